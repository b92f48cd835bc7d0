"""Tune the foundation benchmark shapes, and compare TPE with an exhaustive grid on shape (b) (issue 3).
Prints one JSON line per study; writes results and the winners DB under $OUT. Winners go to the user
DB ($KERNELGEN_CACHE_DIR/tuning.db), so a `kernelgen.bench` run after it on the same machine serves
them. One device call each (a call is limited to 10 minutes):
    source .device/with-site.sh && python3 tools/tune_benchmarks.py --shapes a32k,b,c,c_dense --compare"""
import argparse
import json
import os
import time

from kernelgen.bench import SHAPES
from kernelgen.config import config_space
from kernelgen.db import TuningDB, write_bundled_db
from kernelgen.tune import tune



def main():
    OUT = os.environ.get("OUT", "/tmp/out")
    os.makedirs(OUT, exist_ok=True)
    # studies outlive one call while the machine stays warm ($OUT is emptied before each call): a grid
    # that does not finish in one call resumes in the next
    STUDIES = "/tmp/kg-tune"
    os.makedirs(STUDIES, exist_ok=True)
    db = TuningDB()  # the user DB: what get_kernel serves on this machine
    scratch = TuningDB(os.path.join(STUDIES, "compare.db"))  # the comparison's sub-space winners stay out of it
    results = []

    def run(label, spec, role, shape, trials, storage=None, timeout=280, fixed=None, into=db):
        t0 = time.perf_counter()
        seq = shape.n_k
        # timed on the benchmark's own workload, not the bucket's default inputs
        workload = {"batch": shape.batch, "heads_kv": shape.heads_kv, "n_q": shape.n_q, "n_k": shape.n_k}
        r = tune(spec, role, seq=seq, trials=trials, timeout=timeout, db=into, storage=storage, fixed=fixed,
                 shape=workload)
        wall = time.perf_counter() - t0
        row = dict(label=label, role=role, seq=seq, wall_s=round(wall, 1), default_ms=r.default_ms, best_ms=r.best_ms,
                   n_trials=r.n_trials, n_failed=r.n_failed, config=r.best_config, space=len(config_space(spec, role)),
                   fixed=fixed)
        results.append(row)
        print(json.dumps(row), flush=True)
        # written after every study, so a call stopped by its time limit keeps what it measured
        json.dump(results, open(os.path.join(OUT, "tune_results.json"), "w"), indent=1, default=str)
        write_bundled_db(os.path.join(OUT, "winners.db"), db.rows())
        return r

    args = argparse.ArgumentParser()
    args.add_argument("--shapes", default="a32k,b,c,c_dense")
    args.add_argument("--compare", action="store_true",
                      help="on (b): the exhaustive grid (its winner is b's) against TPE with 30%% of its trials")
    args.add_argument("--select-shapes", default="a32k,b,c", help="shapes whose selector to tune too")
    args.add_argument("--select-trials", type=int, default=8)
    args.add_argument("--backends", default="triton", help="attention backends to tune: triton,tilelang,gluon")
    args = args.parse_args()
    attn_trials = {"a32k": 16, "a128k": 16, "b": 12, "c": 10, "c_dense": 8}  # a32k: the largest space (72)

    for name in filter(None, args.shapes.split(",")):
        s = SHAPES[name]
        if "triton" in args.backends.split(",") and not (args.compare and name == "b"):
            run(f"{name} attn", s.spec("given"), "attn", s, trials=attn_trials[name], timeout=100)
        if "tilelang" in args.backends.split(","):  # a small space: the whole grid
            tl_spec = s.spec("given").replace(backend="tilelang")
            run(f"{name} attn tilelang", tl_spec, "attn", s, trials=len(config_space(tl_spec, "attn")), timeout=150)
        if "gluon" in args.backends.split(","):  # a small space: the whole grid
            gl_spec = s.spec("given").replace(backend="gluon")
            run(f"{name} attn gluon", gl_spec, "attn", s, trials=len(config_space(gl_spec, "attn")), timeout=120)
        if name in args.select_shapes.split(","):
            run(f"{name} select", s.spec("mean"), "select", s, trials=args.select_trials, timeout=90)

    if args.compare:  # TPE against the exhaustive grid over the same (full) space, on shape (b)
        s = SHAPES["b"]
        spec = s.spec("given")
        space = len(config_space(spec, "attn"))
        grid = run("b grid", spec, "attn", s, trials=space, storage=f"sqlite:///{STUDIES}/grid.db", timeout=240)
        tpe = run("b tpe", spec, "attn", s, trials=int(0.3 * space), storage=f"sqlite:///{STUDIES}/tpe.db",
                  timeout=100, into=scratch)
        print(f"grid best {grid.best_ms:.4f} ms over {grid.n_trials} trials ({grid.n_failed} failed); TPE best "
              f"{tpe.best_ms:.4f} ms over {tpe.n_trials} trials ({tpe.n_failed} failed): "
              f"{tpe.best_ms / grid.best_ms - 1:+.1%}")
    print(f"winners: {len(db.rows())} rows -> {OUT}/winners.db (copy to tuning_db/winners.db to bundle)")


# the tuner's worker processes are spawned: they import this file and must not run it
if __name__ == "__main__":
    main()

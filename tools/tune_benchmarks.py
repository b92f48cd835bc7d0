"""Tune the foundation benchmark shapes, and compare TPE with an exhaustive grid on shape (b) (issue 3).
Prints one JSON line per study; writes results and the winners DB under $OUT. Winners go to the user
DB ($KERNELGEN_CACHE_DIR/tuning.db), so a `kernelgen.bench` run after it on the same machine serves
them. One device call each (a call is limited to 10 minutes):
    source .device/with-site.sh && python3 tools/tune_benchmarks.py --shapes a32k,b
    source .device/with-site.sh && python3 tools/tune_benchmarks.py --shapes c,c_dense --compare"""
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

    def run(label, spec, role, seq, trials, storage=None, timeout=280, fixed=None, into=db):
        t0 = time.perf_counter()
        r = tune(spec, role, seq=seq, trials=trials, timeout=timeout, db=into, storage=storage, fixed=fixed)
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
    args.add_argument("--compare", action="store_true", help="TPE (<= 30%% of the trials) against the full grid on (b)")
    args.add_argument("--attn-trials", type=int, default=12)
    args.add_argument("--select-trials", type=int, default=6)
    args = args.parse_args()

    for name in filter(None, args.shapes.split(",")):
        s = SHAPES[name]
        given = s.spec("given")
        run(f"{name} attn", given, "attn", s.n_k, trials=args.attn_trials, timeout=100)
        run(f"{name} select", s.spec("mean"), "select", s.n_k, trials=args.select_trials, timeout=35)

    if args.compare:  # TPE against the exhaustive grid over the same space, on shape (b)
        s = SHAPES["b"]
        spec = s.spec("given")
        # pointer loads: 21 points, small enough for a grid inside one call
        fixed = {"use_tma": False}
        space = len([c for c in config_space(spec, "attn") if not c.use_tma])
        grid = run("b grid", spec, "attn", s.n_k, trials=space, storage=f"sqlite:///{STUDIES}/grid.db", timeout=300,
                   fixed=fixed, into=scratch)
        tpe = run("b tpe", spec, "attn", s.n_k, trials=max(3, int(0.3 * space)), storage=f"sqlite:///{STUDIES}/tpe.db",
                  timeout=120, fixed=fixed, into=scratch)
        print(f"grid best {grid.best_ms:.4f} ms over {grid.n_trials} trials; TPE best {tpe.best_ms:.4f} ms over "
              f"{tpe.n_trials} trials ({tpe.best_ms / grid.best_ms - 1:+.1%})")
    json.dump(results, open(os.path.join(OUT, "tune_results.json"), "w"), indent=1, default=str)
    write_bundled_db(os.path.join(OUT, "winners.db"), db.rows())
    print(f"winners: {len(db.rows())} rows -> {OUT}/winners.db (copy to tuning_db/winners.db to bundle)")


# the tuner's worker processes are spawned: they import this file and must not run it
if __name__ == "__main__":
    main()

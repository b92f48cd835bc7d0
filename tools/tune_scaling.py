"""Maintainers: time one study tuned by 1 GPU and by several, on this machine (`tune(workers=N)`).

    python tools/tune_scaling.py --workers 1,2 --trials 40 --shape a32k --out tune_scaling.json

For each worker count, the benchmark shape's Triton attention study (72 configs on sm_90: TPE, not the
grid) is tuned from nothing: a fresh journal file and a scratch tuning DB in a temporary directory, so no
run resumes another's trials or touches the user DB. The JSON holds, per run, the wall time, the trials
measured, failed, replayed as duplicates and given up (pruned, by reason), the configs each worker
measured, and the best and default times; with the GPU, the versions and the commit. `--device cpu` runs
the interpreter at a tiny size (the plumbing only; its times mean nothing).
"""
from __future__ import annotations

import argparse
import collections
import importlib.metadata as metadata
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch

from kernelgen.tuning import tune
from kernelgen.tuning.db import TuningDB
from kernelgen.tuning.storage import open_storage, parse_storage
from kernelgen.workloads import SHAPES


def run(shape_name: str, trials: int, workers: int, device: str | None) -> dict:
    shape = SHAPES[shape_name]
    workload = {"batch": shape.batch, "heads_kv": shape.heads_kv, "n_q": shape.n_q, "n_k": shape.n_k}
    with tempfile.TemporaryDirectory(prefix="kernelgen-scaling-") as scratch:
        storage = f"journal://{Path(scratch) / 'study.log'}"
        with TuningDB(Path(scratch) / "tuning.db") as db:
            start = time.perf_counter()
            result = tune(shape.spec("given"), "attn", seq=shape.n_k, trials=trials, workers=workers, device=device,
                          storage=storage, db=db, shape=None if device == "cpu" else workload)
            wall_s = time.perf_counter() - start
        study = optuna.load_study(study_name=result.study_name, storage=open_storage(parse_storage(storage)))
        trials_ = study.get_trials(deepcopy=False)
    states = collections.Counter(t.state.name for t in trials_)
    pruned = collections.Counter(t.user_attrs.get("pruned", "?").split(" ")[0] for t in trials_
                                 if t.state.name == "PRUNED")
    measured_by = collections.Counter(t.user_attrs["claimed"] for t in trials_
                                      if "claimed" in t.user_attrs and "duplicate_of" not in t.user_attrs)
    return {
        "workers": workers,
        "wall_s": round(wall_s, 2),
        "trials_measured": result.n_trials,
        "trials_failed": result.n_failed,
        "trials_duplicate": sum("duplicate_of" in t.user_attrs for t in trials_),
        "trials_pruned": dict(pruned),
        "trial_states": dict(states),
        "measured_by_worker": dict(measured_by),
        "best_ms": result.best_ms,
        "default_ms": result.default_ms,
        "best_config": result.best_config,
        "study_name": result.study_name,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts, run in this order")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--shape", default="a32k", choices=[n for n in SHAPES if n != "tiny"])
    parser.add_argument("--device", default=None, help="cpu: the interpreter at a tiny size (plumbing only)")
    parser.add_argument("--out", default="tune_scaling.json")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("tune_scaling.py tunes on CUDA GPUs: it needs one (--device cpu runs the interpreter at a tiny "
                 "size, the plumbing only)")
    shape = "tiny" if args.device == "cpu" else args.shape
    runs = []
    for workers in (int(n) for n in args.workers.split(",")):
        runs.append(run(shape, args.trials, workers, args.device))
        print(json.dumps(runs[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus_visible": torch.cuda.device_count(),
        "versions": {name: metadata.version(name) for name in ("kernelgen", "torch", "triton", "optuna")},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "shape": shape,
        "trials": args.trials,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

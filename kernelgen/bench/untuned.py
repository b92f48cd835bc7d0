"""Shapes nobody tuned: what `get_kernel` serves before any tuning, against what a tune then reaches.

For each shape (default: `kernelgen.workloads.UNTUNED_SHAPES`, which the bundled DB does not hold), in
one process on one GPU, with a scratch user DB (the bundled DB is read as usual):
1. `backend="auto"` with given lists is timed as served: the spec's own bundled winner, else the
   nearest tuned spec's, else the measured rule's backend with its defaults;
2. every backend's attention is tuned for the shape's workload, as `kernelgen tune --preset bench
   --shapes NAME` does (`kernelgen.tuning.presets`), into the scratch DB;
3. `auto` is timed again, now served the tuned winners.
The row's `untuned_vs_tuned` is tuned ms / untuned ms: the share of the tuned speed served untuned.

    kernelgen bench --untuned [--shapes dense16k_d128,c_g8] [--out DIR]
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from .. import backends
from ..device import device_arch
from ..dispatch import SparseAttention
from ..errors import KernelgenRuntimeError
from ..workloads import SHAPES, UNTUNED_SHAPES, useful_flops
from .measure import _bench, _config_json, _dump_rows

__all__ = ["run_untuned"]


def _served_time(shape, given, q, k, v, idx, device, dtype):
    attn = SparseAttention(given.replace(backend=backends.AUTO))  # a fresh instance: reads the DBs anew
    served = attn.served("attn", shape.n_k, dtype, device)
    lists = attn.prepare(idx, shape.n_q, shape.n_k)
    ms = _bench(lambda: attn(q, k, v, block_idx=lists))
    return ms, dict(backend=served.backend.name, config=_config_json(served.config), source=served.source)


def run_untuned(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows (one per shape) of untuned and tuned times; with `out_dir`, also untuned.json there."""
    from ..tuning import lookup, presets, tune
    from ..tuning.db import TuningDB

    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("bench --untuned needs a CUDA GPU: it times and tunes kernels")
    names = list(shape_names or UNTUNED_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    scratch = tempfile.mkdtemp(prefix="kernelgen-untuned-")
    os.environ["KERNELGEN_CACHE_DIR"] = scratch  # tunes write here; kernels and studies are cached here
    lookup._winners.cache_clear()
    db = TuningDB(os.path.join(scratch, "tuning.db"))
    rows = []
    for name in names:
        shape = SHAPES[name]
        given = shape.spec("given")
        q, k, v = shape.inputs(device, dtype)
        idx = SparseAttention(shape.spec("mean")).select(q, k)
        flops = useful_flops(idx, given, shape.n_q, shape.n_k)
        untuned_ms, untuned = _served_time(shape, given, q, k, v, idx, device, dtype)
        log(f"{name:14s} untuned {untuned_ms:8.3f} ms {flops / untuned_ms / 1e9:6.1f} TFLOP/s  "
            f"{untuned['backend']} {untuned['config']} ({untuned['source']})")
        t0 = time.perf_counter()
        for study in presets.studies("bench", device_arch(device), [name]):
            if study.role != "attn" or backends.get(study.spec.backend).unsupported(study.spec, device):
                continue
            result = tune(study.spec, "attn", seq=study.seq, trials=study.trials, shape=study.shape, db=db)
            log(f"{'':14s} tuned {study.spec.backend:8s} {result.best_ms or float('nan'):8.3f} ms "
                f"(default {result.default_ms or float('nan'):.3f}; {result.n_trials} trials)")
        tuned_ms, tuned = _served_time(shape, given, q, k, v, idx, device, dtype)
        ratio = tuned_ms / untuned_ms
        log(f"{name:14s} tuned   {tuned_ms:8.3f} ms {flops / tuned_ms / 1e9:6.1f} TFLOP/s  {tuned['backend']} "
            f"{tuned['config']} ({tuned['source']}); untuned reaches {ratio:.1%} of it "
            f"[tuning {time.perf_counter() - t0:.0f} s]")
        rows.append(dict(shape=name, untuned_ms=untuned_ms, untuned_tflops=flops / untuned_ms / 1e9,
                         untuned=untuned, tuned_ms=tuned_ms, tuned_tflops=flops / tuned_ms / 1e9, tuned=tuned,
                         untuned_vs_tuned=ratio))
        _dump_rows(rows, out_dir, "untuned.json")
        del q, k, v, idx
        torch.cuda.empty_cache()
    db.close()
    return rows

"""`kernelgen bench`: kernelgen side by side with the attention kernels it is weighed against.

For each benchmark shape (`kernelgen.workloads.SHAPES`) the bench times, on one GPU in one process:

- kernelgen on the `mean` selector's lists: the served kernel given the lists, the backend that
  `backend="auto"` serves (with the tuning DB's winner) when it differs, the same with the lists
  prepared once, the backend's defaults when a tuned config is served, the whole `mean` pipeline
  (selection and attention, with its peak extra memory), selection alone, and every other registered
  backend that can serve the shape here (each one that cannot is skipped, with its reason);
- FlexAttention (torch.compile'd) over a BlockMask holding exactly the same lists (`anchors`);
- dense SDPA on cuDNN and on flash (all visible pairs).

Times are `triton.testing.do_bench` medians (L2 cleared before each call); graph_ms is the median of
the same call replayed from a CUDA graph, which leaves the host's launch cost out. Useful TFLOP/s count
4 * D * (visible query-key pairs inside the listed blocks) over batch and query heads
(`kernelgen.workloads`, docs/SEMANTICS.md); the dense anchors count every visible pair. Rows record
which backend served and where its config came from (pinned, user DB, bundled DB or default).

Without a CUDA GPU only the "tiny" shape runs, in Triton's interpreter: a correctness smoke run (every
implementation that runs on the CPU checked against the float64 reference), no timings.

    from kernelgen import bench
    bench.main(shapes="a32k,b", out="bench-out")   # rows to bench-out/bench.{jsonl,csv,json}
    bench.plot("bench-out")                          # bench-out/bench.png (needs matplotlib)

Modules: `measure` (the measurements, the dispatch overhead, the stall watchdog), `anchors` (FlexAttention's
BlockMask, SDPA), `plot`.
"""
from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Iterable

import torch

from ..device import interpreting
from ..errors import KernelgenValueError
from ..workloads import BENCH_SHAPES, SHAPES
from .plot import plot
from . import measure
from .measure import dispatch_overhead, run, stall_guard

__all__ = ["main", "run", "plot", "dispatch_overhead", "stall_guard", "SMOKE_SHAPE", "NO_GPU_MESSAGE",
           "NO_INTERPRETER_MESSAGE"]

SMOKE_SHAPE = "tiny"  # the one shape the Triton interpreter runs
NO_GPU_MESSAGE = "No CUDA GPU: running the Triton interpreter at a tiny size (correctness smoke run, no timings)."
NO_INTERPRETER_MESSAGE = ("no CUDA GPU here, and TRITON_INTERPRET=0 turns off the Triton interpreter that runs kernels "
                          "on the CPU: unset TRITON_INTERPRET (kernelgen then sets it to 1) or set it to 1")


def _names(value: str | Iterable[str] | None, what: str, known=SHAPES) -> list[str] | None:
    """Shape names from "a,b" or a sequence; names not in `known` are an error naming them and the known ones."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n).strip() for n in value]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KernelgenValueError(f"unknown {what} {', '.join(repr(n) for n in unknown)}; known shapes: "
                                  f"{', '.join(known)}")
    return names


def main(shapes: str | Iterable[str] | None = None, out: str | os.PathLike | None = None, overhead: bool = False,
         sweep: str | Iterable[str] = "", profile: str | Iterable[str] = "", graph: bool = True,
         stall_timeout: float = 600.0) -> int:
    """Run the bench; returns 0 (the exit status).

    shapes         shape names ("a32k,b" or a list); default: every GPU shape on a GPU
    out            directory for bench.jsonl, bench.csv and bench.json (and dispatch.json), rewritten each run
                   (JSON: null where a value is NaN); None: none
    overhead       also measure the dispatch overhead of one call (GPU only)
    sweep          shapes on which to also time every attention and select config
    profile        shapes whose `mean` pipeline to profile (CUDA time per kernel)
    graph          also time each row replayed from a CUDA graph (graph_ms)
    stall_timeout  seconds without a logged line after which every thread's stack goes to stderr and
                   the process exits with status 1 (a kernel that hangs the GPU); 0: never

    Unknown shape names raise KernelgenValueError. Without a CUDA GPU only the smoke shape runs (in the
    interpreter), whatever `shapes` says; the others are reported as skipped."""
    names = _names(shapes, "bench shapes")
    if names == []:
        raise KernelgenValueError(f"no bench shape named in {shapes!r}; known shapes: {', '.join(SHAPES)}")
    if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, (int, float)) \
            or not 0 <= stall_timeout <= threading.TIMEOUT_MAX:  # faulthandler's limit
        raise KernelgenValueError(f"stall_timeout must be a number of seconds >= 0 (0: never), got {stall_timeout!r}")
    sweep_names = tuple(_names(sweep, "sweep shapes") or ())
    profile_names = tuple(_names(profile, "profile shapes") or ())
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not interpreting():
        raise KernelgenValueError(NO_INTERPRETER_MESSAGE)
    if not on_gpu:
        print(NO_GPU_MESSAGE)
        skipped = [n for n in names or () if n != SMOKE_SHAPE]
        if skipped:
            print(f"shapes {', '.join(skipped)} need a CUDA GPU: skipped.")
        if sweep_names or profile_names:
            print("config sweeps and profiles need a CUDA GPU: skipped.")
        names = [SMOKE_SHAPE]
    else:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        if names is None:
            names = list(BENCH_SHAPES)
    log = stall_guard(stall_timeout)
    try:
        if overhead:
            if on_gpu:
                result = dispatch_overhead(log=log)
                if out:
                    os.makedirs(out, exist_ok=True)
                    measure.dump_json(result, os.path.join(out, "dispatch.json"))
            else:
                log("dispatch overhead needs a CUDA GPU: skipped.")
        measure.run(names, out, sweep_names, log=log, profile=profile_names, graph=graph)  # patchable
    finally:
        faulthandler.cancel_dump_traceback_later()  # the guard ends with the bench
    return 0

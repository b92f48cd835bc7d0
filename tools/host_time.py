"""Maintainers: the host's time to enqueue one eager call, on a CUDA GPU (what docs/PERF.md's "The host's share of
an eager call" reports).

Each call is timed as `kernelgen bench`'s `host_ms` times one: the GPU synchronised before it, not after, the median
of 300 calls (100 for a32k). The calls: a decode step at dec_c32k's shape over a cache of per-row lengths (the kept
reps grown, then select and decode), the same call with the reps kept, without them, over given lists and writing its
token (`k_new=`); a32k's forward over prepared lists and its forward and backward; bench --chunked's mixed_32k serving
step (`attn.varlen` over a paged cache, rows of four query counts). Where the kernelgen imported has
`backends/triton_launch.py`, each call is timed twice: launched directly, then through Triton's own launch path.

    python tools/host_time.py [--out rows.json]             # this tree's kernelgen
    python tools/host_time.py --base DIR                    # another tree's, e.g. an earlier commit:
        mkdir DIR && git archive COMMIT kernelgen templates tuning_db | tar -x -C DIR
    python tools/host_time.py --launch                      # one Triton kernel of 28 arguments, by piece
    python tools/host_time.py --only "serving step"         # the calls whose name holds the text
    python tools/host_time.py --profile "serving step"      # cProfile of those calls

--launch times one launch of a kernel of 8 pointers, 20 ints and 2 constexprs through `kernel[grid](...)`, Triton's
binder alone, the compiled kernel's launcher called directly, and a specialization key built in Python.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _median_us(fn, n: int, sync) -> float:
    times = []
    for _ in range(n):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e6


def launch_pieces() -> dict:
    """Host µs of one launch of a 28-argument kernel, whole and by piece (back to back, synchronised every 200)."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import driver

    @triton.jit
    def kernel(p0, p1, p2, p3, p4, p5, p6, p7, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14,
               i15, i16, i17, i18, i19, C0: tl.constexpr, C1: tl.constexpr):
        if tl.program_id(0) < 0:
            tl.store(p0 + i0, 0.0)

    def median(fn, n=3000):
        times = []
        for i in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            if i % 200 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    args = [torch.empty(1024, device="cuda") for _ in range(8)] + [4096 * (j + 1) for j in range(20)]
    compiled = kernel[(1, 1, 1)](*args, C0=64, C1=True, num_warps=4)
    device = driver.active.get_current_device()
    binder = kernel.device_caches[device][4]
    bound = binder(*args, C0=64, C1=True, num_warps=4)[0]
    values, stream = tuple(bound.values()), driver.active.get_current_stream(device)
    return {
        "triton_launch_us": median(lambda: kernel[(1, 1, 1)](*args, C0=64, C1=True, num_warps=4)),
        "binder_us": median(lambda: binder(*args, C0=64, C1=True, num_warps=4)),
        "compiled_launcher_us": median(lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                            compiled.packed_metadata, None, None, None, *values)),
        "python_key_us": median(lambda: tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                                              else (a == 1, a % 16 == 0, -2**31 <= a < 2**31) for a in args)),
        "torch_empty_us": median(lambda: torch.empty(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)),
    }


def calls() -> dict:
    """The timed calls, their inputs made and every kernel compiled."""
    import torch

    import kernelgen
    from kernelgen.bench.chunked import SPEC as MIXED_SPEC
    from kernelgen.bench.chunked import mixed_step
    from kernelgen.workloads import SHAPES

    batch, heads_q, heads_kv, n, head_dim = 8, 32, 8, 32768, 128  # dec_c32k
    spec = kernelgen.Spec(head_dim=head_dim, kv_block=128, q_tile=64, top_k=16, causal=True,
                          gqa_group=heads_q // heads_kv, backend="auto")
    attn = kernelgen.get_kernel(spec)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, heads_q, 1, head_dim, **bf16)
    k, v = (torch.randn(batch, heads_kv, n, head_dim, **bf16) for _ in range(2))
    token = torch.randn(batch, heads_kv, 1, head_dim, **bf16)
    lens = torch.full((batch,), n - 1, dtype=torch.int32, device="cuda")
    reps = attn.key_reps(k, cache_seqlens=lens)
    lists = attn.select(q, k, cache_seqlens=lens)

    def step():
        attn.key_reps(k, cache_seqlens=lens, previous=reps)
        return attn(q, k, v, cache_seqlens=lens, key_reps=reps)

    mixed = mixed_step()
    serving = kernelgen.get_kernel(MIXED_SPEC.replace(backend="auto"))
    mixed_reps = serving.key_reps(mixed.k_pages, cache_seqlens=mixed.lens, block_table=mixed.table)

    a = SHAPES["a32k"]
    attn_a = kernelgen.get_kernel(a.spec("mean").replace(backend="auto"))
    qa, ka, va = a.inputs()
    with torch.no_grad():
        lists_a = attn_a.prepare(attn_a.select(qa, ka), qa.shape[2], ka.shape[2])
    leaves = [x.detach().requires_grad_() for x in (qa, ka, va)]
    grad = torch.randn_like(qa)
    return {
        "decode step: reps grown, select, decode": step,
        "the same, writing its token (k_new=)": lambda: attn(q, k, v, cache_seqlens=lens - 1, key_reps=reps,
                                                              k_new=token, v_new=token),
        "select + decode, reps kept": lambda: attn(q, k, v, cache_seqlens=lens, key_reps=reps),
        "select + decode": lambda: attn(q, k, v, cache_seqlens=lens),
        "decode over given lists": lambda: attn(q, k, v, cache_seqlens=lens, block_idx=lists),
        "a32k forward, prepared lists": lambda: attn_a(qa, ka, va, block_idx=lists_a),
        "a32k forward + backward": lambda: attn_a(*leaves, block_idx=lists_a).backward(grad),
        "serving step, varlen over a paged cache": lambda: serving.varlen(
            mixed.packed, mixed.k_pages, mixed.v_pages, mixed.bounds, cache_seqlens=mixed.lens, block_table=mixed.table,
            key_reps=mixed_reps),
    }


def profile(text: str) -> int:
    import cProfile
    import pstats

    import torch

    chosen = {name: fn for name, fn in calls().items() if text in name}
    if not chosen:
        print(f"no call's name holds {text!r}", file=sys.stderr)
        return 2
    for name, fn in chosen.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"== {name}: 200 calls")
        for order in ("tottime", "cumtime"):
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(35)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a directory holding another tree's kernelgen/, templates/ and tuning_db/")
    parser.add_argument("--launch", action="store_true", help="time one Triton launch by piece instead")
    parser.add_argument("--out", help="also write the rows to this JSON file")
    parser.add_argument("--only", metavar="TEXT", help="time only the calls whose name holds TEXT")
    parser.add_argument("--profile", metavar="TEXT", help="instead, profile (cProfile, 200 calls) each call whose "
                        "name holds TEXT and print its top functions by own and by cumulative time")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tools/host_time.py times calls on a CUDA GPU: none is visible here", file=sys.stderr)
        return 2
    if args.base:
        sys.path.insert(0, os.path.abspath(args.base))
    if args.launch:
        rows = launch_pieces()
    elif args.profile:
        return profile(args.profile)
    else:
        import kernelgen

        print(f"kernelgen from {os.path.dirname(kernelgen.__file__)}", file=sys.stderr)
        try:
            from kernelgen.backends import triton_launch
        except ImportError:  # a tree before kernels launched directly
            triton_launch = None
        timed = {name: fn for name, fn in calls().items() if args.only is None or args.only in name}
        paths = [("launched directly", None)] if triton_launch else [("", None)]
        if triton_launch:
            paths.append(("Triton's own launch path", object()))  # no run is this: every call takes Triton's
        rows = {}
        for path, run in paths:
            if run is not None:
                triton_launch._TRITON_RUN = run
            for name, fn in timed.items():
                for _ in range(5):
                    fn()
                label = f"{name}, {path}" if path else name
                rows[label] = round(_median_us(fn, 100 if name.startswith("a32k") else 300, torch.cuda.synchronize),
                                    1)
    for name, value in rows.items():
        print(f"{name:60s} {value:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

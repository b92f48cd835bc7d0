"""kernelgen quickstart: build a Spec, select blocks, run sparse attention, check it, time it.

    python examples/quickstart.py            # GPU: N=32768 bf16, timed against dense SDPA
                                             # CPU: Triton interpreter, N=2048 fp16, correctness only
    python examples/quickstart.py --n 8192 --heads-kv 4

On a CUDA GPU the kernels are compiled by Triton and timed with `triton.testing.do_bench` (median).
Without one, kernelgen runs them in Triton's CPU interpreter, which is slow, so the example falls back to
a small size and only checks the result against the float64 reference (`kernelgen.reference`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import kernelgen  # sets TRITON_INTERPRET=1 by itself when there is no CUDA device
from kernelgen import Spec, reference

# The spec of the example: D=128, 64-key blocks, 64-query tiles, 16 blocks per list (forced diagonal block
# included), causal, GQA group 4, blocks chosen by mean-pooled q.k scores, 1 local block.
SPEC = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="mean", local=1)

REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}  # as tests/checks.py


def rel_error(o: torch.Tensor, ref: torch.Tensor) -> float:
    return ((o.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def check(q, k, v, o, lse, idx, spec, heads_kv_checked: int) -> float:
    """Relative L2 error of `o` against the float64 reference over the same block lists, on the first
    `heads_kv_checked` KV heads (and their query heads): the reference is dense and slow."""
    hq = heads_kv_checked * spec.gqa_group
    ref_o, ref_lse, _ = reference.sparse_attention(
        q[:, :hq], k[:, :heads_kv_checked], v[:, :heads_kv_checked], spec, block_idx=idx[:, :heads_kv_checked]
    )
    assert not torch.isnan(o).any(), "output has NaN"
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[:, :hq].double()[finite] - ref_lse[finite]).abs().max().item()
    print(f"  lse max-abs error vs reference: {lse_err:.2e}")
    return rel_error(o[:, :hq], ref_o)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="sequence length (GPU default 32768, CPU default 2048)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads-kv", type=int, default=None, help="KV heads (GPU default 8, CPU default 1); Hq = 4 * this")
    args = p.parse_args(argv)
    for name in ("n", "batch", "heads_kv"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    spec = SPEC
    if on_gpu:
        device, dtype = "cuda", torch.bfloat16
        n = args.n or 32768
        hkv = args.heads_kv or 8
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    else:
        device, dtype = "cpu", torch.float16
        n = args.n or 2048
        hkv = args.heads_kv or 1
        print(f"No CUDA GPU: falling back to the Triton CPU interpreter at a small size (N={n}, float16); "
              "it checks correctness only, timings on the CPU mean nothing.")
    b, hq = args.batch, hkv * spec.gqa_group
    print(f"spec: {spec}")
    print(f"q [{b}, {hq}, {n}, {spec.head_dim}], k/v [{b}, {hkv}, {n}, {spec.head_dim}], {dtype}, {device}")
    budget = spec.top_k * spec.kv_block
    print(f"each query attends to at most {min(budget, n)} keys (top_k * kv_block = {budget}, N = {n}: "
          f"{spec.n_kv_blocks(n)} KV blocks of {spec.kv_block}; {min(1.0, budget / n):.1%} of N)")

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, n, spec.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, hkv, n, spec.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, n, spec.head_dim, device=device, dtype=dtype, generator=gen)

    attn = kernelgen.get_kernel(spec)  # renders and loads the kernels once per spec

    t0 = time.perf_counter()
    o, lse = attn(q, k, v, return_lse=True)  # select with the spec's selector, then attend
    if on_gpu:
        torch.cuda.synchronize()
    first = "first call: includes compilation" if on_gpu else "interpreted: no compilation, each call as slow"
    print(f"attn(q, k, v) ran in {time.perf_counter() - t0:.1f} s ({first})")
    # The lists the call used (selection is deterministic). attn(q, k, v, block_idx=idx) attends over
    # lists of your own: int32 [B, Hkv, n_q_tiles, top_k], block ids, -1 for an empty slot.
    idx = attn.select(q, k)
    print(f"attn.select(q, k) -> block lists {tuple(idx.shape)}")
    print(f"  tile 0    -> {idx[0, 0, 0].tolist()}")
    print(f"  last tile -> {idx[0, 0, -1].tolist()}")

    heads_checked = 1 if on_gpu else hkv  # the float64 reference is dense: one KV head group on the GPU
    err = check(q, k, v, o, lse, idx, spec, heads_checked)
    tol = REL_TOL[dtype]
    ok = err < tol
    print(f"  relative L2 error vs kernelgen.reference (float64): {err:.2e} (tolerance {tol:.0e}) "
          f"-> {'OK' if ok else 'FAILED'}")

    if on_gpu:
        import triton

        from kernelgen.workloads import useful_flops

        def bench(fn) -> float:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        kd = k.repeat_interleave(spec.gqa_group, 1)
        vd = v.repeat_interleave(spec.gqa_group, 1)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True)  # noqa: E731
        flops = useful_flops(idx, spec, n, n)
        rows = [
            ("kernelgen select + attention", bench(lambda: attn(q, k, v)), flops),
            ("kernelgen select only", bench(lambda: attn.select(q, k)), 0.0),
            ("kernelgen attention, given lists", bench(lambda: attn(q, k, v, block_idx=idx)), flops),
            ("SDPA dense causal", bench(sdpa), None),
        ]
        dense_ms = rows[-1][1]
        print("timings (triton.testing.do_bench, median):")
        for name, ms, fl in rows:
            tflops = f"{fl / ms / 1e9:6.1f} useful TFLOP/s" if fl else " " * 22
            print(f"  {name:34s} {ms:8.3f} ms  {tflops}  {dense_ms / ms:5.2f}x vs dense SDPA")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

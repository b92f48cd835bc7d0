"""GPU check of the TileLang Q-centric forward: correctness against the float64 reference on the
lists kernelgen's Triton selector picks, and time next to the Triton kernel and FlexAttention.
Run on the H200:  python3 tools/tilelang_gpu_check.py"""
import math
import sys

import torch
import triton

import kernelgen
from kernelgen import reference
from kernelgen.bench import SHAPES, useful_flops
from kernelgen.tilelang_backend import build_attn, compile_kernel

CASES = [  # (shape name or tuple, block_M, threads, num_stages)
    ("small_causal", (1, 8, 2, 4096, 4096, 128, 64, 64, 16, True), 128, 256, 2),
    ("small_nc_d64", (1, 2, 2, 4096, 4096, 64, 64, 64, 16, False), 64, 128, 2),
    ("a32k", None, 64, 128, 2),
    ("a32k", None, 128, 256, 2),
    ("b", None, 128, 256, 2),
    ("c", None, 128, 256, 2),
    ("c_dense", None, 128, 256, 2),
]


def main():
    for name, shape_tuple, block_m, threads, stages in CASES:
        if shape_tuple is None:
            s = SHAPES[name]
            b, hq, hkv, nq, nk, d, kvb, qt, top_k, causal = (s.batch, s.heads_q, s.heads_kv, s.n_q, s.n_k, s.head_dim,
                                                            s.kv_block, s.q_tile, s.top_k, s.causal)
        else:
            b, hq, hkv, nq, nk, d, kvb, qt, top_k, causal = shape_tuple
        g = hq // hkv
        spec = kernelgen.Spec(head_dim=d, kv_block=kvb, q_tile=qt, top_k=top_k, causal=causal, gqa_group=g)
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16)
        attn = kernelgen.get_kernel(spec)
        idx = attn.select(q, k)
        try:
            bm = min(block_m, g * qt)
            func = build_attn(batch=b, heads_q=hq, heads_kv=hkv, seq_q=nq, seq_k=nk, head_dim=d, kv_block=kvb,
                              q_tile=qt, top_k=top_k, causal=causal, dtype="bfloat16", block_M=bm,
                              num_stages=stages, threads=threads if bm >= 128 else 128)
            kern = compile_kernel(func)
            scale = 1.0 / math.sqrt(d)
            o, lse = kern(q, k, v, idx, scale)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"{name:14s} bm={block_m} thr={threads}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        ro = None
        if nq * nk <= 4096 * 4096:  # the reference is dense float64: check the small cases
            ro, rlse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
            rel = ((o.double() - ro).norm() / ro.norm()).item()
            mx = (o.double() - ro).abs().max().item()
            inf_ok = torch.equal(torch.isinf(lse), torch.isinf(rlse))
            nan = bool(torch.isnan(o).any())
        else:
            rel = mx = float("nan"); inf_ok = nan = None
        flops = useful_flops(idx, spec, nq, nk)
        ms_tl = triton.testing.do_bench(lambda: kern(q, k, v, idx, scale), return_mode="median")
        given = kernelgen.get_kernel(spec.replace(selector="given"))
        ms_tr = triton.testing.do_bench(lambda: given(q, k, v, block_idx=idx), return_mode="median")
        print(f"{name:14s} bm={bm} thr={threads} st={stages} rel={rel:.2e} maxabs={mx:.2e} inf_ok={inf_ok} nan={nan} "
              f"tilelang {ms_tl:.3f} ms ({flops / ms_tl / 1e9:.0f} TF/s)  triton {ms_tr:.3f} ms ({flops / ms_tr / 1e9:.0f} TF/s)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

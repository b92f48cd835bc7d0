"""Workloads measured in numbers: the benchmark shapes, and the useful-FLOP count every TFLOP/s figure
uses (bench and tuning alike).

Useful FLOPs: 4 * D * (visible (query, key) pairs inside the listed blocks), summed over batch and query
heads (docs/SEMANTICS.md); selection and softmax work are not counted. Dense anchors count every visible
pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import Spec

__all__ = ["BenchShape", "SHAPES", "BENCH_SHAPES", "UNTUNED_SHAPES", "visible_pairs", "useful_flops", "dense_flops"]


@dataclass(frozen=True)
class BenchShape:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    kv_block: int
    q_tile: int
    top_k: int
    causal: bool

    def inputs(self, device="cuda", dtype=torch.bfloat16, seed=0):
        """q, k, v of this shape: randn from one generator seeded `seed` on `device`, in that order."""
        gen = torch.Generator(device=device).manual_seed(seed)
        return [torch.randn(self.batch, h, n, self.head_dim, device=device, dtype=dtype, generator=gen)
                for h, n in ((self.heads_q, self.n_q), (self.heads_kv, self.n_k), (self.heads_kv, self.n_k))]

    def spec(self, selector="mean"):
        return Spec(head_dim=self.head_dim, kv_block=self.kv_block, q_tile=self.q_tile, top_k=self.top_k,
                    causal=self.causal, gqa_group=self.heads_q // self.heads_kv, selector=selector)


SHAPES = {
    s.name: s
    for s in [
        BenchShape("a32k", 1, 8, 8, 32768, 32768, 64, 64, 64, 16, False),
        BenchShape("a128k", 1, 8, 8, 131072, 131072, 64, 64, 64, 16, False),
        BenchShape("b", 2, 16, 1, 4096, 16384, 128, 128, 128, 16, False),
        BenchShape("c", 1, 32, 8, 32768, 32768, 128, 128, 128, 16, True),
        BenchShape("c_dense", 1, 32, 8, 32768, 32768, 128, 128, 128, 256, True),
        # the backward's b-like shape: (b) with as many queries as keys
        BenchShape("b16k", 2, 16, 1, 16384, 16384, 128, 128, 128, 16, False),
        # shapes the bundled DB does not hold: `kernelgen bench --untuned` weighs what is served untuned
        # against what a tune then reaches
        BenchShape("dense16k_d128", 1, 16, 16, 16384, 16384, 128, 128, 128, 128, False),
        BenchShape("dense16k_d64", 1, 16, 16, 16384, 16384, 64, 128, 128, 128, False),
        BenchShape("c_g8", 1, 32, 4, 32768, 32768, 128, 128, 128, 16, True),
        BenchShape("c_g1", 1, 32, 32, 32768, 32768, 128, 128, 128, 16, True),
        BenchShape("a64k_top32", 1, 8, 8, 65536, 65536, 64, 64, 64, 32, False),
        BenchShape("b_q8k", 2, 16, 1, 8192, 16384, 128, 128, 128, 16, False),
        # the CPU smoke size (interpreter)
        BenchShape("tiny", 1, 2, 1, 256, 256, 64, 64, 64, 2, True),
    ]
}
BENCH_SHAPES = ("a32k", "a128k", "b", "c", "c_dense")  # `kernelgen bench`'s default: the tuned benchmark
UNTUNED_SHAPES = ("dense16k_d128", "dense16k_d64", "c_g8", "c_g1", "a64k_top32", "b_q8k")


def visible_pairs(block_idx: torch.Tensor, spec: Spec, n_q: int, n_k: int) -> torch.Tensor:
    """Visible (query, key) pairs inside the listed blocks, per (batch, KV head): int64 [B, Hkv]. Empty,
    out-of-range and repeated ids count as the kernels treat them: not at all, and once."""
    n_blocks = spec.n_kv_blocks(n_k)
    idx = block_idx.long().sort(-1).values
    valid = (idx >= 0) & (idx < n_blocks)
    valid[..., 1:] &= idx[..., 1:] != idx[..., :-1]  # a repeated id is one block, attended once
    start = idx.clamp(0, n_blocks - 1) * spec.kv_block
    end = torch.clamp(start + spec.kv_block, max=n_k)
    tiles = torch.arange(block_idx.shape[2], device=idx.device)
    per_list = spec.list_queries  # queries that share a list: q_tile, or 1 for per-query lists
    q = tiles[:, None] * per_list + torch.arange(per_list, device=idx.device)[None, :]  # [T, per_list]
    q_ok = q < n_q
    if spec.causal:
        last = q + (n_k - n_q)  # last visible key of each query
        seen = (torch.minimum(end[..., None], last[None, None, :, None, :] + 1) - start[..., None]).clamp(min=0)
    else:
        seen = (end - start)[..., None].expand(*idx.shape, per_list)
    seen = seen * q_ok[None, None, :, None, :] * valid[..., None]
    return seen.sum(dim=(2, 3, 4))


def useful_flops(block_idx: torch.Tensor, spec: Spec, n_q: int, n_k: int) -> float:
    """4 * D * (visible query-key pairs inside the listed blocks), over batch and query heads."""
    return 4.0 * spec.head_dim * spec.gqa_group * float(visible_pairs(block_idx, spec, n_q, n_k).sum())


def dense_flops(shape: BenchShape) -> float:
    if shape.causal:
        pairs = sum(max(0, min(shape.n_k, i + 1 + shape.n_k - shape.n_q)) for i in range(shape.n_q))
    else:
        pairs = shape.n_q * shape.n_k
    return 4.0 * shape.head_dim * shape.batch * shape.heads_q * pairs

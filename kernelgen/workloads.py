"""Workloads measured in numbers: the benchmark shapes, and the useful-FLOP count every TFLOP/s figure
uses (bench and tuning alike).

Useful FLOPs: 4 * D * (visible (query, key) pairs inside the listed blocks), summed over batch and query
heads (docs/SEMANTICS.md); selection and softmax work are not counted. Dense anchors count every visible
pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KernelgenValueError

from .spec import DEFAULT_Q_TILE, Spec

__all__ = ["BenchShape", "SHAPES", "BENCH_SHAPES", "UNTUNED_SHAPES", "KV_CENTRIC_SHAPES", "DECODE_SHAPES",
           "WINDOW_SHAPES", "SOFTCAP_SHAPES", "random_query_lists", "agreeing_query_lists", "visible_pairs",
           "useful_flops", "dense_flops"]


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
    schedule: str = "q_centric"  # "kv_centric": per-query lists (q_tile unused, at Spec's default)
    window: int | None = None  # a sliding window (`kernelgen bench --window`); top_k is then its block count
    softcap: float | None = None  # logit soft-capping (`kernelgen bench --softcap`)

    def inputs(self, device="cuda", dtype=torch.bfloat16, seed=0):
        """q, k, v of this shape: randn from one generator seeded `seed` on `device`, in that order."""
        gen = torch.Generator(device=device).manual_seed(seed)
        return [torch.randn(self.batch, h, n, self.head_dim, device=device, dtype=dtype, generator=gen)
                for h, n in ((self.heads_q, self.n_q), (self.heads_kv, self.n_k), (self.heads_kv, self.n_k))]

    def spec(self, selector="mean"):
        return Spec(head_dim=self.head_dim, kv_block=self.kv_block, q_tile=self.q_tile, top_k=self.top_k,
                    causal=self.causal, gqa_group=self.heads_q // self.heads_kv, selector=selector,
                    schedule=self.schedule, window=self.window, softcap=self.softcap)

    def query_lists(self, device="cuda", seed=0) -> torch.Tensor:
        """Random per-query lists of this (KV-centric) shape: `random_query_lists` of its given spec."""
        return random_query_lists(self.spec("given"), self.batch, self.heads_kv, self.n_q, self.n_k, device, seed)


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
        # (c) at Phi-3's head dim, which the Triton kernels pad to 128
        BenchShape("c_d96", 1, 32, 8, 32768, 32768, 96, 128, 128, 16, True),
        # the CPU smoke size (interpreter)
        BenchShape("tiny", 1, 2, 1, 256, 256, 64, 64, 64, 2, True),
    ]
}
BENCH_SHAPES = ("a32k", "a128k", "b", "c", "c_dense")  # `kernelgen bench`'s default: the tuned benchmark

# `kernelgen bench --kv-centric`: per-query lists (random, causal-visible) against FlexAttention, SDPA and
# fla-core's NSA kernels. Not in SHAPES: the Q-centric bench cannot run per-query lists.
KV_CENTRIC_SHAPES = {
    s.name: s
    for s in [
        # 16 of 32 128-key blocks per query, non-causal
        BenchShape("kv_b8", 8, 16, 1, 4096, 4096, 128, 128, DEFAULT_Q_TILE, 16, False, "kv_centric"),
        # NSA's selected-attention shape
        BenchShape("kv_nsa32k", 1, 64, 4, 32768, 32768, 128, 64, DEFAULT_Q_TILE, 16, True, "kv_centric"),
        BenchShape("kv_d64_64k", 1, 16, 1, 65536, 65536, 64, 64, DEFAULT_Q_TILE, 16, True, "kv_centric"),
    ]
}
# `kernelgen bench --decode`: a few queries against a long KV cache (the `decode` role), Q-centric lists.
DECODE_SHAPES = {
    s.name: s
    for s in [
        # a Llama-3-8B-like layer (Hq32 Hkv8 D128) over a 32k cache, a batch of 8 sequences
        BenchShape("dec_c32k", 8, 32, 8, 1, 32768, 128, 128, DEFAULT_Q_TILE, 16, True),
        # the same layer at 128k
        BenchShape("dec_c128k", 2, 32, 8, 1, 131072, 128, 128, DEFAULT_Q_TILE, 16, True),
        # shape (b)'s heads: one KV head for 16 query heads, 64k
        BenchShape("dec_b64k", 8, 16, 1, 1, 65536, 128, 128, DEFAULT_Q_TILE, 16, True),
        # 4 speculative tokens at once
        BenchShape("dec_spec4", 8, 32, 8, 4, 32768, 128, 128, DEFAULT_Q_TILE, 16, True),
    ]
}
# `kernelgen bench --window`: sliding-window layers at 32k, against FlexAttention's sliding-window BlockMask
WINDOW_SHAPES = {
    s.name: s
    for s in [
        # gpt-oss's sliding layers: Hq64 Hkv8 D64, a window of 128 keys (4 blocks of 64 reach it)
        BenchShape("swa128", 1, 64, 8, 32768, 32768, 64, 64, 64, 4, True, window=128),
        # shape (c)'s heads with a window of 4096 keys (Mistral's): 34 blocks of 128
        BenchShape("swa4k", 1, 32, 8, 32768, 32768, 128, 128, 128, 34, True, window=4096),
    ]
}
# `kernelgen bench --softcap`: Gemma 2's cap (50) on shape (c)'s sparse lists and on a Gemma 2 sliding layer, against
# FlexAttention with a tanh score_mod over the same BlockMask
SOFTCAP_SHAPES = {
    s.name: s
    for s in [
        BenchShape("c_cap50", 1, 32, 8, 32768, 32768, 128, 128, 128, 16, True, softcap=50.0),
        # Gemma 2 9B's sliding layers: Hq16 Hkv8 D256, a window of 4096 keys, at its 8k context
        BenchShape("gemma2_swa", 1, 16, 8, 8192, 8192, 256, 64, 64, 66, True, window=4096, softcap=50.0),
    ]
}
UNTUNED_SHAPES = ("dense16k_d128", "dense16k_d64", "c_g8", "c_g1", "a64k_top32", "b_q8k", "c_d96")


def random_query_lists(spec: Spec, batch: int, heads_kv: int, n_q: int, n_k: int, device="cuda", seed: int = 0,
                       chunk: int = 4096) -> torch.Tensor:
    """Random per-query lists, int32 [B, Hkv, Nq, top_k], canonical (ids ascending, then -1): each query
    holds top_k distinct blocks drawn uniformly among those it can see (with causal, the blocks up to its
    diagonal block, which is always held; a query that sees fewer than top_k blocks holds them all).
    Deterministic for a (seed, device, chunk); drawn `chunk` queries at a time to bound the scores' memory."""
    n_blocks = spec.n_kv_blocks(n_k)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(batch, heads_kv, n_q, spec.top_k, dtype=torch.int32, device=device)
    blocks = torch.arange(n_blocks, device=device)
    for start in range(0, n_q, chunk):
        query = torch.arange(start, min(start + chunk, n_q), device=device)
        scores = torch.rand(batch, heads_kv, len(query), n_blocks, device=device, generator=gen)
        if spec.causal:
            last_key = query + (n_k - n_q)  # bottom-right aligned: negative, the query sees no key
            diagonal = torch.div(last_key, spec.kv_block, rounding_mode="floor")[:, None]
            scores = torch.where(blocks > diagonal, -1.0, scores)
            scores = torch.where(blocks == diagonal, 2.0, scores)  # drawn first: the diagonal is always held
        picked_scores, picked = scores.topk(min(spec.top_k, n_blocks), dim=-1)
        picked = torch.where(picked_scores >= 0, picked, n_blocks).sort(-1).values  # invisible ones: empty
        picked = torch.where(picked < n_blocks, picked, -1).to(torch.int32)
        out[:, :, start:start + len(query)] = torch.nn.functional.pad(picked, (0, spec.top_k - picked.shape[-1]),
                                                                      value=-1)
    return out


def agreeing_query_lists(spec: Spec, batch: int, heads_kv: int, n_q: int, n_k: int, own: int, span: int = 64,
                         device="cuda", seed: int = 0) -> torch.Tensor:
    """Per-query lists whose neighbours agree, as content-chosen ones do (NSA's selections move slowly along
    the sequence), int32 [B, Hkv, Nq, top_k], canonical: each span of `span` consecutive queries shares
    top_k - own blocks drawn once among those its first query sees (with causal, less one for each query's
    diagonal block, which it always holds), and each query draws `own` more of its own among those it sees."""
    if not (isinstance(own, int) and 0 <= own <= spec.top_k) or not (isinstance(span, int) and span >= 1):
        raise KernelgenValueError(f"agreeing_query_lists: own={own!r} must be an int in [0, top_k={spec.top_k}] and "
                                  f"span={span!r} an int >= 1")
    n_blocks = spec.n_kv_blocks(n_k)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.arange(n_blocks, device=device)
    query = torch.arange(n_q, device=device)
    n_spans = -(-n_q // span)
    shared = max(0, spec.top_k - own - spec.causal)
    # per span: its shared blocks are the `shared` best-scored blocks its first query sees
    span_scores = torch.rand(batch, heads_kv, n_spans, n_blocks, device=device, generator=gen)
    own_scores = torch.rand(batch, heads_kv, n_q, n_blocks, device=device, generator=gen)
    last_key = query + (n_k - n_q)  # bottom-right aligned
    if spec.causal:
        first_key = (query[::span] + (n_k - n_q))[:, None]
        span_scores = torch.where(blocks * spec.kv_block > first_key, -1.0, span_scores)
    rank = span_scores.argsort(-1, descending=True).argsort(-1)  # 0: the span's best block
    in_shared = (rank < shared) & (span_scores >= 0)
    scores = torch.where(in_shared[:, :, query // span], 2.0 + own_scores, own_scores)
    if spec.causal:
        diagonal = torch.div(last_key, spec.kv_block, rounding_mode="floor")[:, None]
        scores = torch.where(blocks > diagonal, -1.0, scores)
        scores = torch.where(blocks == diagonal, 4.0, scores)
    picked_scores, picked = scores.topk(min(spec.top_k, n_blocks), dim=-1)
    picked = torch.where(picked_scores >= 0, picked, n_blocks).sort(-1).values
    picked = torch.where(picked < n_blocks, picked, -1).to(torch.int32)
    return torch.nn.functional.pad(picked, (0, spec.top_k - picked.shape[-1]), value=-1)


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

"""The anchors timed beside kernelgen: FlexAttention over a BlockMask holding exactly kernelgen's block
lists, and dense SDPA (cuDNN, flash).

FlexAttention gets the same work as kernelgen: every listed block and no other; blocks that need no
elementwise mask go to its `full_kv_*` lists (no mask_mod call), the others (the causal diagonal, a
partial last block) to `kv_*` with the mask_mod. SDPA computes the dense (causal) attention: its time
and FLOPs count every visible pair.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..spec import Spec

__all__ = ["flex_block_mask", "flex_token_mask", "flex_kernel_options", "flex_call", "DenseAnchor",
           "sdpa_dense_anchors"]


def flex_block_mask(block_idx: torch.Tensor, spec: Spec, shape):
    """FlexAttention BlockMask holding exactly kernelgen's lists (`block_idx` int32 [B, Hkv, n_q_tiles,
    top_k], -1 or out-of-range ids empty; `shape` gives n_q and n_k): blocks that need no elementwise
    mask go to full_kv_*, the rest (diagonal, partial last block) to kv_* with the causal mask_mod.
    One list per query head (the G heads of a KV head share theirs)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_k = shape.n_q, shape.n_k
    n_blocks = spec.n_kv_blocks(n_k)
    idx = block_idx.long()
    valid = (idx >= 0) & (idx < n_blocks)
    tiles = torch.arange(idx.shape[2], device=idx.device)[:, None]
    block_end = (idx + 1) * spec.kv_block
    full = valid & (block_end <= n_k)
    if spec.causal:  # the block's last key is visible to the tile's first query
        full = full & (block_end - 1 <= tiles * spec.q_tile + (n_k - n_q))
    partial = valid & ~full

    def pack(sel):
        # BlockMask wants kv_indices [B, H, n_q_blocks, n_kv_blocks]: the selected ids first, then padding.
        # A repeated id counts once, as in kernelgen's lists.
        key = torch.where(sel, idx, n_blocks).sort(-1).values
        first = torch.ones_like(sel)
        first[..., 1:] = key[..., 1:] != key[..., :-1]
        key = torch.where(first, key, n_blocks).sort(-1).values
        count = (key < n_blocks).sum(-1).to(torch.int32)
        ids = torch.where(key < n_blocks, key, 0).to(torch.int32)
        ids = torch.nn.functional.pad(ids, (0, max(0, n_blocks - ids.shape[-1])))[..., :n_blocks]
        g = spec.gqa_group
        return count.repeat_interleave(g, 1).contiguous(), ids.repeat_interleave(g, 1).contiguous()

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (n_k - n_q)

    def in_range(b, h, q_idx, kv_idx):
        return kv_idx < n_k

    kv_num, kv_ids = pack(partial)
    full_num, full_ids = pack(full)
    return BlockMask.from_kv_blocks(kv_num, kv_ids, full_num, full_ids, BLOCK_SIZE=(spec.q_tile, spec.kv_block),
                                    mask_mod=causal_mask if spec.causal else in_range, seq_lengths=(n_q, n_k))


def flex_token_mask(block_mask) -> torch.Tensor:
    """The (query, key) pairs a BlockMask lets FlexAttention's fused kernel see: bool [B, H, n_q, n_k];
    every pair of its full blocks, and the pairs of its partial blocks that its mask_mod keeps. (Eager
    `flex_attention` applies the mask_mod alone and ignores the block lists: no check of a BlockMask.)"""
    from torch.nn.attention.flex_attention import create_mask

    n_q, n_k = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE

    def blocks(num, ids):  # [B, H, n_q_blocks, n_kv_blocks] bool from (count, ids) lists
        dense = torch.zeros(*ids.shape[:3], ids.shape[-1] + 1, dtype=torch.bool, device=ids.device)
        used = torch.arange(ids.shape[-1], device=ids.device) < num[..., None]
        dense.scatter_(-1, torch.where(used, ids.long(), ids.shape[-1]), True)
        return dense[..., :-1].repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :n_q, :n_k]

    partial = blocks(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = torch.zeros_like(partial) if block_mask.full_kv_num_blocks is None else blocks(
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    b, h = block_mask.kv_num_blocks.shape[:2]  # a mask_mod may depend on the batch and head
    kept = create_mask(block_mask.mask_mod, b, h, n_q, n_k, device=partial.device)
    return full | (partial & kept)


def flex_kernel_options(spec: Spec) -> dict | None:
    """FlexAttention's kernel_options for a BlockMask of spec's blocks: its kernel tile must divide the
    BlockMask's blocks (64-blocks need 64x64 tiles); None keeps Flex's own choice."""
    if min(spec.q_tile, spec.kv_block) >= 128:
        return None
    bm, bn = min(64, spec.q_tile), min(64, spec.kv_block)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn}


def flex_call(q, k, v, block_mask, spec: Spec) -> Callable[[], torch.Tensor]:
    """FlexAttention over `block_mask` as a no-argument callable: torch.compile'd (the fused kernel, which
    reads the block lists), with `flex_kernel_options`."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    options = flex_kernel_options(spec)
    gqa = spec.gqa_group > 1
    return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)


class DenseAnchor(NamedTuple):
    """One dense SDPA anchor: call `fn` inside `torch.nn.attention.sdpa_kernel(backend)`."""

    label: str
    backend: object  # torch.nn.attention.SDPBackend
    fn: Callable[[], torch.Tensor]


def sdpa_dense_anchors(q, k, v, spec: Spec) -> list[DenseAnchor]:
    """Dense SDPA on cuDNN and on flash over all keys (causal as spec is), k and v repeated to the query
    heads: the dense work a sparse kernel is weighed against."""
    from torch.nn.attention import SDPBackend

    kd = k.repeat_interleave(spec.gqa_group, 1)
    vd = v.repeat_interleave(spec.gqa_group, 1)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=spec.causal)

    return [DenseAnchor("sdpa cudnn (dense)", SDPBackend.CUDNN_ATTENTION, dense),
            DenseAnchor("sdpa flash (dense)", SDPBackend.FLASH_ATTENTION, dense)]

"""The anchors timed beside kernelgen: FlexAttention over a BlockMask holding exactly kernelgen's block
lists, and dense SDPA (cuDNN, flash).

FlexAttention gets the same work as kernelgen: every listed block and no other (`kernelgen.to_block_mask`);
blocks that need no elementwise mask go to its `full_kv_*` lists (no mask_mod call), the others (the causal
diagonal, a partial last block) to `kv_*` with the mask_mod. SDPA computes the dense (causal) attention: its time
and FLOPs count every visible pair.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..interop import block_mask_blocks, to_block_mask
from ..spec import Spec

__all__ = ["flex_block_mask", "flex_token_mask", "flex_kernel_options", "flex_call", "DenseAnchor",
           "sdpa_dense_anchors"]


def flex_block_mask(block_idx: torch.Tensor, spec: Spec, shape):
    """FlexAttention BlockMask holding exactly kernelgen's lists (`block_idx` int32 [B, Hkv, n_q_tiles,
    top_k]; `shape` gives n_q and n_k): `kernelgen.to_block_mask` with the causal (or in-range) mask_mod
    alone, which the fused kernel calls only inside the partial blocks of the lists (the diagonal, a partial
    last block): the cheapest mask that computes the same attention there."""
    return to_block_mask(block_idx, spec, shape.n_q, shape.n_k, exact_mask_mod=False)


def flex_token_mask(block_mask) -> torch.Tensor:
    """The (query, key) pairs a BlockMask lets FlexAttention's fused kernel see: bool [B, H, n_q, n_k];
    every pair of its full blocks, and the pairs of its partial blocks that its mask_mod keeps. (Eager
    `flex_attention` applies the mask_mod alone and ignores the block lists: no check of a BlockMask.)"""
    from torch.nn.attention.flex_attention import create_mask

    n_q, n_k = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    partial, full = (blocks.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :n_q, :n_k]
                     for blocks in block_mask_blocks(block_mask))
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


def flex_call(q, k, v, block_mask, spec: Spec, return_lse: bool = False,
              score_mod=None) -> Callable[[], torch.Tensor]:
    """FlexAttention over `block_mask` as a no-argument callable: torch.compile'd (the fused kernel, which
    reads the block lists), with `flex_kernel_options`; it returns (o, lse) with `return_lse`, and applies
    `score_mod` (FlexAttention's) where given."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    options = flex_kernel_options(spec)
    gqa = spec.gqa_group > 1
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, kernel_options=options,
                        return_lse=return_lse)


class DenseAnchor(NamedTuple):
    """One dense SDPA anchor: call `fn` inside `torch.nn.attention.sdpa_kernel(backend)`; its gradients are
    those of `leaves` (q and the repeated k and v)."""

    label: str
    backend: object  # torch.nn.attention.SDPBackend
    fn: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sdpa_dense_anchors(q, k, v, spec: Spec) -> list[DenseAnchor]:
    """Dense SDPA on cuDNN and on flash over all keys (causal as spec is), k and v repeated to the query
    heads: the dense work a sparse kernel is weighed against. The repeated k and v are leaves of their own
    (requiring grad as k and v do): a step over views of k and v does not capture in a CUDA graph (torch
    2.11, cuDNN), so the sum of their gradients back to the KV heads is left out of the anchor."""
    from torch.nn.attention import SDPBackend

    kd, vd = (x.detach().repeat_interleave(spec.gqa_group, 1).requires_grad_(x.requires_grad) for x in (k, v))

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=spec.causal)

    return [DenseAnchor("sdpa cudnn (dense)", SDPBackend.CUDNN_ATTENTION, dense, (q, kd, vd)),
            DenseAnchor("sdpa flash (dense)", SDPBackend.FLASH_ATTENTION, dense, (q, kd, vd))]

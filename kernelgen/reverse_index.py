"""The reverse index of block lists: for each (batch, KV head, KV block), the Q tiles whose lists hold it.

Q-centric lists say which KV blocks each Q tile reads. A kernel that owns a KV block instead (the dK/dV
backward, a KV-centric schedule, a multi-GPU split by KV blocks) walks the same (tile, block) pairs from
the block's side. The reverse index is that walk, as CSR:

    offsets  int32 [B, Hkv, n_kv_blocks + 1]: block j's tiles are tiles[b, h, offsets[b, h, j]:offsets[b, h, j + 1]]
    tiles    int32 [B, Hkv, n_q_tiles * top_k]: the tile ids grouped by block, ascending within a block;
             -1 past offsets[b, h, n_kv_blocks] (slots of empty list entries)

It is built on the lists' device by deterministic torch ops of static shapes (no host sync, CUDA-graph
and torch.compile friendly): one sort of the keys block * n_q_tiles + tile, and a binary search for each
block's first key.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ReverseIndex", "build_reverse_index"]


class ReverseIndex(NamedTuple):
    """The Q tiles that list each KV block (CSR; see the module's docstring)."""

    offsets: torch.Tensor
    tiles: torch.Tensor


def build_reverse_index(block_idx: torch.Tensor, n_kv_blocks: int) -> ReverseIndex:
    """The reverse index of lists in the kernels' form (int32 [B, Hkv, n_q_tiles, top_k], valid ids
    ascending then -1, no repeats: `SparseAttention.prepare` or the `lists` role makes them). Ids outside
    [0, n_kv_blocks) are empty slots, as everywhere."""
    b, h, n_tiles, top_k = block_idx.shape
    device = block_idx.device
    ids = block_idx.long()
    valid = (ids >= 0) & (ids < n_kv_blocks)
    tile = torch.arange(n_tiles, device=device, dtype=torch.int64)[:, None]
    none = n_kv_blocks * n_tiles  # sorts after every valid key
    keys = torch.where(valid, ids * n_tiles + tile, none).reshape(b, h, n_tiles * top_k)
    keys = torch.sort(keys, dim=-1).values  # a list holds an id once, so every valid key is unique
    firsts = (torch.arange(n_kv_blocks + 1, device=device, dtype=torch.int64) * n_tiles).expand(b, h, -1)
    offsets = torch.searchsorted(keys, firsts.contiguous()).to(torch.int32)
    tiles = torch.where(keys < none, keys % n_tiles, -1).to(torch.int32)
    return ReverseIndex(offsets, tiles)

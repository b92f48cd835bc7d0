"""The reverse index of block lists: for each (batch, KV head, KV block), the Q tiles whose lists hold it.

Q-centric lists say which KV blocks each Q tile reads. A kernel that owns a KV block instead (the dK/dV
backward, a KV-centric schedule, a multi-GPU split by KV blocks) walks the same (tile, block) pairs from
the block's side. The reverse index is that walk, as CSR:

    offsets  int32 [B, Hkv, n_kv_blocks + 1]: block j's tiles are tiles[b, h, offsets[b, h, j]:offsets[b, h, j + 1]]
    tiles    int32 [B, Hkv, n_q_tiles * top_k]: the tile ids grouped by block, ascending within a block;
             -1 past offsets[b, h, n_kv_blocks] (slots of empty list entries)
    order    int32 [B * Hkv * n_kv_blocks]: the blocks as (b * Hkv + h) * n_kv_blocks + j, those listed by
             the most tiles first (ties: ascending). A kernel with a program per block launches its programs
             in this order, so that the longest walks start first and none is left running alone at the end
             (content-chosen lists are uneven: a few blocks are listed by two to four times the mean).

It is built on the lists' device by deterministic torch ops of static shapes (no host sync, CUDA-graph
and torch.compile friendly): one sort of the keys block * n_q_tiles + tile, and a binary search for each
block's first key.

Per-query lists (the KV-centric schedule, `block_idx[B, Hkv, Nq, top_k]`) have the same walk with a query
for a tile; `build_query_reverse_index` also keeps each pair's slot in the query's list (where the
attention writes its partial output), and `split_tasks` cuts each block's queries into tasks of a
bounded size, so that a block every query lists (sink, local, diagonal) is spread over many programs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ReverseIndex", "build_reverse_index", "heaviest_first", "QueryReverseIndex", "build_query_reverse_index", "split_tasks", "max_tasks"]


class ReverseIndex(NamedTuple):
    """The Q tiles that list each KV block (CSR), and the blocks heaviest first (see the module's docstring)."""

    offsets: torch.Tensor
    tiles: torch.Tensor
    order: torch.Tensor


def build_reverse_index(block_idx: torch.Tensor, n_kv_blocks: int) -> ReverseIndex:
    """The reverse index of lists in the kernels' form (int32 [B, Hkv, n_q_tiles, top_k], valid ids
    ascending then -1, no repeats: `SparseAttention.prepare` or the `lists` role makes them). Ids outside
    [0, n_kv_blocks) are empty slots, as everywhere."""
    offsets, keys, _, none = _sorted_pairs(block_idx, n_kv_blocks)
    n_tiles = block_idx.shape[2]
    tiles = torch.where(keys < none, keys % n_tiles, -1).to(torch.int32)
    return ReverseIndex(offsets, tiles, heaviest_first(offsets))


def heaviest_first(offsets: torch.Tensor) -> torch.Tensor:
    """int32 [B * Hkv * n_kv_blocks]: the blocks of CSR `offsets` [B, Hkv, n_kv_blocks + 1] as flat ids
    (b * Hkv + h) * n_kv_blocks + j, the longest first, ties in ascending order (a stable sort: the same
    order every run)."""
    counts = (offsets[..., 1:] - offsets[..., :-1]).flatten()
    return torch.sort(counts, descending=True, stable=True).indices.to(torch.int32)


def _sorted_pairs(block_idx: torch.Tensor, n_kv_blocks: int):
    """(offsets, sorted keys block * n_lists + list, where each key came from in the flattened lists, the key
    of an empty slot) of lists in the kernels' form."""
    b, h, n_lists, top_k = block_idx.shape
    device = block_idx.device
    ids = block_idx.long()
    valid = (ids >= 0) & (ids < n_kv_blocks)
    row = torch.arange(n_lists, device=device, dtype=torch.int64)[:, None]
    none = n_kv_blocks * n_lists  # sorts after every valid key
    keys = torch.where(valid, ids * n_lists + row, none).reshape(b, h, n_lists * top_k)
    # a list holds an id once, so every valid key is unique; stable: the empty slots keep their order too
    keys, order = torch.sort(keys, dim=-1, stable=True)
    firsts = (torch.arange(n_kv_blocks + 1, device=device, dtype=torch.int64) * n_lists).expand(b, h, -1)
    offsets = torch.searchsorted(keys, firsts.contiguous()).to(torch.int32)
    return offsets, keys, order, none


class QueryReverseIndex(NamedTuple):
    """The queries that list each KV block, for per-query lists (CSR, as `ReverseIndex`):

    offsets  int32 [B, Hkv, n_kv_blocks + 1]: block j's pairs are [offsets[.., j], offsets[.., j + 1])
    queries  int32 [B, Hkv, Nq * top_k]: the queries grouped by block, ascending within a block; -1 past the end
    slots    int32 [B, Hkv, Nq * top_k]: the block's slot in that query's list; -1 past the end
    split    {(n_pairs, queries per task): `split_tasks`' result}, filled by `tasks`: prepared lists keep
             their reverse index, so each of their calls reuses the split rather than recomputing it
    """

    offsets: torch.Tensor
    queries: torch.Tensor
    slots: torch.Tensor
    split: dict

    def tasks(self, n_pairs: int, queries_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`split_tasks(self.offsets, n_pairs, queries_per_task)`, computed once per index and task size."""
        key = (n_pairs, queries_per_task)
        if key not in self.split:
            self.split[key] = split_tasks(self.offsets, n_pairs, queries_per_task)
        return self.split[key]


def build_query_reverse_index(block_idx: torch.Tensor, n_kv_blocks: int) -> QueryReverseIndex:
    """The reverse index of per-query lists in the kernels' form (int32 [B, Hkv, Nq, top_k], valid ids
    ascending then -1, no repeats), on their device, with no host sync."""
    offsets, keys, order, none = _sorted_pairs(block_idx, n_kv_blocks)
    n_q, top_k = block_idx.shape[2:]
    used = keys < none
    queries = torch.where(used, keys % n_q, -1).to(torch.int32)
    slots = torch.where(used, order % top_k, -1).to(torch.int32)
    return QueryReverseIndex(offsets, queries, slots, {})


def max_tasks(n_kv_blocks: int, n_pairs: int, queries_per_task: int) -> int:
    """An upper bound of the tasks of one (batch, KV head): each block's last task may be partial."""
    return n_kv_blocks + -(-n_pairs // queries_per_task)


def split_tasks(offsets: torch.Tensor, n_pairs: int, queries_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's pairs cut into tasks of at most `queries_per_task` consecutive pairs: (task_block,
    task_start), int32 [B, Hkv, max_tasks(...)], a task's block (-1: no task) and its first pair. Static
    shapes, deterministic, no host sync."""
    n_kv_blocks = offsets.shape[-1] - 1
    counts = (offsets[..., 1:] - offsets[..., :-1]).long()
    per_block = -(-counts // queries_per_task)
    ends = per_block.cumsum(-1)  # one past each block's last task
    task = torch.arange(max_tasks(n_kv_blocks, n_pairs, queries_per_task), device=offsets.device)
    block = torch.searchsorted(ends, task.expand(*ends.shape[:-1], -1).contiguous(), right=True)
    real = block < n_kv_blocks
    block = block.clamp(max=n_kv_blocks - 1)
    first_task = torch.gather(ends - per_block, -1, block)
    start = torch.gather(offsets.long(), -1, block) + (task - first_task) * queries_per_task
    return torch.where(real, block, -1).to(torch.int32), torch.where(real, start, 0).to(torch.int32)

"""Per-query lists seen by a tile of consecutive queries: the union of their blocks, and who lists which.

The KV-centric schedule's union design (`kv_attn_union`) attends a tile of `tile_q` consecutive queries
(their G heads packed as rows) over the union of the tile's per-query lists, loading each block once, and
masks each row to the blocks its own query lists. It writes no partial outputs, so it moves far less than
the gathered design (`kv_attn`) wherever neighbouring queries list nearly the same blocks, and wastes
products where they do not. `inflation` is that waste: the (query, block) pairs the union design computes
over the pairs the lists hold; the dispatcher serves the union design to prepared lists whose inflation is
low (`union_max_inflation`).

    lists    int32 [B, Hkv, n_tiles, union_len]: each tile's blocks ascending, then -1
    member   int32 [B, Hkv, Nq, ceil(union_len / 32)]: bit s % 32 of word s // 32 is set where the query's
             own list holds the tile's block at slot s

Built on the lists' device by deterministic torch ops of static shapes (no host sync): a sort of each
tile's tile_q * top_k ids, repeats out, a second sort, and a binary search of each id in its tile's union.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import KernelgenTypeError, KernelgenValueError
from .reverse_index import QueryReverseIndex, build_query_reverse_index, heaviest_first

__all__ = ["TileUnion", "TileUnions", "build_tile_union", "union_for", "union_len", "union_max_inflation",
           "union_tile_q"]


def union_max_inflation(kv_block: int, *, backward: bool = False) -> float:
    """The inflation below which the union design is the faster one, for the forward or the backward, where no
    tuned rates of both designs say (`SparseAttention._union_limit`). Both designs' times grow with the pairs
    the lists hold; the gathered design's partials cost a fixed number of bytes per (query, head, block),
    which larger blocks amortise. On an H200 with pointer loads (tools/kv_union_sweep.py and the tuned rates,
    docs/DESIGN.md) the forwards met at inflation 2.8-3.4 with 64-key blocks and about 1.5 with 128-key ones;
    the backwards at about 1.7 with 64-key blocks (head_dim 64 and 128) and 1.25 with 128-key ones. Tensor
    descriptors move the H200's tuned crossovers higher (forward 3.5-4.1 and 2.2, backward 1.75-1.95 and
    1.43), which only the tuned rates bring; the rule keeps the pointer path's, which GPUs without TMA run.
    Halved per doubling of the block above 128 keys."""
    if kv_block <= 64:
        limit = 1.7 if backward else 2.4
    else:
        limit = 1.25 if backward else 1.5
    return limit * min(1.0, 128 / kv_block)


class TileUnion(NamedTuple):
    """The union of each tile's per-query lists and each query's membership bits (see the module's docstring);
    `cache` keeps what the backward derives from them (`reverse_index`)."""

    tile_q: int
    n_kv_blocks: int
    lists: torch.Tensor
    member: torch.Tensor
    cache: dict

    def reverse_index(self) -> tuple[QueryReverseIndex, torch.Tensor]:
        """For each KV block, the (tile, union slot) pairs of the unions that hold it (the query reverse index
        of the unions, a tile for a query), and the blocks held by the most tiles first (`heaviest_first`):
        the union backward's dK/dV walk. Built on the device at the first call, then kept."""
        if "reverse" not in self.cache:
            reverse = build_query_reverse_index(self.lists, self.n_kv_blocks)
            self.cache["reverse"] = (reverse, heaviest_first(reverse.offsets))
        return self.cache["reverse"]

    def inflation(self, block_idx: torch.Tensor) -> float:
        """(query, block) pairs the union design computes (every query of a tile over the tile's union, the
        last tile's missing queries not counted) over the pairs `block_idx` holds (valid ids); a host sync,
        then kept in `cache`."""
        if "inflation" not in self.cache:
            computed, held = self.pair_counts(block_idx)
            self.cache["inflation"] = float(computed.sum()) / max(1, int(held.sum()))
        return self.cache["inflation"]

    def inflation_per_head(self, block_idx: torch.Tensor) -> torch.Tensor:
        """`inflation` of each (batch, KV head)'s lists: float64 [B, Hkv] (1 where a head's lists are empty)."""
        computed, held = self.pair_counts(block_idx)
        return torch.where(held > 0, computed.double() / held.clamp(min=1), 1.0)

    def pair_counts(self, block_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pairs computed, pairs held) per (batch, KV head), int64 [B, Hkv]."""
        n_q = block_idx.shape[2]
        per_tile = (self.lists >= 0).sum(-1)  # [B, Hkv, n_tiles]
        queries = torch.full((per_tile.shape[-1],), self.tile_q, device=per_tile.device)
        queries[-1] = n_q - self.tile_q * (per_tile.shape[-1] - 1)
        return (per_tile * queries).sum(-1), (block_idx >= 0).sum((-2, -1))


def union_tile_q(gqa_group: int) -> int:
    """The queries of a tile whose G heads make 64 packed rows (4 at G = 16): the union design's default tile,
    the fastest on most list kinds of the H200 sweep (docs/DESIGN.md)."""
    return max(1, 64 // (1 << (gqa_group - 1).bit_length()))


def union_len(tile_q: int, top_k: int, n_kv_blocks: int) -> int:
    """Slots of a tile's union: all its queries' ids, or every block."""
    return min(tile_q * top_k, n_kv_blocks)


def build_tile_union(block_idx: torch.Tensor, tile_q: int, n_kv_blocks: int) -> TileUnion:
    """The tile unions of per-query lists in the kernels' form (int32 [B, Hkv, Nq, top_k], valid ids
    ascending then -1: `SparseAttention.prepare` or the `lists` role makes them, without repeats)."""
    if not isinstance(block_idx, torch.Tensor) or block_idx.dim() != 4 or block_idx.dtype != torch.int32:
        raise KernelgenValueError("block_idx must be per-query lists in the kernels' form, int32 [B, Hkv, Nq, top_k]; "
                                  f"got {getattr(block_idx, 'dtype', type(block_idx).__name__)} "
                                  f"{tuple(getattr(block_idx, 'shape', ()))}")
    if not isinstance(tile_q, int) or tile_q < 1:
        raise KernelgenValueError(f"tile_q={tile_q!r}; expected an int >= 1")
    b, h, n_q, top_k = block_idx.shape
    n_tiles = -(-n_q // tile_q)
    length = union_len(tile_q, top_k, n_kv_blocks)
    none = torch.iinfo(torch.int32).max  # sorts after every id
    ids = torch.where((block_idx >= 0) & (block_idx < n_kv_blocks), block_idx, none)
    ids = torch.nn.functional.pad(ids, (0, 0, 0, n_tiles * tile_q - n_q), value=none)
    ids = torch.sort(ids.reshape(b, h, n_tiles, tile_q * top_k), dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.sort(torch.where(repeat, none, ids), dim=-1).values[..., :length]
    lists = torch.where(ids == none, -1, ids).to(torch.int32).contiguous()
    # each query's ids found in its tile's union (one binary search per id, against its tile's union only):
    # their slots, as bits
    held = (block_idx >= 0) & (block_idx < n_kv_blocks)
    held[..., 1:] &= block_idx[..., 1:] != block_idx[..., :-1]  # ascending: a repeat (never in the kernels' form) once
    wanted = torch.nn.functional.pad(torch.where(held, block_idx, none), (0, 0, 0, n_tiles * tile_q - n_q), value=none)
    slot = torch.searchsorted(ids.contiguous(), wanted.reshape(b, h, n_tiles, tile_q * top_k))
    slot = slot.reshape(b, h, n_tiles * tile_q, top_k)[:, :, :n_q]
    words = -(-length // 32)
    bit = torch.where(held, torch.ones_like(slot) << (slot % 32), 0)
    member = torch.zeros(b, h, n_q, words, dtype=torch.int64, device=block_idx.device)
    member.scatter_add_(-1, torch.where(held, slot // 32, 0), bit)  # an id held once: bits never collide
    member = torch.where(member >= 2 ** 31, member - 2 ** 32, member).to(torch.int32).contiguous()
    return TileUnion(tile_q, n_kv_blocks, lists, member, {})


class TileUnions(dict):
    """The tile unions of one list set by tile_q, each built at its first use: what a tuner's trials of
    several tile_q share, so that a trial times the kernels and not the build (served lists carry theirs,
    built once by `prepare`)."""

    def __init__(self, block_idx: torch.Tensor, n_kv_blocks: int):
        super().__init__()
        self.block_idx, self.n_kv_blocks = block_idx, n_kv_blocks

    def __missing__(self, tile_q: int) -> TileUnion:
        self[tile_q] = union = build_tile_union(self.block_idx, tile_q, self.n_kv_blocks)
        return union


def union_for(union: TileUnion | TileUnions | None, block_idx: torch.Tensor, tile_q: int,
              n_kv_blocks: int) -> TileUnion:
    """The tile union of `block_idx` for tiles of tile_q: `union` if it is that one, the one a TileUnions
    holds or builds, else built here."""
    if isinstance(union, TileUnions):
        return union[tile_q]
    if union is not None and not isinstance(union, TileUnion):
        raise KernelgenTypeError(f"union must be a TileUnion, TileUnions or None; got {type(union).__name__}")
    if union is not None and union.tile_q == tile_q:
        return union
    return build_tile_union(block_idx, tile_q, n_kv_blocks)

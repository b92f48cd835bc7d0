"""How a sequence is cut over the ranks of a context-parallel group, and what that means for block ids.

Glossary
  chunk     one of the equal, consecutive pieces the sequence of N tokens is cut into: `P` of them
            ("contiguous") or `2P` ("zigzag"), each a whole number of KV blocks and of Q tiles.
  shard     what a rank holds: its chunks, in ascending order, concatenated along the sequence.
            "contiguous": rank r holds chunk r. "zigzag": rank r holds chunks r and 2P-1-r, so that
            under causal masking every rank has the same work (an early chunk and a late one).
  global    a block id (or Q tile id) of the whole sequence: what one GPU's lists hold.
  local     an id inside one rank's shard: local block b of rank s is global block
            `chunks(s)[b // blocks_per_chunk] * blocks_per_chunk + b % blocks_per_chunk`.

Causal masking never needs a position offset inside a kernel: chunks are whole blocks and tiles, so a
(Q tile, KV block) pair is either in the same chunk (the kernels' own causal mask, applied inside a rank's
shard, is exact there), or the block's chunk comes earlier (every key visible) or later (none).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KernelgenValueError
from ..spec import Spec

__all__ = ["LAYOUTS", "Layout"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Layout:
    """The cut of a sequence of `n` tokens over `world` ranks, seen from `rank`."""

    name: str
    world: int
    rank: int
    n: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise KernelgenValueError(f"layout={self.name!r} is unknown; expected one of {LAYOUTS}")
        for name, value, low in (("world", self.world, 1), ("n", self.n, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise KernelgenValueError(f"Layout {name}={value!r}; expected an int >= {low}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise KernelgenValueError(f"Layout rank={self.rank!r}; expected an int in [0, world={self.world})")
        if self.n % self.n_chunks:  # unequal chunks would drop tokens
            raise KernelgenValueError(f"layout={self.name!r} over {self.world} ranks cuts the sequence into "
                                      f"{self.n_chunks} equal chunks; N={self.n} is not a multiple of it")

    @classmethod
    def of_shard(cls, name: str, world: int, rank: int, shard_len: int) -> "Layout":
        if name not in LAYOUTS:
            raise KernelgenValueError(f"layout={name!r} is unknown; expected one of {LAYOUTS}")
        per_shard = cls(name, world, rank, 0).n_chunks // world
        if shard_len % per_shard:  # chunks of unequal lengths would be cut wrong
            raise KernelgenValueError(f"a shard of {shard_len} rows does not cut into the {per_shard} equal chunks a "
                                      f"shard of layout={name!r} holds")
        return cls(name, world, rank, shard_len * world)

    # ---- chunks ------------------------------------------------------------------------------------
    @property
    def n_chunks(self) -> int:
        """P chunks, or 2P for zigzag over P > 1 ranks (one rank holds the sequence as one chunk, in order)."""
        return self.world * (2 if self.name == "zigzag" and self.world > 1 else 1)

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.n // self.n_chunks

    @property
    def shard_len(self) -> int:
        return self.n // self.world

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks rank `rank` (default: this one) holds, in shard order."""
        r = self.rank if rank is None else rank
        return (r,) if self.n_chunks == self.world else (r, 2 * self.world - 1 - r)

    def check(self, spec: Spec) -> None:
        """Chunks must be whole KV blocks and whole Q tiles (ValueError naming the sizes otherwise)."""
        for name, size in (("kv_block", spec.kv_block), ("q_tile", spec.q_tile)):
            if self.chunk % size:
                raise KernelgenValueError(
                    f"layout={self.name!r} over {self.world} ranks: chunks of {self.chunk} tokens (N={self.n} in "
                    f"{self.n_chunks} chunks) are not a multiple of spec.{name}={size}; each chunk must hold whole "
                    f"KV blocks and Q tiles")

    def positions(self, rank: int | None = None, device=None) -> torch.Tensor:
        """int64 [shard_len]: the global positions of a rank's shard rows."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk, device=device)
                          for c in self.chunks(rank)])

    # ---- ids ---------------------------------------------------------------------------------------
    def global_ids(self, unit: int, rank: int | None = None, device=None) -> torch.Tensor:
        """int64: the global ids of a rank's local blocks (unit = kv_block) or Q tiles (unit = q_tile), in
        shard order."""
        per_chunk = self.chunk // unit
        return torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk, device=device)
                          for c in self.chunks(rank)])

    def block_tables(self, kv_block: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner, local, chunk), int64 [n_kv_blocks]: for each global block, the rank that holds it, its local
        id there, and its chunk."""
        n_blocks = self.n // kv_block
        per_chunk = self.chunk // kv_block
        owner = torch.empty(n_blocks, dtype=torch.int64, device=device)
        local = torch.empty(n_blocks, dtype=torch.int64, device=device)
        for s in range(self.world):
            ids = self.global_ids(kv_block, s, device)
            owner[ids] = s
            local[ids] = torch.arange(len(ids), device=device)
        return owner, local, torch.arange(n_blocks, device=device) // per_chunk

    def tile_chunks(self, q_tile: int, device=None) -> torch.Tensor:
        """int64 [shard's Q tiles]: the chunk of each of this rank's Q tiles."""
        return self.global_ids(q_tile, device=device) // (self.chunk // q_tile)

    # ---- tensors -----------------------------------------------------------------------------------
    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full [B, H, N, ...] tensor (a copy, contiguous)."""
        return torch.cat([x[:, :, c * self.chunk:(c + 1) * self.chunk] for c in self.chunks()], dim=2).contiguous()

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full [B, H, N, ...] tensor from every rank's shard (`shards[s]` of rank s)."""
        pieces = [None] * self.n_chunks
        for s, x in enumerate(shards):
            for i, c in enumerate(self.chunks(s)):
                pieces[c] = x[:, :, i * self.chunk:(i + 1) * self.chunk]
        return torch.cat(pieces, dim=2)

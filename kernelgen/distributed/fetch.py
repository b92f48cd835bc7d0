"""The sparse path: a rank fetches only the remote KV blocks its lists name, then attends once.

Glossary
  request   a (batch x KV head, global block) pair this rank's lists name, held by another rank and visible
            (under causal masking: in an earlier chunk than the tile's), counted once however many tiles
            list it; as a flat id `bh * n_kv_blocks + block`. Requests are sorted by (owner, bh, block).
  prefix    the fetched blocks of each (batch, KV head), `width` block slots (the largest count over heads;
            unused slots are zeros no list names), placed *before* the rank's own shard in the local K/V:
            K_local = [prefix | own shard]. With Nq = shard length and Nk = width * kv_block + shard length,
            the kernels' causal rule `key <= query + Nk - Nq` is then exact in global positions: every prefix
            key is visible, and own keys obey the shard's own diagonal.

Two all_to_all exchanges move the data: the requested ids (with their counts), then the blocks, each rank's
K blocks then its V blocks (`wire_rows` rows for `counts` blocks), so that the runs a receiver lays out are
contiguous. The backward sends the prefix's dK/dV back the same way reversed; each owner adds them to its own
shard's gradients in fp32, source rank by source rank (a source names a pair once: no two terms of one
exchange meet, and the order of the sum is fixed).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..inputs import BlockLists
from .comm import Group
from .layout import Layout

__all__ = ["Requests", "requests_of", "Fetched", "fetch", "wire_rows", "owned_blocks", "prefixed", "local_lists", "local_prepared",
           "local_forward", "local_backward", "prefix_gradients", "add_returned", "return_gradients"]


class Requests(NamedTuple):
    """What a rank asks for: `ids` int64 flat request ids sorted by (owner, bh, block), `counts[s]` of them
    held by rank s, `head_counts[s][bh]` of those for (batch x KV head) bh (host lists)."""

    ids: torch.Tensor
    counts: list[int]
    head_counts: list[list[int]]


def requests_of(rows: torch.Tensor, layout: Layout, tables, tile_chunk: torch.Tensor, causal: bool) -> Requests:
    """The remote blocks `rows` (global lists of this rank's tiles, [B, Hkv, T, top_k]) name and can see."""
    owner, _, chunk = tables
    n_blocks = owner.numel()
    b, hkv, t, top_k = rows.shape
    ids = rows.long()
    safe = ids.clamp(0, n_blocks - 1)
    keep = (ids >= 0) & (ids < n_blocks) & (owner[safe] != layout.rank)
    if causal:
        keep &= chunk[safe] < tile_chunk[None, None, :, None]
    want = torch.zeros(b * hkv, n_blocks + 1, dtype=torch.bool, device=rows.device)
    want.scatter_(1, torch.where(keep, ids, n_blocks).reshape(b * hkv, t * top_k), True)
    bh, block = want[:, :n_blocks].nonzero(as_tuple=True)
    flat = bh * n_blocks + block
    holder = owner[block]
    order = torch.argsort(holder * (b * hkv * n_blocks) + flat)  # unique keys: (owner, bh, block)
    head_counts = torch.bincount(holder * (b * hkv) + bh, minlength=layout.world * b * hkv)
    head_counts = head_counts.view(layout.world, b * hkv).tolist()  # the requests' one host sync
    return Requests(flat[order], [sum(row) for row in head_counts], head_counts)


class Fetched(NamedTuple):
    """The fetched blocks laid out as the prefix, and how to send their gradients back."""

    k: torch.Tensor          # [B, Hkv, width * kv_block + shard, D]: prefix, then the own shard
    v: torch.Tensor
    width: int               # prefix block slots per (batch, KV head)
    slot: torch.Tensor       # int64 [len(requests.ids)]: each request's slot in its head's prefix
    requests: Requests
    incoming: torch.Tensor   # int64: the flat ids other ranks asked this one for, in source rank order
    incoming_counts: list[int]


def _block_rows(flat: torch.Tensor, tables, n_local: int) -> torch.Tensor:
    """Rows of a shard viewed as [B * Hkv * n_local, kv_block, D] that flat request ids name."""
    _, local, _ = tables
    n_blocks = local.numel()
    return (flat // n_blocks) * n_local + local[flat % n_blocks]


def _words(x: torch.Tensor) -> torch.Tensor:
    """`x` (last dim contiguous) seen as 8-byte words where its sizes and strides allow: the index and strided
    copy kernels move one element per thread, so 16-bit rows move in a quarter of the elements."""
    size = x.element_size()
    if x.stride(-1) == 1 and x.shape[-1] * size % 8 == 0 and x.storage_offset() * size % 8 == 0 \
            and all(s * size % 8 == 0 for s in x.stride()[:-1]) and x.dtype != torch.int64:
        return x.view(torch.int64)
    return x


def _as_words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) both seen as 8-byte words where both allow, else as they are: a strided copy (a shard into
    the local K/V, runs of the interleaved received blocks) moves one element per thread, so 16-bit data
    moves 4x slower than words."""
    words = _words(dst), _words(src)
    return words if words[0].dtype == words[1].dtype else (dst, src)


def _gather_blocks(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, counts: list[int],
                   kv_block: int) -> torch.Tensor:
    """[2 * n, kv_block, D]: the blocks at `rows` of k and v ([B, Hkv, N, D], seen as [B * Hkv * N / kv_block,
    kv_block * D]) in the form the all_to_all carries: per segment of `counts` (one a rank), its K blocks then
    its V blocks (2 * count rows), so that every run of K or V is contiguous. Only those blocks are copied,
    each once, never k or v whole."""
    d = k.shape[3]
    out = k.new_empty(2 * rows.numel(), kv_block, d)
    flat = out.view(-1, kv_block * d)
    start = 0
    for count in counts:
        for i, x in enumerate((k, v)):
            if count:
                torch.index_select(_words(x.reshape(-1, kv_block * d)), 0, rows[start:start + count],
                                   out=_words(flat[2 * start + i * count:2 * start + (i + 1) * count]))
        start += count
    return out


def wire_rows(counts: list[int]) -> list[int]:
    """Rows of `_gather_blocks`'s form per rank for `counts[s]` blocks each: a K and a V row a block."""
    return [2 * count for count in counts]


def _segment(buffer: torch.Tensor, counts: list[int], rank: int, i: int) -> torch.Tensor:
    """The K (i = 0) or V (i = 1) blocks of `rank`'s segment of a buffer in `_gather_blocks`'s form."""
    start = 2 * sum(counts[:rank]) + i * counts[rank]
    return buffer[start:start + counts[rank]]


def owned_blocks(k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, counts: list[int], tables,
                 kv_block: int) -> torch.Tensor:
    """K and V of the blocks of this rank's shards that flat request ids name (`counts[s]` of them from rank
    s), in `_gather_blocks`'s form."""
    return _gather_blocks(k, v, _block_rows(flat, tables, k.shape[2] // kv_block), counts, kv_block)


def prefixed(k: torch.Tensor, v: torch.Tensor, requests: Requests, received: torch.Tensor,
             kv_block: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(K_local, V_local, width, slot): the received blocks (in `_gather_blocks`'s form, segments by owner, each
    in request order) laid out as the prefix of this rank's shards."""
    b, hkv, n, d = k.shape
    heads, head_counts = b * hkv, requests.head_counts
    per_head = [sum(column) for column in zip(*head_counts)]
    width = max(per_head, default=0)
    # slot of each request in its head's prefix: its rank among that head's requests (owner, then block), so
    # the requests of one (owner, head) are one run of `received` and one run of slots, and a head's
    # requests fill slots 0 .. count - 1 of its `width`. Counted on the host from the run lengths: no sync.
    runs = torch.tensor(head_counts, dtype=torch.int64)  # [world, heads]
    lengths = runs.flatten()
    first_slot = (runs.cumsum(0) - runs).flatten()  # earlier owners' requests of the same head
    first_request = lengths.cumsum(0) - lengths
    slot = torch.arange(int(lengths.sum())) + torch.repeat_interleave(first_slot - first_request, lengths)
    slot = (slot.pin_memory() if k.is_cuda else slot).to(k.device, non_blocking=True)
    cut = width * kv_block
    out = []
    for i, x in enumerate((k, v)):  # written in place: [prefix | own shard], no concatenation
        local = x.new_empty(b, hkv, cut + n, d)
        torch.Tensor.copy_(*_as_words(local[:, :, cut:], x))
        prefix = local.view(heads, -1, kv_block, d)
        targets, sources = [], []
        filled = [0] * heads
        for owner, row in enumerate(head_counts):  # requests in (owner, head) order, each run copied whole
            blocks, start = _segment(received, requests.counts, owner, i), 0
            for h, count in enumerate(row):
                if count:
                    target, source = _as_words(prefix[h, filled[h]:filled[h] + count], blocks[start:start + count])
                    targets.append(target)
                    sources.append(source)
                    start += count
                    filled[h] += count
        unnamed = [prefix[h, count:width] for h, count in enumerate(per_head) if count < width]
        if targets:
            torch._foreach_copy_(targets, sources)
        if unnamed:  # the slots no list names: zeros, never garbage
            torch._foreach_zero_(unnamed)
        out.append(local)
    return out[0], out[1], width, slot


def fetch(k: torch.Tensor, v: torch.Tensor, requests: Requests, layout: Layout, tables, kv_block: int,
          group: Group) -> Fetched:
    """Exchange the requests, serve the blocks asked of this rank, and lay the received ones out as the prefix."""
    counts_in = group.all_to_all(torch.tensor(requests.counts, dtype=torch.int64, device=k.device)[:, None],
                                 [1] * group.world, [1] * group.world)[:, 0].tolist()
    incoming = group.all_to_all(requests.ids, requests.counts, counts_in)
    served = owned_blocks(k, v, incoming, counts_in, tables, kv_block)
    received = group.all_to_all(served, wire_rows(counts_in), wire_rows(requests.counts))
    k_local, v_local, width, slot = prefixed(k, v, requests, received, kv_block)
    return Fetched(k_local, v_local, width, slot, requests, incoming, counts_in)


def local_lists(rows: torch.Tensor, fetched: Fetched, layout: Layout, tables, tile_chunk: torch.Tensor,
                kv_block: int, causal: bool) -> torch.Tensor:
    """int32 lists over [prefix | own shard]: fetched blocks at their prefix slot, own blocks after the prefix,
    blocks neither fetched nor visible -1."""
    owner, local, chunk = tables
    n_blocks = owner.numel()
    b, hkv, t, top_k = rows.shape
    table = torch.full((b * hkv, n_blocks), -1, dtype=torch.int64, device=rows.device)
    mine = owner == layout.rank
    table[:, mine] = fetched.width + local[mine]
    ids = fetched.requests.ids
    table[ids // n_blocks, ids % n_blocks] = fetched.slot
    flat = rows.long()
    valid = (flat >= 0) & (flat < n_blocks)
    safe = flat.clamp(0, n_blocks - 1)
    out = torch.gather(table.view(b, hkv, n_blocks), 2, safe.reshape(b, hkv, t * top_k)).view_as(flat)
    keep = valid
    if causal:
        keep &= chunk[safe] <= tile_chunk[None, None, :, None]
    return torch.where(keep, out, -1).to(torch.int32)


def local_prepared(rows: torch.Tensor, fetched: Fetched, call) -> BlockLists:
    """This rank's lists over [prefix | own shard], prepared for its causal kernels (`call`: a `_Call`)."""
    lists = local_lists(rows, fetched, call.layout, call.tables, call.tile_chunk, call.spec.kv_block, call.spec.causal)
    return call.causal_attn.prepare(lists, rows.shape[2] * call.spec.q_tile, fetched.k.shape[2])


def local_forward(q, k_local, v_local, prepared: BlockLists, call) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of this rank's queries: the one causal attention over [prefix | own shard]."""
    return call.causal_attn(q, k_local, v_local, block_idx=prepared, scale=call.scale, return_lse=True)


def local_backward(do, q, k_local, v_local, o, lse, prepared: BlockLists, call,
                   dlse=None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the local attention; dk, dv over [prefix | own shard]. `dlse`: lse's gradient, or None."""
    return call.causal_attn._gradients(do, q, k_local, v_local, o, lse, prepared.block_idx, call.scale,
                                       prepared.reverse_index(), dlse=dlse)


def prefix_gradients(dk: torch.Tensor, dv: torch.Tensor, fetched: Fetched, n_blocks: int,
                     kv_block: int) -> torch.Tensor:
    """dK, dV of the fetched blocks in `_gather_blocks`'s form, segments by owner (what goes back to them)."""
    per_row = dk.shape[2] // kv_block  # blocks per (batch, KV head) of the local K/V: the prefix's, then the own
    return _gather_blocks(dk, dv, (fetched.requests.ids // n_blocks) * per_row + fetched.slot,
                          fetched.requests.counts, kv_block)


def add_returned(dk: torch.Tensor, dv: torch.Tensor, back: torch.Tensor, fetched: Fetched, tables,
                 kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of this rank's own shard: the own part of the local gradients plus, in fp32 and source rank
    order, `back` (what the other ranks computed for the blocks they fetched from it, in `_gather_blocks`'s
    form, segments by source rank in the order of `fetched.incoming`)."""
    b, hkv, _, d = dk.shape
    cut = fetched.width * kv_block
    n_local = (dk.shape[2] - cut) // kv_block
    rows = _block_rows(fetched.incoming, tables, n_local)
    counts = fetched.incoming_counts
    sources = [s for s, count in enumerate(counts) if count]
    out = []
    for i, x in enumerate((dk, dv)):
        if len(sources) <= 1:  # each block named once: a 16-bit add rounds fp32(own) + fp32(returned) once, as below
            own = x.new_empty(b, hkv, n_local * kv_block, d)
            torch.Tensor.copy_(*_as_words(own, x[:, :, cut:]))
            if sources:
                returned = _segment(back, counts, sources[0], i).reshape(rows.numel(), kv_block * d)
                blocks = own.view(b * hkv * n_local, kv_block * d)
                summed = torch.add(_words(blocks).index_select(0, rows).view(x.dtype), returned)
                _words(blocks).index_copy_(0, rows, _words(summed))
            out.append(own)
            continue
        total = x[:, :, cut:].float().contiguous()
        blocks = total.view(b * hkv * n_local, kv_block * d)
        start = 0
        for source in sources:  # fixed order; one source names a block once
            returned = _segment(back, counts, source, i).reshape(counts[source], kv_block * d)
            blocks.index_add_(0, rows[start:start + counts[source]], returned.float())
            start += counts[source]
        out.append(total.to(x.dtype))
    return out[0], out[1]


def return_gradients(dk: torch.Tensor, dv: torch.Tensor, fetched: Fetched, tables, kv_block: int,
                     group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of this rank's own shard from the local gradients over [prefix | own shard]: the prefix's go
    back to their owners (the fetch's all_to_all reversed), and each owner adds what it receives."""
    out = prefix_gradients(dk, dv, fetched, tables[0].numel(), kv_block)
    back = group.all_to_all(out, wire_rows(fetched.requests.counts), wire_rows(fetched.incoming_counts))
    return add_returned(dk, dv, back, fetched, tables, kv_block)

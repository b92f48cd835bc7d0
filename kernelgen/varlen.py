"""Packed sequences of different lengths, in FlashAttention's varlen layout: q [total, Hq, D], k and v
[total, Hkv, D], the sequences one after another, `cu_seqlens` (int32 [n + 1]) their bounds (`attn.varlen`).

They run as right-padded batches (`attn(q, k, v, seqlens=)`), so each sequence selects and attends exactly as it
would alone, bit for bit. Sequences of similar lengths share a batch, padded to its longest (less than twice
each one's length): the padding costs copies and memory, never attention. A sequence in a batch of its own runs
as the call over it alone, on views of the packed tensors.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import KernelgenTypeError, KernelgenValueError
from .inputs import BlockLists, ReadOnce, check_length
from .spec import Spec

__all__ = ["VARLEN_LAYOUT", "VARLEN_INDEX_LAYOUT", "VARLEN_CACHE_LAYOUT", "PackedBatch", "QueryGroup", "check_packed",
           "check_cu_seqlens", "check_max_seqlen", "sequence_lengths", "packed_attention", "packed_batches",
           "batch_call", "batch_outputs", "batch_lists", "check_packed_over_cache", "query_groups", "group_rows",
           "packed_cache_attention", "group_queries", "group_outputs"]

VARLEN_LAYOUT = ("q [total, Hq, D], k and v [total, Hkv, D] (FlashAttention's varlen layout: the sequences one "
                 "after another), cu_seqlens int32 [n + 1] (0, then each sequence's end)")
VARLEN_INDEX_LAYOUT = ("index=(q_idx, k_idx, w) packed as q is: q_idx [total, Hkv*Hi, Di], k_idx [total, Hkv or 1, "
                       "Di], w [total, Hkv*Hi]")
VARLEN_CACHE_LAYOUT = ("q [total, Hq, D] (each cache row's new queries one after another, cu_seqlens int32 [B + 1] "
                       "their bounds), k and v the cache ([B, Hkv, capacity, D], or pools of pages with "
                       "block_table=), index=(q_idx [total, Hkv*Hi, Di], k_idx as k, w [total, Hkv*Hi]), new keys "
                       "k_new and v_new [total, Hkv, D] (k_idx_new [total, k_idx's heads, Di])")
# A sequence shares a batch padded to at most this factor of its length: a batch more is a few launches more, a
# padded token a copy and memory (never attention).
PADDING_SLACK = 2
# A sequence this long runs alone: its call fills the GPU, and the padded call's per-row kernels are slower than
# the tuned ones of a call over one sequence (on an H100, 12288 and 8192 tokens padded together took longer than
# their two calls).
ALONE_TOKENS = 4096


class PackedBatch(NamedTuple):
    """Some of the packed sequences as one right-padded batch: `sequences` (int64 [m], ascending), each a row
    of `length` positions (its longest), `seqlens` (int32 [m]) their lengths; each of the batch's tokens, in
    packed order, at (`row`, `pos`) of the batch, from `tokens` of the packed tensors (None: all of them, in
    order). `start`: where a batch of one sequence (read on the host) begins; it runs as the call over that
    sequence alone, on views of the packed tensors (no copy, and not the padded call's per-row kernels)."""

    sequences: torch.Tensor
    length: int
    seqlens: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    tokens: torch.Tensor | None
    start: int | None = None


def check_packed(q, k, v, cu_seqlens, max_seqlen, spec: Spec, index=None) -> tuple[int, int | None]:
    """(total tokens, max_seqlen or None) of a varlen call, its layout checked (the index selector's vectors'
    too); dtypes, devices and strides are the padded call's to check."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise KernelgenTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise KernelgenValueError(f"varlen takes {VARLEN_LAYOUT}; {name} has shape {tuple(x.shape)}")
    total, heads_q, head_dim = q.shape
    if k.shape[0] != total or v.shape[0] != total:
        raise KernelgenValueError(f"varlen is self-attention over packed sequences: q, k and v hold the same tokens, "
                                  f"got {total}, {k.shape[0]} and {v.shape[0]} ({VARLEN_LAYOUT})")
    if k.shape != v.shape:
        raise KernelgenValueError(f"k and v must have the same shape [total, Hkv, D], got {tuple(k.shape)} and "
                                  f"{tuple(v.shape)}")
    if head_dim != spec.head_dim or k.shape[2] != spec.head_dim:
        raise KernelgenValueError(f"the head dim of q and k must be spec.head_dim={spec.head_dim}, got {head_dim} "
                                  f"and {k.shape[2]} ({VARLEN_LAYOUT})")
    if heads_q != spec.gqa_group * k.shape[1]:
        raise KernelgenValueError(f"q must have spec.gqa_group x Hkv = {spec.gqa_group} x {k.shape[1]} heads, got "
                                  f"{heads_q} ({VARLEN_LAYOUT})")
    if not spec.causal:
        raise KernelgenValueError("varlen needs a causal spec: each sequence runs as a row of a right-padded batch, "
                                  "whose queries must see none of the padding after its tokens")
    if (spec.selector == "index" or index is not None) and not spec.per_query:
        raise KernelgenValueError("varlen takes the index selector with per-query lists (schedule='kv_centric') "
                                  "only: a Q tile's score is a maximum over its queries, and a sequence's last tile "
                                  "holds padding")
    if index is not None:
        _check_packed_index(index, total, k.shape[1])
    check_cu_seqlens(cu_seqlens, q.device)
    return total, check_max_seqlen(max_seqlen)


def _check_packed_index(index, total: int, heads_kv: int) -> None:
    """The index selector's packed vectors, named in their packed layout (the padded call checks dtypes and
    devices): ranks, token counts, heads, Di and unit last strides."""
    if not isinstance(index, (tuple, list)) or len(index) != 3:
        raise KernelgenTypeError(f"varlen takes {VARLEN_INDEX_LAYOUT}, got {type(index).__name__}")
    for name, x, rank in zip(("q_idx", "k_idx", "w"), index, (3, 3, 2)):
        if not isinstance(x, torch.Tensor):
            raise KernelgenTypeError(f"index: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank or x.shape[0] != total:
            raise KernelgenValueError(f"varlen takes {VARLEN_INDEX_LAYOUT} with total = {total}; {name} has shape "
                                      f"{tuple(x.shape)}")
    q_idx, k_idx, w = index
    heads = q_idx.shape[1]
    for name, fine, expected in (("q_idx", heads and heads % heads_kv == 0, f"Hkv*Hi heads (Hkv = {heads_kv})"),
                                 ("k_idx", k_idx.shape[1] in (heads_kv, 1), f"Hkv = {heads_kv} or 1 heads"),
                                 ("k_idx", k_idx.shape[2] == q_idx.shape[2], f"q_idx's Di = {q_idx.shape[2]}"),
                                 ("w", w.shape[1] == heads, f"q_idx's {heads} heads")):
        if not fine:
            raise KernelgenValueError(f"index: {name} must have {expected} ({VARLEN_INDEX_LAYOUT}), got shapes "
                                      f"q_idx {tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, w {tuple(w.shape)}")
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx)):
        if x.stride(-1) != 1:
            raise KernelgenValueError(f"index: {name} must be contiguous in its last dim (stride 1), got strides "
                                      f"{x.stride()}")


def check_cu_seqlens(cu_seqlens, device, name: str = "cu_seqlens") -> None:
    """A varlen call's bounds (`name` is the caller's argument): int32 [n + 1] on the queries' device."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise KernelgenTypeError(f"{name} must be a torch.Tensor (int32 [n + 1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise KernelgenTypeError(f"{name} must be int32, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise KernelgenValueError(f"{name} must be 1-D [n + 1] for n >= 1 sequences, got shape "
                                  f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise KernelgenValueError(f"{name} is on {cu_seqlens.device} but q is on {device}")


def check_max_seqlen(max_seqlen, name: str = "max_seqlen") -> int | None:
    """A varlen call's longest sequence, or None."""
    if max_seqlen is not None and torch.compiler.is_compiling():
        # the compiler may make it dynamic (an int that changed between calls): compare it, never take its value,
        # which would recompile for each new one (packed_batches pads to a power of two at or above it)
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise KernelgenTypeError(f"{name} must be an int, got {type(max_seqlen).__name__}")
        if max_seqlen < 1:
            raise KernelgenValueError(f"{name} must be a positive int")
        return max_seqlen
    return None if max_seqlen is None else check_length(name, max_seqlen)


def packed_attention(call, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                     lists=None, index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """o [total, Hq, D] and lse [total, Hq] of checked packed sequences, each batch of them attended by
    `call(q, k, v, **options) -> (o, lse)`, a padded batch's attention (options: `seqlens=`, `block_idx=` where
    `lists(batch)` gives the batch's lists, and `index=`, the packed index vectors' batch). Each token's o and lse
    are written once, in place (no concatenation): a batch's sequence alone is a slice."""
    batches = packed_batches(cu_seqlens, q.shape[0], max_seqlen)
    o, lse = q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)
    for batch in batches:
        inputs, options = batch_call(batch, q, k, v)
        if lists is not None:
            options["block_idx"] = lists(batch)
        if index is not None:  # w's padded rows [m, H, length] as the selector reads them: unit stride last
            q_idx, k_idx, w = batch_call(batch, *index)[0]
            options["index"] = (q_idx, k_idx, w.contiguous())
        o_batch, lse_batch = batch_outputs(batch, *call(*inputs, **options))
        if len(batches) == 1 and batch.tokens is None:  # every token, in packed order
            o, lse = o_batch, lse_batch
        elif batch.start is not None:
            o[batch.start:batch.start + batch.length], lse[batch.start:batch.start + batch.length] = o_batch, lse_batch
        else:
            o[batch.tokens], lse[batch.tokens] = o_batch, lse_batch
    if not batches:  # no tokens at all: an empty o, still of q's graph (a loss over it backpropagates)
        o = q * 0
    return o, lse


def packed_batches(cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None) -> list[PackedBatch]:
    """The padded batches a varlen call runs. Eagerly, from the bounds read once per cu_seqlens tensor (one
    device sync; the layers of a step, passing the same tensor, share it) and checked. Under torch.compile
    every sequence in one batch of `max_seqlen` positions, checked on the device."""
    if torch.compiler.is_compiling():
        if max_seqlen is None:
            raise KernelgenValueError("under torch.compile varlen needs max_seqlen= (an int): the longest "
                                      "sequence would be read from the device")
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        torch._assert_async((cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (lengths >= 0).all()
                            & (lengths <= max_seqlen).all(),
                            "cu_seqlens must rise from 0 to the packed tokens, each sequence at most max_seqlen")
        n = lengths.shape[0]
        return [_batch(torch.arange(n, device=cu_seqlens.device), _traced_length(max_seqlen), lengths,
                       cu_seqlens[:-1], total, every_token=True)]
    return _read_batches.get((cu_seqlens,), (total, max_seqlen),
                             lambda: _batches_of(cu_seqlens.tolist(), total, max_seqlen, cu_seqlens.device))


def _traced_length(max_seqlen) -> int:
    """The padded length of a compiled call's batch: the power of two at or above max_seqlen. Where the compiler
    made max_seqlen dynamic (a SymInt, as it does to an int that changed between calls), each comparison guards
    its range, not its value: the call is recompiled once per doubling of the longest sequence, not for each."""
    length = 1
    while length < max_seqlen:
        length *= 2
    return length


_read_batches = ReadOnce()  # the last cu_seqlens' batches: the layers of a step share one tensor


def sequence_lengths(bounds: list[int], total: int) -> list[int]:
    """The packed sequences' lengths of bounds read on the host, checked: rising from 0 to `total`."""
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != total or min(lengths) < 0:
        raise KernelgenValueError(f"cu_seqlens must rise from 0 to the {total} packed tokens (each sequence's end "
                                  f"at or after its start), got {_shown(bounds)}")
    return lengths


def _batches_of(bounds: list[int], total: int, max_seqlen: int | None, device) -> list[PackedBatch]:
    lengths = sequence_lengths(bounds, total)
    if max_seqlen is not None and max(lengths) > max_seqlen:
        raise KernelgenValueError(f"a sequence of {max(lengths)} tokens is longer than max_seqlen={max_seqlen}")
    # longest first: a batch is padded to its first sequence and takes those longer than half of it, so that
    # no sequence is padded to twice its length and there is a batch per halving of the lengths at most
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] < ALONE_TOKENS and lengths[i] * PADDING_SLACK > lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    batches = []
    for group in groups:
        longest = lengths[group[0]]
        group.sort()  # packed order: a batch of every sequence reads the packed tensors as they are
        every_token = sum(lengths[i] for i in group) == total
        batches.append(_batch(torch.tensor(group, device=device), longest,
                              torch.tensor([lengths[i] for i in group], device=device, dtype=torch.int32),
                              torch.tensor([bounds[i] for i in group], device=device), sum(lengths[i] for i in group),
                              every_token, bounds[group[0]] if len(group) == 1 else None))
    return batches


def _batch(sequences, length: int, lengths, starts, tokens: int, every_token: bool,
           start: int | None = None) -> PackedBatch:
    lengths = lengths.long()
    row = torch.repeat_interleave(torch.arange(sequences.shape[0], device=sequences.device), lengths,
                                  output_size=tokens)
    first = torch.cumsum(lengths, 0) - lengths  # each row's first token among the batch's
    pos = torch.arange(tokens, device=sequences.device) - first[row]
    return PackedBatch(sequences, length, lengths.to(torch.int32), row, pos,
                       None if every_token else starts.to(torch.int64)[row] + pos, start)


def _shown(bounds: list[int]) -> str:
    return str(bounds) if len(bounds) <= 12 else f"[{', '.join(map(str, bounds[:10]))}, ..., {bounds[-1]}]"


def batch_call(batch: PackedBatch, q, k, v) -> tuple[tuple[torch.Tensor, ...], dict]:
    """The (q, k, v) and options of the call a batch runs: its sequence alone (a view), or its padded batch."""
    if batch.start is not None:
        return tuple(x[batch.start:batch.start + batch.length].transpose(0, 1)[None] for x in (q, k, v)), {}
    return (pad(q, batch), pad(k, batch), pad(v, batch)), {"seqlens": batch.seqlens}


def batch_outputs(batch: PackedBatch, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's o [m, Hq, length, D] and lse [m, Hq, length] at the batch's tokens: [tokens, Hq, D], [tokens, Hq]."""
    if batch.start is not None:
        return o[0].transpose(0, 1), lse[0].t()
    return unpad(o, batch), unpad(lse, batch)


def pad(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """A packed [total, H, D] tensor's sequences of `batch` as a right-padded [m, H, length, D] batch (zeros
    past each row's tokens: padding must be finite)."""
    tokens = x if batch.tokens is None else x.index_select(0, batch.tokens)
    padded = x.new_zeros((batch.sequences.shape[0], batch.length) + tuple(x.shape[1:]))
    return padded.index_put((batch.row, batch.pos), tokens).transpose(1, 2)


def unpad(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """A padded batch's [m, H, length, ...] output back to its tokens, [tokens, H, ...] in packed order."""
    return x.transpose(1, 2)[batch.row, batch.pos]


def batch_lists(block_idx, batch: PackedBatch, spec: Spec, n: int, heads_kv: int,
                max_seqlen: int | None = None) -> torch.Tensor | None:
    """A varlen call's lists (a padded batch's: [n, Hkv, rows, top_k], row d sequence d's lists) for `batch`;
    their shape checked whole (an error shows the caller's, not a batch's slice of it). A compiled call's batch,
    padded past `max_seqlen`, takes rows of -1 (empty lists) for its padding's tiles."""
    if block_idx is None:
        return None
    if isinstance(block_idx, BlockLists):
        raise KernelgenTypeError("varlen takes block_idx as a tensor (a padded batch's lists, one row per "
                                 "sequence), not prepared BlockLists: each batch of sequences takes its rows of it")
    if not isinstance(block_idx, torch.Tensor):
        raise KernelgenTypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    rows = spec.n_q_tiles(batch.length)
    needed = rows if max_seqlen is None or batch.length <= max_seqlen else spec.n_q_tiles(max_seqlen)
    if (block_idx.dim() != 4 or block_idx.shape[0] != n
            or (block_idx.shape[1] != 1 and block_idx.shape[1] != heads_kv)  # not `in`: dynamo (SymInt)
            or block_idx.shape[2] < needed or block_idx.shape[3] != spec.top_k):
        what = "Nq = max_seqlen" if spec.per_query else "n_q_tiles(max_seqlen)"
        raise KernelgenValueError(f"varlen's block_idx is a padded batch's lists, [n, Hkv, {what}, top_k] with "
                                  f"n = {n} sequences, Hkv = {heads_kv} (or 1), at least {needed} rows and top_k = "
                                  f"{spec.top_k} (row d: sequence d's lists, ids from its first token), got "
                                  f"{tuple(block_idx.shape)}")
    if block_idx.shape[2] < rows:
        block_idx = torch.nn.functional.pad(block_idx, (0, 0, 0, rows - block_idx.shape[2]), value=-1)
    if batch.sequences.shape[0] == n and block_idx.shape[2] == rows:  # every sequence, in order
        return block_idx
    return block_idx.index_select(0, batch.sequences)[:, :, :rows]


# ---- packed queries over a KV cache (`attn.varlen(q, k_cache, v_cache, cu_seqlens, cache_seqlens=...)`) --------

class QueryGroup(NamedTuple):
    """The rows of a varlen call over a KV cache that hold `count` new queries each: `rows` (int64 [m], ascending,
    on the device), their queries' packed positions row after row (`tokens`, int64 [m * count]); `every_row`: all of
    the cache's rows, in order, so that the packed queries are `[B, count]` as they lie; `first`: (first row, first
    token) where the rows are consecutive (so are their tokens), their tensors then slices, else None."""

    rows: torch.Tensor
    count: int
    tokens: torch.Tensor
    every_row: bool
    first: tuple[int, int] | None


def check_packed_over_cache(q, k, cu_seqlens, rows: int, index=None, new=(None, None, None),
                            paged: bool = False) -> int:
    """The packed queries of a varlen call over a KV cache `k` of `rows` batch rows (`VARLEN_CACHE_LAYOUT`; `paged`:
    k is a pool of pages): q 3-D, cu_seqlens int32 [rows + 1] on q's device, the index selector's packed q_idx and
    w and its k_idx (the cache's index keys, laid out as k), and the packed new keys (`new`: k_new, v_new,
    k_idx_new, [total, heads, width] of the cache's heads and width, a key a query); dtypes, devices and the rest
    the calls each group runs check, before any writes. Returns the packed query count."""
    if not isinstance(q, torch.Tensor):
        raise KernelgenTypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise KernelgenValueError(f"varlen over a KV cache takes {VARLEN_CACHE_LAYOUT}; q has shape {tuple(q.shape)}")
    check_cu_seqlens(cu_seqlens, q.device)
    if cu_seqlens.shape[0] != rows + 1:
        source = "block_table's rows" if paged else "k.shape[0]"
        raise KernelgenValueError(f"cu_seqlens must have one bound more than the cache's {rows} rows ({source}), "
                                  f"[B + 1] = [{rows + 1}], got {tuple(cu_seqlens.shape)} ({VARLEN_CACHE_LAYOUT})")
    total = q.shape[0]
    k_idx = None
    if index is not None:
        if not isinstance(index, (tuple, list)) or len(index) != 3:
            raise KernelgenTypeError(f"varlen over a KV cache takes {VARLEN_CACHE_LAYOUT}, got index as "
                                     f"{type(index).__name__}")
        k_idx = index[1]
        if not isinstance(k_idx, torch.Tensor):
            raise KernelgenTypeError(f"index: k_idx must be a torch.Tensor, got {type(k_idx).__name__}")
        if k_idx.dim() != 4 or k_idx.shape[0] != k.shape[0] or k_idx.shape[1] not in (k.shape[1], 1) or \
                k_idx.shape[2] != k.shape[2]:
            layout = "a pool of k's pages [n_pages, Hkv or 1, page_size, Di]" if paged else \
                "[B, Hkv or 1, capacity, Di], as k"
            raise KernelgenValueError(f"index: k_idx is the cache's index keys, {layout} = [{k.shape[0]}, "
                                      f"{k.shape[1]} or 1, {k.shape[2]}, Di], got {tuple(k_idx.shape)}")
    widths = (("k_new", (k.shape[1], k.shape[3])), ("v_new", (k.shape[1], k.shape[3])),
              ("k_idx_new", None if k_idx is None else (k_idx.shape[1], k_idx.shape[3])))
    for (name, expected), x in zip(widths, new):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise KernelgenTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[0] != total or (expected is not None and tuple(x.shape[1:]) != expected):
            heads, width = ("heads", "width") if expected is None else expected
            raise KernelgenValueError(f"varlen over a KV cache takes {name} packed as q, [total, heads, width] = "
                                      f"[{total}, {heads}, {width}] (a row's new tokens, a key a query), got "
                                      f"{tuple(x.shape)}")
    if index is not None:
        for name, x, rank in (("q_idx", index[0], 3), ("w", index[2], 2)):
            if not isinstance(x, torch.Tensor):
                raise KernelgenTypeError(f"index: {name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != rank or x.shape[0] != total:
                raise KernelgenValueError(f"varlen over a KV cache takes {VARLEN_CACHE_LAYOUT} with total = {total}; "
                                          f"{name} has shape {tuple(x.shape)}")
    return total


def query_groups(cu_seqlens: torch.Tensor, total: int) -> list[QueryGroup]:
    """The groups of rows a varlen call over a cache runs, one per query count (rows of none are left out), from
    the bounds read once per cu_seqlens tensor (one device sync; the layers of a step share it) and checked."""
    return _read_groups.get((cu_seqlens,), total,
                            lambda: _groups_of(cu_seqlens.tolist(), total, cu_seqlens.device))


_read_groups = ReadOnce()


def _groups_of(bounds: list[int], total: int, device) -> list[QueryGroup]:
    lengths = sequence_lengths(bounds, total)
    by_count: dict[int, list[int]] = {}
    for row, count in enumerate(lengths):
        if count:
            by_count.setdefault(count, []).append(row)
    groups = []
    for count, rows in sorted(by_count.items()):
        starts = torch.tensor([bounds[row] for row in rows])
        tokens = (starts[:, None] + torch.arange(count)).flatten()
        consecutive = rows[-1] - rows[0] == len(rows) - 1
        groups.append(QueryGroup(torch.tensor(rows, device=device), count, tokens.to(device),
                                 len(rows) == len(lengths), (rows[0], bounds[rows[0]]) if consecutive else None))
    return groups


def group_rows(x: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's rows of a tensor of the cache's rows (dim 0): a slice where they are consecutive (no copy: a
    step's rows of one query count usually are), else a copy."""
    if group.first is None:
        return x.index_select(0, group.rows)
    return x.narrow(0, group.first[0], group.rows.shape[0])


def group_queries(x: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """A packed [total, H, ...] tensor's queries of `group` as a call's [m, H, count, ...] (a view where the rows are
    consecutive: their queries then lie as [m, count] rows)."""
    m = group.rows.shape[0]
    if group.first is None:
        picked = x.index_select(0, group.tokens)
    else:
        picked = x.narrow(0, group.first[1], m * group.count)
    return picked.view(m, group.count, *x.shape[1:]).transpose(1, 2)


def group_outputs(o: torch.Tensor, lse: torch.Tensor, group: QueryGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's call's o [m, Hq, count, D] and lse [m, Hq, count] as its tokens' [m * count, Hq, D], [.., Hq]."""
    return o.transpose(1, 2).flatten(0, 1), lse.transpose(1, 2).flatten(0, 1)


def packed_cache_attention(call, q: torch.Tensor, groups: list[QueryGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """o [total, Hq, D] and lse [total, Hq] of packed queries over a KV cache, each group of rows attended by
    `call(group) -> (o, lse)` (its rows' call over the cache, [m, Hq, count, ...]); each token's written once."""
    if len(groups) == 1 and groups[0].every_row:
        return group_outputs(*call(groups[0]), groups[0])
    # every token is in a group (a row of no queries has no tokens): no fill; index_copy_ takes fewer host steps
    # than o[tokens] = ..., twice a group
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
    for group in groups:
        group_o, group_lse = group_outputs(*call(group), group)
        o.index_copy_(0, group.tokens, group_o)
        lse.index_copy_(0, group.tokens, group_lse)
    return o, lse

"""Interop: kernelgen's block lists to and from torch's FlexAttention `BlockMask`, from fla-core's NSA lists, and
FlashInfer's paged-cache indices as a block table.

    lists = kernelgen.from_block_mask(block_mask, spec)        # int32 [B, Hkv, n_q_tiles, top_k], -1 padded
    block_mask = kernelgen.to_block_mask(lists, spec, seq_q, seq_k)
    o = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=spec.gqa_group > 1)
    lists = kernelgen.from_fla_lists(block_indices, block_counts)  # NSA's [B, T, Hkv, S] as [B, Hkv, T, S]
    table, lens = kernelgen.from_flashinfer_pages(kv_indptr, kv_indices, kv_last_page_len, page_size)

The two structures say the same thing at different grain. A `BlockMask`
(`torch.nn.attention.flex_attention`) lists, per (batch, query head, Q block), the KV blocks to visit: the
`full_kv_*` ones whole, the `kv_*` ones through its `mask_mod` (a token-level predicate). kernelgen's lists
name, per (batch, KV head, Q tile), the KV blocks the `G` query heads of that KV head attend to, and
kernelgen's own token-level mask is the causal one (bottom-right aligned, docs/SEMANTICS.md) when
`spec.causal`, else none. The rules of each direction are in the functions' docstrings.
"""
from __future__ import annotations

import torch

from .errors import KernelgenTypeError, KernelgenValueError
from .inputs import BlockLists, check_length, lists_layout
from .spec import Spec
from .varlen import sequence_lengths

__all__ = ["to_block_mask", "from_block_mask", "from_fla_lists", "from_flashinfer_pages", "block_membership",
           "block_mask_blocks"]


def to_block_mask(lists, spec: Spec, seq_q: int, seq_k: int, *, q_block: int | None = None,
                  exact_mask_mod: bool = True, cache_seqlens: torch.Tensor | None = None):
    """A FlexAttention `BlockMask` that attends exactly as kernelgen does over `lists`.

    lists      int32 or int64 `[B, Hkv, n_q_tiles, top_k]` (per-query lists of `schedule="kv_centric"`:
               `[B, Hkv, Nq, top_k]`), or the `BlockLists` of `attn.prepare`. `-1`, out-of-range and repeated
               ids are dropped: a list is a set of blocks (docs/SEMANTICS.md, "Block lists").
    spec       the kernelgen spec the lists are for: kv_block, q_tile, causal, window and gqa_group are read.
               Forced blocks (sink, local, the causal diagonal) are part of the lists a selector emits, and
               given lists are attended as they are, so the mask holds the lists' blocks and no other.
    seq_q, seq_k   the query and key lengths (the mask's `seq_lengths`).
    q_block    the mask's Q block size (default: spec.q_tile; per-query lists: spec.kv_block). It must
               divide the queries of one list (q_tile, or 1 for per-query lists) or be a multiple of them;
               a Q block that spans several lists visits the union of their blocks, and the mask_mod keeps
               each query to its own list.
    exact_mask_mod  True (default): the mask_mod keeps a (query, key) pair iff the key's block is in the
               query's list, the key is inside seq_k and, with spec.causal, key <= query + seq_k - seq_q.
               Eager `flex_attention` and `create_mask` apply the mask_mod alone (they ignore the block
               lists), so they need this. False: the mask_mod is the causal (or in-range) predicate alone,
               which is exact for the fused (torch.compile'd) kernel, which calls it only inside the kv_*
               blocks of lists that are one per Q block, and one table look-up cheaper per element; a Q block
               spanning several lists (per-query lists with q_block > 1) needs the exact mask_mod and refuses
               False.

    cache_seqlens  int32 `[B]` on the lists' device: seq_k is a KV cache's capacity whose row b holds its first
               cache_seqlens[b] keys, its queries the last seq_q positions of those (a decode call's or a prefill's
               over a cache of per-row lengths, docs/SEMANTICS.md): the row's causal diagonal and key edge are its
               own, and listed blocks past its keys are dropped (empty slots). The mask_mod reads the lengths on
               the device.

    Blocks every query of a Q block sees whole (both blocks inside seq_q and seq_k, below the causal diagonal of
    the Q block's first query, held by every list the Q block spans) go to `full_kv_*`: the fused kernel visits
    them without a mask_mod call. The others go to `kv_*`. The mask has `Hkv * G` heads (the `G` query heads of
    a KV head share its list) and the lists' batch; a size of 1 broadcasts in FlexAttention."""
    from torch.nn.attention.flex_attention import BlockMask

    _check_spec(spec)
    _check_flag("exact_mask_mod", exact_mask_mod)
    seq_q, seq_k = check_length("seq_q", seq_q), check_length("seq_k", seq_k)
    idx = _lists_tensor(lists, spec, seq_q, seq_k)
    n_blocks, per_list = spec.n_kv_blocks(seq_k), spec.list_queries
    q_block = _check_q_block(q_block, spec)
    if not exact_mask_mod and q_block > per_list:
        raise KernelgenValueError(f"exact_mask_mod=False needs one list per Q block, but q_block={q_block} spans "
                                  f"{q_block // per_list} lists: their queries differ, so the mask_mod must look "
                                  "each one's list up (exact_mask_mod=True)")
    member = block_membership(idx, n_blocks)  # [B, Hkv, n_lists, n_blocks]
    b, hkv, n_lists, _ = member.shape
    n_q_blocks = -(-seq_q // q_block)
    if q_block <= per_list:  # each Q block lies inside one list's queries
        rows = torch.arange(n_q_blocks, device=idx.device) * q_block // per_list
        union = held_by_all = member[:, :, rows]
    else:  # each Q block spans `span` lists; rows past the last list hold nothing and do not count for "all"
        span = q_block // per_list
        pad = n_q_blocks * span - n_lists
        grouped = (n_q_blocks, span, n_blocks)
        union = torch.nn.functional.pad(member, (0, 0, 0, pad), value=False).view(b, hkv, *grouped).any(3)
        held_by_all = torch.nn.functional.pad(member, (0, 0, 0, pad), value=True).view(b, hkv, *grouped).all(3)
    # each row's keys: [B, 1, 1] (one length for every row without cache_seqlens)
    row_keys = (torch.full((1,), seq_k, device=idx.device) if cache_seqlens is None
                else _row_lengths(cache_seqlens, b, seq_k, idx.device))[:, None, None]
    # as create_block_mask has it, a block crossing seq_q or seq_k is partial: its padding is masked
    block_end = (torch.arange(n_blocks, device=idx.device) + 1) * spec.kv_block
    q_block_end = (torch.arange(n_q_blocks, device=idx.device) + 1) * q_block
    whole = (block_end <= row_keys) & (q_block_end <= seq_q)[:, None]  # [B or 1, n_q_blocks, n_blocks]
    if spec.causal:  # the block's last key is visible to the Q block's first query
        first_query = torch.arange(n_q_blocks, device=idx.device)[:, None] * q_block
        whole = whole & (block_end - 1 <= first_query + (row_keys - seq_q))
    if spec.window is not None:  # and its first key inside the window of the Q block's last query
        last_query = torch.clamp(torch.arange(1, n_q_blocks + 1, device=idx.device) * q_block, max=seq_q)[:, None] - 1
        whole = whole & (block_end - spec.kv_block > last_query + (row_keys - seq_q) - spec.window)
    union = union & (block_end - spec.kv_block < row_keys)[:, None]  # blocks past a row's keys: empty slots
    full = held_by_all & whole[:, None]
    kv_num, kv_ids = _kv_blocks(union & ~full)
    full_num, full_ids = _kv_blocks(full)
    g = spec.gqa_group
    lengths = None if cache_seqlens is None else row_keys.view(-1)
    mask_mod = (_lists_mask_mod(member, spec, seq_q, seq_k, lengths) if exact_mask_mod
                else _causal_mask_mod(spec, seq_q, seq_k, lengths))
    return BlockMask.from_kv_blocks(*(x.repeat_interleave(g, 1) for x in (kv_num, kv_ids, full_num, full_ids)),
                                    BLOCK_SIZE=(q_block, spec.kv_block), mask_mod=mask_mod,
                                    seq_lengths=(seq_q, seq_k))


def from_block_mask(block_mask, spec: Spec, *, union_heads: bool = False, approximate: bool = False) -> torch.Tensor:
    """kernelgen's lists of a FlexAttention `BlockMask`: int32 `[B, Hkv, n_q_tiles, top_k]` (per-query lists
    for `schedule="kv_centric"`: `[B, Hkv, Nq, top_k]`), each list its valid ids ascending, then -1;
    `n_q_tiles` from the mask's `seq_lengths`. Pass them as `block_idx` to a `selector="given"` kernel.

    - **Blocks.** A list holds the union of the Q block's `kv_*` (partial) and `full_kv_*` blocks. Under
      `spec.causal`, a block no query of the tile can see is left out (kernelgen would mask it whole): it
      would only take a slot of `top_k`.
    - **Token-level mask.** Only the block structure is carried. Inside the listed blocks kernelgen applies
      its own mask: causal (key <= query + Nk - Nq, bottom-right aligned) with `spec.causal`, and the sliding
      window with `spec.window` (key > query + Nk - Nq - window), else none.
      kernelgen's attention therefore equals FlexAttention's when the mask's `mask_mod` is, inside its blocks,
      that causal predicate (with the window: FlexAttention's sliding-window mask) or always true. `sink` and
      `local` are not added: given lists are attended as they are. What the mask's structure shows to differ is
      a ValueError naming the first such block, unless `approximate=True` (the block structure alone, the result
      then FlexAttention's only approximately):
      a full block (`full_kv_*`, every pair kept) of which kernelgen's causal mask hides part (a non-causal
      mask for a causal spec, a prefix kept whole), and a partial block (`kv_*`: the mask_mod drops some pair)
      that kernelgen attends whole and that does not cross `Nq` or `Nk` (a sliding window, document boundaries,
      a causal mask for a non-causal spec, or FlexAttention's top-left `q_idx >= kv_idx` where `Nq != Nk`). A
      mask without `full_kv_*` blocks (made by `BlockMask.from_kv_blocks` with a mask_mod) shows no full
      block, so each block kernelgen attends whole is such a partial block; with the default (no-op) mask_mod
      its blocks are full. The check reads the block structure, not the mask_mod: a partial block that
      kernelgen also masks (the causal diagonal) is taken to be masked as kernelgen masks it.
    - **Block sizes.** The mask's `BLOCK_SIZE = (Q block, KV block)`. The KV block must equal `spec.kv_block`
      or be a multiple of it (each mask block becomes that many kernelgen blocks). The Q block must equal the
      queries of one list (`spec.q_tile`; 1 for per-query lists) or be a multiple of them (the lists of one Q
      block are the same). Anything else is a ValueError naming `block_mask.BLOCK_SIZE`.
    - **Heads.** A mask with one head (made with `H=None`) gives one list per batch for every head: `Hkv = 1`,
      to `expand` to the call's KV heads. A mask with `H` query heads gives `H // spec.gqa_group` KV heads:
      the `G` heads of a group must list the same blocks, since kernelgen's list is shared by them; a group
      whose heads differ is a ValueError, as FlexAttention users expect their per-head masks to be kept.
      `union_heads=True` takes the union of the group's blocks instead: every head of the group then attends
      to the blocks any of them lists (a superset: the output differs from the mask's for the other heads).
    - **Batch.** As the mask's (1 for `B=None`: `expand` the lists to the call's batch).
    - **Budget.** A list holding more than `spec.top_k` blocks is a ValueError naming `spec.top_k`.
    """
    _check_spec(spec)
    _check_block_mask(block_mask)
    _check_flag("union_heads", union_heads)
    _check_flag("approximate", approximate)
    seq_q, seq_k = (int(n) for n in block_mask.seq_lengths)
    mask_q, mask_kv = (int(s) for s in block_mask.BLOCK_SIZE)
    per_list, kv_block = spec.list_queries, spec.kv_block
    if mask_kv % kv_block:
        raise KernelgenValueError(f"block_mask.BLOCK_SIZE = {(mask_q, mask_kv)}: its KV block ({mask_kv}) must equal "
                                  f"spec.kv_block = {kv_block} or be a multiple of it")
    if mask_q % per_list:
        lists_of = "spec.q_tile" if not spec.per_query else "one query (per-query lists)"
        raise KernelgenValueError(f"block_mask.BLOCK_SIZE = {(mask_q, mask_kv)}: its Q block ({mask_q}) must equal "
                                  f"the queries of one list ({lists_of} = {per_list}) or be a multiple of them; a "
                                  "smaller Q block would merge different lists")
    partial, full = block_mask_blocks(block_mask)
    dense = partial | full  # [B, H, n_mask_q_blocks, n_mask_kv_blocks]
    batch, heads = dense.shape[:2]
    g = spec.gqa_group
    if heads > 1:
        if heads % g:
            raise KernelgenValueError(f"block_mask has {heads} heads, not a multiple of spec.gqa_group = {g}: expected "
                                      "Hq = Hkv * G query heads (or 1 for every head)")
        grouped = dense.view(batch, heads // g, g, *dense.shape[2:])
        if not union_heads:
            differs = (grouped != grouped[:, :, :1]).flatten(3).any(-1).nonzero()
            if len(differs):
                bi, hk, gi = (int(x) for x in differs[0])
                raise KernelgenValueError(
                    f"block_mask: query heads {hk * g} and {hk * g + gi} (batch {bi}) of KV head {hk} list different "
                    f"blocks, but kernelgen's list is shared by the spec.gqa_group = {g} query heads of a KV head; "
                    "pass union_heads=True to attend every head of a group to the union of their blocks")
        dense = grouped.any(2)
    if not approximate:
        _check_token_mask(block_mask, partial, full, spec, seq_q, seq_k)
    n_blocks = spec.n_kv_blocks(seq_k)
    dense = dense.repeat_interleave(mask_kv // kv_block, -1)[..., :n_blocks]
    dense = torch.nn.functional.pad(dense, (0, n_blocks - dense.shape[-1]))  # a mask narrower than seq_k
    n_lists = spec.n_q_tiles(seq_q)
    rows = (torch.arange(n_lists, device=dense.device) * per_list // mask_q).clamp(max=dense.shape[2] - 1)
    dense = dense[:, :, rows]
    if spec.causal:
        from .reference import tile_eligibility

        dense = dense & tile_eligibility(spec, seq_q, seq_k, device=dense.device)[0]
    counts = dense.sum(-1)
    if int(counts.max()) > spec.top_k:
        bi, hk, t = (int(x) for x in (counts == counts.max()).nonzero()[0])
        what = "query" if spec.per_query else "Q tile"
        raise KernelgenValueError(f"block_mask lists {int(counts.max())} blocks for (batch {bi}, KV head {hk}, {what} "
                                  f"{t}); spec.top_k = {spec.top_k} holds fewer: raise spec.top_k")
    ids = torch.where(dense, torch.arange(n_blocks, device=dense.device), n_blocks).sort(-1).values
    ids = torch.nn.functional.pad(ids, (0, max(0, spec.top_k - n_blocks)), value=n_blocks)[..., :spec.top_k]
    return torch.where(ids < n_blocks, ids, -1).to(torch.int32).contiguous()


def from_fla_lists(block_indices: torch.Tensor, block_counts=None, *, cu_seqlens: torch.Tensor | None = None,
                   max_seqlen: int | None = None) -> torch.Tensor:
    """kernelgen's per-query lists (`schedule="kv_centric"`, `selector="given"`) of fla-core's NSA selection.

    block_indices  int32 or int64 `[B, T, Hkv, S]`, fla-core's layout (`parallel_nsa`'s `block_indices`): S block
                   ids a (token, KV head), each counted from its sequence's first key.
    block_counts   None (every slot used), an int, or an integer tensor `[B, T, Hkv]`: the slots a (token, KV
                   head) uses, as fla-core's; slots past it become -1 (fla-core leaves them unread, whatever they
                   hold).
    cu_seqlens     int32 or int64 `[n + 1]`, the packed sequences' bounds (fla-core's varlen call, B = 1): the
                   lists of `attn.varlen(q[0], k[0], v[0], cu_seqlens, block_idx=lists)`, a padded batch's
                   `[n, Hkv, rows, S]`, row `d` sequence `d`'s tokens, rows past its length -1. `rows` is the
                   longest sequence, read from the device (one sync),
                   or `max_seqlen` where given (no sync; tokens past it are left out).

    Returns int32 `[B, Hkv, T, S]` (with cu_seqlens `[n, Hkv, rows, S]`; `attn.varlen` takes the bounds as
    int32). Ids keep their meaning: -1 and out-of-range ids are empty slots, a repeated id counts once (fla-core
    attends it once a slot), and the causal mask inside a listed block is kernelgen's (bottom-right, as
    fla-core's with Nq = Nk). Only the selected branch: NSA's compressed and sliding-window branches and
    their gated sum stay the caller's. The spec takes `top_k = S`."""
    if not isinstance(block_indices, torch.Tensor) or block_indices.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError("block_indices must be an int32 or int64 torch.Tensor [B, T, Hkv, S], got "
                                 f"{getattr(block_indices, 'dtype', type(block_indices).__name__)}")
    if block_indices.dim() != 4 or block_indices.shape[-1] < 1:
        raise KernelgenValueError(f"block_indices must be [B, T, Hkv, S] (fla-core's layout), got shape "
                                  f"{tuple(block_indices.shape)}")
    batch, tokens, heads_kv, slots = block_indices.shape
    used = _used_slots(block_counts, block_indices)
    lists = torch.where(used, block_indices, -1).to(torch.int32)
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise KernelgenValueError("max_seqlen is the longest packed sequence: it goes with cu_seqlens")
        return lists.transpose(1, 2).contiguous()
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError("cu_seqlens must be an int32 or int64 torch.Tensor [n + 1], got "
                                 f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if batch != 1:
        raise KernelgenValueError(f"with cu_seqlens, block_indices packs the sequences into one row, [1, T, Hkv, S] "
                                  f"(fla-core's varlen layout), got shape {tuple(block_indices.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.device != block_indices.device:
        raise KernelgenValueError(f"cu_seqlens must be [n + 1] on block_indices' device ({block_indices.device}), "
                                  f"got shape {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    bounds = cu_seqlens.long()
    starts = bounds[:-1]
    if max_seqlen is None:  # one read of the bounds, checked as attn.varlen checks them
        max_seqlen = max(sequence_lengths(cu_seqlens.tolist(), tokens))
    elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise KernelgenTypeError(f"max_seqlen must be an int >= 0 (the longest sequence), got {max_seqlen!r}")
    token = torch.arange(tokens, device=bounds.device)
    sequence = torch.searchsorted(bounds[1:], token, right=True).clamp(max=starts.shape[0] - 1)
    position = token - starts[sequence]
    # a token past max_seqlen goes to a spare row, cut off after (no data-dependent shapes: torch.compile traces it)
    position = position.clamp(max=max_seqlen)
    out = torch.full((starts.shape[0], max_seqlen + 1, heads_kv, slots), -1, dtype=torch.int32, device=lists.device)
    out[sequence, position] = lists[0]
    return out[:, :max_seqlen].transpose(1, 2).contiguous()


def from_flashinfer_pages(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                          page_size: int, *, max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table, cache_seqlens) of a paged KV cache that FlashInfer describes in its CSR form, for kernelgen's
    calls over pages (`attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens)`).

    kv_indptr         int32 `[B + 1]`: row b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]], in order.
    kv_indices        int32 `[nnz]`: page ids in the pool.
    kv_last_page_len  int32 `[B]`: the keys in a row's last page (1 .. page_size; a row of no pages has none).
    page_size         the pool's keys a page (any: pages of whole blocks read fastest).
    max_pages         the most pages a row holds, the table's width: read from the device where not given (one
                      sync, which also checks kv_indptr and kv_last_page_len); given, nothing is read on the host,
                      so the conversion runs inside a CUDA graph or torch.compile (a row of more pages is cut to
                      max_pages, its length with it, and a last page's length is clamped to 1 .. page_size).

    Returns int32 `[B, max_pages]` (-1 past a row's pages: a page of no keys, never read) and int32 `[B]`, each
    row's keys: (pages - 1) * page_size + its last page's, 0 for a row of no pages. FlashInfer's pool
    `[n_pages, 2, page_size, H, D]` (its "NHD" layout) goes in as `k_pages = cache[:, 0].transpose(1, 2)` and
    `v_pages = cache[:, 1].transpose(1, 2)`; its "HND" layout `[n_pages, 2, H, page_size, D]` as `cache[:, 0]`."""
    for name, x, rank in (("kv_indptr", kv_indptr, 1), ("kv_indices", kv_indices, 1),
                          ("kv_last_page_len", kv_last_page_len, 1)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
            raise KernelgenTypeError(f"{name} must be an int32 or int64 torch.Tensor, got "
                                     f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != rank or x.device != kv_indptr.device:
            raise KernelgenValueError(f"{name} must be 1-D on kv_indptr's device ({kv_indptr.device}), got shape "
                                      f"{tuple(x.shape)} on {x.device}")
    rows = kv_indptr.shape[0] - 1
    if rows < 1 or kv_last_page_len.shape[0] != rows:
        raise KernelgenValueError(f"kv_indptr must be [B + 1] for B >= 1 rows and kv_last_page_len [B], got "
                                  f"{tuple(kv_indptr.shape)} and {tuple(kv_last_page_len.shape)}")
    page_size = check_length("page_size", page_size)
    bounds = kv_indptr.long()
    pages = bounds[1:] - bounds[:-1]
    if max_pages is None:
        max_pages = int(pages.max()) if rows else 0
        if int(pages.min()) < 0 or int(bounds[0]) != 0 or int(bounds[-1]) != kv_indices.shape[0]:
            raise KernelgenValueError(f"kv_indptr must rise from 0 to kv_indices' {kv_indices.shape[0]} pages")
        last = kv_last_page_len.long()
        wrong = (pages > 0) & ((last < 1) | (last > page_size))
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0, 0])
            raise KernelgenValueError(f"kv_last_page_len[{row}] = {int(last[row])}: a row with pages holds 1 .. "
                                      f"page_size = {page_size} keys in its last page")
    elif isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 0:
        raise KernelgenTypeError(f"max_pages must be an int >= 0 (the most pages a row holds), got {max_pages!r}")
    entry = torch.arange(kv_indices.shape[0], device=bounds.device)
    row = torch.searchsorted(bounds[1:], entry, right=True).clamp(max=rows - 1)
    column = (entry - bounds[row]).clamp(max=max_pages)  # past max_pages: a spare column, cut off after
    table = torch.full((rows, max_pages + 1), -1, dtype=torch.int32, device=bounds.device)
    table[row, column] = kv_indices.to(torch.int32)
    held = pages.clamp(max=max_pages)
    last = torch.where(pages > max_pages, page_size, kv_last_page_len.long().clamp(1, page_size))
    lengths = torch.where(held > 0, (held - 1) * page_size + last, 0).to(torch.int32)
    return table[:, :max_pages].contiguous(), lengths


def _used_slots(block_counts, block_indices: torch.Tensor) -> torch.Tensor:
    """bool, broadcast against block_indices `[B, T, Hkv, S]`: the slots fla-core's `block_counts` uses."""
    slot = torch.arange(block_indices.shape[-1], device=block_indices.device)
    if block_counts is None:
        return torch.ones_like(slot, dtype=torch.bool)
    if isinstance(block_counts, int) and not isinstance(block_counts, bool):
        return slot < block_counts
    if (not isinstance(block_counts, torch.Tensor) or block_counts.is_floating_point()
            or block_counts.dtype == torch.bool or block_counts.is_complex()):
        raise KernelgenTypeError("block_counts must be None, an int or an integer torch.Tensor [B, T, Hkv], got "
                                 f"{getattr(block_counts, 'dtype', type(block_counts).__name__)}")
    if block_counts.shape != block_indices.shape[:3] or block_counts.device != block_indices.device:
        raise KernelgenValueError(f"block_counts must be [B, T, Hkv] = {tuple(block_indices.shape[:3])} on "
                                  f"block_indices' device, got {tuple(block_counts.shape)} on {block_counts.device}")
    return slot < block_counts[..., None]


def _check_token_mask(block_mask, partial: torch.Tensor, full: torch.Tensor, spec: Spec, seq_q: int, seq_k: int):
    """A ValueError naming the first block where the mask's structure shows its token-level mask differs from
    kernelgen's (`from_block_mask`, "Token-level mask")."""
    from torch.nn.attention.flex_attention import noop_mask

    mask_q, mask_kv = (int(x) for x in block_mask.BLOCK_SIZE)
    n_q_blocks, n_kv_blocks = -(-seq_q // mask_q), -(-seq_k // mask_kv)
    partial, full = (x[:, :, :n_q_blocks, :n_kv_blocks] for x in (partial, full))
    if block_mask.mask_mod is noop_mask:  # every listed pair is kept: its partial blocks are full
        partial, full = torch.zeros_like(partial), partial | full
    device = partial.device
    first_query = torch.arange(n_q_blocks, device=device) * mask_q
    first_key = torch.arange(n_kv_blocks, device=device) * mask_kv
    last_key = (first_key + mask_kv).clamp(max=seq_k) - 1
    edge = (first_query + mask_q > seq_q)[:, None] | (first_key + mask_kv > seq_k)[None, :]
    whole = last_key[None, :] <= first_query[:, None] + (seq_k - seq_q)  # kernelgen sees every pair of the block
    if spec.window is not None:  # and the window of the block's last query holds its first key
        last_query = (first_query + mask_q).clamp(max=seq_q) - 1
        whole = whole & (first_key[None, :] > last_query[:, None] + (seq_k - seq_q) - spec.window)
    if not spec.causal:
        whole = torch.ones_like(whole)
    masked_by_us = (full & ~whole).nonzero()
    masked_by_flex = (partial & whole & ~edge).nonzero()
    for found, what in ((masked_by_us, "keeps every pair of"), (masked_by_flex, "masks part of")):
        if len(found):
            b, h, qb, kb = (int(x) for x in found[0])
            window = ("" if spec.window is None else
                      f" and the sliding window of spec.window={spec.window} keys (key > query + Nk - Nq - window)")
            ours = (f"kernelgen's causal mask (bottom-right aligned: key <= query + Nk - Nq){window} hides part of it"
                    if what.startswith("keeps") else
                    f"kernelgen attends it whole (its masks are the causal one, bottom-right aligned: key <= "
                    f"query + Nk - Nq{window}; FlexAttention's q_idx >= kv_idx is top-left aligned where Nq != Nk)"
                    if spec.causal else "kernelgen attends it whole (spec.causal=False: it masks nothing)")
            other = "a sliding window of another width" if spec.window is not None else "a sliding window"
            raise KernelgenValueError(
                f"block_mask {what} KV block {kb} (keys from {kb * mask_kv}) for Q block {qb} (queries from "
                f"{qb * mask_q}), batch {b}, head {h}, where {ours}: block lists carry no other token-level mask "
                f"({other}, document boundaries, a prefix, another causal alignment). Pass approximate=True to take "
                "the mask's block structure alone (kernelgen's result then differs from FlexAttention's)")


def block_membership(block_idx: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """bool `[..., n_lists, n_blocks]` of lists `[..., n_lists, top_k]`: whether each list holds each block
    (-1 and out-of-range ids hold none; a repeated id counts once)."""
    if not isinstance(block_idx, torch.Tensor) or block_idx.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError(f"block_idx must be an int32 or int64 torch.Tensor [..., n_lists, top_k], got "
                                 f"{getattr(block_idx, 'dtype', type(block_idx).__name__)}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int):
        raise KernelgenTypeError(f"n_blocks must be an int (the KV blocks there are), got {n_blocks!r}")
    if n_blocks < 0:
        raise KernelgenValueError(f"n_blocks must be >= 0 (the KV blocks there are), got {n_blocks}")
    idx = block_idx.long()
    dense = torch.zeros(*idx.shape[:-1], n_blocks + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where((idx >= 0) & (idx < n_blocks), idx, n_blocks), True)
    return dense[..., :n_blocks]


def block_mask_blocks(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): bool `[B, H, n_q_blocks, n_kv_blocks]`, the blocks a BlockMask lists in `kv_*` and in
    `full_kv_*` (all False when it has none)."""
    def dense(num, ids):
        out = torch.zeros(*ids.shape[:3], ids.shape[-1] + 1, dtype=torch.bool, device=ids.device)
        used = torch.arange(ids.shape[-1], device=ids.device) < num[..., None]
        out.scatter_(-1, torch.where(used, ids.long(), ids.shape[-1]), True)
        return out[..., :-1]

    _check_block_mask(block_mask)
    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is None:
        return partial, torch.zeros_like(partial)
    return partial, dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


def _kv_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count int32 `[..., T]`, ids int32 `[..., T, n_blocks]`) of a bool `[..., T, n_blocks]`: the held ids
    first, ascending (a BlockMask's kv_num_blocks and kv_indices)."""
    count = dense.sum(-1, dtype=torch.int32)
    ids = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), ids.contiguous()


def _row_lengths(cache_seqlens, batch: int, seq_k: int, device) -> torch.Tensor:
    """A cache's per-row key counts, checked as a call checks them, clamped to [0, seq_k]."""
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise KernelgenTypeError(f"cache_seqlens must be an int32 torch.Tensor [B], got "
                                 f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
    if cache_seqlens.dim() != 1 or (batch > 1 and cache_seqlens.shape[0] not in (batch, 1)) \
            or cache_seqlens.device != device:
        raise KernelgenValueError(f"cache_seqlens must have shape [B] (the lists' batch, {batch}) on the lists' "
                                  f"device {device}, got {tuple(cache_seqlens.shape)} on {cache_seqlens.device}")
    return cache_seqlens.clamp(0, seq_k)


def _lists_mask_mod(member: torch.Tensor, spec: Spec, seq_q: int, seq_k: int, lengths: torch.Tensor | None = None):
    """mask_mod: the key's block is in the query's list, the key is inside seq_k (its row's keys: `lengths`),
    and causal (and the spec's sliding window) allows."""
    batch, heads_kv, n_lists, n_blocks = member.shape
    g, per_list, kv_block, causal, window = spec.gqa_group, spec.list_queries, spec.kv_block, spec.causal, spec.window
    keys = _keys_of_row(seq_k, lengths)

    def in_lists(b, h, q_idx, kv_idx):
        # a size-1 batch or head dim of the lists broadcasts; indices are clamped because the fused kernel may
        # call the mask_mod on padding rows and columns past seq_q and seq_k
        keep = member[b if batch > 1 else 0, h // g if heads_kv > 1 else 0, (q_idx // per_list).clamp(max=n_lists - 1),
                      (kv_idx // kv_block).clamp(max=n_blocks - 1)]
        n = keys(b)
        keep = keep & (kv_idx < n)
        if not causal:
            return keep
        keep = keep & (kv_idx <= q_idx + n - seq_q)
        return keep if window is None else keep & (kv_idx > q_idx + n - seq_q - window)

    return in_lists


def _causal_mask_mod(spec: Spec, seq_q: int, seq_k: int, lengths: torch.Tensor | None = None):
    """mask_mod: causal (bottom-right aligned; with the spec's sliding window) or, without causal, the key inside
    seq_k (its row's keys: `lengths`, each row's diagonal its own)."""
    keys = _keys_of_row(seq_k, lengths)
    window = spec.window

    def causal_mask(b, h, q_idx, kv_idx):
        n = keys(b)
        keep = kv_idx <= q_idx + n - seq_q
        if window is not None:
            keep = keep & (kv_idx > q_idx + n - seq_q - window)
        return keep & (kv_idx < n) if lengths is not None else keep

    def in_range(b, h, q_idx, kv_idx):
        return kv_idx < keys(b)

    return causal_mask if spec.causal else in_range


def _keys_of_row(seq_k: int, lengths: torch.Tensor | None):
    """b -> the keys row b holds: seq_k, or its length (a size-1 `lengths` broadcasts)."""
    if lengths is None:
        return lambda b: seq_k
    if lengths.numel() == 1:
        return lambda b: lengths[0]
    return lambda b: lengths[b]


def _check_spec(spec) -> None:
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")


def _check_block_mask(block_mask) -> None:
    if not hasattr(block_mask, "kv_num_blocks") or not hasattr(block_mask, "BLOCK_SIZE"):
        raise KernelgenTypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got "
                                 f"{type(block_mask).__name__}")


def _check_flag(name: str, value) -> None:
    """A keyword that is True or False: any other value (a string) would choose by its truth."""
    if not isinstance(value, bool):
        raise KernelgenTypeError(f"{name} must be True or False, got {value!r}"[:200])


def _check_q_block(q_block, spec: Spec) -> int:
    per_list = spec.list_queries
    if q_block is None:
        return spec.kv_block if spec.per_query else spec.q_tile
    if isinstance(q_block, bool) or not isinstance(q_block, int):
        raise KernelgenTypeError(f"q_block must be an int, got {type(q_block).__name__} {q_block!r}")
    if q_block < 1 or (per_list % q_block and q_block % per_list):
        raise KernelgenValueError(f"q_block={q_block} must divide the queries of one list ({per_list}) or be a "
                                  "multiple of them")
    return q_block


def _lists_tensor(lists, spec: Spec, seq_q: int, seq_k: int) -> torch.Tensor:
    """The lists as a 4-D integer tensor, checked against spec and the lengths."""
    if isinstance(lists, BlockLists):
        made = (lists.per_query, lists.kv_block, lists.n_kv_blocks)
        if made != (spec.per_query, spec.kv_block, spec.n_kv_blocks(seq_k)):
            raise KernelgenValueError(f"lists were prepared for per_query, kv_block, n_kv_blocks = {made}; spec and "
                                      f"seq_k give {(spec.per_query, spec.kv_block, spec.n_kv_blocks(seq_k))}")
        lists = lists.block_idx
    if not isinstance(lists, torch.Tensor):
        raise KernelgenTypeError(f"lists must be a torch.Tensor {lists_layout(spec)} or kernelgen.BlockLists, got "
                                 f"{type(lists).__name__}")
    if lists.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError(f"lists.dtype must be torch.int32 or torch.int64, got {lists.dtype}")
    n_lists = spec.n_q_tiles(seq_q)
    if lists.dim() != 4 or lists.shape[2] != n_lists or min(lists.shape) < 1:
        raise KernelgenValueError(f"lists.shape = {tuple(lists.shape)}, expected {lists_layout(spec)} with "
                                  f"{'Nq' if spec.per_query else 'n_q_tiles'} = {n_lists} for seq_q = {seq_q}")
    return lists

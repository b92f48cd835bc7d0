"""Float64 reference of everything kernelgen computes: the oracle of every test.

Plain PyTorch, dense, slow and obvious. The semantics it implements: docs/SEMANTICS.md.
"""
from __future__ import annotations

import math

import torch

from .errors import KernelgenTypeError, KernelgenValueError
from .inputs import check_scale, lists_type_error
from .spec import Spec

__all__ = [
    "pool",
    "tile_eligibility",
    "block_scores",
    "index_token_scores",
    "index_block_scores",
    "select_blocks",
    "normalize_block_idx",
    "token_mask",
    "attention",
    "sparse_attention",
    "sparse_attention_grads",
    "gather_pages",
    "scatter_pages",
    "appended",
]


def pool(x: torch.Tensor, tile: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group means of a `[B, H, N, D]` tensor cut into tiles of `tile` rows and each tile into `r`
    consecutive groups. Returns (means float64 `[B, H, n_tiles, r, D]`, valid bool `[n_tiles, r]`);
    a group with no row inside `N` is not valid (and its mean is 0)."""
    b, h, n, d = x.shape
    n_tiles = -(-n // tile)
    pad = n_tiles * tile - n
    xf = torch.nn.functional.pad(x.double(), (0, 0, 0, pad))
    rows = torch.arange(n_tiles * tile, device=x.device) < n
    sums = xf.view(b, h, n_tiles, r, tile // r, d).sum(4)
    counts = rows.view(n_tiles, r, tile // r).sum(-1)
    means = sums / counts.clamp(min=1)[None, None, :, :, None]
    return means, counts > 0


def tile_eligibility(spec: Spec, nq: int, nk: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(eligible, forced), bool `[n_q_tiles, n_kv_blocks]`: per Q tile, or per query for per-query
    (KV-centric) lists, a tile of one query.

    A block is eligible unless causal puts all of it after the tile's last visible key. Forced: the
    `sink` first blocks and the `n_local` blocks ending at the diagonal block (the one holding key
    clamp(i_last + Nk - Nq, 0, Nk - 1)), when eligible."""
    n_tiles, n_blocks = spec.n_q_tiles(nq), spec.n_kv_blocks(nk)
    t = torch.arange(n_tiles, device=device)
    j = torch.arange(n_blocks, device=device)
    last_query = torch.clamp((t + 1) * spec.list_queries, max=nq) - 1
    last_key = last_query + (nk - nq)  # last visible key under causal
    if spec.causal:
        eligible = (j[None, :] * spec.kv_block) <= last_key[:, None]
    else:
        eligible = torch.ones(n_tiles, n_blocks, dtype=torch.bool, device=device)
    diag = torch.clamp(last_key, 0, nk - 1) // spec.kv_block
    local = (j[None, :] <= diag[:, None]) & (j[None, :] > diag[:, None] - spec.n_local)
    forced = eligible & (local | (j[None, :] < spec.sink))
    return eligible, forced


def block_scores(q: torch.Tensor, k: torch.Tensor, spec: Spec, index=None) -> torch.Tensor:
    """Selector scores, float64 `[B, Hkv, n_q_tiles, n_kv_blocks]`: max over the G query heads of the
    group and over the valid r*r group-mean products (r = 1 for "mean"). Per-query lists
    (`[B, Hkv, Nq, n_kv_blocks]`): the mean of the query over the G heads, dotted with each of the block's
    r group means, max over the valid groups. For the "index" selector, `index_block_scores` of
    `index` = (q_idx, k_idx, w)."""
    if spec.selector == "index":
        if index is None:
            raise KernelgenValueError("block_scores: spec.selector='index' needs index=(q_idx, k_idx, w)")
        return index_block_scores(*index, spec, heads_kv=k.shape[1])
    r = spec.groups
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    if spec.per_query:
        q_heads = q.double().view(b, hkv, hq // hkv, nq, d).mean(2)  # [B, Hkv, Nq, D]
        k_means, k_valid = pool(k, spec.kv_block, r)  # [B, Hkv, J, r, D]
        dots = torch.einsum("bhid,bhjsd->bhijs", q_heads, k_means)
        return dots.masked_fill(~k_valid, float("-inf")).amax(-1)
    q_means, q_valid = pool(q, spec.q_tile, r)  # [B, Hq, T, r, D]
    k_means, k_valid = pool(k, spec.kv_block, r)  # [B, Hkv, J, r, D]
    q_means = q_means.view(b, hkv, hq // hkv, *q_means.shape[2:])
    dots = torch.einsum("bhgtrd,bhjsd->bhgtrjs", q_means, k_means)
    valid = q_valid[:, :, None, None] & k_valid[None, None, :, :]  # [T, r, J, r]
    dots = dots.masked_fill(~valid, float("-inf"))
    return dots.amax(dim=(2, 4, 6))


def index_token_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, heads_kv: int,
                       rows: range | None = None) -> torch.Tensor:
    """Token scores of the index selector, float64 `[B, Hkv, len(rows), Nk]`: for KV head h, query i and key
    j, `sum_a w[a, i] * relu(q_idx[a, i] . k_idx[j])` over the Hi index heads a of h (q_idx heads
    h*Hi .. h*Hi + Hi - 1; k_idx has Hkv heads or one shared). No causal mask: `index_block_scores` applies it."""
    rows = range(q_idx.shape[2]) if rows is None else rows
    b, n_index_heads, _, di = q_idx.shape
    hi = n_index_heads // heads_kv
    qd = q_idx[:, :, rows.start:rows.stop].double().view(b, heads_kv, hi, len(rows), di)
    kd = k_idx.double()[:, :, None]  # [B, Hkv or 1, 1, Nk, Di]
    wd = w[:, :, rows.start:rows.stop].double().view(b, heads_kv, hi, len(rows), 1)
    return (torch.relu(qd @ kd.transpose(-1, -2)) * wd).sum(2)


def index_block_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, spec: Spec,
                       heads_kv: int) -> torch.Tensor:
    """Index selector scores, float64 `[B, Hkv, n_q_tiles, n_kv_blocks]`: the max of the token scores
    (`index_token_scores`) over the tile's queries and the block's keys that the query sees (causal,
    bottom-right aligned); -inf for a block with no visible key. Per-query lists (`[B, Hkv, Nq, n_kv_blocks]`):
    each query is a tile of its own. Whole tiles at a time, about 2**25 token scores per step, so that long
    sequences fit in memory."""
    b, n_index_heads, nq, _ = q_idx.shape
    nk = k_idx.shape[2]
    n_blocks = spec.n_kv_blocks(nk)
    pad = n_blocks * spec.kv_block - nk
    per_row = max(1, b * n_index_heads * nk)
    chunk = max(spec.q_tile, (1 << 25) // per_row // spec.q_tile * spec.q_tile)
    key = torch.arange(nk, device=q_idx.device)
    tiles = []
    for start in range(0, nq, chunk):
        rows = range(start, min(start + chunk, nq))
        s = index_token_scores(q_idx, k_idx, w, heads_kv, rows)  # [B, Hkv, rows, Nk]
        if spec.causal:
            query = torch.arange(rows.start, rows.stop, device=q_idx.device)
            s = s.masked_fill(key[None, :] > query[:, None] + (nk - nq), -torch.inf)
        s = torch.nn.functional.pad(s, (0, pad), value=-torch.inf).view(b, heads_kv, len(rows), n_blocks, spec.kv_block)
        s = s.amax(-1)  # [B, Hkv, rows, J]
        n_tiles, per_tile = spec.n_q_tiles(len(rows)), spec.list_queries  # a tile of one query: per-query lists
        s = torch.nn.functional.pad(s, (0, 0, 0, n_tiles * per_tile - len(rows)), value=-torch.inf)
        tiles.append(s.view(b, heads_kv, n_tiles, per_tile, n_blocks).amax(3))
    return torch.cat(tiles, 2)


def select_blocks(q: torch.Tensor, k: torch.Tensor, spec: Spec, index=None) -> torch.Tensor:
    """The block lists the selector chooses: int32 `[B, Hkv, n_q_tiles, top_k]`, valid ids ascending,
    then -1. Forced blocks first, then the highest scores; ties go to the lower block id. `index`:
    (q_idx, k_idx, w) of the "index" selector."""
    if not spec.selects:
        raise KernelgenValueError("select_blocks: spec.selector='given' chooses no blocks; the caller passes block_idx")
    if q.shape[1] < spec.gqa_group * k.shape[1] and spec.selector != "index":
        # the selector pools all G query heads of a KV head: some of them would choose other lists
        raise KernelgenValueError(f"q has {q.shape[1]} of the {spec.gqa_group} query heads of its KV head, and "
                                  f"selector {spec.selector!r} pools all of them: pass the lists the whole group "
                                  "selects (block_idx=)")
    nq, nk = q.shape[2], k.shape[2]
    scores = block_scores(q, k, spec, index)
    eligible, forced = tile_eligibility(spec, nq, nk, device=q.device)
    key = torch.where(forced, torch.inf, scores).masked_fill(~eligible, -torch.inf)
    # stable descending sort keeps the lower block id first among equal scores
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    top = order[..., : spec.top_k]
    taken_eligible = torch.gather(eligible.expand_as(key), -1, top)
    top = torch.where(taken_eligible, top, -1)
    if top.shape[-1] < spec.top_k:
        top = torch.nn.functional.pad(top, (0, spec.top_k - top.shape[-1]), value=-1)
    return normalize_block_idx(top, spec.n_kv_blocks(nk))


def normalize_block_idx(block_idx: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """Canonical form of a list: valid ids ascending, each once, then -1 (ids outside [0, n_kv_blocks) are empty,
    and so is a repeat: [1, 1] becomes [1, -1])."""
    valid = (block_idx >= 0) & (block_idx < n_kv_blocks)
    ids = torch.where(valid, block_idx.long(), n_kv_blocks).sort(dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeat, n_kv_blocks, ids).sort(dim=-1).values
    return torch.where(ids < n_kv_blocks, ids, -1).to(torch.int32)


def token_mask(block_idx: torch.Tensor, spec: Spec, nq: int, nk: int, rows: range | None = None) -> torch.Tensor:
    """bool `[B, Hkv, len(rows), Nk]`: query i sees key j iff j's block is in i's list (and causal and the
    sliding window allow: 0 <= i + Nk - Nq - j < window). `rows` (default: all Nq queries) limits the mask to some
    queries."""
    rows = range(nq) if rows is None else rows
    b, hkv, n_tiles, _ = block_idx.shape
    n_blocks = spec.n_kv_blocks(nk)
    idx = block_idx.long()
    valid = (idx >= 0) & (idx < n_blocks)
    blocks = torch.zeros(b, hkv, n_tiles, n_blocks + 1, dtype=torch.bool, device=block_idx.device)
    blocks.scatter_(-1, torch.where(valid, idx, n_blocks), True)
    blocks = blocks[..., :n_blocks]
    query = torch.arange(rows.start, rows.stop, device=block_idx.device)
    cols = torch.arange(nk, device=block_idx.device) // spec.kv_block
    mask = blocks[:, :, query // spec.list_queries][:, :, :, cols]
    if spec.causal:
        i = query[:, None]
        j = torch.arange(nk, device=block_idx.device)[None, :]
        mask = mask & (j <= i + (nk - nq))
        if spec.window is not None:
            mask = mask & (j > i + (nk - nq) - spec.window)
    return mask


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in float64. `mask` `[B, Hkv or Hq, Nq, Nk]` (bool). Rows with no
    visible key give o = 0 and lse = -inf. `softcap`: each score s becomes softcap * tanh(s / softcap).
    Returns (o float64 `[B, Hq, Nq, D]`, lse float64 `[B, Hq, Nq]`)."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kd = k.double().repeat_interleave(g, dim=1)
    vd = v.double().repeat_interleave(g, dim=1)
    if mask.shape[1] != hq:
        mask = mask.repeat_interleave(g, dim=1)
    s = (q.double() @ kd.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -torch.inf)
    seen = mask.any(-1).expand(s.shape[:-1])
    # a row that sees no key takes its logsumexp over zeros: lse's gradient there is 0, not NaN
    lse = torch.where(seen, torch.logsumexp(s.masked_fill(~seen[..., None], 0.0), dim=-1), -torch.inf)
    p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
    o = p @ vd
    return o, lse


def _broadcast_lists(block_idx, q: torch.Tensor, k: torch.Tensor):
    """Given lists with a batch or KV-head dimension of 1 expanded to q's batch and k's KV heads (a pool's
    too: [n_pages, Hkv, ...]): a dimension of 1 broadcasts, as inputs.check_block_idx has the calls take it
    (restated: the oracle shares no code with what it checks). k's heads, not Hq / G: a check of a slice of
    the query heads passes fewer than G of them."""
    if block_idx is None or block_idx.dim() != 4:
        return block_idx
    return block_idx.expand(q.shape[0] if block_idx.shape[0] == 1 else -1,
                            k.shape[1] if block_idx.shape[1] == 1 else -1, -1, -1)


def _check_call(q, k, v, spec, block_idx=None, scale=None) -> None:
    """The reference holds its inputs to the kernels' rules where its answer would otherwise be no call's: a Spec,
    q, k and v 4-D and not empty, of the spec's head_dim, a scale the kernels take, integer lists."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise KernelgenTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[-1] != spec.head_dim:
            raise KernelgenValueError(f"{name} must be 4-D [B, H, N, D] with D = spec.head_dim = {spec.head_dim}, "
                                      f"got shape {tuple(x.shape)}")
        if min(x.shape) < 1:
            raise KernelgenValueError(f"empty input: {name} {tuple(x.shape)}")
    _check_heads(q, k, spec)
    if block_idx is not None and not isinstance(block_idx, torch.Tensor):
        raise lists_type_error(block_idx, "an integer tensor of block ids")  # a BlockMask is told how to convert
    if block_idx is not None and (block_idx.is_floating_point() or block_idx.is_complex() or
                                  block_idx.dtype == torch.bool):
        raise KernelgenTypeError(f"block_idx must be an integer tensor of block ids, got {block_idx.dtype}")
    if scale is not None:
        check_scale(scale)


def _check_heads(q: torch.Tensor, k: torch.Tensor, spec: Spec) -> None:
    """q's heads are the spec's groups of k's heads, or some of one group with that KV head alone (a check of a slice
    of the query heads: q[:, h*G + a : h*G + c] with k[:, h:h+1]). More than gqa_group * Hkv is no call of the spec
    (q passed as [B, N, H, D], say), and fewer with several KV heads does not say which heads they are (query head
    i reads KV head i // G): never an answer."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq > spec.gqa_group * hkv or hq % hkv:
        raise KernelgenValueError(f"q has {hq} heads and k {hkv} (q.shape[1], k.shape[1]); spec.gqa_group = "
                                  f"{spec.gqa_group} takes at most {spec.gqa_group * hkv}, a multiple of {hkv}: the "
                                  "layout is [B, H, N, D]")
    if hq < spec.gqa_group * hkv and hkv > 1:
        raise KernelgenValueError(f"q has {hq} heads and k {hkv}; spec.gqa_group = {spec.gqa_group} takes "
                                  f"{spec.gqa_group * hkv}: some query heads go with their one KV head alone "
                                  "(q[:, h*G + a : h*G + c] with k[:, h:h+1])")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: Spec,
    block_idx: torch.Tensor | None = None,
    scale: float | None = None,
    index=None,
    cache_seqlens: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_idx_new: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select (unless block_idx is given; `index` = (q_idx, k_idx, w) for the "index" selector) and attend.
    Returns (o, lse, block_idx), float64. Queries are processed in chunks so that long sequences fit in memory.
    `cache_seqlens` ([B] ints): k and v are a cache whose row b holds keys [cache_leftpad[b], cache_seqlens[b])
    (cache_seqlens clamped to [0, Nk], cache_leftpad, [B] ints or None for 0, to [0, cache_seqlens[b]]); that
    row is the call over those keys alone (its queries the last positions of them, its blocks counted from its
    first key), and block_idx, where given, holds its lists (the selected ones, where not, padded to k's
    blocks). `seqlens` ([B] ints, Nq == Nk): a right-padded batch, row b the call over its first seqlens[b]
    queries and keys alone (clamped to [0, N]); o = 0 and lse = -inf past them, and its lists (given: its
    own) padded with -1 past its tiles. `block_table` ([B, pages a row] ints): k and v are pools of pages
    [n_pages, Hkv, page_size, D], the call over `gather_pages` of them (each row's capacity without
    cache_seqlens), and so is the index selector's k_idx ([n_pages, Hkv or 1, page_size, Di]). Given lists with a
    batch or KV-head dimension of 1 hold every row's or head's list. `k_new`, `v_new` (and `k_idx_new`, with
    `index`): new keys written at each row's end first (`appended`, on copies: the caller's k and v are left as they
    are), the call then over the rows' new lengths. `sinks` ([Hq]): each head's sink logit joins its rows'
    softmax (a row then also weighs exp(sink) against its keys, which no value goes with); the padding of
    `seqlens` stays o = 0, lse = -inf."""
    _check_call(q, k, v, spec, block_idx, scale)
    if sinks is not None:
        o, lse, block_idx = sparse_attention(q, k, v, spec, block_idx, scale, index, cache_seqlens, cache_leftpad,
                                             seqlens, block_table, k_new, v_new, k_idx_new)
        sink = sinks.double()[None, :, None].expand(lse.shape)
        with_sink = torch.logsumexp(torch.stack([lse, sink]), dim=0)
        o = o * torch.exp(lse - with_sink)[..., None]
        if seqlens is not None:
            real = torch.arange(q.shape[2], device=q.device) < seqlens.to(q.device)[:, None]
            with_sink = torch.where(real[:, None, :], with_sink, -torch.inf)
        return o, with_sink, block_idx
    if k_new is not None:
        k, lengths = appended(k, k_new, cache_seqlens, block_table)
        v = appended(v, v_new, cache_seqlens, block_table)[0]
        if k_idx_new is not None:
            index = (index[0], appended(index[1], k_idx_new, cache_seqlens, block_table)[0], index[2])
        return sparse_attention(q, k, v, spec, block_idx, scale, index, lengths, cache_leftpad, seqlens, block_table)
    if seqlens is not None and (q.shape[2] != k.shape[2] or cache_seqlens is not None or block_table is not None):
        raise KernelgenValueError(f"seqlens is a padded batch of self-attention: Nq == Nk (got {q.shape[2]} and "
                                  f"{k.shape[2]}), without cache_seqlens or block_table")
    block_idx = _broadcast_lists(block_idx, q, k)
    if block_table is not None:
        k, v = gather_pages(k, block_table, cache_seqlens), gather_pages(v, block_table, cache_seqlens)
        if index is not None:  # k_idx paged as k is, through the same table
            index = (index[0], gather_pages(index[1], block_table, cache_seqlens), index[2])
        if cache_seqlens is None:
            cache_seqlens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32)
    if cache_seqlens is not None:
        return _ragged(q, k, v, spec, block_idx, scale, cache_seqlens, cache_leftpad, index)
    if seqlens is not None:
        return _padded(q, k, v, spec, block_idx, scale, seqlens, index)
    if block_idx is None:
        block_idx = select_blocks(q, k, spec, index)
    nq, nk = q.shape[2], k.shape[2]
    outs, lses = [], []
    for rows in _query_chunks(q, nk, spec):
        mask = token_mask(block_idx, spec, nq, nk, rows)
        o, lse = attention(q[:, :, rows.start : rows.stop], k, v, mask, scale, spec.softcap)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2), block_idx


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """A paged cache [n_pages, H, page_size, D] as the contiguous cache [B, H, pages a row x page_size, D] whose row
    b's key p is pages[block_table[b, p // page_size], :, p % page_size]. The pages that hold a row's keys (its
    first cache_seqlens[b], all without) must exist: a page of no keys (an id outside [0, n_pages)) has no dense
    form here. The positions past a row's keys are zero."""
    if pages.dim() != 4 or block_table.dim() != 2:
        raise KernelgenValueError(f"gather_pages takes pages [n_pages, H, page_size, D] and block_table [B, pages a "
                                  f"row], got shapes {tuple(pages.shape)} and {tuple(block_table.shape)}")
    n_pages, h, page_size, d = pages.shape
    b, per_row = block_table.shape
    table = block_table.long().cpu()
    lengths = [per_row * page_size] * b if cache_seqlens is None else cache_seqlens.tolist()
    out = pages.new_zeros(b, h, per_row * page_size, d)
    for row, n in enumerate(lengths):
        for j in range(-(-min(max(int(n), 0), per_row * page_size) // page_size)):
            page = int(table[row, j])
            if not 0 <= page < n_pages:
                raise KernelgenValueError(f"block_table[{row}, {j}] = {page} holds keys of row {row} but is no "
                                          f"page of [0, {n_pages})")
            out[row, :, j * page_size:(j + 1) * page_size] = pages[page]
    return out


def appended(cache: torch.Tensor, new: torch.Tensor, cache_seqlens: torch.Tensor,
             block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of `cache` with `new` [B, H, n_new, D] written at each row's end, the rows' lengths after it): row b's
    new row j goes to position n + j, n = cache_seqlens[b] clamped to [0, capacity], unless that position is at or
    past the capacity (k's length, or pages a row x page_size with `block_table`: `cache` is then a pool of pages,
    written through the table; a page id outside the pool is no place to write). Lengths: min(n + n_new,
    capacity), int32."""
    out = cache.clone()
    if block_table is None:
        capacity, page_size, table = cache.shape[2], 0, None
    else:
        page_size, table = cache.shape[2], block_table.long().cpu()
        capacity = table.shape[1] * page_size
    starts = cache_seqlens.long().clamp(0, capacity).tolist()
    for b, start in enumerate(starts):
        for j in range(min(new.shape[2], capacity - start)):
            p = start + j
            if table is None:
                out[b, :, p] = new[b, :, j]
            elif 0 <= int(table[b, p // page_size]) < cache.shape[0]:
                out[int(table[b, p // page_size]), :, p % page_size] = new[b, :, j]
    lengths = torch.tensor([min(n + new.shape[2], capacity) for n in starts], dtype=torch.int32)
    return out, lengths.to(cache_seqlens.device)


def scatter_pages(x: torch.Tensor, page_size: int, order: torch.Tensor, spare: int = 0) -> torch.Tensor:
    """The paged cache `gather_pages` makes x [B, H, N, D] from (N a multiple of page_size): a pool of
    B * N / page_size + spare pages [.., H, page_size, D], row b's page j being pool page order[b * N / page_size + j]
    (`order`: distinct ids in the pool; `order[:B * N / page_size].view(B, -1)` is its block_table). The pages no
    row lists are NaN, so that a read of one shows."""
    b, h, n, d = x.shape
    pages = x.reshape(b, h, n // page_size, page_size, d).transpose(1, 2).reshape(-1, h, page_size, d)
    pool = x.new_full((pages.shape[0] + spare, h, page_size, d), float("nan"))
    pool[order[:pages.shape[0]].to(x.device)] = pages
    return pool


def _ragged(q, k, v, spec: Spec, block_idx, scale, cache_seqlens, cache_leftpad=None, index=None):
    """`sparse_attention` of a cache of per-row lengths: each row's own call (over its keys' index vectors too),
    stacked."""
    outs, lses, lists = [], [], []
    n_lists = spec.n_q_tiles(q.shape[2])
    firsts = [0] * q.shape[0] if cache_leftpad is None else cache_leftpad.tolist()
    for b, (first, n) in enumerate(zip(firsts, cache_seqlens.tolist())):
        n = min(max(int(n), 0), k.shape[2])
        first = min(max(int(first), 0), n)
        rows = slice(first, n)
        n -= first
        given = None if block_idx is None else block_idx[b : b + 1]
        if n == 0:  # no key: o = 0, lse = -inf, no list
            outs.append(torch.zeros(q[b : b + 1].shape, dtype=torch.float64, device=q.device))
            lses.append(torch.full(q[b : b + 1].shape[:3], -torch.inf, dtype=torch.float64, device=q.device))
            lists.append(torch.full((1, k.shape[1], n_lists, spec.top_k), -1, dtype=torch.int32, device=q.device)
                         if given is None else given)
            continue
        row_index = None if index is None else (index[0][b : b + 1], index[1][b : b + 1, :, rows], index[2][b : b + 1])
        o, lse, chosen = sparse_attention(q[b : b + 1], k[b : b + 1, :, rows], v[b : b + 1, :, rows], spec, given,
                                          scale, row_index)
        outs.append(o)
        lses.append(lse)
        lists.append(chosen)
    return torch.cat(outs), torch.cat(lses), torch.cat(lists)


def _padded(q, k, v, spec: Spec, block_idx, scale, seqlens, index=None):
    """`sparse_attention` of a right-padded batch: each row's own call over its tokens (and index vectors),
    padded."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float64, device=q.device)
    lists = torch.full((q.shape[0], k.shape[1], spec.n_q_tiles(q.shape[2]), spec.top_k), -1, dtype=torch.int32,
                       device=q.device)
    for b, n in enumerate(seqlens.tolist()):
        n = min(max(int(n), 0), q.shape[2])
        if n == 0:
            continue
        given = None if block_idx is None else block_idx[b : b + 1, :, : spec.n_q_tiles(n)]
        row = (x[b : b + 1, :, :n] for x in (q, k, v))
        row_index = None if index is None else tuple(x[b : b + 1, :, :n] for x in index)  # w's last dim: tokens
        o[b : b + 1, :, :n], lse[b : b + 1, :, :n], chosen = sparse_attention(*row, spec, given, scale, row_index)
        lists[b : b + 1, :, : chosen.shape[2]] = chosen
    return o, lse, lists


def sparse_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    spec: Spec,
    block_idx: torch.Tensor,
    scale: float | None = None,
    stored_o: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), float64: the gradients of sum(o * do) (+ sum(lse * dlse) with `dlse` [B, Hq, Nq]) for o, lse
    = sparse_attention(q, k, v, spec, block_idx, scale), by torch.autograd through `attention`, for the fixed
    lists `block_idx` (selection is not differentiated). One chunk of queries at a time: each chunk's rows give
    their own dq, and their dk and dv add up.

    `stored_o`: the forward's output as a kernel stored it (rounded to its dtype). The backward takes
    delta = rowsum(do * o) from it, as FlashAttention's does; with it given, the gradients are that
    algorithm's in exact arithmetic. The two differ by delta's rounding error times P: a relative 1e-2 of a
    bf16 dq where rows see one or two keys, whose exact dq is (nearly) 0. The correction is the gradient of
    -sum_i err_i * lse_i (d lse_i / d s_ij = P_ij), err_i = rowsum(do_i * (stored_o_i - o_i))."""
    if stored_o is not None and stored_o.shape != q.shape:
        raise KernelgenValueError(f"stored_o.shape = {tuple(stored_o.shape)}; expected q's, {tuple(q.shape)} (the "
                                  "forward's o)")
    _check_call(q, k, v, spec, block_idx, scale)
    block_idx = _broadcast_lists(block_idx, q, k)
    nq, nk = q.shape[2], k.shape[2]
    kd = k.detach().double().requires_grad_()
    vd = v.detach().double().requires_grad_()
    dqs = []
    dk = torch.zeros_like(kd)
    dv = torch.zeros_like(vd)
    for rows in _query_chunks(q, nk, spec):
        qd = q[:, :, rows.start : rows.stop].detach().double().requires_grad_()
        do_rows = do[:, :, rows.start : rows.stop].double()
        with torch.enable_grad():
            o, lse = attention(qd, kd, vd, token_mask(block_idx, spec, nq, nk, rows), scale, spec.softcap)
            outputs, grad_outputs = [o], [do_rows]
            grad_lse = torch.zeros_like(lse) if dlse is None else dlse[:, :, rows.start : rows.stop].double()
            if stored_o is not None:
                grad_lse = grad_lse - ((stored_o[:, :, rows.start : rows.stop].double() - o.detach()) * do_rows).sum(-1)
            if stored_o is not None or dlse is not None:
                outputs.append(lse)
                grad_outputs.append(torch.where(torch.isinf(lse.detach()), 0.0, grad_lse))
            dq_rows, dk_rows, dv_rows = torch.autograd.grad(outputs, (qd, kd, vd), grad_outputs)
        dqs.append(dq_rows)
        dk += dk_rows
        dv += dv_rows
    return torch.cat(dqs, 2), dk, dv


def _query_chunks(q: torch.Tensor, nk: int, spec: Spec):
    """Ranges of whole Q tiles whose dense [B, Hq, rows, Nk] scores hold about 2**27 elements."""
    nq = q.shape[2]
    chunk = max(spec.q_tile, (1 << 27) // max(1, q.shape[0] * q.shape[1] * nk) // spec.q_tile * spec.q_tile)
    for start in range(0, nq, chunk):
        yield range(start, min(start + chunk, nq))

"""Kernel roles: what each kind of kernel computes, how its launch is called, and what it is tuned on.

A role is data. Each backend that runs it supplies a template and a launcher for it (`RoleImpl` in
`kernelgen.backends.base`); a backend that lacks a role has it run by the registry's fallback
backend (`kernelgen.backends.runner`). Adding a role is one `Role` here (or `register_role`)
plus one `RoleImpl` per backend that runs it.

Launch signatures, after (kernel, spec, config, shapes):
  lists     (block_idx, validate)        caller-given lists -> int32 lists in the kernels' form
  window_lists (device)                  a selecting window spec's lists (its window's blocks), int32 [B or 1, 1,
            n_q_tiles, top_k]: one row for calls of one length, a row per batch row with `seqlens=`
  select    (q, k[, k_rep])              lists chosen by spec.selector: int32 [B, Hkv, n_q_tiles, top_k]; k_rep,
            passed only by a call given kept reps: k's representatives from `key_reps`
  key_reps  (k)                          the pooling selectors' representatives of k's blocks: float32
            [B, Hkv, ceil(n / kv_block), r, D] (k: a view of the cache starting at a block boundary)
  append_kv (cache, new[, cache_b, new_b])   new rows [B, H, n_new, D] written into a KV cache at each row's end
            (`seqlens=`; a paged cache's through `block_table=`), a second cache of the same rows in the same
            launch; returns the rows' lengths after the write, int32 [B]
  select_index (q_idx, k_idx, w)         the same, chosen by the index selector from checked index tensors
  attn      (q, k, v, block_idx, scale)  (o, lse) over lists in the kernels' form
  bwd_delta (o, do)                      delta = rowsum(do * o), float32 [B, Hq, Nq]
  bwd_dq    (q, k, v, do, lse, delta, block_idx, scale)   dq over lists in the kernels' form
  bwd_dkdv  (q, k, v, do, lse, delta, reverse, scale)     (dk, dv), walking `reverse`
            (a `kernelgen.reverse_index.ReverseIndex` of the same lists)
KV-centric schedule (per-query lists int32 [B, Hkv, Nq, top_k]; `lists` normalises them as well):
  kv_select (q, k[, k_rep])              per-query lists chosen by spec.selector (k_rep: as select's)
  kv_select_index (q_idx, k_idx, w)      per-query lists chosen by the index selector
  kv_attn   (q, k, v, block_idx, reverse, scale)   (o, lse): partials per (block, query chunk) task of
            `reverse` (a `kernelgen.reverse_index.QueryReverseIndex` of the lists; None: built), merged per row
  kv_attn_union (q, k, v, block_idx, union, scale)   (o, lse): a tile of consecutive queries over the union
            of their lists (`union`: a `kernelgen.tile_union.TileUnion` of the lists, or `TileUnions`; None:
            built), each row masked to its own query's list; served to prepared lists whose union is small
  kv_bwd_union (q, k, v, do, lse, delta, block_idx, union, scale)   (dq, dk, dv) of the union design: dq per
            tile over its union, dk and dv per KV block over the tiles whose union holds it (`union`: as above)
  kv_bwd    (q, k, v, do, lse, delta, block_idx, reverse, scale)   (dq, dk, dv): one walk of `reverse` per
            KV block gives dk, dv and dq's partials; their merge per row gives dq
Either schedule, calls of at most DECODE_MAX_QUERIES queries (decoding against a KV cache):
  decode_select (q, k[, k_rep])          select's, for such a call of the Q-centric schedule (one Q tile: its
            blocks split over more programs; q pooled and the partial lists merged in the same launch)
  kv_decode_select (q, k[, k_rep])       kv_select's, for such a call of the KV-centric schedule (its blocks
            split over more programs, the partial lists merged in the same launch)
  decode_select_index (q_idx, k_idx, w)  select_index's, for such a call (its blocks split over more programs,
            the partial lists merged by a second launch)
  kv_decode_select_index (q_idx, k_idx, w)   kv_select_index's, for such a call (a config of its own)
  decode    (q, k, v, block_idx, scale)  (o, lse) over lists in the kernels' form, split-KV per query
A prefill over a KV cache of per-row lengths (more queries, the last of each row's keys) selects with the four
roles above, launched as a prefill's selection, and attends with
  attn_rows (q, k, v, block_idx, scale, seqlens[, leftpad])   attn's (o, lse), each row over its own keys
  kv_attn_rows (q, k, v, block_idx, reverse, scale, seqlens[, leftpad])   kv_attn's, likewise
and over a paged cache, with
  attn_paged (q, k, v, block_idx, scale, seqlens, block_table)   (o, lse), each row over its own pages' keys
  kv_attn_paged (q, k, v, block_idx, reverse, scale, seqlens, None, block_table)   kv_attn's, likewise
Such calls may pass `cache_seqlens` and `cache_leftpad` (int32 [B]: batch row b of a cache holds keys
[cache_leftpad[b], cache_seqlens[b])): the launchers of the roles whose `RoleImpl.varlen` is set take them as
`seqlens=` and `leftpad=` (key_reps also `grow=(reps, made, made_leftpad)`: reps brought to the rows' keys in
place); a call with lengths is refused where a role it runs has no such launcher. A call over a paged cache
(`block_table`, int32 [B, pages a row]; k and v pools of pages) passes it, with `seqlens=` and never `leftpad=`,
to the launchers whose `RoleImpl.paged` is set as `block_table=`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import reference
from .errors import KernelgenValueError
from .reverse_index import build_query_reverse_index, build_reverse_index
from .spec import DEFAULT_Q_TILE, Spec
from .workloads import agreeing_query_lists, useful_flops

__all__ = ["Role", "ROLES", "BACKWARD_ROLES", "KV_BACKWARD_ROLES", "forward_roles", "backward_roles",
           "DECODE_MAX_QUERIES", "register_role", "get_role", "SELECTION_ROLES", "DECODE_SELECTION_ROLES", "Workload",
           "WorkloadShape", "valid_top_k", "index_inputs", "INDEX_HEADS", "INDEX_DIM", "REL_L2_TOL", "GRAD_REL_L2_TOL"]

# what a tuned config must reproduce: rel. L2 error of o against the float64 reference
REL_L2_TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}
# ... and of dq, dk, dv: P and dS are rounded to the inputs' dtype before their products
GRAD_REL_L2_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4}
SELECT_SCORE_TOL = 1e-3  # relative slack at near-ties between chosen and unchosen blocks
INDEX_HEADS, INDEX_DIM = 4, 64  # the synthetic index inputs the index selector is tuned on (Hi, Di)


class WorkloadShape(NamedTuple):
    batch: int
    heads_kv: int
    n_q: int
    n_k: int


@dataclass
class Workload:
    """Inputs of one role's launch, and how to judge its output (the tuner's trial)."""

    args: tuple                                  # the launch's arguments after (kernel, spec, config, shapes)
    check: Callable[[Any], str | None]           # why the output is wrong, or None
    flops: float | None = None                   # useful FLOPs of one launch (attention roles)
    shape: WorkloadShape | None = None           # the inputs' shape, where not the one asked for (decode's)


@dataclass(frozen=True)
class Role:
    """One kind of kernel.

    name        its key in configs, the tuning DB and templates/<backend>/<name>.py.j2
    summary     what it computes
    canonical   spec fields its kernels do not read, with the value that stands for all of them: specs
                that differ only there share the role's kernels and tuned winners
    workload    (spec, shape, device, dtype, check) -> Workload that the tuner times; None: not tuned
    reverse_index  its launch takes the lists' reverse index after the lists: prepared lists' own, or None
                (the launcher builds it)
    timed_queries  the queries its workload times for the n_q asked (a decode step's one, a prefill chunk's at
                most PREFILL_CHUNK); None: n_q
    """

    name: str
    summary: str
    canonical: dict = dataclasses.field(default_factory=dict)
    workload: Callable[..., Workload] | None = None
    reverse_index: bool = False
    timed_queries: Callable[[int], int] | None = None

    @property
    def tuned(self) -> bool:
        return self.workload is not None

    def kernel_spec(self, spec: Spec, backend: str) -> Spec:
        """The spec whose kernels run this role on `backend`."""
        return spec.replace(backend=backend, **self.canonical)

    def key(self, spec: Spec, backend: str) -> str:
        """The tuning DB's key of this role's winners for `spec` on `backend`."""
        return self.kernel_spec(spec, backend).key()


# ---- workloads -----------------------------------------------------------------------------------

def _inputs(spec: Spec, shape: WorkloadShape, device, dtype, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape_q = (shape.batch, shape.heads_kv * spec.gqa_group, shape.n_q, spec.head_dim)
    shape_kv = (shape.batch, shape.heads_kv, shape.n_k, spec.head_dim)
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))


def _lists(q, k, spec: Spec) -> torch.Tensor:
    """The reference selector's lists (`given` and `index` specs are timed on the `mean` selector's)."""
    return reference.select_blocks(q, k, _chooser(spec)).to(torch.int32)


def _chooser(spec: Spec) -> Spec:
    """The spec whose reference selector picks a workload's lists."""
    return spec if spec.selection_role == "select" else spec.replace(selector="mean")


def attention_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True,
                       lists: torch.Tensor | None = None) -> Workload:
    """The attention over `lists` (default: the reference selector's on the inputs, `_lists`)."""
    q, k, v = _inputs(spec, shape, device, dtype)
    lists = _lists(q, k, spec) if lists is None else lists
    flops = useful_flops(lists, spec, shape.n_q, shape.n_k)
    if not check:
        return Workload((q, k, v, lists, None), lambda out: None, flops)
    ref = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=lists)[0]

    def judge(out) -> str | None:
        return _rel_l2_error("o", out[0], ref, REL_L2_TOL[out[0].dtype])

    return Workload((q, k, v, lists, None), judge, flops)


def _rel_l2_error(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """Why `got` is not `want` (float64) within relative L2 error `tol`, or None (NaN fails too)."""
    err = ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()
    return None if err < tol else f"{name} differs from the reference: rel. L2 error {err:.3e} >= {tol}"


def _backward_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool,
                       lists: torch.Tensor | None = None):
    """(q, k, v, do, lse, delta, lists, float64 (dq, dk, dv) or None): a backward's inputs over `lists` (default:
    `_lists`'). Checked workloads run the reference forward and its autograd; timed ones take stand-ins of the
    same shapes (a finite lse, so that every P is finite)."""
    q, k, v = _inputs(spec, shape, device, dtype)
    do = _inputs(spec, shape, device, dtype, seed=1)[0]
    lists = _lists(q, k, spec) if lists is None else lists
    given = spec.replace(selector="given")
    if check:
        o, lse, _ = reference.sparse_attention(q, k, v, given, block_idx=lists)
        grads = reference.sparse_attention_grads(q, k, v, do, given, lists)
    else:
        o = _inputs(spec, shape, device, dtype, seed=2)[0]
        lse, grads = torch.full(q.shape[:3], 20.0, device=device), None
    o = o.to(dtype)
    delta = (do.float() * o.float()).sum(-1)
    return q, k, v, do, lse.float(), delta, lists, grads


def bwd_dq_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    q, k, v, do, lse, delta, lists, grads = _backward_workload(spec, shape, device, dtype, check)
    flops = 1.5 * useful_flops(lists, spec, shape.n_q, shape.n_k)  # 3 products (S, dP, dQ) to the forward's 2

    def judge(dq) -> str | None:
        return _rel_l2_error("dq", dq, grads[0], GRAD_REL_L2_TOL[dq.dtype])

    return Workload((q, k, v, do, lse, delta, lists, None), judge if check else (lambda out: None), flops)


def bwd_dkdv_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    q, k, v, do, lse, delta, lists, grads = _backward_workload(spec, shape, device, dtype, check)
    reverse = build_reverse_index(lists, spec.n_kv_blocks(shape.n_k))
    flops = 2.0 * useful_flops(lists, spec, shape.n_q, shape.n_k)  # 4 products (S, dP, dV, dK) to the forward's 2

    def judge(out) -> str | None:
        dk, dv = out
        return (_rel_l2_error("dk", dk, grads[1], GRAD_REL_L2_TOL[dk.dtype])
                or _rel_l2_error("dv", dv, grads[2], GRAD_REL_L2_TOL[dv.dtype]))

    return Workload((q, k, v, do, lse, delta, reverse, None), judge if check else (lambda out: None), flops)


def kv_bwd_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    return _per_query_bwd_workload(spec, shape, device, dtype, check, None,
                                   lambda lists: build_query_reverse_index(lists, spec.n_kv_blocks(shape.n_k)))


def _per_query_bwd_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool, lists, walk) -> Workload:
    """A backward over per-query lists (`_backward_workload`'s), giving dq, dk and dv; `walk(lists)` is the
    launch's argument after the lists (kv_bwd's reverse index; the union design's `TileUnions`)."""
    q, k, v, do, lse, delta, lists, grads = _backward_workload(spec, shape, device, dtype, check, lists)
    reverse = walk(lists)
    flops = 2.5 * useful_flops(lists, spec, shape.n_q, shape.n_k)  # 5 products (S, dP, dV, dK, dQ) to the forward's 2

    def judge(out) -> str | None:
        return next(filter(None, (_rel_l2_error(name, grad, want, GRAD_REL_L2_TOL[grad.dtype])
                                  for name, grad, want in zip(("dq", "dk", "dv"), out, grads))), None)

    return Workload((q, k, v, do, lse, delta, lists, reverse, None), judge if check else (lambda out: None), flops)


def valid_top_k(lists: torch.Tensor, q, k, spec: Spec, index=None) -> bool:
    """Forced blocks present, eligible blocks only, as many as the budget allows, and no unchosen block
    scoring clearly higher than a chosen one (float64 reference scores; `index` = (q_idx, k_idx, w) for the
    index selector): fp32 near-ties may differ."""
    nq, nk = q.shape[2], k.shape[2]
    n_blocks = spec.n_kv_blocks(nk)
    if lists.dtype != torch.int32 or not torch.equal(lists, reference.normalize_block_idx(lists, n_blocks)):
        return False
    scores = reference.block_scores(q, k, spec, index)
    eligible, forced = reference.tile_eligibility(spec, nq, nk, device=q.device)
    idx = lists.long()
    chosen = torch.zeros(*scores.shape[:-1], n_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(idx >= 0, idx, n_blocks), True)
    chosen = chosen[..., :n_blocks]
    count_ok = torch.equal(chosen.sum(-1), torch.clamp(eligible.sum(-1), max=spec.top_k).expand_as(chosen.sum(-1)))
    free = eligible & ~forced
    worst_chosen = torch.where(chosen & free, scores, torch.inf).amin(-1)
    best_unchosen = torch.where(~chosen & free, scores, -torch.inf).amax(-1)
    scale = scores[torch.isfinite(scores)].abs().max().clamp(min=1.0)
    return bool(count_ok and not (chosen & ~eligible).any() and not (forced & ~chosen).any()
                and (best_unchosen <= worst_chosen + SELECT_SCORE_TOL * scale).all())


def select_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    q, k, _ = _inputs(spec, shape, device, dtype)

    def judge(lists) -> str | None:
        if valid_top_k(lists, q, k, spec):
            return None
        return "the block lists are not a valid top-k under the float64 scores"

    return Workload((q, k), judge if check else (lambda out: None))


def index_inputs(spec: Spec, shape: WorkloadShape, device, dtype, index_heads: int = INDEX_HEADS,
                 index_dim: int = INDEX_DIM, shared_key: bool = False, seed: int = 0):
    """Synthetic (q_idx, k_idx, w) of the index selector: randn index vectors in `dtype`, float32 weights
    of either sign scaled by 1/sqrt(Hi) (as an indexer's learned weights are, roughly)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    heads = shape.heads_kv * index_heads
    q_idx = torch.randn(shape.batch, heads, shape.n_q, index_dim, generator=gen)
    k_idx = torch.randn(shape.batch, 1 if shared_key else shape.heads_kv, shape.n_k, index_dim, generator=gen)
    w = torch.randn(shape.batch, heads, shape.n_q, generator=gen) / index_heads ** 0.5
    return q_idx.to(device=device, dtype=dtype), k_idx.to(device=device, dtype=dtype), w.to(device)


def select_index_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    index = index_inputs(spec, shape, device, dtype)
    q_idx, k_idx, _ = index  # the lengths and KV heads valid_top_k reads (k_idx has one head per KV head)

    def judge(lists) -> str | None:
        if valid_top_k(lists, q_idx, k_idx, spec, index):
            return None
        return "the block lists are not a valid top-k under the float64 index scores"

    return Workload(index, judge if check else (lambda out: None))


# ---- the registry --------------------------------------------------------------------------------

_KERNEL_READS_LISTS = {"selector": "given", "local": 0, "sink": 0}  # forced blocks are in the lists

ROLES: dict[str, Role] = {}


def register_role(role: Role) -> Role:
    """Add a role (a plug-in, or a test's); its name must be new."""
    if role.name in ROLES:
        raise KernelgenValueError(f"a role named {role.name!r} is registered already")
    ROLES[role.name] = role
    return role


def get_role(name: str) -> Role:
    try:
        return ROLES[name]
    except (KeyError, TypeError):
        raise KernelgenValueError(f"role={name!r} is unknown; expected one of {sorted(ROLES)}") from None


register_role(Role("lists", "caller-given block lists to the kernels' form (ids ascending, then -1; out-of-range "
                   "and repeated ids empty)", canonical=dict(_KERNEL_READS_LISTS, window=None, softcap=None)))
# a window spec's lists are its window's blocks: made from the lengths alone (kv_block, q_tile and top_k), no scores
register_role(Role("window_lists", "a selecting sliding-window spec's lists: each Q tile's window blocks, from its "
                   "last visible key (per row over a KV cache of per-row lengths)",
                   canonical={"head_dim": 64, "gqa_group": 1, "softcap": None}))
# the selectors score q . k unscaled and uncapped (a cap is increasing: it keeps the order of the scores)
register_role(Role("select", "block lists chosen by the spec's selector", workload=select_workload,
                   canonical={"softcap": None}))
register_role(Role("key_reps", "the pooling selectors' representatives of K's blocks, kept with a KV cache so that "
                   "selection reads them instead of pooling K each call", canonical={"softcap": None}))
# the write reads no field of the spec (its rows' width comes with the tensors): one module serves every spec
register_role(Role("append_kv", "new keys and values written into a KV cache at each row's end (a paged cache "
                   "through its table), before a call attends over it",
                   canonical=dict(_KERNEL_READS_LISTS, head_dim=64, kv_block=64, q_tile=DEFAULT_Q_TILE, top_k=1,
                                  causal=False, gqa_group=1, schedule="q_centric", window=None, softcap=None)))
# the index selector reads index tensors, not q and k: head_dim is no field of its kernels
register_role(Role("select_index", "block lists chosen by the index selector (token scores from index vectors, a "
                   "block's score the max over its visible tokens)", canonical={"head_dim": 64, "softcap": None},
                   workload=select_index_workload))
register_role(Role("attn", "attention over block lists: o and lse", canonical=_KERNEL_READS_LISTS,
                   workload=attention_workload))
# The backward of the Q-centric schedule, for the lists the forward used (selection is not differentiated).
# bwd_delta reads o and do alone: one kernel per head_dim serves every spec.
register_role(Role("bwd_delta", "backward preprocess: delta = rowsum(do * o) per query and head",
                   canonical=dict(_KERNEL_READS_LISTS, kv_block=64, q_tile=64, top_k=1, causal=False, gqa_group=1,
                                  window=None, softcap=None)))
register_role(Role("bwd_dq", "backward: dq over block lists, P recomputed from lse", canonical=_KERNEL_READS_LISTS,
                   workload=bwd_dq_workload))
register_role(Role("bwd_dkdv", "backward: dk and dv per KV block, over the Q tiles whose lists hold it (the "
                   "reverse index), the G query heads summed in the program", canonical=_KERNEL_READS_LISTS,
                   workload=bwd_dkdv_workload))
BACKWARD_ROLES = ("bwd_delta", "bwd_dq", "bwd_dkdv")  # what a backward runs, in order


def kv_attn_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    workload = attention_workload(spec, shape, device, dtype, check)  # per-query lists: the spec says so
    q, k, v, lists, scale = workload.args
    return dataclasses.replace(workload, args=(q, k, v, lists, None, scale))


# The KV-centric schedule's forward and backward (bwd_delta is the Q-centric schedule's: it reads o and do alone)
register_role(Role("kv_select", "per-query block lists chosen by the spec's selector", workload=select_workload))
register_role(Role("kv_select_index", "per-query block lists chosen by the index selector (a block's score for a "
                   "query the max of its visible token scores)", canonical={"head_dim": 64},
                   workload=select_index_workload))
register_role(Role("kv_attn", "attention over per-query lists: partials per (KV block, query chunk) task, merged "
                   "per query and head through lse", canonical=_KERNEL_READS_LISTS, workload=kv_attn_workload,
                   reverse_index=True))

UNION_WORKLOAD_OWN = 2  # the union design's workload lists: each span of 64 queries shares all but 2 of a query's


def union_workload_lists(spec: Spec, shape: WorkloadShape, device) -> torch.Tensor:
    return agreeing_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k, own=UNION_WORKLOAD_OWN,
                                device=device)


@functools.lru_cache(maxsize=64)
def union_workload_inflation(spec: Spec, n: int, tile_q: int) -> float:
    """The inflation of the union design's workload lists at n queries and keys and tiles of tile_q: what its
    tuned rate is per pair the lists hold (one KV head's lists on the CPU; inflation is a per-head statistic)."""
    from .tile_union import build_tile_union

    lists = union_workload_lists(spec, WorkloadShape(1, 1, n, n), "cpu")
    return build_tile_union(lists, tile_q, spec.n_kv_blocks(n)).inflation(lists)


def kv_union_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """The union design is served to lists whose neighbours agree: it is tuned on such lists (each span of 64
    queries sharing all but 2 of its blocks, `workloads.agreeing_query_lists`), not on a selector's picks from
    random inputs, which agree no more than random lists do."""
    from .tile_union import TileUnions

    workload = attention_workload(spec, shape, device, dtype, check, union_workload_lists(spec, shape, device))
    q, k, v, lists, scale = workload.args
    return dataclasses.replace(workload, args=(q, k, v, lists, TileUnions(lists, spec.n_kv_blocks(shape.n_k)), scale))


# the union design of the same forward: no partials, the products of every query of a tile over the tile's union
register_role(Role("kv_attn_union", "attention over per-query lists, a tile of consecutive queries over the union of "
                   "their blocks, each row masked to its own query's list", canonical=_KERNEL_READS_LISTS,
                   workload=kv_union_workload))


def kv_bwd_union_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """kv_bwd's workload over the lists the union design is tuned on (`kv_union_workload`'s), their tile union
    for each trial's tile_q built once (as kv_bwd's reverse index is)."""
    from .tile_union import TileUnions

    return _per_query_bwd_workload(spec, shape, device, dtype, check, union_workload_lists(spec, shape, device),
                                   lambda lists: TileUnions(lists, spec.n_kv_blocks(shape.n_k)))


register_role(Role("kv_bwd_union", "backward of the union design: dq per tile over its union, dk and dv per KV block "
                   "over the tiles whose union holds it, each row masked to its own query's list",
                   canonical=_KERNEL_READS_LISTS, workload=kv_bwd_union_workload))


register_role(Role("kv_bwd", "backward over per-query lists: dk, dv and the dq partials per KV block, over the (query, "
                   "slot) pairs that list it (the query reverse index), the G query heads summed in the program; "
                   "then dq's merge in slot order", canonical=_KERNEL_READS_LISTS, workload=kv_bwd_workload))
KV_BACKWARD_ROLES = ("bwd_delta", "kv_bwd")
# the roles that choose lists, one per (schedule, kind of selector): `Spec.selection_role` names a spec's; and
# their decode forms, the selection of a decode call or of a call over a cache of per-row lengths
# (`forward_roles(spec, 1)`)
DECODE_SELECTION_ROLES = {"select": "decode_select", "kv_select": "kv_decode_select",
                          "select_index": "decode_select_index", "kv_select_index": "kv_decode_select_index"}
SELECTION_ROLES = ("select", "select_index", "kv_select", "kv_select_index", *DECODE_SELECTION_ROLES.values())


# Decoding: a call of a few queries (one token, or a few speculative ones) against a long KV cache runs
# `decode` instead of the schedule's attention: the same lists and semantics, one program per (query, split)
DECODE_MAX_QUERIES = 16


def _one_query(n_q: int) -> int:
    return 1


def _prefill_chunk(n_q: int) -> int:
    return min(n_q, PREFILL_CHUNK)


def decode_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """The attention's workload with one query: the last token of the sequence, against every key."""
    one = shape._replace(n_q=1)
    return dataclasses.replace(attention_workload(spec, one, device, dtype, check), shape=one)


def decode_select_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """The selector's workload with one query: the last token of the sequence, against every block."""
    one = shape._replace(n_q=1)
    return dataclasses.replace(select_workload(spec, one, device, dtype, check), shape=one)


# A prefill over a KV cache of per-row lengths (a chunk of more than DECODE_MAX_QUERIES queries at the end of each
# row's keys): the schedule's forward kernel run per row (`attn_rows`, `kv_attn_rows`)
PREFILL_CHUNK = 2048  # the queries a tuned prefill over such a cache appends to each row


def cache_rows_lengths(batch: int, n_k: int, device) -> torch.Tensor:
    """The per-row lengths a prefill over a cache is tuned and benchmarked on: from the whole capacity n_k down to
    about half of it, so rows differ in length and in where the causal diagonal falls."""
    return torch.tensor([n_k - b * n_k // (2 * batch) for b in range(batch)], dtype=torch.int32, device=device)


def rows_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """A chunk of at most PREFILL_CHUNK queries at the end of each row of a cache of n_k keys whose rows hold
    `cache_rows_lengths`, over the lists the reference selector picks for each row alone (`_lists`' selector;
    per-query lists for a per-query spec, attended with no prepared reverse index)."""
    chunk = shape._replace(n_q=min(shape.n_q, PREFILL_CHUNK))
    q, k, v = _inputs(spec, chunk, device, dtype)
    lens = cache_rows_lengths(shape.batch, shape.n_k, device)
    rows = [(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]) for b, n in enumerate(lens.tolist())]
    lists = torch.cat([_lists(qb, kb, spec) for qb, kb, _ in rows])
    flops = sum(useful_flops(lists[b:b + 1], spec, chunk.n_q, kb.shape[2]) for b, (_, kb, _) in enumerate(rows))
    args = (q, k, v, lists, *((None,) if spec.per_query else ()), None, lens)
    if not check:
        return Workload(args, lambda out: None, flops, shape=chunk)
    given = spec.replace(selector="given")
    ref = reference.sparse_attention(q, k, v, given, block_idx=lists, cache_seqlens=lens)[0]
    return Workload(args, lambda out: _rel_l2_error("o", out[0], ref, REL_L2_TOL[out[0].dtype]), flops, shape=chunk)


PAGED_PREFILL_PAGE_BLOCKS = 1  # KV blocks a page of the cache a paged prefill is tuned on (the most scattered)


def paged_rows_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """`rows_workload`'s chunk over the same cache scattered over a pool of pages in a random order
    (PAGED_PREFILL_PAGE_BLOCKS blocks a page; the capacity padded to whole pages, past every row's keys), with its
    block table."""
    rows = rows_workload(spec, shape, device, dtype, check)
    q, k, v, lists, *_, lens = rows.args
    page_size = PAGED_PREFILL_PAGE_BLOCKS * spec.kv_block
    room = (0, 0, 0, -k.shape[2] % page_size)
    k, v = (torch.nn.functional.pad(x, room) for x in (k, v))
    order = torch.randperm(k.shape[0] * k.shape[2] // page_size, generator=torch.Generator().manual_seed(0))
    table = order.view(k.shape[0], -1).to(device=device, dtype=torch.int32)
    k_pages, v_pages = (reference.scatter_pages(x, page_size, order) for x in (k, v))
    # the launch signatures (module docstring): per-query lists take a reverse index before the scale, and a
    # leftpad (none: a paged row starts at its first page) before the table
    args = ((q, k_pages, v_pages, lists, None, None, lens, None, table) if spec.per_query
            else (q, k_pages, v_pages, lists, None, lens, table))
    return dataclasses.replace(rows, args=args)


register_role(Role("attn_rows", "attention of a prefill over a KV cache of per-row lengths (each row's queries the "
                   "last of its own keys): the Q-centric forward's kernel run per row", canonical=_KERNEL_READS_LISTS,
                   workload=rows_workload, timed_queries=_prefill_chunk))
register_role(Role("kv_attn_rows", "attention over per-query lists of a prefill over a KV cache of per-row lengths: "
                   "kv_attn's partial kernel run per row, then its combine", canonical=_KERNEL_READS_LISTS,
                   workload=rows_workload, reverse_index=True, timed_queries=_prefill_chunk))
register_role(Role("attn_paged", "attention of a prefill chunk over a paged KV cache of per-row lengths: attn's "
                   "loop over the pool's blocks where no mask is needed, a block at a time in its page where one is",
                   canonical=_KERNEL_READS_LISTS,
                   workload=paged_rows_workload, timed_queries=_prefill_chunk))
register_role(Role("kv_attn_paged", "attention over per-query lists of a prefill chunk over a paged KV cache: "
                   "kv_attn's partial kernel with each task's block based in its page, then its combine",
                   canonical=_KERNEL_READS_LISTS, workload=paged_rows_workload, reverse_index=True,
                   timed_queries=_prefill_chunk))


def decode_select_index_workload(spec: Spec, shape: WorkloadShape, device, dtype, check: bool = True) -> Workload:
    """The index selector's workload in a decode step over a KV cache of per-row lengths (`cache_rows_lengths`):
    one query at the end of each row, its lists judged against each row's own float64 scores."""
    one = shape._replace(n_q=1)
    q_idx, k_idx, w = index = index_inputs(spec, one, device, dtype)
    lens = cache_rows_lengths(shape.batch, shape.n_k, device)

    def judge(lists) -> str | None:
        for b, n in enumerate(lens.tolist()):
            row = (q_idx[b:b + 1], k_idx[b:b + 1, :, :n], w[b:b + 1])
            if not valid_top_k(lists[b:b + 1], row[0], row[1], spec, row):
                return f"row {b}'s block lists are not a valid top-k under its float64 index scores"
        return None

    return Workload((*index, lens), judge if check else (lambda out: None), shape=one)


register_role(Role("decode_select_index", "the index selector's lists for a call of a few queries (decoding) or over a "
                   "KV cache of per-row lengths: the select_index kernel with its blocks split over many programs",
                   canonical={"head_dim": 64, "softcap": None}, workload=decode_select_index_workload,
                   timed_queries=_one_query))
register_role(Role("kv_decode_select_index", "the index selector's per-query lists for a call of a few queries "
                   "(decoding) or over a KV cache of per-row lengths: the kv_select_index kernels, configured for "
                   "one query a row", canonical={"head_dim": 64}, workload=decode_select_index_workload,
                   timed_queries=_one_query))
register_role(Role("decode_select", "the pooling selectors' lists for a call of a few queries (decoding): the select "
                   "kernel with its blocks split over many programs", workload=decode_select_workload,
                   timed_queries=_one_query, canonical={"softcap": None}))
register_role(Role("kv_decode_select", "the pooling selectors' per-query lists for a call of a few queries (decoding): "
                   "the kv_select kernel with its blocks split over many programs", workload=decode_select_workload,
                   timed_queries=_one_query))
register_role(Role("decode", "attention of a few queries (decoding) over either schedule's lists: split-KV per query, "
                   "its G heads packed, splits merged through lse", canonical=_KERNEL_READS_LISTS,
                   workload=decode_workload, timed_queries=_one_query))


def backward_roles(spec: Spec) -> tuple[str, ...]:
    """The roles of a backward of `spec`'s schedule: (bwd_delta, bwd_dq, bwd_dkdv) for Q-centric lists,
    (bwd_delta, kv_bwd) for per-query ones (one pass gives dq, dk and dv)."""
    return KV_BACKWARD_ROLES if spec.per_query else BACKWARD_ROLES


def tuned_roles(spec: Spec) -> tuple[str, ...]:
    """The tuned roles that calls of `spec` can run: its selector's, the forward's (both designs of per-query
    lists), decode's and the backward's; a tune of the spec tunes these. A window spec's calls attend over lists
    they build (no selector): its forward's, over a cache's rows too, and its backward's."""
    if spec.window is not None:
        return tuple(n for n in ("attn", "attn_rows", "attn_paged", "decode", *backward_roles(spec)) if ROLES[n].tuned)
    _, selection, attn = forward_roles(spec)
    decode_selection = forward_roles(spec, 1)[1]
    paged = forward_roles(spec, paged=True)[2]
    names = [selection, attn, *(["kv_attn_union", "kv_attn_rows"] if spec.per_query else ["attn_rows"]), paged,
             *([decode_selection] if decode_selection != selection else []), "decode", *backward_roles(spec),
             *(["kv_bwd_union"] if spec.per_query else [])]
    return tuple(n for n in names if n is not None and ROLES[n].tuned)


def call_roles(spec: Spec) -> tuple[str, ...]:
    """The roles a call of `spec` runs: `lists` (caller-given lists), `window_lists` (a selecting window spec's),
    `select` (a spec with a selector; with the `mean` and `multi:r` selectors `key_reps` too, and `decode_select`
    or `decode_select_index` for a Q-centric decode call), `attn`, `decode` (a call of a few queries), `attn_rows`
    and `attn_paged` (a prefill over a cache of per-row lengths, contiguous or paged; `kv_attn_rows` and
    `kv_attn_paged` for per-query lists), `append_kv` (a call's new keys written into its cache), and its
    backward's, under the schedule's role names (`roles.forward_roles`, `roles.backward_roles`). Per-query specs run the
    gathered design only: their kv_attn config is pinned, and a pinned kv_attn keeps prepared lists off the union
    design."""
    lists, selection, attn = forward_roles(spec)
    backward = backward_roles(spec)
    kept = ("key_reps",) if selection in ("select", "kv_select") else ()  # the pooling selectors' kept reps
    _, decode_selection, decode = forward_roles(spec, 1)
    decoding = (decode_selection,) if decode_selection not in (None, selection) else ()
    rows = (forward_roles(spec, cache_rows=True)[2], forward_roles(spec, cache_rows=True, paged=True)[2])
    window = ("window_lists",) if spec.window is not None and selection else ()  # a window spec's own lists
    return (lists, *((selection,) if selection else ()), *window, *kept, attn, *decoding, decode, *rows,
            "append_kv") + backward


def pinnable_roles(spec: Spec) -> tuple[str, ...]:
    """The roles a config may be pinned for (`get_kernel(spec, configs=...)`): those a call runs (`call_roles`)
    and the tuned ones it may run (`tuned_roles`: per-query lists' union design too)."""
    return tuple(dict.fromkeys((*call_roles(spec), *tuned_roles(spec))))


def forward_roles(spec: Spec, n_q: int | None = None, cache_rows: bool = False,
                  paged: bool = False) -> tuple[str, str | None, str]:
    """(lists, the selection role or None for given lists, attn): the roles of a forward of `spec`'s
    schedule and selector; a call of n_q <= DECODE_MAX_QUERIES queries attends with `decode`. A call of more
    over a KV cache of per-row lengths (`cache_rows`, a prefill) selects as a decode call does (those roles
    take per-row lengths) and attends with `attn_rows` (`kv_attn_rows` over per-query lists), or over a paged
    cache (`paged`) with `attn_paged` (`kv_attn_paged`)."""
    decode = n_q is not None and n_q <= DECODE_MAX_QUERIES
    if decode or cache_rows or paged:
        selection = DECODE_SELECTION_ROLES.get(spec.selection_role, spec.selection_role)
        rows = ("kv_" if spec.per_query else "") + ("attn_paged" if paged else "attn_rows")
        return ("lists", selection, "decode" if decode else rows)
    return ("lists", spec.selection_role, "kv_attn" if spec.per_query else "attn")

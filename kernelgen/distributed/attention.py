"""`kernelgen.distributed.attention`: sparse attention over a sequence sharded across a process group.

A call checks the shards (the same shapes on every rank, one all_gather), takes this rank's rows of the
global lists (given, or selected across shards: `select.py`), chooses a path from the bytes each would move
(`traffic`), and runs it in a torch.autograd.Function:
  dense   the ring (`ring.py`): every KV shard visits every rank; partials merged through lse
  sparse  the fetch (`fetch.py`): only the remote blocks the lists name, then one local attention
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..dispatch import SparseAttention, get_kernel, once_differentiable
from ..errors import KernelgenRuntimeError, KernelgenTypeError, KernelgenValueError
from ..inputs import Shapes, check_index, check_qkv, check_return_lse, check_scale
from ..sinks import check_sinks, with_sinks
from ..spec import Spec
from .comm import Group, group_of
from .fetch import fetch, local_backward, local_forward, local_prepared, requests_of, return_gradients
from .layout import LAYOUTS, Layout
from .ring import ring_backward, ring_forward
from .select import check_selects_across_shards, select_index_rows, select_rows

__all__ = ["attention", "select_blocks", "shard", "unshard", "traffic", "Traffic", "PATHS"]

PATHS = ("auto", "dense", "sparse")
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@dataclass(frozen=True)
class _Call:
    """What the paths of one call share."""

    spec: Spec
    layout: Layout
    group: Group
    tables: tuple          # Layout.block_tables on the inputs' device
    tile_chunk: torch.Tensor
    scale: float | None
    causal_attn: SparseAttention  # the spec's kernels over given lists (forced blocks are in the lists)
    full_attn: SparseAttention    # the same without causal masking: a shard of earlier chunks

    @classmethod
    def of(cls, spec: Spec, layout: Layout, group: Group, device, scale=None) -> "_Call":
        """The call of rank `layout.rank` (`group` may be Group(None, rank, world): the per-rank pieces that do not
        communicate run without a process group, as `simulate.py` runs every rank in one process)."""
        lists_spec = spec.replace(selector="given", sink=0, local=0)
        return cls(spec, layout, group, layout.block_tables(spec.kv_block, device),
                   layout.tile_chunks(spec.q_tile, device), scale, get_kernel(lists_spec),
                   get_kernel(lists_spec.replace(causal=False)))

    def attn_for(self, src: int) -> SparseAttention:
        """The kernels that attend this rank's queries to rank `src`'s shard."""
        return self.causal_attn if src == self.group.rank else self.full_attn


class Traffic(NamedTuple):
    """Bytes one rank sends, the largest over the ranks: `dense` for the ring, `sparse` for the fetch (requested
    ids and blocks) in a forward; `dense_backward`, `sparse_backward` in a backward (the ring sends the K/V shards
    round again and the dK/dV sums, fp32, one hop more; the fetch sends the fetched blocks' dK/dV back)."""

    dense: int
    sparse: int
    dense_backward: int = 0
    sparse_backward: int = 0

    def path(self, backward: bool = False) -> str:
        """The path `path="auto"` takes: the one that moves fewer bytes in a forward, or, when a backward will
        run, in the forward and backward together (the ring's backward sends more than its forward)."""
        if backward:
            return "sparse" if self.sparse + self.sparse_backward < self.dense + self.dense_backward else "dense"
        return "sparse" if self.sparse < self.dense else "dense"


def traffic(k_shape, elem_bytes: int, world: int, kv_block: int, blocks: int) -> Traffic:
    """The bytes of each path for K/V shards of `k_shape` [B, Hkv, shard, D] over `world` ranks, when the rank
    that moves most fetches or serves `blocks` (batch x KV head, block) pairs."""
    b, hkv, n, d = k_shape
    kv_shard = 2 * b * hkv * n * d
    dense = (world - 1) * kv_shard * elem_bytes
    sparse = blocks * (8 + 2 * kv_block * d * elem_bytes)  # its int64 id, then K and V
    dense_backward = dense + world * kv_shard * 4  # the K/V again; dK/dV in fp32 at steps 1..P-1 and home
    sparse_backward = blocks * 2 * kv_block * d * elem_bytes
    return Traffic(dense, sparse, dense_backward, sparse_backward)


_UNCHECKED = object()  # a scale this rank refused (or never reached): left out of the comparison
_MESSAGE_BYTES = 512  # of a rank's refusal, as the other ranks receive it
# (a refusal's base, the kind the other ranks raise for it): the first base the refusal is an instance of
_REFUSAL_KINDS = ((TypeError, KernelgenTypeError), (ValueError, KernelgenValueError), (Exception, KernelgenRuntimeError))
_WIDEST = 8  # dims of a tensor whose shape the check compares


def _shape_field(x, dims: int | None = None) -> list[int]:
    """x's shape as a field of `_agree` (-1s where x is no tensor of `dims` dims, at most _WIDEST; ndim first)."""
    if not isinstance(x, torch.Tensor) or x.dim() > _WIDEST or dims is not None and x.dim() != dims:
        return [-1] * (1 + (dims or _WIDEST))
    return [x.dim(), *x.shape, *[0] * ((dims or _WIDEST) - x.dim())]


def _agree(group: Group, device, fields: list[tuple], refusal: Exception | None) -> None:
    """Raise on every rank when `fields` differ across ranks or any rank refused its call (`refusal`: this
    rank's own error, re-raised here), in one all_gather: a rank that raised alone would leave the others
    waiting forever in a collective it never enters. `fields`: (name, ints (-1: not known on this rank),
    how to show them or None)."""
    message = list(str(refusal).encode()[:_MESSAGE_BYTES]) if refusal is not None else []
    mine = [_refusal_code(refusal)] + [x for _, values, _ in fields for x in values]
    mine += message + [0] * (_MESSAGE_BYTES - len(message))
    everyone = torch.stack(group.all_gather(torch.tensor(mine, dtype=torch.int64, device=device))).tolist()
    start = 1
    for name, values, show in fields:
        stop = start + len(values)
        known = [(s, row[start:stop]) for s, row in enumerate(everyone) if -1 not in row[start:stop]]
        for s, theirs in known:
            first, ours = known[0]
            if theirs != ours:
                what = f": rank {first} has {show(ours)}, rank {s} has {show(theirs)}" if show else \
                    f" (rank {first} and rank {s})"
                raise KernelgenValueError(
                    f"{name} differs across ranks{what}; every rank must make the same call (spec, layout, path, "
                    "scale, block_idx or index given or not, inputs requiring grad or not) on shards of one shape "
                    "and dtype")
        start = stop
    if refusal is not None:
        raise refusal
    for s, row in enumerate(everyone):
        if row[0]:
            text = bytes(row[start:start + _MESSAGE_BYTES]).rstrip(b"\0").decode(errors="replace")
            raise _REFUSAL_KINDS[row[0] - 1][1](f"rank {s} refused its call: {text} (every rank raises, none waits "
                                                "for it)")


def _refusal_code(refusal: Exception | None) -> int:
    """0 for none, else 1 + the index in _REFUSAL_KINDS of its kind."""
    if refusal is None:
        return 0
    return 1 + next(i for i, (base, _) in enumerate(_REFUSAL_KINDS) if isinstance(refusal, base))


def _device_of(x, group: Group):
    """Where the check's tensor goes: where the group's backend communicates (x's device when it can), so that a
    rank whose x is on a device the backend cannot take (a CPU shard under NCCL) refuses instead of raising alone
    in the check's all_gather."""
    if dist.get_backend(group.pg) != "nccl":
        return torch.device("cpu")
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return x.device
    return torch.device("cuda", torch.cuda.current_device())


def _crc(value) -> int:
    return zlib.crc32(repr(value).encode())


def _check_same_everywhere(q, k, spec: Spec, layout: str, given: bool, path: str, backward: bool, scale,
                           refusal: Exception | None, group: Group, index=None) -> None:
    """The shards' shapes and dtype and the call's options must agree across the ranks, and no rank may have
    refused its call (one all_gather; a ValueError on every rank otherwise)."""
    fields = [
        ("q shard shape", _shape_field(q, 4)[1:], list), ("k shard shape", _shape_field(k, 4)[1:], list),
        ("dtype", [_DTYPE_CODES.get(getattr(q, "dtype", None), -1)], lambda v: str(list(_DTYPE_CODES)[v[0]])),
        ("layout", [LAYOUTS.index(layout) if layout in LAYOUTS else -1], lambda v: repr(LAYOUTS[v[0]])),
        ("block_idx given", [int(given)], None),
        ("index given", [int(index is not None)], None),
        ("k_idx shard shape", _shape_field(index[1] if isinstance(index, (tuple, list)) and len(index) == 3 else None,
                                           4)[1:], list),
        ("path", [PATHS.index(path) if path in PATHS else -1], lambda v: repr(PATHS[v[0]])),
        ("whether an input requires grad", [int(backward)], None),
        ("spec", [_crc(spec.to_json()) if isinstance(spec, Spec) else -1], None),
        ("scale", [-1 if scale is _UNCHECKED else _crc(scale)], None),  # a refused one is not compared
    ]
    _agree(group, _device_of(q, group), fields, refusal)


def _rows(block_idx, spec: Spec, layout: Layout, b: int, hkv: int, device) -> torch.Tensor:
    """This rank's rows of caller-given lists: global lists [B, Hkv, n_q_tiles(N), top_k], or this rank's rows
    already [B, Hkv, shard's Q tiles, top_k] (shard order). Block ids are global. A B or Hkv dimension of 1
    broadcasts, as on one GPU."""
    if not isinstance(block_idx, torch.Tensor):
        raise KernelgenTypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError(f"block_idx.dtype must be torch.int32 or int64, got {block_idx.dtype}")
    if block_idx.device != device:
        raise KernelgenValueError(f"block_idx is on {block_idx.device} but q is on {device}")
    n_tiles, own = layout.n // spec.q_tile, layout.shard_len // spec.q_tile
    shape = tuple(block_idx.shape)
    if block_idx.dim() == 4 and shape[0] in (1, b) and shape[1] in (1, hkv) and shape[3] == spec.top_k:
        block_idx = block_idx.expand(b, hkv, -1, -1)
        if shape[2] == n_tiles:
            return block_idx[:, :, layout.global_ids(spec.q_tile, device=device)]
        if shape[2] == own:
            return block_idx.contiguous()
    raise KernelgenValueError(
        f"block_idx.shape = {shape}; expected the global lists [B, Hkv, n_q_tiles, top_k] = {(b, hkv, n_tiles, spec.top_k)} "
        f"(global block ids, the lists one GPU would use for N={layout.n}), or this rank's rows of them "
        f"{(b, hkv, own, spec.top_k)} in {layout.name} shard order")


def _check_call(q, k, v, spec, layout: str, path: str) -> None:
    """What a call needs on any rank, checked on this one alone."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if spec.per_query:
        raise KernelgenValueError("kernelgen.distributed runs the Q-centric schedule; spec.schedule='kv_centric' "
                                  "is not supported across shards")
    if layout not in LAYOUTS:
        raise KernelgenValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")
    if path not in PATHS:
        raise KernelgenValueError(f"path={path!r} is unknown; expected one of {PATHS}")
    check_qkv(q, k, v, spec)
    if q.shape[2] != k.shape[2]:
        raise KernelgenValueError(f"q_shard has {q.shape[2]} rows and k_shard {k.shape[2]}: context parallelism "
                                  "shards one sequence, so q, k and v shards have the same length")


def _prepare_call(q, k, v, spec: Spec, group, layout: str, block_idx, scale, path: str = "auto",
                  backward: bool = False, return_lse: bool = False, index=None, sinks=None):
    """(call, this rank's rows of the given lists or None, the checked index shards or None); call None when the
    group has one rank (the call runs as on one GPU). Every rank checks its own call, then all agree
    (`_check_same_everywhere`): a call refused on one rank raises on every rank, never leaves the others waiting in
    a collective."""
    g = group_of(group)
    if g.world == 1:
        check_return_lse(return_lse)
        _check_call(q, k, v, spec, layout, path)
        return None, None, index
    refusal, lay, rows, checked = None, None, None, _UNCHECKED
    try:
        check_return_lse(return_lse)
        checked = None if scale is None else check_scale(scale)  # a float: ranks compare its value, not its type
        _check_call(q, k, v, spec, layout, path)
        if spec.window is not None:  # the per-rank kernels over shards take no window
            raise KernelgenValueError(f"Spec.window={spec.window}: context-parallel attention is not built with a "
                                      "sliding window; a window spec runs on one GPU (a group of one rank)")
        if sinks is not None:
            check_sinks(sinks, q.shape[1], q.device)
        lay = Layout.of_shard(layout, g.world, g.rank, q.shape[2])
        lay.check(spec)
        if block_idx is not None:
            rows = _rows(block_idx, spec, lay, k.shape[0], k.shape[1], q.device)
            if index is not None:
                raise KernelgenValueError("pass block_idx= or index=, not both: index= chooses the lists "
                                          "block_idx= gives")
        else:
            check_selects_across_shards(spec, index)
            if index is not None:
                b, hkv, n = k.shape[0], k.shape[1], q.shape[2]
                shapes = Shapes(b, q.shape[1], hkv, n, n, spec.n_q_tiles(n), spec.n_kv_blocks(n))
                index = check_index(index, spec, shapes, q.device)
    except Exception as error:  # not only kernelgen's: any error raised here alone would leave the others waiting
        refusal = error
    _check_same_everywhere(q, k, spec, layout, block_idx is not None, path, backward, checked, refusal, g, index)
    return _Call.of(spec, lay, g, q.device, checked), rows, index


def _choose(rows, call: _Call, k, path: str, backward: bool):
    """(path, requests or None): "sparse" when the fetch moves fewer bytes than the ring, counting the backward's
    when one will run (every rank decides alike: the counts are all-reduced)."""
    if path == "dense":
        return "dense", None
    requests = requests_of(rows, call.layout, call.tables, call.tile_chunk, call.spec.causal)
    if path == "sparse":
        return "sparse", requests
    counts = torch.tensor(requests.counts, dtype=torch.int64, device=k.device)
    answered = torch.stack(call.group.all_gather(counts))[:, call.group.rank].sum()
    most = int(call.group.all_max(torch.maximum(counts.sum(), answered)))
    chosen = traffic(k.shape, k.element_size(), call.group.world, call.spec.kv_block, most).path(backward)
    return chosen, requests if chosen == "sparse" else None


class _ContextParallel(torch.autograd.Function):
    """o, lse of this rank's queries; the backward returns dq, dk, dv of this rank's shards (dK/dV of its
    blocks that other ranks read come home through the path's communication, reversed)."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call, rows, path: str, requests):
        ctx.call, ctx.path = call, path
        if path == "dense":
            o, lse, steps = ring_forward(q, k, v, rows, call)
            ctx.steps = steps
            ctx.save_for_backward(q, k, v, o, lse)
        else:
            fetched = fetch(k, v, requests, call.layout, call.tables, call.spec.kv_block, call.group)
            prepared = local_prepared(rows, fetched, call)
            o, lse = local_forward(q, fetched.k, fetched.v, prepared, call)
            ctx.fetched, ctx.prepared = fetched._replace(k=None, v=None), prepared
            ctx.save_for_backward(q, fetched.k, fetched.v, o, lse, k, v)  # k, v: the shards dk, dv belong to
        return o, lse

    @staticmethod
    @once_differentiable  # no double backward: create_graph=True gradients raise when differentiated
    def backward(ctx, do, dlse):
        call = ctx.call
        q, k, v, o, lse = ctx.saved_tensors[:5]
        if do.stride(-1) != 1:
            do = do.contiguous()
        if ctx.path == "dense":
            dq, dk, dv = ring_backward(do, q, k, v, o, lse, ctx.steps, call, dlse)
        else:
            dq, dk_local, dv_local = local_backward(do, q, k, v, o, lse, ctx.prepared, call, dlse)
            dk, dv = return_gradients(dk_local, dv_local, ctx.fetched, call.tables, call.spec.kv_block, call.group)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None)


def attention(q_shard: torch.Tensor, k_shard: torch.Tensor, v_shard: torch.Tensor, spec: Spec, *, group=None,
              block_idx: torch.Tensor | None = None, index=None, layout: str = "zigzag", path: str = "auto",
              scale=None, return_lse: bool = False, sinks=None):
    """Sparse attention of a sequence sharded along N over the ranks of `group` (default: the default process
    group; without an initialized one, or in a group of one rank, it runs as `get_kernel(spec)` on one GPU).

    q_shard [B, Hq, N/P, D], k_shard, v_shard [B, Hkv, N/P, D]: this rank's shard in `layout` ("zigzag":
    chunks r and 2P-1-r of 2P; "contiguous": chunk r of P; `shard` cuts a full tensor). block_idx: global
    block ids, the lists one GPU would use ([B, Hkv, n_q_tiles(N), top_k]) or this rank's rows of them; None:
    the spec's selector, run across shards (the index selector's from `index` = this rank's shards of (q_idx,
    k_idx, w), in q's layout). path: "dense" (ring), "sparse" (fetch the listed remote blocks)
    or "auto" (the one that moves fewer bytes). sinks: [Hq] attention sinks, as `get_kernel(spec)`'s call takes
    them (their gradient on each rank is its own rows' share: sum it over the ranks, as any parameter replicated
    across them). Returns this rank's o (and lse) shard; both backpropagate.
    """
    backward = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                               for x in (q_shard, k_shard, v_shard))
    call, rows, index = _prepare_call(q_shard, k_shard, v_shard, spec, group, layout, block_idx, scale, path,
                                      backward, return_lse, index, sinks)
    if call is None:
        o, lse = get_kernel(spec)(q_shard, k_shard, v_shard, block_idx=block_idx, index=index, scale=scale,
                                  return_lse=True, sinks=sinks)
        return (o, lse) if return_lse else o
    if rows is None:
        rows = _select(q_shard, k_shard, spec, call, index)
    chosen, requests = _choose(rows, call, k_shard, path, backward)
    o, lse = _ContextParallel.apply(q_shard, k_shard, v_shard, call, rows, chosen, requests)
    if sinks is not None:
        o, lse = with_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o


def select_blocks(q_shard: torch.Tensor, k_shard: torch.Tensor, spec: Spec, *, group=None, index=None,
                  layout: str = "zigzag") -> torch.Tensor:
    """This rank's rows of the lists one GPU's selector would choose: int32 [B, Hkv, shard's Q tiles, top_k],
    global block ids, tiles in shard order (pass them as block_idx). `index`: the index selector's, as
    `attention`'s."""
    call, _, index = _prepare_call(q_shard, k_shard, k_shard, spec, group, layout, None, None, index=index)
    if call is None:
        return get_kernel(spec).select(q_shard, k_shard, index=index)
    return _select(q_shard, k_shard, spec, call, index)


def _select(q, k, spec: Spec, call: _Call, index) -> torch.Tensor:
    """This rank's rows of the lists the spec's selector chooses across the shards."""
    if index is not None:
        return select_index_rows(q, index, spec, call.layout, call.group)
    return select_rows(q, k, spec, call.layout, call.group)


def shard(x: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """This rank's shard of a full [B, H, N, ...] tensor (the same on every rank), contiguous."""
    g = group_of(group)
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise KernelgenValueError(f"x must be a [B, H, N, ...] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    return Layout(layout, g.world, g.rank, x.shape[2]).take(x)  # one rank: the whole sequence, of any length


def unshard(x_shard: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """The full [B, H, N, ...] tensor from every rank's shard (an all_gather; no gradient flows through it)."""
    g = group_of(group)
    refusal = None
    try:
        if not isinstance(x_shard, torch.Tensor) or not 3 <= x_shard.dim() <= _WIDEST:
            raise KernelgenValueError(f"x_shard must be a [B, H, N, ...] tensor of at most {_WIDEST} dims, got "
                                      f"{getattr(x_shard, 'shape', type(x_shard).__name__)}")
        lay = Layout.of_shard(layout, g.world, g.rank, x_shard.shape[2])
    except Exception as error:  # raised alone, it would leave the other ranks waiting in the all_gather
        if g.world == 1:
            raise
        refusal = error
    if g.world == 1:
        return x_shard.detach()
    dtype = [_crc(x_shard.dtype) if refusal is None else -1]
    shape = ("x_shard shape", _shape_field(x_shard), lambda v: v[1:1 + v[0]])
    name = ("layout", [LAYOUTS.index(layout) if layout in LAYOUTS else -1], lambda v: repr(LAYOUTS[v[0]]))
    _agree(g, _device_of(x_shard, g), [shape, ("x_shard dtype", dtype, None), name], refusal)
    return lay.assemble(g.all_gather(x_shard.detach()))

"""`kernelgen.distributed.attention`: sparse attention over a sequence sharded across a process group.

A call checks the shards (the same shapes on every rank, one all_gather), takes this rank's rows of the
global lists (given, or selected across shards: `select.py`), chooses a path from the bytes each would move
(`traffic`), and runs it in a torch.autograd.Function:
  dense   the ring (`ring.py`): every KV shard visits every rank; partials merged through lse
  sparse  the fetch (`fetch.py`): only the remote blocks the lists name, then one local attention
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..dispatch import SparseAttention, get_kernel
from ..errors import KernelgenTypeError, KernelgenValueError
from ..inputs import check_qkv, check_return_lse
from ..spec import Spec
from .comm import Group, group_of
from .fetch import fetch, local_backward, local_forward, local_prepared, requests_of, return_gradients
from .layout import LAYOUTS, Layout
from .ring import ring_backward, ring_forward
from .select import select_rows

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


def _check_same_everywhere(q, k, spec: Spec, layout: str, given: bool, group: Group) -> None:
    """The shards' shapes, dtype and the call's options must agree across the ranks (one all_gather)."""
    mine = torch.tensor([*q.shape, *k.shape, _DTYPE_CODES[q.dtype], LAYOUTS.index(layout), int(given)],
                        dtype=torch.int64, device=q.device)
    everyone = torch.stack(group.all_gather(mine)).tolist()
    names = ("q shard shape", "k shard shape", "dtype", "layout", "block_idx given")
    cuts = ((0, 4), (4, 8), (8, 9), (9, 10), (10, 11))
    for s, theirs in enumerate(everyone):
        for name, (a, z) in zip(names, cuts):
            if theirs[a:z] != everyone[0][a:z]:
                raise KernelgenValueError(
                    f"{name} differs across ranks: rank 0 has {everyone[0][a:z]}, rank {s} has {theirs[a:z]}; "
                    "every rank must pass shards of the same shape, dtype and layout (and all or none pass block_idx)")


def _rows(block_idx, spec: Spec, layout: Layout, b: int, hkv: int, device) -> torch.Tensor:
    """This rank's rows of caller-given lists: global lists [B, Hkv, n_q_tiles(N), top_k], or this rank's rows
    already [B, Hkv, shard's Q tiles, top_k] (shard order). Block ids are global."""
    if not isinstance(block_idx, torch.Tensor):
        raise KernelgenTypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise KernelgenTypeError(f"block_idx.dtype must be torch.int32 or int64, got {block_idx.dtype}")
    if block_idx.device != device:
        raise KernelgenValueError(f"block_idx is on {block_idx.device} but q is on {device}")
    n_tiles, own = layout.n // spec.q_tile, layout.shard_len // spec.q_tile
    shape = tuple(block_idx.shape)
    if block_idx.dim() == 4 and shape[:2] == (b, hkv) and shape[3] == spec.top_k:
        if shape[2] == n_tiles:
            return block_idx[:, :, layout.global_ids(spec.q_tile, device=device)]
        if shape[2] == own:
            return block_idx
    raise KernelgenValueError(
        f"block_idx.shape = {shape}; expected the global lists [B, Hkv, n_q_tiles, top_k] = {(b, hkv, n_tiles, spec.top_k)} "
        f"(global block ids, the lists one GPU would use for N={layout.n}), or this rank's rows of them "
        f"{(b, hkv, own, spec.top_k)} in {layout.name} shard order")


def _prepare_call(q, k, v, spec: Spec, group, layout: str, given: bool, scale) -> _Call | None:
    """Checks; None when the group has one rank (the call runs as on one GPU)."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if spec.per_query:
        raise KernelgenValueError("kernelgen.distributed runs the Q-centric schedule; spec.schedule='kv_centric' "
                                  "is not supported across shards")
    if layout not in LAYOUTS:
        raise KernelgenValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")
    check_qkv(q, k, v, spec)
    if q.shape[2] != k.shape[2]:
        raise KernelgenValueError(f"q_shard has {q.shape[2]} rows and k_shard {k.shape[2]}: context parallelism "
                                  "shards one sequence, so q, k and v shards have the same length")
    g = group_of(group)
    if g.world == 1:
        return None
    _check_same_everywhere(q, k, spec, layout, given, g)
    lay = Layout.of_shard(layout, g.world, g.rank, q.shape[2])
    lay.check(spec)
    return _Call.of(spec, lay, g, q.device, scale)


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
            ctx.save_for_backward(q, fetched.k, fetched.v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _dlse):
        call = ctx.call
        q, k, v, o, lse = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        if ctx.path == "dense":
            dq, dk, dv = ring_backward(do, q, k, v, o, lse, ctx.steps, call)
        else:
            dq, dk_local, dv_local = local_backward(do, q, k, v, o, lse, ctx.prepared, call)
            dk, dv = return_gradients(dk_local, dv_local, ctx.fetched, call.tables, call.spec.kv_block, call.group)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None)


def attention(q_shard: torch.Tensor, k_shard: torch.Tensor, v_shard: torch.Tensor, spec: Spec, *, group=None,
              block_idx: torch.Tensor | None = None, layout: str = "zigzag", path: str = "auto", scale=None,
              return_lse: bool = False):
    """Sparse attention of a sequence sharded along N over the ranks of `group` (default: the default process
    group; without an initialized one, or in a group of one rank, it runs as `get_kernel(spec)` on one GPU).

    q_shard [B, Hq, N/P, D], k_shard, v_shard [B, Hkv, N/P, D]: this rank's shard in `layout` ("zigzag":
    chunks r and 2P-1-r of 2P; "contiguous": chunk r of P; `shard` cuts a full tensor). block_idx: global
    block ids, the lists one GPU would use ([B, Hkv, n_q_tiles(N), top_k]) or this rank's rows of them; None:
    the spec's selector, run across shards. path: "dense" (ring), "sparse" (fetch the listed remote blocks)
    or "auto" (the one that moves fewer bytes). Returns this rank's o (and lse) shard; o backpropagates.
    """
    check_return_lse(return_lse)
    if path not in PATHS:
        raise KernelgenValueError(f"path={path!r} is unknown; expected one of {PATHS}")
    call = _prepare_call(q_shard, k_shard, v_shard, spec, group, layout, block_idx is not None, scale)
    if call is None:
        o, lse = get_kernel(spec)(q_shard, k_shard, v_shard, block_idx=block_idx, scale=scale, return_lse=True)
        return (o, lse) if return_lse else o
    b, hkv = k_shard.shape[:2]
    if block_idx is None:
        if not spec.selects:
            raise KernelgenValueError("spec.selector='given' needs block_idx= (global block ids)")
        rows = select_rows(q_shard, k_shard, spec, call.layout, call.group)
    else:
        rows = _rows(block_idx, spec, call.layout, b, hkv, q_shard.device)
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q_shard, k_shard, v_shard))
    chosen, requests = _choose(rows, call, k_shard, path, backward)
    o, lse = _ContextParallel.apply(q_shard, k_shard, v_shard, call, rows, chosen, requests)
    return (o, lse) if return_lse else o


def select_blocks(q_shard: torch.Tensor, k_shard: torch.Tensor, spec: Spec, *, group=None,
                  layout: str = "zigzag") -> torch.Tensor:
    """This rank's rows of the lists one GPU's selector would choose: int32 [B, Hkv, shard's Q tiles, top_k],
    global block ids, tiles in shard order (pass them as block_idx)."""
    call = _prepare_call(q_shard, k_shard, k_shard, spec, group, layout, False, None)
    if call is None:
        return get_kernel(spec).select(q_shard, k_shard)
    return select_rows(q_shard, k_shard, spec, call.layout, call.group)


def shard(x: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """This rank's shard of a full [B, H, N, ...] tensor (the same on every rank), contiguous."""
    g = group_of(group)
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise KernelgenValueError(f"x must be a [B, H, N, ...] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    lay = Layout(layout, g.world, g.rank, x.shape[2])
    if x.shape[2] % lay.n_chunks:
        raise KernelgenValueError(f"x.shape[2] = {x.shape[2]} is not a multiple of the {lay.n_chunks} chunks of "
                                  f"layout={layout!r} over {g.world} ranks")
    return lay.take(x)


def unshard(x_shard: torch.Tensor, layout: str = "zigzag", group=None) -> torch.Tensor:
    """The full [B, H, N, ...] tensor from every rank's shard (an all_gather; no gradient flows through it)."""
    g = group_of(group)
    lay = Layout.of_shard(layout, g.world, g.rank, x_shard.shape[2])
    if g.world == 1:
        return x_shard
    return lay.assemble(g.all_gather(x_shard.detach()))

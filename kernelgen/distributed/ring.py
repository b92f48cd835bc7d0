"""The dense ring path: every KV shard visits every rank.

Step t of rank r: it holds the K/V shard of rank `(r - t) mod P` (its own at t = 0), sends it on to rank
r + 1 and receives the next from r - 1 while it attends its queries to the shard it holds, over the
listed blocks that live there (`step_lists`). Each step gives a partial output and its lse; the P partials
merge through their lse in step order with the KV-centric schedule's combine kernel (fp32 arithmetic).

Backward: the same ring. Each step's dq, dk, dv come from the Q-centric backward kernels driven with the
*merged* output's lse and `delta = rowsum(dO * O)` (exact: a partial's keys get P = exp(s - lse_final)); dq
sums over the steps in step order. The dK/dV of a shard travel with it, in fp32, one hop behind the K/V:
shard s collects the terms of ranks s, s+1, ..., s+P-1 in that order, then a last hop brings it home.
"""
from __future__ import annotations

import torch

from ..backends.triton import combine_partials
from ..dispatch import get_kernel
from ..inputs import BlockLists, Shapes
from ..spec import Spec

__all__ = ["step_lists", "step_prepared", "forward_step", "backward_step", "merge_partials", "ring_forward",
           "ring_backward"]


def step_lists(rows: torch.Tensor, src: int, tables, tile_chunk: torch.Tensor, causal: bool) -> torch.Tensor:
    """int32 lists over rank `src`'s shard: the entries of `rows` (global ids, this rank's tiles) that `src`
    holds, as its local ids; under causal masking only blocks of a chunk no later than the tile's (a later
    chunk is invisible; the tile's own chunk is masked by the kernel). Other entries: -1."""
    owner, local, chunk = tables
    ids = rows.long()
    valid = (ids >= 0) & (ids < owner.numel())
    safe = ids.clamp(0, owner.numel() - 1)
    keep = valid & (owner[safe] == src)
    if causal:
        keep &= chunk[safe] <= tile_chunk[None, None, :, None]
    return torch.where(keep, local[safe], -1).to(torch.int32)


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(o in `dtype`, float32 lse) of partials o_part [B, Hq, N, S, D] and lse_part [B, Hq, N, S] over disjoint
    key sets: the KV-centric combine (`kv_combine`), slot by slot in fp32; an empty part (lse = -inf) drops out."""
    b, h, n, parts, d = o_part.shape
    combine = get_kernel(Spec(head_dim=d, top_k=parts, schedule="kv_centric", selector="given"))
    served = combine.served("kv_attn", n, dtype, o_part.device)
    # every slot holds a part; the kernel reads a row's slots at unit stride
    used = torch.zeros(1, 1, 1, parts, dtype=torch.int32, device=o_part.device).expand(b, h, n, parts)
    return combine_partials(served.kernel, served.spec, served.config, Shapes(b, h, h, n, n, n, 1), o_part, lse_part,
                            used, dtype)


def step_prepared(rows, src: int, n_q: int, call) -> BlockLists:
    """The prepared lists of the ring step over rank `src`'s shard (`call`: a `_Call`; `n_q` = shard length)."""
    lists = step_lists(rows, src, call.tables, call.tile_chunk, call.spec.causal)
    return call.attn_for(src).prepare(lists, n_q, n_q)


def forward_step(q, kv, prepared: BlockLists, src: int, call) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of this rank's queries over rank `src`'s shard, kv = stack([k, v]) of it: one step's partial."""
    return call.attn_for(src)(q, kv[0], kv[1], block_idx=prepared, scale=call.scale, return_lse=True)


def backward_step(do, q, kv, o, lse, prepared: BlockLists, src: int, call,
                  dlse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv) of one step: this rank's queries' terms over rank `src`'s shard, driven by the *merged* o and
    lse (and lse's gradient `dlse`); dkv = fp32 stack([dk, dv]) of that shard (what travels on round the ring)."""
    dq, dk, dv = call.attn_for(src)._gradients(do, q, kv[0], kv[1], o, lse, prepared.block_idx, call.scale,
                                               prepared.reverse_index(), dlse=dlse)
    return dq, torch.stack([dk, dv]).float()


def ring_forward(q, k, v, rows, ctx) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(o, lse, each step's prepared lists) of this rank's queries over every shard (`ctx`: a `_Call`)."""
    group, world, rank = ctx.group, ctx.group.world, ctx.group.rank
    kv = torch.stack([k, v])
    b, hq, n, d = q.shape
    o_part = torch.empty(b, hq, n, world, d, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(b, hq, n, world, dtype=torch.float32, device=q.device)
    steps = []
    for t in range(world):
        src = (rank - t) % world
        recv, works = group.ring_exchange([kv]) if t < world - 1 else (None, [])
        steps.append(step_prepared(rows, src, n, ctx))
        o_part[:, :, :, t], lse_part[..., t] = forward_step(q, kv, steps[-1], src, ctx)
        for work in works:
            work.wait()
        if recv is not None:
            kv = recv[0]
    o, lse = merge_partials(o_part, lse_part, q.dtype)
    return o, lse, steps


def ring_backward(do, q, k, v, o, lse, steps, ctx, dlse=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shards; `steps`: the forward's prepared lists per step."""
    group, world, rank = ctx.group, ctx.group.world, ctx.group.rank
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc = None  # fp32 [2, B, Hkv, N, D]: dK, dV of the shard held, summed over the ranks it has visited
    for t in range(world):
        src = (rank - t) % world
        sends = ([kv] if t < world - 1 else []) + ([acc] if t > 0 else [])
        recv, works = group.ring_exchange(sends) if sends else ([], [])
        dq_t, term = backward_step(do, q, kv, o, lse, steps[t], src, ctx, dlse)
        dq += dq_t
        for work in works:
            work.wait()
        acc = term if t == 0 else recv[-1] + term
        if t < world - 1:
            kv = recv[0]
    if world > 1:  # shard r + 1's sum goes home; this rank's own arrives from r - 1
        recv, works = group.ring_exchange([acc])
        for work in works:
            work.wait()
        acc = recv[0]
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)

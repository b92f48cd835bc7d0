"""Every rank of a context-parallel call, run rank after rank in one process (no process group).

The per-rank pieces of a path are the functions the autograd Function runs (`ring.py`: `step_prepared`,
`forward_step`, `merge_partials`, `backward_step`; `fetch.py`: `owned_blocks`, `prefixed`, `local_prepared`,
`local_forward`, `local_backward`, `prefix_gradients`, `add_returned`). Here each rank calls them with what
the collectives would have delivered to it (another rank's shard, the blocks the others serve it, the dK/dV
they return), taken from the other ranks' results. Each piece also comes as a zero-argument callable that
reruns it alone, on the inputs a rank of a real run would hand it:

    runs = simulate(q, k, v, lists, spec, world=2, path="dense", do=do)   # one RankRun per rank
    o = unshard_runs(runs, "o")                                            # == one GPU's o (to rounding)
    for piece in runs[0].pieces: ms = bench(piece.run)                     # rank 0's kernels, one by one

`kernelgen bench --context-parallel` times the pieces on one GPU; the tests check the results against one GPU.
Transfers take no time here: their bytes are `attention.traffic`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from ..errors import KernelgenValueError
from ..spec import Spec
from .attention import _Call
from .comm import Group
from .fetch import (Fetched, add_returned, local_backward, local_forward, local_prepared, owned_blocks,
                    prefix_gradients, prefixed, requests_of, wire_rows)
from .layout import Layout
from .ring import backward_step, forward_step, merge_partials, step_prepared

__all__ = ["Piece", "RankRun", "simulate", "unshard_runs"]


@dataclass(frozen=True)
class Piece:
    """One step of a rank's work: `phase` "fwd" or "bwd", `name` what it is, `run()` reruns it alone."""

    phase: str
    name: str
    run: Callable[[], object]


@dataclass
class RankRun:
    """One rank's results (its shards, in shard order; dq, dk, dv None without `do`) and its pieces."""

    layout: Layout
    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    pieces: list[Piece] = field(default_factory=list)
    requested: int = 0   # sparse: the (batch x KV head, block) pairs this rank fetches
    served: int = 0      # sparse: the pairs it serves to the others
    width: int = 0       # sparse: prefix block slots per head


def unshard_runs(runs: list[RankRun], what: str) -> torch.Tensor:
    """The full [B, H, N, ...] tensor of every rank's `what` ("o", "lse", "dq", "dk", "dv")."""
    return runs[0].layout.assemble([getattr(run, what) for run in runs])


def _piece(runs: list[Piece], phase: str, name: str, fn, *args):
    """Append the piece fn(*args) and return its result."""
    run = partial(fn, *args)
    runs.append(Piece(phase, name, run))
    return run()


def simulate(q, k, v, lists, spec: Spec, *, world: int = 2, layout: str = "zigzag", path: str = "dense",
             do=None, scale=None) -> list[RankRun]:
    """Run `kernelgen.distributed.attention(..., path=path)` (forward, and the backward of `do` when given) of full
    q, k, v [B, H, N, D] over `world` simulated ranks in one process: one RankRun per rank. `lists`: global
    lists [B, Hkv, n_q_tiles, top_k] (given; the Q-centric schedule; a B or Hkv dimension of 1 broadcasts)."""
    if path not in ("dense", "sparse"):
        raise KernelgenValueError(f"path={path!r}; simulate runs 'dense' or 'sparse'")
    n = q.shape[2]
    lists = lists.expand(q.shape[0], k.shape[1], -1, -1)  # a B or Hkv dimension of 1 broadcasts, as on one GPU
    lays = [Layout(layout, world, r, n) for r in range(world)]
    lays[0].check(spec)
    calls = [_Call.of(spec, lay, Group(None, lay.rank, world), q.device, scale) for lay in lays]
    shards = {"q": [lay.take(q) for lay in lays], "kv": [torch.stack([lay.take(k), lay.take(v)]) for lay in lays],
              "do": [lay.take(do) for lay in lays] if do is not None else None,
              "rows": [lists[:, :, lay.global_ids(spec.q_tile, device=q.device)] for lay in lays]}
    return (_dense if path == "dense" else _sparse)(calls, shards)


def _sums(dq_terms, dkv_terms, dtype):
    """What a rank sums in the ring's backward: its dq over the steps, and each step's dK/dV onto the sum that
    arrived with the shard (fp32), then the casts."""
    dq = torch.zeros(dq_terms[0].shape, dtype=torch.float32, device=dq_terms[0].device)
    for term in dq_terms:
        dq += term
    acc = dkv_terms[0]
    for term in dkv_terms[1:]:
        acc = acc + term
    return dq.to(dtype), acc.to(dtype)


def _dense(calls: list[_Call], shards: dict) -> list[RankRun]:
    world = len(calls)
    runs, dq_terms, dkv_terms = [], [], []
    for r, call in enumerate(calls):
        q, kv, rows = shards["q"][r], shards["kv"], shards["rows"][r]
        pieces, parts, steps = [], [], []
        for t in range(world):
            src = (r - t) % world
            steps.append(step_prepared(rows, src, q.shape[2], call))
            parts.append(_piece(pieces, "fwd", f"step {t}", forward_step, q, kv[src], steps[t], src, call))
        o_part, lse_part = torch.stack([p[0] for p in parts], 3), torch.stack([p[1] for p in parts], 3)
        o, lse = _piece(pieces, "fwd", "merge", merge_partials, o_part, lse_part, q.dtype)
        run = RankRun(call.layout, o, lse, pieces=pieces)
        if shards["do"] is not None:
            terms = [_piece(pieces, "bwd", f"step {t}", backward_step, shards["do"][r], q, kv[(r - t) % world], o,
                            lse, steps[t], (r - t) % world, call) for t in range(world)]
            dq_terms.append([dq for dq, _ in terms])
            dkv_terms.append([dkv for _, dkv in terms])
        runs.append(run)
    if shards["do"] is None:
        return runs
    for s, run in enumerate(runs):
        # shard s collects the terms of ranks s, s+1, ..., s+P-1 (step t of rank s+t), in that order
        travelled = [dkv_terms[(s + t) % world][t] for t in range(world)]
        run.dq, dkv = _sums(dq_terms[s], travelled, run.o.dtype)
        run.pieces.append(Piece("bwd", "sums", partial(_sums, dq_terms[s], travelled, run.o.dtype)))
        run.dk, run.dv = dkv[0], dkv[1]
    return runs


def _from_each(parts: list[torch.Tensor], counts: list[list[int]], r: int) -> torch.Tensor:
    """Rows for rank r of an all_to_all: `parts[s]` rank s's send buffer, cut by `counts[s]`, in rank order."""
    pieces = []
    for s, x in enumerate(parts):
        start = sum(counts[s][:r])
        pieces.append(x[start:start + counts[s][r]])
    return torch.cat(pieces)


def _sparse(calls: list[_Call], shards: dict) -> list[RankRun]:
    world = len(calls)
    spec, tables = calls[0].spec, calls[0].tables
    kv_block, n_blocks = spec.kv_block, tables[0].numel()
    requests = [requests_of(shards["rows"][r], c.layout, c.tables, c.tile_chunk, spec.causal)
                for r, c in enumerate(calls)]
    asked = [r.counts for r in requests]
    incoming = [_from_each([req.ids for req in requests], asked, r) for r in range(world)]
    incoming_counts = [[asked[s][r] for s in range(world)] for r in range(world)]
    pieces = [[] for _ in calls]
    served = [_piece(pieces[r], "fwd", "gather", owned_blocks, *shards["kv"][r], incoming[r], incoming_counts[r],
                     tables, kv_block) for r in range(world)]
    runs, fetched, prepared, local_grads = [], [], [], []
    for r, call in enumerate(calls):
        q, rows = shards["q"][r], shards["rows"][r]
        received = _from_each(served, [wire_rows(row) for row in incoming_counts], r)
        k_l, v_l, width, slot = _piece(pieces[r], "fwd", "prefix", prefixed, *shards["kv"][r], requests[r], received,
                                       kv_block)
        fetched.append(Fetched(k_l, v_l, width, slot, requests[r], incoming[r], incoming_counts[r]))
        prepared.append(local_prepared(rows, fetched[r], call))
        o, lse = _piece(pieces[r], "fwd", "attention", local_forward, q, k_l, v_l, prepared[r], call)
        runs.append(RankRun(call.layout, o, lse, pieces=pieces[r], requested=len(requests[r].ids),
                            served=len(incoming[r]), width=width))
    if shards["do"] is None:
        return runs
    outs = []
    for r, (call, run) in enumerate(zip(calls, runs)):
        grads = _piece(pieces[r], "bwd", "local backward", local_backward, shards["do"][r], shards["q"][r],
                       fetched[r].k, fetched[r].v, run.o, run.lse, prepared[r], call)
        local_grads.append(grads)
        outs.append(_piece(pieces[r], "bwd", "gradients out", prefix_gradients, grads[1], grads[2], fetched[r],
                           n_blocks, kv_block))
    for r, run in enumerate(runs):
        back = _from_each(outs, [wire_rows(row) for row in asked], r)
        run.dq = local_grads[r][0]
        run.dk, run.dv = _piece(pieces[r], "bwd", "gradients in", add_returned, local_grads[r][1], local_grads[r][2],
                                back, fetched[r], tables, kv_block)
    return runs

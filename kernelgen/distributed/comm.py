"""The collectives context parallelism uses, over a torch.distributed group (NCCL on GPUs, gloo on CPUs).

Point-to-point ring steps go through `batch_isend_irecv`: on NCCL they run on the process group's own
stream, so the attention kernels queued on the current stream meanwhile overlap them, and `wait()` makes
the current stream wait for the data; on gloo they are asynchronous host operations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import KernelgenValueError

__all__ = ["Group", "group_of"]


@dataclass(frozen=True)
class Group:
    """A process group as context parallelism sees it: None (no process group: one rank) or a
    torch.distributed group, this process's rank in it and its size."""

    pg: object
    rank: int
    world: int

    def peer(self, rank: int) -> int:
        """The global rank of the group's `rank` (what point-to-point ops take)."""
        rank %= self.world
        return rank if self.pg is None else dist.get_global_rank(self.pg, rank)

    def ring_exchange(self, sends: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send each tensor to the next rank and receive same-shaped ones from the previous rank, all at
        once and asynchronously: (the receive buffers, the works to wait on)."""
        nxt, prv = self.peer(self.rank + 1), self.peer(self.rank - 1)
        recvs = [torch.empty_like(x) for x in sends]
        ops = []
        for tag, (x, y) in enumerate(zip(sends, recvs)):
            ops.append(dist.P2POp(dist.isend, x, nxt, self.pg, tag))
            ops.append(dist.P2POp(dist.irecv, y, prv, self.pg, tag))
        return recvs, dist.batch_isend_irecv(ops)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows `x[sum(send_counts[:s]):...]` go to rank s; the rows rank s sends here arrive in rank order."""
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.pg)
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on every rank), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x.contiguous(), group=self.pg)
        return out

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.pg)
        return x


def group_of(group) -> Group:
    """The Group of a call's `group=` argument: the default group when None and one is initialized; one
    rank when torch.distributed is not initialized and no group is given."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:  # a group of a destroyed (or never made) process group: its ranks are not here
            raise KernelgenValueError(f"group={group!r} was given but torch.distributed is not initialized; call "
                                      "torch.distributed.init_process_group first (or pass group=None to run "
                                      "as one rank)")
        return Group(None, 0, 1)
    pg = dist.group.WORLD if group is None else group
    rank = dist.get_rank(pg)
    if rank < 0:  # torch says -1 to a rank outside the group; the group's members never wait for it
        raise KernelgenValueError(f"this process (global rank {dist.get_rank()}) is not a member of group={group!r}: "
                                  "call with a group it belongs to (every member of one group makes the same call)")
    return Group(None if group is None else group, rank, dist.get_world_size(pg))

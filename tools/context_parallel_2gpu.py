"""Context parallelism on 2 GPUs against 1 (maintainers; needs 2 CUDA GPUs and NCCL):

    torchrun --nproc-per-node 2 tools/context_parallel_2gpu.py [--seq 262144] [--out cp-2gpu.json]

Shape and lists of `kernelgen bench --context-parallel` (B1 Hq32 Hkv8 D128 causal, 128-key blocks, top-16,
bf16, zigzag; lists `random` and `local_heavy`). Every rank builds the same full q, k, v (seed 0) and takes
its shard. For each list kind and path (dense ring, sparse fetch): the median of 20 timed calls (CUDA
events after a barrier; the slower rank's time) of the forward and of forward+backward, and the relative L2
differences of o, dq, dk, dv (unsharded) from one GPU's result on the full tensors, which rank 0 times too.
Rank 0 prints a table and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import kernelgen
import kernelgen.distributed as kd
from kernelgen.bench.context_parallel import CP_BATCH, CP_HEADS_KV, CP_SPEC, LIST_KINDS, cp_lists


def _median_ms(fn, before=None, reps: int = 20, warmup: int = 3) -> float:
    """Median ms of `fn` on this GPU (CUDA events), `before()` run ahead of each call."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _timed(fn) -> float:
    """Median ms of `fn` called by every rank together (a barrier before each call), the slowest rank's."""
    ms = torch.tensor([_median_ms(fn, before=dist.barrier)], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=262144)
    parser.add_argument("--out", default="cp-2gpu.json")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hq = CP_HEADS_KV * CP_SPEC.gqa_group
    q = torch.randn(CP_BATCH, hq, args.seq, CP_SPEC.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(CP_BATCH, CP_HEADS_KV, args.seq, CP_SPEC.head_dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    shards = [kd.shard(x, "zigzag").requires_grad_() for x in (q, k, v)]
    do_s = kd.shard(do, "zigzag")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    rows = []
    for kind, spec in LIST_KINDS.items():
        lists = cp_lists(spec, CP_BATCH, CP_HEADS_KV, args.seq, "cuda")
        one = kernelgen.get_kernel(CP_SPEC)
        for x in full:
            x.grad = None
        o1 = one(*full, block_idx=lists)
        o1.backward(do)
        ref = [o1.detach()] + [x.grad.clone() for x in full]
        one_fwd = one_bwd = None
        if rank == 0:  # one GPU alone (the other rank waits at the barrier of the next timing)
            with torch.no_grad():
                one_fwd = _median_ms(lambda: one(*full, block_idx=lists))
            one_bwd = _median_ms(lambda: one(*full, block_idx=lists).backward(do))
        dist.barrier()
        for path in ("dense", "sparse"):
            def fwd():
                with torch.no_grad():
                    kd.attention(*shards, CP_SPEC, block_idx=lists, path=path)

            def fwd_bwd():
                kd.attention(*shards, CP_SPEC, block_idx=lists, path=path).backward(do_s)

            for x in shards:
                x.grad = None
            o = kd.attention(*shards, CP_SPEC, block_idx=lists, path=path)
            o.backward(do_s)
            got = [kd.unshard(o.detach(), "zigzag")] + [kd.unshard(x.grad, "zigzag") for x in shards]
            row = {"kind": kind, "path": path, "seq": args.seq, "fwd_ms": _timed(fwd), "fwd_bwd_ms": _timed(fwd_bwd),
                   "one_gpu_fwd_ms": one_fwd, "one_gpu_fwd_bwd_ms": one_bwd}
            row.update({f"rel_diff_{name}": _rel(g, r) for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref)})
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

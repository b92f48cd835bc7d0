"""Context parallelism on 2 GPUs against 1 (maintainers; needs 2 CUDA GPUs and NCCL):

    torchrun --nproc-per-node 2 tools/context_parallel_2gpu.py --seq 262144 --out cp-2gpu.json
    torchrun --nproc-per-node 2 tools/context_parallel_2gpu.py --seq 2097152 --out cp-2gpu-2m.json

Shape and lists of `kernelgen bench --context-parallel` (B1 Hq32 Hkv8 D128 causal, 128-key blocks, top-16,
bf16, zigzag; lists `random` and `local_heavy`). q, k, v and dO are drawn chunk by chunk (one seed per chunk of
the zigzag cut), so a rank makes only its shard and the full tensors are the chunks in order. For each list
kind and path (dense ring, sparse fetch): the median of `--reps` timed calls (CUDA events after a barrier; the
slower rank's time) of the forward and of forward+backward, and each rank's peak memory
(`torch.cuda.max_memory_allocated`) over one forward and over one forward+backward. With the one-GPU reference
(`--one-gpu`, by default up to N = 256k; above it the full problem's tensors are left out for memory), rank 0
also times one GPU alone, and o, dq, dk, dv (unsharded) are compared with one GPU's: relative L2 difference,
`check_ok` when every one is below 1e-2. Rank 0 prints each row and writes them as JSON.

`--smoke` runs the same steps on the CPU over gloo at the bench's smoke size, in fp32 through the Triton
interpreter (timed with the host clock, no memory figures): it checks the script, not the speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import kernelgen
import kernelgen.distributed as kd
from kernelgen.bench.context_parallel import CP_BATCH, CP_HEADS_KV, CP_SEQ, CP_SPEC, SMOKE, cp_lists, list_kinds

CHECK_TOL = 1e-2  # rel. L2 difference from one GPU, bf16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=CP_SEQ, help="tokens N (a multiple of 4 x 128)")
    parser.add_argument("--out", default="cp-2gpu.json", help="JSON rows (rank 0 writes them)")
    parser.add_argument("--one-gpu", choices=("auto", "on", "off"), default="auto",
                        help=f"the one-GPU reference (timing and check); auto: on up to N={CP_SEQ}")
    parser.add_argument("--kinds", default="random,local_heavy", help="list kinds, comma-separated")
    parser.add_argument("--paths", default="dense,sparse", help="paths, comma-separated")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per figure (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the CPU over gloo at the smoke size (fp32)")
    args = parser.parse_args(argv)
    args.kinds, args.paths = args.kinds.split(","), args.paths.split(",")
    known = list_kinds(CP_SPEC)
    for name, values, allowed in (("--kinds", args.kinds, known), ("--paths", args.paths, ("dense", "sparse"))):
        if not values or any(x not in allowed for x in values):
            parser.error(f"{name} {','.join(values)}: expected names among {', '.join(allowed)}")
    if args.smoke:
        args.seq = SMOKE["seq"]
    args.reference = args.one_gpu == "on" or (args.one_gpu == "auto" and args.seq <= CP_SEQ)
    return args


def _median_ms(fn, cuda: bool, reps: int, warmup: int, before=None) -> float:
    """Median ms of `fn` on this rank (CUDA events on a GPU, the host clock otherwise), `before()` ahead of
    each call."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def _peak_bytes(fn) -> int:
    """This GPU's peak allocated bytes over one call of `fn` (everything resident included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _chunked(shape, n: int, chunks, n_chunks: int, seed: int, device, dtype) -> torch.Tensor:
    """[B, H, len(chunks) * n / n_chunks, D]: the chunks `chunks` of a tensor whose chunk c is drawn with seed
    (seed, c); all chunks in order are the full tensor."""
    size = n // n_chunks
    parts = []
    for c in chunks:
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + c)
        parts.append(torch.randn(*shape[:2], size, shape[-1], device=device, generator=gen, dtype=dtype))
    return torch.cat(parts, 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cuda = not args.smoke
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit(f"context_parallel_2gpu.py needs 2 CUDA GPUs and NCCL ({torch.cuda.device_count()} "
                         "visible here); --smoke runs it on the CPU over gloo")
    if "RANK" not in os.environ:
        raise SystemExit("context_parallel_2gpu.py runs one process per rank: start it with torchrun "
                         "--nproc-per-node 2 tools/context_parallel_2gpu.py ...")
    spec = CP_SPEC if cuda else SMOKE["spec"]
    heads_kv = CP_HEADS_KV if cuda else SMOKE["heads_kv"]
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    lay = kd.Layout("zigzag", world, rank, args.seq)
    lay.check(spec)
    shape_q = (CP_BATCH, heads_kv * spec.gqa_group, args.seq, spec.head_dim)
    shape_kv = (CP_BATCH, heads_kv, args.seq, spec.head_dim)
    shapes = {"q": shape_q, "k": shape_kv, "v": shape_kv, "do": shape_q}

    def draw(chunks):
        return {name: _chunked(shape, args.seq, chunks, lay.n_chunks, seed, device, dtype)
                for seed, (name, shape) in enumerate(shapes.items())}

    mine = draw(lay.chunks())
    shards = [mine[x].requires_grad_() for x in ("q", "k", "v")]
    do_s = mine["do"]
    full = draw(range(lay.n_chunks)) if args.reference else None

    def timed(fn) -> float:  # every rank together (a barrier before each call), the slowest rank's time
        ms = torch.tensor([_median_ms(fn, cuda, args.reps, args.warmup, before=dist.barrier)], device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return ms.item()

    def everyone(value: int) -> list[int]:  # every rank's value, in rank order
        out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.int64, device=device))
        return [int(x) for x in out]

    rows = []
    for kind in args.kinds:
        lists = cp_lists(list_kinds(spec)[kind], CP_BATCH, heads_kv, args.seq, device)
        one = kernelgen.get_kernel(spec)
        ref = None
        row_one = {"one_gpu_fwd_ms": None, "one_gpu_fwd_bwd_ms": None}
        if full is not None:
            leaves = [full[x].clone().requires_grad_() for x in ("q", "k", "v")]
            o1 = one(*leaves, block_idx=lists)
            o1.backward(full["do"])
            ref = [o1.detach()] + [x.grad.clone() for x in leaves]  # the timing below adds to .grad
            if rank == 0:  # one GPU alone (the other ranks wait at the next barrier)
                with torch.no_grad():
                    row_one["one_gpu_fwd_ms"] = _median_ms(lambda: one(*leaves, block_idx=lists), cuda, args.reps,
                                                           args.warmup)
                row_one["one_gpu_fwd_bwd_ms"] = _median_ms(
                    lambda: one(*leaves, block_idx=lists).backward(full["do"]), cuda, args.reps, args.warmup)
            del leaves, o1
        dist.barrier()
        for path in args.paths:
            def fwd():
                with torch.no_grad():
                    kd.attention(*shards, spec, block_idx=lists, path=path)

            def fwd_bwd():
                kd.attention(*shards, spec, block_idx=lists, path=path).backward(do_s)

            for x in shards:
                x.grad = None
            o = kd.attention(*shards, spec, block_idx=lists, path=path)
            o.backward(do_s)
            row = {"kind": kind, "path": path, "seq": args.seq, "world": world, **row_one}
            if ref is not None:
                got = [kd.unshard(o.detach(), "zigzag")] + [kd.unshard(x.grad, "zigzag") for x in shards]
                row.update({f"rel_diff_{name}": _rel(g, r) for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref)})
                row["check_ok"] = all(row[f"rel_diff_{name}"] < CHECK_TOL for name in ("o", "dq", "dk", "dv"))
                del got
            del o
            row["fwd_ms"], row["fwd_bwd_ms"] = timed(fwd), timed(fwd_bwd)
            if cuda:
                for x in shards:
                    x.grad = None
                row["peak_bytes_fwd_per_rank"] = everyone(_peak_bytes(fwd))
                row["peak_bytes_fwd_bwd_per_rank"] = everyone(_peak_bytes(fwd_bwd))
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()

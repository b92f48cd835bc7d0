"""`kernelgen bench --context-parallel`: what a 2-rank context-parallel run costs, measured on one GPU.

Shape: B1 Hq32 Hkv8 D128, causal, 128-key blocks and 128-query tiles, top-16, N = 256k (bf16), zigzag layout
over P = 2 ranks. Two kinds of lists (global block ids, as one GPU's):
  random        the diagonal block and 15 blocks drawn uniformly among the visible ones
  local_heavy   sink=1, local=8 (the 8 blocks ending at the diagonal) and 7 random visible blocks

Both ranks run in one process (`kernelgen.distributed.simulate`: the functions the autograd Function runs, fed
what the collectives would deliver), and each rank's pieces are timed alone (`do_bench` median, ms):
  dense   forward: each ring step's attention over the rank's sub-lists of that shard, the lse merge;
          backward: each step's backward kernels driven by the merged o and lse, the fp32 sums (dq over the
          steps, each step's dK/dV onto the sum travelling with the shard)
  sparse  forward: serving the blocks the other rank asks for (gather), laying the received ones out as the
          prefix, the one local attention over [prefix | own shard];
          backward: the local backward, the prefix's dK/dV gathered for their owners, the owner's fp32 adds
and one GPU runs the whole problem: the forward, and the backward kernels (`_gradients`, as the ranks run
them). List preparation (prepare, reverse index) is left out on both sides: lists are reused by every layer.
The bytes each path sends per rank, forward and backward, are counted (`kernelgen.distributed.traffic`: the
largest over the ranks), and the 2-GPU time is projected at an assumed NVLink rate of 450 GB/s per direction
(both directions at once, no other contention):
  dense   fwd: max(step 0, one K/V shard) + step 1 + merge   (the transfer overlaps step 0)
          bwd: max(step 0, one K/V shard) + max(step 1, dK/dV sum) + sums + dK/dV sum home
  sparse  fwd: gather + the requested blocks + prefix + attention   (the fetch precedes the attention)
          bwd: local backward + gradients out + their transfer + gradients in
Each row holds, per path, the slower rank's kernels over one GPU's (forward, forward+backward), the sparse/dense
byte ratios, the projections, and the relative L2 differences of o, dq, dk, dv from one GPU's. A short table is
printed; rows go to context_parallel.json.

    kernelgen bench --context-parallel [--out DIR]
A real 2-GPU run (NCCL, both paths, forward and forward+backward, checked against one GPU):
    torchrun --nproc-per-node 2 tools/context_parallel_2gpu.py
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..distributed.attention import traffic
from ..distributed.simulate import simulate, unshard_runs
from ..reference import tile_eligibility
from ..spec import Spec
from .measure import _bench, _dump_rows, _rel_diff

__all__ = ["run_context_parallel", "cp_lists", "list_kinds", "CP_SPEC", "CP_SEQ", "NVLINK_BYTES_PER_S", "LIST_KINDS",
           "SMOKE"]

CP_SPEC = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given")
CP_SEQ, CP_BATCH, CP_HEADS_KV, CP_WORLD = 262144, 1, 8, 2
NVLINK_BYTES_PER_S = 450e9  # assumed: H100/H200 NVLink, one direction
PATHS = ("dense", "sparse")
# the interpreter's smoke run (the CPU): the same lists kinds on a small problem
SMOKE = {"spec": Spec(head_dim=64, kv_block=16, q_tile=16, top_k=12, causal=True, gqa_group=1, selector="given"),
         "seq": 256, "heads_kv": 1}


def list_kinds(spec: Spec) -> dict[str, Spec]:
    """The kinds of lists, as specs whose forced blocks `cp_lists` keeps."""
    return {"random": spec, "local_heavy": spec.replace(sink=1, local=8)}


LIST_KINDS = list_kinds(CP_SPEC)


def cp_lists(spec: Spec, batch: int, heads_kv: int, n: int, device, seed: int = 0) -> torch.Tensor:
    """Global lists int32 [B, Hkv, n_q_tiles, top_k]: every forced block of `spec` (sink, local, the diagonal),
    the rest of the budget drawn uniformly among the visible blocks."""
    eligible, forced = tile_eligibility(spec, n, n, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(batch, heads_kv, *eligible.shape, device=device, generator=gen)
    scores = torch.where(forced, 2.0, scores).masked_fill(~eligible, -1.0)
    picked_scores, picked = scores.topk(spec.top_k, dim=-1)
    return torch.where(picked_scores >= 0, picked, -1).sort(-1).values.to(torch.int32)


def _one_gpu(spec: Spec, lists, q, k, v, do) -> tuple[dict, list[torch.Tensor]]:
    """One GPU's forward and backward kernels over the whole problem: (times, [o, dq, dk, dv])."""
    one = get_kernel(spec.replace(sink=0, local=0))
    prepared = one.prepare(lists, q.shape[2], k.shape[2])
    reverse = prepared.reverse_index()
    o, lse = one(q, k, v, block_idx=prepared, return_lse=True)
    fwd = _bench(lambda: one(q, k, v, block_idx=prepared, return_lse=True))
    bwd = _bench(lambda: one._gradients(do, q, k, v, o, lse, prepared.block_idx, None, reverse))
    return {"one_gpu_fwd_ms": fwd, "one_gpu_bwd_ms": bwd, "one_gpu_fwd_bwd_ms": fwd + bwd}, \
        [o, *one._gradients(do, q, k, v, o, lse, prepared.block_idx, None, reverse)]


def _rank_times(path: str, runs, log, kind: str) -> list[dict]:
    """Every piece of every rank timed alone: {"rank", "<phase> <piece>" ms..., "fwd_ms", "bwd_ms"} per rank."""
    ranks = []
    for r, run in enumerate(runs):
        times = {f"{p.phase} {p.name}": _bench(p.run) for p in run.pieces}
        row = {"rank": r, **times, "fwd_ms": sum(ms for key, ms in times.items() if key.startswith("fwd")),
               "bwd_ms": sum(ms for key, ms in times.items() if key.startswith("bwd"))}
        if path == "sparse":
            row.update(requested_blocks=run.requested, served_blocks=run.served, prefix_width=run.width)
        ranks.append(row)
        log(f"  {kind} {path} rank {r}: " + ", ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                                                      for key, val in row.items() if key != "rank"))
    return ranks


def _project(path: str, ranks: list[dict], moved, world: int) -> tuple[float, float]:
    """(forward, forward+backward) ms of the slower rank on 2 GPUs (see the module)."""
    def ms(n_bytes):
        return n_bytes / NVLINK_BYTES_PER_S * 1e3

    fwd, fwd_bwd = [], []
    for r in ranks:
        if path == "dense":
            shard, sums = moved.dense / (world - 1), (moved.dense_backward - moved.dense) / world
            f = sum(max(r[f"fwd step {t}"], ms(shard) if t < world - 1 else 0.0) for t in range(world)) + r["fwd merge"]
            b = sum(max(r[f"bwd step {t}"], ms((shard if t < world - 1 else 0) + (sums if t else 0)))
                    for t in range(world)) + r["bwd sums"] + ms(sums)
        else:
            f = r["fwd gather"] + ms(moved.sparse) + r["fwd prefix"] + r["fwd attention"]
            b = r["bwd local backward"] + r["bwd gradients out"] + ms(moved.sparse_backward) + r["bwd gradients in"]
        fwd.append(f)
        fwd_bwd.append(f + b)
    return max(fwd), max(fwd_bwd)


def _table(rows: list[dict], log) -> None:
    log(f"{'lists':<12} {'path':<7} {'fwd/1GPU':>9} {'f+b/1GPU':>9} {'MB fwd':>9} {'MB f+b':>9} "
        f"{'2GPU fwd ms':>12} {'2GPU f+b ms':>12}")
    for row in rows:
        for path in PATHS:
            log(f"{row['kind']:<12} {path:<7} {row[f'{path}_fwd_ratio']:>9.3f} {row[f'{path}_fwd_bwd_ratio']:>9.3f} "
                f"{row[f'{path}_bytes_fwd'] / 1e6:>9.1f} {row[f'{path}_bytes_fwd_bwd'] / 1e6:>9.1f} "
                f"{row[f'projected_2gpu_{path}_fwd_ms']:>12.3f} {row[f'projected_2gpu_{path}_fwd_bwd_ms']:>12.3f}")
        log(f"{row['kind']:<12} sparse/dense bytes: fwd {row['sparse_dense_bytes_ratio_fwd']:.3f}, "
            f"fwd+bwd {row['sparse_dense_bytes_ratio_fwd_bwd']:.3f}; auto picks {row['auto_path']}")


def run_context_parallel(names=None, out_dir=None, log=print, device="cuda", seq: int = CP_SEQ,
                         heads_kv: int = CP_HEADS_KV, spec: Spec = CP_SPEC) -> list[dict]:
    """Time every rank's kernels for each list kind, forward and backward, count the bytes, project 2 GPUs (rows;
    see the module). `names`: unused (the bench has one shape). bf16 on a GPU; fp32 elsewhere (the
    interpreter's smoke run, at `SMOKE`'s size)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q = (CP_BATCH, heads_kv * spec.gqa_group, seq, spec.head_dim)
    shape_kv = (CP_BATCH, heads_kv, seq, spec.head_dim)
    q, k, v, do = (torch.randn(s, device=device, generator=gen, dtype=dtype)
                   for s in (shape_q, shape_kv, shape_kv, shape_q))
    rows = []
    for kind, kind_spec in list_kinds(spec).items():
        lists = cp_lists(kind_spec, CP_BATCH, heads_kv, seq, device)
        row, want = _one_gpu(kind_spec, lists, q, k, v, do)
        row = {"kind": kind, "seq": seq, "world": CP_WORLD, **row}
        ranks, most = {}, 0
        for path in PATHS:
            runs = simulate(q, k, v, lists, kind_spec, world=CP_WORLD, path=path, do=do)
            for name, ref in zip(("o", "dq", "dk", "dv"), want):
                row[f"rel_diff_{path}_{name}"] = _rel_diff(unshard_runs(runs, name), ref)
            ranks[path] = _rank_times(path, runs, log, kind)
            most = max([most] + [max(run.requested, run.served) for run in runs])
            del runs
        moved = traffic((CP_BATCH, heads_kv, seq // CP_WORLD, spec.head_dim), q.element_size(), CP_WORLD,
                        spec.kv_block, most)
        for path in PATHS:
            fwd = max(r["fwd_ms"] for r in ranks[path])
            fwd_bwd = max(r["fwd_ms"] + r["bwd_ms"] for r in ranks[path])
            row.update({f"{path}_rank_fwd_ms": fwd, f"{path}_rank_fwd_bwd_ms": fwd_bwd,
                        f"{path}_fwd_ratio": fwd / row["one_gpu_fwd_ms"],
                        f"{path}_fwd_bwd_ratio": fwd_bwd / row["one_gpu_fwd_bwd_ms"]})
            row[f"{path}_bytes_fwd"] = getattr(moved, path)
            row[f"{path}_bytes_fwd_bwd"] = getattr(moved, path) + getattr(moved, f"{path}_backward")
            row[f"projected_2gpu_{path}_fwd_ms"], row[f"projected_2gpu_{path}_fwd_bwd_ms"] = \
                _project(path, ranks[path], moved, CP_WORLD)
        row["sparse_dense_bytes_ratio_fwd"] = moved.sparse / moved.dense
        row["sparse_dense_bytes_ratio_fwd_bwd"] = row["sparse_bytes_fwd_bwd"] / row["dense_bytes_fwd_bwd"]
        row.update(auto_path=moved.path(), auto_path_training=moved.path(backward=True), nvlink_bytes_per_s_assumed=NVLINK_BYTES_PER_S, ranks=ranks)
        rows.append(row)
        _dump_rows(rows, out_dir, "context_parallel.json")
    _table(rows, log)
    return rows

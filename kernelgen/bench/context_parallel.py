"""`kernelgen bench --context-parallel`: what a 2-rank context-parallel run costs, measured on one GPU.

Shape: B1 Hq32 Hkv8 D128, causal, 128-key blocks and 128-query tiles, top-16, N = 256k (bf16), zigzag layout
over P = 2 ranks. Two kinds of lists (global block ids, as one GPU's):
  random        the diagonal block and 15 blocks drawn uniformly among the visible ones
  local_heavy   sink=1, local=8 (the 8 blocks ending at the diagonal) and 7 random visible blocks

For each kind and each rank, on one GPU, the rank's kernels are timed (`do_bench` median, ms):
  dense   each ring step's attention over the rank's sub-lists of that shard, and the lse merge
  sparse  serving the requested blocks (gather), laying the received ones out as the prefix, and the one
          local attention over [prefix | own shard]
and the bytes each path sends per rank are counted (`kernelgen.distributed.traffic`: the largest over the ranks).
The 2-GPU forward is then projected at an assumed NVLink rate of 450 GB/s per direction (unidirectional,
both directions at once), no other contention:
  dense   max(step 0, transfer of one shard) + step 1 + merge   (the transfer overlaps step 0)
  sparse  gather + transfer of the requested blocks + prefix + attention   (the fetch precedes the attention)
next to one GPU running the whole problem. Rows go to context_parallel.json.

    kernelgen bench --context-parallel [--out DIR]
A real 2-GPU run (NCCL, both paths, forward and forward+backward, checked against one GPU):
    torchrun --nproc-per-node 2 tools/context_parallel_2gpu.py
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..distributed.fetch import Fetched, local_lists, owned_blocks, prefixed, requests_of
from ..distributed.layout import Layout
from ..distributed.attention import traffic
from ..distributed.ring import merge_partials, step_lists
from ..reference import tile_eligibility
from ..spec import Spec
from .measure import _bench, _dump_rows

__all__ = ["run_context_parallel", "cp_lists", "CP_SPEC", "CP_SEQ", "NVLINK_BYTES_PER_S", "LIST_KINDS"]

CP_SPEC = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given")
CP_SEQ, CP_BATCH, CP_HEADS_KV, CP_WORLD = 262144, 1, 8, 2
NVLINK_BYTES_PER_S = 450e9  # assumed: H100/H200 NVLink, one direction
LIST_KINDS = {"random": CP_SPEC, "local_heavy": CP_SPEC.replace(sink=1, local=8)}


def cp_lists(spec: Spec, batch: int, heads_kv: int, n: int, device, seed: int = 0) -> torch.Tensor:
    """Global lists int32 [B, Hkv, n_q_tiles, top_k]: every forced block of `spec` (sink, local, the diagonal),
    the rest of the budget drawn uniformly among the visible blocks."""
    eligible, forced = tile_eligibility(spec, n, n, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(batch, heads_kv, *eligible.shape, device=device, generator=gen)
    scores = torch.where(forced, 2.0, scores).masked_fill(~eligible, -1.0)
    picked_scores, picked = scores.topk(spec.top_k, dim=-1)
    return torch.where(picked_scores >= 0, picked, -1).sort(-1).values.to(torch.int32)


def _rank_rows(kind: str, lists, tensors, rank: int, device, log) -> dict:
    spec = LIST_KINDS[kind]
    q, k, v = tensors
    layout = Layout("zigzag", CP_WORLD, rank, CP_SEQ)
    tables, tile_chunk = layout.block_tables(spec.kv_block, device), layout.tile_chunks(spec.q_tile, device)
    rows = lists[:, :, layout.global_ids(spec.q_tile, device=device)]
    shards = {s: (Layout("zigzag", CP_WORLD, s, CP_SEQ).take(k), Layout("zigzag", CP_WORLD, s, CP_SEQ).take(v))
              for s in range(CP_WORLD)}
    q_r = layout.take(q)
    given = CP_SPEC.replace(sink=0, local=0)
    out = {"kind": kind, "rank": rank}
    parts = []
    for t in range(CP_WORLD):  # the dense ring's steps
        src = (rank - t) % CP_WORLD
        attn = get_kernel(given if src == rank else given.replace(causal=False))
        prepared = attn.prepare(step_lists(rows, src, tables, tile_chunk, True), q_r.shape[2], q_r.shape[2])
        k_s, v_s = shards[src]
        out[f"dense_step{t}_ms"] = _bench(lambda: attn(q_r, k_s, v_s, block_idx=prepared, return_lse=True))
        parts.append(attn(q_r, k_s, v_s, block_idx=prepared, return_lse=True))
    o_part, lse_part = torch.stack([p[0] for p in parts], 3), torch.stack([p[1] for p in parts], 3)
    out["dense_merge_ms"] = _bench(lambda: merge_partials(o_part, lse_part, q.dtype))
    requests = requests_of(rows, layout, tables, tile_chunk, True)  # the sparse path
    incoming = [requests.ids[sum(requests.counts[:s]):sum(requests.counts[:s + 1])] for s in range(CP_WORLD)]
    served = [owned_blocks(*shards[s], ids, tables, spec.kv_block) for s, ids in enumerate(incoming)]
    out["sparse_gather_ms"] = sum(_bench(lambda s=s, ids=ids: owned_blocks(*shards[s], ids, tables, spec.kv_block))
                                  for s, ids in enumerate(incoming) if s != rank)
    received = torch.cat(served)
    n_blocks = tables[0].numel()
    out["sparse_prefix_ms"] = _bench(lambda: prefixed(*shards[rank], requests, received, n_blocks, spec.kv_block))
    k_l, v_l, width, slot = prefixed(*shards[rank], requests, received, n_blocks, spec.kv_block)
    fetched = Fetched(k_l, v_l, width, slot, requests, None, None)
    attn = get_kernel(given)
    prepared = attn.prepare(local_lists(rows, fetched, layout, tables, tile_chunk, spec.kv_block, True),
                            q_r.shape[2], k_l.shape[2])
    out["sparse_attn_ms"] = _bench(lambda: attn(q_r, k_l, v_l, block_idx=prepared, return_lse=True))
    out["requested_blocks"] = len(requests.ids)
    out["prefix_width"] = width
    log(f"  {kind} rank {rank}: " + ", ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                                              for key, val in out.items() if key not in ("kind", "rank")))
    return out


def run_context_parallel(names=None, out_dir=None, log=print, device="cuda") -> list[dict]:
    """Time every rank's kernels for each list kind, count the bytes, project 2 GPUs (rows; see the module).
    `names`: unused (the bench has one shape). bf16 on a GPU; fp32 elsewhere (the interpreter's smoke run)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q = (CP_BATCH, CP_HEADS_KV * CP_SPEC.gqa_group, CP_SEQ, CP_SPEC.head_dim)
    shape_kv = (CP_BATCH, CP_HEADS_KV, CP_SEQ, CP_SPEC.head_dim)
    q, k, v = (torch.randn(s, device=device, generator=gen, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    rows = []
    for kind, spec in LIST_KINDS.items():
        lists = cp_lists(spec, CP_BATCH, CP_HEADS_KV, CP_SEQ, device)
        one = get_kernel(CP_SPEC.replace(sink=0, local=0))
        prepared = one.prepare(lists, CP_SEQ, CP_SEQ)
        one_gpu_ms = _bench(lambda: one(q, k, v, block_idx=prepared, return_lse=True))
        ranks = [_rank_rows(kind, lists, (q, k, v), r, device, log) for r in range(CP_WORLD)]
        shard_shape = (CP_BATCH, CP_HEADS_KV, CP_SEQ // CP_WORLD, CP_SPEC.head_dim)
        moved = traffic(shard_shape, q.element_size(), CP_WORLD, CP_SPEC.kv_block, max(r["requested_blocks"] for r in ranks))
        shard_s = moved.dense / NVLINK_BYTES_PER_S * 1e3
        blocks_s = moved.sparse / NVLINK_BYTES_PER_S * 1e3
        dense = max(max(r["dense_step0_ms"], shard_s) + r["dense_step1_ms"] + r["dense_merge_ms"] for r in ranks)
        sparse = max(r["sparse_gather_ms"] + blocks_s + r["sparse_prefix_ms"] + r["sparse_attn_ms"] for r in ranks)
        row = {"kind": kind, "one_gpu_ms": one_gpu_ms, "dense_bytes_per_rank": moved.dense,
               "sparse_bytes_per_rank": moved.sparse, "dense_transfer_ms": shard_s, "sparse_transfer_ms": blocks_s,
               "projected_2gpu_dense_ms": dense, "projected_2gpu_sparse_ms": sparse, "auto_path": moved.path,
               "nvlink_bytes_per_s_assumed": NVLINK_BYTES_PER_S, "ranks": ranks}
        log(f"{kind}: one GPU {one_gpu_ms:.3f} ms; 2 GPUs projected: dense {dense:.3f} ms "
            f"({moved.dense / 1e6:.1f} MB/rank), sparse {sparse:.3f} ms ({moved.sparse / 1e6:.1f} MB/rank); "
            f"auto picks {moved.path}")
        rows.append(row)
        _dump_rows(rows, out_dir, "context_parallel.json")
    return rows

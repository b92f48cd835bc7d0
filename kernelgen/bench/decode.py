"""`kernelgen bench --decode`: a few queries against a long KV cache, kernelgen against the kernels that serve it.

For each shape of `kernelgen.workloads.DECODE_SHAPES`, in one process on one GPU (bf16):

- kernelgen's `decode` role over lists prepared once, as served (`backend="auto"`), and pinned at each
  split count of its space (the served config's warps and stages);
- the `mean` selector's whole pipeline (selection and decode), and its selection alone; the same with the
  keys' representatives kept (`attn.key_reps`, as a cache keeps them), and their extension by one key;
- a whole decode step over a cache of per-row lengths (`cache_seqlens`, every row one key short of the
  capacity): the kept reps grown in place to the lengths, then the call with them, one CUDA graph for both;
  the same step writing its token's K and V into the cache first (`k_new=`, `v_new=`); and the same step with
  the reps made afresh over every row's keys (a caller that keeps none);
- the decode over a cache of per-row lengths (`cache_seqlens`, every row full) in bf16 and as a float8_e4m3fn cache
  (a scale per batch row and KV head: half the bytes), at each split count too, and the kept-reps step over the
  fp8 cache;
- the same decode, and the same step, over a paged cache (`block_table=`): the cache's pages shuffled over a pool,
  at PAGE_BLOCKS blocks a page, and at SMALL_PAGE keys a page (vLLM's: a block over several pages, each key read
  from its page); their outputs must equal the contiguous cache's bit for bit;
- the index selector's decode step over the same cache of per-row lengths, under each schedule (index vectors of
  the shape it is tuned on, `roles.INDEX_HEADS` heads of `roles.INDEX_DIM` per KV head): its selection reads every
  key's index vector, DSA's decode step; the same step writing its token first (`k_new=`, `v_new=`,
  `k_idx_new=`); and the same step over a paged cache (k_idx paged through the same table, as an indexer's key
  cache is kept);
- FlexAttention (torch.compile'd) over a BlockMask holding exactly the same lists;
- dense SDPA (flash, efficient, cuDNN; the KV heads as they are, `enable_gqa`) over the whole cache: every
  query sees every key, the work of a decode step without sparsity;
- a device-to-device copy of 1 GiB: the HBM bandwidth a memory-bound kernel can reach on this GPU.

Decode moves bytes, it hardly computes: each row reports `kv_MB`, the K and V bytes of the keys it must
read (the listed blocks', or the whole cache's), and `GBps` = kv_MB over its replayed time, next to the
copy's. Times are `do_bench` medians (`ms`, L2 cleared, the host's launch cost included where the host is
the slower), CUDA-graph replays (`graph_ms`, the serving figure where decoders replay graphs), and `host_ms`,
the host's time to enqueue one call on an idle GPU (what an eager decode step, as transformers runs it,
waits for where it exceeds the replay). The selected blocks of one step fit in the L2 cache, so the replay
walks ROTATIONS list sets in turn (the `mean` selector's, then random ones; FlexAttention gets the same
BlockMasks) and reports the time per call: no call finds its blocks in L2 from the call before. Outputs are
compared with kernelgen's (relative L2).

    kernelgen bench --decode [--shapes dec_c32k] [--out DIR]
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from .. import backends
from ..backends.triton import DECODE_SPLITS
from ..device import device_arch
from ..dispatch import get_kernel
from ..errors import KernelgenRuntimeError
from ..reference import scatter_pages
from ..roles import WorkloadShape, forward_roles, index_inputs
from ..workloads import DECODE_SHAPES, random_query_lists, visible_pairs
from .anchors import flex_block_mask, flex_call
from .measure import _bench, _bench_graph, _config_json, _dump_rows, _rel_diff, host_ms, row_attempts

__all__ = ["run_decode", "ROTATIONS", "PAGE_BLOCKS", "SMALL_PAGE", "listed_kv_bytes", "copy_bandwidth"]

ROTATIONS = 8  # list sets a replay walks in turn: 8 steps' blocks are several times H200's 50 MB L2
PAGE_BLOCKS = (1, 4)  # KV blocks a page of the paged rows (a page holds whole blocks)
SMALL_PAGE = 16  # keys a page of the paged rows whose blocks span pages (vLLM's default block_size)


def listed_kv_bytes(block_idx: torch.Tensor, spec, n_k: int, elem_bytes: int) -> int:
    """K and V bytes a decode step reads over Q-centric lists of one Q tile (`[B, Hkv, 1, top_k]`): the keys of
    the distinct valid listed blocks (a partial last block counts its keys), times D, times 2 (K and V)."""
    keys = visible_pairs(block_idx, spec.replace(causal=False), 1, n_k).sum().item()
    return int(keys) * spec.head_dim * 2 * elem_bytes


def copy_bandwidth(n_bytes: int = 2**30) -> float:
    """GB/s of a device-to-device copy of `n_bytes` (bytes read plus bytes written over the do_bench median)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * n_bytes / ms / 1e6


def _rotating_lists(shape, given, first: torch.Tensor, device) -> list[torch.Tensor]:
    """ROTATIONS list sets `[B, Hkv, 1, top_k]`: `first` (the selector's), then random ones of the last query
    (`random_query_lists`, seeds 1, 2, ...: the newest block always held, as a causal selector forces)."""
    return [first] + [random_query_lists(given, shape.batch, shape.heads_kv, 1, shape.n_k, device, seed)
                      for seed in range(1, ROTATIONS)]


def _graph_per_call(calls, log) -> float | None:
    """Median ms per call of `calls` (no-argument callables) replayed from one CUDA graph in turn."""
    def walk():
        for call in calls:
            call()

    total = _bench_graph(walk, log=log)
    return None if total is None else total / len(calls)


def run_decode(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, ms, graph_ms, host_ms, kv_MB, GBps (and config, rel_diff_vs_kernelgen where they
    apply); the copy's GB/s as its own row; with `out_dir`, also decode.json there."""
    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("bench --decode needs a CUDA GPU: it times kernels")
    names = list(shape_names or DECODE_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows: list[dict] = []

    def record(name, impl, call, graph_ms, kv_bytes, **extra):
        """A row of `call` (no arguments): its do_bench and host times, and `graph_ms` measured apart."""
        ms = _bench(call)
        per_s = graph_ms or ms
        row = dict(shape=name, impl=impl, ms=ms, graph_ms=graph_ms, host_ms=host_ms(call),
                   kv_MB=round(kv_bytes / 1e6, 2), GBps=round(kv_bytes / per_s / 1e6, 1) if kv_bytes else None, **extra)
        rows.append(row)
        graph = f" (graph {graph_ms:.4f} ms, host {row['host_ms']:.4f} ms)" if graph_ms else ""
        rate = f" {row['GBps']:7.1f} GB/s" if kv_bytes else ""
        log(f"{name:10s} {impl:34s} {ms:8.4f} ms{graph}{rate} " + " ".join(f"{k}={v}" for k, v in extra.items()))
        _dump_rows(rows, out_dir, "decode.json")

    attempt = row_attempts(log)

    bandwidth = copy_bandwidth()
    rows.append(dict(shape="-", impl="device copy (1 GiB)", GBps=round(bandwidth, 1)))
    log(f"device-to-device copy: {bandwidth:.0f} GB/s (read + write)")
    _dump_rows(rows, out_dir, "decode.json")
    for name in names:
        shape = DECODE_SHAPES[name]
        q, k, v = shape.inputs(device, dtype)
        _shape_rows(name, shape, q, k, v, record, attempt, log)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _shape_rows(name, shape, q, k, v, record, attempt, log) -> None:
    spec, given = shape.spec("mean"), shape.spec("given").replace(backend=backends.AUTO)
    elem = q.element_size()
    selecting = get_kernel(spec.replace(backend=backends.AUTO))
    lists = _rotating_lists(shape, given, selecting.select(q, k), q.device)
    kv_bytes = sum(listed_kv_bytes(idx, given, shape.n_k, elem) for idx in lists) // len(lists)
    attn = get_kernel(given)
    served = attn.served("decode", shape.n_k, q.dtype, q.device)
    prepared = [attn.prepare(idx, shape.n_q, shape.n_k) for idx in lists]
    with torch.no_grad():
        ours = attn(q, k, v, block_idx=prepared[0])

        def lists_row(impl, kernel, **extra):
            graph_ms = _graph_per_call([lambda p=p: kernel(q, k, v, block_idx=p) for p in prepared], log)
            record(name, impl, lambda: kernel(q, k, v, block_idx=prepared[0]), graph_ms, kv_bytes, **extra)

        lists_row("kernelgen decode prepared", attn, backend=served.backend.name, config=_config_json(served.config),
                  config_source=served.source)
        if hasattr(served.config, "splits"):  # the split count: the one tunable a cache's length moves
            for splits in DECODE_SPLITS:
                cfg = dataclasses.replace(served.config, splits=splits)
                if cfg == served.config or served.backend.infeasible(served.spec, "decode", cfg, device_arch(q.device)):
                    continue
                pinned = get_kernel(given.replace(backend=served.backend.name), configs={"decode": cfg})
                attempt(name, f"decode splits={splits}", lambda pinned=pinned, splits=splits: lists_row(
                    f"kernelgen decode splits={splits}", pinned, config=_config_json(cfg)))

        def pipeline():
            record(name, "kernelgen mean select only", lambda: selecting.select(q, k),
                   _bench_graph(lambda: selecting.select(q, k), log=log), 0)
            record(name, "kernelgen mean (select+decode)", lambda: selecting(q, k, v),
                   _bench_graph(lambda: selecting(q, k, v), log=log), kv_bytes + k.numel() * elem,
                   note="kv_MB: the listed blocks' K and V plus the whole K that selection pools")

        def kept():
            reps = selecting.key_reps(k)
            assert torch.equal(selecting.select(q, k, key_reps=reps), lists[0])
            reps_bytes = reps.reps.numel() * reps.reps.element_size()
            chooser = selecting.served("decode_select", shape.n_k, q.dtype, q.device)
            record(name, "kernelgen mean, kept reps (select+decode)", lambda: selecting(q, k, v, key_reps=reps),
                   _bench_graph(lambda: selecting(q, k, v, key_reps=reps), log=log), kv_bytes + reps_bytes,
                   note="kv_MB: the listed blocks' K and V plus the kept reps",
                   select_config=_config_json(chooser.config), select_config_source=chooser.source)
            before = selecting.key_reps(k[:, :, :-1])  # the cache one key ago: its last block is pooled again
            record(name, "kernelgen key_reps extended by one key", lambda: selecting.key_reps(k, previous=before),
                   _bench_graph(lambda: selecting.key_reps(k, previous=before), log=log), 0)

        def per_query():  # the KV-centric schedule's decode call: per-query lists, its selection split too
            per_query_spec = spec.replace(schedule="kv_centric", backend=backends.AUTO)
            served = get_kernel(per_query_spec).served("kv_decode_select", shape.n_k, q.dtype, q.device)
            unsplit = dataclasses.replace(served.config, splits=1)  # one program per query group, as prefill scans
            for label, cfg in (("", served.config), (", selection unsplit", unsplit)):
                kernel = get_kernel(per_query_spec, configs={"kv_decode_select": cfg})
                reps = kernel.key_reps(k)
                call = functools.partial(kernel, q, k, v, key_reps=reps)
                record(name, f"kernelgen mean per-query, kept reps{label}", call, _bench_graph(call, log=log), 0,
                       select_config=_config_json(cfg), select_config_source=served.source if not label else "given")

        def lengths_step():
            lens = torch.full((shape.batch,), shape.n_k - 1, dtype=torch.int32, device=q.device)
            reps = selecting.key_reps(k, cache_seqlens=lens)

            def step():
                selecting.key_reps(k, cache_seqlens=lens, previous=reps)  # the row's last, partial block again
                return selecting(q, k, v, cache_seqlens=lens, key_reps=reps)

            diff = _rel_diff(step(), selecting(q, k[:, :, :-1], v[:, :, :-1]))
            record(name, "kernelgen mean, cache_seqlens step", step, _bench_graph(step, log=log),
                   kv_bytes + reps.reps.numel() * reps.reps.element_size(),
                   note="key_reps grown in place + select + decode, one graph; kv_MB as kept reps'",
                   rel_diff_vs_one_key_less=f"{diff:.1e}")

            before = lens - 1  # the same step writing its token (the key already there) into the cache first
            k_new, v_new = k[:, :, -2:-1].clone(), v[:, :, -2:-1].clone()

            def writing_step():
                return selecting(q, k, v, cache_seqlens=before, key_reps=reps, k_new=k_new, v_new=v_new)

            assert torch.equal(writing_step(), step())
            record(name, "kernelgen mean, cache_seqlens step, k_new=", writing_step,
                   _bench_graph(writing_step, log=log), kv_bytes + reps.reps.numel() * reps.reps.element_size(),
                   note="the cache_seqlens step that writes its token's K and V first (append_kv), one graph")

            def fresh_step():  # what a caller that keeps no reps runs: every row's keys pooled again
                return selecting(q, k, v, cache_seqlens=lens, key_reps=selecting.key_reps(k, cache_seqlens=lens))

            assert torch.equal(fresh_step(), step())
            record(name, "kernelgen mean, cache_seqlens step, reps made", fresh_step, _bench_graph(fresh_step, log=log),
                   kv_bytes + k.numel() * k.element_size() // k.shape[2] * (shape.n_k - 1),
                   note="key_reps made over every row's keys + select + decode, one graph; kv_MB: the listed "
                        "blocks' K and V plus all of K")

        def paged(page_size):
            order = torch.randperm(shape.batch * shape.n_k // page_size, device=q.device,
                                   generator=torch.Generator(q.device).manual_seed(page_size))
            table = order.view(shape.batch, -1).to(torch.int32)
            k_pages, v_pages = scatter_pages(k, page_size, order), scatter_pages(v, page_size, order)
            assert torch.equal(attn(q, k_pages, v_pages, block_idx=prepared[0], block_table=table), ours)
            graph_ms = _graph_per_call([lambda p=p: attn(q, k_pages, v_pages, block_idx=p, block_table=table)
                                        for p in prepared], log)
            record(name, f"kernelgen decode prepared, paged {page_size}",
                   lambda: attn(q, k_pages, v_pages, block_idx=prepared[0], block_table=table), graph_ms, kv_bytes,
                   page_size=page_size)
            lens = torch.full((shape.batch,), shape.n_k - 1, dtype=torch.int32, device=q.device)
            reps = selecting.key_reps(k_pages, cache_seqlens=lens, block_table=table)

            def step():  # as lengths_step's: the row's last, partial block pooled again, then select + decode
                selecting.key_reps(k_pages, cache_seqlens=lens, previous=reps, block_table=table)
                return selecting(q, k_pages, v_pages, cache_seqlens=lens, key_reps=reps, block_table=table)

            assert torch.equal(step(), selecting(q, k, v, cache_seqlens=lens))
            record(name, f"kernelgen mean, cache_seqlens step, paged {page_size}", step, _bench_graph(step, log=log),
                   kv_bytes + reps.reps.numel() * reps.reps.element_size(), page_size=page_size,
                   note="the cache_seqlens step over shuffled pages")
            del k_pages, v_pages

        def fp8_cache():  # the cache in float8_e4m3fn, a scale per (batch row, KV head): half the bytes to read
            top = torch.finfo(torch.float8_e4m3fn).max
            scales = {f"{name}_scale": x.abs().amax(dim=(2, 3)).float() / top for name, x in (("k", k), ("v", v))}
            k8, v8 = ((x.float() / scales[f"{name}_scale"][:, :, None, None]).to(torch.float8_e4m3fn)
                      for name, x in (("k", k), ("v", v)))
            lens = torch.full((shape.batch,), shape.n_k, dtype=torch.int32, device=q.device)
            for label, kc, vc, extra in (("", k, v, {}), (", fp8 cache", k8, v8, scales)):
                def call(p=prepared[0], kc=kc, vc=vc, extra=extra):
                    return attn(q, kc, vc, block_idx=p, cache_seqlens=lens, **extra)

                graph_ms = _graph_per_call([functools.partial(call, p) for p in prepared], log)
                record(name, f"kernelgen decode prepared, cache_seqlens{label}", call, graph_ms,
                       kv_bytes // (2 if extra else 1), rel_diff_vs_bf16_cache=f"{_rel_diff(call(), ours):.1e}")
            for splits in DECODE_SPLITS:  # the fp8 cache at each split count, beside the bf16 rows of each above
                pinned = get_kernel(given.replace(backend=served.backend.name),
                                    configs={"decode": dataclasses.replace(served.config, splits=splits)})
                calls = [functools.partial(pinned, q, k8, v8, block_idx=p, cache_seqlens=lens, **scales)
                         for p in prepared]
                record(name, f"kernelgen decode splits={splits}, fp8 cache", calls[0], _graph_per_call(calls, log),
                       kv_bytes // 2)
            reps = selecting.key_reps(k8, cache_seqlens=lens)
            step = functools.partial(selecting, q, k8, v8, cache_seqlens=lens, key_reps=reps, **scales)
            record(name, "kernelgen mean, kept reps, fp8 cache", step, _bench_graph(step, log=log),
                   kv_bytes // 2 + reps.reps.numel() * reps.reps.element_size(),
                   rel_diff_vs_bf16_cache=f"{_rel_diff(step(), selecting(q, k, v)):.1e}")
            del k8, v8

        attempt(name, "mean pipeline", pipeline)
        attempt(name, "kept reps", kept)
        attempt(name, "fp8 cache", fp8_cache)
        attempt(name, "cache_seqlens step", lengths_step)
        for blocks in PAGE_BLOCKS:
            attempt(name, f"paged cache, {blocks} blocks a page", lambda blocks=blocks: paged(blocks * given.kv_block))
        attempt(name, f"paged cache, {SMALL_PAGE} keys a page", lambda: paged(SMALL_PAGE))
        attempt(name, "per-query lists, kept reps", per_query)

        def index_step(schedule):
            index_spec = spec.replace(selector="index", schedule=schedule, backend=backends.AUTO)
            kernel = get_kernel(index_spec)
            index = index_inputs(index_spec, WorkloadShape(shape.batch, shape.heads_kv, shape.n_q, shape.n_k), q.device,
                                 q.dtype)
            lens = torch.full((shape.batch,), shape.n_k - 1, dtype=torch.int32, device=q.device)
            chooser = kernel.served(forward_roles(index_spec, shape.n_q, cache_rows=True)[1], shape.n_k, q.dtype,
                                    q.device)
            select = functools.partial(kernel.select, q, k, index=index, cache_seqlens=lens)
            step = functools.partial(kernel, q, k, v, index=index, cache_seqlens=lens)
            index_bytes = index[1].numel() * index[1].element_size() // shape.n_k * (shape.n_k - 1)
            extra = dict(select_config=_config_json(chooser.config), select_config_source=chooser.source)
            record(name, f"kernelgen index {schedule} select only", select, _bench_graph(select, log=log), 0, **extra)
            record(name, f"kernelgen index {schedule}, cache_seqlens step", step, _bench_graph(step, log=log),
                   kv_bytes + index_bytes, note="select + decode, one graph; kv_MB: the listed blocks' K and V plus "
                                                "every key's index vector", **extra)
            token = [x[:, :, -2:-1].clone() for x in (k, v, index[1])]  # the step writing its token first
            writing = functools.partial(kernel, q, k, v, index=index, cache_seqlens=lens - 1, k_new=token[0],
                                        v_new=token[1], k_idx_new=token[2])
            assert torch.equal(writing(), step())
            record(name, f"kernelgen index {schedule}, cache_seqlens step, k_new=", writing,
                   _bench_graph(writing, log=log), kv_bytes + index_bytes,
                   note="the step that writes its token's K, V and index key first (append_kv), one graph", **extra)
            page_size = PAGE_BLOCKS[0] * given.kv_block  # the most scattered pages; k_idx through the same table
            order = torch.randperm(shape.batch * shape.n_k // page_size, device=q.device,
                                   generator=torch.Generator(q.device).manual_seed(page_size))
            table = order.view(shape.batch, -1).to(torch.int32)
            k_pages, v_pages, k_idx_pages = (scatter_pages(x, page_size, order) for x in (k, v, index[1]))
            paged_index = (index[0], k_idx_pages, index[2])
            paged_step = functools.partial(kernel, q, k_pages, v_pages, index=paged_index, cache_seqlens=lens,
                                           block_table=table)
            assert torch.equal(paged_step(), step())
            record(name, f"kernelgen index {schedule}, cache_seqlens step, paged {page_size}", paged_step,
                   _bench_graph(paged_step, log=log), kv_bytes + index_bytes, page_size=page_size,
                   note="the cache_seqlens step over shuffled pages, k_idx's too", **extra)

        for schedule in ("q_centric", "kv_centric"):
            attempt(name, f"index selector, {schedule}", lambda schedule=schedule: index_step(schedule))

        def flex():
            calls = [flex_call(q, k, v, flex_block_mask(idx, spec, shape), spec) for idx in lists]
            diff = _rel_diff(calls[0](), ours)
            record(name, "flex (same BlockMask)", calls[0], _graph_per_call(calls, log), kv_bytes,
                   rel_diff_vs_kernelgen=f"{diff:.1e}")

        attempt(name, "FlexAttention", flex)
        _dense_rows(name, q, k, v, record, attempt, log)


def _dense_rows(name, q, k, v, record, attempt, log) -> None:
    """Dense SDPA over the whole cache on each backend that takes the call (the KV heads as they are)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv_bytes = (k.numel() + v.numel()) * k.element_size()

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for label, backend in (("sdpa flash (dense)", SDPBackend.FLASH_ATTENTION),
                           ("sdpa efficient (dense)", SDPBackend.EFFICIENT_ATTENTION),
                           ("sdpa cudnn (dense)", SDPBackend.CUDNN_ATTENTION)):
        def row(backend=backend, label=label):
            with sdpa_kernel(backend):
                with warnings.catch_warnings():  # a backend that refuses the call warns why, then raises: one line
                    warnings.simplefilter("ignore", UserWarning)
                    dense()
                record(name, label, dense, _bench_graph(dense, log=log), kv_bytes)

        attempt(name, label, row)

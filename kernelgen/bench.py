"""Side-by-side benchmark: kernelgen against FlexAttention (identical BlockMask) and SDPA (flash, cuDNN).

    python -m kernelgen.bench [--shapes a32k,b,...] [--out DIR] [--sweep]

One process, one GPU; `triton.testing.do_bench` medians after warm-up, and (graph_ms) the median of
the same call replayed from a CUDA graph, which leaves the host's launch cost out: eager timings of a
short kernel measure the host whenever it is slower than the GPU. Useful TFLOP/s count
4 * D * (visible query-key pairs inside selected blocks), summed over batch and query heads
(shared/DESIGN.md); dense anchors count all visible pairs. On a CPU machine it runs the interpreter at a
tiny size and only checks that everything executes (no timings are meaningful there).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import faulthandler
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

__all__ = ["BenchShape", "SHAPES", "useful_flops", "flex_block_mask", "flex_kernel_options", "run"]


@dataclass(frozen=True)
class BenchShape:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    kv_block: int
    q_tile: int
    top_k: int
    causal: bool

    def inputs(self, device="cuda", dtype=torch.bfloat16, seed=0):
        """q, k, v of this shape: randn from one generator seeded `seed` on `device`, in that order."""
        gen = torch.Generator(device=device).manual_seed(seed)
        return [torch.randn(self.batch, h, n, self.head_dim, device=device, dtype=dtype, generator=gen)
                for h, n in ((self.heads_q, self.n_q), (self.heads_kv, self.n_k), (self.heads_kv, self.n_k))]

    def spec(self, selector="mean"):
        from .spec import Spec

        return Spec(head_dim=self.head_dim, kv_block=self.kv_block, q_tile=self.q_tile, top_k=self.top_k,
                    causal=self.causal, gqa_group=self.heads_q // self.heads_kv, selector=selector)


SHAPES = {
    s.name: s
    for s in [
        BenchShape("a32k", 1, 8, 8, 32768, 32768, 64, 64, 64, 16, False),
        BenchShape("a128k", 1, 8, 8, 131072, 131072, 64, 64, 64, 16, False),
        BenchShape("b", 2, 16, 1, 4096, 16384, 128, 128, 128, 16, False),
        BenchShape("c", 1, 32, 8, 32768, 32768, 128, 128, 128, 16, True),
        BenchShape("c_dense", 1, 32, 8, 32768, 32768, 128, 128, 128, 256, True),
        # the CPU smoke size (interpreter)
        BenchShape("tiny", 1, 2, 1, 256, 256, 64, 64, 64, 2, True),
    ]
}


def visible_pairs(block_idx: torch.Tensor, spec, n_q: int, n_k: int) -> torch.Tensor:
    """Visible (query, key) pairs inside the selected blocks, per (batch, KV head): int64 [B, Hkv]."""
    n_blocks = spec.n_kv_blocks(n_k)
    idx = block_idx.long()
    valid = (idx >= 0) & (idx < n_blocks)
    start = idx.clamp(0, n_blocks - 1) * spec.kv_block
    end = torch.clamp(start + spec.kv_block, max=n_k)
    tiles = torch.arange(block_idx.shape[2], device=idx.device)
    q = tiles[:, None] * spec.q_tile + torch.arange(spec.q_tile, device=idx.device)[None, :]  # [T, q_tile]
    q_ok = q < n_q
    if spec.causal:
        last = q + (n_k - n_q)  # last visible key of each query
        seen = (torch.minimum(end[..., None], last[None, None, :, None, :] + 1) - start[..., None]).clamp(min=0)
    else:
        seen = (end - start)[..., None].expand(*idx.shape, spec.q_tile)
    seen = seen * q_ok[None, None, :, None, :] * valid[..., None]
    return seen.sum(dim=(2, 3, 4))


def useful_flops(block_idx, spec, n_q: int, n_k: int) -> float:
    return 4.0 * spec.head_dim * spec.gqa_group * float(visible_pairs(block_idx, spec, n_q, n_k).sum())


def dense_flops(shape: BenchShape) -> float:
    if shape.causal:
        pairs = sum(max(0, min(shape.n_k, i + 1 + shape.n_k - shape.n_q)) for i in range(shape.n_q))
    else:
        pairs = shape.n_q * shape.n_k
    return 4.0 * shape.head_dim * shape.batch * shape.heads_q * pairs


def flex_block_mask(block_idx: torch.Tensor, spec, shape: BenchShape):
    """FlexAttention BlockMask holding exactly kernelgen's lists: blocks that need no elementwise mask
    go to full_kv_*, the rest (diagonal, partial last block) to kv_* with the causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_k = shape.n_q, shape.n_k
    n_blocks = spec.n_kv_blocks(n_k)
    idx = block_idx.long()
    valid = (idx >= 0) & (idx < n_blocks)
    tiles = torch.arange(idx.shape[2], device=idx.device)[:, None]
    block_end = (idx + 1) * spec.kv_block
    full = valid & (block_end <= n_k)
    if spec.causal:
        full = full & (block_end - 1 <= tiles * spec.q_tile + (n_k - n_q))
    partial = valid & ~full

    def pack(sel):
        # BlockMask wants kv_indices [B, H, n_q_blocks, n_kv_blocks]: the selected ids first, then padding
        key = torch.where(sel, idx, n_blocks)
        order = key.sort(-1).values
        count = sel.sum(-1).to(torch.int32)
        ids = torch.where(order < n_blocks, order, 0).to(torch.int32)
        ids = torch.nn.functional.pad(ids, (0, max(0, n_blocks - ids.shape[-1])))[..., :n_blocks]
        g = spec.gqa_group  # BlockMask is per query head
        return count.repeat_interleave(g, 1).contiguous(), ids.repeat_interleave(g, 1).contiguous()

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (n_k - n_q)

    def any_mask(b, h, q_idx, kv_idx):
        return kv_idx < n_k

    kv_num, kv_ids = pack(partial)
    full_num, full_ids = pack(full)
    return BlockMask.from_kv_blocks(kv_num, kv_ids, full_num, full_ids, BLOCK_SIZE=(spec.q_tile, spec.kv_block),
                                    mask_mod=causal_mask if spec.causal else any_mask, seq_lengths=(n_q, n_k))


def flex_kernel_options(spec) -> dict | None:
    """FlexAttention's kernel_options for a BlockMask of spec's blocks: its kernel tile must divide the
    BlockMask's blocks (64-blocks need 64x64 tiles); None keeps Flex's own choice."""
    if min(spec.q_tile, spec.kv_block) >= 128:
        return None
    bm, bn = min(64, spec.q_tile), min(64, spec.kv_block)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn}


def _bench(fn, warmup=25, rep=100) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _bench_graph(fn, rep=100) -> float | None:
    """Median ms per call of `fn` replayed from a CUDA graph: GPU time without the host's launch cost,
    which do_bench includes whenever the host is slower than the GPU (no L2 clearing between calls).
    None if `fn` cannot be captured."""
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as error:  # report, never hide: the row keeps its do_bench time
        print(f"(graph timing failed: {type(error).__name__}: {str(error)[:200]})", flush=True)
        return None


def _precompile_tilelang(shape_names, log=print) -> None:
    """The TileLang forwards the bench will run (each shape's served TileLang config), compiled in
    parallel processes first: nvcc takes about a minute per kernel on the H200 host, and one after
    the other they filled most of a 10-minute device call before a single row was timed."""
    import kernelgen

    from .tilelang_backend import target_arch
    from .tune import precompile_tilelang

    jobs = []
    for name in shape_names:
        shape = SHAPES[name]
        spec = shape.spec("given").replace(backend="tilelang")
        cfg = kernelgen.get_kernel(spec).config("attn", shape.n_q, shape.n_k)
        jobs.append((spec.to_json(), dataclasses.asdict(cfg), [(shape.batch, shape.heads_kv, shape.n_q, shape.n_k)],
                     target_arch(torch.device("cuda"))))
    seconds, errors = precompile_tilelang(jobs)
    log(f"precompiled {len(jobs)} TileLang forwards in {seconds:.0f} s" + (f"; failed: {errors}" if errors else ""))


def _peak_extra_bytes(fn) -> int:
    """Peak device memory a call allocates beyond what exists before it, output included."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def run(shape_names, out_dir=None, sweep=(), log=print, profile=(), graph: bool = True) -> list[dict]:
    import kernelgen
    from .config import config_space, default_config
    from .spec import gluon_unsupported

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    # rows are appended as they are measured, so a run stopped by a time limit keeps what it measured
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    jsonl = open(os.path.join(out_dir, "bench.jsonl"), "a") if out_dir else None  # noqa: SIM115
    dtype = torch.bfloat16 if on_gpu else torch.float16
    rows = []
    t_start = time.perf_counter()
    if on_gpu and importlib.util.find_spec("tilelang"):
        _precompile_tilelang(shape_names, log)
    for name in shape_names:
        shape = SHAPES[name]
        spec = shape.spec("mean")
        given = shape.spec("given")
        q, k, v = shape.inputs(device, dtype)
        attn = kernelgen.get_kernel(spec)
        attn_given = kernelgen.get_kernel(given)
        idx = attn.select(q, k)
        flops = useful_flops(idx, spec, shape.n_q, shape.n_k)
        dflops = dense_flops(shape)
        out_bytes = q.numel() * q.element_size()

        def record(impl, fn, fl, **extra):
            ms = _bench(fn) if on_gpu else float("nan")
            row = dict(shape=name, impl=impl, ms=ms, tflops=fl / ms / 1e9 if on_gpu else float("nan"), **extra)
            if on_gpu and graph:
                row["graph_ms"] = _bench_graph(fn)
            rows.append(row)
            if jsonl:
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
            graph_ms = f" (graph {row['graph_ms']:.3f} ms)" if row.get("graph_ms") else ""
            log(f"{name:8s} {impl:28s} {ms:8.3f} ms{graph_ms} {row['tflops']:7.1f} TFLOP/s "
                + " ".join(f"{k}={v}" for k, v in extra.items()) + f" [{time.perf_counter() - t_start:.0f} s]")
            return row

        if not on_gpu:  # the interpreter: just check the pipeline runs end to end
            o = attn(q, k, v)
            assert not torch.isnan(o).any()
            log(f"{name}: CPU interpreter smoke run OK (no timings on CPU); useful GFLOP {flops / 1e9:.4f}")
            continue

        served = attn_given.config("attn", shape.n_q, shape.n_k)
        record("kernelgen given", lambda: attn_given(q, k, v, block_idx=idx), flops, config=served.to_json())
        # the served kernels and the anchors first: a run stopped by its time limit keeps the comparison
        auto = kernelgen.get_kernel(given.replace(backend="auto"))
        served_backend = auto.backend(shape.n_k, q.dtype, q.device)
        if served_backend != "triton":  # the tuning DB says TileLang or Gluon is faster here
            record("kernelgen auto given", lambda: auto(q, k, v, block_idx=idx), flops, backend=served_backend,
                   config=auto.config("attn", shape.n_q, shape.n_k).to_json())
        else:
            log(f"{name}: backend='auto' serves triton here (the rows above)")
        # the served kernel with the lists prepared once, as Flex's BlockMask below is built once
        served_attn = auto if served_backend != "triton" else attn_given
        prepared = served_attn.prepare(idx, shape.n_q, shape.n_k)
        record("kernelgen auto prepared", lambda: served_attn(q, k, v, block_idx=prepared), flops,
               backend=served_backend)
        ours = attn_given(q, k, v, block_idx=idx)
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            mask = flex_block_mask(idx, spec, shape)
            g = spec.gqa_group
            opts = flex_kernel_options(spec)
            fo = flex(q, k, v, block_mask=mask, enable_gqa=g > 1, kernel_options=opts)
            diff = ((fo.float() - ours.float()).norm() / ours.float().norm()).item()
            record("flex (same BlockMask)", lambda: flex(q, k, v, block_mask=mask, enable_gqa=g > 1, kernel_options=opts),
                   flops, rel_diff_vs_kernelgen=f"{diff:.1e}", kernel_options=opts)
        except Exception as e:  # report, never hide
            log(f"{name}: FlexAttention failed: {type(e).__name__}: {e}")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kd = k.repeat_interleave(spec.gqa_group, 1)
        vd = v.repeat_interleave(spec.gqa_group, 1)
        for backend, label in ((SDPBackend.CUDNN_ATTENTION, "sdpa cudnn (dense)"), (SDPBackend.FLASH_ATTENTION, "sdpa flash (dense)")):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=shape.causal)  # noqa: E731
                    fn()
                    record(label, fn, dflops)
            except Exception as e:
                log(f"{name}: {label} failed: {type(e).__name__}: {str(e)[:200]}")
        untuned = default_config(given, "attn")
        if served != untuned:  # a tuned winner is served: the defaults, side by side
            attn_default = kernelgen.get_kernel(given, configs={"attn": untuned})
            record("kernelgen given (defaults)", lambda: attn_default(q, k, v, block_idx=idx), flops,
                   config=untuned.to_json())
        extra = _peak_extra_bytes(lambda: attn(q, k, v))
        record("kernelgen mean (select+attn)", lambda: attn(q, k, v), flops,
               peak_extra_MB=round(extra / 2**20, 1), output_MB=round(out_bytes / 2**20, 1),
               workspace_over_output=round((extra - out_bytes) / out_bytes, 3))
        record("kernelgen mean select only", lambda: attn.select(q, k), 0.0)

        def other_backend(backend: str, skip: str | None):
            """A row for `backend` on the same lists (its rel_diff against the Triton output), unless `skip`
            says why it cannot run here; a failure is a logged line, never hidden."""
            if skip:
                log(f"{name}: {backend} backend skipped: {skip}")
                return
            try:
                other = kernelgen.get_kernel(given.replace(backend=backend))
                out = other(q, k, v, block_idx=idx)
                diff = ((out.float() - ours.float()).norm() / ours.float().norm()).item()
                record(f"kernelgen {backend} given", lambda: other(q, k, v, block_idx=idx), flops,
                       rel_diff_vs_kernelgen=f"{diff:.1e}", config=other.config("attn", shape.n_q, shape.n_k).to_json())
            except Exception as e:  # report, never hide
                log(f"{name}: {backend} backend failed: {type(e).__name__}: {str(e)[:300]}")

        other_backend("tilelang", None if importlib.util.find_spec("tilelang") else "tilelang is not installed")
        other_backend("gluon", gluon_unsupported(given) or (
            None if torch.cuda.get_device_capability(q.device) == (9, 0) else "not a Hopper GPU (sm_90)"))
        if name in sweep or name in profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            with profiler(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    attn(q, k, v)
                torch.cuda.synchronize()
            log(f"{name}: CUDA time of 10 `mean` pipeline calls")
            log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
        if name in sweep:
            best = None
            for cfg in config_space(given, "attn"):
                if cfg.num_stages == 1:
                    continue
                try:
                    tuned = kernelgen.get_kernel(given, configs={"attn": cfg})
                    o = tuned(q, k, v, block_idx=idx)
                    if not torch.allclose(o.float(), ours.float(), atol=2e-2, rtol=2e-2):
                        log(f"{name}: config {cfg} gives a different result: rejected")
                        continue
                    ms = _bench(lambda: tuned(q, k, v, block_idx=idx), warmup=10, rep=30)
                except Exception as e:
                    log(f"{name}: config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append(dict(shape=name, impl="sweep attn", ms=ms, tflops=flops / ms / 1e9, config=cfg.to_json()))
                log(f"{name:8s} {'sweep attn':28s} {ms:8.3f} ms {cfg}")
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            best_sel = None
            for cfg in config_space(spec, "select"):
                try:
                    sel = kernelgen.get_kernel(spec, configs={"select": cfg})
                    same = (sel.select(q, k) == idx).float().mean().item()
                    ms = _bench(lambda: sel.select(q, k), warmup=10, rep=30)
                except Exception as e:
                    log(f"{name}: select config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append(dict(shape=name, impl="sweep select", ms=ms, config=cfg.to_json(), same_ids=same))
                log(f"{name:8s} {'sweep select':28s} {ms:8.3f} ms {cfg} same_ids={same:.4f}")
                if best_sel is None or ms < best_sel[0]:
                    best_sel = (ms, cfg, same)
            if best_sel:
                log(f"{name:8s} {'best sweep select':28s} {best_sel[0]:8.3f} ms {best_sel[1]} same_ids={best_sel[2]:.4f}")
            if best:
                log(f"{name:8s} {'best sweep attn':28s} {best[0]:8.3f} ms {flops / best[0] / 1e9:7.1f} TFLOP/s {best[1]}")
        q = k = v = kd = vd = None  # free this shape's tensors before the next one's
        torch.cuda.empty_cache()
    if out_dir:
        jsonl.close()
        keys = sorted({k for r in rows for k in r})
        with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def dispatch_problem():
    """The problem dispatch overhead is measured on (small enough that the GPU waits for the host):
    (spec, q, k, v, idx, attn, shapes, select module, attention config, attention module), the last
    three what a call looks up."""
    import kernelgen
    from . import ops
    from .config import seq_bucket

    spec = kernelgen.Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, selector="given")
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32, device="cuda")
    attn = kernelgen.get_kernel(spec)
    shapes = ops.check_qkv(q, k, v, spec)
    sel_mod, _, backend, cfg, mod = attn._kernels(seq_bucket(shapes.n_k), q.dtype, q.device)
    assert backend == "triton", backend  # the spec's backend: the raw launches are Triton's
    return spec, q, k, v, idx, attn, shapes, sel_mod, cfg, mod


def dispatch_overhead(n_calls: int = 200, rounds: int = 9, log=print) -> dict:
    """Host time per `attn(q, k, v, block_idx=...)` call against the raw Triton launches it makes
    (normalise + attention), on a problem small enough that the GPU waits for the host; and the same
    for a call given prepared lists (`attn.prepare`) against its one raw attention launch.

    The two are timed in alternating rounds and the overhead is the median of the per-round
    differences: host speed drifts between rounds (another process, clocks), and two loops timed
    once each minutes apart measured 7.7 us on one host and 30.3 us on another for the same code."""
    import statistics
    import time

    from . import ops
    from .config import seq_bucket

    spec, q, k, v, idx, attn, shapes, sel_mod, cfg, mod = dispatch_problem()

    def raw():
        lists = ops.prepare_block_idx(idx, spec, shapes, q.device, sel_mod)
        return ops.attention(q, k, v, lists, spec, shapes, mod, cfg, None)

    def call():
        return attn(q, k, v, block_idx=idx)

    def timed(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n_calls * 1e6

    prepared = attn.prepare(idx, shapes.n_q, shapes.n_k)
    lists = prepared.block_idx

    def call_prepared():  # lists prepared once: one launch per call
        return attn(q, k, v, block_idx=prepared)

    def raw_attention():
        return ops.attention(q, k, v, lists, spec, shapes, mod, cfg, None)

    def lookups():  # what a call does beyond the raw launches, without any launch
        ops.check_qkv(q, k, v, spec)
        attn._kernels(seq_bucket(shapes.n_k), q.dtype, q.device)

    calls, raws, lookup, calls_prepared, raws_attention = [], [], [], [], []
    for _ in range(rounds):
        calls.append(timed(call))
        raws.append(timed(raw))
        lookup.append(timed(lookups))
        calls_prepared.append(timed(call_prepared))
        raws_attention.append(timed(raw_attention))
    med = statistics.median
    result = {"call_us": med(calls), "raw_launches_us": med(raws), "checks_and_lookups_us": med(lookup),
              "overhead_us": med(c - r for c, r in zip(calls, raws)), "rounds": rounds,
              "overhead_us_per_round": [round(c - r, 2) for c, r in zip(calls, raws)],
              "prepared_call_us": med(calls_prepared), "raw_attention_us": med(raws_attention),
              "prepared_overhead_us": med(c - r for c, r in zip(calls_prepared, raws_attention))}
    log(f"dispatch: {result['call_us']:.1f} us per call, raw launches {result['raw_launches_us']:.1f} us, "
        f"overhead {result['overhead_us']:.1f} us (median of {rounds} alternating rounds: "
        f"{min(result['overhead_us_per_round']):.1f} to {max(result['overhead_us_per_round']):.1f}; "
        f"input checks and config/module lookups alone: {result['checks_and_lookups_us']:.1f} us); "
        f"with prepared lists: {result['prepared_call_us']:.1f} us per call, raw attention launch "
        f"{result['raw_attention_us']:.1f} us, overhead {result['prepared_overhead_us']:.1f} us")
    return result


def plot(out_dir) -> str | None:
    """bench.png next to bench.json: time and useful TFLOP/s per shape (ordered by N), one series per
    implementation. Needs matplotlib (optional); without it, says so and returns None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    path = os.path.join(out_dir, "bench.json")
    if not os.path.exists(path):
        return None
    rows = [r for r in json.load(open(path)) if not r["impl"].startswith("sweep") and r["ms"] == r["ms"]]
    names = sorted({r["shape"] for r in rows}, key=lambda n: (SHAPES[n].n_k, n) if n in SHAPES else (0, n))
    impls = sorted({r["impl"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for impl in impls:
        pts = [(names.index(r["shape"]), r["ms"], r["tflops"]) for r in rows if r["impl"] == impl]
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        if "select only" not in impl:
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=impl)
    for ax, label in zip(axes, ("ms (median)", "useful TFLOP/s")):
        ax.set_xticks(range(len(names)), [f"{n}\nN={SHAPES[n].n_k}" if n in SHAPES else n for n in names])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(out_dir, "bench.png")
    fig.savefig(png, dpi=120)
    return png


def stall_guard(seconds: float, log=print):
    """A `log` that re-arms a watchdog at each line: when nothing is logged for `seconds` (a kernel that
    hangs the GPU never returns, and no Python exception can interrupt the wait), every thread's stack
    goes to the process's stderr and it exits with status 1, instead of stalling silently until killed.
    The rows measured so far are already in bench.jsonl. 0 (or no stderr file) disables it."""
    stderr = sys.__stderr__  # the process's own: a test runner's stand-in has no file descriptor
    if seconds <= 0 or stderr is None:
        return log

    def arm():
        faulthandler.dump_traceback_later(seconds, exit=True, file=stderr)

    def guarded(*args, **kwargs):
        log(*args, **kwargs)
        arm()

    arm()
    return guarded


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma-separated: " + ",".join(SHAPES))
    p.add_argument("--out", default=None, help="directory for bench.csv and bench.json")
    p.add_argument("--overhead", action="store_true", help="also measure dispatch overhead per call")
    p.add_argument("--sweep", default="", help="comma-separated shapes on which to also time every attention config")
    p.add_argument("--profile", default="", help="comma-separated shapes whose `mean` pipeline to profile (CUDA time per kernel)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay time of each row (graph_ms)")
    p.add_argument("--stall-timeout", type=float, default=600.0,
                   help="seconds without a logged line after which the bench prints every thread's stack and exits "
                        "with status 1 (a kernel that hangs the GPU); 0: never")
    args = p.parse_args(argv)
    if args.shapes:
        names = args.shapes.split(",")
    else:
        names = ["a32k", "a128k", "b", "c", "c_dense"] if torch.cuda.is_available() else ["tiny"]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; expected some of {list(SHAPES)}")
    if not torch.cuda.is_available():
        print("No CUDA GPU: running the Triton interpreter at a tiny size (correctness smoke run, no timings).")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    log = stall_guard(args.stall_timeout)
    try:
        if args.overhead and torch.cuda.is_available():
            overhead = dispatch_overhead(log=log)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "dispatch.json"), "w") as f:
                    json.dump(overhead, f, indent=1)
        run(names, args.out, tuple(filter(None, args.sweep.split(","))), log=log,
            profile=tuple(filter(None, args.profile.split(","))), graph=not args.no_graph)
    finally:
        faulthandler.cancel_dump_traceback_later()  # the guard ends with the bench (e.g. under `kernelgen bench`)
    return 0


if __name__ == "__main__":
    sys.exit(main())

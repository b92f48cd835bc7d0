"""The measurements: each shape's rows (kernelgen's served kernels, the other backends, the anchors),
the dispatch overhead of one call, and the timing helpers they share.

Times are `triton.testing.do_bench` medians (L2 cleared before each call) and, as graph_ms, medians of
the same call replayed from a CUDA graph, which leave the host's launch cost out. TFLOP/s are useful
FLOPs (`kernelgen.workloads`, docs/SEMANTICS.md) per second. Without a CUDA GPU, `run` executes each
shape once in Triton's interpreter and checks the results (no timings).
"""
from __future__ import annotations

import csv
import faulthandler
import json
import math
import os
import statistics
import sys
import time

import torch

from .. import backends
from ..backends import Backend, Problem
from ..device import device_arch
from ..dispatch import get_kernel
from ..inputs import check_block_idx, check_qkv
from ..roles import REL_L2_TOL, get_role
from ..spec import Spec
from ..tuning.buckets import seq_bucket
from ..workloads import SHAPES, dense_flops, useful_flops
from .anchors import flex_block_mask, flex_call, flex_kernel_options, flex_token_mask, sdpa_dense_anchors

__all__ = ["run", "dispatch_overhead", "dispatch_problem", "stall_guard", "host_ms", "json_text", "dump_json"]


def _bench(fn, warmup=25, rep=100) -> float:
    """Median ms per call (`triton.testing.do_bench`: L2 cleared before each call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _bench_graph(fn, rep=100, log=print) -> float | None:
    """Median ms per call of `fn` replayed from a CUDA graph: GPU time without the host's launch cost,
    which do_bench includes whenever the host is slower than the GPU (no L2 clearing between calls).
    None if `fn` cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as error:  # report, never hide: the row keeps its do_bench time
        log(f"(graph timing failed: {type(error).__name__}: {str(error)[:200]})")
        return None


def host_ms(fn, n: int = 30, before=None) -> float:
    """The host's median ms to enqueue one call of `fn` on an idle GPU (synchronised before the call, not
    after; `before`, if given, runs ahead of each call, untimed): where it exceeds the call's GPU time (its
    graph replay), an eager call waits on the host."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(n):
        if before is not None:
            before()
        sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    sync()
    return statistics.median(times)


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


def _config_json(config) -> str:
    return json.dumps(Backend.config_to_dict(config), sort_keys=True)


def _finite(value):
    """`value` with every NaN or infinite float (a row without a time: the CPU smoke run's) as None, in
    nested dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(value, **options) -> str:
    """`value` as strict JSON (null where a float is NaN or infinite: JSON has no NaN); `options`: json.dumps's."""
    return json.dumps(_finite(value), allow_nan=False, **options)


def dump_json(value, path) -> None:
    """`value` to the file `path` as strict JSON (`json_text`), indented: every JSON file the bench writes."""
    with open(path, "w") as f:
        f.write(json_text(value, indent=1))


def _dump_rows(rows: list[dict], out_dir, filename: str) -> None:
    """All rows so far to out_dir/filename (JSON), rewritten after each row: a run stopped by its time
    limit keeps what it measured. No out_dir: nothing."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        dump_json(rows, os.path.join(out_dir, filename))


def row_attempts(log):
    """attempt(name, impl, body): run one row's `body`; an exception is logged with the shape and the row, never
    hidden, and the other rows still run."""
    def attempt(name, impl, body):
        try:
            body()
        except Exception as error:  # report, never hide
            log(f"{name}: {impl} failed: {type(error).__name__}: {str(error)[:300]}")

    return attempt


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def _attn_backends(spec: Spec, device, skip: str | None = None, log=print, label: str = ""):
    """(backend, its spec) for every registered backend that runs the attention and can serve `spec` on
    `device`, but `skip`; each one that cannot is logged with its reason."""
    for backend in backends.all_backends():
        if "attn" not in backend.roles or backend.name == skip:
            continue
        spec_b = spec.replace(backend=backend.name)
        reason = backend.unsupported(spec_b, device)
        if reason:
            log(f"{label}{backend.name} backend skipped: {reason}")
            continue
        yield backend, spec_b


def _precompile_per_shape(shape_names, device, dtype=torch.bfloat16, log=print) -> None:
    """The forwards of backends compiled per problem shape (`Backend.per_shape`) that the bench will run,
    each shape's served config, compiled in parallel processes first: nvcc takes about a minute per
    kernel on an H200 host, and one after the other they fill many minutes before a row is timed."""
    from ..tuning.worker import precompile

    jobs = []
    for name in shape_names:
        shape = SHAPES[name]
        given = shape.spec("given")
        for backend in backends.all_backends():
            if not backend.per_shape or "attn" not in backend.roles:
                continue
            spec_b = given.replace(backend=backend.name)
            if backend.unsupported(spec_b, device):
                continue  # the shape's rows say why
            try:
                config = get_kernel(spec_b).config("attn", shape.n_q, shape.n_k, dtype, device)
            except Exception as error:  # report, never hide
                log(f"{name}: no {backend.name} config to precompile: {type(error).__name__}: {str(error)[:200]}")
                continue
            kernel_spec = get_role("attn").kernel_spec(spec_b, backend.name)
            jobs.append((backend.name, kernel_spec.to_json(), "attn", backend.config_to_dict(config),
                         [(shape.batch, shape.heads_kv, shape.n_q, shape.n_k)], str(dtype).removeprefix("torch."),
                         str(device)))
    if not jobs:
        return
    seconds, errors = precompile(jobs)
    names = ", ".join(sorted({job[0] for job in jobs}))
    log(f"precompiled {len(jobs)} per-shape forwards ({names}) in {seconds:.0f} s"
        + (f"; failed: {errors}" if errors else ""))


def _smoke(name: str, log=print) -> list[dict]:
    """One shape in Triton's interpreter: the selector pipeline, the given lists, prepared lists, and every
    other backend that runs here, each checked against the float64 reference; and FlexAttention's
    BlockMask checked to hold exactly the lists' visible pairs. No timings."""
    from .. import reference

    shape = SHAPES[name]
    spec, given = shape.spec("mean"), shape.spec("given")
    device, dtype = torch.device("cpu"), torch.float16
    q, k, v = shape.inputs(device, dtype)
    attn, attn_given = get_kernel(spec), get_kernel(given)
    idx = attn.select(q, k)
    ref = reference.sparse_attention(q, k, v, given, block_idx=idx)[0]
    tol = REL_L2_TOL[dtype]
    served = attn_given.served("attn", shape.n_k, dtype, device)
    rows, failed = [], []

    def check(impl, out, **extra):
        err = _rel_diff(out, ref)
        rows.append(dict(shape=name, impl=impl, ms=float("nan"), tflops=float("nan"), rel_err_vs_reference=err,
                         **extra))
        if not err < tol:
            failed.append(f"{impl}: rel. L2 error {err:.2e} >= {tol}")

    check("kernelgen mean (select+attn)", attn(q, k, v))
    check("kernelgen given", attn_given(q, k, v, block_idx=idx), backend=served.backend.name,
          config=_config_json(served.config), config_source=served.source)
    check("kernelgen given prepared", attn_given(q, k, v, block_idx=attn_given.prepare(idx, shape.n_q, shape.n_k)))
    for backend, spec_b in _attn_backends(given, device, skip=served.backend.name, log=log, label=f"{name}: "):
        other = get_kernel(spec_b)
        check(f"kernelgen {backend.name} given", other(q, k, v, block_idx=idx), backend=backend.name,
              config=_config_json(other.config("attn", shape.n_q, shape.n_k, dtype, device)))
    # FlexAttention's BlockMask (eager flex_attention ignores the block lists: the mask itself is checked)
    lists_mask = reference.token_mask(idx, spec, shape.n_q, shape.n_k).repeat_interleave(spec.gqa_group, 1)
    if not torch.equal(flex_token_mask(flex_block_mask(idx, spec, shape)), lists_mask):
        failed.append("FlexAttention's BlockMask: its visible pairs differ from the lists'")
    if failed:
        raise AssertionError(f"{name}: the interpreter smoke run computed wrong results: " + "; ".join(failed))
    gflop = useful_flops(idx, spec, shape.n_q, shape.n_k) / 1e9
    log(f"{name}: CPU interpreter smoke run OK ({len(rows)} implementations agree with the float64 reference, "
        f"FlexAttention's BlockMask holds the lists; no timings on CPU); useful GFLOP {gflop:.4f}")
    return rows


def run(shape_names, out_dir=None, sweep=(), log=print, profile=(), graph: bool = True) -> list[dict]:
    """Measure each named shape of `kernelgen.workloads.SHAPES` and return its rows (dicts: shape, impl, ms,
    tflops, graph_ms and what the row adds). With `out_dir`, rows go to bench.jsonl as they are measured
    (a run stopped by a time limit keeps what it measured; the file holds this run's rows alone), then to
    bench.csv and bench.json (JSON: null where a value is NaN). `sweep`:
    shapes on which every attention and select config is also timed; `profile`: shapes whose `mean`
    pipeline is profiled (CUDA time per kernel); `graph`: also time each row from a CUDA graph."""
    on_gpu = torch.cuda.is_available()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    # "w": this run's rows alone, as in bench.csv and bench.json (appending mixed runs together)
    jsonl = open(os.path.join(out_dir, "bench.jsonl"), "w") if out_dir else None  # noqa: SIM115
    rows: list[dict] = []
    try:
        if not on_gpu:  # the interpreter: check the pipeline runs end to end and computes the right thing
            for name in shape_names:
                for row in _smoke(name, log):
                    _write(rows, jsonl, row)
        else:
            device, dtype = torch.device("cuda"), torch.bfloat16
            _precompile_per_shape(shape_names, device, dtype, log)
            t_start = time.perf_counter()
            for name in shape_names:
                _run_shape(name, device, dtype, rows, jsonl, t_start, sweep, profile, graph, log)
                torch.cuda.empty_cache()  # free this shape's memory before the next one's
    finally:
        if jsonl:
            jsonl.close()
    if out_dir:
        keys = sorted({k for r in rows for k in r})
        with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        dump_json(rows, os.path.join(out_dir, "bench.json"))
    return rows


def _write(rows: list, jsonl, row: dict) -> None:
    rows.append(row)
    if jsonl:
        jsonl.write(json_text(row) + "\n")
        jsonl.flush()


def _run_shape(name, device, dtype, rows, jsonl, t_start, sweep, profile, graph, log) -> None:
    """The rows of one shape on the GPU: the served kernels and the anchors first (a run stopped by its
    time limit keeps the comparison), then the defaults, the `mean` pipeline, the other backends."""
    shape = SHAPES[name]
    spec = shape.spec("mean")
    given = shape.spec("given")
    q, k, v = shape.inputs(device, dtype)
    attn = get_kernel(spec)
    attn_given = get_kernel(given)
    idx = attn.select(q, k)
    flops = useful_flops(idx, spec, shape.n_q, shape.n_k)
    dflops = dense_flops(shape)
    out_bytes = q.numel() * q.element_size()

    def record(impl, fn, fl, **extra):
        ms = _bench(fn)
        row = dict(shape=name, impl=impl, ms=ms, tflops=fl / ms / 1e9, **extra)
        if graph:
            row["graph_ms"] = _bench_graph(fn, log=log)
        _write(rows, jsonl, row)
        graph_ms = f" (graph {row['graph_ms']:.3f} ms)" if row.get("graph_ms") else ""
        log(f"{name:8s} {impl:28s} {ms:8.3f} ms{graph_ms} {row['tflops']:7.1f} TFLOP/s "
            + " ".join(f"{k}={v}" for k, v in extra.items()) + f" [{time.perf_counter() - t_start:.0f} s]")
        return row

    def served_fields(served) -> dict:
        return dict(backend=served.backend.name, config=_config_json(served.config), config_source=served.source)

    served = attn_given.served("attn", shape.n_k, q.dtype, q.device)
    record("kernelgen given", lambda: attn_given(q, k, v, block_idx=idx), flops, **served_fields(served))
    auto = get_kernel(given.replace(backend=backends.AUTO))
    auto_served = auto.served("attn", shape.n_k, q.dtype, q.device)
    if auto_served.backend.name != served.backend.name:  # the tuning DB says another backend is faster here
        record("kernelgen auto given", lambda: auto(q, k, v, block_idx=idx), flops, **served_fields(auto_served))
        served_attn = auto
    else:
        log(f"{name}: backend='auto' serves {auto_served.backend.name} here (the rows above)")
        served_attn = attn_given
    # the served kernel with the lists prepared once, as Flex's BlockMask below is built once
    prepared = served_attn.prepare(idx, shape.n_q, shape.n_k)
    record("kernelgen auto prepared", lambda: served_attn(q, k, v, block_idx=prepared), flops,
           backend=auto_served.backend.name)
    ours = attn_given(q, k, v, block_idx=idx)
    try:
        flex = flex_call(q, k, v, flex_block_mask(idx, spec, shape), spec)
        diff = _rel_diff(flex(), ours)
        record("flex (same BlockMask)", flex, flops, rel_diff_vs_kernelgen=f"{diff:.1e}",
               kernel_options=flex_kernel_options(spec))
    except Exception as e:  # report, never hide
        log(f"{name}: FlexAttention failed: {type(e).__name__}: {e}")
    from torch.nn.attention import sdpa_kernel

    for anchor in sdpa_dense_anchors(q, k, v, spec):
        try:
            with sdpa_kernel(anchor.backend):
                anchor.fn()
                record(anchor.label, anchor.fn, dflops)
        except Exception as e:
            log(f"{name}: {anchor.label} failed: {type(e).__name__}: {str(e)[:200]}")
    kernel_spec = get_role("attn").kernel_spec(given, served.backend.name)
    untuned = served.backend.default_config(kernel_spec, "attn", device_arch(q.device))
    if served.config != untuned:  # a tuned winner is served: the defaults, side by side
        attn_default = get_kernel(given, configs={"attn": untuned})
        record("kernelgen given (defaults)", lambda: attn_default(q, k, v, block_idx=idx), flops,
               backend=served.backend.name, config=_config_json(untuned))
    extra = _peak_extra_bytes(lambda: attn(q, k, v))
    record("kernelgen mean (select+attn)", lambda: attn(q, k, v), flops,
           peak_extra_MB=round(extra / 2**20, 1), output_MB=round(out_bytes / 2**20, 1),
           workspace_over_output=round((extra - out_bytes) / out_bytes, 3))
    record("kernelgen mean select only", lambda: attn.select(q, k), 0.0)

    # every other backend on the same lists (its rel_diff against the given row's output)
    for backend, spec_b in _attn_backends(given, q.device, skip=served.backend.name, log=log, label=f"{name}: "):
        try:
            other = get_kernel(spec_b)
            out = other(q, k, v, block_idx=idx)
            diff = _rel_diff(out, ours)
            record(f"kernelgen {backend.name} given", lambda other=other: other(q, k, v, block_idx=idx), flops,
                   rel_diff_vs_kernelgen=f"{diff:.1e}",
                   **served_fields(other.served("attn", shape.n_k, q.dtype, q.device)))
        except Exception as e:  # report, never hide
            log(f"{name}: {backend.name} backend failed: {type(e).__name__}: {str(e)[:300]}")

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
        _sweep(name, spec, given, served.backend, q, k, v, idx, ours, flops, rows, jsonl, log)


def _sweep(name, spec, given, backend: Backend, q, k, v, idx, ours, flops, rows, jsonl, log) -> None:
    """Every feasible attention config of the served backend, and every select config, timed (shorter
    do_bench runs); configs whose results differ are rejected."""
    best = None
    arch = device_arch(q.device)
    kernel_spec = get_role("attn").kernel_spec(given, backend.name)
    pinned_spec = given.replace(backend=backend.name)
    for cfg in backend.config_space(kernel_spec, "attn", arch):
        if getattr(cfg, "num_stages", None) == 1:  # unpipelined points: never the winners, and slow
            continue
        try:
            tuned = get_kernel(pinned_spec, configs={"attn": cfg})
            o = tuned(q, k, v, block_idx=idx)
            if not torch.allclose(o.float(), ours.float(), atol=2e-2, rtol=2e-2):
                log(f"{name}: config {cfg} gives a different result: rejected")
                continue
            ms = _bench(lambda: tuned(q, k, v, block_idx=idx), warmup=10, rep=30)
        except Exception as e:
            log(f"{name}: config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        _write(rows, jsonl, dict(shape=name, impl="sweep attn", ms=ms, tflops=flops / ms / 1e9, backend=backend.name,
                                 config=_config_json(cfg)))
        log(f"{name:8s} {'sweep attn':28s} {ms:8.3f} ms {cfg}")
        if best is None or ms < best[0]:
            best = (ms, cfg)
    best_sel = None
    selector = backends.runner(spec.backend, "select")
    for cfg in selector.config_space(get_role("select").kernel_spec(spec, selector.name), "select", arch):
        try:
            sel = get_kernel(spec, configs={"select": cfg})
            same = (sel.select(q, k) == idx).float().mean().item()
            ms = _bench(lambda: sel.select(q, k), warmup=10, rep=30)
        except Exception as e:
            log(f"{name}: select config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        _write(rows, jsonl, dict(shape=name, impl="sweep select", ms=ms, backend=selector.name,
                                 config=_config_json(cfg), same_ids=same))
        log(f"{name:8s} {'sweep select':28s} {ms:8.3f} ms {cfg} same_ids={same:.4f}")
        if best_sel is None or ms < best_sel[0]:
            best_sel = (ms, cfg, same)
    if best_sel:
        log(f"{name:8s} {'best sweep select':28s} {best_sel[0]:8.3f} ms {best_sel[1]} same_ids={best_sel[2]:.4f}")
    if best:
        log(f"{name:8s} {'best sweep attn':28s} {best[0]:8.3f} ms {flops / best[0] / 1e9:7.1f} TFLOP/s {best[1]}")


# ---- dispatch overhead -------------------------------------------------------------------------------

def dispatch_problem():
    """The problem dispatch overhead is measured on (small enough that the GPU waits for the host):
    (spec, q, k, v, idx, attn, shapes, served lists, served attention, attention kernel); the served
    roles are what a call looks up, and their launches are the raw launches it makes."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, selector="given")
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32, device="cuda")
    attn = get_kernel(spec)
    shapes = check_qkv(q, k, v, spec)
    served_lists = attn.served("lists", shapes.n_k, q.dtype, q.device)
    served_attn = attn.served("attn", shapes.n_k, q.dtype, q.device)
    kernel = served_attn.kernel
    if kernel is None:  # a backend compiled per problem shape: this problem's kernel
        kernel = attn._build(served_attn.backend, served_attn.spec, "attn", served_attn.config,
                             Problem(q.dtype, shapes, q.device))
    return spec, q, k, v, idx, attn, shapes, served_lists, served_attn, kernel


def dispatch_overhead(n_calls: int = 200, rounds: int = 9, log=print) -> dict:
    """Host time per `attn(q, k, v, block_idx=...)` call against the raw launches it makes (the served
    `lists` and `attn` roles' launches), on a problem small enough that the GPU waits for the host; and
    the same for a call given prepared lists (`attn.prepare`) against its one raw attention launch.

    The two are timed in alternating rounds and the overhead is the median of the per-round
    differences: host speed drifts between rounds (another process, clocks), and two loops timed
    once each minutes apart differ by several times for the same code."""
    spec, q, k, v, idx, attn, shapes, served_lists, served_attn, kernel = dispatch_problem()
    checked = check_block_idx(idx, spec, shapes, q.device)
    lists_launch, attn_launch = served_lists.impl.launch, served_attn.impl.launch

    def raw():
        lists = lists_launch(served_lists.kernel, served_lists.spec, served_lists.config, shapes, checked)
        return attn_launch(kernel, served_attn.spec, served_attn.config, shapes, q, k, v, lists, None)

    def call():
        return attn(q, k, v, block_idx=idx)

    prepared = attn.prepare(idx, shapes.n_q, shapes.n_k)
    prepared_lists = prepared.block_idx

    def call_prepared():  # lists prepared once: one launch per call
        return attn(q, k, v, block_idx=prepared)

    def raw_attention():
        return attn_launch(kernel, served_attn.spec, served_attn.config, shapes, q, k, v, prepared_lists, None)

    def lookups():  # what a call does beyond the raw launches, without any launch
        check_qkv(q, k, v, spec)
        check_block_idx(idx, spec, shapes, q.device)
        attn._plan(seq_bucket(shapes.n_k), q.dtype, q.device)

    def timed(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n_calls * 1e6

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
              "prepared_overhead_us": med(c - r for c, r in zip(calls_prepared, raws_attention)),
              "lists_backend": served_lists.backend.name, "attn_backend": served_attn.backend.name,
              "attn_config": _config_json(served_attn.config), "attn_config_source": served_attn.source}
    log(f"dispatch: {result['call_us']:.1f} us per call, raw launches {result['raw_launches_us']:.1f} us, "
        f"overhead {result['overhead_us']:.1f} us (median of {rounds} alternating rounds: "
        f"{min(result['overhead_us_per_round']):.1f} to {max(result['overhead_us_per_round']):.1f}; "
        f"input checks and config/kernel lookups alone: {result['checks_and_lookups_us']:.1f} us); "
        f"with prepared lists: {result['prepared_call_us']:.1f} us per call, raw attention launch "
        f"{result['raw_attention_us']:.1f} us, overhead {result['prepared_overhead_us']:.1f} us")
    return result


# ---- the watchdog ------------------------------------------------------------------------------------

def stall_guard(seconds: float, log=print):
    """A `log` that re-arms a watchdog at each line: when nothing is logged for `seconds` (a kernel that
    hangs the GPU never returns, and no Python exception can interrupt the wait), every thread's stack
    goes to the process's stderr and it exits with status 1, instead of stalling silently until killed.
    The rows measured so far are already in bench.jsonl. 0 (or no stderr file) disables it; end it with
    `faulthandler.cancel_dump_traceback_later()`."""
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

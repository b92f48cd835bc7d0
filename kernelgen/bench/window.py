"""`kernelgen bench --window`: sliding-window attention, kernelgen against FlexAttention and dense SDPA.

For each shape (`workloads.WINDOW_SHAPES`), in one process on one GPU (bf16): kernelgen's window spec
(`Spec.window`; its lists are the window's blocks), called as a model calls it (selection included) and over
lists prepared once, on the backend `auto` serves and on each other backend with windows here; FlexAttention
(torch.compile'd) over the BlockMask that `create_block_mask` builds from the sliding-window mask_mod, at Flex's
own 128x128 blocks; dense causal SDPA on cuDNN, which has no window (the work a model pays without one).
Forward, and forward+backward (`bench.backward`'s timing: do_bench medians, eager and replayed from a CUDA graph).
kernelgen's o and gradients are compared with Flex's (relative L2), and two backward runs bit for bit. TFLOP/s
count the window's visible (query, key) pairs, 4 * D FLOP each forward.

Then a decode step of the same heads: DECODE_BATCH rows of a cache of n_k keys (`cache_seqlens`, every row full),
one query a row at its end, as a serving engine runs it: kernelgen's call (one launch: the decode kernel makes the
rows' window lists from their lengths), and the same over a paged cache (one block a page, the pages shuffled over
the pool); FlexAttention (torch.compile'd) over the cache with the sliding-window BlockMask of one query; dense SDPA
(flash, cuDNN; `enable_gqa`) over exactly the window's keys, sliced out beforehand (what a ring-buffer cache of W
keys hands a dense kernel, at no cost to the anchor). Times are do_bench medians, CUDA-graph
replays and the host's enqueue time (`bench.decode`'s), and kernelgen's o is compared with each anchor's.
"""
from __future__ import annotations

import torch

from .. import backends
from ..dispatch import get_kernel
from ..workloads import WINDOW_SHAPES
from .anchors import sdpa_dense_anchors
from .backward import _grads, _timed
from .measure import _bench, _bench_graph, _dump_rows, _rel_diff, host_ms, row_attempts

__all__ = ["run_window", "DECODE_BATCH"]

DECODE_BATCH = 8  # rows of the decode step's cache


def window_pairs(n: int, window: int) -> int:
    """Visible (query, key) pairs of one head of causal self-attention over n tokens with a sliding window."""
    inside = min(n, window)
    return inside * (inside + 1) // 2 + (n - inside) * window


def window_backends(spec, device, served: str) -> list[str]:
    """The backends other than `served` whose kernels compute `spec`'s window here (for the attention)."""
    return [b.name for b in backends.all_backends()
            if b.name != served and "attn" in b.roles and not b.unsupported(spec.replace(backend=b.name), device)]


def run_window(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_ms, fwd_tflops, fwd_bwd_ms, bwd_ms (graph variants, host_ms) and the checks."""
    import triton.testing
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    names = list(shape_names or WINDOW_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    attempt = row_attempts(log)
    for name in names:
        shape = WINDOW_SHAPES[name]
        spec, window = shape.spec("mean").replace(backend="auto"), shape.window
        q, k, v = (x.requires_grad_() for x in shape.inputs(device, dtype))
        leaves, grad = [q, k, v], torch.randn_like(q)
        flops = 4 * shape.head_dim * window_pairs(shape.n_q, window) * shape.batch * shape.heads_q

        def record(impl, fn, timed_leaves=leaves, windowed=True, **extra):
            """A row of `fn`'s times; `windowed`: it computes the window, and its TFLOP/s count the window's pairs."""
            fwd = triton.testing.do_bench(fn, return_mode="median")
            row = dict(shape=name, impl=impl, fwd_ms=fwd, **(dict(fwd_tflops=flops / fwd / 1e9) if windowed else {}),
                       **_timed(fn, timed_leaves, grad, log, f"{name} {impl}"), **extra)
            rows.append(row)
            tflops = f" ({row['fwd_tflops']:6.1f} TFLOP/s)" if windowed else ""
            log(f"{name:7s} {impl:34s} fwd {fwd:8.3f} ms{tflops}  fwd+bwd "
                f"{row['fwd_bwd_ms']:8.3f} ms (graph {row['fwd_bwd_graph_ms'] or float('nan'):8.3f})  "
                + " ".join(f"{key}={value}" for key, value in extra.items()))
            _dump_rows(rows, out_dir, "window.json")

        attn, given = get_kernel(spec), get_kernel(spec.replace(selector="given"))
        with torch.no_grad():
            lists = given.prepare(attn.select(q, k), shape.n_q, shape.n_k)

        def ours():
            return attn(q, k, v)

        def ours_prepared():
            return given(q, k, v, block_idx=lists)

        first, second = _grads(ours, leaves, grad), _grads(ours, leaves, grad)
        served = attn.served("attn", shape.n_k, dtype, device).backend.name
        record("kernelgen (window, selects)", ours, deterministic=all(map(torch.equal, first, second)),
               fwd_backend=served)
        record("kernelgen (window, prepared lists)", ours_prepared)
        for other in window_backends(spec, device, served):  # what auto did not serve, over the same lists

            def pinned_row(other=other):
                pinned = get_kernel(spec.replace(selector="given", backend=other))
                with torch.no_grad():
                    o_diff = _rel_diff(pinned(q, k, v, block_idx=lists), ours_prepared())
                record(f"kernelgen (window, prepared lists, {other})", lambda: pinned(q, k, v, block_idx=lists),
                       fwd_backend=other, o_rel_diff_vs_kernelgen=f"{o_diff:.1e}")

            attempt(name, f"kernelgen on {other}", pinned_row)

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        try:
            block_mask = create_block_mask(sliding, None, None, shape.n_q, shape.n_k, device=device)
            flex_compiled = torch.compile(flex_attention, dynamic=False)

            def flex():
                return flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=spec.gqa_group > 1)

            with torch.no_grad():
                o_diff = _rel_diff(ours(), flex())
            grad_diff = max(_rel_diff(a, b) for a, b in zip(first, _grads(flex, leaves, grad)))
            record("flex (sliding-window BlockMask)", flex, o_rel_diff_vs_kernelgen=f"{o_diff:.1e}",
                   grad_rel_diff_vs_kernelgen=f"{grad_diff:.1e}")
        except Exception as error:  # report, never hide
            log(f"{name}: FlexAttention failed: {type(error).__name__}: {str(error)[:200]}")
        anchor = sdpa_dense_anchors(q, k, v, spec)[0]  # cuDNN, dense causal (no window)
        try:
            with sdpa_kernel(anchor.backend):
                record("sdpa cudnn (dense causal, no window)", anchor.fn, list(anchor.leaves), windowed=False)
        except Exception as error:
            log(f"{name}: {anchor.label} failed: {type(error).__name__}: {str(error)[:200]}")
        del q, k, v, anchor, grad, lists, first, second
        torch.cuda.empty_cache()
        _decode_step_rows(name, shape, spec, rows, out_dir, log)
        torch.cuda.empty_cache()
    return rows


def _decode_step_rows(name, shape, spec, rows, out_dir, log) -> None:
    """The decode step's rows (module docstring), appended to `rows`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..reference import scatter_pages

    device, dtype, n, window = torch.device("cuda"), torch.bfloat16, shape.n_k, shape.window
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(DECODE_BATCH, shape.heads_q, 1, shape.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(DECODE_BATCH, shape.heads_kv, n, shape.head_dim, generator=gen, device=device, dtype=dtype)
            for _ in range(2))
    lens = torch.full((DECODE_BATCH,), n, dtype=torch.int32, device=device)
    attn = get_kernel(spec)
    order = torch.randperm(DECODE_BATCH * n // spec.kv_block, generator=torch.Generator().manual_seed(0))
    table = order.view(DECODE_BATCH, -1).to(device=device, dtype=torch.int32)
    k_pages, v_pages = (scatter_pages(x, spec.kv_block, order.to(device)) for x in (k, v))
    with torch.no_grad():
        ours = attn(q, k, v, cache_seqlens=lens)
    attempt = row_attempts(log)

    def record(impl, call, **extra):
        with torch.no_grad():
            ms, graph_ms, host = _bench(call), _bench_graph(call, log=log), host_ms(call)
            diff = _rel_diff(call(), ours)
        rows.append(dict(shape=name, impl=f"decode: {impl}", ms=ms, graph_ms=graph_ms, host_ms=host,
                         rel_diff_vs_kernelgen=f"{diff:.1e}", **extra))
        log(f"{name:7s} decode {impl:40s} {ms * 1e3:8.1f} us (graph {(graph_ms or float('nan')) * 1e3:8.1f} us, "
            f"host {host * 1e3:6.1f} us) diff {diff:.1e}")
        _dump_rows(rows, out_dir, "window.json")

    attempt(name, "kernelgen", lambda: record("kernelgen (cache_seqlens)", lambda: attn(q, k, v, cache_seqlens=lens),
                                              decode_backend=attn.served("decode", n, dtype, device).backend.name))
    attempt(name, "kernelgen paged", lambda: record("kernelgen (block_table, a block a page)", lambda: attn(
        q, k_pages, v_pages, block_table=table, cache_seqlens=lens)))

    def flex_row():
        def sliding(b, h, q_idx, kv_idx):
            last = q_idx + n - 1  # the query's own position: the cache's last key
            return (kv_idx <= last) & (kv_idx > last - window)

        block_mask = create_block_mask(sliding, None, None, 1, n, device=device)
        flex = torch.compile(flex_attention, dynamic=False)  # its decoding kernel, at its own options
        record("flex (sliding-window BlockMask)", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True))

    attempt(name, "flex", flex_row)
    kw, vw = (x[:, :, n - window:].contiguous() for x in (k, v))
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, kw, vw, enable_gqa=True)

        attempt(name, f"sdpa {label}", lambda label=label, sdpa=sdpa: record(
            f"sdpa {label} (the window's keys, sliced)", sdpa))

"""`kernelgen bench --window`: sliding-window attention, kernelgen against FlexAttention and dense SDPA.

For each shape (`workloads.WINDOW_SHAPES`), in one process on one GPU (bf16): kernelgen's window spec
(`Spec.window`; its lists are the window's blocks), called as a model calls it (selection included) and over
lists prepared once; FlexAttention (torch.compile'd) over the BlockMask that `create_block_mask` builds from the
sliding-window mask_mod, at Flex's own 128x128 blocks; dense causal SDPA on cuDNN, which has no window (the work
a model pays without one). Forward, and forward+backward (`bench.backward`'s timing: do_bench medians, eager and
replayed from a CUDA graph). kernelgen's o and gradients are compared with Flex's (relative L2), and two
backward runs bit for bit. TFLOP/s count the window's visible (query, key) pairs, 4 * D FLOP each forward.
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..workloads import WINDOW_SHAPES
from .anchors import sdpa_dense_anchors
from .backward import _grads, _timed
from .measure import _dump_rows, _rel_diff

__all__ = ["run_window"]


def window_pairs(n: int, window: int) -> int:
    """Visible (query, key) pairs of one head of causal self-attention over n tokens with a sliding window."""
    inside = min(n, window)
    return inside * (inside + 1) // 2 + (n - inside) * window


def run_window(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_ms, fwd_tflops, fwd_bwd_ms, bwd_ms (graph variants, host_ms) and the checks."""
    import triton.testing
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    names = list(shape_names or WINDOW_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
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
        record("kernelgen (window, selects)", ours, deterministic=all(map(torch.equal, first, second)),
               fwd_backend=attn.served("attn", shape.n_k, dtype, device).backend.name)
        record("kernelgen (window, prepared lists)", ours_prepared)

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
    return rows

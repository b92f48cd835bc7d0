"""`kernelgen bench --backward`: the training step's attention, kernelgen against FlexAttention and SDPA.

For each shape, in one process on one GPU (bf16): kernelgen's forward+backward and backward alone, over
the `mean` selector's lists prepared once; FlexAttention (torch.compile'd) over a BlockMask of exactly
those lists, forward+backward and backward alone; dense SDPA on cuDNN, forward+backward. do_bench
medians, gradients set to None between calls; the backward alone is forward+backward less the forward.
The same step replayed from a CUDA graph (`fwd_bwd_graph_ms`, `bwd_graph_ms`) leaves the host's launch
cost out: on a small shape the eager figure is the host's, not the kernels'; `host_ms` is the host's time
to enqueue one step. kernelgen's gradients are
compared with Flex's (relative L2), and two backward runs are compared bit for bit (`deterministic`). The
"+ sinks" rows add attention sinks (a learned logit per query head, which gets its gradient too): kernelgen's
`sinks=`, and Flex's (o, lse) renormalised by the same `kernelgen.sinks.with_sinks`, as transformers' Flex path
does it.
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..sinks import with_sinks
from ..workloads import SHAPES
from .anchors import flex_block_mask, flex_call, sdpa_dense_anchors
from .measure import _bench_graph, _dump_rows, _rel_diff, host_ms

__all__ = ["run_backward", "BACKWARD_SHAPES"]

BACKWARD_SHAPES = ("b16k", "c", "a32k")


def _timed(fn, leaves, grad, log=print, label: str = "") -> dict:
    """The row's times: fwd+bwd and bwd ms of `fn` (returns o) with o.backward(grad), eager and replayed from a
    CUDA graph (None where the step cannot be captured, logged under `label`). The backward alone is the
    difference from the forward timed with its graph recorded: a compiled backward (Flex's) cannot be
    replayed on a retained graph."""
    import triton.testing

    def step():
        fn().backward(grad)

    def graph_step():  # no .grad to accumulate into: a captured step allocates from the graph's pool
        return torch.autograd.grad(fn(), leaves, grad)

    both = triton.testing.do_bench(step, grad_to_none=leaves, return_mode="median")
    fwd = triton.testing.do_bench(fn, return_mode="median")
    host = _host_ms(step, leaves)

    def labelled(message):
        log(f"{label}: {message}" if label else message)

    both_graph, fwd_graph = _bench_graph(graph_step, log=labelled), _bench_graph(fn, log=labelled)
    bwd_graph = None if both_graph is None or fwd_graph is None else both_graph - fwd_graph
    return dict(fwd_bwd_ms=both, bwd_ms=both - fwd, fwd_bwd_graph_ms=both_graph, bwd_graph_ms=bwd_graph,
                host_ms=host)


def _host_ms(step, leaves) -> float:
    """`measure.host_ms` of a training step, its leaves' gradients cleared before each step and after."""
    def clear():
        for x in leaves:
            x.grad = None

    host = host_ms(step, before=clear)
    clear()
    return host


def _grads(fn, leaves, grad):
    for x in leaves:
        x.grad = None
    fn().backward(grad)
    return [x.grad.clone() for x in leaves]


def run_backward(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_bwd_ms, bwd_ms (and rel_diff / deterministic where they apply)."""
    names = list(shape_names or BACKWARD_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []

    def record(name, impl, times, **extra):
        rows.append(dict(shape=name, impl=impl, **times, **extra))

        def ms(key):
            graph = times[key.replace("_ms", "_graph_ms")]
            return f"{times[key]:8.3f} ms" + ("" if graph is None else f" (graph {graph:8.3f})")

        log(f"{name:8s} {impl:28s} fwd+bwd {ms('fwd_bwd_ms')}  bwd {ms('bwd_ms')}  host {times['host_ms']:7.3f} ms "
            + " ".join(f"{k}={v}" for k, v in extra.items()))
        _dump_rows(rows, out_dir, "backward.json")

    for name in names:
        shape = SHAPES[name]
        spec, given = shape.spec("mean"), shape.spec("given")
        q, k, v = (x.requires_grad_() for x in shape.inputs(device, dtype))
        leaves = [q, k, v]
        grad = torch.randn_like(q)
        with torch.no_grad():
            idx = get_kernel(spec).select(q, k)
        attn = get_kernel(given.replace(backend="auto"))
        lists = attn.prepare(idx, shape.n_q, shape.n_k)

        def ours():
            return attn(q, k, v, block_idx=lists)

        first, second = _grads(ours, leaves, grad), _grads(ours, leaves, grad)
        deterministic = all(torch.equal(a, b) for a, b in zip(first, second))
        record(name, "kernelgen (auto)", _timed(ours, leaves, grad, log, f"{name} kernelgen"),
               deterministic=deterministic,
               fwd_backend=attn.served("attn", shape.n_k, dtype, device).backend.name,
               dkdv_backend=attn.served("bwd_dkdv", shape.n_k, dtype, device).backend.name)
        sinks = torch.randn(q.shape[1], device=device).requires_grad_()

        def ours_with_sinks():
            return attn(q, k, v, block_idx=lists, sinks=sinks)

        sunk = _grads(ours_with_sinks, leaves + [sinks], grad)
        record(name, "kernelgen (auto) + sinks", _timed(ours_with_sinks, leaves + [sinks], grad, log,
                                                        f"{name} kernelgen + sinks"),
               deterministic=all(torch.equal(a, b) for a, b in zip(sunk, _grads(ours_with_sinks, leaves + [sinks],
                                                                                 grad))))
        try:
            block_mask = flex_block_mask(idx, spec, shape)
            flex = flex_call(q, k, v, block_mask, spec)
            flex_grads = _grads(flex, leaves, grad)
            diff = max(_rel_diff(a, b) for a, b in zip(first, flex_grads))
            record(name, "flex (same BlockMask)", _timed(flex, leaves, grad, log, f"{name} flex"),
                   grad_rel_diff_vs_kernelgen=f"{diff:.1e}")
            flex_lse = flex_call(q, k, v, block_mask, spec, return_lse=True)

            def flex_with_sinks():
                return with_sinks(*flex_lse(), sinks)[0]

            flex_grads = _grads(flex_with_sinks, leaves + [sinks], grad)
            diff = max(_rel_diff(a, b) for a, b in zip(sunk, flex_grads))
            record(name, "flex + sinks (through lse)", _timed(flex_with_sinks, leaves + [sinks], grad, log,
                                                              f"{name} flex + sinks"),
                   grad_rel_diff_vs_kernelgen=f"{diff:.1e}")
        except Exception as error:  # report, never hide (Flex has no backward at 64x64 blocks)
            log(f"{name}: FlexAttention fwd+bwd failed: {type(error).__name__}: {str(error)[:200]}")
        from torch.nn.attention import sdpa_kernel

        anchor = sdpa_dense_anchors(q, k, v, spec)[0]  # cuDNN
        try:
            with sdpa_kernel(anchor.backend):
                times = _timed(anchor.fn, list(anchor.leaves), grad, log, f"{name} {anchor.label}")
            record(name, anchor.label, times)
        except Exception as error:
            log(f"{name}: {anchor.label} fwd+bwd failed: {type(error).__name__}: {str(error)[:200]}")
        del anchor
        del q, k, v, grad, lists, first, second, sunk, sinks
        torch.cuda.empty_cache()
    return rows

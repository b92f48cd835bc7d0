"""`kernelgen bench --softcap`: logit soft-capping, kernelgen against FlexAttention with a tanh score_mod.

For each shape (`workloads.SOFTCAP_SHAPES`), in one process on one GPU (bf16): kernelgen's capped spec
(`Spec.softcap`) over the `mean` selector's lists prepared once, served by `auto`, and the same lists without the
cap (what the cap costs); FlexAttention (torch.compile'd) over a BlockMask of exactly those lists (`to_block_mask`:
a window spec's keeps its window), with the score_mod that caps (`softcap * tanh(score / softcap)`, as transformers'
Flex path applies Gemma 2's) and without it. Forward, and forward+backward (`bench.backward`'s timing: do_bench
medians, eager and replayed from a CUDA graph). kernelgen's o and gradients are compared with capped Flex's
(relative L2), and two backward runs bit for bit.

    kernelgen bench --softcap [--shapes c_cap50] [--out DIR]
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..workloads import SOFTCAP_SHAPES
from .anchors import flex_block_mask, flex_call
from .backward import _grads, _timed
from .measure import _bench, _dump_rows, _rel_diff, row_attempts

__all__ = ["run_softcap"]


def run_softcap(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_ms, fwd_bwd_ms, bwd_ms (graph variants, host_ms) and the checks."""
    names = list(shape_names or SOFTCAP_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    attempt = row_attempts(log)
    for name in names:
        shape = SOFTCAP_SHAPES[name]
        spec = shape.spec("mean").replace(backend="auto")
        q, k, v = (x.requires_grad_() for x in shape.inputs(device, dtype))
        leaves, grad = [q, k, v], torch.randn_like(q)

        def record(impl, fn, **extra):
            fwd = _bench(fn)
            row = dict(shape=name, impl=impl, fwd_ms=fwd, **_timed(fn, leaves, grad, log, f"{name} {impl}"), **extra)
            rows.append(row)
            log(f"{name:10s} {impl:32s} fwd {fwd:8.3f} ms  fwd+bwd {row['fwd_bwd_ms']:8.3f} ms (graph "
                f"{row['fwd_bwd_graph_ms'] or float('nan'):8.3f})  " + " ".join(f"{k}={v}" for k, v in extra.items()))
            _dump_rows(rows, out_dir, "softcap.json")

        given = spec.replace(selector="given")
        with torch.no_grad():
            lists = get_kernel(spec).select(q, k)
        capped = get_kernel(given)
        prepared = capped.prepare(lists, shape.n_q, shape.n_k)
        uncapped = get_kernel(given.replace(softcap=None))

        def ours():
            return capped(q, k, v, block_idx=prepared)

        first, second = _grads(ours, leaves, grad), _grads(ours, leaves, grad)
        record("kernelgen (softcap)", ours, deterministic=all(map(torch.equal, first, second)),
               fwd_backend=capped.served("attn", shape.n_k, dtype, device).backend.name)
        record("kernelgen (no cap, same lists)", lambda: uncapped(q, k, v, block_idx=prepared))
        cap = shape.softcap

        def capping(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        def flex_rows():
            block_mask = flex_block_mask(lists, given, shape)
            flex = flex_call(q, k, v, block_mask, given, score_mod=capping)
            with torch.no_grad():
                o_diff = _rel_diff(ours(), flex())
            grad_diff = max(_rel_diff(a, b) for a, b in zip(first, _grads(flex, leaves, grad)))
            record("flex (same BlockMask, tanh score_mod)", flex, o_rel_diff_vs_kernelgen=f"{o_diff:.1e}",
                   grad_rel_diff_vs_kernelgen=f"{grad_diff:.1e}")
            record("flex (same BlockMask, no cap)", flex_call(q, k, v, block_mask, given))

        attempt(name, "flex", flex_rows)
        del q, k, v, grad, lists, prepared, first, second
        torch.cuda.empty_cache()
    return rows

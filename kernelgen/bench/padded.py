"""`kernelgen bench --padded`: a right-padded batch (a training batch, or a prompt batch), kernelgen against
the ways to run it without `seqlens=`; and sequences packed in one row (`attn.varlen`, shape packed_32k).

For each shape, in one process on one GPU (bf16; B8 Hq32 Hkv8 D128, causal, the `mean` selector, 128-key
blocks, top-16, one sink and two local blocks; rows of N tokens down to about N/2, right-padded to N), under
each schedule (Q-centric lists, then per-query lists): kernelgen's one call with `seqlens=`; a kernelgen call
per row (what a padded batch costs without it); then
SDPA with the padding mask, as transformers builds it (causal AND each row's tokens: SDPA's
memory-efficient kernel); and dense SDPA on cuDNN over the whole padded batch, padding included. Forward and
forward+backward, do_bench medians, gradients set to None between calls. The one call's output is compared
with the calls per row over each row's tokens (`max_abs_vs_rows`: 0 when they agree bit for bit).

Packed (packed_32k: sequences of 12288, 8192, 6144, 3072, 2048 and 1024 tokens, 32768 in all, one after another,
the same heads and spec): `attn.varlen` under each schedule; a kernelgen call per sequence; one kernelgen call
over the whole row as one sequence (what packing costs when the bounds are ignored: not the same attention);
SDPA with the block-diagonal causal mask transformers builds for such a batch (memory-efficient kernel); and
dense causal SDPA on cuDNN over the row (bounds ignored).
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..errors import KernelgenRuntimeError
from ..spec import Spec
from .measure import _dump_rows, row_attempts

__all__ = ["run_padded", "PADDED_SHAPES"]

PADDED_SHAPES = {"pad_b8_8k": 8192, "pad_b8_16k": 16384, "packed_32k": 32768}
PACKED_LENGTHS = {"packed_32k": (12288, 8192, 6144, 3072, 2048, 1024)}
BATCH, HEADS_KV, GROUP, HEAD_DIM = 8, 8, 4, 128
SPEC = Spec(head_dim=HEAD_DIM, kv_block=128, top_k=16, causal=True, gqa_group=GROUP, sink=1, local=2)
SCHEDULES = {"": SPEC, " kv_centric": SPEC.replace(schedule="kv_centric")}  # row label suffix: spec


def _lengths(n: int) -> list[int]:
    """N down to about N/2, evenly; every row but the first 37 tokens shorter still."""
    return [n - i * (n // 2) // (BATCH - 1) - (i > 0) * 37 for i in range(BATCH)]


def run_padded(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_ms, fwd_bwd_ms (and max_abs_vs_rows for kernelgen's one call); with `out_dir`,
    also padded.json there."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("bench --padded needs a CUDA GPU: it times kernels")
    rows: list[dict] = []
    attempt = row_attempts(log)
    kernels = {label: get_kernel(spec) for label, spec in SCHEDULES.items()}
    for name in shape_names or PADDED_SHAPES:
        if name in PACKED_LENGTHS:
            _run_packed(name, kernels, rows, attempt, out_dir, log)
            continue
        n = PADDED_SHAPES[name]
        lengths = _lengths(n)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(BATCH, h, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for h in (HEADS_KV * GROUP, HEADS_KV, HEADS_KV))
        grad = torch.randn_like(q)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        positions = torch.arange(n, device="cuda")
        tokens = positions[None, :] < seqlens[:, None]  # [B, N]
        mask = (positions[None, :, None] >= positions[None, None, :]) & tokens[:, None, :]  # causal AND the row's
        kd, vd = (x.detach().repeat_interleave(GROUP, 1).requires_grad_() for x in (k, v))

        def one_call(attn):
            return lambda: attn(q, k, v, seqlens=seqlens)

        def per_row(attn):
            return lambda: torch.cat([torch.nn.functional.pad(
                attn(q[b:b + 1, :, :m], k[b:b + 1, :, :m], v[b:b + 1, :, :m]), (0, 0, 0, n - m))
                for b, m in enumerate(lengths)])

        def sdpa_masked():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, attn_mask=mask[:, None])

        def sdpa_dense():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True)

        impls = []
        for label, attn in kernels.items():
            batched, each_row = one_call(attn), per_row(attn)
            with torch.no_grad():
                got, want = batched(), each_row()
            impls += [(f"kernelgen{label} (seqlens, one call)", batched,
                       {"max_abs_vs_rows": (got - want).abs().max().item()}),
                      (f"kernelgen{label} (a call per row)", each_row, {})]
        _time(rows, name, n, lengths, (*impls, ("sdpa efficient (padding mask)", sdpa_masked, {}),
                                       ("sdpa cudnn (dense, padding computed)", sdpa_dense, {})),
              grad, (q, k, v, kd, vd), attempt, out_dir, log)
    return rows


def _run_packed(name, kernels, rows, attempt, out_dir, log) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = PACKED_LENGTHS[name]
    n = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (HEADS_KV * GROUP, HEADS_KV, HEADS_KV))
    grad = torch.randn_like(q)
    bounds = torch.tensor((0, *lengths), device="cuda").cumsum(0).to(torch.int32)
    starts = bounds[:-1].tolist()
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
    positions = torch.arange(n, device="cuda")
    mask = (sequence[:, None] == sequence[None, :]) & (positions[:, None] >= positions[None, :])
    row = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, H, N, D] views of the packed tensors
    kd, vd = (x.detach().repeat_interleave(GROUP, 1).requires_grad_() for x in row[1:])

    def per_sequence(attn):
        return lambda: torch.cat([attn(*(x[:, :, s:s + m] for x in row))[0].transpose(0, 1)
                                  for s, m in zip(starts, lengths)])

    def sdpa(backend, **options):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(row[0], kd, vd, **options)
        return call

    impls = []
    for label, attn in kernels.items():
        packed, each = (lambda attn=attn: attn.varlen(q, k, v, bounds)), per_sequence(attn)
        with torch.no_grad():
            got, want = packed(), each()
        impls += [(f"kernelgen{label} (varlen)", packed, {"max_abs_vs_sequences": (got - want).abs().max().item()}),
                  (f"kernelgen{label} (a call per sequence)", each, {}),
                  (f"kernelgen{label} (one sequence: bounds ignored)", lambda attn=attn: attn(*row), {})]
    impls += [("sdpa efficient (block-diagonal mask)", sdpa(SDPBackend.EFFICIENT_ATTENTION, attn_mask=mask), {}),
              ("sdpa cudnn (dense causal, bounds ignored)", sdpa(SDPBackend.CUDNN_ATTENTION, is_causal=True), {})]
    _time(rows, name, n, list(lengths), impls, grad.transpose(0, 1)[None], (q, k, v, kd, vd), attempt, out_dir,
          log, packed_grad=grad)


def _time(rows, name, n, lengths, impls, grad, leaves, attempt, out_dir, log, packed_grad=None) -> None:
    """Time each (impl, fn, extra): forward and forward+backward, do_bench medians, the gradients of `leaves`
    set to None between calls; `packed_grad`: dO for outputs in the packed layout ([total, H, D])."""
    import triton.testing

    for impl, fn, extra in impls:
        def timed(impl=impl, fn=fn, extra=extra):
            with torch.no_grad():
                fwd = triton.testing.do_bench(fn, return_mode="median")

            def backward():
                o = fn()
                o.backward(packed_grad if packed_grad is not None and o.dim() == 3 else grad)
            both = triton.testing.do_bench(backward, grad_to_none=leaves, return_mode="median")
            rows.append(dict(shape=name, impl=impl, n=n, lengths=lengths, fwd_ms=round(fwd, 4),
                             fwd_bwd_ms=round(both, 4), **extra))
            log(f"{name:11s} {impl:49s} fwd {fwd:8.3f} ms  fwd+bwd {both:8.3f} ms "
                + " ".join(f"{key}={value}" for key, value in extra.items()))
            _dump_rows(rows, out_dir, "padded.json")

        attempt(name, impl, timed)

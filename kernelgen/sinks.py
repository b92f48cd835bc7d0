"""Attention sinks: a learned logit per query head that joins each row's softmax with no value (gpt-oss's and
DeepSeek-V4's `sinks`, transformers' `s_aux`).

With sink `s_h`, row i of head h attends with weights exp(score_ij - lse'_i) over its keys, where lse'_i =
log(exp(s_h) + sum_j exp(score_ij)): the row's output shrinks by exp(lse_i - lse'_i), its lse becomes lse'_i. That
is a merge of the attention with a keyless part of lse s_h, so it runs after the kernels on their (o, lse), and
autograd takes it back to them through lse's gradient (docs/SEMANTICS.md, "Attention sinks").
"""
from __future__ import annotations

import torch

from .errors import KernelgenTypeError, KernelgenValueError

__all__ = ["check_sinks", "with_sinks"]


def check_sinks(sinks, heads: int, device: torch.device) -> torch.Tensor:
    """`sinks`, a floating tensor [Hq] (one logit per query head) on the call's device."""
    if not isinstance(sinks, torch.Tensor):
        raise KernelgenTypeError(f"sinks must be a tensor [Hq] of one logit per query head, got {type(sinks).__name__}")
    if sinks.layout != torch.strided:
        raise KernelgenTypeError(f"sinks must be a dense (strided) tensor, got layout {sinks.layout}")
    if sinks.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise KernelgenTypeError(f"sinks must be float32, float16 or bfloat16, got {sinks.dtype}")
    if sinks.shape != (heads,):
        raise KernelgenValueError(f"sinks.shape = {tuple(sinks.shape)}; expected ({heads},): one logit per query "
                                  "head")
    if sinks.device != device:
        raise KernelgenValueError(f"sinks is on {sinks.device}; expected q's device, {device}")
    return sinks


def with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of attention whose rows' softmax also holds their head's sink logit. Heads are dim 1 of both
    ([B, Hq, N, D] and [B, Hq, N], or a varlen call's [total, Hq, D] and [total, Hq]). A row without a visible
    key keeps o = 0 and takes lse = its sink. Differentiable in o, lse and sinks."""
    shape = [1] * lse.dim()
    shape[1] = -1
    total = torch.logaddexp(lse, sinks.float().view(shape))
    # exp(lse - total) is 0 where lse = -inf, and where a sink is +inf; total = -inf only for a -inf sink over no
    # key, whose o stays 0
    weight = torch.exp(lse - total.masked_fill(total == float("-inf"), 0.0))
    return o * weight.unsqueeze(-1).to(o.dtype), total

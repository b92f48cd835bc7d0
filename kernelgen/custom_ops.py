"""kernelgen as torch.library custom ops, so that torch.compile traces through it without graph breaks.

    from kernelgen.custom_ops import sparse_attention, select_blocks
    o, lse = sparse_attention(q, k, v, spec, block_idx=None, scale=None)   # inside torch.compile too
    o, lse = sparse_attention(q, k, v, spec, index=(q_idx, k_idx, w))      # Spec(selector="index")
    o, lse = sparse_attention(q, k_cache, v_cache, spec, cache_seqlens=lens)  # decode over per-row lengths

The ops take the spec as its JSON text, and the index selector's tensors as three optional arguments (a string is a valid op argument; a dataclass is not) and
dispatch to `get_kernel(spec)`, so they run exactly the kernels and checks of the eager API. Their
fake (meta) implementations give output shapes and dtypes without running anything.

`kernelgen::sparse_attention` backpropagates (`torch.library.register_autograd`): it also returns the lists
it attended over (in the kernels' form; given or selected), which its backward, the op
`kernelgen::sparse_attention_backward`, reads instead of selecting again. lse carries no gradient.
"""
from __future__ import annotations

import torch

from .dispatch import get_kernel
from .inputs import autocast_qkv, refuse_grad_with_seqlens
from .spec import Spec

__all__ = ["sparse_attention", "select_blocks"]


def _index(q_idx, k_idx, w):
    """The `index=` of the eager API from the ops' three optional tensors (None when none is given)."""
    return None if q_idx is None and k_idx is None and w is None else (q_idx, k_idx, w)


@torch.library.custom_op("kernelgen::select_blocks", mutates_args=())
def _select_op(q: torch.Tensor, k: torch.Tensor, spec_json: str, q_idx: torch.Tensor | None = None,
               k_idx: torch.Tensor | None = None, w: torch.Tensor | None = None) -> torch.Tensor:
    return get_kernel(Spec.from_json(spec_json)).select(q, k, index=_index(q_idx, k_idx, w))


def _lists_like(q: torch.Tensor, k: torch.Tensor, spec: Spec) -> torch.Tensor:
    return q.new_empty((q.shape[0], k.shape[1], spec.n_q_tiles(q.shape[2]), spec.top_k), dtype=torch.int32)


@_select_op.register_fake
def _(q, k, spec_json, q_idx=None, k_idx=None, w=None):
    return _lists_like(q, k, Spec.from_json(spec_json))


@torch.library.custom_op("kernelgen::sparse_attention", mutates_args=())
def _attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None, spec_json: str,
             scale: float | None, q_idx: torch.Tensor | None = None, k_idx: torch.Tensor | None = None,
             w: torch.Tensor | None = None,
             cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    attn = get_kernel(Spec.from_json(spec_json))
    shapes = attn._start_call(q, k, v)
    seqlens = attn._check_seqlens(cache_seqlens, shapes, q.device)
    return attn._forward(q, k, v, shapes, block_idx, scale, _index(q_idx, k_idx, w), seqlens=seqlens)[:3]


@_attn_op.register_fake
def _(q, k, v, block_idx, spec_json, scale, q_idx=None, k_idx=None, w=None, cache_seqlens=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32),
            _lists_like(q, k, Spec.from_json(spec_json)))


@torch.library.custom_op("kernelgen::sparse_attention_backward", mutates_args=())
def _attn_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, lists: torch.Tensor, spec_json: str,
                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return get_kernel(Spec.from_json(spec_json))._gradients(do, q, k, v, o, lse, lists, scale)


@_attn_backward_op.register_fake
def _(do, q, k, v, o, lse, lists, spec_json, scale):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, _, spec_json, scale = inputs[:6]
    o, lse, lists = output
    ctx.save_for_backward(q, k, v, o, lse, lists)
    ctx.spec_json, ctx.scale = spec_json, scale
    ctx.mark_non_differentiable(lse, lists)


def _backward(ctx, do, _dlse, _dlists):
    q, k, v, o, lse, lists = ctx.saved_tensors
    dq, dk, dv = _attn_backward_op(do, q, k, v, o, lse, lists, ctx.spec_json, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None  # nothing for block_idx, spec, scale, index, lengths


torch.library.register_autograd("kernelgen::sparse_attention", _backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _spec_json(spec: Spec) -> str:
    # computed outside the traced graph: dynamo does not trace json.dumps
    return spec.to_json()


def _index_args(index) -> tuple:
    """(q_idx, k_idx, w) of `index=` as the ops' three optional arguments; anything but a triple is left to
    the eager API's check (`inputs.check_index`) to name."""
    if index is None:
        return None, None, None
    if isinstance(index, (tuple, list)) and len(index) == 3:
        return tuple(index)
    from .inputs import INDEX_LAYOUT
    from .errors import KernelgenTypeError

    raise KernelgenTypeError(f"index must be a tuple (q_idx, k_idx, w), got {type(index).__name__}; {INDEX_LAYOUT}")


def select_blocks(q: torch.Tensor, k: torch.Tensor, spec: Spec, index=None) -> torch.Tensor:
    """`get_kernel(spec).select(q, k, index=...)` as a custom op."""
    q, k, _ = autocast_qkv(q, k, k)
    return _select_op(q, k, _spec_json(spec), *_index_args(index))


def sparse_attention(q, k, v, spec: Spec, block_idx=None, scale=None, index=None,
                     cache_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_kernel(spec)(q, k, v, block_idx=..., index=..., scale=..., cache_seqlens=..., return_lse=True)` as a
    custom op; o backpropagates (lse carries no gradient; a call with cache_seqlens has no backward)."""
    q, k, v = autocast_qkv(q, k, v)
    refuse_grad_with_seqlens(cache_seqlens, q, k, v)
    o, lse, _ = _attn_op(q, k, v, block_idx, _spec_json(spec), None if scale is None else float(scale),
                         *_index_args(index), cache_seqlens)
    return o, lse

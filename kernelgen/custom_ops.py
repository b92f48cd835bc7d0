"""kernelgen as torch.library custom ops, so that torch.compile traces through it without graph breaks.

    from kernelgen.custom_ops import sparse_attention, select_blocks
    o, lse = sparse_attention(q, k, v, spec, block_idx=None, scale=None)   # inside torch.compile too

The ops take the spec as its JSON text (a string is a valid op argument; a dataclass is not) and
dispatch to `get_kernel(spec)`, so they run exactly the kernels and checks of the eager API. Their
fake (meta) implementations give output shapes and dtypes without running anything.
"""
from __future__ import annotations

import torch

from .dispatch import get_kernel
from .spec import Spec

__all__ = ["sparse_attention", "select_blocks"]


@torch.library.custom_op("kernelgen::select_blocks", mutates_args=())
def _select_op(q: torch.Tensor, k: torch.Tensor, spec_json: str) -> torch.Tensor:
    return get_kernel(Spec.from_json(spec_json)).select(q, k)


@_select_op.register_fake
def _(q, k, spec_json):
    spec = Spec.from_json(spec_json)
    shape = (q.shape[0], k.shape[1], spec.n_q_tiles(q.shape[2]), spec.top_k)
    return q.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("kernelgen::sparse_attention", mutates_args=())
def _attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None, spec_json: str,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return get_kernel(Spec.from_json(spec_json))(q, k, v, block_idx=block_idx, scale=scale, return_lse=True)


@_attn_op.register_fake
def _(q, k, v, block_idx, spec_json, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.compiler.assume_constant_result
def _spec_json(spec: Spec) -> str:
    # computed outside the traced graph: dynamo does not trace json.dumps
    return spec.to_json()


def select_blocks(q: torch.Tensor, k: torch.Tensor, spec: Spec) -> torch.Tensor:
    """`get_kernel(spec).select(q, k)` as a custom op."""
    return _select_op(q, k, _spec_json(spec))


def sparse_attention(q, k, v, spec: Spec, block_idx=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_kernel(spec)(q, k, v, block_idx=..., scale=..., return_lse=True)` as a custom op."""
    return _attn_op(q, k, v, block_idx, _spec_json(spec), None if scale is None else float(scale))

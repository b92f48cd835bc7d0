"""Selection across shards: a rank's lists equal the rows one GPU would select for its Q tiles.

The pooled selectors ("mean", "multi:r") score a Q tile against each block's representatives (group means
of its keys). Every rank pools its own K blocks and the representatives are all-gathered (float32
`[B, Hkv, n_kv_blocks, r, D]`: a kv_block-th of K's size), then the `select` role's kernel runs on global
shapes, with this rank's Q tile representatives at their global tile ids (the other tiles' lists are
computed and dropped: selection costs P times one rank's share, small next to the attention). Pooling a
tile or block inside a shard is the same arithmetic as inside the whole sequence, so the lists are the
single-GPU ones, ties included.
"""
from __future__ import annotations

import torch

from ..backends.triton import pool_reps, select_from_reps
from ..dispatch import get_kernel
from ..errors import KernelgenValueError
from ..inputs import Shapes
from ..spec import Spec
from .comm import Group
from .layout import Layout

__all__ = ["select_rows", "check_selects_across_shards"]


def check_selects_across_shards(spec: Spec) -> None:
    """A ValueError unless the spec's selector can choose a rank's lists across shards."""
    if not spec.selects:
        raise KernelgenValueError("spec.selector='given' selects nothing: its lists are the caller's, passed to "
                                  "attention(..., block_idx=) (global block ids)")
    if spec.selection_role != "select":
        raise KernelgenValueError(
            f"spec.selector={spec.selector!r} cannot select across shards (the pooled selectors 'mean' and "
            "'multi:r' can); pass block_idx= (global block ids)")


def select_rows(q: torch.Tensor, k: torch.Tensor, spec: Spec, layout: Layout, group: Group) -> torch.Tensor:
    """int32 [B, Hkv, this rank's Q tiles, top_k]: global block ids, the single-GPU selection's rows of this
    rank's tiles (in shard order)."""
    check_selects_across_shards(spec)
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    served = get_kernel(spec).served("select", layout.n, q.dtype, q.device)
    mod, kspec = served.kernel, served.spec
    k_rep = pool_reps(mod, kspec, k, spec.kv_block)
    n_blocks, n_tiles = layout.n // spec.kv_block, layout.n // spec.q_tile
    k_all = k_rep.new_empty(b, hkv, n_blocks, *k_rep.shape[3:])
    for s, part in enumerate(group.all_gather(k_rep)):
        k_all[:, :, layout.global_ids(spec.kv_block, s, q.device)] = part
    tiles = layout.global_ids(spec.q_tile, device=q.device)
    q_rep = pool_reps(mod, kspec, q, spec.q_tile)
    q_all = q_rep.new_zeros(b, hq, n_tiles, *q_rep.shape[3:])
    q_all[:, :, tiles] = q_rep
    shapes = Shapes(b, hq, hkv, layout.n, layout.n, n_tiles, n_blocks)
    return select_from_reps(mod, kspec, served.config, shapes, q_all, k_all)[:, :, tiles].contiguous()

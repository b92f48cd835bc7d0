"""Selection across shards: a rank's lists equal the rows one GPU would select for its Q tiles.

The pooled selectors ("mean", "multi:r") score a Q tile against each block's representatives (group means
of its keys). Every rank pools its own K blocks and the representatives are all-gathered (float32
`[B, Hkv, n_kv_blocks, r, D]`: a kv_block-th of K's size), then the `select` role's kernel runs on global
shapes, with this rank's Q tile representatives at their global tile ids (the other tiles' lists are
computed and dropped: selection costs P times one rank's share, small next to the attention). Pooling a
tile or block inside a shard is the same arithmetic as inside the whole sequence, so the lists are the
single-GPU ones, ties included.

The index selector scores a Q tile's queries against every key's index vector: every rank's k_idx shard is
all-gathered (`[B, Hkv or 1, N, Di]`: Di / 2D of K and V's bytes with one shared key head), then the
`select_index` kernel runs, at the config one GPU's call is served, over each of this rank's chunks as a call
of its own: the chunk's queries the last of the keys up to its end under causal masking (a tile's visible keys,
its diagonal and its sums are then the single-GPU call's), or of all keys under a full mask. A full mask with
local blocks places a tile's local blocks by its position in the call, so there the kernel runs over every
tile of the sequence, this rank's index vectors in place and the others' zero, and keeps this rank's tiles.
"""
from __future__ import annotations

import torch

from ..backends.triton import launch_select_index, pool_reps, select_from_reps
from ..dispatch import get_kernel
from ..errors import KernelgenValueError
from ..inputs import Shapes
from ..spec import Spec
from .comm import Group
from .layout import Layout

__all__ = ["select_rows", "select_index_rows", "check_selects_across_shards"]


def check_selects_across_shards(spec: Spec, index=None) -> None:
    """A ValueError unless the spec's selector can choose a rank's lists across shards (the index selector from
    `index`, this rank's shards of its tensors)."""
    if not spec.selects:
        raise KernelgenValueError("spec.selector='given' selects nothing: its lists are the caller's, passed to "
                                  "attention(..., block_idx=) (global block ids)")
    if spec.selector == "index":
        if index is None:
            raise KernelgenValueError("spec.selector='index' selects across shards from index=(q_idx, k_idx, w): "
                                      "this rank's shards of them, in q's layout (kernelgen.distributed.shard)")
    elif index is not None:
        raise KernelgenValueError(f"index= is the input of the 'index' selector; spec.selector={spec.selector!r} "
                                  "takes none")
    elif spec.selection_role != "select":
        raise KernelgenValueError(
            f"spec.selector={spec.selector!r} cannot select across shards (the pooled selectors 'mean' and "
            "'multi:r' and the index selector can); pass block_idx= (global block ids)")


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


def select_index_rows(q: torch.Tensor, index, spec: Spec, layout: Layout, group: Group) -> torch.Tensor:
    """`select_rows` of the index selector (the module's docstring): int32 [B, Hkv, this rank's Q tiles, top_k],
    global block ids, the single-GPU lists' rows of this rank's tiles (in shard order). `index`: this rank's
    checked shards (q_idx [B, Hkv*Hi, N/P, Di], k_idx [B, Hkv or 1, N/P, Di], w [B, Hkv*Hi, N/P])."""
    q_idx, k_idx, w = index
    b, hq = q.shape[:2]
    hkv = hq // spec.gqa_group
    served = get_kernel(spec).served("select_index", layout.n, q.dtype, q.device)
    mod, kspec, cfg = served.kernel, served.spec, served.config
    k_all = k_idx.new_empty(*k_idx.shape[:2], layout.n, k_idx.shape[3])
    for s, part in enumerate(group.all_gather(k_idx)):
        k_all[:, :, layout.positions(s, q.device)] = part
    n_blocks, n_tiles = layout.n // spec.kv_block, layout.n // spec.q_tile
    if not spec.causal and spec.n_local:  # every tile, this rank's index vectors in place
        q_all = q_idx.new_zeros(*q_idx.shape[:2], layout.n, q_idx.shape[3])
        w_all = w.new_zeros(*w.shape[:2], layout.n)
        q_all[:, :, layout.positions(device=q.device)] = q_idx
        w_all[:, :, layout.positions(device=q.device)] = w
        shapes = Shapes(b, hq, hkv, layout.n, layout.n, n_tiles, n_blocks)
        lists = launch_select_index(mod, kspec, cfg, shapes, q_all, k_all, w_all)
        return lists[:, :, layout.global_ids(spec.q_tile, device=q.device)].contiguous()
    chunk = layout.chunk
    rows = []
    for i, c in enumerate(layout.chunks()):
        n_k = (c + 1) * chunk if spec.causal else layout.n  # the chunk's queries: the last of these keys
        mine = slice(i * chunk, (i + 1) * chunk)
        shapes = Shapes(b, hq, hkv, chunk, n_k, chunk // spec.q_tile, n_k // spec.kv_block)
        rows.append(launch_select_index(mod, kspec, cfg, shapes, q_idx[:, :, mine], k_all[:, :, :n_k],
                                        w[:, :, mine]))
    return torch.cat(rows, 2)

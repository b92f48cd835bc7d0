"""The index selector in fp8 (e4m3) on Hopper, and how close its choice comes to fp32's.

    q8, k8, w8 = to_fp8_index(q_idx, k_idx, w)          # scaled into e4m3's range, the same block ranking
    overlap = fp8_index_overlap(spec, q, k, (q_idx, k_idx, w))   # on an sm_90 GPU: 1.0 = identical lists

Scaling keeps the scores' order: relu is positively homogeneous, so a positive scale c of q_idx's row (index
head a, query i) multiplies that head's term by c, which w[a, i] / c undoes exactly; one positive scale of all
of k_idx multiplies every token score alike, and the top-k is unchanged.
"""
from __future__ import annotations

import torch

from .dispatch import get_kernel
from .spec import Spec

__all__ = ["E4M3_MAX", "to_fp8_index", "fp8_index_overlap"]

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def to_fp8_index(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor):
    """(q_idx, k_idx, w) with the index vectors in float8_e4m3fn: each q_idx row and all of k_idx scaled to
    e4m3's range, w (float32) rescaled so that the token scores keep their order (the module's docstring)."""
    q = q_idx.float()
    q_scale = (E4M3_MAX / q.abs().amax(-1).clamp(min=1e-12))  # [B, H, Nq]
    k = k_idx.float()
    k_scale = E4M3_MAX / k.abs().amax().clamp(min=1e-12)
    q8 = (q * q_scale[..., None]).to(torch.float8_e4m3fn)
    k8 = (k * k_scale).to(torch.float8_e4m3fn)
    return q8, k8, (w.float() / q_scale).contiguous()


def fp8_index_overlap(spec: Spec, q: torch.Tensor, k: torch.Tensor, index) -> float:
    """The share of the blocks chosen with fp32 index vectors that the fp8 (e4m3) selector also chooses,
    over all lists (1.0: the same lists). Runs on an sm_90 GPU (elsewhere fp8 index vectors are refused)."""
    q_idx, k_idx, w = index
    attn = get_kernel(spec)
    want = attn.select(q, k, index=(q_idx.float(), k_idx.float(), w.float()))
    got = attn.select(q, k, index=to_fp8_index(q_idx, k_idx, w))
    n_blocks = spec.n_kv_blocks(k.shape[2])

    def chosen(lists):
        mask = torch.zeros(*lists.shape[:-1], n_blocks + 1, dtype=torch.bool, device=lists.device)
        mask.scatter_(-1, torch.where(lists >= 0, lists.long(), n_blocks), True)
        return mask[..., :n_blocks]

    want_mask = chosen(want)
    return float((chosen(got) & want_mask).sum() / want_mask.sum().clamp(min=1))

"""Validation, allocation and launch of the rendered kernels. No caching decisions here (dispatch)."""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .config import AttnConfig, GluonAttnConfig, SelectConfig, next_pow2
from .spec import Spec

__all__ = ["Shapes", "BlockLists", "interpreting", "check_qkv", "prepare_block_idx", "check_block_lists", "select",
           "attention", "attention_tilelang", "attention_gluon", "check_gluon_device", "softmax_scale", "LOG2E"]

LOG2E = 1.4426950408889634
# Tests set KERNELGEN_POISON=1: outputs start as NaN (lists as INT32_MIN) so unwritten elements fail.
_POISON = os.environ.get("KERNELGEN_POISON", "0") == "1"


def _empty(*shape, like=None, device=None, dtype=None):
    if like is not None:
        shape, device, dtype = like.shape, like.device, like.dtype
    if not _POISON:
        return torch.empty(*shape, device=device, dtype=dtype)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, device=device, dtype=dtype)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Shapes(NamedTuple):
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    n_q_tiles: int
    n_kv_blocks: int


class BlockLists:
    """Lists already in the kernels' form, made once by `SparseAttention.prepare` and passed as `block_idx`
    to every call that attends over them (the layers of a model, repeated steps), as FlexAttention's
    BlockMask is built once and FlashInfer plans once: such a call skips the normalising launch.

    block_idx    int32 [B, Hkv, n_q_tiles, top_k], valid ids ascending then -1: a copy, never the
                 caller's tensor (writing into it afterwards is outside the contract)
    kv_block, top_k, n_kv_blocks   what it was made for; a call with other values is a ValueError

    Only `prepare` makes them (the kernels trust their order: a hand-made one could name a block the
    kernels would read out of bounds), so the constructor refuses."""
    __slots__ = ("block_idx", "kv_block", "top_k", "n_kv_blocks")

    def __init__(self, *args, **kwargs):
        raise TypeError("BlockLists are made by SparseAttention.prepare(block_idx, seq_q, seq_k), not by hand")

    @classmethod
    def _made_by_prepare(cls, block_idx: torch.Tensor, kv_block: int, top_k: int, n_kv_blocks: int) -> BlockLists:
        lists = object.__new__(cls)
        for name, value in zip(cls.__slots__, (block_idx, kv_block, top_k, n_kv_blocks)):
            object.__setattr__(lists, name, value)
        return lists

    def __setattr__(self, name, value):
        raise AttributeError("BlockLists are read-only")

    def __repr__(self) -> str:
        return (f"BlockLists(shape={tuple(self.block_idx.shape)}, kv_block={self.kv_block}, top_k={self.top_k}, "
                f"n_kv_blocks={self.n_kv_blocks}, device={self.block_idx.device})")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_qkv(q, k, v, spec: Spec) -> Shapes:
    """Reject anything the kernels cannot compute, naming the argument and what was expected."""
    try:  # the common case in one expression (this runs on every call); details only on failure
        fine = (q.dim() == 4 and k.dim() == 4 and q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype
                and q.shape[-1] == spec.head_dim and k.shape == v.shape and k.shape[-1] == spec.head_dim
                and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
                and q.is_cuda and k.device == q.device and v.device == q.device and not interpreting())
    except (AttributeError, TypeError):  # not tensors
        fine = False
    if not fine:
        _explain_qkv(q, k, v, spec)
    b, hq, nq, _ = q.shape
    bk, hkv, nk, _ = k.shape
    if bk != b:
        raise ValueError(f"k.shape[0] = {bk} does not match q.shape[0] = {b} (batch)")
    if hq != hkv * spec.gqa_group:
        raise ValueError(f"q has {hq} heads, expected heads_kv * spec.gqa_group = {hkv} * {spec.gqa_group}")
    if nq < 1 or nk < 1 or b < 1 or hkv < 1:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return Shapes(b, hq, hkv, nq, nk, spec.n_q_tiles(nq), spec.n_kv_blocks(nk))


def _explain_qkv(q, k, v, spec: Spec) -> None:
    """Raise the precise error for inputs that failed check_qkv's fast test (returns if they are
    fine after all: CPU tensors under the interpreter)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}.dtype must be float16, bfloat16 or float32, got {t.dtype}")
        if t.shape[-1] != spec.head_dim:
            raise ValueError(f"{name}.shape[-1] = {t.shape[-1]} does not match spec.head_dim = {spec.head_dim}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype = {t.dtype} differs from q.dtype = {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.device.type == "cuda":
        if interpreting():
            raise ValueError("CUDA tensors with TRITON_INTERPRET=1: unset it to run the kernels on the GPU")
    elif q.device.type == "cpu":
        if not interpreting():
            raise ValueError("q is on the CPU: kernelgen runs on CUDA, or on the CPU only under TRITON_INTERPRET=1")
        if q.dtype == torch.bfloat16:
            raise TypeError("bfloat16 is not supported by the Triton CPU interpreter (it computes garbage); "
                            "use float16 or float32 on the CPU")
    else:
        raise ValueError(f"q is on {q.device}; expected a CUDA device (or the CPU under TRITON_INTERPRET=1)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def prepare_block_idx(block_idx, spec: Spec, shapes: Shapes, device, select_mod, validate: bool = False):
    """A caller's lists in the kernels' form: int32, contiguous, valid ids ascending then -1.

    int64 lists are converted exactly (values outside int32 become empty slots, never wrapped ids).
    Ids outside [0, n_kv_blocks) and repeated ids become empty slots. With `validate`, repeats are an
    error instead (this reads the lists back to the host)."""
    if not isinstance(block_idx, torch.Tensor):
        raise TypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    expected = (shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k)
    if tuple(block_idx.shape) != expected:
        raise ValueError(f"block_idx.shape = {tuple(block_idx.shape)}, expected [B, Hkv, n_q_tiles, top_k] = {expected}")
    if block_idx.device != device:
        raise ValueError(f"block_idx is on {block_idx.device} but q is on {device}")
    if block_idx.dtype == torch.int64:
        block_idx = torch.where((block_idx >= 0) & (block_idx < shapes.n_kv_blocks), block_idx, -1).to(torch.int32)
    elif block_idx.dtype != torch.int32:
        raise TypeError(f"block_idx.dtype must be torch.int32 (or int64, converted), got {block_idx.dtype}")
    block_idx = block_idx.contiguous()
    if validate:
        ids = block_idx.long()
        ids = torch.where((ids >= 0) & (ids < shapes.n_kv_blocks), ids, -1).sort(-1).values
        if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
            raise ValueError("block_idx holds a repeated block id in some list; each list must be a set")
    out = _empty(like=block_idx)
    n_lists = shapes.batch * shapes.heads_kv * shapes.n_q_tiles
    lists = max(1, min(16, 2048 // next_pow2(spec.top_k)))  # lists per program: about 2K ids in registers
    select_mod.normalize_lists[(triton.cdiv(n_lists, lists),)](
        block_idx, out, n_lists, shapes.n_kv_blocks,
        TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), LISTS=lists, num_warps=4)
    return out


def check_block_lists(lists: BlockLists, spec: Spec, shapes: Shapes, device) -> torch.Tensor:
    """The normalised tensor of prepared lists, if they were made for this spec's blocks and this call's
    shapes and device (a few comparisons: no launch, no copy)."""
    made = (lists.kv_block, lists.top_k, lists.n_kv_blocks)
    if made != (spec.kv_block, spec.top_k, shapes.n_kv_blocks):
        raise ValueError(f"block_idx was prepared for kv_block, top_k, n_kv_blocks = {made}; this call has "
                         f"{(spec.kv_block, spec.top_k, shapes.n_kv_blocks)} (prepare them for this spec and seq_k)")
    expected = (shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k)
    if tuple(lists.block_idx.shape) != expected:
        raise ValueError(f"block_idx (prepared) has shape {tuple(lists.block_idx.shape)}, expected "
                         f"[B, Hkv, n_q_tiles, top_k] = {expected}")
    if lists.block_idx.device != device:
        raise ValueError(f"block_idx (prepared) is on {lists.block_idx.device} but q is on {device}")
    return lists.block_idx


def _pool(x: torch.Tensor, tile: int, groups: int, n_tiles: int, mod) -> torch.Tensor:
    b, h, n, d = x.shape
    rep = _empty(b, h, n_tiles, groups, d, device=x.device, dtype=torch.float32)
    # one tile per program: on the H200 (a32k) pooling took 15 us per tensor so, and 3x that with 4
    # tiles per program (the template keeps TILES for a later tunable)
    tiles = 1
    mod.pool[(triton.cdiv(n_tiles, tiles), b * h)](x, rep, x.stride(0), x.stride(1), x.stride(2), n, h, n_tiles,
                                                   TILE=tile, GROUPS=groups, HEAD_DIM=d, TILES=tiles,
                                                   num_warps=8 if tiles * tile * d >= 8192 else 4)
    return rep


def select(q: torch.Tensor, k: torch.Tensor, spec: Spec, shapes: Shapes, mod, cfg: SelectConfig) -> torch.Tensor:
    """Block lists int32 [B, Hkv, n_q_tiles, top_k] (ids ascending, then -1), chosen on the device."""
    r = spec.groups
    q_rep = _pool(q, spec.q_tile, r, shapes.n_q_tiles, mod)
    k_rep = _pool(k, spec.kv_block, r, shapes.n_kv_blocks, mod)
    block_idx = _empty(shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k, device=q.device, dtype=torch.int32)
    n_bh, top_k_pad = shapes.batch * shapes.heads_kv, next_pow2(spec.top_k)
    # splits > 1: each split scans a share of the blocks (more programs in flight), then a merge
    cand = block_idx if cfg.splits == 1 else _empty(n_bh * shapes.n_q_tiles * cfg.splits * top_k_pad,
                                                      device=q.device, dtype=torch.int64)
    grid = (triton.cdiv(shapes.n_q_tiles, cfg.tiles), n_bh, cfg.splits)
    mod.select_topk[grid](
        q_rep, k_rep, block_idx, cand, shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv,
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        HEAD_DIM=spec.head_dim, Q_TILE=spec.q_tile, KV_BLOCK=spec.kv_block,
        GROUP=spec.gqa_group, GROUPS=r, GR_PAD=next_pow2(spec.gqa_group * r),
        TOP_K=spec.top_k, TOP_K_PAD=top_k_pad, SINK=spec.sink, N_LOCAL=spec.n_local,
        TILES=cfg.tiles, CHUNK=cfg.chunk, SPLITS=cfg.splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.splits > 1:
        tiles = max(1, min(64, 2048 // (cfg.splits * top_k_pad)))  # about 2K candidate keys per program
        mod.merge_topk[(triton.cdiv(shapes.n_q_tiles, tiles), n_bh)](
            cand, block_idx, shapes.n_q_tiles, shapes.heads_kv, block_idx.stride(0), block_idx.stride(1),
            block_idx.stride(2), TOP_K=spec.top_k, TOP_K_PAD=top_k_pad, SPLITS=cfg.splits, TILES=tiles, num_warps=4)
    return block_idx


def _tma_ok(x: torch.Tensor) -> bool:
    """Tensor descriptors need a 16-byte aligned base and 16-byte aligned strides (but the last, 1)."""
    size = x.element_size()
    return x.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in x.stride()[:-1])


def softmax_scale(scale, spec: Spec) -> float:
    if scale is None:
        return 1.0 / math.sqrt(spec.head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float (default 1/sqrt(head_dim)), got {scale!r}")
    if scale <= 0:
        # the kernels take each row's running max on unscaled scores (as FlashAttention does)
        raise ValueError(f"scale must be > 0 (default 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def attention_tilelang(q, k, v, block_idx, spec: Spec, kernel, scale: float | None):
    """The TileLang forward (compiled for this exact shape) over normalised lists; it reads dense
    [B, H, N, D] tensors, so strided inputs are copied first."""
    scale = softmax_scale(scale, spec)
    return kernel(q.contiguous(), k.contiguous(), v.contiguous(), block_idx, scale)


def attention(q, k, v, block_idx, spec: Spec, shapes: Shapes, mod, cfg: AttnConfig, scale: float | None):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised lists."""
    scale = softmax_scale(scale, spec)
    o = _empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = _empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    grid = (shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)
    k_arg, v_arg = k, v
    use_tma = cfg.use_tma and _tma_ok(k) and _tma_ok(v)  # else the pointer path: same result
    if use_tma:
        block = [1, 1, spec.kv_block, spec.head_dim]
        k_arg = TensorDescriptor(k, list(k.shape), list(k.stride()), block)
        v_arg = TensorDescriptor(v, list(v.shape), list(v.stride()), block)
    mod.attn_fwd[grid](
        q, k_arg, v_arg, o, lse, block_idx,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2], *block_idx.stride()[:3],
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv, scale * LOG2E,
        HEAD_DIM=spec.head_dim, KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group,
        TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), BLOCK_M=cfg.block_m, USE_TMA=use_tma,
        KV_PER_ITER=cfg.kv_per_iter,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def check_gluon_device(device: torch.device) -> None:
    """The Gluon forward runs on Hopper GPUs only: a ValueError anywhere else (the CPU, Triton's
    interpreter, another GPU generation), never a silent fallback to another backend."""
    if device.type != "cuda" or interpreting():
        where = "TRITON_INTERPRET=1" if interpreting() else f"device {device}"
        raise ValueError(f"backend='gluon' runs on CUDA GPUs (Hopper, sm_90) only, not under {where}: Gluon kernels "
                         "have no interpreter; use backend='triton' there")
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        raise ValueError(f"backend='gluon' runs on Hopper GPUs (sm_90) only; {torch.cuda.get_device_name(device)} is "
                         f"sm_{capability[0]}{capability[1]} (its async wgmma, TMA and mbarriers are Hopper's); use "
                         "backend='triton' or 'tilelang'")


@functools.lru_cache(maxsize=None)
def _gluon_kv_descriptor(kv_block: int, head_dim: int, dtype: torch.dtype):
    """(TensorDescriptor class, shared layout) of the K/V blocks the Gluon forward loads. Gluon is
    imported here, on first use: a Triton build without it still runs the other backends."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return GluonTensorDescriptor, gl.NVMMASharedLayout.get_default_for([kv_block, head_dim], gl_dtype)


def _tma_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, N, D] as the [B * Hkv * N, D] rows a TMA descriptor reads: contiguous with a 16-byte
    aligned base (copied only when it is not)."""
    if not x.is_contiguous():
        x = x.contiguous()
    elif x.data_ptr() % 16:
        x = x.clone()
    return x.view(-1, x.shape[-1])


def attention_gluon(q, k, v, block_idx, spec: Spec, shapes: Shapes, mod, cfg: GluonAttnConfig, scale: float | None):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised lists, by the Gluon forward.
    Dispatch has checked the device (`check_gluon_device`); tests/sm90_offline.py compiles through this
    launch path with CPU tensors."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q.dtype = {q.dtype} is not supported by backend='gluon'; expected float16 or bfloat16")
    scale = softmax_scale(scale, spec)
    descriptor, layout = _gluon_kv_descriptor(spec.kv_block, spec.head_dim, q.dtype)
    block = [spec.kv_block, spec.head_dim]
    k_rows, v_rows = _tma_rows(k), _tma_rows(v)
    k_desc = descriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), block, layout)
    v_desc = descriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), block, layout)
    o = _empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = _empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    grid = (shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)
    mod.attn_fwd[grid](
        q, o, lse, block_idx, k_desc, v_desc,
        *q.stride()[:3], *o.stride()[:3], *lse.stride()[:2], *block_idx.stride()[:3],
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv, scale * LOG2E,
        HEAD_DIM=spec.head_dim, KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group,
        TOP_K=spec.top_k, TOP_K_PAD=max(next_pow2(spec.top_k), 32),  # its list layout spans a warp's 32 lanes
        BLOCK_M=cfg.block_m, CAUSAL=spec.causal, STAGES=cfg.num_stages,
        num_warps=cfg.block_m // 16)  # one wgmma row block of 16 per warp
    return o, lse

"""The Gluon backend: the attention forward in Gluon (Triton's explicit-layout dialect), Hopper only.

FlashAttention-3's intra-warpgroup order written out (async wgmma, a TMA ring of (K, V) slots with one
mbarrier each). Selection and list normalising run on the fallback backend.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from dataclasses import dataclass

import torch

from ..archs import arch_facts
from ..errors import KernelgenTypeError, KernelgenValueError
from ..inputs import LOG2E, empty, next_pow2, softmax_scale
from ..spec import Spec
from .base import Backend, Problem, RoleImpl, Shapes
from .triton import rendered_module

__all__ = ["GluonBackend", "GluonAttnConfig", "GLUON_BARRIER_BYTES", "gluon_attn_smem_bytes"]

# What the Gluon forward is written for: one wgmma tile of KV_BLOCK x HEAD_DIM per block, and 64 or 128
# packed rows per program (16 per warp, at least one warpgroup).
HEAD_DIMS = (64, 128)
KV_BLOCKS = (64, 128)
BLOCK_MS = (64, 128)
# Shared memory left beside the K/V rings for their mbarriers (8 B per ring slot, aligned)
GLUON_BARRIER_BYTES = 1024


@dataclass(frozen=True)
class GluonAttnConfig:
    """Gluon Q-centric forward (Hopper). block_m: packed rows per program, 16 per warp (the kernel runs
    block_m // 16 warps); num_stages: listed blocks whose K and V are in flight (the depth of the TMA ring)."""

    block_m: int = 128
    num_stages: int = 3

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def spec_unsupported(spec: Spec) -> str | None:
    """Why the Gluon forward cannot compute `spec`, or None."""
    if spec.head_dim not in HEAD_DIMS:
        return f"Spec.head_dim={spec.head_dim} is not supported by backend='gluon'; expected one of {HEAD_DIMS}"
    if spec.kv_block not in KV_BLOCKS:
        return f"Spec.kv_block={spec.kv_block} is not supported by backend='gluon'; expected one of {KV_BLOCKS}"
    rows = spec.gqa_group * spec.q_tile
    if rows < min(BLOCK_MS):
        return (f"Spec.gqa_group * Spec.q_tile = {spec.gqa_group} * {spec.q_tile} = {rows} packed rows is too few "
                f"for backend='gluon'; expected >= {min(BLOCK_MS)} (a program holds at least 64 rows)")
    if not any(spec.packs_rows(m) for m in BLOCK_MS):
        return (f"Spec.gqa_group={spec.gqa_group} with q_tile={spec.q_tile} cannot be packed into programs of "
                f"{' or '.join(map(str, BLOCK_MS))} rows by backend='gluon'; expected a q_tile that such a "
                "program splits evenly, or whole tiles of a number of heads that divides gqa_group")
    return None


def gluon_attn_smem_bytes(spec: Spec, cfg: GluonAttnConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the Gluon forward: its ring of num_stages K and V blocks (Q lives in
    registers). Triton 3.6 asked for this plus 32 B of barriers in offline sm_90 compiles."""
    return 2 * cfg.num_stages * spec.kv_block * spec.head_dim * elem_bytes


def arch_lacks(arch: str) -> str | None:
    """Why the Gluon forward cannot run on `arch` at all, or None: it is written for TMA and wgmma."""
    facts = arch_facts(arch)
    if not (facts.tma and facts.mma == "wgmma"):
        return f"the Gluon forward needs TMA and wgmma (Hopper, sm_90), which {arch} lacks"
    return None


def attn_infeasible(spec: Spec, cfg: GluonAttnConfig, arch: str) -> str | None:
    """Why the Gluon forward cannot run `cfg` for `spec` on `arch`, or None: a spec the kernel computes, an
    arch with TMA and wgmma, the row packing rule with 64 or 128 rows (16 per warp, whole warpgroups), 2 to
    4 stages, and rings that fit in the arch's shared memory."""
    unsupported = spec_unsupported(spec) or arch_lacks(arch)
    if unsupported:
        return unsupported
    if cfg.block_m not in BLOCK_MS or not spec.packs_rows(cfg.block_m):
        return (f"block_m={cfg.block_m}; expected one of {BLOCK_MS} that splits a Q tile evenly "
                f"(q_tile={spec.q_tile}) or holds whole tiles of a number of heads dividing gqa_group={spec.gqa_group}")
    if cfg.num_stages not in (2, 3, 4):
        return f"num_stages={cfg.num_stages}; expected 2, 3 or 4"
    smem, limit = gluon_attn_smem_bytes(spec, cfg), arch_facts(arch).smem_per_block - GLUON_BARRIER_BYTES
    if smem > limit:
        return f"a ring of {cfg.num_stages} K and V blocks is {smem} B of shared memory; at most {limit} on {arch}"
    return None


def attn_default(spec: Spec, arch: str) -> GluonAttnConfig:
    # the most rows a program can hold, up to 128; 3 stages, as the ring refills a slot one step after
    # its block was used (a32k, H200: 0.181 ms against 0.186 with 2 stages)
    for block_m, stages in itertools.product(BLOCK_MS[::-1], (3, 2)):
        cfg = GluonAttnConfig(block_m=block_m, num_stages=stages)
        if attn_infeasible(spec, cfg, arch) is None:
            return cfg
    raise KernelgenValueError(spec_unsupported(spec) or arch_lacks(arch)
                              or f"no feasible Gluon attention config for {spec} on {arch}")


def attn_space(spec: Spec, arch: str):
    return (GluonAttnConfig(block_m=m, num_stages=s) for m, s in itertools.product(BLOCK_MS, (2, 3, 4)))


@functools.lru_cache(maxsize=None)
def _kv_descriptor(kv_block: int, head_dim: int, dtype: torch.dtype):
    """(TensorDescriptor class, shared layout) of the K/V blocks the forward loads. Gluon is imported
    here, on first use: a Triton build without it still runs the other backends."""
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


def launch_attn(mod, spec: Spec, cfg: GluonAttnConfig, shapes: Shapes, q, k, v, block_idx, scale):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised lists. Dispatch has checked the
    device (`GluonBackend.device_unsupported`); tests/test_gluon_compile.py and tools/offline_compile.py compile
    through this launcher with CPU tensors."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise KernelgenTypeError(f"q.dtype = {q.dtype} is not supported by backend='gluon'; expected float16 or bfloat16")
    scale = softmax_scale(scale, spec)
    descriptor, layout = _kv_descriptor(spec.kv_block, spec.head_dim, q.dtype)
    block = [spec.kv_block, spec.head_dim]
    k_rows, v_rows = _tma_rows(k), _tma_rows(v)
    k_desc = descriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), block, layout)
    v_desc = descriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), block, layout)
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
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


@functools.lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ImportError:  # no triton.experimental at all
        return False


class GluonBackend(Backend):
    name = "gluon"
    summary = "the attention forward in Gluon with FlashAttention-3's order (Hopper, sm_90, only)"
    archs = ("sm_90",)
    compilers = {"triton_version": ("triton", "pytorch-triton")}  # Gluon ships inside Triton
    roles = {"attn": RoleImpl(launch=launch_attn, template="gluon/attn.py.j2", config_type=GluonAttnConfig,
                              default=attn_default, space=attn_space, infeasible=attn_infeasible)}

    def not_installed(self) -> str | None:
        return None if _gluon_importable() else "backend='gluon' needs a Triton with Gluon (triton>=3.5)"

    def spec_unsupported(self, spec: Spec) -> str | None:
        return super().spec_unsupported(spec) or spec_unsupported(spec)

    def device_unsupported(self, device) -> str | None:
        from ..device import interpreting

        device = torch.device(device)
        if device.type != "cuda" or interpreting():
            where = "TRITON_INTERPRET=1" if interpreting() else f"device {device}"
            return (f"backend='gluon' runs on CUDA GPUs (Hopper, sm_90) only, not under {where}: Gluon kernels "
                    "have no interpreter; use backend='triton' there")
        return super().device_unsupported(device)

    def build(self, spec: Spec, role: str, config, problem: Problem | None = None):
        return rendered_module(self.name, role, str(self.role(role).template), spec, config)

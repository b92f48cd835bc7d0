"""The TileLang backend: the attention forward, compiled per problem shape and arch: wgmma, TMA and warp
specialisation on Hopper (sm_90a); mma.sync and a cp.async pipeline on sm_80, sm_86 and sm_89, from the
same template. Also the Q-centric backward's dK/dV (`bwd_dkdv`: wgmma on Hopper, mma.sync before, a
cp.async pipeline on both). Selection, list normalising and the rest of the backward run on the fallback
backend.

Build the forward prim_func from the rendered template, lower it to CUDA source, compile it to a cubin.

Nothing here needs a GPU: lowering is pure TVM, and `tilelang.compile` only runs nvcc and builds a
host wrapper (launching the kernel is what needs a device). TileLang's front end reads a kernel's
Python source with `inspect`, so the rendered module is imported from its content-addressed file
(`compile.load_module`, like the Triton kernels).
"""
from __future__ import annotations

import logging
import time
import dataclasses
import functools
import importlib.util
import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..codegen.cache import load_module
from ..device import device_arch
from ..archs import arch_facts
from ..errors import KernelgenValueError
from ..inputs import softmax_scale
from ..spec import Spec
from .base import Backend, Problem, RoleImpl, Shapes
from .triton import _JsonConfig, pack_infeasible

__all__ = ["TileLangBackend", "TileLangAttnConfig", "TARGETS", "HOPPER", "ATTN_OUT_IDX", "DTYPES",
           "canonical_dtype", "attn_source", "attn_module", "build_attn", "build_attn_from", "target_arch", "lower",
           "compile_kernel", "compile_attn", "attn_pass_configs", "attn_smem_bytes", "attn_default", "attn_space",
           "attn_infeasible", "FAST_MATH", "NO_WARP_SPECIALISATION", "UNROLLED_PIPELINE_DRAIN",
           "TileLangBwdDkdvConfig", "BWD_DKDV_OUT_IDX", "bwd_dkdv_source", "build_bwd_dkdv", "compile_bwd_dkdv",
           "bwd_dkdv_pass_configs", "bwd_dkdv_smem_bytes", "bwd_dkdv_default", "bwd_dkdv_space",
           "bwd_dkdv_infeasible"]

log = logging.getLogger("kernelgen")

TEMPLATE = "tilelang/attn.py.j2"
# The archs the forward builds for, as a device reports them (kernelgen.device.device_arch), and TileLang's
# target for each: wgmma, TMA, warp specialisation and setmaxnreg need Hopper's "a" target. Off Hopper
# the same template lowers T.gemm to mma.sync (ldmatrix operands) and its copies to cp.async.
TARGETS = {"sm_80": "sm_80", "sm_86": "sm_86", "sm_89": "sm_89", "sm_90": "sm_90a"}
HOPPER = "sm_90"
# attn_fwd(Q, K, V, block_idx, scale, O, LSE): O and LSE are allocated and returned by the kernel
ATTN_OUT_IDX = [5, 6]
DTYPES = ("bfloat16", "float16")
BWD_DKDV_TEMPLATE = "tilelang/bwd_dkdv.py.j2"
# attn_bwd_dkdv(Q, K, V, dO, LSE, Delta, OFFSETS, TILES, ORDER, scale, dK, dV): dK and dV allocated and returned
BWD_DKDV_OUT_IDX = [10, 11]


def canonical_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if name not in DTYPES:
        raise KernelgenValueError(f"TileLang attention supports dtype in {DTYPES}, got {dtype!r}")
    return name


# render (jinja2) is imported where it is used: an exported module embeds this file without it

def attn_source(spec: Spec, dtype: Any, config=None) -> str:
    """Rendered forward module for a spec and dtype; its `build(**shape, **tunables)` gives the prim_func."""
    from ..codegen.render import render

    return render(TEMPLATE, spec, config, dtype=canonical_dtype(dtype))


def attn_module(spec: Spec, dtype: Any, config=None):
    """The rendered forward module, imported from its content-addressed file (TileLang reads the
    kernel's source with `inspect`)."""
    return _module("attn", attn_source(spec, dtype, config))


def _module(role: str, source: str):
    from ..codegen.render import module_name

    return load_module(module_name("tilelang", role, source), source)


def build_attn(spec: Spec, dtype: Any, *, batch: int, heads_kv: int, seq_q: int, seq_k: int, config=None, **tunables):
    """The prim_func for one problem shape. `config` (TileLangAttnConfig) or explicit `tunables`
    (block_M, block_N, num_stages, threads, overlap, pingpong) set the tile parameters."""
    return build_attn_from(attn_module(spec, dtype, config), spec, dtype, batch=batch, heads_kv=heads_kv,
                           seq_q=seq_q, seq_k=seq_k, config=config, **tunables)


def build_attn_from(module, spec: Spec, dtype: Any, *, batch: int, heads_kv: int, seq_q: int, seq_k: int,
                    config=None, **tunables):
    """The prim_func of a rendered forward `module` (attn_module's) for one problem shape."""
    if config is not None:
        tunables = {"block_M": config.block_m, "num_stages": config.num_stages, "threads": config.threads,
                    "overlap": config.overlap, "pingpong": config.pingpong, **tunables}
    return module.build(batch=batch, heads_q=heads_kv * spec.gqa_group, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                        head_dim=spec.head_dim, kv_block=spec.kv_block, q_tile=spec.q_tile, top_k=spec.top_k,
                        causal=spec.causal, window=spec.window or 0, dtype=canonical_dtype(dtype), **tunables)


def _arch(arch: str) -> str:
    """`arch` as a device reports it ("sm_90a", TileLang's target, is "sm_90"; "cpu", where nothing runs but
    spaces are listed, is Hopper's, as `kernelgen.archs` has it); an arch the forward is not built for is an
    error."""
    name = HOPPER if arch in (TARGETS[HOPPER], "cpu") else arch
    if name not in TARGETS:
        raise KernelgenValueError(f"arch={arch!r}: the TileLang forward builds for {', '.join(TARGETS)} only")
    return name


def hopper(arch: str) -> bool:
    """The forward for `arch` ("sm_90" or its target "sm_90a") is Hopper's (wgmma, TMA, warp specialisation)."""
    return _arch(arch) == HOPPER


def target_arch(device) -> str:
    """The arch TileLang compiles for on a CUDA device (TARGETS): sm_90 becomes sm_90a."""
    return TARGETS[_arch(device_arch(device))]


def _target_name(arch: str) -> str:
    """TileLang's target for a device's arch (sm_90 -> sm_90a); a target name (or any other) as it is."""
    return TARGETS.get(arch, arch)


def lower(prim_func, arch: str, pass_configs: dict | None = None) -> str:
    """CUDA source of `prim_func` for `arch` ("sm_80", "sm_89", "sm_90" or its target "sm_90a"; no nvcc, no
    GPU), built with `pass_configs` (a forward's: attn_pass_configs)."""
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": _target_name(arch)})
    t0 = time.perf_counter()
    with tvm.transform.PassContext(opt_level=3, config=pass_configs or {}), target:
        artifact = tilelang.lower(prim_func, target=target)
    log.debug("tilelang lower %s: %.2fs", arch, time.perf_counter() - t0)
    return artifact.kernel_source


# nvcc --use_fast_math, as FlashAttention-3 and Triton compile the softmax: exp2f becomes one MUFU.EX2
# (ex2.approx.ftz). Without it every score's exp2 also gets a denormal range check (FSETP and two
# predicated FMUL in the SASS, 2x the loop's code). The epilogue's division and log2 are approximate too
# (2 ulp), far below bf16's rounding.
FAST_MATH = {"tl.enable_fast_math": True}
# TileLang's plain software pipeline (cp.async, one warpgroup) instead of a TMA producer warpgroup
NO_WARP_SPECIALISATION = {"tl.disable_warp_specialized": True}
# TileLang 0.1.15's cp.async pipeline over a run-time trip count (the forward's n_steps) drains its last
# stages in a loop whose wait count depends on the loop index (cp.async.wait_group 3 - 2*i), and its CUDA
# codegen takes only a constant there ("Downcast from tirx.Sub to ir.IntImm failed"; tile-ai/TileOPs#1852).
# Unrolling loops in the IR, not by a #pragma, makes every count a constant. This is what "generates no
# code with two or more stages" was on Hopper's one-warpgroup forward (attn_pass_configs)
UNROLLED_PIPELINE_DRAIN = {"tl.UnrollLoop": {"explicit_unroll": True}}


def attn_pass_configs(config, arch: str) -> dict:
    """The forward's build options for `arch`. Off Hopper: fast math, TileLang's plain cp.async pipeline
    (there is no TMA to specialise a producer for) and the drain unrolled (UNROLLED_PIPELINE_DRAIN), so
    that it builds with 2 and 3 stages. On Hopper both forwards get fast math. The one-warpgroup forward (128
    threads) is built without warp specialisation: with TileLang's producer warpgroup it hung on the
    H200 (a32k's spec: D=64, 64-blocks, 32k keys; docs/DESIGN.md): with fast math a
    call never returned; without it, 300 eager calls and do_bench ran and the CUDA-graph replay of
    the bench then never finished. Both builds have the same synchronisation in SASS, so the race is
    TileLang's pipeline, not fast math. Without warp specialisation, with fast math, the same forward
    ran 300 calls, do_bench and graph replay, in 0.207 ms against 0.277. TileLang 0.1.15 generates no
    code for that pipeline with two or more stages (attn_infeasible keeps one). The
    two-warpgroup forwards (256 threads) keep warp specialisation: they ran thousands of calls ((b),
    c, c_dense, dense D=64 and D=128) and the (b) bench's graph replays."""
    if not hopper(arch):
        return {**FAST_MATH, **NO_WARP_SPECIALISATION, **UNROLLED_PIPELINE_DRAIN}
    return FAST_MATH if config.threads == 256 else {**FAST_MATH, **NO_WARP_SPECIALISATION}


def compile_attn(prim_func, config, arch: str, **kwargs: Any):
    """compile_kernel for a forward built from `config` (build_attn), with that config's build options for
    `arch`: the one place dispatch, the tuner's precompile and exported modules compile the forward."""
    return compile_kernel(prim_func, arch, **{"pass_configs": attn_pass_configs(config, arch), **kwargs})


def compile_kernel(prim_func, arch: str, out_idx: list[int] | None = None, **kwargs: Any):
    """`tilelang.JITKernel` with the cubin built by nvcc for `arch` (a device's arch, or TileLang's target).

    Works on a machine without a GPU: TileLang only needs nvcc to build and a GPU to launch. Its
    own on-disk cache (TILELANG_CACHE_DIR, ~/.tilelang/cache by default) makes a repeat instant.
    """
    import tilelang

    t0 = time.perf_counter()
    kernel = tilelang.compile(
        prim_func,
        out_idx=ATTN_OUT_IDX if out_idx is None else out_idx,
        target={"kind": "cuda", "arch": _target_name(arch)},
        **{"pass_configs": FAST_MATH, **kwargs},
    )
    log.debug("tilelang compile %s: %.2fs", arch, time.perf_counter() - t0)
    return kernel


# ---- configs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileLangAttnConfig:
    """TileLang Q-centric forward. block_m: packed rows per program; threads: 128 (one consumer
    warpgroup, four warps) or 256 (two, eight warps); on Hopper TileLang adds a producer warpgroup for
    the TMA loads of two. num_stages: K and V blocks in flight (cp.async off Hopper). overlap: issue
    the QK gemm of the next KV sub-block and the PV gemm of the last one together and run the
    softmax while PV runs (FlashAttention-3's intra-warpgroup pipelining; Hopper wgmma only). pingpong
    (with overlap and 256 threads): the two consumer warpgroups take turns issuing their gemms
    (FlashAttention-3's inter-warpgroup schedule; Hopper only)."""

    block_m: int = 128
    num_stages: int = 2
    threads: int = 256
    overlap: bool = False
    pingpong: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def attn_smem_bytes(spec: Spec, cfg: TileLangAttnConfig, elem_bytes: int = 2) -> int:
    """Dynamic shared memory of the forward on every arch: the Q rows (O reuses them) and num_stages K and V
    blocks. TileLang 0.1.15 plans exactly this (the lowered kernels' dyn_shared_memory_buf; a CPU test checks)."""
    return (cfg.block_m + 2 * cfg.num_stages * spec.kv_block) * spec.head_dim * elem_bytes


def _mma_infeasible(spec: Spec, cfg: TileLangAttnConfig, arch: str) -> str | None:
    """Why `cfg` cannot run on `arch` off Hopper (mma.sync and cp.async), or None: what that arch lacks."""
    if cfg.overlap or cfg.pingpong:
        return (f"overlap={cfg.overlap}, pingpong={cfg.pingpong} on {arch}: both schedule Hopper's asynchronous "
                f"wgmma, and {arch} runs mma.sync; expected overlap=False, pingpong=False")
    return _smem_infeasible(spec, cfg, arch)


def _smem_infeasible(spec: Spec, cfg: TileLangAttnConfig, arch: str) -> str | None:
    """Why `cfg`'s shared memory does not fit `arch`'s per block, or None."""
    smem, limit = attn_smem_bytes(spec, cfg), arch_facts(arch).smem_per_block
    if smem > limit:
        return (f"{smem} B of shared memory (block_m={cfg.block_m} Q rows and num_stages={cfg.num_stages} K and V "
                f"blocks of {spec.kv_block} keys at head_dim={spec.head_dim}); {arch} allows at most {limit} B "
                "per block")
    return None


def attn_infeasible(spec: Spec, cfg: TileLangAttnConfig, arch: str) -> str | None:
    """Why the TileLang forward cannot run `cfg` for `spec` on `arch`, or None. The row packing rule of every
    backend; 256 threads need 128 rows (two 64-row warpgroups); the shared memory within the arch's, on every
    arch. Off Hopper (_mma_infeasible): no overlap or ping-pong. On Hopper: three stages at head_dim 64 are left
    out: on the H200 that kernel never finished (a32k tune, 2026-11-30). 128 threads: one stage, as that
    forward is built without warp specialisation (attn_pass_configs) and TileLang 0.1.15 generates no
    code for it with more (without UNROLLED_PIPELINE_DRAIN, which the Hopper builds do not take)."""
    arch = _arch(arch)
    if cfg.block_m not in (64, 128) or cfg.threads not in (128, 256):
        return f"block_m={cfg.block_m}, threads={cfg.threads}; expected block_m 64 or 128 and threads 128 or 256"
    packing = pack_infeasible(spec, cfg.block_m)
    if packing:
        return packing
    if cfg.threads == 256 and cfg.block_m != 128:
        return "threads=256 (two consumer warpgroups of 64 rows) needs block_m=128"
    if cfg.num_stages not in (1, 2, 3):
        return f"num_stages={cfg.num_stages}; expected 1, 2 or 3"
    if arch != HOPPER:
        return _mma_infeasible(spec, cfg, arch)
    if cfg.threads == 128 and cfg.num_stages != 1:
        return ("threads=128 allows num_stages=1 only: that forward is built without warp specialisation (it hung "
                "with it on the H200), and TileLang 0.1.15 generates no code for that pipeline with more stages")
    if cfg.pingpong and not (cfg.overlap and cfg.threads == 256):
        return "pingpong=True needs overlap=True and threads=256 (two consumer warpgroups taking turns)"
    if spec.head_dim == 64 and cfg.num_stages == 3:
        return "num_stages=3 at head_dim=64 is left out: on the H200 that kernel never finished"
    return _smem_infeasible(spec, cfg, arch)


def attn_default(spec: Spec, arch: str) -> TileLangAttnConfig:
    """The config served on `arch` when nothing is tuned: the first feasible of a short list."""
    if _arch(arch) == HOPPER:
        # overlap at D=128: 540 vs 514 TFLOP/s on c_dense, 0.282 vs 0.298 ms on (b); at D=64 it was
        # +3% non-causal, -3% causal (H200, 2026-11-30): off, the tuner decides
        candidates = [TileLangAttnConfig(block_m=block_m, num_stages=stages, threads=threads,
                                         overlap=spec.head_dim >= 128)
                      for block_m, threads, stages in ((128, 256, 2), (64, 128, 1))]
    else:
        # Not measured on an sm_80 or sm_89 GPU (the tuner decides). As FlashAttention-2 there: 128 rows on
        # four warps while each thread's fp32 scores and accumulator (block_m * (kv_block + head_dim) /
        # threads) stay within 128 registers, else on eight; two stages where the shared memory holds them
        warps_128 = 128 if spec.kv_block + spec.head_dim <= 128 else 256
        candidates = [TileLangAttnConfig(block_m=block_m, num_stages=stages, threads=threads)
                      for block_m, threads in ((128, warps_128), (64, 128)) for stages in (2, 1)]
    for cfg in candidates:
        why = attn_infeasible(spec, cfg, arch)
        if why is None:
            return cfg
    raise KernelgenValueError(f"no feasible TileLang attention config for {spec} on {arch}; the smallest: {why}")


def attn_space(spec: Spec, arch: str):
    """The candidate configs on `arch` (attn_infeasible sorts out the rest): overlap and ping-pong on Hopper only."""
    switches = (False, True) if _arch(arch) == HOPPER else (False,)
    return (TileLangAttnConfig(block_m=m, num_stages=s, threads=t, overlap=o, pingpong=p)
            for m, s, t, o, p in itertools.product((64, 128), (1, 2, 3), (128, 256), switches, switches))


def launch_attn(kernel, spec: Spec, config, shapes: Shapes, q, k, v, block_idx, scale):
    """The forward compiled for this exact shape, over normalised lists; it reads dense tensors, so strided inputs
    (a window spec's lists are one row expanded over the batch and heads) are copied first."""
    scale = softmax_scale(scale, spec)
    return kernel(q.contiguous(), k.contiguous(), v.contiguous(), block_idx.contiguous(), scale)


@functools.lru_cache(maxsize=64)
def compiled_attn(spec: Spec, config: TileLangAttnConfig, problem: Problem):
    """The forward for one problem shape (cached here and on disk by TileLang)."""
    arch = target_arch(problem.device)
    _refuse_infeasible("attn", config, arch, _smem_infeasible(spec, config, _arch(arch)) if hopper(arch)
                       else _mma_infeasible(spec, config, _arch(arch)))
    return compile_attn(_build_for(build_attn, spec, config, problem), config, arch)


def _refuse_infeasible(role: str, config, arch: str, why: str | None) -> None:
    """Raise, before anything is lowered, where `config` of `role` cannot run on the device's `arch`."""
    if why:
        raise KernelgenValueError(f"configs[{role!r}] = {config} cannot run on {arch}: {why} "
                                  f"(backends.tilelang.{role}_space lists the points of each arch)")


def _build_for(build, spec: Spec, config, problem: Problem):
    """The prim_func that `build` (build_attn, build_bwd_dkdv) gives for `config` and one problem shape."""
    shapes = problem.shapes
    return build(spec, problem.dtype, batch=shapes.batch, heads_kv=shapes.heads_kv, seq_q=shapes.n_q,
                 seq_k=shapes.n_k, config=config)


# ---- the backward's dK/dV -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TileLangBwdDkdvConfig(_JsonConfig):
    """TileLang dK and dV of the Q-centric backward: block_n keys of one KV block per program (dK and dV in
    fp32 registers), walking the Q tiles that list the block block_m queries of one head a step (block_m
    divides q_tile). threads: 128 or 256. num_stages: Q and dO steps in flight (cp.async, no producer
    warpgroup on any arch: bwd_dkdv_pass_configs)."""

    block_n: int = 64
    block_m: int = 64
    num_stages: int = 1
    threads: int = 128


# fp32 registers per thread that dK, dV, P^T and dP^T may hold (of 255; the rest hold addresses, the bf16
# casts and the loop's state): at 192 the H200's D=128, 64 x 64 kernel took 242 (ptxas, no spill)
BWD_DKDV_REGS_LIMIT = 192


def bwd_dkdv_smem_bytes(spec: Spec, cfg: TileLangBwdDkdvConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the dK/dV kernel: K and V, num_stages + 1 buffers of a step's Q and dO, the output
    staging tile, and (programs whose warps do not hold whole 16-key slices) P^T and dS^T. An upper bound of
    what TileLang 0.1.15 plans (a CPU test checks)."""
    rows = 3 * cfg.block_n + 2 * (cfg.num_stages + 1) * cfg.block_m
    operands = 0 if cfg.block_n % (cfg.threads // 2) == 0 else 2 * cfg.block_n * cfg.block_m * elem_bytes
    return rows * spec.head_dim * elem_bytes + operands + 2 * (cfg.num_stages + 1) * cfg.block_m * 4


def warps_cover(m: int, n: int, warps: int) -> bool:
    """Whether TileLang 0.1.15 can lay `warps` warps out over an m x n gemm (T.gemm's warp partition, any
    policy): warps = wm * wn with wm warps of 16 rows and wn of 8 columns each covering it evenly."""
    return any(warps % wm == 0 and m % (16 * wm) == 0 and n % (8 * (warps // wm)) == 0 for wm in range(1, warps + 1))


def bwd_dkdv_infeasible(spec: Spec, cfg: TileLangBwdDkdvConfig, arch: str) -> str | None:
    """Why the TileLang dK/dV kernel cannot run `cfg` for `spec` on `arch`, or None: block_n splits a KV block,
    block_m splits a Q tile (a step is queries of one head), registers for dK, dV, P^T and dP^T, and shared
    memory within the arch's."""
    arch = _arch(arch)
    if cfg.threads not in (128, 256) or cfg.num_stages not in (1, 2):
        return f"threads={cfg.threads}, num_stages={cfg.num_stages}; expected threads 128 or 256, num_stages 1 or 2"
    if cfg.block_n not in (32, 64, 128) or spec.kv_block % cfg.block_n:
        return f"block_n={cfg.block_n} must be 32, 64 or 128 and split a KV block (kv_block={spec.kv_block}) evenly"
    if cfg.block_m not in (16, 32, 64, 128) or spec.q_tile % cfg.block_m:
        return (f"block_m={cfg.block_m} must be 16, 32, 64 or 128 and split a Q tile (q_tile={spec.q_tile}) evenly: "
                "a step holds queries of one head")
    for m, n in ((cfg.block_n, cfg.block_m), (cfg.block_n, spec.head_dim)):
        if not warps_cover(m, n, cfg.threads // 32):
            return (f"threads={cfg.threads}: {cfg.threads // 32} warps cannot split the {m} x {n} gemm (K Q^T, or dK "
                    f"and dV) into tiles of 16 rows and 8 columns: fewer threads or a larger block_m")
    regs = cfg.block_n * (2 * spec.head_dim + 2 * cfg.block_m) // cfg.threads
    if regs > BWD_DKDV_REGS_LIMIT:
        return (f"block_n * (2 * head_dim + 2 * block_m) / threads = {regs} fp32 registers per thread for dK, dV, "
                f"P^T and dP^T; at most {BWD_DKDV_REGS_LIMIT}: more threads or smaller tiles")
    smem, limit = bwd_dkdv_smem_bytes(spec, cfg), arch_facts(arch).smem_per_block
    if smem > limit:
        return (f"{smem} B of shared memory (K, V and num_stages={cfg.num_stages} + 1 steps of Q and dO at "
                f"head_dim={spec.head_dim}); {arch} allows at most {limit} B per block")
    return None


def bwd_dkdv_default(spec: Spec, arch: str) -> TileLangBwdDkdvConfig:
    """The config served on `arch` when nothing is tuned: the first feasible of 64 keys and 64 queries (32 off
    Hopper, where mma.sync fragments take more registers), one warpgroup, two stages (on the H200, the fastest
    of the ten configs `tune --preset bench --role bwd_dkdv` timed at b16k and at c: 4.84 ms at c, Triton's 5.42)."""
    rows = (64, 32, 16) if hopper(arch) else (32, 64, 16)
    why = None
    for n, m, threads, stages in itertools.product((64, 128, 32), rows, (128, 256), (2, 1)):
        cfg = TileLangBwdDkdvConfig(block_n=n, block_m=m, num_stages=stages, threads=threads)
        why = bwd_dkdv_infeasible(spec, cfg, arch)
        if why is None:
            return cfg
    raise KernelgenValueError(f"no feasible TileLang dK/dV config for {spec} on {arch}; the last: {why}")


def bwd_dkdv_space(spec: Spec, arch: str):
    """The candidate configs (bwd_dkdv_infeasible sorts out the rest)."""
    return (TileLangBwdDkdvConfig(block_n=n, block_m=m, num_stages=s, threads=t)
            for n, m, s, t in itertools.product((32, 64, 128), (16, 32, 64, 128), (1, 2), (128, 256)))


def bwd_dkdv_source(spec: Spec, dtype: Any, config=None) -> str:
    """Rendered dK/dV module for a spec and dtype; its `build(**shape, **tunables)` gives the prim_func."""
    from ..codegen.render import render

    return render(BWD_DKDV_TEMPLATE, spec, config, dtype=canonical_dtype(dtype))


def build_bwd_dkdv(spec: Spec, dtype: Any, *, batch: int, heads_kv: int, seq_q: int, seq_k: int, config=None,
                   **tunables):
    """The dK/dV prim_func for one problem shape. `config` (TileLangBwdDkdvConfig) or explicit `tunables`
    (block_M, block_N, num_stages, threads) set the tile parameters."""
    if config is not None:
        tunables = {"block_M": config.block_m, "block_N": config.block_n, "num_stages": config.num_stages,
                    "threads": config.threads, **tunables}
    module = _module("bwd_dkdv", bwd_dkdv_source(spec, dtype, config))
    return module.build(batch=batch, heads_q=heads_kv * spec.gqa_group, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                        head_dim=spec.head_dim, kv_block=spec.kv_block, q_tile=spec.q_tile, top_k=spec.top_k,
                        causal=spec.causal, window=spec.window or 0, dtype=canonical_dtype(dtype), **tunables)


def bwd_dkdv_pass_configs(arch: str) -> dict:
    """The dK/dV kernel's build options, on every arch: fast math, TileLang's plain cp.async pipeline (no
    producer warpgroup: the one-warpgroup forward hung with one on the H200; attn_pass_configs) and the
    drain unrolled, without which TileLang 0.1.15 generates no code for two stages (UNROLLED_PIPELINE_DRAIN)."""
    return {**FAST_MATH, **NO_WARP_SPECIALISATION, **UNROLLED_PIPELINE_DRAIN}


def compile_bwd_dkdv(prim_func, arch: str, **kwargs: Any):
    """compile_kernel for a dK/dV prim_func (build_bwd_dkdv) with its build options for `arch`."""
    return compile_kernel(prim_func, arch, out_idx=BWD_DKDV_OUT_IDX,
                          **{"pass_configs": bwd_dkdv_pass_configs(arch), **kwargs})


def launch_bwd_dkdv(kernel, spec: Spec, config, shapes: Shapes, q, k, v, do, lse, delta, reverse, scale):
    """(dk, dv) (k's shape and dtype): per KV block, over the Q tiles the reverse index says list it, the blocks
    listed most launched first (`reverse.order`). The kernel reads dense tensors of this exact shape, so strided
    inputs are copied first."""
    scale = softmax_scale(scale, spec)
    dk, dv = kernel(*(x.contiguous() for x in (q, k, v, do, lse, delta, reverse.offsets, reverse.tiles,
                                                 reverse.order)), scale)
    return dk, dv


@functools.lru_cache(maxsize=64)
def compiled_bwd_dkdv(spec: Spec, config: TileLangBwdDkdvConfig, problem: Problem):
    """The dK/dV kernel for one problem shape (cached here and on disk by TileLang)."""
    arch = target_arch(problem.device)
    _refuse_infeasible("bwd_dkdv", config, arch, bwd_dkdv_infeasible(spec, config, arch))
    return compile_bwd_dkdv(_build_for(build_bwd_dkdv, spec, config, problem), arch)


class TileLangBackend(Backend):
    name = "tilelang"
    summary = ("the attention forward and the backward's dK/dV in TileLang, compiled per problem shape (sm_80 to "
               "sm_90: wgmma and TMA on Hopper, mma and cp.async before)")
    archs = tuple(TARGETS)
    per_shape = True
    compilers = {"tilelang_version": ("tilelang",)}
    windows = True  # the forward and dK/dV (its other roles run on the fallback, which has them too)
    head_dims = (64, 128, 256)  # its tiles are D wide: a power of two
    roles = {"attn": RoleImpl(launch=launch_attn, template=TEMPLATE, config_type=TileLangAttnConfig,
                              default=attn_default, space=attn_space, infeasible=attn_infeasible),
             # the Q-centric backward's dK/dV (bwd_delta and bwd_dq run on the fallback); on the CPU the
             # fallback's runs it (optional)
             "bwd_dkdv": RoleImpl(launch=launch_bwd_dkdv, template=BWD_DKDV_TEMPLATE,
                                  config_type=TileLangBwdDkdvConfig, default=bwd_dkdv_default, space=bwd_dkdv_space,
                                  infeasible=bwd_dkdv_infeasible, optional=True)}

    def not_installed(self) -> str | None:
        if importlib.util.find_spec("tilelang") is None:
            return ("backend='tilelang' needs TileLang: pip install tilelang==0.1.15 (in a kernelgen checkout: "
                    "pip install -e '.[tilelang]')")
        return None

    def build(self, spec: Spec, role: str, config, problem: Problem | None = None):
        self.role(role)
        if problem is None or problem.device.type != "cuda":
            raise KernelgenValueError("backend='tilelang' runs on CUDA GPUs only (lowering and compiling work without "
                                      "one: kernelgen.backends.tilelang.lower / compile_kernel)")
        if role == "bwd_dkdv":
            return compiled_bwd_dkdv(spec, config, problem)
        return compiled_attn(spec, config, problem)

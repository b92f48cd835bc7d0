"""TileLang backend: build the forward prim_func from the rendered template, lower it to CUDA source,
compile it to a cubin.

Nothing here needs a GPU: lowering is pure TVM, and `tilelang.compile` only runs nvcc and builds a
host wrapper (launching the kernel is what needs a device). TileLang's front end reads a kernel's
Python source with `inspect`, so the rendered module is imported from its content-addressed file
(`compile.load_module`, like the Triton kernels).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .compile import load_module
from .spec import Spec

__all__ = ["ARCH", "ATTN_OUT_IDX", "DTYPES", "canonical_dtype", "attn_source", "attn_module", "build_attn",
           "build_attn_from", "target_arch", "lower", "compile_kernel",
           "compile_attn", "attn_pass_configs", "FAST_MATH", "NO_WARP_SPECIALISATION"]

log = logging.getLogger("kernelgen")

ARCH = "sm_90a"  # warp specialisation and wgmma need the "a" target
# attn_fwd(Q, K, V, block_idx, scale, O, LSE): O and LSE are allocated and returned by the kernel
ATTN_OUT_IDX = [5, 6]
DTYPES = ("bfloat16", "float16")


def canonical_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"TileLang attention supports dtype in {DTYPES}, got {dtype!r}")
    return name


# render (jinja2) is imported where it is used: an exported module embeds this file without it

def attn_source(spec: Spec, dtype: Any, config=None) -> str:
    """Rendered forward module for a spec and dtype; its `build(**shape, **tunables)` gives the prim_func."""
    from .render import render

    if spec.backend != "tilelang":
        spec = spec.replace(backend="tilelang")
    return render(spec, "attn", config, dtype=canonical_dtype(dtype))


def attn_module(spec: Spec, dtype: Any, config=None):
    """The rendered forward module, imported from its content-addressed file (TileLang reads the
    kernel's source with `inspect`)."""
    from .render import module_name

    source = attn_source(spec, dtype, config)
    return load_module(module_name(spec.replace(backend="tilelang"), "attn", source), source)


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
                        causal=spec.causal, dtype=canonical_dtype(dtype), **tunables)


def target_arch(device) -> str:
    """The arch TileLang compiles for on a CUDA device: sm_90 becomes sm_90a (wgmma, warp specialisation)."""
    major, minor = torch.cuda.get_device_capability(device)
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def _target(arch: str):
    from tilelang import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch})


def lower(prim_func, arch: str = ARCH, pass_configs: dict | None = None) -> str:
    """CUDA source of `prim_func` for `arch` (no nvcc, no GPU), built with `pass_configs` (a forward's:
    attn_pass_configs)."""
    import tilelang
    from tilelang import tvm

    target = _target(arch)
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


def attn_pass_configs(config) -> dict:
    """The forward's build options. Both forwards get fast math. The one-warpgroup forward (128
    threads) is built without warp specialisation: with TileLang's producer warpgroup it hung on the
    H200 (a32k's spec: D=64, 64-blocks, 32k keys; docs/PERF.md sessions 7 and 8): with fast math a
    call never returned; without it, 300 eager calls and do_bench ran and the CUDA-graph replay of
    the bench then never finished. Both builds have the same synchronisation in SASS, so the race is
    TileLang's pipeline, not fast math. Without warp specialisation, with fast math, the same forward
    ran 300 calls, do_bench and graph replay, in 0.207 ms against 0.277. TileLang 0.1.15 generates no
    code for that pipeline with two or more stages (config.tilelang_attn_feasible keeps one). The
    two-warpgroup forwards (256 threads) keep warp specialisation: they ran thousands of calls ((b),
    c, c_dense, dense D=64 and D=128) and the (b) bench's graph replays."""
    return FAST_MATH if config.threads == 256 else {**FAST_MATH, **NO_WARP_SPECIALISATION}


def compile_attn(prim_func, config, arch: str = ARCH, **kwargs: Any):
    """compile_kernel for a forward built from `config` (build_attn), with that config's build options:
    the one place dispatch, the tuner's precompile and exported modules compile the forward."""
    return compile_kernel(prim_func, arch=arch, **{"pass_configs": attn_pass_configs(config), **kwargs})


def compile_kernel(prim_func, arch: str = ARCH, out_idx: list[int] | None = None, **kwargs: Any):
    """`tilelang.JITKernel` with the cubin built by nvcc for `arch`.

    Works on a machine without a GPU: TileLang only needs nvcc to build and a GPU to launch. Its
    own on-disk cache (TILELANG_CACHE_DIR, ~/.tilelang/cache by default) makes a repeat instant.
    """
    import tilelang

    t0 = time.perf_counter()
    kernel = tilelang.compile(
        prim_func,
        out_idx=ATTN_OUT_IDX if out_idx is None else out_idx,
        target={"kind": "cuda", "arch": arch},
        **{"pass_configs": FAST_MATH, **kwargs},
    )
    log.debug("tilelang compile %s: %.2fs", arch, time.perf_counter() - t0)
    return kernel


# ---- block selector (Q-centric lists, selector "mean" / "multi:r") ----------------------------------

# pool(X, REP): REP is allocated and returned; select_topk(QREP, KREP, BLOCK_IDX): BLOCK_IDX is
POOL_OUT_IDX = [1]
SELECT_OUT_IDX = [2]

__all__ += ["POOL_OUT_IDX", "SELECT_OUT_IDX", "select_source", "build_select"]


def select_source(spec: Spec) -> str:
    """Rendered selector module for a spec: `build_pool(...)` and `build_select(...)` give the prim_funcs.
    Rendered from templates/tilelang/select.py.j2 with the same context as every other template."""
    if not spec.selects:
        raise ValueError("select_source: spec.selector='given' chooses no blocks; the caller passes block_idx")
    from .render import render

    if spec.backend != "tilelang":
        spec = spec.replace(backend="tilelang")
    return render(spec, "select")


def build_select(
    spec: Spec,
    dtype: Any,
    *,
    batch: int,
    heads_kv: int,
    seq_q: int,
    seq_k: int,
    threads: int = 128,
    pool_threads: int = 128,
    pool_tiles: int = 1,
):
    """(pool_q, pool_k, select_topk) prim_funcs for one problem shape.

    pool_q(Q, QREP) and pool_k(K, KREP) pool Q [batch, heads_kv * G, seq_q, D] and K
    [batch, heads_kv, seq_k, D] (in `dtype`) into fp32 reps (output: parameter 1, POOL_OUT_IDX);
    select_topk(QREP, KREP, BLOCK_IDX) writes int32 [batch, heads_kv, n_q_tiles, top_k] (output:
    parameter 2, SELECT_OUT_IDX), exactly reference.select_blocks up to fp32 near-ties."""
    from .render import module_name

    source = select_source(spec)
    module = load_module(module_name(spec.replace(backend="tilelang"), "select", source), source)
    name = canonical_dtype(dtype)
    pool_q = module.build_pool(batch=batch, heads=heads_kv * spec.gqa_group, seq=seq_q, head_dim=spec.head_dim,
                               tile=spec.q_tile, groups=spec.groups, dtype=name, tiles=pool_tiles,
                               threads=pool_threads)
    pool_k = module.build_pool(batch=batch, heads=heads_kv, seq=seq_k, head_dim=spec.head_dim, tile=spec.kv_block,
                               groups=spec.groups, dtype=name, tiles=pool_tiles, threads=pool_threads)
    select_topk = module.build_select(batch=batch, heads_kv=heads_kv, gqa_group=spec.gqa_group, seq_q=seq_q,
                                       seq_k=seq_k, head_dim=spec.head_dim, q_tile=spec.q_tile,
                                       kv_block=spec.kv_block, top_k=spec.top_k, groups=spec.groups, sink=spec.sink,
                                       n_local=spec.n_local, causal=spec.causal, threads=threads)
    return pool_q, pool_k, select_topk

"""The TileLang dK/dV backward (`bwd_dkdv`): renders, lowers and compiles with nvcc for sm_90a and sm_80 (no
GPU needed); its configs' rules; who runs it (the fallback on the CPU); on a GPU, dk and dv against float64
autograd through kernelgen.reference, and bitwise determinism."""
from __future__ import annotations

import inspect
import os
import re
import shutil

import pytest
import torch

pytestmark = pytest.mark.tilelang

pytest.importorskip("tilelang")

import kernelgen  # noqa: E402
from kernelgen import Spec, TileLangBwdDkdvConfig, backends, reference  # noqa: E402
from kernelgen.archs import arch_facts  # noqa: E402
from kernelgen.backends import tilelang as tb  # noqa: E402
from kernelgen.codegen.cache import load_module  # noqa: E402
from kernelgen.codegen.render import module_name  # noqa: E402
from checks import cubin_bytes  # noqa: E402

BUILD_PARAMS = ["batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "kv_block", "q_tile", "top_k",
                "causal", "window", "dtype", "block_M", "block_N", "num_stages", "threads"]
TILELANG, TRITON = backends.get("tilelang"), backends.get(backends.FALLBACK)


@pytest.fixture(autouse=True)
def _kernelgen_cache(tmp_path_factory, monkeypatch):
    if "KERNELGEN_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernelgen_cache"))


def _spec(causal, D, G, kv_block, q_tile, **fields):
    return Spec(head_dim=D, kv_block=kv_block, q_tile=q_tile, top_k=8, causal=causal, gqa_group=G, backend="tilelang",
                **fields)


def test_render_and_build_signature():
    spec = _spec(True, 64, 1, 64, 64)
    source = tb.bwd_dkdv_source(spec, "float16")
    assert "{{" not in source and "{%" not in source and 'DTYPE = "float16"' in source
    module = load_module(module_name("tilelang", "bwd_dkdv", source), source)
    params = inspect.signature(module.build).parameters
    assert list(params) == BUILD_PARAMS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    shape = dict(batch=1, heads_q=1, heads_kv=1, seq_q=64, seq_k=64, head_dim=64, kv_block=64, q_tile=64, top_k=1,
                 causal=True)
    with pytest.raises(ValueError, match="rendered for"):
        module.build(**shape, dtype="bfloat16")
    with pytest.raises(ValueError, match="must divide q_tile"):
        module.build(**shape, block_M=128)
    with pytest.raises(ValueError, match="must divide kv_block"):
        module.build(**shape, block_N=48)


@pytest.mark.parametrize("cfg,why", [
    (TileLangBwdDkdvConfig(block_m=128), r"block_m=128 must be .* split a Q tile \(q_tile=64\)"),
    (TileLangBwdDkdvConfig(block_n=128), r"block_n=128 must be .* split a KV block \(kv_block=64\)"),
    (TileLangBwdDkdvConfig(threads=64), "expected threads 128 or 256"),
    (TileLangBwdDkdvConfig(num_stages=3), "num_stages 1 or 2"),
    # 8 warps cannot split a 32 x 16 gemm into 16 x 8 tiles (it failed to lower on the H200)
    (TileLangBwdDkdvConfig(block_n=32, block_m=16, threads=256), r"8 warps cannot split the 32 x 16 gemm"),
])
def test_infeasible_configs_say_why(cfg, why):
    spec = _spec(True, 128, 4, 64, 64)
    assert re.search(why, tb.bwd_dkdv_infeasible(spec, cfg, "sm_90"))


def test_registers_and_shared_memory_bound_the_tiles():
    wide = _spec(True, 256, 4, 128, 128)
    why = tb.bwd_dkdv_infeasible(wide, TileLangBwdDkdvConfig(block_n=128, block_m=64, threads=128), "sm_90")
    assert "fp32 registers per thread" in why
    why = tb.bwd_dkdv_infeasible(wide, TileLangBwdDkdvConfig(block_n=64, block_m=32, num_stages=2, threads=256),
                                 "sm_89")
    assert re.search(r"\d+ B of shared memory .*sm_89 allows at most 101376 B", why)
    for arch in ("sm_80", "sm_89", "sm_90"):
        for spec in (wide, _spec(False, 64, 1, 32, 64), _spec(True, 128, 8, 128, 128)):
            cfg = tb.bwd_dkdv_default(spec, arch)
            assert cfg in TILELANG.config_space(spec, "bwd_dkdv", arch)


def test_the_fallback_runs_it_where_tilelang_cannot_run():
    """On the CPU (the interpreter) the backward's dK/dV runs on Triton, as before TileLang had it; on a GPU
    TileLang runs it for a TileLang spec. A forward is never swapped for another backend's."""
    assert backends.runner("tilelang", "bwd_dkdv") is TILELANG
    assert backends.runner("tilelang", "bwd_dkdv", "cpu") is TRITON
    assert backends.runner("tilelang", "attn", "cpu") is TILELANG
    assert backends.runner("triton", "bwd_dkdv", "cpu") is TRITON
    assert backends.runner("tilelang", "bwd_dq", "cpu") is TRITON


def test_the_fallback_runs_it_where_tilelang_has_no_config_of_the_spec(monkeypatch):
    """dK/dV splits a KV block into 32 keys or more: a TileLang spec of 16-key blocks (its forward runs) has its
    dK/dV run by Triton on the GPU too, not a "no feasible config" error at the first backward."""
    monkeypatch.setattr("kernelgen.device.device_arch", lambda device: "sm_90")
    gpu = torch.device("cuda")
    small, large = _spec(True, 64, 1, 16, 64), _spec(True, 64, 1, 64, 64)
    assert not backends.has_config(TILELANG, small, "bwd_dkdv", "sm_90")
    assert backends.has_config(TILELANG, small, "attn", "sm_90")
    assert backends.runner("tilelang", "bwd_dkdv", gpu, small) is TRITON
    assert backends.runner("tilelang", "bwd_dkdv", gpu, large) is TILELANG
    assert backends.runner("tilelang", "attn", gpu, small) is TILELANG


# (causal, D, G, kv_block, q_tile), arch, config (None: the arch's default)
COMPILE_CASES = [
    ((True, 128, 4, 128, 128), "sm_90a", None),
    ((False, 64, 1, 64, 64), "sm_90a", None),
    ((True, 64, 4, 64, 128), "sm_90a", TileLangBwdDkdvConfig(block_n=64, block_m=64, num_stages=2, threads=128)),
    ((False, 128, 1, 128, 64), "sm_90a", TileLangBwdDkdvConfig(block_n=128, block_m=64, num_stages=1, threads=256)),
    ((True, 128, 4, 64, 64), "sm_90a", TileLangBwdDkdvConfig(block_n=32, block_m=32, num_stages=1, threads=128)),
    # 8 warps over 32 x 32: two of 16 rows by four of 8 columns (warps_cover's edge)
    ((False, 64, 2, 64, 64), "sm_90a", TileLangBwdDkdvConfig(block_n=32, block_m=32, num_stages=1, threads=256)),
    ((True, 128, 4, 128, 128), "sm_80", None),
    ((False, 64, 4, 64, 64), "sm_80", TileLangBwdDkdvConfig(block_n=64, block_m=64, num_stages=2, threads=128)),
    ((True, 64, 1, 128, 64), "sm_80", TileLangBwdDkdvConfig(block_n=128, block_m=32, num_stages=2, threads=256)),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("point,arch,cfg", COMPILE_CASES,
                         ids=["-".join(map(str, (*p, a, "default" if c is None else "pinned"))) for p, a, c in
                              COMPILE_CASES])
def test_lowers_and_compiles(point, arch, cfg, nvcc_really_runs):
    """CUDA source and a cubin from nvcc, built as TileLangBackend.build builds it (compile_bwd_dkdv): wgmma on
    sm_90a, mma.sync off Hopper; cp.async loads without a producer warpgroup or mbarrier; no atomics; the
    masks of keys past Nk and queries past Nq; the shared memory within bwd_dkdv_smem_bytes."""
    spec = _spec(*point)
    cfg = cfg or tb.bwd_dkdv_default(spec, arch)
    assert tb.bwd_dkdv_infeasible(spec, cfg, arch) is None
    func = tb.build_bwd_dkdv(spec, "bfloat16", batch=2, heads_kv=2, seq_q=1000, seq_k=1100, config=cfg)
    kernel = tb.compile_bwd_dkdv(func, arch)
    cubin = cubin_bytes(kernel)
    assert cubin[:4] == b"\x7fELF" and arch.encode() in cubin and b"attn_bwd_dkdv_kernel" in cubin
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__({cfg.threads}, 1) attn_bwd_dkdv_kernel(" in src
    if arch == "sm_90a" and cfg.block_n % (cfg.threads // 2) == 0:
        assert "tl::wgmma_ss<" in src  # K Q^T and V dO^T from shared memory
        assert "tl::wgmma_rs<" in src  # P^T dO and dS^T Q with P^T and dS^T in registers
    else:  # off Hopper, and warpgroups of fewer than 64 keys (TileLang falls back to mma.sync)
        assert "tl::mma_sync<" in src and "wgmma" not in src
    assert "tl::cp_async" in src and "mbarrier" not in src and "CUtensorMap" not in src
    assert "atomic" not in src.lower()
    assert "-CUDART_INF_F" in src and "float scale" in src
    smem = [int(f.attrs.get("dyn_shared_memory_buf", 0)) for f in kernel.artifact.device_mod.functions.values()]
    assert max(smem) <= tb.bwd_dkdv_smem_bytes(spec, cfg) <= arch_facts(arch.removesuffix("a")).smem_per_block


def test_build_refuses_a_config_the_device_cannot_run(monkeypatch):
    from kernelgen.backends.base import Problem, Shapes
    from kernelgen.errors import KernelgenValueError

    spec = _spec(True, 256, 4, 128, 128)
    problem = Problem(torch.bfloat16, Shapes(1, 8, 2, 1000, 1100, 8, 9), torch.device("cuda"))
    monkeypatch.setattr(tb, "target_arch", lambda device: "sm_89")
    cfg = TileLangBwdDkdvConfig(block_n=64, block_m=32, num_stages=2, threads=256)
    with pytest.raises(KernelgenValueError, match=r"configs\['bwd_dkdv'\] .* cannot run on sm_89: .* shared memory"):
        TILELANG.build(spec, "bwd_dkdv", cfg, problem)


# ---- GPU: dk and dv against float64 autograd through the reference --------------------------------------

GPU_CASES = {  # (spec fields, batch, heads_kv, n_q, n_k)
    "d64_4k": (dict(head_dim=64, kv_block=64, q_tile=64, top_k=16), 1, 2, 4096, 4096),
    "d128_gqa4_causal_ragged": (dict(head_dim=128, kv_block=128, q_tile=128, top_k=12, causal=True, gqa_group=4,
                                     local=1, sink=1), 1, 2, 5000, 6001),
    "d64_gqa2_causal_q_gt_k": (dict(head_dim=64, kv_block=64, q_tile=128, top_k=8, causal=True, gqa_group=2),
                               2, 1, 3000, 2500),
    "d128_q4k_k16k": (dict(head_dim=128, kv_block=64, q_tile=64, top_k=16, gqa_group=8), 1, 1, 4096, 16384),
}
GPU_CONFIGS = {  # the shared-operand path (block_n < 16 * warps), two warpgroups, two stages
    "small_n": TileLangBwdDkdvConfig(block_n=32, block_m=32, num_stages=1, threads=128),
    "two_wg": TileLangBwdDkdvConfig(block_n=128, block_m=64, num_stages=1, threads=256),
    "stages2": TileLangBwdDkdvConfig(block_n=64, block_m=32, num_stages=2, threads=128),
}


def _leaves(b, hkv, g, nq, nk, d, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(b, hkv * g, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hkv * g, nq, d)]
    q, k, v, do = (torch.randn(s, generator=gen).to(device="cuda", dtype=dtype) for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _dkdv(spec, q, k, v, do, configs=None):
    attn = kernelgen.get_kernel(spec, configs=configs)
    assert attn.served("bwd_dkdv", k.shape[2], q.dtype, q.device).backend is TILELANG
    for x in (q, k, v):
        x.grad = None
    attn(q, k, v).backward(do)
    return k.grad, v.grad, attn.select(q.detach(), k.detach())


def _assert_close(got, want, dtype, name):
    from checks import GRAD_TOLERANCE

    rel_tol, abs_tol = GRAD_TOLERANCE[dtype]
    assert got.dtype == dtype and not torch.isnan(got).any(), name
    rel = ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()
    max_abs = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
    assert rel < rel_tol and max_abs < abs_tol, f"{name}: rel {rel:.2e} (tol {rel_tol}), max-abs {max_abs:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_against_reference(case, dtype):
    fields, b, hkv, nq, nk = GPU_CASES[case]
    spec = Spec(backend="tilelang", **fields)
    q, k, v, do = _leaves(b, hkv, spec.gqa_group, nq, nk, spec.head_dim, dtype, seed=len(case))
    dk, dv, lists = _dkdv(spec, q, k, v, do)
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists)
    _assert_close(dk, want[1], dtype, "dk")
    _assert_close(dv, want[2], dtype, "dv")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_pinned_configs_against_reference(name):
    fields, b, hkv, nq, nk = GPU_CASES["d128_gqa4_causal_ragged"]
    spec = Spec(backend="tilelang", **fields)
    q, k, v, do = _leaves(b, hkv, spec.gqa_group, nq, nk, spec.head_dim, torch.bfloat16, seed=3)
    dk, dv, lists = _dkdv(spec, q, k, v, do, configs={"bwd_dkdv": GPU_CONFIGS[name]})
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists)
    _assert_close(dk, want[1], torch.bfloat16, "dk")
    _assert_close(dv, want[2], torch.bfloat16, "dv")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d64_4k", "d128_gqa4_causal_ragged"])
def test_gpu_is_deterministic(case):
    fields, b, hkv, nq, nk = GPU_CASES[case]
    spec = Spec(backend="tilelang", **fields)
    q, k, v, do = _leaves(b, hkv, spec.gqa_group, nq, nk, spec.head_dim, torch.bfloat16, seed=1)
    first = [g.clone() for g in _dkdv(spec, q, k, v, do)[:2]]
    for _ in range(2):
        again = _dkdv(spec, q, k, v, do)[:2]
        assert all(torch.equal(a, b) for a, b in zip(first, again))

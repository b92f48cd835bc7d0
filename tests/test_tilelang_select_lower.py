"""The TileLang block selector ("mean" and "multi:r") renders, lowers to CUDA source for sm_90a,
compiles to a cubin, and (on TileLang's CPU target "c", one thread per program) picks exactly the
blocks of kernelgen.reference.select_blocks.

No GPU is needed: lowering is pure TVM, `tilelang.compile` for CUDA only runs nvcc, and the "c" target
runs the same kernels on the host with `threads=1` (no thread index, no barrier).
"""
from __future__ import annotations

import inspect
import itertools
import os
import re
import shutil

import pytest

pytestmark = pytest.mark.tilelang

pytest.importorskip("tilelang")

import torch  # noqa: E402

from kernelgen import Spec  # noqa: E402
from kernelgen import reference as ref  # noqa: E402
from checks import cubin_bytes  # noqa: E402
from kernelgen import tilelang_backend as tb  # noqa: E402
from kernelgen.compile import load_module  # noqa: E402
from kernelgen.render import module_name  # noqa: E402

POOL_PARAMS = ["batch", "heads", "seq", "head_dim", "tile", "groups", "dtype", "tiles", "threads"]
SELECT_PARAMS = [
    "batch", "heads_kv", "gqa_group", "seq_q", "seq_k", "head_dim", "q_tile", "kv_block", "top_k", "groups",
    "sink", "n_local", "causal", "threads",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _kernelgen_cache(tmp_path_factory, monkeypatch):
    # rendered modules go to a per-session temp dir, not the user's cache
    if "KERNELGEN_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernelgen_cache"))


def _spec(selector, causal, G, D, kv_block=64, q_tile=64, top_k=8, sink=0, local=0):
    return Spec(head_dim=D, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=G,
                selector=selector, sink=sink, local=local, backend="tilelang")


# selector x causal x (G, D); sink/local on for multi:4 so both forced and unforced structures render
GRID = [(sel, causal, G, D) for sel, causal, (G, D) in itertools.product(["mean", "multi:4"], [False, True],
                                                                          [(1, 64), (4, 128)])]


def _grid_spec(sel, causal, G, D):
    return _spec(sel, causal, G, D, sink=1 if sel != "mean" else 0, local=2 if sel != "mean" else 0)


@pytest.mark.parametrize("sel,causal,G,D", GRID)
def test_render_and_signatures(sel, causal, G, D):
    spec = _grid_spec(sel, causal, G, D)
    source = tb.select_source(spec)
    assert "{{" not in source and "{%" not in source
    assert f"CAUSAL = {causal}" in source and f"GROUPS = {spec.groups}" in source
    assert f"FORCED = {spec.n_forced > 0}" in source
    assert ("n_q_groups" in source) == (spec.groups > 1)  # the multi:r branch only when r > 1
    name = module_name(spec, "select", source)
    module = load_module(name, source)
    assert list(inspect.signature(module.build_pool).parameters) == POOL_PARAMS
    assert list(inspect.signature(module.build_select).parameters) == SELECT_PARAMS
    for fn in (module.build_pool, module.build_select):
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in inspect.signature(fn).parameters.values())
    shape = dict(batch=1, heads_kv=1, gqa_group=1, seq_q=64, seq_k=64, head_dim=D, q_tile=64, kv_block=64, top_k=1)
    with pytest.raises(ValueError, match="rendered for"):
        module.build_select(**shape, causal=not causal)
    with pytest.raises(ValueError, match="threads"):
        module.build_select(**shape, threads=48)


def test_given_selector_has_no_select_kernel():
    with pytest.raises(ValueError, match="given"):
        tb.select_source(_spec("given", False, 1, 64))


@pytest.mark.parametrize("sel,causal,G,D", GRID)
def test_lowers_sm90a(sel, causal, G, D):
    spec = _grid_spec(sel, causal, G, D)
    # ragged lengths: partial last Q tile and KV block, Nk != Nq (bottom-right causal)
    pool_q, pool_k, select = tb.build_select(spec, "bfloat16", batch=2, heads_kv=2, seq_q=1000, seq_k=1100)
    pq = tb.lower(pool_q)
    assert re.search(r"__launch_bounds__\(128, 1\) pool_kernel\(float\* __restrict__ REP, "
                     r"const bfloat16_t\* __restrict__ X\)", pq)
    assert "(float)X[" in pq  # fp32 accumulation of the bf16 rows
    pk = tb.lower(pool_k)
    assert "pool_kernel" in pk
    src = tb.lower(select)
    # three tensors, no [n_q_tiles, n_kv_blocks] scratch in HBM: scores live in shared memory
    assert re.search(r"__launch_bounds__\(128, 1\) select_topk_kernel\(int\* __restrict__ BLOCK_IDX, "
                     r"const float\* __restrict__ KREP, const float\* __restrict__ QREP\)", src)
    assert "extern __shared__" in src  # q reps, scores, reduction buffer, winners
    assert "__syncthreads()" in src
    assert "int64_t" in src and "4294967296" in src  # (score bits, inverted block id) sort keys
    assert "#pragma unroll" in src  # tree reduction / head_dim FMAs
    assert "-CUDART_INF_F" in src  # running max of the dot products
    assert ("best = CUDART_INF_F" in src) == (spec.n_forced > 0)  # forced blocks score +inf
    assert re.search(r"BLOCK_IDX\[.*rank", src) and re.search(r"= -1;", src)  # ranked store, empty slots -1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("sel,causal,G,D", [("multi:4", True, 4, 128), ("mean", False, 1, 64)])
def test_compile_cubin_without_gpu(sel, causal, G, D, nvcc_really_runs):
    spec = _grid_spec(sel, causal, G, D)
    pool_q, _, select = tb.build_select(spec, "float16", batch=2, heads_kv=2, seq_q=1000, seq_k=1100)
    for prim_func, out_idx, name in ((pool_q, tb.POOL_OUT_IDX, b"pool_kernel"),
                                     (select, tb.SELECT_OUT_IDX, b"select_topk_kernel")):
        kernel = tb.compile_kernel(prim_func, out_idx=out_idx)
        cubin = cubin_bytes(kernel)
        assert cubin[:4] == b"\x7fELF"
        assert b"sm_90a" in cubin and name in cubin


def _run_cpu(spec, B, Hkv, Nq, Nk, seed=0):
    import tilelang

    pool_q, pool_k, select = tb.build_select(spec, "float16", batch=B, heads_kv=Hkv, seq_q=Nq, seq_k=Nk,
                                             threads=1, pool_threads=1)
    kq, kk, ks = (tilelang.compile(f, out_idx=o, target="c")
                  for f, o in ((pool_q, tb.POOL_OUT_IDX), (pool_k, tb.POOL_OUT_IDX), (select, tb.SELECT_OUT_IDX)))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * spec.gqa_group, Nq, spec.head_dim, generator=g).half()
    k = torch.randn(B, Hkv, Nk, spec.head_dim, generator=g).half()
    q_rep, k_rep = kq(q), kk(k)
    return q, k, q_rep, k_rep, ks(q_rep, k_rep)


# tiny shapes; ragged Nq, Nk; Nq > Nk under causal leaves the first tiles with nothing (or little) visible
CPU_CASES = [
    ("multi:4", True, 4, dict(sink=1, local=2), 100, 150),
    ("mean", False, 1, dict(), 100, 150),
    ("mean", True, 2, dict(), 150, 70),
    ("multi:2", False, 2, dict(sink=1, local=1), 90, 200),
]


@pytest.mark.parametrize("sel,causal,G,forced,Nq,Nk", CPU_CASES)
def test_matches_reference_on_cpu_target(sel, causal, G, forced, Nq, Nk):
    spec = _spec(sel, causal, G, 64, kv_block=16, q_tile=16, top_k=5, **forced)
    q, k, q_rep, k_rep, block_idx = _run_cpu(spec, 2, 2, Nq, Nk)
    for x, rep, tile in ((q, q_rep, spec.q_tile), (k, k_rep, spec.kv_block)):
        means, _ = ref.pool(x, tile, spec.groups)
        torch.testing.assert_close(rep.double(), means, rtol=1e-6, atol=1e-6)
    expected = ref.select_blocks(q, k, spec)
    assert block_idx.dtype == torch.int32 and block_idx.shape == expected.shape
    assert torch.equal(block_idx, expected)

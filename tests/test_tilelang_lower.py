"""The TileLang forward kernel renders, lowers to CUDA source for sm_90a and compiles to a cubin.

No GPU is needed: lowering is pure TVM and `tilelang.compile` only runs nvcc. Numerical checks of the
kernel against kernelgen.reference run on a GPU elsewhere (tests marked `gpu`).
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import re
import shutil

import pytest

pytestmark = pytest.mark.tilelang

pytest.importorskip("tilelang")

import kernelgen.dispatch  # noqa: E402
from kernelgen import Spec  # noqa: E402
from kernelgen.archs import arch_facts  # noqa: E402
from kernelgen.backends import tilelang as tb  # noqa: E402
from kernelgen.backends.tilelang import TileLangAttnConfig  # noqa: E402
from kernelgen.codegen.cache import load_module  # noqa: E402
from kernelgen.codegen.render import module_name  # noqa: E402
from checks import config_space, cubin_bytes, default_config  # noqa: E402

BUILD_PARAMS = [
    "batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "kv_block", "q_tile", "top_k",
    "causal", "window", "dtype", "block_M", "block_N", "num_stages", "threads", "overlap", "pingpong",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _kernelgen_cache(tmp_path_factory, monkeypatch):
    # rendered modules go to a per-session temp dir, not the user's cache
    if "KERNELGEN_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernelgen_cache"))


def _config(G: int, q_tile: int) -> dict:
    """Known-good defaults on TileLang 0.1.15: 128 packed rows on two warpgroups when a tile (all its
    heads) fills them, else 64 rows on one (one stage: backends.tilelang.attn_infeasible)."""
    if G * q_tile >= 128:
        return dict(block_M=128, threads=256, num_stages=2)
    return dict(block_M=64, threads=128, num_stages=1)


def _spec(causal, D, G, kv_block, q_tile):
    return Spec(head_dim=D, kv_block=kv_block, q_tile=q_tile, top_k=8, causal=causal, gqa_group=G, backend="tilelang")


def _build(causal, D, G, kv_block, q_tile, dtype="bfloat16", **config):
    # ragged lengths: a partial last Q tile and a partial last KV block, Nk != Nq (bottom-right causal)
    tunables = _config(G, q_tile)
    tunables.update(config)
    return tb.build_attn(_spec(causal, D, G, kv_block, q_tile), dtype, batch=2, heads_kv=2, seq_q=1000, seq_k=1100,
                         **tunables)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_render_and_build_signature(causal, dtype):
    spec = _spec(causal, 64, 1, 64, 64)
    source = tb.attn_source(spec, dtype)
    assert "{{" not in source and "{%" not in source
    assert f'DTYPE = "{dtype}"' in source and f'"causal": {str(causal).lower()}' in source  # the spec, recorded
    # causal is an argument of build(), not a Jinja branch: the other causal renders the same code
    other = tb.attn_source(spec.replace(causal=not causal), dtype)
    code = [[line for line in text.splitlines() if not line.startswith("# spec: ")] for text in (source, other)]
    assert other != source and code[0] == code[1]
    name = module_name("tilelang", "attn", source)
    assert name.startswith("kg_tilelang_attn_")
    module = load_module(name, source)
    assert load_module(name, source) is module  # content-addressed: same text, same module
    params = inspect.signature(module.build).parameters
    assert list(params) == BUILD_PARAMS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    shape = dict(batch=1, heads_q=1, heads_kv=1, seq_q=64, seq_k=64, head_dim=64, kv_block=64, q_tile=64, top_k=1)
    other_dtype = next(d for d in tb.DTYPES if d != dtype)
    with pytest.raises(ValueError, match="rendered for"):  # the dtype is the one thing rendered in
        module.build(**shape, causal=causal, dtype=other_dtype, block_M=64, num_stages=1, threads=128)


def test_build_rejects_bad_tiles():
    with pytest.raises(ValueError, match="block_N"):
        _build(False, 64, 1, 64, 64, block_N=48)
    with pytest.raises(ValueError, match="one must divide"):
        _build(False, 64, 1, 64, 64, block_M=48)
    with pytest.raises(ValueError, match="pingpong needs overlap"):
        _build(False, 64, 2, 64, 64, overlap=False, pingpong=True)


# every variant of the Triton CPU test grid (causal x G x D x kv_block x q_tile), with its default config
LOWER_GRID = list(itertools.product([False, True], [64, 128], [1, 2, 4], [64, 128], [64, 128]))
LOOPS = ["plain", "overlap", "pingpong"]


def _variant_config(spec, loop):
    cfg = dataclasses.replace(default_config(spec, "attn"), overlap=loop != "plain", pingpong=loop == "pingpong")
    return None if cfg.pingpong and cfg.threads != 256 else cfg  # ping-pong needs two consumer warpgroups


def _structure(spec, cfg):
    """What decides the kernel's code: the branches of build() that TileLang takes when it parses the kernel
    (causal, an argument of build(); one or two warpgroups, the loop, a split tile or packed heads) and the
    tile shapes its layouts and wgmmas follow. Variants that agree on it differ only in integer constants
    (G, rows per program), not in what TileLang lays out or nvcc builds."""
    return (spec.causal, spec.head_dim, spec.kv_block, dataclasses.astuple(cfg), cfg.block_m < spec.q_tile,
            cfg.block_m > spec.q_tile)


def _grid_variants():
    """(grid point, loop, spec, config) of every variant of the grid: 136."""
    for point in LOWER_GRID:
        spec = _spec(*point)
        for loop in LOOPS:
            cfg = _variant_config(spec, loop)
            if cfg is not None:
                yield point, loop, spec, cfg


def _one_variant_per_structure():
    """The grid's variants, one per kernel structure (64 of 136): each lowers and nvcc-compiles in 10-20 s of
    CPU, so compiling every variant would make CI twice as long for no more code covered. The variant kept
    is the one with the most heads packed."""
    kept = {}
    for point, loop, spec, cfg in sorted(_grid_variants(), key=lambda v: -v[2].gqa_group):
        kept.setdefault(_structure(spec, cfg), (*point, loop))
    return sorted(kept.values())


COMPILE_GRID = _one_variant_per_structure()


def test_compile_grid_holds_every_structure_of_the_grid():
    """Every (grid point, loop) has a compiled variant with its structure, and every template branch occurs."""
    kept = [(spec, cfg) for point, loop, spec, cfg in _grid_variants() if (*point, loop) in COMPILE_GRID]
    compiled = {_structure(spec, cfg) for spec, cfg in kept}
    every = {_structure(spec, cfg) for _, _, spec, cfg in _grid_variants()}
    assert compiled == every and len(COMPILE_GRID) == len(every) < len(LOWER_GRID) * len(LOOPS)
    assert {v[5] for v in COMPILE_GRID} == set(LOOPS) and {v[0] for v in COMPILE_GRID} == {False, True}
    # one and two warpgroups, and two warpgroups packing heads
    assert {(cfg.threads, cfg.block_m > spec.q_tile) for spec, cfg in kept} == {(128, False), (256, False), (256, True)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("causal,D,G,kv_block,q_tile,loop", COMPILE_GRID)
def test_grid_lowers_and_compiles_sm90a(causal, D, G, kv_block, q_tile, loop, nvcc_really_runs):
    """Every kernel structure of the test grid, with its default config (overlap off and on, and, with two
    consumer warpgroups, ping-pong): CUDA source for sm_90a and a cubin from nvcc."""
    spec = _spec(causal, D, G, kv_block, q_tile)
    cfg = _variant_config(spec, loop)
    overlap = cfg.overlap
    assert cfg in config_space(spec, "attn")
    func = tb.build_attn(spec, "bfloat16", batch=2, heads_kv=2, seq_q=1000, seq_k=1100, config=cfg)
    kernel = tb.compile_attn(func, cfg, "sm_90a")  # dispatch's build (its pass configs)
    cubin = cubin_bytes(kernel)
    assert cubin[:4] == b"\x7fELF" and b"sm_90a" in cubin and b"attn_fwd_kernel" in cubin
    src = kernel.get_kernel_source()
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(\d+, 1\) attn_fwd_kernel\(', src)
    assert "tl::wgmma_ss<" in src  # S = Q K^T from shared memory
    assert "tl::wgmma_rs<" in src  # O += P V with P in registers
    assert f"< {1100}" in src  # elementwise mask of the partial last KV block (Nk = 1100)
    assert "-CUDART_INF_F" in src
    assert "float scale" in src  # run-time softmax scale
    if cfg.threads == 128:
        # one warpgroup, no producer (backends.tilelang.attn_pass_configs): cp.async loads, no mbarrier
        assert "__launch_bounds__(128, 1)" in src and "tl::cp_async" in src
        assert "mbarrier" not in src and "CUtensorMap" not in src and "warpgroup_reg_alloc" not in src
        assert ("wait_wgmma" in src) == overlap  # overlap: QK and PV in flight together, waited for apart
        return
    # two consumer warpgroups: TMA loads of K/V, mbarrier pipeline, a warp-specialised producer
    assert "CUtensorMap K_desc" in src and "CUtensorMap V_desc" in src
    assert "tl::tma_load(K_desc" in src and "tl::tma_load(V_desc" in src
    # a program holding one head copies its Q rows with TMA (an element-wise gather was one serialised
    # load per element on the H200); programs packing several heads gather
    assert ("tl::tma_load(Q_desc" in src) == (cfg.block_m <= q_tile)
    assert "mbarrier" in src
    # setmaxnreg: 240 for the consumers, 24 for the producer
    assert "tl::warpgroup_reg_alloc<240>();" in src
    if overlap:
        # QK and PV in flight together; the K buffer is released only after QK's wait, V's after PV's
        assert src.count("tl::wgmma_ss<") == src.count("tl::wgmma_rs<") == 1
        for n, buf in ((1, 0), (0, 1)):
            assert re.search(rf"tl::wait_wgmma<{n}>\(\);\s*touch\[{buf}\] = [^\n]*\n\s*mbarrier\[[^\]]*\]\.arrive\(\);",
                             src), f"no buffer release right after wait_wgmma<{n}>"
    else:
        assert "wait_wgmma" not in src
    # ping-pong: in the loop, each consumer warpgroup (threads 128-255 and 256-383: TileLang's producer is
    # warpgroup 0) waits on its own named barrier (8, 9) before its gemms and arrives on the other's after
    turns = re.search(r"__sync_thread_partial\(\(\(\(\(int\)threadIdx\.x\) >> 7\) \+ 7\), 256\);"
                      r".*?tl::wgmma_ss<.*?tl::wgmma_rs<.*?__named_barrier_arrive\(\(10 - \(\(\(int\)threadIdx\.x\) >> 7\)\), 256\);"
                      r".*?tl::wait_wgmma<1>", src, re.S)
    assert bool(turns) == cfg.pingpong
    assert ("__named_barrier_arrive(8, 256);" in src) == cfg.pingpong  # warpgroup 1 lets warpgroup 0 start
    # TileLang numbers its own named barriers from 3 up (0-2 reserved): they must stay below ping-pong's 8
    assert all(int(n) < 8 for n in re.findall(r"__sync_thread_partial\((\d+),", src))


def test_split_tile_and_sub_blocks_lower():
    # block_M < q_tile (two programs per tile) and block_N < kv_block (two sub-blocks per block)
    # (64 rows: one warpgroup, built as dispatch builds it: attn_pass_configs)
    func = _build(True, 128, 1, 128, 128, block_M=64, block_N=64, threads=128, num_stages=1, dtype="float16")
    cfg = TileLangAttnConfig(block_m=64, num_stages=1, threads=128)
    src = tb.lower(func, "sm_90a", pass_configs=tb.attn_pass_configs(cfg, "sm_90a"))
    assert "attn_fwd_kernel" in src and "half_t" in src and "tl::wgmma_ss<" in src and "tl::cp_async" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("threads", [256, 128])
def test_forward_builds_fast_math_and_one_warpgroup_without_producer(nvcc_really_runs, tmp_path, threads):
    """Both forwards are built with nvcc's fast math (backends.tilelang.attn_pass_configs): each score's
    exp2 is one MUFU.EX2, with no denormal range check around it (FSETP against -126 and two
    predicated FMUL per score, which made the (b) forward 7% slower on the H200). The one-warpgroup
    forward (128 threads) has no producer warpgroup and no mbarrier: with one, it hung on the H200.
    The cubin that compile_attn (the path of TileLangBackend.build, the tuner's and exports') builds says so."""
    import subprocess
    from pathlib import Path

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("triton ships no cuobjdump here")
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=16, backend="tilelang")
    cfg = dataclasses.replace(default_config(spec, "attn"), block_m=128 if threads == 256 else 64, threads=threads,
                              num_stages=2 if threads == 256 else 1)
    func = tb.build_attn(spec, "bfloat16", batch=1, heads_kv=1, seq_q=1024, seq_k=4096, config=cfg)
    (tmp_path / "attn.cubin").write_bytes(cubin_bytes(tb.compile_attn(func, cfg, "sm_90a")))
    sass = subprocess.run([str(cuobjdump), "-sass", str(tmp_path / "attn.cubin")], capture_output=True, text=True,
                          check=True).stdout
    assert sass.count("MUFU.EX2") >= 64  # the scores of one step, unrolled
    assert "-126" not in sass, "exp2f kept its denormal range check: built without fast math?"
    # mbarrier waits (the producer/consumer handshake) only in the warp-specialised build
    assert ("SYNCS.PHASECHK" in sass) == (threads == 256)
    assert ("LDGSTS" in sass) == (threads == 128)  # cp.async: the one warpgroup loads K and V itself


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_bench_precompiles_the_tilelang_forwards(monkeypatch):
    """The bench compiles each shape's TileLang forward (a per-shape backend's) in parallel processes before
    timing anything; a kernel that fails to build is reported in the log line, never dropped silently."""
    import importlib
    import multiprocessing
    import types

    import torch

    import kernelgen.device
    from kernelgen.tuning import worker

    bench_run = importlib.import_module("kernelgen.bench.measure")

    # no GPU here: the H200's arch, in precompile processes forked from this one (spawned ones would not
    # see the stand-in)
    monkeypatch.setattr(worker, "multiprocessing",
                        types.SimpleNamespace(get_context=lambda method=None: multiprocessing.get_context("fork")))
    monkeypatch.setattr(tb, "target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(kernelgen.device, "device_arch", lambda device: "sm_90")  # TileLangBackend.archs asks it
    monkeypatch.setattr(kernelgen.dispatch, "device_arch", lambda device: "sm_90")  # whose default configs it serves
    lines = []
    bench_run._precompile_per_shape(["tiny", "b"], torch.device("cuda"), log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("precompiled 2 per-shape forwards (tilelang)"), lines
    assert "failed" not in lines[0], lines
    monkeypatch.setattr(tb, "target_arch", lambda device: "sm_00")  # an arch nvcc rejects
    lines.clear()
    bench_run._precompile_per_shape(["tiny"], torch.device("cuda"), log=lines.append)
    assert len(lines) == 1 and "failed" in lines[0], lines


# ---- sm_80, sm_86, sm_89: mma.sync and a cp.async pipeline, from the same template --------------------------

def _mma_config(spec, arch, point):
    """The default config on `arch`, or its feasible point with the most shared memory (more threads on a tie)."""
    if point == "default":
        return tb.attn_default(spec, arch)
    feasible = [c for c in tb.attn_space(spec, arch) if tb.attn_infeasible(spec, c, arch) is None]
    return max(feasible, key=lambda c: (tb.attn_smem_bytes(spec, c), c.threads))


# (causal, D, G, kv_block, q_tile), arch, point: D 64 and 128, 64- and 128-blocks, one head per program, heads
# packed (G=4, q_tile=64: two per program), 4 and 8 warps, 1 to 3 stages, sm_89's smaller shared memory
MMA_COMPILE_CASES = [
    ((True, 128, 4, 128, 128), "sm_89", "default"),  # 128 rows, 8 warps, 1 stage (2 need 160 KB)
    ((True, 128, 4, 128, 128), "sm_80", "largest"),  # 2 stages: 160 KB of sm_80's 163 KB
    ((False, 64, 1, 64, 64), "sm_80", "default"),  # 64 rows, 4 warps, 2 stages
    ((False, 64, 1, 64, 64), "sm_89", "largest"),  # 3 stages
    ((True, 64, 4, 64, 64), "sm_80", "default"),  # 128 rows of two heads on 4 warps, 2 stages
    ((True, 64, 4, 64, 64), "sm_89", "largest"),  # ... on 8 warps, 3 stages
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("point,arch,which", MMA_COMPILE_CASES,
                         ids=["-".join(map(str, (*point, arch, which))) for point, arch, which in MMA_COMPILE_CASES])
def test_forward_lowers_and_compiles_for_sm80_and_sm89(point, arch, which, nvcc_really_runs):
    """The forward off Hopper, built as dispatch builds it there (compile_attn with the arch's build options):
    mma.sync from ldmatrix operands, K and V by cp.async in a pipeline of num_stages steps, no wgmma, TMA,
    mbarrier or register reallocation; a cubin for the arch from nvcc; the shared memory the kernel asks for is
    attn_smem_bytes and within the arch's limit."""
    spec = _spec(*point)
    cfg = _mma_config(spec, arch, which)
    assert not cfg.overlap and not cfg.pingpong and tb.attn_infeasible(spec, cfg, arch) is None
    func = tb.build_attn(spec, "bfloat16", batch=2, heads_kv=2, seq_q=1000, seq_k=1100, config=cfg)
    kernel = tb.compile_attn(func, cfg, arch)
    cubin = cubin_bytes(kernel)
    assert cubin[:4] == b"\x7fELF" and arch.encode() in cubin and b"attn_fwd_kernel" in cubin
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__({cfg.threads}, 1) attn_fwd_kernel(" in src
    assert "tl::mma_sync<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 16, 8, 16" in src
    assert "tl::ptx_ldmatrix_x4(" in src and "tl::ptx_ldmatrix_x4_trans(" in src  # K^T and V operands
    # K and V: two cp.async groups a step, num_stages steps in flight (the deepest wait leaves 2 * stages - 1)
    assert "tl::cp_async_gs_conditional<16>" in src and "tl::cp_async_commit();" in src
    waits = {int(n) for n in re.findall(r"tl::cp_async_wait<(\d+)>\(\);", src)}
    assert max(waits) == 2 * cfg.num_stages - 1 and 0 in waits
    for hopper_only in ("wgmma", "tma_load", "CUtensorMap", "mbarrier", "warpgroup_reg", "setmaxnreg", "fence_proxy"):
        assert hopper_only not in src, hopper_only
    assert f"< {1100}" in src and "-CUDART_INF_F" in src and "float scale" in src
    # shared memory: one dynamic buffer, of the size attn_infeasible checks against the arch's limit
    assert len(re.findall(r"__shared__", src)) == 1 and "extern __shared__" in src
    smem = [int(f.attrs["dyn_shared_memory_buf"]) for f in kernel.artifact.device_mod.functions.values()]
    assert smem == [tb.attn_smem_bytes(spec, cfg)] and smem[0] <= arch_facts(arch).smem_per_block


def test_hopper_only_configs_are_refused_before_building_off_hopper(monkeypatch):
    """A config the device's arch cannot run (overlap off Hopper, more shared memory than sm_89 has) is a clear
    error from TileLangBackend.build, before anything is lowered."""
    import torch

    from kernelgen.backends.base import Problem, Shapes
    from kernelgen.errors import KernelgenValueError

    spec = _spec(True, 128, 4, 128, 128)
    problem = Problem(torch.bfloat16, Shapes(1, 8, 2, 1000, 1100, 8, 9), torch.device("cuda"))
    monkeypatch.setattr(tb, "target_arch", lambda device: "sm_89")
    backend = tb.TileLangBackend()
    for cfg, why in ((TileLangAttnConfig(128, 1, 256, overlap=True), "overlap=True, pingpong=False on sm_89"),
                     (TileLangAttnConfig(128, 2, 256), "163840 B of shared memory .*sm_89 allows at most 101376 B")):
        with pytest.raises(KernelgenValueError, match=rf"cannot run on sm_89: {why}"):
            backend.build(spec, "attn", cfg, problem)

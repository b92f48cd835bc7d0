"""TileLang backend through get_kernel: GPU runs against the float64 reference; a clear error on CPU, where
its selection still runs (the Triton selector, in the interpreter)."""
import dataclasses

import pytest
import torch

import kernelgen
from kernelgen import Spec, backends
from kernelgen.backends.triton import SelectConfig
from checks import assert_close_to_reference, assert_exported_module_matches_get_kernel, default_config, feasible
from test_triton_fwd import GPU_CASES, check_empty_lists, given_lists, gpu_case, make_inputs, run_and_check

pytest.importorskip("tilelang")


def test_cpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, backend="tilelang")
    q, k, v = make_inputs(1, 1, 1, 128, 128, 64, torch.float16, "cpu", 0)
    with pytest.raises(ValueError, match="backend='tilelang' runs on cuda devices only, not on cpu"):
        kernelgen.get_kernel(spec)(q, k, v)


def test_selection_runs_the_triton_selector(device):
    """A TileLang spec selects with the Triton kernels (TileLang has no selector; the interpreter on the
    CPU): the same lists as a Triton spec's."""
    assert "select" not in backends.get("tilelang").roles and backends.runner("tilelang", "select").name == "triton"
    q, k, _ = make_inputs(1, 2, 2, 200, 300, 64, torch.float16, device, 1)
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=3, causal=True, gqa_group=2, backend="tilelang")
    attn = kernelgen.get_kernel(spec)
    assert isinstance(attn.config("select", 200, 300, device=device), SelectConfig)
    assert torch.equal(attn.select(q, k), kernelgen.get_kernel(spec.replace(backend="triton")).select(q, k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_tilelang_against_reference(case, dtype):
    run_and_check(*gpu_case(case, dtype, backend="tilelang"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_tilelang_overlap_against_reference(case):
    """The FlashAttention-3-style loop (QK of the next sub-block and PV of the last one in flight together)
    with the largest tile a case allows, with two stages where that tile has them, and with one."""
    spec, q, k, v = gpu_case(case, torch.bfloat16, seed_offset=3, backend="tilelang")
    cfg = default_config(spec, "attn")
    configs = [dataclasses.replace(cfg, num_stages=stages, overlap=True) for stages in (2, 1)]
    configs = [c for c in configs if feasible(spec, "attn", c)]  # one warpgroup: one stage
    assert configs[-1].num_stages == 1 and len(configs) == (2 if cfg.threads == 256 else 1)
    for overlap_cfg in configs:
        run_and_check(spec, q, k, v, configs={"attn": overlap_cfg})


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[2] * c[7] >= 128], ids=lambda c: "-".join(map(str, c)))
def test_gpu_tilelang_pingpong_against_reference(case):
    """FlashAttention-3's ping-pong (two consumer warpgroups taking turns issuing their gemms), with one
    and two stages where the shared memory holds them (one at 256-key blocks), on every case whose tile fills
    two warpgroups."""
    spec, q, k, v = gpu_case(case, torch.bfloat16, seed_offset=5, backend="tilelang")
    configs = [dataclasses.replace(default_config(spec, "attn"), block_m=128, threads=256, num_stages=stages,
                                   overlap=True, pingpong=True) for stages in (1, 2)]
    configs = [c for c in configs if feasible(spec, "attn", c)]
    assert configs and configs[0].num_stages == 1
    for cfg in configs:
        run_and_check(spec, q, k, v, configs={"attn": cfg})


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["plain", "overlap", "pingpong"])
def test_gpu_tilelang_empty_lists(loop):
    """Tiles whose list holds no valid id (all -1 or out of range) give o = 0, lse = -inf; the others are
    still right."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=8, causal=True, gqa_group=2, selector="given",
                backend="tilelang")
    cfg = dataclasses.replace(default_config(spec, "attn"), overlap=loop != "plain", pingpong=loop == "pingpong")
    check_empty_lists(spec, {"attn": cfg})


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tilelang_given_lists(causal):
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=causal, gqa_group=4, selector="given",
                backend="tilelang")
    q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 29)
    run_and_check(spec, q, k, v, block_idx=given_lists(spec, 1, 2, 8192, 8192, 2, "cuda"))


@pytest.mark.gpu
def test_gpu_auto_backend_against_reference():
    """backend='auto' runs whichever backend the tuning DB names (Triton when nothing is tuned), one that can
    serve the spec on this GPU, correctly."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given",
                backend="auto")
    q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 37)
    attn = kernelgen.get_kernel(spec)
    able = {b.name for b in backends.all_backends() if "attn" in b.roles and b.unsupported(spec, q.device) is None}
    assert attn.backend(8192, q.dtype, q.device) in able
    run_and_check(spec, q, k, v, block_idx=given_lists(spec, 1, 2, 8192, 8192, 2, "cuda"))


@pytest.mark.gpu
def test_gpu_exported_tilelang_module_matches_get_kernel(tmp_path):
    assert_exported_module_matches_get_kernel("tilelang", tmp_path)

_MANY_CALLS_CHILD = """
import sys, torch, kernelgen
from kernelgen.backends.tilelang import TileLangAttnConfig
threads, block_m, stages, overlap = (int(x) for x in sys.argv[1:5])
spec = kernelgen.Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, selector="given", backend="tilelang")
gen = torch.Generator(device="cuda").manual_seed(5)
q, k, v = (torch.randn(1, 8, 32768, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
idx = torch.rand(1, 8, 512, 512, device="cuda", generator=gen).argsort(-1)[..., :16].int()
attn = kernelgen.get_kernel(spec, configs={"attn": TileLangAttnConfig(block_m, stages, threads, bool(overlap))})
first = attn(q, k, v, block_idx=idx)
for _ in range(300):
    out = attn(q, k, v, block_idx=idx)
torch.cuda.synchronize()
assert torch.equal(out, first) and not first.isnan().any()
graph = torch.cuda.CUDAGraph()  # back-to-back replays (where the warp-specialised build hung)
with torch.cuda.graph(graph):
    for _ in range(10):
        out = attn(q, k, v, block_idx=idx)
for _ in range(50):
    graph.replay()
torch.cuda.synchronize()
assert torch.equal(out, first)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_tilelang_one_warpgroup_forward_survives_many_calls(overlap):
    """a32k's spec (D=64, 64-blocks, 32k keys) with the one-warpgroup forward (every point of its space):
    300 calls, then 500 more replayed from a CUDA graph. Built with a producer warpgroup it hung on
    the H200 (with fast math a call never returned; without it the graph replay never finished); it
    runs in a child process so that a hang fails this test after 240 s instead of stalling the suite."""
    threads, block_m, stages = 128, 64, 1
    import subprocess
    import sys

    try:
        result = subprocess.run([sys.executable, "-c", _MANY_CALLS_CHILD, str(threads), str(block_m), str(stages),
                                 str(int(overlap))], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"overlap={overlap}: 300 calls and 500 graph replays did not finish in 240 s (a hung kernel?)")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---- the forward of sm_80 to sm_89 (mma.sync, cp.async pipeline), run on this GPU ----------------------------

MMA_GPU_CASES = [
    # (B, Hkv, G, Nq, Nk, D, kv_block, q_tile, top_k, causal): ragged lengths, Nq != Nk both ways
    (1, 2, 4, 2000, 2100, 128, 128, 128, 8, True),
    (2, 1, 1, 3000, 2900, 64, 64, 64, 16, False),
    (1, 2, 4, 2048, 4096, 64, 64, 64, 16, True),  # two heads per 128-row program
    (1, 2, 2, 1500, 1400, 128, 64, 128, 12, False),
]


def _mma_points(spec, arch):
    """(config, dtype) to run off Hopper: the default in bf16 and fp16, the feasible point with the most shared
    memory and the smallest one (64 rows, one stage: a split tile where q_tile is 128) in bf16."""
    from kernelgen.backends import tilelang as tb

    feasible = [c for c in tb.attn_space(spec, arch) if tb.attn_infeasible(spec, c, arch) is None]
    default = tb.attn_default(spec, arch)
    largest = max(feasible, key=lambda c: (tb.attn_smem_bytes(spec, c), c.threads))
    smallest = min(feasible, key=lambda c: (c.block_m, c.num_stages, c.threads))
    return list(dict.fromkeys([(default, torch.bfloat16), (default, torch.float16), (largest, torch.bfloat16),
                               (smallest, torch.bfloat16)]))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("case", MMA_GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_tilelang_mma_forward_against_reference(case, arch):
    """The forward TileLang builds for sm_80 and sm_89 (mma.sync from ldmatrix, a cp.async pipeline; no wgmma or
    TMA), lowered for `arch` with that arch's build options (attn_pass_configs) and compiled by nvcc from its
    compute_XX code for this GPU's SASS, so that an H200 runs the very kernel an A100 or an L40 would. Lists with
    -1, out-of-range ids and whole empty tiles (o = 0, lse = -inf); outputs NaN-poisoned; against the float64
    reference."""
    import math

    import tilelang

    from kernelgen import reference
    from kernelgen.backends import tilelang as tb
    from kernelgen.device import device_arch

    b, hkv, g, nq, nk, d, kv_block, q_tile, top_k, causal = case
    spec = Spec(head_dim=d, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=g,
                selector="given", backend="tilelang")
    idx = given_lists(spec, b, hkv, nq, nk, nq + d, "cuda")
    idx[:, :, ::5] = -1  # whole tiles with no block
    target = {"kind": "cuda", "arch": arch, "code": [device_arch("cuda")]}
    for cfg, dtype in _mma_points(spec, arch):
        assert not cfg.overlap and not cfg.pingpong
        q, k, v = make_inputs(b, hkv, g, nq, nk, d, dtype, "cuda", nq + nk + d + cfg.block_m)
        func = tb.build_attn(spec, dtype, batch=b, heads_kv=hkv, seq_q=nq, seq_k=nk, config=cfg)
        kernel = tilelang.compile(func, out_idx=[], target=target, pass_configs=tb.attn_pass_configs(cfg, arch))
        src = kernel.get_kernel_source()
        assert "tl::mma_sync<" in src and "tl::cp_async_gs_conditional" in src and "wgmma" not in src
        o = torch.full_like(q, math.nan)
        lse = torch.full((b, hkv * g, nq), math.nan, device="cuda", dtype=torch.float32)
        kernel(q, k, v, idx, 1.0 / math.sqrt(d), o, lse)
        torch.cuda.synchronize()
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
        try:
            assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
        except AssertionError as error:
            raise AssertionError(f"{arch} {cfg} {dtype}: {error}") from None
        full = nq // q_tile * q_tile  # the rows of whole tiles: [B, Hkv, G, tile, row]
        tiles = lse.view(b, hkv, g, nq)[..., :full].reshape(b, hkv, g, nq // q_tile, q_tile)
        assert torch.isneginf(tiles[:, :, :, ::5]).all()  # the empty tiles

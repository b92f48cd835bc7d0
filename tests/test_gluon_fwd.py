"""Gluon backend through get_kernel: GPU runs (Hopper only) against the float64 reference; on the CPU, a
clear error instead of a forward, and the launch path's own checks."""
import dataclasses
from pathlib import Path

import pytest
import torch

import kernelgen
from kernelgen import Spec, backends, reference
from kernelgen.backends import Shapes, gluon
from kernelgen.backends.gluon import KV_BLOCKS, GluonAttnConfig
from kernelgen.backends.triton import SelectConfig
from kernelgen.dispatch import SparseAttention
from kernelgen.roles import get_role
from checks import (assert_close_to_reference, assert_exported_module_matches_get_kernel, config_space,
                    default_config, served_backend)
from test_triton_fwd import GPU_CASES, check_empty_lists, given_lists, gpu_case, make_inputs, run_and_check

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on Hopper GPUs (sm_90) only")

SPEC = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, backend="gluon")


# ---- CPU: never a silent fallback ---------------------------------------------------------------------

@pytest.mark.parametrize("spec, configs", [
    (SPEC, None),
    (SPEC.replace(backend="auto"), {"attn": GluonAttnConfig(block_m=64)}),  # a pinned config picks Gluon
])
def test_cpu_is_a_clear_error(spec, configs):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    q, k, v = make_inputs(1, 1, 1, 128, 128, 64, torch.float16, "cpu", 0)
    attn = kernelgen.get_kernel(spec, configs=configs)
    assert attn.backend(128, device="cpu") == "gluon"
    with pytest.raises(ValueError, match=r"backend='gluon' runs on CUDA GPUs \(Hopper, sm_90\) only, not under "
                                         r"TRITON_INTERPRET=1"):
        attn(q, k, v)


def test_selection_runs_the_triton_selector(device):
    """A Gluon spec selects with the Triton kernels (the interpreter on the CPU): the same lists."""
    q, k, _ = make_inputs(1, 2, 2, 200, 300, 64, torch.float16, device, 1)
    spec = SPEC.replace(gqa_group=2, top_k=3)
    attn = kernelgen.get_kernel(spec)
    assert isinstance(attn.config("select", 200, 300, device=device), SelectConfig)
    assert torch.equal(attn.select(q, k), kernelgen.get_kernel(spec.replace(backend="triton")).select(q, k))


def test_the_attention_module_is_the_rendered_gluon_kernel():
    """The attention role of a Gluon spec is Gluon's, built from its rendered template; selection and list
    normalising are the fallback's (Triton's) rendered kernels."""
    backend, kernel_spec = served_backend(SPEC, "attn")
    assert backend is backends.get("gluon") and kernel_spec.backend == "gluon"
    assert default_config(SPEC, "attn") == GluonAttnConfig(64, 3)
    mod = backend.build(kernel_spec, "attn", GluonAttnConfig(64, 3))
    assert mod.__name__.startswith("kg_gluon_attn_") and type(mod.attn_fwd.fn).__name__ == "GluonJITFunction"
    assert '"block_m": 64, "num_stages": 3' in Path(mod.__file__).read_text()  # the config, recorded
    for role, kernel in (("select", "select_topk"), ("lists", "normalize_lists")):
        backend, kernel_spec = served_backend(SPEC, role)
        assert backend is backends.get("triton") and kernel_spec.backend == "triton"
        mod = backend.build(kernel_spec, role, default_config(SPEC, role))
        assert mod.__name__.startswith(f"kg_triton_{role}_") and hasattr(mod, kernel)


def test_float32_is_a_type_error():
    q, k, v = make_inputs(1, 1, 1, 64, 64, 64, torch.float32, "cpu", 0)
    shapes = Shapes(1, 1, 1, 64, 64, 1, 1)
    launch = backends.get("gluon").role("attn").launch
    assert launch is gluon.launch_attn
    with pytest.raises(TypeError, match=r"q.dtype = torch.float32 is not supported by backend='gluon'; expected "
                                        "float16 or bfloat16"):
        launch(None, SPEC, GluonAttnConfig(64), shapes, q, k, v, None, None)


@pytest.fixture
def fresh_device_arch():
    """device_arch caches each GPU's arch and name: a test that fakes them starts and ends with none cached."""
    from kernelgen import device

    device._cuda_arch.cache_clear()
    yield
    device._cuda_arch.cache_clear()


def test_another_gpu_generation_is_a_clear_error(monkeypatch, fresh_device_arch):
    from kernelgen import device

    gluon_backend = backends.get("gluon")
    monkeypatch.setattr(device, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    reason = gluon_backend.device_unsupported(torch.device("cuda", 0))
    assert reason is not None and "backend='gluon' runs on sm_90 only" in reason and "sm_80" in reason, reason
    assert gluon_backend.unsupported(SPEC, torch.device("cuda", 0)) == reason
    with pytest.raises(ValueError, match="backend=.gluon. runs on sm_90 only; NVIDIA A100 is sm_80: use another backend"):
        kernelgen.get_kernel(SPEC).served("attn", 4096, device="cuda:0")
    device._cuda_arch.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gluon_backend.device_unsupported(torch.device("cuda", 0)) is None
    assert "not under device cpu" in gluon_backend.device_unsupported(torch.device("cpu"))


def test_kv_rows_are_copied_only_when_tma_needs_it():
    """TMA reads K/V as [B * Hkv * N, D] rows from a 16-byte aligned base: a contiguous aligned tensor is
    used as it is; a strided one or one whose base is off by an element is copied."""
    x = torch.randn(2, 3, 50, 64, dtype=torch.float16)
    rows = gluon._tma_rows(x)
    assert rows.shape == (300, 64) and rows.data_ptr() == x.data_ptr()
    strided = torch.randn(2, 50, 3, 64, dtype=torch.float16).transpose(1, 2)
    rows = gluon._tma_rows(strided)
    assert rows.shape == (300, 64) and torch.equal(rows.view(2, 3, 50, 64), strided)
    off = torch.randn(2 * 3 * 50 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 50, 64)
    assert off.is_contiguous() and off.data_ptr() % 16
    rows = gluon._tma_rows(off)
    assert rows.data_ptr() % 16 == 0 and torch.equal(rows.view(2, 3, 50, 64), off)


# ---- GPU (Hopper) -------------------------------------------------------------------------------------

@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[6] in KV_BLOCKS],  # 256-key blocks: not Gluon's
                         ids=lambda c: "-".join(map(str, c)))
def test_gpu_gluon_against_reference(case, dtype):
    run_and_check(*gpu_case(case, dtype, backend="gluon"))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1]], ids=lambda c: "-".join(map(str, c)))
def test_gpu_gluon_every_config(case):
    """Every feasible config (64 or 128 rows, 2 to 4 stages) of a D=64 and a D=128 case."""
    spec, q, k, v = gpu_case(case, torch.bfloat16, seed_offset=3, backend="gluon")
    space = config_space(spec, "attn")
    assert len(space) >= 3
    idx = kernelgen.get_kernel(spec).select(q, k)
    for cfg in space:
        run_and_check(spec.replace(selector="given", local=0, sink=0), q, k, v, block_idx=idx,
                      configs={"attn": cfg})


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_gluon_given_lists(causal, index_dtype):
    """Caller-given lists in random order with -1, negative and too-large ids (int64: one that wraps onto
    a valid id in a careless int32 cast)."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=causal, gqa_group=4, selector="given",
                backend="gluon")
    q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 29)
    idx = given_lists(spec, 1, 2, 8192, 8192, 2, "cuda", index_dtype)
    if index_dtype == torch.int64:
        idx[0, 0, 0, 1] = 2**32 + 1
    run_and_check(spec, q, k, v, block_idx=idx)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("block_m", [64, 128])
def test_gpu_gluon_empty_lists(block_m):
    """Tiles whose list holds no valid id (all -1 or out of range) give o = 0, lse = -inf; the others are
    still right (with 64 rows, two programs share a tile)."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=8, causal=True, gqa_group=2, selector="given",
                backend="gluon")
    check_empty_lists(spec, {"attn": GluonAttnConfig(block_m=block_m, num_stages=2)})


@pytest.mark.gpu
@hopper
def test_gpu_gluon_strided_and_misaligned_inputs():
    """q, k, v as views of a [B, N, H, D] buffer, and K/V whose base is off by one element: the launcher
    copies K/V for TMA (only then) and reads q and writes o through strides."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=8, causal=True, gqa_group=2, selector="given",
                backend="gluon")
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 3000, 4, 64, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    kv = torch.randn(1, 3000, 2, 2, 64, generator=gen).to("cuda", torch.bfloat16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    idx = given_lists(spec, 1, 2, 3000, 3000, 7, "cuda")
    run_and_check(spec, q, k, v, block_idx=idx)
    flat = torch.randn(2 * 1 * 2 * 3000 * 64 + 1, generator=gen).to("cuda", torch.bfloat16)[1:]
    k, v = flat.view(2, 1, 2, 3000, 64).unbind(0)
    assert k.data_ptr() % 16 and v.is_contiguous()
    run_and_check(spec, q.contiguous(), k, v, block_idx=idx)


@pytest.mark.gpu
@hopper
def test_gpu_gluon_float32_is_a_type_error():
    q, k, v = make_inputs(1, 1, 1, 256, 256, 64, torch.float32, "cuda", 0)
    with pytest.raises(TypeError, match="float16 or bfloat16 on a GPU"):
        kernelgen.get_kernel(SPEC)(q, k, v)


@pytest.mark.gpu
@hopper
def test_gpu_auto_serves_gluon_when_its_row_is_fastest(tmp_path, monkeypatch):
    """backend='auto' with a tuning DB whose Gluon row is the fastest runs the Gluon forward (the very
    output of a pinned Gluon config), correctly."""
    from kernelgen.device import device_arch, gpu_name
    from kernelgen.tuning import lookup
    from kernelgen.tuning.db import TuningDB, current_fingerprint

    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given",
                backend="auto")
    winner = GluonAttnConfig(block_m=64, num_stages=3)
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    lookup._winners.cache_clear()
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        with TuningDB(tmp_path / "tuning.db") as db:
            # rows of this exact bucket (the bundled DB's for this shape are 32k's, farther away)
            for backend, config, ms in (("triton", default_config(spec.replace(backend="triton"), "attn"), 0.2),
                                        ("gluon", winner, 0.1)):
                db.upsert(spec_key=get_role("attn").key(spec, backend), role="attn", backend=backend,
                          arch=device_arch(device), gpu_name=gpu_name(device),
                          bucket=8192, dtype="bfloat16", config=dataclasses.asdict(config), median_ms=ms, tflops=None,
                          n_trials=1, fingerprint=current_fingerprint(backends.get(backend), "attn"))
        q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 37)
        idx = given_lists(spec, 1, 2, 8192, 8192, 2, "cuda")
        attn = SparseAttention(spec)
        assert attn.backend(8192, q.dtype, q.device) == "gluon"
        assert attn.config("attn", 8192, 8192, q.dtype, q.device) == winner
        o, lse = attn(q, k, v, block_idx=idx, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
        assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)
        pinned = kernelgen.get_kernel(spec.replace(backend="gluon"), configs={"attn": winner})
        assert torch.equal(o, pinned(q, k, v, block_idx=idx))
    finally:
        lookup._winners.cache_clear()


@pytest.mark.gpu
@hopper
def test_gpu_exported_gluon_module_matches_get_kernel(tmp_path):
    assert_exported_module_matches_get_kernel("gluon", tmp_path)
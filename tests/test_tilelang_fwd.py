"""TileLang backend through get_kernel: GPU runs against the float64 reference; a clear error on CPU."""
import pytest
import torch

import kernelgen
from kernelgen import Spec
from test_triton_fwd import GPU_CASES, given_lists, gpu_case, make_inputs, run_and_check

pytest.importorskip("tilelang")


def test_cpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, backend="tilelang")
    q, k, v = make_inputs(1, 1, 1, 128, 128, 64, torch.float16, "cpu", 0)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        kernelgen.get_kernel(spec)(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_tilelang_against_reference(case, dtype):
    run_and_check(*gpu_case(case, dtype, backend="tilelang"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tilelang_given_lists(causal):
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=causal, gqa_group=4, selector="given",
                backend="tilelang")
    q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 29)
    run_and_check(spec, q, k, v, block_idx=given_lists(spec, 1, 2, 8192, 8192, 2, "cuda"))

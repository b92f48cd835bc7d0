"""Calls on a GPU other than the current device: Triton, Gluon and TileLang launch on the current device, so
every launch runs under `device.launching_on` its tensors' GPU (a model spread over GPUs, as transformers'
device_map places it, calls with tensors on each)."""
import contextlib

import pytest
import torch

import kernelgen
import kernelgen.dispatch
from kernelgen import Spec, reference
from kernelgen.device import launching_on
from checks import assert_close_to_reference

SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)


class _OnGpu:
    """Stands for a tensor on cuda:`index` (no GPU here)."""

    is_cuda = True

    def __init__(self, index):
        self.index, self.device = index, torch.device("cuda", index)

    def get_device(self):
        return self.index


def test_launching_on_makes_the_tensor_s_gpu_current(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = launching_on(_OnGpu(1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(launching_on(_OnGpu(0)), contextlib.nullcontext)
    assert isinstance(launching_on(torch.zeros(1)), contextlib.nullcontext)


def test_every_launch_of_a_training_step_runs_under_its_tensors_device(device, monkeypatch):
    """Selection, lists, the forward and the backward's roles: each launch enters launching_on with a tensor of
    the call's device."""
    seen = []

    def recording(t):
        seen.append(t.device)
        return contextlib.nullcontext()

    monkeypatch.setattr(kernelgen.dispatch, "launching_on", recording)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 64, generator=gen).to(device, torch.float16).requires_grad_() for h in (4, 2, 2))
    kernelgen.get_kernel(SPEC)(q, k, v).sum().backward()
    assert len(seen) >= 4 and set(seen) == {q.device}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["triton", "tilelang", "gluon"])
def test_gpu_a_call_on_the_second_gpu(backend):
    """cuda:1 tensors while cuda:0 is current: the result is right, and on cuda:1."""
    spec = SPEC.replace(kv_block=64, q_tile=64, backend=backend)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 2048, 64, generator=gen).to("cuda:1", torch.bfloat16) for h in (4, 2, 2))
    torch.cuda.set_device(0)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, return_lse=True)
    assert o.device == q.device and torch.cuda.current_device() == 0
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(backend="triton"),
                                                   block_idx=kernelgen.get_kernel(spec).select(q, k))
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)

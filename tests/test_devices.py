"""Where and in what dtype a call runs. On a GPU other than the current device: Triton, Gluon and TileLang
launch on the current device, so every launch runs under `device.launching_on` its tensors' GPU (a model
spread over GPUs, as transformers' device_map places it, calls with tensors on each). Under CUDA autocast:
q, k and v are cast to its dtype, as SDPA's are. On the CPU: Triton's interpreter, its bitwise reductions (tl.sort's
and tl.topk's) in numpy."""
import contextlib
import functools
import operator

import pytest
import torch
import triton
import triton.language as tl

import kernelgen
import kernelgen.dispatch
from kernelgen import Spec, custom_ops, reference
from kernelgen.device import interpret_triton_language, interpreting, launching_on
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
    monkeypatch.setattr(kernelgen.device, "current_gpu", lambda: 0)
    guard = launching_on(_OnGpu(1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(launching_on(_OnGpu(0)), contextlib.nullcontext)
    assert isinstance(launching_on(torch.zeros(1)), contextlib.nullcontext)


@pytest.mark.parametrize("backend", ["triton", "tilelang", "auto"])
def test_asking_what_a_gpu_is_served_without_one_says_so(backend, monkeypatch):
    def no_gpu(*args):
        raise RuntimeError("No CUDA GPUs are available")

    kernelgen.device._cuda_arch.cache_clear()
    monkeypatch.setattr(torch.cuda, "current_device", no_gpu)
    attn = kernelgen.get_kernel(SPEC.replace(backend=backend))
    with pytest.raises(kernelgen.KernelgenValueError, match="device cuda: no such CUDA GPU here .No CUDA GPUs are"):
        attn.served("attn", 256, device="cuda")


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


@pytest.mark.gpu
@pytest.mark.parametrize("call", ["get_kernel", "custom_op"])
def test_gpu_float32_under_autocast_runs_in_its_dtype(call):
    """float32 leaves under torch.autocast(bfloat16): o in bfloat16, float32 gradients, both those of the
    bfloat16-cast inputs."""
    spec = SPEC.replace(kv_block=64, q_tile=64)
    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(1, h, 4096, 64, generator=gen).cuda().requires_grad_() for h in (4, 2, 2)]
    do = torch.randn(1, 4, 4096, 64, generator=gen).cuda().to(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if call == "get_kernel":
            o, lse = kernelgen.get_kernel(spec)(*leaves, return_lse=True)
        else:
            o, lse = custom_ops.sparse_attention(*leaves, spec)
    assert o.dtype == torch.bfloat16
    o.backward(do)
    q, k, v = (t.detach().to(torch.bfloat16) for t in leaves)
    lists = kernelgen.get_kernel(spec).select(q, k)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=lists)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=o)
    for leaf, ref in zip(leaves, want):
        assert leaf.grad.dtype == torch.float32
        assert ((leaf.grad.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_the_interpreter_reduces_xor_in_numpy_exactly(monkeypatch):
    """tl.topk and tl.sort reduce with xor at every compare-and-swap stage; in the interpreter those reductions
    run in numpy (`device.interpret_triton_language`), never through the per-element generic reduce, which
    took minutes for a selector's top-k. Their results are exact."""
    if not interpreting():
        pytest.skip("kernels run on the GPU here, not in the interpreter")
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    interpret_triton_language()

    def per_element(*args):
        raise AssertionError("a bitwise reduction ran the interpreter's per-element generic reduce")

    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", per_element)

    @triton.jit
    def reduce_kernel(x_ptr, top_ptr, sorted_ptr, rows_ptr, whole_ptr, K: tl.constexpr):
        offs = tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]
        x = tl.load(x_ptr + offs)
        tl.store(top_ptr + tl.arange(0, 4)[:, None] * K + tl.arange(0, K)[None, :], tl.topk(x, K, 1))
        tl.store(sorted_ptr + offs, tl.sort(x, 1))
        tl.store(rows_ptr + tl.arange(0, 4), tl.xor_sum(x, 1))
        tl.store(whole_ptr, tl.xor_sum(tl.reshape(x, (64,)), 0))

    x = torch.randint(-2**31, 2**31 - 1, (4, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    top, rows, whole = torch.empty(4, 8, dtype=torch.int32), torch.empty(4, dtype=torch.int32), torch.empty(
        1, dtype=torch.int32)
    ordered = torch.empty_like(x)
    reduce_kernel[(1,)](x, top, ordered, rows, whole, K=8)
    assert torch.equal(top, x.topk(8, dim=1).values)
    assert torch.equal(ordered, x.sort(dim=1).values)
    xor = functools.reduce(operator.xor, x.unbind(1))
    assert torch.equal(rows, xor)
    assert torch.equal(whole, functools.reduce(operator.xor, xor.unbind(0)).reshape(1))


def test_the_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """The interpreter patches triton.language's builtins when a kernel launches, and did again on every call of
    a @jit helper inside it (every program and loop step): a quarter of a CPU test's time. Inside a launch a
    helper that sees only modules the launch patched skips it (`device.interpret_triton_language`): the
    patches do not grow with the calls, and the results are the same."""
    if not interpreting():
        pytest.skip("kernels run on the GPU here, not in the interpreter")
    from triton.runtime import interpreter

    interpret_triton_language()
    patched = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: patched.append(args[0]) or patch_builtin(*args))

    counts = []
    for steps in (1, 8):
        patched.clear()
        out = torch.empty(4 * 16)
        _steps_kernel[(4,)](out, STEPS=steps)
        assert (out == steps * 17).all()
        counts.append(len(patched))
    assert counts[0] == counts[1] > 0


@triton.jit
def _add_one(x):
    return x + 1


@triton.jit
def _steps_kernel(out_ptr, STEPS: tl.constexpr):
    x = tl.zeros((16,), tl.float32)
    for _ in range(STEPS):
        x = _add_one(x)
    tl.store(out_ptr + tl.program_id(0) * 16 + tl.arange(0, 16), x + tl.sum(x, 0))

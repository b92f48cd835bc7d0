"""`DirectLauncher` launches a compiled kernel itself only where Triton's own path would launch the same one: the
same specialization of the arguments (Triton's binder derives it), options and knobs, no launch hook, and
JITFunction.run not replaced. Here Triton's compile and launch are stand-ins (no GPU): the tests check which path
each call takes and what reaches the launcher. (On a GPU every kernelgen kernel launches through it.)"""
import types

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kernelgen.backends import triton_launch  # noqa: E402
from kernelgen.backends.triton_launch import DirectLauncher, TritonModule  # noqa: E402

STREAM = 1234


def kernel(x_ptr, n, scale, BLOCK: "tl.constexpr"):  # noqa: F821 - the annotation is Triton's, read as text
    pass


class Compiled:
    """A stand-in for Triton's CompiledKernel: records its launches."""

    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def launcher(monkeypatch):
    """A DirectLauncher over a real JITFunction whose binder is Triton's for sm_90, with Triton's own path
    (`fn.run`) replaced by a stand-in that compiles (a new `Compiled`) and counts its calls."""
    fn = JITFunction(kernel)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    fn.device_caches = {0: ({}, {}, None, None, binder)}
    fn.slow_calls = []

    def triton_run(*args, grid, warmup, **options):
        fn.slow_calls.append((args, grid, options))
        return Compiled()

    fn.run = triton_run  # the instance's: `type(fn).run` is still Triton's
    monkeypatch.setattr(triton_launch, "current_gpu", lambda: 0)
    monkeypatch.setattr(triton_launch, "current_raw_stream", lambda device: STREAM)
    return DirectLauncher(fn)


def test_the_first_call_of_a_specialization_is_tritons_then_its_kernel_launches_directly(launcher):
    x = torch.zeros(64)
    first = launcher[(4,)](x, 4096, 0.5, BLOCK=64, num_warps=4)
    assert len(launcher.fn.slow_calls) == 1 and first.launches == []
    again = launcher[(8, 2)](x, 8192, 0.25, BLOCK=64, num_warps=4)  # same specialization: 8192 % 16 == 0 too
    assert again is first and len(launcher.fn.slow_calls) == 1
    assert first.launches == [(8, 2, 1, STREAM, "function-handle", "packed-metadata", None, None, None,
                               x, 8192, 0.25, 64)]


@pytest.mark.parametrize("other", [
    dict(n=4095),  # not divisible by 16: another specialization
    dict(n=1),  # 1 is a constant to Triton
    dict(n=2**40),  # a 64-bit integer
    dict(x=torch.zeros(65)[1:]),  # a pointer not 16-byte aligned
    dict(x=torch.zeros(64, dtype=torch.float16)),  # another element type
    dict(BLOCK=128),  # another constexpr
    dict(num_warps=8),  # another compile option
])
def test_any_change_triton_specializes_on_takes_tritons_path(launcher, other):
    args = dict(x=torch.zeros(64), n=4096, scale=0.5, BLOCK=64, num_warps=4)
    first = launcher[(1,)](args["x"], args["n"], args["scale"], BLOCK=args["BLOCK"], num_warps=args["num_warps"])
    changed = {**args, **other}
    second = launcher[(1,)](changed["x"], changed["n"], changed["scale"], BLOCK=changed["BLOCK"],
                            num_warps=changed["num_warps"])
    assert len(launcher.fn.slow_calls) == 2 and second is not first and first.launches == second.launches == []
    third = launcher[(1,)](changed["x"], changed["n"], changed["scale"], BLOCK=changed["BLOCK"],
                           num_warps=changed["num_warps"])
    assert third is second and len(second.launches) == 1  # each specialization keeps its own kernel


def test_a_launch_hook_or_a_replaced_run_takes_tritons_path(launcher, monkeypatch):
    x = torch.zeros(64)
    compiled = launcher[(1,)](x, 4096, 0.5, BLOCK=64)
    hook = lambda metadata: None  # noqa: E731 - a profiler's
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher[(1,)](x, 4096, 0.5, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launcher.fn.slow_calls) == 2 and compiled.launches == []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, **kwargs: None)  # a compile-only tool's
    launcher[(1,)](x, 4096, 0.5, BLOCK=64)
    assert len(launcher.fn.slow_calls) == 3 and compiled.launches == []
    launcher[(lambda meta: (1,))](x, 4096, 0.5, BLOCK=64)  # a grid that is a function
    assert len(launcher.fn.slow_calls) == 4


def test_the_debug_knob_is_part_of_the_key(launcher, monkeypatch):
    x = torch.zeros(64)
    launcher[(1,)](x, 4096, 0.5, BLOCK=64)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    launcher[(1,)](x, 4096, 0.5, BLOCK=64)
    assert len(launcher.fn.slow_calls) == 2


def test_a_module_hands_out_one_launcher_a_kernel_and_everything_else_as_it_is():
    fn = JITFunction(kernel)
    module = types.ModuleType("kg_triton_example")
    module.attn_fwd, module.LIMIT, module.helper = fn, 7, print
    wrapped = TritonModule(module)
    assert isinstance(wrapped.attn_fwd, DirectLauncher) and wrapped.attn_fwd.fn is fn
    assert wrapped.attn_fwd is wrapped.attn_fwd
    assert wrapped.LIMIT == 7 and wrapped.helper is print and wrapped.__name__ == "kg_triton_example"
    with pytest.raises(AttributeError):
        wrapped.missing


@pytest.mark.gpu
@pytest.mark.parametrize("n_q", [1, 300])  # decode and prefill
def test_calls_that_alternate_specializations_each_launch_their_own_kernel_on_gpu(n_q):
    """Lengths that Triton specializes differently (a multiple of 16 or not, one), alternating: each call, the
    later ones launched directly, matches the float64 reference over its own lists, and the directly launched
    kernels keep one compiled kernel per specialization."""
    from checks import assert_close_to_reference
    from test_triton_fwd import make_inputs

    import kernelgen
    from kernelgen import Spec, reference

    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, causal=True, gqa_group=2, local=1, backend="triton")
    attn = kernelgen.get_kernel(spec)
    for step, n_k in enumerate((1024, 1000, 1024, 1000, 1024, max(n_q, 1))):
        q, k, v = make_inputs(2, 4, 2, n_q, n_k, 64, torch.float16, "cuda", step)
        block_idx = attn.select(q, k)
        o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=block_idx)
        assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)
    role = "decode" if n_q == 1 else "attn"
    module = attn.served(role, 1024, torch.float16, q.device).kernel
    launchers = [value for value in vars(module).values() if isinstance(value, DirectLauncher)]
    assert launchers and max(len(launcher._compiled) for launcher in launchers) >= 2


def test_the_host_time_tool_says_in_one_line_that_it_needs_a_gpu(capsys, monkeypatch):
    """tools/host_time.py as docs/PERF.md gives it, on a machine without a GPU: exit status 2, one line."""
    from checks import tool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool("host_time").main([]) == 2 and tool("host_time").main(["--launch"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["tools/host_time.py times calls on a CUDA GPU: none is visible here"] * 2

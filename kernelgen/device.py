"""What the process runs on: the CUDA arch of a device, and whether Triton's CPU interpreter is on."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

import torch

from .errors import KernelgenRuntimeError

__all__ = ["interpreting", "interpreter_numpy_problem", "interpret_triton_language", "device_arch", "gpu_name",
           "current_arch", "launching_on", "current_gpu", "current_raw_stream", "on_default_stream"]

# What every launch asks (the current GPU, its current stream), straight from torch's C functions: Triton asks for the
# stream the same way, and torch.cuda.current_device() first checks CUDA is initialised, a few microseconds a launch
# where a GPU tensor already says it is.
current_gpu = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def interpreter_numpy_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run here, where numpy and Triton's versions say so (numpy 2.4 breaks
    Triton 3.6's interpreter with an error that names neither: "only 0-dimensional arrays can be converted to Python
    scalars"), else None."""
    import importlib.metadata

    try:
        numpy, triton = (tuple(int(x) for x in importlib.metadata.version(name).split(".")[:2])
                         for name in ("numpy", "triton"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    if numpy >= (2, 4) and triton <= (3, 6):
        return (f"numpy {'.'.join(map(str, numpy))} breaks Triton {'.'.join(map(str, triton))}'s CPU interpreter, "
                f"which kernelgen's kernels run in without a GPU: pip install 'numpy<2.4'")
    return None


def interpreting() -> bool:
    """Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launching_on(t: torch.Tensor):
    """A context in which `t`'s GPU is the current device. Triton, Gluon and TileLang launch on the current
    device and its current stream, not on their tensors' (a model spread over GPUs calls with tensors on
    another); a no-op where it already is current, and for CPU tensors."""
    if t.is_cuda and t.get_device() != current_gpu():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


_DEFAULT_RAW_STREAMS: dict = {}


def on_default_stream(device: torch.device) -> bool:
    """Whether launches on CUDA `device` (its index given) now go to its default stream, uncaptured."""
    default = _DEFAULT_RAW_STREAMS.get(device.index)
    if default is None:
        default = _DEFAULT_RAW_STREAMS[device.index] = torch.cuda.default_stream(device).cuda_stream
    return current_raw_stream(device.index) == default and not torch.cuda.is_current_stream_capturing()


_language_interpreted = False
_language_lock = threading.Lock()


def interpret_triton_language() -> None:
    """Make triton.language's own @jit helpers (tl.sum, tl.max, tl.cdiv, tl.zeros, tl.rand, ...) run in the
    interpreter, once per process; a no-op unless kernels run in the interpreter.

    `triton.jit` picks JITFunction or InterpretedFunction when each function is defined, from TRITON_INTERPRET
    at that moment. When triton.language was imported before TRITON_INTERPRET=1 was set (`import torch._dynamo`
    imports it), its helpers are JITFunctions, and an interpreted kernel that calls one fails with "Cannot call
    @triton.jit'd outside of the scope of a kernel". Each is rebound, in every triton module that binds it and
    as a method of tl.tensor, to the InterpretedFunction `triton.jit` would have made of the same function.
    """
    global _language_interpreted
    if _language_interpreted or not interpreting():
        return
    with _language_lock:
        if _language_interpreted:
            return
        import triton
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        interpreted = {}  # id(JITFunction) -> its InterpretedFunction (one per function, however often bound)

        def as_interpreted(jit_function):
            if id(jit_function) not in interpreted:
                interpreted[id(jit_function)] = InterpretedFunction(
                    jit_function.fn, version=jit_function.version, do_not_specialize=jit_function.do_not_specialize,
                    do_not_specialize_on_alignment=jit_function.do_not_specialize_on_alignment,
                    debug=jit_function.debug, noinline=jit_function.noinline, repr=jit_function._repr,
                    launch_metadata=jit_function.launch_metadata)
            return interpreted[id(jit_function)]

        package = triton.__name__

        def triton_own(value) -> bool:  # exactly JITFunction: Gluon's subclass has an interpreter of its own
            return type(value) is JITFunction and value.fn.__module__.startswith(package + ".")

        modules = [m for name, m in list(sys.modules.items())
                   if m is not None and (name == package or name.startswith(package + "."))]
        for module in modules:
            for name, value in list(vars(module).items()):
                if triton_own(value):
                    setattr(module, name, as_interpreted(value))
        for name, value in list(vars(tl.tensor).items()):
            if triton_own(value):
                # a plain function, as triton's _tensor_member_fn binds a non-JIT helper: `x.sum(0)` passes x
                setattr(tl.tensor, name, _tensor_method(as_interpreted(value)))
        _reduce_bitwise_in_numpy()
        _patch_language_once_a_launch()
        _language_interpreted = True


def _reduce_bitwise_in_numpy() -> None:
    """The interpreter reduces with numpy for sum, min and max, but runs any other combine function once per
    element, in Python. tl.sort and tl.topk reduce with xor at every compare-and-swap stage, so a selector's
    top-k took minutes in the interpreter; xor, or and and reductions go to numpy's ufuncs here (exact)."""
    import numpy as np
    import triton.language.standard as standard
    from triton.runtime import interpreter

    if not hasattr(getattr(interpreter, "ReduceOps", None), "apply_impl"):
        return  # another Triton's interpreter: as it is
    ufuncs = {getattr(standard, name).fn: ufunc for name, ufunc in
              (("_xor_combine", np.bitwise_xor), ("_or_combine", np.bitwise_or), ("_and_combine", np.bitwise_and))
              if hasattr(standard, name)}
    generic = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        ufunc = ufuncs.get(getattr(self.combine_fn, "fn", None))
        if ufunc is None or len(input) != 1:
            return generic(self, input)
        data = input[0].handle.data
        return self.to_tensor(ufunc.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)

    interpreter.ReduceOps.apply_impl = apply_impl


def _patch_language_once_a_launch() -> None:
    """The interpreter patches the triton.language modules a function sees (inspect.getmembers over each) when a
    kernel launches, and again on every call of a @jit helper inside it, for every program and loop step: a
    quarter of a CPU test's time. Patched modules stay patched until the launch ends, so a helper's call inside a
    launch skips the patch where the launch has patched every module the helper sees; a call outside any launch,
    or one that sees another module (triton.language.core), patches as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or executor is None:
        return  # another Triton's interpreter: as it is
    launch_call = executor.__call__
    languages = (tl, tl.core)
    state = threading.local()  # patched: ids of the modules the current launch has patched (None outside one)

    def patch(fn):
        patched = getattr(state, "patched", None)
        seen = {id(value) for value in fn.__globals__.values() if any(value is lang for lang in languages)}
        if patched is not None and seen and seen <= patched:
            return scope_type()  # nothing to restore: the launch restores what it patched
        if patched is not None:
            patched.update(seen)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set()
        try:
            return launch_call(self, *args, **kwargs)
        except Exception as error:
            problem = interpreter_numpy_problem()
            if problem and "0-dimensional arrays" in str(error):
                raise KernelgenRuntimeError(problem) from None
            raise
        finally:
            state.patched = outer

    interpreter._patch_lang = patch
    executor.__call__ = launch


def _tensor_method(function):
    def method(*args, **kwargs):
        return function(*args, **kwargs)

    method.__name__ = method.__qualname__ = function.__name__
    return method


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}", torch.cuda.get_device_name(index)


def _index(device) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def _cuda_facts(device) -> tuple[str, str]:
    """(arch, name) of a CUDA device; a KernelgenValueError where torch has no such GPU (its own error is an
    AssertionError or a RuntimeError)."""
    try:
        return _cuda_arch(_index(device))
    except (AssertionError, RuntimeError) as error:
        from .errors import KernelgenValueError

        raise KernelgenValueError(f"device {device}: no such CUDA GPU here ({error}); on the CPU only the Triton "
                                  "backend runs, in its interpreter") from None


def device_arch(device="cuda") -> str:
    """"sm_90" for an H100/H200 and so on; "cpu" for the CPU (kernels in the interpreter)."""
    if torch.device(device).type != "cuda":
        return "cpu"
    return _cuda_facts(device)[0]


def gpu_name(device="cuda") -> str:
    """The GPU's name as CUDA reports it ("NVIDIA H200"); "cpu" for the CPU."""
    if torch.device(device).type != "cuda":
        return "cpu"
    return _cuda_facts(device)[1]


def current_arch() -> str | None:
    """The arch of the current CUDA device, or None where there is none."""
    return device_arch("cuda") if torch.cuda.is_available() else None

"""Launching compiled Triton (and Gluon) kernels without `JITFunction.run`'s per-call work.

`kernel[grid](*args)` finds its compiled kernel anew on every call: it binds the arguments, derives their
specialization (each one's type, 16-byte alignment, 1-ness), turns that and the options into a string key, checks
the globals the kernel read, builds launch metadata for the launch hooks, then calls the compiled kernel's
launcher. With the thirty-odd arguments of a kernelgen kernel that is tens of microseconds of host time a launch,
several times the launch itself, and an eager decode step of three kernels waits on it.

`TritonModule` wraps a rendered module so that each of its kernels launches through a `DirectLauncher`: Triton's own
binder still derives the specialization (so nothing Triton keys its kernels on is dropped), the compiled kernel is
found in a dict keyed by it, and its launcher is called as `JITFunction.run` calls it. Triton's own path runs the
first call of each specialization (it compiles, or finds the kernel in its caches), and every call made while a
launch hook is set, while `JITFunction.run` is replaced (tools/offline_compile.py compiles through it), or with a
grid that is a function.
"""
from __future__ import annotations

from types import ModuleType

from triton import knobs
from triton.runtime.jit import JITFunction

from ..device import current_gpu, current_raw_stream

__all__ = ["TritonModule", "DirectLauncher"]

_TRITON_RUN = JITFunction.run  # what a replaced run (a compile-only tool, a profiler) is told apart from


def _no_launch_hooks() -> bool:
    """No launch hook is set: Triton's default hooks are empty chains, which the direct launch passes as None."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (isinstance(enter, knobs.HookChain) and not enter.calls
            and isinstance(leave, knobs.HookChain) and not leave.calls)


class DirectLauncher:
    """`fn[grid](*args, **options)` for one Triton kernel, its compiled kernels keyed by what `JITFunction.run` keys
    them on: Triton's specialization of the arguments (constexprs by value, tensors by dtype and alignment), the
    compile options (num_warps, ...) and the debug and instrumentation knobs it adds to them."""

    __slots__ = ("fn", "_compiled")

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **options: self.launch(grid, args, options)

    def launch(self, grid, args: tuple, options: dict):
        fn = self.fn
        if type(fn).run is not _TRITON_RUN or callable(grid) or not _no_launch_hooks():
            return fn.run(*args, grid=grid, warmup=False, **options)
        device = current_gpu()
        bound, specialization, compile_options = fn.device_caches[device][4](*args, **options)
        key = (device, tuple(specialization), tuple(compile_options.items()), knobs.runtime.debug,
               knobs.compilation.instrumentation_mode)
        kernel = self._compiled.get(key)
        if kernel is None:  # Triton's path: it compiles the kernel, or finds it, and launches it
            kernel = fn.run(*args, grid=grid, warmup=False, **options)
            if kernel is not None and not hasattr(kernel, "result"):  # not an asynchronous compile's future
                self._compiled[key] = kernel
            return kernel
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   current_raw_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                   *bound.values())
        return kernel


class TritonModule:
    """A rendered kernel module whose Triton kernels launch through `DirectLauncher`s; any other attribute (a
    helper, a constant, a kernel run by the interpreter) is the module's own."""

    def __init__(self, module: ModuleType):
        self.module = module

    def __getattr__(self, name: str):
        value = getattr(self.module, name)
        if isinstance(value, JITFunction):
            value = DirectLauncher(value)
        setattr(self, name, value)  # found once: later reads are an instance attribute
        return value

    def __repr__(self) -> str:
        return f"<kernelgen Triton module {self.module.__name__!r}>"

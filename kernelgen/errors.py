"""The errors kernelgen raises on purpose.

Every one derives from `KernelgenError`, and from ValueError or TypeError where it is one, so that
`except ValueError` keeps working and `except kernelgen.KernelgenError` catches kernelgen's alone.
"""
from __future__ import annotations

__all__ = ["KernelgenError", "KernelgenValueError", "KernelgenTypeError", "KernelgenRuntimeError", "KernelgenNotImplementedError"]


class KernelgenError(Exception):
    """Base of the errors kernelgen raises: bad input, an infeasible spec or config, an unsupported device."""


class KernelgenValueError(KernelgenError, ValueError):
    """A value kernelgen cannot take: a shape, a spec field, a config, a device; the message names it."""


class KernelgenTypeError(KernelgenError, TypeError):
    """An argument of the wrong type or dtype; the message names it and what was expected."""


class KernelgenRuntimeError(KernelgenError, RuntimeError):
    """What this machine lacks for the request (a GPU to tune on, a worker process that starts)."""


class KernelgenNotImplementedError(KernelgenError, NotImplementedError):
    """A request kernelgen will serve but does not yet (none raises it now: kept so that code catching it stays
    valid)."""

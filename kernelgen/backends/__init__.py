"""The backend registry: every backend kernelgen can serve, and which one runs a role for a spec.

    from kernelgen import backends
    backends.names()                  # ("triton", "tilelang", "gluon")
    backends.get("gluon").unsupported(spec, device)   # why it cannot serve, or None
    backends.register(MyBackend())    # a plug-in: served, tuned and listed like the others

Everything else in kernelgen iterates over this registry; no other module compares a backend's name.
`Spec(backend="auto")` is served by the registry's choice: the fastest tuned backend that can run the
spec here (`kernelgen.tuning.lookup.fastest_backend`), else the fallback.
"""
from __future__ import annotations

from ..errors import KernelgenTypeError, KernelgenValueError
from .base import Backend, Problem, RoleImpl, Shapes
from .gluon import GluonBackend
from .tilelang import TileLangBackend
from .triton import TritonBackend

__all__ = ["Backend", "RoleImpl", "Problem", "Shapes", "AUTO", "FALLBACK", "register", "unregister", "get", "names",
           "all_backends", "runner", "has_config", "check_spec", "of_config", "config_types"]

AUTO = "auto"
# Runs the roles a spec's backend lacks (selection, list normalising) and serves `auto` where nothing is
# tuned: Triton runs on every CUDA GPU and, through its interpreter, on the CPU.
FALLBACK = "triton"

_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend; its name must be new (and not "auto")."""
    if not isinstance(backend, Backend):
        raise KernelgenTypeError(f"backend must be a kernelgen.backends.Backend, got {type(backend).__name__}")
    if not backend.name or backend.name == AUTO or backend.name in _REGISTRY:
        raise KernelgenValueError(f"backend name {backend.name!r} is empty, reserved or taken; registered: {names()}")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a plug-in backend (tests)."""
    if name == FALLBACK:
        raise KernelgenValueError(f"the fallback backend {FALLBACK!r} cannot be removed")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def all_backends() -> tuple[Backend, ...]:
    return tuple(_REGISTRY.values())


def get(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise KernelgenValueError(f"backend={name!r} is unknown; expected one of {names() + (AUTO,)}") from None


def check_spec(spec) -> None:
    """A spec whose backend exists and can compute it ("auto" always can: the fallback computes every spec)."""
    if spec.backend == AUTO:
        return
    reason = get(spec.backend).spec_unsupported(spec)
    if reason:
        raise KernelgenValueError(reason)


def runner(backend: str, role: str, device=None, spec=None) -> Backend:
    """The backend that runs `role` for a spec served by `backend`: that backend if it has the role, else
    the fallback (selection and list normalising run in Triton for the TileLang and Gluon forwards). On
    `device`, a role the backend marks optional (`RoleImpl.optional`: TileLang's dK/dV backward) runs on the
    fallback where the backend cannot run (the CPU's interpreter), or, given the served `spec`, where it has no
    config of that spec on the device's arch (TileLang's dK/dV takes KV blocks of 32 keys or more)."""
    chosen = get(backend)
    impl = chosen.roles.get(role)
    if impl is None:
        return get(FALLBACK)
    if impl.optional and device is not None:
        if chosen.device_unsupported(device) or (spec is not None and not has_config(chosen, spec, role, device)):
            return get(FALLBACK)
    return chosen


def has_config(backend: Backend, spec, role: str, device_or_arch) -> bool:
    """Whether `backend` has a config of `role` for `spec` on a device (or arch): a spec it computes may still
    have no point that runs there (TileLang's forward packs at least 64 rows a program)."""
    from ..device import device_arch
    from ..roles import get_role

    arch = device_or_arch if isinstance(device_or_arch, str) else device_arch(device_or_arch)
    try:
        backend.default_config(get_role(role).kernel_spec(spec, backend.name), role, arch)
    except KernelgenValueError:
        return False
    return True


def of_config(role: str, config) -> Backend:
    """The backend whose `role` takes configs of this type (a pinned config says which backend serves)."""
    for backend in _REGISTRY.values():
        impl = backend.roles.get(role)
        if impl is not None and impl.config_type is not None and type(config) is impl.config_type:
            return backend
    raise KernelgenTypeError(f"{type(config).__name__} is no config of role {role!r}; expected one of "
                              f"{', '.join(t.__name__ for t in config_types(role))}")


def config_types(role: str) -> list[type]:
    return [b.roles[role].config_type for b in _REGISTRY.values()
            if role in b.roles and b.roles[role].config_type is not None]


for _backend in (TritonBackend(), TileLangBackend(), GluonBackend()):
    register(_backend)

"""The interface every backend implements, and `RoleImpl`: how a backend runs one kernel role."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from ..archs import ANY_ARCH, ARCHS, check_arch
from ..errors import KernelgenTypeError, KernelgenValueError
from ..inputs import Shapes
from ..spec import HEAD_DIMS, Spec

__all__ = ["Backend", "RoleImpl", "Problem", "Shapes", "distribution_version"]


class Problem(NamedTuple):
    """What a kernel compiled for one problem (TileLang's) is built for."""

    dtype: torch.dtype
    shapes: Shapes
    device: torch.device


@dataclass(frozen=True)
class RoleImpl:
    """How one backend runs one role.

    template     templates/<backend>/<role>.py.j2 (a path relative to templates/, or absolute); None when
                 the backend renders nothing (the float64 reference, say)
    config_type  the frozen dataclass of its tunables, with `to_json()` (a rendered module ends with it); None:
                 nothing to tune
    default      (spec, arch) -> the config served on `arch` when nothing is tuned
    space        (spec, arch) -> candidate configs (the feasible ones are kept: `Backend.config_space`)
    infeasible   (spec, config, arch) -> why the kernel cannot run that config on `arch`, or None
    optional     the registry's fallback runs the role where this backend cannot run at all (a device it
                 does not run on: `backends.runner`); the backward's roles, which the fallback runs for every
                 backend, are; a forward is never swapped silently
    launch       (kernel, spec, config, shapes, *args) -> the role's output (`kernelgen.roles` lists the args)
    varlen       the launcher also takes `seqlens=` and `leftpad=` (a decode call's `cache_seqlens` and
                 `cache_leftpad`, int32 [B], read on the device: batch row b holds keys [leftpad[b], seqlens[b]);
                 leftpad may be None, from 0); a call with them is refused where the role it runs lacks this
    paged        the launcher also takes `block_table=` (int32 [B, pages a row]: k and v are pools of pages
                 [n_pages, Hkv, page_size, D], batch row b's key p in page block_table[b, p // page_size]), always
                 with `seqlens=`; a call with it is refused where the role it runs lacks this
    fp8_kv       the launcher also takes `kv_scales=` (`inputs.KVScales`: k and v are an fp8 cache, e4m3fn or e5m2,
                 its dequantisation scales float32 of one element or [B, Hkv]); a call over an fp8 cache is refused
                 where its role lacks this

    `arch` is a checked arch string ("sm_89", or "cpu": `kernelgen.archs`), whose hardware facts
    (`kernelgen.archs.arch_facts`: shared memory, TMA, MMA) the rules read.
    """

    launch: Callable[..., Any]
    template: str | Path | None = None
    config_type: type | None = None
    default: Callable[[Spec, str], Any] = lambda spec, arch: None
    space: Callable[[Spec, str], Iterable] = lambda spec, arch: [None]
    infeasible: Callable[[Spec, Any, str], str | None] = lambda spec, config, arch: None
    optional: bool = False
    varlen: bool = False
    paged: bool = False
    fp8_kv: bool = False


def distribution_version(*names: str) -> str | None:
    """An installed distribution's version from its metadata (no import: importing a compiler can be slow
    or touch CUDA), or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class Backend:
    """A code generator and runtime for some kernel roles. Subclasses set the class attributes and `roles`,
    and implement `build`; the rest has sound defaults.

    name        what Spec.backend says to choose it
    archs       CUDA archs its kernels run on (None: any that its compiler supports)
    devices     device types it runs on ("cuda"; "cpu" for the interpreter or a reference)
    per_shape   its kernels are compiled for one problem shape (`build` gets the Problem)
    compilers   fingerprint column -> distribution names: the compiler versions its winners are tied to
    schedules   the Spec.schedule values its roles compute
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    archs: ClassVar[tuple[str, ...] | None] = None
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    per_shape: ClassVar[bool] = False
    compilers: ClassVar[dict[str, tuple[str, ...]]] = {}
    schedules: ClassVar[tuple[str, ...]] = ("q_centric",)
    windows: ClassVar[bool] = False  # whether its kernels compute Spec.window (a sliding window)
    softcaps: ClassVar[bool] = False  # whether its kernels compute Spec.softcap (logit soft-capping)
    head_dims: ClassVar[tuple[int, ...]] = HEAD_DIMS  # the Spec.head_dim values its kernels compute
    roles: dict[str, RoleImpl] = {}

    # ---- what it supports ------------------------------------------------------------------------
    def not_installed(self) -> str | None:
        """Why this backend cannot run in this environment (a package missing), or None."""
        return None

    def spec_unsupported(self, spec: Spec) -> str | None:
        """Why this backend's kernels cannot compute `spec` at all, or None."""
        if spec.schedule not in self.schedules:
            return (f"Spec.schedule={spec.schedule!r} is not built for backend={self.name!r}; it computes "
                    f"{', '.join(map(repr, self.schedules))} (use backend='triton')")
        if spec.head_dim not in self.head_dims:
            return (f"Spec.head_dim={spec.head_dim} is not supported by backend={self.name!r}; expected one of "
                    f"{self.head_dims} (use backend='triton', or 'auto')")
        if spec.window is not None and not self.windows:
            return (f"Spec.window={spec.window} is not built for backend={self.name!r}: its kernels have no sliding "
                    "window (use backend='triton', or 'auto')")
        if spec.softcap is not None and not self.softcaps:
            return (f"Spec.softcap={spec.softcap} is not built for backend={self.name!r}: its kernels do not cap "
                    "scores (use backend='triton', or 'auto')")
        return None

    def device_unsupported(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None."""
        device = torch.device(device)
        if device.type not in self.devices:
            return f"backend={self.name!r} runs on {' and '.join(self.devices)} devices only, not on {device}"
        if device.type == "cuda" and self.archs is not None:
            from ..device import device_arch, gpu_name

            arch = device_arch(device)
            if arch not in self.archs:
                return (f"backend={self.name!r} runs on {', '.join(self.archs)} only; {gpu_name(device)} is {arch}: "
                        "use another backend (kernelgen.backends.names()) or 'auto'")
        return None

    def unsupported(self, spec: Spec, device=None) -> str | None:
        """Why this backend cannot serve `spec` (on `device`, when given), or None."""
        return self.not_installed() or self.spec_unsupported(spec) or (
            None if device is None else self.device_unsupported(device))

    def arch_unsupported(self, arch: str) -> str | None:
        """Why this backend's kernels cannot run on `arch` ("sm_89", or "cpu"), or None."""
        if arch == "cpu":
            return None if "cpu" in self.devices else f"backend={self.name!r} does not run on the CPU"
        if "cuda" not in self.devices:
            return f"backend={self.name!r} does not run on CUDA GPUs"
        if self.archs is not None and arch not in self.archs:
            return f"backend={self.name!r} runs on {', '.join(self.archs)} only, not {arch}"
        return None

    # ---- configs ---------------------------------------------------------------------------------
    def role(self, role: str) -> RoleImpl:
        try:
            return self.roles[role]
        except KeyError:
            raise KernelgenValueError(f"backend={self.name!r} does not run role {role!r}; it runs "
                                      f"{sorted(self.roles)}") from None

    def config_type(self, role: str) -> type | None:
        return self.role(role).config_type

    def default_config(self, spec: Spec, role: str, arch: str):
        """The config served on `arch` when nothing is tuned."""
        return self.role(role).default(spec, check_arch(arch))

    def infeasible(self, spec: Spec, role: str, config, arch: str | None) -> str | None:
        """Why `config` is no point `role`'s kernel runs for `spec` on `arch`, or None (its type included).
        arch=ANY_ARCH (no device known yet): why it runs on none of the archs this backend runs on, the
        arch-independent rules (the arch's are checked where the device is known)."""
        impl = self.role(role)
        if impl.config_type is None:
            return None if config is None else f"role {role!r} of backend={self.name!r} takes no config"
        if type(config) is not impl.config_type:
            return f"{type(config).__name__} is no {impl.config_type.__name__}"
        if arch is not ANY_ARCH:
            return impl.infeasible(spec, config, check_arch(arch))
        reasons = [impl.infeasible(spec, config, a) for a in self._runnable_archs()]
        return reasons[-1] if reasons and all(reasons) else None  # the most capable arch's reason

    def _runnable_archs(self) -> list[str]:
        """The archs this backend runs on, of the interpreter, kernelgen's table and `archs`, in order of
        capability (the interpreter first: a GPU's reason is the one to give)."""
        candidates = dict.fromkeys(["cpu", *ARCHS, *(self.archs or ())])
        return [arch for arch in candidates if self.arch_unsupported(arch) is None]

    def config_space(self, spec: Spec, role: str, arch: str) -> list:
        """Every point of the role's search space that runs on `arch`."""
        impl = self.role(role)
        arch = check_arch(arch)
        return [c for c in impl.space(spec, arch) if c is None or impl.infeasible(spec, c, arch) is None]

    def check_config(self, spec: Spec, role: str, config, arch: str | None, caller_spec: Spec | None = None) -> None:
        """A config a caller pins: of the role's type, and feasible on `arch` (ANY_ARCH: on some arch this
        backend runs on; an infeasible point could leave rows unwritten). Raises naming the role, and the caller's
        spec where given (the role's kernel spec may differ: the attention's has selector "given")."""
        impl = self.role(role)
        if impl.config_type is not None and type(config) is not impl.config_type:
            raise KernelgenTypeError(f"configs[{role!r}] must be an instance of {impl.config_type.__name__} for "
                                     f"backend={self.name!r}, got {type(config).__name__}")
        if impl.config_type is not None:
            _check_field_types(role, config)
        reason = self.infeasible(spec, role, config, arch)
        if reason:
            where = "any arch" if arch is ANY_ARCH else arch
            raise KernelgenValueError(f"configs[{role!r}] = {config} is not feasible for {caller_spec or spec} on "
                                      f"{where}: {reason} (Backend.config_space lists the feasible points)")

    def config_from_dict(self, role: str, data: dict | None):
        """The role's config of these fields (a DB row's, a study's), each of its declared type (TypeError or
        ValueError naming a wrong one)."""
        impl = self.role(role)
        if impl.config_type is None:
            return None
        config = impl.config_type(**(data or {}))
        _check_field_types(role, config)
        return config

    @staticmethod
    def config_to_dict(config) -> dict | None:
        return None if config is None else dataclasses.asdict(config)

    # ---- building and fingerprints ---------------------------------------------------------------
    def build(self, spec: Spec, role: str, config, problem: Problem | None = None):
        """The kernel that `RoleImpl.launch` runs: a loaded module, a compiled kernel. `spec` is the
        role's kernel spec (`Role.kernel_spec`); `problem` is given when `per_shape`."""
        raise NotImplementedError

    def compiler_versions(self) -> dict[str, str | None]:
        """Fingerprint columns of its compilers (`compilers`), from package metadata."""
        return {column: distribution_version(*names) for column, names in self.compilers.items()}

    @functools.lru_cache(maxsize=None)  # noqa: B019 - backends live as long as the process
    def template_hash(self, role: str) -> str:
        """Hash of the role's template text and of the templates it includes (its rendered kernels'
        source), part of its winners' fingerprint: editing one role's template leaves the other roles'
        winners valid, and editing an included one retires the winners of every role that includes it."""
        from ..codegen.render import template_files

        template = self.role(role).template
        if template is None:
            return "none"
        return hashlib.sha256(b"".join(path.read_bytes() for path in template_files(template))).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"<kernelgen backend {self.name!r}>"


@functools.lru_cache(maxsize=None)
def _field_types(config_type) -> dict[str, type]:
    return typing.get_type_hints(config_type)


def _check_field_types(role: str, config) -> None:
    """Every tunable of a pinned config has its declared type (int or bool; a bool is not an int here), and an int
    one is a count (>= 1; warps a power of two, as Triton takes them), so a wrong one is named, not compared,
    rendered or launched."""
    for name, kind in _field_types(type(config)).items():
        value = getattr(config, name)
        if type(value) is not kind:
            raise KernelgenTypeError(f"configs[{role!r}].{name} must be {kind.__name__}, got {value!r} "
                                     f"({type(value).__name__})")
        if kind is int and value < 1:
            raise KernelgenValueError(f"configs[{role!r}].{name} must be at least 1, got {value}")
        if kind is int and name.endswith("warps") and (value & (value - 1) or value > 32):
            raise KernelgenValueError(f"configs[{role!r}].{name} must be a power of two up to 32 (warps a "
                                      f"program), got {value}")

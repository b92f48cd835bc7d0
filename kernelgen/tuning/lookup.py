"""From the tuning DB to dispatch: the config a role of a spec is served on a device, dtype and length
bucket, and `auto`'s choice of backend. A broken or foreign DB is a miss, never a crash.

A role's config, in this order (`served_config`):
1. the spec's own winner (`tuned_row`: this GPU, the nearest tuned length bucket);
2. the nearest tuned spec's winner (`nearest_spec_row`): the same arch, backend, head-dim tile width, block sizes
   (and selector, for selection), from the spec nearest in GQA group, causality, density and length,
   if the config is feasible for this spec;
3. the backend's default (the caller's business: None here).
`auto` serves the backend whose own winner is fastest; with none, the backend `rule_backend` measured.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any, NamedTuple

import torch

from .. import backends
from ..errors import KernelgenValueError
from ..inputs import next_pow2
from ..device import device_arch, gpu_name
from ..roles import SELECTION_ROLES, get_role
from ..spec import Spec
from .rule import rule_backend

__all__ = ["Target", "Tuned", "cannot_serve", "tuned_config", "tuned_row", "nearest_spec_row", "served_config", "recheck", "fastest_backend",
           "spec_distance"]

log = logging.getLogger("kernelgen")


class Target(NamedTuple):
    """What a lookup is for without a device at hand (an export for another machine): an arch and, if
    known, the GPU's name (None: the rows of any GPU of the arch)."""

    arch: str
    gpu_name: str | None = None


def _target(device) -> Target:
    return device if isinstance(device, Target) else Target(device_arch(device), gpu_name(device))


def cannot_serve(backend, spec: Spec, device) -> str | None:
    """Why `backend` cannot serve `spec` on `device` (a torch device, or a `Target`), or None."""
    if isinstance(device, Target):
        return backend.unsupported(spec) or backend.arch_unsupported(device.arch)
    return backend.unsupported(spec, device)


class Tuned:
    """A tuned config as served: where it came from and what to re-check before trusting it."""

    __slots__ = ("config", "source", "soft_mismatch", "transferred_from", "row")

    def __init__(self, config: Any, row: dict, transferred_from: Spec | None = None):
        self.config = config
        self.row = row
        self.soft_mismatch: tuple[str, ...] = tuple(row.get("soft_mismatch", ()))
        self.transferred_from = transferred_from
        db = f"{row.get('source', 'user')} DB"
        self.source = db if transferred_from is None else f"{db}, nearest tuned spec"

    def __repr__(self) -> str:
        return f"Tuned({self.config}, {self.source!r}, soft_mismatch={self.soft_mismatch})"


@functools.lru_cache(maxsize=None)
def _winners():
    from .db import Winners

    return Winners()


@functools.lru_cache(maxsize=None)
def _fingerprint(backend: str, role: str):
    from .db import current_fingerprint

    return current_fingerprint(backends.get(backend), role)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _feasible(backend, spec: Spec, role: str, row: dict, arch: str, what: str) -> bool:
    """A row whose config is no point of the current space on `arch` (left out since it was tuned: a kernel
    seen to hang, e.g. TileLang's three stages at D=64) is a miss, never a launch of it."""
    reason = backend.infeasible(spec, role, backend.config_from_dict(role, row["config"]), arch)
    if reason:
        log.log(logging.WARNING if what == "own" else logging.DEBUG,
                "tuning DB: %s %s row (bucket %d, %s, %s winner) holds %s, which this kernelgen does not run "
                "for %s (%s); not served", backend.name, role, row["bucket"], row.get("source", "db"), what,
                row["config"], spec, reason)
    return reason is None


def _readable(backend, role: str, row: dict) -> bool:
    """Whether `backend` reads the row's config as one of `role`'s (its fields, of their types); a hand-edited
    one is skipped with a warning naming its key, and never hides the other rows of its key."""
    from .db import KEY_COLUMNS

    try:
        backend.config_from_dict(role, row["config"])
        return True
    except (TypeError, ValueError) as error:
        log.warning("tuning DB row %s holds no %s %s config (%s); skipping it",
                    {name: row.get(name) for name in KEY_COLUMNS}, backend.name, role, error)
        return False


def tuned_row(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    """The DB row of `backend`'s winner for `role` of `spec` (its kernel spec or any spec with the same
    key) on this GPU in the nearest tuned bucket, or None. Carries `source` and `soft_mismatch`."""
    try:
        target = _target(device)
        key = dict(spec_key=get_role(role).key(spec, backend.name), role=role, backend=backend.name,
                   arch=target.arch, dtype=_dtype_name(dtype))
        fingerprint = _fingerprint(backend.name, role)
        readable = functools.partial(_readable, backend, role)
        if target.gpu_name is None:  # any GPU of the arch
            from .db import nearest_bucket_row

            row = nearest_bucket_row(list(filter(readable, _winners().servable(fingerprint, **key))), bucket)
        else:
            row = _winners().lookup(**key, gpu_name=target.gpu_name, bucket=bucket, fingerprint=fingerprint,
                                    usable=readable)
        return row if row is not None and _feasible(backend, spec, role, row, target.arch, "own") else None
    except Exception as error:  # dispatch must keep working whatever the DB holds
        log.warning("tuning DB lookup failed (%s: %s); using default configs", type(error).__name__, error)
        return None


def tuned_config(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device):
    """(config, "user DB" or "bundled DB") of the spec's own winner for a length bucket, or (None, None)."""
    row = tuned_row(backend, spec, role, bucket, dtype, device)
    if row is None:
        return None, None
    return backend.config_from_dict(role, row["config"]), f"{row.get('source', 'user')} DB"


# ---- the nearest tuned spec ------------------------------------------------------------------------

def _kernel_shape(spec: Spec, selection: bool) -> tuple:
    """What a transferred config must share with its source: the fields that shape the kernel's tiles and loads
    (head_dim as its tiles' width, a power of two: D=96 computes at 128's, so 128's winners fit it, after any of its
    own), and a selection role's selector."""
    shape = (next_pow2(spec.head_dim), spec.kv_block, spec.q_tile, spec.schedule)
    return shape + (spec.selector,) if selection else shape


def _density(spec: Spec, bucket: int) -> float:
    """The fraction of a bucket-long sequence's blocks a tile lists."""
    return min(1.0, spec.top_k / max(1, spec.n_kv_blocks(bucket)))


def spec_distance(spec: Spec, bucket: int, other: Spec, other_bucket: int) -> float:
    """How far a winner tuned for (other, other_bucket) is from (spec, bucket), in doublings: of the GQA
    group, the length and the density, and 2 for a causal mismatch (it halves the work and skews it)."""
    return (abs(math.log2(spec.gqa_group / other.gqa_group))
            + abs(math.log2(bucket / other_bucket))
            + abs(math.log2(_density(spec, bucket) / _density(other, other_bucket)))
            + 2.0 * (spec.causal != other.causal))


def nearest_spec_row(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device
                     ) -> tuple[dict, Spec] | None:
    """(row, its spec) of `backend`'s winner for the tuned spec nearest `spec` (`spec_distance`) that
    shares its kernel's shape fields, on this arch (this GPU's rows first), whose config is feasible for
    `spec`; None if there is none."""
    try:
        target = _target(device)
        rows = _winners().servable(_fingerprint(backend.name, role), role=role, backend=backend.name,
                                   arch=target.arch, dtype=_dtype_name(dtype))
        shape = _kernel_shape(spec, role in SELECTION_ROLES)
        this_gpu = target.gpu_name or ""
        candidates = []
        for row in filter(functools.partial(_readable, backend, role), rows):
            try:
                other = Spec(**json.loads(row["spec_json"]))
            except Exception:  # a row without its spec (or of a spec this kernelgen refuses): not a candidate
                continue
            if _kernel_shape(other, role in SELECTION_ROLES) != shape:
                continue
            rank = (row["gpu_name"] != this_gpu and bool(this_gpu), other.head_dim != spec.head_dim,
                    spec_distance(spec, bucket, other, row["bucket"]),
                    row.get("source") != "user", row["median_ms"])
            candidates.append((rank, row, other))
        for _, row, other in sorted(candidates, key=lambda c: c[0]):
            if _feasible(backend, spec, role, row, target.arch, "nearest spec's"):
                return row, other
        return None
    except Exception as error:  # dispatch must keep working whatever the DB holds
        log.warning("tuning DB lookup failed (%s: %s); using default configs", type(error).__name__, error)
        return None


def served_config(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device) -> Tuned | None:
    """The tuned config dispatch serves for `role` of `spec` (its kernel spec on `backend`): the spec's own
    winner, else the nearest tuned spec's; None where neither exists (the default is served)."""
    row = tuned_row(backend, spec, role, bucket, dtype, device)
    if row is not None:
        return Tuned(backend.config_from_dict(role, row["config"]), row)
    nearest = nearest_spec_row(backend, spec, role, bucket, dtype, device)
    if nearest is None:
        return None
    row, other = nearest
    own = other.key() == spec.key()  # (found this way when no GPU name was given)
    return Tuned(backend.config_from_dict(role, row["config"]), row, transferred_from=None if own else other)


@functools.lru_cache(maxsize=None)
def recheck(backend, spec: Spec, role: str, config, bucket: int, dtype: torch.dtype, device: torch.device,
            soft_mismatch: tuple[str, ...]) -> bool:
    """Whether a winner measured under another kernelgen, torch or CUDA runtime (`soft_mismatch` names
    which) still computes the right result here: the tuner's check, once per process."""
    from .worker import check_config

    try:
        error = check_config(backend, spec, role, config, bucket, dtype, device)
    except Exception as exc:  # a config that no longer builds or runs here is as wrong as a wrong result
        error = f"{type(exc).__name__}: {exc}"
    if error:
        log.warning("tuning DB: the %s %s winner %s for %s, measured under another %s, fails its check here (%s); "
                    "serving the default config", backend.name, role, config, spec, ", ".join(soft_mismatch), error)
        return False
    log.debug("tuning DB: the %s %s winner %s for %s was measured under another %s; re-checked here: correct",
              backend.name, role, config, spec, ", ".join(soft_mismatch))
    return True


# ---- auto ------------------------------------------------------------------------------------------

def fastest_backend(spec, bucket: int, dtype: torch.dtype, device: torch.device, role: str = "attn",
                    compiled_once: bool = False) -> str | None:
    """For `Spec.backend == "auto"`: the registered backend whose own tuned `role` for this spec is fastest,
    among those that have the role and can serve the spec on this device (`compiled_once`: and compile it once
    per spec, not per problem shape). Each backend's row is its nearest tuned bucket; the row nearer this bucket
    wins (an exact bucket beats a neighbour's), and between rows equally near, the faster. With no tuned row: for
    the attention, the backend the measured rule prefers (`rule_backend`); for another role, None (it runs where
    the attention runs: `backends.runner`)."""
    servable = {}
    for backend in backends.all_backends():
        if role not in backend.roles or (compiled_once and backend.per_shape):
            continue
        try:
            servable[backend.name] = not cannot_serve(backend, spec, device)
        except Exception:  # dispatch must keep working whatever the device says
            servable[backend.name] = False
    rows = {}
    for name, ok in servable.items():
        if ok:
            backend = backends.get(name)
            row = tuned_row(backend, get_role(role).kernel_spec(spec, name), role, bucket, dtype, device)
            if row is not None:
                rows[name] = row
    if rows:  # the row measured nearest this bucket first, then the faster one
        return min(rows, key=lambda b: (abs(rows[b]["bucket"].bit_length() - int(bucket).bit_length()),
                                        rows[b]["median_ms"]))
    if role != "attn":
        return None
    try:
        arch = _target(device).arch
    except Exception:
        return backends.FALLBACK
    return rule_backend(spec, arch, lambda name: servable.get(name, False)
                        and backends.has_config(backends.get(name), spec, role, arch))



"""From the tuning DB to dispatch: the winning config of a role for a spec, backend, device, dtype and
length bucket, and `auto`'s choice of backend. A broken or foreign DB is a miss, never a crash."""
from __future__ import annotations

import functools
import logging

import torch

from .. import backends
from ..device import device_arch, gpu_name
from ..roles import get_role

__all__ = ["tuned_config", "tuned_row", "fastest_backend"]

log = logging.getLogger("kernelgen")


@functools.lru_cache(maxsize=None)
def _winners():
    from .db import Winners

    return Winners()


@functools.lru_cache(maxsize=None)
def _fingerprint(backend: str, role: str):
    from .db import current_fingerprint

    return current_fingerprint(backends.get(backend), role)


def tuned_row(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    """The DB row of `backend`'s winner for `role` of `spec` (its kernel spec or any spec with the same
    key) in the nearest tuned bucket, or None. A row whose config has left the search space is a miss."""
    try:
        row = _winners().lookup(spec_key=get_role(role).key(spec, backend.name), role=role, backend=backend.name,
                                arch=device_arch(device), gpu_name=gpu_name(device),
                                dtype=str(dtype).removeprefix("torch."), bucket=bucket,
                                fingerprint=_fingerprint(backend.name, role))
        if row is not None and backend.infeasible(spec, role, backend.config_from_dict(role, row["config"]),
                                                  device_arch(device)):
            # tuned before kernelgen left the point out of its space (a kernel seen to hang, e.g.
            # TileLang's three stages at D=64): a miss, never a launch of it
            log.warning("tuning DB: %s %s row (bucket %d, %s) holds %s, which this kernelgen no longer runs; "
                        "using default configs", backend.name, role, row["bucket"], row.get("source", "db"),
                        row["config"])
            return None
        return row
    except Exception as error:  # dispatch must keep working whatever the DB holds
        log.warning("tuning DB lookup failed (%s: %s); using default configs", type(error).__name__, error)
        return None


def tuned_config(backend, spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device):
    """(config, "user DB" or "bundled DB") of the winner for a power-of-two length bucket, or (None, None)."""
    row = tuned_row(backend, spec, role, bucket, dtype, device)
    if row is None:
        return None, None
    return backend.config_from_dict(role, row["config"]), f"{row.get('source', 'user')} DB"


def fastest_backend(spec, bucket: int, dtype: torch.dtype, device: torch.device) -> str:
    """For `Spec.backend == "auto"`: the registered backend whose tuned attention for this bucket is
    fastest, among those that can serve the spec on this device. Each backend's row is its nearest tuned
    bucket; the row nearer this bucket wins (an exact bucket beats a neighbour's), and between rows equally
    near, the faster. With no tuned row at all, the fallback backend."""
    rows = {}
    for backend in backends.all_backends():
        if "attn" not in backend.roles:
            continue
        try:
            if backend.unsupported(spec, device):
                continue
        except Exception:  # dispatch must keep working whatever the device says
            continue
        row = tuned_row(backend, get_role("attn").kernel_spec(spec, backend.name), "attn", bucket, dtype, device)
        if row is not None:
            rows[backend.name] = row
    if not rows:
        return backends.FALLBACK
    # the row measured nearest this bucket first, then the faster one
    return min(rows, key=lambda b: (abs(rows[b]["bucket"].bit_length() - int(bucket).bit_length()),
                                    rows[b]["median_ms"]))

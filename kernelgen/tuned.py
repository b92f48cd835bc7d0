"""Bridge from the tuning DB to dispatch: the winning config for a spec, role, device, dtype and
length, or None (then dispatch uses the defaults). A broken or foreign DB is a miss, never a crash."""
from __future__ import annotations

import functools
import logging

import torch

from .config import ATTN_BACKENDS, config_from_dict, feasible
from .spec import gluon_unsupported

__all__ = ["tuned_config", "device_arch", "fastest_backend"]

log = logging.getLogger("kernelgen")


@functools.lru_cache(maxsize=None)
def device_arch(index: int | None) -> tuple[str, str]:
    """(arch like "sm_90", GPU name) of a CUDA device."""
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}", torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _winners():
    from .db import Winners

    return Winners()


@functools.lru_cache(maxsize=None)
def _fingerprint(backend: str, role: str):
    from .db import current_fingerprint
    from .render import template_hash

    return current_fingerprint(template_hash(backend, role), backend)


def _row(spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device):
    if device.type != "cuda":
        return None
    try:
        arch, gpu_name = device_arch(device.index)
        row = _winners().lookup(spec_key=spec.role_key(role), role=role, backend=spec.backend, arch=arch,
                                gpu_name=gpu_name, dtype=str(dtype).removeprefix("torch."), bucket=bucket,
                                fingerprint=_fingerprint(spec.backend, role))
        if row is not None and not feasible(spec, role, config_from_dict(role, row["config"], spec.backend)):
            # tuned before this kernelgen left the point out of its space (a kernel seen to hang, e.g.
            # TileLang's three stages at D=64): a miss, never a launch of it
            log.warning("tuning DB: %s %s row (bucket %d, %s) holds %s, which this kernelgen no longer runs; "
                        "using default configs", spec.backend, role, row["bucket"], row.get("source", "db"),
                        row["config"])
            return None
        return row
    except Exception as error:  # dispatch must keep working whatever the DB holds
        log.warning("tuning DB lookup failed (%s: %s); using default configs", type(error).__name__, error)
        return None


def tuned_config(spec, role: str, bucket: int, dtype: torch.dtype, device: torch.device):
    """The winner for a power-of-two length bucket (`db.seq_bucket(n_k)`), or None."""
    row = _row(spec, role, bucket, dtype, device)
    return None if row is None else config_from_dict(role, row["config"], spec.backend)


@functools.lru_cache(maxsize=None)
def _tilelang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tilelang") is not None


@functools.lru_cache(maxsize=None)
def _gluon_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ImportError:  # no triton.experimental at all
        return False


def _gluon_runs(spec, device: torch.device) -> bool:
    """The Gluon forward can serve `spec` here: a spec it computes, Gluon importable, a Hopper GPU (sm_90)."""
    if device.type != "cuda" or gluon_unsupported(spec) is not None or not _gluon_installed():
        return False
    try:
        return device_arch(device.index)[0] == "sm_90"
    except Exception:  # dispatch must keep working whatever the device says
        return False


def fastest_backend(spec, bucket: int, dtype: torch.dtype, device: torch.device) -> str:
    """For `Spec.backend == "auto"`: the backend whose tuned attention for this bucket is fastest.
    Each backend's row is its nearest tuned bucket; the row nearer this bucket wins (an exact bucket
    beats a neighbour's), and between rows equally near, the faster. TileLang needs to be installed,
    Gluon a Hopper GPU (and a spec its kernel computes); with no tuned row at all, Triton."""
    rows = {}
    for backend in ATTN_BACKENDS:
        if backend == "tilelang" and not _tilelang_installed():
            continue
        if backend == "gluon" and not _gluon_runs(spec, device):
            continue
        row = _row(spec.replace(backend=backend), "attn", bucket, dtype, device)
        if row is not None:
            rows[backend] = row
    if not rows:
        return "triton"
    # the row measured nearest this bucket first, then the faster one
    return min(rows, key=lambda b: (abs(rows[b]["bucket"].bit_length() - int(bucket).bit_length()),
                                    rows[b]["median_ms"]))

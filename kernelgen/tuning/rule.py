"""The backend `auto` serves where nothing is tuned for a spec: a rule measured on the GPU.

Measured by `tools/backend_rule.py` (each backend's default config, pinned; B1 H16 N16k bf16, G=1;
head_dim 64 and 128, 64- and 128-key blocks, causal or not, top-16 or every block): on the H200 (sm_90)
the fastest backend depended on the block size alone. Table and figures: docs/DESIGN.md
("What `backend="auto"` serves, and why"), docs/perf/backend_rule_sm90.json.

An arch without a measurement gets the fallback backend: the one kernelgen tests on every arch.
"""
from __future__ import annotations

from .. import backends
from ..spec import Spec

__all__ = ["PREFERENCE", "rule_backend"]

# arch -> kv_block -> backends, fastest default first
PREFERENCE: dict[str, dict[int, tuple[str, ...]]] = {
    "sm_90": {
        64: ("gluon", "tilelang", "triton"),  # D=128: 0.29 ms vs 0.32 (TileLang), 0.82 (Triton), top-16
        128: ("tilelang", "gluon", "triton"),  # D=128 dense: 635 TFLOP/s vs 506 (Gluon), 460 (Triton)
    },
}


def rule_backend(spec: Spec, arch: str, supported=lambda name: True) -> str:
    """The backend the rule prefers for `spec` on `arch` among those `supported(name)` accepts; the
    fallback backend where the rule has no entry or none of its backends is supported."""
    for name in PREFERENCE.get(arch, {}).get(spec.kv_block, ()):
        if name in backends.names() and supported(name):
            return name
    return backends.FALLBACK

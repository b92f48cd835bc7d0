"""Bridge from the tuning DB to dispatch: the winning config for a spec, role and length, or None."""
from __future__ import annotations


def tuned_config(spec, role: str, n_k: int):
    return None

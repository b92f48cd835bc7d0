"""Tuning: plan, measure and record the fastest config of each kernel role per GPU and length bucket.

  buckets   the power-of-two length buckets winners are kept per
  plan      what a tune does (pure): backend, feasible space, sampler, inputs, study name
  worker    the crash-isolated process that builds, checks and times one config
  study     the Optuna study around it (one worker process per GPU, each config measured once), and the
            winner written to the DB
  storage   where studies live, by URL (SQLite, an RDB server, a journal file), shared across processes
  db        the SQLite winners tables: the user DB and the bundled, read-only one
  lookup    from the DB to dispatch: a role's winner, and `auto`'s choice of backend

`tune` and `TuneResult` are loaded on first use: dispatch reads the DB without importing Optuna. `plan`
(no Optuna) is imported here: the function shares its name with its module, and a lazy attribute would be
replaced by the module as soon as `kernelgen.tuning.plan` is first imported.
"""
from __future__ import annotations

import importlib

from .buckets import seq_bucket
from .plan import plan, tune_inputs_shape

__all__ = ["tune", "plan", "TuneResult", "seq_bucket", "tune_inputs_shape"]

_LAZY = {"tune": "study", "TuneResult": "study"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

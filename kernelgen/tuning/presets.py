"""Named sets of studies: `kernelgen tune --preset NAME` tunes each of them.

  bench   the benchmark shapes (kernelgen/workloads.py SHAPES): the attention of each registered backend
          that runs on the arch (the whole space when it is small), the selector, and the backward's dQ and
          dK/dV kernels of each backend that has them, timed on the shape's own workload, as the bundled
          winners are made.
  kv      the KV-centric bench shapes (KV_CENTRIC_SHAPES, per-query lists): kv_attn and its union design
          (kv_attn_union, on lists whose neighbours agree), the backward (kv_bwd, and kv_bwd_union on such lists),
          the mean selector (kv_select) and the index selector (kv_select_index, on Hi = 4, Di = 64 index
          vectors), Triton.
  decode  the decode bench shapes (DECODE_SHAPES, a few queries against a long KV cache): the `decode` attention
          of each backend that has it, and the selection of a decode step under each schedule, as `bench --decode`
          times it (decode_select and kv_decode_select for the `mean` selector; decode_select_index and
          kv_decode_select_index on Hi = 4, Di = 64 index vectors over a cache of per-row lengths).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .. import backends
from ..archs import check_arch
from ..errors import KernelgenValueError
from ..spec import Spec
from ..workloads import DECODE_SHAPES, KV_CENTRIC_SHAPES, SHAPES

__all__ = ["Study", "PRESETS", "studies"]

ATTN_TRIALS = {"a32k": 16, "a128k": 16, "b": 12, "c": 10, "c_dense": 8}  # TPE budgets of the large Triton spaces
SELECT_TRIALS = 8
BACKWARD_TRIALS = 10  # per backward role (bwd_dq, bwd_dkdv)
BACKWARD_ROLES = ("bwd_dq", "bwd_dkdv")  # bwd_delta has no tunables worth a study
GRID_MAX = 24  # spaces up to this many points are searched whole


@dataclass(frozen=True)
class Study:
    label: str
    spec: Spec
    role: str
    seq: int
    trials: int
    shape: dict  # the workload timed: batch, heads_kv, n_q, n_k


def _shapes_and_backends(shape_names, table: dict, backend_names):
    """(shape, backend) pairs of a preset's named shapes of `table` (an unknown name refused) and backends."""
    for name in shape_names:
        if name not in table:
            raise KernelgenValueError(f"shapes={name!r} is unknown; expected some of {list(table)}")
        for backend_name in backend_names:
            yield table[name], backends.get(backend_name)


def _bench(arch: str, shape_names, backend_names) -> Iterator[Study]:
    for name in shape_names:
        if name not in SHAPES or name == "tiny":
            raise KernelgenValueError(f"shapes={name!r} is unknown; expected some of "
                                      f"{[n for n in SHAPES if n != 'tiny']}")
        shape = SHAPES[name]
        workload = _workload(shape)
        for backend_name in backend_names:
            backend = backends.get(backend_name)
            spec = shape.spec("given").replace(backend=backend.name)
            if "attn" not in backend.roles or backend.spec_unsupported(spec) or backend.arch_unsupported(arch):
                continue
            space = len(backend.config_space(spec, "attn", arch))
            if not space:  # no config of it fits the arch (its shared memory, say)
                continue
            trials = space if space <= GRID_MAX else min(space, ATTN_TRIALS.get(name, 12))
            yield Study(f"{name} attn {backend.name}", spec, "attn", shape.n_k, trials, workload)
            for role in BACKWARD_ROLES:
                if role in backend.roles and backend.config_space(spec, role, arch):
                    yield Study(f"{name} {role} {backend.name}", spec, role, shape.n_k, BACKWARD_TRIALS, workload)
        if name != "c_dense":  # its lists hold every block: the selector's choice is fixed
            yield Study(f"{name} select", shape.spec("mean"), "select", shape.n_k, SELECT_TRIALS, workload)


KV_TRIALS = {"kv_attn": 16, "kv_attn_union": 12, "kv_bwd": 12, "kv_bwd_union": 12, "kv_select": 8,
             "kv_select_index": 12}
KV_SELECTORS = {"kv_select": "mean", "kv_select_index": "index"}  # the selector each selection role tunes
DEFAULT_SHAPES = {"bench": ["a32k", "b", "c", "c_dense"], "kv": list(KV_CENTRIC_SHAPES),
                  "decode": list(DECODE_SHAPES)}


def _workload(shape) -> dict:
    return {"batch": shape.batch, "heads_kv": shape.heads_kv, "n_q": shape.n_q, "n_k": shape.n_k}


def _kv(arch: str, shape_names, backend_names) -> Iterator[Study]:
    """The per-query roles of each backend that runs them (Triton)."""
    for shape, backend in _shapes_and_backends(shape_names, KV_CENTRIC_SHAPES, backend_names):
        for role, trials in KV_TRIALS.items():
            spec = shape.spec(KV_SELECTORS.get(role, "given")).replace(backend=backend.name)
            if role in backend.roles and not backend.spec_unsupported(spec) and not backend.arch_unsupported(arch):
                yield Study(f"{shape.name} {role} {backend.name}", spec, role, shape.n_k, trials, _workload(shape))


DECODE_TRIALS = 12  # per selection role of a decode step (decode's own space is small: searched whole)
# the selection role of a decode step: (selector, schedule) it tunes
DECODE_SELECTIONS = {"decode_select": ("mean", "q_centric"), "kv_decode_select": ("mean", "kv_centric"),
                     "decode_select_index": ("index", "q_centric"),
                     "kv_decode_select_index": ("index", "kv_centric")}


def _decode(arch: str, shape_names, backend_names) -> Iterator[Study]:
    for shape, backend in _shapes_and_backends(shape_names, DECODE_SHAPES, backend_names):
        if backend.arch_unsupported(arch):
            continue
        given = shape.spec("given").replace(backend=backend.name)
        space = len(backend.config_space(given, "decode", arch)) if "decode" in backend.roles and \
            not backend.spec_unsupported(given) else 0
        if space:
            yield Study(f"{shape.name} decode {backend.name}", given, "decode", shape.n_k,
                        space if space <= GRID_MAX else DECODE_TRIALS, _workload(shape))
        for role, (selector, schedule) in DECODE_SELECTIONS.items():
            spec = shape.spec(selector).replace(schedule=schedule, backend=backend.name)
            if role in backend.roles and not backend.spec_unsupported(spec):
                yield Study(f"{shape.name} {role} {backend.name}", spec, role, shape.n_k, DECODE_TRIALS,
                            _workload(shape))


PRESETS = {"bench": _bench, "kv": _kv, "decode": _decode}


def studies(preset: str, arch: str, shape_names=None, backend_names=None, roles=None) -> list[Study]:
    """The studies of a preset on `arch`, for some shapes (default: all but the CPU smoke size), backends
    (default: every registered one that runs on `arch`) and roles (default: all)."""
    if preset not in PRESETS:
        raise KernelgenValueError(f"preset {preset!r} is unknown; expected one of {sorted(PRESETS)}")
    shape_names = shape_names or DEFAULT_SHAPES[preset]
    chosen = PRESETS[preset](check_arch(arch), shape_names, backend_names or backends.names())
    return [study for study in chosen if roles is None or study.role in roles]

"""Planning a tune (pure; any machine): the backend and kernel spec tuned, the feasible space, the
sampler, the inputs timed, the study's name.

A trial is one config: one categorical parameter per config field, over the values present in the
feasible space (`Backend.config_space`). Small spaces (at most `trials` points) are searched
exhaustively with GridSampler, larger ones with TPE, seeded with the default config and its
neighbours along each field of at most three values (`seeds`).
"""
from __future__ import annotations

import dataclasses
import json
import math

import torch

from .. import backends
from ..archs import check_arch
from ..backends import Backend
from ..device import current_arch
from ..errors import KernelgenTypeError, KernelgenValueError
from ..roles import ROLES, SELECTION_ROLES, forward_roles, get_role
from ..spec import Spec
from .buckets import seq_bucket

__all__ = ["trial_shapes", "plan", "tune_inputs_shape", "study_name", "tuned_backend", "check_budget", "check_seq",
           "check_workers", "config_key", "seeds", "MAX_SEQ"]

CPU_MAX_SEQ = 256  # interpreter inputs: seq capped here, one KV head
CHECK_MAX_SEQ_GPU = 1000  # correctness inputs on the GPU: small, and not a multiple of any tile
CHECK_HEADS_KV_GPU = 2
MAX_SEQ = 1 << 24  # 16M tokens: past any one GPU's memory for these inputs


def check_budget(trials, timeout=None) -> None:
    """A tune's budget: trials an int >= 1; timeout None or a finite number of seconds > 0."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise KernelgenValueError(f"trials must be an int >= 1, got {trials!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise KernelgenValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def check_workers(workers) -> int:
    """A tune's worker processes: an int >= 1 (one per GPU)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise KernelgenValueError(f"workers must be an int >= 1 (one worker process per GPU), got {workers!r}")
    return workers


def check_seq(seq) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= MAX_SEQ:
        raise KernelgenValueError(f"seq must be an int from 1 to {MAX_SEQ}, got {seq!r}")
    return seq


def tune_inputs_shape(spec: Spec, seq: int, *, cpu: bool = False,
                      shape: dict | None = None) -> tuple[int, int, int, int, int]:
    """(B, Hq, Hkv, Nq, Nk) of the inputs a tune times on.

    GPU: B=1, Hq = max(G, 32 rounded up to a multiple of G), Hkv = Hq // G, Nq = Nk = seq; or
    `shape` ({"batch", "heads_kv", "n_q", "n_k"}: the workload to tune for), whose n_k must lie
    in seq's bucket.
    CPU (interpreter): B=1, Hq = G, Hkv = 1, Nq = Nk = min(seq, 256).
    """
    seq = check_seq(seq)
    g = spec.gqa_group
    if shape is not None and not cpu:
        if set(shape) != {"batch", "heads_kv", "n_q", "n_k"} or not all(
                isinstance(x, int) and x >= 1 for x in shape.values()):
            raise KernelgenValueError(f"shape must map batch, heads_kv, n_q, n_k to ints >= 1, got {shape!r}")
        if seq_bucket(shape["n_k"]) != seq_bucket(seq):
            raise KernelgenValueError(f"shape n_k={shape['n_k']} is outside the bucket of seq={seq}")
        return shape["batch"], shape["heads_kv"] * g, shape["heads_kv"], shape["n_q"], shape["n_k"]
    if cpu:
        n = min(seq, CPU_MAX_SEQ)
        return 1, g, 1, n, n
    heads_q = max(g, -(-32 // g) * g)
    return 1, heads_q, heads_q // g, seq, seq


def study_name(spec: Spec, role: str, arch: str, bucket: int) -> str:
    """`spec` is the role's kernel spec (`tuned_backend`'s second value)."""
    return f"kg-{spec.key()}-{role}-{spec.backend}-{arch}-{bucket}"


def tuned_backend(spec: Spec, role: str) -> tuple[Backend, Spec]:
    """(the backend that runs `role` for `spec`, the role's kernel spec on it): what a tune of it measures."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    role_obj = get_role(role)
    if not role_obj.tuned:
        raise KernelgenValueError(f"role={role!r} has no tunables; tuned roles: "
                                  f"{sorted(r for r, o in ROLES.items() if o.tuned)}")
    if role in SELECTION_ROLES and role not in (spec.selection_role, forward_roles(spec, 1)[1]):
        raise KernelgenValueError(f"role={role!r} does not choose the lists of spec.selector={spec.selector!r}; its "
                                  f"selection role is {spec.selection_role!r}")
    if spec.backend == backends.AUTO:
        if role == "attn":
            raise KernelgenValueError(f"spec.backend='auto' is served, not tuned: tune each of {backends.names()}; "
                                      "get_kernel then serves the fastest")
        backend = backends.runner(backends.FALLBACK, role)
    else:
        backends.check_spec(spec)
        backend = backends.runner(spec.backend, role)
    return backend, role_obj.kernel_spec(spec, backend.name)


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _params(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def _choices(space: list[dict]) -> dict[str, list]:
    """One categorical parameter per config field: the values that occur in the feasible space."""
    return {name: sorted({p[name] for p in space}) for name in space[0]} if space else {}


def seeds(default: dict, choices: dict[str, list], feasible: set[str], limit: int = 8) -> list[dict]:
    """The first TPE trials (at most `limit`): the default config, then its feasible neighbours along
    every field of at most three values, two-valued fields (switches such as use_tma or kv_per_iter)
    first, then three-valued ones (the selector's splits), which a short random start-up could miss."""
    seeds = [default] if config_key(default) in feasible else []
    for field, values in sorted(choices.items(), key=lambda item: len(item[1])):
        if len(values) <= 3:
            for value in values:
                other = {**default, field: value}
                if value != default[field] and config_key(other) in feasible:
                    seeds.append(other)
    return seeds[:limit]


def plan(spec: Spec, role: str, *, seq: int, arch: str | None = None, trials: int = 30,
         device: str | None = None, fixed: dict | None = None, shape: dict | None = None) -> dict:
    """What `tune(spec, role, seq=seq, arch=arch, trials=trials, device=device, fixed=fixed)` would do:
    the configs `arch` runs (default: device="cpu"'s "cpu", else the GPU present's). Pure; works on any
    machine given an arch. `fixed` ({field: value}) restricts the space to the points with those values;
    `shape` sets the inputs timed (`tune_inputs_shape`)."""
    backend, spec = tuned_backend(spec, role)
    check_budget(trials)
    seq = check_seq(seq)
    cpu = _is_cpu(device)
    if arch is None:
        arch = "cpu" if cpu else current_arch()
    if arch is None:
        raise KernelgenValueError("arch=None and no CUDA GPU here to say which: the configs a tune may try depend on "
                                  "the arch; pass arch='sm_90' (or sm_80, sm_89, ...), or device='cpu'")
    reason = backend.arch_unsupported(check_arch(arch))
    if reason:
        raise KernelgenValueError(reason)
    bucket = seq_bucket(seq)
    space = [_params(c) for c in backend.config_space(spec, role, arch)]
    if fixed:
        unknown = set(fixed) - set(space[0] if space else fixed)
        if unknown:
            raise KernelgenValueError(f"fixed names {sorted(unknown)}, which are not {role} config fields")
        space = [p for p in space if all(p[k] == v for k, v in fixed.items())]
    # one study, one shape: the bucket's default inputs, or the workload given
    b, hq, hkv, nq, nk = tune_inputs_shape(spec, bucket if shape is None else seq, cpu=cpu, shape=shape)
    timed = get_role(role).timed_queries
    nq = nq if timed is None else timed(nq)  # the workload's own query count (a decode step's one)
    return {
        "study_name": study_name(spec, role, arch, bucket),
        "spec_key": spec.key(),
        "role": role,
        "backend": spec.backend,
        "arch": arch,
        "bucket": bucket,
        "seq": int(seq),
        "space": space,
        "space_size": len(space),
        "params": _choices(space),
        "default": _params(backend.default_config(spec, role, arch)),
        "sampler": "grid" if len(space) <= trials else "tpe",
        "trials": min(trials, len(space)),
        "shape": {"batch": b, "heads_q": hq, "heads_kv": hkv, "n_q": nq, "n_k": nk, "head_dim": spec.head_dim},
        "dtype": "float16" if cpu else "bfloat16",
        "device": "cpu" if cpu else "cuda",
    }




def trial_shapes(spec: Spec, seq: int, cpu: bool, shape: dict | None) -> tuple[tuple, tuple]:
    """(batch, heads_kv, n_q, n_k) of a trial's two inputs: the small ones checked against the
    reference, and the ones timed (the same on the CPU)."""
    batch, _, hkv, n, n_k = tune_inputs_shape(spec, seq, cpu=cpu, shape=shape)
    bench = (batch, hkv, n, n_k)
    if cpu:
        return (1, hkv, n, n), bench
    n_check = min(seq, CHECK_MAX_SEQ_GPU)
    return (1, CHECK_HEADS_KV_GPU, n_check, n_check), bench

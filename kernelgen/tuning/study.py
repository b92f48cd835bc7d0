"""Tuning studies: one Optuna study per (kernel spec, role, backend, arch, sequence bucket) -> the tuning DB.

    result = tune(spec, "attn", seq=32768, trials=30)      # on the GPU to be tuned
    plan(spec, "attn", seq=32768)                          # what tune() would do; any machine

Each study lives in an Optuna RDB SQLite file (`cache_dir()/optuna.db` unless `storage` says
otherwise) under the name `kg-{kernel spec key}-{role}-{backend}-{arch}-{bucket}`, so a tune that is
interrupted resumes where it stopped: trials already measured count toward `trials`.

A sampled point outside the feasible space is pruned before any compile; a point already measured
returns its stored time (marked `duplicate_of`) so the sampler's model stays right without measuring it
again. A config that fails to compile, runs out of resources, crashes, hangs past `trial_timeout` or
computes a wrong result is a FAILED trial (user attr `error`), never a winner; the study goes on.

The fastest config is written to the tuning DB (`kernelgen.tuning.db.TuningDB`), keyed by the role's
kernel spec, role, backend, arch, GPU name, bucket and dtype, with the toolchain fingerprint (the role's
template hash included). A role the spec's backend lacks is tuned on the backend that runs it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from ..device import device_arch
from ..errors import KernelgenRuntimeError, KernelgenValueError
from ..spec import Spec
from . import db as tuning_db
from .plan import check_budget, config_key, plan, seeds, tuned_backend
from .worker import Worker, precompile_points

__all__ = ["TuneResult", "tune", "TRIAL_TIMEOUT_S"]

log = logging.getLogger("kernelgen")

TRIAL_TIMEOUT_S = 300.0  # per measurement: compile + check + timing
MAX_UNMEASURED_IN_A_ROW = 100  # pruned or duplicate points in a row: the sampler has nothing new
HEARTBEAT_S, GRACE_S = 30, 120  # a RUNNING trial whose tuner stopped beating for GRACE_S is stale


@dataclass(frozen=True)
class TuneResult:
    """What a tune found. Times are median milliseconds; None where nothing was measured.

    n_trials and n_failed count the whole study (resumed sessions included): configs measured, and
    configs that failed (compile, resources, crash, timeout, wrong result).
    """

    study_name: str
    role: str
    bucket: int
    arch: str
    gpu_name: str
    dtype: str
    best_config: dict | None
    best_ms: float | None
    default_ms: float | None
    tflops: float | None
    n_trials: int
    n_failed: int
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """default_ms / best_ms (>= 1 when the tuner found something at least as fast)."""
        if self.best_ms is None or self.default_ms is None:
            return None
        return self.default_ms / self.best_ms



def _storage(storage) -> optuna.storages.BaseStorage:
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if storage is None:
        from ..codegen.cache import cache_dir, unwritable

        storage = cache_dir() / "optuna.db"
        problem = unwritable(storage.parent)
        if problem is not None:
            raise KernelgenRuntimeError(f"the tuner's study storage {storage} cannot be written ({problem}); set "
                                        "KERNELGEN_CACHE_DIR to a writable directory")
    url = str(storage)
    if "://" not in url:
        path = Path(url).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{path}"
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}},
                                      heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)


@contextlib.contextmanager
def _quiet_optuna():
    """Optuna's own per-trial INFO and WARNING lines would interleave with the CLI's progress bar;
    tune() logs each trial through the "kernelgen" logger instead."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _measured(study: optuna.Study) -> tuple[list, list]:
    """(complete, failed): trials that measured a config, and trials whose config failed. Duplicates
    (a stored time replayed) and trials that died with their tuner are neither."""
    complete, failed = [], []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs:
            complete.append(t)
        elif t.state == TrialState.FAIL and "error" in t.user_attrs:
            failed.append(t)
    return complete, failed


def _requeue_interrupted(study: optuna.Study) -> None:
    """Queue again the configs of trials that failed without a verdict (Ctrl-C, a killed tuner whose
    heartbeat went stale) and were never measured since."""
    optuna.storages.fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    settled = {config_key(t.params) for t in trials
               if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "error" in t.user_attrs)}
    waiting = {config_key(t.system_attrs.get("fixed_params", t.params)) for t in trials
               if t.state in (TrialState.WAITING, TrialState.RUNNING)}
    for t in trials:
        if t.state == TrialState.FAIL and "error" not in t.user_attrs and t.params:
            key = config_key(t.params)
            if key not in settled and key not in waiting:
                log.info("tune: re-queueing %s (trial %d was interrupted)", t.params, t.number)
                study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number})
                waiting.add(key)


def _open_study(name: str, storage, sampler, identity: dict) -> optuna.Study:
    """Load or create the study; a study measured under another identity (toolchain fingerprint,
    GPU, config space, input shape) is no evidence about this one and starts over."""
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    stored = study.user_attrs.get("kernelgen")
    if stored is not None and stored != identity:
        log.warning("tune: study %s was measured under %s; starting it over for %s", name, stored, identity)
        optuna.delete_study(study_name=name, storage=storage)
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize")
    if stored != identity:
        study.set_user_attr("kernelgen", identity)
    return study


class _TrialFailed(Exception):
    pass


def _resolve_device(device, arch: str | None) -> tuple[str, str, str]:
    """(device string for the worker, arch, gpu name); raises when tuning cannot happen here."""
    dev = torch.device(device if device is not None else "cuda")
    if dev.type == "cpu":
        if arch is not None and arch != "cpu":
            raise KernelgenValueError(f"arch={arch!r} does not match the device: device='cpu' runs the Triton "
                             "interpreter (arch 'cpu'); tune on a GPU of that arch instead")
        return "cpu", "cpu", "cpu"
    if dev.type != "cuda":
        raise KernelgenValueError(f"device={device!r}: expected a CUDA device (or 'cpu' for the interpreter, tests only)")
    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("tuning needs a CUDA GPU, and none is available here; plan(spec, role, seq=..., "
                           "arch=...) shows what a tune would do on any machine")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    present = device_arch(dev)
    if arch is not None and arch != present:
        raise KernelgenValueError(f"arch={arch!r} does not match the GPU present: {torch.cuda.get_device_name(dev)} "
                         f"is {present}; tune for {arch} on a GPU of that arch")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise KernelgenRuntimeError("TRITON_INTERPRET=1 is set: unset it to tune on the GPU")
    return str(dev), present, torch.cuda.get_device_name(dev)


def tune(
    spec: Spec,
    role: str = "attn",
    *,
    seq: int = 32768,
    arch: str | None = None,
    trials: int = 30,
    timeout: float | None = None,
    db: tuning_db.TuningDB | None = None,
    storage=None,
    seed: int = 0,
    progress: Callable[[int, int, float | None], None] | None = None,
    device: str | None = None,
    trial_timeout: float = TRIAL_TIMEOUT_S,
    fixed: dict | None = None,
    shape: dict | None = None,
) -> TuneResult:
    """Tune `role` (a tuned role: "attn", "select") of `spec` for sequences of `seq`'s bucket on this GPU.

    trials         configs to measure (failures included), counting those a resumed study holds.
    timeout        seconds for the whole study (Optuna's timeout); the default config's own timing,
                   when the study did not measure it, comes on top.
    db             where the winner goes (default: the user DB, `kernelgen.tuning.db.TuningDB()`).
    storage        Optuna storage: a URL, a path to an SQLite file, or a storage object
                   (default: `kernelgen.codegen.cache.cache_dir()/"optuna.db"`).
    progress       called as progress(i, trials, median_ms or None) after each measured config, i
                   counting measured configs from 0 (a resumed study starts past 0); None: failed.
    device         None or "cuda[:i]": the GPU; "cpu": the interpreter on tiny inputs (tests only).
    trial_timeout  seconds one measurement (compile, check, timing) may take before it counts as failed.
    fixed          {field: value}: search only the points of the space with those values.
    shape          {"batch", "heads_kv", "n_q", "n_k"}: time on this workload (n_k in seq's bucket)
                   instead of the bucket's default inputs (`tune_inputs_shape`).
    """
    backend, kernel_spec = tuned_backend(spec, role)
    check_budget(trials, timeout)
    worker_device, arch, gpu_name = _resolve_device(device, arch)
    cpu = worker_device == "cpu"
    unsupported = backend.unsupported(kernel_spec, torch.device(worker_device))
    if unsupported:  # every trial would fail
        raise KernelgenValueError(unsupported)
    the_plan = plan(spec, role, seq=seq, arch=arch, trials=trials, device="cpu" if cpu else None, fixed=fixed,
                    shape=shape)
    spec = kernel_spec
    space, choices = the_plan["space"], the_plan["params"]
    if not space:
        raise KernelgenValueError(f"no feasible {role} config in the search space of {spec} "
                                  "(Backend.config_space); nothing to tune")
    if db is not None:  # a read-only DB fails now, not after the trials
        db.check_writable()
    else:
        with tuning_db.TuningDB() as user_db:
            user_db.check_writable()
    name, bucket, dtype = the_plan["study_name"], the_plan["bucket"], the_plan["dtype"]
    feasible = {config_key(p) for p in space}
    default = the_plan["default"]
    fingerprint = tuning_db.current_fingerprint(backend, role)
    identity = {
        "fingerprint": fingerprint.as_columns(),
        "gpu_name": gpu_name,
        "dtype": dtype,
        "shape": the_plan["shape"],
        "space": hashlib.sha256(json.dumps(space, sort_keys=True).encode()).hexdigest()[:16],
    }
    base_job = {"backend": backend.name, "spec_json": spec.to_json(), "role": role, "seq": bucket, "device": worker_device,
                "shape": None if cpu else shape}
    note = ("CPU interpreter run: fp16, tiny inputs, time.perf_counter over 2 calls; the timings are "
            "meaningless (plumbing only)") if cpu else ""
    worker = Worker(worker_device)

    def measure(params: dict) -> tuple[dict | None, str | None]:
        status, payload = worker.run({**base_job, "params": params}, trial_timeout)
        return (payload, None) if status == "ok" else (None, f"{status}: {payload}")

    with _quiet_optuna():
        storage_obj = _storage(storage)
        if the_plan["sampler"] == "grid":
            sampler = optuna.samplers.GridSampler(choices, seed=seed)
        else:
            # Optuna's 10 random start-up trials would be most of a short tune: a third of the budget
            # explores, the rest follows the model (multivariate: block_m, warps and stages interact)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, trials // 3)),
                                                     multivariate=True)
        study = _open_study(name, storage_obj, sampler, identity)
        _requeue_interrupted(study)
        complete, failed = _measured(study)
        if the_plan["sampler"] == "tpe" and not study.get_trials(deepcopy=False):
            for seed_params in seeds(default, choices, feasible, limit=max(1, the_plan["trials"] // 2)):
                study.enqueue_trial(seed_params)
        done = len(complete) + len(failed)
        if backend.per_shape and not cpu and done < trials:
            seen = {config_key(t.params) for t in complete + failed}
            precompile_points(backend, spec, role, [p for p in space if config_key(p) not in seen], bucket, shape,
                              worker_device)
        log.info("tune %s: %d configs feasible, %s sampler, %d of %d trials already measured", name,
                 len(space), the_plan["sampler"], done, trials)
        unmeasured_in_a_row = [0]

        def objective(trial: optuna.Trial) -> float:
            params = {field: trial.suggest_categorical(field, values) for field, values in choices.items()}
            key = config_key(params)
            if key not in feasible:
                trial.set_user_attr("pruned", "infeasible")
                raise optuna.TrialPruned(f"{params} is outside the feasible space")
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
                if config_key(t.params) != key:
                    continue
                if t.state == TrialState.COMPLETE:
                    trial.set_user_attr("duplicate_of", t.number)
                    return t.value
                if "error" in t.user_attrs:
                    trial.set_user_attr("pruned", f"failed in trial {t.number}")
                    raise optuna.TrialPruned(f"{params} failed in trial {t.number}")
            result, error = measure(params)
            if error is not None:
                trial.set_user_attr("error", error)
                log.warning("tune %s: trial %d %s failed: %s", name, trial.number, params, error.splitlines()[0])
                raise _TrialFailed(error)
            trial.set_user_attr("flops", result["flops"])
            log.info("tune %s: trial %d %s: %.4f ms", name, trial.number, params, result["ms"])
            return result["ms"]

        def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            measured_now = ((trial.state == TrialState.COMPLETE and "duplicate_of" not in trial.user_attrs)
                            or (trial.state == TrialState.FAIL and "error" in trial.user_attrs))
            if not measured_now:
                unmeasured_in_a_row[0] += 1
                if unmeasured_in_a_row[0] >= MAX_UNMEASURED_IN_A_ROW:
                    log.info("tune %s: %d sampled points in a row were infeasible or already measured; "
                             "stopping", name, unmeasured_in_a_row[0])
                    study.stop()
                return
            unmeasured_in_a_row[0] = 0
            complete, failed = _measured(study)
            if progress is not None:
                progress(len(complete) + len(failed) - 1, trials, trial.value)
            seen = {config_key(t.params) for t in complete + failed}
            if len(complete) + len(failed) >= trials or feasible <= seen:
                study.stop()

        try:
            if done < trials and not feasible <= {config_key(t.params) for t in complete + failed}:
                study.optimize(objective, timeout=timeout, catch=(_TrialFailed,), callbacks=[after_trial],
                               gc_after_trial=False)
            complete, failed = _measured(study)
            default_ms, default_failed, default_flops = None, False, None
            for t in complete + failed:
                if t.params == default:
                    default_ms, default_failed = t.value, t.state == TrialState.FAIL
            # not measured by the study (and inside the searched space): time it now
            if default_ms is None and not default_failed and config_key(default) in feasible:
                result, error = measure(default)
                if error is None:
                    default_ms, default_flops = result["ms"], result["flops"]
                else:
                    log.warning("tune %s: the default config %s failed: %s", name, default, error.splitlines()[0])
        finally:
            worker.close()
            if storage_obj is not storage and hasattr(storage_obj, "engine"):
                storage_obj.engine.dispose()  # ours: release the SQLite file

    best = min(complete, key=lambda t: t.value) if complete else None
    best_config, best_ms = (dict(best.params), best.value) if best else (None, None)
    flops = best.user_attrs.get("flops") if best else None
    if default_ms is not None and (best_ms is None or default_ms < best_ms):
        best_config, best_ms, flops = dict(default), default_ms, default_flops or flops
    tflops = flops / best_ms / 1e9 if flops and best_ms else None  # roles whose workload counts FLOPs
    notes = [note] if note else []
    if best_config is None:
        notes.append("every measured config failed; nothing written to the tuning DB")
        log.warning("tune %s: every measured config failed (%d); nothing written", name, len(failed))
    else:
        target = db if db is not None else tuning_db.TuningDB()
        try:
            target.upsert(spec_key=spec.key(), role=role, backend=backend.name, arch=arch, gpu_name=gpu_name,
                          bucket=bucket, dtype=dtype, config=best_config, median_ms=best_ms, tflops=tflops,
                          n_trials=len(complete), fingerprint=fingerprint, spec_json=spec.to_json())
        finally:
            if db is None:
                target.close()
        log.info("tune %s: best %s %.4f ms (default %s), %d measured, %d failed", name, best_config, best_ms,
                 "failed" if default_ms is None else f"{default_ms:.4f} ms", len(complete), len(failed))
    return TuneResult(study_name=name, role=role, bucket=bucket, arch=arch, gpu_name=gpu_name, dtype=dtype,
                      best_config=best_config, best_ms=best_ms, default_ms=default_ms, tflops=tflops,
                      n_trials=len(complete), n_failed=len(failed), note="; ".join(notes))

"""Tuning studies: one Optuna study per (kernel spec, role, backend, arch, sequence bucket) -> the tuning DB.

    result = tune(spec, "attn", seq=32768, trials=30)              # on the GPU to be tuned
    result = tune(spec, "attn", seq=32768, trials=40, workers=2)   # on GPUs 0 and 1 at once
    plan(spec, "attn", seq=32768)                                  # what tune() would do; any machine

Each study lives in an Optuna storage (`kernelgen.tuning.storage`: by default the cache dir's SQLite file,
or its journal file when several workers share the study) under the name
`kg-{kernel spec key}-{role}-{backend}-{arch}-{bucket}-{identity}`, the identity a hash of the toolchain
fingerprint, the GPU's name, the dtype, the input shape and the config space. Every process that tunes the
same thing with the same toolchain on the same kind of GPU computes the same name: a tune that is
interrupted resumes where it stopped (trials already measured count toward `trials`), and tuners on other
GPUs or hosts that open the same storage join the study.

`workers=N` runs N worker processes, one per GPU, each the loop a single tune runs: ask the study for a
trial (Optuna's sampler sees the trials of every worker; TPE's constant liar steers it away from configs
being measured), claim its config, measure it in a crash-isolated measurement process
(`kernelgen.tuning.worker`) on its GPU, tell the study. The tuning process reports progress from the
storage, then writes the winner.

A sampled point outside the feasible space is pruned before any compile; a point already measured
returns its stored time (marked `duplicate_of`) so the sampler's model stays right without measuring it
again. A config that fails to compile, runs out of resources, crashes, hangs past `trial_timeout` or
computes a wrong result is a FAILED trial (user attr `error`), never a winner; the study goes on.

**Each config is measured once, whatever the number of workers.** A trial claims its config (user attr
`claimed`) only after every lower-numbered trial still running has claimed or given up its own, so claims
are decided in trial order, which the storage sets for every worker alike. A trial gives up (is pruned;
`pruned` says why) a config that another trial has measured, failed or is measuring, and gives up when
the measured and claimed configs already reach `trials`.

The fastest config is written to the tuning DB (`kernelgen.tuning.db.TuningDB`), keyed by the role's
kernel spec, role, backend, arch, GPU name, bucket and dtype, with the toolchain fingerprint (the role's
template hash included). The DB keeps the faster of two rows, so tunes that end together lose nothing.
A role the spec's backend lacks is tuned on the backend that runs it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import optuna
import torch
from optuna.trial import TrialState

from ..device import device_arch
from ..errors import KernelgenRuntimeError, KernelgenValueError
from ..spec import Spec
from . import db as tuning_db
from .plan import check_budget, check_workers, config_key, plan, seeds, tuned_backend
from .storage import StorageURL, default_storage, open_storage, parse_storage
from .worker import MAIN_GUARD, STARTUP_TIMEOUT_S, Worker, precompile_points

__all__ = ["TuneResult", "tune", "TRIAL_TIMEOUT_S"]

log = logging.getLogger("kernelgen")

TRIAL_TIMEOUT_S = 300.0  # per measurement: compile + check + timing
MAX_UNMEASURED_IN_A_ROW = 100  # pruned or duplicate points in a row: the sampler has nothing new
CLAIM_STALE_S = 60.0  # a trial still unclaimed this long after it started has lost its tuner
STALE_MARGIN_S = 120.0  # past a measurement's own limits (start-up, trial_timeout), a RUNNING trial is dead
CLAIM_POLL_S = 0.05  # waiting for lower-numbered trials to claim
PROGRESS_POLL_S = 0.5  # a tune of several workers reads the study's progress from the storage this often


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

def _age_s(trial: optuna.trial.FrozenTrial) -> float:
    return 0.0 if trial.datetime_start is None else (datetime.now() - trial.datetime_start).total_seconds()


def _claimer_gone(trial: optuna.trial.FrozenTrial) -> bool:
    """The trial was claimed on this host by a process that no longer exists (a killed tuner or worker): its
    measurement will never be told. Another host's claim is never judged here."""
    host, _, rest = trial.user_attrs.get("claimed", "").partition(" pid ")
    if host != socket.gethostname() or not rest.split(" ", 1)[0].isdigit():
        return False
    pid = int(rest.split(" ", 1)[0])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, as another user's
        return False
    return False


def _requeue_interrupted(study: optuna.Study, stale_s: float) -> None:
    """Queue again the configs of trials that failed without a verdict (Ctrl-C, a killed tuner whose
    heartbeat went stale or whose process on this host is gone or, in a storage without heartbeats, a trial
    still RUNNING `stale_s` after it started) and were never measured since."""
    optuna.storages.fail_stale_trials(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _age_s(t) > stale_s or _claimer_gone(t):
            log.info("tune: trial %d started %.0f s ago and is still running; its tuner is gone", t.number,
                     _age_s(t))
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
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


def _measuring(t: optuna.trial.FrozenTrial, stale_s: float) -> bool:
    """A trial whose config is being measured (by a live worker, here or elsewhere)."""
    return (t.state == TrialState.RUNNING and "claimed" in t.user_attrs and _age_s(t) <= stale_s
            and not _claimer_gone(t))


def _settled_trial(study: optuna.Study, params: dict, stale_s: float) -> optuna.trial.FrozenTrial | None:
    """The trial that measured `params` or failed them; None if none did. A config some worker is measuring
    now is waited for: it is never measured twice."""
    key = config_key(params)
    while True:
        complete, failed = _measured(study)
        for t in complete + failed:
            if config_key(t.params) == key:
                return t
        if not any(config_key(t.params) == key and _measuring(t, stale_s)
                   for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
            return None
        time.sleep(PROGRESS_POLL_S)


def _study_name(base: str, identity: dict) -> str:
    """The plan's name and a hash of what the timings depend on: the same in every process that tunes the
    same thing with the same toolchain on the same kind of GPU, another wherever a timing could differ."""
    return f"{base}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]}"


def _open_study(name: str, storage, sampler, identity: dict) -> optuna.Study:
    """Load or create the study (its name holds the identity's hash; the identity is kept to read)."""
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    if study.user_attrs.get("kernelgen") != identity:
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

def _worker_devices(device, worker_device: str, workers: int, arch: str, gpu_name: str) -> list[str]:
    """The device of each worker: GPUs 0 to workers-1 (as CUDA_VISIBLE_DEVICES numbers them), all of
    the tuned kind, or the interpreter."""
    if worker_device == "cpu" or workers == 1:
        return [worker_device] * workers
    if device is not None and torch.device(device).index is not None:
        raise KernelgenValueError(f"device={device!r} names one GPU, and workers={workers} run one per GPU, on "
                                  f"cuda:0 to cuda:{workers - 1}; pass device='cuda' (CUDA_VISIBLE_DEVICES chooses "
                                  "the GPUs)")
    count = torch.cuda.device_count()
    if workers > count:
        raise KernelgenValueError(f"workers={workers}, but {count} CUDA GPU{'s are' if count != 1 else ' is'} "
                                  "visible here: one worker runs per GPU")
    devices = [f"cuda:{i}" for i in range(workers)]
    for dev in devices:
        if (device_arch(dev), torch.cuda.get_device_name(dev)) != (arch, gpu_name):
            raise KernelgenValueError(f"{dev} is a {torch.cuda.get_device_name(dev)} ({device_arch(dev)}), not a "
                                      f"{gpu_name} ({arch}): the workers of one study need GPUs of one kind "
                                      "(CUDA_VISIBLE_DEVICES chooses which)")
    return devices


@dataclass(frozen=True)
class _SearchJob:
    """What a worker needs to search a study: plain data, sent to a spawned worker process."""

    name: str
    storage: StorageURL | None  # None: a storage object the caller passed, usable in this process only
    sampler: str  # "grid" or "tpe"
    choices: dict
    feasible: frozenset
    trials: int
    seed: int
    timeout: float | None
    trial_timeout: float
    job: dict  # what the measurement process is sent, less the config
    device: str

    @property
    def stale_s(self) -> float:
        """How long a live worker's trial may run: the measurement process's start-up and time limit."""
        return STARTUP_TIMEOUT_S + self.trial_timeout + STALE_MARGIN_S

    def new_sampler(self) -> optuna.samplers.BaseSampler:
        if self.sampler == "grid":
            return optuna.samplers.GridSampler(self.choices, seed=self.seed)
        # Optuna's 10 random start-up trials would be most of a short tune: a third of the budget explores,
        # the rest follows the model (multivariate: block_m, warps and stages interact); the constant liar
        # counts the configs other workers are measuring as bad, so that they are not proposed again
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=max(2, min(10, self.trials // 3)),
                                              multivariate=True, constant_liar=True)

    def measure(self, worker: Worker, params: dict) -> tuple[dict | None, str | None]:
        status, payload = worker.run({**self.job, "device": self.device, "params": params}, self.trial_timeout)
        return (payload, None) if status == "ok" else (None, f"{status}: {payload}")


class _Search:
    """One worker's loop over a study: a trial, its config claimed, measured on the worker's device."""

    def __init__(self, job: _SearchJob, study: optuna.Study, worker: Worker, progress=None):
        self.job, self.study, self.worker, self.progress = job, study, worker, progress
        self.unmeasured_in_a_row = 0

    def run(self) -> None:
        self.study.optimize(self.objective, timeout=self.job.timeout, catch=(_TrialFailed,),
                            callbacks=[self.after_trial], gc_after_trial=False)

    def objective(self, trial: optuna.Trial) -> float:
        job = self.job
        params = {field: trial.suggest_categorical(field, values) for field, values in job.choices.items()}
        key = config_key(params)
        if key not in job.feasible:
            trial.set_user_attr("pruned", "infeasible")
            raise optuna.TrialPruned(f"{params} is outside the feasible space")
        stored = self._claim(trial, key)
        if stored is not None:
            return stored
        result, error = job.measure(self.worker, params)
        if error is not None:
            trial.set_user_attr("error", error)
            log.warning("tune %s: trial %d %s failed: %s", job.name, trial.number, params, error.splitlines()[0])
            raise _TrialFailed(error)
        trial.set_user_attr("flops", result["flops"])
        log.info("tune %s: trial %d %s on %s: %.4f ms", job.name, trial.number, params, job.device, result["ms"])
        return result["ms"]

    def _claim(self, trial: optuna.Trial, key: str) -> float | None:
        """Claim `key` for this trial (None: measure it), or settle the trial without measuring: the stored
        time of a config measured already, or pruned (a config failed or being measured, or no budget left)."""
        counted = 0  # configs measured, failed or claimed: what `trials` counts
        for t in self._after_lower_claims(trial.number):
            if t.number == trial.number:
                continue
            same = bool(t.params) and config_key(t.params) == key
            if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs:
                if same:
                    trial.set_user_attr("duplicate_of", t.number)
                    return t.value
            elif t.state == TrialState.FAIL and "error" in t.user_attrs:
                if same:
                    trial.set_user_attr("pruned", f"failed in trial {t.number}")
                    raise optuna.TrialPruned(f"{key} failed in trial {t.number}")
            elif _measuring(t, self.job.stale_s):
                if same:
                    trial.set_user_attr("pruned", f"measured by trial {t.number}")
                    raise optuna.TrialPruned(f"{key} is being measured by trial {t.number}")
            else:
                continue
            counted += 1
        if counted >= self.job.trials:
            trial.set_user_attr("pruned", "budget")  # after_trial stops the search
            raise optuna.TrialPruned(f"{self.job.trials} configs are measured or being measured")
        trial.set_user_attr("claimed", f"{socket.gethostname()} pid {os.getpid()} {self.job.device}")
        return None

    def _after_lower_claims(self, number: int) -> list[optuna.trial.FrozenTrial]:
        """The study's trials once no lower-numbered trial is still running without a claim: each trial
        decides after every earlier one has."""
        while True:
            trials = self.study.get_trials(deepcopy=False)
            if not any(t.number < number and t.state == TrialState.RUNNING and "claimed" not in t.user_attrs
                       and _age_s(t) < CLAIM_STALE_S for t in trials):
                return trials
            time.sleep(CLAIM_POLL_S)

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        measured_now = ((trial.state == TrialState.COMPLETE and "duplicate_of" not in trial.user_attrs)
                        or (trial.state == TrialState.FAIL and "error" in trial.user_attrs))
        self.unmeasured_in_a_row = 0 if measured_now else self.unmeasured_in_a_row + 1
        if self.unmeasured_in_a_row >= MAX_UNMEASURED_IN_A_ROW:
            log.info("tune %s: %d sampled points in a row were infeasible or already measured; stopping",
                     self.job.name, self.unmeasured_in_a_row)
            study.stop()
            return
        complete, failed = _measured(study)
        busy = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if _measuring(t, self.job.stale_s)]
        if measured_now and self.progress is not None:
            self.progress(len(complete) + len(failed) - 1, self.job.trials, trial.value)
        seen = {config_key(t.params) for t in complete + failed + busy}
        if len(complete) + len(failed) + len(busy) >= self.job.trials or self.job.feasible <= seen:
            study.stop()


def _search_main(job: _SearchJob, conn) -> None:
    """A spawned worker process: search the study on job.device until it is done. Replies ("done", None)
    or ("error", why)."""
    worker = Worker(job.device)
    try:
        with _quiet_optuna():
            study = optuna.load_study(study_name=job.name, storage=open_storage(job.storage),
                                      sampler=job.new_sampler())
            _Search(job, study, worker).run()
        conn.send(("done", None))
    except KeyboardInterrupt:
        conn.send(("error", "interrupted"))
    except BaseException as error:  # noqa: BLE001 - reported to the tuning process
        conn.send(("error", f"{type(error).__name__}: {' '.join(str(error).split())}"))
    finally:
        worker.close()


def _search_in_processes(job: _SearchJob, devices: list[str], study: optuna.Study, progress) -> list[str]:
    """Search the study with a spawned worker process per device (the sampler seeded apart in each),
    reporting progress as the storage shows it. Returns the errors that stopped workers."""
    ctx = multiprocessing.get_context("spawn")
    children = []
    try:
        for i, device in enumerate(devices):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_search_main, args=(dataclasses.replace(job, device=device, seed=job.seed + i),
                                                          send), name=f"kernelgen-tune-{i}")
            proc.start()
            send.close()
            children.append((proc, receive))
        reported: set[int] = set()
        while True:
            running = any(proc.is_alive() for proc, _ in children)
            if progress is not None:
                complete, failed = _measured(study)
                for t in sorted(complete + failed, key=lambda t: t.number):
                    if t.number not in reported:
                        progress(len(reported), job.trials, t.value)
                        reported.add(t.number)
            if not running:
                break
            time.sleep(PROGRESS_POLL_S)
        errors = []
        for (proc, receive), device in zip(children, devices):
            proc.join()
            try:
                status, why = receive.recv()
            except EOFError:  # it died without a word: often a script that spawn re-ran without its main guard
                status, why = "error", f"exit code {proc.exitcode}, without a reply (its stderr says why; {MAIN_GUARD})"
            if status != "done":
                errors.append(f"{proc.name} on {device}: {why}")
        return errors
    finally:
        for proc, receive in children:
            if proc.is_alive():  # interrupted: let it fail its trial (requeued on resume) and stop its worker
                os.kill(proc.pid, signal.SIGINT)
                proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            receive.close()


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
    workers: int = 1,
) -> TuneResult:
    """Tune `role` (a tuned role: "attn", "select") of `spec` for sequences of `seq`'s bucket on this GPU.

    trials         configs to measure (failures included), counting those a resumed study holds, and
                   those that other processes sharing the study measure.
    timeout        seconds for the whole study (Optuna's timeout, per worker); the default config's own
                   timing, when the study did not measure it, comes on top.
    db             where the winner goes (default: the user DB, `kernelgen.tuning.db.TuningDB()`).
    storage        Optuna storage: a URL (sqlite:///PATH, postgresql://..., journal:///PATH; see
                   `kernelgen.tuning.storage`), a path to an SQLite file, or a storage object (one worker
                   only). Default: `cache_dir()/"optuna.db"`, or with several workers the journal file
                   `cache_dir()/"optuna-journal.log"`.
    progress       called as progress(i, trials, median_ms or None) after each measured config, i
                   counting measured configs from 0 (a resumed study starts past 0); None: failed.
    device         None or "cuda[:i]": the GPU; "cpu": the interpreter on tiny inputs (tests only).
    trial_timeout  seconds one measurement (compile, check, timing) may take before it counts as failed.
    fixed          {field: value}: search only the points of the space with those values.
    shape          {"batch", "heads_kv", "n_q", "n_k"}: time on this workload (n_k in seq's bucket)
                   instead of the bucket's default inputs (`tune_inputs_shape`).
    workers        worker processes measuring at once, one per GPU: cuda:0 to cuda:workers-1, which must
                   be GPUs of one kind (with device="cpu": interpreter processes, tests only).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # a spawned process importing the caller's script (each tune process does, as multiprocessing's own
        # bootstrapping check knows): a script that tunes at its top level would tune again there, and its parent
        # wait out the start-up timeout for a worker that never gets ready
        raise KernelgenRuntimeError(MAIN_GUARD)
    backend, kernel_spec = tuned_backend(spec, role)
    check_budget(trials, timeout)
    check_workers(workers)
    worker_device, arch, gpu_name = _resolve_device(device, arch)
    cpu = worker_device == "cpu"
    devices = _worker_devices(device, worker_device, workers, arch, gpu_name)
    own_storage = not isinstance(storage, optuna.storages.BaseStorage)
    if not own_storage and workers > 1:
        raise KernelgenValueError(f"workers={workers} share the study from other processes: pass storage as a URL or "
                                  "path, not a storage object")
    url = parse_storage(storage) if own_storage and storage is not None else None
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
    if own_storage and url is None:
        url = default_storage(workers)
    bucket, dtype = the_plan["bucket"], the_plan["dtype"]
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
    name = _study_name(the_plan["study_name"], identity)
    job = _SearchJob(name=name, storage=url, sampler=the_plan["sampler"], choices=choices,
                     feasible=frozenset(feasible), trials=trials, seed=seed, timeout=timeout, trial_timeout=trial_timeout,
                     job={"backend": backend.name, "spec_json": spec.to_json(), "role": role, "seq": bucket,
                          "device": worker_device, "shape": None if cpu else shape},
                     device=devices[0])
    note = ("CPU interpreter run: fp16, tiny inputs, time.perf_counter over 2 calls; the timings are "
            "meaningless (plumbing only)") if cpu else ""
    worker = Worker(devices[0])

    with _quiet_optuna():
        storage_obj = open_storage(url) if own_storage else storage
        try:
            study = _open_study(name, storage_obj, job.new_sampler(), identity)
            _requeue_interrupted(study, job.stale_s)
            complete, failed = _measured(study)
            if the_plan["sampler"] == "tpe" and not study.get_trials(deepcopy=False):
                for seed_params in seeds(default, choices, feasible, limit=max(1, the_plan["trials"] // 2)):
                    study.enqueue_trial(seed_params)
            done = len(complete) + len(failed)
            if backend.per_shape and not cpu and done < trials:
                seen = {config_key(t.params) for t in complete + failed}
                precompile_points(backend, spec, role, [p for p in space if config_key(p) not in seen], bucket,
                                  shape, worker_device)
            log.info("tune %s: %d configs feasible, %s sampler, %d of %d trials already measured, %d worker%s",
                     name, len(space), the_plan["sampler"], done, trials, workers, "s" if workers > 1 else "")
            if done < trials and not feasible <= {config_key(t.params) for t in complete + failed}:
                if workers == 1:
                    _Search(job, study, worker, progress).run()
                else:
                    errors = _search_in_processes(job, devices, study, progress)
                    for error in errors:
                        log.warning("tune %s: worker %s", name, error)
                    if len(errors) == workers:
                        raise KernelgenRuntimeError(f"tune {name}: every worker stopped on an error; the first: "
                                                    f"{errors[0]}")
            default_trial = _settled_trial(study, default, job.stale_s)
            complete, failed = _measured(study)
            default_ms, default_failed, default_flops = None, False, None
            if default_trial is not None:
                default_ms, default_failed = default_trial.value, default_trial.state == TrialState.FAIL
            # not measured by the study (and inside the searched space): time it now
            if default_ms is None and not default_failed and config_key(default) in feasible:
                result, error = job.measure(worker, default)
                if error is None:
                    default_ms, default_flops = result["ms"], result["flops"]
                else:
                    log.warning("tune %s: the default config %s failed: %s", name, default, error.splitlines()[0])
        finally:
            worker.close()
            if own_storage and hasattr(storage_obj, "engine"):
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

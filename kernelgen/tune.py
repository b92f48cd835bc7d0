"""Autotuning: one Optuna study per (spec, role, backend, arch, sequence bucket) -> the tuning DB.

    result = tune(spec, "attn", seq=32768, trials=30)      # on the GPU to be tuned
    plan(spec, "attn", seq=32768)                          # what tune() would do; any machine

Each study lives in an Optuna RDB SQLite file (`cache_dir()/optuna.db` unless `storage` says
otherwise) under the name `kg-{spec.role_key(role)}-{role}-{backend}-{arch}-{bucket}`, so a tune that is
interrupted resumes where it stopped: trials already measured count toward `trials`.

A trial is one config: one categorical parameter per config field, over the values present in the
feasible space (`config.config_space`). A sampled point outside that space is pruned before any
compile; a point already measured returns its stored time (marked `duplicate_of`) so the sampler's
model stays right without measuring it again. Small spaces (at most `trials` points) are searched
exhaustively with GridSampler, larger ones with TPE, seeded with the default config and its
neighbours along each field of at most three values (`_seeds`).

Every measurement runs in a worker process ("spawn"): an illegal memory access poisons the CUDA
context of the process that made it, so the worker is replaced after any crash, timeout or run-time
error (a config the compiler refuses, or one with a wrong result, leaves it in service). It checks
the config against `kernelgen.reference` on small inputs first (attention: rel. L2 error of o
< 1e-2; selection: the default config's lists, or a valid top-k), then times it on inputs of the
bucket's size (`tune_inputs_shape(spec, bucket)`: all seqs of a bucket share one study) with
`triton.testing.do_bench` (median ms, the objective).
A config that fails to compile, runs out of resources, crashes, hangs past `trial_timeout` or
computes a wrong result is a FAILED trial (user attr `error`), never a winner; the study goes on.

The fastest config is written to the tuning DB (`kernelgen.db.TuningDB`), keyed by spec, role,
backend, arch, GPU name, bucket and dtype, with the toolchain fingerprint (the role's template hash
included). Selection is tuned as the spec's Triton twin (`Spec.for_role`) for every backend.

`device="cpu"` (tests only) runs the Triton interpreter on tiny fp16 inputs and times two calls with
`time.perf_counter`: it exercises the plumbing; its timings mean nothing.

Test hook: the worker sabotages every config whose fields include all items of the JSON object in
`$KERNELGEN_TUNE_SABOTAGE` (e.g. '{"block_m": 64}'), as `$KERNELGEN_TUNE_SABOTAGE_MODE` says:
"raise" (default: an exception), "exit" (the process dies) or "hang" (sleeps past any timeout).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from . import db as tuning_db
from .config import config_space, default_config
from .spec import Spec

__all__ = ["TuneResult", "tune", "plan", "tune_inputs_shape", "study_name", "precompile_tilelang"]

log = logging.getLogger("kernelgen")

CPU_MAX_SEQ = 256  # interpreter inputs: seq capped here, one KV head
CHECK_MAX_SEQ_GPU = 1000  # correctness inputs on the GPU: small, and not a multiple of any tile
CHECK_HEADS_KV_GPU = 2
REL_L2_TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}
SELECT_SCORE_TOL = 1e-3  # relative slack at near-ties when lists differ from the default's
TRIAL_TIMEOUT_S = 300.0  # per measurement: compile + check + timing
STARTUP_TIMEOUT_S = 300.0  # a fresh worker importing torch, triton and kernelgen
MAX_UNMEASURED_IN_A_ROW = 100  # pruned or duplicate points in a row: the sampler has nothing new
HEARTBEAT_S, GRACE_S = 30, 120  # a RUNNING trial whose tuner stopped beating for GRACE_S is stale
SABOTAGE_ENV, SABOTAGE_MODE_ENV = "KERNELGEN_TUNE_SABOTAGE", "KERNELGEN_TUNE_SABOTAGE_MODE"
INPUT_SEED = 0  # the same inputs for every trial of every session


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


# ---------------------------------------------------------------------------------------------------
# Planning (pure)


def tune_inputs_shape(spec: Spec, seq: int, *, cpu: bool = False,
                      shape: dict | None = None) -> tuple[int, int, int, int, int]:
    """(B, Hq, Hkv, Nq, Nk) of the inputs a tune times on.

    GPU: B=1, Hq = max(G, 32 rounded up to a multiple of G), Hkv = Hq // G, Nq = Nk = seq; or
    `shape` ({"batch", "heads_kv", "n_q", "n_k"}: the workload to tune for), whose n_k must lie
    in seq's bucket.
    CPU (interpreter): B=1, Hq = G, Hkv = 1, Nq = Nk = min(seq, 256).
    """
    seq = int(seq)
    if seq < 1:
        raise ValueError(f"seq must be >= 1, got {seq}")
    g = spec.gqa_group
    if shape is not None and not cpu:
        if set(shape) != {"batch", "heads_kv", "n_q", "n_k"} or not all(
                isinstance(x, int) and x >= 1 for x in shape.values()):
            raise ValueError(f"shape must map batch, heads_kv, n_q, n_k to ints >= 1, got {shape!r}")
        if tuning_db.seq_bucket(shape["n_k"]) != tuning_db.seq_bucket(seq):
            raise ValueError(f"shape n_k={shape['n_k']} is outside the bucket of seq={seq}")
        return shape["batch"], shape["heads_kv"] * g, shape["heads_kv"], shape["n_q"], shape["n_k"]
    if cpu:
        n = min(seq, CPU_MAX_SEQ)
        return 1, g, 1, n, n
    heads_q = max(g, -(-32 // g) * g)
    return 1, heads_q, heads_q // g, seq, seq


def study_name(spec: Spec, role: str, arch: str, bucket: int) -> str:
    return f"kg-{spec.role_key(role)}-{role}-{spec.backend}-{arch}-{bucket}"


def _check_role(spec: Spec, role: str) -> None:
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if role not in ("attn", "select"):
        raise ValueError(f"role={role!r} is unknown; expected 'attn' or 'select'")
    if role == "select" and not spec.selects:
        raise ValueError("role='select' needs a spec with a selector; spec.selector='given' has none to tune")
    if spec.backend == "auto" and role == "attn":
        raise ValueError("spec.backend='auto' is served, not tuned: tune backend='triton', 'tilelang' and 'gluon'; "
                         "get_kernel then serves the fastest")


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _current_arch() -> str | None:
    return _arch_of(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None


def _params(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _config_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def _choices(space: list[dict]) -> dict[str, list]:
    """One categorical parameter per config field: the values that occur in the feasible space."""
    return {name: sorted({p[name] for p in space}) for name in space[0]} if space else {}


def _seeds(default: dict, choices: dict[str, list], feasible: set[str], limit: int = 8) -> list[dict]:
    """The first TPE trials (at most `limit`): the default config, then its feasible neighbours along
    every field of at most three values, two-valued fields (switches such as use_tma or kv_per_iter)
    first, then three-valued ones (the selector's splits), which a short random start-up could miss."""
    seeds = [default] if _config_key(default) in feasible else []
    for field, values in sorted(choices.items(), key=lambda item: len(item[1])):
        if len(values) <= 3:
            for value in values:
                other = {**default, field: value}
                if value != default[field] and _config_key(other) in feasible:
                    seeds.append(other)
    return seeds[:limit]


def plan(spec: Spec, role: str, *, seq: int, arch: str | None = None, trials: int = 30,
         device: str | None = None, fixed: dict | None = None, shape: dict | None = None) -> dict:
    """What `tune(spec, role, seq=seq, arch=arch, trials=trials, device=device, fixed=fixed)` would do.
    Pure; works on any machine (arch is None, and so is the study name, where no GPU says what it is).
    `fixed` ({field: value}) restricts the space to the points with those values; `shape` sets the
    inputs timed (`tune_inputs_shape`)."""
    _check_role(spec, role)
    spec = spec.for_role(role)
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    cpu = _is_cpu(device)
    if arch is None:
        arch = "cpu" if cpu else _current_arch()
    bucket = tuning_db.seq_bucket(seq)
    space = [_params(c) for c in config_space(spec, role)]
    if fixed:
        unknown = set(fixed) - set(space[0] if space else fixed)
        if unknown:
            raise ValueError(f"fixed names {sorted(unknown)}, which are not {role} config fields")
        space = [p for p in space if all(p[k] == v for k, v in fixed.items())]
    # one study, one shape: the bucket's default inputs, or the workload given
    b, hq, hkv, nq, nk = tune_inputs_shape(spec, bucket if shape is None else seq, cpu=cpu, shape=shape)
    return {
        "study_name": study_name(spec, role, arch, bucket) if arch is not None else None,
        "spec_key": spec.role_key(role),
        "role": role,
        "backend": spec.backend,
        "arch": arch,
        "bucket": bucket,
        "seq": int(seq),
        "space": space,
        "space_size": len(space),
        "params": _choices(space),
        "default": _params(default_config(spec, role)),
        "sampler": "grid" if len(space) <= trials else "tpe",
        "trials": min(trials, len(space)),
        "shape": {"batch": b, "heads_q": hq, "heads_kv": hkv, "n_q": nq, "n_k": nk, "head_dim": spec.head_dim},
        "dtype": "float16" if cpu else "bfloat16",
        "device": "cpu" if cpu else "cuda",
    }


# ---------------------------------------------------------------------------------------------------
# The worker process


class _Rejected(Exception):
    """The config runs but computes something else than the reference."""


def _sabotage(params: dict) -> None:
    """The test hook (see the module docstring)."""
    target = os.environ.get(SABOTAGE_ENV)
    if not target or not all(params.get(k) == v for k, v in json.loads(target).items()):
        return
    mode = os.environ.get(SABOTAGE_MODE_ENV, "raise")
    log.warning("tune worker: sabotaging %s (%s=%s, test hook)", params, SABOTAGE_ENV, target)
    if mode == "exit":
        os._exit(3)
    if mode == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"sabotaged by {SABOTAGE_ENV} (test hook)")


def _make_inputs(spec: Spec, heads_kv: int, n: int, device: str, dtype: torch.dtype, batch: int = 1,
                 n_k: int | None = None):
    gen = torch.Generator(device="cpu").manual_seed(INPUT_SEED)
    shape_q = (batch, heads_kv * spec.gqa_group, n, spec.head_dim)
    shape_kv = (batch, heads_kv, n if n_k is None else n_k, spec.head_dim)
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))


def _trial_shapes(spec: Spec, seq: int, cpu: bool, shape: dict | None) -> tuple[tuple, tuple]:
    """(batch, heads_kv, n_q, n_k) of a trial's two inputs: the small ones checked against the
    reference, and the ones timed (the same on the CPU)."""
    batch, _, hkv, n, n_k = tune_inputs_shape(spec, seq, cpu=cpu, shape=shape)
    bench = (batch, hkv, n, n_k)
    if cpu:
        return (1, hkv, n, n), bench
    n_check = min(seq, CHECK_MAX_SEQ_GPU)
    return (1, CHECK_HEADS_KV_GPU, n_check, n_check), bench


class _Inputs:
    """Inputs of one (spec, seq, device), made once per worker: small ones to check against the
    reference, bucket-sized ones to time on (the same tensors on the CPU)."""

    def __init__(self, spec: Spec, seq: int, device: str, shape: dict | None = None):
        import kernelgen
        from . import reference
        from .bench import useful_flops

        cpu = device == "cpu"
        self.dtype = torch.float16 if cpu else torch.bfloat16
        self.sel_spec = spec if spec.selects else spec.replace(selector="mean")
        self.given_spec = spec.replace(selector="given")
        (_, check_hkv, n_check, _), (batch, hkv, n, n_k) = _trial_shapes(spec, seq, cpu, shape)
        self.check = _make_inputs(spec, check_hkv, n_check, device, self.dtype)
        self.bench = self.check if cpu else _make_inputs(spec, hkv, n, device, self.dtype, batch, n_k)
        q, k, v = self.check
        self.check_idx = reference.select_blocks(q, k, self.sel_spec)
        self.ref_o = reference.sparse_attention(q, k, v, self.given_spec, block_idx=self.check_idx)[0]
        default_sel = {"select": default_config(self.sel_spec, "select")}
        selector = kernelgen.get_kernel(self.sel_spec, configs=default_sel)
        self.default_lists = selector.select(q, k) if spec.selects else None
        qb, kb, _ = self.bench
        self.bench_idx = self.check_idx if cpu else selector.select(qb, kb)
        self.flops = useful_flops(self.bench_idx, self.given_spec, n, n_k)


def _valid_top_k(lists: torch.Tensor, q, k, spec: Spec) -> bool:
    """Forced blocks present, eligible blocks only, as many as the budget allows, and no unchosen
    block scoring clearly higher than a chosen one (float64 reference scores)."""
    from . import reference

    nq, nk = q.shape[2], k.shape[2]
    n_blocks = spec.n_kv_blocks(nk)
    if lists.dtype != torch.int32 or not torch.equal(lists, reference.normalize_block_idx(lists, n_blocks)):
        return False
    scores = reference.block_scores(q, k, spec)
    eligible, forced = reference.tile_eligibility(spec, nq, nk, device=q.device)
    idx = lists.long()
    chosen = torch.zeros(*scores.shape[:-1], n_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(idx >= 0, idx, n_blocks), True)
    chosen = chosen[..., :n_blocks]
    count_ok = torch.equal(chosen.sum(-1), torch.clamp(eligible.sum(-1), max=spec.top_k).expand_as(chosen.sum(-1)))
    free = eligible & ~forced
    worst_chosen = torch.where(chosen & free, scores, torch.inf).amin(-1)
    best_unchosen = torch.where(~chosen & free, scores, -torch.inf).amax(-1)
    scale = scores[torch.isfinite(scores)].abs().max().clamp(min=1.0)
    return bool(count_ok and not (chosen & ~eligible).any() and not (forced & ~chosen).any()
                and (best_unchosen <= worst_chosen + SELECT_SCORE_TOL * scale).all())


def _measure(job: dict, cache: dict) -> dict:
    """Check one config against the reference, then time it. Runs in the worker."""
    import kernelgen

    spec, role, params, seq, device = (Spec.from_json(job["spec_json"]), job["role"], job["params"],
                                       job["seq"], job["device"])
    _sabotage(params)
    shape = job.get("shape")
    key = (job["spec_json"], seq, device, json.dumps(shape, sort_keys=True))
    if key not in cache:
        cache.clear()  # one tune at a time: drop the previous spec's (possibly large) inputs
        cache[key] = _Inputs(spec, seq, device, shape)
    inputs: _Inputs = cache[key]
    cfg = default_config(spec, role).__class__(**params)
    q, k, v = inputs.check
    qb, kb, vb = inputs.bench
    if role == "attn":
        pinned = {"attn": cfg, "select": default_config(inputs.given_spec, "select")}
        attn = kernelgen.get_kernel(inputs.given_spec, configs=pinned)
        o = attn(q, k, v, block_idx=inputs.check_idx)
        err = ((o.double() - inputs.ref_o).norm() / inputs.ref_o.norm().clamp(min=1e-30)).item()
        tol = REL_L2_TOL[o.dtype]
        if not err < tol:  # NaN (an unwritten, poisoned element) fails too
            raise _Rejected(f"o differs from the reference: rel. L2 error {err:.3e} >= {tol}")
        fn = lambda: attn(qb, kb, vb, block_idx=inputs.bench_idx)  # noqa: E731
    else:
        sel = kernelgen.get_kernel(spec, configs={"select": cfg})
        lists = sel.select(q, k)
        if not (torch.equal(lists, inputs.default_lists) or _valid_top_k(lists, q, k, spec)):
            raise _Rejected("the block lists are not a valid top-k (and differ from the default config's)")
        fn = lambda: sel.select(qb, kb)  # noqa: E731
    if device == "cpu":
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
    else:
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return {"ms": float(ms), "flops": inputs.flops if role == "attn" else None}


def _worker_main(conn, device: str) -> None:
    """Serve measurement jobs from `conn` until None or EOF. Replies ("ok", {"ms", "flops"}),
    ("rejected", why): a wrong result, ("failed", why): the compiler refused the config (its
    resources, say), which leaves the process sound, or ("error", why): anything else, after which
    the parent replaces the worker (a CUDA error poisons the context for good)."""
    try:
        import kernelgen  # noqa: F401  (the slow imports, before saying ready)
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
            torch.cuda.init()
        conn.send(("ready", os.getpid()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("error", _describe(error)))
        return
    cache: dict = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            reply = ("ok", _measure(job, cache))
        except _Rejected as error:
            reply = ("rejected", str(error))
        except (CompilationError, OutOfResources) as error:
            reply = ("failed", _describe(error))
        except BaseException as error:  # noqa: BLE001
            reply = ("error", _describe(error))
        conn.send(reply)


def _compile_tilelang_point(job: tuple) -> str | None:
    """Build and compile one TileLang attention config for one problem shape (a precompile process).
    Returns the error, if any: the trial meets it again and records it."""
    spec_json, params, shapes, arch = job
    from . import tilelang_backend
    from .config import TileLangAttnConfig

    spec = Spec.from_json(spec_json)
    try:
        config = TileLangAttnConfig(**params)
        for batch, heads_kv, n_q, n_k in shapes:
            func = tilelang_backend.build_attn(spec, "bfloat16", batch=batch, heads_kv=heads_kv, seq_q=n_q, seq_k=n_k,
                                               config=config)
            tilelang_backend.compile_attn(func, config, arch=arch)
    except Exception as error:  # noqa: BLE001
        return _describe(error, 300)
    return None


def _precompile_tilelang(spec: Spec, space: list[dict], bucket: int, shape: dict | None, device: str) -> float:
    """TileLang compiles one kernel per problem shape, and nvcc takes seconds for each: compile the
    points of `space`, for both inputs of a trial (`_trial_shapes`), in parallel processes first. They
    fill TileLang's disk cache, so each trial then only checks and times (H200 host, 16 cores: a
    12-point grid tuned in 55-80 s per shape, where 6 serial trials had taken 87-144 s). Returns the
    seconds it took."""
    from . import tilelang_backend

    shapes = _trial_shapes(spec, bucket, False, shape)
    arch = tilelang_backend.target_arch(torch.device(device))
    seconds, errors = precompile_tilelang([(spec.to_json(), params, shapes, arch) for params in space])
    log.info("tune: precompiled %d TileLang configs x %d shapes in %.0f s (%d failed)", len(space), len(shapes),
             seconds, len(errors))
    return seconds


def precompile_tilelang(jobs: list[tuple]) -> tuple[float, list[str]]:
    """Compile TileLang attention kernels in parallel spawned processes, filling TileLang's disk cache so
    that the same compile in this process is then instant. A job: (spec JSON, TileLangAttnConfig fields,
    [(batch, heads_kv, n_q, n_k), ...], arch). Returns (seconds, errors)."""
    import concurrent.futures as cf

    if not jobs:
        return 0.0, []
    t0 = time.perf_counter()
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 16))
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_compile_tilelang_point, jobs) if e]
    return time.perf_counter() - t0, errors


def _describe(error: BaseException, limit: int = 4000) -> str:
    text = "".join(traceback.format_exception(error))
    head = f"{type(error).__name__}: {error}"
    return (head + "\n" + text[-(limit - len(head)):])[:limit]


@contextlib.contextmanager
def _interpreter_env(enabled: bool):
    """TRITON_INTERPRET=1 in the environment a spawned CPU worker inherits (it must be set before
    the worker first imports triton)."""
    old = os.environ.get("TRITON_INTERPRET")
    if enabled:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if enabled:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


class _Worker:
    """One spawned measurement process, started on first use and after any failure."""

    def __init__(self, device: str, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.device = device
        self.startup_timeout = startup_timeout
        self._proc = None
        self._conn = None
        self.starts = 0

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.device), daemon=True, name="kernelgen-tune")
        with _interpreter_env(self.device == "cpu"):
            proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.starts += 1
        status, payload = self._receive(self.startup_timeout, "starting")
        if status != "ready":
            self.close(graceful=False)
            raise RuntimeError(f"tune worker failed to start: {payload}")
        log.debug("tune worker %s ready on %s", payload, self.device)

    def _receive(self, timeout: float, doing: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "error", f"timed out after {timeout:.0f} s {doing}"
            try:
                if self._conn.poll(min(left, 1.0)):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if self._proc.is_alive():
                    continue
            self._proc.join(1.0)
            return "error", f"worker process died {doing} (exit code {self._proc.exitcode})"

    def run(self, job: dict, timeout: float) -> tuple[str, Any]:
        """("ok", {"ms", "flops"}), or ("rejected" | "failed" | "error", why); never raises for the
        config's sake. After an "error" (crash, timeout, CUDA error) the worker is replaced."""
        try:
            if self._proc is None:
                self._start()
        except RuntimeError as error:
            return "error", str(error)
        try:
            self._conn.send(job)
        except (BrokenPipeError, OSError) as error:
            self.close()
            return "error", f"worker process unreachable: {error}"
        status, payload = self._receive(timeout, "measuring")
        if status == "error":
            self.close(graceful=False)  # its CUDA context may be poisoned, or it is dead or stuck
        return status, payload

    def close(self, graceful: bool = True) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        try:
            if graceful and proc.is_alive():
                conn.send(None)
                proc.join(5.0)
        except (BrokenPipeError, OSError):
            pass
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        conn.close()


# ---------------------------------------------------------------------------------------------------
# The study


def _storage(storage) -> optuna.storages.BaseStorage:
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if storage is None:
        from .compile import cache_dir

        storage = cache_dir() / "optuna.db"
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
    settled = {_config_key(t.params) for t in trials
               if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "error" in t.user_attrs)}
    waiting = {_config_key(t.system_attrs.get("fixed_params", t.params)) for t in trials
               if t.state in (TrialState.WAITING, TrialState.RUNNING)}
    for t in trials:
        if t.state == TrialState.FAIL and "error" not in t.user_attrs and t.params:
            key = _config_key(t.params)
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
            raise ValueError(f"arch={arch!r} does not match the device: device='cpu' runs the Triton "
                             "interpreter (arch 'cpu'); tune on a GPU of that arch instead")
        return "cpu", "cpu", "cpu"
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: expected a CUDA device (or 'cpu' for the interpreter, tests only)")
    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU, and none is available here; plan(spec, role, seq=..., "
                           "arch=...) shows what a tune would do on any machine")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    present = _arch_of(dev)
    if arch is not None and arch != present:
        raise ValueError(f"arch={arch!r} does not match the GPU present: {torch.cuda.get_device_name(dev)} "
                         f"is {present}; tune for {arch} on a GPU of that arch")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it to tune on the GPU")
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
    """Tune `role` ("attn" or "select") of `spec` for sequences of `seq`'s bucket on this GPU.

    trials         configs to measure (failures included), counting those a resumed study holds.
    timeout        seconds for the whole study (Optuna's timeout); the default config's own timing,
                   when the study did not measure it, comes on top.
    db             where the winner goes (default: the user DB, `kernelgen.db.TuningDB()`).
    storage        Optuna storage: a URL, a path to an SQLite file, or a storage object
                   (default: `kernelgen.compile.cache_dir()/"optuna.db"`).
    progress       called as progress(i, trials, median_ms or None) after each measured config, i
                   counting measured configs from 0 (a resumed study starts past 0); None: failed.
    device         None or "cuda[:i]": the GPU; "cpu": the interpreter on tiny inputs (tests only).
    trial_timeout  seconds one measurement (compile, check, timing) may take before it counts as failed.
    fixed          {field: value}: search only the points of the space with those values.
    shape          {"batch", "heads_kv", "n_q", "n_k"}: time on this workload (n_k in seq's bucket)
                   instead of the bucket's default inputs (`tune_inputs_shape`).
    """
    _check_role(spec, role)
    spec = spec.for_role(role)
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    worker_device, arch, gpu_name = _resolve_device(device, arch)
    cpu = worker_device == "cpu"
    if spec.backend == "gluon":  # role attn (selection is tuned as the Triton twin)
        from .ops import check_gluon_device

        check_gluon_device(torch.device(worker_device))  # a Hopper GPU, else every trial would fail
    the_plan = plan(spec, role, seq=seq, arch=arch, trials=trials, device="cpu" if cpu else None, fixed=fixed,
                    shape=shape)
    space, choices = the_plan["space"], the_plan["params"]
    if not space:
        raise ValueError(f"no feasible {role} config in the search space of {spec} (config.config_space); "
                         "nothing to tune")
    name, bucket, dtype = the_plan["study_name"], the_plan["bucket"], the_plan["dtype"]
    feasible = {_config_key(p) for p in space}
    default = the_plan["default"]
    from .render import template_hash

    fingerprint = tuning_db.current_fingerprint(template_hash(spec.backend, role), spec.backend)
    identity = {
        "fingerprint": fingerprint.as_columns(),
        "gpu_name": gpu_name,
        "dtype": dtype,
        "shape": the_plan["shape"],
        "space": hashlib.sha256(json.dumps(space, sort_keys=True).encode()).hexdigest()[:16],
    }
    base_job = {"spec_json": spec.to_json(), "role": role, "seq": bucket, "device": worker_device,
                "shape": None if cpu else shape}
    note = ("CPU interpreter run: fp16, tiny inputs, time.perf_counter over 2 calls; the timings are "
            "meaningless (plumbing only)") if cpu else ""
    worker = _Worker(worker_device)

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
            for seed_params in _seeds(default, choices, feasible, limit=max(1, the_plan["trials"] // 2)):
                study.enqueue_trial(seed_params)
        done = len(complete) + len(failed)
        if spec.backend == "tilelang" and role == "attn" and not cpu and done < trials:
            seen = {_config_key(t.params) for t in complete + failed}
            _precompile_tilelang(spec, [p for p in space if _config_key(p) not in seen], bucket, shape, worker_device)
        log.info("tune %s: %d configs feasible, %s sampler, %d of %d trials already measured", name,
                 len(space), the_plan["sampler"], done, trials)
        unmeasured_in_a_row = [0]

        def objective(trial: optuna.Trial) -> float:
            params = {field: trial.suggest_categorical(field, values) for field, values in choices.items()}
            key = _config_key(params)
            if key not in feasible:
                trial.set_user_attr("pruned", "infeasible")
                raise optuna.TrialPruned(f"{params} is outside the feasible space")
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
                if _config_key(t.params) != key:
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
            seen = {_config_key(t.params) for t in complete + failed}
            if len(complete) + len(failed) >= trials or feasible <= seen:
                study.stop()

        try:
            if done < trials and not feasible <= {_config_key(t.params) for t in complete + failed}:
                study.optimize(objective, timeout=timeout, catch=(_TrialFailed,), callbacks=[after_trial],
                               gc_after_trial=False)
            complete, failed = _measured(study)
            default_ms, default_failed, default_flops = None, False, None
            for t in complete + failed:
                if t.params == default:
                    default_ms, default_failed = t.value, t.state == TrialState.FAIL
            # not measured by the study (and inside the searched space): time it now
            if default_ms is None and not default_failed and _config_key(default) in feasible:
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
    tflops = flops / best_ms / 1e9 if role == "attn" and flops and best_ms else None
    notes = [note] if note else []
    if best_config is None:
        notes.append("every measured config failed; nothing written to the tuning DB")
        log.warning("tune %s: every measured config failed (%d); nothing written", name, len(failed))
    else:
        target = db if db is not None else tuning_db.TuningDB()
        try:
            target.upsert(spec_key=spec.role_key(role), role=role, backend=spec.backend, arch=arch, gpu_name=gpu_name,
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

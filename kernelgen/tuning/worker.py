"""The tuner's measurement process: each trial's config is built, checked against the float64
reference on small inputs (the role's workload, `kernelgen.roles`), then timed on inputs of the bucket's
size with `triton.testing.do_bench` (median ms).

Every measurement runs in a worker process ("spawn"): an illegal memory access poisons the CUDA
context of the process that made it, so the worker is replaced after any crash, timeout or run-time
error (a config the compiler refuses, or one with a wrong result, leaves it in service).

`device="cpu"` (tests only) runs the Triton interpreter on tiny fp16 inputs and times two calls with
`time.perf_counter`: it exercises the plumbing; its timings mean nothing.

Test hook: the worker sabotages every config whose fields include all items of the JSON object in
`$KERNELGEN_TUNE_SABOTAGE` (e.g. '{"block_m": 64}'), as `$KERNELGEN_TUNE_SABOTAGE_MODE` says:
"raise" (default: an exception), "exit" (the process dies) or "hang" (sleeps past any timeout).
"""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import statistics
import time
import traceback
from typing import Any

import torch

from .. import backends
from ..backends import Backend, Problem, Shapes
from ..errors import KernelgenRuntimeError
from ..roles import WorkloadShape, get_role
from ..spec import Spec
from .plan import trial_shapes

__all__ = ["Worker", "precompile", "precompile_points", "check_config", "STARTUP_TIMEOUT_S", "SABOTAGE_ENV",
           "SABOTAGE_MODE_ENV"]

log = logging.getLogger("kernelgen")

STARTUP_TIMEOUT_S = 300.0  # a fresh worker importing torch, triton and kernelgen
SABOTAGE_ENV, SABOTAGE_MODE_ENV = "KERNELGEN_TUNE_SABOTAGE", "KERNELGEN_TUNE_SABOTAGE_MODE"


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


class _Inputs:
    """The two workloads of one (backend, spec, role, seq, device), made once per worker: small inputs
    checked against the reference, bucket-sized ones timed (the same on the CPU)."""

    def __init__(self, spec: Spec, role: str, seq: int, device: str, shape: dict | None = None):
        cpu = device == "cpu"
        self.dtype = torch.float16 if cpu else torch.bfloat16
        workload = get_role(role).workload
        check, bench = (WorkloadShape(*s) for s in trial_shapes(spec, seq, cpu, shape))
        self.check = workload(spec, check, device, self.dtype, check=True)
        self.check_shapes = _shapes(spec, self.check.shape or check)
        self.bench = self.check if cpu else workload(spec, bench, device, self.dtype, check=False)
        self.bench_shapes = _shapes(spec, self.bench.shape or bench)


def _shapes(spec: Spec, shape: WorkloadShape) -> Shapes:
    return Shapes(shape.batch, shape.heads_kv * spec.gqa_group, shape.heads_kv, shape.n_q, shape.n_k,
                  spec.n_q_tiles(shape.n_q), spec.n_kv_blocks(shape.n_k))


def _launcher(backend: Backend, spec: Spec, role: str, config, workload, shapes: Shapes, dtype, device):
    """A call of `config`'s kernel on a workload's inputs."""
    problem = Problem(dtype, shapes, torch.device(device)) if backend.per_shape else None
    kernel = backend.build(spec, role, config, problem)
    impl = backend.role(role)
    return lambda: impl.launch(kernel, spec, config, shapes, *workload.args)


def check_config(backend: Backend, spec: Spec, role: str, config, seq: int, dtype: torch.dtype, device) -> str | None:
    """Why `config` computes `role` of `spec` wrongly, or None: the tuner's own check (small inputs against
    the float64 reference), run in this process. Dispatch runs it once before serving a winner measured
    under another torch or CUDA runtime."""
    device = torch.device(device)
    check, _ = (WorkloadShape(*s) for s in trial_shapes(spec, seq, device.type == "cpu", None))
    workload = get_role(role).workload(spec, check, device, dtype, check=True)
    return workload.check(_launcher(backend, spec, role, config, workload, _shapes(spec, workload.shape or check),
                                    dtype, device)())


def _measure(job: dict, cache: dict) -> dict:
    """Check one config against the reference, then time it. Runs in the worker."""
    spec, role, params, seq, device = (Spec.from_json(job["spec_json"]), job["role"], job["params"],
                                       job["seq"], job["device"])
    backend = backends.get(job["backend"])
    _sabotage(params)
    shape = job.get("shape")
    key = (job["backend"], job["spec_json"], role, seq, device, json.dumps(shape, sort_keys=True))
    if key not in cache:
        cache.clear()  # one tune at a time: drop the previous spec's (possibly large) inputs
        cache[key] = _Inputs(spec, role, seq, device, shape)
    inputs: _Inputs = cache[key]
    config = backend.config_from_dict(role, params)
    error = inputs.check.check(_launcher(backend, spec, role, config, inputs.check, inputs.check_shapes,
                                         inputs.dtype, device)())
    if error:  # NaN (an unwritten, poisoned element) fails too
        raise _Rejected(error)
    fn = _launcher(backend, spec, role, config, inputs.bench, inputs.bench_shapes, inputs.dtype, device)
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
    return {"ms": float(ms), "flops": inputs.bench.flops}


def _worker_main(conn, device: str) -> None:
    """Serve measurement jobs from `conn` until None or EOF. Replies ("ok", {"ms", "flops"}),
    ("rejected", why): a wrong result, ("failed", why): the compiler refused the config (its
    resources, say), which leaves the process sound, or ("error", why): anything else, after which
    the parent replaces the worker (a CUDA error poisons the context for good)."""
    try:
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


def _build_point(job: tuple) -> str | None:
    """Build one config's kernels for some problem shapes (a precompile process). Returns the error, if
    any: the trial meets it again and records it."""
    backend_name, spec_json, role, params, shapes, dtype, device = job
    backend = backends.get(backend_name)
    spec = Spec.from_json(spec_json)
    try:
        config = backend.config_from_dict(role, params)
        for shape in shapes:
            backend.build(spec, role, config, Problem(getattr(torch, dtype), _shapes(spec, WorkloadShape(*shape)),
                                                      torch.device(device)))
    except Exception as error:  # noqa: BLE001
        return _describe(error, 300)
    return None


def precompile_points(backend: Backend, spec: Spec, role: str, space: list[dict], bucket: int, shape: dict | None,
                      device: str) -> float:
    """A backend whose kernels are compiled per problem shape (TileLang: nvcc takes seconds for each)
    gets the points of `space` compiled, for both inputs of a trial (`trial_shapes`), in parallel
    processes first. They fill its disk cache, so each trial then only checks and times (H200 host, 16
    cores: a 12-point grid tuned in 55-80 s per shape, where 6 serial trials had taken 87-144 s).
    Returns the seconds it took."""
    shapes = trial_shapes(spec, bucket, False, shape)
    seconds, errors = precompile([(backend.name, spec.to_json(), role, params, shapes, "bfloat16", device)
                                  for params in space])
    log.info("tune: precompiled %d %s configs x %d shapes in %.0f s (%d failed)", len(space), backend.name,
             len(shapes), seconds, len(errors))
    return seconds


def precompile(jobs: list[tuple]) -> tuple[float, list[str]]:
    """Build kernels in parallel spawned processes, filling the compiler's disk cache so that the same
    build in this process is then instant. A job: (backend, spec JSON, role, config fields,
    [(batch, heads_kv, n_q, n_k), ...], dtype name, device). Returns (seconds, errors)."""
    import concurrent.futures as cf

    if not jobs:
        return 0.0, []
    t0 = time.perf_counter()
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 16))
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_build_point, jobs) if e]
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


MAIN_GUARD = ("a script that tunes must do so under `if __name__ == '__main__':`, as each tune process imports the "
              "script again")


class Worker:
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
            hint = f" (its stderr says why; {MAIN_GUARD})" if payload.startswith("worker process died") else ""
            raise KernelgenRuntimeError(f"tune worker failed to start: {payload}{hint}")
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



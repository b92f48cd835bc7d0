"""Tune on first use (opt-in: `KERNELGEN_AUTOTUNE=1`).

When dispatch serves a role a config that was not tuned for the spec itself (a default, or the nearest
tuned spec's), it asks for a short tune of that role in a separate process (`python -m
kernelgen.tuning.autotune`); the call is served meanwhile. The winner goes to the user DB; when the
process ends, `generation` moves on and every `SparseAttention` reads the DB again on its next call.

KERNELGEN_AUTOTUNE=1           switch it on (also true, yes, on); in Triton's CPU interpreter it tunes nothing
KERNELGEN_AUTOTUNE_TRIALS=N    configs a tune measures (default 8)
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

from ..device import interpreting
from ..roles import get_role
from ..spec import Spec

__all__ = ["enabled", "request", "running", "poll", "wait", "generation", "ENV", "TRIALS_ENV", "DEFAULT_TRIALS"]

log = logging.getLogger("kernelgen")

ENV, TRIALS_ENV = "KERNELGEN_AUTOTUNE", "KERNELGEN_AUTOTUNE_TRIALS"
DEFAULT_TRIALS = 8

generation = 0  # moves on each time a tune ends: served configs may have changed
_running: dict[tuple, subprocess.Popen] = {}
_requested: set[tuple] = set()


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_warned: set[str] = set()


def enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _ON and value not in _OFF and value not in _warned:
        _warned.add(value)  # once per value: this runs on every call
        log.warning("%s=%r is neither on (%s) nor off (%s): off", ENV, os.environ[ENV], ", ".join(_ON),
                    ", ".join(_OFF[1:]))
    return value in _ON


def _trials() -> int:
    try:
        return max(1, int(os.environ.get(TRIALS_ENV, DEFAULT_TRIALS)))
    except ValueError:
        log.warning("%s=%r is not an int; using %d", TRIALS_ENV, os.environ.get(TRIALS_ENV), DEFAULT_TRIALS)
        return DEFAULT_TRIALS


def request(spec: Spec, role: str, bucket: int, device) -> None:
    """Start a tune of `role` for `spec` (a kernel spec: its backend is the one tuned) in `bucket`, once per
    process; nothing when a tune of it ran or runs already, or the role has nothing to tune."""
    if not get_role(role).tuned:
        return
    if interpreting():  # its timings say nothing of a GPU's (`kernelgen tune` refuses the CPU likewise)
        if "interpreter" not in _warned:
            _warned.add("interpreter")
            log.warning("%s: kernels run in Triton's CPU interpreter, which is not tuned (it runs the default "
                        "configs): no tune started", ENV)
        return
    key = (spec, role, bucket, str(device))
    if key in _requested:
        return
    _requested.add(key)
    # on the call's GPU: the winner is stored for that GPU's kind, which another GPU of the host may not be
    job = dict(spec=spec.to_json(), role=role, seq=bucket, trials=_trials(), device=str(device))
    try:
        stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty tune must never block on it
        _running[key] = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(job)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    except OSError as error:
        log.warning("autotune: could not start a tune of %s for %s (%s)", role, spec, error)
        return
    _running[key].stderr_file = stderr
    log.info("autotune: tuning %s of %s for %d keys in the background (%d trials)", role, spec, bucket, job["trials"])


def running() -> bool:
    return bool(_running)


def poll() -> bool:
    """Reap finished tunes; True if any ended (their winners are in the user DB)."""
    global generation
    ended = [key for key, proc in _running.items() if proc.poll() is not None]
    for key in ended:
        proc = _running.pop(key)
        proc.stderr_file.seek(0)
        error = proc.stderr_file.read().strip().splitlines()[-1:] if proc.returncode else []
        proc.stderr_file.close()
        if proc.returncode:
            log.warning("autotune: the tune of %s for %s failed (exit %d): %s", key[1], key[0], proc.returncode,
                        error[0] if error else "no message")
        else:
            log.info("autotune: tuned %s of %s", key[1], key[0])
    if ended:
        generation += 1
    return bool(ended)


def wait(timeout: float | None = None) -> None:
    """Wait for every running tune to end (tests, and scripts that want tuned kernels before timing)."""
    for proc in list(_running.values()):
        proc.wait(timeout)
    poll()


def _main(job_json: str) -> None:
    from .study import tune

    job = json.loads(job_json)
    tune(Spec.from_json(job["spec"]), job["role"], seq=job["seq"], trials=job["trials"], device=job["device"])


if __name__ == "__main__":
    _main(sys.argv[1])

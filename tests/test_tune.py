"""Tests for kernelgen.tuning (plan, worker, study). CPU: the worker runs the Triton interpreter on tiny
inputs; timings are meaningless, the plumbing is what is checked. Some tests replace the worker process by
a fake one to check the study logic without compiling anything."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import zlib

import optuna
import pytest
import torch
from optuna.trial import TrialState

import kernelgen.device
import kernelgen.roles
from kernelgen import KernelgenRuntimeError, KernelgenTypeError, KernelgenValueError, Spec, backends, reference
from kernelgen.archs import ARCHS, check_arch
from kernelgen.backends.triton import attn_smem_bytes
from kernelgen.roles import get_role, tuned_roles, valid_top_k
from kernelgen.tuning import TuneResult, plan, tune, tune_inputs_shape
from kernelgen.tuning import study as study_module
from kernelgen.tuning import worker as worker_module
from kernelgen.tuning.buckets import seq_bucket
from kernelgen.tuning.db import TuningDB, Winners, current_fingerprint
from kernelgen.tuning.plan import tuned_backend
from kernelgen.tuning.worker import check_config

# the module (`kernelgen.tuning.plan` is the function `plan`, as `from kernelgen.tuning import plan` gives)
plan_module = importlib.import_module("kernelgen.tuning.plan")
TRITON, TILELANG, GLUON = (backends.get(name) for name in ("triton", "tilelang", "gluon"))
# 16 feasible attention configs; small enough for the interpreter to run a trial in well under a second
SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)
ATTN_SPEC = get_role("attn").kernel_spec(SPEC, "triton")  # what the attention tune measures and records
SEQ = 128


def asdicts(configs):
    return [dataclasses.asdict(c) for c in configs]


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """No test may touch the real user cache dir (the Optuna storage and the user DB default there)."""
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(worker_module.SABOTAGE_ENV, raising=False)
    monkeypatch.delenv(worker_module.SABOTAGE_MODE_ENV, raising=False)


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.db") as tuning_db:
        yield tuning_db


def measured(storage, name):
    """(complete, failed) trials that measured a config, as tune() counts them."""
    return study_module._measured(optuna.load_study(study_name=name, storage=f"sqlite:///{storage}"))


def run_tune(tmp_path, db, **kwargs):
    kwargs = {"role": "attn", "seq": SEQ, "trials": 3, "device": "cpu", "db": db,
              "storage": tmp_path / "optuna.db", **kwargs}
    return tune(SPEC, **kwargs)


class FakeWorker:
    """Stands in for the worker process: a deterministic time per config, no compile. Records the jobs'
    configs (and the whole jobs)."""

    jobs: list = []
    full_jobs: list = []
    interrupt_at: int | None = None

    def __init__(self, device):
        self.device = device

    def run(self, job, timeout):
        FakeWorker.jobs.append(job["params"])
        FakeWorker.full_jobs.append(job)
        if FakeWorker.interrupt_at is not None and len(FakeWorker.jobs) == FakeWorker.interrupt_at:
            raise KeyboardInterrupt
        ms = 1.0 + zlib.crc32(json.dumps(job["params"], sort_keys=True).encode()) % 1000 / 100
        return "ok", {"ms": ms, "flops": 1e9}

    def close(self):
        pass


@pytest.fixture
def fake_worker(monkeypatch):
    FakeWorker.jobs = []
    FakeWorker.full_jobs = []
    FakeWorker.interrupt_at = None
    monkeypatch.setattr(study_module, "Worker", FakeWorker)
    return FakeWorker


# -- plan ------------------------------------------------------------------------------------------


def test_the_package_exports_the_functions():
    """`from kernelgen.tuning import plan` is the function, also once its module (and the study's) is imported."""
    import kernelgen.tuning

    assert plan is plan_module.plan and callable(plan) and kernelgen.tuning.plan is plan_module.plan
    assert tune is study_module.tune and TuneResult is study_module.TuneResult
    assert tune_inputs_shape is plan_module.tune_inputs_shape


def test_plan_attn():
    p = plan(SPEC, "attn", seq=5000, arch="sm_90", trials=3)
    assert p["bucket"] == seq_bucket(5000) == 8192
    assert p["study_name"] == f"kg-{get_role('attn').key(SPEC, 'triton')}-attn-triton-sm_90-8192"
    assert p["spec_key"] == ATTN_SPEC.key() and p["backend"] == "triton" and p["arch"] == "sm_90"
    space = TRITON.config_space(ATTN_SPEC, "attn", "sm_90")
    assert p["space"] and p["space_size"] == len(p["space"]) == len(space)
    assert p["space"] == asdicts(space)
    assert all(TRITON.infeasible(ATTN_SPEC, "attn", TRITON.config_from_dict("attn", c), "sm_90") is None
               for c in p["space"])
    assert p["sampler"] == "tpe" and p["trials"] == 3
    assert p["default"] == {"block_m": 64, "num_warps": 4, "num_stages": 2, "use_tma": False, "kv_per_iter": 1}
    assert p["default"] == dataclasses.asdict(TRITON.default_config(ATTN_SPEC, "attn", "sm_90"))
    assert set(p["params"]) == {"block_m", "num_warps", "num_stages", "use_tma", "kv_per_iter"}
    # timed at the bucket's size: every seq of a bucket shares one study
    assert p["shape"] == {"batch": 1, "heads_q": 32, "heads_kv": 16, "n_q": 8192, "n_k": 8192, "head_dim": 64}
    assert p["dtype"] == "bfloat16" and p["device"] == "cuda"
    assert plan(SPEC, "attn", seq=5000, arch="sm_90", trials=len(space))["sampler"] == "grid"
    json.dumps(p)  # plain data, fit for `kernelgen tune --dry-run`


def test_attention_tune_is_shared_by_every_selector():
    """The attention kernel reads lists only: specs differing in selector or forced blocks share its study."""
    p = plan(SPEC, "attn", seq=5000, arch="sm_90")
    for other in (SPEC.replace(selector="given"), SPEC.replace(selector="multi:2", local=1, sink=1)):
        assert plan(other, "attn", seq=5000, arch="sm_90") == p
    assert plan(SPEC.replace(top_k=1), "attn", seq=5000, arch="sm_90")["study_name"] != p["study_name"]


def test_plan_fixed_restricts_the_space():
    full = plan(SPEC, "attn", seq=5000, arch="sm_90")["space"]
    sub = plan(SPEC, "attn", seq=5000, arch="sm_90", fixed={"use_tma": False, "kv_per_iter": 2})
    assert sub["space"] == [c for c in full if not c["use_tma"] and c["kv_per_iter"] == 2]
    assert 0 < sub["space_size"] < len(full) and sub["params"]["kv_per_iter"] == [2]
    with pytest.raises(KernelgenValueError, match="not attn config fields"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", fixed={"threads": 128})


def test_plan_shape_sets_the_timed_workload():
    p = plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 2, "heads_kv": 1, "n_q": 1000, "n_k": 5000})
    assert p["bucket"] == 8192
    assert p["shape"] == {"batch": 2, "heads_q": SPEC.gqa_group, "heads_kv": 1, "n_q": 1000, "n_k": 5000, "head_dim": 64}
    with pytest.raises(KernelgenValueError, match="outside the bucket"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 1, "heads_kv": 1, "n_q": 64, "n_k": 20000})
    with pytest.raises(KernelgenValueError, match="shape must map"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 1, "heads_kv": 1, "n_q": 64})


def test_plan_names_the_queries_a_role_s_workload_times():
    """A decode role times one query, a prefill over a cache's rows at most PREFILL_CHUNK, whatever seq asks: the
    plan (and so `tune --dry-run`) says so."""
    assert plan(SPEC, "decode", seq=65536, arch="sm_90")["shape"]["n_q"] == 1
    assert plan(SPEC, "attn_rows", seq=65536, arch="sm_90")["shape"]["n_q"] == 2048
    assert plan(SPEC, "attn", seq=65536, arch="sm_90")["shape"]["n_q"] == 65536


@pytest.mark.parametrize("seq", [0, -1, -5000, True, 2.5, "4096", plan_module.MAX_SEQ + 1])
def test_plan_rejects_a_seq_that_is_no_length(seq):
    with pytest.raises(KernelgenValueError, match=rf"seq must be an int from 1 to {plan_module.MAX_SEQ}"):
        plan(SPEC, "attn", seq=seq, arch="sm_90")


@pytest.mark.parametrize("trials", [0, -1, True, 2.0, None])
def test_plan_rejects_trials_that_are_no_count(trials):
    with pytest.raises(KernelgenValueError, match="trials must be an int >= 1"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", trials=trials)


@pytest.mark.parametrize("arch", ["banana", "sm_999", "sm_9", "sm_49", "sm_90b", "sm_90a", "SM_90", "", "90", "cuda"])
def test_plan_rejects_a_malformed_arch(arch):
    with pytest.raises(KernelgenValueError, match=rf"arch={re.escape(repr(arch))} is not a CUDA arch"):
        check_arch(arch)
    with pytest.raises(KernelgenValueError, match="is not a CUDA arch"):
        plan(SPEC, "attn", seq=5000, arch=arch)


@pytest.mark.parametrize("arch", ["cpu", "sm_80", "sm_89", "sm_90", "sm_100", "sm_120"])
def test_check_arch_accepts_cuda_archs(arch):
    assert check_arch(arch) == arch
    assert plan(SPEC, "attn", seq=5000, arch=arch)["arch"] == arch


def test_plan_keeps_the_configs_the_arch_runs():
    """D=128 with 128-key blocks: sm_90 tries TMA and up to 227 KB of shared memory; sm_89 (99 KB, no TMA)
    and sm_80 (163 KB, no TMA) only what they run, and each arch's default is a point of its space."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given")
    kernel_spec = get_role("attn").kernel_spec(spec, "triton")
    plans = {arch: plan(spec, "attn", seq=32768, arch=arch) for arch in ("sm_80", "sm_89", "sm_90")}
    for arch, p in plans.items():
        configs = [TRITON.config_from_dict("attn", c) for c in p["space"]]
        smem = [attn_smem_bytes(kernel_spec, c, arch) for c in configs]
        assert configs and max(smem) <= ARCHS[arch].smem_per_block, arch
        assert any(c.use_tma for c in configs) == (arch == "sm_90"), arch
        assert p["default"] in p["space"] and p["study_name"].endswith(f"-{arch}-32768"), arch
    assert max(attn_smem_bytes(kernel_spec, TRITON.config_from_dict("attn", c), "sm_90")
               for c in plans["sm_90"]["space"]) > ARCHS["sm_80"].smem_per_block
    assert len(plans["sm_89"]["space"]) < len(plans["sm_80"]["space"]) < len(plans["sm_90"]["space"])
    assert plans["sm_90"]["default"] == {"block_m": 128, "num_warps": 8, "num_stages": 2, "use_tma": False,
                                         "kv_per_iter": 1}
    assert plans["sm_89"]["default"] == {**plans["sm_90"]["default"], "block_m": 64}  # 128 rows do not fit 99 KB


@pytest.mark.parametrize("arch", ["sm_50", "sm_75"])
def test_plan_refuses_an_arch_older_than_the_kernels(arch):
    for role in ("select", "attn"):  # whatever the role's rules read
        with pytest.raises(KernelgenValueError, match=rf"arch='{arch}' is older than kernelgen's kernels run on; "
                                                      "expected sm_80 or newer"):
            plan(SPEC, role, seq=5000, arch=arch)


def test_plan_rejects_an_arch_the_backend_cannot_run():
    """Gluon runs on sm_90 only, TileLang on CUDA GPUs only: a tune for another arch would fail every trial."""
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, backend="gluon")
    for arch in ("sm_89", "sm_80", "sm_100"):
        with pytest.raises(KernelgenValueError, match=rf"backend='gluon' runs on sm_90 only, not {arch}"):
            plan(spec, "attn", seq=5000, arch=arch)
    with pytest.raises(KernelgenValueError, match="backend='gluon' does not run on the CPU"):
        plan(spec, "attn", seq=5000, arch="cpu")
    assert plan(spec, "attn", seq=5000, arch="sm_90")["arch"] == "sm_90"
    assert plan(spec, "select", seq=5000, arch="sm_89")["backend"] == "triton"  # the selector runs anywhere
    with pytest.raises(KernelgenValueError, match="backend='tilelang' does not run on the CPU"):
        plan(spec.replace(backend="tilelang"), "attn", seq=5000, device="cpu")
    assert plan(spec.replace(backend="tilelang"), "attn", seq=5000, arch="sm_89")["backend"] == "tilelang"


def test_auto_backend_is_not_tuned():
    with pytest.raises(KernelgenValueError,
                       match=rf"served, not tuned: tune each of {re.escape(str(backends.names()))}"):
        plan(SPEC.replace(backend="auto"), "attn", seq=5000, arch="sm_90")


def test_plan_gluon_attn():
    """The Gluon forward is tuned over its own space (rows and stages; the warps follow from the rows)."""
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, backend="gluon")
    p = plan(spec, "attn", seq=5000, arch="sm_90", trials=30)
    assert p["study_name"] == f"kg-{get_role('attn').key(spec, 'gluon')}-attn-gluon-sm_90-8192" and p["backend"] == "gluon"
    assert p["space"] == [{"block_m": m, "num_stages": s} for m in (64, 128) for s in (2, 3, 4)]
    assert p["default"] == {"block_m": 128, "num_stages": 3} and p["sampler"] == "grid"
    assert plan(spec, "select", seq=5000, arch="sm_90") == plan(spec.replace(backend="triton"), "select", seq=5000,
                                                                 arch="sm_90")  # the Triton selector's study


def test_a_spec_the_backend_cannot_compute_is_not_planned():
    with pytest.raises(KernelgenValueError, match="Spec.head_dim=256 is not supported by backend='gluon'"):
        plan(Spec(head_dim=256, backend="gluon"), "attn", seq=5000, arch="sm_90")
    with pytest.raises(KernelgenValueError, match="backend='cuda' is unknown"):
        plan(Spec(head_dim=64, backend="cuda"), "attn", seq=5000, arch="sm_90")
    with pytest.raises(KernelgenTypeError, match="spec must be a kernelgen.Spec"):
        plan(SPEC.to_dict(), "attn", seq=5000, arch="sm_90")


def test_gluon_is_tuned_on_hopper_only(tmp_path, db):
    """Off a Hopper GPU every Gluon trial would fail: tune says so before starting a study."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, backend="gluon", selector="given")
    with pytest.raises(KernelgenValueError, match=r"backend='gluon' runs on CUDA GPUs \(Hopper, sm_90\) only"):
        tune(spec, "attn", seq=SEQ, trials=2, device="cpu", db=db, storage=tmp_path / "optuna.db")
    assert db.rows() == [] and not (tmp_path / "optuna.db").exists()


def test_a_read_only_cache_dir_fails_before_the_first_trial(tmp_path, monkeypatch, fake_worker):
    """The user DB (or the Optuna storage) cannot be written: one clear error naming it, before any trial."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(KernelgenRuntimeError, match=r"tuning database .*/file/cache/tuning.db cannot be written"):
        tune(SPEC, "attn", seq=SEQ, trials=2, device="cpu")
    with TuningDB(tmp_path / "tuning.db") as db, \
            pytest.raises(KernelgenRuntimeError, match=r"study storage .*/file/cache/optuna.db cannot be written"):
        tune(SPEC, "attn", seq=SEQ, trials=2, device="cpu", db=db)
    assert fake_worker.jobs == []


@pytest.mark.parametrize("backend", ["tilelang", "gluon", "auto"])
def test_selection_is_tuned_as_the_triton_twin(backend):
    """Every backend selects with the Triton kernels: one study and one DB row serve them all."""
    spec = SPEC.replace(backend=backend, head_dim=128, kv_block=64, q_tile=64)  # one Gluon computes too
    p = plan(spec, "select", seq=5000, arch="sm_90")
    assert p == plan(spec.replace(backend="triton"), "select", seq=5000, arch="sm_90")
    assert p["backend"] == "triton"
    assert p["spec_key"] == get_role("select").key(spec, "triton") == spec.replace(backend="triton").key()


@pytest.mark.parametrize("backend", ["tilelang", "gluon", "auto"])
def test_tuned_backend_of_the_selector_is_triton(backend):
    spec = SPEC.replace(backend=backend, head_dim=128, kv_block=64, q_tile=64)
    runner, kernel_spec = tuned_backend(spec, "select")
    assert runner is TRITON and kernel_spec == spec.replace(backend="triton")


def test_tuned_backend_of_the_attention():
    for backend in ("triton", "tilelang"):
        runner, kernel_spec = tuned_backend(SPEC.replace(backend=backend), "attn")
        assert runner is backends.get(backend)
        assert kernel_spec == SPEC.replace(backend=backend, selector="given", local=0, sink=0)
    with pytest.raises(KernelgenValueError, match="has no tunables"):
        tuned_backend(SPEC, "lists")


def test_plan_select_and_cpu():
    p = plan(SPEC, "select", seq=1000, trials=1000, device="cpu")
    assert p["sampler"] == "grid" and p["trials"] == p["space_size"] > 0
    assert p["space"] == asdicts(TRITON.config_space(SPEC, "select", "cpu"))
    assert p["arch"] == "cpu" and p["dtype"] == "float16" and p["bucket"] == 1024 and p["device"] == "cpu"
    assert p["shape"]["n_q"] == 256 and p["shape"]["heads_q"] == SPEC.gqa_group
    with pytest.raises(KernelgenValueError, match="selector='given'"):
        plan(SPEC.replace(selector="given"), "select", seq=1000)
    with pytest.raises(KernelgenValueError, match="role='bwd' is unknown"):
        plan(SPEC, "bwd", seq=1000)
    with pytest.raises(KernelgenValueError, match="role='lists' has no tunables"):
        plan(SPEC, "lists", seq=1000)


@pytest.mark.parametrize("g, heads", [(1, 32), (2, 32), (3, 33), (8, 32), (64, 64)])
def test_tune_inputs_shape(g, heads):
    spec = SPEC.replace(gqa_group=g)
    assert tune_inputs_shape(spec, 4096) == (1, heads, heads // g, 4096, 4096)
    assert tune_inputs_shape(spec, 4096, cpu=True) == (1, g, 1, 256, 256)


# -- errors before any work --------------------------------------------------------------------------


@pytest.fixture
def no_cached_gpu():
    """device_arch caches what CUDA says per device: a pretend GPU must not outlive its test."""
    kernelgen.device._cuda_arch.cache_clear()
    yield
    kernelgen.device._cuda_arch.cache_clear()


def test_no_cuda_needs_device_cpu(monkeypatch, tmp_path, db):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="tuning needs a CUDA GPU"):
        tune(SPEC, seq=SEQ, db=db, storage=tmp_path / "optuna.db")
    # a dry run works on any machine, given the arch its space depends on
    assert plan(SPEC, "attn", seq=SEQ, arch="sm_89")["study_name"].endswith("-sm_89-1024")
    with pytest.raises(KernelgenValueError, match="arch=None and no CUDA GPU here.*pass arch='sm_90'"):
        plan(SPEC, "attn", seq=SEQ)


def test_tune_scaling_tool_without_a_gpu_says_so(monkeypatch, tmp_path):
    """tools/tune_scaling.py as docs/PERF.md gives it, on a machine without a GPU: one line naming --device cpu,
    before any tune starts (not the tuner's traceback)."""
    from checks import tool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["tune_scaling.py", "--workers", "1,2", "--trials", "40", "--shape", "a32k",
                                      "--out", str(tmp_path / "tune_scaling.json")])
    with pytest.raises(SystemExit, match="needs one \\(--device cpu runs the interpreter"):
        tool("tune_scaling").main()
    assert not (tmp_path / "tune_scaling.json").exists()


def test_arch_mismatch(monkeypatch, tmp_path, db, no_cached_gpu):
    with pytest.raises(KernelgenValueError, match="sm_90.*cpu"):
        run_tune(tmp_path, db, arch="sm_90")
    # a pretend sm_90 GPU, asked to tune for sm_80
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend H200")
    with pytest.raises(KernelgenValueError, match=r"arch='sm_80'.*Pretend H200 is sm_90"):
        tune(SPEC, seq=SEQ, arch="sm_80", db=db, storage=tmp_path / "optuna.db")
    assert not (tmp_path / "optuna.db").exists()


@pytest.mark.parametrize("kwargs, error", [
    (dict(trials=0), "trials must be an int >= 1"),
    (dict(seq=0), "seq must be an int from 1"),
    (dict(arch="banana"), "does not match the device"),
    (dict(device="meta"), "expected a CUDA device"),
])
def test_tune_refuses_bad_arguments_before_any_work(tmp_path, db, kwargs, error):
    with pytest.raises(KernelgenValueError, match=error):
        run_tune(tmp_path, db, **kwargs)
    assert db.rows() == [] and not (tmp_path / "optuna.db").exists()


# -- real worker processes (interpreter) --------------------------------------------------------------


def test_a_script_that_tunes_without_its_main_guard_is_told_at_once(tmp_path):
    """A script calling tune() at its top level: the spawned measurement process imports it again, and there
    tune() refuses naming the main guard (before, the parent waited out the 300 s start-up timeout, no hint)."""
    script = tmp_path / "tune_script.py"
    script.write_text("from kernelgen import Spec\nfrom kernelgen.tuning import tune\n"
                      f"print(tune(Spec.from_json({SPEC.to_json()!r}), seq={SEQ}, trials=1, device='cpu'))\n")
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    said = run.stdout + run.stderr
    assert "tune worker failed to start: worker process died starting" in said, said[-2000:]
    assert "must do so under `if __name__ == '__main__':`" in said and "timed out" not in said


def test_tune_cpu_writes_one_winner(tmp_path, db):
    calls = []
    result = run_tune(tmp_path, db, progress=lambda *args: calls.append(args))
    assert isinstance(result, TuneResult)
    # the plan's name, then a hash of the toolchain, GPU, dtype, shape and space the timings depend on
    assert re.fullmatch(rf"kg-{get_role('attn').key(SPEC, 'triton')}-attn-triton-cpu-1024-[0-9a-f]{{12}}",
                        result.study_name)
    assert (result.arch, result.gpu_name, result.dtype, result.bucket) == ("cpu", "cpu", "float16", 1024)
    assert result.n_trials == 3 and result.n_failed == 0
    assert result.best_ms > 0 and result.default_ms >= result.best_ms and result.tflops > 0
    assert "meaningless" in result.note
    assert [c[:2] for c in calls] == [(0, 3), (1, 3), (2, 3)] and all(c[2] > 0 for c in calls)
    space = [json.dumps(c, sort_keys=True) for c in asdicts(TRITON.config_space(ATTN_SPEC, "attn", "cpu"))]
    assert json.dumps(result.best_config, sort_keys=True) in space

    rows = db.rows()
    assert len(rows) == 1
    row = rows[0]
    assert row["config"] == result.best_config and row["median_ms"] == result.best_ms
    assert (row["role"], row["backend"], row["n_trials"]) == ("attn", "triton", 3)
    assert json.loads(row["spec_json"]) == ATTN_SPEC.to_dict()  # the kernel spec that was measured
    fp = current_fingerprint(TRITON, "attn")
    assert {k: row[k] for k in fp.as_columns()} == fp.as_columns()
    found = Winners(db).lookup(spec_key=get_role("attn").key(SPEC, "triton"), role="attn", backend="triton",
                               arch="cpu", gpu_name="cpu", dtype="float16", bucket=seq_bucket(SEQ), fingerprint=fp)
    assert found["config"] == result.best_config and found["source"] == "user"
    # the first trial was the default config (TPE is seeded with it)
    complete, _ = measured(tmp_path / "optuna.db", result.study_name)
    first = min(complete, key=lambda t: t.number)
    assert first.params == dataclasses.asdict(TRITON.default_config(ATTN_SPEC, "attn", "cpu"))
    assert first.value == result.default_ms


HANG_TIMEOUT_S = 20


@pytest.mark.parametrize("mode, error", [
    ("raise", "RuntimeError: sabotaged"),  # an exception in the worker (e.g. a CUDA error)
    ("exit", "died measuring (exit code 3)"),  # the process dies (e.g. a segfault)
    ("hang", f"timed out after {HANG_TIMEOUT_S} s measuring"),  # the process hangs past the per-trial timeout
])
def test_failing_trial_is_recorded_and_the_study_goes_on(tmp_path, db, monkeypatch, mode, error):
    # the default config (trial 0) fails; the next trials run in a fresh worker process
    default = dataclasses.asdict(TRITON.default_config(ATTN_SPEC, "attn", "cpu"))
    monkeypatch.setenv(worker_module.SABOTAGE_ENV, json.dumps(default))
    monkeypatch.setenv(worker_module.SABOTAGE_MODE_ENV, mode)
    # the healthy trials must fit the timeout too, also on a loaded machine (tests run in parallel):
    # a short one only where the hang is what is tested
    result = run_tune(tmp_path, db, trial_timeout=HANG_TIMEOUT_S if mode == "hang" else 300)
    assert result.n_failed == 1 and result.n_trials == 2  # failures count toward `trials`
    assert result.default_ms is None and result.best_config != default
    complete, failed = measured(tmp_path / "optuna.db", result.study_name)
    assert failed[0].state == TrialState.FAIL and failed[0].number == 0
    assert error in failed[0].user_attrs["error"]
    assert len(db.rows()) == 1 and db.rows()[0]["config"] == result.best_config


def test_resume_reuses_completed_trials(tmp_path, db, monkeypatch):
    first = run_tune(tmp_path, db, trials=2)
    before, _ = measured(tmp_path / "optuna.db", first.study_name)
    second = run_tune(tmp_path, db, trials=3)
    after, _ = measured(tmp_path / "optuna.db", first.study_name)
    assert (first.n_trials, second.n_trials) == (2, 3)
    assert {t.number: t.value for t in before}.items() <= {t.number: t.value for t in after}.items()
    # nothing left to measure: no worker may start
    monkeypatch.setattr(worker_module.Worker, "_start", lambda self: pytest.fail("a worker was started"))
    third = run_tune(tmp_path, db, trials=3)
    assert third.n_trials == 3 and third.best_ms == min(t.value for t in after)
    assert len(db.rows()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the interpreter in this process")
def test_worker_checks_against_the_reference(monkeypatch):
    job = {"backend": "triton", "seq": SEQ, "device": "cpu"}
    cache = {}
    attn = {**job, "spec_json": ATTN_SPEC.to_json(), "role": "attn",
            "params": {"block_m": 32, "num_warps": 4, "num_stages": 1}}
    assert worker_module._measure(attn, cache)["ms"] > 0
    inputs = next(iter(cache.values()))
    q, k, v, lists, scale = inputs.check.args
    # as if the kernel computed something else: it is given other values than the reference was
    inputs.check = dataclasses.replace(inputs.check, args=(q, k, v * 1.1, lists, scale))
    with pytest.raises(worker_module._Rejected, match="rel. L2 error"):
        worker_module._measure(attn, cache)

    select = {**job, "spec_json": SPEC.to_json(), "role": "select",
              "params": {"tiles": 8, "chunk": 16, "num_warps": 4, "num_stages": 1}}
    assert worker_module._measure(select, cache)["flops"] is None
    [inputs] = cache.values()  # the attention's inputs were dropped
    q, k = inputs.check.args
    lists = reference.select_blocks(q, k, SPEC).to(torch.int32)
    assert valid_top_k(lists, q, k, SPEC) and inputs.check.check(lists) is None
    empty_lists = torch.full_like(lists, -1)
    assert not valid_top_k(empty_lists, q, k, SPEC)  # forced blocks missing
    assert "not a valid top-k" in inputs.check.check(empty_lists)
    # the lists of the kernel scoring -k pick the lowest-scoring blocks: rejected
    inputs.check = dataclasses.replace(inputs.check, args=(q, -k))
    with pytest.raises(worker_module._Rejected, match="not a valid top-k"):
        worker_module._measure(select, cache)
    # valid_top_k is the whole judgement (no comparison with the default config's lists)
    monkeypatch.setattr(kernelgen.roles, "valid_top_k", lambda *args: True)
    assert inputs.check.check(empty_lists) is None
    assert worker_module._measure(select, cache)["ms"] > 0


# -- the study logic, with a fake worker ---------------------------------------------------------------


def test_grid_measures_each_feasible_point_once(tmp_path, db, fake_worker):
    # head_dim 256, kv_block 128: registers and shared memory make some products of the choices infeasible
    spec = Spec(head_dim=256, kv_block=128, q_tile=64, top_k=2, gqa_group=2)
    space = asdicts(TRITON.config_space(get_role("attn").kernel_spec(spec, "triton"), "attn", "cpu"))
    p = plan(spec, "attn", seq=SEQ, trials=len(space), device="cpu")
    n_product = 1
    for values in p["params"].values():
        n_product *= len(values)
    assert p["sampler"] == "grid" and n_product > len(space)
    result = tune(spec, seq=SEQ, trials=len(space), device="cpu", db=db, storage=tmp_path / "optuna.db")
    assert sorted(map(str, fake_worker.jobs)) == sorted(map(str, space))  # infeasible points never reach it
    study = optuna.load_study(study_name=result.study_name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    # the study stops once every feasible point is measured, maybe before the grid reaches the last infeasible one
    assert 0 < len(pruned) <= n_product - len(space) and all(t.user_attrs["pruned"] == "infeasible" for t in pruned)
    assert result.n_trials == len(space) and result.best_ms == min(t.value for t in study.trials if t.value)


def test_jobs_name_the_backend_and_kernel_spec_measured(tmp_path, db, fake_worker):
    run_tune(tmp_path, db, trials=2)
    assert len(fake_worker.full_jobs) == 2
    for job in fake_worker.full_jobs:
        assert (job["backend"], job["role"], job["device"], job["seq"]) == ("triton", "attn", "cpu", 1024)
        assert Spec.from_json(job["spec_json"]) == ATTN_SPEC


def test_a_tilelang_spec_s_selector_is_tuned_on_triton(tmp_path, db, fake_worker):
    """A role the spec's backend lacks is tuned (and recorded) on the backend that runs it."""
    spec = SPEC.replace(backend="tilelang")
    result = tune(spec, "select", seq=SEQ, trials=2, device="cpu", db=db, storage=tmp_path / "optuna.db")
    assert result.study_name.startswith(f"kg-{SPEC.key()}-select-triton-cpu-1024-")
    assert {job["backend"] for job in fake_worker.full_jobs} == {"triton"}
    assert {job["spec_json"] for job in fake_worker.full_jobs} == {SPEC.to_json()}
    [row] = db.rows()
    assert (row["backend"], row["role"], row["spec_key"]) == ("triton", "select", get_role("select").key(spec, "triton"))
    assert row["template_hash"] == TRITON.template_hash("select")


def test_interrupted_trial_is_requeued(tmp_path, db, fake_worker):
    fake_worker.interrupt_at = 2
    with pytest.raises(KeyboardInterrupt):
        run_tune(tmp_path, db, trials=4)
    interrupted = fake_worker.jobs[1]
    fake_worker.interrupt_at = None
    result = run_tune(tmp_path, db, trials=4)
    assert interrupted in fake_worker.jobs[2:]  # measured again on resume (after the seeds still queued)
    assert result.n_trials == 4 and result.n_failed == 0 and len(fake_worker.jobs) == 5


def test_a_claim_of_a_killed_tuner_on_this_host_is_measured_again(tmp_path, db, fake_worker):
    """A tuner killed mid-measurement (SIGKILL) leaves its trial RUNNING and claimed; where the claiming process was
    on this host and is gone, the next tune re-queues its config at once: measured, not counted as in flight."""
    first = run_tune(tmp_path, db, trials=2)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    study = optuna.load_study(study_name=first.study_name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    p = plan(SPEC, "attn", seq=SEQ, trials=3, device="cpu")
    config = next(c for c in p["space"] if c not in fake_worker.jobs)
    study.enqueue_trial(config)
    trial = study.ask()
    for field, values in p["params"].items():
        trial.suggest_categorical(field, values)
    trial.set_user_attr("claimed", f"{socket.gethostname()} pid {gone.pid} cpu")
    result = run_tune(tmp_path, db, trials=3)
    assert fake_worker.jobs[2:] == [config] and result.n_trials == 3
    study = optuna.load_study(study_name=first.study_name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert study.trials[trial.number].state == TrialState.FAIL  # given up, its config queued again


def test_study_of_another_toolchain_starts_over(tmp_path, db, fake_worker, monkeypatch):
    run_tune(tmp_path, db, trials=2)
    assert len(fake_worker.jobs) == 2
    real = study_module.tuning_db.current_fingerprint
    monkeypatch.setattr(study_module.tuning_db, "current_fingerprint",
                        lambda *args: real(*args).__class__(**{**real(*args).as_columns(), "triton_version": "x"}))
    result = run_tune(tmp_path, db, trials=2)
    assert len(fake_worker.jobs) == 4 and result.n_trials == 2


def test_tpe_seeds_cover_every_value_of_small_fields():
    from kernelgen.tuning.plan import config_key, seeds

    default = {"tiles": 64, "chunk": 128, "num_warps": 4, "splits": 1}
    choices = {"tiles": [1, 2, 4, 8, 16, 32, 64], "chunk": [16, 32, 64, 128, 256], "num_warps": [4, 8], "splits": [1, 2, 4]}
    points = [{"tiles": 64, "chunk": 128, "num_warps": w, "splits": n} for w in (4, 8) for n in (1, 2, 4)]
    feasible = {config_key(p) for p in points if p["splits"] != 4 or p["num_warps"] == 4}
    found = seeds(default, choices, feasible)
    assert seeds(default, choices, feasible, limit=2) == found[:2]
    assert found[0] == default
    # the neighbours along num_warps and splits, none along the wide fields; only feasible ones
    assert sorted((s["num_warps"], s["splits"]) for s in found[1:]) == [(4, 2), (4, 4), (8, 1)]
    assert all(s["tiles"] == 64 and s["chunk"] == 128 for s in found)
    assert config_key({"b": 1, "a": 2}) == config_key({"a": 2, "b": 1})
    assert seeds(default, choices, set()) == []  # nothing feasible: no seeds, not even the default


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")
def test_tilelang_precompile_point_compiles_or_reports(monkeypatch, nvcc_really_runs):
    """The tuner's precompile step (a process per config) builds the TileLang kernels of both shapes a
    trial runs, and returns the error of a config that cannot build instead of raising. nvcc needs no
    GPU: the arch a GPU would report is given."""
    from kernelgen.backends import tilelang as tilelang_backend

    monkeypatch.setattr(tilelang_backend, "target_arch", lambda device: "sm_90a")
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, causal=True, backend="tilelang", selector="given")
    shapes = ((1, 2, 300, 300), (1, 1, 1000, 1100))
    ok = worker_module._build_point(("tilelang", spec.to_json(), "attn", {"block_m": 64, "num_stages": 1,
                                     "threads": 128, "overlap": True}, shapes, "bfloat16", "cuda"))
    assert ok is None
    bad = worker_module._build_point(("tilelang", spec.to_json(), "attn", {"block_m": 48, "num_stages": 2,
                                      "threads": 128, "overlap": False}, shapes, "bfloat16", "cuda"))
    assert bad is not None and "block_M=48" in bad


def test_precompile_points_builds_both_shapes_of_each_point(monkeypatch):
    """precompile_points hands precompile one job per point with the two shapes of a trial (trial_shapes)."""
    assert worker_module.precompile([]) == (0.0, [])  # nothing to build: no process pool
    seen = []
    monkeypatch.setattr(worker_module, "precompile", lambda jobs: (seen.extend(jobs), (1.5, []))[1])
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, causal=True, backend="tilelang", selector="given")
    space = [{"block_m": 64, "num_stages": 1, "threads": 128, "overlap": o, "pingpong": False} for o in (False, True)]
    assert worker_module.precompile_points(TILELANG, spec, "attn", space, 16384, None, "cuda:0") == 1.5
    shapes = plan_module.trial_shapes(spec, 16384, False, None)
    assert seen == [("tilelang", spec.to_json(), "attn", p, shapes, "bfloat16", "cuda:0") for p in space]


def test_trial_shapes_are_what_the_worker_checks_and_times():
    """One place says which two shapes a trial runs (the TileLang precompile compiles exactly those)."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, selector="given")
    check, bench = plan_module.trial_shapes(spec, 32768, False, None)
    b, hq, hkv, nq, nk = tune_inputs_shape(spec, 32768)
    assert check == (1, plan_module.CHECK_HEADS_KV_GPU, plan_module.CHECK_MAX_SEQ_GPU, plan_module.CHECK_MAX_SEQ_GPU)
    assert bench == (b, hkv, nq, nk) and hq == hkv * 4
    workload = {"batch": 2, "heads_kv": 1, "n_q": 4096, "n_k": 16384}
    assert plan_module.trial_shapes(spec, 16384, False, workload)[1] == (2, 1, 4096, 16384)
    cpu_check, cpu_bench = plan_module.trial_shapes(spec, 16384, True, None)
    assert cpu_check == cpu_bench == (1, 1, plan_module.CPU_MAX_SEQ, plan_module.CPU_MAX_SEQ)


_TRIAL_SPECS = [Spec(**{"head_dim": 64, "kv_block": 32, "q_tile": 32, "top_k": 3, "causal": True, "gqa_group": 2,
                        "local": 1, "selector": selector, **extra})
                for selector in ("mean", "index") for extra in ({}, {"schedule": "kv_centric", "q_tile": 64})]


@pytest.mark.parametrize("spec, role", [(spec, role) for spec in _TRIAL_SPECS for role in tuned_roles(spec)],
                         ids=lambda x: x if isinstance(x, str) else f"{x.schedule}-{x.selector}")
def test_every_role_s_trial_passes_its_own_check(spec, role):
    """Each tuned role's trial, with the default config, against the float64 reference in the interpreter:
    the tuner's workload, its launch shapes and the kernels agree (a trial told the wrong shapes fails
    every config, and nothing is written)."""
    backend, kernel_spec = tuned_backend(spec, role)
    config = backend.default_config(kernel_spec, role, "cpu")
    assert check_config(backend, kernel_spec, role, config, 256, torch.float16, "cpu") is None

"""Tests for kernelgen.tune (CPU: the worker runs the Triton interpreter on tiny inputs; timings are
meaningless, the plumbing is what is checked). Some tests replace the worker process by a fake one
to check the study logic without compiling anything."""
from __future__ import annotations

import json
import shutil
import zlib

import optuna
import pytest
import torch
from optuna.trial import TrialState

import kernelgen.tune as tune_module
from kernelgen import Spec
from kernelgen.config import attn_feasible, config_from_dict, config_space, default_config
from kernelgen.db import TuningDB, Winners, current_fingerprint, seq_bucket
from kernelgen.render import template_hash
from kernelgen.tune import TuneResult, plan, tune, tune_inputs_shape

# 16 feasible attention configs; small enough for the interpreter to run a trial in well under a second
SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)
SEQ = 128


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """No test may touch the real user cache dir (the Optuna storage and the user DB default there)."""
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tune_module.SABOTAGE_ENV, raising=False)
    monkeypatch.delenv(tune_module.SABOTAGE_MODE_ENV, raising=False)


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.db") as tuning_db:
        yield tuning_db


def measured(storage, name):
    """(complete, failed) trials that measured a config, as tune() counts them."""
    return tune_module._measured(optuna.load_study(study_name=name, storage=f"sqlite:///{storage}"))


def run_tune(tmp_path, db, **kwargs):
    kwargs = {"role": "attn", "seq": SEQ, "trials": 3, "device": "cpu", "db": db,
              "storage": tmp_path / "optuna.db", **kwargs}
    return tune(SPEC, **kwargs)


class FakeWorker:
    """Stands in for the worker process: a deterministic time per config, no compile. Records jobs."""

    jobs: list = []
    interrupt_at: int | None = None

    def __init__(self, device):
        self.device = device

    def run(self, job, timeout):
        FakeWorker.jobs.append(job["params"])
        if FakeWorker.interrupt_at is not None and len(FakeWorker.jobs) == FakeWorker.interrupt_at:
            raise KeyboardInterrupt
        ms = 1.0 + zlib.crc32(json.dumps(job["params"], sort_keys=True).encode()) % 1000 / 100
        return "ok", {"ms": ms, "flops": 1e9}

    def close(self):
        pass


@pytest.fixture
def fake_worker(monkeypatch):
    FakeWorker.jobs = []
    FakeWorker.interrupt_at = None
    monkeypatch.setattr(tune_module, "_Worker", FakeWorker)
    return FakeWorker


# -- plan ------------------------------------------------------------------------------------------


def test_plan_attn():
    p = plan(SPEC, "attn", seq=5000, arch="sm_90", trials=3)
    assert p["bucket"] == seq_bucket(5000) == 8192
    assert p["study_name"] == f"kg-{SPEC.role_key('attn')}-attn-triton-sm_90-8192"
    assert p["space"] and p["space_size"] == len(p["space"]) == len(config_space(SPEC, "attn"))
    assert all(attn_feasible(SPEC, config_from_dict("attn", c)) for c in p["space"])
    assert p["sampler"] == "tpe" and p["trials"] == 3
    assert p["default"] == {"block_m": 64, "num_warps": 4, "num_stages": 2, "use_tma": False, "kv_per_iter": 1}
    assert set(p["params"]) == {"block_m", "num_warps", "num_stages", "use_tma", "kv_per_iter"}
    # timed at the bucket's size: every seq of a bucket shares one study
    assert p["shape"] == {"batch": 1, "heads_q": 32, "heads_kv": 16, "n_q": 8192, "n_k": 8192, "head_dim": 64}
    assert p["dtype"] == "bfloat16"
    n_space = len(config_space(SPEC, "attn"))
    assert plan(SPEC, "attn", seq=5000, arch="sm_90", trials=n_space)["sampler"] == "grid"
    json.dumps(p)  # plain data, fit for `kernelgen tune --dry-run`


def test_plan_fixed_restricts_the_space():
    full = plan(SPEC, "attn", seq=5000, arch="sm_90")["space"]
    sub = plan(SPEC, "attn", seq=5000, arch="sm_90", fixed={"use_tma": False, "kv_per_iter": 2})
    assert sub["space"] == [c for c in full if not c["use_tma"] and c["kv_per_iter"] == 2]
    assert 0 < sub["space_size"] < len(full) and sub["params"]["kv_per_iter"] == [2]
    with pytest.raises(ValueError, match="not attn config fields"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", fixed={"threads": 128})


def test_plan_shape_sets_the_timed_workload():
    p = plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 2, "heads_kv": 1, "n_q": 1000, "n_k": 5000})
    assert p["bucket"] == 8192
    assert p["shape"] == {"batch": 2, "heads_q": SPEC.gqa_group, "heads_kv": 1, "n_q": 1000, "n_k": 5000, "head_dim": 64}
    with pytest.raises(ValueError, match="outside the bucket"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 1, "heads_kv": 1, "n_q": 64, "n_k": 20000})
    with pytest.raises(ValueError, match="shape must map"):
        plan(SPEC, "attn", seq=5000, arch="sm_90", shape={"batch": 1, "heads_kv": 1, "n_q": 64})


def test_auto_backend_is_not_tuned():
    with pytest.raises(ValueError, match="served, not tuned: tune backend='triton', 'tilelang' and 'gluon'"):
        plan(SPEC.replace(backend="auto"), "attn", seq=5000, arch="sm_90")


def test_plan_gluon_attn():
    """The Gluon forward is tuned over its own space (rows and stages; the warps follow from the rows)."""
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, backend="gluon")
    p = plan(spec, "attn", seq=5000, arch="sm_90", trials=30)
    assert p["study_name"] == f"kg-{spec.role_key('attn')}-attn-gluon-sm_90-8192" and p["backend"] == "gluon"
    assert p["space"] == [{"block_m": m, "num_stages": s} for m in (64, 128) for s in (2, 3, 4)]
    assert p["default"] == {"block_m": 128, "num_stages": 3} and p["sampler"] == "grid"
    assert plan(spec, "select", seq=5000, arch="sm_90") == plan(spec.replace(backend="triton"), "select", seq=5000,
                                                                 arch="sm_90")  # the Triton selector's study


def test_gluon_is_tuned_on_hopper_only(tmp_path, db):
    """Off a Hopper GPU every Gluon trial would fail: tune says so before starting a study."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, backend="gluon", selector="given")
    with pytest.raises(ValueError, match=r"backend='gluon' runs on CUDA GPUs \(Hopper, sm_90\) only"):
        tune(spec, "attn", seq=SEQ, trials=2, device="cpu", db=db, storage=tmp_path / "optuna.db")
    assert db.rows() == [] and not (tmp_path / "optuna.db").exists()


@pytest.mark.parametrize("backend", ["tilelang", "auto"])
def test_selection_is_tuned_as_the_triton_twin(backend):
    """Every backend selects with the Triton kernels: one study and one DB row serve them all."""
    p = plan(SPEC.replace(backend=backend), "select", seq=5000, arch="sm_90")
    assert p == plan(SPEC, "select", seq=5000, arch="sm_90")
    assert p["spec_key"] == SPEC.replace(backend=backend).role_key("select") == SPEC.role_key("select")


def test_plan_select_and_cpu():
    p = plan(SPEC, "select", seq=1000, trials=1000, device="cpu")
    assert p["sampler"] == "grid" and p["trials"] == p["space_size"] > 0
    assert p["arch"] == "cpu" and p["dtype"] == "float16" and p["bucket"] == 1024
    assert p["shape"]["n_q"] == 256 and p["shape"]["heads_q"] == SPEC.gqa_group
    with pytest.raises(ValueError, match="selector='given'"):
        plan(SPEC.replace(selector="given"), "select", seq=1000)
    with pytest.raises(ValueError, match="role="):
        plan(SPEC, "bwd", seq=1000)


@pytest.mark.parametrize("g, heads", [(1, 32), (2, 32), (3, 33), (8, 32), (64, 64)])
def test_tune_inputs_shape(g, heads):
    spec = SPEC.replace(gqa_group=g)
    assert tune_inputs_shape(spec, 4096) == (1, heads, heads // g, 4096, 4096)
    assert tune_inputs_shape(spec, 4096, cpu=True) == (1, g, 1, 256, 256)


# -- errors before any work --------------------------------------------------------------------------


def test_no_cuda_needs_device_cpu(monkeypatch, tmp_path, db):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="tuning needs a CUDA GPU"):
        tune(SPEC, seq=SEQ, db=db, storage=tmp_path / "optuna.db")
    assert plan(SPEC, "attn", seq=SEQ)["study_name"] is None  # a dry run still works


def test_arch_mismatch(monkeypatch, tmp_path, db):
    with pytest.raises(ValueError, match="sm_90.*cpu"):
        run_tune(tmp_path, db, arch="sm_90")
    # a pretend sm_90 GPU, asked to tune for sm_80
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend H200")
    with pytest.raises(ValueError, match=r"arch='sm_80'.*Pretend H200 is sm_90"):
        tune(SPEC, seq=SEQ, arch="sm_80", db=db, storage=tmp_path / "optuna.db")
    assert not (tmp_path / "optuna.db").exists()


# -- real worker processes (interpreter) --------------------------------------------------------------


def test_tune_cpu_writes_one_winner(tmp_path, db):
    calls = []
    result = run_tune(tmp_path, db, progress=lambda *args: calls.append(args))
    assert isinstance(result, TuneResult)
    assert result.study_name == f"kg-{SPEC.role_key('attn')}-attn-triton-cpu-1024"
    assert (result.arch, result.gpu_name, result.dtype, result.bucket) == ("cpu", "cpu", "float16", 1024)
    assert result.n_trials == 3 and result.n_failed == 0
    assert result.best_ms > 0 and result.default_ms >= result.best_ms and result.tflops > 0
    assert "meaningless" in result.note
    assert [c[:2] for c in calls] == [(0, 3), (1, 3), (2, 3)] and all(c[2] > 0 for c in calls)
    space = [json.dumps(c.__dict__, sort_keys=True) for c in config_space(SPEC, "attn")]
    assert json.dumps(result.best_config, sort_keys=True) in space

    rows = db.rows()
    assert len(rows) == 1
    row = rows[0]
    assert row["config"] == result.best_config and row["median_ms"] == result.best_ms
    assert (row["role"], row["n_trials"], json.loads(row["spec_json"])) == ("attn", 3, SPEC.to_dict())
    fp = current_fingerprint(template_hash("triton", "attn"), "triton")
    found = Winners(db).lookup(spec_key=SPEC.role_key("attn"), role="attn", backend="triton", arch="cpu", gpu_name="cpu",
                               dtype="float16", bucket=seq_bucket(SEQ), fingerprint=fp)
    assert found["config"] == result.best_config and found["source"] == "user"
    # the first trial was the default config (TPE is seeded with it)
    complete, _ = measured(tmp_path / "optuna.db", result.study_name)
    first = min(complete, key=lambda t: t.number)
    assert first.params == default_config(SPEC, "attn").__dict__ and first.value == result.default_ms


HANG_TIMEOUT_S = 20


@pytest.mark.parametrize("mode, error", [
    ("raise", "RuntimeError: sabotaged"),  # an exception in the worker (e.g. a CUDA error)
    ("exit", "died measuring (exit code 3)"),  # the process dies (e.g. a segfault)
    ("hang", f"timed out after {HANG_TIMEOUT_S} s measuring"),  # the process hangs past the per-trial timeout
])
def test_failing_trial_is_recorded_and_the_study_goes_on(tmp_path, db, monkeypatch, mode, error):
    # the default config (trial 0) fails; the next trials run in a fresh worker process
    monkeypatch.setenv(tune_module.SABOTAGE_ENV, json.dumps(default_config(SPEC, "attn").__dict__))
    monkeypatch.setenv(tune_module.SABOTAGE_MODE_ENV, mode)
    # the healthy trials must fit the timeout too, also on a loaded machine (tests run in parallel):
    # a short one only where the hang is what is tested
    result = run_tune(tmp_path, db, trial_timeout=HANG_TIMEOUT_S if mode == "hang" else 300)
    assert result.n_failed == 1 and result.n_trials == 2  # failures count toward `trials`
    assert result.default_ms is None and result.best_config != default_config(SPEC, "attn").__dict__
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
    monkeypatch.setattr(tune_module._Worker, "_start", lambda self: pytest.fail("a worker was started"))
    third = run_tune(tmp_path, db, trials=3)
    assert third.n_trials == 3 and third.best_ms == min(t.value for t in after)
    assert len(db.rows()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the interpreter in this process")
def test_worker_checks_against_the_reference():
    job = {"spec_json": SPEC.to_json(), "seq": SEQ, "device": "cpu"}
    cache = {}
    attn = {**job, "role": "attn", "params": {"block_m": 32, "num_warps": 4, "num_stages": 1}}
    assert tune_module._measure(attn, cache)["ms"] > 0
    inputs = next(iter(cache.values()))
    inputs.ref_o = inputs.ref_o * 1.1  # as if the kernel computed something else
    with pytest.raises(tune_module._Rejected, match="rel. L2 error"):
        tune_module._measure(attn, cache)

    select = {**job, "role": "select", "params": {"tiles": 8, "chunk": 16, "num_warps": 4, "num_stages": 1}}
    assert tune_module._measure(select, cache)["flops"] is None
    q, k, _ = inputs.check
    lists = inputs.default_lists
    assert tune_module._valid_top_k(lists, q, k, SPEC)
    inputs.default_lists = torch.full_like(lists, -1)  # other lists than the default's: a valid top-k still passes
    tune_module._measure(select, cache)
    assert not tune_module._valid_top_k(inputs.default_lists, q, k, SPEC)  # forced blocks missing


# -- the study logic, with a fake worker ---------------------------------------------------------------


def test_grid_measures_each_feasible_point_once(tmp_path, db, fake_worker):
    # head_dim 256, kv_block 128: registers and shared memory make some products of the choices infeasible
    spec = Spec(head_dim=256, kv_block=128, q_tile=64, top_k=2, gqa_group=2)
    space = [c.__dict__ for c in config_space(spec, "attn")]
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


def test_interrupted_trial_is_requeued(tmp_path, db, fake_worker):
    fake_worker.interrupt_at = 2
    with pytest.raises(KeyboardInterrupt):
        run_tune(tmp_path, db, trials=4)
    interrupted = fake_worker.jobs[1]
    fake_worker.interrupt_at = None
    result = run_tune(tmp_path, db, trials=4)
    assert interrupted in fake_worker.jobs[2:]  # measured again on resume (after the seeds still queued)
    assert result.n_trials == 4 and result.n_failed == 0 and len(fake_worker.jobs) == 5


def test_study_of_another_toolchain_starts_over(tmp_path, db, fake_worker, monkeypatch):
    run_tune(tmp_path, db, trials=2)
    assert len(fake_worker.jobs) == 2
    real = tune_module.tuning_db.current_fingerprint
    monkeypatch.setattr(tune_module.tuning_db, "current_fingerprint",
                        lambda *args: real(*args).__class__(**{**real(*args).as_columns(), "triton_version": "x"}))
    result = run_tune(tmp_path, db, trials=2)
    assert len(fake_worker.jobs) == 4 and result.n_trials == 2


def test_tpe_seeds_cover_every_value_of_small_fields():
    from kernelgen.tune import _config_key, _seeds

    default = {"tiles": 64, "chunk": 128, "num_warps": 4, "splits": 1}
    choices = {"tiles": [1, 2, 4, 8, 16, 32, 64], "chunk": [16, 32, 64, 128, 256], "num_warps": [4, 8], "splits": [1, 2, 4]}
    points = [{"tiles": 64, "chunk": 128, "num_warps": w, "splits": n} for w in (4, 8) for n in (1, 2, 4)]
    feasible = {_config_key(p) for p in points if p["splits"] != 4 or p["num_warps"] == 4}
    seeds = _seeds(default, choices, feasible)
    assert _seeds(default, choices, feasible, limit=2) == seeds[:2]
    assert seeds[0] == default
    # the neighbours along num_warps and splits, none along the wide fields; only feasible ones
    assert sorted((s["num_warps"], s["splits"]) for s in seeds[1:]) == [(4, 2), (4, 4), (8, 1)]
    assert all(s["tiles"] == 64 and s["chunk"] == 128 for s in seeds)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_tilelang_precompile_point_compiles_or_reports():
    """The tuner's TileLang precompile step (a process per config) builds the kernels of both shapes a
    trial runs, and returns the error of a config that cannot build instead of raising."""
    pytest.importorskip("tilelang")
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, causal=True, backend="tilelang", selector="given")
    shapes = ((1, 2, 300, 300), (1, 1, 1000, 1100))
    ok = tune_module._compile_tilelang_point((spec.to_json(), {"block_m": 64, "num_stages": 1, "threads": 128,
                                                                "overlap": True}, shapes, "sm_90a"))
    assert ok is None
    bad = tune_module._compile_tilelang_point((spec.to_json(), {"block_m": 48, "num_stages": 2, "threads": 128,
                                                                 "overlap": False}, shapes, "sm_90a"))
    assert bad is not None and "block_M=48" in bad


def test_trial_shapes_are_what_the_worker_checks_and_times():
    """One place says which two shapes a trial runs (the TileLang precompile compiles exactly those)."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, selector="given")
    check, bench = tune_module._trial_shapes(spec, 32768, False, None)
    b, hq, hkv, nq, nk = tune_inputs_shape(spec, 32768)
    assert check == (1, tune_module.CHECK_HEADS_KV_GPU, tune_module.CHECK_MAX_SEQ_GPU, tune_module.CHECK_MAX_SEQ_GPU)
    assert bench == (b, hkv, nq, nk) and hq == hkv * 4
    workload = {"batch": 2, "heads_kv": 1, "n_q": 4096, "n_k": 16384}
    assert tune_module._trial_shapes(spec, 16384, False, workload)[1] == (2, 1, 4096, 16384)
    cpu_check, cpu_bench = tune_module._trial_shapes(spec, 16384, True, None)
    assert cpu_check == cpu_bench == (1, 1, tune_module.CPU_MAX_SEQ, tune_module.CPU_MAX_SEQ)

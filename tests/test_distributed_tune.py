"""Tuning one study from several processes (CPU): `tune(workers=N)` and tuners that share a `storage`.

Stand-in measurements (a deterministic time per config, a short sleep, a line in a shared log) stand for
the GPU in the processes that share a journal file; `workers=2` itself runs the Triton interpreter at a
tiny size."""
from __future__ import annotations

import collections
import json
import multiprocessing
import os
import threading
import time
import zlib

import optuna
import pytest
import torch
from optuna.trial import TrialState

from kernelgen import KernelgenRuntimeError, KernelgenValueError, Spec
from kernelgen.tuning import plan, tune
from kernelgen.tuning import study as study_module
from kernelgen.tuning.db import TuningDB
from kernelgen.tuning.plan import config_key
from kernelgen.tuning.storage import open_storage, parse_storage

SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)  # 72 attn configs on the CPU
SEQ = 32
STAND_IN_LOG = "KERNELGEN_TEST_STAND_IN_LOG"


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))


def stand_in_ms(params: dict) -> float:
    return 1.0 + zlib.crc32(config_key(params).encode()) % 1000 / 100


class StandInWorker:
    """The measurement process's stand-in: a time per config, after a sleep that lets the other process's
    trials overlap; each measurement appended to the log file named by $KERNELGEN_TEST_STAND_IN_LOG."""

    def __init__(self, device):
        self.device = device

    def run(self, job, timeout):
        with open(os.environ[STAND_IN_LOG], "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "role": job["role"], "config": config_key(job["params"])}) + "\n")
        time.sleep(0.1)
        return "ok", {"ms": stand_in_ms(job["params"]), "flops": 1e9}

    def close(self):
        pass


def _tune_in_a_process(cache_dir, log_path, storage, db_path, studies, start, results):
    """A tuner of its own (as on another host): the same studies, the same storage and DB file."""
    os.environ["KERNELGEN_CACHE_DIR"] = cache_dir
    os.environ[STAND_IN_LOG] = log_path
    study_module.Worker = StandInWorker
    # the same random sampler in both: they propose the same configs at the same time, as two hosts' TPE
    # samplers would now and then (TPE's constant liar makes it rare, not impossible)
    grid_or_tpe = study_module._SearchJob.new_sampler
    study_module._SearchJob.new_sampler = lambda job: (optuna.samplers.RandomSampler(seed=0) if job.sampler == "tpe"
                                                        else grid_or_tpe(job))
    start.wait()
    with TuningDB(db_path) as db:
        found = {role: tune(SPEC, role, seq=SEQ, trials=trials, fixed=fixed, device="cpu", storage=storage, db=db)
                 for role, (trials, fixed) in studies.items()}
    results.put({role: (r.study_name, r.best_ms, r.n_trials) for role, r in found.items()})


def _measurements(log_path):
    with open(log_path) as log:
        return [json.loads(line) for line in log]


def test_two_processes_share_a_journal_study(tmp_path):
    """Two tuners on one journal file: the attention's study (its budget below its space; both samplers
    propose the same configs) and the selector's grid. Each config is measured once, the budget holds, both
    tuners measure, and the DB both merge into holds each study's fastest."""
    storage = f"journal://{tmp_path / 'study.log'}"
    log_path, db_path = str(tmp_path / "measured.jsonl"), tmp_path / "tuning.db"
    select_fixed = {"num_warps": 4, "num_stages": 1}
    select_space = plan(SPEC, "select", seq=SEQ, device="cpu", fixed=select_fixed)["space_size"]
    studies = {"attn": (12, None), "select": (select_space, select_fixed)}
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_tune_in_a_process, args=(str(tmp_path / "cache"), log_path, storage, str(db_path),
                                                          studies, start, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    found = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0

    measurements = _measurements(log_path)
    assert len({m["pid"] for m in measurements}) == 2  # both tuners measured
    with TuningDB(db_path) as db:
        rows = {row["role"]: row for row in db.rows()}
    assert sorted(rows) == ["attn", "select"]
    for role, (trials, _) in studies.items():
        configs = [m["config"] for m in measurements if m["role"] == role]
        assert len(configs) == len(set(configs)) == trials, role  # no config twice, exactly the budget
        name = found[0][role][0]
        assert found[1][role][0] == name  # one study
        study = optuna.load_study(study_name=name, storage=open_storage(parse_storage(storage)))
        complete, failed = study_module._measured(study)
        assert not failed and sorted(config_key(t.params) for t in complete) == sorted(configs)
        assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
        pruned = collections.Counter(t.user_attrs.get("pruned", "").split(" ")[0]
                                     for t in study.get_trials(states=(TrialState.PRUNED,)))
        assert set(pruned) <= {"infeasible", "measured", "budget", "failed"}, pruned
        # each tuner merged the study's winner as it saw it at its end; the DB kept the fastest
        best = min(complete, key=lambda t: t.value)
        assert rows[role]["median_ms"] == best.value == min(r[role][1] for r in found)
        assert rows[role]["config"] == best.params and rows[role]["n_trials"] in {r[role][2] for r in found}


def test_tune_workers_2_on_the_interpreter(tmp_path):
    """`workers=2` without a storage: two worker processes on the cache dir's journal file, each measuring
    in an interpreter process of its own; the tuning process writes the fastest to the DB."""
    calls = []
    with TuningDB(tmp_path / "tuning.db") as db:
        result = tune(SPEC, "attn", seq=SEQ, trials=3, device="cpu", workers=2, db=db,
                      progress=lambda *args: calls.append(args))
        [row] = db.rows()
    assert result.n_trials == 3 and result.n_failed == 0
    assert [c[:2] for c in calls] == [(i, 3) for i in range(3)]
    study = optuna.load_study(study_name=result.study_name,
                              storage=open_storage(parse_storage(f"journal://{tmp_path / 'cache' / 'optuna-journal.log'}")))
    complete, _ = study_module._measured(study)
    assert len({config_key(t.params) for t in complete}) == len(complete) == 3
    assert all("claimed" in t.user_attrs for t in complete)
    assert row["config"] == result.best_config == min(complete, key=lambda t: t.value).params
    assert row["median_ms"] == result.best_ms and result.default_ms is not None


def test_a_trial_decides_after_every_earlier_trial(tmp_path):
    """Claims are decided in trial order: a trial waits while an earlier one has not claimed, then gives up
    the config the earlier one measures; past the budget, a trial gives up."""
    study = optuna.create_study(study_name="s", storage=open_storage(parse_storage(f"journal://{tmp_path / 's.log'}")))
    params = {"block_m": 64}
    job = study_module._SearchJob(name="s", storage=None, sampler="tpe", choices={"block_m": [32, 64]},
                                  feasible=frozenset({config_key(params)}), trials=1, seed=0, timeout=None,
                                  trial_timeout=60.0, job={}, device="cpu")
    search = study_module._Search(job, study, worker=None)
    for _ in range(3):
        study.enqueue_trial(params)
    first, second = study.ask(), study.ask()
    for trial in (first, second):
        trial.suggest_categorical("block_m", [32, 64])
    verdicts = []

    def decide():
        try:
            verdicts.append(search._claim(second, config_key(params)))
        except optuna.TrialPruned as pruned:
            verdicts.append(str(pruned))

    later = threading.Thread(target=decide)
    later.start()
    time.sleep(0.5)
    assert later.is_alive() and verdicts == []  # the first trial has not claimed yet
    assert search._claim(first, config_key(params)) is None  # claimed: measure it
    later.join(5.0)
    assert verdicts == [f"{config_key(params)} is being measured by trial 0"]
    study.tell(second, state=TrialState.PRUNED)
    third = study.ask()
    third.suggest_categorical("block_m", [32, 64])
    with pytest.raises(optuna.TrialPruned, match="1 configs are measured or being measured"):
        search._claim(third, config_key({"block_m": 32}))
    study.tell(third, state=TrialState.PRUNED)
    study.tell(first, 1.0)
    fourth = study.ask()
    fourth.suggest_categorical("block_m", [32, 64])
    assert search._claim(fourth, config_key(params)) == 1.0  # measured: its stored time
    assert fourth.user_attrs["duplicate_of"] == 0


def test_workers_must_be_a_count_of_gpus_present(tmp_path, monkeypatch):
    with TuningDB(tmp_path / "tuning.db") as db:
        for workers in (0, -1, True, 1.5):
            with pytest.raises(KernelgenValueError, match="workers must be an int >= 1"):
                tune(SPEC, seq=SEQ, device="cpu", workers=workers, db=db)
        with pytest.raises(KernelgenValueError, match="pass storage as a URL or path"):
            tune(SPEC, seq=SEQ, device="cpu", workers=2, db=db, storage=optuna.storages.InMemoryStorage())
        with pytest.raises(KernelgenValueError, match="not a URL"):
            tune(SPEC, seq=SEQ, device="cpu", workers=2, db=db, storage="sqlite:/x.db")
        # a pretend machine with one H200
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(study_module, "_resolve_device", lambda device, arch: ("cuda:0", "sm_90", "Pretend H200"))
        with pytest.raises(KernelgenValueError, match="workers=2, but 1 CUDA GPU is visible here"):
            tune(SPEC, seq=SEQ, workers=2, db=db)
        with pytest.raises(KernelgenValueError, match="names one GPU"):
            tune(SPEC, seq=SEQ, workers=2, device="cuda:1", db=db)
        assert db.rows() == []
    assert not (tmp_path / "cache").exists()  # no storage was made


@pytest.mark.parametrize("url, kind, target", [
    ("journal:///tmp/x/study.log", "journal", "journal:///tmp/x/study.log"),
    ("sqlite:////tmp/x/optuna.db", "rdb", "sqlite:////tmp/x/optuna.db"),
    ("/tmp/x/optuna.db", "rdb", "sqlite:////tmp/x/optuna.db"),
    ("postgresql://tuner@db.example/kernelgen", "rdb", "postgresql://tuner@db.example/kernelgen"),
])
def test_storage_urls(url, kind, target):
    parsed = parse_storage(url)
    assert (parsed.kind, str(parsed)) == (kind, target)


@pytest.mark.parametrize("url, words", [
    ("", "empty"),
    ("journal://", "names no journal file"),
    ("sqlite:/x.db", "not a URL"),
    ("sqlite://", "names no SQLite file"),
    ("sqlite:///:memory:", "in-memory"),
    ("banana://host/db", "unknown scheme 'banana'"),
    ("postgresql://user@host:port/db", "is not a database URL"),
    ("postgresql://user@host", "names no database"),
])
def test_malformed_storage_urls(url, words):
    with pytest.raises(KernelgenValueError, match=words):
        parse_storage(url)


def test_a_journal_storage_opens_and_a_missing_driver_is_named(tmp_path):
    storage = open_storage(parse_storage(f"journal://{tmp_path / 'a' / 'study.log'}"))
    optuna.create_study(study_name="s", storage=storage)
    assert (tmp_path / "a" / "study.log").is_file()
    with pytest.raises((KernelgenValueError, KernelgenRuntimeError), match="storage mysql://"):
        open_storage(parse_storage("mysql://user@127.0.0.1:1/kernelgen"))


def test_a_storage_that_cannot_be_opened_is_named(tmp_path):
    """A journal that holds something else, or a storage whose directory cannot be made: one error naming the
    storage (not a bare JSONDecodeError or FileNotFoundError)."""
    other = tmp_path / "notes.txt"
    other.write_text("not a journal\nat all\n")
    with pytest.raises(KernelgenValueError, match=f"storage journal://{other} is not an Optuna journal file"):
        open_storage(parse_storage(f"journal://{other}"))
    for lines in ('{"level": "info", "msg": "a server log"}\n', '{"op_code": 99}\n'):  # JSON, no Optuna operations
        other.write_text(lines)
        with pytest.raises(KernelgenValueError, match=f"storage journal://{other} is not an Optuna journal file"):
            open_storage(parse_storage(f"journal://{other}"))
    (tmp_path / "file").write_text("")
    for url in (f"journal://{tmp_path / 'file' / 'study.log'}", f"sqlite:///{tmp_path / 'file' / 'optuna.db'}"):
        with pytest.raises(KernelgenRuntimeError, match=f"storage {url} cannot be opened"):
            open_storage(parse_storage(url))


def test_a_storage_of_another_optuna_schema_is_named(tmp_path):
    """An SQLite storage whose tables another Optuna version set up: one error naming the storage (Optuna's own is
    a bare RuntimeError, a traceback from `kernelgen tune`)."""
    import sqlite3

    path = tmp_path / "optuna.db"
    open_storage(parse_storage(path)).engine.dispose()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'v99.0.0'")
    conn.close()
    with pytest.raises(KernelgenRuntimeError, match=f"storage sqlite:///{path} cannot be opened: .*optuna"):
        open_storage(parse_storage(path))


def test_a_journal_cut_off_mid_append_keeps_its_studies(tmp_path):
    """A tuner killed while appending leaves a last line without its newline. The next tune's first append would
    join it and make the journal unreadable (every study in it); instead the torn line is cut off when the
    storage opens and before each append (a tuner that opened it earlier), and the complete trials stay."""
    path = tmp_path / "study.log"
    url = parse_storage(f"journal://{path}")
    optuna.create_study(study_name="s", storage=open_storage(url)).optimize(
        lambda trial: trial.suggest_int("x", 0, 9), n_trials=3)
    whole = path.read_bytes()
    with open(path, "ab") as journal:
        journal.write(b'{"op_code":5,"worker_id":"gone","trial_id":3,"sta')
    study = optuna.load_study(study_name="s", storage=open_storage(url))
    study.optimize(lambda trial: trial.suggest_int("x", 0, 9), n_trials=2)
    assert path.read_bytes().startswith(whole)
    study = optuna.load_study(study_name="s", storage=open_storage(url))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    live = optuna.load_study(study_name="s", storage=open_storage(url))  # opened before the next tear
    with open(path, "ab") as journal:
        journal.write(b'{"op_code":5,"worker_id":"gone","trial_id":5,"sta')
    live.optimize(lambda trial: trial.suggest_int("x", 0, 9), n_trials=2)  # its appends cut the torn line first
    study = optuna.load_study(study_name="s", storage=open_storage(url))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 7
    text = tmp_path / "notes.txt"  # not a journal: left as it is, whatever its last line
    text.write_text("not a journal")
    open_storage(parse_storage(f"journal://{text}"))
    assert text.read_text() == "not a journal"


def test_a_new_sqlite_storage_opened_by_processes_at_once(tmp_path, monkeypatch):
    """Processes that create a new storage's tables at once: those that lose the race (the version row already
    written: an IntegrityError; a table already made) open it again, and a tune goes on."""
    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    made, raced = optuna.storages.RDBStorage, iter([
        IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE constraint failed")),
        OperationalError("CREATE TABLE studies", {}, Exception("table studies already exists"))])

    def racing(*args, **kwargs):
        error = next(raced, None)
        if error is not None:
            made(*args, **kwargs)  # the winner's tables
            raise error
        return made(*args, **kwargs)

    def unreachable(*args, **kwargs):
        raise OperationalError("connect", {}, Exception("unable to open database file"))

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    storage = open_storage(parse_storage(f"sqlite:///{tmp_path / 'optuna.db'}"))
    monkeypatch.setattr(optuna.storages, "RDBStorage", unreachable)
    with pytest.raises(KernelgenRuntimeError, match="cannot be opened: .*unable to open database file"):
        open_storage(parse_storage(f"sqlite:///{tmp_path / 'other.db'}"))  # no race: said at once
    monkeypatch.setattr(optuna.storages, "RDBStorage", made)
    assert optuna.create_study(study_name="s", storage=storage).study_name == "s"

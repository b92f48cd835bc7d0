"""Tests for kernelgen.tuning.db: the tuning database (CPU only, no GPU needed)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import sqlite3
import subprocess
import sys

import pytest
from checks import read_only

from kernelgen import KernelgenRuntimeError, backends
from kernelgen.tuning.db import (
    BUNDLED_DB_PATH,
    Fingerprint,
    TuningDB,
    UnreadableDatabase,
    Winners,
    current_fingerprint,
    default_user_db_path,
    rows_of_file,
    seq_bucket,
    write_bundled_db,
)

FP = Fingerprint(
    kernelgen_version="0.1.0",
    template_hash="t0",
    triton_version="3.2.0",
    tilelang_version=None,
    torch_version="2.5.0",
    cuda_version="12.4",
)
KEY = dict(spec_key="spec-a", role="fwd", backend="triton", arch="sm_90", gpu_name="NVIDIA H200",
           dtype="bf16")
N_PROCESSES = 8
UPSERTS_PER_PROCESS = 50


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """No test may touch the real user cache dir."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(cache_dir))
    return cache_dir


@pytest.fixture
def db(tmp_path):
    with TuningDB(tmp_path / "tuning.db") as tuning_db:
        yield tuning_db


def upsert(db: TuningDB, *, bucket=2048, config=None, median_ms=1.0, fingerprint=FP, **key_overrides):
    db.upsert(**{**KEY, **key_overrides}, bucket=bucket, config=config or {"BLOCK_M": 64},
              median_ms=median_ms, tflops=100.0, n_trials=8, fingerprint=fingerprint)


def lookup(db, *, bucket=2048, fingerprint=FP, **key_overrides):
    return db.lookup(**{**KEY, **key_overrides}, bucket=bucket, fingerprint=fingerprint)


# -- buckets and fingerprints ------------------------------------------------------------------------

@pytest.mark.parametrize("n, bucket", [(0, 1024), (1, 1024), (1000, 1024), (1024, 1024), (1025, 2048),
                                       (4096, 4096), (5000, 8192), (131072, 131072)])
def test_seq_bucket(n, bucket):
    assert seq_bucket(n) == bucket


def test_seq_bucket_rejects_negative():
    with pytest.raises(ValueError, match=">= 0"):
        seq_bucket(-1)


def test_current_fingerprint_never_raises_and_names_only_the_backend_compiler():
    triton = backends.get("triton")
    triton_fp = current_fingerprint(triton, "attn")
    assert triton_fp.template_hash == triton.template_hash("attn")
    assert len(triton_fp.template_hash) == 16 and int(triton_fp.template_hash, 16) >= 0  # sha256 prefix
    assert triton_fp.kernelgen_version  # installed version, or "0+unknown" in a bare checkout
    assert triton_fp.tilelang_version is None
    tilelang_fp = current_fingerprint(backends.get("tilelang"), "attn")
    assert tilelang_fp.triton_version is None
    assert tilelang_fp.template_hash == backends.get("tilelang").template_hash("attn")
    gluon_fp = current_fingerprint(backends.get("gluon"), "attn")  # Gluon is Triton's dialect: its version matters
    assert gluon_fp.triton_version == triton_fp.triton_version is not None and gluon_fp.tilelang_version is None
    assert gluon_fp.template_hash != triton_fp.template_hash  # each backend's own template


def test_current_fingerprint_holds_the_role_s_template():
    """Each role's winners are tied to its own template: the selector's and the forward's differ."""
    triton = backends.get("triton")
    attn, select = current_fingerprint(triton, "attn"), current_fingerprint(triton, "select")
    assert select.template_hash == triton.template_hash("select") != attn.template_hash
    assert {**attn.as_columns(), "template_hash": None} == {**select.as_columns(), "template_hash": None}


def test_current_fingerprint_of_a_plug_in_without_compilers():
    """A backend that names no compiler records none (and its template-less role hashes to "none")."""

    class NoCompiler(backends.Backend):
        name = "no-compiler"
        roles = {"attn": backends.RoleImpl(launch=lambda *args: None)}

    fp = current_fingerprint(NoCompiler(), "attn")
    assert (fp.template_hash, fp.triton_version, fp.tilelang_version) == ("none", None, None)
    assert fp.torch_version and fp.kernelgen_version


def test_default_path_follows_env(isolated_cache_dir):
    assert default_user_db_path() == isolated_cache_dir / "tuning.db"
    with TuningDB() as default_db:
        assert default_db.path == isolated_cache_dir / "tuning.db"
        assert default_db.path.exists()


# -- one process --------------------------------------------------------------------------------------

def test_round_trip(db):
    db.upsert(**KEY, bucket=4096, config={"BLOCK_M": 128, "num_warps": 8, "stages": [2, 3]},
              median_ms=0.5, tflops=None, n_trials=12, fingerprint=FP, spec_json='{"head_dim": 128}')
    row = lookup(db, bucket=4096)
    assert row["config"] == {"BLOCK_M": 128, "num_warps": 8, "stages": [2, 3]}
    assert (row["median_ms"], row["tflops"], row["n_trials"]) == (0.5, None, 12)
    assert row["spec_json"] == '{"head_dim": 128}'
    assert Fingerprint.from_row(row) == FP
    assert row["timestamp"].endswith("+00:00")
    assert {k: row[k] for k in KEY} == KEY and row["bucket"] == 4096
    # Stored as JSON text, readable without kernelgen.
    with contextlib.closing(sqlite3.connect(db.path)) as conn:
        raw = conn.execute("SELECT config FROM winners").fetchone()[0]
    assert raw == '{"BLOCK_M": 128, "num_warps": 8, "stages": [2, 3]}'


def test_faster_row_wins(db):
    upsert(db, config={"BLOCK_M": 64}, median_ms=2.0)
    upsert(db, config={"BLOCK_M": 128}, median_ms=1.0)
    upsert(db, config={"BLOCK_M": 32}, median_ms=3.0)
    [row] = db.rows()
    assert row["config"] == {"BLOCK_M": 128} and row["median_ms"] == 1.0


def test_new_fingerprint_replaces_even_a_faster_row(db):
    upsert(db, config={"BLOCK_M": 64}, median_ms=1.0)
    new_fp = Fingerprint(**{**FP.as_columns(), "triton_version": "3.3.0"})
    upsert(db, config={"BLOCK_M": 128}, median_ms=5.0, fingerprint=new_fp)
    [row] = db.rows()
    assert row["config"] == {"BLOCK_M": 128} and Fingerprint.from_row(row) == new_fp


@pytest.mark.parametrize("field", ["template_hash", "triton_version", "tilelang_version"])
def test_a_mismatch_of_what_generates_the_kernel_is_a_miss(db, field):
    upsert(db)
    other = Fingerprint(**{**FP.as_columns(), field: "something else"})
    assert lookup(db, fingerprint=other) is None
    assert lookup(db)["soft_mismatch"] == ()


@pytest.mark.parametrize("field", ["kernelgen_version", "torch_version", "cuda_version"])
def test_a_mismatch_of_the_runtime_is_served_and_named(db, field):
    upsert(db)
    other = Fingerprint(**{**FP.as_columns(), field: "something else"})
    row = lookup(db, fingerprint=other)
    assert row["config"] == {"BLOCK_M": 64} and row["soft_mismatch"] == (field,)
    assert db.servable(other, role=KEY["role"])[0]["soft_mismatch"] == (field,)


def test_nearest_bucket(db):
    for bucket in (1024, 4096, 16384):
        upsert(db, bucket=bucket, config={"tuned_for": bucket})
    assert lookup(db, bucket=4096)["config"] == {"tuned_for": 4096}  # exact
    assert lookup(db, bucket=8192)["config"] == {"tuned_for": 16384}  # one step either way: larger
    assert lookup(db, bucket=32768)["config"] == {"tuned_for": 16384}
    assert lookup(db, bucket=512)["config"] == {"tuned_for": 1024}
    assert lookup(db, bucket=2048)["config"] == {"tuned_for": 4096}  # tie between 1024 and 4096


def test_nearest_bucket_prefers_closer_then_larger(db):
    upsert(db, bucket=1024, config={"tuned_for": 1024})
    upsert(db, bucket=16384, config={"tuned_for": 16384})
    assert lookup(db, bucket=2048)["config"] == {"tuned_for": 1024}  # 1 step vs 3 steps
    assert lookup(db, bucket=4096)["config"] == {"tuned_for": 16384}  # 2 vs 2: the larger bucket
    assert lookup(db, bucket=4096, spec_key="another spec") is None


def test_stale_exact_bucket_does_not_shadow_fresh_neighbour(db):
    stale = Fingerprint(**{**FP.as_columns(), "template_hash": "old"})
    upsert(db, bucket=4096, config={"stale": True}, fingerprint=stale)
    upsert(db, bucket=8192, config={"stale": False})
    assert lookup(db, bucket=4096)["config"] == {"stale": False}


def test_rows_and_clear_filters(db):
    upsert(db, role="fwd")
    upsert(db, role="bwd")
    upsert(db, role="fwd", gpu_name="NVIDIA H100")
    assert len(db.rows()) == 3
    assert {row["gpu_name"] for row in db.rows(role="fwd")} == {"NVIDIA H200", "NVIDIA H100"}
    assert len(db.rows(fingerprint=FP, role="bwd")) == 1
    with pytest.raises(ValueError, match="cannot filter"):
        db.rows(no_such_column=1)
    assert db.clear(role="fwd") == 2
    assert [row["role"] for row in db.rows()] == ["bwd"]
    assert db.clear() == 1 and db.rows() == []


def test_rejects_nan_time(db):
    with pytest.raises(ValueError, match="median_ms"):
        upsert(db, median_ms=float("nan"))


# -- several processes ---------------------------------------------------------------------------------

def _same_key_time(worker, i):
    # Distinct for every (worker, i), and every worker keeps improving, so the winner changes hands
    # many times while the others write; the fastest of all is worker 0's last.
    return 1.0 + (UPSERTS_PER_PROCESS - 1 - i) * N_PROCESSES + worker


def _hammer(distinct_keys_path, same_key_path, worker, barrier):
    """One tuning process: its own TuningDB per file, started together with the others."""
    distinct_keys_db = TuningDB(distinct_keys_path)
    same_key_db = TuningDB(same_key_path)
    barrier.wait(timeout=60)  # a worker that died before this point fails the test, not hangs it
    for i in range(UPSERTS_PER_PROCESS):
        upsert(distinct_keys_db, spec_key=f"spec-{worker}-{i}", median_ms=1.0 + i)
        upsert(same_key_db, config={"worker": worker, "i": i}, median_ms=_same_key_time(worker, i))


@pytest.fixture(scope="module")
def hammered_dbs(tmp_path_factory):
    """8 spawned processes x 50 upserts into two shared files: distinct keys into one, a single key
    into the other. Both scenarios share one set of processes: spawning (and importing torch in
    each) costs more than the upserts."""
    tmp_path = tmp_path_factory.mktemp("concurrent")
    paths = tmp_path / "distinct_keys.db", tmp_path / "same_key.db"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(N_PROCESSES)
    processes = [context.Process(target=_hammer, args=(*paths, worker, barrier))
                 for worker in range(N_PROCESSES)]
    # This fixture runs before the per-test cache-dir fixture; the children inherit this one instead.
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
        for process in processes:
            process.start()
    for process in processes:
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
    assert [process.exitcode for process in processes] == [0] * N_PROCESSES
    return paths


def test_concurrent_upserts_with_distinct_keys_lose_nothing(hammered_dbs):
    with TuningDB(hammered_dbs[0]) as tuning_db:
        rows = tuning_db.rows()
    assert len(rows) == N_PROCESSES * UPSERTS_PER_PROCESS
    assert {row["spec_key"] for row in rows} == {
        f"spec-{w}-{i}" for w in range(N_PROCESSES) for i in range(UPSERTS_PER_PROCESS)}
    assert all(row["median_ms"] == 1.0 + int(row["spec_key"].rsplit("-", 1)[1]) for row in rows)


def test_concurrent_upserts_to_one_key_keep_the_fastest(hammered_dbs):
    fastest = min(_same_key_time(w, i) for w in range(N_PROCESSES) for i in range(UPSERTS_PER_PROCESS))
    with TuningDB(hammered_dbs[1]) as tuning_db:
        [row] = tuning_db.rows()
    assert row["median_ms"] == fastest
    assert row["config"] == {"worker": 0, "i": UPSERTS_PER_PROCESS - 1}  # config and time stay paired


# -- damaged files --------------------------------------------------------------------------------------

GARBAGE = b"this is not an SQLite database\x00\xff" * 200


def test_tuners_creating_one_db_together_all_write_it(tmp_path):
    """Tuners that open a new DB file at the same moment (threads here: connections of their own, as processes'
    are) all open it writable: the one that sees another create the winners table never takes the file for
    another program's. 20 files, 4 openers each (before the fix about a third of the files refused one)."""
    import threading

    refused = []
    for i in range(20):
        path, barrier = tmp_path / f"tuning{i}.db", threading.Barrier(4)

        def open_it(path=path, barrier=barrier):
            barrier.wait()
            try:
                with TuningDB(path) as db:
                    db.check_writable()
            except KernelgenRuntimeError as error:
                refused.append(str(error))

        threads = [threading.Thread(target=open_it) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not refused, refused[0]


def test_corrupted_file_is_moved_aside_and_recreated(tmp_path, caplog):
    path = tmp_path / "tuning.db"
    path.write_bytes(GARBAGE)
    with caplog.at_level(logging.WARNING, logger="kernelgen"):
        tuning_db = TuningDB(path)
    warnings = [r for r in caplog.records if r.name == "kernelgen" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert "corrupt" in warnings[0].getMessage()
    [aside] = tmp_path.glob("tuning.db.corrupt-*")
    assert aside.read_bytes() == GARBAGE  # kept, byte for byte
    assert tuning_db.rows() == []
    upsert(tuning_db)
    assert lookup(tuning_db)["config"] == {"BLOCK_M": 64}
    tuning_db.close()


def _damage_page(path, page=None, holding: bytes = b"") -> None:
    """Overwrite the start of SQLite page `page` (1-based), or of the page holding `holding`, with WAL mode off
    first so the main file holds every row."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=delete")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    start = (page - 1) * page_size if page else data.index(holding) // page_size * page_size
    assert start > 0  # the header page holds the schema: damaged there, nothing is readable
    data[start:start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", ["table page", "index page", "truncated"])
def test_corrupted_file_keeps_the_rows_sqlite_can_still_read(tmp_path, caplog, damaged):
    """A damaged page moves the file aside; the new file holds every row that still reads, unchanged: all of
    them where only the key's index is hit, all but the damaged table page's rows where a table page is, the
    rows of the pages left where the file was cut short (a copy stopped halfway)."""
    path = tmp_path / "tuning.db"
    with TuningDB(path) as tuning_db:
        for i in range(200):  # about five rows a page: the table spans some forty pages
            upsert(tuning_db, spec_key=f"key-{i:04d}-", config={"BLOCK_M": 64, "note": f"row {i} " + "x" * 600},
                   median_ms=1.0 + i)
        before = {row["spec_key"]: row for row in tuning_db.rows()}
    if damaged == "table page":
        _damage_page(path, holding=b"row 100 ")
    elif damaged == "truncated":
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA journal_mode=delete")  # every row in the main file
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    else:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            [index_root] = conn.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index'").fetchone()
        _damage_page(path, index_root)
    damaged_bytes = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kernelgen"), TuningDB(path) as tuning_db:
        after = {row["spec_key"]: row for row in tuning_db.rows()}
        upsert(tuning_db, spec_key="key-new", median_ms=0.5)  # the new file takes writes
        assert lookup(tuning_db, spec_key="key-new")["median_ms"] == 0.5
    [aside] = tmp_path.glob("tuning.db.corrupt-*")
    assert aside.read_bytes() == damaged_bytes
    [warning] = [r.getMessage() for r in caplog.records if r.name == "kernelgen" and "corrupted" in r.getMessage()]
    assert f"the {len(after)} rows it could still read" in warning and "\n" not in warning
    if damaged == "index page":
        assert after == before
    elif damaged == "truncated":
        assert 40 < len(after) < 200 and all(after[key] == before[key] for key in after)
    else:
        assert "key-0100-" not in after and 150 < len(after) < 200
        assert all(after[key] == before[key] for key in after)


# -- user DB over bundled DB ------------------------------------------------------------------------------

def _row(config, **overrides):
    return {**KEY, "bucket": 2048, "config": config, "median_ms": 1.0, "tflops": None, "n_trials": 4,
            "timestamp": "2025-01-01T00:00:00+00:00", **FP.as_columns(), "spec_json": "", **overrides}


def test_user_db_overrides_bundled(tmp_path):
    bundled_path = write_bundled_db(tmp_path / "winners.db", [
        _row({"from": "bundled"}),
        _row({"from": "bundled"}, spec_key="only-bundled"),
    ])
    bundled_digest = hashlib.sha256(bundled_path.read_bytes()).hexdigest()
    with TuningDB(tmp_path / "user.db") as user_db:
        upsert(user_db, config={"from": "user"})
        winners = Winners(user_db, bundled_path=bundled_path)
        row = lookup(winners)
        assert (row["config"], row["source"]) == ({"from": "user"}, "user")
        row = lookup(winners, spec_key="only-bundled")
        assert (row["config"], row["source"]) == ({"from": "bundled"}, "bundled")
        assert lookup(winners, spec_key="nowhere") is None
        assert lookup(winners, spec_key="only-bundled", fingerprint=Fingerprint(
            **{**FP.as_columns(), "template_hash": "another"})) is None
        row = lookup(winners, spec_key="only-bundled", fingerprint=Fingerprint(**{**FP.as_columns(),
                                                                                 "cuda_version": "13.0"}))
        assert (row["source"], row["soft_mismatch"]) == ("bundled", ("cuda_version",))
        assert [r["source"] for r in winners.servable(FP, role=KEY["role"])] == ["user", "bundled", "bundled"]
    # Read-only means read-only: no byte changed, no WAL or journal left next to it.
    assert hashlib.sha256(bundled_path.read_bytes()).hexdigest() == bundled_digest
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("winners")) == ["winners.db"]


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_unusable_bundled_db_is_skipped_with_a_warning(tmp_path, caplog, damage):
    bundled_path = tmp_path / "winners.db"
    if damage == "garbage":
        bundled_path.write_bytes(GARBAGE)
    with TuningDB(tmp_path / "user.db") as user_db:
        upsert(user_db, config={"from": "user"})
        with caplog.at_level(logging.WARNING, logger="kernelgen"):
            winners = Winners(user_db, bundled_path=bundled_path)
        assert any(str(bundled_path) in r.getMessage() for r in caplog.records if r.name == "kernelgen")
        assert lookup(winners)["source"] == "user"
        assert lookup(winners, spec_key="nowhere") is None
    if damage == "garbage":
        assert bundled_path.read_bytes() == GARBAGE  # never moved aside or rewritten
        assert not list(tmp_path.glob("winners.db.corrupt-*"))


def test_shipped_bundled_db_opens(tmp_path):
    assert BUNDLED_DB_PATH.name == "winners.db" and BUNDLED_DB_PATH.is_file()
    with TuningDB(tmp_path / "user.db") as user_db:
        assert lookup(Winners(user_db)) is None  # empty until a tuning run fills it


def test_winners_default_user_db_lives_in_cache_dir_and_is_read_once_it_exists(isolated_cache_dir):
    """Looking up winners creates no file (a fresh install serves the bundled ones); the user DB a tune then
    writes in the cache dir is served from the next lookup on."""
    winners = Winners()
    assert lookup(winners) is None and winners.user is None
    assert not (isolated_cache_dir / "tuning.db").exists()
    with TuningDB() as tuned:
        upsert(tuned, median_ms=1.0)
    assert lookup(winners)["source"] == "user"
    assert winners.user.path == isolated_cache_dir / "tuning.db"
    winners.user.close()


# ---------------------------------------------------------------------------------------------------
# A read-only cache dir


def test_a_read_only_cache_dir_opens_the_user_db_read_only(isolated_cache_dir):
    """An existing user DB in a directory that cannot be written (root included) is read, never written:
    lookups and rows work; upsert and clear are one clear error naming the file, before any write."""
    with TuningDB() as tuned:
        upsert(tuned, median_ms=1.0)
    path = isolated_cache_dir / "tuning.db"
    before = path.read_bytes()
    with read_only(isolated_cache_dir):
        with TuningDB() as db:
            assert db.read_only is not None
            assert lookup(db)["median_ms"] == 1.0 and len(db.rows()) == 1
            assert Winners(db).lookup(**KEY, bucket=2048, fingerprint=FP)["source"] == "user"
            for write in (lambda: upsert(db, median_ms=0.5), db.clear, db.check_writable):
                with pytest.raises(KernelgenRuntimeError, match="cannot be written") as error:
                    write()
                assert str(path) in str(error.value) and "\n" not in str(error.value)
            assert len(db.rows()) == 1
    assert path.read_bytes() == before
    assert sorted(p.name for p in isolated_cache_dir.iterdir()) == ["tuning.db"]


def test_a_read_only_wal_db_is_read_without_its_shm_file(tmp_path):
    """A WAL DB in a read-only directory whose -shm file is gone (SQLite cannot create it) is still read."""
    path = tmp_path / "ro" / "tuning.db"
    with TuningDB(path) as tuned:
        upsert(tuned)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.db"]  # the last close removed -wal, -shm
    with read_only(path.parent), TuningDB(path) as db:
        assert db.read_only is not None and lookup(db) is not None


def test_a_read_only_db_with_a_crashed_writer_s_journal_serves_none_of_its_changes(tmp_path):
    """A rollback-journal DB whose writer died mid-transaction (a hot -journal), in a directory that cannot be
    written: SQLite can roll the journal back only where it can write, and reading the main file alone
    (immutable) would serve rows no writer committed. The file is skipped with a warning, and rows_of_file says
    why in one line."""
    path = tmp_path / "ro" / "tuning.db"
    with TuningDB(path) as tuned:
        for i in range(300):  # pages enough for the writer below to spill some into the main file
            upsert(tuned, spec_key=f"s{i:03d}", median_ms=1.0)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=delete")
    script = (f"import sqlite3, os; c = sqlite3.connect({str(path)!r}, isolation_level=None); "
              "c.execute('PRAGMA cache_size=1'); c.execute('BEGIN'); "
              "c.execute(\"UPDATE winners SET config='{\\\"BLOCK_M\\\": 999}', median_ms=0.001\"); "
              "c.execute('PRAGMA cache_spill=1'); os._exit(9)")
    subprocess.run([sys.executable, "-c", script], check=False)
    journal = path.with_name("tuning.db-journal")
    assert journal.is_file() and journal.stat().st_size > 0
    with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM winners WHERE median_ms < 1").fetchone()[0] > 0  # the hazard
    with read_only(path.parent):
        with TuningDB(path) as db:
            assert db.read_only is not None
            assert all(row["median_ms"] == 1.0 for row in db.rows())  # none of the uncommitted update
        with pytest.raises(UnreadableDatabase, match=r"tuning.db-journal holds changes") as error:
            rows_of_file(path)
        assert "\n" not in str(error.value)
    with TuningDB(path) as db:  # writable again: SQLite rolls the journal back
        assert len(db.rows()) == 300 and all(row["median_ms"] == 1.0 for row in db.rows())


def test_a_row_left_unreadable_by_hand_is_skipped_and_replaced_by_the_next_winner(tmp_path, caplog):
    """A row whose config is not JSON, or whose median_ms is text (a hand edit, another program): the other rows
    are still listed and served, and a new winner for its key replaces it, with a warning naming its key."""
    path = tmp_path / "tuning.db"
    with TuningDB(path) as db:
        for bucket in (1024, 2048, 4096):
            upsert(db, bucket=bucket)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE winners SET config = '{not json' WHERE bucket = 1024")
        conn.execute("UPDATE winners SET median_ms = 'fast' WHERE bucket = 4096")
    with caplog.at_level(logging.WARNING, logger="kernelgen"), TuningDB(path) as db:
        assert [row["bucket"] for row in db.rows()] == [2048]
        assert lookup(db, bucket=2048)["bucket"] == 2048
        assert sum("unreadable" in record.getMessage() for record in caplog.records) >= 2
        assert "'bucket': 1024" in caplog.text
        upsert(db, bucket=1024, median_ms=5.0)  # the bad row's key: written, not a JSONDecodeError
        assert [row["bucket"] for row in db.rows()] == [1024, 2048]
    assert [row["bucket"] for row in rows_of_file(path)] == [1024, 2048]


def test_a_user_db_that_is_no_regular_file_is_read_as_empty_and_refuses_writes(tmp_path):
    """A FIFO where the DB should be (SQLite: disk I/O error): lookups miss, bundled winners are served, and a
    write is one clear error, not an OperationalError's traceback."""
    path = tmp_path / "tuning.db"
    os.mkfifo(path)
    with TuningDB(path) as db:
        assert db.read_only is not None and db.rows() == [] and lookup(db) is None
        with pytest.raises(KernelgenRuntimeError, match="cannot be written"):
            upsert(db)


def test_a_user_db_that_cannot_be_created_is_empty(tmp_path, monkeypatch):
    """The cache dir's parent is a regular file (no one can create the dir, root included): the user DB is
    absent; lookups miss, bundled winners are still served, and writes are one clear error."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with TuningDB() as db:
        assert db.read_only and db.rows() == [] and lookup(db) is None
        with pytest.raises(KernelgenRuntimeError, match=r"tuning database .*file/cache/tuning.db cannot be written"):
            upsert(db)
    assert Winners().user is None  # dispatch's lookups miss the user DB, and create nothing


def test_a_read_only_db_file_in_a_writable_dir_refuses_writes_clearly(tmp_path):
    """A DB file that may only be read, in a directory that may be written: read, and writes refused clearly."""
    path = tmp_path / "tuning.db"
    with TuningDB(path) as tuned:
        upsert(tuned)
    with read_only(path), TuningDB(path) as db:
        assert db.read_only is not None and lookup(db) is not None
        with pytest.raises(KernelgenRuntimeError, match="cannot be written"):
            upsert(db, median_ms=0.1)


def test_a_cache_dir_that_is_a_file_says_so(tmp_path):
    """KERNELGEN_CACHE_DIR naming a regular file (or a folder under one): lookups miss, and writes are refused
    saying which path is a file, not "File exists"."""
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file" / "tuning.db", tmp_path / "file" / "sub" / "tuning.db"):
        with TuningDB(path) as db:
            assert lookup(db) is None
            with pytest.raises(KernelgenRuntimeError, match=f"{tmp_path / 'file'} is a file, not a directory"):
                upsert(db)


def test_a_db_with_only_the_columns_kernelgen_reads_takes_new_rows(tmp_path):
    """A winners table with the columns kernelgen reads but not every column it writes (made by another tool) is
    read, and a tune's upsert adds the missing columns rather than failing after the trials."""
    import sqlite_utils

    from kernelgen.tuning.db import KEY_COLUMNS, REQUIRED_COLUMNS, SCHEMA

    path = tmp_path / "tuning.db"
    with contextlib.closing(sqlite_utils.Database(path)) as made:
        made["winners"].create({name: SCHEMA[name] for name in REQUIRED_COLUMNS}, pk=KEY_COLUMNS)
    with TuningDB(path) as db:
        upsert(db, median_ms=2.0)
        upsert(db, median_ms=1.0)
        assert lookup(db)["median_ms"] == 1.0 and lookup(db)["tflops"] is not None


# ---------------------------------------------------------------------------------------------------
# A DB another process keeps locked


@contextlib.contextmanager
def _held(path, *, exclusively):
    """Another connection holds `path`'s write lock for the duration; `exclusively`, in SQLite's exclusive
    locking mode, so that readers wait too (it can be taken only while no other connection is open)."""
    conn = sqlite3.connect(path, isolation_level=None)
    if exclusively:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("SELECT count(*) FROM winners").fetchone()
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_a_db_locked_past_the_wait_is_one_error_naming_the_file(tmp_path, monkeypatch):
    """A lock held longer than the retries wait is a KernelgenRuntimeError naming the file (one CLI line), when
    opening or writing: never a bare sqlite3 error."""
    from kernelgen.tuning import db as db_module

    monkeypatch.setattr(db_module, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(db_module, "LOCKED_RETRY_DEADLINE_S", 0.2)
    path = tmp_path / "tuning.db"
    with TuningDB(path) as tuned:
        upsert(tuned)
    with _held(path, exclusively=True), pytest.raises(KernelgenRuntimeError, match="is locked") as opening:
        TuningDB(path)
    with TuningDB(path) as opened:
        with _held(path, exclusively=False), pytest.raises(KernelgenRuntimeError, match="is locked") as writing:
            upsert(opened, median_ms=0.5)
        assert lookup(opened)["median_ms"] == 1.0  # the lock gone, the DB is as it was
    for error in (opening, writing):
        assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_winners_table_keyed_otherwise_is_never_served_nor_written(tmp_path):
    """A winners table whose primary key is not kernelgen's (a later layout with one more key column): its rows
    are ambiguous under kernelgen's key, so the user DB is empty and read-only, the bundled DB is skipped, and
    the file is left as it was."""
    import json

    import sqlite_utils

    from kernelgen.tuning.db import KEY_COLUMNS, SCHEMA, UnreadableDatabase, rows_of_file

    path = tmp_path / "tuning.db"
    with contextlib.closing(sqlite_utils.Database(path)) as made:
        made["winners"].create({**SCHEMA, "variant": str}, pk=(*KEY_COLUMNS, "variant"))
        for variant, ms in (("a", 1.0), ("b", 0.5)):
            made["winners"].insert({**KEY, "bucket": 2048, "config": json.dumps({"variant": variant}),
                                    "median_ms": ms, "n_trials": 4, "timestamp": "t", **FP.as_columns(),
                                    "variant": variant})
    before = path.read_bytes()
    with TuningDB(path) as db:
        assert db.read_only is not None and "primary key" in db.read_only
        assert lookup(db) is None
        with pytest.raises(KernelgenRuntimeError, match="cannot be written"):
            upsert(db, median_ms=0.1)
    with TuningDB(tmp_path / "user.db") as user:
        assert Winners(user, bundled_path=path).lookup(**KEY, bucket=2048, fingerprint=FP) is None
    with pytest.raises(UnreadableDatabase, match="primary key"):
        rows_of_file(path)
    assert path.read_bytes() == before


def test_a_bundled_db_that_cannot_replace_its_target_leaves_no_partial_file(tmp_path):
    """The target is a directory (or an immutable file): the write fails with the OS's error, and the half-made
    file beside it is removed."""
    target = tmp_path / "winners.db"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        write_bundled_db(target, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["winners.db"]


def test_bundle_merges_conflicting_rows_of_the_given_files_as_upsert_keeps_them(tmp_path):
    """Two machines' DBs with a row of the same key: whatever the order the files are given in, of one fingerprint
    the faster is kept, of two the later measured (as one DB keeps them); a merged row replaces the bundled one."""
    from kernelgen.tuning.db import merge_into_bundled, read_only_rows

    stale = Fingerprint(**{**FP.as_columns(), "template_hash": "t-old"})
    files = {}
    for name, ms, fingerprint, stamp in (("fast", 1.0, FP, "2026-01-02"), ("slow", 2.0, FP, "2026-01-03"),
                                         ("old", 0.5, stale, "2026-01-01"), ("new", 3.0, FP, "2026-01-04")):
        files[name] = write_bundled_db(tmp_path / f"{name}.db", [
            _row({"from": name}, median_ms=ms, timestamp=f"{stamp}T00:00:00+00:00", **fingerprint.as_columns())])
    bundled = write_bundled_db(tmp_path / "winners.db", [_row({"from": "bundled"}, median_ms=0.1),
                                                         _row({"from": "bundled"}, bucket=4096)])
    for pair, kept in ((("fast", "slow"), "fast"), (("old", "new"), "new")):
        for order in (pair, pair[::-1]):
            target = tmp_path / f"into-{'-'.join(order)}.db"
            write_bundled_db(target, read_only_rows(bundled))
            merge_into_bundled([files[name] for name in order], target)
            rows = {row["bucket"]: row["config"]["from"] for row in read_only_rows(target)}
            assert rows == {2048: kept, 4096: "bundled"}, order


def test_bundle_takes_dbs_with_only_the_columns_kernelgen_reads(tmp_path):
    """Tables made by another tool, with no timestamp column, one key in both under two fingerprints: a row of no
    time counts as older than one with a time, and the bundled file holds the kept rows (a KeyError or a NOT NULL
    failure before)."""
    import sqlite_utils

    from kernelgen.tuning.db import KEY_COLUMNS, REQUIRED_COLUMNS, SCHEMA, merge_into_bundled, read_only_rows

    stale = Fingerprint(**{**FP.as_columns(), "torch_version": "2.0.0"})
    paths = []
    for name, fingerprint in (("a", FP), ("b", stale)):
        paths.append(tmp_path / f"{name}.db")
        with contextlib.closing(sqlite_utils.Database(paths[-1])) as made:
            made["winners"].create({column: SCHEMA[column] for column in REQUIRED_COLUMNS}, pk=KEY_COLUMNS)
            row = {column: value for column, value in _row({"from": name}, **fingerprint.as_columns()).items()
                   if column in REQUIRED_COLUMNS}
            made["winners"].insert({**row, "config": json.dumps(row["config"])})
    merge_into_bundled(paths, tmp_path / "winners.db")
    assert [row["config"] for row in read_only_rows(tmp_path / "winners.db")] == [{"from": "a"}]
    dated = write_bundled_db(tmp_path / "dated.db", [_row({"from": "dated"}, timestamp="2026-01-01T00:00:00+00:00")])
    merge_into_bundled([dated, *paths], tmp_path / "with-dated.db")
    assert [row["config"] for row in read_only_rows(tmp_path / "with-dated.db")] == [{"from": "dated"}]


def test_a_user_db_locked_when_dispatch_opens_it_still_serves_the_bundled_winners(isolated_cache_dir, monkeypatch,
                                                                                   caplog):
    """Dispatch's Winners() over a user DB another process keeps locked: one warning, and the bundled winners are
    served without it (not the defaults, after a wait per lookup)."""
    from kernelgen.tuning import db as db_module

    monkeypatch.setattr(db_module, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(db_module, "LOCKED_RETRY_DEADLINE_S", 0.2)
    with TuningDB() as tuned:
        upsert(tuned, median_ms=1.0)
    bundled = write_bundled_db(isolated_cache_dir.parent / "winners.db", [_row({"BLOCK_M": 128}, median_ms=2.0)])
    with _held(isolated_cache_dir / "tuning.db", exclusively=True), caplog.at_level(logging.WARNING, "kernelgen"):
        winners = Winners(bundled_path=bundled)
        row = winners.lookup(**KEY, bucket=2048, fingerprint=FP)
    assert row["source"] == "bundled" and row["config"] == {"BLOCK_M": 128}
    assert [r.getMessage() for r in caplog.records if "is locked" in r.getMessage()] != []
    winners.user.close()

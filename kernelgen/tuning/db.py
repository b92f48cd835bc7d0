"""The tuning database: the fastest `KernelConfig` found for each (spec, role, backend, GPU, sequence bucket).

Two SQLite files hold winners, one table (`winners`) each, with the same schema:

- the user DB, `platformdirs.user_cache_dir("kernelgen")/tuning.db` (or `$KERNELGEN_CACHE_DIR/tuning.db`),
  written by `kernelgen tune`, possibly by several tuning processes at once;
- the bundled DB, `tuning_db/winners.db`, shipped with the package and only ever opened read-only.

`Winners.lookup` asks the user DB first and the bundled DB second. Rows are plain JSON text and
numbers, never pickles, so a DB written by one version can be read (and inspected with `sqlite3` or
`sqlite-utils`) by any other.

A row remembers what produced it (`Fingerprint`: kernelgen, template, compiler, torch and CUDA
versions). What generates the kernel (template hash, the backend's compiler) must match: a winner
measured with another compiler or template is no evidence about this one, so that is a miss, never a
crash. Another kernelgen, torch or CUDA runtime is a soft mismatch: the row is served, marked with the
columns that differ (`soft_mismatch`), and dispatch re-checks it for correctness before first use.
Sequence lengths are bucketed to powers of two (`seq_bucket`); a lookup for an untuned bucket falls
back to the nearest tuned one.

Example::

    db = TuningDB()
    fp = current_fingerprint(backends.get("triton"), "attn")
    key = get_role("attn").key(spec, "triton")
    db.upsert(spec_key=key, role="attn", backend="triton", arch="sm_90", gpu_name="NVIDIA H200",
              bucket=seq_bucket(n), dtype="bfloat16", config=json.loads(AttnConfig(block_m=128).to_json()),
              median_ms=0.41, tflops=512.0, n_trials=64, fingerprint=fp)
    Winners(db).lookup(spec_key=key, role="attn", backend="triton", arch="sm_90",
                       gpu_name="NVIDIA H200", dtype="bfloat16", bucket=seq_bucket(n), fingerprint=fp)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import platformdirs
import sqlite_utils

from ..errors import KernelgenRuntimeError, KernelgenTypeError, KernelgenValueError
from .buckets import seq_bucket  # the DB keys winners by it; re-exported here

try:  # POSIX only; elsewhere recovery of a corrupted file simply runs unserialised
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "TuningDB",
    "Winners",
    "Fingerprint",
    "seq_bucket",
    "current_fingerprint",
    "default_user_db_path",
    "write_bundled_db",
    "merge_into_bundled",
    "read_only_rows",
    "nearest_bucket_row",
    "rows_of_file",
    "UnreadableDatabase",
    "BUNDLED_DB_PATH",
]

logger = logging.getLogger("kernelgen")

TABLE = "winners"
KEY_COLUMNS = ("spec_key", "role", "backend", "arch", "gpu_name", "bucket", "dtype")
FINGERPRINT_COLUMNS = (
    "kernelgen_version",
    "template_hash",
    "triton_version",
    "tilelang_version",
    "torch_version",
    "cuda_version",
)
# what generates the kernel: a row is served only where these match
HARD_FINGERPRINT_COLUMNS = ("template_hash", "triton_version", "tilelang_version")
# what runs around it: a row is served across these, re-checked first (`Fingerprint.soft_mismatch`)
SOFT_FINGERPRINT_COLUMNS = ("kernelgen_version", "torch_version", "cuda_version")
SCHEMA: dict[str, type] = {
    "spec_key": str,
    "role": str,
    "backend": str,
    "arch": str,
    "gpu_name": str,
    "bucket": int,
    "dtype": str,
    "config": str,  # JSON object
    "median_ms": float,
    "tflops": float,
    "n_trials": int,
    "timestamp": str,  # UTC, ISO 8601
    **{name: str for name in FINGERPRINT_COLUMNS},
    "spec_json": str,
}

# what kernelgen reads from a row: a winners table without them is another program's (or is damaged)
REQUIRED_COLUMNS = (*KEY_COLUMNS, "config", "median_ms", "n_trials", *FINGERPRINT_COLUMNS)
NOT_NULL_COLUMNS = (*KEY_COLUMNS, "config", "median_ms", "n_trials", "timestamp")

BUSY_TIMEOUT_S = 30.0  # SQLite's own wait for a lock, per statement
LOCKED_RETRY_DEADLINE_S = 120.0  # our retries on top of it, for a whole transaction

_T = TypeVar("_T")


def _find_bundled_db() -> Path:
    # An installed wheel carries tuning_db/ inside the package (pyproject's force-include); a source
    # checkout keeps it at the repository root, one level above the package.
    package_dir = Path(__file__).resolve().parent.parent
    installed = package_dir / "tuning_db" / "winners.db"
    return installed if installed.exists() else package_dir.parent / "tuning_db" / "winners.db"


BUNDLED_DB_PATH: Path = _find_bundled_db()


def default_user_db_path() -> Path:
    """`$KERNELGEN_CACHE_DIR/tuning.db` when that variable is set, else the platform's user cache dir."""
    cache_dir = os.environ.get("KERNELGEN_CACHE_DIR") or platformdirs.user_cache_dir("kernelgen")
    return Path(cache_dir).expanduser() / "tuning.db"  # ~ expanded, as codegen.cache.cache_dir does


# ---------------------------------------------------------------------------------------------------
# Fingerprints


@dataclass(frozen=True)
class Fingerprint:
    """What produced a tuning result. A row is reused where its hard columns (template, compiler) are
    this process's; the soft ones (kernelgen, torch, CUDA runtime) may differ.

    Versions of packages that are absent (or irrelevant to the backend) are None.
    """

    kernelgen_version: str
    template_hash: str
    triton_version: str | None
    tilelang_version: str | None
    torch_version: str | None
    cuda_version: str | None

    def as_columns(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Fingerprint:
        return cls(**{name: row.get(name) for name in FINGERPRINT_COLUMNS})

    def hard_columns(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in HARD_FINGERPRINT_COLUMNS}

    def soft_mismatch(self, row: dict[str, Any]) -> tuple[str, ...]:
        """The soft columns in which `row` was measured under another version than this fingerprint's."""
        return tuple(name for name in SOFT_FINGERPRINT_COLUMNS if row.get(name) != getattr(self, name))


@functools.lru_cache(maxsize=None)
def _torch_versions() -> tuple[str | None, str | None]:
    try:
        import torch
    except Exception:  # a fingerprint must never raise, whatever is broken in the environment
        return None, None
    return str(torch.__version__), torch.version.cuda


def current_fingerprint(backend, role: str) -> Fingerprint:
    """The fingerprint of this process for `backend`'s kernels of `role` (a `kernelgen.backends.Backend`).

    Only the backend's own compilers are recorded (the others are None): installing or upgrading TileLang
    says nothing about a Triton kernel's speed, so it must not invalidate Triton winners.
    """
    from ..backends.base import distribution_version

    versions = {column: None for column in ("triton_version", "tilelang_version")}
    versions.update(backend.compiler_versions())
    torch_version, cuda_version = _torch_versions()
    return Fingerprint(
        kernelgen_version=distribution_version("kernelgen") or "0+unknown",
        template_hash=backend.template_hash(role),
        triton_version=versions["triton_version"],
        tilelang_version=versions["tilelang_version"],
        torch_version=torch_version,
        cuda_version=cuda_version,
    )


# ---------------------------------------------------------------------------------------------------
# SQLite plumbing shared by the user DB and the bundled DB


class _CorruptDatabase(sqlite3.DatabaseError):
    """The file opens but fails SQLite's integrity check."""


def _is_corruption(error: sqlite3.DatabaseError) -> bool:
    if isinstance(error, _CorruptDatabase):
        return True
    # Only damage to the file counts. "database is locked" is an OperationalError, also a
    # DatabaseError: mistaking it for corruption would move a healthy, busy DB aside.
    if isinstance(error, sqlite3.OperationalError):
        return False
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
    message = str(error).lower()
    return "not a database" in message or "malformed" in message


def _is_locked(error: sqlite3.OperationalError) -> bool:
    message = str(error).lower()
    return "locked" in message or "busy" in message


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _cannot_write(error: sqlite3.OperationalError) -> bool:
    """SQLite refused to create or write the file (a read-only file, directory or mount), as opposed to a
    lock, which passes, or damage, which recovery handles."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM)
    message = str(error).lower()
    return "readonly" in message or "unable to open" in message


def _retry_while_locked(operation: Callable[[], _T]) -> _T:
    """Run `operation`, again after a short random sleep while SQLite reports a lock, up to a deadline.

    The busy timeout already waits inside SQLite; this covers the cases where SQLite gives up at once
    (e.g. changing the journal mode) or a busy tuning farm outlasts one timeout.
    """
    deadline = time.monotonic() + LOCKED_RETRY_DEADLINE_S
    delay_s = 0.005
    while True:
        try:
            return operation()
        except sqlite3.OperationalError as error:
            if not _is_locked(error) or time.monotonic() > deadline:
                raise
        time.sleep(delay_s * (0.5 + random.random()))  # jitter: waiters must not wake in lockstep
        delay_s = min(delay_s * 2, 0.5)


def _check_integrity(conn: sqlite3.Connection) -> None:
    """Raise sqlite3.DatabaseError if the file is not a healthy SQLite database."""
    result = conn.execute("PRAGMA quick_check").fetchone()[0]
    if result != "ok":
        raise _CorruptDatabase(f"integrity check failed: {result}")


@contextlib.contextmanager
def _write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    # BEGIN IMMEDIATE takes the write lock before the first read, so a read-compare-write cannot
    # interleave with another writer's (a deferred BEGIN would fail with SQLITE_BUSY_SNAPSHOT).
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _readable_rows(path: Path) -> list[dict[str, Any]]:
    """The rows SQLite can still read from the damaged tuning DB at `path`, each whole and decodable: the table
    walked in rowid order from either end up to the first page that fails, so a damaged page loses its own rows
    and not those around it. [] where nothing can be read (a damaged header or schema)."""
    rows: dict[int, dict[str, Any]] = {}
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return []
    with contextlib.closing(conn):
        conn.row_factory = sqlite3.Row
        with contextlib.suppress(sqlite3.Error):
            # a file shorter than its header's page count (a copy cut short) is refused as corrupt unless SQLite
            # may take its schema as it stands; the read-only connection still writes nothing
            conn.execute("PRAGMA writable_schema=ON")
        for order in ("ASC", "DESC"):
            try:
                for row in conn.execute(f"SELECT rowid AS [rowid], * FROM [{TABLE}] ORDER BY rowid {order}"):
                    rows.setdefault(row["rowid"], dict(row))
            except sqlite3.Error:
                continue  # the walk ends at the damage; the other direction reads past it
    readable = []
    for row in rows.values():
        row = {name: row.get(name) for name in SCHEMA}
        if any(row[name] is None for name in NOT_NULL_COLUMNS):
            continue
        if _decode(row) is not None:  # warns of an undecodable one; that row stays in the file moved aside only
            readable.append(row)
    return readable


def _where(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """A WHERE clause of equality filters over known columns; None matches NULL, as `IS` does.
    `fingerprint=` matches every fingerprint column, `servable_under=` only the hard ones."""
    filters = dict(filters)
    fingerprint = filters.pop("fingerprint", None)
    if fingerprint is not None:
        filters.update(fingerprint.as_columns())
    servable_under = filters.pop("servable_under", None)
    if servable_under is not None:
        filters.update(servable_under.hard_columns())
    filterable = set(SCHEMA) - {"config"}  # config is JSON text; equality on it would be fragile
    unknown = sorted(set(filters) - filterable)
    if unknown:
        allowed = ", ".join(name for name in SCHEMA if name != "config")
        raise KernelgenValueError(f"cannot filter tuning rows on {unknown}; filter on: fingerprint, servable_under, "
                                  f"{allowed}")
    if not filters:
        return "1", []
    clause = " AND ".join(f"[{name}] IS ?" for name in filters)
    return clause, list(filters.values())


def _decode(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row with its config decoded, or None (with a warning naming its key) where a hand edit or another
    program left it unreadable: one bad row must not hide the others, nor block a new winner for its key."""
    row = dict(row)
    try:
        row["config"] = json.loads(row["config"])
        problem = None if isinstance(row["config"], dict) else f"config is a JSON {type(row['config']).__name__}"
    except (TypeError, ValueError) as error:
        problem = f"config: {error}"
    if problem is None:
        problem = _bad_number(row, "bucket", int, 1) or _bad_number(row, "median_ms", float, 0) or \
            _bad_number(row, "tflops", float, 0, missing=True)
    if problem is not None:
        logger.warning("tuning DB row %s is unreadable (%s); skipping it",
                       {name: row.get(name) for name in KEY_COLUMNS}, problem)
        return None
    return row


def _bad_number(row: dict[str, Any], name: str, kind: type, least: float, missing: bool = False) -> str | None:
    """What is wrong with the row's number `name` (an int, or any finite number for float, above `least`; for an
    int at least `least`), or None; `missing`: it may be absent or NULL."""
    value = row.get(name)
    if missing and value is None:
        return None
    number = not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
    if not number or not math.isfinite(value) or value < least or (kind is float and value == least):
        return f"{name} is {value!r}, not {'an int' if kind is int else 'a number'} " \
               f"{'at least' if kind is int else 'above'} {least}"
    return None


def _select(db: sqlite_utils.Database, filters: dict[str, Any]) -> list[dict[str, Any]]:
    clause, params = _where(filters)
    order = ", ".join(KEY_COLUMNS)
    rows = (_decode(row) for row in db.table(TABLE).rows_where(clause, params, order_by=order))
    return [row for row in rows if row is not None]


def nearest_bucket_row(rows: list[dict[str, Any]], bucket: int) -> dict[str, Any] | None:
    """The row of `bucket`, else of the bucket nearest in log2 distance (ties go to the larger bucket:
    a config tuned for longer sequences is the safer guess, it was not chosen for a short grid)."""
    if not rows:
        return None
    target = math.log2(bucket)
    return min(rows, key=lambda row: (abs(math.log2(row["bucket"]) - target), -row["bucket"]))


def _servable(db: sqlite_utils.Database, fingerprint: Fingerprint, **key: Any) -> list[dict[str, Any]]:
    """Rows matching `key` that this fingerprint may serve, each with its `soft_mismatch`."""
    return [{**row, "soft_mismatch": fingerprint.soft_mismatch(row)}
            for row in _select(db, {**key, "servable_under": fingerprint})]


def _lookup(db: sqlite_utils.Database, *, bucket: int, fingerprint: Fingerprint,
            usable: Callable[[dict], bool] | None = None, **key: Any) -> dict | None:
    if bucket <= 0:
        raise KernelgenValueError(f"bucket must be a positive sequence bucket (see seq_bucket), got {bucket}")
    # Filtering on the fingerprint first means a stale exact-bucket row never shadows a fresh
    # neighbouring bucket; and on `usable`, that a row the caller cannot use never shadows one it can.
    rows = _servable(db, fingerprint, **key)
    return nearest_bucket_row(rows if usable is None else [row for row in rows if usable(row)], bucket)


def _create_schema(db: sqlite_utils.Database) -> None:
    db.table(TABLE).create(
        SCHEMA,
        pk=KEY_COLUMNS,
        not_null=NOT_NULL_COLUMNS,
        if_not_exists=True,
    )


def _utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------
# The user DB


class TuningDB:
    """A read-write tuning database in one SQLite file, safe to share between processes.

    Writers serialise on SQLite's write lock (WAL mode, so readers never wait); `upsert` compares and
    writes inside one `BEGIN IMMEDIATE` transaction, so concurrent tuners cannot lose a faster row.
    A corrupted file is moved aside to `<name>.corrupt-<timestamp>` (kept whole) and a new DB takes its place,
    holding the rows SQLite could still read from it. One instance may be shared between threads.

    Where the file or its directory cannot be written (a read-only cache), the DB is opened read-only, or is
    empty when the file does not exist or holds another program's table: lookups and `rows` work (or miss),
    and `upsert` and `clear` raise a KernelgenRuntimeError naming the path (`read_only` says why;
    `check_writable` asks up front). A lock another process holds past the retries' deadline (a SQLite shell's
    open transaction, say) is a KernelgenRuntimeError naming the file.
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_user_db_path()
        self._lock = threading.RLock()
        self.read_only: str | None = None  # why writes are refused; None: the DB is writable
        with self._locked_is_an_error():
            self._open()

    def _open(self) -> None:
        if self.path.is_dir():  # not a read-only cache but a misplaced folder: said at once, not at the first write
            logger.warning("user tuning database %s is a directory, not a database file: it holds no winners, and "
                           "tunes cannot store theirs", self.path)
            self._open_for_reading(f"{self.path} is a directory, not a database file", read_file=False)
            return
        if self.path.exists() and not os.access(self.path, os.W_OK):  # root too, on a read-only mount or inode
            self._open_for_reading("the file is not writable")
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = self._open_healthy()
        except (FileExistsError, NotADirectoryError):  # a file where the cache dir (or a folder above it) should be
            self._open_for_reading(f"{_nearest_existing(self.path.parent)} is a file, not a directory")
            return
        except (OSError, sqlite3.OperationalError) as error:
            if isinstance(error, sqlite3.OperationalError) and _is_locked(error):
                raise  # the lookups' wait and stand-in handle a lock (_user_db_for_lookups)
            # read-only, damage aside (recovered inside), or an I/O error (a FIFO, a failing disk): read what can
            # be read, refuse writes in one line naming why
            self._open_for_reading(_one_line(error))
            return
        self._db = sqlite_utils.Database(self._conn)
        try:
            # before WAL mode, which rewrites the file's header: another program's file stays as it is
            _retry_while_locked(self._check_existing_schema)
            _retry_while_locked(self._enable_wal)
            _retry_while_locked(self._ensure_schema)
        except BaseException as error:
            self._conn.close()
            if not (isinstance(error, _ForeignSchema)
                    or isinstance(error, sqlite3.OperationalError) and not _is_locked(error)):
                raise
            self._open_for_reading(_one_line(error))

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r})"

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def check_writable(self) -> None:
        """Raise KernelgenRuntimeError, naming the file, when results cannot be written to this DB."""
        if self.read_only is not None:
            raise self._read_only_error()

    def _read_only_error(self) -> KernelgenRuntimeError:
        return KernelgenRuntimeError(f"the tuning database {self.path} cannot be written ({self.read_only}); to "
                                     "tune or clear, set KERNELGEN_CACHE_DIR to another, writable directory")

    # -- public API ----------------------------------------------------------------------------------

    def upsert(
        self,
        *,
        spec_key: str,
        role: str,
        backend: str,
        arch: str,
        gpu_name: str,
        bucket: int,
        dtype: str,
        config: dict,
        median_ms: float,
        tflops: float | None,
        n_trials: int,
        fingerprint: Fingerprint,
        spec_json: str = "",
    ) -> None:
        """Record a tuning result, keeping the faster row when one exists for the key and fingerprint.

        A row from a different fingerprint is replaced whatever its time: it was measured on another
        stack and is no longer comparable.
        """
        if not (math.isfinite(median_ms) and median_ms > 0):
            # A NaN would make every later comparison false and pin a bogus row forever.
            raise KernelgenValueError(f"median_ms must be a finite positive time, got {median_ms}")
        if not isinstance(config, dict):
            raise KernelgenTypeError(f"config must be a dict of tunables, got {type(config).__name__}")
        key = dict(spec_key=spec_key, role=role, backend=backend, arch=arch, gpu_name=gpu_name,
                   bucket=int(bucket), dtype=dtype)
        record = {
            **key,
            "config": json.dumps(config, sort_keys=True),
            "median_ms": float(median_ms),
            "tflops": None if tflops is None else float(tflops),
            "n_trials": int(n_trials),
            "timestamp": _utc_timestamp(),
            **fingerprint.as_columns(),
            "spec_json": spec_json,
        }

        def compare_and_write() -> None:
            with self._write_transaction():
                existing = _select(self._db, key)
                if existing and Fingerprint.from_row(existing[0]) == fingerprint \
                        and existing[0]["median_ms"] <= record["median_ms"]:
                    logger.debug("tuning DB %s keeps %s (%.4f ms <= %.4f ms)", self.path, key,
                                 existing[0]["median_ms"], record["median_ms"])
                    return
                # alter: a table made elsewhere with only the columns kernelgen reads gets the others
                self._db.table(TABLE).upsert(record, pk=KEY_COLUMNS, alter=True)

        self._write(compare_and_write)

    def lookup(
        self,
        *,
        spec_key: str,
        role: str,
        backend: str,
        arch: str,
        gpu_name: str,
        dtype: str,
        bucket: int,
        fingerprint: Fingerprint,
        usable: Callable[[dict], bool] | None = None,
    ) -> dict | None:
        """The winner for this key: the exact bucket, else the nearest tuned one; None on a miss.

        Rows of another fingerprint, and those `usable` (given a row) refuses, are ignored. The returned row has
        `config` decoded from JSON.
        """
        return self._run(lambda: _lookup(
            self._db, spec_key=spec_key, role=role, backend=backend, arch=arch, gpu_name=gpu_name,
            dtype=dtype, bucket=bucket, fingerprint=fingerprint, usable=usable))

    def servable(self, fingerprint: Fingerprint, **key: Any) -> list[dict]:
        """Rows equal to `key` (columns, any subset) that `fingerprint` may serve, each with its
        `soft_mismatch`: the candidates of a nearest-spec transfer."""
        return self._run(lambda: _servable(self._db, fingerprint, **key))

    def rows(self, **filters: Any) -> list[dict]:
        """All rows (config decoded), optionally only those equal to `filters` (column=value, or
        fingerprint=Fingerprint)."""
        return self._run(lambda: _select(self._db, filters))

    def clear(self, **filters: Any) -> int:
        """Delete all rows, or those matching `filters` (as in `rows`); returns how many went."""
        clause, params = _where(filters)

        def delete() -> int:
            with self._write_transaction():
                return self._conn.execute(f"DELETE FROM [{TABLE}] WHERE {clause}", params).rowcount

        return self._write(delete)

    # -- connection, transactions, recovery ---------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions from the driver; ours are explicit, and
        # sqlite-utils nests its own as savepoints inside them.
        return sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)

    @classmethod
    def without_file(cls, path: str | Path | None, reason: str) -> TuningDB:
        """An empty, read-only stand-in for the DB at `path`, which cannot be opened for `reason`: lookups miss."""
        db = cls.__new__(cls)
        db.path = Path(path) if path is not None else default_user_db_path()
        db._lock = threading.RLock()
        db._open_for_reading(reason, read_file=False)
        return db

    def _open_for_reading(self, reason: str, read_file: bool = True) -> None:
        """Open the file read-only, as it cannot be written (or holds another program's table) for `reason`; an
        empty in-memory DB when the file does not exist or cannot be read as a tuning DB (lookups miss)."""
        self.read_only = reason
        db = _open_read_only(self.path, what="user tuning database") if read_file and self.path.is_file() else None
        if db is None:
            logger.debug("user tuning database %s cannot be created (%s); it holds no winners", self.path,
                         self.read_only)
            db = sqlite_utils.Database(sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False))
            _create_schema(db)
        else:
            logger.debug("user tuning database %s is read-only (%s)", self.path, self.read_only)
        self._db, self._conn = db, db.conn

    def _write(self, operation: Callable[[], _T]) -> _T:
        """Run a write operation, or raise check_writable's error: SQLite may learn only now that the file is
        read-only."""
        self.check_writable()
        try:
            return self._run(operation)
        except sqlite3.OperationalError as error:
            if not _cannot_write(error):
                raise
            self.read_only = _one_line(error)
            raise self._read_only_error() from error

    def _open_healthy(self) -> sqlite3.Connection:
        conn = self._connect()
        try:
            _retry_while_locked(lambda: _check_integrity(conn))
            return conn
        except sqlite3.DatabaseError as error:
            conn.close()
            if not _is_corruption(error):
                raise
            self._recover(error)
            return self._connect()

    def _enable_wal(self) -> None:
        if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            self._conn.execute("PRAGMA journal_mode=wal")
        # In WAL mode NORMAL cannot corrupt the file; a power cut may only lose the last few results,
        # which a cache can afford, and it saves an fsync per upsert while many tuners write at once.
        self._conn.execute("PRAGMA synchronous=NORMAL")

    def _check_existing_schema(self) -> None:
        # the tables read once: a tuner creating the winners table between two reads would look like another
        # program's file to a second one opening it at the same time
        names = self._db.table_names()
        if TABLE in names:
            _check_schema(self._db)  # another program's table: not damage, never moved aside nor written
        elif names:  # another program's tables, and no winners table: not ours to add one to
            raise _ForeignSchema(f"no {TABLE!r} table; it holds {', '.join(names[:5])}: another program's file")

    def _ensure_schema(self) -> None:
        if self._db.table(TABLE).exists():
            return
        # IMMEDIATE so that processes starting together create the table once, one after another.
        with self._write_transaction():
            _create_schema(self._db)

    def _write_transaction(self) -> contextlib.AbstractContextManager[None]:
        return _write_transaction(self._conn)

    @contextlib.contextmanager
    def _locked_is_an_error(self) -> Iterator[None]:
        """A lock still held after the retries' deadline: a KernelgenRuntimeError naming the file."""
        try:
            yield
        except sqlite3.OperationalError as error:
            if not _is_locked(error):
                raise
            raise KernelgenRuntimeError(
                f"the tuning database {self.path} is locked by another process ({_one_line(error)}, still after "
                f"{LOCKED_RETRY_DEADLINE_S:g} s); try again once it ends") from None

    def _run(self, operation: Callable[[], _T]) -> _T:
        """Run one DB operation: retried while locked; on a file corrupted since we opened it,
        recovered once and run again on the new DB."""
        with self._lock, self._locked_is_an_error():
            try:
                return _retry_while_locked(operation)
            except sqlite3.DatabaseError as error:
                if not _is_corruption(error) or self.read_only is not None:  # read-only: nothing to recover into
                    raise
                self._conn.close()
                self._recover(error)
                self._conn = self._connect()
                self._db = sqlite_utils.Database(self._conn)
                _retry_while_locked(self._enable_wal)
                _retry_while_locked(self._ensure_schema)
                return _retry_while_locked(operation)

    def _recover(self, error: sqlite3.DatabaseError) -> None:
        """Move the corrupted file aside (never delete it: it may hold hours of tuning) and start a new one holding
        the rows SQLite can still read from it; the caller then connects to the new file."""
        with self._recovery_lock():
            # Another process may have recovered while we waited: check again before moving anything,
            # or we would move its fresh DB aside.
            try:
                with contextlib.closing(self._connect()) as conn:
                    _retry_while_locked(lambda: _check_integrity(conn))
                return
            except sqlite3.DatabaseError as recheck_error:
                if not _is_corruption(recheck_error):
                    raise
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            os.replace(self.path, aside)
            # A WAL left by the damaged file would be replayed into the new, empty one.
            for suffix in ("-wal", "-shm"):
                sidecar = self.path.with_name(self.path.name + suffix)
                if sidecar.exists():
                    os.replace(sidecar, aside.with_name(aside.name + suffix))
            rows = _readable_rows(aside)
            if rows:
                self._write_salvaged(rows)
            logger.warning("tuning database %s is corrupted (%s); moved it aside to %s and started a new one holding "
                           "the %d rows it could still read", self.path, _one_line(error), aside, len(rows))

    def _write_salvaged(self, rows: list[dict[str, Any]]) -> None:
        with contextlib.closing(self._connect()) as conn:
            db = sqlite_utils.Database(conn)

            def write() -> None:
                with _write_transaction(conn):
                    _create_schema(db)
                    # OR IGNORE: a process that opened the new file meanwhile may have written a fresher row
                    db.table(TABLE).insert_all(rows, pk=KEY_COLUMNS, ignore=True)

            _retry_while_locked(write)

    @contextlib.contextmanager
    def _recovery_lock(self) -> Iterator[None]:
        # A separate lock file: the DB file itself is the thing being replaced.
        if fcntl is None:  # pragma: no cover - Windows
            yield
            return
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------
# The bundled DB and the two together


def read_only_rows(path: str | Path, **filters: Any) -> list[dict]:
    """Rows of a DB file opened read-only (nothing is written, not even its journal mode); [] when the file
    is missing or unreadable (with a warning)."""
    try:
        return rows_of_file(path, **filters)
    except UnreadableDatabase as error:
        logger.warning("%s", error)
        return []


class UnreadableDatabase(KernelgenValueError):
    """A file that is not a readable kernelgen tuning DB: missing, not a file, not SQLite, damaged, or with
    another schema."""


def rows_of_file(path: str | Path, **filters: Any) -> list[dict]:
    """Rows of the tuning DB file at `path`, opened read-only, optionally only those equal to `filters` (as
    `TuningDB.rows`); UnreadableDatabase naming the file and why when it is not one."""
    path = Path(path)
    try:
        db = _connect_read_only(path)
    except sqlite3.DatabaseError as error:
        raise UnreadableDatabase(f"tuning database {path} is unreadable ({error})") from None
    try:
        return _select(db, filters)
    except sqlite3.DatabaseError as error:
        raise UnreadableDatabase(f"tuning database {path} is unreadable ({error})") from None
    finally:
        db.conn.close()


def _connect_read_only(path: Path) -> sqlite_utils.Database:
    """The tuning DB at `path`, opened so that nothing can write to it; sqlite3.DatabaseError saying why when
    it cannot be read as one."""
    if not path.is_file():
        raise sqlite3.DatabaseError("no such file" if not path.exists() else "not a file")
    # mode=ro in a URI: SQLite itself refuses writes, and a missing file is not created.
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    try:
        try:
            _check_integrity(conn)
        except sqlite3.OperationalError as error:
            if not _cannot_write(error):
                raise
            # A WAL file in a directory we cannot write: reading needs its -shm file, which SQLite cannot
            # create. immutable=1 reads the main file alone (results still only in the -wal are not seen),
            # which is sound only where no -journal or -wal holds changes the main file lacks: a crashed
            # writer's transaction (to roll back), or a checkpoint cut off midway, which only a writable open
            # applies. Read otherwise, the main file could give rows no writer ever committed.
            conn.close()
            sides = (path.with_name(f"{path.name}-journal"), path.with_name(f"{path.name}-wal"))
            pending = [side.name for side in sides if side.is_file() and side.stat().st_size > 0]
            if pending:
                raise sqlite3.DatabaseError(f"{pending[0]} holds changes that only an open that can write applies; "
                                            f"it cannot be read consistently here") from None
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True,
                                   check_same_thread=False)
            _check_integrity(conn)
        db = sqlite_utils.Database(conn)
        _check_schema(db)
        return db
    except BaseException:
        conn.close()
        raise


class _ForeignSchema(sqlite3.DatabaseError):
    """A healthy SQLite file that is not a kernelgen tuning DB (another program's, or another layout)."""


def _check_schema(db: sqlite_utils.Database) -> None:
    """_ForeignSchema unless the DB has a winners table with the columns kernelgen reads."""
    if not db.table(TABLE).exists():
        raise _ForeignSchema(f"no {TABLE!r} table")
    missing = [name for name in REQUIRED_COLUMNS if name not in db.table(TABLE).columns_dict]
    if missing:
        raise _ForeignSchema(f"its {TABLE!r} table lacks the columns {missing}: not a kernelgen tuning DB")
    # Another key (a layout with more key columns) makes kernelgen's lookups ambiguous and its upserts fail.
    pks = db.table(TABLE).pks
    if set(pks) != set(KEY_COLUMNS):
        raise _ForeignSchema(f"its {TABLE!r} table's primary key is {pks}, not {list(KEY_COLUMNS)}: another layout")


def _open_read_only(path: Path, what: str = "bundled tuning database") -> sqlite_utils.Database | None:
    """The bundled DB, opened so that nothing can write to it; None (with a warning) if unusable."""
    try:
        return _connect_read_only(path)
    except sqlite3.DatabaseError as error:
        logger.warning("%s %s is unreadable (%s); skipping it", what, path, error)
        return None


def _user_db_for_lookups() -> TuningDB:
    """The user DB; where another process keeps it locked past the wait, an empty stand-in, so that dispatch
    serves the bundled winners rather than waiting again at every lookup."""
    try:
        return TuningDB()
    except KernelgenRuntimeError as error:
        logger.warning("%s; this process looks up the bundled winners without it", error)
        return TuningDB.without_file(None, _one_line(error))


class Winners:
    """Tuned configs from the user DB first, then from the bundled read-only DB.

    A user row always takes precedence: it was measured on this machine.
    """

    def __init__(self, user: TuningDB | None = None, bundled_path: str | Path = BUNDLED_DB_PATH):
        self._user = user
        self.bundled_path = Path(bundled_path)
        self._bundled = _open_read_only(self.bundled_path)
        self._lock = threading.Lock()  # the bundled connection is shared between threads

    @property
    def user(self) -> TuningDB | None:
        """The user DB (default path), opened once its file exists: serving the bundled winners before any tune
        creates no cache directory and no file. None until then."""
        with self._lock:
            if self._user is None and default_user_db_path().is_file():
                self._user = _user_db_for_lookups()
            return self._user

    def lookup(
        self,
        *,
        spec_key: str,
        role: str,
        backend: str,
        arch: str,
        gpu_name: str,
        dtype: str,
        bucket: int,
        fingerprint: Fingerprint,
        usable: Callable[[dict], bool] | None = None,
    ) -> dict | None:
        """As `TuningDB.lookup`, with `source` ("user" or "bundled") added to the row."""
        key = dict(spec_key=spec_key, role=role, backend=backend, arch=arch, gpu_name=gpu_name,
                   dtype=dtype, bucket=bucket, fingerprint=fingerprint, usable=usable)
        user = self.user
        row = user.lookup(**key) if user is not None else None
        if row is not None:
            return {**row, "source": "user"}
        row = self._query_bundled(lambda db: _lookup(db, **key))
        return None if row is None else {**row, "source": "bundled"}

    def servable(self, fingerprint: Fingerprint, **key: Any) -> list[dict]:
        """As `TuningDB.servable`, over both DBs: the user's rows first, each with its `source`."""
        user = self.user
        rows = [] if user is None else [{**row, "source": "user"} for row in user.servable(fingerprint, **key)]
        bundled = self._query_bundled(lambda db: _servable(db, fingerprint, **key)) or []
        return rows + [{**row, "source": "bundled"} for row in bundled]

    def _query_bundled(self, query: Callable[[sqlite_utils.Database], _T]) -> _T | None:
        """`query` on the bundled DB; None without one. A damaged file, or a schema from another version,
        is skipped for good (with a warning), never a crash of dispatch."""
        with self._lock:
            if self._bundled is None:
                return None
            try:
                return query(self._bundled)
            except sqlite3.DatabaseError as error:
                logger.warning("bundled tuning database %s is unreadable (%s); skipping it",
                               self.bundled_path, error)
                self._bundled.close()
                self._bundled = None
                return None


def write_bundled_db(path: str | Path, rows: Iterable[dict] = ()) -> Path:
    """Write a fresh DB at `path` holding `rows` (as returned by `TuningDB.rows`), fit to ship.

    It uses a rollback journal, not WAL: a WAL database cannot be opened read-only from a read-only
    directory (site-packages), which is where a wheel puts it. The file is replaced atomically.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.unlink(missing_ok=True)
    db = sqlite_utils.Database(partial)
    try:
        db.execute("PRAGMA journal_mode=delete")
        with db.atomic():
            _create_schema(db)
            records = [{name: row.get(name) for name in SCHEMA} for row in rows]
            for record in records:
                if not isinstance(record["config"], str):
                    record["config"] = json.dumps(record["config"], sort_keys=True)
                if record["timestamp"] is None:  # a row of a table made elsewhere, without the column: time unknown
                    record["timestamp"] = ""
            db.table(TABLE).insert_all(records, pk=KEY_COLUMNS)
        db.execute("VACUUM")  # compact: this file is committed to the repository
        db.close()
        os.replace(partial, path)
    except BaseException:
        db.close()
        partial.unlink(missing_ok=True)  # a failed write leaves no half-made file beside the target
        raise
    return path


def _kept(old: dict, new: dict) -> dict:
    """Of two rows of one key, the one `TuningDB.upsert` keeps had both been written in the order measured: of
    one fingerprint the faster, of two the later measured (an earlier one's stack is gone)."""
    if Fingerprint.from_row(old) == Fingerprint.from_row(new):
        return new if new["median_ms"] < old["median_ms"] else old
    # a table made elsewhere with only the columns kernelgen reads has no timestamps: such a row counts as older
    return new if (new.get("timestamp") or "") > (old.get("timestamp") or "") else old


def _is_wal_file(path: Path) -> bool:
    """Whether `path` is an SQLite file in WAL mode (header bytes 18-19 are 2, SQLite's file format docs)."""
    try:
        with open(path, "rb") as file:
            header = file.read(20)
    except OSError:
        return False
    return header.startswith(b"SQLite format 3\x00") and header[18:20] == b"\x02\x02"


def merge_into_bundled(paths: Iterable[str | Path], bundled: str | Path = BUNDLED_DB_PATH) -> list[dict]:
    """Merge the winners of other DB files (GPU machines' user DBs) into the bundled DB file: a row of theirs
    replaces the bundled row of the same key, every other bundled row is kept. Rows of one key in several of
    `paths` merge as one DB keeps them (`_kept`), whatever their order. Returns the rows."""
    bundled = Path(bundled)
    if _is_wal_file(bundled):
        # A WAL file is a user DB that tuners write: replacing it would drop rows written meanwhile.
        raise KernelgenValueError(f"{bundled} is a user tuning DB (WAL journal), which tuners may be writing: "
                                  f"bundle it into a new file instead (`kernelgen db bundle {bundled} FILE... --into "
                                  "NEW.db`), or into the bundled DB file")
    # read-only, and strictly: a file that is not a tuning DB is an error, never merged as empty or overwritten
    rows = {tuple(r[c] for c in KEY_COLUMNS): r for r in (rows_of_file(bundled) if bundled.exists() else [])}
    merged: dict[tuple, dict] = {}
    dropped = 0
    for path in paths:
        for row in rows_of_file(path):
            key = tuple(row[c] for c in KEY_COLUMNS)
            if key in merged:
                dropped += 1
                row = _kept(merged[key], row)
            merged[key] = row
    if dropped:
        logger.info("%d merged rows had a faster or later measured row of the same key in another file; "
                    "that one is kept", dropped)
    rows.update(merged)
    write_bundled_db(bundled, rows.values())
    return list(rows.values())

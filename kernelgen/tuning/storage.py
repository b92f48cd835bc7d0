"""Where tuning studies live: an Optuna storage, named by a URL that every tuning process can open.

    sqlite:///path/optuna.db              an SQLite file (one host; its writers take turns)
    postgresql://user@host/db, mysql://...  an RDB server (any SQLAlchemy URL Optuna's RDBStorage takes)
    journal:///path/study.log             Optuna's journal file (JournalStorage over JournalFileBackend):
                                          appends under a file lock, no server, fit for a file system
                                          that several hosts mount
    /path/optuna.db                       a plain path: an SQLite file

`parse_storage` checks a URL without opening anything (the CLI validates `--storage` with it);
`open_storage` opens it (a journal's last line cut off mid-append by a killed tuner is cut off on opening
and before each append).
Without a storage, a single-worker tune keeps its studies in `cache_dir()/optuna.db` and a tune of several
workers in the journal `cache_dir()/optuna-journal.log`.
"""
from __future__ import annotations

import logging
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import KernelgenRuntimeError, KernelgenValueError

__all__ = ["StorageURL", "parse_storage", "open_storage", "default_storage", "HEARTBEAT_S", "GRACE_S"]

SCHEMA_ATTEMPTS = 6  # opening a new RDB storage while other processes create its tables: tries, 0.1 s apart, doubling
HEARTBEAT_S, GRACE_S = 30, 120  # RDB storages: a RUNNING trial whose tuner stopped beating for GRACE_S is stale
log = logging.getLogger("kernelgen")
RDB_BACKENDS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_EXPECTED = ("expected sqlite:///PATH, postgresql://USER@HOST/DB (or another SQLAlchemy URL), "
             "journal:///PATH, or a file path")


@dataclass(frozen=True)
class StorageURL:
    """A checked storage: kind "rdb" (url: the SQLAlchemy URL) or "journal" (url: journal://ABSOLUTE_PATH)."""

    kind: str
    url: str

    @property
    def journal_path(self) -> Path:
        return Path(self.url[len("journal://"):])

    def __str__(self) -> str:
        return self.url


def parse_storage(text: str | Path, name: str = "storage") -> StorageURL:
    """Check a storage URL (or path) and make it absolute; KernelgenValueError naming what is wrong, the storage
    called `name` (the command line's "--storage")."""
    text = str(text).strip()
    if not text:
        raise KernelgenValueError(f"{name} is empty; {_EXPECTED}")
    if "://" not in text:
        if _SCHEME.match(text) and not text.startswith(("./", "/")):
            raise KernelgenValueError(f"{name} {text!r} is not a URL (no '://'); {_EXPECTED}")
        return StorageURL("rdb", f"sqlite:///{_file(text, 'storage')}")
    scheme = text.split("://", 1)[0].lower()
    if scheme == "journal":
        path = text.split("://", 1)[1]
        if not path:
            raise KernelgenValueError(f"{name} {text!r} names no journal file; expected journal:///PATH")
        return StorageURL("journal", f"journal://{_file(path, 'journal file')}")
    from sqlalchemy.engine import make_url

    try:
        url = make_url(text)
    except Exception as error:  # noqa: BLE001 - SQLAlchemy raises ArgumentError or ValueError (a port, say)
        raise KernelgenValueError(f"{name} {text!r} is not a database URL ({error}); {_EXPECTED}") from None
    backend = url.get_backend_name()
    if backend not in RDB_BACKENDS:
        raise KernelgenValueError(f"{name} {text!r}: unknown scheme {scheme!r}; {_EXPECTED}")
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise KernelgenValueError(f"{name} {text!r} names no SQLite file (an in-memory database is no "
                                      "place to share a study); expected sqlite:///PATH")
        return StorageURL("rdb", f"sqlite:///{_file(url.database, 'SQLite file')}")
    if not url.database:
        raise KernelgenValueError(f"{name} {text!r} names no database; expected {backend}://USER@HOST/DB")
    return StorageURL("rdb", text)


def _file(path: str, what: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if resolved.is_dir():
        raise KernelgenValueError(f"the {what} {resolved} is a directory; expected a file")
    return resolved


def default_storage(workers: int) -> StorageURL:
    """The cache dir's storage: the SQLite file for one worker, the journal file for several (SQLite's
    single writer would make them queue); KernelgenRuntimeError when the cache dir cannot be written."""
    from ..codegen.cache import cache_dir, unwritable

    path = cache_dir() / ("optuna.db" if workers == 1 else "optuna-journal.log")
    problem = unwritable(path.parent)
    if problem is not None:
        raise KernelgenRuntimeError(f"the tuner's study storage {path} cannot be written ({problem}); set "
                                    "KERNELGEN_CACHE_DIR to a writable directory")
    return parse_storage(f"journal://{path}" if workers > 1 else path)


def _cut_torn_tail(path: Path, lock=None) -> None:
    """Cut off a journal's last line when it lacks its newline: an append cut short (a tuner killed while
    writing, a full disk). Optuna skips such a line, but its next append would join it and make that line, and
    so every later one, unreadable. Under Optuna's own append lock (`lock`, the file's default one where not
    given) no append is in flight, so the line is torn."""
    from optuna.storages.journal import JournalFileSymlinkLock  # JournalFileBackend's default lock

    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = lock or JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        with open(path, "rb+") as journal:
            size = journal.seek(0, os.SEEK_END)
            journal.seek(size - 1)
            if journal.read(1) == b"\n":
                return
            journal.seek(0)
            if not journal.read(11) == b'{"op_code":':  # not a journal: left as it is
                return
            keep = size
            while keep > 0:  # back to the last newline, a block at a time: a journal may be large
                start = max(0, keep - 65536)
                journal.seek(start)
                block = journal.read(keep - start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                keep = start
            journal.truncate(keep)
            os.fsync(journal.fileno())
    finally:
        lock.release()
    log.warning("storage journal://%s ended in a line cut off mid-append (%d bytes, a tuner killed while writing); "
                "cut it off", path, size - keep)


def _journal_file(path: Path):
    """Optuna's journal file backend, whose every append first cuts off a torn last line (`_cut_torn_tail`): a
    tuner that opened the journal before another was killed mid-append still appends lines of their own."""
    from optuna.storages.journal import JournalFileBackend

    class MendingJournalFile(JournalFileBackend):
        def append_logs(self, logs) -> None:
            _cut_torn_tail(path, self._lock)
            super().append_logs(logs)

    return MendingJournalFile(str(path))


def open_storage(storage: StorageURL):
    """The Optuna storage object of a checked URL (its file's directory made when missing)."""
    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

    sqlite = storage.url.startswith("sqlite:")
    try:
        if storage.kind == "journal":
            storage.journal_path.parent.mkdir(parents=True, exist_ok=True)
            _cut_torn_tail(storage.journal_path)
            return optuna.storages.JournalStorage(_journal_file(storage.journal_path))
        if sqlite:
            Path(storage.url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a directory that cannot be made, a file that cannot be read or locked
        raise KernelgenRuntimeError(f"storage {storage.url} cannot be opened: {error}") from None
    except (ValueError, KeyError, AssertionError) as error:
        # lines that are not JSON (ValueError), or JSON without Optuna's operations (KeyError: no op_code;
        # AssertionError: one it does not know) as Optuna replays them: another program's file
        raise KernelgenValueError(f"storage {storage.url} is not an Optuna journal file ({type(error).__name__}: "
                                  f"{error}); name a journal that kernelgen tune wrote, or a new file") from None
    try:
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return optuna.storages.RDBStorage(
                        storage.url, engine_kwargs={"connect_args": {"timeout": 60}} if sqlite else None,
                        heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
            except (IntegrityError, OperationalError) as error:
                # processes that open a new storage at once each create its tables and version row: the ones that
                # lose the race find them made, and open it again
                if attempt + 1 == SCHEMA_ATTEMPTS or not isinstance(error, IntegrityError) and \
                        "already exists" not in str(error):
                    raise
                time.sleep(0.1 * 2 ** attempt)
    except ImportError as error:  # the database's driver (psycopg2, say) is not installed
        raise KernelgenValueError(f"storage {storage.url}: {error}; install the database's Python driver") from None
    except (SQLAlchemyError, RuntimeError) as error:  # no server there, refused credentials, ...; RuntimeError:
        # tables another Optuna version set up (`optuna storage upgrade` migrates them)
        raise KernelgenRuntimeError(f"storage {storage.url} cannot be opened: {' '.join(str(error).split())[:300]}") \
            from None

"""The content-addressed cache of rendered kernel modules, and where kernelgen keeps its files.

Triton's @jit reads its function's source from the file, so rendered text is written to
`<cache>/kernels/<name>.py` (name = hash of the text; written once, atomically) and imported from there.
When the cache cannot be written (a read-only home, a read-only container image), the modules go to a
private temporary directory instead, one per process, removed at exit.
"""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["cache_dir", "kernels_dir", "unwritable", "load_module"]

log = logging.getLogger("kernelgen")
_modules: dict[str, ModuleType] = {}
_private_kernels: Path | None = None  # this process's own kernels directory, once made
_private_lock = threading.Lock()


def cache_dir() -> Path:
    """`$KERNELGEN_CACHE_DIR`, else the platform's user cache dir for kernelgen (not created here: it may
    be read-only, see `unwritable`)."""
    if os.environ.get("KERNELGEN_CACHE_DIR"):
        # ~ expanded: a value quoted in a shell, or set by a Dockerfile's ENV, reaches us unexpanded
        return Path(os.environ["KERNELGEN_CACHE_DIR"]).expanduser()
    import platformdirs  # here: an exported module embeds this file and replaces cache_dir

    return Path(platformdirs.user_cache_dir("kernelgen"))


def unwritable(directory: Path, create: bool = True) -> str | None:
    """Why no file can be created in `directory` (made when missing), or None when one can. Tried rather than
    read from permission bits: root ignores those, while a read-only mount or an immutable directory refuses
    root too. With create=False a missing `directory` is left missing: its nearest existing ancestor, where it
    would be made, is tried instead."""
    directory = Path(directory)
    if not create:
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
        if not directory.is_dir():
            return "not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kernelgen-probe-")
    except FileExistsError:
        return "not a directory"
    except OSError as error:
        return error.strerror or str(error)
    os.close(fd)
    os.unlink(probe)
    return None


def untrusted(directory: Path) -> str | None:
    """Why modules imported from `directory` could hold another user's code, or None: it (or its parent, which
    could swap it) is a symbolic link, another user's, or writable by others, who could then plant a module, whose
    file the compilers read their kernels' source from (a shared temporary directory's predictable name, made first
    by someone else)."""
    if not hasattr(os, "getuid"):  # no owners to compare (Windows): its user dirs are the user's own
        return None
    for path in (directory, directory.parent):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            return f"{path} is a symbolic link"
        if info.st_uid != os.getuid():
            return f"{path} belongs to another user (uid {info.st_uid})"
        # writable by its group counts only for a group not the user's own (a umask of 002 gives the user's
        # private group write); a sticky parent (/tmp) lets no one else rename or remove what it holds
        others = info.st_mode & stat.S_IWOTH or info.st_mode & stat.S_IWGRP and info.st_gid != os.getgid()
        if others and not (path == directory.parent and info.st_mode & stat.S_ISVTX):
            return f"{path} is writable by others"
    return None


def kernels_dir() -> Path:
    """Where rendered kernel modules are written: the cache dir's kernels/, else, when that cannot be written,
    this process's private temporary directory (made once, with one warning, and removed at exit)."""
    global _private_kernels
    shared = cache_dir() / "kernels"
    problem = unwritable(shared) or untrusted(shared)
    if problem is None:
        return shared
    with _private_lock:
        if _private_kernels is None:
            _private_kernels = Path(tempfile.mkdtemp(prefix="kernelgen-kernels-"))
            atexit.register(shutil.rmtree, _private_kernels, ignore_errors=True)
            log.warning("kernelgen cannot write kernel modules to %s (%s); this process writes them to %s",
                        shared, problem, _private_kernels)
    return _private_kernels


def _write_once(path: Path, text: str) -> None:
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return
    except OSError:  # absent, or unreadable: written anew (the directory's permissions decide, not the file's)
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: concurrent writers of the same name write the same bytes


def load_module(name: str, source: str, directory: Path | None = None) -> ModuleType:
    """Import rendered `source` as module `name` (memoised per process), from `directory`/<name>.py
    (default: `kernels_dir()`)."""
    mod = _modules.get(name)
    if mod is not None:
        return mod
    path = (kernels_dir() if directory is None else Path(directory)) / f"{name}.py"
    _write_once(path, source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    # compiled from the source in hand, never from cached bytecode, which a damaged __pycache__ file would break;
    # the file stays the module's, for the compilers that read their kernels' source from it. dont_inherit: not
    # this file's `from __future__ import annotations` (TileLang evaluates its kernels' annotations)
    exec(compile(source, str(path), "exec", dont_inherit=True), mod.__dict__)  # noqa: S102 - kernelgen's own module
    log.debug("loaded kernel module %s from %s", name, path)
    _modules[name] = mod
    return mod

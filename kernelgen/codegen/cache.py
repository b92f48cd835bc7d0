"""The content-addressed cache of rendered kernel modules, and where kernelgen keeps its files.

Triton's @jit reads its function's source from the file, so rendered text is written to
`<cache>/kernels/<name>.py` (name = hash of the text; written once, atomically) and imported from there.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["cache_dir", "load_module"]

log = logging.getLogger("kernelgen")
_modules: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    """`$KERNELGEN_CACHE_DIR`, else the platform's user cache dir for kernelgen."""
    if os.environ.get("KERNELGEN_CACHE_DIR"):
        path = Path(os.environ["KERNELGEN_CACHE_DIR"])
    else:  # imported here: an exported module embeds this file and always passes its directory
        import platformdirs

        path = Path(platformdirs.user_cache_dir("kernelgen"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_once(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: concurrent writers of the same name write the same text


def load_module(name: str, source: str, directory: Path | None = None) -> ModuleType:
    """Import rendered `source` as module `name` (memoised per process), from `directory`/<name>.py
    (default: the cache dir's kernels/)."""
    mod = _modules.get(name)
    if mod is not None:
        return mod
    path = (cache_dir() / "kernels" if directory is None else Path(directory)) / f"{name}.py"
    _write_once(path, source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    log.debug("loaded kernel module %s from %s", name, path)
    _modules[name] = mod
    return mod

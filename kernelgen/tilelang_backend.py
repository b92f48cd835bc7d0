"""TileLang backend: render the Jinja templates under `templates/tilelang/`, import the rendered
module, lower its prim_func to CUDA source and compile it to a cubin.

Nothing here needs a GPU: lowering is pure TVM, and `tilelang.compile` only runs nvcc and builds a
host wrapper (launching the kernel is what needs a device). TileLang's front end reads a kernel's
Python source with `inspect`, so a rendered module is always imported from a real file, stored
content-addressed (`<name>_<sha256[:16]>.py`) under the kernelgen cache dir and written only when
absent, so the file that produced a kernel can always be read back.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "ARCH",
    "ATTN_OUT_IDX",
    "templates_dir",
    "render_attn",
    "load_module",
    "build_attn",
    "lower",
    "compile_kernel",
]

log = logging.getLogger("kernelgen")

ARCH = "sm_90a"
# attn_fwd(Q, K, V, block_idx, scale, O, LSE): O and LSE are allocated and returned by the kernel
ATTN_OUT_IDX = [5, 6]
_DTYPES = ("bfloat16", "float16")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def templates_dir() -> Path:
    """`templates/` inside the installed package if present (wheel), else the repository's."""
    here = Path(__file__).resolve().parent
    inside = here / "templates"
    return inside if inside.is_dir() else here.parent / "templates"


@lru_cache(maxsize=1)
def _env():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _canonical_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"TileLang attention supports dtype in {_DTYPES}, got {dtype!r}")
    return name


def render_attn(causal: bool, dtype: str) -> str:
    """Source of the forward module for one structure (causal or not, dtype); its `build(**shape, **config)`
    returns the prim_func."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return _env().get_template("tilelang/attn_fwd.py.j2").render(causal=causal, dtype=_canonical_dtype(dtype))


def _cache_dir() -> Path:
    root = os.environ.get("KERNELGEN_CACHE_DIR")
    if root is None:
        import platformdirs

        root = platformdirs.user_cache_dir("kernelgen")
    path = Path(root) / "tilelang"
    path.mkdir(parents=True, exist_ok=True)
    return path


_modules: dict[str, ModuleType] = {}


def load_module(source: str, name: str = "attn_fwd") -> ModuleType:
    """Import rendered source from a content-addressed file (reused when the content is the same)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"kernelgen_tilelang_{name}_{digest}"
    if mod_name in _modules:
        return _modules[mod_name]
    path = _cache_dir() / f"{name}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: concurrent writers produce the same bytes
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # inspect.getsource (TileLang's parser) looks modules up here
    spec.loader.exec_module(module)
    _modules[mod_name] = module
    return module


def build_attn(**kwargs: Any):
    """Render, load and build in one call: `build_attn(causal=..., dtype=..., <shape>, <config>)`."""
    causal, dtype = kwargs["causal"], _canonical_dtype(kwargs["dtype"])
    module = load_module(render_attn(causal, dtype))
    return module.build(**{**kwargs, "dtype": dtype})


def _target(arch: str):
    from tilelang import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch})


def lower(prim_func, arch: str = ARCH) -> str:
    """CUDA source of `prim_func` for `arch` (no nvcc, no GPU)."""
    import tilelang
    from tilelang import tvm

    target = _target(arch)
    t0 = time.perf_counter()
    with tvm.transform.PassContext(opt_level=3), target:
        artifact = tilelang.lower(prim_func, target=target)
    log.debug("tilelang lower %s: %.2fs", arch, time.perf_counter() - t0)
    return artifact.kernel_source


def compile_kernel(prim_func, arch: str = ARCH, out_idx: list[int] | None = None, **kwargs: Any):
    """`tilelang.JITKernel` with the cubin built by nvcc for `arch`.

    Works on a machine without a GPU: TileLang only needs nvcc to build and a GPU to launch. Its
    own on-disk cache (TILELANG_CACHE_DIR, ~/.tilelang/cache by default) makes a repeat instant.
    """
    import tilelang

    t0 = time.perf_counter()
    kernel = tilelang.compile(
        prim_func,
        out_idx=ATTN_OUT_IDX if out_idx is None else out_idx,
        target={"kind": "cuda", "arch": arch},
        **kwargs,
    )
    log.debug("tilelang compile %s: %.2fs", arch, time.perf_counter() - t0)
    return kernel

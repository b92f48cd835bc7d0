"""Render kernel source from a spec (structure) and a config (recorded in the module header).

Templates live in the top-level `templates/` of the repository; an installed wheel carries them
inside the package. Rendering is deterministic: the same spec and config give the same text, and the
module name is derived from that text.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jinja2

from .spec import Spec

__all__ = ["TEMPLATE_DIR", "render", "module_name", "template_hash", "TEMPLATES"]


def _find_template_dir() -> Path:
    installed = Path(__file__).parent / "templates"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "templates"


TEMPLATE_DIR = _find_template_dir()

# role -> template, per backend (Gluon specs select with the Triton selector, as TileLang specs do in
# get_kernel; the TileLang selector is tested, not served)
TEMPLATES = {
    "triton": {"attn": "triton/attn_fwd.py.j2", "select": "triton/select.py.j2"},
    "tilelang": {"attn": "tilelang/attn_fwd.py.j2", "select": "tilelang/select.py.j2"},
    "gluon": {"attn": "gluon/attn_fwd.py.j2", "select": "triton/select.py.j2"},
}


@functools.lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,  # a line holding only a block tag leaves no trace in the Python it renders
        lstrip_blocks=True,
        autoescape=False,
    )


def context(spec: Spec) -> dict:
    """What the templates may branch on: structure only."""
    return {
        "spec_json": spec.to_json(),
        "causal": spec.causal,
        "groups": spec.groups,
        "forced": spec.n_forced > 0,
    }


def render(spec: Spec, role: str, config=None, **extra) -> str:
    """Source of one role's kernels. `extra` adds structure the spec does not fix (TileLang: dtype)."""
    try:
        name = TEMPLATES[spec.backend][role]
    except KeyError:
        raise ValueError(f"no template for backend={spec.backend!r}, role={role!r}") from None
    source = _env().get_template(name).render(**context(spec), **extra)
    if config is not None:
        source += f"\n# config: {config.to_json()}\n"
    return source


def module_name(spec: Spec, role: str, source: str) -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"kg_{spec.backend}_{role}_{digest}"


@functools.lru_cache(maxsize=None)
def template_hash(backend: str | None = None, role: str | None = None) -> str:
    """Hash of the template of one (backend, role), part of the tuning DB's toolchain fingerprint of
    that role's winners: editing the selector's template leaves the attention winners valid. Without
    arguments, of every template file."""
    if backend is None and role is None:
        paths = sorted(TEMPLATE_DIR.rglob("*.j2"))
    else:
        try:
            paths = [TEMPLATE_DIR / TEMPLATES[backend][role]]
        except KeyError:
            raise ValueError(f"no template for backend={backend!r}, role={role!r}") from None
    h = hashlib.sha256()
    for path in paths:
        h.update(path.relative_to(TEMPLATE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]

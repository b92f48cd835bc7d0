"""Render kernel source from a template, a spec and a config (recorded in the module's last line).

Templates live in the top-level `templates/<backend>/<role>.py.j2` of the repository; an installed wheel
carries them inside the package. Rendering is deterministic: the same spec and config give the same
text, and the module name is derived from that text.

What Jinja decides: only text that the kernel language cannot produce itself, which is the module
header (the spec, for a reader of the rendered file) and code repeated verbatim in two places of one
kernel (macros). Every spec field a kernel branches on reaches it as a compile-time constant of its
own language (`tl.constexpr` in Triton and Gluon, an argument of the prim_func factory in TileLang),
so that the language specialises the branch, as it does for tunables.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jinja2

from ..spec import Spec

__all__ = ["TEMPLATE_DIR", "template_path", "template_files", "render", "module_name"]


def _find_template_dir() -> Path:
    installed = Path(__file__).resolve().parent.parent / "templates"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent.parent / "templates"


TEMPLATE_DIR = _find_template_dir()


def template_path(template: str | Path) -> Path:
    """A template named relative to templates/ (or given by an absolute path)."""
    path = Path(template)
    return path if path.is_absolute() else TEMPLATE_DIR / path


def template_files(template: str | Path) -> list[Path]:
    """The template's file, then every template it includes or imports (recursively, each once): what its
    rendered kernels' source depends on."""
    import jinja2.meta

    first = template_path(template)
    files, pending = [first], [first]
    while pending:
        path = pending.pop()
        env = _env(path.parent)
        for name in jinja2.meta.find_referenced_templates(env.parse(path.read_text())):
            included = path.parent / name
            if name is not None and included not in files:
                files.append(included)
                pending.append(included)
    return files


@functools.lru_cache(maxsize=None)
def _env(directory: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,  # a line holding only a block tag leaves no trace in the Python it renders
        lstrip_blocks=True,
        autoescape=False,
    )


def render(template: str | Path, spec: Spec, config=None, **extra) -> str:
    """Source of one template's kernels for `spec`; `extra` adds text the kernel language cannot
    produce itself (TileLang: the dtype, a string in its type annotations)."""
    path = template_path(template)
    if not path.is_file():
        raise FileNotFoundError(f"no template {path}")
    source = _env(path.parent).get_template(path.name).render(spec_json=spec.to_json(), **extra)
    if config is not None:
        source += f"\n# config: {config.to_json()}\n"
    return source


def module_name(backend: str, role: str, source: str) -> str:
    """kg_<backend>_<role>_<hash of the text>: one module per distinct source."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"kg_{backend}_{role}_{digest}"

"""export_module(spec, path): one standalone .py file that computes what `get_kernel(spec)` computes.

The exported file needs only torch and triton (Gluon is part of Triton), plus tilelang for a TileLang spec
(no kernelgen, jinja2 or platformdirs), and is assembled from kernelgen's own sources, so that nothing is
written twice:

  header      kernelgen version, spec JSON, configs, date
  embedded    kernelgen/spec.py, config.py and ops.py verbatim, relative imports resolved in place:
              ops.py stays the one place for validation, list conversion/normalisation and launch
  ops         a namespace of what ops.py defines, taken right after it (SparseAttention calls `ops.select`;
              the module-level `select` below is the public launcher)
  kernels     render(spec, "select", cfg) and render(spec, "attn", cfg): the selector is the Triton twin's
              for every backend (as get_kernel runs it), the forward Triton's or Gluon's; the TileLang
              forward, rendered per dtype, is embedded as text with kernelgen/compile.py and
              tilelang_backend.py, which import it from a file at first use (TileLang reads kernel source
              with `inspect`) and compile it per shape
  dispatch    class SparseAttention from kernelgen/dispatch.py verbatim
  launcher    SPEC, CONFIGS, `kernel` (a SparseAttention whose kernel modules are this file's kernels and
              whose configs are baked in), attn(q, k, v, *, block_idx=None, scale=None, return_lse=False),
              select(q, k) and prepare(block_idx, seq_q, seq_k)

All sections share one namespace (Triton's @jit resolves a kernel's globals in its module and reads its
source from a real file); export refuses a file in which two sections bind one name differently, or in
which an embedded module imports anything beyond the standard library, torch and triton.

The skeleton (header, launcher) lives here rather than in templates/, which hold kernels only: each
kernel template's hash (render.template_hash(backend, role)) is part of its tuned winners' fingerprint.
"""
from __future__ import annotations

import ast
import dataclasses
import datetime
import json
import os
import pprint
import sys
import tempfile
import textwrap
from pathlib import Path

from . import compile as _compile_module
from . import config as _config_module
from . import dispatch as _dispatch_module
from . import ops as _ops_module
from . import spec as _spec_module
from . import tilelang_backend as _tilelang_module
from .config import check_config, default_config
from .render import module_name, render
from .spec import Spec

__all__ = ["export_module", "ExportError"]

# Embedded whole, in dependency order: (module, file); TileLang specs add the module loader and backend.
_EMBEDDED = (("spec", _spec_module), ("config", _config_module), ("ops", _ops_module))
_EMBEDDED_TILELANG = (("compile", _compile_module), ("tilelang_backend", _tilelang_module))
_ALLOWED_ROOTS = frozenset(sys.stdlib_module_names) | {"torch", "triton"}
_ROLES = ("select", "attn")  # the roles an exported module launches
_PUBLIC = ("SPEC", "CONFIGS", "kernel", "attn", "select", "prepare")


class ExportError(RuntimeError):
    """kernelgen's sources cannot be assembled into a standalone module (an import or a name clash)."""


def export_module(spec: Spec, out_path, *, configs: dict | None = None) -> Path:
    """Write one standalone Python module for `spec` to `out_path` (a .py file) and return its path.

    configs   {"attn": AttnConfig (TileLangAttnConfig, GluonAttnConfig), "select": SelectConfig} baked into
              the module. A missing role (or configs=None) gets `kernelgen.config.default_config(spec, role)`;
              to bake in the tuning DB's winners for a length, pass `{r: get_kernel(spec).config(r, n, n,
              dtype, device) for r in ("attn", "select")}` (on the machine whose DB holds them).

    The module has `attn(q, k, v, *, block_idx=None, scale=None, return_lse=False)`, `select(q, k)`,
    `prepare(block_idx, seq_q, seq_k)` (lists normalised once, as SparseAttention.prepare), `SPEC` (the
    spec's fields), `CONFIGS` (the configs' fields) and `kernel` (the SparseAttention behind
    them; `kernel.validate_lists = True` makes repeated ids in given lists an error). Its inputs are checked
    exactly as get_kernel's are (the same code). Without a CUDA device it selects Triton's interpreter
    itself, as `import kernelgen` does. Import it like any module; with importlib, put it in sys.modules
    before exec_module (its dataclasses need that, as kernelgen's compile.load_module does).
    """
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if spec.backend not in ("triton", "tilelang", "gluon"):
        raise ValueError(f"export_module needs spec.backend 'triton', 'tilelang' or 'gluon', got {spec.backend!r}: "
                         "'auto' chooses per GPU from the tuning DB, which an exported module does not carry")
    out_path = Path(out_path)
    if out_path.suffix != ".py":
        raise ValueError(f"out_path must name a .py file (Triton reads kernel source from it), got {out_path}")
    cfgs = _resolve_configs(spec, configs)
    text = assemble(spec, cfgs)
    _write_atomic(out_path, text)
    return out_path


def _resolve_configs(spec: Spec, configs: dict | None) -> dict:
    configs = dict(configs or {})
    unknown = set(configs) - set(_ROLES)
    if unknown:
        raise ValueError(f"configs has unknown roles {sorted(unknown)}; expected a subset of {sorted(_ROLES)}")
    out = {}
    for role in _ROLES:
        cfg = configs.get(role) or default_config(spec, role)
        check_config(spec, role, cfg)
        out[role] = cfg
    return out


# ---- assembly ------------------------------------------------------------------------------------

def assemble(spec: Spec, configs: dict) -> str:
    """The exported module's text (checked: it parses, and its sections share one namespace cleanly)."""
    from . import __version__

    tilelang = spec.backend == "tilelang"
    configs_json = json.dumps({r: dataclasses.asdict(c) for r, c in configs.items()}, sort_keys=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sections: list[tuple[str, str]] = [("header", _HEADER.format(
        version=__version__, spec_json=spec.to_json(), configs_json=configs_json, date=date,
        spec_key=spec.key(), needs="torch, triton and tilelang" if tilelang else "torch and triton"))]

    provided: dict[str, dict[str, str]] = {}  # embedded module -> {name it binds at top level: how}
    for name, module in _EMBEDDED + (_EMBEDDED_TILELANG if tilelang else ()):
        origin = f"kernelgen/{name}.py"
        source = _rewrite_imports(_read_source(module), origin, provided)
        provided[name] = _bindings(source, origin)
        sections.append((origin, source))

    ops_names = sorted(n for n, how in provided["ops"].items()
                       if not n.startswith("__") and not how.startswith("import"))
    sections.append(("ops namespace", _OPS_NAMESPACE.format(
        fields=textwrap.fill(", ".join(f"{n}={n}" for n in ops_names), 100,
                             initial_indent="    ", subsequent_indent="    "))))

    kernel_names = {}
    for role in _ROLES:
        if tilelang and role == "attn":
            continue  # below, as text
        origin = f"rendered {role} kernels"
        source = render(spec.for_role(role), role, configs[role])
        kernel_names[role] = sorted(n for n, sig in _bindings(source, origin).items() if sig.startswith("def "))
        _check_imports(source, origin)
        sections.append((origin, source))
    if tilelang:
        modules = {}
        for dtype in _tilelang_module.DTYPES:
            source = _tilelang_module.attn_source(spec, dtype, configs["attn"])
            modules[dtype] = (module_name(spec, "attn", source), source)
        sections.append(("rendered TileLang forward, one module per dtype", _TILELANG_SOURCES.format(
            modules=pprint.pformat(modules, width=100))))

    dispatch_source = _rewrite_imports(_class_source(_dispatch_module, "SparseAttention"),
                                       "kernelgen/dispatch.py", provided)
    sections.append(("kernelgen/dispatch.py: SparseAttention", dispatch_source))

    kernels = ",\n".join(
        f"    {role!r}: types.SimpleNamespace({', '.join(f'{n}={n}' for n in names)})"
        for role, names in kernel_names.items())
    sections.append(("launcher", _LAUNCHER.format(
        spec_dict=repr(spec.to_dict()),
        configs_dict=repr({r: dataclasses.asdict(c) for r, c in configs.items()}),
        kernels=kernels, public=repr(list(_PUBLIC)), tilelang_kernel=_TILELANG_KERNEL if tilelang else "")))

    _check_namespace(sections)
    parts = []
    for title, source in sections:
        if title != "header":
            parts.append(f"\n\n# {'=' * 98}\n# {title}\n# {'=' * 98}\n")
        parts.append(source if source.endswith("\n") else source + "\n")
    text = "".join(parts)
    compile(text, "<exported module>", "exec")  # a syntax error here is a bug in this file
    return text


def _read_source(module) -> str:
    return Path(module.__file__).read_text()


def _class_source(module, name: str) -> str:
    """The class `name` of `module`, after the module's imports of the standard library, torch and triton
    (its relative imports stay behind: `ops` is the namespace above; the rest is kernelgen-only)."""
    source = _read_source(module)
    lines = source.splitlines(keepends=True)
    imports = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if all(r.split(".")[0] in _ALLOWED_ROOTS for r in roots) and roots != ["__future__"]:
                imports.append(ast.unparse(node) + "\n")
        if isinstance(node, ast.ClassDef) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(imports) + "\n\n" + "".join(lines[first - 1:node.end_lineno])
    raise ExportError(f"{module.__name__} defines no class {name}")


def _rewrite_imports(source: str, origin: str, provided: dict) -> str:
    """`source` with `from __future__` dropped (the module has one at its top) and each relative import
    resolved in the shared namespace: a name from an embedded module is already bound (an `as` becomes an
    assignment); a module-level import of anything else is an ExportError, and one inside a function
    becomes `raise ImportError` (that code path needs kernelgen)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    top = {id(node) for node in tree.body}
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        is_top = id(node) in top
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            new = ["# from __future__ import ... (at the top of this file)"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            target = node.module if node.level == 1 else None
            if target in provided and node.names[0].name != "*":
                missing = [a.name for a in node.names if a.name not in provided[target]]
                if missing:
                    raise ExportError(f"{origin} imports {missing} from .{target}, which does not bind them")
                new = [f"{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
                new = new or [f"{'pass  ' if not is_top else ''}# {ast.unparse(node)} (embedded above)"]
            elif is_top:
                raise ExportError(f"{origin}: module-level `{ast.unparse(node)}` needs a part of kernelgen that "
                                  f"the exported module does not embed; embed it in kernelgen/export.py or move "
                                  f"the import into the function that needs it")
            else:
                new = [f"raise ImportError({ast.unparse(node) + ' needs kernelgen (not in this exported module)'!r})"]
        else:
            if is_top:
                _check_import(node, origin)
            continue
        start, end = node.lineno - 1, node.end_lineno - 1
        head, tail = lines[start][:node.col_offset], lines[end][node.end_col_offset:]
        if head.strip() or tail.split("#")[0].strip():
            raise ExportError(f"{origin}:{node.lineno}: an import that shares its line cannot be rewritten")
        edits.append((start, end, [head + s + "\n" for s in new]))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end + 1] = new
    return "".join(lines)


def _check_import(node, origin: str) -> None:
    roots = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else [node.module.split(".")[0]]
    for root in roots:
        if root not in _ALLOWED_ROOTS:
            raise ExportError(f"{origin} imports {root!r} at module level; the exported module may need only the "
                              f"standard library, torch and triton")


def _check_imports(source: str, origin: str) -> None:
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and (node.level > 0 or node.module == "__future__"):
                raise ExportError(f"{origin}: unexpected `{ast.unparse(node)}`")
            _check_import(node, origin)


def _bindings(source: str, origin: str) -> dict[str, str]:
    """Top-level name -> what binds it: imports and assignments by their text (so that one section may
    repeat another's `import triton`), definitions by a tag unique to the section."""
    out = {}

    def bind(name, sig):
        out[name] = sig

    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    bind(name, f"import {getattr(node, 'module', None)}:{a.name}:{a.asname}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node.name, f"def {node.name} in {origin}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in _target_names(targets):
                    bind(name, f"assign {ast.dump(node)}")
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source).body)
    return out


def _target_names(targets) -> list[str]:
    """Names an assignment binds (`x = ...`, `a, b = ...`; not `x[i] = ...` or `x.y = ...`)."""
    names = []
    for target in targets:
        if isinstance(target, ast.Name):
            names.append(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            names += _target_names(target.elts)
        elif isinstance(target, ast.Starred):
            names += _target_names([target.value])
    return names


def _deferred_loads(source: str) -> set[str]:
    """Global names read inside function bodies: they see the module's last binding of the name, whereas
    module-level code (the `ops` namespace, class bodies) runs in order and sees the binding before it."""
    names = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = [fn.body] if isinstance(fn, ast.Lambda) else fn.body
            names |= {n.id for stmt in body for n in ast.walk(stmt)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return names


def _check_namespace(sections: list[tuple[str, str]]) -> None:
    """No two sections bind one name differently. The one exception: the launcher may rebind a name that no
    earlier function reads as a global (ops.select is reached through the `ops` namespace only)."""
    seen: dict[str, tuple[str, str]] = {}
    read: set[str] = set()
    for title, source in sections:
        for name, sig in _bindings(source, title).items():
            if name == "__all__" or name not in seen or seen[name][1] == sig:
                seen[name] = (title, sig)
                continue
            if title == "launcher" and name not in read:
                continue
            raise ExportError(f"name clash in the exported module: {name!r} is bound by {seen[name][0]} and "
                              f"again, differently, by {title}")
        read |= _deferred_loads(source)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- the parts of the exported module that are not kernelgen's own files ------------------------

_HEADER = '''\
# Generated by kernelgen {version} on {date} -- do not edit; regenerate with kernelgen.export.export_module.
# spec: {spec_json}
# spec key: {spec_key}
# configs: {configs_json}
"""Block-sparse attention with run-time block selection for one kernelgen spec (standalone: needs only
{needs}).

    import this_module as m
    o = m.attn(q, k, v)                               # select blocks with the spec's selector, then attend
    o, lse = m.attn(q, k, v, block_idx=idx, return_lse=True)   # caller-given lists
    idx = m.select(q, k)                              # the lists the selector would use
    lists = m.prepare(idx, seq_q, seq_k)              # lists for many calls, normalised once:
    o = m.attn(q, k, v, block_idx=lists)              # these calls skip that launch

q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D]; Hq = SPEC["gqa_group"] * Hkv; block_idx int32 (or int64)
[B, Hkv, n_q_tiles, top_k], -1 for an empty slot. Semantics: kernelgen's docs/SEMANTICS.md.
`kernel.validate_lists = True` makes a repeated id in a given list an error (one device sync per call).
The sections below are kernelgen's own files and rendered kernels, each as kernelgen has them, and
kernelgen's SparseAttention class; the launcher at the end ties them together.
"""
from __future__ import annotations

import os
import types

import torch

# Without a CUDA device the kernels can only run in Triton's interpreter, which must be chosen before
# triton.language is first imported (as `import kernelgen` does).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
'''

_OPS_NAMESPACE = '''\
# kernelgen.ops as SparseAttention reads it (`ops.check_qkv`, `ops.select`, ...), taken before the
# launcher's public select(q, k) rebinds the module-level name `select`.
ops = types.SimpleNamespace(
{fields}
)
'''

_LAUNCHER = '''\
SPEC = {spec_dict}
CONFIGS = {configs_dict}

# role -> the kernels SparseAttention launches for it (kernelgen loads one rendered module per role)
_KERNELS = {{
{kernels},
}}


class _ExportedAttention(SparseAttention):
    """SparseAttention over this file's kernels: configs baked in, nothing rendered, cached or tuned."""

    def module(self, role, config):
        return _KERNELS[role]
{tilelang_kernel}

kernel = _ExportedAttention(Spec.from_dict(SPEC),
                            {{role: config_from_dict(role, data, SPEC["backend"]) for role, data in CONFIGS.items()}})


def attn(q, k, v, *, block_idx=None, scale=None, return_lse=False):
    """o [B, Hq, Nq, D] (and lse float32 [B, Hq, Nq] with return_lse) over the spec's selection, or over
    block_idx int32/int64 [B, Hkv, n_q_tiles, top_k] when given (-1 empty; out-of-range ids are empty)."""
    return kernel(q, k, v, block_idx=block_idx, scale=scale, return_lse=return_lse)


def select(q, k):
    """The block lists int32 [B, Hkv, n_q_tiles, top_k] (ids ascending, then -1) the selector chooses."""
    return kernel.select(q, k)


def prepare(block_idx, seq_q, seq_k):
    """block_idx checked and normalised once for calls with seq_q queries and seq_k keys: pass the result
    as attn's block_idx (those calls skip the normalising launch)."""
    return kernel.prepare(block_idx, seq_q, seq_k)


__all__ = {public}
'''

_TILELANG_SOURCES = '''\
# dtype -> (module name, source) of the rendered TileLang forward; imported from a file at first use
_TILELANG_ATTN = {modules}
'''

_TILELANG_KERNEL = '''
    @functools.lru_cache(maxsize=64)
    def _tilelang_kernel(self, shapes, dtype, config, device):
        """As SparseAttention's, from this file's rendered forward (written under $KERNELGEN_CACHE_DIR,
        else the temp dir, as <name>.py, then imported) instead of kernelgen's renderer."""
        if device.type != "cuda":
            raise ValueError("backend='tilelang' runs on CUDA GPUs only")
        name, source = _TILELANG_ATTN[canonical_dtype(dtype)]
        directory = Path(os.environ.get("KERNELGEN_CACHE_DIR") or tempfile.gettempdir()) / "kernelgen-export"
        func = build_attn_from(load_module(name, source, directory), self.spec, dtype, batch=shapes.batch,
                               heads_kv=shapes.heads_kv, seq_q=shapes.n_q, seq_k=shapes.n_k, config=config)
        return compile_attn(func, config, arch=target_arch(device))
'''

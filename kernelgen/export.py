"""export_module(spec, path): one standalone .py file that computes what `get_kernel(spec)` computes.

The exported file needs only torch and triton (Gluon is part of Triton), plus the compilers of the spec's
backend (`Backend.compilers`: tilelang for a TileLang spec); no kernelgen, jinja2 or platformdirs. It is
assembled from kernelgen's own sources, so that nothing is written twice:

  header     kernelgen version, spec JSON, configs, date; chooses Triton's interpreter without CUDA
  sources    kernelgen's modules, each verbatim as a string: `dispatch` and every module it imports at
             module level, found by following the imports (errors, spec, device, inputs, roles, the
             backends package with every registered backend, codegen/cache, tuning/buckets and lookup, ...)
  renders    the kernels kernelgen renders for this spec and these configs, verbatim, keyed by the
             arguments of `codegen.render.render` (a per-shape backend's template per dtype)
  loader     imports those sources as one private package (`_kernelgen_export_<digest>`) through a finder
             on sys.meta_path, so that each module keeps its own namespace and its relative imports work
             unchanged; `codegen.render` is a stand-in that returns the renders above (kernelgen's
             `module_name` verbatim); a part of kernelgen that is not embedded is a ModuleNotFoundError
             when (if ever) a function imports it
  launcher   SPEC, CONFIGS, `kernel` (kernelgen's own SparseAttention with every role's config pinned, so
             that nothing is tuned or looked up), attn(q, k, v, *, block_idx=None, index=None, scale=None,
             return_lse=False, key_reps=None, cache_seqlens=None, cache_leftpad=None, seqlens=None,
             block_table=None, k_new=None, v_new=None, k_idx_new=None, sinks=None, k_scale=None, v_scale=None) (its
             output backpropagates,
             as kernelgen's does), select(q, k, *, ...),
             key_reps(k, *, previous=None, ...) and prepare(block_idx, seq_q, seq_k): the keyword arguments
             of kernelgen's SparseAttention

Kernels are built by the backends' own code (`Backend.build`): rendered modules are written, as kernelgen
writes them, to `codegen.cache.load_module`'s directory (Triton and TileLang read a kernel's source from
its file): $KERNELGEN_CACHE_DIR/kernels, else <temp dir>/kernelgen-export-<uid>/kernels, or a private
temporary directory of the process where that cannot be written.

Export refuses (ExportError) sources in which a module-level import needs anything beyond the standard
library, torch, triton and the embedded modules. The skeleton (header, loader, launcher) lives here rather
than in templates/, which hold kernels only (each template's hash is part of its winners' fingerprint).
"""
from __future__ import annotations

import ast
import datetime
import hashlib
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import jinja2
import jinja2.meta

from . import backends
from .archs import check_arch
from .backends.base import distribution_version
from .codegen import render as _render_module
from .codegen.render import render, template_path
from .device import current_arch
from .errors import KernelgenError, KernelgenTypeError, KernelgenValueError
from .roles import call_roles, get_role
from .spec import Spec

__all__ = ["export_module", "ExportError", "assemble", "call_roles"]

_PACKAGE_DIR = Path(__file__).resolve().parent
# What the exported module runs: kernelgen's SparseAttention, and the cache its backends load kernels from.
_ROOTS = ("dispatch", "codegen.cache")
_ALLOWED_ROOTS = frozenset(sys.stdlib_module_names) | {"torch", "triton"}
# The dtypes a template that takes a `dtype` (a per-shape backend's: its kernel is compiled per problem) is
# rendered for: the half-precision dtypes a GPU call takes (float32 runs in Triton's interpreter only).
_RENDER_DTYPES = ("bfloat16", "float16")
_PUBLIC = ("SPEC", "CONFIGS", "kernel", "attn", "varlen", "select", "prepare", "key_reps")


class ExportError(KernelgenError, RuntimeError):
    """kernelgen's sources cannot be assembled into a standalone module (an import it cannot satisfy)."""


def export_module(spec: Spec, out_path, configs: dict | None = None, arch: str | None = None,
                  sources: dict | None = None) -> Path:
    """Write one standalone Python module for `spec` to `out_path` (a .py file) and return its path.

    configs   {role: config} baked into the module, for the roles a call runs (`call_roles`: "select"
              only for a spec with a selector; "lists" and "bwd_delta" take None). A missing role (or
              configs=None) gets the backend's default (`backends.runner(spec.backend, role).default_config`);
              to bake in the tuning DB's winners for an arch and length, pass `tuned_configs(...)`'s.
    arch      the arch the module is for ("sm_89"; `kernelgen.archs`): the defaults are its, and the
              configs must run on it. Default: the GPU present's, else "cpu" (the interpreter).
    sources   {role: where its config came from}, written in the module's header (roles left out:
              "default" when the default was baked, else "given").

    The module has `attn(q, k, v, *, block_idx=None, index=None, scale=None, return_lse=False, key_reps=None,
    cache_seqlens=None, cache_leftpad=None, seqlens=None, block_table=None, k_new=None, v_new=None,
    k_idx_new=None, sinks=None, k_scale=None, v_scale=None)`, `varlen(q, k, v, cu_seqlens, max_seqlen=None, *,
    block_idx=None, index=None, scale=None, return_lse=False, cache_seqlens=None, block_table=None,
    cache_leftpad=None, key_reps=None, k_new=None, v_new=None, k_idx_new=None, sinks=None, k_scale=None,
    v_scale=None)` (packed sequences, or packed queries over a KV cache,
    as SparseAttention.varlen), `select(q, k, *, index=None, key_reps=None, cache_seqlens=None,
    cache_leftpad=None, seqlens=None, block_table=None)`, `prepare(block_idx, seq_q, seq_k)` (lists normalised
    once, as SparseAttention.prepare), `key_reps(k, *, previous=None, cache_seqlens=None, cache_leftpad=None,
    block_table=None)` (the pooling selectors' kept representatives, as SparseAttention.key_reps), `SPEC` (the
    spec's fields), `CONFIGS` (the configs' fields) and
    `kernel` (the SparseAttention behind them; `kernel.validate_lists = True` makes repeated ids in given lists an
    error). Its inputs are checked
    exactly as get_kernel's are (the same code). Without a CUDA device it selects Triton's interpreter
    itself, as `import kernelgen` does. Import it like any module (with importlib: spec_from_file_location,
    module_from_spec, exec_module).
    """
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if spec.backend == backends.AUTO:
        raise KernelgenValueError(
            f"export_module needs a registered backend ({', '.join(backends.names())}), got {spec.backend!r}: "
            f"{backends.AUTO!r} chooses per GPU from the tuning DB, which an exported module does not carry")
    backends.check_spec(spec)
    _check_embedded_backends(spec)
    if not isinstance(out_path, (str, os.PathLike)):
        raise KernelgenTypeError(f"out_path must be the path of a .py file (a str or os.PathLike), got "
                                 f"{type(out_path).__name__}")
    if sources is not None and not isinstance(sources, dict):
        raise KernelgenTypeError(f"sources must be a dict {{role: where its config came from}}, got "
                                 f"{type(sources).__name__}")
    out_path = Path(out_path)
    if out_path.suffix != ".py":
        raise KernelgenValueError(f"out_path must name a .py file, got {out_path}")
    if out_path.is_dir():
        raise KernelgenValueError(f"out_path {out_path} is a directory; expected a .py file to write")
    if arch is None:
        arch = current_arch() or "cpu"
    resolved = resolve_configs(spec, configs, check_arch(arch))
    given = dict(configs or {})
    sources = {role: (sources or {}).get(role) or ("given" if given.get(role) is not None else f"default ({arch})")
               for role, cfg in resolved.items() if cfg is not None}
    text = assemble(spec, resolved, sources)
    _write_atomic(out_path, text)
    return out_path


def tuned_configs(spec: Spec, *, arch: str, seq: int, gpu_name: str | None = None,
                  dtype=None) -> tuple[Spec, dict, dict]:
    """(spec, {role: config}, {role: source}): what get_kernel would serve a call of `seq` keys on a GPU of
    `arch` (named `gpu_name`, or any of the arch) from the tuning DBs here: the spec's own winner, else
    the nearest tuned spec's, else the default. `backend="auto"` becomes the backend it would serve.
    `dtype`: the calls' (default bfloat16)."""
    import torch

    from .tuning.buckets import seq_bucket
    from .tuning.lookup import Target, fastest_backend, served_config
    from .tuning.plan import check_seq

    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in (torch.bfloat16, torch.float16):  # the dtypes winners are tuned for
        raise KernelgenValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype!r}")
    target = Target(check_arch(arch), gpu_name)
    bucket = seq_bucket(check_seq(seq))
    if spec.backend == backends.AUTO:
        spec = spec.replace(backend=fastest_backend(spec, bucket, dtype, target))
    configs, sources = {}, {}
    for role in call_roles(spec):
        backend, kernel_spec = _runner(spec, role)
        if backend.config_type(role) is None:
            continue
        tuned = served_config(backend, kernel_spec, role, bucket, dtype, target)
        if tuned is None:
            sources[role] = (f"default (no {backend.name} winner on {arch} in {str(dtype).removeprefix('torch.')} for "
                             "this spec, nor for one of its kv_block, q_tile, schedule and head_dim's tile width)")
            continue
        row = tuned.row
        measured = "; measured under another " + ", ".join(tuned.soft_mismatch) if tuned.soft_mismatch else ""
        configs[role] = tuned.config
        other_gpu = f"; no winner tuned on {gpu_name}" if gpu_name and row["gpu_name"] != gpu_name else ""
        sources[role] = (f"{tuned.source}: {row['gpu_name']} {row['arch']}, bucket {row['bucket']}{measured}"
                         f"{other_gpu}")
    return spec, configs, sources


def resolve_configs(spec: Spec, configs: dict | None, arch: str) -> dict:
    """{role: config} for every role a call of `spec` runs on `arch`: the given ones checked, the others the
    default."""
    if configs is not None and not isinstance(configs, dict):
        raise KernelgenTypeError(f"configs must be a dict {{role: config}}, got {type(configs).__name__}")
    configs = dict(configs or {})
    roles = call_roles(spec)
    unknown = sorted(r for r in configs if r not in roles)
    if unknown:
        raise KernelgenValueError(f"configs has unknown roles {unknown} for {spec}: a call of it runs "
                                  f"{list(roles)}")
    out = {}
    for role in roles:
        backend, kernel_spec = _runner(spec, role)
        cfg = configs.get(role)
        if cfg is None:
            cfg = backend.default_config(kernel_spec, role, arch)
        backend.check_config(kernel_spec, role, cfg, arch)
        out[role] = cfg
    return out


def _check_embedded_backends(spec: Spec) -> None:
    """Every backend a call of `spec` runs is one of kernelgen's own: an exported module embeds kernelgen's sources,
    so a plug-in registered from another package would be unknown when the module is imported."""
    own = [b.name for b in backends.all_backends() if type(b).__module__.startswith(f"{__package__}.")]
    for role in call_roles(spec):
        backend = _runner(spec, role)[0]
        if backend.name not in own:
            raise KernelgenValueError(
                f"backend={backend.name!r} (role {role!r}) is a plug-in from {type(backend).__module__}, outside "
                f"kernelgen: an exported module embeds kernelgen's own sources and runs their backends "
                f"({', '.join(own)}); use the plug-in through get_kernel")


def _runner(spec: Spec, role: str):
    backend = backends.runner(spec.backend, role)
    return backend, get_role(role).kernel_spec(spec, backend.name)


# ---- assembly ------------------------------------------------------------------------------------

def assemble(spec: Spec, configs: dict, config_sources: dict | None = None) -> str:
    """The exported module's text for `spec` and its resolved configs (`resolve_configs`); checked: every
    embedded module's module-level imports are satisfied, and the text compiles."""
    needs = _needs(spec)
    rendered = _renders(spec, configs, allowed=_ALLOWED_ROOTS | set(needs))
    sources, packages, stand_ins = _embedded_sources()
    digest = hashlib.sha256(json.dumps([sources, sorted(rendered.items())], sort_keys=True).encode()).hexdigest()
    configs_dict = {role: backends.Backend.config_to_dict(cfg) for role, cfg in configs.items()}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    parts = [_HEADER.format(
        version=distribution_version("kernelgen") or "0+unknown", date=date, spec_json=spec.to_json(),
        spec_key=spec.key(), configs_json=json.dumps(configs_dict, sort_keys=True),
        sources_json=json.dumps(config_sources or {}, sort_keys=True),
        needs=", ".join(needs[:-1]) + " and " + needs[-1], package=f"_kernelgen_export_{digest[:16]}")]
    parts.append(_section("kernelgen's sources, verbatim: dotted module path (relative to kernelgen) -> source"))
    parts.append("_SOURCES = {}\n")
    for key, source in sources.items():
        title = _origin(key, key in packages) + (" (a stand-in)" if key in stand_ins else "")
        parts.append(f"\n# {'-' * 20} {title}\n_SOURCES[{key!r}] = {_literal(source)}\n")
    parts.append(f"\n_PACKAGES = {tuple(sorted(packages))!r}\n")

    parts.append(_section("the kernels kernelgen renders for this spec and configs, verbatim: "
                          "(template, kernel spec, config, extra) -> source"))
    parts.append("_RENDERED = {}\n")
    for key, source in rendered.items():
        parts.append(f"\n_RENDERED[{key!r}] = {_literal(source)}\n")

    parts.append(_section("loader: the sources above as one private package"))
    parts.append(_LOADER.format(import_order=_import_order(sources)))
    parts.append(_section("launcher"))
    parts.append(_LAUNCHER.format(spec_dict=repr(spec.to_dict()), configs_dict=repr(configs_dict),
                                  public=repr(list(_PUBLIC))))
    text = "".join(parts)
    compile(text, "<exported module>", "exec")  # a syntax error here is a bug in this file
    return text


def _section(title: str) -> str:
    return f"\n\n# {'=' * 98}\n# {title}\n# {'=' * 98}\n"


def _needs(spec: Spec) -> list[str]:
    """The distributions the exported module needs: torch, and the compilers of the backends its roles run
    on (each backend's `compilers`, by their first distribution name)."""
    needs = ["torch", "triton"]  # the header and the launchers import them whatever the backend
    for role in call_roles(spec):
        for names in _runner(spec, role)[0].compilers.values():
            if names and names[0] not in needs:
                needs.append(names[0])
    return needs


def _literal(text: str) -> str:
    """A Python literal of `text` that shows it verbatim (a raw triple-quoted string) where one can."""
    for quote in ("'''", '"""'):
        literal = f"r{quote}{text}{quote}"
        if quote not in text:
            try:
                if ast.literal_eval(literal) == text:
                    return literal
            except (SyntaxError, ValueError):
                pass
    return repr(text)


# ---- kernelgen's modules: which, and their imports -------------------------------------------------

def _module_file(key: str) -> tuple[Path, bool] | None:
    """(file, is_package) of kernelgen module `key` ("backends.triton"; "" is kernelgen itself), or None."""
    base = _PACKAGE_DIR.joinpath(*key.split(".")) if key else _PACKAGE_DIR
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    if key and base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    return None


def _origin(key: str, is_package: bool) -> str:
    """kernelgen/backends/triton.py for "backends.triton"."""
    path = "/".join(["kernelgen", *(key.split(".") if key else [])])
    return path + "/__init__.py" if is_package else path + ".py"


def resolve_import(node: ast.ImportFrom, key: str, is_package: bool) -> str:
    """The module (relative to kernelgen) that a relative import in module `key` names: in
    "backends.triton", `from ..inputs import X` is "inputs" and `from .base import Y` "backends.base"."""
    package = key.split(".") if is_package else key.split(".")[:-1]
    if key == "":
        package = []
    up = node.level - 1
    if up > len(package):
        raise ExportError(f"{_origin(key, is_package)}: `{ast.unparse(node)}` reaches beyond kernelgen")
    parts = package[:len(package) - up] + (node.module.split(".") if node.module else [])
    return ".".join(parts)


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported (not those inside functions)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def _bound_names(source: str) -> set[str] | None:
    """Names a module binds at top level; None when it has a module `__getattr__` (it may provide any)."""
    names = set()
    todo = list(ast.parse(source).body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return None if "__getattr__" in names else names


def module_imports(source: str, key: str, is_package: bool, exists, allowed=_ALLOWED_ROOTS,
                   origin: str | None = None) -> list[tuple[str, list]]:
    """The kernelgen modules that importing module `key` imports, as (module key, names imported from it):
    a module-level import of anything beyond the standard library, `allowed` and kernelgen modules for
    which `exists(key)` holds is an ExportError."""
    origin = origin or _origin(key, is_package)
    out = []
    for node in _top_level_imports(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = resolve_import(node, key, is_package)
            if not exists(target):
                raise ExportError(f"{origin}: module-level `{ast.unparse(node)}` needs kernelgen.{target}, which "
                                  "the exported module does not embed (it imports more than torch and triton); "
                                  "move the import into the function that needs it")
            names = [a.name for a in node.names]
            out.append((target, names))
            for name in names:  # `from . import backends`: a submodule
                sub = f"{target}.{name}" if target else name
                if exists(sub):
                    out.append((sub, []))
            continue
        roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        for root in (r.split(".")[0] for r in roots):
            if root not in allowed:
                raise ExportError(f"{origin} imports {root!r} at module level; the exported module may need only "
                                  f"the standard library, {', '.join(sorted(allowed - set(sys.stdlib_module_names)))}"
                                  " and the kernelgen modules it embeds")
    return out


def _embedded_sources() -> tuple[dict[str, str], set[str], set[str]]:
    """{module key: source} of every module the exported module embeds (the roots and what they import at
    module level, with their packages), in dependency order; the package keys; the stand-ins' keys."""
    # kernelgen modules the exported module replaces: the package itself (kernelgen/__init__.py imports what
    # an exported module leaves out), and the renderer (jinja2 and the templates) by the renders baked in
    stand_ins = {"": _ROOT_STAND_IN, "codegen.render": _render_stand_in()}
    packages = {""}
    sources: dict[str, str] = {}
    imports: dict[str, list] = {}

    def exists(key: str) -> bool:
        return key in stand_ins or _module_file(key) is not None

    def visit(key: str) -> None:
        if key in sources or key in imports:
            return
        found = _module_file(key)
        is_package = found[1] if key not in stand_ins else key in packages
        source = stand_ins[key] if key in stand_ins else found[0].read_text()
        if is_package:
            packages.add(key)
        imports[key] = module_imports(source, key, is_package, exists)
        parent = key.rpartition(".")[0]
        if key:  # importing a module imports its package first
            visit(parent)
        for target, _ in imports[key]:
            visit(target)
        sources[key] = source

    for key in _ROOTS + tuple(stand_ins):
        visit(key)
    # every name imported at module level from an embedded module is bound there (an import inside a
    # function is checked when it runs: Backend.template_hash, say, needs kernelgen's templates)
    for key, found in imports.items():
        for target, names in found:
            bound = _bound_names(sources[target])
            missing = [n for n in names if bound is not None and n not in bound and n != "*"
                       and f"{target}.{n}".lstrip(".") not in sources]
            if missing:
                raise ExportError(f"{_origin(key, key in packages)} imports {missing} from kernelgen.{target}, "
                                  "which does not bind them in the exported module")
    return sources, packages, set(stand_ins)


def _import_order(sources: dict[str, str]) -> tuple[str, ...]:
    """The embedded modules in the order `import kernelgen` imports them (its __init__ imports the backends
    package before the modules that import a backend's base), then the rest."""
    init = _PACKAGE_DIR / "__init__.py"
    order = []
    for node in _top_level_imports(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = resolve_import(node, "", True)
            for key in [target] + [f"{target}.{a.name}".lstrip(".") for a in node.names]:
                if key and key in sources and key not in order:
                    order.append(key)
    return tuple(order + [k for k in sources if k not in order and k])


# ---- renders ---------------------------------------------------------------------------------------

def _renders(spec: Spec, configs: dict, allowed) -> dict[tuple, str]:
    """{(template, kernel spec JSON, config JSON or None, extra): source} of every kernel a call of `spec`
    builds: each role's template on the backend that runs it. A template that takes a `dtype` (a per-shape
    backend's) is rendered for each of _RENDER_DTYPES; other variables beside spec_json are an ExportError."""
    out = {}
    for role, cfg in configs.items():
        backend, kernel_spec = _runner(spec, role)
        template = backend.role(role).template
        if template is None:  # a backend that renders nothing for this role
            continue
        variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(
            template_path(template).read_text())) - {"spec_json"}
        if variables - {"dtype"}:
            raise ExportError(f"template {template} takes {sorted(variables - {'dtype'})}, which export_module "
                              "cannot supply")
        extras = [{"dtype": d} for d in _RENDER_DTYPES] if variables else [{}]
        for extra in extras:
            key = (str(template), kernel_spec.to_json(), None if cfg is None else cfg.to_json(),
                   tuple(sorted(extra.items())))
            source = render(str(template), kernel_spec, cfg, **extra)
            module_imports(source, "", False, lambda key: False, allowed, origin=f"{template} rendered for {role}")
            out[key] = source
    return out


def _render_stand_in() -> str:
    """codegen/render.py as the exported module has it: `render` returns the text kernelgen rendered for
    the same arguments (RENDERED, set by the loader); `module_name` is kernelgen's, verbatim."""
    return _RENDER_STAND_IN.format(module_name=inspect.getsource(_render_module.module_name))


# ---- writing ---------------------------------------------------------------------------------------

def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temp file in the same directory, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the parts of the exported module that are not kernelgen's own files ------------------------

_ROOT_STAND_IN = '''\
"""kernelgen's modules as an exported module embeds them (kernelgen/__init__.py itself is not embedded)."""
'''

_RENDER_STAND_IN = '''\
"""kernelgen/codegen/render.py as an exported module has it: no templates and no jinja2, but the kernels
kernelgen rendered for it (RENDERED, set by the exported module's loader), and kernelgen's module_name."""
from __future__ import annotations

import hashlib

__all__ = ["render", "module_name"]


def render(template, spec, config=None, **extra) -> str:
    """The source kernelgen's render(template, spec, config, **extra) gave when the module was exported."""
    key = (str(template), spec.to_json(), None if config is None else config.to_json(), tuple(sorted(extra.items())))
    try:
        return RENDERED[key]
    except KeyError:
        raise ModuleNotFoundError(f"this exported module holds no kernel rendered from {{template}} for {{spec}} "
                                  f"with config {{config}} and {{extra}}: export the module for it") from None


{module_name}'''

_HEADER = '''\
# Generated by kernelgen {version} on {date} -- do not edit; regenerate with kernelgen.export.export_module.
# spec: {spec_json}
# spec key: {spec_key}
# configs: {configs_json}
# config sources: {sources_json}
"""Block-sparse attention with run-time block selection for one kernelgen spec (standalone: needs only
{needs}).

    import this_module as m
    o = m.attn(q, k, v)                               # select blocks with the spec's selector, then attend
    o, lse = m.attn(q, k, v, block_idx=idx, return_lse=True)   # caller-given lists
    o.backward(do)                                    # inputs that require grad get dq, dk, dv (lse backpropagates too)
    idx = m.select(q, k)                              # the lists the selector would use
    lists = m.prepare(idx, seq_q, seq_k)              # lists for many calls, normalised once:
    o = m.attn(q, k, v, block_idx=lists)              # these calls skip that launch

q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D]; Hq = SPEC["gqa_group"] * Hkv; block_idx int32 (or int64)
[B, Hkv, n_q_tiles, top_k], -1 for an empty slot. Semantics: kernelgen's docs/SEMANTICS.md.
`kernel.validate_lists = True` makes a repeated id in a given list an error (one device sync per call).
Under torch.compile a call runs eagerly outside the graph (a graph break; its configs are pinned, and
kernelgen's custom ops serve tuned ones): `kernelgen.get_kernel(spec)` runs in the graph.

Below: kernelgen's own modules verbatim (_SOURCES) and the kernels it renders for this spec (_RENDERED),
imported as the private package {package} by a finder on sys.meta_path; the launcher at the end serves
this spec with kernelgen's SparseAttention, every config pinned. Rendered kernels are written at first use
to $KERNELGEN_CACHE_DIR/kernels, else <temp dir>/kernelgen-export-<uid>/kernels (a private temporary
directory where that cannot be written; Triton and TileLang read a kernel's source from its file), and
imported from there, as kernelgen does.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
from pathlib import Path

import torch

# Without a CUDA device the kernels can only run in Triton's interpreter, which must be chosen before
# triton.language is first imported (as `import kernelgen` does).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_PACKAGE = "{package}"
'''

_LOADER = '''\
class _EmbeddedKernelgen(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports _SOURCES as the package _PACKAGE: each module in its own namespace, its relative imports
    resolved inside the package; tracebacks and `inspect` show its lines (get_source). A part of kernelgen
    that is not embedded is a ModuleNotFoundError (a function that needs it needs kernelgen)."""

    def __init__(self, package, sources, packages, preset, where):
        self.package, self.sources, self.packages, self.preset, self.where = package, sources, packages, preset, where

    def _key(self, fullname):
        if fullname == self.package:
            return ""
        if fullname.startswith(self.package + "."):
            return fullname[len(self.package) + 1:]
        return None

    def find_spec(self, fullname, path=None, target=None):
        key = self._key(fullname)
        if key is None:
            return None
        if key not in self.sources:
            raise ModuleNotFoundError(f"kernelgen.{{key}} is not part of this exported module: the code that imports "
                                      "it needs kernelgen itself", name=fullname)
        is_package = key in self.packages
        path = os.path.join(self.where, "kernelgen", *(key.split(".") if key else []))
        origin = os.path.join(path, "__init__.py") if is_package else path + ".py"
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=origin, is_package=is_package)
        spec.has_location = True
        return spec

    def is_package(self, fullname):
        return self._key(fullname) in self.packages

    def get_source(self, fullname):
        return self.sources[self._key(fullname)]

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        key = self._key(module.__name__)
        module.__dict__.update(self.preset.get(key, {{}}))
        code = compile(self.sources[key], module.__spec__.origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)


if not any(getattr(finder, "package", None) == _PACKAGE for finder in sys.meta_path):
    sys.meta_path.insert(0, _EmbeddedKernelgen(_PACKAGE, _SOURCES, frozenset(_PACKAGES),
                                               {{"codegen.render": {{"RENDERED": _RENDERED}}}},
                                               globals().get("__file__") or "<kernelgen export>"))


def _embedded(key):
    """The embedded kernelgen module `key` ("dispatch", "backends.triton"), imported."""
    return importlib.import_module(f"{{_PACKAGE}}.{{key}}" if key else _PACKAGE)


# as `import kernelgen` imports them (the backends package before the modules that import a backend's base)
for _key in {import_order!r}:
    _embedded(_key)


def _cache_dir(kernelgen_cache_dir=_embedded("codegen.cache").cache_dir):
    """kernelgen's cache dir where $KERNELGEN_CACHE_DIR names one, else <temp dir>/kernelgen-export-<uid>
    (kernelgen's default, the user cache dir, needs platformdirs)."""
    if os.environ.get("KERNELGEN_CACHE_DIR"):
        return kernelgen_cache_dir()
    return Path(tempfile.gettempdir()) / f"kernelgen-export-{{os.getuid() if hasattr(os, 'getuid') else 'user'}}"


if _embedded("codegen.cache").cache_dir.__name__ == "cache_dir":  # not yet replaced (by an identical export)
    _embedded("codegen.cache").cache_dir = _cache_dir
'''

_LAUNCHER = '''\
SPEC = {spec_dict}
CONFIGS = {configs_dict}

# kernelgen's SparseAttention with every role a call runs pinned to the config above: nothing is tuned or
# looked up; kernels are built by the backends' own code from the renders above.
kernel = _embedded("dispatch").SparseAttention(
    _embedded("spec").Spec.from_dict(SPEC),
    {{role: _embedded("backends").runner(SPEC["backend"], role).config_from_dict(role, data)
     for role, data in CONFIGS.items()}})


def attn(q, k, v, *, block_idx=None, index=None, scale=None, return_lse=False, key_reps=None, cache_seqlens=None,
         cache_leftpad=None, seqlens=None, block_table=None, k_new=None, v_new=None, k_idx_new=None, sinks=None,
         k_scale=None, v_scale=None):
    """o [B, Hq, Nq, D] (and lse float32 [B, Hq, Nq] with return_lse) over the spec's selection, or over
    block_idx int32/int64 [B, Hkv, n_q_tiles, top_k] when given (-1 empty; out-of-range ids are empty).
    index: (q_idx, k_idx, w) of the index selector; key_reps: k's kept representatives (key_reps(k));
    cache_seqlens, cache_leftpad: int32 [B], a KV cache (a decode step's or a prefill chunk's) whose batch row b
    holds keys [cache_leftpad[b], cache_seqlens[b]) (cache_leftpad None: from 0); seqlens: int32 [B], a right-padded
    batch whose row b holds its first seqlens[b] tokens, each row attended as if alone; block_table: int32
    [B, pages a row], k and v pools of pages [n_pages, Hkv, page_size, D] (row b's key p in page
    block_table[b, p // page_size]); k_new, v_new: [B, Hkv, n_new, D], written into the cache at each row's end
    (cache_seqlens[b]) before the call attends over cache_seqlens + n_new keys (k_idx_new: the index keys of the
    same tokens, written into index's k_idx); sinks: float [Hq], attention sinks (a logit per query head in each
    row's softmax, with no value); k_scale, v_scale: float or float32 (one element or [B, Hkv]), the dequantisation
    scales of an fp8 cache (k and v float8_e4m3fn or float8_e5m2). o and lse backpropagate (a call over a cache has no backward)."""
    return kernel(q, k, v, block_idx=block_idx, index=index, scale=scale, return_lse=return_lse, key_reps=key_reps,
                  cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, seqlens=seqlens, block_table=block_table,
                  k_new=k_new, v_new=v_new, k_idx_new=k_idx_new, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


def varlen(q, k, v, cu_seqlens, max_seqlen=None, *, block_idx=None, index=None, scale=None, return_lse=False,
           cache_seqlens=None, block_table=None, cache_leftpad=None, key_reps=None, k_new=None, v_new=None,
           k_idx_new=None, sinks=None, k_scale=None, v_scale=None):
    """Causal self-attention over packed sequences, FlashAttention's varlen layout: q [total, Hq, D], k and v
    [total, Hkv, D], cu_seqlens int32 [n + 1]; each sequence as attn over it alone. o [total, Hq, D] (and lse
    float32 [Hq, total]); block_idx: given lists, [n, Hkv, rows, top_k], row d sequence d's; index: the index
    selector's (q_idx, k_idx, w) packed as q is (per-query lists). With cache_seqlens or block_table, k and v
    are a KV cache of B rows (as attn's) and q each row's new queries, packed (cu_seqlens [B + 1]): row b as
    attn over its cache row with its own queries (k_new, v_new, k_idx_new: their tokens' keys, packed as q,
    written at each row's end first); sinks, k_scale, v_scale: as attn's."""
    return kernel.varlen(q, k, v, cu_seqlens, max_seqlen, block_idx=block_idx, index=index, scale=scale,
                         return_lse=return_lse, cache_seqlens=cache_seqlens, block_table=block_table,
                         cache_leftpad=cache_leftpad, key_reps=key_reps, k_new=k_new, v_new=v_new,
                         k_idx_new=k_idx_new, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


def select(q, k, *, index=None, key_reps=None, cache_seqlens=None, cache_leftpad=None, seqlens=None,
           block_table=None):
    """The block lists int32 [B, Hkv, n_q_tiles, top_k] (ids ascending, then -1) the selector chooses
    (index: (q_idx, k_idx, w) of the index selector; key_reps, cache_seqlens, cache_leftpad, seqlens, block_table:
    as attn's)."""
    return kernel.select(q, k, index=index, key_reps=key_reps, cache_seqlens=cache_seqlens,
                         cache_leftpad=cache_leftpad, seqlens=seqlens, block_table=block_table)


def key_reps(k, *, previous=None, cache_seqlens=None, cache_leftpad=None, block_table=None):
    """The mean or multi:r selector's representatives of k's blocks, kept with a KV cache for attn's and select's
    key_reps=; previous: those of an earlier k this one extends (only its new blocks are pooled; with
    cache_seqlens and cache_leftpad, grown in place to those rows); block_table: k is paged, as attn's."""
    return kernel.key_reps(k, previous=previous, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                           block_table=block_table)


def prepare(block_idx, seq_q, seq_k):
    """block_idx checked and normalised once for calls with seq_q queries and seq_k keys: pass the result
    as attn's block_idx (those calls skip the normalising launch)."""
    return kernel.prepare(block_idx, seq_q, seq_k)


__all__ = {public}
'''

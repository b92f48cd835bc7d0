"""export_module: one standalone .py file that computes what get_kernel(spec) computes.

The exported files are imported in a child process in which `kernelgen`, `jinja2` and `platformdirs`
cannot be imported; their outputs, block lists, lse and error messages are compared here with
kernelgen's on the same inputs.
"""
import ast
import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernelgen
from checks import TEST_ARCH
from kernelgen import AttnConfig, GluonAttnConfig, KernelgenValueError, SelectConfig, Spec, TileLangAttnConfig, backends
from kernelgen.codegen.render import render
from kernelgen.export import ExportError, call_roles, export_module, module_imports, resolve_import, tuned_configs
from kernelgen.roles import BACKWARD_ROLES, get_role

# causal, GQA 2, local and sink, Nq != Nk; exported with non-default configs (baked in)
MEAN = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=5, causal=True, gqa_group=2, local=2, sink=1)
MEAN_CONFIGS = {"attn": AttnConfig(block_m=32, num_warps=4, num_stages=1),
                "select": SelectConfig(tiles=8, chunk=16, num_warps=4, num_stages=1)}
# a sliding window: its lists are made (window_lists), over the calls' caches too
WINDOW = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, window=50)
# caller-given lists, exported with the default configs
GIVEN = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="given")

# The same calls run on get_kernel(spec) here and on the exported module in the child (one source).
CALLS = '''
import torch


def run_calls(attn, select, prepare, varlen, x):
    """Outputs by name, and (exception type, message) or None for each bad call."""
    q, k, v, idx = x["q"], x["k"], x["v"], x.get("idx")
    n_q, n_k = q.shape[2], k.shape[2]
    out = {}
    if idx is None:
        out["idx"] = select(q, k)
        out["o"], out["lse"] = attn(q, k, v, return_lse=True)
        lens = torch.tensor([n_q, n_q // 3][:q.shape[0]], dtype=torch.int32)  # a right-padded batch
        out["o_padded"] = attn(q, k[:, :, :n_q].contiguous(), v[:, :, :n_q].contiguous(), seqlens=lens)
        bounds = torch.tensor([0, n_q // 3, n_q], dtype=torch.int32)  # two packed sequences
        out["o_varlen"] = varlen(*(t[0, :, :n_q].transpose(0, 1) for t in (q, k, v)), bounds)
        size = x["spec"]["kv_block"]  # a prefill chunk over a paged cache: a block a page, the pages in reverse
        n = n_k - n_k % size
        k_pages, v_pages = (t[:, :, :n].reshape(*t.shape[:2], n // size, size, -1).transpose(1, 2).flatten(0, 1)
                            .flip(0).contiguous() for t in (k, v))
        table = torch.arange(k_pages.shape[0] - 1, -1, -1, dtype=torch.int32).view(q.shape[0], -1)
        lens = torch.tensor([n, n // 2][:q.shape[0]], dtype=torch.int32)
        out["o_paged"] = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens)
        k_pages, v_pages = k_pages.clone(), v_pages.clone()  # three new tokens a row, written at each row's end
        out["o_appended"] = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens // 2,
                                 k_new=k[:, :, :3].clone(), v_new=v[:, :, :3].clone())
        out["k_appended"], out["v_appended"] = k_pages, v_pages
        counts = torch.tensor([0, 3, 1, 2][:q.shape[0] + 1], dtype=torch.int32)  # packed new queries over the pages
        packed = torch.cat([q[b, :, :int(counts[b + 1])].transpose(0, 1) for b in range(q.shape[0])])
        out["o_varlen_cache"] = varlen(packed, k_pages, v_pages, counts.cumsum(0, dtype=torch.int32),
                                       block_table=table, cache_seqlens=lens)
    else:
        out["o"], out["lse"] = attn(q, k, v, block_idx=idx, return_lse=True)  # int64: converted exactly
        out["o_int32_scaled"] = attn(q, k, v, block_idx=idx.clamp(-1, 2**31 - 1).int(), scale=0.3)
        out["o_prepared"], out["lse_prepared"] = attn(q, k, v, block_idx=prepare(idx, n_q, n_k), return_lse=True)
        # compiled: the exported module's pinned configs run outside the graph, kernelgen's in its ops
        out["o_compiled"] = torch.compile(lambda q, k, v: attn(q, k, v, block_idx=idx) * 2, backend="aot_eager")(q, k, v)
    # the backward: the gradients of sum(o * do) through the module's autograd
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = attn(*leaves, block_idx=idx)
    o.backward(torch.linspace(-1, 1, o.numel()).view_as(o).to(o.dtype))
    out["dq"], out["dk"], out["dv"] = (t.grad for t in leaves)
    bad = {
        "q.dtype": lambda: attn(q.double(), k, v, block_idx=idx),
        "v.dtype": lambda: attn(q, k, v.int(), block_idx=idx),
        "k 4-D": lambda: attn(q, k[0], v, block_idx=idx),
        "q stride": lambda: attn(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, block_idx=idx),
        "heads": lambda: attn(q[:, :1], k, v, block_idx=idx),
        "scale": lambda: attn(q, k, v, block_idx=idx, scale="0.1"),
    }
    if idx is None:
        bad["select k.dtype"] = lambda: select(q, k.double())
    else:
        bad["block_idx.dtype"] = lambda: attn(q, k, v, block_idx=idx.short())
        bad["block_idx.shape"] = lambda: attn(q, k, v, block_idx=idx[..., :1])
        bad["no block_idx"] = lambda: attn(q, k, v)
        bad["prepared for other keys"] = lambda: attn(q, k, v, block_idx=prepare(idx, n_q, 2 * n_k))
    errors = {}
    for name, call in bad.items():
        try:
            call()
            errors[name] = None
        except Exception as error:
            errors[name] = (type(error).__name__, str(error))
    return out, errors
'''

# A child process in which kernelgen, jinja2 and platformdirs cannot be imported.
BLOCKING = textwrap.dedent('''
    import importlib.abc, importlib.util, sys
    from pathlib import Path

    BLOCKED = ("kernelgen", "jinja2", "platformdirs")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{name} is blocked in this process", name=name)
            return None

    sys.meta_path.insert(0, Block())

    def load(path):
        """The exported module at `path`, imported under its file's name."""
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
''')

CHILD = CALLS + BLOCKING + textwrap.dedent('''
    try:
        import kernelgen  # noqa: F401
        raise SystemExit("kernelgen is importable in the child")
    except ImportError:
        pass

    import torch

    inputs = torch.load(sys.argv[1])
    results = {}
    for name, x in inputs.items():
        module = load(x["path"])
        assert module.CONFIGS == x["configs"], (module.CONFIGS, x["configs"])
        assert module.SPEC == x["spec"], (module.SPEC, x["spec"])
        results[name] = run_calls(module.attn, module.select, module.prepare, module.varlen, x)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(results, sys.argv[2])
''')

_namespace = {}
exec(CALLS, _namespace)
run_calls = _namespace["run_calls"]

STDLIB_TORCH_TRITON = frozenset(sys.stdlib_module_names) | {"torch", "triton"}


def _default_config(spec, role, arch=TEST_ARCH):
    """The config get_kernel serves `role` of `spec` with on `arch` when nothing is pinned or tuned."""
    backend = backends.runner(spec.backend, role)
    return backend.default_config(get_role(role).kernel_spec(spec, backend.name), role, arch)


def _configs_dict(spec, configs):
    """What the exported module's CONFIGS holds: every role a call runs, the given configs or the defaults."""
    configs = {r: configs.get(r) or _default_config(spec, r) for r in call_roles(spec)}
    return {r: None if c is None else dataclasses.asdict(c) for r, c in configs.items()}


def _given_lists(spec, b, hkv, nq, nk, seed):
    """int64 lists with -1, negative and too-large ids, a repeat, and one id that wraps in a careless cast."""
    gen = torch.Generator().manual_seed(seed)
    n_tiles, n_blocks = spec.n_q_tiles(nq), spec.n_kv_blocks(nk)
    idx = torch.stack([torch.randperm(n_blocks + 3, generator=gen)[: spec.top_k] for _ in range(b * hkv * n_tiles)])
    idx = idx.view(b, hkv, n_tiles, spec.top_k) - 1
    idx[0, 0, 0] = torch.tensor([2, -5, 2, 10**6])
    idx[0, 1, 1, 1] = 2**32 + 1
    return idx


def _inputs(b, hkv, g, nq, nk, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in
            ((b, hkv * g, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))]


def _run_child(tmp_path, source: str, *args: str, timeout: float = 300, env: dict | None = None):
    """Run `source` as child.py in a fresh interpreter without PYTHONPATH (so kernelgen cannot be
    imported) and without KERNELGEN_CACHE_DIR (the exported modules write kernels under the temp dir,
    here tmp_path), under Triton's interpreter, with `args`; the last arg is the file it saves its outputs
    to, loaded and returned. `env` overrides those variables (None: unset)."""
    (tmp_path / "child.py").write_text(source)
    env = {**{key: val for key, val in os.environ.items() if key not in ("PYTHONPATH", "KERNELGEN_CACHE_DIR")},
           "TRITON_INTERPRET": "1", "TMPDIR": str(tmp_path), **(env or {})}
    env = {key: val for key, val in env.items() if val is not None}
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(args[-1])


def _load(path, name=None):
    """The exported module at `path`, imported in this process (kernelgen is importable here)."""
    name = name or Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _assignments(text: str, name: str) -> dict:
    """{key: str} of the exported file's `name[key] = "..."` statements (its _SOURCES and _RENDERED)."""
    out = {}
    for node in ast.parse(text).body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                and getattr(node.targets[0].value, "id", None) == name):
            out[ast.literal_eval(node.targets[0].slice)] = ast.literal_eval(node.value)
    return out


def test_exported_modules_match_get_kernel_without_kernelgen(tmp_path, device):
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    cases = {}
    q, k, v = _inputs(2, 2, 2, 150, 230, 64, torch.float32, 1)
    path = export_module(MEAN, tmp_path / "kg_mean.py", configs=MEAN_CONFIGS)
    cases["mean"] = dict(path=str(path), spec=MEAN.to_dict(), q=q, k=k, v=v, configs=_configs_dict(MEAN, MEAN_CONFIGS))
    q, k, v = _inputs(1, 2, 2, 100, 140, 64, torch.float16, 2)
    path = export_module(GIVEN, tmp_path / "kg_given.py")
    cases["given"] = dict(path=str(path), spec=GIVEN.to_dict(), q=q, k=k, v=v,
                          idx=_given_lists(GIVEN, 1, 2, 100, 140, 3), configs=_configs_dict(GIVEN, {}))
    # no selector, no select config
    assert set(cases["given"]["configs"]) == {"lists", "attn", "decode", "attn_rows", "attn_paged", "append_kv",
                                              *BACKWARD_ROLES}
    q, k, v = _inputs(2, 1, 2, 120, 200, 64, torch.float32, 4)
    path = export_module(WINDOW, tmp_path / "kg_window.py")
    cases["window"] = dict(path=str(path), spec=WINDOW.to_dict(), q=q, k=k, v=v, configs=_configs_dict(WINDOW, {}))
    torch.save(cases, tmp_path / "inputs.pt")
    exported = _run_child(tmp_path, CHILD, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"))
    # without KERNELGEN_CACHE_DIR the rendered kernels went to <temp dir>/kernelgen-export-<uid>/kernels
    written = sorted(p.name for p in tmp_path.glob("kernelgen-export-*/kernels/*.py"))
    assert any(n.startswith("kg_triton_attn_") for n in written), written
    assert any(n.startswith("kg_triton_select_") for n in written), written
    assert any(n.startswith("kg_triton_lists_") for n in written), written
    assert any(n.startswith("kg_triton_window_lists_") for n in written), written
    for role in BACKWARD_ROLES:  # the module backpropagates with kernels it embeds
        assert any(n.startswith(f"kg_triton_{role}_") for n in written), written

    for name, spec, configs in (("mean", MEAN, MEAN_CONFIGS), ("given", GIVEN, None), ("window", WINDOW, None)):
        attn = kernelgen.get_kernel(spec, configs=configs)
        expect_out, expect_errors = run_calls(attn, attn.select, attn.prepare, attn.varlen, cases[name])
        out, errors = exported[name]
        assert out.keys() == expect_out.keys()
        for key, want in expect_out.items():
            got = out[key]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, key)
            if key == "idx":
                assert torch.equal(got, want), name
            else:
                assert not torch.isnan(got).any(), (name, key)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
        if "o_prepared" in out:  # prepared lists give exactly what the raw lists give
            assert torch.equal(out["o_prepared"], out["o"]) and torch.equal(out["lse_prepared"], out["lse"])
        assert errors == expect_errors
        for call, error in errors.items():
            assert error is not None, f"{name}: {call} raised nothing"
        for call in ("q.dtype", "v.dtype", "block_idx.dtype", "block_idx.shape"):
            if call in errors:
                assert errors[call][0] in ("KernelgenTypeError", "KernelgenValueError") and call in errors[call][1], \
                    errors[call]


def test_header_sources_and_imports(tmp_path):
    path = export_module(MEAN, tmp_path / "kg_mean.py", configs={"attn": MEAN_CONFIGS["attn"]})
    text = path.read_text()
    header = text.split('"""', 1)[0]
    assert f"kernelgen {kernelgen.__version__}" in header and MEAN.to_json() in header
    assert MEAN_CONFIGS["attn"].to_json().strip("{}") in header  # given config baked in
    assert _default_config(MEAN, "select").to_json().strip("{}") in header  # missing role: the default
    assert "needs only\ntorch and triton)" in text.split('"""', 2)[1]
    assert f"SPEC = {MEAN.to_dict()!r}" in text
    assert "\ndef attn(q, k, v, *, block_idx=None" in text
    assert ("\ndef select(q, k, *, index=None, key_reps=None, cache_seqlens=None, cache_leftpad=None, seqlens=None,\n"
            "           block_table=None)") in text

    sources, rendered = _assignments(text, "_SOURCES"), _assignments(text, "_RENDERED")
    package_dir = Path(kernelgen.__file__).parent
    # kernelgen's own modules, verbatim: dispatch and what it imports (each backend's module included)
    for key in ("errors", "spec", "device", "inputs", "roles", "dispatch", "backends", "backends.base",
                "backends.triton", "backends.gluon", "backends.tilelang", "codegen.cache", "tuning.buckets"):
        assert key in sources, key
    stand_ins = {"", "codegen.render"}  # the package itself, and the renderer (its renders baked in)
    for key, source in sources.items():
        if key not in stand_ins:
            file = package_dir.joinpath(*key.split("."))
            file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
            assert source == file.read_text(), key
    assert "export" not in sources and "codegen.render" in sources and "import jinja2" not in sources["codegen.render"]
    # every kernel a call builds, verbatim: lists (kernel spec: selector given, no forced blocks), select, the kept
    # key reps', attn, decode_select and decode (a call of a few queries), attn_rows and attn_paged (a prefill over
    # a cache of per-row lengths, contiguous or paged), append_kv (new keys written into a cache) and the backward's
    # (MEAN is Q-centric)
    for role, cfg in (("lists", None), ("select", _default_config(MEAN, "select")), ("key_reps", None),
                      ("attn", MEAN_CONFIGS["attn"]), ("append_kv", None),
                      *((role, _default_config(MEAN, role))
                        for role in ("decode_select", "decode", "attn_rows", "attn_paged", *BACKWARD_ROLES))):
        kernel_spec = get_role(role).kernel_spec(MEAN, "triton")
        template = str(backends.get("triton").role(role).template)
        source = rendered[(template, kernel_spec.to_json(), None if cfg is None else cfg.to_json(), ())]
        assert source == render(template, kernel_spec, cfg)
    assert len(rendered) == 9 + len(BACKWARD_ROLES)

    # nothing beyond the standard library, torch and triton at module level, and relative imports only of
    # embedded modules: in the file's own code, in each embedded module and in each rendered kernel
    packages = set(ast.literal_eval(next(n.value for n in ast.parse(text).body if isinstance(n, ast.Assign)
                                         and getattr(n.targets[0], "id", None) == "_PACKAGES")))
    modules = [("<file>", text, False)] + [(k, s, k in packages) for k, s in sources.items()] + \
              [("<kernel>", s, False) for s in rendered.values()]
    for key, source, is_package in modules:
        tree = ast.parse(source)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in top:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                assert resolve_import(node, key, is_package) in sources, (key, ast.unparse(node))
                continue
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert {r.split(".")[0] for r in roots} <= STDLIB_TORCH_TRITON, (key, ast.unparse(node))


def test_imports_resolve_inside_the_package():
    def rel(code, key, is_package=False):
        return resolve_import(ast.parse(code).body[0], key, is_package)

    assert rel("from ..inputs import X", "backends.triton") == "inputs"
    assert rel("from .base import Y", "backends.triton") == "backends.base"
    assert rel("from ..codegen.render import render", "backends.triton") == "codegen.render"
    assert rel("from .base import Y", "backends", is_package=True) == "backends.base"
    assert rel("from ..errors import E", "backends", is_package=True) == "errors"
    assert rel("from . import backends", "dispatch") == ""
    assert rel("from .. import backends", "tuning.lookup") == ""
    assert rel("from .buckets import seq_bucket", "tuning", is_package=True) == "tuning.buckets"
    with pytest.raises(ExportError, match="beyond kernelgen"):
        rel("from ...x import y", "tuning.lookup")

    exists = {"", "inputs", "backends", "backends.base", "spec"}.__contains__
    source = ("import torch\nfrom . import backends\nfrom .spec import Spec as S\n"
              "def f():\n    from .tuning.db import W\n    import jinja2\n    return W\n")
    assert module_imports(source, "dispatch", False, exists) == [("", ["backends"]), ("backends", []),
                                                                  ("spec", ["Spec"])]
    with pytest.raises(ExportError, match="does not embed"):
        module_imports("from .tuning.db import Winners\n", "tuning.lookup", False, exists)
    with pytest.raises(ExportError, match="jinja2"):
        module_imports("import jinja2\n", "codegen.render", False, exists)
    with pytest.raises(ExportError, match="kernelgen"):
        module_imports("try:\n    import kernelgen.spec\nexcept ImportError:\n    pass\n", "x", False, exists)


def test_exported_package_is_private_and_refuses_what_it_lacks(tmp_path):
    """Loaded here, next to kernelgen: the exported module's kernelgen is a package of its own (its own
    registry, its own Spec), and a part of kernelgen it does not embed is a ModuleNotFoundError on use."""
    module = _load(export_module(GIVEN, tmp_path / "kg_given_here.py"), "kg_given_here")
    package = module._PACKAGE
    assert package.startswith("_kernelgen_export_") and package in sys.modules
    assert type(module.kernel).__module__ == f"{package}.dispatch"
    assert module._embedded("backends") is not backends and module._embedded("backends").names() == backends.names()
    assert module.kernel.spec.to_dict() == GIVEN.to_dict()
    with pytest.raises(ModuleNotFoundError, match="not part of this exported module"):
        importlib.import_module(f"{package}.tuning.db")
    with pytest.raises(ImportError):  # the stand-in renderer has no templates
        module._embedded("backends").get("triton").template_hash("attn")
    render_stand_in = module._embedded("codegen.render")
    with pytest.raises(ModuleNotFoundError, match="holds no kernel"):
        render_stand_in.render("triton/attn.py.j2", module.kernel.spec.replace(top_k=7))
    # a second export of the same spec and configs is the same package; another spec's is another
    again = _load(export_module(GIVEN, tmp_path / "kg_given_again.py"), "kg_given_again")
    other = _load(export_module(MEAN, tmp_path / "kg_mean_here.py"), "kg_mean_here")
    assert again._PACKAGE == package and other._PACKAGE != package


def test_the_module_s_functions_take_what_the_kernel_s_methods_take(tmp_path):
    """attn, varlen, select, key_reps and prepare of an exported module have the parameters of the
    SparseAttention methods they call (an option added to one and not the other would be out of reach)."""
    module = _load(export_module(GIVEN, tmp_path / "kg_given_params.py"), "kg_given_params")
    kernel = kernelgen.get_kernel(GIVEN)
    for name, method in (("attn", kernel.__call__), ("varlen", kernel.varlen), ("select", kernel.select),
                         ("key_reps", kernel.key_reps), ("prepare", kernel.prepare)):
        params = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(module, name)).parameters.values()]
        assert params == [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()], name


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="spec"):
        export_module(MEAN.to_dict(), tmp_path / "m.py")
    with pytest.raises(ValueError, match=r"\.py"):
        export_module(MEAN, tmp_path / "m.txt")
    with pytest.raises(TypeError, match="configs\\['attn'\\]"):
        export_module(MEAN, tmp_path / "m.py", configs={"attn": MEAN_CONFIGS["select"]})
    with pytest.raises(ValueError, match="not feasible"):
        export_module(MEAN, tmp_path / "m.py", configs={"attn": AttnConfig(block_m=128)})
    with pytest.raises(ValueError, match="unknown roles"):
        export_module(MEAN, tmp_path / "m.py", configs={"backward": MEAN_CONFIGS["attn"]})
    with pytest.raises(ValueError, match="unknown roles \\['select'\\]"):  # a given spec runs no selector
        export_module(GIVEN, tmp_path / "m.py", configs={"select": MEAN_CONFIGS["select"]})
    with pytest.raises(TypeError, match="configs must be a dict"):
        export_module(MEAN, tmp_path / "m.py", configs=[MEAN_CONFIGS["attn"]])
    with pytest.raises(ValueError, match="nope"):  # unknown backend: the registry says
        export_module(MEAN.replace(backend="nope"), tmp_path / "m.py")
    with pytest.raises(ValueError, match="gluon"):  # a spec the Gluon forward does not compute
        export_module(MEAN.replace(backend="gluon"), tmp_path / "m.py")
    with pytest.raises(TypeError, match="configs\\['attn'\\]"):  # another backend's config type
        export_module(MEAN.replace(backend="tilelang"), tmp_path / "m.py", configs={"attn": MEAN_CONFIGS["attn"]})
    with pytest.raises(kernelgen.KernelgenTypeError, match="out_path must be the path of a .py file"):
        export_module(MEAN, None)
    with pytest.raises(kernelgen.KernelgenTypeError, match="sources must be a dict"):
        export_module(MEAN, tmp_path / "m.py", sources=["tuned"])
    with pytest.raises(KernelgenValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        tuned_configs(MEAN, arch="sm_90", seq=4096, dtype=torch.float32)  # no winner is tuned for it
    assert not list(tmp_path.iterdir())
    (tmp_path / "d.py").mkdir()  # a directory named like the file: named, not a rename's error about a temp file
    with pytest.raises(ValueError, match=r"d\.py is a directory; expected a \.py file"):
        export_module(MEAN, tmp_path / "d.py")
    assert [p.name for p in tmp_path.iterdir()] == ["d.py"]


def test_the_configs_baked_in_are_the_arch_s(tmp_path):
    """A module for an L4 (sm_89: 99 KB of shared memory) bakes in sm_89's defaults and refuses a config
    that only other archs run."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=4, gqa_group=4, selector="given")
    sm89, sm90 = (_default_config(spec, "attn", arch) for arch in ("sm_89", "sm_90"))
    assert sm89 != sm90
    header = export_module(spec, tmp_path / "kg_l4.py", arch="sm_89").read_text().split('"""', 1)[0]
    assert sm89.to_json().strip("{}") in header and sm90.to_json().strip("{}") not in header
    with pytest.raises(KernelgenValueError, match=r"configs\['attn'\] = .* not feasible for .* on sm_89"):
        export_module(spec, tmp_path / "m.py", configs={"attn": sm90}, arch="sm_89")
    with pytest.raises(KernelgenValueError, match="arch='sm_89a' is not a CUDA arch"):
        export_module(spec, tmp_path / "m.py", arch="sm_89a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kg_l4.py"]


def test_auto_backend_is_not_exported(tmp_path):
    with pytest.raises(ValueError, match="auto"):
        export_module(MEAN.replace(backend="auto"), tmp_path / "m.py")
    assert not list(tmp_path.iterdir())


def test_a_plug_in_backend_from_outside_kernelgen_is_refused(tmp_path):
    """An exported module embeds kernelgen's sources: a backend registered from another package would be unknown
    when the module is imported, so export names it instead of writing that module."""
    class Outside(backends.Backend):
        name = "outside"
        devices = ("cpu",)
        roles = {"attn": backends.RoleImpl(launch=lambda *args: None)}

    backends.register(Outside())
    try:
        with pytest.raises(KernelgenValueError, match=r"backend='outside' \(role 'attn'\) is a plug-in from test_"):
            export_module(MEAN.replace(backend="outside"), tmp_path / "m.py")
    finally:
        backends.unregister("outside")
    assert not list(tmp_path.iterdir())


def test_write_is_atomic(tmp_path, monkeypatch):
    """The file is replaced whole or not at all: a failed export leaves the old file and no temp file."""
    out = tmp_path / "sub" / "kg.py"
    export_module(GIVEN, out)
    first = out.read_text()
    assert os.stat(out).st_mode & 0o777 == 0o644
    with pytest.raises(ValueError):
        export_module(GIVEN, out, configs={"attn": AttnConfig(block_m=128)})

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        export_module(MEAN, out)
    monkeypatch.undo()
    assert out.read_text() == first and sorted(p.name for p in out.parent.iterdir()) == ["kg.py"]
    export_module(MEAN, out)
    assert out.read_text() != first and f"SPEC = {MEAN.to_dict()!r}" in out.read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["kg.py"]


TILELANG_CHILD = BLOCKING + textwrap.dedent('''
    import torch

    module = load(sys.argv[1])
    x = torch.load(sys.argv[2])
    out = {"idx": module.select(x["q"], x["k"]), "spec": module.SPEC, "configs": module.CONFIGS}
    try:
        module.attn(x["q"], x["k"], x["v"])
        out["cpu_error"] = None
    except Exception as error:
        out["cpu_error"] = (type(error).__name__, str(error))
    if sys.argv[3] == "lower":  # the forward the module would compile on a GPU, for this shape: CUDA for sm_90a
        tilelang = module._embedded("backends.tilelang")
        kernel_spec = module._embedded("roles").get_role("attn").kernel_spec(module.kernel.spec, module.SPEC["backend"])
        func = tilelang.build_attn(kernel_spec, torch.float16, batch=1, heads_kv=2, seq_q=150, seq_k=230,
                                   config=module.kernel._fixed["attn"])
        out["cuda_source"] = str(tilelang.lower(func, "sm_90a"))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(out, sys.argv[4])
''')

TILELANG_SPEC = MEAN.replace(backend="tilelang")
TILELANG_CONFIGS = {"attn": TileLangAttnConfig(block_m=64, num_stages=1, threads=128), "select": MEAN_CONFIGS["select"]}


def _tilelang_child(tmp_path, lower: bool):
    """Export TILELANG_SPEC, check the file, run TILELANG_CHILD on it; returns (outputs, q, k)."""
    from kernelgen.backends import tilelang as tilelang_backend

    path = export_module(TILELANG_SPEC, tmp_path / "kg_tl.py", configs=TILELANG_CONFIGS)
    text = path.read_text()
    assert "needs only\ntorch, triton and tilelang)" in text.split('"""', 2)[1]
    kernel_spec = get_role("attn").kernel_spec(TILELANG_SPEC, "tilelang")
    for dtype in (torch.float16, torch.bfloat16):  # the rendered forward, verbatim, per dtype
        assert tilelang_backend.attn_source(kernel_spec, dtype, TILELANG_CONFIGS["attn"]) in text
    q, k, v = _inputs(1, 2, 2, 150, 230, 64, torch.float16, 4)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "inputs.pt")
    out = _run_child(tmp_path, TILELANG_CHILD, str(path), str(tmp_path / "inputs.pt"), "lower" if lower else "-",
                     str(tmp_path / "outputs.pt"), timeout=600)
    assert out["spec"] == TILELANG_SPEC.to_dict() and out["configs"] == _configs_dict(TILELANG_SPEC, TILELANG_CONFIGS)
    attn = kernelgen.get_kernel(TILELANG_SPEC, configs=TILELANG_CONFIGS)
    assert torch.equal(out["idx"], attn.select(q, k))  # selection runs in Triton, as get_kernel runs it
    with pytest.raises(ValueError) as expected:  # no TileLang forward on the CPU: the error get_kernel gives
        attn(q, k, v)
    assert out["cpu_error"] == (type(expected.value).__name__, str(expected.value))
    return out, kernel_spec


def test_exported_tilelang_module_without_kernelgen(tmp_path, device):
    """A TileLang spec exports to a module that needs torch, triton and tilelang (only on use): without
    kernelgen it holds the rendered forward, selects as get_kernel does (the Triton twin) and refuses a CPU
    forward as get_kernel does."""
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    _tilelang_child(tmp_path, lower=False)


@pytest.mark.tilelang
def test_exported_tilelang_module_builds_kernelgens_forward(tmp_path, device):
    """...and builds the very forward kernelgen builds (same CUDA source), from its baked render."""
    pytest.importorskip("tilelang")
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    from kernelgen.backends import tilelang as tilelang_backend

    out, kernel_spec = _tilelang_child(tmp_path, lower=True)
    func = tilelang_backend.build_attn(kernel_spec, torch.float16, batch=1, heads_kv=2, seq_q=150, seq_k=230,
                                       config=TILELANG_CONFIGS["attn"])
    expected = tilelang_backend.lower(func, "sm_90a")
    assert out["cuda_source"] == expected and "tl::tma_load(K_desc" in expected


GLUON_CHILD = BLOCKING + textwrap.dedent('''
    import torch

    module = load(sys.argv[1])
    x = torch.load(sys.argv[2])
    backend = module._embedded("backends").get(module.SPEC["backend"])
    kernel_spec = module._embedded("roles").get_role("attn").kernel_spec(module.kernel.spec, backend.name)
    attn_kernels = backend.build(kernel_spec, "attn", module.kernel._fixed["attn"])  # from the baked render
    out = {"idx": module.select(x["q"], x["k"]), "spec": module.SPEC, "configs": module.CONFIGS,
           "attn_fwd": type(attn_kernels.attn_fwd.fn).__name__, "backend": module.kernel.backend(x["k"].shape[2])}
    try:
        module.attn(x["q"], x["k"], x["v"])
        out["cpu_error"] = None
    except Exception as error:
        out["cpu_error"] = (type(error).__name__, str(error))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(out, sys.argv[3])
''')


def test_exported_gluon_module_without_kernelgen(tmp_path, device):
    """A Gluon spec exports to a module that needs only torch and triton: without kernelgen it selects as
    get_kernel does (the Triton twin), holds and loads the rendered Gluon forward, and refuses a CPU forward
    as get_kernel does. (Running the forward needs a Hopper GPU: tests/test_gluon_fwd.py.)"""
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    spec = Spec(head_dim=64, kv_block=64, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1, backend="gluon")
    configs = {"attn": GluonAttnConfig(block_m=64, num_stages=3), "select": SelectConfig(tiles=8, chunk=16)}
    path = export_module(spec, tmp_path / "kg_gl.py", configs=configs)
    text = path.read_text()
    assert "needs only\ntorch and triton)" in text.split('"""', 2)[1]
    kernel_spec = get_role("attn").kernel_spec(spec, "gluon")
    assert render("gluon/attn.py.j2", kernel_spec, configs["attn"]) in text  # the rendered kernel, verbatim
    assert "\n@gluon.jit\ndef attn_fwd(" in text
    q, k, v = _inputs(1, 2, 2, 150, 230, 64, torch.float16, 5)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "inputs.pt")
    out = _run_child(tmp_path, GLUON_CHILD, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"))
    assert out["spec"] == spec.to_dict() and out["configs"] == _configs_dict(spec, configs)
    assert out["attn_fwd"] == "GluonJITFunction" and out["backend"] == "gluon"
    attn = kernelgen.get_kernel(spec, configs=configs)
    assert torch.equal(out["idx"], attn.select(q, k))
    with pytest.raises(ValueError) as expected:
        attn(q, k, v)
    assert out["cpu_error"] == (type(expected.value).__name__, str(expected.value))
    assert "runs on CUDA GPUs (Hopper, sm_90) only" in out["cpu_error"][1]


# torch._dynamo imports triton.language while TRITON_INTERPRET is unset: Triton's own @jit helpers (tl.sum,
# tl.max, ...) are then JITFunctions, which an interpreted kernel cannot call unless kernelgen rebinds them.
DYNAMO_FIRST = textwrap.dedent('''
    import torch._dynamo  # noqa: F401
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    assert type(tl.sum) is JITFunction, type(tl.sum)  # the case under test
    import torch

    if sys.argv[1] == "kernelgen":
        import kernelgen

        attn = kernelgen.get_kernel(kernelgen.Spec.from_json(sys.argv[2]))
    else:
        attn = load(sys.argv[1]).attn
    x = torch.load(sys.argv[3])
    torch.save(attn(x["q"], x["k"], x["v"]), sys.argv[4])
''')


@pytest.mark.parametrize("how", ["kernelgen", "exported"])
def test_interpreter_works_when_torch_dynamo_imported_triton_first(tmp_path, device, how):
    """`import torch._dynamo` before kernelgen (or an exported module) on a CPU: kernels still run in the
    interpreter and match the reference."""
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, selector="mean")
    q, k, v = _inputs(1, 1, 1, 128, 128, 64, torch.float32, 6)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "inputs.pt")
    if how == "kernelgen":
        source = "import sys\n" + DYNAMO_FIRST
        where = {"PYTHONPATH": str(Path(kernelgen.__file__).resolve().parent.parent),
                 "KERNELGEN_CACHE_DIR": str(tmp_path / "cache")}
    else:
        source, where = BLOCKING + DYNAMO_FIRST, {}
        how = str(export_module(spec, tmp_path / "kg_dynamo_first.py"))
    o = _run_child(tmp_path, source, how, spec.to_json(), str(tmp_path / "inputs.pt"), str(tmp_path / "o.pt"),
                   env={"TRITON_INTERPRET": None, **where})
    expected = kernelgen.reference.sparse_attention(q, k, v, spec)[0]
    assert ((o.double() - expected).norm() / expected.norm()).item() < 1e-4


GPU_TRAIN_CHILD = BLOCKING + textwrap.dedent('''
    import torch

    module = load(sys.argv[1])
    x = {name: t.cuda() for name, t in torch.load(sys.argv[2]).items()}
    q, k, v = (x[name].requires_grad_() for name in "qkv")
    o = module.attn(q, k, v)
    o.backward(x["do"])
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save({"idx": module.select(q, k).cpu(), "o": o.detach().cpu(),
                **{f"d{name}": t.grad.cpu() for name, t in zip("qkv", (q, k, v))}}, sys.argv[3])
''')


@pytest.mark.gpu
def test_gpu_exported_module_with_tuned_winners_trains(tmp_path):
    """The module `kernelgen export --seq` writes, with the winners this GPU would be served baked in, runs
    forward and backward on the GPU without kernelgen, bit for bit as get_kernel with those configs."""
    from kernelgen.device import current_arch
    from kernelgen.export import tuned_configs
    from kernelgen.workloads import SHAPES

    spec, configs, _ = tuned_configs(SHAPES["c"].spec("mean"), arch=current_arch(), seq=4096)
    path = export_module(spec, tmp_path / "kg_c.py", configs, current_arch())
    x = dict(zip(("q", "k", "v", "do"), _inputs(1, 2, 4, 4096, 4096, 128, torch.bfloat16, 7)))
    x["do"] = torch.randn_like(x["q"])
    torch.save(x, tmp_path / "inputs.pt")
    out = _run_child(tmp_path, GPU_TRAIN_CHILD, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"),
                     env={"TRITON_INTERPRET": None})
    attn = kernelgen.get_kernel(spec, configs=configs)
    q, k, v = (x[name].cuda().requires_grad_() for name in "qkv")
    o = attn(q, k, v)
    o.backward(x["do"].cuda())
    assert torch.equal(out["idx"], attn.select(q, k).cpu())
    for name, want in (("o", o.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert not torch.isnan(out[name]).any() and torch.equal(out[name], want.cpu()), name

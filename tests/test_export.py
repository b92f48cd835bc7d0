"""export_module: one standalone .py file that computes what get_kernel(spec) computes.

The exported files are imported in a child process in which `kernelgen`, `jinja2` and `platformdirs`
cannot be imported; their outputs, block lists, lse and error messages are compared here with
kernelgen's on the same inputs.
"""
import ast
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernelgen
from kernelgen import AttnConfig, SelectConfig, Spec
from kernelgen.export import ExportError, _check_namespace, _rewrite_imports, export_module

# causal, GQA 2, local and sink, Nq != Nk; exported with non-default configs (baked in)
MEAN = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=5, causal=True, gqa_group=2, local=2, sink=1)
MEAN_CONFIGS = {"attn": AttnConfig(block_m=32, num_warps=4, num_stages=1),
                "select": SelectConfig(tiles=8, chunk=16, num_warps=4, num_stages=1)}
# caller-given lists, exported with the default configs
GIVEN = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="given")

# The same calls run on get_kernel(spec) here and on the exported module in the child (one source).
CALLS = '''
def run_calls(attn, select, prepare, x):
    """Outputs by name, and (exception type, message) or None for each bad call."""
    q, k, v, idx = x["q"], x["k"], x["v"], x.get("idx")
    n_q, n_k = q.shape[2], k.shape[2]
    out = {}
    if idx is None:
        out["idx"] = select(q, k)
        out["o"], out["lse"] = attn(q, k, v, return_lse=True)
    else:
        out["o"], out["lse"] = attn(q, k, v, block_idx=idx, return_lse=True)  # int64: converted exactly
        out["o_int32_scaled"] = attn(q, k, v, block_idx=idx.clamp(-1, 2**31 - 1).int(), scale=0.3)
        out["o_prepared"], out["lse_prepared"] = attn(q, k, v, block_idx=prepare(idx, n_q, n_k), return_lse=True)
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
        results[name] = run_calls(module.attn, module.select, module.prepare, x)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(results, sys.argv[2])
''')

_namespace = {}
exec(CALLS, _namespace)
run_calls = _namespace["run_calls"]


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


def _run_child(tmp_path, source: str, *args: str, timeout: float = 300):
    """Run `source` as child.py in a fresh interpreter without PYTHONPATH (so kernelgen cannot be
    imported), under Triton's interpreter, with `args`; the last arg is the file it saves its outputs
    to, loaded and returned."""
    (tmp_path / "child.py").write_text(source)
    env = {key: val for key, val in os.environ.items() if key != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(args[-1])


def test_exported_modules_match_get_kernel_without_kernelgen(tmp_path, device):
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    cases = {}
    q, k, v = _inputs(2, 2, 2, 150, 230, 64, torch.float32, 1)
    path = export_module(MEAN, tmp_path / "kg_mean.py", configs=MEAN_CONFIGS)
    cases["mean"] = dict(path=str(path), spec=MEAN.to_dict(), q=q, k=k, v=v,
                         configs={r: c.__dict__ for r, c in MEAN_CONFIGS.items()})
    q, k, v = _inputs(1, 2, 2, 100, 140, 64, torch.float16, 2)
    path = export_module(GIVEN, tmp_path / "kg_given.py")
    cases["given"] = dict(path=str(path), spec=GIVEN.to_dict(), q=q, k=k, v=v,
                          idx=_given_lists(GIVEN, 1, 2, 100, 140, 3),
                          configs={r: kernelgen.config.default_config(GIVEN, r).__dict__ for r in ("attn", "select")})
    torch.save(cases, tmp_path / "inputs.pt")
    exported = _run_child(tmp_path, CHILD, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"))

    for name, spec, configs in (("mean", MEAN, MEAN_CONFIGS), ("given", GIVEN, None)):
        attn = kernelgen.get_kernel(spec, configs=configs)
        expect_out, expect_errors = run_calls(attn, attn.select, attn.prepare, cases[name])
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
                assert errors[call][0] in ("TypeError", "ValueError") and call in errors[call][1], errors[call]


def test_header_imports_and_configs(tmp_path):
    path = export_module(MEAN, tmp_path / "kg_mean.py", configs={"attn": MEAN_CONFIGS["attn"]})
    text = path.read_text()
    header = text.split('"""', 1)[0]
    assert f"kernelgen {kernelgen.__version__}" in header and MEAN.to_json() in header
    assert MEAN_CONFIGS["attn"].to_json().strip("{}") in header  # given config baked in
    default_select = kernelgen.config.default_config(MEAN, "select")
    assert default_select.to_json().strip("{}") in header  # missing role: the default
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots = {node.module.split(".")[0]}
        else:
            continue
        assert not roots & {"kernelgen", "jinja2", "platformdirs"}, ast.unparse(node)


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
    assert not (tmp_path / "m.py").exists()


def test_name_clashes_and_imports_are_refused():
    with pytest.raises(ExportError, match="'f'"):
        _check_namespace([("a", "def f(): pass\n"), ("b", "f = 1\n")])
    _check_namespace([("a", "import triton\n"), ("b", "import triton\n")])  # the same binding twice is fine
    # the launcher may rebind a name no earlier function reads (ops.select, reached through `ops`)...
    _check_namespace([("ops", "def select(): pass\nns = select\n"), ("launcher", "def select(): pass\n")])
    # ...but not one that an earlier function would then call
    with pytest.raises(ExportError, match="'select'"):
        _check_namespace([("ops", "def select(): pass\ndef g(): return select()\n"), ("launcher", "select = 1\n")])
    with pytest.raises(ExportError, match="does not embed"):
        _rewrite_imports("from .db import Winners\n", "kernelgen/x.py", {})
    with pytest.raises(ExportError, match="jinja2"):
        _rewrite_imports("import jinja2\n", "kernelgen/x.py", {})
    rewritten = _rewrite_imports("from .spec import Spec as S\ndef f():\n    from .db import W\n    return W\n",
                                 "kernelgen/x.py", {"spec": {"Spec"}})
    assert "S = Spec" in rewritten and "raise ImportError" in rewritten
    compile(rewritten, "x", "exec")


TILELANG_CHILD = BLOCKING + textwrap.dedent('''
    import torch

    module = load(sys.argv[1])
    x = torch.load(sys.argv[2])
    out = {"idx": module.select(x["q"], x["k"]), "spec": module.SPEC, "configs": module.CONFIGS}
    try:
        module.attn(x["q"], x["k"], x["v"])
        out["cpu_error"] = None
    except ValueError as error:
        out["cpu_error"] = str(error)
    # the forward the module would compile on a GPU, for this shape: its CUDA source for sm_90a
    name, source = module._TILELANG_ATTN["float16"]
    func = module.build_attn_from(module.load_module(name, source, Path(sys.argv[3])), module.kernel.spec,
                                  torch.float16, batch=1, heads_kv=2, seq_q=150, seq_k=230,
                                  config=module.kernel._fixed["attn"])
    out["cuda_source"] = str(module.lower(func))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(out, sys.argv[4])
''')


@pytest.mark.tilelang
def test_exported_tilelang_module_without_kernelgen(tmp_path, device):
    """A TileLang spec exports too: without kernelgen, the module selects as get_kernel does (Triton
    twin), refuses a CPU forward clearly, and builds the very forward kernelgen builds (same CUDA source)."""
    pytest.importorskip("tilelang")
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    from kernelgen import tilelang_backend
    from kernelgen.config import TileLangAttnConfig

    spec = MEAN.replace(backend="tilelang")
    configs = {"attn": TileLangAttnConfig(block_m=64, num_stages=1, threads=128), "select": MEAN_CONFIGS["select"]}
    path = export_module(spec, tmp_path / "kg_tl.py", configs=configs)
    assert "torch, triton and tilelang" in path.read_text().split('"""', 2)[1]
    q, k, v = _inputs(1, 2, 2, 150, 230, 64, torch.float16, 4)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "inputs.pt")
    out = _run_child(tmp_path, TILELANG_CHILD, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "kernels"),
                     str(tmp_path / "outputs.pt"), timeout=600)
    assert out["spec"] == spec.to_dict() and out["configs"] == {r: c.__dict__ for r, c in configs.items()}
    attn = kernelgen.get_kernel(spec, configs=configs)
    assert torch.equal(out["idx"], attn.select(q, k))
    assert out["cpu_error"] is not None and "CUDA GPUs only" in out["cpu_error"]
    expected = tilelang_backend.lower(tilelang_backend.build_attn(spec, torch.float16, batch=1, heads_kv=2, seq_q=150,
                                                                  seq_k=230, config=configs["attn"]))
    assert out["cuda_source"] == expected and "tl::tma_load(K_desc" in expected


GLUON_CHILD = BLOCKING + textwrap.dedent('''
    import torch

    module = load(sys.argv[1])
    x = torch.load(sys.argv[2])
    attn_kernels = module.kernel.module("attn", None)
    out = {"idx": module.select(x["q"], x["k"]), "spec": module.SPEC, "configs": module.CONFIGS,
           "attn_fwd": type(attn_kernels.attn_fwd).__name__, "backend": module.kernel.backend(x["k"].shape[2])}
    try:
        module.attn(x["q"], x["k"], x["v"])
        out["cpu_error"] = None
    except ValueError as error:
        out["cpu_error"] = str(error)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    torch.save(out, sys.argv[3])
''')


def test_exported_gluon_module_without_kernelgen(tmp_path, device):
    """A Gluon spec exports to a module that needs only torch and triton: without kernelgen it selects as
    get_kernel does (the Triton twin), holds the rendered Gluon forward, and refuses a CPU forward clearly.
    (Running the forward needs a Hopper GPU: tests/test_gluon_fwd.py.)"""
    if device != "cpu":
        pytest.skip("the child runs the interpreter")
    from kernelgen.config import GluonAttnConfig
    from kernelgen.render import render

    spec = Spec(head_dim=64, kv_block=64, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1, backend="gluon")
    configs = {"attn": GluonAttnConfig(block_m=64, num_stages=3), "select": SelectConfig(tiles=8, chunk=16)}
    path = export_module(spec, tmp_path / "kg_gl.py", configs=configs)
    text = path.read_text()
    assert "needs only\ntorch and triton)" in text.split('"""', 2)[1]
    assert render(spec, "attn", configs["attn"]) in text  # the rendered kernel, verbatim
    q, k, v = _inputs(1, 2, 2, 150, 230, 64, torch.float16, 5)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "inputs.pt")
    out = _run_child(tmp_path, GLUON_CHILD, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"))
    assert out["spec"] == spec.to_dict() and out["configs"] == {r: c.__dict__ for r, c in configs.items()}
    assert out["attn_fwd"] == "GluonJITFunction" and out["backend"] == "gluon"
    assert torch.equal(out["idx"], kernelgen.get_kernel(spec, configs=configs).select(q, k))
    assert out["cpu_error"] is not None and "runs on CUDA GPUs (Hopper, sm_90) only" in out["cpu_error"]


def test_auto_backend_is_not_exported(tmp_path):
    with pytest.raises(ValueError, match="auto"):
        export_module(MEAN.replace(backend="auto"), tmp_path / "m.py")

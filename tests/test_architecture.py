"""The architecture's promises: backends and roles are plug-ins, kernelgen's modules import no cycle, and
no module outside kernelgen/backends/ compares a backend's name."""
import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kernelgen
from kernelgen import Spec, backends, reference
from kernelgen.backends import Backend, RoleImpl
from kernelgen.cli import app
from kernelgen.roles import ROLES, Role
from kernelgen.tuning.db import TuningDB, current_fingerprint

PACKAGE = Path(kernelgen.__file__).parent


# ---- a toy backend: the float64 reference, on the CPU only ------------------------------------------

@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """A stand-in tunable: the reference ignores it."""

    rows_per_step: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _lists(kernel, spec, config, shapes, block_idx):
    return reference.normalize_block_idx(block_idx, shapes.n_kv_blocks).to(torch.int32)


def _select(kernel, spec, config, shapes, q, k):
    return reference.select_blocks(q, k, spec).to(torch.int32)


def _attn(kernel, spec, config, shapes, q, k, v, block_idx, scale):
    o, lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=block_idx, scale=scale)
    return o.to(q.dtype), lse.float()


class ReferenceBackend(Backend):
    name = "reference"
    summary = "kernelgen.reference in float64 (a test's plug-in)"
    devices = ("cpu",)
    roles = {
        "lists": RoleImpl(launch=_lists),
        "select": RoleImpl(launch=_select),
        "attn": RoleImpl(launch=_attn, config_type=ReferenceConfig, default=lambda spec, arch: ReferenceConfig(),
                         space=lambda spec, arch: [ReferenceConfig(1), ReferenceConfig(2), ReferenceConfig(3)],
                         infeasible=lambda spec, c, arch: None if c.rows_per_step in (1, 2)
                         else "at most 2 rows per step"),
    }

    def build(self, spec, role, config, problem=None):
        return None  # nothing to compile


@pytest.fixture
def reference_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    from kernelgen.tuning import lookup

    def forget():  # what earlier tests served from other DBs
        lookup._winners.cache_clear()
        kernelgen.dispatch._kernels.clear()

    forget()
    backend = backends.register(ReferenceBackend())
    yield backend
    backends.unregister("reference")
    forget()


SPEC = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=3, causal=True, gqa_group=2, local=1, backend="reference")


def _inputs(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 64, generator=gen)
    k, v = torch.randn(1, 2, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen)
    return q, k, v


def test_a_registered_backend_is_served_by_get_kernel(reference_backend):
    q, k, v = _inputs()
    attn = kernelgen.get_kernel(SPEC)
    o, lse = attn(q, k, v, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, SPEC)
    assert torch.allclose(o.double(), ref_o) and torch.allclose(lse.double(), ref_lse.float().double())
    given = kernelgen.get_kernel(SPEC.replace(selector="given"))
    idx = attn.select(q, k)
    assert torch.equal(given(q, k, v, block_idx=idx), o)
    assert attn.served("attn", q.shape[2], q.dtype, q.device).backend is reference_backend
    assert attn.served("attn", q.shape[2], q.dtype, q.device).source == "default"


def test_a_registered_backend_is_planned_and_listed_by_the_cli(reference_backend, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(SPEC.to_json())
    result = CliRunner().invoke(app, ["tune", "--arch", "cpu", "--seq", "256", "--spec", str(path), "--role", "attn",
                                      "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "(reference)" in result.output and "space of 2 configs" in result.output
    assert '{"rows_per_step": 2}' in result.output and '{"rows_per_step": 3}' not in result.output

    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0 and "backend reference" in result.output


def test_a_registered_backend_s_winner_is_served_from_the_db_and_listed(reference_backend):
    role = ROLES["attn"]
    kernel_spec = role.kernel_spec(SPEC, "reference")
    with TuningDB() as db:
        db.upsert(spec_key=role.key(SPEC, "reference"), role="attn", backend="reference", arch="cpu", gpu_name="cpu",
                  bucket=1024, dtype="float32", config={"rows_per_step": 2}, median_ms=1.0, tflops=None, n_trials=2,
                  fingerprint=current_fingerprint(reference_backend, "attn"), spec_json=kernel_spec.to_json())
    served = kernelgen.get_kernel(SPEC).served("attn", 300, torch.float32, "cpu")
    assert served.config == ReferenceConfig(2) and served.source == "user DB"
    # its repr: who serves the role with what, from where; not the role's launch machinery
    assert repr(served) == ("Served(role='attn', backend='reference', config=ReferenceConfig(rows_per_step=2), "
                            "source='user DB')")

    result = CliRunner().invoke(app, ["db", "list"])
    assert result.exit_code == 0, result.output
    assert role.key(SPEC, "reference") in result.output and "reference" in result.output


def test_a_backend_that_cannot_run_here_is_a_clear_error(reference_backend):
    class GpuOnly(ReferenceBackend):
        name = "gpu_only"
        devices = ("cuda",)

    backends.register(GpuOnly())
    try:
        q, k, v = _inputs()
        with pytest.raises(kernelgen.KernelgenValueError, match="runs on cuda devices only"):
            kernelgen.get_kernel(SPEC.replace(backend="gpu_only"))(q, k, v)
    finally:
        backends.unregister("gpu_only")


class PerShapeReference(ReferenceBackend):
    """The reference as a backend that compiles per problem shape (as TileLang does): it counts its builds."""

    name = "per_shape_reference"
    per_shape = True

    def __init__(self):
        self.built = []

    def build(self, spec, role, config, problem=None):
        if role == "attn":
            self.built.append(problem.shapes.n_q)
        return None


def test_auto_compiles_a_per_shape_role_for_a_bounded_number_of_shapes(reference_backend, monkeypatch, caplog):
    """Under auto, a role served by a backend that compiles per problem shape compiles for at most
    KERNELGEN_PER_SHAPE_LIMIT shapes; other shapes run on the fastest backend that compiles once (said once), the
    shapes compiled keep theirs, and a backend named in the spec compiles every shape."""
    from kernelgen import dispatch

    per_shape = backends.register(PerShapeReference())
    try:
        monkeypatch.setenv("KERNELGEN_PER_SHAPE_LIMIT", "2")
        monkeypatch.setattr(dispatch, "fastest_backend", lambda spec, bucket, dtype, device, role="attn",
                            compiled_once=False: "reference" if compiled_once else "per_shape_reference")
        attn = kernelgen.get_kernel(SPEC.replace(backend="auto"))
        q, k, v = _inputs(300)
        with caplog.at_level("WARNING", logger="kernelgen"):
            for n in (100, 200, 100, 250, 300, 200):
                o = attn(q[:, :, :n], k[:, :, :n], v[:, :, :n])
                assert torch.allclose(o.double(), reference.sparse_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n],
                                                                               SPEC)[0]), n
        assert per_shape.built == [100, 200]  # 250 and 300 ran on the reference backend, which builds nothing
        said = [r.getMessage() for r in caplog.records if "KERNELGEN_PER_SHAPE_LIMIT" in r.getMessage()]
        said = [line for line in said if line.startswith("kernelgen: attn of")]
        assert len(said) == 1 and "per_shape_reference" in said[0] and "for 2 problem shapes" in said[0]

        per_shape.built.clear()  # a backend named, not chosen by auto, compiles every shape; two shapes' kernels
        monkeypatch.setattr(dispatch, "SHAPE_KERNELS_KEPT", 4)  # of its two roles (select, attn) are kept
        named = kernelgen.get_kernel(SPEC.replace(backend="per_shape_reference"))
        for n in (100, 200, 100, 250, 100, 200):
            named(q[:, :, :n], k[:, :, :n], v[:, :, :n])
        assert per_shape.built == [100, 200, 250, 200]  # 200, the least recently used, went for 250

        monkeypatch.setenv("KERNELGEN_PER_SHAPE_LIMIT", "many")
        with pytest.raises(kernelgen.KernelgenValueError, match="KERNELGEN_PER_SHAPE_LIMIT='many'; expected an int"):
            dispatch.per_shape_limit()
    finally:
        backends.unregister("per_shape_reference")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        kernelgen.get_kernel(SPEC.replace(backend="nope"))


# ---- a test-only role: one template and one launcher ----------------------------------------------

ROW_SUM_TEMPLATE = '''\
# spec: {{ spec_json }}
import triton
import triton.language as tl


@triton.jit
def row_sum(X, OUT, n_rows, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    x = tl.load(X + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], mask=rows[:, None] < n_rows, other=0.0)
    tl.store(OUT + rows, tl.sum(x.to(tl.float32), 1), mask=rows < n_rows)
'''


def _launch_row_sum(mod, spec, config, shapes, x):
    out = torch.empty(x.shape[:-1], dtype=torch.float32)
    n_rows = out.numel()
    mod.row_sum[(-(-n_rows // 16),)](x, out, n_rows, HEAD_DIM=spec.head_dim, ROWS=16)
    return out


def test_a_new_role_is_one_template_and_one_launcher(tmp_path, monkeypatch):
    """What adding a role takes: a Role (what it computes) and, per backend that runs it, a template and a
    launcher. Dispatch then builds and launches it like any other role."""
    template = tmp_path / "row_sum.py.j2"
    template.write_text(ROW_SUM_TEMPLATE)
    monkeypatch.setitem(ROLES, "row_sum", Role("row_sum", "the sum of each row of a [B, H, N, D] tensor"))
    triton_backend = backends.get("triton")
    monkeypatch.setitem(triton_backend.roles, "row_sum", RoleImpl(launch=_launch_row_sum, template=template))
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))

    spec = Spec(head_dim=64)
    x, _, _ = _inputs(n=100)
    attn = kernelgen.get_kernel(spec, configs={})
    shapes = kernelgen.inputs.check_qkv(x, x, x, spec)
    out = attn._run("row_sum", x, shapes, x)
    assert torch.allclose(out, x.sum(-1), atol=1e-4)
    assert attn.served("row_sum", 100, x.dtype, x.device).backend is triton_backend


# ---- the import graph and the backend names ---------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """kernelgen modules that `path` imports, at module level or inside functions, with the packages whose
    __init__ such an import runs."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kernelgen"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "kernelgen":
                continue
            for alias in node.names:  # `from . import backends` imports a submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).exists()
                          or (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else target)
    # importing kernelgen.a.b first runs the package kernelgen.a (its __init__), which counts; kernelgen's
    # own __init__ is the top of every import and imports the public API, so it is left out
    # (a module's own packages are being initialised when it runs: they are no edge)
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 1)}
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return (found | parents) - own - {name, "kernelgen"}


def test_kernelgen_modules_import_no_cycle():
    graph = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    visiting, done = [], set()

    def visit(node):
        if node in done:
            return
        if node in visiting:
            raise AssertionError("import cycle: " + " -> ".join(visiting[visiting.index(node):] + [node]))
        visiting.append(node)
        for other in sorted(graph.get(node, ())):
            visit(other)
        visiting.pop()
        done.add(node)

    assert "kernelgen.dispatch" in graph and "kernelgen.backends.triton" in graph
    for node in sorted(graph):
        visit(node)


def test_no_code_outside_backends_compares_a_backend_name():
    names = set(backends.names())
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "backends" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for operand in [node.left, *node.comparators]:
                    values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                    if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, f"backend names compared outside kernelgen/backends/: {offenders}"


def test_every_public_config_type_is_exported():
    for backend in backends.all_backends():
        for role, impl in backend.roles.items():
            if impl.config_type is not None:
                assert getattr(kernelgen, impl.config_type.__name__) is impl.config_type, (backend.name, role)


def test_kernelgen_raises_its_own_errors():
    """Every deliberate error is a KernelgenError (still a ValueError, TypeError or RuntimeError), so that
    `except kernelgen.KernelgenError` catches kernelgen's alone; the tuner's sabotage hook is a test's."""
    plain = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                if node.exc.func.id in ("ValueError", "TypeError", "RuntimeError") \
                        and "sabotaged" not in ast.get_source_segment(source, node):
                    plain.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not plain, f"plain errors raised by kernelgen: {plain}"


def test_an_unknown_role_is_named_as_such():
    attn = kernelgen.get_kernel(Spec(head_dim=64))
    with pytest.raises(kernelgen.KernelgenValueError, match=r"role='foo' is unknown; expected one of"):
        attn.served("foo", 100, torch.float32, "cpu")


def test_what_is_served_checks_the_question():
    """config/served/backend answer for a call's length and dtype: a dtype or length of another type would match
    no tuned row and answer "default" where calls get a winner, so it is refused, named."""
    attn = kernelgen.get_kernel(Spec(head_dim=64))
    with pytest.raises(kernelgen.KernelgenTypeError, match=r"dtype must be a torch.dtype.*got str 'bf16'"):
        attn.served("attn", 4096, "bf16", "cpu")
    with pytest.raises(kernelgen.KernelgenTypeError, match=r"n_k must be an int, got str '4096'"):
        attn.backend("4096", torch.float32, "cpu")
    with pytest.raises(kernelgen.KernelgenValueError, match=r"n_q must be a positive int, got 0"):
        attn.config("attn", 0, 4096, torch.float32, "cpu")
    with pytest.raises(kernelgen.KernelgenTypeError, match=r"n_k must be an int, got float 64.5"):
        attn.config("attn", 64, 64.5, torch.float32, "cpu")
    assert attn.served("attn", 4096, torch.float32, "cpu").source == "default"

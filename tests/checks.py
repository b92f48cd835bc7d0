"""Checks shared by the kernel tests: errors against the float64 reference, selection validity, offline
compiles for a GPU arch (tools/offline_compile.py), and a read-only directory."""
import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kernelgen import backends, reference
from kernelgen.device import current_arch
from kernelgen.roles import get_role

# The arch the tests' kernels run on: the GPU's, else the interpreter's ("cpu": sm_90's configs)
TEST_ARCH = current_arch() or "cpu"

# relative L2 error, max-abs error (inputs are randn; outputs are O(0.1..1))
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (3e-3, 2e-2),
    torch.bfloat16: (1e-2, 6e-2),
}

# gradients: relative L2 error, max-abs error over the largest reference magnitude (inputs and do are randn)
GRAD_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 3e-3),
    torch.bfloat16: (1e-2, 2e-2),
}


def served_backend(spec, role):
    """(backend, kernel spec) that get_kernel runs `role` of `spec` with: the spec's backend when it has
    the role, else the fallback (`backends.runner`), and the role's canonical spec for it."""
    backend = backends.runner(spec.backend, role)
    return backend, get_role(role).kernel_spec(spec, backend.name)


def default_config(spec, role, arch=TEST_ARCH):
    """The config get_kernel serves `role` of `spec` with on `arch` when nothing is pinned or tuned."""
    backend, kernel_spec = served_backend(spec, role)
    return backend.default_config(kernel_spec, role, arch)


def config_space(spec, role, arch=TEST_ARCH):
    """The feasible points of the search space of `role` for `spec` on `arch`."""
    backend, kernel_spec = served_backend(spec, role)
    return backend.config_space(kernel_spec, role, arch)


def feasible(spec, role, config, arch=TEST_ARCH) -> bool:
    backend, kernel_spec = served_backend(spec, role)
    return backend.infeasible(kernel_spec, role, config, arch) is None


def assert_close_to_reference(o, lse, ref_o, ref_lse, dtype):
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert not torch.isnan(o).any(), "output has NaN (unwritten or poisoned elements)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or poisoned elements)"
    rel = ((o.double() - ref_o).norm() / ref_o.norm().clamp(min=1e-30)).item()
    max_abs = (o.double() - ref_o).abs().max().item()
    assert rel < rel_tol and max_abs < abs_tol, f"rel {rel:.2e} (tol {rel_tol}), max-abs {max_abs:.2e} (tol {abs_tol})"
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), "lse = -inf exactly where no key is visible"
    assert (lse[inf] < 0).all()
    lse_err = (lse.double()[~inf] - ref_lse[~inf]).abs().max().item() if (~inf).any() else 0.0
    assert lse_err < 10 * abs_tol, f"lse max-abs {lse_err:.2e}"
    return rel, max_abs


def assert_backward_is_deterministic(attn, q, k, v, do) -> None:
    """Two backward runs of attn(q, k, v) give bitwise-equal gradients."""
    import torch

    first = torch.autograd.grad(attn(q, k, v), (q, k, v), do)
    second = torch.autograd.grad(attn(q, k, v), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def assert_compiled_step_is_eager(attn, q, k, v, do) -> None:
    """attn(q, k, v) compiled with fullgraph=True gives the eager call's o and gradients bit for bit."""
    import torch

    want_o = attn(q, k, v)
    want = torch.autograd.grad(want_o, (q, k, v), do)
    o = torch.compile(lambda q, k, v: attn(q, k, v), fullgraph=True)(q, k, v)
    got = torch.autograd.grad(o, (q, k, v), do)
    assert torch.equal(o, want_o) and all(torch.equal(a, b) for a, b in zip(got, want))


def assert_valid_selection(block_idx, q, k, spec, tol=1e-3, index=None):
    """`block_idx` is a correct top-k: canonical form, eligible blocks only, every forced block, as many
    blocks as the budget allows, and no unchosen eligible block scores clearly higher than a chosen one
    (float64 reference scores, of `index` = (q_idx, k_idx, w) for the index selector; `tol` absorbs the
    kernel's fp32/tf32 rounding at near-ties)."""
    nq, nk = q.shape[2], k.shape[2]
    n_blocks = spec.n_kv_blocks(nk)
    assert block_idx.dtype == torch.int32
    assert torch.equal(block_idx, reference.normalize_block_idx(block_idx, n_blocks)), \
        "not ascending distinct ids then -1"
    scores = reference.block_scores(q, k, spec, index)
    eligible, forced = reference.tile_eligibility(spec, nq, nk, device=q.device)
    chosen = torch.zeros(*scores.shape[:-1], n_blocks + 1, dtype=torch.bool, device=q.device)
    idx = block_idx.long()
    chosen.scatter_(-1, torch.where(idx >= 0, idx, n_blocks), True)
    chosen = chosen[..., :n_blocks]
    assert not (chosen & ~eligible).any(), "an ineligible block was chosen"
    assert not (forced & ~chosen).any(), "a forced block is missing"
    n_expected = torch.clamp(eligible.sum(-1), max=spec.top_k)
    assert torch.equal(chosen.sum(-1), n_expected.expand_as(chosen.sum(-1))), "wrong number of blocks"
    free = eligible & ~forced
    worst_chosen = torch.where(chosen & free, scores, torch.inf).amin(-1)
    best_unchosen = torch.where(~chosen & free, scores, -torch.inf).amax(-1)
    scale = scores[torch.isfinite(scores)].abs().max().clamp(min=1.0)
    assert (best_unchosen <= worst_chosen + tol * scale).all(), "an unchosen block scores higher than a chosen one"


def cubin_bytes(kernel) -> bytes:
    """The cubin inside a compiled tilelang.JITKernel (built with TileLang's cache off)."""
    cuda_mod = next(m for m in kernel.adapter.rt_mod.imports if m.kind == "cuda")
    try:
        data = cuda_mod.inspect_source("cubin")
        return data.encode("latin-1") if isinstance(data, str) else bytes(data)
    except UnicodeDecodeError as e:  # the cubin is binary; tvm-ffi returns it as a string
        return e.object


def tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package)."""
    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_offline(cases: list[dict], arch: str, processes: int = 1, timeout: float = 1200) -> list[dict]:
    """tools/offline_compile.py's results for `arch` on `cases` (its JSON case format), in order:
    {"kernels": [[name, shared_bytes], ...]} or {"error": "..."}."""
    return tool("offline_compile").compile_offline(cases, arch, processes, timeout)


def assert_exported_module_matches_get_kernel(backend: str, tmp_path) -> None:
    """The module `kernelgen export` writes for a `backend` spec computes what get_kernel computes with the
    configs baked into it: same lists, bit-identical o and lse (GPU: bf16, 8k keys, causal, G=4)."""
    import dataclasses

    import kernelgen
    from kernelgen import Spec
    from kernelgen.export import export_module

    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, backend=backend)
    name = f"kg_{backend}_gpu"
    path = export_module(spec, tmp_path / f"{name}.py")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    gen = torch.Generator(device="cuda").manual_seed(41)
    q = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 2, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    # the configs baked in (the module's own config classes: rebuilt as kernelgen's); no configs given to
    # export_module: the defaults
    baked = {role: backends.runner(backend, role).config_from_dict(role, cfg and dataclasses.asdict(cfg))
             for role, cfg in module.kernel._fixed.items()}
    assert baked["attn"] == default_config(spec, "attn")
    attn = kernelgen.get_kernel(spec, configs=baked)
    o, lse = module.attn(q, k, v, return_lse=True)
    want_o, want_lse = attn(q, k, v, return_lse=True)
    assert torch.equal(module.select(q, k), attn.select(q, k))
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


@contextlib.contextmanager
def read_only(path: Path):
    """`path` (a file or a directory) refuses writes, and a directory new files, for the duration, root
    included: chmod, and as root `chattr +i` (root ignores permission bits, not an immutable inode). Skips
    the test where neither takes effect."""
    import pytest

    from kernelgen.codegen.cache import unwritable

    mode = path.stat().st_mode & 0o777
    path.chmod(0o555 if path.is_dir() else 0o444)
    immutable = (os.geteuid() == 0 and shutil.which("chattr") is not None
                 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0)
    try:
        if (unwritable(path) is None) if path.is_dir() else os.access(path, os.W_OK):
            pytest.skip(f"cannot make {path} read-only here (root without chattr)")
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)

"""A non-editable `pip install .` works: the installed package carries its templates and bundled tuning DB,
renders kernels and runs a forward pass, from a working directory outside the repository.

The venv is created with --system-site-packages so torch and triton come from the running environment
(nothing large is downloaded). With hatchling importable the build needs no network
(--no-deps --no-build-isolation); otherwise pip builds in isolation, fetching only hatchling.
"""
import importlib.util
import os
import re
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("venv")

REPO = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent(
    """
    import json, os, sys, sysconfig
    from pathlib import Path

    import torch
    import kernelgen
    from kernelgen import Spec, backends, reference
    from kernelgen.codegen import render

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    venv = Path(sys.prefix).resolve()
    pkg = Path(kernelgen.__file__).resolve().parent
    tdir = Path(render.TEMPLATE_DIR).resolve()
    assert sys.prefix != sys.base_prefix, "not running inside the venv"
    assert pkg.is_relative_to(site), f"kernelgen imported from {pkg}, not from the venv's {site}"
    assert tdir.is_relative_to(site) and tdir.is_dir(), f"TEMPLATE_DIR {tdir} is not inside {site}"
    for backend in backends.all_backends():
        for role, impl in backend.roles.items():
            assert (tdir / impl.template).is_file(), f"missing template {impl.template} in {tdir}"
            assert len(backend.template_hash(role)) == 16

    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1, sink=1)
    for role, impl in backends.get("triton").roles.items():
        src = render.render(impl.template, spec)
        assert "@triton.jit" in src and spec.to_json() in src, role

    bundled = pkg / "tuning_db" / "winners.db"
    assert bundled.is_file(), f"bundled tuning DB missing: {bundled}"

    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 70, 64, generator=gen, dtype=torch.float32)
    k = torch.randn(1, 1, 90, 64, generator=gen, dtype=torch.float32)
    v = torch.randn(1, 1, 90, 64, generator=gen, dtype=torch.float32)
    attn = kernelgen.get_kernel(spec)
    idx = attn.select(q, k)
    o, lse = attn(q, k, v, return_lse=True)
    ref_o, ref_lse, ref_idx = reference.sparse_attention(q, k, v, spec)
    assert torch.equal(idx, ref_idx), (idx, ref_idx)
    err = ((o.double() - ref_o).norm() / ref_o.norm()).item()
    assert err < 1e-5, err
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4
    cache = Path(os.environ["KERNELGEN_CACHE_DIR"])
    assert any(cache.rglob("kg_triton_attn_*.py")), "rendered kernels are not in KERNELGEN_CACHE_DIR"
    print(json.dumps({"package": str(pkg), "templates": str(tdir), "rel_err": err}))
    """
)


def _run(cmd, cwd, env, timeout):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-4000:]}")
    return proc


def test_non_editable_install(tmp_path):
    venv_dir = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # --without-pip skips ensurepip (slow): the venv's interpreter runs the system pip, which it sees through
    # --system-site-packages, and that pip installs into the venv (sys.prefix).
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv_dir)], tmp_path, env, 60)
    py = venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # --system-site-packages exposes the *base* interpreter's packages; when the tests themselves run in a
    # venv, torch and triton live in that venv instead, so expose its site-packages too (after the new
    # venv's own, which therefore wins for kernelgen).
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env, 60)
    outer = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(purelib.stdout.strip()) / "_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))
    pip = [str(py), "-m", "pip", "install", "--no-input", "--quiet"]
    if importlib.util.find_spec("hatchling") is not None:
        pip += ["--no-deps", "--no-build-isolation"]
    _run(pip + [str(REPO)], tmp_path, env, 300)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env.update(TRITON_INTERPRET="1", KERNELGEN_CACHE_DIR=str(tmp_path / "cache"), KERNELGEN_POISON="1")
    script = work / "check_install.py"
    script.write_text(CHECK)
    proc = _run([str(py), str(script)], work, env, 300)
    assert '"rel_err"' in proc.stdout, proc.stdout
    print(proc.stdout)


def test_import_kernelgen_reaches_its_submodules():
    """`import kernelgen` alone then kernelgen.custom_ops / kernelgen.distributed, as the README writes them
    (loaded on first use); an unknown attribute is still an AttributeError."""
    code = ("import kernelgen\n"
            "assert callable(kernelgen.custom_ops.sparse_attention) and callable(kernelgen.distributed.attention)\n"
            "try:\n    kernelgen.no_such_thing\nexcept AttributeError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no attribute 'no_such_thing'" in result.stdout


def _names_no_numpy():
    raise TypeError("only 0-dimensional arrays can be converted to Python scalars")  # numpy 2.4's, in Triton 3.6


def test_numpy_that_breaks_the_interpreter_is_named(monkeypatch, device):
    """numpy 2.4 with Triton 3.6: the interpreter's problem is said at import, and a launch that meets it is a
    one-line KernelgenRuntimeError saying what to install; with a numpy that works, nothing is said."""
    import importlib.metadata

    import triton

    from kernelgen import KernelgenRuntimeError
    from kernelgen.device import interpret_triton_language, interpreter_numpy_problem

    versions = {"numpy": "2.4.0", "triton": "3.6.0"}
    monkeypatch.setattr(importlib.metadata, "version", versions.__getitem__)
    assert re.search(r"numpy 2.4 breaks Triton 3.6's CPU interpreter.*numpy<2.4", interpreter_numpy_problem())
    if device == "cpu":
        interpret_triton_language()  # as kernelgen's kernel modules do when they load (the launch's error named)

        @triton.jit
        def kernel(x):
            _names_no_numpy()

        with pytest.raises(KernelgenRuntimeError, match=r"^numpy 2.4 breaks .* pip install 'numpy<2.4'$"):
            kernel[(1,)](torch.zeros(1))
    versions["numpy"] = "2.3.5"
    assert interpreter_numpy_problem() is None


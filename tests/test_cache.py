"""Where rendered kernel modules go: the cache dir's kernels/, or, where that cannot be written, a private
temporary directory of the process (CPU: the kernels run in the interpreter, in a child process so that
nothing is memoised from other tests)."""
import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from checks import read_only

import kernelgen
from kernelgen.codegen.cache import cache_dir, kernels_dir, untrusted, unwritable

CHILD = textwrap.dedent('''
    import logging

    import torch

    import kernelgen
    from kernelgen.codegen.cache import kernels_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    spec = kernelgen.Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, selector="mean")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 128, 64, generator=gen) for _ in range(3))
    o = kernelgen.get_kernel(spec)(q, k, v)  # three kernel modules: lists, select, attn
    expected = kernelgen.reference.sparse_attention(q, k, v, spec)[0]
    assert ((o.double() - expected).norm() / expected.norm()).item() < 1e-4
    print(kernels_dir())
''')


def _run(tmp_path, cache):
    """CHILD with KERNELGEN_CACHE_DIR=cache and its temp dir in tmp_path/tmp: (kernels dir, stderr)."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(cache), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": str(Path(kernelgen.__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("where", ["read-only dir", "under a regular file"])
def test_kernels_run_when_the_cache_dir_cannot_be_written(tmp_path, where):
    """get_kernel(spec)(q, k, v) works; its modules go to one private temporary directory, with one warning,
    removed at exit; nothing is written to the cache dir."""
    if where == "read-only dir":
        cache = tmp_path / "cache"
        cache.mkdir()
        with read_only(cache):
            private, stderr = _run(tmp_path, cache)
        assert list(cache.iterdir()) == []
    else:
        (tmp_path / "file").write_text("")
        private, stderr = _run(tmp_path, tmp_path / "file" / "cache")
    warnings = [line for line in stderr.splitlines() if "cannot write kernel modules" in line]
    assert len(warnings) == 1 and str(private) in warnings[0], stderr
    assert private.parent == tmp_path / "tmp" and private.name.startswith("kernelgen-kernels-")
    assert not private.exists()  # removed at exit


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no file owners to compare")
@pytest.mark.parametrize("how", ["writable by others", "parent writable by others", "a symbolic link"])
def test_kernels_are_never_imported_from_a_directory_others_could_write(tmp_path, how):
    """A kernels directory that another user could plant modules or bytecode in (a shared temporary directory's
    predictable name, made first by someone else, as an exported module's default cache is) is not used: the
    modules go to a private temporary directory, with a warning naming why."""
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    if how == "writable by others":
        (cache / "kernels").chmod(0o777)
    elif how == "parent writable by others":
        cache.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir()
        (cache / "kernels").rmdir()
        (cache / "kernels").symlink_to(tmp_path / "elsewhere")
    private, stderr = _run(tmp_path, cache)
    assert private.parent == tmp_path / "tmp" and private.name.startswith("kernelgen-kernels-")
    assert how.split(" by ")[0].replace("parent ", "") in stderr
    assert not any((cache / "kernels").iterdir())


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no file owners to compare")
def test_a_directory_its_user_s_own_group_may_write_is_trusted(tmp_path):
    """A umask of 002 (a user's private group) makes directories group-writable: that group is the user's own."""
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    kernels.chmod(0o775)
    assert os.stat(kernels).st_gid == os.getgid() and untrusted(kernels) is None
    kernels.chmod(0o777)
    assert untrusted(kernels) == f"{kernels} is writable by others"


def test_kernels_go_to_the_cache_dir_when_it_can_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache" and not cache_dir().exists()  # cache_dir() creates nothing
    assert kernels_dir() == tmp_path / "cache" / "kernels" and unwritable(kernels_dir()) is None
    assert list(kernels_dir().iterdir()) == []  # the write probe leaves nothing behind


def test_a_cache_dir_given_with_a_tilde_is_the_home_s(tmp_path, monkeypatch):
    """KERNELGEN_CACHE_DIR='~/kg' (quoted in a shell, a Dockerfile's ENV) is under $HOME, not a './~' directory."""
    from kernelgen.tuning.db import default_user_db_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", "~/kg")
    monkeypatch.chdir(tmp_path)
    assert cache_dir() == tmp_path / "home" / "kg"
    assert kernels_dir() == tmp_path / "home" / "kg" / "kernels"
    assert default_user_db_path() == tmp_path / "home" / "kg" / "tuning.db"
    assert not (tmp_path / "~").exists()


def test_damaged_kernel_files_in_the_cache_are_written_anew(tmp_path):
    """A cached kernel module that is not text, one that cannot be read (by a user other than root), and truncated
    bytecode of one left as it was: the next process's call rewrites the modules, never imports cached bytecode,
    and its output is right."""
    cache = tmp_path / "cache"
    (tmp_path / "first").mkdir()
    kernels, _ = _run(tmp_path / "first", cache)
    modules = sorted(kernels.glob("*.py"))
    assert len(modules) == 3
    modules[0].write_bytes(os.urandom(2000) + b"\xff\xfe")
    modules[1].chmod(0)
    pyc = Path(py_compile.compile(str(modules[2]), doraise=True))  # valid for the source as it is, then cut short
    pyc.write_bytes(pyc.read_bytes()[:100])
    (tmp_path / "second").mkdir()
    assert _run(tmp_path / "second", cache)[0] == kernels
    assert all("# Generated by kernelgen" in module.read_text() for module in modules)

"""tools/carry_winners.py in a scratch repository (HEAD's kernelgen, templates and tools, with the working tree's
carry_winners.py and offline_compile.py): a template edit that leaves the attention's PTX unchanged (a comment, a
renamed local) carries its winner to the new template hash; one that changes the code (a constant) leaves the
row as it was. The same for TileLang rows (attn and bwd_dkdv), by their generated CUDA source. One small spec
(D=64, 1024 keys), compiled or lowered for sm_90 without a GPU."""
import dataclasses
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kernelgen import Spec, backends
from kernelgen.codegen import render
from kernelgen.roles import get_role
from kernelgen.tuning.db import current_fingerprint, write_bundled_db

pytest.importorskip("triton.backends.nvidia")

REPO = Path(__file__).resolve().parent.parent
TRITON = backends.get("triton")
SPEC = get_role("attn").kernel_spec(Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, selector="given"), "triton")
N = 1024
GIT = ["git", "-c", "user.name=kernelgen tests", "-c", "user.email=tests@kernelgen.invalid", "-c",
       "commit.gpgsign=false"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _scratch_repo(tmp_path: Path) -> Path:
    """kernelgen, templates and tools of this repository's HEAD, the tools under test from its working tree,
    committed as one revision."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "kernelgen", "templates", "tools"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip("not a git checkout")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    for tool in ("carry_winners.py", "offline_compile.py"):
        shutil.copy(REPO / "tools" / tool, repo / "tools" / tool)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "old")
    return repo


def _attn_hash(repo: Path, backend: backends.Backend = TRITON, role: str = "attn") -> str:
    """The attention's (or `backend`'s `role`'s) template hash in `repo`'s tree (kernelgen's own, over its
    templates)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(render, "TEMPLATE_DIR", repo / "templates")
        backends.Backend.template_hash.cache_clear()
        try:
            return backend.template_hash(role)
        finally:
            backends.Backend.template_hash.cache_clear()


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}: pick another edit for this test"
    path.write_text(text.replace(old, new))


def _rows(db: Path) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute("SELECT * FROM winners ORDER BY bucket, backend")]


def _journal_mode(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]


def _carry(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "tools" / "carry_winners.py"), *args, "--jobs", "1"],
                          cwd=repo, capture_output=True, text=True, timeout=600)


def _verdicts(stdout: str) -> dict[tuple[str, int], str]:
    """(backend, bucket) -> verdict, from the tool's row lines."""
    verdicts = {}
    for line in stdout.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[0] in backends.names() and fields[3].isdigit():
            verdicts[fields[0], int(fields[3])] = fields[5]
    return verdicts


def test_a_template_edit_that_keeps_the_ptx_carries_the_winner_and_one_that_changes_it_does_not(tmp_path):
    repo = _scratch_repo(tmp_path)
    old_hash = _attn_hash(repo)
    fingerprint = current_fingerprint(TRITON, "attn").as_columns()
    attn = dict(spec_key=SPEC.key(), role="attn", backend="triton", arch="sm_90", gpu_name="NVIDIA H200", bucket=N,
                dtype="bfloat16", config=dataclasses.asdict(TRITON.default_config(SPEC, "attn", "sm_90")),
                median_ms=0.01, tflops=1.0, n_trials=3, timestamp="2026-01-01T00:00:00+00:00",
                spec_json=SPEC.to_json(), **{**fingerprint, "template_hash": old_hash})
    db = write_bundled_db(tmp_path / "winners.db", [
        attn,
        {**attn, "bucket": 2048, "template_hash": "0" * 16},  # tuned with templates OLD_REV never had
        {**attn, "backend": "tilelang", "template_hash": "0" * 16}])  # stale; TileLang is not compiled here
    assert _journal_mode(db) == "delete"
    before = _rows(db)

    # (a) a comment line and a renamed local: the same PTX
    template = repo / "templates" / TRITON.role("attn").template
    _edit(template, "import triton.language as tl\n", "import triton.language as tl\n# a comment moves every line\n")
    _edit(template, "lse_ptrs", "lse_out_ptrs")
    _git(repo, "commit", "-q", "-am", "new")
    new_hash = _attn_hash(repo)
    assert new_hash != old_hash
    done = _carry(repo, "HEAD~1", "--db", str(db))
    assert done.returncode == 0, done.stderr
    verdicts = _verdicts(done.stdout)
    assert verdicts == {("triton", N): "carried", ("tilelang", N): verdicts["tilelang", N],
                        ("triton", 2048): verdicts["triton", 2048]}, done.stdout
    assert verdicts["triton", 2048].startswith("not from OLD_REV"), done.stdout
    assert verdicts["tilelang", N].startswith("not from OLD_REV"), done.stdout
    after = _rows(db)
    assert after == [{**row, "template_hash": new_hash} if row["template_hash"] == old_hash else row
                     for row in before]  # that column of that row only
    assert _journal_mode(db) == "delete"
    assert len(_git(repo, "worktree", "list").splitlines()) == 1  # OLD_REV's checkout removed

    # (b) a changed constant in the working tree (uncommitted: the current tree is the working tree)
    _edit(template, "* 0.6931471805599453", "* 0.69")
    done = _carry(repo, "HEAD", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert _verdicts(done.stdout)["triton", N] == "differs: attn_fwd", done.stdout
    assert _rows(db) == after and _journal_mode(db) == "delete"

    # a revision or DB that is none: one line on stderr, exit status 2
    for args in (["no-such-rev", "--db", str(db)], ["HEAD", "--db", str(tmp_path / "none.db")]):
        done = _carry(repo, *args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and not done.stdout, done


def test_a_tilelang_template_edit_that_keeps_the_cuda_source_carries_the_winner_and_one_that_changes_it_does_not(
        tmp_path):
    """TileLang rows (attn, bwd_dkdv) are lowered to CUDA source in both trees: a comment line that moves every
    line of the rendered module carries bwd_dkdv's row; a changed constant of the forward leaves its row. A float16
    row is not checked."""
    pytest.importorskip("tilelang")
    tilelang = backends.get("tilelang")
    repo = _scratch_repo(tmp_path)
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, selector="given", backend="tilelang")
    rows = []
    for role in ("attn", "bwd_dkdv"):
        kernel_spec = get_role(role).kernel_spec(spec, "tilelang")
        rows.append(dict(
            spec_key=kernel_spec.key(), role=role, backend="tilelang", arch="sm_90", gpu_name="NVIDIA H200",
            bucket=N, dtype="bfloat16", config=dataclasses.asdict(tilelang.default_config(kernel_spec, role, "sm_90")),
            median_ms=0.01, tflops=1.0, n_trials=3, timestamp="2026-01-01T00:00:00+00:00",
            spec_json=kernel_spec.to_json(),
            **{**current_fingerprint(tilelang, role).as_columns(), "template_hash": _attn_hash(repo, tilelang, role)}))
    db = write_bundled_db(tmp_path / "winners.db", [*rows, {**rows[0], "bucket": 2048, "dtype": "float16"}])
    before = _rows(db)

    # a comment line in both templates moves every line of the rendered modules; the forward's LN2 changes too
    for role in ("attn", "bwd_dkdv"):
        _edit(repo / "templates" / tilelang.role(role).template, "import tilelang.language as T\n",
              "import tilelang.language as T\n# a comment moves every line\n")
    _edit(repo / "templates" / tilelang.role("attn").template, "LN2 = 0.6931471805599453", "LN2 = 0.69")
    _git(repo, "commit", "-q", "-am", "new")
    new_hashes = {row["role"]: _attn_hash(repo, tilelang, row["role"]) for row in rows}
    assert all(new_hashes[row["role"]] != row["template_hash"] for row in rows)
    done = _carry(repo, "HEAD~1", "--db", str(db))
    assert done.returncode == 0, done.stderr
    verdicts = _role_verdicts(done.stdout)
    assert verdicts == {("attn", N): "differs: attn_fwd_kernel", ("bwd_dkdv", N): "carried",
                        ("attn", 2048): "not checked (dtype float16: lowered in bfloat16 only)"}, done.stdout
    assert _rows(db) == [{**row, "template_hash": new_hashes["bwd_dkdv"]} if row["role"] == "bwd_dkdv" else row
                         for row in before]
    assert _journal_mode(db) == "delete" and len(_git(repo, "worktree", "list").splitlines()) == 1


def _role_verdicts(stdout: str) -> dict[tuple[str, int], str]:
    """(role, bucket) -> verdict of the TileLang rows, from the tool's row lines."""
    verdicts = {}
    for line in stdout.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[0] == "tilelang" and fields[3].isdigit():
            verdicts[fields[1], int(fields[3])] = fields[5]
    return verdicts

"""Every `kernelgen` command through typer's test runner (CPU)."""
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from kernelgen import AttnConfig, Spec, backends
from kernelgen.archs import ARCHS
from kernelgen.backends.triton import attn_smem_bytes
from kernelgen.cli import app
from kernelgen.roles import get_role
from kernelgen.workloads import SHAPES
from kernelgen.tuning.db import BUNDLED_DB_PATH, TuningDB, current_fingerprint, read_only_rows

runner = CliRunner()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))


def invoke(*args):
    result = runner.invoke(app, list(args))
    return result


def one_line_error(result, *words):
    """Bad input: exit status 2 and one line on stderr naming what was wrong, never a traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernelgen: error: "), result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], (word, lines[0])


def flat(output: str) -> str:
    """The words of an output, without rich's line breaks and panel borders."""
    return " ".join(output.replace("│", " ").split())


def printed_configs(output: str) -> list[dict]:
    """The configs a dry run lists, in order (JSON objects, which rich's tables wrap at spaces)."""
    return [json.loads(text) for text in re.findall(r"\{[^{}]*\}", flat(output)) if text.startswith('{"')]


@pytest.mark.parametrize("command", [[], ["tune"], ["db"], ["db", "list"], ["export"], ["bench"], ["info"]])
def test_help(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_info():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "triton" in result.output and "tuning DB" in result.output


def test_tune_dry_run_prints_space_without_gpu(tmp_path):
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, local=1)
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    result = invoke("tune", "--arch", "sm_90", "--seq", "32768", "--spec", str(path), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "attn" in result.output and "select" in result.output and "32768" in result.output
    assert "block_m" in result.output and "tiles" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_tune_without_gpu_is_a_clear_error():
    result = invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64")
    one_line_error(result, "no CUDA GPU")


def test_tune_auto_backend_is_a_clear_error():
    result = invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--backend", "auto", "--dry-run",
                    "--role", "attn")
    one_line_error(result, "served, not tuned", *backends.names())


def test_tune_dry_run_gluon_prints_the_gluon_space():
    """128 keys per block at D=128 and 2 heads of 64-query tiles: 64 or 128 rows, and 2 or 3 stages (4 do
    not fit in shared memory)."""
    result = invoke("tune", "--arch", "sm_90", "--seq", "8192", "--head-dim", "128", "--kv-block", "128",
                    "--gqa-group", "2", "--backend", "gluon", "--role", "attn", "--dry-run")
    assert result.exit_code == 0, result.output
    spec = Spec(head_dim=128, kv_block=128, q_tile=64, top_k=16, gqa_group=2, backend="gluon")
    assert f"kg-{get_role('attn').key(spec, 'gluon')}-attn-gluon-sm_90-8192" in result.output
    assert "space of 4 configs" in result.output
    for block_m in (64, 128):
        for stages in (2, 3):
            assert f'{{"block_m": {block_m}, "num_stages": {stages}}}' in result.output
    assert '"num_stages": 4' not in result.output and "num_warps" not in result.output


def test_tune_gluon_spec_the_kernel_cannot_compute_is_a_clear_error():
    result = invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "128", "--kv-block", "32",
                    "--backend", "gluon", "--dry-run")
    one_line_error(result, "kv_block=32 is not supported by backend='gluon'")


@pytest.mark.parametrize("args, words", [
    (["--head-dim", "96"], ["head_dim=96"]),
    (["--backend", "banana"], ["backend='banana' is unknown"]),
    (["--arch", "banana"], ["arch='banana' is not a CUDA arch"]),
    (["--arch", "sm_999"], ["arch='sm_999' is not a CUDA arch"]),
    (["--arch", "sm_75"], ["arch='sm_75' is older than kernelgen's kernels run on; expected sm_80 or newer"]),
    (["--seq", "-5"], ["seq must be an int from 1"]),
    (["--trials", "0"], ["trials must be an int >= 1"]),
    (["--role", "foo"], ["--role 'foo' is not a tuned role"]),
    (["--backend", "gluon", "--arch", "sm_89", "--kv-block", "64", "--role", "attn"], ["runs on sm_90 only"]),
])
def test_bad_tune_options_are_one_line_errors(args, words):
    base = {"--arch": "sm_90", "--seq": "4096", "--head-dim": "64"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    result = invoke("tune", *[x for kv in base.items() for x in kv], "--dry-run")
    one_line_error(result, *words)


def test_tune_preset_bench_dry_run_plans_every_backend_the_arch_runs():
    result = invoke("tune", "--arch", "sm_90", "--preset", "bench", "--shapes", "a32k", "--dry-run")
    assert result.exit_code == 0, result.output
    for name in ("(triton)", "(tilelang)", "(gluon)"):
        assert name in result.output
    result = invoke("tune", "--arch", "sm_89", "--preset", "bench", "--shapes", "a32k", "--dry-run")
    assert result.exit_code == 0 and "(gluon)" not in result.output and "(triton)" in result.output
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "nope", "--dry-run"), "preset 'nope' is unknown")


def _triton_attn_points(output: str) -> list[AttnConfig]:
    return [AttnConfig(**c) for c in printed_configs(output) if "use_tma" in c]


@pytest.mark.parametrize("options", [
    ["--seq", "32768", "--head-dim", "128", "--kv-block", "128", "--q-tile", "128", "--gqa-group", "4", "--causal"],
    ["--preset", "bench", "--shapes", "c"],  # the same attention, as the bundled winners are tuned
])
def test_tune_dry_run_plans_only_what_the_arch_runs(options):
    """sm_89 (99 KB of shared memory per program, no TMA): no use_tma point, no Gluon study, and every
    Triton attention point within 99 KB, where sm_90 plans all three."""
    spec = SHAPES["c"].spec("given")
    assert (spec.head_dim, spec.kv_block, spec.q_tile, spec.gqa_group, spec.causal) == (128, 128, 128, 4, True)
    plans = {}
    for arch in ("sm_89", "sm_90"):
        result = invoke("tune", "--arch", arch, *options, "--dry-run")
        assert result.exit_code == 0, result.output
        plans[arch] = result.output
    sm89, sm90 = _triton_attn_points(plans["sm_89"]), _triton_attn_points(plans["sm_90"])
    assert sm89 and not any(c.use_tma for c in sm89) and "(gluon)" not in plans["sm_89"]
    assert max(attn_smem_bytes(spec, c, "sm_89") for c in sm89) <= ARCHS["sm_89"].smem_per_block == 101376
    assert any(c.use_tma for c in sm90) and max(attn_smem_bytes(spec, c, "sm_90") for c in sm90) > 101376
    assert set(sm89) < set(sm90)
    if "--preset" in options:
        assert "(gluon)" in plans["sm_90"]


def _add_row(path, spec_key="abc", ms=1.0):
    with TuningDB(path) as db:
        db.upsert(spec_key=spec_key, role="attn", backend="triton", arch="sm_90", gpu_name="NVIDIA H200", bucket=32768,
                  dtype="bfloat16", config={"block_m": 64, "num_warps": 4, "num_stages": 2}, median_ms=ms, tflops=300.0,
                  n_trials=10, fingerprint=current_fingerprint(backends.get("triton"), "attn"), spec_json="{}")


def test_db_list_show_clear(tmp_path):
    path = tmp_path / "cache" / "tuning.db"  # the user DB
    _add_row(path, "abc")
    _add_row(path, "def", 2.0)
    bundled = read_only_rows(BUNDLED_DB_PATH)
    result = invoke("db", "list")
    assert result.exit_code == 0, result.output
    assert "abc" in result.output and "def" in result.output and f"{2 + len(bundled)} rows" in result.output
    for row in bundled:  # whole keys, to copy
        assert row["spec_key"] in result.output
    result = invoke("db", "show", "abc")
    assert result.exit_code == 0 and '"block_m": 64' in result.output and '"source": "user"' in result.output
    result = invoke("db", "show", bundled[0]["spec_key"])
    assert result.exit_code == 0 and '"source": "bundled"' in result.output
    one_line_error(invoke("db", "show", "zzz"), "no rows for spec key zzz")
    result = invoke("db", "clear", "--spec-key", "abc", "--yes")
    assert result.exit_code == 0 and "deleted 1 rows" in result.output
    assert [r["spec_key"] for r in TuningDB(path).rows()] == ["def"]
    result = runner.invoke(app, ["db", "clear"], input="n\n")
    assert result.exit_code != 0 and len(TuningDB(path).rows()) == 1  # declined: nothing deleted
    assert len(read_only_rows(BUNDLED_DB_PATH)) == len(bundled)


def test_db_list_path_reads_without_writing(tmp_path):
    """--path opens the file read-only: a shipped DB in a read-only directory stays as it is."""
    path = tmp_path / "shipped.db"
    _add_row(path, "abc")
    from kernelgen.tuning.db import write_bundled_db

    write_bundled_db(path, TuningDB(path).rows())  # a rollback-journal file, as shipped
    before = path.read_bytes()
    path.chmod(0o444)
    tmp_path.chmod(0o555)
    try:
        result = invoke("db", "list", "--path", str(path))
        assert result.exit_code == 0 and "abc" in result.output and "1 rows" in result.output
    finally:
        tmp_path.chmod(0o755)
    assert path.read_bytes() == before


def test_db_bundle_merges_and_keeps(tmp_path):
    ours = tmp_path / "gpu.db"
    _add_row(ours, "new-key")
    target = tmp_path / "winners.db"
    from kernelgen.tuning.db import write_bundled_db

    write_bundled_db(target, read_only_rows(BUNDLED_DB_PATH))
    result = invoke("db", "bundle", str(ours), "--into", str(target))
    assert result.exit_code == 0, result.output
    keys = [r["spec_key"] for r in read_only_rows(target)]
    assert "new-key" in keys and len(keys) == len(read_only_rows(BUNDLED_DB_PATH)) + 1
    one_line_error(invoke("db", "bundle", str(tmp_path / "missing.db"), "--into", str(target)), "missing.db")


def test_export_writes_an_importable_module(tmp_path):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True)
    (tmp_path / "spec.json").write_text(spec.to_json())
    out = tmp_path / "mod.py"
    result = invoke("export", "--spec", str(tmp_path / "spec.json"), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "\ndef attn(q, k, v, *, block_idx=None" in text and "\ndef select(q, k)" in text
    assert f"SPEC = {spec.to_dict()!r}" in text


def test_export_backend_option(tmp_path):
    out = tmp_path / "tl.py"
    result = invoke("export", "--head-dim", "64", "--kv-block", "64", "--q-tile", "64", "--top-k", "4",
                    "--backend", "tilelang", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "'backend': 'tilelang'" in out.read_text()
    out = tmp_path / "gl.py"
    result = invoke("export", "--head-dim", "64", "--kv-block", "64", "--q-tile", "64", "--top-k", "4",
                    "--backend", "gluon", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "\n@gluon.jit\ndef attn_fwd(" in out.read_text() and "'backend': 'gluon'" in out.read_text()
    result = invoke("export", "--backend", "auto", "--out", str(tmp_path / "auto.py"))
    one_line_error(result, "auto")
    assert not (tmp_path / "auto.py").exists()


def test_export_arch_option(tmp_path):
    """--arch bakes in that arch's defaults (sm_89: 64 rows of D=128 with 128-key blocks fit 99 KB, 128 do not)."""
    out = tmp_path / "l4.py"
    options = ["--head-dim", "128", "--kv-block", "128", "--q-tile", "128", "--gqa-group", "4", "--selector", "given"]
    result = invoke("export", *options, "--arch", "sm_89", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert '"attn": {"block_m": 64, "kv_per_iter": 1, "num_stages": 2, "num_warps": 8, "use_tma": false}' in \
        out.read_text()
    one_line_error(invoke("export", *options, "--arch", "sm_75", "--out", str(tmp_path / "old.py")),
                   "arch='sm_75' is older than kernelgen's kernels run on")
    assert not (tmp_path / "old.py").exists()


def test_bench_cpu_smoke(tmp_path):
    result = invoke("bench", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "interpreter" in result.output


def test_bench_unknown_shape_is_a_one_line_error(tmp_path):
    one_line_error(invoke("bench", "--shapes", "nope", "--out", str(tmp_path / "b")), "nope")


def test_bench_stall_guard_ends_a_hang_with_stacks():
    """`kernelgen bench` re-arms a watchdog at each logged line (--stall-timeout): lines every 0.6 s keep
    a 1 s guard quiet, then a call that never returns (as a hung kernel's) ends in every thread's stack
    on stderr and exit status 1, instead of a silent stall."""
    import subprocess
    import sys

    code = ("import time\nfrom kernelgen.bench.measure import stall_guard\nlog = stall_guard(1.0)\n"
            "for i in range(4):\n    log(f'row {i}')\n    time.sleep(0.6)\ntime.sleep(60)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "row 3" in result.stdout  # the guard was re-armed by each line
    assert "Timeout (0:00:01)!" in result.stderr and 'File "<string>", line 7' in result.stderr

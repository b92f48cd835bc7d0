"""Every `kernelgen` command through typer's test runner (CPU)."""
import contextlib
import dataclasses
from pathlib import Path
import json
import logging
import re

import pytest
import torch
import typer.main
from checks import read_only
from typer.testing import CliRunner

from kernelgen import AttnConfig, Spec, backends
from kernelgen.archs import ARCHS
from kernelgen.backends.triton import attn_smem_bytes
from kernelgen.cli import app
from kernelgen.device import current_arch
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
    """Bad input: exit status 2 and one line on stderr naming what was wrong, never a traceback (log lines that
    came before it, each one line of its own, aside)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith(("kernelgen: WARNING: ", "kernelgen: INFO: "))]
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


@pytest.mark.parametrize("command", [[], ["db"]])
def test_a_group_alone_prints_its_help(command):
    """`kernelgen` or `kernelgen db` with no command answers with the help, as --help does: exit status 0."""
    result = invoke(*command)
    assert result.exit_code == 0, result.output
    assert result.stdout == invoke(*command, "--help").stdout


def _command(*names: str):
    """The click command of `kernelgen NAMES...`, as typer builds it."""
    command = typer.main.get_command(app)
    for name in names:
        command = command.commands[name]
    return command


def option_help(*names: str) -> str:
    """The help text of option names[-1] of the command names[:-1], whole (not wrapped at hyphens as --help is)."""
    *command, option = names
    return next(param.help for param in _command(*command).params if option in param.opts)


def test_tune_help_says_when_the_arch_must_be_the_gpu_present(tmp_path):
    """--arch must be the GPU present for a tune only: a dry run plans any arch on any machine, and cpu (named in the
    help, not only in an error) is for dry runs alone; --seq is required unless --preset is given."""
    arch, seq = option_help("tune", "--arch"), option_help("tune", "--seq")
    assert "must be the GPU present" not in arch
    assert "--dry-run plans any arch from sm_80 on, on any machine" in arch and "cpu (--dry-run only)" in arch
    assert "Required unless --preset is given" in seq
    path = tmp_path / "spec.json"
    path.write_text(Spec(head_dim=64).to_json())
    other = "sm_80" if current_arch() == "sm_89" else "sm_89"  # not this machine's GPU
    for arch_option in (other, "cpu"):
        result = invoke("tune", "--arch", arch_option, "--seq", "32768", "--spec", str(path), "--role", "attn",
                        "--dry-run")
        assert result.exit_code == 0 and "attn (triton): study" in result.output, result.output
    one_line_error(invoke("tune", "--arch", "cpu", "--seq", "4096", "--spec", str(path)), "--arch cpu", "--dry-run")
    one_line_error(invoke("tune", "--arch", other, "--seq", "4096", "--spec", str(path)), "GPU")
    one_line_error(invoke("tune", "--arch", "sm_90", "--dry-run"), "--seq is required (or --preset)")


BENCH_MODE_SHAPES = [("--shapes", "BENCH_SHAPES"), ("--backward", "BACKWARD_SHAPES"), ("--untuned", "UNTUNED_SHAPES"),
                     ("--kv-centric", "KV_CENTRIC_SHAPES"), ("--decode", "DECODE_SHAPES"),
                     ("--padded", "PADDED_SHAPES"), ("--chunked", "CHUNKED_SHAPES")]


def test_bench_help_names_every_shape_of_each_bench():
    """Each bench's --help lists the shapes it runs, read from the dicts the benches run (chunked's mixed_32k
    too), never copied into cli.py's text."""
    import ast

    import kernelgen.cli
    from kernelgen.bench import backward, chunked, padded
    from kernelgen import workloads

    every = set()
    for option, name in BENCH_MODE_SHAPES:
        names = next(getattr(where, name) for where in (workloads, backward, chunked, padded) if hasattr(where, name))
        assert set(names) <= set(re.findall(r"\w+", option_help("bench", option))), (option, name)
        every |= set(names)
    assert "mixed_32k" in option_help("bench", "--chunked")
    source = Path(kernelgen.cli.__file__).read_text()
    literals = {word for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
                and isinstance(node.value, str) for word in re.findall(r"\w+", node.value)}
    assert not {name for name in every if len(name) > 2} & literals  # ("b" and "c" are words of any text)


def test_info(monkeypatch):
    """info names each backend's state as its text says it: an install hint's extra in brackets is no markup."""
    tilelang = backends.get("tilelang")
    # the instance (a test that patched it may have left its bound method on it, which shadows the class)
    monkeypatch.setattr(tilelang, "not_installed", lambda: "needs TileLang: pip install -e '.[tilelang]'")
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "triton" in result.output and "tuning DB" in result.output
    assert "pip install -e '.[tilelang]'" in flat(result.output)


def test_version():
    from kernelgen import __version__

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"kernelgen {__version__}"


def test_python_m_kernelgen_runs_the_cli():
    import os
    import subprocess
    import sys

    from kernelgen import __version__

    root = str(Path(__file__).resolve().parent.parent)
    result = subprocess.run([sys.executable, "-m", "kernelgen", "--version"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"kernelgen {__version__}"


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


def _planned_roles(output: str) -> list[str]:
    return re.findall(r"^([a-z_]+) \([a-z]+\): study", output, flags=re.M)


def test_tune_plans_the_roles_the_spec_s_calls_run():
    """A spec's tune covers its selector (and its decode calls' and a cache's rows' selector), its schedule's forward (both per-query
    designs, and the prefill over a cache of per-row lengths, contiguous or paged), decode and the backward: no
    role of the other schedule, no other selector's."""
    base = ("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--dry-run")
    result = invoke(*base)
    assert result.exit_code == 0, result.output
    assert _planned_roles(result.output) == ["select", "attn", "attn_rows", "attn_paged", "decode_select", "decode",
                                             "bwd_dq", "bwd_dkdv"]
    result = invoke(*base, "--schedule", "kv_centric", "--selector", "index")
    assert result.exit_code == 0, result.output
    assert _planned_roles(result.output) == ["kv_select_index", "kv_attn", "kv_attn_union", "kv_attn_rows",
                                             "kv_attn_paged", "kv_decode_select_index", "decode", "kv_bwd",
                                             "kv_bwd_union"]
    result = invoke(*base, "--selector", "given", "--role", "bwd_dq")
    assert result.exit_code == 0 and _planned_roles(result.output) == ["bwd_dq"]
    result = invoke(*base, "--role", "attn", "--role", "select", "--role", "attn")  # one study per role
    assert result.exit_code == 0 and _planned_roles(result.output) == ["attn", "select"]


def test_tune_dry_run_summarises_a_large_space_and_lists_it_on_request():
    """A space of 66 configs: each field's values and the first trials, and every config only with --space."""
    base = ("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--role", "attn", "--dry-run")
    summary, every = invoke(*base), invoke(*base, "--space")
    assert summary.exit_code == 0 and every.exit_code == 0, (summary.output, every.output)
    size = int(re.search(r"space of (\d+) configs", flat(summary.output)).group(1))
    assert size > 16 and "block_m 16, 32, 64" in flat(summary.output)
    assert "the default and its neighbours" in flat(summary.output)
    assert len(printed_configs(summary.output)) == 1  # the default alone
    assert len(printed_configs(every.output)) == size + 1


def test_tune_checks_every_study_before_printing_any():
    result = invoke("tune", "--arch", "sm_89", "--seq", "4096", "--backend", "gluon", "--dry-run")
    one_line_error(result, "runs on sm_90 only")
    assert result.stdout == ""


def test_db_show_spec_finds_every_role_s_rows(tmp_path):
    """The attention's and the backward's winners sit under the lists-reading key, the selector's under the
    spec's own: --spec shows both."""
    spec = SHAPES["c"].spec("mean")
    bundled = {(r["spec_key"], r["role"]) for r in read_only_rows(BUNDLED_DB_PATH)}
    (tmp_path / "c.json").write_text(spec.to_json())
    result = invoke("db", "show", "--spec", str(tmp_path / "c.json"))
    assert result.exit_code == 0, result.output
    shown = {(r["spec_key"], r["role"]) for r in json.loads(result.stdout)}
    assert {"select", "attn", "bwd_dq", "bwd_dkdv"} <= {role for _, role in shown} and shown <= bundled
    assert (spec.key(), "select") in shown and (get_role("attn").key(spec, "triton"), "attn") in shown


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_bench_gpu_shapes_on_a_cpu_are_a_clear_error(tmp_path):
    one_line_error(invoke("bench", "--shapes", "a32k,tiny", "--out", str(tmp_path / "b")), "a32k", "CUDA GPU")
    one_line_error(invoke("bench", "--sweep", "c", "--out", str(tmp_path / "b")), "c", "CUDA GPU")
    for option in ("--overhead", "--no-graph"):  # timings of a GPU's bench: refused, not left unread
        one_line_error(invoke("bench", option, "--out", str(tmp_path / "b")), option, "needs a CUDA GPU")
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_a_cpu_without_the_interpreter_says_how_to_turn_it_on(tmp_path, monkeypatch):
    """TRITON_INTERPRET=0 on a machine without a GPU leaves nothing to run kernels: the bench says so in one line
    (not "running the interpreter" and then an error), and `info` says it too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = invoke("bench", "--out", str(tmp_path / "b"))
    one_line_error(result, "TRITON_INTERPRET=0 turns off the Triton interpreter", "set it to 1")
    assert "running the Triton interpreter" not in result.stdout
    info = invoke("info")
    assert info.exit_code == 0 and "TRITON_INTERPRET=0 turns off" in flat(info.output)


def test_tune_gluon_spec_the_kernel_cannot_compute_is_a_clear_error():
    result = invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "128", "--kv-block", "32",
                    "--backend", "gluon", "--dry-run")
    one_line_error(result, "--kv-block 32 is not supported by --backend 'gluon'")


@pytest.mark.parametrize("args, words", [
    (["--head-dim", "72"], ["--head-dim 72 is not supported"]),
    (["--backend", "banana"], ["--backend 'banana' is unknown"]),
    (["--arch", "banana"], ["--arch 'banana' is not a CUDA arch"]),
    (["--arch", "sm_999"], ["--arch 'sm_999' is not a CUDA arch"]),
    (["--arch", "sm_75"], ["--arch 'sm_75' is older than kernelgen's kernels run on; expected sm_80 or newer"]),
    (["--seq", "-5"], ["--seq must be an int from 1"]),
    (["--trials", "0"], ["--trials must be an int >= 1"]),
    (["--role", "foo"], ["--role 'foo' is not a tuned role"]),
    (["--backend", "gluon", "--arch", "sm_89", "--kv-block", "64", "--role", "attn"], ["runs on sm_90 only"]),
    (["--workers", "0"], ["--workers must be an int >= 1"]),
    (["--storage", "banana://host/db"], ["--storage", "unknown scheme 'banana'"]),
    (["--storage", "journal://"], ["--storage", "names no journal file"]),
    (["--storage", "sqlite:/optuna.db"], ["--storage", "not a URL"]),
    (["--storage", "postgresql://tuner@host:port/db"], ["--storage", "not a database URL"]),
])
def test_bad_tune_options_are_one_line_errors(args, words):
    base = {"--arch": "sm_90", "--seq": "4096", "--head-dim": "64"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    result = invoke("tune", *[x for kv in base.items() for x in kv], "--dry-run")
    one_line_error(result, *words)


def test_tune_workers_and_storage(tmp_path, monkeypatch):
    """A dry run takes --workers and --storage; a tune checks --workers against the GPUs there are, before
    anything else (here a pretend machine with one sm_90 GPU)."""
    result = invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--role", "attn", "--workers", "2",
                    "--storage", f"journal://{tmp_path / 'study.log'}", "--dry-run")
    assert result.exit_code == 0, result.output
    one_line_error(invoke("tune", "--arch", "sm_90", "--seq", "4096", "--workers", "0"),
                   "--workers must be an int >= 1")
    monkeypatch.setattr("kernelgen.device.current_arch", lambda: "sm_90")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_line_error(invoke("tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--workers", "2"),
                   "--workers 2: 1 CUDA GPU is visible here")
    assert not (tmp_path / "study.log").exists() and not (tmp_path / "cache").exists()


def test_tune_preset_bench_dry_run_plans_every_backend_the_arch_runs():
    result = invoke("tune", "--arch", "sm_90", "--preset", "bench", "--shapes", "a32k", "--dry-run")
    assert result.exit_code == 0, result.output
    for name in ("(triton)", "(tilelang)", "(gluon)"):
        assert name in result.output
    result = invoke("tune", "--arch", "sm_89", "--preset", "bench", "--shapes", "a32k", "--dry-run")
    assert result.exit_code == 0 and "(gluon)" not in result.output and "(triton)" in result.output
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "nope", "--dry-run"), "--preset 'nope' is unknown")


def test_tune_presets_take_roles_and_the_kv_shapes():
    """--role narrows a preset (the backward's studies alone); the kv preset plans the per-query roles."""
    from kernelgen.tuning.presets import studies

    backward = studies("bench", "sm_90", ["c"], ["triton"], ["bwd_dq", "bwd_dkdv"])
    assert [s.role for s in backward] == ["bwd_dq", "bwd_dkdv"] and all(s.spec.selector == "given" for s in backward)
    kv = studies("kv", "sm_90", ["kv_nsa32k"])
    assert [s.role for s in kv] == ["kv_attn", "kv_attn_union", "kv_bwd", "kv_bwd_union", "kv_select",
                                    "kv_select_index"]
    assert [s.spec.selector for s in kv] == ["given", "given", "given", "given", "mean", "index"]
    assert all(s.spec.per_query and s.shape["n_k"] == 32768 for s in kv)
    assert studies("kv", "sm_90", None, ["tilelang"]) == []  # per-query lists run in Triton only
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "kv", "--shapes", "c", "--dry-run"),
                   "--shapes 'c' is unknown")
    # a preset whose --role or --backends leave no study: an error, as nothing would run
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "bench", "--role", "kv_attn", "--dry-run"),
                   "--role kv_attn: the bench preset's studies tune attn, bwd_dq, bwd_dkdv, select")
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "bench", "--role", "attn", "--role", "banana",
                          "--dry-run"), "--role banana")
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "kv", "--backends", "tilelang", "--dry-run"),
                   "--preset kv plans no study on sm_90 with --backends tilelang")


def test_the_decode_preset_plans_decode_and_each_schedule_s_decode_selection():
    """The decode preset tunes what `bench --decode` times: decode over given lists, and a decode step's selection
    (both selectors, both schedules), on a decode shape's one query against its whole cache."""
    from kernelgen.tuning.presets import studies

    planned = studies("decode", "sm_90", ["dec_b64k"], ["triton"])
    assert [(s.role, s.spec.selector, s.spec.schedule) for s in planned] == [
        ("decode", "given", "q_centric"), ("decode_select", "mean", "q_centric"),
        ("kv_decode_select", "mean", "kv_centric"), ("decode_select_index", "index", "q_centric"),
        ("kv_decode_select_index", "index", "kv_centric")]
    assert all(s.seq == 65536 and s.shape == {"batch": 8, "heads_kv": 1, "n_q": 1, "n_k": 65536} for s in planned)
    assert all(s.spec.gqa_group == 16 and s.spec.kv_block == 128 and s.spec.causal for s in planned)
    result = invoke("tune", "--arch", "sm_90", "--preset", "decode", "--shapes", "dec_c32k", "--role",
                    "decode_select_index", "--dry-run")
    assert result.exit_code == 0 and "decode_select_index (triton)" in result.output, result.output
    one_line_error(invoke("tune", "--arch", "sm_90", "--preset", "decode", "--shapes", "c", "--dry-run"),
                   "--shapes 'c' is unknown")


def test_tune_trials_override_a_presets_own_counts():
    """A preset plans each study's own trial count; an explicit --trials sets them all."""
    base = ("tune", "--arch", "sm_90", "--preset", "kv", "--shapes", "kv_nsa32k", "--role", "kv_bwd", "--dry-run")
    own = invoke(*base)
    assert own.exit_code == 0 and "12 trials" in own.output and "40 trials" not in own.output
    given = invoke(*base, "--trials", "40")
    assert given.exit_code == 0 and "40 trials" in given.output and "12 trials" not in given.output


def _triton_attn_points(output: str) -> list[AttnConfig]:
    fields = {f.name for f in dataclasses.fields(AttnConfig)}
    return [AttnConfig(**c) for c in printed_configs(output) if set(c) == fields]


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
        result = invoke("tune", "--arch", arch, *options, "--dry-run", "--space")
        assert result.exit_code == 0, result.output
        plans[arch] = result.output
    sm89, sm90 = _triton_attn_points(plans["sm_89"]), _triton_attn_points(plans["sm_90"])
    assert sm89 and not any(c.use_tma for c in sm89) and "(gluon)" not in plans["sm_89"]
    assert max(attn_smem_bytes(spec, c, "sm_89") for c in sm89) <= ARCHS["sm_89"].smem_per_block == 101376
    assert any(c.use_tma for c in sm90) and max(attn_smem_bytes(spec, c, "sm_90") for c in sm90) > 101376
    assert set(sm89) < set(sm90)
    if "--preset" in options:
        assert "(gluon)" in plans["sm_90"]


def _add_row(path, spec_key="abc", ms=1.0, gpu="NVIDIA H200"):
    with TuningDB(path) as db:
        db.upsert(spec_key=spec_key, role="attn", backend="triton", arch="sm_90", gpu_name=gpu, bucket=32768,
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
    declined = runner.invoke(app, ["db", "clear"], input="n\n")  # the user's answer: nothing deleted, no error
    assert declined.exit_code == 0 and "nothing deleted" in declined.output and len(TuningDB(path).rows()) == 1
    # no one to answer (no terminal, end of input): one line, nothing deleted
    one_line_error(runner.invoke(app, ["db", "clear"], input=""), "nothing deleted", "--yes")
    assert len(TuningDB(path).rows()) == 1
    assert len(read_only_rows(BUNDLED_DB_PATH)) == len(bundled)
    _add_row(path, "def", 1.5, gpu="NVIDIA H100 80GB HBM3")  # the same key on another GPU of the arch: its own row
    assert "NVIDIA H100 80GB HBM3" in flat(invoke("db", "list").output)
    result = invoke("db", "clear", "--gpu", "NVIDIA H100 80GB HBM3", "--yes")
    assert result.exit_code == 0 and "deleted 1 rows" in result.output
    assert [r["gpu_name"] for r in TuningDB(path).rows()] == ["NVIDIA H200"]


def test_a_read_only_cache_dir(tmp_path):
    """info says the cache is read-only and where kernels and the DB live; db list and show read the user DB;
    db clear is one line naming the file, before it asks."""
    _add_row(tmp_path / "cache" / "tuning.db", "abc")
    with read_only(tmp_path / "cache"):
        result = invoke("info")
        assert result.exit_code == 0, result.output
        info = "".join(flat(result.output).split())  # rich folds long paths anywhere
        assert f"{tmp_path / 'cache'}(cannotbewritten:" in info and "kernelmodulesaprivatetemporarydirectory" in info
        assert f"{tmp_path / 'cache' / 'tuning.db'}(1rows,read-only)" in info
        result = invoke("db", "list")
        assert result.exit_code == 0 and "abc" in result.output, result.output
        assert invoke("db", "show", "abc").exit_code == 0
        one_line_error(runner.invoke(app, ["db", "clear"], input="y\n"), "cannot be written", str(tmp_path / "cache"))
    assert [r["spec_key"] for r in read_only_rows(tmp_path / "cache" / "tuning.db")] == ["abc"]


def test_a_cache_dir_that_cannot_be_created(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "(none,andthecachedircannotholdone:" in "".join(flat(result.output).split())
    result = invoke("db", "list")
    assert result.exit_code == 0 and f"{len(read_only_rows(BUNDLED_DB_PATH))} rows" in result.output, result.output
    result = invoke("db", "clear", "--yes")  # no user DB: nothing to delete, and nothing made
    assert result.exit_code == 0 and "deleted 0 rows (there is no user DB at" in flat(result.output), result.output


def test_a_user_db_path_that_is_a_directory(tmp_path):
    """A directory where the user DB's file should be is said so: info names it, db list warns and lists the
    bundled rows, db clear is one line."""
    (tmp_path / "cache" / "tuning.db").mkdir(parents=True)
    result = invoke("info")
    assert result.exit_code == 0 and "(cannotbeused:adirectory" in "".join(flat(result.output).split()), result.output
    result = invoke("db", "list")
    assert result.exit_code == 0 and "is a directory, not a database file" in flat(result.output), result.output
    assert f"{len(read_only_rows(BUNDLED_DB_PATH))} rows" in result.output
    one_line_error(invoke("db", "clear", "--yes"), "is a directory, not a database file", "nothing to delete")


def test_reading_commands_make_no_cache_dir(tmp_path):
    """info, db list and db show only read: a missing cache dir stays missing (no directory, no empty user DB),
    and one that could not be made (its parent read-only) is said to be read-only."""
    assert invoke("info").exit_code == 0
    assert invoke("db", "list").exit_code == 0
    one_line_error(invoke("db", "show", "abc"), "no rows for spec key abc")
    assert not (tmp_path / "cache").exists()
    (tmp_path / "parent").mkdir()
    with read_only(tmp_path / "parent"), pytest.MonkeyPatch.context() as env:
        env.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "parent" / "cache"))
        result = invoke("info")
        assert result.exit_code == 0, result.output
        assert f"{tmp_path / 'parent' / 'cache'}(cannotbewritten:" in "".join(flat(result.output).split())
    assert not (tmp_path / "parent" / "cache").exists()


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


def test_db_bundle_into_a_directory_it_cannot_write_is_one_line(tmp_path):
    """--into a file of a read-only directory: one line naming --into, and nothing written."""
    _add_row(tmp_path / "gpu.db", "gpu-key")
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        one_line_error(invoke("db", "bundle", str(tmp_path / "gpu.db"), "--into", str(tmp_path / "ro" / "x.db")),
                       "--into", "cannot write to", str(tmp_path / "ro"))
    assert not (tmp_path / "ro" / "x.db").exists()


def test_db_bundle_refuses_a_user_db_as_target(tmp_path):
    """A user DB (WAL) may be written by a tuner while bundle reads it and replaces the file: refused, and kept."""
    ours, live = tmp_path / "gpu.db", tmp_path / "tuning.db"
    _add_row(ours, "new-key")
    _add_row(live, "live-key")
    before = [r["spec_key"] for r in TuningDB(live).rows()]
    one_line_error(invoke("db", "bundle", str(ours), "--into", str(live)), "WAL")
    assert [r["spec_key"] for r in TuningDB(live).rows()] == before == ["live-key"]


def test_export_writes_an_importable_module(tmp_path):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True)
    (tmp_path / "spec.json").write_text(spec.to_json())
    out = tmp_path / "mod.py"
    result = invoke("export", "--spec", str(tmp_path / "spec.json"), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "\ndef attn(q, k, v, *, block_idx=None" in text and "\ndef select(q, k, *, index=None, key_reps=None" in text
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
    if current_arch() is None:  # written here for a GPU machine: the command says this one cannot run it
        assert "note: this machine cannot run backend 'gluon'" in flat(result.output)
    result = invoke("export", "--backend", "auto", "--out", str(tmp_path / "auto.py"))
    one_line_error(result, "auto")
    assert not (tmp_path / "auto.py").exists()


def test_export_bakes_the_tuned_winners_for_arch_and_seq_and_says_so(tmp_path):
    """Shape (c) on sm_90: the bundled winners (measured under another torch, which the module's header
    says), `auto` resolved to the backend it would serve; without --arch the defaults, said as much."""
    from kernelgen.export import tuned_configs
    from kernelgen.tuning.lookup import Target, cannot_serve
    from kernelgen.workloads import SHAPES

    spec = SHAPES["c"].spec("mean")
    options = ["--head-dim", "128", "--kv-block", "128", "--q-tile", "128", "--top-k", "16", "--causal",
               "--gqa-group", "4"]
    out = tmp_path / "c.py"
    result = invoke("export", *options, "--backend", "auto", "--arch", "sm_90", "--seq", "32768", "--out", str(out))
    assert result.exit_code == 0, result.output
    resolved, configs, sources = tuned_configs(spec.replace(backend="auto"), arch="sm_90", seq=32768)
    rows = {(r["role"], r["backend"]): r for r in read_only_rows(BUNDLED_DB_PATH)
            if r["spec_key"] == get_role(r["role"]).key(spec, r["backend"]) and r["bucket"] == 32768}
    # the fastest of the backends that can serve it here (TileLang's row only where TileLang is installed)
    servable = [b for r, b in rows if r == "attn" and not cannot_serve(backends.get(b), spec, Target("sm_90"))]
    assert resolved.backend == min(servable, key=lambda b: rows["attn", b]["median_ms"])
    for name in {b for r, b in rows if r == "attn"} - set(servable):  # the others are named, with the reason
        assert f"auto: {name} not considered: " in flat(result.output)
    assert backends.Backend.config_to_dict(configs["attn"]) == rows["attn", resolved.backend]["config"]
    assert backends.Backend.config_to_dict(configs["select"]) == rows["select", "triton"]["config"]
    text = out.read_text()
    assert f"'backend': '{resolved.backend}'" in text and "# config sources: " in text
    assert "bundled DB: NVIDIA H200 sm_90, bucket 32768" in flat(result.output)
    default = invoke("export", *options, "--out", str(tmp_path / "d.py"))
    assert default.exit_code == 0
    assert "default for cpu; --arch and --seq bake in a GPU's tuned winners" in flat(default.output)
    # a spec no winner of the arch shares its kernel's shape with: the default, and why
    untuned = invoke("export", *options, "--kv-block", "32", "--arch", "sm_90", "--seq", "4096", "--out",
                     str(tmp_path / "u.py"))
    assert untuned.exit_code == 0, untuned.output
    assert ("default (no triton winner on sm_90 in bfloat16 for this spec, nor for one of its kv_block, q_tile, "
            "schedule and head_dim's tile width)") in flat(untuned.output)
    one_line_error(invoke("export", *options, "--gpu", "NVIDIA H200", "--out", str(out)), "--seq")
    one_line_error(invoke("export", *options, "--arch", "sm_9000", "--seq", "4096", "--out", str(out)), "arch")
    one_line_error(invoke("export", *options, "--arch", "sm_90", "--seq", "4096", "--dtype", "fp8", "--out",
                          str(out)), "--dtype")


def test_bench_untuned_and_backward_need_a_gpu(tmp_path):
    one_line_error(invoke("bench", "--untuned", "--out", str(tmp_path / "u")), "CUDA GPU")
    one_line_error(invoke("bench", "--backward", "--out", str(tmp_path / "u")), "CUDA GPU")
    one_line_error(invoke("bench", "--untuned", "--shapes", "c_g9"), "c_g9")
def test_export_arch_option(tmp_path):
    """--arch bakes in that arch's defaults (sm_89: 64 rows of D=128 with 128-key blocks fit 99 KB, 128 do not)."""
    out = tmp_path / "l4.py"
    options = ["--head-dim", "128", "--kv-block", "128", "--q-tile", "128", "--gqa-group", "4", "--selector", "given"]
    result = invoke("export", *options, "--arch", "sm_89", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert '"attn": {"block_m": 64, "kv_per_iter": 1, "num_stages": 2, "num_warps": 8, "use_tma": false}' in \
        out.read_text()
    one_line_error(invoke("export", *options, "--arch", "sm_75", "--out", str(tmp_path / "old.py")),
                   "--arch 'sm_75' is older than kernelgen's kernels run on")
    assert not (tmp_path / "old.py").exists()
    one_line_error(invoke("export", *options, "--arch", "cpu", "--seq", "4096", "--out", str(out)),
                   "--arch cpu has none (e.g. --arch sm_90)")


def test_bench_cpu_smoke(tmp_path):
    result = invoke("bench", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "interpreter" in result.output


def test_bench_unknown_shape_is_a_one_line_error(tmp_path):
    one_line_error(invoke("bench", "--shapes", "nope", "--out", str(tmp_path / "b")), "nope")


def _bad_files(root: Path) -> None:
    """Files that are not what a command expects, under `root`."""
    import sqlite3

    (root / "text.db").write_text("not a database\n")
    (root / "corrupt.json").write_text('{"head_dim": 64, ')
    (root / "list.json").write_text("[64, 64]")
    (root / "fields.json").write_text('{"head_dim": 64, "banana": 1}')
    (root / "banana_backend.json").write_text('{"head_dim": 64, "backend": "banana"}')
    (root / "empty.json").write_text('{}')
    (root / "deep.json").write_text("[" * 100_000)  # deeper than json's parser recurses
    (root / "a_dir").mkdir()
    torch.save({x: torch.zeros(1, 2, 128, 64) for x in "qkv"}, root / "qkv.pt")
    for name, table in (("foreign.db", "winners (role TEXT, backend TEXT)"), ("no_winners.db", "other (x)")):
        with contextlib.closing(sqlite3.connect(root / name)) as conn:
            conn.execute(f"CREATE TABLE {table}")
            conn.commit()


DRY = ["tune", "--arch", "sm_90", "--seq", "4096", "--head-dim", "64", "--dry-run"]
DRY_FILE = ["tune", "--arch", "sm_90", "--seq", "4096", "--dry-run"]  # a spec or a model from a file
BAD_INPUT = [  # (arguments, {FILES} standing for the directory of _bad_files, words of the one line)
    # typer's own usage errors: one line naming the command's --help
    (["banana"], ["No such command 'banana'", "kernelgen --help"]),
    (["--banana"], ["No such option: --banana"]),
    (["db", "banana"], ["No such command 'banana'", "kernelgen db --help"]),
    (["tune", "--seq", "4096"], ["Missing option '--arch'", "kernelgen tune --help"]),
    (DRY + ["--seq", "abc"], ["'--seq'", "integer"]),
    (DRY + ["--timeout", "soon"], ["'--timeout'"]),
    (DRY + ["--banana", "1"], ["No such option: --banana"]),
    (["db", "show"], ["give a spec key or --spec FILE"]),
    (DRY_FILE + ["--spec", "{FILES}/empty.json"], ["--spec", "empty.json", "head_dim"]),
    (["tune", "--arch", "sm_89", "--preset", "bench", "--backends", "auto", "--dry-run"],
     ["--backends auto", "none to tune"]),
    (["tune", "--arch", "sm_89", "--preset", "bench", "--shapes", ",", "--dry-run"], ["--shapes ','", "no shape"]),
    (["db", "list", "--path", "{FILES}/text.db"], ["--path", "text.db", "unreadable"]),
    (["db", "show", "abc", "--spec", "{FILES}/fields.json"], ["give a spec key or --spec FILE"]),
    (["db", "show", "--spec", "{FILES}/corrupt.json"], ["--spec", "corrupt.json"]),
    (["db", "clear", "--spec-key"], ["--spec-key", "requires an argument"]),
    (["db", "bundle"], ["Missing argument 'FILE'"]),
    (["export"], ["Missing option '--out'"]),
    (["info", "extra"], ["unexpected extra argument", "kernelgen info --help"]),
    # numbers: negative, zero, huge
    (DRY + ["--seq", "0"], ["--seq must be an int from 1"]),
    (DRY + ["--seq", str(10**30)], ["--seq must be an int from 1"]),
    (DRY + ["--trials", "-1"], ["--trials must be an int >= 1"]),
    (["tune", "--arch", "sm_90", "--preset", "bench", "--trials", "0", "--dry-run"], ["--trials must be an int >= 1"]),
    (DRY + ["--timeout", "-5"], ["--timeout must be a number of seconds > 0"]),
    (DRY + ["--timeout", "nan"], ["--timeout must be a number of seconds > 0"]),
    (DRY + ["--head-dim", "0"], ["--head-dim 0 is not supported"]),
    (DRY + ["--head-dim", "-64"], ["--head-dim -64 is not supported"]),
    (DRY + ["--kv-block", str(2**40)], ["--kv-block 1099511627776 is too large"]),
    (DRY + ["--q-tile", "-1"], ["--q-tile -1 is not supported"]),
    (DRY + ["--top-k", "0"], ["--top-k must be >= 1"]),
    (DRY + ["--top-k", str(10**10)], ["--top-k 10000000000 is too large"]),
    (DRY + ["--top-k", str(2**30)], ["search space is empty"]),
    (DRY + ["--gqa-group", "0"], ["--gqa-group must be >= 1"]),
    (DRY + ["--gqa-group", str(10**11)], ["--gqa-group 100000000000 is too large"]),
    (DRY + ["--gqa-group", str(2**30)], ["search space is empty"]),
    (DRY + ["--local", "-1"], ["--local and --sink must be >= 0", "--local -1"]),
    (DRY + ["--local", str(10**12)], ["--local 1000000000000 is too large"]),
    (DRY + ["--local", str(2**30)], ["cannot hold its forced blocks"]),
    (DRY + ["--sink", "-1"], ["--sink -1"]),
    (DRY + ["--kv-block", "48"], ["--kv-block 48 is not supported", "a power of two"]),
    (DRY + ["--top-k", "1", "--local", "2"], ["--top-k 1 cannot hold its forced blocks", "--local 2"]),
    (DRY + ["--schedule", "kv_centric", "--q-tile", "32"], ["--q-tile 32 with --schedule 'kv_centric'",
                                                            "leave --q-tile at its default"]),
    (["export", "--out", "{FILES}/m.py", "--arch", "sm_90", "--seq", "0"], ["--seq must be an int from 1"]),
    (["export", "--out", "{FILES}/m.py", "--head-dim", "0"], ["--head-dim 0 is not supported"]),
    (["export", "--out", "{FILES}/m.py", "--arch", "banana"], ["--arch 'banana' is not a CUDA arch"]),
    (DRY_FILE + ["--spec", "{FILES}/banana_backend.json"], ["--spec", "banana_backend.json", "backend='banana'"]),
    (["bench", "--stall-timeout", "-1", "--out", "{FILES}/b"], ["--stall-timeout must be"]),
    (["bench", "--stall-timeout", "nan", "--out", "{FILES}/b"], ["--stall-timeout must be"]),
    (["bench", "--stall-timeout", "1e300", "--out", "{FILES}/b"], ["--stall-timeout must be"]),
    # unknown names
    (DRY + ["--selector", "banana"], ["--selector 'banana' is unknown"]),
    (DRY + ["--selector", "multi:x"], ["--selector 'multi:x'"]),
    (DRY + ["--role", "banana"], ["--role 'banana' is not a tuned role"]),
    (DRY + ["--role", "kv_attn"], ["--role 'kv_attn'", "q_centric", "never run it", "bwd_dkdv"]),
    (DRY + ["--schedule", "kv_centric", "--role", "attn"], ["--role 'attn'", "kv_centric", "kv_bwd_union"]),
    (DRY + ["--schedule", "banana"], ["--schedule 'banana' is unknown"]),
    (["tune", "--arch", "cpu", "--seq", "256", "--role", "attn"], ["--arch cpu", "--dry-run"]),
    (DRY_FILE + ["--model", "{FILES}/missing.json"], ["--model", "missing.json", "No such file"]),
    (["quality", "--qkv", "{FILES}/qkv.pt", "--device", "tpu", "--out", "{FILES}/q"],
     ["--device 'tpu'", "cpu or cuda"]),
    (["quality", "--qkv", "{FILES}/qkv.pt", "--device", "cuda:99", "--out", "{FILES}/q"], ["--device cuda:99",
                                                                                            "no such CUDA GPU"]),
    (["tune", "--arch", "sm_90", "--preset", "bench", "--shapes", "banana", "--dry-run"], ["--shapes 'banana' is unknown"]),
    # options that the others given leave unread
    (["tune", "--arch", "sm_90", "--preset", "bench", "--seq", "1024", "--dry-run"],
     ["--preset cannot be combined with --seq"]),
    (DRY + ["--shapes", "a32k"], ["--shapes needs --preset"]),
    (DRY + ["--backends", "gluon"], ["--backends needs --preset or --model"]),
    (["tune", "--arch", "sm_90", "--seq", "4096", "--space"], ["--space needs --dry-run"]),
    (DRY + ["--spec", "{FILES}/fields.json"], ["--spec cannot be combined with --head-dim"]),
    (DRY_FILE + ["--model", "{FILES}/missing.json", "--spec", "{FILES}/fields.json"],
     ["--model cannot be combined with --spec"]),
    (["bench", "--decode", "--no-graph", "--out", "{FILES}/b"], ["--decode cannot be combined with --no-graph"]),
    (["bench", "--decode", "--stall-timeout", "5", "--out", "{FILES}/b"],
     ["--decode cannot be combined with --stall-timeout"]),
    (["bench", "--context-parallel", "--stall-timeout", "5", "--out", "{FILES}/b"],
     ["--context-parallel cannot be combined with --stall-timeout"]),
    (["export", "--out", "{FILES}/m.py", "--dtype", "float16"], ["--dtype needs --seq"]),
    (["export", "--out", "{FILES}/m.py", "--gpu", "NVIDIA L4"], ["--gpu needs --seq"]),
    (["export", "--out", "{FILES}/m.py", "--backend", "auto"], ["--backend auto", "give --seq"]),
    (["export", "--out", "{FILES}/m.py", "--arch", "cpu", "--seq", "1024"], ["--seq", "--arch cpu has none"]),
    (["export", "--out", "{FILES}/m.py", "--seq", "1024"], ["--seq", "give --arch too"]),  # on a machine without a GPU
    (["export", "--out", "{FILES}/m.py", "--spec", "{FILES}/fields.json", "--backend", "tilelang"],
     ["--spec cannot be combined with --backend"]),
    (["tune", "--arch", "sm_90", "--preset", "bench", "--backends", "banana", "--dry-run"],
     ["--backends 'banana' is unknown"]),
    (["export", "--out", "{FILES}/m.py", "--backend", "banana"], ["--backend 'banana' is unknown"]),
    (["bench", "--shapes", "banana", "--out", "{FILES}/b"], ["unknown bench shapes 'banana'"]),
    (["bench", "--shapes", ",", "--out", "{FILES}/b"], ["no bench shape named"]),
    (["bench", "--sweep", "banana", "--out", "{FILES}/b"], ["unknown sweep shapes 'banana'"]),
    # files: missing, a directory, not JSON, JSON of another shape, not SQLite, SQLite of another schema
    (DRY_FILE + ["--spec", "{FILES}/missing.json"], ["--spec", "missing.json", "No such file"]),
    (DRY_FILE + ["--spec", "{FILES}/a_dir"], ["--spec", "a_dir", "Is a directory"]),
    (DRY_FILE + ["--spec", "{FILES}/corrupt.json"], ["--spec", "corrupt.json", "Expecting"]),
    (DRY_FILE + ["--spec", "{FILES}/deep.json"], ["--spec", "deep.json", "recursion"]),
    (DRY_FILE + ["--model", "{FILES}/deep.json"], ["--model", "deep.json", "not JSON"]),
    (DRY_FILE + ["--model", "{FILES}/qkv.pt"], ["--model", "qkv.pt", "not text; expected a Hugging Face config.json"]),
    (DRY_FILE + ["--spec", "{FILES}/list.json"], ["--spec", "list.json", "JSON object", "got list"]),
    (DRY_FILE + ["--spec", "{FILES}/fields.json"], ["--spec", "fields.json", "unknown fields ['banana']"]),
    (["export", "--out", "{FILES}/m.py", "--spec", "{FILES}/text.db"], ["--spec", "text.db"]),
    (["export", "--out", "{FILES}/a_dir"], ["--out", "a_dir", ".py file"]),
    (["export", "--out", "{FILES}/m.txt"], ["--out", "m.txt", ".py file"]),
    (["export", "--out", "{FILES}/corrupt.json/m.py"], ["--out", "corrupt.json", "not a directory"]),
    (["bench", "--out", "{FILES}/text.db"], ["--out", "text.db", "not a directory"]),
    (["db", "list", "--path", "{FILES}/missing.db"], ["missing.db is unreadable (no such file)"]),
    (["db", "list", "--path", "{FILES}/a_dir"], ["a_dir is unreadable (not a file)"]),
    (["db", "list", "--path", "{FILES}/text.db"], ["text.db is unreadable", "not a database"]),
    (["db", "list", "--path", "{FILES}/corrupt.json"], ["corrupt.json is unreadable"]),
    (["db", "list", "--path", "{FILES}/foreign.db"], ["foreign.db is unreadable", "lacks the columns ['spec_key'"]),
    (["db", "list", "--path", "{FILES}/no_winners.db"], ["no_winners.db is unreadable (no 'winners' table)"]),
    (["db", "show", "abc", "--path", "{FILES}/foreign.db"], ["foreign.db is unreadable"]),
    (["db", "show", "abc", "--path", "{FILES}/text.db"], ["text.db is unreadable"]),
    (["db", "bundle", "{FILES}/missing.db"], ["missing.db is not a file"]),
    (["db", "bundle", "{FILES}/a_dir"], ["a_dir is not a file"]),
    (["db", "bundle", "{FILES}/text.db", "--into", "{FILES}/into.db"], ["text.db is unreadable"]),
    (["db", "bundle", "{FILES}/foreign.db", "--into", "{FILES}/into.db"], ["foreign.db is unreadable"]),
    (["db", "bundle", "{FILES}/no_winners.db", "--into", "{FILES}/into.db"], ["no_winners.db is unreadable"]),
    (["db", "bundle", "{FILES}/gpu.db", "--into", "{FILES}/corrupt.json"], ["corrupt.json is unreadable"]),
    (["db", "bundle", "{FILES}/gpu.db", "--into", "{FILES}/a_dir"], ["a_dir is unreadable (not a file)"]),
]


@pytest.mark.parametrize("args, words", BAD_INPUT, ids=[" ".join(a[len(DRY) if a[:len(DRY)] == DRY else 0:])
                                                         for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_status_2(tmp_path, args, words):
    """Every command, with bad values of its options: one line on stderr, exit status 2, and nothing written
    where the command would write (a file that is not a tuning DB is never merged as empty nor overwritten)."""
    files = tmp_path / "files"
    files.mkdir()
    _bad_files(files)
    _add_row(files / "gpu.db", "gpu-key")
    before = {p: p.read_bytes() for p in files.rglob("*") if p.is_file()}
    one_line_error(invoke(*[a.replace("{FILES}", str(files)) for a in args]), *words)
    assert {p: p.read_bytes() for p in files.rglob("*") if p.is_file()} == before
    assert not (files / "into.db").exists() and not (files / "m.py").exists()


@pytest.mark.parametrize("args, flag, name", [
    (DRY_FILE + ["--model", "{FILES}/missing.json"], "--model", "missing.json"),
    (DRY_FILE + ["--model", "{FILES}/corrupt.json"], "--model", "corrupt.json"),
    (DRY_FILE + ["--model", "{FILES}/list.json"], "--model", "list.json"),
    (DRY_FILE + ["--model", "{FILES}/a_dir"], "--model", "a_dir"),
    (DRY_FILE + ["--spec", "{FILES}/missing.json"], "--spec", "missing.json"),
    (DRY_FILE + ["--spec", "{FILES}/corrupt.json"], "--spec", "corrupt.json"),
    (DRY + ["--storage", "banana://host/db"], "storage", "banana://host/db"),  # not "--storage: storage '...'"
    (DRY + ["--storage", "{FILES}/a_dir"], "--storage", "a_dir"),
    (["db", "list", "--path", "{FILES}/missing.db"], "--path", "missing.db"),
    (["db", "show", "abc", "--path", "{FILES}/text.db"], "--path", "text.db"),
    (["quality", "--qkv", "{FILES}/missing.pt", "--out", "{FILES}/q"], "--qkv", "missing.pt"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_file_s_error_names_its_option_and_the_file_once(tmp_path, args, flag, name):
    """A file option's error names the option and the file once each, though the library's message may name them
    too (read_model_config's start with "--model FILE:", rows_of_file's name the file)."""
    files = tmp_path / "files"
    files.mkdir()
    _bad_files(files)
    result = invoke(*[a.replace("{FILES}", str(files)) for a in args])
    one_line_error(result, flag, name)
    line = result.stderr.strip().splitlines()[-1].replace(str(files), "FILES")
    assert line.count(flag) == 1 and line.count(name) == 1, line


@pytest.mark.parametrize("user_db", ["foreign.db", "no_winners.db"])
def test_a_user_db_of_another_schema_is_never_written(tmp_path, user_db):
    """A user DB that holds another program's table (a winners table of another layout, or other tables and no
    winners table): db list warns and lists the bundled rows, db clear is one line, and the file is left as it
    was (no table added, no journal mode changed)."""
    _bad_files(tmp_path)
    path = tmp_path / "cache" / "tuning.db"
    path.parent.mkdir()
    path.write_bytes((tmp_path / user_db).read_bytes())
    result = invoke("db", "list")
    assert result.exit_code == 0 and f"{len(read_only_rows(BUNDLED_DB_PATH))} rows" in result.output
    why = "lacks the columns" if user_db == "foreign.db" else "no 'winners' table"
    one_line_error(invoke("db", "clear", "--yes"), "cannot be written", str(path), why)
    one_line_error(invoke("db", "show", "abc"), "no rows for spec key abc")
    assert path.read_bytes() == (tmp_path / user_db).read_bytes()


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


def test_logs_go_to_stderr_and_answers_to_stdout(tmp_path):
    """What a command answers is stdout alone (db show's JSON parses), its log lines go to stderr, one line each."""
    from kernelgen.tuning.db import TuningDB

    with TuningDB() as db:
        key = next(iter(read_only_rows(BUNDLED_DB_PATH)))["spec_key"]
    path = db.path
    path.write_bytes(b"SQLite format 3\x00" + b"\x01" * 4000)  # damaged: moved aside with a warning
    result = invoke("db", "show", key)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["spec_key"] == key
    warned = [line for line in result.stderr.splitlines() if "corrupted" in line]
    assert len(warned) == 1 and str(path) in warned[0]


def test_verbose_goes_before_or_after_the_command(tmp_path, monkeypatch):
    """`kernelgen bench -v` logs kernelgen's debug messages as `kernelgen -v bench` does, and every command takes -v;
    a command without it logs none (a -v before the command is not undone by its absence after it)."""
    def bench_main(**kwargs):  # a debug line of kernelgen's, whatever this process has already compiled and logged
        logging.getLogger("kernelgen.bench").debug("a debug line")
        return 0

    monkeypatch.setattr("kernelgen.bench.main", bench_main)
    monkeypatch.setattr("kernelgen.bench.plot", lambda out: None)
    for args, logged in ((["bench", "-v"], True), (["-v", "bench"], True), (["bench", "--verbose"], True),
                         (["bench"], False)):
        result = invoke(*args, "--out", str(tmp_path / "b"))
        assert result.exit_code == 0, (args, result.output)
        assert ("kernelgen: DEBUG: a debug line" in result.stderr) == logged, (args, result.stderr)

    def leaves(command, path=()):
        for name, sub in getattr(command, "commands", {}).items():
            yield from leaves(sub, (*path, name)) if hasattr(sub, "commands") else [((*path, name), sub)]

    for path, command in leaves(_command()):
        assert any("-v" in param.opts for param in command.params), path


def test_export_makes_out_s_missing_directories_and_says_so(tmp_path):
    assert "missing parent directories are created" in option_help("export", "--out")
    out = tmp_path / "new" / "dir" / "m.py"
    result = invoke("export", "--head-dim", "64", "--out", str(out))
    assert result.exit_code == 0 and out.is_file(), result.output


def test_tune_plans_long_lists_and_names_backends_it_leaves_out():
    """A top_k past 128 plans every role (each selector space holds chunks of next_pow2(top_k) blocks); a
    --backends entry that plans nothing on the arch is said, not dropped in silence."""
    result = invoke("tune", "--arch", "sm_89", "--seq", "32768", "--top-k", "200", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "decode_select" in result.output and "search space is empty" not in result.output
    result = invoke("tune", "--arch", "sm_89", "--preset", "bench", "--shapes", "a32k", "--backends", "gluon,triton",
                    "--dry-run")
    assert result.exit_code == 0, result.output
    assert "note: --backends gluon plans no study on sm_89" in flat(result.output)

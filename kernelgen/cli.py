"""`kernelgen` command line: tune, db, export, bench, quality, info (typer + rich).

The library never configures logging; this module does, for the commands it runs. Bad input gets one
line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sqlite3
import sys
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Column, Table
from rich.text import Text

from .bench import NO_INTERPRETER_MESSAGE, SMOKE_SHAPE
from .bench.backward import BACKWARD_SHAPES
from .bench.chunked import CHUNKED_SHAPES
from .bench.context_parallel import CP_BATCH, CP_HEADS_KV, CP_SEQ, CP_SPEC, CP_WORLD
from .bench.padded import PACKED_LENGTHS, PADDED_SHAPES
from .device import interpreting
from .errors import KernelgenError, KernelgenTypeError, KernelgenValueError
from .workloads import BENCH_SHAPES, DECODE_SHAPES, KV_CENTRIC_SHAPES, SOFTCAP_SHAPES, UNTUNED_SHAPES, WINDOW_SHAPES


# The exceptions module of the click that typer runs on (recent typer vendors click as typer._click).
_click_errors = sys.modules[typer.BadParameter.__module__]


class _OneLineUsageErrors(typer.core.TyperGroup):
    """The root command: a usage error of any command (an unknown option or command, a missing argument, a
    value of the wrong type) is one line naming that command's --help and exit status 2, not a usage block."""

    def make_context(self, *args, **kwargs):
        with _usage_errors_as_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_errors_as_one_line():  # subcommands parse their arguments inside the root's invoke
            return super().invoke(ctx)


@contextlib.contextmanager
def _usage_errors_as_one_line():
    try:
        yield
    except getattr(_click_errors, "NoArgsIsHelpError", ()) as error:
        print(error.format_message())  # `kernelgen` or `kernelgen db` alone: the help is the answer, as --help's
        raise typer.Exit(0) from None
    except _click_errors.UsageError as error:
        see = f" (see `{error.ctx.command_path} --help`)" if error.ctx is not None else ""
        _fail(f"{error.format_message()}{see}")


# plain click help: typer's rich panels draw a flag as taking a value ("--dry-run <bool>")
app = typer.Typer(name="kernelgen", cls=_OneLineUsageErrors, no_args_is_help=True, rich_markup_mode=None,
                  help="Compiler and autotuner for run-time block-sparse attention kernels.")
db_app = typer.Typer(help="The tuning databases (winners per spec, role, backend, GPU and length bucket).",
                     rich_markup_mode=None,
                     no_args_is_help=True)
app.add_typer(db_app, name="db")
# text from specs, paths and errors is printed as it is ('[tilelang]' is no tag); piped, tables keep every digit
console = Console(markup=False, width=None if sys.stdout.isatty() else 200)


def _fail(message: str) -> None:
    """One line on stderr, exit status 2 (bad input: the command did nothing)."""
    print(f"kernelgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(2)


def _given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among the parameters `names` that the command line set, as they are spelled there."""
    flags = {param.name: (param.secondary_opts or param.opts)[0] if ctx.params.get(param.name) is False
             else param.opts[0] for param in ctx.command.params}  # --no-graph as typed, not --graph
    return [flags[name] for name in names
            if (source := ctx.get_parameter_source(name)) is not None and source.name == "COMMANDLINE"]


def _refuse_with(ctx: typer.Context, what: str, why: str, *names: str) -> None:
    """Fail, naming them, where the command line set any of the options `names`, which `what` leaves unread."""
    given = _given(ctx, *names)
    if given:
        _fail(f"{what} cannot be combined with {', '.join(given)}: {why}")


def _needs(ctx: typer.Context, name: str, needed: str, why: str) -> None:
    """Fail where the command line set the option `name` without `needed`, the option it takes effect with."""
    given = _given(ctx, name)
    if given:
        _fail(f"{given[0]} needs {needed}: {why}")


@contextlib.contextmanager
def _as_typed(ctx: typer.Context, *names: str, **renamed: str):
    """A bad value of an option, raised by the library under its own name for it (a parameter's, a Spec
    field's: `names`, or the keys of `renamed`, whose values are the options' parameters), becomes one line
    naming the option as the command line spells it: "seq must be ..." is "--seq must be ...",
    "Spec.kv_block=48" is "--kv-block 48"."""
    try:
        yield
    except (KernelgenValueError, KernelgenTypeError) as error:
        flags = {param.name: param.opts[0] for param in ctx.command.params}
        message = str(error)
        for name, param in {**{name: name for name in names}, **renamed}.items():
            flag = flags[param]
            message = re.sub(rf"(?<![\w.-])(?:Spec\.)?{name}=", f"{flag} ", message)
            message = re.sub(rf"\bSpec\.{name}\b|^{name}\b", flag, message)
            if "_" in name:  # an identifier, never an English word: named in prose too ("leave q_tile at ...")
                message = re.sub(rf"(?<![\w.-]){name}(?= )", flag, message)
        _fail(message)


def clean_errors(command):
    """Bad input raised inside a command (a kernelgen error, a ValueError or TypeError, a file that cannot be
    read) becomes one line and exit status 2."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (KernelgenError, ValueError, TypeError, OSError, sqlite3.Error) as error:  # sqlite3: a failing disk
            _fail(error)
    return run


_LOG_HANDLER = "kernelgen.cli"  # the name of the handler the command line gives kernelgen's logger


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        console.print(f"kernelgen {__version__}")
        raise typer.Exit()


def _log_to_stderr(verbose: bool) -> None:
    """Give kernelgen's logger the command line's handler, at DEBUG with -v, else INFO: the one place -v acts,
    whether it comes before the command's name (the root's callback) or after it (the command's own -v)."""
    # kernelgen's logs go to stderr (stdout holds what a command answers: `db show`'s JSON), one line each where it
    # is no terminal; the handler is kernelgen's logger's own, replaced at each command (tests run many in a process)
    handler = (RichHandler(console=Console(stderr=True, markup=False)) if sys.stderr.isatty()
               else logging.StreamHandler(sys.stderr))
    if not sys.stderr.isatty():
        handler.setFormatter(logging.Formatter("kernelgen: %(levelname)s: %(message)s"))
    handler.set_name(_LOG_HANDLER)
    logger = logging.getLogger("kernelgen")
    for old in [h for h in logger.handlers if h.get_name() == _LOG_HANDLER]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def _verbose_given(ctx: typer.Context, value: bool) -> bool:
    # a command's -v (the root's is _main's); only one given acts: an absent one must not undo `kernelgen -v bench`
    if value and ctx.parent is not None and not ctx.resilient_parsing:
        _log_to_stderr(True)
    return value


# The root's and every command's: users write it after the command (`kernelgen bench -v`) as often as before it.
# The root's callback runs before a command's options are parsed, so a -v after the name still wins.
VERBOSE = typer.Option(False, "--verbose", "-v", callback=_verbose_given,
                       help="Log kernelgen's debug messages (before or after the command: kernelgen -v bench, "
                            "kernelgen bench -v).")


@app.callback()
def _main(verbose: bool = VERBOSE,
          version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print kernelgen's version and exit.")):
    _log_to_stderr(verbose)


def _spec_from_file(spec_file) -> "Spec":
    from .spec import Spec

    try:
        data = json.loads(Path(spec_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:  # recursion: deep nesting
        _fail(f"--spec {spec_file}: {getattr(error, 'strerror', None) or error}: expected a Spec's JSON "
              "(Spec.to_json())")
    if not isinstance(data, dict):
        _fail(f"--spec {spec_file}: expected a JSON object of Spec fields (Spec.to_json()), got {type(data).__name__}")
    try:
        return Spec.from_dict(data)
    except (KernelgenError, TypeError, ValueError) as error:  # an unknown field or a bad value: Spec's own error
        # (a field left out takes Spec's default, as Spec(...) gives it)
        _fail(f"--spec {spec_file}: {error}")


def _spec_from_options(ctx, spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector, local, sink,
                       backend, schedule="q_centric", window=None, softcap=None):
    from . import backends
    from .spec import Spec

    if spec_file is not None:
        spec = _spec_from_file(spec_file)
        try:
            backends.check_spec(spec)
        except KernelgenError as error:
            _fail(f"--spec {spec_file}: {error}")
        return spec
    with _as_typed(ctx, *SPEC_OPTIONS):
        spec = Spec(head_dim=head_dim, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal,
                    gqa_group=gqa_group, selector=selector, local=local, sink=sink, backend=backend, schedule=schedule,
                    window=window, softcap=softcap)
        backends.check_spec(spec)
    return spec


# options shared by the commands that take a spec
DEFAULT_TRIALS = 30  # per role of one spec
SPEC_FILE = typer.Option(None, "--spec", help="Spec JSON file (Spec.to_json()), instead of the spec options.")
MAIN_BENCH_OPTIONS = ("overhead", "sweep", "graph")  # the main bench's own: timings on a GPU
MAIN_BENCH_ONLY = (*MAIN_BENCH_OPTIONS, "stall_timeout")  # what the benches of their own leave unread
SPEC_OPTIONS = ("head_dim", "kv_block", "q_tile", "top_k", "causal", "gqa_group", "selector", "local", "sink",
                "backend", "schedule", "window", "softcap")
HEAD_DIM = typer.Option(128, help="Head dimension D.")
KV_BLOCK = typer.Option(64, help="Keys per KV block.")
Q_TILE = typer.Option(64, help="Queries per Q tile.")
TOP_K = typer.Option(16, help="Blocks per list, forced ones included.")
CAUSAL = typer.Option(False, "--causal/--no-causal", help="Bottom-right causal mask.")
GQA = typer.Option(1, help="Query heads per KV head.")
SELECTOR = typer.Option("mean", help="mean | multi:r | index | given (index: tuned on synthetic index vectors, "
                                     "Hi=4, Di=64).")
LOCAL = typer.Option(0, help="Local blocks forced into every list.")
SINK = typer.Option(0, help="Sink blocks forced into every list.")
BACKEND = typer.Option("triton", help="A registered backend (see `kernelgen info`), or auto (served, not tuned).")
SCHEDULE = typer.Option("q_centric", help="q_centric (a list per Q tile) or kv_centric (a list per query).")
WINDOW = typer.Option(None, help="A sliding window of this many keys (with --causal; the lists are then its blocks, "
                                 "and top_k must equal them).")
SOFTCAP = typer.Option(None, help="Logit soft-capping: scores become softcap * tanh(score / softcap) (Gemma 2: 50).")


def _check_out_dir(directory: Path) -> None:
    """Fail now, naming the option, when --out's directory cannot be written (made when missing)."""
    from .codegen.cache import unwritable

    problem = unwritable(directory)
    if problem is not None:
        _fail(f"--out: cannot write to {directory} ({problem})")


LISTED_SPACE = 16  # a dry run lists every config of a space this small (else with --space)


def _check_plan(p: dict) -> dict:
    if not p["space"]:  # as tune() would say: nothing to try
        _fail(f"no feasible {p['role']} config for this spec on {p['backend']} (study {p['study_name']}): the "
              "search space is empty; nothing to tune")
    return p


def _print_plan(p: dict, every_config: bool) -> None:
    """A study's plan: its space as each field's values, the trials (every config on a grid; on TPE the
    default and its neighbours first), and every config where the space is small or `every_config`."""
    from .tuning.plan import config_key, seeds

    rounded = "" if p["seq"] == p["bucket"] else f" (--seq {p['seq']} rounded up)"
    console.print(Text.assemble((p["role"], "bold"), f" ({p['backend']}): study {p['study_name']}, bucket "
                                f"{p['bucket']}{rounded}, sampler {p['sampler']}, {p['trials']} trials over a space "
                                f"of {p['space_size']} configs, benchmark shape {p['shape']}"))
    fields = Table("field", "values", box=None)
    for name, values in p["params"].items():
        fields.add_row(name, ", ".join(str(v) for v in values))
    console.print(fields)
    if p["sampler"] == "grid":
        console.print("trials: every config of the space")
    else:
        first = seeds(p["default"], p["params"], {config_key(c) for c in p["space"]})
        seeded = min(len(first), p["trials"])
        then = ", then TPE's samples" if p["trials"] > seeded else ""
        console.print(f"trials: first the default and its neighbours ({seeded} of {len(first)}){then}; the "
                      f"default {json.dumps(p['default'], sort_keys=True)}")
    if every_config or p["space_size"] <= LISTED_SPACE:
        table = Table("#", "config")
        for i, cfg in enumerate(p["space"]):
            table.add_row(str(i), json.dumps(cfg, sort_keys=True))
        console.print(table)


def _tune_one(spec, role, seq, arch, trials, timeout, shape=None, label=None, workers=1, storage=None):
    from rich.progress import Progress

    from .tuning import tune as run_tune

    with Progress(console=console) as bar:
        task = bar.add_task(f"tuning {label or role}", total=trials)
        result = run_tune(spec, role, seq=seq, arch=arch, trials=trials, timeout=timeout, shape=shape,
                          workers=workers, storage=storage,
                          progress=lambda i, n, value: bar.update(task, completed=i + 1, total=n))
    table = Table("study", "default ms", "tuned ms", "speed-up", "trials", "failed", "config")

    def ms(value):
        return "failed" if value is None else f"{value:.4f}"

    speedup = "-" if not (result.default_ms and result.best_ms) else f"{result.default_ms / result.best_ms:.2f}x"
    table.add_row(label or role, ms(result.default_ms), ms(result.best_ms), speedup, str(result.n_trials),
                  str(result.n_failed), json.dumps(result.best_config, sort_keys=True))
    console.print(table)
    if result.note:
        console.print(result.note)


@app.command()
@clean_errors
def tune(
    ctx: typer.Context,
    arch: str = typer.Option(..., help="GPU architecture to tune for, e.g. sm_90. A tune runs on a GPU of this "
                                       "arch (the current GPU must be one); --dry-run plans any arch from sm_80 on, "
                                       "on any machine. cpu (--dry-run only) plans the Triton interpreter's spaces, "
                                       "with sm_90's limits."),
    seq: Optional[int] = typer.Option(None, help="Sequence length; tuned for its power-of-two bucket. Required "
                                                 "unless --preset is given (its studies have their own lengths)."),
    # the flag named: typer 0.27 registers no --role for a list option given a metavar alone
    role: Optional[List[str]] = typer.Option(None, "--role", metavar="ROLE",
                                             help="A kernel role to tune, repeated for more (--role attn --role "
                                                  "select; default: every tuned role the spec's calls run)."),
    trials: Optional[int] = typer.Option(None, help="Trials per role (Optuna; default 30, with --preset or "
                                                    "--model each study's own count)."),
    timeout: Optional[float] = typer.Option(None, help="Seconds per role's study."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each study's space (each field's values), its "
                                                          "trials and, for a small space, every config; run "
                                                          "nothing (no GPU needed)."),
    every_config: bool = typer.Option(False, "--space", help="With --dry-run: list every config of every space."),
    workers: int = typer.Option(1, help="Worker processes measuring one study's trials at once, one per GPU "
                                        "(cuda:0 to cuda:N-1; CUDA_VISIBLE_DEVICES chooses which)."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage of the studies, shared by every process that "
                                                     "opens it (other hosts join the same study): sqlite:///PATH, "
                                                     "postgresql://USER@HOST/DB, journal:///PATH (default: the cache "
                                                     "dir's SQLite file; with --workers > 1 its journal file)."),
    preset: Optional[str] = typer.Option(None, help="A named set of studies instead of one spec: bench (the "
                                                    "benchmark shapes: each backend's attention, the selector and "
                                                    "the backward), kv (the KV-centric bench shapes), decode "
                                                    "(the decode bench shapes: decode and each schedule's "
                                                    "selection of a decode step); --role narrows it."),
    shapes: Optional[str] = typer.Option(None, help="With --preset: comma-separated shape names."),
    backends_option: Optional[str] = typer.Option(None, "--backends", help="With --preset or --model: comma-separated "
                                                                           "backends."),
    model: Optional[Path] = typer.Option(None, help="A Hugging Face config.json: tune every distinct attention spec "
                                                    "of the model, as attn_implementation=\"kernelgen\" serves it "
                                                    "(heads, KV heads, head_dim and sparse options from the file: its "
                                                    "\"kernelgen\" object or kernelgen_<option> keys); --role "
                                                    "narrows it."),
    spec_file: Optional[Path] = SPEC_FILE, head_dim: int = HEAD_DIM, kv_block: int = KV_BLOCK, q_tile: int = Q_TILE,
    top_k: int = TOP_K, causal: bool = CAUSAL, gqa_group: int = GQA, selector: str = SELECTOR, local: int = LOCAL,
    sink: int = SINK, backend: str = BACKEND, schedule: str = SCHEDULE, window: Optional[int] = WINDOW,
    softcap: Optional[float] = SOFTCAP,
    verbose: bool = VERBOSE,
):
    """Search tile, warp and stage parameters on this GPU and store the winners in the user tuning DB (with
    --dry-run: print the plan, on any machine)."""
    from . import backends as registry
    from .device import current_arch
    from .roles import ROLES, tuned_roles
    from .archs import check_arch
    from .tuning.model import model_studies, read_model_config
    from .tuning.plan import check_budget, check_seq, check_workers, plan
    from .tuning.presets import studies
    from .tuning.storage import parse_storage

    with _as_typed(ctx, "arch"):
        check_arch(arch)
    if preset is not None and model is not None:
        _fail("--preset and --model are two sets of studies: give one")
    if not dry_run:
        _needs(ctx, "every_config", "--dry-run", "it lists the configs a dry run plans")
    if preset is None:
        _needs(ctx, "shapes", "--preset", "it names the preset's shapes to tune")
        if model is None:
            _needs(ctx, "backends_option", "--preset or --model", "one spec's studies tune its own backend (--backend)")
    if preset is not None:
        _refuse_with(ctx, "--preset", "its studies have their own specs and lengths", "seq", "spec_file",
                     *SPEC_OPTIONS)
    if model is not None:
        _refuse_with(ctx, "--model", "the model's config.json gives every spec field (its \"kernelgen\" object or "
                     "kernelgen_<option> keys set the sparse options, as the model is served)", "spec_file",
                     *SPEC_OPTIONS)
    if spec_file is not None:
        _refuse_with(ctx, "--spec", "the file gives the whole spec", *SPEC_OPTIONS)
    with _as_typed(ctx, "trials", "timeout", "workers"):
        check_budget(DEFAULT_TRIALS if trials is None else trials, timeout)
        check_workers(workers)
    if storage is not None:
        try:
            storage = str(parse_storage(storage, name="--storage"))
        except KernelgenError as error:  # its messages name the storage: "--storage 'URL' ..."
            message = str(error)
            _fail(message if message.startswith("--storage") else f"--storage: {message}")
    if not dry_run:
        present = current_arch()
        if arch == "cpu":
            _fail("--arch cpu: the interpreter is not tuned (it runs the default configs); give --dry-run to see "
                  "a plan, or a GPU's arch on that GPU")
        if present is None:
            _fail("no CUDA GPU here: tuning needs the GPU it tunes for (use --dry-run to see the plan)")
        if present != arch:
            _fail(f"--arch {arch} does not match the GPU present ({present}); tune on a GPU of that arch")
        import torch

        count = torch.cuda.device_count()
        if workers > count:
            _fail(f"--workers {workers}: {count} CUDA GPU{'s are' if count != 1 else ' is'} visible here, and one "
                  "worker runs per GPU")
    names = list(dict.fromkeys(b for b in (backends_option or "").split(",") if b)) or None
    for name in names or ():
        if name == registry.AUTO:
            _fail(f"--backends {backends_option}: auto serves the backends tuned, it is none to tune; expected some "
                  f"of {registry.names()}")
        with _as_typed(ctx, backend="backends_option"):
            registry.get(name)
    if preset is not None or model is not None:
        if model is not None:
            if seq is None:
                _fail("--model needs --seq: the sequence length to tune the model's attention for")
            with _as_typed(ctx, "seq"):
                check_seq(seq)
            try:
                config = read_model_config(model)
            except KernelgenError as error:  # its messages start with "--model FILE:" already
                _fail(error)
            try:
                chosen_studies = list(model_studies(config, seq, DEFAULT_TRIALS, arch, names))
            except KernelgenError as error:  # the model's attention, not a flag of this command line
                _fail(f"--model {model}: {error}")
            source, whose = "--model", "the model's"
        else:
            chosen = list(dict.fromkeys(s for s in (shapes or "").split(",") if s)) or None
            if shapes is not None and not chosen:
                _fail(f"--shapes {shapes!r} names no shape")
            with _as_typed(ctx, "preset", "shapes"):
                chosen_studies = studies(preset, arch, chosen, names)
            source, whose = f"--preset {preset}", f"the {preset} preset's"
        if not chosen_studies:  # nothing run would read as success
            with_backends = f" with --backends {backends_option}" if names else ""
            _fail(f"{source} plans no study on {arch}{with_backends}: nothing to tune")
        planned = {study.spec.backend for study in chosen_studies}
        for name in [n for n in names or () if n not in planned]:  # left out: say so, not tune the rest in silence
            why = registry.get(name).arch_unsupported(arch) or f"none of {whose} studies runs on it there"
            console.print(f"note: --backends {name} plans no study on {arch} ({why})")
        if role:
            unknown = sorted(set(role) - {study.role for study in chosen_studies})
            if unknown:
                _fail(f"--role {', '.join(unknown)}: {whose} studies tune "
                      f"{', '.join(dict.fromkeys(study.role for study in chosen_studies))}")
            chosen_studies = [study for study in chosen_studies if study.role in role]
        if trials is not None:  # an explicit --trials sets every study's
            chosen_studies = [dataclasses.replace(study, trials=trials) for study in chosen_studies]
        runs = [(study.spec, study.role, study.seq, study.trials, study.shape, study.label) for study in chosen_studies]
    else:
        if seq is None:
            _fail("--seq is required (or --preset)")
        with _as_typed(ctx, "seq"):
            check_seq(seq)
        spec = _spec_from_options(ctx, spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector,
                                  local, sink, backend, schedule, window, softcap)
        own = tuned_roles(spec)
        for name in role or ():
            if name not in ROLES or not ROLES[name].tuned:
                _fail(f"--role {name!r} is not a tuned role; expected some of "
                      f"{[n for n, r in ROLES.items() if r.tuned]}")
            if name not in own:
                _fail(f"--role {name!r}: calls of this spec ({spec.schedule}, selector {spec.selector!r}) never run "
                      f"it; its tuned roles: {', '.join(own)}")
        trials = DEFAULT_TRIALS if trials is None else trials
        runs = [(spec, r, seq, trials, None, None) for r in dict.fromkeys(role or own)]  # a role repeated: once
    # every study planned (and so checked) before any is printed or run; a spec of the options is theirs to name
    from_options = preset is None and model is None and spec_file is None
    with _as_typed(ctx, "arch", *(SPEC_OPTIONS if from_options else ())):
        plans = [_check_plan(plan(spec, r, seq=n, arch=arch, trials=t, shape=shape))
                 for spec, r, n, t, shape, _ in runs]
    for p, (spec, r, n, t, shape, label) in zip(plans, runs):
        if dry_run:
            _print_plan(p, every_config)
        else:
            _tune_one(spec, r, n, arch, t, timeout, shape, label, workers, storage)


def _all_rows(path: Optional[Path], **filters) -> list[dict]:
    """Rows of the user DB and the bundled DB with their source, or of one DB file (`path`)."""
    from .tuning.db import (BUNDLED_DB_PATH, TuningDB, UnreadableDatabase, default_user_db_path, read_only_rows,
                            rows_of_file)

    if path is not None:  # named on the command line: a file that is not a tuning DB is an error
        try:
            return [{**r, "source": str(path)} for r in rows_of_file(path, **filters)]
        except UnreadableDatabase as error:  # "tuning database PATH is unreadable (why)": the path named once
            _fail(f"--path: {error}")
    rows = []
    if default_user_db_path().exists():  # listing makes no user DB (nor its cache dir) where there is none
        with TuningDB() as user:
            rows = [{**r, "source": "user"} for r in user.rows(**filters)]
    return rows + [{**r, "source": "bundled"} for r in read_only_rows(BUNDLED_DB_PATH, **filters)]


@db_app.command("list")
@clean_errors
def db_list(spec_key: Optional[str] = typer.Option(None, help="Only this spec key."),
            path: Optional[Path] = typer.Option(None, help="Only this DB file, opened read-only (default: the user "
                                                           "DB and the bundled DB)."),
            verbose: bool = VERBOSE):
    """List the tuned winners of the user DB and the bundled DB (full spec keys, one row each)."""
    rows = _all_rows(path, **({"spec_key": spec_key} if spec_key else {}))
    table = Table("source", "spec_key", "role", "backend", "arch", "gpu", "bucket", "dtype", "ms", "TFLOP/s",
                  "trials", box=None)
    for row in rows:
        tf = row.get("tflops")
        table.add_row(row["source"], row["spec_key"], row["role"], row["backend"], row["arch"], row["gpu_name"],
                      str(row["bucket"]),
                      row["dtype"], f"{row['median_ms']:.4f}", "-" if tf is None else f"{tf:.1f}",
                      str(row["n_trials"]))
    Console(width=max(console.width, 160), markup=False).print(table)
    console.print(f"{len(rows)} rows")


@db_app.command("show")
@clean_errors
def db_show(spec_key: Optional[str] = typer.Argument(None, help="Spec key (see `kernelgen db list`)."),
            spec_file: Optional[Path] = typer.Option(None, "--spec", help="Instead of a key: a Spec JSON file "
                                                                          "(Spec.to_json()); shows the winners of "
                                                                          "every role its calls run, each stored "
                                                                          "under that role's key."),
            path: Optional[Path] = typer.Option(None, help="Only this DB file (default: the user DB and the bundled "
                                                           "DB)."),
            verbose: bool = VERBOSE):
    """Every stored field of a spec key's winners, as JSON."""
    from . import backends as registry
    from .roles import get_role, tuned_roles

    if (spec_key is None) == (spec_file is None):
        _fail("give a spec key or --spec FILE (one of them)")
    if spec_file is not None:
        spec = _spec_from_file(spec_file)
        keys = sorted({get_role(role).key(spec, name) for role in tuned_roles(spec) for name in registry.names()})
        rows = [row for key in keys for row in _all_rows(path, spec_key=key)]
        if not rows:
            _fail(f"no rows for the spec in {spec_file} (its roles' keys: {', '.join(keys)})")
    else:
        rows = _all_rows(path, spec_key=spec_key)
        if not rows:
            _fail(f"no rows for spec key {spec_key} (see `kernelgen db list`)")
    console.print_json(json.dumps(rows, default=str))


@db_app.command("clear")
@clean_errors
def db_clear(spec_key: Optional[str] = typer.Option(None, help="Only this spec key."),
             gpu: Optional[str] = typer.Option(None, help="Only this GPU's rows (its name as `db list` shows it)."),
             yes: bool = typer.Option(False, "--yes", help="Do not ask."), verbose: bool = VERBOSE):
    """Delete winners from the user DB (the bundled DB is read-only)."""
    from .tuning.db import TuningDB, default_user_db_path

    user = default_user_db_path()
    if not user.exists():  # nothing to delete, and no DB (nor cache dir) made to say so
        console.print(f"deleted 0 rows (there is no user DB at {user})")
        return
    if user.is_dir():
        _fail(f"the user tuning DB {user} is a directory, not a database file: nothing to delete")
    with TuningDB() as db:
        db.check_writable()
        if not yes:
            which = " and ".join([f"of {spec_key}"] * bool(spec_key) + [f"of GPU {gpu}"] * bool(gpu))
            try:
                confirmed = typer.confirm(f"Delete {'rows ' + which if which else 'all rows'} in {db.path}?",
                                          default=False)
            except typer.Abort:  # no answer to read (no terminal, end of input): a script that left out --yes
                _fail("nothing deleted: not confirmed (pass --yes to delete without asking)")
            if not confirmed:  # the user's own answer: no error
                console.print("nothing deleted")
                return
        n = db.clear(**{column: value for column, value in (("spec_key", spec_key), ("gpu_name", gpu)) if value})
    console.print(f"deleted {n} rows")


@db_app.command("bundle")
@clean_errors
def db_bundle(files: List[Path] = typer.Argument(..., metavar="FILE", help="DB files whose winners to merge (a GPU "
                                                                           "machine's user DB)."),
              into: Optional[Path] = typer.Option(None, help="The bundled DB file (default: tuning_db/winners.db)."),
              verbose: bool = VERBOSE):
    """Merge tuned winners into the bundled DB that ships with kernelgen (maintainers): a merged row replaces
    the bundled row of the same key; every other row is kept. Rows of one key in several FILES merge as the
    user DB keeps them: of one fingerprint the faster, else the later measured."""
    from .codegen.cache import unwritable
    from .tuning.db import BUNDLED_DB_PATH, merge_into_bundled

    for file in files:
        if not file.is_file():
            _fail(f"{file} is not a file")
    target = into or BUNDLED_DB_PATH
    problem = unwritable(Path(target).parent, create=False)  # before any is read: the merge rewrites the file
    if problem is not None:
        _fail(f"--into {target}: cannot write to {Path(target).parent} ({problem})")
    rows = merge_into_bundled(files, target)
    console.print(f"{len(rows)} rows in {target}")


@app.command()
@clean_errors
def export(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="The .py file to write (missing parent directories are "
                                                 "created)."),
    spec_file: Optional[Path] = SPEC_FILE, head_dim: int = HEAD_DIM, kv_block: int = KV_BLOCK, q_tile: int = Q_TILE,
    top_k: int = TOP_K, causal: bool = CAUSAL, gqa_group: int = GQA, selector: str = SELECTOR, local: int = LOCAL,
    sink: int = SINK, backend: str = typer.Option("triton", help="A registered backend, or auto with --seq: its "
                                                   "kernels are baked in."), schedule: str = SCHEDULE,
    window: Optional[int] = WINDOW,
    softcap: Optional[float] = SOFTCAP,
    arch: Optional[str] = typer.Option(None, help="GPU architecture the module is for, e.g. sm_89: its default "
                                                  "configs, or with --seq its tuned winners, are baked in (default: "
                                                  "the GPU present's, else cpu)."),
    seq: Optional[int] = typer.Option(None, help="Bake in the tuning DBs' winners for the arch and this sequence "
                                                 "length's bucket."),
    gpu: Optional[str] = typer.Option(None, help="With --seq: the GPU's name as CUDA reports it (default: any GPU "
                                                 "of the arch)."),
    dtype: str = typer.Option("bfloat16", help="With --seq: the dtype whose winners are baked (bfloat16, float16)."),
    verbose: bool = VERBOSE,
):
    """Write one standalone module (torch + triton, and the backend's compiler) with the kernels and configs
    baked in: the tuning DBs' winners for --arch and --seq, or the defaults. Says which it baked."""
    import torch

    from . import backends as registry
    from .export import export_module, tuned_configs

    if out.suffix != ".py" or out.is_dir():  # before any lookup; export_module's own check names out_path
        _fail(f"--out {out}: expected a .py file to write (the module's name)")
    if spec_file is not None:
        _refuse_with(ctx, "--spec", "the file gives the whole spec", *SPEC_OPTIONS)
    if seq is None:
        for name in ("gpu", "dtype"):
            _needs(ctx, name, "--seq", "it chooses the tuned winners of that sequence length to bake in")
    spec = _spec_from_options(ctx, spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector, local,
                              sink, backend, schedule, window, softcap)
    from .archs import check_arch
    from .device import current_arch
    from .tuning.plan import check_seq

    given_arch = arch is not None
    with _as_typed(ctx, "arch", "seq"):
        arch = check_arch(arch) if given_arch else current_arch() or "cpu"
        if seq is not None:
            check_seq(seq)
    if spec.backend == registry.AUTO and seq is None:
        _fail("--backend auto bakes in the backend the tuning DBs serve fastest: give --seq (and --arch) too")
    if seq is not None and arch == "cpu":
        _fail(f"--seq bakes in a GPU's tuned winners: {'--arch cpu has none' if given_arch else 'give --arch too'} "
              f"(e.g. --arch sm_90); the CPU runs the defaults")
    if dtype not in ("bfloat16", "float16"):
        _fail(f"--dtype must be bfloat16 or float16, got {dtype!r}")
    unsupported = arch == "cpu" and spec.backend != registry.AUTO and registry.get(spec.backend).device_unsupported(
        torch.device("cpu"))
    if unsupported:  # a module for a GPU machine may be written here, but says so
        console.print(f"note: this machine cannot run backend {spec.backend!r} ({unsupported}): the module's calls "
                      "run on a GPU the backend supports")
    configs, sources = None, None
    if seq is not None:
        from .tuning.lookup import Target, cannot_serve

        if spec.backend == registry.AUTO:  # say which backends auto left out, and why (TileLang not installed, ...)
            for candidate in registry.all_backends():
                why = "attn" in candidate.roles and cannot_serve(candidate, spec, Target(arch, gpu))
                if why:
                    console.print(f"auto: {candidate.name} not considered: {why}")
        spec, configs, sources = tuned_configs(spec, arch=arch, seq=seq, gpu_name=gpu, dtype=getattr(torch, dtype))
    _check_out_dir(out.parent)
    path = export_module(spec, out, configs, arch, sources)
    from .export import resolve_configs

    for role, cfg in resolve_configs(spec, configs, arch).items():
        if cfg is not None:
            where = (sources or {}).get(role, f"default for {arch}; " + ("--arch and --seq bake in a GPU's tuned "
                                                                       "winners" if arch == "cpu" else
                                                                       "--seq bakes in tuned winners"))
            console.print(f"{role}: {registry.runner(spec.backend, role).name} "
                          f"{json.dumps(registry.Backend.config_to_dict(cfg), sort_keys=True)} ({where})")
    console.print(f"wrote {path}")
    if arch == "cpu":  # no GPU here and no --arch: the defaults are sized for no particular GPU
        console.print("note: no GPU here and no --arch: the module pins the interpreter's defaults, sized for sm_90's "
                      "shared memory; a GPU with less (sm_80, sm_86, sm_89) refuses those that do not fit. Export "
                      "with --arch for the GPU that will run it")


def _listed(names) -> str:
    return ", ".join(names)


# the bench modes' shapes, named in --help from the dicts the benches run (not copied: a shape added shows up);
# the shapes a bench runs another way are named apart, told as the bench tells them
_PACKED = [name for name in PADDED_SHAPES if name in PACKED_LENGTHS]  # run_padded: sequences packed in a row
_MIXED = [name for name, (counts, _) in CHUNKED_SHAPES.items() if isinstance(counts, tuple)]  # run_chunked: a step


@app.command()
@clean_errors
def bench(
    ctx: typer.Context,
    shapes: Optional[str] = typer.Option(None, help=f"Comma-separated shape names (default on a GPU: "
                                                    f"{_listed(BENCH_SHAPES)}; on a CPU only the interpreter "
                                                    f"smoke run, {SMOKE_SHAPE})."),
    out: Path = typer.Option(Path("bench-out"), help="Directory for bench.csv, bench.json, bench.jsonl (rows as "
                                                     "they are measured) and bench.png (created with its parents "
                                                     "when missing)."),
    overhead: bool = typer.Option(False, "--overhead", help="Also measure dispatch overhead per call."),
    sweep: str = typer.Option("", help="Shapes on which to also time every attention and select config."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="Also time each row replayed from a CUDA graph."),
    stall_timeout: float = typer.Option(600.0, help="Seconds without output after which the bench prints every "
                                                    "thread's stack and exits 1 (a hung kernel); 0: never."),
    backward: bool = typer.Option(False, "--backward", help="Forward+backward and backward alone against FlexAttention "
                                                            "(same BlockMask) and SDPA cuDNN (default shapes "
                                                            f"{_listed(BACKWARD_SHAPES)}; GPU only)."),
    untuned: bool = typer.Option(False, "--untuned", help="On shapes the bundled DB does not hold ("
                                                          f"{_listed(UNTUNED_SHAPES)}; or --shapes): "
                                                          "time what is served untuned, tune every backend in a "
                                                          "scratch DB, time it again (GPU only)."),
    kv_centric: bool = typer.Option(False, "--kv-centric", help="Per-query lists (the KV-centric schedule) against "
                                                                "FlexAttention, SDPA cuDNN and fla-core's NSA kernels "
                                                                f"(shapes {_listed(KV_CENTRIC_SHAPES)}; GPU only)."),
    decode: bool = typer.Option(False, "--decode", help="A few queries against a long KV cache (the decode role) "
                                                        "against FlexAttention (same BlockMask) and dense SDPA, in "
                                                        "GB/s beside a device copy's (shapes "
                                                        f"{_listed(DECODE_SHAPES)}; GPU only)."),
    padded: bool = typer.Option(False, "--padded", help="A right-padded batch (B8, rows of N down to N/2) in one "
                                                        "call (seqlens=) under each schedule against a call per "
                                                        "row, SDPA with the padding mask and dense SDPA cuDNN, "
                                                        "forward and "
                                                        "forward+backward (shapes "
                                                        f"{_listed(n for n in PADDED_SHAPES if n not in _PACKED)}; "
                                                        f"and {_listed(_PACKED)}: attn.varlen over "
                                                        "sequences packed in one row; GPU only)."),
    chunked: bool = typer.Option(False, "--chunked", help="A prefill chunk over a KV cache of per-row lengths (B8, "
                                                          "rows of N down to N/2) in one call (cache_seqlens=) "
                                                          "against a call per row, FlexAttention (same lists and "
                                                          "lengths) and SDPA with the rows' mask, and the one "
                                                          "call over the same cache in shuffled pages "
                                                          "(block_table=) (shapes "
                                                          f"{_listed(n for n in CHUNKED_SHAPES if n not in _MIXED)}; "
                                                          f"and {_listed(_MIXED)}: a serving step, rows of mixed "
                                                          "query counts over one paged cache through attn.varlen; "
                                                          "GPU only)."),
    window: bool = typer.Option(False, "--window", help="Sliding-window attention (Spec.window) against "
                                                        "FlexAttention's sliding-window BlockMask and dense causal "
                                                        f"SDPA cuDNN, forward and forward+backward (shapes "
                                                        f"{_listed(WINDOW_SHAPES)}; GPU only)."),
    softcap: bool = typer.Option(False, "--softcap", help="Logit soft-capping (Spec.softcap) against FlexAttention "
                                                          "with a tanh score_mod on the same BlockMask, forward and "
                                                          f"forward+backward (shapes {_listed(SOFTCAP_SHAPES)}; GPU "
                                                          "only)."),
    context_parallel: bool = typer.Option(False, "--context-parallel", help=f"A {CP_WORLD}-rank context-parallel "
                                          "run's per-rank kernels (dense ring and sparse fetch), forward and "
                                          "backward, timed on one GPU against one GPU's, the bytes each path moves, "
                                          f"and the {CP_WORLD}-GPU time projected at NVLink speed (B{CP_BATCH} "
                                          f"Hq{CP_HEADS_KV * CP_SPEC.gqa_group} Hkv{CP_HEADS_KV} D{CP_SPEC.head_dim}"
                                          f"{' causal' if CP_SPEC.causal else ''}, N={CP_SEQ // 1024}k; GPU only)."),
    verbose: bool = VERBOSE,
):
    """kernelgen next to FlexAttention (same BlockMask) and SDPA flash / cuDNN: ms and useful TFLOP/s."""
    from . import bench as benchmark

    if context_parallel:
        import torch

        from .bench.context_parallel import run_context_parallel

        if backward or untuned or kv_centric or decode or padded or chunked or window or softcap or shapes:
            _fail("--context-parallel is a bench of its own (one shape): give it alone")
        _refuse_with(ctx, "--context-parallel", "a bench of its own (one shape)", *MAIN_BENCH_ONLY)
        if not torch.cuda.is_available():
            _fail("bench --context-parallel needs a CUDA GPU: it times kernels")
        _check_out_dir(out)
        run_context_parallel(out_dir=str(out))
        return
    if backward or untuned or kv_centric or decode or padded or chunked or window or softcap:  # GPU-only, of their own
        import torch

        from .bench.backward import run_backward
        from .bench.chunked import CHUNKED_SHAPES, run_chunked
        from .bench.decode import run_decode
        from .bench.kv_centric import run_kv_centric
        from .bench.padded import PADDED_SHAPES, run_padded
        from .bench.untuned import run_untuned
        from .bench.softcap import run_softcap
        from .bench.window import run_window
        from .workloads import SHAPES

        chosen = [(flag, run, known) for flag, on, run, known in (
            ("--backward", backward, run_backward, SHAPES), ("--untuned", untuned, run_untuned, SHAPES),
            ("--kv-centric", kv_centric, run_kv_centric, KV_CENTRIC_SHAPES),
            ("--decode", decode, run_decode, DECODE_SHAPES), ("--padded", padded, run_padded, PADDED_SHAPES),
            ("--chunked", chunked, run_chunked, CHUNKED_SHAPES), ("--window", window, run_window, WINDOW_SHAPES),
            ("--softcap", softcap, run_softcap, SOFTCAP_SHAPES))
            if on]
        if len(chosen) > 1:
            _fail(f"{' and '.join(flag for flag, _, _ in chosen)} are separate benches: give one")
        flag, run, known = chosen[0]
        _refuse_with(ctx, flag, "a bench of its own", *MAIN_BENCH_ONLY)
        names = benchmark._names(shapes, "bench shapes", known)
        if not torch.cuda.is_available():
            _fail(f"bench {flag} needs a CUDA GPU: it times kernels")
        _check_out_dir(out)
        run(names, str(out))
        return

    import torch

    names = benchmark._names(shapes, "bench shapes") or []
    for flag, chosen in (("--shapes", names), ("--sweep", benchmark._names(sweep, "sweep shapes") or [])):
        gpu_only = [n for n in chosen if n != benchmark.SMOKE_SHAPE]
        if gpu_only and not torch.cuda.is_available():
            _fail(f"{flag} {','.join(gpu_only)}: these shapes need a CUDA GPU; on a CPU the bench runs only its "
                  f"{benchmark.SMOKE_SHAPE!r} smoke run in the interpreter (no --shapes)")
    if not torch.cuda.is_available():
        for name in MAIN_BENCH_OPTIONS:
            _needs(ctx, name, "a CUDA GPU", "on a CPU the bench runs only its smoke run in the interpreter")
    _check_out_dir(out)
    with _as_typed(ctx, "stall_timeout"):
        benchmark.main(shapes=shapes, out=str(out), overhead=overhead, sweep=sweep, graph=graph,
                       stall_timeout=stall_timeout)
    png = benchmark.plot(str(out))
    if png:
        console.print(f"plot: {png}")


@app.command()
@clean_errors
def quality(
    ctx: typer.Context,
    qkv: Path = typer.Option(..., "--qkv", help="A .pt file of captured tensors: {'layers': {name: {'q', 'k'[, 'v'][, "
                                                 "'q_idx', 'k_idx', 'w']}}} (kernelgen.quality.capture_qkv) or one "
                                                 "layer's {'q', 'k'[, 'v']}; without v the output error is nan."),
    selectors: Optional[str] = typer.Option(None, help="Comma-separated selectors: mean, multi:r, index (default: "
                                                       "mean and multi:4, and index when the file holds index "
                                                       "vectors)."),
    top_k: str = typer.Option("4,8,16,32", "--top-k", help="Comma-separated list budgets (forced blocks included)."),
    kv_block: int = KV_BLOCK, q_tile: int = Q_TILE, local: int = LOCAL, sink: int = SINK,
    causal: Optional[bool] = typer.Option(None, "--causal/--no-causal", help="Bottom-right causal mask (default: as "
                                                                             "the file records, else not)."),
    out: Path = typer.Option(Path("quality-out"), help="Directory for quality.csv and quality.png (created with "
                                                       "its parents when missing)."),
    device: Optional[str] = typer.Option(None, help="Where to compute: cpu or cuda (default: cuda when present)."),
    schedule: str = typer.Option("q_centric", help="q_centric (a list per Q tile) or kv_centric (a list per "
                                                   "query; adds the union design's inflation)."),
    verbose: bool = VERBOSE,
):
    """Attention-mass recall and output error of each selector's block lists against dense attention, per
    layer and head, for q/k/v captured from a model; per-query lists also report how closely neighbouring
    queries' lists agree (the KV-centric union design's inflation)."""
    import torch

    from .quality import (QUALITY_SELECTORS, full_coverage_note, load_qkv, plot_recall, recorded_causal,
                          selection_quality, summarize, write_csv)
    from .spec import HEAD_DIMS, HEAD_DIMS_TEXT, Spec
    from .tile_union import union_max_inflation

    if not qkv.is_file():
        _fail(f"--qkv {qkv}: no such file")
    try:
        budgets = [int(t) for t in top_k.split(",") if t.strip()]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) < 1:
        _fail(f"--top-k {top_k!r}: expected comma-separated ints >= 1, e.g. 4,8,16")
    try:
        layers = load_qkv(qkv)
    except KernelgenError as error:  # its messages start with the file's path
        _fail(f"--qkv {error}")
    first = next(iter(layers.values()))
    for key in ("q", "k"):
        if not isinstance(first.get(key), torch.Tensor) or first[key].dim() != 4:
            _fail(f"--qkv {qkv}: layer {next(iter(layers))!r} needs a 4-D tensor {key!r} [B, H, N, D]")
    q, k = first["q"], first["k"]
    if 0 in q.shape or 0 in k.shape:
        _fail(f"--qkv {qkv}: layer {next(iter(layers))!r} has q {list(q.shape)}, k {list(k.shape)}: B, H, N and D "
              "must be at least 1")
    has_index = all(all(x in layer for x in ("q_idx", "k_idx", "w")) for layer in layers.values())
    if selectors is None:
        r = 4 if kv_block % 4 == 0 and q_tile % 4 == 0 else 2
        chosen = ["mean", f"multi:{r}"] + (["index"] if has_index else [])
    else:
        chosen = [sel.strip() for sel in selectors.split(",") if sel.strip()]
        if not chosen or "given" in chosen:
            _fail(f"--selectors {selectors!r}: expected some of {', '.join(QUALITY_SELECTORS)} (given lists are no "
                  "selection to measure)")
        if "index" in chosen and not has_index:
            _fail(f"--selectors index: {qkv} holds no index vectors (q_idx, k_idx, w) in every layer")
    if causal is None:
        try:
            recorded = {name: recorded_causal(name, layer) for name, layer in layers.items()}
        except KernelgenError as error:
            _fail(f"--qkv {qkv}: {error}")
        if len(set(recorded.values())) > 1:  # one spec measures every layer: a mixed file would mismeasure some
            causal_ones = [name for name, was in recorded.items() if was]
            _fail(f"--qkv {qkv}: {len(causal_ones)} of {len(recorded)} layers record causal (e.g. "
                  f"{causal_ones[0]!r}), the rest not; pass --causal or --no-causal, or capture them apart")
        causal = all(recorded.values())
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except RuntimeError:
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        _fail(f"--device {device!r}: expected cpu or cuda (cuda:N)")
    if where.type == "cuda" and not (torch.cuda.is_available() and (where.index or 0) < torch.cuda.device_count()):
        _fail(f"--device {device}: no such CUDA GPU here ({torch.cuda.device_count()} visible); give --device cpu")
    if q.shape[2] < q.shape[1] or k.shape[2] < k.shape[1]:  # fewer tokens than heads: likely [B, N, H, D]
        console.print(f"note: q {list(q.shape)} and k {list(k.shape)} are read as [B, H, N, D]: {q.shape[1]} "
                      f"heads of {q.shape[2]} queries over {k.shape[2]} keys; transpose a [B, N, H, D] capture "
                      "(capture_qkv records [B, H, N, D])")
    if q.shape[1] % max(1, k.shape[1]):
        _fail(f"--qkv {qkv}: q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]}")
    if q.shape[-1] not in HEAD_DIMS:
        _fail(f"--qkv {qkv}: q's head dim {q.shape[-1]} is not supported; expected {HEAD_DIMS_TEXT}")
    with _as_typed(ctx, "kv_block", "q_tile", "top_k", "local", "sink", "schedule", selector="selectors"):
        spec = Spec(head_dim=q.shape[-1], kv_block=kv_block, q_tile=q_tile, top_k=max(budgets), causal=causal,
                    gqa_group=q.shape[1] // k.shape[1], local=local, sink=sink, schedule=schedule)
        for sel in chosen:  # every selector and budget checked before any is measured
            for budget in budgets:
                spec.replace(selector=sel, top_k=budget)
    _check_out_dir(out)
    try:
        rows = selection_quality(layers, spec, chosen, budgets, device=where)
    except (KernelgenValueError, KernelgenTypeError) as error:  # the options are checked: the file's tensors
        _fail(f"--qkv {qkv}: {error}")
    columns = ["selector", "top_k", "recall (mean)", "recall (lowest)", "rel. error (mean)", "rel. error (max)",
               "lowest recall at"] + (["inflation (mean)"] if spec.per_query else [])
    table = Table(*columns)
    for row in summarize(rows):
        table.add_row(row["selector"], str(row["top_k"]), f"{row['recall_mean']:.4f}", f"{row['recall_min']:.4f}",
                      f"{row['rel_error_mean']:.2e}", f"{row['rel_error_max']:.2e}", row["worst"] or "-",
                      *([f"{row['inflation_mean']:.2f}"] if spec.per_query else []))
    # layers may differ in length: each is measured at its own, and the header gives the range
    n_qs, n_ks = ({layer[x].shape[2] for layer in layers.values()} for x in "qk")
    n_blocks = sorted({spec.n_kv_blocks(n) for n in n_ks})
    console.print(f"{len(layers)} layers, {q.shape[1]} query heads, Nq={_span(n_qs)}, Nk={_span(n_ks)}, "
                  f"{'causal' if causal else 'not causal'}, kv_block={kv_block}, "
                  f"{'per-query lists' if spec.per_query else f'q_tile={q_tile}'}, local={local}, "
                  f"sink={sink} ({_span(n_blocks)} KV blocks)")
    if spec.per_query:
        console.print("inflation: the pairs the KV-centric union design computes over those the lists hold; "
                      f"prepare() serves it at most {union_max_inflation(kv_block):.2f}, or where this spec's tuned "
                      "winners of both designs on the GPU put their crossover")
    console.print(table)
    note = full_coverage_note(budgets, n_blocks[-1])  # budgets that list every block of every layer
    if note:
        console.print(note)
    console.print(f"per layer and head: {write_csv(rows, out / 'quality.csv')}")
    png = plot_recall(rows, out / "quality.png")
    if png:
        console.print(f"plot: {png}")


def _span(values) -> str:
    """A set of ints as its one value, or as "least–most"."""
    return str(min(values)) if len(set(values)) == 1 else f"{min(values)}–{max(values)}"


@app.command()
def info(verbose: bool = VERBOSE):
    """Versions, GPU, backends, cache and tuning-DB paths."""
    import importlib.metadata as md

    import torch

    from . import backends
    from .codegen.cache import cache_dir, unwritable
    from .device import current_arch, gpu_name
    from .tuning.db import BUNDLED_DB_PATH, UnreadableDatabase, default_user_db_path, read_only_rows, rows_of_file

    table = Table("what", Column("value", overflow="fold"))  # a path is folded, never cut short

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    for name in ("kernelgen", "torch", "triton", "tilelang", "optuna", "sqlite-utils"):
        table.add_row(name, version(name))
    table.add_row("CUDA (torch)", str(torch.version.cuda))
    if torch.cuda.is_available():
        table.add_row("GPU", f"{gpu_name()} ({current_arch()})")
    else:
        table.add_row("GPU", "none: kernels run in the Triton interpreter (TRITON_INTERPRET=1)" if interpreting() else
                      f"none, and {NO_INTERPRETER_MESSAGE.removeprefix('no CUDA GPU here, and ')}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in backends.all_backends():
        why = backend.not_installed() or backend.device_unsupported(device)
        table.add_row(f"backend {backend.name}", f"{'runs here' if not why else why}; {backend.summary}")
    cache = cache_dir()
    read_only = unwritable(cache, create=False)  # info reads: a missing cache dir stays missing
    if read_only is None:
        table.add_row("cache dir", str(cache))
        table.add_row("kernel modules", str(cache / "kernels"))
    else:
        table.add_row("cache dir", f"{cache} (cannot be written: {read_only})")
        table.add_row("kernel modules", "a private temporary directory per process (the cache dir cannot be written)")
    user = default_user_db_path()
    if user.is_file():
        writable = read_only is None and os.access(user, os.W_OK)
        try:
            state = f"{user} ({len(rows_of_file(user))} rows{'' if writable else ', read-only'})"
        except UnreadableDatabase as error:  # says which file and why
            state = str(error)
        table.add_row("user tuning DB", state)
    elif user.is_dir():
        table.add_row("user tuning DB", f"{user} (cannot be used: a directory, not a database file)")
    elif read_only is None:
        table.add_row("user tuning DB", f"{user} (none yet)")
    else:
        table.add_row("user tuning DB", f"{user} (none, and the cache dir cannot hold one: {read_only})")
    table.add_row("bundled tuning DB", f"{BUNDLED_DB_PATH} ({len(read_only_rows(BUNDLED_DB_PATH))} rows)")
    console.print(table)


if __name__ == "__main__":
    app()

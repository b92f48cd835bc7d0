"""`kernelgen` command line: tune, db, export, bench, info (typer + rich).

The library never configures logging; this module does, for the commands it runs.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

app = typer.Typer(help="Compiler and autotuner for run-time block-sparse attention kernels.", no_args_is_help=True)
db_app = typer.Typer(help="The tuning database (winners per spec, role, GPU and length bucket).", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console()


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log kernelgen's debug messages.")):
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[RichHandler(console=console)])
    logging.getLogger("kernelgen").setLevel(logging.DEBUG if verbose else logging.INFO)


def _spec_from_options(spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector, local, sink, backend):
    from .spec import Spec

    try:
        if spec_file is not None:
            return Spec.from_json(Path(spec_file).read_text())
        return Spec(head_dim=head_dim, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal,
                    gqa_group=gqa_group, selector=selector, local=local, sink=sink, backend=backend)
    except (ValueError, TypeError, OSError) as error:
        raise typer.BadParameter(str(error)) from None


# options shared by the commands that take a spec
SPEC_FILE = typer.Option(None, "--spec", help="Spec JSON file (Spec.to_json()); overrides the spec options.")
HEAD_DIM = typer.Option(128, help="Head dimension D.")
KV_BLOCK = typer.Option(64, help="Keys per KV block.")
Q_TILE = typer.Option(64, help="Queries per Q tile.")
TOP_K = typer.Option(16, help="Blocks per list, forced ones included.")
CAUSAL = typer.Option(False, "--causal/--no-causal", help="Bottom-right causal mask.")
GQA = typer.Option(1, help="Query heads per KV head.")
SELECTOR = typer.Option("mean", help="mean | multi:r | given.")
LOCAL = typer.Option(0, help="Local blocks forced into every list.")
SINK = typer.Option(0, help="Sink blocks forced into every list.")
BACKEND = typer.Option("triton", help="triton | tilelang | gluon | auto (gluon: Hopper only; auto: served, not "
                                      "tuned).")


def _current_arch() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@app.command()
def tune(
    arch: str = typer.Option(..., help="GPU architecture to tune for, e.g. sm_90 (must be the GPU present)."),
    seq: int = typer.Option(..., help="Sequence length; tuned for its power-of-two bucket."),
    role: List[str] = typer.Option(["attn", "select"], help="Kernel roles to tune."),
    trials: int = typer.Option(30, help="Trials per role (Optuna)."),
    timeout: Optional[float] = typer.Option(None, help="Seconds per role's study."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the search space and the trials; run nothing."),
    spec_file: Optional[Path] = SPEC_FILE, head_dim: int = HEAD_DIM, kv_block: int = KV_BLOCK, q_tile: int = Q_TILE,
    top_k: int = TOP_K, causal: bool = CAUSAL, gqa_group: int = GQA, selector: str = SELECTOR, local: int = LOCAL,
    sink: int = SINK, backend: str = BACKEND,
):
    """Search tile, warp and stage parameters on this GPU and store the winners in the tuning DB."""
    from . import tune as tuning

    spec = _spec_from_options(spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector, local,
                              sink, backend)
    if spec.backend == "auto" and "attn" in role:
        raise typer.BadParameter("auto is served, not tuned: tune --backend triton, --backend tilelang and "
                                 "--backend gluon; get_kernel then serves the fastest", param_hint="--backend")
    roles = [r for r in role if r != "select" or spec.selects]
    if not dry_run:
        present = _current_arch()
        if present is None:
            raise typer.BadParameter("no CUDA GPU here: tuning needs the GPU it tunes for (use --dry-run to see the plan)",
                                     param_hint="--arch")
        if present != arch:
            raise typer.BadParameter(f"--arch {arch} does not match the GPU present ({present})", param_hint="--arch")
    for r in roles:
        p = tuning.plan(spec, r, seq=seq, arch=arch, trials=trials)
        if dry_run:
            console.print(f"[bold]{r}[/bold]: study {p['study_name']}, bucket {p['bucket']}, sampler {p['sampler']}, "
                          f"{min(trials, len(p['space']))} trials over a space of {len(p['space'])} configs, "
                          f"benchmark shape {p['shape']}")
            table = Table("#", "config")
            for i, cfg in enumerate(p["space"]):
                table.add_row(str(i), json.dumps(cfg, sort_keys=True))
            console.print(table)
            continue
        from rich.progress import Progress

        with Progress(console=console) as bar:
            task = bar.add_task(f"tuning {r}", total=trials)
            result = tuning.tune(spec, r, seq=seq, arch=arch, trials=trials, timeout=timeout,
                                 progress=lambda i, n, value: bar.update(task, completed=i + 1, total=n))
        table = Table("role", "default ms", "tuned ms", "speed-up", "trials", "failed", "config")

        def ms(value):
            return "failed" if value is None else f"{value:.4f}"

        speedup = "-" if not (result.default_ms and result.best_ms) else f"{result.default_ms / result.best_ms:.2f}x"
        table.add_row(r, ms(result.default_ms), ms(result.best_ms), speedup, str(result.n_trials),
                      str(result.n_failed), json.dumps(result.best_config, sort_keys=True))
        console.print(table)
        if result.note:
            console.print(result.note)


@db_app.command("list")
def db_list(spec_key: Optional[str] = typer.Option(None, help="Only this spec key."),
            path: Optional[Path] = typer.Option(None, help="DB file (default: the user DB).")):
    """List the tuned winners."""
    from .db import TuningDB

    filters = {"spec_key": spec_key} if spec_key else {}
    rows = TuningDB(path).rows(**filters)
    table = Table("spec_key", "role", "backend", "arch", "gpu", "bucket", "dtype", "ms", "TFLOP/s", "trials")
    for row in rows:
        tf = row.get("tflops")
        table.add_row(row["spec_key"], row["role"], row["backend"], row["arch"], row["gpu_name"], str(row["bucket"]),
                      row["dtype"], f"{row['median_ms']:.4f}", "-" if tf is None else f"{tf:.1f}", str(row["n_trials"]))
    console.print(table)
    console.print(f"{len(rows)} rows in {TuningDB(path).path}")


@db_app.command("show")
def db_show(spec_key: str = typer.Argument(..., help="Spec key (see `kernelgen db list`)."),
            path: Optional[Path] = typer.Option(None, help="DB file (default: the user DB).")):
    """Every stored field of a spec's winners, as JSON."""
    from .db import TuningDB

    rows = TuningDB(path).rows(spec_key=spec_key)
    if not rows:
        console.print(f"no rows for spec key {spec_key}")
        raise typer.Exit(1)
    console.print_json(json.dumps(rows, default=str))


@db_app.command("clear")
def db_clear(spec_key: Optional[str] = typer.Option(None, help="Only this spec key."),
             path: Optional[Path] = typer.Option(None, help="DB file (default: the user DB)."),
             yes: bool = typer.Option(False, "--yes", help="Do not ask.")):
    """Delete winners from the user DB (the bundled DB is read-only)."""
    from .db import TuningDB

    db = TuningDB(path)
    if not yes:
        typer.confirm(f"Delete {'all rows' if not spec_key else 'rows of ' + spec_key} in {db.path}?", abort=True)
    n = db.clear(**({"spec_key": spec_key} if spec_key else {}))
    console.print(f"deleted {n} rows")


@app.command()
def export(
    out: Path = typer.Option(..., "--out", help="The .py file to write."),
    spec_file: Optional[Path] = SPEC_FILE, head_dim: int = HEAD_DIM, kv_block: int = KV_BLOCK, q_tile: int = Q_TILE,
    top_k: int = TOP_K, causal: bool = CAUSAL, gqa_group: int = GQA, selector: str = SELECTOR, local: int = LOCAL,
    sink: int = SINK, backend: str = typer.Option("triton", help="triton | tilelang | gluon (tilelang: the module "
                                                   "then needs tilelang too)."),
):
    """Write one standalone module (torch + triton, and tilelang for a TileLang spec) with the kernels and
    configs baked in."""
    from .export import export_module

    spec = _spec_from_options(spec_file, head_dim, kv_block, q_tile, top_k, causal, gqa_group, selector, local, sink,
                              backend)
    try:
        path = export_module(spec, out)
    except ValueError as error:  # e.g. backend auto
        raise typer.BadParameter(str(error)) from None
    console.print(f"wrote {path}")


@app.command()
def bench(
    shapes: Optional[str] = typer.Option(None, help="Comma-separated shape names (default: all on a GPU, tiny on CPU)."),
    out: Path = typer.Option(Path("bench-out"), help="Directory for bench.csv, bench.json and bench.png."),
    sweep: str = typer.Option("", help="Shapes on which to also sweep every attention and select config."),
):
    """kernelgen next to FlexAttention (same BlockMask) and SDPA flash / cuDNN: ms and useful TFLOP/s."""
    from . import bench as benchmark

    args = ["--out", str(out)] + (["--shapes", shapes] if shapes else []) + (["--sweep", sweep] if sweep else [])
    benchmark.main(args)
    png = benchmark.plot(out)
    if png:
        console.print(f"plot: {png}")


@app.command()
def info():
    """Versions, GPU, cache and tuning-DB paths."""
    import importlib.metadata as md

    import torch

    from .compile import cache_dir
    from .db import BUNDLED_DB_PATH, TuningDB

    table = Table("what", "value")

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    for name in ("kernelgen", "torch", "triton", "tilelang", "optuna", "sqlite-utils"):
        table.add_row(name, version(name))
    table.add_row("CUDA (torch)", str(torch.version.cuda))
    if torch.cuda.is_available():
        table.add_row("GPU", f"{torch.cuda.get_device_name()} ({_current_arch()})")
    else:
        table.add_row("GPU", "none: kernels run in the Triton interpreter (TRITON_INTERPRET=1)")
    table.add_row("cache dir", str(cache_dir()))
    user = TuningDB()
    table.add_row("user tuning DB", f"{user.path} ({len(user.rows())} rows)")
    table.add_row("bundled tuning DB", str(BUNDLED_DB_PATH))
    console.print(table)


if __name__ == "__main__":
    app()

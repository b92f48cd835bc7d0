"""bench.png from a bench run's bench.json: time and useful TFLOP/s per shape (matplotlib, optional)."""
from __future__ import annotations

import json
import math
import os

from ..workloads import SHAPES

__all__ = ["plot", "pyplot"]


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None after a one-line note when matplotlib (optional)
    is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def plot(out_dir) -> str | None:
    """bench.png next to bench.json: time and useful TFLOP/s per shape (ordered by N), one series per
    implementation; sweep rows and rows without a time (the CPU smoke run) are left out. Needs matplotlib
    (optional). Returns the path, or None after a one-line note when there is no plot (no bench.json, no
    timed row, no matplotlib)."""
    path = os.path.join(out_dir, "bench.json")
    if not os.path.exists(path):
        print(f"no {path}: no plot")
        return None
    with open(path) as f:  # a time is null (NaN in files of older runs) where none was measured
        rows = [r for r in json.load(f) if not r["impl"].startswith("sweep") and _number(r["ms"])]
    for r in rows:
        r["tflops"] = r["tflops"] if _number(r.get("tflops")) else math.nan  # a gap in the series
    if not rows:
        print("no timed rows (the CPU smoke run has no timings): no plot")
        return None
    plt = pyplot()
    if plt is None:
        return None
    names = sorted({r["shape"] for r in rows}, key=lambda n: (SHAPES[n].n_k, n) if n in SHAPES else (0, n))
    impls = sorted({r["impl"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, impl in enumerate(impls):
        pts = sorted((names.index(r["shape"]), r["ms"], r["tflops"]) for r in rows if r["impl"] == impl)
        style = dict(marker="o", label=impl, color=f"C{i % 10}", linestyle="-" if i < 10 else "--")  # one per impl
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
        if "select only" not in impl:
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], **style)
    for ax, label in zip(axes, ("ms (median)", "useful TFLOP/s")):
        ax.set_xticks(range(len(names)), [f"{n}\nN={SHAPES[n].n_k}" if n in SHAPES else n for n in names])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)  # every series (selection alone has no useful FLOPs)
    fig.tight_layout()
    png = os.path.join(out_dir, "bench.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png

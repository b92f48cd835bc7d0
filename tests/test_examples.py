"""The examples run end to end (on the CPU: the interpreter at their tiny sizes)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_train_tiny_trains_both_models(tmp_path):
    """One step of each model; on a CPU at the example's tiny size (it says so). Both losses are finite and
    the sparse model's first loss is the dense model's (same weights, same data, attention that differs
    only in which blocks it reads)."""
    if torch.cuda.is_available():
        return  # the GPU run is the example's own (200 steps)
    out = tmp_path / "curves.json"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--steps", "2", "--out",
                             str(out)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "No CUDA GPU" in result.stdout
    curves = json.loads(out.read_text())["curves"]
    dense, sparse = curves["dense SDPA"], curves["kernelgen sparse"]
    assert len(dense) == len(sparse) == 2
    assert abs(dense[0] - sparse[0]) < 0.05 * dense[0]
    assert sparse[1] < sparse[0]  # the backward trains it


def test_quality_tiny_reports_each_length(tmp_path):
    """Two dense steps on the CPU, then the selection-quality report at two short lengths: a CSV per length whose
    recall reaches 1 where top_k covers every block."""
    if torch.cuda.is_available():
        return  # the GPU run is the example's own (N=4096..32768)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quality_tiny.py"), "--steps", "2", "--lengths",
                             "64,128", "--top-k", "2,8", "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "No CUDA GPU" in result.stdout and "N=64" in result.stdout and "N=128" in result.stdout
    rows = (tmp_path / "quality_N64.csv").read_text().splitlines()
    assert rows[0] == "layer,head,selector,top_k,recall,rel_error,inflation"
    assert (tmp_path / "quality_N128.csv").exists()
    # as `kernelgen quality` says: a budget of every block has recall 1 whatever the selector
    assert "top_k 8: at least the 4 KV blocks there are, so every block is listed" in result.stdout
    full = [float(r.split(",")[4]) for r in rows[1:] if r.split(",")[3] == "8"]  # 4 blocks of 16 keys: all listed
    assert full and all(abs(x - 1) < 1e-9 for x in full)


def test_hf_llama_sparse_runs_tiny_on_the_cpu(tmp_path):
    """On a CPU the example runs its tiny model in the interpreter (it says so), checks kernelgen against SDPA with
    every block listed, decoding over a KeyRepsCache against a DynamicCache and the compiled model against the eager
    one, and times the three attention implementations."""
    if torch.cuda.is_available():
        return  # the GPU run is the example's own (1B-scale, 32k and 128k tokens)
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_llama_sparse.py"), "--seq", "64", "--compile",
                             "--out", str(out)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "No CUDA GPU" in result.stdout and "every block listed" in result.stdout
    assert "a tiny model (2 layers, hidden 64) at 64 tokens" in result.stdout  # --seq's, not the default 128
    assert re.search(r"model: \d+\.\dK parameters", result.stdout), result.stdout[:500]  # not 0.000164B
    assert "logits over a KeyRepsCache equal a DynamicCache's: True" in result.stdout
    assert "compiled prefill: logits max-abs difference from the eager model's 0.00e+00" in result.stdout
    rows = json.loads(out.read_text())["results"]
    assert [(r["tokens"], r["attention"]) for r in rows] == [(64, "sdpa"), (64, "kernelgen")]


def test_hf_packed_training_runs_tiny_on_the_cpu(tmp_path):
    """On a CPU the example runs its tiny packed batch in the interpreter (it says so), checks the compiled training
    step (the varlen kwargs, inside the graph) against the eager one, and times each implementation both ways."""
    if torch.cuda.is_available():
        return  # the GPU run is the example's own (1B-scale layers, 32768 packed tokens)
    pytest.importorskip("transformers")
    out = tmp_path / "packed.json"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_packed_training.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no CUDA GPU" in result.stdout
    assert "q_proj gradient 0.00e+00 apart" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["attention"], r["compiled"]) for r in rows] == [(a, c) for c in (False, True)
                                                               for a in ("no-op", "sdpa", "kernelgen")]


def test_decode_graph_checks_each_step_on_the_cpu():
    """On a CPU the example decodes its tiny ragged cache eagerly in the interpreter (it says so) and checks every
    step against the reference, each row over its own keys."""
    if torch.cuda.is_available():
        return  # the GPU run is the example's own (a 32k cache, CUDA graphs timed)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "decode_graph.py"), "--steps", "2"],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CPU interpreter" in result.stdout and "prompts of [24, 48, 72] keys" in result.stdout
    assert "step 2: lengths [26, 50, 74]" in result.stdout

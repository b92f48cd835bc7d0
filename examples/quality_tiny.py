"""How well kernelgen's selectors keep the attention a model learned densely, at several lengths.

    python examples/quality_tiny.py                 # GPU: trains at N=32768, reports N=4096..32768
    python examples/quality_tiny.py --steps 100 --lengths 4096,16384 --out quality-out

Trains the tiny decoder of examples/train_tiny.py with dense SDPA on its synthetic task (a bigram chain with
spans copied from earlier in the sequence: retrieval that a layer must do by content), then, for each
length, runs the trained model on fresh sequences with `kernelgen.quality.capture_qkv` recording q, k and v
at each attention call, and reports, per selector and top_k, the fraction of the dense softmax mass that
the selected blocks hold (recall) and the relative L2 error of the sparse output against the dense one
(`kernelgen.quality.selection_quality`; the same report as `kernelgen quality`). Writes
quality_N<length>.csv (per layer and head) and, with matplotlib, quality_N<length>.png.

On a CUDA GPU: d_model 256, 4 heads of 64, trained at the longest length, lists of 64-key blocks. On a CPU:
a tiny size (N up to 256, 16-key blocks) and 40 dense steps, to show the script runs end to end; its figures
say little about long contexts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernelgen  # noqa: F401  (sets TRITON_INTERPRET=1 by itself when there is no CUDA device)
from kernelgen import Spec
from kernelgen.quality import capture_qkv, full_coverage_note, plot_recall, selection_quality, summarize, write_csv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny import TinyDecoder, dense_attention, make_batch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="dense training steps (GPU default 200, CPU 40)")
    p.add_argument("--lengths", default=None, help="comma-separated lengths to report (GPU default "
                                                   "4096,8192,16384,32768; CPU 128,256)")
    p.add_argument("--top-k", default=None, help="comma-separated budgets (GPU default 4,8,16,32,64; CPU 2,4,8)")
    p.add_argument("--out", default="quality-tiny-out", help="directory for the CSV and PNG files")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        device, steps, batch, d_model, heads, vocab = torch.device("cuda"), args.steps or 200, 2, 256, 4, 256
        lengths, top_ks, block = [4096, 8192, 16384, 32768], [4, 8, 16, 32, 64], 64
    else:
        device, steps, batch, d_model, heads, vocab = torch.device("cpu"), args.steps or 40, 4, 128, 2, 64
        lengths, top_ks, block = [128, 256], [2, 4, 8], 16
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else lengths
    top_ks = [int(t) for t in args.top_k.split(",")] if args.top_k else top_ks
    n_train = max(lengths)  # learned positions: train at the longest length, report on its prefixes' lengths
    if not on_gpu:
        print(f"No CUDA GPU: a tiny decoder (N up to {n_train}, {steps} steps) to show the script runs end to end; "
              "the long-context figures need the GPU run (N=4096..32768).")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bigram = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 3, dim=-1)
    model = TinyDecoder(vocab, n_train, d_model, heads, 2, dense_attention).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = make_batch(gen, batch, n_train, vocab, bigram, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step == 1 or step % 20 == 0 or step == steps:
            print(f"step {step:4d}  dense loss {loss.item():.4f}", flush=True)
    print(f"trained densely at N={n_train} in {time.perf_counter() - start:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    head_dim = d_model // heads
    for n in lengths:
        tokens = make_batch(gen, 1, n, vocab, bigram, device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            with capture_qkv(model, device=None) as layers:
                model(tokens[:, :-1])
        spec = Spec(head_dim=head_dim, kv_block=block, q_tile=block, causal=True, local=1, sink=1)
        budgets = [t for t in top_ks if t >= spec.n_forced]
        rows = selection_quality(layers, spec, ["mean", "multi:4"], budgets)
        n_blocks = spec.n_kv_blocks(next(iter(layers.values()))["k"].shape[2])  # of the keys attention saw
        print(f"\nN={n} ({n_blocks} KV blocks of {block}; a sink and a local block forced)")
        print(f"{'selector':>9} {'top_k':>5} {'recall mean':>11} {'lowest':>7} {'rel.err mean':>12} {'max':>8}  "
              "lowest recall at")
        for row in summarize(rows):
            print(f"{row['selector']:>9} {row['top_k']:5d} {row['recall_mean']:11.4f} {row['recall_min']:7.4f} "
                  f"{row['rel_error_mean']:12.2e} {row['rel_error_max']:8.2e}  {row['worst']}")
        note = full_coverage_note(budgets, n_blocks)
        if note:  # as `kernelgen quality` says it
            print(note)
        write_csv(rows, os.path.join(args.out, f"quality_N{n}.csv"))
        png = plot_recall(rows, os.path.join(args.out, f"quality_N{n}.png"))
        if png:
            print(f"plot: {png}")
    print(f"\nper layer and head: {args.out}/quality_N*.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

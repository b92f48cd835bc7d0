"""Train a tiny decoder with kernelgen's sparse attention next to the same model on dense SDPA.

    python examples/train_tiny.py              # GPU: 200 steps, N=2048, bf16; CPU: a few steps, tiny, fp32
    python examples/train_tiny.py --steps 400 --out curves.json

The data are made in code: token sequences from a random bigram chain (local structure) into which
spans copied from earlier in the same sequence are pasted (retrieval: the copy's source lies anywhere
before it, so a layer must find it by content). Both models share the initial weights, the data and the
optimizer; only the attention differs: `torch.nn.functional.scaled_dot_product_attention` (dense, causal)
or kernelgen's causal block-sparse attention, whose `mean` selector picks top_k KV blocks per Q tile
(a local block and a sink block forced) and whose backward trains the projections. The selection itself
is not differentiated, as in NSA and DSA. Prints both loss curves side by side and the final gap.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

import kernelgen  # sets TRITON_INTERPRET=1 by itself when there is no CUDA device
from kernelgen import Spec


def make_batch(gen: torch.Generator, batch: int, n: int, vocab: int, bigram: torch.Tensor, device) -> torch.Tensor:
    """[batch, n + 1] tokens: a bigram chain with copied spans pasted in."""
    # The chain is sampled in plain Python (bisect on each row's CDF): one torch call per token would take
    # seconds per batch at N=32768.
    cdf = bigram.double().cumsum(-1).tolist()
    rng = random.Random(int(torch.randint(2**62, (1,), generator=gen)))
    rows = []
    for _ in range(batch):
        token = rng.randrange(vocab)
        row = [token]
        for _ in range(n):
            token = min(bisect.bisect(cdf[token], rng.random()), vocab - 1)
            row.append(token)
        rows.append(row)
    seq = torch.tensor(rows, dtype=torch.long)
    span = max(8, n // 32)
    for b in range(batch):
        for _ in range(4):  # four retrieval spans per sequence
            dst = int(torch.randint(n // 2, n + 1 - span, (1,), generator=gen))
            src = int(torch.randint(0, dst - span, (1,), generator=gen))
            seq[b, dst:dst + span] = seq[b, src:src + span].clone()
    return seq.to(device)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int, n: int, d_model: int, heads: int, layers: int, attention):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(n, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, attention) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def dense_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="training steps (GPU default 200, CPU default 3)")
    p.add_argument("--out", default=None, help="write both loss curves here (JSON)")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        device, dtype, steps = torch.device("cuda"), torch.bfloat16, args.steps or 200
        n, batch, d_model, heads, vocab = 2048, 8, 256, 4, 256
        spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=8, causal=True, selector="mean", local=1, sink=1)
    else:
        device, dtype, steps = torch.device("cpu"), torch.float32, args.steps or 3
        n, batch, d_model, heads, vocab = 128, 2, 128, 2, 64
        spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=True, selector="mean", local=1, sink=1)
        print(f"No CUDA GPU: {steps} steps at a tiny size (N={n}, fp32) in Triton's interpreter, to show the "
              "script runs end to end; the loss figures need the GPU run (200 steps).")
    sparse = kernelgen.get_kernel(spec)
    print(f"kernelgen spec: {spec}; each query tile sees {spec.top_k} of {n // spec.kv_block} blocks")

    def sparse_attention(q, k, v):
        return sparse(q, k, v)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bigram = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 3, dim=-1)
    models = {}
    for name, attention in (("dense SDPA", dense_attention), ("kernelgen sparse", sparse_attention)):
        torch.manual_seed(0)  # the same initial weights
        models[name] = TinyDecoder(vocab, n, d_model, heads, 2, attention).to(device)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for name, m in models.items()}
    curves = {name: [] for name in models}
    print(f"{'step':>5} " + " ".join(f"{name:>17}" for name in models))
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = make_batch(gen, batch, n, vocab, bigram, device)
        for name, model in models.items():
            with torch.autocast(device.type, dtype=dtype, enabled=on_gpu):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            if not math.isfinite(loss.item()):
                raise SystemExit(f"{name}: loss is {loss.item()} at step {step}")
            optims[name].zero_grad(set_to_none=True)
            loss.backward()
            optims[name].step()
            curves[name].append(loss.item())
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"{step:5d} " + " ".join(f"{curves[name][-1]:17.4f}" for name in models), flush=True)
    window = min(10, steps)  # the last steps' mean: one batch's loss is noisy
    final = {name: sum(c[-window:]) / window for name, c in curves.items()}
    gap = final["kernelgen sparse"] / final["dense SDPA"] - 1
    print(f"mean loss over the last {window} steps: dense {final['dense SDPA']:.4f}, sparse "
          f"{final['kernelgen sparse']:.4f} ({gap:+.1%}); {time.perf_counter() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(spec=spec.to_dict(), n=n, steps=steps, curves=curves, final=final, gap=gap), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

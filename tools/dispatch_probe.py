"""Where `attn(q, k, v, block_idx=...)` spends host time beyond its raw launches (GPU host).

On `kernelgen.bench.dispatch_overhead`'s problem (small enough that the GPU waits for the host), times
in alternating rounds (median over rounds, microseconds per call):
  call        the public call
  raw         its two launches as ops.py makes them (normalise the lists, attention)
  checks      ops.check_qkv alone;  lookup: the cached per-bucket lookup alone
  normalise   ops.prepare_block_idx alone;  attention: ops.attention alone
  empty       torch.empty of the output and lse alone (what ops.attention allocates)
  prepared    the public call with lists prepared once (attn.prepare): one launch, compare with attention
then profiles 2000 calls and 2000 raw launches with cProfile (top functions by own time).

    python3 tools/dispatch_probe.py [--out DIR]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernelgen import ops  # noqa: E402
from kernelgen.bench import dispatch_problem  # noqa: E402
from kernelgen.config import seq_bucket  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    spec, q, k, v, idx, attn, shapes, sel_mod, cfg, mod = dispatch_problem()
    bucket, backend = seq_bucket(shapes.n_k), "triton"
    lists = ops.prepare_block_idx(idx, spec, shapes, q.device, sel_mod)
    pieces = {
        "call": lambda: attn(q, k, v, block_idx=idx),
        "raw": lambda: ops.attention(q, k, v, ops.prepare_block_idx(idx, spec, shapes, q.device, sel_mod), spec,
                                     shapes, mod, cfg, None),
        "checks": lambda: ops.check_qkv(q, k, v, spec),
        "lookup": lambda: attn._kernels(bucket, q.dtype, q.device),
        "normalise": lambda: ops.prepare_block_idx(idx, spec, shapes, q.device, sel_mod),
        "attention": lambda: ops.attention(q, k, v, lists, spec, shapes, mod, cfg, None),
        "empty": lambda: (torch.empty(q.shape, device=q.device, dtype=q.dtype),
                          torch.empty(1, 1, 128, device=q.device, dtype=torch.float32)),
        "prepared": lambda: attn(q, k, v, block_idx=prepared),
    }
    prepared = attn.prepare(idx, shapes.n_q, shapes.n_k)

    def timed(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.calls * 1e6

    per_round = {name: [] for name in pieces}
    for _ in range(args.rounds):
        for name, fn in pieces.items():
            per_round[name].append(timed(fn))
    result = {name: statistics.median(ts) for name, ts in per_round.items()}
    result["overhead"] = statistics.median(c - r for c, r in zip(per_round["call"], per_round["raw"]))
    result["prepared_overhead"] = statistics.median(c - r for c, r in zip(per_round["prepared"], per_round["attention"]))
    print(f"backend {backend}; us per call (median of {args.rounds} alternating rounds):")
    for name, us in result.items():
        print(f"  {name:10s} {us:7.1f}")
    profiles = {}
    for name in ("call", "raw"):
        prof = cProfile.Profile()
        fn = pieces[name]
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        profiles[name] = text.getvalue()
        print(f"== cProfile of 2000 x {name} (by own time)\n" + "\n".join(profiles[name].splitlines()[:40]))
    if args.out:
        with open(os.path.join(args.out, "dispatch_probe.json"), "w") as f:
            json.dump({"us": result, "per_round": per_round, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()

"""Maintainers: measure which backend's *default* attention config is fastest, per head_dim, block size,
causality and density, on this GPU. Its table is the evidence behind `kernelgen.tuning.rule` (the backend
`auto` serves where nothing is tuned); docs/DESIGN.md quotes it.

    python tools/backend_rule.py [--seq 16384] [--heads 16] [--out rule.json]

Each spec is timed with each backend's default config pinned (never a tuned winner), over lists chosen
by the `mean` selector (sparse: top_k=16) or every block (dense), bf16, B=1, G=1.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import triton.testing

import kernelgen
from kernelgen import backends
from kernelgen.device import current_arch, gpu_name
from kernelgen.roles import get_role
from kernelgen.tuning.worker import precompile
from kernelgen.workloads import useful_flops


def grid(seq: int):
    for head_dim, block, causal, dense in itertools.product((64, 128), (64, 128), (False, True), (False, True)):
        top_k = seq // block if dense else 16
        yield kernelgen.Spec(head_dim=head_dim, kv_block=block, q_tile=block, top_k=top_k, causal=causal,
                             gqa_group=1, selector="given"), dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("backend_rule: needs a CUDA GPU")
    device, dtype, n = torch.device("cuda"), torch.bfloat16, args.seq
    arch = current_arch()
    cases = []
    for spec, dense in grid(n):
        for backend in backends.all_backends():
            if "attn" not in backend.roles or backend.unsupported(spec.replace(backend=backend.name), device):
                continue
            kernel_spec = get_role("attn").kernel_spec(spec.replace(backend=backend.name), backend.name)
            cases.append((spec, dense, backend, kernel_spec, backend.default_config(kernel_spec, "attn")))
    jobs = [(b.name, ks.to_json(), "attn", b.config_to_dict(cfg), [(1, args.heads, n, n)], "bfloat16", "cuda")
            for _, _, b, ks, cfg in cases if b.per_shape]
    seconds, errors = precompile(jobs)
    print(f"precompiled {len(jobs)} per-shape kernels in {seconds:.0f} s; failed: {errors}", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, n, 128, device=device, dtype=dtype, generator=gen) for _ in range(3))
    rows = []
    for spec, dense, backend, kernel_spec, cfg in cases:
        d = spec.head_dim
        qd, kd, vd = q[..., :d].contiguous(), k[..., :d].contiguous(), v[..., :d].contiguous()
        if dense:
            tiles = spec.n_q_tiles(n)
            idx = torch.arange(spec.top_k, device=device, dtype=torch.int32).expand(1, args.heads, tiles, -1).contiguous()
        else:
            idx = kernelgen.get_kernel(spec.replace(selector="mean")).select(qd, kd)
        attn = kernelgen.get_kernel(spec.replace(backend=backend.name), configs={"attn": cfg})
        lists = attn.prepare(idx, n, n)
        t0 = time.perf_counter()
        try:
            ms = triton.testing.do_bench(lambda: attn(qd, kd, vd, block_idx=lists), warmup=10, rep=50,
                                         return_mode="median")
        except Exception as error:  # report, never hide
            print(f"{backend.name} {kernel_spec}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        tflops = useful_flops(idx, spec, n, n) / ms / 1e9
        row = dict(head_dim=d, block=spec.kv_block, causal=spec.causal, dense=dense, top_k=spec.top_k,
                   backend=backend.name, config=backend.config_to_dict(cfg), ms=ms, tflops=tflops)
        rows.append(row)
        print(f"D{d:<3} blk{spec.kv_block:<3} causal={int(spec.causal)} dense={int(dense)} {backend.name:8s} "
              f"{ms:8.3f} ms {tflops:6.1f} TFLOP/s  [{time.perf_counter() - t0:.0f} s]", flush=True)
    best = {}
    for row in rows:
        key = (row["head_dim"], row["block"], row["causal"], row["dense"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    print("fastest default per (head_dim, block, causal, dense):")
    for key, row in sorted(best.items()):
        print(f"  {key}: {row['backend']}")
    result = dict(arch=arch, gpu=gpu_name(device), seq=n, heads=args.heads, torch=torch.__version__,
                  triton=triton.__version__, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Maintainers: the KV-centric backward's configs (`kv_bwd`) on the KV-centric bench shapes.

    python tools/kv_bwd_sweep.py kv_nsa32k [--budget 280]   # one CUDA GPU; OUT=DIR for kv_bwd_sweep.json
    python tools/kv_bwd_sweep.py kv_nsa32k --ptxas          # no GPU: what each config compiles to on sm_90

On the GPU, for each named shape of `kernelgen.workloads.KV_CENTRIC_SHAPES` (bf16, its random per-query lists
prepared once, one forward): the backward alone (`torch.autograd.grad` of the forward's output; `kv_bwd_dkdv`,
its dQ merge and `bwd_delta`) at each feasible config of block_n 64/32, block_m 64/128/32, 8/4 warps, 2/3/1
stages (bf16 dQ partials), `do_bench` median, until `--budget` seconds have passed.

With --ptxas, each config's `kv_bwd_dkdv` is compiled for sm_90 through the real launch path
(tools/offline_compile.py, with the shape's spec at 4096 tokens) and the table gives its wgmma products,
registers, spill stores and shared memory: what decides how many programs share an SM.
"""
import argparse
import itertools
import json
import os
import sys
import time

from kernelgen import KvBwdConfig
from kernelgen.backends.triton import kv_bwd_infeasible
from kernelgen.workloads import KV_CENTRIC_SHAPES

CONFIGS = [KvBwdConfig(block_n=n, block_m=m, num_warps=w, num_stages=s)
           for n, m, w, s in itertools.product((64, 32), (64, 128, 32), (8, 4), (2, 3, 1))]


def feasible(spec):
    return [cfg for cfg in CONFIGS if kv_bwd_infeasible(spec, cfg, "sm_90") is None]


def sweep(name: str, budget: float, t0: float) -> list[dict]:
    import torch
    import triton.testing

    from kernelgen import get_kernel

    shape = KV_CENTRIC_SHAPES[name]
    given = shape.spec("given")
    q, k, v = (x.requires_grad_() for x in shape.inputs(torch.device("cuda"), torch.bfloat16))
    lists = shape.query_lists("cuda")
    grad = torch.randn_like(q)
    rows = []
    for cfg in feasible(given):
        if time.time() - t0 > budget:
            print("budget reached")
            break
        attn = get_kernel(given, configs={"kv_bwd": cfg})
        prep = attn.prepare(lists, shape.n_q, shape.n_k)
        o = attn(q, k, v, block_idx=prep)
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(o, (q, k, v), grad, retain_graph=True),
                                     warmup=5, rep=30, return_mode="median")
        rows.append(dict(shape=name, config=json.loads(cfg.to_json()), ms=ms))
        print(f"{name} block_n {cfg.block_n:3d} block_m {cfg.block_m:3d} warps {cfg.num_warps} "
              f"stages {cfg.num_stages}: {ms:.3f} ms", flush=True)
    best = min(rows, key=lambda r: r["ms"])
    print(f"{name} fastest: {best['ms']:.3f} ms {best['config']}")
    return rows


def ptxas(name: str) -> None:
    from offline_compile import compile_offline  # this directory's

    given = KV_CENTRIC_SHAPES[name].spec("given")
    configs = feasible(given)
    cases = [{"spec": given.to_dict(), "n": 4096, "kv_bwd": json.loads(cfg.to_json()), "resources": True}
             for cfg in configs]
    print(f"{name}: block_n block_m warps stages | wgmma registers spill-stores shared")
    for cfg, result in zip(configs, compile_offline(cases, "sm_90", processes=os.cpu_count() or 1)):
        if "error" in result:
            print(f"  {cfg}: {result['error'].strip()}")
            continue
        (used,) = [r for r in result["resources"] if r["name"] == "kv_bwd_dkdv"]
        shared = dict(result["kernels"])["kv_bwd_dkdv"]
        print(f"  {cfg.block_n:3d} {cfg.block_m:3d} {cfg.num_warps} {cfg.num_stages} | "
              f"{used['wgmma']:5d} {used['registers']:9d} {used['spill_stores']:12d} {shared:6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", help=f"comma-separated, of {list(KV_CENTRIC_SHAPES)}")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds of measuring, all shapes together")
    parser.add_argument("--ptxas", action="store_true", help="compile for sm_90 and report, no GPU")
    args = parser.parse_args()
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in KV_CENTRIC_SHAPES]
    if unknown:
        sys.exit(f"unknown shape(s) {unknown}; expected some of {list(KV_CENTRIC_SHAPES)}")
    if args.ptxas:
        for name in names:
            ptxas(name)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("kv_bwd_sweep.py times kernels: it needs a CUDA GPU (--ptxas compiles for sm_90 without one)")
    t0, rows = time.time(), []
    for name in names:
        rows += sweep(name, args.budget, t0)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "kv_bwd_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

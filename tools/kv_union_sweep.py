"""Maintainers: the KV-centric schedule's two forward designs on one CUDA GPU, as the lists' agreement varies.

    python tools/kv_union_sweep.py [SHAPE ...]     # OUT=DIR for kv_union_sweep.json (default /tmp)
    python tools/kv_union_sweep.py --backward [SHAPE ...]
    python tools/kv_union_sweep.py --kernels [SHAPE ...]

For each shape of `kernelgen.workloads.KV_CENTRIC_SHAPES` (default: all; bf16) and each kind of per-query
lists (`random_query_lists`, and `agreeing_query_lists` with own = 0, 2, 4, 8 blocks per query), prints:
- the gathered design (`kv_attn`, its served config), lists prepared once, `do_bench` median;
- the union design (`kv_attn_union`) at each config of a small grid (tile_q 1-16, the rows that hold
  whole queries, 4/8 warps, 1/2 stages), with its inflation (products computed over those the lists hold);
- the fastest union config, and its time over the gathered design's.
`kv_union_default` and `tile_union.union_max_inflation` are set from this sweep (docs/DESIGN.md).
With --backward, on random lists and agreeing ones (own = 2): forward+backward with the gathered design's
backward (kv_bwd) and with the union design's (kv_bwd_union) at a grid of its configs, the union forward's
default config, `do_bench` median of a forward and `o.backward(do)`.
With --kernels, on agreeing lists (own = 2): each kernel's CUDA time (torch profiler, the mean of 3
forward+backward steps) with the union forward's served config and the union backward's served dQ, at a grid
of dK/dV configs (keys x rows a step, warps, stages, use_tma), with every kernel's use_tma set alike.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch
import triton.testing

from kernelgen import KvUnionBwdConfig, KvUnionConfig, get_kernel
from kernelgen.backends.triton import kv_union_bwd_infeasible, kv_union_infeasible
from kernelgen.tile_union import build_tile_union
from kernelgen.workloads import KV_CENTRIC_SHAPES, agreeing_query_lists, random_query_lists


def bench(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def grid(spec):
    for tile_q in (1, 2, 4, 8, 16):
        for block_m in sorted({min(64, spec.gqa_group * tile_q), 64, 128}):
            for warps in (4, 8):
                for stages in (1, 2):
                    cfg = KvUnionConfig(tile_q=tile_q, block_m=block_m, num_warps=warps, num_stages=stages)
                    if kv_union_infeasible(spec, cfg, "sm_90") is None:
                        yield cfg


def backward_grid(spec):
    for dq in ((64, 4, 2), (64, 8, 2)):
        for block_n, block_m, warps in ((64, 32, 4), (64, 64, 4), (64, 64, 8), (32, 64, 4), (32, 32, 4), (64, 16, 4)):
            cfg = KvUnionBwdConfig(tile_q=4, dq_block_m=dq[0], dq_warps=dq[1], dq_stages=dq[2], block_n=block_n,
                                   block_m=block_m, num_warps=warps, num_stages=2)
            if kv_union_bwd_infeasible(spec, cfg, "sm_90") is None:
                yield cfg


def backward_inputs(name):
    """A shape's spec (given lists), q, k and v as leaves, and do: bf16 on the GPU."""
    shape = KV_CENTRIC_SHAPES[name]
    leaves = [x.requires_grad_() for x in shape.inputs(torch.device("cuda"), torch.bfloat16)]
    return shape, shape.spec("given"), leaves, torch.randn_like(leaves[0])


def sweep_backward(names, out):
    rows = []
    for name in names:
        shape, spec, leaves, do = backward_inputs(name)
        kinds = {"random": random_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k),
                 "agree2": agreeing_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k, 2)}
        for kind, lists in kinds.items():
            timings = {}
            gathered = get_kernel(spec, configs={"kv_attn": get_kernel(spec).config("kv_attn", shape.n_q, shape.n_k)})
            union_fwd = {"kv_attn_union": get_kernel(spec).config("kv_attn_union", shape.n_q, shape.n_k)}
            for label, attn in [("gathered fwd+bwd", gathered)] + [
                    (cfg.to_json(), get_kernel(spec, configs={**union_fwd, "kv_bwd_union": cfg}))
                    for cfg in backward_grid(spec)]:
                prepared = attn.prepare(lists, shape.n_q, shape.n_k)
                try:
                    ms = triton.testing.do_bench(lambda: attn(*leaves, block_idx=prepared).backward(do), warmup=10,
                                                 rep=60, return_mode="median", grad_to_none=leaves)
                except Exception as e:  # a config the compiler refuses: reported, the sweep goes on
                    print(name, kind, label, "failed", type(e).__name__, str(e)[:160], flush=True)
                    continue
                timings[label] = ms
                rows.append(dict(shape=name, lists=kind, backward=label, fwd_bwd_ms=ms))
            best = min((v, k) for k, v in timings.items() if k != "gathered fwd+bwd")
            print(f"{name:10s} {kind:7s} gathered fwd+bwd {timings['gathered fwd+bwd']:.3f} ms | union fwd+bwd best "
                  f"{best[0]:.3f} ms {best[1]}", flush=True)
        json.dump(rows, open(f"{out}/kv_union_backward.json", "w"), indent=1)


def kernel_ms(attn, leaves, lists, do) -> dict:
    """Each kernel's CUDA time (ms) in one forward+backward step, averaged over 3 profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        for x in leaves:
            x.grad = None
        attn(*leaves, block_idx=lists).backward(do)

    step(), step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return {e.key[:32]: round(e.device_time_total / 3e3, 3) for e in prof.key_averages() if e.device_time_total > 20}


def sweep_kernels(names, out):
    rows = []
    for name in names:
        shape, spec, leaves, do = backward_inputs(name)
        lists = agreeing_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k, 2)
        served = get_kernel(spec)
        fwd = served.config("kv_attn_union", shape.n_q, shape.n_k)
        bwd = served.config("kv_bwd_union", shape.n_q, shape.n_k)
        for block_n, block_m, warps, stages, tma in ((64, 64, 4, 2, False), (64, 64, 4, 2, True), (64, 64, 4, 3, True),
                                                     (64, 32, 4, 2, True), (64, 64, 8, 2, True), (32, 64, 4, 2, True),
                                                     (32, 32, 4, 2, True)):
            # tma: every kernel's loads through tensor descriptors (the forward's and dQ's K and V too)
            cfg = KvUnionBwdConfig(tile_q=fwd.tile_q, dq_block_m=bwd.dq_block_m, dq_warps=bwd.dq_warps,
                                   dq_stages=bwd.dq_stages, dq_use_tma=tma, block_n=block_n, block_m=block_m,
                                   num_warps=warps, num_stages=stages, use_tma=tma)
            if kv_union_bwd_infeasible(spec, cfg, "sm_90") is not None:
                continue
            attn = get_kernel(spec, configs={"kv_attn_union": dataclasses.replace(fwd, use_tma=tma),
                                             "kv_bwd_union": cfg})
            ms = kernel_ms(attn, leaves, attn.prepare(lists, shape.n_q, shape.n_k), do)
            rows.append(dict(shape=name, dkdv=[block_n, block_m, warps, stages, tma], kernels=ms))
            print(f"{name:10s} dK/dV {block_n} x {block_m}, {warps} warps, {stages} stages, tma {tma:d}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ms.items() if "union" in k), flush=True)
        del leaves, do, lists
        torch.cuda.empty_cache()
        json.dump(rows, open(f"{out}/kv_union_kernels.json", "w"), indent=1)


def sweep_forward(names, out):
    rows = []
    for name in names:
        shape = KV_CENTRIC_SHAPES[name]
        spec = shape.spec("given")
        q, k, v = shape.inputs(torch.device("cuda"), torch.bfloat16)
        kinds = {"random": random_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k)}
        for own in (0, 2, 4, 8):
            kinds[f"agree{own}"] = agreeing_query_lists(spec, shape.batch, shape.heads_kv, shape.n_q, shape.n_k, own)
        configs = list(grid(spec))
        for kind, lists in kinds.items():
            gathered_cfg = get_kernel(spec).config("kv_attn", shape.n_q, shape.n_k)
            gathered_attn = get_kernel(spec, configs={"kv_attn": gathered_cfg})
            prepared = gathered_attn.prepare(lists, shape.n_q, shape.n_k)
            gathered = bench(lambda: gathered_attn(q, k, v, block_idx=prepared))
            ref = gathered_attn(q, k, v, block_idx=prepared)
            rows.append(dict(shape=name, lists=kind, design="gathered", ms=gathered))
            n_blocks = spec.n_kv_blocks(shape.n_k)
            inflation = {t: build_tile_union(prepared.block_idx, t, n_blocks).inflation(prepared.block_idx)
                         for t in (1, 2, 4, 8, 16)}
            best = None
            for cfg in configs:
                try:
                    attn = get_kernel(spec, configs={"kv_attn_union": cfg})
                    union_lists = attn.prepare(lists, shape.n_q, shape.n_k)
                    ms = bench(lambda: attn(q, k, v, block_idx=union_lists))
                    union_out = attn(q, k, v, block_idx=union_lists).float()
                    diff = ((union_out - ref.float()).norm() / ref.float().norm()).item()
                except Exception as e:  # a config the compiler refuses: reported, the sweep goes on
                    print(name, kind, cfg, "failed", type(e).__name__, str(e)[:160], flush=True)
                    continue
                rows.append(dict(shape=name, lists=kind, design="union", config=cfg.to_json(), ms=ms,
                                 inflation=inflation[cfg.tile_q], rel_diff=diff))
                if best is None or ms < best[0]:
                    best = (ms, cfg, diff)
            print(f"{name:10s} {kind:7s} inflation " + " ".join(f"{t}:{x:.2f}" for t, x in inflation.items())
                  + f" | gathered {gathered:.3f} ms | union best {best[0]:.3f} ms ({best[0] / gathered:.2f}x) "
                  f"{best[1].to_json()} diff {best[2]:.1e}", flush=True)
        del q, k, v, kinds
        torch.cuda.empty_cache()
        json.dump(rows, open(f"{out}/kv_union_sweep.json", "w"), indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", metavar="SHAPE", help=f"of {list(KV_CENTRIC_SHAPES)} (default: all)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backward", action="store_true", help="forward+backward: the two designs' backwards")
    which.add_argument("--kernels", action="store_true", help="each kernel's CUDA time at a grid of dK/dV configs")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes if name not in KV_CENTRIC_SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; expected some of {list(KV_CENTRIC_SHAPES)}")
    if not torch.cuda.is_available():
        sys.exit("kv_union_sweep.py times kernels: it needs a CUDA GPU")
    sweep = sweep_backward if args.backward else sweep_kernels if args.kernels else sweep_forward
    sweep(args.shapes or list(KV_CENTRIC_SHAPES), os.environ.get("OUT", "/tmp"))


if __name__ == "__main__":
    main()

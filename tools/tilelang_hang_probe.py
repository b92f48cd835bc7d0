"""H200 probe behind docs/PERF.md session 7 (calls 5 and 6): the a32k TileLang forward with one consumer
warpgroup (block_M 64, 128 threads, no overlap), built with or without nvcc's fast math, called once,
then 300 times, then timed by do_bench, then (--graph) replayed from a CUDA graph by do_bench_cudagraph
(where session 8's bench hung with the precise build). --no-ws builds it without TileLang's warp
specialisation (no producer warpgroup: cp.async pipelining). Run it under `timeout`: a build that hangs
never returns.

    timeout 40 python3 tools/tilelang_hang_probe.py precise [--stages 2] [--n 32768] [--graph] [--no-ws]
    timeout 30 python3 tools/tilelang_hang_probe.py fast

--case NAME --config JSON (session 10) runs instead a tools/tilelang_probe.py case (its inputs and lists)
with a product config, built as the product builds it (fast math, warp-specialised at 256 threads).
"""
import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kernelgen  # noqa: E402
from kernelgen import ops, tilelang_backend  # noqa: E402
from kernelgen.config import TileLangAttnConfig  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("build", choices=["fast", "precise"])
p.add_argument("--stages", type=int, default=2)
p.add_argument("--n", type=int, default=32768)
p.add_argument("--graph", action="store_true")
p.add_argument("--no-ws", action="store_true")
p.add_argument("--case", default=None, help="a tools/tilelang_probe.py case (then --config is the product config)")
p.add_argument("--config", default=None, help="TileLangAttnConfig fields as JSON, with --case")
args = p.parse_args()
t0 = time.perf_counter()
if args.case:
    import json
    import math

    sys.path.insert(0, os.path.dirname(__file__))
    import tilelang_probe

    shape = tilelang_probe.CASES[args.case]
    cfg = TileLangAttnConfig(**json.loads(args.config))
    q, k, v = shape.inputs("cuda", torch.bfloat16, seed=1)
    idx = tilelang_probe.lists(shape, tilelang_probe.spec_of(shape), "cuda")
    kernel = tilelang_probe.build(args.case, cfg, None)
    print(f"[{time.perf_counter() - t0:.1f}s] {args.case} {cfg} built", flush=True)
    scale = 1.0 / math.sqrt(shape.head_dim)
    for n in (1, 20):
        for _ in range(n):
            o = kernel(q, k, v, idx, scale)[0]
        torch.cuda.synchronize()
        print(f"[{time.perf_counter() - t0:.1f}s] {n} calls ok, nan={o.isnan().any().item()}", flush=True)
    print(f"do_bench {triton.testing.do_bench(lambda: kernel(q, k, v, idx, scale), return_mode='median'):.3f} ms "
          f"[{time.perf_counter() - t0:.1f}s]", flush=True)
    sys.exit(0)
spec = kernelgen.Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, causal=False, gqa_group=1, selector="given",
                      backend="tilelang")
n_tiles = args.n // 64
q, k, v = (torch.randn(1, 8, args.n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
idx = torch.stack([torch.randperm(n_tiles, device="cuda")[:16] for _ in range(8 * n_tiles)]).view(1, 8, n_tiles, 16).int()
# built here, not through get_kernel: the space no longer holds the warp-specialised or multi-stage
# one-warpgroup builds this probe compares (tilelang_backend.attn_pass_configs)
cfg = TileLangAttnConfig(64, args.stages, 128, False)
func = tilelang_backend.build_attn(spec, torch.bfloat16, batch=1, heads_kv=8, seq_q=args.n, seq_k=args.n, config=cfg)
kernel = tilelang_backend.compile_kernel(func, pass_configs={"tl.enable_fast_math": args.build == "fast",
                                                             "tl.disable_warp_specialized": args.no_ws})


def call():
    return ops.attention_tilelang(q, k, v, idx, spec, kernel, None)[0]


o = call()
torch.cuda.synchronize()
print(f"[{time.perf_counter() - t0:.1f}s] first call ok, nan={o.isnan().any().item()}", flush=True)
for _ in range(300):
    call()
torch.cuda.synchronize()
print(f"[{time.perf_counter() - t0:.1f}s] 300 calls ok", flush=True)
print(f"do_bench {triton.testing.do_bench(call, return_mode='median'):.3f} ms [{time.perf_counter() - t0:.1f}s]", flush=True)
if args.graph:
    print(f"do_bench_cudagraph {triton.testing.do_bench_cudagraph(call):.3f} ms [{time.perf_counter() - t0:.1f}s]",
          flush=True)

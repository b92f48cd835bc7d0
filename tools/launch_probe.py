"""Where a forward's time goes on the host and on the GPU (H200): per backend on a benchmark shape,
  host_us     host time per eager call (perf_counter over calls that do not wait for the GPU),
  graph_ms    GPU time per call, replaying the calls captured in a CUDA graph (no host in the loop),
  stream_ms   back-to-back eager calls between two events, per call,
  do_bench_ms triton.testing.do_bench's median (it clears L2 with a 256 MB memset before each call),
plus, for Gluon, the host cost of the launch's pieces.

    python3 tools/launch_probe.py [--shapes a32k,b] [--backends triton,gluon,tilelang] [--out DIR]
"""
import argparse
import json
import os
import sys
import time
import timeit

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kernelgen  # noqa: E402
from kernelgen import ops  # noqa: E402
from kernelgen.config import seq_bucket  # noqa: E402
from kernelgen.bench import SHAPES  # noqa: E402


def per_call_us(fn, number=200):
    return timeit.timeit(fn, number=number) / number * 1e6


def measure(shape_name, backend):
    shape = SHAPES[shape_name]
    q, k, v = shape.inputs("cuda", torch.bfloat16)
    idx = kernelgen.get_kernel(shape.spec("mean")).select(q, k)
    attn = kernelgen.get_kernel(shape.spec("given").replace(backend=backend))
    fn = lambda: attn(q, k, v, block_idx=idx)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n = 30  # few enough that the launch queue never fills: the loop's wall time is host time
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    stream_ms = start.elapsed_time(end) / n
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(graph, stream=s):
            for _ in range(10):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    graph_ms = start.elapsed_time(end) / 50
    row = dict(shape=shape_name, backend=backend, host_us=host_us, graph_ms=graph_ms, stream_ms=stream_ms,
               do_bench_ms=triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
               config=attn.config("attn", shape.n_q, shape.n_k).to_json())
    if backend == "gluon":  # the pieces of the launch
        spec = attn.spec
        descriptor, layout = ops._gluon_kv_descriptor(spec.kv_block, spec.head_dim, q.dtype)
        rows = ops._tma_rows(k)
        make = lambda: descriptor(rows, list(rows.shape), list(rows.stride()), [spec.kv_block, spec.head_dim], layout)  # noqa: E731
        row["descriptor_us"] = per_call_us(make)
        shapes = ops.check_qkv(q, k, v, spec)
        select_mod, _, _, cfg, mod = attn._kernels(seq_bucket(shape.n_k), q.dtype, q.device)
        row["prepare_block_idx_us"] = per_call_us(lambda: ops.prepare_block_idx(idx, spec, shapes, q.device, select_mod), 50)
        norm = ops.prepare_block_idx(idx, spec, shapes, q.device, select_mod)
        raw = lambda: ops.attention_gluon(q, k, v, norm, spec, shapes, mod, cfg, None)  # noqa: E731
        row["attention_gluon_host_us"] = per_call_us(raw, 30)
        torch.cuda.synchronize()
        row["attention_gluon_do_bench_ms"] = triton.testing.do_bench(raw, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="a32k")
    p.add_argument("--backends", default="triton,gluon")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for name in a.shapes.split(","):
        for backend in a.backends.split(","):
            try:
                rows.append(measure(name, backend))
            except Exception as error:  # noqa: BLE001 (a row, not the end of the probe)
                print(f"{name} {backend}: {type(error).__name__}: {str(error)[:300]}", flush=True)
    if a.out:
        with open(os.path.join(a.out, "launch_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

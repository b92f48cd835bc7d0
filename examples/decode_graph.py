"""Decoding a batch of sequences of different lengths from one preallocated KV cache, a CUDA graph a step.

    python examples/decode_graph.py                 # GPU: B8 Hq32 Hkv8 D128, a 32k cache, bf16, graphs timed
                                                    # CPU: Triton interpreter, a tiny cache, checks only
    python examples/decode_graph.py --capacity 131072 --batch 2 --steps 64

Serving engines keep one KV cache buffer per layer, its rows filled to different lengths, and replay each
decode step from a CUDA graph so that the host's launch cost disappears. kernelgen's decode takes the lengths
as a device tensor (`cache_seqlens=`), so one captured step serves every later one:

    reps = attn.key_reps(k_cache, cache_seqlens=lens)              # the selector's block means, once
    with torch.cuda.graph(graph):                                   # one step
        o = attn(q, k_cache, v_cache, cache_seqlens=lens, key_reps=reps,  # writes k_new, v_new at lens[b], then
                 k_new=k_new, v_new=v_new)                          # grows reps and attends over lens + 1 keys
        lens += 1

Each step's output is checked against the float64 reference (`kernelgen.reference`, each row over its own keys).
On a GPU the step is timed replayed from the graph and called eagerly, next to dense SDPA over the same cache
with a mask of the lengths (SDPA's way to take rows of different lengths), also replayed from a graph.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kernelgen  # sets TRITON_INTERPRET=1 by itself when there is no CUDA device
from kernelgen import Spec, reference

REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}  # as tests/checks.py


def make_cache(batch, heads_kv, capacity, head_dim, dtype, device, seed=0):
    """K and V caches of `capacity` keys a row, and the rows' prompt lengths: from a quarter to three quarters
    of the capacity, each row its own."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, heads_kv, capacity, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    lengths = torch.linspace(capacity // 4, (3 * capacity) // 4, batch).round().to(torch.int32)
    return k, v, lengths.to(device)


class DecodeStep:
    """One decode step over the cache: append this step's key and value to every row, grow the kept reps,
    attend. Its tensors are fixed buffers, so a CUDA graph of `__call__` replays it for every later step."""

    def __init__(self, spec: Spec, k_cache, v_cache, lens, heads_q: int):
        self.attn = kernelgen.get_kernel(spec)
        self.k_cache, self.v_cache, self.lens = k_cache, v_cache, lens
        batch, heads_kv, _, head_dim = k_cache.shape
        self.q = torch.empty(batch, heads_q, 1, head_dim, device=k_cache.device, dtype=k_cache.dtype)
        self.k_new, self.v_new = (torch.empty(batch, heads_kv, 1, head_dim, device=k_cache.device,
                                              dtype=k_cache.dtype) for _ in range(2))
        self.reps = self.attn.key_reps(k_cache, cache_seqlens=lens)

    def fill(self, gen: torch.Generator) -> None:
        """This step's query, key and value (a model's projections would write them here)."""
        for x in (self.q, self.k_new, self.v_new):
            x.copy_(torch.randn(x.shape, generator=gen))

    def __call__(self) -> torch.Tensor:
        o = self.attn(self.q, self.k_cache, self.v_cache, cache_seqlens=self.lens, key_reps=self.reps,
                      k_new=self.k_new, v_new=self.v_new)  # the call writes them at each row's length first
        self.lens += 1
        return o


def check(step: DecodeStep, o: torch.Tensor, spec: Spec, heads_kv_checked: int = 1) -> float:
    """Relative L2 error of o against the float64 reference over the lists the step selects (each row over its
    own keys), on the first KV heads' query heads."""
    lists = step.attn.select(step.q, step.k_cache, cache_seqlens=step.lens, key_reps=step.reps)
    hq = heads_kv_checked * spec.gqa_group
    ref, _, _ = reference.sparse_attention(step.q[:, :hq], step.k_cache[:, :heads_kv_checked],
                                           step.v_cache[:, :heads_kv_checked], spec.replace(selector="given"),
                                           block_idx=lists[:, :heads_kv_checked], cache_seqlens=step.lens)
    return ((o[:, :hq].double() - ref).norm() / ref.norm()).item()


def graph_of(fn):
    """A CUDA graph of fn() after two warm-up calls on a side stream, and its output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def median_us(fn, steps: int) -> float:
    """Median µs of fn() over `steps` calls, each timed by CUDA events."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=None, help="rows (GPU default 8, CPU 3)")
    p.add_argument("--capacity", type=int, default=None, help="keys a row of the cache holds (GPU 32768, CPU 96)")
    p.add_argument("--steps", type=int, default=None, help="decode steps (GPU 64, CPU 3)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if gpu:
        spec = Spec(head_dim=128, kv_block=128, q_tile=64, top_k=16, causal=True, gqa_group=4, sink=1, local=2)
        batch, capacity, steps, heads_kv, dtype = args.batch or 8, args.capacity or 32768, args.steps or 64, 8, \
            torch.bfloat16
    else:
        spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=3, causal=True, gqa_group=2, sink=1, local=1)
        batch, capacity, steps, heads_kv, dtype = args.batch or 3, args.capacity or 96, args.steps or 3, 2, \
            torch.float16
        print("no CUDA device: Triton's CPU interpreter at a tiny size, eager steps (no CUDA graph), checks only")
    device = "cuda" if gpu else "cpu"
    k_cache, v_cache, lens = make_cache(batch, heads_kv, capacity, spec.head_dim, dtype, device)
    appended = 2 * steps + 8  # the GPU run's warm-up, checked, graphed and eager steps
    if int(lens.max()) + appended > capacity:
        sys.exit(f"--capacity {capacity} leaves no room for {appended} keys after prompts of up to {int(lens.max())}")
    print(f"B{batch} Hq{heads_kv * spec.gqa_group} Hkv{heads_kv} D{spec.head_dim}, cache of {capacity} keys a row, "
          f"prompts of {lens.tolist()} keys; top-{spec.top_k} of {spec.kv_block}-key blocks, {dtype}")
    step = DecodeStep(spec, k_cache, v_cache, lens, heads_kv * spec.gqa_group)
    gen = torch.Generator().manual_seed(1)
    step.fill(gen)
    if not gpu:
        for i in range(steps):
            step.fill(gen)
            err = check(step, step(), spec)
            print(f"step {i + 1}: lengths {lens.tolist()}, rel. L2 error against the reference {err:.1e}")
            assert err < REL_TOL[dtype], err
        return 0

    graph, o = graph_of(step)  # the warm-up and capture ran three steps' appends: the lengths moved on
    for i in range(3):
        step.fill(gen)
        graph.replay()
        err = check(step, o, spec)
        assert err < REL_TOL[dtype], f"step {i}: rel. L2 error {err:.1e}"
    print(f"replayed steps match the reference: rel. L2 error {err:.1e} (lengths now {lens.tolist()})")
    graphed = median_us(graph.replay, steps)
    eager = median_us(step, steps)

    def dense():  # SDPA over the whole cache, the rows' lengths as a boolean mask
        visible = torch.arange(capacity, device=device)[None, :] < step.lens[:, None]
        return torch.nn.functional.scaled_dot_product_attention(step.q, k_cache, v_cache,
                                                                attn_mask=visible[:, None, None, :],
                                                                enable_gqa=True)

    dense_graph, _ = graph_of(dense)
    dense_us = median_us(dense_graph.replay, steps)
    print(f"a decode step (append, reps grown, select, attend), median of {steps}: {graphed:.1f} µs replayed from "
          f"a CUDA graph, {eager:.1f} µs called eagerly; dense SDPA over the cache with a length mask, replayed: "
          f"{dense_us:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

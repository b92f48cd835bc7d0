"""Maintainers: sweep the KV-centric forward's configs on the KV-centric bench shapes, on one CUDA GPU.

    python tools/kv_attn_sweep.py            # OUT=DIR for kv_sweep.json (default /tmp)

For each shape of `kernelgen.workloads.KV_CENTRIC_SHAPES` (bf16, its random per-query lists prepared once):
- the copy floor of the partials: one bf16 tensor of their size, [B, Hq, Nq, top_k, D], copied (written
  and read once, as the forward writes them and the combine reads them);
- the forward (`kv_attn`: partials and combine) at each of 108 configs (block_m 64/128/256, steps 1/4/16,
  4/8 warps, 1-3 stages; bf16 partials), `do_bench` median (10 ms warm-up, 40 ms of repeats);
- the fastest config's two kernels, under torch.profiler.
`kv_attn_default` takes its preference order from this sweep.
"""
import argparse
import itertools
import json
import os
import sys

import torch
import triton.testing

from kernelgen import KvAttnConfig, get_kernel
from kernelgen.workloads import KV_CENTRIC_SHAPES
from kernelgen.backends.triton import kv_attn_infeasible


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no arguments: --help, or a usage error
    if not torch.cuda.is_available():
        sys.exit("kv_attn_sweep.py times kernels: it needs a CUDA GPU")
    sweep(os.environ.get("OUT", "/tmp"))


def sweep(out) -> None:
    rows = []
    for name, shape in KV_CENTRIC_SHAPES.items():
        given = shape.spec("given")
        q, k, v = shape.inputs(torch.device("cuda"), torch.bfloat16)
        lists = shape.query_lists("cuda")
        # floor: write + read the partials once (bf16), i.e. a copy of a tensor of their size
        part = torch.empty(shape.batch, shape.heads_q, shape.n_q, given.top_k, given.head_dim, device="cuda",
                           dtype=torch.bfloat16)
        other = torch.empty_like(part)
        floor = triton.testing.do_bench(lambda: other.copy_(part), return_mode="median")
        print(f"{name} partials copy floor (bf16, {part.numel()*2/1e9:.2f} GB each way): {floor:.3f} ms", flush=True)
        rows.append(dict(shape=name, cfg="copy_floor", ms=floor))
        del part, other
        best = None
        cfgs = [KvAttnConfig(block_m=m, steps=t, num_warps=w, num_stages=s)
                for m, t, w, s in itertools.product((64, 128, 256), (1, 4, 16), (4, 8), (1, 2, 3))]
        for cfg in cfgs:
            if kv_attn_infeasible(given, cfg, "sm_90"):
                continue
            try:
                attn = get_kernel(given, configs={"kv_attn": cfg})
                prep = attn.prepare(lists, shape.n_q, shape.n_k)
                with torch.no_grad():
                    ms = triton.testing.do_bench(lambda: attn(q, k, v, block_idx=prep), warmup=10, rep=40,
                                                 return_mode="median")
            except Exception as e:
                print(name, cfg, "failed", type(e).__name__, str(e)[:200]); continue
            rows.append(dict(shape=name, cfg=cfg.to_dict() if hasattr(cfg, "to_dict") else str(cfg), ms=ms))
            if best is None or ms < best[0]:
                best = (ms, cfg)
        print(f"{name} best {best[0]:.3f} ms {best[1]}", flush=True)
        attn = get_kernel(given, configs={"kv_attn": best[1]})
        prep = attn.prepare(lists, shape.n_q, shape.n_k)
        from torch.profiler import profile, ProfilerActivity
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                attn(q, k, v, block_idx=prep)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6), flush=True)
        del q, k, v, lists
        torch.cuda.empty_cache()
    json.dump(rows, open(f"{out}/kv_sweep.json", "w"), default=str, indent=1)


if __name__ == "__main__":
    main()

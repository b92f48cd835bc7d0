"""Run one forward of a benchmark shape a few times, for a profiler to read (H200).

    ncu --clock-control none -k regex:attn_fwd --launch-skip 2 --launch-count 1 --section ... \
        python3 tools/profile_forward.py --shape a32k --backend gluon --config '{"block_m": 64, "num_stages": 2}'

The inputs and lists are the bench's (bf16 randn, seed 0, kernelgen's `mean` selector; every block for
tools/tilelang_probe.py's dense cases). `--variant` launches a tools/tilelang_variants.py patch of the
TileLang forward instead of the product kernel; `--backend cudnn` runs the dense anchor (SDPA's cuDNN
backend, K and V expanded to the query heads) instead.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import kernelgen  # noqa: E402
from kernelgen.bench import SHAPES  # noqa: E402
from kernelgen.config import config_from_dict  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="a32k", help="a bench shape or a tools/tilelang_probe.py case")
    p.add_argument("--backend", default="gluon", choices=["triton", "tilelang", "gluon", "cudnn"])
    p.add_argument("--config", default=None, help="the attention config as JSON (default: what dispatch serves)")
    p.add_argument("--variant", default=None, help="a tools/tilelang_variants.py variant (TileLang only)")
    p.add_argument("--iters", type=int, default=4)
    a = p.parse_args()
    import tilelang_probe

    shape = SHAPES.get(a.shape) or tilelang_probe.CASES[a.shape]
    q, k, v = shape.inputs("cuda", torch.bfloat16)
    if a.backend == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = shape.heads_q // shape.heads_kv
        kd, vd = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(a.iters):
                torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=shape.causal)
        torch.cuda.synchronize()
        print(f"{a.shape} cudnn: {a.iters} runs done", flush=True)
        return
    spec0 = shape.spec("mean")
    idx = tilelang_probe.lists(shape, spec0, "cuda")
    spec = shape.spec("given").replace(backend=a.backend)
    configs = {"attn": config_from_dict("attn", json.loads(a.config), a.backend)} if a.config else None
    if a.variant:
        kernel = tilelang_probe.build(a.shape, configs["attn"], a.variant)
        fn = lambda: kernel(q, k, v, idx, 1.0 / math.sqrt(shape.head_dim))  # noqa: E731
    else:
        attn = kernelgen.get_kernel(spec, configs=configs)
        fn = lambda: attn(q, k, v, block_idx=idx)  # noqa: E731
    for _ in range(a.iters):
        fn()
    torch.cuda.synchronize()
    print(f"{a.shape} {a.backend} {a.config or 'served'} {a.variant or ''}: {a.iters} runs done", flush=True)


if __name__ == "__main__":
    main()

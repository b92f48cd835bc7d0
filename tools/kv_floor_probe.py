"""H200 probe: how fast can any Q-centric kernel read the K/V blocks that the benchmark lists select?

For a shape, every program of the served Q-centric forward reads the K and V blocks of its list
(a program per Q tile, per split of the G packed heads). This probe times a Triton kernel that does
only that, with the same grid and the same lists, and no attention math: it adds the blocks up and
writes one number per program. Its time is a floor for the forward on that shape; the forward's
time against it says how much of the forward is data movement. Next to it, in the same run:
  hot      the same kernel with every list replaced by blocks 0..top_k-1 (the reads always hit L2):
           the ceiling of L2-to-SM traffic for this access pattern;
  forward  the forward `get_kernel` serves (given lists) and FlexAttention with the same BlockMask;
  copy     torch's copy of K (DRAM bandwidth).

    python3 tools/kv_floor_probe.py [--shapes a32k,b] [--out DIR]
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernelgen.bench import SHAPES, flex_block_mask, flex_kernel_options, useful_flops  # noqa: E402


@triton.jit
def kv_stream(K, V, IDX, OUT, n_kv_blocks, heads_kv, n_prog_m,
              stride_kb, stride_kh, stride_kn, stride_ib, stride_ih, stride_it,
              SPLITS: tl.constexpr, TOP_K: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads_kv
    hkv = pid_bh % heads_kv
    tile = pid_m // SPLITS
    lst = IDX + b * stride_ib + hkv * stride_ih + tile * stride_it
    offs = tl.arange(0, KV_BLOCK)[:, None] * stride_kn + tl.arange(0, HEAD_DIM)[None, :]
    head = b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    acc = tl.zeros([KV_BLOCK, HEAD_DIM], tl.float32)
    for i in range(TOP_K):
        blk = tl.minimum(tl.maximum(tl.load(lst + i), 0), n_kv_blocks - 1)
        base = head + (blk * KV_BLOCK).to(tl.int64) * stride_kn
        # .cg: cached in L2 only, as the forward's bulk copies are (no L1 reuse to flatter the floor)
        k = tl.load(K + base + offs, cache_modifier=".cg")
        v = tl.load(V + base + offs, cache_modifier=".cg")
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + pid_bh * n_prog_m + pid_m, tl.sum(acc))


def stream(k, v, idx, shape, splits, num_warps):
    n_q_tiles = idx.shape[2]
    grid = (n_q_tiles * splits, shape.batch * shape.heads_kv)
    out = torch.empty(grid[1] * grid[0], device=k.device, dtype=torch.float32)

    def run():
        kv_stream[grid](
            k, v, idx, out, -(-k.shape[2] // shape.kv_block), shape.heads_kv, grid[0],
            k.stride(0), k.stride(1), k.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
            SPLITS=splits, TOP_K=shape.top_k, KV_BLOCK=shape.kv_block, HEAD_DIM=shape.head_dim, num_warps=num_warps)
        return out

    return run


def main():
    import kernelgen
    from torch.nn.attention.flex_attention import flex_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="a32k,b")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h, n: torch.randn(shape.batch, h, n, shape.head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                      generator=gen)
        q, k, v = mk(shape.heads_q, shape.n_q), mk(shape.heads_kv, shape.n_k), mk(shape.heads_kv, shape.n_k)
        spec = shape.spec("mean")
        idx = kernelgen.get_kernel(spec).select(q, k)  # the benchmark's lists
        attn = kernelgen.get_kernel(shape.spec("given"))
        cfg = attn.config("attn", shape.n_q, shape.n_k)
        block_m = getattr(cfg, "block_m", 128)
        splits = max(1, spec.gqa_group * spec.q_tile // block_m)
        valid = ((idx >= 0) & (idx < shape.n_k // shape.kv_block)).sum().item()
        kv_bytes = valid * splits * shape.kv_block * shape.head_dim * 2 * 2  # K and V, bf16
        hot = torch.arange(shape.top_k, device="cuda", dtype=torch.int32).expand_as(idx).contiguous()
        row = dict(shape=name, block_m=block_m, programs=idx.shape[2] * splits * shape.batch * shape.heads_kv,
                   kv_read_GB=kv_bytes / 1e9)
        row["floor_ms"] = min(bench(stream(k, v, idx, shape, splits, w)) for w in (4, 8))
        row["hot_ms"] = min(bench(stream(k, v, hot, shape, splits, w)) for w in (4, 8))
        row["forward_ms"] = bench(lambda: attn(q, k, v, block_idx=idx))
        mask = flex_block_mask(idx, spec, shape)
        opts = flex_kernel_options(spec)
        row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=mask, enable_gqa=shape.heads_q != shape.heads_kv,
                                            kernel_options=opts))
        row["copy_k_ms"] = bench(lambda: k.clone())
        row["useful_tflops_forward"] = useful_flops(idx, spec, shape.n_q, shape.n_k) / row["forward_ms"] / 1e9
        for key in ("floor", "hot", "forward", "flex"):
            row[f"{key}_TBps"] = kv_bytes / row[f"{key}_ms"] / 1e9
        row["dram_TBps"] = 2 * k.numel() * k.element_size() / row["copy_k_ms"] / 1e9
        row["flex_over_floor"] = row["flex_ms"] / row["floor_ms"]
        rows.append(row)
        print(f"{name:6s} programs {row['programs']:6d}  K/V read {row['kv_read_GB']:.3f} GB | floor {row['floor_ms']:.3f} ms "
              f"({row['floor_TBps']:.2f} TB/s)  hot {row['hot_ms']:.3f} ({row['hot_TBps']:.2f})  forward {row['forward_ms']:.3f} "
              f"({row['forward_TBps']:.2f})  flex {row['flex_ms']:.3f} ({row['flex_TBps']:.2f})  copy {row['dram_TBps']:.2f} TB/s "
              f"| 1.3x flex = {row['flex_ms'] / 1.3:.3f} ms; flex / floor = {row['flex_over_floor']:.2f}")
    if args.out:
        with open(os.path.join(args.out, "kv_floor.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

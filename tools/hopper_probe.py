"""Probes on the GPU that say where the time of the block-sparse forward goes (not a test, not the product).

    python3 tools/hopper_probe.py --out $OUT

1. **Gather floor.** A kernel with the attention's grid that only loads each listed K and V block
   (same lists, same programs, no MMA, no softmax): no kernel that reads every listed block once per
   program can be faster. Compared with kernelgen's attention and FlexAttention on the same lists.
2. **Hot lists.** kernelgen's attention where every list names the same blocks (K/V stay in L2):
   the compute-and-latency part alone.
3. **Triton's Hopper warp specialisation.** A minimal list-driven flash loop (TMA loads) with
   `tl.range(..., warp_specialize=True)`, against the same loop without it, dense lists, D=64/128:
   checks whether Triton 3.6's automatic producer/consumer split is correct and faster on sm_90.
4. **Tiles per program.** The same loop on short random lists (16 blocks), with 1, 2 or 4 Q tiles
   per program: what a persistent schedule could win on the per-tile prologue and epilogue.
Prints a short table; writes every row to $OUT/probe.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def gather_kv(K, V, IDX, OUT, n_kv_blocks, heads_kv, n_tiles,
              stride_kb, stride_kh, stride_kn, stride_ib, stride_ih, stride_it,
              HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr, TOP_K: tl.constexpr, SPLITS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads_kv
    hkv = pid_bh % heads_kv
    tile = pid_m // SPLITS
    lst = IDX + b * stride_ib + hkv * stride_ih + tile * stride_it
    offs = tl.arange(0, KV_BLOCK)[:, None] * stride_kn + tl.arange(0, HEAD_DIM)[None, :]
    base = b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    acc = tl.zeros([KV_BLOCK, HEAD_DIM], tl.float32)
    for i in range(TOP_K):
        blk = tl.minimum(tl.maximum(tl.load(lst + i), 0), n_kv_blocks - 1)
        ptr = base + (blk * KV_BLOCK).to(tl.int64) * stride_kn + offs
        acc += tl.load(K + ptr).to(tl.float32) + tl.load(V + ptr).to(tl.float32)
    tl.store(OUT + pid_bh * tl.num_programs(0) + pid_m, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _flash_step(acc, l_i, m_i, q, Kd, Vd, bh, start, qk_scale, BN: tl.constexpr, D: tl.constexpr):
    """One online-softmax step over the BN keys from `start` (inlined by Triton)."""
    k = Kd.load([bh, start, 0]).reshape(BN, D)
    qk = tl.dot(q, k.T)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = Vd.load([bh, start, 0]).reshape(BN, D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def flash_loop(Qd, Kd, Vd, Od, IDX, qk_scale, n_tiles,
               TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, WS: tl.constexpr):
    """Q, K, V, O: [BH, N, D] descriptors; IDX int32 [n_tiles, TOP_K]: the blocks of BN keys each BM-query tile visits."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    q = Qd.load([bh, pid * BM, 0]).reshape(BM, D)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for i in tl.range(0, TOP_K, warp_specialize=WS):
        start = tl.load(IDX + pid * TOP_K + i) * BN
        acc, l_i, m_i = _flash_step(acc, l_i, m_i, q, Kd, Vd, bh, start, qk_scale, BN, D)
    Od.store([bh, pid * BM, 0], (acc / l_i[:, None]).to(Od.dtype).reshape(1, BM, D))


@triton.jit
def flash_tiles(Qd, Kd, Vd, Od, IDX, qk_scale, n_tiles,
                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr):
    """flash_loop with TILES consecutive Q tiles per program (an outer loop): does handing a program
    several short lists (as a persistent kernel would) hide the per-tile prologue and epilogue?"""
    bh = tl.program_id(1)
    for t in range(TILES):
        tile = tl.program_id(0) * TILES + t
        q = Qd.load([bh, tile * BM, 0]).reshape(BM, D)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for i in range(0, TOP_K):
            start = tl.load(IDX + tile * TOP_K + i) * BN
            acc, l_i, m_i = _flash_step(acc, l_i, m_i, q, Kd, Vd, bh, start, qk_scale, BN, D)
        Od.store([bh, tile * BM, 0], (acc / l_i[:, None]).to(Od.dtype).reshape(1, BM, D))


def probe_tiles(rows, log):
    """Short random lists (top_k 16 of 128-blocks, N=16k, D=128, 32 heads): 1, 2 or 4 tiles per program."""
    d, n, bh, top_k, bm, bn = 128, 16384, 32, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    n_tiles = n // bm
    idx = torch.rand(n_tiles, n // bn, device="cuda", generator=gen).argsort(-1)[:, :top_k].sort(-1).values
    idx = idx.to(torch.int32).contiguous()
    flops = 4.0 * bh * n * top_k * bn * d
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))

    def desc(t, rows_):
        return TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, rows_, d])

    ref = None
    for tiles, warps, stages in ((1, 8, 2), (1, 8, 3), (2, 8, 2), (4, 8, 2), (4, 8, 3)):
        o = torch.full_like(q, float("nan"))
        qd, kd, vd, od = desc(q, bm), desc(k, bn), desc(v, bn), desc(o, bm)

        def call():
            flash_tiles[(n_tiles // tiles, bh)](qd, kd, vd, od, idx, 1.4426950408889634 / math.sqrt(d), n_tiles,
                                                TOP_K=top_k, BM=bm, BN=bn, D=d, TILES=tiles,
                                                num_warps=warps, num_stages=stages)
        label = f"short lists, {tiles} tile(s)/program {warps}w {stages}s"
        try:
            call()
            torch.cuda.synchronize()
            ref = o.clone() if ref is None else ref
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = bench(call)
        except Exception as e:  # report, never hide
            log(f"{label}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(shape="short lists D128 N16k BH32 top16", impl=label, ms=ms, tflops=flops / ms / 1e9,
                         diff_vs_first=err))
        log(f"{label:50s} {ms:8.4f} ms {flops / ms / 1e9:7.1f} TF/s diff_vs_first={err:.1e}")


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def probe_gather(rows, log):
    import kernelgen
    from kernelgen.bench import SHAPES, flex_block_mask, flex_kernel_options, useful_flops

    for name in ("a32k", "b"):
        s = SHAPES[name]
        spec, given = s.spec("mean"), s.spec("given")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(s.batch, s.heads_q, s.n_q, s.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(s.batch, s.heads_kv, s.n_k, s.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        idx = kernelgen.get_kernel(spec).select(q, k)
        attn = kernelgen.get_kernel(given)
        cfg = attn.config("attn", s.n_q, s.n_k)
        flops = useful_flops(idx, spec, s.n_q, s.n_k)
        n_tiles = idx.shape[2]
        n_blocks = spec.n_kv_blocks(s.n_k)
        splits = spec.gqa_group * s.q_tile // cfg.block_m
        out = torch.empty(s.batch * s.heads_kv * n_tiles * splits, device="cuda", dtype=torch.float32)
        listed_bytes = idx.numel() * splits * 2 * s.kv_block * s.head_dim * 2  # K+V bytes the programs load

        def row(impl, ms, **extra):
            r = dict(shape=name, impl=impl, ms=ms, tflops=flops / ms / 1e9, **extra)
            rows.append(r)
            log(f"{name:6s} {impl:44s} {ms:8.4f} ms {r['tflops']:7.1f} TF/s "
                + " ".join(f"{a}={b}" for a, b in extra.items()))

        row("kernelgen given (served config)", bench(lambda: attn(q, k, v, block_idx=idx)), config=cfg.to_json())
        for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
            def gather():
                gather_kv[(n_tiles * splits, s.batch * s.heads_kv)](
                    k, v, idx, out, n_blocks, s.heads_kv, n_tiles, k.stride(0), k.stride(1), k.stride(2),
                    idx.stride(0), idx.stride(1), idx.stride(2), HEAD_DIM=s.head_dim, KV_BLOCK=s.kv_block,
                    TOP_K=s.top_k, SPLITS=splits, num_warps=warps, num_stages=stages)
            ms = bench(gather)
            row(f"gather only ({warps} warps, {stages} stages)", ms,
                GB_per_s=round(listed_bytes / ms / 1e6), listed_GB=round(listed_bytes / 1e9, 3))
        hot = torch.arange(s.top_k, device="cuda", dtype=torch.int32).expand_as(idx).contiguous()
        row("kernelgen given, hot lists (blocks 0..top_k-1)", bench(lambda: attn(q, k, v, block_idx=hot)))
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            mask = flex_block_mask(idx, spec, s)
            opts = flex_kernel_options(spec)
            g = spec.gqa_group
            row("flex (same BlockMask)", bench(lambda: flex(q, k, v, block_mask=mask, enable_gqa=g > 1,
                                                            kernel_options=opts)))
        except Exception as e:  # report, never hide
            log(f"{name}: flex failed: {type(e).__name__}: {str(e)[:200]}")
        del q, k, v
        torch.cuda.empty_cache()


def probe_ws(rows, log):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for d, n, bh in ((128, 16384, 32), (64, 16384, 32)):
        bn = d
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(bh, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = 1 / math.sqrt(d)
        flops = 4.0 * bh * n * n * d
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
            ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None]))
        rows.append(dict(shape=f"dense D{d} N{n} BH{bh}", impl="sdpa cudnn", ms=ms, tflops=flops / ms / 1e9))
        log(f"D{d:<4d} {'sdpa cudnn':44s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TF/s")
        for bm, warps, stages, ws in ((128, 8, 2, False), (128, 8, 3, False), (64, 4, 2, False),
                                      (64, 4, 2, True), (64, 4, 3, True)):
            n_tiles = n // bm
            idx = torch.arange(n // bn, device="cuda", dtype=torch.int32).repeat(n_tiles, 1).contiguous()

            def desc(t, rows_):
                return TensorDescriptor(t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, rows_, d])

            o = torch.full_like(q, float("nan"))
            qd, kd, vd, od = desc(q, bm), desc(k, bn), desc(v, bn), desc(o, bm)
            triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))

            def call():
                flash_loop[(n_tiles, bh)](qd, kd, vd, od, idx, scale * 1.4426950408889634, n_tiles,
                                          TOP_K=n // bn, BM=bm, BN=bn, D=d, WS=ws, num_warps=warps, num_stages=stages)
            label = f"flash loop BM{bm} {warps}w {stages}s{' warp_specialize' if ws else ''}"
            try:
                call()
                torch.cuda.synchronize()
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = bench(call)
            except Exception as e:  # report, never hide
                log(f"D{d} {label}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(dict(shape=f"dense D{d} N{n} BH{bh}", impl=label, ms=ms, tflops=flops / ms / 1e9, rel_err=err))
            log(f"D{d:<4d} {label:44s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TF/s rel_err={err:.1e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--parts", default="gather,tiles,ws")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    try:
        if "gather" in args.parts:
            probe_gather(rows, log)
        if "tiles" in args.parts:
            probe_tiles(rows, log)
        if "ws" in args.parts:
            probe_ws(rows, log)
    finally:
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""H200 probe of TileLang forward variants (configs, e.g. overlap on/off) on the benchmark shapes and on
dense shapes (every block listed), next to cuDNN SDPA (dense) and FlexAttention (same lists).

Every kernel first compiles in a pool of worker processes (nvcc is the slow part; TileLang's disk
cache then makes the timed process's compile instant). Each output is checked: against SDPA where
the lists cover everything, else against the first config of its case (itself checked by the GPU
tests); a check failure is reported in the row, never hidden.

    python3 tools/tilelang_probe.py [--cases b,c_dense,...] [--out DIR]
"""
import argparse
import concurrent.futures as cf
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from kernelgen.bench import SHAPES, BenchShape, dense_flops, flex_block_mask, flex_kernel_options, useful_flops  # noqa: E402
from kernelgen.config import TileLangAttnConfig as C  # noqa: E402

# dense shapes of issue 4: every KV block in every list (128-blocks, so 128-row tiles at D=64 too)
DENSE = {
    f"dense_d{d}_{n // 1024}k_{'c' if causal else 'nc'}": BenchShape(
        f"dense_d{d}_{n // 1024}k", 1, 32 if d == 128 else 64, 32 if d == 128 else 64, n, n, d, 128, 128, n // 128, causal)
    for d in (128, 64) for n in (16384,) for causal in (False, True)
}
CASES = {"b": SHAPES["b"], "c": SHAPES["c"], "c_dense": SHAPES["c_dense"], "a32k": SHAPES["a32k"], **DENSE}


def configs(shape, variants=()):
    """(config, variant) pairs: a few product configs, then each variant on its own configs
    (tilelang_variants.VARIANT_CONFIGS) or on the overlapped configs of two consumer warpgroups."""
    from tilelang_variants import ON_PRODUCT_CONFIGS, VARIANT_CONFIGS

    rows = 64 if shape.q_tile * shape.heads_q // shape.heads_kv < 128 else 128  # (a): 64 rows per program at most
    if rows == 64:  # one warpgroup: one stage (config.tilelang_attn_feasible)
        base = [C(64, 1, 128, False), C(64, 1, 128, True)]
    elif shape.head_dim == 128:
        base = [C(128, 2, 256, False), C(128, 2, 256, True), C(128, 3, 256, True), C(128, 2, 256, True, True),
                C(128, 3, 256, True, True)]
    else:
        base = [C(128, 2, 256, False), C(128, 2, 256, True), C(128, 1, 256, False), C(128, 2, 256, True, True),
                C(128, 1, 256, True, True)]
    pairs = [(c, None) for c in base]
    for v in variants:
        if v in VARIANT_CONFIGS:
            pairs += [(C(*t), v) for t in VARIANT_CONFIGS[v](rows, shape.head_dim)]
        elif v in ON_PRODUCT_CONFIGS:
            pairs += [(c, v) for c in base]
        else:
            pairs += [(c, v) for c in base if c.overlap and c.threads == 256 and not c.pingpong]
    return pairs


def spec_of(shape):
    return shape.spec("given").replace(backend="tilelang")


def build(name, cfg, variant):
    """The compiled kernel of one case, config and variant (None: the product template as it is)."""
    from kernelgen import tilelang_backend as tb
    from kernelgen.compile import load_module
    from kernelgen.render import module_name

    shape = CASES[name]
    spec = spec_of(shape)
    source = tb.attn_source(spec, "bfloat16")
    options = {}
    if variant:
        from tilelang_variants import COMPILE_OPTIONS, patch

        source = patch(source, variant)
        options = COMPILE_OPTIONS.get(variant, {})
    module = load_module(module_name(spec, "attn", source), source)
    func = tb.build_attn_from(module, spec, "bfloat16", batch=shape.batch, heads_kv=shape.heads_kv, seq_q=shape.n_q,
                              seq_k=shape.n_k, config=cfg)
    return tb.compile_attn(func, cfg, arch="sm_90a", **options)  # the product's build options unless the variant's


def compile_one(args):
    name, cfg, variant = args
    t0 = time.perf_counter()
    try:
        build(name, cfg, variant)
        return name, cfg, variant, None, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (reported in the table)
        return name, cfg, variant, f"{type(e).__name__}: {str(e)[:200]}", time.perf_counter() - t0


def lists(shape, spec, device):
    """The benchmark's lists (kernelgen's mean selector), or every block for a dense case."""
    import kernelgen

    n_tiles, n_blocks = -(-shape.n_q // shape.q_tile), -(-shape.n_k // shape.kv_block)
    if shape.top_k >= n_blocks:
        ids = torch.arange(n_blocks, device=device, dtype=torch.int32)
        return ids.expand(shape.batch, shape.heads_kv, n_tiles, n_blocks).contiguous()
    q, k, _ = shape.inputs(device, torch.bfloat16, seed=0)  # the bench's inputs: its lists
    return kernelgen.get_kernel(shape.spec("mean")).select(q, k)


def main():
    import triton

    import kernelgen

    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="b,c_dense," + ",".join(DENSE))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--flex", default="b", help="cases that also time FlexAttention")
    p.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    p.add_argument("--variants", default="", help="comma-separated tools/tilelang_variants.py variants")
    a = p.parse_args()
    names = [n for n in a.cases.split(",") if n]
    variants = [v for v in a.variants.split(",") if v]
    jobs = [(n, c, v) for n in names for c, v in configs(CASES[n], variants)]
    t0 = time.perf_counter()
    failed = {}
    with cf.ProcessPoolExecutor(a.workers) as pool:
        for name, cfg, variant, err, secs in pool.map(compile_one, jobs):
            if err:
                failed[name, cfg, variant] = err
                print(f"compile failed {name} {cfg} {variant}: {err}", flush=True)
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s ({a.workers} workers)", flush=True)

    os.makedirs(a.out, exist_ok=True)
    rows = []
    out = open(os.path.join(a.out, "tilelang_probe.jsonl"), "a")  # noqa: SIM115

    def record(**row):
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"{row['case']:18s} {row['impl']:44s} {row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s {row.get('check', '')}",
              flush=True)

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for name in names:
        shape = CASES[name]
        spec = spec_of(shape)
        q, k, v = shape.inputs("cuda", torch.bfloat16, seed=1)
        idx = lists(shape, spec, "cuda")
        dense = idx.shape[-1] >= -(-shape.n_k // shape.kv_block)
        flops = useful_flops(idx, spec, shape.n_q, shape.n_k)
        g = spec.gqa_group
        kd, vd = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=shape.causal)  # noqa: E731
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            want = sdpa().float() if dense else None
            record(case=name, impl="sdpa cudnn (dense)", ms=(ms := bench(sdpa)), tflops=dense_flops(shape) / ms / 1e9)
        first = None
        for cfg, variant in configs(shape, variants):
            impl = f"tilelang m{cfg.block_m} s{cfg.num_stages} t{cfg.threads} overlap={int(cfg.overlap)}"
            impl += " pingpong" if cfg.pingpong else ""
            impl += f" +{variant}" if variant else ""
            if (name, cfg, variant) in failed:
                record(case=name, impl=impl, ms=float("nan"), tflops=float("nan"),
                       check="compile failed: " + failed[name, cfg, variant])
                continue
            try:
                if variant:  # the patched kernel, launched directly (outputs O and LSE)
                    kernel, scale = build(name, cfg, variant), 1.0 / math.sqrt(shape.head_dim)
                    fn = lambda: kernel(q, k, v, idx, scale)[0]  # noqa: E731
                else:
                    attn = kernelgen.get_kernel(spec, configs={"attn": cfg})
                    fn = lambda: attn(q, k, v, block_idx=idx)  # noqa: E731
                o = fn()
                torch.cuda.synchronize()
                ref = want if dense else first
                if ref is None:
                    first, check = o.float(), "baseline of this case"
                else:
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    mx = (o.float() - ref).abs().max().item()
                    ok = err < 1e-2 and not torch.isnan(o).any()
                    check = f"{'OK' if ok else 'WRONG'} rel {err:.1e} max {mx:.1e} vs {'sdpa' if dense else 'first config'}"
                ms = bench(fn)
                record(case=name, impl=impl, ms=ms, tflops=flops / ms / 1e9, check=check, config=cfg.to_json())
            except Exception as e:  # noqa: BLE001
                record(case=name, impl=impl, ms=float("nan"), tflops=float("nan"), check=f"{type(e).__name__}: {str(e)[:200]}")
        if name in a.flex.split(","):
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            mask = flex_block_mask(idx, spec, shape)
            opts = flex_kernel_options(spec)
            fl = lambda: flex(q, k, v, block_mask=mask, enable_gqa=g > 1, kernel_options=opts)  # noqa: E731
            fl()
            record(case=name, impl="flex (same BlockMask)", ms=(ms := bench(fl)), tflops=flops / ms / 1e9)
        q = k = v = kd = vd = want = first = None
        torch.cuda.empty_cache()
    out.close()


if __name__ == "__main__":
    main()

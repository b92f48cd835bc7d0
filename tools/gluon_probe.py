"""H200 probe of the Gluon forward (backend="gluon", every config given on the command line): correctness on
the Triton GPU test grid's shapes against the float64 reference (outputs poisoned with NaN first), then
timings next to the forward kernelgen serves, FlexAttention with the same BlockMask, and cuDNN SDPA on
the dense cases. (Session 5's two-blocks-per-step variant, tools/gluon_fwd2.py, is in commit 6244172.)

    python3 tools/gluon_probe.py [--out DIR] [--check-only] [--time-only] [--stages 2,3] [--baseline FILE,...
                                 [--baseline-maxnreg N] [--baseline-persistent 3,4]]

--baseline times other versions of templates/gluon/attn_fwd.py.j2 (a candidate, or the template as it
was at an earlier commit) with the same configs, next to the product kernel, in the same run; each row
has its output's rel. L2 difference from the served kernel's. A candidate named *persistent* is launched
with a grid of N programs per SM and n_work. Session 7's rejected candidates (a persistent forward and
a warp-specialised one, docs/PERF.md) are tools/candidates/ in commit d06b112; session 8's ping-pong
candidate and its control (two items per program, launched with grid[0] halved) are in commit 125c80e.
Session 9's polynomial-exp2 candidates (tools/candidates/gluon_attn_fwd_poly*.py.j2) are in commit 427b46b;
session 10's L2-prefetch candidates (tools/candidates/gluon_attn_fwd_prefetch*.py.j2, launched with K and V
as raw pointers too) in commit dcf15b5. `--hot` also times the product with lists that always hit L2.
Every timing is do_bench's median (`ms`) and a CUDA-graph replay's (`graph_ms`: GPU time, no host).
"""
import argparse
import json
import os
import sys
import types

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from checks import assert_close_to_reference  # noqa: E402

import kernelgen  # noqa: E402
from kernelgen import ops, reference  # noqa: E402
from kernelgen.config import GluonAttnConfig  # noqa: E402
from kernelgen.bench import (SHAPES, BenchShape, _bench, _bench_graph, flex_block_mask, flex_kernel_options,  # noqa: E402
                             useful_flops)

DEVICE, DTYPE = "cuda", torch.bfloat16
# (B, Hkv, G, Nq, Nk, D, kv_block, q_tile, top_k, causal): the Triton GPU grid's shapes, plus partial
# blocks, GQA splits, Nq != Nk
CHECKS = [
    (1, 2, 1, 4096, 4096, 64, 64, 64, 16, True),
    (1, 2, 4, 4096, 4096, 128, 64, 64, 16, True),
    (2, 1, 16, 4096, 16384, 128, 128, 128, 16, False),
    (1, 2, 4, 8192, 8192, 128, 128, 128, 16, True),
    (1, 1, 2, 16384 + 77, 16384 + 77, 64, 64, 128, 16, True),
    (1, 1, 4, 4000, 4096, 128, 128, 64, 64, True),
    (1, 2, 2, 4096, 4096, 128, 128, 128, 32, True),
    (1, 2, 1, 1000, 1500, 64, 64, 64, 8, False),
]
# dense (every block listed), 16k: D=128 with 128-blocks (H32), D=64 with 64-blocks and 128-query tiles (H64)
DENSE = {f"dense_d{d}_16k_{'c' if c else 'nc'}": BenchShape("dense", 1, 4096 // d, 4096 // d, 16384, 16384, d, d, 128,
                                                             16384 // d, c)
         for d in (128, 64) for c in (False, True)}


def gluon(spec, block_m, stages):
    """The Gluon forward of `spec` with one pinned config (lists given)."""
    return kernelgen.get_kernel(spec.replace(selector="given", backend="gluon"),
                                configs={"attn": GluonAttnConfig(block_m=block_m, num_stages=stages)})


def check(case, dtype, block_m, stages, lists="select", baseline=None, maxnreg=None):
    """One check of the product kernel, or of a candidate template (`baseline`; a persistent one runs
    7 programs, so each walks many items of varied lengths)."""
    b, hkv, g, nq, nk, d, kv_block, q_tile, top_k, causal = case
    spec = kernelgen.Spec(head_dim=d, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=g)
    gen = torch.Generator(device=DEVICE).manual_seed(nq + d + g)
    q = torch.randn(b, hkv * g, nq, d, device=DEVICE, dtype=dtype, generator=gen)
    k = torch.randn(b, hkv, nk, d, device=DEVICE, dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, nk, d, device=DEVICE, dtype=dtype, generator=gen)
    if lists == "select":
        idx = kernelgen.get_kernel(spec).select(q, k)
    else:  # empty lists, out-of-range and negative ids, repeats
        n_blocks = spec.n_kv_blocks(nk)
        width = max(top_k, n_blocks + 6)
        keys = torch.rand(b, hkv, spec.n_q_tiles(nq), width, device=DEVICE, generator=gen)
        idx = (keys.argsort(-1)[..., :top_k] - 3).to(torch.int32)  # distinct ids, some outside [0, n_blocks)
        idx[:, :, ::3] = -1
    norm = reference.normalize_block_idx(idx, spec.n_kv_blocks(nk))  # what ops.prepare_block_idx makes
    ops._POISON = True  # outputs start as NaN: an unwritten element fails the check
    try:
        if baseline:
            persistent = "persistent" in os.path.basename(baseline)
            o, lse = baseline_kernel(baseline, spec, block_m, stages, None if persistent else maxnreg,
                                     programs=7 if persistent else None)(q, k, v, idx)
        else:
            o, lse = gluon(spec, block_m, stages)(q, k, v, block_idx=idx, return_lse=True)
    finally:
        ops._POISON = False
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=norm)
    row = dict(case=list(case), dtype=str(dtype), block_m=block_m, stages=stages, lists=lists,
               kernel=os.path.basename(baseline) if baseline else "product")
    try:  # the GPU tests' check: no NaN, rel. L2 and max-abs within tolerance, lse -inf exactly where empty
        rel, max_abs = assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
        return dict(row, ok=True, rel=rel, max_abs=max_abs)
    except AssertionError as error:
        return dict(row, ok=False, error=str(error))

class _Launch:
    """A candidate Gluon kernel launched the way it needs: with `maxnreg` (warp-specialised kernels:
    without it they assume 256 registers per thread, one program per SM), or persistent (`per_sm`
    programs per SM, or `programs` in all, walk ops.attention_gluon's grid as n_work items)."""

    def __init__(self, kernel, maxnreg=None, per_sm=None, programs=None, pairs=False):
        self.kernel, self.maxnreg, self.per_sm, self.programs, self.pairs = kernel, maxnreg, per_sm, programs, pairs
        self.kwargs = {}  # more launch arguments (a prefetch candidate's K and V, set per call)

    def __getitem__(self, grid):
        extra = dict(self.kwargs, **({"maxnreg": self.maxnreg} if self.maxnreg else {}))
        if self.pairs:  # two work items per program (one per warpgroup)
            grid = (triton.cdiv(grid[0], 2), *grid[1:])
        if self.per_sm or self.programs:
            n_work = grid[0] * grid[1]
            extra["n_work"] = n_work
            grid = (min(n_work, self.programs or self.per_sm * torch.cuda.get_device_properties(0).multi_processor_count), )
        return lambda *args, **kwargs: self.kernel[grid](*args, **extra, **kwargs)


def baseline_kernel(path, spec, block_m, stages, maxnreg=None, per_sm=None, programs=None):
    """`attn(q, k, v, idx)` by the Gluon forward rendered from the template file `path` (same contract)."""
    import jinja2
    from kernelgen.compile import load_module
    from kernelgen.render import context, module_name

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.dirname(os.path.abspath(path))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True, autoescape=False)
    gspec = spec.replace(selector="given", backend="gluon")
    source = env.get_template(os.path.basename(path)).render(**context(gspec))
    mod = load_module(module_name(gspec, "attn", source), source)
    pairs = any(word in os.path.basename(path) for word in ("pingpong", "pairs"))
    prefetch = "prefetch" in os.path.basename(path)  # takes K and V as raw pointers too
    if maxnreg or per_sm or programs or pairs or prefetch:
        mod = types.SimpleNamespace(attn_fwd=_Launch(mod.attn_fwd, maxnreg, per_sm, programs, pairs))
    cfg = GluonAttnConfig(block_m=block_m, num_stages=stages)
    attn = gluon(spec, block_m, stages)  # its normaliser and input checks

    def run(q, k, v, idx):
        if prefetch:
            mod.attn_fwd.kwargs = dict(K=k, V=v, PF_EVICT_LAST="last" in os.path.basename(path))
        shapes = ops.check_qkv(q, k, v, gspec)
        norm = ops.prepare_block_idx(idx, gspec, shapes, q.device, attn.module("select", attn.config("select", 1, shapes.n_k)))
        return ops.attention_gluon(q, k, v, norm, gspec, shapes, mod, cfg, None)
    return run


def timing(name, shape, configs, baselines=(), baseline_maxnreg=None, per_sm=(None, ), hot=False):
    from torch.nn.attention.flex_attention import flex_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):  # do_bench's median, and the same call replayed from a CUDA graph (GPU time, no host)
        graph = _bench_graph(fn)
        return _bench(fn), float("nan") if graph is None else graph
    q, k, v = shape.inputs(DEVICE, DTYPE)
    spec = shape.spec("mean")
    dense = shape.top_k * shape.kv_block >= shape.n_k
    if dense:  # every block in every list
        n_tiles, n_blocks = spec.n_q_tiles(shape.n_q), spec.n_kv_blocks(shape.n_k)
        idx = torch.arange(n_blocks, device=DEVICE, dtype=torch.int32).expand(
            shape.batch, shape.heads_kv, n_tiles, n_blocks).contiguous()
    else:
        idx = kernelgen.get_kernel(spec).select(q, k)
    flops = useful_flops(idx, spec, shape.n_q, shape.n_k)
    given = kernelgen.get_kernel(spec.replace(selector="given", backend="auto"))
    rows = []

    def row(impl, times, **extra):
        ms, graph_ms = times
        r = dict(shape=name, impl=impl, ms=ms, graph_ms=graph_ms, tflops=flops / ms / 1e9, **extra)
        rows.append(r)
        print(f"{name:18s} {impl:34s} {ms:8.3f} ms (graph {graph_ms:6.3f}) {r['tflops']:6.1f} TFLOP/s "
              f"{extra if extra else ''}", flush=True)

    served = given(q, k, v, block_idx=idx)
    row("kernelgen auto (served)", bench(lambda: given(q, k, v, block_idx=idx)),
        backend=given.backend(shape.n_k), config=given.config("attn", shape.n_q, shape.n_k).to_json())
    for block_m, stages in configs:
        try:
            attn = gluon(spec, block_m, stages)
            o = attn(q, k, v, block_idx=idx)
            diff = ((o.float() - served.float()).norm() / served.float().norm()).item()
            row(f"gluon m{block_m} s{stages}", bench(lambda: attn(q, k, v, block_idx=idx)),
                rel_diff_vs_served=f"{diff:.1e}")
            if hot:  # every list the first top_k blocks: K and V in L2 after the first touch (an upper bound)
                idx_hot = torch.arange(shape.top_k, device=DEVICE, dtype=torch.int32).expand_as(idx).contiguous()
                row(f"gluon m{block_m} s{stages} hot lists", bench(lambda: attn(q, k, v, block_idx=idx_hot)))
        except Exception as error:  # noqa: BLE001 (a config that fails is a row, not the end of the probe)
            print(f"{name} gluon m{block_m} s{stages}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        for baseline in baselines:
            persistent = "persistent" in os.path.basename(baseline)
            for n_sm in (per_sm if persistent else (None, )):
                label = f"{os.path.basename(baseline).split('.')[0]}{f' x{n_sm}/SM' if n_sm else ''} m{block_m} s{stages}"
                try:
                    base = baseline_kernel(baseline, spec, block_m, stages, None if persistent else baseline_maxnreg,
                                           n_sm)
                    o = base(q, k, v, idx)[0]
                    diff = ((o.float() - served.float()).norm() / served.float().norm()).item()
                    row(label, bench(lambda: base(q, k, v, idx)), rel_diff_vs_served=f"{diff:.1e}")
                    del base
                except Exception as error:  # noqa: BLE001
                    print(f"{name} {label}: {type(error).__name__}: {str(error)[:300]}", flush=True)
    if dense:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row("sdpa cudnn (dense)", bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=shape.causal, enable_gqa=shape.heads_q != shape.heads_kv)))
    else:
        flex = torch.compile(flex_attention, dynamic=False)
        mask = flex_block_mask(idx, spec, shape)
        opts = flex_kernel_options(spec)
        row("flex (same BlockMask)", bench(lambda: flex(q, k, v, block_mask=mask, enable_gqa=shape.heads_q != shape.heads_kv,
                                                        kernel_options=opts)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--time-only", action="store_true")
    p.add_argument("--shapes", default="a32k,b,c,c_dense," + ",".join(DENSE))
    p.add_argument("--stages", default="2,3")
    p.add_argument("--baseline", default="", help="other Gluon forward templates (comma-separated) to time with the "
                   "same configs; a file named *persistent* is launched persistent (--baseline-persistent)")
    p.add_argument("--baseline-maxnreg", type=int, default=None, help="launch non-persistent --baseline kernels with "
                   "this maxnreg")
    p.add_argument("--baseline-persistent", default="4", help="programs per SM for a persistent --baseline (list)")
    p.add_argument("--check-baselines", action="store_true", help="run the checks on the --baseline kernels too")
    p.add_argument("--hot", action="store_true", help="also time the product kernel with every list the first top_k "
                   "blocks (always in L2): how much the K/V reads' misses cost")
    args = p.parse_args()
    args.stages = [int(x) for x in args.stages.split(",")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    results = {"checks": [], "timings": []}
    if not args.time_only:
        kernels = [None] + ([b for b in args.baseline.split(",") if b] if args.check_baselines else [])
        for case, kernel in ((c, k) for k in kernels for c in CHECKS):
            for dtype in (torch.bfloat16, torch.float16):
                block_m = min(128, case[2] * case[7])
                for lists in ("select", "random"):
                    try:
                        r = check(case, dtype, block_m, 2, lists, kernel, args.baseline_maxnreg)
                    except Exception as error:  # noqa: BLE001
                        r = dict(case=list(case), dtype=str(dtype), lists=lists, ok=False, kernel=str(kernel),
                                 error=f"{type(error).__name__}: {str(error)[:400]}")
                    results["checks"].append(r)
                    print(("PASS " if r["ok"] else "FAIL ") + json.dumps(r), flush=True)
        n_ok = sum(r["ok"] for r in results["checks"])
        print(f"checks: {n_ok}/{len(results['checks'])} pass", flush=True)
    if not args.check_only:
        for name in args.shapes.split(","):
            shape = SHAPES.get(name) or DENSE[name]
            rows_max = min(128, shape.heads_q // shape.heads_kv * shape.q_tile)
            configs = [(m, s) for m in (64, 128) if m <= rows_max for s in args.stages
                       if 2 * s * shape.kv_block * shape.head_dim * 2 <= 227 * 1024]
            results["timings"] += timing(name, shape, configs, [b for b in args.baseline.split(",") if b],
                                         args.baseline_maxnreg, [int(x) for x in args.baseline_persistent.split(",")],
                                         args.hot)
    if args.out:
        with open(os.path.join(args.out, "gluon_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

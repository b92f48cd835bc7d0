"""`kernelgen bench --kv-centric`: per-query lists (the KV-centric schedule) against the kernels that take them.

For each shape of `kernelgen.workloads.KV_CENTRIC_SHAPES`, in one process on one GPU (bf16), over two
per-query list sets: random ones (`random_query_lists`, seed 0: neighbours agree by chance only), and ones
whose neighbours agree (`agreeing_query_lists`: each span of 64 queries shares all but AGREEING_OWN of a
query's blocks), the rows of each set labelled `lists`:

- kernelgen's KV-centric forward, the lists prepared once, in the design `prepare` serves (`design`: the
  gathered one, or the union one with its inflation), and where that is the union design, the gathered
  design over the same lists too; on `SELECTOR_SHAPES` (random lists) also each selector's
  pipeline (`SELECTORS`: `mean`, and `index` on random bf16 index vectors, Hi = 4, Di = 64, `selector_index`,
  and the same vectors in e4m3 (`index_fp8.to_fp8_index`; sm_90 only)):
  selection and attention, and selection alone with its share of the prepared forward (`of_prepared_forward`);
- dense SDPA on cuDNN, forward and forward+backward (every visible pair; once per shape);
- FlexAttention (torch.compile'd) over a BlockMask of each Q tile's union of listed blocks, with a
  mask_mod that looks each (query, block) up in a dense bool membership tensor [B, Hkv, Nq, n_blocks]
  (`kernelgen.to_block_mask` with a Q block of kv_block queries);
  building that tensor and the BlockMask is timed as its own row;
- fla-core's NSA selected-attention kernel (`ParallelNSAFunction`, layout [B, T, H, D]), forward and
  forward+backward, where it applies: it is causal only and needs G = Hq/Hkv a power of two >= 16.
  fla-core is imported lazily and never a dependency; inputs are transposed to its layout before timing.

kernelgen's forward+backward row (its KV-centric backward, lists prepared once) also says whether two
backward runs gave bitwise-equal gradients. Every anchor that cannot run is logged
with its reason and skipped. Outputs are compared with kernelgen's (relative L2, `rel_diff_vs_kernelgen`).
Rows (shape, impl, ms, tflops = useful TFLOP/s; the dense anchor counts every visible pair) go to
kv_centric.json.

    kernelgen bench --kv-centric [--shapes kv_nsa32k] [--out DIR]
"""
from __future__ import annotations

import torch

from ..dispatch import get_kernel
from ..errors import KernelgenRuntimeError
from ..index_fp8 import to_fp8_index
from ..interop import to_block_mask
from ..roles import WorkloadShape, index_inputs
from ..spec import Spec
from ..workloads import KV_CENTRIC_SHAPES, agreeing_query_lists, dense_flops, useful_flops
from .anchors import flex_call, sdpa_dense_anchors
from .backward import _grads, _timed
from .measure import _bench, _dump_rows, _rel_diff, row_attempts

__all__ = ["run_kv_centric", "fla_nsa_unsupported", "SELECTOR_SHAPES", "SELECTORS", "selector_index"]

SELECTOR_SHAPES = ("kv_nsa32k",)  # shapes on which the selector pipelines are also timed (NSA's shape)
# the selector pipelines timed there: row label -> (the spec's selector, index vectors in e4m3 (sm_90 only))
SELECTORS = {"mean": ("mean", False), "index": ("index", False), "index fp8": ("index", True)}
INDEX_HEADS, INDEX_DIM = 4, 64  # the index selector's inputs there (Hi, Di), as a lightning indexer's
AGREEING_OWN = 2  # the agreeing lists: each span of 64 queries shares all but this many blocks a query


def selector_index(shape, device, dtype, seed: int = 0):
    """Random (q_idx, k_idx, w) of the index selector for a bench shape, all in `dtype`: Hi = 4 index heads of
    Di = 64 per KV head, k_idx with one head per KV head (`roles.index_inputs`)."""
    shapes = WorkloadShape(shape.batch, shape.heads_kv, shape.n_q, shape.n_k)
    q_idx, k_idx, w = index_inputs(shape.spec("index"), shapes, device, dtype, INDEX_HEADS, INDEX_DIM, seed=seed)
    return q_idx, k_idx, w.to(dtype)


def fla_nsa_unsupported(spec: Spec) -> str | None:
    """Why fla-core's ParallelNSAFunction cannot compute `spec`'s attention over the same lists, or None.
    Its kernels mask causally, always (key <= query + Nk - Nq); each program holds the G query heads of a
    KV head as the rows of a tl.dot (a power of two, >= 16); D <= 256. It does not deduplicate ids (the
    lists here have no repeats) and skips negative ones (our -1 padding)."""
    if not spec.causal:
        return "fla's NSA kernels are causal only; this shape is non-causal"
    g = spec.gqa_group
    if g < 16 or g & (g - 1):
        return f"fla's NSA kernels need G = Hq/Hkv a power of two >= 16, here G = {g}"
    if spec.head_dim > 256:
        return f"fla's NSA kernels need D <= 256, here D = {spec.head_dim}"
    return None


def run_kv_centric(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, ms, tflops (and rel_diff_vs_kernelgen, fwd_bwd_ms where they apply); with
    `out_dir`, also kv_centric.json there."""
    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("bench --kv-centric needs a CUDA GPU: it times kernels")
    names = list(shape_names or KV_CENTRIC_SHAPES)
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows: list[dict] = []

    def record(name, impl, ms, flops, **extra):
        rows.append(dict(shape=name, impl=impl, ms=ms, tflops=flops / ms / 1e9 if flops else None, **extra))
        rate = f" {flops / ms / 1e9:7.1f} TFLOP/s" if flops else ""
        log(f"{name:10s} {impl:36s} {ms:8.3f} ms{rate} " + " ".join(f"{k}={v}" for k, v in extra.items()))
        _dump_rows(rows, out_dir, "kv_centric.json")

    attempt = row_attempts(log)

    for name in names:
        shape = KV_CENTRIC_SHAPES[name]
        given = shape.spec("given")
        q, k, v = shape.inputs(device, dtype)
        for kind, lists in (("random", shape.query_lists(device)),
                            ("agreeing", agreeing_query_lists(given, shape.batch, shape.heads_kv, shape.n_q, shape.n_k,
                                                              AGREEING_OWN, device=device))):
            ours = _lists_rows(name, shape, kind, lists, q, k, v, record, attempt, log)
            if kind == "random":
                _dense_row(name, shape, q, k, v, record, attempt)
        del q, k, v, lists, ours
        torch.cuda.empty_cache()
    return rows


def _lists_rows(name, shape, kind, lists, q, k, v, record, attempt, log):
    """Every row over one list set (`kind`: random, or agreeing neighbours): kernelgen prepared (the design
    prepare serves, its inflation), the gathered design where prepare served the union one, forward+backward,
    the selector pipelines (random lists, SELECTOR_SHAPES), FlexAttention and fla-core over the same lists.
    Returns kernelgen's output."""
    device, dtype = q.device, q.dtype
    given = shape.spec("given")
    flops = useful_flops(lists, given, shape.n_q, shape.n_k)
    attn = get_kernel(given)
    prepared = attn.prepare(lists, shape.n_q, shape.n_k)
    union = prepared.union
    design = dict(lists=kind, design="gathered" if union is None else f"union of {union.tile_q} queries")
    if union is not None:
        design["inflation"] = f"{union.inflation(prepared.block_idx):.2f}"
    with torch.no_grad():
        ours = attn(q, k, v, block_idx=prepared)
        forward_ms = _bench(lambda: attn(q, k, v, block_idx=prepared))
        record(name, "kernelgen kv_centric prepared", forward_ms, flops,
               backend=attn.served("kv_attn", shape.n_k, dtype, device).backend.name, **design)
        if union is not None:
            gathered = get_kernel(given, configs={"kv_attn": attn.config("kv_attn", shape.n_q, shape.n_k, dtype, device)})
            gathered_lists = gathered.prepare(lists, shape.n_q, shape.n_k)
            record(name, "kernelgen kv_centric gathered", _bench(lambda: gathered(q, k, v, block_idx=gathered_lists)),
                   flops, lists=kind, rel_diff_vs_kernelgen=f"{_rel_diff(gathered(q, k, v, block_idx=gathered_lists), ours):.1e}")

    def backward():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        grad = torch.randn_like(q)

        def call():
            return attn(*leaves, block_idx=prepared)

        times = _timed(call, leaves, grad)
        first, second = _grads(call, leaves, grad), _grads(call, leaves, grad)
        same = all(torch.equal(a, b) for a, b in zip(first, second))
        record(name, "kernelgen kv_centric fwd+bwd", times.pop("fwd_bwd_ms"), 0.0, **times, deterministic=same,
               **design)
    attempt(name, "kernelgen fwd+bwd", backward)
    if name in SELECTOR_SHAPES and kind == "random":
        for selector, (spec_selector, fp8) in SELECTORS.items():
            def pipeline(selector=selector, spec_selector=spec_selector, fp8=fp8):
                index = selector_index(shape, device, dtype) if spec_selector == "index" else None
                if fp8:
                    index = to_fp8_index(*index)
                attn_sel = get_kernel(shape.spec(spec_selector))
                with torch.no_grad():  # useful FLOPs of its own lists
                    sel_flops = useful_flops(attn_sel.select(q, k, index=index), given, shape.n_q, shape.n_k)
                    record(name, f"kernelgen kv_centric {selector} (select+attn)",
                           _bench(lambda: attn_sel(q, k, v, index=index)), sel_flops)
                    select_ms = _bench(lambda: attn_sel.select(q, k, index=index))
                    record(name, f"kernelgen kv_centric {selector} select only", select_ms, 0.0,
                           of_prepared_forward=f"{select_ms / forward_ms:.1%}")
            attempt(name, f"the {selector} pipeline", pipeline)

    def flex():
        flex_tile = shape.kv_block  # Flex's kernel tile must divide the BlockMask's blocks
        flex_spec = Spec(head_dim=shape.head_dim, kv_block=shape.kv_block, q_tile=flex_tile,
                         causal=shape.causal, gqa_group=given.gqa_group)

        def build():
            return to_block_mask(lists, given, shape.n_q, shape.n_k, q_block=flex_tile)

        block_mask = build()
        fn = flex_call(q, k, v, block_mask, flex_spec)
        diff = _rel_diff(fn(), ours)
        record(name, "flex (tile union + membership mask_mod)", _bench(fn), flops, lists=kind,
               rel_diff_vs_kernelgen=f"{diff:.1e}", visited_blocks=int(block_mask.kv_num_blocks.sum()
                                                                      + block_mask.full_kv_num_blocks.sum()))
        record(name, "flex membership + BlockMask build", _bench(build), 0.0, lists=kind)
    attempt(name, "FlexAttention", flex)

    def fla():
        reason = fla_nsa_unsupported(given)
        if reason:
            log(f"{name}: fla NSA skipped: {reason}")
            return
        try:
            from fla.ops.nsa.parallel import ParallelNSAFunction
        except ImportError as error:
            log(f"{name}: fla NSA skipped: fla-core is not importable ({error})")
            return
        # its layout: q [B, T, Hq, D], k/v [B, T, Hkv, D], lists [B, T, Hkv, S] (transposed before timing)
        qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        indices = lists.transpose(1, 2).contiguous()
        scale = shape.head_dim ** -0.5

        def call():
            return ParallelNSAFunction.apply(qt, kt, vt, indices, given.top_k, shape.kv_block, scale, None)

        with torch.no_grad():
            diff = _rel_diff(call().transpose(1, 2), ours)
            fwd = _bench(call)
        times = _timed(call, [qt, kt, vt], torch.randn_like(qt))
        record(name, "fla ParallelNSAFunction", fwd, flops, lists=kind, fwd_bwd_ms=times["fwd_bwd_ms"],
               fwd_bwd_graph_ms=times["fwd_bwd_graph_ms"], rel_diff_vs_kernelgen=f"{diff:.1e}")
    attempt(name, "fla NSA", fla)
    return ours


def _dense_row(name, shape, q, k, v, record, attempt):
    """Dense SDPA on cuDNN, forward and forward+backward: every visible pair, whatever the lists."""
    def sdpa():
        from torch.nn.attention import sdpa_kernel

        anchor = sdpa_dense_anchors(*(x.detach().requires_grad_() for x in (q, k, v)), shape.spec("given"))[0]
        with sdpa_kernel(anchor.backend):
            with torch.no_grad():
                fwd = _bench(anchor.fn)
            times = _timed(anchor.fn, list(anchor.leaves), torch.randn_like(q))
        record(name, anchor.label, fwd, dense_flops(shape), fwd_bwd_ms=times["fwd_bwd_ms"],
               fwd_bwd_graph_ms=times["fwd_bwd_graph_ms"])
    attempt(name, "sdpa cudnn (dense)", sdpa)

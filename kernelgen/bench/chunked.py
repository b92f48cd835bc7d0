"""`kernelgen bench --chunked`: a prefill chunk over a KV cache of per-row lengths (a serving engine's chunked
prefill, a static cache's next prompt), kernelgen's one call against the ways to run it without one.

For each shape, in one process on one GPU (bf16; B8 Hq32 Hkv8 D128, causal, 128-key blocks and Q tiles, top-16,
one sink and two local blocks; a cache of capacity N whose rows hold N down to about N/2 keys,
`roles.cache_rows_lengths`, the chunk's queries the last of each row's keys):
- kernelgen over the `mean` selector's lists, given: one call with `cache_seqlens=` (the `attn_rows` role), and a
  call per row over its own keys (what such a batch costs without it);
- the whole `mean` pipeline (selection and attention), one call and a call per row; per-query lists (the
  KV-centric schedule) one call (the `kv_attn_rows` role) and a call per row;
- the same one calls over the cache scattered in shuffled pages of PAGE_BLOCKS blocks, and of SMALL_PAGE keys (a
  block over several pages) (`block_table=`: the `attn_paged` and `kv_attn_paged` roles), compared with the
  contiguous call (`max_abs_vs_contiguous`);
- FlexAttention (torch.compile'd) over a BlockMask of the same lists with the rows' lengths
  (`to_block_mask(..., cache_seqlens=)`);
- SDPA with the rows' mask (causal from each row's own diagonal AND its keys: SDPA's memory-efficient kernel)
  over the whole capacity.
Shape mixed_32k is a serving step instead: rows of a 32k cache in shuffled pages of 512 keys with different
query counts (MIXED_COUNTS: two prefill chunks, decode rows, a speculative row of 4), the `mean` selector with kept
reps: `attn.varlen` over the cache (one call, the rows grouped by query count) and the same with the rows' new
tokens written first (`k_new=`), a call per row, and dense FlashAttention varlen (`aten._flash_attention_forward`,
each row's keys packed, causal from each row's end) over the same rows; with the host's time to enqueue one call
(`host_ms`), since such a step is short enough for the host to be the slower, and graph replays where a graph can
hold the call (not varlen: it reads its bounds on the host).
Forward only (a call over per-row lengths has no backward), do_bench medians; graph_ms: the same call replayed
from a CUDA graph (one-call rows). Useful TFLOP/s count 4 * D * the visible pairs inside each row's listed
blocks. The one call's output is compared with the calls per row (`max_abs_vs_rows`: 0 when they agree bit for
bit) and FlexAttention's with the one call's (`max_abs_vs_kernelgen`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..dispatch import get_kernel
from ..errors import KernelgenRuntimeError
from ..interop import to_block_mask
from ..reference import scatter_pages
from ..roles import cache_rows_lengths
from ..spec import DEFAULT_Q_TILE, Spec
from ..workloads import useful_flops
from .anchors import flex_kernel_options
from .measure import _bench_graph, _dump_rows, host_ms, row_attempts

__all__ = ["run_chunked", "CHUNKED_SHAPES", "mixed_step"]

MIXED_COUNTS = (2048, 512, 1, 1, 1, 1, 1, 4)  # a serving step's rows: two prefill chunks, decode rows, speculation
# (queries a row, or each row's, capacity)
CHUNKED_SHAPES = {"chunk512_32k": (512, 32768), "chunk2048_32k": (2048, 32768), "mixed_32k": (MIXED_COUNTS, 32768)}
MIXED_PAGE = 512
BATCH, HEADS_KV, GROUP, HEAD_DIM = 8, 8, 4, 128
SPEC = Spec(head_dim=HEAD_DIM, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=GROUP, sink=1, local=2)
PAGE_BLOCKS = (1, 4)  # KV blocks a page of the paged cache
SMALL_PAGE = 16  # keys a page of the paged cache whose blocks span pages (vLLM's default block_size)


def run_chunked(shape_names=None, out_dir=None, log=print) -> list[dict]:
    """Rows: shape, impl, fwd_ms, graph_ms, tflops (and the comparisons above); with `out_dir`, also chunked.json
    there."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        raise KernelgenRuntimeError("bench --chunked needs a CUDA GPU: it times kernels")
    rows: list[dict] = []
    attempt = row_attempts(log)
    selecting, given = get_kernel(SPEC), get_kernel(SPEC.replace(selector="given"))
    per_query = get_kernel(SPEC.replace(schedule="kv_centric", q_tile=DEFAULT_Q_TILE))
    flex = torch.compile(flex_attention, dynamic=False)
    for name in shape_names or CHUNKED_SHAPES:
        n_q, n = CHUNKED_SHAPES[name]
        if isinstance(n_q, tuple):
            _mixed_rows(name, n_q, n, selecting, rows, attempt, log, out_dir)
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(BATCH, h, m, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h, m in ((HEADS_KV * GROUP, n_q), (HEADS_KV, n), (HEADS_KV, n)))
        lens = cache_rows_lengths(BATCH, n, "cuda")
        lengths = lens.tolist()
        with torch.no_grad():
            lists = selecting.select(q, k, cache_seqlens=lens)
        flops = sum(useful_flops(lists[b:b + 1], SPEC, n_q, m) for b, m in enumerate(lengths))
        rows_k = [(k[b:b + 1, :, :m], v[b:b + 1, :, :m]) for b, m in enumerate(lengths)]
        positions = torch.arange(n, device="cuda")
        query_at = lens[:, None] - n_q + torch.arange(n_q, device="cuda")[None, :]  # [B, Nq]: each query's key position
        mask = (positions[None, None, :] <= query_at[:, :, None]) & (positions[None, None, :] < lens[:, None, None])
        kd, vd = (x.repeat_interleave(GROUP, 1) for x in (k, v))
        block_mask = to_block_mask(lists, SPEC, n_q, n, cache_seqlens=lens, exact_mask_mod=False)

        def one_call(kernel, **extra):
            return lambda: kernel(q, k, v, cache_seqlens=lens, **extra)

        def per_row(kernel, with_lists=False):
            return lambda: torch.cat([kernel(q[b:b + 1], *row, **({"block_idx": lists[b:b + 1]} if with_lists else {}))
                                      for b, row in enumerate(rows_k)])

        def flex_call():
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=flex_kernel_options(SPEC))

        def sdpa_masked():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, attn_mask=mask[:, None])

        def paged_rows(page):
            """The one calls over the cache in shuffled pages of `page` keys."""
            order = torch.randperm(BATCH * n // page, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            table = order.view(BATCH, -1).to(torch.int32)
            pools = [scatter_pages(x, page, order) for x in (k, v)]

            def paged_call(kernel, **extra):
                return lambda: kernel(q, *pools, cache_seqlens=lens, block_table=table, **extra)

            calls = [(f"kernelgen given lists, one call over pages of {page}", paged_call(given, block_idx=lists),
                      one_call(given, block_idx=lists), flops),
                     (f"kernelgen mean (select+attend), one call over pages of {page}", paged_call(selecting),
                      one_call(selecting), flops),
                     (f"kernelgen mean per-query (select+attend), one call over pages of {page}",
                      paged_call(per_query), one_call(per_query), None)]
            with torch.no_grad():
                return [(impl, fn, useful, True, {"max_abs_vs_contiguous": (fn() - contiguous()).abs().max().item()})
                        for impl, fn, contiguous, useful in calls]

        with torch.no_grad():
            ours = one_call(given, block_idx=lists)()
            compare = {"max_abs_vs_rows": (ours - per_row(given, True)()).abs().max().item()}
        impls = [("kernelgen given lists, one call (cache_seqlens)", one_call(given, block_idx=lists), flops, True,
                  compare),
                 ("kernelgen given lists, a call per row", per_row(given, True), flops, False, {}),
                 ("kernelgen mean (select+attend), one call", one_call(selecting), flops, True, {}),
                 ("kernelgen mean (select+attend), a call per row", per_row(selecting), flops, False, {}),
                 ("kernelgen mean per-query (select+attend), one call", one_call(per_query), None, True, {}),
                 ("kernelgen mean per-query (select+attend), a call per row", per_row(per_query), None, False, {}),
                 *(row for page in (*(blocks * SPEC.kv_block for blocks in PAGE_BLOCKS), SMALL_PAGE)
                   for row in paged_rows(page)),
                 ("flex (same lists, rows' lengths)", flex_call, flops, True, {}),
                 ("sdpa efficient (rows' mask, dense)", sdpa_masked, None, False, {})]
        for impl, fn, useful, graphed, extra in impls:
            def timed(impl=impl, fn=fn, useful=useful, graphed=graphed, extra=extra):
                with torch.no_grad():
                    if impl.startswith("flex"):
                        extra = {"max_abs_vs_kernelgen": (fn() - ours).abs().max().item()}
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    graph_ms = _bench_graph(fn, log=log) if graphed else None
                tflops = None if useful is None else round(useful / ms / 1e9, 1)
                rows.append(dict(shape=name, impl=impl, n_q=n_q, n_k=n, lengths=lengths, fwd_ms=round(ms, 4),
                                 graph_ms=None if graph_ms is None else round(graph_ms, 4), tflops=tflops, **extra))
                log(f"{name:14s} {impl:58s} fwd {ms:8.3f} ms  graph {graph_ms or float('nan'):8.3f} ms  "
                    f"{tflops or '':>6} TFLOP/s " + " ".join(f"{key}={value:.3g}" for key, value in extra.items()))
                _dump_rows(rows, out_dir, "chunked.json")

            attempt(name, impl, timed)
    return rows


class MixedStep(NamedTuple):
    """A serving step's inputs (module docstring): packed queries of rows of `counts` queries over a paged cache."""
    q_rows: list  # each row's queries [1, Hq, count, D]
    packed: torch.Tensor  # the same packed, [total, Hq, D]
    bounds: torch.Tensor  # cu_seqlens of the queries, int32 [B + 1]
    k: torch.Tensor  # the cache, contiguous [B, Hkv, n, D]
    v: torch.Tensor
    k_pages: torch.Tensor  # the same in shuffled pages of MIXED_PAGE keys
    v_pages: torch.Tensor
    table: torch.Tensor  # int32 [B, n / MIXED_PAGE]
    lens: torch.Tensor  # the rows' lengths after the step, int32 [B]
    lengths: list[int]  # the same on the host


def mixed_step(counts=MIXED_COUNTS, n: int = 32768) -> MixedStep:
    """The bench's mixed_32k step (bf16 on the current GPU), also what tools/host_time.py times."""
    batch = len(counts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(batch, HEADS_KV, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    lens = cache_rows_lengths(batch, n, "cuda")
    q_rows = [torch.randn(1, HEADS_KV * GROUP, c, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
              for c in counts]
    packed = torch.cat([x[0].transpose(0, 1) for x in q_rows])
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    order = torch.randperm(batch * n // MIXED_PAGE, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    k_pages, v_pages = (scatter_pages(x, MIXED_PAGE, order) for x in (k, v))
    return MixedStep(q_rows, packed, bounds, k, v, k_pages, v_pages, order.view(batch, -1).to(torch.int32), lens,
                     lens.tolist())


def _mixed_rows(name, counts, n, selecting, rows, attempt, log, out_dir) -> None:
    """A serving step's rows (module docstring): rows of `counts` queries over a paged cache of capacity n."""
    import triton.testing

    batch = len(counts)
    step = mixed_step(counts, n)
    q_rows, packed, bounds, k, v, k_pages, v_pages, table, lens, lengths = step
    before = lens - torch.tensor(counts, dtype=torch.int32, device="cuda")  # the writing step's rows before it
    new = [torch.cat([x[b, :, m - c:m].transpose(0, 1) for b, (c, m) in enumerate(zip(counts, lengths))])
           for x in (k, v)]  # the keys already there: the writing step rewrites them
    with torch.no_grad():
        reps = selecting.key_reps(k_pages, cache_seqlens=lens, block_table=table)
        row_reps = [reps.index_batch(slice(b, b + 1)) for b in range(batch)]
        lists = [selecting.select(q_rows[b], k_pages, cache_seqlens=lens[b:b + 1], block_table=table[b:b + 1],
                                  key_reps=row_reps[b]) for b in range(batch)]
    flops = sum(useful_flops(lists[b], SPEC, c, m) for b, (c, m) in enumerate(zip(counts, lengths)))
    k_packed, v_packed = (torch.cat([x[b, :, :m].transpose(0, 1) for b, m in enumerate(lengths)]) for x in (k, v))
    bounds_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def one_call():
        return selecting.varlen(packed, k_pages, v_pages, bounds, cache_seqlens=lens, block_table=table,
                                key_reps=reps)

    def writing_call():
        return selecting.varlen(packed, k_pages, v_pages, bounds, cache_seqlens=before, block_table=table,
                                key_reps=reps, k_new=new[0], v_new=new[1])

    def per_row():
        return [selecting(q_rows[b], k_pages, v_pages, cache_seqlens=lens[b:b + 1], block_table=table[b:b + 1],
                          key_reps=row_reps[b]) for b in range(batch)]

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(packed, k_packed, v_packed, bounds, bounds_k, max(counts),
                                                       max(lengths), 0.0, True, False)[0]

    with torch.no_grad():
        ours = one_call()
        mine = torch.cat([o[0].transpose(0, 1) for o in per_row()])
        compare = {"max_abs_vs_rows": (ours - mine).abs().max().item()}
    impls = [("kernelgen mean, varlen over the paged cache (one call)", one_call, flops, compare),
             ("kernelgen mean, varlen writing the rows' tokens (k_new=)", writing_call, flops, {}),
             ("kernelgen mean, a call per row", per_row, flops, {}),
             ("flash varlen (dense, rows' keys packed)", flash_varlen, None, {})]
    for impl, fn, useful, extra in impls:
        def timed(impl=impl, fn=fn, useful=useful, extra=extra):
            with torch.no_grad():
                ms = triton.testing.do_bench(fn, return_mode="median")
                graph_ms = None if impl.startswith("kernelgen mean, varlen") else _bench_graph(fn, log=log)
                enqueue_ms = host_ms(fn)
            tflops = None if useful is None else round(useful / (graph_ms or ms) / 1e9, 1)
            rows.append(dict(shape=name, impl=impl, n_q=list(counts), n_k=n, lengths=lengths, fwd_ms=round(ms, 4),
                             graph_ms=None if graph_ms is None else round(graph_ms, 4), host_ms=round(enqueue_ms, 4),
                             tflops=tflops, **extra))
            log(f"{name:14s} {impl:58s} fwd {ms:8.3f} ms  graph {graph_ms or float('nan'):8.3f} ms  host "
                f"{enqueue_ms:8.3f} ms  {tflops or '':>6} TFLOP/s "
                + " ".join(f"{key}={value:.3g}" for key, value in extra.items()))
            _dump_rows(rows, out_dir, "chunked.json")

        attempt(name, impl, timed)

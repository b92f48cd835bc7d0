"""New keys written into a KV cache by the call that attends over it (`k_new=`, `v_new=`; the index selector's
`k_idx_new=`), as flash_attn_with_kvcache's k= and v=: row b's new tokens go at cache_seqlens[b] (through the
block table of a paged cache), and the call is the call over the rows grown by them, bit for bit. Positions past
the capacity, or in a page outside the pool, are not written."""
import pytest
import torch

from kernelgen import Spec, custom_ops, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError

from checks import assert_close_to_reference
from test_cache_seqlens import _cache, _index, _spec
from test_decode import random_lists
from test_paged_kv import paged

CAPACITY = 96
LENGTHS = (96, 37, 0, 48, 94)  # a full row (nothing written), a partial block, an empty row, a block edge, near full


def _new_tokens(q, n_new, seed=7, heads=None, width=None):
    gen = torch.Generator().manual_seed(seed)
    b, hq, _, d = q.shape
    shape = (b, heads or hq // 2, n_new, width or d)  # _cache's group of 2
    return torch.randn(*shape, generator=gen).to(device=q.device, dtype=q.dtype)


def _same(a, b):
    """Bitwise equal, NaN where NaN (a pool's unlisted pages are NaN)."""
    return a.shape == b.shape and torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)) and \
        torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("schedule, selector, n_new, dtype, layout", [
    ("q_centric", "mean", 1, torch.float32, "contiguous"),
    ("q_centric", "multi:2", 3, torch.float16, "paged"),
    ("q_centric", "given", 20, torch.float32, "leftpad"),    # a prefill chunk: more queries than a decode call's
    ("kv_centric", "mean", 2, torch.float16, "leftpad"),
    ("kv_centric", "given", 1, torch.float32, "paged"),
    ("kv_centric", "multi:2", 20, torch.float16, "paged")])
def test_new_keys_are_written_at_each_row_s_end_then_attended(schedule, selector, n_new, dtype, layout, device):
    """The caches after the call are `reference.appended`'s bit for bit (a row at capacity keeps its keys), and o,
    lse equal the call over the grown rows without k_new (the caller's write), bit for bit, and match the float64
    reference of the call with k_new."""
    spec = _spec(selector, schedule)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(n_new, dtype, device, capacity=CAPACITY, lengths=LENGTHS)
    k_new, v_new = _new_tokens(q, n_new), _new_tokens(q, n_new, seed=8)
    pads = torch.tensor([3, 16, 0, 0, 40], dtype=torch.int32, device=device) if layout == "leftpad" else None
    table = None
    if layout == "paged":
        k, table = paged(k, 32)
        v, _ = paged(v, 32, table=table.cpu())
    block_idx = None
    if selector == "given":
        block_idx = random_lists(spec, q.shape[0], 2, n_new, CAPACITY, seed=3).to(device)
    options = dict(block_idx=block_idx, cache_seqlens=lens, cache_leftpad=pads, block_table=table, return_lse=True)
    k_want, after = reference.appended(k, k_new, lens, table)
    v_want, _ = reference.appended(v, v_new, lens, table)
    assert after.tolist() == [96, 37 + n_new, n_new, 48 + n_new, min(94 + n_new, 96)]
    k_call, v_call = k.clone(), v.clone()
    o, lse = attn(q, k_call, v_call, k_new=k_new, v_new=v_new, **options)
    assert _same(k_call, k_want) and _same(v_call, v_want)
    o_grown, lse_grown = attn(q, k_want, v_want, **{**options, "cache_seqlens": after})
    assert torch.equal(o, o_grown) and torch.equal(lse, lse_grown)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec if block_idx is None else spec.replace(
        selector="given"), block_idx, cache_seqlens=lens, cache_leftpad=pads, block_table=table, k_new=k_new,
        v_new=v_new)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("schedule, layout", [("kv_centric", "contiguous"), ("q_centric", "paged")])
def test_the_index_selector_writes_its_index_keys_beside_them(schedule, layout, device):
    """DSA's decode step: k_idx_new goes into k_idx (shared key head, or a pool paged as k is) at the same
    positions, and the step selects and attends over the grown rows, bit for bit."""
    spec = _spec("index", schedule)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=CAPACITY, lengths=LENGTHS)
    q_idx, k_idx, w = _index(q, CAPACITY, shared_key=layout == "paged")
    k_new, v_new = _new_tokens(q, 1), _new_tokens(q, 1, seed=8)
    k_idx_new = _new_tokens(q, 1, seed=9, heads=k_idx.shape[1], width=k_idx.shape[3])
    table = None
    if layout == "paged":
        k, table = paged(k, 32)
        v, _ = paged(v, 32, table=table.cpu())
        k_idx, _ = paged(k_idx, 32, table=table.cpu())
    k_call, v_call, k_idx_call = k.clone(), v.clone(), k_idx.clone()
    o, lse = attn(q, k_call, v_call, index=(q_idx, k_idx_call, w), cache_seqlens=lens, block_table=table,
                  k_new=k_new, v_new=v_new, k_idx_new=k_idx_new, return_lse=True)
    k_idx_want, after = reference.appended(k_idx, k_idx_new, lens, table)
    assert _same(k_idx_call, k_idx_want) and _same(k_call, reference.appended(k, k_new, lens, table)[0])
    assert torch.equal(o, attn(q, k_call, v_call, index=(q_idx, k_idx_call, w), cache_seqlens=after,
                               block_table=table))
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, index=(q_idx, k_idx, w), cache_seqlens=lens,
                                                   block_table=table, k_new=k_new, v_new=v_new, k_idx_new=k_idx_new)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)


def test_a_decode_loop_with_kept_reps_equals_a_fresh_call_each_step(device):
    """Five decode steps, each writing its token and growing the kept representatives in the call: each step's
    o equals the step over the grown cache with reps pooled afresh, bit for bit."""
    spec = _spec("multi:2", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float16, device, capacity=64, lengths=(30, 0, 47, 15, 63))
    reps = attn.key_reps(k, cache_seqlens=lens)
    for step in range(5):
        k_new, v_new = _new_tokens(q, 1, seed=20 + step), _new_tokens(q, 1, seed=40 + step)
        o = attn(q, k, v, cache_seqlens=lens, key_reps=reps, k_new=k_new, v_new=v_new)
        lens = (lens + 1).clamp(max=64)
        assert torch.equal(reps.seqlens[:, 0], lens)
        assert torch.equal(o, attn(q, k, v, cache_seqlens=lens)), step


def test_positions_past_the_capacity_or_in_no_page_are_not_written(device):
    """A row near capacity writes what fits, a negative length writes from 0, and a position whose page id is
    outside the pool (a hole, a junk entry) is skipped: nothing else in the pools changes."""
    spec = _spec("mean", "kv_centric")
    attn = get_kernel(spec)
    q, k, v, _ = _cache(4, torch.float32, device, capacity=64, lengths=(0, 0, 0, 0, 0))
    lens = torch.tensor([62, -5, 30, 64, 10], dtype=torch.int32, device=device)
    k_new, v_new = _new_tokens(q, 4), _new_tokens(q, 4, seed=8)
    k_call = k.clone()
    attn(q, k_call, v.clone(), cache_seqlens=lens, k_new=k_new, v_new=v_new)
    assert _same(k_call, reference.appended(k, k_new, lens)[0])
    assert torch.equal(k_call[0, :, 62:], k_new[0, :, :2]) and torch.equal(k_call[1, :, :4], k_new[1, :, :4])
    assert torch.equal(k_call[3], k[3])  # full: nothing written
    pages, table = paged(k, 16)
    v_pages, _ = paged(v, 16, table=table.cpu())
    table[2, 2] = 10_000  # row 2's positions 32-47: a junk page id; row 4's 0-15: another
    table[4, 0] = -1
    table = table.to(device)
    pages_call = pages.clone()
    attn(q, pages_call, v_pages, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new)
    assert _same(pages_call, reference.appended(pages, k_new, lens, table)[0])
    assert not _same(pages_call, pages)  # something was written


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_new_keys_that_are_a_view_of_the_cache_are_read_before_the_write(schedule, device):
    """k_new and v_new as views of the cache overlapping the positions they go to (k's keys moved back by two; v_new
    a view of k): the call reads them as they were, as the reference does. A prefill chunk's write goes a chunk at a
    time, and once read keys it had already overwritten (o and the cache wrong, silently)."""
    spec = _spec("given", schedule)
    attn = get_kernel(spec)
    q, k, v, _ = _cache(20, torch.float32, device, capacity=96, lengths=(60,))
    lists = random_lists(spec, 1, 2, 20, 80, seed=3).to(device)
    lens = torch.tensor([60], dtype=torch.int32, device=device)
    k_new, v_new = k[:, :, 58:78], k[:, :, 50:70]
    k0, v0, k_new0, v_new0 = (x.clone() for x in (k, v, k_new, v_new))
    want_o, want_lse = reference.sparse_attention(q, k0, v0, spec, lists, cache_seqlens=lens, k_new=k_new0,
                                                  v_new=v_new0)[:2]
    o, lse = attn(q, k, v, block_idx=lists, cache_seqlens=lens, k_new=k_new, v_new=v_new, return_lse=True)
    assert _same(k, reference.appended(k0, k_new0, lens)[0]) and _same(v, reference.appended(v0, v_new0, lens)[0])
    assert_close_to_reference(o, lse, want_o, want_lse, torch.float32)


def test_a_compiled_step_writes_and_attends_as_the_eager_one(device):
    """Under torch.compile (fullgraph) the write is an op of its own that mutates the caches: the compiled step's
    caches and o equal the eager step's."""
    spec = _spec("mean", "kv_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=CAPACITY, lengths=LENGTHS)
    k_new, v_new = _new_tokens(q, 1), _new_tokens(q, 1, seed=8)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, k_new, v_new, lens):
        return attn(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new) * 2

    k_eager, v_eager, k_compiled, v_compiled = k.clone(), v.clone(), k.clone(), v.clone()
    o_eager = attn(q, k_eager, v_eager, cache_seqlens=lens, k_new=k_new, v_new=v_new) * 2
    assert torch.equal(step(q, k_compiled, v_compiled, k_new, v_new, lens), o_eager)
    assert torch.equal(k_compiled, k_eager) and torch.equal(v_compiled, v_eager)
    k_op = k.clone()
    o_op, _ = custom_ops.sparse_attention(q, k_op, v.clone(), spec, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    assert torch.equal(o_op * 2, o_eager) and torch.equal(k_op, k_eager)


def test_inductor_writes_into_the_cache_itself(device):
    """Inductor (the default torch.compile backend) hands the caller's caches to the write op itself: no copy of
    a cache per step, which at a serving cache's size would cost more than the step."""
    from torch._inductor.utils import run_and_get_code

    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=CAPACITY, lengths=LENGTHS)
    k_new, v_new = _new_tokens(q, 1), _new_tokens(q, 1, seed=8)
    k_eager, v_eager = k.clone(), v.clone()
    o_eager = attn(q, k_eager, v_eager, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    step = torch.compile(lambda q, k, v, k_new, v_new, lens: attn(q, k, v, cache_seqlens=lens, k_new=k_new,
                                                                   v_new=v_new), fullgraph=True)
    o, codes = run_and_get_code(step, q, k, v, k_new, v_new, lens)
    assert torch.equal(o, o_eager) and torch.equal(k, k_eager) and torch.equal(v, v_eager)
    code = "\n".join(codes)
    assert "kernelgen.append_kv.default(arg" in code and "clone" not in code, code


def test_bad_new_keys_are_named_and_nothing_is_written(device):
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=CAPACITY, lengths=LENGTHS)
    k_new, v_new = _new_tokens(q, 1), _new_tokens(q, 1, seed=8)
    k_before = k.clone()
    cases = [
        (KernelgenValueError, "k_new= and v_new= go together", dict(k_new=k_new)),
        (KernelgenValueError, "needs cache_seqlens", dict(k_new=k_new, v_new=v_new, cache_seqlens=None)),
        (KernelgenTypeError, "k_new.dtype", dict(k_new=k_new.half(), v_new=v_new)),
        (KernelgenValueError, r"k_new.shape = \(5, 4, 1, 64\)", dict(k_new=torch.cat([k_new, k_new], 1), v_new=v_new)),
        (KernelgenValueError, "v_new has 2 new tokens", dict(k_new=k_new, v_new=torch.cat([v_new, v_new], 2))),
        (KernelgenTypeError, "k_new must be a torch.Tensor", dict(k_new=k_new.tolist(), v_new=v_new)),
        (KernelgenValueError, "k_idx_new= is the index selector's", dict(k_new=k_new, v_new=v_new,
                                                                          k_idx_new=k_new)),
        (KernelgenValueError, "requires grad", dict(k_new=k_new.clone().requires_grad_(), v_new=v_new)),
        (KernelgenValueError, "padded batch", dict(k_new=k_new, v_new=v_new, cache_seqlens=None, seqlens=lens)),
        # what the forward checks after the write is checked before it too: a refused call writes nothing
        (KernelgenTypeError, "scale must be a finite real", dict(k_new=k_new, v_new=v_new, scale="0.1")),
        (KernelgenValueError, "key_reps were made for kv_block", dict(
            k_new=k_new, v_new=v_new, key_reps=get_kernel(spec.replace(kv_block=32)).key_reps(k, cache_seqlens=lens))),
        (KernelgenValueError, "pass block_idx= or key_reps=", dict(
            k_new=k_new, v_new=v_new, key_reps=attn.key_reps(k, cache_seqlens=lens),
            block_idx=random_lists(spec, 5, 2, 1, CAPACITY, seed=2).to(device))),
    ]
    for error, match, kwargs in cases:
        with pytest.raises(error, match=match):
            attn(q, k, v, **{"cache_seqlens": lens, **kwargs})
        assert torch.equal(k, k_before), match
    with pytest.raises(KernelgenValueError, match="have no backward"):  # refused before the write
        attn(q, k.clone().requires_grad_(), v, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    given = get_kernel(spec.replace(selector="given"))
    with pytest.raises(KernelgenValueError, match="block_idx"):
        given(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new, block_idx=torch.zeros(5, 2, 1, 2,
                                                                                            dtype=torch.int32))
    with pytest.raises(KernelgenValueError, match="padded batch"):
        custom_ops.sparse_attention(q, k, v, spec, cache_seqlens=lens, seqlens=lens, k_new=k_new, v_new=v_new)
    with pytest.raises(KernelgenTypeError, match="scale must be a finite real"):
        custom_ops.sparse_attention(q, k, v, spec, cache_seqlens=lens, k_new=k_new, v_new=v_new, scale="0.1")
    assert torch.equal(k, k_before)
    index_spec = _spec("index", "kv_centric")
    q_idx, k_idx, w = _index(q, CAPACITY)
    with pytest.raises(KernelgenValueError, match="needs it"):  # the new tokens' index keys left out
        get_kernel(index_spec)(q, k, v, index=(q_idx, k_idx, w), cache_seqlens=lens, k_new=k_new, v_new=v_new)
    with pytest.raises(KernelgenValueError, match="index: w.shape"):  # a refused index: refused before the write
        get_kernel(index_spec)(q, k, v, index=(q_idx, k_idx, w[:, :1]), cache_seqlens=lens, k_new=k_new,
                               v_new=v_new, k_idx_new=_new_tokens(q, 1, heads=2, width=32))
    assert torch.equal(k, k_before)
    with pytest.raises(KernelgenValueError, match="k_new= and v_new= go together"):
        custom_ops.sparse_attention(q, k, v, spec, cache_seqlens=lens, v_new=v_new)


@pytest.mark.gpu
def test_an_autocast_copy_of_the_cache_is_refused():
    """Under torch.autocast a float32 cache would be cast to a copy, which the write would reach instead."""
    spec = _spec("mean", "q_centric")
    q, k, v, lens = _cache(1, torch.float32, "cuda", capacity=CAPACITY, lengths=LENGTHS)
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(KernelgenValueError, match="a copy"):
        get_kernel(spec)(q, k, v, cache_seqlens=lens, k_new=_new_tokens(q, 1).bfloat16(),
                         v_new=_new_tokens(q, 1).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, selector, layout", [("q_centric", "mean", "paged"),
                                                        ("kv_centric", "index", "contiguous"),
                                                        ("kv_centric", "mean", "paged")])
def test_a_graph_of_a_decode_step_that_appends_replays_on_gpu(schedule, selector, layout):
    """A bf16 decode step over 16k-key rows (and an empty one) that writes its token, captured once as a CUDA graph
    and replayed for eight tokens with the lengths advanced in place: each replay's o equals the eager step's over
    the same cache, and the caches equal the reference's writes."""
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=1, sink=1,
                selector=selector, **({} if schedule == "kv_centric" else {"q_tile": 16}))
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.bfloat16, "cuda", 16384, (16000, 9000, 0, 16380), heads_kv=2, group=4,
                           head_dim=128)
    table = None
    if layout == "paged":
        k, table = paged(k, 256)
        v, _ = paged(v, 256, table=table.cpu())
    gen = torch.Generator("cuda").manual_seed(5)
    index, k_idx_new = None, None
    if selector == "index":
        index = (torch.randn(4, 8, 1, 64, device="cuda", generator=gen).bfloat16(),
                 torch.randn(4, 1, 16384, 64, device="cuda", generator=gen).bfloat16(),
                 torch.rand(4, 8, 1, device="cuda", generator=gen))
        k_idx_new = torch.empty(4, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.empty(4, 2, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    options = dict(index=index, block_table=table, cache_seqlens=lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = attn(q, k, v, k_new=k_new, v_new=v_new, k_idx_new=k_idx_new, **options)
    for step in range(8):
        for new in (k_new, v_new, k_idx_new, q):
            if new is not None:
                new.copy_(torch.randn(new.shape, device="cuda", generator=gen))
        k_want = reference.appended(k, k_new, lens, table)[0]
        graph.replay()
        assert _same(k, k_want), step
        lens.add_(1).clamp_(max=16384)
        assert torch.equal(replayed, attn(q, k, v, **options)), step

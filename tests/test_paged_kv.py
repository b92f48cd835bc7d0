"""Calls over a paged KV cache (`block_table=`): k and v are pools of pages [n_pages, Hkv, page_size, D] and row b's
key p sits in page block_table[b, p // page_size]. A paged decode call is the call over the contiguous cache its
pages make (`reference.gather_pages`), bit for bit: the same lists, o and lse, and the same kept representatives.
A paged prefill chunk (more than 16 queries) selects the contiguous call's lists, bit for bit, and attends with
kernels of its own (`attn_paged`, `kv_attn_paged`): o and lse match the float64 reference, and the contiguous
cache's call bit for bit where the same steps run."""
import dataclasses

import pytest
import torch

from kernelgen import AttnConfig, DecodeConfig, Spec, custom_ops, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError
from kernelgen.roles import forward_roles

from checks import assert_close_to_reference, assert_valid_selection
from test_cache_seqlens import _cache, _index, _spec
from test_decode import random_lists

LENGTHS = (96, 37, 0, 48, 1)  # a full row, a partial block, an empty row, a page boundary, one key
SPARE_PAGES = 3  # pages no row lists: the pool is larger than the rows need


def paged(x: torch.Tensor, page_size: int, seed: int = 0, table: torch.Tensor | None = None):
    """x [B, H, N, D] scattered over a pool of pages in a random order, SPARE_PAGES more than the rows need (NaN,
    as is every page no row lists: a read of one would show), and its table int32 [B, N / page_size]."""
    b, n = x.shape[0], x.shape[2]
    if table is None:
        order = torch.randperm(b * n // page_size + SPARE_PAGES, generator=torch.Generator().manual_seed(seed))
        table = order[:b * n // page_size].view(b, -1).to(torch.int32)
    return reference.scatter_pages(x, page_size, table.flatten().long(), SPARE_PAGES), table.to(x.device)


def _paged_cache(n_q, dtype, device, page_size, lengths=LENGTHS, **kw):
    q, k, v, lens = _cache(n_q, dtype, device, capacity=96, lengths=lengths, **kw)
    k_pages, table = paged(k, page_size)
    v_pages, _ = paged(v, page_size, table=table.cpu())
    return q, k, v, lens, k_pages, v_pages, table


@pytest.mark.parametrize("schedule, selector, n_q, dtype, page_size, fields", [
    ("q_centric", "mean", 1, torch.float32, 16, {}), ("q_centric", "multi:2", 3, torch.float16, 32, {}),
    ("kv_centric", "mean", 2, torch.float32, 32, {}), ("kv_centric", "multi:2", 1, torch.float16, 16, {}),
    # blocks over several pages: vLLM's 16 keys a page under 32-key blocks, SGLang's 1, and 24 (no divisor)
    ("q_centric", "multi:2", 1, torch.float32, 16, {"kv_block": 32}),
    ("kv_centric", "mean", 3, torch.float16, 1, {"kv_block": 32}),
    ("q_centric", "mean", 2, torch.float16, 24, {"kv_block": 32}),
])
def test_a_paged_call_is_the_call_over_its_pages_gathered(schedule, selector, n_q, dtype, page_size, fields, device):
    """Lists, o and lse equal the contiguous cache's call bit for bit, pooled in the call or from kept reps (which
    equal the contiguous cache's, and grow in place as its rows do), and match the float64 reference."""
    spec = _spec(selector, schedule, **fields)
    attn = get_kernel(spec, configs={"decode": DecodeConfig(splits=2)})
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(n_q, dtype, device, page_size)
    assert torch.equal(attn.select(q, k_pages, cache_seqlens=lens, block_table=table),
                       attn.select(q, k, cache_seqlens=lens))
    o, lse = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, return_lse=True)
    o_dense, lse_dense = attn(q, k, v, cache_seqlens=lens, return_lse=True)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec, cache_seqlens=lens, block_table=table)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()  # the empty row
    for b in (0, 3):  # batch invariance: a row with its own table row over the same pool is the batch's row
        alone = attn(q[b:b + 1], k_pages, v_pages, block_table=table[b:b + 1], cache_seqlens=lens[b:b + 1])
        assert torch.equal(alone, o[b:b + 1]), b
    shorter = (lens - 30).clamp(min=0)
    reps = attn.key_reps(k_pages, block_table=table, cache_seqlens=shorter)
    assert reps.seqlens[:, 0].tolist() == shorter.tolist() and reps.n_k == 96
    o_reps = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, key_reps=reps)  # grows them first
    assert torch.equal(o_reps, o)
    assert reps.seqlens[:, 0].tolist() == list(LENGTHS)
    assert torch.equal(reps.reps, attn.key_reps(k, cache_seqlens=lens).reps)


def test_pages_of_one_key_under_a_partial_last_block(device):
    """Token pages (SGLang's page_size 1) of rows of 100 keys under 32-key blocks (a partial last block): kept reps
    made and grown over the pages are the contiguous cache's bits, and the call that reads them is its call."""
    spec = _spec("multi:2", kv_block=32)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(2, torch.float32, device, capacity=100, lengths=(100, 37, 0, 70, 1))
    k_pages, table = paged(k, 1)
    v_pages, _ = paged(v, 1, table=table.cpu())
    reps = attn.key_reps(k_pages, block_table=table, cache_seqlens=lens // 2)
    attn.key_reps(k_pages, block_table=table, cache_seqlens=lens, previous=reps)
    assert torch.equal(reps.reps, attn.key_reps(k, cache_seqlens=lens).reps) and reps.reps.shape[2] == 4
    assert torch.equal(attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, key_reps=reps),
                       attn(q, k, v, cache_seqlens=lens))


def test_without_lengths_every_row_holds_its_pages(device):
    """No cache_seqlens: each row's keys are all its pages hold (its capacity), as a contiguous cache's."""
    spec = _spec("mean")
    attn = get_kernel(spec)
    q, k, v, _, k_pages, v_pages, table = _paged_cache(2, torch.float32, device, 32)
    assert torch.equal(attn(q, k_pages, v_pages, block_table=table), attn(q, k, v))
    reps = attn.key_reps(k_pages, block_table=table)
    assert torch.equal(reps.reps, attn.key_reps(k).reps) and reps.seqlens[:, 0].tolist() == [96] * len(LENGTHS)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_given_lists_over_pages(schedule, device):
    """Given lists (either schedule's), raw ids past a row's keys included, over pages: the contiguous call's bits."""
    spec = _spec("given", schedule)
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(3, torch.float16, device, 16)
    idx = random_lists(spec, len(LENGTHS), 2, 3, 96, seed=5).to(device)
    o = attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens)
    assert torch.equal(o, attn(q, k, v, block_idx=idx, cache_seqlens=lens))
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec, idx, cache_seqlens=lens,
                                                   block_table=table)
    assert_close_to_reference(o, attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens,
                                      return_lse=True)[1], ref_o, ref_lse, torch.float16)


def test_page_ids_outside_the_pool_hold_no_keys(device):
    """A table entry outside [0, n_pages) is never read: past a row's keys it changes nothing; among them its keys
    are masked, as if the lists did not name its blocks."""
    spec = _spec("given")
    attn = get_kernel(spec, configs={"decode": DecodeConfig(splits=1)})
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 32)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=device).expand(len(LENGTHS), 2, 1, 3).contiguous()
    o = attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens)
    unused = table.clone()
    unused[1, 2], unused[4, 1:] = -1, 10**6  # row 1 holds 37 keys (pages 0, 1), row 4 one key (page 0)
    assert torch.equal(attn(q, k_pages, v_pages, block_idx=idx, block_table=unused, cache_seqlens=lens), o)
    holes = table.clone()
    holes[0, 0] = -5  # row 0's page 0: blocks 0 and 1
    without = idx.clone()
    without[0, :, :, :2] = -1
    assert torch.equal(attn(q, k_pages, v_pages, block_idx=idx, block_table=holes, cache_seqlens=lens),
                       attn(q, k_pages, v_pages, block_idx=without, block_table=table, cache_seqlens=lens))
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -5"):
        reference.gather_pages(k_pages, holes, lens)


def test_scattered_pages_gather_back():
    """`reference.scatter_pages` is `gather_pages`'s inverse, and leaves the pages no row lists NaN."""
    x = torch.randn(3, 2, 64, 8)
    order = torch.randperm(3 * 64 // 16 + 2, generator=torch.Generator().manual_seed(0))
    pool = reference.scatter_pages(x, 16, order, spare=2)
    assert pool.shape == (14, 2, 16, 8) and torch.isnan(pool[order[12:]]).all()
    assert torch.equal(reference.gather_pages(pool, order[:12].view(3, -1).to(torch.int32)), x)


def test_the_custom_ops_take_pages(device):
    """kernelgen.custom_ops.sparse_attention and key_reps take block_table= (so torch.compile traces such a step)."""
    spec = _spec("mean")
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 16)
    o, lse = custom_ops.sparse_attention(q, k_pages, v_pages, spec, block_table=table, cache_seqlens=lens)
    assert torch.equal(o, get_kernel(spec)(q, k, v, cache_seqlens=lens))
    reps = custom_ops.key_reps(k_pages, spec, cache_seqlens=(lens - 20).clamp(min=0), block_table=table)
    assert reps.n_k == 96
    o_reps, _ = custom_ops.sparse_attention(q, k_pages, v_pages, spec, block_table=table, cache_seqlens=lens,
                                            key_reps=reps)
    assert torch.equal(o_reps, o) and reps.seqlens[:, 0].tolist() == list(LENGTHS)
    q_chunk = torch.randn(q.shape[0], q.shape[1], N_Q, q.shape[3], device=device)  # a prefill chunk: attn_paged
    o_chunk, _ = custom_ops.sparse_attention(q_chunk, k_pages, v_pages, spec, block_table=table, cache_seqlens=lens)
    assert torch.equal(o_chunk, get_kernel(spec)(q_chunk, k_pages, v_pages, block_table=table, cache_seqlens=lens))
    torch.library.opcheck(torch.ops.kernelgen.sparse_attention.default, (q_chunk, k_pages, v_pages, None,
                                                                         spec.to_json(), None),
                          {"cache_seqlens": lens, "block_table": table}, test_utils=("test_schema", "test_faketensor"))
    for call in (lambda: custom_ops.sparse_attention(q, k_pages, v_pages, spec, block_table=table.tolist()),
                 lambda: custom_ops.key_reps(k_pages, spec, block_table=table.tolist()),
                 lambda: custom_ops.sparse_attention(q, k_pages, v_pages, spec, block_table=table,
                                                     cache_seqlens=lens.tolist())):
        with pytest.raises(KernelgenTypeError, match="must be a torch.Tensor or None, got list"):
            call()


def test_bad_pages_are_named(device):
    spec = _spec("mean")
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 32)
    cases = [
        (dict(block_table=table.long()), KernelgenTypeError, "block_table must be int32"),
        (dict(block_table=table[0]), KernelgenValueError, "block_table must have shape [B, pages a row]"),
        (dict(block_table=table[:2]), KernelgenValueError, "block_table.shape[0] = 2 does not match q.shape[0] = 5"),
        (dict(block_table=table.t().contiguous().t()), KernelgenValueError, "block_table's rows must be contiguous"),
        (dict(block_table=table, cache_leftpad=lens), KernelgenValueError,
         "cache_leftpad= cannot go with block_table="),
        (dict(block_table=table, seqlens=lens), KernelgenValueError, "pass seqlens="),
        (dict(block_table=table, cache_seqlens=lens[:2]), KernelgenValueError, "cache_seqlens must have shape [B]"),
        (dict(block_table=[[0]]), KernelgenTypeError, "block_table must be a torch.Tensor"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            attn(q, k_pages, v_pages, **kwargs)
    with pytest.raises(KernelgenValueError, match=r"k and v must have the same shape.*n_pages, Hkv, page_size"):
        attn(q, k_pages, v_pages[:-1], block_table=table)
    with pytest.raises(KernelgenValueError, match=r"k must be 4-D \[n_pages, Hkv, page_size, D\]"):
        attn(q, k_pages[0], v_pages[0], block_table=table)
    plain = attn.key_reps(k)  # reps of one length: a paged call has per-row lengths
    with pytest.raises(KernelgenValueError, match="made without cache_seqlens=.*block_table= always gives"):
        attn(q, k_pages, v_pages, block_table=table, key_reps=plain)
    with pytest.raises(KernelgenValueError, match=r"make them with attn.key_reps\(k, block_table=...\)"):
        attn.key_reps(k_pages, block_table=table, previous=plain)
    with pytest.raises(KernelgenValueError, match=r"gather_pages takes pages \[n_pages"):
        reference.gather_pages(k_pages, table[0])
    with pytest.raises(KernelgenValueError, match=r"empty input: k \(\d+, 2, 0, 64\)"):  # pages of no keys
        attn(q, k_pages[:, :, :0], v_pages[:, :, :0], block_table=table)
    # FlashAttention's and vLLM's pool [n_pages, page_size, Hkv, D], passed as it is: told to transpose it
    fa_layout = r"but k has 32 .*\[n_pages, page_size, Hkv, D\] as \.transpose\(1, 2\)"
    with pytest.raises(KernelgenValueError, match=fa_layout):
        attn(q, k_pages.transpose(1, 2).contiguous(), v_pages.transpose(1, 2).contiguous(), block_table=table)
    with pytest.raises(KernelgenValueError, match="no backward"):
        attn(q.requires_grad_(), k_pages, v_pages, block_table=table)


N_Q = 40  # more than a decode call's 16: a prefill chunk; more than rows 1, 3 and 4 hold


def _paged_index(q, table, page_size, shared_key=False):
    """The index selector's inputs beside `_paged_cache`'s: (q_idx, k_idx, w) and k_idx's pages, through the same
    table."""
    q_idx, k_idx, w = _index(q, 96, shared_key=shared_key)
    k_idx_pages, _ = paged(k_idx, page_size, table=table.cpu())
    return (q_idx, k_idx, w), (q_idx, k_idx_pages, w)


@pytest.mark.parametrize("schedule, n_q, dtype, page_size, shared_key, fields", [
    ("q_centric", 1, torch.float32, 16, False, {}), ("q_centric", N_Q, torch.float16, 32, True, {}),
    ("kv_centric", 3, torch.float16, 32, True, {}), ("kv_centric", N_Q, torch.float32, 16, False, {}),
    # blocks over several pages of 8 keys
    ("q_centric", N_Q, torch.float32, 8, False, {"kv_block": 32}),
    ("kv_centric", 2, torch.float16, 8, True, {"kv_block": 32})])
def test_the_index_selector_reads_k_idx_from_the_same_pages(schedule, n_q, dtype, page_size, shared_key, fields,
                                                            device):
    """Over a paged cache the index selector reads k_idx from its own pool of pages through the call's block_table:
    lists and o are the contiguous cache's call's bit for bit (a decode call, and a prefill chunk), and match the
    float64 reference; no page outside the rows' is read (every other page of each pool is NaN)."""
    spec = _spec("index", schedule, **fields)
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(n_q, dtype, device, page_size)
    index, paged_index = _paged_index(q, table, page_size, shared_key)
    lists = attn.select(q, k_pages, index=paged_index, cache_seqlens=lens, block_table=table)
    assert torch.equal(lists, attn.select(q, k, index=index, cache_seqlens=lens))
    o, lse = attn(q, k_pages, v_pages, index=paged_index, block_table=table, cache_seqlens=lens, return_lse=True)
    o_dense, lse_dense = attn(q, k, v, index=index, cache_seqlens=lens, return_lse=True)
    if n_q <= 16:  # decode: the same kernel over the same lists
        assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec, index=paged_index,
                                                   cache_seqlens=lens, block_table=table)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    assert not torch.isnan(o).any() and (o[2] == 0).all() and (lists[2] == -1).all()  # the empty row
    for b in (0, 1, 3):  # each row's lists: a valid top-k of its own keys' float64 index scores
        n = int(lens[b])
        row_index = (index[0][b:b + 1], index[1][b:b + 1, :, :n], index[2][b:b + 1])
        assert_valid_selection(lists[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n], spec, index=row_index)


def test_index_pages_outside_the_pool_hold_no_keys(device):
    """A table entry outside [0, n_pages) is never read for k_idx either: past a row's keys it changes nothing;
    among them its keys are no row keys (never scored), and no NaN reaches the lists or o."""
    spec = _spec("index")
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 32)
    _, paged_index = _paged_index(q, table, 32)
    lists = attn.select(q, k_pages, index=paged_index, block_table=table, cache_seqlens=lens)
    unused = table.clone()
    unused[1, 2], unused[4, 1:] = -1, 10**6
    assert torch.equal(attn.select(q, k_pages, index=paged_index, block_table=unused, cache_seqlens=lens), lists)
    holes = table.clone()
    holes[0, 0] = -5  # row 0's first page: blocks 0 and 1, whose keys then score nothing
    o = attn(q, k_pages, v_pages, index=paged_index, block_table=holes, cache_seqlens=lens)
    assert not torch.isnan(o).any()


def test_a_paged_index_is_checked_against_the_pool(device):
    """k_idx over a paged cache must be a pool of k's pages (n_pages, page_size); its contiguous form is told so."""
    attn = get_kernel(_spec("index"))
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 32)
    index, paged_index = _paged_index(q, table, 32)
    with pytest.raises(KernelgenValueError, match=r"expected pages \[n_pages, Hkv or 1, page_size, Di\] = "
                                                  r"\[18, 2 or 1, 32, 32\] with block_table="):
        attn(q, k_pages, v_pages, index=index, block_table=table, cache_seqlens=lens)
    with pytest.raises(KernelgenValueError, match=r"k_idx.shape = \(18, 2, 16, 32\)"):
        attn.select(q, k_pages, index=(paged_index[0], paged_index[1][:, :, :16], paged_index[2]),
                    block_table=table, cache_seqlens=lens)
    with pytest.raises(KernelgenValueError, match=r"expected \[B, Hkv or 1, Nk, Di\]"):  # pages without a table
        attn(q, k, v, index=paged_index, cache_seqlens=lens)
    with pytest.raises(KernelgenValueError, match=r"k_idx must be 4-D.*k_idx is a pool of pages"):
        attn(q, k_pages, v_pages, index=(paged_index[0], paged_index[1][0], paged_index[2]), block_table=table)
    with pytest.raises(KernelgenValueError, match="needs index="):
        attn(q, k_pages, v_pages, block_table=table)
    with pytest.raises(KernelgenValueError, match="cache_leftpad= cannot go with block_table="):
        attn(q, k_pages, v_pages, index=paged_index, block_table=table, cache_leftpad=lens * 0)





def test_a_paged_prefill_runs_the_paged_roles():
    for schedule, select, attend in (("q_centric", "decode_select", "attn_paged"),
                                     ("kv_centric", "kv_decode_select", "kv_attn_paged")):
        assert forward_roles(_spec("mean", schedule), N_Q, True, paged=True) == ("lists", select, attend)
    assert forward_roles(_spec("mean"), 16, True, paged=True)[2] == "decode"


@pytest.mark.parametrize("schedule, selector, dtype, page_size, config, fields", [
    ("q_centric", "mean", torch.float32, 16, None, {}),
    ("q_centric", "multi:2", torch.float16, 32, AttnConfig(block_m=16, num_warps=4, num_stages=1, kv_per_iter=2), {}),
    ("q_centric", "given", torch.float32, 32, AttnConfig(block_m=32, num_warps=4, num_stages=1, kv_per_iter=1), {}),
    ("kv_centric", "mean", torch.float32, 16, None, {}), ("kv_centric", "given", torch.float16, 32, None, {}),
    # blocks over several pages: 8 keys a page under 32-key blocks, 1 (token pages), 24 (no divisor)
    ("q_centric", "mean", torch.float16, 8, None, {"kv_block": 32}),
    ("q_centric", "given", torch.float32, 1, AttnConfig(block_m=32, num_warps=4, num_stages=1, kv_per_iter=2),
     {"kv_block": 32}),
    ("kv_centric", "multi:2", torch.float32, 24, None, {"kv_block": 32}),
    ("kv_centric", "given", torch.float16, 8, None, {"kv_block": 32})])
def test_a_paged_prefill_is_the_reference_over_its_pages(schedule, selector, dtype, page_size, config, fields,
                                                         device):
    """A chunk of 40 queries at the end of rows of 96, 37, 0, 48 and 1 keys over shuffled pages (the pool's other
    pages NaN): the contiguous cache's lists bit for bit, o and lse the float64 reference's; a row with its own
    table row over the same pool is the batch's row, bit for bit; kept reps grow in place to the same lists."""
    spec = _spec(selector, schedule, **fields)
    configs = None if config is None else {"attn_paged": config}
    attn = get_kernel(spec, configs=configs)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(N_Q, dtype, device, page_size)
    if spec.selects:
        idx = attn.select(q, k_pages, cache_seqlens=lens, block_table=table)
        assert torch.equal(idx, attn.select(q, k, cache_seqlens=lens))
        assert_valid_selection(idx[:1], q[:1], k[:1], spec)
    else:
        idx = random_lists(spec, len(LENGTHS), 2, N_Q, 96, seed=3).to(device)
    o, lse = attn(q, k_pages, v_pages, block_idx=None if spec.selects else idx, block_table=table,
                  cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec.replace(selector="given"), idx,
                                                   cache_seqlens=lens, block_table=table)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()  # the empty row
    assert (o[4, :, :-1] == 0).all()  # one key: only the last query may see it
    assert (o[4, :, -1] != 0).any() or not spec.selects  # and does through the sink block where selected
    for b in (0, 3):
        alone = attn(q[b:b + 1], k_pages, v_pages, block_idx=idx[b:b + 1], block_table=table[b:b + 1],
                     cache_seqlens=lens[b:b + 1])
        assert torch.equal(alone, o[b:b + 1]), b
    if spec.selects:
        reps = attn.key_reps(k_pages, block_table=table, cache_seqlens=(lens - 30).clamp(min=0))
        assert torch.equal(attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, key_reps=reps), o)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_a_paged_prefill_reads_no_page_outside_the_pool(schedule, device):
    """A table entry outside [0, n_pages) holds no keys in a prefill chunk too: its blocks are masked, as if the
    lists did not name them, raw or prepared."""
    spec = _spec("given", schedule)
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(N_Q, torch.float32, device, 32)
    lists = 3 if schedule == "q_centric" else N_Q
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=device).expand(len(LENGTHS), 2, lists, 3).contiguous()
    holes = table.clone()
    holes[0, 0], holes[1, 2] = -5, 10**6  # row 0's blocks 0 and 1; row 1's page 2 lies past its 37 keys
    without = idx.clone()
    without[0, :, :, :2] = -1
    expected = attn(q, k_pages, v_pages, block_idx=without, block_table=table, cache_seqlens=lens)
    assert torch.equal(attn(q, k_pages, v_pages, block_idx=idx, block_table=holes, cache_seqlens=lens), expected)
    prepared = attn.prepare(idx, seq_q=N_Q, seq_k=96)  # its reverse index (per-query lists) serves as it is
    assert torch.equal(attn(q, k_pages, v_pages, block_idx=prepared, block_table=holes, cache_seqlens=lens), expected)


@pytest.mark.parametrize("schedule, n_q", [("q_centric", 1), ("kv_centric", 2), ("q_centric", N_Q),
                                           ("kv_centric", N_Q)])
def test_a_page_outside_the_pool_hides_its_keys_alone(schedule, n_q, device):
    """Pages of 8 keys under 32-key blocks (a decode step and a prefill chunk): a table entry outside
    [0, n_pages) hides its page's 8 keys and no other key of their block; row 0 by hand in float64."""
    spec = _spec("given", schedule, kv_block=32, local=0, sink=0)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(n_q, torch.float32, device, 8)
    lists = n_q if schedule == "kv_centric" else spec.n_q_tiles(n_q)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32, device=device).expand(len(LENGTHS), 2, lists, 3).contiguous()
    holes = table.clone()
    holes[0, 1] = -5  # row 0's keys 8 .. 15, in block 0
    o = get_kernel(spec)(q, k_pages, v_pages, block_idx=idx, block_table=holes, cache_seqlens=lens)
    q0, k0, v0 = (x[0].double() for x in (q, k, v))
    keys = torch.arange(96, device=device)
    seen = (keys[None, :] <= torch.arange(96 - n_q, 96, device=device)[:, None]) & ((keys < 8) | (keys >= 16))
    for h in range(4):
        s = (q0[h] @ k0[h // 2].T / 8.0).masked_fill(~seen, float("-inf"))
        assert torch.allclose(o[0, h].double(), torch.softmax(s, -1) @ v0[h // 2], atol=1e-5), h
    whole = get_kernel(spec)(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens)
    assert torch.equal(o[1:], whole[1:])  # the other rows' pages: untouched


def test_a_paged_prefill_is_the_contiguous_call_where_the_same_steps_run(device):
    """Q-centric lists over shuffled pages of 32 keys (two blocks each; blocks past a row's keys and a page outside
    the pool listed too): with one block a step (the paged kernel's masked blocks take one at a time), o and lse
    are attn_rows' over the contiguous cache, bit for bit, whether the blocks no mask touches walk the pool as one
    row of blocks or each is loaded from its page on its own (a pool whose page stride is no whole number of
    blocks); with two blocks a step they match the reference."""
    spec = _spec("given", local=0, sink=0, top_k=5)
    one_step = AttnConfig(block_m=32, num_warps=4, num_stages=1, kv_per_iter=1)
    attn = get_kernel(spec, configs={"attn_paged": one_step, "attn_rows": one_step})
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(N_Q, torch.float32, device, 32)
    idx = random_lists(spec, len(LENGTHS), 2, N_Q, 96, seed=5).to(device)
    idx[..., -1] = 9  # past every row's 96 keys: an empty slot
    o_rows, lse_rows = attn(q, k, v, block_idx=idx, cache_seqlens=lens, return_lse=True)
    padded = torch.full((k_pages.shape[0], 2, 33, 64), float("nan"), device=device)  # a page stride of 66 rows
    for pool in ("whole", "padded"):
        if pool == "padded":
            k_pages = padded.clone().index_copy_(2, torch.arange(32, device=device), k_pages)[:, :, :32]
            v_pages = padded.clone().index_copy_(2, torch.arange(32, device=device), v_pages)[:, :, :32]
        o, lse = attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens, return_lse=True)
        assert torch.equal(o, o_rows) and torch.equal(lse, lse_rows), pool
    two_steps = get_kernel(spec, configs={"attn_paged": dataclasses.replace(one_step, kv_per_iter=2)})
    o, lse = two_steps(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)


def test_a_pool_walks_as_one_row_of_blocks_only_where_its_strides_allow():
    from kernelgen.backends.triton import pool_ratio

    spec = _spec("given", kv_block=16)
    pool = torch.empty(10, 2, 32, 64)
    assert pool_ratio(spec, pool, pool) == 4  # a page: 2 heads x 2 blocks of 16 rows
    assert pool_ratio(spec, pool.transpose(1, 2).contiguous().transpose(1, 2), pool) == 0  # k's and v's differ
    vllm = torch.empty(10, 32, 2, 64).transpose(1, 2)  # [n_pages, page_size, Hkv, D]
    assert pool_ratio(spec, vllm, vllm) == 2
    assert pool_ratio(spec, torch.empty(10, 2, 33, 64)[:, :, :32], torch.empty(10, 2, 33, 64)[:, :, :32]) == 0


def test_paged_prefill_configs_are_checked():
    from kernelgen import backends

    triton = backends.get("triton")
    q_spec, kv_spec = _spec("mean"), _spec("mean", "kv_centric")
    assert not any(c.use_tma for c in triton.config_space(q_spec, "attn_paged", "sm_90"))
    for spec, config, words in ((kv_spec, AttnConfig(block_m=16), "with the kv_attn_paged role"),
                                (q_spec, AttnConfig(block_m=16, use_tma=True), "through pointers"),
                                (q_spec, AttnConfig(block_m=64), "block_m")):
        with pytest.raises(KernelgenValueError, match=words):
            triton.check_config(spec, "attn_paged", config, "sm_90")


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_the_tuner_checks_a_paged_prefill(schedule):
    """The tuner's own check of attn_paged and kv_attn_paged (their workload: the rows' chunk over shuffled pages,
    the capacity padded to whole pages) passes the default config, at a length of no whole page."""
    from kernelgen import backends
    from kernelgen.roles import get_role
    from kernelgen.tuning.plan import trial_shapes
    from kernelgen.tuning.worker import check_config

    role = forward_roles(_spec("mean", schedule), paged=True)[2]
    spec = get_role(role).kernel_spec(_spec("mean", schedule, kv_block=32), "triton")
    assert trial_shapes(spec, 200, True, None)[0][3] % spec.kv_block  # the check's keys: no whole page
    triton = backends.get("triton")
    assert check_config(triton, spec, role, triton.default_config(spec, role, "cpu"), 200, torch.float16,
                        "cpu") is None


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, selector, dtype, page_size", [("q_centric", "mean", torch.bfloat16, 128),
                                                                  ("q_centric", "given", torch.float16, 256),
                                                                  ("kv_centric", "mean", torch.bfloat16, 128),
                                                                  ("q_centric", "mean", torch.bfloat16, 16),
                                                                  ("kv_centric", "given", torch.float16, 16)])
def test_a_long_paged_prefill_on_gpu(schedule, selector, dtype, page_size):
    """A chunk of 1024 queries appended to rows of 32768, 20000, 700 and 0 keys over shuffled pages: the
    contiguous cache's lists bit for bit, and the float64 reference over them."""
    tile = {} if schedule == "kv_centric" else {"q_tile": 128}
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1,
                selector=selector, **tile)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1024, dtype, "cuda", 32768, (32768, 20000, 700, 0), heads_kv=2, group=4, head_dim=128)
    k_pages, table = paged(k, page_size)
    v_pages, _ = paged(v, page_size, table=table.cpu())
    if spec.selects:
        idx = attn.select(q, k_pages, cache_seqlens=lens, block_table=table)
        assert torch.equal(idx, attn.select(q, k, cache_seqlens=lens))
        assert torch.equal(attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens),
                           attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens))
    else:
        idx = random_lists(spec, 4, 2, 1024, 32768, seed=7).cuda()
    o, lse = attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, selector, page_size", [("q_centric", "mean", 128), ("q_centric", "given", 256),
                                                           ("kv_centric", "mean", 128), ("q_centric", "mean", 16),
                                                           ("kv_centric", "mean", 1)])
def test_a_long_paged_cache_on_gpu(schedule, selector, page_size):
    """bf16 rows of 32k, 20000, 1 and 0 keys over shuffled pages (of whole blocks, and of 16 keys or one, a block
    over several pages): the contiguous call's bits, and the reference."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1,
                selector=selector)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(2, torch.bfloat16, "cuda", 32768, (32768, 20000, 1, 0), heads_kv=2, group=4,
                           head_dim=128)
    k_pages, table = paged(k, page_size)
    v_pages, _ = paged(v, page_size, table=table.cpu())
    idx = None if spec.selects else random_lists(spec, 4, 2, 1, 32768, seed=4).cuda()
    o, lse = attn(q, k_pages, v_pages, block_idx=idx, block_table=table, cache_seqlens=lens, return_lse=True)
    o_dense, lse_dense = attn(q, k, v, block_idx=idx, cache_seqlens=lens, return_lse=True)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec if idx is None else spec.replace(selector="given"),
                                                   idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)
    if spec.selects:
        reps = attn.key_reps(k_pages, block_table=table, cache_seqlens=lens)
        assert torch.equal(reps.reps, attn.key_reps(k, cache_seqlens=lens).reps)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, n_q", [("q_centric", 1), ("kv_centric", 1), ("q_centric", 64),
                                           ("kv_centric", 64)])
def test_the_index_selector_over_a_long_paged_cache_on_gpu(schedule, n_q):
    """DSA's decode step (and a prefill chunk) over a paged bf16 cache of rows of 32k, 20000, 1 and 0 keys, k_idx
    paged through the same table: the contiguous cache's lists bit for bit, o against the reference, and a CUDA
    graph of the step replays it bit for bit after the table's pages move."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1,
                selector="index")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(n_q, torch.bfloat16, "cuda", 32768, (32768, 20000, 1, 0), heads_kv=2, group=4,
                           head_dim=128)
    k_pages, table = paged(k, 512)
    v_pages, _ = paged(v, 512, table=table.cpu())
    gen = torch.Generator("cuda").manual_seed(5)  # Hi = 4 index heads of Di = 64 a KV head, one shared key head
    q_idx, k_idx = (torch.randn(4, h, n, 64, device="cuda", generator=gen).to(torch.bfloat16)
                    for h, n in ((8, n_q), (1, 32768)))
    w = torch.rand(4, 8, n_q, device="cuda", generator=gen)
    k_idx_pages, _ = paged(k_idx, 512, table=table.cpu())
    index, paged_index = (q_idx, k_idx, w), (q_idx, k_idx_pages, w)
    lists = attn.select(q, k_pages, index=paged_index, block_table=table, cache_seqlens=lens)
    assert torch.equal(lists, attn.select(q, k, index=index, cache_seqlens=lens))
    o, lse = attn(q, k_pages, v_pages, index=paged_index, block_table=table, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, index=index, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)
    if n_q <= 16:  # a decode call: the same kernels over the same lists
        assert torch.equal(o, attn(q, k, v, index=index, cache_seqlens=lens))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = attn(q, k_pages, v_pages, index=paged_index, block_table=table, cache_seqlens=lens)
    graph.replay()
    assert torch.equal(replayed, o)
    moved = torch.randperm(k_pages.shape[0], device="cuda")  # every pool's pages moved, the table with them
    for pool in (k_pages, v_pages, k_idx_pages):
        pool[moved] = pool.clone()
    table.copy_(moved[table.long()].to(torch.int32))
    graph.replay()
    assert torch.equal(replayed, o)


def test_a_paged_prefill_of_256_key_blocks(device):
    """A 256-key block runs in the forward as its two 128-key halves, over pages too (the pages no row lists are
    NaN: a read of one would show)."""
    spec = Spec(head_dim=64, kv_block=256, q_tile=64, top_k=2, causal=True, gqa_group=2)
    gen = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(2, h, n, 64, generator=gen).to(device) for h, n in ((2, 40), (1, 768), (1, 768)))
    lens = torch.tensor([700, 300], dtype=torch.int32, device=device)
    k_pages, table = paged(k, 256)
    v_pages, _ = paged(v, 256, table=table.cpu())
    o, lse = get_kernel(spec)(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec, cache_seqlens=lens, block_table=table)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)


def test_flash_attention_s_cache_batch_idx_is_a_table_of_one_row_pages(device):
    """FlashAttention's cache_batch_idx (batch row b reads slot slot_ids[b] of a contiguous cache): the cache as
    a pool of one-row pages and a table of one page a row, with the slots' kept reps picked by index_batch, is
    the call over the picked rows, bit for bit."""
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=96)
    slot_ids = torch.tensor([4, 0, 3], device=device)
    reps = attn.key_reps(k, cache_seqlens=lens)
    picked = attn(q[:3], k[slot_ids], v[slot_ids], cache_seqlens=lens[slot_ids])
    table = slot_ids.view(-1, 1).to(torch.int32)
    assert torch.equal(attn(q[:3], k, v, block_table=table, cache_seqlens=lens[slot_ids]), picked)
    assert torch.equal(attn(q[:3], k, v, block_table=table, cache_seqlens=lens[slot_ids],
                            key_reps=reps.index_batch(slot_ids)), picked)

"""Packed queries over a KV cache (`attn.varlen(q, k_cache, v_cache, cu_seqlens, cache_seqlens=, block_table=)`): a
serving step that mixes decode rows and prefill chunks of different lengths in one call. Row b's
cu_seqlens[b + 1] - cu_seqlens[b] queries are the last positions of its cache row; each row is the call it would
make alone (its lists bit for bit; o bit for bit for decode rows and rows of consecutive groups, to rounding for
prefill chunks that run the paged kernels)."""
import pytest
import torch

from kernelgen import Spec, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError
from kernelgen.varlen import query_groups

from checks import assert_close_to_reference
from test_cache_seqlens import _cache, _index, _spec
from test_decode import random_lists
from test_paged_kv import paged

LENGTHS = (96, 37, 0, 48, 94)
COUNTS = (1, 20, 0, 1, 3)  # decode rows, a prefill chunk, a row with no new query, a speculative row of 3
APART = (20, 1, 0, 20, 3)  # prefill chunks of one count in rows that are not consecutive


def _exact(counts, b, layout) -> bool:
    """Whether row b's o is its own call's bit for bit: all but a contiguous cache's prefill rows of a count whose
    rows are not consecutive (read as one-row pages: the paged kernels, to rounding)."""
    rows = [row for row, count in enumerate(counts) if count == counts[b]]
    return counts[b] <= 16 or layout == "paged" or rows[-1] - rows[0] == len(rows) - 1


def _packed(x, counts):
    """Row b's first counts[b] positions of x [B, H, N, ...], packed [total, H, ...], and the bounds."""
    packed = torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(counts)])
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=x.device)
    return packed, bounds


def _row(x, bounds, b):
    """Row b's part of a packed [total, H, ...] output, as its own call's [1, H, count, ...]."""
    return x[int(bounds[b]):int(bounds[b + 1])].transpose(0, 1)[None]


def _own_call(b, count, k, v, lens, table, index):
    """(cache, row options, index) of row b's own call with its `count` queries: its row of a contiguous cache (a
    view: a write through it reaches the cache), or the pool with its row of the table."""
    rows = dict(cache_seqlens=lens[b:b + 1])
    if table is None:
        cache = (k[b:b + 1], v[b:b + 1])
    else:
        cache, rows["block_table"] = (k, v), table[b:b + 1]
    own_index = None if index is None else (index[0][b:b + 1, :, :count], index[1] if table is not None else
                                            index[1][b:b + 1], index[2][b:b + 1, :, :count].contiguous())
    return cache, rows, own_index


@pytest.mark.parametrize("schedule, selector, layout, dtype, counts", [
    ("q_centric", "mean", "contiguous", torch.float32, COUNTS),
    ("q_centric", "mean", "contiguous", torch.float32, APART),
    ("q_centric", "multi:2", "paged", torch.float16, COUNTS),
    ("q_centric", "given", "contiguous", torch.float16, APART),
    ("kv_centric", "mean", "paged", torch.float32, APART),
    ("kv_centric", "index", "contiguous", torch.float32, COUNTS),
    ("kv_centric", "index", "contiguous", torch.float32, APART),
    ("q_centric", "index", "paged", torch.float16, COUNTS),
    # rows apart over a contiguous cache of 88 keys, which no whole number of 16-key blocks fills: one-row pages
    ("q_centric", "mean", "contiguous 88", torch.float32, APART),
    ("kv_centric", "given", "contiguous 88", torch.float16, APART)])
def test_each_row_is_its_own_call(schedule, selector, layout, dtype, counts, device):
    """Each row's o and lse equal its own call over its cache row with its own queries (bit for bit where it
    decodes or the rows of its count are consecutive; prefill chunks of a count in rows apart over a contiguous
    cache run the paged kernels, to rounding), match the float64 reference, and a row with no new query takes no
    token."""
    spec = _spec(selector, schedule)
    attn = get_kernel(spec)
    capacity = 88 if layout == "contiguous 88" else 96
    q, k, v, lens = _cache(max(counts), dtype, device, capacity=capacity,
                           lengths=tuple(min(n, capacity) for n in LENGTHS))
    index = _index(q, 96, shared_key=layout == "paged") if selector == "index" else None
    table = None
    if layout == "paged":
        k, table = paged(k, 32)
        v, _ = paged(v, 32, table=table.cpu())
        if index is not None:
            index = (index[0], paged(index[1], 32, table=table.cpu())[0], index[2])
    block_idx = random_lists(spec, 5, 2, max(counts), capacity, seed=4).to(device) if selector == "given" else None
    packed, bounds = _packed(q, counts)
    packed_index = None if index is None else (_packed(index[0], counts)[0], index[1], _packed(index[2][..., None],
                                                                                              counts)[0][..., 0])
    o, lse = attn.varlen(packed, k, v, bounds, cache_seqlens=lens, block_table=table, block_idx=block_idx,
                         index=packed_index, return_lse=True)
    assert o.shape == packed.shape and lse.shape == (packed.shape[1], packed.shape[0])
    for b, count in enumerate(counts):
        if not count:
            continue
        cache, rows, own_index = _own_call(b, count, k, v, lens, table, index)
        own_lists = None if block_idx is None else block_idx[b:b + 1, :, :spec.n_q_tiles(count)]
        o_own, lse_own = attn(q[b:b + 1, :, :count], *cache, block_idx=own_lists, index=own_index, return_lse=True,
                              **rows)
        got_o, got_lse = _row(o, bounds, b), _row(lse.t(), bounds, b)
        if _exact(counts, b, layout):
            assert torch.equal(got_o, o_own) and torch.equal(got_lse, lse_own), b
        ref_o, ref_lse, _ = reference.sparse_attention(
            q[b:b + 1, :, :count], *cache, spec if block_idx is None else spec.replace(selector="given"), own_lists,
            index=own_index, **rows)
        assert_close_to_reference(got_o, got_lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("schedule, selector, layout, counts", [("q_centric", "mean", "paged", COUNTS),
                                                                ("kv_centric", "index", "contiguous", COUNTS),
                                                                ("q_centric", "multi:2", "contiguous", APART)])
def test_new_tokens_are_written_then_attended(schedule, selector, layout, counts, device):
    """k_new and v_new packed as q (and k_idx_new): each row's tokens written at its length, then the row attends
    over them, as its own call with k_new= does: the same caches and o, bit for bit where it decodes; kept reps
    (grown in place by the groups of consecutive rows, from a copy by the others) end as reps made afresh."""
    spec = _spec(selector, schedule)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(max(counts), torch.float32, device, capacity=96, lengths=(60, 37, 0, 48, 94))
    gen = torch.Generator().manual_seed(11)
    k_new, v_new = (torch.randn(k.shape[0], 2, max(counts), 64, generator=gen).to(device) for _ in range(2))
    index = _index(q, 96) if selector == "index" else None
    k_idx_new = None if index is None else torch.randn(5, 2, max(counts), 32, generator=gen).to(device)
    table = None
    if layout == "paged":
        k, table = paged(k, 32)
        v, _ = paged(v, 32, table=table.cpu())
    packed, bounds = _packed(q, counts)
    packed_index = None if index is None else (_packed(index[0], counts)[0], index[1].clone(),
                                                _packed(index[2][..., None], counts)[0][..., 0])
    new = [_packed(x, counts)[0] if x is not None else None for x in (k_new, v_new, k_idx_new)]
    k_call, v_call = k.clone(), v.clone()
    reps = None if index is not None else attn.key_reps(k_call, cache_seqlens=lens, block_table=table)
    o = attn.varlen(packed, k_call, v_call, bounds, cache_seqlens=lens, block_table=table, index=packed_index,
                    k_new=new[0], v_new=new[1], k_idx_new=new[2], key_reps=reps)
    if reps is not None:  # grown to the rows' lengths after their new tokens, in place
        after = (lens + torch.tensor(counts, dtype=torch.int32, device=device)).clamp(max=96)
        assert torch.equal(reps.seqlens[:, 0], after)
        assert torch.equal(reps.reps, attn.key_reps(k_call, cache_seqlens=after, block_table=table).reps)
    k_own, v_own = k.clone(), v.clone()
    k_idx_own = None if index is None else index[1].clone()
    for b, count in enumerate(counts):
        if not count:
            continue
        cache, rows, own_index = _own_call(b, count, k_own, v_own, lens, table,
                                           None if index is None else (index[0], k_idx_own, index[2]))
        o_own = attn(q[b:b + 1, :, :count], *cache, index=own_index, k_new=k_new[b:b + 1, :, :count],
                     v_new=v_new[b:b + 1, :, :count], **rows,
                     k_idx_new=None if index is None else k_idx_new[b:b + 1, :, :count])
        if _exact(counts, b, layout):
            assert torch.equal(_row(o, bounds, b), o_own), b
        else:
            assert (_row(o, bounds, b) - o_own).abs().max() < 1e-5, b
    assert torch.equal(k_call.nan_to_num(7), k_own.nan_to_num(7)) and torch.equal(v_call.nan_to_num(7),
                                                                                   v_own.nan_to_num(7))
    if index is not None:
        assert torch.equal(packed_index[1], k_idx_own)


def test_rows_of_one_count_are_the_plain_call(device):
    """Every row with the same query count: one call over the whole cache, its packed queries read as they lie,
    bit for bit the batched call's; kept reps are grown to the rows once, in place."""
    spec = _spec("mean", "kv_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(2, torch.float16, device, capacity=96, lengths=LENGTHS)
    reps = attn.key_reps(k, cache_seqlens=lens - 2)
    packed, bounds = _packed(q, (2,) * 5)
    o = attn.varlen(packed, k, v, bounds, cache_seqlens=lens, key_reps=reps)
    assert torch.equal(reps.seqlens[:, 0], lens)
    assert torch.equal(o.view(5, 2, *o.shape[1:]).transpose(1, 2), attn(q, k, v, cache_seqlens=lens))


def test_left_padded_rows_of_a_contiguous_cache(device):
    """cache_leftpad= over a contiguous cache whose rows of each query count are consecutive: each row is its own
    call over its keys from its first, bit for bit."""
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    counts = (1, 1, 20, 0, 3)
    q, k, v, lens = _cache(max(counts), torch.float32, device, capacity=96, lengths=LENGTHS)
    pads = torch.tensor([5, 0, 3, 0, 40], dtype=torch.int32, device=device)
    packed, bounds = _packed(q, counts)
    o = attn.varlen(packed, k, v, bounds, cache_seqlens=lens, cache_leftpad=pads)
    for b, count in enumerate(counts):
        if count:
            own = attn(q[b:b + 1, :, :count], k[b:b + 1], v[b:b + 1], cache_seqlens=lens[b:b + 1],
                       cache_leftpad=pads[b:b + 1])
            assert torch.equal(_row(o, bounds, b), own), b


def test_a_compiled_caller_runs_it_eagerly(device):
    """Under torch.compile the call reads its bounds on the host: a graph break, the eager result."""
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(20, torch.float32, device, capacity=96, lengths=LENGTHS)
    packed, bounds = _packed(q, COUNTS)

    @torch.compile(backend="aot_eager")
    def step(packed, k, v, bounds, lens):
        return attn.varlen(packed, k, v, bounds, cache_seqlens=lens) * 2

    assert torch.equal(step(packed, k, v, bounds, lens), attn.varlen(packed, k, v, bounds, cache_seqlens=lens) * 2)


def test_bad_inputs_are_named(device):
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(20, torch.float32, device, capacity=96, lengths=LENGTHS)
    packed, bounds = _packed(q, COUNTS)
    pads = torch.zeros(5, dtype=torch.int32, device=device)
    cases = [
        (KernelgenValueError, "one bound more than the cache's 5 rows", dict(cu_seqlens=bounds[:-1])),
        (KernelgenTypeError, "cu_seqlens must be int32", dict(cu_seqlens=bounds.long())),
        (KernelgenValueError, "q has shape", dict(q=q)),
        (KernelgenValueError, "k is", dict(k=k[0])),
        (KernelgenValueError, "must rise from 0", dict(cu_seqlens=bounds.flip(0).contiguous())),
        (KernelgenValueError, "cache_leftpad= takes the rows of each query count one after another",
         dict(cache_leftpad=pads)),
        (KernelgenValueError, "block_idx", dict(block_idx=random_lists(spec, 5, 2, 16, 96, seed=1).to(device))),
        (KernelgenValueError, "over a KV cache only", dict(cache_seqlens=None, cache_leftpad=pads)),
        (KernelgenValueError, "k_new packed as q", dict(k_new=k[:, :, :1])),
        (KernelgenValueError, "k_new= and v_new= go together", dict(k_new=packed[:, :2].contiguous())),
    ]
    new = dict(k_new=packed[:, :2].contiguous(), v_new=packed[:, :2].contiguous())  # 2 KV heads of 64
    cases += [
        (KernelgenValueError, r"cache_seqlens must have shape \[B\] = \(5,\)", dict(cache_seqlens=lens[:3])),
        (KernelgenValueError, "cache_seqlens must be contiguous", dict(
            cache_seqlens=torch.stack([lens, lens], 1).flatten()[::2])),
        (KernelgenTypeError, "cache_seqlens must be a torch.Tensor", dict(cache_seqlens=lens.tolist())),
        (KernelgenValueError, "longer than max_seqlen=8", dict(max_seqlen=8)),
        (KernelgenValueError, r"cache_seqlens= calls .* have no backward", dict(q=packed.clone().requires_grad_())),
        (KernelgenValueError, r"k_new packed as q, \[total, heads, width\] = \[25, 2, 64\]",
         dict(k_new=packed[:, :1].contiguous(), v_new=packed[:, :1].contiguous())),
        (KernelgenTypeError, "k_new must be a torch.Tensor", dict(k_new=[1], v_new=new["v_new"])),
        (KernelgenValueError, "block_idx .* rows of 20 queries need 2 lists", dict(
            block_idx=random_lists(spec, 5, 2, 16, 96, seed=1).to(device), **new)),  # checked before any write
    ]
    k_before = k.clone()
    for error, match, changed in cases:
        args = {"q": packed, "k": k, "v": v, "cu_seqlens": bounds, "cache_seqlens": lens, **changed}
        with pytest.raises(error, match=match):
            get_kernel(spec.replace(selector="given") if "block_idx" in changed else spec).varlen(
                args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens"), **args)
        assert torch.equal(k, k_before), match
    index_spec = _spec("index", "kv_centric")
    q_idx, k_idx, w = _index(q, 96)
    with pytest.raises(KernelgenValueError, match=r"index: k_idx is the cache's index keys, \[B, Hkv or 1"):
        get_kernel(index_spec).varlen(packed, k, v, bounds, cache_seqlens=lens, index=(
            _packed(q_idx, COUNTS)[0], k_idx[:2], _packed(w[..., None], COUNTS)[0][..., 0]))


def test_a_refused_call_writes_nothing_whichever_group_is_refused(device):
    """Refusals that only some groups meet (rows of a count apart over a contiguous cache with cache_leftpad) and
    key_reps of another batch, which a group's call sees only a slice of: checked before the first group
    (consecutive rows, here) writes its new keys or grows its reps."""
    spec = _spec("mean", "q_centric")
    attn = get_kernel(spec)
    counts = (1, 1, 3, 0, 3)  # the first group's rows are consecutive, the second's apart
    pads = torch.tensor([1, 2, 3, 0, 4], dtype=torch.int32, device=device)
    cases = [("cache_leftpad= takes the rows of each query count one after another", 96, dict(cache_leftpad=pads)),
             (r"key_reps hold shape \(2, ", 96, dict(reps_rows=2)),
             # what a group's own writing call refuses: every group's is checked before the one write
             ("v_new requires grad", 96, dict(grad=True))]
    for match, capacity, options in cases:
        q, k, v, lens = _cache(3, torch.float32, device, capacity=capacity, lengths=(10, 20, 30, 0, 40))
        reps_rows = options.pop("reps_rows", 5)
        grad = options.pop("grad", False)
        reps = attn.key_reps(k[:reps_rows], cache_seqlens=lens[:reps_rows], **{
            name: x[:reps_rows] for name, x in options.items()})
        packed, bounds = _packed(q, counts)
        before = [x.clone() for x in (k, v, reps.reps, reps.seqlens)]
        with pytest.raises(KernelgenValueError, match=match):
            attn.varlen(packed, k, v, bounds, cache_seqlens=lens, key_reps=reps, k_new=packed[:, :2].contiguous(),
                        v_new=packed[:, :2].contiguous().requires_grad_(grad), **options)
        assert all(torch.equal(x, y) for x, y in zip(before, (k, v, reps.reps, reps.seqlens))), match
    k_pages, table = paged(k, 32)  # a table of fewer rows than the bounds: the rows' count says where it comes from
    with pytest.raises(KernelgenValueError, match=r"the cache's 4 rows \(block_table's rows\)"):
        attn.varlen(packed, k_pages, k_pages, bounds, cache_seqlens=lens, block_table=table[:4])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_every_row_s_new_keys_are_written_by_one_launch(layout, device, monkeypatch):
    """A call of several groups (APART: rows of one count apart) writes all its rows' new keys, and the index keys,
    with one append launch each, before its groups attend over the longer rows; each group's call is checked once
    (before the write), not again when it attends."""
    attn = get_kernel(_spec("index", "q_centric"))
    q, k, v, lens = _cache(20, torch.float32, device, capacity=96, lengths=(60, 37, 0, 48, 94))
    index = _index(q, 96)
    table = None
    if layout == "paged":
        k, table = paged(k, 32)
        v, _ = paged(v, 32, table=table.cpu())
        index = (index[0], paged(index[1], 32, table=table.cpu())[0], index[2])
    packed, bounds = _packed(q, APART)
    packed_index = (_packed(index[0], APART)[0], index[1], _packed(index[2][..., None], APART)[0][..., 0])
    launches, append = [], type(attn)._append

    def counted(self, *args, **options):
        launches.append(options)
        return append(self, *args, **options)

    monkeypatch.setattr(type(attn), "_append", counted)
    checks, checked_call = [], type(attn)._checked_call

    def counted_checks(self, *args, **options):
        checks.append(options)
        return checked_call(self, *args, **options)

    monkeypatch.setattr(type(attn), "_checked_call", counted_checks)
    before = k.clone()
    attn.varlen(packed, k, v, bounds, cache_seqlens=lens, block_table=table, index=packed_index,
                k_new=packed[:, :2].contiguous(), v_new=packed[:, 2:].contiguous(),
                k_idx_new=packed[:, :2, 32:].contiguous())
    assert len(launches) == 1 and not torch.equal(k, before)
    assert len(checks) == len(query_groups(bounds, packed.shape[0])) > 1


def test_kept_reps_end_at_every_row_s_length_without_cache_seqlens(device):
    """A paged cache called without cache_seqlens: every row holds its table's keys, and the kept reps end grown
    to them, rows of no query and rows apart included (the groups' calls grow only some)."""
    attn = get_kernel(_spec("mean", "q_centric"))
    q, k, v, lens = _cache(20, torch.float32, device, capacity=96, lengths=(10, 20, 30, 40, 50))
    k, table = paged(k, 32)
    v, _ = paged(v, 32, table=table.cpu())
    reps = attn.key_reps(k, cache_seqlens=lens, block_table=table)
    attn.varlen(_packed(q, APART)[0], k, v, _packed(q, APART)[1], block_table=table, key_reps=reps)
    full = torch.full((5,), 96, dtype=torch.int32, device=device)
    assert torch.equal(reps.seqlens[:, 0], full)
    assert torch.equal(reps.reps, attn.key_reps(k, cache_seqlens=full, block_table=table).reps)


def test_new_keys_that_are_a_view_of_the_cache_are_read_before_any_write(device):
    """New keys that alias the cache they go into are read as they were before the call, whichever row's write
    reaches them first (the plain call's rule, `reference.sparse_attention(..., k_new=)`)."""
    attn = get_kernel(_spec("mean", "q_centric"))
    q, k, v, lens = _cache(3, torch.float32, device, capacity=96, lengths=(1, 40))
    counts = (1, 2)
    k_new, v_new = (x[0].transpose(0, 1)[:3] for x in (k, v))  # row 0's first 3 keys; row 0 overwrites the 2nd
    want = []
    for x in (k, v):
        want.append(x.clone())
        want[-1][0, :, 1], want[-1][1, :, 40:42] = x[0, :, 0], x[0, :, 1:3]  # the keys as they were
    packed, bounds = _packed(q, counts)
    attn.varlen(packed, k, v, bounds, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])


def test_a_call_without_queries_checks_its_inputs_and_writes_nothing(device):
    """Rows of no new query run nothing, but what their calls of one query would refuse is refused all the same."""
    spec = _spec("given", "q_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, capacity=96, lengths=(10, 20))
    none = q[:, :, :0].transpose(1, 2).flatten(0, 1)  # [0, Hq, D]
    bounds = torch.zeros(3, dtype=torch.int32, device=device)
    lists = torch.zeros(2, 2, 1, spec.top_k, dtype=torch.int32, device=device)
    before = k.clone()
    o = attn.varlen(none, k, v, bounds, cache_seqlens=lens, block_idx=lists, k_new=none[:, :2], v_new=none[:, :2])
    assert o.shape == none.shape and torch.equal(k, before)
    cases = [(KernelgenValueError, "q has 3 heads", dict(q=none[:, :3])),
             (KernelgenTypeError, r"k_new.dtype = torch.float16 differs", dict(k_new=none[:, :2].half())),
             (KernelgenValueError, "needs block_idx", dict(block_idx=None)),
             (KernelgenValueError, "scale must be > 0", dict(scale=-1.0))]
    for error, match, options in cases:
        call = dict(q=none, block_idx=lists, k_new=none[:, :2], v_new=none[:, :2]) | options
        with pytest.raises(error, match=match):
            attn.varlen(call.pop("q"), k, v, bounds, cache_seqlens=lens, **call)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, layout", [("q_centric", "paged"), ("kv_centric", "paged"),
                                              ("q_centric", "contiguous")])
def test_a_mixed_serving_step_on_gpu(schedule, layout):
    """A bf16 serving step over a 32k cache (paged, or contiguous: a group's consecutive rows its slices): a
    2048-query prefill chunk, a 300-query one, a speculative row of 4 and five decode rows (one of an empty cache),
    in one call: each row its own call's o and lse, bit for bit, and the float64 reference's."""
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=1, sink=1,
                **({} if schedule == "kv_centric" else {"q_tile": 64}))
    attn = get_kernel(spec)
    lengths = (32768, 20000, 4096, 31000, 1, 0, 8000, 12345)
    counts = (2048, 1, 4, 1, 1, 1, 300, 1)
    q, k, v, lens = _cache(2048, torch.bfloat16, "cuda", 32768, lengths, heads_kv=2, group=4, head_dim=128)
    table = None
    if layout == "paged":
        k, table = paged(k, 512)
        v, _ = paged(v, 512, table=table.cpu())
    packed, bounds = _packed(q, counts)
    o, lse = attn.varlen(packed, k, v, bounds, cache_seqlens=lens, block_table=table, return_lse=True)
    for b, count in enumerate(counts):
        cache, rows, _ = _own_call(b, count, k, v, lens, table, None)
        o_own, lse_own = attn(q[b:b + 1, :, :count], *cache, **rows, return_lse=True)
        assert torch.equal(_row(o, bounds, b), o_own) and torch.equal(_row(lse.t(), bounds, b), lse_own), b
        if b in (0, 2, 5, 6):  # over the lists the row selects (bf16 near-ties may choose other blocks in float64)
            lists = attn.select(q[b:b + 1, :, :count], cache[0], **rows)
            ref_o, ref_lse, _ = reference.sparse_attention(q[b:b + 1, :, :count], *cache,
                                                           spec.replace(selector="given"), lists, **rows)
            assert_close_to_reference(o_own, lse_own, ref_o, ref_lse, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()  # a capture would keep the groups of the bounds it saw: refused
    with pytest.raises(KernelgenValueError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            attn.varlen(packed, k, v, bounds, cache_seqlens=lens, block_table=table)

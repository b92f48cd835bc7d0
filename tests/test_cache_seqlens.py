"""Decode calls over a KV cache of per-row lengths (`cache_seqlens=`, and left padding: `cache_leftpad=`): each
batch row is the call over its own keys, read on the device, so one launch (and a CUDA graph of it) serves any
lengths; kept key representatives grow in place."""
import pytest
import torch

from kernelgen import DecodeConfig, KeyReps, SelectConfig, Spec, custom_ops, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError

from checks import assert_close_to_reference, assert_valid_selection
from test_decode import random_lists

LENGTHS = (100, 37, 0, 48, 1)  # a full row, a partial last block, an empty row, a block boundary, one key


def _spec(selector="mean", schedule="q_centric", **fields):
    tile = {} if schedule == "kv_centric" else {"q_tile": 16}
    return Spec(**{"head_dim": 64, "kv_block": 16, "top_k": 3, "causal": True, "gqa_group": 2, "selector": selector,
                   "schedule": schedule, "local": 1, "sink": 1, **tile, **fields})


def _cache(n_q, dtype, device, capacity=100, lengths=LENGTHS, heads_kv=2, group=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = [torch.randn(len(lengths), h, n, head_dim, generator=gen).to(device=device, dtype=dtype)
               for h, n in ((heads_kv * group, n_q), (heads_kv, capacity), (heads_kv, capacity))]
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=device)


def _check(spec, q, k, v, lens, block_idx=None, configs=None, key_reps=None):
    attn = get_kernel(spec, configs=configs)
    o, lse = attn(q, k, v, block_idx=block_idx, cache_seqlens=lens, key_reps=key_reps, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec if block_idx is None else
                                                   spec.replace(selector="given"), block_idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)
    return o, lse


@pytest.mark.parametrize("schedule, selector, n_q, dtype, causal", [("q_centric", "mean", 1, torch.float32, True),
                                                                    ("q_centric", "multi:2", 3, torch.float16, True),
                                                                    ("q_centric", "mean", 2, torch.float16, False),
                                                                    ("kv_centric", "multi:2", 2, torch.float32, True),
                                                                    ("kv_centric", "mean", 1, torch.float16, False)])
def test_each_row_selects_and_attends_over_its_own_keys(schedule, selector, n_q, dtype, causal, device):
    """The lists of row b are those of the call over k[b, :, :lengths[b]] alone, bit for bit (pooled in the call
    or from kept reps), and o, lse match the float64 reference; a row with no key gives o = 0, lse = -inf."""
    spec = _spec(selector, schedule, causal=causal)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(n_q, dtype, device)
    lists = attn.select(q, k, cache_seqlens=lens)
    for b, n in enumerate(LENGTHS):
        if n:
            row = (q[b:b + 1], k[b:b + 1, :, :n])
            assert torch.equal(lists[b:b + 1], attn.select(*row)), b
            assert_valid_selection(lists[b:b + 1], *row, spec)
        else:
            assert (lists[b] == -1).all()
    reps = attn.key_reps(k, cache_seqlens=lens)
    assert reps.seqlens.tolist() == [[n, n] for n in LENGTHS] and reps.n_k == 100
    assert torch.equal(attn.select(q, k, key_reps=reps, cache_seqlens=lens), lists)
    o, lse = _check(spec, q, k, v, lens)
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()
    o_reps, lse_reps = _check(spec, q, k, v, lens, key_reps=reps)
    assert torch.equal(o_reps, o) and torch.equal(lse_reps, lse)


@pytest.mark.parametrize("schedule, splits", [("q_centric", 1), ("q_centric", 4), ("kv_centric", 2)])
def test_given_lists_past_a_rows_keys_are_empty(schedule, splits, device):
    """Given lists (either schedule's) may name blocks past a row's keys, as the row's lists of a full cache
    would: those are empty slots for that row."""
    spec = _spec("given", schedule)
    q, k, v, lens = _cache(3, torch.float32, device)
    idx = random_lists(spec, len(LENGTHS), 2, 3, 100, seed=3).to(device)
    _check(spec, q, k, v, lens, block_idx=idx, configs={"decode": DecodeConfig(splits=splits)})


def test_lengths_are_read_on_the_device_each_call(device):
    """Changing cache_seqlens in place (as a decode loop or a CUDA graph's replay does) changes what the next call
    sees: nothing about the lengths is kept on the host."""
    spec = _spec("mean")
    attn = get_kernel(spec, configs={"decode_select": SelectConfig(tiles=8, chunk=16, splits=2)})  # a merge too
    q, k, v, lens = _cache(1, torch.float32, device)
    first = attn(q, k, v, cache_seqlens=lens)
    lens.copy_(torch.tensor([60, 38, 5, 49, 2], dtype=torch.int32))
    second = attn(q, k, v, cache_seqlens=lens)
    ref_o, _, _ = reference.sparse_attention(q, k, v, spec, cache_seqlens=lens)
    assert not torch.equal(first, second)
    assert ((second.double() - ref_o).norm() / ref_o.norm()).item() < 1e-4


@pytest.mark.parametrize("selector", ["mean", "multi:2"])
def test_kept_reps_grow_in_place_to_new_lengths(selector, device):
    """previous= with cache_seqlens brings the reps to the new lengths in place (each row by its own amount: none,
    one key, across a block boundary, a chunk, and back to fewer keys), equal bit for bit to reps made at once."""
    attn = get_kernel(_spec(selector))
    _, k, _, _ = _cache(1, torch.float16, device)
    reps = attn.key_reps(k, cache_seqlens=torch.tensor([90, 20, 0, 47, 1], dtype=torch.int32, device=device))
    for lengths in ((100, 21, 0, 48, 1), (100, 33, 16, 49, 17), (64, 33, 40, 49, 3)):
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        assert attn.key_reps(k, cache_seqlens=lens, previous=reps) is reps
        fresh = attn.key_reps(k, cache_seqlens=lens)
        assert torch.equal(reps.seqlens, fresh.seqlens)
        for b, n in enumerate(lengths):
            blocks = -(-n // 16)
            assert torch.equal(reps.reps[b, :, :blocks], fresh.reps[b, :, :blocks]), (lengths, b)
    assert isinstance(reps.index_batch([1, 0]), KeyReps) and reps.index_batch([1, 0]).seqlens[0, 0] == 33


def test_a_rewritten_row_brought_to_no_keys_is_pooled_again(device):
    """A batch slot given a new request (its keys rewritten from position 0): reps grown to length 0 for that row
    first, then by the call, select as the call that pools k does; the other rows keep growing."""
    attn = get_kernel(_spec("mean"))
    q, k, v, _ = _cache(1, torch.float32, device)
    reps = attn.key_reps(k, cache_seqlens=torch.tensor([90, 80, 0, 48, 60], dtype=torch.int32, device=device))
    k[1, :, :70] = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(9)).to(device)
    attn.key_reps(k, cache_seqlens=torch.tensor([90, 0, 0, 48, 60], dtype=torch.int32, device=device),
                  previous=reps)
    lens = torch.tensor([91, 70, 3, 49, 60], dtype=torch.int32, device=device)
    assert torch.equal(attn(q, k, v, cache_seqlens=lens, key_reps=reps), attn(q, k, v, cache_seqlens=lens))
    assert torch.equal(reps.reps[1, :, :5], attn.key_reps(k, cache_seqlens=lens).reps[1, :, :5])


PADS = (5, 20, 3, 16, 59)  # left padding: a few keys, past a block boundary, past an empty row's end, one key left


@pytest.mark.parametrize("schedule, selector, dtype", [("q_centric", "mean", torch.float32),
                                                       ("q_centric", "multi:2", torch.float16),
                                                       ("kv_centric", "mean", torch.float32)])
def test_left_padded_rows_are_the_calls_over_their_own_keys(schedule, selector, dtype, device):
    """cache_leftpad: row b is the call over k[b, :, pads[b]:lengths[b]] alone (its blocks counted from its first
    key), lists and outputs bit for bit, pooled in the call or from kept reps; o, lse match the reference."""
    spec = _spec(selector, schedule)
    lengths = (100, 37, 0, 48, 60)
    attn = get_kernel(spec, configs={"decode": DecodeConfig(splits=2)})
    q, k, v, lens = _cache(2, dtype, device, lengths=lengths)
    pads = torch.tensor(PADS, dtype=torch.int32, device=device)
    lists = attn.select(q, k, cache_seqlens=lens, cache_leftpad=pads)
    o, lse = attn(q, k, v, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    for b, (n, pad) in enumerate(zip(lengths, PADS)):
        keys = slice(min(pad, n), n)
        if keys.stop > keys.start:
            row = (q[b:b + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys])
            assert torch.equal(lists[b:b + 1], attn.select(*row[:2])), b
            assert torch.equal(o[b:b + 1], attn(*row)), b
        else:
            assert (lists[b] == -1).all() and (o[b] == 0).all() and torch.isinf(lse[b]).all()
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, cache_seqlens=lens, cache_leftpad=pads)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    reps = attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads)
    assert reps.seqlens[:, 0].tolist() == [95, 17, 0, 32, 1] and reps.leftpad[:, 0].tolist() == [5, 20, 0, 16, 59]
    assert torch.equal(attn.select(q, k, key_reps=reps, cache_seqlens=lens, cache_leftpad=pads), lists)
    assert torch.equal(attn(q, k, v, key_reps=reps, cache_seqlens=lens, cache_leftpad=pads), o)


def test_kept_reps_grown_to_another_left_padding_are_pooled_again(device):
    """Reps grown in place follow each row's first key: where it moved (padding added, taken away, or changed)
    the row is pooled again on the device, where it stayed only the new blocks are; either way the same bits as
    reps made at once."""
    attn = get_kernel(_spec("multi:2"))
    _, k, _, _ = _cache(1, torch.float16, device)
    reps = attn.key_reps(k, cache_seqlens=torch.tensor([90, 20, 0, 47, 1], dtype=torch.int32, device=device))
    for lengths, pads in (((100, 21, 0, 48, 1), (0, 3, 0, 16, 0)), ((100, 40, 16, 49, 17), (0, 3, 2, 17, 1)),
                          ((64, 40, 40, 49, 3), None)):
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        pads = None if pads is None else torch.tensor(pads, dtype=torch.int32, device=device)
        assert attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads, previous=reps) is reps
        fresh = attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads)
        assert torch.equal(reps.seqlens, fresh.seqlens) and torch.equal(reps.leftpad, fresh.leftpad)
        for b, n in enumerate(fresh.seqlens[:, 0].tolist()):
            blocks = -(-n // 16)
            assert torch.equal(reps.reps[b, :, :blocks], fresh.reps[b, :, :blocks]), (lengths, b)
    assert reps.index_batch([3, 0]).leftpad[0, 0] == 0 and reps.index_batch([3, 0]).seqlens[0, 0] == 49


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_a_call_grows_kept_reps_to_its_own_rows(schedule, device):
    """Reps of per-row lengths follow the call: passed to a call (or a select, or the custom op) of other
    lengths or another left padding than they hold, they are first grown to its rows in place, so it selects
    and attends exactly as the call that pools k itself, never from reps of other keys."""
    from kernelgen import custom_ops

    spec = _spec("multi:2", schedule)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device, lengths=(90, 20, 0, 47, 1))
    reps = attn.key_reps(k, cache_seqlens=lens)
    for lengths, pads in (((100, 37, 16, 48, 1), None), ((100, 37, 16, 48, 30), (3, 0, 16, 17, 1)),
                          ((64, 40, 40, 49, 3), (0, 20, 2, 0, 0))):
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        pads = None if pads is None else torch.tensor(pads, dtype=torch.int32, device=device)
        rows = {"cache_seqlens": lens, "cache_leftpad": pads}
        lists = attn.select(q, k, **rows)
        o = attn(q, k, v, **rows)
        assert torch.equal(attn(q, k, v, key_reps=reps, **rows), o), lengths
        fresh = attn.key_reps(k, **rows)
        assert torch.equal(reps.seqlens, fresh.seqlens) and torch.equal(reps.leftpad, fresh.leftpad)
        assert torch.equal(attn.select(q, k, key_reps=reps, **rows), lists)
    lens = torch.tensor((100, 21, 5, 0, 2), dtype=torch.int32, device=device)
    o_op, _ = custom_ops.sparse_attention(q, k, v, spec, cache_seqlens=lens, key_reps=reps)
    assert torch.equal(o_op, attn(q, k, v, cache_seqlens=lens)) and reps.seqlens[:, 0].tolist() == [100, 21, 5, 0, 2]


def test_bad_cache_seqlens_are_refused_by_name(device):
    spec = _spec("mean")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device)
    reps = attn.key_reps(k, cache_seqlens=lens)
    plain = attn.key_reps(k)
    cases = [
        (lambda: attn(q, k, v, cache_seqlens=lens.tolist()), KernelgenTypeError, "torch.Tensor"),
        (lambda: attn(q, k, v, cache_leftpad=lens), KernelgenValueError, "cache_leftpad= needs cache_seqlens="),
        (lambda: attn(q, k, v, cache_seqlens=lens, cache_leftpad=lens.long()), KernelgenTypeError,
         "cache_leftpad must be int32"),
        (lambda: attn.select(q, k, cache_seqlens=lens, cache_leftpad=lens[1:]), KernelgenValueError,
         "cache_leftpad must have shape [B]"),
        (lambda: attn.key_reps(k, cache_seqlens=lens, cache_leftpad=3), KernelgenTypeError,
         "cache_leftpad must be a torch.Tensor"),
        (lambda: attn(q, k, v, cache_seqlens=lens.long()), KernelgenTypeError, "int32"),
        (lambda: attn(q, k, v, cache_seqlens=lens[:2]), KernelgenValueError, "shape [B]"),
        (lambda: attn(q, k, v, cache_seqlens=torch.stack([lens, lens], 1)[:, 0]), KernelgenValueError, "contiguous"),
        (lambda: attn(q.requires_grad_(), k, v, cache_seqlens=lens), KernelgenValueError, "no backward"),
        (lambda: attn(q, k, v, cache_seqlens=lens, key_reps=plain), KernelgenValueError, "made without"),
        (lambda: attn(q, k, v, key_reps=reps), KernelgenValueError, "made with cache_seqlens"),
        (lambda: attn.key_reps(k, cache_seqlens=lens, previous=plain), KernelgenValueError, "without cache_seqlens"),
        (lambda: attn.key_reps(k, previous=reps), KernelgenValueError, "with cache_seqlens"),
        (lambda: reps.cropped(10), KernelgenValueError, "not cropped"),
        # a cache moved into a smaller tensor: made again, not grown (which would name the same fix again)
        (lambda: attn(q, k[:, :, :80], v[:, :, :80], cache_seqlens=lens, key_reps=reps), KernelgenValueError,
         "k has 80: make them for this k with attn.key_reps"),
        (lambda: attn.key_reps(k[:, :, :80], cache_seqlens=lens, previous=reps), KernelgenValueError,
         "made for a cache of 100 keys a row; k holds 80"),
        (lambda: custom_ops.key_reps(k[:, :, :80], spec, cache_seqlens=lens, previous=reps), KernelgenValueError,
         "made for a cache of 100 keys a row; k holds 80"),
        (lambda: get_kernel(_spec("index"))(q, k, v, cache_seqlens=lens), KernelgenValueError,
         "needs index="),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            call()
        q = q.detach()


def _index(q, capacity, index_heads=2, index_dim=32, shared_key=False, seed=1):
    """The index selector's (q_idx, k_idx, w) beside a cache of `capacity` keys a row (q's batch and queries)."""
    gen = torch.Generator().manual_seed(seed)
    b, hq, n_q, _ = q.shape
    heads = hq // 2 * index_heads  # _cache's group of 2
    q_idx = torch.randn(b, heads, n_q, index_dim, generator=gen)
    k_idx = torch.randn(b, 1 if shared_key else hq // 2, capacity, index_dim, generator=gen)
    w = torch.randn(b, heads, n_q, generator=gen)
    return tuple(x.to(device=q.device, dtype=q.dtype if x is not w else torch.float32) for x in (q_idx, k_idx, w))


@pytest.mark.parametrize("schedule, n_q, dtype, pads, shared_key", [
    ("kv_centric", 1, torch.float32, None, True),
    ("kv_centric", 3, torch.float16, PADS, False),
    ("kv_centric", 20, torch.float32, PADS, True),  # a prefill chunk: more queries than a decode call's
    ("q_centric", 1, torch.float32, PADS, False),
    ("q_centric", 20, torch.float16, None, True)])
def test_the_index_selector_over_a_cache_s_rows(schedule, n_q, dtype, pads, shared_key, device):
    """The index selector with cache_seqlens (and cache_leftpad): row b's lists and o are those of the call over
    its own keys and their index vectors alone, bit for bit; o, lse match the float64 reference; a row with no
    key gets no list, o = 0 and lse = -inf."""
    spec = _spec("index", schedule)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(n_q, dtype, device)
    index = _index(q, k.shape[2], shared_key=shared_key)
    pads = None if pads is None else torch.tensor(pads, dtype=torch.int32, device=device)
    lists = attn.select(q, k, index=index, cache_seqlens=lens, cache_leftpad=pads)
    o, lse = attn(q, k, v, index=index, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    for b, n in enumerate(LENGTHS):
        keys = slice(0 if pads is None else min(PADS[b], n), n)
        if keys.stop > keys.start:
            row = (q[b:b + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys])
            row_index = (index[0][b:b + 1], index[1][b:b + 1, :, keys], index[2][b:b + 1])
            assert torch.equal(lists[b:b + 1], attn.select(*row[:2], index=row_index)), b
            assert torch.equal(o[b:b + 1], attn(*row, index=row_index)), b
            assert_valid_selection(lists[b:b + 1], *row[:2], spec, index=row_index)
        else:
            assert (lists[b] == -1).all() and (o[b] == 0).all() and torch.isinf(lse[b]).all()
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, index=index, cache_seqlens=lens,
                                                   cache_leftpad=pads)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)


def test_the_index_selector_over_a_cache_s_rows_compiles(device):
    """Under torch.compile (fullgraph) a decode step with the index selector over a cache of per-row lengths equals
    the eager call."""
    spec = _spec("index", "kv_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.float32, device)
    index = _index(q, k.shape[2])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, index, lens):
        return attn(q, k, v, index=index, cache_seqlens=lens)

    assert torch.equal(step(q, k, v, index, lens), attn(q, k, v, index=index, cache_seqlens=lens))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["kv_centric", "q_centric"])
def test_the_index_selector_over_a_long_ragged_cache_on_gpu(schedule):
    """DSA's decode step over a ragged bf16 cache (rows of 64k, 40k, 1 and 0 keys in a 64k cache; one shared key
    head, Hi = 16, Di = 128): each row's lists a valid top-k of its own keys, o and lse matching the float64
    reference over them, and one CUDA graph of the step replayed as the rows grow equal to the eager step."""
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=16, schedule=schedule, local=1, sink=1,
                selector="index", **({} if schedule == "kv_centric" else {"q_tile": 16}))
    lengths = (65536, 40000, 1, 0)
    q, k, v, lens = _cache(1, torch.bfloat16, "cuda", 65536, lengths, heads_kv=1, group=16, head_dim=128)
    gen = torch.Generator().manual_seed(5)
    index = (torch.randn(4, 16, 1, 128, generator=gen).cuda().bfloat16(),
             torch.randn(4, 1, 65536, 128, generator=gen).cuda().bfloat16(),
             torch.randn(4, 16, 1, generator=gen).cuda() / 4)
    attn = get_kernel(spec)
    lists = attn.select(q, k, index=index, cache_seqlens=lens)
    for b, n in enumerate(lengths):
        if n:
            row_index = (index[0][b:b + 1], index[1][b:b + 1, :, :n], index[2][b:b + 1])
            assert_valid_selection(lists[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n], spec, index=row_index)
        else:
            assert (lists[b] == -1).all()
    _check(spec.replace(selector="given"), q, k, v, lens, block_idx=lists)
    o = attn(q, k, v, index=index, cache_seqlens=lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attn(q, k, v, index=index, cache_seqlens=lens)
    for step in range(1, 3):
        lens.copy_(torch.tensor([65536, 40000 + 64 * step, 1 + step, 0], dtype=torch.int32, device="cuda"))
        q.normal_()
        index[0].normal_()
        graph.replay()
        assert torch.equal(o, attn(q, k, v, index=index, cache_seqlens=lens)), step


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, selector", [("q_centric", "mean"), ("kv_centric", "mean"), ("kv_centric", "given")])
def test_long_ragged_cache_on_gpu(schedule, selector):
    """bf16 rows of 64k, 40k, 1 and 0 keys in a 64k cache: the mean selector, or given per-query lists."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1,
                selector=selector)
    q, k, v, lens = _cache(2, torch.bfloat16, "cuda", 65536, (65536, 40000, 1, 0), heads_kv=2, group=4, head_dim=128)
    idx = None if spec.selects else random_lists(spec, 4, 2, 2, 65536, seed=4).cuda()
    _check(spec, q, k, v, lens, block_idx=idx)


@pytest.mark.gpu
@pytest.mark.parametrize("pads", [None, (0, 100, 3000, 1)])
def test_a_cuda_graph_of_a_decode_step_follows_the_lengths(pads):
    """One captured step (the call with the kept reps, which grows them to the lengths) replayed as the cache
    grows: every replay equals the eager call at those lengths (and left padding), bit for bit."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, local=2, sink=1)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(1, torch.bfloat16, "cuda", 8192, (5000, 127, 8000, 1), heads_kv=2, group=4, head_dim=128)
    pads = None if pads is None else torch.tensor(pads, dtype=torch.int32, device="cuda")
    reps = attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads)
    attn(q, k, v, cache_seqlens=lens, cache_leftpad=pads, key_reps=reps)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attn(q, k, v, cache_seqlens=lens, cache_leftpad=pads, key_reps=reps)
    for step in range(1, 4):
        lens += torch.tensor([1, 1, 128, 0], dtype=torch.int32, device="cuda")
        q.normal_()
        graph.replay()
        fresh = attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads)
        eager = attn(q, k, v, cache_seqlens=lens, cache_leftpad=pads, key_reps=fresh)
        assert torch.equal(o, eager), step

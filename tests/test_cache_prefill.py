"""A prefill over a KV cache of per-row lengths: a chunk of more than DECODE_MAX_QUERIES queries at the end of each
row's keys (`cache_seqlens=`, `cache_leftpad=`), as a serving engine's chunked prefill or a static cache's next
prompt runs it. Row b is the call over its own keys alone."""
import pytest
import torch

from kernelgen import AttnConfig, Spec, get_kernel, reference
from kernelgen.errors import KernelgenValueError
from kernelgen.roles import DECODE_MAX_QUERIES, forward_roles

from checks import assert_close_to_reference, assert_valid_selection
from test_cache_seqlens import _cache, _spec
from test_decode import random_lists

# a full row, a partial last block, an empty row, fewer keys than the chunk has queries, one key
LENGTHS = (100, 37, 0, 20, 1)
PADS = (5, 20, 0, 3, 1)  # left padding: a few keys, past a block boundary, none, a few, the row's only key
N_Q = 24  # more than a decode call's 16: a prefill chunk


def _rows_alone(lengths, pads):
    return [(min(p, n), n) for p, n in zip(pads or (0,) * len(lengths), lengths)]


def test_a_prefill_over_cache_rows_runs_the_row_roles():
    spec = _spec("mean")
    assert forward_roles(spec, N_Q, cache_rows=True) == ("lists", "decode_select", "attn_rows")
    per_query = _spec("mean", "kv_centric")
    assert forward_roles(per_query, N_Q, cache_rows=True) == ("lists", "kv_decode_select", "kv_attn_rows")
    assert forward_roles(spec, DECODE_MAX_QUERIES, cache_rows=True)[2] == "decode"
    assert forward_roles(spec, N_Q)[2] == "attn"


@pytest.mark.parametrize("selector, dtype, causal, pads", [("mean", torch.float32, True, None),
                                                           ("multi:2", torch.float16, True, PADS),
                                                           ("mean", torch.float16, False, PADS),
                                                           ("given", torch.float32, True, PADS)])
def test_q_centric_rows_are_the_calls_over_their_own_keys(selector, dtype, causal, pads, device):
    """Row b's lists, o and lse are those of the call over k[b, :, pad:length] alone, bit for bit (the forward's
    own kernel runs each row), and match the float64 reference; a row with no key, and the queries placed before
    a short row's first key, give o = 0, lse = -inf."""
    spec = _spec(selector, causal=causal)
    attn = get_kernel(spec)
    q, k, v, lens = _cache(N_Q, dtype, device, lengths=LENGTHS)
    pads = None if pads is None else torch.tensor(pads, dtype=torch.int32, device=device)
    block_idx = random_lists(spec, len(LENGTHS), 2, N_Q, 100, seed=3).to(device) if selector == "given" else None
    o, lse = attn(q, k, v, block_idx=block_idx, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    lists = None if block_idx is not None else attn.select(q, k, cache_seqlens=lens, cache_leftpad=pads)
    for b, (first, n) in enumerate(_rows_alone(LENGTHS, None if pads is None else PADS)):
        if n == first:
            assert (o[b] == 0).all() and torch.isinf(lse[b]).all()
            continue
        row = (q[b:b + 1], k[b:b + 1, :, first:n], v[b:b + 1, :, first:n])
        given = None if block_idx is None else block_idx[b:b + 1]
        o_row, lse_row = attn(*row, block_idx=given, return_lse=True)
        assert torch.equal(o[b:b + 1], o_row) and torch.equal(lse[b:b + 1], lse_row), b
        if lists is not None:
            assert torch.equal(lists[b:b + 1], attn.select(*row[:2])), b
            assert_valid_selection(lists[b:b + 1], *row[:2], spec)
    ref_spec = spec if block_idx is None else spec.replace(selector="given")
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, ref_spec, block_idx, cache_seqlens=lens, cache_leftpad=pads)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)
    if causal:  # row 3 holds fewer keys than the chunk has queries: the first few come before its first key
        first, n = _rows_alone(LENGTHS, None if pads is None else PADS)[3]
        assert torch.isinf(lse[3, :, :N_Q - (n - first)]).all()
        assert block_idx is not None or not torch.isinf(lse[3, :, N_Q - (n - first):]).any()


@pytest.mark.parametrize("selector, dtype", [("mean", torch.float32), ("given", torch.float16)])
def test_per_query_rows_select_alone_and_match_the_reference(selector, dtype, device):
    """Per-query lists: each row's lists, o and lse are the call's over its own keys, bit for bit (kv_attn's
    partials and combine run each row), and match the float64 reference."""
    spec = _spec(selector, "kv_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(N_Q, dtype, device, lengths=LENGTHS)
    pads = torch.tensor(PADS, dtype=torch.int32, device=device)
    block_idx = random_lists(spec, len(LENGTHS), 2, N_Q, 100, seed=5).to(device) if selector == "given" else None
    o, lse = attn(q, k, v, block_idx=block_idx, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    lists = None if block_idx is not None else attn.select(q, k, cache_seqlens=lens, cache_leftpad=pads)
    for b, (first, n) in enumerate(_rows_alone(LENGTHS, PADS)):
        if n == first:
            assert (o[b] == 0).all() and torch.isinf(lse[b]).all()
            continue
        row = (q[b:b + 1], k[b:b + 1, :, first:n], v[b:b + 1, :, first:n])
        o_row, lse_row = attn(*row, block_idx=None if block_idx is None else block_idx[b:b + 1], return_lse=True)
        assert torch.equal(o[b:b + 1], o_row) and torch.equal(lse[b:b + 1], lse_row), b
        if lists is not None:
            assert torch.equal(lists[b:b + 1], attn.select(*row[:2])), b
    ref_spec = spec if block_idx is None else spec.replace(selector="given")
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, ref_spec, block_idx, cache_seqlens=lens, cache_leftpad=pads)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


def test_prepared_per_query_lists_bring_their_reverse_index(device, monkeypatch):
    """A prefill over cache rows with prepared per-query lists walks the lists' own reverse index: none is built
    per call, and the result is the raw lists' bit for bit."""
    import kernelgen.backends.triton as triton_backend

    spec = _spec("given", "kv_centric")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(N_Q, torch.float32, device, lengths=LENGTHS)
    raw = random_lists(spec, len(LENGTHS), 2, N_Q, 100, seed=7).to(device)
    expected = attn(q, k, v, block_idx=raw, cache_seqlens=lens)
    lists = attn.prepare(raw, N_Q, k.shape[2])

    def no_build(*args, **kwargs):
        raise AssertionError("a reverse index was built for prepared lists")

    monkeypatch.setattr(triton_backend, "build_query_reverse_index", no_build)
    assert torch.equal(attn(q, k, v, block_idx=lists, cache_seqlens=lens), expected)


def test_kept_reps_select_the_same_lists(device):
    spec = _spec("mean")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(N_Q, torch.float32, device, lengths=LENGTHS)
    reps = attn.key_reps(k, cache_seqlens=lens)
    assert torch.equal(attn(q, k, v, cache_seqlens=lens, key_reps=reps), attn(q, k, v, cache_seqlens=lens))


def test_a_prefill_over_cache_rows_is_refused_where_it_cannot_run(device):
    spec = _spec("mean")
    attn = get_kernel(spec)
    q, k, v, lens = _cache(N_Q, torch.float32, device, lengths=LENGTHS)
    cases = [
        (lambda: attn(q.requires_grad_(), k, v, cache_seqlens=lens), "no backward"),
        (lambda: get_kernel(_spec("index"))(q, k, v, cache_seqlens=lens), "needs index="),
        (lambda: get_kernel(spec, configs={"attn_rows": AttnConfig(use_tma=True)}), "use_tma"),
    ]
    for call, words in cases:
        with pytest.raises(KernelgenValueError, match=words):
            call()
        q = q.detach()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, selector, dtype", [("q_centric", "mean", torch.bfloat16),
                                                       ("q_centric", "given", torch.float16),
                                                       ("kv_centric", "mean", torch.bfloat16)])
def test_a_long_chunked_prefill_on_gpu(schedule, selector, dtype):
    """A chunk of 1024 queries appended to rows of 32768, 20000, 700 and 0 keys (left padding on one row): the
    float64 reference, and bit for bit a row's call alone."""
    tile = {} if schedule == "kv_centric" else {"q_tile": 128}
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1,
                selector=selector, **tile)
    q, k, v, lens = _cache(1024, dtype, "cuda", 32768, (32768, 20000, 700, 0), heads_kv=2, group=4, head_dim=128)
    pads = torch.tensor([0, 300, 0, 0], dtype=torch.int32, device="cuda")
    attn = get_kernel(spec)
    if spec.selects:  # the reference attends over the kernel's lists: fp32 scores may break near-ties otherwise
        idx = attn.select(q, k, cache_seqlens=lens, cache_leftpad=pads)
        assert torch.equal(attn(q, k, v, cache_seqlens=lens, cache_leftpad=pads),
                           attn(q, k, v, block_idx=idx, cache_seqlens=lens, cache_leftpad=pads))
        assert_valid_selection(idx[1:2], q[1:2], k[1:2, :, 300:20000], spec)
    else:
        idx = random_lists(spec, 4, 2, 1024, 32768, seed=7).cuda()
    o, lse = attn(q, k, v, block_idx=idx, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), idx, cache_seqlens=lens,
                                                   cache_leftpad=pads)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    row = attn(q[1:2], k[1:2, :, 300:20000], v[1:2, :, 300:20000], block_idx=idx[1:2])
    assert torch.equal(row, o[1:2])


def test_the_custom_op_takes_a_prefill_over_cache_rows(device):
    """kernelgen.custom_ops.sparse_attention with cache_seqlens and more than 16 queries: the eager call's bits,
    and torch.library's checks of the op (its fake implementation's shapes included)."""
    import kernelgen.custom_ops as ops

    spec = _spec("mean")
    q, k, v, lens = _cache(N_Q, torch.float32, device, lengths=LENGTHS)
    pads = torch.tensor(PADS, dtype=torch.int32, device=device)
    o, lse = ops.sparse_attention(q, k, v, spec, cache_seqlens=lens, cache_leftpad=pads)
    want = get_kernel(spec)(q, k, v, cache_seqlens=lens, cache_leftpad=pads, return_lse=True)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    torch.library.opcheck(torch.ops.kernelgen.sparse_attention.default,
                          (q, k, v, None, spec.to_json(), None),
                          {"cache_seqlens": lens, "cache_leftpad": pads},
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("schedule, starts", [("q_centric", (0, 16, 48)), ("kv_centric", (0, 10, 17, 37))])
def test_a_prompt_prefilled_in_chunks_gets_the_lists_of_one_call(schedule, starts, device):
    """SEMANTICS, *Batch invariance*, queries split over calls: chunks that each start a whole number of q_tile
    queries into the prompt (Q-centric), or anywhere (per-query lists), select the one call's lists over the
    cache written so far."""
    spec = _spec("mean", schedule)
    attn = get_kernel(spec)
    q, k, _, _ = _cache(64, torch.float32, device, capacity=64, lengths=(64,))
    whole = attn.select(q, k)
    per_query = spec.per_query
    for start, end in zip(starts, (*starts[1:], 64)):
        lens = torch.tensor([end], dtype=torch.int32, device=device)
        chunk = attn.select(q[:, :, start:end], k, cache_seqlens=lens)
        rows = slice(start, end) if per_query else slice(start // spec.q_tile, -(-end // spec.q_tile))
        assert torch.equal(chunk, whole[:, :, rows]), (start, end)

"""kernelgen.to_block_mask / from_block_mask: round trips of the block structure, FlexAttention (eager, CPU) on
the BlockMask against kernelgen (the interpreter, fp32) on the lists, and bad inputs."""
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import kernelgen
from kernelgen import Spec, from_block_mask, reference, to_block_mask
from kernelgen.bench.anchors import flex_token_mask
from kernelgen.custom_ops import sparse_attention
from kernelgen.interop import block_mask_blocks, block_membership

# eager flex_attention warns that it is unfused; that is what these CPU tests run
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _inputs(b, hq, hkv, n_q, n_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, 64, generator=gen)
    k, v = (torch.randn(b, hkv, n_k, 64, generator=gen) for _ in range(2))
    return q, k, v


def _flex(q, k, v, block_mask, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=spec.gqa_group > 1)


def _eligible_lists(lists, spec, n_q, n_k):
    """The canonical sets of `lists` (-1, out-of-range and repeated ids dropped), without the blocks that no
    query of the tile can see under causal masking."""
    n_blocks = spec.n_kv_blocks(n_k)
    held = block_membership(lists, n_blocks) & reference.tile_eligibility(spec, n_q, n_k)[0]
    ids = torch.where(held, torch.arange(n_blocks), -1)
    ids = torch.nn.functional.pad(ids, (0, max(0, lists.shape[-1] - n_blocks)), value=-1)
    return reference.normalize_block_idx(ids, n_blocks)[..., :lists.shape[-1]]


CASES = [  # causal, gqa_group, n_q, n_k
    (True, 2, 80, 80),
    (True, 1, 40, 72),   # Nq < Nk: bottom-right causal, partial last tile and block
    (False, 2, 72, 40),  # Nq > Nk, partial tiles
    (True, 2, 72, 40),   # causal with Nq > Nk: the first queries see nothing (o = 0)
]


@pytest.mark.parametrize("causal,g,n_q,n_k", CASES)
def test_flex_on_the_block_mask_equals_kernelgen_on_the_lists(causal, g, n_q, n_k):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=3, causal=causal, gqa_group=g, sink=1)
    q, k, v = _inputs(2, 2 * g, 2, n_q, n_k)
    lists = reference.select_blocks(q, k, spec)
    lists[0, 1, 0] = torch.tensor([-1, 7 if n_k > 16 * 7 else 99, lists[0, 1, 0, 0]])  # empty, out of range, repeat
    ours = kernelgen.get_kernel(spec.replace(selector="given"))(q, k, v, block_idx=lists)
    block_mask = to_block_mask(lists, spec, n_q, n_k)
    torch.testing.assert_close(_flex(q, k, v, block_mask, spec), ours, atol=2e-5, rtol=1e-4)
    # the fused kernel's view (full blocks whole, partial ones through the mask_mod) is the lists' too
    pairs = reference.token_mask(lists, spec, n_q, n_k).repeat_interleave(g, 1)
    assert torch.equal(flex_token_mask(block_mask), pairs)
    assert torch.equal(flex_token_mask(to_block_mask(lists, spec, n_q, n_k, exact_mask_mod=False)), pairs)
    # a Q block spanning two lists: the union of their blocks, each query kept to its own list
    wide = to_block_mask(lists, spec, n_q, n_k, q_block=32)
    assert wide.BLOCK_SIZE == (32, 16) and torch.equal(flex_token_mask(wide), pairs)


@pytest.mark.parametrize("causal, schedule", [(True, "q_centric"), (False, "q_centric"), (True, "kv_centric")])
def test_a_block_mask_over_a_cache_of_per_row_lengths(causal, schedule):
    """cache_seqlens=: each row's keys, causal diagonal and empty slots are its own, so FlexAttention on the
    mask equals kernelgen's call over the cache's rows (a prefill chunk of 24 queries after rows of 70, 37, 0 and
    20 keys in a capacity of 80)."""
    tile = {} if schedule == "kv_centric" else {"q_tile": 16}
    spec = Spec(head_dim=64, kv_block=16, top_k=3, causal=causal, gqa_group=2, sink=1, schedule=schedule, **tile)
    q, k, v = _inputs(4, 4, 2, 24, 80, seed=3)
    lens = torch.tensor([70, 37, 0, 20], dtype=torch.int32)
    lists = kernelgen.get_kernel(spec).select(q, k, cache_seqlens=lens)
    lists[1, 0, 0, 0] = 4  # a block past row 1's 37 keys: an empty slot there
    given = spec.replace(selector="given")
    want, _, _ = reference.sparse_attention(q, k, v, given, lists, cache_seqlens=lens)
    pairs = torch.zeros(4, 2, 24, 80, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        if n:
            pairs[b, :, :, :n] = reference.token_mask(lists[b:b + 1], spec, 24, n)[0]
    for exact in (True, False):
        block_mask = to_block_mask(lists, spec, 24, 80, cache_seqlens=lens, exact_mask_mod=exact,
                                   **({"q_block": 1} if schedule == "kv_centric" and not exact else {}))
        assert torch.equal(flex_token_mask(block_mask), pairs.repeat_interleave(2, 1)), exact
    got = _flex(q, k, v, to_block_mask(lists, spec, 24, 80, cache_seqlens=lens), spec)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-4)  # rows that see no key: 0 in both
    with pytest.raises(kernelgen.KernelgenTypeError, match="cache_seqlens must be an int32"):
        to_block_mask(lists, spec, 24, 80, cache_seqlens=lens.long())
    with pytest.raises(kernelgen.KernelgenValueError, match="cache_seqlens must have shape"):
        to_block_mask(lists, spec, 24, 80, cache_seqlens=lens[:3])


@pytest.mark.parametrize("causal,g,n_q,n_k", CASES)
def test_lists_to_block_mask_to_lists(causal, g, n_q, n_k):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=causal, gqa_group=g)
    gen = torch.Generator().manual_seed(1)
    n_blocks = spec.n_kv_blocks(n_k)
    raw = torch.randint(-2, n_blocks + 2, (2, 2, spec.n_q_tiles(n_q), 4), generator=gen, dtype=torch.int32)
    block_mask = to_block_mask(raw, spec, n_q, n_k)
    assert block_mask.seq_lengths == (n_q, n_k) and block_mask.kv_num_blocks.shape[1] == 2 * g
    back = from_block_mask(block_mask, spec)
    assert back.dtype == torch.int32 and back.shape == raw.shape
    # -1, out-of-range and repeated ids dropped; blocks causal hides from the whole tile dropped too
    assert torch.equal(back, _eligible_lists(raw, spec, n_q, n_k))
    # lists a selector made hold eligible blocks only: they come back as they were
    q, k, _ = _inputs(2, 2 * g, 2, n_q, n_k)
    selected = reference.select_blocks(q, k, spec.replace(local=1, sink=1))
    assert torch.equal(from_block_mask(to_block_mask(selected, spec, n_q, n_k), spec), selected)


def _blocky_mask_mod(n_q, n_k, causal, seed):
    """A mask_mod whose kept pairs are a random block pattern (32 x 16 blocks), per head, causal or not."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.rand(4, -(-n_q // 32), -(-n_k // 16), generator=gen) < 0.4
    pattern[1] = pattern[0]  # heads 0 and 1 (one GQA group of 2) agree, and so do heads 2 and 3
    pattern[3] = pattern[2]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = pattern[h, q_idx // 32, kv_idx // 16]
        return keep & (kv_idx <= q_idx + (n_k - n_q)) if causal else keep

    return mask_mod


@pytest.mark.parametrize("causal,n_q,n_k", [(True, 96, 96), (True, 64, 112), (False, 80, 48)])
def test_block_mask_to_lists_to_block_mask(causal, n_q, n_k):
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=8, causal=causal, gqa_group=2)
    mask_mod = _blocky_mask_mod(n_q, n_k, causal, seed=n_q)
    original = create_block_mask(mask_mod, 1, 4, n_q, n_k, device="cpu", BLOCK_SIZE=(32, 16))
    lists = from_block_mask(original, spec)
    assert lists.shape == (1, 2, spec.n_q_tiles(n_q), 8)
    again = to_block_mask(lists, spec, n_q, n_k)
    for got, want in zip(block_mask_blocks(again), block_mask_blocks(original)):
        assert torch.equal(got, want)  # the same partial and the same full blocks
    # kernelgen on the lists computes what FlexAttention computes on the original mask
    q, k, v = _inputs(1, 4, 2, n_q, n_k, seed=3)
    ours = kernelgen.get_kernel(spec.replace(selector="given"))(q, k, v, block_idx=lists)
    torch.testing.assert_close(ours, _flex(q, k, v, original, spec), atol=2e-5, rtol=1e-4)


def test_coarser_mask_blocks_convert_exactly():
    """A mask of 64 x 32 blocks to lists of 16-query tiles and 16-key blocks: the same pairs."""
    n = 128
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=8, causal=True)
    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, n, n, device="cpu", BLOCK_SIZE=(64, 32))
    lists = from_block_mask(mask, spec)
    assert lists.shape == (1, 1, 8, 8)  # one list for every batch and head: expand() it for the call
    # the 32-key blocks were split; halves wholly above the diagonal of their tile are left out
    assert lists[0, 0, 0].tolist() == [0] + [-1] * 7 and lists[0, 0, 7].tolist() == list(range(8))
    pairs = reference.token_mask(lists, spec, n, n)
    assert torch.equal(pairs[0, 0], torch.ones(n, n, dtype=torch.bool).tril())


def test_per_query_lists_round_trip():
    from kernelgen.workloads import random_query_lists

    spec = Spec(head_dim=64, kv_block=16, top_k=4, causal=True, gqa_group=2, selector="given", schedule="kv_centric")
    lists = random_query_lists(spec, 1, 2, 50, 70, "cpu", seed=2)
    block_mask = to_block_mask(lists, spec, 50, 70, q_block=1)
    assert block_mask.BLOCK_SIZE == (1, 16)
    assert torch.equal(from_block_mask(block_mask, spec), _eligible_lists(lists, spec, 50, 70))
    wide = to_block_mask(lists, spec, 50, 70)  # default: Q blocks of kv_block queries, membership mask_mod
    assert torch.equal(flex_token_mask(wide), reference.token_mask(lists, spec, 50, 70).repeat_interleave(2, 1))


def _window(width):
    return lambda b, h, q, kv: (kv <= q) & (q - kv < width)


def _documents(*lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q)


@pytest.mark.parametrize("name, mask_mod, causal, n_q, n_k, block", [
    ("a token-level sliding window", _window(40), True, 128, 128, "masks part of KV block 0 .* Q block 1"),
    ("document boundaries", _documents(40, 50, 38), True, 128, 128, "masks part of KV block 0 .* Q block 1"),
    ("a prefix kept whole", lambda b, h, q, kv: (kv <= q) | (kv < 40), True, 128, 128,
     "keeps every pair of KV block 0 .* Q block 0"),
    ("Flex's top-left causal, Nq < Nk", lambda b, h, q, kv: kv <= q, True, 64, 128, "masks part of KV block 0"),
    ("a causal mask for a non-causal spec", lambda b, h, q, kv: kv <= q, False, 128, 128, "masks part of KV block 0"),
    ("no mask for a causal spec", lambda b, h, q, kv: kv >= 0, True, 128, 128,
     "keeps every pair of KV block 0 .* Q block 0"),
])
def test_a_token_level_mask_the_lists_cannot_carry_is_refused(name, mask_mod, causal, n_q, n_k, block):
    """The mask's structure shows where its mask_mod is not kernelgen's causal (or no) mask: a ValueError naming the
    block, unless approximate=True, which takes the block structure (and then differs from FlexAttention)."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=causal)
    mask = create_block_mask(mask_mod, None, None, n_q, n_k, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(ValueError, match=block + ".*approximate=True"):
        from_block_mask(mask, spec)
    lists = from_block_mask(mask, spec, approximate=True)
    q, k, v = _inputs(1, 1, 1, n_q, n_k)
    ours = kernelgen.get_kernel(spec.replace(selector="given"))(q, k, v, block_idx=lists)
    assert (ours - _flex(q, k, v, mask, spec)).abs().max() > 1e-2, name  # what the error spared the caller


def test_masks_kernelgen_reproduces_pass_the_token_level_check():
    """Bottom-right causal with Nq < Nk and partial edge blocks, no mask at all, and a mask without full blocks
    whose mask_mod is the no-op: each converts, and kernelgen computes what FlexAttention does."""
    cases = [(lambda b, h, q, kv: kv <= q + 50, True, 70, 120), (lambda b, h, q, kv: kv >= 0, False, 70, 120)]
    for mask_mod, causal, n_q, n_k in cases:
        spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=causal)
        mask = create_block_mask(mask_mod, None, None, n_q, n_k, device="cpu", BLOCK_SIZE=32)
        q, k, v = _inputs(1, 1, 1, n_q, n_k)
        ours = kernelgen.get_kernel(spec.replace(selector="given"))(q, k, v, block_idx=from_block_mask(mask, spec))
        torch.testing.assert_close(ours, _flex(q, k, v, mask, spec), atol=2e-5, rtol=1e-4)
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4)
    noop = BlockMask.from_kv_blocks(torch.tensor([[[2]]], dtype=torch.int32),
                                    torch.tensor([[[[0, 1]]]], dtype=torch.int32), BLOCK_SIZE=16, seq_lengths=(16, 32))
    assert from_block_mask(noop, spec).tolist() == [[[[0, 1, -1, -1]]]]
    with pytest.raises(ValueError, match="masks part of KV block 0"):  # a mask_mod and no full blocks: partial ones
        from_block_mask(BlockMask.from_kv_blocks(noop.kv_num_blocks, noop.kv_indices, BLOCK_SIZE=16,
                                                 seq_lengths=(16, 32), mask_mod=lambda b, h, q, kv: kv >= 0), spec)


@pytest.mark.parametrize("window, n", [(40, 128), (70, 150), (33, 96)])
def test_a_sliding_window_mask_converts_exactly_for_a_window_spec(window, n):
    """FlexAttention's sliding-window mask is a window spec's: its lists convert with no refusal, and kernelgen over
    them computes what FlexAttention does; a spec of another window is refused."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, window=window, selector="given")
    mask = create_block_mask(_window(window), None, None, n, n, device="cpu", BLOCK_SIZE=32)
    lists = from_block_mask(mask, spec)
    assert torch.equal(flex_token_mask(mask), reference.token_mask(lists, spec, n, n))
    q, k, v = _inputs(1, 1, 1, n, n)
    torch.testing.assert_close(kernelgen.get_kernel(spec)(q, k, v, block_idx=lists), _flex(q, k, v, mask, spec),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="masks part of KV block .*spec.window=.* keys"):
        from_block_mask(mask, spec.replace(window=window + 32))
    # and back: a window spec's lists to a BlockMask whose mask_mod has the window (exact or not)
    for exact in (True, False):
        back = to_block_mask(lists, spec, n, n, exact_mask_mod=exact)
        assert torch.equal(flex_token_mask(back), reference.token_mask(lists, spec, n, n))
    selected = kernelgen.get_kernel(spec.replace(selector="mean", top_k=spec.replace(top_k=1).window_blocks))
    lists = selected.select(q, k)
    assert torch.equal(flex_token_mask(to_block_mask(lists, selected.spec, n, n)),
                       reference.token_mask(lists, selected.spec, n, n))


def test_heads_of_a_group_must_agree_unless_union():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, gqa_group=2)
    kv_num = torch.tensor([[[1], [1]]], dtype=torch.int32)  # 1 batch, 2 query heads, 1 Q block
    kv_ids = torch.tensor([[[[0, 1]], [[1, 0]]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_ids, BLOCK_SIZE=16, seq_lengths=(16, 32))
    with pytest.raises(ValueError, match="union_heads") as info:
        from_block_mask(mask, spec)
    assert "query heads 0 and 1" in str(info.value) and "gqa_group" in str(info.value)
    assert from_block_mask(mask, spec, union_heads=True).tolist() == [[[[0, 1, -1, -1]]]]


def test_bad_inputs_name_the_argument():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2)
    lists = torch.zeros(1, 1, 4, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="spec"):
        to_block_mask(lists, {"kv_block": 16}, 64, 64)
    with pytest.raises(TypeError, match="lists"):
        to_block_mask(lists.tolist(), spec, 64, 64)
    with pytest.raises(TypeError, match="lists.dtype"):
        to_block_mask(lists.float(), spec, 64, 64)
    with pytest.raises(ValueError, match="lists.shape.*n_q_tiles = 2"):
        to_block_mask(lists, spec, 32, 64)
    with pytest.raises(TypeError, match="seq_k"):
        to_block_mask(lists, spec, 64, 64.0)
    with pytest.raises(ValueError, match="seq_q"):
        to_block_mask(lists, spec, 0, 64)
    with pytest.raises(ValueError, match="q_block"):
        to_block_mask(lists, spec, 64, 64, q_block=24)
    with pytest.raises(ValueError, match="exact_mask_mod"):
        to_block_mask(lists, spec, 64, 64, q_block=32, exact_mask_mod=False)
    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(TypeError, match="block_mask"):
        from_block_mask(lists, spec)
    # a Flex user's first try: the BlockMask itself as block_idx, which is told how to convert it
    given = kernelgen.get_kernel(spec.replace(selector="given"))
    q = torch.zeros(1, 1, 64, 64)
    with pytest.raises(TypeError, match=r"got a FlexAttention BlockMask: pass kernelgen.from_block_mask"):
        given(q, q, q, block_idx=mask)
    with pytest.raises(TypeError, match=r"got a FlexAttention BlockMask: pass kernelgen.from_block_mask"):
        given.prepare(mask, 64, 64)
    with pytest.raises(TypeError, match=r"got a FlexAttention BlockMask: pass kernelgen.from_block_mask"):
        sparse_attention(q, q, q, spec.replace(selector="given"), block_idx=mask)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE.*spec.kv_block = 32"):
        from_block_mask(mask, spec.replace(kv_block=32))
    with pytest.raises(ValueError, match=r"BLOCK_SIZE.*spec.q_tile"):
        from_block_mask(mask, spec.replace(q_tile=32))
    with pytest.raises(ValueError, match="spec.top_k = 2"):  # the last tile lists all 4 blocks
        from_block_mask(mask, spec.replace(causal=True))
    three_heads = create_block_mask(lambda b, h, q, kv: kv <= q, 1, 3, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="3 heads.*gqa_group = 2"):
        from_block_mask(three_heads, spec.replace(top_k=4, gqa_group=2))
    # flags are True or False: a string (or None) would choose by its truth
    with pytest.raises(TypeError, match="exact_mask_mod must be True or False, got 'no'"):
        to_block_mask(lists, spec, 64, 64, exact_mask_mod="no")
    with pytest.raises(TypeError, match="union_heads must be True or False, got 'yes'"):
        from_block_mask(mask, spec.replace(top_k=4), union_heads="yes")
    with pytest.raises(TypeError, match="approximate must be True or False, got 1"):
        from_block_mask(mask, spec.replace(top_k=4), approximate=1)
    # the public helpers check their arguments, naming them
    with pytest.raises(TypeError, match="block_mask must be a"):
        block_mask_blocks(None)
    for bad in (lists.tolist(), lists.float()):
        with pytest.raises(TypeError, match="block_idx must be an int32 or int64"):
            block_membership(bad, 4)
    with pytest.raises(TypeError, match="n_blocks must be an int"):
        block_membership(lists, "4")
    with pytest.raises(ValueError, match="n_blocks must be >= 0"):
        block_membership(lists, -1)


def _fla_lists(b, tokens, heads_kv, slots, n_blocks, seed=0):
    """fla-core's int64 [B, T, Hkv, S] lists with -1, repeated and out-of-range ids, and counts [B, T, Hkv]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, n_blocks + 2, (b, tokens, heads_kv, slots), generator=gen)
    counts = torch.randint(0, slots + 1, (b, tokens, heads_kv), generator=gen)
    return ids, counts


def test_fla_lists_are_the_transposed_lists_without_their_unused_slots():
    ids, counts = _fla_lists(2, 24, 2, 3, 4)
    used = torch.arange(3) < counts[..., None]
    want = torch.where(used, ids, -1).transpose(1, 2).to(torch.int32)
    for got, expected in ((kernelgen.from_fla_lists(ids, counts), want),
                          (kernelgen.from_fla_lists(ids, 2), torch.where(torch.arange(3) < 2, ids, -1).transpose(1, 2)),
                          (kernelgen.from_fla_lists(ids.int()), ids.transpose(1, 2))):
        assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, expected.int())


def test_fla_packed_lists_attend_each_sequence_as_alone():
    """fla-core's varlen lists (B = 1, ids counted from each sequence's first key), converted with cu_seqlens:
    attn.varlen gives each sequence the call over it alone with its own tokens' lists, bit for bit."""
    spec = Spec(head_dim=64, kv_block=16, top_k=3, causal=True, gqa_group=2, selector="given", schedule="kv_centric")
    attn = kernelgen.get_kernel(spec)
    lengths = (40, 0, 1, 33)
    total = sum(lengths)
    bounds = torch.tensor((0,) + lengths).cumsum(0).to(torch.int32)
    ids, counts = _fla_lists(1, total, 2, 3, 3, seed=1)
    lists = kernelgen.from_fla_lists(ids, counts, cu_seqlens=bounds)
    assert lists.shape == (4, 2, 40, 3)
    assert torch.equal(lists, kernelgen.from_fla_lists(ids, counts, cu_seqlens=bounds.long(), max_seqlen=40))
    wider = kernelgen.from_fla_lists(ids, counts, cu_seqlens=bounds, max_seqlen=48)  # as under torch.compile
    assert torch.equal(wider[:, :, :40], lists) and bool((wider[:, :, 40:] == -1).all())
    compiled = torch.compile(lambda i, c, b: kernelgen.from_fla_lists(i, c, cu_seqlens=b, max_seqlen=48),
                             backend="eager", fullgraph=True)  # no host read, no data-dependent shape
    assert torch.equal(compiled(ids, counts, bounds), wider)
    shorter = kernelgen.from_fla_lists(ids, counts, cu_seqlens=bounds, max_seqlen=16)  # tails past it dropped
    assert torch.equal(shorter, lists[:, :, :16])
    q, _, _ = _inputs(1, 4, 2, total, total, seed=2)
    k, v = (torch.randn(total, 2, 64, generator=torch.Generator().manual_seed(s)) for s in (3, 4))
    q = q[0].transpose(0, 1).contiguous()  # packed [total, Hq, D]
    o = attn.varlen(q, k, v, bounds, block_idx=lists)
    per_token = kernelgen.from_fla_lists(ids, counts)  # [1, Hkv, total, S]
    for d, (start, n) in enumerate(zip(bounds[:-1].tolist(), lengths)):
        seq = slice(start, start + n)
        assert torch.equal(lists[d, :, :n], per_token[0, :, seq]) and bool((lists[d, :, n:] == -1).all())
        if n == 0:
            continue
        alone = attn(*(x[seq].transpose(0, 1)[None] for x in (q, k, v)), block_idx=per_token[:, :, seq])
        assert torch.equal(o[seq], alone[0].transpose(0, 1))
        want, _, _ = reference.sparse_attention(*(x[seq].transpose(0, 1)[None] for x in (q, k, v)), spec,
                                                block_idx=per_token[:, :, seq])
        assert (o[seq] - want[0].transpose(0, 1)).abs().max() < 1e-4


def test_fla_lists_bad_inputs_name_the_argument():
    ids, counts = _fla_lists(1, 8, 2, 3, 2)
    bounds = torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_indices must be an int32 or int64"):
        kernelgen.from_fla_lists(ids.float())
    with pytest.raises(ValueError, match=r"block_indices must be \[B, T, Hkv, S\]"):
        kernelgen.from_fla_lists(ids[0])
    with pytest.raises(TypeError, match="block_counts must be None, an int or an integer"):
        kernelgen.from_fla_lists(ids, counts.float())
    with pytest.raises(ValueError, match=r"block_counts must be \[B, T, Hkv\] = \(1, 8, 2\)"):
        kernelgen.from_fla_lists(ids, counts[:, :4])
    with pytest.raises(ValueError, match="max_seqlen .* goes with cu_seqlens"):
        kernelgen.from_fla_lists(ids, max_seqlen=8)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 or int64"):
        kernelgen.from_fla_lists(ids, cu_seqlens=[0, 5, 8])
    with pytest.raises(ValueError, match=r"packs the sequences into one row, \[1, T, Hkv, S\]"):
        kernelgen.from_fla_lists(ids.expand(2, -1, -1, -1), cu_seqlens=bounds)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to the 8 packed tokens"):
        kernelgen.from_fla_lists(ids, cu_seqlens=torch.tensor([0, 5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        kernelgen.from_fla_lists(ids, cu_seqlens=torch.tensor([0, 6, 5, 8], dtype=torch.int32))
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        kernelgen.from_fla_lists(ids, cu_seqlens=bounds, max_seqlen=5.0)


def _flashinfer_csr(table: torch.Tensor, lengths: list[int], page_size: int):
    """FlashInfer's CSR description of the pages a table's rows hold: (kv_indptr, kv_indices, kv_last_page_len)."""
    pages = [-(-n // page_size) for n in lengths]
    indices = torch.cat([table[b, :p] for b, p in enumerate(pages)])
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 1 for n, p in zip(lengths, pages)], dtype=torch.int32)
    return indptr, indices.to(torch.int32), last


def test_flashinfer_pages_are_a_block_table_and_lengths():
    """A paged cache described FlashInfer's way (its NHD pool, CSR page indices, last page lengths) becomes the
    block table and lengths of kernelgen's call over the same pages: the same o as over the contiguous cache; with
    max_pages given (no host read) the same table, and a row of more pages cut to them."""
    from test_paged_kv import paged

    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=3, causal=True, gqa_group=2, local=1, sink=1)
    lengths = [96, 37, 0, 48, 1]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 1, 64, generator=gen)
    k, v = (torch.randn(5, 2, 96, 64, generator=gen) for _ in range(2))
    k_pages, table = paged(k, 32)
    v_pages, _ = paged(v, 32, table=table)
    pool = torch.stack([k_pages, v_pages], 1).transpose(2, 3).contiguous()  # FlashInfer's [n_pages, 2, page, H, D]
    indptr, indices, last = _flashinfer_csr(table, lengths, 32)
    got_table, got_lens = kernelgen.from_flashinfer_pages(indptr, indices, last, 32)
    assert got_lens.tolist() == lengths and got_table.shape == (5, 3)
    for b, n in enumerate(lengths):
        pages = -(-n // 32)
        assert torch.equal(got_table[b, :pages], table[b, :pages]) and (got_table[b, pages:] == -1).all()
    attn = kernelgen.get_kernel(spec)
    o = attn(q, pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2), block_table=got_table, cache_seqlens=got_lens)
    assert torch.equal(o, attn(q, k, v, cache_seqlens=got_lens))
    fixed_table, fixed_lens = kernelgen.from_flashinfer_pages(indptr, indices, last, 32, max_pages=3)
    assert torch.equal(fixed_table, got_table) and torch.equal(fixed_lens, got_lens)
    compiled = torch.compile(lambda *csr: kernelgen.from_flashinfer_pages(*csr, 32, max_pages=3), fullgraph=True,
                             backend="aot_eager")  # no host read with max_pages: it traces whole
    assert all(torch.equal(a, b) for a, b in zip(compiled(indptr, indices, last), (got_table, got_lens)))
    cut_table, cut_lens = kernelgen.from_flashinfer_pages(indptr, indices, last, 32, max_pages=2)
    assert torch.equal(cut_table, got_table[:, :2]) and cut_lens.tolist() == [64, 37, 0, 48, 1]
    with pytest.raises(kernelgen.KernelgenTypeError, match="kv_indices must be an int32 or int64"):
        kernelgen.from_flashinfer_pages(indptr, indices.float(), last, 32)
    with pytest.raises(kernelgen.KernelgenValueError, match=r"kv_indptr must be \[B \+ 1\]"):
        kernelgen.from_flashinfer_pages(indptr, indices, last[:-1], 32)
    with pytest.raises(kernelgen.KernelgenValueError, match="must rise from 0"):
        kernelgen.from_flashinfer_pages(indptr.flip(0).contiguous(), indices, last, 32)
    with pytest.raises(kernelgen.KernelgenTypeError, match="max_pages must be an int"):
        kernelgen.from_flashinfer_pages(indptr, indices, last, 32, max_pages=2.0)
    for wrong in (0, 33):  # a last page of no keys, or of more than a page holds: never a length made up
        bad = last.clone()
        bad[3] = wrong
        with pytest.raises(kernelgen.KernelgenValueError, match=rf"kv_last_page_len\[3\] = {wrong}: a row with pages "
                                                                 r"holds 1 \.\. page_size = 32"):
            kernelgen.from_flashinfer_pages(indptr, indices, bad, 32)

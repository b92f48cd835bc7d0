"""The oracle itself: against SDPA where they must agree, and the properties DESIGN.md fixes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import Spec, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [1, 4])
def test_dense_matches_sdpa(causal, g):
    n = 200
    q, k, v = rand(2, 2 * g, n, 64), rand(2, 2, n, 64), rand(2, 2, n, 64)
    spec = Spec(head_dim=64, kv_block=32, q_tile=64, top_k=8, causal=causal, gqa_group=g)  # 7 blocks: dense
    o, lse, idx = reference.sparse_attention(q, k, v, spec)
    expect = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert (o - expect).abs().max() < 1e-12
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) / 8.0
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12


def test_causal_bottom_right_and_empty_rows():
    nq, nk = 96, 40  # queries 0..55 see no key under bottom-right causal
    q, k, v = rand(1, 1, nq, 64), rand(1, 1, nk, 64), rand(1, 1, nk, 64)
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=3, causal=True)
    o, lse, idx = reference.sparse_attention(q, k, v, spec)
    assert (o[:, :, : nq - nk] == 0).all() and torch.isinf(lse[:, :, : nq - nk]).all()
    assert not torch.isnan(o).any()
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    expect = F.scaled_dot_product_attention(q[:, :, nq - nk :], k, v, attn_mask=(j <= i + nk - nq)[nq - nk :])
    assert (o[:, :, nq - nk :] - expect).abs().max() < 1e-12
    assert (idx[0, 0, 0] == -1).all()  # tile 0: nothing visible, empty list


def test_gradients_of_the_stored_output_are_flashattention_s_algorithm():
    """With stored_o, delta = rowsum(do * stored_o), as a kernel takes it: dS = P (dP - delta). Exact o gives
    autograd's gradients; a bf16 o gives the algorithm's, whose dq where a row sees one key is rounding noise
    (the exact dq is 0 there), and rows that see no key get 0, not NaN."""
    nq, nk, d = 40, 5, 64  # bottom-right causal: queries 35.. see 1..5 keys, the rest none
    spec = Spec(head_dim=d, kv_block=16, q_tile=16, top_k=2, causal=True, selector="given")
    q, k, v, do = rand(1, 1, nq, d), rand(1, 1, nk, d), rand(1, 1, nk, d), rand(1, 1, nq, d)
    lists = torch.zeros(1, 1, 3, 2, dtype=torch.int32)
    o, _, _ = reference.sparse_attention(q, k, v, spec, lists)
    exact = reference.sparse_attention_grads(q, k, v, do, spec, lists)
    for got, want in zip(reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=o), exact):
        assert torch.equal(got, want)
    stored = o.to(torch.bfloat16)
    dq, dk, dv = reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=stored)
    visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] - (nq - nk)
    s = (q[0, 0] @ k[0, 0].T / d**0.5).masked_fill(~visible, -torch.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    ds = p * (do[0, 0] @ v[0, 0].T - (do[0, 0] * stored[0, 0].double()).sum(-1, keepdim=True))
    assert (dq[0, 0] - ds @ k[0, 0] / d**0.5).abs().max() < 1e-12
    assert (dk[0, 0] - ds.T @ q[0, 0] / d**0.5).abs().max() < 1e-12
    assert torch.equal(dv, exact[2])
    assert (dq[0, 0, : nq - nk] == 0).all() and exact[0][0, 0, nq - nk].abs().max() < 1e-12
    assert dq[0, 0, nq - nk].abs().max() > 1e-6  # one key: delta's rounding, not 0
    with pytest.raises(ValueError, match=r"stored_o.shape = \(1, 1, 39, 64\); expected q's, \(1, 1, 40, 64\)"):
        reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=o[:, :, 1:])


def test_lse_merges_disjoint_key_sets():
    q, k, v = rand(1, 2, 64, 64), rand(1, 2, 128, 64), rand(1, 2, 128, 64)
    full = torch.ones(1, 2, 64, 128, dtype=torch.bool)
    a = full.clone()
    a[..., 50:] = False
    o, lse = reference.attention(q, k, v, full)
    oa, la = reference.attention(q, k, v, a)
    ob, lb = reference.attention(q, k, v, ~a)
    merged = torch.logaddexp(la, lb)
    assert (merged - lse).abs().max() < 1e-12
    om = torch.exp(la - merged)[..., None] * oa + torch.exp(lb - merged)[..., None] * ob
    assert (om - o).abs().max() < 1e-12


def test_selection_forced_ties_and_budget():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=True, local=2, sink=1)
    n = 160
    q = torch.ones(1, 1, n, 64, dtype=torch.float64)
    k = torch.ones(1, 1, n, 64, dtype=torch.float64)  # every score ties
    idx = reference.select_blocks(q, k, spec)[0, 0]
    for t in range(10):
        visible = list(range(t + 1))
        forced = sorted({0} | {b for b in (t, t - 1) if b >= 0})
        rest = [b for b in visible if b not in forced][: 4 - len(forced)]  # ties: lowest ids
        assert idx[t].tolist() == sorted(forced + rest) + [-1] * (4 - len(forced + rest))


def test_selection_picks_highest_scores():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, selector="mean")
    q = torch.zeros(1, 1, 16, 64, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 96, 64, dtype=torch.float64)
    for b, val in enumerate([0.1, 0.5, -1.0, 0.9, 0.2, 0.3]):
        k[0, 0, 16 * b : 16 * b + 16, 0] = val
    assert reference.select_blocks(q, k, spec)[0, 0, 0].tolist() == [1, 3]


def test_multi_sees_what_mean_averages_away():
    # block 1 holds one strongly matching group and one opposite group: its mean is 0, its best group is not
    spec_mean = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=1)
    spec_multi = spec_mean.replace(selector="multi:2")
    q = torch.zeros(1, 1, 16, 64, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 32, 64, dtype=torch.float64)
    k[0, 0, :16, 0] = 0.1
    k[0, 0, 16:24, 0] = 1.0
    k[0, 0, 24:32, 0] = -1.0
    assert reference.select_blocks(q, k, spec_mean)[0, 0, 0].tolist() == [0]
    assert reference.select_blocks(q, k, spec_multi)[0, 0, 0].tolist() == [1]


def test_normalize_and_token_mask_ignore_bad_ids():
    idx = torch.tensor([[[[5, -1, 99, 2, 2, -7]]]], dtype=torch.int32)
    assert reference.normalize_block_idx(idx, 6).tolist() == [[[[2, 5, -1, -1, -1, -1]]]]  # a repeat is empty
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=6)
    mask = reference.token_mask(idx, spec, 16, 96)
    assert mask[0, 0, 0].view(6, 16).all(-1).tolist() == [False, False, True, False, False, True]


def test_a_plain_import_kernelgen_gives_the_reference():
    """As the README uses it, in a fresh process: `import kernelgen`, then `kernelgen.reference.sparse_attention`."""
    code = ("import torch, kernelgen\nq = k = v = torch.zeros(1, 1, 64, 64)\n"
            "o, lse, idx = kernelgen.reference.sparse_attention(q, k, v, kernelgen.Spec(head_dim=64, top_k=1))\n"
            "assert o.shape == q.shape\n")
    env = {**os.environ, "PYTHONPATH": str(Path(kernelgen.__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_gradients_broadcast_lists_of_one_batch_or_kv_head():
    """sparse_attention_grads takes lists with a batch or KV-head dimension of 1 as sparse_attention does: the
    gradients of those lists expanded."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True, gqa_group=2)
    q, k, v = rand(2, 4, 64, 64), rand(2, 2, 64, 64), rand(2, 2, 64, 64)
    do = rand(2, 4, 64, 64)
    lists = torch.tensor([[0, 1], [1, -1], [2, 0], [3, 1]], dtype=torch.int32).view(1, 1, 4, 2)
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists.expand(2, 2, -1, -1))
    for got, expected in zip(reference.sparse_attention_grads(q, k, v, do, spec, lists), want):
        assert torch.equal(got, expected)


def test_a_slice_of_the_query_heads_takes_lists_of_one_kv_head():
    """A check of fewer query heads than a group (q[:, :2] at G = 4) with lists of one KV head: the rows of the
    whole call, as the GPU tests check a slice of the heads in float64."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True, gqa_group=4)
    q, k, v = rand(1, 4, 64, 64), rand(1, 1, 64, 64), rand(1, 1, 64, 64)
    lists = torch.tensor([[0, 1], [1, -1], [2, 0], [3, 1]], dtype=torch.int32).view(1, 1, 4, 2)
    whole_o, whole_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=lists)
    o, lse, _ = reference.sparse_attention(q[:, :2], k, v, spec, block_idx=lists)
    assert torch.equal(o, whole_o[:, :2]) and torch.equal(lse, whole_lse[:, :2])


def test_queries_in_the_wrong_layout_are_refused_not_answered():
    """q passed as [B, N, H, D]: more heads than the spec's groups of k's heads is no call of the spec."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=True, gqa_group=2, local=1)
    q, k = torch.randn(1, 2, 64, 64), torch.randn(1, 1, 64, 64)
    with pytest.raises(ValueError, match=r"q has 64 heads .* at most 2.*\[B, H, N, D\]"):
        reference.sparse_attention(q.transpose(1, 2), k, k, spec)
    with pytest.raises(ValueError, match="q has 64 heads"):
        reference.sparse_attention_grads(q.transpose(1, 2), k, k, q.transpose(1, 2), spec, torch.zeros(1, 1, 1, 4))
    assert reference.sparse_attention(q, k, k, spec)[0].shape == q.shape
    # a slice of the group: its lists are the whole group's, which the selector pools from all of its heads
    with pytest.raises(ValueError, match=r"q has 1 of the 2 query heads .* pools all of them.*block_idx="):
        reference.sparse_attention(q[:, :1], k, k, spec)
    lists = reference.select_blocks(q, k, spec)
    assert torch.equal(reference.sparse_attention(q[:, :1], k, k, spec, block_idx=lists)[0],
                       reference.sparse_attention(q, k, k, spec)[0][:, :1])


def test_some_query_heads_with_several_kv_heads_are_refused_not_answered():
    """Query head i reads KV head i // G: q[:, :2] at G = 2 beside k's 2 heads are both KV head 0's, which the
    oracle cannot tell from q[:, 2:4] (KV head 1's). It refuses them rather than pair head 1 with KV head 1; a
    slice goes with its KV head alone."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True, gqa_group=2, selector="given")
    q, k, v = rand(1, 4, 32, 64), rand(1, 2, 32, 64), rand(1, 2, 32, 64)
    lists = torch.tensor([[0, -1], [0, 1]], dtype=torch.int32).view(1, 1, 2, 2)
    whole_o, _, _ = reference.sparse_attention(q, k, v, spec, block_idx=lists)
    with pytest.raises(ValueError, match=r"q has 2 heads and k 2; .* k\[:, h:h\+1\]"):
        reference.sparse_attention(q[:, :2], k, v, spec, block_idx=lists)
    with pytest.raises(ValueError, match="q has 2 heads and k 2"):
        reference.sparse_attention_grads(q[:, :2], k, v, q[:, :2], spec, lists)
    o, _, _ = reference.sparse_attention(q[:, 2:4], k[:, 1:], v[:, 1:], spec, block_idx=lists)
    assert torch.equal(o, whole_o[:, 2:4])


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_the_selector_fills_every_slot_the_forced_blocks_leave(schedule):
    """The forced blocks are a set: at diagonal block 0 (Nq = Nk, tile 0 or query 0), sink=1 and local=2 force
    block 0 alone (local block -1 does not exist), so top_k=3 leaves two free slots, not top_k - (sink + local) = 0,
    as the kernels' selection fills them."""
    kw = {} if schedule == "kv_centric" else {"q_tile": 16}
    spec = Spec(head_dim=64, kv_block=16, top_k=3, causal=False, sink=1, local=2, schedule=schedule, **kw)
    q = torch.zeros(1, 1, 64, 64, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 64, 64, dtype=torch.float64)
    for b, val in enumerate([-1.0, 0.5, -0.5, 0.9]):
        k[0, 0, 16 * b : 16 * b + 16, 0] = val
    lists = reference.select_blocks(q, k, spec)[0, 0]
    assert lists[0].tolist() == [0, 1, 3]  # block 0 forced; blocks 3 and 1 score highest


def test_a_query_whose_listed_blocks_all_lie_past_its_diagonal_is_an_empty_row():
    """Nq = Nk = 32, q_tile 32, kv_block 16, top_k=1, causal: the tile's list is its diagonal block 1 alone, and
    queries 0..15 see none of its keys: o = 0, lse = -inf, and no gradient, as for a list of empty slots."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=1, causal=True)
    q, k, v, do = rand(1, 1, 32, 64), rand(1, 1, 32, 64), rand(1, 1, 32, 64), rand(1, 1, 32, 64)
    o, lse, idx = reference.sparse_attention(q, k, v, spec)
    assert idx.tolist() == [[[[1]]]]
    assert (o[0, 0, :16] == 0).all() and torch.isneginf(lse[0, 0, :16]).all() and torch.isfinite(lse[0, 0, 16:]).all()
    dq, dk, dv = reference.sparse_attention_grads(q, k, v, do, spec, idx, stored_o=o.float())
    assert (dq[0, 0, :16] == 0).all() and (dk[0, 0, :16] == 0).all() and (dv[0, 0, :16] == 0).all()
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def test_seqlens_outside_self_attention_are_refused_not_answered():
    """seqlens is a right-padded batch of self-attention (Nq == Nk), refused with cache_seqlens or block_table, as
    the kernels refuse them: no answer for a call no kernel makes (Nq = 32 against Nk = 64 was q's 32 rows over
    k's first 32 keys; with cache_seqlens, seqlens was ignored)."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True)
    q, k = rand(1, 1, 32, 64), rand(1, 1, 64, 64)
    lens = torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"Nq == Nk \(got 32 and 64\)"):
        reference.sparse_attention(q, k, k, spec, seqlens=lens)
    with pytest.raises(ValueError, match="without cache_seqlens or block_table"):
        reference.sparse_attention(k, k, k, spec, seqlens=lens, cache_seqlens=lens)
    o, lse, _ = reference.sparse_attention(k, k, k, spec, seqlens=lens)
    assert (o[0, 0, 40:] == 0).all() and torch.isneginf(lse[0, 0, 40:]).all()


def test_the_reference_refuses_what_no_kernel_call_takes():
    """A scale, spec, shape or list dtype the kernels refuse is refused here too, never answered."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True)
    q = torch.randn(1, 1, 32, 64)
    cases = [(KernelgenValueError, "scale must be > 0", dict(scale=0)),
             (KernelgenTypeError, "scale must be a finite real", dict(scale=float("inf"))),
             (KernelgenTypeError, "scale must be a finite real", dict(scale=torch.tensor(0.5))),
             (KernelgenTypeError, "block_idx must be an integer tensor", dict(block_idx=torch.zeros(1, 1, 2, 2))),
             (KernelgenTypeError, "spec must be a kernelgen.Spec", dict(spec={"head_dim": 64})),
             (KernelgenValueError, r"empty input: q \(1, 1, 0, 64\)", dict(q=q[:, :, :0])),
             (KernelgenValueError, "D = spec.head_dim = 64", dict(q=q[..., :32], k=q[..., :32], v=q[..., :32]))]
    for error, match, options in cases:
        args = {"q": q, "k": q, "v": q, "spec": spec} | options
        with pytest.raises(error, match=match):
            reference.sparse_attention(**args)
    with pytest.raises(KernelgenValueError, match="scale must be > 0"):
        reference.sparse_attention_grads(q, q, q, q, spec, torch.zeros(1, 1, 2, 2, dtype=torch.int32), scale=-1.0)

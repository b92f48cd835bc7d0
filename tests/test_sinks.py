"""Attention sinks (`sinks=`, a logit per query head in each row's softmax, with no value): o, lse and the gradients
to q, k, v and the sinks against float64 autograd through kernelgen.reference, on both schedules, over a cache,
a padded batch and packed sequences, and under torch.compile; the reference against the softmax with a sink
column that gpt-oss's eager attention computes; bad sinks named."""
import math

import pytest
import torch

import kernelgen
from kernelgen import Spec, reference
from checks import assert_close_to_reference
from test_backward import assert_grads_close, leaves


def sinks_of(heads: int, device, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(device, dtype).requires_grad_()


def reference_with_grads(q, k, v, sinks, spec, lists, do, dlse, **call):
    """o, lse and the float64 gradients of sum(o * do) + sum(lse * dlse) to q, k, v and sinks."""
    leaves_ = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    o, lse, _ = reference.sparse_attention(*leaves_[:3], spec, lists, sinks=leaves_[3], **call)
    loss = (o * do.double()).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse.double()).sum()
    loss.backward()
    return o.detach(), lse.detach(), [x.grad for x in leaves_]


def test_reference_is_the_softmax_with_a_sink_column():
    """As gpt-oss's eager attention: the sink logit joins the scores, softmax, and its column is dropped."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2)  # every block listed
    q, k, v, _ = leaves(1, 2, 2, 100, 120, 64, torch.float64, "cpu", seed=1)
    sinks = sinks_of(4, "cpu").double()
    o, lse, _ = reference.sparse_attention(q, k, v, spec, sinks=sinks)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(64)
    visible = torch.ones(100, 120, dtype=torch.bool).tril(120 - 100)  # bottom-right causal
    scores = scores.masked_fill(~visible, -torch.inf)
    with_sink = torch.cat([scores, sinks[None, :, None, None].expand(1, 4, 100, 1)], -1)
    want = torch.softmax(with_sink, -1)[..., :-1] @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(with_sink, -1), rtol=1e-12, atol=1e-12)


SPECS = [  # causal with Nq > Nk: the first rows see no key, and attend to the sink alone
    (Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1), (170, 130)),
    (Spec(head_dim=64, kv_block=64, q_tile=32, top_k=2, gqa_group=4), (100, 230)),
    (Spec(head_dim=64, kv_block=32, top_k=3, causal=True, gqa_group=2, schedule="kv_centric", sink=1), (150, 140)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec, lengths", SPECS, ids=["q-causal", "q-full", "kv-causal"])
def test_against_reference(spec, lengths, dtype, device):
    q, k, v, do = leaves(1, 2, spec.gqa_group, *lengths, 64, dtype, device, seed=sum(lengths))
    sinks = sinks_of(q.shape[1], device, dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(2)).to(device)
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, k, v, sinks=sinks, return_lse=True)
    torch.autograd.backward([o, lse], [do, dlse])
    lists = attn.select(q.detach(), k.detach())
    ref_o, ref_lse, grads = reference_with_grads(q, k, v, sinks, spec, lists, do, dlse)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    if spec.causal and lengths[0] > lengths[1]:  # a row without keys: o = 0, lse = its sink
        assert torch.equal(o[:, :, 0], torch.zeros_like(o[:, :, 0]))
        torch.testing.assert_close(lse[0, :, 0], sinks.detach().float())
    assert_grads_close((q.grad, k.grad, v.grad), grads[:3], dtype)
    assert sinks.grad.dtype == sinks.dtype
    rel = ((sinks.grad.double() - grads[3]).norm() / grads[3].norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_without_grad_and_deterministic(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 2, 2, 128, 128, 64, torch.float32, device, seed=3)
    sinks = sinks_of(4, device)
    attn = kernelgen.get_kernel(spec)
    with torch.no_grad():
        o, lse = attn(q, k, v, sinks=sinks, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec, sinks=sinks.detach())
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    runs = []
    for _ in range(2):
        for x in (q, k, v, sinks):
            x.grad = None
        attn(q, k, v, sinks=sinks).backward(do)
        runs.append([x.grad.clone() for x in (q, k, v, sinks)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_over_a_cache_a_row_without_keys_attends_to_its_sink(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, _ = (x.detach() for x in leaves(3, 2, 2, 1, 160, 64, torch.float32, device, seed=4))
    lens = torch.tensor([160, 0, 77], dtype=torch.int32, device=device)
    sinks = sinks_of(4, device).detach()
    o, lse = kernelgen.get_kernel(spec)(q, k, v, cache_seqlens=lens, sinks=sinks, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, cache_seqlens=lens, sinks=sinks)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(lse[1, :, 0], sinks)


def test_padded_batch_keeps_its_padding_and_varlen_matches_it(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)
    q, k, v, do = leaves(2, 1, 2, 96, 96, 64, torch.float32, device, seed=5)
    sinks = sinks_of(2, device)
    lens = torch.tensor([96, 50], dtype=torch.int32, device=device)
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, k, v, seqlens=lens, sinks=sinks, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec, seqlens=lens,
                                                   sinks=sinks.detach())
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    assert torch.isinf(lse[1, :, 50:]).all() and torch.equal(o[1, :, 50:], torch.zeros_like(o[1, :, 50:]))
    o.backward(do)
    padded_grads = [x.grad.clone() for x in (q, k, v, sinks)]
    packed = [torch.cat([x[0, :, :96], x[1, :, :50]], 1).transpose(0, 1).detach().requires_grad_()
              for x in (q, k, v)]
    sinks.grad = None
    cu = torch.tensor([0, 96, 146], dtype=torch.int32, device=device)
    o_packed, lse_packed = attn.varlen(*packed, cu, sinks=sinks, return_lse=True)
    torch.testing.assert_close(o_packed, torch.cat([o[0, :, :96], o[1, :, :50]], 1).transpose(0, 1))
    torch.testing.assert_close(lse_packed, torch.cat([lse[0, :, :96], lse[1, :, :50]], 1))
    o_packed.backward(torch.cat([do[0, :, :96], do[1, :, :50]], 1).transpose(0, 1))
    torch.testing.assert_close(sinks.grad, padded_grads[3])
    torch.testing.assert_close(packed[0].grad[96:].transpose(0, 1), padded_grads[0][1, :, :50])


def test_under_compile_fullgraph(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 2, 2, 130, 130, 64, torch.float32, device, seed=6)
    sinks = sinks_of(4, device)
    attn = kernelgen.get_kernel(spec)

    def layer(q, k, v, sinks):
        return (attn(q, k, v, sinks=sinks) * do).sum()

    layer(q, k, v, sinks).backward()
    eager = [x.grad.clone() for x in (q, k, v, sinks)]
    for x in (q, k, v, sinks):
        x.grad = None
    torch.compile(layer, fullgraph=True)(q, k, v, sinks).backward()
    for a, x in zip(eager, (q, k, v, sinks)):
        torch.testing.assert_close(x.grad, a, rtol=1e-5, atol=1e-6)


def test_bad_sinks_are_named(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, gqa_group=2)
    q, k, v, _ = (x.detach() for x in leaves(1, 1, 2, 64, 64, 64, torch.float32, device, seed=7))
    attn = kernelgen.get_kernel(spec)
    cases = [([0.0, 0.0], TypeError, "sinks must be a tensor"),
             (torch.zeros(2, dtype=torch.int32, device=device), TypeError, "sinks must be float32, float16 or bf"),
             (torch.zeros(3, device=device), ValueError, r"sinks.shape = \(3,\); expected \(2,\)"),
             (torch.zeros(1, 2, device=device), ValueError, r"sinks.shape = \(1, 2\)"),
             (torch.zeros(2, device="meta"), ValueError, "sinks is on meta"),
             (torch.zeros(2, dtype=torch.float64, device=device), TypeError, "float32, float16 or bfloat16"),
             (torch.zeros(2, device=device).to_sparse(), TypeError, "dense")]
    for sinks, error, message in cases:
        with pytest.raises(error, match=message):
            attn(q, k, v, sinks=sinks)
    # refused before the cache is written
    cache_k, cache_v = torch.zeros(1, 1, 64, 64, device=device), torch.zeros(1, 1, 64, 64, device=device)
    with pytest.raises(TypeError, match="dense"):
        attn(q[:, :, :1], cache_k, cache_v, cache_seqlens=torch.tensor([10], dtype=torch.int32, device=device),
             k_new=torch.ones(1, 1, 1, 64, device=device), v_new=torch.ones(1, 1, 1, 64, device=device),
             sinks=torch.zeros(2, device=device).to_sparse())
    assert not cache_k.any() and not cache_v.any()
    # a +inf sink takes all of every row's weight: o = 0
    o, lse = attn(q, k, v, sinks=torch.tensor([0.0, float("inf")], device=device), return_lse=True)
    assert torch.equal(o[:, 1], torch.zeros_like(o[:, 1])) and torch.isposinf(lse[:, 1]).all()
    packed = [x[0].transpose(0, 1) for x in (q, k, v)]
    with pytest.raises(ValueError, match="sinks.shape"):
        attn.varlen(*packed, torch.tensor([0, 64], dtype=torch.int32, device=device), sinks=torch.zeros(5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_gpu_against_reference_and_deterministic(schedule, dtype):
    q_tile = {"q_tile": 128} if schedule == "q_centric" else {}
    spec = Spec(head_dim=128, kv_block=64, top_k=12, causal=True, gqa_group=4, local=1, schedule=schedule, **q_tile)
    q, k, v, do = leaves(1, 2, 4, 4096, 4096, 128, dtype, "cuda", seed=12)
    sinks = sinks_of(8, "cuda", dtype=torch.bfloat16)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(8)).cuda()
    attn = kernelgen.get_kernel(spec)
    runs = []
    for _ in range(2):
        for x in (q, k, v, sinks):
            x.grad = None
        o, lse = attn(q, k, v, sinks=sinks, return_lse=True)
        torch.autograd.backward([o, lse], [do, dlse])
        runs.append([x.grad.clone() for x in (q, k, v, sinks)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref_o, ref_lse, grads = reference_with_grads(q, k, v, sinks, spec, attn.select(q.detach(), k.detach()), do,
                                                 dlse)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    assert_grads_close(runs[0][:3], grads[:3], dtype)
    rel = ((runs[0][3].double() - grads[3]).norm() / grads[3].norm()).item()
    assert rel < 2e-2, rel

"""lse backpropagates: a loss that reads lse (a merge of partial attentions, an lse penalty, attention sinks) gets
dq, dk, dv of sum(o * do) + sum(lse * dlse), against float64 autograd through kernelgen.reference, on both
schedules, eagerly and through the custom op under torch.compile; a row without a visible key takes no gradient
from its (constant) lse."""
import pytest
import torch

import kernelgen
from kernelgen import Spec, reference
from kernelgen.custom_ops import sparse_attention
from test_backward import assert_grads_close, leaves


def lse_loss(o, lse, do, dlse):
    """sum(o * do) + sum(lse * dlse) over the rows with a visible key (lse = -inf elsewhere)."""
    return (o * do).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum()


def grads_with_lse(attend, q, k, v, do, dlse):
    for x in (q, k, v):
        x.grad = None
    o, lse = attend(q, k, v)
    lse_loss(o, lse, do, dlse).backward()
    return q.grad, k.grad, v.grad


def reference_grads(q, k, v, do, dlse, spec, lists):
    lists = lists.block_idx if isinstance(lists, kernelgen.BlockLists) else lists
    return reference.sparse_attention_grads(q, k, v, do, spec, lists, dlse=dlse)


SPECS = [  # causal with Nq > Nk leaves the first rows without a visible key
    (Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1), (180, 120)),
    (Spec(head_dim=64, kv_block=64, q_tile=32, top_k=2, gqa_group=4), (100, 230)),
    (Spec(head_dim=64, kv_block=32, top_k=3, causal=True, gqa_group=2, schedule="kv_centric", sink=1), (170, 130)),
    (Spec(head_dim=64, kv_block=32, top_k=2, gqa_group=1, schedule="kv_centric"), (90, 200)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec, lengths", SPECS, ids=["q-causal", "q-full", "kv-causal", "kv-full"])
def test_lse_gradient_against_reference(spec, lengths, dtype, device):
    q, k, v, do = leaves(1, 2, spec.gqa_group, *lengths, 64, dtype, device, seed=sum(lengths))
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(3)).to(device)
    attn = kernelgen.get_kernel(spec)
    grads = grads_with_lse(lambda *qkv: attn(*qkv, return_lse=True), q, k, v, do, dlse)
    want = reference_grads(q, k, v, do, dlse, spec, attn.select(q.detach(), k.detach()))
    assert_grads_close(grads, want, dtype)
    without = reference_grads(q, k, v, do, None, spec, attn.select(q.detach(), k.detach()))
    assert (want[0] - without[0]).norm() > 0.1 * without[0].norm()  # lse's term is no rounding-sized change


def test_union_design_and_prepared_lists(device):
    """Prepared per-query lists whose neighbours agree run the union design, forward and backward."""
    spec = Spec(head_dim=64, kv_block=32, top_k=3, causal=True, gqa_group=2, schedule="kv_centric")
    q, k, v, do = leaves(1, 1, 2, 160, 160, 64, torch.float32, device, seed=8)
    attn = kernelgen.get_kernel(spec)
    lists = attn.select(q.detach(), k.detach())
    lists = lists[:, :, :1].expand(-1, -1, 160, -1).contiguous()  # every query the first one's list
    prepared = attn.prepare(lists, 160, 160)
    assert prepared.union is not None
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(4)).to(device)
    grads = grads_with_lse(lambda *qkv: attn(*qkv, block_idx=prepared, return_lse=True), q, k, v, do, dlse)
    assert_grads_close(grads, reference_grads(q, k, v, do, dlse, spec, lists), torch.float32)


def test_only_lse_reaches_the_loss(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True)
    q, k, v, do = leaves(1, 1, 1, 96, 96, 64, torch.float32, device, seed=9)
    attn = kernelgen.get_kernel(spec)
    _, lse = attn(q, k, v, return_lse=True)
    lse.sum().backward()
    want = reference_grads(q, k, v, torch.zeros_like(do), torch.ones_like(lse), spec, attn.select(q.detach(),
                                                                                                k.detach()))
    assert_grads_close((q.grad, k.grad, v.grad), want, torch.float32)
    assert torch.equal(v.grad, torch.zeros_like(v.grad))  # lse does not depend on v


def test_a_row_without_keys_takes_no_gradient_from_its_lse(device):
    """Its lse is -inf whatever q and k are: a NaN or inf gradient reaching it (logsumexp's over -inf is NaN) is
    dropped, not spread over dq and dk."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True)
    q, k, v, do = leaves(1, 1, 1, 128, 64, 64, torch.float32, device, seed=10)  # rows 0..63 see no key
    o, lse = kernelgen.get_kernel(spec)(q, k, v, return_lse=True)
    assert torch.isinf(lse[..., :64]).all() and torch.isfinite(lse[..., 64:]).all()
    dlse = torch.ones_like(lse)
    dlse[..., :64] = float("nan")
    torch.autograd.backward([o, lse], [do, dlse])
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert torch.equal(q.grad[..., :64, :], torch.zeros_like(q.grad[..., :64, :]))


def test_padded_batch_and_varlen(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)
    q, k, v, do = leaves(2, 1, 2, 96, 96, 64, torch.float32, device, seed=11)
    attn = kernelgen.get_kernel(spec)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(5)).to(device)
    lens = torch.tensor([96, 50], dtype=torch.int32, device=device)
    grads = grads_with_lse(lambda *qkv: attn(*qkv, seqlens=lens, return_lse=True), q, k, v, do, dlse)
    for b, n in enumerate(lens.tolist()):  # each row the call over its own tokens
        row = [x[b:b + 1, :, :n].detach().requires_grad_() for x in (q, k, v)]
        want = reference_grads(*row, do[b:b + 1, :, :n], dlse[b:b + 1, :, :n], spec,
                               attn.select(row[0].detach(), row[1].detach()))
        got = [grads[0][b:b + 1, :, :n], grads[1][b:b + 1, :, :n], grads[2][b:b + 1, :, :n]]
        assert_grads_close(got, want, torch.float32)
    # varlen: the same rows packed; its lse is [Hq, total], as FlashAttention's
    packed = [torch.cat([x[0, :, :96], x[1, :, :50]], 1).transpose(0, 1).detach().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, 96, 146], dtype=torch.int32, device=device)
    o, lse = attn.varlen(*packed, cu, return_lse=True)
    packed_do = torch.cat([do[0, :, :96], do[1, :, :50]], 1).transpose(0, 1)
    packed_dlse = torch.cat([dlse[0, :, :96], dlse[1, :, :50]], 1)
    torch.autograd.backward([o, lse], [packed_do, packed_dlse])
    for i, (start, n) in enumerate([(0, 96), (96, 50)]):
        want = [g[i:i + 1, :, :n] for g in grads]
        got = [packed[j].grad[start:start + n].transpose(0, 1)[None] for j in range(3)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_custom_op_under_compile_fullgraph(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 2, 2, 130, 150, 64, torch.float32, device, seed=12)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(6)).to(device)

    def layer(q, k, v):
        o, lse = sparse_attention(q, k, v, spec)
        return lse_loss(o, lse, do, dlse)

    eager = grads_with_lse(lambda *qkv: kernelgen.get_kernel(spec)(*qkv, return_lse=True), q, k, v, do, dlse)
    eager = [x.clone() for x in eager]
    for x in (q, k, v):
        x.grad = None
    layer(q, k, v).backward()
    assert all(torch.equal(a, x.grad) for a, x in zip(eager, (q, k, v)))  # the op is the eager API
    for x in (q, k, v):
        x.grad = None
    torch.compile(layer, fullgraph=True)(q, k, v).backward()
    assert all(torch.equal(a, x.grad) for a, x in zip(eager, (q, k, v)))


GPU_SPECS = {
    "q_d128_gqa4_causal_8k": (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=12, causal=True, gqa_group=4,
                                   local=1), 8192),
    "q_d64_4k": (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16), 4096),
    "kv_d128_causal_4k": (Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4,
                               schedule="kv_centric"), 4096),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(GPU_SPECS))
def test_gpu_lse_gradient_against_reference_and_deterministic(case, dtype):
    spec, n = GPU_SPECS[case]
    q, k, v, do = leaves(1, 2, spec.gqa_group, n, n, spec.head_dim, dtype, "cuda", seed=len(case))
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(7)).cuda()
    attn = kernelgen.get_kernel(spec)
    grads = [g.clone() for g in grads_with_lse(lambda *qkv: attn(*qkv, return_lse=True), q, k, v, do, dlse)]
    lists = attn.select(q.detach(), k.detach())
    lists = lists.block_idx if isinstance(lists, kernelgen.BlockLists) else lists
    o = attn(q.detach(), k.detach(), v.detach(), block_idx=lists)
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=o, dlse=dlse)
    assert_grads_close(grads, want, dtype)
    again = grads_with_lse(lambda *qkv: attn(*qkv, return_lse=True), q, k, v, do, dlse)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))

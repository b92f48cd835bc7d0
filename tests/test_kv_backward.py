"""The KV-centric schedule's backward (per-query lists): dq, dk, dv against float64 autograd through
kernelgen.reference on the CPU (interpreter, fp32/fp16, small); masks (causal, ragged, given lists with
empty, repeated and out-of-range ids, an empty row, local/sink); determinism; a popular block walked in many
steps; prepared lists; the roles' configs. GPU cases are marked gpu."""
import pytest
import torch

import kernelgen
from kernelgen import KvBwdConfig, Spec, reference
from kernelgen.archs import ARCHS
from kernelgen.backends.triton import kv_bwd_default, kv_bwd_infeasible
from kernelgen.custom_ops import sparse_attention
from kernelgen.export import call_roles
from kernelgen.roles import KV_BACKWARD_ROLES, backward_roles
from test_backward import assert_grads_close, assert_tuner_checks_against_autograd, leaves


def kv_spec(**fields):
    return Spec(schedule="kv_centric", **{"head_dim": 64, "kv_block": 32, "top_k": 2, **fields})


def grads_of(spec, q, k, v, do, block_idx=None, configs=None):
    """(dq, dk, dv) of kernelgen's autograd, and the lists the forward attended over."""
    attn = kernelgen.get_kernel(spec, configs=configs)
    for x in (q, k, v):
        x.grad = None
    o = attn(q, k, v, block_idx=block_idx)
    o.backward(do)
    if block_idx is None:
        block_idx = attn.select(q.detach(), k.detach())
    elif isinstance(block_idx, kernelgen.BlockLists):
        block_idx = block_idx.block_idx
    return (q.grad.clone(), k.grad.clone(), v.grad.clone()), block_idx


def check(spec, q, k, v, do, block_idx=None, configs=None):
    grads, lists = grads_of(spec, q, k, v, do, block_idx, configs)
    want = reference.sparse_attention_grads(q, k, v, do, spec.replace(selector="given"), lists)
    assert_grads_close(grads, want, q.dtype)
    return grads, want


# causal, G, kv_block, (Nq, Nk), dtype: GQA 1/4, kv_block 32/64, ragged, Nq < = > Nk (Nq > Nk under causal
# leaves the first rows without a visible key)
GRID = [
    (True, 1, 32, (70, 100), torch.float32),
    (False, 4, 64, (45, 130), torch.float16),
    (True, 4, 32, (90, 50), torch.float32),
    (False, 1, 64, (60, 60), torch.float16),
    (True, 2, 64, (40, 97), torch.float16),
]


@pytest.mark.parametrize("causal, g, kv_block, lengths, dtype", GRID)
def test_grid_cpu(causal, g, kv_block, lengths, dtype, device):
    nq, nk = lengths
    spec = kv_spec(kv_block=kv_block, causal=causal, gqa_group=g)
    check(spec, *leaves(1, 2, g, nq, nk, 64, dtype, device, nq + nk))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_local_sink(dtype, device):
    spec = kv_spec(top_k=4, causal=True, gqa_group=2, selector="multi:2", local=2, sink=1)
    check(spec, *leaves(1, 1, 2, 80, 150, 64, dtype, device, 7))


@pytest.mark.parametrize("causal", [False, True])
def test_given_lists_empty_repeated_out_of_range_and_an_empty_row(causal, device):
    spec = kv_spec(top_k=4, causal=causal, gqa_group=2, selector="given")
    nq, nk = 60, 100  # 4 blocks
    q, k, v, do = leaves(1, 2, 2, nq, nk, 64, torch.float32, device, 13)
    gen = torch.Generator(device="cpu").manual_seed(5)
    idx = torch.randint(-2, 6, (1, 2, nq, 4), generator=gen)  # -1, -2 and ids 4, 5: empty slots
    idx[0, 0, 5] = torch.tensor([2, 2, 1, 2])  # repeats count once
    idx[0, 1, 7] = -1  # an empty row: zero gradient
    idx[0, 1, 8] = torch.tensor([3, 7, -1, 2**31 - 1])
    idx = idx.to(torch.int32).to(device)
    grads, _ = check(spec, q, k, v, do, idx)
    assert torch.equal(grads[0][0, 2:4, 7], torch.zeros_like(grads[0][0, 2:4, 7]))


def test_rows_without_a_visible_key_get_zero_gradient(device):
    spec = kv_spec(causal=True, selector="given")
    nq, nk = 90, 40  # causal, Nq > Nk: the first 50 queries see no key
    q, k, v, do = leaves(1, 1, 1, nq, nk, 64, torch.float32, device, 3)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device).expand(1, 1, nq, 2).contiguous()
    grads, _ = check(spec, q, k, v, do, idx)
    assert torch.equal(grads[0][:, :, :50], torch.zeros_like(grads[0][:, :, :50]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_deterministic_and_a_popular_block_in_many_steps(dtype, device):
    """Every query lists block 0 (a sink): its program walks 200 pairs, 16 rows (8 queries of G = 2) a step;
    16-key parts of 32-key blocks: each row's dQ merges two partials a slot."""
    spec = kv_spec(top_k=3, causal=False, gqa_group=2, sink=1)
    configs = {"kv_bwd": KvBwdConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, merge_rows=16)}
    q, k, v, do = leaves(1, 1, 2, 200, 160, 64, dtype, device, 17)
    first, lists = grads_of(spec, q, k, v, do, configs=configs)
    assert (lists[..., 0] == 0).all()
    want = reference.sparse_attention_grads(q, k, v, do, spec.replace(selector="given"), lists)
    assert_grads_close(first, want, dtype)
    second, _ = grads_of(spec, q, k, v, do, configs=configs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_prepared_lists_and_only_some_inputs_require_grad(device):
    spec = kv_spec(causal=True, gqa_group=2, selector="given")
    nq, nk = 50, 90
    q, k, v, do = leaves(1, 1, 2, nq, nk, 64, torch.float32, device, 21)
    gen = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, 3, (1, 1, nq, 2), generator=gen).to(torch.int32).to(device)
    attn = kernelgen.get_kernel(spec)
    lists = attn.prepare(idx, nq, nk)
    check(spec, q, k, v, do, lists)
    want = reference.sparse_attention_grads(q, k, v, do, spec, idx)
    k.requires_grad_(False)
    q.grad = k.grad = v.grad = None
    attn(q, k, v, block_idx=lists).backward(do)
    assert k.grad is None
    assert_grads_close((q.grad, torch.zeros_like(k), v.grad), (want[0], torch.zeros_like(want[1]), want[2]),
                       torch.float32)


def test_roles_and_configs():
    spec = kv_spec(gqa_group=4)
    assert backward_roles(spec) == KV_BACKWARD_ROLES
    assert call_roles(spec)[-2:] == KV_BACKWARD_ROLES
    assert backward_roles(spec.replace(schedule="q_centric"))[1:] == ("bwd_dq", "bwd_dkdv")
    for arch in ARCHS:
        assert kv_bwd_infeasible(spec, kv_bwd_default(spec, arch), arch) is None
    assert "block_m" in kv_bwd_infeasible(spec, KvBwdConfig(block_n=32, block_m=2), "sm_90")
    assert "block_n" in kv_bwd_infeasible(spec, KvBwdConfig(block_n=48), "sm_90")
    assert "merge_rows" in kv_bwd_infeasible(spec, KvBwdConfig(block_n=32, merge_rows=24), "sm_90")
    assert "registers" in kv_bwd_infeasible(spec.replace(head_dim=256, kv_block=128),
                                            KvBwdConfig(block_n=128, block_m=128, num_warps=4), "sm_90")
    with pytest.raises(kernelgen.KernelgenValueError):
        kernelgen.get_kernel(spec, configs={"kv_bwd": KvBwdConfig(block_n=48)})


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the wrong scale's exp overflows fp16
def test_tuner_checks_the_role_against_autograd(monkeypatch):
    """kv_bwd's tuned workload (per-query lists of the reference selector): the default passes the tuner's
    check of dq, dk and dv; a launch computing the gradients of another scale fails it."""
    assert_tuner_checks_against_autograd(kv_spec(top_k=3, causal=True, gqa_group=2), "kv_bwd", monkeypatch)


def test_custom_op_backpropagates(device):
    spec = kv_spec(causal=True, gqa_group=2, local=1)
    q, k, v, do = leaves(1, 1, 2, 40, 70, 64, torch.float32, device, 23)
    o, _ = sparse_attention(q, k, v, spec)
    o.backward(do)
    lists = kernelgen.get_kernel(spec).select(q.detach(), k.detach())
    want = reference.sparse_attention_grads(q, k, v, do, spec.replace(selector="given"), lists)
    assert_grads_close((q.grad, k.grad, v.grad), want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, g", [(True, 1), (True, 4), (False, 2)])
def test_gpu_against_reference(causal, g, dtype):
    spec = kv_spec(kv_block=64, top_k=8, causal=causal, gqa_group=g, local=1, sink=1, head_dim=128)
    check(spec, *leaves(1, 2, g, 4096, 4096, 128, dtype, "cuda", 1))


@pytest.mark.gpu
def test_gpu_deterministic():
    spec = kv_spec(kv_block=64, top_k=16, causal=True, gqa_group=4, sink=1, head_dim=128)
    q, k, v, do = leaves(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 2)
    first, _ = grads_of(spec, q, k, v, do)
    second, _ = grads_of(spec, q, k, v, do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)

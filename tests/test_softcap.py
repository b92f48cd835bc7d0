"""Logit soft-capping (`Spec.softcap`): the reference against the capped softmax, o, lse and the gradients against
float64 autograd through kernelgen.reference (plain, given and windowed lists, pinned configs, calls over a KV cache,
compiled calls), selection left as it is, and the refusals."""
import math

import pytest
import torch

import kernelgen
from kernelgen import DecodeConfig, Spec, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError
from kernelgen.spec import window_blocks
from checks import (assert_backward_is_deterministic, assert_close_to_reference, assert_compiled_step_is_eager,
                    compile_offline)
from test_backward import assert_grads_close, leaves
from test_window import CONFIGS  # the forward's two-block steps and split tiles, the backward's too and packed heads


def capped_spec(softcap=5.0, **fields) -> Spec:
    base = dict(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2)
    return Spec(**(base | fields), softcap=softcap)


def test_spec_fields_and_json():
    spec = capped_spec(50)
    assert spec.softcap == 50.0 and isinstance(spec.softcap, float)  # 50 and 50.0 are one spec
    assert spec == capped_spec(50.0) and spec.key() == capped_spec(50.0).key()
    assert Spec.from_json(spec.to_json()) == spec
    plain = Spec(head_dim=64)
    assert "softcap" not in plain.to_json()  # specs without a cap keep their JSON, keys and tuned winners
    assert spec.key() != spec.replace(softcap=None).key()


@pytest.mark.parametrize("softcap, error, message", [
    (0.0, KernelgenValueError, "expected a cap > 0"),
    (-1.0, KernelgenValueError, "expected a cap > 0"),
    (math.inf, KernelgenValueError, "expected a cap > 0"),
    (math.nan, KernelgenValueError, "expected a cap > 0"),
    (True, KernelgenTypeError, "Spec.softcap must be a float"),
    ("50", KernelgenTypeError, "Spec.softcap must be a float"),
])
def test_bad_caps_are_refused(softcap, error, message):
    with pytest.raises(error, match=message):
        capped_spec(softcap)


def test_kv_centric_and_backends_without_caps_refuse_it():
    with pytest.raises(KernelgenValueError, match="schedule='q_centric' only"):
        Spec(head_dim=64, schedule="kv_centric", softcap=30.0)
    for backend in ("tilelang", "gluon"):
        with pytest.raises(KernelgenValueError, match=f"Spec.softcap=5.0 is not built for backend='{backend}'"):
            kernelgen.get_kernel(capped_spec(backend=backend))


def test_reference_is_the_capped_softmax():
    """softcap * tanh(s / softcap) of the scaled scores, then the masked softmax (FlashAttention's softcap)."""
    spec = capped_spec(2.0, top_k=8, selector="given", gqa_group=1)
    q, k, v, _ = leaves(1, 1, 1, 70, 90, 64, torch.float64, "cpu", seed=1)
    every = torch.arange(8).expand(1, 1, spec.n_q_tiles(70), 8)
    o, lse, _ = reference.sparse_attention(q, k, v, spec, every)
    scores = 2.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(64) / 2.0)
    visible = torch.arange(90)[None, :] <= torch.arange(70)[:, None] + 20
    scores = scores.masked_fill(~visible, -torch.inf)
    torch.testing.assert_close(o, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def check_call(spec, lengths, dtype, device, block_idx=None, configs=None, hkv=1, seed=0, spread=3.0):
    """o, lse and the gradients of a call against float64 autograd; inputs scaled by `spread`, so that scores reach
    the cap."""
    q, k, v, do = leaves(1, hkv, spec.gqa_group, *lengths, spec.head_dim, dtype, device, seed=seed)
    q, k = ((x.detach() * spread).requires_grad_() for x in (q, k))
    attn = kernelgen.get_kernel(spec, configs=configs)
    o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
    o.backward(do)
    lists = attn.select(q.detach(), k.detach()) if block_idx is None else block_idx
    want_o, want_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec, lists)
    assert_close_to_reference(o, lse, want_o, want_lse, dtype)
    uncapped = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec.replace(softcap=None), lists)[0]
    assert (want_o - uncapped).norm() > 0.1 * want_o.norm()  # the cap matters at this spread
    want = reference.sparse_attention_grads(q.detach(), k.detach(), v.detach(), do, spec, lists)
    assert_grads_close((q.grad, k.grad, v.grad), want, dtype)
    return (q, k, v, do), (o, lse)


# causal or not, kv_block / q_tile both ways, D 64 and 128, G 1/2/4, Nq != Nk both ways, a sliding window
GRID = [
    dict(causal=True, lengths=(200, 200)),
    dict(causal=False, lengths=(150, 230)),
    dict(causal=True, kv_block=16, q_tile=64, top_k=6, gqa_group=4, lengths=(260, 190)),
    dict(causal=True, kv_block=64, q_tile=32, gqa_group=1, head_dim=128, lengths=(100, 300)),
    dict(causal=True, window=40, top_k=window_blocks(32, 32, 40), lengths=(200, 240)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GRID, ids=["causal", "non-causal", "g4-q64-k16", "d128-k64", "window"])
def test_against_reference(case, dtype, device):
    fields = dict(case)
    lengths = fields.pop("lengths")
    check_call(capped_spec(5.0, **fields), lengths, dtype, device, hkv=2, seed=sum(lengths))


def test_given_lists(device):
    """-1, repeats, out-of-range ids and an empty list, under a cap."""
    spec = capped_spec(3.0, selector="given")
    lists = torch.tensor([[[[0, -1, -1, -1], [0, 1, 1, 9], [-1, -1, -1, -1], [1, 2, 3, 2**40], [0, 2, 4, -3]]]])
    (q, _, _, _), (o, lse) = check_call(spec, (150, 150), torch.float32, device, block_idx=lists, seed=3)
    assert torch.isneginf(lse[:, :, 64:96]).all() and (o[:, :, 64:96] == 0).all() and (q.grad[:, :, 64:96] == 0).all()


@pytest.mark.parametrize("configs", CONFIGS, ids=["split-tiles", "packed-heads"])
def test_pinned_configs(configs, device):
    check_call(capped_spec(4.0, top_k=5, gqa_group=4), (230, 260), torch.float16, device, configs=configs, seed=7)


def test_selection_is_unchanged(device):
    """Selectors score uncapped products: a cap keeps their order, and a capped spec's lists are its uncapped twin's."""
    spec = capped_spec(1.0, top_k=3)
    q, k, _, _ = leaves(2, 2, 2, 200, 260, 64, torch.float32, device, seed=4)
    lists = kernelgen.get_kernel(spec).select(q.detach(), k.detach())
    assert torch.equal(lists, kernelgen.get_kernel(spec.replace(softcap=None)).select(q.detach(), k.detach()))


@pytest.mark.parametrize("n_q", [1, 3, 40])
def test_calls_over_a_cache(n_q, device):
    """Decode steps (split lists) and a prefill chunk over per-row lengths with left padding, and over a paged cache,
    against the reference rows."""
    spec = capped_spec(4.0, kv_block=16, top_k=5)
    configs = {"decode": DecodeConfig(splits=2, num_warps=4, num_stages=1)}
    q, k, v, _ = leaves(3, 2, 2, n_q, 160, 64, torch.float32, device, seed=n_q)
    q, k, v = (x.detach() * s for x, s in ((q, 3.0), (k, 3.0), (v, 1.0)))
    lengths = torch.tensor([160, 75, 20], dtype=torch.int32, device=device)
    firsts = torch.tensor([0, 9, 3], dtype=torch.int32, device=device)
    attn = kernelgen.get_kernel(spec, configs=configs)
    got = attn(q, k, v, cache_seqlens=lengths, cache_leftpad=firsts, return_lse=True)
    want = reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths, cache_leftpad=firsts)[:2]
    assert_close_to_reference(*got, *want, torch.float32)
    table = torch.arange(30, device=device, dtype=torch.int32).flip(0).view(3, 10)  # a block a page, reversed
    pages = [x.reshape(3, 2, 10, 16, 64).transpose(1, 2).reshape(30, 2, 16, 64).flip(0) for x in (k, v)]
    paged = attn(q, *pages, block_table=table, cache_seqlens=lengths, return_lse=True)
    assert_close_to_reference(*paged, *reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths)[:2],
                              torch.float32)


def test_compiled_forward_and_backward(device):
    q, k, v, do = leaves(1, 1, 2, 150, 150, 64, torch.float32, device, seed=4)
    assert_compiled_step_is_eager(kernelgen.get_kernel(capped_spec(5.0)), q, k, v, do)


def test_capped_kernels_compile_for_sm90():
    """The interpreter does not compile: the cap's branches of attn, bwd_dq, bwd_dkdv, decode, attn_rows and
    attn_paged build for sm_90."""
    spec = capped_spec(50.0, head_dim=128, kv_block=64, q_tile=64, top_k=8, gqa_group=4)
    cases = [{"spec": spec.to_dict(), "n": 4096, "backward": True, "rows": True, "resources": True,
              "decode": {"splits": 4, "num_warps": 4, "num_stages": 2}},
             {"spec": spec.replace(softcap=None).to_dict(), "n": 4096, "resources": True}]
    result, uncapped = compile_offline(cases, "sm_90")
    assert "error" not in result, result.get("error")
    assert {"attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv", "decode_partial", "attn_rows_fwd",
            "attn_paged_fwd"} <= {name for name, _ in result["kernels"]}

    def mufu(compiled):  # MUFU operations a step of the forward's loop issues per warp
        return next(r["loop"]["mufu"] for r in compiled["resources"] if r["name"] == "attn_fwd")

    # a score's cap is one MUFU operation on a GPU (tanh.approx.f32), the softmax's ex2 the other: twice the
    # uncapped loop's, where the interpreter's form (an ex2 and a division's rcp) would make it three times
    assert mufu(uncapped) > 0 and mufu(result) <= 2 * mufu(uncapped) + 8, (mufu(result), mufu(uncapped))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, head_dim", [(4096, 128), (8192, 256)])
def test_gpu_against_reference(n, head_dim, dtype, device):
    """Gemma 2's cap (50) at scores that reach it, and its head_dim, forward and backward, deterministic."""
    spec = capped_spec(50.0, head_dim=head_dim, kv_block=64, q_tile=64, top_k=16, gqa_group=2)
    (q, k, v, do), _ = check_call(spec, (n, n), dtype, device, hkv=2, seed=n, spread=8.0)
    attn = kernelgen.get_kernel(spec)
    assert_backward_is_deterministic(attn, q, k, v, do)

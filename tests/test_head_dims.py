"""Head dims that are no power of two (any multiple of 16 up to 256, as FlashAttention takes): the Triton kernels pad
their tiles to the next power of two and mask the rest, so every form of the call (selection, both schedules, the
backward, caches and pages, varlen, windows and softcap) matches the float64 reference as at 64 or 128; TileLang and
Gluon, whose tiles are D wide, refuse such a spec by name."""
import pytest
import torch

from kernelgen import Spec, backends, get_kernel, reference
from kernelgen.errors import KernelgenValueError
from kernelgen.spec import HEAD_DIMS

from checks import assert_close_to_reference, assert_valid_selection
from test_backward import assert_grads_close, check_against_reference, leaves
from test_cache_seqlens import _spec
from test_decode import random_lists
from test_paged_kv import _paged_cache
from test_triton_fwd import make_inputs, run_and_check


def test_every_multiple_of_16_up_to_256_is_a_head_dim():
    assert HEAD_DIMS == tuple(range(16, 257, 16))
    for d in HEAD_DIMS:
        assert Spec(head_dim=d).head_dim == d
    for d in (0, 8, 72, 100, 264, 512):
        with pytest.raises(KernelgenValueError, match=rf"Spec.head_dim={d} is not supported; expected a multiple of "
                                                      "16 from 16 to 256"):
            Spec(head_dim=d)


@pytest.mark.parametrize("name, dims", [("tilelang", "(64, 128, 256)"), ("gluon", "(64, 128)")])
def test_backends_whose_tiles_are_d_wide_refuse_other_dims(name, dims):
    why = backends.get(name).spec_unsupported(Spec(head_dim=96))
    assert why.startswith(f"Spec.head_dim=96 is not supported by backend='{name}'; expected one of {dims}")
    assert backends.get("triton").spec_unsupported(Spec(head_dim=96)) is None


@pytest.mark.parametrize("d, selector, schedule, dtype", [
    (80, "mean", "q_centric", torch.float32), (48, "multi:2", "q_centric", torch.float16),
    (96, "given", "q_centric", torch.float32), (16, "mean", "q_centric", torch.float16),
    (96, "mean", "kv_centric", torch.float16), (80, "multi:2", "kv_centric", torch.float32),
    (112, "given", "kv_centric", torch.float32)])
def test_a_padded_head_dim_is_the_reference(d, selector, schedule, dtype, device):
    """Selected lists are valid (checked against float64 scores) and o and lse are the reference's, GQA and causal,
    Nq != Nk; with given lists, -1 and out-of-range ids among them."""
    tile = {} if schedule == "kv_centric" else {"q_tile": 32}
    spec = Spec(head_dim=d, kv_block=16, top_k=4, causal=True, gqa_group=2, selector=selector, schedule=schedule,
                local=1, sink=1, **tile)
    q, k, v = make_inputs(1, 2, 2, 90, 130, d, dtype, device, seed=d)
    block_idx = random_lists(spec, 1, 2, 90, 130, seed=d).to(device) if selector == "given" else None
    run_and_check(spec, q, k, v, block_idx=block_idx)


@pytest.mark.parametrize("d, schedule, dtype", [(80, "q_centric", torch.float32), (48, "q_centric", torch.float16),
                                                (96, "kv_centric", torch.float32)])
def test_gradients_at_a_padded_head_dim(d, schedule, dtype, device):
    tile = {} if schedule == "kv_centric" else {"q_tile": 32}
    spec = Spec(head_dim=d, kv_block=32, top_k=3, causal=True, gqa_group=2, schedule=schedule, local=1, **tile)
    q, k, v, do = leaves(1, 2, 2, 100, 140, d, dtype, device, seed=d)
    grads, _ = check_against_reference(spec, q, k, v, do)
    again, _ = check_against_reference(spec, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))  # deterministic, padded or not


@pytest.mark.parametrize("schedule, n_q, page_size", [("q_centric", 1, 16), ("kv_centric", 2, 8),
                                                      ("q_centric", 40, 32), ("kv_centric", 40, 16)])
def test_a_cache_over_pages_at_a_padded_head_dim(schedule, n_q, page_size, device):
    """Decode steps and prefill chunks over shuffled pages (the pool's spare pages NaN) at D=80: the contiguous
    cache's lists, o and lse the reference's, the empty row zero; a decode step is the contiguous call bit for bit."""
    spec = _spec("mean", schedule, head_dim=80)
    attn = get_kernel(spec)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(n_q, torch.float32, device, page_size, head_dim=80)
    idx = attn.select(q, k_pages, cache_seqlens=lens, block_table=table)
    assert torch.equal(idx, attn.select(q, k, cache_seqlens=lens))
    o, lse = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages, v_pages, spec.replace(selector="given"), idx,
                                                   cache_seqlens=lens, block_table=table)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()
    if n_q <= 16:
        assert torch.equal(o, attn(q, k, v, cache_seqlens=lens))
    reps = attn.key_reps(k_pages, block_table=table, cache_seqlens=lens)
    assert torch.equal(reps.reps, attn.key_reps(k, cache_seqlens=lens).reps)


def test_new_keys_are_written_at_a_padded_head_dim(device):
    """k_new and v_new land in the pages' rows (D=48 of a 64-wide tile) and the call attends over them."""
    spec = _spec("mean", head_dim=48)
    q, k, v, lens, k_pages, v_pages, table = _paged_cache(1, torch.float32, device, 16, head_dim=48,
                                                          lengths=(60, 37, 0, 48, 1))
    gen = torch.Generator().manual_seed(5)
    k_new, v_new = (torch.randn(q.shape[0], k.shape[1], 2, 48, generator=gen).to(device) for _ in range(2))
    ref_o, ref_lse, _ = reference.sparse_attention(q, k_pages.clone(), v_pages.clone(), spec, cache_seqlens=lens,
                                                   block_table=table, k_new=k_new, v_new=v_new)
    o, lse = get_kernel(spec)(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                              return_lse=True)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    gathered = reference.gather_pages(k_pages, table)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(gathered[b, :, n:n + 2], k_new[b])


def test_varlen_at_a_padded_head_dim(device):
    """Packed sequences of 37, 64 and 5 tokens: each is the call over it alone, bit for bit."""
    spec = Spec(head_dim=80, kv_block=16, q_tile=16, top_k=3, causal=True, gqa_group=2, local=1)
    attn = get_kernel(spec)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(106, h, 80, generator=gen).to(device) for h in (4, 2, 2))
    bounds = torch.tensor([0, 37, 101, 106], dtype=torch.int32, device=device)
    o = attn.varlen(q, k, v, bounds)
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        alone = attn(*(x[start:end].transpose(0, 1)[None] for x in (q, k, v)))
        assert torch.equal(o[start:end], alone[0].transpose(0, 1))


def test_a_window_and_softcap_at_a_padded_head_dim(device):
    spec = Spec(head_dim=96, kv_block=16, q_tile=32, top_k=6, causal=True, gqa_group=2, window=40, softcap=5.0)
    q, k, v, do = leaves(1, 2, 2, 100, 100, 96, torch.float32, device, seed=1)
    o, lse = get_kernel(spec)(q, k, v, return_lse=True)
    ref_o, ref_lse, lists = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec)
    assert_close_to_reference(o.detach(), lse, ref_o, ref_lse, torch.float32)
    o.backward(do)
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists)
    assert_grads_close((q.grad, k.grad, v.grad), want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("d, schedule, dtype", [(96, "q_centric", torch.bfloat16), (80, "q_centric", torch.float16),
                                                (192, "q_centric", torch.bfloat16), (96, "kv_centric", torch.bfloat16)])
def test_a_padded_head_dim_on_gpu(d, schedule, dtype):
    """8k tokens, causal, GQA 4: o, lse and the gradients against the float64 reference over the call's lists, a
    valid top-k of the float64 scores; the backward bitwise deterministic."""
    tile = {} if schedule == "kv_centric" else {"q_tile": 64}
    spec = Spec(head_dim=d, kv_block=64, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=1, sink=1,
                **tile)
    q, k, v, do = leaves(1, 2, 4, 8192, 8192, d, dtype, "cuda", seed=d)
    attn = get_kernel(spec)
    idx = attn.select(q.detach(), k.detach())
    assert_valid_selection(idx, q.detach(), k.detach(), spec)
    o, lse = attn(q, k, v, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec.replace(selector="given"),
                                                   idx)
    assert_close_to_reference(o.detach(), lse, ref_o, ref_lse, dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    want = reference.sparse_attention_grads(q, k, v, do, spec.replace(selector="given"), idx)
    assert_grads_close(grads, want, dtype)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(attn(q, k, v), (q, k, v), do)))

"""Sliding windows (`Spec.window`): o, lse and the gradients against float64 autograd through kernelgen.reference,
the reference against a dense softmax under transformers' sliding-window mask, the kernels' skipped and masked
segments under pinned configs, and the refusals: specs that cannot hold a window, backends and call forms
without one."""
import math

import pytest
import torch

import kernelgen
from kernelgen import AttnConfig, BwdDkdvConfig, BwdDqConfig, Spec, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError
from kernelgen import backends
from kernelgen.spec import window_blocks
from checks import (TEST_ARCH, assert_backward_is_deterministic, assert_close_to_reference,
                    assert_compiled_step_is_eager, compile_offline)
from test_backward import assert_grads_close, leaves

TILELANG = backends.get("tilelang")


def window_spec(window: int, kv_block: int = 32, q_tile: int = 32, gqa_group: int = 2, head_dim: int = 64,
                **fields) -> Spec:
    """A selecting window spec: its lists are the window's blocks (top_k = n_forced)."""
    blocks = window_blocks(q_tile, kv_block, window)
    return Spec(head_dim=head_dim, kv_block=kv_block, q_tile=q_tile, causal=True, window=window, gqa_group=gqa_group,
                top_k=blocks + fields.pop("local_extra", 0), **fields)


def test_spec_fields_and_json():
    spec = window_spec(128, kv_block=64, q_tile=64)
    assert spec.window_blocks == 4 and spec.n_local == 4 and spec.n_forced == 4  # 64 + 128 - 1 keys: 4 blocks
    assert Spec.from_json(spec.to_json()) == spec
    plain = Spec(head_dim=64, causal=True)
    assert "window" not in plain.to_json()  # specs without a window keep their JSON, keys and tuned winners
    assert plain.window_blocks == 0 and plain.n_local == 1
    given = Spec(head_dim=64, causal=True, window=1000, selector="given", top_k=2)  # given lists: any top_k
    assert given.n_local == 1


@pytest.mark.parametrize("fields, message", [
    (dict(window=64), "needs causal=True"),
    (dict(window=0, causal=True, top_k=1), r"expected keys in \[1, 2\*\*31\)"),
    (dict(window=64, causal=True, schedule="kv_centric", top_k=3), "q_centric"),
    (dict(window=64, causal=True, selector="index", top_k=3), "selector='index'"),
    (dict(window=64, causal=True, sink=1, top_k=4), "sinks="),
    (dict(window=64, causal=True, top_k=16), "set top_k=3"),
])
def test_specs_that_cannot_hold_a_window_are_refused(fields, message):
    with pytest.raises(KernelgenValueError, match=message):
        Spec(head_dim=64, **fields)


@pytest.mark.parametrize("window", [True, 64.0, "64"])
def test_a_window_of_another_type_is_refused(window):
    with pytest.raises(KernelgenTypeError, match="Spec.window must be an int"):
        Spec(head_dim=64, causal=True, window=window, selector="given")


def test_reference_is_the_softmax_under_a_sliding_window_mask():
    """As transformers' sliding-window causal mask (kv_idx > q_idx - sliding_window), bottom-right aligned."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=8, causal=True, window=20, selector="given")
    q, k, v, _ = leaves(1, 1, 1, 90, 110, 64, torch.float64, "cpu", seed=1)
    every = torch.arange(8).expand(1, 1, spec.n_q_tiles(90), 8)  # 110 keys: 7 blocks, and one empty slot
    o, lse, _ = reference.sparse_attention(q, k, v, spec, every)
    i = torch.arange(90)[:, None] + 20
    j = torch.arange(110)[None, :]
    visible = (j <= i) & (j > i - 20)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(64)).masked_fill(~visible, -torch.inf)
    torch.testing.assert_close(o, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def check_call(spec, lengths, dtype, device, block_idx=None, configs=None, hkv=1, seed=0):
    q, k, v, do = leaves(1, hkv, spec.gqa_group, *lengths, spec.head_dim, dtype, device, seed=seed)
    attn = kernelgen.get_kernel(spec, configs=configs)
    o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
    o.backward(do)
    lists = attn.select(q.detach(), k.detach()) if block_idx is None else block_idx
    want_o, want_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec, lists)
    assert_close_to_reference(o, lse, want_o, want_lse, dtype)
    want = reference.sparse_attention_grads(q.detach(), k.detach(), v.detach(), do, spec, lists)
    assert_grads_close((q.grad, k.grad, v.grad), want, dtype)
    return (q, k, v, do), (o, lse)


# window, kv_block, q_tile, G, (Nq, Nk): a window inside one block, across several, not a multiple of a block,
# of three keys; q_tile != kv_block both ways; Nq < Nk and Nq > Nk (the first rows see no key)
GRID = [
    (50, 32, 32, 2, (300, 300)),
    (128, 64, 64, 1, (260, 330)),
    (20, 32, 64, 2, (200, 333)),
    (300, 64, 32, 4, (150, 400)),
    (70, 32, 32, 2, (200, 130)),
    (3, 16, 16, 1, (100, 100)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, kv_block, q_tile, g, lengths", GRID)
def test_against_reference(window, kv_block, q_tile, g, lengths, dtype, device):
    spec = window_spec(window, kv_block, q_tile, g)
    check_call(spec, lengths, dtype, device, seed=window + sum(lengths))


def test_a_window_of_one_key_is_the_query_s_own_value(device):
    """Each row sees only its diagonal key: o is that key's value, and no score has a gradient."""
    q, k, v, do = leaves(1, 1, 2, 100, 120, 64, torch.float32, device, seed=2)
    o = kernelgen.get_kernel(window_spec(1, kv_block=16, q_tile=16))(q, k, v)
    torch.testing.assert_close(o, v[:, :, 20:].repeat_interleave(2, 1), rtol=1e-6, atol=1e-6)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5
    torch.testing.assert_close(dv[:, :, 20:], do.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    assert (dv[:, :, :20] == 0).all()


def test_given_lists_are_masked_by_the_window(device):
    """Given lists hold blocks wholly before the window (they attend to nothing), cut by it, -1, repeats and
    out-of-range ids; a list wholly outside the window leaves its rows without a key (o = 0, lse = -inf, zero
    gradient)."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, window=40, gqa_group=2, selector="given")
    lists = torch.tensor([[[[0, -1, -1, -1], [0, 1, 1, 9], [0, 2, 3, -5], [1, 2, 3, 4], [0, 1, -1, -1],
                            [3, 4, 5, 2**40]]]])
    (q, k, v, do), (o, lse) = check_call(spec, (190, 190), torch.float32, device, block_idx=lists, seed=3)
    assert torch.isneginf(lse[:, :, 128:160]).all() and (o[:, :, 128:160] == 0).all()  # tile 4: blocks 0, 1 only
    assert (q.grad[:, :, 128:160] == 0).all()


CONFIGS = [  # the forward's two-block steps and split tiles, the backward's split tiles and packed heads
    {"attn": AttnConfig(block_m=16, num_warps=4, num_stages=1, kv_per_iter=2),
     "bwd_dq": BwdDqConfig(block_m=16, num_warps=4, num_stages=1),
     "bwd_dkdv": BwdDkdvConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)},
    {"attn": AttnConfig(block_m=128, num_warps=8, num_stages=2, kv_per_iter=2),
     "bwd_dq": BwdDqConfig(block_m=128, num_warps=8, num_stages=2),
     "bwd_dkdv": BwdDkdvConfig(block_n=32, block_m=128, num_warps=8, num_stages=2)},
]


@pytest.mark.parametrize("window", [45, 200])
@pytest.mark.parametrize("configs", CONFIGS, ids=["split-tiles", "packed-heads"])
def test_pinned_configs(configs, window, device):
    spec = window_spec(window, kv_block=32, q_tile=32, gqa_group=4, local_extra=0)
    check_call(spec, (230, 260), torch.float16, device, configs=configs, seed=window)


def test_larger_local_and_a_short_call(device):
    """local past the window's blocks (they attend to nothing), and a call of one query (the decode kernel)."""
    blocks = window_spec(60).window_blocks
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, causal=True, window=60, gqa_group=2, local=blocks + 2,
                top_k=blocks + 2)
    check_call(spec, (200, 200), torch.float32, device, seed=1)
    check_call(spec, (1, 300), torch.float32, device, seed=2)


def test_backward_is_deterministic(device):
    spec = window_spec(100, gqa_group=4)
    q, k, v, do = leaves(1, 2, 4, 260, 260, 64, torch.float16, device, seed=9)
    attn = kernelgen.get_kernel(spec)
    assert_backward_is_deterministic(attn, q, k, v, do)


def test_compiled_forward_and_backward(device):
    q, k, v, do = leaves(1, 1, 2, 150, 150, 64, torch.float32, device, seed=4)
    assert_compiled_step_is_eager(kernelgen.get_kernel(window_spec(50)), q, k, v, do)


@pytest.mark.parametrize("backend", ["gluon"])
def test_backends_without_windows_refuse_them(backend):
    with pytest.raises(KernelgenValueError, match=f"Spec.window=50 is not built for backend='{backend}'"):
        kernelgen.get_kernel(window_spec(50).replace(backend=backend))


def test_auto_serves_a_window_spec(device):
    spec = window_spec(50).replace(backend="auto")
    check_call(spec, (100, 100), torch.float32, device)


def cache_call(spec, n_q, dtype, device, seed, leftpad=True, batch=3, hkv=2):
    """q, k, v of a call over a cache of 300 keys a row, and its rows' lengths and first keys (a row shorter than
    the window, one whose left padding leaves it one key, one of the whole capacity)."""
    q, k, v, _ = leaves(batch, hkv, spec.gqa_group, n_q, 300, spec.head_dim, dtype, device, seed=seed)
    lengths = torch.tensor([300, 77, 190][:batch], dtype=torch.int32, device=device)
    firsts = torch.tensor([0, 40, 189][:batch], dtype=torch.int32, device=device) if leftpad else None
    return q.detach(), k.detach(), v.detach(), lengths, firsts


# queries: one (decode), four (decode, speculative), 40 (a prefill chunk: attn_rows)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q", [1, 4, 40])
@pytest.mark.parametrize("window, kv_block, q_tile, leftpad", [(50, 32, 32, True), (70, 16, 32, False),
                                                               (3, 16, 16, True), (200, 64, 32, True)])
def test_a_call_over_a_cache_is_each_row_alone(window, kv_block, q_tile, leftpad, n_q, dtype, device):
    """cache_seqlens= (and cache_leftpad=): row b is the window call over its own keys, its queries their last;
    its lists are the window's blocks over those keys, made on the device (the selector's, bit for bit)."""
    spec = window_spec(window, kv_block, q_tile, gqa_group=2)
    q, k, v, lengths, firsts = cache_call(spec, n_q, dtype, device, seed=window + n_q, leftpad=leftpad)
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, k, v, cache_seqlens=lengths, cache_leftpad=firsts, return_lse=True)
    want_o, want_lse, want_lists = reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths,
                                                              cache_leftpad=firsts)
    assert_close_to_reference(o, lse, want_o, want_lse, dtype)
    lists = attn.select(q, k, cache_seqlens=lengths, cache_leftpad=firsts)
    assert torch.equal(lists.cpu(), want_lists.to(torch.int32))


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("n_q, leftpad, paged", [(1, True, False), (5, False, True), (16, True, False)])
def test_a_decode_step_makes_its_window_lists_in_the_kernel(n_q, leftpad, paged, splits, device, monkeypatch):
    """A decode step over a cache (no backward) computes each row's window lists in the decode kernel, without the
    window_lists launch: o and lse equal, bit for bit, the same decode over the lists that launch makes."""
    spec = window_spec(40, kv_block=16, q_tile=16, gqa_group=2)
    q, k, v, lengths, firsts = cache_call(spec, n_q, torch.float16, device, seed=n_q + splits, leftpad=leftpad)
    config = {"decode": kernelgen.DecodeConfig(splits=splits, num_warps=4, num_stages=1)}
    attn = kernelgen.get_kernel(spec, configs=config)
    given = kernelgen.get_kernel(spec.replace(selector="given"), configs=config)
    lists = attn.select(q, k, cache_seqlens=lengths, cache_leftpad=firsts)
    if paged:  # one block a page, the pool's pages in reverse order
        padded = [torch.nn.functional.pad(x, (0, 0, 0, -x.shape[2] % 16)) for x in (k, v)]
        blocks = padded[0].shape[2] // 16
        k, v = (x.reshape(3, 2, blocks, 16, 64).transpose(1, 2).reshape(-1, 2, 16, 64).flip(0) for x in padded)
        table = (3 * blocks - 1 - torch.arange(3 * blocks, device=device, dtype=torch.int32)).view(3, -1)
        rows = {"block_table": table, "cache_seqlens": lengths}
    else:
        rows = {"cache_seqlens": lengths, "cache_leftpad": firsts}
    want = given(q, k, v, block_idx=lists, return_lse=True, **rows)

    def no_lists(*args, **kwargs):
        raise AssertionError("a decode step launched window_lists")

    monkeypatch.setattr(attn, "_window_lists", no_lists)
    o, lse = attn(q, k, v, return_lse=True, **rows)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    assert not torch.isnan(o).any()


@pytest.mark.parametrize("n_q", [1, 40])
@pytest.mark.parametrize("page_blocks", [1, 2])
def test_a_paged_cache_is_the_contiguous_one(n_q, page_blocks, device):
    """block_table=: the rows' pages shuffled over a pool give the contiguous cache's o and lse."""
    spec = window_spec(45, kv_block=16, q_tile=32, gqa_group=2)
    q, k, v, lengths, _ = cache_call(spec, n_q, torch.float32, device, seed=n_q, leftpad=False)
    page_size = page_blocks * spec.kv_block
    room = (0, 0, 0, -k.shape[2] % page_size)
    k, v = (torch.nn.functional.pad(x, room) for x in (k, v))
    order = torch.randperm(k.shape[0] * k.shape[2] // page_size, generator=torch.Generator().manual_seed(1))
    table = order.view(k.shape[0], -1).to(device=device, dtype=torch.int32)
    pages = [reference.scatter_pages(x, page_size, order.to(device)) for x in (k, v)]
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, *pages, block_table=table, cache_seqlens=lengths, return_lse=True)
    want_o, want_lse, _ = reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths)
    assert_close_to_reference(o, lse, want_o, want_lse, torch.float32)
    contiguous_o = attn(q, k, v, cache_seqlens=lengths)
    torch.testing.assert_close(o, contiguous_o, rtol=1e-6, atol=1e-6)


DECODE_CONFIGS = [  # splits of a decode's list, and the prefill's two-block steps and split tiles
    {"decode": kernelgen.DecodeConfig(splits=4, num_warps=4, num_stages=1),
     "attn_rows": AttnConfig(block_m=16, num_warps=4, num_stages=1, kv_per_iter=2),
     "attn_paged": AttnConfig(block_m=16, num_warps=4, num_stages=1, kv_per_iter=2)},
    {"decode": kernelgen.DecodeConfig(splits=1, num_warps=4, num_stages=1),
     "attn_rows": AttnConfig(block_m=64, num_warps=4, num_stages=1, kv_per_iter=1),
     "attn_paged": AttnConfig(block_m=64, num_warps=4, num_stages=1, kv_per_iter=1)},
]


@pytest.mark.parametrize("configs", DECODE_CONFIGS, ids=["splits", "one-split"])
@pytest.mark.parametrize("n_q", [2, 40])
def test_given_lists_over_a_cache_are_masked_by_the_window(n_q, configs, device):
    """Given lists over a cache's rows: every block of the row (those wholly before the window are skipped, those
    it cuts masked), -1, repeats and ids past a row's blocks, under pinned configs, contiguous and paged."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=24, causal=True, window=37, gqa_group=2,
                selector="given")
    q, k, v, lengths, firsts = cache_call(spec, n_q, torch.float16, device, seed=n_q)
    lists = torch.arange(24, device=device).repeat(3, 2, spec.n_q_tiles(n_q), 1)
    lists[1, :, :, 3:6] = torch.tensor([-1, 2, 300])  # a row of 37 keys: 3 blocks, then empty slots
    attn = kernelgen.get_kernel(spec, configs=configs)
    o, lse = attn(q, k, v, block_idx=lists, cache_seqlens=lengths, cache_leftpad=firsts, return_lse=True)
    want_o, want_lse, _ = reference.sparse_attention(q, k, v, spec, lists, cache_seqlens=lengths,
                                                     cache_leftpad=firsts)
    assert_close_to_reference(o, lse, want_o, want_lse, torch.float16)
    padded = [torch.nn.functional.pad(x, (0, 0, 0, 4)) for x in (k, v)]  # 19 blocks of 16 keys a row
    table = torch.arange(3 * 19, device=device, dtype=torch.int32).view(3, -1)  # one block a page, in order
    pages = [x.reshape(3, 2, 19, 16, 64).transpose(1, 2).reshape(-1, 2, 16, 64) for x in padded]
    paged = attn(q, *pages, block_idx=lists, block_table=table, cache_seqlens=lengths, return_lse=True)
    want_paged = reference.sparse_attention(q, k, v, spec, lists, cache_seqlens=lengths)[:2]
    assert_close_to_reference(*paged, *want_paged, torch.float16)


def test_new_keys_and_a_serving_step_of_mixed_query_counts(device):
    """k_new= writes each row's new keys first; varlen over the cache runs each row as its own call."""
    spec = window_spec(60, kv_block=16, q_tile=16, gqa_group=2)
    q, k, v, lengths, _ = cache_call(spec, 1, torch.float32, device, seed=5, leftpad=False)
    k_new, v_new = (torch.randn(3, 2, 1, 64, generator=torch.Generator().manual_seed(h)).to(device) for h in (1, 2))
    want = reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths, k_new=k_new, v_new=v_new)[:2]
    attn = kernelgen.get_kernel(spec)
    got = attn(q, k.clone(), v.clone(), cache_seqlens=lengths, k_new=k_new, v_new=v_new, return_lse=True)
    assert_close_to_reference(*got, *want, torch.float32)
    counts = [1, 20, 3]  # a decode row, a prefill chunk, a speculative step
    cu = torch.tensor([0, 1, 21, 24], dtype=torch.int32, device=device)
    packed = torch.randn(24, 4, 64, generator=torch.Generator().manual_seed(3)).to(device)
    got = attn.varlen(packed, k, v, cu, cache_seqlens=lengths)
    for b, (a, n) in enumerate(zip(cu.tolist(), counts)):
        alone = attn(packed[a:a + n].transpose(0, 1)[None], k[b:b + 1], v[b:b + 1], cache_seqlens=lengths[b:b + 1])
        torch.testing.assert_close(got[a:a + n], alone[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_padded_batch_is_each_row_alone(dtype, device):
    """seqlens=: each row is the window call over its own tokens (its padding o = 0, lse = -inf), gradients too."""
    q, k, v, do = leaves(3, 1, 2, 200, 200, 64, dtype, device, seed=6)
    seqlens = torch.tensor([200, 131, 17], dtype=torch.int32, device=device)
    o, lse = check_padded(window_spec(45, gqa_group=2), q, k, v, do, seqlens)
    assert (o[2, :, 17:] == 0).all() and torch.isneginf(lse[2, :, 17:]).all()


def check_padded(spec, q, k, v, do, seqlens):
    """o, lse of a padded call (seqlens=), its o, lse and gradients checked against float64 autograd."""
    o, lse = kernelgen.get_kernel(spec)(q, k, v, seqlens=seqlens, return_lse=True)
    o.backward(do)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want_o, want_lse, _ = reference.sparse_attention(*exact, spec, seqlens=seqlens)
    assert_close_to_reference(o, lse, want_o.detach(), want_lse, q.dtype)
    (want_o * do.double()).sum().backward()
    assert_grads_close((q.grad, k.grad, v.grad), [x.grad for x in exact], q.dtype)
    return o, lse


def test_packed_sequences_are_each_sequence_alone(device):
    """varlen: each packed sequence attends as the window call over it alone would."""
    spec = window_spec(30, gqa_group=2)
    bounds = [0, 70, 75, 180]
    q, k, v = (torch.randn(180, h, 64, generator=torch.Generator().manual_seed(h)).to(device)
               for h in (4, 2, 2))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    attn = kernelgen.get_kernel(spec)
    o = attn.varlen(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])))
    for a, b in zip(bounds, bounds[1:]):
        alone = attn(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)
        torch.testing.assert_close(o[a:b], alone, rtol=1e-6, atol=1e-6)


def test_window_kernels_compile_for_sm90():
    """The interpreter does not compile: the window's branches of attn, bwd_dq, bwd_dkdv, decode, attn_rows and
    attn_paged build for sm_90."""
    cases = [{"spec": window_spec(100, kv_block=64, q_tile=64, gqa_group=2).to_dict(), "n": 4096, "backward": True},
             {"spec": window_spec(128, kv_block=64, q_tile=64, gqa_group=1).to_dict(), "n": 4096,
              "attn": {"block_m": 64, "num_warps": 4, "num_stages": 2, "kv_per_iter": 2, "use_tma": False}},
             {"spec": window_spec(256, kv_block=64, q_tile=64, gqa_group=4).replace(selector="given").to_dict(),
              "n": 4096, "decode": {"splits": 4, "num_warps": 4, "num_stages": 2}, "rows": True},
             {"spec": window_spec(128, kv_block=64, q_tile=64, gqa_group=8).to_dict(), "n": 4096,
              "decode": {"splits": 2, "num_warps": 4, "num_stages": 2}}]  # its steps make their lists in the kernel
    results = compile_offline(cases, "sm_90", processes=2)
    for result in results:
        assert "error" not in result, result.get("error")
        assert "attn_fwd" in {name for name, _ in result["kernels"]}
    assert {"decode_partial", "attn_rows_fwd", "attn_paged_fwd"} <= {name for name, _ in results[2]["kernels"]}
    assert [name for name, _ in results[3]["kernels"]].count("decode_partial") == 2  # over lists, and without


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window, n", [(128, 4096), (4096, 8192)])
def test_gpu_against_reference(window, n, dtype, device):
    spec = window_spec(window, kv_block=64, q_tile=64, gqa_group=4, head_dim=128)
    check_call(spec, (n, n), dtype, device, hkv=2, seed=n)
    test_backward_is_deterministic(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window, n", [(128, 4096), (4096, 32768)])
def test_gpu_calls_over_a_cache(window, n, dtype, device):
    """Decode steps (1 and 4 queries) and a prefill chunk over a cache of per-row lengths, contiguous with left
    padding, and paged (a block a page, shuffled) against the contiguous call."""
    spec = window_spec(window, kv_block=64, q_tile=64, gqa_group=4, head_dim=128)
    attn = kernelgen.get_kernel(spec)
    _, k, v, _ = leaves(3, 2, 4, 1, n, 128, dtype, device, seed=n)
    k, v = k.detach(), v.detach()
    lengths = torch.tensor([n, n // 2 + 5, 300], dtype=torch.int32, device=device)
    firsts = torch.tensor([0, 7, 0], dtype=torch.int32, device=device)
    order = torch.randperm(3 * n // 64, generator=torch.Generator().manual_seed(0))
    table = order.view(3, -1).to(device=device, dtype=torch.int32)
    pages = [reference.scatter_pages(x, 64, order.to(device)) for x in (k, v)]
    for n_q in (1, 4, 1000):
        q = torch.randn(3, 8, n_q, 128, generator=torch.Generator().manual_seed(n_q)).to(device, dtype)
        o, lse = attn(q, k, v, cache_seqlens=lengths, cache_leftpad=firsts, return_lse=True)
        want = reference.sparse_attention(q, k, v, spec, cache_seqlens=lengths, cache_leftpad=firsts)[:2]
        assert_close_to_reference(o, lse, *want, dtype)
        paged = attn(q, *pages, block_table=table, cache_seqlens=lengths)
        torch.testing.assert_close(paged, attn(q, k, v, cache_seqlens=lengths), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("window, lengths", [(50, (300, 300)), (70, (200, 130)), (300, (150, 400)), (20, (37, 37))])
def test_calls_attend_over_the_selector_s_lists_without_selecting(window, lengths, device, monkeypatch):
    """A selecting window spec's lists are its window's blocks: the calls build them once per length, equal to the
    selector kernel's lists bit for bit (it runs with key_reps=), and never run the selector; `select` returns them
    (a copy: writing into it leaves the calls' lists as they are)."""
    spec = window_spec(window, gqa_group=2, local_extra=0)
    q, k, v, _ = leaves(2, 2, 2, *lengths, 64, torch.float32, device, seed=window)
    attn = kernelgen.get_kernel(spec)
    want = attn.select(q.detach(), k.detach(), key_reps=attn.key_reps(k.detach()))  # the selector's kernel
    torch.testing.assert_close(want, reference.select_blocks(q.detach(), k.detach(), spec), rtol=0, atol=0)
    lists = attn._window_tile_lists(lengths[0], lengths[1], q.device)
    assert torch.equal(lists.expand_as(want), want)
    selected = attn.select(q.detach(), k.detach())
    assert torch.equal(selected, want)
    selected.fill_(-1)
    assert torch.equal(attn._window_tile_lists(lengths[0], lengths[1], q.device).expand_as(want), want)

    def no_selection(*args, **kwargs):
        raise AssertionError("a window spec's call ran the selector")

    monkeypatch.setattr(attn, "_select", no_selection)
    o = attn(q, k, v)
    assert attn._window_tile_lists(lengths[0], lengths[1], q.device) is lists  # built once per length
    want_o, _, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), spec, want)
    assert ((o.double() - want_o).norm() / want_o.norm()) < 1e-5


def test_tune_plans_the_roles_a_window_spec_runs():
    """Its calls build their lists (no selector): the forward (over a cache's rows too: decode, attn_rows,
    attn_paged) and the backward are what a tune of it times."""
    from kernelgen.roles import tuned_roles

    assert tuned_roles(window_spec(128, kv_block=64, q_tile=64)) == ("attn", "attn_rows", "attn_paged", "decode",
                                                                     "bwd_dq", "bwd_dkdv")
    assert "select" in tuned_roles(Spec(head_dim=64, causal=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_padded_batch_and_packed_sequences(dtype, device):
    spec = window_spec(256, kv_block=64, q_tile=64, gqa_group=4, head_dim=128)
    q, k, v, do = leaves(3, 2, 4, 3000, 3000, 128, dtype, device, seed=1)
    check_padded(spec, q, k, v, do, torch.tensor([3000, 2111, 70], dtype=torch.int32, device=device))
    attn = kernelgen.get_kernel(spec)
    packed = [x.detach()[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    bounds = [0, 1000, 1001, 3000]
    got = attn.varlen(*packed, torch.tensor(bounds, dtype=torch.int32, device=device), 1999)
    for a, b in zip(bounds, bounds[1:]):
        alone = attn(*(x[a:b].transpose(0, 1)[None] for x in packed))[0].transpose(0, 1)
        torch.testing.assert_close(got[a:b], alone, rtol=1e-2, atol=1e-2)


def test_select_over_a_padded_batch_empties_the_padding_s_lists(device):
    spec = window_spec(50, gqa_group=2)
    q, k, _, _ = leaves(2, 1, 2, 200, 200, 64, torch.float32, device, seed=0)
    seqlens = torch.tensor([200, 70], dtype=torch.int32, device=device)
    lists = kernelgen.get_kernel(spec).select(q.detach(), k.detach(), seqlens=seqlens)
    whole = kernelgen.get_kernel(spec).select(q.detach(), k.detach())
    assert torch.equal(lists[0], whole[0]) and torch.equal(lists[1, :, :3], whole[1, :, :3])
    assert (lists[1, :, 3:] == -1).all()  # tiles from query 96 on: row 1's padding


# TileLang: the forward and dK/dV take the window (its other roles run on Triton)
TILELANG_LOOPS = {  # the forward's loops: plain (one warpgroup, a tile split where q_tile > 64; two), overlapped,
    "plain": dict(block_m=64, num_stages=1, threads=128),  # and ping-pong
    "two-warpgroups": dict(block_m=128, num_stages=2, threads=256),
    "overlap": dict(block_m=128, num_stages=2, threads=256, overlap=True),
    "pingpong": dict(block_m=128, num_stages=2, threads=256, overlap=True, pingpong=True),
}


def test_tilelang_window_kernels_lower():
    """The TileLang forward (its most involved loop: overlapped, ping-pong) and dK/dV of a window spec lower for
    sm_90a, and the window is in their code: it differs from the same spec's without one (nvcc compiles them in the
    GPU tests; tests/test_tilelang_lower.py compiles every loop)."""
    tb = pytest.importorskip("kernelgen.backends.tilelang")
    spec = window_spec(200, kv_block=64, q_tile=128, gqa_group=2, head_dim=128).replace(backend="tilelang")
    config = tb.TileLangAttnConfig(**TILELANG_LOOPS["pingpong"])
    shape = dict(batch=1, heads_kv=2, seq_q=1000, seq_k=1100)
    windowed, plain = (tb.lower(tb.build_attn(s, "bfloat16", **shape, config=config), "sm_90a",
                                tb.attn_pass_configs(config, "sm_90a")) for s in (spec, spec.replace(window=None)))
    assert "attn_fwd_kernel" in windowed and windowed != plain
    dkdv = tb.bwd_dkdv_default(spec, "sm_90")
    windowed, plain = (tb.lower(tb.build_bwd_dkdv(s, "bfloat16", **shape, config=dkdv), "sm_90a",
                                tb.bwd_dkdv_pass_configs("sm_90a")) for s in (spec, spec.replace(window=None)))
    assert "attn_bwd_dkdv_kernel" in windowed and windowed != plain


@pytest.mark.gpu
@pytest.mark.parametrize("loop, dtype", [(loop, torch.bfloat16) for loop in TILELANG_LOOPS] + [("plain", torch.float16)])
@pytest.mark.parametrize("window, kv_block, q_tile, lengths", [
    (128, 64, 64, (4096, 4096)), (4096, 128, 128, (8192, 8192)), (300, 64, 128, (2000, 2100)),
    (77, 128, 64, (1000, 900))])
def test_gpu_tilelang_against_reference(window, kv_block, q_tile, lengths, loop, dtype, device):
    """The TileLang forward (every loop) and dK/dV over a window spec's lists (ragged: Nq != Nk, partial blocks),
    against the reference; the backward bitwise deterministic."""
    pytest.importorskip("tilelang")
    tb = pytest.importorskip("kernelgen.backends.tilelang")
    spec = window_spec(window, kv_block=kv_block, q_tile=q_tile, gqa_group=4, head_dim=128).replace(backend="tilelang")
    config = tb.TileLangAttnConfig(**TILELANG_LOOPS[loop])
    if TILELANG.infeasible(spec, "attn", config, "sm_90"):
        pytest.skip(f"{loop} is infeasible for {spec}")
    (q, k, v, do), _ = check_call(spec, lengths, dtype, device, configs={"attn": config}, hkv=2, seed=window)
    attn = kernelgen.get_kernel(spec, configs={"attn": config})
    assert attn.served("attn", lengths[1], dtype, device).backend.name == "tilelang"
    assert attn.served("bwd_dkdv", lengths[1], dtype, device).backend.name == "tilelang"
    if loop == "plain":
        assert_backward_is_deterministic(attn, q.detach().requires_grad_(), k.detach().requires_grad_(),
                                         v.detach().requires_grad_(), do)

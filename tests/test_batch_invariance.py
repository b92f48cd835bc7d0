"""Batch invariance: a row's lists, outputs and gradients do not depend on the other rows of its batch, nor on the
batch's size. Row b of a call equals the same call over row b alone, bit for bit: prefill and decode, both
schedules, selected or given lists, forward and backward. Inference that must not change with what it is batched
with (a server's batches come and go) relies on it: no kernel's split, tile or config is chosen from the batch."""
import pytest
import torch

from kernelgen import Spec, get_kernel
from kernelgen.backends.triton import DecodeConfig

from test_decode import random_lists

BATCH = 2
N = 64  # 4 blocks of 16 keys, 3 listed: lists that differ between rows


def _spec(selector, schedule, **fields):
    return Spec(**{"head_dim": 64, "kv_block": 16, "q_tile": 16 if schedule == "q_centric" else 64, "top_k": 3,
                   "causal": True, "gqa_group": 2, "selector": selector, "local": 1, "sink": 1,
                   "schedule": schedule, **fields})


def _inputs(n_q, n_k, dtype, device, heads_kv=2, group=2, head_dim=64, batch=BATCH):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, h, n, head_dim, generator=gen).to(device=device, dtype=dtype)
                 for h, n in ((heads_kv * group, n_q), (heads_kv, n_k), (heads_kv, n_k), (heads_kv * group, n_q)))


def _forward_backward(attn, q, k, v, do, **call):
    """(o, lse, dq, dk, dv) of one call; no gradients for a call of a few queries against a cache (decode)."""
    leaves = [x.clone().requires_grad_(q.shape[2] == k.shape[2]) for x in (q, k, v)]
    o, lse = attn(*leaves, return_lse=True, **call)
    if not leaves[0].requires_grad:
        return o, lse
    (o * do).sum().backward()
    return (o.detach(), lse, *(x.grad for x in leaves))


def _assert_rows_alone(attn, q, k, v, do, lists=None, **call):
    """Every row of the batched call equals the call over that row alone, bit for bit: lists, o, lse, gradients."""
    batched = _forward_backward(attn, q, k, v, do, block_idx=lists, **call)
    selected = attn.select(q, k, **call) if lists is None else None
    for b in range(q.shape[0]):
        rows = [x[b:b + 1] for x in (q, k, v, do)]
        row_call = {name: value[b:b + 1] for name, value in call.items()}
        row_lists = None if lists is None else lists[b:b + 1]
        if selected is not None:
            assert torch.equal(selected[b:b + 1], attn.select(*rows[:2], **row_call)), b
        for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), batched,
                                   _forward_backward(attn, *rows, block_idx=row_lists, **row_call)):
            assert torch.equal(got[b:b + 1], want), (name, b)


@pytest.mark.parametrize("schedule, selector, dtype", [("q_centric", "mean", torch.float32),
                                                       ("q_centric", "multi:2", torch.float16),
                                                       ("q_centric", "given", torch.float32),
                                                       ("kv_centric", "mean", torch.float32),
                                                       ("kv_centric", "given", torch.float16)])
def test_a_prefill_row_is_its_own_call(schedule, selector, dtype, device):
    spec = _spec(selector, schedule)
    q, k, v, do = _inputs(N, N, dtype, device)
    lists = random_lists(spec, BATCH, 2, N, N, seed=1).to(device) if selector == "given" else None
    _assert_rows_alone(get_kernel(spec), q, k, v, do, lists)


@pytest.mark.parametrize("schedule, selector, n_q, splits, per_row", [("q_centric", "mean", 1, 4, True),
                                                                      ("q_centric", "given", 3, 2, False),
                                                                      ("kv_centric", "multi:2", 2, 4, True)])
def test_a_decode_row_is_its_own_call(schedule, selector, n_q, splits, per_row, device):
    """A few queries against a cache, with its splits merged in the last program; `per_row`: over per-row
    lengths (`cache_seqlens`). The split count comes from the config, never from the batch."""
    spec = _spec(selector, schedule)
    attn = get_kernel(spec, configs={"decode": DecodeConfig(splits=splits)})
    q, k, v, do = _inputs(n_q, N, torch.float16, device)
    lists = random_lists(spec, BATCH, 2, n_q, N, seed=2).to(device) if selector == "given" else None
    call = {"cache_seqlens": torch.tensor([N, 37], dtype=torch.int32, device=device)} if per_row else {}
    _assert_rows_alone(attn, q, k, v, do, lists, **call)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule, backend", [("q_centric", "triton"), ("q_centric", "auto"), ("kv_centric", "auto")])
def test_rows_are_their_own_calls_on_gpu(schedule, backend):
    """bf16, 4096 keys of 128-key blocks, top-16: a batch of 4 against each row alone, a prefill (forward and
    backward) and a decode call; `auto` serves whichever backend the DB or the rule names for each role."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, local=2, sink=1, schedule=schedule,
                backend=backend)
    attn = get_kernel(spec)
    q, k, v, do = _inputs(4096, 4096, torch.bfloat16, "cuda", group=4, head_dim=128, batch=4)
    _assert_rows_alone(attn, q, k, v, do)
    _assert_rows_alone(attn, q[:, :, -1:], k, v, do[:, :, -1:])

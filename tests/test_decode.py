"""The decode role (a call of at most DECODE_MAX_QUERIES queries: split-KV over each query's list) against the
float64 reference: CPU (interpreter, fp32/fp16) and GPU (bf16, a long cache)."""
import pytest
import torch

import kernelgen
from kernelgen import DecodeConfig, Spec, reference
from kernelgen.roles import DECODE_MAX_QUERIES, forward_roles
from checks import assert_close_to_reference, assert_valid_selection, default_config, feasible
from test_triton_fwd import make_inputs


def decode_spec(**fields):
    return Spec(**{"head_dim": 64, "kv_block": 32, "top_k": 4, "causal": True, "selector": "given", **fields})


def random_lists(spec, b, hkv, nq, nk, seed):
    """Lists with -1, -2, out-of-range and repeated ids, of either schedule's shape."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = spec.n_kv_blocks(nk)
    return torch.randint(-2, n_blocks + 3, (b, hkv, spec.n_q_tiles(nq), spec.top_k), generator=gen, dtype=torch.int32)


def check(spec, q, k, v, block_idx=None, configs=None):
    attn = kernelgen.get_kernel(spec, configs=configs)
    if block_idx is None:
        block_idx = attn.select(q, k)
        assert_valid_selection(block_idx, q, k, spec)
    o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=block_idx)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)
    return o


def test_few_queries_are_served_by_decode():
    spec = decode_spec()
    assert forward_roles(spec, 1)[2] == forward_roles(spec, DECODE_MAX_QUERIES)[2] == "decode"
    assert forward_roles(spec, DECODE_MAX_QUERIES + 1)[2] == "attn"
    assert forward_roles(spec.replace(schedule="kv_centric"), DECODE_MAX_QUERIES + 1)[2] == "kv_attn"
    # a pooling selector's decode call selects with decode_select (kv_decode_select for per-query lists); the
    # index selector with decode_select_index (kv_decode_select_index)
    mean = spec.replace(selector="mean")
    assert forward_roles(mean, 1)[1] == "decode_select" and forward_roles(mean, DECODE_MAX_QUERIES + 1)[1] == "select"
    per_query = mean.replace(schedule="kv_centric")
    assert forward_roles(per_query, 1)[1] == "kv_decode_select"
    assert forward_roles(per_query, DECODE_MAX_QUERIES + 1)[1] == "kv_select"
    index = spec.replace(selector="index")
    assert forward_roles(index, 1)[1] == "decode_select_index"
    assert forward_roles(index, DECODE_MAX_QUERIES + 1)[1] == "select_index"
    assert forward_roles(index.replace(schedule="kv_centric"), 1)[1] == "kv_decode_select_index"
    assert forward_roles(index, DECODE_MAX_QUERIES + 1, cache_rows=True)[1] == "decode_select_index"


# schedule, G, Nq, Nk, dtype, splits: GQA 1/2/4, Nq 1..4, both schedules' lists, one split, more splits than blocks
CASES = [
    ("q_centric", 1, 1, 300, torch.float32, 8),
    ("q_centric", 2, 2, 257, torch.float16, 2),
    ("kv_centric", 4, 3, 200, torch.float32, 1),
    ("kv_centric", 2, 4, 97, torch.float16, 32),
    ("q_centric", 4, 4, 64, torch.float16, 4),
    # Q-centric programs pack the queries of their list (16 // next_pow2(G) of them): a partial last program, a
    # causal edge inside the packed queries, and queries that see no key at all (Nk < Nq)
    ("q_centric", 2, 11, 45, torch.float32, 2),
    ("q_centric", 1, 16, 40, torch.float16, 1),
    ("q_centric", 1, 16, 10, torch.float32, 4),
]


@pytest.mark.parametrize("schedule, g, nq, nk, dtype, splits", CASES)
def test_given_lists_against_reference(schedule, g, nq, nk, dtype, splits, device):
    spec = decode_spec(gqa_group=g, schedule=schedule)
    q, k, v = make_inputs(2, 2, g, nq, nk, 64, dtype, device, nq * nk)
    idx = random_lists(spec, 2, 2, nq, nk, seed=nk).to(device)
    idx[0, 1, -1] = -1  # an empty list: o = 0, lse = -inf
    check(spec, q, k, v, idx, configs={"decode": DecodeConfig(splits=splits)})


@pytest.mark.parametrize("schedule, selector, dtype", [("q_centric", "mean", torch.float32),
                                                        ("kv_centric", "multi:2", torch.float16),
                                                        ("q_centric", "multi:4", torch.float16)])
def test_selected_lists_with_sink_and_local(schedule, selector, dtype, device):
    spec = Spec(head_dim=64, kv_block=32, top_k=4, causal=True, gqa_group=2, schedule=schedule, selector=selector,
                local=2, sink=1, q_tile=32 if schedule == "q_centric" else 64)
    q, k, v = make_inputs(1, 2, 2, 1, 400, 64, dtype, device, 17)
    check(spec, q, k, v)


def test_more_queries_than_keys_and_non_causal(device):
    """Queries that see no key (Nq > Nk, causal) get o = 0, lse = -inf; without causal masking every listed key
    is seen."""
    for causal, nq, nk in ((True, 4, 2), (False, 3, 100)):
        spec = decode_spec(causal=causal, gqa_group=2, top_k=3)
        q, k, v = make_inputs(1, 1, 2, nq, nk, 64, torch.float32, device, 5)
        check(spec, q, k, v, random_lists(spec, 1, 1, nq, nk, seed=2).to(device))


def test_backward_after_decode(device):
    """The backward of a decode call is the schedule's, over the lists the decode attended."""
    spec = decode_spec(gqa_group=2, selector="mean")
    q, k, v = make_inputs(1, 1, 2, 2, 150, 64, torch.float32, device, 3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    attn = kernelgen.get_kernel(spec)
    do = torch.randn_like(q)
    attn(q, k, v).backward(do)
    lists = attn.select(q.detach(), k.detach())
    grads = reference.sparse_attention_grads(q.detach(), k.detach(), v.detach(), do, spec.replace(selector="given"),
                                             lists)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-4


def test_config_space_and_defaults():
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=8)
    assert default_config(spec, "decode", "sm_90") == DecodeConfig(splits=8, num_warps=4, num_stages=2)
    assert default_config(spec.replace(top_k=2), "decode", "sm_90").splits == 1
    assert not feasible(spec, "decode", DecodeConfig(splits=3))
    wide = Spec(head_dim=256, kv_block=256, top_k=4, causal=True)
    assert not feasible(wide, "decode", DecodeConfig(num_warps=1))  # 16 rows x 512 fp32 on one warp
    assert feasible(wide.replace(kv_block=128), "decode", DecodeConfig(num_warps=4, num_stages=1))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_long_cache_on_gpu(schedule):
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, schedule=schedule, local=2, sink=1)
    q, k, v = make_inputs(2, 2, 4, 1, 65536, 128, torch.bfloat16, "cuda", 1)
    check(spec, q, k, v)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_the_tuner_launches_decode_on_its_one_query(schedule):
    """The tuner's decode trial: its inputs hold one query, so its launch's shapes say one query (a launch
    told the trial's sequence length read past q and wrote past o), and the default config passes the
    tuner's own check against the reference."""
    from kernelgen import backends
    from kernelgen.tuning.worker import _Inputs, check_config

    spec = decode_spec(schedule=schedule)
    inputs = _Inputs(spec, "decode", 256, "cpu")
    q = inputs.check.args[0]
    assert q.shape[2] == inputs.check_shapes.n_q == inputs.bench_shapes.n_q == 1
    assert inputs.check_shapes.n_k == inputs.check.args[1].shape[2]
    triton = backends.get("triton")
    assert check_config(triton, spec, "decode", triton.default_config(spec, "decode", "cpu"), 256, torch.float16,
                        "cpu") is None


@pytest.mark.parametrize("role, n_q", [("select", 200), ("decode_select", 9)])
def test_top_k_1_with_one_tile_a_program(role, n_q, device):
    """top_k = 1 with one Q tile per program (tiles = 1: multi:4 at G = 4 fills the 16 rows), the default of a
    decode call's selector: a running top-k one wide broke tl.topk; now the lists are a valid top-1."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=128, top_k=1, causal=True, gqa_group=4, selector="multi:4")
    dtype = torch.float16
    q, k, v = make_inputs(2, 1, 4, n_q, 39 if n_q < 16 else 300, 64, dtype, device, 7)
    attn = kernelgen.get_kernel(spec, configs={role: kernelgen.SelectConfig(tiles=1, chunk=16, splits=2)})
    lists = attn.select(q, k)
    assert lists.shape[-1] == 1
    assert_valid_selection(lists, q, k, spec)
    check(spec, q, k, v)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
@pytest.mark.parametrize("selector", ["mean", "multi:2"])
def test_a_decode_selection_is_one_launch_whatever_its_splits(schedule, selector, device):
    """A decode call's selection (decode_select, kv_decode_select for per-query lists) is one launch: its
    programs pool q themselves, each scans its split of the blocks, and the last split of a group to finish
    merges their top-k. The lists are bit-equal at any split count, with kept reps and over a cache of per-row
    lengths too, and a valid top-k under float64 scores; every arrival count is zero again after the launches
    (the next call's selection and decode count from zero)."""
    from kernelgen.backends.triton import _ARRIVALS

    spec = Spec(head_dim=64, kv_block=16, q_tile=16 if schedule == "q_centric" else 64, top_k=3, causal=True,
                gqa_group=2, selector=selector, schedule=schedule, local=1, sink=1)
    q, k, v = make_inputs(2, 2, 2, 3, 300, 64, torch.float16, device, 11)

    def selection(splits):
        if schedule == "kv_centric":
            return {"kv_decode_select": kernelgen.KvSelectConfig(queries=16, chunk=16, splits=splits)}
        return {"decode_select": kernelgen.SelectConfig(tiles=16 // (2 * spec.groups), chunk=16, splits=splits)}

    kernels = [kernelgen.get_kernel(spec, configs={**selection(n), "decode": DecodeConfig(splits=4)})
               for n in (1, 2, 8)]
    lists = [attn.select(q, k) for attn in kernels]
    assert all(torch.equal(lists[0], other) for other in lists[1:])
    assert_valid_selection(lists[0], q, k, spec)
    lens = torch.tensor([300, 77], dtype=torch.int32, device=device)
    pads = torch.tensor([5, 0], dtype=torch.int32, device=device)
    ragged = [attn.select(q, k, key_reps=attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads), cache_seqlens=lens,
                          cache_leftpad=pads) for attn in kernels]
    assert all(torch.equal(ragged[0], other) for other in ragged[1:])
    assert torch.equal(ragged[0][1:], kernels[0].select(q[1:], k[1:, :, :77]))
    o = kernels[2](q, k, v)
    assert torch.equal(o, kernels[2](q, k, v, block_idx=lists[0]))
    assert not _ARRIVALS[torch.device(device)].any()

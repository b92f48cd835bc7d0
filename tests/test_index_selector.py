"""The token-level index selector (Spec(selector="index")): its float64 reference against a brute force, the
Triton kernel's lists against the float64 scores, end to end attention, bad inputs, the custom ops, configs."""
import pytest
import torch

import kernelgen
from kernelgen import IndexSelectConfig, KernelgenTypeError, KernelgenValueError, Spec, reference
from kernelgen.custom_ops import select_blocks, sparse_attention
from kernelgen.index_fp8 import fp8_index_overlap, to_fp8_index
from kernelgen.roles import WorkloadShape, get_role, index_inputs

from checks import TEST_ARCH, assert_close_to_reference, assert_valid_selection, config_space, default_config


def make(spec, batch, heads_kv, nq, nk, device, dtype=torch.float32, index_heads=4, index_dim=64, shared=False,
         seed=0):
    """q, k, v and index=(q_idx, k_idx, w) of one call."""
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(batch, heads_kv * spec.gqa_group, nq, spec.head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, heads_kv, nk, spec.head_dim, generator=gen).to(device, dtype) for _ in range(2))
    index = index_inputs(spec, WorkloadShape(batch, heads_kv, nq, nk), device, dtype, index_heads, index_dim,
                         shared, seed)
    return q, k, v, index


def index_spec(schedule="q_centric", **fields):
    """An index spec of either schedule: q_tile 32 for Q-centric lists (per-query lists have no Q tile)."""
    fields = {"head_dim": 64, "kv_block": 32, "top_k": 2, "causal": True, **fields}
    return Spec(selector="index", schedule=schedule, q_tile=32 if schedule == "q_centric" else 64, **fields)


SCHEDULES = pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])


def brute_block_scores(q_idx, k_idx, w, spec, heads_kv):
    """Token by token, block by block: the definition in docs/SEMANTICS.md, in loops."""
    b, heads, nq, _ = q_idx.shape
    nk = k_idx.shape[2]
    hi = heads // heads_kv
    out = torch.full((b, heads_kv, spec.n_q_tiles(nq), spec.n_kv_blocks(nk)), -torch.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(heads_kv):
            kh = k_idx[bi, h if k_idx.shape[1] > 1 else 0].double()
            for i in range(nq):
                for j in range(nk):
                    if spec.causal and j > i + nk - nq:
                        continue
                    s = sum(float(w[bi, h * hi + a, i]) * max(0.0, float(q_idx[bi, h * hi + a, i].double() @ kh[j]))
                            for a in range(hi))
                    t, blk = i // spec.list_queries, j // spec.kv_block  # per-query lists: a tile of one
                    out[bi, h, t, blk] = max(out[bi, h, t, blk].item(), s)
    return out


@pytest.mark.parametrize("causal,shared,nq,nk", [(True, False, 40, 56), (False, True, 33, 20), (True, True, 50, 30)])
def test_reference_matches_brute_force(causal, shared, nq, nk):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=causal, gqa_group=2, selector="index")
    _, _, _, index = make(spec, 1, 2, nq, nk, "cpu", index_heads=2, index_dim=32, shared=shared)
    got = reference.index_block_scores(*index, spec, heads_kv=2)
    want = brute_block_scores(*index, spec, heads_kv=2)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    # a block with no visible key is exactly an ineligible one
    eligible, _ = reference.tile_eligibility(spec, nq, nk)
    assert torch.equal(torch.isfinite(got), eligible.expand_as(got))


# (causal, gqa_group, heads_kv, index_heads, index_dim, shared k_idx, nq, nk, kv_block, q_tile, top_k, local, sink)
CASES = [
    (True, 1, 2, 4, 64, False, 200, 200, 32, 32, 3, 0, 0),
    (False, 4, 1, 1, 32, False, 130, 150, 32, 32, 3, 0, 0),
    (True, 4, 2, 4, 32, True, 100, 170, 16, 32, 4, 1, 1),     # Nq < Nk, shared key head, local and sink
    (True, 1, 1, 4, 64, False, 150, 90, 32, 16, 2, 0, 0),      # Nq > Nk: the first tiles see no key
    (False, 1, 2, 1, 64, True, 77, 333, 64, 64, 5, 2, 1),      # ragged, non-causal local/sink
    (True, 2, 1, 3, 32, False, 96, 96, 16, 16, 8, 2, 0),       # Hi=3 (padded to 4), top_k >= most tiles' blocks
    (False, 1, 1, 1, 32, False, 16, 32, 16, 16, 1, 0, 0),      # top_k = 1: one block a list
    (False, 2, 1, 2, 32, False, 40, 70, 16, 32, 1, 0, 1),      # top_k = 1, the sink forced
    (True, 2, 1, 2, 32, True, 40, 70, 16, 32, 1, 0, 0),        # top_k = 1, causal: the diagonal forced
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_kernel_lists_are_a_valid_top_k(device, case):
    causal, g, hkv, hi, di, shared, nq, nk, kv_block, q_tile, top_k, local, sink = case
    spec = Spec(head_dim=64, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=g,
                selector="index", local=local, sink=sink)
    q, k, _, index = make(spec, 2 if hkv == 1 else 1, hkv, nq, nk, device, index_heads=hi, index_dim=di,
                          shared=shared)
    lists = kernelgen.get_kernel(spec).select(q, k, index=index)
    assert_valid_selection(lists, q, k, spec, index=index)


@pytest.mark.parametrize("cfg", [IndexSelectConfig(rows=16, chunk=2), IndexSelectConfig(rows=32, chunk=4, num_warps=8)])
def test_configs_choose_valid_lists(device, cfg):
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="index", local=1)
    q, k, _, index = make(spec, 1, 2, 120, 140, device, index_heads=4, index_dim=32)
    lists = kernelgen.get_kernel(spec, configs={"select_index": cfg}).select(q, k, index=index)
    assert_valid_selection(lists, q, k, spec, index=index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_matches_reference(device, dtype):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2, selector="index")
    q, k, v, index = make(spec, 1, 2, 90, 110, device, dtype, index_heads=2, index_dim=32)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, index=index, return_lse=True)
    lists = kernelgen.get_kernel(spec).select(q, k, index=index)
    assert_valid_selection(lists, q, k, spec, index=index)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=lists)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)


@SCHEDULES
def test_backward_runs_on_the_selected_lists(device, schedule):
    spec = index_spec(schedule)
    q, k, v, index = make(spec, 1, 1, 64, 96, device, index_heads=2, index_dim=32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = kernelgen.get_kernel(spec)(*leaves, index=index)
    do = torch.randn_like(o)
    o.backward(do)
    lists = kernelgen.get_kernel(spec).select(q, k, index=index)
    want = reference.sparse_attention_grads(q, k, v, do, spec.replace(selector="given"), lists)
    for got, ref in zip((x.grad for x in leaves), want):
        assert ((got.double() - ref).norm() / ref.norm()) < 1e-4


@SCHEDULES
def test_bad_index_inputs(device, schedule):
    spec = index_spec(schedule, gqa_group=2)
    q, k, v, (qi, ki, w) = make(spec, 1, 2, 64, 64, device, index_heads=2, index_dim=32)
    attn = kernelgen.get_kernel(spec)
    bad = [
        ((qi, ki), KernelgenTypeError, "got a tuple of 2"),  # a pair is a tuple too: say how many
        ([qi, ki, w, w], KernelgenTypeError, "got a list of 4"),
        ((qi.numpy() if device == "cpu" else None, ki, w), KernelgenTypeError, "q_idx must be a torch.Tensor"),
        ((qi[0], ki, w), KernelgenValueError, "q_idx must be 4-D"),
        ((qi, ki.half(), w), KernelgenTypeError, "k_idx.dtype"),
        ((qi.to(torch.int32), ki.to(torch.int32), w), KernelgenTypeError, "q_idx.dtype"),
        ((qi, ki, w.to(torch.int32)), KernelgenTypeError, "w.dtype"),
        ((qi[:, :3], ki, w[:, :3]), KernelgenValueError, "multiple of Hkv"),
        ((qi[:, :, :60], ki, w), KernelgenValueError, "Nq"),
        ((qi.transpose(1, 2), ki, w), KernelgenValueError, r"layout \[B, T, H, Di\] goes in as q_idx.transpose"),
        ((qi, ki[:, :, :50], w), KernelgenValueError, "k_idx.shape"),
        ((qi, torch.cat([ki, ki[:, :1]], 1), w), KernelgenValueError, "Hkv or 1"),  # 3 key heads for 2 KV heads
        ((qi[..., :16], ki[..., :16], w), KernelgenValueError, "Di"),
        ((qi, ki, w[:, :, :10]), KernelgenValueError, "w.shape"),
        ((qi.transpose(2, 3).contiguous().transpose(2, 3), ki, w), KernelgenValueError, "contiguous"),
    ]
    if device == "cpu":  # the interpreter computes garbage in bfloat16: the message names the argument
        bad += [((qi.bfloat16(), ki.bfloat16(), w), KernelgenTypeError, r"^index: q_idx\.dtype = torch\.bfloat16"),
                ((qi, ki, w.bfloat16()), KernelgenTypeError, r"^index: w\.dtype = torch\.bfloat16")]
    for index, error, words in bad:
        with pytest.raises(error, match=words):
            attn(q, k, v, index=index)
    with pytest.raises(KernelgenValueError, match="needs index="):
        attn(q, k, v)
    with pytest.raises(KernelgenValueError, match="needs index="):
        attn.select(q, k)
    with pytest.raises(KernelgenValueError, match="not both"):
        attn(q, k, v, index=(qi, ki, w), block_idx=attn.select(q, k, index=(qi, ki, w)))
    with pytest.raises(KernelgenValueError, match="selector='mean' takes none"):
        kernelgen.get_kernel(spec.replace(selector="mean"))(q, k, v, index=(qi, ki, w))
    # key_reps= feeds the pooling selectors: refused, not ignored, in a call, a selection and over a cache's rows
    reps = kernelgen.get_kernel(spec.replace(selector="mean")).key_reps(k)
    lens = torch.full((1,), 50, dtype=torch.int32, device=device)
    for call in (lambda: attn(q, k, v, index=(qi, ki, w), key_reps=reps),
                 lambda: attn.select(q, k, index=(qi, ki, w), key_reps=torch.zeros(3)),
                 lambda: attn(q[:, :, :1], k, v, index=(qi[:, :, :1], ki, w[:, :, :1]), key_reps=reps,
                              cache_seqlens=lens)):
        with pytest.raises(KernelgenValueError, match="key_reps= is the input of the pooling selectors"):
            call()
    with pytest.raises(KernelgenValueError, match="selector='given' takes none"):
        kernelgen.get_kernel(spec.replace(selector="given"))(q, k, v, index=(qi, ki, w))
    # given lists are still accepted by an index spec
    lists = attn.select(q, k, index=(qi, ki, w))
    assert torch.equal(attn(q, k, v, block_idx=lists), attn(q, k, v, index=(qi, ki, w)))


@SCHEDULES
def test_a_decode_step_in_deepseek_s_layouts(device, schedule):
    """One new token with DeepSeek's indexer layouts as the docs pass them: weights [B, 1, H] transposed and made
    contiguous stay [B, H, 1] with a last stride of H (torch skips size-1 dims), which the call takes; the lists
    and o are those of the same call over contiguous copies."""
    spec = index_spec(schedule, gqa_group=2)
    attn = kernelgen.get_kernel(spec)
    q, k, v, (qi, ki, w) = make(spec, 2, 1, 1, 96, device, index_heads=4, index_dim=32)
    weights = w.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # DeepSeek's [B, T=1, H] ...
    weights = weights.transpose(1, 2).contiguous()  # ... as the docs pass it
    assert weights.stride(-1) != 1
    assert torch.equal(attn.select(q, k, index=(qi, ki, weights)), attn.select(q, k, index=(qi, ki, w.clone())))
    assert torch.equal(attn(q, k, v, index=(qi, ki, weights)), attn(q, k, v, index=(qi, ki, w.clone())))


@SCHEDULES
def test_fp8_is_refused_off_hopper(device, schedule):
    if device == "cuda" and kernelgen.device.device_arch() == "sm_90":
        pytest.skip("fp8 runs here: test_fp8_overlap_gpu")
    spec = index_spec(schedule, causal=False)
    q, k, v, (qi, ki, w) = make(spec, 1, 1, 64, 64, device, index_dim=32)
    fp8 = (qi.to(torch.float8_e4m3fn), ki.to(torch.float8_e4m3fn), w)
    with pytest.raises(KernelgenTypeError, match="sm_90"):
        kernelgen.get_kernel(spec).select(q, k, index=fp8)
    with pytest.raises(KernelgenTypeError, match="sm_90"):
        fp8_index_overlap(spec, q, k, (qi, ki, w))


def test_fp8_scaling_keeps_the_block_scores_order():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, causal=True, selector="index")
    _, _, _, index = make(spec, 1, 1, 48, 48, "cpu", index_dim=32)
    q8, k8, w8 = to_fp8_index(*index)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and w8.dtype == torch.float32
    # exact in the scale: a float64 product of the dequantised fp8 vectors is a positive multiple of the original
    scores = reference.index_block_scores(*index, spec, heads_kv=1)
    scaled = reference.index_block_scores(q8.double(), k8.double(), w8, spec, heads_kv=1)
    finite = torch.isfinite(scores)
    ratio = scaled[finite] / scores[finite]
    assert torch.allclose(ratio, ratio.median().expand_as(ratio), rtol=0.1)


def test_custom_ops(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, selector="index", local=1)
    q, k, v, index = make(spec, 1, 2, 70, 90, device, index_heads=2, index_dim=32, shared=True)
    attn = kernelgen.get_kernel(spec)
    with pytest.raises(KernelgenTypeError, match="got a tuple of 2"):
        sparse_attention(q, k, v, spec, index=index[:2])
    assert torch.equal(select_blocks(q, k, spec, index=index), attn.select(q, k, index=index))
    o, lse = sparse_attention(q, k, v, spec, index=index)
    eo, else_ = attn(q, k, v, index=index, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, else_)
    torch.library.opcheck(torch.ops.kernelgen.select_blocks.default, (q, k, spec.to_json(), *index),
                          test_utils=("test_schema", "test_faketensor"))

    def layer(q, k, v, q_idx, k_idx, w):
        o, lse = sparse_attention(q, k, v, spec, index=(q_idx, k_idx, w))
        return o * 2, lse

    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    o2, lse2 = compiled(q, k, v, *index)
    assert torch.equal(o2, eo * 2) and torch.equal(lse2, else_)


def test_configs_and_workload(device):
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=8, causal=True, gqa_group=4, selector="index")
    assert spec.selection_role == "select_index" and Spec(head_dim=64).selection_role == "select"
    assert Spec(head_dim=64, selector="given").selection_role is None
    for arch in ("sm_80", "sm_89", "sm_90", TEST_ARCH):
        assert default_config(spec, "select_index", arch) in config_space(spec, "select_index", arch)
    for kv_block in (16, 256):
        assert default_config(spec.replace(kv_block=kv_block), "select_index", "sm_89") is not None
    backend = kernelgen.backends.get("triton")
    assert "registers" in backend.infeasible(spec, "select_index", IndexSelectConfig(rows=128, chunk=8), "sm_90")
    assert "rows=8" in backend.infeasible(spec, "select_index", IndexSelectConfig(rows=8), "sm_90")
    assert_workload_judges_lists(index_spec(), device, 96, 96)


def assert_workload_judges_lists(spec, device, nq, nk):
    """The tuner's workload of the spec's selection role accepts the selector's lists and refuses empty ones."""
    work = get_role(spec.selection_role).workload(spec, WorkloadShape(1, 1, nq, nk), device, torch.float32)
    lists = kernelgen.get_kernel(spec).select(torch.empty(1, 1, nq, 64, device=device),
                                             torch.empty(1, 1, nk, 64, device=device), index=work.args)
    assert work.check(lists) is None
    assert work.check(torch.full_like(lists, -1)) is not None


def test_tune_plans_the_index_selector():
    from kernelgen.tuning.plan import plan

    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=8, causal=True, selector="index")
    assert plan(spec, "select_index", seq=4096, arch="sm_90", trials=4) is not None
    with pytest.raises(KernelgenValueError, match="selection role"):
        plan(spec, "select", seq=4096, arch="sm_90", trials=4)
    with pytest.raises(KernelgenValueError, match="selection role"):
        plan(spec.replace(selector="mean"), "select_index", seq=4096, arch="sm_90", trials=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,causal,shared", [(4096, True, False), (16384, True, True), (65536, False, False)])
def test_index_selector_gpu(dtype, n, causal, shared):
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=causal, gqa_group=4, selector="index",
                local=1, sink=1)
    q, k, v, index = make(spec, 1, 2, n, n, "cuda", dtype, index_heads=4, index_dim=64, shared=shared)
    attn = kernelgen.get_kernel(spec)
    lists = attn.select(q, k, index=index)
    assert_valid_selection(lists, q, k, spec, index=index, tol=1e-2)  # bf16/fp16 index products
    if n <= 16384:
        o, lse = attn(q, k, v, index=index, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=lists)
        assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.gpu
def test_fp8_overlap_gpu():
    if kernelgen.device.device_arch() != "sm_90":
        pytest.skip("fp8 index vectors run on sm_90 only")
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="index")
    q, k, _, index = make(spec, 1, 2, 16384, 16384, "cuda", torch.bfloat16, index_heads=4, index_dim=64)
    overlap = fp8_index_overlap(spec, q, k, index)
    print(f"fp8 index selector: {overlap:.4f} of the fp32 selector's blocks")
    assert overlap > 0.9


def test_tune_runs_the_index_selector_on_cpu(tmp_path):
    """The tuner times the index selector on its synthetic index inputs (Hi=4, Di=64) and stores a winner."""
    from kernelgen.tuning.db import TuningDB
    from kernelgen.tuning.study import tune

    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2, selector="index")
    with TuningDB(tmp_path / "user.db") as db:
        result = tune(spec, "select_index", seq=128, trials=2, device="cpu", db=db, storage=tmp_path / "optuna.db")
        assert result.best_config is not None and result.n_failed == 0
        assert [row["role"] for row in db.rows()] == ["select_index"]


@pytest.mark.parametrize("nq, index_heads, rows", [(1, 16, 16), (3, 4, 16), (16, 2, 32)])
def test_a_decode_call_s_lists_are_the_same_however_its_blocks_are_split(nq, index_heads, rows, device):
    """A decode call (at most 16 queries: one Q tile) selects with decode_select_index, whose programs share the
    tile's blocks (splits, merged by merge_topk): 1, 4, 16 and 64 splits (more than the call's 26 blocks, so
    some scan none) give the same lists, bit for bit, a valid top-k of the float64 scores, with or without
    cache_seqlens."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=True, gqa_group=2, selector="index", local=1,
                sink=1)
    q, k, _, index = make(spec, 2, 2, nq, 410, device, index_heads=index_heads, index_dim=32, seed=nq)
    lens = torch.tensor([410, 150], dtype=torch.int32, device=device)
    got = {}
    for splits in (1, 4, 16, 64):
        attn = kernelgen.get_kernel(spec, configs={"decode_select_index": IndexSelectConfig(rows=rows, chunk=2,
                                                                                          splits=splits)})
        got[splits] = attn.select(q, k, index=index), attn.select(q, k, index=index, cache_seqlens=lens)
    for splits, (lists, rows_lists) in got.items():
        assert torch.equal(lists, got[1][0]) and torch.equal(rows_lists, got[1][1]), splits
    assert_valid_selection(got[1][0], q, k, spec, index=index)
    row = (index[0][1:], index[1][1:, :, :150], index[2][1:])
    assert_valid_selection(got[1][1][1:], q[1:], k[1:, :, :150], spec, index=row)

"""The index selector on the KV-centric schedule (Spec(selector="index", schedule="kv_centric"), role
kv_select_index): per-query float64 reference scores against a brute force, the Triton kernel's per-query lists
against the reference's, attention over them end to end, configs; on the GPU, long sequences, the same bits
every run, and fp8. (Bad inputs, fp8 off Hopper and the backward over the selected lists: tests/test_index_selector.py,
for either schedule.)"""
import pytest
import torch

import kernelgen
from kernelgen import KernelgenValueError, KvIndexSelectConfig, Spec, reference
from kernelgen.custom_ops import select_blocks
from kernelgen.index_fp8 import fp8_index_overlap, to_fp8_index

from checks import TEST_ARCH, assert_close_to_reference, assert_valid_selection, config_space, default_config
from test_index_selector import assert_workload_judges_lists, brute_block_scores, make
from test_kv_centric import _reference_rows


def kv_index_spec(**fields):
    return Spec(selector="index", schedule="kv_centric", **{"head_dim": 64, "kv_block": 16, "top_k": 3, **fields})


def assert_same_score_sets(got, want, scores, tol=1e-4):
    """Lists `got` and `want` choose blocks of the same float64 scores, list by list (ties may swap ids)."""
    def chosen(lists):
        idx = lists.long()
        vals = torch.where(idx >= 0, scores.gather(-1, idx.clamp(min=0)), -torch.inf)
        return vals.sort(-1, descending=True).values

    a, b = chosen(got), chosen(want)
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "the lists hold different numbers of blocks"
    scale = scores[torch.isfinite(scores)].abs().max().clamp(min=1.0)
    finite = torch.isfinite(a)
    assert ((a[finite] - b[finite]).abs() <= tol * scale).all(), "the chosen blocks' scores differ"


@pytest.mark.parametrize("causal,shared,nq,nk", [(True, False, 20, 45), (False, True, 23, 17)])
def test_reference_matches_brute_force(causal, shared, nq, nk):
    spec = kv_index_spec(causal=causal, gqa_group=2)
    _, _, _, index = make(spec, 1, 2, nq, nk, "cpu", index_heads=2, index_dim=32, shared=shared)
    got = reference.index_block_scores(*index, spec, heads_kv=2)
    want = brute_block_scores(*index, spec, heads_kv=2)
    assert got.shape == (1, 2, nq, spec.n_kv_blocks(nk))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    eligible, _ = reference.tile_eligibility(spec, nq, nk)  # per query: no visible key iff ineligible
    assert torch.equal(torch.isfinite(got), eligible.expand_as(got))


# (causal, G, Hkv, Hi, Di, shared k_idx, Nq, Nk, kv_block, top_k, local, sink, dtype)
CASES = [
    (True, 1, 2, 4, 64, False, 70, 90, 16, 3, 0, 0, torch.float32),
    (False, 4, 1, 1, 32, False, 40, 100, 32, 2, 0, 0, torch.float16),   # Hi = 1: one head per product
    (True, 2, 2, 2, 32, True, 90, 50, 16, 4, 2, 1, torch.float32),      # Nq > Nk: the first queries see nothing
    (True, 4, 1, 4, 32, True, 33, 120, 16, 5, 1, 1, torch.float16),     # Nq < Nk, shared key head, local and sink
    (False, 2, 2, 3, 64, False, 45, 77, 32, 3, 1, 1, torch.float32),    # Hi = 3 (padded to 4), non-causal forced
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_lists_match_the_reference(device, case):
    causal, g, hkv, hi, di, shared, nq, nk, kv_block, top_k, local, sink, dtype = case
    spec = kv_index_spec(kv_block=kv_block, top_k=top_k, causal=causal, gqa_group=g, local=local, sink=sink)
    q, k, _, index = make(spec, 2 if hkv == 1 else 1, hkv, nq, nk, device, dtype, index_heads=hi, index_dim=di,
                          shared=shared)
    lists = kernelgen.get_kernel(spec).select(q, k, index=index)
    assert lists.shape == (q.shape[0], hkv, nq, top_k)
    assert_valid_selection(lists, q, k, spec, index=index)
    assert_same_score_sets(lists, reference.select_blocks(q, k, spec, index), reference.block_scores(q, k, spec, index))


@pytest.mark.parametrize("cfg,scratch", [
    (KvIndexSelectConfig(queries=16, heads=1, chunk=1, span=2, rows=8, width=4), None),  # 5 spans, 3 merges a row
    (KvIndexSelectConfig(queries=32, heads=2, chunk=8, span=8, rows=16, width=16, num_warps=8), None),  # one merge
    (KvIndexSelectConfig(queries=16, heads=1, chunk=2, span=4, rows=16, width=8), 4 * 9 * 16),  # 16 queries a chunk
    # index vectors held: one per head, two heads a product (Hi = 3: the second's packed rows half empty)
    (KvIndexSelectConfig(queries=16, heads=1, chunk=1, span=2, rows=8, width=4, hold=True), None),
    (KvIndexSelectConfig(queries=32, heads=2, chunk=2, span=4, rows=16, width=16, num_stages=2, hold=True), None)])
@pytest.mark.parametrize("index_heads", [2, 3])
def test_configs_choose_the_same_lists(device, cfg, scratch, index_heads, monkeypatch):
    if scratch:  # a scratch of one 16-query chunk: the launcher walks the queries in 4 chunks
        monkeypatch.setattr(kernelgen.backends.triton, "KV_INDEX_SCORES_BYTES", scratch)
    spec = kv_index_spec(top_k=4, causal=True, local=1, sink=1)
    q, k, _, index = make(spec, 1, 1, 50, 140, device, index_heads=index_heads, index_dim=32)
    lists = kernelgen.get_kernel(spec, configs={"kv_select_index": cfg}).select(q, k, index=index)
    assert_same_score_sets(lists, reference.select_blocks(q, k, spec, index), reference.block_scores(q, k, spec, index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_over_the_selection(device, dtype):
    spec = kv_index_spec(kv_block=32, top_k=2, causal=True, gqa_group=2, local=1)
    q, k, v, index = make(spec, 1, 2, 60, 90, device, dtype, index_heads=2, index_dim=32)
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, k, v, index=index, return_lse=True)
    lists = attn.select(q, k, index=index)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=lists)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    # the custom op selects the same lists
    assert torch.equal(select_blocks(q, k, spec, index=index), lists)


def test_configs_and_workload(device):
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, selector="index", schedule="kv_centric")
    assert spec.selection_role == "kv_select_index"
    assert spec.replace(selector="mean").selection_role == "kv_select"
    for kv_block, top_k in ((64, 16), (16, 4), (128, 64), (256, 256)):
        s = spec.replace(kv_block=kv_block, top_k=top_k)
        for arch in ("sm_80", "sm_89", "sm_90", TEST_ARCH):
            assert default_config(s, "kv_select_index", arch) in config_space(s, "kv_select_index", arch)
    backend = kernelgen.backends.get("triton")
    assert "registers" in backend.infeasible(spec, "kv_select_index", KvIndexSelectConfig(queries=128, chunk=4), "sm_90")
    assert "queries=8" in backend.infeasible(spec, "kv_select_index", KvIndexSelectConfig(queries=8), "sm_90")
    assert "span=3" in backend.infeasible(spec, "kv_select_index", KvIndexSelectConfig(chunk=2, span=3), "sm_90")
    assert "width=48" in backend.infeasible(spec, "kv_select_index", KvIndexSelectConfig(width=48), "sm_90")
    assert_workload_judges_lists(kv_index_spec(kv_block=32, top_k=2, causal=True), device, 48, 80)


def test_tune_plans_it():
    from kernelgen.tuning.plan import plan

    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, selector="index", schedule="kv_centric")
    assert plan(spec, "kv_select_index", seq=4096, arch="sm_90", trials=4) is not None
    for role, other in (("kv_select", spec), ("select_index", spec), ("kv_select_index", spec.replace(selector="mean"))):
        with pytest.raises(KernelgenValueError, match="selection role"):
            plan(other, role, seq=4096, arch="sm_90", trials=4)


def test_an_exported_module_selects_as_get_kernel(tmp_path, device):
    import importlib.util

    from kernelgen.export import call_roles, export_module

    spec = kv_index_spec(kv_block=32, top_k=2, causal=True)
    assert "kv_select_index" in call_roles(spec)
    path = export_module(spec, tmp_path / "kv_index_mod.py", arch="cpu" if device == "cpu" else None)
    loader = importlib.util.spec_from_file_location("kv_index_mod", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    q, k, v, index = make(spec, 1, 1, 40, 60, device, index_heads=2, index_dim=32)
    assert torch.equal(module.select(q, k, index=index), kernelgen.get_kernel(spec).select(q, k, index=index))


# ---- GPU: long sequences, bf16/fp16, the same bits every run, fp8 -------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,causal,shared", [(4096, True, False), (16384, True, True), (65536, False, False)])
@pytest.mark.parametrize("hold", [False, True])
def test_kv_index_selector_gpu(dtype, n, causal, shared, hold):
    g = 4
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=causal, gqa_group=g, selector="index",
                schedule="kv_centric", local=1, sink=1)
    q, k, v, index = make(spec, 1, 2, n, n, "cuda", dtype, index_heads=4, index_dim=64, shared=shared)
    attn = kernelgen.get_kernel(spec, configs={"kv_select_index": KvIndexSelectConfig(hold=hold)})
    lists = attn.select(q, k, index=index)
    assert torch.equal(attn.select(q, k, index=index), lists)  # deterministic
    assert_valid_selection(lists, q, k, spec, index=index, tol=1e-2)  # bf16/fp16 index products
    o, lse = attn(q, k, v, index=index, return_lse=True)
    o2, lse2 = attn(q, k, v, index=index, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    rows = slice(n - 2048, n)  # the last queries (the longest lists) of the first KV head's query heads
    ref_o, ref_lse = _reference_rows(q, k, v, lists, spec, rows, g)
    assert_close_to_reference(o[:, :g, rows], lse[:, :g, rows], ref_o, ref_lse, dtype)


@pytest.mark.gpu
def test_kv_index_fp8_gpu():
    if kernelgen.device.device_arch() != "sm_90":
        pytest.skip("fp8 index vectors run on sm_90 only")
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, selector="index", schedule="kv_centric")
    q, k, _, index = make(spec, 1, 2, 16384, 16384, "cuda", torch.bfloat16, index_heads=4, index_dim=64)
    attn = kernelgen.get_kernel(spec)
    fp8 = to_fp8_index(*index)
    lists = attn.select(q, k, index=fp8)
    assert torch.equal(attn.select(q, k, index=fp8), lists)
    # exact products of e4m3 values, fp32 sums: a valid top-k under the float64 scores of the fp8 values themselves
    assert_valid_selection(lists, q, k, spec, index=tuple(x.double() for x in fp8))
    overlap = fp8_index_overlap(spec, q, k, index)  # against the fp32 selector's lists
    print(f"kv-centric fp8 index selector: {overlap:.4f} of the fp32 selector's blocks")
    assert overlap > 0.8

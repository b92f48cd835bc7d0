"""The KV-centric schedule's union design (`kv_attn_union`): a tile of consecutive queries over the union of
their per-query lists, each row masked to its own query's list. Against the float64 reference on the CPU
(interpreter, fp32/fp16): the grid of masks, given lists with empty, repeated and out-of-range ids and an
empty row, gradients through it; the tile union itself against sets; which design `prepare` serves. GPU
cases are marked gpu."""
import dataclasses

import pytest
import torch

import kernelgen
from kernelgen import KvAttnConfig, KvUnionBwdConfig, KvUnionConfig, Spec, reference
from kernelgen.backends.triton import (kv_union_bwd_default, kv_union_bwd_infeasible, kv_union_default,
                                       kv_union_infeasible, kv_union_space)
from kernelgen.archs import arch_facts
from kernelgen.errors import KernelgenValueError
from kernelgen.tile_union import build_tile_union, union_for, union_max_inflation
from kernelgen.workloads import agreeing_query_lists, random_query_lists
from checks import TEST_ARCH, assert_close_to_reference
from test_backward import assert_grads_close, leaves
from test_triton_fwd import make_inputs


def kv_spec(**fields):
    return Spec(schedule="kv_centric", **{"head_dim": 64, "kv_block": 32, "top_k": 3, "selector": "given", **fields})


def union_config(tile_q, block_m=16, num_warps=4, num_stages=1, use_tma=False):
    return {"kv_attn_union": KvUnionConfig(tile_q=tile_q, block_m=block_m, num_warps=num_warps, num_stages=num_stages,
                                           use_tma=use_tma)}


def skip_without_tma(use_tma):
    if use_tma and not arch_facts(TEST_ARCH).tma:
        pytest.skip(f"use_tma needs TMA, which {TEST_ARCH} lacks")


def attend_union(spec, q, k, v, idx, configs):
    """o, lse over `idx` through the union design (pinned: prepare serves it whatever the lists)."""
    attn = kernelgen.get_kernel(spec, configs=configs)
    lists = attn.prepare(idx, q.shape[2], k.shape[2])
    assert lists.union is not None and lists.union.tile_q == configs["kv_attn_union"].tile_q
    return attn(q, k, v, block_idx=lists, return_lse=True)


def check_union(spec, q, k, v, idx, configs):
    o, lse = attend_union(spec, q, k, v, idx, configs)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)
    return o, lse


# causal, G, D, kv_block, (Nq, Nk), tile_q, block_m, use_tma: GQA 1/2/4, D 64/128, kv_block 32/64, Nq <, =, > Nk,
# ragged ends (zero-filled by the copy engine where use_tma), a program holding part of a tile (block_m < tile_q),
# one tile's heads split over programs, whole tiles
CASES = [
    (False, 1, 64, 32, (70, 100), 16, 16, True),
    (True, 2, 64, 64, (100, 100), 8, 16, False),
    (True, 4, 128, 32, (90, 50), 4, 16, True),
    (False, 2, 128, 64, (45, 130), 32, 16, False),
    (True, 1, 64, 32, (40, 97), 64, 32, False),
    (True, 4, 64, 32, (77, 160), 8, 32, True),
]


@pytest.mark.parametrize("causal, g, d, kv_block, lengths, tile_q, block_m, use_tma", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_against_reference(causal, g, d, kv_block, lengths, tile_q, block_m, use_tma, dtype, device):
    skip_without_tma(use_tma)
    nq, nk = lengths
    spec = kv_spec(head_dim=d, kv_block=kv_block, causal=causal, gqa_group=g)
    q, k, v = make_inputs(1, 2, g, nq, nk, d, dtype, device, nq + nk)
    idx = reference.select_blocks(q.float(), k.float(), spec.replace(selector="mean"))
    check_union(spec, q, k, v, idx, union_config(tile_q, block_m, use_tma=use_tma))


def test_given_lists_empty_repeated_out_of_range_and_an_empty_row(device):
    spec = kv_spec(top_k=4, causal=True, gqa_group=2)
    nq, nk = 60, 100  # 4 blocks
    q, k, v = make_inputs(1, 2, 2, nq, nk, 64, torch.float32, device, 13)
    gen = torch.Generator(device="cpu").manual_seed(5)
    idx = torch.randint(-2, 6, (1, 2, nq, 4), generator=gen, dtype=torch.int32)  # -1, -2, 4, 5: empty slots
    idx[0, 0, 5] = torch.tensor([2, 2, 1, 2])  # repeats count once
    idx[0, 1, 7] = -1  # an empty row: o = 0, lse = -inf
    idx[0, 1, 8] = torch.tensor([3, 7, -1, 2**31 - 1])
    o, lse = check_union(spec, q, k, v, idx.to(device), union_config(8))
    assert (o[0, 2:4, 7] == 0).all() and torch.isinf(lse[0, 2:4, 7]).all()


def test_causal_rows_that_see_nothing(device):
    """Nq > Nk: the first Nq - Nk queries see no key, whatever their tile's union holds."""
    spec = kv_spec(top_k=2, causal=True)
    q, k, v = make_inputs(1, 1, 1, 70, 40, 64, torch.float32, device, 17)
    idx = reference.select_blocks(q, k, spec.replace(selector="mean"))
    o, lse = check_union(spec, q, k, v, idx, union_config(16))
    assert (o[:, :, :30] == 0).all() and torch.isinf(lse[:, :, :30]).all()


def union_grads(spec, q, k, v, do, idx, configs):
    attn = kernelgen.get_kernel(spec, configs=configs)
    lists = attn.prepare(idx, q.shape[2], k.shape[2])
    assert lists.union is not None
    for x in (q, k, v):
        x.grad = None
    attn(q, k, v, block_idx=lists).backward(do)
    return q.grad.clone(), k.grad.clone(), v.grad.clone()


def bwd_config(tile_q, block_m=16, dq_block_m=16, block_n=16, use_tma=False):
    """The union design's forward and backward; use_tma: every kernel's loads through tensor descriptors."""
    return {**union_config(tile_q, use_tma=use_tma),
            "kv_bwd_union": KvUnionBwdConfig(tile_q=tile_q, dq_block_m=dq_block_m, dq_warps=4, dq_stages=1,
                                             dq_use_tma=use_tma, block_n=block_n, block_m=block_m, num_warps=4,
                                             num_stages=1, use_tma=use_tma)}


# causal, G, kv_block, (Nq, Nk), dtype, tile_q, dK/dV rows, use_tma: the forward's grid of masks; the dK/dV's
# Q and dO through tensor descriptors in boxes of heads x queries (4 x 4, 2 x 8) and of part of a tile (1 x 16)
GRAD_CASES = [
    (True, 1, 32, (70, 100), torch.float32, 16, 16, True),
    (False, 4, 64, (45, 130), torch.float16, 4, 16, True),
    (True, 4, 32, (90, 50), torch.float32, 8, 32, False),
    (False, 2, 32, (60, 60), torch.float16, 16, 32, False),
    (True, 2, 64, (40, 97), torch.float16, 8, 16, True),
]


@pytest.mark.parametrize("causal, g, kv_block, lengths, dtype, tile_q, block_m, use_tma", GRAD_CASES)
def test_gradients_of_the_union_design(causal, g, kv_block, lengths, dtype, tile_q, block_m, use_tma, device):
    """The union design's backward (kv_bwd_union) against float64 autograd, two runs bitwise equal."""
    skip_without_tma(use_tma)
    nq, nk = lengths
    spec = kv_spec(kv_block=kv_block, causal=causal, gqa_group=g, top_k=2)
    q, k, v, do = leaves(1, 2, g, nq, nk, 64, dtype, device, nq + nk)
    idx = reference.select_blocks(q.detach().float(), k.detach().float(), spec.replace(selector="mean"))
    configs = bwd_config(tile_q, block_m, block_n=min(32, kv_block), use_tma=use_tma)
    grads = union_grads(spec, q, k, v, do, idx, configs)
    assert_grads_close(grads, reference.sparse_attention_grads(q, k, v, do, spec, idx), dtype)
    assert all(torch.equal(a, b) for a, b in zip(grads, union_grads(spec, q, k, v, do, idx, configs)))


def test_gradients_over_given_lists_with_empty_repeated_out_of_range_ids_and_an_empty_row(device):
    spec = kv_spec(top_k=4, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 2, 2, 60, 100, 64, torch.float32, device, 7)
    gen = torch.Generator(device="cpu").manual_seed(5)
    idx = torch.randint(-2, 6, (1, 2, 60, 4), generator=gen, dtype=torch.int32)
    idx[0, 0, 5] = torch.tensor([2, 2, 1, 2])
    idx[0, 1, 7] = -1
    idx = idx.to(device)
    grads = union_grads(spec, q, k, v, do, idx, bwd_config(8))
    assert_grads_close(grads, reference.sparse_attention_grads(q, k, v, do, spec, idx), q.dtype)
    assert (grads[0][0, 2:4, 7] == 0).all()  # the empty row: no gradient, never NaN


def test_deterministic(device):
    spec = kv_spec(top_k=3, causal=True, gqa_group=2, kv_block=64)
    q, k, v = make_inputs(1, 1, 2, 90, 200, 64, torch.float16, device, 19)
    idx = reference.select_blocks(q.float(), k.float(), spec.replace(selector="mean"))
    first = attend_union(spec, q, k, v, idx, union_config(8))
    second = attend_union(spec, q, k, v, idx, union_config(8))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---- the tile union ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile_q, n_blocks, top_k", [(4, 10, 3), (8, 80, 6), (16, 200, 5), (3, 7, 4)])
def test_the_tile_union_and_membership_bits_against_sets(tile_q, n_blocks, top_k):
    """Every tile's union is the set of its queries' valid ids, ascending then -1; a query's bit at slot s is
    set exactly where its list holds the union's block s (unions longer than 32 blocks take several words,
    bit 31 included)."""
    gen = torch.Generator().manual_seed(tile_q * n_blocks)
    nq = 5 * tile_q + 1  # a partial last tile
    idx = torch.randint(-1, n_blocks + 2, (2, 1, nq, top_k), generator=gen, dtype=torch.int32)
    idx = reference.normalize_block_idx(idx, n_blocks)
    union = build_tile_union(idx, tile_q, n_blocks)
    length = min(tile_q * top_k, n_blocks)
    assert union.lists.shape == (2, 1, 6, length) and union.member.shape == (2, 1, nq, -(-length // 32))
    assert union.lists.dtype == union.member.dtype == torch.int32
    for b in range(2):
        for tile in range(6):
            rows = idx[b, 0, tile * tile_q:(tile + 1) * tile_q]
            want = sorted({int(i) for i in rows.flatten() if i >= 0})
            got = union.lists[b, 0, tile].tolist()
            assert got == want + [-1] * (length - len(want))
            for query in range(tile * tile_q, min(nq, (tile + 1) * tile_q)):
                words = union.member[b, 0, query].tolist()
                bits = {s for s in range(length) if (words[s // 32] >> (s % 32)) & 1}
                assert {got[s] for s in bits} == {int(i) for i in idx[b, 0, query] if i >= 0}
    held = int((idx >= 0).sum())
    computed = sum(int((union.lists[b, 0, t] >= 0).sum()) * min(tile_q, nq - t * tile_q)
                   for b in range(2) for t in range(6))
    assert union.inflation(idx) == pytest.approx(computed / held)


# ---- which design prepare serves -----------------------------------------------------------------------

def test_prepare_serves_the_union_design_to_agreeing_lists_only(device):
    spec = kv_spec(top_k=4, kv_block=16, gqa_group=2)
    nq = 256  # 16 blocks
    agreeing = agreeing_query_lists(spec, 1, 1, nq, nq, own=0, device="cpu").to(device)
    random = random_query_lists(spec, 1, 1, nq, nq, device="cpu").to(device)
    attn = kernelgen.get_kernel(spec, configs=union_config(8))
    agree = kernelgen.get_kernel(spec).prepare(agreeing, nq, nq)
    assert agree.union is not None and agree.union.inflation(agree.block_idx) <= union_max_inflation(16)
    scattered = kernelgen.get_kernel(spec).prepare(random, nq, nq)
    assert scattered.union is None  # eight queries' random picks cover most of the 16 blocks: inflation 3.6 > 2.4
    assert "union of 8 queries" in repr(attn.prepare(random, nq, nq))  # a pinned union config serves it anyway
    gathered = kernelgen.get_kernel(spec, configs={"kv_attn": KvAttnConfig(block_m=16)})
    assert gathered.prepare(agreeing, nq, nq).union is None  # a pinned gathered config keeps the gathered design
    q, k, v = make_inputs(1, 1, 2, nq, nq, 64, torch.float32, device, 29)
    for lists, raw in ((agree, agreeing), (scattered, random)):
        o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=lists, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=raw)
        assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


def test_the_backward_runs_the_union_design_only_where_lists_agree_closely(device, monkeypatch):
    """Prepared lists whose forward ran the union design: the union backward at inflation <= 1.7 (64-key blocks
    or fewer; these lists: 1.0 and 2.9), the gathered one (kv_bwd, over the same o and lse) above; a pinned
    backward config decides alone."""
    from kernelgen.backends.triton import TritonBackend

    spec = kv_spec(top_k=4, kv_block=16, gqa_group=2)
    nq = 256
    close = agreeing_query_lists(spec, 1, 1, nq, nq, own=0, device="cpu").to(device)
    loose = agreeing_query_lists(spec, 1, 1, nq, nq, own=2, device="cpu").to(device)
    ran = []
    for role in ("kv_bwd", "kv_bwd_union"):
        impl = TritonBackend.roles[role]
        monkeypatch.setitem(TritonBackend.roles, role, dataclasses.replace(
            impl, launch=lambda *a, role=role, launch=impl.launch: ran.append(role) or launch(*a)))
    q, k, v, do = leaves(1, 1, 2, nq, nq, 64, torch.float32, device, 31)
    forward = union_config(8)  # the union forward whatever the inflation; the backward unpinned
    for lists, configs, want in ((close, forward, "kv_bwd_union"), (loose, forward, "kv_bwd"),
                                 (loose, bwd_config(8), "kv_bwd_union")):
        attn = kernelgen.get_kernel(spec, configs=configs)
        prepared = attn.prepare(lists, nq, nq)
        assert prepared.union is not None, prepared.union
        ran.clear()
        attn(q, k, v, block_idx=prepared).backward(do)
        assert ran == [want], (prepared.union.inflation(prepared.block_idx), ran)


def test_a_pinned_union_backward_serves_prepared_lists_of_the_gathered_forward(device, monkeypatch):
    """Prepared lists too loose for the union forward (no kv_attn_union pinned) under a pinned kv_bwd_union: the
    backward runs the pinned design, as it does for raw lists, against the float64 reference."""
    from kernelgen.backends.triton import TritonBackend

    ran = []
    for role in ("kv_attn", "kv_attn_union", "kv_bwd", "kv_bwd_union"):
        impl = TritonBackend.roles[role]
        monkeypatch.setitem(TritonBackend.roles, role, dataclasses.replace(
            impl, launch=lambda *a, role=role, launch=impl.launch: ran.append(role) or launch(*a)))
    spec = kv_spec(top_k=4, kv_block=16, gqa_group=2)
    nq = 200
    loose = random_query_lists(spec, 1, 1, nq, nq, device="cpu").to(device)
    attn = kernelgen.get_kernel(spec, configs={"kv_bwd_union": bwd_config(8)["kv_bwd_union"]})
    prepared = attn.prepare(loose, nq, nq)
    assert prepared.union is None
    q, k, v, do = leaves(1, 1, 2, nq, nq, 64, torch.float32, device, 41)
    attn(q, k, v, block_idx=prepared).backward(do)
    assert ran == ["kv_attn", "kv_bwd_union"], ran
    assert_grads_close((q.grad, k.grad, v.grad), reference.sparse_attention_grads(q, k, v, do, spec, loose), q.dtype)


def test_a_pinned_union_config_serves_raw_and_selected_lists(device, monkeypatch):
    """Raw lists and the selector's own (no prepare, no sync) run the union design, forward and backward, where
    configs pin it: against the float64 reference."""
    import kernelgen.dispatch
    from kernelgen.backends.triton import TritonBackend

    builds = []
    build = kernelgen.dispatch.build_tile_union
    monkeypatch.setattr(kernelgen.dispatch, "build_tile_union", lambda *a: builds.append(a) or build(*a))
    ran = []
    for role in ("kv_attn", "kv_attn_union", "kv_bwd", "kv_bwd_union"):
        impl = TritonBackend.roles[role]
        monkeypatch.setitem(TritonBackend.roles, role, dataclasses.replace(
            impl, launch=lambda *a, role=role, launch=impl.launch: ran.append(role) or launch(*a)))
    for selector in ("given", "mean"):
        spec = kv_spec(top_k=3, causal=True, gqa_group=2, selector=selector)
        q, k, v, do = leaves(1, 2, 2, 70, 100, 64, torch.float32, device, 37)
        idx = reference.select_blocks(q.detach(), k.detach(), spec.replace(selector="mean"))
        attn = kernelgen.get_kernel(spec, configs=bwd_config(8))
        ran.clear()
        builds.clear()
        o, lse = attn(q, k, v, block_idx=idx if selector == "given" else None, return_lse=True)
        o.backward(do)
        assert ran == ["kv_attn_union", "kv_bwd_union"], ran
        assert len(builds) == 1  # the backward reuses the union the forward built
        given = spec.replace(selector="given")
        ref_o, ref_lse, _ = reference.sparse_attention(q.detach(), k.detach(), v.detach(), given, block_idx=idx)
        assert_close_to_reference(o.detach(), lse, ref_o, ref_lse, q.dtype)
        assert_grads_close((q.grad, k.grad, v.grad), reference.sparse_attention_grads(q, k, v, do, given, idx),
                           q.dtype)


def test_the_served_union_configs_pin_as_the_readme_says(device):
    """README's recipe: `attn.config(role, n_q, n_k)`, on this machine's GPU or else its CPU when no device is
    named, pinned for both union roles, runs raw lists through the union design."""
    spec = kv_spec(top_k=3, causal=True, gqa_group=2)
    attn = kernelgen.get_kernel(spec)
    configs = {r: attn.config(r, 70, 100) for r in ("kv_attn_union", "kv_bwd_union")}
    assert configs == {r: attn.config(r, 70, 100, device=device) for r in configs}
    q, k, v = make_inputs(1, 2, 2, 70, 100, 64, torch.float32, device, 41)
    idx = reference.select_blocks(q, k, spec.replace(selector="mean"))
    o, lse = kernelgen.get_kernel(spec, configs=configs)(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


def test_tuning_workloads_build_a_tile_union_once_per_tile_q(device, monkeypatch):
    """A tuner's trials time the kernels, not the union's build: the workload builds each tile_q's union once
    (as kv_bwd's workload builds its reverse index once), and a trial's output still matches."""
    import kernelgen.tile_union
    from kernelgen.backends.triton import TritonBackend
    from kernelgen.roles import ROLES, WorkloadShape
    from kernelgen.tuning.worker import _launcher, _shapes

    builds = []
    build = kernelgen.tile_union.build_tile_union
    monkeypatch.setattr(kernelgen.tile_union, "build_tile_union", lambda *a: builds.append(a[1]) or build(*a))
    spec = kv_spec(top_k=4, kv_block=16, gqa_group=2)
    for role, cfgs in (("kv_attn_union", [union_config(t)["kv_attn_union"] for t in (8, 16, 8)]),
                       ("kv_bwd_union", [bwd_config(t)["kv_bwd_union"] for t in (8, 16, 8)])):
        shape = WorkloadShape(1, 1, 128, 128)
        workload = ROLES[role].workload(spec, shape, device, torch.float32)
        builds.clear()
        for cfg in cfgs:
            out = _launcher(TritonBackend(), spec, role, cfg, workload, _shapes(spec, shape), torch.float32, device)()
            assert workload.check(out) is None, (role, cfg)
        assert builds == [8, 16], (role, builds)


def test_an_exported_module_runs_the_gathered_design(tmp_path, device):
    """An exported per-query module pins every role it embeds, kv_attn included: its prepare never serves the
    union design, whose kernels it does not carry."""
    import importlib.util

    from kernelgen.export import export_module

    spec = kv_spec(top_k=4, kv_block=16, gqa_group=2)
    path = export_module(spec, tmp_path / "kv_mod.py", arch="cpu" if device == "cpu" else None)
    loader = importlib.util.spec_from_file_location("kv_mod", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    lists = agreeing_query_lists(spec, 1, 1, 256, 256, own=0, device="cpu").to(device)
    prepared = module.prepare(lists, 256, 256)
    assert prepared.union is None
    q, k, v = make_inputs(1, 1, 2, 256, 256, 64, torch.float32, device, 43)
    o, lse = module.attn(q, k, v, block_idx=prepared, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=lists)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


def test_the_helpers_reject_bad_input():
    spec = kv_spec(top_k=4)
    for own, span in ((-1, 64), (5, 64), (2, 0)):
        with pytest.raises(KernelgenValueError, match="own=|span="):
            agreeing_query_lists(spec, 1, 1, 64, 64, own=own, span=span, device="cpu")
    lists = torch.zeros(1, 1, 8, 4, dtype=torch.int32)
    with pytest.raises(KernelgenValueError, match="int32"):
        build_tile_union(lists.long(), 4, 8)
    with pytest.raises(KernelgenValueError, match="tile_q"):
        build_tile_union(lists, 0, 8)
    with pytest.raises(TypeError, match="union must be"):
        union_for("a union", lists, 4, 8)
    with pytest.raises(TypeError):  # backward is keyword-only: a head_dim passed second is no silent backward=True
        union_max_inflation(64, 128)


def test_configs_are_checked():
    spec = kv_spec(gqa_group=16, head_dim=128, kv_block=64, top_k=16)
    for arch in ("sm_80", "sm_89", "sm_90"):
        cfg = kv_union_default(spec, arch)
        assert kv_union_infeasible(spec, cfg, arch) is None and cfg in set(kv_union_space(spec, arch))
    assert "tile_q=3" in kv_union_infeasible(spec, KvUnionConfig(tile_q=3), "sm_90")
    for arch in ("sm_80", "sm_89"):
        assert "needs TMA" in kv_union_infeasible(spec, KvUnionConfig(use_tma=True), arch)
        assert "dq_use_tma=True needs TMA" in kv_union_bwd_infeasible(spec, KvUnionBwdConfig(dq_use_tma=True), arch)
        assert "use_tma=True needs TMA" in kv_union_bwd_infeasible(spec, KvUnionBwdConfig(use_tma=True), arch)
        assert not any(c.use_tma for c in kv_union_space(spec, arch))
    assert "block_m=256" in kv_union_infeasible(spec, KvUnionConfig(tile_q=8, block_m=256), "sm_90")  # > 16 * 8 rows
    assert kv_union_infeasible(kv_spec(gqa_group=3), KvUnionConfig(tile_q=8, block_m=32), "sm_90")  # 4 heads of 3
    with pytest.raises(KernelgenValueError, match="tile_q"):
        kernelgen.get_kernel(spec, configs={"kv_attn_union": KvUnionConfig(tile_q=5)})


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, d, kv_block, g, causal", [(4096, 128, 128, 16, False), (16384, 128, 64, 16, True),
                                                       (32768, 64, 64, 16, True)])
def test_gpu_against_reference(n, d, kv_block, g, causal, dtype):
    """Agreeing lists through the union design; a slice of rows checked in float64."""
    spec = kv_spec(head_dim=d, kv_block=kv_block, gqa_group=g, top_k=16, causal=causal)
    idx = agreeing_query_lists(spec, 1, 1, n, n, own=2, seed=1)
    q, k, v = make_inputs(1, 1, g, n, n, d, dtype, "cuda", 3)
    attn = kernelgen.get_kernel(spec, configs={"kv_attn_union": kv_union_default(spec, "sm_90")})
    lists = attn.prepare(idx, n, n)
    assert lists.union is not None  # pinned: at 128-key blocks these lists' inflation, 1.3, serves the gathered one
    o, lse = attn(q, k, v, block_idx=lists, return_lse=True)
    o2, lse2 = attn(q, k, v, block_idx=lists, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    rows = slice(n - 512, n)
    ref_o, ref_lse, _ = reference.sparse_attention(q[:, :4, rows].double(), k.double(), v.double(), spec,
                                                   block_idx=idx[:, :, rows])
    assert_close_to_reference(o[:, :4, rows], lse[:, :4, rows], ref_o, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("d, causal", [(128, True), (64, False)])
def test_gpu_gradients(d, causal, use_tma, dtype):
    """4k queries, G = 16, 64-key blocks, agreeing lists: the union design's backward against float64 autograd;
    two backward runs bitwise equal."""
    skip_without_tma(use_tma)
    n, g = 4096, 16
    spec = kv_spec(head_dim=d, kv_block=64, gqa_group=g, top_k=16, causal=causal)
    idx = agreeing_query_lists(spec, 1, 1, n, n, own=2, seed=2)
    q, k, v, do = leaves(1, 1, g, n, n, d, dtype, "cuda", 4)
    cfg = dataclasses.replace(kv_union_bwd_default(spec, "sm_90"), dq_use_tma=use_tma, use_tma=use_tma)
    attn = kernelgen.get_kernel(spec, configs={"kv_bwd_union": cfg})
    lists = attn.prepare(idx, n, n)
    assert lists.union is not None
    runs = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        attn(q, k, v, block_idx=lists).backward(do)
        runs.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    want = reference.sparse_attention_grads(*(x.detach().double() for x in (q, k, v, do)), spec, idx)
    assert_grads_close(runs[0], want, dtype)

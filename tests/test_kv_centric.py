"""The KV-centric schedule's forward (per-query lists) against the float64 reference: CPU (interpreter,
fp32/fp16, small) and GPU (bf16/fp16, 4k-64k, a subset of heads checked)."""
import pytest
import torch

import kernelgen
from kernelgen import KvAttnConfig, Spec, backends, reference
from kernelgen.errors import KernelgenValueError
from kernelgen.reverse_index import build_query_reverse_index, split_tasks
from checks import assert_close_to_reference, assert_valid_selection
from test_triton_fwd import make_inputs


def kv_spec(**fields):
    return Spec(schedule="kv_centric", **{"head_dim": 64, "kv_block": 32, "top_k": 3, **fields})


def run_and_check(spec, q, k, v, block_idx=None, configs=None):
    attn = kernelgen.get_kernel(spec, configs=configs)
    if block_idx is None:
        idx = attn.select(q, k)
        assert idx.shape == (q.shape[0], k.shape[1], q.shape[2], spec.top_k)
        assert_valid_selection(idx, q, k, spec)
        o, lse = attn(q, k, v, return_lse=True)
        block_idx = idx  # the call selects what select() does (deterministic)
    else:
        o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec.replace(selector="given"), block_idx=block_idx)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    return o, lse, assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


# causal, G, D, kv_block, (Nq, Nk): each of GQA 1/2/4, D 64/128, kv_block 32/64, Nq <, =, > Nk, ragged ends
CASES = [
    (False, 1, 64, 32, (70, 100)),
    (True, 2, 64, 64, (100, 100)),
    (True, 4, 128, 32, (90, 50)),
    (False, 2, 128, 64, (45, 130)),
    (True, 1, 64, 32, (40, 97)),
]


@pytest.mark.parametrize("causal, g, d, kv_block, lengths", CASES)
def test_against_reference(causal, g, d, kv_block, lengths, device):
    nq, nk = lengths
    spec = kv_spec(head_dim=d, kv_block=kv_block, top_k=2, causal=causal, gqa_group=g)
    q, k, v = make_inputs(1, 2, g, nq, nk, d, torch.float16, device, nq + nk)
    run_and_check(spec, q, k, v)


@pytest.mark.parametrize("dtype, selector", [(torch.float32, "mean"), (torch.float16, "multi:2"),
                                             (torch.float32, "multi:4")])
def test_selectors_local_sink(dtype, selector, device):
    spec = kv_spec(top_k=4, causal=True, gqa_group=2, selector=selector, local=2, sink=1)
    q, k, v = make_inputs(1, 2, 2, 80, 150, 64, dtype, device, 7)
    run_and_check(spec, q, k, v)


def test_non_causal_sink_local(device):
    spec = kv_spec(top_k=3, causal=False, local=1, sink=1)
    q, k, v = make_inputs(2, 1, 1, 50, 120, 64, torch.float32, device, 9)
    run_and_check(spec, q, k, v)


def test_selection_matches_the_reference_where_scores_do_not_tie(device):
    spec = kv_spec(top_k=3, causal=True, gqa_group=2, selector="multi:2")
    q, k, _ = make_inputs(1, 1, 2, 60, 160, 64, torch.float32, device, 11)
    assert torch.equal(kernelgen.get_kernel(spec).select(q, k), reference.select_blocks(q, k, spec))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_given_lists_empty_repeated_out_of_range_and_an_empty_row(index_dtype, device):
    spec = kv_spec(top_k=4, causal=True, gqa_group=2, selector="given")
    nq, nk = 60, 100  # 4 blocks
    q, k, v = make_inputs(1, 2, 2, nq, nk, 64, torch.float32, device, 13)
    gen = torch.Generator(device="cpu").manual_seed(5)
    idx = torch.randint(-2, 6, (1, 2, nq, 4), generator=gen)  # -1, -2 and ids 4, 5: empty slots
    idx[0, 0, 5] = torch.tensor([2, 2, 1, 2])  # repeats count once
    idx[0, 1, 7] = -1  # an empty row: o = 0, lse = -inf
    idx[0, 1, 8] = torch.tensor([3, 7, -1, 2**31 - 1 if index_dtype == torch.int32 else 2**32 + 1])
    o, lse, _ = run_and_check(spec, q, k, v, block_idx=idx.to(device=device, dtype=index_dtype))
    assert torch.equal(o[0, 2:4, 7], torch.zeros_like(o[0, 2:4, 7])) and torch.isinf(lse[0, 2:4, 7]).all()


def test_causal_rows_that_see_nothing(device):
    """Nq > Nk: the first Nq - Nk queries see no key, whatever their lists hold."""
    spec = kv_spec(top_k=2, causal=True)
    q, k, v = make_inputs(1, 1, 1, 70, 40, 64, torch.float32, device, 17)
    o, lse, _ = run_and_check(spec, q, k, v)
    assert (o[:, :, :30] == 0).all() and torch.isinf(lse[:, :, :30]).all()


def test_deterministic_and_prepared_lists_give_the_same_bits(device):
    """Under the same design (the gathered one, pinned: prepare would serve these close lists the union
    design, whose bits differ by rounding; tests/test_kv_union.py)."""
    spec = kv_spec(top_k=3, causal=True, gqa_group=2, selector="given", kv_block=64)
    q, k, v = make_inputs(1, 1, 2, 90, 200, 64, torch.float16, device, 19)
    idx = reference.select_blocks(q.float(), k.float(), spec.replace(selector="mean"))
    attn = kernelgen.get_kernel(spec, configs={"kv_attn": kernelgen.get_kernel(spec).config("kv_attn", 90, 200,
                                                                                            device=device)})
    o1, lse1 = attn(q, k, v, block_idx=idx, return_lse=True)
    o2, lse2 = attn(q, k, v, block_idx=idx, return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    lists = attn.prepare(idx, 90, 200)
    assert isinstance(lists, kernelgen.BlockLists) and lists.per_query
    assert lists.reverse_index() is lists.reverse_index()
    o3, lse3 = attn(q, k, v, block_idx=lists, return_lse=True)
    assert torch.equal(o1, o3) and torch.equal(lse1, lse3)


def test_a_popular_block_is_split_across_tasks(device):
    """Block 0 (a sink, in every list) has one pair per query: with 16 queries a task it takes several
    programs, and the result is the same as with one large task per block."""
    spec = kv_spec(top_k=2, causal=True, sink=1, selector="given")
    nq = 70
    q, k, v = make_inputs(1, 1, 1, nq, nq, 64, torch.float32, device, 23)
    idx = reference.select_blocks(q, k, spec.replace(selector="mean"))
    reverse = build_query_reverse_index(idx, spec.n_kv_blocks(nq))
    task_block, task_start = split_tasks(reverse.offsets, nq * spec.top_k, 16)
    assert int((task_block == 0).sum()) == -(-nq // 16)
    small, _, _ = run_and_check(spec, q, k, v, block_idx=idx, configs={"kv_attn": KvAttnConfig(block_m=16)})
    large, _, _ = run_and_check(spec, q, k, v, block_idx=idx, configs={"kv_attn": KvAttnConfig(block_m=128)})
    assert torch.allclose(small, large, atol=1e-5)


def test_prepared_lists_split_their_tasks_once(device, monkeypatch):
    """The forward's task split is kept with a prepared list set's reverse index: a second call reuses it."""
    import kernelgen.reverse_index as reverse_index

    spec = kv_spec(top_k=2, causal=True, sink=1, selector="given")
    q, k, v = make_inputs(1, 1, 1, 40, 40, 64, torch.float32, device, 5)
    attn = kernelgen.get_kernel(spec, configs={"kv_attn": KvAttnConfig()})  # the gathered design, which splits
    lists = attn.prepare(reference.select_blocks(q, k, spec.replace(selector="mean")), 40, 40)
    splits = []
    monkeypatch.setattr(reverse_index, "split_tasks", lambda *a: splits.append(a) or split_tasks(*a))
    first, second = attn(q, k, v, block_idx=lists), attn(q, k, v, block_idx=lists)
    assert len(splits) == 1 and torch.equal(first, second)


def test_reverse_index_and_tasks_cover_every_pair_once():
    gen = torch.Generator().manual_seed(29)
    n_blocks, nq, top_k = 5, 37, 3
    raw = torch.randint(-1, n_blocks, (2, 2, nq, top_k), generator=gen)
    idx = reference.normalize_block_idx(raw, n_blocks)
    reverse = build_query_reverse_index(idx, n_blocks)
    task_block, task_start = split_tasks(reverse.offsets, nq * top_k, 4)
    for b in range(2):
        for h in range(2):
            pairs = []
            for t in range(task_block.shape[-1]):
                j = int(task_block[b, h, t])
                if j < 0:
                    continue
                start = int(task_start[b, h, t])
                end = min(start + 4, int(reverse.offsets[b, h, j + 1]))
                assert start < end
                queries = reverse.queries[b, h, start:end].tolist()
                assert queries == sorted(queries)
                for i, s in zip(queries, reverse.slots[b, h, start:end].tolist()):
                    assert int(idx[b, h, i, s]) == j
                    pairs.append((i, s))
            want = [(i, s) for i in range(nq) for s in range(top_k) if idx[b, h, i, s] >= 0]
            assert sorted(pairs) == want


def test_partials_in_the_inputs_dtype(device):
    spec = kv_spec(top_k=3, causal=True, gqa_group=4, head_dim=128)
    q, k, v = make_inputs(1, 1, 4, 50, 90, 128, torch.float16, device, 31)
    run_and_check(spec, q, k, v, configs={"kv_attn": KvAttnConfig(block_m=32, partials_fp32=False, combine_rows=16)})


def test_bad_inputs_are_clear_errors(device):
    spec = kv_spec(top_k=2, selector="given")
    q, k, v = make_inputs(1, 1, 1, 40, 64, 64, torch.float32, device, 37)
    attn = kernelgen.get_kernel(spec)
    tiled = torch.zeros(1, 1, 1, 2, dtype=torch.int32, device=device)  # a Q-centric shape
    with pytest.raises(kernelgen.KernelgenValueError, match=r"expected \[B, Hkv, Nq, top_k\] = \(1, 1, 40, 2\)"):
        attn(q, k, v, block_idx=tiled)
    with pytest.raises(kernelgen.KernelgenTypeError, match="block_idx.dtype"):
        attn(q, k, v, block_idx=torch.zeros(1, 1, 40, 2, device=device))
    with pytest.raises(kernelgen.KernelgenValueError, match="needs block_idx"):
        attn(q, k, v)
    q_centric = kernelgen.get_kernel(Spec(head_dim=64, kv_block=32, top_k=2, q_tile=64, selector="given"))
    with pytest.raises(kernelgen.KernelgenValueError, match="prepared for per-Q-tile lists"):
        attn(q, k, v, block_idx=q_centric.prepare(torch.zeros(1, 1, 1, 2, dtype=torch.int32, device=device), 40, 64))
    with pytest.raises(kernelgen.KernelgenValueError, match="no Q tile is used"):
        kv_spec(q_tile=128)
    for name in ("tilelang", "gluon"):
        assert "kv_centric" in backends.get(name).spec_unsupported(kv_spec())
        with pytest.raises(kernelgen.KernelgenValueError, match="is not built for backend"):
            kernelgen.get_kernel(kv_spec(backend=name))


def test_lists_in_nsa_layout_are_refused_naming_the_transpose(device):
    """fla-core's NSA keeps per-query lists as [B, T, Hkv, S]: passed as they are, the call and prepare say so (prepare
    reads Hkv from dim 1, so it must not claim T there as the expected Hkv)."""
    spec = kv_spec(top_k=2, selector="given", gqa_group=2)
    q, k, v = make_inputs(1, 2, 2, 40, 64, 64, torch.float32, device, 37)
    attn = kernelgen.get_kernel(spec)
    ours = torch.zeros(1, 2, 40, 2, dtype=torch.int32, device=device)
    for nsa in (ours.transpose(1, 2), ours[:, :1].transpose(1, 2)):  # Hkv heads, or one broadcast
        with pytest.raises(KernelgenValueError, match=r"NSA's \[B, T, Hkv, S\].*block_idx.transpose\(1, 2\)"):
            attn(q, k, v, block_idx=nsa)
        with pytest.raises(KernelgenValueError, match=r"NSA's \[B, T, Hkv, S\].*block_idx.transpose\(1, 2\)") as error:
            attn.prepare(nsa, 40, 64)
        assert "(1, 40, 40, 2)" not in str(error.value)
    with pytest.raises(KernelgenValueError, match=r"NSA's \[B, T, Hkv, S\]"):  # one query (a decode step)
        attn(q[:, :, :1], k, v, block_idx=ours[:, :, :1].transpose(1, 2))
    with pytest.raises(KernelgenValueError, match=r"block_idx.shape = \(1, 1, 39, 2\)"):  # the caller's, not broadcast
        attn(q, k, v, block_idx=ours[:, :1, :39])
    # q, k, v left in [B, T, H, D] while the lists were transposed: the message names that mistake too
    with pytest.raises(KernelgenValueError, match=r"q, k and v may be the ones in \[B, T, H, D\]"):
        attn(q, k, v, block_idx=ours.transpose(1, 2))
    # a list per query given to a Q-centric spec: the schedule that takes them is named
    q_centric = kernelgen.get_kernel(Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2, gqa_group=2, selector="given"))
    with pytest.raises(KernelgenValueError, match=r"schedule='kv_centric'\) takes those"):
        q_centric(q, k, v, block_idx=ours)


# ---- GPU: long sequences, bf16/fp16 -------------------------------------------------------------------------

GPU_CASES = [  # B, Hkv, G, Nq, Nk, D, kv_block, top_k, causal
    (1, 2, 4, 4096, 4096, 128, 64, 16, True),
    (1, 2, 1, 16384, 16384, 64, 64, 16, False),
    (1, 2, 8, 32768, 32768, 128, 128, 16, True),
    (1, 1, 4, 65536, 65536, 128, 64, 16, True),
    (2, 1, 2, 8192, 16384, 128, 64, 32, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_against_reference(case, dtype):
    b, hkv, g, nq, nk, d, kv_block, top_k, causal = case
    spec = kv_spec(head_dim=d, kv_block=kv_block, top_k=top_k, causal=causal, gqa_group=g, sink=1, local=2)
    q, k, v = make_inputs(b, hkv, g, nq, nk, d, dtype, "cuda", sum(case))
    attn = kernelgen.get_kernel(spec)
    idx = attn.select(q, k)
    o, lse = attn(q, k, v, return_lse=True)
    torch.testing.assert_close(attn(q, k, v), o, rtol=0, atol=0)  # deterministic
    rows = slice(nq - 2048, nq)  # the last queries (the longest lists) of the first KV head's query heads
    ref_o, ref_lse = _reference_rows(q, k, v, idx, spec, rows, g)
    assert_close_to_reference(o[:, :g, rows], lse[:, :g, rows], ref_o, ref_lse, dtype)


def _reference_rows(q, k, v, idx, spec, rows, g):
    """The float64 reference for some query rows of the first KV head (causal: those rows' own diagonal)."""
    nq, nk = q.shape[2], k.shape[2]
    mask = reference.token_mask(idx[:, :1], spec, nq, nk, range(rows.start, rows.stop))
    return reference.attention(q[:, :g, rows], k[:, :1], v[:, :1], mask)


@pytest.mark.gpu
def test_gpu_given_lists_and_empty_rows():
    spec = kv_spec(head_dim=128, kv_block=64, top_k=8, causal=True, gqa_group=4, selector="given")
    q, k, v = make_inputs(1, 2, 4, 8192, 4096, 128, torch.bfloat16, "cuda", 3)
    idx = torch.randint(-1, 80, (1, 2, 8192, 8), device="cuda", dtype=torch.int32)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=idx, return_lse=True)
    assert (o[:, :, :4096] == 0).all() and torch.isinf(lse[:, :, :4096]).all()  # rows that see no key
    rows = slice(6144, 8192)
    ref_o, ref_lse = _reference_rows(q, k, v, idx, spec, rows, 4)
    assert_close_to_reference(o[:, :4, rows], lse[:, :4, rows], ref_o, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("d, kv_block, g, top_k, selector", [(64, 32, 1, 16, "mean"), (128, 128, 4, 16, "multi:4"),
                                                             (256, 64, 8, 64, "mean"), (128, 64, 16, 256, "mean")])
def test_defaults_are_feasible_points_of_their_spaces(d, kv_block, g, top_k, selector):
    spec = kv_spec(head_dim=d, kv_block=kv_block, gqa_group=g, top_k=top_k, selector=selector)
    triton_backend = backends.get("triton")
    for arch in ("sm_80", "sm_89", "sm_90", "cpu"):
        for role in ("kv_select", "kv_attn"):
            kernel_spec = kernelgen.roles.get_role(role).kernel_spec(spec, "triton")
            space = triton_backend.config_space(kernel_spec, role, arch)
            if role == "kv_select" and not space:
                # chunk >= next_pow2(top_k) fp32 representatives, held twice: at D=256 and top_k=64 none fits
                # sm_89's 99 KB, at top_k=256 none fits any GPU's (kv_select_smem_bytes)
                assert (d, top_k) in ((256, 64), (128, 256)) and arch != "sm_90" or top_k == 256, (arch, d, top_k)
                with pytest.raises(KernelgenValueError, match="shared memory"):
                    triton_backend.default_config(kernel_spec, role, arch)
                continue
            cfg = triton_backend.default_config(kernel_spec, role, arch)
            assert triton_backend.infeasible(kernel_spec, role, cfg, arch) is None, (arch, role, cfg)
            assert space and (cfg in space or role == "kv_select"), (arch, role, cfg)


def test_an_exported_module_runs_the_schedule(tmp_path, device):
    import importlib.util

    from kernelgen.export import export_module

    spec = kv_spec(top_k=2, causal=True)
    path = export_module(spec, tmp_path / "kv_mod.py", arch="cpu" if device == "cpu" else None)
    loader = importlib.util.spec_from_file_location("kv_mod", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    q, k, v = make_inputs(1, 1, 1, 40, 60, 64, torch.float32, device, 41)
    assert torch.equal(module.attn(q, k, v), kernelgen.get_kernel(spec)(q, k, v))

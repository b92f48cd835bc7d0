"""Triton kernels against the float64 reference: CPU (interpreter, fp16/fp32, small) and GPU (bf16/fp16, 4k-32k)."""
import dataclasses
import itertools

import pytest
import torch

import kernelgen
from kernelgen import Spec, reference
from kernelgen.archs import arch_facts
from checks import TEST_ARCH, assert_close_to_reference, assert_valid_selection, default_config

# use_tma configs are served only where the arch has TMA (and the interpreter, which emulates it)
needs_tma = pytest.mark.skipif(not arch_facts(TEST_ARCH).tma, reason=f"use_tma needs TMA, which {TEST_ARCH} lacks")


def make_inputs(b, hkv, g, nq, nk, d, dtype, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hkv * g, nq, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def run_and_check(spec, q, k, v, block_idx=None, configs=None):
    attn = kernelgen.get_kernel(spec, configs=configs)
    if block_idx is None:
        idx = attn.select(q, k)
        assert_valid_selection(idx, q, k, spec)
        o, lse = attn(q, k, v, return_lse=True)
        # the call selects the same lists as select() (deterministic), so check against those
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    else:
        o, lse = attn(q, k, v, block_idx=block_idx, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=block_idx)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    return assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


# The CPU grid: causal x GQA group x head_dim x kv_block x q_tile, lengths not multiples of the blocks,
# Nq != Nk in both directions, a top_k that leaves blocks out.
GRID = list(itertools.product([False, True], [1, 2, 4], [64, 128], [64, 128], [64, 128]))


@pytest.mark.parametrize("causal, g, d, kv_block, q_tile", GRID)
def test_grid_cpu(causal, g, d, kv_block, q_tile, device):
    seed = hash((causal, g, d, kv_block, q_tile)) % 1000
    nq, nk = [(300, 300), (200, 461), (333, 150)][seed % 3]
    spec = Spec(head_dim=d, kv_block=kv_block, q_tile=q_tile, top_k=2, causal=causal, gqa_group=g)
    q, k, v = make_inputs(1, 2, g, nq, nk, d, torch.float16, device, seed)
    run_and_check(spec, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("selector", ["mean", "multi:2", "multi:4"])
def test_selectors_local_sink(selector, dtype, device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=64, top_k=5, causal=True, gqa_group=2,
                selector=selector, local=2, sink=1)
    q, k, v = make_inputs(2, 2, 2, 250, 410, 64, dtype, device, 7)
    run_and_check(spec, q, k, v)


def test_non_causal_local_sink_and_small_tiles(device):
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=4, causal=False, gqa_group=1, local=1, sink=1)
    q, k, v = make_inputs(1, 3, 1, 100, 170, 64, torch.float32, device, 3)
    run_and_check(spec, q, k, v)


def test_dense_when_top_k_covers_everything(device):
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=8, causal=True, gqa_group=2)
    q, k, v = make_inputs(1, 1, 2, 300, 300, 64, torch.float32, device, 11)
    o = kernelgen.get_kernel(spec)(q, k, v)
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                              enable_gqa=True)
    assert (o.double() - expect).abs().max() < 1e-4


def test_head_dim_256(device):
    spec = Spec(head_dim=256, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v = make_inputs(1, 1, 2, 100, 130, 256, torch.float16, device, 5)
    run_and_check(spec, q, k, v)


def given_lists(spec, b, hkv, nq, nk, seed, device, dtype=torch.int32):
    """Random lists with -1 slots, out-of-range ids (negative and too large), in random order."""
    gen = torch.Generator().manual_seed(seed)
    n_tiles, n_blocks = spec.n_q_tiles(nq), spec.n_kv_blocks(nk)
    idx = torch.stack([torch.randperm(n_blocks + 3, generator=gen)[: spec.top_k] for _ in range(b * hkv * n_tiles)])
    idx = idx.view(b, hkv, n_tiles, spec.top_k) - 1  # ids in [-1, n_blocks + 1]
    idx[..., 0] = torch.where(torch.rand(b, hkv, n_tiles, generator=gen) < 0.2, -5, idx[..., 0])
    idx[..., -1] = torch.where(torch.rand(b, hkv, n_tiles, generator=gen) < 0.2, 10**6, idx[..., -1])
    return idx.to(device=device, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_given_lists_with_empty_and_out_of_range(causal, index_dtype, device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=causal, gqa_group=2, selector="given")
    q, k, v = make_inputs(2, 2, 2, 150, 200, 64, torch.float16, device, 13)
    idx = given_lists(spec, 2, 2, 150, 200, 1, device, index_dtype)
    if index_dtype == torch.int64:
        idx[0, 0, 0, 1] = 2**32 + 1  # would wrap to block 1 in a careless int32 cast
    run_and_check(spec, q, k, v, block_idx=idx)


@pytest.mark.parametrize("causal", [False, True])
def test_kv_blocks_of_256_keys_run_as_their_halves(causal, device):
    """A step holds at most 128 keys: a 256-key block runs as its two halves. Selected and given lists (-1,
    out-of-range ids, a last block whose second half is past the last key) match the reference, and so does a
    prefill over cache rows of other lengths."""
    spec = Spec(head_dim=64, kv_block=256, q_tile=64, top_k=2, causal=causal, gqa_group=2)
    q, k, v = make_inputs(1, 1, 2, 200, 600, 64, torch.float32, device, 29)
    run_and_check(spec, q, k, v)
    given = spec.replace(selector="given")
    run_and_check(given, q, k, v, block_idx=given_lists(given, 1, 1, 200, 600, 2, device))
    q, k, v = make_inputs(2, 1, 2, 100, 600, 64, torch.float32, device, 31)
    lens = torch.tensor([600, 333], dtype=torch.int32, device=device)
    idx = given_lists(given, 2, 1, 100, 600, 3, device)
    o, lse = kernelgen.get_kernel(given)(q, k, v, block_idx=idx, cache_seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, given, idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)


def test_given_lists_repeated_ids_count_once(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, selector="given")
    q, k, v = make_inputs(1, 1, 1, 64, 128, 64, torch.float32, device, 17)
    idx = torch.tensor([[[[2, 2, 0, 2], [1, 3, 3, -1]]]], dtype=torch.int32, device=device)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    with pytest.raises(ValueError, match="repeated"):
        kernelgen.get_kernel(spec, validate_lists=True)(q, k, v, block_idx=idx)


def test_all_empty_lists_give_zero_and_minus_inf(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, selector="given")
    q, k, v = make_inputs(1, 1, 1, 64, 64, 64, torch.float16, device, 19)
    idx = torch.full((1, 1, 2, 2), -1, dtype=torch.int32, device=device)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=idx, return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_strided_inputs(device):
    """Non-contiguous q/k/v (a view of a [B, N, H, D] buffer, as in most models) are read through strides."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 90, 4, 64, generator=gen).to(device, torch.float16).transpose(1, 2)
    kv = torch.randn(1, 120, 2, 2, 64, generator=gen).to(device, torch.float16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    run_and_check(spec, q, k, v)


def test_auto_backend_with_nothing_tuned_runs_triton(device):
    """backend="auto" serves the faster tuned backend; with no tuned row (always so on the CPU) it
    is the Triton kernel, and the result is the same attention."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, backend="auto")
    q, k, v = make_inputs(1, 1, 2, 100, 130, 64, torch.float16, device, 41)
    attn = kernelgen.get_kernel(spec)
    assert attn.backend(130, torch.float16, device) == "triton"
    run_and_check(spec, q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("top_k", [3, 4])  # odd: a step with no second block; even: whole steps
def test_two_blocks_per_step(causal, top_k, device):
    """kv_per_iter=2 (a tunable): two listed blocks side by side in one step, the second block
    anywhere in K (not adjacent), -1 and out-of-range slots, a partial last block, strided K/V."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=top_k, causal=causal, gqa_group=2, selector="given")
    q, k, v = make_inputs(1, 2, 2, 150, 203, 64, torch.float16, device, 37 + top_k)
    k, v = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    idx = given_lists(spec, 1, 2, 150, 203, 5 + top_k, device)
    for cfg in (kernelgen.AttnConfig(block_m=64, num_warps=4, num_stages=2, kv_per_iter=2),
                kernelgen.AttnConfig(block_m=32, num_warps=4, num_stages=1, kv_per_iter=2)):
        o, lse = kernelgen.get_kernel(spec, configs={"attn": cfg})(q, k, v, block_idx=idx, return_lse=True)
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
        assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float16)


# ---- GPU ------------------------------------------------------------------------------------------
GPU_CASES = [
    # (B, Hkv, G, Nq, Nk, D, kv_block, q_tile, top_k, causal, selector, local, sink)
    (1, 2, 1, 4096, 4096, 64, 64, 64, 16, True, "mean", 1, 1),
    (1, 2, 4, 4096, 4096, 128, 64, 64, 16, True, "mean", 2, 0),
    (2, 1, 16, 4096, 16384, 128, 128, 128, 16, False, "mean", 0, 0),
    (1, 2, 4, 8192, 8192, 128, 128, 128, 16, True, "multi:4", 1, 1),
    (1, 1, 2, 16384 + 77, 16384 + 77, 64, 64, 128, 16, True, "mean", 1, 0),
    (1, 1, 1, 32768, 32768, 64, 64, 64, 16, True, "mean", 1, 0),
    (1, 1, 4, 4000, 4096, 128, 128, 64, 64, True, "mean", 1, 0),  # Nq != Nk
    (1, 2, 2, 4096, 4096, 128, 128, 128, 32, True, "mean", 1, 0),  # top_k covers all: dense
    (1, 2, 4, 8192 + 100, 8192 + 100, 128, 256, 128, 8, True, "mean", 1, 1),  # 256-key blocks: run as halves
]


def gpu_case(case, dtype, seed_offset=0, **spec_changes):
    """(spec, q, k, v) of one GPU_CASES row, on CUDA."""
    b, hkv, g, nq, nk, d, kv_block, q_tile, top_k, causal, selector, local, sink = case
    spec = Spec(head_dim=d, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=g,
                selector=selector, local=local, sink=sink, **spec_changes)
    return (spec, *make_inputs(b, hkv, g, nq, nk, d, dtype, "cuda", nq + d + g + seed_offset))


def check_empty_lists(spec, configs):
    """Tiles whose list holds no valid id (all -1, or ids out of range) give o = 0 and lse = -inf, and the
    other tiles still match the reference (GPU: bf16, 4k keys; spec: D=128, 128-blocks and tiles, G=2)."""
    q, k, v = make_inputs(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "cuda", 43)
    idx = given_lists(spec, 1, 2, 4096, 4096, 5, "cuda")
    idx[:, :, ::3] = -1
    idx[:, 1, 1::3] = 10**6
    run_and_check(spec, q, k, v, block_idx=idx, configs=configs)
    o, lse = kernelgen.get_kernel(spec, configs=configs)(q, k, v, block_idx=idx, return_lse=True)
    o, lse = o.view(1, 4, 32, 128, 128), lse.view(1, 4, 32, 128)  # [B, H, tile, row(, D)]
    for heads, tiles in ((slice(None), slice(0, None, 3)), (slice(2, 4), slice(1, None, 3))):
        assert (o[:, heads, tiles] == 0).all() and torch.isneginf(lse[:, heads, tiles]).all()
    assert torch.isfinite(lse[:, :, 2::3]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_against_reference(case, dtype):
    run_and_check(*gpu_case(case, dtype))



@pytest.mark.gpu
def test_gpu_empty_lists():
    check_empty_lists(Spec(head_dim=128, kv_block=128, q_tile=128, top_k=8, causal=True, gqa_group=2,
                           selector="given"), None)

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_given_lists(causal):
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=causal, gqa_group=4, selector="given")
    q, k, v = make_inputs(1, 2, 4, 8192, 8192, 128, torch.bfloat16, "cuda", 29)
    idx = given_lists(spec, 1, 2, 8192, 8192, 2, "cuda")
    run_and_check(spec, q, k, v, block_idx=idx)


@needs_tma
@pytest.mark.parametrize("causal", [False, True])
def test_tma_descriptor_path(causal, device):
    """use_tma loads K/V through [B, Hkv, Nk, D] tensor descriptors; the partial last block is zero-filled."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=causal, gqa_group=2, selector="given")
    q, k, v = make_inputs(1, 2, 2, 150, 200, 64, torch.float16, device, 31)
    idx = given_lists(spec, 1, 2, 150, 200, 4, device)
    cfg = kernelgen.AttnConfig(block_m=64, num_warps=4, num_stages=2, use_tma=True)
    o, lse = kernelgen.get_kernel(spec, configs={"attn": cfg})(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.gpu
@needs_tma
@pytest.mark.parametrize("case", GPU_CASES[:4], ids=lambda c: "-".join(map(str, c)))
def test_gpu_tma_against_reference(case):
    spec, q, k, v = gpu_case(case, torch.bfloat16, seed_offset=1)
    cfg = default_config(spec, "attn")
    attn = kernelgen.get_kernel(spec, configs={"attn": kernelgen.AttnConfig(cfg.block_m, cfg.num_warps, cfg.num_stages, True)})
    idx = attn.select(q, k)
    o, lse = attn(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_selection_over_many_tiles_and_blocks(device):
    """Several pool programs (some partly past the end) and several top-k chunks per list."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=20, causal=True, gqa_group=1, selector="multi:2", local=1)
    q, k, v = make_inputs(1, 1, 1, 700, 2100, 64, torch.float16, device, 37)
    cfg = kernelgen.SelectConfig(tiles=16, chunk=32, num_warps=4, num_stages=1)  # 132 blocks: 5 chunks
    idx = kernelgen.get_kernel(spec, configs={"select": cfg}).select(q, k)
    assert_valid_selection(idx, q, k, spec)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("causal, selector, g", [(True, "multi:2", 1), (False, "mean", 2)])
def test_split_selection_gives_the_same_lists(splits, causal, selector, g, device):
    """splits > 1 (a tunable): the blocks are scanned by several programs and their partial top-k
    merged; the lists are exactly those of one program (ties included), forced blocks too, and a
    split with no chunk of its own (more splits than chunks for early causal tiles) is harmless."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=12, causal=causal, gqa_group=g, selector=selector,
                local=1, sink=1)
    q, k, v = make_inputs(1, 2, g, 333, 1000, 64, torch.float16, device, 43)
    one = kernelgen.SelectConfig(tiles=8, chunk=16, num_warps=4, num_stages=1)  # 63 blocks: 4 chunks
    expect = kernelgen.get_kernel(spec, configs={"select": one}).select(q, k)
    assert_valid_selection(expect, q, k, spec)
    split = kernelgen.SelectConfig(tiles=8, chunk=16, num_warps=4, num_stages=1, splits=splits)
    assert torch.equal(kernelgen.get_kernel(spec, configs={"select": split}).select(q, k), expect)


def test_long_given_lists_with_repeats(device):
    """top_k = 64: the list normaliser runs one list per program and drops repeats of any multiplicity."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=32, top_k=64, causal=True, selector="given")
    q, k, v = make_inputs(1, 1, 1, 64, 1000, 64, torch.float16, device, 41)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(-3, 70, (1, 1, 2, 64), generator=gen, dtype=torch.int32).to(device)  # many repeats
    o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[5]], ids=lambda c: "-".join(map(str, c)))
def test_gpu_two_blocks_per_step(case):
    spec, q, k, v = gpu_case(case, torch.bfloat16, seed_offset=2)
    cfg = kernelgen.AttnConfig(block_m=64, num_warps=4, num_stages=2, kv_per_iter=2)
    attn = kernelgen.get_kernel(spec, configs={"attn": cfg})
    idx = attn.select(q, k)
    o, lse = attn(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 4])
def test_gpu_split_selection_gives_the_same_lists(splits):
    spec, q, k, v = gpu_case(GPU_CASES[5], torch.bfloat16, seed_offset=3)  # 32k, causal, 512 blocks
    one = default_config(spec, "select")
    expect = kernelgen.get_kernel(spec, configs={"select": one}).select(q, k)
    split = dataclasses.replace(one, splits=splits)
    assert torch.equal(kernelgen.get_kernel(spec, configs={"select": split}).select(q, k), expect)

"""Prepared lists (`attn.prepare` -> BlockLists): normalised once, then calls skip that launch and give
exactly what the raw lists give."""
import copy
import pickle

import pytest
import torch

import kernelgen
from kernelgen import BlockLists, Spec, reference
from kernelgen.spec import DEFAULT_Q_TILE
from checks import assert_close_to_reference
from test_triton_fwd import given_lists, make_inputs

SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="given")


def _no_normalising(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a call with prepared lists normalised them again")
    monkeypatch.setattr(kernelgen.dispatch, "check_block_idx", fail)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_prepared_lists_give_what_raw_lists_give(index_dtype, device, monkeypatch):
    q, k, v = make_inputs(2, 2, 2, 150, 200, 64, torch.float16, device, 41)
    idx = given_lists(SPEC, 2, 2, 150, 200, 5, device, index_dtype)  # empty, out-of-range and repeated ids
    idx[0, 1, 2, :2] = 3  # a repeat: counts once
    attn = kernelgen.get_kernel(SPEC)
    raw_o, raw_lse = attn(q, k, v, block_idx=idx, return_lse=True)
    lists = attn.prepare(idx, 150, 200)
    assert isinstance(lists, BlockLists) and lists.block_idx.dtype == torch.int32
    assert lists.block_idx.data_ptr() != idx.data_ptr()
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, SPEC, block_idx=idx)
    _no_normalising(monkeypatch)
    for _ in range(2):  # reused as they are
        o, lse = attn(q, k, v, block_idx=lists, return_lse=True)
        assert torch.equal(o, raw_o) and torch.equal(lse, raw_lse)
        assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float16)
    # other inputs of the same shape (another layer), in another dtype
    q2, k2, v2 = make_inputs(2, 2, 2, 150, 200, 64, torch.float32, device, 43)
    o2, lse2 = attn(q2, k2, v2, block_idx=lists, return_lse=True)
    ref_o2, ref_lse2, _ = reference.sparse_attention(q2, k2, v2, SPEC, block_idx=idx)
    assert_close_to_reference(o2, lse2, ref_o2, ref_lse2, torch.float32)


def test_prepared_lists_are_a_copy(device):
    q, k, v = make_inputs(1, 2, 2, 96, 128, 64, torch.float32, device, 47)
    idx = given_lists(SPEC, 1, 2, 96, 128, 6, device)
    attn = kernelgen.get_kernel(SPEC)
    want = attn(q, k, v, block_idx=idx)
    lists = attn.prepare(idx, 96, 128)
    idx.fill_(0)  # the caller reuses its buffer
    assert torch.equal(attn(q, k, v, block_idx=lists), want)


def test_prepared_lists_for_another_problem_are_refused(device):
    q, k, v = make_inputs(1, 2, 2, 96, 128, 64, torch.float32, device, 53)
    attn = kernelgen.get_kernel(SPEC)
    idx = given_lists(SPEC, 1, 2, 96, 128, 7, device)
    with pytest.raises(ValueError, match="n_kv_blocks"):  # made for 256 keys, called with 128
        attn(q, k, v, block_idx=attn.prepare(idx, 96, 256))
    with pytest.raises(ValueError, match="shape"):  # made for 2 KV heads, called with 1
        attn(q[:, :2], k[:, :1], v[:, :1], block_idx=attn.prepare(idx, 96, 128))
    with pytest.raises(ValueError, match="kv_block"):  # made for other blocks
        other = kernelgen.get_kernel(SPEC.replace(kv_block=64, top_k=4))
        attn(q, k, v, block_idx=other.prepare(given_lists(SPEC.replace(kv_block=64), 1, 2, 96, 128, 7, device), 96, 128))
    with pytest.raises(ValueError, match="prepared for 3 Q tiles; this call has 1"):  # made for 96 queries
        attn(q[:, :, :32], k, v, block_idx=attn.prepare(idx, 96, 128))
    per_query = kernelgen.get_kernel(SPEC.replace(schedule="kv_centric", q_tile=DEFAULT_Q_TILE))
    lists = per_query.prepare(torch.zeros(1, 2, 96, SPEC.top_k, dtype=torch.int32, device=device), 96, 128)
    with pytest.raises(ValueError, match="prepared for 96 queries; this call has 59"):  # not its batch or heads
        per_query(q[:, :, :59], k, v, block_idx=lists)
    with pytest.raises(ValueError, match="validate_lists|repeated"):
        rep = idx.clone()
        rep[..., 1] = rep[..., 0] = 0
        kernelgen.get_kernel(SPEC, validate_lists=True).prepare(rep, 96, 128)


def test_prepare_takes_any_integer_type(device):
    """numpy integers and 0-d integer tensors (lengths read off arrays and shapes) are lengths too."""
    import numpy as np

    attn = kernelgen.get_kernel(SPEC)
    idx = given_lists(SPEC, 1, 2, 96, 128, 7, device)
    want = attn.prepare(idx, 96, 128).block_idx
    for seq_q, seq_k in ((np.int64(96), np.int32(128)), (torch.tensor(96), torch.tensor(128, dtype=torch.int32))):
        got = attn.prepare(idx, seq_q, seq_k)
        assert torch.equal(got.block_idx, want)
        assert type(got.n_kv_blocks) is int and got.n_kv_blocks == 128 // SPEC.kv_block


def test_prepare_names_bad_arguments(device):
    attn = kernelgen.get_kernel(SPEC)
    idx = given_lists(SPEC, 1, 2, 96, 128, 7, device)
    with pytest.raises(ValueError, match="seq_k"):
        attn.prepare(idx, 96, 0)
    with pytest.raises(TypeError, match="seq_q"):
        attn.prepare(idx, 96.0, 128)
    with pytest.raises(TypeError, match="seq_k"):
        attn.prepare(idx, 96, True)
    with pytest.raises(TypeError, match="block_idx"):
        attn.prepare(idx.tolist(), 96, 128)
    with pytest.raises(ValueError, match="4-D"):
        attn.prepare(idx[0], 96, 128)
    with pytest.raises(TypeError, match="int32"):
        attn.prepare(idx.to(torch.int16), 96, 128)
    with pytest.raises(ValueError, match="shape"):  # 3 Q tiles for 96 queries, not 4
        attn.prepare(torch.cat([idx, idx[:, :, :1]], 2), 96, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon", "tilelang"])
def test_gpu_prepared_lists_every_backend(backend, monkeypatch):
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, selector="given",
                backend=backend)
    q, k, v = make_inputs(1, 2, 2, 4096, 4096, 64, torch.bfloat16, "cuda", 59)
    idx = given_lists(spec, 1, 2, 4096, 4096, 8, "cuda")
    attn = kernelgen.get_kernel(spec)
    raw_o, raw_lse = attn(q, k, v, block_idx=idx, return_lse=True)
    lists = attn.prepare(idx, 4096, 4096)
    _no_normalising(monkeypatch)
    o, lse = attn(q, k, v, block_idx=lists, return_lse=True)
    assert torch.equal(o, raw_o) and torch.equal(lse, raw_lse)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)


def test_block_lists_are_made_by_prepare_only(device):
    attn = kernelgen.get_kernel(SPEC)
    idx = given_lists(SPEC, 1, 2, 96, 128, 7, device)
    with pytest.raises(TypeError, match="prepare"):
        BlockLists(idx, 32, 4, 4)  # unnormalised lists the kernels would trust
    lists = attn.prepare(idx, 96, 128)
    with pytest.raises(AttributeError, match="read-only"):
        lists.block_idx = idx
    assert "kv_block=32" in repr(lists) and lists.n_kv_blocks == 4 and lists.top_k == 4


def test_block_lists_and_key_reps_copy_and_pickle(device):
    """copy, deepcopy (a model copied for an EMA, a prompt cache reused) and pickle make them as prepare and
    key_reps do: the same lists and reps, which the calls take as the originals."""
    attn = kernelgen.get_kernel(SPEC)
    q, k, v = make_inputs(1, 2, 2, 96, 128, 64, torch.float32, device, 61)
    lists = attn.prepare(given_lists(SPEC, 1, 2, 96, 128, 7, device), 96, 128)
    lists.reverse_index()
    reps = kernelgen.get_kernel(SPEC.replace(selector="mean")).key_reps(k)
    for made in (copy.copy, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        copied_lists, copied_reps = made(lists), made(reps)
        assert type(copied_lists) is BlockLists and torch.equal(copied_lists.block_idx, lists.block_idx)
        assert copied_lists.union is None and torch.equal(copied_lists.reverse_index()[0], lists.reverse_index()[0])
        assert torch.equal(attn(q, k, v, block_idx=copied_lists), attn(q, k, v, block_idx=lists))
        assert torch.equal(copied_reps.reps, reps.reps) and copied_reps.n_k == reps.n_k
    assert copy.deepcopy(reps).reps is not reps.reps  # reps grow in place: a deep copy is its own


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_a_batch_or_head_dimension_of_one_broadcasts(schedule, device):
    """Lists of one row or one KV head (a BlockMask made with B=None or H=None) serve every row or head: the call
    given them expanded, bit for bit, and the reference broadcasts them alike; another size is refused."""
    spec = SPEC if schedule == "q_centric" else SPEC.replace(schedule="kv_centric", q_tile=64)
    q, k, v = make_inputs(3, 2, 2, 70, 90, 64, torch.float32, device, 53)
    lists = 70 if spec.per_query else spec.n_q_tiles(70)
    idx = torch.randint(-1, spec.n_kv_blocks(90), (1, 1, lists, spec.top_k), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(5)).to(device)
    attn = kernelgen.get_kernel(spec)
    for shape in ((1, 1), (3, 1), (1, 2)):
        part = idx.expand(*shape, -1, -1).clone()
        o, lse = attn(q, k, v, block_idx=part, return_lse=True)
        full = part.expand(3, 2, -1, -1)
        assert torch.equal(o, attn(q, k, v, block_idx=full.contiguous())), shape
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=part)
        assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    with pytest.raises(ValueError, match="block_idx.shape"):
        attn(q, k, v, block_idx=idx.expand(2, 2, -1, -1))
    with pytest.raises(ValueError, match=r"expand\(3, 2, -1, -1\)"):
        attn(q, k, v, block_idx=attn.prepare(idx, 70, 90))

"""Kept key representatives (`attn.key_reps`): the pooling selectors' representatives of K's blocks, made once
per KV cache and extended as it grows, select exactly what pooling K in the call selects."""
import pytest
import torch

from kernelgen import KeyReps, Spec, get_kernel
from kernelgen.errors import KernelgenTypeError, KernelgenValueError

from checks import assert_valid_selection


def _spec(selector="mean", schedule="q_centric", **fields):
    tile = {} if schedule == "kv_centric" else {"q_tile": 16}
    return Spec(**{"head_dim": 64, "kv_block": 16, "top_k": 3, "causal": True, "gqa_group": 2, "selector": selector,
                   "schedule": schedule, **tile, **fields})


def _qkv(n_q, n_k, device, seed=0):
    """float16 q, k, v (the interpreter's and the GPU's dtype alike: bit-equality is checked, not accuracy)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, n, 64, generator=gen).to(device=device, dtype=torch.float16)
            for h, n in ((4, n_q), (2, n_k), (2, n_k))]


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
@pytest.mark.parametrize("selector", ["mean", "multi:2"])
def test_kept_reps_select_what_pooling_selects(selector, schedule, device):
    """Lists from kept reps equal the call's own, bit for bit, and so do o and lse: prefill-sized and decode calls,
    a partial last block, local and sink blocks forced."""
    spec = _spec(selector, schedule, local=1, sink=1)
    attn = get_kernel(spec)
    q, k, v = _qkv(40, 70, device)
    reps = attn.key_reps(k)
    assert isinstance(reps, KeyReps) and reps.reps.shape == (2, 2, 5, spec.groups, 64) and reps.n_k == 70
    assert reps.reps.dtype == torch.float32
    lists = attn.select(q, k, key_reps=reps)
    assert torch.equal(lists, attn.select(q, k))
    assert_valid_selection(lists, q, k, spec)
    for queries in (q, q[:, :, -1:], q[:, :, -3:]):  # prefill, a decode step, three speculative tokens
        o, lse = attn(queries, k, v, key_reps=reps, return_lse=True)
        o_ref, lse_ref = attn(queries, k, v, return_lse=True)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("selector", ["mean", "multi:2"])
def test_reps_extended_as_the_cache_grows_equal_reps_made_at_once(selector, device):
    """A cache that grows by one key (into a new block, inside a partial one, onto a block boundary) and by a
    chunk: previous=... pools the new blocks only, and the result is the reps of the whole k, bit for bit."""
    attn = get_kernel(_spec(selector))
    _, k, _ = _qkv(1, 70, device)
    reps = attn.key_reps(k[:, :, :37])
    for n in (38, 47, 48, 49, 64, 65, 70):
        grown = attn.key_reps(k[:, :, :n], previous=reps)
        assert grown.n_k == n and torch.equal(grown.reps, attn.key_reps(k[:, :, :n]).reps), n
        reps = grown
    assert attn.key_reps(k, previous=reps) is reps  # nothing new: the same object


def test_extending_pools_only_the_new_blocks(device):
    """Only the blocks from previous's partial last block on are recomputed: a whole block left behind keeps
    previous's values even where k's keys there changed (what the caller promised not to do)."""
    attn = get_kernel(_spec())
    _, k, _ = _qkv(1, 40, device)
    reps = attn.key_reps(k[:, :, :37])  # blocks 0 and 1 whole, block 2 partial
    changed = k.clone()
    changed[:, :, :32] += 1.0
    changed[:, :, 32:] -= 1.0
    grown = attn.key_reps(changed, previous=reps)
    assert torch.equal(grown.reps[:, :, :2], reps.reps[:, :, :2])
    assert torch.equal(grown.reps[:, :, 2:], attn.key_reps(changed).reps[:, :, 2:])


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_cropped_and_strided_picked_reps_are_the_reps_of_their_keys(schedule, device):
    """reps.cropped(n) passed as they are to a call over the first n keys, and index_batch with a step slice (of
    reps of per-row lengths too, grown in place by a call), select what the call over those keys selects: the
    kernels read reps by their shape, so a strided slice of them must not reach them as it is."""
    spec = _spec("mean", schedule)
    attn = get_kernel(spec)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, h, n, 64, generator=gen).to(device) for h, n in ((4, 2), (2, 200), (2, 200)))
    cropped = attn.key_reps(k).cropped(160)
    assert cropped.n_k == 160 and torch.equal(attn.select(q, k[:, :, :160], key_reps=cropped),
                                              attn.select(q, k[:, :, :160]))
    every_other = attn.key_reps(k).index_batch(slice(None, None, 2))
    assert torch.equal(attn.select(q[::2], k[::2], key_reps=every_other), attn.select(q[::2], k[::2]))
    lens = torch.tensor([30, 70, 110, 150], dtype=torch.int32, device=device)
    reps = attn.key_reps(k, cache_seqlens=lens)
    kept = reps.reps.clone()
    picked, grown_lens = reps.index_batch(slice(None, None, 2)), torch.tensor([120, 200], dtype=torch.int32,
                                                                               device=device)
    o = attn(q[::2], k[::2], v[::2], cache_seqlens=grown_lens, key_reps=picked)  # grows picked in place
    assert torch.equal(o, attn(q[::2], k[::2], v[::2], cache_seqlens=grown_lens))
    assert torch.equal(picked.reps, attn.key_reps(k[::2], cache_seqlens=grown_lens).reps)
    assert torch.equal(reps.reps[1::2], kept[1::2])  # the rows it did not pick are left as they were


def test_the_call_autograd_keeps_working_with_kept_reps(device):
    """Inputs that require grad: the gradients over lists chosen from kept reps are those of the plain call."""
    attn = get_kernel(_spec())
    q, k, v = (x.requires_grad_() for x in _qkv(40, 70, device))
    reps = attn.key_reps(k.detach())
    grads = torch.autograd.grad(attn(q, k, v, key_reps=reps).square().sum(), (q, k, v))
    want = torch.autograd.grad(attn(q, k, v).square().sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def test_bad_key_reps_are_refused_naming_what_is_wrong(device):
    spec = _spec()
    attn = get_kernel(spec)
    q, k, v = _qkv(20, 70, device)
    reps = attn.key_reps(k)
    cases = [
        (lambda: attn(q, k[:, :, :60], v[:, :, :60], key_reps=reps), KernelgenValueError,
         "n_k = 70 keys but k has 60: attn.key_reps(k, previous=key_reps.cropped(60))"),
        (lambda: attn(q, k, v, key_reps=attn.key_reps(k[:, :, :60])), KernelgenValueError,
         "extend them with attn.key_reps(k, previous=key_reps)"),
        (lambda: attn(q, k, v, key_reps=reps.reps), KernelgenTypeError, "KeyReps"),
        (lambda: attn(q, k, v, key_reps=reps, block_idx=attn.select(q, k)), KernelgenValueError, "not both"),
        (lambda: attn(q[:1], k[:1], v[:1], key_reps=reps), KernelgenValueError, "[B, Hkv, n_kv_blocks, r, D]"),
        (lambda: get_kernel(_spec("multi:2"))(q, k, v, key_reps=reps), KernelgenValueError, "groups"),
        (lambda: get_kernel(_spec(kv_block=32))(q, k, v, key_reps=reps), KernelgenValueError, "kv_block"),
        (lambda: get_kernel(_spec("given"))(q, k, v, key_reps=reps), KernelgenValueError, "selector='given'"),
        (lambda: get_kernel(_spec("index")).key_reps(k), KernelgenValueError, "k_idx"),
        (lambda: get_kernel(_spec("given")).key_reps(k), KernelgenValueError, "pooling"),
        (lambda: attn.key_reps(k[:, :, :50], previous=reps), KernelgenValueError, "shrank"),
        (lambda: attn.key_reps(k, previous=reps.reps), KernelgenTypeError, "previous"),
        (lambda: attn.key_reps(k[..., :32]), KernelgenValueError, "k.shape[-1] = 32 does not match spec.head_dim"),
        (lambda: attn.key_reps(k.double()), KernelgenTypeError, "k.dtype"),  # k is what the caller passed, not q
        (lambda: attn.key_reps(k[0]), KernelgenValueError, "k must be 4-D"),
        (lambda: KeyReps(reps.reps, 70, 16, 1), KernelgenTypeError, "key_reps(k)"),
    ]
    for call, error, words in cases:
        with pytest.raises(error) as caught:
            call()
        assert words in str(caught.value), (words, str(caught.value))
    with pytest.raises(AttributeError):
        reps.n_k = 60


def test_the_exported_module_keeps_reps(tmp_path, device):
    import importlib.util

    spec = _spec()
    from kernelgen.export import export_module

    path = export_module(spec, tmp_path / "kept.py")
    loader = importlib.util.spec_from_file_location("kept", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    q, k, v = _qkv(20, 70, device)
    reps = module.key_reps(k)
    assert torch.equal(module.attn(q, k, v, key_reps=reps), get_kernel(spec)(q, k, v))

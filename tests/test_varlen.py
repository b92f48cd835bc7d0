"""Packed sequences of different lengths (`attn.varlen`, FlashAttention's varlen layout): each sequence selects
and attends exactly as the call over it alone, forward and backward, eagerly and under torch.compile."""
import re

import pytest
import torch

from kernelgen import Spec, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError
from kernelgen.varlen import packed_batches

from checks import assert_close_to_reference
from test_decode import random_lists

# an empty sequence, one token, a partial last tile, a tile boundary; lengths that make three padded batches
LENGTHS = (40, 0, 1, 33, 16, 7)
PER_QUERY = {"schedule": "kv_centric", "q_tile": 64}


def _spec(selector="mean", **fields):
    return Spec(**{"head_dim": 64, "kv_block": 16, "q_tile": 16, "top_k": 3, "causal": True, "gqa_group": 2,
                   "selector": selector, "local": 1, "sink": 1, **fields})


def _packed(dtype, device, lengths=LENGTHS, heads_kv=2, group=2, head_dim=64, seed=0):
    """q, k, v, dO packed [total, H, D], and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, h, head_dim, generator=gen).to(device=device, dtype=dtype)
                   for h in (heads_kv * group, heads_kv, heads_kv, heads_kv * group))
    bounds = torch.tensor((0,) + lengths).cumsum(0).to(device=device, dtype=torch.int32)
    return q, k, v, do, bounds


def _alone(x, start, n):
    """Sequence [start, start + n) of a packed tensor as a call's [1, H, n, D]."""
    return x[start:start + n].transpose(0, 1)[None]


def _lists(spec, lengths, device):
    """Given lists of a padded batch of the sequences, [n, Hkv, rows(longest), top_k], with -1, repeats and ids
    past each sequence's blocks."""
    return random_lists(spec, len(lengths), 2, max(lengths), max(lengths), seed=1).to(device)


@pytest.mark.parametrize("selector, dtype, fields", [("mean", torch.float32, {}),
                                                     ("multi:2", torch.float16, {}),
                                                     ("given", torch.float32, {}),
                                                     ("mean", torch.float32, PER_QUERY),
                                                     ("given", torch.float16, PER_QUERY)])
def test_each_sequence_is_the_call_over_it_alone(selector, dtype, fields, device):
    """o, lse and dq, dk, dv of each packed sequence equal those of the call over it alone, bit for bit, in
    several padded batches; they match the float64 reference; a second backward is bitwise equal."""
    spec = _spec(selector, **fields)
    attn = get_kernel(spec)
    q, k, v, do, bounds = _packed(dtype, device)
    assert len(packed_batches(bounds, q.shape[0], None)) > 1  # the lengths span more than one padded batch
    given = _lists(spec, LENGTHS, device) if selector == "given" else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = attn.varlen(*leaves, bounds, block_idx=given, return_lse=True)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    grads = torch.autograd.grad(o, leaves, do)
    again = torch.autograd.grad(attn.varlen(*leaves, bounds, block_idx=given), leaves, do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    for d, (start, n) in enumerate(zip(bounds.tolist(), LENGTHS)):
        if n == 0:
            continue
        alone = [_alone(x, start, n).detach().requires_grad_() for x in (q, k, v)]
        lists = None if given is None else given[d:d + 1, :, :spec.n_q_tiles(n)]
        o_alone, lse_alone = attn(*alone, block_idx=lists, return_lse=True)
        grads_alone = torch.autograd.grad(o_alone, alone, _alone(do, start, n))
        assert torch.equal(_alone(o, start, n), o_alone), d
        assert torch.equal(lse[:, start:start + n], lse_alone[0]), d
        assert all(torch.equal(_alone(g, start, n), g_alone) for g, g_alone in zip(grads, grads_alone)), d
        ref_o, ref_lse, _ = reference.sparse_attention(*(x.detach() for x in alone), spec, lists)
        assert_close_to_reference(o_alone, lse_alone, ref_o, ref_lse, dtype)


def _packed_index(total, heads_kv=2, index_heads=2, index_dim=32, shared=False, seed=7):
    """The index selector's vectors packed as q is: q_idx [total, Hkv*Hi, Di], k_idx [total, Hkv or 1, Di],
    w [total, Hkv*Hi] (weights of either sign)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, heads_kv * index_heads, index_dim, generator=gen),
            torch.randn(total, 1 if shared else heads_kv, index_dim, generator=gen),
            torch.randn(total, heads_kv * index_heads, generator=gen))


@pytest.mark.parametrize("shared", [False, True])
def test_the_index_selector_with_per_query_lists(shared, device):
    """Per-query lists from the index selector over packed sequences (attn.varlen, index= packed as q) and a
    padded batch (seqlens=): each sequence's lists, o, lse and gradients are the call's over it alone, bit for bit;
    the padding's lists are empty."""
    spec = _spec("index", **PER_QUERY)
    attn = get_kernel(spec)
    q, k, v, do, bounds = _packed(torch.float32, device)
    index = tuple(x.to(device) for x in _packed_index(q.shape[0], shared=shared))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = attn.varlen(*leaves, bounds, index=index, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do)
    if not shared:  # compiled (one batch padded to max_seqlen), forward and backward: the eager bits
        import kernelgen.custom_ops  # noqa: F401  (the ops a call being compiled runs)

        compiled = torch.compile(lambda q, k, v, b, i: attn.varlen(q, k, v, b, max_seqlen=48, index=i),
                                 backend="aot_eager", fullgraph=True)
        o_compiled = compiled(*leaves, bounds, index)
        assert torch.equal(o_compiled, o)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(o_compiled, leaves, do), grads))
    alone_index = [None] * len(LENGTHS)
    for d, (start, n) in enumerate(zip(bounds.tolist(), LENGTHS)):
        if n == 0:
            continue
        alone = [_alone(x, start, n).detach().requires_grad_() for x in (q, k, v)]
        alone_index[d] = (_alone(index[0], start, n), _alone(index[1], start, n),
                          index[2][start:start + n].t()[None].contiguous())
        o_alone, lse_alone = attn(*alone, index=alone_index[d], return_lse=True)
        grads_alone = torch.autograd.grad(o_alone, alone, _alone(do, start, n))
        assert torch.equal(_alone(o, start, n), o_alone), d
        assert torch.equal(lse[:, start:start + n], lse_alone[0]), d
        assert all(torch.equal(_alone(g, start, n), g_alone) for g, g_alone in zip(grads, grads_alone)), d
        lists = attn.select(*(x.detach() for x in alone[:2]), index=alone_index[d])
        ref_o, ref_lse, _ = reference.sparse_attention(*(x.detach() for x in alone), spec.replace(selector="given"),
                                                       lists)
        assert_close_to_reference(o_alone, lse_alone, ref_o, ref_lse, torch.float32)
    # the padded batch of the first and fourth sequences (40 and 33 tokens): select() and the call
    rows = [0, 3]
    seqlens = torch.tensor([LENGTHS[d] for d in rows], dtype=torch.int32, device=device)
    starts = bounds.tolist()

    def padded(x):
        """Packed [total, H, ...] as the rows' right-padded [2, H, 40, ...] (contiguous)."""
        out = x.new_zeros(len(rows), 40, *x.shape[1:])
        for i, d in enumerate(rows):
            out[i, :LENGTHS[d]] = x[starts[d]:starts[d] + LENGTHS[d]]
        return out.transpose(1, 2).contiguous()

    batch_qkv = [padded(x) for x in (q, k, v)]
    q_idx, k_idx, w = (padded(x) for x in index)
    lists = attn.select(batch_qkv[0], batch_qkv[1], index=(q_idx, k_idx, w), seqlens=seqlens)
    o_padded = attn(*batch_qkv, index=(q_idx, k_idx, w), seqlens=seqlens)
    ref_o, _, ref_lists = reference.sparse_attention(*batch_qkv, spec, index=(q_idx, k_idx, w), seqlens=seqlens)
    assert torch.equal(ref_lists, lists) and (o_padded - ref_o).abs().max() < 1e-4
    for i, d in enumerate(rows):
        n = LENGTHS[d]
        want = attn.select(*(_alone(x, starts[d], n) for x in (q, k)), index=alone_index[d])
        assert torch.equal(lists[i:i + 1, :, :n], want) and bool((lists[i, :, n:] == -1).all())
        assert torch.equal(o_padded[i:i + 1, :, :n], _alone(o, starts[d], n).detach())


def test_the_index_selector_needs_per_query_lists_with_lengths(device):
    """A Q tile's index score is a maximum over its queries, and a row's last tile holds padding: Q-centric index
    specs refuse seqlens= and varlen, naming the schedule; packed index vectors of another layout are named."""
    q, k, v, _, bounds = _packed(torch.float32, device)
    index = tuple(x.to(device) for x in _packed_index(q.shape[0]))
    q_centric = get_kernel(_spec("index"))
    with pytest.raises(ValueError, match="index selector with per-query lists \\(schedule='kv_centric'\\)"):
        q_centric.varlen(q, k, v, bounds, index=index)
    with pytest.raises(ValueError, match="seqlens= takes the index selector with per-query lists"):
        q_centric(*(x[None].transpose(1, 2) for x in (q, k, v)), index=tuple(x[None].transpose(1, 2) for x in index),
                  seqlens=torch.tensor([q.shape[0]], dtype=torch.int32, device=device))
    per_query = get_kernel(_spec("index", **PER_QUERY))
    with pytest.raises(ValueError, match=r"varlen takes index=\(q_idx, k_idx, w\) packed as q is.*w has shape"):
        per_query.varlen(q, k, v, bounds, index=(index[0], index[1], index[2][None]))
    with pytest.raises(TypeError, match="varlen takes index="):
        per_query.varlen(q, k, v, bounds, index=index[0])
    # named in the packed layout, whatever the lengths (not as the padded batches' tensors)
    three_heads = torch.cat([index[1], index[1][:, :1]], 1)
    for bad, words in (((index[0], three_heads, index[2]), "k_idx must have Hkv = 2 or 1 heads"),
                       ((index[0][:, :3], index[1], index[2][:, :3]), "q_idx must have Hkv\\*Hi heads"),
                       ((index[0], index[1][..., :16], index[2]), "k_idx must have q_idx's Di = 32"),
                       ((index[0], index[1], index[2][:, :2]), "w must have q_idx's 4 heads"),
                       ((index[0].transpose(1, 2).contiguous().transpose(1, 2), index[1], index[2]),
                        "q_idx must be contiguous in its last dim")):
        with pytest.raises(ValueError, match=words):
            per_query.varlen(q, k, v, bounds, index=bad)


def test_under_torch_compile_it_is_the_eager_call(device):
    """With max_seqlen, attn.varlen traces whole (fullgraph, aot_eager), forward and backward, and gives the
    eager call's bits (one batch padded to max_seqlen there, several eagerly: the same rows)."""
    import kernelgen.custom_ops  # noqa: F401  (the ops a call being compiled runs)

    spec = _spec()
    attn = get_kernel(spec)
    q, k, v, do, bounds = _packed(torch.float32, device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled = torch.compile(lambda q, k, v, b: attn.varlen(q, k, v, b, max_seqlen=48), backend="aot_eager",
                             fullgraph=True)
    o = compiled(*leaves, bounds)
    o_eager = attn.varlen(*leaves, bounds)
    assert torch.equal(o, o_eager)
    grads, grads_eager = (torch.autograd.grad(x, leaves, do) for x in (o, o_eager))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_eager))
    if device == "cpu":  # on a GPU a device-side assert, which ends the process's CUDA context
        too_short = torch.compile(lambda q, k, v, b: attn.varlen(q, k, v, b, max_seqlen=32), backend="aot_eager")
        with pytest.raises(RuntimeError, match="each sequence at most max_seqlen"):
            too_short(q, k, v, bounds)
    with pytest.raises(Exception, match="under torch.compile varlen needs max_seqlen="):  # dynamo wraps it
        torch.compile(lambda q, k, v, b: attn.varlen(q, k, v, b), backend="eager", fullgraph=True)(q, k, v, bounds)


def test_a_compiled_call_recompiles_once_per_doubling_of_the_longest_sequence(device):
    """Under torch.compile max_seqlen, once the compiler makes it dynamic, is compared, never specialised: the
    padded batch is the power of two at or above it, so new lengths in that range reuse the graph; each call is
    the eager call, bit for bit."""
    import kernelgen.custom_ops  # noqa: F401  (the ops a call being compiled runs)

    attn = get_kernel(_spec())
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, b, m: attn.varlen(q, k, v, b, max_seqlen=m), backend="aot_eager",
                             fullgraph=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, lengths in enumerate(((20, 9, 3), (30, 5, 7), (17, 25, 2), (31, 1, 4))):
        q, k, v, _, bounds = _packed(torch.float32, device, lengths, seed=seed)
        assert torch.equal(compiled(q, k, v, bounds, max(lengths)), attn.varlen(q, k, v, bounds)), lengths
    # 20 (static), then 30 dynamic: 16 < max_seqlen <= 32 holds for 25 and 31
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    torch._dynamo.reset()


def test_given_lists_under_torch_compile_with_dynamic_shapes(device):
    """A compiled call recompiled with the KV head count dynamic (a SymInt) and the lists' static takes lists of
    the right shape (`in` over the SymInt in the shape check refused them) and gives the eager call's bits."""
    import kernelgen.custom_ops  # noqa: F401  (the ops a call being compiled runs)

    compiled = torch.compile(lambda a, q, k, v, b, g: a.varlen(q, k, v, b, max_seqlen=48, block_idx=g),
                             backend="aot_eager", fullgraph=True)
    for heads_kv, selector in ((1, "mean"), (2, "given")):
        attn = get_kernel(_spec(selector))
        q, k, v, _, bounds = _packed(torch.float32, device, lengths=(40, 3), heads_kv=heads_kv)
        given = random_lists(_spec("given"), 2, heads_kv, 48, 48, seed=2).to(device) if selector == "given" else None
        assert torch.equal(compiled(attn, q, k, v, bounds, given), attn.varlen(q, k, v, bounds, block_idx=given))


def test_the_bounds_are_read_once_per_tensor(device):
    """The layers of a step pass one cu_seqlens: its bounds are read (a device sync) once; written in place,
    they are read again."""
    q, _, _, _, bounds = _packed(torch.float32, device)
    first = packed_batches(bounds, q.shape[0], None)
    assert packed_batches(bounds, q.shape[0], None) is first
    bounds[1:] = bounds[-1]  # one sequence of every token
    (batch,) = packed_batches(bounds, q.shape[0], None)
    assert batch.tokens is None and batch.length == q.shape[0]


def test_bounds_made_under_inference_mode(device):
    """Bounds made under torch.inference_mode (which keeps no version counter) are read each call: the call is
    the eager one's, and bounds written in place are seen (it was torch's RuntimeError about the counter)."""
    attn = get_kernel(_spec())
    q, k, v, _, bounds = _packed(torch.float32, device, lengths=(5, 19))
    want = attn.varlen(q, k, v, bounds)
    with torch.inference_mode():
        made = bounds.clone()
        assert torch.equal(attn.varlen(q, k, v, made), want)
        made[1] = 0  # one sequence of every token
        assert torch.equal(attn.varlen(q, k, v, made), attn.varlen(q, k, v, bounds[[0, 2]]))


def test_bad_inputs_are_refused_by_name(device):
    q, k, v, _, bounds = _packed(torch.float32, device, lengths=(5, 3))
    attn = get_kernel(_spec())
    given = _lists(_spec("given"), (5, 3), device)
    for call, error, words in [
        (lambda: attn.varlen(q[None], k, v, bounds), KernelgenValueError, "varlen takes q [total, Hq, D]"),
        (lambda: attn.varlen(q, k[:4], v[:4], bounds), KernelgenValueError, "the same tokens"),
        (lambda: attn.varlen(*(x.transpose(0, 1) for x in (q, k, v)), bounds), KernelgenValueError,
         "got 4, 2 and 2 .q [total, Hq, D]"),  # [H, total, D]: the layout named
        (lambda: attn.varlen(q[:, :3], k, v, bounds), KernelgenValueError, "2 x 2 heads"),
        (lambda: attn.varlen(q, k, v, bounds.long()), KernelgenTypeError, "cu_seqlens must be int32"),
        (lambda: attn.varlen(q, k, v, [0, 5, 8]), KernelgenTypeError, "cu_seqlens must be a torch.Tensor"),
        (lambda: attn.varlen(q, k, v, bounds[:1]), KernelgenValueError, "cu_seqlens must be 1-D"),
        (lambda: attn.varlen(q, k, v, bounds.flip(0).contiguous()), KernelgenValueError, "rise from 0"),
        (lambda: attn.varlen(q, k, v, bounds[:2]), KernelgenValueError, "rise from 0 to the 8 packed tokens"),
        (lambda: attn.varlen(q, k, v, bounds, max_seqlen=4), KernelgenValueError, "longer than max_seqlen=4"),
        (lambda: attn.varlen(q, k, v, bounds, max_seqlen=4.0), KernelgenTypeError, "max_seqlen must be an int"),
        (lambda: attn.varlen(q, k, v, bounds, return_lse=1), KernelgenTypeError, "return_lse must be a bool"),
        (lambda: get_kernel(_spec(causal=False)).varlen(q, k, v, bounds), KernelgenValueError, "causal"),
        (lambda: get_kernel(_spec("index")).varlen(q, k, v, bounds), KernelgenValueError, "index selector"),
        (lambda: get_kernel(_spec("given")).varlen(q, k, v, bounds, block_idx=given[:1]), KernelgenValueError,
         "n = 2 sequences"),
        (lambda: get_kernel(_spec("given")).varlen(q, k, v, bounds, block_idx=get_kernel(_spec("given")).prepare(
            given, 5, 5)), KernelgenTypeError, "not prepared BlockLists"),
    ]:
        with pytest.raises(error, match=words.replace("[", r"\[")):
            call()
    # lists of another top_k or Hkv over sequences in two padded batches: the error shows the caller's shape
    q, k, v, _, bounds = _packed(torch.float32, device, lengths=(40, 3))
    given = _lists(_spec("given"), (40, 3), device)
    for lists in (given[..., :2], given[:, [0, 1, 1]]):
        with pytest.raises(KernelgenValueError, match="top_k = 3 .*got " + re.escape(str(tuple(lists.shape)))):
            get_kernel(_spec("given")).varlen(q, k, v, bounds, block_idx=lists)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_on_gpu(dtype, schedule):
    """Sequences of 8192, 0, 5000, 1 and 300 tokens packed (128-key blocks, top-16): outputs and gradients equal
    each sequence's own call, bit for bit, and the backward is deterministic."""
    lengths = (8192, 0, 5000, 1, 300)
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, local=2, sink=1, schedule=schedule)
    attn = get_kernel(spec)
    q, k, v, do, bounds = _packed(dtype, "cuda", lengths, heads_kv=2, group=4, head_dim=128)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attn.varlen(*leaves, bounds)
    grads = torch.autograd.grad(o, leaves, do)
    again = torch.autograd.grad(attn.varlen(*leaves, bounds), leaves, do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    for start, n in zip(bounds.tolist(), lengths):
        if n == 0:
            continue
        alone = [_alone(x, start, n).detach().requires_grad_() for x in (q, k, v)]
        o_alone = attn(*alone)
        grads_alone = torch.autograd.grad(o_alone, alone, _alone(do, start, n))
        assert torch.equal(_alone(o, start, n), o_alone), n
        assert all(torch.equal(_alone(g, start, n), g_alone) for g, g_alone in zip(grads, grads_alone)), n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_index_selector_over_packed_sequences_on_gpu(dtype):
    """DSA's shape of selection over packed sequences (per-query lists, Hi = 4 index heads of 64): outputs and
    gradients equal each sequence's own call, bit for bit."""
    lengths = (8192, 0, 3000, 1, 300)
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, local=1, sink=1, selector="index",
                schedule="kv_centric")
    attn = get_kernel(spec)
    q, k, v, do, bounds = _packed(dtype, "cuda", lengths, heads_kv=2, group=4, head_dim=128)
    index = tuple(x.to("cuda", dtype) for x in _packed_index(q.shape[0], index_heads=4, index_dim=64))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attn.varlen(*leaves, bounds, index=index)
    grads = torch.autograd.grad(o, leaves, do)
    for start, n in zip(bounds.tolist(), lengths):
        if n == 0:
            continue
        alone = [_alone(x, start, n).detach().requires_grad_() for x in (q, k, v)]
        alone_index = (_alone(index[0], start, n), _alone(index[1], start, n),
                       index[2][start:start + n].t()[None].contiguous())
        o_alone = attn(*alone, index=alone_index)
        grads_alone = torch.autograd.grad(o_alone, alone, _alone(do, start, n))
        assert torch.equal(_alone(o, start, n), o_alone), n
        assert all(torch.equal(_alone(g, start, n), g_alone) for g, g_alone in zip(grads, grads_alone)), n

"""Right-padded batches (`seqlens=`): one call over a batch of rows of different lengths, each row selecting
and attending exactly as the call over its own tokens alone, forward and backward; the padding gives o = 0,
lse = -inf and no gradient."""
import pytest
import torch

from kernelgen import Spec, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError

from checks import assert_close_to_reference, assert_valid_selection
from test_backward import assert_grads_close
from test_decode import random_lists

LENGTHS = (100, 37, 0, 48, 1)  # a full row, a partial last tile, an empty row, a tile boundary, one token


def _spec(selector="mean", **fields):
    return Spec(**{"head_dim": 64, "kv_block": 16, "q_tile": 16, "top_k": 3, "causal": True, "gqa_group": 2,
                   "selector": selector, "local": 1, "sink": 1, **fields})


def _batch(dtype, device, n=100, lengths=LENGTHS, heads_kv=2, group=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(len(lengths), h, n, head_dim, generator=gen).to(device=device, dtype=dtype)
                   for h in (heads_kv * group, heads_kv, heads_kv, heads_kv * group))
    return q, k, v, do, torch.tensor(lengths, dtype=torch.int32, device=device)


def _row_lists(spec, lists, b, n):
    return lists[b:b + 1, :, :spec.n_q_tiles(n)]


PER_QUERY = {"schedule": "kv_centric", "q_tile": 64}  # one list per query: the KV-centric schedule


@pytest.mark.parametrize("selector, dtype, fields", [("mean", torch.float32, {}),
                                                     ("multi:2", torch.float16, {}),
                                                     ("mean", torch.float32, {"q_tile": 32}),
                                                     ("multi:2", torch.float32, {"kv_block": 32, "local": 2}),
                                                     ("given", torch.float32, {}),
                                                     ("mean", torch.float32, PER_QUERY),
                                                     ("multi:2", torch.float16, PER_QUERY),
                                                     ("given", torch.float32, PER_QUERY)])
def test_each_row_is_the_call_over_its_own_tokens(selector, dtype, fields, device):
    """Row b's lists and outputs are those of the call over its first lengths[b] queries and keys alone, bit for
    bit (its last partial tile and block pooled over its tokens alone); o, lse match the float64 reference;
    the padding gives o = 0 and lse = -inf."""
    spec = _spec(selector, **fields)
    attn = get_kernel(spec)
    q, k, v, _, lens = _batch(dtype, device)
    given = random_lists(spec, len(LENGTHS), 2, 100, 100, seed=1).to(device) if selector == "given" else None
    o, lse = attn(q, k, v, block_idx=given, seqlens=lens, return_lse=True)
    lists = given if given is not None else attn.select(q, k, seqlens=lens)
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        row = tuple(x[b:b + 1, :, :n] for x in (q, k, v))
        row_given = None if given is None else _row_lists(spec, given, b, n)
        if given is None:
            assert torch.equal(_row_lists(spec, lists, b, n), attn.select(*row[:2])), b
        assert torch.equal(o[b:b + 1, :, :n], attn(*row, block_idx=row_given)), b
    ref_o, ref_lse, ref_lists = reference.sparse_attention(q, k, v, spec, given, seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    padding = torch.arange(100, device=device)[None, :] >= lens[:, None].long()
    assert (o.permute(0, 2, 1, 3)[padding] == 0).all() and torch.isinf(lse.permute(0, 2, 1)[padding]).all()
    if given is None:  # the lists past a row's tokens are empty
        past = torch.arange(lists.shape[2], device=device)[None, :] * spec.list_queries >= lens[:, None].long()
        assert (lists.permute(0, 2, 1, 3)[past] == -1).all()


@pytest.mark.parametrize("fields", [{}, PER_QUERY], ids=["q_centric", "kv_centric"])
@pytest.mark.parametrize("selector", ["mean", "given"])
def test_gradients_are_each_rows_and_deterministic(selector, fields, device):
    """dq, dk, dv equal those of each row's own call, bit for bit, match float64 autograd over each row's
    tokens, are 0 at the padding, and two backward runs are bitwise equal."""
    spec = _spec(selector, **fields)
    attn = get_kernel(spec)
    q, k, v, do, lens = _batch(torch.float32, device, seed=2)
    given = random_lists(spec, len(LENGTHS), 2, 100, 100, seed=3).to(device) if selector == "given" else None

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        (attn(*leaves, block_idx=given, seqlens=lens) * do).sum().backward()
        return [x.grad for x in leaves]

    got = grads()
    assert all(torch.equal(a, b) for a, b in zip(got, grads())), "two backward runs differ"
    for b, n in enumerate(LENGTHS):
        assert all((g[b, :, n:] == 0).all() for g in got), b
        if n == 0:
            continue
        row = [x[b:b + 1, :, :n].clone().requires_grad_() for x in (q, k, v)]
        row_given = None if given is None else _row_lists(spec, given, b, n)
        (attn(*row, block_idx=row_given) * do[b:b + 1, :, :n]).sum().backward()
        assert all(torch.equal(g[b:b + 1, :, :n], x.grad) for g, x in zip(got, row)), b
        if n == 1:
            continue  # one key: softmax is 1, dq is 0 in exact arithmetic (a relative error has no scale)
        lists = row_given if given is not None else attn.select(*(x.detach() for x in row[:2]))
        want = reference.sparse_attention_grads(*(x.detach() for x in row), do[b:b + 1, :, :n], spec, lists)
        assert_grads_close([g[b:b + 1, :, :n] for g in got], want, torch.float32)


@pytest.mark.parametrize("fields", [{}, PER_QUERY], ids=["q_centric", "kv_centric"])
def test_a_padded_batch_of_few_tokens_is_a_prefill(fields, device):
    """A padded batch of at most 16 positions (the decode calls' size) still selects and attends as a prefill
    does, each row over its own tokens: forward, select and backward run, and match the float64 reference."""
    spec = _spec("mean", **fields)
    attn = get_kernel(spec)
    q, k, v, do, lens = _batch(torch.float32, device, n=16, lengths=(5, 16, 0))
    o, lse = attn(q, k, v, seqlens=lens, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    lists = attn.select(q, k, seqlens=lens)
    for b, n in enumerate((5, 16)):
        assert_valid_selection(lists[b:b + 1, :, :spec.n_q_tiles(n)], q[b:b + 1, :, :n], k[b:b + 1, :, :n], spec)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (attn(*leaves, seqlens=lens) * do).sum().backward()
    assert all((x.grad[2] == 0).all() and x.grad.isfinite().all() for x in leaves)


def test_bad_seqlens_are_refused_by_name(device):
    q, k, v, _, lens = _batch(torch.float32, device, lengths=(5, 3))
    attn = get_kernel(_spec())
    for call, error, words in [
        (lambda: attn(q, k, v, seqlens=lens.long()), KernelgenTypeError, "seqlens must be int32"),
        (lambda: attn(q, k, v, seqlens=lens[:1]), KernelgenValueError, "seqlens must have shape [B]"),
        (lambda: attn(q, k, v, seqlens=[5, 3]), KernelgenTypeError, "seqlens must be a torch.Tensor"),
        (lambda: attn(q, k, v, seqlens=lens, cache_seqlens=lens), KernelgenValueError, "not both"),
        (lambda: attn(q, k, v, seqlens=lens, cache_leftpad=lens), KernelgenValueError,
         "pass seqlens= .* or cache_leftpad= .*, not both"),
        (lambda: attn(q[:, :, :50], k, v, seqlens=lens), KernelgenValueError, "Nq == Nk"),
        (lambda: attn(q, k, v, seqlens=lens, key_reps=attn.key_reps(k)), KernelgenValueError, "no key_reps"),
        (lambda: get_kernel(_spec(causal=False))(q, k, v, seqlens=lens), KernelgenValueError, "causal"),
        (lambda: get_kernel(_spec("index"))(q, k, v, seqlens=lens), KernelgenValueError, "index selector"),
    ]:
        with pytest.raises(error, match=words.replace("[", r"\[")):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_batch_on_gpu(dtype, schedule):
    """Rows of 8192, 5000, 1 and 0 tokens padded to 8192 (128-key blocks, top-16): outputs and gradients equal
    each row's own call, bit for bit, and the backward is deterministic."""
    spec = Spec(head_dim=128, kv_block=128, top_k=16, causal=True, gqa_group=4, local=2, sink=1, schedule=schedule)
    attn = get_kernel(spec)
    q, k, v, do, lens = _batch(dtype, "cuda", 8192, (8192, 5000, 1, 0), heads_kv=2, group=4, head_dim=128)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attn(*leaves, seqlens=lens)
    (o * do).sum().backward()
    again = [x.clone().requires_grad_() for x in (q, k, v)]
    (attn(*again, seqlens=lens) * do).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, again))
    for b, n in enumerate((8192, 5000, 1)):
        row = [x[b:b + 1, :, :n].clone().requires_grad_() for x in (q, k, v)]
        o_row = attn(*row)
        (o_row * do[b:b + 1, :, :n]).sum().backward()
        assert torch.equal(o[b:b + 1, :, :n], o_row), b
        assert all(torch.equal(g.grad[b:b + 1, :, :n], x.grad) for g, x in zip(leaves, row)), b
    assert (o[3] == 0).all() and all((g.grad[3] == 0).all() for g in leaves)

"""The torch.library ops: same results as the eager API, traceable by torch.compile without graph breaks."""
import pytest
import torch

import kernelgen
from kernelgen import Spec
from kernelgen.custom_ops import key_reps, select_blocks, sparse_attention


def inputs(device, dtype=torch.float16):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 130, 64, generator=gen).to(device, dtype)
    k = torch.randn(1, 2, 150, 64, generator=gen).to(device, dtype)
    v = torch.randn(1, 2, 150, 64, generator=gen).to(device, dtype)
    return q, k, v


SPEC = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1)


def test_ops_match_eager(device):
    q, k, v = inputs(device)
    attn = kernelgen.get_kernel(SPEC)
    o, lse = sparse_attention(q, k, v, SPEC)
    eo, else_ = attn(q, k, v, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, else_)
    assert torch.equal(select_blocks(q, k, SPEC), attn.select(q, k))
    idx = attn.select(q, k)
    o2, _ = sparse_attention(q, k, v, SPEC.replace(selector="given"), block_idx=idx, scale=0.1)
    assert torch.equal(o2, attn(q, k, v, block_idx=idx, scale=0.1))


def test_fake_shapes_and_opcheck(device):
    q, k, v = inputs(device)
    idx = select_blocks(q, k, SPEC)
    torch.library.opcheck(torch.ops.kernelgen.select_blocks.default, (q, k, SPEC.to_json()),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kernelgen.sparse_attention.default, (q, k, v, idx, SPEC.to_json(), None),
                          test_utils=("test_schema", "test_faketensor"))
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.kernelgen.sparse_attention.default, (*leaves, None, SPEC.to_json(), 0.2),
                          test_utils=("test_schema", "test_autograd_registration"))
    o, lse, lists = torch.ops.kernelgen.sparse_attention(*leaves, None, SPEC.to_json(), 0.2)
    assert torch.equal(lists, select_blocks(q.float(), k.float(), SPEC))  # the lists the backward reads
    for needs in (None, [True, False, False], [False, True, True]):  # a gradient not needed: an empty tensor
        torch.library.opcheck(torch.ops.kernelgen.sparse_attention_backward.default,
                              (torch.randn_like(o), *(x.detach() for x in leaves), o.detach(), lse, lists,
                               SPEC.to_json(), 0.2, needs), test_utils=("test_schema", "test_faketensor"))


def test_compiles_without_graph_breaks(device):
    q, k, v = inputs(device)

    def layer(q, k, v):
        o, lse = sparse_attention(q, k, v, SPEC)
        return o * 2, lse

    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    o, lse = compiled(q, k, v)
    eo, else_ = kernelgen.get_kernel(SPEC)(q, k, v, return_lse=True)
    assert torch.equal(o, eo * 2) and torch.equal(lse, else_)


def test_the_eager_api_under_compile_runs_the_ops(device):
    """get_kernel(spec)'s call, select() and key_reps() inside torch.compile run the ops (fullgraph, forward and
    backward), as a FlexAttention user writes a model. A kernel with pinned configs, which the ops do not serve (an
    exported module pins them all), and a NumPy scale (traced as a tensor) run eagerly outside the graph: a graph
    break, which fullgraph=True refuses giving that reason."""
    import numpy as np

    attn = kernelgen.get_kernel(SPEC)

    def layer(q, k, v):
        o, lse = attn(q, k, v, return_lse=True, scale=0.1)
        return o * 2, lse, attn.select(q, k), attn.key_reps(k).reps

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = (x.detach().requires_grad_() for x in inputs(device))
    o, lse, lists, reps = compiled(q, k, v)
    o.backward(torch.ones_like(o))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    eo, else_ = attn(*leaves, return_lse=True, scale=0.1)
    (eo * 2).backward(torch.ones_like(eo))
    assert torch.equal(o, eo * 2) and torch.equal(lse, else_)
    assert torch.equal(lists, attn.select(q, k)) and torch.equal(reps, attn.key_reps(k).reps)
    for got, want in zip((q, k, v), leaves):
        assert torch.equal(got.grad, want.grad)
    q, k, v = inputs(device)
    config = attn.config("attn", q.shape[2], k.shape[2], q.dtype, q.device)
    pinned = kernelgen.get_kernel(SPEC, configs={"attn": config, "select": attn.config("select", q.shape[2],
                                                                                        k.shape[2], q.dtype, q.device)})
    with pytest.raises(Exception, match="a call with pinned configs .* runs outside the graph"):
        torch.compile(lambda q, k, v: pinned(q, k, v), fullgraph=True, backend="eager")(q, k, v)
    with pytest.raises(Exception, match="a scale that is not a Python float runs outside the graph"):
        torch.compile(lambda q, k, v: attn(q, k, v, scale=np.float32(0.1)), fullgraph=True, backend="eager")(q, k, v)

    def pinned_layer(q, k, v):
        return pinned(q, k, v) * 2, pinned.select(q, k), pinned.key_reps(k).reps, attn(q, k, v, scale=np.float32(.5))

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o, lists, reps, o_numpy = torch.compile(pinned_layer, backend="aot_eager")(*leaves)
    o.sum().backward()
    assert torch.equal(o, attn(q, k, v) * 2) and torch.equal(o_numpy, attn(q, k, v, scale=0.5))
    assert torch.equal(lists, attn.select(q, k)) and torch.equal(reps, attn.key_reps(k).reps)
    eager = [x.detach().requires_grad_() for x in (q, k, v)]
    (pinned(*eager) * 2).sum().backward()
    assert all(torch.equal(got.grad, want.grad) for got, want in zip(leaves, eager))


def test_one_compiled_function_over_kernels_of_several_specs(device):
    """A function compiled once and called with kernels of specs that differ in an int (layers of different
    top_k or kv_block sharing one attention function): dynamo makes such ints symbolic on its recompile, so the
    ops get the spec as text, which it keeps static. Each call is its kernel's eager one."""
    q, k, v = inputs(device)
    call = torch.compile(lambda attn, q, k, v: (attn(q, k, v), attn.select(q, k), attn.key_reps(k).reps),
                         backend="aot_eager", fullgraph=True)
    for fields in ({"top_k": 2}, {"top_k": 3}, {"top_k": 4, "kv_block": 16}):
        attn = kernelgen.get_kernel(SPEC.replace(**fields))
        o, lists, reps = call(attn, q, k, v)
        assert torch.equal(o, attn(q, k, v)) and torch.equal(lists, attn.select(q, k)), fields
        assert torch.equal(reps, attn.key_reps(k).reps), fields


def test_prepare_inside_compile_runs_outside_the_graph_and_prepared_lists_pass_in(device):
    """attn.prepare reads the lists on the host: inside torch.compile it runs eagerly, a graph break that
    fullgraph=True refuses naming it (dynamo's own error was about json's encoder, and without fullgraph the
    interpreter's kernels were traced with fake tensors); lists prepared outside pass into the compiled call, which
    equals the eager one. select() over a padded batch's rows breaks the graph the same way."""
    spec = SPEC.replace(selector="given")
    attn = kernelgen.get_kernel(spec)
    q, k, v = inputs(device)
    idx = torch.randint(-1, spec.n_kv_blocks(k.shape[2]), (q.shape[0], k.shape[1], spec.n_q_tiles(q.shape[2]),
                                                          spec.top_k), dtype=torch.int32, device=device)
    lists = attn.prepare(idx, q.shape[2], k.shape[2])
    expected = attn(q, k, v, block_idx=lists)

    def prepared_inside(q, k, v):
        return attn(q, k, v, block_idx=attn.prepare(idx, q.shape[2], k.shape[2]))

    with pytest.raises(Exception, match="attn.prepare reads the lists on the host"):
        torch.compile(prepared_inside, fullgraph=True, backend="eager")(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(prepared_inside, backend="aot_eager")(q, k, v), expected)
    compiled = torch.compile(lambda q, k, v: attn(q, k, v, block_idx=lists), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), expected)

    selecting, k = kernelgen.get_kernel(SPEC), k[:, :, :q.shape[2]]  # a padded batch's self-attention
    lens = torch.tensor([q.shape[2] - 5] * q.shape[0], dtype=torch.int32, device=device)
    with pytest.raises(Exception, match=r"select\(\) over a cache's or a padded batch's rows .* runs eagerly"):
        torch.compile(lambda q, k: selecting.select(q, k, seqlens=lens), fullgraph=True, backend="eager")(q, k)
    torch._dynamo.reset()
    selected = torch.compile(lambda q, k: selecting.select(q, k, seqlens=lens), backend="aot_eager")(q, k)
    assert torch.equal(selected, selecting.select(q, k, seqlens=lens))


def test_get_kernel_inside_a_compiled_region(device):
    """get_kernel(spec) written inside a fullgraph region reads the spec's cached callable (no graph break, even
    for a Spec made there); a spec not built before compiling is built outside the graph: a graph break that
    fullgraph=True refuses naming what to do, and without fullgraph it runs."""
    q, k, v = inputs(device)
    expected = kernelgen.get_kernel(SPEC)(q, k, v)

    def layer(q, k, v):
        return kernelgen.get_kernel(Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2,
                                         local=1))(q, k, v)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v), expected)
    unbuilt = SPEC.replace(top_k=SPEC.top_k + 1)
    kernelgen.dispatch._kernels.pop((unbuilt, False), None)
    with pytest.raises(Exception, match=r"call get_kernel\(spec\) before compiling"):
        torch.compile(lambda q, k, v: kernelgen.get_kernel(unbuilt)(q, k, v), fullgraph=True,
                      backend="eager")(q, k, v)
    torch._dynamo.reset()
    kernelgen.dispatch._kernels.pop((unbuilt, False), None)
    o = torch.compile(lambda q, k, v: kernelgen.get_kernel(unbuilt)(q, k, v), backend="aot_eager")(q, k, v)
    assert torch.equal(o, kernelgen.get_kernel(unbuilt)(q, k, v))


def test_compiles_with_dynamic_lengths_and_backpropagates(device):
    """torch.compile(dynamic=True), as a model sees prompts of many lengths: one graph, forward and backward
    (aot_eager traces the backward too), bit-equal to the eager calls at each length."""

    def layer(q, k, v):
        o, lse = sparse_attention(q, k, v, SPEC)
        return o * 2, lse

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (97, 130):
        q, k, v = (x[:, :, :n].detach().requires_grad_() for x in inputs(device))
        o, lse = compiled(q, k, v)
        o.backward(torch.ones_like(o))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        eo, else_ = kernelgen.get_kernel(SPEC)(*leaves, return_lse=True)
        (eo * 2).backward(torch.ones_like(eo))
        assert torch.equal(o, eo * 2) and torch.equal(lse, else_)
        for got, want in zip((q, k, v), leaves):
            assert torch.equal(got.grad, want.grad)


def test_a_decode_over_per_row_lengths_compiles(device):
    """cache_seqlens through the op: fullgraph, bit-equal to the eager call; with grad it is refused by name."""
    q, k, v = inputs(device)
    q = q[:, :, -2:]
    lens = torch.tensor([77], dtype=torch.int32, device=device)
    compiled = torch.compile(lambda q, k, v, lens: sparse_attention(q, k, v, SPEC, cache_seqlens=lens),
                             fullgraph=True, backend="eager")
    o, lse = compiled(q, k, v, lens)
    eo, else_ = kernelgen.get_kernel(SPEC)(q, k, v, cache_seqlens=lens, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, else_)
    assert torch.equal(o, kernelgen.get_kernel(SPEC)(q, k[:, :, :77], v[:, :, :77]))
    pads = torch.tensor([30], dtype=torch.int32, device=device)  # left padding: the keys from 30 on
    compiled = torch.compile(lambda q, k, v, lens, pads: sparse_attention(q, k, v, SPEC, cache_seqlens=lens,
                                                                          cache_leftpad=pads),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v, lens, pads)[0], kernelgen.get_kernel(SPEC)(q, k[:, :, 30:77], v[:, :, 30:77]))
    try:
        sparse_attention(q.requires_grad_(), k, v, SPEC, cache_seqlens=lens)
    except kernelgen.KernelgenError as error:
        assert "no backward" in str(error)
    else:
        raise AssertionError("a differentiable call with cache_seqlens was not refused")


def test_a_padded_batch_compiles_forward_and_backward(device):
    """seqlens through the op: fullgraph, o and the gradients bit-equal to the eager call's."""
    q, k, v = inputs(device)
    q, k, v = (torch.cat([x[:, :, :130], x[:, :, :130].flip(2)]) for x in (q, k, v))  # self-attention: Nq == Nk
    lens = torch.tensor([77, 20], dtype=torch.int32, device=device)
    compiled = torch.compile(lambda q, k, v, lens: sparse_attention(q, k, v, SPEC, seqlens=lens)[0],
                             fullgraph=True, backend="aot_eager")
    outputs = []
    for call in (compiled, lambda q, k, v, lens: kernelgen.get_kernel(SPEC)(q, k, v, seqlens=lens)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = call(*leaves, lens)
        o.square().sum().backward()
        outputs.append((o, *(x.grad for x in leaves)))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    assert (outputs[0][0][1, :, 20:] == 0).all() and (outputs[0][2][1, :, 20:] == 0).all()


def test_key_reps_through_the_ops(device):
    """The selector's kept reps as ops: made, grown in place over per-row lengths and read by the attention op,
    fullgraph; the same bits and outputs as the eager API's."""
    q, k, v = inputs(device)
    q = q[:, :, -1:]
    attn = kernelgen.get_kernel(SPEC)
    lens = torch.tensor([70], dtype=torch.int32, device=device)

    def step(q, k, v, lens, reps):
        reps = key_reps(k, SPEC, cache_seqlens=lens, previous=reps)
        return sparse_attention(q, k, v, SPEC, cache_seqlens=lens, key_reps=reps)[0]

    reps = key_reps(k, SPEC, cache_seqlens=lens)
    want = attn.key_reps(k, cache_seqlens=lens)
    assert torch.equal(reps.reps, want.reps) and torch.equal(reps.seqlens, want.seqlens)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lens += 9
    o = compiled(q, k, v, lens, reps)
    assert torch.equal(reps.seqlens, torch.full_like(want.seqlens, 79))  # grown in place
    assert torch.equal(reps.reps[:, :, :3], attn.key_reps(k, cache_seqlens=lens).reps[:, :, :3])
    assert torch.equal(o, attn(q, k, v, cache_seqlens=lens))
    plain = key_reps(k[:, :, :100], SPEC)  # one length: made, then extended
    assert plain.seqlens is None and torch.equal(key_reps(k, SPEC, previous=plain).reps, attn.key_reps(k).reps)
    o, _ = torch.compile(lambda q, k, v, r: sparse_attention(q, k, v, SPEC, key_reps=r), fullgraph=True,
                         backend="eager")(q, k, v, attn.key_reps(k))
    assert torch.equal(o, attn(q, k, v))
    torch.library.opcheck(torch.ops.kernelgen.key_reps.default, (k, SPEC.to_json(), lens),
                          test_utils=("test_schema", "test_faketensor"))
    pads = torch.tensor([64], dtype=torch.int32, device=device)  # left padding, grown through the op in place
    compiled(q, k, v, lens, reps)
    padded = torch.compile(lambda k, lens, pads, reps: key_reps(k, SPEC, cache_seqlens=lens, previous=reps,
                                                                cache_leftpad=pads), fullgraph=True, backend="eager")
    padded(k, lens, pads, reps)
    assert reps.seqlens.flatten().tolist() == [79 - 64] * reps.seqlens.numel() and (reps.leftpad == 64).all()
    assert torch.equal(reps.reps[:, :, :1], attn.key_reps(k, cache_seqlens=lens, cache_leftpad=pads).reps[:, :, :1])
    torch.library.opcheck(torch.ops.kernelgen.key_reps.default, (k, SPEC.to_json(), lens, None, 0, pads),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(TypeError, match="previous must be the KeyReps"):
        key_reps(k, SPEC, previous=reps.reps)
    with pytest.raises(ValueError, match="made without cache_seqlens"):
        key_reps(k, SPEC, cache_seqlens=lens, previous=plain)


def test_key_reps_of_per_row_lengths_grow_into_a_longer_cache(device):
    """A cache of per-row lengths that grew into a longer tensor: the op gives reps with room for its new blocks,
    grown to the rows (the eager call's bits), compiled too; the attention op reads them."""
    q, k, v = inputs(device)
    q = q[:, :, -1:]
    attn = kernelgen.get_kernel(SPEC)
    short, lens = k[:, :, :96].contiguous(), torch.tensor([70], dtype=torch.int32, device=device)
    reps = key_reps(short, SPEC, cache_seqlens=lens)
    lens += 50  # past the short cache's 96 keys

    def grow(k, lens, reps):
        return key_reps(k, SPEC, cache_seqlens=lens, previous=reps).reps

    grown = torch.compile(grow, fullgraph=True, backend="eager")(k, lens, reps)
    want = attn.key_reps(k, cache_seqlens=lens)
    assert grown.shape == want.reps.shape and torch.equal(grown, want.reps)
    bigger = key_reps(k, SPEC, cache_seqlens=lens, previous=key_reps(short, SPEC, cache_seqlens=lens - 50))
    assert bigger.n_k == k.shape[2] and torch.equal(bigger.seqlens, want.seqlens)
    assert torch.equal(sparse_attention(q, k, v, SPEC, cache_seqlens=lens, key_reps=bigger)[0],
                       attn(q, k, v, cache_seqlens=lens))


def test_a_spec_that_is_not_one_is_refused_by_name(device):
    q, k, v = inputs(device)
    with pytest.raises(ValueError, match="spec is not a Spec's JSON text"):
        sparse_attention(q, k, v, "{not json")
    with pytest.raises(TypeError, match="spec must be a Spec or its JSON text"):
        key_reps(k, 64)
    o, _ = sparse_attention(q, k, v, SPEC.to_json())
    assert torch.equal(o, sparse_attention(q, k, v, SPEC)[0])


@pytest.mark.gpu
def test_a_spec_object_compiles_on_the_gpu():
    """torch.compile(fullgraph=True) of the ops given a Spec object (not its JSON text) on the GPU's torch: its
    dynamo cannot hand a frozen dataclass instance to a constant function, so the ops pass its fields."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=3, causal=True, gqa_group=2)
    q, k, v = (x.cuda() for x in inputs("cpu", torch.bfloat16))
    compiled = torch.compile(lambda q, k, v: sparse_attention(q, k, v, spec)[0], fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), kernelgen.get_kernel(spec)(q, k, v))


def test_prepared_lists_go_through_the_op(device):
    """attn.prepare's lists through the op (eager and fullgraph): their normalised ids, the raw lists' result."""
    q, k, v = inputs(device)
    given = SPEC.replace(selector="given")
    idx = kernelgen.get_kernel(SPEC).select(q, k)
    prepared = kernelgen.get_kernel(given).prepare(idx, 130, 150)
    expected = sparse_attention(q, k, v, given, block_idx=idx)
    assert all(torch.equal(a, b) for a, b in zip(sparse_attention(q, k, v, given, block_idx=prepared), expected))
    compiled = torch.compile(lambda q, k, v, lists: sparse_attention(q, k, v, given, block_idx=lists)[0],
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v, prepared), expected[0])


def test_a_scale_that_is_not_a_real_scalar_is_refused_as_the_eager_call_refuses_it(device):
    """A tensor scale (a learnable temperature) is a TypeError, as in the eager call: float() would take its value
    and silently drop its gradient. So are a bool and a string; a NumPy scalar is taken."""
    import numpy as np

    q, k, v = inputs(device, torch.float32)
    for scale in (torch.tensor(0.1, requires_grad=True), torch.tensor(0.1), True, "0.1"):
        with pytest.raises(TypeError, match="scale must be a finite real number") as op_error:
            sparse_attention(q, k, v, SPEC, scale=scale)
        with pytest.raises(TypeError, match="scale must be a finite real number") as eager_error:
            kernelgen.get_kernel(SPEC)(q, k, v, scale=scale)
        assert str(op_error.value) == str(eager_error.value)
    assert torch.equal(sparse_attention(q, k, v, SPEC, scale=np.float32(0.25))[0],
                       kernelgen.get_kernel(SPEC)(q, k, v, scale=0.25))


@pytest.mark.parametrize("frozen", ["q", "kv"])
def test_the_op_s_backward_computes_only_the_gradients_its_inputs_need(frozen, device, roles):
    """A frozen q (or frozen k and v) launches no dQ (no dK/dV) kernel, as in the eager call's backward; the
    gradients that are needed are the eager call's, bit for bit, eager and compiled."""
    needs = (frozen != "q", frozen != "kv", frozen != "kv")
    q, k, v = inputs(device, torch.float32)
    do = torch.randn_like(q)
    compiled = torch.compile(lambda q, k, v: sparse_attention(q, k, v, SPEC)[0], fullgraph=True, backend="aot_eager")
    results = []
    for call in (lambda q, k, v: sparse_attention(q, k, v, SPEC)[0], compiled, kernelgen.get_kernel(SPEC)):
        leaves = [x.clone().requires_grad_(need) for x, need in zip((q, k, v), needs)]
        roles.clear()
        call(*leaves).backward(do)
        assert roles["bwd_dq" if frozen == "q" else "bwd_dkdv"] == 0, roles
        assert roles["bwd_dkdv" if frozen == "q" else "bwd_dq"] == 1, roles
        results.append([x.grad for x in leaves])
    for grads in results[:2]:
        for got, want, need in zip(grads, results[2], needs):
            assert (got is None and want is None) if not need else torch.equal(got, want)


def test_kept_reps_of_another_capacity_are_refused_before_they_grow(device):
    """Reps of per-row lengths made for a cache of another capacity: the op names their n_k as the eager call does,
    and leaves them as they were (the growth is not run for a call that is refused)."""
    q, k, v = inputs(device)
    q = q[:, :, -1:]
    lens = torch.tensor([40], dtype=torch.int32, device=device)
    for capacity, words in ((k.shape[2] - 16, "grow them"), (k.shape[2] - 4, "grow them"),
                            (k.shape[2] + 16, "make them for this k")):
        cache = torch.cat([k, k], 2)[:, :, :capacity].contiguous()
        reps = key_reps(cache, SPEC, cache_seqlens=lens)
        before = reps.seqlens.clone()
        with pytest.raises(ValueError, match=f"key_reps were made for n_k = {capacity} keys but k has "
                                             f"{k.shape[2]}: {words}"):
            sparse_attention(q, k, v, SPEC, cache_seqlens=lens + 7, key_reps=reps)
        assert torch.equal(reps.seqlens, before)

"""kernelgen as a transformers attention implementation for a model with attention sinks (transformers' `s_aux=`):
a tiny gpt-oss built in code (2 experts, no downloads), fp32 in the CPU interpreter, against the same weights under
attn_implementation="eager", which applies the sinks. Its full-attention layers are kernelgen's (`sinks=` on every
call, eager and compiled), and so are its sliding-window layers' prompts (a window spec: test_transformers_window.py);
the calls kernelgen cannot compute run the model's own eager attention (SDPA would ignore the sinks)."""
import re
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelgen.integrations import transformers as kg_hf  # noqa: E402
from test_transformers import (  # noqa: E402,F401
    VOCAB, assert_close, compiled, left_padded, small_select_tiles, tokens, training_steps)

LAYERS = ("full_attention", "sliding_attention")
SCALE = 0.125


def tiny_gpt_oss(layer_types=LAYERS, **options):
    """A layer of each type (a window of 16 keys), 4 query heads over 2 KV heads, head_dim 64, 2 experts; 16-key
    blocks."""
    options = {"kernelgen_kv_block": 16, "kernelgen_q_tile": 16, **options}
    return transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, num_hidden_layers=len(layer_types),
                                     layer_types=list(layer_types), sliding_window=16, num_local_experts=2,
                                     num_experts_per_tok=1, vocab_size=VOCAB, initializer_range=0.2, pad_token_id=0,
                                     **options)


def gpt_oss_pair(layer_types=LAYERS):
    """(kernelgen model, eager model) with the same weights, each layer's sinks logits from -1 to 3 (gpt-oss's init
    gives them about 0.2, and negative ones fade as a row sees more keys: too little to tell a model that drops
    them)."""
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(tiny_gpt_oss(layer_types), attn_implementation="eager")
    with torch.no_grad():
        for i, layer in enumerate(eager.model.layers):
            layer.self_attn.sinks.copy_(torch.tensor([2.5, -1.0, 1.0, 3.0]).roll(i))
    ours = transformers.AutoModelForCausalLM.from_config(tiny_gpt_oss(layer_types), attn_implementation="kernelgen")
    ours.load_state_dict(eager.state_dict())
    return ours.eval(), eager.eval()


@pytest.fixture(scope="module")
def models():
    patch = pytest.MonkeyPatch()
    patch.setattr(kg_hf, "get_kernel", small_select_tiles)
    yield gpt_oss_pair()
    patch.undo()


def test_a_prompt_matches_eager(models, roles):
    """top_k covers every block (4 of 16 keys hold 50 tokens): the full layer's kernelgen call with the sinks is
    eager's dense attention with them; the sliding layer runs kernelgen's window spec, with no warning."""
    ours, eager = models
    ours.config.kernelgen_top_k = 4
    ids = tokens(2, 50)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids).logits
        want = eager(ids).logits
    assert roles["attn"] == 2  # a call a layer: the full-attention one, the sliding one (50 tokens, a window of 16)
    assert_close(got, want)


def test_backward_gives_the_sinks_their_gradient(models, roles):
    """A training step through kernelgen's forward and backward: the sinks' gradients (both layers'), and the
    queries', are eager's."""
    ours, eager = models
    ours.config.kernelgen_top_k = 3
    ids = tokens(1, 48, seed=4)
    grads = []
    for model in (ours, eager):
        model.train()
        model.zero_grad()
        try:
            model(ids, labels=ids).loss.backward()
        finally:
            model.eval()
        grads.append([p.grad.clone() for p in (*(layer.self_attn.sinks for layer in model.model.layers),
                                               model.model.layers[0].self_attn.q_proj.weight)])
        model.zero_grad()
    assert roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2  # both layers' (the sliding one: its window spec)
    for got, want in zip(*grads):
        assert want.abs().max() > 0
        assert_close(got, want, tol=1e-3)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["whole", "left_padded"])
def test_generate_matches_eager(models, roles, cache, padded):
    """generate() over a cache, from a batch of whole prompts or left-padded ones: the tokens and each step's logits
    are eager's. The full layer's prompt is one kernelgen call (a padded one too: with sinks, which SDPA would ignore,
    no dense SDPA call in its place), each decode step one; the sliding layer's prompt is one (its window spec, a
    padded one with `seqlens`), and so is each of its decode steps (its window over the cached keys)."""
    ours, eager = models
    ours.config.kernelgen_top_k = 3  # every block of the 48 keys
    ids, mask = left_padded([tokens(1, n, seed=20 + i) for i, n in enumerate((45, 30 if padded else 45))])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        out = [model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, cache_implementation=cache) for model in (ours, eager)]
    assert roles["attn"] == 2 and roles["decode"] == 4  # the prompt, then two single-token steps of both layers
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert_close(torch.stack(out[0].logits), torch.stack(out[1].logits))


def test_a_sliding_layer_with_top_k_0_runs_eager_quietly(models, roles, monkeypatch):
    """A sliding layer whose options say top_k 0 is not kernelgen's: its calls run the model's eager attention, which
    applies the sinks and the window, with no warning."""
    ours, eager = models
    ours.config.kernelgen_top_k = 4
    monkeypatch.setattr(ours.config, "kernelgen", {"layer_types": {"sliding_attention": {"top_k": 0}}},
                        raising=False)
    ids = tokens(1, 50, seed=1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids).logits
        want = eager(ids).logits
    assert roles["attn"] == 1  # the full-attention layer alone
    assert_close(got, want)


class NoEagerAttention(torch.nn.Module):
    """An attention module whose modeling file (this one) has no eager_attention_forward."""
    is_causal = True

    def __init__(self, config):
        super().__init__()
        self.config, self.layer_idx, self.num_key_value_groups = config, 0, 2
        self.sinks = torch.nn.Parameter(torch.zeros(4))


def test_what_kernelgen_cannot_compute_runs_the_models_eager_attention(models):
    """A call with sinks that kernelgen cannot compute runs the model's eager_attention_forward (with a warning once
    per reason), given the additive mask transformers' eager attention takes for SDPA's reading of the mask: no mask
    is causal (every key for one query), a boolean one allows its True entries. Sinks that are not one logit per
    query head are such a call. A module whose file has no eager_attention_forward is a ValueError."""
    attn = models[0].model.layers[0].self_attn
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    q, k, v = torch.randn(2, 4, 20, 64), torch.randn(2, 2, 20, 64), torch.randn(2, 2, 20, 64)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    padded = causal & torch.arange(20).ge(torch.tensor([0, 3])[:, None])[:, None, None, :]

    def additive(allowed):
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)

    kg_hf._warned.clear()
    for inputs, mask, kwargs, want_mask, reason in (
            ((q, k, v), None, {"output_attentions": True}, additive(causal), "output_attentions"),
            ((q[:, :, -1:], k, v), None, {"output_attentions": True}, None, None),  # one query: every key
            ((q, k, v), padded, {"output_attentions": True}, additive(padded), None),
            ((q, k, v), None, {"is_causal": False}, None, "non-causal"),
            ((q, k, v), padded, {"s_aux": attn.sinks[:, None]}, additive(padded), r"sinks of shape \(4, 1\)")):
        kwargs = {"s_aux": attn.sinks, **kwargs}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kg_hf.KernelgenFallbackWarning)
            got = kg_hf.attention_forward(attn, *inputs, mask, scaling=SCALE, **kwargs)
        if reason is not None:
            assert len(caught) == 1 and caught[0].category is kg_hf.KernelgenFallbackWarning, caught
            assert re.search(f"{reason}.*; such calls run the model's eager attention", str(caught[0].message))
        else:
            assert not caught  # the same reason again: warned once
        want = eager(attn, *inputs, want_mask, scaling=SCALE)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    stub = NoEagerAttention(attn.config)
    with pytest.raises(ValueError, match="s_aux=.*no eager_attention_forward.*attn_implementation=\"eager\""):
        kg_hf.attention_forward(stub, q, k, v, None, scaling=SCALE, dropout=0.1, s_aux=stub.sinks)


def reference(attn, q, k, v, allowed):
    """gpt-oss's eager attention [B, N, H, D] over the keys `allowed` ([B or 1, 1, Nq, Nk] bool) sees."""
    mask = torch.where(allowed, 0.0, torch.finfo(q.dtype).min)
    return sys.modules[type(attn).__module__].eager_attention_forward(attn, q, k, v, mask, scaling=SCALE)[0]


def call_forms():
    """(name, q, k, v, mask, kwargs, allowed, real): each kind of call the integration makes kernelgen compute, with
    what each query sees and which queries' outputs count (a padding query's are 0 in kernelgen's, not eager's)."""
    g = torch.Generator().manual_seed(7)
    n = 40

    def qkv(n_q, n_k=None):
        n_k = n_q if n_k is None else n_k
        return (torch.randn(2, 4, n_q, 64, generator=g), torch.randn(2, 2, n_k, 64, generator=g),
                torch.randn(2, 2, n_k, 64, generator=g))

    keys = torch.arange(n)
    causal = (keys[None, :] <= keys[:, None])[None, None]
    every = torch.ones(2, n, dtype=torch.bool)
    forms = [("causal", *qkv(n), None, {}, causal.expand(2, -1, -1, -1), every)]
    # a padded prompt: row 0 right-padded after 30 tokens, row 1 left-padded by 6 (`seqlens`)
    first, end = torch.tensor([0, 6]), torch.tensor([30, n])
    tokens_ = (keys >= first[:, None]) & (keys < end[:, None])
    padded = causal & tokens_[:, None, None, :]
    forms.append(("padded", *qkv(n), padded, {}, padded, tokens_))
    # packed sequences (FlashAttention's varlen kwargs): 17 + 23 tokens in row 0, 12 + 28 in row 1
    bounds = torch.tensor([0, 17, 40, 52, 80], dtype=torch.int32)
    sequence = torch.searchsorted(bounds, torch.arange(2 * n, dtype=torch.int32), right=True).view(2, n)
    packed = causal & (sequence[:, :, None] == sequence[:, None, :])[:, None]
    varlen = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 28, "max_length_k": 28}
    forms.append(("packed", *qkv(n), None, varlen, packed, every))
    # decode: 2 queries after 38 keys of a 48-key static cache, row 1 left-padded by 5 (`cache_leftpad`)
    cache = torch.arange(48)
    at = (cache <= torch.arange(38, 40)[:, None])[None, None] & (cache >= torch.tensor([0, 5])[:, None])[:, None, None]
    forms.append(("decode", *qkv(2, 48), at, {}, at, torch.ones(2, 2, dtype=torch.bool)))
    forms.append(("one_query", *qkv(1, 30), None, {}, torch.ones(1, 1, 1, 30, dtype=torch.bool),
                  torch.ones(2, 1, dtype=torch.bool)))
    return forms


@pytest.mark.parametrize("form", [f[0] for f in call_forms()])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_each_call_form_joins_the_sinks(models, roles, compiled, form, compile):
    """attention_forward with gpt-oss's sinks, top_k covering every block, on each call form kernelgen computes (no
    mask; a padded prompt; packed sequences; a decode step over a left-padded static cache; one query), eagerly and
    inside torch.compile(fullgraph=True) (the custom op, the sinks joined after it): each real query's output and
    the sinks' gradient (and the queries', where the call has a backward) are eager's."""
    ours, _ = models
    ours.config.kernelgen_top_k = 3
    attn = ours.model.layers[0].self_attn
    _, q, k, v, mask, kwargs, allowed, real = next(f for f in call_forms() if f[0] == form)

    def call(q, k, v, mask):
        return kg_hf.attention_forward(attn, q, k, v, mask, scaling=SCALE, s_aux=attn.sinks, **kwargs)[0]

    if compile:
        call = compiled(call)
    leaves = (attn.sinks,) if form == "decode" else (attn.sinks, q)  # a call over a cache has no backward to q
    q.requires_grad_(form != "decode")
    with warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = call(q, k, v, mask)
    assert sum(roles.values()) > 0  # kernelgen's kernels ran
    want = reference(attn, q, k, v, allowed)
    real = real[:, :, None, None]
    assert_close(got * real, want * real)
    assert not (got * ~real).any()  # a padding query's output is 0
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)) * real
    grads = [torch.autograd.grad((o * weights).sum(), leaves) for o in (got, want)]
    for got_grad, want_grad in zip(*grads):
        assert_close(got_grad, want_grad, tol=1e-3)


def test_a_compiled_training_step_runs_in_the_graph(compiled, roles, monkeypatch):
    """torch.compile(fullgraph=True) of a training step of a gpt-oss whose layers are all kernelgen's, over a padded
    batch: the sinks join each layer's call inside the graph; the loss and the sinks' gradients are eager's."""
    monkeypatch.setattr(kg_hf, "get_kernel", small_select_tiles)
    ours, eager = gpt_oss_pair(("full_attention",) * 2)
    ours.config.kernelgen_top_k = 3
    ids, mask = left_padded([tokens(1, n, seed=50 + i) for i, n in enumerate((48, 33))])
    labels = torch.where(mask.bool(), ids, -100)
    mask[0, 40:], labels[0, 40:] = 0, -100  # right padding too
    results = training_steps(ours, eager, compiled, ids, mask, labels,
                             lambda model: [layer.self_attn.sinks.grad.clone() for layer in model.model.layers])
    assert roles["attn"] == 2 and roles["bwd_dq"] == 2  # ours: one call a layer, inside the graph
    for got, want in zip(*results):
        assert_close(got, want, tol=1e-3)

"""kernelgen as a transformers attention implementation for a model with logit soft-capping (Gemma 2's
`attn_logit_softcapping`, transformers' `softcap=`): a tiny Gemma 2 built in code (a sliding and a full layer, no
downloads), fp32 in the CPU interpreter, against the same weights under attn_implementation="eager", which applies the
cap. Both layers are kernelgen's, their specs capped (`Spec.softcap`); the calls kernelgen cannot compute run the
model's own eager attention (SDPA would not cap)."""
import copy
import re
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernelgen.custom_ops  # noqa: E402
from kernelgen import Spec  # noqa: E402
from kernelgen.errors import KernelgenValueError  # noqa: E402
from kernelgen.integrations import transformers as kg_hf  # noqa: E402
from kernelgen.tuning.model import layer_type_specs, model_specs, model_studies  # noqa: E402
from test_transformers import (  # noqa: E402,F401
    VOCAB, assert_close, compiled, left_padded, small_select_tiles, tokens, training_steps)
from test_transformers_window import fell_back, pair, quiet, served  # noqa: E402,F401

CAP = 2.0  # small: these scores reach it, so that the cap changes the logits
WINDOW = 16
LAYERS = ("sliding_attention", "full_attention")  # Gemma 2's alternation
SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": VOCAB, "initializer_range": 0.3, "pad_token_id": 0, "sliding_window": WINDOW,
         "attn_logit_softcapping": CAP, "kernelgen_kv_block": 16, "kernelgen_q_tile": 16, "kernelgen_top_k": 4}


def gemma2_config(layer_types=LAYERS, **options):
    """A layer of each type, 4 query heads over 2 KV heads, head_dim 64, a window of 16 keys; 16-key blocks, top_k 4
    (every block of up to 64 keys: dense, so that the full layer's attention is eager's)."""
    return transformers.Gemma2Config(**{**SMALL, "num_hidden_layers": len(layer_types),
                                        "layer_types": list(layer_types), **options})


def capped(window=None, **fields):
    """The spec a layer of these models is served: the full layer's, or the sliding layer's (`window`: its lists the
    window's blocks), capped at CAP."""
    fields = {"head_dim": 64, "kv_block": 16, "q_tile": 16, "gqa_group": 2, "causal": True, "softcap": CAP, **fields}
    if window is None:
        return Spec(**{"top_k": 4, "local": 1, **fields})
    return Spec(**fields, window=window, top_k=Spec(**fields, window=window, selector="given", top_k=1).window_blocks)


def gemma2_pair(layer_types=LAYERS):
    """(kernelgen model, eager model) with the same weights."""
    return pair(gemma2_config(layer_types))


@pytest.fixture(scope="module")
def models():
    patch = pytest.MonkeyPatch()
    patch.setattr(kg_hf, "get_kernel", small_select_tiles)
    yield gemma2_pair()
    patch.undo()


def assert_capped_calls(served):
    """Every kernel the integration served was a layer's capped spec, and each ran."""
    assert served and set(served) <= {capped(), capped(WINDOW)}, served
    assert {spec for spec, _, _ in served.calls} == set(served)


# ---- the specs ---------------------------------------------------------------------------------------------

def test_every_layers_spec_is_capped():
    """attn_logit_softcapping caps every kernelgen layer's spec, the sliding layers' window specs too; a backend that
    cannot cap (TileLang, Gluon) gives Triton; `kernelgen tune --model` tunes those specs (on the backends that cap).
    A config without it (Gemma 3's None) gives specs without a cap; the KV-centric schedule and a cap that is not a
    positive number are refused."""
    config = gemma2_config()
    assert kg_hf.layer_spec(config) == capped()
    assert kg_hf.layer_spec(config, "sliding_attention") == capped(WINDOW)
    assert model_specs(config.to_dict()) == [("sliding_attention", capped(WINDOW)), ("full_attention", capped())]
    for backend in ("tilelang", "gluon"):
        served = gemma2_config(kernelgen_backend=backend)
        assert kg_hf.layer_spec(served) == capped(backend="triton")
        assert kg_hf.layer_spec(served, "sliding_attention") == capped(WINDOW, backend="triton")
    assert kg_hf.layer_spec(gemma2_config(kernelgen_backend="auto")).backend == "auto"  # auto serves Triton
    studies = list(model_studies(config.to_dict(), 4096, 2, "sm_90"))
    assert studies and all(study.spec.softcap == CAP for study in studies)
    assert {study.spec.backend for study in studies} == {"triton"}
    uncapped = gemma2_config(attn_logit_softcapping=None)
    assert kg_hf.layer_spec(uncapped) == capped(softcap=None)
    assert kg_hf.layer_spec(uncapped, "sliding_attention") == capped(WINDOW, softcap=None)
    gemma3 = transformers.Gemma3TextConfig(**{**SMALL, "attn_logit_softcapping": None})
    assert all(spec is None or spec.softcap is None for spec in layer_type_specs(gemma3.to_dict()).values())
    assert kg_hf.layer_spec(gemma3).softcap is None
    with pytest.raises(KernelgenValueError, match="attn_logit_softcapping=2.0 with schedule 'kv_centric'"):
        kg_hf.layer_spec(gemma2_config(kernelgen_schedule="kv_centric", kernelgen_q_tile=None))
    for bad in (0, -1.0, "50", True):
        with pytest.raises(KernelgenValueError, match="attn_logit_softcapping must be a positive number"):
            model_specs({**config.to_dict(), "attn_logit_softcapping": bad})


# ---- the model against eager -------------------------------------------------------------------------------

def test_a_prompt_matches_eager(models, served, fell_back, roles):
    """A prompt (2 rows of 48 tokens, a window of 16): both layers run kernelgen with their capped specs, no call falls
    back, no warning; the logits are eager's."""
    ours, eager = models
    ids = tokens(2, 48, seed=3)
    with torch.no_grad(), quiet():
        got = ours(ids).logits
        want = eager(ids).logits
    assert served == [capped(WINDOW), capped()] and fell_back == []
    assert roles["attn"] == 2  # a call a layer
    assert_close(got, want)


@pytest.mark.parametrize("layer_types", [("full_attention",) * 2, ("sliding_attention",) * 2],
                         ids=["full", "sliding"])
def test_every_layer_type_runs_capped(served, fell_back, layer_types):
    """A Gemma 2 whose layers are all full ones, or all sliding ones: each layer runs kernelgen with its capped spec,
    and the logits are eager's."""
    ours, eager = gemma2_pair(layer_types)
    ids = tokens(1, 40, seed=6)
    with torch.no_grad(), quiet():
        got = ours(ids).logits
        want = eager(ids).logits
    assert served == [capped(WINDOW if layer_types[0] == "sliding_attention" else None)] * 2 and fell_back == []
    assert_close(got, want)


def test_the_cap_changes_the_logits(models, monkeypatch):
    """The cap matters to these models: kernelgen's specs without it, or eager's attention without it, give logits
    clearly unlike eager's with it."""
    ours, eager = models
    ids = tokens(2, 48, seed=3)
    monkeypatch.setattr(kg_hf, "get_kernel", lambda spec: small_select_tiles(spec.replace(softcap=None)))
    uncapped = copy.deepcopy(eager)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        want = eager(ids).logits
        for got in (ours(ids).logits, uncapped(ids).logits):
            assert (got - want).abs().max() > 0.05 * want.abs().max()


def test_training_gradients_match_eager(models, served, fell_back, roles):
    """A training step: both layers' forward and backward are kernelgen's; the loss and both layers' q and k
    projections' gradients are eager's."""
    ours, eager = models
    ids = tokens(1, 48, seed=4)
    results = []
    for model in (ours, eager):
        model.train()
        model.zero_grad()
        try:
            loss = model(ids, labels=ids).loss
            loss.backward()
        finally:
            model.eval()
        results.append([loss.detach(), *(p.grad.clone() for layer in model.model.layers
                                         for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight))])
        model.zero_grad()
    assert_capped_calls(served)
    assert fell_back == [] and roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2  # both layers' backward
    for got, want in zip(*results):
        assert want.abs().max() > 0
        assert_close(got, want, tol=1e-3)


@pytest.mark.parametrize("cache", ["dynamic", "static", "key_reps"])
def test_generate_a_left_padded_batch_matches_eager(models, served, fell_back, roles, cache):
    """generate() from a left-padded batch (45 and 30 tokens) over a dynamic cache, a static one, or a KeyRepsCache
    (the full layer's decode steps select from kept reps): the tokens and each step's logits are eager's. Each layer's
    prompt is one kernelgen call (the full layer's too: with the cap, no dense SDPA call in its place), and each decode
    step one, all capped; nothing falls back."""
    ours, eager = models
    ids, mask = left_padded([tokens(1, n, seed=20 + i) for i, n in enumerate((45, 30))])
    out = []
    with torch.no_grad(), quiet():
        for model in (ours, eager):
            options = {"cache_implementation": cache} if cache != "key_reps" else (
                {"cache": kg_hf.KeyRepsCache(config=model.config)} if model is ours else {})
            out.append(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, **options))
    assert_capped_calls(served)
    assert fell_back == [] and roles["attn"] == 2 and roles["decode"] == 4  # the prompt, two steps, of both layers
    if cache == "key_reps":
        full = next(layer for layer in out[0].cache.layers if isinstance(layer, kg_hf.KeyRepsLayer))
        assert full.key_reps is not None
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert_close(torch.stack(out[0].logits), torch.stack(out[1].logits))


# ---- what kernelgen does not compute -----------------------------------------------------------------------

def test_layers_that_are_not_kernelgens_run_eager_quietly(models, roles, monkeypatch):
    """top_k 0 makes both layers not kernelgen's: their calls run the model's eager attention (not SDPA, which would
    not cap), with no warning."""
    ours, eager = models
    monkeypatch.setattr(ours.config, "kernelgen_top_k", 0)
    ids = tokens(1, 40, seed=1)
    with torch.no_grad(), quiet():
        assert torch.equal(ours(ids).logits, eager(ids).logits)
    assert sum(roles.values()) == 0


class NoEagerAttention(torch.nn.Module):
    """An attention module whose modeling file (this one) has no eager_attention_forward."""
    is_causal = True

    def __init__(self, config):
        super().__init__()
        self.config, self.layer_idx, self.num_key_value_groups = config, 1, 2


def additive(allowed):
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


def test_what_kernelgen_cannot_compute_runs_the_models_eager_attention(models, roles):
    """A call of a capped layer that kernelgen cannot compute runs the model's eager_attention_forward, which caps,
    with the additive mask transformers' eager attention takes: a custom 4-D mask (warned in the full layer, quiet in
    the sliding one), a cap other than the spec's (warned); never SDPA, never an error. A module whose file has no
    eager_attention_forward is a ValueError naming the cap."""
    ours, _ = models
    full, sliding = ours.model.layers[1].self_attn, ours.model.layers[0].self_attn
    eager = sys.modules[type(full).__module__].eager_attention_forward
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 40, 64, generator=g) for h in (4, 2, 2))
    keys = torch.arange(40)
    causal = (keys <= keys[:, None])[None, None]
    holes = causal & (keys % 7 != 3)  # a custom mask: some keys hidden from every query
    window = causal & (keys > keys[:, None] - WINDOW)
    kg_hf._warned.clear()
    for attn, mask, kwargs, want_mask, warned in (
            (full, holes, {}, additive(holes), "not purely causal"),
            (full, None, {"softcap": 3.0}, additive(causal), "soft-capping at 3.0, not the spec's 2.0"),
            (sliding, holes & window, {"sliding_window": WINDOW}, additive(holes & window), None)):
        kwargs = {"softcap": CAP, **kwargs}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kg_hf.KernelgenFallbackWarning)
            got = kg_hf.attention_forward(attn, q, k, v, mask, scaling=attn.scaling, **kwargs)
        if warned is None:
            assert not caught
        else:
            assert len(caught) == 1, caught
            assert re.search(f"{warned}.*; such calls run the model's eager attention \\(they have soft-capping\\)",
                             str(caught[0].message))
        want = eager(attn, q, k, v, want_mask, scaling=attn.scaling, **kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert sum(roles.values()) == 0
    stub = NoEagerAttention(full.config)
    with pytest.raises(ValueError, match="soft-capping \\(softcap=\\).*no eager_attention_forward"):
        kg_hf.attention_forward(stub, q, k, v, holes, scaling=full.scaling, softcap=CAP)


# ---- inside torch.compile ----------------------------------------------------------------------------------

@pytest.fixture
def compiled_specs(compiled, monkeypatch):
    """The specs the custom ops of compiled steps get kernels for (kernelgen.custom_ops.get_kernel, spied on)."""
    seen = []

    def spy(spec, **kwargs):
        seen.append(spec)
        return small_select_tiles(spec, **kwargs)

    monkeypatch.setattr(kernelgen.custom_ops, "get_kernel", spy)
    return seen


def test_a_compiled_training_step_runs_in_the_graph(compiled, compiled_specs, roles, monkeypatch):
    """torch.compile(fullgraph=True) of a training step of a Gemma 2 whose layers are full ones, over a left- and
    right-padded batch: each layer's call runs in the graph with the capped spec (the custom op's JSON carries it); the
    loss and the q projections' gradients are eager's."""
    monkeypatch.setattr(kg_hf, "get_kernel", small_select_tiles)
    ours, eager = gemma2_pair(("full_attention",) * 2)
    ids, mask = left_padded([tokens(1, n, seed=50 + i) for i, n in enumerate((48, 33))])
    mask[0, 40:] = 0  # right padding too
    # the labels of tokens after a real one: a padding query's output (0 in kernelgen's) predicts none
    after_token = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1).bool()
    labels = torch.where(mask.bool() & after_token, ids, -100)
    results = training_steps(ours, eager, compiled, ids, mask, labels,
                             lambda model: [layer.self_attn.q_proj.weight.grad.clone() for layer in model.model.layers])
    assert roles["attn"] == 2 and roles["bwd_dq"] == 2  # ours: one call a layer, inside the graph
    assert compiled_specs and set(compiled_specs) == {capped()}
    for got, want in zip(*results):
        assert_close(got, want, tol=1e-3)


def test_a_compiled_call_with_another_cap_breaks_the_graph_into_eager(models, compiled, roles):
    """A compiled call of the full layer with the spec's cap runs in the graph (fullgraph), capped; one whose softcap
    is not the spec's leaves the graph (its eager call), which runs the model's eager attention: eager's result, no
    kernelgen kernel."""
    full = models[0].model.layers[1].self_attn
    eager = sys.modules[type(full).__module__].eager_attention_forward
    q, k, v = (torch.randn(1, h, 32, 64, generator=torch.Generator().manual_seed(seed))
               for seed, h in enumerate((4, 2, 2)))
    causal = additive(torch.ones(32, 32, dtype=torch.bool).tril()[None, None])
    kg_hf.attention_forward(full, q, k, v, None, scaling=full.scaling, softcap=CAP)  # the module's spec, read now
    for softcap, fullgraph in ((CAP, True), (3.0, False)):
        roles.clear()
        call = compiled(lambda q, k, v: kg_hf.attention_forward(full, q, k, v, None, scaling=full.scaling,
                                                                softcap=softcap)[0], fullgraph=fullgraph)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kg_hf.KernelgenFallbackWarning)
            got = call(q, k, v)
        assert_close(got, eager(full, q, k, v, causal, scaling=full.scaling, softcap=softcap)[0], tol=1e-5)
        assert roles["attn"] == (1 if softcap == CAP else 0)

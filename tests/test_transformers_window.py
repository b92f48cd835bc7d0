"""kernelgen as a transformers attention implementation in sliding-window layers (`Spec.window`): tiny models built in
code (no downloads), fp32 in the CPU interpreter. A gpt-oss (attention sinks; a full and a sliding layer, a window of
24 keys under longer sequences) against the same weights under attn_implementation="eager"; a Mistral (every layer
windowed, no layer_types) and a Qwen2 ("sliding_attention" layers, no sinks) against SDPA and eager. The sliding
layers' prompts and training steps, padded (`seqlens`) or packed (`varlen`) too, and their decode steps and chunks
after cached keys, left-padded (`cache_leftpad`) too, run kernelgen's window spec (a spy on get_kernel and the
kernels' calls proves it, another on the fallback that none ran); their other calls run SDPA or the model's eager
attention, quietly."""
import contextlib
import copy
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelgen import Spec  # noqa: E402
from kernelgen.integrations import transformers as kg_hf  # noqa: E402
from kernelgen.tuning.model import model_specs  # noqa: E402
from test_transformers import VOCAB, assert_close, compiled, left_padded, small_select_tiles, tokens  # noqa: E402,F401

WINDOW = 24
LAYERS = ("full_attention", "sliding_attention")
SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 2, "vocab_size": VOCAB, "initializer_range": 0.2, "pad_token_id": 0,
         "sliding_window": WINDOW, "kernelgen_kv_block": 16, "kernelgen_q_tile": 16}


def window_spec(window=WINDOW, **fields):
    """The spec a sliding layer of these models is served: its lists the window's blocks (4 of 16 keys for 24)."""
    fields = {"head_dim": 64, "kv_block": 16, "q_tile": 16, "gqa_group": 2, "causal": True, "window": window,
              **fields}
    return Spec(**fields, top_k=Spec(**fields, selector="given", top_k=1).window_blocks)


def gpt_oss_config(**options):
    return transformers.GptOssConfig(**{**SMALL, "layer_types": list(LAYERS), "num_local_experts": 2,
                                        "num_experts_per_tok": 1, "kernelgen_top_k": 8, **options})


def pair(config, reference="eager"):
    """(kernelgen model, reference model) with the same weights; gpt-oss's sinks logits from -1 to 3 (its init gives
    them about 0.2: too little to tell a model that drops them)."""
    torch.manual_seed(0)  # a config each: from_config sets the implementation on the config it is given
    want = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    with torch.no_grad():
        for i, layer in enumerate(want.model.layers):
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.copy_(torch.tensor([2.5, -1.0, 1.0, 3.0]).roll(i))
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="kernelgen")
    ours.load_state_dict(want.state_dict())
    return ours.eval(), want.eval()


@pytest.fixture(scope="module")
def models():
    return pair(gpt_oss_config())


class Served(list):
    """The specs the integration's eager calls get kernels for, in call order; `calls`: (spec, "call" or "varlen",
    the names of the options given, other than None) of each call of those kernels."""

    def window_calls(self):
        """(form, options) of each call of the sliding layer's spec."""
        return [(form, options) for spec, form, options in self.calls if spec == window_spec()]


class Recorded:
    """A kernel that records its calls in `served.calls`."""

    def __init__(self, served, spec, attn):
        self._served, self._spec, self._attn = served, spec, attn

    def __call__(self, *args, **options):
        self._served.calls.append((self._spec, "call", {k for k, v in options.items() if v is not None}))
        return self._attn(*args, **options)

    def varlen(self, *args, **options):
        self._served.calls.append((self._spec, "varlen", {k for k, v in options.items() if v is not None}))
        return self._attn.varlen(*args, **options)

    def __getattr__(self, name):
        return getattr(self._attn, name)


@pytest.fixture
def served(monkeypatch):
    """The specs the integration's eager calls get kernels for, and their calls (get_kernel, spied on)."""
    seen = Served()
    seen.calls = []

    def spy(spec, **kwargs):
        seen.append(spec)
        return Recorded(seen, spec, small_select_tiles(spec, **kwargs))

    monkeypatch.setattr(kg_hf, "get_kernel", spy)
    return seen


@pytest.fixture
def fell_back(monkeypatch):
    """(layer_idx, n_q, n_k) of each attention call that ran SDPA or the model's eager attention instead of kernelgen
    (`_other_attention`, spied on): sliding layers fall back quietly, so a warning would not tell."""
    calls = []
    other = kg_hf._other_attention

    def spy(module, query, key, *args):
        calls.append((module.layer_idx, query.shape[2], key.shape[2]))
        return other(module, query, key, *args)

    monkeypatch.setattr(kg_hf, "_other_attention", spy)
    return calls


@contextlib.contextmanager
def quiet():
    """A context in which a KernelgenFallbackWarning is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        yield


def test_a_sliding_layers_spec_is_its_window():
    """A sliding layer's spec: its window, kv_block, q_tile and backend from the options (a backend without windows
    gives Triton), its lists the window's blocks; top_k 0 (its type's or the model's) leaves it to SDPA. A model
    without layer_types that sets sliding_window (Mistral) has every layer windowed, unless use_sliding_window is
    false; `kernelgen tune --model` tunes the same specs."""
    config = gpt_oss_config(kernelgen_backend="gluon")
    assert kg_hf.layer_spec(config, "sliding_attention") == window_spec(backend="triton")
    assert kg_hf.layer_spec(config, "full_attention").window is None
    assert kg_hf.layer_spec(config, "full_attention").backend == "gluon"
    tilelang = gpt_oss_config(kernelgen_backend="tilelang")  # its forward and dK/dV have windows
    assert kg_hf.layer_spec(tilelang, "sliding_attention") == window_spec(backend="tilelang")
    assert window_spec().top_k == 4 and window_spec().selector == "mean"
    assert model_specs(gpt_oss_config().to_dict()) == [("full_attention", kg_hf.layer_spec(gpt_oss_config())),
                                                       ("sliding_attention", window_spec())]
    off = gpt_oss_config(kernelgen={"layer_types": {"sliding_attention": {"top_k": 0}}})
    assert kg_hf.layer_spec(off, "sliding_attention") is None and kg_hf.layer_spec(off).top_k == 8
    assert kg_hf.layer_spec(gpt_oss_config(kernelgen_top_k=0), "sliding_attention") is None
    mistral = transformers.MistralConfig(**SMALL)
    assert kg_hf.layer_spec(mistral) == window_spec()
    assert kg_hf.layer_spec(transformers.MistralConfig(**{**SMALL, "sliding_window": None})).window is None
    raw = {**mistral.to_dict(), "use_sliding_window": False}  # Qwen2's config.json: a window it does not use
    assert model_specs(raw)[0][1].window is None


def test_a_prompt_matches_eager(models, served):
    """gpt-oss's prompt (2 rows of 110 tokens, a window of 24): the sliding layer runs kernelgen's window spec with
    the sinks, and the logits are eager's; no warning."""
    ours, eager = models
    ids = tokens(2, 110, seed=3)
    with torch.no_grad(), quiet():
        got = ours(ids).logits
        want = eager(ids).logits
    assert served == [kg_hf.layer_spec(ours.config), window_spec()]
    assert_close(got, want)


def training_step(model, ids, **batch) -> list:
    """A training step's loss and gradients: both layers' sinks, the sliding layer's q and k projections."""
    model.train()
    model.zero_grad()
    try:
        loss = model(ids, **batch).loss
        loss.backward()
    finally:
        model.eval()
    attn = model.model.layers[1].self_attn
    results = [loss.detach(), *(layer.self_attn.sinks.grad.clone() for layer in model.model.layers),
               attn.q_proj.weight.grad.clone(), attn.k_proj.weight.grad.clone()]
    model.zero_grad()
    return results


def test_training_gradients_match_eager(models, served, roles):
    """A training step: the sliding layer's forward and backward are kernelgen's; the loss and the gradients (both
    layers' sinks, the sliding layer's projections) are eager's."""
    ours, eager = models
    ids = tokens(1, 100, seed=4)
    results = [training_step(model, ids, labels=ids) for model in (ours, eager)]
    assert window_spec() in served
    assert ours.config._attn_implementation == "kernelgen" and eager.config._attn_implementation == "eager"
    assert roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2  # both layers' backward
    for got, want in zip(*results):
        assert want.abs().max() > 0
        assert_close(got, want, tol=1e-3)


def test_a_left_padded_prompt_matches_eager(models, served):
    """A left-padded prompt batch (100 and 70 tokens, as generate() pads it): the sliding layer runs kernelgen's
    window spec once with `seqlens` (its rows moved to start at 0), the sinks joined; every token's logits are
    eager's."""
    ours, eager = models
    ids, mask = left_padded([tokens(1, 100, seed=30), tokens(1, 70, seed=31)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), quiet():
        got, want = (model(ids, attention_mask=mask, position_ids=positions).logits for model in (ours, eager))
    assert [(how, "seqlens" in options) for how, options in served.window_calls()] == [("call", True)]
    real = mask.bool()
    assert_close(got[real], want[real])


def test_a_right_padded_training_batch_matches_eager(models, served, roles):
    """A right-padded training batch (100 and 60 tokens, the padding's labels -100): the sliding layer's forward
    (`seqlens`) and backward are kernelgen's; the loss and the gradients (both layers' sinks, the sliding layer's
    projections) are eager's."""
    ours, eager = models
    ids = tokens(2, 100, seed=32)
    mask = (torch.arange(100) < torch.tensor([100, 60])[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    results = [training_step(model, ids, attention_mask=mask, labels=labels) for model in (ours, eager)]
    assert [(how, "seqlens" in options) for how, options in served.window_calls()] == [("call", True)]
    assert roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2  # both layers' backward
    for got, want in zip(*results):
        assert want.abs().max() > 0
        assert_close(got, want, tol=1e-3)


@pytest.mark.parametrize("family, flash_kwargs", [("gpt_oss", True), ("mistral", False), ("mistral", True)],
                         ids=["gpt_oss_flash_kwargs", "mistral_position_ids", "mistral_flash_kwargs"])
def test_packed_sequences_match_each_sequence_alone(models, served, family, flash_kwargs):
    """A padding-free batch (3 sequences of 45, 30 and 25 tokens in one row, position_ids restarting, as
    DataCollatorWithFlattening gives it): each sliding layer runs kernelgen's window spec once with `attn.varlen`,
    its sequences read from the block-diagonal mask transformers builds from the position_ids (Mistral's; no cache),
    or bounded by FlashAttention's varlen kwargs (over that mask, or where the model made a cache, whose mask drops
    the restarts; gpt-oss's masks never read position_ids); the logits are each sequence's run alone."""
    if family == "gpt_oss":
        ours, alone_model = models
    else:
        ours, alone_model = pair(transformers.MistralConfig(**SMALL), "sdpa")
    lengths = (45, 30, 25)
    sequences = [tokens(1, n, seed=40 + i) for i, n in enumerate(lengths)]
    ids = torch.cat(sequences, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = {"position_ids": positions, "use_cache": family == "gpt_oss"}
    if flash_kwargs:
        bounds = torch.tensor([0, 45, 75, 100], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=45, max_length_k=45)
    with torch.no_grad(), quiet():
        got = ours(ids, **kwargs).logits
        alone = torch.cat([alone_model(sequence).logits for sequence in sequences], 1)
        if family == "mistral" and not flash_kwargs:  # SDPA's packed mask: the same
            assert_close(alone_model(ids, **kwargs).logits, alone)
    layers = sum(spec == window_spec() for spec in served)
    assert layers == (1 if family == "gpt_oss" else 2)
    assert [how for how, _ in served.window_calls()] == ["varlen"] * layers
    assert_close(got, alone)


GENERATED = 12  # new tokens: the window (24) moves past the left padding of a 14-token prompt beside a 20-token one
CACHE_OPTIONS = {"seqlens", "cache_seqlens", "cache_leftpad"}
LEFTPAD = {"cache_seqlens", "cache_leftpad"}
# the CACHE_OPTIONS of each way a window spec computes a call (call_forms' `runs`)
RUN_OPTIONS = {"call": set(), "varlen": set(), "seqlens": {"seqlens"}, "cache_leftpad": LEFTPAD}


def step_options(lengths, generated=GENERATED):
    """The options (of CACHE_OPTIONS) of a sliding layer's calls in generate() of left-padded prompts of `lengths`:
    the prompt's (`seqlens` where padded), then each decode step's (`cache_leftpad` while a row's padding is within
    its query's window: a padding key after the query's position p less WINDOW)."""
    n, padding = max(lengths), max(lengths) - min(lengths)
    steps = [LEFTPAD if padding > max(0, n + step - WINDOW + 1) else set() for step in range(generated - 1)]
    return [{"seqlens"} if padding else set(), *steps]


def generated(model, lengths, cache="dynamic"):
    """generate()'s greedy tokens and each step's logits [steps, B, V] from left-padded prompts of `lengths`."""
    ids, mask = left_padded([tokens(1, n, seed=20 + i) for i, n in enumerate(lengths)])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=GENERATED, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, cache_implementation=cache)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("cache, lengths", [("dynamic", (20,)), ("static", (100,)), ("dynamic", (20, 14))],
                         ids=["dynamic", "static", "left_padded"])
def test_generate_matches_eager(models, served, fell_back, cache, lengths):
    """generate() past the window: the tokens and each step's logits are eager's. The sliding layer's prompt over a
    fresh cache (which hands it the whole prompt's keys) and its decode steps over the window's keys are kernelgen's,
    the sinks joined: the maskless ones (transformers gives none until the window cuts keys) too, a left-padded
    batch's prompt with `seqlens`, its steps with `cache_leftpad` while a row's padding is within the window; no call
    falls back."""
    ours, eager = models
    with torch.no_grad(), quiet():
        (got_ids, got), (want_ids, want) = (generated(model, lengths, cache) for model in (ours, eager))
    assert fell_back == []
    assert [options & CACHE_OPTIONS for _, options in served.window_calls()] == step_options(lengths)
    assert torch.equal(got_ids, want_ids)
    assert_close(got, want)


def test_a_chunk_after_cached_keys_matches_eager(models, served, fell_back):
    """A left-padded prompt batch (40 and 30 tokens) in two chunks over a cache, as a chunked prefill runs it: the
    sliding layer's second chunk (10 queries after the window's cached keys, row 1's padding within its first
    queries' windows) is kernelgen's with `cache_leftpad`; every token's logits are eager's."""
    ours, eager = models
    ids, mask = left_padded([tokens(1, 40, seed=50), tokens(1, 30, seed=51)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def chunked(model):
        cache = transformers.DynamicCache(config=model.config)
        return torch.cat([model(ids[:, chunk], attention_mask=mask[:, :chunk.stop], position_ids=positions[:, chunk],
                                cache=cache, use_cache=True).logits
                          for chunk in (slice(0, 30), slice(30, 40))], 1)

    with torch.no_grad(), quiet():
        got, want = chunked(ours), chunked(eager)
    assert fell_back == []
    assert [options & CACHE_OPTIONS for _, options in served.window_calls()] == [{"seqlens"}, LEFTPAD]
    real = mask.bool()
    assert_close(got[real], want[real])


def sinkless_config(family):
    """A Mistral's (no layer_types: every layer windowed) or a Qwen2's (a "sliding_attention" layer)."""
    if family == "mistral":
        return transformers.MistralConfig(**SMALL)
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, max_window_layers=1)
    assert config.layer_types == list(LAYERS)
    return config


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_model_without_sinks_matches_sdpa(family, served):
    """A Mistral (no layer_types: every layer windowed) and a Qwen2 (a "sliding_attention" layer): each sliding
    layer's prompt is kernelgen's window spec; the logits are SDPA's and eager's."""
    config = sinkless_config(family)
    ours, sdpa = pair(config, "sdpa")
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    ids = tokens(2, 100, seed=5)
    with torch.no_grad(), quiet():
        got = ours(ids).logits
        want = sdpa(ids).logits
        assert_close(eager(ids).logits, want)
    assert served.count(window_spec()) == (2 if family == "mistral" else 1)
    assert_close(got, want)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_generate_of_a_model_without_sinks_matches_eager(family, served, fell_back):
    """generate() of a Mistral and a Qwen2 from a left-padded batch (20 and 14 tokens) past the window: each sliding
    layer's prompt (`seqlens`) and decode steps (`cache_leftpad` while the padding is within the window) are
    kernelgen's, none falls back; the tokens and each step's logits are eager's."""
    ours, eager = pair(sinkless_config(family), "eager")
    lengths = (20, 14)
    with torch.no_grad(), quiet():
        (got_ids, got), (want_ids, want) = (generated(model, lengths) for model in (ours, eager))
    layers = 2 if family == "mistral" else 1
    assert fell_back == []
    options = [options & CACHE_OPTIONS for _, options in served.window_calls()]
    assert options == [step for step in step_options(lengths) for _ in range(layers)]
    assert torch.equal(got_ids, want_ids)
    assert_close(got, want)


def sliding_mask(n, window=WINDOW, n_k=None):
    """transformers' sliding-window causal mask [1, 1, n, n_k] (bottom-right aligned), boolean."""
    n_k = n if n_k is None else n_k
    i = torch.arange(n)[:, None] + n_k - n
    j = torch.arange(n_k)[None, :]
    return ((j <= i) & (j > i - window))[None, None]


def reference(attn, q, k, v, allowed):
    """gpt-oss's eager attention [B, N, H, D] over the keys `allowed` (bool) sees."""
    mask = torch.where(allowed, 0.0, torch.finfo(q.dtype).min)
    return sys.modules[type(attn).__module__].eager_attention_forward(attn, q, k, v, mask, scaling=0.125)[0]


def call_forms():
    """(name, n_q, n_k, mask, kwargs, allowed, runs): calls of a sliding layer, with what each query sees, and how
    kernelgen's window spec computes them ("call", "seqlens", "varlen", "cache_leftpad"; None: it does not)."""
    n = 40
    window = sliding_mask(n)
    keys = torch.arange(n)
    padded = window & (keys >= torch.tensor([0, 5])[:, None])[:, None, None, :]  # row 1: 5 tokens of left padding
    right_padded = window & (keys < torch.tensor([n, 30])[:, None])[:, None, None, :]  # row 1: 10 after its tokens
    holed = window.clone()
    holed[..., 30, 25] = False
    padded_holed = padded.clone()
    padded_holed[1, :, 30, 25] = False
    right_unseen = right_padded & (keys < 30)[:, None]  # its padding queries see nothing: not transformers' mask
    bounds = torch.tensor([0, 17, 40, 57, 80], dtype=torch.int32)
    sequence = torch.searchsorted(bounds, torch.arange(2 * n, dtype=torch.int32), right=True).view(2, n)
    packed = window & (sequence[:, :, None] == sequence[:, None, :])[:, None]
    flash = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 23, "max_length_k": 23}
    other = torch.tensor([0, 20, 40, 57, 80], dtype=torch.int32)
    flash_other = {"cu_seq_lens_q": other, "cu_seq_lens_k": other, "max_length_q": 23, "max_length_k": 23}
    causal = sliding_mask(n, window=n)
    return [
        ("window", n, n, window, {}, window, "call"),
        ("window_additive", n, n, torch.where(window, 0.0, torch.finfo(torch.float32).min), {}, window, "call"),
        ("window_per_row", n, n, window.expand(2, 1, n, n), {}, window, "call"),
        ("short_no_mask", WINDOW, WINDOW, None, {}, sliding_mask(WINDOW), "call"),
        ("long_no_mask", n, n, None, {}, causal, None),  # SDPA's causal reading: not the window's
        ("padded", n, n, padded, {}, padded, "seqlens"),
        ("padded_additive", n, n, torch.where(padded, 0.0, torch.finfo(torch.float32).min), {}, padded, "seqlens"),
        ("right_padded", n, n, right_padded, {}, right_padded, "seqlens"),
        ("padded_flash_kwargs", n, n, padded, flash, padded, "seqlens"),  # the mask is read, as in full layers
        ("padded_custom", n, n, padded_holed, {}, padded_holed, None),
        ("right_padded_unseen", n, n, right_unseen, {}, right_unseen, None),
        ("custom", n, n, holed, {}, holed, None),
        ("another_window", n, n, sliding_mask(n, window=20), {}, sliding_mask(n, window=20), None),
        ("packed", n, n, packed, flash, packed, "varlen"),
        ("packed_mask", n, n, packed, {}, packed, "varlen"),
        ("packed_additive", n, n, torch.where(packed, 0.0, torch.finfo(torch.float32).min), {}, packed, "varlen"),
        ("flash_kwargs_over_every_token", n, n, window, flash, packed, "varlen"),  # the model made a cache
        ("packed_other_bounds", n, n, packed, flash_other, packed, None),
        ("flash_kwargs_some", n, n, packed, {"cu_seq_lens_q": bounds}, packed, None),
        ("no_window_kwarg", n, n, window, {"sliding_window": None}, window, "call"),
        ("another_window_kwarg", n, n, window, {"sliding_window": 20}, window, None),
    ] + cached_call_forms()


def hf_sliding_mask(n_q, n_k, pads=(0, 0), ends=None, window=WINDOW):
    """transformers' sliding-window causal mask [2, 1, n_q, n_k] (`sdpa_mask`, as a call after cached keys gets it:
    the queries the last n_q keys), row b's tokens keys [pads[b], ends[b]) (default: to the last key), boolean."""
    keys = torch.arange(n_k)
    tokens = (keys >= torch.tensor(pads)[:, None]) & (keys < torch.tensor(ends or (n_k, n_k))[:, None])
    return transformers.masking_utils.sdpa_mask(
        batch_size=2, q_length=n_q, kv_length=n_k, q_offset=torch.tensor(n_k - n_q), attention_mask=tokens,
        mask_function=transformers.masking_utils.sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False)


def additive(mask):
    return torch.where(mask, 0.0, torch.finfo(torch.float32).min)


def cached_call_forms():
    """call_forms' calls after cached keys (decode steps, and chunks of 3 or 8 queries): the plain call where no row's
    padding is within a query's window (or no mask: one query over no more keys than the window), `cache_leftpad`
    where it is; right padding, a custom mask, a chunk under another window and one without a mask (SDPA's causal
    reading is from the top left) are not the window's."""
    n = 40
    decode, left_padded = hf_sliding_mask(1, WINDOW), hf_sliding_mask(1, WINDOW, pads=(0, 5))
    chunk_padded, chunk_of_padding = hf_sliding_mask(3, 20, pads=(0, 5)), hf_sliding_mask(3, 20, pads=(0, 18))
    padding_sees_all = chunk_of_padding.clone()
    padding_sees_all[1, :, 0] = True  # row 1's first query (position 17) is padding: whatever it sees is unread
    custom = hf_sliding_mask(3, n)
    custom[0, :, 1, 30] = False
    right_padded = hf_sliding_mask(1, WINDOW, ends=(WINDOW, 20))
    chunk_right_padded = hf_sliding_mask(3, 20, ends=(20, 19))
    top_left = torch.ones(3, 20, dtype=torch.bool).tril()[None, None]
    narrower, chunk_narrower = hf_sliding_mask(1, n, window=20), hf_sliding_mask(3, n, window=20)
    return [
        ("decode", 1, WINDOW, None, {}, decode, "call"),
        ("decode_fewer_keys", 1, 10, None, {}, hf_sliding_mask(1, 10), "call"),
        ("decode_no_mask_past_the_window", 1, n, None, {}, torch.ones(1, 1, 1, n, dtype=torch.bool), None),
        ("decode_mask", 1, WINDOW, decode, {}, decode, "call"),
        ("decode_past_the_window", 1, n, hf_sliding_mask(1, n), {}, hf_sliding_mask(1, n), "call"),  # a full cache
        ("decode_left_padded", 1, WINDOW, left_padded, {}, left_padded, "cache_leftpad"),
        ("decode_left_padded_additive", 1, WINDOW, additive(left_padded), {}, left_padded, "cache_leftpad"),
        ("decode_padding_past_the_window", 1, n, hf_sliding_mask(1, n, pads=(0, 5)), {},
         hf_sliding_mask(1, n, pads=(0, 5)), "call"),
        ("chunk", 3, n, hf_sliding_mask(3, n), {}, hf_sliding_mask(3, n), "call"),
        ("after_cached_keys", 8, n, sliding_mask(8, n_k=n), {}, sliding_mask(8, n_k=n), "call"),
        ("chunk_left_padded", 3, 20, chunk_padded, {}, chunk_padded, "cache_leftpad"),
        ("chunk_left_padded_additive", 3, 20, additive(chunk_padded), {}, chunk_padded, "cache_leftpad"),
        ("chunk_of_padding", 3, 20, chunk_of_padding, {}, chunk_of_padding, "cache_leftpad"),
        ("chunk_padding_sees_all", 3, 20, padding_sees_all, {}, chunk_of_padding, "cache_leftpad"),
        ("chunk_no_mask", 3, 20, None, {}, top_left, None),
        ("decode_right_padded", 1, WINDOW, right_padded, {}, right_padded, None),
        ("chunk_right_padded", 3, 20, chunk_right_padded, {}, chunk_right_padded, None),
        ("chunk_custom", 3, n, custom, {}, custom, None),
        # one query's smaller window is its keys' left padding: the same attention; more queries tell them apart
        ("decode_another_window", 1, n, narrower, {}, narrower, "cache_leftpad"),
        ("chunk_another_window", 3, n, chunk_narrower, {}, chunk_narrower, None),
    ]


@pytest.mark.parametrize("form", [f[0] for f in call_forms()])
def test_each_call_form_runs_kernelgen_or_what_it_ran_before(models, served, form):
    """attention_forward on gpt-oss's sliding layer: kernelgen's window spec where the mask is the sliding-window causal
    one (boolean or additive, broadcast or per row; none where the window cuts nothing) over each row's tokens: the
    keys the queries' own (`seqlens` for padding; `varlen` for packed sequences, FlashAttention's varlen kwargs bounding
    them where they agree with the mask), or the queries the last of the keys (`cache_leftpad` for left padding within
    a window); else the model's eager attention, quietly. Each real query's output (a token's: one that sees itself)
    is the eager attention's under what it sees (a fallback's every query's); none is NaN."""
    _, q_len, k_len, mask, kwargs, allowed, runs = next(f for f in call_forms() if f[0] == form)
    attn = models[0].model.layers[1].self_attn
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, q_len, 64, generator=g)
    k, v = torch.randn(2, 2, k_len, 64, generator=g), torch.randn(2, 2, k_len, 64, generator=g)
    kwargs = {"sliding_window": WINDOW, **kwargs}
    with torch.no_grad(), quiet():
        got = kg_hf.attention_forward(attn, q, k, v, mask, scaling=0.125, s_aux=attn.sinks, **kwargs)[0]
    assert served == ([window_spec()] if runs else [])
    if runs:
        [(how, options)] = served.window_calls()
        assert how == ("varlen" if runs == "varlen" else "call") and options & CACHE_OPTIONS == RUN_OPTIONS[runs]
    want = reference(attn, q, k, v, allowed)
    real = allowed.expand(2, 1, q_len, k_len)[:, 0].diagonal(k_len - q_len, 1, 2)  # [B, Nq]: a query sees itself
    if runs is None:  # the same attention as the reference's
        real = torch.ones_like(real)
    assert real.sum() >= q_len  # the forms' rows hold tokens
    assert not got.isnan().any()
    assert_close(got[real], want[real])


def test_a_compiled_call_runs_the_window_spec_in_the_graph(models, compiled, roles):
    """Inside torch.compile(fullgraph=True), a sliding layer's call with no mask (no more tokens than the window) runs
    the custom op with the window spec, the sinks joined after it: eager's output and gradients."""
    attn = models[0].model.layers[1].self_attn
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, WINDOW, 64, generator=g, requires_grad=True)
    k, v = torch.randn(1, 2, WINDOW, 64, generator=g), torch.randn(1, 2, WINDOW, 64, generator=g)

    def call(q, k, v):
        return kg_hf.attention_forward(attn, q, k, v, None, scaling=0.125, sliding_window=WINDOW, s_aux=attn.sinks)[0]

    with quiet():
        got = compiled(call)(q, k, v)
    assert roles["attn"] == 1
    want = reference(attn, q, k, v, sliding_mask(WINDOW))
    assert_close(got, want)
    grads = [torch.autograd.grad(o.square().sum(), (q, attn.sinks)) for o in (got, want)]
    for got_grad, want_grad in zip(*grads):
        assert_close(got_grad, want_grad, tol=1e-3)


def test_a_compiled_decode_step_runs_the_window_spec_in_the_graph(models, compiled, roles):
    """Inside torch.compile(fullgraph=True), a sliding layer's decode step with no mask (a window's keys) runs the
    custom op with the window spec, the sinks joined after it: eager's output."""
    attn = models[0].model.layers[1].self_attn
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 1, 64, generator=g)
    k, v = torch.randn(2, 2, WINDOW, 64, generator=g), torch.randn(2, 2, WINDOW, 64, generator=g)

    def call(q, k, v):
        return kg_hf.attention_forward(attn, q, k, v, None, scaling=0.125, sliding_window=WINDOW, s_aux=attn.sinks)[0]

    with torch.no_grad(), quiet():
        got = compiled(call)(q, k, v)
    assert roles["decode"] == 1
    assert_close(got, reference(attn, q, k, v, hf_sliding_mask(1, WINDOW)))


def test_a_compiled_masked_decode_step_runs_the_eager_call(models, compiled, served):
    """Inside torch.compile, a sliding layer's decode step given a mask (left padding within the window) breaks the
    graph into the eager call, which reads the mask: `cache_leftpad`; eager's output."""
    attn = models[0].model.layers[1].self_attn
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 4, 1, 64, generator=g)
    k, v = torch.randn(2, 2, WINDOW, 64, generator=g), torch.randn(2, 2, WINDOW, 64, generator=g)
    mask = hf_sliding_mask(1, WINDOW, pads=(0, 5))

    def call(q, k, v, mask):
        return kg_hf.attention_forward(attn, q, k, v, mask, scaling=0.125, sliding_window=WINDOW, s_aux=attn.sinks)[0]

    with torch.no_grad(), quiet():
        got = compiled(call, fullgraph=False)(q, k, v, mask)
    assert [options & CACHE_OPTIONS for _, options in served.window_calls()] == [LEFTPAD]
    assert_close(got, reference(attn, q, k, v, mask))


def test_a_compiled_training_step_matches_eager(models, compiled, served):
    """torch.compile of a gpt-oss training step: the sliding layer's call, given the 4-D mask transformers builds
    while compiling, breaks the graph into the eager call, which runs the window spec (its full layer runs in the
    graph); the loss and the sinks' gradients are eager's."""
    ours, eager = models
    ids = tokens(1, 100, seed=6)
    results = []
    for model, run in ((ours, compiled(lambda ids: ours(ids, labels=ids).loss, fullgraph=False)),
                       (eager, lambda ids: eager(ids, labels=ids).loss)):
        model.train()
        model.zero_grad()
        try:
            loss = run(ids)
            loss.backward()
        finally:
            model.eval()
        results.append((loss.detach(), *(layer.self_attn.sinks.grad.clone() for layer in model.model.layers)))
        model.zero_grad()
    assert window_spec() in served
    for got, want in zip(*results):
        assert want.abs().max() > 0
        assert_close(got, want, tol=1e-3)

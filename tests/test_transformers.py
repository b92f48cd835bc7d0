"""kernelgen as a transformers attention implementation ("kernelgen"), on a tiny Llama-style model built in code
(no downloads), fp32 in the CPU interpreter: against the same weights under SDPA."""
import functools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernelgen  # noqa: E402
from kernelgen import SelectConfig, Spec  # noqa: E402
from kernelgen.backends import triton as triton_backend  # noqa: E402
from kernelgen.integrations import transformers as kg_hf  # noqa: E402

VOCAB = 128


def tiny_config(**options):
    """2 layers, 4 query heads over 2 KV heads (G = 2), head_dim 64; 16-key blocks so that a few dozen tokens
    make several blocks. A larger init than Llama's makes attention matter to the logits."""
    options = {"kernelgen_kv_block": 16, "kernelgen_q_tile": 16, **options}
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=VOCAB,
                                    initializer_range=0.2, pad_token_id=0, **options)


@functools.lru_cache(maxsize=None)
def small_select_tiles(spec):
    """get_kernel(spec), its selector scoring 16 blocks a step: the interpreter's cost grows with the score tile,
    and these sequences have at most 5 blocks (the default's 128 columns take 5x longer)."""
    if spec.selection_role != "select":
        return kernelgen.get_kernel(spec)
    return kernelgen.get_kernel(spec, configs={"select": SelectConfig(tiles=8, chunk=16)})


@pytest.fixture(scope="module")
def models():
    """(kernelgen model, SDPA model) with the same weights; each test sets the kernelgen model's options."""
    patch = pytest.MonkeyPatch()
    patch.setattr(kg_hf, "get_kernel", small_select_tiles)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="kernelgen").eval()
    ours.load_state_dict(sdpa.state_dict())
    yield ours, sdpa
    patch.undo()


def set_options(model, **options):
    for name, value in {"top_k": 16, "local": 1, "sink": 0, "selector": "mean", "schedule": "q_centric", "q_tile": 16,
                        **options}.items():
        setattr(model.config, f"kernelgen_{name}", value)


def tokens(batch, n, seed=0):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def assert_close(a, b, tol=1e-4):
    assert (a - b).abs().max().item() < tol * b.abs().max().item(), (a - b).abs().max().item()


def test_registered_and_the_spec_comes_from_the_config():
    kg_hf.register()  # again: idempotent
    assert transformers.AttentionInterface._global_mapping["kernelgen"] is kg_hf.attention_forward
    config = tiny_config(kernelgen_top_k=4, kernelgen_sink=1)
    assert kg_hf.layer_spec(config) == Spec(head_dim=64, kv_block=16, q_tile=16, top_k=4, causal=True, gqa_group=2,
                                            local=1, sink=1)
    # the object `kernelgen tune --model` reads, per layer type; an attribute wins over it
    config = tiny_config(kernelgen={"top_k": 8, "layer_types": {"sliding_attention": {"top_k": 2}}},
                         kernelgen_kv_block=32)
    config.layer_types = ["full_attention", "sliding_attention"]
    assert kg_hf.layer_spec(config).top_k == 8 and kg_hf.layer_spec(config).kv_block == 32
    assert kg_hf.layer_spec(config, "sliding_attention").top_k == 2
    assert kg_hf.layer_spec(config, "chunked_attention") is None  # no options: SDPA
    assert kg_hf.layer_spec(tiny_config(kernelgen_top_k=0)) is None
    with pytest.raises(ValueError, match="unknown"):
        kg_hf.layer_spec(tiny_config(kernelgen={"topk": 3}))
    # a value the Spec refuses is named by the key the user set it with
    with pytest.raises(TypeError, match="model config: kernelgen_top_k = '16': Spec.top_k must be an int"):
        kg_hf.layer_spec(tiny_config(kernelgen_top_k="16"))
    config = tiny_config(kernelgen={"layer_types": {"sliding_attention": {"kv_block": 48}}})
    config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"kernelgen\.layer_types\.sliding_attention\.kv_block = 48: Spec\.kv_block"):
        kg_hf.layer_spec(config, "sliding_attention")
    for selector in ("index", "given"):  # inputs a model's attention never passes: refused where the spec is read
        with pytest.raises(ValueError, match=f"selector='{selector}'.*'mean' or 'multi:r'"):
            kg_hf.layer_spec(tiny_config(kernelgen_selector=selector))
    # `kernelgen tune --model config.json` tunes the specs the model is served, defaults included
    from kernelgen.tuning.model import model_specs

    for config in (tiny_config(kernelgen={"kv_block": 32, "top_k": 8}), tiny_config(),
                   tiny_config(kernelgen={"schedule": "kv_centric", "sink": 1}, kernelgen_q_tile=None)):
        assert model_specs(config.to_dict()) == [("full_attention", kg_hf.layer_spec(config))], config.to_dict()
    with pytest.raises(ValueError, match="head_dim=40"):
        kg_hf.layer_spec(transformers.LlamaConfig(hidden_size=80, num_attention_heads=2))


def test_a_misspelt_option_is_refused(models):
    """A kernelgen_<name> attribute that is no option (a typo) is a ValueError naming it, as an unknown key of the
    "kernelgen" object is, set before the first call or after it; so is a layer type the model does not have
    under the object's "layer_types". Never the defaults silently."""
    with pytest.raises(ValueError, match="kernelgen_topk"):
        kg_hf.layer_spec(tiny_config(kernelgen_topk=4))
    config = tiny_config(kernelgen={"layer_types": {"sliding_atention": {"top_k": 4}}})
    config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding_atention"):
        kg_hf.layer_spec(config, "sliding_attention")
    ours, _ = models
    set_options(ours, top_k=2)
    assert kg_hf._module_spec(ours.model.layers[0].self_attn).top_k == 2
    ours.config.kernelgen_topk = 4
    try:
        with pytest.raises(ValueError, match="kernelgen_topk"):
            kg_hf._module_spec(ours.model.layers[0].self_attn)
    finally:
        del ours.config.kernelgen_topk


def test_what_kernelgen_cannot_compute_runs_sdpa_with_a_warning(models):
    """head_dim 40 (no kernels), dropout, output_attentions, a sliding window and values of another head_dim:
    SDPA's result, one warning per reason."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=80, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, num_hidden_layers=1, vocab_size=VOCAB)
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kernelgen").eval()
    ours.load_state_dict(sdpa.state_dict())
    ids = tokens(1, 20)
    kg_hf._warned.clear()
    with torch.no_grad(), pytest.warns(kg_hf.KernelgenFallbackWarning, match="head_dim=40"):
        assert torch.equal(ours(ids).logits, sdpa(ids).logits)
    attn = models[0].model.layers[0].self_attn  # head_dim 64, G = 2
    q = torch.randn(1, 4, 20, 64)
    k = v = torch.randn(1, 2, 20, 64)
    for kwargs, reason in (({"dropout": 0.1}, "dropout"), ({"output_attentions": True}, "output_attentions"),
                           ({"sliding_window": 8}, "sliding window"), ({"v": torch.randn(1, 2, 20, 128)}, "value"),
                           ({"float64": True}, "float64 in Triton's CPU interpreter")):
        value = kwargs.pop("v", v)  # MLA-style: values wider than queries and keys
        inputs = [x.double() for x in (q, k, value)] if kwargs.pop("float64", False) else [q, k, value]
        with pytest.warns(kg_hf.KernelgenFallbackWarning, match=reason):
            torch.manual_seed(2)
            got = kg_hf.attention_forward(attn, *inputs, None, scaling=0.125, **kwargs)[0]
        torch.manual_seed(2)
        want = transformers.integrations.sdpa_attention.sdpa_attention_forward(attn, *inputs, None,
                                                                              scaling=0.125, **kwargs)[0]
        assert torch.equal(got, want)


def test_every_block_listed_matches_sdpa_and_sparsity_changes_it(models, roles):
    ours, sdpa = models
    ids = tokens(2, 70)
    with torch.no_grad():
        want = sdpa(ids).logits
        set_options(ours, top_k=5)  # 5 blocks of 16 keys hold all 70
        assert_close(ours(ids).logits, want)
        assert roles["attn"] == 2 and roles["select"] == 2
        set_options(ours, top_k=2)
        assert (ours(ids).logits - want).abs().max() > 1e-3


def test_prefill_after_a_cache_prefix_is_bottom_right_causal(models, roles):
    """A prompt's second chunk sees the cached first one: transformers passes a 4-D causal mask (Nk > Nq),
    which kernelgen reads as purely causal and serves itself."""
    ours, sdpa = models
    ids = tokens(1, 60, seed=1)
    set_options(ours, top_k=4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        want = sdpa(ids).logits[:, 36:]
        cache = transformers.DynamicCache(config=ours.config)
        ours(ids[:, :36], cache=cache)
        got = ours(ids[:, 36:], cache=cache).logits
    assert_close(got, want)
    assert roles["attn"] == 4


def test_generate_decodes_with_the_decode_role(models, roles):
    ours, sdpa = models
    prompt = tokens(2, 40, seed=2)
    set_options(ours, top_k=3)  # every block of the 43 tokens: greedy tokens as SDPA's
    with torch.no_grad():
        want = sdpa.generate(prompt, max_new_tokens=3, do_sample=False)
        got = ours.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert roles["attn"] == 2 and roles["decode"] == 2 * 2  # the prompt, then two single-token steps per layer
    roles.clear()
    set_options(ours, top_k=2, sink=1)  # sparse: 1 sink, the diagonal block
    with torch.no_grad():
        got = ours.generate(prompt, max_new_tokens=3, do_sample=False)
    assert got.shape == (2, 43) and roles["decode"] == 4


def left_padded(prompts):
    """(ids, mask) of a batch of prompts (each [1, n]) padded on the left, as a tokenizer pads for generate()."""
    n = max(p.shape[1] for p in prompts)
    ids, mask = torch.zeros(len(prompts), n, dtype=torch.long), torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, n - p.shape[1]:], mask[b, n - p.shape[1]:] = p[0], 1
    return ids, mask


def greedy(model, ids, mask, cache, steps=2):
    """generate()'s logits [steps + 1, B, V] and tokens, under `cache`: "dynamic", "static" or "key_reps"."""
    kwargs = ({"cache": kg_hf.KeyRepsCache(config=model.config)} if cache == "key_reps"
              else {"cache_implementation": cache})
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return torch.stack(out.logits), out.sequences[:, ids.shape[1]:], out


@pytest.mark.parametrize("cache", ["dynamic", "key_reps", "static"])
def test_a_left_padded_batch_generates_each_row_as_if_alone(models, roles, cache):
    """generate() over a left-padded batch: each row's logits are those of its prompt generated alone (its
    blocks counted from its first token), under each cache; no fallback. The prompt runs one call a layer
    (`seqlens`, its rows moved to start at 0), each decode step one (`cache_leftpad`); a KeyRepsCache keeps reps
    of the padded rows."""
    ours, _ = models
    set_options(ours, top_k=2)  # sparse: the diagonal block and one chosen of up to 3
    prompts = [tokens(1, n, seed=20 + i) for i, n in enumerate((45, 30, 17))]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        logits, chosen, out = greedy(ours, *left_padded(prompts), cache)
        assert roles["attn"] == 2 and roles["decode"] == 2 * 2  # 2 layers: the padded prompt, then 2 steps
        if cache == "key_reps":
            kept = out.past_key_values
            for layer in kept.layers:
                assert layer.key_reps.leftpad[:, 0].tolist() == [0, 15, 28]
            kept.crop(-1)  # per-row reps are not cropped: made again by the next call
            assert all(layer.key_reps is None for layer in kept.layers)
            ours(chosen[:, -1:], cache=kept)  # a call without the padding mask: plain reps, made afresh
            assert all(layer.key_reps.seqlens is None for layer in kept.layers)
        for b, prompt in enumerate(prompts):
            alone, alone_chosen, _ = greedy(ours, prompt, torch.ones_like(prompt), cache)
            assert torch.equal(chosen[b], alone_chosen[0]), b
            assert_close(logits[:, b], alone[:, 0], tol=1e-5)


@pytest.mark.parametrize("split", [30, 20])
def test_a_left_padded_prompts_next_chunk_is_each_row_alone(models, roles, split):
    """A left-padded batch's prompt in two chunks, and each row's logits in the second are those of its own prompt
    chunked at the same token. After 30 positions every row's padding is cached: the second chunk is one
    `attn_rows` call a layer over the cache's rows (`cache_seqlens`, `cache_leftpad`). After 20, a row's padding
    reaches into it: a call per row, since a padding query would join its tile's pooled query."""
    ours, _ = models
    set_options(ours, top_k=2)
    prompts = [tokens(1, n, seed=40 + i) for i, n in enumerate((60, 44, 38))]
    ids, mask = left_padded(prompts)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), warnings.catch_warnings():
        # a first chunk of 20 holds a row of padding alone: SDPA runs it (dense, as 2 blocks of top_k 2 are)
        warnings.simplefilter("ignore", kg_hf.KernelgenFallbackWarning)
        cache = transformers.DynamicCache(config=ours.config)
        ours(ids[:, :split], attention_mask=mask[:, :split], position_ids=positions[:, :split], cache=cache)
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        roles.clear()
        got = ours(ids[:, split:], attention_mask=mask, position_ids=positions[:, split:], cache=cache).logits
        assert (roles["attn_rows"], roles["attn"]) == ((2, 0) if split == 30 else (0, 2 * len(prompts)))
        for b, prompt in enumerate(prompts):
            first = split - (ids.shape[1] - prompt.shape[1])  # the row's tokens in the first chunk
            alone = transformers.DynamicCache(config=ours.config)
            if first > 0:
                ours(prompt[:, :first], cache=alone)
            assert_close(got[b, max(0, -first):], ours(prompt[:, max(0, first):], cache=alone).logits[0], tol=1e-5)


def test_a_padded_prompt_within_top_k_blocks_runs_sdpa_once(models, roles):
    """Rows whose keys fit in top_k blocks attend densely (every block listed): the padded batch runs one SDPA call
    a layer, the same attention as a call per row, with no warning and no kernelgen launch."""
    ours, sdpa = models
    set_options(ours, top_k=3)  # 3 blocks of 16: rows of up to 48 tokens
    ids, mask = left_padded([tokens(1, n, seed=40 + i) for i, n in enumerate((40, 25))])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, attention_mask=mask).logits
    assert not roles and torch.equal(got, sdpa(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_a_right_padded_training_batch_is_each_row_alone(models, roles, schedule):
    """Right padding (a training batch): one call a layer (`seqlens`), each row's logits at its tokens, and the
    gradients they give, are the row's alone; padding positions take no part. Either schedule."""
    ours, _ = models
    set_options(ours, top_k=2, schedule=schedule, q_tile=16 if schedule == "q_centric" else 64)
    rows = [tokens(1, n, seed=30 + i) for i, n in enumerate((40, 23))]
    ids, mask = torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :row.shape[1]], mask[b, :row.shape[1]] = row[0], 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, attention_mask=mask).logits
        assert roles["attn" if schedule == "q_centric" else "kv_attn"] == 2  # 2 layers, a call each
        loss = sum(got[b, :row.shape[1]].square().mean() for b, row in enumerate(rows))
        loss.backward()
        grad = ours.model.layers[0].self_attn.q_proj.weight.grad.clone()
        ours.zero_grad()
        alone = [ours(row).logits for row in rows]
        sum(a[0].square().mean() for a in alone).backward()
        want = ours.model.layers[0].self_attn.q_proj.weight.grad
        ours.zero_grad()
    for b, row in enumerate(rows):
        assert_close(got[b, :row.shape[1]].detach(), alone[b][0].detach(), tol=1e-5)
    assert_close(grad, want, tol=1e-4)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_packed_sequences_are_each_alone(models, roles, schedule):
    """Sequences packed in each row (position_ids that restart, no cache: a padding-free training batch, whose
    mask transformers makes block-diagonal) run attn.varlen: one padded batch a layer, no fallback; each
    sequence's logits and the gradients they give are the sequence's alone."""
    ours, _ = models
    set_options(ours, top_k=2, schedule=schedule, q_tile=16 if schedule == "q_centric" else 64)
    lengths = [(40, 24), (17, 40, 7)]  # a row each
    seqs = [[tokens(1, n, seed=40 + 3 * b + i) for i, n in enumerate(row)] for b, row in enumerate(lengths)]
    ids = torch.cat([torch.cat(row, 1) for row in seqs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    with warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, position_ids=positions, use_cache=False).logits
        # 2 layers, each: 40, 40, 24 in one padded batch, 17 and 7 alone (7 queries: a decode call)
        assert roles["attn" if schedule == "q_centric" else "kv_attn"] == 4
        got.square().mean(-1).sum().backward()
        grad = ours.model.layers[0].self_attn.q_proj.weight.grad.clone()
        ours.zero_grad()
        alone = [[ours(seq, use_cache=False).logits for seq in row] for row in seqs]
        sum(a.square().mean(-1).sum() for row in alone for a in row).backward()
        want = ours.model.layers[0].self_attn.q_proj.weight.grad
        ours.zero_grad()
    for b, row in enumerate(alone):
        assert_close(got[b:b + 1].detach(), torch.cat(row, 1).detach(), tol=1e-5)
    assert_close(grad, want, tol=1e-4)


def test_a_packed_mask_of_one_row_broadcasts_over_the_batch(models):
    """A block-diagonal 4-D mask [1, 1, N, N] given for a batch of 2 (SDPA broadcasts it) runs attn.varlen over
    each row, as the mask expanded to the batch does (it was a ValueError about cu_seqlens)."""
    ours, _ = models
    set_options(ours, top_k=2)
    seq = torch.cat([torch.zeros(17, dtype=torch.long), torch.ones(23, dtype=torch.long)])
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(40, 40, dtype=torch.bool).tril()
    ids = tokens(2, 40, seed=9)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, attention_mask=allowed[None, None], use_cache=False).logits
        want = ours(ids, attention_mask=allowed[None, None].expand(2, 1, 40, 40), use_cache=False).logits
    assert torch.equal(got, want)


def test_packed_sequences_compiled(models):
    """A compiled step over packed sequences cannot read their mask: before any eager call it stops at the mask's
    check, whose message names packed sequences and what to do; after an eager step it breaks the graph into
    that eager call, the eager logits bit for bit."""
    ours, _ = models
    set_options(ours, top_k=2)
    ids, positions = tokens(1, 40, seed=12), torch.cat([torch.arange(17), torch.arange(23)])[None]
    for module in ours.modules():  # as if compiled before any eager call
        module.__dict__.pop("_kernelgen_mask_refused", None)
    compiled = torch.compile(ours, backend="aot_eager")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"packed in a row: pass FlashAttention's varlen kwargs .*, or run one "
                                               "step eagerly first"):
            compiled(ids, position_ids=positions, use_cache=False)
        want = ours(ids, position_ids=positions, use_cache=False).logits
        assert torch.equal(compiled(ids, position_ids=positions, use_cache=False).logits, want)


def packed_batch(lengths, seed=0):
    """One row of packed sequences: ids [1, total], position_ids that restart, and FlashAttention's varlen kwargs
    as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them (two int32 tensors, two ints)."""
    ids = torch.cat([tokens(1, n, seed=seed + i) for i, n in enumerate(lengths)], 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = torch.tensor((0,) + tuple(lengths)).cumsum(0).to(torch.int32)
    return ids, positions, {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds.clone(), "max_length_q": max(lengths),
                            "max_length_k": max(lengths)}


def test_flash_attention_varlen_kwargs_bound_the_sequences(models, roles, monkeypatch):
    """FlashAttention's varlen kwargs with a mask causal over every token (none: position_ids that do not restart;
    or the causal one transformers builds where the model made a cache) bound the sequences, as in FlashAttention's
    varlen path: the logits are those of the block-diagonal mask over the same positions, bit for bit. Bounds of
    another dtype, or keys' bounds unlike the queries', are refused by name. The keys' bounds are compared with the
    queries' once for a pair of tensors, not in every layer (each comparison waits on the device)."""
    ours, _ = models
    set_options(ours, top_k=2)
    ids, _, kwargs = packed_batch((17, 40, 7), seed=60)
    sequence = torch.repeat_interleave(torch.arange(3), torch.tensor((17, 40, 7)))
    allowed = (sequence[:, None] == sequence[None, :]) & torch.ones(64, 64, dtype=torch.bool).tril()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, use_cache=False, **kwargs).logits
        assert roles["attn"] == 4  # 2 layers: 40 and 17 in one padded batch, 7 alone (a decode call)
        assert torch.equal(got, ours(ids, attention_mask=allowed[None, None], use_cache=False).logits)
        causal = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        assert torch.equal(ours(ids, attention_mask=causal, use_cache=False, **kwargs).logits, got)
        # with a cache, transformers builds the causal mask whatever position_ids say; the kwargs still bound
        positions = torch.cat([torch.arange(n) for n in (17, 40, 7)])[None]
        assert torch.equal(ours(ids, position_ids=positions, **kwargs).logits,
                           ours(ids, position_ids=positions, use_cache=False).logits)
        with pytest.raises(TypeError, match="cu_seq_lens_q must be int32"):
            ours(ids, use_cache=False, **{**kwargs, "cu_seq_lens_q": kwargs["cu_seq_lens_q"].long()})
        # without a cache, position_ids that restart make a packed mask: it must bound the kwargs' sequences, as a
        # compiled step's device check requires
        assert torch.equal(ours(ids, position_ids=positions, use_cache=False, **kwargs).logits,
                           ours(ids, position_ids=positions, use_cache=False).logits)
        elsewhere = torch.cat([torch.arange(n) for n in (20, 37, 7)])[None]
        with pytest.raises(ValueError, match="bound other sequences than the attention mask"):
            ours(ids, position_ids=elsewhere, use_cache=False, **kwargs)
        other = kwargs["cu_seq_lens_k"].clone()
        other[1] = 20
        with pytest.raises(ValueError, match="cu_seq_lens_k differs from cu_seq_lens_q"):
            ours(ids, use_cache=False, **{**kwargs, "cu_seq_lens_k": other})
        compared, equal, bounds = [], torch.equal, kwargs["cu_seq_lens_k"]
        monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(bounds is a or bounds is b) or equal(a, b))
        ours(ids, use_cache=False, **kwargs)
        assert sum(compared) == 0  # this pair was found equal before
        bounds[1] = 20  # a write: compared again, and refused
        with pytest.raises(ValueError, match="cu_seq_lens_k differs from cu_seq_lens_q"):
            ours(ids, use_cache=False, **kwargs)
        bounds[1] = 17
        assert torch.equal(ours(ids, use_cache=False, **kwargs).logits, got) and sum(compared) == 2


def test_a_compiled_packed_training_step_runs_in_the_graph(models, roles, compiled):
    """torch.compile(fullgraph=True) of a padding-free training step given FlashAttention's varlen kwargs: the
    sequences are attended in the graph as one padded batch a layer (the mask checked on the device against the
    kwargs), the loss and gradients are the eager step's, and batches whose longest sequence differs recompile
    once per doubling of it, not for each."""
    ours, _ = models
    set_options(ours, top_k=2)

    def loss_of(ids, positions, **kwargs):
        return ours(ids, position_ids=positions, labels=ids, use_cache=False, **kwargs).loss

    step = compiled(loss_of)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ours.train()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
            for lengths in ((17, 23), (40, 7), (9, 30, 5), (31, 2, 6)):
                ids, positions, kwargs = packed_batch(lengths, seed=70)
                ours.zero_grad()
                want = loss_of(ids, positions)
                want.backward()
                want_grad = ours.model.layers[0].self_attn.q_proj.weight.grad.clone()
                ours.zero_grad()
                roles.clear()
                got = step(ids, positions, **kwargs)
                assert roles["attn"] == 2, lengths  # one padded batch a layer, inside the graph
                got.backward()
                assert_close(got.detach(), want.detach(), tol=1e-5)
                assert_close(ours.model.layers[0].self_attn.q_proj.weight.grad, want_grad, tol=1e-4)
    finally:
        ours.eval()
    # the first batch; dynamic shapes (the longest sequence 40: padded to 64); the sequence count changed and the
    # longest halved (30, padded to 32); the longest sequence 31 then falls in that graph's range
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 3


def test_a_compiled_steps_packed_mask_is_checked_against_the_kwargs(models, compiled):
    """A compiled step whose mask bounds other sequences than FlashAttention's kwargs (and is not causal over every
    token) stops at the device-side check (on the CPU, a RuntimeError): never a wrong result."""
    ours, _ = models
    set_options(ours, top_k=2)
    ids, positions, kwargs = packed_batch((17, 23), seed=80)
    _, _, other = packed_batch((20, 20), seed=80)
    with torch.no_grad(), pytest.raises(RuntimeError, match="neither causal nor the block-diagonal causal mask"):
        compiled(lambda *a, **k: ours(*a, **k).logits)(ids, position_ids=positions, use_cache=False, **other)


def test_packed_sequences_under_inference_mode(models):
    """Under torch.inference_mode the mask (an inference tensor, no version counter) is read each layer: packed
    rows run attn.varlen, a padded batch its call (both were torch's RuntimeError about the counter)."""
    ours, _ = models
    set_options(ours, top_k=2)
    ids, positions = tokens(1, 40, seed=11), torch.cat([torch.arange(17), torch.arange(23)])[None]
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        calls = (lambda: ours(ids, position_ids=positions, use_cache=False).logits,
                 lambda: ours(tokens(2, 40), attention_mask=mask).logits)
        want = [call() for call in calls]
        with torch.inference_mode():
            got = [call() for call in calls]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_mask_with_holes_falls_back_to_sdpa_with_one_warning(models):
    ours, sdpa = models
    set_options(ours, top_k=2)
    ids = tokens(2, 40, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 7:9] = 0  # a hole among the row's tokens: not a padded row
    kg_hf._warned.clear()
    with torch.no_grad():
        with pytest.warns(kg_hf.KernelgenFallbackWarning, match="not purely causal over each row's tokens"):
            got = ours(ids, attention_mask=mask).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)  # once per reason
            ours(ids, attention_mask=mask)
        want = sdpa(ids, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_backward_runs_through_kernelgen(models, roles):
    ours, sdpa = models
    ids = tokens(1, 48, seed=4)
    set_options(ours, top_k=3)  # every block: gradients as SDPA's
    grads = []
    for model in (ours, sdpa):
        model.train()
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
        model.eval()
    assert roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2
    assert_close(grads[0], grads[1], tol=1e-3)


def prefill_then_decode(model, prompt, cache, steps):
    """Logits of a prefill of `prompt` and of `steps` greedy single-token steps after it, over `cache`."""
    out = [model(prompt, cache=cache).logits[:, -1]]
    for _ in range(steps):
        out.append(model(out[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("selector", ["mean", "multi:2"])
def test_key_reps_cache_selects_what_a_plain_cache_does(models, roles, selector):
    ours, _ = models
    prompt = tokens(2, 50, seed=5)  # 4 blocks of 16: 1 of the 3 before the diagonal block selected
    set_options(ours, top_k=2, selector=selector)
    with torch.no_grad():
        want = prefill_then_decode(ours, prompt, transformers.DynamicCache(config=ours.config), 2)
        roles.clear()
        cache = kg_hf.KeyRepsCache(config=ours.config)
        got = prefill_then_decode(ours, prompt, cache, 2)
    assert torch.equal(got, want)  # bit-identical lists, so identical logits
    assert roles["key_reps"] == 2 * 3 and roles["decode"] == 2 * 2  # 2 layers: the prompt, then 2 steps
    attn = kg_hf.get_kernel(kg_hf.layer_spec(ours.config))
    for layer in cache.layers:
        assert isinstance(layer, kg_hf.KeyRepsLayer) and layer.key_reps.n_k == 52
        assert torch.equal(layer.key_reps.reps, attn.key_reps(layer.keys).reps)  # extended = made at once


def test_decode_selects_from_the_kept_reps(models):
    """The layer's reps are what selection reads: reps of other keys give other lists, so other logits."""
    ours, _ = models
    prompt = tokens(1, 70, seed=6)
    set_options(ours, top_k=2, local=1)
    with torch.no_grad():
        cache = kg_hf.KeyRepsCache(config=ours.config)
        ours(prompt, cache=cache)
        step = prompt[:, -1:]
        want = ours(step, cache=cache).logits
        cache.crop(-1)
        attn = kg_hf.get_kernel(kg_hf.layer_spec(ours.config))
        for layer in cache.layers:  # the reps of reversed keys: the same length, other block means
            layer.key_reps = attn.key_reps(layer.keys.flip(2))
        got = ours(step, cache=cache).logits
    assert not torch.equal(got, want)


def test_key_reps_follow_the_cache_through_reorder_crop_and_batch_ops(models):
    ours, _ = models
    set_options(ours, top_k=3)
    attn = kg_hf.get_kernel(kg_hf.layer_spec(ours.config))
    with torch.no_grad():
        cache = kg_hf.KeyRepsCache(config=ours.config)
        ours(tokens(3, 70, seed=7), cache=cache)

        def assert_reps_match_the_keys():
            for layer in cache.layers:
                extended = attn.key_reps(layer.keys, previous=layer.key_reps)
                assert torch.equal(extended.reps, attn.key_reps(layer.keys).reps)

        cache.reorder_cache(torch.tensor([2, 0, 0]))
        assert_reps_match_the_keys()
        cache.crop(-7)  # 63 keys: the partial block is pooled again
        assert cache.layers[0].key_reps.n_k == 48
        assert_reps_match_the_keys()
        cache.batch_select_indices(torch.tensor([1, 2]))
        assert_reps_match_the_keys()
        cache.batch_repeat_interleave(2)
        assert cache.layers[0].key_reps.reps.shape[0] == 4
        assert_reps_match_the_keys()
        cache.reset()
        assert all(layer.key_reps is None for layer in cache.layers)


def test_key_reps_cache_without_a_config_and_its_refusals():
    cache = kg_hf.KeyRepsCache()
    assert cache.layer_class_to_replicate is kg_hf.KeyRepsLayer
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, top_k=2)
    reps = kernelgen.get_kernel(spec).key_reps(torch.randn(1, 1, 40, 64))
    assert reps.cropped(40).n_k == 32 and reps.cropped(15).reps.shape[2] == 0
    with pytest.raises(ValueError, match="n_k = 41"):
        reps.cropped(41)
    with pytest.raises(TypeError, match="n_k must be an int"):
        reps.cropped(16.0)
    assert torch.equal(reps.index_batch(torch.tensor([0, 0])).reps, reps.reps.repeat(2, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="outside these key_reps' batch of 1"):
        reps.index_batch(torch.tensor([1]))
    with pytest.raises(TypeError, match="integer or bool"):
        reps.index_batch(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="must pick batch rows"):
        reps.index_batch(0)


def test_a_modules_spec_follows_its_config(models):
    """The spec a module keeps is read again when the config's options change, an options object changed in
    place included."""
    ours, _ = models
    module = ours.model.layers[0].self_attn
    set_options(ours, top_k=2)
    assert kg_hf._module_spec(module).top_k == 2
    ours.config.kernelgen_top_k = 3
    assert kg_hf._module_spec(module).top_k == 3
    ours.config.kernelgen = {"backend": "auto"}
    assert kg_hf._module_spec(module).backend == "auto"
    ours.config.kernelgen["backend"] = "triton"
    assert kg_hf._module_spec(module).backend == "triton"
    ours.config.kernelgen = None


# ---- decode steps under torch.compile, over a static cache -----------------------------------------------

@pytest.fixture
def compiled(monkeypatch):
    """torch.compile as these tests use it: aot_eager (the graph as dynamo and AOTAutograd trace it, run
    eagerly: a CPU machine has no CUDA graphs), with the custom ops' kernels as the fixture's."""
    import kernelgen.custom_ops

    monkeypatch.setattr(kernelgen.custom_ops, "get_kernel", small_select_tiles)
    torch._dynamo.reset()
    yield lambda fn, fullgraph=True: torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
    torch._dynamo.reset()


def training_steps(ours, eager, compiled, ids, mask, labels, grads) -> list[tuple]:
    """[(loss, *grads(model))] of one training step over the same batch: `ours` compiled (with the `compiled`
    fixture's torch.compile), then `eager` as it is."""
    results = []
    for model, run in ((ours, compiled(lambda *a: ours(a[0], attention_mask=a[1], labels=a[2]).loss)),
                       (eager, lambda *a: eager(a[0], attention_mask=a[1], labels=a[2]).loss)):
        model.train()
        try:
            loss = run(ids, mask, labels)
            loss.backward()
        finally:
            model.eval()
        results.append((loss.detach(), *grads(model)))
    return results


def static_steps(model, step, prompt, steps, mask=None, cache=None):
    """Logits of a prefill of `prompt` (eager, as generate() runs it) into a StaticCache (`cache`, reset, or a
    new one) and of `steps` greedy single-token steps through `step` (model.forward, compiled or not), each
    given its cache position."""
    n = prompt.shape[1]
    if cache is None:
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    cache.reset()
    out = [model(prompt, attention_mask=mask, cache=cache).logits[:, -1]]
    for i in range(steps):
        if mask is not None:  # the padding mask generate() extends
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out.append(step(out[-1].argmax(-1, keepdim=True), attention_mask=mask, cache=cache,
                        cache_position=torch.tensor([n + i])).logits[:, -1])
    return torch.stack(out)


def test_a_compiled_decode_step_over_a_static_cache_runs_in_the_graph(models, roles, compiled):
    """fullgraph=True: the step traces with no graph break, its mask read on the device (`cache_seqlens`), its
    selection from the reps kept on the cache's keys; the logits are the eager steps'. The cache reset and
    refilled with another prompt gives a DynamicCache's logits: the kept reps follow the keys written over the
    old ones."""
    ours, _ = models
    set_options(ours, top_k=2)  # sparse: the diagonal block and one chosen from the reps, of 3 or 4
    prompt, other = tokens(2, 45, seed=8), tokens(2, 33, seed=10)
    with torch.no_grad():
        eager = static_steps(ours, ours, prompt, 2)
        roles.clear()
        cache = transformers.StaticCache(config=ours.config, max_cache_len=64)
        step = compiled(ours.forward)
        got = static_steps(ours, step, prompt, 2, cache=cache)
        assert roles["attn"] == 2 and roles["decode"] == 2 * 2  # the eager prompt, then 2 compiled steps a layer
        assert roles["key_reps"] == 2 * 3  # made with the prompt, grown by each step
        attn = kg_hf.get_kernel(kg_hf.layer_spec(ours.config))
        for layer in cache.layers:
            kept = layer.keys._kernelgen_reps
            assert kept.seqlens.eq(47).all()
            fresh = attn.key_reps(layer.keys, cache_seqlens=torch.full((2,), 47, dtype=torch.int32))
            assert torch.equal(kept.reps[:, :, :3], fresh.reps[:, :, :3])  # the blocks of the 47 keys
        again = static_steps(ours, step, other, 2, cache=cache)
        assert_close(again, prefill_then_decode(ours, other, transformers.DynamicCache(config=ours.config), 2), 1e-5)
    assert_close(got, eager, tol=1e-5)


def test_a_compiled_step_after_a_padded_prefill_runs_in_the_graph(models, compiled):
    """A left-padded batch's compiled steps read each row's tokens from the mask on the device (`cache_leftpad`):
    fullgraph, the eager steps' logits. After a prefill whose mask has holes (SDPA) the module's compiled steps run
    SDPA too (a graph break), where the mask they cannot read would otherwise stop the run."""
    ours, sdpa = models
    set_options(ours, top_k=2)
    prompt = tokens(2, 40, seed=9)
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    with torch.no_grad():
        got = static_steps(ours, compiled(ours.forward), prompt, 2, mask)
        assert_close(got, static_steps(ours, ours, prompt, 2, mask), tol=1e-5)
        holed = mask.clone()
        holed[0, 10] = 0
        kg_hf._warned.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kg_hf.KernelgenFallbackWarning)
            torch._dynamo.reset()
            got = static_steps(ours, compiled(ours.forward, fullgraph=False), prompt, 2, holed)
            assert_close(got, static_steps(sdpa, sdpa, prompt, 2, holed), tol=1e-5)
        ours(prompt)  # an unpadded call: the compiled step (recompiled) runs kernelgen's kernels again
    assert not any(m.__dict__.get("_kernelgen_mask_refused") for m in ours.modules())


def test_a_compiled_steps_mask_is_checked_on_the_device():
    causal = transformers.masking_utils.sdpa_mask(batch_size=2, q_length=2, kv_length=20, q_offset=torch.tensor(9),
                                                  allow_is_causal_skip=False)
    rows = (torch.tensor([11, 11], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32))
    assert all(map(torch.equal, kg_hf._rows_on_device(causal, 2, 20), rows))
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    assert all(map(torch.equal, kg_hf._rows_on_device(additive, 2, 20), rows))
    padded = causal.clone()
    padded[1, :, :, :3] = False  # left padding: row 1's tokens are keys 3..10
    assert kg_hf._rows_on_device(padded, 2, 20)[1].tolist() == [0, 3]
    holed, ahead, all_padding = causal.clone(), causal.clone(), causal.clone()
    holed[0, :, 1, 5] = False
    ahead[0, :, 0, 10] = True  # the first query sees the key after it
    all_padding[1, :, :, :10] = False  # 1 token for 2 queries: a query of padding
    for bad in (holed, ahead, all_padding, additive + 0.5, additive * 0.25):
        with pytest.raises(RuntimeError, match="not purely causal"):
            kg_hf._rows_on_device(bad, 2, 20)


def padded_batch(spans, n):
    """(ids, mask, labels) of rows whose tokens are keys [first, end) of n (padding before and after them)."""
    ids, mask = torch.zeros(len(spans), n, dtype=torch.long), torch.zeros(len(spans), n, dtype=torch.long)
    for b, (first, end) in enumerate(spans):
        ids[b, first:end], mask[b, first:end] = tokens(1, end - first, seed=40 + b)[0], 1
    return ids, mask, torch.where(mask.bool(), ids, -100)


def test_a_padded_batch_whose_every_row_is_padded_is_one_call(models, roles):
    """A training batch padded past its longest row (`pad_to_multiple_of`): its queries still sit at keys 0 ..
    n - 1, so it is one call a layer, each row's logits its own alone."""
    ours, _ = models
    set_options(ours, top_k=2)
    spans = [(0, 40), (0, 23)]
    ids, mask, _ = padded_batch(spans, 48)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        got = ours(ids, attention_mask=mask).logits
        assert roles["attn"] == 2
        for b, (first, end) in enumerate(spans):
            assert_close(got[b, first:end], ours(ids[b:b + 1, first:end]).logits[0], tol=1e-5)


@pytest.mark.parametrize("spans", [[(0, 48), (0, 48)], [(0, 40), (8, 48), (3, 30)]], ids=["whole", "padded"])
def test_a_compiled_training_step_runs_in_the_graph(models, roles, compiled, spans):
    """torch.compile(fullgraph=True) of a training step (loss and backward) over whole rows, and over a batch with a
    right-padded, a left-padded and a row padded on both sides: transformers hands each layer a 4-D mask, read and
    checked on the device, the rows moved to start at 0 and attended in one call; the loss and gradients are the
    eager step's."""
    ours, _ = models
    set_options(ours, top_k=2)
    ids, mask, labels = padded_batch(spans, 48)

    def step(ids, mask, labels):
        ours.zero_grad()
        loss = ours(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), ours.model.layers[0].self_attn.q_proj.weight.grad.clone()

    ours.train()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
            want = step(ids, mask, labels)
            roles.clear()
            got = compiled(lambda *a: ours(*a[:1], attention_mask=a[1], labels=a[2]).loss)(ids, mask, labels)
            assert roles["attn"] == 2  # one call a layer, inside the graph
            ours.zero_grad()
            got.backward()
            assert roles["bwd_dq"] == 2 and roles["bwd_dkdv"] == 2
            grad = ours.model.layers[0].self_attn.q_proj.weight.grad
    finally:
        ours.eval()
    assert_close(got.detach(), want[0], tol=1e-5)
    assert_close(grad, want[1], tol=1e-4)


def test_a_model_compiled_before_any_eager_call_runs_in_the_graph(roles, compiled, monkeypatch):
    """torch.compile(model, fullgraph=True) called first, as a FlexAttention user compiles: no eager call has kept
    each layer's spec on its module, so the layer reads it from the config while the compiler traces; the prompt's
    logits are the eager model's, with no graph break and no recompile."""
    monkeypatch.setattr(kg_hf, "get_kernel", small_select_tiles)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="kernelgen").eval()
    set_options(model, top_k=2)
    ids = tokens(1, 48, seed=3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kg_hf.KernelgenFallbackWarning)
        roles.clear()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        step = compiled(model)
        got = step(ids).logits
        assert roles["attn"] == 2  # one call a layer, inside the graph
        assert torch.equal(step(ids).logits, got)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
        assert_close(got, model(ids).logits, tol=1e-6)


def test_moved_rows_move_their_gradient_back():
    x = torch.randn(3, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    shift = torch.tensor([0, 3, 6], dtype=torch.int32)
    moved = kg_hf._RowsMoved.apply(x, shift)
    assert torch.equal(moved[1, :, 0], x[1, :, 3]) and torch.equal(kg_hf._RowsMoved.apply(moved, -shift), x)
    assert torch.autograd.gradcheck(lambda x: kg_hf._RowsMoved.apply(x, shift), (x,))


def test_a_compiled_prompts_mask_is_checked_on_the_device():
    n = 20
    causal = transformers.masking_utils.sdpa_mask(batch_size=3, q_length=n, kv_length=n, allow_is_causal_skip=False)
    padding = torch.ones(3, n, dtype=torch.long)
    padding[0, 15:], padding[1, :4], padding[2, :2], padding[2, 17:] = 0, 0, 0, 0
    padded = transformers.masking_utils.sdpa_mask(batch_size=3, q_length=n, kv_length=n, attention_mask=padding.bool(),
                                                  allow_is_causal_skip=False)
    firsts, ends = kg_hf._prompt_rows_on_device(padded, n)
    assert firsts.tolist() == [0, 4, 2] and ends.tolist() == [15, 20, 17]
    assert [x.tolist() for x in kg_hf._prompt_rows_on_device(causal, n)] == [[0] * 3, [n] * 3]
    additive = torch.where(padded, 0.0, torch.finfo(torch.float32).min)
    assert all(map(torch.equal, kg_hf._prompt_rows_on_device(additive, n), (firsts, ends)))
    holed, ahead, empty = padded.clone(), padded.clone(), padded.clone()
    holed[0, :, 9, 5] = False
    ahead[1, :, 6, 7] = True  # a query sees the key after it
    empty[2] = False  # a row of padding alone
    for bad in (holed, ahead, empty, additive + 0.5):
        with pytest.raises(RuntimeError, match="not purely causal"):
            kg_hf._prompt_rows_on_device(bad, n)


def gpu_llama():
    """A 2-layer bf16 Llama on the GPU, sparse: 8 blocks of 64 keys a list, 1 sink and 2 local blocks."""
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=1000,
                                      max_position_embeddings=8192, kernelgen_kv_block=64, kernelgen_q_tile=64,
                                      kernelgen_top_k=8, kernelgen_sink=1, kernelgen_local=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kernelgen",
                                                         dtype=torch.bfloat16).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_generate_over_a_static_cache_compiles_to_cuda_graphs(padded):
    """generate(cache_implementation="static") compiles the decode step (mode "reduce-overhead": CUDA graphs):
    no graph break, no step left out of the graphs, and the logits of the eager generate over a DynamicCache; a
    left-padded batch's too, and its padded row's first logits those of the row alone."""
    from torch._dynamo.utils import counters

    model = gpu_llama().eval()
    ids = torch.randint(1, 1000, (2, 3000), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :700], mask[1, :700] = 0, 0
    run = functools.partial(model.generate, ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                            do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    torch._dynamo.reset()
    counters.clear()
    triton_backend._ARRIVALS.clear()  # the compiled steps run kernelgen's decode first: nothing of theirs
    with torch.no_grad():                # may stay in the graphs' memory pool (cudagraph trees refuse to run)
        got = run(cache_implementation="static")
        again = run(cache_implementation="static")  # replayed from the graphs
        want = run()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert torch.equal(got.sequences, again.sequences)
    assert torch.equal(got.sequences[:, :3004], want.sequences[:, :3004])
    for step in range(3):  # the rest of the model compiled rounds otherwise: close, not equal
        a, b = got.logits[step].float(), want.logits[step].float()
        assert (a - b).norm() < 2e-2 * b.norm(), step
    if padded:
        with torch.no_grad():
            alone = model(ids[1:, 700:]).logits[0, -1].float()
        assert (want.logits[0][1].float() - alone).norm() < 2e-2 * alone.norm()


@pytest.mark.gpu
def test_a_compiled_training_step_on_the_gpu():
    """torch.compile (inductor) of a bf16 training step over a padded batch: no graph break, and the loss and
    gradients of the eager step."""
    from torch._dynamo.utils import counters

    model = gpu_llama().train()
    ids = torch.randint(1, 1000, (2, 4096), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, 3000:], mask[1, :500] = 0, 0
    labels = torch.where(mask.bool(), ids, -100)

    def step(forward):
        model.zero_grad()
        loss = forward(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()

    want = step(model)
    torch._dynamo.reset()
    counters.clear()
    # the lists are chosen from q and k's bf16 bits: inductor's fused rounding flips some (gradients then 9% apart)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        got = step(torch.compile(model))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (got[0] - want[0]).abs() < 2e-2 * want[0].abs()
    assert (got[1] - want[1]).norm() < 5e-2 * want[1].norm()


@pytest.mark.gpu
def test_a_compiled_packed_training_step_on_the_gpu():
    """torch.compile (inductor) of a bf16 padding-free training step given FlashAttention's varlen kwargs (the
    model makes a cache, so transformers builds a causal mask: the kwargs bound the sequences): no graph break, the
    loss and gradients of the eager step over the block-diagonal mask, and a third batch whose longest sequence
    stays in the second's power of two reuses its graphs."""
    from torch._dynamo.utils import counters

    model = gpu_llama().train()

    def batch(lengths):
        ids = torch.randint(1, 1000, (1, sum(lengths)), device="cuda")
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        bounds = torch.tensor((0,) + lengths, device="cuda").cumsum(0).to(torch.int32)
        return ids, positions, {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(lengths),
                                "max_length_k": max(lengths)}

    def step(forward, ids, positions, **kwargs):
        model.zero_grad()
        loss = forward(ids, position_ids=positions, labels=ids, **kwargs).loss
        loss.backward()
        return loss.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    graphs = []
    for lengths in ((3000, 700, 396), (2500, 1200, 300, 96), (2900, 1196)):
        ids, positions, kwargs = batch(lengths)
        want = step(model, ids, positions, use_cache=False)  # the block-diagonal mask, read on the host
        with torch._inductor.config.patch(emulate_precision_casts=True):  # as in the padded step's test
            got = step(compiled, ids, positions, **kwargs)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert (got[0] - want[0]).abs() < 2e-2 * want[0].abs(), lengths
        assert (got[1] - want[1]).norm() < 5e-2 * want[1].norm(), lengths
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1]  # dynamic shapes after the first batch; 2900 is padded to 4096 as 2500 was


@pytest.mark.gpu
def test_a_model_compiled_before_any_eager_call_on_the_gpu():
    """torch.compile(fullgraph=True, inductor) of a fresh bf16 model's prompt, before any eager call: kernelgen
    inside the graph, and the eager model's logits."""
    from torch._dynamo.utils import counters

    model = gpu_llama().eval()
    ids = torch.randint(1, 1000, (1, 4096), device="cuda")
    torch._dynamo.reset()
    counters.clear()
    # the lists are chosen from q and k's bf16 bits: inductor's fused rounding would flip some
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
        got = torch.compile(model, fullgraph=True)(ids).logits.float()
        want = model(ids).logits.float()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (got - want).norm() < 2e-2 * want.norm()

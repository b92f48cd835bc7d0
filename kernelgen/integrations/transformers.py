"""kernelgen's sparse attention as a Hugging Face transformers attention implementation, "kernelgen".

    import kernelgen.integrations.transformers      # registers "kernelgen" (register() does it again, harmlessly)
    config.kernelgen_top_k = 16                     # sparse options: below
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kernelgen")

Every attention call of the model then selects its KV blocks at run time and attends over them:
- **Prefill** (more than `roles.DECODE_MAX_QUERIES` queries): causal block-sparse attention with the spec's
  selector, bottom-right aligned, so that a prompt's chunk after a KV cache prefix sees the whole prefix.
- **Decode** (a few queries against the KV cache): the same spec's lists, served by the `decode` role
  (split-KV over each query's list).
- **Training**: q, k and v keep their autograd graph; the backward runs kernelgen's (the gradients of the lists
  the forward used).

The spec (one per model config and layer type, its kernels cached by `get_kernel`) takes the heads, KV heads
and head_dim from the config, and these options from config attributes `kernelgen_<option>`, or from a
`"kernelgen"` object in config.json, the form `kernelgen tune --model` reads (with options per layer type
under `"layer_types"`); an attribute wins over the object:

    top_k      blocks per list, forced blocks included (default 16)
    kv_block   keys per block (64)                q_tile     queries per list (64; Q-centric schedule)
    selector   "mean" or "multi:r" ("mean")        local      blocks ending at the diagonal (1)
    sink       leading blocks every list holds (0)
    schedule   "q_centric" or "kv_centric" ("q_centric")
    backend    a kernelgen backend or "auto" ("triton")

**Sliding-window layers** (transformers' `sliding_window`: gpt-oss's, Gemma's and Qwen2's "sliding_attention"
layers, every layer of a Mistral, Mixtral, Phi-3 or Starcoder2 whose config sets it) are kernelgen's too, with a
window spec (`Spec.window`, `tuning.model.window_spec`): their lists are the window's blocks, dense attention within
the window, so of their options only kv_block, q_tile and backend apply (a backend without windows gives "triton"),
and top_k = 0 (for the layer type, or for the model) still makes them not kernelgen's. kernelgen computes their calls,
the sinks joined, wherever the mask is exactly the sliding-window causal mask over each row's tokens, read on the host
(once per mask):
- *Prompts and training steps*, forward and backward (no keys cached before them; a fresh cache hands a sliding
  layer the whole prompt's keys): the plain call where the mask is over every token (or there is none, where the
  window cuts nothing); a padded batch (left- or right-padded, as transformers masks it: no token sees padding) in
  one call, `seqlens`, its left-padded rows moved to start at 0, a padding position's output 0, as in full layers;
  packed sequences (the block-diagonal mask transformers builds from position_ids that restart, where the model
  passes them to its masks: Mistral's and Qwen2's do, gpt-oss's do not) as `attn.varlen`, each sequence alone;
  FlashAttention's varlen kwargs bound the sequences where the mask is over every token (or none) or packed with the
  same bounds (a padded mask is read instead, as in full layers).
- *Decode steps and chunks after cached keys* (their queries the last of their keys, as transformers' caches hand
  them: `DynamicSlidingWindowLayer` the window's last keys, a full layer every key): the plain call where no row's
  padding is within a query's window (or there is no mask: a single query the window cuts nothing of); left padding
  as one call, `cache_seqlens` and `cache_leftpad`, each row over its keys from its first token (a padding query's
  output 0). A static cache's steps before its window fills (keys not yet written after the tokens) are not such
  calls.
Inside torch.compile a call with no mask (a prompt or a decode step the window cuts nothing of) runs in the graph
(its shapes read); a masked call breaks the graph into the eager call. Every other call of theirs (custom masks,
right padding in the cache, a packed mask whose sequences the kwargs bound otherwise, and what kernelgen cannot
compute) runs quietly what the layer runs without kernelgen: SDPA, or the model's eager attention where it has
attention sinks or soft-capping.

**Decoding with kept key representatives.** The `mean` and `multi:r` selectors score blocks by their keys'
means. A plain cache makes every call pool the whole cache again to choose a few blocks of it, which at long
context costs more than the decode itself. `KeyRepsCache`, a `DynamicCache` whose layers also keep those means
(`kernelgen.KeyReps`) and extend them as the cache grows, takes that away; the lists are bit-identical:

    cache = KeyRepsCache(config=model.config)
    model.generate(ids, cache=cache, max_new_tokens=256)

Its layers follow the cache through beam search's reordering, batch selection and repetition, and cropping.

**A static cache, compiled decode steps.** `generate(ids, cache_implementation="static")` preallocates the cache
and, on a GPU, compiles the decode step with torch.compile and replays it from CUDA graphs. kernelgen's steps run
inside those graphs: the custom ops of `kernelgen.custom_ops`, each row's tokens read from the mask on the device
(`cache_seqlens`, `cache_leftpad`), and the mask checked on the device to be causal over them (where it is not, a
device-side assertion stops the run: a compiled step cannot fall back). The blocks' means are kept with the cache
here too, on its key tensor, and grown in place by each call, eager or compiled, that writes keys into it. A
module whose last eager call fell back because of its mask (a custom mask) runs its compiled steps through SDPA
as well. A compiled prompt or training step (more than `DECODE_MAX_QUERIES` queries, no keys cached before it)
given a 4-D mask, which transformers builds while compiling with torch before 2.14, runs in the graph too: each
row's tokens read from the mask on the device and the mask checked there likewise, its rows moved to start at 0
and attended in one call (`seqlens`), as an eager padded batch is. One after cached keys runs outside the graph (a
graph break per layer), its mask read on the host.

**Padded batches.** A batch whose rows are padded (on the left, as generate() pads prompts, or on the right, as
a training batch is) computes each row over its own tokens, exactly as if it were alone: its blocks are counted
from its first token. A padding position's output is 0, as transformers' FlashAttention integration gives. A
decode step is one call (`cache_leftpad`, eager or compiled); so is a prompt or a training batch (`seqlens`, its
left-padded rows moved to start at 0), or, where every row's keys fit in top_k blocks (every block listed: dense
attention), one SDPA call with the mask (the same attention; its padding positions are SDPA's, read by nothing).
A prompt chunk after earlier keys whose queries are all tokens (left padding, all of it before the chunk) is one
call over the cache's rows (`cache_seqlens`, `cache_leftpad`); one that holds padding runs a call per row.

**Packed sequences.** A padding-free training batch (`position_ids` that restart, no cache: transformers then
builds a block-diagonal causal mask, as for `DataCollatorWithFlattening`'s batches) runs as `attn.varlen`, its
sequences read from the mask, each attended as if it were alone. Where the batch carries FlashAttention's varlen
kwargs (`cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q`, `max_length_k`, as
`DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them), they bound the sequences, as in
FlashAttention's varlen path, wherever the mask is causal over every token (none, or the one transformers builds
where the model made a cache, which drops the restarts) or packed; a mask with padding, or a custom one, is read
instead. A compiled step runs them in the graph (one padded batch), its mask checked on the device. Without those
kwargs a compiled step cannot read a packed mask on the device: once an eager call of the module has seen one, its
compiled calls break the graph into that eager call (attn.varlen); a module compiled before any eager call stops at
the mask's device-side check (on a GPU that ends the CUDA context), whose message says what to do.

Layers whose type (`config.layer_types`) is neither "full_attention" nor named under the object's `"layer_types"`
nor a sliding window's run SDPA (Llama 4's "chunked_attention", say), as do layers with `kernelgen_top_k = 0`. What
kernelgen cannot compute falls back to SDPA with a `KernelgenFallbackWarning` (quietly in sliding-window layers),
once per reason, never a wrong result: an attention mask that is not causal over each row's tokens (a custom 4-D
mask, an additive bias), dropout > 0, `output_attentions`, a sliding window in a layer whose spec has none (or
another one), soft-capping other than the spec's, a position bias, a non-causal module, a head_dim kernelgen has no
kernels for (or values of another head_dim than the queries'), and dtypes its kernels do not take on the device
(float32 on a GPU, bfloat16 in the CPU interpreter). Where the call has attention sinks or soft-capping, which SDPA
does not compute, the model's eager attention runs in SDPA's place (below).

**Soft-capping.** A model whose config sets `attn_logit_softcapping` (Gemma 2's 50.0; transformers passes it as
`softcap=`) has it in every kernelgen layer's spec (`Spec.softcap`), full and sliding-window layers alike (a backend
whose kernels do not cap gives "triton"; the KV-centric schedule is refused): kernelgen's calls cap each score,
`softcap * tanh(s / softcap)`, on every path above (prompts, padded and packed batches, decode steps with kept
reps, sliding layers' calls, the backward, compiled steps in the graph), and a padded prompt within top_k blocks
runs kernelgen, not SDPA. A call whose `softcap` is not its spec's, and every call that would run SDPA, which does
not cap, runs the model's own eager attention instead (as for sinks, below), which applies the cap: quietly in the
layers that are not kernelgen's and in sliding-window layers, with the `KernelgenFallbackWarning` in kernelgen's
others.

**Attention sinks.** A model whose attention has sinks (transformers' `s_aux=`, a logit per query head: gpt-oss,
DeepSeek-V4, MiMo-V2-Flash, ...) runs with them. kernelgen's calls join them (`sinks=`; a compiled step's custom op
call joins them after the op, in the graph), their gradient included, and a
padded prompt within top_k blocks runs kernelgen, not SDPA. Every call that would run SDPA, which ignores sinks,
runs the model's own eager attention instead (`eager_attention_forward` of the module's modeling file, which applies
the sinks, and a sliding window through the mask; given the additive mask transformers' "eager" builds): quietly in
the layers that are not kernelgen's (`kernelgen_top_k = 0`) and in sliding-window layers, with the
`KernelgenFallbackWarning` in kernelgen's others. Like attn_implementation="eager", it holds each call's scores
([B, H, Nq, Nk]): gpt-oss's and Gemma 2's sliding layers run their prompts, training steps and decode steps through
kernelgen (with the sinks, or the cap), so none of those materialises them (a padded or packed batch neither), but
the calls they fall back on do.
Sinks other than one logit per query head (per-token sinks) are such a call; a module whose file has no
`eager_attention_forward` is refused at one (a ValueError).
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import sys
import warnings
import weakref
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .. import custom_ops
from ..device import interpreting
from ..dispatch import get_kernel
from ..errors import KernelgenError, KernelgenValueError
from ..inputs import KeyReps, ReadOnce
from ..roles import DECODE_MAX_QUERIES
from ..spec import HEAD_DIMS, HEAD_DIMS_TEXT, Spec
from ..tuning.model import FULL, MODEL_OPTIONS, layer_type_specs
from ..varlen import check_cu_seqlens, check_max_seqlen, packed_attention

__all__ = ["NAME", "register", "layer_spec", "attention_forward", "KernelgenFallbackWarning",
           "KeyRepsCache", "KeyRepsLayer"]

log = logging.getLogger("kernelgen")

NAME = "kernelgen"
class KernelgenFallbackWarning(UserWarning):
    """An attention call that kernelgen cannot compute ran SDPA instead, or the model's eager attention where it has
    attention sinks or soft-capping (warned once per reason)."""


_warned: set[str] = set()


def _fall_back(reason: str, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """`_other_attention`, after a warning the first time `reason` comes up (with the attention it runs)."""
    beyond_sdpa = _beyond_sdpa(kwargs)
    if beyond_sdpa is None:
        runs = "SDPA"
    else:
        _model_eager(module, kwargs)  # or its refusal, before any warning
        runs = f"the model's eager attention (they have {beyond_sdpa[0]})"
    message = f"kernelgen attention: {reason}; such calls run {runs} instead"
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, KernelgenFallbackWarning, stacklevel=3)
    return _other_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _sinks(kwargs) -> torch.Tensor | None:
    """The call's attention sinks: `s_aux=` (gpt-oss, DeepSeek-V4, ...) or `sinks=`, or None."""
    for name in _SINK_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


_SINK_NAMES = ("s_aux", "sinks")


def _beyond_sdpa(kwargs) -> tuple[str, str] | None:
    """(what, its kwarg) of a call's attention that SDPA does not compute: attention sinks (which it would ignore),
    or soft-capping (`softcap=`: Gemma 2's attn_logit_softcapping); None where SDPA computes the call."""
    for name in _SINK_NAMES:
        if kwargs.get(name) is not None:
            return "attention sinks", f"{name}="
    if kwargs.get("softcap") is not None:
        return "soft-capping", "softcap="
    return None


def _other_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """The attention of a call kernelgen does not compute: SDPA, or, where the call has attention sinks or
    soft-capping (which SDPA would ignore), the eager attention of the module's modeling file
    (`eager_attention_forward`, which applies them; the sliding window too, through the mask), given the additive
    mask transformers' "eager" builds."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _beyond_sdpa(kwargs) is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _model_eager(module, kwargs)(module, query, key, value,
                                        _eager_mask(module, query, key, attention_mask, kwargs), scaling=scaling,
                                        dropout=dropout, **kwargs)


def _model_eager(module, kwargs):
    """The `eager_attention_forward` of the module's modeling file, or a KernelgenValueError where it has none."""
    where = type(module).__module__
    eager = getattr(sys.modules.get(where), "eager_attention_forward", None)
    if not callable(eager):
        what, name = _beyond_sdpa(kwargs)
        raise KernelgenValueError(f"kernelgen attention: this call has {what} ({name}), which SDPA does not "
                                  f"compute, and kernelgen does not compute it here; {where} has no "
                                  "eager_attention_forward to run instead: load the model with attn_implementation="
                                  "\"eager\" (or another implementation that applies them)")
    return eager


def _eager_mask(module, query, key, mask, kwargs) -> torch.Tensor | None:
    """The additive mask (0 or the dtype's minimum, in the queries' dtype) an eager attention function takes for
    what SDPA reads from `mask`, as transformers' "eager" mask interface builds it: None is causal from the top left
    (no mask for a single query or a non-causal module), a boolean mask allows its True entries."""
    if mask is None:
        causal = kwargs.get("is_causal")
        if query.shape[2] == 1 or not (getattr(module, "is_causal", True) if causal is None else causal):
            return None
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device), torch.finfo(query.dtype).min)


def register(name: str = NAME) -> None:
    """Make `name` an attention implementation of transformers (`attn_implementation=name`), with SDPA's mask
    construction (None where the mask is purely causal, else a 4-D boolean mask). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


# ---- the spec ------------------------------------------------------------------------------------------

def layer_spec(config, layer_type: str | None = None) -> Spec | None:
    """The spec kernelgen computes the attention of `config`'s layers of `layer_type` with (None: the
    config's only type, "full_attention"), or None where such layers are not kernelgen's (a layer type
    without sparse options and no sliding window, or top_k = 0): `tuning.model.layer_type_specs`, which `kernelgen
    tune --model` reads config.json with. A sliding-window layer's is a window spec (`tuning.model.window_spec`).
    Options no Spec takes, or a head_dim kernelgen has no kernels for, are a KernelgenValueError."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = {name: getattr(text, name, None) for name in _READ}
    values.update((name, value) for name, value in vars(text).items() if name.startswith("kernelgen_"))  # typos
    return _checked_spec(_spec(json.dumps(values, sort_keys=True, default=str), layer_type or FULL))


def _checked_spec(spec: Spec | None) -> Spec | None:
    if spec is not None and spec.selector in ("index", "given"):  # a model's attention passes neither
        raise KernelgenValueError(f"selector={spec.selector!r} takes {_SELECTOR_INPUTS[spec.selector]}, which a "
                                  "transformers model's attention does not pass: the integration selects with "
                                  "'mean' or 'multi:r'")
    return spec


_SELECTOR_INPUTS = {"index": "index vectors (index=(q_idx, k_idx, w))", "given": "block lists (block_idx=)"}


# what a module's spec is read from: the sparse options and the model's shape, as the config holds them
_READ = tuple(f"kernelgen_{name}" for name in MODEL_OPTIONS) + ("kernelgen", "num_attention_heads",
                                                                "num_key_value_heads", "head_dim", "hidden_size",
                                                                "layer_types", "sliding_window",
                                                                "use_sliding_window", "attn_logit_softcapping")


@functools.lru_cache(maxsize=64)
def _spec(values_json: str, layer_type: str) -> Spec | None:
    return layer_type_specs(json.loads(values_json)).get(layer_type)


def _module_spec(module) -> Spec | None:
    """layer_spec of an attention module's config and layer type, kept on the module while what it was read
    from holds the same values: reading it through the config's attribute lookup was most of the host time
    of a decode call's wrapper."""
    config = module.config
    kept = module.__dict__.get("_kernelgen_spec")
    if kept is not None and kept[0] is config:
        text, values, spec = kept[1:]
        state = vars(text)
        if len(state) == values[-1] and all(state.get(name) == value for name, value in zip(_READ, values)):
            return spec
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types, layer_idx = getattr(text, "layer_types", None), getattr(module, "layer_idx", None)
    spec = layer_spec(config, layer_types[layer_idx] if layer_types and layer_idx is not None else None)
    state = vars(text)
    # a copy of each value, so that an options object changed in place is seen as changed
    # (and how many attributes the config has: one added, a misspelt option say, reads it again)
    module.__dict__["_kernelgen_spec"] = (config, text, (*(copy.deepcopy(state.get(name)) for name in _READ),
                                                         len(state)), spec)
    # what a compiled step reads instead (plain constants: it cannot run this function): the spec's JSON text, the
    # blocks of the reps its selector keeps and its window; a compiled model keeps what its last eager call saw
    module.__dict__["_kernelgen_traced"] = _traced_of(spec)
    return spec


# what a compiled step reads of a module's spec: (JSON text or "", reps blocks, window, softcap)
_Traced = tuple[str, tuple | None, int | None, float | None]


def _traced_of(spec: Spec | None) -> _Traced:
    """(JSON text or "", reps blocks, window, softcap) of a module's spec, what its compiled steps read."""
    return ("", None, None, None) if spec is None else (spec.to_json(), _reps_blocks(spec), spec.window,
                                                        spec.softcap)


# ---- masks ---------------------------------------------------------------------------------------------

_read_masks = ReadOnce()  # the last mask's verdict: the layers of a step share one mask


class PaddedRows(NamedTuple):
    """A padded batch's mask, read: query i sits at key position `offset + i`, and batch row b's tokens are
    keys [firsts[b], ends[b]) (left padding before them, right padding after); its real queries are those at
    its tokens' positions. `pads` and `lens` (int32 [B], on the mask's device): firsts, and offset + n_q for
    every row, a decode call's `cache_leftpad` and `cache_seqlens`; `tokens` (likewise): each row's token count,
    a padded prompt's `seqlens` once its rows are moved to start at position 0."""
    offset: int
    firsts: tuple[int, ...]
    ends: tuple[int, ...]
    pads: torch.Tensor
    lens: torch.Tensor
    tokens: torch.Tensor

    def queries(self, b: int, n_q: int) -> range:
        """Row b's real queries."""
        return range(max(0, self.firsts[b] - self.offset), max(0, min(n_q, self.ends[b] - self.offset)))


class PackedRows(NamedTuple):
    """A mask of sequences packed in each row, as transformers builds it from position_ids that restart (a
    padding-free batch): each query sees its own sequence's keys up to itself. `cu_seqlens` (int32 [n + 1], on
    the mask's device): the sequences' bounds among the rows' tokens one after another (`attn.varlen`); `rows`
    and `n`: the mask's rows and tokens a row (a mask of one row broadcasts over the batch, `bounds`)."""
    cu_seqlens: torch.Tensor
    rows: int
    n: int
    repeated: dict  # batch -> a one-row mask's bounds over that many rows (one tensor: varlen reads it once)

    def bounds(self, batch: int) -> torch.Tensor:
        """cu_seqlens of a call of `batch` rows."""
        if self.rows == batch:
            return self.cu_seqlens
        if batch not in self.repeated:
            starts = self.cu_seqlens[:-1]
            self.repeated[batch] = torch.cat([*(starts + b * self.n for b in range(batch)),
                                              self.cu_seqlens[-1:] * batch])
        return self.repeated[batch]


def _visible_keys(mask, n_q: int, n_k: int) -> int | PaddedRows | PackedRows | str:
    """How many leading keys a call sees if `mask` is purely causal, bottom-right aligned over them (then
    the call attends over those keys, causally); the rows of a padded batch where each row's tokens are
    contiguous and causal among themselves; else why not (a str)."""
    if mask is None:
        # SDPA's reading of no mask: one query sees every key; more queries are causal from the top left,
        # over the first n_q keys (a static cache's empty prefill: the keys past them are not written yet)
        if n_q == 1 or n_q == n_k:
            return n_k
        return n_q if n_q < n_k else "more queries than keys without a mask"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (n_q, n_k):
        return f"an attention mask of shape {tuple(getattr(mask, 'shape', ()))} (expected None or 4-D [.., Nq, Nk])"
    return _read_masks.get((mask,), None, lambda: _mask_verdict(mask, n_q, n_k))  # its shape gives n_q, n_k


_HOLES = ("an attention mask that is not purely causal over each row's tokens (a custom 4-D mask, or a padding mask "
          "with a gap inside a row)")


def _allowed(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | bool]:
    """(allowed, plain) of a 4-D mask: its allowed entries, and whether every entry is allowed or blocked (a 0-d
    tensor for an additive mask, which must hold 0 or at most half its dtype's minimum: another value would weight
    the scores, which kernelgen does not)."""
    if mask.dtype == torch.bool:
        return mask, True
    allowed = mask == 0
    return allowed, (allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()


def _mask_verdict(mask: torch.Tensor, n_q: int, n_k: int) -> int | PaddedRows | PackedRows | str:
    allowed, plain = _allowed(mask)
    if not bool(plain):
        return "an additive attention mask with a bias (values other than 0 and -inf)"
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return "an attention mask that differs between heads"
    allowed = allowed[:, 0]
    # each row's tokens, read from what its last query sees (a right-padded row's last query sees all of them)
    last, keys = allowed[:, -1, :], torch.arange(n_k, device=mask.device)
    firsts = torch.where(last, keys, n_k).amin(-1)
    ends = torch.where(last, keys + 1, 0).amax(-1)
    counts, first, end = torch.stack([last.sum(-1), firsts, ends]).tolist()
    if min(counts) == 0:
        return "an attention mask whose last query sees no key (a row of padding alone, or a custom 4-D mask)"
    # where the queries sit: after a static cache's written keys (the last query's row ends there), or at 0 when
    # there are as many keys as queries (a prompt or a training batch, every row perhaps ending in padding)
    offset = 0 if n_q == n_k else max(end) - n_q
    if any(c != e - f for c, f, e in zip(counts, first, end)) or offset < 0:
        return _packed_rows(allowed) if n_q == n_k else _HOLES
    positions = offset + torch.arange(n_q, device=mask.device)
    expected = ((keys[None, None, :] <= positions[None, :, None]) & (keys >= firsts[:, None, None])
                & (keys < ends[:, None, None]))
    if not bool((allowed == expected).all()):
        return _packed_rows(allowed) if n_q == n_k else _HOLES
    if max(first) == 0 and min(end) == offset + n_q:
        return offset + n_q  # no padding
    pads = firsts.to(torch.int32)
    return PaddedRows(offset, tuple(first), tuple(end), pads, torch.full_like(pads, offset + n_q),
                      (ends - firsts).to(torch.int32))


def _packed_rows(allowed: torch.Tensor) -> PackedRows | str:
    """`allowed` ([B, N, N] bool) read as sequences packed in each row, where query i sees exactly keys
    [start, i] of the sequence it is in; else _HOLES. Read some queries at a time (2**26 positions, 512 MiB of
    int64): the positions of a whole 32k mask would take 8 GiB."""
    batch, n = allowed.shape[:2]
    chunk = max(1, (1 << 26) // (batch * n))
    keys = torch.arange(n, device=allowed.device)
    firsts, lasts, counts = [], [], []
    for start in range(0, n, chunk):
        rows = allowed[:, start:start + chunk]
        firsts.append(torch.where(rows, keys, n).amin(-1))
        lasts.append(torch.where(rows, keys, -1).amax(-1))
        counts.append(rows.sum(-1))
    firsts, lasts, counts = (torch.cat(x, 1) for x in (firsts, lasts, counts))  # [B, N] each
    starts = firsts == keys  # a sequence begins at this query
    same = torch.cat([starts[:, :1], firsts[:, 1:] == firsts[:, :-1]], 1)  # or continues the one before it
    if not bool(((lasts == keys) & (counts == keys - firsts + 1) & (starts | same)).all()):
        return _HOLES
    bounds = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([batch * n], device=allowed.device)])
    return PackedRows(bounds.to(torch.int32), batch, n, {})


# ---- a cache that keeps the selector's key representatives -----------------------------------------------

class KeyRepsLayer(DynamicLayer):
    """A `DynamicLayer` that also keeps the kernelgen selector's representatives of its keys (`key_reps`, a
    `kernelgen.KeyReps`, or None until an attention call makes them). The attention function finds the layer
    from the keys `update` returns, extends the reps over them and selects from the reps. Every operation that
    changes the keys other than by appending applies the same change to the reps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.key_reps: KeyReps | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        keys._kernelgen_reps_layer = weakref.ref(self)  # the attention call receives exactly this tensor
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.key_reps = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.key_reps is not None and self.key_reps.seqlens is not None:
            self.key_reps = None  # a padded batch's (per-row) reps: made again by the next call
        elif self.key_reps is not None:
            self.key_reps = self.key_reps.cropped(min(self.key_reps.n_k, self.get_seq_length()))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_reps is not None:
            self.key_reps = self.key_reps.index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.key_reps is not None:
            rows = torch.arange(self.key_reps.reps.shape[0], device=self.key_reps.reps.device)
            self.key_reps = self.key_reps.index_batch(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.key_reps is not None:
            self.key_reps = self.key_reps.index_batch(indices)


class KeyRepsCache(DynamicCache):
    """transformers' `DynamicCache` with `KeyRepsLayer`s in place of its plain `DynamicLayer`s (the layers of
    other kinds, sliding windows say, stay as they are): kernelgen's decode steps then select their blocks from
    kept representatives instead of pooling the whole cache. Takes DynamicCache's arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [_keeping_reps(layer) for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = KeyRepsLayer


def _keeping_reps(layer):
    if type(layer) is not DynamicLayer:
        return layer
    kept = KeyRepsLayer()
    if layer.is_initialized:
        kept.update(layer.keys, layer.values)
    return kept


def _reps_layer(key: torch.Tensor) -> KeyRepsLayer | None:
    """The KeyRepsLayer whose keys `key` is, or None."""
    ref = getattr(key, "_kernelgen_reps_layer", None)
    return None if ref is None else ref()


def _extendable(reps: KeyReps | None, spec: Spec, key: torch.Tensor, padded: bool = False) -> KeyReps | None:
    """`reps` if `key` extends the keys they were made from under this spec, and they are a padded batch's
    (per-row, `padded`) or not as the call is, else None (made afresh)."""
    if reps is None or (reps.kv_block, reps.groups) != (spec.kv_block, spec.groups):
        return None
    if (reps.seqlens is not None) != padded:
        return None
    if reps.reps.shape[:2] != key.shape[:2] or reps.n_k > key.shape[2] or reps.reps.device != key.device:
        return None
    return reps


# ---- the attention function ------------------------------------------------------------------------------

def _head_dims_unsupported(query, value) -> str | None:
    """Why kernelgen has no kernels of these head dims (SDPA has), or None."""
    if query.shape[-1] not in HEAD_DIMS:
        return f"head_dim={query.shape[-1]} (kernelgen's kernels take {HEAD_DIMS_TEXT})"
    if value.shape[-1] != query.shape[-1]:
        return f"a value head_dim ({value.shape[-1]}) unlike the query's ({query.shape[-1]})"
    return None


def _unsupported(module, query, dropout, kwargs, window: int | None = None,
                 softcap: float | None = None) -> str | None:
    """Why kernelgen cannot compute this call (beyond its mask) with a spec of this `window` (Spec.window) and
    `softcap` (Spec.softcap), or None."""
    if dropout and dropout > 0:
        return "dropout > 0"
    if kwargs.get("output_attentions"):
        return "output_attentions=True (kernelgen returns no attention weights)"
    sliding = kwargs.get("sliding_window")
    if sliding is not None and sliding != window:  # the module's window, which its mask applies too
        return "a sliding window" if window is None else f"a sliding window of {sliding} keys, not the spec's {window}"
    capped = kwargs.get("softcap")
    if capped != softcap:  # the module's soft-capping (attn_logit_softcapping), which the spec must apply
        return (f"soft-capping at {capped}, not the spec's {softcap}" if capped is not None and softcap is not None
                else f"soft-capping (softcap={capped}) unlike the spec's (softcap={softcap})")
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return "a non-causal attention module"
    sinks = _sinks(kwargs)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point()
                              or tuple(sinks.shape) != (query.shape[1],)):
        return (f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))} (kernelgen's take one logit per query "
                f"head, [{query.shape[1]}])")
    if query.device.type == "cuda":
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"{query.dtype} on a GPU (kernelgen's kernels take float16 and bfloat16 there)"
    elif not interpreting():
        return f"tensors on {query.device} (kernelgen runs on CUDA GPUs, or the CPU in Triton's interpreter)"
    elif query.dtype == torch.bfloat16:
        return "bfloat16 in Triton's CPU interpreter (it computes bfloat16 wrongly)"
    elif query.dtype not in (torch.float16, torch.float32):
        return f"{query.dtype} in Triton's CPU interpreter (kernelgen's kernels take float16 and float32 there)"
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query [B, H, Nq, D], key and value [B, Hkv, Nk, D] (the KV cache
    included) -> (attn_output [B, Nq, H, D], None)."""
    args = (module, query, key, value, attention_mask, scaling, dropout)
    traced = _in_graph(module, query, key, value, attention_mask, dropout, kwargs) if torch.compiler.is_compiling() \
        else None
    if traced is not None:
        return _attention_in_graph(*args, traced, kwargs)
    return _attention_eager(*args, **kwargs)


@torch.compiler.disable
def _attention_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """The call as it runs outside torch.compile, where the mask is read on the host (a graph break inside a
    compiled model, where `_in_graph` declines)."""
    args = (module, query, key, value, attention_mask, scaling, dropout)
    reason = _head_dims_unsupported(query, value)
    if reason:
        return _fall_back(reason, *args, **kwargs)
    spec = _module_spec(module)
    if spec is None:  # not kernelgen's layer: SDPA (the model's eager attention, for sinks or soft-capping)
        return _other_attention(*args, kwargs)
    if spec.window is not None:
        return _attention_window(spec, *args, kwargs)
    reason = _unsupported(module, query, dropout, kwargs, softcap=spec.softcap)
    if reason is None:
        n_keys = _visible_keys(attention_mask, query.shape[2], key.shape[2])
        reason = n_keys if isinstance(n_keys, str) else None
        # what a compiled step of this module, which cannot read its mask, should expect (see `_in_graph`; it
        # runs no packed sequences)
        module.__dict__["_kernelgen_mask_refused"] = reason is not None or isinstance(n_keys, PackedRows)
    if reason is not None:
        _forget_reps(key)  # this call's keys are written, and its reps will not see them
        return _fall_back(reason, *args, **kwargs)
    attn = get_kernel(spec)
    sinks = _sinks(kwargs)
    if sinks is not None:
        sinks = sinks.to(query.device)  # [Hq], checked by `_unsupported`
    # FlashAttention's varlen kwargs bound the sequences where the mask is causal over every token or packed (a
    # mask with padding, or a custom one, is read instead: FlashAttention's varlen path likewise takes a padding mask
    # first)
    packed = _flash_varlen(query, key, kwargs) if isinstance(n_keys, (int, PackedRows)) else None
    if packed is not None or isinstance(n_keys, PackedRows):  # each sequence alone, as its own call
        _forget_reps(key)
        bounds, max_length = (n_keys.bounds(query.shape[0]), None) if packed is None else _read_bounds(*packed)
        if packed is not None and isinstance(n_keys, PackedRows) and not _equal_bounds(n_keys.bounds(
                query.shape[0]), bounds):  # a compiled step's device check refuses this mask likewise
            raise KernelgenValueError(_MASK_BOUNDS)
        o = attn.varlen(*_flat(query, key, value), bounds, max_length, scale=scaling, sinks=sinks)
        return o.view(query.shape[0], query.shape[2], *o.shape[1:]), None
    if isinstance(n_keys, PaddedRows):
        return _attention_padded(module, attn, spec, query, key, value, n_keys, scaling, attention_mask, kwargs,
                                 sinks)
    if n_keys < key.shape[2]:  # a preallocated (static) cache, its first n_keys keys written
        lens = torch.full((key.shape[0],), n_keys, dtype=torch.int32, device=key.device)
        reps = _static_reps(attn, module.__dict__["_kernelgen_traced"][1], query, key, lens)
        if query.shape[2] > DECODE_MAX_QUERIES:  # a prompt: its own selection, over the keys written so far
            o = attn(query, key[:, :, :n_keys], value[:, :, :n_keys], scale=scaling, sinks=sinks)
        else:
            o = attn(query, key, value, scale=scaling, cache_seqlens=lens, key_reps=reps, sinks=sinks)
        return o.transpose(1, 2).contiguous(), None
    layer = _reps_layer(key) if spec.selection_role in ("select", "kv_select") else None
    if layer is None:
        o = attn(query, key, value, scale=scaling, sinks=sinks)
    else:  # selection from the layer's kept reps, extended over the keys appended since the last call
        layer.key_reps = attn.key_reps(key, previous=_extendable(layer.key_reps, spec, key))
        o = attn(query, key, value, scale=scaling, key_reps=layer.key_reps, sinks=sinks)
    return o.transpose(1, 2).contiguous(), None


def _attention_window(spec: Spec, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A sliding-window layer's call (its spec has a window), where its mask is exactly the sliding-window causal mask
    over each row's tokens, or over each packed sequence's (`_window_rows`). Its keys the queries' own tokens (a
    prompt or a training batch over no cache, or a fresh one, which hands a sliding layer the whole prompt's keys):
    kernelgen's plain call, a padded batch's (`seqlens`, left-padded rows moved to start at 0) or packed sequences'
    (`attn.varlen`). Its queries the last of its keys (a decode step or a chunk after cached keys): the plain call,
    or, with left padding, each row over its keys [first, Nk) (`cache_seqlens`, `cache_leftpad`). The sinks joined.
    Every other call (a custom mask, right padding in the cache, what kernelgen cannot compute) runs quietly what
    such a layer runs without kernelgen: SDPA, or the model's eager attention where it has attention sinks or
    soft-capping."""
    rows = None if _unsupported(module, query, dropout, kwargs, spec.window, spec.softcap) else _window_rows(
        spec.window, query, key, attention_mask, kwargs)
    if rows is None:
        return _other_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    sinks = _sinks(kwargs)
    if sinks is not None:
        sinks = sinks.to(query.device)  # [Hq], checked by `_unsupported`
    attn = get_kernel(spec)
    batch = query.shape[0]
    if isinstance(rows, _Sequences):  # each sequence alone, as its own call
        o = attn.varlen(*_flat(query, key, value), rows.cu_seqlens, rows.max_length, scale=scaling, sinks=sinks)
        return o.view(batch, query.shape[2], *o.shape[1:]), None
    if isinstance(rows, PaddedRows) and rows.offset > 0:  # after cached keys: row b over its keys [first, Nk)
        o = attn(query, key, value, scale=scaling, sinks=sinks, cache_seqlens=rows.lens.expand(batch).contiguous(),
                 cache_leftpad=rows.pads.expand(batch).contiguous())
    elif isinstance(rows, PaddedRows):  # each row alone, over its own tokens; a padding query's output is 0
        return _attention_padded_prompt(attn, query, key, value, rows.pads.expand(batch), rows.tokens, scaling,
                                        shifted=max(rows.firsts) > 0, sinks=sinks)
    else:
        o = attn(query, key, value, scale=scaling, sinks=sinks)
    return o.transpose(1, 2).contiguous(), None


class _Sequences(NamedTuple):
    """A window layer's packed sequences: `attn.varlen`'s bounds (int32 [n + 1]) and longest sequence (or None)."""
    cu_seqlens: torch.Tensor
    max_length: int | None


def _window_refused(window: int, query, key, kwargs) -> bool:
    """Whether a window spec's plain call is not the attention of this call without a mask (SDPA's reading: one query
    sees every key, more are causal from the top left; transformers gives a sliding layer no mask only where the
    window cuts nothing): it is where the keys are the queries' own tokens (as many) or a single query's (a decode
    step), no more than `window` of them, and no packed sequences (FlashAttention's varlen kwargs; a compiled step
    breaks the graph into the eager call for them)."""
    n_q, n_k = query.shape[2], key.shape[2]
    return n_q not in (1, n_k) or n_k > window or any(kwargs.get(name) is not None for name in _FLASH_VARLEN)


def _window_rows(window: int, query, key, mask, kwargs) -> bool | PaddedRows | _Sequences | None:
    """What a window spec computes this call as, where that is exactly the layer's attention: True (its plain call:
    the mask is the sliding-window causal mask over every token, or none where the window cuts nothing), the rows
    of a padded batch (each row's tokens contiguous, the mask the sliding-window causal one over them, none seen by
    or seeing padding), or packed sequences (the mask block-diagonal, the sliding-window causal mask over each
    sequence; or FlashAttention's varlen kwargs, which bound them where the mask is over every token or packed
    likewise, as for full layers: a padded mask is read instead); else None. A call after cached keys:
    `_window_cached_rows`."""
    n_q, n_k, batch = query.shape[2], key.shape[2], query.shape[0]
    if n_q != n_k:
        return _window_cached_rows(window, query, key, mask, kwargs)
    flash = None
    if any(kwargs.get(name) is not None for name in _FLASH_VARLEN):
        try:
            flash = _flash_varlen(query, key, kwargs)
            if flash is None:  # some of the four only
                return None
            flash = _Sequences(*_read_bounds(*flash))
        except KernelgenError:  # bounds kernelgen does not take: what the layer ran before
            return None
    if mask is None:  # SDPA's causal reading, which transformers gives only where the window cuts nothing
        return None if n_q > window else (flash or True)
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (n_q, n_k)
            or mask.shape[0] not in (1, batch)):
        return None
    rows = _read_window_masks.get((mask,), window, lambda: _window_verdict(mask, window))
    if isinstance(rows, PackedRows):
        bounds = rows.bounds(batch)
        if flash is not None and not _equal_bounds(bounds, flash.cu_seqlens):
            return None
        return _Sequences(bounds, None) if flash is None else flash
    if rows is True and flash is not None:
        return flash
    return rows


_read_window_masks = ReadOnce()  # the last window mask's verdict: the sliding layers of a step share one mask


def _window_cached_rows(window: int, query, key, mask, kwargs) -> bool | PaddedRows | None:
    """What a window spec computes a call after cached keys as (a decode step or a chunk, its queries the last Nq of
    its keys, as transformers' caches hand them), where that is exactly the layer's attention: True (its plain call:
    no mask for a single query the window cuts nothing of, or a mask that is the sliding-window causal one over
    every key), PaddedRows (the keys' left padding, `cache_leftpad`; `_window_cached_verdict`); else None, as for
    packed sequences' kwargs."""
    n_q, n_k, batch = query.shape[2], key.shape[2], query.shape[0]
    if n_q > n_k or any(kwargs.get(name) is not None for name in _FLASH_VARLEN):
        return None
    if mask is None:  # SDPA's reading: one query sees every key; more are causal from the top left (not the window)
        return True if n_q == 1 and n_k <= window else None
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (n_q, n_k)
            or mask.shape[0] not in (1, batch)):
        return None
    return _read_window_masks.get((mask,), window, lambda: _window_cached_verdict(mask, window))


def _window_cached_verdict(mask: torch.Tensor, window: int) -> bool | PaddedRows | None:
    """A 4-D mask [B or 1, H or 1, Nq, Nk] (Nq < Nk, query i at key position p = Nk - Nq + i; boolean, or additive
    of 0 and at most half its dtype's minimum), the same for every head, read as a window spec's call after cached
    keys: PaddedRows where each row's tokens are keys [first, Nk) (left padding alone) and each query of them sees
    exactly keys [max(first, p - window + 1), p] (a padding query, p < first, may see any: its output is 0), True
    where no row has padding that a query's window reaches; else None. A row's first token is the first key of its
    real queries: the longest run of queries up to the last that each see a run of keys ending at itself, no longer
    than the window."""
    n_q, n_k = mask.shape[-2:]
    ok, lows, highs, counts, _ = _query_spans(mask)  # [B, Nq] each
    positions = n_k - n_q + torch.arange(n_q, device=mask.device)
    spans = (highs == positions) & (counts == highs - lows + 1)  # a run of keys ending at the query
    looks_real = spans & (lows > positions - window)
    real_run = looks_real.flip(-1).to(torch.int32).cumprod(-1).flip(-1).bool()  # those up to the last query
    first = torch.where(real_run, lows, n_k).amin(-1, keepdim=True)  # [B, 1]
    first = torch.where(first <= positions[0] - window + 1, 0, first)  # padding no query's window reaches
    seen_exactly = spans & (lows == torch.maximum(first, positions - window + 1))
    ok = ok & (first < n_k).all() & (seen_exactly | (positions < first)).all()
    if not bool(ok):
        return None
    first = first[:, 0]
    firsts = first.tolist()
    if max(firsts) == 0:
        return True
    pads = first.to(torch.int32)
    return PaddedRows(n_k - n_q, tuple(firsts), (n_k,) * len(firsts), pads, torch.full_like(pads, n_k),
                      (n_k - first).to(torch.int32))


def _query_spans(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ok, firsts, lasts, counts, seen) of a 4-D mask [B or 1, H or 1, Nq, Nk]: whether it is plain (`_allowed`) and
    the same for every head (a 0-d tensor); each query's first and last allowed key (Nk and -1 where none) and how
    many it sees ([B, Nq] each); whether some query sees each key ([B, Nk]). Read some queries at a time (2**26
    positions): a 32k prompt's whole mask as int64 would take 8 GiB."""
    batch, heads, n_q, n_k = mask.shape
    chunk = max(1, (1 << 26) // (batch * heads * n_k))
    keys = torch.arange(n_k, device=mask.device)
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    seen = torch.zeros(batch, n_k, dtype=torch.bool, device=mask.device)
    firsts, lasts, counts = [], [], []
    for start in range(0, n_q, chunk):
        allowed, plain = _allowed(mask[:, :, start:start + chunk])
        ok = ok & plain & (allowed == allowed[:, :1]).all()
        rows = allowed[:, 0]  # [B, chunk, Nk]
        seen |= rows.any(1)
        firsts.append(torch.where(rows, keys, n_k).amin(-1))
        lasts.append(torch.where(rows, keys, -1).amax(-1))
        counts.append(rows.sum(-1))
    return (ok, *(torch.cat(x, 1) for x in (firsts, lasts, counts)), seen)


def _window_verdict(mask: torch.Tensor, window: int) -> bool | PaddedRows | PackedRows | None:
    """A 4-D mask [B or 1, H or 1, N, N] (boolean, or additive of 0 and at most half its dtype's minimum), the same
    for every head, read as a window spec's call: True where it is the sliding-window causal mask for every row
    (query i sees keys j with 0 <= i - j < window); PaddedRows where each row's tokens (the keys some query sees)
    are contiguous, [first, end), and query i sees exactly keys [max(first, i - window + 1), min(i, end - 1)] (none
    for left padding; transformers' mask lets a right-padding query see the row's last tokens); PackedRows where
    every query sees itself and query i sees exactly keys [max(start, i - window + 1), i] of the sequence it is in
    (which starts at the query that sees itself alone); else None. Each query's keys are read as their first, last
    and count (`_query_spans`), one wait on the device for each reading."""
    batch, n = mask.shape[0], mask.shape[-1]
    keys = torch.arange(n, device=mask.device)
    ok, firsts, lasts, counts, seen = _query_spans(mask)  # [B, N] each, query i at i
    # each row's tokens, and what each query sees of them
    first = torch.where(seen, keys, n).amin(-1, keepdim=True)
    end = torch.where(seen, keys + 1, 0).amax(-1, keepdim=True)
    low, high = torch.maximum(first, keys - window + 1), torch.minimum(keys, end - 1)
    expected = (high - low + 1).clamp(min=0)
    padded = (ok & (seen.sum(-1, keepdim=True) == end - first).all() & (end > first).all() & (counts == expected).all()
              & ((expected == 0) | ((firsts == low) & (lasts == high))).all())
    if bool(padded):
        first, end = first[:, 0], end[:, 0]
        first_list, end_list = first.tolist(), end.tolist()
        if max(first_list) == 0 and min(end_list) == n:
            return True
        pads = first.to(torch.int32)
        return PaddedRows(0, tuple(first_list), tuple(end_list), pads, torch.full_like(pads, n),
                          (end - first).to(torch.int32))
    starts = firsts == keys  # a query that sees itself alone starts a sequence
    sequence_start = torch.where(starts, keys, 0).cummax(-1).values
    packed = ok & ((lasts == keys) & (counts == keys - firsts + 1)
                   & (firsts == torch.maximum(sequence_start, keys - window + 1))).all()
    if not bool(packed):
        return None
    bounds = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([batch * n], device=mask.device)])
    return PackedRows(bounds.to(torch.int32), batch, n, {})


# FlashAttention's varlen kwargs: a padding-free batch's sequences among its rows' tokens one after another, which
# transformers passes to every attention call where the data collator gives them
# (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`)
_FLASH_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_KV_BOUNDS = ("kernelgen attention: cu_seq_lens_k differs from cu_seq_lens_q; kernelgen attends packed sequences "
              "over their own tokens (FlashAttention's varlen self-attention), so the two must be equal")
_MASK_BOUNDS = ("kernelgen attention: FlashAttention's varlen kwargs (cu_seq_lens_q) bound other sequences than the "
                "attention mask transformers built from position_ids that restart; give position_ids that restart "
                "where the kwargs' sequences start")


def _flash_varlen(query, key, kwargs) -> tuple[torch.Tensor, torch.Tensor, object] | None:
    """(cu_seq_lens_q, cu_seq_lens_k, max_length_q) of a call that carries all four of FlashAttention's varlen kwargs
    and whose keys are its queries' tokens (no cache before them), their bounds checked; else None."""
    values = [kwargs.get(name) for name in _FLASH_VARLEN]
    if any(value is None for value in values) or query.shape[2] != key.shape[2]:
        return None
    for name, bounds in zip(_FLASH_VARLEN, values[:2]):
        check_cu_seqlens(bounds, query.device, name)
    return values[0], values[1], values[2]


def _read_bounds(cu_seqlens, cu_seqlens_k, max_length) -> tuple[torch.Tensor, int | None]:
    """An eager call's bounds and longest sequence from FlashAttention's varlen kwargs: the keys' bounds must be the
    queries' (self-attention); a max_length tensor (transformers computes one from position_ids) is not read, as
    varlen reads the bounds."""
    if cu_seqlens_k is not cu_seqlens and not _equal_bounds(cu_seqlens, cu_seqlens_k):
        raise KernelgenValueError(_KV_BOUNDS)
    return cu_seqlens, max_length if isinstance(max_length, int) else None


_compared = ReadOnce(size=4)  # every layer compares the same tensors: the collator's two bounds, a packed mask's


def _equal_bounds(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal(a, b), which waits on the device, once per pair of tensors (`ReadOnce`)."""
    return _compared.get((a, b), None, lambda: torch.equal(a, b))


def _flat(*tensors: torch.Tensor):
    """[B, H, N, D] tensors in FlashAttention's varlen layout, [B * N, H, D]: the rows' tokens one after another."""
    return (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in tensors)


def _attention_padded(module, attn, spec: Spec, query, key, value, rows: PaddedRows, scaling, mask, kwargs,
                      sinks=None):
    """A padded batch's call: each row over its own tokens, as if it were alone (its blocks counted from its
    first token); a padding query's output is 0, as transformers' FlashAttention integration gives. A decode
    call whose queries are all tokens is one call (`cache_leftpad`); so is a prompt or a training batch
    (`seqlens`, its rows moved to start at position 0), or, where every row's keys fit in top_k blocks (every
    block listed: dense causal attention over the row's tokens) and neither attention sinks nor soft-capping (which
    SDPA does not compute), SDPA over the padded batch. So is a chunk after earlier keys (of a longer prompt) whose
    queries are all tokens (`cache_seqlens`, `cache_leftpad`: a prefill over the cache's rows); one that holds
    padding runs a call per row.
    `sinks`: the call's ([Hq], or None), joined by each kernelgen call."""
    batch, n_q = query.shape[0], query.shape[2]
    pads, lens = (x.expand(batch).contiguous() for x in (rows.pads, rows.lens))  # a mask of one row broadcasts
    static = rows.offset + n_q < key.shape[2]  # a preallocated cache, its first offset + n_q keys written
    reps = _static_reps(attn, module.__dict__["_kernelgen_traced"][1], query, key, lens, pads) if static else None
    layer = None if static or spec.selection_role not in ("select", "kv_select") else _reps_layer(key)
    whole = all(rows.queries(b if len(rows.firsts) > 1 else 0, n_q) == range(n_q) for b in range(batch))
    if n_q <= DECODE_MAX_QUERIES and whole:
        if layer is not None:  # reps of the left-padded cache, the last call's (the call grows them to lens)
            kept = _extendable(layer.key_reps, spec, key, padded=True)
            reps = layer.key_reps = (attn.key_reps(key, cache_seqlens=lens, cache_leftpad=pads) if kept is None
                                     else kept._with_room(key.shape[2]))
        o = attn(query, key, value, scale=scaling, cache_seqlens=lens, cache_leftpad=pads, key_reps=reps, sinks=sinks)
        return o.transpose(1, 2).contiguous(), None
    if layer is not None:
        layer.key_reps = None  # made by the next decode call
    row_keys = (min(end, rows.offset + n_q) - first for first, end in zip(rows.firsts, rows.ends))
    if sinks is None and spec.softcap is None and all(spec.n_kv_blocks(n) <= spec.top_k for n in row_keys):
        # dense: one SDPA call does in one launch what a call per row would (short prompts' launches, B of them
        # a layer, cost more than their attention)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
    if rows.offset == 0:
        return _attention_padded_prompt(attn, query, key, value, rows.pads.expand(batch), rows.tokens, scaling,
                                        shifted=max(rows.firsts) > 0, sinks=sinks)
    if whole:
        # a chunk after earlier keys whose queries are all tokens (left padding, all of it before the chunk): one
        # call over the cache's rows. A chunk that still holds padding runs a call per row: a padding query would
        # see no key, but it would join its Q tile's pooled query, and so choose the row's blocks
        o = attn(query, key, value, scale=scaling, cache_seqlens=lens, cache_leftpad=pads, key_reps=reps, sinks=sinks)
        return o.transpose(1, 2).contiguous(), None
    outputs = []
    for b in range(batch):
        row = b if len(rows.firsts) > 1 else 0
        real = rows.queries(row, n_q)
        keys = slice(rows.firsts[row], rows.offset + real.stop)
        parts = [query.new_zeros(1, query.shape[1], real.start, query.shape[3])] if real.start else []
        if len(real):
            parts.append(attn(query[b:b + 1, :, real.start:real.stop], key[b:b + 1, :, keys], value[b:b + 1, :, keys],
                              scale=scaling, sinks=sinks))
        if n_q > real.stop:
            parts.append(query.new_zeros(1, query.shape[1], n_q - max(real.stop, real.start), query.shape[3]))
        outputs.append(torch.cat(parts, 2))
    return torch.cat(outputs).transpose(1, 2).contiguous(), None


def _attention_padded_prompt(attn, query, key, value, firsts: torch.Tensor, tokens: torch.Tensor, scaling,
                             shifted: bool = True, sinks: torch.Tensor | None = None):
    """A padded prompt or training batch (its queries at keys 0 .. n_q - 1) in one call: each row moved to
    start at position 0 (right padding: where `shifted`, rows with left padding move), attended with `seqlens`
    (`tokens`: each row's token count), and moved back; the padding's output is 0. `attn`: a kernelgen callable,
    or the custom op's call (a compiled step's). `firsts`: each row's first token (int32 [B]). `sinks`: the call's
    attention sinks ([Hq], or None)."""
    batch, n = query.shape[0], query.shape[2]
    key, value = key[:, :, :n], value[:, :, :n]  # a static cache's keys past the prompt are not written
    if shifted:  # left padding: row b's token i to position i (and its padding after its tokens)
        query, key, value = (_RowsMoved.apply(x, firsts) for x in (query, key, value))
    o = attn(query, key, value, scale=scaling, seqlens=tokens.expand(batch).contiguous(), sinks=sinks)
    if shifted:
        o = _RowsMoved.apply(o, -firsts)
    return o.transpose(1, 2).contiguous(), None


def _rows_moved(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, D] with row b's position (i + shift[b]) mod N at position i."""
    n = x.shape[2]
    at = ((torch.arange(n, device=x.device) + shift[:, None]) % n)[:, None, :, None]
    return x.gather(2, at.expand(x.shape[0], x.shape[1], n, x.shape[3]))


class _RowsMoved(torch.autograd.Function):
    """`_rows_moved`, whose gradient is moved back by a gather too: a gather's own backward scatters, which
    CUDA's deterministic mode refuses (the moves are permutations, so no two values ever add)."""

    @staticmethod
    def forward(ctx, x, shift):
        ctx.save_for_backward(shift)
        return _rows_moved(x, shift)

    @staticmethod
    def backward(ctx, grad):
        shift, = ctx.saved_tensors
        return _rows_moved(grad, -shift), None


# ---- a static cache's kept reps --------------------------------------------------------------------------
# A static cache hands every attention call the same preallocated key tensor. The selector's representatives
# of its blocks are kept on that tensor (`_kernelgen_reps`, a KeyReps over per-row lengths) and grown in place
# each call, in eager calls and in compiled steps alike (a CUDA graph replays the growth). A call's n_q keys
# were just written at lens - n_q .. lens - 1, possibly over older ones (the cache reset or cropped, then
# refilled), so each row's reps are first cut back to lens - n_q: what was pooled before that is unchanged.
# A call that does not update them (one that runs SDPA) drops them; an operation that replaces the tensor
# (beam search's reorder) leaves them behind.

def _forget_reps(key: torch.Tensor) -> None:
    if getattr(key, "_kernelgen_reps", None) is not None:
        key._kernelgen_reps = None


def _reps_blocks(spec: Spec) -> tuple[int, int] | None:
    """(kv_block, groups) of the reps a spec's selector keeps, or None where it keeps none (a window spec's lists
    are its window's blocks, and its calls run over no cache)."""
    if spec.window is not None or spec.selection_role not in ("select", "kv_select"):
        return None
    return spec.kv_block, spec.groups


def _static_reps(attn, blocks: tuple[int, int] | None, query, key, lens,
                 pads: torch.Tensor | None = None) -> KeyReps | None:
    """The reps kept on static cache keys `key`, for a call over `lens` (int32 [B], on the device) and left
    padding `pads` (int32 [B] or None), which grows them to those rows itself; None for a spec whose selector
    keeps none (`blocks`: `_reps_blocks` of the spec). `attn`: get_kernel(spec) in an eager call, which makes
    them where there are none (once, at a static address, for CUDA graphs to replay); None in a compiled one,
    which without them lets its selection pool the keys."""
    if blocks is None:
        return None
    reps = getattr(key, "_kernelgen_reps", None)
    if reps is not None and ((reps.kv_block, reps.groups) != blocks or reps.n_k != key.shape[2]
                             or reps.reps.shape[:2] != key.shape[:2] or reps.reps.device != key.device):
        reps = None  # made under another spec
    if reps is None:
        if attn is None:
            return None
        reps = attn.key_reps(key, cache_seqlens=lens, cache_leftpad=pads)
        for kept in (reps.reps, reps.seqlens, reps.leftpad):
            torch._dynamo.mark_static_address(kept)
        key._kernelgen_reps = reps
        return reps
    # the keys each row's reps hold, cut back to the row's first key written by this call
    written = lens - query.shape[2] - (0 if pads is None else pads)
    reps.seqlens.copy_(torch.minimum(reps.seqlens, written.clamp(min=0)[:, None]))
    return reps


# ---- inside torch.compile ----------------------------------------------------------------------------------

def _traced_spec(module) -> _Traced:
    """The module's `_kernelgen_traced` for a module whose first call is traced, read from its config as the eager
    call reads it: the compiler reads the config's values (guarding them, so that a changed option recompiles),
    and `_traced_spec_of` makes them the spec while it traces (it cannot trace the spec's JSON and caches)."""
    config = module.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = tuple(getattr(text, name, None) for name in _READ)
    layer_types, layer_idx = getattr(text, "layer_types", None), getattr(module, "layer_idx", None)
    return _traced_spec_of(values, layer_types[layer_idx] if layer_types and layer_idx is not None else None)


@torch._dynamo.assume_constant_result
def _traced_spec_of(values: tuple, layer_type: str | None) -> _Traced:
    """`_traced_of` the spec of the config values `_READ` names: run once while the compiler traces, its result a
    constant. Its arguments are plain values, which every torch's compiler passes (torch 2.11's takes no module)."""
    return _traced_of(_checked_spec(_spec(json.dumps(dict(zip(_READ, values)), sort_keys=True, default=str),
                                          layer_type or FULL)))


def _in_graph(module, query, key, value, mask, dropout, kwargs) -> _Traced | None:
    """What a call being traced by torch.compile runs inside the graph with (`_traced_of` the spec: its JSON text,
    the reps' blocks, its window and softcap), where it can: a layer of kernelgen's, a call it computes (its
    softcap the spec's), and a mask it can read on the device (a window layer's: no mask, which its shapes read).
    Every other call (None) runs `_attention_eager` (a graph break: correct, slower; or what the eager call falls
    back on)."""
    # a compiled model keeps what its last eager call saw; a model compiled before any reads its config now
    if _head_dims_unsupported(query, value):
        return None
    traced = getattr(module, "_kernelgen_traced", None)
    if traced is None:
        traced = _traced_spec(module)
    if not traced[0] or _unsupported(module, query, dropout, kwargs, *traced[2:]):
        return None
    if traced[2] is not None:  # a window layer: what the eager call reads of its mask, known from the shapes
        return None if mask is not None or _window_refused(traced[2], query, key, kwargs) else traced
    packed = _flash_varlen(query, key, kwargs)
    if packed is not None:  # packed sequences, their bounds on the device; a tensor max_length is read on the host
        return traced if isinstance(packed[2], int) else None
    if mask is None:  # purely causal: the keys seen follow from the shapes
        return None if isinstance(_visible_keys(None, query.shape[2], key.shape[2]), str) else traced
    # a mask tensor, read on the device, unless this module's last eager call found its mask not causal over each
    # row's tokens (a custom mask)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or getattr(module, "_kernelgen_mask_refused", False):
        return None
    if query.shape[2] <= DECODE_MAX_QUERIES:  # a decode step (`cache_seqlens`, `cache_leftpad`)
        return traced
    # a prompt or a training batch with no keys before it, in one call (`seqlens`)
    return traced if key.shape[2] == query.shape[2] and tuple(mask.shape[-2:]) == (query.shape[2],) * 2 else None


def _attention_in_graph(module, query, key, value, mask, scaling, dropout, traced, kwargs):
    """The call as torch.compile traces it: the ops `kernelgen::sparse_attention` (opaque to the compiler,
    replayable in CUDA graphs), with no host read of any tensor."""
    spec_json, blocks = traced[:2]
    n_q, n_k = query.shape[2], key.shape[2]
    sinks = _sinks(kwargs)
    if sinks is not None:
        sinks = sinks.to(query.device)
    packed = _flash_varlen(query, key, kwargs)
    if packed is not None:  # packed sequences (FlashAttention's varlen kwargs), in one padded batch
        cu_seqlens, cu_seqlens_k, max_length = packed
        if cu_seqlens_k is not cu_seqlens:
            if cu_seqlens_k.shape != cu_seqlens.shape:
                raise KernelgenValueError(_KV_BOUNDS)
            torch._assert_async((cu_seqlens_k == cu_seqlens).all(), _KV_BOUNDS)
        if mask is not None:
            _packed_mask_on_device(mask, cu_seqlens, query.shape[0], n_q)

        def attn(q, k, v, **options):
            return custom_ops.sparse_attention(q, k, v, spec_json, scale=scaling, sinks=sinks, **options)

        max_length = check_max_seqlen(max_length, "max_length_q")
        o, _ = packed_attention(attn, *_flat(query, key, value), cu_seqlens, max_length)
        return o.view(query.shape[0], n_q, *o.shape[1:]), None
    if mask is None:
        n_keys = _visible_keys(None, n_q, n_k)  # from shapes alone
        o, _ = custom_ops.sparse_attention(query, key[:, :, :n_keys], value[:, :, :n_keys], spec_json, scale=scaling,
                                           sinks=sinks)
    elif n_q > DECODE_MAX_QUERIES:  # a prompt or a training batch: each row moved to start at 0, as eager calls do
        firsts, ends = _prompt_rows_on_device(mask, n_q)
        batch = query.shape[0]

        def attn(q, k, v, scale, seqlens, sinks):
            return custom_ops.sparse_attention(q, k, v, spec_json, scale=scale, seqlens=seqlens, sinks=sinks)[0]

        return _attention_padded_prompt(attn, query, key, value, firsts.expand(batch), ends - firsts, scaling,
                                        sinks=sinks)
    else:  # a decode step over a static cache: its rows read on the device, its kept reps grown in place
        lens, pads = _rows_on_device(mask, n_q, n_k)
        reps = _static_reps(None, blocks, query, key, lens, pads)
        o, _ = custom_ops.sparse_attention(query, key, value, spec_json, scale=scaling, cache_seqlens=lens,
                                           key_reps=reps, cache_leftpad=pads, sinks=sinks)
    return o.transpose(1, 2).contiguous(), None


def _packed_mask_on_device(mask: torch.Tensor, cu_seqlens: torch.Tensor, batch: int, n: int) -> None:
    """A device-side assertion that a compiled step's 4-D mask (of `batch` rows, or one that broadcasts) is what the
    eager call takes FlashAttention's kwargs with: causal over every token (transformers builds that where a cache
    was made), or the block-diagonal causal mask of the packed sequences `cu_seqlens` bounds among the rows' tokens
    (n a row), as transformers builds from position_ids that restart. Another (padding, a custom mask) stops the
    run; it never gives a wrong result."""
    allowed, plain = _allowed(mask)
    tokens = torch.arange(batch * n, device=mask.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens, tokens, right=True).view(-1, n)  # each token's, per row
    keys = torch.arange(n, device=mask.device)
    causal = keys[None, :] <= keys[:, None]
    visible = (sequence[:, :, None] == sequence[:, None, :]) & causal
    # compared as int8: inductor's value ranges of torch 2.11 fail on == between these boolean tensors
    seen, packed, causal = (x.to(torch.int8) for x in (allowed, visible, causal))
    ok = (seen == packed[:, None]).all() | (seen == causal).all()
    ok = ok & plain
    torch._assert_async(ok, "kernelgen attention: a compiled step given FlashAttention's varlen kwargs has an "
                            "attention mask that is neither causal nor the block-diagonal causal mask of the sequences "
                            "they bound (padding, or a custom mask); run it without torch.compile")


def _rows_on_device(mask: torch.Tensor, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tokens, keys [pads[b], lens[b]) (int32 [B] each), read from a decode call's 4-D mask with
    tensor ops alone, and a device-side assertion that the mask is purely causal over them, bottom-right
    aligned, every query one of its row's tokens: what the eager call checks on the host. A mask that is not
    stops the run; it never gives a wrong result."""
    allowed, plain = _allowed(mask)
    last, keys = allowed[:, 0, -1, :], torch.arange(n_k, device=mask.device)
    lens = torch.where(last, keys + 1, 0).amax(-1).to(torch.int32)
    pads = torch.where(last, keys, n_k).amin(-1).to(torch.int32)
    last_key = lens[:, None] - n_q + torch.arange(n_q, device=mask.device)[None, :]  # [B, Nq]: each query's
    visible = (keys[None, None, :] <= last_key[:, :, None]) & (keys[None, None, :] >= pads[:, None, None])
    ok = (allowed == visible[:, None]).all() & (lens - pads >= n_q).all()
    ok = ok & plain
    torch._assert_async(ok, "kernelgen attention: a compiled decode step's attention mask is not purely causal "
                            "over each row's tokens (a custom mask); run it without torch.compile")
    return lens, pads


def _prompt_rows_on_device(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(firsts, ends): each row's tokens, keys [firsts[b], ends[b]) (int32 [B] each), read from the 4-D mask of
    a prompt or a training batch (n queries at keys 0 .. n - 1) with tensor ops alone, and a device-side
    assertion that the mask is what the eager call accepts (`_mask_verdict`): purely causal over each row's
    tokens, a padding query's row seeing the tokens before it. A mask that is not stops the run; it never gives
    a wrong result."""
    allowed, plain = _allowed(mask)
    last, keys = allowed[:, 0, -1, :], torch.arange(n, device=mask.device)
    firsts = torch.where(last, keys, n).amin(-1).to(torch.int32)
    ends = torch.where(last, keys + 1, 0).amax(-1).to(torch.int32)
    visible = ((keys[None, None, :] <= keys[None, :, None]) & (keys >= firsts[:, None, None])
               & (keys < ends[:, None, None]))
    ok = (allowed == visible[:, None]).all() & (ends > firsts).all()
    ok = ok & plain
    torch._assert_async(ok, "kernelgen attention: a compiled prompt's or training step's attention mask is not "
                            "purely causal over each row's tokens (a custom mask, or sequences packed in a row: "
                            "pass FlashAttention's varlen kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs="
                            "True)), or run one step eagerly first, after which the module's compiled calls run them "
                            "eagerly); run it without torch.compile")
    return firsts, ends


register()

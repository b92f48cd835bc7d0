"""A whole model's attention specs, from its Hugging Face `config.json`: `kernelgen tune --model`, and the specs
kernelgen's transformers integration serves the model's layers (`attn_implementation="kernelgen"`), which are one:
a tune of the config tunes what the model runs.

The heads, KV heads and head_dim come from the model's config (a multimodal model's `text_config`); the sparse
options (MODEL_OPTIONS) from its defaults, then a `"kernelgen"` object in the same file, then `kernelgen_<option>`
keys (attributes of the loaded config). The attention is causal (a causal LM's). A model whose layers differ
(`layer_types`, e.g. "sliding_attention" and "full_attention") gets one spec per layer type that has sparse options:
`"kernelgen": {"top_k": 16, "layer_types": {"chunked_attention": {"top_k": 4, "local": 4}}}`; the options of
"full_attention" are the top-level ones, and a layer type without options (other than a sliding window's, below),
or with top_k 0, is not kernelgen's.

    {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_hidden_layers": 32,
     "kernelgen": {"kv_block": 128, "q_tile": 128, "top_k": 16}}

Sliding-window layers are kernelgen's by default, with a window spec (`Spec.window`: the config's `sliding_window`):
the "sliding_attention" layers (gpt-oss, Gemma, Qwen2, ...), or every layer of a model without `layer_types` whose
config sets `sliding_window` (Mistral, Mixtral, Phi-3, Starcoder2; not where `use_sliding_window` is false). Their
lists are the window's blocks (dense attention within the window, `selector="mean"`, top_k = `Spec.window_blocks`):
of their options only kv_block, q_tile and backend apply (a backend without sliding windows gives "triton"), and
top_k 0 still means not kernelgen's.

A config that sets `attn_logit_softcapping` (Gemma 2's 50.0) gives every kernelgen layer's spec, full and sliding
alike, that soft-capping (`Spec.softcap`); a backend whose kernels do not cap gives "triton", and the KV-centric
schedule, which does not cap either, is refused (a KernelgenValueError).
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import backends
from ..errors import KernelgenTypeError, KernelgenValueError
from ..spec import Spec
from .presets import GRID_MAX, Study

__all__ = ["read_model_config", "model_specs", "layer_type_specs", "window_spec", "model_studies", "MODEL_OPTIONS",
           "FULL", "SLIDING"]

# the sparse options of a model's attention, and their defaults
MODEL_OPTIONS = {"top_k": 16, "kv_block": 64, "q_tile": 64, "selector": "mean", "local": 1, "sink": 0,
                 "schedule": "q_centric", "backend": "triton"}
FULL = "full_attention"
SLIDING = "sliding_attention"


def read_model_config(path: str | Path) -> dict:
    """The model config (JSON object) at `path`."""
    try:
        config = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, RecursionError) as error:  # recursion: nesting deeper than the parser goes
        raise KernelgenValueError(f"--model {path}: not JSON ({error})") from None
    except UnicodeDecodeError:
        raise KernelgenValueError(f"--model {path}: not text; expected a Hugging Face config.json") from None
    except OSError as error:
        raise KernelgenValueError(f"--model {path}: {error.strerror or error}") from None
    if not isinstance(config, dict):
        raise KernelgenValueError(f"--model {path}: expected a JSON object (a Hugging Face config.json)")
    return config


def _positive_int(config: dict, name: str, default: Any = None) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KernelgenValueError(f"model config: {name} must be a positive int, got {value!r}")
    return value


def _sparse_options(options: Any, where: str) -> dict:
    if not isinstance(options, dict):
        raise KernelgenValueError(f"model config: {where} must be an object of sparse options, got {options!r}")
    unknown = sorted(set(options) - set(MODEL_OPTIONS) - {"causal", "layer_types"})
    if unknown:
        raise KernelgenValueError(f"model config: {where} has unknown options {unknown}; expected some of "
                                  f"{list(MODEL_OPTIONS)}")
    if options.get("causal", True) is not True:
        raise KernelgenValueError(f"model config: {where}.causal = {options['causal']!r}: a causal LM's attention is "
                                  "causal (leave causal out)")
    return {k: v for k, v in options.items() if k not in ("causal", "layer_types")}


def layer_type_specs(config: dict) -> dict[str, Spec | None]:
    """{layer type: its layers' spec, or None where they are not kernelgen's} for each layer type of the model,
    in layer order ("full_attention" for a model without `layer_types`)."""
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise KernelgenValueError("model config: text_config must be an object")
    heads = _positive_int(text, "num_attention_heads")
    heads_kv = heads if text.get("num_key_value_heads") is None else _positive_int(text, "num_key_value_heads")
    if heads % heads_kv:
        raise KernelgenValueError(f"model config: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={heads_kv}")
    if text.get("head_dim") is not None:
        head_dim = _positive_int(text, "head_dim")
    else:
        head_dim = _positive_int(text, "hidden_size") // heads
    ours = config.get("kernelgen", text.get("kernelgen"))
    ours = {} if ours is None else ours
    top = {**MODEL_OPTIONS, **_sparse_options(ours, "kernelgen")}
    origin = {name: f"kernelgen.{name}" for name in top if name in ours}  # where an option was set: errors name it
    unknown = sorted({key for key in (*text, *config) if key.startswith("kernelgen_")}
                     - {f"kernelgen_{name}" for name in MODEL_OPTIONS})
    if unknown:
        raise KernelgenValueError(f"model config: unknown options {unknown}; expected some of "
                                  f"{[f'kernelgen_{name}' for name in MODEL_OPTIONS]}")
    for name in MODEL_OPTIONS:  # kernelgen_<option> keys (a loaded config's attributes) win over the object
        value = text.get(f"kernelgen_{name}", config.get(f"kernelgen_{name}"))
        if value is not None:
            top[name], origin[name] = value, f"kernelgen_{name}"
    per_type = ours.get("layer_types", {})
    if not isinstance(per_type, dict):
        raise KernelgenValueError("model config: kernelgen.layer_types must map layer types to sparse options")
    layer_types = text.get("layer_types") or [FULL]
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise KernelgenValueError("model config: layer_types must be a list of layer type names")
    unknown = sorted(set(per_type) - set(layer_types) - {FULL})
    if unknown:
        raise KernelgenValueError(f"model config: kernelgen.layer_types names {unknown}, which the model's layer "
                                  f"types {list(dict.fromkeys(layer_types))} do not hold")
    softcap = _softcap(text)
    specs: dict[str, Spec | None] = {}
    for layer_type in dict.fromkeys(layer_types):
        window = _window(text, layer_type)
        if layer_type != FULL and layer_type not in per_type and window is None:
            specs[layer_type] = None  # no sparse options for it, no window: not kernelgen's layer
            continue
        own = _sparse_options(per_type.get(layer_type, {}), f"kernelgen.layer_types.{layer_type}")
        options = {**top, **own}
        where = {**origin, **{name: f"kernelgen.layer_types.{layer_type}.{name}" for name in own}}
        with _naming_options(where, options):
            if options["top_k"] == 0:
                specs[layer_type] = None
            elif window is not None:
                specs[layer_type] = window_spec(head_dim, heads // heads_kv, window, options, softcap)
            else:
                specs[layer_type] = _full_spec(head_dim, heads // heads_kv, options, softcap, layer_type)
    return specs


@contextlib.contextmanager
def _naming_options(where: dict, options: dict):
    """A Spec refusing an option's value names the config key the user set it with (`kernelgen_top_k`,
    `kernelgen.layer_types.<type>.top_k`), not only the Spec field."""
    try:
        yield
    except (KernelgenTypeError, KernelgenValueError) as error:
        named = [name for name in where if f"Spec.{name}" in str(error) or f"{name}=" in str(error)]
        if not named:
            raise
        raise type(error)(f"model config: {where[named[0]]} = {options[named[0]]!r}: {error}") from None


def _softcap(text: dict) -> float | None:
    """The config's logit soft-capping (`attn_logit_softcapping`: Gemma 2's 50.0), or None."""
    softcap = text.get("attn_logit_softcapping")
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise KernelgenValueError(f"model config: attn_logit_softcapping must be a positive number or null, got "
                                  f"{softcap!r}")
    return float(softcap)


def _full_spec(head_dim: int, gqa_group: int, options: dict, softcap: float | None, layer_type: str) -> Spec:
    """A layer's sparse spec from its `options`, capped at `softcap` (a backend that cannot cap gives "triton")."""
    if softcap is not None and options["schedule"] == "kv_centric":
        raise KernelgenValueError(f"model config: attn_logit_softcapping={softcap} with schedule 'kv_centric' (layer "
                                  f"type {layer_type}): the KV-centric schedule does not cap scores; use 'q_centric'")
    backend = _backend_for(options["backend"], window=None, softcap=softcap)
    return Spec(head_dim=head_dim, gqa_group=gqa_group, causal=True, **{**options, "backend": backend},
                softcap=softcap)


def _backend_for(backend, window: int | None, softcap: float | None):
    """The backend option, or "triton" where it names a backend whose kernels compute no sliding window (and the
    spec has one) or no soft-capping (and the spec caps)."""
    if isinstance(backend, str) and backend in backends.names():
        kernels = backends.get(backend)
        if (window is not None and not kernels.windows) or (softcap is not None and not kernels.softcaps):
            return backends.FALLBACK  # Triton, which computes every spec
    return backend


def _window(text: dict, layer_type: str) -> int | None:
    """The sliding window (keys) of a model's layers of `layer_type`, as transformers' modeling files apply it: the
    config's `sliding_window` for its "sliding_attention" layers, or for every layer of a model without
    `layer_types` (Mistral, Mixtral, Phi-3, Starcoder2, ...; unless `use_sliding_window` is false, as Qwen2's
    config.json has it); else None."""
    window = text.get("sliding_window")
    if window is None or text.get("use_sliding_window") is False:
        return None
    if layer_type != SLIDING and text.get("layer_types"):
        return None
    return _positive_int(text, "sliding_window")


def window_spec(head_dim: int, gqa_group: int, window: int, options: dict, softcap: float | None = None) -> Spec:
    """The spec of a sliding-window layer: causal, `window`, capped at `softcap` (None: not), its lists the window's
    blocks (dense attention within the window; selector "mean", top_k = `Spec.window_blocks`), kv_block, q_tile and
    backend from `options` (a backend without sliding windows, or without soft-capping where it caps, gives
    "triton")."""
    fields = dict(head_dim=head_dim, gqa_group=gqa_group, causal=True, window=window, kv_block=options["kv_block"],
                  q_tile=options["q_tile"], backend=_backend_for(options["backend"], window, softcap), softcap=softcap)
    return Spec(**fields, selector="mean", top_k=Spec(**fields, selector="given", top_k=1).window_blocks)


def model_specs(config: dict) -> list[tuple[str, Spec]]:
    """(layer type, spec) for each distinct attention spec of the model that kernelgen computes, in layer
    order."""
    specs: dict[Spec, str] = {}
    for layer_type, spec in layer_type_specs(config).items():
        if spec is not None:
            specs.setdefault(spec, layer_type)
    if not specs:
        raise KernelgenValueError(f"model config: no layer type has sparse options (layer types: "
                                  f"{list(layer_type_specs(config))}); add them under kernelgen.layer_types")
    return [(layer_type, spec) for spec, layer_type in specs.items()]


def model_studies(config: dict, seq: int, trials: int, arch: str, backend_names=None) -> Iterator[Study]:
    """Each distinct spec's attention (prefill, and decode where the backend has it) on every backend that runs
    on `arch`, and its selector, timed on the model's heads at `seq` tokens (batch 1)."""
    text = config.get("text_config", config)
    for layer_type, spec in model_specs(config):
        heads_kv = text.get("num_key_value_heads") or text["num_attention_heads"]
        workload = {"batch": 1, "heads_kv": heads_kv, "n_q": seq, "n_k": seq}
        label = f"{layer_type} (D{spec.head_dim} G{spec.gqa_group} top{spec.top_k})"
        for name in backend_names or backends.names():
            backend = backends.get(name)
            given = spec.replace(selector="given", backend=name)
            if "attn" not in backend.roles or backend.spec_unsupported(given) or backend.arch_unsupported(arch):
                continue
            for role in ("attn", "decode"):  # prefill; generation, a token at a time against the KV cache
                space = len(backend.config_space(given, role, arch)) if role in backend.roles else 0
                if space:  # else nothing of this backend fits the arch; a small space is searched whole
                    yield Study(f"{label} {role} {name}", given, role, seq,
                                space if space <= GRID_MAX else min(space, trials), workload)
        if spec.selects:  # the spec's selection role: select, or select_index (synthetic index inputs)
            yield Study(f"{label} {spec.selection_role}", spec, spec.selection_role, seq, trials, workload)

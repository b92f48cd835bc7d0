"""Selection quality: how much of a model's dense attention each selector's block lists keep.

    with kernelgen.quality.capture_qkv(model) as layers:      # q, k, v at each attention call
        model(tokens)
    rows = kernelgen.quality.selection_quality(layers, Spec(head_dim=128, kv_block=64, q_tile=64, causal=True),
                                               selectors=["mean", "multi:4"], top_ks=[4, 8, 16])

For each layer, selector and top_k, per query head:
- **recall**: the fraction of the dense softmax mass (causal as the spec is) that falls inside the blocks the
  selector lists for the query, averaged over queries (and batch). Queries that see no key are left out.
- **rel_error**: the relative L2 error of kernelgen's sparse output (the softmax renormalised over the listed
  blocks, docs/SEMANTICS.md) against the dense output, over the head's queries: `||o_sparse - o_dense|| /
  ||o_dense||`. Needs v.
- **inflation** (per-query lists, `Spec(schedule="kv_centric")`; NaN for Q-centric ones): how closely
  neighbouring queries' lists agree, as the KV-centric union design pays for it: the (query, block) pairs it
  computes over a tile of `tile_union.union_tile_q(G)` queries over those the lists hold, per KV head
  (`TileUnion.inflation`). `SparseAttention.prepare` serves the union design where it is at most
  `tile_union.union_max_inflation`, or the crossover of the spec's tuned winners of both designs on the GPU
  where the tuning DB holds them.

The dense softmax is computed a chunk of queries at a time (about `chunk_elements` scores per chunk): no
`Nq x Nk` tensor is held at once. `kernelgen quality --qkv FILE.pt` runs it from the command line.
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping

import torch

from .errors import KernelgenError, KernelgenTypeError, KernelgenValueError
from .inputs import Shapes, check_index, check_scale
from .interop import block_membership
from .spec import Spec

__all__ = ["capture_qkv", "load_qkv", "recorded_causal", "selection_quality", "summarize", "full_coverage_note",
           "write_csv", "plot_recall", "QUALITY_SELECTORS", "FIELDS", "ROOT"]

QUALITY_SELECTORS = ("mean", "multi:r", "index")
FIELDS = ("layer", "head", "selector", "top_k", "recall", "rel_error", "inflation")
_INDEX_KEYS = ("q_idx", "k_idx", "w")
ROOT = "<root>"  # capture_qkv's name for the model itself (named_modules() names it "")


@contextlib.contextmanager
def capture_qkv(model: torch.nn.Module, layers: Iterable[str] | None = None, *, device="cpu"):
    """Record q, k and v where a model calls attention: a context manager yielding a dict, filled during the
    forward passes run inside it, `{module name: {"q", "k", "v", "causal", "scale"}}`.

    It intercepts `torch.nn.functional.scaled_dot_product_attention`, so the tensors are those attention
    really sees (after RoPE, after any reshaping), with no dependency on the model's code: Hugging Face
    models loaded with `attn_implementation="sdpa"` (Llama's default), and any model that calls SDPA through
    `torch.nn.functional`. A model that calls another kernel (FlashAttention's, an eager softmax) is not seen.
    Each call is filed under the innermost module that made it (`model.named_modules()` names, e.g.
    `model.layers.3.self_attn`; "<root>" (`ROOT`) for the model's own forward); `layers` keeps only calls made
    inside the named modules (a name that is not a module of the model is a ValueError). Repeated calls of one
    module (several forward passes) are concatenated along the batch when their shapes agree, else filed as
    `name#2`, `name#3`, ...

    k and v repeated per query head before the call (Hugging Face's `repeat_kv`) are stored once per KV head.
    `causal` is True for `is_causal=True` or a mask that is exactly the bottom-right causal one, else False
    (`is_causal=True` with Nq != Nk, which SDPA aligns top-left, warns: kernelgen's causal mask is bottom-right;
    so does another mask, which is not kept);
    `scale` is the call's (None: 1/sqrt(D)). Tensors are detached and moved to `device` (None: left where they
    are)."""
    functional = torch.nn.functional
    if not isinstance(model, torch.nn.Module):
        raise KernelgenTypeError(f"capture_qkv: model must be a torch.nn.Module, got {type(model).__name__}")
    modules = {name or ROOT: module for name, module in model.named_modules()}
    if layers is not None:
        names = [layers] if isinstance(layers, str) else list(layers) if isinstance(layers, Iterable) else [layers]
        if not all(isinstance(name, str) for name in names):
            raise KernelgenTypeError(f"capture_qkv: layers must be a module's name or a list of them "
                                     f"(model.named_modules()), got {layers!r}")
        # "" (named_modules' name of the model) names it too
        layers = [name or ROOT for name in names]
        unknown = [name for name in layers if name not in modules]
        if unknown:
            raise KernelgenValueError(f"capture_qkv: layers {unknown} are not modules of the model (its names: "
                                      "model.named_modules())")
    hooked = layers if layers is not None else list(modules)
    inside: list[str] = []
    captured: dict[str, dict] = {}
    handles = []
    for name in hooked:
        module = modules[name]
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: inside.append(name)))
        handles.append(module.register_forward_hook(lambda m, args, out: inside.pop() and None, always_call=True))
    original = functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if inside:
            _record(captured, inside[-1], query, key, value, attn_mask, is_causal, scale, device)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)

    functional.scaled_dot_product_attention = recording
    try:
        yield captured
    finally:
        functional.scaled_dot_product_attention = original
        for handle in handles:
            handle.remove()


def _record(captured, name, query, key, value, attn_mask, is_causal, scale, device) -> None:
    q, k, v = (t.detach() if device is None else t.detach().to(device) for t in (query, key, value))
    k, v = _undo_repeat_kv(k, v)
    n_q, n_k = q.shape[-2], k.shape[-2]
    causal = bool(is_causal) or (attn_mask is not None and _is_causal_mask(attn_mask, n_q, n_k))
    if attn_mask is not None and not causal:
        warnings.warn(f"capture_qkv: {name} called scaled_dot_product_attention with an attn_mask that is not the "
                      "causal one (padding, a window, a bias): kernelgen records causal=False and keeps no mask, so "
                      "its quality is measured against attention without that mask, another than the model's",
                      stacklevel=3)
    if is_causal and n_q != n_k:
        warnings.warn(f"capture_qkv: {name} called scaled_dot_product_attention(is_causal=True) with Nq={n_q} != "
                      f"Nk={n_k}: SDPA aligns that mask top-left, kernelgen's causal mask (recorded causal=True) "
                      "bottom-right, so its quality is measured against another attention than the model's",
                      stacklevel=3)
    entry = {"q": q, "k": k, "v": v, "causal": causal, "scale": scale}
    same = captured.get(name)
    if same is not None and all(same[x].shape[1:] == entry[x].shape[1:] for x in "qkv") and \
            (same["causal"], same["scale"]) == (causal, scale):
        for x in "qkv":
            same[x] = torch.cat([same[x], entry[x]])
        return
    if same is not None:
        name = next(f"{name}#{i}" for i in range(2, 1 << 30) if f"{name}#{i}" not in captured)
    captured[name] = entry


def _undo_repeat_kv(k: torch.Tensor, v: torch.Tensor):
    """k and v with each group of identical consecutive heads (repeat_interleave'd KV heads) kept once."""
    heads = k.shape[1]
    for g in range(heads, 1, -1):
        if heads % g == 0:
            k1, v1 = k[:, ::g], v[:, ::g]
            if torch.equal(k1.repeat_interleave(g, 1), k) and torch.equal(v1.repeat_interleave(g, 1), v):
                return k1.contiguous(), v1.contiguous()
    return k, v


def _is_causal_mask(mask: torch.Tensor, n_q: int, n_k: int) -> bool:
    """Whether an SDPA attn_mask (bool: True keeps; float: -inf drops) is the bottom-right causal mask."""
    if mask.shape[-2:] != (n_q, n_k):
        return False
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    want = torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).tril(n_k - n_q)
    return bool((keep == want).all())


def load_qkv(path) -> dict[str, dict]:
    """The layers a .pt file holds: `{"layers": {name: {"q", "k"[, "v"][, "q_idx", "k_idx", "w"][, "causal"]
    [, "scale"]}}}` (what `torch.save({"layers": captured}, path)` writes after `capture_qkv`), or one layer's
    dict at the top level. Loaded with `weights_only=True` onto the CPU; a file torch.save did not write, or
    one holding other objects than tensors, is a KernelgenValueError of one line."""
    try:
        with warnings.catch_warnings():  # a pickle of another protocol: the error below says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001: torch.load raises pickle's and its own errors for a bad file
        raise KernelgenValueError(f"{path}: not a file of tensors that torch.save wrote ({_load_error(error)})") \
            from None
    if isinstance(data, Mapping) and "layers" in data:
        data = data["layers"]
    elif isinstance(data, Mapping) and "q" in data:
        data = {"layer": data}
    if not isinstance(data, Mapping) or not data or not all(isinstance(x, Mapping) for x in data.values()):
        raise KernelgenValueError(f"{path}: expected {{'layers': {{name: {{'q': ..., 'k': ..., 'v': ...}}}}}} or one "
                                  "layer's {'q': ..., 'k': ..., 'v': ...}")
    names = [str(name) for name in data]
    if len(set(names)) < len(names):  # a report names its layers by their text: two of one text would merge
        same = next(name for name in names if names.count(name) > 1)
        keys = [key for key in data if str(key) == same]
        raise KernelgenValueError(f"{path}: two layers are named {same!r} (keys {keys}); name each layer differently")
    return {str(name): dict(layer) for name, layer in data.items()}


def recorded_causal(name: str, layer: Mapping) -> bool:
    """A layer's recorded "causal" (False where it records none): a bool, or a one-element bool tensor."""
    causal = layer.get("causal", False)
    if isinstance(causal, torch.Tensor) and causal.numel() == 1 and causal.dtype == torch.bool:
        causal = bool(causal.item())
    if not isinstance(causal, bool):
        raise KernelgenTypeError(f"layer {name!r}: recorded causal must be a bool, got {type(causal).__name__} "
                                 f"{causal!r}")
    return causal


def _load_error(error: Exception) -> str:
    """torch.load's error in one line: the weights-only unpickler's own reason where it gives one (its message
    opens with advice to load with weights_only=False, which a file of tensors never needs), ANSI codes out."""
    if isinstance(error, KeyError):  # the weights-only unpickler's for a byte that is no pickle opcode
        return f"not a pickle: unknown opcode {error}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if reason is None and len(lines) > 1 and lines[0].startswith("Weights only load failed"):
        # torch's paragraph of advice first, then its reason (an unsupported GLOBAL, say), then a pointer to docs
        reason = re.match(r"(.+)", next((x for x in lines[1:] if not x.startswith("Check the documentation")), ""))
    line = reason.group(1) if reason else next(iter(lines), "")
    line = re.split(r"(?<=\.) ", line)[0]  # its first sentence: the rest is advice
    return f"{type(error).__name__}: {line[:200]}" if line else type(error).__name__


def selection_quality(layers: Mapping[str, Mapping], spec: Spec, selectors: Iterable[str], top_ks: Iterable[int], *,
                      scale: float | None = None, use_kernels: bool | None = None, device=None,
                      chunk_elements: int = 1 << 25) -> list[dict]:
    """Recall and output error of each selector and top_k, per layer and query head (module docstring).

    layers     `{name: {"q": [B, Hq, Nq, D], "k": [B, Hkv, Nk, D], "v" (optional), "q_idx", "k_idx", "w"
               (optional: the index selector's vectors, docs/SEMANTICS.md), "scale" (optional)}}`, as
               `capture_qkv` or `load_qkv` give.
    spec       kv_block, q_tile, causal, local, sink, schedule: the selection to measure. Its head_dim and
               gqa_group must be the tensors'; selector and top_k are replaced by each of `selectors`, `top_ks`.
    selectors  "mean", "multi:r" (e.g. "multi:4"), "index" (every layer must hold q_idx, k_idx and w).
    top_ks     list budgets, forced blocks included (each at least the spec's forced blocks).
    scale      softmax scale, a real number > 0 as a call takes (default: the layer's recorded "scale", else
               1/sqrt(D)).
    use_kernels  choose the lists with kernelgen's selection kernels (`get_kernel(spec).select`) or with the
               float64 reference (`kernelgen.reference.select_blocks`, the same math); default: the kernels for
               fp16 and bf16 on a CUDA device, the reference elsewhere (the CPU interpreter is slow).
    device     where to compute (default: q's device). Scores are float32 on a GPU, float64 on the CPU.

    Returns rows `{"layer", "head", "selector", "top_k", "recall", "rel_error", "inflation"}` (rel_error NaN
    without v, inflation NaN for Q-centric lists),
    layers in order, then selectors, top_ks and heads."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if not isinstance(layers, Mapping) or not layers:
        raise KernelgenValueError("layers must be a non-empty dict {name: {'q': ..., 'k': ..., 'v': ...}}")
    selectors, top_ks = _check_selectors(selectors), _check_top_ks(top_ks)
    device = _check_device(device)
    if use_kernels is not None and not isinstance(use_kernels, bool):  # a string would choose by its truth
        raise KernelgenTypeError(f"use_kernels must be None, True or False, got {use_kernels!r}")
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int):
        raise KernelgenTypeError(f"chunk_elements must be an int, got {type(chunk_elements).__name__} "
                                 f"{chunk_elements!r}")
    if chunk_elements < 1:
        raise KernelgenValueError(f"chunk_elements must be >= 1 (scores per chunk), got {chunk_elements}")
    specs = {(sel, top_k): spec.replace(selector=sel, top_k=top_k) for sel in selectors for top_k in top_ks}
    rows = []
    for name, layer in layers.items():
        rows += _layer_quality(str(name), layer, spec, specs, scale, use_kernels, device, chunk_elements)
    return rows


def _check_selectors(selectors) -> list[str]:
    if not isinstance(selectors, (str, Iterable)):
        raise KernelgenTypeError(f"selectors must be a selector's name or a list of them, e.g. ['mean', 'multi:4'], "
                                 f"got {type(selectors).__name__} {selectors!r}")
    selectors = [selectors] if isinstance(selectors, str) else list(selectors)
    if not selectors:
        raise KernelgenValueError(f"selectors is empty; expected some of {QUALITY_SELECTORS}")
    for sel in selectors:
        if not isinstance(sel, str):
            raise KernelgenTypeError(f"selectors must be names (str), e.g. 'mean', got {type(sel).__name__} {sel!r}")
        if sel == "given":
            raise KernelgenValueError(f"selectors: {sel!r} chooses no blocks; expected some of {QUALITY_SELECTORS}")
    return selectors


def _check_top_ks(top_ks) -> list[int]:
    if isinstance(top_ks, bool) or not isinstance(top_ks, (int, Iterable)) or isinstance(top_ks, str):
        raise KernelgenTypeError(f"top_ks must be an int or a list of ints >= 1, got {type(top_ks).__name__} "
                                 f"{top_ks!r}")
    top_ks = [top_ks] if isinstance(top_ks, int) else list(top_ks)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in top_ks):
        raise KernelgenTypeError(f"top_ks must be ints >= 1, got {top_ks!r}")
    if not top_ks or min(top_ks) < 1:
        raise KernelgenValueError(f"top_ks must be a non-empty list of ints >= 1, got {top_ks!r}")
    return sorted(set(top_ks))


def _check_device(device) -> torch.device | None:
    """Where to compute: None (q's device), or a CPU or a CUDA GPU present here."""
    if device is None:
        return None
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        raise KernelgenValueError(f"device must be cpu or cuda (cuda:N), a torch.device or its name, got {device!r}")
    if where.type == "cuda" and not (torch.cuda.is_available() and (where.index or 0) < torch.cuda.device_count()):
        raise KernelgenValueError(f"device={device!r}: no such CUDA GPU here ({torch.cuda.device_count()} visible)")
    return where


def _layer_tensors(name: str, layer, spec: Spec, device, uses_index: bool = False):
    if not isinstance(layer, Mapping):
        raise KernelgenTypeError(f"layer {name!r} must be a dict with 'q', 'k' and optionally 'v', got "
                                 f"{type(layer).__name__}")
    tensors = {}
    for key in ("q", "k", "v", *_INDEX_KEYS):
        t = layer.get(key)
        if t is None and key in ("q", "k"):
            raise KernelgenValueError(f"layer {name!r} has no {key!r} tensor")
        if t is not None and not isinstance(t, torch.Tensor):
            raise KernelgenTypeError(f"layer {name!r}: {key} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and (t.layout != torch.strided or t.device.type not in ("cpu", "cuda")):
            raise KernelgenValueError(f"layer {name!r}: {key} is a {t.layout} tensor on {t.device}; expected a dense "
                                      "(strided) tensor on the CPU or a CUDA GPU")
        tensors[key] = None if t is None else t.to(device if device is not None else layer["q"].device)
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if q.device.type not in ("cpu", "cuda"):
        raise KernelgenValueError(f"layer {name!r}: q is on {q.device}; expected cpu or cuda (or pass device=)")
    for key, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and (t.dim() != 4 or not t.is_floating_point()):
            raise KernelgenValueError(f"layer {name!r}: {key} must be a 4-D float tensor [B, H, N, D], got "
                                      f"{t.dtype} {tuple(t.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] or (v is not None and v.shape != k.shape):
        raise KernelgenValueError(f"layer {name!r}: q {tuple(q.shape)}, k {tuple(k.shape)}"
                                  f"{'' if v is None else f', v {tuple(v.shape)}'} do not fit q [B, Hq, Nq, D], "
                                  "k and v [B, Hkv, Nk, D]")
    if 0 in q.shape or 0 in k.shape:
        raise KernelgenValueError(f"layer {name!r}: q {tuple(q.shape)}, k {tuple(k.shape)}: B, H, N and D must be at "
                                  "least 1 (an empty input has no attention to measure)")
    for key, t in tensors.items():
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise KernelgenValueError(f"layer {name!r}: {key} holds NaN or infinite values; quality is measured on "
                                      "finite inputs")
    if q.shape[1] % k.shape[1]:
        raise KernelgenValueError(f"layer {name!r}: q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]}")
    if q.shape[-1] != spec.head_dim:
        raise KernelgenValueError(f"layer {name!r}: q.shape[-1] = {q.shape[-1]} but spec.head_dim = {spec.head_dim}")
    if q.shape[1] // k.shape[1] != spec.gqa_group:
        raise KernelgenValueError(f"layer {name!r}: q has {q.shape[1]} heads and k {k.shape[1]}, so G = "
                                  f"{q.shape[1] // k.shape[1]}, but spec.gqa_group = {spec.gqa_group}")
    index = tuple(tensors[x] for x in _INDEX_KEYS)
    if uses_index and all(t is not None for t in index):  # shapes as a call checks them, in float32 (any float)
        shapes = Shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], spec.n_q_tiles(q.shape[2]),
                        spec.n_kv_blocks(k.shape[2]))
        try:
            if not all(t.is_floating_point() for t in index):
                raise KernelgenTypeError(f"index: q_idx, k_idx and w must be float tensors, got "
                                         f"{', '.join(str(t.dtype) for t in index)}")
            check_index(tuple(t.float().contiguous() for t in index), spec.replace(selector="index"), shapes, q.device)
        except KernelgenError as error:
            raise type(error)(f"layer {name!r}: {error}") from None
    return q, k, v, (index if all(t is not None for t in index) else None)


def _select(q, k, spec: Spec, index, use_kernels) -> torch.Tensor:
    if spec.selector == "index" and index is None:
        raise KernelgenValueError("selector 'index' needs the layers' index vectors (q_idx, k_idx, w)")
    if use_kernels is None:  # the kernels take fp16 and bf16 on the GPU; fp32 inputs get the reference
        use_kernels = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if use_kernels:
        from .dispatch import get_kernel

        return get_kernel(spec).select(q.contiguous(), k.contiguous(), **({"index": index} if index else {}))
    from .reference import select_blocks

    return select_blocks(q, k, spec, index)


def _layer_quality(name, layer, base: Spec, specs: dict, scale, use_kernels, device, chunk_elements) -> list[dict]:
    uses_index = any(spec.selector == "index" for spec in specs.values())
    q, k, v, index = _layer_tensors(name, layer, base, device, uses_index)
    scale = _layer_scale(name, layer, scale, q.shape[-1])
    b, hq, n_q, _ = q.shape
    g, n_k = base.gqa_group, k.shape[2]
    n_blocks, kv_block, per_list = base.n_kv_blocks(n_k), base.kv_block, base.list_queries
    # a budget past the blocks there are lists them all: its lists are selected at that many slots
    lists = {key: _select(q, k, _capped(spec, n_blocks), index if spec.selector == "index" else None, use_kernels)
             for key, spec in specs.items()}
    member = {key: block_membership(idx, n_blocks) for key, idx in lists.items()}  # [B, Hkv, n_lists, n_blocks]
    # per KV head, over the batch: how much the union design would compute beyond the lists (per-query lists)
    inflation = {key: (_inflation(idx, g, n_blocks) if base.per_query else torch.full((hq // g,), math.nan))
                 for key, idx in lists.items()}
    work = torch.float64 if q.device.type == "cpu" else torch.float32
    kd = k.to(work).repeat_interleave(g, 1)
    vd = None if v is None else v.to(work).repeat_interleave(g, 1)
    zeros = torch.zeros(hq, dtype=torch.float64, device=q.device)
    recall = {key: zeros.clone() for key in specs}
    err_sq = {key: zeros.clone() for key in specs}
    dense_sq, counted = zeros.clone(), zeros.clone()
    pad = n_blocks * kv_block - n_k
    rows_per_chunk = max(per_list, chunk_elements // max(1, b * hq * n_k) // per_list * per_list)
    for start in range(0, n_q, rows_per_chunk):
        rows = torch.arange(start, min(start + rows_per_chunk, n_q), device=q.device)
        s = (q[:, :, rows].to(work) @ kd.transpose(-1, -2)) * scale  # [B, Hq, R, Nk]
        if base.causal:
            s = s.masked_fill(torch.arange(n_k, device=q.device) > rows[:, None] + (n_k - n_q), -torch.inf)
        lse = torch.logsumexp(s, -1, keepdim=True)
        if bool((torch.isnan(lse) | (lse == torch.inf)).any()):
            raise KernelgenValueError(f"layer {name!r}: the scores q·k overflow {work} (inputs too large)")
        seen = torch.isfinite(lse)  # rows with a visible key; the others have no dense attention to keep
        s = torch.nn.functional.pad(s, (0, pad), value=-torch.inf).view(b, hq, len(rows), n_blocks, kv_block)
        p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
        o_dense = None if vd is None else p.flatten(-2)[..., :n_k] @ vd
        counted += seen.sum((0, 2, 3)).double()
        if o_dense is not None:
            dense_sq += (o_dense.square() * seen).sum((0, 2, 3)).double()
        block_mass = p.sum(-1)  # [B, Hq, R, n_blocks]
        lists = rows // per_list
        for key in specs:
            held = member[key][:, :, lists].repeat_interleave(g, 1)  # [B, Hq, R, n_blocks]
            kept = (block_mass * held).sum(-1, keepdim=True)  # the mass inside the listed blocks
            recall[key] += (kept * seen).sum((0, 2, 3)).double()
            if o_dense is not None:  # the softmax over the listed keys alone, from the scores: never the dense
                # probabilities renormalised, which underflow to 0 where the listed keys lie far below the others
                o_sparse = torch.softmax(s.masked_fill(~held[..., None], -torch.inf).flatten(-2), -1)
                o_sparse = o_sparse.nan_to_num(0.0)[..., :n_k] @ vd  # a list of no visible key: o = 0
                err_sq[key] += ((o_sparse - o_dense).square() * seen).sum((0, 2, 3)).double()
    out = []
    for (sel, top_k) in specs:
        for h in range(hq):
            rel = math.sqrt(err_sq[sel, top_k][h] / dense_sq[h]) if vd is not None and dense_sq[h] > 0 else math.nan
            out.append(dict(layer=name, head=h, selector=sel, top_k=top_k,
                            recall=float(recall[sel, top_k][h] / counted[h]) if counted[h] else math.nan,
                            rel_error=rel, inflation=float(inflation[sel, top_k][h // g])))
    return out


def _capped(spec: Spec, n_blocks: int) -> Spec:
    """`spec` with its top_k at most the `n_blocks` there are (and at least its forced blocks): the same lists."""
    return spec.replace(top_k=max(min(spec.top_k, n_blocks), spec.n_forced))


def _layer_scale(name: str, layer, scale, head_dim: int) -> float:
    """The softmax scale, checked as a call's: `scale`, else the layer's recorded one, else 1/sqrt(D)."""
    if scale is None:
        scale = layer.get("scale")
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:  # a file may hold it as a tensor
            scale = scale.item()
        if scale is None:
            return 1.0 / math.sqrt(head_dim)
        try:
            return check_scale(scale)
        except KernelgenError as error:
            raise type(error)(f"layer {name!r}: recorded {error}") from None
    return check_scale(scale)


def _inflation(lists: torch.Tensor, g: int, n_blocks: int) -> torch.Tensor:
    """float64 [Hkv]: the union design's inflation of each KV head's per-query lists, over the batch."""
    from .reference import normalize_block_idx
    from .tile_union import build_tile_union, union_tile_q

    lists = normalize_block_idx(lists, n_blocks)
    computed, held = build_tile_union(lists, union_tile_q(g), n_blocks).pair_counts(lists)
    return (computed.sum(0).double() / held.sum(0).clamp(min=1)).cpu()


def summarize(rows: list[dict]) -> list[dict]:
    """Per selector and top_k, over every layer and head: recall mean and min, rel_error mean and max, inflation
    mean (NaN for Q-centric lists), and the (layer, head) of the lowest recall."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["selector"], row["top_k"]), []).append(row)
    out = []
    for (sel, top_k), group in groups.items():
        recalls = [r["recall"] for r in group if r["recall"] == r["recall"]]
        errors = [r["rel_error"] for r in group if r["rel_error"] == r["rel_error"]]
        worst = min((r for r in group if r["recall"] == r["recall"]), key=lambda r: r["recall"], default=None)
        inflations = [r["inflation"] for r in group if r["inflation"] == r["inflation"]]
        out.append(dict(selector=sel, top_k=top_k, recall_mean=_mean(recalls),
                        recall_min=min(recalls, default=math.nan), rel_error_mean=_mean(errors),
                        rel_error_max=max(errors, default=math.nan), inflation_mean=_mean(inflations),
                        worst=None if worst is None else f"{worst['layer']} head {worst['head']}"))
    return out


def full_coverage_note(top_ks: Iterable[int], n_blocks: int) -> str | None:
    """The note for the budgets that list every one of `n_blocks` KV blocks (their recall is 1 whatever the
    selector), or None when there is none: printed under a report beside its table."""
    whole = [t for t in top_ks if t >= n_blocks]
    if not whole:
        return None
    return (f"top_k {', '.join(map(str, whole))}: at least the {n_blocks} KV blocks there are, so every block is "
            "listed (recall 1 says nothing of the selectors there)")


def _mean(values) -> float:
    return sum(values) / len(values) if values else math.nan


def write_csv(rows: list[dict], path) -> str:
    """quality.csv: one row per (layer, head, selector, top_k), then the summary rows (layer and head "all":
    recall, rel_error and inflation are the means over every layer and head)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(FIELDS)
        for row in rows:
            writer.writerow([row[x] for x in FIELDS])
        for row in summarize(rows):
            writer.writerow(["all", "all", row["selector"], row["top_k"], row["recall_mean"], row["rel_error_mean"],
                             row["inflation_mean"]])
    return str(path)


def plot_recall(rows: list[dict], path) -> str | None:
    """A PNG of recall (mean over layers and heads, and the lowest head, dashed) and the mean rel_error against
    top_k, one colour per selector. Needs matplotlib (optional); without it, says so and returns None."""
    from .bench.plot import pyplot

    plt = pyplot()
    if plt is None:
        return None
    summary = summarize(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, sel in enumerate(dict.fromkeys(r["selector"] for r in summary)):
        pts = sorted((r["top_k"], r["recall_mean"], r["recall_min"], r["rel_error_mean"]) for r in summary
                     if r["selector"] == sel)
        top_ks = [p[0] for p in pts]
        axes[0].plot(top_ks, [p[1] for p in pts], marker="o", color=f"C{i}", label=f"{sel} (mean)")
        axes[0].plot(top_ks, [p[2] for p in pts], linestyle="--", color=f"C{i}", label=f"{sel} (lowest head)")
        # full coverage is exact (error ~1e-16): a floor keeps the log axis on the errors that matter
        axes[1].plot(top_ks, [max(p[3], 1e-6) for p in pts], marker="o", color=f"C{i}", label=sel)
    budgets = sorted({r["top_k"] for r in summary})
    for ax, label in zip(axes, ("attention-mass recall", "relative L2 error of the output (floor 1e-6)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(t) for t in budgets])
        ax.set_xlabel("top_k (blocks per list)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)

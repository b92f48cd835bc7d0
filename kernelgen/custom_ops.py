"""kernelgen as torch.library custom ops, so that torch.compile traces through it without graph breaks.

    from kernelgen.custom_ops import sparse_attention, select_blocks
    o, lse = sparse_attention(q, k, v, spec, block_idx=None, scale=None)   # inside torch.compile too
    o, lse = sparse_attention(q, k, v, spec, index=(q_idx, k_idx, w))      # Spec(selector="index")
    o, lse = sparse_attention(q, k_cache, v_cache, spec, cache_seqlens=lens)  # decode over per-row lengths
    o, lse = sparse_attention(q, k_cache, v_cache, spec, cache_seqlens=lens, cache_leftpad=pads)  # left-padded
    o, lse = sparse_attention(q, k_pages, v_pages, spec, block_table=table, cache_seqlens=lens)  # a paged cache
    reps = key_reps(k_cache, spec, cache_seqlens=lens)                    # the selector's kept representatives
    key_reps(k_cache, spec, cache_seqlens=lens, previous=reps)            # grown in place (a CUDA graph replays it)
    o, lse = sparse_attention(q, k_cache, v_cache, spec, cache_seqlens=lens, key_reps=reps)
    o, lse = sparse_attention(q, k, v, spec, seqlens=lens)               # a right-padded batch, one call

The ops take the spec as its JSON text (a string is a valid op argument; a dataclass is not), and the index
selector's tensors as three optional arguments, and dispatch to `get_kernel(spec)`, so they run exactly the kernels
and checks of the eager API. Their fake (meta) implementations give output shapes and dtypes without running
anything.

`kernelgen::sparse_attention` backpropagates (`torch.library.register_autograd`): it also returns the lists
it attended over (in the kernels' form; given or selected), which its backward, the op
`kernelgen::sparse_attention_backward`, reads instead of selecting again. lse backpropagates too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys

import torch

from . import dispatch
from .dispatch import clear_padding, get_kernel
from .errors import KernelgenRuntimeError, KernelgenTypeError, KernelgenValueError
from .inputs import (INDEX_LAYOUT, BlockLists, KeyReps, autocast_qkv, check_kv_scale_value, check_kv_scales,
                     check_reps_fit_capacity, check_reps_length, check_scale, describe_index, lists_type_error,
                     refuse_cast_cache, refuse_forward_ad, refuse_function_transforms, refuse_grad_with_seqlens,
                     refuse_unpaired_new_keys)
from .sinks import check_sinks, with_sinks
from .spec import Spec

__all__ = ["sparse_attention", "select_blocks", "key_reps"]


@functools.lru_cache(maxsize=256)
def _spec_of(spec_json: str) -> Spec:
    # the ops take the spec as text; parsed once per text, not on every call
    return Spec.from_json(spec_json)


def _index(q_idx, k_idx, w):
    """The `index=` of the eager API from the ops' three optional tensors (None when none is given)."""
    return None if q_idx is None and k_idx is None and w is None else (q_idx, k_idx, w)


@torch.library.custom_op("kernelgen::select_blocks", mutates_args=())
def _select_op(q: torch.Tensor, k: torch.Tensor, spec_json: str, q_idx: torch.Tensor | None = None,
               k_idx: torch.Tensor | None = None, w: torch.Tensor | None = None) -> torch.Tensor:
    return get_kernel(_spec_of(spec_json)).select(q, k, index=_index(q_idx, k_idx, w))


def _lists_like(q: torch.Tensor, k: torch.Tensor, spec: Spec) -> torch.Tensor:
    return q.new_empty((q.shape[0], k.shape[1], spec.n_q_tiles(q.shape[2]), spec.top_k), dtype=torch.int32)


@_select_op.register_fake
def _(q, k, spec_json, q_idx=None, k_idx=None, w=None):
    return _lists_like(q, k, _spec_of(spec_json))


@torch.library.custom_op("kernelgen::sparse_attention", mutates_args=())
def _attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None, spec_json: str,
             scale: float | None, q_idx: torch.Tensor | None = None, k_idx: torch.Tensor | None = None,
             w: torch.Tensor | None = None, cache_seqlens: torch.Tensor | None = None,
             reps: torch.Tensor | None = None, reps_seqlens: torch.Tensor | None = None,
             reps_n_k: int = 0, cache_leftpad: torch.Tensor | None = None,
             reps_leftpad: torch.Tensor | None = None, seqlens: torch.Tensor | None = None,
             block_table: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _spec_of(spec_json)
    attn = get_kernel(spec)
    shapes = attn._start_call(q, k, v, block_table)
    rows = attn._rows(shapes, q.device, cache_seqlens, cache_leftpad, seqlens,
                      _key_reps(spec, reps, reps_seqlens, reps_n_k, reps_leftpad), _index(q_idx, k_idx, w),
                      block_table)
    rows = check_kv_scales(k, v, k_scale, v_scale, rows, shapes, q.device)
    return attn._forward(q, k, v, shapes, block_idx, scale, _index(q_idx, k_idx, w),
                         _key_reps(spec, reps, reps_seqlens, reps_n_k, reps_leftpad), rows)[:3]


@_attn_op.register_fake
def _(q, k, v, block_idx, spec_json, scale, q_idx=None, k_idx=None, w=None, cache_seqlens=None, reps=None,
      reps_seqlens=None, reps_n_k=0, cache_leftpad=None, reps_leftpad=None, seqlens=None, block_table=None,
      k_scale=None, v_scale=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32),
            _lists_like(q, k, _spec_of(spec_json)))


@torch.library.custom_op("kernelgen::append_kv", mutates_args=("k", "v", "k_idx"))
def _append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               spec_json: str, cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor | None = None,
               block_table: torch.Tensor | None = None, q_idx: torch.Tensor | None = None,
               k_idx: torch.Tensor | None = None, w: torch.Tensor | None = None,
               k_idx_new: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A call's new keys written into its cache in place (k, v; k_idx): the rows' lengths after the write."""
    attn = get_kernel(_spec_of(spec_json))
    shapes = attn._start_call(q, k, v, block_table)
    index = _index(q_idx, k_idx, w)
    rows = attn._rows(shapes, q.device, cache_seqlens, cache_leftpad, None, None, index, block_table)
    rows = check_kv_scales(k, v, k_scale, v_scale, rows, shapes, q.device)
    new = attn._new_keys(k, v, shapes, (k_new, v_new, k_idx_new), index, rows, (k, v), cache_seqlens)
    return attn._append(k, v, shapes, new, rows).seqlens


@_append_op.register_fake
def _(q, k, v, k_new, v_new, spec_json, cache_seqlens, cache_leftpad=None, block_table=None, q_idx=None, k_idx=None,
      w=None, k_idx_new=None, k_scale=None, v_scale=None):
    return torch.empty_like(cache_seqlens)


@torch.library.custom_op("kernelgen::sparse_attention_backward", mutates_args=())
def _attn_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, lists: torch.Tensor, spec_json: str, scale: float | None,
                      needs: list[bool] | None = None,
                      dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); a gradient that `needs` (three bools) leaves out is not computed (the eager backward skips the
    dQ or the dK/dV kernels alike), and comes back as an empty tensor: an op returns tensors, not None. `dlse`:
    lse's gradient, or None."""
    needs = (True, True, True) if needs is None else tuple(needs)
    grads = get_kernel(_spec_of(spec_json))._gradients(do, q, k, v, o, lse, lists, scale, needs=needs, dlse=dlse)
    return tuple(x.new_empty(0) if grad is None else grad for grad, x in zip(grads, (q, k, v)))


@_attn_backward_op.register_fake
def _(do, q, k, v, o, lse, lists, spec_json, scale, needs=None, dlse=None):
    needs = (True, True, True) if needs is None else needs
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) if need else x.new_empty(0)
                 for x, need in zip((q, k, v), needs))


def _setup_context(ctx, inputs, output):
    q, k, v, _, spec_json, scale = inputs[:6]
    o, lse, lists = output
    ctx.save_for_backward(q, k, v, o, lse, lists)
    ctx.spec_json, ctx.scale = spec_json, scale
    ctx.mark_non_differentiable(lists)


def _backward(ctx, do, dlse, _dlists):
    q, k, v, o, lse, lists = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])  # a frozen q, or frozen k and v: their kernels are not launched
    if do is None:  # autograd materialises unused outputs' gradients as zeros; None where it does not
        do = torch.zeros_like(o)
    grads = _attn_backward_op(do, q, k, v, o, lse, lists, ctx.spec_json, ctx.scale, needs, dlse)
    grads = tuple(grad if need else None for grad, need in zip(grads, needs))
    return grads + (None,) * 14  # nothing for block_idx, spec, scale, index, rows, key reps, pages


torch.library.register_autograd("kernelgen::sparse_attention", _backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise KernelgenRuntimeError(dispatch.NO_DOUBLE_BACKWARD)


# the backward op's own backward (a create_graph=True gradient differentiated): torch's message would name a
# missing registration, not that the gradients are not differentiable
torch.library.register_autograd("kernelgen::sparse_attention_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)


# ---- the pooling selectors' kept representatives (KeyReps), as tensors: a KeyReps is not an op argument --------

def _capacity(k: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The keys a row of k holds room for: k's length, or a paged cache's pages a row x page_size."""
    return k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]


def _key_reps(spec: Spec, reps, seqlens, n_k: int, leftpad=None) -> KeyReps | None:
    """The KeyReps of the ops' tensors (None without reps; seqlens, leftpad: empty or None for reps of one
    length, n_k)."""
    if reps is None:
        return None
    if seqlens is None or seqlens.numel() == 0:
        return KeyReps._made_by_key_reps(reps, n_k, spec.kv_block, spec.groups)
    return KeyReps._made_by_key_reps(reps, n_k, spec.kv_block, spec.groups, seqlens, leftpad)


@torch.library.custom_op("kernelgen::key_reps", mutates_args=())
def _key_reps_op(k: torch.Tensor, spec_json: str, cache_seqlens: torch.Tensor | None = None,
                 previous: torch.Tensor | None = None, previous_n_k: int = 0,
                 cache_leftpad: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _spec_of(spec_json)
    made = get_kernel(spec).key_reps(k, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                     previous=_key_reps(spec, previous, None, previous_n_k), block_table=block_table)
    seqlens, leftpad = ((k.new_empty(0, dtype=torch.int32), k.new_empty(0, dtype=torch.int32)) if made.seqlens is None
                        else (made.seqlens, made.leftpad))
    # outputs may not alias inputs: reps extended by no key are previous itself
    return made.reps if made.reps is not previous else made.reps.clone(), seqlens, leftpad


@_key_reps_op.register_fake
def _(k, spec_json, cache_seqlens=None, previous=None, previous_n_k=0, cache_leftpad=None, block_table=None):
    spec = _spec_of(spec_json)
    b = k.shape[0] if block_table is None else block_table.shape[0]  # a pool of pages: the rows are the table's
    hkv, n_k = k.shape[1], _capacity(k, block_table)
    reps = k.new_empty((b, hkv, spec.n_kv_blocks(n_k), spec.groups, k.shape[-1]), dtype=torch.float32)
    rows = (b, hkv) if cache_seqlens is not None or block_table is not None else (0,)
    return reps, k.new_empty(rows, dtype=torch.int32), k.new_empty(rows, dtype=torch.int32)


@torch.library.custom_op("kernelgen::grow_key_reps", mutates_args=("reps", "reps_seqlens", "reps_leftpad"))
def _grow_key_reps_op(k: torch.Tensor, spec_json: str, cache_seqlens: torch.Tensor | None, reps: torch.Tensor,
                      reps_seqlens: torch.Tensor, reps_leftpad: torch.Tensor,
                      cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> None:
    spec = _spec_of(spec_json)
    n_k = _capacity(k, block_table)
    get_kernel(spec).key_reps(k, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                              previous=_key_reps(spec, reps, reps_seqlens, n_k, reps_leftpad), block_table=block_table)


@_grow_key_reps_op.register_fake
def _(k, spec_json, cache_seqlens, reps, reps_seqlens, reps_leftpad, cache_leftpad=None, block_table=None):
    return None


def key_reps(k: torch.Tensor, spec: Spec | str, cache_seqlens=None, previous: KeyReps | None = None,
             cache_leftpad=None, block_table=None) -> KeyReps:
    """`get_kernel(spec).key_reps(k, cache_seqlens=..., cache_leftpad=..., previous=..., block_table=...)` as custom
    ops: made afresh, extended over a longer k, or, for reps of a cache of per-row lengths (a paged cache's
    too), grown in place to the rows' keys (and returned; a longer k gets reps with room for its new blocks,
    returned in place of previous, as the eager call's), which a CUDA graph replays. Pass them to
    `sparse_attention(..., key_reps=)`, which grows reps of per-row lengths to its rows itself."""
    spec_json = _spec_json(spec)
    k = autocast_qkv(k, k, k)[0].detach()  # the reps feed the selection, which is not differentiated
    _tensors_or_none(cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, block_table=block_table)
    rows = cache_seqlens is not None or block_table is not None
    if previous is not None and not isinstance(previous, KeyReps):
        raise KernelgenTypeError(f"previous must be the KeyReps of key_reps, got {type(previous).__name__}")
    if previous is not None and rows and previous.seqlens is not None:
        n_k = _capacity(k, block_table)
        if n_k > previous.n_k:  # a cache that grew into a longer tensor: room for its new blocks, then grown
            previous = previous._with_room(n_k)
        check_reps_fit_capacity(previous, n_k)
        _grow_key_reps_op(k, spec_json, cache_seqlens, previous.reps, previous.seqlens, previous.leftpad,
                          cache_leftpad, block_table)
        return previous
    if previous is not None and (rows or previous.seqlens is not None):
        get_kernel(_spec_of(spec_json)).key_reps(k, cache_seqlens=cache_seqlens, previous=previous,
                                                 block_table=block_table)  # raises
    reps, seqlens, leftpad = _key_reps_op(k, spec_json, cache_seqlens, None if previous is None else previous.reps,
                                          0 if previous is None else previous.n_k, cache_leftpad, block_table)
    blocks = _reps_blocks(spec_json)
    n_k = _capacity(k, block_table)
    if not rows:
        return KeyReps._made_by_key_reps(reps, n_k, *blocks)
    return KeyReps._made_by_key_reps(reps, n_k, *blocks, seqlens, leftpad)


@torch.compiler.assume_constant_result
def _reps_blocks(spec_json: str) -> tuple[int, int]:
    # (kv_block, groups) of the spec's reps, outside the traced graph: dynamo does not trace json.loads
    spec = _spec_of(spec_json)
    return spec.kv_block, spec.groups


_SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(Spec))


def _spec_json(spec: Spec | str) -> str:
    """The JSON text the ops take, of a Spec or of its JSON text (checked). A Spec goes to the constant function by
    its field values: torch 2.11's dynamo cannot hand a frozen dataclass instance to one (it cannot reconstruct
    it), while it reads the instance's fields."""
    if isinstance(spec, Spec):
        return _fields_json(tuple(getattr(spec, name) for name in _SPEC_FIELDS))
    return _checked_json(spec)


@torch.compiler.assume_constant_result
def _fields_json(values: tuple) -> str:
    # computed outside the traced graph: dynamo does not trace json.dumps
    return _json_of_fields(values)


@functools.lru_cache(maxsize=256)  # every eager call of an op asks: made once per spec
def _json_of_fields(values: tuple) -> str:
    return Spec(**dict(zip(_SPEC_FIELDS, values))).to_json()


@torch.compiler.assume_constant_result
def _checked_json(spec) -> str:
    if not isinstance(spec, str):
        raise KernelgenTypeError(f"spec must be a Spec or its JSON text (Spec.to_json()), got {type(spec).__name__}")
    try:
        _spec_of(spec)
    except (ValueError, TypeError, KeyError) as error:
        raise KernelgenValueError(f"spec is not a Spec's JSON text (Spec.to_json()): {error}") from None
    return spec


def _index_args(index) -> tuple:
    """(q_idx, k_idx, w) of `index=` as the ops' three optional arguments; anything but a triple is left to
    the eager API's check (`inputs.check_index`) to name."""
    if index is None:
        return None, None, None
    if isinstance(index, (tuple, list)) and len(index) == 3:
        return tuple(index)
    raise KernelgenTypeError(f"index must be a tuple (q_idx, k_idx, w), got {describe_index(index)}; {INDEX_LAYOUT}")


def _tensors_or_none(**arguments) -> None:
    """The ops' optional tensor arguments are tensors or None: anything else is named here, as the eager API
    names it, not left to the op schema's error."""
    for name, value in arguments.items():
        if value is not None and not isinstance(value, torch.Tensor):
            if name == "block_idx":
                raise lists_type_error(value, "a torch.Tensor or None")
            raise KernelgenTypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")


def select_blocks(q: torch.Tensor, k: torch.Tensor, spec: Spec | str, index=None) -> torch.Tensor:
    """`get_kernel(spec).select(q, k, index=...)` as a custom op (`spec` may also be its JSON text)."""
    q, k, _ = autocast_qkv(q, k, k)
    # the selection is not differentiated (as NSA's and DSA's are not): a traced backward stops at its inputs
    detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in (q, k, *_index_args(index))]
    return _select_op(*detached[:2], _spec_json(spec), *detached[2:])


def sparse_attention(q, k, v, spec: Spec | str, block_idx=None, scale=None, index=None,
                     cache_seqlens=None, key_reps: KeyReps | None = None,
                     cache_leftpad=None, seqlens=None, block_table=None, k_new=None, v_new=None,
                     k_idx_new=None, sinks=None, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_kernel(spec)(q, k, v, block_idx=..., index=..., scale=..., cache_seqlens=..., cache_leftpad=...,
    key_reps=..., seqlens=..., block_table=..., k_new=..., v_new=..., k_idx_new=..., sinks=..., k_scale=...,
    v_scale=..., return_lse=True)` as custom ops (a float scale enters them as a one-element tensor; attention sinks
    joined after them, in the graph); o and lse backpropagate (a
    call with cache_seqlens or block_table has no backward).
    `spec` may also be its JSON text (`Spec.to_json`). Prepared lists (`attn.prepare`) go in as their normalised
    ids: their reverse index and union design stay outside the op, which builds what its calls need. New keys
    (k_new=) are written into the cache by an op of their own, which mutates k and v (and k_idx) in place."""
    if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 4:  # before the op writes new keys
        check_sinks(sinks, q.shape[1], q.device)
    k_scale, v_scale = (_scale_tensor(name, x, q) for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    cache = (k, v)
    q, k, v = autocast_qkv(q, k, v)
    refuse_forward_ad(q, k, v)
    if not torch.compiler.is_compiling():  # dynamo runs no torch.func transform over the op
        refuse_function_transforms(q, k, v)
    if isinstance(block_idx, BlockLists):  # an op takes tensors: prepared lists go in as their normalised ids
        block_idx = block_idx.block_idx
    _tensors_or_none(block_idx=block_idx, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, seqlens=seqlens,
                     block_table=block_table)
    refuse_grad_with_seqlens(cache_seqlens, q, k, v, block_table)
    if key_reps is not None and not isinstance(key_reps, KeyReps):
        raise KernelgenTypeError(f"key_reps must be the KeyReps of key_reps(), got {type(key_reps).__name__}")
    reps = (None, None, 0, None) if key_reps is None else (key_reps.reps, key_reps.seqlens, key_reps.n_k,
                                                           key_reps.leftpad)
    spec_json = _spec_json(spec)
    if k_new is not None or v_new is not None or k_idx_new is not None:
        if seqlens is not None:
            raise KernelgenValueError("k_new= writes into a KV cache (cache_seqlens=): a padded batch's call "
                                      "(seqlens=) has none")
        if not torch.compiler.is_compiling():  # the forward's host checks, before anything is written
            attn = get_kernel(_spec_of(spec_json))
            shapes = attn._check_shapes(q, k, v, block_table)
            attn._check_before_writing(shapes, q.device, block_idx, index, key_reps, scale,
                                       attn._rows(shapes, q.device, cache_seqlens, cache_leftpad, None, key_reps,
                                                  index, block_table))
        cache_seqlens = _append_new_keys(q, k, v, spec_json, (k_new, v_new, k_idx_new), cache, cache_seqlens,
                                         cache_leftpad, block_table, index, (k_scale, v_scale))
    if key_reps is not None and (cache_seqlens is not None or block_table is not None) and key_reps.seqlens is not None:
        # reps of per-row lengths follow the call, as the eager call's do: grown to its rows first (its op is
        # functional, as autograd needs, so the growth is an op of its own); reps of another capacity are refused
        # first, as the eager call refuses them, not grown in place for a call that then fails
        if isinstance(k, torch.Tensor) and k.dim() == 4 and (block_table is None or block_table.dim() == 2):
            check_reps_length(key_reps, _capacity(k, block_table))  # other k, tables: the call's checks name them
        _grow_key_reps_op(k, spec_json, cache_seqlens, *reps[:2], reps[3], cache_leftpad, block_table)
    if scale is not None and not torch.compiler.is_compiling():
        # as the eager call checks it: float() would read a tensor and drop its gradient
        check_scale(scale)
    elif scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        # dynamo traces a NumPy scalar as a tensor, whose value the op's float argument cannot take
        raise KernelgenTypeError(f"scale must be a Python float under torch.compile, got {type(scale).__name__} (a "
                                 "NumPy scalar is traced as a tensor): pass float(scale)")
    o, lse, _ = _attn_op(q, k, v, block_idx, spec_json, None if scale is None else float(scale),
                         *_index_args(index), cache_seqlens, *reps[:3], cache_leftpad, reps[3], seqlens, block_table,
                         k_scale, v_scale)
    if sinks is not None:
        o, lse = with_sinks(o, lse, sinks)
    if seqlens is not None:  # the padding's o and lse, cleared outside the op: no gradient reaches them
        o, lse = clear_padding(o, lse, seqlens)
    return o, lse


def _append_new_keys(q, k, v, spec_json: str, new: tuple, cache: tuple, cache_seqlens, cache_leftpad, block_table,
                     index, kv_scales=(None, None)) -> torch.Tensor:
    """`sparse_attention`'s write of new keys (k_new, v_new, k_idx_new) into its cache: the rows' lengths after it.
    What the op could not take (anything but tensors, a call without cache_seqlens) is named as the eager call
    names it."""
    _tensors_or_none(k_new=new[0], v_new=new[1], k_idx_new=new[2])
    refuse_unpaired_new_keys(new[0], new[1], cache_seqlens)  # the op's arguments: tensors, not None
    refuse_cast_cache(k, v, cache)
    return _append_op(q, k, v, *new[:2], spec_json, cache_seqlens, cache_leftpad, block_table, *_index_args(index),
                      new[2], *kv_scales)


def _scale_tensor(name: str, scale, q) -> torch.Tensor | None:
    """An fp8 cache's scale as the ops take it: a float (checked as the eager call checks it) as a one-element
    float32 tensor on q's device; a tensor or None as it is (the op's check names anything wrong). A float that
    torch.compile traces as a symbol (a recompile for a new value) is checked in the graph."""
    if scale is None or isinstance(scale, torch.Tensor) or not isinstance(q, torch.Tensor):
        return scale
    if torch.compiler.is_compiling():  # the float may be a symbol (a recompile for a new value): math cannot read it
        torch._check(scale > 0, lambda: f"{name} must be finite and > 0")
        torch._check(scale < math.inf, lambda: f"{name} must be finite and > 0")
    else:
        scale = check_kv_scale_value(name, scale)
    return torch.full((1,), scale, dtype=torch.float32, device=q.device)


dispatch.trace_through(sys.modules[__name__])  # get_kernel(spec)'s calls under torch.compile run these

"""Input checks every call makes, whatever the backend: shapes, dtypes, devices, strides, block lists.

Each bad input is a KernelgenValueError or KernelgenTypeError (ValueError, TypeError) that names the
argument and what was expected. Also the pieces every launcher shares: poisoned allocation for tests,
`BlockLists`, the softmax scale.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator
import os
import weakref
from typing import Callable, NamedTuple

import torch

from .device import device_arch, interpreting
from .errors import KernelgenTypeError, KernelgenValueError
from .reverse_index import QueryReverseIndex, ReverseIndex, build_reverse_index
from .spec import Spec

__all__ = ["Shapes", "BlockLists", "KeyReps", "check_key_reps", "check_reps_length",
           "check_reps_fit_capacity", "CacheRows", "check_cache_rows", "NewKeys", "check_new_keys",
           "refuse_unpaired_new_keys", "refuse_cast_cache", "check_row_ints", "NEW_KEYS_LAYOUT", "check_paged_kv",
           "check_pages",
           "refuse_grad_with_seqlens", "check_keys", "check_qkv",
           "check_block_idx", "check_block_lists", "refuse_nsa_layout", "lists_type_error", "describe_index",
           "check_index",
           "check_length", "check_return_lse",
           "softmax_scale", "empty", "next_pow2", "cdiv", "LOG2E", "LAYOUT", "lists_layout", "INDEX_DIMS",
           "INDEX_LAYOUT", "ReadOnce"]

LOG2E = 1.4426950408889634
LAYOUT = "q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] (heads before sequence, as SDPA and FlexAttention)"
# Tests set KERNELGEN_POISON=1: outputs start as NaN (lists as INT32_MIN) so unwritten elements fail.
_POISON = os.environ.get("KERNELGEN_POISON", "0") == "1"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# on a GPU: the kernels' products of float32 would run in tf32, short of what float32 promises
_GPU_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DIMS = (32, 64, 128)  # Di of the index selector's vectors
INDEX_LAYOUT = ("index=(q_idx [B, Hkv*Hi, Nq, Di], k_idx [B, Hkv or 1, Nk, Di], w [B, Hkv*Hi, Nq]): Hi index heads "
                "per KV head (h*Hi .. h*Hi+Hi-1 belong to KV head h), one index key head per KV head or one shared")
PAGED_INDEX_LAYOUT = ("over a paged cache (block_table=), k_idx is a pool of pages [n_pages, Hkv or 1, page_size, Di] "
                      "read through the same block_table as k and v: row b's key p in page block_table[b, p // "
                      "page_size]")
_INDEX_FP8 = torch.float8_e4m3fn  # index vectors computed in fp8 (fp32 accumulation), on sm_90 only
# an fp8 KV cache's dtypes (`check_kv_scales`): e4m3 (3 mantissa bits, finite to ±448; FlashAttention 3's, vLLM's
# "fp8") and e5m2 (2 bits, to ±57344; vLLM's "fp8_e5m2")
KV_CACHE_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Shapes(NamedTuple):
    """The sizes of one call, checked (`check_qkv`)."""

    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    n_q_tiles: int
    n_kv_blocks: int


class ReadOnce:
    """Values read from tensors on the host (each read waits on the device), remembered while the tensors are the
    same objects at the same versions: a write through torch operations bumps a tensor's version and reads it
    again; one that bypasses the counter (`.data`, `.numpy()`) is not seen. Tensors made under
    torch.inference_mode have no version counter and are read every time. Holds the last `size` reads."""

    def __init__(self, size: int = 1):
        self._size, self._seen = size, {}

    def get(self, tensors: tuple, key, read):
        """read() for `tensors` (and a hashable `key` of what else it depends on), or the value remembered."""
        if any(t.is_inference() for t in tensors):
            return read()
        ids = (tuple(id(t) for t in tensors), key)
        seen = self._seen.get(ids)
        if seen is not None and all(ref() is t and version == t._version
                                    for (ref, version), t in zip(seen[0], tensors)):
            return seen[1]
        value = read()
        self._seen.pop(ids, None)
        if len(self._seen) >= self._size:
            self._seen.pop(next(iter(self._seen)))
        self._seen[ids] = ([(weakref.ref(t), t._version) for t in tensors], value)
        return value


def empty(*shape, like=None, device=None, dtype=None) -> torch.Tensor:
    """torch.empty, or under KERNELGEN_POISON=1 a tensor of NaN (INT_MIN for integers)."""
    if like is not None:
        shape, device, dtype = like.shape, like.device, like.dtype
    if not _POISON:
        return torch.empty(*shape, device=device, dtype=dtype)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, device=device, dtype=dtype)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, on the host (triton.cdiv takes microseconds a call: it is a constexpr function)."""
    return -(-a // b)


class BlockLists:
    """Lists already in the kernels' form, made once by `SparseAttention.prepare` and passed as `block_idx`
    to every call that attends over them (the layers of a model, repeated steps), as FlexAttention's
    BlockMask is built once and FlashInfer plans once: such a call skips the normalising launch.

    block_idx    int32 [B, Hkv, n_q_tiles, top_k] (per-query lists: [B, Hkv, Nq, top_k]), valid ids
                 ascending then -1: a copy, never the caller's tensor (writing into it afterwards is outside
                 the contract)
    kv_block, top_k, n_kv_blocks, per_query   what it was made for; a call with other values is a ValueError

    union        per-query lists only: the `kernelgen.tile_union.TileUnion` of consecutive queries' lists when
                 `prepare` found them close enough to run the union design (`kv_attn_union`), else None (the
                 gathered design, `kv_attn`)

    Only `prepare` makes them (the kernels trust their order: a hand-made one could name a block the
    kernels would read out of bounds), so the constructor refuses. `reverse_index()` is built on the
    device when a backward first needs it, then kept with the lists."""
    __slots__ = ("block_idx", "kv_block", "top_k", "n_kv_blocks", "per_query", "_reverse", "union")

    def __init__(self, *args, **kwargs):
        raise KernelgenTypeError("BlockLists are made by SparseAttention.prepare(block_idx, seq_q, seq_k), not by hand")

    @classmethod
    def _made_by_prepare(cls, block_idx: torch.Tensor, kv_block: int, top_k: int, n_kv_blocks: int,
                         per_query: bool = False, reverse: QueryReverseIndex | None = None,
                         union=None) -> BlockLists:
        lists = object.__new__(cls)
        for name, value in zip(cls.__slots__, (block_idx, kv_block, top_k, n_kv_blocks, per_query, reverse, union)):
            object.__setattr__(lists, name, value)
        return lists

    def reverse_index(self) -> ReverseIndex | QueryReverseIndex:
        """For each (batch, KV head, KV block), the Q tiles whose lists hold it (`kernelgen.reverse_index`):
        built on the lists' device at the first call, the same object afterwards. Per-query lists: the
        queries and slots (`QueryReverseIndex`), built by `prepare`."""
        if self._reverse is None:
            object.__setattr__(self, "_reverse", build_reverse_index(self.block_idx, self.n_kv_blocks))
        return self._reverse

    def __setattr__(self, name, value):
        raise AttributeError("BlockLists are read-only")

    def __reduce__(self):  # copy, deepcopy and pickle make them as prepare does (not through __setattr__)
        return BlockLists._made_by_prepare, tuple(getattr(self, name) for name in self.__slots__)

    def __repr__(self) -> str:
        design = "" if self.union is None else f", union of {self.union.tile_q} queries"
        return (f"BlockLists(shape={tuple(self.block_idx.shape)}, kv_block={self.kv_block}, top_k={self.top_k}, "
                f"n_kv_blocks={self.n_kv_blocks}{design}, device={self.block_idx.device})")


class KeyReps:
    """The selector's representatives of K's blocks, made once by `SparseAttention.key_reps(k)` and passed as
    `key_reps=` to the calls over that k: their selection pools q alone instead of the whole of K. Kept
    with a KV cache and extended as it grows (`key_reps(k, previous=...)` pools only the new blocks), they
    take a decode step's selection from reading all of K to reading one vector per group of each block.

    reps         float32 [B, Hkv, n_kv_blocks, r, D]: the mean of each of the r groups of consecutive keys of
                 every block (r = 1 for `mean`, r for `multi:r`; a partial last block averages the keys it
                 has), as the selector computes them
    n_k, kv_block, groups   what they were made for; a call with other values is a ValueError
    seqlens      reps of a cache of per-row lengths (made with `cache_seqlens=`): int32 [B, Hkv], the keys each
                 row's reps hold, on the device (n_k is then the cache's capacity, and the reps of blocks past
                 a row's keys are never read); None otherwise
    leftpad      with seqlens: int32 [B, Hkv], the key each row's reps start from (`cache_leftpad=`; 0 without),
                 on the device; None otherwise

    They hold what k held when they were made; a call passes the same k (or, for a grown cache, reps
    extended over it). Reps with seqlens follow the call instead: a call with `cache_seqlens=` grows them in
    place to its rows first, so it never selects from reps of other lengths. Only `key_reps` makes them, so the
    constructor refuses."""
    __slots__ = ("reps", "n_k", "kv_block", "groups", "seqlens", "leftpad")

    def __init__(self, *args, **kwargs):
        raise KernelgenTypeError("KeyReps are made by SparseAttention.key_reps(k), not by hand")

    @classmethod
    def _made_by_key_reps(cls, reps: torch.Tensor, n_k: int, kv_block: int, groups: int,
                          seqlens: torch.Tensor | None = None, leftpad: torch.Tensor | None = None) -> KeyReps:
        made = object.__new__(cls)
        for name, value in zip(cls.__slots__, (reps, n_k, kv_block, groups, seqlens, leftpad)):
            object.__setattr__(made, name, value)
        return made

    def __setattr__(self, name, value):
        raise AttributeError("KeyReps are read-only")

    def __reduce__(self):  # copy, deepcopy and pickle make them as key_reps does (not through __setattr__)
        return KeyReps._made_by_key_reps, tuple(getattr(self, name) for name in self.__slots__)

    def index_batch(self, index) -> KeyReps:
        """The reps of the batch rows `index` picks (any index of k's batch dimension: a KV cache reordered for
        beam search, or rows kept or repeated): those of k[index]."""
        if isinstance(index, torch.Tensor):
            if index.dtype.is_floating_point or index.is_complex():
                raise KernelgenTypeError(f"index must hold integer or bool batch rows, got dtype {index.dtype}")
            index = index.to(self.reps.device)
        try:
            # contiguous: the kernels read (and grow in place) reps [B, Hkv, n_kv_blocks, r, D] and their lengths
            # [B, Hkv] by their shapes, so a strided pick (a step slice) is copied
            reps = self.reps[index].contiguous()
        except IndexError as error:
            raise KernelgenValueError(f"index picks rows outside these key_reps' batch of {self.reps.shape[0]}: "
                                      f"{error}") from None
        if reps.dim() != self.reps.dim():
            raise KernelgenValueError(f"index must pick batch rows (a 1-D index, a slice or a bool mask), got "
                                      f"{index!r}")
        seqlens, leftpad = (None, None) if self.seqlens is None else (self.seqlens[index].contiguous(),
                                                                      self.leftpad[index].contiguous())
        return self._picked(reps, seqlens, leftpad)

    def _picked(self, reps, seqlens, leftpad) -> KeyReps:
        return KeyReps._made_by_key_reps(reps, self.n_k, self.kv_block, self.groups, seqlens, leftpad)

    def _rows_of(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> KeyReps:
        """index_batch for a varlen group's rows, `pick` taking each [B, ...] tensor's (`varlen.group_rows`: slices
        where the rows are consecutive, which a call then grows in place as it grows these reps; else copies):
        fewer host steps than advanced indexing, once a group."""
        return self._picked(*(None if x is None else pick(x) for x in (self.reps, self.seqlens, self.leftpad)))

    def _with_room(self, n_k: int) -> KeyReps:
        """Reps of per-row lengths for a cache that grew into a new tensor of n_k keys: zeros appended for its
        new blocks, the rows' recorded lengths kept (the same tensors), so the next growth pools them."""
        extra = -(-n_k // self.kv_block) - self.reps.shape[2]
        reps = self.reps if extra <= 0 else torch.cat(
            [self.reps, self.reps.new_zeros(*self.reps.shape[:2], extra, *self.reps.shape[3:])], dim=2)
        return KeyReps._made_by_key_reps(reps, n_k, self.kv_block, self.groups, self.seqlens, self.leftpad)

    def cropped(self, n_k: int) -> KeyReps:
        """The reps of the whole blocks among the first n_k keys (a KV cache cropped to n_k keys): they extend
        (`key_reps(k, previous=...)`) over any k that holds those keys first; the extension pools the block that
        n_k falls in again."""
        if isinstance(n_k, bool) or not isinstance(n_k, int):
            raise KernelgenTypeError(f"n_k must be an int, got {type(n_k).__name__}")
        if self.seqlens is not None:
            raise KernelgenValueError("key_reps made with cache_seqlens follow the lengths they are grown to "
                                      "(attn.key_reps(k, cache_seqlens=..., previous=reps)); they are not cropped")
        if not 0 <= n_k <= self.n_k:
            raise KernelgenValueError(f"n_k = {n_k}: these key_reps hold {self.n_k} keys; crop to 0..{self.n_k}")
        whole = n_k // self.kv_block
        # a copy: the kernels read reps by their shape, and a slice of the blocks is strided
        return KeyReps._made_by_key_reps(self.reps[:, :, :whole].contiguous(), whole * self.kv_block, self.kv_block,
                                         self.groups)

    def __repr__(self) -> str:
        lengths = "" if self.seqlens is None else ", per-row lengths"
        return (f"KeyReps(shape={tuple(self.reps.shape)}, n_k={self.n_k}, kv_block={self.kv_block}, "
                f"groups={self.groups}{lengths}, device={self.reps.device})")


class CacheRows(NamedTuple):
    """A decode call's keys per batch row of a KV cache, checked: row b holds keys [leftpad[b], seqlens[b])
    (int32 [B] each, read on the device; leftpad None: from 0); `block_table` (int32 [B, pages a row], or None): k
    and v are pools of pages, row b's key p in page block_table[b, p // page_size] (`check_paged_kv`)."""
    seqlens: torch.Tensor
    leftpad: torch.Tensor | None
    block_table: torch.Tensor | None = None
    kv_scales: KVScales | None = None  # an fp8 cache's (`check_kv_scales`)


class KVScales(NamedTuple):
    """An fp8 KV cache's dequantisation scales, float32 each: one element (every row's and head's) or [B, Hkv],
    contiguous. The cache holds k / k_scale and v / v_scale, and a call attends over k_cache * k_scale and
    v_cache * v_scale."""
    k: torch.Tensor
    v: torch.Tensor

    def strides(self) -> tuple[int, int]:
        """Each scale's step from one (batch row, KV head) to the next, b * Hkv + h: 0 for one scale, else 1."""
        return int(self.k.numel() > 1), int(self.v.numel() > 1)


def check_kv_scales(k, v, k_scale, v_scale, rows, shapes: Shapes, device) -> CacheRows | TokenRows | None:
    """A call's rows with its fp8 cache's scales (`CacheRows.kv_scales`): k and v float8_e4m3fn or float8_e5m2 over
    a KV cache (cache_seqlens= or block_table=), each scale a Python float > 0 (None: 1.0) or a float32 tensor of one
    element or [B, Hkv] on the call's device. A cache of q's dtype takes no scales."""
    if k.dtype not in KV_CACHE_FP8:
        if k_scale is not None or v_scale is not None:
            name = "k_scale" if k_scale is not None else "v_scale"
            raise KernelgenValueError(f"{name}= dequantises an fp8 KV cache (float8_e4m3fn or float8_e5m2); k.dtype "
                                      f"is {k.dtype}")
        return rows
    if not isinstance(rows, CacheRows):
        raise KernelgenValueError(f"k.dtype = {k.dtype}: an fp8 KV cache is read by calls over a cache: pass "
                                  "cache_seqlens= (or block_table=) with k_scale= and v_scale=")
    check_fp8_arch(k)
    return rows._replace(kv_scales=KVScales(*(_kv_scale(name, x, shapes, device)
                                              for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))))


def check_fp8_arch(k: torch.Tensor) -> None:
    """An e4m3 cache's kernels (attention, selection, kept reps) need sm_89 or newer (e4m3 conversions); e5m2's and
    16-bit caches' run on any GPU kernelgen runs on."""
    if k.dtype == torch.float8_e4m3fn:
        arch = device_arch(k.device)  # cached per device: this runs on every decode step
        if arch != "cpu" and int(arch[3:]) < 89:
            raise KernelgenTypeError(f"k.dtype = float8_e4m3fn: a float8_e4m3fn KV cache needs an sm_89 or newer GPU "
                                     f"(e4m3 conversions); this GPU is {arch} (float8_e5m2 caches run there)")


def _kv_scale(name: str, scale, shapes: Shapes, device) -> torch.Tensor:
    """One checked scale of an fp8 cache, as the kernels read it (`KVScales`): float32 of one element, or [B, Hkv]
    contiguous. A one-element tensor is passed as it is (no copy: a decode step's launches stay its kernels')."""
    if not isinstance(scale, torch.Tensor):
        value = 1.0 if scale is None else check_kv_scale_value(name, scale)
        return _constant_scale(value, str(device))
    if scale.dtype != torch.float32:
        raise KernelgenTypeError(f"{name} must be float32, got dtype {scale.dtype}")
    if scale.requires_grad and torch.is_grad_enabled():
        raise KernelgenValueError(f"{name} requires grad: a call over a cache has no backward, so its scales would "
                                  f"get none; pass {name}.detach()")
    if scale.device != device:
        raise KernelgenValueError(f"{name} is on {scale.device} but q is on {device}")
    if scale.numel() == 1:
        return scale.reshape(1)
    if tuple(scale.shape) != (shapes.batch, shapes.heads_kv):
        raise KernelgenValueError(f"{name} must have one element or shape [B, Hkv] = [{shapes.batch}, "
                                  f"{shapes.heads_kv}], got {tuple(scale.shape)}")
    return scale.contiguous()


def check_kv_scale_value(name: str, scale) -> float:
    """A scale given as a number: a real, finite and > 0 (not a bool), as a float."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise KernelgenTypeError(f"{name} must be a float or a float32 tensor, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise KernelgenValueError(f"{name} must be finite and > 0, got {scale}")
    return float(scale)


@functools.lru_cache(maxsize=64)
def _constant_scale(value: float, device: str) -> torch.Tensor:
    """A float scale as a one-element tensor, made once per value and device (a decode step passes the same scale
    every call: no launch to fill it again)."""
    return torch.full((1,), value, dtype=torch.float32, device=device)


def check_cache_rows(cache_seqlens, cache_leftpad, shapes: Shapes, device,
                     block_table: torch.Tensor | None = None) -> CacheRows | None:
    """A call's `cache_seqlens` and `cache_leftpad` (None, None: a call of one length): int32 [B], contiguous, on
    the call's device (values are read on the device: each length is clamped to [0, Nk], k's length being the
    cache's capacity, and each left padding to [0, its row's length]). A paged cache's (`block_table`, checked
    by `check_paged_kv`) are always rows: without cache_seqlens each row holds the capacity its pages give."""
    if block_table is not None:
        if cache_leftpad is not None:
            raise KernelgenValueError("cache_leftpad= cannot go with block_table=: a paged cache's rows start at "
                                      "their first page (leave out the padding's pages instead)")
        seqlens = (torch.full((shapes.batch,), shapes.n_k, dtype=torch.int32, device=device) if cache_seqlens is None
                   else _check_row_ints("cache_seqlens", cache_seqlens, shapes, device))
        return CacheRows(seqlens, None, block_table)
    if cache_seqlens is None:
        if cache_leftpad is not None:
            raise KernelgenValueError("cache_leftpad= needs cache_seqlens= (each row's end; k's length for all)")
        return None
    return CacheRows(_check_row_ints("cache_seqlens", cache_seqlens, shapes, device),
                     None if cache_leftpad is None else _check_row_ints("cache_leftpad", cache_leftpad, shapes,
                                                                        device))


NEW_KEYS_LAYOUT = ("k_new and v_new [B, Hkv, n_new, D] (k's batch rows, heads and head_dim; a paged cache's rows are "
                   "its block_table's), k_idx_new [B, k_idx's heads, n_new, Di]")


class NewKeys(NamedTuple):
    """A call's new keys, checked (`check_new_keys`): written into its cache at each row's end before it attends
    (`k_idx`, `k_idx_new`: the index selector's index keys, or None)."""
    k: torch.Tensor
    v: torch.Tensor
    k_idx: torch.Tensor | None
    k_idx_new: torch.Tensor | None


def refuse_unpaired_new_keys(k_new, v_new, cache_seqlens) -> None:
    """New keys come with their values and with the lengths that say where they go."""
    if k_new is None or v_new is None:
        raise KernelgenValueError("k_new= and v_new= go together (the new tokens' keys and values, written into "
                                  f"the cache at each row's end); {NEW_KEYS_LAYOUT}")
    if cache_seqlens is None:
        raise KernelgenValueError("k_new= needs cache_seqlens= (each row's length before the write: its new keys go "
                                  "there, as flash_attn_with_kvcache's k= and v=)")


def check_new_keys(k_new, v_new, k_idx_new, k, index, shapes: Shapes, cache_seqlens) -> NewKeys | None:
    """A call's `k_new=`, `v_new=` and `k_idx_new=` (None: a call that writes nothing), against its cache k (its
    checked `shapes`; a pool of pages when it has a block_table) and `index` (the index selector's, checked by
    `check_index`): each [B, H, n_new, width] of the cache's dtype, device, batch rows and heads, on a call that
    passes `cache_seqlens` (where each row's new keys go). The write is not differentiated: new keys that require
    grad are refused, as a cache's call is."""
    if k_new is None and v_new is None and k_idx_new is None:
        return None
    refuse_unpaired_new_keys(k_new, v_new, cache_seqlens)
    k_idx = None if index is None else index[1]
    if (k_idx_new is None) != (k_idx is None):
        raise KernelgenValueError("k_idx_new= goes with index= (the new tokens' index keys, written into k_idx as "
                                  "k_new into k); a call of the index selector that writes k_new needs it"
                                  if k_idx is not None else "k_idx_new= is the index selector's (its new index "
                                  "keys, written into index=(q_idx, k_idx, w)'s k_idx): this call passes no index=")
    n_new = None
    for name, new, cache, heads in (("k_new", k_new, k, shapes.heads_kv), ("v_new", v_new, k, shapes.heads_kv),
                                    ("k_idx_new", k_idx_new, k_idx, None if k_idx is None else k_idx.shape[1])):
        if new is None:
            continue
        if not isinstance(new, torch.Tensor):
            raise KernelgenTypeError(f"{name} must be a torch.Tensor, got {type(new).__name__}")
        if cache.dtype in KV_CACHE_FP8 and name != "k_idx_new":  # quantised as it is written (`check_kv_scales`)
            if new.dtype not in _DTYPES:
                raise KernelgenTypeError(f"{name}.dtype must be float16, bfloat16 or float32 (quantised into the fp8 "
                                         f"cache), got {new.dtype}")
        elif new.dtype != cache.dtype:
            raise KernelgenTypeError(f"{name}.dtype = {new.dtype} differs from the cache's ({cache.dtype})")
        if new.device != cache.device:
            raise KernelgenValueError(f"{name} is on {new.device} but the cache is on {cache.device}")
        if new.dim() != 4 or new.shape[0] != shapes.batch or new.shape[1] != heads or new.shape[3] != cache.shape[3]:
            raise KernelgenValueError(f"{name}.shape = {tuple(new.shape)}, expected [B, H, n_new, width] = "
                                      f"[{shapes.batch}, {heads}, n_new, {cache.shape[3]}]; {NEW_KEYS_LAYOUT}")
        if n_new is not None and new.shape[2] != n_new:
            raise KernelgenValueError(f"{name} has {new.shape[2]} new tokens (dim 2) but k_new has {n_new}")
        n_new = new.shape[2]
        if new.requires_grad and torch.is_grad_enabled():
            raise KernelgenValueError(f"{name} requires grad, but the write into the cache has no backward: call "
                                      "under torch.no_grad(), or pass it detached")
    return NewKeys(k_new, v_new, k_idx, k_idx_new)


def apart_from_cache(new: NewKeys, k, v) -> NewKeys:
    """New keys that share memory with a cache they are written into (a view of it: keys moved within it) are
    copied first, as the reference reads them: the write reads them a chunk at a time while it writes, so an
    overlap would read keys it had already overwritten."""
    caches = {x.untyped_storage().data_ptr() for x in (k, v, new.k_idx) if x is not None}

    def apart(x):
        return x if x is None or x.untyped_storage().data_ptr() not in caches else x.clone()

    return NewKeys(apart(new.k), apart(new.v), new.k_idx, apart(new.k_idx_new))


def refuse_cast_cache(k, v, cache: tuple) -> None:
    """New keys are written into the caller's k and v (`cache`): refuse a call whose autocast cast them to a copy
    (k, v), which the write would reach instead."""
    if k is not cache[0] or v is not cache[1]:
        raise KernelgenValueError(f"k_new= writes into k and v themselves, but torch.autocast casts this "
                                  f"{cache[0].dtype} cache to {k.dtype}, a copy: keep the cache in {k.dtype}")


class TokenRows(NamedTuple):
    """A right-padded batch's tokens (`seqlens=`), checked: row b's queries and keys are its first seqlens[b]
    positions (int32 [B], read on the device, clamped to [0, N])."""
    seqlens: torch.Tensor


def check_token_rows(seqlens, spec: Spec, shapes: Shapes, device, *, cache_seqlens=None, key_reps=None,
                     index=None, cache_leftpad=None) -> TokenRows:
    """A call's `seqlens` (a right-padded batch), and what such a call can be: causal self-attention, over given
    lists, a pooling selector's or (per-query lists) the index selector's, with nothing of a KV cache."""
    for name, value in (("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise KernelgenValueError(f"pass seqlens= (a right-padded batch's tokens) or {name}= (a KV cache's "
                                      "rows), not both")
    if not spec.causal:
        raise KernelgenValueError("seqlens= needs a causal spec: a padded row's queries must see none of the "
                                  "padding after its tokens (run each row's own length)")
    if shapes.n_q != shapes.n_k:
        raise KernelgenValueError(f"seqlens= is for self-attention over a padded batch (Nq == Nk); q has "
                                  f"{shapes.n_q} queries and k {shapes.n_k} keys")
    if (spec.selector == "index" or index is not None) and not spec.per_query:
        raise KernelgenValueError("seqlens= takes the index selector with per-query lists (schedule='kv_centric') "
                                  "only: a Q tile's score is a maximum over its queries, and a row's last tile "
                                  "holds padding")
    if key_reps is not None:
        raise KernelgenValueError("seqlens= calls pool their own keys: pass no key_reps=")
    return TokenRows(_check_row_ints("seqlens", seqlens, shapes, device))


def check_row_ints(name: str, value, rows: int, device) -> torch.Tensor:
    """A cache's per-row ints (`cache_seqlens`, `cache_leftpad`) of `rows` batch rows, checked as a call checks
    them (None passes)."""
    return value if value is None else _check_row_ints(name, value, Shapes(rows, 0, 0, 0, 0, 0, 0), device)


def _check_row_ints(name: str, value, shapes: Shapes, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise KernelgenTypeError(f"{name} must be a torch.Tensor (int32 [B]), got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise KernelgenTypeError(f"{name} must be int32, got dtype {value.dtype}")
    if tuple(value.shape) != (shapes.batch,):
        raise KernelgenValueError(f"{name} must have shape [B] = ({shapes.batch},), got {tuple(value.shape)}")
    if value.device != device:
        raise KernelgenValueError(f"{name} is on {value.device} but q is on {device}")
    if shapes.batch > 1 and value.stride(0) != 1:
        raise KernelgenValueError(f"{name} must be contiguous, got stride {value.stride(0)}")
    return value


def refuse_function_transforms(q, k, v) -> None:
    """torch.func transforms (grad, vjp, vmap, jacrev) hand the call wrapped tensors, which the kernels cannot
    read: torch failed on them with messages about its own internals (an autograd.Function's setup_context, the
    storage of a BatchedTensorImpl)."""
    if torch._C._functorch.peek_interpreter_stack() is None:  # no transform running: a quarter of a microsecond
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise KernelgenTypeError(f"{name} is a tensor of a torch.func transform (grad, vjp, vmap, jacrev, ...), "
                                     "which kernelgen's kernels cannot read: take gradients with loss.backward() or "
                                     "torch.autograd.grad, and batch along B instead of vmap")


def refuse_forward_ad(q, k, v) -> None:
    """Forward-mode AD (`torch.autograd.forward_ad` dual tensors) has no rule here: the kernels read the primals
    only, so o would come back with no tangent, a silently zero directional derivative."""
    if torch.autograd.forward_ad._current_level < 0:  # no dual level open, so no dual tensor: skip 4 us a call
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise KernelgenTypeError(f"{name} is a forward-mode AD dual tensor (torch.autograd.forward_ad): kernelgen "
                                     "has no forward-mode derivative (jvp); use backward mode, loss.backward() or "
                                     "torch.autograd.grad")


def refuse_grad_with_seqlens(cache_seqlens, q, k, v, block_table=None) -> None:
    """A call over per-row lengths, or over a paged cache, has no backward: refuse one whose inputs would take
    gradients."""
    if (cache_seqlens is not None or block_table is not None) and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        if block_table is not None:
            raise KernelgenValueError("block_table= calls (decoding over a paged cache) have no backward: call "
                                      "under torch.no_grad()")
        raise KernelgenValueError("cache_seqlens= calls (a decode step or a prefill chunk over a KV cache) have no "
                                  "backward: call under torch.no_grad(), or without cache_seqlens")


def check_reps_fit_capacity(previous: KeyReps, n_k: int) -> None:
    """Reps of per-row lengths grow with their cache (`key_reps(previous=)`) into a tensor as long or longer; a
    cache moved into a smaller tensor needs them made again."""
    if previous.n_k > n_k:
        raise KernelgenValueError(f"previous key_reps were made for a cache of {previous.n_k} keys a row; k holds "
                                  f"{n_k}: a cache that grew extends them, one moved into a smaller tensor needs "
                                  "attn.key_reps(k, cache_seqlens=...)")


def check_reps_length(key_reps: KeyReps, n_k: int) -> None:
    """Reps made for a call's n_k keys (a cache's capacity), else an error that says how to make them so."""
    if key_reps.n_k != n_k:
        if key_reps.seqlens is not None and key_reps.n_k < n_k:
            fix = "grow them with attn.key_reps(k, cache_seqlens=..., previous=key_reps)"
        elif key_reps.seqlens is not None:  # a cache copied into a smaller tensor: its reps are not cropped
            fix = "make them for this k with attn.key_reps(k, cache_seqlens=...)"
        elif key_reps.n_k < n_k:
            fix = "extend them with attn.key_reps(k, previous=key_reps)"
        else:  # a cache cropped to a prefix of their keys
            fix = f"attn.key_reps(k, previous=key_reps.cropped({n_k})) makes them for this k"
        raise KernelgenValueError(f"key_reps were made for n_k = {key_reps.n_k} keys but k has {n_k}: {fix}")


def check_key_reps(key_reps, spec: Spec, shapes: Shapes, device, varlen: bool = False) -> torch.Tensor:
    """The representatives tensor of a call's `key_reps=`, if they were made for this spec's blocks and this
    call's k (its batch, KV heads, length and device): a few comparisons, no launch."""
    if spec.selection_role not in ("select", "kv_select"):
        raise KernelgenValueError(f"key_reps= is the input of the pooling selectors (mean, multi:r); spec.selector="
                                  f"{spec.selector!r} takes none")
    if not isinstance(key_reps, KeyReps):
        other = (" of another copy of kernelgen (an exported module's calls take the KeyReps of its own key_reps())"
                 if type(key_reps).__name__ == "KeyReps" else "")
        raise KernelgenTypeError(f"key_reps must be the KeyReps of attn.key_reps(k), got {type(key_reps).__name__}"
                                 f"{other}")
    made = (key_reps.kv_block, key_reps.groups)
    if made != (spec.kv_block, spec.groups):
        raise KernelgenValueError(f"key_reps were made for kv_block, groups = {made}; this spec has "
                                  f"{(spec.kv_block, spec.groups)}")
    check_reps_length(key_reps, shapes.n_k)
    expected = (shapes.batch, shapes.heads_kv, shapes.n_kv_blocks, spec.groups, spec.head_dim)
    if tuple(key_reps.reps.shape) != expected:
        raise KernelgenValueError(f"key_reps hold shape {tuple(key_reps.reps.shape)}; this call's k needs "
                                  f"[B, Hkv, n_kv_blocks, r, D] = {expected}")
    if key_reps.reps.device != device:
        raise KernelgenValueError(f"key_reps are on {key_reps.reps.device} but q is on {device}")
    if (key_reps.seqlens is not None) != varlen:
        made, call = ("with", "has none") if key_reps.seqlens is not None else ("without", "has them")
        raise KernelgenValueError(f"key_reps were made {made} cache_seqlens= (per-row lengths, which a paged "
                                  f"cache's block_table= always gives) but this call {call}: make them as the calls "
                                  "that read them are made")
    return key_reps.reps


def autocast_qkv(q, k, v):
    """q, k and v in CUDA autocast's dtype where it is on, as SDPA's are cast (a float32 model under
    torch.autocast calls with float32 tensors), else as they are. The casts are differentiable: float32 leaves
    get float32 gradients."""
    if isinstance(q, torch.Tensor) and q.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                     and t.dtype not in KV_CACHE_FP8 else t for t in (q, k, v))  # an fp8 cache stays one
    return q, k, v


def _common_qkv(q, k, v, spec: Spec) -> bool:
    """Whether q, k and v pass every check of `_explain_qkv`, tested in one expression (this runs on every call):
    False sends them to `_explain_qkv`, which names what is wrong (or returns: CPU tensors under the
    interpreter)."""
    try:
        return (q.dim() == 4 and k.dim() == 4 and q.dtype in _GPU_DTYPES and k.dtype == v.dtype
                and (k.dtype == q.dtype or k.dtype in KV_CACHE_FP8)
                and q.shape[-1] == spec.head_dim and k.shape == v.shape and k.shape[-1] == spec.head_dim
                and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
                and q.is_cuda and k.device == q.device and v.device == q.device and not interpreting())
    except (AttributeError, TypeError):  # not tensors
        return False


def check_qkv(q, k, v, spec: Spec) -> Shapes:
    """Reject anything the kernels cannot compute, naming the argument and what was expected."""
    if not _common_qkv(q, k, v, spec):
        _explain_qkv(q, k, v, spec)
    b, hq, nq, _ = q.shape
    bk, hkv, nk, _ = k.shape
    if bk != b:
        raise KernelgenValueError(f"k.shape[0] = {bk} does not match q.shape[0] = {b} (batch); the layout is {LAYOUT}")
    if hq != hkv * spec.gqa_group:
        raise KernelgenValueError(f"q has {hq} heads (dim 1) but k has {hkv} and spec.gqa_group = {spec.gqa_group}: "
                                  f"expected {hkv * spec.gqa_group}; the layout is {LAYOUT}")
    if nq < 1 or nk < 1 or b < 1 or hkv < 1:
        raise KernelgenValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return Shapes(b, hq, hkv, nq, nk, spec.n_q_tiles(nq), spec.n_kv_blocks(nk))


PAGED_LAYOUT = ("k and v [n_pages, Hkv, page_size, D] (a pool of pages; FlashAttention's [n_pages, page_size, Hkv, D] "
                "as .transpose(1, 2)), block_table int32 [B, pages a row]")


def check_paged_kv(q, k, v, block_table, spec: Spec) -> Shapes:
    """A call over a paged KV cache: q [B, Hq, Nq, D] (a decode step's or a prefill chunk's queries); k and v
    pools of pages [n_pages, Hkv, page_size, D] (`check_pages`). Row b's key p sits in page
    block_table[b, p // page_size] at row p % page_size: the call's Nk is pages a row x page_size."""
    for name, pool in (("k", k), ("v", v)):  # the pools' own layout named first, not the contiguous one
        if isinstance(pool, torch.Tensor) and pool.dim() != 4:
            raise KernelgenValueError(f"{name} must be 4-D [n_pages, Hkv, page_size, D] with block_table=, got shape "
                                      f"{tuple(pool.shape)}")
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.shape != v.shape:
        raise KernelgenValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}; "
                                  f"the paged layout is {PAGED_LAYOUT}")
    if not _common_qkv(q, k, v, spec):
        _explain_qkv(q, k, v, spec)  # raises naming what is wrong; returns when each tensor is fine
    b, hq, nq, _ = q.shape
    batch, hkv, n_k = check_pages(k, block_table, spec)
    if batch != b:
        raise KernelgenValueError(f"block_table.shape[0] = {batch} does not match q.shape[0] = {b} (batch)")
    if hq != hkv * spec.gqa_group:
        raise KernelgenValueError(f"q has {hq} heads (dim 1) but k has {hkv} and spec.gqa_group = {spec.gqa_group}: "
                                  f"expected {hkv * spec.gqa_group}; the paged layout is {PAGED_LAYOUT}")
    if min(hq, nq) < 1:
        raise KernelgenValueError(f"empty input: q {tuple(q.shape)}")
    return Shapes(b, hq, hkv, nq, n_k, spec.n_q_tiles(nq), spec.n_kv_blocks(n_k))


def check_pages(k, block_table, spec: Spec) -> tuple[int, int, int]:
    """A paged cache k [n_pages, Hkv, page_size, D] (a tensor `_explain_qkv` passed), pages of any size (whole
    blocks, or blocks over several pages: vLLM's 16 keys a page, SGLang's 1), and its block_table int32
    [B, pages a row] on k's device with contiguous rows: (B, Hkv, Nk = pages a row x page_size). Page ids are read
    on the device; one outside [0, n_pages) is a page of no keys."""
    if not isinstance(block_table, torch.Tensor):
        raise KernelgenTypeError(f"block_table must be a torch.Tensor (int32 [B, pages a row]), got "
                                 f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise KernelgenTypeError(f"block_table must be int32, got dtype {block_table.dtype}")
    if block_table.dim() != 2 or min(block_table.shape) < 1:
        raise KernelgenValueError(f"block_table must have shape [B, pages a row], got {tuple(block_table.shape)}")
    if block_table.device != k.device:
        raise KernelgenValueError(f"block_table is on {block_table.device} but k is on {k.device}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise KernelgenValueError(f"block_table's rows must be contiguous, got strides {block_table.stride()}")
    n_pages, hkv, page_size, _ = k.shape
    if min(n_pages, hkv, page_size) < 1:
        raise KernelgenValueError(f"empty input: k {tuple(k.shape)}")
    return block_table.shape[0], hkv, block_table.shape[1] * page_size


def check_keys(k, spec: Spec) -> tuple[int, int, int]:
    """k alone, held to the rules `check_qkv` holds k to (a cache whose representatives are kept): (B, Hkv, Nk)."""
    if not _common_qkv(k, k, k, spec):
        _explain_qkv(k, k, k, spec, first="k")  # raises naming what is wrong; returns when k passes
    b, hkv, n_k, _ = k.shape
    if min(b, hkv, n_k) < 1:
        raise KernelgenValueError(f"empty input: k {tuple(k.shape)}")
    check_fp8_arch(k)
    return b, hkv, n_k


def _explain_qkv(q, k, v, spec: Spec, first: str = "q") -> None:
    """Raise the precise error for inputs that failed check_qkv's fast test (returns if they are
    fine after all: CPU tensors under the interpreter). `first`: the name of the tensor passed as q (check_keys
    passes k alone), so that the message names the argument the caller gave."""
    for name, t in ((first, q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelgenTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise KernelgenValueError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        fp8_cache = name in ("k", "v") and t.dtype in KV_CACHE_FP8  # an fp8 KV cache (`check_kv_scales`)
        if t.dtype not in _DTYPES and not fp8_cache:
            expected = "float16 or float32 (bfloat16 on a GPU)" if t.device.type == "cpu" else \
                "float16 or bfloat16"
            raise KernelgenTypeError(f"{name}.dtype must be {expected}, got {t.dtype}")
        if t.shape[-1] != spec.head_dim:
            raise KernelgenValueError(f"{name}.shape[-1] = {t.shape[-1]} does not match spec.head_dim = {spec.head_dim}")
        if t.stride(-1) != 1:
            raise KernelgenValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
        if name == "v" and {k.dtype, t.dtype} & set(KV_CACHE_FP8) and t.dtype != k.dtype:  # an fp8 cache: both
            raise KernelgenTypeError(f"v.dtype = {t.dtype} differs from k.dtype = {k.dtype}")
        if t.dtype != q.dtype and not fp8_cache:
            raise KernelgenTypeError(f"{name}.dtype = {t.dtype} differs from {first}.dtype = {q.dtype}"
                                     + (" (an fp8 KV cache holds k and v both in one fp8 dtype)"
                                        if {k.dtype, v.dtype} & set(KV_CACHE_FP8) else ""))
        if t.device != q.device:
            raise KernelgenValueError(f"{name} is on {t.device} but {first} is on {q.device}")
        if t.device.type == "cuda" and t.dtype not in _GPU_DTYPES and not fp8_cache:
            raise KernelgenTypeError(f"{name}.dtype must be float16 or bfloat16 on a GPU, got {t.dtype}: the kernels' "
                                     "tensor-core products would round float32 to tf32 (cast with .to(torch.bfloat16); "
                                     "float32 runs in kernelgen.reference and the CPU interpreter)")
    if q.device.type == "cuda":
        if interpreting():
            raise KernelgenValueError("CUDA tensors with TRITON_INTERPRET=1: unset it to run the kernels on the GPU")
    elif q.device.type == "cpu":
        if not interpreting():
            raise KernelgenValueError(f"{first} is on the CPU: kernelgen runs on CUDA, or on the CPU only under "
                                      "TRITON_INTERPRET=1")
        if q.dtype == torch.bfloat16:
            raise KernelgenTypeError(f"{first}.dtype = torch.bfloat16 is not supported by the Triton CPU interpreter "
                                     "(it computes garbage); use float16 or float32 on the CPU")
    else:
        raise KernelgenValueError(f"{first} is on {q.device}; expected a CUDA device (or the CPU under "
                                  "TRITON_INTERPRET=1)")
    if k.shape != v.shape:
        raise KernelgenValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}; "
                                  f"the layout is {LAYOUT}")


def lists_type_error(block_idx, expected: str = "a torch.Tensor") -> KernelgenTypeError:
    """The error for a block_idx that is no tensor; a FlexAttention BlockMask, the natural thing for a Flex user
    to pass, is told how to convert it."""
    got = type(block_idx).__name__
    if got == "BlockMask":
        return KernelgenTypeError(f"block_idx must be {expected}, got a FlexAttention BlockMask: pass "
                                  "kernelgen.from_block_mask(block_mask, spec), its lists")
    return KernelgenTypeError(f"block_idx must be {expected}, got {got}")


def check_block_idx(block_idx, spec: Spec, shapes: Shapes, device, validate: bool = False) -> torch.Tensor:
    """A caller's lists checked on the host, as contiguous int32 (the "lists" role then puts them in the
    kernels' form); a batch or KV-head dimension of 1 broadcasts (a BlockMask's B=None, H=None). int64 lists are
    converted exactly: values outside [0, n_kv_blocks) become empty slots, never wrapped ids. With `validate`,
    a repeated id is an error (this reads the lists back)."""
    if not isinstance(block_idx, torch.Tensor):
        raise lists_type_error(block_idx)
    expected = (shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k)
    given = tuple(block_idx.shape)  # the caller's, for an error: not the broadcast one
    if block_idx.dim() == 4 and all(n in (1, want) for n, want in zip(block_idx.shape[:2], expected[:2])):
        block_idx = block_idx.expand(*expected[:2], *block_idx.shape[2:])  # B or Hkv of 1 broadcasts, as in Flex
    if tuple(block_idx.shape) != expected:
        refuse_nsa_layout(given, spec, shapes.n_q, shapes.heads_kv)
        # a list per query given to a Q-centric spec: say which schedule takes them
        other = (" (a list per query: Spec(schedule='kv_centric') takes those)"
                 if not spec.per_query and len(given) == 4 and given[2] == shapes.n_q != shapes.n_q_tiles else "")
        raise KernelgenValueError(f"block_idx.shape = {given}, expected {lists_layout(spec)} = {expected}{other}")
    if block_idx.device != device:
        raise KernelgenValueError(f"block_idx is on {block_idx.device} but q is on {device}")
    if block_idx.dtype == torch.int64:
        block_idx = torch.where((block_idx >= 0) & (block_idx < shapes.n_kv_blocks), block_idx, -1).to(torch.int32)
    elif block_idx.dtype != torch.int32:
        raise KernelgenTypeError(f"block_idx.dtype must be torch.int32 (or int64, converted), got {block_idx.dtype}")
    block_idx = block_idx.contiguous()
    if validate:
        ids = block_idx.long()
        ids = torch.where((ids >= 0) & (ids < shapes.n_kv_blocks), ids, -1).sort(-1).values
        if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
            raise KernelgenValueError("block_idx holds a repeated block id in some list; each list must be a set")
    return block_idx


def refuse_nsa_layout(shape: tuple, spec: Spec, n_q: int, heads_kv: int | None = None) -> None:
    """Raise where per-query lists of this shape look like NSA's (fla-core's) [B, T, Hkv, S]: Nq in dim 1, where
    Hkv belongs (`heads_kv`, None where the caller does not know it: prepare reads Hkv from that dimension)."""
    shape = tuple(shape)
    if not spec.per_query or len(shape) != 4 or shape[1] != n_q or shape[2] == n_q:
        return
    if heads_kv is not None and (shape[1] == heads_kv or shape[2] not in (1, heads_kv)):
        return
    raise KernelgenValueError(f"block_idx.shape = {shape} holds Nq = {n_q} in dim 1; per-query lists are "
                              f"{lists_layout(spec)}: lists in NSA's [B, T, Hkv, S] layout (fla-core's) go in as "
                              "block_idx.transpose(1, 2). If they are so already, q, k and v may be the ones in "
                              "[B, T, H, D]: they go in as q.transpose(1, 2) (k and v likewise)")


def check_block_lists(lists: BlockLists, spec: Spec, shapes: Shapes, device) -> torch.Tensor:
    """The normalised tensor of prepared lists, if they were made for this spec's blocks and this call's
    shapes and device (a few comparisons: no launch, no copy)."""
    if lists.per_query != spec.per_query:
        raise KernelgenValueError(f"block_idx was prepared for {'per-query' if lists.per_query else 'per-Q-tile'} lists; "
                                  f"this spec (schedule={spec.schedule!r}) takes {lists_layout(spec)}")
    made = (lists.kv_block, lists.top_k, lists.n_kv_blocks)
    if made != (spec.kv_block, spec.top_k, shapes.n_kv_blocks):
        raise KernelgenValueError(f"block_idx was prepared for kv_block, top_k, n_kv_blocks = {made}; this call has "
                         f"{(spec.kv_block, spec.top_k, shapes.n_kv_blocks)} (prepare them for this spec and seq_k)")
    expected = (shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k)
    got = tuple(lists.block_idx.shape)
    if got[2] != expected[2]:  # the lists' rows: Q tiles, or queries (per-query lists)
        rows = "queries" if spec.per_query else "Q tiles"
        raise KernelgenValueError(f"block_idx was prepared for {got[2]} {rows}; this call has {expected[2]} "
                                  "(prepare them with this call's number of queries as seq_q)")
    if got != expected:
        raise KernelgenValueError(f"block_idx (prepared) has shape {got}, expected "
                         f"{lists_layout(spec)} = {expected} (prepare lists of the calls' batch and KV heads: "
                         f"a broadcast list as block_idx.expand({expected[0]}, {expected[1]}, -1, -1))")
    if lists.block_idx.device != device:
        raise KernelgenValueError(f"block_idx (prepared) is on {lists.block_idx.device} but q is on {device}")
    return lists.block_idx


def check_length(name: str, n) -> int:
    """A sequence length: any integer type (numpy, a 0-d integer tensor), as range() takes, >= 1; bool and
    float are refused, naming the argument."""
    try:
        length = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        length = None
    if length is None:
        raise KernelgenTypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if length < 1:
        raise KernelgenValueError(f"{name} must be a positive int, got {n!r}")
    return length


def lists_layout(spec: Spec) -> str:
    """The shape of a spec's block lists, in words."""
    return "[B, Hkv, Nq, top_k]" if spec.per_query else "[B, Hkv, n_q_tiles, top_k]"


def describe_index(index) -> str:
    """What `index=` was, for an error: a tuple's or list's length too, since a pair is still a tuple."""
    if isinstance(index, (tuple, list)):
        return f"a {type(index).__name__} of {len(index)}"
    return type(index).__name__


def check_index(index, spec: Spec, shapes: Shapes, device,
                pool: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index selector's (q_idx, k_idx, w), checked against the call's shapes and device (INDEX_LAYOUT);
    Hi comes from q_idx's heads. q_idx and k_idx share a dtype: float16, bfloat16, float32, or float8_e4m3fn on
    sm_90 (Hopper) GPUs; w is float32, float16 or bfloat16. Each is contiguous in its last dim. `pool`: a call
    over a paged cache's (n_pages, page_size): k_idx is a pool of pages [n_pages, Hkv or 1, page_size, Di] that
    the call's block_table reads, as k's (PAGED_INDEX_LAYOUT)."""
    if spec.selector != "index":
        raise KernelgenValueError(f"index= is the input of the 'index' selector; spec.selector={spec.selector!r} "
                                  "takes none (use Spec(selector='index'))")
    if not isinstance(index, (tuple, list)) or len(index) != 3:
        raise KernelgenTypeError(f"index must be a tuple (q_idx, k_idx, w), got {describe_index(index)}; "
                                 f"{INDEX_LAYOUT}")
    q_idx, k_idx, w = index
    for name, t, dims in (("q_idx", q_idx, 4), ("k_idx", k_idx, 4), ("w", w, 3)):
        if not isinstance(t, torch.Tensor):
            raise KernelgenTypeError(f"index: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            layout = PAGED_INDEX_LAYOUT if pool is not None and name == "k_idx" else INDEX_LAYOUT
            raise KernelgenValueError(f"index: {name} must be {dims}-D, got shape {tuple(t.shape)}; {layout}")
        if t.device != device:
            raise KernelgenValueError(f"index: {name} is on {t.device} but q is on {device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:  # one query's w [B, H, 1] is contiguous whatever its stride
            raise KernelgenValueError(f"index: {name} must be contiguous in its last dim (stride 1), got strides "
                                      f"{t.stride()}")
    if q_idx.dtype != k_idx.dtype:
        raise KernelgenTypeError(f"index: k_idx.dtype = {k_idx.dtype} differs from q_idx.dtype = {q_idx.dtype}")
    if q_idx.dtype == _INDEX_FP8:
        _check_index_fp8(device)
    elif q_idx.dtype not in _DTYPES:
        raise KernelgenTypeError(f"index: q_idx.dtype must be float16, bfloat16, float32 (or float8_e4m3fn on sm_90), "
                                 f"got {q_idx.dtype}")
    if w.dtype not in _WEIGHT_DTYPES:
        raise KernelgenTypeError(f"index: w.dtype must be float32, float16 or bfloat16, got {w.dtype}")
    if device.type == "cpu" and torch.bfloat16 in (q_idx.dtype, w.dtype):
        name = "q_idx" if q_idx.dtype == torch.bfloat16 else "w"
        raise KernelgenTypeError(f"index: {name}.dtype = torch.bfloat16 is not supported by the Triton CPU interpreter "
                                 "(it computes garbage); use float16 or float32 on the CPU")
    b, hkv, nq, nk = shapes.batch, shapes.heads_kv, shapes.n_q, shapes.n_k
    heads = q_idx.shape[1]
    if q_idx.shape[0] != b or q_idx.shape[2] != nq:
        hint = ("; DeepSeek's indexer layout [B, T, H, Di] goes in as q_idx.transpose(1, 2)"
                if q_idx.shape[1] == nq else "")
        raise KernelgenValueError(f"index: q_idx.shape = {tuple(q_idx.shape)} must have batch {b} and Nq = {nq} "
                                  f"(q's){hint}; {INDEX_LAYOUT}")
    if heads < hkv or heads % hkv:
        raise KernelgenValueError(f"index: q_idx has {heads} heads (dim 1), expected Hkv*Hi, a multiple of Hkv = {hkv}; "
                                  f"{INDEX_LAYOUT}")
    di = q_idx.shape[3]
    if di not in INDEX_DIMS:
        raise KernelgenValueError(f"index: q_idx.shape[-1] = {di} (Di) is not supported; expected one of {INDEX_DIMS}")
    if pool is not None:
        n_pages, page_size = pool
        if k_idx.shape[0] != n_pages or k_idx.shape[1] not in (hkv, 1) or k_idx.shape[2] != page_size or \
                k_idx.shape[3] != di:
            raise KernelgenValueError(f"index: k_idx.shape = {tuple(k_idx.shape)}, expected pages [n_pages, Hkv or 1, "
                                      f"page_size, Di] = [{n_pages}, {_heads_k(hkv)}, {page_size}, {di}] with "
                                      f"block_table= (k's pool and pages); {PAGED_INDEX_LAYOUT}")
    elif k_idx.shape[0] != b or k_idx.shape[1] not in (hkv, 1) or k_idx.shape[2] != nk or k_idx.shape[3] != di:
        raise KernelgenValueError(f"index: k_idx.shape = {tuple(k_idx.shape)}, expected [B, Hkv or 1, Nk, Di] = "
                                  f"[{b}, {_heads_k(hkv)}, {nk}, {di}]; {INDEX_LAYOUT}")
    if tuple(w.shape) != (b, heads, nq):
        raise KernelgenValueError(f"index: w.shape = {tuple(w.shape)}, expected [B, Hkv*Hi, Nq] = {(b, heads, nq)}; "
                                  f"{INDEX_LAYOUT}")
    return q_idx, k_idx, w


def _heads_k(hkv: int) -> str:
    """k_idx's head counts an error message names: Hkv or 1."""
    return str(hkv) if hkv == 1 else f"{hkv} or 1"


def _check_index_fp8(device) -> None:
    """float8_e4m3fn index vectors run on Hopper (sm_90) only: its tensor cores take e4m3 operands with fp32
    accumulation; elsewhere (older GPUs, Triton's interpreter) they are refused, never computed in garbage."""
    from .device import device_arch

    if device.type != "cuda" or interpreting():
        raise KernelgenTypeError("index: float8_e4m3fn index vectors run on sm_90 (Hopper) GPUs only, not in the "
                                 "Triton CPU interpreter; pass float16 or float32 there")
    arch = device_arch(device)
    if arch != "sm_90":
        raise KernelgenTypeError(f"index: float8_e4m3fn index vectors run on sm_90 (Hopper) GPUs only; this GPU is "
                                 f"{arch}: pass float16 or bfloat16")


def check_return_lse(return_lse) -> bool:
    """return_lse, a bool: any other value (a string, a tensor) would choose the call's return form by its
    truth."""
    if not isinstance(return_lse, bool):
        shown = type(return_lse).__name__ if isinstance(return_lse, torch.Tensor) else repr(return_lse)[:80]
        raise KernelgenTypeError(f"return_lse must be a bool (True: return (o, lse); False: o), got {shown}")
    return return_lse


def softmax_scale(scale, spec: Spec) -> float:
    if scale is None:
        return 1.0 / math.sqrt(spec.head_dim)
    return check_scale(scale)


def check_scale(scale) -> float:
    """A caller's softmax scale (not None) as a float, checked."""
    if type(scale).__module__ == "numpy" and getattr(scale, "ndim", None) == 0:
        scale = scale.item()  # a 0-d array: how dynamo passes a NumPy scalar past a graph break
    # a real scalar (Python's or NumPy's, whose bool is no Real); a tensor is refused: its value would need a read
    # from the device
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise KernelgenTypeError(f"scale must be a finite real number, a Python or NumPy scalar (default "
                                 f"1/sqrt(head_dim)), got {scale!r}")
    if scale <= 0:
        # the kernels take each row's running max on unscaled scores (as FlashAttention does)
        raise KernelgenValueError(f"scale must be > 0 (default 1/sqrt(head_dim)), got {scale!r}")
    return float(scale)



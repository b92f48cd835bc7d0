"""get_kernel(spec): the public entry. Chooses a backend and configs per call shape, builds kernels once,
launches them.

A call's roles and who runs them: `lists` (caller-given lists to the kernels' form) or `select` (the
spec's selector), then `attn` (`decode` for a call of at most `roles.DECODE_MAX_QUERIES` queries, decoding
against a KV cache; `append_kv` first where the call writes new keys into the cache); with inputs that require
grad, its backward runs `bwd_delta`, `bwd_dq` and `bwd_dkdv`
over the lists the forward used (`_AttentionFunction`; the KV-centric schedule's: `kv_select` or
`kv_select_index`, `kv_attn` or, for prepared lists whose neighbours agree, `kv_attn_union`, and `kv_bwd` or
`kv_bwd_union` in the backward). The spec's backend runs each role it
has; the registry's fallback runs the others (`backends.runner`). A role's config is, in this order:
pinned by the caller, the tuning DB's winner for the spec, the nearest tuned spec's winner (user DB, then
the bundled one; `kernelgen.tuning.lookup.served_config`), or the backend's default. A winner measured
under another torch or CUDA runtime is re-checked against the reference once before it is served. With
KERNELGEN_AUTOTUNE=1 a role served anything but its own winner is tuned in the background
(`kernelgen.tuning.autotune`). Under `auto`, a role that a backend compiling per problem shape (TileLang) serves
compiles for at most KERNELGEN_PER_SHAPE_LIMIT (default 8) shapes in a process; calls of other shapes run it on the
fastest backend that compiles once per spec (`SparseAttention._past_shape_limit`).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from . import backends
from .backends import Backend, Problem, RoleImpl
from .errors import KernelgenRuntimeError, KernelgenTypeError, KernelgenValueError
from .inputs import (BlockLists, KeyReps, Shapes, apart_from_cache, autocast_qkv, check_block_idx,
                     check_block_lists, CacheRows, TokenRows, check_cache_rows, check_index, check_key_reps,
                     check_kv_scales, check_new_keys, NewKeys, check_fp8_arch,
                     check_reps_fit_capacity, check_keys, check_length, check_row_ints, check_scale, refuse_cast_cache,
                     check_paged_kv, check_pages, check_qkv, check_return_lse, check_token_rows, lists_layout,
                     lists_type_error, refuse_forward_ad, refuse_function_transforms,
                     refuse_grad_with_seqlens, refuse_nsa_layout)
from .archs import ANY_ARCH
from .device import device_arch, interpreting, launching_on
from .reverse_index import QueryReverseIndex, ReverseIndex, build_query_reverse_index, build_reverse_index
from .roles import (DECODE_MAX_QUERIES, backward_roles, forward_roles, get_role, pinnable_roles,
                    union_workload_inflation)
from .sinks import check_sinks, with_sinks
from .spec import Spec
from .tile_union import TileUnion, build_tile_union, union_max_inflation
from .tuning.buckets import seq_bucket
from .tuning import autotune
from .tuning.lookup import fastest_backend, recheck, served_config, tuned_row
from .varlen import (VARLEN_CACHE_LAYOUT, QueryGroup, batch_lists, check_packed, check_packed_over_cache,
                     group_queries, group_rows, packed_attention, packed_cache_attention, query_groups)

__all__ = ["get_kernel", "SparseAttention", "Served"]

log = logging.getLogger("kernelgen")

# Under auto, the problem shapes one role of a spec compiles on a backend that compiles per shape, in a process: each
# costs the compiler's time (TileLang: nvcc, seconds) on the call that first sees it; past it, a serving process whose
# lengths vary runs that role where it compiles once (as torch._dynamo's cache_size_limit bounds recompiles)
PER_SHAPE_LIMIT_ENV, PER_SHAPE_LIMIT_DEFAULT = "KERNELGEN_PER_SHAPE_LIMIT", 8
# per-shape kernels a SparseAttention keeps: the least recently used go (rebuilt from the compiler's caches)
SHAPE_KERNELS_KEPT = 64
_NOT_BUILT = object()


def per_shape_limit() -> int:
    """$KERNELGEN_PER_SHAPE_LIMIT, else PER_SHAPE_LIMIT_DEFAULT; a value that is no int >= 0 is a ValueError."""
    value = os.environ.get(PER_SHAPE_LIMIT_ENV, "").strip()
    if not value:
        return PER_SHAPE_LIMIT_DEFAULT
    try:
        limit = int(value)
    except ValueError:
        limit = -1
    if limit < 0:
        raise KernelgenValueError(f"{PER_SHAPE_LIMIT_ENV}={value!r}; expected an int >= 0 (the problem shapes a "
                                  f"role compiles per process under backend='auto'; default {PER_SHAPE_LIMIT_DEFAULT})")
    return limit


@dataclass(frozen=True, repr=False)
class Served:
    """What one role of a call runs: the backend, its kernel spec and config, where the config came
    from ("pinned", "user DB", "bundled DB" or "default"), and the kernel when it is not per shape."""

    role: str
    backend: Backend
    impl: RoleImpl
    spec: Spec
    config: Any
    source: str
    kernel: Any = None

    def __repr__(self) -> str:
        # what a user asks served() for: who runs the role, with what, decided where (not the launch machinery)
        return (f"Served(role={self.role!r}, backend={self.backend.name!r}, config={self.config!r}, "
                f"source={self.source!r})")


def _query_bucket(n_k, dtype) -> int:
    """The length bucket of a question to `config`/`served`/`backend`, its arguments checked: a dtype given as
    'bf16' or a length as '4096' would match no tuned row and answer "default" where calls are served a winner."""
    n_k = check_length("n_k", n_k)
    if not isinstance(dtype, torch.dtype):
        raise KernelgenTypeError(f"dtype must be a torch.dtype, the calls' q.dtype (e.g. torch.bfloat16), got "
                                 f"{type(dtype).__name__} {dtype!r}")
    return seq_bucket(n_k)


# kernelgen.custom_ops, which sets itself here when imported (kernelgen's __init__ imports it; it imports this
# module, so this one cannot import it): what a call being compiled runs instead of this dispatcher
_traced_ops = None


def trace_through(ops) -> None:
    """Make `ops` (kernelgen.custom_ops: sparse_attention, select_blocks, key_reps) what calls run under
    torch.compile."""
    global _traced_ops
    _traced_ops = ops


def _local_device(device) -> torch.device:
    """`device`, or where None this machine's GPU, or its CPU where it has none (the interpreter)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class SparseAttention:
    """Callable returned by `get_kernel(spec)`.

    attn(q, k, v)                         select blocks with the spec's selector, then attend
    attn(q, k, v, block_idx=idx)          attend over caller-given lists (int32 [B, Hkv, n_q_tiles, top_k], -1 empty)
    lists = attn.prepare(idx, seq_q, seq_k)   the same lists checked and normalised once (`BlockLists`);
    attn(q, k, v, block_idx=lists)        calls with them skip that step (one launch fewer per call)
    attn(q, k, v, return_lse=True)        also return lse (float32 [B, Hq, Nq]; a loss may read it)
    attn.select(q, k)                     the lists the selector would use
    reps = attn.key_reps(k)               the `mean`/`multi:r` selector's representatives of k's blocks, kept with a
                                          KV cache (`KeyReps`); attn(q, k, v, key_reps=reps) selects from them, not
                                          by pooling k (a decode step); key_reps(k, previous=reps) extends them
    With Spec(schedule="kv_centric") the lists are per query: int32 [B, Hkv, Nq, top_k]. prepare() serves
    them the union design where neighbouring queries' lists agree closely (`BlockLists.union`); configs=
    {"kv_attn_union": KvUnionConfig(...)} (and "kv_bwd_union" for the backward) pins it for raw and
    selected lists too, built every call.
    attn(q, k, v, index=(q_idx, k_idx, w))    Spec(selector="index"): lists from index vectors
                                          (`inputs.INDEX_LAYOUT`); attn.select(q, k, index=...) likewise
    attn(q, k_pages, v_pages, block_table=t, cache_seqlens=n)   a decode call or prefill chunk over a paged
                                          KV cache (`inputs.PAGED_LAYOUT`); key_reps(k_pages, block_table=t, ...)
                                          likewise; the index selector's k_idx paged the same way, through the
                                          same table (`inputs.PAGED_INDEX_LAYOUT`)
    attn(q, k, v, seqlens=n)              a right-padded batch; attn.varlen(q, k, v, cu_seqlens) packed sequences
                                          (`varlen.VARLEN_LAYOUT`), each as the call over it alone
    attn(q, k, v, sinks=s)                attention sinks: a logit per query head [Hq] in each row's softmax,
                                          with no value (`kernelgen.sinks`); any call, varlen too
    attn(q, k8, v8, cache_seqlens=n, k_scale=s, v_scale=t)   over an fp8 (e4m3fn or e5m2) KV cache: as over
                                          k8 * s and v8 * t (`inputs.check_kv_scales`); paged and varlen too

    q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D]; Hq = spec.gqa_group * Hkv; fp16/bf16 (fp32 in the interpreter).
    With inputs that require grad (and grad enabled), o backpropagates: dq, dk, dv for the lists the forward
    used, deterministic run to run. Under torch.compile the call, select() and key_reps() run
    `kernelgen.custom_ops` (traced whole, forward and backward).
    `validate_lists=True` makes repeated ids in given lists an error (costs a device sync per call).
    """

    def __init__(self, spec: Spec, configs: dict | None = None, validate_lists: bool = False):
        if not isinstance(spec, Spec):
            raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
        backends.check_spec(spec)
        if configs is not None and not isinstance(configs, dict):  # dict() of a list fails naming no argument
            raise KernelgenTypeError(f"configs must be a dict {{role: config}}, e.g. "
                                     f"{{'attn': kernelgen.AttnConfig(...)}}, got {type(configs).__name__}")
        if not isinstance(validate_lists, bool):
            raise KernelgenTypeError(f"validate_lists must be a bool, got {type(validate_lists).__name__} "
                                     f"{validate_lists!r}")
        self.spec = spec
        # what a call being compiled hands the ops: text, which dynamo keeps static (the spec's ints, read from a
        # function compiled over kernels of several specs, it would make symbolic, which the ops cannot take)
        self._spec_text = spec.to_json()
        self.validate_lists = validate_lists
        self._fixed = dict(configs or {})
        self._shape_kernels: dict = {}  # per-shape kernels (TileLang's) of this spec, least recently used first
        self._shapes_compiled: dict = {}  # role -> problem shapes compiled per shape (`_past_shape_limit`)
        self._shape_limit: int | None = None  # per_shape_limit(), read at this kernel's first per-shape compile
        self._said_past_limit: set = set()  # roles whose move past the limit was logged
        self._generation = autotune.generation  # what the served configs were read under
        runs = pinnable_roles(spec)
        for role, cfg in self._fixed.items():
            get_role(role)
            if role not in runs:  # a pin no call reads is a caller's mistake, not a choice to ignore
                raise KernelgenValueError(f"configs pins {role!r}, which no call of {spec} runs; its calls run "
                                          f"{list(runs)}")
            backend = self._pinned_backend(role, cfg)
            # no device yet: what no arch runs fails here, what this one cannot when served
            backend.check_config(get_role(role).kernel_spec(spec, backend.name), role, cfg, ANY_ARCH, spec)

    def _pinned_backend(self, role: str, cfg) -> Backend:
        if self.spec.backend == backends.AUTO:  # any backend's config: it says which backend serves
            return backends.of_config(role, cfg)
        return backends.runner(self.spec.backend, role)

    # ---- what is served ----------------------------------------------------------------------------
    def config(self, role: str, n_q: int, n_k: int, dtype=torch.bfloat16, device=None):
        """The config a call of these lengths runs `role` with: pinned, else the tuning DB's winner for this
        device (default: the GPU, or the CPU where there is none), dtype and length bucket, else the default."""
        check_length("n_q", n_q)
        return self._served(role, _query_bucket(n_k, dtype), dtype, _local_device(device)).config

    def served(self, role: str, n_k: int, dtype=torch.bfloat16, device=None) -> Served:
        """Backend, config and its source for `role` in a call with n_k keys (device: as `config`'s)."""
        return self._served(role, _query_bucket(n_k, dtype), dtype, _local_device(device))

    def backend(self, n_k: int, dtype=torch.bfloat16, device=None) -> str:
        """The backend that runs the attention of a call with n_k keys (device: as `config`'s)."""
        return self._backend(_query_bucket(n_k, dtype), dtype, _local_device(device))

    @functools.lru_cache(maxsize=256)
    def _backend(self, bucket: int, dtype, device) -> str:
        if self.spec.backend != backends.AUTO:
            return self.spec.backend
        if "attn" in self._fixed:
            return backends.of_config("attn", self._fixed["attn"]).name
        return fastest_backend(self.spec, bucket, dtype, device)

    def _role_backend(self, role: str, bucket: int, dtype, device) -> Backend:
        """The backend that runs `role`: under auto, the one a pinned config belongs to, else for a role besides
        the attention the backend whose tuned row for it is fastest (the backward's dK/dV: Triton or TileLang);
        otherwise the attention's backend where it has the role, the fallback where it has not."""
        if self.spec.backend == backends.AUTO and role != "attn":
            if role in self._fixed:
                return self._pinned_backend(role, self._fixed[role])
            fastest = fastest_backend(self.spec, bucket, dtype, device, role)
            if fastest is not None:
                return backends.get(fastest)
        return backends.runner(self._backend(bucket, dtype, device), role, device, self.spec)

    @functools.lru_cache(maxsize=256)
    def _served(self, role: str, bucket: int, dtype, device) -> Served:
        # cached per length bucket: the DB is read once per (role, bucket, dtype, device)
        get_role(role)  # an unknown role is named as such, not as one a backend lacks
        return self._served_on(self._role_backend(role, bucket, dtype, device), role, bucket, dtype, device)

    @functools.lru_cache(maxsize=256)
    def _served_compiled_once(self, role: str, bucket: int, dtype, device) -> Served:
        """`_served`'s role for a call past the per-shape limit: on the backend, among those that compile once per
        spec, whose tuned row for it is fastest, else the one the rule prefers (the attention) or the fallback."""
        name = fastest_backend(self.spec, bucket, dtype, device, role, compiled_once=True)
        backend = backends.get(backends.FALLBACK) if name is None else backends.runner(name, role)
        return self._served_on(backend, role, bucket, dtype, device)

    def _served_on(self, backend: Backend, role: str, bucket: int, dtype, device) -> Served:
        reason = backend.unsupported(self.spec, device)
        if reason:  # never a silent fallback to another backend
            raise KernelgenValueError(reason)
        impl = backend.role(role)
        spec = get_role(role).kernel_spec(self.spec, backend.name)
        if role in self._fixed:
            config, source = self._fixed[role], "pinned"
            backend.check_config(spec, role, config, device_arch(device), self.spec)
        else:
            config, source = self._tuned(backend, spec, role, bucket, dtype, device)
        log.debug("kernelgen serves %s of %s (bucket %d, %s, %s): backend %s, config %s (%s)", role, self.spec,
                  bucket, str(dtype).removeprefix("torch."), device, backend.name, config, source)
        kernel = None if backend.per_shape else self._build(backend, spec, role, config, None)
        return Served(role, backend, impl, spec, config, source, kernel)

    @staticmethod
    def _tuned(backend: Backend, spec: Spec, role: str, bucket: int, dtype, device) -> tuple[Any, str]:
        """(config, source) of a role that is not pinned: tuned (re-checked where measured under another
        runtime), else the default."""
        tuned = served_config(backend, spec, role, bucket, dtype, device)
        if tuned is not None and tuned.soft_mismatch and not recheck(backend, spec, role, tuned.config, bucket,
                                                                     dtype, device, tuned.soft_mismatch):
            tuned = None
        if autotune.enabled() and (tuned is None or tuned.transferred_from is not None):
            autotune.request(spec, role, bucket, device)
        if tuned is None:
            return backend.default_config(spec, role, device_arch(device)), "default"
        return tuned.config, tuned.source

    def _build(self, backend: Backend, spec: Spec, role: str, config, problem: Problem | None):
        """The kernel of a role (an exported module overrides this with its own embedded kernels)."""
        return backend.build(spec, role, config, problem)

    @functools.lru_cache(maxsize=256)
    def _plan(self, bucket: int, dtype, device, decode: bool = False, cache_rows: bool = False,
              paged: bool = False) -> tuple[Served, Served | None, Served]:
        """(lists, the selection role or None, attn): the roles a call may run (`roles.forward_roles`; a call of
        at most DECODE_MAX_QUERIES queries attends with `decode`; `cache_rows`: a prefill over a cache of per-row
        lengths, `paged` over a paged one), in one lookup per call."""
        lists, selection, attn = forward_roles(self.spec, 1 if decode else None, cache_rows, paged)
        return (self._served(lists, bucket, dtype, device),
                self._served(selection, bucket, dtype, device) if selection else None,
                self._served(attn, bucket, dtype, device))

    @functools.lru_cache(maxsize=256)
    def _backward_plan(self, bucket: int, dtype, device) -> tuple[Served, ...]:
        """The backward's roles (`roles.backward_roles`: bwd_delta, bwd_dq, bwd_dkdv; bwd_delta and kv_bwd for
        per-query lists), in one lookup."""
        return tuple(self._served(role, bucket, dtype, device) for role in backward_roles(self.spec))

    def _launch(self, served: Served, like: torch.Tensor, shapes: Shapes, *args, **options):
        with launching_on(like):  # a per-shape kernel is loaded, and every kernel launched, on like's GPU
            kernel = served.kernel
            if kernel is None:  # compiled per problem shape: one dict hit per call once built
                key = (served.role, served.config, shapes, like.dtype, like.device)
                kernel = self._shape_kernels.pop(key, _NOT_BUILT)
                if kernel is _NOT_BUILT and self._past_shape_limit(served, shapes):
                    served = self._served_compiled_once(served.role, seq_bucket(shapes.n_k), like.dtype, like.device)
                    kernel = served.kernel
                else:
                    if kernel is _NOT_BUILT:
                        kernel = self._build(served.backend, served.spec, served.role, served.config,
                                             Problem(like.dtype, shapes, like.device))
                    self._shape_kernels[key] = kernel  # the most recently used last
                    while len(self._shape_kernels) > SHAPE_KERNELS_KEPT:
                        del self._shape_kernels[next(iter(self._shape_kernels))]
            return served.impl.launch(kernel, served.spec, served.config, shapes, *args, **options)

    def _past_shape_limit(self, served: Served, shapes: Shapes) -> bool:
        """Whether a call of `shapes`, new to `served`'s per-shape kernels, runs its role elsewhere: under auto,
        where the role has compiled per_shape_limit() other shapes in this process and is not pinned. Said once
        a role."""
        if self.spec.backend != backends.AUTO or served.role in self._fixed:
            return False
        compiled = self._shapes_compiled.setdefault(served.role, set())
        if shapes in compiled:
            return False
        if self._shape_limit is None:  # once: a call past the limit must not read the environment again
            self._shape_limit = per_shape_limit()
        limit = self._shape_limit
        if len(compiled) < limit:
            compiled.add(shapes)
            return False
        if served.role not in self._said_past_limit:
            self._said_past_limit.add(served.role)
            log.warning("kernelgen: %s of %s has compiled %s for %d problem shapes (it compiles per shape); calls "
                        "of other shapes run it on a backend that compiles once (%s=%d: raise it to compile more)",
                        served.role, self.spec, served.backend.name, limit, PER_SHAPE_LIMIT_ENV, limit)
        return True

    def _run(self, role: str, like: torch.Tensor, shapes: Shapes, *args):
        """Launch any role's kernels for a call of these shapes."""
        return self._launch(self._served(role, seq_bucket(shapes.n_k), like.dtype, like.device), like, shapes, *args)

    # ---- the calls -----------------------------------------------------------------------------------
    def select(self, q: torch.Tensor, k: torch.Tensor, *, index=None, key_reps: KeyReps | None = None,
               cache_seqlens: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
               seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
        if not self.spec.selects:
            raise KernelgenValueError("spec.selector='given' has no selector: pass block_idx to the call")
        if torch.compiler.is_compiling():
            rows = dict(key_reps=key_reps, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, seqlens=seqlens,
                        block_table=block_table)
            if any(value is not None for value in rows.values()):  # the op kernelgen::select_blocks takes none
                return _select_rows_eagerly(self.select, q, k, index=index, **rows)
            if self._outside_graph():
                return _eagerly(self.select, q, k, index=index)
            return self._traced().select_blocks(q, k, self._spec_text, index=index)
        q, k, _ = autocast_qkv(q, k, k)
        shapes = self._check_shapes(q, k, k, block_table)
        check_fp8_arch(k)
        rows = self._rows(shapes, q.device, cache_seqlens, cache_leftpad, seqlens, key_reps, index, block_table)
        if self.spec.window is not None and key_reps is None:  # the calls' own lists (a copy: the cached ones stay)
            lists = self._window_lists(shapes, q, rows).contiguous()
        else:
            role = self._selection_role(shapes, rows)  # the selection a call of these queries runs
            served = self._served(role, seq_bucket(shapes.n_k), q.dtype, q.device)
            self._reps_to_rows(k, shapes, key_reps, rows)
            lists = self._select(q, k, shapes, index, served, key_reps, rows)
        if isinstance(rows, TokenRows):
            lists = _padding_lists_emptied(lists, rows.seqlens, self.spec.list_queries)
        return lists

    def _check_shapes(self, q, k, v, block_table) -> Shapes:
        """A call's checked shapes: of q, k and v, or of a call over a paged cache (`block_table`)."""
        if block_table is None:
            return check_qkv(q, k, v, self.spec)
        return check_paged_kv(q, k, v, block_table, self.spec)

    def _rows(self, shapes: Shapes, device, cache_seqlens, cache_leftpad, seqlens, key_reps, index,
              block_table=None) -> CacheRows | TokenRows | None:
        """A call's checked rows: a KV cache's rows (`cache_seqlens`, `cache_leftpad`; its pages,
        `block_table`), a right-padded batch's tokens (`seqlens`), or None."""
        if block_table is not None:
            if seqlens is not None:
                raise KernelgenValueError("pass seqlens= (a right-padded batch's tokens) or block_table= (a paged "
                                          "KV cache's), not both")
            return check_cache_rows(cache_seqlens, cache_leftpad, shapes, device, block_table)
        if seqlens is None:
            return check_cache_rows(cache_seqlens, cache_leftpad, shapes, device)
        return check_token_rows(seqlens, self.spec, shapes, device, key_reps=key_reps, index=index,
                                cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)

    def _selection_role(self, shapes: Shapes, rows) -> str | None:
        """The selection role a call runs: a Q-centric padded batch's is the decode selection, whose module has
        the per-row kernels (each row pooled and scored over its own tokens); the per-query selector's module
        has them itself."""
        if isinstance(rows, TokenRows):  # a prefill's, however few its queries
            return forward_roles(self.spec, None if self.spec.per_query else 1)[1]
        return forward_roles(self.spec, shapes.n_q, isinstance(rows, CacheRows))[1]

    @staticmethod
    def _varlen(served: Served, rows: CacheRows | TokenRows | None, scaled: bool = False) -> dict:
        """The launch options that pass a call's `cache_seqlens` and `cache_leftpad` (or a padded batch's
        `seqlens`, its queries the rows' own tokens) to a role that takes them (none without); `scaled` (a role that
        reads the cache's values: attention, appending): an fp8 cache's scales too, as `kv_scales=`. Selection reads
        an fp8 cache's keys unscaled: a positive scale a (batch row, KV head) ranks its blocks alike."""
        if rows is None:
            return {}
        if scaled and isinstance(rows, CacheRows) and rows.kv_scales is not None:
            if not served.impl.fp8_kv:
                raise KernelgenValueError(f"k and v are an fp8 KV cache: the {served.role!r} role of backend "
                                          f"{served.backend.name!r} reads no fp8 KV cache (the Triton backend's "
                                          "calls over a cache do: decode, attn_rows, attn_paged, kv_attn_rows and "
                                          "kv_attn_paged)")
            return SparseAttention._varlen(served, rows) | {"kv_scales": rows.kv_scales}
        if not served.impl.varlen:
            name = "seqlens" if isinstance(rows, TokenRows) else "cache_seqlens"
            raise KernelgenValueError(f"{name}=: the {served.role!r} role of backend {served.backend.name!r} "
                                      "takes no per-row lengths (the Triton backend's decode, attn_rows, "
                                      "kv_attn_rows, its pooling selectors' and key_reps do: mean or multi:r, or "
                                      "given lists)")
        if isinstance(rows, TokenRows):
            return {"seqlens": rows.seqlens, "row_queries": True}
        if rows.block_table is None:
            return {"seqlens": rows.seqlens, "leftpad": rows.leftpad}
        if not served.impl.paged:
            raise KernelgenValueError(f"block_table=: the {served.role!r} role of backend {served.backend.name!r} "
                                      "reads no paged cache (the Triton backend's decode, attn_paged, "
                                      "kv_attn_paged, its pooling selectors' and key_reps do)")
        return {"seqlens": rows.seqlens, "block_table": rows.block_table}

    def _reps_to_rows(self, k, shapes: Shapes, key_reps, rows: CacheRows | None) -> None:
        """Kept reps of a cache of per-row lengths, brought in place to a call's rows before it selects from
        them (one launch, pooling only the tiles that changed: none but the last partial one when they were
        grown to these rows already). The reps' lengths live on the device, so a call cannot compare them with
        its own without a host sync; growing them instead makes a call select from exactly its rows' keys,
        never from reps of other lengths or another left padding."""
        if rows is None or not isinstance(key_reps, KeyReps) or key_reps.seqlens is None:
            return  # nothing to follow; `_select`'s check names anything wrong
        check_key_reps(key_reps, self.spec, shapes, k.device, varlen=True)
        self._grow_reps(k, shapes, key_reps, rows)

    def _select(self, q, k, shapes: Shapes, index, served: Served, key_reps: KeyReps | None = None,
                rows: CacheRows | TokenRows | None = None) -> torch.Tensor:
        """The selector's lists for a checked call: from q and k (or k's kept representatives, `key_reps`), or
        from `index` (the index selector's); `rows`: a decode call's checked cache rows."""
        if self.spec.selector == "index":
            # per-query lists over a right-padded batch (check_token_rows) select without the lengths: a query's
            # blocks score over the keys it sees, causal within its row, so none of the padding (whose own lists
            # are emptied); over a cache's rows the decode role takes them
            varlen = self._varlen(served, None if isinstance(rows, TokenRows) else rows)
            if key_reps is not None:
                check_key_reps(key_reps, self.spec, shapes, q.device)  # raises: the pooling selectors' input
            if index is None:
                raise KernelgenValueError("spec.selector='index' needs index=(q_idx, k_idx, w) (or block_idx=...)")
            pool = None if "block_table" not in varlen else (k.shape[0], k.shape[2])  # k_idx paged as k is
            return self._launch(served, q, shapes, *check_index(index, self.spec, shapes, q.device, pool), **varlen)
        varlen = self._varlen(served, rows)
        k_rep = None if key_reps is None else check_key_reps(key_reps, self.spec, shapes, q.device, bool(varlen))
        if index is not None:
            check_index(index, self.spec, shapes, q.device)  # raises: index= is the index selector's input
        return self._launch(served, q, shapes, q, k, *(() if k_rep is None else (k_rep,)),  # a plug-in may keep none
                            **varlen)

    def key_reps(self, k: torch.Tensor, *, previous: KeyReps | None = None,
                 cache_seqlens: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None) -> KeyReps:
        """The selector's representatives of k's blocks (`KeyReps`), for calls over this k as `key_reps=`:
        their selection pools q alone, not the whole of k. `previous`: the KeyReps of an earlier k that this
        one extends (a KV cache that grew: the same keys first, more after); only the blocks from previous's
        last partial block on are pooled, the others are copied. The reps are the selector's own bits: a call
        with them selects exactly what a call without them does.

        `cache_seqlens` (int32 [B], on the device): k is a cache of that capacity whose row b holds
        cache_seqlens[b] keys, for calls that pass the same cache_seqlens. With `previous` (made so, for this
        cache), previous is brought to the new lengths in place, on the device, and returned: one launch with
        no host sync, which a CUDA graph can replay (for a longer k, a cache that grew into a new tensor, the
        reps returned take previous's place). A call with `cache_seqlens=` and such reps grows them to its rows
        itself, so a decode step needs this only where k grew into a new tensor. `cache_leftpad` (int32 [B],
        with cache_seqlens): row b's keys start at cache_leftpad[b] (a left-padded batch), its blocks counted
        from there; reps grown to another left padding than they hold are pooled again, on the device.
        `block_table` (int32 [B, pages a row]): k is a paged cache (`inputs.PAGED_LAYOUT`), its reps those of
        the rows its pages hold, per row as with cache_seqlens (each row's capacity without it)."""
        if torch.compiler.is_compiling() and self._outside_graph():
            return _eagerly(self.key_reps, k, cache_seqlens=cache_seqlens, previous=previous,
                            cache_leftpad=cache_leftpad, block_table=block_table)
        if torch.compiler.is_compiling():
            return self._traced().key_reps(k, self._spec_text, cache_seqlens=cache_seqlens, previous=previous,
                                           cache_leftpad=cache_leftpad, block_table=block_table)
        if self.spec.selection_role not in ("select", "kv_select"):
            raise KernelgenValueError(f"key_reps are the pooling selectors' (mean, multi:r); spec.selector="
                                      f"{self.spec.selector!r} keeps none (the index selector's k_idx is its cache)")
        k = autocast_qkv(k, k, k)[0]
        spec = self.spec
        shapes = self._cache_shapes(k, block_table)
        n_k = shapes.n_k
        if previous is not None and not isinstance(previous, KeyReps):
            raise KernelgenTypeError(f"previous must be the KeyReps of attn.key_reps, got {type(previous).__name__}")
        rows = check_cache_rows(cache_seqlens, cache_leftpad, shapes, k.device, block_table)
        if rows is not None:
            return self._key_reps_varlen(k, shapes, previous, rows)
        start = 0  # the first block pooled here
        if previous is not None:
            if previous.seqlens is not None:
                raise KernelgenValueError("previous key_reps were made with cache_seqlens=: grow them with "
                                          "attn.key_reps(k, cache_seqlens=..., previous=...)")
            if previous.n_k > n_k:
                raise KernelgenValueError(f"previous key_reps were made for {previous.n_k} keys; k has {n_k}: a cache "
                                          "that grew extends them, one that shrank needs attn.key_reps(k)")
            check_key_reps(previous, spec, shapes._replace(n_k=previous.n_k,
                                                           n_kv_blocks=spec.n_kv_blocks(previous.n_k)), k.device)
            start = previous.n_k // spec.kv_block  # its blocks before this one are whole, and unchanged
            if previous.n_k == n_k:
                return previous
        served = self._served("key_reps", seq_bucket(n_k), k.dtype, k.device)
        reps = self._launch(served, k, shapes, k[:, :, start * spec.kv_block:])
        if start:
            reps = torch.cat([previous.reps[:, :, :start], reps], dim=2)
        return KeyReps._made_by_key_reps(reps, n_k, spec.kv_block, spec.groups)

    def _cache_shapes(self, k: torch.Tensor, block_table: torch.Tensor | None) -> Shapes:
        """The checked sizes of the cache k (a pool of pages where block_table is given: its rows the table's) as
        key reps see them: one query a row."""
        b, hkv, n_k = check_keys(k, self.spec)
        if block_table is not None:
            b, hkv, n_k = check_pages(k, block_table, self.spec)
        return Shapes(b, hkv * self.spec.gqa_group, hkv, 1, n_k, 1, self.spec.n_kv_blocks(n_k))

    def _key_reps_varlen(self, k: torch.Tensor, shapes: Shapes, previous: KeyReps | None, rows: CacheRows) -> KeyReps:
        """`key_reps` of a checked cache k of per-row keys: made afresh (every block of the capacity pooled,
        each row over its keys), or `previous` grown in place."""
        spec, (b, hkv, n_k) = self.spec, (shapes.batch, shapes.heads_kv, shapes.n_k)
        if previous is None:
            served = self._served("key_reps", seq_bucket(n_k), k.dtype, k.device)
            reps = self._launch(served, k, shapes, k, **self._varlen(served, rows))
            end = rows.seqlens.clamp(0, n_k)
            first = torch.zeros_like(end) if rows.leftpad is None else torch.minimum(rows.leftpad.clamp(min=0), end)
            made, made_leftpad = ((x[:, None].expand(b, hkv).contiguous()) for x in (end - first, first))
            return KeyReps._made_by_key_reps(reps, n_k, spec.kv_block, spec.groups, made, made_leftpad)
        if previous.seqlens is None:
            if rows.block_table is not None:
                raise KernelgenValueError("previous key_reps were made without per-row lengths: a paged cache's "
                                          "rows have them; make them with attn.key_reps(k, block_table=...)")
            raise KernelgenValueError("previous key_reps were made without cache_seqlens=: grow them with "
                                      "attn.key_reps(k, previous=...), or make them with cache_seqlens=")
        if previous.n_k < n_k:  # a cache that grew (a new, longer tensor): room for its new blocks, then grown
            previous = previous._with_room(n_k)
        check_reps_fit_capacity(previous, n_k)
        check_key_reps(previous, spec, shapes, k.device, varlen=True)
        self._grow_reps(k, shapes, previous, rows)
        return previous

    def _grow_reps(self, k, shapes: Shapes, reps: KeyReps, rows: CacheRows) -> None:
        """Checked reps of per-row lengths brought to `rows` in place (`pool_grown`: one launch)."""
        served = self._served("key_reps", seq_bucket(shapes.n_k), k.dtype, k.device)
        self._launch(served, k, shapes, k, grow=(reps.reps, reps.seqlens, reps.leftpad), **self._varlen(served, rows))

    def prepare(self, block_idx: torch.Tensor, seq_q: int, seq_k: int) -> BlockLists:
        """Given lists checked and normalised once, for calls with seq_q queries and seq_k keys (any
        batch, heads and dtype that match block_idx's shape; other lengths with as many Q tiles and KV blocks
        are the same calls to the lists): pass the result as block_idx. Repeated
        ids count once (an error with validate_lists=True), as in a call given the raw lists. Per-query
        lists also get their reverse index, and the design their calls run: the union one where neighbouring
        queries' lists agree closely enough (`BlockLists.union`; measuring that is one host sync)."""
        if torch.compiler.is_compiling():
            return _prepare_eagerly(self.prepare, block_idx, seq_q, seq_k)
        seq_q, seq_k = check_length("seq_q", seq_q), check_length("seq_k", seq_k)
        if not isinstance(block_idx, torch.Tensor):
            raise lists_type_error(block_idx)
        if block_idx.device.type != "cuda" and not interpreting():
            raise KernelgenValueError(f"block_idx is on {block_idx.device}; expected the CUDA device the calls will use")
        if block_idx.dim() != 4:
            raise KernelgenValueError(f"block_idx must be 4-D {lists_layout(self.spec)}, got shape "
                                      f"{tuple(block_idx.shape)}")
        spec = self.spec
        refuse_nsa_layout(block_idx.shape, spec, seq_q)  # dim 1 is read as Hkv below: an error would name T there
        b, hkv = block_idx.shape[:2]
        shapes = Shapes(b, hkv * spec.gqa_group, hkv, seq_q, seq_k, spec.n_q_tiles(seq_q), spec.n_kv_blocks(seq_k))
        checked = check_block_idx(block_idx, spec, shapes, block_idx.device, self.validate_lists)
        # the lists' form does not depend on the dtype of the calls that read them
        lists = self._run("lists", torch.empty(0, dtype=torch.bfloat16, device=block_idx.device), shapes, checked)
        if not spec.per_query:
            return BlockLists._made_by_prepare(lists, spec.kv_block, spec.top_k, shapes.n_kv_blocks)
        # per-query lists carry their reverse index from the start (the gathered forward and the backward walk
        # it) and, where neighbouring queries' lists are close enough, the tile union the union design needs
        reverse = build_query_reverse_index(lists, shapes.n_kv_blocks)
        return BlockLists._made_by_prepare(lists, spec.kv_block, spec.top_k, shapes.n_kv_blocks, True, reverse,
                                           self._union_for(lists, shapes))

    def _window_lists(self, shapes: Shapes, q: torch.Tensor, rows=None) -> torch.Tensor:
        """A selecting window spec's lists for a call of queries `q`, int32 [B, Hkv, n_q_tiles, top_k] in the kernels'
        form, the selector's bit for bit (the window's blocks: its forced local blocks fill top_k, so there is nothing
        to score), the same for every KV head: over a cache's rows (`rows`, CacheRows) each row's own, made per call
        (`window_lists`, one launch); else a view of `_window_tile_lists`, made once per length."""
        if isinstance(rows, CacheRows):
            served = self._served("window_lists", seq_bucket(shapes.n_k), q.dtype, q.device)
            lists = self._launch(served, q, shapes, q.device, **self._varlen(served, rows))
        else:
            lists = self._window_tile_lists(shapes.n_q, shapes.n_k, q.device)
        return lists.expand(shapes.batch, shapes.heads_kv, -1, -1)

    @functools.lru_cache(maxsize=16)
    def _window_tile_lists(self, n_q: int, n_k: int, device) -> torch.Tensor:
        """A selecting window spec's lists for calls of n_q queries over n_k keys, int32 [1, 1, n_q_tiles, top_k]
        (one row for the batch): made once per length, so that the calls skip selection."""
        shapes = Shapes(1, 1, 1, n_q, n_k, self.spec.n_q_tiles(n_q), self.spec.n_kv_blocks(n_k))
        served = self._served("window_lists", seq_bucket(n_k), torch.bfloat16, device)
        return self._launch(served, torch.empty(0, dtype=torch.bfloat16, device=device), shapes, device)

    def _union_for(self, lists: torch.Tensor, shapes: Shapes) -> TileUnion | None:
        """The tile union of prepared per-query lists when the union design computes few enough products
        beyond the pairs they hold to be the faster design (`_union_limit`; one host sync, at prepare time),
        else None. A pinned kv_attn config keeps the gathered design; a pinned kv_attn_union config, the union
        design."""
        if "kv_attn" in self._fixed and "kv_attn_union" not in self._fixed:
            return None
        bucket = seq_bucket(shapes.n_k)
        served = self._served("kv_attn_union", bucket, torch.bfloat16, lists.device)
        union = build_tile_union(lists, served.config.tile_q, shapes.n_kv_blocks)
        if "kv_attn_union" in self._fixed or union.inflation(lists) <= self._union_limit(bucket, torch.bfloat16,
                                                                                        lists.device):
            return union
        return None

    def _union_backward(self, union: TileUnion, block_idx: torch.Tensor, shapes: Shapes, dtype, device) -> bool:
        """Whether the backward over prepared lists whose forward ran the union design runs the union design's
        too: where a config pins one of the two backwards, that one; else where the lists' inflation
        (measured at prepare time: no sync here) is at most `_union_limit` of the backward."""
        if "kv_bwd_union" in self._fixed or "kv_bwd" in self._fixed:
            return "kv_bwd_union" in self._fixed
        return union.inflation(block_idx) <= self._union_limit(seq_bucket(shapes.n_k), dtype, device, backward=True)

    @functools.lru_cache(maxsize=256)
    def _union_limit(self, bucket: int, dtype, device, backward: bool = False) -> float:
        """The inflation up to which the union design (forward, or backward) is the faster one. Where the
        tuning DB holds this spec's own winners of both designs on this GPU, from their rates: each design's
        time is proportional to the pairs it computes (the union design's to its inflation), so the two meet
        at union rate x its workload's inflation / gathered rate. Otherwise `tile_union.union_max_inflation`,
        measured on an H200."""
        gathered, union = ("kv_bwd", "kv_bwd_union") if backward else ("kv_attn", "kv_attn_union")
        served = [self._served(role, bucket, dtype, device) for role in (gathered, union)]
        rows = [tuned_row(s.backend, s.spec, s.role, bucket, dtype, device) if s.source in ("user DB", "bundled DB")
                else None for s in served]
        if all(row is not None and (row.get("tflops") or 0) > 0 for row in rows):
            inflation = union_workload_inflation(self.spec, int(rows[1]["bucket"]), served[1].config.tile_q)
            return rows[1]["tflops"] * inflation / rows[0]["tflops"]
        return union_max_inflation(self.spec.kv_block, backward=backward)

    def _forget_served(self) -> None:
        """Read the tuning DB again on the next call (a background tune has stored a winner)."""
        for cached in (self._backend, self._served, self._served_compiled_once, self._plan, self._backward_plan,
                       self._union_limit):
            cached.cache_clear()
        self._shape_kernels.clear()
        self._generation = autotune.generation

    def __call__(self, q, k, v, *, block_idx=None, index=None, scale=None, return_lse: bool = False,
                 key_reps: KeyReps | None = None, cache_seqlens: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None, seqlens: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                 v_new: torch.Tensor | None = None, k_idx_new: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, k_scale=None, v_scale=None):
        check_return_lse(return_lse)
        if torch.compiler.is_compiling() and self._outside_graph(scale):
            return _eagerly(self, q, k, v, block_idx=block_idx, index=index, scale=scale, return_lse=return_lse,
                            key_reps=key_reps, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                            seqlens=seqlens, block_table=block_table, k_new=k_new, v_new=v_new, k_idx_new=k_idx_new,
                            sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 4:  # else q's own check names q
            check_sinks(sinks, q.shape[1], q.device)
        if torch.compiler.is_compiling():  # dynamo cannot trace this dispatcher (its caches, its host reads)
            o, lse = self._traced().sparse_attention(
                q, k, v, self._spec_text, block_idx=block_idx, scale=scale, index=index, cache_seqlens=cache_seqlens,
                key_reps=key_reps, cache_leftpad=cache_leftpad, seqlens=seqlens, block_table=block_table,
                k_new=k_new, v_new=v_new, k_idx_new=k_idx_new, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
            return (o, lse) if return_lse else o
        q, k, v, shapes, rows, new = self._checked_call(
            q, k, v, block_idx=block_idx, index=index, scale=scale, key_reps=key_reps, cache_seqlens=cache_seqlens,
            cache_leftpad=cache_leftpad, seqlens=seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
            k_idx_new=k_idx_new, k_scale=k_scale, v_scale=v_scale)
        if new is not None:
            rows = self._append(k, v, shapes, new, rows)
        o, lse = self._checked_attention(q, k, v, shapes, rows, block_idx, scale, index, key_reps, sinks)
        return (o, lse) if return_lse else o

    def _checked_attention(self, q, k, v, shapes: Shapes, rows, block_idx, scale, index,
                           key_reps, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of a call that `_checked_call` has checked (and whose new keys are written: `rows`' lengths
        include them), through autograd where the inputs require grad, with `sinks` (checked) joined."""
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            o, lse = _AttentionFunction.apply(q, k, v, self, shapes, block_idx, scale, index, key_reps, rows)
        else:
            if block_idx is None:
                self._reps_to_rows(k, shapes, key_reps, rows)
            o, lse, _ = self._forward(q, k, v, shapes, block_idx, scale, index, key_reps, rows, lists_kept=False)[:3]
        if sinks is not None:
            o, lse = with_sinks(o, lse, sinks)
        if isinstance(rows, TokenRows):
            o, lse = clear_padding(o, lse, rows.seqlens)
        return o, lse

    def _checked_call(self, q, k, v, *, block_idx=None, index=None, scale=None, key_reps=None, cache_seqlens=None,
                      cache_leftpad=None, seqlens=None, block_table=None, k_new=None, v_new=None, k_idx_new=None,
                      k_scale=None, v_scale=None):
        """What a call checks before it writes or launches anything: (q, k, v as autocast leaves them, shapes,
        rows (an fp8 cache's with its scales), the checked new keys it writes first or None)."""
        new = (k_new, v_new, k_idx_new)
        refuse_function_transforms(q, k, v)
        cache = (k, v)
        q, k, v = autocast_qkv(q, k, v)
        refuse_forward_ad(q, k, v)
        shapes = self._start_call(q, k, v, block_table)
        rows = self._rows(shapes, q.device, cache_seqlens, cache_leftpad, seqlens, key_reps, index, block_table)
        rows = check_kv_scales(k, v, k_scale, v_scale, rows, shapes, q.device)
        if isinstance(rows, CacheRows):
            refuse_grad_with_seqlens(rows.seqlens, q, k, v, rows.block_table)
        if all(x is None for x in new):
            return q, k, v, shapes, rows, None
        self._check_before_writing(shapes, q.device, block_idx, index, key_reps, scale, rows)
        return q, k, v, shapes, rows, self._new_keys(k, v, shapes, new, index, rows, cache, cache_seqlens)

    def _new_keys(self, k, v, shapes: Shapes, new: tuple, index, rows, cache: tuple, cache_seqlens) -> NewKeys:
        """A call's new keys (k_new, v_new, k_idx_new), checked for `_append`. `cache`: k and v as the caller
        passed them, which the write must reach."""
        if isinstance(rows, TokenRows):
            raise KernelgenValueError("k_new= writes into a KV cache (cache_seqlens=): a padded batch's call "
                                      "(seqlens=) has none")
        if index is not None:  # checked before anything is written: a refused index writes nothing
            check_index(index, self.spec, shapes, k.device,
                        None if rows is None or rows.block_table is None else (k.shape[0], k.shape[2]))
        new = apart_from_cache(check_new_keys(*new, k, index, shapes, cache_seqlens), k, v)
        refuse_cast_cache(k, v, cache)
        return new

    def _check_before_writing(self, shapes: Shapes, device, block_idx, index, key_reps, scale, rows) -> None:
        """What a call that writes new keys checks before it writes: the host checks its forward makes after the
        write (its lists or their source, kept reps, scale), so that a call refused for them writes nothing."""
        if block_idx is not None and (index is not None or key_reps is not None):
            raise KernelgenValueError(f"pass block_idx= or {'index' if index is not None else 'key_reps'}=, not "
                                      "both: the one chooses the lists the other gives")
        if scale is not None:
            check_scale(scale)
        if block_idx is None and self.spec.selector == "given":
            raise KernelgenValueError(f"spec.selector='given' needs block_idx=int32 {lists_layout(self.spec)}")
        if isinstance(block_idx, BlockLists):
            check_block_lists(block_idx, self.spec, shapes, device)
        elif block_idx is not None:
            check_block_idx(block_idx, self.spec, shapes, device)
        if key_reps is not None:
            check_key_reps(key_reps, self.spec, shapes, device, isinstance(rows, CacheRows))

    def _append(self, k, v, shapes: Shapes, new: NewKeys, rows: CacheRows, **packed) -> CacheRows:
        """Write a call's checked new keys (k_new, v_new; the index selector's k_idx_new) into its cache at each
        row's end, in one launch (two with k_idx), and return its rows grown by them: the call then attends as one
        over the longer rows would. Positions past the capacity (or in a page outside the pool) are not written,
        and the lengths stay clamped to the capacity (no host sync to check them). A call refused after the write
        leaves the new keys past the rows' lengths (the caller's cache_seqlens is not changed), where nothing
        reads them. `packed`: cu_seqlens and most_new, for new keys packed as a varlen call's queries."""
        served = self._served("append_kv", seq_bucket(shapes.n_k), k.dtype, k.device)
        options = self._varlen(served, rows, scaled=True) | packed
        after = self._launch(served, k, shapes, k, new.k, v, new.v, **options)
        if new.k_idx is not None:  # the index keys are not the fp8 cache's: written as they are
            self._launch(served, k, shapes, new.k_idx, new.k_idx_new, **(options | {"kv_scales": None}))
        return rows._replace(seqlens=after)

    def varlen(self, q, k, v, cu_seqlens, max_seqlen=None, *, block_idx=None, index=None, scale=None,
               return_lse: bool = False, cache_seqlens=None, block_table=None, cache_leftpad=None, key_reps=None,
               k_new=None, v_new=None, k_idx_new=None, sinks=None, k_scale=None, v_scale=None):
        """Causal self-attention over packed sequences of different lengths, in FlashAttention's varlen layout
        (`varlen.VARLEN_LAYOUT`): each sequence selects and attends as the call over it alone would, bit for bit,
        forward and backward. o is [total, Hq, D]; lse (return_lse) float32 [Hq, total], as FlashAttention's.
        block_idx: a padded batch's given lists, [n, Hkv, rows, top_k], row d sequence d's. index: the index
        selector's (q_idx, k_idx, w), packed as q is (`varlen.VARLEN_INDEX_LAYOUT`; per-query lists). Eagerly the
        bounds are read from the device once per cu_seqlens tensor; under torch.compile pass max_seqlen (an int: one
        batch, padded to the power of two at or above it).

        With `cache_seqlens=` or `block_table=`, k and v are a KV cache of B rows and q holds each row's new
        queries, packed (`varlen.VARLEN_CACHE_LAYOUT`; cu_seqlens int32 [B + 1]): a serving step mixing decode
        rows and prefill chunks of any lengths in one call. Row b is the call over its cache row with its
        cu_seqlens[b + 1] - cu_seqlens[b] queries (`_varlen_over_cache`); k_new, v_new [total, Hkv, D] (and
        k_idx_new [total, k_idx's heads, Di]), packed as q, are its new tokens' keys, written at each row's end
        first as the call's k_new= writes them. `sinks`, and an fp8 cache's `k_scale` and `v_scale`: as the call's."""
        check_return_lse(return_lse)
        if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 3:  # else q's own check names q
            check_sinks(sinks, q.shape[1], q.device)
        if cache_seqlens is not None or block_table is not None:
            new = (k_new, v_new, k_idx_new)
            if torch.compiler.is_compiling():
                return _varlen_eagerly(self, q, k, v, cu_seqlens, max_seqlen, block_idx=block_idx, index=index,
                                       scale=scale, return_lse=return_lse, cache_seqlens=cache_seqlens,
                                       block_table=block_table, cache_leftpad=cache_leftpad, key_reps=key_reps,
                                       k_new=k_new, v_new=v_new, k_idx_new=k_idx_new, sinks=sinks, k_scale=k_scale,
                                       v_scale=v_scale)
            o, lse = self._varlen_over_cache(q, k, v, cu_seqlens, block_idx, index, scale, cache_seqlens,
                                             block_table, cache_leftpad, key_reps, new, max_seqlen, (k_scale, v_scale))
            if sinks is not None:
                o, lse = with_sinks(o, lse, sinks)
            return (o, lse.t().contiguous()) if return_lse else o
        for name, value in (("cache_leftpad", cache_leftpad), ("key_reps", key_reps), ("k_new", k_new),
                            ("v_new", v_new), ("k_idx_new", k_idx_new), ("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise KernelgenValueError(f"varlen takes {name}= over a KV cache only (with cache_seqlens= or "
                                          "block_table=)")
        total, max_seqlen = check_packed(q, k, v, cu_seqlens, max_seqlen, self.spec, index)
        n = cu_seqlens.shape[0] - 1

        def call(q, k, v, **options):
            return self(q, k, v, **options, scale=scale, return_lse=True)

        o, lse = packed_attention(call, q, k, v, cu_seqlens, max_seqlen,
                                  None if block_idx is None else
                                  (lambda batch: batch_lists(block_idx, batch, self.spec, n, k.shape[1], max_seqlen)),
                                  index)
        if sinks is not None:
            o, lse = with_sinks(o, lse, sinks)
        return (o, lse.t().contiguous()) if return_lse else o  # FlashAttention's varlen lse: [Hq, total]

    def _varlen_over_cache(self, q, k, v, cu_seqlens, block_idx, index, scale, cache_seqlens, block_table,
                           cache_leftpad, key_reps, new=(None, None, None),
                           max_seqlen=None, kv_scales=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
        """`varlen` over a KV cache: (o [total, Hq, D], lse [total, Hq]). The rows are grouped by their query count
        (bounds read once per cu_seqlens tensor) and each group runs as one call of that many queries over its
        rows of the cache: the call each row would make alone, its lists bit for bit. A group's consecutive rows are
        slices of the cache's tensors; a group of rows of a contiguous cache that are not consecutive reads them as
        pages of one row each (its table the rows' ids: no copy), so its prefill chunks run the paged kernels (o to
        rounding); each group takes its rows of kept reps, which its call grows (in place where the rows are
        consecutive, else a copy), and the reps are grown in place to the rows' lengths after the call once, at its
        end (rows grown by their group's call then have nothing left to pool). `new`: the packed new keys (k_new,
        v_new, k_idx_new), written by one launch for every row (after each group's call has been checked as its
        own writing call would be: a refused call writes nothing), before the groups attend. `kv_scales`: an fp8
        cache's (k_scale, v_scale), each group's call given its rows' of [B, Hkv] scales."""
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise KernelgenValueError(f"varlen over a KV cache takes {VARLEN_CACHE_LAYOUT}; {name} is "
                                          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        rows = check_pages(k, block_table, self.spec)[0] if block_table is not None else k.shape[0]
        total = check_packed_over_cache(q, k, cu_seqlens, rows, index, new, block_table is not None)
        check_row_ints("cache_seqlens", cache_seqlens, rows, q.device)
        check_row_ints("cache_leftpad", cache_leftpad, rows, q.device)
        refuse_grad_with_seqlens(cache_seqlens, q, k, v, block_table)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # a graph would hold the groups of the bounds read before it, and replay them whatever the bounds hold
            raise KernelgenValueError("varlen over a KV cache groups its rows by the query counts it reads on the "
                                      "host: it cannot be captured in a CUDA graph (a replay would keep the groups "
                                      "of the capture); capture a batch of one query count with attn(q, ...)")
        groups = query_groups(cu_seqlens, total)
        if groups and max_seqlen is not None and groups[-1].count > check_length("max_seqlen", max_seqlen):
            raise KernelgenValueError(f"a row of {groups[-1].count} new queries is longer than max_seqlen={max_seqlen}")
        # what a group's call cannot see whole, checked before any group writes its new keys or grows its reps
        if groups:
            _group_lists(block_idx, groups[-1], self.spec, rows, k.shape[1])
        cache_shapes = self._cache_shapes(k, block_table)
        if key_reps is not None:  # a group's call checks only its rows' slice of them
            check_key_reps(key_reps, self.spec, cache_shapes, q.device, varlen=True)
        # an fp8 cache's [B, Hkv] scales too: the whole batch's, before groups slice them (the write reads these)
        cache_rows = check_kv_scales(k, v, *kv_scales, CacheRows(cache_seqlens, cache_leftpad, block_table),
                                     cache_shapes, q.device)
        if block_table is None and any(group.first is None for group in groups):
            if cache_leftpad is not None:
                raise KernelgenValueError("varlen over a contiguous KV cache with cache_leftpad= takes the rows of "
                                          "each query count one after another (a paged row starts at its first "
                                          "page): pass the rows of each count in a call of their own")
        k_idx = None if index is None else index[1]

        def group_call(group: QueryGroup, lengths, new_keys, queries=q, packed_index=index) -> tuple[tuple, dict]:
            """The group's call over the cache, its rows' `lengths`, writing `new_keys` (packed, or Nones), of the
            packed `queries` and index selector's inputs."""
            options = dict(cache_seqlens=lengths, cache_leftpad=cache_leftpad, block_table=block_table,
                           key_reps=key_reps, block_idx=_group_lists(block_idx, group, self.spec, rows, k.shape[1]),
                           k_scale=kv_scales[0], v_scale=kv_scales[1])
            cache, group_k_idx = (k, v), k_idx
            if not group.every_row:
                options.update((name, None if x is None else group_rows(x, group)) for name, x in
                               (("cache_seqlens", lengths), ("cache_leftpad", cache_leftpad),
                                ("block_table", block_table)))
                options.update((name, group_rows(x, group)) for name, x in zip(("k_scale", "v_scale"), kv_scales)
                               if isinstance(x, torch.Tensor) and x.numel() > 1)  # [B, Hkv]: the group's rows'
                if isinstance(key_reps, KeyReps):  # the rows' reps, which the group's call grows
                    options["key_reps"] = key_reps._rows_of(functools.partial(group_rows, group=group))
                if block_table is None and group.first is not None:  # a contiguous cache's consecutive rows: a slice
                    cache = tuple(group_rows(x, group) for x in cache)
                    group_k_idx = None if k_idx is None else group_rows(k_idx, group)
                elif block_table is None:  # a contiguous cache's other rows as a pool of one-row pages (checked)
                    options["block_table"] = group.rows.to(torch.int32).view(-1, 1)
            if packed_index is not None:
                options["index"] = (group_queries(packed_index[0], group), group_k_idx,
                                    group_queries(packed_index[2], group).contiguous())
            options.update((name, None if x is None else group_queries(x, group))
                           for name, x in zip(("k_new", "v_new", "k_idx_new"), new_keys))
            return (group_queries(queries, group), *cache), options

        if not groups:  # no row has a query: nothing runs, but what a call of one query a row refuses is refused
            every_row = torch.arange(rows, device=q.device)

            def one_a_row(x):
                return None if x is None else x.new_zeros((rows, *x.shape[1:])).requires_grad_(x.requires_grad)

            args, options = group_call(QueryGroup(every_row, 1, every_row, True, (0, 0)), cache_seqlens,
                                       [one_a_row(x) for x in new], one_a_row(q),
                                       None if index is None else (one_a_row(index[0]), k_idx, one_a_row(index[2])))
            self._checked_call(*args, **options, scale=scale)
        after, checked = cache_seqlens, {}
        if groups and any(x is not None for x in new):
            # each group's call checked as if it wrote its rows' new keys, then one launch writes every row's; the
            # groups then attend as checked, over their rows' new lengths
            for group in groups:
                args, options = group_call(group, cache_seqlens, new)
                checked[id(group)] = self._checked_call(*args, **options, scale=scale)[:5], options
            written = apart_from_cache(NewKeys(new[0], new[1], k_idx, new[2]), k, v)
            after = self._append(k, v, cache_shapes, written, cache_rows, cu_seqlens=cu_seqlens,
                                 most_new=groups[-1].count).seqlens

        def call(group: QueryGroup):
            if id(group) in checked:
                (group_q, group_k, group_v, shapes, group_cache), options = checked[id(group)]
                lengths = after if group.every_row else group_rows(after, group)
                return self._checked_attention(group_q, group_k, group_v, shapes,
                                               group_cache._replace(seqlens=lengths), options["block_idx"], scale,
                                               options.get("index"), options["key_reps"])
            args, options = group_call(group, after, (None, None, None))
            return self(*args, **options, scale=scale, return_lse=True)

        out = packed_cache_attention(call, q, groups)
        if isinstance(key_reps, KeyReps) and key_reps.seqlens is not None:
            # every row's reps grown to its length after the call (the groups' calls grew theirs already); without
            # cache_seqlens a row holds the whole capacity
            if after is None:
                capacity = k.shape[2] * (1 if block_table is None else block_table.shape[1])
                after = torch.full((rows,), capacity, dtype=torch.int32, device=k.device)
            self.key_reps(k, cache_seqlens=after, cache_leftpad=cache_leftpad, previous=key_reps,
                          block_table=block_table)
        return out

    def _outside_graph(self, scale=None) -> bool:
        """Whether a call being compiled runs eagerly, outside the graph (`_eagerly`): the ops serve the spec's
        tuned configs, not pinned ones, and take scale as a Python float (dynamo traces a NumPy scalar as a
        tensor; eagerly a NumPy scalar runs and a tensor or bool is refused by name)."""
        return bool(self._fixed) or (scale is not None and (isinstance(scale, bool) or
                                                            not isinstance(scale, (int, float))))

    def _traced(self):
        """kernelgen.custom_ops, which a call being compiled runs instead: get_kernel(spec)'s kernels as ops that
        torch.compile traces (fullgraph, forward and backward), with the spec's tuned configs."""
        if _traced_ops is None:
            raise KernelgenRuntimeError("under torch.compile a call runs kernelgen.custom_ops: import it first")
        return _traced_ops

    def _start_call(self, q, k, v, block_table=None) -> Shapes:
        """What every call does first: check the inputs, and take up winners a background tune stored."""
        shapes = self._check_shapes(q, k, v, block_table)
        if autotune.running():
            autotune.poll()
        if self._generation != autotune.generation:
            self._forget_served()
        return shapes

    def _attend(self, q, k, v, shapes: Shapes, block_idx, scale, index=None,
                key_reps: KeyReps | None = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The forward of a checked call: (o, lse, the lists it attended over: the BlockLists given, else
        the normalised or selected int32 tensor). `index`: the index selector's (q_idx, k_idx, w); `key_reps`:
        the pooling selectors' kept representatives of k."""
        return self._forward(q, k, v, shapes, block_idx, scale, index, key_reps)[:3]

    def _forward(self, q, k, v, shapes: Shapes, block_idx, scale, index=None, key_reps: KeyReps | None = None,
                 rows: CacheRows | TokenRows | None = None, lists_kept: bool = True):
        """`_attend`'s (o, lse, lists), and the tile union the forward built for raw or selected lists under a
        pinned union config (None otherwise): a backward of the union design reuses it. `rows`: a decode call's
        checked cache rows, or a padded batch's tokens (o and lse then hold the padding's too: the caller
        clears them). `lists_kept=False` (no backward will read the lists): a selecting window spec's decode
        computes its lists in the kernel, and the lists returned are None."""
        padded = isinstance(rows, TokenRows)  # a right-padded batch: its whole rows attend, each row selects alone
        cache_rows = isinstance(rows, CacheRows)
        lists, select, attn = self._plan(seq_bucket(shapes.n_k), q.dtype, q.device,
                                         shapes.n_q <= DECODE_MAX_QUERIES and not padded, cache_rows,
                                         cache_rows and rows.block_table is not None)
        if padded and select is not None:
            select = self._served(self._selection_role(shapes, rows), seq_bucket(shapes.n_k), q.dtype, q.device)
        if block_idx is not None and index is not None:
            raise KernelgenValueError("pass block_idx= or index=, not both: index= chooses the lists block_idx= gives")
        if block_idx is not None and key_reps is not None:
            raise KernelgenValueError("pass block_idx= or key_reps=, not both: key_reps= feeds the selector, block_idx= "
                                      "gives the lists")
        if block_idx is None:
            if select is None:
                if index is not None:
                    check_index(index, self.spec, shapes, q.device)  # raises: not an index spec
                if key_reps is not None:
                    check_key_reps(key_reps, self.spec, shapes, q.device)  # raises: no selector to feed
                raise KernelgenValueError(f"spec.selector='given' needs block_idx=int32 {lists_layout(self.spec)}")
            if self.spec.window is not None and key_reps is None:
                # a decode whose lists no backward reads makes them itself: no launch of window_lists
                made_here = lists_kept or attn.role != "decode"
                used = normalised = self._window_lists(shapes, q, rows) if made_here else None
            else:
                used = normalised = self._select(q, k, shapes, index, select, key_reps, rows)
        elif isinstance(block_idx, BlockLists):
            used, normalised = block_idx, check_block_lists(block_idx, self.spec, shapes, q.device)
        else:
            checked = check_block_idx(block_idx, self.spec, shapes, q.device, self.validate_lists)
            used = normalised = self._launch(lists, q, shapes, checked)
        prepared = isinstance(used, BlockLists)
        if padded and not prepared:
            used = normalised = _padding_lists_emptied(normalised, rows.seqlens, self.spec.list_queries)
        built = None  # the union built here for raw or selected lists
        if attn.role == "kv_attn" and ((prepared and used.union is not None)
                                       or (not prepared and "kv_attn_union" in self._fixed)):
            # prepared lists whose union is close enough, or raw and selected lists under a pinned union config
            # (the caller knows they agree: their union is built each call)
            served = self._served("kv_attn_union", seq_bucket(shapes.n_k), q.dtype, q.device)
            union = used.union if prepared else build_tile_union(normalised, served.config.tile_q, shapes.n_kv_blocks)
            built = None if prepared else union
            o, lse = self._launch(served, q, shapes, q, k, v, normalised, union, scale)
        elif get_role(attn.role).reverse_index:
            reverse = used.reverse_index() if prepared else None
            o, lse = self._launch(attn, q, shapes, q, k, v, normalised, reverse, scale,
                                  **self._varlen(attn, None if padded else rows, scaled=True))
        else:
            # a padded batch's attention runs over whole rows: causal, a row's tokens see none of its padding
            o, lse = self._launch(attn, q, shapes, q, k, v, normalised, scale,
                                  **self._varlen(attn, None if padded else rows, scaled=True))
        return o, lse, used, built

    def _gradients(self, do, q, k, v, o, lse, block_idx: torch.Tensor, scale,
                   reverse: ReverseIndex | QueryReverseIndex | None = None,
                   needs=(True, True, True), shapes: Shapes | None = None,
                   union: TileUnion | None = None,
                   dlse: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        """(dq, dk, dv) of o = attn(q, k, v, block_idx=..., scale=scale) given do, its forward's o and lse,
        and the lists it attended over, in the kernels' form (`block_idx`; `reverse`, their reverse index,
        is built when None: a QueryReverseIndex for per-query lists; `union`: prepared per-query lists' tile
        union, whose backward runs instead). A gradient that `needs` leaves out is None, and not computed.
        `shapes`: the forward's checked shapes of these q, k, v (checked again when None). `dlse`: lse's
        gradient, where the loss reads lse too (None: it does not)."""
        if shapes is None:
            shapes = check_qkv(q, k, v, self.spec)
        if do is None:  # only lse reached the loss
            do = torch.zeros_like(o)
        if do.stride(-1) != 1:  # the kernels read rows with unit stride (an expanded do of o.sum() has 0)
            do = do.contiguous()
        delta_role, *grad_roles = self._backward_plan(seq_bucket(shapes.n_k), q.dtype, q.device)
        delta = self._launch(delta_role, q, shapes, o, do)
        if dlse is not None:
            delta = with_lse_gradient(delta, dlse, lse)
        if union is not None:  # the union design's: dq per tile, dk and dv per block over the unions
            served = self._served("kv_bwd_union", seq_bucket(shapes.n_k), q.dtype, q.device)
            grads = self._launch(served, q, shapes, q, k, v, do, lse, delta, block_idx, union, scale)
            return tuple(grad if need else None for grad, need in zip(grads, needs))
        if self.spec.per_query:  # one walk of the reverse index gives all three
            if reverse is None:
                reverse = build_query_reverse_index(block_idx, shapes.n_kv_blocks)
            dq, dk, dv = self._launch(grad_roles[0], q, shapes, q, k, v, do, lse, delta, block_idx, reverse, scale)
            return tuple(grad if need else None for grad, need in zip((dq, dk, dv), needs))
        dq_role, dkdv_role = grad_roles
        dq = self._launch(dq_role, q, shapes, q, k, v, do, lse, delta, block_idx, scale) if needs[0] else None
        dk = dv = None
        if needs[1] or needs[2]:
            if reverse is None:
                reverse = build_reverse_index(block_idx, shapes.n_kv_blocks)
            dk, dv = self._launch(dkdv_role, q, shapes, q, k, v, do, lse, delta, reverse, scale)
        return dq, dk if needs[1] else None, dv if needs[2] else None

    def __repr__(self) -> str:
        return f"SparseAttention({self.spec})"


NO_DOUBLE_BACKWARD = ("kernelgen's attention gradients are not differentiable (no double backward): dq, dk and dv "
                      "from a create_graph=True backward cannot be backpropagated again")


@torch.compiler.disable(reason="kernelgen: a call with pinned configs (an exported module pins them all) or a "
                               "scale that is not a Python float runs outside the graph, eagerly: the custom ops "
                               "serve the spec's tuned configs and take a Python float scale")
def _eagerly(method, *args, **kwargs):
    """A compiled call that the custom ops cannot take (`SparseAttention._outside_graph`), run eagerly: a graph
    break (under fullgraph=True, dynamo's error giving the reason above)."""
    return method(*args, **kwargs)


@torch.compiler.disable(reason="kernelgen: attn.prepare reads the lists on the host (its checks, its reverse "
                               "index): it runs eagerly, outside the graph; prepare the lists before the compiled "
                               "region and pass them in, or pass the raw lists as block_idx")
def _prepare_eagerly(prepare, *args):
    return prepare(*args)


@torch.compiler.disable(reason="kernelgen: select() over a cache's or a padded batch's rows (key_reps, "
                               "cache_seqlens, cache_leftpad, seqlens, block_table) runs eagerly, outside the graph: "
                               "the op kernelgen::select_blocks takes q, k and index= only (a call with those "
                               "arguments selects and attends in one op)")
def _select_rows_eagerly(select, *args, **kwargs):
    return select(*args, **kwargs)


@torch.compiler.disable(reason="kernelgen: varlen over a KV cache reads its bounds on the host (one group of rows "
                               "per query count), which a graph cannot hold: it runs eagerly")
def _varlen_eagerly(attn, *args, **kwargs):
    return attn.varlen(*args, **kwargs)


def _group_lists(block_idx, group: QueryGroup, spec: Spec, rows: int, heads_kv: int):
    """A group's rows of a varlen-over-cache call's given lists, [B, Hkv or 1, at least the longest row's lists,
    top_k] (row b's first n_q_tiles of its count: its call's lists), or None."""
    if block_idx is None:
        return None
    if not isinstance(block_idx, torch.Tensor):
        raise lists_type_error(block_idx)
    needed = spec.n_q_tiles(group.count)
    if block_idx.dim() != 4 or block_idx.shape[0] not in (1, rows) or block_idx.shape[1] not in (1, heads_kv) or \
            block_idx.shape[2] < needed or block_idx.shape[3] != spec.top_k:
        raise KernelgenValueError(f"varlen over a KV cache takes block_idx [B or 1, Hkv or 1, lists of the row with "
                                  f"the most queries, top_k] (row b's first lists its own), B = {rows}, Hkv = "
                                  f"{heads_kv}, top_k = {spec.top_k}; rows of {group.count} queries need {needed} "
                                  f"lists, got {tuple(block_idx.shape)}")
    picked = block_idx if group.every_row or block_idx.shape[0] == 1 else group_rows(block_idx, group)
    return picked[:, :, :needed]


def once_differentiable(backward):
    """A backward whose gradients raise NO_DOUBLE_BACKWARD when differentiated. torch's once_differentiable ties
    them to fresh leaves, so only a backward that walks every node (`.backward()`) meets the error:
    `torch.autograd.grad(dq.pow(2).sum(), q)` walks only the paths to q and took dq as a constant. Here every
    gradient of a backward run with grad on (create_graph=True) is tied to the saved tensors and grad outputs that
    require grad (q, k, v, do: what the gradients depend on), so any path through them raises. A Function whose
    gradients depend on an input it does not keep in `save_for_backward` must save it too."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled() or all(grad is None for grad in grads):
            return grads
        sources = [x for x in (*ctx.saved_tensors, *grad_outputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        refuse = torch._C._functions.DelayedError(NO_DOUBLE_BACKWARD.encode(), len(grads) + len(sources))
        return refuse(*grads, *sources)[:len(grads)]

    return wrapper


class _AttentionFunction(torch.autograd.Function):
    """attn(q, k, v) with a backward: the forward runs as without grad and keeps the lists it attended over
    (given or selected: never selected again, and selection is not differentiated, as in NSA and DSA);
    lse backpropagates too (as FlexAttention's). A BlockLists' reverse index is built once and
    kept with it; raw or selected lists get theirs in each backward."""

    @staticmethod
    def forward(ctx, q, k, v, attn: SparseAttention, shapes: Shapes, block_idx, scale, index, key_reps, rows):
        o, lse, used, ctx.built_union = attn._forward(q, k, v, shapes, block_idx, scale, index, key_reps, rows)
        ctx.attn, ctx.scale, ctx.shapes = attn, scale, shapes
        ctx.set_materialize_grads(False)  # an output the loss does not read: None, not a zero tensor filled per step
        ctx.prepared = used if isinstance(used, BlockLists) else None
        ctx.save_for_backward(q, k, v, o, lse, used.block_idx if ctx.prepared is not None else used)
        return o, lse

    @staticmethod
    @once_differentiable  # no double backward: the gradients are not differentiated
    def backward(ctx, do, dlse):
        if do is None and dlse is None:
            return (None,) * 10
        q, k, v, o, lse, block_idx = ctx.saved_tensors
        attn = ctx.attn
        union = ctx.prepared.union if ctx.prepared is not None else None
        if union is not None and not attn._union_backward(union, ctx.prepared.block_idx, ctx.shapes, q.dtype,
                                                          q.device):
            union = None  # the gathered design's backward reads the union forward's o and lse alike
        elif union is None and attn.spec.per_query and "kv_bwd_union" in attn._fixed:
            # raw or selected lists, or prepared ones the forward ran gathered, under a pinned union backward
            # config: the union the forward built, else theirs for the backward config's tile_q
            union = ctx.built_union or build_tile_union(block_idx, attn._fixed["kv_bwd_union"].tile_q,
                                                         ctx.shapes.n_kv_blocks)
        reverse = ctx.prepared.reverse_index() if ctx.prepared is not None and union is None else None
        dq, dk, dv = attn._gradients(do, q, k, v, o, lse, block_idx, ctx.scale, reverse, ctx.needs_input_grad[:3],
                                     ctx.shapes, union, dlse)
        return dq, dk, dv, None, None, None, None, None, None, None


def with_lse_gradient(delta: torch.Tensor, dlse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The backward's delta where the loss reads lse too: d lse_i / d s_ij = P_ij, so dS_ij = P_ij (dP_ij -
    delta_i + dlse_i), which the kernels compute as they are, given delta_i - dlse_i. A row without a visible key
    (lse = -inf) has a constant lse: its dlse is dropped (it could be NaN, as logsumexp's over -inf is)."""
    return (delta - dlse.masked_fill(lse == float("-inf"), 0.0)).contiguous()


def _padding_lists_emptied(lists: torch.Tensor, seqlens: torch.Tensor, list_queries: int) -> torch.Tensor:
    """A padded batch's lists (a list per `list_queries` queries: a Q tile's, or a query's) with every list past
    its row's tokens empty (-1): the padding's queries attend to nothing, so they cost neither the forward nor
    the backward anything."""
    past = torch.arange(lists.shape[2], device=lists.device)[None, :] * list_queries >= seqlens[:, None]  # [B, lists]
    return lists.masked_fill(past[:, None, :, None], -1)


def clear_padding(o: torch.Tensor, lse: torch.Tensor, seqlens: torch.Tensor):
    """A padded batch's (o, lse) with every position past its row's tokens at o = 0, lse = -inf (no gradient
    flows to those: their rows of o took none of the loss)."""
    real = torch.arange(o.shape[2], device=o.device) < seqlens[:, None]  # [B, N]; a length past N is all of it
    return torch.where(real[:, None, :, None], o, 0.0), torch.where(real[:, None, :], lse, float("-inf"))


# get_kernel's callables, by (spec, validate_lists): a plain dict, which dynamo reads inside a compiled region (it
# would trace through an lru_cache and build the callable again), oldest dropped past KERNELS_KEPT
_kernels: dict[tuple[Spec, bool], SparseAttention] = {}
_kernels_lock = threading.Lock()
KERNELS_KEPT = 256


def get_kernel(spec: Spec, *, configs: dict | None = None, validate_lists: bool = False) -> SparseAttention:
    """The callable for `spec` (cached per spec). `configs` ({role: config}, e.g. {"attn": AttnConfig(...),
    "select": SelectConfig(...)}; the config type says the backend) pins tunables instead of the tuning DB's
    winners or the defaults; a role no call of `spec` runs (`roles.pinnable_roles`) is refused. Inside
    torch.compile a spec's cached callable is read as the graph's constant; one not built yet is built outside the
    graph (a graph break, refused by fullgraph=True: call get_kernel(spec) once before compiling)."""
    if not isinstance(spec, Spec):
        raise KernelgenTypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if configs:
        return _built(spec, configs, validate_lists)
    attn = _kernels.get((spec, validate_lists))
    return attn if attn is not None else _built(spec, None, validate_lists)


@torch.compiler.disable(reason="kernelgen: get_kernel(spec) builds a spec's callable outside the graph, once per "
                               "spec: call get_kernel(spec) before compiling (where the model is built), and inside "
                               "the compiled region it is read from get_kernel's cache")
def _built(spec: Spec, configs: dict | None, validate_lists: bool) -> SparseAttention:
    attn = SparseAttention(spec, configs, validate_lists)
    if configs:
        return attn
    with _kernels_lock:  # threads building at once: each key kept once, the oldest dropped once
        attn = _kernels.setdefault((spec, validate_lists), attn)
        while len(_kernels) > KERNELS_KEPT:
            del _kernels[next(iter(_kernels))]
    return attn

"""get_kernel(spec): the public entry. Picks configs, renders and loads kernels once, launches them."""
from __future__ import annotations

import functools
import logging
import operator

import torch

from . import ops
from .compile import load_module
from .config import attn_backend_of, check_config, default_config, seq_bucket
from .render import module_name, render
from .spec import Spec
from .tuned import fastest_backend, tuned_config

__all__ = ["get_kernel", "SparseAttention"]

log = logging.getLogger("kernelgen")


class SparseAttention:
    """Callable returned by `get_kernel(spec)`.

    attn(q, k, v)                         select blocks with the spec's selector, then attend
    attn(q, k, v, block_idx=idx)          attend over caller-given lists (int32 [B, Hkv, n_q_tiles, top_k], -1 empty)
    lists = attn.prepare(idx, seq_q, seq_k)   the same lists checked and normalised once (ops.BlockLists);
    attn(q, k, v, block_idx=lists)        calls with them skip that step (one launch fewer per call)
    attn(q, k, v, return_lse=True)        also return lse (float32 [B, Hq, Nq])
    attn.select(q, k)                     the lists the selector would use

    q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D]; Hq = spec.gqa_group * Hkv; fp16/bf16 (fp32 in the interpreter).
    `validate_lists=True` makes repeated ids in given lists an error (costs a device sync per call).
    """

    def __init__(self, spec: Spec, configs: dict | None = None, validate_lists: bool = False):
        if not isinstance(spec, Spec):
            raise TypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
        self.spec = spec
        self.validate_lists = validate_lists
        self._fixed = dict(configs or {})
        for role, cfg in self._fixed.items():
            check_config(spec, role, cfg)

    def config(self, role: str, n_q: int, n_k: int, dtype=torch.bfloat16, device="cuda"):
        """The config a call of these lengths runs with: pinned, else the tuning DB's winner for this
        device, dtype and length bucket, else the default. With backend="auto", the attention config
        is that of the backend served (a TileLangAttnConfig means TileLang, a GluonAttnConfig Gluon)."""
        return self._config(role, seq_bucket(n_k), dtype, torch.device(device))

    def backend(self, n_k: int, dtype=torch.bfloat16, device="cuda") -> str:
        """The backend that runs the attention of a call with n_k keys: "triton", "tilelang" or "gluon"."""
        return self._backend(seq_bucket(n_k), dtype, torch.device(device))

    @functools.lru_cache(maxsize=256)
    def _backend(self, bucket: int, dtype, device) -> str:
        if self.spec.backend != "auto":
            return self.spec.backend
        if "attn" in self._fixed:  # a pinned config says which backend it is for
            return attn_backend_of(self._fixed["attn"])
        return fastest_backend(self.spec, bucket, dtype, device)

    def _role_spec(self, role: str, backend: str) -> Spec:
        return self.spec.replace(backend=backend).for_role(role)

    @functools.lru_cache(maxsize=256)
    def _config(self, role: str, bucket: int, dtype, device):
        # cached per length bucket: the DB is read once per (role, bucket, dtype, device)
        if role in self._fixed:
            return self._fixed[role]
        spec = self._role_spec(role, self._backend(bucket, dtype, device))
        return tuned_config(spec, role, bucket, dtype, device) or default_config(spec, role)

    @functools.lru_cache(maxsize=64)
    def module(self, role: str, config):
        """The rendered module of a role: the Triton selector, or the Triton or Gluon attention (the
        config's type says which; TileLang kernels are built per shape by `_tilelang_kernel`)."""
        backend = attn_backend_of(config) if role == "attn" else "triton"
        if backend == "tilelang":
            raise ValueError("TileLang kernels are compiled per problem shape, not loaded as a module")
        spec = self._role_spec(role, backend)
        source = render(spec, role, config)
        return load_module(module_name(spec, role, source), source)

    @functools.lru_cache(maxsize=64)
    def _tilelang_kernel(self, shapes, dtype, config, device):
        """TileLang kernels are compiled for one problem shape (cached here and on disk by TileLang)."""
        if device.type != "cuda":
            raise ValueError("backend='tilelang' runs on CUDA GPUs only (lowering and compiling work without one: "
                             "kernelgen.tilelang_backend.lower / compile_kernel)")
        from . import tilelang_backend

        func = tilelang_backend.build_attn(self.spec, dtype, batch=shapes.batch, heads_kv=shapes.heads_kv,
                                           seq_q=shapes.n_q, seq_k=shapes.n_k, config=config)
        return tilelang_backend.compile_attn(func, config, arch=tilelang_backend.target_arch(device))

    def _select_module(self, q: torch.Tensor, n_q: int, n_k: int):
        cfg = self._config("select", seq_bucket(n_k), q.dtype, q.device)
        return self.module("select", cfg), cfg

    def select(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if not self.spec.selects:
            raise ValueError("spec.selector='given' has no selector: pass block_idx to the call")
        shapes = ops.check_qkv(q, k, k, self.spec)
        mod, cfg = self._select_module(q, shapes.n_q, shapes.n_k)
        return ops.select(q, k, self.spec, shapes, mod, cfg)

    def prepare(self, block_idx: torch.Tensor, seq_q: int, seq_k: int) -> ops.BlockLists:
        """Given lists checked and normalised once, for calls with seq_q queries and seq_k keys (any
        batch, heads and dtype that match block_idx's shape): pass the result as block_idx. Repeated
        ids count once (an error with validate_lists=True), as in a call given the raw lists."""
        lengths = []
        for name, n in (("seq_q", seq_q), ("seq_k", seq_k)):
            try:  # any integer type (numpy, a 0-d integer tensor), as range() takes; bool and float are not
                length = None if isinstance(n, bool) else operator.index(n)
            except TypeError:
                length = None
            if length is None:
                raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
            if length < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
            lengths.append(length)
        seq_q, seq_k = lengths
        if not isinstance(block_idx, torch.Tensor):
            raise TypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
        if block_idx.device.type != "cuda" and not ops.interpreting():
            raise ValueError(f"block_idx is on {block_idx.device}; expected the CUDA device the calls will use")
        if block_idx.dim() != 4:
            raise ValueError(f"block_idx must be 4-D [B, Hkv, n_q_tiles, top_k], got shape {tuple(block_idx.shape)}")
        b, hkv = block_idx.shape[:2]
        spec = self.spec
        shapes = ops.Shapes(b, hkv * spec.gqa_group, hkv, seq_q, seq_k, spec.n_q_tiles(seq_q), spec.n_kv_blocks(seq_k))
        # the normaliser lives in the selector's module, whose config (any dtype's) does not change it
        select_mod = self.module("select", self._config("select", seq_bucket(seq_k), torch.bfloat16, block_idx.device))
        normalised = ops.prepare_block_idx(block_idx, spec, shapes, block_idx.device, select_mod, self.validate_lists)
        return ops.BlockLists._made_by_prepare(normalised, spec.kv_block, spec.top_k, shapes.n_kv_blocks)

    @functools.lru_cache(maxsize=256)
    def _kernels(self, bucket: int, dtype, device):
        """(select module, select config, attention backend, attention config, attention module or None
        for TileLang) of one length bucket: a call makes this one cached lookup."""
        select_cfg = self._config("select", bucket, dtype, device)
        attn_cfg = self._config("attn", bucket, dtype, device)
        backend = self._backend(bucket, dtype, device)
        if backend == "gluon":
            ops.check_gluon_device(device)  # here, once per device: never a silent fallback
        attn_mod = None if backend == "tilelang" else self.module("attn", attn_cfg)
        return self.module("select", select_cfg), select_cfg, backend, attn_cfg, attn_mod

    def __call__(self, q, k, v, *, block_idx=None, scale=None, return_lse: bool = False):
        spec = self.spec
        shapes = ops.check_qkv(q, k, v, spec)
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            raise NotImplementedError("kernelgen has no backward pass yet: call it under torch.no_grad() "
                                      "or with inputs that do not require grad")
        select_mod, select_cfg, backend, attn_cfg, attn_mod = self._kernels(seq_bucket(shapes.n_k), q.dtype, q.device)
        if block_idx is None:
            if not spec.selects:
                raise ValueError("spec.selector='given' needs block_idx=int32 [B, Hkv, n_q_tiles, top_k]")
            block_idx = ops.select(q, k, spec, shapes, select_mod, select_cfg)
        elif isinstance(block_idx, ops.BlockLists):
            block_idx = ops.check_block_lists(block_idx, spec, shapes, q.device)
        else:
            block_idx = ops.prepare_block_idx(block_idx, spec, shapes, q.device, select_mod, self.validate_lists)
        if backend == "triton":
            o, lse = ops.attention(q, k, v, block_idx, spec, shapes, attn_mod, attn_cfg, scale)
        elif backend == "gluon":
            o, lse = ops.attention_gluon(q, k, v, block_idx, spec, shapes, attn_mod, attn_cfg, scale)
        else:
            kernel = self._tilelang_kernel(shapes, q.dtype, attn_cfg, q.device)
            o, lse = ops.attention_tilelang(q, k, v, block_idx, spec, kernel, scale)
        return (o, lse) if return_lse else o

    def __repr__(self) -> str:
        return f"SparseAttention({self.spec})"


@functools.lru_cache(maxsize=256)
def _cached(spec: Spec, validate_lists: bool) -> SparseAttention:
    return SparseAttention(spec, validate_lists=validate_lists)


def get_kernel(spec: Spec, *, configs: dict | None = None, validate_lists: bool = False) -> SparseAttention:
    """The callable for `spec` (cached per spec). `configs` ({"attn": AttnConfig (TileLangAttnConfig,
    GluonAttnConfig for those backends), "select": SelectConfig}) pins tunables instead of the tuning DB's
    winners or the defaults."""
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a kernelgen.Spec, got {type(spec).__name__}")
    if configs:
        return SparseAttention(spec, configs, validate_lists)
    return _cached(spec, validate_lists)

"""Tunables: one frozen config per kernel role, their defaults, and their search spaces.

A config changes how a kernel runs, never what it computes: every point of a space gives the same
result (up to rounding) as the defaults. Infeasible points are pruned here, before any compile.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass

from .spec import GLUON_BLOCK_MS, Spec, gluon_unsupported

__all__ = ["seq_bucket", "AttnConfig", "SelectConfig", "TileLangAttnConfig", "GluonAttnConfig", "ROLES",
           "default_config", "config_space", "config_from_dict", "check_config", "feasible", "infeasible",
           "attn_backend_of", "next_pow2"]

ROLES = ("attn", "select")


MIN_BUCKET = 1024  # shorter sequences share the 1024 bucket


def seq_bucket(n: int) -> int:
    """The tuning bucket of sequence length `n` (tunables are chosen per bucket): the smallest power
    of two >= n, at least 1024.

    >>> seq_bucket(1), seq_bucket(1024), seq_bucket(1025), seq_bucket(5000)
    (1024, 1024, 2048, 8192)
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"seq_bucket expects a sequence length >= 0, got {n}")
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(frozen=True)
class AttnConfig:
    """Q-centric forward. block_m: packed rows (G heads x Q_TILE queries) per program; use_tma: load
    K/V blocks through tensor descriptors (TMA on Hopper) instead of pointers; kv_per_iter: listed
    blocks per loop step (2: two 64-key blocks make one 128-key MMA). (Triton 3.6's automatic warp
    specialisation of the loop is no tunable: on the H200 its Hopper pass asserts on this kernel.)"""

    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False
    kv_per_iter: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class SelectConfig:
    """Scoring and top-k. tiles: Q tiles per program (they share each k_rep chunk load);
    chunk: KV blocks scored per step; splits: programs that share one group of tiles, each scanning
    a part of the blocks (their partial top-k are merged by a second kernel)."""

    tiles: int = 16
    chunk: int = 64
    num_warps: int = 4
    num_stages: int = 1
    splits: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class TileLangAttnConfig:
    """TileLang Q-centric forward. block_m: packed rows per program; threads: 128 (one consumer
    warpgroup) or 256 (two); TileLang adds a producer warpgroup for the TMA loads. overlap: issue
    the QK gemm of the next KV sub-block and the PV gemm of the last one together and run the
    softmax while PV runs (FlashAttention-3's intra-warpgroup pipelining; Hopper wgmma only). pingpong
    (with overlap and 256 threads): the two consumer warpgroups take turns issuing their gemms
    (FlashAttention-3's inter-warpgroup schedule)."""

    block_m: int = 128
    num_stages: int = 2
    threads: int = 256
    overlap: bool = False
    pingpong: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class GluonAttnConfig:
    """Gluon Q-centric forward (Hopper). block_m: packed rows per program, 16 per warp (the kernel runs
    block_m // 16 warps); num_stages: listed blocks whose K and V are in flight (the depth of the TMA ring)."""

    block_m: int = 128
    num_stages: int = 3

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_CONFIG_TYPES = {
    ("triton", "attn"): AttnConfig,
    ("triton", "select"): SelectConfig,
    ("tilelang", "attn"): TileLangAttnConfig,
    ("tilelang", "select"): SelectConfig,  # TileLang specs select with the Triton selector
    ("gluon", "attn"): GluonAttnConfig,
    ("gluon", "select"): SelectConfig,  # so do Gluon specs
}
ATTN_BACKENDS = ("triton", "tilelang", "gluon")  # what backend="auto" chooses from


def attn_backend_of(cfg) -> str:
    """The backend an attention config is for: its type says (a pinned config picks the backend)."""
    for backend in ATTN_BACKENDS:
        if type(cfg) is _CONFIG_TYPES[backend, "attn"]:
            return backend
    raise TypeError(f"{type(cfg).__name__} is no attention config; expected one of "
                    f"{', '.join(_CONFIG_TYPES[b, 'attn'].__name__ for b in ATTN_BACKENDS)}")


def config_from_dict(role: str, data: dict, backend: str = "triton"):
    if (backend, role) not in _CONFIG_TYPES:
        raise ValueError(f"role={role!r} is unknown for backend={backend!r}; expected one of {ROLES}")
    return _CONFIG_TYPES[backend, role](**data)


# Shared memory a Triton program may use on sm_90 (H100/H200): 227 KB.
SMEM_LIMIT_SM90 = 232448


def attn_smem_bytes(spec: Spec, cfg: AttnConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the forward: num_stages buffers of one K and one V block, plus the Q tile.
    (Matches what Triton 3.6 asked for on the H200: 278528 B for D=128, 128-blocks, block_m=64, 4 stages.)"""
    return (cfg.num_stages * 2 * spec.kv_block * cfg.kv_per_iter + cfg.block_m) * spec.head_dim * elem_bytes


def attn_infeasible(spec: Spec, cfg: AttnConfig, smem_limit: int = SMEM_LIMIT_SM90) -> str | None:
    """Why the Triton forward cannot run `cfg` for `spec`, or None. block_m must cover whole heads of one
    tile (block_m > q_tile) or split a tile evenly; the pipeline's buffers must fit in shared memory."""
    if cfg.block_m < 16 or not spec.packs_rows(cfg.block_m):
        return (f"block_m={cfg.block_m} must be >= 16 and either split a Q tile evenly (q_tile={spec.q_tile}) or "
                f"hold whole tiles of a number of heads that divides gqa_group={spec.gqa_group}")
    if cfg.kv_per_iter not in (1, 2):
        return f"kv_per_iter={cfg.kv_per_iter}; expected 1 or 2"
    block_n = spec.kv_block * cfg.kv_per_iter  # one step is at most 128 keys
    if block_n > 128:
        return f"kv_block * kv_per_iter = {block_n} keys per step; at most 128"
    if cfg.use_tma and cfg.kv_per_iter > 1:
        return "use_tma loads one block per step: kv_per_iter must be 1"
    # registers: the fp32 accumulator and scores of one program (Triton spills badly past this)
    regs = cfg.block_m * (spec.head_dim + block_n) // (32 * cfg.num_warps)
    if regs > 192:
        return (f"block_m * (head_dim + keys per step) / (32 * num_warps) = {regs} fp32 registers per thread for "
                "the scores and the accumulator; at most 192 (Triton spills past it): more warps or fewer rows")
    smem = attn_smem_bytes(spec, cfg)
    if smem > smem_limit:
        return f"{smem} B of shared memory (num_stages K and V blocks and the Q tile); at most {smem_limit}"
    return None


def attn_feasible(spec: Spec, cfg: AttnConfig, smem_limit: int = SMEM_LIMIT_SM90) -> bool:
    return attn_infeasible(spec, cfg, smem_limit) is None


def tilelang_attn_infeasible(spec: Spec, cfg: TileLangAttnConfig) -> str | None:
    """Why the TileLang forward cannot run `cfg` for `spec`, or None. The row packing rule of Triton's;
    256 threads need 128 rows (two 64-row warpgroups). Three stages at head_dim 64 are left out: on the
    H200 that kernel never finished (a32k tune, 2026-11-30). 128 threads: one stage, as that forward is
    built without warp specialisation (tilelang_backend.attn_pass_configs) and TileLang 0.1.15 generates
    no code for it with more."""
    if cfg.block_m not in (64, 128) or cfg.threads not in (128, 256):
        return f"block_m={cfg.block_m}, threads={cfg.threads}; expected block_m 64 or 128 and threads 128 or 256"
    packing = attn_infeasible(spec, AttnConfig(block_m=cfg.block_m, num_warps=cfg.threads // 32, num_stages=1))
    if packing:
        return packing
    if cfg.threads == 256 and cfg.block_m != 128:
        return "threads=256 (two consumer warpgroups of 64 rows) needs block_m=128"
    if cfg.num_stages not in (1, 2, 3):
        return f"num_stages={cfg.num_stages}; expected 1, 2 or 3"
    if cfg.threads == 128 and cfg.num_stages != 1:
        return ("threads=128 allows num_stages=1 only: that forward is built without warp specialisation (it hung "
                "with it on the H200), and TileLang 0.1.15 generates no code for that pipeline with more stages")
    if not isinstance(cfg.overlap, bool) or not isinstance(cfg.pingpong, bool):
        return f"overlap={cfg.overlap!r}, pingpong={cfg.pingpong!r}; expected bools"
    if cfg.pingpong and not (cfg.overlap and cfg.threads == 256):
        return "pingpong=True needs overlap=True and threads=256 (two consumer warpgroups taking turns)"
    if spec.head_dim == 64 and cfg.num_stages == 3:
        return "num_stages=3 at head_dim=64 is left out: on the H200 that kernel never finished"
    return None


def tilelang_attn_feasible(spec: Spec, cfg: TileLangAttnConfig) -> bool:
    return tilelang_attn_infeasible(spec, cfg) is None


# Shared memory left beside the Gluon forward's K/V rings for its mbarriers (8 B per ring slot, aligned)
GLUON_BARRIER_BYTES = 1024


def gluon_attn_smem_bytes(spec: Spec, cfg: GluonAttnConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the Gluon forward: its ring of num_stages K and V blocks (Q lives in
    registers). Triton 3.6 asked for this plus 32 B of barriers in offline sm_90 compiles."""
    return 2 * cfg.num_stages * spec.kv_block * spec.head_dim * elem_bytes


def gluon_attn_infeasible(spec: Spec, cfg: GluonAttnConfig) -> str | None:
    """Why the Gluon forward cannot run `cfg` for `spec`, or None: a spec the kernel computes
    (`kernelgen.spec.gluon_unsupported`), the row packing rule of Triton's forward with 64 or 128 rows
    (16 per warp, whole warpgroups), 2 to 4 stages, and rings that fit in shared memory."""
    unsupported = gluon_unsupported(spec)
    if unsupported:
        return unsupported
    if cfg.block_m not in GLUON_BLOCK_MS or not spec.packs_rows(cfg.block_m):
        return (f"block_m={cfg.block_m}; expected one of {GLUON_BLOCK_MS} that splits a Q tile evenly "
                f"(q_tile={spec.q_tile}) or holds whole tiles of a number of heads dividing gqa_group={spec.gqa_group}")
    if cfg.num_stages not in (2, 3, 4):
        return f"num_stages={cfg.num_stages}; expected 2, 3 or 4"
    smem, limit = gluon_attn_smem_bytes(spec, cfg), SMEM_LIMIT_SM90 - GLUON_BARRIER_BYTES
    if smem > limit:
        return f"a ring of {cfg.num_stages} K and V blocks is {smem} B of shared memory; at most {limit}"
    return None


def gluon_attn_feasible(spec: Spec, cfg: GluonAttnConfig) -> bool:
    return gluon_attn_infeasible(spec, cfg) is None


_ATTN_INFEASIBLE = {"triton": attn_infeasible, "tilelang": tilelang_attn_infeasible, "gluon": gluon_attn_infeasible}


def infeasible(spec: Spec, role: str, cfg) -> str | None:
    """Why `cfg` is no config of `role` that some backend of `spec` runs within its kernel's range, or None."""
    if role == "select":
        return select_infeasible(spec, cfg) if type(cfg) is SelectConfig else f"{type(cfg).__name__} is no SelectConfig"
    backend = {t: b for (b, r), t in _CONFIG_TYPES.items() if r == role}.get(type(cfg))
    if backend is None:
        return f"{type(cfg).__name__} is no config of role {role!r}"
    return _ATTN_INFEASIBLE[backend](spec, cfg)


def feasible(spec: Spec, role: str, cfg) -> bool:
    """A config of a known role and of a type some backend of `spec` runs, within that kernel's range."""
    return infeasible(spec, role, cfg) is None


def check_config(spec: Spec, role: str, cfg) -> None:
    """A config pinned by a caller: the type its backend runs (with backend="auto", any attention type:
    it says which backend), and a feasible point (an infeasible one could leave rows unwritten).
    Raises TypeError/ValueError naming the role."""
    backends = ATTN_BACKENDS if spec.backend == "auto" else (spec.backend,)
    if role not in ROLES:
        raise ValueError(f"configs has unknown role {role!r}; expected a subset of {ROLES}")
    types = {_CONFIG_TYPES[b, role]: b for b in backends}
    if type(cfg) not in types:
        raise TypeError(f"configs[{role!r}] must be a {' or '.join(t.__name__ for t in types)} for "
                        f"backend={spec.backend!r}, got {type(cfg).__name__}")
    reason = infeasible(spec, role, cfg)
    if reason:
        raise ValueError(f"configs[{role!r}] = {cfg} is not feasible for {spec}: {reason} "
                         "(kernelgen.config.config_space lists the feasible points)")


def select_infeasible(spec: Spec, cfg: SelectConfig) -> str | None:
    """Why the selector cannot run `cfg` for `spec`, or None."""
    gr_pad = next_pow2(spec.gqa_group * spec.groups)
    rows = cfg.tiles * gr_pad
    cols = cfg.chunk * spec.groups
    # tl.dot needs >= 16 rows and columns; keep the score tile within registers
    if rows < 16 or cols < 16 or rows * cols > 64 * 256 or rows > 256:
        return (f"a score tile of tiles * next_pow2(gqa_group * groups) = {rows} rows and chunk * groups = {cols} "
                "columns; expected 16 to 256 rows, at least 16 columns and at most 16384 scores")
    # tl.topk of a chunk needs at least next_pow2(top_k) columns
    if cfg.chunk < next_pow2(spec.top_k):
        return f"chunk={cfg.chunk} blocks is fewer than next_pow2(top_k) = {next_pow2(spec.top_k)}"
    if cfg.splits not in (1, 2, 4, 8):
        return f"splits={cfg.splits}; expected 1, 2, 4 or 8"
    return None


def select_feasible(spec: Spec, cfg: SelectConfig) -> bool:
    return select_infeasible(spec, cfg) is None


def default_config(spec: Spec, role: str):
    """A sound starting point per head_dim (the tuner improves on it)."""
    if role == "attn" and spec.backend == "gluon":
        # the most rows a program can hold, up to 128; 3 stages, as the ring refills a slot one step after
        # its block was used (a32k, H200: 0.181 ms against 0.186 with 2 stages)
        for block_m, stages in itertools.product(GLUON_BLOCK_MS[::-1], (3, 2)):
            cfg = GluonAttnConfig(block_m=block_m, num_stages=stages)
            if gluon_attn_feasible(spec, cfg):
                return cfg
        raise ValueError(gluon_unsupported(spec) or f"no feasible Gluon attention config for {spec}")
    if role == "attn" and spec.backend == "tilelang":
        # overlap at D=128: 540 vs 514 TFLOP/s on c_dense, 0.282 vs 0.298 ms on (b); at D=64 it was
        # +3% non-causal, -3% causal (H200, 2026-11-30): off, the tuner decides
        for block_m, threads, stages in ((128, 256, 2), (64, 128, 1)):
            cfg = TileLangAttnConfig(block_m=block_m, num_stages=stages, threads=threads, overlap=spec.head_dim >= 128)
            if tilelang_attn_feasible(spec, cfg):
                return cfg
        raise ValueError(f"no feasible TileLang attention config for {spec}")
    if role == "attn":
        warps = {64: 4, 128: 8, 256: 8}[spec.head_dim]
        stages = {64: 2, 128: 2, 256: 1}[spec.head_dim]  # H200 sweep, shape (a): 2 stages beat 3
        for block_m in (128, 64, 32, 16):
            cfg = AttnConfig(block_m=block_m, num_warps=warps, num_stages=stages)
            if attn_feasible(spec, cfg):
                return cfg
        raise ValueError(f"no attention config fits {spec}: one K and one V block of kv_block x head_dim = "
                         f"{spec.kv_block} x {spec.head_dim} plus a Q tile exceed the {SMEM_LIMIT_SM90} B of shared "
                         "memory of sm_90; use a smaller kv_block")
    if role == "select":
        gr_pad = next_pow2(spec.gqa_group * spec.groups)
        # 64 q_rep rows against >= 128 k_rep columns per step (H200 sweep, shape (a): 0.087 ms vs
        # 0.147 ms with 16 rows: each program reads k_rep once for more tiles)
        chunk = max(next_pow2(spec.top_k), 128 // spec.groups)
        # long lists: fewer tiles per program keep the running top-k lists in registers
        tiles = max(1, (64 if next_pow2(spec.top_k) <= 64 else 16) // gr_pad)
        cfg = SelectConfig(tiles=tiles, chunk=chunk, num_warps=4, num_stages=1)
        return cfg if select_feasible(spec, cfg) else dataclasses.replace(cfg, tiles=max(1, 16 // gr_pad))
    raise ValueError(f"role={role!r} is unknown; expected one of {ROLES}")


def config_space(spec: Spec, role: str) -> list:
    """Every feasible point of a role's search space (a comprehension plus a filter)."""
    if role == "attn" and spec.backend == "gluon":
        space = (GluonAttnConfig(block_m=m, num_stages=s) for m, s in itertools.product(GLUON_BLOCK_MS, (2, 3, 4)))
        return [c for c in space if gluon_attn_feasible(spec, c)]
    if role == "attn" and spec.backend == "tilelang":
        space = (
            TileLangAttnConfig(block_m=m, num_stages=s, threads=t, overlap=o, pingpong=p)
            for m, s, t, o, p in itertools.product((64, 128), (1, 2, 3), (128, 256), (False, True), (False, True))
        )
        return [c for c in space if tilelang_attn_feasible(spec, c)]
    if role == "attn":
        space = (
            AttnConfig(block_m=m, num_warps=w, num_stages=s, use_tma=t, kv_per_iter=n)
            for m, w, s, t, n in itertools.product((16, 32, 64, 128, 256), (4, 8), (1, 2, 3, 4), (False, True), (1, 2))
        )
        return [c for c in space if attn_feasible(spec, c)]
    if role == "select":
        space = (
            SelectConfig(tiles=t, chunk=c, num_warps=w, num_stages=1, splits=n)
            for t, c, w, n in itertools.product((1, 2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256), (4, 8), (1, 2, 4))
        )
        return [c for c in space if select_feasible(spec, c)]
    raise ValueError(f"role={role!r} is unknown; expected one of {ROLES}")

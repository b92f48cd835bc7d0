"""The Triton backend: every role, on any GPU Triton supports and on the CPU through its interpreter.

Its kernels are rendered once per (spec, role, config) from templates/triton/<role>.py.j2 and loaded
from the content-addressed cache; Triton compiles them per device on first launch.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..archs import arch_facts
from ..device import device_arch, on_default_stream
from ..errors import KernelgenValueError
from ..inputs import LOG2E, KVScales, cdiv, empty, next_pow2, softmax_scale
from ..reverse_index import QueryReverseIndex, ReverseIndex, build_query_reverse_index, max_tasks
from ..roles import DECODE_MAX_QUERIES, INDEX_HEADS
from ..spec import Spec
from ..tile_union import TileUnion, TileUnions, union_for, union_tile_q
from .base import Backend, Problem, RoleImpl, Shapes
from .triton_launch import TritonModule

__all__ = ["TritonBackend", "AttnConfig", "SelectConfig", "IndexSelectConfig", "BwdDqConfig", "BwdDkdvConfig",
           "KvSelectConfig", "KvIndexSelectConfig", "KvAttnConfig", "KvUnionConfig", "KvUnionBwdConfig", "KvBwdConfig", "DecodeConfig", "attn_smem_bytes",
           "bwd_dq_smem_bytes", "bwd_dkdv_smem_bytes", "kv_select_smem_bytes", "kv_attn_smem_bytes", "decode_smem_bytes",
           "index_select_smem_bytes", "kv_index_select_smem_bytes", "pack_infeasible", "rendered_module", "pool_reps",
           "select_from_reps", "combine_partials"]


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


class _JsonConfig:
    """A frozen dataclass of tunables that writes itself as sorted JSON (the tuning DB's and the render's form)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class BwdDqConfig(_JsonConfig):
    """dQ of the backward: block_m packed rows (G heads x Q_TILE queries) per program, as the forward's,
    walking the tile's list; use_tma: K and V blocks through tensor descriptors (sm_90), not pointers."""

    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False


@dataclass(frozen=True)
class BwdDkdvConfig(_JsonConfig):
    """dK and dV of the backward: block_n keys of one KV block per program (K, V and their gradients held
    in registers), walking the Q tiles that list the block block_m packed query rows at a time."""

    block_n: int = 64
    block_m: int = 32
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KvSelectConfig(_JsonConfig):
    """Per-query selection (KV-centric): queries scored per program (they share each k_rep chunk load),
    chunk: KV blocks scored per step, splits: programs sharing one query group's blocks (partial top-k each,
    then a merge; a decode call's)."""

    queries: int = 32
    chunk: int = 64
    num_warps: int = 4
    splits: int = 1


@dataclass(frozen=True)
class KvAttnConfig(_JsonConfig):
    """KV-centric forward. block_m: packed rows per step (queries per step = block_m // next_pow2(G)),
    steps: steps per task (a program loads its K and V block once for them), num_stages: Triton's software
    pipeline depth over the steps, partials_fp32: partial outputs in fp32 (else in the inputs' dtype: half the
    bytes written and read, the merge still in fp32), combine_rows: queries per program of the combine."""

    block_m: int = 64
    steps: int = 4
    num_warps: int = 4
    num_stages: int = 2
    partials_fp32: bool = False
    combine_rows: int = 32


@dataclass(frozen=True)
class KvUnionConfig(_JsonConfig):
    """The KV-centric schedule's union design: tile_q consecutive queries attend over the union of their
    lists (`kernelgen.tile_union`), each row masked to its own query's blocks; block_m: packed rows per
    program (the G heads x tile_q queries, head-major, split as the Q-centric forward splits a tile); use_tma:
    K and V blocks through tensor descriptors (sm_90), not pointers."""

    tile_q: int = 4
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False


@dataclass(frozen=True)
class KvUnionBwdConfig(_JsonConfig):
    """The union design's backward: dq_block_m packed rows per dQ program (the forward's walk of a tile's
    union; at most the tile's G * tile_q rows), and block_n keys of one KV block per dK/dV program, walking the
    tiles whose union holds the block block_m packed rows a step; dq_use_tma: the dQ loads K and V blocks
    through tensor descriptors (sm_90); use_tma: the dK/dV loads each step's Q and dO rows as one box of a
    tensor descriptor, not through per-row pointers. tile_q: the tiles of a call whose lists bring none
    (prepared lists bring their forward's)."""

    tile_q: int = 4
    dq_block_m: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    dq_use_tma: bool = False
    block_n: int = 64
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False


@dataclass(frozen=True)
class KvBwdConfig(_JsonConfig):
    """The KV-centric backward: block_n keys of one KV block per program (K, V and their gradients held in
    registers), walking the (query, slot) pairs that list the block block_m packed rows (block_m //
    next_pow2(G) queries) at a time and writing each row's dQ partial; dq_partials_fp32: those partials in
    fp32 (else in the inputs' dtype: half the bytes, the merge still in fp32); merge_rows: queries per
    program of the dQ merge."""

    block_n: int = 64
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2
    dq_partials_fp32: bool = False
    merge_rows: int = 32


@dataclass(frozen=True)
class DecodeConfig(_JsonConfig):
    """Decode (a few queries, `roles.DECODE_MAX_QUERIES` at most): one program per (batch, KV head, queries,
    split), the G heads of `decode_queries` queries that share a list packed in rows (max(16, next_pow2(G))),
    each split walking its share of their list; with splits > 1 the last split of a group to finish merges
    the splits' partials through their lse (no launch of its own)."""

    splits: int = 8
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class IndexSelectConfig(_JsonConfig):
    """The index selector's scoring and top-k, one Q tile per program. rows: packed (index head, query) rows
    per tl.dot (as many index heads as fit, the tile's queries in steps of the rest); chunk: KV blocks
    scored per step (chunk * kv_block keys); splits: programs sharing a tile's blocks, their best keys merged
    by a second launch (a decode call's one tile)."""

    rows: int = 64
    chunk: int = 1
    num_warps: int = 4
    num_stages: int = 1
    splits: int = 1


@dataclass(frozen=True)
class KvIndexSelectConfig(_JsonConfig):
    """The index selector for per-query lists (KV-centric), two kernels. Block scores: queries per program
    (they share each key load), heads: index heads per tl.dot (packed with the queries as its heads * queries
    rows; at most next_pow2(Hi) at launch), chunk: KV blocks scored per step (chunk * kv_block keys), span:
    KV blocks per program (programs over one query tile split its blocks), num_warps and num_stages. Top-k:
    rows: queries per program (their running lists in registers), width: blocks merged into them at once
    (at least next_pow2(top_k)). hold: a block-scores program reads its queries' index vectors once and keeps
    them in shared memory, instead of reading them with every step's keys; a call whose index vectors would
    not fit (`kv_index_select_smem_bytes` at its Hi and Di) runs without holding them (the same scores)."""

    queries: int = 64
    heads: int = 1
    chunk: int = 2
    span: int = 32
    rows: int = 16
    width: int = 32
    num_warps: int = 8
    num_stages: int = 1
    hold: bool = False


# ---- attention: feasibility, defaults, space -------------------------------------------------------

def _tile_d(spec: Spec) -> int:
    """The width of the kernels' head-dim tiles: D padded to a power of two (templates/triton/head_dim.py.j2)."""
    return next_pow2(spec.head_dim)


def pack_infeasible(spec: Spec, block_m: int) -> str | None:
    """Why programs of `block_m` packed rows cannot cover a spec's tiles, or None: block_m must split a Q
    tile evenly or hold whole tiles of a number of heads that divides gqa_group (every backend's rule)."""
    if block_m < 16 or not spec.packs_rows(block_m):
        return (f"block_m={block_m} must be >= 16 and either split a Q tile evenly (q_tile={spec.q_tile}) or "
                f"hold whole tiles of a number of heads that divides gqa_group={spec.gqa_group}")
    return None


STEP_KEYS = 128  # the Q-centric forward's keys per step: its score tile's columns


@functools.lru_cache(maxsize=None)  # on every launch and feasibility check of the forward
def _step_spec(spec: Spec) -> Spec:
    """The spec the Q-centric forward's kernels run for `spec`: a KV block wider than a step (256 keys) runs as its
    halves of STEP_KEYS keys, each listed id b as the ids 2b and 2b + 1 (`_stepped`): the same keys, the same
    attention."""
    if spec.kv_block <= STEP_KEYS:
        return spec
    return spec.replace(kv_block=STEP_KEYS, top_k=spec.top_k * (spec.kv_block // STEP_KEYS))


def _stepped(spec: Spec, shapes: Shapes, block_idx: torch.Tensor) -> tuple[Spec, Shapes, torch.Tensor]:
    """(spec, shapes, lists) of a Q-centric forward launch in STEP_KEYS-key blocks (`_step_spec`): normalised
    lists (ids ascending, then -1) split into their blocks' halves stay normalised, a half past the last key an
    empty slot (-1)."""
    if spec.kv_block <= STEP_KEYS:
        return spec, shapes, block_idx
    stepped = _step_spec(spec)
    ratio = spec.kv_block // STEP_KEYS
    n_blocks = cdiv(shapes.n_k, STEP_KEYS)
    ids = block_idx[..., None] * ratio + torch.arange(ratio, device=block_idx.device, dtype=block_idx.dtype)
    ids = torch.where((block_idx[..., None] < 0) | (ids >= n_blocks), -1, ids).flatten(-2).to(torch.int32)
    return stepped, shapes._replace(n_kv_blocks=n_blocks), ids


def attn_smem_bytes(spec: Spec, cfg: AttnConfig, arch: str, elem_bytes: int = 2) -> int:
    """Shared memory of the forward on `arch`: buffers of one K and one V block per step, plus the Q tile.
    With wgmma (sm_90) Triton 3.6 keeps num_stages of them (what it asked for on the H200: 278528 B for
    D=128, 128-blocks, block_m=64, 4 stages); with mma.sync (sm_80 to sm_89) its pipeline keeps
    num_stages - 1 (one at a single stage) and asks for at most half a step's keys of rows more
    (offline sm_80 and sm_89 compiles: tests/test_triton_compile.py); an unknown arch gets the larger."""
    block_n = spec.kv_block * cfg.kv_per_iter
    if arch_facts(arch).mma == "mma.sync" and cfg.num_stages > 1:
        rows = (cfg.num_stages - 1) * 2 * block_n + cfg.block_m + block_n // 2
    else:
        rows = cfg.num_stages * 2 * block_n + cfg.block_m
    return rows * _tile_d(spec) * elem_bytes


def attn_infeasible(spec: Spec, cfg: AttnConfig, arch: str) -> str | None:
    """Why the Triton forward cannot run `cfg` for `spec` on `arch`, or None: the row packing rule, at most
    128 keys per step, registers for the scores and accumulator, TMA only where the arch has it, and
    buffers that fit in the arch's shared memory."""
    spec = _step_spec(spec)
    packing = pack_infeasible(spec, cfg.block_m)
    if packing:
        return packing
    if cfg.kv_per_iter not in (1, 2):
        return f"kv_per_iter={cfg.kv_per_iter}; expected 1 or 2"
    block_n = spec.kv_block * cfg.kv_per_iter
    if block_n > STEP_KEYS:
        return f"kv_block * kv_per_iter = {block_n} keys per step; at most {STEP_KEYS}"
    if cfg.use_tma and cfg.kv_per_iter > 1:
        return "use_tma loads one block per step: kv_per_iter must be 1"
    facts = arch_facts(arch)
    if cfg.use_tma and not facts.tma:
        return f"use_tma=True needs TMA (sm_90), which {arch} lacks"
    # registers: the fp32 accumulator and scores of one program (Triton spills badly past this)
    regs = cfg.block_m * (_tile_d(spec) + block_n) // (32 * cfg.num_warps)
    if regs > 192:
        return (f"block_m * (head_dim + keys per step) / (32 * num_warps) = {regs} fp32 registers per thread for "
                "the scores and the accumulator; at most 192 (Triton spills past it): more warps or fewer rows")
    smem = attn_smem_bytes(spec, cfg, arch)
    if smem > facts.smem_per_block:
        return (f"{smem} B of shared memory (K and V buffers and the Q tile: attn_smem_bytes); at most "
                f"{facts.smem_per_block} on {arch}")
    return None


def attn_default(spec: Spec, arch: str) -> AttnConfig:
    warps = 4 if _tile_d(spec) <= 64 else 8
    stages = 1 if _tile_d(spec) >= 256 else 2  # H200 sweep, shape (a): 2 stages beat 3
    # fewer rows, then fewer stages, where the arch's shared memory holds no more: 64 rows at D=128 with
    # 128-key blocks on sm_86 and sm_89 (99 KB), and at D=256 with 64-key blocks there or 128-key ones on
    # sm_80; one stage on an arch the table lacks. sm_90 fits the H200 sweep's choice.
    for num_stages in range(stages, 0, -1):
        for block_m in (128, 64, 32, 16):
            cfg = AttnConfig(block_m=block_m, num_warps=warps, num_stages=num_stages)
            if attn_infeasible(spec, cfg, arch) is None:
                return cfg
    step = _step_spec(spec).kv_block
    raise KernelgenValueError(
        f"no attention config fits head_dim={spec.head_dim}, kv_block={spec.kv_block} on {arch}: one K and one V "
        f"block of {step} x {spec.head_dim} a step plus a Q tile exceed its {arch_facts(arch).smem_per_block} B of "
        "shared memory; use a smaller kv_block")


def attn_space(spec: Spec, arch: str):
    # every arch's candidates: attn_infeasible keeps those the arch runs
    return (AttnConfig(block_m=m, num_warps=w, num_stages=s, use_tma=t, kv_per_iter=n)
            for m, w, s, t, n in itertools.product((16, 32, 64, 128, 256), (4, 8), (1, 2, 3, 4), (False, True), (1, 2)))


def attn_rows_infeasible(spec: Spec, cfg: AttnConfig, arch: str) -> str | None:
    """The forward's rules, through pointers only (a descriptor's zero fill stops at the capacity, not at a
    row's last key)."""
    if cfg.use_tma:
        return "use_tma=True: attn_rows loads K and V through pointers (rows end before the cache does)"
    return attn_infeasible(spec, cfg, arch)


def attn_rows_default(spec: Spec, arch: str) -> AttnConfig:
    return dataclasses.replace(attn_default(spec, arch), use_tma=False)


def attn_rows_space(spec: Spec, arch: str):
    return (cfg for cfg in attn_space(spec, arch) if not cfg.use_tma)


# ---- selection: feasibility, defaults, space -------------------------------------------------------

def select_infeasible(spec: Spec, cfg: SelectConfig, arch: str, splits=(1, 2, 4, 8)) -> str | None:
    """Why the selector cannot run `cfg` for `spec`, or None (on every arch alike); `splits`: the split counts
    the role takes."""
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
    if cfg.splits not in splits:
        return f"splits={cfg.splits}; expected one of {splits}"
    return None


def select_default(spec: Spec, arch: str) -> SelectConfig:
    gr_pad = next_pow2(spec.gqa_group * spec.groups)
    # 64 q_rep rows against >= 128 k_rep columns per step (H200 sweep, shape (a): 0.087 ms vs
    # 0.147 ms with 16 rows: each program reads k_rep once for more tiles)
    chunk = max(next_pow2(spec.top_k), 128 // spec.groups)
    # long lists: fewer tiles per program keep the running top-k lists in registers
    tiles = max(1, (64 if next_pow2(spec.top_k) <= 64 else 16) // gr_pad)
    cfg = SelectConfig(tiles=tiles, chunk=chunk, num_warps=4, num_stages=1)
    return cfg if select_infeasible(spec, cfg, arch) is None else dataclasses.replace(cfg, tiles=max(1, 16 // gr_pad))


def _chunks(spec: Spec, sizes: tuple[int, ...]) -> list[int]:
    """A selector space's chunk sizes (blocks a step), each at least next_pow2(top_k), which a chunk's top-k needs:
    a long list's space keeps its points, not none."""
    return sorted({max(c, next_pow2(spec.top_k)) for c in sizes})


def select_space(spec: Spec, arch: str):
    return (SelectConfig(tiles=t, chunk=c, num_warps=w, num_stages=1, splits=n)
            for t, c, w, n in itertools.product((1, 2, 4, 8, 16, 32, 64), _chunks(spec, (16, 32, 64, 128, 256)),
                                                (4, 8), (1, 2, 4)))


# ---- the selector of a decode call: feasibility, defaults, space ------------------------------------
# A call of a few queries has one Q tile: select's grid (tile groups x B*Hkv x splits) is B*Hkv programs for
# each split, each scanning its share of every block. So decode_select takes the least rows and more splits.

DECODE_SELECT_SPLITS = (1, 2, 4, 8, 16, 32)


MERGE_CANDIDATES = 2048  # the most keys merge_topk takes per tile (splits x next_pow2(top_k)), as select's 8 x 256


def _merge_infeasible(spec: Spec, splits: int) -> str | None:
    """Why merge_topk cannot take `splits` partial top-k of a list, or None."""
    if splits * next_pow2(spec.top_k) > MERGE_CANDIDATES:
        return (f"splits={splits} x next_pow2(top_k) = {splits * next_pow2(spec.top_k)} candidate keys to merge "
                f"per list; expected at most {MERGE_CANDIDATES}")
    return None


def decode_select_infeasible(spec: Spec, cfg: SelectConfig, arch: str) -> str | None:
    return _merge_infeasible(spec, cfg.splits) or select_infeasible(spec, cfg, arch, DECODE_SELECT_SPLITS)


def decode_select_default(spec: Spec, arch: str) -> SelectConfig:
    # one tile: the fewest rows tl.dot takes; 64-block chunks, 8 splits (H200, bench --decode dec_c32k: a share
    # of 32 blocks for each of 512 programs)
    tiles = max(1, 16 // next_pow2(spec.gqa_group * spec.groups))
    chunk = max(next_pow2(spec.top_k), 64 // spec.groups, 16)
    splits = max(1, min(8, MERGE_CANDIDATES // next_pow2(spec.top_k)))
    return SelectConfig(tiles=tiles, chunk=chunk, num_warps=4, num_stages=1, splits=splits)


def decode_select_space(spec: Spec, arch: str):
    gr_pad = next_pow2(spec.gqa_group * spec.groups)
    return (SelectConfig(tiles=t, chunk=c, num_warps=w, num_stages=1, splits=n)
            for t, c, w, n in itertools.product(sorted({max(1, 16 // gr_pad), max(1, 32 // gr_pad)}),
                                                _chunks(spec, (16, 32, 64, 128)), (2, 4), DECODE_SELECT_SPLITS))


# ---- KV-centric forward: feasibility, defaults, spaces ---------------------------------------------

TILE_ROWS = (16, 32, 64, 128, 256)  # rows of a program's tl.dot tiles: powers of two

def kv_select_smem_bytes(spec: Spec, cfg: KvSelectConfig, arch: str) -> int:
    """Shared memory of the per-query selector: the fp32 operands of its score product (the queries' means and
    a chunk's representatives, the latter twice) and the int64 keys of the top-k merges. What Triton 3.6 asked
    for on sm_80, exactly, over queries 16-128, chunk 16-128, groups 1 and 4, head_dim 64 and 128, top_k 16
    and 64 (offline compiles); with wgmma (sm_90) and 8 warps, 16-bit scores of a step more (queries=64,
    chunk=128: 245760 B). tests/test_triton_compile.py checks it bounds sm_80 to sm_90's."""
    keys = max(cfg.chunk, 2 * next_pow2(spec.top_k))  # a chunk's keys, or the running lists joined with its top
    smem = cfg.queries * (4 * _tile_d(spec) + 8 * keys) + 8 * cfg.chunk * spec.groups * _tile_d(spec)
    if arch_facts(arch).mma != "mma.sync" and cfg.num_warps > 4:
        smem += 2 * cfg.queries * cfg.chunk * spec.groups
    return smem


def kv_select_infeasible(spec: Spec, cfg: KvSelectConfig, arch: str) -> str | None:
    """Why the per-query selector cannot run `cfg` for `spec` on `arch`, or None: tl.dot's and the registers'
    tile bounds, and the shared memory of the arch (kv_select_smem_bytes). Splits are a decode call's
    (`kv_decode_select_infeasible`)."""
    if cfg.splits != 1:
        return f"splits={cfg.splits}: a prefill's selection scans each query group's blocks in one program"
    cols = cfg.chunk * spec.groups
    # tl.dot needs >= 16 rows and columns; keep the score tile and the running lists within registers
    if cfg.queries < 16 or cfg.queries > 256 or cols < 16 or cfg.queries * cols > 64 * 256:
        return (f"a score tile of queries = {cfg.queries} rows and chunk * groups = {cols} columns; expected 16 to "
                "256 rows, at least 16 columns and at most 16384 scores")
    if cfg.chunk < next_pow2(spec.top_k):
        return f"chunk={cfg.chunk} blocks is fewer than next_pow2(top_k) = {next_pow2(spec.top_k)}"
    if cfg.queries * next_pow2(spec.top_k) > 8192:
        return f"queries * next_pow2(top_k) = {cfg.queries * next_pow2(spec.top_k)} running keys; at most 8192"
    smem = kv_select_smem_bytes(spec, cfg, arch)
    if smem > arch_facts(arch).smem_per_block:
        return (f"{smem} B of shared memory (the score product's fp32 operands and the top-k keys: "
                f"kv_select_smem_bytes); at most {arch_facts(arch).smem_per_block} on {arch}: fewer queries or a "
                "smaller chunk")
    return None


def kv_decode_select_infeasible(spec: Spec, cfg: KvSelectConfig, arch: str) -> str | None:
    if cfg.splits not in DECODE_SELECT_SPLITS:
        return f"splits={cfg.splits}; expected one of {DECODE_SELECT_SPLITS}"
    return _merge_infeasible(spec, cfg.splits) or kv_select_infeasible(spec, dataclasses.replace(cfg, splits=1),
                                                                        arch)


def kv_decode_select_default(spec: Spec, arch: str) -> KvSelectConfig:
    # a decode call: one program per (query group, B*Hkv) leaves the GPU idle at long context; split the blocks
    # over 8 programs as decode_select does (MERGE_CANDIDATES bounds the merge)
    splits = max(1, min(8, MERGE_CANDIDATES // next_pow2(spec.top_k)))
    return _first_feasible(spec, arch, kv_decode_select_infeasible, (
        KvSelectConfig(queries=16, chunk=max(next_pow2(spec.top_k), c // spec.groups), num_warps=4, splits=splits)
        for c in (64, 32, 16, 128)), _PER_QUERY_SELECT_REMEDY)


def kv_decode_select_space(spec: Spec, arch: str):
    return (KvSelectConfig(queries=16, chunk=c, num_warps=w, splits=n)
            for c, w, n in itertools.product(_chunks(spec, (16, 32, 64, 128)), (2, 4), DECODE_SELECT_SPLITS))


def kv_select_default(spec: Spec, arch: str) -> KvSelectConfig:
    return _first_feasible(spec, arch, kv_select_infeasible, (
        KvSelectConfig(queries=q, chunk=max(next_pow2(spec.top_k), c // spec.groups), num_warps=4)
        for q in (64, 32, 16) for c in (128, 64, 32, 16)), _PER_QUERY_SELECT_REMEDY)


def kv_select_space(spec: Spec, arch: str):
    return (KvSelectConfig(queries=q, chunk=c, num_warps=w)
            for q, c, w in itertools.product((16, 32, 64, 128), _chunks(spec, (16, 32, 64, 128, 256)), (4, 8)))


def kv_attn_smem_bytes(spec: Spec, cfg: KvAttnConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the KV-centric forward's partials kernel: one K and one V block and the buffers of
    a step's rows, num_stages + 1 of them when pipelined (at most what Triton 3.6 asks for on sm_80 to sm_90:
    tests/test_triton_compile.py compiles offline)."""
    row_buffers = cfg.num_stages + 1 if cfg.num_stages > 1 else 1
    return (2 * spec.kv_block + row_buffers * cfg.block_m) * _tile_d(spec) * elem_bytes


KV_ATTN_STEPS = (1, 2, 4, 8, 16)
# fp32 words per thread of a kernel's accumulators and score tiles; past them Triton spills (a forward
# holds its output and scores, a backward more tiles at once)
FWD_REGS_LIMIT = 192
BWD_REGS_LIMIT = 256


def kv_attn_infeasible(spec: Spec, cfg: KvAttnConfig, arch: str) -> str | None:
    """Why the KV-centric forward cannot run `cfg` for `spec` on `arch`, or None: whole queries per step
    (block_m a power of two, 16 to 256, at least next_pow2(G) rows), registers for the scores and output of
    one block, and one K and one V block plus the pipelined rows in shared memory."""
    g_pad = next_pow2(spec.gqa_group)
    if cfg.block_m not in TILE_ROWS or cfg.block_m < g_pad:
        return f"block_m={cfg.block_m}; expected one of {TILE_ROWS} holding whole queries (>= next_pow2(G) = {g_pad})"
    if cfg.steps not in KV_ATTN_STEPS:
        return f"steps={cfg.steps}; expected one of {KV_ATTN_STEPS}"
    if cfg.num_stages not in (1, 2, 3, 4):
        return f"num_stages={cfg.num_stages}; expected 1 to 4"
    if cfg.combine_rows not in (16, 32, 64, 128):
        return f"combine_rows={cfg.combine_rows}; expected 16, 32, 64 or 128"
    return _resources(cfg.block_m * (_tile_d(spec) + spec.kv_block) // (32 * cfg.num_warps),
                      "block_m * (head_dim + kv_block) / (32 * num_warps)", kv_attn_smem_bytes(spec, cfg),
                      "one K and one V block and the pipelined step rows", arch_facts(arch).smem_per_block,
                      FWD_REGS_LIMIT)


def kv_attn_default(spec: Spec, arch: str) -> KvAttnConfig:
    """64 rows, 16 steps and 4 warps led a sweep of 108 configs on each KV-centric bench shape (H200)."""
    warps = 4 if _tile_d(spec) <= 64 else 8
    return _first_feasible(spec, arch, kv_attn_infeasible, (
        KvAttnConfig(block_m=m, steps=16, num_warps=w, num_stages=s) for m in (64, 128, 32, 16, 256)
        for w in (4, warps) for s in (2, 1)))


def kv_attn_space(spec: Spec, arch: str):
    return (KvAttnConfig(block_m=m, steps=t, num_warps=w, num_stages=s, partials_fp32=f, combine_rows=r)
            for m, t, w, s, f, r in itertools.product(TILE_ROWS, KV_ATTN_STEPS, (4, 8), (1, 2, 3), (False, True),
                                                      (32, 64)))


UNION_TILE_Q = (1, 2, 4, 8, 16, 32, 64)


def _union_packs(spec: Spec, tile_q: int, block_m: int) -> bool:
    """Programs of block_m packed rows cover tiles of tile_q queries' G heads evenly (the Q-centric rule)."""
    return block_m in TILE_ROWS and spec.packs_rows(block_m, tile_q)


def kv_union_infeasible(spec: Spec, cfg: KvUnionConfig, arch: str) -> str | None:
    """Why the union design cannot run `cfg` for `spec` on `arch`, or None: the Q-centric forward's row
    packing with tile_q queries for a tile, its registers, and its shared memory at one block a step."""
    if cfg.tile_q not in UNION_TILE_Q:
        return f"tile_q={cfg.tile_q}; expected one of {UNION_TILE_Q}"
    if not _union_packs(spec, cfg.tile_q, cfg.block_m):
        return (f"block_m={cfg.block_m} must be one of {TILE_ROWS}, at most gqa_group * tile_q = "
                f"{spec.gqa_group * cfg.tile_q}, and split a tile of tile_q={cfg.tile_q} queries evenly or hold whole "
                f"tiles of a number of heads that divides gqa_group={spec.gqa_group}")
    if cfg.num_stages not in (1, 2, 3, 4):
        return f"num_stages={cfg.num_stages}; expected 1 to 4"
    if cfg.use_tma and not arch_facts(arch).tma:
        return f"use_tma=True needs TMA (sm_90), which {arch} lacks"
    return _resources(cfg.block_m * (_tile_d(spec) + spec.kv_block) // (32 * cfg.num_warps),
                      "block_m * (head_dim + kv_block) / (32 * num_warps)",
                      attn_smem_bytes(spec, AttnConfig(block_m=cfg.block_m, num_stages=cfg.num_stages), arch),
                      "num_stages K and V blocks and the tile's rows", arch_facts(arch).smem_per_block,
                      FWD_REGS_LIMIT)


def kv_union_default(spec: Spec, arch: str) -> KvUnionConfig:
    """A program of 64 rows holding whole tiles (4 queries at G = 16), 4 warps, 2 stages: the fastest point of
    the H200 sweep on most list kinds (tools/kv_union_sweep.py, docs/DESIGN.md); then whatever packs. K and V
    through tensor descriptors where the arch has TMA (H200: 4.47 -> 3.55 ms at kv_nsa32k, 1.14 -> 1.03 at
    kv_d64_64k)."""
    rows = (64, 128, 32, 16, 256)
    tiles = sorted(UNION_TILE_Q, key=lambda t: (t != union_tile_q(spec.gqa_group), abs(next_pow2(spec.gqa_group) * t - 64)))
    return _first_feasible(spec, arch, kv_union_infeasible, (
        KvUnionConfig(tile_q=t, block_m=m, num_warps=w, num_stages=s, use_tma=arch_facts(arch).tma)
        for t in tiles for m in rows for s in (2, 1) for w in (4, 8)))


def _tma_choices(arch: str) -> tuple[bool, ...]:
    return (False, True) if arch_facts(arch).tma else (False,)


def kv_union_space(spec: Spec, arch: str):
    return (KvUnionConfig(tile_q=t, block_m=m, num_warps=w, num_stages=s, use_tma=tma)
            for t, m, w, s, tma in itertools.product(UNION_TILE_Q, TILE_ROWS, (4, 8), (1, 2, 3), _tma_choices(arch)))


def union_rows(spec: Spec, tile_q: int, block_m: int) -> int | None:
    """The rows a program of the union design takes for tiles of tile_q queries: block_m, or the largest power
    of two below it that packs (the forward's packing rule, `kv_union_infeasible`); None if none of 16 or more."""
    block_m = min(block_m, next_pow2(spec.gqa_group * tile_q))
    while block_m >= 16:
        if _union_packs(spec, tile_q, block_m):
            return block_m
        block_m //= 2
    return None


def kv_union_bwd_infeasible(spec: Spec, cfg: KvUnionBwdConfig, arch: str) -> str | None:
    """Why the union backward cannot run `cfg` for `spec` on `arch`, or None: rows that pack for its tile_q
    (dQ and dK/dV alike), whole key slices of a block, and the Q-centric backward kernels' resources."""
    if cfg.tile_q not in UNION_TILE_Q:
        return f"tile_q={cfg.tile_q}; expected one of {UNION_TILE_Q}"
    for name, rows in (("dq_block_m", cfg.dq_block_m), ("block_m", cfg.block_m)):
        if not _union_packs(spec, cfg.tile_q, rows):
            return (f"{name}={rows} must be one of {TILE_ROWS} and pack tiles of tile_q={cfg.tile_q} queries of "
                    f"gqa_group={spec.gqa_group} heads (kv_union_infeasible)")
    for name, on in (("dq_use_tma", cfg.dq_use_tma), ("use_tma", cfg.use_tma)):
        if on and not arch_facts(arch).tma:
            return f"{name}=True needs TMA (sm_90), which {arch} lacks"
    dq_why = _dq_resources(spec, BwdDqConfig(cfg.dq_block_m, cfg.dq_warps, cfg.dq_stages), arch)
    if dq_why:
        return f"dQ: {dq_why}"
    dkdv_why = _dkdv_infeasible(spec, BwdDkdvConfig(cfg.block_n, cfg.block_m, cfg.num_warps, cfg.num_stages), arch,
                                lambda: None)
    return f"dK/dV: {dkdv_why}" if dkdv_why else None


def kv_union_bwd_default(spec: Spec, arch: str) -> KvUnionBwdConfig:
    fwd = kv_union_default(spec, arch)
    # H200 (tools/kv_union_sweep.py --kernels): through tensor descriptors the dQ took 4.63 -> 3.76 ms at
    # kv_nsa32k and 1.11 -> 1.08 at kv_d64_64k, the dK/dV 8.88 -> 7.81 and 2.99 -> 3.02
    tma = arch_facts(arch).tma
    return _first_feasible(spec, arch, kv_union_bwd_infeasible, (
        KvUnionBwdConfig(tile_q=fwd.tile_q, dq_block_m=dq.block_m, dq_warps=dq.num_warps, dq_stages=dq.num_stages,
                         dq_use_tma=tma, block_n=n, block_m=m, num_warps=w, num_stages=st, use_tma=tma)
        for dq in (BwdDqConfig(fwd.block_m, 4, 2), BwdDqConfig(fwd.block_m, 8, 2), BwdDqConfig(32, 4, 2),
                   BwdDqConfig(16, 4, 1))
        # H200 (agreeing lists, kv_nsa32k and kv_d64_64k): 64 keys x 64 rows a dK/dV step on 4 warps, 2 stages, was
        # the fastest at head_dim 128 and 64; 8 warps took 1.7-3x as long
        for n in (min(64, spec.kv_block), 32, 16) for m in (64, 32, 16) for w in (4, 8) for st in (2, 1)))


def kv_union_bwd_space(spec: Spec, arch: str):
    return (KvUnionBwdConfig(tile_q=t, dq_block_m=qm, dq_warps=qw, dq_stages=qs, dq_use_tma=qt, block_n=n, block_m=m,
                             num_warps=w, num_stages=st, use_tma=tma)
            for t, qm, qw, qs, qt, n, m, w, st, tma in itertools.product(
                UNION_TILE_Q, (32, 64, 128), (4, 8), (1, 2), _tma_choices(arch), (32, 64), (16, 32, 64), (4, 8),
                (1, 2, 3), _tma_choices(arch)))


# ---- decode: feasibility, defaults, space ----------------------------------------------------------

DECODE_SPLITS = (1, 2, 4, 8, 16, 32)


def decode_rows(spec: Spec) -> int:
    """Packed rows of a decode program: the G heads of one query, padded to tl.dot's 16 at least."""
    return max(16, next_pow2(spec.gqa_group))


@functools.lru_cache(maxsize=None)  # read on every decode launch
def decode_queries(spec: Spec) -> int:
    """Queries a decode program packs into its rows: as many as the padding to 16 rows holds where they share
    a list (Q-centric: a call's few queries are in one Q tile, q_tile >= 16), so that one K/V block load serves
    them all; one where each query has its own list."""
    return 1 if spec.per_query else decode_rows(spec) // next_pow2(spec.gqa_group)


def decode_smem_bytes(spec: Spec, cfg: DecodeConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the decode kernel: num_stages buffers of one K and one V block, plus the packed rows
    of q and of P (tests/test_triton_compile.py checks it bounds what Triton 3.6 asks for on sm_80 to sm_90)."""
    return (cfg.num_stages * 2 * spec.kv_block + 2 * decode_rows(spec)) * _tile_d(spec) * elem_bytes


def decode_infeasible(spec: Spec, cfg: DecodeConfig, arch: str) -> str | None:
    """Why the decode kernel cannot run `cfg` for `spec` on `arch`, or None: splits from DECODE_SPLITS, registers
    for the accumulator and the scores of one block, and K and V buffers that fit in shared memory."""
    if cfg.splits not in DECODE_SPLITS:
        return f"splits={cfg.splits}; expected one of {DECODE_SPLITS}"
    if cfg.num_warps not in (1, 2, 4, 8) or cfg.num_stages < 1:
        return f"num_warps={cfg.num_warps}, num_stages={cfg.num_stages}; expected 1, 2, 4 or 8 warps and >= 1 stage"
    return _resources(decode_rows(spec) * (_tile_d(spec) + spec.kv_block) // (32 * cfg.num_warps),
                      "rows * (head_dim + kv_block) / (32 * num_warps)", decode_smem_bytes(spec, cfg),
                      f"num_stages K and V blocks and the rows, on {arch}: fewer stages",
                      arch_facts(arch).smem_per_block, FWD_REGS_LIMIT)


def decode_default(spec: Spec, arch: str) -> DecodeConfig:
    # about two listed blocks per split (not measured): a long list is spread over more programs, which a
    # batch of one and few KV heads needs to fill a GPU
    splits = max(1, min(16, next_pow2(spec.top_k) // 2))
    return _first_feasible(spec, arch, decode_infeasible, (
        DecodeConfig(splits=splits, num_warps=w, num_stages=s) for s in (2, 1) for w in (4, 8)))


def decode_space(spec: Spec, arch: str):
    return (DecodeConfig(splits=n, num_warps=w, num_stages=s)
            for n, w, s in itertools.product(DECODE_SPLITS, (2, 4, 8), (1, 2, 3)))


def attn_paged_infeasible(spec: Spec, cfg: AttnConfig, arch: str) -> str | None:
    """attn_rows' rules, for Q-centric lists (per-query lists have kv_attn_paged)."""
    if spec.per_query:
        return "per-query lists attend over pages with the kv_attn_paged role, not attn_paged"
    return attn_rows_infeasible(spec, cfg, arch)


# ---- the index selector: feasibility, defaults, space ---------------------------------------------------

INDEX_REGS_LIMIT = 128  # fp32 words per thread of the step's score tiles (the product and the head sum)
INDEX_SMEM_DIM = 128  # the largest index dim: its size is a call's, not the spec's, so budgets assume it


def index_select_smem_bytes(spec: Spec, cfg: IndexSelectConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the index selector: num_stages steps of keys and the packed query rows, of 16-bit index
    vectors of the largest dim (at most what Triton 3.6 asks for on sm_80 to sm_90:
    tests/test_triton_compile.py compiles offline)."""
    return (cfg.num_stages * cfg.chunk * spec.kv_block + cfg.rows) * INDEX_SMEM_DIM * elem_bytes


def _index_step_infeasible(spec: Spec, cfg, rows: int, rows_what: str, fewer: str) -> str | None:
    """What either index selector's step needs, or None: chunk a power of two, a power of two of warps and a
    stage at least, and `rows` (`rows_what`) fp32 rows of chunk * kv_block scores in registers."""
    if cfg.chunk < 1 or cfg.chunk & (cfg.chunk - 1):
        return f"chunk={cfg.chunk} blocks; expected a power of two >= 1"
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        return f"num_warps={cfg.num_warps}, num_stages={cfg.num_stages}; expected a power of two <= 16 and >= 1 stage"
    regs = rows * cfg.chunk * spec.kv_block // (32 * cfg.num_warps)
    if regs > INDEX_REGS_LIMIT:
        return (f"{rows_what} * chunk * kv_block / (32 * num_warps) = {regs} fp32 registers per thread for the step's "
                f"scores; at most {INDEX_REGS_LIMIT}: {fewer} or blocks per step, or more warps")
    return None


def index_select_infeasible(spec: Spec, cfg: IndexSelectConfig, arch: str) -> str | None:
    """Why the index selector cannot run `cfg` for `spec` on `arch`, or None: rows is a power of two from 16
    (tl.dot's smallest M) to 256, chunk a power of two, splits one from 1 to 64 (merge_topk's), the step's score
    tiles fit in registers, and num_stages key steps and the packed query rows in shared memory (16-bit index
    vectors of dim 128)."""
    if cfg.rows not in (16, 32, 64, 128, 256):
        return f"rows={cfg.rows}; expected a power of two from 16 to 256"
    if cfg.splits not in (1, 2, 4, 8, 16, 32, 64):
        return f"splits={cfg.splits}; expected a power of two from 1 to 64"
    reason = _merge_infeasible(spec, cfg.splits)
    if reason:
        return reason
    reason = _index_step_infeasible(spec, cfg, 2 * cfg.rows, "2 * rows", "fewer rows")
    if reason:
        return reason
    smem = index_select_smem_bytes(spec, cfg)
    if smem > arch_facts(arch).smem_per_block:
        return f"{smem} B of shared memory (num_stages key steps and the rows); at most {arch_facts(arch).smem_per_block}"
    return None


def index_select_default(spec: Spec, arch: str) -> IndexSelectConfig:
    # about 128 keys per step against 64 packed rows; more warps before fewer rows at long KV blocks
    chunk = max(1, 128 // spec.kv_block)
    for rows, warps in ((64, 4), (64, 8), (32, 8), (16, 8)):
        cfg = IndexSelectConfig(rows=rows, chunk=chunk, num_warps=warps, num_stages=1)
        if index_select_infeasible(spec, cfg, arch) is None:
            return cfg
    raise KernelgenValueError(f"no IndexSelectConfig fits {spec} on {arch}: {index_select_infeasible(spec, cfg, arch)}")


def index_select_space(spec: Spec, arch: str):
    return (IndexSelectConfig(rows=r, chunk=c, num_warps=w, num_stages=n)
            for r, c, w, n in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (4, 8), (1, 2, 3)))


def decode_index_select_default(spec: Spec, arch: str) -> IndexSelectConfig:
    # a decode call's one Q tile: 16 packed rows (Hi = 16 index heads of one query fill them), its blocks split
    # over 16 programs (8 rows of a batch: 128 programs), as decode_select splits a tile's; 256 keys a step (the
    # tuned winner at bench --decode's dec_b64k and dec_c32k, H100: 1.43x and 1.15x over 128 keys)
    splits = max(1, min(16, MERGE_CANDIDATES // next_pow2(spec.top_k)))
    chunk = max(1, min(8, 256 // spec.kv_block))
    cfg = IndexSelectConfig(rows=16, chunk=chunk, num_warps=4, num_stages=1, splits=splits)
    return cfg if index_select_infeasible(spec, cfg, arch) is None else index_select_default(spec, arch)


def decode_index_select_space(spec: Spec, arch: str):
    return (IndexSelectConfig(rows=r, chunk=c, num_warps=w, num_stages=n, splits=sp)
            for r, c, w, n, sp in itertools.product((16, 32, 64), (1, 2, 4, 8), (4, 8), (1, 2), (4, 8, 16, 32)))


# ---- the index selector for per-query lists (KV-centric): feasibility, defaults, space ----------------------

def kv_index_select_width(spec: Spec, cfg: KvIndexSelectConfig) -> int:
    """Blocks merged into the running lists at once: the config's width, or next_pow2(top_k) when that is
    more (tl.topk takes next_pow2(top_k) of them)."""
    return max(cfg.width, next_pow2(spec.top_k))


def kv_index_select_smem_bytes(spec: Spec, cfg: KvIndexSelectConfig, arch: str, elem_bytes: int = 2,
                               index_heads: int = INDEX_HEADS, index_dim: int = INDEX_SMEM_DIM) -> int:
    """Shared memory of the per-query index selector, with 16-bit index vectors (of the largest dim unless
    told): a step's keys and num_stages copies of the packed query rows (the products' operands), or with
    hold, num_stages steps' keys and every index head's query rows (`index_heads` of them, Hi; the tuned
    inputs' unless told), and with heads > 1 the fp32 product tile that the heads' sum reshapes. Triton 3.6
    needs the larger of the two with mma.sync (sm_80 to sm_89) and their sum (give or take) with wgmma
    (sm_90): offline compiles over queries 16-128, heads 1-4, chunk 1-8, kv_block 16-256, 1 and 2 stages, Di 64
    and 128 (tests/test_triton_compile.py checks it bounds them)."""
    keys, rows = cfg.chunk * spec.kv_block, cfg.heads * cfg.queries
    if cfg.hold:
        held = -(-index_heads // cfg.heads) * rows
        operands = (cfg.num_stages * keys + held) * index_dim * elem_bytes
    else:
        operands = (keys + cfg.num_stages * rows) * index_dim * elem_bytes
    head_sum = 4 * rows * keys if cfg.heads > 1 else 0
    if arch_facts(arch).mma == "mma.sync":
        return max(operands, head_sum)
    return operands + head_sum


def kv_index_select_infeasible(spec: Spec, cfg: KvIndexSelectConfig, arch: str) -> str | None:
    """Why the per-query index selector cannot run `cfg` for `spec` on `arch`, or None: queries from 16 (tl.dot's
    smallest M, whatever Hi) to 128, heads 1 to 8, chunk a power of two and span a multiple of it, the step's
    score tiles (the product of heads * queries rows and the heads' sum) in registers, shared memory
    (`kv_index_select_smem_bytes`), and the top-k's rows a power of two, width one, their keys in registers."""
    if cfg.queries not in (16, 32, 64, 128):
        return f"queries={cfg.queries}; expected 16, 32, 64 or 128"
    if cfg.heads not in (1, 2, 4, 8):
        return f"heads={cfg.heads}; expected 1, 2, 4 or 8 index heads per product"
    reason = _index_step_infeasible(spec, cfg, (cfg.heads + 1) * cfg.queries, "(heads + 1) * queries",
                                    "fewer queries or heads")
    if reason:
        return reason
    if cfg.span < cfg.chunk or cfg.span % cfg.chunk:
        return f"span={cfg.span} blocks; expected a multiple of chunk={cfg.chunk}"
    if cfg.rows not in (8, 16, 32, 64) or cfg.width < 1 or cfg.width & (cfg.width - 1):
        return f"rows={cfg.rows}, width={cfg.width}; expected rows 8 to 64 and width, powers of two"
    running = cfg.rows * max(kv_index_select_width(spec, cfg), 2 * next_pow2(spec.top_k))
    if running > 8192:
        return f"rows * max(width, 2 * next_pow2(top_k)) = {running} keys of the top-k merges; at most 8192"
    smem = kv_index_select_smem_bytes(spec, cfg, arch)
    if smem > arch_facts(arch).smem_per_block:
        return (f"{smem} B of shared memory (a step's keys, the query rows and the heads' product tile: "
                f"kv_index_select_smem_bytes); "
                f"at most {arch_facts(arch).smem_per_block} on {arch}")
    return None


def kv_index_select_default(spec: Spec, arch: str) -> KvIndexSelectConfig:
    # about 128 keys per step against 64 queries, one index head per product (a heads' sum would reshape the
    # product tile through shared memory: 6-7x slower on an H200); 16 queries' lists merged 32 blocks at a time.
    # Index vectors held in shared memory by 4 warps: 3.24 ms against 4.44 unheld on 8 warps at kv_nsa32k on an
    # H200 (`kernelgen tune --preset kv --role kv_select_index`'s default, before and after)
    chunk = max(1, 128 // spec.kv_block)
    width = max(32, next_pow2(spec.top_k))
    rows = 16 if 16 * max(width, 2 * next_pow2(spec.top_k)) <= 8192 else 8
    return _first_feasible(spec, arch, kv_index_select_infeasible, (
        KvIndexSelectConfig(queries=q, heads=h, chunk=chunk, span=max(chunk, 32), rows=rows, width=width,
                            num_warps=w, num_stages=1, hold=hold)
        for q, h, w, hold in ((64, 1, 4, True), (64, 1, 8, False), (32, 1, 4, False), (32, 2, 8, False),
                              (16, 4, 8, False), (16, 1, 4, False))))


def kv_decode_index_select_default(spec: Spec, arch: str) -> KvIndexSelectConfig:
    # a decode step: one query a row, so a product's rows are queries=16 (tl.dot's least; kv_select_index's 64
    # score 63 padding rows), and the keys spread over more programs (span 8). At 8 rows of up to 64k keys (Hi 16,
    # Di 128, 64-key blocks, top-32): 148 us against 322 with kv_select_index's default (H200); within 1.12x of
    # the tuned winners at bench --decode's shapes (H100)
    chunk = max(1, 256 // spec.kv_block)
    width = max(128, next_pow2(spec.top_k))
    decode = KvIndexSelectConfig(queries=16, heads=1, chunk=chunk, span=max(chunk, 8), rows=8, width=width,
                                 num_warps=4, num_stages=1, hold=True)
    return decode if kv_index_select_infeasible(spec, decode, arch) is None else kv_index_select_default(spec, arch)


def kv_decode_index_select_space(spec: Spec, arch: str):
    """One query a row: the fewest queries a product takes, shorter spans (more programs), and the top-k's fewest
    rows; the default (`kv_decode_index_select_default`) among them."""
    return (KvIndexSelectConfig(queries=16, heads=h, chunk=c, span=sp, rows=8, width=wd, num_warps=w, num_stages=1,
                                hold=hold)
            for h, c, sp, wd, w, hold in itertools.product((1, 2), (1, 2, 4, 8, 16), (4, 8, 16, 32), (32, 128, 256),
                                                           (4, 8), (False, True)))


def kv_index_select_space(spec: Spec, arch: str):
    return (KvIndexSelectConfig(queries=q, heads=h, chunk=c, span=sp, rows=r, width=wd, num_warps=w, num_stages=n,
                                hold=hold)
            for q, h, c, sp, r, wd, w, n, hold in itertools.product(
                (16, 32, 64, 128), (1, 2, 4), (1, 2, 4, 8), (16, 32, 64), (8, 16, 32), (32, 64, 128, 256), (4, 8), (1, 2),
                (False, True)))


# ---- backward: feasibility, defaults, spaces --------------------------------------------------------




def bwd_dq_smem_bytes(spec: Spec, cfg: BwdDqConfig, elem_bytes: int = 2) -> int:
    """Shared memory of the dQ kernel: num_stages buffers of one K and one V block, plus Q and dO (what Triton
    3.6 asked for on sm_90: tests/test_backward.py compiles offline)."""
    return (cfg.num_stages * 2 * spec.kv_block + 2 * cfg.block_m) * _tile_d(spec) * elem_bytes


def bwd_dkdv_smem_bytes(spec: Spec, cfg: BwdDkdvConfig, elem_bytes: int = 2) -> int:
    """Shared memory of a dK/dV kernel (either schedule's): num_stages buffers of one step's Q and dO, plus K and V; unpipelined
    (1 stage), Q and dO twice, once per product that reads each. (What Triton 3.6 asked for on sm_90, give or
    take its barriers: tests/test_backward.py compiles offline.)"""
    rows = max(cfg.num_stages * 2 * cfg.block_m + 2 * cfg.block_n, 4 * cfg.block_m)
    return rows * _tile_d(spec) * elem_bytes + 2048  # and up to 2 KB of the pipeline's barriers


def _resources(regs: int, regs_what: str, smem: int, smem_what: str, smem_limit: int,
               regs_limit: int = BWD_REGS_LIMIT) -> str | None:
    """Why a kernel's tiles do not fit (`regs` fp32 registers per thread, `smem` bytes), or None."""
    if regs > regs_limit:
        return (f"{regs_what} = {regs} fp32 registers per thread; at most {regs_limit} (Triton spills past "
                "it): more warps or smaller tiles")
    if smem > smem_limit:
        return f"{smem} B of shared memory ({smem_what}); at most {smem_limit}"
    return None


def _bwd_warps_stages(spec: Spec) -> tuple[int, int]:
    """The backward defaults' num_warps and num_stages for the spec's head_dim (the forward's)."""
    return (4 if _tile_d(spec) <= 64 else 8), (1 if _tile_d(spec) >= 256 else 2)


def bwd_dq_infeasible(spec: Spec, cfg: BwdDqConfig, arch: str) -> str | None:
    """Why the dQ kernel cannot run `cfg` for `spec`, or None: the forward's row packing, registers for dQ,
    Q, dO and the P and dP tiles of one block, and K and V buffers that fit in shared memory."""
    if cfg.use_tma and not arch_facts(arch).tma:
        return f"use_tma=True needs TMA (sm_90), which {arch} lacks"
    return pack_infeasible(spec, cfg.block_m) or _dq_resources(spec, cfg, arch)


def _dq_resources(spec: Spec, cfg: BwdDqConfig, arch: str) -> str | None:
    """A dQ kernel's registers and shared memory (either design's: the Q-centric one and the union one)."""
    return _resources(
        cfg.block_m * (2 * _tile_d(spec) + 2 * spec.kv_block) // (32 * cfg.num_warps),
        "block_m * (2 * head_dim + 2 * kv_block) / (32 * num_warps) for dQ, Q, dO, P and dP",
        bwd_dq_smem_bytes(spec, cfg), "num_stages K and V blocks, Q and dO", arch_facts(arch).smem_per_block)


def bwd_dq_default(spec: Spec, arch: str) -> BwdDqConfig:
    warps, stages = _bwd_warps_stages(spec)
    # 128 rows first (8 warps at head_dim 128): on (c) (H200, 2026-12-01) 2.92 ms against 5.52 with 64 rows. Fewer stages
    # only where the arch's shared memory holds no more (sm_86/sm_89 at head_dim 128)
    return _first_feasible(spec, arch, bwd_dq_infeasible, (BwdDqConfig(block_m=m, num_warps=w, num_stages=s)
                                                           for s in (stages, 1) for m in (128, 64, 32, 16)
                                                           for w in (warps, 8)))


def bwd_dq_space(spec: Spec, arch: str):
    return (BwdDqConfig(block_m=m, num_warps=w, num_stages=s, use_tma=t)
            for m, w, s, t in itertools.product((16, 32, 64, 128, 256), (4, 8), (1, 2, 3, 4), _tma_choices(arch)))


def bwd_dkdv_infeasible(spec: Spec, cfg: BwdDkdvConfig, arch: str) -> str | None:
    """Why the dK/dV kernel cannot run `cfg` for `spec`, or None: block_n splits a KV block, block_m packs
    the tile's rows as the forward's block_m does, registers for dK, dV, K, V and the P and dP tiles of one
    step, and Q and dO buffers that fit in shared memory."""
    return _dkdv_infeasible(spec, cfg, arch, lambda: pack_infeasible(spec, cfg.block_m))


def _dkdv_infeasible(spec: Spec, cfg, arch: str, rows_infeasible, dq_rows: int = 0) -> str | None:
    """A dK/dV kernel's checks (either schedule's): block_n splits a KV block, then `rows_infeasible()` (the
    schedule's rule for block_m), then registers (with `dq_rows` rows of a dQ partial, the KV-centric
    kernel's) and shared memory (`bwd_dkdv_smem_bytes`)."""
    if cfg.block_n < 16 or cfg.block_n > spec.kv_block or spec.kv_block % cfg.block_n:
        return f"block_n={cfg.block_n} must be >= 16 and split a KV block (kv_block={spec.kv_block}) evenly"
    return rows_infeasible() or _resources(
        (cfg.block_n * (3 * _tile_d(spec) + 2 * cfg.block_m) + dq_rows * _tile_d(spec)) // (32 * cfg.num_warps),
        "(block_n * (3 * head_dim + 2 * block_m) + dq rows * head_dim) / (32 * num_warps) for dK, dV, K, V, P, dP "
        "and a dQ partial",
        bwd_dkdv_smem_bytes(spec, cfg), "num_stages Q and dO steps, K and V", arch_facts(arch).smem_per_block)


def bwd_dkdv_default(spec: Spec, arch: str) -> BwdDkdvConfig:
    warps, stages = _bwd_warps_stages(spec)
    # 4 warps first: on (c) (H200, 2026-12-01) 64 x 64 steps on 4 warps took 5.61 ms against 10.00 on 8
    return _first_feasible(spec, arch, bwd_dkdv_infeasible, (
        BwdDkdvConfig(block_n=n, block_m=m, num_warps=w, num_stages=s)
        for s in (stages, 1) for n in (min(spec.kv_block, 64), 32, 16) for m in (64, 32, 16, 128) for w in (4, 8)))


def bwd_dkdv_space(spec: Spec, arch: str):
    return (BwdDkdvConfig(block_n=n, block_m=m, num_warps=w, num_stages=s)
            for n, m, w, s in itertools.product((16, 32, 64, 128, 256), (16, 32, 64, 128), (4, 8), (1, 2, 3)))


def kv_bwd_infeasible(spec: Spec, cfg: KvBwdConfig, arch: str) -> str | None:
    """Why the KV-centric backward cannot run `cfg` for `spec` on `arch`, or None: block_n splits a KV
    block, block_m holds whole queries (a power of two, 16 to 256, at least next_pow2(G) rows), registers
    for dK, dV, K, V, the P and dP tiles and the dQ partial of one step, and Q and dO buffers that fit in
    shared memory."""
    g_pad = next_pow2(spec.gqa_group)

    def rows_infeasible():
        if cfg.block_m not in TILE_ROWS or cfg.block_m < g_pad:
            return (f"block_m={cfg.block_m}; expected one of {TILE_ROWS} holding whole queries (>= next_pow2(G) = "
                    f"{g_pad})")
        if cfg.merge_rows not in (16, 32, 64, 128):
            return f"merge_rows={cfg.merge_rows}; expected 16, 32, 64 or 128"
        return None

    return _dkdv_infeasible(spec, cfg, arch, rows_infeasible, dq_rows=cfg.block_m)


def kv_bwd_default(spec: Spec, arch: str) -> KvBwdConfig:
    _, stages = _bwd_warps_stages(spec)
    return _first_feasible(spec, arch, kv_bwd_infeasible, (
        KvBwdConfig(block_n=n, block_m=m, num_warps=w, num_stages=s)
        for s in (stages, 1) for n in (min(spec.kv_block, 64), 32, 16) for m in (64, 32, 16, 128, 256)
        for w in (4, 8)))


def kv_bwd_space(spec: Spec, arch: str):
    return (KvBwdConfig(block_n=n, block_m=m, num_warps=w, num_stages=s, dq_partials_fp32=f)
            for n, m, w, s, f in itertools.product((16, 32, 64, 128, 256), TILE_ROWS, (4, 8), (1, 2, 3),
                                                   (False, True)))


# what a spec that no config of a per-query selection fits can change: its score product holds a chunk of at least
# next_pow2(top_k) blocks' r representatives (kv_select_smem_bytes), whatever the config
_PER_QUERY_SELECT_REMEDY = "use a smaller top_k, fewer groups (multi:r) or a smaller head_dim"


def _first_feasible(spec: Spec, arch: str, infeasible, candidates, remedy: str = "use a smaller kv_block or q_tile"):
    """The first candidate config `infeasible(spec, config, arch)` accepts (a default's order of preference)."""
    why = reason = None
    for cfg in candidates:
        reason = infeasible(spec, cfg, arch)
        if reason is None:
            return cfg
        if not isinstance(cfg, (BwdDqConfig, BwdDkdvConfig)) or pack_infeasible(spec, cfg.block_m) is None:
            why = reason  # the last resources' reason says more than a row packing's
    raise KernelgenValueError(f"no {type(cfg).__name__} fits {spec} on {arch}: {why or reason}; {remedy}")


# ---- launchers --------------------------------------------------------------------------------------

def launch_lists(mod, spec: Spec, config, shapes: Shapes, block_idx: torch.Tensor) -> torch.Tensor:
    """Checked int32 lists (`inputs.check_block_idx`) in the kernels' form, on the device, no host sync."""
    out = empty(like=block_idx)
    n_lists = shapes.batch * shapes.heads_kv * shapes.n_q_tiles
    lists = max(1, min(16, 2048 // next_pow2(spec.top_k)))  # lists per program: about 2K ids in registers
    mod.normalize_lists[(cdiv(n_lists, lists),)](
        block_idx, out, n_lists, shapes.n_kv_blocks,
        TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), LISTS=lists, num_warps=4)
    return out


def launch_window_lists(mod, spec: Spec, config, shapes: Shapes, device, *, seqlens: torch.Tensor | None = None,
                        leftpad: torch.Tensor | None = None,
                        block_table: torch.Tensor | None = None) -> torch.Tensor:
    """A selecting window spec's lists in the kernels' form, int32 [B, 1, n_q_tiles, top_k] (expand it over the KV
    heads): each tile's window blocks. Without `seqlens` every row holds n_k keys and one row is made, [1, 1, ...];
    with it (int32 [B]; `leftpad`: as `launch_decode`'s), row b's over its own keys. `block_table` is not read: a
    paged row's keys are its first seqlens[b] positions."""
    rows = 1 if seqlens is None else shapes.batch
    out = empty(rows, 1, shapes.n_q_tiles, spec.top_k, device=device, dtype=torch.int32)
    tiles = min(64, next_pow2(shapes.n_q_tiles))
    mod.window_lists[(cdiv(shapes.n_q_tiles, tiles), rows)](
        out, *((out, out) if seqlens is None else _row_keys(seqlens, leftpad)), out.stride(0), out.stride(2),
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, TOP_K=spec.top_k,
        TOP_K_PAD=next_pow2(spec.top_k), TILES=tiles, VARLEN=seqlens is not None, HAS_LEFTPAD=leftpad is not None,
        num_warps=1)
    return out


def _pool(x: torch.Tensor, tile: int, groups: int, n_tiles: int, mod, seqlens: torch.Tensor | None = None,
          leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """pool's representatives of x's tiles; `seqlens`, `leftpad` (int32 [B]): batch row b holds rows
    [leftpad[b], seqlens[b]) (leftpad None: from 0), its tiles counted from its first; `block_table` (with
    seqlens): x is a pool of pages whose row b's are listed there (`pool_paged`)."""
    if block_table is not None:
        return _pool_paged(x, tile, groups, n_tiles, mod, seqlens, block_table)
    b, h, n, d = x.shape
    rep = empty(b, h, n_tiles, groups, d, device=x.device, dtype=torch.float32)
    # one tile per program: on the H200 (a32k) pooling took 15 us per tensor so, and 3x that with 4
    # tiles per program (the template keeps TILES for a later tunable)
    tiles = 1
    kernel, lengths = (mod.pool, ()) if seqlens is None else (mod.pool_varlen, _row_keys(seqlens, leftpad))
    kernel[(cdiv(n_tiles, tiles), b * h)](x, rep, *lengths, x.stride(0), x.stride(1), x.stride(2), n, h,
                                                 n_tiles, TILE=tile, GROUPS=groups, HEAD_DIM=d, BLOCK_D=next_pow2(d),
                                                 TILES=tiles, num_warps=_pool_warps(tiles * tile, d),
                                                 **_has_leftpad(seqlens, leftpad))
    return rep


def _pool_paged(x: torch.Tensor, tile: int, groups: int, n_tiles: int, mod, seqlens: torch.Tensor,
                block_table: torch.Tensor) -> torch.Tensor:
    """`_pool` of a paged cache x [n_pages, H, page_size, D]: row b's first seqlens[b] keys, from its pages."""
    b, (n_pages, h, page_size, d) = block_table.shape[0], x.shape
    rep = empty(b, h, n_tiles, groups, d, device=x.device, dtype=torch.float32)
    mod.pool_paged[(n_tiles, b * h)](x, rep, block_table, seqlens, *_paged_strides(block_table, x),
                                     block_table.shape[1] * page_size, n_pages, h, n_tiles, TILE=tile, GROUPS=groups,
                                     HEAD_DIM=d, BLOCK_D=next_pow2(d),
                                     PAGE_SIZE=page_size, num_warps=_pool_warps(tile, d))
    return rep


def _pool_warps(rows: int, head_dim: int) -> int:
    """Warps of a pooling program over `rows` rows of `head_dim`: 8 from 8192 elements on."""
    return 8 if rows * head_dim >= 8192 else 4


def _paged_strides(block_table: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:
    """The paged kernels' strides: the table's row, then x's page, head and row."""
    return block_table.stride(0), *x.stride()[:3]


def _row_keys(seqlens: torch.Tensor, leftpad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen kernels' SEQLENS, LEFTPAD arguments (LEFTPAD, unread without HAS_LEFTPAD, then points at
    SEQLENS)."""
    return seqlens, seqlens if leftpad is None else leftpad


def _has_leftpad(seqlens: torch.Tensor | None, leftpad: torch.Tensor | None) -> dict:
    """The varlen kernels' HAS_LEFTPAD constexpr (none for the kernels of one length)."""
    return {} if seqlens is None else {"HAS_LEFTPAD": leftpad is not None}


def topk_width(top_k: int) -> int:
    """The selectors' running top-k width: next_pow2(top_k), at least 2 (tl.topk and tl.sort of a [1, 1] tensor fail
    in Triton 3.6; the slots past top_k are never stored)."""
    return max(2, next_pow2(top_k))


def launch_select(mod, spec: Spec, cfg: SelectConfig, shapes: Shapes, q: torch.Tensor, k: torch.Tensor,
                  k_rep: torch.Tensor | None = None, *, seqlens: torch.Tensor | None = None,
                  leftpad: torch.Tensor | None = None, row_queries: bool = False,
                  block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Block lists int32 [B, Hkv, n_q_tiles, top_k] (ids ascending, then -1), chosen on the device; `k_rep`:
    k's representatives kept from `launch_key_reps` (None: pooled here); `seqlens`, `leftpad` (int32 [B]): batch
    row b holds k's keys [leftpad[b], seqlens[b]) (leftpad None: from 0), its blocks counted from its first, its
    queries the last of them; `row_queries`: its queries are its own tokens instead (a right-padded prefill: q's
    first seqlens[b] rows); `block_table`: k is paged."""
    r = spec.groups
    q_rep = _pool(q, spec.q_tile, r, shapes.n_q_tiles, mod, seqlens if row_queries else None)
    if k_rep is None:
        k_rep = _pool(k, spec.kv_block, r, shapes.n_kv_blocks, mod, seqlens, leftpad, block_table)
    return select_from_reps(mod, spec, cfg, shapes, q_rep, k_rep, seqlens, leftpad, row_queries)


def launch_key_reps(mod, spec: Spec, cfg, shapes: Shapes, k: torch.Tensor, *, seqlens: torch.Tensor | None = None,
                    leftpad: torch.Tensor | None = None,
                    grow: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The selector's representatives of k's blocks (k: any [B, Hkv, n, D] view starting at a block boundary):
    float32 [B, Hkv, ceil(n / kv_block), r, D], as `launch_select` pools them. `seqlens`, `leftpad` (int32 [B]):
    batch row b holds keys [leftpad[b], seqlens[b]) (leftpad None: from 0); `grow` = (reps, made, made_leftpad):
    reps made for made[b, h] keys from made_leftpad[b, h] (int32 [B, Hkv]), brought to the rows' keys in place
    (only the blocks from made's last partial one are pooled, or all where a row's first key moved) and
    returned. `block_table` (with seqlens): k is a pool of pages [n_pages, Hkv, page_size, D], row b's listed
    there (no leftpad)."""
    if block_table is not None:
        return _paged_key_reps(mod, spec, k, seqlens, block_table, grow)
    if grow is None:
        return _pool(k, spec.kv_block, spec.groups, -(-k.shape[2] // spec.kv_block), mod, seqlens, leftpad)
    reps, made, made_leftpad = grow
    b, h, n, d = k.shape
    mod.pool_grown[(1, b * h)](k, reps, *_row_keys(seqlens, leftpad), made, made_leftpad, k.stride(0), k.stride(1),
                               k.stride(2), n, h, reps.shape[2], TILE=spec.kv_block, GROUPS=spec.groups,
                               HEAD_DIM=d, BLOCK_D=next_pow2(d),
                               HAS_LEFTPAD=leftpad is not None, num_warps=_pool_warps(spec.kv_block, d))
    return reps


def _paged_key_reps(mod, spec: Spec, k: torch.Tensor, seqlens: torch.Tensor, block_table: torch.Tensor,
                    grow: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """launch_key_reps of a paged cache: made (`pool_paged`), or grown in place (`pool_paged_grown`)."""
    n_pages, h, page_size, d = k.shape
    n_tiles = cdiv(block_table.shape[1] * page_size, spec.kv_block)  # pages of no whole blocks: a partial last
    if grow is None:
        return _pool_paged(k, spec.kv_block, spec.groups, n_tiles, mod, seqlens, block_table)
    reps, made, made_leftpad = grow
    mod.pool_paged_grown[(1, block_table.shape[0] * h)](
        k, reps, block_table, seqlens, made, made_leftpad, *_paged_strides(block_table, k),
        block_table.shape[1] * page_size, n_pages, h, reps.shape[2], TILE=spec.kv_block, GROUPS=spec.groups,
        HEAD_DIM=d, BLOCK_D=next_pow2(d), PAGE_SIZE=page_size, num_warps=_pool_warps(spec.kv_block, d))
    return reps


def launch_append_kv(mod, spec: Spec, cfg, shapes: Shapes, cache: torch.Tensor, new: torch.Tensor,
                     cache_b: torch.Tensor | None = None, new_b: torch.Tensor | None = None, *,
                     seqlens: torch.Tensor, leftpad: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                     most_new: int = 0, kv_scales: KVScales | None = None) -> torch.Tensor:
    """new [B, H, n_new, D] written into cache (and new_b into cache_b, of the same rows and heads) at each row's
    end, seqlens[b] clamped to [0, capacity]: positions past the capacity, or in a page outside the pool
    (`block_table`: the caches are pools of pages [n_pages, H, page_size, D]), are not written. Returns the rows'
    lengths after the write, int32 [B] (min(start + n_new, capacity)). leftpad: a row's first key, which the
    write does not move. cu_seqlens (int32 [B + 1]): new and new_b are packed [total, H, D] as a varlen call's
    queries, row b's new rows [cu_seqlens[b], cu_seqlens[b + 1]), none more than `most_new` (one launch for
    every row). `kv_scales`: cache and cache_b are an fp8 K and V cache of these scales, the new rows quantised
    (divided by their (b, h)'s scale, saturated to the dtype's largest finite value, rounded to nearest even)."""
    packed = cu_seqlens is not None
    if packed:
        (batch, n_new), (heads, dim) = (cu_seqlens.shape[0] - 1, most_new), new.shape[1:]
    else:
        batch, heads, n_new, dim = new.shape
    pairs = 1 if cache_b is None else 2
    cache_b, new_b = (cache, new) if cache_b is None else (cache_b, new_b)
    if block_table is None:
        capacity, n_pages, page_size, table, stride_tb = cache.shape[2], 0, 0, seqlens, 0
    else:
        n_pages, page_size = cache.shape[0], cache.shape[2]
        capacity, table, stride_tb = block_table.shape[1] * page_size, block_table, block_table.stride(0)
    after = empty(batch, device=new.device, dtype=torch.int32)
    rows = min(16, next_pow2(max(n_new, 1)))
    # packed [total, H, D]: a row's rows start at cu_seqlens[b] (no batch stride), token after token
    new_strides, new_b_strides = ((0, *x.stride()[1:2], x.stride(0), x.stride(2)) if packed else x.stride()
                                  for x in (new, new_b))
    mod.append_rows[(max(cdiv(n_new, rows), 1), batch * heads)](
        cache, new, cache_b, new_b, seqlens, after, table, cu_seqlens if packed else seqlens, *cache.stride(),
        *new_strides, *cache_b.stride(), *new_b_strides, stride_tb, n_new, capacity, heads, n_pages, dim,
        new_b.shape[-1], PAIRS=pairs, ROWS=rows, BLOCK_D=next_pow2(max(dim, new_b.shape[-1])), PAGE_SIZE=page_size,
        PACKED=packed, num_warps=4,
        **({} if kv_scales is None else {"SCALE_A": kv_scales.k, "SCALE_B": kv_scales.v,
                                         **dict(zip(("SCALE_A_STRIDE", "SCALE_B_STRIDE"), kv_scales.strides()))}))
    return after


def pool_reps(mod, spec: Spec, x: torch.Tensor, unit: int) -> torch.Tensor:
    """The selector's representatives of a [B, H, N, D] tensor cut into tiles of `unit` rows (q_tile for
    queries, kv_block for keys): float32 [B, H, ceil(N / unit), r, D], r = spec.groups (the `select` role's
    module `mod`)."""
    return _pool(x, unit, spec.groups, -(-x.shape[2] // unit), mod)


def select_from_reps(mod, spec: Spec, cfg: SelectConfig, shapes: Shapes, q_rep: torch.Tensor,
                     k_rep: torch.Tensor, seqlens: torch.Tensor | None = None,
                     leftpad: torch.Tensor | None = None, row_queries: bool = False) -> torch.Tensor:
    """`launch_select` from representatives already pooled (`pool_reps`: float32 [B, Hq, n_q_tiles, r, D] and
    [B, Hkv, n_kv_blocks, r, D], contiguous), as a context-parallel rank has them after gathering the blocks'."""
    block_idx, cand = _select_buffers(spec, cfg.splits, shapes, shapes.n_q_tiles, q_rep.device)
    grid = (cdiv(shapes.n_q_tiles, cfg.tiles), shapes.batch * shapes.heads_kv, cfg.splits)
    kernel, lengths = (mod.select_topk, ()) if seqlens is None else (mod.select_topk_varlen,
                                                                     _row_keys(seqlens, leftpad))
    args, options = _select_args(spec, cfg, shapes, block_idx)
    kernel[grid](q_rep, k_rep, block_idx, cand, *lengths, *args, **options, **_has_leftpad(seqlens, leftpad),
                 **({} if seqlens is None else {"ROW_QUERIES": row_queries}))
    if cfg.splits > 1:
        _merge_topk(mod, spec, cand, block_idx, cfg.splits)
    return block_idx


def launch_decode_select(mod, spec: Spec, cfg: SelectConfig, shapes: Shapes, q: torch.Tensor, k: torch.Tensor,
                         k_rep: torch.Tensor | None = None, *, seqlens: torch.Tensor | None = None,
                         leftpad: torch.Tensor | None = None, row_queries: bool = False,
                         block_table: torch.Tensor | None = None) -> torch.Tensor:
    """`launch_select`'s lists for a call of a few queries (the `decode_select` role's), q pooled and the splits
    merged in the selection's own launch (`decode_select_topk`); a right-padded batch (`row_queries`) pools
    each row's queries over its own tokens first, as `launch_select` does; `block_table`: k is paged. A call of
    more queries (a prefill over a cache of per-row lengths) runs `launch_select`, whose programs take Q tiles."""
    if row_queries or shapes.n_q > DECODE_MAX_QUERIES:
        return launch_select(mod, spec, cfg, shapes, q, k, k_rep, seqlens=seqlens, leftpad=leftpad,
                             row_queries=row_queries, block_table=block_table)
    r = spec.groups
    if k_rep is None:
        k_rep = _pool(k, spec.kv_block, r, shapes.n_kv_blocks, mod, seqlens, leftpad, block_table)
    block_idx, cand = _select_buffers(spec, cfg.splits, shapes, shapes.n_q_tiles, q.device)
    n_bh, tile_groups = shapes.batch * shapes.heads_kv, cdiv(shapes.n_q_tiles, cfg.tiles)
    arrived = block_idx if cfg.splits == 1 else arrival_counts(tile_groups * n_bh, q.device)
    q_rep = empty(cfg.splits, shapes.batch, shapes.heads_q, shapes.n_q_tiles, r, spec.head_dim, device=q.device,
                  dtype=torch.float32)
    args, options = _select_args(spec, cfg, shapes, block_idx)
    mod.decode_select_topk[(tile_groups, n_bh, cfg.splits)](
        q, q_rep, k_rep, block_idx, cand, arrived, *((block_idx, block_idx) if seqlens is None
                                                    else _row_keys(seqlens, leftpad)),
        *q.stride()[:3], *args, **options, VARLEN=seqlens is not None, HAS_LEFTPAD=leftpad is not None)
    return block_idx


def _select_buffers(spec: Spec, splits: int, shapes: Shapes, n_lists: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lists int32 [B, Hkv, n_lists, top_k], the splits' candidates) of a selection (n_lists: Q tiles, or queries
    for per-query lists): with splits > 1 each split scans a share of the blocks (more programs in flight) and
    writes its best keys, which a merge then picks from."""
    block_idx = empty(shapes.batch, shapes.heads_kv, n_lists, spec.top_k, device=device, dtype=torch.int32)
    cand = block_idx if splits == 1 else empty(shapes.batch * shapes.heads_kv * n_lists * splits
                                               * topk_width(spec.top_k), device=device, dtype=torch.int64)
    return block_idx, cand


def _select_args(spec: Spec, cfg: SelectConfig, shapes: Shapes, block_idx) -> tuple[list, dict]:
    """select_topk's arguments after its lengths: (those passed by position, the constexprs and launch
    options)."""
    return ([shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv, *block_idx.stride()[:3]],
            _select_constexprs(spec, cfg))


@functools.lru_cache(maxsize=None)  # read on every selection launch: a spec's and config's, made once
def _select_constexprs(spec: Spec, cfg: SelectConfig) -> dict:
    r = spec.groups
    return dict(HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
                Q_TILE=spec.q_tile, KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, GROUPS=r,
                GR_PAD=next_pow2(spec.gqa_group * r), TOP_K=spec.top_k, TOP_K_PAD=topk_width(spec.top_k),
                SINK=spec.sink, N_LOCAL=spec.n_local, TILES=cfg.tiles, CHUNK=cfg.chunk, SPLITS=cfg.splits,
                CAUSAL=spec.causal, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _merge_topk(mod, spec: Spec, cand: torch.Tensor, block_idx: torch.Tensor, splits: int) -> None:
    """block_idx's lists [B, Hkv, n_lists, top_k] from the `splits` partial top-k of each list in `cand` (a tile's,
    or a query's for per-query lists)."""
    top_k_pad = topk_width(spec.top_k)
    tiles = max(1, min(64, 2048 // (splits * top_k_pad)))  # about 2K candidate keys per program
    mod.merge_topk[(cdiv(block_idx.shape[2], tiles), block_idx.shape[0] * block_idx.shape[1])](
        cand, block_idx, block_idx.shape[2], block_idx.shape[1], *block_idx.stride()[:3], TOP_K=spec.top_k,
        TOP_K_PAD=top_k_pad, SPLITS=splits, TILES=tiles, num_warps=4)


def launch_kv_select(mod, spec: Spec, cfg: KvSelectConfig, shapes: Shapes, q: torch.Tensor, k: torch.Tensor,
                     k_rep: torch.Tensor | None = None, *, seqlens: torch.Tensor | None = None,
                     leftpad: torch.Tensor | None = None, row_queries: bool = False,
                     block_table: torch.Tensor | None = None):
    """Per-query lists int32 [B, Hkv, Nq, top_k] (ids ascending, then -1), chosen on the device; `k_rep`,
    `seqlens`, `leftpad`, `row_queries`, `block_table`: as `launch_select`'s (a right-padded batch's queries
    past its row's tokens get no list written: the caller empties them)."""
    block_idx, cand, k_rep = _kv_select_buffers(mod, spec, cfg, shapes, q, k, k_rep, seqlens, leftpad, block_table)
    kernel, lengths = (mod.kv_select_topk, ()) if seqlens is None else (mod.kv_select_topk_varlen,
                                                                        _row_keys(seqlens, leftpad))
    args, options = _kv_select_args(spec, cfg, shapes, q, block_idx)
    kernel[(cdiv(shapes.n_q, cfg.queries), shapes.batch * shapes.heads_kv, cfg.splits)](
        q, k_rep, block_idx, cand, *lengths, *args, **options, **_has_leftpad(seqlens, leftpad),
        **({} if seqlens is None else {"ROW_QUERIES": row_queries}))
    if cfg.splits > 1:  # a query's candidates merged as select's tiles' are
        _merge_topk(mod, spec, cand, block_idx, cfg.splits)
    return block_idx


def launch_kv_decode_select(mod, spec: Spec, cfg: KvSelectConfig, shapes: Shapes, q: torch.Tensor, k: torch.Tensor,
                            k_rep: torch.Tensor | None = None, *, seqlens: torch.Tensor | None = None,
                            leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None):
    """`launch_kv_select`'s lists for a call of a few queries (the `kv_decode_select` role's), the splits merged
    in the selection's own launch (`kv_decode_select_topk`); `block_table`: k is paged. A call of more queries
    (a prefill over a cache of per-row lengths) runs `launch_kv_select`."""
    if shapes.n_q > DECODE_MAX_QUERIES:
        return launch_kv_select(mod, spec, cfg, shapes, q, k, k_rep, seqlens=seqlens, leftpad=leftpad,
                                block_table=block_table)
    block_idx, cand, k_rep = _kv_select_buffers(mod, spec, cfg, shapes, q, k, k_rep, seqlens, leftpad, block_table)
    groups, n_bh = cdiv(shapes.n_q, cfg.queries), shapes.batch * shapes.heads_kv
    arrived = block_idx if cfg.splits == 1 else arrival_counts(groups * n_bh, q.device)
    args, options = _kv_select_args(spec, cfg, shapes, q, block_idx)
    lengths = (block_idx, block_idx) if seqlens is None else _row_keys(seqlens, leftpad)
    mod.kv_decode_select_topk[(groups, n_bh, cfg.splits)](
        q, k_rep, block_idx, cand, arrived, *lengths, *args, **options, VARLEN=seqlens is not None,
        HAS_LEFTPAD=leftpad is not None)
    return block_idx


def _kv_select_buffers(mod, spec: Spec, cfg: KvSelectConfig, shapes: Shapes, q, k, k_rep, seqlens, leftpad,
                       block_table=None):
    """(lists, the splits' candidates, k's representatives: pooled here where not kept) of a per-query selection."""
    if k_rep is None:
        k_rep = _pool(k, spec.kv_block, spec.groups, shapes.n_kv_blocks, mod, seqlens, leftpad, block_table)
    return (*_select_buffers(spec, cfg.splits, shapes, shapes.n_q, q.device), k_rep)


def _kv_select_args(spec: Spec, cfg: KvSelectConfig, shapes: Shapes, q, block_idx) -> tuple[list, dict]:
    """kv_select_topk's arguments after its lengths: (those passed by position, the constexprs and launch
    options)."""
    return ([*q.stride()[:3], shapes.n_q, shapes.n_k, shapes.n_kv_blocks, shapes.heads_kv, *block_idx.stride()[:3]],
            _kv_select_constexprs(spec, cfg))


@functools.lru_cache(maxsize=None)  # read on every per-query selection launch
def _kv_select_constexprs(spec: Spec, cfg: KvSelectConfig) -> dict:
    return dict(HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
                KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, GROUPS=spec.groups,
                TOP_K=spec.top_k, TOP_K_PAD=topk_width(spec.top_k), SINK=spec.sink, N_LOCAL=spec.n_local,
                QUERIES=cfg.queries, CHUNK=cfg.chunk, SPLITS=cfg.splits, CAUSAL=spec.causal, num_warps=cfg.num_warps)


def launch_kv_attn(mod, spec: Spec, cfg: KvAttnConfig, shapes: Shapes, q, k, v, block_idx,
                   reverse: QueryReverseIndex | None, scale, seqlens: torch.Tensor | None = None,
                   leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                   kv_scales: KVScales | None = None):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised per-query lists: partials per
    task of the reverse index (built here when None), then their merge per (query, head). `seqlens`, `leftpad`
    (the kv_attn_rows role's module): a prefill over a KV cache of per-row lengths, as `launch_attn_rows`'.
    `block_table` (with seqlens; the kv_attn_paged role's module): k and v are pools of pages, as
    `launch_decode`'s (a block whose page lies outside the pool gives an empty partial)."""
    scale = softmax_scale(scale, spec)
    if reverse is None:
        reverse = build_query_reverse_index(block_idx, shapes.n_kv_blocks)
    g_pad = next_pow2(spec.gqa_group)
    queries = cfg.block_m // g_pad  # per step
    n_pairs = shapes.n_q * spec.top_k
    task_block, task_start = reverse.tasks(n_pairs, queries * cfg.steps)
    part_dtype = torch.float32 if cfg.partials_fp32 else q.dtype
    o_part = empty(shapes.batch, shapes.heads_q, shapes.n_q, spec.top_k, spec.head_dim, device=q.device,
                   dtype=part_dtype)
    lse_part = empty(shapes.batch, shapes.heads_q, shapes.n_q, spec.top_k, device=q.device, dtype=torch.float32)
    grid = (max_tasks(shapes.n_kv_blocks, n_pairs, queries * cfg.steps), shapes.batch * shapes.heads_kv)
    # the kernel of the call's cache, and what it takes beyond kv_attn_partial's: the rows' lengths (and pages)
    if block_table is not None:
        partial, row_args, table_stride, n_pages, extra = (mod.kv_attn_paged_partial, (seqlens, block_table),
                                                           (block_table.stride(0),), (k.shape[0],),
                                                           {"PAGE_SIZE": k.shape[2]})
    elif seqlens is not None:
        partial, row_args, table_stride, n_pages, extra = (mod.kv_attn_rows_partial, _row_keys(seqlens, leftpad),
                                                           (), (), _has_leftpad(seqlens, leftpad))
    else:
        partial, row_args, table_stride, n_pages, extra = mod.kv_attn_partial, (), (), (), {}
    partial[grid](
        q, k, v, o_part, lse_part, reverse.offsets, reverse.queries, reverse.slots, task_block, task_start, *row_args,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_part.stride()[:4], *lse_part.stride()[:3],
        *reverse.offsets.stride()[:2], *reverse.queries.stride()[:2], *task_block.stride()[:2], *table_stride,
        shapes.n_q, shapes.n_k, *n_pages, shapes.heads_kv, scale * LOG2E,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, GROUP_PAD=g_pad, QUERIES=queries,
        STEPS=cfg.steps, CAUSAL=spec.causal, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        **_scale_args(kv_scales))
    return combine_partials(mod, spec, cfg, shapes, o_part, lse_part, block_idx, q.dtype)


def launch_kv_attn_union(mod, spec: Spec, cfg: KvUnionConfig, shapes: Shapes, q, k, v, block_idx,
                         union: TileUnion | TileUnions | None, scale):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised per-query lists, a program per
    (tile of cfg.tile_q queries, head split) over the tile's union (`union_for`: built here when None or made
    for another tile_q)."""
    scale = softmax_scale(scale, spec)
    union = union_for(union, block_idx, cfg.tile_q, shapes.n_kv_blocks)
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    n_tiles, length = union.lists.shape[2:]
    splits = spec.gqa_group * cfg.tile_q // cfg.block_m
    use_tma, k_arg, v_arg = _kv_block_descriptors(spec, cfg.use_tma, k, v)
    mod.kv_attn_union[(n_tiles * splits, shapes.batch * shapes.heads_kv)](
        q, k_arg, v_arg, o, lse, union.lists, union.member,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        *union.lists.stride()[:3], *union.member.stride()[:3],
        shapes.n_q, shapes.n_k, n_tiles, shapes.heads_kv, scale * LOG2E,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec), KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, TILE_Q=cfg.tile_q,
        UNION_PAD=next_pow2(length), UNION_LEN=length, BLOCK_M=cfg.block_m, USE_TMA=use_tma, CAUSAL=spec.causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def launch_kv_bwd_union(mod, spec: Spec, cfg: KvUnionBwdConfig, shapes: Shapes, q, k, v, do, lse, delta,
                        block_idx, union: TileUnion | TileUnions | None, scale):
    """(dq, dk, dv) of the union design over normalised per-query lists: dQ per tile over its union, dK/dV per
    KV block over the tiles whose union holds it (`union`: the forward's, whatever its tile_q; else
    `union_for` cfg.tile_q)."""
    scale = softmax_scale(scale, spec)
    if not isinstance(union, TileUnion):
        union = union_for(union, block_idx, cfg.tile_q, shapes.n_kv_blocks)
    dq_rows, rows = union_rows(spec, union.tile_q, cfg.dq_block_m), union_rows(spec, union.tile_q, cfg.block_m)
    if dq_rows is None or rows is None:
        raise KernelgenValueError(f"no rows of 16 or more pack tiles of {union.tile_q} queries of gqa_group="
                                  f"{spec.gqa_group} heads; prepare the lists for another kv_attn_union tile_q")
    dq = empty(*q.shape, device=q.device, dtype=q.dtype)
    dk = empty(*k.shape, device=k.device, dtype=k.dtype)
    dv = empty(*v.shape, device=v.device, dtype=v.dtype)
    n_tiles, length = union.lists.shape[2:]
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
              *delta.stride()[:2])
    dq_tma, k_arg, v_arg = _kv_block_descriptors(spec, cfg.dq_use_tma, k, v)
    mod.union_bwd_dq[(n_tiles * (spec.gqa_group * union.tile_q // dq_rows), shapes.batch * shapes.heads_kv)](
        q, k_arg, v_arg, do, lse, delta, dq, union.lists, union.member, *common, *dq.stride()[:3],
        *union.lists.stride()[:3], *union.member.stride()[:3],
        shapes.n_q, shapes.n_k, n_tiles, shapes.heads_kv, scale * LOG2E, scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, TILE_Q=union.tile_q,
        UNION_PAD=next_pow2(length), UNION_LEN=length, BLOCK_M=dq_rows, DQ_TMA=dq_tma, CAUSAL=spec.causal,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
    reverse, order = union.reverse_index()
    # a step's rows: heads x consecutive queries of [B, Hq, Nq, D]
    use_tma, q_arg, do_arg = _descriptors(
        cfg.use_tma, [1, max(1, rows // union.tile_q), min(rows, union.tile_q), spec.head_dim], q, do)
    mod.union_bwd_dkdv[(order.numel() * (spec.kv_block // cfg.block_n),)](
        q_arg, k, v, do_arg, lse, delta, dk, dv, union.member, reverse.offsets, reverse.queries, reverse.slots, order,
        *common, *dk.stride()[:3], *dv.stride()[:3], *union.member.stride()[:3], *reverse.offsets.stride()[:2],
        *reverse.queries.stride()[:2],
        shapes.n_q, shapes.n_k, shapes.heads_kv, shapes.n_kv_blocks, scale * LOG2E, scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        KV_BLOCK=spec.kv_block, TILE_Q=union.tile_q, GROUP=spec.gqa_group,
        BLOCK_N=cfg.block_n, BLOCK_M=rows, USE_TMA=use_tma, CAUSAL=spec.causal, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq, dk, dv


def combine_partials(mod, spec: Spec, cfg: KvAttnConfig, shapes: Shapes, o_part, lse_part, used, dtype):
    """(o [B, Hq, Nq, D] in `dtype`, lse float32 [B, Hq, Nq]): each row's spec.top_k partials (o_part [B, Hq, Nq,
    top_k, D], lse_part [B, Hq, Nq, top_k], any strides) merged through their lse in slot order, the slots
    whose `used[b, h // G, n, slot]` is >= 0 only (`used` and `lse_part` at unit stride over slots; the `kv_attn`
    role's module `mod`)."""
    o = empty(*o_part.shape[:3], spec.head_dim, device=o_part.device, dtype=dtype)
    lse = empty(*o_part.shape[:3], device=o_part.device, dtype=torch.float32)
    mod.kv_combine[(cdiv(shapes.n_q, cfg.combine_rows), shapes.batch * shapes.heads_q)](
        o_part, lse_part, used, o, lse, *o_part.stride()[:4], *lse_part.stride()[:3], *used.stride()[:3],
        *o.stride()[:3], *lse.stride()[:2], shapes.n_q, shapes.heads_q,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        GROUP=spec.gqa_group, TOP_K=spec.top_k, ROWS=cfg.combine_rows, num_warps=4)
    return o, lse


_ARRIVALS: dict = {}


def arrival_counts(n: int, device) -> torch.Tensor:
    """int32 zeros [>= n] on `device` for the kernels whose last program of a group merges the group's work
    (it counts the group's programs in, then zeroes the count: the counts are zero again after every launch).
    They are kept and reused (no fill launch per call) where that is safe: on the CPU, and on a GPU's default
    stream, whose launches run one after another. Elsewhere they are made afresh and not kept: another stream's
    launch could run beside one that holds them, and torch.compile's CUDA graphs warm up and capture on a side
    stream, with allocations routed to the graphs' memory pool, which must own nothing that outlives a call
    (cudagraph trees check, and refuse to run)."""
    key = device if isinstance(device, torch.device) else torch.device(device)
    counts = _ARRIVALS.get(key)
    if counts is not None and counts.numel() >= n and (not counts.is_cuda or on_default_stream(counts.device)):
        return counts
    counts = torch.zeros(max(n, 256), device=device, dtype=torch.int32)
    if not counts.is_cuda or on_default_stream(counts.device):
        _ARRIVALS[key] = counts
    return counts


def launch_decode(mod, spec: Spec, cfg: DecodeConfig, shapes: Shapes, q, k, v, block_idx, scale, *,
                  seqlens: torch.Tensor | None = None, leftpad: torch.Tensor | None = None,
                  block_table: torch.Tensor | None = None, kv_scales: KVScales | None = None):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised lists (Q-centric or per-query:
    the spec says which) of a call of a few queries: a partial per (query group, split), merged, with
    splits > 1, by the group's last program in split order (`arrival_counts`). `seqlens`, `leftpad` (int32 [B]):
    batch row b holds k's keys [leftpad[b], seqlens[b]) (leftpad None: from 0), its queries the last positions
    of those. `block_table` (int32 [B, pages a row]): k and v are pools of pages [n_pages, Hkv, page_size, D].
    `block_idx` None (a selecting window spec's): each row's window lists are computed in the kernel, as
    `launch_window_lists` makes them, not read."""
    scale = softmax_scale(scale, spec)
    window_lists = block_idx is None
    if window_lists and spec.window is None:
        raise KernelgenValueError("decode without block_idx computes a window spec's lists: spec.window is None")
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    groups = cdiv(shapes.n_q, decode_queries(spec))
    if cfg.splits == 1:  # the partial is the output: nothing to merge
        o_part, lse_part, split_strides, arrived = o, lse, (0,), lse
    else:
        o_part = empty(shapes.batch, shapes.heads_q, shapes.n_q, cfg.splits, spec.head_dim, device=q.device,
                       dtype=torch.float32)
        lse_part = empty(shapes.batch, shapes.heads_q, shapes.n_q, cfg.splits, device=q.device, dtype=torch.float32)
        split_strides = (o_part.stride(3),)
        arrived = arrival_counts(groups * shapes.batch * shapes.heads_kv, q.device)
    paged = block_table is not None
    lists, list_strides = (lse, (0, 0, 0)) if window_lists else (block_idx, block_idx.stride()[:3])  # lse: not read
    mod.decode_partial[(groups * cfg.splits, shapes.batch * shapes.heads_kv)](
        q, k, v, o_part, lse_part, o, lse, arrived, lists,
        *((lists, lists) if seqlens is None else _row_keys(seqlens, leftpad)),
        block_table if paged else lists,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_part.stride()[:3], *split_strides,
        *lse_part.stride()[:3], *list_strides, *o.stride()[:3], *lse.stride()[:2],
        block_table.stride(0) if paged else 0, k.shape[0] if paged else 0,
        shapes.n_q, shapes.n_k, shapes.n_kv_blocks, shapes.heads_kv, qk_scale(spec, scale),
        **_decode_constexprs(spec, cfg),
        VARLEN=seqlens is not None, HAS_LEFTPAD=leftpad is not None, PAGED=paged,
        PAGE_SIZE=k.shape[2] if paged else spec.kv_block, WINDOW_LISTS=window_lists, **_scale_args(kv_scales))
    return o, lse


def qk_scale(spec: Spec, scale: float) -> float:
    """The Q-centric kernels' qk_scale: scale * log2(e), their scores in the log2 domain; with Spec.softcap,
    scale / softcap, tanh's argument (the kernels scale the capped score themselves: softcap.py.j2)."""
    return scale * LOG2E if spec.softcap is None else scale / spec.softcap


@functools.lru_cache(maxsize=None)  # read on every decode launch: a spec's and config's, made once
def _decode_constexprs(spec: Spec, cfg: DecodeConfig) -> dict:
    return dict(HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
                KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, G_PAD=next_pow2(spec.gqa_group),
                ROWS=decode_rows(spec), QUERIES=decode_queries(spec), LIST_QUERIES=spec.list_queries,
                TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), SPLITS=cfg.splits, CAUSAL=spec.causal,
                WINDOW=spec.window or 0, SOFTCAP=spec.softcap or 0.0, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def launch_attn_paged(mod, spec: Spec, cfg: AttnConfig, shapes: Shapes, q, k, v, block_idx, scale,
                      seqlens: torch.Tensor, block_table: torch.Tensor, kv_scales: KVScales | None = None):
    """`launch_attn_rows`' (o, lse) of a prefill chunk over a paged KV cache: k and v are pools of pages
    [n_pages, Hkv, page_size, D], row b's key p in page block_table[b, p // page_size] (`attn_paged_fwd`: the
    forward's loop over the pool's blocks where no mask is needed, a block at a time in its page where one is)."""
    spec, shapes, block_idx = _stepped(spec, shapes, block_idx)
    scale = softmax_scale(scale, spec)
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    row_idx = empty(*block_idx.shape, device=q.device, dtype=torch.int32)
    pool_idx = empty(*block_idx.shape, device=q.device, dtype=torch.int32)
    n_pages, _, page_size, _ = k.shape
    # pages of whole blocks: BLOCKS_A_PAGE of them; else 0, each key read from its page
    blocks_a_page = page_size // spec.kv_block if page_size % spec.kv_block == 0 else 0
    ratio = pool_ratio(spec, k, v) if blocks_a_page else 0
    constexprs = _attn_constexprs(spec, cfg)
    mod.paged_lists[(shapes.n_q_tiles, shapes.batch * shapes.heads_kv)](
        block_idx, block_table, seqlens, row_idx, pool_idx, *block_idx.stride()[:3], *row_idx.stride()[:3],
        block_table.stride(0), shapes.n_k, n_pages, shapes.heads_kv, ratio, KV_BLOCK=spec.kv_block, TOP_K=spec.top_k,
        TOP_K_PAD=constexprs["TOP_K_PAD"], BLOCKS_A_PAGE=blocks_a_page)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    mod.attn_paged_fwd[(shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)](
        q, k, v, o, lse, row_idx, pool_idx, seqlens, block_table,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2], *row_idx.stride()[:3],
        block_table.stride(0), shapes.n_q, shapes.n_k, n_pages, shapes.heads_kv, n_pages * ratio, qk_scale(spec, scale),
        BLOCKS_A_PAGE=blocks_a_page, **constexprs, **_scale_args(kv_scales),
        **({} if blocks_a_page else {"PAGE_SIZE": page_size}))
    return o, lse


def _scale_args(kv_scales: KVScales | None) -> dict:
    """The attention kernels' K_SCALE and V_SCALE (an fp8 cache's scales; none without: the kernels' None) and
    their strides over (batch row, KV head) (0: one scale for all)."""
    if kv_scales is None:
        return {}
    k_stride, v_stride = kv_scales.strides()
    return {"K_SCALE": kv_scales.k, "V_SCALE": kv_scales.v, "K_SCALE_STRIDE": k_stride, "V_SCALE_STRIDE": v_stride}


def pool_ratio(spec: Spec, k: torch.Tensor, v: torch.Tensor) -> int:
    """Blocks of kv_block rows (of stride k.stride(2)) from one page's start to the next's in k and in v, where
    both pools have the same whole number and their blocks' key offsets fit in int32: `attn_paged_fwd` then
    walks the pool as one row of blocks; else 0 (every block is loaded from its page on its own)."""
    ratios = set()
    for pool in (k, v):
        rows = spec.kv_block * pool.stride(2)
        ratios.add(pool.stride(0) // rows if rows > 0 and pool.stride(0) % rows == 0 else 0)
    ratio = ratios.pop() if len(ratios) == 1 else 0
    return ratio if k.shape[0] * ratio * spec.kv_block < 2 ** 31 else 0


def _index_pages(k_idx: torch.Tensor, seqlens: torch.Tensor | None, leftpad: torch.Tensor | None,
                 block_table: torch.Tensor | None) -> tuple[tuple, tuple, int]:
    """The index selector's arguments of a call's rows, before its counts and after them, and PAGE_SIZE: none for
    a call of one length (TABLE unread); over a cache's rows SEQLENS, LEFTPAD, TABLE and n_pages, stride_tb; over a
    paged one, k_idx a pool of pages [n_pages, Hkv or 1, page_size, Di] (its page stride in the batch stride's
    place) read through `block_table`."""
    if seqlens is None:
        return (None,), (0,), 0
    if block_table is None:
        return (*_row_keys(seqlens, leftpad), None), (0, 0), 0
    return (*_row_keys(seqlens, leftpad), block_table), (k_idx.shape[0], block_table.stride(0)), k_idx.shape[2]


def launch_select_index(mod, spec: Spec, cfg: IndexSelectConfig, shapes: Shapes, q_idx: torch.Tensor,
                        k_idx: torch.Tensor, w: torch.Tensor, seqlens: torch.Tensor | None = None,
                        leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Block lists int32 [B, Hkv, n_q_tiles, top_k] (ids ascending, then -1) chosen by the index selector from
    checked index tensors (`inputs.check_index`): q_idx [B, Hkv*Hi, Nq, Di], k_idx [B, Hkv or 1, Nk, Di],
    w [B, Hkv*Hi, Nq]. `seqlens`, `leftpad`: k_idx is a cache whose row b holds keys [leftpad[b], seqlens[b])
    (the `decode_select_index` role's module), each row's lists its own call's; with `block_table`, k_idx is a
    pool of pages [n_pages, Hkv or 1, page_size, Di] (`inputs.check_index`'s paged form) that the table reads."""
    index_heads = q_idx.shape[1] // shapes.heads_kv
    heads_step = min(next_pow2(index_heads), cfg.rows)  # as many heads per product as the rows hold
    q_rows = min(cfg.rows // heads_step, spec.q_tile)
    top_k_pad = topk_width(spec.top_k)
    block_idx = empty(shapes.batch, shapes.heads_kv, shapes.n_q_tiles, spec.top_k, device=q_idx.device,
                      dtype=torch.int32)
    stride_kh = 0 if k_idx.shape[1] == 1 else k_idx.stride(1)  # one key head shared by every KV head
    lead, counts, page_size = _index_pages(k_idx, seqlens, leftpad, block_table)
    kernel = mod.select_index_topk if seqlens is None else mod.select_index_topk_rows
    n_bh = shapes.batch * shapes.heads_kv
    cand = block_idx if cfg.splits == 1 else empty(n_bh * shapes.n_q_tiles * cfg.splits * top_k_pad,
                                                   device=q_idx.device, dtype=torch.int64)
    kernel[(shapes.n_q_tiles, n_bh, cfg.splits)](
        q_idx, k_idx, w, block_idx, cand, *lead, shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks,
        shapes.heads_kv, index_heads, *counts, *q_idx.stride()[:3], k_idx.stride(0), stride_kh, k_idx.stride(2),
        *w.stride()[:2], *block_idx.stride()[:3],
        INDEX_DIM=q_idx.shape[3], Q_TILE=spec.q_tile, KV_BLOCK=spec.kv_block, TOP_K=spec.top_k,
        TOP_K_PAD=top_k_pad, SINK=spec.sink, N_LOCAL=spec.n_local, HEADS_STEP=heads_step, Q_ROWS=q_rows,
        CHUNK=cfg.chunk, WIDTH=max(cfg.chunk, top_k_pad), CAUSAL=spec.causal, SPLITS=cfg.splits,
        PAGE_SIZE=page_size, **_has_leftpad(seqlens, leftpad), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.splits > 1:
        _merge_topk(mod, spec, cand, block_idx, cfg.splits)
    return block_idx


KV_INDEX_SCORES_BYTES = 1 << 28  # the index selector's block-score scratch at most (queries taken in chunks)


@functools.lru_cache(maxsize=256)
def _index_vectors_fit(spec: Spec, cfg: KvIndexSelectConfig, arch: str, elem_bytes: int, index_heads: int,
                       index_dim: int) -> bool:
    """Whether a block-scores program holding its queries' index vectors (`hold`) fits the arch's shared
    memory at a call's Hi and Di (once per call shape, off the launch path)."""
    return kv_index_select_smem_bytes(spec, cfg, arch, elem_bytes, index_heads, index_dim) <= \
        arch_facts(arch).smem_per_block


def launch_kv_select_index(mod, spec: Spec, cfg: KvIndexSelectConfig, shapes: Shapes, q_idx: torch.Tensor,
                           k_idx: torch.Tensor, w: torch.Tensor, seqlens: torch.Tensor | None = None,
                           leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Per-query lists int32 [B, Hkv, Nq, top_k] (ids ascending, then -1) chosen by the index selector from
    checked index tensors (`inputs.check_index`), as `launch_select_index`'s: block scores into a scratch of
    at most KV_INDEX_SCORES_BYTES, a chunk of queries at a time, then each chunk's top-k. `seqlens`,
    `leftpad`, `block_table`: as `launch_select_index`'s (the `kv_decode_select_index` role's module)."""
    index_heads = q_idx.shape[1] // shapes.heads_kv
    hold = cfg.hold and _index_vectors_fit(spec, cfg, device_arch(q_idx.device), q_idx.element_size(), index_heads,
                                           q_idx.shape[3])
    n_blocks, bh = shapes.n_kv_blocks, shapes.batch * shapes.heads_kv
    block_idx = empty(shapes.batch, shapes.heads_kv, shapes.n_q, spec.top_k, device=q_idx.device, dtype=torch.int32)
    stride_kh = 0 if k_idx.shape[1] == 1 else k_idx.stride(1)  # one key head shared by every KV head
    step = max(cfg.queries, cfg.rows)
    chunk_q = min(cdiv(shapes.n_q, step), max(1, KV_INDEX_SCORES_BYTES // (4 * bh * n_blocks * step))) * step
    scores = torch.empty(bh, chunk_q, n_blocks, device=q_idx.device, dtype=torch.float32)
    row_options = _has_leftpad(seqlens, leftpad)
    lead, counts, page_size = _index_pages(k_idx, seqlens, leftpad, block_table)
    lengths = lead[:-1]  # the top-k reads the rows' lengths, no key
    scores_kernel, topk_kernel = ((mod.kv_index_block_scores, mod.kv_index_topk) if seqlens is None else
                                  (mod.kv_index_block_scores_rows, mod.kv_index_topk_rows))
    for q0 in range(0, shapes.n_q, chunk_q):
        n_chunk = min(chunk_q, shapes.n_q - q0)
        scores_kernel[(cdiv(n_chunk, cfg.queries), bh, cdiv(n_blocks, cfg.span))](
            q_idx, k_idx, w, scores, *lead, q0, shapes.n_q, shapes.n_k, n_blocks, shapes.heads_kv, index_heads,
            *counts, *q_idx.stride()[:3], k_idx.stride(0), stride_kh, k_idx.stride(2), *w.stride()[:2],
            *scores.stride()[:2], INDEX_DIM=q_idx.shape[3], KV_BLOCK=spec.kv_block, QUERIES=cfg.queries,
            HEADS_STEP=min(cfg.heads, next_pow2(index_heads)), CHUNK=cfg.chunk, SPAN=cfg.span, CAUSAL=spec.causal,
            HOLD=hold, INDEX_HEADS=index_heads if hold else 1, PAGE_SIZE=page_size, **row_options,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        topk_kernel[(cdiv(n_chunk, cfg.rows), bh)](
            scores, block_idx, *lengths, q0, shapes.n_q, shapes.n_k, n_blocks, shapes.heads_kv, *scores.stride()[:2],
            *block_idx.stride()[:3], KV_BLOCK=spec.kv_block, TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k),
            SINK=spec.sink, N_LOCAL=spec.n_local, ROWS=cfg.rows, WIDTH=kv_index_select_width(spec, cfg),
            CAUSAL=spec.causal, **row_options, num_warps=4)
    return block_idx


def _tma_ok(x: torch.Tensor) -> bool:
    """Tensor descriptors need a 16-byte aligned base and 16-byte aligned strides (but the last, 1)."""
    size = x.element_size()
    return x.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in x.stride()[:-1])


def _descriptors(use_tma: bool, box: list[int], *tensors):
    """(use_tma, *tensors as tensor descriptors of `box`) where asked and every tensor allows, else (False,
    *tensors): the pointer path, the same result. A box of a head dim that is no power of two is no tile the kernels
    load (their tiles pad D to one): pointers too."""
    if not (use_tma and box[-1] == next_pow2(box[-1]) and all(_tma_ok(x) for x in tensors)):
        return (False, *tensors)
    return (True, *(TensorDescriptor(x, list(x.shape), list(x.stride()), box) for x in tensors))


def _kv_block_descriptors(spec: Spec, use_tma: bool, k, v):
    """(use_tma, K, V) for a kernel that loads whole KV blocks: [B, Hkv, Nk, D] descriptors of one block."""
    return _descriptors(use_tma, [1, 1, spec.kv_block, spec.head_dim], k, v)


def launch_attn(mod, spec: Spec, cfg: AttnConfig, shapes: Shapes, q, k, v, block_idx, scale):
    """o (q's shape and dtype) and lse (float32 [B, Hq, Nq]) over normalised lists."""
    spec, shapes, block_idx = _stepped(spec, shapes, block_idx)
    scale = softmax_scale(scale, spec)
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    grid = (shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)
    use_tma, k_arg, v_arg = _kv_block_descriptors(spec, cfg.use_tma, k, v)
    mod.attn_fwd[grid](
        q, k_arg, v_arg, o, lse, block_idx,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2], *block_idx.stride()[:3],
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv, qk_scale(spec, scale),
        USE_TMA=use_tma, **_attn_constexprs(spec, cfg))
    return o, lse


@functools.lru_cache(maxsize=None)  # read on every forward launch: a spec's and config's, made once
def _attn_constexprs(spec: Spec, cfg: AttnConfig) -> dict:
    """The Q-centric forward's constexprs and launch options but USE_TMA (attn_fwd's, attn_rows_fwd's and
    attn_paged_fwd's)."""
    return dict(HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
                KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group,
                TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), BLOCK_M=cfg.block_m, KV_PER_ITER=cfg.kv_per_iter,
                CAUSAL=spec.causal, WINDOW=spec.window or 0, SOFTCAP=spec.softcap or 0.0, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def launch_attn_rows(mod, spec: Spec, cfg: AttnConfig, shapes: Shapes, q, k, v, block_idx, scale,
                     seqlens: torch.Tensor, leftpad: torch.Tensor | None = None, kv_scales: KVScales | None = None):
    """`launch_attn`'s (o, lse) of a prefill over a KV cache of per-row lengths: batch row b holds k's keys
    [leftpad[b], seqlens[b]) (int32 [B]; leftpad None: from 0), its Nq queries the last positions of those, its
    lists over its own blocks (`attn_rows_fwd`: the forward's kernel per row, through pointers). `kv_scales`: k and
    v are an fp8 cache of these scales."""
    spec, shapes, block_idx = _stepped(spec, shapes, block_idx)
    scale = softmax_scale(scale, spec)
    o = empty(*q.shape, device=q.device, dtype=q.dtype)
    lse = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=q.device, dtype=torch.float32)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    mod.attn_rows_fwd[(shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)](
        q, k, v, o, lse, block_idx, *_row_keys(seqlens, leftpad),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2], *block_idx.stride()[:3],
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.heads_kv, qk_scale(spec, scale),
        HAS_LEFTPAD=leftpad is not None, **_attn_constexprs(spec, cfg), **_scale_args(kv_scales))
    return o, lse


def launch_bwd_delta(mod, spec: Spec, config, shapes: Shapes, o, do):
    """delta = rowsum(dO * O), float32 [B, Hq, Nq]."""
    delta = empty(shapes.batch, shapes.heads_q, shapes.n_q, device=o.device, dtype=torch.float32)
    rows = 64
    mod.attn_bwd_delta[(cdiv(shapes.n_q, rows), shapes.batch * shapes.heads_q)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], *delta.stride()[:2], shapes.n_q, shapes.heads_q,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec), ROWS=rows, num_warps=4)
    return delta


def launch_bwd_dq(mod, spec: Spec, cfg: BwdDqConfig, shapes: Shapes, q, k, v, do, lse, delta, block_idx, scale):
    """dq (q's shape and dtype) over normalised lists, from the forward's lse and the preprocess's delta."""
    scale = softmax_scale(scale, spec)
    dq = empty(*q.shape, device=q.device, dtype=q.dtype)
    splits = spec.gqa_group * spec.q_tile // cfg.block_m
    use_tma, k_arg, v_arg = _kv_block_descriptors(spec, cfg.use_tma, k, v)
    mod.attn_bwd_dq[(shapes.n_q_tiles * splits, shapes.batch * shapes.heads_kv)](
        q, k_arg, v_arg, do, lse, delta, dq, block_idx,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2], *delta.stride()[:2],
        *dq.stride()[:3], *block_idx.stride()[:3],
        shapes.n_q, shapes.n_k, shapes.n_q_tiles, shapes.n_kv_blocks, shapes.heads_kv, qk_scale(spec, scale), scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec), KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group,
        TOP_K=spec.top_k, TOP_K_PAD=next_pow2(spec.top_k), BLOCK_M=cfg.block_m, USE_TMA=use_tma,
        CAUSAL=spec.causal, WINDOW=spec.window or 0, SOFTCAP=spec.softcap or 0.0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq


def launch_bwd_dkdv(mod, spec: Spec, cfg: BwdDkdvConfig, shapes: Shapes, q, k, v, do, lse, delta,
                    reverse: ReverseIndex, scale):
    """(dk, dv) (k's shape and dtype): one program per block_n keys of a KV block, over the Q tiles the reverse
    index says list it, the blocks listed most launched first (`reverse.order`)."""
    scale = softmax_scale(scale, spec)
    dk = empty(*k.shape, device=k.device, dtype=k.dtype)
    dv = empty(*v.shape, device=v.device, dtype=v.dtype)
    grid = (reverse.order.numel() * (spec.kv_block // cfg.block_n),)
    mod.attn_bwd_dkdv[grid](
        q, k, v, do, lse, delta, dk, dv, reverse.offsets, reverse.tiles, reverse.order,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2], *delta.stride()[:2],
        *dk.stride()[:3], *dv.stride()[:3], *reverse.offsets.stride()[:2], *reverse.tiles.stride()[:2],
        shapes.n_q, shapes.n_k, shapes.heads_kv, shapes.n_kv_blocks, qk_scale(spec, scale), scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec), KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, CAUSAL=spec.causal, WINDOW=spec.window or 0,
        SOFTCAP=spec.softcap or 0.0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dk, dv


def launch_kv_bwd(mod, spec: Spec, cfg: KvBwdConfig, shapes: Shapes, q, k, v, do, lse, delta,
                  block_idx, reverse: QueryReverseIndex, scale):
    """(dq, dk, dv) (q's, k's and v's shapes and dtypes) over normalised per-query lists: dK, dV and the dQ
    partials per KV block, over the (query, slot) pairs of the query reverse index; then dQ's merge."""
    scale = softmax_scale(scale, spec)
    parts = spec.kv_block // cfg.block_n
    dk = empty(*k.shape, device=k.device, dtype=k.dtype)
    dv = empty(*v.shape, device=v.device, dtype=v.dtype)
    dq_part = empty(shapes.batch, shapes.heads_q, shapes.n_q, spec.top_k * parts, spec.head_dim, device=q.device,
                    dtype=torch.float32 if cfg.dq_partials_fp32 else q.dtype)
    mod.kv_bwd_dkdv[(shapes.n_kv_blocks * parts, shapes.batch * shapes.heads_kv)](
        q, k, v, do, lse, delta, dk, dv, dq_part, reverse.offsets, reverse.queries, reverse.slots,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2], *delta.stride()[:2],
        *dk.stride()[:3], *dv.stride()[:3], *reverse.offsets.stride()[:2], *reverse.queries.stride()[:2],
        *dq_part.stride()[:4], shapes.n_q, shapes.n_k, shapes.heads_kv, scale * LOG2E, scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        KV_BLOCK=spec.kv_block, GROUP=spec.gqa_group, GROUP_PAD=next_pow2(spec.gqa_group),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, CAUSAL=spec.causal, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    dq = empty(*q.shape, device=q.device, dtype=q.dtype)
    mod.kv_bwd_dq_merge[(cdiv(shapes.n_q, cfg.merge_rows), shapes.batch * shapes.heads_q)](
        dq_part, block_idx, dq, *dq_part.stride()[:4], *block_idx.stride()[:3], *dq.stride()[:3],
        shapes.n_q, shapes.heads_q, scale,
        HEAD_DIM=spec.head_dim, BLOCK_D=_tile_d(spec),
        GROUP=spec.gqa_group, TOP_K=spec.top_k, PARTS=parts, ROWS=cfg.merge_rows,
        num_warps=4)
    return dq, dk, dv


# ---- the backend ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def rendered_module(backend: str, role: str, template: str, spec: Spec, config):
    """The module rendered from `template` for (spec, config), imported from the content-addressed cache, its
    kernels launched directly once compiled (`TritonModule`). Rendering (jinja2) is imported here: an exported
    module embeds this file without it."""
    from ..codegen.cache import load_module
    from ..codegen.render import module_name, render
    from ..device import interpret_triton_language

    source = render(template, spec, config)
    interpret_triton_language()  # before the kernel's first call, whatever imported triton first
    return TritonModule(load_module(module_name(backend, role, source), source))


class TritonBackend(Backend):
    name = "triton"
    summary = "Triton kernels for every role; any CUDA GPU Triton supports, and the CPU through its interpreter"
    devices = ("cuda", "cpu")
    compilers = {"triton_version": ("triton", "pytorch-triton")}
    schedules = ("q_centric", "kv_centric")
    windows = True  # the Q-centric forward, its calls over caches (decode, attn_rows, attn_paged) and backward
    softcaps = True  # the same kernels
    roles = {
        "lists": RoleImpl(launch=launch_lists, template="triton/lists.py.j2"),
        "window_lists": RoleImpl(launch=launch_window_lists, template="triton/window_lists.py.j2", varlen=True,
                                 paged=True),
        "key_reps": RoleImpl(launch=launch_key_reps, template="triton/key_reps.py.j2", varlen=True, paged=True),
        "append_kv": RoleImpl(launch=launch_append_kv, template="triton/append_kv.py.j2", varlen=True, paged=True,
                              fp8_kv=True),
        "select": RoleImpl(launch=launch_select, template="triton/select.py.j2", config_type=SelectConfig,
                           default=select_default, space=select_space, infeasible=select_infeasible),
        "decode_select": RoleImpl(launch=launch_decode_select, template="triton/decode_select.py.j2",
                                  config_type=SelectConfig, default=decode_select_default, space=decode_select_space,
                                  infeasible=decode_select_infeasible, varlen=True, paged=True),
        "select_index": RoleImpl(launch=launch_select_index, template="triton/select_index.py.j2",
                                 config_type=IndexSelectConfig, default=index_select_default,
                                 space=index_select_space, infeasible=index_select_infeasible),
        "decode_select_index": RoleImpl(launch=launch_select_index, template="triton/decode_select_index.py.j2",
                                        config_type=IndexSelectConfig, default=decode_index_select_default,
                                        space=decode_index_select_space, infeasible=index_select_infeasible,
                                        varlen=True, paged=True),
        "attn": RoleImpl(launch=launch_attn, template="triton/attn.py.j2", config_type=AttnConfig,
                         default=attn_default, space=attn_space, infeasible=attn_infeasible),
        "attn_rows": RoleImpl(launch=launch_attn_rows, template="triton/attn_rows.py.j2", config_type=AttnConfig,
                              default=attn_rows_default, space=attn_rows_space, infeasible=attn_rows_infeasible,
                              varlen=True, fp8_kv=True),
        "bwd_delta": RoleImpl(launch=launch_bwd_delta, template="triton/bwd_delta.py.j2"),
        "bwd_dq": RoleImpl(launch=launch_bwd_dq, template="triton/bwd_dq.py.j2", config_type=BwdDqConfig,
                           default=bwd_dq_default, space=bwd_dq_space, infeasible=bwd_dq_infeasible),
        "bwd_dkdv": RoleImpl(launch=launch_bwd_dkdv, template="triton/bwd_dkdv.py.j2", config_type=BwdDkdvConfig,
                             default=bwd_dkdv_default, space=bwd_dkdv_space, infeasible=bwd_dkdv_infeasible),
        # the KV-centric schedule's forward (per-query lists; the "lists" role normalises them too)
        "kv_select": RoleImpl(launch=launch_kv_select, template="triton/kv_select.py.j2", config_type=KvSelectConfig,
                              default=kv_select_default, space=kv_select_space, infeasible=kv_select_infeasible,
                              varlen=True),
        "kv_decode_select": RoleImpl(launch=launch_kv_decode_select, template="triton/kv_decode_select.py.j2",
                                     config_type=KvSelectConfig, default=kv_decode_select_default,
                                     space=kv_decode_select_space, infeasible=kv_decode_select_infeasible,
                                     varlen=True, paged=True),
        "kv_select_index": RoleImpl(launch=launch_kv_select_index, template="triton/kv_select_index.py.j2",
                                    config_type=KvIndexSelectConfig, default=kv_index_select_default,
                                    space=kv_index_select_space, infeasible=kv_index_select_infeasible),
        "kv_decode_select_index": RoleImpl(launch=launch_kv_select_index,
                                         template="triton/kv_decode_select_index.py.j2",
                                         config_type=KvIndexSelectConfig, default=kv_decode_index_select_default,
                                         space=kv_decode_index_select_space, infeasible=kv_index_select_infeasible,
                                         varlen=True, paged=True),
        "kv_attn": RoleImpl(launch=launch_kv_attn, template="triton/kv_attn.py.j2", config_type=KvAttnConfig,
                            default=kv_attn_default, space=kv_attn_space, infeasible=kv_attn_infeasible),
        "kv_attn_rows": RoleImpl(launch=launch_kv_attn, template="triton/kv_attn_rows.py.j2", config_type=KvAttnConfig,
                                 default=kv_attn_default, space=kv_attn_space, infeasible=kv_attn_infeasible,
                                 varlen=True, fp8_kv=True),
        "kv_attn_union": RoleImpl(launch=launch_kv_attn_union, template="triton/kv_attn_union.py.j2",
                                  config_type=KvUnionConfig, default=kv_union_default, space=kv_union_space,
                                  infeasible=kv_union_infeasible),
        "kv_bwd_union": RoleImpl(launch=launch_kv_bwd_union, template="triton/kv_bwd_union.py.j2",
                                 config_type=KvUnionBwdConfig, default=kv_union_bwd_default,
                                 space=kv_union_bwd_space, infeasible=kv_union_bwd_infeasible),
        # a few queries (decode) over either schedule's lists: split-KV over each query's list
        "decode": RoleImpl(launch=launch_decode, template="triton/decode.py.j2", config_type=DecodeConfig,
                           default=decode_default, space=decode_space, infeasible=decode_infeasible, varlen=True,
                           paged=True, fp8_kv=True),
        # a prefill chunk over a paged cache: each schedule's forward kernel with its blocks based in their pages
        "kv_attn_paged": RoleImpl(launch=launch_kv_attn, template="triton/kv_attn_paged.py.j2",
                                  config_type=KvAttnConfig, default=kv_attn_default, space=kv_attn_space,
                                  infeasible=kv_attn_infeasible, varlen=True, paged=True, fp8_kv=True),
        "attn_paged": RoleImpl(launch=launch_attn_paged, template="triton/attn_paged.py.j2", config_type=AttnConfig,
                               default=attn_rows_default, space=attn_rows_space, infeasible=attn_paged_infeasible,
                               varlen=True, paged=True, fp8_kv=True),
        # its backward (bwd_delta is shared with the Q-centric schedule)
        "kv_bwd": RoleImpl(launch=launch_kv_bwd, template="triton/kv_bwd.py.j2", config_type=KvBwdConfig,
                           default=kv_bwd_default, space=kv_bwd_space, infeasible=kv_bwd_infeasible),
    }

    def device_unsupported(self, device) -> str | None:
        from ..device import interpreting

        device = torch.device(device)
        if device.type == "cpu" and not interpreting():
            return "backend='triton' runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)"
        return super().device_unsupported(device)

    def build(self, spec: Spec, role: str, config, problem: Problem | None = None):
        return rendered_module(self.name, role, str(self.role(role).template), spec, config)

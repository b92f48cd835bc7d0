"""`Spec`: what sparse attention to compute (docs/SEMANTICS.md gives the semantics).

A spec is frozen, hashable, validated on construction and round-trips through JSON. Everything a
kernel needs at compile time that is not a tunable lives here; tunables are each backend's config classes
(`kernelgen/backends/<name>.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
from dataclasses import dataclass

from .errors import KernelgenTypeError, KernelgenValueError

__all__ = ["Spec", "HEAD_DIMS", "HEAD_DIMS_TEXT", "TILE_SIZES", "SELECTORS", "SCHEDULES", "window_blocks"]

# Any multiple of 16 up to 256, as FlashAttention takes: kernels whose tiles need a power of two pad D to the next one
# and mask the rest (a backend that cannot says so where it is served).
HEAD_DIMS = tuple(range(16, 257, 16))
HEAD_DIMS_TEXT = "a multiple of 16 from 16 to 256"
TILE_SIZES = (16, 32, 64, 128, 256)
SELECTORS = ("mean", "multi:r", "index", "given")  # multi:r with r a power of two, e.g. "multi:4"
SCHEDULES = ("q_centric", "kv_centric")  # kv_centric: per-query lists (docs/SEMANTICS.md)
DEFAULT_Q_TILE = 64


@functools.lru_cache(maxsize=64)  # read by every launch (Spec.groups): parsed once per selector string
def _selector_groups(sel) -> int:
    """r of a selector: 1 for mean, index and given; r for "multi:r"; a ValueError for anything else."""
    if sel in ("mean", "index", "given"):
        return 1
    if isinstance(sel, str) and sel.startswith("multi:"):
        try:
            r = int(sel.split(":", 1)[1])
        except ValueError:
            r = 0
        if r >= 2 and _is_pow2(r):
            return r
        raise KernelgenValueError(f"Spec.selector={sel!r}: r must be a power of two >= 2, e.g. 'multi:4'")
    raise KernelgenValueError(f"Spec.selector={sel!r} is unknown; expected 'mean', 'multi:r' (e.g. 'multi:4'), "
                             "'index' or 'given'")


def window_blocks(q_tile: int, kv_block: int, window: int) -> int:
    """KV blocks that the sliding window of a Q tile's queries can touch: its keys span q_tile + window - 1
    positions (`Spec.window_blocks`; a selecting window spec's top_k)."""
    return -(-(q_tile + window - 2) // kv_block) + 1


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class Spec:
    """Block-sparse attention with run-time block selection.

    head_dim   D of q, k and v.
    kv_block   keys per KV block (the unit of selection).
    q_tile     queries per Q tile; Q-centric schedules choose one block list per tile. The KV-centric
               schedule has one list per query and no Q tile: q_tile must stay at its default there.
    top_k      blocks per list, forced (sink, local, diagonal) blocks included.
    causal     bottom-right aligned causal mask (FlashAttention >= 2.1).
    gqa_group  G = Hq / Hkv; the G query heads of a KV head share its block list.
    selector   "mean" (mean-pooled tile and block), "multi:r" (r group means each, max of r*r
               products), "index" (token scores from caller-given index vectors, as DeepSeek's lightning
               indexer: the call passes index=(q_idx, k_idx, w); either schedule), or "given" (the caller passes
               block_idx).
    schedule   "q_centric" (a list per Q tile; programs own Q tiles) or "kv_centric" (a list per query;
               programs own (KV block, query chunk) tasks, partial outputs merged through lse).
    local      blocks ending at the diagonal block that every list holds (with causal, at least 1).
    sink       leading blocks that every list holds (when visible).
    window     a sliding window (causal only): query i sees at most the `window` most recent keys, its diagonal
               key included, 0 <= (i + Nk - Nq) - j < window, as FlashAttention's window_size=(window - 1, 0) and
               transformers' sliding_window. None: no window. The window's blocks are forced (`n_local`); the
               Q-centric schedule's Triton kernels compute it (docs/SEMANTICS.md, "Sliding window").
    softcap    logit soft-capping: a score s = scale * q.k becomes softcap * tanh(s / softcap) before the softmax, as
               FlashAttention's softcap and Gemma 2's attn_logit_softcapping. None: none. Selection is unchanged
               (tanh is increasing); the Q-centric schedule's Triton kernels compute it (docs/SEMANTICS.md,
               "Soft-capping").
    backend    a registered backend ("triton", "tilelang", "gluon"; `kernelgen.backends.names()`), or "auto"
               (get_kernel serves the fastest tuned one). Whether the backend can compute the spec is
               checked where it is served (get_kernel, tune, export), against the registry.
    """

    head_dim: int
    kv_block: int = 64
    q_tile: int = DEFAULT_Q_TILE
    top_k: int = 16
    causal: bool = False
    gqa_group: int = 1
    selector: str = "mean"
    schedule: str = "q_centric"
    backend: str = "triton"
    local: int = 0
    sink: int = 0
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("head_dim", "kv_block", "q_tile", "top_k", "gqa_group", "local", "sink"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise KernelgenTypeError(f"Spec.{name} must be an int, got {type(value).__name__} {value!r}")
            if type(value) is not int:  # a NumPy integer: stored as the int it is (hashes, JSON and keys agree)
                value = int(value)
                object.__setattr__(self, name, value)
            if value >= 2**31:  # counts and ids are int32 in the lists and the kernels
                raise KernelgenValueError(f"Spec.{name}={value} is too large; expected less than 2**31")
        if not isinstance(self.causal, bool):
            raise KernelgenTypeError(f"Spec.causal must be a bool, got {type(self.causal).__name__}")
        if self.head_dim not in HEAD_DIMS:
            raise KernelgenValueError(f"Spec.head_dim={self.head_dim} is not supported; expected {HEAD_DIMS_TEXT}")
        for name in ("kv_block", "q_tile"):
            if getattr(self, name) not in TILE_SIZES:
                raise KernelgenValueError(
                    f"Spec.{name}={getattr(self, name)} is not supported; expected a power of two in {TILE_SIZES}"
                )
        if self.gqa_group < 1:
            raise KernelgenValueError(f"Spec.gqa_group must be >= 1, got {self.gqa_group}")
        if self.top_k < 1:
            raise KernelgenValueError(f"Spec.top_k must be >= 1, got {self.top_k}")
        if self.local < 0 or self.sink < 0:
            raise KernelgenValueError(f"Spec.local and Spec.sink must be >= 0, got local={self.local}, sink={self.sink}")
        if self.schedule not in SCHEDULES:
            raise KernelgenValueError(f"Spec.schedule={self.schedule!r} is unknown; expected one of {SCHEDULES}")
        if not isinstance(self.backend, str):
            raise KernelgenTypeError(f"Spec.backend must be a backend's name (a str), got {self.backend!r}")
        if not self.backend:
            raise KernelgenValueError("Spec.backend is empty; expected a backend's name or 'auto'")
        if self.per_query and self.q_tile != DEFAULT_Q_TILE:
            # a caller who sets q_tile expects it to shape the lists; per-query lists have no Q tile
            raise KernelgenValueError(
                f"Spec.q_tile={self.q_tile} with schedule='kv_centric': its lists are per query (block_idx "
                f"[B, Hkv, Nq, top_k]) and no Q tile is used; leave q_tile at its default ({DEFAULT_Q_TILE})")
        self._check_window()
        self._check_softcap()
        r = self._parse_selector()
        if r > 1 and self.per_query and self.kv_block % r:
            raise KernelgenValueError(f"Spec.selector={self.selector!r}: r={r} must divide kv_block={self.kv_block}")
        if r > 1 and not self.per_query and (self.q_tile % r or self.kv_block % r):
            raise KernelgenValueError(
                f"Spec.selector={self.selector!r}: r={r} must divide q_tile={self.q_tile} and kv_block={self.kv_block}"
            )
        if self.top_k < self.n_forced:
            diagonal = "; a causal spec forces its diagonal block: local counts at least 1" \
                if self.n_local > self.local else ""
            raise KernelgenValueError(
                f"Spec.top_k={self.top_k} cannot hold its forced blocks: sink={self.sink} + local={self.n_local} "
                f"= {self.n_forced} (top_k is the whole budget, forced blocks included{diagonal})"
            )

    def _check_window(self) -> None:
        window = self.window
        if window is None:
            return
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise KernelgenTypeError(f"Spec.window must be an int (keys) or None, got {type(window).__name__} "
                                     f"{window!r}")
        if type(window) is not int:
            object.__setattr__(self, "window", int(window))
        if not 1 <= self.window < 2**31:
            raise KernelgenValueError(f"Spec.window={self.window}: expected keys in [1, 2**31), or None for no window")
        if not self.causal:
            raise KernelgenValueError(f"Spec.window={self.window} needs causal=True: the window ends at each query's "
                                      "diagonal key (FlashAttention's window_size=(window - 1, 0))")
        if self.per_query:
            raise KernelgenValueError(f"Spec.window={self.window} is built for schedule='q_centric' only, not "
                                      "'kv_centric'")
        if self.selector == "index":
            raise KernelgenValueError(f"Spec.window={self.window} with selector='index': a window spec's lists are its "
                                      "window's blocks; use selector='mean' (or 'given' lists, which the window masks)")
        if self.sink:
            raise KernelgenValueError(f"Spec.window={self.window} with sink={self.sink}: the window hides sink blocks; "
                                      "attention sinks of gpt-oss's kind are the call's sinks= logits")
        if self.selects and self.top_k != self.n_forced:
            raise KernelgenValueError(
                f"Spec.window={self.window} with selector={self.selector!r}: the lists are the window's blocks, "
                f"n_local={self.n_local} for q_tile={self.q_tile} and kv_block={self.kv_block}; set top_k="
                f"{self.n_forced} (or pass given lists, which the window masks)")

    def _check_softcap(self) -> None:
        softcap = self.softcap
        if softcap is None:
            return
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise KernelgenTypeError(f"Spec.softcap must be a float or None, got {type(softcap).__name__} {softcap!r}")
        object.__setattr__(self, "softcap", float(softcap))  # 50 and 50.0 are one spec (hashes, JSON, keys)
        if not 0 < self.softcap < math.inf:
            raise KernelgenValueError(f"Spec.softcap={self.softcap}: expected a cap > 0 (Gemma 2's is 50.0), or None "
                                      "for none")
        if self.per_query:
            raise KernelgenValueError(f"Spec.softcap={self.softcap} is built for schedule='q_centric' only, not "
                                      "'kv_centric'")

    @property
    def window_blocks(self) -> int:
        """Blocks that the window of a Q tile's queries can touch (`window_blocks`; 0 without a window)."""
        return 0 if self.window is None else window_blocks(self.q_tile, self.kv_block, self.window)

    def _parse_selector(self) -> int:
        sel = self.selector  # not a str: unhashable perhaps, refused uncached
        return _selector_groups(sel) if isinstance(sel, str) else _selector_groups.__wrapped__(sel)

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        """r: representatives per tile and per block (1 for mean)."""
        return self._parse_selector()

    @property
    def per_query(self) -> bool:
        """Whether each query has its own list (the KV-centric schedule)."""
        return self.schedule == "kv_centric"

    @property
    def list_queries(self) -> int:
        """Queries that share one list: q_tile, or 1 for per-query lists (a list per query is a Q tile
        of one query: eligibility, forced blocks and masks follow from the same rules)."""
        return 1 if self.per_query else self.q_tile

    @property
    def n_local(self) -> int:
        """Local blocks forced into every list; causal forces at least the diagonal block, a window (of a spec
        that selects) the blocks it can touch."""
        return max(self.local, 1, self.window_blocks if self.selects else 0) if self.causal else self.local

    @property
    def n_forced(self) -> int:
        return self.sink + self.n_local

    @property
    def selects(self) -> bool:
        return self.selector != "given"

    @property
    def selection_role(self) -> str | None:
        """The kernel role that chooses this spec's lists: "select_index" for the index selector, "select" for
        the pooled ones (mean, multi:r), "kv_select_index" and "kv_select" for per-query lists, None for
        given lists."""
        if not self.selects:
            return None
        role = "select_index" if self.selector == "index" else "select"
        return f"kv_{role}" if self.per_query else role

    def packs_rows(self, block_m: int, tile: int | None = None) -> bool:
        """Whether programs of `block_m` packed rows (the G heads x `tile` queries of a tile, head-major;
        default q_tile) cover the rows evenly: block_m splits one head's tile, or holds whole tiles of a
        number of heads that divides gqa_group."""
        tile = self.q_tile if tile is None else tile
        if block_m < 1 or block_m > self.gqa_group * tile:
            return False
        if block_m <= tile:
            return tile % block_m == 0
        return block_m % tile == 0 and self.gqa_group % (block_m // tile) == 0

    def n_q_tiles(self, nq: int) -> int:
        """Lists per (batch, KV head): Q tiles, or queries for per-query lists."""
        return -(-nq // self.list_queries)

    def n_kv_blocks(self, nk: int) -> int:
        return -(-nk // self.kv_block)

    # ---- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for name in ("window", "softcap"):  # a spec without them keeps the JSON, keys and tuned winners it had
            if data[name] is None:
                del data[name]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Spec":
        if not isinstance(data, dict):
            raise KernelgenTypeError(f"Spec.from_dict takes a dict of Spec fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise KernelgenValueError(f"Spec: unknown fields {sorted(unknown)}; expected a subset of {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError, RecursionError) as error:
            raise KernelgenValueError(f"Spec.from_json: not a JSON object of Spec fields ({error})") from None
        if not isinstance(data, dict):
            raise KernelgenValueError(f"Spec.from_json: expected a JSON object of Spec fields, got "
                                      f"{type(data).__name__} {text[:40]!r}")
        return cls.from_dict(data)

    def key(self) -> str:
        """Short stable hash of the spec (used in kernel names, cache paths and the tuning DB)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def replace(self, **changes) -> "Spec":
        return dataclasses.replace(self, **changes)

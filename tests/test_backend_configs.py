"""Config spaces of each backend's roles per arch: every point feasible, infeasible points pruned before any
compile, defaults inside, pinned configs checked (`kernelgen.backends`: Backend.default_config, config_space,
infeasible, check_config, config_from_dict; `kernelgen.archs`: what each arch offers)."""
import dataclasses
import itertools
import re

import pytest

import kernelgen
from kernelgen import (AttnConfig, GluonAttnConfig, KernelgenTypeError, KernelgenValueError, KvIndexSelectConfig,
                       SelectConfig, Spec)
from kernelgen import TileLangAttnConfig, backends
from kernelgen.backends import gluon as gluon_backend
from kernelgen.backends import tilelang as tilelang_backend
from kernelgen.backends import triton as triton_backend
from kernelgen.archs import ANY_ARCH, ARCHS, ArchFacts, arch_facts
from kernelgen.backends.triton import attn_smem_bytes
from kernelgen.dispatch import SparseAttention
from kernelgen.roles import get_role
from kernelgen.tuning.buckets import seq_bucket

TRITON, TILELANG, GLUON = (backends.get(name) for name in ("triton", "tilelang", "gluon"))
SM90_SMEM = ARCHS["sm_90"].smem_per_block

SPECS = [
    Spec(head_dim=d, kv_block=kv, q_tile=qt, top_k=tk, causal=c, gqa_group=g, selector=sel, backend=be)
    for d, kv, qt, tk, c, g, sel, be in itertools.product(
        (64, 128, 256), (32, 64, 128), (64, 128), (16, 256), (False, True), (1, 4), ("mean", "multi:4"),
        ("triton", "tilelang"))
]


def _served(spec, role):
    """(backend that runs `role` for `spec`, the role's kernel spec on it), as dispatch and the tuner see it."""
    backend = backends.runner(spec.backend, role)
    return backend, get_role(role).kernel_spec(spec, backend.name)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_defaults_are_points_of_their_spaces(spec):
    for arch, role in itertools.product(("sm_80", "sm_89", "sm_90"), ("attn", "select", "bwd_dq", "bwd_dkdv")):
        backend, kernel_spec = _served(spec, role)
        space = backend.config_space(kernel_spec, role, arch)
        if not space and spec.head_dim == 256 and spec.kv_block == 128:
            # a K and a V block of 64 KB each: more than the 99 KB of sm_89 holds with any Q tile
            assert arch == "sm_89" and backend.name in ("triton", "tilelang")
            with pytest.raises(KernelgenValueError, match=r"101376|no .* fits .* on sm_89"):
                backend.default_config(kernel_spec, role, arch)
            continue
        assert space and all(type(c) is backend.config_type(role) for c in space), (arch, role)
        assert all(backend.infeasible(kernel_spec, role, c, arch) is None for c in space), (arch, role)
        cfg = backend.default_config(kernel_spec, role, arch)
        assert backend.infeasible(kernel_spec, role, cfg, arch) is None, (arch, role, cfg)
        if role == "select" and spec.top_k > 128:
            continue  # long lists: the default's chunk can exceed the space's largest (it stays feasible)
        assert cfg in space, (arch, role, cfg)


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric"])
def test_the_index_selector_s_decode_defaults_are_points_of_their_spaces(schedule):
    """decode_select_index's and kv_decode_select_index's defaults are in their spaces (a tune times them first
    and falls back to them), at every kv_block and head_dim, on every arch."""
    role = "decode_select_index" if schedule == "q_centric" else "kv_decode_select_index"
    for arch, kv_block, head_dim, top_k in itertools.product(("sm_80", "sm_89", "sm_90"), (16, 32, 64, 128),
                                                             (64, 128), (16, 64)):
        spec = Spec(head_dim=head_dim, kv_block=kv_block, top_k=top_k, causal=True, selector="index",
                    schedule=schedule, **({"q_tile": 64} if schedule == "q_centric" else {}))
        backend, kernel_spec = _served(spec, role)
        cfg = backend.default_config(kernel_spec, role, arch)
        assert cfg in backend.config_space(kernel_spec, role, arch), (arch, kv_block, head_dim, cfg)


def test_the_arch_table():
    """Shared memory per program as CUDA gives it, TMA and wgmma on sm_90 only; the interpreter gets sm_90's
    facts, an arch the table lacks its least, one older than the kernels an error."""
    smem = {arch: facts.smem_per_block for arch, facts in ARCHS.items()}
    assert smem == {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448}
    assert [a for a, f in ARCHS.items() if f.tma] == [a for a, f in ARCHS.items() if f.mma == "wgmma"] == ["sm_90"]
    assert arch_facts("cpu") == dataclasses.replace(ARCHS["sm_90"], arch="cpu")
    for newer in ("sm_100", "sm_120"):
        assert arch_facts(newer) == ArchFacts(newer, 101376, tma=False, mma="unknown")
    with pytest.raises(KernelgenValueError, match="arch='sm_75' is older than kernelgen's kernels run on"):
        arch_facts("sm_75")
    with pytest.raises(KernelgenValueError, match="arch='sm_90a' is not a CUDA arch"):
        TRITON.default_config(Spec(head_dim=64), "attn", "sm_90a")


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_100"])
def test_triton_off_hopper_has_no_tma_and_less_shared_memory(arch):
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, gqa_group=4, selector="given")
    space = TRITON.config_space(spec, "attn", arch)
    assert space and not any(c.use_tma for c in space)
    assert max(attn_smem_bytes(spec, c, arch) for c in space) <= arch_facts(arch).smem_per_block
    assert {dataclasses.replace(c, use_tma=False) for c in TRITON.config_space(spec, "attn", "sm_90")} > set(space)
    tma = AttnConfig(block_m=64, use_tma=True)
    assert TRITON.infeasible(spec, "attn", tma, arch) == f"use_tma=True needs TMA (sm_90), which {arch} lacks"
    assert TRITON.infeasible(spec, "attn", tma, "sm_90") is None
    assert TRITON.infeasible(spec, "attn", tma, ANY_ARCH) is None  # pinned before a device: sm_90 runs it


def test_mma_sync_archs_buffer_one_stage_fewer():
    """What Triton 3.6 asks for (offline compiles, tests/test_triton_compile.py): sm_90 buffers num_stages
    K and V blocks, sm_80 to sm_89 num_stages - 1 and up to half a step of keys' rows more; one stage is one
    buffer everywhere; an arch the table lacks gets the larger estimate."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, selector="given")
    two, one = AttnConfig(block_m=64, num_warps=8, num_stages=2), AttnConfig(block_m=128, num_warps=8, num_stages=1)
    assert attn_smem_bytes(spec, two, "sm_90") == attn_smem_bytes(spec, two, "sm_100") == (4 * 128 + 64) * 256
    assert attn_smem_bytes(spec, two, "sm_89") == (2 * 128 + 64 + 64) * 256 == 98304
    assert {attn_smem_bytes(spec, one, arch) for arch in ("sm_80", "sm_89", "sm_90", "sm_100")} == {(256 + 128) * 256}
    # so at 99 KB the H200's default (128 rows, 2 stages) gives way to 64 rows on sm_89, to one stage on sm_120
    assert TRITON.default_config(spec, "attn", "sm_90") == dataclasses.replace(two, block_m=128)
    assert TRITON.default_config(spec, "attn", "sm_80") == dataclasses.replace(two, block_m=128)
    assert TRITON.default_config(spec, "attn", "sm_89") == two
    assert TRITON.default_config(spec, "attn", "sm_120") == one


def test_gluon_runs_on_sm90_only():
    spec = _gluon(gqa_group=4)
    for arch in ("sm_80", "sm_89", "sm_100"):
        assert GLUON.config_space(spec, "attn", arch) == []
        with pytest.raises(KernelgenValueError, match=f"needs TMA and wgmma \\(Hopper, sm_90\\), which {arch} lacks"):
            GLUON.default_config(spec, "attn", arch)
    assert GLUON.infeasible(spec, "attn", GluonAttnConfig(), ANY_ARCH) is None


def test_roles_a_backend_lacks_run_on_the_fallback():
    """Selection and list normalising run in Triton for every backend; asking a backend for a role it
    lacks is a clear error."""
    for name in ("tilelang", "gluon"):
        assert backends.runner(name, "attn").name == name
        assert backends.runner(name, "select") is TRITON and backends.runner(name, "lists") is TRITON
        with pytest.raises(KernelgenValueError, match=rf"backend='{name}' does not run role 'select'"):
            backends.get(name).default_config(Spec(head_dim=128, backend=name), "select", "sm_90")
    assert TRITON.config_type("lists") is None and TRITON.config_space(Spec(head_dim=64), "lists", "sm_89") == [None]
    with pytest.raises(KernelgenValueError, match="does not run role 'bwd'"):
        TRITON.config_space(Spec(head_dim=64), "bwd", "sm_90")


def test_shared_memory_bound_prunes_what_failed_on_the_h200():
    # Triton 3.6 on the H200 refused these (out of resource: shared memory, 278528 and 294912 B > 232448)
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=16, selector="given")
    for block_m, need in ((64, 278528), (128, 294912)):
        cfg = AttnConfig(block_m=block_m, num_warps=8, num_stages=4)
        assert attn_smem_bytes(spec, cfg, "sm_90") == need > SM90_SMEM
        assert "B of shared memory" in triton_backend.attn_infeasible(spec, cfg, "sm_90")
        assert TRITON.infeasible(spec, "attn", cfg, "sm_90") and cfg not in TRITON.config_space(spec, "attn", "sm_90")
    assert TRITON.infeasible(spec, "attn", AttnConfig(block_m=128, num_warps=8, num_stages=2), "sm_90") is None


def test_select_space_respects_top_k():
    spec = Spec(head_dim=64, top_k=64)
    space = TRITON.config_space(spec, "select", "sm_90")
    assert space and all(c.chunk >= 64 and triton_backend.select_infeasible(spec, c, "sm_90") is None for c in space)


def test_seq_bucket():
    assert [seq_bucket(n) for n in (0, 1, 1024, 1025, 32768, 32769)] == [1024, 1024, 1024, 2048, 32768, 65536]
    with pytest.raises(ValueError):
        seq_bucket(-1)


def test_a_spec_no_config_fits_is_a_clear_error():
    """sm_86's 99 KB do not hold one step's K and V of a 256-key block's halves at D=256 (sm_90's 227 KB do)."""
    spec = Spec(head_dim=256, kv_block=256)
    assert TRITON.default_config(spec, "attn", "sm_90").num_stages == 1
    with pytest.raises(KernelgenValueError, match=r"head_dim=256, kv_block=256 on sm_86: .* 128 x 256 a step .* "
                                                  "smaller kv_block"):
        TRITON.default_config(spec, "attn", "sm_86")


@pytest.mark.parametrize("role", ["kv_select", "kv_decode_select"])
def test_a_per_query_selection_no_config_fits_names_what_the_spec_can_change(role):
    """Its score product holds a chunk of next_pow2(top_k) blocks' r representatives whatever the config: the
    error names top_k, the groups and head_dim, not kv_block or q_tile."""
    spec = Spec(head_dim=128, kv_block=32, top_k=40, causal=True, selector="multi:4", schedule="kv_centric")
    with pytest.raises(KernelgenValueError, match=r"no KvSelectConfig fits .* a smaller top_k, fewer groups"):
        TRITON.default_config(spec, role, "sm_90")
    assert TRITON.default_config(spec.replace(top_k=32), role, "sm_90") is not None


@pytest.mark.parametrize("arch", ["sm_90", ANY_ARCH])
def test_a_config_of_another_type_is_infeasible(arch):
    spec = Spec(head_dim=64)
    assert TRITON.infeasible(spec, "attn", GluonAttnConfig(), arch) == "GluonAttnConfig is no AttnConfig"
    assert TRITON.infeasible(spec, "select", AttnConfig(), arch) == "AttnConfig is no SelectConfig"
    assert "takes no config" in TRITON.infeasible(spec, "lists", SelectConfig(), arch)
    assert TRITON.infeasible(spec, "lists", None, arch) is None


@pytest.mark.parametrize("change", [dict(threads=512), dict(threads=64), dict(num_stages=4), dict(num_stages=0),
                                    dict(overlap="yes"), dict(pingpong=1), dict(overlap=False, pingpong=True),
                                    dict(block_m=64, threads=128, num_stages=1, pingpong=True)])
def test_tilelang_pinned_config_outside_the_kernel_s_range_is_refused(change):
    """A pinned TileLang config the kernel was never built for (thread count, stages, a non-bool switch: a
    type error, as for every backend's configs) is a clear error, not a launch of an untested shape."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    cfg = TILELANG.default_config(spec, "attn", "sm_90")
    assert type(cfg) is TileLangAttnConfig
    TILELANG.check_config(spec, "attn", cfg, "sm_90")
    # overlap with two warpgroups: allowed
    TILELANG.check_config(spec, "attn", dataclasses.replace(cfg, pingpong=True), "sm_90")
    non_bool = any(type(v) is not bool for k, v in change.items() if k in ("overlap", "pingpong"))
    error, match = (KernelgenTypeError, "must be bool") if non_bool else (KernelgenValueError,
                                                                          "not feasible|must be at least 1")
    with pytest.raises(error, match=match):
        TILELANG.check_config(spec, "attn", dataclasses.replace(cfg, **change), "sm_90")


def test_tilelang_pingpong_needs_overlap_and_two_warpgroups():
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    space = TILELANG.config_space(spec, "attn", "sm_90")
    assert all(c.overlap and c.threads == 256 for c in space if c.pingpong)
    assert sum(c.pingpong for c in space) == sum(c.overlap and c.threads == 256 and not c.pingpong for c in space) > 0
    why = tilelang_backend.attn_infeasible(spec, TileLangAttnConfig(block_m=128, num_stages=2, threads=256,
                                                                    overlap=False, pingpong=True), "sm_90")
    assert "pingpong=True needs overlap=True and threads=256" in why


# ---- Gluon -------------------------------------------------------------------------------------------

def _gluon(**fields):
    return Spec(**{"head_dim": 128, "kv_block": 128, "q_tile": 128, "top_k": 16, "backend": "gluon", **fields})


@pytest.mark.parametrize("spec, points, default", [
    # D = kv_block = 128: four stages of K and V (256 KB) exceed the H200's shared memory
    (_gluon(gqa_group=4), {(64, 2), (64, 3), (128, 2), (128, 3)}, (128, 3)),
    (_gluon(head_dim=64, kv_block=64, q_tile=64), {(64, 2), (64, 3), (64, 4)}, (64, 3)),  # 64 rows only
    (_gluon(kv_block=64, q_tile=64, gqa_group=2), {(m, s) for m in (64, 128) for s in (2, 3, 4)}, (128, 3)),
    (_gluon(head_dim=64, q_tile=16, gqa_group=8), {(m, s) for m in (64, 128) for s in (2, 3, 4)}, (128, 3)),
    (_gluon(q_tile=64, gqa_group=3), {(64, 2), (64, 3)}, (64, 3)),  # 128 rows would split a head's tile
])
def test_gluon_space_and_default(spec, points, default):
    space = GLUON.config_space(spec, "attn", "sm_90")
    assert {(c.block_m, c.num_stages) for c in space} == points
    assert all(type(c) is GluonAttnConfig and gluon_backend.attn_infeasible(spec, c, "sm_90") is None for c in space)
    assert GLUON.default_config(spec, "attn", "sm_90") == GluonAttnConfig(*default)
    selector, select_spec = _served(spec, "select")  # the Triton selector's
    assert selector is TRITON and select_spec == spec.replace(backend="triton")
    assert selector.default_config(select_spec, "select", "sm_90") in selector.config_space(select_spec, "select",
                                                                                           "sm_90")


def test_gluon_shared_memory_bound():
    spec = _gluon(gqa_group=4)
    limit = SM90_SMEM - gluon_backend.GLUON_BARRIER_BYTES
    assert gluon_backend.gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 4)) == 262144 > limit
    assert "262144 B of shared memory" in gluon_backend.attn_infeasible(spec, GluonAttnConfig(128, 4), "sm_90")
    assert gluon_backend.gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 3)) == 196608
    assert gluon_backend.attn_infeasible(spec, GluonAttnConfig(128, 3), "sm_90") is None


@pytest.mark.parametrize("cfg", [dict(block_m=32), dict(block_m=256), dict(num_stages=1), dict(num_stages=5),
                                 dict(block_m=128, num_stages=4)])
def test_gluon_pinned_config_outside_the_kernel_s_range_is_refused(cfg):
    spec = _gluon(gqa_group=4)
    GLUON.check_config(spec, "attn", GluonAttnConfig(), "sm_90")
    with pytest.raises(KernelgenValueError, match=r"configs\['attn'\] = .* is not feasible"):
        GLUON.check_config(spec, "attn", GluonAttnConfig(**cfg), "sm_90")
    with pytest.raises(KernelgenValueError, match=r"configs\['attn'\] = .* is not feasible"):
        SparseAttention(spec, {"attn": GluonAttnConfig(**cfg)})  # what get_kernel(configs=...) runs


def test_gluon_pinned_config_types():
    """A Gluon spec takes a GluonAttnConfig (and the Triton SelectConfig); "auto" takes any attention type,
    a Gluon one only where the Gluon kernel computes the spec."""
    spec = _gluon(gqa_group=4)
    with pytest.raises(KernelgenTypeError, match=r"must be an instance of GluonAttnConfig for backend='gluon', got AttnConfig"):
        GLUON.check_config(spec, "attn", AttnConfig(), "sm_90")
    with pytest.raises(KernelgenTypeError, match=r"must be an instance of GluonAttnConfig for backend='gluon', got AttnConfig"):
        SparseAttention(spec, {"attn": AttnConfig()})
    with pytest.raises(KernelgenTypeError, match=r"must be an instance of AttnConfig for backend='triton', got GluonAttnConfig"):
        TRITON.check_config(spec.replace(backend="triton"), "attn", GluonAttnConfig(), ANY_ARCH)
    with pytest.raises(KernelgenTypeError, match=r"must be an instance of AttnConfig for backend='triton', got GluonAttnConfig"):
        SparseAttention(spec.replace(backend="triton"), {"attn": GluonAttnConfig()})
    SparseAttention(spec, {"select": SelectConfig(tiles=16)})  # the Triton selector's config
    with pytest.raises(KernelgenTypeError, match=r"must be an instance of SelectConfig"):
        SparseAttention(spec, {"select": GluonAttnConfig()})
    auto = spec.replace(backend="auto")
    for cfg in (AttnConfig(num_warps=8), GluonAttnConfig()):
        SparseAttention(auto, {"attn": cfg})
    with pytest.raises(KernelgenValueError, match="not feasible.*head_dim=256"):  # D=256: no Gluon kernel
        SparseAttention(auto.replace(head_dim=256, kv_block=64), {"attn": GluonAttnConfig(block_m=128)})
    assert backends.of_config("attn", GluonAttnConfig()) is GLUON and backends.of_config("attn", AttnConfig()) is TRITON
    assert backends.of_config("attn", TileLangAttnConfig()) is TILELANG
    assert backends.of_config("select", SelectConfig()) is TRITON
    with pytest.raises(kernelgen.KernelgenTypeError, match="SelectConfig is no config of role .attn."):
        backends.of_config("attn", SelectConfig())
    assert GLUON.config_from_dict("attn", {"block_m": 64, "num_stages": 3}) == GluonAttnConfig(64, 3)
    assert TRITON.config_from_dict("select", {"tiles": 8}) == SelectConfig(tiles=8)
    assert TRITON.config_from_dict("lists", None) is None
    assert GluonAttnConfig(64, 3).to_json() == '{"block_m": 64, "num_stages": 3}'


@pytest.mark.parametrize("fields, why", [
    (dict(head_dim=256, kv_block=64), r"Spec.head_dim=256 is not supported by backend='gluon'"),
    (dict(kv_block=32), r"Spec.kv_block=32 is not supported by backend='gluon'"),
    (dict(q_tile=32, gqa_group=1), r"32 packed rows is too few for backend='gluon'"),
    (dict(q_tile=64, gqa_group=3, head_dim=64, kv_block=64, top_k=8), None),  # 64-row programs: computed
])
def test_a_spec_the_gluon_kernel_cannot_compute_is_refused_where_served(fields, why):
    """Spec(backend="gluon", ...) constructs whatever its fields; `check_spec` (run by get_kernel, tune and
    export) refuses a spec the Gluon forward does not compute, naming why."""
    spec = _gluon(**fields)  # no error at construction
    assert GLUON.spec_unsupported(spec) == gluon_backend.spec_unsupported(spec)
    if why is None:
        backends.check_spec(spec)
        assert GLUON.spec_unsupported(spec) is None
        return
    with pytest.raises(KernelgenValueError, match=why):
        backends.check_spec(spec)
    with pytest.raises(KernelgenValueError, match=why):
        kernelgen.get_kernel(spec)
    with pytest.raises(KernelgenValueError, match=why):
        GLUON.default_config(spec, "attn", "sm_90")
    assert GLUON.config_space(spec, "attn", "sm_90") == []
    backends.check_spec(spec.replace(backend="triton"))  # Triton computes every spec
    backends.check_spec(spec.replace(backend="auto"))  # and so serves "auto"


def test_an_unknown_backend_is_refused_where_served():
    spec = Spec(head_dim=64, backend="cuda")  # any non-empty name constructs
    with pytest.raises(KernelgenValueError, match=r"backend='cuda' is unknown; expected one of"):
        backends.check_spec(spec)
    with pytest.raises(KernelgenValueError, match=r"backend='cuda' is unknown"):
        kernelgen.get_kernel(spec)
    with pytest.raises(KernelgenValueError, match="Spec.backend is empty"):
        Spec(head_dim=64, backend="")
    with pytest.raises(KernelgenTypeError, match="Spec.backend must be a backend's name"):
        Spec(head_dim=64, backend=None)


@pytest.mark.parametrize("backend, role, cfg, why", [
    ("tilelang", "attn", "TileLangAttnConfig(64, 2, 128, False)", "threads=128 allows num_stages=1 only"),
    ("tilelang", "attn", "TileLangAttnConfig(64, 2, 256, True)", "needs block_m=128"),
    ("tilelang", "attn", "TileLangAttnConfig(128, 3, 256, True)", "num_stages=3 at head_dim=64"),
    ("triton", "attn", "AttnConfig(block_m=128, num_warps=2)", r"256 fp32 registers per thread"),
    ("triton", "attn", "AttnConfig(block_m=48)", "block_m=48 must be >= 16 and either split a Q tile"),
    ("triton", "attn", "AttnConfig(use_tma=True, kv_per_iter=2, block_m=64)", "use_tma loads one block per step"),
    ("triton", "attn", "AttnConfig(block_m=64, num_stages=40)", "B of shared memory"),
    ("gluon", "attn", "GluonAttnConfig(64, 5)", "num_stages=5; expected 2, 3 or 4"),
    ("triton", "select", "SelectConfig(chunk=8)", "chunk \\* groups = 8 columns; expected 16 to 256 rows, at least 16"),
    ("triton", "select", "SelectConfig(splits=3)", "splits=3"),
])
def test_an_infeasible_pinned_config_says_why(backend, role, cfg, why):
    spec = Spec(head_dim=64, kv_block=64, q_tile=128, top_k=16, backend=backend)
    cfg = eval(cfg)
    runner = backends.get(backend)
    assert runner.infeasible(spec, role, cfg, "sm_90")
    with pytest.raises(KernelgenValueError, match=rf"configs\['{role}'\] = .* not feasible for .* on sm_90: .*{why}"):
        runner.check_config(spec, role, cfg, "sm_90")
    if backend == "tilelang" and runner.infeasible(spec, role, cfg, "sm_80") is None:
        # Hopper's rule only (its warp-specialised pipeline): the mma.sync forward of sm_80 runs it, so a
        # config pinned before any device is known is accepted
        runner.check_config(spec, role, cfg, ANY_ARCH)
        return
    # no arch runs them: refused where a config is pinned, before any device is known
    with pytest.raises(KernelgenValueError, match=rf"configs\['{role}'\] = .* not feasible .* on any arch: .*{why}"):
        runner.check_config(spec, role, cfg, ANY_ARCH)


def test_a_selector_chunk_narrower_than_top_k_says_why():
    assert "chunk=16 blocks is fewer than next_pow2(top_k) = 32" in TRITON.infeasible(
        Spec(head_dim=64, kv_block=64, q_tile=64, top_k=32), "select", SelectConfig(tiles=16, chunk=16), "sm_89")


# ---- TileLang per arch: Hopper's forward (wgmma, TMA) and the mma.sync / cp.async one of sm_80 to sm_89 --------

TILELANG_SPECS = [s for s in SPECS if s.backend == "tilelang" and s.selector == "mean" and s.top_k == 16]
OFF_HOPPER = ("sm_80", "sm_86", "sm_89")


def _tilelang_feasible(spec, arch):
    space = tilelang_backend.attn_space(spec, arch)
    return [c for c in space if tilelang_backend.attn_infeasible(spec, c, arch) is None]


@pytest.mark.parametrize("arch", OFF_HOPPER)
def test_tilelang_space_off_hopper_has_no_wgmma_schedule_and_fits_the_shared_memory(arch):
    """Off Hopper: no overlap or ping-pong (they schedule asynchronous wgmma), 1 to 3 stages at either thread count,
    every point within the arch's shared memory; the default is a feasible point, or, where no point fits (D=256
    with 128-key blocks on sm_86/sm_89), a clear error saying how much the smallest needs."""
    limit = arch_facts(arch).smem_per_block
    for spec in TILELANG_SPECS:
        space = _tilelang_feasible(spec, arch)
        assert not any(c.overlap or c.pingpong for c in space)
        assert all(tilelang_backend.attn_smem_bytes(spec, c) <= limit for c in space)
        if not space:
            with pytest.raises(KernelgenValueError, match=rf"no feasible TileLang attention config .* on {arch}; "
                                                          rf"the smallest: \d+ B of shared memory"):
                tilelang_backend.attn_default(spec, arch)
            continue
        assert tilelang_backend.attn_default(spec, arch) in space
    small = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, backend="tilelang")
    assert {(c.threads, c.num_stages) for c in _tilelang_feasible(small, arch)} == {(128, 1), (128, 2), (128, 3)}


def test_tilelang_spaces_per_arch_nest_and_hopper_is_unchanged():
    """sm_86 and sm_89 (99 KB) hold the points of sm_80 (163 KB) that fit; through Backend, each arch's space
    and default are the module's functions of that arch."""
    for spec in TILELANG_SPECS:
        sm80, sm86, sm89 = (_tilelang_feasible(spec, arch) for arch in OFF_HOPPER)
        assert sm86 == sm89 and set(sm89) <= set(sm80)
        assert set(sm89) == {c for c in sm80 if tilelang_backend.attn_smem_bytes(spec, c) <= 101376}
        for arch in ("sm_80", "sm_89", "sm_90"):
            assert TILELANG.config_space(spec, "attn", arch) == _tilelang_feasible(spec, arch)
            if _tilelang_feasible(spec, arch):
                assert TILELANG.default_config(spec, "attn", arch) == tilelang_backend.attn_default(spec, arch)
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    assert [tilelang_backend.attn_default(spec, arch) for arch in ("sm_80", "sm_89", "sm_90")] == [
        TileLangAttnConfig(128, 2, 256), TileLangAttnConfig(128, 1, 256), TileLangAttnConfig(128, 2, 256, overlap=True)]


@pytest.mark.parametrize("cfg, why", [
    (TileLangAttnConfig(128, 2, 256, overlap=True), "overlap=True, pingpong=False on sm_89: both schedule Hopper's"),
    (TileLangAttnConfig(128, 2, 256, overlap=True, pingpong=True), "expected overlap=False, pingpong=False"),
    (TileLangAttnConfig(128, 2, 256), r"163840 B of shared memory .* sm_89 allows at most 101376 B per block"),
    (TileLangAttnConfig(64, 3, 256), "threads=256 .* needs block_m=128"),
])
def test_tilelang_config_infeasible_on_sm89_says_why(cfg, why):
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    assert re.search(why, tilelang_backend.attn_infeasible(spec, cfg, "sm_89"))
    assert tilelang_backend.attn_infeasible(spec, TileLangAttnConfig(128, 2, 256), "sm_80") is None  # 160 KB fit


def test_tilelang_hopper_space_and_default_fit_its_shared_memory():
    """On Hopper too every point and the default fit 227 KB (TileLang plans attn_smem_bytes there as well): at
    D=256 with 128-key blocks two stages of 128 rows need 320 KB, which fails to lower or to launch."""
    spec = Spec(head_dim=256, kv_block=128, q_tile=128, top_k=16, causal=True, backend="tilelang")
    limit = arch_facts("sm_90").smem_per_block
    space = _tilelang_feasible(spec, "sm_90")
    assert space and all(tilelang_backend.attn_smem_bytes(spec, c) <= limit for c in space)
    assert tilelang_backend.attn_smem_bytes(spec, tilelang_backend.attn_default(spec, "sm_90")) <= limit
    why = tilelang_backend.attn_infeasible(spec, TileLangAttnConfig(128, 2, 256, overlap=True), "sm_90")
    assert re.search(r"327680 B of shared memory .* sm_90 allows at most 232448 B", why)


def test_tilelang_on_cpu_lists_hopper_s_configs_and_runs_nowhere():
    """As kernelgen.archs has it: "cpu" (where specs are planned or exported, never launched) is given
    Hopper's configs; the backend itself does not run on the CPU."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, backend="tilelang")
    assert tilelang_backend.attn_default(spec, "cpu") == tilelang_backend.attn_default(spec, "sm_90")
    assert list(tilelang_backend.attn_space(spec, "cpu")) == list(tilelang_backend.attn_space(spec, "sm_90"))
    assert "does not run on the CPU" in TILELANG.arch_unsupported("cpu")


@pytest.mark.parametrize("arch", ["sm_75", "sm_100", "sm_90b", ""])
def test_tilelang_config_functions_name_an_arch_they_do_not_build_for(arch, monkeypatch):
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, backend="tilelang")
    expected = rf"arch={arch!r}: the TileLang forward builds for sm_80, sm_86, sm_89, sm_90 only"
    for call in (lambda: tilelang_backend.attn_default(spec, arch),
                 lambda: list(tilelang_backend.attn_space(spec, arch)),
                 lambda: tilelang_backend.attn_infeasible(spec, TileLangAttnConfig(64, 1, 128), arch)):
        with pytest.raises(KernelgenValueError, match=re.escape(expected)):
            call()
    assert TILELANG.archs == ("sm_80", "sm_86", "sm_89", "sm_90") and TILELANG.arch_unsupported(arch)
    # the arch TileLang compiles for on a device: sm_90 as sm_90a (wgmma, TMA), the others as they are
    for device, target in (("sm_80", "sm_80"), ("sm_86", "sm_86"), ("sm_89", "sm_89"), ("sm_90", "sm_90a")):
        monkeypatch.setattr(tilelang_backend, "device_arch", lambda _device, arch=device: arch)
        assert tilelang_backend.target_arch("cuda") == target
    monkeypatch.setattr(tilelang_backend, "device_arch", lambda _device: arch)
    with pytest.raises(KernelgenValueError, match=re.escape(expected)):
        tilelang_backend.target_arch("cuda")


def test_pinned_config_fields_have_their_declared_types():
    """A tunable of the wrong type (a float, a string, an int for a flag) is named, never compared or rendered."""
    spec = Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, selector="index",
                schedule="kv_centric")
    with pytest.raises(KernelgenTypeError, match=r"configs\['kv_select_index'\]\.hold must be bool, got 3"):
        SparseAttention(spec, {"kv_select_index": KvIndexSelectConfig(hold=3)})
    with pytest.raises(KernelgenTypeError, match=r"configs\['kv_select_index'\]\.queries must be int, got 64\.0"):
        SparseAttention(spec, {"kv_select_index": KvIndexSelectConfig(queries=64.0)})
    given = Spec(head_dim=128, kv_block=64, top_k=16, selector="given")
    for config, match in ((AttnConfig(num_warps=0), r"configs\['attn'\]\.num_warps must be at least 1, got 0"),
                          (AttnConfig(num_warps=3), r"\.num_warps must be a power of two up to 32.*got 3"),
                          (AttnConfig(num_stages=-1), r"\.num_stages must be at least 1, got -1")):
        with pytest.raises(KernelgenValueError, match=match):  # counts: never a division by zero or a launch
            SparseAttention(given, {"attn": config})
    with pytest.raises(KernelgenTypeError, match=r"configs\['attn'\]\.block_m must be int, got '64'"):
        SparseAttention(Spec(head_dim=128, kv_block=64, top_k=16, selector="given"), {"attn": AttnConfig(block_m="64")})
    tilelang = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    with pytest.raises(KernelgenTypeError, match=r"configs\['attn'\]\.overlap must be bool, got 'yes'"):
        TILELANG.check_config(tilelang, "attn", TileLangAttnConfig(128, 1, 256, overlap="yes"), "sm_89")
    with pytest.raises(KernelgenTypeError, match=r"\.use_tma must be bool, got 1"):
        TRITON.check_config(spec.replace(schedule="q_centric", selector="given"), "attn", AttnConfig(use_tma=1),
                            ANY_ARCH)


def test_get_kernel_s_options_are_checked():
    """configs as a list (of configs, without their roles) and a validate_lists that is no bool are named."""
    spec = Spec(head_dim=64)
    with pytest.raises(KernelgenTypeError, match=r"configs must be a dict \{role: config\}.*got list"):
        kernelgen.get_kernel(spec, configs=[AttnConfig()])
    with pytest.raises(KernelgenTypeError, match=r"validate_lists must be a bool, got str 'yes'"):
        kernelgen.get_kernel(spec, validate_lists="yes")
    with pytest.raises(KernelgenTypeError, match=r"validate_lists must be a bool, got NoneType"):
        kernelgen.get_kernel(spec, validate_lists=None)

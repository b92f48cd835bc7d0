"""Config spaces of each backend's roles: every point feasible, infeasible points pruned before any compile,
defaults inside, pinned configs checked (`kernelgen.backends`: Backend.default_config, config_space,
infeasible, check_config, config_from_dict)."""
import dataclasses
import itertools

import pytest

import kernelgen
from kernelgen import AttnConfig, GluonAttnConfig, KernelgenTypeError, KernelgenValueError, SelectConfig, Spec
from kernelgen import TileLangAttnConfig, backends
from kernelgen.backends import gluon as gluon_backend
from kernelgen.backends import tilelang as tilelang_backend
from kernelgen.backends import triton as triton_backend
from kernelgen.backends.triton import SMEM_LIMIT_SM90, attn_smem_bytes
from kernelgen.dispatch import SparseAttention
from kernelgen.roles import get_role
from kernelgen.tuning.buckets import seq_bucket

TRITON, TILELANG, GLUON = (backends.get(name) for name in ("triton", "tilelang", "gluon"))

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
    for role in ("attn", "select", "bwd_dq", "bwd_dkdv"):
        backend, kernel_spec = _served(spec, role)
        space = backend.config_space(kernel_spec, role)
        assert space and all(type(c) is backend.config_type(role) for c in space), role
        assert all(backend.infeasible(kernel_spec, role, c) is None for c in space), role
        cfg = backend.default_config(kernel_spec, role)
        assert backend.infeasible(kernel_spec, role, cfg) is None, (role, cfg)
        if role == "select" and spec.top_k > 128:
            continue  # long lists: the default's chunk can exceed the space's largest (it stays feasible)
        assert cfg in space, (role, cfg)


def test_roles_a_backend_lacks_run_on_the_fallback():
    """Selection and list normalising run in Triton for every backend; asking a backend for a role it
    lacks is a clear error."""
    for name in ("tilelang", "gluon"):
        assert backends.runner(name, "attn").name == name
        assert backends.runner(name, "select") is TRITON and backends.runner(name, "lists") is TRITON
        with pytest.raises(KernelgenValueError, match=rf"backend='{name}' does not run role 'select'"):
            backends.get(name).default_config(Spec(head_dim=128, backend=name), "select")
    assert TRITON.config_type("lists") is None and TRITON.config_space(Spec(head_dim=64), "lists") == [None]
    with pytest.raises(KernelgenValueError, match="does not run role 'bwd'"):
        TRITON.config_space(Spec(head_dim=64), "bwd")


def test_shared_memory_bound_prunes_what_failed_on_the_h200():
    # Triton 3.6 on the H200 refused these (out of resource: shared memory, 278528 and 294912 B > 232448)
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=16, selector="given")
    for block_m, need in ((64, 278528), (128, 294912)):
        cfg = AttnConfig(block_m=block_m, num_warps=8, num_stages=4)
        assert attn_smem_bytes(spec, cfg) == need > SMEM_LIMIT_SM90
        assert "B of shared memory" in triton_backend.attn_infeasible(spec, cfg)
        assert TRITON.infeasible(spec, "attn", cfg) and cfg not in TRITON.config_space(spec, "attn")
    assert TRITON.infeasible(spec, "attn", AttnConfig(block_m=128, num_warps=8, num_stages=2)) is None


def test_select_space_respects_top_k():
    spec = Spec(head_dim=64, top_k=64)
    space = TRITON.config_space(spec, "select")
    assert space and all(c.chunk >= 64 and triton_backend.select_infeasible(spec, c) is None for c in space)


def test_seq_bucket():
    assert [seq_bucket(n) for n in (0, 1, 1024, 1025, 32768, 32769)] == [1024, 1024, 1024, 2048, 32768, 65536]
    with pytest.raises(ValueError):
        seq_bucket(-1)


def test_a_spec_no_config_fits_is_a_clear_error():
    with pytest.raises(KernelgenValueError, match="smaller kv_block"):
        TRITON.default_config(Spec(head_dim=256, kv_block=256), "attn")


def test_a_config_of_another_type_is_infeasible():
    spec = Spec(head_dim=64)
    assert TRITON.infeasible(spec, "attn", GluonAttnConfig()) == "GluonAttnConfig is no AttnConfig"
    assert TRITON.infeasible(spec, "select", AttnConfig()) == "AttnConfig is no SelectConfig"
    assert "takes no config" in TRITON.infeasible(spec, "lists", SelectConfig())
    assert TRITON.infeasible(spec, "lists", None) is None


@pytest.mark.parametrize("change", [dict(threads=512), dict(threads=64), dict(num_stages=4), dict(num_stages=0),
                                    dict(overlap="yes"), dict(pingpong=1), dict(overlap=False, pingpong=True),
                                    dict(block_m=64, threads=128, num_stages=1, pingpong=True)])
def test_tilelang_pinned_config_outside_the_kernel_s_range_is_refused(change):
    """A pinned TileLang config the kernel was never built for (thread count, stages, a non-bool switch)
    is a clear error, not a launch of an untested shape."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    cfg = TILELANG.default_config(spec, "attn")
    assert type(cfg) is TileLangAttnConfig
    TILELANG.check_config(spec, "attn", cfg)
    TILELANG.check_config(spec, "attn", dataclasses.replace(cfg, pingpong=True))  # overlap with two warpgroups: allowed
    with pytest.raises(KernelgenValueError, match="not feasible"):
        TILELANG.check_config(spec, "attn", dataclasses.replace(cfg, **change))


def test_tilelang_pingpong_needs_overlap_and_two_warpgroups():
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    space = TILELANG.config_space(spec, "attn")
    assert all(c.overlap and c.threads == 256 for c in space if c.pingpong)
    assert sum(c.pingpong for c in space) == sum(c.overlap and c.threads == 256 and not c.pingpong for c in space) > 0
    why = tilelang_backend.attn_infeasible(spec, TileLangAttnConfig(block_m=128, num_stages=2, threads=256,
                                                                    overlap=False, pingpong=True))
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
    space = GLUON.config_space(spec, "attn")
    assert {(c.block_m, c.num_stages) for c in space} == points
    assert all(type(c) is GluonAttnConfig and gluon_backend.attn_infeasible(spec, c) is None for c in space)
    assert GLUON.default_config(spec, "attn") == GluonAttnConfig(*default)
    selector, select_spec = _served(spec, "select")  # the Triton selector's
    assert selector is TRITON and select_spec == spec.replace(backend="triton")
    assert selector.default_config(select_spec, "select") in selector.config_space(select_spec, "select")


def test_gluon_shared_memory_bound():
    spec = _gluon(gqa_group=4)
    limit = SMEM_LIMIT_SM90 - gluon_backend.GLUON_BARRIER_BYTES
    assert gluon_backend.gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 4)) == 262144 > limit
    assert "262144 B of shared memory" in gluon_backend.attn_infeasible(spec, GluonAttnConfig(128, 4))
    assert gluon_backend.gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 3)) == 196608
    assert gluon_backend.attn_infeasible(spec, GluonAttnConfig(128, 3)) is None


@pytest.mark.parametrize("cfg", [dict(block_m=32), dict(block_m=256), dict(num_stages=1), dict(num_stages=5),
                                 dict(block_m=128, num_stages=4)])
def test_gluon_pinned_config_outside_the_kernel_s_range_is_refused(cfg):
    spec = _gluon(gqa_group=4)
    GLUON.check_config(spec, "attn", GluonAttnConfig())
    with pytest.raises(KernelgenValueError, match=r"configs\['attn'\] = .* is not feasible"):
        GLUON.check_config(spec, "attn", GluonAttnConfig(**cfg))
    with pytest.raises(KernelgenValueError, match=r"configs\['attn'\] = .* is not feasible"):
        SparseAttention(spec, {"attn": GluonAttnConfig(**cfg)})  # what get_kernel(configs=...) runs


def test_gluon_pinned_config_types():
    """A Gluon spec takes a GluonAttnConfig (and the Triton SelectConfig); "auto" takes any attention type,
    a Gluon one only where the Gluon kernel computes the spec."""
    spec = _gluon(gqa_group=4)
    with pytest.raises(KernelgenTypeError, match=r"must be a GluonAttnConfig for backend='gluon', got AttnConfig"):
        GLUON.check_config(spec, "attn", AttnConfig())
    with pytest.raises(KernelgenTypeError, match=r"must be a GluonAttnConfig for backend='gluon', got AttnConfig"):
        SparseAttention(spec, {"attn": AttnConfig()})
    with pytest.raises(KernelgenTypeError, match=r"must be a AttnConfig for backend='triton', got GluonAttnConfig"):
        TRITON.check_config(spec.replace(backend="triton"), "attn", GluonAttnConfig())
    with pytest.raises(KernelgenTypeError, match=r"must be a AttnConfig for backend='triton', got GluonAttnConfig"):
        SparseAttention(spec.replace(backend="triton"), {"attn": GluonAttnConfig()})
    SparseAttention(spec, {"select": SelectConfig(tiles=16)})  # the Triton selector's config
    with pytest.raises(KernelgenTypeError, match=r"must be a SelectConfig"):
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
        GLUON.default_config(spec, "attn")
    assert GLUON.config_space(spec, "attn") == []
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
    assert runner.infeasible(spec, role, cfg)
    with pytest.raises(KernelgenValueError, match=rf"configs\['{role}'\] = .* is not feasible for .*{why}"):
        runner.check_config(spec, role, cfg)


def test_a_selector_chunk_narrower_than_top_k_says_why():
    assert "chunk=16 blocks is fewer than next_pow2(top_k) = 32" in TRITON.infeasible(
        Spec(head_dim=64, kv_block=64, q_tile=64, top_k=32), "select", SelectConfig(tiles=16, chunk=16))

"""Config spaces: every point feasible, infeasible points pruned before any compile, defaults inside."""
import itertools

import pytest

from kernelgen import AttnConfig, Spec
from kernelgen.config import (SMEM_LIMIT_SM90, attn_feasible, attn_smem_bytes, config_space, default_config,
                              seq_bucket, select_feasible)

SPECS = [
    Spec(head_dim=d, kv_block=kv, q_tile=qt, top_k=tk, causal=c, gqa_group=g, selector=sel, backend=be)
    for d, kv, qt, tk, c, g, sel, be in itertools.product(
        (64, 128, 256), (32, 64, 128), (64, 128), (16, 256), (False, True), (1, 4), ("mean", "multi:4"),
        ("triton", "tilelang"))
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_defaults_are_points_of_their_spaces(spec):
    for role in ("attn", "select"):
        space = config_space(spec, role)
        cfg = default_config(spec, role)
        if role == "select" and spec.top_k > 128:
            continue  # long lists: the default's chunk can exceed the space's largest (it stays feasible)
        assert cfg in space, (role, cfg)


def test_shared_memory_bound_prunes_what_failed_on_the_h200():
    # Triton 3.6 on the H200 refused these (out of resource: shared memory, 278528 and 294912 B > 232448)
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=16, selector="given")
    for block_m, need in ((64, 278528), (128, 294912)):
        cfg = AttnConfig(block_m=block_m, num_warps=8, num_stages=4)
        assert attn_smem_bytes(spec, cfg) == need > SMEM_LIMIT_SM90
        assert not attn_feasible(spec, cfg) and cfg not in config_space(spec, "attn")
    assert attn_feasible(spec, AttnConfig(block_m=128, num_warps=8, num_stages=2))


def test_select_space_respects_top_k():
    spec = Spec(head_dim=64, top_k=64)
    assert all(c.chunk >= 64 and select_feasible(spec, c) for c in config_space(spec, "select"))


def test_seq_bucket():
    assert [seq_bucket(n) for n in (0, 1, 1024, 1025, 32768, 32769)] == [1024, 1024, 1024, 2048, 32768, 65536]
    with pytest.raises(ValueError):
        seq_bucket(-1)


def test_a_spec_no_config_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller kv_block"):
        default_config(Spec(head_dim=256, kv_block=256), "attn")


@pytest.mark.parametrize("change", [dict(threads=512), dict(threads=64), dict(num_stages=4), dict(num_stages=0),
                                    dict(overlap="yes"), dict(pingpong=1), dict(overlap=False, pingpong=True),
                                    dict(block_m=64, threads=128, num_stages=1, pingpong=True)])
def test_tilelang_pinned_config_outside_the_kernel_s_range_is_refused(change):
    """A pinned TileLang config the kernel was never built for (thread count, stages, a non-bool switch)
    is a clear error, not a launch of an untested shape."""
    import dataclasses

    from kernelgen.config import check_config

    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    cfg = default_config(spec, "attn")
    check_config(spec, "attn", cfg)
    check_config(spec, "attn", dataclasses.replace(cfg, pingpong=True))  # overlap with two warpgroups: allowed
    with pytest.raises(ValueError, match="not feasible"):
        check_config(spec, "attn", dataclasses.replace(cfg, **change))


def test_tilelang_pingpong_needs_overlap_and_two_warpgroups():
    from kernelgen.config import TileLangAttnConfig, tilelang_attn_infeasible

    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    space = config_space(spec, "attn")
    assert all(c.overlap and c.threads == 256 for c in space if c.pingpong)
    assert sum(c.pingpong for c in space) == sum(c.overlap and c.threads == 256 and not c.pingpong for c in space) > 0
    why = tilelang_attn_infeasible(spec, TileLangAttnConfig(block_m=128, num_stages=2, threads=256, overlap=False,
                                                            pingpong=True))
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
    from kernelgen.config import GluonAttnConfig, gluon_attn_feasible

    space = config_space(spec, "attn")
    assert {(c.block_m, c.num_stages) for c in space} == points
    assert all(type(c) is GluonAttnConfig and gluon_attn_feasible(spec, c) for c in space)
    assert default_config(spec, "attn") == GluonAttnConfig(*default)
    assert default_config(spec, "select") in config_space(spec, "select")  # the Triton selector's


def test_gluon_shared_memory_bound():
    from kernelgen.config import GLUON_BARRIER_BYTES, GluonAttnConfig, gluon_attn_feasible, gluon_attn_smem_bytes

    spec = _gluon(gqa_group=4)
    assert gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 4)) == 262144 > SMEM_LIMIT_SM90 - GLUON_BARRIER_BYTES
    assert not gluon_attn_feasible(spec, GluonAttnConfig(128, 4))
    assert gluon_attn_smem_bytes(spec, GluonAttnConfig(128, 3)) == 196608
    assert gluon_attn_feasible(spec, GluonAttnConfig(128, 3))


@pytest.mark.parametrize("cfg", [dict(block_m=32), dict(block_m=256), dict(num_stages=1), dict(num_stages=5),
                                 dict(block_m=128, num_stages=4)])
def test_gluon_pinned_config_outside_the_kernel_s_range_is_refused(cfg):
    from kernelgen.config import GluonAttnConfig, check_config

    spec = _gluon(gqa_group=4)
    check_config(spec, "attn", GluonAttnConfig())
    with pytest.raises(ValueError, match=r"configs\['attn'\] = .* is not feasible"):
        check_config(spec, "attn", GluonAttnConfig(**cfg))


def test_gluon_pinned_config_types():
    """A Gluon spec takes a GluonAttnConfig (and the Triton SelectConfig); "auto" takes any attention type,
    a Gluon one only where the Gluon kernel computes the spec."""
    from kernelgen.config import GluonAttnConfig, SelectConfig, attn_backend_of, check_config, config_from_dict

    spec = _gluon(gqa_group=4)
    with pytest.raises(TypeError, match=r"must be a GluonAttnConfig for backend='gluon', got AttnConfig"):
        check_config(spec, "attn", AttnConfig())
    with pytest.raises(TypeError, match=r"must be a AttnConfig for backend='triton', got GluonAttnConfig"):
        check_config(spec.replace(backend="triton"), "attn", GluonAttnConfig())
    check_config(spec, "select", SelectConfig(tiles=16))
    auto = spec.replace(backend="auto")
    for cfg in (AttnConfig(num_warps=8), GluonAttnConfig()):
        check_config(auto, "attn", cfg)
    with pytest.raises(ValueError, match="not feasible"):  # D=256: no Gluon kernel
        check_config(auto.replace(head_dim=256, kv_block=64), "attn", GluonAttnConfig(block_m=128))
    assert attn_backend_of(GluonAttnConfig()) == "gluon" and attn_backend_of(AttnConfig()) == "triton"
    with pytest.raises(TypeError, match="no attention config"):
        attn_backend_of(SelectConfig())
    assert config_from_dict("attn", {"block_m": 64, "num_stages": 3}, "gluon") == GluonAttnConfig(64, 3)
    assert GluonAttnConfig(64, 3).to_json() == '{"block_m": 64, "num_stages": 3}'


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
    from kernelgen.config import (AttnConfig, GluonAttnConfig, SelectConfig, TileLangAttnConfig,  # noqa: F401
                                  check_config, infeasible)

    spec = Spec(head_dim=64, kv_block=64, q_tile=128, top_k=16, backend=backend)
    cfg = eval(cfg)
    assert infeasible(spec, role, cfg)
    with pytest.raises(ValueError, match=rf"configs\['{role}'\] = .* is not feasible for .*{why}"):
        check_config(spec, role, cfg)


def test_a_selector_chunk_narrower_than_top_k_says_why():
    from kernelgen.config import SelectConfig, infeasible

    assert "chunk=16 blocks is fewer than next_pow2(top_k) = 32" in infeasible(
        Spec(head_dim=64, kv_block=64, q_tile=64, top_k=32), "select", SelectConfig(tiles=16, chunk=16))

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
                                    dict(overlap="yes")])
def test_tilelang_pinned_config_outside_the_kernel_s_range_is_refused(change):
    """A pinned TileLang config the kernel was never built for (thread count, stages, a non-bool switch)
    is a clear error, not a launch of an untested shape."""
    import dataclasses

    from kernelgen.config import check_config

    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, backend="tilelang")
    cfg = default_config(spec, "attn")
    check_config(spec, "attn", cfg)
    with pytest.raises(ValueError, match="not feasible"):
        check_config(spec, "attn", dataclasses.replace(cfg, **change))

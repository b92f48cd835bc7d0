"""Every feasible config of the Gluon forward compiles for sm_90 (ptxas included) on this GPU-less machine,
through its real launch path (kernelgen.backends.gluon.launch_attn, run by tools/offline_compile.py: TMA
descriptors over CPU tensors), and asks for the shared memory the tuner's estimate says: what only a Hopper
GPU would otherwise show (a layout the compiler refuses, an over-full shared memory) fails here, in CI."""
import dataclasses
import itertools
import os

import pytest

from checks import compile_offline, config_space, default_config
from kernelgen import Spec
from kernelgen.archs import ARCHS
from kernelgen.backends.gluon import GLUON_BARRIER_BYTES, gluon_attn_smem_bytes

pytest.importorskip("triton.backends.nvidia")
pytest.importorskip("triton.experimental.gluon")

# D x kv_block x q_tile x G x causal; given lists (the selector is Triton's, compiled by its own test)
SPECS = [Spec(head_dim=d, kv_block=kv, q_tile=qt, top_k=16, causal=causal, gqa_group=g, selector="given",
              backend="gluon")
         for d, kv, qt, g, causal in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 16), (False, True))]
CASES = [(spec, cfg) for spec in SPECS for cfg in config_space(spec, "attn", "sm_90")]
N = 1000  # not a multiple of any tile or block


def test_the_grid_holds_every_tunable_value():
    """The space is what the kernel takes: both row counts and every stage count occur, the default is a
    point of each spec's space, and only D=128 with 128-key blocks loses its 4-stage rings."""
    assert {cfg.block_m for _, cfg in CASES} == {64, 128}
    assert {cfg.num_stages for _, cfg in CASES} == {2, 3, 4}
    for spec in SPECS:
        space = config_space(spec, "attn", "sm_90")
        assert default_config(spec, "attn", "sm_90") in space
        big = spec.head_dim == spec.kv_block == 128
        assert max(c.num_stages for c in space) == (3 if big else 4), spec


def test_every_feasible_config_compiles_for_sm90_and_asks_the_estimated_shared_memory():
    # the lists are given: the selector is pinned (check_config wants a feasible one) but never compiled
    cases = [{"spec": spec.to_dict(), "attn": dataclasses.asdict(cfg), "n": N,
              "select": dataclasses.asdict(default_config(spec.replace(selector="mean"), "select", "sm_90"))}
             for spec, cfg in CASES]
    results = compile_offline(cases, "sm_90", processes=max(1, min(4, os.cpu_count() or 1)))
    for (spec, cfg), result in zip(CASES, results):
        assert "error" not in result, f"{spec} {cfg}: {result.get('error')}"
        kernels = dict(result["kernels"])
        assert set(kernels) == {"normalize_lists", "attn_fwd"}, kernels
        # the rings are all the shared memory the forward asks for, give or take its barriers: the
        # estimate decides which stage counts the tuner may try
        estimate = gluon_attn_smem_bytes(spec, cfg)
        assert estimate <= kernels["attn_fwd"] <= estimate + GLUON_BARRIER_BYTES, (spec, cfg, estimate, kernels)
        assert kernels["attn_fwd"] <= ARCHS["sm_90"].smem_per_block

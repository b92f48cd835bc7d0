"""Every Triton kernel compiles for sm_90 (ptxas included) on this GPU-less machine, through the Triton
backend's real launchers (tests/sm90_offline.py), and fits the H200's shared memory: what the interpreter
cannot see (a compiler assertion, an over-full shared memory) fails here, in CI, not on the next GPU run."""
import dataclasses

import pytest

from checks import compile_for_sm90, config_space, default_config
from kernelgen import AttnConfig, SelectConfig, Spec
from kernelgen.backends.triton import SMEM_LIMIT_SM90, attn_smem_bytes

pytest.importorskip("triton.backends.nvidia")

# (spec, attention config or None for the default, select config or None, sequence length)
BASE = [
    (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16), None, None, 4000),  # shape (a)
    (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, selector="given"),
     AttnConfig(block_m=64, num_warps=4, num_stages=2, kv_per_iter=2), None, 4000),
    (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4), None,
     SelectConfig(tiles=4, chunk=128, splits=2), 4000),  # shape (c), split selection
    (Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, selector="multi:4", local=2,
          sink=1), AttnConfig(block_m=128, num_warps=8, num_stages=2, use_tma=True), None, 3000),
    (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=32, causal=True, gqa_group=2), None, None, 4000),  # dense
    (Spec(head_dim=256, kv_block=32, q_tile=32, top_k=8, causal=True, gqa_group=2), None, None, 1000),
    (Spec(head_dim=64, kv_block=16, q_tile=32, top_k=64, selector="given"), None, None, 2000),  # long lists
    (Spec(head_dim=64, kv_block=32, q_tile=64, top_k=8, selector="multi:2", causal=True),
     None, SelectConfig(tiles=8, chunk=32, splits=4), 2000),
]
# the attention configs nearest the shared-memory limit (the estimate decides what the tuner may try)
EDGE_SPEC = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given")
EDGE = [(EDGE_SPEC, cfg, None, 2000) for cfg in config_space(EDGE_SPEC, "attn")
        if attn_smem_bytes(EDGE_SPEC, cfg) > 200_000 and cfg.num_warps == 8 and cfg.block_m >= 64]


def _case(spec, attn, select, n):
    attn = attn or default_config(spec, "attn")
    select = select or default_config(spec.replace(selector="mean") if not spec.selects else spec, "select")
    return {"spec": spec.to_dict(), "attn": dataclasses.asdict(attn), "select": dataclasses.asdict(select), "n": n}


def test_kernels_compile_for_sm90_and_fit_shared_memory():
    cases = BASE + EDGE
    assert len(EDGE) >= 2
    results = compile_for_sm90([_case(*c) for c in cases])
    for (spec, attn, select, n), result in zip(cases, results):
        assert "error" not in result, f"{spec} {attn} {select}: {result.get('error')}"
        kernels = dict(result["kernels"])
        expected = {"attn_fwd"} | ({"pool", "select_topk"} if spec.selects else {"normalize_lists"})
        if select is not None and select.splits > 1:
            expected.add("merge_topk")
        assert expected <= set(kernels), kernels
        assert all(shared <= SMEM_LIMIT_SM90 for shared in kernels.values()), kernels
        # the tuner's estimate (backends.triton.attn_smem_bytes) bounds what Triton asks for (give or take its
        # barriers), and is exact near the limit, where it decides which configs the tuner may try
        estimate = attn_smem_bytes(spec, attn or default_config(spec, "attn"))
        assert kernels["attn_fwd"] <= estimate + 1024, (estimate, kernels)
        if spec is EDGE_SPEC:
            assert estimate <= kernels["attn_fwd"] + 1024, (estimate, kernels)

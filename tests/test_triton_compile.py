"""Every Triton kernel compiles for sm_80, sm_89 and sm_90 (ptxas included) on this GPU-less machine, through
the Triton backend's real launchers (tests/offline_compile.py), with each arch's default configs and the points
of its space nearest its shared memory limit, and fits that arch's shared memory: what the interpreter cannot
see (a compiler assertion, an over-full shared memory on a 99 KB GPU) fails here, in CI, not on the next GPU run.
One compile process per arch, side by side."""
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from checks import compile_offline, config_space, default_config
from kernelgen import AttnConfig, SelectConfig, Spec
from kernelgen.archs import arch_facts
from kernelgen.backends.triton import attn_smem_bytes

pytest.importorskip("triton.backends.nvidia")

ARCH_NAMES = ("sm_80", "sm_89", "sm_90")
# (spec, select config or None for the default, sequence length): causal or not, D 64/128/256, kv_block
# 32/64/128, GQA 1/2/4, each selector (given lists: the lists kernel), split selection (its merge kernel)
SPECS = [
    (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16), None, 4000),  # shape (a)
    (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4),
     SelectConfig(tiles=4, chunk=128, splits=2), 4000),  # shape (c), split selection
    (Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="multi:4", local=2,
          sink=1), None, 3000),
    (Spec(head_dim=64, kv_block=128, q_tile=64, top_k=8, selector="given"), None, 2000),
    (Spec(head_dim=256, kv_block=32, q_tile=32, top_k=8, causal=True, gqa_group=2, selector="given"), None, 1000),
]
# the attention points that ask for the most shared memory, where the estimate decides what may be tried
EDGE_SPECS = [Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given"),
              Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, gqa_group=4, selector="given")]


class Case(NamedTuple):
    spec: Spec
    attn: AttnConfig
    select: SelectConfig  # compiled where the spec selects; else pinned only (dispatch checks it)
    n: int
    edge: bool  # a point near the arch's shared memory limit


def _largest(spec, arch, keep=lambda cfg: True) -> AttnConfig:
    """The point of `spec`'s space on `arch` that asks for the most shared memory (then the most rows)."""
    points = [c for c in config_space(spec, "attn", arch) if keep(c)]
    return max(points, key=lambda c: (attn_smem_bytes(spec, c, arch), c.block_m, c.num_warps))


def _cases(arch) -> list[Case]:
    """What to compile for `arch`: each spec with the arch's defaults, and the points of the largest shared
    memory (overall, at 64 rows, at one stage, through TMA where the arch has it, with two blocks a step)."""
    def select_default(spec):
        return default_config(spec if spec.selects else spec.replace(selector="mean"), "select", arch)

    cases = [Case(spec, default_config(spec, "attn", arch), select or select_default(spec), n, False)
             for spec, select, n in SPECS]
    big, two_blocks = EDGE_SPECS
    edges = {_largest(big, arch), _largest(big, arch, lambda c: c.block_m == 64),
             _largest(big, arch, lambda c: c.num_stages == 1)}
    if arch_facts(arch).tma:
        edges.add(_largest(big, arch, lambda c: c.use_tma))
    cases += [Case(big, cfg, select_default(big), 2000, True) for cfg in sorted(edges, key=str)]
    cases.append(Case(two_blocks, _largest(two_blocks, arch, lambda c: c.kv_per_iter == 2),
                      select_default(two_blocks), 2000, True))
    return cases


def _job(case: Case) -> dict:
    """tests/offline_compile.py's form of a case."""
    return {"spec": case.spec.to_dict(), "attn": dataclasses.asdict(case.attn),
            "select": dataclasses.asdict(case.select), "n": case.n}


def test_the_cases_cover_what_each_arch_allows():
    """sm_90's largest points load through TMA and ask for more than sm_80's 163 KB; sm_89's stay within 99 KB;
    the defaults differ where 99 KB forbids sm_90's."""
    for arch in ARCH_NAMES:
        cases = _cases(arch)
        assert any(c.attn.use_tma for c in cases) == (arch == "sm_90")
        assert any(c.attn.kv_per_iter == 2 for c in cases) and {1, 2} <= {c.attn.num_stages for c in cases}
        largest = max(attn_smem_bytes(c.spec, c.attn, arch) for c in cases)
        assert arch_facts(arch).smem_per_block - 16384 < largest <= arch_facts(arch).smem_per_block, arch
    assert default_config(EDGE_SPECS[0], "attn", "sm_89") != default_config(EDGE_SPECS[0], "attn", "sm_90")


def test_kernels_compile_for_each_arch_and_fit_its_shared_memory():
    cases = {arch: _cases(arch) for arch in ARCH_NAMES}
    with ThreadPoolExecutor(len(ARCH_NAMES)) as pool:  # one compile process per arch
        results = dict(zip(ARCH_NAMES, pool.map(lambda arch: compile_offline([_job(c) for c in cases[arch]], arch),
                                                ARCH_NAMES)))
    for arch in ARCH_NAMES:
        facts = arch_facts(arch)
        for (spec, attn, select, _, edge), result in zip(cases[arch], results[arch]):
            assert "error" not in result, f"{arch} {spec} {attn} {select}: {result.get('error')}"
            kernels = dict(result["kernels"])
            expected = {"attn_fwd"} | ({"pool", "select_topk"} if spec.selects else {"normalize_lists"})
            if spec.selects and select.splits > 1:
                expected.add("merge_topk")
            assert expected <= set(kernels), (arch, kernels)
            assert all(shared <= facts.smem_per_block for shared in kernels.values()), (arch, kernels)
            # the tuner's estimate (backends.triton.attn_smem_bytes) bounds what Triton asks for (give or take
            # its barriers), and near the limit, where it decides which configs may be tried, it is exact, but
            # for the half step of keys' rows it allows pipelined mma.sync kernels
            estimate, asked = attn_smem_bytes(spec, attn, arch), kernels["attn_fwd"]
            assert asked <= estimate + 1024, (arch, attn, estimate, kernels)
            if edge:
                keys = spec.kv_block * attn.kv_per_iter
                margin = keys // 2 * spec.head_dim * 2 if facts.mma == "mma.sync" and attn.num_stages > 1 else 0
                assert estimate <= asked + margin + 1024, (arch, attn, estimate, kernels)

"""Every Triton kernel compiles for sm_80, sm_89 and sm_90 (ptxas included) on this GPU-less machine, through
the Triton backend's real launchers (tools/offline_compile.py), with each arch's default configs and the points
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
from kernelgen.backends.triton import (attn_smem_bytes, bwd_dkdv_smem_bytes, bwd_dq_smem_bytes, decode_smem_bytes,
                                       index_select_smem_bytes, kv_attn_smem_bytes, kv_index_select_smem_bytes,
                                       kv_select_smem_bytes)
from kernelgen.roles import DECODE_SELECTION_ROLES, backward_roles, forward_roles

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
# the backward of SPECS' first two (D 64 and 128), the KV-centric schedule (its selector, and given lists) and
# the index selector (16-bit index vectors, Hi=4, Di=64; the attention is the multi:4 spec's kernel)
BACKWARD_SPECS = [spec for spec, _, _ in SPECS[:2]]
KV_SPECS = [Spec(head_dim=128, kv_block=64, top_k=16, causal=True, gqa_group=4, schedule="kv_centric", selector=s)
            for s in ("mean", "given")]
INDEX_SPEC = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="index")
KV_INDEX_SPEC = INDEX_SPEC.replace(schedule="kv_centric")
INDEX = {"heads": 4, "dim": 64}
# head dims that are no power of two (tiles padded to 128, masked): each schedule's forward, backward, decode step
# and prefill over a cache's pages of 16, on sm_90
PADDED_SPECS = [Spec(head_dim=96, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="multi:2",
                     local=1, sink=1),
                Spec(head_dim=80, kv_block=64, top_k=16, causal=True, gqa_group=2, schedule="kv_centric")]
# the fp8 KV caches the calls over a cache read on each arch (Q-centric, KV-centric): e4m3 from sm_89 on, e5m2 on any
FP8_CACHES = {"sm_80": ("float8_e5m2", "float8_e5m2"), "sm_89": ("float8_e4m3fn", "float8_e5m2"),
              "sm_90": ("float8_e5m2", "float8_e4m3fn")}

# each tuned role's shared memory estimate (spec, config, arch) and the kernel it estimates
ESTIMATES = {"attn": (attn_smem_bytes, "attn_fwd"),
             "kv_select": (kv_select_smem_bytes, "kv_select_topk"),
             "kv_attn": (lambda spec, cfg, arch: kv_attn_smem_bytes(spec, cfg), "kv_attn_partial"),
             "select_index": (lambda spec, cfg, arch: index_select_smem_bytes(spec, cfg), "select_index_topk"),
             "kv_select_index": (kv_index_select_smem_bytes, "kv_index_block_scores"),
             "decode_select_index": (lambda spec, cfg, arch: index_select_smem_bytes(spec, cfg),
                                     "select_index_topk_rows"),
             "kv_decode_select_index": (kv_index_select_smem_bytes, "kv_index_block_scores_rows"),
             "bwd_dq": (lambda spec, cfg, arch: bwd_dq_smem_bytes(spec, cfg), "attn_bwd_dq"),
             "bwd_dkdv": (lambda spec, cfg, arch: bwd_dkdv_smem_bytes(spec, cfg), "attn_bwd_dkdv"),
             "decode": (lambda spec, cfg, arch: decode_smem_bytes(spec, cfg), "decode_partial"),
             "attn_paged": (attn_smem_bytes, "attn_paged_fwd"),
             "kv_attn_union": (lambda spec, cfg, arch: attn_smem_bytes(spec, AttnConfig(block_m=cfg.block_m,
                                                                                        num_stages=cfg.num_stages), arch),
                               "kv_attn_union")}
# the kernels each role launches (beyond these: select's merge_topk with splits > 1)
KERNELS = {"lists": {"normalize_lists"}, "select": {"pool", "select_topk"}, "kv_select": {"pool", "kv_select_topk"},
           "select_index": {"select_index_topk"}, "kv_select_index": {"kv_index_block_scores", "kv_index_topk"}, "attn": {"attn_fwd"}, "kv_attn": {"kv_attn_partial", "kv_combine"},
           "bwd_delta": {"attn_bwd_delta"}, "bwd_dq": {"attn_bwd_dq"}, "bwd_dkdv": {"attn_bwd_dkdv"},
           "kv_bwd": {"kv_bwd_dkdv", "kv_bwd_dq_merge"}, "decode": {"decode_partial"},
           "decode_select": {"pool", "decode_select_topk"}, "kv_decode_select": {"pool", "kv_decode_select_topk"},
           "decode_select_index": {"select_index_topk_rows"},
           "kv_decode_select_index": {"kv_index_block_scores_rows", "kv_index_topk_rows"},
           "kv_attn_union": {"kv_attn_union"}, "kv_bwd_union": {"union_bwd_dq", "union_bwd_dkdv"},
           "attn_rows": {"attn_rows_fwd"}, "kv_attn_rows": {"kv_attn_rows_partial", "kv_combine"},
           "attn_paged": {"paged_lists", "attn_paged_fwd"}, "kv_attn_paged": {"kv_attn_paged_partial", "kv_combine"}}


class Case(NamedTuple):
    spec: Spec
    configs: dict  # {role: config}: compiled where the spec runs the role; else pinned only (dispatch checks it)
    n: int
    edge: bool = False  # the attention at a point near the arch's shared memory limit
    index: dict | None = None  # the index selector's tensors: {"heads", "dim", "dtype"}
    backward: bool = False  # the backward's roles too
    decode: bool = False  # a call of a few queries too: its selection where the spec selects, and configs["decode"]
    union: bool = False  # the per-query union design too (its backward where `backward`)
    rows: bool = False  # a prefill over a cache of per-row lengths too (attn_rows, kv_attn_rows), and paged
    fp8_cache: str | None = None  # the calls over a cache again over an fp8 cache of this dtype, and append_kv
    page_size: int | None = None  # the paged calls' pages (None: a block a page); with `decode`, a paged step too

    @property
    def roles(self) -> list[str]:
        """The roles tools/offline_compile.py compiles for the case."""
        lists, selection, attn = forward_roles(self.spec)
        union_bwd = ["kv_bwd_union"] if self.union and self.backward else []
        decode_selection = forward_roles(self.spec, 1)[1]
        decode = [*([decode_selection] if decode_selection else []), "decode"] if self.decode else []
        rows = [forward_roles(self.spec, cache_rows=True, paged=paged)[2] for paged in (False, True) if self.rows]
        return [selection or lists, attn, *decode, *rows, *(["kv_attn_union"] if self.union else []),
                *((*backward_roles(self.spec), *union_bwd) if self.backward else ())]


def _largest(spec, arch, keep=lambda cfg: True, role="attn"):
    """The point of `spec`'s space of `role` on `arch` that asks for the most shared memory (then the most
    rows)."""
    estimate = ESTIMATES[role][0]
    points = [c for c in config_space(spec, role, arch) if keep(c)]
    return max(points, key=lambda c: (estimate(spec, c, arch), getattr(c, "block_m", 0), c.num_warps))


def _defaults(spec, arch, roles) -> dict:
    return {role: default_config(spec, role, arch) for role in roles}


def _cases(arch) -> list[Case]:
    """What to compile for `arch`: each spec with the arch's defaults, and the points of the largest shared
    memory (overall, at 64 rows, at one stage, through TMA where the arch has it, with two blocks a step); the
    backward, KV-centric and index selector's roles with the arch's defaults and largest points."""
    def select_default(spec):
        return default_config(spec if spec.selects else spec.replace(selector="mean"), "select", arch)

    cases = [Case(spec, {"attn": default_config(spec, "attn", arch), "select": select or select_default(spec)}, n,
                  backward=spec in BACKWARD_SPECS) for spec, select, n in SPECS]
    big, two_blocks = EDGE_SPECS
    edges = {_largest(big, arch), _largest(big, arch, lambda c: c.block_m == 64),
             _largest(big, arch, lambda c: c.num_stages == 1)}
    if arch_facts(arch).tma:
        edges.add(_largest(big, arch, lambda c: c.use_tma))
    cases += [Case(big, {"attn": cfg, "select": select_default(big)}, 2000, True) for cfg in sorted(edges, key=str)]
    cases.append(Case(two_blocks, {"attn": _largest(two_blocks, arch, lambda c: c.kv_per_iter == 2),
                                   "select": select_default(two_blocks)}, 2000, True))
    # the backward's largest points (its forward: the defaults' kernels again)
    cases += [Case(spec, {**_defaults(spec, arch, ["attn", "select"]),
                          **{role: _largest(spec, arch, role=role) for role in ("bwd_dq", "bwd_dkdv")}}, 2000,
                   backward=True) for spec in BACKWARD_SPECS]
    for spec in KV_SPECS:  # with their backward, decode, a prefill over cache rows and the union design (defaults)
        cases.append(Case(spec, _defaults(spec, arch, [r for r in forward_roles(spec)[1:] if r] + ["decode"]), 2000,
                          backward=True, decode=True, union=True, rows=True,
                          fp8_cache=FP8_CACHES[arch][1] if spec.selector == "mean" else None,
                          page_size=16 if spec.selector == "mean" else None))  # vLLM's pages: 4 a block
    for spec in PADDED_SPECS if arch == "sm_90" else ():  # the masks are no arch's: one arch's compile shows them
        cases.append(Case(spec, _defaults(spec, arch, [r for r in forward_roles(spec)[1:] if r] + ["decode"]), 2000,
                          backward=True, decode=True, union=spec.per_query, rows=True, page_size=16))
    # the union design's largest point, 128 rows of 8 queries at G = 16
    union_spec = KV_SPECS[1].replace(gqa_group=16)
    cases.append(Case(union_spec, {"kv_attn_union": _largest(union_spec, arch, lambda c: c.tile_q == 8,
                                                             role="kv_attn_union")}, 2000, union=True))
    # decode over Q-centric lists: the arch's default, and its largest point at D 256
    for spec, cfg, fp8 in ((SPECS[1][0], default_config(SPECS[1][0], "decode", arch), FP8_CACHES[arch][0]),
                           (SPECS[4][0], _largest(SPECS[4][0], arch, role="decode"), None)):
        cases.append(Case(spec, {**_defaults(spec, arch, ["attn", "select"]), "decode": cfg}, 2000, decode=True,
                          rows=True, fp8_cache=fp8, page_size=16 if fp8 else None))
    # a paged prefill's largest point at D 256 (the forward's loop through pointers, at the most shared memory)
    cases.append(Case(SPECS[4][0], {**_defaults(SPECS[4][0], arch, ["attn", "select"]),
                                    "attn_paged": _largest(SPECS[4][0], arch, role="attn_paged")}, 2000, rows=True))
    cases.append(Case(KV_SPECS[0], {role: _largest(KV_SPECS[0], arch, role=role) for role in ("kv_select", "kv_attn")},
                      2000))
    for spec, (selection, attn) in ((INDEX_SPEC, ("select_index", "attn")),
                                    (KV_INDEX_SPEC, ("kv_select_index", "kv_attn"))):  # either schedule's
        for dtype in ("float16", "bfloat16"):  # bf16: a decode call too, its selection over a cache's rows
            decode = dtype == "bfloat16"
            roles = [selection, attn, *([DECODE_SELECTION_ROLES[selection], "decode"] if decode else [])]
            cases.append(Case(spec, _defaults(spec, arch, roles), 2000, index={**INDEX, "dtype": dtype},
                              decode=decode))
        cases.append(Case(spec, {selection: _largest(spec, arch, role=selection),
                                 attn: default_config(spec, attn, arch)}, 2000, index={**INDEX, "dtype": "float16"}))
    # the per-query index selector holding its index vectors: the default's shape, and the largest such point
    held = dataclasses.replace(default_config(KV_INDEX_SPEC, "kv_select_index", arch), hold=True)
    for cfg in (held, _largest(KV_INDEX_SPEC, arch, lambda c: c.hold, role="kv_select_index")):
        cases.append(Case(KV_INDEX_SPEC, {"kv_select_index": cfg, "kv_attn": default_config(KV_INDEX_SPEC, "kv_attn", arch)},
                          2000, index={**INDEX, "dtype": "bfloat16"}))
    return cases


def _job(case: Case) -> dict:
    """tools/offline_compile.py's form of a case."""
    job = {"spec": case.spec.to_dict(), "n": case.n, "backward": case.backward, "union": case.union, "rows": case.rows,
           **{role: dataclasses.asdict(cfg) for role, cfg in case.configs.items()},
           **({"fp8_cache": case.fp8_cache} if case.fp8_cache else {}),
           **({"page_size": case.page_size} if case.page_size else {})}
    return job if case.index is None else {**job, "index": case.index}


def test_the_cases_cover_what_each_arch_allows():
    """sm_90's largest points load through TMA and ask for more than sm_80's 163 KB; sm_89's stay within 99 KB;
    the defaults differ where 99 KB forbids sm_90's. Every role of every schedule and selector is compiled."""
    for arch in ARCH_NAMES:
        cases = _cases(arch)
        attn = [c.configs["attn"] for c in cases if "attn" in c.roles]
        assert any(a.use_tma for a in attn) == (arch == "sm_90")
        assert any(a.kv_per_iter == 2 for a in attn) and {1, 2} <= {a.num_stages for a in attn}
        largest = max(attn_smem_bytes(c.spec, c.configs["attn"], arch) for c in cases if "attn" in c.roles)
        assert arch_facts(arch).smem_per_block - 16384 < largest <= arch_facts(arch).smem_per_block, arch
        assert {role for c in cases for role in c.roles} == set(KERNELS)
        assert {c.fp8_cache for c in cases} - {None} == set(FP8_CACHES[arch])
    assert default_config(EDGE_SPECS[0], "attn", "sm_89") != default_config(EDGE_SPECS[0], "attn", "sm_90")


def test_kernels_compile_for_each_arch_and_fit_its_shared_memory():
    cases = {arch: _cases(arch) for arch in ARCH_NAMES}
    with ThreadPoolExecutor(len(ARCH_NAMES)) as pool:  # one compile process per arch
        results = dict(zip(ARCH_NAMES, pool.map(lambda arch: compile_offline([_job(c) for c in cases[arch]], arch),
                                                ARCH_NAMES)))
    for arch in ARCH_NAMES:
        facts = arch_facts(arch)
        for case, result in zip(cases[arch], results[arch]):
            spec, configs = case.spec, case.configs
            assert "error" not in result, f"{arch} {spec} {configs}: {result.get('error')}"
            kernels = dict(result["kernels"])
            expected = set().union(*(KERNELS[role] for role in case.roles))
            if any(role in case.roles and configs[role].splits > 1 for role in ("select", "decode_select_index")):
                expected.add("merge_topk")
            if case.fp8_cache:
                expected.add("append_rows")
            if case.page_size and not case.spec.per_query:
                expected.add("pool_paged")  # the step's selection, pooled from the pages
            assert expected <= set(kernels), (arch, kernels)
            assert all(shared <= facts.smem_per_block for shared in kernels.values()), (arch, kernels)
            # the tuner's estimates (backends.triton's *_smem_bytes) bound what Triton asks for (give or take its
            # barriers)
            for role in set(case.roles) & set(configs) & set(ESTIMATES):
                estimate, name = ESTIMATES[role]
                assert kernels[name] <= estimate(spec, configs[role], arch) + 1024, (arch, role, configs[role], kernels)
            # ... and near the limit, where it decides which configs may be tried, the attention's is exact, but
            # for the half step of keys' rows it allows pipelined mma.sync kernels
            if case.edge:
                attn = configs["attn"]
                estimate, asked = attn_smem_bytes(spec, attn, arch), kernels["attn_fwd"]
                keys = spec.kv_block * attn.kv_per_iter
                margin = keys // 2 * spec.head_dim * 2 if facts.mma == "mma.sync" and attn.num_stages > 1 else 0
                assert estimate <= asked + margin + 1024, (arch, attn, estimate, kernels)


def test_offline_compile_reports_each_kernels_registers_spills_products_and_loop():
    """tools/offline_compile.py's "resources" (what tools/kv_bwd_sweep.py --ptxas prints): ptxas's register
    count within the arch's 255, no spills at the default, and the attention's products as wgmma on sm_90."""
    spec = SPECS[3][0]  # given lists: the lists kernel, then the attention
    (result,) = compile_offline([{"spec": spec.to_dict(), "n": 1000, "resources": True}], "sm_90")
    assert "error" not in result, result
    used = {r["name"]: r for r in result["resources"]}
    assert set(used) == {name for name, _ in result["kernels"]}
    attn = used["attn_fwd"]
    assert 0 < attn["registers"] <= 255 and attn["spill_stores"] == 0 and attn["wgmma"] >= 2, attn
    # its loop over the list: the two products of a step (issued as several wgmma instructions), one exp2
    # per score and thread at least, and every instruction of the iteration counted once, by kind
    loop = attn["loop"]
    assert loop["mma"] >= 2 and loop["mufu"] >= 16, loop
    assert loop["instructions"] == sum(v for k, v in loop.items() if k != "instructions"), loop


def _tool(name: str, *args, stdin: str = ""):
    """tools/<name>.py run as a maintainer runs it: its exit status, stdout and stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "tools" / f"{name}.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


@pytest.mark.parametrize("name", ["offline_compile", "kv_union_sweep", "kv_attn_sweep", "carry_winners"])
def test_maintainer_tools_answer_help_without_a_gpu(name):
    result = _tool(name, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {name}.py") and "Maintainers:" in result.stdout


@pytest.mark.parametrize("name, args", [("kv_bwd_sweep", ("kv_nsa32k",)), ("kv_attn_sweep", ())])
def test_maintainer_sweeps_say_they_need_a_gpu(name, args):
    """A sweep run without a GPU, as docs/PERF.md's Reproduce gives it: one line saying it needs one, no
    traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the sweeps run on a GPU here")
    result = _tool(name, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "needs a CUDA GPU" in lines[0], result.stderr[-2000:]


@pytest.mark.parametrize("stdin, says", [("", "stdin is empty"), ("[{'spec'", "stdin is not JSON"),
                                         ('{"spec": {}}', "not a list"), ("[1]", "objects (cases)")])
def test_offline_compile_says_what_it_expects_on_stdin(stdin, says):
    """Run by hand with nothing or the wrong thing piped in: one line saying what it reads, exit status 2."""
    result = _tool("offline_compile", "sm_90", stdin=stdin)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "a JSON list of cases on stdin" in lines[0], result.stderr


def test_offline_compile_names_a_bad_arch():
    result = _tool("offline_compile", "sm90", stdin="[]")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "arch='sm90'" in lines[0] and "sm_XY" in lines[0]

"""kernelgen.bench on the CPU: the interpreter smoke run, shape-name errors, FlexAttention's BlockMask
holding exactly the lists, and the FLOP counts."""
import importlib
import importlib.util
import itertools

import pytest
import torch

import kernelgen
from kernelgen import bench, reference
from kernelgen.bench.anchors import flex_block_mask, flex_kernel_options, flex_token_mask
from kernelgen.errors import KernelgenValueError
from kernelgen.workloads import (KV_CENTRIC_SHAPES, SHAPES, BenchShape, dense_flops, random_query_lists, useful_flops,
                                 visible_pairs)

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of kernelgen.bench")
runner = importlib.import_module("kernelgen.bench.measure")


def _strict(constant):
    raise AssertionError(f"{constant} in a JSON file: strict JSON has null there")


@needs_cpu
def test_main_tiny_smoke_run(tmp_path, capsys):
    (tmp_path / "bench.jsonl").write_text('{"shape": "an earlier run"}\n')
    assert bench.main(shapes="tiny", out=tmp_path, stall_timeout=0) == 0
    printed = capsys.readouterr().out
    assert bench.NO_GPU_MESSAGE in printed and "smoke run OK" in printed
    import json

    rows = json.loads((tmp_path / "bench.json").read_text(), parse_constant=_strict)
    lines = (tmp_path / "bench.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=_strict) for line in lines] == rows  # this run's rows alone
    assert all(r["ms"] is None and r["tflops"] is None for r in rows)  # no timings on the CPU: null, not NaN
    assert bench.plot(tmp_path) is None and "no timed rows" in capsys.readouterr().out
    impls = {r["impl"] for r in rows}
    assert {"kernelgen given", "kernelgen mean (select+attn)"} <= impls
    given = next(r for r in rows if r["impl"] == "kernelgen given")
    assert given["backend"] in kernelgen.backends.names() and given["config_source"]
    assert all(r["rel_err_vs_reference"] < 1e-2 for r in rows)
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench.jsonl").exists()


def test_plot_says_why_there_is_none(tmp_path, capsys):
    assert bench.plot(tmp_path) is None and "no plot" in capsys.readouterr().out  # no bench.json
    (tmp_path / "bench.json").write_text('[{"shape": "tiny", "impl": "kernelgen given", "ms": 1.5, "tflops": null}]')
    png = bench.plot(tmp_path)
    if importlib.util.find_spec("matplotlib"):
        assert png and (tmp_path / "bench.png").stat().st_size > 0
    else:
        assert png is None and "matplotlib is not installed" in capsys.readouterr().out


def test_unknown_shape_is_one_clear_error():
    with pytest.raises(KernelgenValueError, match="nope") as info:
        bench.main(shapes="nope,a32k", stall_timeout=0)
    message = str(info.value)
    assert "\n" not in message and "a32k" in message and "tiny" in message  # names the known shapes
    with pytest.raises(KernelgenValueError, match="nada"):
        bench.main(shapes="tiny", sweep="nada", stall_timeout=0)


@needs_cpu
def test_gpu_shapes_are_skipped_on_the_cpu(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(runner, "run", lambda names, *args, **kwargs: ran.append(list(names)) or [])
    assert bench.main(shapes=["a32k", "b"], overhead=True, stall_timeout=0) == 0
    assert ran == [["tiny"]]  # the smoke shape only: a32k is never run in the interpreter
    printed = capsys.readouterr().out
    assert "a32k" in printed and "b" in printed and "skipped" in printed


def _lists_example():
    """Lists with empty slots, an out-of-range id, a repeated id and blocks above the causal diagonal."""
    shape = BenchShape("t", 1, 4, 2, 200, 256, 64, 64, 64, 3, True)
    spec = shape.spec("given")
    idx = torch.tensor([[[[0, -1, 7], [1, 0, 0], [2, 3, -1], [3, 1, 2]],
                         [[0, 3, -1], [1, -1, -1], [0, 2, 2], [-1, 0, 9]]]], dtype=torch.int32)
    return shape, spec, idx


def test_flex_block_mask_holds_exactly_the_lists():
    shape, spec, idx = _lists_example()
    mask = flex_block_mask(idx, spec, shape)
    n_blocks = spec.n_kv_blocks(shape.n_k)
    # its blocks (full and partial together) are the lists' valid ids, per query head
    want = torch.zeros(1, 2, idx.shape[2], n_blocks, dtype=torch.bool)
    for b, h, t, j in itertools.product(*(range(s) for s in idx.shape)):
        block = int(idx[b, h, t, j])
        if 0 <= block < n_blocks:
            want[b, h, t, block] = True
    want = want.repeat_interleave(spec.gqa_group, 1)
    assert torch.equal(mask.to_dense().bool(), want)
    # and the pairs its fused kernel sees are the lists' visible pairs (bottom-right causal, n_q < n_k)
    pairs = reference.token_mask(idx, spec, shape.n_q, shape.n_k).repeat_interleave(spec.gqa_group, 1)
    assert torch.equal(flex_token_mask(mask), pairs)
    # a repeated id counts once, as in kernelgen's lists
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == int(want.sum())


def test_flex_block_mask_of_the_selector_lists():
    shape = SHAPES["tiny"]
    spec = shape.spec("mean")
    q, k, _ = shape.inputs("cpu", torch.float16)
    idx = kernelgen.get_kernel(spec).select(q, k)
    pairs = reference.token_mask(idx, spec, shape.n_q, shape.n_k).repeat_interleave(spec.gqa_group, 1)
    assert torch.equal(flex_token_mask(flex_block_mask(idx, spec, shape)), pairs)
    assert flex_kernel_options(spec) == {"BLOCK_M": 64, "BLOCK_N": 64, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}
    assert flex_kernel_options(SHAPES["c"].spec()) is None


@pytest.mark.parametrize("n_q,n_k,causal", [(7, 7, True), (5, 9, True), (9, 5, True), (6, 11, False)])
def test_dense_flops_counts_every_visible_pair(n_q, n_k, causal):
    shape = BenchShape("s", 2, 3, 1, n_q, n_k, 64, 64, 64, 1, causal)
    pairs = sum(1 for i in range(n_q) for j in range(n_k) if not causal or j <= i + n_k - n_q)
    assert dense_flops(shape) == 4.0 * 64 * 2 * 3 * pairs


def test_useful_flops_counts_the_listed_visible_pairs():
    shape, spec, _ = _lists_example()
    idx = torch.tensor([[[[0, -1, 7], [1, 0, -1], [2, 3, -1], [3, 1, 2]],  # no repeated ids
                         [[0, 3, -1], [1, -1, -1], [0, 2, -1], [-1, 0, 9]]]], dtype=torch.int32)
    pairs = reference.token_mask(idx, spec, shape.n_q, shape.n_k)  # [B, Hkv, n_q, n_k]
    assert torch.equal(visible_pairs(idx, spec, shape.n_q, shape.n_k), pairs.sum(dim=(2, 3)))
    assert useful_flops(idx, spec, shape.n_q, shape.n_k) == 4.0 * spec.head_dim * spec.gqa_group * float(pairs.sum())
    # every block of every tile listed: the dense causal count
    full = BenchShape("f", 1, 1, 1, 256, 256, 64, 64, 64, 4, True)
    every = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4)
    assert useful_flops(every, full.spec("given"), 256, 256) == dense_flops(full)


def test_per_shape_backends_are_precompiled_with_their_served_config(monkeypatch):
    """Every registered backend compiled per problem shape that can serve a shape gets its served attention
    config built first (`kernelgen.tuning.worker.precompile`), on the role's kernel spec."""
    from dataclasses import dataclass

    from kernelgen import backends
    from kernelgen.backends import Backend, RoleImpl
    from kernelgen.roles import get_role
    from kernelgen.tuning import worker

    @dataclass(frozen=True)
    class PlugConfig:
        block_m: int = 32

    class PerShapePlugin(Backend):
        name = "bench-test-per-shape"
        devices = ("cuda", "cpu")
        per_shape = True
        roles = {"attn": RoleImpl(launch=lambda *args: None, config_type=PlugConfig,
                                  default=lambda spec, arch: PlugConfig())}

    jobs, lines = [], []
    monkeypatch.setattr(worker, "precompile", lambda batch: (jobs.extend(batch), (0.5, []))[1])
    backends.register(PerShapePlugin())
    try:
        runner._precompile_per_shape(["tiny"], torch.device("cpu"), torch.float16, log=lines.append)
    finally:
        backends.unregister(PerShapePlugin.name)
    shape = SHAPES["tiny"]
    spec = get_role("attn").kernel_spec(shape.spec("given"), PerShapePlugin.name)
    assert (PerShapePlugin.name, spec.to_json(), "attn", {"block_m": 32},
            [(shape.batch, shape.heads_kv, shape.n_q, shape.n_k)], "float16", "cpu") in jobs
    assert all(backends.get(job[0]).per_shape for job in jobs if job[0] != PerShapePlugin.name)
    assert lines and lines[0].startswith(f"precompiled {len(jobs)} per-shape forwards")


@pytest.mark.parametrize("causal,n_q,n_k", [(True, 200, 200), (True, 100, 180), (False, 130, 160)])
def test_random_query_lists(causal, n_q, n_k):
    """Per-query lists: only visible blocks, the diagonal block held, no repeats, canonical, deterministic."""
    spec = kernelgen.Spec(head_dim=64, kv_block=16, top_k=4, causal=causal, selector="given", schedule="kv_centric")
    lists = random_query_lists(spec, 2, 3, n_q, n_k, "cpu", seed=5)
    assert lists.dtype == torch.int32 and lists.shape == (2, 3, n_q, 4)
    assert torch.equal(lists, random_query_lists(spec, 2, 3, n_q, n_k, "cpu", seed=5))
    assert not torch.equal(lists, random_query_lists(spec, 2, 3, n_q, n_k, "cpu", seed=6))
    n_blocks = spec.n_kv_blocks(n_k)
    for i in range(n_q):
        last_key = i + n_k - n_q
        visible = range(last_key // 16 + 1) if causal else range(n_blocks)
        for row in lists[:, :, i].reshape(-1, 4).tolist():
            held = [b for b in row if b >= 0]
            assert row == held + [-1] * (4 - len(held)) and held == sorted(set(held)), row
            assert set(held) <= set(visible) and len(held) == min(4, len(visible)), (i, row)
            if causal and last_key >= 0:
                assert last_key // 16 in held, (i, row)
    assert random_query_lists(spec, 1, 1, n_q, n_k, "cpu").shape[-1] == 4


@pytest.mark.parametrize("causal,n_q,n_k,q_tile", [(True, 200, 200, 16), (True, 100, 180, 32), (False, 130, 160, 32)])
def test_flex_block_mask_of_per_query_lists_holds_exactly_them(causal, n_q, n_k, q_tile):
    spec = kernelgen.Spec(head_dim=64, kv_block=16, top_k=4, causal=causal, gqa_group=2, selector="given",
                          schedule="kv_centric")
    lists = random_query_lists(spec, 2, 2, n_q, n_k, "cpu", seed=1)
    block_mask = kernelgen.to_block_mask(lists, spec, n_q, n_k, q_block=q_tile)  # as `bench --kv-centric` builds it
    assert block_mask.BLOCK_SIZE == (q_tile, 16)
    want = reference.token_mask(lists, spec, n_q, n_k).repeat_interleave(spec.gqa_group, 1)
    assert torch.equal(flex_token_mask(block_mask), want)


def test_kv_centric_shapes_and_fla_limits():
    from kernelgen.bench.kv_centric import fla_nsa_unsupported

    assert set(KV_CENTRIC_SHAPES).isdisjoint(SHAPES)
    b8, nsa, d64 = (KV_CENTRIC_SHAPES[n] for n in ("kv_b8", "kv_nsa32k", "kv_d64_64k"))
    assert (b8.batch, b8.heads_q, b8.heads_kv, b8.head_dim, b8.n_q, b8.spec().n_kv_blocks(b8.n_k), b8.top_k,
            b8.causal) == (8, 16, 1, 128, 4096, 32, 16, False)
    assert (nsa.heads_q, nsa.heads_kv, nsa.n_k, nsa.kv_block, nsa.causal) == (64, 4, 32768, 64, True)
    assert (d64.heads_q, d64.heads_kv, d64.head_dim, d64.n_k, d64.kv_block, d64.causal) == (16, 1, 64, 65536, 64, True)
    assert all(s.spec().schedule == "kv_centric" for s in (b8, nsa, d64))
    assert "causal" in fla_nsa_unsupported(b8.spec("given"))
    assert fla_nsa_unsupported(nsa.spec("given")) is None and fla_nsa_unsupported(d64.spec("given")) is None


def test_context_parallel_smoke_run(monkeypatch, tmp_path):
    """The context-parallel bench at its CPU size, the timer stubbed (1 ms a piece): both ranks'
    pieces, forward and backward, match one GPU, and the rows hold the ratios, bytes and projections."""
    import json

    from kernelgen.bench import context_parallel as cp

    monkeypatch.setattr(cp, "_bench", lambda fn: 1.0)
    lines = []
    rows = cp.run_context_parallel(out_dir=tmp_path, log=lines.append, device="cpu", **cp.SMOKE)
    assert [r["kind"] for r in rows] == list(cp.LIST_KINDS) == ["random", "local_heavy"]
    assert json.loads((tmp_path / "context_parallel.json").read_text())[1]["kind"] == "local_heavy"
    for row in rows:
        assert all(row[f"rel_diff_{path}_{x}"] < 1e-4 for path in cp.PATHS for x in ("o", "dq", "dk", "dv")), row
        assert row["one_gpu_fwd_bwd_ms"] == 2.0
        assert row["dense_fwd_ratio"] == 3.0 and row["dense_fwd_bwd_ratio"] == 3.0  # 2 steps + merge per pass
        assert row["sparse_fwd_ratio"] == 3.0 and row["sparse_fwd_bwd_ratio"] == 3.0
        assert row["dense_bytes_fwd_bwd"] == 4 * row["dense_bytes_fwd"]  # K/V twice, dK/dV sums twice (all fp32)
        assert row["sparse_dense_bytes_ratio_fwd"] == row["sparse_bytes_fwd"] / row["dense_bytes_fwd"]
        assert row["projected_2gpu_dense_fwd_bwd_ms"] > row["projected_2gpu_dense_fwd_ms"] >= 3.0
        sparse = row["ranks"]["sparse"]
        assert [r["rank"] for r in sparse] == [0, 1] and sparse[0]["requested_blocks"] > 0
    assert any("sparse/dense bytes" in line for line in lines)


def test_backward_timing_replays_the_step_without_touching_grad(monkeypatch):
    """The training bench's graph figures time a step that returns its gradients (a captured step cannot
    accumulate into .grad), and the backward alone is the step less the forward, eager and replayed."""
    import triton.testing

    from kernelgen.bench import backward, measure

    x = torch.randn(4, requires_grad=True)
    grad = torch.ones(4)
    replayed = []

    def graph(fn, log=print):
        replayed.append(fn())
        return 3.0 if isinstance(replayed[-1], tuple) else 1.25

    def bench(fn, grad_to_none=(), **kwargs):  # the step fills x.grad, the forward alone does not
        fn()
        ms = 4.0 if x.grad is not None else 1.5
        for leaf in grad_to_none:
            leaf.grad = None
        return ms

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    monkeypatch.setattr(backward, "_bench_graph", graph)
    times = backward._timed(lambda: x * 2, [x], grad)
    host = times.pop("host_ms")  # the host's enqueue of one step, timed for real
    assert times == dict(fwd_bwd_ms=4.0, bwd_ms=2.5, fwd_bwd_graph_ms=3.0, bwd_graph_ms=1.75)
    assert 0 < host < 1000 and x.grad is None  # the timing leaves no gradient behind
    step_grads = replayed[0]
    assert torch.equal(step_grads[0], torch.full((4,), 2.0))
    monkeypatch.setattr(backward, "_bench_graph", measure._bench_graph)  # a step that cannot be captured

    def capture_fails(fn, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", capture_fails)
    logged = []
    assert backward._timed(lambda: x * 2, [x], grad, logged.append, "a32k cudnn")["bwd_graph_ms"] is None
    assert logged and all(line.startswith("a32k cudnn: (graph timing failed: RuntimeError") for line in logged)


def test_dense_anchor_attends_over_repeated_k_and_v_that_are_leaves():
    """The dense anchors' K/V are k and v repeated to the query heads, as leaves of their own (a step over
    views of k and v does not capture in a CUDA graph), requiring grad as k and v do."""
    from kernelgen.bench.anchors import sdpa_dense_anchors

    spec = kernelgen.Spec(head_dim=64, kv_block=16, top_k=2, gqa_group=2, causal=True)
    q = torch.randn(1, 4, 32, 64, requires_grad=True)
    k, v = torch.randn(1, 2, 32, 64, requires_grad=True), torch.randn(1, 2, 32, 64)
    anchor = sdpa_dense_anchors(q, k, v, spec)[0]
    aq, kd, vd = anchor.leaves
    assert aq is q and kd.is_leaf and vd.is_leaf and kd.requires_grad and not vd.requires_grad
    assert torch.equal(kd, k.repeat_interleave(2, 1)) and torch.equal(vd, v.repeat_interleave(2, 1))
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    assert torch.allclose(anchor.fn(), want)
    dq, dkd = torch.autograd.grad(anchor.fn(), (q, kd), torch.ones_like(q))
    assert dkd.shape == (1, 4, 32, 64) and dq.shape == q.shape


@pytest.mark.parametrize("flag, cases", [
    ("--kv-centric", ((["--shapes", "kv_nope"], "kv_nope"), (["--backward"], "give one"))),
    ("--decode", ((["--shapes", "dec_nope"], "dec_nope"), (["--kv-centric"], "give one"),
                  (["--context-parallel"], "give it alone"))),
    ("--padded", ((["--shapes", "pad_nope"], "pad_nope"), (["--decode"], "give one"))),
    ("--chunked", ((["--shapes", "chunk_nope"], "chunk_nope"), (["--padded"], "give one")))])
def test_gpu_only_benches_answer_in_one_line_on_a_cpu(flag, cases, tmp_path):
    """On a CPU each GPU-only bench is one line on stderr and exit status 2, as are its unknown shapes and a
    second bench flag; nothing is written."""
    from typer.testing import CliRunner

    from kernelgen.cli import app

    runner = CliRunner()
    for args, word in ((["--out", str(tmp_path / "out")], "CUDA GPU"), *cases):
        result = runner.invoke(app, ["bench", flag, *args])
        assert result.exit_code == 2, (result.exit_code, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kernelgen: error: ") and word in lines[0], result.stderr
        assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_padded_bench_rows_run_from_n_down_to_about_half():
    from kernelgen.bench.padded import _lengths

    lengths = _lengths(8192)
    assert lengths[0] == 8192 and lengths == sorted(lengths, reverse=True) and 4000 <= lengths[-1]


def test_decode_shapes_are_decode_calls():
    from kernelgen.roles import DECODE_MAX_QUERIES, forward_roles
    from kernelgen.workloads import DECODE_SHAPES

    assert set(DECODE_SHAPES).isdisjoint(SHAPES) and set(DECODE_SHAPES).isdisjoint(KV_CENTRIC_SHAPES)
    for shape in DECODE_SHAPES.values():
        assert shape.n_q <= DECODE_MAX_QUERIES and shape.n_q <= shape.q_tile  # one list per call and KV head
        assert forward_roles(shape.spec("given"), shape.n_q)[-1] == "decode"


def test_listed_kv_bytes_counts_each_valid_block_once():
    """The K and V bytes a decode step reads: distinct in-range ids, a partial last block by its keys; -1, repeats
    and out-of-range ids read nothing."""
    from kernelgen.bench.decode import listed_kv_bytes

    spec = kernelgen.Spec(head_dim=64, kv_block=16, top_k=6, causal=True, selector="given")
    n_k = 16 * 9 + 5  # 10 blocks, the last of 5 keys
    lists = torch.tensor([[[[0, 3, 3, -1, 9, 10]], [[-1] * 6]]], dtype=torch.int32)  # [B1, Hkv2, 1 tile, 6]
    assert listed_kv_bytes(lists, spec, n_k, 2) == (16 + 16 + 5) * 64 * 2 * 2
    assert listed_kv_bytes(lists, spec, n_k, 4) == 2 * listed_kv_bytes(lists, spec, n_k, 2)


@pytest.mark.gpu
def test_decode_bench_rows_on_the_gpu(monkeypatch, tmp_path):
    """`bench --decode` at a small shape: every kernelgen row, Flex's and the dense anchors' are written, Flex
    agrees with kernelgen, and GB/s is kv_MB over the replayed time."""
    import json

    from kernelgen.bench import decode
    from kernelgen.workloads import BenchShape

    small = BenchShape("dec_small", 2, 8, 2, 1, 8192, 128, 128, 64, 4, True)
    monkeypatch.setitem(decode.DECODE_SHAPES, "dec_small", small)
    monkeypatch.setattr(decode, "_bench", lambda fn: (fn(), 1.0)[1])
    decode.run_decode(["dec_small"], tmp_path, log=lambda line: None)
    rows = json.loads((tmp_path / "decode.json").read_text())
    impls = {r["impl"]: r for r in rows}
    for impl in ("device copy (1 GiB)", "kernelgen decode prepared", "kernelgen mean (select+decode)",
                 "kernelgen mean, kept reps (select+decode)", "kernelgen key_reps extended by one key",
                 "kernelgen mean select only", "kernelgen mean, cache_seqlens step",
                 "kernelgen mean, cache_seqlens step, reps made", "flex (same BlockMask)",
                 "kernelgen decode prepared, paged 128", "kernelgen mean, cache_seqlens step, paged 512",
                 "kernelgen decode prepared, paged 16", "kernelgen mean, cache_seqlens step, paged 16",
                 "kernelgen index q_centric, cache_seqlens step", "kernelgen index kv_centric select only",
                 "kernelgen index kv_centric, cache_seqlens step, paged 128", "sdpa flash (dense)",
                 "kernelgen decode prepared, cache_seqlens, fp8 cache", "kernelgen decode splits=2, fp8 cache",
                 "kernelgen mean, kept reps, fp8 cache"):
        assert impl in impls, sorted(impls)
    # the bf16 cache over full rows is the call without lengths; the fp8 cache differs by e4m3's rounding
    assert float(impls["kernelgen decode prepared, cache_seqlens"]["rel_diff_vs_bf16_cache"]) == 0
    assert 0 < float(impls["kernelgen decode prepared, cache_seqlens, fp8 cache"]["rel_diff_vs_bf16_cache"]) < 0.1
    assert float(impls["flex (same BlockMask)"]["rel_diff_vs_kernelgen"]) < 2e-2
    # the step over per-row lengths, replayed from one graph, is the plain call over the keys the lengths name
    assert float(impls["kernelgen mean, cache_seqlens step"]["rel_diff_vs_one_key_less"]) == 0
    assert all(r["host_ms"] > 0 for r in rows[1:])  # the host's enqueue of each row's call, timed for real
    ours = impls["kernelgen decode prepared"]
    assert ours["kv_MB"] * 1e6 == pytest.approx(ours["GBps"] * 1e6 * ours["graph_ms"], rel=1e-2)
    # 4 of 64 blocks a KV head, every list full (kv_MB is rounded to 10 kB)
    assert ours["kv_MB"] == pytest.approx(impls["sdpa flash (dense)"]["kv_MB"] * 4 / 64, abs=0.01)
    assert impls["kernelgen decode splits=2, fp8 cache"]["kv_MB"] == pytest.approx(ours["kv_MB"] / 2, abs=0.01)


@pytest.mark.gpu
def test_chunked_bench_rows_on_the_gpu(monkeypatch, tmp_path):
    """`bench --chunked` at a small shape: every row is written, the one call equals the calls per row bit for bit,
    the calls over pages and FlexAttention over the same lists and lengths agree with it."""
    import json

    from kernelgen.bench import chunked

    monkeypatch.setitem(chunked.CHUNKED_SHAPES, "chunk_small", (256, 4096))
    chunked.run_chunked(["chunk_small"], tmp_path, log=lambda line: None)
    rows = {r["impl"]: r for r in json.loads((tmp_path / "chunked.json").read_text())}
    assert len(rows) == 8 + 3 * (len(chunked.PAGE_BLOCKS) + 1), sorted(rows)  # and pages of SMALL_PAGE keys
    assert rows["kernelgen given lists, one call (cache_seqlens)"]["max_abs_vs_rows"] == 0
    paged = [r for name, r in rows.items() if "over pages" in name]
    assert paged and all(r["max_abs_vs_contiguous"] < 0.05 for r in paged), paged
    assert rows["flex (same lists, rows' lengths)"]["max_abs_vs_kernelgen"] < 0.05
    assert rows["kernelgen given lists, one call (cache_seqlens)"]["graph_ms"] > 0

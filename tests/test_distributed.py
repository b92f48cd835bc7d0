"""kernelgen.distributed on the CPU: 2 and 4 gloo processes, the Triton interpreter in fp32, each rank's o,
lse, dq, dk and dv against the float64 reference of the unsharded problem (and the selected lists against
one process's selector). One spawn per group size runs every case, to pay the start-up once."""
import datetime
import json
import os
import socket
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernelgen
import kernelgen.distributed as kd
from kernelgen import Spec, reference
from checks import tool

D = 64
TOL = 1e-4  # rel. L2 error of fp32 results against float64 (roles.REL_L2_TOL, GRAD_REL_L2_TOL)


def _spec(**changes) -> Spec:
    return Spec(head_dim=D, kv_block=16, q_tile=16, top_k=3, gqa_group=2, selector="given").replace(**changes)


# (name, spec, layout, path, lists: "given" (the reference selector's, passed in), "broadcast" (its first KV head's,
# [B, 1, n_q_tiles, top_k], for every head, as on one GPU) or "select" (across shards))
CASES = {
    2: [
        ("causal-zigzag-dense", _spec(causal=True, sink=1), "zigzag", "dense", "given"),
        ("causal-zigzag-sparse", _spec(causal=True, sink=1), "zigzag", "sparse", "given"),
        ("causal-contiguous-auto-local2", _spec(causal=True, local=2), "contiguous", "auto", "given"),
        ("full-contiguous-dense", _spec(), "contiguous", "dense", "given"),
        ("full-zigzag-sparse-mha", _spec(gqa_group=1), "zigzag", "sparse", "given"),
        ("causal-zigzag-select", _spec(causal=True, sink=1, selector="mean"), "zigzag", "auto", "select"),
        ("causal-contiguous-sparse-one-list", _spec(causal=True), "contiguous", "sparse", "broadcast"),
        ("causal-zigzag-index", _spec(causal=True, sink=1, local=1, selector="index"), "zigzag", "auto", "select"),
        ("full-zigzag-index", _spec(sink=1, selector="index"), "zigzag", "sparse", "select"),
    ],
    4: [
        ("causal-zigzag-dense", _spec(causal=True, sink=1), "zigzag", "dense", "given"),
        ("causal-zigzag-sparse-select", _spec(causal=True, selector="mean"), "zigzag", "sparse", "select"),
        ("full-contiguous-sparse", _spec(local=1), "contiguous", "sparse", "given"),
        ("full-zigzag-index-local", _spec(local=2, selector="index"), "zigzag", "dense", "select"),
    ],
}
SEQ = {2: 128, 4: 128}


def _inputs(spec: Spec, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    q = torch.randn(1, hkv * spec.gqa_group, n, D, generator=gen)
    k = torch.randn(1, hkv, n, D, generator=gen)
    v = torch.randn(1, hkv, n, D, generator=gen)
    do = torch.randn(1, hkv * spec.gqa_group, n, D, generator=gen)
    return q, k, v, do


def _index(spec: Spec, n: int, seed: int):
    """The index selector's (q_idx, k_idx, w) beside `_inputs`' (2 index heads of 32 a KV head, one shared key
    head)."""
    gen = torch.Generator().manual_seed(seed + 1)
    heads = 2 * 2
    return (torch.randn(1, heads, n, 32, generator=gen), torch.randn(1, 1, n, 32, generator=gen),
            torch.rand(1, heads, n, generator=gen))


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    diff = (got.double() - want).where(finite, 0.0)
    return (diff.norm() / want.where(finite, 0.0).norm().clamp(min=1e-30)).item()


def _reference(q, k, v, do, dlse, spec: Spec, lists, sinks):
    """o, lse and the gradients of sum(o * do) + sum(lse * dlse) to q, k, v and sinks, by float64 autograd."""
    leaves = [None if x is None else x.double().requires_grad_() for x in (q, k, v, sinks)]
    o, lse, _ = reference.sparse_attention(*leaves[:3], spec, block_idx=lists, sinks=leaves[3])
    loss = (o * do.double()).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse.double()).sum()
    loss.backward()
    return o.detach(), lse.detach(), [None if x is None else x.grad for x in leaves]


def _run_case(case, world: int, rank: int) -> dict:
    """Each case's loss reads lse too; every other case's call has attention sinks."""
    name, spec, layout, path, lists_from = case
    n = SEQ[world]
    q, k, v, do = _inputs(spec, n, seed=len(name))
    gen = torch.Generator().manual_seed(len(name) + 1)
    dlse = torch.randn(q.shape[:3], generator=gen)
    sinks = torch.randn(q.shape[1], generator=gen) if CASES[world].index(case) % 2 == 0 else None
    chooser = spec if spec.selection_role == "select" else spec.replace(selector="mean")
    lists = reference.select_blocks(q, k, chooser).to(torch.int32)
    if lists_from == "broadcast":
        lists = lists[:, :1]
    given = spec.replace(selector="given")
    q_s, k_s, v_s, do_s, dlse_s = (kd.shard(x, layout) for x in (q, k, v, do, dlse))
    for x in (q_s, k_s, v_s):
        x.requires_grad_()
    sinks_s = None if sinks is None else sinks.clone().requires_grad_()
    errors = {}
    if lists_from == "select":
        index = _index(spec, n, len(name)) if spec.selector == "index" else None
        index_s = None if index is None else tuple(kd.shard(x, layout) for x in index)
        rows = kd.select_blocks(q_s, k_s, spec, index=index_s, layout=layout)
        single = kernelgen.get_kernel(spec).select(q, k, index=index)
        want = single[:, :, kd.Layout.of_shard(layout, world, rank, n // world).global_ids(spec.q_tile)]
        errors["lists"] = 0.0 if torch.equal(rows, want) else float("inf")
        lists = single
        o_s, lse_s = kd.attention(q_s, k_s, v_s, spec, index=index_s, layout=layout, path=path, return_lse=True,
                                  sinks=sinks_s)
    else:
        o_s, lse_s = kd.attention(q_s, k_s, v_s, spec, block_idx=lists, layout=layout, path=path, return_lse=True,
                                  sinks=sinks_s)
    o_ref, lse_ref, grads_ref = _reference(q, k, v, do, dlse, given, lists, sinks)
    torch.autograd.backward([o_s, lse_s.masked_fill(torch.isinf(lse_s), 0.0)], [do_s, dlse_s])
    for what, got, want in (("o", o_s, o_ref), ("lse", lse_s[..., None], lse_ref[..., None]),
                            ("dq", q_s.grad, grads_ref[0]), ("dk", k_s.grad, grads_ref[1]),
                            ("dv", v_s.grad, grads_ref[2])):
        errors[what] = _err(got.detach(), kd.shard(want, layout))
    if sinks is not None:  # each rank's rows' share of the sinks' gradient: summed over the ranks, the whole
        total = sinks_s.grad.clone()
        dist.all_reduce(total)
        errors["dsinks"] = _err(total, grads_ref[3])
    return errors


def _raises(call) -> str:
    """The message of the ValueError, TypeError or RuntimeError `call` raises ("" when it raises none)."""
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
    return ""


def _kind(call) -> str:
    """Which of TypeError and ValueError `call` raises ("" when neither)."""
    try:
        call()
    except TypeError:
        return "TypeError"
    except ValueError:
        return "ValueError"
    return ""


def _bad_inputs(world: int, rank: int) -> dict:
    """The message each bad call raises on this rank (every rank must raise, none may hang)."""
    spec = _spec(causal=True)
    q, k, v, _ = _inputs(spec, 128, seed=0)
    lists = reference.select_blocks(q, k, spec.replace(selector="mean")).to(torch.int32)
    q_s, k_s, v_s = (kd.shard(x, "zigzag") for x in (q, k, v))
    index_s = tuple(kd.shard(x, "zigzag") for x in _index(spec, 128, 0))
    last = rank == world - 1
    short = 48 if last else 64  # one rank's shards differ
    first_only = dist.new_group([0])  # every rank takes part in making it
    return {
        "shapes": _raises(lambda: kd.attention(q_s[:, :, :short], k_s[:, :, :short], v_s[:, :, :short], spec,
                                               block_idx=lists)),
        "chunks": _raises(lambda: kd.attention(q_s[:, :, :40], k_s[:, :, :40], v_s[:, :, :40], spec, block_idx=lists)),
        "lists": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists[:, :, :3])),
        "layout": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists, layout="striped")),
        "path": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists, path="ring")),
        "qk lengths": _raises(lambda: kd.attention(q_s, k_s[:, :, :32], v_s[:, :, :32], spec, block_idx=lists)),
        "index selector": _raises(lambda: kd.attention(q_s, k_s, v_s, spec.replace(selector="index"))),
        "one rank's k_idx": _raises(lambda: kd.attention(q_s, k_s, v_s, spec.replace(selector="index"),
                                                         index=(index_s[0], index_s[1].expand(-1, 2 if last else 1,
                                                                                              -1, -1), index_s[2]))),
        "index of a pooled selector": _raises(lambda: kd.attention(q_s, k_s, v_s, spec.replace(selector="mean"),
                                                                   index=index_s)),
        "short k_idx": _raises(lambda: kd.select_blocks(q_s, k_s, spec.replace(selector="index"),
                                                        index=(index_s[0], index_s[1][:, :, :32], index_s[2]))),
        # one rank's call differs, or only one rank's is refused: every rank raises, none waits in a collective
        "one rank's path": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists,
                                                        path="sparse" if last else "dense")),
        "one rank's spec": _raises(lambda: kd.attention(q_s, k_s, v_s, spec.replace(causal=not last), block_idx=lists,
                                                        path="dense")),
        "one rank's lists": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists[:, :, :3] if last
                                                         else lists, path="dense")),
        "one rank's list dtype": _raises(lambda: kd.attention(q_s, k_s, v_s, spec, block_idx=lists.float() if last
                                                              else lists, path="dense")),
        "one rank's grad": _raises(lambda: kd.attention(q_s.requires_grad_(last), k_s, v_s, spec, block_idx=lists,
                                                        path="dense")),
        "one rank's return_lse": _raises(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, block_idx=lists,
                                                              path="dense", return_lse="yes" if last else True)),
        "one rank's unshard": _raises(lambda: kd.unshard(q_s[:, :, :short].detach())),
        "odd zigzag unshard": _raises(lambda: kd.unshard(q_s[:, :, :5].detach())),
        "one rank's unshard layout": _raises(lambda: kd.unshard(q_s.detach(), "contiguous" if last else "zigzag")),
        "select of given lists": _raises(lambda: kd.select_blocks(q_s, k_s, spec.replace(selector="given"))),
        # only one rank's refused: each sees that rank's own error (not "scale differs"), of the type it raised there
        "one rank's tensor scale": _raises(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, block_idx=lists,
                                                                path="dense",
                                                                scale=torch.tensor(0.1) if last else 0.1)),
        "one rank's sinks": _raises(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, block_idx=lists, path="dense",
                                                         sinks=torch.zeros(3 if last else q_s.shape[1]))),
        "one rank's tensor scale kind": _kind(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, block_idx=lists,
                                                                   path="dense",
                                                                   scale=torch.tensor(0.1) if last else 0.1)),
        # an error that is not kernelgen's, met on one rank while it checks its call, is passed to the others too
        "one rank's sparse lists": _raises(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, path="dense",
                                                                block_idx=lists.to_sparse() if last else lists)),
        "equal scales of two types": _raises(lambda: kd.attention(q_s.detach(), k_s, v_s, spec, block_idx=lists,
                                                                  path="dense", scale=np.float64(0.125) if last
                                                                  else 0.125)) or "ran alike",
        "outside the group": _raises(lambda: kd.shard(q, group=first_only)) if last else "rank 0: not a member",
        "after them": "in step" if torch.equal(kd.unshard(kd.shard(q, "zigzag"), "zigzag"), q) else "out of step",
    }


EXPECTED_MESSAGES = {"shapes": "differs across ranks", "chunks": "not a multiple of spec.kv_block",
                     "lists": "block_idx.shape", "layout": "layout='striped'", "path": "path='ring'",
                     "qk lengths": "same length", "index selector": "selects across shards from index=",
                     "one rank's k_idx": "k_idx shard shape differs across ranks",
                     "index of a pooled selector": "index= is the input of the 'index' selector",
                     "short k_idx": "index: k_idx.shape = (1, 1, 32, 32)",
                     "one rank's path": "path differs across ranks", "one rank's spec": "spec differs across ranks",
                     "one rank's lists": "block_idx.shape", "one rank's list dtype": "block_idx.dtype must be",
                     "one rank's grad": "requires grad differs across ranks",
                     "one rank's return_lse": "return_lse must be a bool",
                     "one rank's unshard": "x_shard shape differs across ranks",
                     "odd zigzag unshard": "a shard of 5 rows does not cut into the 2 equal chunks",
                     "one rank's unshard layout": "layout differs across ranks",
                     "select of given lists": "selects nothing: its lists are the caller's",
                     "one rank's tensor scale": "scale must be a finite real",
                     "one rank's tensor scale kind": "TypeError", "one rank's sinks": "sinks.shape = (3,)",
                     "one rank's sparse lists": "unsupported for Sparse",
                     "outside the group": "not a member",
                     "equal scales of two types": "ran alike", "after them": "in step"}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank left waiting in a collective fails the test in a minute or two, not gloo's default half hour
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        results = {case[0]: _run_case(case, world, rank) for case in CASES[world]}
        if world == 2:
            results["bad inputs"] = _bad_inputs(world, rank)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_matches_one_gpu(world):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), out_dir), nprocs=world, join=True)
        results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    messages = [res.pop("bad inputs", None) for res in results]
    bad = {(r, case, what): err for r, res in enumerate(results) for case, errs in res.items()
           for what, err in errs.items() if not err < TOL}
    assert not bad, bad
    for r, got in enumerate(messages):
        if got is not None:
            wrong = {what: got[what] for what, expected in EXPECTED_MESSAGES.items() if expected not in got[what]}
            assert not wrong, (r, wrong)


def test_one_process_runs_as_one_gpu():
    """Without an initialized process group the call is get_kernel(spec)'s, and shard/unshard are the identity."""
    assert not dist.is_initialized()
    spec = _spec(causal=True, sink=1)
    q, k, v, _ = _inputs(spec, 64, seed=3)
    lists = reference.select_blocks(q, k, spec.replace(selector="mean")).to(torch.int32)
    o, lse = kd.attention(kd.shard(q), kd.shard(k), kd.shard(v), spec, block_idx=lists, return_lse=True)
    o_one, lse_one = kernelgen.get_kernel(spec)(q, k, v, block_idx=lists, return_lse=True)
    assert torch.equal(kd.unshard(o), o_one) and torch.equal(lse, lse_one)
    odd = q[:, :, :63]  # one rank holds any length, as the call takes it
    assert torch.equal(kd.shard(odd, "zigzag"), odd) and torch.equal(kd.unshard(odd, "zigzag"), odd)


def test_group_without_process_group():
    """A group given while torch.distributed is not initialized is refused, never run as one rank on a shard."""
    assert not dist.is_initialized()
    spec = _spec(causal=True)
    q, k, v, _ = _inputs(spec, 64, seed=3)
    lists = reference.select_blocks(q, k, spec.replace(selector="mean")).to(torch.int32)
    stale = object()
    for call in (lambda: kd.attention(q, k, v, spec, block_idx=lists, group=stale),
                 lambda: kd.select_blocks(q, k, spec.replace(selector="mean"), group=stale),
                 lambda: kd.shard(q, group=stale), lambda: kd.unshard(q, group=stale)):
        with pytest.raises(ValueError, match="group=.* torch.distributed is not initialized"):
            call()


def test_check_goes_where_the_backend_communicates(monkeypatch):
    """The ranks' check tensor goes to a CUDA device under NCCL whatever device a rank's shard is on (a CPU shard
    is that rank's refusal, not an error raised alone in the check's all_gather), and to the CPU under gloo."""
    from kernelgen.distributed.attention import _device_of
    from kernelgen.distributed.comm import Group

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _device_of(torch.zeros(1), Group(None, 0, 2)) == torch.device("cuda", 0)
    assert _device_of(None, Group(None, 0, 2)) == torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _device_of(torch.zeros(1), Group(None, 0, 2)) == torch.device("cpu")


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_simulated_ranks_take_broadcast_lists(path):
    """simulate: one list for every KV head ([B, 1, n_q_tiles, top_k]) broadcasts, as on one GPU."""
    from kernelgen.distributed.simulate import simulate, unshard_runs

    spec = _spec(causal=True)
    q, k, v, _ = _inputs(spec, 64, seed=5)
    lists = reference.select_blocks(q, k, spec.replace(selector="mean"))[:, :1].to(torch.int32)
    want = kernelgen.get_kernel(spec)(q, k, v, block_idx=lists)
    got = unshard_runs(simulate(q, k, v, lists, spec, world=2, path=path), "o")
    assert _err(got, want.double()) < TOL


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_no_double_backward_even_where_do_requires_no_grad(monkeypatch, path):
    """A rank's dq, dk, dv depend on its q, k, v: a create_graph=True backward's gradients raise when
    differentiated, whether or not do requires grad (o.sum()'s does not), also where autograd.grad walks only
    the paths to one shard (the sparse path keeps the fetched k and v, and the shards themselves)."""
    import importlib

    cp = importlib.import_module("kernelgen.distributed.attention")  # the package's attention is the function

    grads = tuple(torch.randn(1, 2, 8, D) for _ in range(3))
    monkeypatch.setattr(cp, "ring_backward", lambda *args: grads)
    monkeypatch.setattr(cp, "local_backward", lambda *args: grads)
    monkeypatch.setattr(cp, "return_gradients", lambda dk, dv, *args: (dk, dv))
    q, k, v = (torch.randn(1, 2, 8, D, requires_grad=True) for _ in range(3))
    o, lse = torch.randn(1, 2, 8, D), torch.randn(1, 2, 8)
    saved = (q, k, v, o, lse) if path == "dense" else (q, k.detach().clone(), v.detach().clone(), o, lse, k, v)
    call = type("Call", (), {"tables": None, "spec": _spec(), "group": None})()
    ctx = type("Ctx", (), {"call": call, "path": path, "steps": None, "prepared": None, "fetched": None,
                           "needs_input_grad": (True,) * 7, "saved_tensors": saved})()
    with torch.enable_grad():  # as autograd runs a backward under create_graph=True
        dq, dk, dv = cp._ContextParallel.backward(ctx, torch.ones(1, 2, 8, D), None)[:3]
    with pytest.raises(RuntimeError, match="not differentiable"):
        dq.sum().backward()
    for grad in (dq, dk, dv):
        for shard in (q, k, v):
            with pytest.raises(RuntimeError, match="not differentiable"):
                torch.autograd.grad(grad.pow(2).sum(), shard)


def test_layout_tables():
    """Zigzag over 2 ranks: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; ids map both ways."""
    lay = kd.Layout("zigzag", 2, 1, 64)
    assert lay.chunks() == (1, 2) and lay.positions().tolist() == list(range(16, 48))
    owner, local, chunk = lay.block_tables(16)
    assert owner.tolist() == [0, 1, 1, 0] and local.tolist() == [0, 0, 1, 1] and chunk.tolist() == [0, 1, 2, 3]
    x = torch.arange(64.0).view(1, 1, 64, 1)
    shards = [kd.Layout("zigzag", 2, r, 64).take(x) for r in range(2)]
    assert torch.equal(lay.assemble(shards), x)
    assert kd.traffic((1, 8, 131072, 128), 2, 2, 128, 1000).path() == "sparse"
    # more blocks than a shard's worth: the ring moves fewer bytes forward, the fetch fewer forward and backward
    most = kd.traffic((1, 8, 131072, 128), 2, 2, 128, 9000)
    assert most.path() == "dense" and most.path(backward=True) == "sparse"
    for world, rank in ((2, 2), (2, -1), (0, 0), (2, 1.0)):  # a rank outside the world has no chunks
        with pytest.raises(ValueError, match="Layout (rank|world)="):
            kd.Layout("zigzag", world, rank, 64)
    with pytest.raises(ValueError, match="4 equal chunks; N=18 is not a multiple"):  # unequal chunks would drop rows
        kd.Layout("zigzag", 2, 1, 18)
    alone = kd.Layout("zigzag", 1, 0, 19)  # one rank holds the sequence whole, in order, whatever its length
    assert alone.shard_len == 19 and alone.positions().tolist() == list(range(19))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "local_heavy"])
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_ranks_in_one_process_match_one_gpu_cuda(path, kind):
    """Both ranks of a 2-rank run, simulated in one process on one GPU (the per-rank functions the autograd
    Function runs), bf16 at N=4096 with the bench's spec: o, lse, dq, dk, dv against one GPU's."""
    from kernelgen.bench.context_parallel import CP_SPEC, cp_lists, list_kinds
    from kernelgen.distributed.simulate import simulate, unshard_runs

    spec, n = list_kinds(CP_SPEC)[kind], 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, 8, n, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, n, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    lists = cp_lists(spec, 1, 2, n, "cuda")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = kernelgen.get_kernel(CP_SPEC)(*full, block_idx=lists, return_lse=True)
    o.backward(do)
    runs = simulate(q, k, v, lists, spec, world=2, path=path, do=do)
    for name, want in (("o", o), ("lse", lse), ("dq", full[0].grad), ("dk", full[1].grad), ("dv", full[2].grad)):
        got = unshard_runs(runs, name)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, (name, err)
    if path == "sparse":
        assert all(run.requested > 0 for run in runs)


def test_two_gpu_tool_arguments():
    two_gpu = tool("context_parallel_2gpu")
    assert two_gpu.parse_args([]).reference and two_gpu.parse_args([]).seq == 262144
    big = two_gpu.parse_args(["--seq", "2097152", "--out", "x.json"])
    assert not big.reference and big.kinds == ["random", "local_heavy"] and big.paths == ["dense", "sparse"]
    assert two_gpu.parse_args(["--seq", "2097152", "--one-gpu", "on"]).reference
    with pytest.raises(SystemExit):
        two_gpu.parse_args(["--paths", "ring"])


def test_two_gpu_tool_says_what_it_needs(monkeypatch):
    """Run where it cannot run: without 2 CUDA GPUs, or without torchrun's ranks, one line saying so (no
    KeyError or rendezvous traceback)."""
    two_gpu = tool("context_parallel_2gpu")
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit, match="needs 2 CUDA GPUs and NCCL .*--smoke runs it on the CPU"):
            two_gpu.main(["--seq", "262144", "--out", "cp-2gpu.json"])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="start it with torchrun --nproc-per-node 2"):
        two_gpu.main(["--smoke"])


def _tool_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    two_gpu = tool("context_parallel_2gpu")
    two_gpu.main(["--smoke", "--kinds", "local_heavy", "--paths", "sparse", "--reps", "1", "--warmup", "0",
                  "--out", out])


def test_two_gpu_tool_smoke_on_the_cpu(tmp_path):
    """The 2-GPU script on the CPU over gloo at the smoke size (the sparse path, the one that fetches): o and the
    gradients match one process."""
    out = tmp_path / "cp.json"
    mp.spawn(_tool_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["path"]) for r in rows] == [("local_heavy", "sparse")]
    assert all(r["check_ok"] and r["rel_diff_dk"] < 1e-4 and r["fwd_bwd_ms"] > 0 for r in rows), [
        {key: val for key, val in r.items() if "rel" in key} for r in rows]


def _wire(blocks: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[n, 2, kv_block, D] K/V pairs in the all_to_all's form: per segment of `counts`, its K then its V blocks."""
    out, start = [], 0
    for count in counts:
        out += [blocks[start:start + count, 0], blocks[start:start + count, 1]]
        start += count
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_returned_gradients_add_in_fp32_once_rounded(dtype):
    """add_returned: blocks named by one source take one 16-bit add, bit for bit the fp32 sum rounded once;
    blocks named by several sources are summed in fp32 in source order; untouched blocks are kept."""
    from kernelgen.distributed.fetch import Fetched, Requests, add_returned

    g = torch.Generator().manual_seed(0)
    b, hkv, kv_block, d, n_local, width = 1, 2, 4, 8, 6, 2
    tables = (torch.zeros(n_local, dtype=torch.long), torch.arange(n_local), torch.zeros(n_local, dtype=torch.long))
    dk, dv = (torch.randn(b, hkv, (width + n_local) * kv_block, d, generator=g).to(dtype) for _ in range(2))
    for incoming, counts in (([3, 7, 8], [3]), ([3, 7, 8, 3, 7], [3, 2])):  # flat ids bh * n_local + block
        ids = torch.tensor(incoming)
        back = torch.randn(len(incoming), 2, kv_block, d, generator=g).to(dtype)
        nothing_asked = Requests(torch.zeros(0, dtype=torch.long), [], [])
        fetched = Fetched(dk, dv, width, torch.zeros(0, dtype=torch.long), nothing_asked, ids, counts)
        got = add_returned(dk, dv, _wire(back, counts), fetched, tables, kv_block)
        for i, x in enumerate((dk, dv)):
            want = x[:, :, width * kv_block:].float().reshape(b * hkv * n_local, kv_block, d).clone()
            for j, flat in enumerate(incoming):  # in source order
                want[flat] += back[j, i].float()
            assert torch.equal(got[i], want.to(dtype).view_as(got[i]))


def test_prefix_layout_of_received_blocks():
    """prefixed: each received block at its head's slot (the heads' requests in order), the slots no request
    fills zero, then the own shard unchanged."""
    from kernelgen.distributed.fetch import Requests, prefixed

    g = torch.Generator().manual_seed(1)
    b, hkv, kv_block, d, n, n_blocks = 1, 3, 4, 8, 12, 10
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    ids = torch.tensor([0 * n_blocks + 2, 0 * n_blocks + 5, 2 * n_blocks + 1])  # head 0 asks 2, head 2 one, head 1 none
    received = torch.randn(3, 2, kv_block, d, generator=g)
    k_l, v_l, width, slot = prefixed(k, v, Requests(ids, [3], [[2, 0, 1]]), _wire(received, [3]), kv_block)
    assert width == 2 and slot.tolist() == [0, 1, 0]
    for i, (x, local) in enumerate(((k, k_l), (v, v_l))):
        assert local.shape == (b, hkv, width * kv_block + n, d)
        assert torch.equal(local[:, :, width * kv_block:], x)
        prefix = local[0, :, :width * kv_block].reshape(hkv, width, kv_block, d)
        assert torch.equal(prefix[0, 0], received[0, i]) and torch.equal(prefix[0, 1], received[1, i])
        assert torch.equal(prefix[2, 0], received[2, i])
        assert not prefix[1].any() and not prefix[2, 1].any()
    # two owners: requests come (owner, head, block) ordered; a head's slots follow the owners in turn
    ids = torch.tensor([0 * n_blocks + 2, 2 * n_blocks + 1, 0 * n_blocks + 5, 1 * n_blocks + 0])
    received = torch.randn(4, 2, kv_block, d, generator=g)
    requests = Requests(ids, [2, 2], [[1, 0, 1], [1, 1, 0]])  # per owner: head 0 and 2, then head 0 and 1
    k_l, v_l, width, slot = prefixed(k, v, requests, _wire(received, [2, 2]), kv_block)
    assert width == 2 and slot.tolist() == [0, 0, 1, 0]
    for i, (x, local) in enumerate(((k, k_l), (v, v_l))):
        assert torch.equal(local[:, :, width * kv_block:], x)
        prefix = local[0, :, :width * kv_block].reshape(hkv, width, kv_block, d)
        for j, (h, s) in enumerate(((0, 0), (2, 0), (0, 1), (1, 0))):
            assert torch.equal(prefix[h, s], received[j, i])
        assert not prefix[1, 1].any() and not prefix[2, 1].any()

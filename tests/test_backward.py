"""The backward: dq, dk, dv against float64 autograd through kernelgen.reference, on the CPU (interpreter,
fp32/fp16, small) and the GPU (bf16/fp16, 4k-32k); the reverse index; determinism; autograd with prepared
lists and return_lse; the custom op under torch.compile."""
import dataclasses

import pytest
import torch

import kernelgen
from kernelgen import BwdDkdvConfig, BwdDqConfig, Spec, backends, reference
from kernelgen.archs import ARCHS, arch_facts
from kernelgen.backends.triton import bwd_dkdv_smem_bytes, bwd_dq_smem_bytes
from kernelgen.custom_ops import sparse_attention
from kernelgen.reverse_index import build_reverse_index
from kernelgen.roles import BACKWARD_ROLES
from kernelgen.tuning.worker import check_config
from checks import GRAD_TOLERANCE, TEST_ARCH, compile_offline, default_config


def leaves(b, hkv, g, nq, nk, d, dtype, device, seed):
    """q, k, v (leaves that require grad) and do."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(b, hkv * g, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hkv * g, nq, d)]
    q, k, v, do = (torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def assert_grads_close(grads, want, dtype):
    rel_tol, abs_tol = GRAD_TOLERANCE[dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == dtype and got.shape == ref.shape, name
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten or poisoned elements)"
        rel = ((got.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        max_abs = ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()
        assert rel < rel_tol and max_abs < abs_tol, f"{name}: rel {rel:.2e} (tol {rel_tol}), max-abs {max_abs:.2e}"


def run_backward(spec, q, k, v, do, block_idx=None, configs=None, scale=None):
    """(dq, dk, dv) of kernelgen's autograd, and the lists the forward attended over."""
    attn = kernelgen.get_kernel(spec, configs=configs)
    for x in (q, k, v):
        x.grad = None
    o = attn(q, k, v, block_idx=block_idx, scale=scale)
    o.backward(do)
    if block_idx is None:
        block_idx = attn.select(q.detach(), k.detach())  # the same lists (selection is deterministic)
    return (q.grad, k.grad, v.grad), block_idx


def check_against_reference(spec, q, k, v, do, block_idx=None, configs=None, scale=None):
    grads, lists = run_backward(spec, q, k, v, do, block_idx, configs, scale)
    if isinstance(lists, kernelgen.BlockLists):
        lists = lists.block_idx
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists, scale)
    assert_grads_close(grads, want, q.dtype)
    return grads, want


# causal, G, D, kv_block, q_tile, (Nq, Nk), dtype: ragged lengths, Nq != Nk both ways (Nq > Nk under causal
# leaves the first rows without a visible key), q_tile != kv_block both ways
GRID = [
    (True, 1, 64, 64, 64, (300, 300), torch.float16),
    (False, 2, 64, 32, 64, (200, 461), torch.float32),
    (True, 4, 128, 64, 32, (333, 150), torch.float16),
    (True, 2, 128, 128, 128, (260, 260), torch.float32),
    (False, 4, 64, 128, 64, (190, 300), torch.float16),
    (True, 2, 64, 64, 128, (150, 420), torch.float32),
    (False, 2, 64, 256, 64, (200, 600), torch.float32),  # the forward runs the blocks' 128-key halves
]


@pytest.mark.parametrize("causal, g, d, kv_block, q_tile, lengths, dtype", GRID)
def test_grid_cpu(causal, g, d, kv_block, q_tile, lengths, dtype, device):
    spec = Spec(head_dim=d, kv_block=kv_block, q_tile=q_tile, top_k=2, causal=causal, gqa_group=g)
    check_against_reference(spec, *leaves(1, 2, g, *lengths, d, dtype, device, seed=sum(lengths) + g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_local_sink_multi_selector(dtype, device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=64, top_k=5, causal=True, gqa_group=2, selector="multi:2",
                local=2, sink=1)
    check_against_reference(spec, *leaves(2, 1, 2, 250, 300, 64, dtype, device, seed=7), scale=0.2)


def given_lists(device):
    """Lists of one (batch, KV head) over 5 KV blocks and 4 Q tiles: -1 slots, a repeated id, out-of-range ids
    (5, -7, 2**40: int64 is converted exactly), an empty list."""
    return torch.tensor([[[[3, 1, 1, -1], [0, 5, 2, -7], [-1, -1, -1, -1], [4, 2 ** 40, 0, 3]]]],
                        dtype=torch.int64, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_given_lists_empty_repeated_out_of_range(causal, dtype, device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=causal, gqa_group=2, selector="given")
    q, k, v, do = leaves(1, 1, 2, 110, 150, 64, dtype, device, seed=3)
    grads, _ = check_against_reference(spec, q, k, v, do, given_lists(device))
    assert torch.equal(grads[0][:, :, 64:96], torch.zeros_like(grads[0][:, :, 64:96]))  # tile 2's list is empty


def test_rows_without_a_visible_key_get_zero_gradient(device):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key (o = 0, lse = -inf); their dq is 0, never NaN,
    and they add nothing to dk, dv."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 1, 2, 200, 90, 64, torch.float32, device, seed=5)
    (dq, dk, dv), _ = check_against_reference(spec, q, k, v, do)
    assert torch.equal(dq[:, :, :110], torch.zeros_like(dq[:, :, :110]))
    do_seen = do.clone()
    do_seen[:, :, :110] = 0  # what the rows without a key receive changes nothing
    (_, dk2, dv2), _ = run_backward(spec, q, k, v, do_seen)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


# configs that take the kernels' other paths: programs of fewer rows than a Q tile, of several heads'
# tiles, and dK/dV programs of part of a KV block
CONFIGS = [
    {"bwd_dq": BwdDqConfig(block_m=16, num_warps=4, num_stages=1),
     "bwd_dkdv": BwdDkdvConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)},
    {"bwd_dq": BwdDqConfig(block_m=128, num_warps=8, num_stages=2),
     "bwd_dkdv": BwdDkdvConfig(block_n=32, block_m=128, num_warps=8, num_stages=2)},
    {"bwd_dq": BwdDqConfig(block_m=64, num_warps=4, num_stages=2, use_tma=True),  # the last block zero-filled
     "bwd_dkdv": BwdDkdvConfig(block_n=64, block_m=64, num_warps=4, num_stages=2)},
]


@pytest.mark.parametrize("configs", CONFIGS, ids=["split-tiles", "packed-heads", "dq-tma"])
def test_pinned_configs(configs, device):
    if configs["bwd_dq"].use_tma and not arch_facts(TEST_ARCH).tma:
        pytest.skip(f"use_tma needs TMA, which {TEST_ARCH} lacks")
    spec = Spec(head_dim=64, kv_block=64, q_tile=32, top_k=3, causal=True, gqa_group=4, local=1)
    check_against_reference(spec, *leaves(1, 1, 4, 170, 200, 64, torch.float16, device, seed=11), configs=configs)


def test_backward_is_deterministic(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=4)
    q, k, v, do = leaves(1, 2, 4, 160, 160, 64, torch.float16, device, seed=13)
    first, _ = run_backward(spec, q, k, v, do)
    first = [g.clone() for g in first]
    second, _ = run_backward(spec, q, k, v, do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def python_reverse_index(block_idx, n_kv_blocks):
    """The reverse index, one loop at a time: for each block, the tiles whose lists hold it, ascending."""
    b_, h_, n_tiles, top_k = block_idx.shape
    offsets = torch.zeros(b_, h_, n_kv_blocks + 1, dtype=torch.int32)
    tiles = torch.full((b_, h_, n_tiles * top_k), -1, dtype=torch.int32)
    for b in range(b_):
        for h in range(h_):
            flat = []
            for j in range(n_kv_blocks):
                offsets[b, h, j] = len(flat)
                flat += [t for t in range(n_tiles) if j in block_idx[b, h, t].tolist()]
            offsets[b, h, n_kv_blocks] = len(flat)
            tiles[b, h, :len(flat)] = torch.tensor(flat, dtype=torch.int32)
    return offsets, tiles


def test_megatron_s_b_h_d_layout_goes_in_as_a_view(device):
    """Megatron's [S, B, H, D] tensors go in as `x.permute(1, 2, 0, 3)` (no copy): o and the gradients (in the
    leaves' own layout) match the reference on contiguous copies."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    gen = torch.Generator().manual_seed(5)
    q_sbhd, k_sbhd, v_sbhd, do_sbhd = (torch.randn(96, 2, h, 64, generator=gen).to(device) for h in (4, 2, 2, 4))
    for x in (q_sbhd, k_sbhd, v_sbhd):
        x.requires_grad_()
    views = [x.permute(1, 2, 0, 3) for x in (q_sbhd, k_sbhd, v_sbhd, do_sbhd)]
    assert not views[0].is_contiguous() and views[0].stride(-1) == 1
    attn = kernelgen.get_kernel(spec)
    o = attn(*views[:3])
    o.backward(views[3])
    lists = attn.select(views[0].detach(), views[1].detach())
    copies = [x.detach().contiguous() for x in views]
    want_o, _, _ = reference.sparse_attention(*copies[:3], spec.replace(selector="given"), block_idx=lists)
    assert (o.double() - want_o).abs().max() < 1e-4
    want = reference.sparse_attention_grads(*copies, spec, lists)
    grads = [x.grad for x in (q_sbhd, k_sbhd, v_sbhd)]
    assert all(g.shape == x.shape for g, x in zip(grads, (q_sbhd, k_sbhd, v_sbhd)))
    assert_grads_close([g.permute(1, 2, 0, 3) for g in grads], want, torch.float32)


def test_reverse_index_against_python(device):
    gen = torch.Generator().manual_seed(0)
    n_blocks = 9
    raw = torch.randint(-3, n_blocks + 3, (2, 3, 7, 5), generator=gen, dtype=torch.int32)
    raw[1, 2, 4] = -1  # an empty list
    lists = reference.normalize_block_idx(raw, n_blocks)  # repeats and out-of-range ids: empty slots
    offsets, tiles, order = build_reverse_index(lists.to(device), n_blocks)
    want_offsets, want_tiles = python_reverse_index(lists, n_blocks)
    assert offsets.dtype == tiles.dtype == order.dtype == torch.int32
    assert torch.equal(offsets.cpu(), want_offsets) and torch.equal(tiles.cpu(), want_tiles)
    # every block once, those listed by the most tiles first, ties in ascending order
    counts = (want_offsets[..., 1:] - want_offsets[..., :-1]).flatten().tolist()
    want_order = sorted(range(len(counts)), key=lambda block: (-counts[block], block))
    assert order.cpu().tolist() == want_order and len(set(want_order)) == 2 * 3 * n_blocks


def test_the_dkdv_launch_order_changes_no_bit(device, monkeypatch):
    """The programs' launch order (`ReverseIndex.order`, heaviest first) only schedules: each block's program
    computes the same sums in the same order, so another order gives the same gradients, bit for bit."""
    import kernelgen.reverse_index as reverse_index

    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="given")
    q, k, v, do = leaves(2, 2, 2, 110, 150, 64, torch.float32, device, seed=5)
    gen = torch.Generator().manual_seed(5)
    lists = torch.randint(-2, 7, (2, 2, 4, 4), generator=gen).to(device)  # -1, -2 and 5, 6: empty slots
    heaviest, _ = run_backward(spec, q, k, v, do, lists)
    heaviest = [g.clone() for g in heaviest]
    grid_order = torch.arange(2 * 2 * 5, device=device, dtype=torch.int32)
    used = build_reverse_index(kernelgen.get_kernel(spec).prepare(lists, 110, 150).block_idx, 5).order
    assert not torch.equal(used, grid_order) and not torch.equal(used, grid_order.flip(0))
    monkeypatch.setattr(reverse_index, "heaviest_first", lambda offsets: grid_order.flip(0))
    reversed_, _ = run_backward(spec, q, k, v, do, lists)
    for a, b in zip(heaviest, reversed_):
        assert torch.equal(a, b)


def test_prepared_lists_backpropagate_and_keep_their_reverse_index(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=4, causal=True, gqa_group=2, selector="given")
    q, k, v, do = leaves(1, 1, 2, 110, 150, 64, torch.float32, device, seed=3)
    attn = kernelgen.get_kernel(spec)
    raw = given_lists(device)
    lists = attn.prepare(raw, 110, 150)
    grads, _ = check_against_reference(spec, q, k, v, do, lists)
    grads = [g.clone() for g in grads]
    reverse = lists.reverse_index()
    assert reverse is lists.reverse_index()  # built once, by the backward, and kept
    again, _ = run_backward(spec, q, k, v, do, raw)  # raw lists: the same gradients, bit for bit
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


def test_return_lse_and_only_some_inputs_require_grad(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2)
    q, k, v, do = leaves(1, 1, 2, 100, 100, 64, torch.float32, device, seed=17)
    attn = kernelgen.get_kernel(spec)
    o, lse = attn(q, k, v, return_lse=True)
    assert o.requires_grad and lse.requires_grad  # lse backpropagates too (tests/test_lse_gradient.py)
    with torch.no_grad():
        assert not attn(q, k, v).requires_grad
    k_only = k.detach().requires_grad_()
    attn(q.detach(), k_only, v.detach()).backward(do)
    want = reference.sparse_attention_grads(q, k, v, do, spec, attn.select(q.detach(), k.detach()))
    assert_grads_close([k_only.grad], [want[1]], torch.float32)


@pytest.mark.parametrize("op", [False, True], ids=["eager", "custom-op"])
def test_double_backward_is_an_error_even_where_do_requires_no_grad(op, device):
    """dq depends on q: differentiating a create_graph=True gradient must fail, not treat dq as a constant. With
    o.sum() (a do that requires no grad) and q = x * x, the second backward used to give x.grad = 2 * dq."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True)
    q, k, v, do = leaves(1, 1, 1, 64, 64, 64, torch.float32, device, seed=5)
    attn = kernelgen.get_kernel(spec)
    attend = (lambda *qkv: sparse_attention(*qkv, spec)[0]) if op else attn
    x = q.detach().requires_grad_()
    gx, = torch.autograd.grad(attend(x * x, k.detach(), v.detach()).sum(), x, create_graph=True)
    want = 2 * x.detach() * reference.sparse_attention_grads(x * x, k, v, torch.ones_like(do), spec,
                                                             attn.select((x * x).detach(), k.detach()))[0]
    assert_grads_close([gx.detach(), gx.detach(), gx.detach()], [want] * 3, torch.float32)  # first order: right
    with pytest.raises(RuntimeError, match="not differentiable"):
        gx.sum().backward()
    dq, = torch.autograd.grad(attend(q, k, v), q, do.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        dq.sum().backward()


@pytest.mark.parametrize("op", [False, True], ids=["eager", "custom-op"])
def test_a_second_derivative_taken_with_autograd_grad_raises(op, device):
    """autograd.grad walks only the paths to the inputs it is asked about: a gradient penalty's
    grad(dq.pow(2).sum() + q.pow(2).sum(), q) once returned 2 * q, the attention's term silently left out."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True)
    q, k, v, _ = leaves(1, 1, 1, 64, 64, 64, torch.float32, device, seed=6)
    attend = (lambda *qkv: sparse_attention(*qkv, spec)[0]) if op else kernelgen.get_kernel(spec)
    grads = torch.autograd.grad(attend(q, k, v).sum(), (q, k, v), create_graph=True)
    for grad, x in zip(grads, (q, k, v)):
        assert grad.requires_grad
        for wrt in (q, k, v):
            with pytest.raises(RuntimeError, match="not differentiable"):
                torch.autograd.grad(grad.pow(2).sum() + x.pow(2).sum(), wrt, allow_unused=True)


@pytest.mark.parametrize("op", [False, True], ids=["eager", "custom-op"])
def test_forward_mode_ad_is_refused(op, device):
    """The kernels read a dual tensor's primal only: o would carry no tangent (a silently zero jvp)."""
    import torch.autograd.forward_ad as fwAD

    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True)
    q, k, v, do = leaves(1, 1, 1, 64, 64, 64, torch.float32, device, seed=5)
    attend = (lambda *qkv: sparse_attention(*qkv, spec)[0]) if op else kernelgen.get_kernel(spec)
    with fwAD.dual_level():
        with pytest.raises(TypeError, match="forward-mode AD"):
            attend(fwAD.make_dual(q.detach(), do), k.detach(), v.detach())
    with pytest.raises(TypeError, match="forward-mode AD|torch.func transform"):
        torch.func.jvp(lambda x: attend(x, k.detach(), v.detach()), (q.detach(),), (do,))


@pytest.mark.parametrize("op", [False, True], ids=["eager", "custom-op"])
def test_function_transforms_are_refused_naming_them(op, device):
    """torch.func's wrapped tensors reach no kernel: a TypeError names the transform and what to use instead (the
    custom op's own message was torch's, about an autograd.Function's setup_context)."""
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True)
    q, k, v, do = leaves(2, 1, 1, 64, 64, 64, torch.float32, device, seed=5)
    attn = (lambda *qkv: sparse_attention(*qkv, spec)[0]) if op else kernelgen.get_kernel(spec)
    q, k, v = q.detach(), k.detach(), v.detach()
    with pytest.raises(TypeError, match="torch.func transform"):
        torch.func.grad(lambda x: attn(x, k, v).sum())(q)
    with pytest.raises(TypeError, match="torch.func transform"):
        torch.func.vjp(lambda x: attn(x, k, v), q)
    with pytest.raises(TypeError, match="torch.func transform"):
        torch.vmap(lambda a, b, c: attn(a[None], b[None], c[None]))(q, k, v)


def test_the_backward_gets_no_zero_tensor_for_lse_s_gradient(device, monkeypatch):
    """A call without return_lse leaves lse out of the loss, and autograd hands the backward None for it rather
    than a zero tensor it would allocate and fill on every step."""
    from kernelgen.dispatch import _AttentionFunction

    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2)
    q, k, v, do = leaves(1, 1, 1, 64, 64, 64, torch.float32, device, seed=5)
    seen, backward = [], _AttentionFunction.backward
    monkeypatch.setattr(_AttentionFunction, "backward",
                        staticmethod(lambda ctx, do, dlse: seen.append(dlse) or backward(ctx, do, dlse)))
    kernelgen.get_kernel(spec)(q, k, v).backward(do)
    assert seen == [None]
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_backward_roles_are_served_like_the_forward_s(device):
    """Configs come from `_served` (pinned, DB or default); a spec whose backend lacks a backward role, or
    cannot run where its role is optional (TileLang's bwd_dkdv on the CPU), has it run by the fallback, Triton."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=4, causal=True)
    pinned = BwdDqConfig(block_m=32, num_warps=4, num_stages=1)
    attn = kernelgen.get_kernel(spec, configs={"bwd_dq": pinned})
    assert attn.served("bwd_dq", 1000, torch.float16, device).source == "pinned"
    assert attn.config("bwd_dq", 1000, 1000, torch.float16, device) == pinned
    assert attn.config("bwd_dkdv", 1000, 1000, torch.float16, device) == default_config(spec, "bwd_dkdv")
    for name in backends.names():
        other = spec.replace(backend=name)
        if backends.get(name).unsupported(other):
            continue
        for role in BACKWARD_ROLES:
            served = kernelgen.get_kernel(other).served(role, 1000, torch.float16, device)
            own = role in backends.get(name).roles and not backends.get(name).device_unsupported(device)
            assert served.backend.name == (name if own else backends.FALLBACK) and served.source == "default"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the wrong scale's exp overflows fp16
@pytest.mark.parametrize("role", ["bwd_dq", "bwd_dkdv"])
def test_tuner_checks_backward_configs_against_autograd(role, monkeypatch):
    """The roles' tuned workloads: the default passes the tuner's check; a launch computing something else
    (the gradients of another scale) fails it."""
    assert_tuner_checks_against_autograd(Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2),
                                         role, monkeypatch)


def assert_tuner_checks_against_autograd(spec, role, monkeypatch):
    """The default config of `role` passes the tuner's check at 100 keys (fp16, CPU); a launch that computes
    the gradients of another scale fails it."""
    backend = backends.runner(spec.backend, role)
    kernel_spec = kernelgen.roles.get_role(role).kernel_spec(spec, backend.name)
    config = default_config(spec, role)
    assert check_config(backend, kernel_spec, role, config, 100, torch.float16, "cpu") is None
    impl = backend.roles[role]

    def wrong_scale(kernel, spec, config, shapes, *args):
        return impl.launch(kernel, spec, config, shapes, *args[:-1], 0.5)

    monkeypatch.setitem(backend.roles, role, dataclasses.replace(impl, launch=wrong_scale))
    error = check_config(backend, kernel_spec, role, config, 100, torch.float16, "cpu")
    assert error is not None and "differs from the reference" in error


def test_a_backward_role_tunes_on_the_cpu(tmp_path, monkeypatch):
    """The tuner's plumbing (worker process, check against autograd, DB row) takes a backward role as it
    takes the forward's."""
    from kernelgen.tuning import tune
    from kernelgen.tuning.db import TuningDB

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=2, causal=True, gqa_group=2)
    with TuningDB(tmp_path / "tuning.db") as db:
        result = tune(spec, role="bwd_dkdv", seq=128, trials=2, device="cpu", db=db, storage=tmp_path / "optuna.db")
        rows = db.rows()
    assert result.n_trials == 2 and result.n_failed == 0 and result.tflops > 0
    assert [(r["role"], r["backend"]) for r in rows] == [("bwd_dkdv", "triton")]
    assert BwdDkdvConfig(**result.best_config) in backends.get("triton").config_space(
        kernelgen.roles.get_role("bwd_dkdv").kernel_spec(spec, "triton"), "bwd_dkdv", "cpu")


def test_custom_op_compiles_forward_and_backward_without_graph_breaks(device):
    spec = Spec(head_dim=64, kv_block=32, q_tile=32, top_k=3, causal=True, gqa_group=2, local=1)

    def layer(q, k, v, do):
        o, lse = sparse_attention(q, k, v, spec)
        return (o * do).sum() + lse.sum().detach()

    q, k, v, do = leaves(1, 2, 2, 130, 150, 64, torch.float32, device, seed=19)
    layer(q, k, v, do).backward()
    eager = [x.grad.clone() for x in (q, k, v)]
    (dq, dk, dv), _ = run_backward(spec, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(eager, (dq, dk, dv)))  # the op is the eager API
    for x in (q, k, v):
        x.grad = None
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: a graph break is an error
    compiled(q, k, v, do).backward()
    for a, b in zip(eager, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


# ---- sm_90: the backward's kernels compile (ptxas included) and fit the H200's shared memory -------------

EDGE = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4, selector="given")
SM90 = [  # (spec, dq config, dkdv config; None: the default)
    (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16), None, None),
    (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4), None, None),
    (Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=2, local=1, sink=1),
     BwdDqConfig(block_m=128, num_warps=8, num_stages=2), BwdDkdvConfig(block_n=32, block_m=128, num_warps=8,
                                                                        num_stages=1)),
    (Spec(head_dim=256, kv_block=32, q_tile=32, top_k=8, causal=True, gqa_group=2), None, None),
    (Spec(head_dim=64, kv_block=16, q_tile=32, top_k=64, selector="given"), None, None),
    # the configs nearest the shared-memory limit (the estimates decide what the tuner may try)
    (EDGE, BwdDqConfig(block_m=64, num_warps=8, num_stages=3),
     BwdDkdvConfig(block_n=64, block_m=128, num_warps=8, num_stages=3)),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the offline compile stands in for a GPU")
def test_backward_kernels_compile_for_sm90_and_fit_shared_memory():
    pytest.importorskip("triton.backends.nvidia")
    cases = []
    for spec, dq, dkdv in SM90:
        chooser = spec if spec.selects else spec.replace(selector="mean")
        cases.append({"spec": spec.to_dict(), "n": 3000,
                      **{role: dataclasses.asdict(cfg or default_config(spec if role != "select" else chooser, role))
                         for role, cfg in (("attn", None), ("select", None), ("bwd_dq", dq), ("bwd_dkdv", dkdv))}})
    for (spec, dq, dkdv), case, result in zip(SM90, cases, compile_offline(cases, "sm_90")):
        assert "error" not in result, f"{spec}: {result.get('error')}"
        kernels = dict(result["kernels"])
        assert {"attn_bwd_delta", "attn_bwd_dq", "attn_bwd_dkdv"} <= set(kernels), kernels
        assert all(shared <= ARCHS["sm_90"].smem_per_block for shared in kernels.values()), kernels
        # the estimates bound what Triton asks for (give or take its barriers), exactly near the limit
        for name, estimate in (("attn_bwd_dq", bwd_dq_smem_bytes(spec, BwdDqConfig(**case["bwd_dq"]))),
                               ("attn_bwd_dkdv", bwd_dkdv_smem_bytes(spec, BwdDkdvConfig(**case["bwd_dkdv"])))):
            assert kernels[name] <= estimate + 1024, (name, estimate, kernels)
            if spec is EDGE:
                assert estimate <= kernels[name] + 2048, (name, estimate, kernels)


# ---- GPU: bf16 and fp16 at 4k-32k, against the float64 reference ---------------------------------------

GPU_CASES = {  # (spec, batch, heads_kv, n_q, n_k)
    "d64_32k": (Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16), 1, 2, 32768, 32768),
    "d128_gqa4_causal_8k": (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, causal=True, gqa_group=4,
                                 local=1, sink=1), 1, 2, 8192, 8192),
    "d128_gqa8_q4k_k16k": (Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=8), 2, 1, 4096, 16384),
    "d64_causal_ragged": (Spec(head_dim=64, kv_block=64, q_tile=128, top_k=12, causal=True, gqa_group=2),
                          1, 2, 5000, 6001),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_against_reference(case, dtype):
    spec, b, hkv, nq, nk = GPU_CASES[case]
    q, k, v, do = leaves(b, hkv, spec.gqa_group, nq, nk, spec.head_dim, dtype, "cuda", seed=len(case))
    check_against_reference(spec, q, k, v, do)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d64_32k", "d128_gqa4_causal_8k"])
def test_gpu_backward_is_deterministic(case):
    spec, b, hkv, nq, nk = GPU_CASES[case]
    q, k, v, do = leaves(b, hkv, spec.gqa_group, nq, nk, spec.head_dim, torch.bfloat16, "cuda", seed=1)
    first = [g.clone() for g in run_backward(spec, q, k, v, do)[0]]
    for _ in range(3):
        again = run_backward(spec, q, k, v, do)[0]
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [name for name in backends.names() if name != backends.FALLBACK])
def test_gpu_backward_after_another_backend_s_forward(backend):
    """The TileLang and Gluon forwards' outputs backpropagate through the Triton backward."""
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, causal=True, backend=backend)
    if backends.get(backend).unsupported(spec, "cuda"):
        pytest.skip(backends.get(backend).unsupported(spec, "cuda"))
    check_against_reference(spec, *leaves(1, 2, 1, 4096, 4096, 64, torch.bfloat16, "cuda", seed=4))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", backends.names())
def test_gpu_training_step_replays_from_a_cuda_graph(backend):
    """A forward and backward captured in one CUDA graph (as torch.compile's reduce-overhead mode and the
    training bench capture them) replay to the eager step's gradients, bit for bit."""
    spec = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=8, causal=True, gqa_group=2, selector="given",
                backend=backend)
    if backends.get(backend).unsupported(spec, "cuda"):
        pytest.skip(backends.get(backend).unsupported(spec, "cuda"))
    q, k, v, do = leaves(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "cuda", seed=5)
    attn = kernelgen.get_kernel(spec)
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, spec.n_kv_blocks(4096), (1, 2, spec.n_q_tiles(4096), 8), generator=gen).int().cuda()
    lists = attn.prepare(raw, 4096, 4096)

    def step():
        return torch.autograd.grad(attn(q, k, v, block_idx=lists), (q, k, v), do)

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch.cuda.graph asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for grad in captured:
        grad.fill_(float("nan"))  # the replay must write every element
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


@pytest.mark.gpu
def test_gpu_prepared_lists_and_given_lists():
    spec = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=8, causal=True, gqa_group=2, selector="given")
    q, k, v, do = leaves(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "cuda", seed=2)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-2, spec.n_kv_blocks(4096) + 2, (1, 2, spec.n_q_tiles(4096), 8), generator=gen).cuda()
    lists = kernelgen.get_kernel(spec).prepare(raw, 4096, 4096)
    prepared, _ = check_against_reference(spec, q, k, v, do, lists)
    prepared = [g.clone() for g in prepared]
    again, _ = run_backward(spec, q, k, v, do, raw)
    assert all(torch.equal(a, b) for a, b in zip(prepared, again))

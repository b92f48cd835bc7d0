"""Bad inputs to `get_kernel(spec)(q, k, v, ...)` and `.select(q, k)` fail early with a clear error that
names the argument and says what was expected. Everything here is tiny (N <= 130, D = 64)."""
import re

import numpy as np
import pytest
import torch

import kernelgen
from kernelgen import Spec, reference
from checks import assert_close_to_reference

D = 64
SPEC = Spec(head_dim=D, kv_block=32, q_tile=64, top_k=2, causal=True, gqa_group=2)
GIVEN = SPEC.replace(selector="given")


def qkv(device, b=1, hkv=1, g=2, nq=64, nk=96, d=D, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, nq, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def lists(spec, nq, nk, device, b=1, hkv=1, dtype=torch.int32):
    """Valid lists: block 0 and the last block of every tile (fits any top_k >= 2)."""
    n_tiles, n_blocks = spec.n_q_tiles(nq), spec.n_kv_blocks(nk)
    idx = torch.full((b, hkv, n_tiles, spec.top_k), -1, dtype=dtype)
    idx[..., 0] = 0
    idx[..., 1] = n_blocks - 1
    return idx.to(device)


@pytest.fixture
def attn():
    return kernelgen.get_kernel(SPEC)


def test_valid_call_runs(attn, device):
    """The baseline every other case below perturbs by one argument."""
    q, k, v = qkv(device)
    o = attn(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype and not torch.isnan(o).any()


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-0.125, ValueError), (float("nan"), TypeError),
                                        ("0.1", TypeError), (torch.tensor(0.1), TypeError), (True, TypeError)])
def test_bad_scale(attn, device, bad, error):
    with pytest.raises(error, match=r"^scale must be"):
        attn(*qkv(device), scale=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None, torch.tensor(True)], ids=["str", "int", "None", "tensor"])
def test_return_lse_must_be_a_bool(attn, device, bad):
    with pytest.raises(kernelgen.KernelgenTypeError, match=r"^return_lse must be a bool"):
        attn(*qkv(device), return_lse=bad)


def test_scale_is_applied(device):
    q, k, v = qkv(device)
    idx = lists(GIVEN, 64, 96, device)
    o = kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx, scale=0.3)
    ref_o, _, _ = reference.sparse_attention(q, k, v, GIVEN, block_idx=idx, scale=0.3)
    assert ((o.double() - ref_o).norm() / ref_o.norm()) < 1e-2
    # a NumPy scalar is a real number as a Python float is: the same call
    assert torch.equal(kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx, scale=np.float32(0.3)),
                       kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx, scale=float(np.float32(0.3))))


# ---- q, k, v ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 1.0, "q", [[1.0]]], ids=["None", "float", "str", "list"])
def test_not_a_tensor(attn, device, name, bad):
    args = dict(zip("qkv", qkv(device)))
    args[name] = bad
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor, got {type(bad).__name__}"):
        attn(**args)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(64, D), (2, 64, D), (1, 1, 2, 64, D)], ids=["2d", "3d", "5d"])
def test_wrong_ndim(attn, device, name, shape):
    args = dict(zip("qkv", qkv(device)))
    args[name] = torch.randn(*shape).to(device, torch.float16)
    with pytest.raises(ValueError, match=r"^" + re.escape(f"{name} must be 4-D [B, H, N, D], got shape {tuple(shape)}")):
        attn(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang", "auto"])
def test_gpu_float32_is_a_type_error(backend):
    """float32 runs on the CPU only: on a GPU the kernels' products would round it to tf32."""
    q, k, v = qkv("cuda", dtype=torch.float32)
    attn = kernelgen.get_kernel(SPEC.replace(kv_block=64, backend=backend))
    with pytest.raises(TypeError, match=r"^q\.dtype must be float16 or bfloat16 on a GPU, got torch\.float32: .*tf32"):
        attn(q, k, v)
    q, k, v = qkv("cuda", dtype=torch.float16)
    attn(q, k, v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.bool, torch.uint8])
def test_unsupported_dtype(attn, device, dtype):
    """The dtypes the call takes on this device: bfloat16 only on a GPU (the interpreter computes garbage)."""
    expected = "float16 or float32 \\(bfloat16 on a GPU\\)" if device == "cpu" else "float16 or bfloat16"
    q, k, v = qkv(device)
    bad = (q * 4).to(dtype)
    with pytest.raises(TypeError, match=rf"^q\.dtype must be {expected}, got " + str(dtype)):
        attn(bad, k, v)
    bad = (k * 4).to(dtype)
    with pytest.raises(TypeError, match=rf"^k\.dtype must be {expected}"):
        attn(q, bad, v)
    with pytest.raises(TypeError, match=rf"^q\.dtype must be {expected}"):
        attn.select((q * 4).to(dtype), k)


@pytest.mark.parametrize("name", ["k", "v"])
def test_dtype_mismatch(attn, device, name):
    args = dict(zip("qkv", qkv(device)))
    args[name] = args[name].float()
    with pytest.raises(TypeError, match=rf"^{name}\.dtype = torch\.float32 differs from q\.dtype = torch\.float16"):
        attn(**args)


def test_dtype_mismatch_in_select(attn, device):
    q, k, _ = qkv(device)
    with pytest.raises(TypeError, match=r"^k\.dtype = torch\.float32 differs from q\.dtype = torch\.float16"):
        attn.select(q, k.float())


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_head_dim_mismatch(attn, device, name):
    args = dict(zip("qkv", qkv(device)))
    t = args[name]
    args[name] = torch.zeros(*t.shape[:-1], 128, device=device, dtype=t.dtype)
    with pytest.raises(ValueError, match=rf"^{name}\.shape\[-1\] = 128 does not match spec\.head_dim = {D}"):
        attn(**args)


def test_head_dim_mismatch_in_select(attn, device):
    q, k, _ = qkv(device, d=128)
    with pytest.raises(ValueError, match=rf"^q\.shape\[-1\] = 128 does not match spec\.head_dim = {D}"):
        attn.select(q, k)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_stride(attn, device, name):
    args = dict(zip("qkv", qkv(device)))
    t = args[name]
    strided = torch.zeros(*t.shape[:-1], 2 * D, device=device, dtype=t.dtype)[..., ::2]
    assert strided.shape == t.shape and strided.stride(-1) == 2
    args[name] = strided
    with pytest.raises(ValueError, match=rf"^{name} must be contiguous in its last dim \(stride 1\)"):
        attn(**args)


def test_other_strides_are_fine(attn, device):
    """Only the last dim must be unit-stride: a [B, N, H, D] buffer seen as [B, H, N, D] is accepted."""
    q, k, v = qkv(device)
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q2.is_contiguous() and q2.stride(-1) == 1
    torch.testing.assert_close(attn(q2, k, v), attn(q, k, v), rtol=0, atol=0)


def test_device_mismatch(attn, device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match=r"^v is on meta but q is on"):
        attn(q, k, v.to("meta"))


def test_kv_shape_mismatch(attn, device):
    q, k, _ = qkv(device)
    _, _, v = qkv(device, nk=64)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape, got \(1, 1, 96, 64\) and \(1, 1, 64, 64\)"):
        attn(q, k, v)
    _, _, v = qkv(device, hkv=2)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        attn(q, k, v)


def test_batch_mismatch(attn, device):
    q, _, _ = qkv(device, b=2)
    _, k, v = qkv(device, b=1)
    with pytest.raises(ValueError, match=r"^k\.shape\[0\] = 1 does not match q\.shape\[0\] = 2 \(batch\)"):
        attn(q, k, v)
    with pytest.raises(ValueError, match=r"^k\.shape\[0\] = 1 does not match q\.shape\[0\] = 2"):
        attn.select(q, k)


@pytest.mark.parametrize("hq, hkv", [(3, 1), (2, 2), (1, 1), (8, 2)])
def test_heads_not_gqa_group_times_kv_heads(attn, device, hq, hkv):
    q = torch.zeros(1, hq, 64, D, device=device, dtype=torch.float16)
    k = torch.zeros(1, hkv, 96, D, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"^q has {hq} heads \(dim 1\) but k has {hkv} and spec\.gqa_group = 2: "
                                         rf"expected {2 * hkv}; the layout is q \[B, Hq, Nq, D\]"):
        attn(q, k, k)
    with pytest.raises(ValueError, match=rf"^q has {hq} heads"):
        attn.select(q, k)


@pytest.mark.parametrize("kv_layout", ["[B, H, N, D]", "[B, N, H, D]"])
def test_sequence_first_q_names_the_layout(attn, device, kv_layout):
    """q as [B, N, H, D] (FlashAttention's layout), k and v in either: an error naming kernelgen's layout."""
    q, k, v = qkv(device, hkv=2)
    q = q.transpose(1, 2).contiguous()
    if kv_layout == "[B, N, H, D]":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    layout = re.escape(kernelgen.inputs.LAYOUT)
    with pytest.raises(kernelgen.KernelgenValueError, match=rf"^q has 64 heads \(dim 1\) .*; the layout is {layout}"):
        attn(q, k, v)
    with pytest.raises(kernelgen.KernelgenValueError, match=rf"the layout is {layout}"):
        attn.select(q, k)


def test_batch_and_kv_mismatch_name_the_layout(attn, device):
    q, k, v = qkv(device)
    layout = re.escape(kernelgen.inputs.LAYOUT)
    with pytest.raises(kernelgen.KernelgenValueError, match=rf"\(batch\); the layout is {layout}$"):
        attn(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(kernelgen.KernelgenValueError, match=rf"same shape.*; the layout is {layout}$"):
        attn(q, k, v.transpose(1, 2).contiguous())


@pytest.mark.parametrize("which", ["q", "k"])
def test_empty_sequence(attn, device, which):
    q, k, v = qkv(device, nq=0 if which == "q" else 64, nk=0 if which == "k" else 96)
    with pytest.raises(ValueError, match=r"^empty input"):
        attn(q, k, v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 is rejected only by the CPU interpreter")
def test_bf16_on_cpu(attn):
    q, k, v = qkv("cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^q\.dtype = torch\.bfloat16 is not supported by the Triton CPU interpreter.*"
                                        r"use float16 or float32"):
        attn(q, k, v)
    with pytest.raises(TypeError, match=r"bfloat16 is not supported"):
        attn.select(q, k)


# ---- block_idx -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_block_idx_dtype(device, dtype):
    q, k, v = qkv(device)
    idx = lists(GIVEN, 64, 96, device).to(dtype)
    with pytest.raises(TypeError, match=rf"^block_idx\.dtype must be torch\.int32 \(or int64, converted\), got {dtype}"):
        kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx)


@pytest.mark.parametrize("bad", [[[[[0, 2]]]], (0, 2), 3, object()], ids=["list", "tuple", "int", "object"])
def test_block_idx_not_a_tensor(device, bad):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match=r"^block_idx must be a torch\.Tensor, got "):
        kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=bad)


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 2), (1, 1, 2, 3), (1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 2), (1, 1, 1, 1, 2), (1, 2, 1, 1)],
)
def test_block_idx_shape(device, shape):
    """Expected [B, Hkv, n_q_tiles, top_k] = (1, 1, 1, 2) for Nq = 64, q_tile = 64, top_k = 2 (lists are
    per KV head, not per query head)."""
    q, k, v = qkv(device)
    idx = torch.zeros(shape, dtype=torch.int32, device=device)
    expect = r"\(1, 1, 1, 2\)"
    if shape == (1, 1, 1, 2):
        kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx)  # the right shape is accepted
        return
    with pytest.raises(ValueError, match=rf"^block_idx\.shape = .*expected \[B, Hkv, n_q_tiles, top_k\] = {expect}"):
        kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx)


def test_block_idx_device(device):
    q, k, v = qkv(device)
    idx = lists(GIVEN, 64, 96, "meta")
    with pytest.raises(ValueError, match=r"^block_idx is on meta but q is on"):
        kernelgen.get_kernel(GIVEN)(q, k, v, block_idx=idx)


def test_given_without_block_idx(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match=r"selector='given' needs block_idx=int32 \[B, Hkv, n_q_tiles, top_k\]"):
        kernelgen.get_kernel(GIVEN)(q, k, v)


def test_select_on_given_spec(device):
    q, k, _ = qkv(device)
    with pytest.raises(ValueError, match=r"selector='given' has no selector: pass block_idx"):
        kernelgen.get_kernel(GIVEN).select(q, k)


def test_selecting_spec_also_accepts_block_idx(attn, device):
    """A caller may override a selecting spec's choice with its own lists."""
    q, k, v = qkv(device)
    idx = lists(SPEC, 64, 96, device)
    o, lse = attn(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, SPEC, block_idx=idx)
    assert_close_to_reference(o, lse, ref_o, ref_lse, q.dtype)


@pytest.mark.parametrize(
    "big",
    [2**32 + 1, -(2**32) + 1, 2**31 + 1, 2**63 - 1, -(2**63)],
    ids=["2^32+1", "-2^32+1", "2^31+1", "int64max", "int64min"],
)
def test_int64_block_idx_is_not_wrapped(device, big):
    """An int64 id outside int32 is an empty slot (as in the reference), never its low 32 bits."""
    spec = Spec(head_dim=D, kv_block=32, q_tile=64, top_k=2, causal=False, gqa_group=1, selector="given")
    q, k, v = qkv(device, g=1, nq=130, nk=128, dtype=torch.float32, seed=3)
    idx = torch.tensor([[[[big, 0], [2, big], [big, -1]]]], dtype=torch.int64, device=device)
    o, lse = kernelgen.get_kernel(spec)(q, k, v, block_idx=idx, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=idx)
    assert torch.isneginf(ref_lse[:, :, 128:]).all()  # tile 2 has only `big`: it sees no key
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)
    # and the test would see a wrap: with the truncated id the result differs
    wrapped = idx.to(torch.int32)
    wrapped_o, _, _ = reference.sparse_attention(q, k, v, spec, block_idx=wrapped)
    if not torch.equal(reference.normalize_block_idx(wrapped, 4), reference.normalize_block_idx(idx, 4)):
        assert (o.double() - wrapped_o).abs().max() > 0.1


# ---- autograd and spec -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_requires_grad(attn, device, name):
    """An input that requires grad makes o backpropagate into it alone (tests/test_backward.py checks the
    values); under torch.no_grad(), o is detached."""
    args = dict(zip("qkv", qkv(device)))
    args[name].requires_grad_(True)
    o = attn(**args)
    assert o.requires_grad
    o.sum().backward()  # do is expanded from a scalar: stride 0
    assert {x for x, t in args.items() if t.grad is not None} == {name}
    assert not torch.isnan(args[name].grad).any()
    with torch.no_grad():
        o = attn(**args)
    assert not o.requires_grad and not torch.isnan(o).any()


def test_requires_grad_with_given_lists(device):
    q, k, v = qkv(device)
    kernelgen.get_kernel(GIVEN)(q.requires_grad_(), k, v, block_idx=lists(GIVEN, 64, 96, device)).sum().backward()
    assert q.grad is not None and not torch.isnan(q.grad).any()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=1, causal=True, sink=1),  # the diagonal block + 1 sink
        dict(top_k=2, causal=True, local=3),
        dict(top_k=3, causal=False, local=2, sink=2),
        dict(top_k=1, causal=False, sink=2),
    ],
)
def test_top_k_too_small_for_forced_blocks(kwargs):
    n_local = max(kwargs.get("local", 0), 1) if kwargs["causal"] else kwargs.get("local", 0)
    forced = kwargs.get("sink", 0) + n_local
    with pytest.raises(ValueError, match=rf"^Spec\.top_k={kwargs['top_k']} cannot hold its forced blocks: .* = {forced}"):
        Spec(head_dim=D, **kwargs)
    Spec(head_dim=D, **{**kwargs, "top_k": forced})  # exactly enough is fine


@pytest.mark.parametrize("configs, error, match", [
    ({"attn": kernelgen.SelectConfig()}, TypeError, r"configs\['attn'\] must be an instance of AttnConfig"),
    ({"attn": kernelgen.AttnConfig(block_m=48)}, ValueError, r"configs\['attn'\] = .* is not feasible"),
    ({"attn": kernelgen.AttnConfig(block_m=64, kv_per_iter=3)}, ValueError, "not feasible"),
    ({"select": kernelgen.SelectConfig(tiles=8, chunk=32, splits=3)}, ValueError, r"configs\['select'\]"),
    ({"fwd": kernelgen.AttnConfig()}, ValueError,
     re.escape(f"role='fwd' is unknown; expected one of {sorted(kernelgen.roles.ROLES)}")),
    ({"kv_attn": kernelgen.KvAttnConfig()}, ValueError, r"configs pins 'kv_attn', which no call of .* runs"),
])
def test_pinned_configs_are_checked(configs, error, match):
    """A pinned config outside the feasible space (one that could leave rows unwritten) is refused."""
    with pytest.raises(error, match=match):
        kernelgen.get_kernel(SPEC, configs=configs)


def test_get_kernel_needs_a_spec():
    with pytest.raises(TypeError, match=r"^spec must be a kernelgen\.Spec, got str"):
        kernelgen.get_kernel("head_dim=64")


def test_cdiv_is_the_ceiling_of_ints():
    from kernelgen.inputs import cdiv

    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1  # no float rounding

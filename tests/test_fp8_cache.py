"""Calls over an fp8 KV cache: k and v float8_e4m3fn or float8_e5m2, with dequantisation scales (`k_scale=`,
`v_scale=`: a float, a one-element float32 tensor, or float32 [B, Hkv]). A call attends as over k * k_scale and
v * v_scale (the float64 reference over the dequantised cache), selects the same blocks, and new keys are written
quantised as `(x / scale).clamp(-fp8_max, fp8_max).to(fp8 dtype)` quantises them (fp8_max: 448 for e4m3, 57344 for
e5m2)."""
import dataclasses

import pytest
import torch

from kernelgen import DecodeConfig, custom_ops, get_kernel, reference
from kernelgen.errors import KernelgenTypeError, KernelgenValueError

from checks import assert_close_to_reference, assert_valid_selection
from test_cache_seqlens import _cache, _spec
from test_paged_kv import paged

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def quantise(x: torch.Tensor, scale, dtype=FP8) -> torch.Tensor:
    """x [B, H, N, D] as an fp8 cache of `scale` (a float, or [B, H])."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    scale = scale.view(-1, scale.shape[-1], 1, 1) if scale.dim() == 2 else scale
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantised(x8: torch.Tensor, scale) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float64, device=x8.device)
    return x8.double() * (scale.view(-1, scale.shape[-1], 1, 1) if scale.dim() == 2 else scale)


def _fp8_cache(n_q, dtype, device, k_scale, v_scale, fp8=FP8, **kw):
    q, k, v, lens = _cache(n_q, dtype, device, **kw)
    return q, quantise(k, k_scale, fp8), quantise(v, v_scale, fp8), lens


def _row_scales(device, batch=5, heads_kv=2):
    return (torch.rand(batch, heads_kv, generator=torch.Generator().manual_seed(1)) * 0.05 + 0.005).to(device)


@pytest.mark.parametrize("selector, n_q, dtype, scales, fields, fp8", [
    ("mean", 1, torch.float32, "rows", {}, FP8),                  # decode, [B, Hkv] scales
    ("multi:2", 3, torch.float16, "float", {}, FP8),              # decode of a few queries
    ("mean", 40, torch.float32, "one", {}, FP8),                  # a prefill chunk (attn_rows), one-element tensors
    ("mean", 1, torch.float32, "float", {"softcap": 30.0}, FP8),  # decode, capped
    ("mean", 2, torch.float16, "rows", {"window": 40, "top_k": 5, "local": 0, "sink": 0}, FP8),  # a window's lists
    ("multi:2", 3, torch.float32, "rows", {"schedule": "kv_centric"}, FP8),  # per-query lists' decode
    ("mean", 40, torch.float16, "float", {"schedule": "kv_centric"}, FP8),  # and prefill chunk (kv_attn_rows)
    ("mean", 1, torch.float16, "one", {}, E5M2),                  # an e5m2 cache: decode
    ("mean", 40, torch.float32, "rows", {}, E5M2),                # a prefill chunk
    ("mean", 40, torch.float32, "one", {"schedule": "kv_centric"}, E5M2),  # per-query lists' prefill chunk
])
def test_a_call_over_an_fp8_cache_is_the_reference_over_the_dequantised_cache(selector, n_q, dtype, scales, fields,
                                                                               fp8, device):
    """o and lse match the float64 reference over k * k_scale and v * v_scale, with the lists the reference selects
    there (a positive scale a batch row and KV head ranks its blocks as the stored keys do)."""
    spec = _spec(selector, **fields)
    k_scale, v_scale = {"rows": (_row_scales(device), _row_scales(device) * 2),
                        "float": (0.02, 0.03),
                        "one": (torch.tensor(0.02, device=device), torch.tensor([0.03], device=device))}[scales]
    q, k8, v8, lens = _fp8_cache(n_q, dtype, device, k_scale, v_scale, fp8)
    attn = get_kernel(spec, configs={"decode": DecodeConfig(splits=2)})
    o, lse = attn(q, k8, v8, cache_seqlens=lens, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q.double(), dequantised(k8, k_scale), dequantised(v8, v_scale),
                                                   spec, None, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, dtype)
    assert o.dtype == q.dtype
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()  # the empty row


@pytest.mark.parametrize("n_q, schedule", [(1, "q_centric"), (24, "q_centric"), (24, "kv_centric")])
def test_a_paged_fp8_cache_is_the_contiguous_one(n_q, schedule, device):
    """Over pages (decode, attn_paged and kv_attn_paged), the call is the contiguous fp8 cache's: the same lists, o
    to rounding."""
    spec = _spec("mean", schedule)
    k_scale, v_scale = _row_scales(device), 0.05
    q, k8, v8, lens = _fp8_cache(n_q, torch.float32, device, k_scale, v_scale, capacity=96,
                                 lengths=(96, 37, 0, 48, 1))
    k_pages, table = paged(k8, 32)
    v_pages, _ = paged(v8, 32, table=table.cpu())
    attn = get_kernel(spec)
    assert torch.equal(attn.select(q, k_pages, cache_seqlens=lens, block_table=table),
                       attn.select(q, k8, cache_seqlens=lens))
    o, lse = attn(q, k_pages, v_pages, block_table=table, cache_seqlens=lens, k_scale=k_scale, v_scale=v_scale,
                  return_lse=True)
    ref_o, ref_lse, _ = reference.sparse_attention(q.double(), dequantised(k8, k_scale), dequantised(v8, v_scale),
                                                   spec, None, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.float32)


@pytest.mark.parametrize("fp8", [FP8, E5M2])
def test_new_keys_are_written_quantised(fp8, device):
    """k_new and v_new go into the fp8 cache as the quantise formula writes them, bit for bit (values past the
    dtype's range saturate to its largest finite value), and the call attends over the longer rows."""
    spec = _spec("mean")
    k_scale, v_scale = _row_scales(device), 0.05
    q, k8, v8, lens = _fp8_cache(1, torch.float32, device, k_scale, v_scale, fp8)
    gen = torch.Generator().manual_seed(3)
    k_new, v_new = (torch.randn(5, 2, 1, 64, generator=gen).to(device) for _ in range(2))
    k_new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])  # saturated, saturated, zero, tiny
    k_new[0, 0, 0, 4:8] = torch.tensor([3e3, -2e3, 1e-7, 0.3]) * k_scale[0, 0].item()  # e5m2's range, subnormals
    k_new[0, 0, 0, 8:10] = torch.tensor([-1e-9, -0.0])  # a negative zero after rounding: -0 (0x80), as torch writes
    lens_before = torch.tensor([90, 37, 0, 48, 1], dtype=torch.int32, device=device)
    want_k, want_v = k8.clone(), v8.clone()
    for b, start in enumerate(lens_before.tolist()):
        want_k[b, :, start] = quantise(k_new[b:b + 1], k_scale[b:b + 1], fp8)[0, :, 0]
        want_v[b, :, start] = quantise(v_new[b:b + 1], v_scale, fp8)[0, :, 0]
    o = get_kernel(spec)(q, k8, v8, cache_seqlens=lens_before, k_new=k_new, v_new=v_new, k_scale=k_scale,
                         v_scale=v_scale)
    assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), want_v.view(torch.uint8))
    top = torch.finfo(fp8).max
    assert k8[0, 0, 90, 0].item() == top and k8[0, 0, 90, 1].item() == -top  # 1e4 / k_scale[0, 0] > 57344
    ref_o, _, _ = reference.sparse_attention(q.double(), dequantised(k8, k_scale), dequantised(v8, v_scale), spec,
                                             None, cache_seqlens=lens_before + 1)
    assert ((o.double() - ref_o).norm() / ref_o.norm()).item() < 1e-5


def test_the_custom_ops_and_varlen_take_an_fp8_cache(device):
    """The custom op (a float scale entering as a tensor) equals the eager call bit for bit; varlen over the cache
    gives each row's call, with its rows' [B, Hkv] scales."""
    spec = _spec("mean")
    k_scale, v_scale = _row_scales(device), 0.05
    q, k8, v8, lens = _fp8_cache(3, torch.float32, device, k_scale, v_scale, capacity=96, lengths=(96, 37, 0, 48, 1))
    attn = get_kernel(spec)
    o, lse = attn(q, k8, v8, cache_seqlens=lens, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    o_op, lse_op = custom_ops.sparse_attention(q, k8, v8, spec, cache_seqlens=lens, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
    counts = [1, 3, 0, 2, 1]  # rows of different query counts: each group's call takes its rows' scales
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    packed = torch.cat([q[b, :, 3 - n:].transpose(0, 1) for b, n in enumerate(counts)])
    out = attn.varlen(packed, k8, v8, cu, cache_seqlens=lens, k_scale=k_scale, v_scale=v_scale)
    for wrong in (k_scale[:2], k_scale.repeat(2, 1), k_scale.repeat(1, 2)):  # the batch's, not a group's
        with pytest.raises(KernelgenValueError, match=r"k_scale must have one element or shape \[B, Hkv\] = \[5, 2\]"):
            attn.varlen(packed, k8, v8, cu, cache_seqlens=lens, k_scale=wrong, v_scale=v_scale)
    for b, n in enumerate(counts):
        if n:
            alone = attn(q[b:b + 1, :, 3 - n:], k8[b:b + 1], v8[b:b + 1], cache_seqlens=lens[b:b + 1],
                         k_scale=k_scale[b:b + 1], v_scale=v_scale)
            got = out[cu[b]:cu[b + 1]].transpose(0, 1)
            assert torch.allclose(got, alone[0], rtol=1e-5, atol=1e-6), b


def test_kept_reps_and_a_compiled_step_over_an_fp8_cache(device):
    """Kept reps of the fp8 cache select as the call does, and a decode step compiled with fullgraph=True (a float
    scale and a tensor one, new keys written) equals the eager step bit for bit."""
    spec = _spec("mean")
    k_scale = _row_scales(device)
    q, k8, v8, lens = _fp8_cache(1, torch.float32, device, k_scale, 0.05)
    attn = get_kernel(spec)
    reps = attn.key_reps(k8, cache_seqlens=lens)
    want = attn(q, k8, v8, cache_seqlens=lens, k_scale=k_scale, v_scale=0.05)
    assert torch.equal(attn(q, k8, v8, cache_seqlens=lens, key_reps=reps, k_scale=k_scale, v_scale=0.05), want)
    k_new = torch.randn(5, 2, 1, 64, generator=torch.Generator().manual_seed(4)).to(device)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, lens, k_new):
        return attn(q, k, v, cache_seqlens=lens - 1, k_new=k_new, v_new=k_new, k_scale=k_scale, v_scale=0.05)

    k_eager, v_eager = k8.clone(), v8.clone()
    eager = attn(q, k_eager, v_eager, cache_seqlens=lens - 1, k_new=k_new, v_new=k_new, k_scale=k_scale,
                 v_scale=0.05)
    assert torch.equal(step(q, k8, v8, lens, k_new), eager)
    assert torch.equal(k8.view(torch.uint8), k_eager.view(torch.uint8))


def test_a_compiled_step_takes_a_new_float_scale(device):
    """A float scale passed to a compiled (fullgraph) step: a new value recompiles with the scale as a symbol, and
    each step equals the eager call; a scale that is not > 0 is refused in the graph too."""
    spec = _spec("mean")
    q, k8, v8, lens = _fp8_cache(1, torch.float32, device, 0.02, 0.02, E5M2)
    attn = get_kernel(spec)
    step = torch.compile(lambda q, k, v, lens, s: attn(q, k, v, cache_seqlens=lens, k_scale=s, v_scale=0.03),
                         fullgraph=True, backend="aot_eager")
    for scale in (0.02, 0.05, 0.011):
        assert torch.equal(step(q, k8, v8, lens, scale), attn(q, k8, v8, cache_seqlens=lens, k_scale=scale,
                                                               v_scale=0.03)), scale
    with pytest.raises(Exception, match="k_scale must be finite and > 0"):
        step(q, k8, v8, lens, -1.0)


def test_bad_fp8_caches_are_named(device):
    spec = _spec("mean")
    q, k8, v8, lens = _fp8_cache(1, torch.float32, device, 0.02, 0.02)
    attn = get_kernel(spec)
    with pytest.raises(KernelgenValueError, match="cache_seqlens="):
        attn(q, k8, v8)  # not a call over a cache
    with pytest.raises(KernelgenValueError, match="k_scale= dequantises an fp8 KV cache"):
        attn(q, k8.float(), v8.float(), cache_seqlens=lens, k_scale=0.02)
    with pytest.raises(KernelgenValueError, match="v_scale must be finite and > 0"):
        attn(q, k8, v8, cache_seqlens=lens, v_scale=-1.0)
    with pytest.raises(KernelgenValueError, match=r"k_scale requires grad: .* pass k_scale.detach\(\)"):
        attn(q, k8, v8, cache_seqlens=lens, k_scale=torch.ones(5, 2, device=device, requires_grad=True))
    with pytest.raises(KernelgenTypeError, match="k_scale must be float32"):
        attn(q, k8, v8, cache_seqlens=lens, k_scale=torch.ones(5, 2, dtype=torch.float64, device=device))
    with pytest.raises(KernelgenValueError, match=r"k_scale must have one element or shape \[B, Hkv\] = \[5, 2\]"):
        attn(q, k8, v8, cache_seqlens=lens, k_scale=torch.ones(2, 5, device=device))
    with pytest.raises(KernelgenTypeError, match="v.dtype = torch.float32 differs from k.dtype"):
        attn(q, k8, v8.float(), cache_seqlens=lens)
    with pytest.raises(KernelgenTypeError, match="v.dtype = torch.float8_e5m2 differs from k.dtype"):
        attn(q, k8, v8.to(E5M2), cache_seqlens=lens)
    with pytest.raises(KernelgenValueError, match="v_scale must be finite and > 0"):
        custom_ops.sparse_attention(q, k8, v8, spec, cache_seqlens=lens, v_scale=0.0)


def test_scales_of_one_element_are_read_in_place():
    """A one-element tensor scale reaches the kernels as it is (no copy a call), a float as one cached tensor."""
    from kernelgen.inputs import CacheRows, Shapes, check_kv_scales

    shapes = Shapes(5, 4, 2, 1, 96, 1, 3)
    rows, k8 = CacheRows(torch.zeros(5, dtype=torch.int32), None), torch.zeros(5, 2, 96, 64, dtype=FP8)
    one, per_row = torch.tensor(0.5), torch.rand(5, 2)
    scales = check_kv_scales(k8, k8, one, per_row, rows, shapes, torch.device("cpu")).kv_scales
    assert scales.k.data_ptr() == one.data_ptr() and scales.k.numel() == 1 and scales.v.data_ptr() == per_row.data_ptr()
    assert scales.strides() == (0, 1)
    again = check_kv_scales(k8, k8, 0.25, 0.25, rows, shapes, torch.device("cpu")).kv_scales
    assert again.k is check_kv_scales(k8, k8, 0.25, 1, rows, shapes, torch.device("cpu")).kv_scales.k
    assert again.k.tolist() == [0.25] and again.strides() == (0, 0)


def test_an_e4m3_cache_needs_sm_89(monkeypatch):
    """On a GPU older than sm_89 (here the device's arch made sm_80) an e4m3 cache is refused by the call, by
    select() and by key_reps(), before any kernel compiles; an e5m2 cache runs there."""
    from kernelgen import inputs

    spec = _spec("mean")
    q, k8, v8, lens = _fp8_cache(1, torch.float32, "cpu", 0.02, 0.02)
    attn = get_kernel(spec)
    monkeypatch.setattr(inputs, "device_arch", lambda device: "sm_80")
    refused = "float8_e4m3fn KV cache needs an sm_89 or newer GPU .e4m3 conversions.; this GPU is sm_80 .float8_e5m2"
    for call in (lambda: attn(q, k8, v8, cache_seqlens=lens, k_scale=0.02, v_scale=0.02),
                 lambda: attn.select(q, k8, cache_seqlens=lens), lambda: attn.key_reps(k8)):
        with pytest.raises(KernelgenTypeError, match=refused):
            call()
    k5, v5 = k8.to(E5M2), v8.to(E5M2)
    assert attn(q, k5, v5, cache_seqlens=lens, k_scale=0.02, v_scale=0.02).shape == q.shape


def test_a_role_that_reads_no_fp8_cache_is_refused(monkeypatch, device):
    """A role whose RoleImpl leaves fp8_kv off (a plug-in's) is refused by name, not fed an fp8 cache."""
    from kernelgen.backends.triton import TritonBackend

    roles = dict(TritonBackend.roles)
    roles["decode"] = dataclasses.replace(roles["decode"], fp8_kv=False)
    monkeypatch.setattr(TritonBackend, "roles", roles)
    q, k8, v8, lens = _fp8_cache(1, torch.float32, device, 0.02, 0.02)
    with pytest.raises(KernelgenValueError, match="the 'decode' role of backend 'triton' reads no fp8 KV cache"):
        get_kernel(_spec("mean", top_k=4))(q, k8, v8, cache_seqlens=lens)  # a spec of its own: no cached kernel


@pytest.mark.gpu
@pytest.mark.parametrize("n_q, paged_cache, schedule, fp8", [
    (1, False, "q_centric", FP8), (1, True, "q_centric", FP8), (4, False, "q_centric", FP8),
    (256, True, "q_centric", FP8), (1, True, "kv_centric", FP8), (256, True, "kv_centric", FP8),
    (256, False, "kv_centric", FP8), (1, True, "q_centric", E5M2), (256, False, "kv_centric", E5M2),
])
def test_an_fp8_cache_on_gpu(n_q, paged_cache, schedule, fp8):
    """bf16 queries over a 32k fp8 cache (decode, speculative steps and a paged prefill chunk) against the float64
    reference over the dequantised cache, over the lists the call selects (a valid top-k of the float64 scores: at
    near-ties a bf16 query's per-query lists may differ from the reference's own), and deterministic."""
    spec = _spec("mean").replace(head_dim=128, kv_block=128, q_tile=64, top_k=16, gqa_group=4, local=1, sink=1,
                                  schedule=schedule)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = (32768, 20000, 1)
    q = torch.randn(3, 16, n_q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(3, 4, 32768, 128, device="cuda", generator=gen) for _ in range(2))
    k_scale = k.abs().amax(dim=(2, 3)) / torch.finfo(fp8).max
    k8, v8 = quantise(k, k_scale, fp8), quantise(v, 0.01, fp8)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kc, vc, table = k8, v8, None
    if paged_cache:
        kc, table = paged(k8, 256)
        vc, _ = paged(v8, 256, table=table.cpu())
    attn = get_kernel(spec)
    o, lse = attn(q, kc, vc, cache_seqlens=lens, block_table=table, k_scale=k_scale, v_scale=0.01, return_lse=True)
    again = attn(q, kc, vc, cache_seqlens=lens, block_table=table, k_scale=k_scale, v_scale=0.01)
    assert torch.equal(o, again)
    idx = attn.select(q, kc, cache_seqlens=lens, block_table=table)
    assert_valid_selection(idx[:1], q[:1].double(), dequantised(k8[:1], k_scale[:1]), spec)  # the row of 32768 keys
    ref_o, ref_lse, _ = reference.sparse_attention(q.double(), dequantised(k8, k_scale), dequantised(v8, 0.01),
                                                   spec.replace(selector="given"), idx, cache_seqlens=lens)
    assert_close_to_reference(o, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [FP8, E5M2])
def test_new_keys_are_written_quantised_on_gpu(fp8):
    """bf16 new keys and values go into an fp8 cache (contiguous and paged) as torch quantises them, bit for bit:
    the GPU's own conversion after the kernel's rounding, saturated values and subnormals included."""
    spec = _spec("mean").replace(head_dim=128, kv_block=64, q_tile=64, top_k=8, gqa_group=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_scale = torch.rand(4, 2, device="cuda", generator=gen) * 0.05 + 0.005
    k8, v8 = (quantise(torch.randn(4, 2, 512, 128, device="cuda", generator=gen), s, fp8) for s in (k_scale, 0.02))
    q = torch.randn(4, 8, 3, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new, v_new = (torch.randn(4, 2, 3, 128, device="cuda", generator=gen).to(torch.bfloat16) * 4 for _ in range(2))
    k_new[0, 0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-6])  # saturated, saturated, zero, tiny
    lens = torch.tensor([500, 64, 0, 509], dtype=torch.int32, device="cuda")
    want_k, want_v = k8.clone(), v8.clone()
    for b, start in enumerate(lens.tolist()):
        n = min(3, 512 - start)
        want_k[b, :, start:start + n] = quantise(k_new[b:b + 1, :, :n], k_scale[b:b + 1], fp8)[0]
        want_v[b, :, start:start + n] = quantise(v_new[b:b + 1, :, :n], 0.02, fp8)[0]
    k_pages, table = paged(k8, 128)
    v_pages, _ = paged(v8, 128, table=table.cpu())
    attn = get_kernel(spec)
    attn(q, k8, v8, cache_seqlens=lens, k_new=k_new, v_new=v_new, k_scale=k_scale, v_scale=0.02)
    attn(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new, k_scale=k_scale,
         v_scale=0.02)
    for got, want in ((k8, want_k), (v8, want_v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    unpaged_k, _ = paged(want_k, 128, table=table.cpu())
    assert torch.equal(k_pages.view(torch.uint8), unpaged_k.view(torch.uint8))

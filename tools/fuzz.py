"""Randomized differential check of kernelgen against its float64 oracle, `kernelgen.reference`.

Each case is drawn from its seed: a random Spec (every selector, both schedules, sliding windows, soft-capping, and
on a GPU every backend and "auto"), ragged lengths with Nq != Nk and decode-sized calls (some over a cache of per-row
lengths, `cache_seqlens`, NaN past each row's keys, and the same over shuffled pages: `block_table`; longer calls
over such a cache too, a prefill chunk's; some such caches in fp8 with per-row scales), GQA, forced blocks, a scale, strided views of [B, N, H, D] buffers,
given lists holding -1, negative, out-of-range and repeated ids and empty rows (raw int32/int64 or prepared),
index-selector inputs (fp8 on sm_90), tunables pinned to random points of each role's search space, and a backward
run twice.

A case passes when the lists are a valid top-k, o and lse match the reference (NaN-poisoned outputs), the
gradients match float64 autograd, and the two backward runs are bitwise equal. A KernelgenValueError or
KernelgenTypeError is a rejection. Anything else (a wrong value, another exception, a dead process) fails.

    python tools/fuzz.py --minutes 10 [--device cuda] [--workers 4]   # cases until the time is up
    python tools/fuzz.py --case SEED [--device cuda]                   # one case, in full
    python tools/fuzz.py --distributed --minutes 10                    # context-parallel cases (below)

--distributed draws context-parallel cases instead: 2 to 4 ranks (`kernelgen.distributed.simulate` runs them
in one process), both layouts, the dense ring and the sparse fetch, given lists with bad ids, a backward; the
unsharded o, lse and gradients must match the reference of the whole sequence.

Results: one JSON line a case under --out; the summary lists every failure with its seed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ["KERNELGEN_POISON"] = "1"  # outputs start as NaN: an unwritten element fails its check
TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if TESTS not in sys.path:
    sys.path.append(TESTS)  # checks.py: the tests' tolerances and selection check

# how far an unchosen block may score above a chosen one (over the largest score): kernels' rounding
SELECTION_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}
# the float64 reference's scores are Nq x Nk per head: bound B * Hq * Nq * Nk
MAX_SCORES = {"cpu": 2 * 300 * 300, "cuda": 2**26}


# --------------------------------------------------------------------------------------------------------
# cases: plain dicts drawn from a seed, so that a failure replays from its seed or its JSON line
def draw_length(r: random.Random, device: str) -> int:
    u = r.random()
    if u < 0.2:
        return r.randint(1, 20)
    if u < 0.35:
        return r.choice([16, 17, 32, 63, 64, 65, 128, 256, 511, 512])
    if device == "cpu" or u < 0.7:
        return r.randint(21, 300)
    return r.randint(300, 4096)


def draw_case(seed: int, device: str = "cpu", max_len: int | None = None) -> dict:
    """The case of `seed` on `device`; `max_len` caps Nq and Nk (a quick run)."""
    r = random.Random(seed)
    gpu = device == "cuda"
    schedule = "kv_centric" if r.random() < 0.3 else "q_centric"
    backend = "triton"
    if gpu:
        backend = (r.choice(["triton", "triton", "auto"]) if schedule == "kv_centric"
                   else r.choice(["triton", "triton", "gluon", "tilelang", "tilelang", "auto"]))
    selector = r.choice(["mean", "mean", "multi:2", "multi:4", "given", "given", "given", "index", "index"])
    kv_block = r.choice([32, 64, 64, 128, 256] if gpu else [16, 32, 64])
    q_tile = 64 if schedule == "kv_centric" else r.choice([16, 32, 64, 64, 128])
    g = r.choice([1, 2, 4])
    spec = dict(head_dim=r.choice([64, 128]) if gpu else 64, kv_block=kv_block, q_tile=q_tile,
                top_k=r.choice([1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 40]), causal=r.random() < 0.6, gqa_group=g,
                selector=selector, schedule=schedule, local=r.choice([0, 0, 1, 1, 2, 3]),
                sink=r.choice([0, 0, 0, 1, 2]), backend=backend)
    b, hkv = r.choice([1, 1, 2]), (r.choice([1, 2]) if g <= 2 else 1)
    nq, nk = draw_length(r, device), draw_length(r, device)
    if r.random() < 0.2:
        nq = r.randint(1, 16)  # the decode path
    if max_len is not None:
        nq, nk = min(nq, max_len), min(nk, max_len)
    while b * hkv * g * nq * nk > MAX_SCORES[device]:
        nq, nk = max(1, nq // 2), max(1, (nk * 3) // 4)
    dtypes = ["bfloat16", "float16"] if gpu else ["float32", "float16"]
    case = dict(seed=seed, device=device, spec=spec, b=b, hkv=hkv, nq=nq, nk=nk, dtype=r.choice(dtypes),
                scale=None if r.random() < 0.8 else round(r.uniform(0.02, 0.5), 4), strided=r.random() < 0.2,
                backward=r.random() < 0.4,
                needs_grad=[True, True, True] if r.random() < 0.8 else [r.random() < 0.5 for _ in range(3)],
                lists=None, index=None, pin_configs=r.random() < 0.5 and backend != "auto", config_seed=seed)
    if selector == "given" or r.random() < 0.1:  # given lists, sometimes to a selecting spec as block_idx=
        case["lists"] = dict(kind=r.choice(["raw32", "raw64", "prepared", "prepared"]), seed=r.randint(0, 10**6),
                             p_invalid=r.choice([0.0, 0.1, 0.3]), p_repeat=r.choice([0.0, 0.2, 0.5]),
                             p_empty_row=r.choice([0.0, 0.05, 0.3]), p_distinct=r.choice([0.0, 0.5]))
    elif selector == "index":
        index_dtypes = ["float32", "float16"] + (["bfloat16", "float8_e4m3fn"] if gpu else [])
        case["index"] = dict(heads=r.choice([1, 2, 3, 4]), dim=r.choice([32, 64, 128]), shared=r.random() < 0.4,
                             dtype=r.choice(index_dtypes), w_dtype=r.choice(["float32", "float16"]))
    # a pooling selector's calls given kept key reps, made for a shorter cache and extended (drawn last: the
    # draws above stay those of earlier versions of this tool)
    case["kept_reps"] = case["lists"] is None and selector not in ("given", "index") and r.random() < 0.5
    # a decode call over a cache of per-row lengths (cache_seqlens): the case's k and v as row 0, other rows
    # shorter or longer, the capacity past them NaN (a read of it poisons o)
    case["ragged"] = (dict(extra=r.choice([0, 1, kv_block, 2 * kv_block + 3]), seed=r.randint(0, 10**6))
                      if nq <= 16 and selector != "index" and r.random() < 0.5 else None)
    # the same decode call over the cache in shuffled pages (block_table) of 1, 2 or 4 blocks
    case["paged"] = r.choice([1, 2, 4]) if case["ragged"] and r.random() < 0.5 else None
    # a prefill chunk over such a cache: the ragged call with more than 16 queries, over pages too
    if nq > 16 and selector != "index" and r.random() < 0.4:
        case["ragged"] = dict(extra=r.choice([0, 1, kv_block, 2 * kv_block + 3]), seed=r.randint(0, 10**6))
        case["paged"] = r.choice([1, 2, 4]) if r.random() < 0.5 else None
    # a sliding window (Q-centric, causal, no sink; a selecting spec's lists are its window's blocks), drawn last as
    # well
    if (r.random() < 0.25 and schedule == "q_centric" and spec["causal"] and selector != "index"
            and backend in ("triton", "auto")):
        window = r.choice([1, 7, 40, 64, 100, 300])
        spec.update(window=window, sink=0)
        from kernelgen.spec import window_blocks

        if selector != "given":  # Spec.n_local: the lists hold nothing else
            spec["top_k"] = max(spec["local"], 1, window_blocks(q_tile, kv_block, window))
        else:
            spec["top_k"] = max(spec["top_k"], spec["local"], 1)  # given lists keep the forced-blocks check
    # logit soft-capping (Q-centric, Triton): caps from ones that bite unit scores to Gemma 2's
    if r.random() < 0.2 and schedule == "q_centric" and backend in ("triton", "auto"):
        spec["softcap"] = r.choice([0.5, 2.0, 5.0, 50.0])
    # the cache (and its pages) as an fp8 cache (its dtype's name) with a scale per row and KV head, drawn last
    fp8 = bool(case["ragged"]) and r.random() < 0.3
    case["fp8_cache"] = r.choice(["float8_e4m3fn", "float8_e5m2"]) if fp8 else None
    # pages that hold no whole blocks (a block's keys each read from its page): 1 key, 5 (no divisor), half a block
    case["page_keys"] = r.choice([1, 5, kv_block // 2]) if case["paged"] and r.random() < 0.4 else None
    # a head dim that is no power of two (Triton's tiles pad it; TileLang and Gluon take powers of two), drawn last
    if r.random() < 0.25 and backend in ("triton", "auto"):
        spec["head_dim"] = r.choice([16, 48, 80, 96] + ([112, 192] if gpu else []))
    return case


def draw_distributed_case(seed: int, device: str = "cpu") -> dict:
    """A context-parallel case: world, layout, path, and a sequence of whole chunks of blocks and tiles."""
    r = random.Random(seed)
    world, layout = r.choice([2, 2, 3, 4]), r.choice(["zigzag", "contiguous"])
    kv_block, q_tile, g = r.choice([16, 32]), r.choice([16, 32]), r.choice([1, 2, 4])
    top_k, causal = r.choice([1, 2, 3, 5, 8]), r.random() < 0.6
    local, sink = r.choice([0, 0, 1, 2]), r.choice([0, 0, 1])
    if sink + max(local, 1 if causal else 0) > top_k:
        local = sink = 0
    chunk = max(kv_block, q_tile) * r.choice([1, 2, 3])
    n = chunk * world * (2 if layout == "zigzag" else 1)
    spec = dict(head_dim=64, kv_block=kv_block, q_tile=q_tile, top_k=top_k, causal=causal, gqa_group=g,
                selector="given", local=local, sink=sink)
    return dict(seed=seed, device=device, kind="distributed", spec=spec, world=world, layout=layout,
                path=r.choice(["dense", "sparse"]), b=r.choice([1, 2]), hkv=r.choice([1, 2]) if g < 4 else 1,
                nq=n, nk=n, dtype=r.choice(["float32", "float16"]), scale=None, strided=False, index=None,
                lists=dict(kind="raw32", seed=r.randint(0, 10**6), p_invalid=r.choice([0.0, 0.2]), p_repeat=0.1,
                           p_empty_row=r.choice([0.0, 0.1]), p_distinct=0.5))


def run_distributed_case(case: dict, torch, reference, spec) -> dict:
    """The whole sequence's o, lse and gradients from the simulated ranks, against the reference."""
    from kernelgen.distributed.simulate import simulate, unshard_runs

    q, k, v, do, _ = make_inputs(case, spec, torch)
    lists = make_lists(case, spec, torch)
    runs = simulate(q, k, v, lists, spec, world=case["world"], layout=case["layout"], path=case["path"], do=do)
    o, lse = unshard_runs(runs, "o"), unshard_runs(runs, "lse")
    ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, spec, block_idx=lists)
    result = dict(forward=compare_forward(o, lse, ref_o, ref_lse, q, torch))
    want = reference.sparse_attention_grads(q, k, v, do, spec, lists, stored_o=o)
    grads = [unshard_runs(runs, name) for name in ("dq", "dk", "dv")]
    result["backward"] = compare_grads(grads, want, [True] * 3, q.dtype, torch, (q, k, v, do, o, None))
    return result


# --------------------------------------------------------------------------------------------------------
class Failure(Exception):
    """A wrong result."""


def make_inputs(case, spec, torch):
    gen = torch.Generator().manual_seed(case["seed"] + 7)
    dtype, device = getattr(torch, case["dtype"]), case["device"]
    b, hkv, g, nq, nk, d = case["b"], case["hkv"], spec.gqa_group, case["nq"], case["nk"], spec.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if case["strided"]:  # views of [B, N, H, D] buffers, as FlashAttention's layout hands them over
        q = randn(b, nq, hkv * g, d).transpose(1, 2)
        kv = randn(b, nk, 2, hkv, d)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    else:
        q, k, v = randn(b, hkv * g, nq, d), randn(b, hkv, nk, d), randn(b, hkv, nk, d)
    do = randn(b, hkv * g, nq, d)
    index = None
    if case["index"] is not None:
        ix = case["index"]
        heads = hkv * ix["heads"]
        q_idx = torch.randn(b, heads, nq, ix["dim"], generator=gen).to(device=device)
        k_idx = torch.randn(b, 1 if ix["shared"] else hkv, nk, ix["dim"], generator=gen).to(device=device)
        w = (torch.randn(b, heads, nq, generator=gen) / ix["heads"] ** 0.5).to(device=device)
        index = (q_idx.to(getattr(torch, ix["dtype"])), k_idx.to(getattr(torch, ix["dtype"])),
                 w.to(getattr(torch, ix["w_dtype"])))
    return q, k, v, do, index


def make_lists(case, spec, torch):
    """Given lists of [B, Hkv, rows, top_k] ids (rows: Q tiles, or queries for per-query lists) with the
    case's share of invalid ids (-1, -7, n_blocks, n_blocks + 3, 10**6, or 2**32 + 1 in int64: a careless
    cast wraps it onto block 1), repeats and empty rows."""
    p, n_blocks = case["lists"], spec.n_kv_blocks(case["nk"])
    gen = torch.Generator().manual_seed(p["seed"])
    rows, top_k = case["b"] * case["hkv"] * spec.n_q_tiles(case["nq"]), spec.top_k
    idx = torch.randint(0, n_blocks, (rows, top_k), generator=gen)
    if torch.rand(1, generator=gen).item() < p["p_distinct"]:  # distinct ids a row, like a selector's
        idx = torch.stack([torch.randperm(max(n_blocks, top_k), generator=gen)[:top_k] for _ in range(rows)])
    repeat = torch.rand(rows, top_k, generator=gen) < p["p_repeat"]
    idx = torch.where(repeat, idx[:, :1].expand_as(idx), idx)
    invalid = torch.tensor([-1, -7, n_blocks, n_blocks + 3, 2**32 + 1 if p["kind"] == "raw64" else 10**6])
    kinds = torch.randint(0, len(invalid), (rows, top_k), generator=gen)
    idx = torch.where(torch.rand(rows, top_k, generator=gen) < p["p_invalid"], invalid[kinds], idx)
    idx[torch.rand(rows, generator=gen) < p["p_empty_row"]] = -1
    idx = idx.view(case["b"], case["hkv"], -1, top_k)
    if p["kind"] != "raw64":
        idx = idx.clamp(-2**31, 2**31 - 1).to(torch.int32)
    return idx.to(case["device"])


def pinned_configs(case, spec):
    """A random feasible point of each tuned role's search space, on this device's arch."""
    from kernelgen import backends
    from kernelgen.device import current_arch
    from kernelgen.roles import get_role, tuned_roles

    r = random.Random(case["config_seed"] * 7919 + 1)
    arch = (current_arch() if case["device"] == "cuda" else None) or "cpu"
    configs = {}
    for role in tuned_roles(spec):
        backend = backends.runner(spec.backend, role, case["device"])
        space = backend.config_space(get_role(role).kernel_spec(spec, backend.name), role, arch)
        if space and space[0] is not None:
            configs[role] = r.choice(space)
    return configs


def compare_forward(o, lse, ref_o, ref_lse, q, torch):
    from checks import TOLERANCE

    rel_tol, abs_tol = TOLERANCE[q.dtype]
    if o.shape != q.shape or o.dtype != q.dtype or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise Failure(f"o {tuple(o.shape)} {o.dtype} / lse {tuple(lse.shape)} {lse.dtype}: wrong shape or dtype")
    if torch.isnan(o).any() or torch.isnan(lse).any():
        raise Failure(f"NaN in o ({int(torch.isnan(o).sum())}) or lse ({int(torch.isnan(lse).sum())}): "
                      "unwritten or poisoned elements")
    no_key = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse), no_key):
        where = (torch.isinf(lse) != no_key).nonzero()[:4].tolist()
        raise Failure(f"lse = -inf at other rows than the reference's, first at {where}")
    if (lse[no_key] > 0).any() or (o[no_key] != 0).any():
        raise Failure("a row that sees no key has lse = +inf or o != 0")
    err = o.double() - ref_o
    rel = (err.norm() / ref_o.norm().clamp(min=1e-30)).item()
    max_abs = err.abs().max().item() if err.numel() else 0.0
    lse_err = (lse.double() - ref_lse)[~no_key].abs().max().item() if (~no_key).any() else 0.0
    if not (rel < rel_tol and max_abs < abs_tol and lse_err < 10 * abs_tol):
        where = (err.abs() >= abs_tol).nonzero()[:4].tolist()
        raise Failure(f"o: rel {rel:.2e} (tol {rel_tol}), max-abs {max_abs:.2e} (tol {abs_tol}), lse max-abs "
                      f"{lse_err:.2e}; first bad elements {where}")
    return dict(rel=rel, max_abs=max_abs, lse_err=lse_err)


def cancelled_size(name, q, k, v, do, o, scale, torch) -> float:
    """An upper bound on the size of the terms a gradient element sums, before they cancel: dS_ij = P_ij *
    (do_i . v_j - do_i . o_i) is bounded by |do_i| (|v_j| + |o_i|), dk_j sums dS_ij q_i over the group's
    queries, dq_i sums dS_ij k_j over the keys, dv_j sums P_ij do_i. A reference gradient of zero (one visible
    key: dS = 0 exactly) is met up to the rounding of those terms, not of 1."""
    rows = {x: t.double().norm(dim=-1).max().item() for x, t in dict(q=q, k=k, v=v, do=do, o=o).items()}
    group = q.shape[1] // k.shape[1]
    ds = (scale or q.shape[-1] ** -0.5) * rows["do"] * (rows["v"] + rows["o"])
    return {"dq": ds * rows["k"] * k.shape[2], "dk": ds * rows["q"] * q.shape[2] * group,
            "dv": rows["do"] * q.shape[2] * group}[name]


def compare_grads(grads, want, needs, dtype, torch, inputs):
    """`inputs`: (q, k, v, do, o, scale), for the size of the terms a zero reference gradient cancels."""
    from checks import GRAD_TOLERANCE

    rel_tol, abs_tol = GRAD_TOLERANCE[dtype]
    errors = {}
    for name, got, ref, need in zip(("dq", "dk", "dv"), grads, want, needs):
        if not need:
            if got is not None:
                raise Failure(f"{name}: a gradient for an input that does not require grad")
            continue
        if got is None or got.dtype != dtype or got.shape != ref.shape:
            raise Failure(f"{name}: missing, or of the wrong dtype or shape")
        if torch.isnan(got).any():
            raise Failure(f"{name}: NaN ({int(torch.isnan(got).sum())} elements)")
        err = got.double() - ref
        rel = (err.norm() / ref.norm().clamp(min=1e-30)).item()
        max_abs = (err.abs().max() / ref.abs().max().clamp(min=1.0)).item()
        if ref.norm().item() < 1e-12:  # a zero reference gradient (one visible key): met up to rounding
            max_abs = err.abs().max().item() / max(1.0, cancelled_size(name, *inputs, torch))
            rel = 0.0 if max_abs < abs_tol else rel
        errors[name] = (rel, max_abs)
        if not (rel < rel_tol and max_abs < abs_tol):
            raise Failure(f"{name}: rel {rel:.2e} (tol {rel_tol}), max-abs {max_abs:.2e} (tol {abs_tol})")
    return errors


def run_ragged(case, attn, spec, q, k, v, given, torch, reference) -> None:
    """A call (a decode step, or a prefill chunk) with cache_seqlens over the case's rows and a copy of its first:
    row 0 of its nk keys, the others of random lengths up to the capacity (nk + extra); each row's lists are those
    of the call over its keys alone, o and lse the reference's."""
    q, k, v = (torch.cat([x, x[:1]]) for x in (q, k, v))
    given = None if given is None else torch.cat([given, given[:1]])
    nk, cap = case["nk"], case["nk"] + case["ragged"]["extra"]
    gen = torch.Generator().manual_seed(case["ragged"]["seed"])
    lengths = [nk] + torch.randint(0, cap + 1, (case["b"],), generator=gen).tolist()
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    k_cache, v_cache = (torch.cat([x, torch.randn(*x.shape[:2], cap - nk, x.shape[3], generator=gen).to(x)], 2)
                        for x in (k, v))
    for cache in (k_cache, v_cache):  # past each row's keys: NaN, which a read would carry into o
        for b, n in enumerate(lengths):
            cache[b, :, n:] = float("nan")
    scales, ref_cache = {}, (k_cache, v_cache)
    if case.get("fp8_cache"):  # quantised with a scale per (row, KV head); the reference runs over it dequantised
        fp8 = getattr(torch, case["fp8_cache"])
        scales = {name: (x.nan_to_num().abs().amax(dim=(2, 3)).float().clamp(min=1e-3) / torch.finfo(fp8).max)
                  for name, x in (("k_scale", k_cache), ("v_scale", v_cache))}
        k_cache, v_cache = ((x.float() / scales[name][:, :, None, None]).to(fp8)
                            for name, x in (("k_scale", k_cache), ("v_scale", v_cache)))
        ref_cache = tuple((x.double() * scales[name][:, :, None, None].double()).to(q.dtype)
                          for name, x in (("k_scale", k_cache), ("v_scale", v_cache)))
    key_reps = None
    if given is None:
        lists = attn.select(q, k_cache, cache_seqlens=lens)
        for b, n in enumerate(lengths):
            own = attn.select(q[b:b + 1], k_cache[b:b + 1, :, :n]) if n else torch.full_like(lists[b:b + 1], -1)
            if not torch.equal(lists[b:b + 1], own):
                raise Failure(f"cache_seqlens: row {b}'s lists ({n} keys) differ from its own call's")
        if case.get("kept_reps"):
            key_reps = attn.key_reps(k_cache, cache_seqlens=(lens * 2) // 3)
            attn.key_reps(k_cache, cache_seqlens=lens, previous=key_reps)
            if not torch.equal(attn.select(q, k_cache, cache_seqlens=lens, key_reps=key_reps), lists):
                raise Failure("cache_seqlens: the lists from grown kept reps differ from the call's own")
    else:
        lists = given
    o, lse = attn(q, k_cache, v_cache, block_idx=given, scale=case["scale"], cache_seqlens=lens, key_reps=key_reps,
                  return_lse=True, **scales)
    ref_spec = spec.replace(selector="given", backend="triton")
    ref_o, ref_lse, _ = reference.sparse_attention(q, *ref_cache, ref_spec, block_idx=lists, scale=case["scale"],
                                                   cache_seqlens=lens)
    compare_forward(o, lse, ref_o, ref_lse, q, torch)
    if case.get("paged"):
        run_paged(case, attn, q, k_cache, v_cache, given, lens, torch, reference, lists, (ref_o, ref_lse), scales)


def run_paged(case, attn, q, k_cache, v_cache, given, lens, torch, reference, lists, ref, scales) -> None:
    """The ragged call over its cache scattered in shuffled pages (spare pages NaN, the capacity padded to whole
    pages with NaN): a decode call is bit for bit the contiguous call over the padded cache; a prefill chunk (its
    own kernel) selects the contiguous call's lists, bit for bit, and matches the reference (`ref`, over
    `lists`); `scales`: an fp8 cache's k_scale and v_scale, or none."""
    page = case.get("page_keys") or attn.spec.kv_block * case["paged"]
    cap = -(-k_cache.shape[2] // page) * page
    gen = torch.Generator().manual_seed(case["ragged"]["seed"] + 1)
    padded = [torch.cat([x, torch.full((*x.shape[:2], cap - x.shape[2], x.shape[3]), float("nan")).to(x)], 2)
              for x in (k_cache, v_cache)]
    order = torch.randperm(q.shape[0] * (cap // page) + 2, generator=gen)
    table = order[:q.shape[0] * (cap // page)].view(q.shape[0], -1).to(device=q.device, dtype=torch.int32)
    pools = [reference.scatter_pages(x, page, order, spare=2) for x in padded]
    reps = paged_reps = None
    if case.get("kept_reps") and given is None:
        reps = attn.key_reps(padded[0], cache_seqlens=lens)
        paged_reps = attn.key_reps(pools[0], block_table=table, cache_seqlens=(lens * 2) // 3)
    o, lse = attn(q, *padded, block_idx=given, scale=case["scale"], cache_seqlens=lens, key_reps=reps,
                  return_lse=True, **scales)
    o_paged, lse_paged = attn(q, *pools, block_idx=given, scale=case["scale"], cache_seqlens=lens,
                              key_reps=paged_reps, block_table=table, return_lse=True, **scales)
    if q.shape[2] > 16:  # a prefill chunk
        if given is None and not torch.equal(attn.select(q, pools[0], cache_seqlens=lens, block_table=table), lists):
            raise Failure(f"block_table: the lists over pages of {page} keys differ from the contiguous cache's")
        compare_forward(o_paged, lse_paged, *ref, q, torch)
    elif not (torch.equal(o_paged, o) and torch.equal(lse_paged, lse)):
        raise Failure(f"block_table: the call over pages of {page} keys differs from the contiguous cache's")
    if paged_reps is not None and not torch.equal(paged_reps.reps, reps.reps):
        raise Failure("block_table: the kept reps grown from pages differ from the contiguous cache's")


def run_case(case: dict) -> dict:
    """The case's outcome: status pass / reject / wrong / error, the stage it reached, and the errors."""
    import torch

    import kernelgen
    from kernelgen import Spec, reference
    from kernelgen.errors import KernelgenError

    from checks import assert_valid_selection

    result, stage = dict(seed=case["seed"]), "spec"
    try:
        spec = Spec(**case["spec"])
        if case.get("kind") == "distributed":
            stage = "distributed"
            result.update(run_distributed_case(case, torch, reference, spec), status="pass", stage=stage)
            return result
        stage = "get_kernel"
        configs = pinned_configs(case, spec) if case["pin_configs"] else None
        result["configs"] = {role: repr(c) for role, c in (configs or {}).items()}
        attn = kernelgen.get_kernel(spec, configs=configs)
        stage = "inputs"
        q, k, v, do, index = make_inputs(case, spec, torch)
        nq, nk, n_blocks = case["nq"], case["nk"], spec.n_kv_blocks(case["nk"])
        block_idx = ref_lists = None
        if case["lists"] is not None:
            ref_lists = block_idx = make_lists(case, spec, torch)
            if case["lists"]["kind"] == "prepared":
                stage = "prepare"
                block_idx = attn.prepare(ref_lists, nq, nk)
                if not torch.equal(block_idx.block_idx, reference.normalize_block_idx(ref_lists, n_blocks)):
                    raise Failure("prepare: the lists are not in canonical form")
        else:
            stage = "select"
            ref_lists = attn.select(q, k, index=index)
            if tuple(ref_lists.shape) != (case["b"], case["hkv"], spec.n_q_tiles(nq), spec.top_k):
                raise Failure(f"select: lists of shape {tuple(ref_lists.shape)}")
            try:
                tol = SELECTION_TOLERANCE[case["dtype"]]
                assert_valid_selection(ref_lists, q, k, spec, tol=tol, index=index)
            except AssertionError as e:
                raise Failure(f"select: {e}") from None
            if not torch.equal(ref_lists, attn.select(q, k, index=index)):
                raise Failure("select: two runs differ")
        key_reps = None
        if case.get("kept_reps"):
            stage = "key_reps"
            key_reps = attn.key_reps(k, previous=attn.key_reps(k[:, :, :max(1, (2 * nk) // 3)]))
            if not torch.equal(attn.select(q, k, key_reps=key_reps), ref_lists):
                raise Failure("key_reps: the lists from kept reps differ from the call's own")
        stage = "forward"
        call = dict(block_idx=block_idx, index=index if block_idx is None else None, scale=case["scale"],
                    key_reps=key_reps)
        o, lse = attn(q, k, v, return_lse=True, **call)
        ref_spec = spec.replace(selector="given", backend="triton")
        ref_o, ref_lse, _ = reference.sparse_attention(q, k, v, ref_spec, block_idx=ref_lists, scale=case["scale"])
        result["forward"] = compare_forward(o, lse, ref_o, ref_lse, q, torch)
        if case.get("ragged"):
            stage = "cache_seqlens"
            run_ragged(case, attn, spec, q, k, v, ref_lists if case["lists"] is not None else None, torch, reference)
        if case["backward"]:
            stage = "backward"
            needs = case["needs_grad"] if any(case["needs_grad"]) else [True, False, False]
            runs = []
            for _ in range(2):
                leaves = [x.detach().clone().requires_grad_(need) for x, need in zip((q, k, v), needs)]
                o_grad = attn(*leaves, **call)
                if not torch.equal(o_grad, o):
                    raise Failure("the forward with grad differs from the one without")
                o_grad.backward(do)
                runs.append([x.grad for x in leaves])
            # delta = rowsum(do * o) of the stored o, as the kernels take it (the reference's docstring)
            want = reference.sparse_attention_grads(q, k, v, do, ref_spec, ref_lists, case["scale"], stored_o=o)
            result["backward"] = compare_grads(runs[0], want, needs, q.dtype, torch, (q, k, v, do, o, case["scale"]))
            for name, first, second in zip(("dq", "dk", "dv"), *runs):
                if first is not None and not torch.equal(first, second):
                    raise Failure(f"{name}: two backward runs differ (not deterministic)")
        result["status"] = "pass"
    except Failure as e:
        result.update(status="wrong", message=str(e))
    except (ValueError, TypeError) as e:
        clean = isinstance(e, KernelgenError)
        result.update(status="reject" if clean else "error", message=f"{type(e).__name__}: {e}")
        if not clean:
            result["traceback"] = traceback.format_exc(limit=-6)
    except Exception as e:  # noqa: BLE001  (every other exception is a finding)
        result.update(status="error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=-6))
    result["stage"] = stage
    return result


# --------------------------------------------------------------------------------------------------------
def worker(seeds: list[int], device: str, out: Path, distributed: bool = False) -> None:
    """Runs `seeds` in order, a line each in `out` ("start" first: a process that dies leaves its seed). A
    CUDA error spoils the process's context, so the worker stops after one."""
    with out.open("a") as f:
        for seed in seeds:
            case = (draw_distributed_case if distributed else draw_case)(seed, device)
            f.write(json.dumps(dict(seed=seed, status="start")) + "\n")
            f.flush()
            started = time.time()
            result = run_case(case)
            result["seconds"] = round(time.time() - started, 2)
            result["case"] = case
            f.write(json.dumps(result, default=str) + "\n")
            f.flush()
            if result["status"] == "error" and "CUDA" in result.get("message", ""):
                sys.exit(3)


def read_results(out: Path) -> dict[int, dict]:
    """Each seed's outcome; a seed that started and never finished died with its process."""
    outcomes = {}
    for path in out.glob("worker-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed process
                continue
            if row["status"] == "start":
                outcomes.setdefault(row["seed"], dict(seed=row["seed"], status="died", message="the process died"))
            else:
                outcomes[row["seed"]] = row
    return outcomes


def drive(args) -> int:
    """Workers over seeds start, start + 1, ... until the time is up; a dead worker is replaced."""
    args.out.mkdir(parents=True, exist_ok=True)
    deadline, next_seed, procs = time.time() + 60 * args.minutes, args.start, {}
    batch = 8
    while procs or time.time() < deadline:
        for slot in range(args.workers):
            if slot not in procs and time.time() < deadline:
                seeds = list(range(next_seed, next_seed + batch))
                next_seed += batch
                cmd = [sys.executable, __file__, "--device", args.device, "--seeds", ",".join(map(str, seeds)),
                       "--out", str(args.out / f"worker-{slot}.jsonl"), *(["--distributed"] if args.distributed else [])]
                procs[slot] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        for slot, proc in list(procs.items()):
            if proc.poll() is not None:
                del procs[slot]
            elif time.time() > deadline + args.grace:
                proc.kill()
    outcomes = read_results(args.out)
    counts = collections.Counter(row["status"] for row in outcomes.values())
    print(f"{len(outcomes)} cases on {args.device}: " + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    failures = [row for row in outcomes.values() if row["status"] not in ("pass", "reject")]
    for row in sorted(failures, key=lambda row: row["seed"]):
        print(f"  seed {row['seed']}: {row['status']} at {row.get('stage', '?')}: {row.get('message', '')[:300]}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--grace", type=float, default=300.0, help="seconds a running case may overrun --minutes")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--case", type=int, help="run one seed and print its case and outcome")
    parser.add_argument("--distributed", action="store_true", help="context-parallel cases on simulated ranks")
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("fuzz-results"))
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.case is not None:
        case = (draw_distributed_case if args.distributed else draw_case)(args.case, args.device)
        print(json.dumps(case))
        print(json.dumps(run_case(case), indent=1, default=str))
        return 0
    if args.seeds:
        worker([int(s) for s in args.seeds.split(",")], args.device, args.out, args.distributed)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())

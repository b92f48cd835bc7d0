"""Prototype: the Q-centric forward in Gluon (Triton's explicit-layout dialect), with FlashAttention-3's
intra-warpgroup order written out: the QK product of block i+1 is issued (async wgmma) before the
softmax of block i, and PV of block i runs while the next softmax does. Triton 3.6 does not emit
that order from `tl.dot` (it waits for each QK right after issuing it).

Same contract as the Triton template's attn_fwd: normalised lists (valid ids ascending, then -1),
packed GQA rows, causal or not, lse. K and V must be contiguous [B, Hkv, Nk, D] (TMA over their
[B*Hkv*Nk, D] view; rows a partial last block reads past Nk belong to the next head or are
zero-filled, and are masked out).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _step_ids(lst, t, n, KPS: gl.constexpr):
    """Block ids of step t: listed blocks KPS*t .. KPS*t+KPS-1 (a missing second one repeats the first;
    its keys are masked). Zeros past the list."""
    id0 = gl.load(lst + KPS * t, mask=KPS * t < n, other=0)
    id1 = id0
    if KPS == 2:
        id1 = gl.load(lst + KPS * t + 1, mask=KPS * t + 1 < n, other=0)
        id1 = gl.where(KPS * t + 1 < n, id1, id0)
    return id0, id1


@gluon.jit
def _issue(desc, bar, smem, t, id0, id1, row0, n_steps, KV_BLOCK: gl.constexpr, KPS: gl.constexpr,
           STAGES: gl.constexpr):
    """Start the bulk copies of step t's blocks into ring slot t % STAGES (no-op for t >= n_steps)."""
    pred = t < n_steps
    slot = t % STAGES
    mbarrier.expect(bar.index(slot), KPS * desc.block_type.nbytes, pred=pred)
    dst = smem.index(slot)
    tma.async_copy_global_to_shared(desc, [row0 + id0 * KV_BLOCK, 0], bar.index(slot),
                                    dst.slice(0, KV_BLOCK, dim=0), pred=pred)
    if KPS == 2:
        tma.async_copy_global_to_shared(desc, [row0 + id1 * KV_BLOCK, 0], bar.index(slot),
                                        dst.slice(KV_BLOCK, KV_BLOCK, dim=0), pred=pred)


@gluon.jit
def _softmax(s, m_i, l_i, t, n, n_unmasked, lst, qi, n_q, n_k, qk_scale,
             KV_BLOCK: gl.constexpr, KPS: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of step t's unscaled scores s: (p, alpha, m, l)."""
    if KPS * t + KPS - 1 >= n_unmasked:  # partial last block, (causal) the diagonal, a missing block
        id0, id1 = _step_ids(lst, t, n, KPS)
        col = gl.arange(0, KPS * KV_BLOCK, layout=gl.SliceLayout(0, s_layout))
        second = col // KV_BLOCK
        keys = gl.where(second == 0, id0, id1) * KV_BLOCK + col % KV_BLOCK
        visible = gl.expand_dims((keys < n_k) & (KPS * t + second < n), 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(qi, 1) + (n_k - n_q))
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_shift, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_shift = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_shift)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def attn_fwd(Q, O, LSE, BLOCK_IDX, k_desc, v_desc,
             stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
             stride_ib, stride_ih, stride_it,
             n_q, n_k, n_q_tiles, n_kv_blocks, heads_kv, qk_scale,
             HEAD_DIM: gl.constexpr, KV_BLOCK: gl.constexpr, Q_TILE: gl.constexpr, GROUP: gl.constexpr,
             TOP_K: gl.constexpr, TOP_K_PAD: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr, KPS: gl.constexpr, num_warps: gl.constexpr):
    STEP_N: gl.constexpr = KPS * KV_BLOCK  # keys per step: KPS listed blocks side by side
    SPLITS: gl.constexpr = GROUP * Q_TILE // BLOCK_M
    ROW_SPAN: gl.constexpr = BLOCK_M if BLOCK_M < Q_TILE else Q_TILE
    dtype: gl.constexpr = k_desc.dtype
    # one wgmma row block of 16 per warp: BLOCK_M = 16 * num_warps
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, STEP_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    list_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // heads_kv
    hkv = pid_bh % heads_kv
    if CAUSAL:
        tile = n_q_tiles - 1 - pid_m // SPLITS
    else:
        tile = pid_m // SPLITS
    split = pid_m % SPLITS

    # Q rows (packed: head-major within the program), into registers as the wgmma A operand
    rows = split * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    head = hkv * GROUP + rows // Q_TILE
    qi_io = tile * Q_TILE + rows % Q_TILE
    row_ok = qi_io < n_q
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    q_ptrs = (Q + b.to(gl.int64) * stride_qb + gl.expand_dims(head.to(gl.int64) * stride_qh + qi_io.to(gl.int64) * stride_qn, 1)
              + gl.expand_dims(offs_d, 0))
    q = gl.load(q_ptrs, mask=gl.expand_dims(row_ok, 1), other=0.0)
    q = gl.convert_layout(q, q_op)

    # the list: valid prefix, and the part of it that needs no elementwise mask
    lst = BLOCK_IDX + b.to(gl.int64) * stride_ib + hkv.to(gl.int64) * stride_ih + tile.to(gl.int64) * stride_it
    slots = gl.arange(0, TOP_K_PAD, layout=list_layout)
    ids = gl.load(lst + slots, mask=slots < TOP_K, other=-1)
    valid = (ids >= 0) & (ids < n_kv_blocks)
    block_end = (ids + 1) * KV_BLOCK
    unmasked = valid & (block_end <= n_k)
    if CAUSAL:
        q_lo = tile * Q_TILE + (split * BLOCK_M) % Q_TILE
        q_hi = gl.minimum(q_lo + ROW_SPAN, n_q) - 1
        unmasked = unmasked & (block_end - 1 <= q_lo + (n_k - n_q))
        valid = valid & (ids * KV_BLOCK <= q_hi + (n_k - n_q))
    n = gl.sum(valid.to(gl.int32), 0)
    n_unmasked = gl.minimum(gl.sum(unmasked.to(gl.int32), 0), n)

    # rings of STAGES steps of K and V blocks, one barrier per slot
    n_steps = (n + KPS - 1) // KPS
    row0 = (b * heads_kv + hkv) * n_k
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, STEP_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, STEP_N, HEAD_DIM], v_desc.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(st), count=1)
        mbarrier.init(v_bar.index(st), count=1)
    for st in gl.static_range(STAGES):
        id0, id1 = _step_ids(lst, st, n, KPS)
        _issue(k_desc, k_bar, k_smem, st, id0, id1, row0, n_steps, KV_BLOCK, KPS, STAGES)
        _issue(v_desc, v_bar, v_smem, st, id0, id1, row0, n_steps, KV_BLOCK, KPS, STAGES)

    qi = tile * Q_TILE + (split * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))) % Q_TILE
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, STEP_N], gl.float32, layout=s_layout)
    if n_steps > 0:
        # FlashAttention-3's order: step t issues QK(t) and PV(t - 1) together, then runs the softmax of
        # t while PV(t - 1) computes; every wgmma is retired by the end of a step
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, n, n_unmasked, lst, qi, n_q, n_k, qk_scale, KV_BLOCK, KPS,
                                      CAUSAL, s_layout)
        p = gl.convert_layout(p.to(dtype), p_op)
        refill0, refill1 = _step_ids(lst, STAGES, n, KPS)  # read a step ahead: load latency off the path
        for t in range(1, n_steps):
            # slot (t - 1) % STAGES of K is free (QK(t - 1) retired): refill it with step t - 1 + STAGES
            _issue(k_desc, k_bar, k_smem, t - 1 + STAGES, refill0, refill1, row0, n_steps, KV_BLOCK, KPS, STAGES)
            next0, next1 = _step_ids(lst, t + STAGES, n, KPS)
            cur = t % STAGES
            mbarrier.wait(k_bar.index(cur), (t // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(cur).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            prev = (t - 1) % STAGES
            mbarrier.wait(v_bar.index(prev), ((t - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # QK(t) retired; PV(t - 1) runs on
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n, n_unmasked, lst, qi, n_q, n_k, qk_scale, KV_BLOCK, KPS,
                                          CAUSAL, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            # slot (t - 1) % STAGES of V is free too
            _issue(v_desc, v_bar, v_smem, t - 1 + STAGES, refill0, refill1, row0, n_steps, KV_BLOCK, KPS, STAGES)
            refill0 = next0
            refill1 = next1
            p = gl.convert_layout(p.to(dtype), p_op)
        last = (n_steps - 1) % STAGES
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_bar.index(last), ((n_steps - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(st))
        mbarrier.invalidate(v_bar.index(st))

    empty = l_i == 0.0  # no visible key: o = 0, lse = -inf
    o = acc / gl.expand_dims(gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout)), 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o = gl.convert_layout(o.to(dtype), io_layout)
    o_ptrs = (O + b.to(gl.int64) * stride_ob + gl.expand_dims(head.to(gl.int64) * stride_oh + qi_io.to(gl.int64) * stride_on, 1)
              + gl.expand_dims(offs_d, 0))
    gl.store(o_ptrs, o, mask=gl.expand_dims(row_ok, 1))
    lse = gl.convert_layout(lse, gl.SliceLayout(1, io_layout))
    gl.store(LSE + b.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + qi_io, lse, mask=row_ok)


def attention(q, k, v, block_idx, spec, block_m=None, stages=2, scale=None, poison=False, kps=1):
    """o, lse for normalised lists block_idx (int32 [B, Hkv, n_q_tiles, top_k])."""
    b, hq, n_q, d = q.shape
    _, hkv, n_k, _ = k.shape
    block_m = block_m or min(128, spec.gqa_group * spec.q_tile)
    k2 = k.contiguous().view(b * hkv * n_k, d)
    v2 = v.contiguous().view(b * hkv * n_k, d)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[k.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([spec.kv_block, d], gl_dtype)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [spec.kv_block, d], layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [spec.kv_block, d], layout)
    o = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    lse = torch.full((b, hq, n_q), float("nan"), device=q.device) if poison else torch.empty(b, hq, n_q, device=q.device)
    n_q_tiles, n_kv_blocks = block_idx.shape[2], -(-n_k // spec.kv_block)
    splits = spec.gqa_group * spec.q_tile // block_m
    scale = scale if scale is not None else d ** -0.5
    top_k_pad = 1 << max(0, (spec.top_k - 1).bit_length())
    attn_fwd[(n_q_tiles * splits, b * hkv)](
        q, o, lse, block_idx, k_desc, v_desc,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        n_q, n_k, n_q_tiles, n_kv_blocks, hkv, scale * 1.4426950408889634,
        HEAD_DIM=d, KV_BLOCK=spec.kv_block, Q_TILE=spec.q_tile, GROUP=spec.gqa_group, TOP_K=spec.top_k,
        TOP_K_PAD=max(top_k_pad, 32), BLOCK_M=block_m, CAUSAL=spec.causal, STAGES=stages, KPS=kps, num_warps=block_m // 16)
    return o, lse

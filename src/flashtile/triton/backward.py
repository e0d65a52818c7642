"""The backward kernels: recompute the probabilities from ``lse``, no atomics.

With ``D = rowsum(dO * O)`` (:func:`attn_bwd_delta`) and ``P = exp(S - lse)``
rebuilt tile by tile::

    dV_j += P^T dO        dP = dO V_j^T        dS = P * (dP - D)
    dK_j += scale * dS^T Q                     dQ += scale * dS K_j

(with softcap, ``dS`` is multiplied by ``1 - tanh^2``). Two kernels share the
work so that every output element has exactly one writer, as in the CPU
backward: :func:`attn_bwd_dkdv` owns a key block of one kv head and walks the
query blocks that see it, for every query head of its GQA group (the group's
sum happens in registers, in a fixed order); :func:`attn_bwd_dq` owns a query
block and walks the key blocks it sees, like the forward. Gradients are
bit-identical from run to run. Both walk their loops in the forward's three
phases (masked edge, unmasked interior, masked edge).

Rows that saw no key (``lse = -inf``) read ``lse = +inf``, so every
``exp2(S - lse)`` of theirs is 0 and they contribute nothing.
"""

import triton
import triton.language as tl

from .forward import sequence
from .tiles import (
    LOG2E,
    device_fn,
    dot,
    load_tile,
    mma_in,
    operand_like,
    phase_block,
    phase_count,
    phase_ends,
    query_block_keys,
    row_bounds,
    scores,
    store_tile,
)


@triton.jit
def attn_bwd_delta(
    Out, DOut, Delta, CuQ, so_b, so_h, so_t, sd_b, sd_h, sd_t, st_b, st_h, heads, seqlen_q,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """``Delta (B, Hq, Tq)`` float32 ``= rowsum(dO * O)`` (``dO`` strides ``sd_*``)."""
    seq = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    start_m = tl.program_id(0) * BLOCK_M
    b, q0, _, tq, _, _ = sequence(seq, CuQ, CuQ, CuQ, seqlen_q, seqlen_q, False, VARLEN)
    if start_m >= tq:
        return
    b = b.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = (q0 + offs_m[:, None]).to(tl.int64)
    m_ok = offs_m < tq
    cols = offs_dv < HEAD_DV
    o = load_tile(
        Out + b * so_b + h * so_h + rows * so_t + offs_dv[None, :], m_ok, cols, True, True
    )
    do = load_tile(
        DOut + b * sd_b + h * sd_h + rows * sd_t + offs_dv[None, :], m_ok, cols, True, True
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * st_b + h * st_h + q0 + offs_m, delta, mask=m_ok)


@device_fn
def query_range(j0, tq, tk, kv_len, left, right, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):  # fmt: skip
    """Query rows ``[i_lo, i_hi)`` that see some key of ``[j0, j0 + BLOCK_N)``, and
    ``[a, b)`` that see all of them (the inverse of :func:`~.tiles.row_bounds`)."""
    j1 = j0 + BLOCK_N
    shift = tk - tq  # a row's position is i + shift
    i_lo = j0 * 0
    a = j0 * 0
    i_hi = j0 * 0 + tq
    b = j0 * 0 + tq
    if HAS_RIGHT:  # hi = pos + right + 1 > j0, and >= j1 for every key
        i_lo = tl.maximum(i_lo, j0 - right - shift)
        a = tl.maximum(a, j1 - 1 - right - shift)
    if HAS_LEFT:  # lo = pos - left < j1, and <= j0 for every key
        i_hi = tl.minimum(i_hi, j1 + left - shift)
        b = tl.minimum(b, j0 + left - shift + 1)
    i_hi = tl.where(kv_len > j0, tl.maximum(i_lo, i_hi), i_lo)
    b = tl.where(kv_len >= j1, b, a)  # padding inside the block: no interior
    return i_lo, i_hi, tl.maximum(a, i_lo), tl.minimum(b, i_hi)


@device_fn
def _row_state(Lse, Delta, offs_m, m_ok, row_base):
    """``(lse in log2 units, +inf for rows that saw no key, delta)`` of query rows."""
    lse = tl.load(Lse + row_base + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse2, tl.load(Delta + row_base + offs_m, mask=m_ok, other=0.0)


@device_fn
def _dkdv_range(
    dk, dv, k, v, q_base, do_base, stride_q, stride_do, Lse, Delta, row_base, lo, s1, s2, hi,
    offs_n, tq, shift, kv_len, left, right, slope2, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Accumulate the key block's ``dk`` (unscaled) and ``dv`` over the query blocks of
    one phase (see :func:`~.tiles.phase_count`)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    blocks, head = phase_count(lo, s1, s2, hi, BLOCK_M, MASKED)
    for i in range(blocks):
        start_m, end = phase_block(i, head, lo, s1, s2, hi, BLOCK_M, MASKED)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = offs_m[:, None].to(tl.int64)
        q = load_tile(q_base + rows * stride_q + offs_d[None, :], m_ok, offs_d < HEAD_D,
                      MASKED, BLOCK_D != HEAD_D)  # fmt: skip
        do = load_tile(do_base + rows * stride_do + offs_dv[None, :], m_ok, offs_dv < HEAD_DV,
                       MASKED, BLOCK_DV != HEAD_DV)  # fmt: skip
        q = mma_in(q, EMULATE_BF16)
        do = mma_in(do, EMULATE_BF16)
        lse2, delta = _row_state(Lse, Delta, offs_m, m_ok, row_base)
        pos = offs_m + shift
        lo_r, hi_r = row_bounds(pos, kv_len, left, right, HAS_LEFT, HAS_RIGHT)
        hi_r = tl.where(m_ok, hi_r, 0)
        s, t = scores(q, k, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
                      SOFTCAP, ALIBI, MASKED, IEEE)  # fmt: skip
        p = tl.exp2(s - lse2[:, None])
        dv = dot(tl.trans(operand_like(p, do, EMULATE_BF16)), do, dv, IEEE)
        dp = dot(do, tl.trans(v), tl.zeros([BLOCK_M, k.shape[0]], tl.float32), IEEE)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dk = dot(tl.trans(operand_like(ds, q, EMULATE_BF16)), q, dk, IEEE)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DOut, Lse, Delta, DK, DV, Slopes, KvLens, CuQ, CuK,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, sl_b, sl_h,
    sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, ss_b,
    heads_kv, group, seqlen_q, seqlen_k, left, right, scale, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """``DK``, ``DV`` (shaped like ``K``, ``V``) for key block ``program_id(0)`` of one kv head."""
    seq = tl.program_id(1) // heads_kv
    hk = tl.program_id(1) % heads_kv
    start_n = tl.program_id(0) * BLOCK_N
    b, q0, k0, tq, tk, kv_len = sequence(seq, CuQ, CuK, KvLens, seqlen_q, seqlen_k, KV_LENS, VARLEN)
    if start_n >= tk:
        return
    b = b.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < tk
    keys = (k0 + offs_n[:, None]).to(tl.int64)
    k_ptrs = K + b * sk_b + hk * sk_h + keys * sk_t + offs_d[None, :]
    v_ptrs = V + b * sv_b + hk * sv_h + keys * sv_t + offs_dv[None, :]
    k = mma_in(load_tile(k_ptrs, n_ok, offs_d < HEAD_D, True, BLOCK_D != HEAD_D), EMULATE_BF16)
    v = mma_in(load_tile(v_ptrs, n_ok, offs_dv < HEAD_DV, True, BLOCK_DV != HEAD_DV), EMULATE_BF16)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    i_lo, i_hi, a, z = query_range(
        start_n, tq, tk, kv_len, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    s1, s2 = phase_ends(i_lo, i_hi, a, z, BLOCK_M)
    for g in range(group):  # the GQA group's sum, in a fixed order
        h = (hk * group + g).to(tl.int64)
        slope2 = tl.zeros([BLOCK_M], tl.float32)
        if ALIBI:
            slope2 += tl.load(Slopes + b * ss_b + h) * LOG2E
        q_base = Q + b * sq_b + h * sq_h + q0.to(tl.int64) * sq_t
        do_base = DOut + b * sd_b + h * sd_h + q0.to(tl.int64) * sd_t
        row_base = b * sl_b + h * sl_h + q0
        for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
            dk, dv = _dkdv_range(
                dk, dv, k, v, q_base, do_base, sq_t, sd_t, Lse, Delta, row_base, i_lo, s1, s2,
                i_hi,
                offs_n, tq, tk - tq, kv_len, left, right, slope2, qk_scale, cap_in, cap_out,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT,
                SOFTCAP, ALIBI, phase == 0, IEEE, EMULATE_BF16,
            )  # fmt: skip
    out_mask = n_ok[:, None]
    dk_ptrs = DK + b * sdk_b + hk * sdk_h + keys * sdk_t + offs_d[None, :]
    dv_ptrs = DV + b * sdv_b + hk * sdv_h + keys * sdv_t + offs_dv[None, :]
    store_tile(dk_ptrs, dk * scale, out_mask & (offs_d[None, :] < HEAD_D), EMULATE_BF16)
    store_tile(dv_ptrs, dv, out_mask & (offs_dv[None, :] < HEAD_DV), EMULATE_BF16)


@device_fn
def _dq_range(
    dq, q, do, lse2, delta, k_base, v_base, stride_k, stride_v, lo, s1, s2, hi,
    pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
    IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Accumulate the query block's ``dq`` (unscaled) over the key blocks of one phase."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    blocks, head = phase_count(lo, s1, s2, hi, BLOCK_N, MASKED)
    for i in range(blocks):
        start_n, end = phase_block(i, head, lo, s1, s2, hi, BLOCK_N, MASKED)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        keys = offs_n[:, None].to(tl.int64)
        k = load_tile(k_base + keys * stride_k + offs_d[None, :], n_ok, offs_d < HEAD_D,
                      MASKED, BLOCK_D != HEAD_D)  # fmt: skip
        v = load_tile(v_base + keys * stride_v + offs_dv[None, :], n_ok, offs_dv < HEAD_DV,
                      MASKED, BLOCK_DV != HEAD_DV)  # fmt: skip
        k = mma_in(k, EMULATE_BF16)
        v = mma_in(v, EMULATE_BF16)
        s, t = scores(q, k, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
                      SOFTCAP, ALIBI, MASKED, IEEE)  # fmt: skip
        p = tl.exp2(s - lse2[:, None])
        dp = dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = dot(operand_like(ds, k, EMULATE_BF16), k, dq, IEEE)
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, DOut, Lse, Delta, DQ, Slopes, KvLens, CuQ, CuK,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, sl_b, sl_h,
    sdq_b, sdq_h, sdq_t, ss_b,
    heads, group, seqlen_q, seqlen_k, left, right, scale, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """``DQ`` (shaped like ``Q``) for query block ``program_id(0)`` of one head."""
    seq = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    start_m = tl.program_id(0) * BLOCK_M
    b, q0, k0, tq, tk, kv_len = sequence(seq, CuQ, CuK, KvLens, seqlen_q, seqlen_k, KV_LENS, VARLEN)
    if start_m >= tq:
        return
    b = b.to(tl.int64)
    hk = (h // group).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < tq
    rows = (q0 + offs_m[:, None]).to(tl.int64)
    q_ptrs = Q + b * sq_b + h * sq_h + rows * sq_t + offs_d[None, :]
    do_ptrs = DOut + b * sd_b + h * sd_h + rows * sd_t + offs_dv[None, :]
    q = mma_in(load_tile(q_ptrs, m_ok, offs_d < HEAD_D, True, BLOCK_D != HEAD_D), EMULATE_BF16)
    do = load_tile(do_ptrs, m_ok, offs_dv < HEAD_DV, True, BLOCK_DV != HEAD_DV)
    do = mma_in(do, EMULATE_BF16)
    lse2, delta = _row_state(Lse, Delta, offs_m, m_ok, b * sl_b + h * sl_h + q0)
    pos, lo_r, hi_r, lo, s1, s2, hi = query_block_keys(
        start_m, tq, tk, kv_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope2 += tl.load(Slopes + b * ss_b + h) * LOG2E
    k_base = K + b * sk_b + hk * sk_h + k0.to(tl.int64) * sk_t
    v_base = V + b * sv_b + hk * sv_h + k0.to(tl.int64) * sv_t
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
        dq = _dq_range(
            dq, q, do, lse2, delta, k_base, v_base, sk_t, sv_t, lo, s1, s2, hi,
            pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, ALIBI, phase == 0, IEEE,
            EMULATE_BF16,
        )  # fmt: skip
    dq_ptrs = DQ + b * sdq_b + h * sdq_h + rows * sdq_t + offs_d[None, :]
    store_tile(dq_ptrs, dq * scale, m_ok[:, None] & (offs_d[None, :] < HEAD_D), EMULATE_BF16)

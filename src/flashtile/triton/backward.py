"""The backward kernels: recompute the probabilities from ``lse``, no atomics.

With ``D = rowsum(dO * O)`` (:func:`attn_bwd_delta`) and ``P = exp(S - lse)``
rebuilt tile by tile::

    dV_j += P^T dO        dP = dO V_j^T        dS = P * (dP - D)
    dK_j += scale * dS^T Q                     dQ += scale * dS K_j

(with softcap, ``dS`` is multiplied by ``1 - tanh^2``, with a score mod by its
derivative; dropout regenerates the forward's mask, :func:`_probs_and_dscores`).
A score mod's captured tables get ``dS`` times the derivative by each
element read, added by :func:`attn_bwd_dq` with atomic adds (so those
gradients, unlike ``dq``, ``dk``, ``dv``, are not bit-reproducible: the
order of the adds varies). With a block mask (``SPARSE``) both kernels walk
its lists (``Num``/``Idx``, the dk/dv kernel the transposed ones) as the
forward does. Two kernels share the
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

from .tiles import (
    LOG2E,
    device_fn,
    dot,
    kept,
    listed,
    load_rows,
    operand_like,
    phase_ends,
    program_tile,
    query_block_keys,
    row_bounds,
    row_slopes,
    scores,
    store_rows,
    walk_block,
    walk_count,
)


@triton.jit
def attn_bwd_delta(
    Out, DOut, Delta, CuQ, so_b, so_h, so_t, sd_b, sd_h, sd_t, st_b, st_h, heads, seqlen_q,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """``Delta (B, Hq, Tq)`` float32 ``= rowsum(dO * O)`` (``dO`` strides ``sd_*``)."""
    start_m, h, b, q0, _, tq, _, _ = program_tile(
        heads, CuQ, CuQ, CuQ, seqlen_q, seqlen_q, BLOCK_M, False, VARLEN
    )
    if start_m >= tq:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = (q0 + offs_m).to(tl.int64)
    m_ok = offs_m < tq
    o = load_rows(Out + b * so_b + h * so_h + rows * so_t, m_ok, HEAD_DV, BLOCK_DV, True, False)
    do = load_rows(DOut + b * sd_b + h * sd_h + rows * sd_t, m_ok, HEAD_DV, BLOCK_DV, True, False)
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
def _probs_and_dscores(
    q, k, v, do, lse2, delta, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
    keep, drop_scale, mod, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    CAPTURE_FN: tl.constexpr,
):  # fmt: skip
    """``(P, dS, sums)`` of one tile: ``P = exp2(S - lse)`` recomputed (capped
    at ``2**15``, which float16 operands hold: a row left out of the loss
    adds exact zeros whatever its ``lse``, and a ``P`` past 1 fails the
    precision rule anyway), ``dS = P * (dP - D)`` with ``dP = dO
    V^T`` (times ``1 - tanh^2`` under softcap), both float32, and the rows'
    sums of ``P`` before dropout (for the precision rule,
    :func:`flashtile.precision.failing_rows`).
    With ``DROPOUT`` (keep mask ``Z``, scale ``c``) the output was ``(c Z * P) V``:
    ``dP`` becomes ``c Z * dP`` and the returned ``P`` (dV's operand) ``c Z * P``.
    A score mod (``SCORE_FN``: its derivative's function) multiplies ``dS``
    by ``dy/dx`` where ``P > 0`` (elsewhere ``dS = 0``: a hidden score's
    derivative may be inf); ``CAPTURE_FN`` adds the captured tables' share."""
    s, t, x = scores(
        q, k, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, mod,
        SOFTCAP, ALIBI, MASKED, IEEE, SCORE_FN, MASK_FN, True,
    )  # fmt: skip
    x = s - lse2[:, None]
    p = tl.exp2(tl.where(x > 15.0, 15.0, x))  # (NaN stays NaN)
    sums = tl.sum(p, 1)
    dp = dot(do, tl.trans(v), tl.zeros([q.shape[0], k.shape[0]], tl.float32), IEEE)
    if DROPOUT:
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    if SCORE_FN is not None:
        live = p > 0.0
        if CAPTURE_FN is not None:
            qi = (pos - mod[6])[:, None]
            CAPTURE_FN(x, ds, mod[3], mod[4], qi, offs_n[None, :], mod[0], mod[1], mod[2],
                       live & (ds != 0.0))  # fmt: skip
        ds = tl.where(live, ds * t, 0.0)
    if DROPOUT:
        p = tl.where(keep, p * drop_scale, 0.0)
    return p, ds, sums


@device_fn
def _dkdv_range(
    dk, dv, k, v, q_base, do_base, stride_q, stride_do, Lse, Delta, row_base, lo, s1, s2, hi,
    offs_n, tq, shift, kv_len, left, right, slope2, qk_scale, cap_in, cap_out, q0, keys, drop,
    walk, mod,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr, SCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr, SPARSE: tl.constexpr, MAP_M: tl.constexpr,
):  # fmt: skip
    """Accumulate the key block's ``dk`` (unscaled) and ``dv`` over the query blocks of
    one phase (see :func:`~.tiles.phase_count`, or with ``SPARSE`` the listed
    walk ``walk``); ``q0`` is the sequence's first query row and ``keys`` the
    block's key rows in the arrays (for dropout)."""
    blocks, head = walk_count(lo, s1, s2, hi, walk, BLOCK_M, MASKED, SPARSE, MAP_M)
    for i in range(blocks):
        offs_m, m_ok = walk_block(i, head, lo, s1, s2, hi, walk, tq, BLOCK_M, MASKED, SPARSE,
                                  MAP_M)  # fmt: skip
        rows = offs_m.to(tl.int64)
        q = load_rows(q_base + rows * stride_q, m_ok, HEAD_D, BLOCK_D, MASKED, EMULATE_BF16)
        do = load_rows(do_base + rows * stride_do, m_ok, HEAD_DV, BLOCK_DV, MASKED, EMULATE_BF16)
        lse2, delta = _row_state(Lse, Delta, offs_m, m_ok, row_base)
        pos = offs_m + shift
        lo_r, hi_r = row_bounds(pos, kv_len, left, right, HAS_LEFT, HAS_RIGHT)
        hi_r = tl.where(m_ok, hi_r, 0)
        keep = kept(q0 + offs_m, keys, drop) if DROPOUT else 0
        p, ds, _ = _probs_and_dscores(
            q, k, v, do, lse2, delta, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            keep, drop[4], mod, SOFTCAP, ALIBI, MASKED, DROPOUT, IEEE, SCORE_FN, MASK_FN, None,
        )  # fmt: skip
        dv = dot(tl.trans(operand_like(p, do, EMULATE_BF16)), do, dv, IEEE)
        dk = dot(tl.trans(operand_like(ds, q, EMULATE_BF16)), q, dk, IEEE)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DOut, Lse, Delta, DK, DV, Slopes, KvLens, CuQ, CuK, Floats, Ints, Num, Idx,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, sl_b, sl_h,
    sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, ss_b,
    heads_kv, group, seqlen_q, seqlen_k, left, right, scale, qk_scale, cap_in, cap_out,
    seed, drop_offset, drop_threshold, drop_scale, map_b, map_h, map_rows, map_cols,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    SPARSE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr,
):  # fmt: skip
    """``DK``, ``DV`` (shaped like ``K``, ``V``) for key block ``program_id(0)`` of one kv head."""
    start_n, hk, b, q0, k0, tq, tk, kv_len = program_tile(
        heads_kv, CuQ, CuK, KvLens, seqlen_q, seqlen_k, BLOCK_N, KV_LENS, VARLEN
    )
    if start_n >= tk:
        return
    hk = hk.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < tk
    keys = (k0 + offs_n).to(tl.int64)
    k = load_rows(K + b * sk_b + hk * sk_h + keys * sk_t, n_ok, HEAD_D, BLOCK_D, True, EMULATE_BF16)
    v = load_rows(V + b * sv_b + hk * sv_h + keys * sv_t, n_ok, HEAD_DV, BLOCK_DV, True,
                  EMULATE_BF16)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    i_lo, i_hi, a, z = query_range(
        start_n, tq, tk, kv_len, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    s1, s2 = phase_ends(i_lo, i_hi, a, z, BLOCK_M)
    for g in range(group):  # the GQA group's sum, in a fixed order
        h = (hk * group + g).to(tl.int64)
        slope2 = row_slopes(Slopes + b * ss_b + h, True, BLOCK_M, ALIBI)
        q_base = Q + b * sq_b + h * sq_h + q0.to(tl.int64) * sq_t
        do_base = DOut + b * sd_b + h * sd_h + q0.to(tl.int64) * sd_t
        row_base = b * sl_b + h * sl_h + q0
        drop = (b * 65536 + h, seed, drop_offset, drop_threshold, drop_scale)
        mod = (Floats, Ints, Floats, b.to(tl.int32), h.to(tl.int32), tq, tk - tq, scale)
        # (as the forward's: a block mask's partial query blocks, then its full ones)
        for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
            walk = (0, Idx)
            if SPARSE:
                walk = listed(Num, Idx, (map_b, map_h, map_rows, map_cols), phase, b, h,
                              start_n // MAP_N)  # fmt: skip
            dk, dv = _dkdv_range(
                dk, dv, k, v, q_base, do_base, sq_t, sd_t, Lse, Delta, row_base, i_lo, s1, s2,
                i_hi,
                offs_n, tq, tk - tq, kv_len, left, right, slope2, qk_scale, cap_in, cap_out,
                q0, keys, drop, walk, mod, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, ALIBI, phase == 0 or SPARSE, DROPOUT, IEEE, EMULATE_BF16,
                SCORE_FN, MASK_FN if phase == 0 else None, SPARSE, MAP_M,
            )  # fmt: skip
    dk_rows = DK + b * sdk_b + hk * sdk_h + keys * sdk_t
    store_rows(dk_rows, dk * scale, n_ok, HEAD_D, BLOCK_D, EMULATE_BF16)
    store_rows(
        DV + b * sdv_b + hk * sdv_h + keys * sdv_t, dv, n_ok, HEAD_DV, BLOCK_DV, EMULATE_BF16
    )


@device_fn
def _dq_range(
    dq, sums, q, do, lse2, delta, k_base, v_base, stride_k, stride_v, lo, s1, s2, hi,
    pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, rows, k0, drop, walk, mod, kv_len,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
    SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr, CAPTURE_FN: tl.constexpr,
    SPARSE: tl.constexpr, MAP_N: tl.constexpr,
):  # fmt: skip
    """Accumulate the query block's ``dq`` (unscaled) and its rows' sums of
    ``P`` over the key blocks of one phase (``rows``, ``k0``: the block's query
    rows and the sequence's first key row; ``SPARSE``: the listed walk
    ``walk``, keys before ``kv_len``)."""
    blocks, head = walk_count(lo, s1, s2, hi, walk, BLOCK_N, MASKED, SPARSE, MAP_N)
    for i in range(blocks):
        offs_n, n_ok = walk_block(i, head, lo, s1, s2, hi, walk, kv_len, BLOCK_N, MASKED, SPARSE,
                                  MAP_N)  # fmt: skip
        keys = offs_n.to(tl.int64)
        k = load_rows(k_base + keys * stride_k, n_ok, HEAD_D, BLOCK_D, MASKED, EMULATE_BF16)
        v = load_rows(v_base + keys * stride_v, n_ok, HEAD_DV, BLOCK_DV, MASKED, EMULATE_BF16)
        keep = kept(rows, k0 + offs_n, drop) if DROPOUT else 0
        _, ds, tile_sums = _probs_and_dscores(
            q, k, v, do, lse2, delta, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            keep, drop[4], mod, SOFTCAP, ALIBI, MASKED, DROPOUT, IEEE, SCORE_FN, MASK_FN,
            CAPTURE_FN,
        )  # fmt: skip
        dq = dot(operand_like(ds, k, EMULATE_BF16), k, dq, IEEE)
        sums += tile_sums
    return dq, sums


@triton.jit
def attn_bwd_dq(
    Q, K, V, DOut, Lse, Delta, DQ, Sums, Slopes, KvLens, CuQ, CuK, Floats, Ints, Grads, Num, Idx,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, sl_b, sl_h,
    sdq_b, sdq_h, sdq_t, ss_b,
    heads, group, seqlen_q, seqlen_k, left, right, scale, qk_scale, cap_in, cap_out,
    seed, drop_offset, drop_threshold, drop_scale, map_b, map_h, map_rows, map_cols,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    CAPTURE_FN: tl.constexpr, SPARSE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr,
):  # fmt: skip
    """``DQ`` (shaped like ``Q``) and the rows' sums of ``P`` (``Sums``, shaped
    and strided like ``Lse``) for query block ``program_id(0)`` of one head."""
    start_m, h, b, q0, k0, tq, tk, kv_len = program_tile(
        heads, CuQ, CuK, KvLens, seqlen_q, seqlen_k, BLOCK_M, KV_LENS, VARLEN
    )
    if start_m >= tq:
        return
    hk = (h // group).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < tq
    rows = (q0 + offs_m).to(tl.int64)
    q = load_rows(Q + b * sq_b + h * sq_h + rows * sq_t, m_ok, HEAD_D, BLOCK_D, True, EMULATE_BF16)
    do = load_rows(DOut + b * sd_b + h * sd_h + rows * sd_t, m_ok, HEAD_DV, BLOCK_DV, True,
                   EMULATE_BF16)  # fmt: skip
    lse2, delta = _row_state(Lse, Delta, offs_m, m_ok, b * sl_b + h * sl_h + q0)
    pos, lo_r, hi_r, lo, s1, s2, hi = query_block_keys(
        start_m, tq, tk, kv_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    slope2 = row_slopes(Slopes + b * ss_b + h, m_ok, BLOCK_M, ALIBI)
    k_base = K + b * sk_b + hk * sk_h + k0.to(tl.int64) * sk_t
    v_base = V + b * sv_b + hk * sv_h + k0.to(tl.int64) * sv_t
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    sums = tl.zeros([BLOCK_M], tl.float32)
    drop = (b * 65536 + h, seed, drop_offset, drop_threshold, drop_scale)
    mod = (Floats, Ints, Grads, b.to(tl.int32), h, tq, tk - tq, scale)
    # (as the forward's: a block mask's partial key blocks, then its full ones)
    for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
        walk = (0, Idx)
        if SPARSE:
            walk = listed(Num, Idx, (map_b, map_h, map_rows, map_cols), phase, b, h,
                          start_m // MAP_M)  # fmt: skip
        dq, sums = _dq_range(
            dq, sums, q, do, lse2, delta, k_base, v_base, sk_t, sv_t, lo, s1, s2, hi,
            pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, rows, k0, drop, walk, mod, kv_len,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, ALIBI, phase == 0 or SPARSE,
            DROPOUT, IEEE, EMULATE_BF16, SCORE_FN, MASK_FN if phase == 0 else None, CAPTURE_FN,
            SPARSE, MAP_N,
        )  # fmt: skip
    store_rows(DQ + b * sdq_b + h * sdq_h + rows * sdq_t, dq * scale, m_ok, HEAD_D, BLOCK_D,
               EMULATE_BF16)  # fmt: skip
    tl.store(Sums + b * sl_b + h * sl_h + q0 + offs_m, sums, mask=m_ok)

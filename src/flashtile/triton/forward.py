"""The forward kernel: FlashAttention-2's schedule, every variant a compile-time flag.

Grid ``(cdiv(Tq_max, BLOCK_M), sequences * Hq)``: a program owns one query
block of one head, keeps it in registers, and walks the key blocks its rows
may see in three phases (:func:`~flashtile.triton.tiles.phase_ends`): key
blocks across the left edge of the band (masked), blocks every row sees (no
per-element mask: the common case away from the diagonal), and blocks across
the right edge, the causal diagonal or the end of the keys (masked). Blocks
outside the band are never visited. The output is normalised once at the end
and ``lse`` (natural log, float32) is written for the backward.

Variants: ``HAS_LEFT``/``HAS_RIGHT`` (sliding window; causal is ``right =
0``), ``SOFTCAP``, ``ALIBI`` (slopes ``(B, Hq)`` or ``(Hq,)``, batch stride
0), ``KV_LENS`` (valid keys per batch entry; positions still align with
``Tk``), ``VARLEN`` (packed sequences from ``cu_seqlens``; then the tensors
are ``(1, H, total, d)`` and each sequence aligns bottom-right on its own).
GQA/MQA: query head ``h`` reads kv head ``h // group``; K/V are never copied.
"""

import triton
import triton.language as tl

from .tiles import (
    LOG2E,
    device_fn,
    finish_rows,
    load_tile,
    mma_in,
    online_block,
    phase_block,
    phase_count,
    query_block_keys,
    scores,
    store_tile,
)


@device_fn
def sequence(
    seq, CuQ, CuK, KvLens, seqlen_q, seqlen_k, KV_LENS: tl.constexpr, VARLEN: tl.constexpr
):
    """``(batch index, first query, first key, Tq, Tk, valid keys)`` of sequence ``seq``."""
    if VARLEN:
        q0 = tl.load(CuQ + seq)
        k0 = tl.load(CuK + seq)
        tq = tl.load(CuQ + seq + 1) - q0
        tk = tl.load(CuK + seq + 1) - k0
        b = seq * 0
    else:
        q0 = seq * 0
        k0 = seq * 0
        tq = seq * 0 + seqlen_q
        tk = seq * 0 + seqlen_k
        b = seq
    kv_len = tk
    if KV_LENS:
        kv_len = tl.load(KvLens + seq)
    return b, q0, k0, tq, tk, kv_len


@device_fn
def _fwd_range(
    acc, l_i, m_i, q, k_base, v_base, stride_k, stride_v, lo, s1, s2, hi,
    pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
    IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Fold the key blocks of one phase (see :func:`~.tiles.phase_count`) into the state."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    blocks, head = phase_count(lo, s1, s2, hi, BLOCK_N, MASKED)
    for i in range(blocks):
        start_n, end = phase_block(i, head, lo, s1, s2, hi, BLOCK_N, MASKED)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k_ptrs = k_base + offs_n[:, None].to(tl.int64) * stride_k + offs_d[None, :]
        k = mma_in(
            load_tile(k_ptrs, n_ok, offs_d < HEAD_D, MASKED, BLOCK_D != HEAD_D), EMULATE_BF16
        )
        s, _ = scores(
            q, k, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            SOFTCAP, ALIBI, MASKED, IEEE,
        )  # fmt: skip
        v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_v + offs_dv[None, :]
        v = load_tile(v_ptrs, n_ok, offs_dv < HEAD_DV, MASKED, BLOCK_DV != HEAD_DV)
        acc, l_i, m_i = online_block(
            acc, l_i, m_i, s, mma_in(v, EMULATE_BF16), MASKED, IEEE, EMULATE_BF16
        )
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, Out, Lse, Slopes, KvLens, CuQ, CuK,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, sl_b, sl_h, ss_b,
    heads, group, seqlen_q, seqlen_k, left, right, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """``Out (B, Hq, Tq, dv)`` and ``Lse (B, Hq, Tq)`` float32 (see the module docstring)."""
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
    pos, lo_r, hi_r, lo, s1, s2, hi = query_block_keys(
        start_m, tq, tk, kv_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope2 += tl.load(Slopes + b * ss_b + h) * LOG2E
    q_ptrs = Q + b * sq_b + h * sq_h + (q0 + offs_m[:, None]).to(tl.int64) * sq_t + offs_d[None, :]
    q = mma_in(load_tile(q_ptrs, m_ok, offs_d < HEAD_D, True, BLOCK_D != HEAD_D), EMULATE_BF16)
    k_base = K + b * sk_b + hk * sk_h + k0.to(tl.int64) * sk_t
    v_base = V + b * sv_b + hk * sv_h + k0.to(tl.int64) * sv_t
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, sk_t, sv_t, lo, s1, s2, hi,
            pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, ALIBI, phase == 0, IEEE,
            EMULATE_BF16,
        )  # fmt: skip
    out, lse = finish_rows(acc, l_i, m_i)
    o_ptrs = (
        Out + b * so_b + h * so_h + (q0 + offs_m[:, None]).to(tl.int64) * so_t + offs_dv[None, :]
    )
    store_tile(o_ptrs, out, m_ok[:, None] & (offs_dv[None, :] < HEAD_DV), EMULATE_BF16)
    tl.store(Lse + b * sl_b + h * sl_h + q0 + offs_m, lse, mask=m_ok)

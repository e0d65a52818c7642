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
are ``(1, H, total, d)`` and each sequence aligns bottom-right on its own),
``DROPOUT`` (:func:`~flashtile.triton.tiles.kept`: the CPU kernels' mask),
and a user's mods (:mod:`.flex`): ``SCORE_FN``/``MASK_FN`` (Triton functions
from :mod:`.mod_source`, reading the captured tables ``Floats``/``Ints``) and
``SPARSE``: the key blocks of a block mask's lists (``Num``/``Idx``, sized
``map_b``, ``map_h``, ``map_rows``, ``map_cols``; blocks of ``MAP_M x
MAP_N``; partial blocks first, with ``MASK_FN``, then full ones) instead of
the band's phases.
GQA/MQA: query head ``h`` reads kv head ``h // group``; K/V are never copied.
The key loop is :func:`~flashtile.triton.tiles.attend_range`, which the
decoding kernel runs too (there over a paged or contiguous cache).
"""

import triton
import triton.language as tl

from .tiles import (
    attend_range,
    finish_rows,
    listed,
    load_rows,
    program_tile,
    query_block_keys,
    row_slopes,
    store_rows,
)


@triton.jit
def attn_fwd(
    Q, K, V, Out, Lse, Slopes, KvLens, CuQ, CuK, Floats, Ints, Num, Idx,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, sl_b, sl_h, ss_b,
    heads, group, seqlen_q, seqlen_k, left, right, scale, qk_scale, cap_in, cap_out,
    seed, drop_offset, drop_threshold, drop_scale, map_b, map_h, map_rows, map_cols,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    KV_LENS: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    SPARSE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr,
):  # fmt: skip
    """``Out (B, Hq, Tq, dv)`` and ``Lse (B, Hq, Tq)`` float32 (see the module docstring)."""
    start_m, h, b, q0, k0, tq, tk, kv_len = program_tile(
        heads, CuQ, CuK, KvLens, seqlen_q, seqlen_k, BLOCK_M, KV_LENS, VARLEN
    )
    if start_m >= tq:
        return
    hk = (h // group).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < tq
    rows = (q0 + offs_m).to(tl.int64)
    pos, lo_r, hi_r, lo, s1, s2, hi = query_block_keys(
        start_m, tq, tk, kv_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    slope2 = row_slopes(Slopes + b * ss_b + h, m_ok, BLOCK_M, ALIBI)
    q = load_rows(Q + b * sq_b + h * sq_h + rows * sq_t, m_ok, HEAD_D, BLOCK_D, True, EMULATE_BF16)
    k_base = K + b * sk_b + hk * sk_h + k0.to(tl.int64) * sk_t
    v_base = V + b * sv_b + hk * sv_h + k0.to(tl.int64) * sv_t
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    drop = (b * 65536 + h, seed, drop_offset, drop_threshold, drop_scale)
    mod = (Floats, Ints, Floats, b.to(tl.int32), h, tq, tk - tq, scale)
    # The masked edges, then the unmasked interior; or a block mask's partial
    # blocks (MASK_FN applies), then its full ones (bounds only).
    for phase in tl.static_range(2):
        walk = (0, Idx)
        if SPARSE:
            walk = listed(Num, Idx, (map_b, map_h, map_rows, map_cols), phase, b, h,
                          start_m // MAP_M)  # fmt: skip
        acc, l_i, m_i = attend_range(
            acc, l_i, m_i, q, k_base, v_base, K, 0, sk_t, 0, sv_t, 1, lo, s1, s2, hi,
            pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, rows, k0, drop, walk, mod, kv_len,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, ALIBI, phase == 0 or SPARSE,
            False, DROPOUT, IEEE, EMULATE_BF16, SCORE_FN, MASK_FN if phase == 0 else None,
            SPARSE, MAP_N,
        )  # fmt: skip
    out, lse = finish_rows(acc, l_i, m_i)
    if DROPOUT:
        out = out * drop_scale
    store_rows(Out + b * so_b + h * so_h + rows * so_t, out, m_ok, HEAD_DV, BLOCK_DV, EMULATE_BF16)
    tl.store(Lse + b * sl_b + h * sl_h + q0 + offs_m, lse, mask=m_ok)

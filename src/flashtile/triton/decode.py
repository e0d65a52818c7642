"""Decoding kernels: split-KV attention over a long cache, then a merge (flash-decoding).

A decode step has a few queries per sequence and a long cache: the time is
reading K and V once. :func:`decode_split` gives each program one key chunk
of one ``(sequence, kv head)`` and stacks the queries of every query head
in the kv head's GQA group as rows of one tile (``group * Tq`` rows: row
``r`` is query head ``hk * group + r // Tq``, query ``r % Tq``), so each K/V
tile is read once for the whole group. Each chunk writes a normalised partial
``(out, lse)``; :func:`decode_merge` combines a row's partials with the
online-softmax merge (:func:`flashtile.merge_states`' rule). With one split
the split kernel writes the final output itself and no merge runs.

Cache addressing (:mod:`flashtile.kvlayout`'s rule): contiguous ``(B, Hkv,
T_max, d)``, or paged ``(pages, Hkv, page_size, d)`` where key ``j`` of
sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j //
page_size]`` (``PAGED``; any page size, pages looked up per key). Query ``i``
of ``Tq`` sits at position ``seqlen - Tq + i``.
"""

import triton
import triton.language as tl

from .tiles import (
    LN2,
    LOG2E,
    attend_range,
    device_fn,
    finish_rows,
    load_rows,
    phase_ends,
    row_bounds,
    row_slopes,
    store_rows,
)


@device_fn
def _chunk(seqlen, tq, split, num_splits, left, right,
           BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):  # fmt: skip
    """Keys ``[start, end)`` of this split (its share, in whole key blocks, of the keys
    any query sees), split into phases at ``s1``, ``s2`` (the interior is what every
    query sees). Returns ``(start, s1, s2, end)``."""
    lo, hi_first = row_bounds(seqlen - tq, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
    lo_last, hi = row_bounds(seqlen - 1, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
    hi = tl.maximum(lo, hi)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    start = tl.minimum(lo + split * chunk, hi)
    end = tl.minimum(start + chunk, hi)
    s1, s2 = phase_ends(start, end, lo_last, hi_first, BLOCK_N)
    return start, s1, s2, end


@triton.jit
def decode_split(
    Q, K, V, Out, Lse, Table, SeqLens, Slopes,
    sq_b, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_r, so_s, sl_b, sl_r, sl_s, st_b, ss_b,
    heads_kv, group, tq, num_splits, page_size, left, right, qk_scale, cap_in, cap_out,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    PAGED: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_splits, B * Hkv, row blocks)``. ``Q (B, Hq * Tq, d)`` contiguous rows;
    ``Out``/``Lse`` are the partials ``(B, Hq * Tq, S, dv)``/``(B, Hq * Tq, S)`` float32,
    or the final ``(B, Hq * Tq, dv)``/``(B, Hq * Tq)`` with split strides 0."""
    split = tl.program_id(0)
    b = (tl.program_id(1) // heads_kv).to(tl.int64)
    hk = (tl.program_id(1) % heads_kv).to(tl.int64)
    seqlen = tl.load(SeqLens + b)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < group * tq
    pos = seqlen - tq + r % tq
    lo_r, hi_r = row_bounds(pos, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
    slope2 = row_slopes(Slopes + b * ss_b + hk * group + r // tq, r_ok, BLOCK_M, ALIBI)
    rows = (hk * group * tq + r).to(tl.int64)  # the row in the (Hq * Tq) axis
    q = load_rows(Q + b * sq_b + rows * HEAD_D, r_ok, HEAD_D, BLOCK_D, True, EMULATE_BF16)
    if PAGED:  # pages carry no batch index: the table does
        k_base = K + hk * sk_h
        v_base = V + hk * sv_h
    else:
        k_base = K + b * sk_b + hk * sk_h
        v_base = V + b * sv_b + hk * sv_h
    start, s1, s2, end = _chunk(seqlen, tq, split, num_splits, left, right, BLOCK_N,
                                HAS_LEFT, HAS_RIGHT)  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for phase in tl.static_range(2):  # the masked edges, then the unmasked interior
        acc, l_i, m_i = attend_range(
            acc, l_i, m_i, q, k_base, v_base, Table + b * st_b, sk_b, sk_t, sv_b, sv_t,
            page_size, start, s1, s2, end, pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out,
            rows, 0, (0, 0, 0, 0, 1.0), (0, Table), (0, 0, 0, 0, 0, 0, 0, 0.0), 0, HEAD_D,
            HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, ALIBI, phase == 0, PAGED, False, IEEE,
            EMULATE_BF16, None, None, False, 1,
        )  # fmt: skip
    out, lse = finish_rows(acc, l_i, m_i)
    store_rows(Out + b * so_b + rows * so_r + split * so_s, out, r_ok, HEAD_DV, BLOCK_DV,
               EMULATE_BF16)  # fmt: skip
    tl.store(Lse + b * sl_b + rows * sl_r + split * sl_s, lse, mask=r_ok)


@triton.jit
def decode_merge(
    PartOut, PartLse, Out, Lse, total_rows, num_splits,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Merge the partials ``(rows, S, dv)``/``(rows, S)`` into ``Out (rows, dv)`` in the
    output dtype and ``Lse (rows,)`` float32. Empty partials (``lse = -inf``) weigh 0;
    a row with no key at all gives zeros and ``-inf``."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = r < total_rows
    offs_dv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(PartLse + r * num_splits + s, mask=r_ok, other=float("-inf")))
    m_base = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    weight = tl.zeros([BLOCK_R], tl.float32)
    mask = r_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    for s in range(num_splits):
        lse_s = tl.load(PartLse + r * num_splits + s, mask=r_ok, other=float("-inf"))
        w = tl.exp2((lse_s - m_base) * LOG2E)
        part = tl.load(PartOut + (r * num_splits + s)[:, None] * HEAD_DV + offs_dv[None, :],
                       mask=mask, other=0.0)  # fmt: skip
        acc += w[:, None] * part
        weight += w
    empty = weight == 0.0
    out = acc / tl.where(empty, 1.0, weight)[:, None]
    lse = tl.where(empty, float("-inf"), m_base + tl.log2(tl.where(empty, 1.0, weight)) * LN2)
    store_rows(Out + r * HEAD_DV, out, r_ok, HEAD_DV, BLOCK_DV, EMULATE_BF16)
    tl.store(Lse + r, lse, mask=r_ok)

"""Fused multi-threaded attention forward (Numba).

One work item is one ``(sequence, kv head, query block)``: the block's
queries of every query head that reads that kv head, stacked into one tile
(:mod:`.tiles`), so each K/V tile is loaded once per group. The items run in
a ``prange`` in the order :func:`flashtile.api` plans. Per row an item keeps
a reference ``m_i`` at or above the running max (in log2 units, see
:func:`softmax_tile`), the normaliser ``ell_i`` and the unnormalised output
``acc``, and walks the key/value blocks its queries can see:

    S   = (scale * log2(e) * Q_i) K_j^T        BLAS gemm into a reused buffer
    m'  = m_i, or max(S) + HEADROOM if S passed m_i;  alpha = 2**(m_i - m')
    P   = 2**(S - m')  (vectorised, in place);  ell_i = alpha * ell_i + rowsum(P)
    acc = alpha * acc + P V_j                  rescale rows, then gemm with beta = 1

Folding ``scale * log2(e)`` into the query tile once makes every score an
exponent of 2, so the inner loop is one subtract and a polynomial. Key blocks
outside the causal/window band (or empty in a block mask) are never visited;
only tiles that cross the band's edges pay for per-row limits, and hidden
entries are written as exact zeros.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..masks import block_key_range, tile_fully_visible
from . import FASTMATH
from .blas import gemm
from .memory import prefetch_rows
from .rowops import exp2_shifted, row_max
from .tiles import (
    changes_scores,
    diagonal_split,
    needs_transform,
    row_bounds,
    tile_state,
    transform_row,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: How far (log2 units) the reference ``m`` sits above a row's max: every
#: ``P <= 2**-10``, so a 512-wide tile sums to <= 0.5 unless a score jumped.
HEADROOM = 10.0
#: With a block map, kept key blocks are gathered into tiles of up to this
#: many keys, so a sparse mask still runs wide, efficient tile products.
GATHER_KEYS = 512


@njit(fastmath=FASTMATH, cache=True)
def prepare_row(row, r, segs, geo, kv, full):
    """Lay out stacked row ``r`` of a tile for the softmax; return columns ``[lo, hi)``.

    ``segs (nseg, 4)`` rows ``(column offset, first key, length, state)``
    describe which keys the tile's columns hold: one segment for a plain
    tile, several when kept blocks of a block mask were gathered. With one
    segment, columns outside the positional bounds are left out of
    ``[lo, hi)``; with several, hidden columns are set to ``-inf`` (they
    exponentiate to exact zeros) and ``[lo, hi)`` is the whole row. Variants
    are applied to the visible columns.
    """
    b, h0, br, i0, tq, tk, kv_len = geo
    i = i0 + r % br
    h = h0 + r // br
    transform = needs_transform(kv)
    if segs.shape[0] == 1:
        j0, n, state = segs[0, 1], segs[0, 2], segs[0, 3]
        lo, hi = 0, n
        if not full:
            lo, hi = row_bounds(i, j0, j0 + n, tq, tk, kv_len, kv)
        if transform and hi > lo:
            transform_row(row[lo:hi], j0 + lo, i, tq, tk, b, h, kv, state == 1, row[:0])
        return lo, hi
    for g in range(segs.shape[0]):
        off, j0, n, state = segs[g, 0], segs[g, 1], segs[g, 2], segs[g, 3]
        a, c = row_bounds(i, j0, j0 + n, tq, tk, kv_len, kv)
        row[off : off + a] = -np.inf
        row[off + c : off + n] = -np.inf
        if transform and c > a:
            transform_row(row[off + a : off + c], j0 + a, i, tq, tk, b, h, kv, state == 1, row[:0])
    return 0, segs[-1, 0] + segs[-1, 2]


@njit(fastmath=FASTMATH, cache=True)
def rebase_row(row, r, lo, hi, q_row, k_rows, segs, geo, kv, full):
    """Recompute row ``r``'s scores ``k_rows[lo:hi] @ q_row`` with every variant,
    exponentiate against a new reference ``max + HEADROOM``; return
    ``(reference, row sum)``.

    The rare path of :func:`softmax_tile`; kept out of line so that the hot
    loops stay small.
    """
    for c in range(lo, hi):
        acc = row.dtype.type(0.0)
        for t in range(q_row.shape[0]):
            acc += q_row[t] * k_rows[c, t]
        row[c] = acc
    prepare_row(row, r, segs, geo, kv, full)
    seg = row[lo:hi]
    m_new = row_max(seg, hi - lo) + HEADROOM
    return m_new, exp2_shifted(seg, m_new, hi - lo)


@njit(fastmath=FASTMATH, cache=True)
def softmax_tile(s, m, ell, alpha, q_tile, k_tile, segs, geo, kv, full):
    """Online-softmax update of one stacked score tile ``s (rows, n)`` in place.

    ``geo = (b, h0, br, i0, tq, tk, kv_len)`` places the tile: row ``r`` is
    query ``i0 + r % br`` of head ``h0 + r // br`` in batch ``b``; ``segs``
    (see :func:`prepare_row`) says which key each column holds; ``k_tile``
    holds those keys' rows. ``full`` says every row sees every column: all
    segments lie inside every row's positional bounds and, with a block
    map, in fully kept blocks. A full tile without score-changing variants
    goes straight to the exponential, row by row.

    On return ``s`` holds ``P = 2**(S - m_new)`` (exact zeros where hidden),
    ``m``/``ell`` the updated state and ``alpha`` the per-row rescale.

    ``m`` is a *reference* at or above the running max, not the max itself:
    a row's first visible tile sets it to ``max + HEADROOM``. Later tiles are
    exponentiated against the old reference straight away, with no max pass
    and no rescale, which is exact for any reference. Only when a score rises
    above the reference (some ``P > 1``, which a row sum ``<= 1`` rules out
    cheaply) is that row's score recomputed from ``q_tile`` and ``k_tile``
    and the reference raised, as in the textbook update.
    """
    rows = s.shape[0]
    plain = full and not changes_scores(kv)
    for r in range(rows):
        row = s[r]
        if plain:
            lo, hi = 0, s.shape[1]
        else:
            lo, hi = prepare_row(row, r, segs, geo, kv, full)
        alpha[r] = 1.0
        if hi <= lo:
            row[:] = 0.0
            continue
        seg = row[lo:hi]
        n = hi - lo
        m_new = m[r]
        if m_new == -np.inf:  # first visible tile: set the reference
            mx = row_max(seg, n)
            if mx == -np.inf:  # every score hidden by a mask: still empty
                row[:] = 0.0
                continue
            m_new = mx + HEADROOM
            total = exp2_shifted(seg, m_new, n)
        else:
            total = exp2_shifted(seg, m_new, n)
            if total > 1.0 and row_max(seg, n) > 1.0:
                # A score passed the reference: rebuild this row and raise it.
                m_new, total = rebase_row(row, r, lo, hi, q_tile[r], k_tile, segs, geo, kv, full)
            alpha[r] = 1.0 if m_new == m[r] else math.exp2(m[r] - m_new)
        row[:lo] = 0.0
        row[hi:] = 0.0
        ell[r] = ell[r] * alpha[r] + total
        m[r] = m_new


@njit(fastmath=FASTMATH, cache=True)
def load_q_tile(q, b, h0, group, qs0, i0, br, mult, out):
    """Stack ``group`` heads' queries ``[i0, i0 + br)`` into ``out``, scaled."""
    for g in range(group):
        src = q[b, h0 + g, qs0 + i0 : qs0 + i0 + br]
        dst = out[g * br : (g + 1) * br]
        for r in range(br):
            for c in range(q.shape[3]):
                dst[r, c] = src[r, c] * mult


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def forward_kernel(q, k, v, out, lse, visited, seqs, items, scale, kv, block_q, block_k, gemm_fn):
    """``out``/``lse`` of attention for C-contiguous 4-D arrays.

    Args:
        q: ``(NB, Hq, TQ, d)``; k, v: ``(NB, Hkv, TK, d / dv)``.
        out: ``(NB, Hq, TQ, dv)``, lse: ``(NB, Hq, TQ)`` (natural log), written.
        visited: ``(N,)`` int64, written: key blocks computed per item (tests
            use it to check what was skipped).
        seqs: ``(S, 6)`` int64 rows ``(b, q_start, Tq, k_start, Tk, kv_len)``:
            sequence ``s`` is queries ``q_start + [0, Tq)`` and keys
            ``k_start + [0, Tk)`` of batch entry ``b`` (one per batch entry,
            or one per packed sequence for varlen), ``kv_len`` valid keys.
        items: ``(N, 3)`` int64 rows ``(s, kv head, i0)``, in the order the
            threads should take them (:func:`flashtile.planning.forward_items`).
        kv: :class:`KernelVariants`. gemm_fn: :func:`.blas.gemm_for` of the dtype.
    """
    group = q.shape[1] // k.shape[1]
    dv = v.shape[3]
    q_mult = q.dtype.type(scale * LOG2E)
    for n in prange(items.shape[0]):
        sq, hk, i0 = items[n, 0], items[n, 1], items[n, 2]
        b, qs0, tq, ks0, tk, kv_len = seqs[sq]
        br = min(block_q, tq - i0)
        h0 = hk * group
        rows = group * br

        q_tile = np.empty((rows, q.shape[3]), dtype=q.dtype)
        load_q_tile(q, b, h0, group, qs0, i0, br, q_mult, q_tile)
        # Gathered tiles (block map) can hold several key blocks.
        width_max = block_k * (max(1, GATHER_KEYS // block_k) if kv.states.size > 0 else 1)
        s_buf = np.empty(rows * width_max, dtype=q.dtype)
        acc = np.zeros((rows, dv), dtype=q.dtype)
        m = np.full(rows, -np.inf, dtype=q.dtype)
        ell = np.zeros(rows, dtype=q.dtype)
        alpha = np.empty(rows, dtype=q.dtype)
        visited[n] = 0

        lo, hi = block_key_range(i0, i0 + br, tq, tk, kv.causal, kv.left, kv.right, kv_len)
        geo = (b, h0, br, i0, tq, tk, kv_len)
        if kv.states.size > 0:
            # Block map: gather up to GATHER_KEYS keys of kept blocks per tile.
            kb_lo, kb_hi = lo // block_k, (hi + block_k - 1) // block_k
            kept = np.empty((kb_hi - kb_lo, 4), dtype=np.int64)
            n_kept = 0
            for kb in range(kb_lo, kb_hi):
                state = tile_state(kv, b, h0, group, i0 // block_q, kb)
                if state != 0:
                    j0 = max(kb * block_k, lo)
                    kept[n_kept, 0] = 0
                    kept[n_kept, 1] = j0
                    kept[n_kept, 2] = min(kb * block_k + block_k, hi) - j0
                    kept[n_kept, 3] = state
                    n_kept += 1
            per_tile = max(1, GATHER_KEYS // block_k)
            k_buf = np.empty((per_tile * block_k, k.shape[3]), dtype=q.dtype)
            v_buf = np.empty((per_tile * block_k, dv), dtype=q.dtype)
            for g0 in range(0, n_kept, per_tile):
                segs = kept[g0 : min(g0 + per_tile, n_kept)]
                width = 0
                full = True  # every row sees every gathered column
                for g in range(segs.shape[0]):
                    j0, nk = segs[g, 1], segs[g, 2]
                    segs[g, 0] = width
                    k_buf[width : width + nk] = k[b, hk, ks0 + j0 : ks0 + j0 + nk]
                    v_buf[width : width + nk] = v[b, hk, ks0 + j0 : ks0 + j0 + nk]
                    width += nk
                    full = (
                        full
                        and segs[g, 3] == 2
                        and tile_fully_visible(
                            i0, i0 + br, j0, j0 + nk, tq, tk, kv.causal, kv.left, kv.right, kv_len
                        )
                    )
                visited[n] += segs.shape[0]  # key blocks computed
                s = s_buf[: rows * width].reshape((rows, width))
                gemm(gemm_fn, q_tile, k_buf[:width], s, False, True, 0.0)
                softmax_tile(s, m, ell, alpha, q_tile, k_buf, segs, geo, kv, full)
                for r in range(rows):
                    if alpha[r] != 1.0:
                        acc[r] *= alpha[r]
                gemm(gemm_fn, s, v_buf[:width], acc, False, False, 1.0)
        else:
            seg1 = np.zeros((1, 4), dtype=np.int64)
            seg1[0, 3] = 2  # no block map means no boolean mask to read
            for j0 in range(lo, hi, block_k):
                j1 = min(j0 + block_k, hi)
                visited[n] += 1
                # A C-contiguous (rows, bc) view: contiguous rows let LLVM vectorise.
                s = s_buf[: rows * (j1 - j0)].reshape((rows, j1 - j0))
                k_tile = k[b, hk, ks0 + j0 : ks0 + j1]
                v_tile = v[b, hk, ks0 + j0 : ks0 + j1]
                full = tile_fully_visible(
                    i0, i0 + br, j0, j1, tq, tk, kv.causal, kv.left, kv.right, kv_len
                )
                # Across the diagonal the top rows skip the keys they cannot
                # see in both products (a tenth of the work at T=1024).
                top, top_w = diagonal_split(group, br, full, i0, j0, j1, tq, tk, kv_len, kv)
                if top > 0:
                    if top_w > 0:
                        gemm(
                            gemm_fn, q_tile[:top], k_tile[:top_w], s[:top, :top_w], False, True, 0.0
                        )
                    gemm(gemm_fn, q_tile[top:], k_tile, s[top:], False, True, 0.0)
                else:
                    gemm(gemm_fn, q_tile, k_tile, s, False, True, 0.0)
                if j1 < hi:  # pull the next K/V tile toward L2 while this one is finished
                    j2 = min(j1 + block_k, hi)
                    prefetch_rows(k[b, hk], ks0 + j1, ks0 + j2)
                    prefetch_rows(v[b, hk], ks0 + j1, ks0 + j2)
                seg1[0, 1], seg1[0, 2] = j0, j1 - j0
                # Hidden columns (the top rows' unwritten ones too) come back as zeros.
                softmax_tile(s, m, ell, alpha, q_tile, k_tile, seg1, geo, kv, full)
                for r in range(rows):
                    if alpha[r] != 1.0:  # most rows keep their reference: nothing to rescale
                        acc[r] *= alpha[r]
                if top > 0:
                    if top_w > 0:
                        gemm(gemm_fn, s[:top, :top_w], v_tile[:top_w], acc[:top], False, False, 1.0)
                    gemm(gemm_fn, s[top:], v_tile, acc[top:], False, False, 1.0)
                else:
                    gemm(gemm_fn, s, v_tile, acc, False, False, 1.0)

        # Normalise once; rows that saw no key get zeros and lse = -inf.
        for r in range(rows):
            h = h0 + r // br
            i = qs0 + i0 + r % br
            if ell[r] == 0.0:  # saw no key (a NaN row is not caught here: it stays NaN)
                out[b, h, i, :] = 0.0
                lse[b, h, i] = -np.inf
            else:
                inv = 1.0 / ell[r]
                for c in range(dv):
                    out[b, h, i, c] = acc[r, c] * inv
                lse[b, h, i] = (m[r] + math.log2(ell[r])) * LN2

"""The tile step: one key tile folded into a tile of query rows, and the epilogue.

The attention forward (plain and gathered tiles) and the decode kernel walk
key tiles differently but fold each one the same way (:func:`fold_key_tile`).
Per row a tile of stacked query rows (:mod:`.tiles`) keeps a reference
``m_i`` at or above the running max (log2 units, see :func:`softmax_tile`),
the normaliser ``ell_i`` and the unnormalised output ``acc``::

    S   = (scale * log2(e) * Q_i) K_j^T        BLAS gemm into a reused buffer
    m'  = m_i, or max(S) + HEADROOM if S passed m_i;  alpha = 2**(m_i - m')
    P   = 2**(S - m')  (vectorised, in place);  ell_i = alpha * ell_i + rowsum(P)
    P   = P * keep                             dropout only (.dropout), after the sum
    acc = alpha * acc + P V_j                  rescale rows, then gemm with beta = 1

Folding ``scale * log2(e)`` into the query tile once makes every score an
exponent of 2, so the inner loop is one subtract and a polynomial. Across the
causal diagonal both products skip the columns the top rows cannot see
(:func:`.tiles.diagonal_split`; the backward's score product is
:func:`score_product` too). :func:`finish_rows` divides by ``ell`` once at
the end and writes ``out`` and the natural-log ``lse``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..masks import TILE_FULL, TILE_PARTIAL
from . import FASTMATH
from .blas import gemm, gemm_scaled
from .dropout import drop_tile
from .half import narrow, prob_tile, widen
from .memory import prefetch_rows
from .rowops import exp2_into, row_max, zero_outside
from .tiles import (
    SEG_COLUMNS,
    SEG_KEY,
    SEG_LENGTH,
    SEG_OFFSET,
    SEG_STATE,
    changes_scores,
    needs_transform,
    row_bounds,
    row_query,
    row_span,
    transform_row,
)
from .vectors import wide_vectors

#: How far (log2 units) the reference ``m`` sits above a row's max: every
#: ``P <= 2**-10``, so a 512-wide tile sums to <= 0.5 unless a score jumped.
HEADROOM = 10.0


@njit(fastmath=FASTMATH, cache=True)
def item_buffers(rows, dv, scores, dtype):
    """``(acc, m, ell, alpha, s_buf)`` of a work item, carved from one
    allocation of ``dtype``: the state before any tile (``acc (rows, dv)``
    and ``ell`` zero, ``m`` -inf), ``alpha (rows,)`` scratch and a flat
    score buffer of ``scores`` elements. One malloc and free rather than
    five (``malloc`` and ``free`` took 15% of a tiny call's kernel samples)."""
    # The scores first: the allocation's alignment serves the largest tile.
    buf = np.empty(scores + rows * (dv + 3), dtype=dtype)
    acc = buf[scores : scores + rows * dv].reshape((rows, dv))
    acc[:] = 0.0
    state = buf[scores + rows * dv :]
    m, ell, alpha = state[:rows], state[rows : 2 * rows], state[2 * rows :]
    m[:] = -np.inf
    ell[:] = 0.0
    return acc, m, ell, alpha, buf[:scores]


@njit(fastmath=FASTMATH, cache=True)
def one_segment():
    """A ``segs`` table for a tile of consecutive keys with no block map
    (the caller fills in ``SEG_KEY`` and ``SEG_LENGTH`` per tile)."""
    segs = np.zeros((1, SEG_COLUMNS), dtype=np.int64)
    segs[0, SEG_STATE] = TILE_FULL
    return segs


@njit(fastmath=FASTMATH, cache=True)
def prepare_row(s, r, segs, tile, variants, full):
    """Lay out stacked row ``r`` of the score tile ``s``; return its columns ``[lo, hi)``.

    ``segs`` (columns ``SEG_*``) says which keys the tile's columns hold: one
    segment for a plain tile, several when kept blocks of a block mask were
    gathered. With one segment, columns outside the positional bounds are
    left out of ``[lo, hi)``; with several, hidden columns are set to
    ``-inf`` (they exponentiate to exact zeros) and ``[lo, hi)`` is the whole
    row. Variants are applied to the visible columns. (A row view is taken
    only where a variant needs one: each costs two atomic reference counts.)
    """
    i, h = row_query(tile, r)
    transform = needs_transform(variants)
    if segs.shape[0] == 1:
        j0, n = segs[0, SEG_KEY], segs[0, SEG_LENGTH]
        lo, hi = 0, n
        if not full:
            lo, hi = row_bounds(tile, i, j0, j0 + n, variants)
        if transform and hi > lo:
            read_bool = segs[0, SEG_STATE] == TILE_PARTIAL
            transform_row(s[r, lo:hi], j0 + lo, tile, i, h, variants, read_bool, s[r, :0])
        return lo, hi
    row = s[r]
    for g in range(segs.shape[0]):
        off, j0, n = segs[g, SEG_OFFSET], segs[g, SEG_KEY], segs[g, SEG_LENGTH]
        a, c = row_bounds(tile, i, j0, j0 + n, variants)
        row[off : off + a] = -np.inf
        row[off + c : off + n] = -np.inf
        if transform and c > a:
            read_bool = segs[g, SEG_STATE] == TILE_PARTIAL
            transform_row(row[off + a : off + c], j0 + a, tile, i, h, variants, read_bool, row[:0])
    return 0, segs[-1, SEG_OFFSET] + segs[-1, SEG_LENGTH]


class KeptScores(NamedTuple):
    """A tile's raw scores ``(rows, n)``, kept apart for a rebase
    (:func:`raw_scores`) by a caller that has no key tile to recompute
    them from (row-wise decoding, :mod:`.cache_rows`)."""

    raw: np.ndarray


def raw_scores(s, r, lo, hi, q_row, keys, s_mult):
    """``s[r, lo:hi]`` = row ``r``'s raw scores again: ``s_mult * keys[lo:hi]
    @ q_row`` from key rows, or copied from a :class:`KeptScores`. Only
    callable from compiled code (the overload picks by the type of ``keys``)."""
    raise NotImplementedError("raw_scores is only available inside Numba kernels")


@overload(raw_scores, fastmath=FASTMATH, inline="always")  # in rebase_row: its vector width
def _raw_scores(s, r, lo, hi, q_row, keys, s_mult):
    if isinstance(keys, types.BaseNamedTuple) and keys.instance_class is KeptScores:

        def copy(s, r, lo, hi, q_row, keys, s_mult):
            for c in range(lo, hi):
                s[r, c] = keys.raw[r, c]

        return copy

    def recompute(s, r, lo, hi, q_row, keys, s_mult):
        for c in range(lo, hi):
            acc = s.dtype.type(0.0)
            for t in range(q_row.shape[0]):
                acc += widen(q_row[t]) * widen(keys[c, t])
            s[r, c] = acc * s_mult

    return recompute


@njit(fastmath=FASTMATH, cache=True)
def rebase_row(s, p, r, lo, hi, q_row, k_rows, s_mult, segs, tile, variants, full, raw_flag):
    """Recompute row ``r``'s scores ``s_mult * k_rows[lo:hi] @ q_row`` with every variant,
    exponentiate them into ``p`` (may be ``s``) against a new reference
    ``max + HEADROOM``; return ``(reference, row sum)``.

    The rare path of :func:`softmax_tile`; kept out of line so that the hot
    loops stay small. The recomputed raw scores are checked like the
    product's (``raw_flag``, :func:`flag_non_finite`): this loop sums in
    another order than BLAS, so near float32's largest value one of them can
    overflow where the other did not. ``k_rows`` may instead be a
    :class:`KeptScores`: the tile's raw scores, copied back (row-wise
    decoding, which reads no key tile).
    """
    wide_vectors()
    raw_scores(s, r, lo, hi, q_row, k_rows, s_mult)
    if raw_flag.size > 0:
        flag_non_finite(s[r : r + 1, lo:hi], raw_flag)
    prepare_row(s, r, segs, tile, variants, full)
    m_new = row_max(s, r, lo, hi) + HEADROOM
    return m_new, exp2_into(s, p, r, lo, hi, m_new)


@njit(fastmath=FASTMATH, cache=True)
def softmax_tile(s, p, m, ell, alpha, q_tile, k_tile, s_mult, segs, tile, variants, full, raw_flag):
    """Online-softmax update of one stacked score tile ``s (rows, n)`` into ``p``.

    ``tile`` (a :class:`.tiles.QueryTile`) places the rows; ``segs`` (see
    :func:`prepare_row`) says which key each column holds; ``k_tile`` holds
    those keys' rows. ``full`` says every row sees every column: all
    segments lie inside every row's positional bounds and, with a block
    map, in fully kept blocks. A full tile without score-changing variants
    goes straight to the exponential, row by row.

    On return ``p`` holds ``P = 2**(S - m_new)`` (exact zeros where hidden),
    ``m``/``ell`` the updated state and ``alpha`` the per-row rescale. ``p``
    is ``s`` itself (in place) or, for bf16 operands, a ``uint16`` tile that
    receives ``P`` rounded to bf16 (:func:`.half.prob_tile`); ``s`` keeps
    the scores then, the variants applied. ``k_tile`` may be a
    :class:`KeptScores` instead of key rows (:func:`raw_scores`).

    ``m`` is a *reference* at or above the running max, not the max itself:
    a row's first visible tile sets it to ``max + HEADROOM``. Later tiles are
    exponentiated against the old reference straight away, with no max pass
    and no rescale, which is exact for any reference. Only when a score rises
    above the reference (some ``P > 1``, which a row sum ``<= 1`` rules out
    cheaply; a bf16 ``P`` in ``(1, 1.004)`` rounds to 1 and is let pass, it is
    harmless) is that row's score recomputed from ``q_tile`` and ``k_tile``
    (times ``s_mult``, see :func:`score_product`) and the reference raised,
    as in the textbook update.
    """
    wide_vectors()
    rows = s.shape[0]
    plain = full and not changes_scores(variants)
    # One segment and no transform: the positional bounds alone, from
    # scalars (an out-of-line prepare_row costs 24 atomic reference-count
    # updates per row for its array arguments: a quarter of a tiny call).
    positional = segs.shape[0] == 1 and not needs_transform(variants)
    j0 = segs[0, SEG_KEY] if positional else 0
    causal, left, right = variants.causal, variants.left, variants.right
    for r in range(rows):  # indexed, not row views (see prepare_row)
        if plain:
            lo, hi = 0, s.shape[1]
        elif positional:  # (not full: a full one is plain)
            lo, hi = row_span(tile, tile.i0 + r % tile.br, j0, s.shape[1], causal, left, right)
        else:
            lo, hi = prepare_row(s, r, segs, tile, variants, full)
        alpha[r] = 1.0
        if hi <= lo:
            zero_outside(p, r, 0, 0)
            continue
        m_new = m[r]
        if m_new == -np.inf:  # first visible tile: set the reference
            mx = row_max(s, r, lo, hi)
            if mx == -np.inf:  # every score hidden by a mask: still empty
                zero_outside(p, r, 0, 0)
                continue
            m_new = mx + HEADROOM
            total = exp2_into(s, p, r, lo, hi, m_new)
        else:
            total = exp2_into(s, p, r, lo, hi, m_new)
            # (bf16 bits of P >= 0 order as their values: the max works on them)
            if total > 1.0 and row_max(p, r, lo, hi) > narrow(1.0, p):
                # A score passed the reference: rebuild this row and raise it.
                m_new, total = rebase_row(
                    s, p, r, lo, hi, q_tile[r], k_tile, s_mult, segs, tile, variants, full,
                    raw_flag,
                )  # fmt: skip
            alpha[r] = 1.0 if m_new == m[r] else math.exp2(m[r] - m_new)
        zero_outside(p, r, lo, hi)
        ell[r] = ell[r] * alpha[r] + total
        m[r] = m_new


@njit(fastmath=FASTMATH, cache=True, inline="always")
def score_product(gemm_fn, q_tile, k_tile, s, top, top_w, s_mult=1.0):
    """``s = s_mult * q_tile k_tile^T``; with a diagonal split (``top > 0``)
    the first ``top`` rows get only the first ``top_w`` columns (the rest is
    left unwritten: the caller hides it). ``s_mult`` is 1 when the query
    tile is already scaled (float tiles), the score scale for bf16 operands
    (:func:`.half.split_scale`)."""
    if top > 0:
        if top_w > 0:
            gemm_scaled(
                gemm_fn, q_tile[:top], k_tile[:top_w], s[:top, :top_w], False, True, s_mult, 0.0
            )
        gemm_scaled(gemm_fn, q_tile[top:], k_tile, s[top:], False, True, s_mult, 0.0)
    else:
        gemm_scaled(gemm_fn, q_tile, k_tile, s, False, True, s_mult, 0.0)


@njit(fastmath=FASTMATH, cache=True)
def flag_non_finite(s, flag):
    """``flag[0] = 1`` if the tile ``s`` holds a NaN or an infinite score.

    Decoding checks the float32 range after the call (:mod:`flashtile.precision`):
    a score that overflowed is inf, -inf or NaN straight out of the product,
    but softcap turns it into the cap and a -inf hides its key, so the row's
    ``lse`` need not show it. The raw scores do (the product's, and those
    :func:`rebase_row` recomputes)."""
    wide_vectors()
    bad = False
    for r in range(s.shape[0]):
        row = np.uintp(r)
        for c in range(s.shape[1]):
            bad |= not abs(s[row, c]) < np.inf  # NaN compares False
    if bad:
        flag[0] = 1


@njit(fastmath=FASTMATH, cache=True, inline="always")
def rescale_rows(acc, alpha):
    """``acc[r] *= alpha[r]`` where the row's reference moved (``alpha != 1``)."""
    for r in range(acc.shape[0]):
        if alpha[r] != 1.0:  # most rows keep their reference: nothing to rescale
            for c in range(acc.shape[1]):
                acc[r, c] *= alpha[r]


@njit(fastmath=FASTMATH, cache=True, inline="always")
def fold_key_tile(
    gemm_fn, q_tile, k_tile, v_tile, s, m, ell, alpha, acc, segs, tile, variants, full, top,
    top_w, k_next, v_next, p_buf, s_mult, raw_flag,
):  # fmt: skip
    """Fold one key tile into the rows' state ``(m, ell, acc)``: the tile step.

    Inlined into each caller by Numba (``inline="always"``), as the helpers
    it calls are not: it runs once per key tile, and an out-of-line call
    passes some 150 words of array descriptors (a few percent of a small
    decoding tile).

    Args:
        q_tile: ``(rows, d)`` stacked queries, scaled by ``scale * log2(e) /
            s_mult``.
        k_tile, v_tile: ``(n, d)``, ``(n, dv)``: the keys and values of the
            tile's columns (described by ``segs``, columns ``SEG_*``).
        s: ``(rows, n)`` C-contiguous float score buffer; alpha: ``(rows,)`` scratch.
        m, ell, acc: ``(rows,)``, ``(rows,)``, ``(rows, dv)``: the state, in
            the dtype of ``s``.
        tile, variants: :class:`.tiles.QueryTile`, :class:`.tiles.KernelVariants`.
        full: every row sees every column (no per-row limits, no mask reads).
        top, top_w: the diagonal split (:func:`.tiles.diagonal_split`; ``top
            = 0`` for none).
        k_next, v_next: rows of the next tile to prefetch while this one is
            finished (zero rows for none).
        p_buf: bf16 operands (``uint16``): at least ``rows * n`` elements for
            ``P`` rounded to bf16 (:func:`.half.prob_buffer`); float
            operands: empty, ``P`` overwrites the scores in ``s``.
        s_mult: the scale the score product applies (:func:`.half.split_scale`).
        raw_flag: ``(1,)`` uint8 set to 1 when a raw score is not finite
            (:func:`flag_non_finite`; decoding, whose tiles have no diagonal
            split: ``top = 0``, so the whole of ``s`` is written), or empty
            (the forward, whose range is checked before the call).
    """
    score_product(gemm_fn, q_tile, k_tile, s, top, top_w, s_mult)
    if raw_flag.size > 0:
        flag_non_finite(s, raw_flag)
    prefetch_rows(k_next, 0, k_next.shape[0])
    prefetch_rows(v_next, 0, v_next.shape[0])
    # Hidden columns (the top rows' unwritten ones too) come back as zeros.
    p = prob_tile(s, p_buf)
    softmax_tile(s, p, m, ell, alpha, q_tile, k_tile, s_mult, segs, tile, variants, full, raw_flag)
    if variants.drop_threshold > 0:  # after the sums: ell is the undropped normaliser
        drop_tile(p, segs, tile, variants, 0.0)
    rescale_rows(acc, alpha)
    if top > 0:
        if top_w > 0:
            gemm(gemm_fn, p[:top, :top_w], v_tile[:top_w], acc[:top], False, False, 1.0)
        gemm(gemm_fn, p[top:], v_tile, acc[top:], False, False, 1.0)
    else:
        gemm(gemm_fn, p, v_tile, acc, False, False, 1.0)


@njit(fastmath=FASTMATH, cache=True)
def finish_rows(acc, m, ell, out, lse, h0, i_first, br, mult, lse_mult):
    """The epilogue: normalise the rows once and write ``out`` and ``lse``.

    ``mult`` scales ``out`` (dropout's ``1 / (1 - p)``; 1 otherwise).
    Row ``r`` goes to ``out[h0 + r // br, i_first + r % br]`` of ``out (H, T,
    dv)`` (float, or bf16 bits as uint16: rounded) and ``lse (H, T)``:
    ``(m + log2(ell)) * lse_mult``, the natural log for ``ln 2``, log2
    units for 1 (exact for a one-hot row). A row that saw no key gets zeros
    and ``lse = -inf`` (a NaN row is not caught here: it stays NaN).
    """
    wide_vectors()
    for r in range(acc.shape[0]):
        h = h0 + r // br
        i = i_first + r % br
        if ell[r] == 0.0:
            out[h, i, :] = 0
            lse[h, i] = -np.inf
        else:
            inv = mult / ell[r]
            for c in range(out.shape[2]):
                out[h, i, c] = narrow(acc[r, c] * inv, out)
            lse[h, i] = (m[r] + math.log2(ell[r])) * lse_mult

"""Fused multi-threaded attention forward (Numba).

One work item is one ``(batch, head, query block)``; the items run in a
``prange``. For its ``block_q`` queries an item keeps a reference ``m_i`` at
or above the running max (in log2 units, see :func:`softmax_tile`), the
normaliser ``ell_i`` and the unnormalised output ``acc``, and walks the
key/value blocks:

    S   = (scale * log2(e) * Q_i) K_j^T        BLAS gemm into a reused buffer
    m'  = m_i, or max(S) + HEADROOM if S passed m_i;  alpha = 2**(m_i - m')
    P   = 2**(S - m')  (vectorised, in place);  ell_i = alpha * ell_i + rowsum(P)
    acc = alpha * acc + P V_j                  rescale rows, then gemm with beta = 1

Folding ``scale * log2(e)`` into the query tile once makes every score an
exponent of 2, so the inner loop is one subtract and a polynomial. Under the
causal mask, key blocks beyond the last visible key are never visited and only
the tiles that straddle the diagonal pay for per-row limits; masked entries
are written as exact zeros rather than pushed through ``exp``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..masks import key_stop, last_visible_key, tile_needs_mask
from . import FASTMATH
from .blas import gemm
from .rowops import exp2_shifted, row_max

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: How far (log2 units) the reference ``m`` sits above a row's max: every
#: ``P <= 2**-10``, so a 512-wide tile sums to <= 0.5 unless a score jumped.
HEADROOM = 10.0


@njit(inline="always", cache=True)
def zigzag(idx, n):
    """Order 0, n-1, 1, n-2, ...: contiguous halves of it get equal causal work."""
    half = idx // 2
    return half if idx % 2 == 0 else n - 1 - half


@njit(fastmath=FASTMATH, cache=True)
def rebase_row(row, lim, q_row, k_tile, bits):
    """Recompute ``row[:lim] = k_tile @ q_row``, exponentiate against a new
    reference ``max + HEADROOM`` and return ``(reference, row sum)``.

    The rare path of :func:`softmax_tile`; kept out of line so that the hot
    loops stay small.
    """
    for c in range(lim):
        acc = row.dtype.type(0.0)
        for t in range(q_row.shape[0]):
            acc += q_row[t] * k_tile[c, t]
        row[c] = acc
    m_new = row_max(row, lim) + HEADROOM
    return m_new, exp2_shifted(row, m_new, lim, bits)


@njit(fastmath=FASTMATH, cache=True)
def softmax_tile(s, m, ell, alpha, bits, row0, col0, tq, tk, causal, masked, q_tile, k_tile):
    """Online-softmax update of one score tile ``s (br, bc)`` in place.

    On return ``s`` holds ``P = 2**(S - m_new)`` (exact zeros where masked),
    ``m``/``ell`` hold the updated state and ``alpha`` the per-row rescale.
    Row ``r`` is query ``row0 + r``; column ``c`` is key ``col0 + c``.

    ``m`` is a *reference* at or above the running max, not the max itself:
    a row's first visible tile sets it to ``max + HEADROOM``. Later tiles are
    exponentiated against the old reference straight away, with no max pass
    and no rescale, which is exact for any reference. Only when a score rises
    above the reference (some ``P > 1``, which a row sum ``<= 1`` rules out
    cheaply) is that row's score recomputed from ``q_tile`` and ``k_tile``
    and the reference raised, as in the textbook update.
    """
    br, bc = s.shape
    for r in range(br):
        row = s[r]
        lim = bc
        if masked:
            lim = min(bc, last_visible_key(row0 + r, tq, tk, causal) + 1 - col0)
        if lim <= 0:
            row[:] = 0.0
            alpha[r] = 1.0
            continue
        m_new = m[r]
        if m_new == -np.inf:  # first visible tile: nothing to rescale
            m_new = row_max(row, lim) + HEADROOM
            total = exp2_shifted(row, m_new, lim, bits)
        else:
            total = exp2_shifted(row, m_new, lim, bits)
            if total > 1.0 and row_max(row, lim) > 1.0:
                # A score passed the reference: rebuild this row and raise it.
                m_new, total = rebase_row(row, lim, q_tile[r], k_tile, bits)
        alpha[r] = 1.0 if m_new == m[r] else math.exp2(m[r] - m_new)  # 0 if m = -inf
        row[lim:] = 0.0
        ell[r] = ell[r] * alpha[r] + total
        m[r] = m_new


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def forward_kernel(q, k, v, out, lse, scale, causal, block_q, block_k, gemm_fn):
    """``out``/``lse`` of attention for C-contiguous ``(B, H, T, d)`` arrays.

    ``out (B, H, Tq, dv)`` and ``lse (B, H, Tq)`` (natural log) are written in
    place. ``q``, ``k``, ``v``, ``out`` and ``lse`` share one dtype, and
    ``gemm_fn`` is :func:`.blas.gemm_for` of it.
    """
    n_batch, n_head, tq, _ = q.shape
    tk = k.shape[2]
    dv = v.shape[3]
    n_qblocks = (tq + block_q - 1) // block_q
    q_mult = q.dtype.type(scale * LOG2E)
    for item in prange(n_batch * n_head * n_qblocks):
        bh = item // n_qblocks
        b = bh // n_head
        h = bh % n_head
        i0 = zigzag(item % n_qblocks, n_qblocks) * block_q
        i1 = min(i0 + block_q, tq)
        br = i1 - i0

        q_tile = q[b, h, i0:i1] * q_mult  # scaled copy: q stays in cache
        s_buf = np.empty(br * block_k, dtype=q.dtype)
        acc = np.zeros((br, dv), dtype=q.dtype)
        m = np.full(br, -np.inf, dtype=q.dtype)
        ell = np.zeros(br, dtype=q.dtype)
        alpha = np.empty(br, dtype=q.dtype)
        bits = np.empty(block_k, dtype=np.int32)

        j_stop = key_stop(i1, tq, tk, causal)
        for j0 in range(0, j_stop, block_k):
            j1 = min(j0 + block_k, j_stop)
            # A C-contiguous (br, bc) view: contiguous rows let LLVM vectorise.
            s = s_buf[: br * (j1 - j0)].reshape((br, j1 - j0))
            k_tile = k[b, h, j0:j1]
            gemm(gemm_fn, q_tile, k_tile, s, False, True, 0.0)
            masked = causal and tile_needs_mask(i0, j1, tq, tk, causal)
            softmax_tile(s, m, ell, alpha, bits, i0, j0, tq, tk, causal, masked, q_tile, k_tile)
            for r in range(br):
                if alpha[r] != 1.0:  # most rows keep their reference: nothing to rescale
                    acc[r] *= alpha[r]
            gemm(gemm_fn, s, v[b, h, j0:j1], acc, False, False, 1.0)  # acc += P V_j

        # Normalise once; rows that saw no key keep zeros and lse = -inf.
        for r in range(br):
            if ell[r] == 0.0:  # saw no key (a NaN row is not caught here: it stays NaN)
                out[b, h, i0 + r, :] = 0.0
                lse[b, h, i0 + r] = -np.inf
            else:
                inv = 1.0 / ell[r]
                for c in range(dv):
                    out[b, h, i0 + r, c] = acc[r, c] * inv
                lse[b, h, i0 + r] = (m[r] + math.log2(ell[r])) * LN2

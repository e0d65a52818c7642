"""Fused attention backward by recomputation (Numba).

One work item is one ``(batch, head)``: it owns that head's ``dq``, ``dk`` and
``dv`` outright, so items never write to the same memory (no races, no
atomics) and the order of every sum is fixed (bit-identical results run to
run). Within a head, for each key block ``j`` and each query block ``i`` that
can see it::

    P    = 2**(scale*log2(e) * Q_i K_j^T - lse_i*log2(e))   recomputed, never stored
    dV_j += P^T dO_i            dP = dO_i V_j^T
    dS   = P * (dP - D_i)       dQ_i += scale * dS K_j     dK_j += scale * dS^T Q_i

with ``D = rowsum(dO * O)``. Five BLAS products per tile, one recomputed
exponential. Heads are the unit of parallelism, so ``B * H`` below the core
count leaves cores idle (a known limit, see docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..masks import key_stop, last_visible_key, tile_needs_mask
from . import FASTMATH
from .forward import LOG2E
from .rowops import exp2_shifted


@njit(fastmath=FASTMATH, cache=True)
def probs_tile(s, lse2, bits, row0, col0, tq, tk, causal, masked):
    """``s = 2**(s - lse2[row])`` in place, exact zeros where masked.

    ``lse2`` is the natural-log lse times ``log2(e)``; ``-inf`` rows (queries
    that saw no key) become all zeros.
    """
    br, bc = s.shape
    for r in range(br):
        row = s[r]
        lim = bc
        if masked:
            lim = min(bc, last_visible_key(row0 + r, tq, tk, causal) + 1 - col0)
        if lim <= 0 or lse2[r] == -np.inf:
            row[:] = 0.0
            continue
        exp2_shifted(row, lse2[r], lim, bits)
        row[lim:] = 0.0


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def backward_kernel(q, k, v, out, lse, dout, dq, dk, dv, scale, causal, block_q, block_k):
    """Write ``dq``, ``dk``, ``dv`` for C-contiguous ``(B, H, T, d)`` arrays."""
    n_batch, n_head, tq, d = q.shape
    tk = k.shape[2]
    dvw = v.shape[3]
    q_mult = q.dtype.type(scale * LOG2E)
    g_mult = q.dtype.type(scale)
    for bh in prange(n_batch * n_head):
        b = bh // n_head
        h = bh % n_head
        qh = q[b, h]
        qs = qh * q_mult
        doh = dout[b, h]
        lse2 = lse[b, h] * q.dtype.type(LOG2E)
        delta = np.empty(tq, dtype=q.dtype)
        for i in range(tq):
            acc = q.dtype.type(0.0)
            for c in range(dvw):
                acc += doh[i, c] * out[b, h, i, c]
            delta[i] = acc
        dqh = dq[b, h]
        dqh[:] = 0.0
        p_buf = np.empty(block_q * block_k, dtype=q.dtype)
        dp_buf = np.empty(block_q * block_k, dtype=q.dtype)
        dq_tmp = np.empty(block_q * d, dtype=q.dtype)
        dk_tmp = np.empty(block_k * d, dtype=q.dtype)
        dv_tmp = np.empty(block_k * dvw, dtype=q.dtype)
        bits = np.empty(block_k, dtype=np.int32)

        j_stop = key_stop(tq, tq, tk, causal)
        for j0 in range(0, j_stop, block_k):
            j1 = min(j0 + block_k, j_stop)
            bc = j1 - j0
            kj = k[b, h, j0:j1]
            vj = v[b, h, j0:j1]
            dk_acc = np.zeros((bc, d), dtype=q.dtype)
            dv_acc = np.zeros((bc, dvw), dtype=q.dtype)
            dk_t = dk_tmp[: bc * d].reshape((bc, d))
            dv_t = dv_tmp[: bc * dvw].reshape((bc, dvw))
            # First query that sees key j0 (bottom-right causal): i + tk - tq >= j0.
            i_first = max(0, j0 - (tk - tq)) if causal else 0
            for i0 in range((i_first // block_q) * block_q, tq, block_q):
                i1 = min(i0 + block_q, tq)
                br = i1 - i0
                p = p_buf[: br * bc].reshape((br, bc))
                dp = dp_buf[: br * bc].reshape((br, bc))
                np.dot(qs[i0:i1], kj.T, p)
                masked = causal and tile_needs_mask(i0, j1, tq, tk, causal)
                probs_tile(p, lse2[i0:i1], bits, i0, j0, tq, tk, causal, masked)
                np.dot(p.T, doh[i0:i1], dv_t)
                dv_acc += dv_t
                np.dot(doh[i0:i1], vj.T, dp)
                for r in range(br):
                    dr = delta[i0 + r]
                    for c in range(bc):
                        dp[r, c] = p[r, c] * (dp[r, c] - dr)  # dS, in place
                dq_t = dq_tmp[: br * d].reshape((br, d))
                np.dot(dp, kj, dq_t)
                dqh[i0:i1] += dq_t
                np.dot(dp.T, qh[i0:i1], dk_t)
                dk_acc += dk_t
            dk[b, h, j0:j1] = dk_acc * g_mult
            dv[b, h, j0:j1] = dv_acc
        dqh *= g_mult
        if j_stop < tk:
            dk[b, h, j_stop:] = 0.0
            dv[b, h, j_stop:] = 0.0

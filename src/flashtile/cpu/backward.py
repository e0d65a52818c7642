"""Fused attention backward by recomputation (Numba).

One work item is one ``(batch, head)``: it owns that head's ``dq``, ``dk`` and
``dv`` outright, so items never write to the same memory (no races, no
atomics) and the order of every sum is fixed (bit-identical results run to
run). Within a head, for each key block ``j`` and each query block ``i`` that
can see it::

    P    = 2**(scale*log2(e) * Q_i K_j^T - lse_i*log2(e))   recomputed, never stored
    dV_j += P^T dO_i            dP = dO_i V_j^T
    dS   = P * (dP - D_i)       dQ_i += scale * dS K_j     dK_j += scale * dS^T Q_i

with ``D = rowsum(dO * O)``. Five BLAS products per tile (three of them
accumulate straight into the gradients), one recomputed exponential. Heads
are the unit of parallelism, so ``B * H`` below the core count leaves cores
idle (a known limit, see docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..masks import key_stop, last_visible_key, tile_needs_mask
from . import FASTMATH
from .blas import gemm
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
def backward_kernel(q, k, v, out, lse, dout, dq, dk, dv, scale, causal, block_q, block_k, gemm_fn):
    """Write ``dq``, ``dk``, ``dv`` for C-contiguous ``(B, H, T, d)`` arrays.

    ``gemm_fn`` is :func:`.blas.gemm_for` of the arrays' dtype. The three
    gradients accumulate in place through ``gemm`` with ``beta = 1``.
    """
    n_batch, n_head, tq, _ = q.shape
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
        delta = np.empty(tq, dtype=q.dtype)  # D_i = dO_i . O_i
        for i in range(tq):
            acc = q.dtype.type(0.0)
            for c in range(dvw):
                acc += doh[i, c] * out[b, h, i, c]
            delta[i] = acc
        dqh, dkh, dvh = dq[b, h], dk[b, h], dv[b, h]
        dqh[:] = 0.0
        dkh[:] = 0.0
        dvh[:] = 0.0
        p_buf = np.empty(block_q * block_k, dtype=q.dtype)
        ds_buf = np.empty(block_q * block_k, dtype=q.dtype)
        bits = np.empty(block_k, dtype=np.int32)

        j_stop = key_stop(tq, tq, tk, causal)
        for j0 in range(0, j_stop, block_k):
            j1 = min(j0 + block_k, j_stop)
            bc = j1 - j0
            kj, vj = k[b, h, j0:j1], v[b, h, j0:j1]
            dkj, dvj = dkh[j0:j1], dvh[j0:j1]
            # First query that sees key j0 (bottom-right causal): i + tk - tq >= j0.
            i_first = max(0, j0 - (tk - tq)) if causal else 0
            for i0 in range((i_first // block_q) * block_q, tq, block_q):
                i1 = min(i0 + block_q, tq)
                br = i1 - i0
                # C-contiguous tiles: contiguous rows let LLVM vectorise.
                p = p_buf[: br * bc].reshape((br, bc))
                ds = ds_buf[: br * bc].reshape((br, bc))
                gemm(gemm_fn, qs[i0:i1], kj, p, False, True, 0.0)
                masked = causal and tile_needs_mask(i0, j1, tq, tk, causal)
                probs_tile(p, lse2[i0:i1], bits, i0, j0, tq, tk, causal, masked)
                gemm(gemm_fn, p, doh[i0:i1], dvj, True, False, 1.0)  # dV_j += P^T dO_i
                gemm(gemm_fn, doh[i0:i1], vj, ds, False, True, 0.0)  # dP = dO_i V_j^T
                for r in range(br):
                    dr = delta[i0 + r]
                    for c in range(bc):
                        ds[r, c] = p[r, c] * (ds[r, c] - dr)  # dS = P * (dP - D)
                gemm(gemm_fn, ds, kj, dqh[i0:i1], False, False, 1.0)  # dQ_i += dS K_j
                gemm(gemm_fn, ds, qh[i0:i1], dkj, True, False, 1.0)  # dK_j += dS^T Q_i
        dqh *= g_mult
        dkh *= g_mult

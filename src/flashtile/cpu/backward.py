"""Fused attention backward by recomputation (Numba).

One work item is one ``(sequence, kv head)``: it owns that kv head's ``dk``
and ``dv`` and the ``dq`` of its query heads (GQA groups stack as in the
forward), so items never write to the same memory (no races, no atomics) and
the order of every sum is fixed (bit-identical results run to run). For each
query block ``i`` and each key block ``j`` it can see::

    P    = 2**(scale*log2(e) * Q_i K_j^T - lse_i*log2(e))   recomputed, never stored
    dV_j += P^T dO_i            dP = dO_i V_j^T
    dS   = P * (dP - D_i)       dQ_i += scale * dS K_j     dK_j += scale * dS^T Q_i

with ``D = rowsum(dO * O)`` (softcap multiplies ``dS`` by ``1 - tanh**2``).
Five BLAS products per tile (three accumulate straight into the gradients),
one recomputed exponential; a tile across the causal diagonal runs them as
two row blocks, the top one over only the keys it sees
(:func:`.tiles.diagonal_split`). With fewer ``(sequence, kv head)`` pairs than
threads, a pair is split into parts over its query blocks with private
``dk``/``dv`` sums (see :func:`backward_kernel`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..masks import block_key_range, tile_fully_visible
from . import FASTMATH
from .blas import gemm
from .forward import LOG2E, load_q_tile
from .rowops import exp2_shifted
from .tiles import diagonal_split, needs_transform, row_bounds, tile_state, transform_row


@njit(fastmath=FASTMATH, cache=True)
def probs_tile(s, lse2, tanh_buf, geo, kv, full, read_bool):
    """``s = 2**(s - lse2[row])`` in place with every variant, exact zeros where hidden.

    ``geo`` as in :func:`.forward.softmax_tile`. ``lse2`` is the natural-log
    lse times ``log2(e)`` per stacked row; ``-inf`` rows (queries that saw no
    key) become all zeros. With softcap, ``tanh_buf`` (shaped like ``s``)
    receives ``tanh(s / cap)`` for the chain rule.
    """
    b, h0, br, i0, j0, tq, tk, kv_len = geo
    rows, bc = s.shape
    transform = needs_transform(kv)
    for r in range(rows):
        row = s[r]
        i = i0 + r % br
        lo, hi = 0, bc
        if not full:
            lo, hi = row_bounds(i, j0, j0 + bc, tq, tk, kv_len, kv)
        if tanh_buf.size > 0:  # outside [lo, hi) the chain factor must be finite
            tanh_buf[r, :lo] = 0.0
            tanh_buf[r, hi:] = 0.0
        if hi <= lo or lse2[r] == -np.inf:
            row[:] = 0.0
            if tanh_buf.size > 0:
                tanh_buf[r, :] = 0.0
            continue
        seg = row[lo:hi]
        if transform:
            tanh_row = tanh_buf[r, lo:hi] if tanh_buf.size > 0 else tanh_buf[0:0, 0]
            transform_row(seg, j0 + lo, i, tq, tk, b, h0 + r // br, kv, read_bool, tanh_row)
        exp2_shifted(seg, lse2[r], hi - lo)
        row[:lo] = 0.0
        row[hi:] = 0.0


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def backward_kernel(
    q, k, v, out, lse, dout, dq, dk, dv, seqs, items, scale, kv, block_q, block_k, gemm_fn
):
    """Write ``dq`` and per-part ``dk``, ``dv`` for C-contiguous 4-D arrays.

    Arrays, ``seqs``, ``kv`` and ``gemm_fn`` as in :func:`.forward.forward_kernel`;
    ``items (N, 3)`` are ``(sequence, kv head, part)``: with ``P`` parts
    (``dk``/``dv`` are ``(P, NB, Hkv, TK, d)``) part ``p`` takes the query
    blocks ``p, p + P, ...`` of the sequence, writes their ``dq`` rows and
    accumulates its share of the kv head's gradients into ``dk[p]``/``dv[p]``.
    No two items write the same memory; the caller sums the parts in a fixed
    order, so results stay bit-identical run to run. ``P > 1`` only when there
    are fewer ``(sequence, kv head)`` pairs than threads.
    """
    group = q.shape[1] // k.shape[1]
    d = q.shape[3]
    dvw = v.shape[3]
    dt = q.dtype.type
    q_mult = dt(scale * LOG2E)
    n_parts = dk.shape[0]
    for n in prange(items.shape[0]):
        sq, hk, part = items[n, 0], items[n, 1], items[n, 2]
        b, qs0, tq, ks0, tk, kv_len = seqs[sq]
        h0 = hk * group
        rows_max = group * min(block_q, tq)
        q_tile = np.empty((rows_max, d), dtype=q.dtype)  # scaled, for the scores
        q_raw = np.empty((rows_max, d), dtype=q.dtype)  # unscaled, for dK
        do_tile = np.empty((rows_max, dvw), dtype=q.dtype)
        dq_tile = np.empty((rows_max, d), dtype=q.dtype)
        lse2 = np.empty(rows_max, dtype=q.dtype)
        delta = np.empty(rows_max, dtype=q.dtype)
        p_buf = np.empty(rows_max * block_k, dtype=q.dtype)
        ds_buf = np.empty(rows_max * block_k, dtype=q.dtype)
        tanh_buf = np.empty(rows_max * block_k if kv.softcap > 0.0 else 0, dtype=q.dtype)
        dkh = dk[part, b, hk, ks0 : ks0 + tk]
        dvh = dv[part, b, hk, ks0 : ks0 + tk]
        dkh[:] = 0.0
        dvh[:] = 0.0
        blocks = np.empty((2, 3), dtype=np.int64)

        # Query blocks outer (the stacked q/dO tiles are gathered once each),
        # key blocks inner; dK/dV rows accumulate across query blocks. Every
        # dq row of a visited block is written (zeros if it sees no key).
        for i0 in range(part * block_q, tq, n_parts * block_q):
            br = min(block_q, tq - i0)
            rows = group * br
            qt, qr = q_tile[:rows], q_raw[:rows]
            dot, dqt = do_tile[:rows], dq_tile[:rows]
            load_q_tile(q, b, h0, group, qs0, i0, br, q_mult, qt)
            load_q_tile(q, b, h0, group, qs0, i0, br, dt(1.0), qr)
            load_q_tile(dout, b, h0, group, qs0, i0, br, dt(1.0), dot)
            dqt[:] = 0.0
            for r in range(rows):
                h = h0 + r // br
                i = qs0 + i0 + r % br
                lse2[r] = lse[b, h, i] * dt(LOG2E)
                acc = dt(0.0)
                for c in range(dvw):
                    acc += dout[b, h, i, c] * out[b, h, i, c]
                delta[r] = acc  # D_i = dO_i . O_i
            lo, hi = block_key_range(i0, i0 + br, tq, tk, kv.causal, kv.left, kv.right, kv_len)
            if kv.states.size > 0:
                lo = (lo // block_k) * block_k
            for j0 in range(lo, hi, block_k):
                j1 = min(j0 + block_k, hi)
                bc = j1 - j0
                state = tile_state(kv, b, h0, group, i0 // block_q, j0 // block_k)
                if state == 0:
                    continue
                kj = k[b, hk, ks0 + j0 : ks0 + j1]
                vj = v[b, hk, ks0 + j0 : ks0 + j1]
                # C-contiguous tiles: contiguous rows let LLVM vectorise.
                p = p_buf[: rows * bc].reshape((rows, bc))
                ds = ds_buf[: rows * bc].reshape((rows, bc))
                has_tanh = 1 if tanh_buf.size else 0
                tb = tanh_buf[: rows * bc * has_tanh].reshape((rows * has_tanh, bc))
                full = tile_fully_visible(
                    i0, i0 + br, j0, j1, tq, tk, kv.causal, kv.left, kv.right, kv_len
                )
                # Row blocks (r0, r1) x the first cw columns: one block, or two
                # across the diagonal, where the top half of the rows sees only
                # its first top_w keys and every product skips the rest.
                top, top_w = diagonal_split(group, br, full, i0, j0, j1, tq, tk, kv_len, kv)
                blocks[0, 0], blocks[0, 1], blocks[0, 2] = 0, top, top_w
                blocks[1, 0], blocks[1, 1], blocks[1, 2] = top, rows, bc
                for g in range(0 if top > 0 else 1, 2):
                    r0, r1, cw = blocks[g, 0], blocks[g, 1], blocks[g, 2]
                    if cw > 0:
                        gemm(gemm_fn, qt[r0:r1], kj[:cw], p[r0:r1, :cw], False, True, 0.0)
                geo = (b, h0, br, i0, j0, tq, tk, kv_len)
                probs_tile(p, lse2, tb, geo, kv, full, state == 1)
                for g in range(0 if top > 0 else 1, 2):
                    r0, r1, cw = blocks[g, 0], blocks[g, 1], blocks[g, 2]
                    if cw == 0:
                        continue
                    pg, dsg = p[r0:r1, :cw], ds[r0:r1, :cw]
                    dog = dot[r0:r1]
                    gemm(gemm_fn, pg, dog, dvh[j0 : j0 + cw], True, False, 1.0)  # dV_j += P^T dO_i
                    gemm(gemm_fn, dog, vj[:cw], dsg, False, True, 0.0)  # dP = dO_i V_j^T
                    # Rows of the C-contiguous tiles (unit stride known: vectorised).
                    for r in range(r0, r1):
                        p_row, ds_row, dr = p[r], ds[r], delta[r]
                        for c in range(cw):
                            ds_row[c] = p_row[c] * (ds_row[c] - dr)  # dS = P * (dP - D)
                        if tanh_buf.size:
                            t_row = tb[r]
                            for c in range(cw):
                                ds_row[c] *= 1.0 - t_row[c] * t_row[c]  # through softcap's tanh
                    gemm(gemm_fn, dsg, kj[:cw], dqt[r0:r1], False, False, 1.0)  # dQ_i += dS K_j
                    gemm(gemm_fn, dsg, qr[r0:r1], dkh[j0 : j0 + cw], True, False, 1.0)  # dK_j
            for r in range(rows):
                h = h0 + r // br
                i = qs0 + i0 + r % br
                for c in range(d):
                    dq[b, h, i, c] = dqt[r, c] * scale
        dkh *= dt(scale)

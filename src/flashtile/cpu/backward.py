"""Fused attention backward by recomputation (Numba).

One work item is one ``(sequence, kv head)``: it owns that kv head's ``dk``
and ``dv`` and the ``dq`` of its query heads (GQA groups stack as in the
forward), so items never write to the same memory (no races, no atomics) and
the order of every sum is fixed (bit-identical results run to run). For each
query block ``i`` and each key block ``j`` it can see::

    P    = 2**(scale*log2(e) * Q_i K_j^T - lse_i*log2(e))   recomputed, never stored
    dV_j += P^T dO_i            dP = dO_i V_j^T
    dS   = P * (dP - D_i)       dQ_i += scale * dS K_j     dK_j += scale * dS^T Q_i

with ``D = rowsum(dO * O)`` (softcap and a score function multiply ``dS`` by their derivative;
dropout regenerates the forward's mask, :func:`grad_rows`).
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

from ..masks import TILE_EMPTY, TILE_PARTIAL
from ..units import LOG2E
from . import FASTMATH, prange_only
from .blas import gemm, gemm_scaled
from .blas_threads import pin_blas, unpin_blas
from .bounds import past_limits
from .dropout import mark_rows
from .half import narrow, narrow_operand, prob_buffer, prob_tile, split_scale, widen
from .mod_calls import call_row, pointer
from .rowops import exp2_into, zero_outside
from .tile_step import score_product
from .tiles import (
    SEQ_K_START,
    SEQ_Q_START,
    KernelVariants,
    diagonal_split,
    load_q_tile,
    needs_transform,
    row_bounds,
    row_query,
    sequence_tile,
    tile_key_range,
    tile_sees_all,
    tile_state,
    transform_row,
)
from .vectors import wide_vectors


@njit(fastmath=FASTMATH, cache=True)
def probs_tile(s, p, lse2, sums, chain_buf, raw_buf, tile, j0, variants, full, read_bool):
    """``p = 2**(s - lse2[row])`` with every variant, exact zeros where hidden.

    ``p`` is ``s`` (in place) or, for bf16 operands, a ``uint16`` tile that
    receives ``P`` rounded to bf16 (:func:`.half.prob_tile`).

    ``s (rows, bc)`` holds the scores of the tile's rows (a
    :class:`.tiles.QueryTile`) against keys ``[j0, j0 + bc)``. ``lse2`` is
    the natural-log lse times ``log2(e)`` per stacked row; ``-inf`` rows
    (queries that saw no key) become all zeros. With softcap or a score
    function, ``chain_buf`` (shaped like ``s``) receives the derivative of
    the new scores by the raw ones (:func:`.tiles.transform_row`); with
    captured gradients ``raw_buf`` (shaped like ``s``) keeps the raw scores.
    Both are zero outside a row's visible columns. ``sums[r]`` gains the
    row's sum of ``P`` (:func:`flashtile.precision.failing_rows` reads the
    totals: a row whose ``P`` sum past 1 was recomputed from an ``lse``
    below its scores').
    """
    wide_vectors()
    rows, bc = s.shape
    transform = needs_transform(variants)
    for r in range(rows):  # indexed, not row views (see .tile_step.prepare_row)
        i, h = row_query(tile, r)
        lo, hi = 0, bc
        if not full:
            lo, hi = row_bounds(tile, i, j0, j0 + bc, variants)
        if hi <= lo or lse2[r] == -np.inf:
            lo, hi = 0, 0
        for extra in (chain_buf, raw_buf):  # outside [lo, hi) the factors must be finite
            if extra.size > 0:
                zero_outside(extra, r, lo, hi)
        if hi <= lo:
            zero_outside(p, r, 0, 0)
            continue
        if raw_buf.size > 0:
            raw_buf[r, lo:hi] = s[r, lo:hi]
        if transform:
            chain_row = chain_buf[r, lo:hi] if chain_buf.size > 0 else chain_buf[0:0, 0]
            transform_row(s[r, lo:hi], j0 + lo, tile, i, h, variants, read_bool, chain_row)
        sums[r] += exp2_into(s, p, r, lo, hi, lse2[r])
        zero_outside(p, r, lo, hi)


@njit(fastmath=FASTMATH, cache=True)
def row_terms(lse, out, dout, h0, i_first, br, lse2, delta, lse2_mult):
    """Per stacked row ``r`` (query ``i_first + r % br`` of head ``h0 + r //
    br`` in ``(H, T, ...)`` arrays): ``lse2 = lse * lse2_mult`` (``log2(e)``
    for a natural-log ``lse``, 1 for one in log2 units) and ``delta = D_i =
    dO_i . O_i``."""
    wide_vectors()
    for r in range(lse2.shape[0]):
        h = h0 + r // br
        i = i_first + r % br
        lse2[r] = lse[h, i] * lse2.dtype.type(lse2_mult)
        acc = lse2.dtype.type(0.0)
        for c in range(out.shape[2]):
            acc += widen(dout[h, i, c]) * widen(out[h, i, c])
        delta[r] = acc


@njit(fastmath=FASTMATH, cache=True, inline="always")
def chained(g, chain, row, c):
    """``g`` times the chain factor ``chain[row, c]`` (``g`` without one). A
    hidden entry (``g = 0``) stays 0 whatever its factor (a score function's
    derivative may be inf where a mask hides the score)."""
    if chain.size == 0:
        return g
    return g * chain[row, c] if g != 0.0 else g * 0.0


@njit(fastmath=FASTMATH, cache=True)
def captured_rows(p, dp, ds, chain, raw, mod_grad, delta, r0, r1, cw, tile, j0, variants):
    """:func:`grad_rows`' ``dS`` loop with captured gradients: per row, the
    gradient of the new scores into ``dp``, the row function
    ``variants.capture_fn`` adds the captured tables' share to ``mod_grad``,
    then ``dS`` through the chain factor (the slow path: one call per row)."""
    keep_scale, zero = dp.dtype.type(variants.drop_scale), dp.dtype.type(0.0)
    fp, ip = pointer(variants.mod_floats), pointer(variants.mod_ints)
    for r in range(r0, r1):
        row, dr = np.uintp(r), delta[r]
        for c in range(cw):
            x = widen(p[row, c])
            if variants.drop_threshold > 0:
                factor = keep_scale if x > zero else zero
                dp[row, c] = abs(x) * (dp[row, c] * factor - dr)
                p[row, c] = narrow(max(x, zero), p)
            else:
                dp[row, c] = x * (dp[row, c] - dr)
        i, h = row_query(tile, r)
        call_row(
            variants.capture_fn, raw[r:].ctypes.data, dp[r:].ctypes.data, cw, tile.b, h, i, j0,
            fp, ip, pointer(mod_grad),
        )  # fmt: skip
        for c in range(cw):
            ds[row, c] = narrow_operand(chained(dp[row, c], chain, row, c), ds)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def grad_rows(
    gemm_fn, p, dp, ds, chain, raw, mod_grad, do_tile, q_raw, k_tile, v_tile, dq_tile, dk_tile,
    dv_tile, delta, r0, r1, cw, tile, j0, variants,
):  # fmt: skip
    """The four gradient products of rows ``[r0, r1)`` over a tile's first ``cw`` keys.

    ``p`` holds the tile's probabilities, ``dp`` (float) receives ``dP``,
    ``ds`` receives ``dS``: ``dp`` itself, or for bf16 operands a ``uint16``
    tile where it is rounded (:func:`.half.prob_tile`); all C-contiguous
    ``(rows, bc)``. ``chain`` holds softcap's or a score function's
    derivative (or is empty): ``dS`` is the gradient of the raw scores.
    With captured gradients (:mod:`flashtile.mods`), ``raw`` holds the raw
    scores and the row function ``variants.capture_fn`` adds each row's
    contribution to ``mod_grad`` (the item's buffer) from the gradient of
    the new scores, before the chain factor.
    ``dk_tile``/``dv_tile`` are the gradient rows of the tile's keys, which
    are keys ``j0, j0 + 1, ...`` of the ``tile``'s sequence.

    With dropout (keep mask ``Z``, scale ``c = 1 / (1 - p)``) the output was
    ``(c Z * P) V``, so ``dV += c (Z * P)^T dO`` and ``dS = P * (c Z * dP -
    D)``: :func:`.dropout.mark_rows` negates the dropped entries of ``p``,
    the ``dS`` loop reads the mark and clears it.
    """
    pg, dsg = p[r0:r1, :cw], ds[r0:r1, :cw]
    dog = do_tile[r0:r1]
    gemm(gemm_fn, dog, v_tile[:cw], dp[r0:r1, :cw], False, True, 0.0)  # dP = dO_i V_j^T
    dropping = variants.drop_threshold > 0
    if dropping:
        mark_rows(p, r0, r1, cw, j0, tile, variants)
    keep_scale, zero = dp.dtype.type(variants.drop_scale), dp.dtype.type(0.0)
    if variants.capture_fn != 0:
        captured_rows(p, dp, ds, chain, raw, mod_grad, delta, r0, r1, cw, tile, j0, variants)
    else:
        # Rows of the C-contiguous tiles (unit stride known: vectorised).
        # Indexed, not row views: each view costs two atomic reference counts.
        for r in range(r0, r1):
            row, dr = np.uintp(r), delta[r]
            if dropping:  # dS = P * (c Z * dP - D); then P * Z for dV
                for c in range(cw):
                    x = widen(p[row, c])
                    factor = (
                        keep_scale if x > zero else zero
                    )  # (a multiply vectorises, a select not)
                    g = abs(x) * (dp[row, c] * factor - dr)
                    ds[row, c] = narrow_operand(chained(g, chain, row, c), ds)
                    p[row, c] = narrow(max(x, zero), p)
            elif (
                chain.size
            ):  # dS = P * (dP - D), through softcap's or a score function's derivative
                for c in range(cw):
                    g = widen(p[row, c]) * (dp[row, c] - dr)
                    ds[row, c] = narrow_operand(chained(g, chain, row, c), ds)
            else:
                for c in range(cw):
                    ds[row, c] = narrow_operand(widen(p[row, c]) * (dp[row, c] - dr), ds)
    # dV_j += c P^T dO_i (after the loop, which cleared dropout's marks)
    gemm_scaled(gemm_fn, pg, dog, dv_tile[:cw], True, False, keep_scale, 1.0)
    gemm(gemm_fn, dsg, k_tile[:cw], dq_tile[r0:r1], False, False, 1.0)  # dQ_i += dS K_j
    gemm(gemm_fn, dsg, q_raw[r0:r1], dk_tile[:cw], True, False, 1.0)  # dK_j += dS^T Q_i


@njit(fastmath=FASTMATH, cache=True, inline="always")
def tile_view(buf, rows, bc):
    """The C-contiguous ``(rows, bc)`` tile at the start of a flat buffer, or
    ``(0, bc)`` when the buffer is empty (its variant is off)."""
    on = 1 if buf.size else 0
    return buf[: rows * bc * on].reshape((rows * on, bc))


@njit(fastmath=FASTMATH, cache=True)
def grad_query_block(
    gemm_fn, q_tile, q_raw, do_tile, dq_tile, k_rows, v_rows, dk_rows, dv_rows, p_buf, ds_buf,
    chain_buf, raw_buf, mod_grad, half_bufs, s_mult, lse2, delta, sums, tile, group, variants,
    block_q, block_k,
):  # fmt: skip
    """Accumulate one query block's ``dq_tile`` and its share of ``dk_rows``
    and ``dv_rows`` (the sequence's rows of one kv head) over the key blocks
    its queries see. ``q_tile`` times ``s_mult`` is scaled by ``scale *
    log2(e)`` (:func:`.half.split_scale`), ``q_raw`` is not; ``*_buf`` are
    flat scratch of at least ``rows * block_k``; ``half_bufs`` two such
    ``uint16`` buffers for bf16 ``P`` and ``dS`` (:func:`.half.prob_buffer`),
    or empty (float ``P`` and ``dS`` in place); ``sums`` gains each row's
    sum of ``P`` (:func:`probs_tile`)."""
    wide_vectors()
    rows = q_tile.shape[0]
    lo, hi = tile_key_range(tile, variants)
    if variants.states.size > 0:  # block-map blocks start at multiples of block_k
        lo = (lo // block_k) * block_k
    for j0 in range(lo, hi, block_k):
        j1 = min(j0 + block_k, hi)
        bc = j1 - j0
        state = tile_state(variants, tile.b, tile.h0, group, tile.i0 // block_q, j0 // block_k)
        if state == TILE_EMPTY:
            continue
        k_tile, v_tile = k_rows[j0:j1], v_rows[j0:j1]
        # C-contiguous tiles: contiguous rows let LLVM vectorise.
        p = p_buf[: rows * bc].reshape((rows, bc))
        ds = ds_buf[: rows * bc].reshape((rows, bc))
        chain, raw = tile_view(chain_buf, rows, bc), tile_view(raw_buf, rows, bc)
        full = tile_sees_all(tile, j0, j1, variants)
        # Across the diagonal the top half of the rows sees only its first
        # top_w keys, and every product skips the rest.
        top, top_w = diagonal_split(tile, group, full, j0, j1, variants)
        score_product(gemm_fn, q_tile, k_tile, p, top, top_w, s_mult)
        p_out, ds_out = prob_tile(p, half_bufs[0]), prob_tile(ds, half_bufs[1])
        probs_tile(
            p, p_out, lse2, sums, chain, raw, tile, j0, variants, full, state == TILE_PARTIAL
        )
        dk_tile, dv_tile = dk_rows[j0:j1], dv_rows[j0:j1]
        if top > 0 and top_w > 0:
            grad_rows(
                gemm_fn, p_out, ds, ds_out, chain, raw, mod_grad, do_tile, q_raw, k_tile, v_tile,
                dq_tile,
                dk_tile, dv_tile, delta, 0, top, top_w, tile, j0, variants,
            )  # fmt: skip
        grad_rows(
            gemm_fn, p_out, ds, ds_out, chain, raw, mod_grad, do_tile, q_raw, k_tile, v_tile,
            dq_tile, dk_tile,
            dv_tile, delta, top, rows, bc, tile, j0, variants,
        )  # fmt: skip


@njit(fastmath=FASTMATH, cache=True)
def store_rows(src, dst, h0, i_first, br, mult):
    """``dst[h0 + r // br, i_first + r % br] = src[r] * mult`` for every stacked
    row (rounded to bf16 when ``dst`` holds bf16 bits)."""
    wide_vectors()
    for r in range(src.shape[0]):
        h = h0 + r // br
        i = i_first + r % br
        for c in range(src.shape[1]):
            dst[h, i, c] = narrow(src[r, c] * mult, dst)


# Inlined into backward_call, which compiles it with its own flags (the same
# fastmath; cpu.prange_only): these apply only where it is called on its own.
@njit(parallel=True, fastmath=FASTMATH, cache=True, inline="always")
def backward_kernel(
    q, k, v, out, lse, dout, dq, dk, dv, sums, seqs, items, scale, variant_fields, block_q,
    block_k, lse2_mult, gemm_fn,
):  # fmt: skip
    """Write ``dq``, per-part ``dk``, ``dv`` and the rows' sums of ``P``
    (``sums (NB, Hq, TQ, 1)``, :func:`probs_tile`) for C-contiguous 4-D arrays.

    Arrays, ``seqs`` and ``gemm_fn`` as in :func:`.forward.forward_kernel`,
    the variants as a plain tuple (``tuple(variants)``); ``items (N, 3)`` are ``(sequence, kv
    head, part)``: with ``P`` parts (``dk``/``dv`` are ``(P, NB, Hkv, TK,
    d)``) part ``p`` takes the query blocks ``p, p + P, ...`` of the
    sequence, writes their ``dq`` rows and accumulates its share of the kv
    head's gradients into ``dk[p]``/``dv[p]``. No two items write the same
    memory; the caller sums the parts in a fixed order, so results stay
    bit-identical run to run. ``P > 1`` only when there are fewer
    ``(sequence, kv head)`` pairs than threads. ``lse2_mult``: ``log2(e)``
    for a natural-log ``lse``, 1 for log2 units (:func:`row_terms`). The
    BLAS is pinned by the caller (:func:`backward_call`).
    """
    variants = KernelVariants(*variant_fields)
    group = q.shape[1] // k.shape[1]
    d, dvw = q.shape[3], v.shape[3]
    work = lse.dtype  # float32 for bf16 operands (dk/dv accumulate in it too)
    dt = work.type
    q_mult, s_mult = split_scale(q, lse, scale * LOG2E)
    n_parts = dk.shape[0]
    for n in prange(items.shape[0]):
        wide_vectors()  # the prange body is a function of its own
        sq, hk, part = items[n, 0], items[n, 1], items[n, 2]
        tile = sequence_tile(seqs, sq, hk * group, 0, block_q)
        b, tq, tk = tile.b, tile.tq, tile.tk
        qs0, ks0 = seqs[sq, SEQ_Q_START], seqs[sq, SEQ_K_START]
        rows_max = group * tile.br  # the first block is the longest
        q_tile = np.empty((rows_max, d), dtype=q.dtype)  # scaled, for the scores
        q_raw = np.empty((rows_max, d), dtype=q.dtype)  # unscaled, for dK
        do_tile = np.empty((rows_max, dvw), dtype=q.dtype)
        dq_tile = np.empty((rows_max, d), dtype=work)
        lse2 = np.empty(rows_max, dtype=work)
        delta = np.empty(rows_max, dtype=work)
        row_sums = np.empty((rows_max, 1), dtype=work)
        p_buf = np.empty(rows_max * block_k, dtype=work)
        ds_buf = np.empty(rows_max * block_k, dtype=work)
        n_probs = rows_max * block_k
        half_bufs = (prob_buffer(q, n_probs, p_buf), prob_buffer(q, n_probs, ds_buf))
        chained_scores = variants.softcap > 0.0 or variants.score_fn != 0
        chain_buf = np.empty(rows_max * block_k if chained_scores else 0, dtype=work)
        raw_buf = np.empty(rows_max * block_k if variants.capture_fn != 0 else 0, dtype=work)
        grads = variants.mod_grads
        mod_grad = grads[n] if grads.shape[0] > 0 else grads.ravel()
        k_rows, v_rows = k[b, hk, ks0 : ks0 + tk], v[b, hk, ks0 : ks0 + tk]
        dk_rows, dv_rows = dk[part, b, hk, ks0 : ks0 + tk], dv[part, b, hk, ks0 : ks0 + tk]
        dk_rows[:] = 0.0
        dv_rows[:] = 0.0
        # Query blocks outer (the stacked q/dO tiles are gathered once each),
        # key blocks inner; dK/dV rows accumulate across query blocks. Every
        # dq row of a visited block is written (zeros if it sees no key).
        for i0 in range(part * block_q, tq, n_parts * block_q):
            tile = sequence_tile(seqs, sq, hk * group, i0, block_q)
            rows = group * tile.br
            qt, qr = q_tile[:rows], q_raw[:rows]
            dot, dqt = do_tile[:rows], dq_tile[:rows]
            load_q_tile(q, tile, group, qs0, q_mult, qt)
            load_q_tile(q, tile, group, qs0, dt(1.0), qr)
            load_q_tile(dout, tile, group, qs0, dt(1.0), dot)
            row_terms(
                lse[b], out[b], dout[b], tile.h0, qs0 + i0, tile.br, lse2[:rows], delta[:rows],
                lse2_mult,
            )  # fmt: skip
            dqt[:] = 0.0
            row_sums[:rows] = 0.0
            grad_query_block(
                gemm_fn, qt, qr, dot, dqt, k_rows, v_rows, dk_rows, dv_rows, p_buf, ds_buf,
                chain_buf, raw_buf, mod_grad, half_bufs, s_mult, lse2[:rows], delta[:rows],
                row_sums[:rows, 0], tile, group, variants, block_q, block_k,
            )  # fmt: skip
            store_rows(dqt, dq[b], tile.h0, qs0 + i0, tile.br, scale)
            store_rows(row_sums[:rows], sums[b], tile.h0, qs0 + i0, tile.br, dt(1.0))
        dk_rows *= dt(scale)


@njit(fastmath=FASTMATH, cache=True, parallel=prange_only())
def backward_call(
    q, k, v, out, lse, dout, dq, dk, dv, seqs, items, scale, variant_fields, block_q, block_k,
    lse2_mult, score_limit, products_limit, gemm_fn, blas_threads,
):  # fmt: skip
    """:func:`backward_kernel` with the parts' ``dk``/``dv`` summed into the
    first (in order: deterministic) and the rows' sums allocated here;
    returns ``(sums (NB, Hq, TQ, 1), fits)``. Arguments as there: ``dq``
    (shaped like ``q``) and the parts' ``dk``, ``dv`` (``(P, NB, Hkv, TK, d /
    dv)``, zeros) come from the caller, NumPy's: allocated here, beside a
    training step's torch tensors, their pages were faulted in afresh on
    every call (some 400 faults at T=256, 40% of the backward's time).
    ``blas_threads``: the BLAS pinned meanwhile (:mod:`.blas_threads`), the
    first step (before anything that may raise, see ``launch._call``).

    ``score_limit``, ``products_limit``: as in
    :func:`.forward.forward_call`: a call past either limit
    (:func:`.bounds.past_limits`) computes nothing and returns ``fits``
    False (a prepared call's values checked here; the caller plans it
    again).

    ``backward_kernel`` is inlined here (:func:`flashtile.cpu.prange_only`: one
    level less for Numba to optimise again).
    """
    pin_blas(blas_threads)
    sums = np.zeros(q.shape[:3] + (1,), dtype=lse.dtype)
    fits = not past_limits(q, k, scale, score_limit, products_limit)
    if fits and q.size > 0:  # (no heads or batch: nothing to compute; the kernel divides by H)
        backward_kernel(
            q, k, v, out, lse, dout, dq, dk, dv, sums, seqs, items, scale, variant_fields,
            block_q, block_k, lse2_mult, gemm_fn,
        )  # fmt: skip
        dk_sum, dv_sum = dk[0], dv[0]
        for p in range(1, dk.shape[0]):  # a fixed order: deterministic sums
            dk_sum += dk[p]
            dv_sum += dv[p]
    unpin_blas(blas_threads)  # last: nothing after it may raise (see launch._call)
    return sums, fits

"""Fused multi-threaded attention forward (Numba).

One work item is one ``(sequence, kv head, query block)``: the block's
queries of every query head that reads that kv head, stacked into one tile
(:mod:`.tiles`), so each K/V tile is loaded once per group. The items run in
a ``prange`` in the order :mod:`flashtile.planning` gives. An item walks the
key blocks its queries can see and folds each into its rows' running state
with the tile step (:func:`.tile_step.fold_key_tile`), then normalises once
(:func:`.tile_step.finish_rows`).

Two walks: along the causal/window band (:func:`walk_band`), where only
tiles that cross the band's edges pay for per-row limits, and, with a block
map, over the kept blocks gathered into wide tiles (:func:`walk_gathered`).
Key blocks outside the band (or empty in a block mask) are never visited;
hidden entries are written as exact zeros.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..masks import TILE_EMPTY, TILE_FULL
from ..units import LOG2E
from . import FASTMATH, prange_only
from .blas_threads import pin_blas, unpin_blas
from .bounds import past_limits
from .half import prob_buffer, split_scale
from .tile_step import finish_rows, fold_key_tile, item_buffers, one_segment
from .tiles import (
    SEG_COLUMNS,
    SEG_KEY,
    SEG_LENGTH,
    SEG_OFFSET,
    SEG_STATE,
    SEQ_K_START,
    SEQ_Q_START,
    KernelVariants,
    diagonal_split,
    load_q_tile,
    sequence_tile,
    tile_key_range,
    tile_sees_all,
    tile_state,
)
from .vectors import wide_vectors

#: With a block map, kept key blocks are gathered into tiles of up to this
#: many keys, so a sparse mask still runs wide, efficient tile products.
GATHER_KEYS = 512


@njit(fastmath=FASTMATH, cache=True)
def walk_band(
    gemm_fn, q_tile, k_rows, v_rows, s_buf, p_buf, s_mult, m, ell, alpha, acc, tile, group, va, bk
):
    """Fold key blocks ``[lo, lo + bk), ...`` of the tile's band into its state.

    ``q_tile``, ``m``, ``ell``, ``alpha``, ``acc``: the rows and their state
    (:func:`.tile_step.fold_key_tile`, also for ``p_buf`` and ``s_mult``);
    ``k_rows``/``v_rows``: the sequence's keys and values of one kv head (row
    ``j`` = key ``j``); ``s_buf``: a flat score buffer of at least ``rows *
    bk``; ``tile``: a
    :class:`.tiles.QueryTile` of ``group`` stacked heads; ``va``: the
    :class:`.tiles.KernelVariants`. Returns the number of key blocks computed.
    """
    wide_vectors()
    rows = q_tile.shape[0]
    segs = one_segment()
    no_flag = np.zeros(0, dtype=np.uint8)  # the range was checked before the call
    lo, hi = tile_key_range(tile, va)
    n_tiles = max(-(-(hi - lo) // bk), 0)
    # Right to left: the keys nearest the query first. Where scores fall
    # with distance (ALiBi, a relative bias) the first tile then sets the
    # reference of the online softmax at the row's max, and later tiles
    # never raise it; left to right, every tile raised it (a row recomputed
    # per tile: with ALiBi 2.3-4.4x the time of plain causal attention, now
    # 1.26x; flashtile bench --preset flex).
    for t in range(n_tiles):
        j0 = lo + (n_tiles - 1 - t) * bk
        j1 = min(j0 + bk, hi)
        j2 = max(j0 - bk, lo)  # the next tile, prefetched while this one is finished
        # A C-contiguous (rows, bc) view: contiguous rows let LLVM vectorise.
        s = s_buf[: rows * (j1 - j0)].reshape((rows, j1 - j0))
        full = tile_sees_all(tile, j0, j1, va)
        # Across the diagonal the top rows skip the keys they cannot see in
        # both products (a tenth of the work at T=1024).
        top, top_w = diagonal_split(tile, group, full, j0, j1, va)
        segs[0, SEG_KEY], segs[0, SEG_LENGTH] = j0, j1 - j0
        k_tile, v_tile = k_rows[j0:j1], v_rows[j0:j1]
        k_next, v_next = k_rows[j2:j0], v_rows[j2:j0]
        fold_key_tile(
            gemm_fn, q_tile, k_tile, v_tile, s, m, ell, alpha, acc, segs, tile, va, full, top,
            top_w, k_next, v_next, p_buf, s_mult, no_flag,
        )  # fmt: skip
    return n_tiles


@njit(fastmath=FASTMATH, cache=True)
def kept_blocks(tile, group, va, block_q, bk):
    """``(n, SEG_COLUMNS)`` segments: the block map's kept key blocks in the
    tile's band, cut to the band (``SEG_OFFSET`` is set when gathering)."""
    lo, hi = tile_key_range(tile, va)
    kb_lo, kb_hi = lo // bk, (hi + bk - 1) // bk
    kept = np.empty((kb_hi - kb_lo, SEG_COLUMNS), dtype=np.int64)
    n = 0
    for kb in range(kb_lo, kb_hi):
        state = tile_state(va, tile.b, tile.h0, group, tile.i0 // block_q, kb)
        if state != TILE_EMPTY:
            j0 = max(kb * bk, lo)
            kept[n, SEG_KEY] = j0
            kept[n, SEG_LENGTH] = min(kb * bk + bk, hi) - j0
            kept[n, SEG_STATE] = state
            n += 1
    return kept[:n]


@njit(fastmath=FASTMATH, cache=True)
def walk_gathered(
    gemm_fn, q_tile, k_rows, v_rows, s_buf, p_buf, s_mult, m, ell, alpha, acc, tile, group, va,
    block_q, bk,
):  # fmt: skip
    """Fold the kept key blocks of a block map, up to GATHER_KEYS keys per
    tile: read in place where they follow each other in the keys, else
    gathered into scratch tiles (arguments as in :func:`walk_band`).
    Returns the number of key blocks computed."""
    wide_vectors()
    rows = q_tile.shape[0]
    no_flag = np.zeros(0, dtype=np.uint8)  # the range was checked before the call
    kept = kept_blocks(tile, group, va, block_q, bk)
    n_kept = kept.shape[0]
    per_tile = max(1, GATHER_KEYS // bk)
    k_buf = np.empty((per_tile * bk, k_rows.shape[1]), dtype=q_tile.dtype)
    v_buf = np.empty((per_tile * bk, v_rows.shape[1]), dtype=q_tile.dtype)
    n_groups = -(-n_kept // per_tile)
    for t in range(n_groups):  # right to left, as walk_band
        g0 = (n_groups - 1 - t) * per_tile
        segs = kept[g0 : min(g0 + per_tile, n_kept)]
        width = 0
        full = True  # every row sees every gathered column
        first = segs[0, SEG_KEY]
        for g in range(segs.shape[0]):
            j0, nk = segs[g, SEG_KEY], segs[g, SEG_LENGTH]
            segs[g, SEG_OFFSET] = width
            width += nk
            full = full and segs[g, SEG_STATE] == TILE_FULL and tile_sees_all(tile, j0, j0 + nk, va)
        # Kept blocks that follow each other in the keys are read in place
        # (a causal or banded map keeps runs of them); others are gathered.
        adjacent = segs[-1, SEG_KEY] + segs[-1, SEG_LENGTH] - first == width
        k_tile, v_tile = k_rows[first : first + width], v_rows[first : first + width]
        if not adjacent:
            for g in range(segs.shape[0]):
                off, j0, nk = segs[g, SEG_OFFSET], segs[g, SEG_KEY], segs[g, SEG_LENGTH]
                k_buf[off : off + nk] = k_rows[j0 : j0 + nk]
                v_buf[off : off + nk] = v_rows[j0 : j0 + nk]
            k_tile, v_tile = k_buf[:width], v_buf[:width]
        s = s_buf[: rows * width].reshape((rows, width))
        fold_key_tile(
            gemm_fn, q_tile, k_tile, v_tile, s, m, ell, alpha, acc, segs, tile, va, full, 0, 0,
            k_buf[:0], v_buf[:0], p_buf, s_mult, no_flag,
        )  # fmt: skip
    return n_kept


# Inlined into forward_call, which compiles it with its own flags (the same
# fastmath; cpu.prange_only): these apply only where it is called on its own.
@njit(parallel=True, fastmath=FASTMATH, cache=True, inline="always")
def forward_kernel(
    q, k, v, out, lse, visited, seqs, items, scale, variants, block_q, block_k, lse_mult, gemm_fn
):
    """``out``/``lse`` of attention for C-contiguous 4-D arrays.

    Args:
        q: ``(NB, Hq, TQ, d)``; k, v: ``(NB, Hkv, TK, d / dv)``: float32,
            float64, or bf16 bits (``uint16``, :mod:`.half`).
        out: ``(NB, Hq, TQ, dv)`` in the dtype of ``q``, lse: ``(NB, Hq, TQ)``
            (natural log) in the work dtype (float32 for bf16), written.
        visited: ``(N,)`` int64, written: key blocks computed per item (tests
            use it to check what was skipped).
        seqs: ``(S, SEQ_COLUMNS)`` int64 sequence table (:mod:`.tiles`).
        items: ``(N, 3)`` int64 rows ``(sequence, kv head, i0)``, in the
            order the threads should take them.
        variants: :class:`.tiles.KernelVariants`. gemm_fn: the ``address`` of
            :func:`.blas.gemm_for` for the dtype.
        lse_mult: ``ln 2`` (``lse`` in natural log), or 1 (log2 units, the
            backward's own: :func:`.tile_step.finish_rows`).
    """
    group = q.shape[1] // k.shape[1]
    work = lse.dtype  # the state's dtype: float32 for bf16 operands
    q_mult, s_mult = split_scale(q, lse, scale * LOG2E)
    gathered = variants.states.size > 0
    # Gathered tiles (block map) can hold several key blocks.
    width = block_k * (max(1, GATHER_KEYS // block_k) if gathered else 1)
    for n in prange(items.shape[0]):
        wide_vectors()  # the prange body is a function of its own
        sq, hk, i0 = items[n, 0], items[n, 1], items[n, 2]
        tile = sequence_tile(seqs, sq, hk * group, i0, block_q)
        b, qs0, ks0 = tile.b, seqs[sq, SEQ_Q_START], seqs[sq, SEQ_K_START]
        rows = group * tile.br
        q_tile = np.empty((rows, q.shape[3]), dtype=q.dtype)
        load_q_tile(q, tile, group, qs0, q_mult, q_tile)
        # The item's float buffers in one allocation (each costs a malloc and
        # a free: 15% of a tiny call's kernel samples as separate arrays).
        acc, m, ell, alpha, s_buf = item_buffers(rows, v.shape[3], rows * width, work)
        p_buf = prob_buffer(q, rows * width, s_buf)  # bf16: P rounded for the value product
        k_rows, v_rows = k[b, hk, ks0 : ks0 + tile.tk], v[b, hk, ks0 : ks0 + tile.tk]
        if gathered:
            visited[n] = walk_gathered(
                gemm_fn, q_tile, k_rows, v_rows, s_buf, p_buf, s_mult, m, ell, alpha, acc, tile,
                group, variants, block_q, block_k,
            )  # fmt: skip
        else:
            visited[n] = walk_band(
                gemm_fn, q_tile, k_rows, v_rows, s_buf, p_buf, s_mult, m, ell, alpha, acc, tile,
                group, variants, block_k,
            )  # fmt: skip
        finish_rows(
            acc, m, ell, out[b], lse[b], tile.h0, qs0 + i0, tile.br, variants.drop_scale, lse_mult
        )


@njit(fastmath=FASTMATH, cache=True, parallel=prange_only())
def forward_call(
    q, k, v, lse, seqs, items, scale, variant_fields, block_q, block_k, lse_mult, score_limit,
    products_limit, gemm_fn, blas_threads,
):  # fmt: skip
    """:func:`forward_kernel` into ``lse`` (allocated by the caller, in the
    work dtype) with ``out`` and ``visited`` allocated here; returns ``(out,
    visited, fits)``. Arguments as there; ``variant_fields``: a
    :class:`.tiles.KernelVariants` as a plain tuple (``tuple(variants)``);
    ``blas_threads``: the BLAS pinned meanwhile (:mod:`.blas_threads`).
    With no query heads or batch (``q.size == 0``) nothing is computed (the
    kernel divides by the head count). One compiled call: inside a model's
    loop, each allocation from Python costs close to a microsecond.

    ``score_limit``, ``products_limit``: in log2 units, inf to check
    nothing (two floats: a tuple argument costs the dispatcher 0.4 us). A
    call whose bounds reach either limit (:func:`.bounds.past_limits`)
    computes nothing and returns ``fits`` False: a prepared call checks its
    values here, and is planned again for them (float64).

    ``forward_kernel`` is inlined here (:func:`flashtile.cpu.prange_only`: one
    level less for Numba to optimise again).
    """
    pin_blas(blas_threads)  # first: before anything that may raise (see launch._call)
    out = np.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    visited = np.empty(items.shape[0], dtype=np.int64)
    fits = not past_limits(q, k, scale, score_limit, products_limit)
    if fits and q.size > 0:
        forward_kernel(
            q, k, v, out, lse, visited, seqs, items, scale, KernelVariants(*variant_fields),
            block_q, block_k, lse_mult, gemm_fn,
        )  # fmt: skip
    unpin_blas(blas_threads)  # last: nothing after it may raise
    return out, visited, fits

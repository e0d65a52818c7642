"""Decoding tiles read from cache pages in place: no gather, no BLAS.

Two of the decode kernel's walks (:mod:`.decode`; which one runs is a route
measured on the machine, :func:`flashtile.workitems.decode_walk`):

- :class:`RowWalk`: one kv head's items read each key's row where it lies,
  in the cache's own format (float32 as is; bf16 and float16 patterns
  widened in registers, :func:`.memory.load_value`): the dot products of
  each key with the query rows, the value rows added into the accumulator
  rows, in passes that load each element once for several products
  (:data:`.row_passes.ROWS_PER_PASS`; four rows at a time against two keys in LLVM IR
  where the head dim is a multiple of 8, :mod:`.quad_passes`), each key
  prefetching the row :data:`.row_passes.AHEAD` keys on (pages are separate streams
  the hardware prefetcher does not follow);
- :class:`HeadRowsWalk`: an item takes every kv head of its key chunk and
  reads the rows of all heads in the cache's memory order, with this
  module's passes (:mod:`.cache_heads`, which also dispatches the two).

The online softmax in between is the forward's own
(:func:`.tile_step.softmax_tile`). Measured: with one query row in 16-key
pages (12 heads, d 64, Tk=32768, float32; Emerald Rapids Xeon, 2 cores)
the row walk took 0.74-0.91x the gather path's time, while contiguous
caches and several rows stayed faster on BLAS there (1.0-1.35x); on an AVX2
AMD EPYC the row walk beat BLAS tiles by 2-3x for GQA rows and d 128, and
lost 2x at d 64 against 2048 keys (docs/decoding.md). float64 work (float64
caches and the float32 range fallback) takes the tiles of the same items.

The passes both walks read with are :mod:`.row_passes`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit
from numba.extending import overload

from . import FASTMATH
from .memory import is_flag, unmanaged
from .quad_passes import QUAD, has_quads
from .row_passes import (
    AHEAD,
    ScorePass,
    dot_rows4,
    far_gap,
    key_scores,
    page_run,
    page_values_run,
    prefetch_row,
    quad_run,
)
from .tile_step import KeptScores, flag_non_finite, rescale_rows, softmax_tile
from .tiles import SEG_KEY, SEG_LENGTH, QueryTile, tile_sees_all
from .vectors import wide_vectors


class TileWalk(NamedTuple):
    """Walk flag: a decode call's items fold BLAS tiles of one kv head (:mod:`.decode`)."""


class RowWalk(NamedTuple):
    """Walk flag: a decode call's items read their rows in place (this module)."""


class HeadTilesWalk(NamedTuple):
    """Walk flag: a decode call's items take every kv head of their key chunk
    and gather each tile's rows of all heads at once for BLAS (:mod:`.decode`)."""


class HeadRowsWalk(NamedTuple):
    """Walk flag: a decode call's items take every kv head of their key chunk
    and read the rows of all heads in place, in memory order (:mod:`.cache_heads`)."""


#: The flag of each of :func:`flashtile.workitems.decode_walk`'s walks.
_WALKS = {
    "tiles": TileWalk(), "tiles-stream": TileWalk(), "rows": RowWalk(),
    "head-tiles": HeadTilesWalk(), "head-rows": HeadRowsWalk(),
}  # fmt: skip


def walk_flag(walk: str) -> TileWalk | RowWalk | HeadTilesWalk | HeadRowsWalk:
    """The decode kernel's walk flag for a plan's ``walk`` (the routing rule
    is :func:`flashtile.workitems.decode_walk`'s). The flag is a type of its
    own, so the kernels of other calls do not compile the other walks."""
    return _WALKS[walk]


def walk_prefetches(walk: str) -> bool:
    """Whether items of several rows that fold tiles read in place prefetch
    each next tile in software (the decode kernel's runtime flag ``ahead``):
    every walk but ``"tiles-stream"``, which leaves the stream to the
    hardware prefetcher (the route measures which is faster,
    :mod:`flashtile.routes`)."""
    return walk != "tiles-stream"


def reads_rows(walk) -> bool:
    """Whether ``walk`` reads rows in place (:class:`RowWalk`,
    :class:`HeadRowsWalk`), a constant in compiled code. Only callable from
    compiled code."""
    raise NotImplementedError("reads_rows is only available inside Numba kernels")


@overload(reads_rows, inline="always")
def _reads_rows(walk):
    if is_flag(walk, RowWalk) or is_flag(walk, HeadRowsWalk):
        return lambda walk: True
    return lambda walk: False


def walk_heads(walk, kv_heads):
    """The kv heads one item takes: ``kv_heads`` with :class:`HeadTilesWalk`
    and :class:`HeadRowsWalk`, else 1 (a constant in compiled code). Only
    callable from compiled code."""
    raise NotImplementedError("walk_heads is only available inside Numba kernels")


@overload(walk_heads, inline="always")
def _walk_heads(walk, kv_heads):
    if is_flag(walk, HeadTilesWalk) or is_flag(walk, HeadRowsWalk):
        return lambda walk, kv_heads: kv_heads
    return lambda walk, kv_heads: 1


@njit(fastmath=FASTMATH, cache=True, inline="always")
def head_tile(b, hk, group, tq, length):
    """The :class:`.tiles.QueryTile` of kv head ``hk``'s group of sequence
    ``b`` in decoding: every query of the sequence (``i0 = 0``, ``br =
    Tq``), the last at position ``length - 1``."""
    return QueryTile(b, hk * group, tq, 0, tq, length, length, 0, 0)


@njit(fastmath=FASTMATH, cache=True)
def cache_scores(q_tile, flat, fmt, table_row, heads, hk, page, j0, n, s, j_end):
    """``s[r, t] = q_tile[r] . key_{j0 + t}`` for ``t < n``: the keys' rows read
    from the flat cache ``flat`` (format flag ``fmt``), one page's run at a
    time: key by key (:func:`.row_passes.key_scores`), for one query row four
    keys per pass (:func:`.row_passes.dot_rows4`: two pairs of neighbours,
    far apart in a long run, :func:`.row_passes.far_gap`), and for four rows
    or more in the IR passes (:func:`.row_passes.quad_run`, where they
    exist). ``q_tile (rows, d)``, ``s (rows, >= n)``, both in the work
    dtype. Each key prefetches the row :data:`.row_passes.AHEAD` keys on,
    below ``j_end``."""
    wide_vectors()
    q_tile, s = unmanaged(q_tile), unmanaged(s)  # (see .memory.unmanaged)
    flat, table_row = unmanaged(flat), unmanaged(table_row)
    rows, d = q_tile.shape
    width = np.uint64(d)
    t = 0
    while t < n:
        j = j0 + t
        run, base = page_run(table_row, heads, hk, page, d, j, n - t)
        u = top = 0
        if rows == 1:  # one row: nothing to share a key's elements with
            g = far_gap(run)  # keys k, k + 1, k + g, k + g + 1 per pass, blocks of 2g
            u = run - run % (2 * g)
            for k in range(0, u, 2 * g):
                for i in range(k, k + g, 2):
                    for a in (i, i + 1, i + g, i + g + 1):
                        prefetch_row(flat, table_row, heads, hk, page, d, j + a + AHEAD, j_end)
                    o0 = base + np.uint64(i) * width
                    o2 = o0 + np.uint64(g) * width
                    x = dot_rows4(q_tile, 0, flat, o0, o0 + width, o2, o2 + width, width, fmt)
                    s[0, t + i], s[0, t + i + 1], s[0, t + i + g], s[0, t + i + g + 1] = x
        elif rows >= QUAD and has_quads(q_tile, s, flat, fmt, d):
            top = rows - rows % QUAD  # four rows at a time (.quad_passes), the rest below
            ahead = (table_row, heads, hk, page, d, j, j_end)
            quad_run(q_tile, s, ScorePass(), 0, top, t, run, flat, fmt, base, d, page, ahead)
            if top == rows:
                u = run
        for i in range(u, run):
            if top == 0:  # (else the quad passes' loop prefetched the run)
                prefetch_row(flat, table_row, heads, hk, page, d, j + i + AHEAD, j_end)
            key_scores(q_tile, top, rows, flat, base + np.uint64(i) * width, width, fmt, s, t + i)
        t += run


@njit(fastmath=FASTMATH, cache=True)
def cache_values(p, flat, fmt, table_row, heads, hk, page, j0, n, acc, j_end):
    """``acc += p[:, :n] @ V`` for the value rows of keys ``j0 .. j0 + n - 1``
    read from the flat cache ``flat`` (format ``fmt``), one page's run at a
    time (:func:`page_values_run`) over ``acc (rows, dv)``; prefetching as
    :func:`cache_scores`."""
    wide_vectors()
    p, acc = unmanaged(p), unmanaged(acc)  # (see .memory.unmanaged)
    flat, table_row = unmanaged(flat), unmanaged(table_row)
    rows, dv = acc.shape
    width, t = np.uint64(dv), 0
    while t < n:
        j = j0 + t
        run, base = page_run(table_row, heads, hk, page, dv, j, n - t)
        ahead = (table_row, heads, hk, page, dv, j, j_end)
        page_values_run(acc, p, 0, rows, t, run, flat, base, width, fmt, page, ahead)
        t += run


@njit(fastmath=FASTMATH, cache=True, inline="always")
def fold_cache_tile(
    q_tile, k_flat, v_flat, fmt, table_row, heads, hk, page, j0, j1, s, raw, m, ell, alpha, acc,
    segs, tile, variants, full, raw_flag, j_end,
):  # fmt: skip
    """Fold keys ``[j0, j1)`` of one sequence and kv head into the rows' state
    ``(m, ell, acc)``: :func:`.tile_step.fold_key_tile` for rows read in
    place. ``s``, ``raw``: two ``(rows, j1 - j0)`` float tiles, the second a
    copy of the raw scores for a rare rebase (there is no key tile to
    recompute them from); ``k_flat``/``v_flat``: the flat caches of
    ``heads`` kv heads in pages of ``page`` keys; the rest as there."""
    n = j1 - j0
    cache_scores(q_tile, k_flat, fmt, table_row, heads, hk, page, j0, n, s, j_end)
    if raw_flag.size > 0:
        flag_non_finite(s, raw_flag)
    raw[:] = s
    softmax_tile(
        s, s, m, ell, alpha, q_tile, KeptScores(raw), 1.0, segs, tile, variants, full, raw_flag
    )
    rescale_rows(acc, alpha)
    cache_values(s, v_flat, fmt, table_row, heads, hk, page, j0, n, acc, j_end)


@njit(fastmath=FASTMATH, cache=True)
def walk_cache_rows(
    lo, hi, q_tile, k_flat, v_flat, fmt, table_row, heads, hk, page, tile_keys, s_buf, m, ell,
    alpha, acc, segs, tile, variants, raw_flag,
):  # fmt: skip
    """Fold keys ``[lo, hi)`` into the rows' state, ``tile_keys`` at a time
    (:func:`fold_cache_tile`). ``s_buf``: at least ``2 * rows * tile_keys``
    floats (the scores, then their kept copy); ``segs``: the one-segment
    table the tile step reads; the rest as there."""
    wide_vectors()
    rows = q_tile.shape[0]
    kept = rows * tile_keys
    j0 = lo
    while j0 < hi:
        j1 = min(j0 + tile_keys, hi)
        n = j1 - j0
        segs[0, SEG_KEY], segs[0, SEG_LENGTH] = j0, n
        fold_cache_tile(
            q_tile, k_flat, v_flat, fmt, table_row, heads, hk, page, j0, j1,
            s_buf[: rows * n].reshape((rows, n)), s_buf[kept : kept + rows * n].reshape((rows, n)),
            m, ell, alpha, acc, segs, tile, variants, tile_sees_all(tile, j0, j1, variants),
            raw_flag, hi,
        )  # fmt: skip
        j0 = j1

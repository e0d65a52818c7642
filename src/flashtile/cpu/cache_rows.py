"""Decoding tiles read from cache pages in place: no gather, no BLAS.

Two of the decode kernel's walks (:mod:`.decode`; which one runs is a route
measured on the machine, :func:`flashtile.workitems.decode_walk`):

- :class:`RowWalk`: one kv head's items read each key's row where it lies,
  in the cache's own format (float32 as is; bf16 and float16 patterns
  widened in registers, :func:`.memory.load_value`): the dot products of
  each key with the query rows, the value rows added into the accumulator
  rows, in passes that load each element once for several products
  (:data:`ROWS_PER_PASS`; four rows at a time against two keys in LLVM IR
  where the head dim is a multiple of 8, :mod:`.quad_passes`), each key
  prefetching the row :data:`AHEAD` keys on (pages are separate streams
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

Rows are addressed through the flat cache (``reshape(-1)`` of the C-contiguous
``(blocks, Hkv, P, width)`` array) by an unsigned element offset per key:
signed offsets make Numba emit a negative-index check that keeps LLVM from
vectorising the row loops (measured 12x slower).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit
from numba.extending import overload

from . import FASTMATH
from .memory import CACHE_LINE, is_flag, load_value, prefetch, unmanaged
from .quad_passes import FETCH_ROWS, QUAD, halves, has_quads, quad_scores, quad_values
from .tile_step import KeptScores, flag_non_finite, rescale_rows, softmax_tile
from .tiles import SEG_KEY, SEG_LENGTH, QueryTile, tile_sees_all
from .vectors import wide_vectors

#: Each key's row prefetches the row this many keys on (the same stream).
AHEAD = 16
#: Elements per call of the four-row passes over a long run (:func:`quad_steps`:
#: 256 keys at d 128, 512 at d 64), read as two halves side by side
#: (:func:`.quad_passes.halves`, which measured runs of 32 to 1024 keys; at
#: d 64 from memory 512 keys read 4% faster than 256): 128 KiB of float32
#: rows, so that items of 8 to 16 rows read a call's rows again from L2,
#: not the whole run from memory.
QUAD_RUN = 32768
#: One query row reads a run of at least this many keys as pairs of
#: neighbouring rows far apart (:func:`far_gap`), the two halves of the
#: run: two streams, as :func:`.quad_passes.halves` reads them. One thread,
#: 8 kv heads from memory, AVX2 AMD EPYC: scores 19.7 -> 24.0 GB/s at d 128
#: (23.3 -> 27.4 at d 64), values 23.4 -> 30.0 (23.1 -> 29.7).
FAR_RUN = 64
#: Only pages shorter than this are prefetched row by row. Longer pages (a
#: contiguous cache is one page per sequence) are long sequential runs that
#: the hardware prefetcher follows by itself, and software prefetches there
#: only cost issue slots: GQA 32/8, d 128, Tk = 65536, float32, 2 threads,
#: four processes each way on the 2-core AVX2 AMD EPYC VM: 21.9-22.9 ms
#: without them, 26.5-27.8 ms with (a GQA 16/4 d 64 four-layer cache of 8192
#: keys: 3.4-3.8 ms against 4.1-5.7). Small pages (16 keys, one-token pages)
#: are separate streams, where the prefetch pays (docs/decoding.md).
PREFETCH_BELOW_PAGE = 256


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


@njit(fastmath=FASTMATH, cache=True, inline="always")
def row_offset(table_row, heads, hk, page, width, j):
    """Flat element offset (uint64) of key ``j``'s row of kv head ``hk`` in a
    ``(blocks, heads, page, width)`` cache whose sequence maps its pages
    through ``table_row``."""
    block = table_row[j // page]
    return np.uint64(((block * heads + hk) * page + j % page) * width)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def page_run(table_row, heads, hk, page, width, j, left):
    """``(run, offset)``: how many of the next ``left`` keys from key ``j`` lie
    in ``j``'s page, and the flat offset of ``j``'s row (consecutive there)."""
    return min(page - j % page, left), row_offset(table_row, heads, hk, page, width, j)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def prefetch_row(flat, table_row, heads, hk, page, width, j, j_end):
    """Prefetch key ``j``'s row (:func:`row_offset`) if ``j < j_end``."""
    if j < j_end and page < PREFETCH_BELOW_PAGE:
        o = row_offset(table_row, heads, hk, page, width, j)
        step = np.uint64(max(1, CACHE_LINE // flat.itemsize))
        for c in range(np.uint64(0), np.uint64(width), step):
            prefetch(flat, o + c)


#: Query rows per pass of the score loops (the passes are written for four),
#: and the rows from which the value loops take four keys per pass (two
#: below). A score pass reads one key row, in memory order, and loads (and
#: widens) each element once for four query rows; a value pass loads and
#: stores an accumulator row once for four value rows. One-row items take
#: four keys per pass in the scores instead (the query row loaded once for
#: four keys). The passes that read four key rows at once (those two) are
#: kept where they measured no slower streaming from memory. Measured on the
#: Zen 4 EPYC (two threads, 1024-key tiles, float32, scores and values only;
#: GB/s with 268 MB / 16 MB of K and V), before -> after: 4 rows at d 128,
#: 29.8-30.2 / 39.8 -> 30.9-31.6 / 52.6; 8 rows, 15.8 / 17.7 -> 18.8 / 23.7;
#: one row at d 128, 33.1-34.4 from memory either way. Tried and not kept,
#: because they took 1.03-1.6x the time streaming from memory (four key rows
#: read as interleaved streams, which the hardware prefetcher follows worse
#: here): four keys per pass in the scores of several rows (in cache as fast
#: as these passes), four value rows per pass for one-row items, and four
#: rows by four keys in one value pass (1.28x faster in cache, 1.6x slower
#: from memory).
ROWS_PER_PASS = 4


@njit(fastmath=FASTMATH, cache=True, inline="always")
def quad_steps(page, width):
    """``(keys, fetch)`` of a page's run in the four-row passes
    (:mod:`.quad_passes`): a long page's run :data:`QUAD_RUN` elements per call
    (each group of four rows reads them in turn, from L2 after the first),
    each row read prefetching the row :data:`~.quad_passes.FETCH_ROWS` on
    (``fetch``, in elements); a small page's two keys per call, each key
    prefetching its own row :data:`AHEAD` keys on, in the next pages, as
    the other passes do (prefetched all at once per run, pages of 16 keys
    took 1.15x the time)."""
    if page >= PREFETCH_BELOW_PAGE:
        return max(2, QUAD_RUN // width), FETCH_ROWS * width
    return 2, 0


@njit(fastmath=FASTMATH, cache=True, inline="always")
def dot_row(q_tile, r, flat, o, width, fmt):
    """``q_tile[r] . flat[o : o + width]``, the cache row read in format ``fmt``."""
    acc = q_tile.dtype.type(0.0)
    for c in range(width):
        acc += q_tile[r, c] * load_value(flat, o + c, fmt)
    return acc


@njit(fastmath=FASTMATH, cache=True, inline="always")
def dot_queries4(q_tile, r, flat, o, width, fmt):
    """The dot products of query rows ``r .. r + 3`` with the cache row at
    flat offset ``o``, each key element loaded (and widened) once."""
    a0 = a1 = a2 = a3 = q_tile.dtype.type(0.0)
    for c in range(width):
        x = load_value(flat, o + c, fmt)
        a0 += q_tile[r, c] * x
        a1 += q_tile[r + 1, c] * x
        a2 += q_tile[r + 2, c] * x
        a3 += q_tile[r + 3, c] * x
    return a0, a1, a2, a3


@njit(fastmath=FASTMATH, cache=True, inline="always")
def key_scores(q_tile, r0, r1, flat, o, width, fmt, s, t):
    """``s[r, t] = q_tile[r] . flat[o : o + width]`` for the query rows ``r0 <=
    r < r1``, four rows per pass (:data:`ROWS_PER_PASS`) and the rest one by
    one (rows indexed, not viewed: a view per key is a reference count to
    take and drop, see :func:`.memory.unmanaged`)."""
    r = r0
    while r + 4 <= r1:  # (loops of their own: a branch kept them scalar)
        s[r, t], s[r + 1, t], s[r + 2, t], s[r + 3, t] = dot_queries4(
            q_tile, r, flat, o, width, fmt
        )
        r += 4
    for i in range(r, r1):
        s[i, t] = dot_row(q_tile, i, flat, o, width, fmt)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def add_value_rows(acc, p, r0, r1, t, count, gap, flat, o0, o1, o2, o3, width, fmt):
    """``acc[r] += sum_a p[r, t_a] * row_a`` for ``r0 <= r < r1`` and ``a <
    count`` (4, 2 or 1: any other count adds nothing) over the cache rows at
    flat offsets ``o0 .. o3`` (those past ``count`` unread), whose weights
    are columns ``t_a``: ``t, t + 1, t + gap, t + gap + 1`` for four keys,
    ``t, t + gap`` for two (``gap`` 2 and 1: consecutive keys). Each ``acc``
    row loaded and stored once per call (rows indexed, as in
    :func:`key_scores`)."""
    for r in range(r0, r1):
        if count == 4:
            w0, w1, w2, w3 = p[r, t], p[r, t + 1], p[r, t + gap], p[r, t + gap + 1]
            for c in range(width):
                acc[r, c] += (
                    w0 * load_value(flat, o0 + c, fmt) + w1 * load_value(flat, o1 + c, fmt)
                ) + (w2 * load_value(flat, o2 + c, fmt) + w3 * load_value(flat, o3 + c, fmt))
        elif count == 2:
            w0, w1 = p[r, t], p[r, t + gap]
            for c in range(width):
                acc[r, c] += w0 * load_value(flat, o0 + c, fmt) + w1 * load_value(flat, o1 + c, fmt)
        elif count == 1:
            w0 = p[r, t]
            for c in range(width):
                acc[r, c] += w0 * load_value(flat, o0 + c, fmt)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def pass_keys(rows):
    """Value rows per pass (:func:`add_value_rows`) for items of ``rows`` query
    rows: four from :data:`ROWS_PER_PASS` rows, else two (the last few keys
    of a run one by one)."""
    return 4 if rows >= ROWS_PER_PASS else 2


@njit(fastmath=FASTMATH, cache=True, inline="always")
def run_values(acc, p, r0, r1, t, run, count, flat, o, width, fmt, ahead):
    """Add the value rows of ``run`` consecutive keys, from flat offset ``o``,
    into ``acc`` rows ``r0 <= r < r1`` (weights: ``p`` columns ``t ..``),
    ``count`` keys per pass (:func:`add_value_rows`) while ``count`` are left;
    return how many keys that added (a multiple of ``count``). Called with
    literal ``count`` (and, for one row, literal rows), so that the inlined
    pass compiles without its branches and row loop: the one-row value pass
    of a decoding step took 0.80-0.90x the time so (12 heads at d 64 with
    2048 keys in L3 and 65536 from memory, 8 heads at d 128; one thread,
    AVX2 AMD EPYC). ``ahead``: ``(table_row, heads, hk, page, dv, j, j_end)``, the
    keys' prefetch (:func:`prefetch_row`; ``j`` the first key's index, and
    none with ``j_end = 0``)."""
    table_row, heads, hk, page, dv, j, j_end = ahead
    u = 0
    while u + count <= run:
        for a in range(count):
            prefetch_row(flat, table_row, heads, hk, page, dv, j + u + a + AHEAD, j_end)
        o0 = o + np.uint64(u) * width
        o1 = o0 + width  # (sums: an integer literal times a uint64 is a float64)
        o2 = o1 + width
        gap = count // 2  # (consecutive keys)
        add_value_rows(acc, p, r0, r1, t + u, count, gap, flat, o0, o1, o2, o2 + width, width, fmt)
        u += count
    return u


@njit(fastmath=FASTMATH, cache=True, inline="always")
def far_gap(run):
    """How far apart (in keys) one query row's passes read their two pairs
    of neighbouring rows in a run of ``run`` keys: the run's halves (even)
    from :data:`FAR_RUN` keys, else 2 (four consecutive keys)."""
    return max(2, (run // 4) * 2) if run >= FAR_RUN else 2


@njit(fastmath=FASTMATH, cache=True, inline="always")
def far_values(acc, p, r, t, run, flat, o, width, fmt):
    """``acc[r] += sum_k p[r, t + k] * row_k`` for one query row over a run of
    ``run`` consecutive value rows from flat offset ``o``, key ``k`` beside
    key ``k + run // 2`` (two streams, :data:`FAR_RUN`); returns the keys
    added (all but an odd run's last)."""
    g = run // 2
    far = np.uint64(g) * width
    for k in range(g):
        o0 = o + np.uint64(k) * width
        add_value_rows(acc, p, r, r + 1, t + k, 2, g, flat, o0, o0 + far, o0, o0, width, fmt)
    return 2 * g


@njit(fastmath=FASTMATH, cache=True, inline="always")
def page_values_run(acc, p, r0, r1, t, run, flat, o, width, fmt, ahead):
    """:func:`run_values` over all ``run`` keys: :func:`pass_keys` keys per
    pass, then one by one for the last few; one row's passes compiled on
    their own (see :func:`run_values`; a long run's as :func:`far_values`);
    four rows or more two keys per pass,
    four rows at a time (:func:`.quad_passes.quad_values`, where it exists;
    no prefetch with ``j_end = 0``)."""
    rows = r1 - r0
    if rows >= QUAD and has_quads(acc, p, flat, fmt, acc.shape[1]):
        table_row, heads, hk, page, dv, j, j_end = ahead
        top = r1 - rows % QUAD  # four rows at a time (.quad_passes), the rest below
        step, fetch = quad_steps(page, dv)
        fetch = fetch if j_end > 0 else 0
        for a in range(0, run, step):
            keys = min(step, run - a)
            for i in range(a, a + keys):
                prefetch_row(flat, table_row, heads, hk, page, dv, j + i + AHEAD, j_end)
            o_a = o + np.uint64(a) * width
            for r in range(r0, top, QUAD):
                quad_values(
                    acc, r, p, t + a, flat, fmt, o_a, width, width, keys, halves(keys), fetch
                )
        if top == r1:
            return
        r0, rows = top, r1 - top
        ahead = (table_row, heads, hk, PREFETCH_BELOW_PAGE, dv, j, 0)  # (prefetched above)
    if rows == 1 and run >= FAR_RUN:
        u = far_values(acc, p, r0, t, run, flat, o, width, fmt)
    elif rows == 1:
        u = run_values(acc, p, r0, r0 + 1, t, run, 2, flat, o, width, fmt, ahead)
    elif pass_keys(rows) == 4:
        u = run_values(acc, p, r0, r1, t, run, 4, flat, o, width, fmt, ahead)
    else:
        u = run_values(acc, p, r0, r1, t, run, 2, flat, o, width, fmt, ahead)
    table_row, heads, hk, page, dv, j, j_end = ahead
    rest = (table_row, heads, hk, page, dv, j + u, j_end)
    o_rest = o + np.uint64(u) * width
    run_values(acc, p, r0, r1, t + u, run - u, 1, flat, o_rest, width, fmt, rest)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def dot_keys4(q_tile, r, flat, o, width, fmt):
    """The dot products of query row ``r`` with the four consecutive cache rows
    from flat offset ``o`` (:func:`dot_rows4`)."""
    o1 = o + width  # (sums: an integer literal times a uint64 is a float64)
    o2 = o1 + width
    return dot_rows4(q_tile, r, flat, o, o1, o2, o2 + width, width, fmt)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def dot_rows4(q_tile, r, flat, o0, o1, o2, o3, width, fmt):
    """The dot products of query row ``r`` with the cache rows at flat offsets
    ``o0 .. o3``, each query element loaded once: four independent sums, where
    one key at a time is a chain of dependent adds and a horizontal sum per
    key."""
    a0 = a1 = a2 = a3 = q_tile.dtype.type(0.0)
    for c in range(width):
        x = q_tile[r, c]
        a0 += x * load_value(flat, o0 + c, fmt)
        a1 += x * load_value(flat, o1 + c, fmt)
        a2 += x * load_value(flat, o2 + c, fmt)
        a3 += x * load_value(flat, o3 + c, fmt)
    return a0, a1, a2, a3


@njit(fastmath=FASTMATH, cache=True)
def cache_scores(q_tile, flat, fmt, table_row, heads, hk, page, j0, n, s, j_end):
    """``s[r, t] = q_tile[r] . key_{j0 + t}`` for ``t < n``: the keys' rows read
    from the flat cache ``flat`` (format flag ``fmt``), one page's run at a
    time: key by key (:func:`key_scores`), for one query row four keys per
    pass (:func:`dot_rows4`: two pairs of neighbours, far apart in a long
    run, :func:`far_gap`), and for four rows or more two keys per pass,
    four rows at a time (:func:`.quad_passes.quad_scores`, where it
    exists). ``q_tile (rows, d)``, ``s (rows, >= n)``, both in the work
    dtype. Each key prefetches the row :data:`AHEAD` keys on, below
    ``j_end``."""
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
            step, fetch = quad_steps(page, d)
            for a in range(0, run, step):
                keys = min(step, run - a)
                for i in range(a, a + keys):
                    prefetch_row(flat, table_row, heads, hk, page, d, j + i + AHEAD, j_end)
                o_a = base + np.uint64(a) * width
                for r in range(0, top, QUAD):
                    quad_scores(
                        q_tile, r, flat, fmt, o_a, d, d, keys, halves(keys), s, t + a, fetch
                    )
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
        page_values_run(acc, p, 0, rows, t, run, flat, base, width, fmt, ahead)
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

"""The passes of the decode walks that read cache rows in place.

:mod:`.cache_rows` (one kv head's rows) and :mod:`.cache_heads` (every kv
head's rows in memory order) read keys and values where they lie in the
cache, in its own format (float32 as is; bf16 and float16 patterns widened
in registers, :func:`.memory.load_value`). This module holds what both
walks read with: where a key's row lies (:func:`row_offset`), its prefetch
(:func:`prefetch_row`), and the register loops that load each element once
for several products: the dot products of a key row with query rows
(:func:`key_scores`, :func:`dot_rows4`) and the value rows added into
accumulator rows (:func:`add_value_rows`, :func:`run_values`); four query
rows at a time against two keys in LLVM IR where the head dim is a
multiple of 8 (:func:`quad_run`, :mod:`.quad_passes`). Long runs are read
as two streams far apart (:data:`FAR_RUN`, :func:`.quad_passes.halves`).

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
from .memory import CACHE_LINE, is_flag, load_value, prefetch
from .quad_passes import FETCH_ROWS, QUAD, halves, has_quads, quad_scores, quad_values

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
def far_values(acc, p, r, t, run, flat, o, width, fmt, ahead):
    """``acc[r] += sum_k p[r, t + k] * row_k`` for one query row over a run of
    ``run`` consecutive value rows from flat offset ``o``, key ``k`` beside
    key ``k + g`` (``g`` from :func:`far_gap`: two streams); returns the keys
    added (a multiple of four: the last few are left). ``ahead`` as in
    :func:`run_values`."""
    table_row, heads, hk, page, dv, j, j_end = ahead
    g = far_gap(run)
    far = np.uint64(g) * width
    for k in range(g):
        prefetch_row(flat, table_row, heads, hk, page, dv, j + k + AHEAD, j_end)
        prefetch_row(flat, table_row, heads, hk, page, dv, j + k + g + AHEAD, j_end)
        o0 = o + np.uint64(k) * width
        add_value_rows(acc, p, r, r + 1, t + k, 2, g, flat, o0, o0 + far, o0, o0, width, fmt)
    return 2 * g


class ScorePass(NamedTuple):
    """Pass flag: query rows against key rows, into scores (:func:`quad_run`,
    :func:`row_pass`)."""


class ValuePass(NamedTuple):
    """Pass flag: weighted value rows added into accumulator rows."""


def quad_pass(kind, tile, r, other, t, flat, fmt, o, width, stride, keys, gap, fetch):
    """:func:`.quad_passes.quad_scores` (``kind`` a :class:`ScorePass`: ``tile``
    the query rows, ``other`` the scores) or :func:`.quad_passes.quad_values`
    (a :class:`ValuePass`: the accumulator rows and the weights), chosen
    when compiled. Only callable from compiled code."""
    raise NotImplementedError("quad_pass is only available inside Numba kernels")


@overload(quad_pass, inline="always")
def _quad_pass(kind, tile, r, other, t, flat, fmt, o, width, stride, keys, gap, fetch):
    if is_flag(kind, ScorePass):

        def scores(kind, tile, r, other, t, flat, fmt, o, width, stride, keys, gap, fetch):
            quad_scores(tile, r, flat, fmt, o, width, stride, keys, gap, other, t, fetch)

        return scores

    def values(kind, tile, r, other, t, flat, fmt, o, width, stride, keys, gap, fetch):
        quad_values(tile, r, other, t, flat, fmt, o, width, stride, keys, gap, fetch)

    return values


def row_pass(kind, tile, r0, r1, other, t, flat, o, width, fmt):
    """One key row at flat offset ``o`` against rows ``r0 <= r < r1`` of
    ``tile`` (:func:`quad_pass`'s ``kind``, ``tile``, ``other``): its
    scores (:func:`key_scores`) or its weighted value row added
    (:func:`add_value_rows`). Only callable from compiled code."""
    raise NotImplementedError("row_pass is only available inside Numba kernels")


@overload(row_pass, inline="always")
def _row_pass(kind, tile, r0, r1, other, t, flat, o, width, fmt):
    if is_flag(kind, ScorePass):
        return lambda kind, tile, r0, r1, other, t, flat, o, width, fmt: key_scores(
            tile, r0, r1, flat, o, width, fmt, other, t
        )

    def values(kind, tile, r0, r1, other, t, flat, o, width, fmt):
        add_value_rows(tile, other, r0, r1, t, 1, 0, flat, o, o, o, o, width, fmt)

    return values


@njit(fastmath=FASTMATH, cache=True, inline="always")
def quad_run(tile, other, kind, r0, r1, t, run, flat, fmt, o, stride, page, ahead):
    """The four-row passes (:mod:`.quad_passes`) over rows ``r0 <= r < r1`` of
    ``tile`` (``r1 - r0`` a multiple of four) and the ``run`` key rows from
    flat offset ``o``, ``stride`` elements apart (:func:`quad_pass`, of
    ``kind``: ``other[r, t + k] = tile[r] . key_k`` or ``tile[r] += sum_k
    other[r, t + k] * value_k``), in a cache of pages of ``page`` keys.
    A page's run goes in the pieces of :func:`quad_steps` (with their
    prefetch), a piece's two halves side by side from :data:`FAR_RUN` keys,
    neighbours below; a run of one-token pages (one kv head's rows of
    consecutive tokens) in one call, neighbours side by side, each row
    prefetching the row :data:`~.quad_passes.FETCH_ROWS` on. ``ahead``:
    ``(table_row, heads, hk, page, width, j, j_end)``, each piece's keys
    prefetched as :func:`prefetch_row` (nothing with ``j_end = 0``)."""
    table_row, heads, hk, fold_page, width, j, j_end = ahead  # (see prefetch_row)
    if page == 1:
        step, fetch = run, FETCH_ROWS * stride
    else:
        step, fetch = quad_steps(page, width)
    for a in range(0, run, step):
        keys = min(step, run - a)
        for i in range(a, a + keys):
            prefetch_row(flat, table_row, heads, hk, fold_page, width, j + i + AHEAD, j_end)
        gap = halves(keys) if page > 1 and keys >= FAR_RUN else 1
        o_a = o + np.uint64(a * stride)
        for r in range(r0, r1, QUAD):
            quad_pass(kind, tile, r, other, t + a, flat, fmt, o_a, width, stride, keys, gap, fetch)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def page_values_run(acc, p, r0, r1, t, run, flat, o, width, fmt, page, ahead):
    """:func:`run_values` over all ``run`` keys: :func:`pass_keys` keys per
    pass, then one by one for the last few; one row's passes compiled on
    their own (see :func:`run_values`; a long run's as :func:`far_values`);
    four rows or more four at a time in the IR passes (:func:`quad_run`,
    where they exist)."""
    rows = r1 - r0
    if rows >= QUAD and has_quads(acc, p, flat, fmt, acc.shape[1]):
        top = r1 - rows % QUAD  # four rows at a time (.quad_passes), the rest below
        quad_run(acc, p, ValuePass(), r0, top, t, run, flat, fmt, o, acc.shape[1], page, ahead)
        if top == r1:
            return
        r0, rows = top, r1 - top
        table_row, heads, hk, _, dv, j, _ = ahead
        ahead = (table_row, heads, hk, PREFETCH_BELOW_PAGE, dv, j, 0)  # (prefetched above)
    if rows == 1 and run >= FAR_RUN:
        u = far_values(acc, p, r0, t, run, flat, o, width, fmt, ahead)
    elif rows == 1:
        u = run_values(acc, p, r0, r0 + 1, t, run, 2, flat, o, width, fmt, ahead)
    elif pass_keys(rows) == 4:
        u = run_values(acc, p, r0, r1, t, run, 4, flat, o, width, fmt, ahead)
    else:
        u = run_values(acc, p, r0, r1, t, run, 2, flat, o, width, fmt, ahead)
    table_row, heads, hk, fold_page, dv, j, j_end = ahead  # (not ``page``: see prefetch_row)
    rest = (table_row, heads, hk, fold_page, dv, j + u, j_end)
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

"""The head walk of decoding (:class:`.cache_rows.HeadRowsWalk`), and the
dispatch of the walks that read cache rows in place (:func:`walk_rows`).

An item of the head walk takes every kv head of its key chunk and reads
the rows of all heads in the cache's own memory order, with the row walk's
passes (:mod:`.row_passes`):

- one-token pages (flash-attn's ``(B, T, Hkv, d)`` cache): key by key, each
  key's rows of all heads in turn, where one head's rows alone lie ``Hkv *
  d`` elements apart; four query rows or more per head (where the IR
  passes exist) a run of up to :data:`TOKEN_RUN` tokens at a time, each
  head's rows of the run in turn (:func:`head_quads`);
- pages of several keys (``(blocks, Hkv, P, d)``, a vLLM-style paged
  cache): page by page, each head's run of keys in the page in turn, so a
  page's K (or V) rows of all heads are one sequential run. The row walk
  reads one head's run per page instead (``P * d`` elements, 8 KiB at P =
  16, d 128, float32) and jumps to the next page: in pages of 16 a parallel
  sum over the same 512 MiB in that order streamed 23 GB/s, against 32 page
  by page (Zen 4 EPYC).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from . import FASTMATH
from .cache_rows import HeadRowsWalk, RowWalk, head_tile, walk_cache_rows
from .memory import is_flag, unmanaged
from .quad_passes import QUAD, has_quads
from .row_passes import (
    PREFETCH_BELOW_PAGE,
    ScorePass,
    ValuePass,
    add_value_rows,
    dot_keys4,
    dot_rows4,
    key_scores,
    page_run,
    page_values_run,
    pass_keys,
    quad_run,
    row_offset,
    row_pass,
)
from .tile_step import KeptScores, flag_non_finite, rescale_rows, softmax_tile
from .tiles import SEG_KEY, SEG_LENGTH, tile_sees_all
from .vectors import wide_vectors

#: Tokens per run of the four-row passes over one-token pages
#: (:func:`head_quads`): each kv head's
#: rows of 8 tokens in turn, so the run's rows of every head (32 KiB at 8
#: kv heads, d 128, float32) are read in memory order and stay in L1 for
#: the next head. GQA 32/8, d 128, one thread, AVX2 AMD EPYC: scores and
#: values 7.5 and 8.3 ms over 32768 keys from memory (one key at a time,
#: every head: 9.6 and 10.0), 0.81 and 0.74 ms over 4096 in L3 (1.12 and
#: 1.02); runs of 4 and 16 within 5%, each head's 256 keys of a tile in
#: turn 1.2-1.4x the time.
TOKEN_RUN = 8


def walk_rows(walk, lo, hi, rest):
    """With a walk that reads rows in place, fold keys ``[lo, hi)`` of every
    head of the item (:func:`.cache_rows.walk_cache_rows` for
    :class:`.cache_rows.RowWalk`, :func:`walk_head_rows` for
    :class:`.cache_rows.HeadRowsWalk`) and return ``hi``; with a tile walk,
    compile to nothing and return ``lo`` (the caller's tile walk then does
    the keys). ``rest``: ``(q_tiles, k_flat, v_flat, fmt, table_row,
    kv_heads, hk0, page, tile_keys, s_buf, m, ell, alpha, acc, segs, b,
    group, length, variants, raw_flag)``, the state with a leading heads axis
    (:func:`.decode.heads_buffers`). Only callable from compiled code."""
    raise NotImplementedError("walk_rows is only available inside Numba kernels")


@overload(walk_rows, inline="always")
def _walk_rows(walk, lo, hi, rest):
    if is_flag(walk, HeadRowsWalk):

        def heads_impl(walk, lo, hi, rest):
            walk_head_rows(lo, hi, *rest)
            return hi

        return heads_impl
    if not is_flag(walk, RowWalk):
        return lambda walk, lo, hi, rest: lo

    def impl(walk, lo, hi, rest):
        q_tiles, k_flat, v_flat, fmt, table_row, heads, hk, page, tile_keys, s_buf = rest[:10]
        m, ell, alpha, acc, segs, b, group, length, variants, raw_flag = rest[10:]
        tile = head_tile(b, hk, group, q_tiles.shape[1] // group, length)
        walk_cache_rows(
            lo, hi, q_tiles[0], k_flat, v_flat, fmt, table_row, heads, hk, page, tile_keys,
            s_buf, m[0], ell[0], alpha, acc[0], segs, tile, variants, raw_flag,
        )  # fmt: skip
        return hi

    return impl


@njit(fastmath=FASTMATH, cache=True)
def head_scores(q_tiles, flat, fmt, table_row, heads, hk0, page, j0, n, s):
    """``s[u, r, t] = q_tiles[u, r] . key_{j0 + t}`` of kv head ``hk0 + u``,
    for every head of the item, in the cache's memory order (the module
    docstring): page by page, each head's run of keys in the page
    (:func:`.row_passes.key_scores` key by key, or for one query row four
    keys per pass); with one-token pages that is key by key, each key's rows
    of all heads in turn (one row: :func:`token_scores4`). Four query rows
    or more take the four-row passes where they exist (:func:`head_quads`),
    over one-token pages in short runs of tokens. ``q_tiles (nh, rows, d)``,
    ``s (nh, rows, >= n)``."""
    wide_vectors()
    nh, rows, d = q_tiles.shape
    # Every head's rows in one 2-D tile each, indexed, not viewed per key;
    # the arrays unmanaged (see .memory.unmanaged).
    q_all = unmanaged(q_tiles.reshape((nh * rows, d)))
    s_all = unmanaged(s.reshape((nh * rows, s.shape[2])))
    flat, table_row = unmanaged(flat), unmanaged(table_row)
    width = np.uint64(d)
    t = 0
    if rows == 1 and page == 1:  # (page literal 1 below: no division per key)
        t = token_scores4(q_all, s_all, flat, fmt, table_row, heads, hk0, j0, n)
    elif rows >= QUAD and has_quads(q_all, s_all, flat, fmt, d):
        head_quads(q_all, s_all, ScorePass(), flat, fmt, table_row, heads, hk0, page, j0, n, rows)
        return
    while t < n:
        run = 0  # (the same for every head)
        for u in range(nh):
            run, o = page_run(table_row, heads, hk0 + u, page, d, j0 + t, n - t)
            i = 0
            if rows == 1:  # four keys of the run per pass (as .cache_rows.cache_scores)
                while i + 4 <= run:
                    c = t + i
                    x = dot_keys4(q_all, u, flat, o + np.uint64(i) * width, width, fmt)
                    s_all[u, c], s_all[u, c + 1], s_all[u, c + 2], s_all[u, c + 3] = x
                    i += 4
            while i < run:
                o_i = o + np.uint64(i) * width
                key_scores(q_all, u * rows, (u + 1) * rows, flat, o_i, width, fmt, s_all, t + i)
                i += 1
        t += run


@njit(fastmath=FASTMATH, cache=True, inline="always")
def token_scores4(q_all, s_all, flat, fmt, table_row, heads, hk0, j0, n):
    """:func:`head_scores` of one query row per head over one-token pages,
    four keys per pass while four are left (each key in its own page,
    :func:`.row_passes.dot_rows4`); return the next key. The scores of 12
    heads, d 64, over 2048 keys (in L3, one thread, AVX2 AMD EPYC) took
    0.54x the time of one key at a time with a page lookup (a division) per
    key; pages of 16 keys, four keys of a run per pass, 0.70x."""
    nh, d = q_all.shape
    width = np.uint64(d)
    t = 0
    while t + 4 <= n:
        for u in range(nh):
            j = j0 + t
            o0 = row_offset(table_row, heads, hk0 + u, 1, d, j)
            o1 = row_offset(table_row, heads, hk0 + u, 1, d, j + 1)
            o2 = row_offset(table_row, heads, hk0 + u, 1, d, j + 2)
            o3 = row_offset(table_row, heads, hk0 + u, 1, d, j + 3)
            x = dot_rows4(q_all, u, flat, o0, o1, o2, o3, width, fmt)
            s_all[u, t], s_all[u, t + 1], s_all[u, t + 2], s_all[u, t + 3] = x
        t += 4
    return t


@njit(fastmath=FASTMATH, cache=True, inline="always")
def token_run(table_row, j, most):
    """How many of the next ``most`` (at least 1) one-token pages from key
    ``j`` follow each other in the cache (so each kv head's rows of those
    tokens lie ``kv heads * d`` elements apart): all of them in a cache row,
    up to a block's end in a paged one."""
    first, run = table_row[j], 1
    while run < most and table_row[j + run] == first + run:
        run += 1
    return run


@njit(fastmath=FASTMATH, cache=True, inline="always")
def head_quads(tile_all, other_all, kind, flat, fmt, table_row, heads, hk0, page, j0, n, rows):
    """:func:`head_scores` (``kind`` a :class:`.row_passes.ScorePass`:
    ``tile_all`` the query rows, ``other_all`` the scores) or
    :func:`token_values` (a :class:`.row_passes.ValuePass`: the accumulator
    rows and the weights) of ``rows`` rows per head (at least
    :data:`~.quad_passes.QUAD`, flattened as there), each head's run in turn
    in the four-row passes (:func:`.row_passes.quad_run`), the rows past a
    multiple of four key by key. A run: with one-token pages up to
    :data:`TOKEN_RUN` consecutive tokens (:func:`token_run`; a head's rows
    ``kv heads * d`` elements apart), else a page's run. Returns ``n``."""
    width = tile_all.shape[1]
    top = rows - rows % QUAD
    t = 0
    while t < n:
        if page == 1:
            run, stride = token_run(table_row, j0 + t, min(TOKEN_RUN, n - t)), heads * width
        else:
            run, stride = page_run(table_row, heads, hk0, page, width, j0 + t, n - t)[0], width
        for u in range(tile_all.shape[0] // rows):
            o = row_offset(table_row, heads, hk0 + u, page, width, j0 + t)
            unread = (table_row, heads, hk0 + u, PREFETCH_BELOW_PAGE, width, j0 + t, 0)
            r0, r1 = u * rows + top, (u + 1) * rows
            quad_run(tile_all, other_all, kind, u * rows, r0, t, run, flat, fmt, o, stride, page,
                     unread)  # fmt: skip
            for i in range(run if r0 < r1 else 0):
                o_i = o + np.uint64(i * stride)
                row_pass(kind, tile_all, r0, r1, other_all, t + i, flat, o_i, np.uint64(width), fmt)
        t += run
    return n


@njit(fastmath=FASTMATH, cache=True)
def token_values(p, flat, fmt, table_row, heads, hk0, j0, n, acc):
    """``acc[u] += p[u, :, :n] @ V`` of kv head ``hk0 + u`` for every head of
    the item, from a cache of one-token pages: key by key, each key's value
    rows of all heads in turn, :func:`.row_passes.pass_keys` keys per
    pass over ``acc (nh, rows, dv)`` (each key of a pass in its own page),
    then one by one; one row compiled on its own (as
    :func:`.row_passes.page_values_run`); four rows or more in the four-row
    passes over runs of tokens (:func:`head_quads`, where they exist)."""
    wide_vectors()
    nh, rows, dv = acc.shape
    acc_all = unmanaged(acc.reshape((nh * rows, dv)))  # (as in head_scores)
    p_all = unmanaged(p.reshape((nh * rows, p.shape[2])))
    flat, table_row = unmanaged(flat), unmanaged(table_row)
    keys = (flat, fmt, table_row, heads, hk0, j0, n)
    if rows == 1:
        t = token_passes(acc_all, p_all, 1, 0, 2, keys)
    elif rows >= QUAD and has_quads(acc_all, p_all, flat, fmt, dv):
        kind = ValuePass()
        t = head_quads(acc_all, p_all, kind, flat, fmt, table_row, heads, hk0, 1, j0, n, rows)
    elif pass_keys(rows) == 4:
        t = token_passes(acc_all, p_all, rows, 0, 4, keys)
    else:
        t = token_passes(acc_all, p_all, rows, 0, 2, keys)
    token_passes(acc_all, p_all, rows, t, 1, keys)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def token_passes(acc_all, p_all, rows, t, count, keys):
    """:func:`token_values`' passes of ``count`` keys from key ``t`` while
    ``count`` are left (literal ``count`` and, for one row, ``rows``: see
    :func:`.row_passes.run_values`); return the next key. ``acc_all (nh *
    rows, dv)``, ``p_all (nh * rows, >= n)``; ``keys``: ``(flat, fmt,
    table_row, heads, hk0, j0, n)``."""
    flat, fmt, table_row, heads, hk0, j0, n = keys
    dv = acc_all.shape[1]
    width = np.uint64(dv)
    while t + count <= n:
        for u in range(acc_all.shape[0] // rows):
            # Offsets past the pass's keys repeat its first key's (unread).
            o0 = row_offset(table_row, heads, hk0 + u, 1, dv, j0 + t)
            o1 = o2 = o3 = o0
            if count > 1:
                o1 = row_offset(table_row, heads, hk0 + u, 1, dv, j0 + t + 1)
            if count > 2:
                o2 = row_offset(table_row, heads, hk0 + u, 1, dv, j0 + t + 2)
                o3 = row_offset(table_row, heads, hk0 + u, 1, dv, j0 + t + 3)
            r0, r1, gap = u * rows, (u + 1) * rows, count // 2  # (consecutive keys)
            add_value_rows(acc_all, p_all, r0, r1, t, count, gap, flat, o0, o1, o2, o3, width, fmt)
        t += count
    return t


@njit(fastmath=FASTMATH, cache=True)
def page_values(p, flat, fmt, table_row, heads, hk0, page, j0, n, acc):
    """:func:`token_values` for pages of several keys: page by page, each
    head's run of value rows in the page (the order of :func:`head_scores`),
    :func:`.row_passes.page_values_run` over each run."""
    wide_vectors()
    nh, rows, dv = acc.shape
    acc_all = unmanaged(acc.reshape((nh * rows, dv)))  # (as in head_scores)
    p_all = unmanaged(p.reshape((nh * rows, p.shape[2])))
    flat, table_row = unmanaged(flat), unmanaged(table_row)
    width = np.uint64(dv)
    t = 0
    while t < n:
        run = 0  # (the same for every head)
        for u in range(nh):
            run, base = page_run(table_row, heads, hk0 + u, page, dv, j0 + t, n - t)
            # No prefetch (j_end = 0). The page given as PREFETCH_BELOW_PAGE makes
            # prefetch_row's test false at compile time, so its code folds away
            # (LLVM cannot prove a key index >= 0 = j_end): about 6.6 s of the
            # head walk's 50 s compile per cache format.
            unread = (table_row, heads, hk0 + u, PREFETCH_BELOW_PAGE, dv, j0 + t, 0)
            page_values_run(acc_all, p_all, u * rows, (u + 1) * rows, t, run, flat, base, width,
                            fmt, page, unread)  # fmt: skip
        t += run


@njit(fastmath=FASTMATH, cache=True)
def walk_head_rows(
    lo, hi, q_tiles, k_flat, v_flat, fmt, table_row, heads, hk0, page, tile_keys, s_buf, m, ell,
    alpha, acc, segs, b, group, length, variants, raw_flag,
):  # fmt: skip
    """Fold keys ``[lo, hi)`` into the state of every head of an item
    (:class:`.cache_rows.HeadRowsWalk`), ``tile_keys`` at a time: the scores
    of all heads (:func:`head_scores`), each head's online softmax
    (:func:`.tile_step.softmax_tile`, the raw scores kept for a rebase, as
    :func:`.cache_rows.fold_cache_tile`), then the values of all heads
    (:func:`token_values` or :func:`page_values`). ``m, ell (nh, rows)``,
    ``acc (nh, rows, dv)``; ``s_buf``: at least ``2 * nh * rows *
    tile_keys`` floats.

    With one-token pages every head's query rows and state are touched per
    key (16 KiB each at GQA 32/8, d 128), more than L1 holds beside the
    stream: there this walk read 14-15 GB/s where the row walk of a ``(B,
    Hkv, T, d)`` cache read 18-23 (AVX2 AMD EPYC, Tk=65536); four rows or
    more now read runs of tokens in the IR passes (:func:`head_quads`:
    27-29 GB/s, the row walk 30-35 with its halves). Tried and not
    kept: two keys per pass in the scores (no change), and each head's tile
    in turn (:func:`.cache_rows.fold_cache_tile`, its rows and state in L1)
    while the next tile's rows of every head were prefetched in memory
    order, a slice per head: 1.5x this walk's time (the prefetch bursts
    stall).
    """
    wide_vectors()
    nh, rows = q_tiles.shape[0], q_tiles.shape[1]
    kept = nh * rows * tile_keys
    j0 = lo
    while j0 < hi:
        j1 = min(j0 + tile_keys, hi)
        n = j1 - j0
        s = s_buf[: nh * rows * n].reshape((nh, rows, n))
        raw = s_buf[kept : kept + nh * rows * n].reshape((nh, rows, n))
        head_scores(q_tiles, k_flat, fmt, table_row, heads, hk0, page, j0, n, s)
        if raw_flag.size > 0:
            flag_non_finite(s.reshape((nh * rows, n)), raw_flag)
        raw[:] = s
        segs[0, SEG_KEY], segs[0, SEG_LENGTH] = j0, n
        for u in range(nh):
            tile = head_tile(b, hk0 + u, group, rows // group, length)
            full = tile_sees_all(tile, j0, j1, variants)
            softmax_tile(
                s[u], s[u], m[u], ell[u], alpha, q_tiles[u], KeptScores(raw[u]), 1.0, segs, tile,
                variants, full, raw_flag,
            )  # fmt: skip
            rescale_rows(acc[u], alpha)
        if page == 1:
            token_values(s, v_flat, fmt, table_row, heads, hk0, j0, n, acc)
        else:
            page_values(s, v_flat, fmt, table_row, heads, hk0, page, j0, n, acc)
        j0 = j1

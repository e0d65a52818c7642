"""Split-KV decoding against a (paged) KV cache, and the merge of the splits.

A decode step has a handful of queries per sequence and a long cache, so
the work is reading K and V once. One work item is one ``(sequence, kv head,
key chunk)``: the ``group * Tq`` queries of the query heads that read the kv
head, stacked as rows (as in :mod:`.forward`), against one chunk of that
sequence's keys; with the head walks one item takes every kv head of its
chunk. Chunks of one sequence run in parallel and each writes a
partial ``(out, lse)``; :func:`merge_partials` folds them with the
``merge_states`` rule. Planning (how many chunks, which thread takes which)
is :func:`flashtile.decode_planning.plan_decode`'s job.

The cache is always addressed through pages: key ``j`` of sequence ``b``
lives in block ``table[b, j // P]`` at row ``j % P`` of the ``(blocks, Hkv,
P, d)`` arrays. A contiguous ``(B, Hkv, T_max, d)`` cache is the special case
``P = T_max`` with ``table[b] = [b]``. A tile of keys inside one page is
used in place; a tile spanning pages (small pages) or stored in 16 bits
(float16 or bfloat16, told apart by a compile-time format flag, see
:func:`.memory.cache_operands`) is gathered, and widened, into a scratch
tile first. With bf16 queries and a bf16 cache where the CPU has bf16
products (:func:`flashtile.decode_planning.decode_operands`), the tiles stay bf16:
used in place, or their bits gathered, and the products are the forward's
bf16 ones (``P`` rounded to bf16). Either way each tile is
folded by the forward's tile step (:func:`.tile_step.fold_key_tile`: the same
online softmax, variants and epilogue), and the next rows are prefetched
(:mod:`.memory`): the next tile while this one is computed, or, for small
pages, the next page while this one is copied. Items that walk the cache
row by row skip the gather and BLAS (:mod:`.cache_rows`); which walk runs is
a route measured on the machine (:func:`flashtile.workitems.decode_walk`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import overload

from ..units import LN2, LOG2E
from . import FASTMATH, prange_only
from .blas_threads import pin_blas, unpin_blas
from .cache_heads import walk_rows
from .cache_rows import HeadTilesWalk, head_tile, reads_rows, walk_heads
from .half import prob_buffer, split_scale, work_empty
from .memory import BFloat16Bits, FloatValues, is_flag, load_value, prefetch_rows
from .tile_step import finish_rows, fold_key_tile, item_buffers, one_segment
from .tiles import (
    SEG_KEY,
    SEG_LENGTH,
    KernelVariants,
    load_q_tile,
    tile_key_range,
    tile_sees_all,
)
from .vectors import wide_vectors

#: Tiles gathered from small pages prefetch this many pages ahead, and at
#: least PREFETCH_KEYS keys ahead: with pages of one token (flash-attn's
#: (B, T, Hkv, d) cache read in place, :mod:`flashtile.flash_attn`) one page
#: ahead is one row, too close for DRAM. Measured on a shared host (GQA 32/8,
#: d 128, Tk=65536, speed relative to flashtile's own layout, A/B runs
#: alternating): 0.72x and 0.78x with one page ahead, 0.83x and 0.77x with 16
#: keys; a small gain at best, inside the run-to-run spread.
PREFETCH_PAGES = 1
PREFETCH_KEYS = 16


def load_tile(src, fmt, table_row, hk, page, j0, j1, buf, j_end):
    """Rows of keys ``[j0, j1)`` (one sequence, kv head ``hk``) in the dtype of ``buf``.

    ``src (blocks, Hkv, P, width)`` in the format ``fmt`` (a flag of
    :mod:`.memory`). Rows inside one page come back in place (a view) when
    they need no widening: float rows, or bf16 bits for bf16 products (a
    ``uint16`` ``buf``); rows spanning pages are copied into ``buf``, 16-bit
    patterns widened when ``buf`` is float (:func:`copy_row`).

    Each small page is a separate stream that the hardware prefetcher only
    picks up halfway, so the copy prefetches the next page (below ``j_end``)
    itself, *one row per row copied*. Prefetching a whole page at once
    stalls: a core tracks only about 16 outstanding cache-line misses, and
    further prefetch instructions wait for a free slot. Measured on one core
    reading shuffled 8 KiB pages: no prefetch 26.8 us per 256-key K+V tile,
    whole next page up front 30.7, row by row 20.5-23.5, as fast as reading
    the pages in order (23.0); in the copy-and-gemm loop 5-8% faster than
    prefetching the whole next page. Only callable from compiled code.
    """
    raise NotImplementedError("load_tile is only available inside Numba kernels")


@njit(fastmath=FASTMATH, cache=True)
def copy_row(src, dst, fmt):
    """``dst[:] = src`` for 1-D arrays, widening 16-bit patterns (uint16) by
    the format flag ``fmt`` (:func:`.memory.load_value`) into a float
    ``dst``; into a ``uint16`` ``dst`` (bf16 products) the bits as they are."""
    wide_vectors()
    for c in range(src.shape[0]):  # a loop: slice assignment copies twice
        dst[c] = row_element(src, c, fmt, dst)


def row_element(src, c, fmt, dst):
    """``src[c]`` as an element of ``dst``: its bits for a ``uint16`` ``dst``,
    else its value (:func:`.memory.load_value`). Only callable from compiled code."""
    raise NotImplementedError("row_element is only available inside Numba kernels")


@overload(row_element, fastmath=FASTMATH, inline="always")
def _row_element(src, c, fmt, dst):
    if dst.dtype != types.uint16:
        return lambda src, c, fmt, dst: load_value(src, c, fmt)
    if not is_flag(fmt, BFloat16Bits):  # float16 is never read as bf16: mantissa bits would go
        raise TypingError(f"bf16 products need a bfloat16 cache, got the format flag {fmt}")
    return lambda src, c, fmt, dst: src[c]


@overload(load_tile, fastmath=FASTMATH)
def _load_tile_overload(src, fmt, table_row, hk, page, j0, j1, buf, j_end):
    # 16-bit patterns widened into a float buffer; bf16 products read them as they are.
    widened = not is_flag(fmt, FloatValues) and buf.dtype != types.uint16

    def impl(src, fmt, table_row, hk, page, j0, j1, buf, j_end):
        if not widened and j0 % page + (j1 - j0) <= page:
            off = j0 % page
            return src[table_row[j0 // page], hk, off : off + j1 - j0]
        j = j0
        while j < j1:  # one page's run at a time
            off, run = j % page, min(page - j % page, j1 - j)
            rows = src[table_row[j // page], hk, off : off + run]
            out = buf[j - j0 : j - j0 + run]
            ahead = j - off + max(PREFETCH_PAGES * page, PREFETCH_KEYS)
            reach = min(page, j_end - ahead) if page < j1 - j0 else 0
            if reach > 0:  # small pages: prefetch row by row (see the docstring)
                nxt = src[table_row[ahead // page], hk]
                for t in range(run):
                    if t < reach:
                        prefetch_rows(nxt, t, t + 1)
                    copy_row(rows[t], out[t], fmt)
            else:
                copy_row(rows.reshape(rows.size), out.reshape(out.size), fmt)
            j += run
        return buf[: j1 - j0]

    return impl


@njit(fastmath=FASTMATH, cache=True)
def prefetch_keys(k, v, table_row, hk, page, j0, j1):
    """Prefetch the K and V rows of keys ``[j0, j1)`` (any pages they span)."""
    j = j0
    while j < j1:
        blk = table_row[j // page]
        off = j % page
        run = min(page - off, j1 - j)
        prefetch_rows(k[blk, hk], off, off + run)
        prefetch_rows(v[blk, hk], off, off + run)
        j += run


@njit(fastmath=FASTMATH, cache=True)
def item_queries(q, b, hk0, heads, group, length, q_mult):
    """``(heads, group * Tq, d)``: the stacked, scaled queries
    (:func:`.tiles.load_q_tile`) of kv heads ``hk0 .. hk0 + heads - 1`` of
    sequence ``b``."""
    tq = q.shape[2]
    q_tiles = np.empty((heads, group * tq, q.shape[3]), dtype=q.dtype)
    for u in range(heads):
        load_q_tile(q, head_tile(b, hk0 + u, group, tq, length), group, 0, q_mult, q_tiles[u])
    return q_tiles


@njit(fastmath=FASTMATH, cache=True)
def heads_buffers(heads, rows, dv, scores, dtype):
    """:func:`.tile_step.item_buffers` for ``heads`` kv heads' rows: ``(acc
    (heads, rows, dv), m (heads, rows), ell (heads, rows), alpha (rows,),
    s_buf)``, one allocation."""
    acc, m, ell, alpha, s_buf = item_buffers(rows * heads, dv, scores, dtype)
    acc3 = acc.reshape((heads, rows, dv))
    return acc3, m.reshape((heads, rows)), ell.reshape((heads, rows)), alpha[:rows], s_buf


@njit(fastmath=FASTMATH, cache=True)
def gather_heads(src, fmt, table_row, page, j0, j1, buf):
    """``buf[h, t] =`` the row of key ``j0 + t`` of kv head ``h``, for every
    kv head and ``t < j1 - j0``, reading each page's ``(Hkv, run, width)``
    block in memory order (16-bit patterns widened as :func:`copy_row`).

    For one-token pages (flash-attn's ``(B, T, Hkv, d)`` cache) that order is
    the cache's own: consecutive keys' blocks follow each other, one stream
    the hardware prefetcher follows, where one head's rows alone are ``Hkv``
    rows apart and each a stream of its own. ``src (blocks, Hkv, P, width)``,
    ``buf (Hkv, >= j1 - j0, width)``."""
    wide_vectors()
    width = src.shape[3]
    j = j0
    while j < j1:  # one page's run at a time
        off, run = j % page, min(page - j % page, j1 - j)
        block = src[table_row[j // page]]
        for h in range(src.shape[1]):
            rows = block[h, off : off + run]
            out = buf[h, j - j0 : j - j0 + run]
            copy_row(rows.reshape(run * width), out.reshape(run * width), fmt)
        j += run


def walk_tile(walk, src, fmt, table_row, hk, u, page, j0, j1, buf, j_end):
    """The rows of keys ``[j0, j1)`` of kv head ``hk``, the ``u``-th head of
    its item: with :class:`.cache_rows.HeadTilesWalk` ``buf[u]``'s first rows
    (:func:`gather_heads` filled them), else :func:`load_tile` into
    ``buf[0]``. Only callable from compiled code."""
    raise NotImplementedError("walk_tile is only available inside Numba kernels")


@overload(walk_tile, fastmath=FASTMATH, inline="always")
def _walk_tile(walk, src, fmt, table_row, hk, u, page, j0, j1, buf, j_end):
    if is_flag(walk, HeadTilesWalk):
        return lambda walk, src, fmt, table_row, hk, u, page, j0, j1, buf, j_end: buf[u, : j1 - j0]

    def impl(walk, src, fmt, table_row, hk, u, page, j0, j1, buf, j_end):
        return load_tile(src, fmt, table_row, hk, page, j0, j1, buf[0], j_end)

    return impl


def gather_tile(walk, src, fmt, table_row, page, j0, j1, buf):
    """:func:`gather_heads` with :class:`.cache_rows.HeadTilesWalk`; nothing for
    the other walks. Only callable from compiled code."""
    raise NotImplementedError("gather_tile is only available inside Numba kernels")


@overload(gather_tile, inline="always")
def _gather_tile(walk, src, fmt, table_row, page, j0, j1, buf):
    if is_flag(walk, HeadTilesWalk):
        return lambda walk, src, fmt, table_row, page, j0, j1, buf: gather_heads(
            src, fmt, table_row, page, j0, j1, buf
        )
    return lambda walk, src, fmt, table_row, page, j0, j1, buf: None


# Inlined into decode_call, which compiles it with its own flags (the same
# fastmath; cpu.prange_only): these apply only where it is called on its own.
@njit(parallel=True, fastmath=FASTMATH, cache=True, inline="always")
def decode_kernel(
    q, k, v, fmt, walk, table, seqlens, items, spans, part_out, part_lse, part_flag, scale,
    variants, tile_keys, ahead, gemm_fn,
):  # fmt: skip
    """Partial attention of each item's queries over its key chunk.

    Args:
        q: ``(B, Hq, Tq, d)`` in the compute dtype, or bf16 bits (``uint16``)
            for bf16 products (the cache bf16 too; float32 state).
        k, v: ``(blocks, Hkv, P, d / dv)`` cache pages, in the compute dtype,
            or uint16 (16-bit patterns: widened tile by tile for float
            queries, read as they are for bf16 products).
        fmt: the caches' format flag (:func:`.memory.cache_operands`).
        walk: how items walk their keys, :func:`.cache_rows.walk_flag` (a
            flag type: kernels for tile walks do not compile the row walk).
        table: ``(B, pages)`` int64 block table (see the module docstring).
        seqlens: ``(B,)`` int64 valid keys per sequence; query ``i`` of
            sequence ``b`` sits at position ``seqlens[b] - Tq + i``.
        items: ``(N, 5)`` int64 rows ``(b, kv head, j_lo, j_hi, slot)``; with
            :class:`.cache_rows.HeadTilesWalk` or :class:`.cache_rows.HeadRowsWalk`
            an item stands for every kv head from its own on, head ``hk + u``
            writing slot ``slot + u * count``.
        spans: ``(B * Hkv, 2)`` int64 ``(first slot, count)`` per ``(b, kv head)``.
        part_out: ``(slots, group * Tq, dv)``, part_lse: ``(slots, group * Tq)``
            (natural log), in the work dtype (float32 for bf16 products),
            written at each item's slot; a chunk whose keys
            no query sees gives zeros and ``-inf``.
        part_flag: ``(N,)`` uint8, zeros: item ``n`` sets entry ``n`` to 1
            when one of its raw scores is not finite (a score past float32's
            range, or a NaN/inf input: :mod:`flashtile.precision` then
            checks the range).
        variants: :class:`.tiles.KernelVariants` (no mask arrays).
        tile_keys: keys per tile. ahead: items of several rows prefetch each
            next tile read in place (:func:`.cache_rows.walk_prefetches`).
            gemm_fn: the ``address`` of :func:`.blas.gemm_for` of the dtype.
    """
    tq, d = q.shape[2], q.shape[3]
    page, dv, hkv = k.shape[2], v.shape[3], k.shape[1]
    group = q.shape[1] // hkv
    rows = group * tq
    heads = walk_heads(walk, hkv)  # kv heads per item
    work = part_lse.dtype  # the state's dtype: float32 for bf16 operands
    # One row per item (MHA, one query) is a pure stream that the hardware
    # prefetcher keeps up with: prefetching the next tile at once stalls on
    # the core's few outstanding misses (no prefetch: 0.76-0.86x the time,
    # 12 heads, d 64, Tk=32768). With a GQA group's rows there is compute to
    # hide it behind (32/8, d 128 on a Xeon: without it 1.13-1.23x the time),
    # but not on every CPU: the "tiles-stream" walk, measured, turns it off.
    prefetch_ahead = rows > 1 and ahead
    # Items that read rows in place (walk: .cache_rows.walk_flag) keep the raw
    # scores after the scores (a rebase reads them) and gather nothing.
    row_wise = reads_rows(walk)
    k_flat, v_flat = k.reshape(k.size), v.reshape(v.size)  # their addressing
    floats = rows * tile_keys * (2 * heads if row_wise else 1)
    scratch = 0 if row_wise else tile_keys  # rows of the gather tiles
    q_mult, s_mult = split_scale(q, part_lse, scale * LOG2E)
    for n in prange(items.shape[0]):
        wide_vectors()  # the prange body is a function of its own
        b, hk0, j_lo, j_hi, slot = items[n, 0], items[n, 1], items[n, 2], items[n, 3], items[n, 4]
        count = spans[b * hkv + hk0, 1]  # slots from one head's partial to the next's
        length = seqlens[b]
        table_row = table[b]
        q_tiles = item_queries(q, b, hk0, heads, group, length, q_mult)
        acc, m, ell, alpha, s_buf = heads_buffers(heads, rows, dv, floats, work)
        p_buf = prob_buffer(q, rows * tile_keys, s_buf)  # bf16: P rounded for the value product
        # Gathered tiles in the operands' dtype (bf16 bits for bf16 products).
        k_buf = np.empty((heads, scratch, d), dtype=q.dtype)
        v_buf = np.empty((heads, scratch, dv), dtype=q.dtype)
        segs = one_segment()  # no boolean mask in decoding

        lo, hi = tile_key_range(head_tile(b, hk0, group, tq, length), variants)  # every head's
        lo, hi = max(lo, j_lo), min(hi, j_hi)
        rest = (
            q_tiles, k_flat, v_flat, fmt, table_row, hkv, hk0, page, tile_keys, s_buf, m, ell,
            alpha, acc, segs, b, group, length, variants, part_flag[n : n + 1],
        )  # fmt: skip
        j0 = walk_rows(walk, lo, hi, rest)  # hi when it read the rows: no tiles left
        while j0 < hi:
            j1 = min(j0 + tile_keys, hi)
            if page >= tile_keys:
                # End the tile at its page, so it is read in place. Such tiles
                # wait on DRAM unless asked for early: prefetch the next one.
                # (Tiles of small pages prefetch page by page as they are
                # gathered instead; a whole tile ahead measured slower there.)
                j1 = min(j1, j0 - j0 % page + page)
                if prefetch_ahead:
                    prefetch_keys(k, v, table_row, hk0, page, j1, min(j1 + tile_keys, hi))
            gather_tile(walk, k, fmt, table_row, page, j0, j1, k_buf)
            gather_tile(walk, v, fmt, table_row, page, j0, j1, v_buf)
            s = s_buf[: rows * (j1 - j0)].reshape((rows, j1 - j0))
            segs[0, SEG_KEY], segs[0, SEG_LENGTH] = j0, j1 - j0
            for u in range(heads):
                tile = head_tile(b, hk0 + u, group, tq, length)
                k_tile = walk_tile(walk, k, fmt, table_row, hk0 + u, u, page, j0, j1, k_buf, hi)
                v_tile = walk_tile(walk, v, fmt, table_row, hk0 + u, u, page, j0, j1, v_buf, hi)
                full = tile_sees_all(tile, j0, j1, variants)
                fold_key_tile(
                    gemm_fn, q_tiles[u], k_tile, v_tile, s, m[u], ell[u], alpha, acc[u],
                    segs, tile, variants, full, 0, 0, k_buf[0, :0], v_buf[0, :0], p_buf,
                    s_mult, part_flag[n : n + 1],
                )  # fmt: skip
            j0 = j1
        for u in range(heads):  # head u's partial: `count` slots after head u - 1's
            out_u = part_out[slot + u * count].reshape((group, tq, dv))
            lse_u = part_lse[slot + u * count].reshape((group, tq))
            finish_rows(acc[u], m[u], ell[u], out_u, lse_u, 0, 0, tq, 1.0, LN2)


@njit(fastmath=FASTMATH, cache=True, parallel=prange_only())
def decode_call(
    q, k, v, fmt, walk, table, seqlens, items, spans, check_raw, scale, variant_fields, tile_keys,
    ahead, gemm_fn, blas_threads,
):  # fmt: skip
    """One decoding call in compiled code: :func:`decode_kernel` over
    ``items`` into partials, then :func:`merge_partials` over ``spans``.

    Arguments as :func:`decode_kernel`'s (without the partial buffers, which
    are allocated here; the variants as a plain tuple,
    ``tuple(variants)``); ``check_raw``: report raw scores that are not
    finite (float32 work, :mod:`flashtile.precision`); ``blas_threads``: the
    BLAS pinned meanwhile (:mod:`.blas_threads`). Returns ``(out (B,
    Hq, Tq, dv), lse (B, Hq, Tq), flagged, finite)``, both in the work dtype
    (float32 for bf16 products): ``flagged``, a raw
    score was not finite; ``finite``, every ``lse`` is. One call from Python
    instead of five allocations, two kernel calls and two reductions: inside
    a model's loop each of those costs microseconds.

    ``decode_kernel`` is inlined here (:func:`flashtile.cpu.prange_only`: one
    level less for Numba to optimise again).
    """
    variants = KernelVariants(*variant_fields)
    pin_blas(blas_threads)
    batch, hq, tq = q.shape[0], q.shape[1], q.shape[2]
    dv = v.shape[3]
    rows = (hq // k.shape[1]) * tq
    slots = spans[-1, 0] + spans[-1, 1] if spans.shape[0] > 0 else 0
    part_out = work_empty((slots, rows, dv), q)
    part_lse = work_empty((slots, rows), q)
    part_flag = np.zeros(items.shape[0] if check_raw else 0, dtype=np.uint8)
    decode_kernel(
        q, k, v, fmt, walk, table, seqlens, items, spans, part_out, part_lse, part_flag, scale,
        variants, tile_keys, ahead, gemm_fn,
    )  # fmt: skip
    out = work_empty((batch, hq, tq, dv), q)
    lse = work_empty((batch, hq, tq), q)
    merge_partials(part_out, part_lse, spans, out, lse)
    flagged, finite = part_flag.any(), all_finite(lse.reshape(lse.size))
    unpin_blas(blas_threads)  # last: nothing after it may raise (see launch._call)
    return out, lse, flagged, finite


@njit(cache=True)
def all_finite(values):
    """Whether every value of the 1-D ``values`` is finite: ``np.isfinite(values).all()``
    as a loop (an array expression in a parallel entry call compiles as a
    subroutine that Numba warns about), stopping at the first that is not."""
    for x in values:  # noqa: SIM110 (a plain loop for Numba, stopping at the first)
        if not np.isfinite(x):
            return False
    return True


@njit(fastmath=FASTMATH, cache=True)
def merge_partials(part_out, part_lse, spans, out, lse):
    """Fold each ``(sequence, kv head)``'s partials into ``out``/``lse``.

    The compiled twin of :func:`flashtile.merge.merge_states` applied over a
    run of slots: ``lse = log sum_s exp(lse_s)`` and ``out = sum_s
    exp(lse_s - lse) out_s``, relative to the largest ``lse_s`` so nothing
    overflows; empty partials (``lse_s = -inf``) weigh nothing and a row with
    no partial left gives zeros and ``-inf``. A partial with a NaN or ``+inf``
    lse (a NaN or infinite score in its chunk) makes the row NaN, whatever
    the split, as :func:`flashtile.attention` gives.

    Args:
        part_out: ``(slots, group * Tq, dv)``; part_lse: ``(slots, group * Tq)``.
        spans: ``(B * Hkv, 2)`` int64 ``(first slot, count)`` of ``(b, kv head)``
            at row ``b * Hkv + kv head``.
        out: ``(B, Hq, Tq, dv)``; lse: ``(B, Hq, Tq)``, written.
    """
    wide_vectors()
    hq, tq, dv = out.shape[1], out.shape[2], out.shape[3]
    hkv = spans.shape[0] // out.shape[0]
    group = hq // hkv
    # Serial on purpose: a few rows per (sequence, kv head), far less work
    # than waking the thread pool again.
    for u in range(spans.shape[0]):
        b, hk = u // hkv, u % hkv
        s0, count = spans[u, 0], spans[u, 1]
        for r in range(group * tq):
            h, i = hk * group + r // tq, r % tq
            top = -np.inf
            broken = False
            for s in range(s0, s0 + count):
                x = part_lse[s, r]
                broken |= x != x or x == np.inf  # a NaN or +inf score in the chunk
                top = max(top, x)
            dst = out[b, h, i]
            if broken:  # propagate, as attention does; never a silent empty row
                dst[:] = np.nan
                lse[b, h, i] = np.nan
                continue
            dst[:] = 0.0
            if top == -np.inf:
                lse[b, h, i] = -np.inf
                continue
            total = 0.0
            for s in range(s0, s0 + count):
                total += math.exp(part_lse[s, r] - top)
            for s in range(s0, s0 + count):
                w = math.exp(part_lse[s, r] - top) / total
                if w != 0.0:
                    src = part_out[s, r]
                    for c in range(dv):
                        dst[c] += w * src[c]
            lse[b, h, i] = top + math.log(total)

"""What every kernel knows about one tile of stacked query rows.

A *work item* covers ``group * br`` stacked rows: ``br`` consecutive queries
``[i0, i0 + br)`` of each of the ``group`` query heads that read one kv head
(GQA/MQA; ``group = 1`` otherwise), so a K/V tile loaded once serves the
whole group. A :class:`QueryTile` places those rows: row ``r`` is query
``i0 + r % br`` of query head ``h0 + r // br``.

Scores arrive from the ``gemm`` in log2 units (the query tile is scaled by
``scale * log2(e)`` when it is loaded, :func:`load_q_tile`);
:func:`transform_row` then applies the variants in the order of
:mod:`flashtile.variants`, all in log2 units, and :func:`row_bounds` gives the
columns the positional rules leave visible.

The per-call variant parameters travel as one :class:`KernelVariants`
namedtuple (into the kernels' entry points as a plain tuple of its fields,
``tuple(variants)``: Numba's dispatcher types a plain tuple in C, a named
one in Python, 1 us a call). Switched-off arrays have zero size, so every combination
of variants runs the same compiled kernel (one compilation per dtype).

The kernels' integer tables are indexed through named columns: ``SEQ_*``
for the sequence table that :mod:`flashtile.planning` builds, ``SEG_*`` for
the key segments of a score tile (:mod:`.tile_step`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..masks import (
    TILE_EMPTY,
    TILE_FULL,
    TILE_PARTIAL,
    block_key_range,
    key_bounds,
    tile_fully_visible,
)
from . import FASTMATH
from .half import narrow, widen
from .mod_calls import call_row, pointer
from .rowops import tanh_of
from .vectors import wide_vectors

#: Columns of the ``seqs (S, SEQ_COLUMNS)`` int64 table: sequence ``s`` is
#: queries ``q_start + [0, Tq)`` and keys ``k_start + [0, Tk)`` of batch
#: entry ``b``, of which the first ``kv_len`` keys are valid (one row per
#: batch entry, or one per packed sequence for varlen).
SEQ_BATCH, SEQ_Q_START, SEQ_TQ, SEQ_K_START, SEQ_TK, SEQ_KV_LEN = range(6)
SEQ_COLUMNS = 6

#: Columns of a score tile's ``segs (nseg, SEG_COLUMNS)`` int64 table: the
#: tile's columns ``[offset, offset + length)`` hold keys ``[key, key +
#: length)``, whose block-map state is ``state`` (``TILE_FULL`` without a map).
SEG_OFFSET, SEG_KEY, SEG_LENGTH, SEG_STATE = range(4)
SEG_COLUMNS = 4


class QueryTile(NamedTuple):
    """Where a tile's stacked rows sit: row ``r`` is query ``i0 + r % br`` of
    query head ``h0 + r // br`` in batch entry ``b``, in a sequence of ``tq``
    queries and ``tk`` keys, the first ``kv_len`` of them valid. Positions
    are the sequence's own (causal alignment uses ``tq`` and ``tk``);
    ``q_start`` and ``k_start`` are its first query and key rows in the
    arrays (nonzero for packed sequences), which dropout's counters read."""

    b: int
    h0: int
    br: int
    i0: int
    tq: int
    tk: int
    kv_len: int
    q_start: int
    k_start: int


class KernelVariants(NamedTuple):
    """Variant parameters as the kernels read them (scores in log2 units).

    ``softcap`` is ``cap * log2(e)`` (0 = off); ``alibi (Ba, Hq)`` holds
    ``slope * log2(e)``; ``mask_add`` is pre-multiplied by ``log2(e)``;
    ``mask_add``/``mask_bool``/``states`` are ``(Bm, Hm, TQm, TKm)``-shaped
    with size-1 dims broadcasting, and empty when off; ``states`` (the block
    map for the call's tiles, ``TILE_*`` values) is present whenever
    ``mask_bool`` is. Dropout (:mod:`flashtile.dropout`): ``drop_threshold``
    the 16-bit threshold (0 = off), ``drop_key0``/``drop_key1`` the seed's
    halves, ``drop_offset`` the counter's offset word, ``drop_scale`` the
    kept entries' ``1 / (1 - p)`` (1 when off). A user's score and mask
    functions (:mod:`flashtile.mods`, called through
    :func:`.mod_calls.call_row`): ``score_fn``, ``score_grad_fn`` (the score
    and its derivative, for the backward), ``capture_fn`` (the gradients of
    captured float tables) and ``mask_fn`` are addresses of row functions for
    the work dtype (0 = off); ``mod_floats``/``mod_ints`` the captured tables,
    flat; ``mod_grads (items, mod_floats.size)`` one gradient buffer per
    backward work item (empty when no captured table takes a gradient).
    """

    causal: bool
    left: int
    right: int
    softcap: float
    alibi: np.ndarray
    mask_add: np.ndarray
    mask_bool: np.ndarray
    states: np.ndarray
    drop_threshold: int
    drop_key0: int
    drop_key1: int
    drop_offset: int
    drop_scale: float
    score_fn: int
    score_grad_fn: int
    capture_fn: int
    mask_fn: int
    mod_floats: np.ndarray
    mod_ints: np.ndarray
    mod_grads: np.ndarray


@njit(fastmath=FASTMATH, cache=True)
def sequence_tile(seqs, s, h0, i0, block_q):
    """The :class:`QueryTile` of query block ``[i0, i0 + block_q)`` (cut at
    the sequence's end) of sequence ``s``, heads from ``h0``."""
    tq = seqs[s, SEQ_TQ]
    br = min(block_q, tq - i0)
    return QueryTile(
        seqs[s, SEQ_BATCH], h0, br, i0, tq, seqs[s, SEQ_TK], seqs[s, SEQ_KV_LEN],
        seqs[s, SEQ_Q_START], seqs[s, SEQ_K_START],
    )  # fmt: skip


@njit(fastmath=FASTMATH, cache=True)
def tile_key_range(tile, variants):
    """Keys ``[lo, hi)`` that any of the tile's queries may see by position."""
    t, va = tile, variants
    return block_key_range(t.i0, t.i0 + t.br, t.tq, t.tk, va.causal, va.left, va.right, t.kv_len)


@njit(fastmath=FASTMATH, cache=True)
def tile_sees_all(tile, j0, j1, variants):
    """Whether every query of the tile sees every key in ``[j0, j1)`` by position."""
    t, va = tile, variants
    return tile_fully_visible(
        t.i0, t.i0 + t.br, j0, j1, t.tq, t.tk, va.causal, va.left, va.right, t.kv_len
    )


@njit(fastmath=FASTMATH, cache=True, inline="always")
def row_query(tile, r):
    """``(i, h)``: the query and the query head of the tile's stacked row ``r``.

    Callers compute it once per row and pass it on: the per-row helpers run
    once per row and key segment, where an integer division per call shows.
    This and the other per-row helpers are inlined: a call passes the
    variants' arrays, and each array argument costs two atomic reference
    counts per call.
    """
    return tile.i0 + r % tile.br, tile.h0 + r // tile.br


@njit(fastmath=FASTMATH, cache=True, inline="always")
def row_bounds(tile, i, j0, j1, variants):
    """Columns ``[a, b)`` of a tile over keys ``[j0, j1)`` that query ``i`` sees.

    Always ``0 <= a <= b <= j1 - j0``: a tile wholly left of the row's range
    gives ``(j1 - j0, j1 - j0)`` (callers hide ``[0, a)`` and ``[b, n)``).
    """
    return row_span(tile, i, j0, j1 - j0, variants.causal, variants.left, variants.right)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def row_span(tile, i, j0, n, causal, left, right):
    """:func:`row_bounds` of keys ``[j0, j0 + n)`` from the positional
    variants as scalars (for loops that must not pass the variants' arrays)."""
    lo, hi = key_bounds(i, tile.tq, tile.tk, causal, left, right, tile.kv_len)
    a = min(max(lo, j0), j0 + n) - j0
    b = min(hi, j0 + n) - j0
    return a, max(a, b)


#: A tile's rows are split in two across the diagonal only when each half has
#: at least this many rows and the top half skips at least this many keys.
MIN_SPLIT_ROWS = 32


@njit(fastmath=FASTMATH, cache=True)
def diagonal_split(tile, group, full, j0, j1, variants):
    """``(top, top_w)``: split a tile's rows at ``top`` when the rows above it
    see only the tile's first ``top_w`` keys; ``top = 0`` means no split.

    Across the causal diagonal (or a window's right edge) the first half of
    a tile's rows sees fewer keys, so the tile products of those rows can
    skip the columns past ``top_w``. Only with one query head per tile
    (``group == 1``): stacked GQA heads repeat the same rows per head.
    """
    if group != 1 or full or tile.br < 2 * MIN_SPLIT_ROWS:
        return 0, 0
    top = tile.br // 2
    top_w = row_bounds(tile, tile.i0 + top - 1, j0, j1, variants)[1]
    if top_w > j1 - j0 - MIN_SPLIT_ROWS:
        return 0, 0  # too little to skip
    return top, top_w


@njit(fastmath=FASTMATH, cache=True, inline="always")
def changes_scores(variants):
    """Whether a variant changes visible scores (softcap, ALiBi, additive
    mask, a score function)."""
    va = variants
    return va.softcap > 0.0 or va.alibi.size > 0 or va.mask_add.size > 0 or va.score_fn != 0


@njit(fastmath=FASTMATH, cache=True, inline="always")
def needs_transform(variants):
    """Whether :func:`transform_row` has anything to do (a bool mask or a
    mask function too)."""
    return changes_scores(variants) or variants.mask_bool.size > 0 or variants.mask_fn != 0


@njit(fastmath=FASTMATH, cache=True, inline="always")
def softcap_row(seg, chain_out, softcap):
    """``seg = softcap * tanh(seg / softcap)`` in place, and with a non-empty
    ``chain_out`` the derivative ``1 - tanh^2`` (computed without cancelling).
    In the scores' dtype (float32 scores take the vectorised
    :func:`.rowops.tanh_of`), one loop per case and unsigned indices: a test
    or a signed index inside keeps it scalar."""
    cap = seg.dtype.type(softcap)
    inv = seg.dtype.type(1.0) / cap
    if chain_out.size > 0:
        for c in range(seg.shape[0]):
            j = np.uintp(c)
            t, dt = tanh_of(seg[j] * inv)
            seg[j] = cap * t
            chain_out[j] = dt
    else:
        for c in range(seg.shape[0]):
            j = np.uintp(c)
            seg[j] = cap * tanh_of(seg[j] * inv)[0]


@njit(fastmath=FASTMATH, cache=True)
def transform_row(seg, col0, tile, i, h, variants, read_bool, chain_out):
    """Apply the score function or softcap, ALiBi, the additive and the
    boolean mask (or mask function) to ``seg`` in place.

    ``seg`` holds the scores of query ``i`` of head ``h`` (a row of ``tile``,
    see :func:`row_query`) against keys ``col0, col0 + 1, ...``.
    ``read_bool`` is False when the block map says the keys' block is fully
    kept. With softcap or a score function, ``chain_out`` (same length)
    receives the derivative of the new score by the raw one for the
    backward's chain rule (pass an empty array to skip).
    """
    wide_vectors()
    va = variants
    n = seg.shape[0]
    b = tile.b
    if va.score_fn != 0:  # (never with softcap: flashtile.mods)
        fp, ip = pointer(va.mod_floats), pointer(va.mod_ints)
        if chain_out.size > 0:
            aux = chain_out.ctypes.data
            call_row(va.score_grad_fn, seg.ctypes.data, aux, n, b, h, i, col0, fp, ip, 0)
        else:
            call_row(va.score_fn, seg.ctypes.data, 0, n, b, h, i, col0, fp, ip, 0)
    if va.softcap > 0.0:
        softcap_row(seg, chain_out, va.softcap)
    if va.alibi.size > 0:
        slope = va.alibi[b % va.alibi.shape[0], h]
        p = i + tile.tk - tile.tq
        for c in range(n):
            seg[c] -= slope * abs(p - (col0 + c))
    if va.mask_add.size > 0:
        ma = va.mask_add
        row = ma[b % ma.shape[0], h % ma.shape[1], i % ma.shape[2]]
        for c in range(n):
            seg[c] += row[(col0 + c) % ma.shape[3]]
    if read_bool and va.mask_bool.size > 0:
        mb = va.mask_bool
        row = mb[b % mb.shape[0], h % mb.shape[1], i % mb.shape[2]]
        for c in range(n):
            if not row[(col0 + c) % mb.shape[3]]:
                seg[c] = -np.inf
    if read_bool and va.mask_fn != 0:
        fp, ip = pointer(va.mod_floats), pointer(va.mod_ints)
        call_row(va.mask_fn, seg.ctypes.data, 0, n, b, h, i, col0, fp, ip, 0)


@njit(fastmath=FASTMATH, cache=True)
def tile_state(variants, b, h0, group, qblock, kblock):
    """Block-map state (``TILE_*``) of a stacked tile: empty only when every
    head's block is empty, full only when every head's block is full."""
    st = variants.states
    if st.size == 0:  # no mask (the caller always builds a map for a mask)
        return TILE_FULL
    lo, hi = TILE_FULL, TILE_EMPTY
    for g in range(group):
        v = st[b % st.shape[0], (h0 + g) % st.shape[1], qblock, kblock]
        lo = min(lo, v)
        hi = max(hi, v)
    if hi == TILE_EMPTY:
        return TILE_EMPTY
    return TILE_FULL if lo == TILE_FULL else TILE_PARTIAL


@njit(fastmath=FASTMATH, cache=True)
def load_q_tile(src, tile, group, q_start, mult, out):
    """Stack the tile's rows of ``src (NB, H, T, w)`` into ``out (group * br, w)``,
    times ``mult``: ``group`` heads from ``tile.h0``, queries ``q_start +
    tile.i0 + [0, br)`` (queries, or the output gradient, in the backward).
    Either may hold bf16 bits (:mod:`.half`; ``mult = 1`` copies them exactly)."""
    wide_vectors()
    br = tile.br
    i = q_start + tile.i0
    for g in range(group):
        rows = src[tile.b, tile.h0 + g, i : i + br]
        dst = out[g * br : (g + 1) * br]
        for r in range(br):
            for c in range(src.shape[3]):
                dst[r, c] = narrow(widen(rows[r, c]) * mult, out)

"""Dropout inside the tile step: the keep/drop decisions of a probability tile.

The decision rule is :mod:`flashtile.dropout`'s (one Philox block per eight
key columns of a query row); this module applies it to a tile of stacked
query rows (:mod:`.tiles`). Per row, one loop fills the row's Philox words
(straight-line integer code that LLVM vectorises across blocks) and a second
compares the row's columns' 16-bit values to the threshold.

A dropped entry becomes ``P * sign``: ``sign = 0`` in the forward (the value
product then skips it), ``-1`` in the backward, which marks the entry while
keeping ``P`` for the ``dS`` formula (``P >= 0``, so the sign bit carries the
mask, as flash-attn's ``S_dmask`` does; :func:`.backward.grad_rows` reads it).
The ``1 / (1 - p)`` of the kept entries is applied once, outside.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..dropout import COUNTER_LIMIT, KEEP_BITS
from ..dropout import philox as _philox
from . import FASTMATH
from .half import narrow, widen
from .tiles import SEG_KEY, SEG_LENGTH, SEG_OFFSET, row_query
from .vectors import wide_vectors

#: Key columns per Philox block (four 32-bit words of two 16-bit values).
COLUMNS_PER_BLOCK = 8

#: The one Philox, inlined at Numba's level: LLVM then sees the whole block
#: loop and vectorises it (as a call, it stays scalar).
philox = njit(fastmath=FASTMATH, inline="always")(_philox)


@njit(fastmath=FASTMATH, cache=True)
def drop_span(p, r, c0, c1, key0, i, bh, key, sign, values):
    """Apply dropout to ``p[r, c0:c1]``, whose columns hold keys ``key0 + c0, ...``.

    ``i`` is the row's query (a row index of the caller's arrays), ``bh`` the
    counter word ``b * 2**16 + h``, ``key`` :func:`generator_key`'s tuple;
    ``values`` a uint16 scratch of at least ``(c1 - c0) + 2 *
    COLUMNS_PER_BLOCK`` elements. (Scalars, not the variants record: each
    array argument of a call costs two atomic reference counts, per row here.)
    """
    wide_vectors()
    if c1 <= c0:
        return
    g_lo = (key0 + c0) // COLUMNS_PER_BLOCK
    g_hi = (key0 + c1 - 1) // COLUMNS_PER_BLOCK
    u32, u16 = np.uint32, np.uint16
    k0, k1, off, threshold = key
    ui, ubh = u32(i), u32(bh)
    for g in range(g_hi - g_lo + 1):  # the blocks (vectorised across g)
        w0, w1, w2, w3 = philox(u32(g_lo + g), ui, ubh, off, k0, k1)
        at = COLUMNS_PER_BLOCK * g  # column j takes half j % 2 of word (j // 2) % 4
        values[at], values[at + 1] = u16(w0), u16(w0 >> u32(KEEP_BITS))
        values[at + 2], values[at + 3] = u16(w1), u16(w1 >> u32(KEEP_BITS))
        values[at + 4], values[at + 5] = u16(w2), u16(w2 >> u32(KEEP_BITS))
        values[at + 6], values[at + 7] = u16(w3), u16(w3 >> u32(KEEP_BITS))
    # Unit-stride views of the row and its values: with indices offset by
    # run-time amounts LLVM left this loop scalar (2x the time of the tile).
    start = key0 + c0 - g_lo * COLUMNS_PER_BLOCK
    row = p[r, c0:c1]
    keep = values[start : start + (c1 - c0)]
    one = widen(row[0]) * 0 + 1  # 1 and the sign in the work dtype
    dropped = -one if sign < 0 else one - one
    for t in range(row.shape[0]):  # multiply by a selected factor: a select of x stayed scalar
        factor = one if keep[t] >= threshold else dropped
        row[t] = narrow(widen(row[t]) * factor, row)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def generator_key(variants):
    """``(k0, k1, offset, threshold)``: the variants' dropout scalars as the
    generator takes them (uint32 key and offset words and threshold)."""
    va, u32 = variants, np.uint32
    return (u32(va.drop_key0), u32(va.drop_key1), u32(va.drop_offset), np.uint32(va.drop_threshold))


@njit(fastmath=FASTMATH, cache=True)
def drop_tile(p, segs, tile, variants, sign):
    """Dropout on a probability tile ``p (rows, n)`` of the forward or decode
    tile step: ``segs`` (columns ``SEG_*``) says which keys its columns hold,
    ``tile`` (a :class:`.tiles.QueryTile`) places its rows."""
    n, key = p.shape[1], generator_key(variants)
    values = np.empty(n + 2 * COLUMNS_PER_BLOCK, dtype=np.uint16)
    for r in range(p.shape[0]):
        i, h = row_query(tile, r)
        bh = tile.b * COUNTER_LIMIT + h
        for g in range(segs.shape[0]):
            off, first, length = segs[g, SEG_OFFSET], segs[g, SEG_KEY], segs[g, SEG_LENGTH]
            drop_span(
                p, r, off, off + length, tile.k_start + first - off, tile.q_start + i, bh, key,
                sign, values,
            )  # fmt: skip


@njit(fastmath=FASTMATH, cache=True)
def mark_rows(p, r0, r1, cw, j0, tile, variants):
    """The backward's marks: rows ``[r0, r1)`` of ``p``, columns ``[0, cw)``
    holding keys ``j0, j0 + 1, ...``; dropped entries negated."""
    values = np.empty(cw + 2 * COLUMNS_PER_BLOCK, dtype=np.uint16)
    key = generator_key(variants)
    for r in range(r0, r1):
        i, h = row_query(tile, r)
        drop_span(
            p, r, 0, cw, tile.k_start + j0, tile.q_start + i, tile.b * COUNTER_LIMIT + h, key,
            -1.0, values,
        )  # fmt: skip

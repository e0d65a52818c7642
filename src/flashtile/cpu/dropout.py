"""Dropout inside the tile step: the keep/drop decisions of a probability tile.

The decision rule is :mod:`flashtile.dropout`'s (one Philox block per eight
key columns of a query row); this module applies it to a tile of stacked
query rows (:mod:`.tiles`). Per row, one loop fills the row's Philox words
(straight-line integer code that LLVM vectorises across blocks) and a second
applies them to the row's columns.

A dropped entry becomes ``P * sign``: ``sign = 0`` in the forward (the value
product then skips it), ``-1`` in the backward, which marks the entry while
keeping ``P`` for the ``dS`` formula (``P >= 0``, so the sign bit carries the
mask, as flash-attn's ``S_dmask`` does; :func:`.backward.grad_rows` reads it).
The ``1 / (1 - p)`` of the kept entries is applied once, outside.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..dropout import KEEP_BITS, philox
from . import FASTMATH
from .half import narrow, widen
from .tiles import SEG_KEY, SEG_LENGTH, SEG_OFFSET, row_query
from .vectors import wide_vectors

#: Key columns per Philox block (four 32-bit words of two 16-bit values).
COLUMNS_PER_BLOCK = 8


@njit(fastmath=FASTMATH, cache=True)
def drop_span(p, r, c0, c1, key0, i, bh, variants, sign, words):
    """Apply dropout to ``p[r, c0:c1]``, whose columns hold keys ``key0 + c0, ...``.

    ``i`` is the row's query (a row index of the caller's arrays), ``bh`` the
    counter word ``b * 2**16 + h``; ``words`` a uint32 scratch of at least
    ``4 * ((c1 - c0) // 8 + 2)`` elements.
    """
    wide_vectors()
    if c1 <= c0:
        return
    va = variants
    g_lo = (key0 + c0) // COLUMNS_PER_BLOCK
    g_hi = (key0 + c1 - 1) // COLUMNS_PER_BLOCK
    u = np.uint64
    k0, k1, off = u(va.drop_key0), u(va.drop_key1), u(va.drop_offset)
    ui, ubh = u(i), u(bh)
    for g in range(g_hi - g_lo + 1):
        w0, w1, w2, w3 = philox(u(g_lo + g), ui, ubh, off, k0, k1)
        words[4 * g] = w0
        words[4 * g + 1] = w1
        words[4 * g + 2] = w2
        words[4 * g + 3] = w3
    base = g_lo * COLUMNS_PER_BLOCK
    threshold = np.uint32(va.drop_threshold)
    for c in range(c0, c1):
        rel = key0 + c - base
        value = (words[rel >> 1] >> np.uint32((rel & 1) * KEEP_BITS)) & np.uint32(0xFFFF)
        x = widen(p[r, c])
        p[r, c] = narrow(x if value >= threshold else x * sign, p)


@njit(fastmath=FASTMATH, cache=True)
def drop_tile(p, segs, tile, variants, sign):
    """Dropout on a probability tile ``p (rows, n)`` of the forward or decode
    tile step: ``segs`` (columns ``SEG_*``) says which keys its columns hold,
    ``tile`` (a :class:`.tiles.QueryTile`) places its rows."""
    n = p.shape[1]
    words = np.empty(4 * (n // COLUMNS_PER_BLOCK + 2), dtype=np.uint32)
    for r in range(p.shape[0]):
        i, h = row_query(tile, r)
        bh = tile.b * 65536 + h
        for g in range(segs.shape[0]):
            off, key, length = segs[g, SEG_OFFSET], segs[g, SEG_KEY], segs[g, SEG_LENGTH]
            drop_span(
                p, r, off, off + length, tile.k_start + key - off, tile.q_start + i, bh,
                variants, sign, words,
            )  # fmt: skip


@njit(fastmath=FASTMATH, cache=True)
def mark_rows(p, r0, r1, cw, j0, tile, variants):
    """The backward's marks: rows ``[r0, r1)`` of ``p``, columns ``[0, cw)``
    holding keys ``j0, j0 + 1, ...``; dropped entries negated."""
    words = np.empty(4 * (cw // COLUMNS_PER_BLOCK + 2), dtype=np.uint32)
    for r in range(r0, r1):
        i, h = row_query(tile, r)
        drop_span(
            p, r, 0, cw, tile.k_start + j0, tile.q_start + i, tile.b * 65536 + h, variants,
            -1.0, words,
        )  # fmt: skip

"""What the forward and backward kernels share about one score tile.

A *work item* covers ``group * br`` stacked rows: ``br`` consecutive queries
``[i0, i0 + br)`` of each of the ``group`` query heads that read one kv head
(GQA/MQA; ``group = 1`` otherwise), so a K/V tile loaded once serves the
whole group. Row ``r`` of a tile is query ``i0 + r % br`` of query head
``h0 + r // br``.

Scores arrive from the ``gemm`` in log2 units (the query tile is scaled by
``scale * log2(e)``); :func:`transform_row` then applies the variants in the
order of :mod:`flashtile.variants`, all in log2 units, and
:func:`row_bounds` gives the columns the positional rules leave visible.

The per-call variant parameters travel as one :class:`KernelVariants`
namedtuple. Switched-off arrays have zero size, so every combination of
variants runs the same compiled kernel (one compilation per dtype).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ..masks import key_bounds
from . import FASTMATH


class KernelVariants(NamedTuple):
    """Variant parameters as the kernels read them (scores in log2 units).

    ``softcap`` is ``cap * log2(e)`` (0 = off); ``alibi (Ba, Hq)`` holds
    ``slope * log2(e)``; ``mask_add`` is pre-multiplied by ``log2(e)``;
    ``mask_add``/``mask_bool``/``states`` are ``(Bm, Hm, TQm, TKm)``-shaped
    with size-1 dims broadcasting, and empty when off; ``states`` (the block
    map for the call's tiles) is present whenever ``mask_bool`` is.
    """

    causal: bool
    left: int
    right: int
    softcap: float
    alibi: np.ndarray
    mask_add: np.ndarray
    mask_bool: np.ndarray
    states: np.ndarray


@njit(fastmath=FASTMATH, cache=True)
def row_bounds(i, j0, j1, tq, tk, kv_len, kv):
    """Columns ``[a, b)`` of a tile over keys ``[j0, j1)`` that query ``i`` sees.

    Always ``0 <= a <= b <= j1 - j0``: a tile wholly left of the row's range
    gives ``(j1 - j0, j1 - j0)`` (callers hide ``[0, a)`` and ``[b, n)``).
    """
    lo, hi = key_bounds(i, tq, tk, kv.causal, kv.left, kv.right, kv_len)
    a = min(max(lo, j0), j1) - j0
    b = min(hi, j1) - j0
    return a, max(a, b)


#: A tile's rows are split in two across the diagonal only when each half has
#: at least this many rows and the top half skips at least this many keys.
MIN_SPLIT_ROWS = 32


@njit(fastmath=FASTMATH, cache=True)
def diagonal_split(group, br, full, i0, j0, j1, tq, tk, kv_len, kv):
    """``(top, top_w)``: split a tile's rows at ``top`` when the rows above it
    see only the tile's first ``top_w`` keys; ``top = 0`` means no split.

    Across the causal diagonal (or a window's right edge) the first half of
    a tile's rows sees fewer keys, so the tile products of those rows can
    skip the columns past ``top_w``. Only with one query head per tile
    (``group == 1``): stacked GQA heads repeat the same rows per head.
    """
    if group != 1 or full or br < 2 * MIN_SPLIT_ROWS:
        return 0, 0
    top = br // 2
    top_w = row_bounds(i0 + top - 1, j0, j1, tq, tk, kv_len, kv)[1]
    if top_w > j1 - j0 - MIN_SPLIT_ROWS:
        return 0, 0  # too little to skip
    return top, top_w


@njit(fastmath=FASTMATH, cache=True)
def changes_scores(kv):
    """Whether a variant changes visible scores (softcap, ALiBi, additive mask)."""
    return kv.softcap > 0.0 or kv.alibi.size > 0 or kv.mask_add.size > 0


@njit(fastmath=FASTMATH, cache=True)
def needs_transform(kv):
    """Whether :func:`transform_row` has anything to do (a bool mask too)."""
    return changes_scores(kv) or kv.mask_bool.size > 0


@njit(fastmath=FASTMATH, cache=True)
def transform_row(seg, col0, i, tq, tk, b, h, kv, read_bool, tanh_out):
    """Apply softcap, ALiBi, the additive and the boolean mask to ``seg`` in place.

    ``seg`` holds the scores of query ``i`` (head ``h``, batch ``b``) against
    keys ``col0, col0 + 1, ...``. ``read_bool`` is False when the block map
    says the tile is fully kept. With softcap, ``tanh_out`` (same length)
    receives ``tanh(s / cap)`` for the backward's chain rule (pass an empty
    array to skip).
    """
    n = seg.shape[0]
    if kv.softcap > 0.0:
        inv = 1.0 / kv.softcap
        for c in range(n):
            t = math.tanh(seg[c] * inv)
            seg[c] = kv.softcap * t
            if tanh_out.size > 0:
                tanh_out[c] = t
    if kv.alibi.size > 0:
        slope = kv.alibi[b % kv.alibi.shape[0], h]
        p = i + tk - tq
        for c in range(n):
            seg[c] -= slope * abs(p - (col0 + c))
    if kv.mask_add.size > 0:
        ma = kv.mask_add
        row = ma[b % ma.shape[0], h % ma.shape[1], i % ma.shape[2]]
        for c in range(n):
            seg[c] += row[(col0 + c) % ma.shape[3]]
    if read_bool and kv.mask_bool.size > 0:
        mb = kv.mask_bool
        row = mb[b % mb.shape[0], h % mb.shape[1], i % mb.shape[2]]
        for c in range(n):
            if not row[(col0 + c) % mb.shape[3]]:
                seg[c] = -np.inf


@njit(fastmath=FASTMATH, cache=True)
def tile_state(kv, b, h0, group, qblock, kblock):
    """Block-map state of a stacked tile: 0 skip, 1 read the mask, 2 fully kept."""
    st = kv.states
    if st.size == 0:  # no mask (the caller always builds a map for a mask)
        return 2
    lo, hi = 2, 0
    for g in range(group):
        v = st[b % st.shape[0], (h0 + g) % st.shape[1], qblock, kblock]
        lo = min(lo, v)
        hi = max(hi, v)
    if hi == 0:
        return 0
    return 2 if lo == 2 else 1

"""Which flashtile calls one ring step makes: blocks of local queries x received keys.

A rank's shard is a list of *segments*, contiguous runs of the global
sequence, ``(start, length)`` in local order (one for ``contiguous``, two for
``zigzag``). Query ``g_q`` may see key ``g_k`` (global positions) iff::

    lo <= g_k - g_q <= hi      lo = -left (or -inf), hi = right (or +inf), causal: hi <= 0

which is flashtile's rule for one whole sequence (``Tq == Tk``, so a query's
position is its index). For a query segment and a key segment the same rule
in local indices ``i``, ``j`` reads ``a <= j - i <= b`` with ``a = lo + e``,
``b = hi + e`` and ``e = q_start - k_start``. flashtile's bottom-right
alignment expresses that band exactly, without a mask: slice the queries to
``[q0, q1)`` and the keys to ``[k0, k1)`` so that ``D = q1 - k1`` lies in
``[-b, -a]``; then query ``i'`` of the slice sits at ``p' = i' + Tk' - Tq'`` and
the band becomes ``window=(-(a + D), b + D)`` around ``p'`` (both sides >= 0).
A side at 0 on the right is plain ``causal``. Queries outside ``[q0, q1)``
see no key of that segment and are left out of the call.

ALiBi cannot be shifted this way (its bias is ``|p - j|`` with the true
positions), so the ring refuses it (see :func:`flashtile.distributed.ring_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..masks import normalize_window


@dataclass(frozen=True)
class Block:
    """One flashtile call: local query rows ``[q0, q1)`` x key rows ``[k0, k1)``.

    ``causal`` and ``window`` are the flags to pass (bottom-right, within the
    slices); ``window`` is None or ``(left, right)`` with -1 = unbounded.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    window: tuple[int, int] | None = None

    @property
    def full(self) -> bool:
        return not self.causal and self.window is None

    def kwargs(self) -> dict:
        """The ``causal``/``window`` keywords of this block's flashtile call."""
        kw = {"causal": self.causal}
        if self.window is not None:
            kw["window"] = self.window
        return kw


def band(causal: bool, window) -> tuple[float, float]:
    """``(lo, hi)``: the key - query offsets a query may see (``+-inf`` = unbounded).

    ``window=(left, right)`` as in :func:`flashtile.attention` (None or -1 for
    an unbounded side; ``window=(256, 0)`` is a causal window of 257 keys),
    read by the same rule (:func:`flashtile.masks.normalize_window`).
    """
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    left, right = normalize_window(window, bool(causal))
    lo = -math.inf if left < 0 else -left
    hi = math.inf if right < 0 else right
    return lo, hi


def segment_block(q_seg, k_seg, lo: float, hi: float) -> Block | None:
    """The block of query segment x key segment, in segment-local indices; None if empty."""
    (qs, lq), (ks, lk) = q_seg, k_seg
    a, b = lo + (qs - ks), hi + (qs - ks)
    if b < -(lq - 1) or a > lk - 1:
        return None
    if a <= -(lq - 1) and b >= lk - 1:
        return Block(0, lq, 0, lk)
    q0, q1 = max(0, -b), min(lq, lk - a)  # rows that see at least one key
    k0, k1 = max(0, q0 + a), min(lk, q1 + b)  # keys some row sees
    q0, q1, k0, k1 = int(q0), int(q1), int(k0), int(k1)
    d = q1 - k1  # bottom-right offset of the sliced call
    left = -1 if a == -math.inf else int(-(a + d))
    right = -1 if b == math.inf else int(b + d)
    if right == 0:
        return Block(q0, q1, k0, k1, causal=True, window=None if left < 0 else (left, 0))
    return Block(q0, q1, k0, k1, window=None if left < 0 and right < 0 else (left, right))


def _offsets(segments) -> list[int]:
    out, at = [], 0
    for _, length in segments:
        out.append(at)
        at += length
    return out


def _merge_full(blocks: list[Block]) -> list[Block]:
    """Join full blocks that tile a larger rectangle (fewer, larger calls)."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for x in range(len(blocks)):
            for y in range(len(blocks)):
                p, s = blocks[x], blocks[y]
                if x == y or not (p.full and s.full):
                    continue
                if (p.k0, p.k1) == (s.k0, s.k1) and p.q1 == s.q0:
                    joined = Block(p.q0, s.q1, p.k0, p.k1)
                elif (p.q0, p.q1) == (s.q0, s.q1) and p.k1 == s.k0:
                    joined = Block(p.q0, p.q1, p.k0, s.k1)
                else:
                    continue
                blocks = [b for z, b in enumerate(blocks) if z not in (x, y)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda b: (b.q0, b.k0))


def plan_blocks(q_segments, k_segments, lo: float, hi: float) -> list[Block]:
    """The calls for local queries in ``q_segments`` against keys in ``k_segments``.

    Blocks are in local indices of the two shards and never overlap. A shard
    against itself under plain causal is one causal call: local order follows
    global order within a shard, so the local diagonal is the global one.
    """
    n = sum(length for _, length in q_segments)
    if list(q_segments) == list(k_segments) and lo == -math.inf and hi == 0:
        return [Block(0, n, 0, n, causal=True)]
    blocks = []
    for q_seg, q_at in zip(q_segments, _offsets(q_segments), strict=True):
        for k_seg, k_at in zip(k_segments, _offsets(k_segments), strict=True):
            if q_seg[1] == 0 or k_seg[1] == 0:
                continue
            blk = segment_block(q_seg, k_seg, lo, hi)
            if blk is not None:
                blocks.append(
                    Block(
                        blk.q0 + q_at,
                        blk.q1 + q_at,
                        blk.k0 + k_at,
                        blk.k1 + k_at,
                        blk.causal,
                        blk.window,
                    )
                )
    return _merge_full(blocks)

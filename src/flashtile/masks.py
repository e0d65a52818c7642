"""Which keys each query may see: the one source of truth for masking.

Causal alignment is *bottom-right*: query ``i`` of ``Tq`` sits at absolute
position ``i + (Tk - Tq)``, so it sees key ``j`` iff ``j <= i + Tk - Tq``.
When ``Tq == Tk`` this is the usual lower triangle. When ``Tq < Tk`` (decoding
against a cache) the last query sees every key; when ``Tq > Tk`` the first
``Tq - Tk`` queries see no key at all and produce zeros (lse ``-inf``)::

    Tq=2, Tk=5          Tq=5, Tk=2          Tq=Tk=3
    k: 0 1 2 3 4        k: 0 1              k: 0 1 2
    q0 x x x x .        q0 . .              q0 x . .
    q1 x x x x x        q1 . .              q1 x x .
                        q2 . .              q2 x x x
                        q3 x .
                        q4 x x

The scalar helpers are plain Python marked ``register_jitable``: the NumPy
reference calls them as ordinary functions and the compiled kernels inline
them, so both use the same rule. (Without Numba they stay plain Python.)
"""

from __future__ import annotations

import numpy as np

try:
    from numba.extending import register_jitable as _jitable
except ImportError:  # the reference works without Numba

    def _jitable(fn):
        return fn


@_jitable
def causal_offset(tq: int, tk: int) -> int:
    """Shift ``Tk - Tq`` between query row index and absolute position."""
    return tk - tq


@_jitable
def last_visible_key(i: int, tq: int, tk: int, causal: bool) -> int:
    """Largest key index query ``i`` may see (``-1`` when it sees none)."""
    if causal:
        return min(i + tk - tq, tk - 1)
    return tk - 1


@_jitable
def key_stop(q_stop: int, tq: int, tk: int, causal: bool) -> int:
    """Exclusive upper bound on the keys any query in ``[.., q_stop)`` sees.

    Key blocks starting at or after this bound are skipped entirely.
    """
    return max(0, last_visible_key(q_stop - 1, tq, tk, causal) + 1)


@_jitable
def tile_needs_mask(q_start: int, k_stop: int, tq: int, tk: int, causal: bool) -> bool:
    """Whether some key in ``[.., k_stop)`` is hidden from some query ``>= q_start``.

    When False the tile is fully visible and needs no elementwise mask.
    """
    return last_visible_key(q_start, tq, tk, causal) < k_stop - 1


def visible(q_idx: np.ndarray, k_idx: np.ndarray, tq: int, tk: int, causal: bool) -> np.ndarray:
    """Boolean ``(len(q_idx), len(k_idx))`` tile: True where query sees key."""
    q_idx = np.asarray(q_idx)
    k_idx = np.asarray(k_idx)
    if not causal:
        return np.ones((q_idx.size, k_idx.size), dtype=bool)
    return k_idx[None, :] <= q_idx[:, None] + causal_offset(tq, tk)

"""Which keys each query may see: the one source of truth for masking.

Positions. Query ``i`` of ``Tq`` sits at absolute position ``p = i + Tk - Tq``
(*bottom-right* alignment) and key ``j`` at position ``j``. A query sees key
``j`` when all of these hold:

- ``causal``: ``j <= p``;
- ``window=(left, right)``: ``p - left <= j <= p + right`` (a negative side
  is unbounded; with ``causal`` the right side is at most 0);
- key padding: ``j < kv_len`` (the sequence's valid keys; alignment still
  uses ``Tk``, padding only hides keys);
- an optional boolean ``mask[i, j]`` (True = keep), applied elementwise.

Pictures (``x`` = visible)::

    causal, Tq=2, Tk=5     causal, Tq=5, Tk=2     causal + window=(2, 0), Tq=3, Tk=6
    k: 0 1 2 3 4           k: 0 1                 k: 0 1 2 3 4 5
    q0 x x x x .           q0 . .   <- no key     q0 . x x x . .    (p = 3)
    q1 x x x x x           q1 . .                 q1 . . x x x .    (p = 4)
                           q2 . .                 q2 . . . x x x    (p = 5)
                           q3 x .
                           q4 x x

For every query the positional rules leave one contiguous key range
``[lo, hi)`` (:func:`key_bounds`), and ``lo`` and ``hi`` never decrease as
``i`` grows: a block of queries ``[i0, i1)`` needs keys ``[lo(i0), hi(i1-1))``
only, which is how every kernel skips whole tiles.

The scalar helpers are plain Python marked ``register_jitable``: the NumPy
reference calls them as ordinary functions and the compiled kernels inline
them, so both use the same rule. (Without Numba they stay plain Python.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import check_block_size

try:
    from numba.extending import register_jitable as _jitable
except ImportError:  # the reference works without Numba

    def _jitable(fn):
        return fn


@_jitable
def key_bounds(i, tq, tk, causal, left, right, kv_len):
    """Keys ``[lo, hi)`` that query ``i`` may see by position (empty when ``hi <= lo``).

    ``left``/``right`` < 0 mean unbounded; ``kv_len`` is the number of valid
    keys (``tk`` without padding). ``hi`` may be below ``lo``: both ends stay
    monotone in ``i`` that way, which :func:`block_key_range` relies on.
    """
    p = i + tk - tq
    hi = kv_len
    if causal:
        hi = min(hi, p + 1)
    if right >= 0:
        hi = min(hi, p + right + 1)
    lo = 0
    if left >= 0:
        lo = max(lo, p - left)
    return lo, hi


@_jitable
def block_key_range(i0, i1, tq, tk, causal, left, right, kv_len):
    """Keys ``[lo, hi)`` that any query in ``[i0, i1)`` may see (empty: ``lo == hi``).

    Both ends of a row's range never decrease with ``i``, so the union of the
    rows' ranges lies within the first row's ``lo`` and the last row's ``hi``.
    """
    lo, _ = key_bounds(i0, tq, tk, causal, left, right, kv_len)
    _, hi = key_bounds(i1 - 1, tq, tk, causal, left, right, kv_len)
    return lo, max(lo, hi)


@_jitable
def tile_fully_visible(i0, i1, j0, j1, tq, tk, causal, left, right, kv_len):
    """Whether every query in ``[i0, i1)`` sees every key in ``[j0, j1)``.

    When True the tile needs no per-row limits (the common case away from
    the edges of the band).
    """
    lo, _ = key_bounds(i1 - 1, tq, tk, causal, left, right, kv_len)
    _, hi = key_bounds(i0, tq, tk, causal, left, right, kv_len)
    return lo <= j0 and hi >= j1


#: A window side at or beyond this many keys is unbounded (-1): wider than any
#: sequence, and small enough that positions plus sides stay within int64.
WINDOW_UNBOUNDED = 2**62


def normalize_window(window, causal: bool) -> tuple[int, int]:
    """``window`` as ``(left, right)`` ints with -1 = unbounded; causal caps right at 0.

    A side of :data:`WINDOW_UNBOUNDED` (2**62) keys or more, Python ints past
    int64 included, is the same as unbounded.
    """
    if window is None:
        left, right = -1, -1
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(
                f"window must be a pair (left, right), got {window!r}: "
                f"e.g. window=(256, 0) for a causal sliding window of 257 keys"
            ) from None
        sides = []
        for name, side in (("left", left), ("right", right)):
            if side is None:
                side = -1
            if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
                raise TypeError(f"window {name} must be an int or None, got {side!r}")
            if side < -1:
                raise ValueError(
                    f"window {name}={side}: use a count >= 0, or -1 / None for unbounded"
                )
            sides.append(-1 if side >= WINDOW_UNBOUNDED else int(side))
        left, right = sides
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible(q_idx, k_idx, tq, tk, causal, left=-1, right=-1, kv_len=None) -> np.ndarray:
    """Boolean ``(len(q_idx), len(k_idx))`` tile of the positional rules.

    ``kv_len`` may be an int or an array ``(B,)``; then the result gets a
    leading batch axis ``(B, 1, nq, nk)`` ready to broadcast over heads.
    """
    q_idx = np.asarray(q_idx)[:, None]
    k_idx = np.asarray(k_idx)[None, :]
    p = q_idx + tk - tq
    keep = np.ones((q_idx.shape[0], k_idx.shape[1]), dtype=bool)
    if causal:
        keep &= k_idx <= p
    if right >= 0:
        keep &= k_idx <= p + right
    if left >= 0:
        keep &= k_idx >= p - left
    if kv_len is None:
        return keep
    kv_len = np.asarray(kv_len)
    if kv_len.ndim == 0:
        return keep & (k_idx < kv_len)
    return keep & (k_idx < kv_len[:, None, None, None])


#: Tile states of a block map (:attr:`BlockMask.states`), as the kernels read
#: them: no entry kept (the tile is skipped), some kept (the kernel reads the
#: mask), every entry kept (no elementwise mask). Plain ints so that the
#: compiled kernels can use them; ``BlockMask.EMPTY`` etc. name the same values.
TILE_EMPTY, TILE_PARTIAL, TILE_FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockMask:
    """A boolean mask summarised per tile, for skipping (FlexAttention's BlockMask).

    Build it with :func:`block_mask`. One built by hand is checked: the mask
    is copied (read-only, so later edits of the caller's array change
    nothing) and ``states``, when given, must agree with it: a tile may be
    marked PARTIAL whatever it holds (the kernel then reads the mask), but
    EMPTY and FULL must be true of the mask. ``states=None`` summarises.

    Attributes:
        mask: ``(Bm, Hm, Tq, Tk)`` bool, True = keep (``Bm``/``Hm`` may be 1).
        block_q, block_k: the tile sizes of the summary.
        states: ``(Bm, Hm, ceil(Tq/block_q), ceil(Tk/block_k))`` int8:
            0 = no entry kept (the tile is skipped), 1 = partial (the kernel
            reads the mask), 2 = every entry kept (no elementwise mask).
    """

    mask: np.ndarray
    block_q: int
    block_k: int
    states: np.ndarray | None = None

    EMPTY, PARTIAL, FULL = TILE_EMPTY, TILE_PARTIAL, TILE_FULL

    def __post_init__(self):
        mask = np.asarray(self.mask)
        if mask.dtype != bool:
            raise TypeError(
                f"block_mask needs a boolean mask (True = keep), got dtype {mask.dtype}"
            )
        if not 2 <= mask.ndim <= 4:
            raise ValueError(f"mask has shape {mask.shape}; expected (Tq, Tk) up to (B, H, Tq, Tk)")
        block_q = check_block_size(self.block_q, "block_q")
        block_k = check_block_size(self.block_k, "block_k")
        # A private, read-only copy: editing the caller's array later must not
        # change what this summary (and every call reusing it) computes.
        mask4 = np.array(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), order="C", copy=True)
        mask4.flags.writeable = False
        states = tile_states(mask4, block_q, block_k)
        if self.states is not None:
            states = _checked_states(self.states, states, block_q, block_k)
        states.flags.writeable = False
        for name, value in (("mask", mask4), ("block_q", block_q), ("block_k", block_k)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "states", states)

    def counts(self) -> dict[str, int]:
        """How many tiles are empty, partial and full."""
        kinds = (("empty", self.EMPTY), ("partial", self.PARTIAL), ("full", self.FULL))
        return {name: int(np.count_nonzero(self.states == value)) for name, value in kinds}


def _checked_states(given, summary: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Hand-given ``states`` as int8, refused where they claim more than the mask."""
    states = np.asarray(given)
    if states.shape != summary.shape:
        raise ValueError(
            f"BlockMask states has shape {states.shape}, expected {summary.shape} "
            f"(Bm, Hm, ceil(Tq/{block_q}), ceil(Tk/{block_k})): build it with "
            f"flashtile.block_mask(mask, {block_q}, {block_k})"
        )
    if states.dtype.kind not in "iu" or not np.isin(states, (0, 1, 2)).all():
        raise ValueError(
            "BlockMask states must hold 0 (empty), 1 (partial) or 2 (full) integers, "
            f"got dtype {states.dtype} with values {np.unique(states)[:8].tolist()}"
        )
    wrong = (states != BlockMask.PARTIAL) & (states != summary)
    if wrong.any():
        tile = tuple(int(i) for i in np.argwhere(wrong)[0])
        raise ValueError(
            f"BlockMask states mark tile {tile} as {int(states[tile])} but its mask makes "
            f"it {int(summary[tile])} (0 = empty, 1 = partial, 2 = full): a skipped or "
            f"unmasked tile would give wrong results; build it with flashtile.block_mask"
        )
    return states.astype(np.int8)


def block_mask(mask, block_q: int, block_k: int) -> BlockMask:
    """Summarise a boolean mask ``(..., Tq, Tk)`` (up to 4 dims) into tile states.

    Build it once and pass it as ``mask=`` to reuse the summary across calls;
    the kernels use their own tile sizes when these differ. The mask is
    copied: later edits of ``mask`` do not change the result.
    """
    return BlockMask(mask, block_q, block_k)


def tile_states(mask4: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """``(Bm, Hm, ceil(Tq/block_q), ceil(Tk/block_k))`` int8 states of a 4-D bool mask."""
    bm, hm, tq, tk = mask4.shape
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    if mask4.size == 0:  # no tiles, or tiles of nothing
        return np.zeros((bm, hm, nq, nk), dtype=np.int8)
    mask4 = np.ascontiguousarray(mask4)
    # A tile larger than the mask is one tile of the whole mask: summarise with
    # the mask's extent, so that padding never allocates more than the mask.
    block_q, block_k = min(block_q, tq), min(block_k, tk)
    # Ragged edge tiles are padded by repeating their own last row/column:
    # neutral for both "any kept" and "all kept".
    padded = mask4
    if (tq, tk) != (nq * block_q, nk * block_k):
        pad = ((0, 0), (0, 0), (0, nq * block_q - tq), (0, nk * block_k - tk))
        padded = np.pad(mask4, pad, mode="edge")
    # Reduce over a tile's rows first (a streaming, vectorised pass), then over
    # its columns. True is the byte 1, so 8 bools read as one uint64 word
    # reduce 8 at a time: 3-4x faster than np.any over both tile axes.
    word, ones = (np.uint64, 0x0101010101010101) if block_k % 8 == 0 else (np.uint8, 1)
    words = padded.view(word).reshape(bm, hm, nq, block_q, -1)
    per_word = (bm, hm, nq, nk, -1)
    any_kept = (
        np.bitwise_or.reduce(np.bitwise_or.reduce(words, axis=3).reshape(per_word), axis=4) != 0
    )
    all_kept = np.bitwise_and.reduce(
        np.bitwise_and.reduce(words, axis=3).reshape(per_word), axis=4
    ) == word(ones)
    partial_or_empty = np.where(any_kept, BlockMask.PARTIAL, BlockMask.EMPTY)
    return np.where(all_kept, BlockMask.FULL, partial_or_empty).astype(np.int8)

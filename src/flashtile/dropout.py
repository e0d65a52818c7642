"""Attention dropout: which probabilities are kept, decided by a counter-based generator.

Dropout zeroes each attention probability ``P[b, h, i, j]`` with probability
``p`` and scales the kept ones by ``1 / (1 - p)``. The decision for one entry
is a pure function of ``(seed, offset, b, h, i, j)``: a Philox-4x32-10 block
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) with

    key     = (seed mod 2**32, seed div 2**32)
    counter = (j div 8, i, b * 2**16 + h, offset)

gives four 32-bit words, i.e. eight 16-bit values, one per key column ``j ..
j + 7`` (column ``j`` takes half ``j mod 2`` of word ``(j div 2) mod 4``). The
entry is kept iff its 16-bit value is at least ``round(p * 2**16)``. So the
backward regenerates exactly the forward's mask, and the mask does not depend
on tile sizes, threads, the order of work or the backend: the NumPy oracle
(:func:`keep_mask`) and the compiled kernels call the same :func:`philox`.

``i`` and ``j`` are row indices into the arrays the caller passed (for packed
variable-length batches, rows of the packed arrays, with ``b = 0``), ``h`` the
query head. The normaliser (``lse``) is that of the undropped softmax, as in
every dropout implementation: dropout acts on the probabilities, not the scores.
"""

from __future__ import annotations

import numbers

import numpy as np

try:
    from numba.extending import register_jitable as _jitable
except ImportError:  # the oracle works without Numba

    def _jitable(fn):
        return fn


#: Philox-4x32's multipliers and key increments (Random123).
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
PHILOX_ROUNDS = 10
_SHIFT32 = np.uint64(32)
#: Keep/drop values are 16 bits wide: eight per Philox block.
KEEP_BITS = 16
#: Heads and batch entries share one counter word: each must stay below this.
COUNTER_LIMIT = 1 << 16


@_jitable
def philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``.

    Every argument is a ``np.uint32`` (or a uint32 array: the NumPy oracle
    evaluates many blocks at once); returns the four output words as uint32.
    Each product is a 32 x 32 -> 64-bit multiply (exact in uint64) and every
    other value is truncated to 32 bits as soon as it is formed, which lets
    LLVM vectorise a loop of blocks (``vpmuludq``: 2x the scalar rate on AVX2).
    """
    u32, u64 = np.uint32, np.uint64
    for _ in range(PHILOX_ROUNDS):
        a = PHILOX_M0 * u64(c0)
        b = PHILOX_M1 * u64(c2)
        c0, c1, c2, c3 = (
            u32(u32(b >> _SHIFT32) ^ c1 ^ k0),
            u32(b),
            u32(u32(a >> _SHIFT32) ^ c3 ^ k1),
            u32(a),
        )
        k0 = u32(k0 + PHILOX_W0)
        k1 = u32(k1 + PHILOX_W1)
    return c0, c1, c2, c3


def keep_threshold(p: float) -> int:
    """The 16-bit threshold of drop probability ``p``: keep iff value >= it
    (0 for ``p = 0``: nothing dropped). The drop probability is thus ``p``
    rounded to a multiple of ``2**-16``, at least ``2**-16`` for ``p > 0``;
    kept entries are scaled by ``1 / (1 - p)`` with ``p`` as given."""
    return max(1, round(p * (1 << KEEP_BITS))) if p > 0.0 else 0


def check_dropout(dropout_p, dropout_seed, dropout_offset) -> tuple[float, int, int]:
    """``(p, seed, offset)`` validated: ``0 <= p < 1``; with ``p > 0`` a seed in
    ``[0, 2**64)`` and an offset in ``[0, 2**32)`` (integers, not bools)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(
            f"dropout_p must lie in [0, 1), got {p}: 1 would drop every probability "
            f"(its scale 1 / (1 - p) is infinite)"
        )
    if keep_threshold(p) >= 1 << KEEP_BITS:
        raise ValueError(
            f"dropout_p={p} rounds to 1 at the generator's resolution of 2**-16 (every "
            f"probability dropped, each kept one scaled by {1 / (1 - p):.3g}): use at most "
            f"{1 - 2.0**-KEEP_BITS}"
        )
    if p == 0.0:  # seed and offset unused, but still of the right kind when given
        _check_counter_words(0 if dropout_seed is None else dropout_seed, dropout_offset)
        return 0.0, 0, 0
    if dropout_seed is None:
        raise ValueError(
            f"dropout_p={p} needs a dropout_seed (an integer in [0, 2**64)): the backward "
            f"regenerates the forward's mask from it (flashtile.torch draws one from torch's "
            f"generator)"
        )
    _check_counter_words(dropout_seed, dropout_offset)
    return p, int(dropout_seed), int(dropout_offset)


def _check_counter_words(dropout_seed, dropout_offset) -> None:
    checks = ((dropout_seed, "dropout_seed", 64), (dropout_offset, "dropout_offset", 32))
    for value, name, bits in checks:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if not 0 <= int(value) < 1 << bits:
            raise ValueError(f"{name} must lie in [0, 2**{bits}), got {value}")


def check_counter_range(batch: int, heads: int) -> None:
    """ValueError when batch entries or heads would not fit the counter word."""
    for n, what, fix in ((batch, "batch entries", "split the batch"), (heads, "heads", "")):
        if n > COUNTER_LIMIT:
            raise ValueError(
                f"dropout supports up to {COUNTER_LIMIT} {what}, got {n}"
                + (f": {fix}" if fix else "")
            )


def keep_mask(p, seed, offset, batch, heads, rows, cols) -> np.ndarray:
    """``(batch, heads, len(rows), len(cols))`` bool: which probabilities dropout keeps.

    ``rows`` and ``cols`` are the query and key row indices (integer
    sequences, e.g. ``range(Tq)``); the oracle and ``S_dmask``-style
    inspection use it, the kernels evaluate the same blocks tile by tile.
    """
    rows = np.asarray(rows, dtype=np.uint32)
    cols = np.asarray(cols, dtype=np.uint32)
    if p == 0.0:
        return np.ones((batch, heads, rows.size, cols.size), dtype=bool)
    u32 = np.uint32
    bh = (np.arange(batch, dtype=u32)[:, None] << u32(16)) | np.arange(heads, dtype=u32)
    i = rows[None, None, :, None]
    j = cols[None, None, None, :]
    words = philox(
        j >> u32(3), i, bh[:, :, None, None], u32(offset), u32(seed & 0xFFFFFFFF), u32(seed >> 32)
    )
    which = ((j >> u32(1)) & u32(3)).astype(np.intp)
    word = np.choose(which, np.broadcast_arrays(*words))
    value = (word >> ((j & u32(1)) * u32(KEEP_BITS))) & u32(0xFFFF)
    return value >= keep_threshold(p)

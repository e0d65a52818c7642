"""Vectorisable row primitives for the score tiles: ``max`` and ``2**x``.

Numba compiles ``max(a, b)`` on floats with NaN semantics, which keeps a
single running-max loop scalar (0.7 G elements/s per core measured here).
:func:`row_max` keeps eight independent partial maxima instead, which LLVM
packs into one vector register (about 5 G elements/s).

``math.exp`` compiles to a scalar libm call per element and does not
vectorise. Here ``2**x = 2**n * 2**f`` with ``n = trunc(x)`` and
``f = x - n`` in ``(-1, 0]``: ``2**f`` is a degree-6 polynomial (Horner, FMAs)
and ``2**n`` is built directly as the float32 bit pattern ``(n + 127) << 23``
in an int32 buffer that is then read as float32. Every step is branch-free, so
LLVM emits packed FMAs (ymm/zmm) for the loops.

The forward calls this on scores minus a reference that is normally at or
above their max (``x <= 0``), and uses a result above 1 to detect a score
that jumped past the reference. So the input is clamped on both sides:
below -127 (``-inf`` included) to -127, whose bit pattern
``(-127 + 127) << 23`` is exactly 0.0 (a masked score comes out as an exact
zero; true values that small, < 6e-39, are far below float32 rounding of a
row sum), and above 127 to 127, so a jump gives a large finite value rather
than a wrapped-around exponent. Results for ``x > 0`` are only used to detect
the jump, never kept.

float64 tiles use ``math.exp2`` instead, for full double accuracy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from . import FASTMATH

# Coefficients of 2**f on [-1, 0], fitted for minimal maximum *relative*
# error (iteratively reweighted least squares on Chebyshev nodes, in float64,
# then rounded to float32): max relative error 2.1e-7, about float32 epsilon.
_C0 = np.float32(1.0)
_C1 = np.float32(0.6931470036506653)
_C2 = np.float32(0.2402239739894867)
_C3 = np.float32(0.055489420890808105)
_C4 = np.float32(0.00957701075822115)
_C5 = np.float32(0.001273051486350596)
_C6 = np.float32(0.00010851110710063949)
_LOW = np.float32(-127.0)
_HIGH = np.float32(127.0)


@njit(fastmath=FASTMATH, cache=True)
def row_max(row, n):
    """``max(row[:n])`` for ``n >= 1``, vectorised by eight partial maxima."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = row[0]
    n8 = n - n % 8
    for c in range(0, n8, 8):
        a0 = max(a0, row[c])
        a1 = max(a1, row[c + 1])
        a2 = max(a2, row[c + 2])
        a3 = max(a3, row[c + 3])
        a4 = max(a4, row[c + 4])
        a5 = max(a5, row[c + 5])
        a6 = max(a6, row[c + 6])
        a7 = max(a7, row[c + 7])
    mx = max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))
    for c in range(n8, n):
        mx = max(mx, row[c])
    return mx


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f32(row, shift, n, bits):
    """``row[:n] = 2**(row[:n] - shift)`` in place; ``bits`` is int32 scratch.

    Returns ``sum(row[:n])`` after the update (the block's normaliser).
    """
    for j in range(n):
        x = row[j] - shift
        x = _LOW if x < _LOW else x  # NaN stays NaN (the comparison is False)
        x = _HIGH if x > _HIGH else x  # 2**127 at most: finite, and flags a re-base
        xi = np.int32(x)  # truncates toward zero: f = x - xi lies in (-1, 0]
        f = x - np.float32(xi)
        p = _C6
        p = p * f + _C5
        p = p * f + _C4
        p = p * f + _C3
        p = p * f + _C2
        p = p * f + _C1
        p = p * f + _C0
        row[j] = p
        bits[j] = (xi + np.int32(127)) << np.int32(23)
    scale = bits[:n].view(np.float32)
    total = np.float32(0.0)
    for j in range(n):
        v = row[j] * scale[j]
        row[j] = v
        total += v
    return total


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f64(row, shift, n, bits):
    """float64 twin of :func:`exp2_shifted_f32` using ``math.exp2``."""
    total = 0.0
    for j in range(n):
        v = math.exp2(row[j] - shift)
        row[j] = v
        total += v
    return total


def exp2_shifted(row, shift, n, bits):
    """``row[:n] = 2**(row[:n] - shift)``; returns the sum. Dispatches on dtype.

    Only callable from compiled code (the overload below picks the twin).
    """
    raise NotImplementedError("exp2_shifted is only available inside Numba kernels")


@overload(exp2_shifted, fastmath=FASTMATH)
def _exp2_shifted_overload(row, shift, n, bits):
    if row.dtype == types.float32:

        def impl(row, shift, n, bits):
            return exp2_shifted_f32(row, np.float32(shift), n, bits)
    else:

        def impl(row, shift, n, bits):
            return exp2_shifted_f64(row, shift, n, bits)

    return impl

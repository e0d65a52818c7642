"""Vectorisable row primitives for the score tiles: ``max`` and ``2**x``.

Numba compiles ``max(a, b)`` on floats with NaN semantics, which keeps a
single running-max loop scalar (0.7 G elements/s per core measured here).
:func:`row_max` keeps eight independent partial maxima instead, which LLVM
packs into one vector register (about 5 G elements/s).

``math.exp`` compiles to a scalar libm call per element and does not
vectorise. Here ``2**x = 2**n * 2**f`` with ``n = trunc(x)`` and
``f = x - n`` in ``(-1, 0]``: ``2**f`` is a degree-6 polynomial (Horner, FMAs)
and ``2**n`` is built directly as the float32 bit pattern ``(n + 127) << 23``
(:func:`pow2_int`, an LLVM bitcast). Every step is branch-free, so LLVM emits
one packed loop (ymm FMAs) that exponentiates, stores and sums in a single
pass: 2.2 G elements/s per core here, against 1.5 for an earlier two-pass
version that staged the bit patterns in an int32 buffer.

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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from . import FASTMATH
from .half import narrow

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


@intrinsic
def pow2_int(typingctx, n):
    """``2.0**n`` as float32 for an integer ``-127 <= n <= 127``, from its bits.

    The bit pattern ``(n + 127) << 23`` reinterpreted as float32: exact for
    ``n >= -126``, and exactly 0.0 for ``n = -127`` (the clamp's floor). Numba
    has no bit reinterpretation of scalars, hence the intrinsic; it widens or
    narrows any integer type to int32 first (Numba promotes int32 arithmetic
    to int64).
    """
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, i32)
        elif v.type.width < 32:
            v = builder.sext(v, i32)
        v = builder.shl(builder.add(v, i32(127)), i32(23))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(n), codegen


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _exp2_f32(x, shift):
    """``2**(x - shift)`` in float32 by the polynomial above (one element)."""
    x = x - shift
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
    return p * pow2_int(xi)


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f32(row, shift, n):
    """``row[:n] = 2**(row[:n] - shift)`` in place; returns the float32 sum
    (the block's normaliser).

    In place, not ``dst = f(row)`` with ``dst`` the same array: LLVM cannot
    prove two array arguments distinct, its runtime overlap check fails for
    identical ones, and the loop then runs scalar (2x slower kernels).
    """
    total = np.float32(0.0)
    for j in range(n):
        v = _exp2_f32(row[j], shift)
        row[j] = v
        total += v
    return total


@njit(fastmath=FASTMATH, cache=True)
def exp2_bf16_f32(row, dst, shift, n):
    """``dst[:n] = 2**(row[:n] - shift)`` rounded to bf16 bits (``uint16``,
    :func:`.half.narrow`), a buffer of its own; returns the float32 sum of
    the unrounded values."""
    total = np.float32(0.0)
    for j in range(n):
        v = _exp2_f32(row[j], shift)
        dst[j] = narrow(v, dst)
        total += v
    return total


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f64(row, shift, n):
    """float64 twin of :func:`exp2_shifted_f32` using ``math.exp2``."""
    total = 0.0
    for j in range(n):
        v = math.exp2(row[j] - shift)
        row[j] = v
        total += v
    return total


def exp2_into(row, dst, shift, n):
    """``dst[:n] = 2**(row[:n] - shift)``; returns the sum. Dispatches on dtype.

    ``dst`` is a ``uint16`` bf16 buffer, or else ``row`` itself (a float
    ``dst`` is computed in place in ``row``: see :func:`exp2_shifted_f32`).
    Only callable from compiled code (the overload below picks the twin).
    """
    raise NotImplementedError("exp2_into is only available inside Numba kernels")


@overload(exp2_into, fastmath=FASTMATH)
def _exp2_into_overload(row, dst, shift, n):
    if dst.dtype == types.uint16:
        return lambda row, dst, shift, n: exp2_bf16_f32(row, dst, np.float32(shift), n)
    if row.dtype == types.float32:
        return lambda row, dst, shift, n: exp2_shifted_f32(row, np.float32(shift), n)
    return lambda row, dst, shift, n: exp2_shifted_f64(row, shift, n)


def exp2_shifted(row, shift, n):
    """``row[:n] = 2**(row[:n] - shift)``; returns the sum. Dispatches on dtype.

    Only callable from compiled code (the overload below picks the twin).
    """
    raise NotImplementedError("exp2_shifted is only available inside Numba kernels")


@overload(exp2_shifted, fastmath=FASTMATH)
def _exp2_shifted_overload(row, shift, n):
    if row.dtype == types.float32:
        return lambda row, shift, n: exp2_shifted_f32(row, np.float32(shift), n)
    return lambda row, shift, n: exp2_shifted_f64(row, shift, n)

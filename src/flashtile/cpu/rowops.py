"""Vectorisable row primitives for the score tiles: ``max`` and ``2**x``.

Numba compiles ``max(a, b)`` on floats as a compare-and-select, which keeps
a running-max loop scalar (0.7 G elements/s per core measured here);
:func:`row_max` uses LLVM's NaN-propagating ``maximum`` instead, which
vectorises (about 10 G elements/s).

``math.exp`` compiles to a scalar libm call per element and does not
vectorise. Here ``2**x = 2**n * 2**f`` with ``n = trunc(x)`` and
``f = x - n`` in ``(-1, 0]``: ``2**f`` is a degree-6 polynomial (Horner, FMAs)
and ``2**n`` is built directly as the float32 bit pattern ``(n + 127) << 23``
(:func:`pow2_int`, an LLVM bitcast). Every step is branch-free, so LLVM emits
one packed loop (ymm FMAs) that exponentiates, stores and sums in a single
pass: 2.2-2.8 G elements/s per core here, against 1.5 for an earlier two-pass
version that staged the bit patterns in an int32 buffer. bf16 probabilities,
rounded right after, use a degree-4 polynomial (:func:`_exp2_for_bf16`).

Every primitive takes the whole 2-D tile and a row index ``r`` rather than
a row view: creating a view takes a reference on the tile's memory (two
atomic updates per row and call), about 8% of a bf16 forward before.

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
from .half import narrow_operand
from .vectors import wide_vectors

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
# The same fit at degree 4, max relative error 3.1e-6: 1000 times below a
# bf16 rounding step, so bf16 P (rounded right after) does not need degree 6.
_B1 = np.float32(0.6930635571479797)
_B2 = np.float32(0.23945674300193787)
_B3 = np.float32(0.05322356894612312)
_B4 = np.float32(0.006831889506429434)
_LOW = np.float32(-127.0)
_HIGH = np.float32(127.0)


@intrinsic
def _fmaximum(typingctx, a, b):
    """LLVM's ``maximum`` of two floats: NaN if either is NaN.

    Numba's ``max`` on floats is a compare-and-select that LLVM will not
    turn into a vector reduction; ``llvm.maximum`` (NaN-propagating, as a
    row max must be, see :func:`row_max`) vectorises.
    """
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        ty = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maximum", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args)

    return a(a, b), codegen


@intrinsic
def _quotient(typingctx, a, b):
    """``a / b`` as LLVM's plain ``fdiv`` (IEEE: ``x / 0`` is inf or NaN).
    Numba's ``/`` checks for a zero divisor and raises, a branch per element
    that keeps the loop around it scalar (the softcap's loop of
    :func:`_tanh_f32` ran at 0.1-0.2 G elements/s with it, 1.1 without)."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        return builder.fdiv(*args)

    return a(a, b), codegen


def _larger(a, b):
    """The larger of two array elements (NaN-propagating for floats)."""
    raise NotImplementedError("_larger is only available inside Numba kernels")


@overload(_larger, fastmath=FASTMATH, inline="always")
def _larger_overload(a, b):
    if isinstance(a, types.Float):
        return lambda a, b: _fmaximum(a, b)
    return lambda a, b: max(a, b)  # integers (bf16 bit patterns of P >= 0)


@njit(fastmath=FASTMATH, cache=True)
def row_max(s, r, lo, hi):
    """``max(s[r, lo:hi])`` for ``hi > lo``; NaN if any entry is NaN (a NaN
    score must not leave a row looking empty or finite).

    One vectorised reduction (``llvm.maximum``, about 10 G elements/s per
    core here against 2-4 for eight scalar partial maxima); unsigned
    indices, see :func:`exp2_shifted_f32`.
    """
    wide_vectors()
    row = np.uintp(r)
    mx = s[row, np.uintp(lo)]
    for t in range(hi - lo):
        mx = _larger(mx, s[row, np.uintp(lo + t)])
    return mx


@njit(fastmath=FASTMATH, cache=True)
def zero_outside(p, r, lo, hi):
    """``p[r, :lo] = 0`` and ``p[r, hi:] = 0`` (indexed loops: no row views)."""
    wide_vectors()
    row = np.uintp(r)
    for c in range(lo):
        p[row, c] = 0
    for t in range(p.shape[1] - max(hi, 0)):
        p[row, np.uintp(hi + t)] = 0


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
def _exp2_split(x, shift):
    """``(f, n)`` with ``x - shift = n + f`` (clamped, see the module docstring):
    ``n`` an int32, ``f`` in ``(-1, 0]`` (NaN stays NaN)."""
    x = x - shift
    x = _LOW if x < _LOW else x  # NaN stays NaN (the comparison is False)
    x = _HIGH if x > _HIGH else x  # 2**127 at most: finite, and flags a re-base
    xi = np.int32(x)  # truncates toward zero: f = x - xi lies in (-1, 0]
    return x - np.float32(xi), xi


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _exp2_f32(x, shift):
    """``2**(x - shift)`` in float32 by the degree-6 polynomial above (one element)."""
    f, n = _exp2_split(x, shift)
    p = _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    return p * pow2_int(n)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _exp2_for_bf16(x, shift):
    """:func:`_exp2_f32` to 3.1e-6 relative error (degree 4), for ``P``
    that is rounded to bf16 (relative steps of 2**-8) and its row sum."""
    f, n = _exp2_split(x, shift)
    p = _B4
    p = p * f + _B3
    p = p * f + _B2
    p = p * f + _B1
    p = p * f + _C0
    return p * pow2_int(n)


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f32(s, p, r, lo, hi, shift):
    """``s[r, lo:hi] = 2**(s[r, lo:hi] - shift)`` in place; returns the float32
    sum (the block's normaliser). ``p`` is not used (the signature of
    :func:`exp2_into`).

    In place, not ``dst = f(row)`` with ``dst`` the same array: LLVM cannot
    prove two array arguments distinct, its runtime overlap check fails for
    identical ones, and the loop then runs scalar (2x slower kernels).

    The row is indexed, not sliced: a row view per call costs two atomic
    reference-count updates, some 8% of a bf16 forward when taken per row
    of every tile. The indices are unsigned: Numba wraps a negative signed
    index around (``j += n`` when ``j < 0``), which LLVM cannot rule out for
    ``range(lo, hi)``, and that per-element select kept the loop scalar
    (0.3 G elements/s against 2.7).
    """
    wide_vectors()
    total, c = np.float32(0.0), np.float32(shift)
    row = np.uintp(r)
    for t in range(hi - lo):
        j = np.uintp(lo + t)
        v = _exp2_f32(s[row, j], c)
        s[row, j] = v
        total += v
    return total


@njit(fastmath=FASTMATH, cache=True)
def exp2_bf16_f32(s, p, r, lo, hi, shift):
    """``p[r, lo:hi] = 2**(s[r, lo:hi] - shift)`` rounded to bf16 bits
    (``uint16``, :func:`.half.narrow_operand`), a buffer of its own; returns the
    float32 sum of the unrounded values."""
    wide_vectors()
    total, c = np.float32(0.0), np.float32(shift)
    row = np.uintp(r)
    for t in range(hi - lo):
        j = np.uintp(lo + t)
        v = _exp2_for_bf16(s[row, j], c)
        p[row, j] = narrow_operand(v, p)
        total += v
    return total


@njit(fastmath=FASTMATH, cache=True)
def exp2_shifted_f64(s, p, r, lo, hi, shift):
    """float64 twin of :func:`exp2_shifted_f32` using ``math.exp2``, capped
    as it is at ``2**127`` (NaN stays NaN): a ``P`` recomputed from an
    ``lse`` that its scores pass stays finite, so a row whose ``dout`` is
    zero adds exact zeros to the gradients, never ``inf * 0``."""
    wide_vectors()
    total = 0.0
    row = np.uintp(r)
    for t in range(hi - lo):
        j = np.uintp(lo + t)
        x = s[row, j] - shift
        v = math.exp2(_HIGH if x > _HIGH else x)
        s[row, j] = v
        total += v
    return total


def exp2_into(s, p, r, lo, hi, shift):
    """``p[r, lo:hi] = 2**(s[r, lo:hi] - shift)``; returns the sum. Dispatches on dtype.

    ``s`` and ``p`` are 2-D tiles; ``p`` is a ``uint16`` bf16 tile, or else
    ``s`` itself (a float ``p`` is computed in place in ``s``: see
    :func:`exp2_shifted_f32`). Only callable from compiled code (the
    overload below picks the twin).
    """
    raise NotImplementedError("exp2_into is only available inside Numba kernels")


@overload(exp2_into, fastmath=FASTMATH)
def _exp2_into_overload(s, p, r, lo, hi, shift):
    # The implementations themselves, not a lambda that calls them: a wrapper
    # holds its array arguments across the call, two atomic reference counts
    # per array per row that LLVM cannot drop.
    if p.dtype == types.uint16:
        return exp2_bf16_f32.py_func
    if s.dtype == types.float32:
        return exp2_shifted_f32.py_func
    return exp2_shifted_f64.py_func


# tanh's odd Taylor series, x * sum_k T[k] x^(2k), to x^17: below |x| 0.55
# its truncation is under 1e-8 relative (the x^19 term: 2.4e-4 x^19).
_T = tuple(
    np.float32(c)
    for c in (
        1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835, -1382.0 / 155925,
        21844.0 / 6081075, -929569.0 / 638512875, 6404582.0 / 10854718875,
    )
)  # fmt: skip
_TANH_SERIES_LIMIT = np.float32(0.55)
_TWO_LOG2E = np.float32(2.0 * 1.4426950408889634)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _tanh_f32(x):
    """``(tanh(x), 1 - tanh(x)**2)`` in float32, branch-free (vectorises,
    unlike libm's ``tanh``): the series below ``|x|`` 0.55, else ``1 - r``
    with ``r = 2m / (1 + m)``, ``m = e^(-2|x|)`` from :func:`_exp2_f32` (whose
    fit covers exponents at or below 0; no cancellation: the result is at
    least 0.5), the sign put back. The derivative there is ``r (2 - r)``, not
    ``1 - t*t``, which cancels to 0 once ``t`` rounds to 1 (``|x|`` 9).
    Within 3 float32 ulps; inf gives ±1 (derivative 0) and NaN stays NaN."""
    z = x * x
    p = _T[8]
    p = p * z + _T[7]
    p = p * z + _T[6]
    p = p * z + _T[5]
    p = p * z + _T[4]
    p = p * z + _T[3]
    p = p * z + _T[2]
    p = p * z + _T[1]
    p = p * z + _T[0]
    a = abs(x)
    m = _exp2_f32(-a * _TWO_LOG2E, np.float32(0.0))  # (0 from 2**-127 down)
    r = _quotient(np.float32(2.0) * m, np.float32(1.0) + m)
    big = np.float32(1.0) - r
    big = big if x >= np.float32(0.0) else -big  # (NaN: -NaN, still NaN)
    small = x * p
    series = a < _TANH_SERIES_LIMIT
    t = small if series else big
    d = np.float32(1.0) - small * small if series else r * (np.float32(2.0) - r)
    return t, d


def tanh_of(x):
    """``(tanh(x), 1 - tanh(x)**2)`` for a kernel's score dtype (the softcap
    and its derivative): :func:`_tanh_f32` for float32 (libm's scalar
    ``tanh`` kept the loop scalar), ``math.tanh`` for float64. Compiled code
    only (the overload below)."""
    raise NotImplementedError("tanh_of is only available inside Numba kernels")


def _tanh_f64(x):
    t = math.tanh(x)
    return t, 1.0 - t * t


@overload(tanh_of, fastmath=FASTMATH, inline="always")
def _tanh_of_overload(x):
    if x == types.float32:
        return _tanh_f32.py_func
    return _tanh_f64

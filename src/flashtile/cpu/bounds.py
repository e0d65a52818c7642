"""Bounds on a call's scores, compiled: ``max |x|`` over finite entries and
the bound formula that :mod:`flashtile.precision` (which picks a call's
work dtype from them) and the kernels' own check of a prepared call
(:func:`past_limits`, in :func:`.forward.forward_call` and
:func:`.backward.backward_call`) share; and the extremes the backward's
precision rule reads (:func:`rule_extremes`).

Here, not in :mod:`flashtile.precision`, because the kernels call it: the
kernel fingerprint (:mod:`flashtile.cpu`) covers this package's sources.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload, register_jitable

from ..units import LOG2E


def top_finite(a):
    """``max |a|`` over the finite entries of a 1-D contiguous float32/float64
    array, or of bf16 bits (``uint16``), as a float (0 if none). Compiled
    code only (the overload below)."""
    raise NotImplementedError("top_finite is only available inside Numba code")


#: numba dtype -> (integer view, magnitude bits, bits of +inf, bits -> float):
#: a finite float's magnitude orders as its sign-cleared bits, and those of
#: inf and NaN are at or above +inf's (all below the sign bit, so signed
#: compares work).
_BITS = {
    numba.types.float32: (np.int32, 0x7FFFFFFF, 0x7F800000, np.float32),
    numba.types.float64: (np.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, np.float64),
    numba.types.uint16: (np.int16, 0x7FFF, 0x7F80, None),  # bf16: the top half of a float32
}


@overload(top_finite)
def _top_finite_overload(a):
    view, magnitude, inf, float_type = _BITS[a.dtype]
    magnitude, inf = view(magnitude), view(inf)

    def impl(a):
        # One pass of integer compares on the bits, which vectorises.
        bits = a.view(view)
        top = view(0)
        for i in range(bits.size):
            x = bits[i] & magnitude
            x = x if x < inf else view(0)
            top = x if x > top else top
        if float_type is None:  # bf16 bits: the top half of a float32's
            wide = np.empty(1, dtype=np.int32)
            wide[0] = top << 16  # (Numba computes it in int64: stored back as int32)
            return float(wide.view(np.float32)[0])
        out = np.empty(1, dtype=view)
        out[0] = top
        return float(out.view(float_type)[0])

    return impl


@numba.njit(cache=True)  # no fastmath: exact integer compares
def max_abs_compiled(a):
    """:func:`top_finite` of one array."""
    return top_finite(a)


@numba.njit(cache=True)  # no fastmath: exact integer compares
def bounds_compiled(q, k, d, scale, additive):
    """:func:`bound_formula` from the maxima of two arrays, in one compiled call
    (a small call's bound cost more in Python around the passes than in them)."""
    return bound_formula(top_finite(q), top_finite(k), d, scale, additive)


@register_jitable(fastmath=False)  # (not the calling kernel's: the planner's bound exactly)
def past_limits(q, k, scale, score_limit, products_limit):
    """Whether the bounds of a call's ``q, k`` (C-contiguous, 4-D) reach
    either limit (log2 units; inf to check nothing, which reads no value):
    a prepared call's check of its values, made in the kernel's compiled
    call (a separate compiled pass from Python made a tiny call 1.3 us
    slower). No additive term: only for calls without ALiBi slopes or an
    additive mask."""
    if not (score_limit < np.inf or products_limit < np.inf) or q.size == 0 or k.size == 0:
        return False
    top_q, top_k = top_finite(q.reshape(q.size)), top_finite(k.reshape(k.size))
    score, products = bound_formula(top_q, top_k, q.shape[3], scale, 0.0)
    return score >= score_limit or products >= products_limit


@numba.njit(cache=True)  # no fastmath: the NaN tests must stay
def rule_extremes(lse, sums):
    """``(min, max)`` of ``lse`` taken in the dtype of ``sums``, and ``max``
    of ``sums``, NaN left out (NaN where every entry is): NumPy's ``fmin``
    and ``fmax`` reductions, in one compiled call (the three NumPy
    reductions and the cast cost a tiny backward 7 us). 1-D C-contiguous
    float32/float64 arrays, at least one entry."""
    nan = sums.dtype.type(np.nan)
    lo, hi, top = nan, nan, nan
    for i in range(lse.size):
        x = sums.dtype.type(lse[i])
        if not np.isnan(x):
            lo = x if np.isnan(lo) or x < lo else lo
            hi = x if np.isnan(hi) or x > hi else hi
    for i in range(sums.size):
        x = sums[i]
        if not np.isnan(x):
            top = x if np.isnan(top) or x > top else top
    return float(lo), float(hi), float(top)


@register_jitable(fastmath=False)
def bound_formula(big_q, big_k, d, scale, additive):
    """``(score_bound, product_bound)`` from ``max |q|``, ``max |k|`` over
    finite entries, the head dim, the scale and :func:`flashtile.precision.additive_bound`
    (see :func:`flashtile.precision.bounds`). Python and compiled code."""
    raw = max(1.0, big_q) * max(1.0, d * big_k)
    return LOG2E * (abs(scale) * raw + additive), LOG2E * raw

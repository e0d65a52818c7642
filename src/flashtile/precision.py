"""Which dtype a call computes in: float32 scores must stay inside float32's range.

float16 and float32 inputs are computed in float32 (:func:`compute_dtype`).
The kernels work in log2 units: they scale the query tile by ``scale *
log2(e)``, compare scores with a reference above the row's max and add the
ALiBi and float-mask terms. A score past float32's range there becomes inf
and its row NaN, while float64 would be exact (a ``scale`` of 1e38, values
near 1e19, huge ALiBi slopes). Such calls are computed in float64 instead;
the results are cast back (an ``lse`` past float32's range becomes inf).

The rule is one bound on the magnitude of every score (:func:`score_bound`).
Calls on the forward kernel check it before planning (one pass over ``q``
and ``k``); decoding (and attention calls routed to the decode kernel),
whose cost is reading the cache once, checks it only when a raw score was
not finite or a row that sees keys got a non-finite ``lse``
(:func:`decode_overflowed`), and then computes the step again in float64.
NaN and inf entries are left out of the bound: the NaN policy covers the
rows they reach, and the other rows still need the right dtype.

An overflow need not show in ``lse``: softcap maps an infinite score to the
cap, and q.k partial sums that overflow and cancel give ``-inf`` for a
finite score (the key is dropped). So the decode kernel also reports any
raw score (out of the product or the tile step's recompute of a row, before
softcap and the other variants) that is not finite, and that too raises the
question
(:func:`flashtile.cpu.tile_step.flag_non_finite`). ``tests/test_hardening.py``
holds such inputs for both kernels. What no check after the call can see:
terms of q.k near float32's largest value that cancel to a finite but
inexact score (rounding, not range); the forward's bound sends such inputs
to float64, decoding computes them in float32.
"""

from __future__ import annotations

import math
import struct

import numba
import numpy as np

from ._validate import BFLOAT16, compute_dtype
from .variants import Variants

LOG2E = math.log2(math.e)
#: A bound on float32 scores in log2 units: 8x below float32's largest value
#: leaves room for the sums and differences the online softmax forms.
FLOAT32_SCORE_LIMIT = float(np.finfo(np.float32).max) / 8
#: float16's largest value: a float16 input is bounded by its dtype (no pass over it).
FLOAT16_MAX = float(np.finfo(np.float16).max)


def finite_max_abs(a: np.ndarray) -> float:
    """``max |a|`` over the finite entries of ``a``, as a Python float (0 if none)."""
    if a.size == 0:
        return 0.0
    route = _bits_route(a)
    if route is not None:
        bits, magnitude, inf, as_float = route
        return as_float(_top_finite_magnitude(bits, magnitude, inf))
    hi, lo = float(a.max()), float(a.min())
    if math.isfinite(hi) and math.isfinite(lo):  # the common case: two fast passes
        return max(hi, -lo)
    return float(np.max(np.abs(a), where=np.isfinite(a), initial=0.0))


def _bits_route(a: np.ndarray):
    """``(bits, magnitude, inf, as_float)`` when ``max |a|`` is taken in one
    pass over its bits (:data:`_MAGNITUDE_BITS`), else None. The route for
    contiguous arrays, and for bf16 always (ml_dtypes' own max is some 40x
    slower than copying a strided array first)."""
    known = _MAGNITUDE_BITS.get(a.dtype)
    if known is None or not (a.flags.c_contiguous or a.dtype == BFLOAT16):
        return None
    view, magnitude, inf, as_float = known
    return a.reshape(-1).view(view), magnitude, inf, as_float


def _finite_max_abs_pair(q: np.ndarray, k: np.ndarray) -> tuple[float, float]:
    """:func:`finite_max_abs` of ``q`` and ``k`` (float16: its largest value,
    no pass); two arrays on the bits route in one compiled call (a small
    call's bound cost two calls' Python around them: 9.6 -> 7.5 us)."""
    routes = (q.dtype == k.dtype and q.size and k.size) and (_bits_route(q), _bits_route(k))
    if not routes or None in routes:
        return tuple(FLOAT16_MAX if a.dtype == np.float16 else finite_max_abs(a) for a in (q, k))
    (q_bits, magnitude, inf, as_float), (k_bits, *_) = routes
    tops = _top_finite_magnitudes(q_bits, k_bits, magnitude, inf)
    return as_float(tops[0]), as_float(tops[1])


#: dtype -> (signed integer view, magnitude bits, bits of +inf, bits -> float):
#: a finite float's magnitude orders as its sign-cleared bits, and those of
#: inf and NaN are at or above +inf's (all below the sign bit, so signed
#: compares work).
_MAGNITUDE_BITS = {
    np.dtype(np.float32): (
        np.int32, np.int32(0x7FFFFFFF), np.int32(0x7F800000),
        lambda top: struct.unpack("=f", struct.pack("=i", top))[0],
    ),
    np.dtype(np.float64): (
        np.int64, np.int64(0x7FFFFFFFFFFFFFFF), np.int64(0x7FF0000000000000),
        lambda top: struct.unpack("=d", struct.pack("=q", top))[0],
    ),
    np.dtype(BFLOAT16): (
        np.int16, np.int16(0x7FFF), np.int16(0x7F80),
        lambda top: float(np.array(top, dtype=np.int16).view(BFLOAT16)),
    ),
}  # fmt: skip


@numba.njit(cache=True)  # no fastmath: exact integer compares
def _top_finite_magnitude(bits, magnitude, inf):
    """The largest ``bits & magnitude`` below ``inf`` (0 if none): the bits of
    ``max |a|`` over the finite entries, in one pass that vectorises (the
    selects and the maximum stay in the integer type of ``bits``)."""
    zero = bits.dtype.type(0)
    top = zero
    for i in range(bits.size):
        x = bits[i] & magnitude
        x = x if x < inf else zero
        top = x if x > top else top
    return top


@numba.njit(cache=True)  # no fastmath: exact integer compares
def _top_finite_magnitudes(a_bits, b_bits, magnitude, inf):
    """:func:`_top_finite_magnitude` of two arrays in one call."""
    return _top_finite_magnitude(a_bits, magnitude, inf), _top_finite_magnitude(
        b_bits, magnitude, inf
    )


def additive_bound(va: Variants, tq: int, tk: int) -> float:
    """A bound on ``|ALiBi bias| + |float mask|`` over the visible entries."""
    bound = 0.0
    if va.alibi is not None:  # |p - j| < max(Tq, Tk); counted once even for Tq = Tk = 1
        bound += finite_max_abs(va.alibi) * max(tq, tk, 1)
    if va.mask_add is not None:  # -inf entries are hidden, not added
        bound += finite_max_abs(va.mask_add)
    return bound


def score_bound(scale: float, q: np.ndarray, k: np.ndarray, va: Variants, tq: int, tk: int):
    """A bound on every score and on the scaled query tile, in log2 units.

    ``|scale| max(1, max|q|) max(1, d max|k|) + additive_bound``, times
    ``log2(e)``: it covers ``|scale q . k|``, the query tile ``scale *
    log2(e) * q`` and the multiplier itself. ``q (..., d)`` and ``k``: the
    call's arrays (float16 ones are bounded by their dtype).
    """
    return bounds(scale, q, k, va, tq, tk)[0]


def bounds(scale: float, q: np.ndarray, k: np.ndarray, va: Variants, tq: int, tk: int):
    """``(score_bound, product_bound)``: :func:`score_bound`, and a bound on the
    unscaled products ``|q . k|`` in log2 units. bf16 tile products sum
    ``q . k`` in float32 before the gemm applies the scale
    (:func:`flashtile.cpu.half.split_scale`), so they need the second one
    inside float32's range too (a tiny ``scale`` with huge values)."""
    big_q, big_k = _finite_max_abs_pair(q, k)
    raw = max(1.0, big_q) * max(1.0, q.shape[-1] * big_k)
    return LOG2E * (abs(scale) * raw + additive_bound(va, tq, tk)), LOG2E * raw


def work_dtype(dtype: np.dtype, bound: float) -> np.dtype:
    """The dtype to compute inputs of ``dtype`` in, given :func:`score_bound`:
    :func:`compute_dtype`, or float64 where float32 scores could overflow."""
    work = compute_dtype(dtype)
    return np.dtype(np.float64) if bound >= FLOAT32_SCORE_LIMIT else work


def decode_overflowed(
    lse: np.ndarray, seqlens: np.ndarray, bound, flagged: bool, finite: bool
) -> bool:
    """Whether a float32 decode step must be computed again in float64.

    A raw score that was not finite (``flagged``, from the kernel) or a row of
    a non-empty sequence with a non-finite ``lse (B, Hq, Tq)`` raises the
    question (cheap tests); then ``bound()``, the call's :func:`score_bound`
    (a pass over the cache), answers it. ``finite``: the kernel found every
    ``lse`` finite.
    """
    if lse.dtype == np.float64:
        return False
    if flagged:
        return bound() >= FLOAT32_SCORE_LIMIT
    if finite:  # the common case
        return False
    # -inf is expected only in the rows of empty sequences.
    odd = ~np.isfinite(lse) & ~(np.isneginf(lse) & (seqlens == 0)[:, None, None])
    return bool(odd.any()) and bound() >= FLOAT32_SCORE_LIMIT


def narrow_lse(lse: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``lse`` in the compute dtype of inputs of ``dtype`` (float32 for float16
    and float32 inputs also when float64 was needed); past float32's range: inf."""
    narrow = compute_dtype(dtype)
    if lse.dtype == narrow:  # the common case: nothing to cast (errstate costs microseconds)
        return lse
    with np.errstate(over="ignore"):
        return lse.astype(narrow)

"""Which dtype a call computes in: float32 scores must stay inside float32's range.

float16 and float32 inputs are computed in float32 (:func:`compute_dtype`).
The kernels work in log2 units: they scale the query tile by ``scale *
log2(e)``, compare scores with a reference above the row's max and add the
ALiBi and float-mask terms. A score past float32's range there becomes inf
and its row NaN, while float64 would be exact (a ``scale`` of 1e38, values
near 1e19, huge ALiBi slopes). Such calls are computed in float64 instead;
the results are cast back (an ``lse`` past float32's range becomes inf).

The rule is one bound on the magnitude of every score (:func:`bounds`).
Calls on the forward kernel check it before planning (one pass over ``q``
and ``k``; a prepared call's kernel makes that pass itself, in the same
compiled call, :func:`flashtile.cpu.forward.forward_call`); decoding (and
attention calls routed to the decode kernel), whose cost is reading the
cache once, checks it only when a raw score was not finite or a row that
sees keys got a non-finite ``lse`` (:func:`decode_overflowed`), and then
computes the step again in float64.
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

bf16 tile products (oneMKL's bf16 gemm or flashtile's: ``vdpbf16ps`` or AMX) flush terms
of ``q . k`` below float32's smallest normal to zero, and sum ``q . k``
before the scale. Neither shows after the call when the scale is huge and
the values tiny (every score then reads 0): :func:`bf16_products_fit` keeps
such calls on float32 products, decided before the call from the scale.
The products flush bf16 *inputs* below float32's smallest normal too; that
matters only where such a value meets a huge one (``1e-39 * 1e35``): the
forward's score bound sends such calls to float64 in practice (the huge
value makes it large), decoding (which does
not read the cache before the step) computes them with the terms lost.

The backward recomputes ``P = exp(s - lse)`` from its own scores and the
stored ``lse``, so the rounding of both lands in the exponent of every
``P``, and nothing normalises it away as the forward's running sum does
(float32, d = 4: ``dv`` was 31% off at ``|lse|`` 5e6, inf at 7e10, while
the forward was right). :func:`failing_rows` is the rule, decided after
the backward ran (:mod:`flashtile.gradients` acts on it): the rows' sums of
``P``, which the kernel returns, must not pass 1, and ``|lse|`` must be
small enough for the work dtype to resolve the scores near it.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from ._validate import BFLOAT16, compute_dtype
from .cpu.bounds import bound_formula, bounds_compiled, max_abs_compiled, rule_extremes
from .units import LOG2E
from .variants import Variants

#: A bound on float32 scores in log2 units: 8x below float32's largest value
#: leaves room for the sums and differences the online softmax forms.
FLOAT32_SCORE_LIMIT = float(np.finfo(np.float32).max) / 8
#: float16's largest value: a float16 input is bounded by its dtype (no pass over it).
FLOAT16_MAX = float(np.finfo(np.float16).max)


def finite_max_abs(a: np.ndarray) -> float:
    """``max |a|`` over the finite entries of ``a``, as a Python float (0 if none)."""
    if a.size == 0:
        return 0.0
    bits = _compiled_operands(a)[0]
    if bits is not None:
        return max_abs_compiled(bits)
    hi, lo = float(a.max()), float(a.min())
    if math.isfinite(hi) and math.isfinite(lo):  # the common case: two fast passes
        return max(hi, -lo)
    return float(np.max(np.abs(a), where=np.isfinite(a), initial=0.0))


def _compiled_operands(*arrays: np.ndarray) -> list:
    """Each array as the compiled maxima read it (:mod:`flashtile.cpu.bounds`),
    or None: a C-contiguous float32/float64 array, flat (one compilation per dtype,
    not per rank); bf16 always, as its ``uint16`` bits (a strided one copied
    first: ml_dtypes' own max is some 40x slower than the copy). Several in
    one call: a call's bound reads ``q`` and ``k``."""
    operands = []
    for a in arrays:
        if a.dtype == BFLOAT16:
            operands.append(np.ascontiguousarray(a).reshape(-1).view(np.uint16))
        elif a.dtype in _COMPILED_FLOATS and a.flags.c_contiguous:
            operands.append(a.reshape(-1))
        else:
            operands.append(None)
    return operands


_COMPILED_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def additive_bound(va: Variants, tq: int, tk: int) -> float:
    """A bound on ``|ALiBi bias| + |float mask|`` over the visible entries."""
    bound = 0.0
    if va.alibi is not None:  # |p - j| < max(Tq, Tk); counted once even for Tq = Tk = 1
        bound += finite_max_abs(va.alibi) * max(tq, tk, 1)
    if va.mask_add is not None:  # -inf entries are hidden, not added
        bound += finite_max_abs(va.mask_add)
    return bound


def bounds(scale: float, q: np.ndarray, k: np.ndarray, va: Variants, tq: int, tk: int):
    """``(score_bound, product_bound)`` in log2 units.

    The score bound covers every score and the scaled query tile:
    ``|scale| max(1, max|q|) max(1, d max|k|) + additive_bound``, times
    ``log2(e)``: it covers ``|scale q . k|``, the query tile ``scale *
    log2(e) * q`` and the multiplier itself (``q (..., d)`` and ``k``: the
    call's arrays). The product bound covers the unscaled products ``|q . k|``
    in log2 units. bf16 tile products sum
    ``q . k`` in float32 before the gemm applies the scale
    (:func:`flashtile.cpu.half.split_scale`), so they need the second one
    inside float32's range too (a tiny ``scale`` with huge values).
    float16 inputs are bounded by their dtype (no pass)."""
    scale = float(scale)
    additive = 0.0 if va.alibi is None and va.mask_add is None else additive_bound(va, tq, tk)
    d = q.shape[-1]
    if q.dtype == k.dtype and q.size and k.size:
        q_op, k_op = _compiled_operands(q, k)
        if q_op is not None and k_op is not None:  # the common case: one compiled call
            return bounds_compiled(q_op, k_op, d, scale, additive)
    big_q, big_k = (FLOAT16_MAX if a.dtype == np.float16 else finite_max_abs(a) for a in (q, k))
    return bound_formula(big_q, big_k, d, scale, additive)


def decode_bound(scale, q, k, va: Variants, tq: int, tk: int, operands: np.dtype) -> float:
    """The bound a decode step's float32 scores answer to (:func:`decode_overflowed`):
    the score bound of :func:`bounds`, and where the tiles were multiplied as bf16
    (``operands``, the dtype of the plan's queries,
    :func:`flashtile.decode_planning.decode_operands`) the unscaled products'
    bound too, as :func:`bounds` explains."""
    score, products = bounds(scale, q, k, va, tq, tk)
    return max(score, products) if operands == BFLOAT16 else score


#: :func:`bf16_products_fit`: how far a flushed term may move a score (log2 units).
BF16_FLUSH_LIMIT = 2.0**-12


def bf16_products_fit(scale: float, d: int) -> bool:
    """Whether bf16 tile products are exact enough at score multiplier
    ``scale`` and head dim ``d``: each of the ``d`` terms of ``q . k`` that
    the products flush to zero (below float32's smallest normal, 2**-126)
    moves a score by at most ``|scale| * 2**-126 * log2(e)``; all of them
    together must stay under :data:`BF16_FLUSH_LIMIT`. Any ``scale`` below
    about ``1e34 / d`` fits (the default ``1/sqrt(d)`` by far)."""
    return abs(scale) * d * 2.0**-126 * LOG2E < BF16_FLUSH_LIMIT


def work_dtype(dtype: np.dtype, bound: float) -> np.dtype:
    """The dtype to compute inputs of ``dtype`` in, given the score bound of :func:`bounds`:
    :func:`compute_dtype`, or float64 where float32 scores could overflow."""
    work = compute_dtype(dtype)
    return np.dtype(np.float64) if bound >= FLOAT32_SCORE_LIMIT else work


def decode_overflowed(
    lse: np.ndarray, seqlens: np.ndarray, bound, flagged: bool, finite: bool
) -> bool:
    """Whether a float32 decode step must be computed again in float64.

    A raw score that was not finite (``flagged``, from the kernel) or a row of
    a non-empty sequence with a non-finite ``lse (B, Hq, Tq)`` raises the
    question (cheap tests); then ``bound()``, the call's :func:`decode_bound`
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


def narrow_out(a: np.ndarray, dtype) -> np.ndarray:
    """A result (``out``, a gradient) in the caller's ``dtype``: past its
    range (float16's 65504; float32's, from float64 work) it is inf, as any
    cast to it gives, without NumPy's overflow warning."""
    if a.dtype == dtype:
        return a
    if dtype == BFLOAT16 and a.dtype == np.float32:  # a widened bf16 call's (no bf16 products)
        from .cpu.half import to_bfloat16  # (compiled, 7x ml_dtypes' cast; NaN payloads kept)

        return to_bfloat16(a)
    with np.errstate(over="ignore"):
        return a.astype(dtype)


def narrow_lse(lse: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``lse`` in the compute dtype of inputs of ``dtype`` (float32 for float16
    and float32 inputs also when float64 was needed); past float32's range: inf."""
    narrow = compute_dtype(dtype)
    if lse.dtype == narrow:  # the common case: nothing to cast (errstate costs microseconds)
        return lse
    with np.errstate(over="ignore"):
        return lse.astype(narrow)


#: How far a row's recomputed probabilities may sum past 1, and how coarse
#: the scores near ``lse`` may be (:func:`failing_rows`): the share of a
#: gradient's relative error the backward's recomputation may add where
#: float64 can do better (the CPU). float32 work meets it while ``|lse|``
#: stays below 1024.
GRADIENT_TOLERANCE = 2.0**-12
#: :data:`GRADIENT_TOLERANCE` where nothing better exists (the Triton
#: kernels have no float64): only a recomputation off by about 1% fails.
LAST_RESORT_TOLERANCE = 2.0**-7


def gradients_unreliable(sums, lse, dout, sinks) -> bool:
    """Whether gradients recomputed from ``lse`` may be off by more than
    :data:`GRADIENT_TOLERANCE` (the caller then computes them again in
    float64, or refuses): :func:`failing_rows` among the rows whose ``dout``
    is not all zero (a zero row adds exact zeros, ``P`` being capped: padding
    rows hidden by an additive -1e9 need not be exact).

    ``sums (..., Tq)``: each query row's sum of the probabilities the backward
    recomputed (the kernels' fourth result), ``lse (..., Tq)`` the ``lse``
    they were recomputed from, ``dout (..., Tq, dv)``, ``sinks (Hq,)`` or
    None; NumPy arrays. Costs a pass over ``sums`` and ``lse``; ``dout`` is
    read only when some row fails."""
    if sinks is None and _no_row_fails(sums, lse):  # the common case, in three reductions
        return False
    off = failing_rows(np, sums.reshape(lse.shape), lse, sinks)
    if not off.any():  # the common case: no pass over dout
        return False
    return bool(np.any(off & np.any(dout != 0, axis=-1)))


def failing_rows(xp, sums, lse, sinks, tol=GRADIENT_TOLERANCE):
    """The rows ``(..., Tq)`` whose recomputed ``P`` cannot be trusted, as a
    bool array (NumPy, or torch tensors on any device with ``xp = torch``:
    the Triton backward's, which must not wait for the GPU). The work dtype,
    in which the scores were computed, is ``sums``'s. A row fails when

    - its ``P`` sum past ``1 - exp(sink - lse)`` (1 without sinks) by more
      than ``tol``: its ``lse`` is below the scores' (rounded down, or
      another call's); or ``lse = +inf`` (past float32's range, stored as
      inf: every ``P`` would be 0). A sum *below* it is not a failure: a
      block of a longer row, recomputed from that row's ``lse``, sums to its
      share (the distributed engine's blocks, and callers who merge blocks
      themselves); an ``lse`` rounded up is the next rule's;
    - ``|lse| * eps`` reaches ``tol``, ``eps`` summing the epsilons of
      ``lse``'s dtype and the work dtype that are narrower than float64: the
      scores near ``lse`` round by that much, so ``lse`` may be off by that
      much either way (rounded up: the sums cannot tell) and the ``P`` off
      one by one (float32: ``|lse|`` 1024 and beyond, at the default
      ``tol``). With both in float64 the sums alone decide: scores rounded
      one by one are what a float64 computation of any kind sees.

    Rows that see no key (``lse = -inf``, zero sums) and rows the NaN policy
    covers (NaN sums or ``lse``) never fail."""
    wide = _cast(xp, lse, sums.dtype)
    empty = wide == -xp.inf  # (not isneginf: NumPy's is a Python function, 2 us a call)
    expected = 1.0
    if sinks is not None:  # the sink's share of the row: exp(sink - lse)
        sink = _cast(xp, sinks, sums.dtype).reshape((-1, 1))
        expected = 1.0 - xp.exp(sink - xp.where(empty, xp.inf, wide))
    off = (sums - expected > tol) | (wide == xp.inf)  # (NaN: False)
    eps = _rounding(xp, lse.dtype, sums.dtype)
    if eps:
        off = off | (xp.abs(wide) * eps >= tol) & ~empty
    return off


def _no_row_fails(sums, lse, tol=GRADIENT_TOLERANCE) -> bool:
    """A sufficient test that :func:`failing_rows` (NumPy arrays, no sinks)
    finds no failing row, from three reductions instead of its dozen array
    operations (a small training step's backward spent 30 us in them): the
    largest sum (NaN left out, as the rule does) within ``tol`` of 1, every
    ``lse`` (in the sums' dtype) finite, and the largest ``|lse|`` below the
    rule's rounding limit. False means "ask the rule" (an empty row, an
    inf, a large sum or ``lse``), never "a row fails"."""
    if sums.size == 0:
        return True
    flat = (None, None) if lse.dtype == BFLOAT16 else _compiled_operands(lse, sums)
    if flat[0] is not None and flat[1] is not None:
        lo, hi, top = rule_extremes(*flat)  # (the same reductions, compiled)
    else:
        wide = _cast(np, lse, sums.dtype)
        lo, hi = float(np.fmin.reduce(wide, axis=None)), float(np.fmax.reduce(wide, axis=None))
        top = float(np.fmax.reduce(sums, axis=None))
    if not (-np.inf < lo and hi < np.inf):  # (all NaN: NaN, which fails both tests)
        return False
    eps = _rounding(np, lse.dtype, sums.dtype)
    return top - 1.0 <= tol and max(-lo, hi) * eps < tol


def _rounding(xp, lse_dtype, work) -> float:
    """How coarse scores near ``lse`` are, relative to ``|lse|``: the
    epsilons of ``lse``'s dtype and the work dtype that are narrower than
    float64 (0 when both are float64; see :func:`failing_rows`)."""
    return sum(_eps(xp, t) for t in (lse_dtype, work) if t != xp.float64)


def _cast(xp, a, dtype):
    """``a`` in ``dtype``; a float64 ``lse`` past float32's range becomes inf (no warning)."""
    if xp is not np:
        return a.to(dtype)
    a = np.asarray(a)
    if a.dtype == dtype:
        return a
    with np.errstate(over="ignore"):
        return a.astype(dtype)


@functools.cache
def _eps(xp, dtype) -> float:
    """The epsilon of ``dtype`` (cached: ``ml_dtypes.finfo`` costs 2 us a call)."""
    return float((ml_dtypes if xp is np else xp).finfo(dtype).eps)

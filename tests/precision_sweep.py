"""The backward's precision sweep (issue 33): gradients of calls whose scores
range from 1 to 1e30, judged against a long-double oracle by the accuracy
rule, or a clear error. Shared by ``tests/test_backward_precision.py`` (a
slice) and ``python -m tests.precision_sweep`` (the whole sweep, a table).

A case builds ``q``, ``k``, ``v`` in a dtype with scores of magnitude
``mag`` in one of two shapes: "peaked" (``scale`` large: scores spread by
``mag``, so the softmax is nearly one-hot) and "offset" (a shared component
adds ``mag`` to every score and the rest varies by units, so many keys share
the row's weight: the hard case, where ``|lse|`` is large but ``P`` is not
one-hot). With ``padded``, the last rows see every key through an additive
-1e9 and their ``dout`` is zero (a padded batch left out of the loss).

A result is right when its relative error against the oracle (rounded to
the gradient's dtype) is within ``max(4 err64, min(4 err32, 1e-2), 4
eps)``: ``err64``/``err32`` are the errors of the dense formula computed
naively in float64 and in float32 (for 16-bit inputs from the output
rounded to their dtype, as any 16-bit attention returns it): the accuracy
rule's allowance; ``eps`` the gradient dtype's. A result past 1% off is
wrong whatever float32 would give, unless even float64's error is past 1%:
such a result is "ill-conditioned" (within the rule): ``P`` one-hot to rounding at
scales near 1e29, where ``dP - D`` cancels to rounding noise that the scale
multiplies (no float64 method does better). A ``ValueError`` is a refusal,
right only where the naive float64 computation is off too, or where the
oracle itself (long double) cannot resolve the scores.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np

import flashtile

MAGNITUDES = (1.0, 1e2, 1e4, 1e6, 1e9, 1e12, 1e15, 1e20, 1e30)
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)
HEAD_DIMS = (4, 64, 256)
SHAPES = ("peaked", "offset")


def dense_gradients(q, k, v, dout, scale, mask, dtype, out_dtype=None):
    """``(dq, dk, dv)`` of softmax attention by the dense formula, in ``dtype``
    (with ``out_dtype``: the forward's output rounded to it, as attention in
    a 16-bit dtype returns it, before the backward reads it)."""
    q, k, v, dout, mask = (np.asarray(a).astype(dtype) for a in (q, k, v, dout, mask))
    scale = dtype(scale)
    with np.errstate(all="ignore"):
        s = np.einsum("hid,hjd->hij", q, k) * scale + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("hij,hjd->hid", p, v)
        if out_dtype is not None:
            out = out.astype(out_dtype).astype(dtype)
        dv = np.einsum("hij,hid->hjd", p, dout)
        dp = np.einsum("hid,hjd->hij", dout, v)
        ds = p * (dp - (dout * out).sum(-1, keepdims=True))
        dq = np.einsum("hij,hjd->hid", ds, k) * scale
        dk = np.einsum("hij,hid->hjd", ds, q) * scale
    return dq, dk, dv


def make_case(dtype, d, mag, shape, padded, seed=0, heads=2, tq=9, tk=23):
    """``(q, k, v, dout, scale, mask)`` of one case (``mask (tq, tk)`` additive)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((heads, t, d)) for t in (tq, tk, tk))
    if shape == "peaked":
        scale = mag / np.sqrt(d)
    else:  # a shared component worth mag in every score; the rest varies by units
        scale = 1.0 / np.sqrt(d)
        product = mag * np.sqrt(d)
        q[..., 0] = min(np.sqrt(product), float(ml_dtypes.finfo(dtype).max) / 2)
        k[..., 0] = product / q[0, 0, 0]
    mask = np.zeros((tq, tk))
    dout = rng.standard_normal((heads, tq, v.shape[-1]))
    if padded:
        mask[-3:] = -1e9
        dout[:, -3:] = 0.0
    with np.errstate(over="ignore"):
        arrays = [np.asarray(a).astype(dtype) for a in (q, k, v, dout)]
    if not all(np.isfinite(a.astype(np.float64)).all() for a in arrays):
        return None  # past the dtype's range: no such inputs
    return (*arrays, float(scale), mask)


def rel_err(a, ref, dtype=None) -> float:
    """The relative norm error of ``a`` against ``ref`` rounded to ``dtype``
    (a gradient below the dtype's range is 0 there, not an error)."""
    if dtype is not None:
        with np.errstate(all="ignore"):
            ref = np.asarray(ref).astype(dtype)
    a, ref = np.asarray(a, dtype=np.longdouble), np.asarray(ref, dtype=np.longdouble)
    num, den = np.linalg.norm((a - ref).ravel()), np.linalg.norm(ref.ravel())
    if not np.isfinite(num):
        return np.inf
    return float(num / den) if den > 0 else (0.0 if num == 0 else np.inf)


def judge(dtype, d, mag, shape, padded):
    """``(verdict, detail)``: "right", "refused" (a justified ``ValueError``),
    "wrong" (outside the rule with no error) or "refused-computable"."""
    case = make_case(dtype, d, mag, shape, padded)
    if case is None:
        return "n/a", "past the dtype's range"
    q, k, v, dout, scale, mask = case
    oracle = dense_gradients(q, k, v, dout, scale, mask, np.longdouble)
    narrow = None if dtype == np.float32 else dtype  # 16-bit: out rounded, as returned

    def naive(work):
        grads = dense_gradients(q, k, v, dout, scale, mask, work, narrow)
        return max(rel_err(g, o, dtype) for g, o in zip(grads, oracle, strict=True))

    naive = {w: naive(w) for w in (np.float32, np.float64)}
    eps = float(ml_dtypes.finfo(dtype).eps)
    allowed = max(4 * naive[np.float64], min(4 * naive[np.float32], 1e-2), 4 * eps)
    with np.errstate(over="ignore"):  # an lse past float32's range is inf, by the policy
        out, lse = flashtile.attention(q, k, v, scale=scale, mask=mask, return_lse=True)
    # The oracle resolves scores to eps(long double) of their size: past
    # that the case is not judged, and a refusal is right.
    blind = shape == "offset" and mag * float(np.finfo(np.longdouble).eps) > 1e-6
    try:
        grads = flashtile.attention_backward(q, k, v, out, lse, dout, scale=scale, mask=mask)
    except ValueError as exc:
        ok = blind or naive[np.float64] > 1e-2
        return ("refused" if ok else "refused-computable"), f"{str(exc)[:60]}"
    if blind:
        return "n/a", "past the oracle's resolution"
    err = max(rel_err(g, o, dtype) for g, o in zip(grads, oracle, strict=True))
    if err <= max(min(4 * naive[np.float64], 1e-2), min(4 * naive[np.float32], 1e-2), 4 * eps):
        verdict = "right"
    else:  # past 1% off: right only as far off as float64 itself
        verdict = "ill-conditioned" if err <= allowed else "wrong"
    return verdict, f"err {err:.2g} allowed {allowed:.2g} (err32 {naive[np.float32]:.2g})"


def main() -> None:
    counts: dict = {}
    for dtype, d, shape, padded in itertools.product(DTYPES, HEAD_DIMS, SHAPES, (False, True)):
        for mag in MAGNITUDES:
            verdict, detail = judge(dtype, d, mag, shape, padded)
            counts[verdict] = counts.get(verdict, 0) + 1
            name = np.dtype(dtype).name
            print(
                f"{name:8} d={d:3} {shape:6} padded={padded!s:5} mag={mag:<6g} {verdict:8} {detail}"
            )
    print(counts)


if __name__ == "__main__":
    main()

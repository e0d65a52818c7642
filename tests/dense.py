"""An independent dense float64 oracle for attention, written from the formulas.

Nothing here imports flashtile: these functions materialise the full score and
probability matrices with an explicit bottom-right causal mask (key ``j`` is
visible to query ``i`` iff ``j <= i + Tk - Tq``) and are the ground truth the
library's tiled paths are compared against.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


def _scale(d: int, scale) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def visibility(tq: int, tk: int, causal: bool) -> np.ndarray:
    """Boolean ``(tq, tk)`` matrix: True where query ``i`` may see key ``j``."""
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    if causal:
        return j <= i + (tk - tq)
    return np.ones((tq, tk), dtype=bool)


def _probabilities(q, k, causal, scale):
    """Scaled masked scores ``S``, probabilities ``P`` and the row-visibility flags."""
    tq, d = q.shape[-2:]
    tk = k.shape[-2]
    vis = visibility(tq, tk, causal)
    s = np.einsum("...id,...jd->...ij", q, k) * _scale(d, scale)
    s = np.where(vis, s, -np.inf)
    sees_any = vis.any(axis=1)  # (tq,)
    # Shift by the row max; a row that sees no key is shifted by 0 (its max is -inf).
    row_max = np.where(sees_any, np.max(s, axis=-1), 0.0)
    e = np.exp(s - row_max[..., None])  # exactly 0 where masked
    ell = e.sum(axis=-1)
    safe_ell = np.where(sees_any, ell, 1.0)
    p = e / safe_ell[..., None]
    return s, p, row_max, ell, sees_any


def dense_attention(q, k, v, causal: bool = False, scale=None):
    """``(out, lse)`` of softmax attention in float64, materialising ``P``.

    ``q (..., Tq, d)``, ``k (..., Tk, d)``, ``v (..., Tk, dv)`` with broadcast
    leading dims. Rows that see no key give ``out = 0`` and ``lse = -inf``.
    """
    q, k, v = _f64(q, k, v)
    _, p, row_max, ell, sees_any = _probabilities(q, k, causal, scale)
    out = np.einsum("...ij,...jv->...iv", p, v)
    out = np.where(sees_any[:, None], out, 0.0)
    lse = np.full(ell.shape, -np.inf)
    lse[..., sees_any] = row_max[..., sees_any] + np.log(ell[..., sees_any])
    return out, lse


def _reduce_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a gradient over the dims that broadcasting added or stretched."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def dense_attention_backward(q, k, v, dout, causal: bool = False, scale=None):
    """``(dq, dk, dv)`` of ``sum(dense_attention(q, k, v)[0] * dout)`` in float64.

    Textbook formulas on the full probability matrix::

        dV = P^T dO      dP = dO V^T      dS = P * (dP - rowsum(dP * P))
        dQ = scale dS K  dK = scale dS^T Q

    Gradients are summed back to the (possibly broadcast) input shapes.
    """
    q_shape, k_shape, v_shape = np.shape(q), np.shape(k), np.shape(v)
    q, k, v, dout = _f64(q, k, v, dout)
    sc = _scale(q.shape[-1], scale)
    _, p, _, _, _ = _probabilities(q, k, causal, scale)
    dv = np.einsum("...ij,...iv->...jv", p, dout)
    dp = np.einsum("...iv,...jv->...ij", dout, v)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = sc * np.einsum("...ij,...jd->...id", ds, k)
    dk = sc * np.einsum("...ij,...id->...jd", ds, q)
    return _reduce_to(dq, q_shape), _reduce_to(dk, k_shape), _reduce_to(dv, v_shape)


def rel_err(a, ref) -> float:
    """Relative norm error ``||a - ref|| / ||ref||`` (absolute when ``ref`` is 0).

    NaN anywhere in ``a`` gives NaN, which fails every ``<`` comparison.
    """
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    diff = float(np.linalg.norm((a - ref).ravel()))
    denom = float(np.linalg.norm(ref.ravel()))
    return diff / denom if denom > 0 else diff

"""``merge_states``: the one primitive that combines partial attention results.

A partial result over a key set ``S`` is a pair ``(out_S, lse_S)``: the
normalised attention output over those keys and ``lse_S = log sum_{j in S}
exp(s_j)``. For disjoint ``A`` and ``B``::

    lse   = log(exp(lse_A) + exp(lse_B))
    out   = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Both weights are computed relative to ``max(lse_A, lse_B)`` so nothing
overflows, and a side with ``lse = -inf`` (it saw no key) contributes nothing.
If both sides are empty the result is ``out = 0, lse = -inf``.
Split-KV decoding and ring attention fold their partials with this function.
"""

from __future__ import annotations

import numpy as np

from ._validate import as_float_array


def merge_states(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results over disjoint key sets.

    Args:
        out_a, out_b: ``(..., T, dv)`` normalised partial outputs.
        lse_a, lse_b: ``(..., T)`` natural-log normalisers (``-inf`` = no key;
            ``+inf`` is refused with a ``ValueError``, NaN gives NaN rows).

    Returns:
        ``(out, lse)`` with the shapes of the inputs (both partials must
        have the same shapes); ``out`` has the dtype of ``out_a``/``out_b``,
        ``lse`` that of the lse inputs.
        The merge is exact, commutative and associative up to rounding.
    """
    out_a = as_float_array(out_a, "out_a")
    out_b = as_float_array(out_b, "out_b")
    lse_a = as_float_array(lse_a, "lse_a")
    lse_b = as_float_array(lse_b, "lse_b")
    for out, lse, side in ((out_a, lse_a, "a"), (out_b, lse_b, "b")):
        if out.ndim < 1 or out.shape[:-1] != lse.shape:
            raise ValueError(
                f"out_{side} has shape {out.shape} and lse_{side} {lse.shape}: "
                f"lse must have the shape of out without its last axis"
            )
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a {out_a.shape} and out_b {out_b.shape} differ: both partials "
            f"must cover the same queries with the same value width"
        )
    for lse, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        refuse_posinf(np, lse, name)
    lse_dtype = np.result_type(lse_a, lse_b)
    with np.errstate(divide="ignore", invalid="ignore"):  # discarded: see merge_partials
        out, lse = merge_partials(np, out_a, lse_a, out_b, lse_b)
    return out.astype(np.result_type(out_a, out_b), copy=False), lse.astype(lse_dtype, copy=False)


def refuse_posinf(xp, lse, name: str) -> None:
    """ValueError when ``lse`` (NumPy, or torch with ``xp = torch``) holds +inf:
    no normaliser of finite scores, its merge weight would be inf/inf = NaN."""
    if xp.isposinf(lse).any():
        where = xp.argwhere(xp.isposinf(lse))[0].tolist()
        raise ValueError(
            f"{name} holds +inf at {where}: an lse is finite, or -inf for a partial that saw "
            f"no key (+inf means the scores overflowed float32; compute them in float64)"
        )


def merge_partials(xp, out_a, lse_a, out_b, lse_b):
    """The arithmetic of :func:`merge_states`, unchecked (callers refuse +inf
    lse with :func:`refuse_posinf`), for NumPy arrays (``xp = numpy``)
    or torch tensors on any device (``xp = torch``; what ring attention on GPUs merges).

    Shapes as in :func:`merge_states`; the result has the inputs' promoted dtype.
    NumPy callers silence the division warning of an all-empty row (its weight
    is 0: ``1 / 0`` is discarded) and the invalid-value warning of a side of
    weight 0 whose ``out`` holds inf (``0 * inf`` is discarded too).
    """
    m = xp.maximum(lse_a, lse_b)
    # Where both sides are empty m is -inf; shift by 0 instead so that the
    # weights become exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
    m_safe = xp.where(xp.isneginf(m), 0.0, m)
    w_a = xp.exp(lse_a - m_safe)
    w_b = xp.exp(lse_b - m_safe)
    total = w_a + w_b
    lse = m_safe + xp.log(total)
    inv = xp.where(total != 0, 1.0 / total, 0.0)
    # A side of weight 0 (lse = -inf) contributes nothing, even if its out
    # holds NaN or garbage (an empty chunk's buffer, say).
    part_a = xp.where((w_a == 0)[..., None], 0.0, (w_a * inv)[..., None] * out_a)
    part_b = xp.where((w_b == 0)[..., None], 0.0, (w_b * inv)[..., None] * out_b)
    return part_a + part_b, lse


def add_sinks(xp, out, lse, sinks):
    """``(out, lse)`` of ``(..., Hq, T, dv)``, ``(..., Hq, T)`` with the attention
    sinks ``sinks (Hq,)`` merged in (NumPy, or torch with ``xp = torch``).

    A sink is one more key per query head, of score ``sinks[h]`` and value
    zero: a partial result ``(0, sinks[h])`` over a key set of its own, so it
    enters through :func:`merge_partials` like any other partial (no overflow
    for a large sink; a row that saw no key gets ``out = 0``, ``lse =
    sinks[h]``; a ``-inf`` sink changes nothing). ``out`` keeps its dtype.
    """
    sink = xp.zeros_like(lse) + _cast(xp, sinks, lse.dtype).reshape((-1, 1))  # (..., Hq, T)
    with np.errstate(divide="ignore", invalid="ignore"):  # discarded (see merge_partials)
        merged, lse = merge_partials(xp, out, lse, 0.0, sink)
    return _cast(xp, merged, out.dtype), lse


def sink_gradient(xp, out, lse, dout, sinks):
    """``d loss / d sinks (Hq,)`` from the forward's sink-merged ``out``, ``lse``
    (:func:`add_sinks`) and the gradient ``dout`` of ``out``.

    The sink's probability in row ``i`` is ``P_i = exp(sink - lse_i)`` and
    ``d out_i / d sink = -P_i out_i``, so the gradient is ``-sum_i P_i D_i``
    with ``D_i = dout_i . out_i`` over every row of the head (the backward's
    own ``D``). In the dtype of ``lse``.
    """
    # A row with lse = -inf has a -inf sink too (lse includes it): its P is 0.
    safe = xp.where(xp.isneginf(lse), xp.inf, lse)
    p_sink = xp.exp(_cast(xp, sinks, lse.dtype).reshape((-1, 1)) - safe)
    delta = (_cast(xp, dout, lse.dtype) * _cast(xp, out, lse.dtype)).sum(-1)
    return -(p_sink * delta).reshape((-1,) + tuple(lse.shape[-2:])).sum((0, 2))


def _cast(xp, a, dtype):
    """``a`` in ``dtype`` (NumPy's ``astype``, torch's ``to``), no copy when it is."""
    return a.astype(dtype, copy=False) if xp is np else a.to(dtype)

"""Attention backward by recomputation, in NumPy.

The forward pass keeps only ``lse`` per query row. The backward walks the
same key blocks again, rebuilds each probability tile exactly as
``P = exp(S - lse)``, uses it and forgets it. With ``D = rowsum(dO * O)``::

    dV_j += P^T dO            dP = dO V_j^T
    dS    = P * (dP - D)      dQ  += scale * dS K_j      dK_j += scale * dS^T Q

No ``Tq x Tk`` array is ever stored; each tile is ``(Tq, block_size)``.
"""

from __future__ import annotations

import numpy as np

from .._validate import check_block_size, check_same_shape
from ..masks import key_stop
from .attention import _prepare, _scores


def _sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a broadcast gradient back to an input's ``shape``."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


def tiled_attention_backward(
    q, k, v, out, dout, lse, block_size: int, causal: bool = False, *, scale=None
):
    """Gradients ``(dq, dk, dv)`` of :func:`tiled_attention` by recomputation.

    Args:
        q, k, v: the forward inputs, ``(..., Tq, d)``, ``(..., Tk, d)``,
            ``(..., Tk, dv)``.
        out: the forward output ``(batch..., Tq, dv)`` (batch = broadcast
            leading dims).
        dout: upstream gradient, same shape as ``out``.
        lse: ``(batch..., Tq)`` from ``tiled_attention(..., return_lse=True)``.
        block_size: keys per recomputed tile (any value gives the same result).
        causal, scale: as in the forward.

    Returns:
        ``dq``, ``dk``, ``dv`` with the shapes and dtypes of ``q``, ``k``,
        ``v``. Rows that saw no key (``lse = -inf``) contribute nothing.
    """
    in_shapes = [np.shape(a) for a in (q, k, v)]
    q, k, v, shapes, causal, scale, out_dtype = _prepare(q, k, v, causal, scale)
    block_size = check_block_size(block_size)
    o_shape = shapes.batch + (shapes.tq, shapes.dv)
    out = check_same_shape(out, "out", o_shape, "the forward output").astype(q.dtype)
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of the output").astype(q.dtype)
    lse = check_same_shape(lse, "lse", o_shape[:-1], "from return_lse=True").astype(q.dtype)

    delta = np.sum(dout * out, axis=-1)  # D_i = dO_i . O_i = sum_j P_ij dP_ij
    # exp(S - (+inf)) = 0 makes every probability of an empty row vanish.
    origin = np.where(np.isneginf(lse), np.inf, lse).astype(q.dtype, copy=False)
    dq = np.zeros(shapes.batch + (shapes.tq, shapes.d), dtype=q.dtype)
    dk = np.zeros(shapes.batch + (shapes.tk, shapes.d), dtype=q.dtype)
    dv = np.zeros(shapes.batch + (shapes.tk, shapes.dv), dtype=q.dtype)
    stop_all = key_stop(shapes.tq, shapes.tq, shapes.tk, causal)
    for start in range(0, stop_all, block_size):
        stop = min(start + block_size, stop_all)
        p = np.exp(_scores(q, k, start, stop, shapes, causal, scale) - origin[..., None])
        pt = np.swapaxes(p, -1, -2)
        dv[..., start:stop, :] = pt @ dout
        dp = dout @ np.swapaxes(v[..., start:stop, :], -1, -2)
        ds = p * (dp - delta[..., None])
        dq += (ds @ k[..., start:stop, :]) * scale
        dk[..., start:stop, :] = (np.swapaxes(ds, -1, -2) @ q) * scale
    grads = (
        _sum_to_shape(g, s).astype(out_dtype, copy=False)
        for g, s in zip((dq, dk, dv), in_shapes, strict=True)
    )
    return tuple(grads)

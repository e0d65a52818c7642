"""Attention forward in NumPy: the dense oracle and the tiled online version.

Layout ``(..., T, d)``: ``q (..., Tq, d)``, ``k (..., Tk, d)``,
``v (..., Tk, dv)``; leading dims broadcast. Causal masking is bottom-right
aligned (see :mod:`flashtile.masks`). A query that sees no key gets a zero
output row and ``lse = -inf``.

Precision: the running state (``m``, ``ell``, the numerator) is kept in the
input dtype for float32/float64 and in float32 for float16; outputs have the
input dtype, ``lse`` the accumulation dtype.
"""

from __future__ import annotations

import numpy as np

from .._validate import check_block_size, check_flag, check_qkv, compute_dtype, resolve_scale
from ..masks import key_stop, tile_needs_mask, visible
from .softmax import online_update, softmax


def _prepare(q, k, v, causal, scale):
    """Validate, resolve the scale and cast to the accumulation dtype."""
    q, k, v, shapes = check_qkv(q, k, v)
    causal = check_flag(causal, "causal")
    scale = resolve_scale(scale, shapes.d)
    acc = compute_dtype(q.dtype)
    return (
        q.astype(acc, copy=False),
        k.astype(acc, copy=False),
        v.astype(acc, copy=False),
        shapes,
        causal,
        scale,
        q.dtype,
    )


def _scores(q, k, start, stop, shapes, causal, scale):
    """Scaled scores of every query against keys ``[start, stop)``, masked."""
    s = (q @ np.swapaxes(k[..., start:stop, :], -1, -2)) * scale
    if tile_needs_mask(0, stop, shapes.tq, shapes.tk, causal):
        keep = visible(np.arange(shapes.tq), np.arange(start, stop), shapes.tq, shapes.tk, causal)
        s = np.where(keep, s, -np.inf).astype(s.dtype, copy=False)
    return s


def naive_attention(q, k, v, causal: bool = False, *, scale=None):
    """Dense attention ``softmax(q k^T * scale) v`` that materialises every score.

    Returns ``(out, weights)``: ``out (..., Tq, dv)`` and the probability matrix
    ``weights (..., Tq, Tk)``. This is the oracle the tiled paths are checked
    against; its memory is ``O(Tq * Tk)``.
    """
    q, k, v, shapes, causal, scale, out_dtype = _prepare(q, k, v, causal, scale)
    weights = softmax(_scores(q, k, 0, shapes.tk, shapes, causal, scale), axis=-1)
    return (weights @ v).astype(out_dtype, copy=False), weights.astype(out_dtype, copy=False)


def tiled_attention(
    q, k, v, block_size: int, causal: bool = False, *, scale=None, return_lse: bool = False
):
    """Exact attention that streams K/V in blocks of ``block_size`` keys.

    Per query row it keeps only the running max ``m``, the normaliser ``ell``
    and the unnormalised output; each ``(Tq, block_size)`` score tile is folded
    in with :func:`online_update` and discarded. Key blocks that no query can
    see under the causal mask are never visited.

    Returns ``out (..., Tq, dv)``, and with ``return_lse=True`` also
    ``lse = m + log(ell)`` of shape ``(..., Tq)`` (``-inf`` for empty rows).
    """
    q, k, v, shapes, causal, scale, out_dtype = _prepare(q, k, v, causal, scale)
    block_size = check_block_size(block_size)
    state_shape = shapes.batch + (shapes.tq,)
    m = np.full(state_shape, -np.inf, dtype=q.dtype)
    ell = np.zeros(state_shape, dtype=q.dtype)
    numerator = np.zeros(state_shape + (shapes.dv,), dtype=q.dtype)
    stop_all = key_stop(shapes.tq, shapes.tq, shapes.tk, causal)
    for start in range(0, stop_all, block_size):
        stop = min(start + block_size, stop_all)
        s = _scores(q, k, start, stop, shapes, causal, scale)
        m, ell, rescale, p = online_update(m, ell, s)
        numerator = numerator * rescale[..., None] + p @ v[..., start:stop, :]
    # Normalise once at the end; empty rows (ell = 0) stay zero.
    denom = ell[..., None]
    out = np.divide(numerator, denom, out=np.zeros_like(numerator), where=denom != 0)
    out = out.astype(out_dtype, copy=False)
    if not return_lse:
        return out
    with np.errstate(divide="ignore"):
        lse = m + np.log(ell)  # -inf + -inf = -inf for empty rows
    return out, lse


def online_attention(Q, K, V, block_size: int):
    """The exercise's name for :func:`tiled_attention` (non-causal)."""
    return tiled_attention(Q, K, V, block_size)


def attention_memory_elements(tokens: int) -> dict[str, int]:
    """Elements of score storage (naive) vs. persistent row state (tiled).

    Naive attention holds a ``tokens x tokens`` score matrix; the tiled
    forward keeps one running entry per query row (per statistic).
    """
    tokens = check_block_size(tokens, "tokens")
    return {"naive_scores": tokens * tokens, "online_state": tokens}

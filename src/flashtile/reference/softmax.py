"""Softmax, dense and online (streaming), in plain NumPy.

The online normaliser keeps two numbers for a row that arrives block by
block: the running maximum ``m`` and the running sum ``ell = sum exp(s - m)``.
When a block raises the maximum, the old sum is moved to the new origin by
multiplying with ``exp(m_old - m_new)``; this rescale is the whole trick.

A row whose entries are all ``-inf`` (fully masked) has ``m = -inf``,
``ell = 0``; its softmax is defined here as all zeros, never NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .._validate import as_float_array, check_block_size, compute_dtype


def softmax(x, axis: int = -1) -> np.ndarray:
    """Stable softmax along ``axis`` (subtract the max, exponentiate, normalise).

    Slices that are entirely ``-inf`` give zeros instead of NaN; an empty
    axis gives an empty result (as :func:`online_softmax`).
    """
    x = as_float_array(x, "x")
    xc = x.astype(compute_dtype(x.dtype), copy=False)  # float16 sums in float32
    top = np.max(xc, axis=axis, keepdims=True, initial=-np.inf)  # (-inf: an empty slice)
    weights = np.exp(xc - _safe(top))
    total = np.sum(weights, axis=axis, keepdims=True)
    probs = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    return probs.astype(x.dtype, copy=False)


@dataclass(frozen=True)
class OnlineStep:
    """One block of the online normaliser, as shown by ``flashtile trace``.

    ``rescale = exp(m_old - m_new)`` is the factor applied to the old sum;
    ``ell`` is the running sum after this block.
    """

    index: int
    block: np.ndarray
    block_max: float
    m_old: float
    m_new: float
    rescale: float
    ell: float


def _safe(m):
    """Shift origin: ``m`` where finite, 0 where ``-inf`` (an empty state)."""
    return np.where(np.isneginf(m), 0, m).astype(np.result_type(m), copy=False)


def online_update(m, ell, scores):
    """Fold one block of scores into the running state: the online softmax step.

    Args:
        m, ell: ``(...)`` running max and normaliser (``-inf`` and 0 when empty).
        scores: ``(..., B)`` the new block; ``-inf`` entries are masked.

    Returns:
        ``(m_new, ell_new, rescale, p)`` where ``rescale = exp(m - m_new)`` is
        the factor for everything accumulated so far and
        ``p = exp(scores - m_new)`` the block's unnormalised weights. Rows that
        are still empty keep ``m = -inf``, ``ell = 0`` and get ``p = 0``.
    """
    m_new = np.maximum(m, np.max(scores, axis=-1))
    origin = _safe(m_new)
    rescale = np.exp(m - origin)  # exp(-inf) = 0 on a row's first visible block
    p = np.exp(scores - origin[..., None])
    return m_new, ell * rescale + np.sum(p, axis=-1), rescale, p


def online_softmax_steps(blocks: Iterable) -> Iterator[OnlineStep]:
    """Fold 1-D score blocks into ``(m, ell)``, yielding the state after each."""
    m = ell = None
    for index, block in enumerate(blocks):
        block = as_float_array(block, "block")
        if block.ndim != 1:
            raise ValueError(f"block {index} has shape {block.shape}; blocks must be 1-D")
        if block.size == 0:
            continue
        if m is None:  # the state accumulates in float32 for float16 blocks
            m = np.array(-np.inf, dtype=compute_dtype(block.dtype))
            ell = np.zeros((), dtype=m.dtype)
        m_new, ell, rescale, _ = online_update(m, ell, block)
        yield OnlineStep(
            index, block, float(block.max()), float(m), float(m_new), float(rescale), float(ell)
        )
        m = m_new


def online_softmax_normalizer(blocks: Iterable) -> tuple[float, float]:
    """Running max ``m`` and normaliser ``ell`` of one row given as 1-D blocks.

    Equals ``(max(row), sum(exp(row - max(row))))`` of the concatenated row;
    ``(-inf, 0.0)`` for an empty or fully ``-inf`` row.
    """
    m, ell = -np.inf, 0.0
    for step in online_softmax_steps(blocks):
        m, ell = step.m_new, step.ell
    return m, ell


def online_softmax(x, block_size: int) -> np.ndarray:
    """Softmax along the last axis in one streaming pass plus one normalisation.

    The first pass visits ``block_size`` entries at a time and keeps only the
    running ``(m, ell)`` per row; the second computes ``exp(x - m) / ell``.
    The result has the shape and dtype of ``x`` (1-D in the exercise; leading
    dims are independent rows). Any ``block_size >= 1`` gives the same answer.
    """
    x = as_float_array(x, "x")
    block_size = check_block_size(block_size)
    if x.ndim == 0:
        raise ValueError("x is a scalar; online_softmax needs at least one axis")
    xc = x.astype(compute_dtype(x.dtype), copy=False)  # float16 sums in float32
    m = np.full(x.shape[:-1], -np.inf, dtype=xc.dtype)
    ell = np.zeros(x.shape[:-1], dtype=xc.dtype)
    for start in range(0, x.shape[-1], block_size):
        m, ell, _, _ = online_update(m, ell, xc[..., start : start + block_size])
    weights = np.exp(xc - _safe(m)[..., None])
    ell = ell[..., None]
    probs = np.divide(weights, ell, out=np.zeros_like(weights), where=ell != 0)
    return probs.astype(x.dtype, copy=False)

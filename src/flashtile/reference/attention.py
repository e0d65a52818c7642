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

from dataclasses import dataclass

import numpy as np

from .._validate import (
    AttentionShapes,
    check_block_size,
    check_flag,
    check_qkv,
    compute_dtype,
    resolve_scale,
)
from ..dropout import keep_mask
from ..masks import block_key_range, visible
from ..variants import Variants, clear_padded_keys, existing_keys, resolve_variants
from .softmax import online_update, softmax


@dataclass(frozen=True)
class _Problem:
    """One validated call: arrays in the accumulation dtype plus the variants.

    ``k``/``v`` are already repeated per query head for GQA (the reference may
    copy; the kernels never do).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    shapes: AttentionShapes
    variants: Variants
    scale: float
    out_dtype: np.dtype

    @property
    def key_range(self) -> tuple[int, int]:
        """Keys any query may see by position: blocks outside are skipped."""
        sh, va = self.shapes, self.variants
        return block_key_range(0, sh.tq, sh.tq, sh.tk, va.causal, va.left, va.right, sh.tk)


def _prepare(q, k, v, causal, scale, variants) -> _Problem:
    """Validate, resolve the scale and variants, cast to the accumulation dtype."""
    q, k, v, shapes = check_qkv(q, k, v)
    scale = resolve_scale(scale, shapes.d)
    va = resolve_variants(shapes, causal=causal, **variants)
    acc = compute_dtype(q.dtype)
    if shapes.group > 1:
        k, v = (np.repeat(a, shapes.group, axis=-3) for a in (k, v))
    keep = existing_keys(va, variants.get("key_padding_mask"), shapes.tk)
    k, v = clear_padded_keys(k, v, keep)  # padded keys do not exist, whatever they hold
    cast = (a.astype(acc, copy=False) for a in (q, k, v))
    return _Problem(*cast, shapes, va, scale, q.dtype)


def _key_slice(mask: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Keys ``[start, stop)`` of a mask; a size-1 key axis broadcasts as is."""
    return mask if mask.shape[-1] == 1 else mask[..., start:stop]


def _scores(pb: _Problem, start: int, stop: int):
    """Scores of every query against keys ``[start, stop)``, all variants applied.

    Returns ``(s, dcap)``: ``s (..., Tq, stop - start)`` with ``-inf`` where
    hidden, and ``dcap = ds_capped/ds`` (the softcap derivative) or None.
    """
    sh, va = pb.shapes, pb.variants
    s = (pb.q @ np.swapaxes(pb.k[..., start:stop, :], -1, -2)) * pb.scale
    dcap = None
    if va.softcap is not None:
        t = np.tanh(s / va.softcap)
        s, dcap = va.softcap * t, 1.0 - t * t
    q_idx, k_idx = np.arange(sh.tq), np.arange(start, stop)
    if va.alibi is not None:
        dist = np.abs((q_idx + sh.tk - sh.tq)[:, None] - k_idx[None, :])
        s = s - va.alibi * dist
    if va.mask_add is not None:
        s = s + _key_slice(va.mask_add, start, stop)
    keep = visible(q_idx, k_idx, sh.tq, sh.tk, va.causal, va.left, va.right, va.kv_lengths)
    if va.mask_bool is not None:
        keep = keep & _key_slice(va.mask_bool, start, stop)
    s = np.where(keep, s, -np.inf).astype(pb.q.dtype, copy=False)
    return s, dcap


def _kept(pb: _Problem, start: int, stop: int):
    """Dropout's factor on the probabilities of keys ``[start, stop)``:
    ``keep / (1 - p)`` shaped ``(batch..., Tq, stop - start)``, or None without dropout."""
    va, sh = pb.variants, pb.shapes
    if va.dropout_p == 0.0:
        return None
    dims = (1, 1) + tuple(sh.batch)
    keep = keep_mask(
        va.dropout_p, va.dropout_seed, va.dropout_offset, dims[-2], dims[-1], range(sh.tq),
        range(start, stop),
    )  # fmt: skip
    factor = keep.reshape(sh.batch + keep.shape[2:]) / (1.0 - va.dropout_p)
    return factor.astype(pb.q.dtype)


def _sinks(pb: _Problem):
    """The sink logits shaped to broadcast over ``(batch..., Tq)`` rows, or None."""
    sinks = pb.variants.sinks
    return None if sinks is None else sinks.astype(pb.q.dtype)[:, None]


def naive_attention(q, k, v, causal: bool = False, *, scale=None, **variants):
    """Dense attention ``softmax(q k^T * scale) v`` that materialises every score.

    Returns ``(out, weights)``: ``out (..., Tq, dv)`` and the probability matrix
    ``weights (..., Tq, Tk)`` (before dropout). This is the oracle the tiled
    paths are checked against; its memory is ``O(Tq * Tk)``. ``variants`` are
    the keywords of :func:`flashtile.variants.resolve_variants` (window,
    alibi_slopes, softcap, kv_lengths, key_padding_mask, mask, sinks,
    dropout_p/dropout_seed/dropout_offset).
    """
    pb = _prepare(q, k, v, causal, scale, variants)
    s = _scores(pb, 0, pb.shapes.tk)[0]
    sinks = _sinks(pb)
    if sinks is None:
        weights = softmax(s, axis=-1)
    else:  # the sink is one more column, of score sinks[h] and value zero
        column = np.broadcast_to(sinks[..., None], s.shape[:-1] + (1,))
        weights = softmax(np.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    kept = _kept(pb, 0, pb.shapes.tk)
    out = (weights if kept is None else weights * kept) @ pb.v
    return out.astype(pb.out_dtype, copy=False), weights.astype(pb.out_dtype, copy=False)


def tiled_attention(
    q,
    k,
    v,
    block_size: int,
    causal: bool = False,
    *,
    scale=None,
    return_lse: bool = False,
    **variants,
):
    """Exact attention that streams K/V in blocks of ``block_size`` keys.

    Per query row it keeps only the running max ``m``, the normaliser ``ell``
    and the unnormalised output; each ``(Tq, block_size)`` score tile is folded
    in with :func:`online_update` and discarded. Key blocks that no query can
    see (causal, window) are never visited. ``variants`` as in
    :func:`naive_attention`.

    Returns ``out (..., Tq, dv)``, and with ``return_lse=True`` also
    ``lse = m + log(ell)`` of shape ``(..., Tq)`` (``-inf`` for empty rows).
    """
    return_lse = check_flag(return_lse, "return_lse")
    pb = _prepare(q, k, v, causal, scale, variants)
    block_size = check_block_size(block_size)
    sh = pb.shapes
    state_shape = sh.batch + (sh.tq,)
    m = np.full(state_shape, -np.inf, dtype=pb.q.dtype)
    ell = np.zeros(state_shape, dtype=pb.q.dtype)
    sinks = _sinks(pb)
    if sinks is not None:  # the sink is the state's first score: m = sink, ell = 1
        m = np.broadcast_to(sinks, state_shape).astype(pb.q.dtype)
        ell = np.where(np.isneginf(m), 0.0, 1.0).astype(pb.q.dtype)
    numerator = np.zeros(state_shape + (sh.dv,), dtype=pb.q.dtype)
    first, last = pb.key_range
    for start in range(first, last, block_size):
        stop = min(start + block_size, last)
        m, ell, rescale, p = online_update(m, ell, _scores(pb, start, stop)[0])
        kept = _kept(pb, start, stop)  # dropout acts on P after its sum entered ell
        p = p if kept is None else p * kept
        numerator = numerator * rescale[..., None] + p @ pb.v[..., start:stop, :]
    # Normalise once at the end; empty rows (ell = 0) stay zero.
    denom = ell[..., None]
    out = np.divide(numerator, denom, out=np.zeros_like(numerator), where=denom != 0)
    out = out.astype(pb.out_dtype, copy=False)
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

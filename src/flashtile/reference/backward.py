"""Attention backward by recomputation, in NumPy.

The forward pass keeps only ``lse`` per query row. The backward walks the
same key blocks again, rebuilds each probability tile exactly as
``P = exp(S - lse)``, uses it and forgets it. With ``D = rowsum(dO * O)``::

    dV_j += P^T dO            dP = dO V_j^T
    dS    = P * (dP - D)      dQ  += scale * dS K_j      dK_j += scale * dS^T Q

(with softcap, ``dS`` is multiplied by ``1 - tanh(s / softcap)**2``).

No ``Tq x Tk`` array is ever stored; each tile is ``(Tq, block_size)``.
"""

from __future__ import annotations

import warnings

import numpy as np

from .._validate import check_block_size, check_same_shape
from .attention import _kept, _prepare, _scores, _sinks


def _sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a broadcast gradient back to an input's ``shape``."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


#: Keys per recomputed tile when the caller does not choose one.
DEFAULT_BLOCK_SIZE = 64

_NEW_ORDER = (
    "tiled_attention_backward(q, k, v, out, lse, dout, block_size=..., causal=...), "
    "the order of attention_backward"
)


def tiled_attention_backward(
    q, k, v, out, lse, dout, *legacy, block_size=None, causal=False, scale=None, **variants
):
    """Gradients ``(dq, dk, dv)`` of :func:`tiled_attention` by recomputation.

    Takes the arguments of :func:`flashtile.attention_backward`, in its order.

    Args:
        q, k, v: the forward inputs, ``(..., Tq, d)``, ``(..., Tk, d)``,
            ``(..., Tk, dv)``.
        out: the forward output ``(batch..., Tq, dv)`` (batch = broadcast
            leading dims).
        lse: ``(batch..., Tq)`` from ``tiled_attention(..., return_lse=True)``.
        dout: upstream gradient, same shape as ``out``.
        block_size: keys per recomputed tile (keyword-only; any value gives
            the same result; None means 64).
        causal, scale, variants: as in the forward (keyword-only). With
            ``softcap`` the chain rule through ``tanh`` is applied; masks and
            ALiBi are constants.

    Returns:
        ``dq``, ``dk``, ``dv`` with the shapes and dtypes of ``q``, ``k``,
        ``v`` (summed over a query-head group for GQA), and with ``sinks``
        also ``dsinks (Hq,)``. Rows that saw no key (``lse = -inf``)
        contribute nothing. Dropout's mask is regenerated from its seed.

    Deprecated: the earlier order ``(q, k, v, out, dout, lse, block_size,
    causal)``, recognised by a positional ``block_size``/``causal`` or by the
    fifth argument shaped like ``out`` and the sixth like ``lse``, still runs
    correctly with a :class:`DeprecationWarning`.
    """
    if _old_order(out, lse, dout, legacy):
        lse, dout = dout, lse
    if legacy:
        block_size, causal = _legacy_flags(legacy, block_size, causal)
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    in_shapes = [np.shape(a) for a in (q, k, v)]
    pb = _prepare(q, k, v, causal, scale, variants)
    block_size = check_block_size(block_size)
    sh, dt = pb.shapes, pb.q.dtype
    o_shape = sh.batch + (sh.tq, sh.dv)
    out = check_same_shape(out, "out", o_shape, "the forward output").astype(dt)
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of the output").astype(dt)
    lse = check_same_shape(lse, "lse", o_shape[:-1], "from return_lse=True").astype(dt)

    delta = np.sum(dout * out, axis=-1)  # D_i = dO_i . O_i = sum_j P_ij dP_ij
    # exp(S - (+inf)) = 0 makes every probability of an empty row vanish.
    origin = np.where(np.isneginf(lse), np.inf, lse).astype(dt, copy=False)
    dq = np.zeros(sh.batch + (sh.tq, sh.d), dtype=dt)
    dk = np.zeros(sh.batch + (sh.tk, sh.d), dtype=dt)
    dv = np.zeros(sh.batch + (sh.tk, sh.dv), dtype=dt)
    first, last = pb.key_range
    for start in range(first, last, block_size):
        stop = min(start + block_size, last)
        s, dcap = _scores(pb, start, stop)
        p = np.exp(s - origin[..., None])
        kept = _kept(pb, start, stop)  # dropout: out was (P * kept) V
        kept = np.ones_like(p) if kept is None else kept
        dv[..., start:stop, :] = np.swapaxes(p * kept, -1, -2) @ dout
        dp = dout @ np.swapaxes(pb.v[..., start:stop, :], -1, -2)
        ds = p * (dp * kept - delta[..., None])
        if dcap is not None:
            ds = ds * dcap  # through softcap * tanh(s / softcap)
        dq += (ds @ pb.k[..., start:stop, :]) * pb.scale
        dk[..., start:stop, :] = (np.swapaxes(ds, -1, -2) @ pb.q) * pb.scale
    if sh.group > 1:  # fold the repeated kv heads back onto their group
        dk, dv = (_sum_groups(g, sh.group) for g in (dk, dv))
    grads = tuple(
        _sum_to_shape(g, s).astype(pb.out_dtype, copy=False)
        for g, s in zip((dq, dk, dv), in_shapes, strict=True)
    )
    sinks = _sinks(pb)
    if sinks is None:
        return grads
    # d lse / d sink = exp(sink - lse) per row, and d out_i / d sink = -P_sink_i out_i.
    p_sink = np.exp(sinks - origin)
    dsinks = -(p_sink * delta).reshape(-1, sh.batch[-1], sh.tq).sum(axis=(0, 2))
    return grads + (dsinks.astype(pb.out_dtype, copy=False),)


def _old_order(out, fifth, sixth, legacy: tuple) -> bool:
    """Whether ``fifth, sixth`` are ``dout, lse`` (the deprecated order); warns if so
    or if ``block_size``/``causal`` came positionally.

    The shapes decide: ``out`` is ``(batch..., Tq, dv)`` and ``lse`` one dim
    shorter, so the two orders cannot be confused. Shapes that fit neither
    order follow the positional flags (validation then names the bad shape).
    """
    o = np.shape(out)
    looks_old = len(o) > 0 and np.shape(fifth) == o and np.shape(sixth) == o[:-1]
    looks_new = len(o) > 0 and np.shape(fifth) == o[:-1] and np.shape(sixth) == o
    old = looks_old or (bool(legacy) and not looks_new)
    if old or legacy:
        warnings.warn(
            "tiled_attention_backward(q, k, v, out, dout, lse, block_size, causal) is "
            f"deprecated: call {_NEW_ORDER}",
            DeprecationWarning,
            stacklevel=3,
        )
    return old


def _legacy_flags(legacy: tuple, block_size, causal):
    """``block_size, causal`` from the deprecated positional ``block_size[, causal]``."""
    if len(legacy) > 2:
        raise TypeError(
            f"tiled_attention_backward takes at most 8 positional arguments, got "
            f"{6 + len(legacy)}: call {_NEW_ORDER}"
        )
    if block_size is not None or (len(legacy) == 2 and causal is not False):
        raise TypeError(
            "tiled_attention_backward got block_size or causal both positionally and "
            f"by keyword: call {_NEW_ORDER}"
        )
    return legacy[0], (legacy[1] if len(legacy) == 2 else causal)


def _sum_groups(grad: np.ndarray, group: int) -> np.ndarray:
    """``(..., Hq, T, d)`` -> ``(..., Hq // group, T, d)`` summing each group."""
    *lead, hq, t, d = grad.shape
    return grad.reshape(*lead, hq // group, group, t, d).sum(axis=-3)

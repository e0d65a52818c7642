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


# --------------------------------------------------------------------------------------
# Variants: GQA/MQA, sliding window, ALiBi, softcap, key padding, masks, varlen.
#
# Written directly from the formulas on the materialised (B, Hq, Tq, Tk) score
# matrix; K/V are repeated per query head for GQA (fine for an oracle). The
# score pipeline, in order:
#
#     s = scale * q.k
#     s = softcap * tanh(s / softcap)          if softcap
#     s = s - slope[b, h] * |p - j|            if alibi_slopes   (p = i + Tk - Tq)
#     s = s + mask                             if mask is a float array
#     s = -inf where the key is not visible    (causal, window, padding, bool mask,
#                                               float mask == -inf)
# --------------------------------------------------------------------------------------


def _window_sides(window, causal: bool):
    """``(left, right)`` with ``None`` for an unbounded side; causal caps right at 0."""
    left = right = None
    if window is not None:
        left, right = window
        left = None if left is None or left == -1 else int(left)
        right = None if right is None or right == -1 else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def variant_visibility(
    shape,
    causal: bool = False,
    *,
    window=None,
    kv_lengths=None,
    key_padding_mask=None,
    mask=None,
) -> np.ndarray:
    """Boolean ``(B, Hq, Tq, Tk)`` array: True where query ``i`` may see key ``j``.

    Query ``i`` sits at absolute position ``p = i + Tk - Tq``. A float ``mask``
    hides the entries where it is ``-inf``.
    """
    b, _, tq, tk = shape
    p = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    left, right = _window_sides(window, causal)
    vis = np.ones((tq, tk), dtype=bool)
    if left is not None:
        vis &= j >= p - left
    if right is not None:
        vis &= j <= p + right
    vis = np.broadcast_to(vis, shape).copy()
    if kv_lengths is not None:
        lengths = np.asarray(kv_lengths).reshape(b)
        vis &= (np.arange(tk)[None, :] < lengths[:, None])[:, None, None, :]
    if key_padding_mask is not None:
        vis &= np.asarray(key_padding_mask, dtype=bool).reshape(b, tk)[:, None, None, :]
    if mask is not None:
        m = np.asarray(mask)
        keep = m if m.dtype == bool else m != -np.inf
        vis &= np.broadcast_to(keep, shape)
    return vis


def _variant_problem(q, k, v, causal, scale, variants):
    """Everything the forward and backward oracles share, in float64."""
    unknown = set(variants) - {
        "window",
        "alibi_slopes",
        "softcap",
        "kv_lengths",
        "key_padding_mask",
        "mask",
    }
    if unknown:
        raise TypeError(f"unknown variant keywords {sorted(unknown)}")
    q, k, v = _f64(q, k, v)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"oracle: Hq={hq} is not a multiple of Hkv={hkv}")
    group = hq // hkv
    kr = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    vr = np.repeat(v, group, axis=1)
    sc = _scale(d, scale)
    raw = sc * np.einsum("bhid,bhjd->bhij", q, kr)
    s = raw
    softcap = variants.get("softcap")
    if softcap is not None:
        s = softcap * np.tanh(raw / softcap)
    slopes = variants.get("alibi_slopes")
    if slopes is not None:
        slopes = np.asarray(slopes, dtype=np.float64)
        slopes = slopes[None, :] if slopes.ndim == 1 else slopes  # (1 or B, Hq)
        dist = np.abs(np.arange(tq)[:, None] + (tk - tq) - np.arange(tk)[None, :])
        s = s - slopes[:, :, None, None] * dist
    mask = variants.get("mask")
    if mask is not None and np.asarray(mask).dtype != bool:
        s = s + np.asarray(mask, dtype=np.float64)
    vis = variant_visibility(
        (b, hq, tq, tk),
        causal,
        window=variants.get("window"),
        kv_lengths=variants.get("kv_lengths"),
        key_padding_mask=variants.get("key_padding_mask"),
        mask=mask,
    )
    s = np.where(vis, s, -np.inf)
    sees_any = vis.any(axis=-1)  # (B, Hq, Tq)
    row_max = np.where(sees_any, np.max(s, axis=-1), 0.0)
    e = np.exp(s - row_max[..., None])  # exactly 0 where hidden
    ell = e.sum(axis=-1)
    p = e / np.where(sees_any, ell, 1.0)[..., None]
    return {
        "q": q,
        "kr": kr,
        "vr": vr,
        "raw": raw,
        "s": s,
        "p": p,
        "vis": vis,
        "sees_any": sees_any,
        "row_max": row_max,
        "ell": ell,
        "scale": sc,
        "group": group,
        "softcap": softcap,
    }


def dense_variant_attention(q, k, v, causal: bool = False, scale=None, **variants):
    """``(out, lse)`` in float64 for ``q (B, Hq, Tq, d)``, ``k/v (B, Hkv, Tk, d/dv)``.

    ``variants``: ``window``, ``alibi_slopes``, ``softcap``, ``kv_lengths``,
    ``key_padding_mask``, ``mask`` (bool: True = keep; float: added). Rows that
    see no key give ``out = 0`` and ``lse = -inf``.
    """
    pb = _variant_problem(q, k, v, causal, scale, variants)
    out = np.einsum("bhij,bhjv->bhiv", pb["p"], pb["vr"])
    out = np.where(pb["sees_any"][..., None], out, 0.0)
    sees = pb["sees_any"]
    lse = np.full(sees.shape, -np.inf)
    lse[sees] = pb["row_max"][sees] + np.log(pb["ell"][sees])
    return out, lse


def dense_variant_probabilities(q, k, v, causal: bool = False, scale=None, **variants):
    """The ``(B, Hq, Tq, Tk)`` attention weights (zero where hidden)."""
    return _variant_problem(q, k, v, causal, scale, variants)["p"]


def dense_variant_backward(q, k, v, dout, causal: bool = False, scale=None, **variants):
    """``(dq, dk, dv)`` of ``sum(dense_variant_attention(...)[0] * dout)`` in float64.

    Same textbook formulas as :func:`dense_attention_backward`, then the softcap
    chain rule ``dS_raw = dS * (1 - tanh(s / softcap)^2)`` (ALiBi and an additive
    mask do not depend on q or k), and the GQA sum over each query-head group.
    """
    pb = _variant_problem(q, k, v, causal, scale, variants)
    (dout,) = _f64(dout)
    p, kr, vr, qq = pb["p"], pb["kr"], pb["vr"], pb["q"]
    dv_rep = np.einsum("bhij,bhiv->bhjv", p, dout)
    dp = np.einsum("bhiv,bhjv->bhij", dout, vr)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    if pb["softcap"] is not None:
        ds = ds * (1.0 - np.tanh(pb["raw"] / pb["softcap"]) ** 2)
    dq = pb["scale"] * np.einsum("bhij,bhjd->bhid", ds, kr)
    dk_rep = pb["scale"] * np.einsum("bhij,bhid->bhjd", ds, qq)
    b, hq, tk = dk_rep.shape[0], dk_rep.shape[1], dk_rep.shape[2]
    g = pb["group"]
    dk = dk_rep.reshape(b, hq // g, g, tk, -1).sum(axis=2)
    dv = dv_rep.reshape(b, hq // g, g, tk, -1).sum(axis=2)
    return dq, dk, dv


def dense_extended(q, k, v, dout, causal=False, scale=None, keep=None, sinks=None, **variants):
    """``(out, lse, dq, dk, dv, dsinks)`` in float64 with dropout and sinks.

    ``keep (B, Hq, Tq, Tk)``: dropout's factors, ``0`` where dropped and ``1 /
    (1 - p)`` where kept (None: nothing dropped): ``out = (P * keep) V``.
    ``sinks (Hq,)``: one more column of score ``sinks[h]`` and value zero in
    every row's softmax. ``dsinks`` is None without sinks.
    Written from the formulas on the extended ``(Tq, Tk + 1)`` softmax.
    """
    pb = _variant_problem(q, k, v, causal, scale, variants)
    (dout,) = _f64(dout)
    s, kr, vr, qq = pb["s"], pb["kr"], pb["vr"], pb["q"]
    b, hq, tq, tk = s.shape
    sink_col = np.full((b, hq, tq, 1), -np.inf)
    if sinks is not None:
        sink_col[:] = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
    ext = np.concatenate([s, sink_col], axis=-1)
    top = ext.max(axis=-1, keepdims=True)
    finite = np.isfinite(top)
    e = np.exp(ext - np.where(finite, top, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    p_ext = np.where(finite, e / np.where(finite, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(finite, top + np.log(total), -np.inf)[..., 0]
    p, p_sink = p_ext[..., :-1], p_ext[..., -1]
    factor = np.ones_like(p) if keep is None else np.asarray(keep, dtype=np.float64)
    out = np.einsum("bhij,bhjv->bhiv", p * factor, vr)
    dv_rep = np.einsum("bhij,bhiv->bhjv", p * factor, dout)
    dp = np.einsum("bhiv,bhjv->bhij", dout, vr) * factor
    delta = np.sum(p * dp, axis=-1, keepdims=True)  # the sink's dP is 0
    ds = p * (dp - delta)
    if pb["softcap"] is not None:
        ds = ds * (1.0 - np.tanh(pb["raw"] / pb["softcap"]) ** 2)
    dq = pb["scale"] * np.einsum("bhij,bhjd->bhid", ds, kr)
    dk_rep = pb["scale"] * np.einsum("bhij,bhid->bhjd", ds, qq)
    g = pb["group"]
    dk = dk_rep.reshape(b, hq // g, g, tk, -1).sum(axis=2)
    dv = dv_rep.reshape(b, hq // g, g, tk, -1).sum(axis=2)
    dsinks = None if sinks is None else -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    return out, lse, dq, dk, dv, dsinks


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq = [int(x) for x in np.asarray(cu_seqlens_q)]
    ck = [int(x) for x in np.asarray(cu_seqlens_k)]
    assert len(cq) == len(ck)
    return [(s, cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(cq) - 1)]


def _varlen_slopes(alibi_slopes, s):
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    return slopes if slopes.ndim == 1 else slopes[s]


def dense_varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale=None, **variants
):
    """Packed batches: ``q (Hq, total_q, d)``; each sequence through the dense oracle.

    ``variants``: ``window``, ``alibi_slopes`` ((Hq,) or (S, Hq)), ``softcap``.
    """
    q, k, v = _f64(q, k, v)
    hq, total_q = q.shape[:2]
    scale = _scale(q.shape[-1], scale)
    out = np.zeros((hq, total_q, v.shape[-1]))
    lse = np.full((hq, total_q), -np.inf)
    for s, qa, qb, ka, kb in _sequences(cu_seqlens_q, cu_seqlens_k):
        if qb == qa or kb == ka:
            continue  # no queries, or queries that see no key: zeros and -inf
        kw = dict(variants, alibi_slopes=_varlen_slopes(variants.get("alibi_slopes"), s))
        o, o_lse = dense_variant_attention(
            q[None, :, qa:qb], k[None, :, ka:kb], v[None, :, ka:kb], causal, scale, **kw
        )
        out[:, qa:qb], lse[:, qa:qb] = o[0], o_lse[0]
    return out, lse


def dense_varlen_backward(
    q, k, v, dout, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale=None, **variants
):
    """``(dq, dk, dv)`` of ``sum(dense_varlen_attention(...)[0] * dout)``."""
    q, k, v, dout = _f64(q, k, v, dout)
    scale = _scale(q.shape[-1], scale)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for s, qa, qb, ka, kb in _sequences(cu_seqlens_q, cu_seqlens_k):
        if qb == qa or kb == ka:
            continue
        kw = dict(variants, alibi_slopes=_varlen_slopes(variants.get("alibi_slopes"), s))
        g = dense_variant_backward(
            q[None, :, qa:qb],
            k[None, :, ka:kb],
            v[None, :, ka:kb],
            dout[None, :, qa:qb],
            causal,
            scale,
            **kw,
        )
        dq[:, qa:qb], dk[:, ka:kb], dv[:, ka:kb] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv

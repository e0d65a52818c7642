"""A float64 oracle for flash-attn's API in its own layout, written in torch
from flash-attn's formulas (checked once against tests/dense.py by
test_flash_attn.py); shared by the flash_attn test files."""

from __future__ import annotations

import math

import numpy as np
import torch

from dense import rel_err, variant_visibility


def _dense(q, k, v, causal=False, window=None, softcap=None, alibi=None, scale=None, sinks=None,
           keep=None, dropout_p=0.0):  # fmt: skip
    """``(out (B, Tq, H, dv), lse (B, H, Tq), P (B, H, Tq, Tk))`` in the inputs' dtype.

    flash-attn's layout; k/v repeated per query head (GQA); ``keep (B, H, Tq, Tk)``
    applies dropout as ``P * keep / (1 - p)``. A row that sees no key gives zeros
    and ``lse = -inf`` (with sinks: ``lse = sink``).
    """
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(hq // hkv, dim=2)
    vr = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kr) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = alibi.to(s.dtype).reshape(-1 if alibi.ndim == 2 else 1, hq, 1, 1)
        dist = (torch.arange(tq)[:, None] + tk - tq - torch.arange(tk)[None, :]).abs()
        s = s - slopes * dist.to(s.dtype)
    vis = torch.from_numpy(variant_visibility((b, hq, tq, tk), causal, window=window))
    s = s.masked_fill(~vis, -torch.inf)
    row_max = s.amax(-1, keepdim=True) if tk else s.new_full((b, hq, tq, 1), -torch.inf)
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None]
        row_max = torch.maximum(row_max, sink)
    m = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - m)
    ell = e.sum(-1, keepdim=True)
    if sinks is not None:
        ell = ell + torch.exp(sink - m)
    p = e / torch.where(ell > 0, ell, torch.ones_like(ell))
    lse = torch.where(ell > 0, m + torch.log(ell), torch.full_like(ell, -torch.inf))[..., 0]
    pd = p if keep is None else p * keep / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", pd, vr), lse, p


def _inputs(b, tq, tk, hq, hkv, d, dv=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, dv or d))
    return tuple(torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes)


def _f64(*ts):
    return tuple(None if t is None else t.detach().double() for t in ts)


def _assert_float32_accuracy(out, q, k, v, **kw):
    """The accuracy rule: within 3x the error of naive float32 attention, vs float64."""
    ref = _dense(*_f64(q, k, v), **kw)[0]
    naive = _dense(q, k, v, **kw)[0]
    err = rel_err(out.detach().numpy(), ref.numpy())
    assert err <= 3 * max(rel_err(naive.detach().numpy(), ref.numpy()), 1e-7), err
    return ref


VARLEN_Q, VARLEN_K = [3, 0, 5, 4, 2], [5, 4, 7, 0, 9]


def _varlen_case(hq, hkv, d, dtype, grad=False, seed=3):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.cumsum([0, *VARLEN_Q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *VARLEN_K]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g, dtype=dtype).requires_grad_(grad)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=dtype).requires_grad_(grad)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=dtype).requires_grad_(grad)
    return q, k, v, cu_q, cu_k


def _varlen_oracle(q, k, v, cu_q, cu_k, alibi=None, **kw):
    """Sequence by sequence through :func:`_dense`: ``(out, lse (H, total_q), S padded)``."""
    outs, lses = [], []
    probs = torch.zeros(len(cu_q) - 1, q.shape[1], max(VARLEN_Q), max(VARLEN_K), dtype=q.dtype)
    for s in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if qb == qa:
            continue
        if kb == ka:
            outs.append(q.new_zeros(qb - qa, q.shape[1], v.shape[2]) * q[qa:qb].sum())
            lses.append(torch.full((q.shape[1], qb - qa), -torch.inf, dtype=q.dtype))
            continue
        slopes = None if alibi is None else (alibi if alibi.ndim == 1 else alibi[s])
        o, lse, p = _dense(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], alibi=slopes, **kw)
        outs.append(o[0])
        lses.append(lse[0])
        probs[s, :, : qb - qa, : kb - ka] = p[0].detach()
    return torch.cat(outs), torch.cat(lses, 1), probs

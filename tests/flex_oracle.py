"""The dense oracle of the FlexAttention tests (tests/test_flex*.py).

``dense_flex`` materialises every score in eager torch and applies the mod to
the whole score matrix through broadcast index tensors: the ground truth the
compiled mods are compared against, by the accuracy rule (:func:`_check`).
"""

from __future__ import annotations

import math

import torch

B, HQ, HKV, T, D = 2, 4, 2, 77, 16


def _indices(b, h, tq, tk):
    return (
        torch.arange(b).view(-1, 1, 1, 1),
        torch.arange(h).view(1, -1, 1, 1),
        torch.arange(tq).view(1, 1, -1, 1),
        torch.arange(tk).view(1, 1, 1, -1),
    )


def dense_flex(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """``(out, lse)`` with every score materialised: the oracle."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    idx = _indices(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see no key: zeros
    return p.to(v.dtype) @ v, lse


def _inputs(seed=0, tq=T, tk=T, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(seed)

    def make(h, t):
        return torch.randn(B, h, t, D, generator=g, dtype=dtype).requires_grad_(grad)

    return make(HQ, tq), make(HKV, tk), make(HKV, tk)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _check(got, base, ref, what, floor=1e-6, scale=0.0):
    """The accuracy rule: within 2x the float32 dense error, plus a floor
    relative to ``ref`` (or to ``scale``, the size of the quantity that
    produced it, where ``ref`` is all zeros: a gradient that vanishes
    exactly in float64 comes out as rounding noise)."""
    got, base, ref = (t.detach().double() for t in (got, base, ref))
    err, base_err = float((got - ref).norm()), float((base - ref).norm())
    size = max(float(ref.norm()), scale)
    assert err <= 2 * base_err + floor * size, f"{what}: {err:.3g} vs float32 dense {base_err:.3g}"

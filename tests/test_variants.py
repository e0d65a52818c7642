"""Attention variants (issue 4): GQA/MQA, sliding windows, ALiBi, softcap, key
padding, arbitrary masks, block masks and packed variable-length batches.

Every path is compared with the independent dense oracle in ``dense.py``
(materialised scores, mask, bias, softcap, softmax, in float64). The first
section checks that oracle itself: against hand-computed values, a scalar
loop written separately, and central finite differences.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashtile as ft
from dense import (
    dense_attention,
    dense_attention_backward,
    dense_variant_attention,
    dense_variant_backward,
    dense_variant_probabilities,
    dense_varlen_attention,
    dense_varlen_backward,
    rel_err,
    variant_visibility,
)

# --------------------------------------------------------------------------------------
# Problem builders
# --------------------------------------------------------------------------------------


def no_variants(rng, shape):
    return {}


def window(left, right):
    return lambda rng, shape: {"window": (left, right)}


def alibi(per_batch: bool = False):
    def make(rng, shape):
        b, hq = shape[:2]
        return {"alibi_slopes": rng.uniform(0.05, 1.0, (b, hq) if per_batch else (hq,))}

    return make


def softcap(cap: float):
    return lambda rng, shape: {"softcap": cap}


def scale(value: float):
    return lambda rng, shape: {"scale": value}


def lengths(*kv_lengths):
    return lambda rng, shape: {"kv_lengths": np.array(kv_lengths, dtype=np.int64)}


def padding_mask(rng, shape):
    b, tk = shape[0], shape[4]
    keep = rng.random((b, tk)) < 0.7
    keep[:, 0] = True
    return {"key_padding_mask": keep}


def _mask_shape(dims: str, shape) -> tuple[int, ...]:
    """``dims`` spells the mask shape: b=B, h=Hq, q=Tq, k=Tk, 1=1 (e.g. ``"b1qk"``)."""
    b, hq, _, tq, tk = shape[:5]
    sizes = {"b": b, "h": hq, "q": tq, "k": tk, "1": 1}
    return tuple(sizes[c] for c in dims)


def bool_mask(dims: str, density: float = 0.6):
    return lambda rng, shape: {"mask": rng.random(_mask_shape(dims, shape)) < density}


def float_mask(dims: str, p_hidden: float = 0.15):
    def make(rng, shape):
        mshape = _mask_shape(dims, shape)
        mask = rng.standard_normal(mshape)
        mask[rng.random(mshape) < p_hidden] = -np.inf
        return {"mask": mask}

    return make


def combine(*makers):
    def make(rng, shape):
        out = {}
        for m in makers:
            out.update(m(rng, shape))
        return out

    return make


@dataclass(frozen=True)
class Case:
    """One attention problem: shape ``(B, Hq, Hkv, Tq, Tk, d, dv)`` plus variants."""

    name: str
    shape: tuple[int, int, int, int, int, int, int]
    causal: bool = False
    make: Callable = no_variants
    block: int = 7  # reference tile size: does not divide the sequence lengths
    amp: float = 1.0  # scale of q and k (large enough for softcap to bite)

    def build(self, rng, dtype=np.float64):
        b, hq, hkv, tq, tk, d, dv = self.shape
        q = (self.amp * rng.standard_normal((b, hq, tq, d))).astype(dtype)
        k = (self.amp * rng.standard_normal((b, hkv, tk, d))).astype(dtype)
        v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
        dout = rng.standard_normal((b, hq, tq, dv)).astype(dtype)
        return q, k, v, dout, self.make(rng, self.shape)


def _ids(cases):
    return [c.name for c in cases]


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def _visibility(case, var):
    """The oracle's ``(B, Hq, Tq, Tk)`` visibility for a case and its variants."""
    b, hq, _, tq, tk = case.shape[:5]
    return variant_visibility(
        (b, hq, tq, tk),
        case.causal,
        window=var.get("window"),
        kv_lengths=var.get("kv_lengths"),
        key_padding_mask=var.get("key_padding_mask"),
        mask=var.get("mask"),
    )


def assert_lse_close(lse, ref, tol):
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    if finite.any():
        assert rel_err(lse[finite], ref[finite]) < tol


def assert_grads_close(got, want, tol):
    assert len(got) == 3
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        assert rel_err(g, w) < tol, name


# --------------------------------------------------------------------------------------
# 1. The oracle checks itself (these pass without any flashtile variant code)
# --------------------------------------------------------------------------------------


def _scalar_attention(q, k, v, causal=False, scale=None, **variants):
    """A plain-Python loop over (b, h, i, j), written separately from the oracle."""
    b_, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    window = variants.get("window")
    slopes = variants.get("alibi_slopes")
    cap = variants.get("softcap")
    kv_lengths = variants.get("kv_lengths")
    kpm = variants.get("key_padding_mask")
    mask = variants.get("mask")
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), (b_, hq, tq, tk))
    left = right = math.inf
    if window is not None:
        left = math.inf if window[0] in (None, -1) else window[0]
        right = math.inf if window[1] in (None, -1) else window[1]
    if causal:
        right = 0
    out = np.zeros((b_, hq, tq, v.shape[-1]))
    lse = np.full((b_, hq, tq), -np.inf)
    for b in range(b_):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(tq):
                p = i + tk - tq
                scores = {}
                for j in range(tk):
                    if j < p - left or j > p + right:
                        continue
                    if kv_lengths is not None and j >= kv_lengths[b]:
                        continue
                    if kpm is not None and not kpm[b][j]:
                        continue
                    if mask is not None and mask.dtype == bool and not mask[b, h, i, j]:
                        continue
                    s = sc * sum(float(q[b, h, i, c]) * float(k[b, g, j, c]) for c in range(d))
                    if cap is not None:
                        s = cap * math.tanh(s / cap)
                    if slopes is not None:
                        slope = slopes[h] if np.ndim(slopes) == 1 else slopes[b][h]
                        s -= slope * abs(p - j)
                    if mask is not None and mask.dtype != bool:
                        s += float(mask[b, h, i, j])
                    if s != -math.inf:
                        scores[j] = s
                if not scores:
                    continue
                top = max(scores.values())
                ell = sum(math.exp(s - top) for s in scores.values())
                lse[b, h, i] = top + math.log(ell)
                for j, s in scores.items():
                    out[b, h, i] += math.exp(s - lse[b, h, i]) * v[b, g, j]
    return out, lse


# Tiny problems that exercise each variant, for the scalar loop and finite differences.
TINY = [
    Case("plain", (1, 2, 2, 3, 4, 2, 3)),
    Case("causal-Tq<Tk", (1, 2, 2, 3, 5, 2, 2), causal=True),
    Case("gqa", (2, 4, 2, 3, 4, 2, 2)),
    Case("mqa-causal-Tq>Tk", (1, 3, 1, 5, 3, 2, 2), causal=True),
    Case("window", (1, 2, 2, 4, 5, 2, 2), make=window(1, 1)),
    Case("window-Tq>Tk", (1, 2, 2, 6, 3, 2, 2), make=window(2, None)),
    Case("causal-window", (2, 2, 1, 5, 4, 2, 3), causal=True, make=window(1, -1)),
    Case("alibi", (1, 2, 2, 3, 4, 2, 2), make=alibi()),
    Case("alibi-batch", (2, 2, 1, 3, 4, 2, 2), causal=True, make=alibi(per_batch=True)),
    Case("softcap", (1, 2, 2, 3, 4, 3, 2), make=softcap(0.7), amp=2.0),
    Case("softcap-alibi", (1, 2, 1, 4, 3, 3, 2), make=combine(softcap(0.9), alibi()), amp=2.0),
    Case("kv_lengths", (2, 2, 2, 3, 5, 2, 2), make=lengths(5, 2)),
    Case("kv_lengths-zero", (2, 2, 1, 3, 4, 2, 2), causal=True, make=lengths(0, 3)),
    Case("key_padding_mask", (2, 2, 2, 3, 5, 2, 2), make=padding_mask),
    Case("mask-bool", (2, 4, 2, 3, 5, 2, 2), make=bool_mask("bhqk")),
    Case("mask-bool-2d", (1, 2, 1, 4, 5, 2, 2), make=bool_mask("qk")),
    Case("mask-float", (2, 2, 2, 3, 5, 2, 2), make=float_mask("b1qk", 0.3)),
    Case(
        "everything",
        (2, 4, 2, 4, 5, 2, 3),
        causal=True,
        make=combine(
            window(2, None),
            alibi(True),
            softcap(1.1),
            lengths(5, 4),
            float_mask("1hqk"),
            scale(0.8),
        ),
        amp=1.5,
    ),
]


@pytest.mark.parametrize("case", TINY, ids=_ids(TINY))
def test_oracle_matches_scalar_loop(rng, case):
    q, k, v, _, var = case.build(rng)
    out, lse = dense_variant_attention(q, k, v, case.causal, **var)
    want_out, want_lse = _scalar_attention(q, k, v, case.causal, **var)
    assert rel_err(out, want_out) < 1e-13
    assert_lse_close(lse, want_lse, 1e-13)


def _finite_difference_grads(q, k, v, dout, causal, var, h=1e-6):
    def loss(*args):
        return float(np.sum(dense_variant_attention(*args, causal, **var)[0] * dout))

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for ix in np.ndindex(x.shape):
            x0 = x[ix]
            x[ix] = x0 + h
            up = loss(*args)
            x[ix] = x0 - h
            down = loss(*args)
            x[ix] = x0
            g[ix] = (up - down) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("case", TINY, ids=_ids(TINY))
def test_oracle_backward_matches_finite_differences(rng, case):
    q, k, v, dout, var = case.build(rng)
    got = dense_variant_backward(q, k, v, dout, case.causal, **var)
    want = _finite_difference_grads(q, k, v, dout, case.causal, var)
    assert float(np.abs(want[0]).max()) > 0  # a non-trivial gradient
    assert_grads_close(got, want, 1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_without_variants_is_the_plain_oracle(rng, causal):
    q, k, v, dout, _ = Case("plain", (2, 3, 3, 9, 13, 4, 5)).build(rng)
    out, lse = dense_variant_attention(q, k, v, causal)
    want_out, want_lse = dense_attention(q, k, v, causal)
    assert rel_err(out, want_out) < 1e-14
    assert_lse_close(lse, want_lse, 1e-14)
    grads = dense_variant_backward(q, k, v, dout, causal)
    assert_grads_close(grads, dense_attention_backward(q, k, v, dout, causal), 1e-14)


def test_oracle_gqa_reads_kv_head_h_over_group():
    q = np.zeros((1, 4, 2, 3))
    k = np.zeros((1, 2, 3, 3))
    v = np.ones((1, 2, 3, 1)) * np.array([1.0, 2.0])[None, :, None, None]
    out, _ = dense_variant_attention(q, k, v)
    np.testing.assert_allclose(out[0, :, 0, 0], [1.0, 1.0, 2.0, 2.0], rtol=1e-15)


def test_oracle_window_by_hand():
    # q = 0: every visible key gets the same weight; v = I turns weights into out.
    q, k, v = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 5, 2)), np.eye(5)[None, None]
    out, lse = dense_variant_attention(q, k, v, window=(1, 0))
    # Tq=3, Tk=5: query i sits at p = i + 2 and sees keys p-1..p.
    want = [[0, 0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5, 0], [0, 0, 0, 0.5, 0.5]]
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-15)
    np.testing.assert_allclose(lse[0, 0], [math.log(2)] * 3, rtol=1e-15)
    # Tq=5, Tk=3, causal caps the right side at 0: p = i - 2 sees keys p-1..p.
    q, k, v = np.zeros((1, 1, 5, 2)), np.zeros((1, 1, 3, 2)), np.eye(3)[None, None]
    out, lse = dense_variant_attention(q, k, v, True, window=(1, 5))
    want = [[0, 0, 0], [0, 0, 0], [1, 0, 0], [0.5, 0.5, 0], [0, 0.5, 0.5]]
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-15)
    np.testing.assert_array_equal(lse[0, 0, :2], [-np.inf, -np.inf])
    np.testing.assert_allclose(lse[0, 0, 2:], [0, math.log(2), math.log(2)], rtol=1e-15)
    # window (0, 0) is the diagonal; unbounded sides are None or -1.
    q, k, v = np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)), np.eye(4)[None, None]
    np.testing.assert_array_equal(
        dense_variant_attention(q, k, v, window=(0, 0))[0][0, 0], np.eye(4)
    )
    a = dense_variant_attention(q, k, v, window=(None, 1))[0]
    np.testing.assert_array_equal(a, dense_variant_attention(q, k, v, window=(-1, 1))[0])
    np.testing.assert_allclose(a[0, 0, 0], [0.5, 0.5, 0, 0], rtol=1e-15)
    np.testing.assert_allclose(a[0, 0, 3], [0.25] * 4, rtol=1e-15)


def test_oracle_alibi_by_hand():
    q, k, v = np.zeros((2, 1, 1, 2)), np.zeros((2, 1, 3, 2)), np.eye(3)[None, None]
    v = np.broadcast_to(v, (2, 1, 3, 3))
    # Tq=1, Tk=3: the query sits at p=2; bias -slope * [2, 1, 0].
    for slopes in (np.array([0.5]), np.array([[0.5], [0.5]])):
        out, lse = dense_variant_attention(q, k, v, alibi_slopes=slopes)
        e = np.exp([-1.0, -0.5, 0.0])
        np.testing.assert_allclose(out[0, 0, 0], e / e.sum(), rtol=1e-15)
        np.testing.assert_allclose(lse[:, 0, 0], [math.log(e.sum())] * 2, rtol=1e-15)
    _, lse = dense_variant_attention(q, k, v, alibi_slopes=np.array([[0.5], [2.0]]))
    np.testing.assert_allclose(lse[1, 0, 0], math.log(np.exp([-4.0, -2.0, 0.0]).sum()))


def test_oracle_softcap_by_hand():
    q = np.array([[[[3.0]]]])
    k = np.array([[[[1.0], [0.0]]]])
    v = np.array([[[[1.0], [0.0]]]])
    out, lse = dense_variant_attention(q, k, v, scale=1.0, softcap=2.0)
    s = 2.0 * math.tanh(1.5)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(math.exp(s) + 1.0), rtol=1e-15)
    np.testing.assert_allclose(out[0, 0, 0, 0], math.exp(s) / (math.exp(s) + 1.0), rtol=1e-15)
    # softcap is applied before ALiBi: p = 1, bias -0.5 * [1, 0].
    _, lse = dense_variant_attention(q, k, v, scale=1.0, softcap=2.0, alibi_slopes=[0.5])
    np.testing.assert_allclose(lse[0, 0, 0], math.log(math.exp(s - 0.5) + 1.0), rtol=1e-15)
    # and the scale before softcap.
    _, lse = dense_variant_attention(q, k, v, scale=0.5, softcap=2.0)
    s = 2.0 * math.tanh(0.75)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(math.exp(s) + 1.0), rtol=1e-15)


def test_oracle_masks_and_padding_by_hand():
    q, k, v = np.zeros((2, 1, 1, 2)), np.zeros((2, 1, 4, 2)), np.eye(4)[None, None]
    v = np.broadcast_to(v, (2, 1, 4, 4))
    out, lse = dense_variant_attention(q, k, v, kv_lengths=np.array([3, 0]))
    np.testing.assert_allclose(out[0, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-15)
    np.testing.assert_array_equal(out[1], 0.0)
    assert lse[1, 0, 0] == -np.inf
    kpm = np.array([[True, False, True, False], [False] * 4])
    out2, _ = dense_variant_attention(q, k, v, key_padding_mask=kpm)
    np.testing.assert_allclose(out2[0, 0, 0], [0.5, 0, 0.5, 0], rtol=1e-15)
    np.testing.assert_array_equal(out2[1], 0.0)
    fmask = np.array([[math.log(3.0), 0.0, -np.inf, 0.0]])
    out3, lse3 = dense_variant_attention(q, k, v, mask=fmask)
    np.testing.assert_allclose(out3[0, 0, 0], [0.6, 0.2, 0, 0.2], rtol=1e-15)
    np.testing.assert_allclose(lse3[0, 0, 0], math.log(5.0), rtol=1e-15)
    out4, lse4 = dense_variant_attention(q, k, v, mask=np.isfinite(fmask))
    np.testing.assert_allclose(out4[0, 0, 0], [1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-15)
    np.testing.assert_allclose(lse4[0, 0, 0], math.log(3.0), rtol=1e-15)


def test_oracle_varlen_equals_batched_oracle_for_equal_lengths(rng):
    q, k, v, dout, _ = Case("x", (3, 4, 2, 6, 9, 3, 2)).build(rng)
    packed = [np.concatenate(list(a), axis=1) for a in (q, k, v, dout)]  # (H, 3*T, d)
    cu_q, cu_k = np.array([0, 6, 12, 18]), np.array([0, 9, 18, 27])
    var = {"window": (3, 1), "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]), "softcap": 2.0}
    out, lse = dense_varlen_attention(*packed[:3], cu_q, cu_k, True, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, True, **var)
    assert rel_err(out, np.concatenate(list(want_out), axis=1)) < 1e-14
    assert_lse_close(lse, np.concatenate(list(want_lse), axis=1), 1e-14)
    grads = dense_varlen_backward(*packed, cu_q, cu_k, True, **var)
    want = dense_variant_backward(q, k, v, dout, True, **var)
    assert_grads_close(grads, [np.concatenate(list(w), axis=1) for w in want], 1e-14)


# --------------------------------------------------------------------------------------
# 2. Reference and fast kernel vs the oracle, per variant and in pairs
# --------------------------------------------------------------------------------------

CASES = [
    Case("gqa", (2, 6, 2, 37, 37, 5, 3)),
    Case("gqa-causal-Tq<Tk", (2, 6, 3, 29, 41, 4, 4), causal=True),
    Case("mqa-causal-Tq>Tk", (1, 4, 1, 41, 29, 3, 5), causal=True),
    Case("window", (2, 2, 2, 53, 53, 4, 3), make=window(5, 3)),
    Case("window-left-only", (1, 3, 3, 40, 40, 3, 3), make=window(7, None)),
    Case("window-right-only", (1, 2, 2, 40, 40, 3, 2), make=window(-1, 2)),
    Case("window-diagonal", (1, 2, 2, 23, 23, 3, 3), make=window(0, 0)),
    Case("window-Tq<Tk", (2, 2, 2, 13, 50, 4, 3), make=window(4, 2)),
    Case("window-Tq>Tk", (2, 2, 2, 50, 13, 4, 3), make=window(3, 1)),
    Case("causal-window", (2, 2, 2, 45, 45, 5, 4), causal=True, make=window(8, 4)),
    Case("causal-window-Tq<Tk", (1, 2, 2, 19, 61, 4, 4), causal=True, make=window(6, None)),
    Case("causal-window-Tq>Tk", (1, 2, 2, 61, 19, 4, 4), causal=True, make=window(6, 0)),
    Case("gqa-window", (2, 4, 2, 33, 47, 4, 5), make=window(6, 6)),
    Case("alibi", (2, 3, 3, 31, 31, 4, 4), make=alibi()),
    Case("alibi-per-batch-causal", (2, 4, 2, 21, 34, 4, 3), causal=True, make=alibi(True)),
    Case("softcap", (2, 2, 2, 30, 30, 8, 4), make=softcap(1.5), amp=2.5),
    Case(
        "softcap-alibi",
        (2, 3, 1, 27, 35, 8, 4),
        causal=True,
        make=combine(softcap(2.0), alibi()),
        amp=2.5,
    ),
    Case("kv_lengths", (3, 2, 2, 17, 40, 4, 3), make=lengths(40, 23, 1)),
    Case("padding-causal", (2, 2, 1, 40, 40, 4, 3), causal=True, make=lengths(31, 40)),
    Case("padding-causal-Tq<Tk", (2, 2, 2, 12, 28, 4, 3), causal=True, make=lengths(5, 28)),
    Case("key_padding_mask", (2, 2, 2, 20, 33, 4, 3), make=padding_mask),
    Case("mask-bool-b1qk", (2, 3, 3, 25, 38, 4, 3), make=bool_mask("b1qk")),
    Case("mask-bool-qk-causal", (1, 2, 2, 30, 30, 4, 4), causal=True, make=bool_mask("qk")),
    Case("mask-bool-b11k", (2, 2, 2, 19, 27, 3, 3), make=bool_mask("b11k")),
    Case("mask-float", (2, 2, 2, 26, 31, 4, 4), make=float_mask("bhqk")),
    Case("mask-gqa", (2, 4, 2, 26, 31, 4, 4), causal=True, make=bool_mask("bhqk")),
    Case(
        "everything",
        (2, 6, 2, 37, 44, 5, 3),
        causal=True,
        make=combine(
            window(9, None),
            alibi(True),
            softcap(2.0),
            lengths(44, 30),
            float_mask("b1qk"),
            scale(0.4),
        ),
        amp=2.0,
    ),
    Case(
        "long-causal-window",
        (1, 2, 1, 1025, 1025, 3, 2),
        causal=True,
        make=window(64, 0),
        block=100,
    ),
    Case("long-alibi-Tq1", (1, 2, 2, 1, 1025, 4, 4), causal=True, make=alibi(), block=333),
]
TILES = {"block_q": 16, "block_k": 24}


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_reference_forward_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, lse = ft.tiled_attention(q, k, v, case.block, case.causal, return_lse=True, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, case.causal, **var)
    assert out.shape == want_out.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_naive_forward_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, weights = ft.naive_attention(q, k, v, case.causal, **var)
    want_out, _ = dense_variant_attention(q, k, v, case.causal, **var)
    want_p = dense_variant_probabilities(q, k, v, case.causal, **var)
    assert out.shape == want_out.shape and weights.shape == want_p.shape
    assert rel_err(out, want_out) < 1e-12
    assert rel_err(weights, want_p) < 1e-12
    assert np.all(weights[~_visibility(case, var)] == 0)  # hidden keys get exactly zero weight


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_reference_backward_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng)
    block = case.block
    out, lse = ft.tiled_attention(q, k, v, block, case.causal, return_lse=True, **var)
    grads = ft.tiled_attention_backward(q, k, v, out, dout, lse, block, case.causal, **var)
    want = dense_variant_backward(q, k, v, dout, case.causal, **var)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_fast_forward_float64_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, case.causal, **var)
    assert out.dtype == np.float64 and out.shape == want_out.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_fast_backward_float64_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=case.causal, **TILES, **var)
    want = dense_variant_backward(q, k, v, dout, case.causal, **var)
    assert all(g.dtype == np.float64 for g in grads)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_fast_float32_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng, np.float32)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    assert out.dtype == np.float32
    want_out, want_lse = dense_variant_attention(*_f64(q, k, v), case.causal, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=case.causal, **TILES, **var)
    assert all(g.dtype == np.float32 for g in grads)
    want = dense_variant_backward(*_f64(q, k, v, dout), case.causal, **var)
    assert_grads_close(grads, want, 1e-5)


# Spellings that must mean the same thing (checked without the oracle).
EQUIVALENT = [
    ("window-None-vs-minus1", False, {"window": (None, 2)}, {"window": (-1, 2)}),
    ("window-unbounded-vs-none", False, {"window": (-1, -1)}, {}),
    ("window-None-None-vs-none", True, {"window": (None, None)}, {}),
    ("window-wider-than-T-vs-none", False, {"window": (500, 500)}, {}),
    ("causal-caps-right", True, {"window": (4, 9)}, {"window": (4, 0)}),
    ("causal-right-unbounded", True, {"window": (4, None)}, {"window": (4, 0)}),
    ("zero-slopes-vs-none", True, {"alibi_slopes": np.zeros(4)}, {}),
    ("huge-softcap-vs-none", False, {"softcap": 1e9}, {}),
    (
        "kv_lengths-vs-key_padding_mask",
        True,
        {"kv_lengths": np.array([11, 4])},
        {"key_padding_mask": np.arange(17)[None, :] < np.array([[11], [4]])},
    ),
    (
        "bool-mask-2d-vs-4d",
        False,
        {"mask": np.tri(13, 17, 3, dtype=bool)},
        {"mask": np.broadcast_to(np.tri(13, 17, 3, dtype=bool), (2, 4, 13, 17)).copy()},
    ),
    (
        "bool-vs-float-mask",
        False,
        {"mask": np.tri(13, 17, 3, dtype=bool)},
        {"mask": np.where(np.tri(13, 17, 3, dtype=bool), 0.0, -np.inf)},
    ),
]


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize(
    ("causal", "var_a", "var_b"),
    [e[1:] for e in EQUIVALENT],
    ids=[e[0] for e in EQUIVALENT],
)
def test_equivalent_spellings(rng, path, causal, var_a, var_b):
    q, k, v, dout, _ = Case("x", (2, 4, 2, 13, 17, 4, 3)).build(rng)

    def run(var):
        if path == "reference":
            out, lse = ft.tiled_attention(q, k, v, 5, causal, return_lse=True, **var)
            grads = ft.tiled_attention_backward(q, k, v, out, dout, lse, 5, causal, **var)
        else:
            out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, **TILES, **var)
            grads = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, **TILES, **var)
        return out, lse, grads

    out_a, lse_a, grads_a = run(var_a)
    out_b, lse_b, grads_b = run(var_b)
    assert rel_err(out_a, out_b) < 1e-12
    assert_lse_close(lse_a, np.asarray(lse_b), 1e-12)
    assert_grads_close(grads_a, grads_b, 1e-10)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_gqa_equals_explicitly_repeated_kv(rng, path):
    q, k, v, dout, _ = Case("x", (2, 6, 2, 21, 30, 4, 3)).build(rng)
    k3, v3 = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    var = {"window": (5, 2)}

    def run(kk, vv):
        if path == "reference":
            out, lse = ft.tiled_attention(q, kk, vv, 8, True, return_lse=True, **var)
            return out, ft.tiled_attention_backward(q, kk, vv, out, dout, lse, 8, True, **var)
        out, lse = ft.attention(q, kk, vv, causal=True, return_lse=True, **TILES, **var)
        return out, ft.attention_backward(q, kk, vv, out, lse, dout, causal=True, **TILES, **var)

    out_g, (dq_g, dk_g, dv_g) = run(k, v)
    out_r, (dq_r, dk_r, dv_r) = run(k3, v3)
    assert rel_err(out_g, out_r) < 1e-12
    assert rel_err(dq_g, dq_r) < 1e-10
    assert dk_g.shape == k.shape and dv_g.shape == v.shape
    assert rel_err(dk_g, dk_r.reshape(2, 2, 3, 30, 4).sum(axis=2)) < 1e-10
    assert rel_err(dv_g, dv_r.reshape(2, 2, 3, 30, 3).sum(axis=2)) < 1e-10


@settings(max_examples=30, deadline=None)
@given(
    tq=st.integers(1, 60),
    tk=st.integers(1, 60),
    heads=st.sampled_from([(2, 2), (2, 1), (4, 2)]),
    causal=st.booleans(),
    left=st.sampled_from([None, 0, 1, 5, 17]),
    right=st.sampled_from([None, 0, 2, 9]),
    block_q=st.integers(1, 40),
    block_k=st.integers(1, 40),
    seed=st.integers(0, 2**31),
)
def test_fast_window_any_tiles_matches_oracle(
    tq, tk, heads, causal, left, right, block_q, block_k, seed
):
    """Band skipping must be exact for every tile size, window and alignment."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    q = rng.standard_normal((1, hq, tq, 3))
    k = rng.standard_normal((1, hkv, tk, 3))
    v = rng.standard_normal((1, hkv, tk, 2))
    dout = rng.standard_normal((1, hq, tq, 2))
    var = {"window": (left, right)}
    tiles = {"block_q": block_q, "block_k": block_k}
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, **tiles, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, causal, **var)
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, **tiles, **var)
    assert_grads_close(grads, dense_variant_backward(q, k, v, dout, causal, **var), 1e-10)


# --------------------------------------------------------------------------------------
# 3. Rows that see no key: zeros, lse = -inf, zero gradients, no NaN, no warning
# --------------------------------------------------------------------------------------


def _mask_with_empty_rows(rng, shape):
    b, hq, _, tq, tk = shape[:5]
    mask = rng.random((b, hq, tq, tk)) < 0.5
    mask[:, :, :, 0] = True
    mask[0, 1, 3] = False
    mask[1, 0, :4] = False
    mask[1, 3, -1] = False
    return {"mask": mask}


def _float_mask_with_empty_rows(rng, shape):
    b, _, _, tq, tk = shape[:5]
    mask = rng.standard_normal((b, 1, tq, tk))
    mask[0, 0, 2] = -np.inf
    mask[1, 0, 5:7] = -np.inf
    return {"mask": mask}


def _padding_mask_empty_batch(rng, shape):
    keep = np.ones((shape[0], shape[4]), dtype=bool)
    keep[1] = False
    keep[0, 5:] = False
    return {"key_padding_mask": keep}


EMPTY = [
    Case("window-outside-keys", (2, 2, 2, 20, 6, 4, 3), make=window(2, 0)),
    Case("window-outside-causal-Tq>Tk", (1, 2, 1, 30, 8, 4, 3), causal=True, make=window(3, 0)),
    Case("kv_lengths-zero", (2, 4, 2, 9, 12, 4, 3), make=lengths(0, 7)),
    Case("kv_lengths-zero-causal", (2, 2, 2, 9, 12, 4, 3), causal=True, make=lengths(7, 0)),
    Case("mask-all-false-rows-gqa", (2, 4, 2, 10, 30, 4, 3), make=_mask_with_empty_rows),
    Case("float-mask-all-inf-rows", (2, 2, 2, 10, 30, 4, 3), make=_float_mask_with_empty_rows),
    Case("key_padding_mask-empty", (2, 2, 2, 11, 13, 4, 3), make=_padding_mask_empty_batch),
    Case("causal-Tq>Tk-gqa", (1, 4, 2, 40, 9, 16, 16), causal=True),
    Case("window-and-padding", (2, 2, 2, 20, 20, 4, 3), make=combine(window(3, 3), lengths(5, 20))),
]


def _run_path(path, case, rng):
    dtype = np.float32 if path == "fast-float32" else np.float64
    q, k, v, dout, var = case.build(rng, dtype)
    c = case.causal
    if path == "reference":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = ft.tiled_attention(q, k, v, 4, c, return_lse=True, **var)
            grads = ft.tiled_attention_backward(q, k, v, out, dout, lse, 4, c, **var)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out, lse = ft.attention(q, k, v, causal=c, return_lse=True, **TILES, **var)
            grads = ft.attention_backward(q, k, v, out, lse, dout, causal=c, **TILES, **var)
    return (q, k, v, dout, var), out, lse, grads


@pytest.mark.parametrize("path", ["reference", "fast-float64", "fast-float32"])
@pytest.mark.parametrize("case", EMPTY, ids=_ids(EMPTY))
def test_rows_that_see_no_key(rng, case, path):
    (q, k, v, dout, var), out, lse, (dq, dk, dv) = _run_path(path, case, rng)
    b, hq, hkv, tq, tk = case.shape[:5]
    vis = _visibility(case, var)
    empty = ~vis.any(axis=-1)  # (B, Hq, Tq)
    assert empty.any() and not empty.all()  # the scenario has both kinds of rows
    unseen = ~vis.reshape(b, hkv, hq // hkv, tq, tk).any(axis=(2, 3))  # (B, Hkv, Tk)
    for a in (out, lse, dq, dk, dv):
        assert not np.isnan(a).any()
    assert np.all(out[empty] == 0)
    assert np.all(np.isneginf(lse[empty]))
    assert np.all(np.isfinite(lse[~empty])) and np.all(np.isfinite(out))
    assert np.all(dq[empty] == 0)
    assert np.all(dk[unseen] == 0) and np.all(dv[unseen] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    tol, gtol = (1e-5, 1e-5) if path == "fast-float32" else (1e-12, 1e-10)
    want_out, want_lse = dense_variant_attention(*_f64(q, k, v), case.causal, **var)
    assert rel_err(out, want_out) < tol
    assert_lse_close(lse, want_lse, tol)
    want = dense_variant_backward(*_f64(q, k, v, dout), case.causal, **var)
    assert_grads_close((dq, dk, dv), want, gtol)


def test_naive_rows_that_see_no_key(rng):
    q, k, v, _, var = EMPTY[2].build(rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = ft.naive_attention(q, k, v, False, **var)
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(weights[0], 0.0)
    np.testing.assert_allclose(weights[1].sum(axis=-1), 1.0, rtol=1e-14)


# --------------------------------------------------------------------------------------
# 4. Packed variable-length batches
# --------------------------------------------------------------------------------------

# (lengths of q, lengths of k) per sequence: Tq != Tk both ways and a length-1 sequence.
VARLEN_LENGTHS = [
    ([5, 1, 17, 9], [5, 1, 23, 3]),
    ([7, 1, 30], [7, 1, 30]),
]
VARLEN_VARIANTS = [
    ("plain", {}),
    ("window", {"window": (3, 2)}),
    ("alibi", {"alibi_slopes": np.array([0.3, 0.1, 0.7, 0.05])}),
    ("softcap", {"softcap": 1.5}),
    (
        "window-alibi-softcap",
        {"window": (4, None), "alibi_slopes": np.full(4, 0.2), "softcap": 3.0},
    ),
]


def _packed(rng, q_lens, k_lens, hq=4, hkv=2, d=5, dv=3, dtype=np.float64, amp=2.0):
    tq, tk = sum(q_lens), sum(k_lens)
    q = (amp * rng.standard_normal((hq, tq, d))).astype(dtype)
    k = (amp * rng.standard_normal((hkv, tk, d))).astype(dtype)
    v = rng.standard_normal((hkv, tk, dv)).astype(dtype)
    dout = rng.standard_normal((hq, tq, dv)).astype(dtype)
    return q, k, v, dout


def _cu(lens, dtype):
    return np.concatenate([[0], np.cumsum(lens)]).astype(dtype)


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("vname", "var"), VARLEN_VARIANTS, ids=[n for n, _ in VARLEN_VARIANTS])
@pytest.mark.parametrize("lens", VARLEN_LENGTHS, ids=["ragged", "self"])
def test_varlen_matches_per_sequence_oracle(rng, lens, vname, var, causal, cu_dtype):
    q, k, v, dout = _packed(rng, *lens)
    cu_q, cu_k = _cu(lens[0], cu_dtype), _cu(lens[1], cu_dtype)
    out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **var)
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, causal, **var)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=causal, **var)
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, causal, **var)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_float32(rng, causal):
    lens = VARLEN_LENGTHS[0]
    q, k, v, dout = _packed(rng, *lens, dtype=np.float32)
    cu_q, cu_k = _cu(lens[0], np.int32), _cu(lens[1], np.int32)
    var = VARLEN_VARIANTS[-1][1]
    out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **var)
    assert out.dtype == np.float32
    want_out, want_lse = dense_varlen_attention(*_f64(q, k, v), cu_q, cu_k, causal, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=causal, **var)
    want = dense_varlen_backward(*_f64(q, k, v, dout), cu_q, cu_k, causal, **var)
    assert_grads_close(grads, want, 1e-5)


def test_varlen_long_sequence(rng):
    lens = ([1025, 3], [1025, 40])
    q, k, v, dout = _packed(rng, *lens, hq=2, hkv=1, d=3, dv=2, amp=1.0)
    cu_q, cu_k = _cu(lens[0], np.int64), _cu(lens[1], np.int64)
    out, lse = ft.varlen_attention(
        q, k, v, cu_q, cu_k, causal=True, window=(50, 0), return_lse=True
    )
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, True, window=(50, 0))
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.varlen_attention_backward(
        q, k, v, out, lse, dout, cu_q, cu_k, causal=True, window=(50, 0)
    )
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, True, window=(50, 0))
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_empty_sequences_and_rows(rng, causal):
    """A sequence with no keys gives zero rows; one with no queries contributes nothing."""
    q_lens, k_lens = [0, 4, 3, 6], [3, 0, 5, 2]  # causal: the first 4 queries of seq 3 see nothing
    q, k, v, dout = _packed(rng, q_lens, k_lens)
    cu_q, cu_k = _cu(q_lens, np.int64), _cu(k_lens, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
        dq, dk, dv = ft.varlen_attention_backward(
            q, k, v, out, lse, dout, cu_q, cu_k, causal=causal
        )
    for a in (out, lse, dq, dk, dv):
        assert not np.isnan(a).any()
    np.testing.assert_array_equal(out[:, 0:4], 0.0)  # sequence 1: no keys
    np.testing.assert_array_equal(lse[:, 0:4], -np.inf)
    np.testing.assert_array_equal(dq[:, 0:4], 0.0)
    np.testing.assert_array_equal(dk[:, 0:3], 0.0)  # sequence 0: no queries
    np.testing.assert_array_equal(dv[:, 0:3], 0.0)
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, causal)
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, causal)
    assert_grads_close((dq, dk, dv), want, 1e-10)


# --------------------------------------------------------------------------------------
# 5. block_mask
# --------------------------------------------------------------------------------------

HAND_MASK = np.array(
    [
        [1, 1, 1, 0, 0, 0, 1],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 1],
    ],
    dtype=bool,
)
# Tiles of 2 queries x 3 keys; the last tile row and column are partial edges.
HAND_STATES = [[2, 0, 1], [1, 2, 0], [0, 2, 2]]


def _expected_states(mask, block_q, block_k):
    bm, hm, tq, tk = mask.shape
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    states = np.zeros((bm, hm, nq, nk), dtype=np.int8)
    for a in range(nq):
        for c in range(nk):
            tile = mask[:, :, a * block_q : (a + 1) * block_q, c * block_k : (c + 1) * block_k]
            states[:, :, a, c] = np.where(
                tile.all(axis=(2, 3)), 2, np.where(tile.any(axis=(2, 3)), 1, 0)
            )
    return states


def _block_sparse_mask(rng, shape, cell=10):
    """Cells of ``cell x cell`` that are all-False, all-True or random."""
    b, h, tq, tk = shape
    kind = rng.integers(0, 3, size=(b, h, -(-tq // cell), -(-tk // cell)))
    kind = np.repeat(np.repeat(kind, cell, axis=2), cell, axis=3)[:, :, :tq, :tk]
    noise = rng.random(shape) < 0.5
    return np.where(kind == 0, False, np.where(kind == 1, True, noise))


def test_block_mask_hand_made():
    bm = ft.block_mask(HAND_MASK[None, None], 2, 3)
    assert bm.block_q == 2 and bm.block_k == 3
    assert bm.mask.dtype == bool and bm.mask.shape == (1, 1, 5, 7)
    np.testing.assert_array_equal(bm.mask[0, 0], HAND_MASK)
    assert bm.states.dtype == np.int8 and bm.states.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(bm.states[0, 0], HAND_STATES)
    assert bm.counts() == {"empty": 3, "partial": 2, "full": 4}


def test_block_mask_from_2d_mask_has_4_dims():
    bm = ft.block_mask(HAND_MASK, 2, 3)
    assert bm.mask.shape == (1, 1, 5, 7)
    np.testing.assert_array_equal(bm.states[0, 0], HAND_STATES)
    transposed = ft.block_mask(HAND_MASK, 3, 2)
    np.testing.assert_array_equal(transposed.states, _expected_states(HAND_MASK[None, None], 3, 2))


@pytest.mark.parametrize("blocks", [(16, 24), (7, 5), (1, 1), (64, 128)])
def test_block_mask_states_and_counts(rng, blocks):
    mask = _block_sparse_mask(rng, (2, 3, 50, 70))
    bm = ft.block_mask(mask, *blocks)
    want = _expected_states(mask, *blocks)
    assert bm.states.shape == want.shape
    np.testing.assert_array_equal(bm.states, want)
    counts = bm.counts()
    assert set(counts) == {"empty", "partial", "full"}
    assert sum(counts.values()) == want.size
    assert counts["empty"] == np.count_nonzero(want == 0)
    assert counts["partial"] == np.count_nonzero(want == 1)
    assert counts["full"] == np.count_nonzero(want == 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mdims", [(2, 4), (1, 1)], ids=["per-head", "shared"])
def test_block_mask_gives_the_same_answer_as_the_raw_mask(rng, mdims, causal, dtype):
    q, k, v, dout, _ = Case("x", (2, 4, 2, 50, 70, 8, 4)).build(rng, dtype)
    mask = _block_sparse_mask(rng, (*mdims, 50, 70))
    mask[..., 0] = True  # every row keeps a key
    bm = ft.block_mask(mask, TILES["block_q"], TILES["block_k"])
    kw = {"causal": causal, **TILES}
    out_bm, lse_bm = ft.attention(q, k, v, mask=bm, return_lse=True, **kw)
    out_raw, lse_raw = ft.attention(q, k, v, mask=mask, return_lse=True, **kw)
    np.testing.assert_array_equal(out_bm, out_raw)
    np.testing.assert_array_equal(lse_bm, lse_raw)
    grads_bm = ft.attention_backward(q, k, v, out_bm, lse_bm, dout, mask=bm, **kw)
    grads_raw = ft.attention_backward(q, k, v, out_raw, lse_raw, dout, mask=mask, **kw)
    for a, b in zip(grads_bm, grads_raw, strict=True):
        np.testing.assert_array_equal(a, b)
    tol, gtol = (1e-5, 1e-5) if dtype == np.float32 else (1e-12, 1e-10)
    want_out, want_lse = dense_variant_attention(*_f64(q, k, v), causal, mask=mask)
    assert rel_err(out_bm, want_out) < tol
    assert_lse_close(lse_bm, want_lse, tol)
    want = dense_variant_backward(*_f64(q, k, v, dout), causal, mask=mask)
    assert_grads_close(grads_bm, want, gtol)


@pytest.mark.parametrize("lead", [(), (3,)], ids=["(T, d)", "(H, T, d)"])
def test_block_mask_works_for_inputs_without_batch_or_head_dims(rng, lead):
    # block_mask stores (1, 1, Tq, Tk); the inputs here have 2 or 3 dims.
    q, k, v = (rng.standard_normal((*lead, 20, 4)) for _ in range(3))
    mask = rng.random((20, 20)) < 0.6
    mask[:, 0] = True
    bm = ft.block_mask(mask, 8, 8)
    np.testing.assert_array_equal(ft.attention(q, k, v, mask=bm), ft.attention(q, k, v, mask=mask))
    np.testing.assert_array_equal(
        ft.tiled_attention(q, k, v, 8, mask=bm), ft.tiled_attention(q, k, v, 8, mask=mask)
    )
    np.testing.assert_array_equal(
        ft.naive_attention(q, k, v, mask=bm)[0], ft.naive_attention(q, k, v, mask=mask)[0]
    )


def test_a_scalar_mask_is_refused_with_a_clear_error(rng):
    q = rng.standard_normal((5, 4))
    with pytest.raises(ValueError, match="mask is a scalar"):
        ft.attention(q, q, q, mask=np.array(True))


def test_block_mask_with_default_tiles_and_padding(rng):
    """A BlockMask built for other tile sizes still gives the exact answer."""
    q, k, v, dout, _ = Case("x", (2, 2, 1, 45, 60, 8, 4)).build(rng)
    mask = _block_sparse_mask(rng, (2, 1, 45, 60))
    bm = ft.block_mask(mask, 8, 8)
    var = {"kv_lengths": np.array([60, 33]), "window": (20, 5)}
    out, lse = ft.attention(q, k, v, mask=bm, return_lse=True, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, mask=mask, **var)
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.attention_backward(q, k, v, out, lse, dout, mask=bm, **var)
    assert_grads_close(grads, dense_variant_backward(q, k, v, dout, mask=mask, **var), 1e-10)


@pytest.mark.parametrize(
    "var",
    [
        {"window": (300, 0), "causal": True},
        {"window": (40, 10), "kv_lengths": np.array([700, 530])},
        {"causal": True, "kv_lengths": np.array([700, 301])},
    ],
    ids=["causal-window", "window-padding", "causal-padding"],
)
def test_gathered_full_blocks_with_positional_limits(rng, var):
    """Whole kept 64-blocks gathered into one tile, some left of a row's band.

    Regression: a gathered segment wholly left of a row's window used to
    hide the start of the next segments too (``row_bounds`` returned a start
    beyond the segment), giving wrong outputs with the default tiles.
    """
    q, k, v, dout, _ = Case("x", (2, 2, 2, 700, 700, 16, 16)).build(rng, np.float32)
    blocks = rng.random((2, 1, 11, 11)) < 0.4
    blocks |= np.eye(11, dtype=bool)  # the diagonal keeps every row's own key
    mask = np.kron(blocks, np.ones((64, 64), dtype=bool))[..., :700, :700]
    bm = ft.block_mask(mask, 64, 64)
    assert bm.counts()["full"] > 0 and bm.counts()["empty"] > 0
    out, lse = ft.attention(q, k, v, mask=bm, return_lse=True, **var)
    want_out, want_lse = dense_variant_attention(*_f64(q, k, v), mask=mask, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.attention_backward(q, k, v, out, lse, dout, mask=bm, **var)
    want = dense_variant_backward(*_f64(q, k, v, dout), mask=mask, **var)
    assert_grads_close(grads, want, 1e-4)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 4, 4)])
def test_block_mask_of_an_empty_mask_has_no_kept_tiles(shape):
    bm = ft.block_mask(np.ones(shape, dtype=bool), 4, 4)
    assert bm.states.ndim == 4 and not bm.states.any()


def test_block_mask_summary_is_reused_with_a_window(rng, monkeypatch):
    """A window does not shrink the tiles away from a BlockMask's (no re-summary)."""
    # 4 heads x 3 query blocks: enough items that block_q is not halved for threads
    q, k, v, _, _ = Case("x", (1, 4, 4, 300, 300, 8, 8)).build(rng)
    bm = ft.block_mask(_block_sparse_mask(rng, (1, 1, 300, 300)), 128, 128)
    want = ft.attention(q, k, v, mask=bm, window=(256, 0), causal=True)

    def no_summary(*args, **kwargs):
        raise AssertionError("the mask was summarised again")

    monkeypatch.setattr("flashtile.planning.block_mask", no_summary)
    np.testing.assert_array_equal(
        ft.attention(q, k, v, mask=bm, window=(256, 0), causal=True), want
    )


def test_block_mask_summary_is_reused_with_gqa_and_few_items(rng, monkeypatch):
    """GQA shrinks default query tiles and few items halve them for the threads;
    neither may move the tiles away from a BlockMask's (no re-summary)."""
    # 2 query blocks x 1 kv head = 2 items: fewer than 4 per thread, so a
    # default call would halve its query tiles (and GQA would shrink them).
    q, k, v, dout, _ = Case("x", (1, 2, 1, 128, 128, 8, 8)).build(rng)
    mask = _block_sparse_mask(rng, (1, 1, 128, 128))
    mask[..., 0] = True
    bm = ft.block_mask(mask, 64, 64)
    want, want_lse = ft.attention(q, k, v, mask=mask, return_lse=True)
    want_grads = ft.attention_backward(q, k, v, want, want_lse, dout, mask=mask)

    def no_summary(*args, **kwargs):
        raise AssertionError("the mask was summarised again")

    monkeypatch.setattr("flashtile.planning.block_mask", no_summary)
    out, lse = ft.attention(q, k, v, mask=bm, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    grads = ft.attention_backward(q, k, v, out, lse, dout, mask=bm)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------
# 6. Bad inputs: errors that name the values
# --------------------------------------------------------------------------------------

_B, _HQ, _HKV, _TQ, _TK, _D = 2, 4, 2, 5, 9, 8

BAD_INPUTS = [
    # (id, overrides, exceptions, substrings the message must contain)
    (
        "heads-6-4",
        {"q": np.zeros((_B, 6, _TQ, _D)), "k": np.zeros((_B, 4, _TK, _D))},
        ValueError,
        ["6", "4"],
    ),
    ("window-minus-2", {"window": (-2, 0)}, ValueError, ["-2"]),
    ("window-right-minus-5", {"window": (3, -5)}, ValueError, ["-5"]),
    ("alibi-shape-5", {"alibi_slopes": np.ones(5)}, ValueError, ["(5,)"]),
    ("alibi-shape-3x4", {"alibi_slopes": np.ones((3, 4))}, ValueError, ["(3, 4)"]),
    ("softcap-zero", {"softcap": 0.0}, ValueError, ["softcap", "0"]),
    ("softcap-negative", {"softcap": -1.5}, ValueError, ["softcap", "-1.5"]),
    ("kv_lengths-shape", {"kv_lengths": np.array([9, 9, 9])}, ValueError, ["kv_lengths", "(3,)"]),
    ("kv_lengths-too-long", {"kv_lengths": np.array([9, 12])}, ValueError, ["12", "9"]),
    (
        "kv_lengths-and-key_padding_mask",
        {"kv_lengths": np.array([9, 9]), "key_padding_mask": np.ones((_B, _TK), dtype=bool)},
        ValueError,
        ["kv_lengths", "key_padding_mask"],
    ),
    ("mask-shape", {"mask": np.ones((3, 5), dtype=bool)}, ValueError, ["(3, 5)"]),
    ("mask-int", {"mask": np.ones((_TQ, _TK), dtype=np.int64)}, (TypeError, ValueError), ["int64"]),
]


def _call(entry, q, k, v, kw):
    dv = v.shape[-1]
    out = np.zeros((*q.shape[:-1], dv))
    lse = np.zeros(q.shape[:-1])
    if entry == "naive":
        return ft.naive_attention(q, k, v, False, **kw)
    if entry == "reference":
        return ft.tiled_attention(q, k, v, 4, False, **kw)
    if entry == "reference-backward":
        return ft.tiled_attention_backward(q, k, v, out, out, lse, 4, False, **kw)
    if entry == "fast":
        return ft.attention(q, k, v, **kw)
    return ft.attention_backward(q, k, v, out, lse, out, **kw)


def _assert_message_names(excinfo, needles):
    msg = str(excinfo.value)
    assert "unexpected keyword" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("entry", ["naive", "reference", "reference-backward", "fast", "fast-bwd"])
@pytest.mark.parametrize(
    ("overrides", "exc", "needles"),
    [b[1:] for b in BAD_INPUTS],
    ids=[b[0] for b in BAD_INPUTS],
)
def test_bad_variant_inputs_name_the_values(entry, overrides, exc, needles):
    kw = dict(overrides)
    q = kw.pop("q", np.zeros((_B, _HQ, _TQ, _D)))
    k = kw.pop("k", np.zeros((_B, _HKV, _TK, _D)))
    v = np.zeros(k.shape)
    with pytest.raises(exc) as excinfo:
        _call(entry, q, k, v, kw)
    _assert_message_names(excinfo, needles)


BAD_VARLEN = [
    ("cu_q-not-from-0", {"cu_seqlens_q": [1, 4, 9]}, ["cu_seqlens_q"]),
    (
        "cu_k-decreasing",
        {"cu_seqlens_q": [0, 3, 6, 9], "cu_seqlens_k": [0, 7, 5, 12]},
        ["cu_seqlens_k"],
    ),
    ("cu_q-not-total", {"cu_seqlens_q": [0, 4, 8]}, ["cu_seqlens_q", "8", "9"]),
    ("cu_k-not-total", {"cu_seqlens_k": [0, 6, 11]}, ["cu_seqlens_k", "11", "12"]),
    ("cu-different-counts", {"cu_seqlens_k": [0, 3, 6, 12]}, ["cu_seqlens"]),
    ("heads-3-2", {"q": np.zeros((3, 9, 4))}, ["3", "2"]),
    ("window-minus-2", {"window": (-2, 0)}, ["-2"]),
    ("softcap-zero", {"softcap": 0.0}, ["softcap"]),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize(
    ("overrides", "needles"), [b[1:] for b in BAD_VARLEN], ids=[b[0] for b in BAD_VARLEN]
)
def test_bad_varlen_inputs_name_the_values(overrides, needles, backward):
    kw = dict(overrides)
    q = kw.pop("q", np.zeros((2, 9, 4)))
    k = v = np.zeros((2, 12, 4))
    cu_q = np.asarray(kw.pop("cu_seqlens_q", [0, 4, 9]), dtype=np.int64)
    cu_k = np.asarray(kw.pop("cu_seqlens_k", [0, 5, 12]), dtype=np.int64)
    with pytest.raises(ValueError) as excinfo:
        if backward:
            out, lse = np.zeros(q.shape), np.zeros(q.shape[:-1])
            ft.varlen_attention_backward(q, k, v, out, lse, out, cu_q, cu_k, **kw)
        else:
            ft.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    _assert_message_names(excinfo, needles)


@pytest.mark.parametrize("dtype", [bool, np.float64])
def test_masks_that_broadcast_over_keys(rng, dtype):
    """A mask with a size-1 key axis broadcasts in every path (the reference
    once sliced it to nothing past the first key block)."""
    q = rng.standard_normal((1, 2, 6, 4))
    k = rng.standard_normal((1, 2, 9, 4))
    v = rng.standard_normal((1, 2, 9, 3))
    rows = np.array([True, False, True, True, False, True])[None, None, :, None]
    mask = rows if dtype is bool else np.where(rows, 0.5, -np.inf)
    dense, _ = ft.naive_attention(q, k, v, mask=mask)
    tiled, lse = ft.tiled_attention(q, k, v, 4, mask=mask, return_lse=True)
    fast = ft.attention(q, k, v, mask=mask, block_q=2, block_k=4)
    assert rel_err(tiled, dense) < 1e-12 and rel_err(fast, dense) < 1e-12
    assert np.all(tiled[..., 1, :] == 0) and np.all(np.isneginf(lse[..., 1]))
    dout = rng.standard_normal(tiled.shape)
    grads = ft.tiled_attention_backward(q, k, v, tiled, dout, lse, 4, mask=mask)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_empty_query_blocks_compute_nothing(rng):
    from flashtile.api import visited_tiles

    q, k, v = (rng.standard_normal((1, 1, t, 4)) for t in (8, 40, 40))
    # Every query sits past the 5 valid keys' window: no key is ever visible.
    kw = {"kv_lengths": np.array([5]), "window": (2, 0), "block_q": 8, "block_k": 8}
    assert visited_tiles(q, k, v, **kw) == 0
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"alibi_slopes": np.full(2, np.nan)}, ValueError, "finite"),
        ({"mask": np.full((6, 9), np.nan)}, ValueError, "not NaN, \\+inf"),
        ({"mask": np.full((6, 9), np.inf)}, ValueError, "not NaN, \\+inf"),
    ],
)
def test_non_finite_variant_inputs_are_refused(rng, kwargs, exc, match):
    q, k, v = (rng.standard_normal((1, 2, t, 4)) for t in (6, 9, 9))
    with pytest.raises(exc, match=match):
        ft.attention(q, k, v, **kwargs)
    with pytest.raises(exc, match=match):
        ft.tiled_attention(q, k, v, 4, **kwargs)


def test_softcap_accepts_a_zero_dim_array(rng):
    q, k, v = (rng.standard_normal((1, 2, t, 4)) for t in (6, 9, 9))
    a = ft.attention(q, k, v, softcap=np.array(2.0))
    np.testing.assert_array_equal(a, ft.attention(q, k, v, softcap=2.0))


def test_float_mask_at_float32_min_hides_keys_without_warnings(rng):
    # Hugging Face masks hold torch.finfo(float32).min; in log2 units that
    # leaves the float32 range and must act as -inf, silently.
    q, k, v = (rng.standard_normal((1, 2, 6, 8), dtype=np.float32) for _ in range(3))
    keep = rng.random((6, 6)) < 0.6
    keep[2] = False  # a row that sees no key
    additive = np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ft.attention(q, k, v, mask=additive)
    want = ft.attention(q, k, v, mask=keep)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got[:, :, 2] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_negative_mask_values_hide_keys_on_every_path_and_dtype(rng, dtype):
    # Below -FLT_MAX / log2(e) a value counts as -inf everywhere, so the
    # kernel, the reference and both dtypes agree on a fully masked row.
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(dtype) for _ in range(3))
    additive = np.zeros((5, 5))
    additive[1] = np.finfo(np.float32).min  # row 1 sees no key
    additive[3, 2] = -1e300
    for out in (
        ft.attention(q, k, v, mask=additive),
        ft.tiled_attention(q, k, v, 2, mask=additive),
        ft.naive_attention(q, k, v, mask=additive)[0],
    ):
        assert (out[:, 1] == 0).all()
        keep = np.ones((5, 5), dtype=bool)
        keep[1], keep[3, 2] = False, False
        np.testing.assert_allclose(out, ft.attention(q, k, v, mask=keep), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not NaN, \\+inf or larger values"):
        ft.attention(q, k, v, mask=np.full((5, 5), 3e38))


@pytest.mark.parametrize(
    ("window", "causal", "want"),
    [((256, 0), True, 64), ((100, 100), False, 64), ((511, 0), True, 128), ((1024, 0), True, 256)],
)
def test_default_query_tile_shrinks_with_a_window_band(window, causal, want):
    """Rows per tile follow the band (about band / 4, 64..256); explicit sizes win."""
    from flashtile import planning

    q = np.zeros((1, 2, 3000, 8), dtype=np.float32)
    _, block_q, block_k = planning.plan_call(
        q, q, q, causal, None, {"window": window}, None, None, planning.FWD_BLOCKS
    )
    assert (block_q, block_k) == (want, planning.FWD_BLOCKS[1])
    _, block_q, _ = planning.plan_call(
        q, q, q, causal, None, {"window": window}, 200, None, planning.FWD_BLOCKS
    )
    assert block_q == 200
    _, block_q, _ = planning.plan_call(q, q, q, causal, None, {}, None, None, planning.FWD_BLOCKS)
    assert block_q == planning.FWD_BLOCKS[0]

"""The dense variant oracle in ``dense.py`` checks itself, without any flashtile code:
against hand-computed values, a scalar loop written separately, finite
differences, and the plain oracle when no variant is given.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dense import (
    dense_attention,
    dense_attention_backward,
    dense_variant_attention,
    dense_variant_backward,
    dense_varlen_attention,
    dense_varlen_backward,
    rel_err,
)
from variant_builders import (
    Case,
    alibi,
    assert_grads_close,
    assert_lse_close,
    bool_mask,
    combine,
    float_mask,
    ids,
    lengths,
    padding_mask,
    scale,
    softcap,
    window,
)


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


@pytest.mark.parametrize("case", TINY, ids=ids(TINY))
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


@pytest.mark.parametrize("case", TINY, ids=ids(TINY))
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

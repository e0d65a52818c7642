"""Each attention variant, alone and in combinations (GQA/MQA, sliding windows,
ALiBi, softcap, key padding, bool and float masks), on every path: the NumPy
reference, the naive dense path and the fast kernel in float64 and float32,
against the dense oracle in ``dense.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashtile as ft
from dense import (
    dense_variant_attention,
    dense_variant_backward,
    dense_variant_probabilities,
    rel_err,
)
from variant_builders import (
    TILES,
    Case,
    alibi,
    assert_grads_close,
    assert_lse_close,
    bool_mask,
    combine,
    f64,
    float_mask,
    forward_backward,
    ids,
    lengths,
    padding_mask,
    scale,
    softcap,
    visibility,
    window,
)

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


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_reference_forward_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, lse = ft.tiled_attention(q, k, v, case.block, case.causal, return_lse=True, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, case.causal, **var)
    assert out.shape == want_out.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_naive_forward_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, weights = ft.naive_attention(q, k, v, case.causal, **var)
    want_out, _ = dense_variant_attention(q, k, v, case.causal, **var)
    want_p = dense_variant_probabilities(q, k, v, case.causal, **var)
    assert out.shape == want_out.shape and weights.shape == want_p.shape
    assert rel_err(out, want_out) < 1e-12
    assert rel_err(weights, want_p) < 1e-12
    assert np.all(weights[~visibility(case, var)] == 0)  # hidden keys get exactly zero weight


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_reference_backward_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng)
    _, _, grads = forward_backward("reference", q, k, v, dout, case.causal, case.block, **var)
    want = dense_variant_backward(q, k, v, dout, case.causal, **var)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_fast_forward_float64_matches_oracle(rng, case):
    q, k, v, _, var = case.build(rng)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    want_out, want_lse = dense_variant_attention(q, k, v, case.causal, **var)
    assert out.dtype == np.float64 and out.shape == want_out.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_fast_backward_float64_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=case.causal, **TILES, **var)
    want = dense_variant_backward(q, k, v, dout, case.causal, **var)
    assert all(g.dtype == np.float64 for g in grads)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_fast_float32_matches_oracle(rng, case):
    q, k, v, dout, var = case.build(rng, np.float32)
    out, lse = ft.attention(q, k, v, causal=case.causal, return_lse=True, **TILES, **var)
    assert out.dtype == np.float32
    want_out, want_lse = dense_variant_attention(*f64(q, k, v), case.causal, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=case.causal, **TILES, **var)
    assert all(g.dtype == np.float32 for g in grads)
    want = dense_variant_backward(*f64(q, k, v, dout), case.causal, **var)
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
    out_a, lse_a, grads_a = forward_backward(path, q, k, v, dout, causal, 5, **var_a)
    out_b, lse_b, grads_b = forward_backward(path, q, k, v, dout, causal, 5, **var_b)
    assert rel_err(out_a, out_b) < 1e-12
    assert_lse_close(lse_a, np.asarray(lse_b), 1e-12)
    assert_grads_close(grads_a, grads_b, 1e-10)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_gqa_equals_explicitly_repeated_kv(rng, path):
    q, k, v, dout, _ = Case("x", (2, 6, 2, 21, 30, 4, 3)).build(rng)
    k3, v3 = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    var = {"window": (5, 2)}
    out_g, _, (dq_g, dk_g, dv_g) = forward_backward(path, q, k, v, dout, True, 8, **var)
    out_r, _, (dq_r, dk_r, dv_r) = forward_backward(path, q, k3, v3, dout, True, 8, **var)
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

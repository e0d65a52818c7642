"""Forward attention (naive, tiled, online) against the independent dense oracle."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dense import dense_attention, rel_err, visibility
from flashtile import (
    attention_memory_elements,
    naive_attention,
    online_attention,
    tiled_attention,
)


def qkv(rng, tq, tk, d, dv, lead=(), dtype=np.float64):
    q = rng.normal(size=(*lead, tq, d)).astype(dtype)
    k = rng.normal(size=(*lead, tk, d)).astype(dtype)
    v = rng.normal(size=(*lead, tk, dv)).astype(dtype)
    return q, k, v


# (Tq, Tk, d, dv, block_size): odd sizes, Tq != Tk both ways, dv != d, and block
# sizes that do not divide Tk (plus 1 and larger than Tk).
SEQ_PAIRS = [(1, 1), (7, 7), (97, 97), (1, 7), (7, 1), (7, 97), (97, 7), (1, 97), (97, 1)]
HEAD_DIMS = [(1, 2), (3, 3), (59, 5), (64, 64)]


def _block_for(tk: int) -> int:
    return {1: 1, 7: 3, 97: 10}[tk]


GRID = [(tq, tk, d, dv, _block_for(tk)) for tq, tk in SEQ_PAIRS for d, dv in HEAD_DIMS]
GRID += [
    (7, 7, 3, 4, 1),
    (7, 7, 3, 4, 8),
    (97, 97, 3, 5, 96),
    (97, 97, 59, 2, 200),
    (1025, 1025, 1, 2, 100),
    (1025, 7, 3, 3, 4),
    (7, 1025, 3, 1, 333),
]


def _id(case) -> str:
    tq, tk, d, dv, b = case
    return f"Tq{tq}-Tk{tk}-d{d}-dv{dv}-b{b}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_tiled_matches_dense_oracle(rng, case, causal):
    tq, tk, d, dv, block_size = case
    q, k, v = qkv(rng, tq, tk, d, dv)
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    out, lse = tiled_attention(q, k, v, block_size, causal=causal, return_lse=True)
    assert out.shape == (tq, dv)
    assert lse.shape == (tq,)
    assert rel_err(out, ref_out) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-12
    assert tiled_attention(q, k, v, block_size, causal=causal).shape == (tq, dv)


@pytest.mark.parametrize(
    "case",
    [c for c in GRID if max(c[0], c[1]) <= 97],
    ids=_id,
)
def test_online_attention_matches_dense_oracle(rng, case):
    tq, tk, d, dv, block_size = case
    q, k, v = qkv(rng, tq, tk, d, dv)
    out = online_attention(q, k, v, block_size)
    assert out.shape == (tq, dv)
    assert rel_err(out, dense_attention(q, k, v)[0]) < 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tq,tk", [(7, 7), (97, 97), (7, 97), (97, 7), (1, 7), (7, 1)])
def test_naive_matches_dense_oracle(rng, tq, tk, causal):
    q, k, v = qkv(rng, tq, tk, 3, 5)
    out, weights = naive_attention(q, k, v, causal=causal)
    assert out.shape == (tq, 5)
    assert weights.shape == (tq, tk)
    assert rel_err(out, dense_attention(q, k, v, causal=causal)[0]) < 1e-12
    sees_any = visibility(tq, tk, causal).any(axis=1)
    np.testing.assert_allclose(weights.sum(axis=-1), sees_any.astype(float), rtol=1e-14)
    # Hidden keys get exactly zero weight.
    assert np.all(weights[~visibility(tq, tk, causal)] == 0.0)


def test_causal_square_is_the_lower_triangle(rng):
    tq = tk = 9
    q, k, v = qkv(rng, tq, tk, 4, 4)
    _, weights = naive_attention(q, k, v, causal=True)
    pos = np.arange(tq)
    seed_mask = pos[None, :] <= pos[:, None]
    np.testing.assert_array_equal(weights > 0, seed_mask)
    # Row i of the causal output is plain attention over the prefix of keys 0..i.
    out = tiled_attention(q, k, v, 4, causal=True)
    for i in range(tq):
        prefix = dense_attention(q[i : i + 1], k[: i + 1], v[: i + 1])[0]
        assert rel_err(out[i : i + 1], prefix) < 1e-12


@pytest.mark.parametrize("block_size", [1, 2, 5])
def test_causal_more_queries_than_keys_gives_empty_rows(rng, block_size):
    tq, tk = 7, 3
    q, k, v = qkv(rng, tq, tk, 3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = tiled_attention(q, k, v, block_size, causal=True, return_lse=True)
        naive_out, weights = naive_attention(q, k, v, causal=True)
    empty = tq - tk
    assert not np.isnan(out).any()
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:empty], 0.0)
    np.testing.assert_array_equal(lse[:empty], -np.inf)
    assert np.all(np.isfinite(lse[empty:]))
    np.testing.assert_array_equal(naive_out[:empty], 0.0)
    np.testing.assert_array_equal(weights[:empty], 0.0)
    # Query empty + i sees keys 0..i.
    for i in range(tk):
        row = dense_attention(q[empty + i : empty + i + 1], k[: i + 1], v[: i + 1])[0]
        assert rel_err(out[empty + i : empty + i + 1], row) < 1e-12


def test_causal_fewer_queries_than_keys_is_bottom_right(rng):
    tq, tk = 3, 8
    q, k, v = qkv(rng, tq, tk, 4, 3)
    out = tiled_attention(q, k, v, 3, causal=True)
    # Query i sits at absolute position i + Tk - Tq: it sees keys 0..i+5.
    for i in range(tq):
        stop = i + tk - tq + 1
        row = dense_attention(q[i : i + 1], k[:stop], v[:stop])[0]
        assert rel_err(out[i : i + 1], row) < 1e-12
    # The last query sees every key: same as non-causal for that row.
    full = tiled_attention(q, k, v, 3, causal=False)
    assert rel_err(out[-1], full[-1]) < 1e-12
    assert rel_err(out[0], full[0]) > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "q_lead,kv_lead",
    [((2, 3), (2, 3)), ((2, 3), (1, 3)), ((2, 3), (3,)), ((1, 3), (2, 1)), ((4,), ())],
)
def test_batched_and_broadcast_leading_dims(rng, q_lead, kv_lead, causal):
    tq, tk, d, dv = 6, 11, 5, 3
    q = rng.normal(size=(*q_lead, tq, d))
    k = rng.normal(size=(*kv_lead, tk, d))
    v = rng.normal(size=(*kv_lead, tk, dv))
    batch = np.broadcast_shapes(q_lead, kv_lead)
    out, lse = tiled_attention(q, k, v, 4, causal=causal, return_lse=True)
    assert out.shape == (*batch, tq, dv)
    assert lse.shape == (*batch, tq)
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-12
    # Each (b, h) slice is an independent attention problem.
    qb = np.broadcast_to(q, (*batch, tq, d))
    kb = np.broadcast_to(k, (*batch, tk, d))
    vb = np.broadcast_to(v, (*batch, tk, dv))
    for idx in np.ndindex(*batch):
        one = dense_attention(qb[idx], kb[idx], vb[idx], causal=causal)[0]
        assert rel_err(out[idx], one) < 1e-12
    naive_out, weights = naive_attention(q, k, v, causal=causal)
    assert weights.shape == (*batch, tq, tk)
    assert rel_err(naive_out, ref_out) < 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "q_lead,k_lead,v_lead",
    [((1, 3), (2, 1), (1, 3)), ((3,), (2, 1), (2, 3)), ((), (2, 3), (1,)), ((2, 1), (1, 3), (3,))],
)
def test_k_and_v_broadcast_differently(rng, q_lead, k_lead, v_lead, causal):
    q = rng.normal(size=(*q_lead, 6, 4))
    k = rng.normal(size=(*k_lead, 9, 4))
    v = rng.normal(size=(*v_lead, 9, 2))
    batch = np.broadcast_shapes(q_lead, k_lead, v_lead)
    out, lse = tiled_attention(q, k, v, 4, causal=causal, return_lse=True)
    assert out.shape == (*batch, 6, 2)
    assert lse.shape == (*batch, 6)
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tq,tk", [(5, 5), (3, 9), (9, 3)])
def test_lse_matches_oracle(rng, tq, tk, causal):
    q, k, v = qkv(rng, tq, tk, 4, 2, lead=(2,))
    _, lse = tiled_attention(q, k, v, 2, causal=causal, return_lse=True)
    _, ref_lse = dense_attention(q, k, v, causal=causal)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-12
    # lse is log sum exp of the visible scaled scores: check one row by hand.
    s = q[0, -1] @ k[0].T / 2.0
    s = s[visibility(tq, tk, causal)[-1]]
    assert abs(lse[0, -1] - (s.max() + np.log(np.exp(s - s.max()).sum()))) < 1e-12


def test_explicit_scale_matches_oracle(rng):
    q, k, v = qkv(rng, 7, 9, 3, 2)
    for scale in (0.1, 1.0, 2.5):
        out, lse = tiled_attention(q, k, v, 4, causal=True, scale=scale, return_lse=True)
        ref_out, ref_lse = dense_attention(q, k, v, causal=True, scale=scale)
        assert rel_err(out, ref_out) < 1e-12
        assert rel_err(lse, ref_lse) < 1e-12
        naive_out, _ = naive_attention(q, k, v, causal=True, scale=scale)
        assert rel_err(naive_out, ref_out) < 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("magnitude", [1e3, 1e4])
def test_large_logits_stay_finite_and_correct(rng, magnitude, causal):
    tq, tk, d = 9, 13, 4
    q, k, v = qkv(rng, tq, tk, d, 3)
    # Scale q so that the largest |score| per row is about `magnitude`.
    raw = np.abs(q @ k.T / np.sqrt(d)).max(axis=1, keepdims=True)
    q = q * (magnitude / raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = tiled_attention(q, k, v, 4, causal=causal, return_lse=True)
        naive_out, _ = naive_attention(q, k, v, causal=causal)
    assert np.all(np.isfinite(out))
    assert np.all(np.isfinite(lse))
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    # Scores of size M carry absolute rounding ~M * eps, which moves the weights by that much.
    tol = 100 * magnitude * np.finfo(np.float64).eps
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, ref_lse) < tol
    assert rel_err(naive_out, ref_out) < tol


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tq,tk,d", [(97, 97, 64), (7, 97, 59), (97, 7, 3)])
def test_float32_in_float32_out(rng, tq, tk, d, causal):
    q, k, v = qkv(rng, tq, tk, d, 5, dtype=np.float32)
    out, lse = tiled_attention(q, k, v, 10, causal=causal, return_lse=True)
    assert out.dtype == np.float32
    assert lse.dtype == np.float32
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    assert rel_err(out, ref_out) < 1e-5
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-5
    naive_out, weights = naive_attention(q, k, v, causal=causal)
    assert naive_out.dtype == np.float32
    assert weights.dtype == np.float32
    assert rel_err(naive_out, ref_out) < 1e-5
    assert online_attention(q, k, v, 10).dtype == np.float32


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float16_in_float16_out(rng, causal):
    q, k, v = qkv(rng, 33, 29, 8, 6, dtype=np.float16)
    out, lse = tiled_attention(q, k, v, 5, causal=causal, return_lse=True)
    assert out.dtype == np.float16
    assert lse.dtype == np.float32  # lse is returned in the accumulation dtype
    assert np.all(np.isfinite(out))
    ref_out, _ = dense_attention(q, k, v, causal=causal)
    # Accumulation is in float32, so the error is dominated by the final rounding
    # of each output element to float16 (unit roundoff 2**-11).
    assert rel_err(out, ref_out) < 2 * 2.0**-11
    naive_out, weights = naive_attention(q, k, v, causal=causal)
    assert naive_out.dtype == np.float16
    assert weights.dtype == np.float16
    assert rel_err(naive_out, ref_out) < 2 * 2.0**-11


@given(
    tq=st.integers(1, 24),
    tk=st.integers(1, 24),
    d=st.integers(1, 6),
    dv=st.integers(1, 6),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
@settings(max_examples=30, deadline=None)
def test_block_size_invariance(tq, tk, d, dv, causal, seed, data):
    block_a = data.draw(st.integers(1, tk + 3), label="block_a")
    block_b = data.draw(st.integers(1, tk + 3), label="block_b")
    q, k, v = qkv(np.random.default_rng(seed), tq, tk, d, dv, lead=(2,))
    out_a, lse_a = tiled_attention(q, k, v, block_a, causal=causal, return_lse=True)
    out_b, lse_b = tiled_attention(q, k, v, block_b, causal=causal, return_lse=True)
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    assert rel_err(out_a, out_b) < 1e-12
    assert rel_err(out_a, ref_out) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse_a), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse_b), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert rel_err(lse_a[finite], lse_b[finite]) < 1e-12
    assert rel_err(lse_a[finite], ref_lse[finite]) < 1e-12


def test_memory_accounting_matches_the_chapter():
    assert attention_memory_elements(4096) == {"naive_scores": 16777216, "online_state": 4096}
    assert attention_memory_elements(1) == {"naive_scores": 1, "online_state": 1}
    assert attention_memory_elements(np.int64(7)) == {"naive_scores": 49, "online_state": 7}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("row", [0, 3, 6])
def test_nan_in_one_query_row_stays_in_that_row(rng, row, causal):
    q, k, v = qkv(rng, 7, 7, 3, 2)
    q[row, 1] = np.nan
    out = tiled_attention(q, k, v, 3, causal=causal)
    assert np.all(np.isnan(out[row]))
    others = np.delete(np.arange(7), row)
    assert np.all(np.isfinite(out[others]))
    # The other rows are exactly what they would be without the poisoned query.
    if causal:
        rows = [dense_attention(q[i : i + 1], k[: i + 1], v[: i + 1])[0] for i in others]
        ref = np.concatenate(rows)
    else:
        ref = dense_attention(q[others], k, v)[0]
    assert rel_err(out[others], ref) < 1e-12
    naive_out, _ = naive_attention(q, k, v, causal=causal)
    assert np.all(np.isnan(naive_out[row]))
    assert np.all(np.isfinite(naive_out[others]))

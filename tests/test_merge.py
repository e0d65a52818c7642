"""merge_states: combining partial (out, lse) results over disjoint key sets."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dense import dense_attention, rel_err, visibility
from flashtile import merge_states, tiled_attention


def qkv(rng, lead, tq, tk, d, dv):
    return (
        rng.normal(size=(*lead, tq, d)),
        rng.normal(size=(*lead, tk, d)),
        rng.normal(size=(*lead, tk, dv)),
    )


def partial(q, k, v, start, stop, block_size=3):
    return tiled_attention(
        q, k[..., start:stop, :], v[..., start:stop, :], block_size, return_lse=True
    )


@pytest.mark.parametrize("split", [1, 5, 12, 16])
def test_merge_of_key_split_equals_full_attention(rng, split):
    q, k, v = qkv(rng, (2, 3), 9, 17, 4, 5)
    out_a, lse_a = partial(q, k, v, 0, split)
    out_b, lse_b = partial(q, k, v, split, 17)
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention(q, k, v)
    assert out.shape == ref_out.shape
    assert lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-12
    # Each half alone is a different answer: the merge is doing real work.
    assert rel_err(out_a, ref_out) > 1e-3


def test_merge_with_very_different_magnitudes(rng):
    """One half's scores dwarf the other's: weights computed relative to the max."""
    q, k, v = qkv(rng, (), 4, 10, 3, 2)
    k[:5] *= 300.0
    out_a, lse_a = partial(q, k, v, 0, 5)
    out_b, lse_b = partial(q, k, v, 5, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention(q, k, v)
    assert np.all(np.isfinite(out))
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-12


def three_partials(rng):
    q, k, v = qkv(rng, (2,), 6, 15, 3, 4)
    parts = [partial(q, k, v, a, b) for a, b in ((0, 4), (4, 11), (11, 15))]
    return parts, dense_attention(q, k, v)


def test_merge_is_associative(rng):
    (a, b, c), (ref_out, ref_lse) = three_partials(rng)
    left = merge_states(*merge_states(*a, *b), *c)
    right = merge_states(*a, *merge_states(*b, *c))
    for got in (left, right):
        assert rel_err(got[0], ref_out) < 1e-12
        assert rel_err(got[1], ref_lse) < 1e-12
    assert rel_err(left[0], right[0]) < 1e-13
    assert rel_err(left[1], right[1]) < 1e-13


def test_merge_is_commutative(rng):
    (a, b, c), (ref_out, ref_lse) = three_partials(rng)
    ab = merge_states(*a, *b)
    ba = merge_states(*b, *a)
    assert rel_err(ab[0], ba[0]) < 1e-14
    assert rel_err(ab[1], ba[1]) < 1e-14
    full = merge_states(*c, *ba)
    assert rel_err(full[0], ref_out) < 1e-12
    assert rel_err(full[1], ref_lse) < 1e-12


@pytest.mark.parametrize("empty_side", ["a", "b"])
def test_merge_with_one_empty_side_returns_the_other_exactly(rng, empty_side):
    out = rng.normal(size=(2, 5, 3))
    lse = rng.normal(size=(2, 5)) * 10
    empty_out = np.zeros((2, 5, 3))
    empty_lse = np.full((2, 5), -np.inf)
    args = (
        (empty_out, empty_lse, out, lse) if empty_side == "a" else (out, lse, empty_out, empty_lse)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_out, got_lse = merge_states(*args)
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_lse, lse)


def test_an_empty_side_contributes_nothing_even_if_its_out_is_garbage(rng):
    # An empty chunk's out may be an uninitialised buffer: weight 0 must not
    # turn its NaN into 0 * NaN = NaN.
    out = rng.normal(size=(3, 2))
    lse = rng.normal(size=3)
    garbage = np.full((3, 2), np.nan)
    got_out, got_lse = merge_states(garbage, np.full(3, -np.inf), out, lse)
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_lse, lse)


def test_merge_with_some_empty_rows(rng):
    """Rows empty on one side take the other side; rows empty on both stay empty."""
    out_a = rng.normal(size=(4, 2))
    out_b = rng.normal(size=(4, 2))
    lse_a = np.array([0.5, -np.inf, 1.0, -np.inf])
    lse_b = np.array([-np.inf, 2.0, 1.0, -np.inf])
    out_a[3] = 0.0
    out_b[3] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out[0], out_a[0])
    np.testing.assert_array_equal(out[1], out_b[1])
    np.testing.assert_array_equal(out[3], 0.0)
    np.testing.assert_array_equal(lse[[0, 1, 3]], [0.5, 2.0, -np.inf])
    # Equal lse: the average, and lse grows by log 2.
    assert rel_err(out[2], (out_a[2] + out_b[2]) / 2) < 1e-15
    assert abs(lse[2] - (1.0 + np.log(2.0))) < 1e-15


def test_merge_both_empty_gives_zeros_and_neg_inf():
    empty_out = np.zeros((3, 4))
    empty_lse = np.full(3, -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_states(empty_out, empty_lse, empty_out.copy(), empty_lse.copy())
    assert not np.isnan(out).any()
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def masked_partial(q, k, v, vis):
    """Explicit float64 (out, lse) over the keys marked True in ``vis (Tq, Tk)``."""
    s = np.where(vis, q @ k.T / np.sqrt(q.shape[-1]), -np.inf)
    sees = vis.any(axis=1)
    lse = np.full(q.shape[0], -np.inf)
    lse[sees] = np.log(np.exp(s[sees]).sum(axis=1))
    out = np.zeros((q.shape[0], v.shape[-1]))
    out[sees] = np.exp(s[sees] - lse[sees, None]) @ v
    return out, lse


def test_merge_of_causal_partials_with_empty_rows(rng):
    """Causal Tq > Tk split over keys: rows see no key, keys in one half, or in both."""
    tq, tk, split = 8, 5, 2
    q, k, v = qkv(rng, (), tq, tk, 3, 2)
    vis = visibility(tq, tk, causal=True)
    out_a, lse_a = masked_partial(q, k[:split], v[:split], vis[:, :split])
    out_b, lse_b = masked_partial(q, k[split:], v[split:], vis[:, split:])
    # Bottom-right alignment makes the key suffix a plain causal problem of its own.
    suffix_out, suffix_lse = tiled_attention(
        q, k[split:], v[split:], 2, causal=True, return_lse=True
    )
    assert rel_err(suffix_out, out_b) < 1e-12
    np.testing.assert_array_equal(np.isneginf(suffix_lse), np.isneginf(lse_b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = tiled_attention(q, k, v, 2, causal=True, return_lse=True)
    assert rel_err(out, ref_out) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) < 1e-12
    assert rel_err(out, dense_attention(q, k, v, causal=True)[0]) < 1e-12


def test_merge_preserves_float32():
    out = np.ones((2, 3), dtype=np.float32)
    lse = np.zeros(2, dtype=np.float32)
    got_out, got_lse = merge_states(out, lse, out, lse)
    assert got_out.dtype == np.float32
    assert got_lse.dtype == np.float32
    np.testing.assert_allclose(got_out, 1.0, rtol=1e-7)
    np.testing.assert_allclose(got_lse, np.log(2.0), rtol=1e-7)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 3), (3,), (2, 3), (2,)), r"out_a has shape \(2, 3\) and lse_a \(3,\)"),
        (((2, 3), (2,), (2, 3), (2, 3)), r"out_b has shape \(2, 3\) and lse_b \(2, 3\)"),
        (((2, 3), (2,), (2, 4), (2,)), r"out_a \(2, 3\) and out_b \(2, 4\) differ"),
        (((2, 3), (2,), (5, 3), (5,)), r"out_a \(2, 3\) and out_b \(5, 3\) differ"),
    ],
)
def test_merge_shape_mismatch_errors(shapes, match):
    arrays = [np.zeros(s) for s in shapes]
    with pytest.raises(ValueError, match=match):
        merge_states(*arrays)


def test_merge_rejects_integer_inputs():
    with pytest.raises(TypeError, match="out_a has dtype int64"):
        merge_states(np.zeros((2, 3), dtype=np.int64), np.zeros(2), np.zeros((2, 3)), np.zeros(2))

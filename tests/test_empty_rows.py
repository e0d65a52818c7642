"""Rows that see no key (through a window, padding, a mask or causal alignment):
zero output, ``lse = -inf``, zero gradients, no NaN and no warning, on every path.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import flashtile as ft
from dense import dense_variant_attention, dense_variant_backward, rel_err
from variant_builders import (
    Case,
    assert_grads_close,
    assert_lse_close,
    combine,
    f64,
    forward_backward,
    ids,
    lengths,
    visibility,
    window,
)


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
    # No warning at all from the reference; none from NumPy's arithmetic in the
    # fast path (Numba may warn about its own compilation).
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning if path == "reference" else RuntimeWarning)
        out, lse, grads = forward_backward(path, q, k, v, dout, case.causal, 4, **var)
    return (q, k, v, dout, var), out, lse, grads


@pytest.mark.parametrize("path", ["reference", "fast-float64", "fast-float32"])
@pytest.mark.parametrize("case", EMPTY, ids=ids(EMPTY))
def test_rows_that_see_no_key(rng, case, path):
    (q, k, v, dout, var), out, lse, (dq, dk, dv) = _run_path(path, case, rng)
    b, hq, hkv, tq, tk = case.shape[:5]
    vis = visibility(case, var)
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
    want_out, want_lse = dense_variant_attention(*f64(q, k, v), case.causal, **var)
    assert rel_err(out, want_out) < tol
    assert_lse_close(lse, want_lse, tol)
    want = dense_variant_backward(*f64(q, k, v, dout), case.causal, **var)
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
    grads = ft.tiled_attention_backward(q, k, v, tiled, lse, dout, block_size=4, mask=mask)
    assert all(np.all(np.isfinite(g)) for g in grads)


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

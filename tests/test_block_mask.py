"""``block_mask``: its tile states by hand and against a brute-force summary, and
attention with a ``BlockMask`` giving exactly the raw mask's answer (with
positional limits, other tile sizes and inputs without batch or head dims).
"""

from __future__ import annotations

import numpy as np
import pytest

import flashtile as ft
from dense import dense_variant_attention, dense_variant_backward, rel_err
from variant_builders import (
    TILES,
    Case,
    assert_grads_close,
    assert_lse_close,
    block_sparse_mask,
    f64,
)

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
    mask = block_sparse_mask(rng, (2, 3, 50, 70))
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
    mask = block_sparse_mask(rng, (*mdims, 50, 70))
    mask[..., 0] = True  # every row keeps a key
    bm = ft.block_mask(mask, TILES["block_q"], TILES["block_k"])
    kw = {"causal": causal, **TILES}
    out_bm, lse_bm = ft.attention(q, k, v, mask=bm, return_lse=True, **kw)
    out_raw, lse_raw = ft.attention(q, k, v, mask=mask, return_lse=True, **kw)
    # Equal up to the last bits only: oneMKL's gemm may pick another code path
    # for buffers of another alignment (seen once under load, 1 ulp).
    same = {"rtol": 8 * np.finfo(dtype).eps, "atol": 8 * np.finfo(dtype).eps}
    np.testing.assert_allclose(out_bm, out_raw, **same)
    np.testing.assert_allclose(lse_bm, lse_raw, **same)
    grads_bm = ft.attention_backward(q, k, v, out_bm, lse_bm, dout, mask=bm, **kw)
    grads_raw = ft.attention_backward(q, k, v, out_raw, lse_raw, dout, mask=mask, **kw)
    for a, b in zip(grads_bm, grads_raw, strict=True):
        np.testing.assert_allclose(a, b, **same)
    tol, gtol = (1e-5, 1e-5) if dtype == np.float32 else (1e-12, 1e-10)
    want_out, want_lse = dense_variant_attention(*f64(q, k, v), causal, mask=mask)
    assert rel_err(out_bm, want_out) < tol
    assert_lse_close(lse_bm, want_lse, tol)
    want = dense_variant_backward(*f64(q, k, v, dout), causal, mask=mask)
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


def test_block_mask_with_default_tiles_and_padding(rng):
    """A BlockMask built for other tile sizes still gives the exact answer."""
    q, k, v, dout, _ = Case("x", (2, 2, 1, 45, 60, 8, 4)).build(rng)
    mask = block_sparse_mask(rng, (2, 1, 45, 60))
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
    want_out, want_lse = dense_variant_attention(*f64(q, k, v), mask=mask, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.attention_backward(q, k, v, out, lse, dout, mask=bm, **var)
    want = dense_variant_backward(*f64(q, k, v, dout), mask=mask, **var)
    assert_grads_close(grads, want, 1e-4)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 4, 4)])
def test_block_mask_of_an_empty_mask_has_no_kept_tiles(shape):
    bm = ft.block_mask(np.ones(shape, dtype=bool), 4, 4)
    assert bm.states.ndim == 4 and not bm.states.any()

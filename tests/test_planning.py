"""Planning internals: a BlockMask's summary is reused (not rebuilt), empty query
blocks visit no tile, and the default query tile follows a window's band.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashtile as ft
from variant_builders import Case
from variant_builders import block_sparse_mask as _block_sparse_mask


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


def test_empty_query_blocks_compute_nothing(rng):
    from flashtile.api import visited_tiles

    q, k, v = (rng.standard_normal((1, 1, t, 4)) for t in (8, 40, 40))
    # Every query sits past the 5 valid keys' window: no key is ever visible.
    kw = {"kv_lengths": np.array([5]), "window": (2, 0), "block_q": 8, "block_k": 8}
    assert visited_tiles(q, k, v, **kw) == 0
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


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

"""The planner: one plan per call holds the tile sizes, the work items and the
block map the kernel reads (flashtile.planning). Results are checked through
the public API; the plans themselves through ``api.check_call`` and
``planning.plan_forward``/``plan_backward``."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import flashtile as ft
from flashtile import planning
from flashtile.api import check_call, visited_tiles
from flashtile.cpu.tiles import SEQ_K_START, SEQ_Q_START, SEQ_TK, SEQ_TQ
from variant_builders import block_sparse_mask as _block_sparse_mask


def _qkv(rng, b, hq, hkv, tq, tk, d=8):
    q = rng.standard_normal((b, hq, tq, d))
    k = rng.standard_normal((b, hkv, tk, d))
    v = rng.standard_normal((b, hkv, tk, d))
    dout = rng.standard_normal((b, hq, tq, d))
    return q, k, v, dout


def _no_summary(*args, **kwargs):
    raise AssertionError("the mask was summarised again")


def test_block_mask_summary_is_reused_with_a_window(rng, monkeypatch):
    """A window does not shrink the tiles away from a BlockMask's (no re-summary)."""
    # 4 heads x 3 query blocks: enough items that block_q is not halved for threads
    q, k, v, _ = _qkv(rng, 1, 4, 4, 300, 300)
    bm = ft.block_mask(_block_sparse_mask(rng, (1, 1, 300, 300)), 128, 128)
    want = ft.attention(q, k, v, mask=bm, window=(256, 0), causal=True)
    monkeypatch.setattr("flashtile.planning.block_mask", _no_summary)
    np.testing.assert_array_equal(
        ft.attention(q, k, v, mask=bm, window=(256, 0), causal=True), want
    )


def test_block_mask_summary_is_reused_with_gqa_and_few_items(rng, monkeypatch):
    """GQA shrinks default query tiles and few items halve them for the threads;
    neither may move the tiles away from a BlockMask's (no re-summary)."""
    # 2 query blocks x 1 kv head = 2 items: fewer than 4 per thread, so a
    # default call would halve its query tiles (and GQA would shrink them).
    q, k, v, dout = _qkv(rng, 1, 2, 1, 128, 128)
    mask = _block_sparse_mask(rng, (1, 1, 128, 128))
    mask[..., 0] = True
    bm = ft.block_mask(mask, 64, 64)
    want, want_lse = ft.attention(q, k, v, mask=mask, return_lse=True)
    want_grads = ft.attention_backward(q, k, v, want, want_lse, dout, mask=mask)
    monkeypatch.setattr("flashtile.planning.block_mask", _no_summary)
    out, lse = ft.attention(q, k, v, mask=bm, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    grads = ft.attention_backward(q, k, v, out, lse, dout, mask=bm)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_empty_query_blocks_compute_nothing(rng):
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
    q = np.zeros((1, 2, 3000, 8), dtype=np.float32)
    plan = planning.plan_forward(check_call(q, q, q, causal, None, {"window": window}))
    assert (plan.block_q, plan.block_k) == (want, planning.FWD_BLOCKS[1])
    plan = planning.plan_forward(check_call(q, q, q, causal, None, {"window": window}), 200)
    assert plan.block_q == 200
    plan = planning.plan_forward(check_call(q, q, q, causal, None, {}))
    assert plan.block_q == planning.FWD_BLOCKS[0]


def _halved_for_threads(block_q, n_kv, tq):
    """The default block_q after halving until every thread has enough items."""
    want = planning.ITEMS_PER_THREAD * numba.get_num_threads()
    while block_q > planning.MIN_BLOCK_Q and n_kv * -(-tq // block_q) < want:
        block_q //= 2
    return max(block_q, planning.MIN_BLOCK_Q)


def test_default_query_tiles_shrink_for_groups_and_threads():
    """GQA divides the default rows by the group; a short call halves them
    until every thread has enough items; explicit sizes and the backward
    never halve."""
    q, kv = np.zeros((1, 8, 4000, 4)), np.zeros((1, 2, 4000, 4))
    plan = planning.plan_forward(check_call(q, kv, kv, False, None, {}))
    assert plan.block_q == _halved_for_threads(planning.FWD_BLOCKS[0] // 4, 2, 4000)
    q1 = np.zeros((1, 1, 300, 4))
    plan = planning.plan_forward(check_call(q1, q1, q1, True, None, {}))
    assert plan.block_q == _halved_for_threads(256, 1, 300) < 256
    assert len(plan.items) == -(-300 // plan.block_q)
    assert planning.plan_forward(check_call(q1, q1, q1, True, None, {}), 256).block_q == 256
    assert planning.plan_backward(check_call(q1, q1, q1, True, None, {})).block_q == 256


def test_forward_items_cover_every_query_block_once_per_kv_head():
    q, kv = np.zeros((2, 6, 100, 4)), np.zeros((2, 3, 70, 4))
    plan = planning.plan_forward(check_call(q, kv, kv, True, None, {}), 16, 32)
    want = sorted((s, hk, i0) for s in range(2) for hk in range(3) for i0 in range(0, 100, 16))
    assert sorted(map(tuple, plan.items.tolist())) == want
    assert plan.items.flags.c_contiguous and plan.parts == 1


def test_varlen_plan_drops_sequences_without_queries():
    q, kv = np.zeros((2, 9, 4)), np.zeros((2, 12, 4))
    cu_q, cu_k = np.array([0, 4, 4, 9]), np.array([0, 5, 8, 12])
    plan = planning.plan_forward(check_call(q, kv, kv, False, None, {}, (cu_q, cu_k)))
    cols = [SEQ_Q_START, SEQ_TQ, SEQ_K_START, SEQ_TK]
    assert plan.seqs[:, cols].tolist() == [[0, 4, 0, 5], [4, 5, 8, 4]]
    assert plan.out_shape == (2, 9)


def test_block_map_matches_the_final_tiles_and_is_writeable(rng):
    """The block map is summarised for the tiles the kernel runs (after every
    shrink), and is a fresh writeable array; the bool mask is read-only
    whether it came raw, from a BlockMask or not at all (one compiled kernel
    per dtype)."""
    q = rng.standard_normal((1, 2, 100, 4))
    raw = rng.random((100, 100)) < 0.5
    bm = ft.block_mask(raw, 32, 64)
    plan = planning.plan_forward(check_call(q, q, q, False, None, {"mask": bm}))
    assert (plan.block_q, plan.block_k) == (32, 64)
    assert plan.variants.states.shape[2:] == (4, 2)
    assert plan.variants.states.flags.writeable
    for variants in ({"mask": bm}, {"mask": raw}, {}):
        plan = planning.plan_forward(check_call(q, q, q, False, None, variants))
        assert not plan.variants.mask_bool.flags.writeable
    assert raw.flags.writeable  # the caller's array is untouched
    plan = planning.plan_forward(check_call(q, q, q, False, None, {"mask": bm}), 50, 50)
    assert plan.variants.states.shape[2:] == (2, 2)


def test_tile_sizes_are_checked_before_the_schedule_cache():
    q = np.zeros((1, 2, 8, 4), np.float32)
    ft.attention(q, q, q, block_q=16)  # caches the schedule of block_q=16
    for bad in (16.0, True):
        with pytest.raises(TypeError, match="block_q must be a positive integer"):
            ft.attention(q, q, q, block_q=bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16", np.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_score_bounds_follow_the_formula_over_finite_entries(rng, dtype, strided):
    """The compiled bound (flashtile.precision.bounds) against the formula in
    float64: max |q| and max |k| over finite entries (float16: the dtype's
    largest value), NaN and inf left out, strided arrays too."""
    import ml_dtypes

    from flashtile.precision import FLOAT16_MAX, LOG2E, bounds, finite_max_abs
    from flashtile.variants import resolve_variants

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    q = rng.standard_normal((2, 6, 5, 8)) * 7
    k = rng.standard_normal((2, 6, 9, 8)) * 3
    q[1, 2, 0, 0], k[0, 4, 8, 7] = -40.0, 25.0  # the largest finite magnitudes
    q[0, 0, 1, 3], k[1, 2, 4, 0], k[0, 0, 0, 0] = np.inf, np.nan, -np.inf
    q, k = q.astype(dtype), k.astype(dtype)
    if strided:  # every other head: the largest entries stay in
        q, k = q[:, ::2], k[:, ::2]
    scale = -0.3
    got = bounds(scale, q, k, resolve_variants(None, causal=False), 5, 9)

    def biggest(a):
        if dtype == np.float16:
            return FLOAT16_MAX
        wide = a.astype(np.float64)
        return float(np.abs(wide[np.isfinite(wide)]).max())

    raw = max(1.0, biggest(q)) * max(1.0, 8 * biggest(k))
    assert got == pytest.approx((LOG2E * abs(scale) * raw, LOG2E * raw), rel=1e-12)
    assert finite_max_abs(np.array([np.nan, -np.inf], dtype=dtype)) == 0.0
    assert finite_max_abs(np.zeros((0, 3), dtype=dtype)) == 0.0

"""Decoding against a KV cache (issue 6): split-KV, paged caches, KVCache.

The oracle is the dense float64 formula of ``dense.py`` applied to each
sequence's valid keys; the NumPy reference ``flashtile.reference.
decode_attention`` is checked against it, and the fast path against both.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import flashtile
from dense import dense_attention, dense_variant_attention
from flashtile import routes
from flashtile.cpu.cache_rows import (
    HeadRowsWalk,
    HeadTilesWalk,
    RowWalk,
    TileWalk,
    walk_flag,
    walk_prefetches,
)
from flashtile.cpu.decode import copy_row
from flashtile.cpu.memory import Float16Bits
from flashtile.decode_planning import plan_decode
from flashtile.kvlayout import check_cache, decode_variants
from flashtile.reference import decode_attention as reference_decode
from flashtile.workitems import decode_tile, decode_walk, plan_splits

TOL32 = dict(rtol=2e-5, atol=2e-5)


def _dense_decode(q, keys, values, lengths, causal=True, **variants):
    """float64 ``(out, lse)``: each sequence's queries against its first keys."""
    batch, hq, tq, _ = q.shape
    out = np.zeros((batch, hq, tq, values.shape[-1]))
    lse = np.full((batch, hq, tq), -np.inf)
    slopes = variants.pop("alibi_slopes", None)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        per_b = None if slopes is None else (slopes if np.ndim(slopes) == 1 else slopes[b])
        o, s = dense_variant_attention(
            q[b : b + 1],
            keys[b : b + 1, :, :n],
            values[b : b + 1, :, :n],
            causal,
            alibi_slopes=per_b,
            **variants,
        )
        out[b], lse[b] = o[0], s[0]
    return out, lse


def _problem(rng, batch=3, hq=6, hkv=2, tq=3, d=16, dv=None, t_max=70, dtype=np.float32):
    dv = d if dv is None else dv
    q = rng.standard_normal((batch, hq, tq, d)).astype(dtype)
    k = rng.standard_normal((batch, hkv, t_max, d)).astype(dtype)
    v = rng.standard_normal((batch, hkv, t_max, dv)).astype(dtype)
    return q, k, v


def _paged(rng, k, v, lengths, page):
    """The same sequences in a shuffled page pool, ``-1`` past each sequence."""
    batch, hkv, _, d = k.shape
    per_seq = -(-k.shape[2] // page)
    pool = batch * per_seq + 2  # spare pages that no sequence uses
    order = rng.permutation(pool)
    table = np.full((batch, per_seq), -1, dtype=np.int64)
    kp = rng.standard_normal((pool, hkv, page, d)).astype(k.dtype)  # junk where unused
    vp = rng.standard_normal((pool, hkv, page, v.shape[3])).astype(v.dtype)
    for b, n in enumerate(lengths):
        for p in range(-(-n // page)):
            table[b, p] = order[b * per_seq + p]
            rows = slice(p * page, min((p + 1) * page, n))
            kp[table[b, p], :, : rows.stop - rows.start] = k[b, :, rows]
            vp[table[b, p], :, : rows.stop - rows.start] = v[b, :, rows]
    return kp, vp, table


VARIANTS = [
    {},
    {"causal": False},
    {"window": (9, 0)},
    {"window": (4, 2), "causal": False},
    {"softcap": 3.0},
    {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.3, 0.2, 0.1])},
    {"alibi_slopes": np.linspace(0.05, 0.6, 18).reshape(3, 6)},
]


@pytest.mark.parametrize("variants", VARIANTS, ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize("tq", [1, 3])
def test_decode_matches_dense_and_reference(rng, variants, tq):
    q, k, v = _problem(rng, tq=tq, dv=11)
    lengths = np.array([70, 37, 2])
    out, lse = flashtile.decode_attention(
        q, k, v, cache_seqlens=lengths, return_lse=True, **variants
    )
    ref_out, ref_lse = reference_decode(q, k, v, cache_seqlens=lengths, return_lse=True, **variants)
    want_out, want_lse = _dense_decode(q, k, v, lengths, **dict(variants))
    np.testing.assert_allclose(ref_out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, want_out, **TOL32)
    np.testing.assert_allclose(lse, want_lse, **TOL32)
    np.testing.assert_allclose(ref_lse, want_lse, **TOL32)
    assert out.dtype == np.float32 and out.shape == (3, 6, tq, 11)


def test_decode_float64_is_exact_to_double_rounding(rng):
    q, k, v = _problem(rng, batch=2, hq=4, hkv=1, tq=2, d=8, t_max=300, dtype=np.float64)
    lengths = np.array([300, 129])
    out, lse = flashtile.decode_attention(q, k, v, cache_seqlens=lengths, return_lse=True)
    want_out, want_lse = _dense_decode(q, k, v, lengths)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page", [1, 5, 16, 64, 128])
def test_paged_equals_contiguous(rng, page):
    q, k, v = _problem(rng, t_max=300)
    lengths = np.array([300, 17, 129])
    kp, vp, table = _paged(rng, k, v, lengths, page)
    paged = flashtile.decode_attention(q, kp, vp, cache_seqlens=lengths, block_table=table)
    contiguous = flashtile.decode_attention(q, k, v, cache_seqlens=lengths)
    np.testing.assert_allclose(paged, contiguous, **TOL32)
    ref = reference_decode(q, kp, vp, cache_seqlens=lengths, block_table=table)
    np.testing.assert_allclose(paged, ref, **TOL32)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 1000])
def test_any_number_of_splits_gives_the_same_answer(rng, num_splits):
    # 1000 splits of 300 keys leaves most chunks empty: their lse = -inf
    # partials must merge in without NaN.
    q, k, v = _problem(rng, t_max=300)
    lengths = np.array([300, 1, 257])
    out, lse = flashtile.decode_attention(
        q, k, v, cache_seqlens=lengths, num_splits=num_splits, return_lse=True
    )
    want_out, want_lse = _dense_decode(q, k, v, lengths)
    np.testing.assert_allclose(out, want_out, **TOL32)
    np.testing.assert_allclose(lse, want_lse, **TOL32)


def test_rows_that_see_no_key_give_zeros_not_nan(rng):
    q, k, v = _problem(rng, tq=4)
    lengths = np.array([0, 2, 70])  # an empty sequence; Tq > length leaves early rows empty
    out, lse = flashtile.decode_attention(q, k, v, cache_seqlens=lengths, return_lse=True)
    assert np.isfinite(out).all()
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert (out[1, :, :2] == 0).all() and np.isneginf(lse[1, :, :2]).all()
    want_out, _ = _dense_decode(q, k, v, lengths)
    np.testing.assert_allclose(out, want_out, **TOL32)


def test_large_logits_and_late_maxima(rng):
    # Scores near 1000 and a maximum that appears only in the last chunk.
    q, k, v = _problem(rng, batch=1, hq=2, hkv=1, tq=1, d=4, t_max=2000)
    k[0, 0, 1990] = q[0, 0, 0] * 60
    q *= 20
    out = flashtile.decode_attention(q, k, v, num_splits=5)
    want, _ = _dense_decode(q, k, v, [2000])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variants", VARIANTS, ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize("page", [None, 1, 7, 300])
def test_single_row_items_read_the_cache_in_place(rng, variants, page):
    # One query row per kv head (MHA, Tq = 1), by the fixed rules: pages
    # smaller than a tile (7) take the row-wise path (cpu/cache_rows.py),
    # rows read where they lie; one-token pages gather all heads' rows at
    # once (the heads walk); 300-key pages stay on BLAS, and so does the contiguous float32
    # cache, in tiles of 1024 keys (workitems.decode_tile). An odd head dim
    # leaves the rows unaligned.
    q, k, v = _problem(rng, hq=6, hkv=6, tq=1, d=13, dv=11, t_max=1300)
    lengths = np.array([1300, 257, 1])
    kw = dict(cache_seqlens=lengths, return_lse=True, **variants)
    if page is not None:
        k, v, kw["block_table"] = _paged(rng, k, v, lengths, page)
    out, lse = flashtile.decode_attention(q, k, v, **kw)
    want_out, want_lse = reference_decode(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    np.testing.assert_allclose(out, want_out, **TOL32)
    np.testing.assert_allclose(lse, want_lse, **TOL32)


def test_the_walk_is_the_route_of_the_layout_and_rows_class(rng):
    # (rows, page, pages per sequence, kv heads, head dim, keys) -> the route
    cases = {
        (1, 16, 8, 2, 64, 128): "decode.paged.one.d64.short",
        (4, 16, 8, 2, 96, 4096): "decode.paged.few.d64.short",
        (1, 16, 1, 2, 97, 4097): "decode.contiguous.one.d128.long",  # one page: contiguous
        (4, 256, 8, 2, 128, 2048): "decode.contiguous.few.d128.short",  # large pages
        (1, 1, 64, 8, 64, 9000): "decode.tokens.one.d64.long",  # one-token pages, heads
        (16, 1, 64, 8, 256, 64): "decode.tokens.many.d128.short",
        (9, 1, 64, 8, 64, 64): "decode.tokens.many.d64.short",
        (8, 1, 64, 8, 64, 64): "decode.tokens.few.d64.short",
        (1, 1, 64, 1, 64, 64): "decode.paged.one.d64.short",  # one head: small pages
    }
    for args, name in cases.items():
        for walk in routes.ROUTES[name].candidates:
            with routes.force(name, walk):
                one_head = walk == "head-rows" and args[3] == 1  # (the row walk: below)
                assert decode_walk(*args) == ("rows" if one_head else walk), (args, walk)
    # More rows than the routes measure keep BLAS tiles (heads for one-token pages).
    assert decode_walk(17, 16, 8, 2, 64, 64) == "tiles"
    assert decode_walk(17, 1, 64, 8, 64, 64) == "head-tiles"
    # Tile lengths: one-row items in long pages take longer tiles; the heads
    # walk's tiles hold every head's rows in HEADS_TILE_BYTES.
    assert decode_tile(1, 1300) == 1024 and decode_tile(4, 1300) == decode_tile(1, 300) == 256
    assert decode_tile(4, 1300, "rows") == 1024 and decode_tile(4, 1000, "rows") == 256
    assert decode_tile(4, 1, "head-tiles", 8 * 256 * 4) == 32
    assert decode_tile(4, 1, "head-tiles", 64) == 256
    assert decode_tile(4, 1, "head-tiles", 1 << 20) == 16
    # The head walk reads in place, in pages of one key or several: a full tile.
    assert decode_tile(4, 16, "head-rows", 8 * 256 * 4) == 256
    assert decode_tile(4, 1, "head-rows", 1 << 20) == 256
    # One kv head: the head walk is the row walk without its prefetch, so
    # the row walk runs.
    with routes.force("decode.paged.few.d64.short", "head-rows"):
        assert decode_walk(4, 16, 8, 2, 64, 64) == "head-rows"
        assert decode_walk(4, 16, 8, 1, 64, 64) == "rows"
    # Planned: the walks that read rows in place run float32 work only
    # (float64 takes the tiles of the same items); the flag types.
    q, k, v = _problem(rng, batch=1, hq=2, hkv=2, tq=1, d=4, t_max=64)
    kp, vp, table = _paged(rng, k, v, [64], 16)
    kt, vt = (x.transpose(0, 2, 1, 3).reshape(64, 2, 1, 4).copy() for x in (k, v))  # token pages
    cases = (
        ("decode.paged.one.d64.short", "rows", (kp, vp, table), "tiles"),
        ("decode.tokens.one.d64.short", "head-rows", (kt, vt, np.arange(64)[None]), "head-tiles"),
        ("decode.paged.one.d64.short", "head-rows", (kp, vp, table), "head-tiles"),
    )
    for name, walk, (kc, vc, tab), wide in cases:
        with routes.force(name, walk):
            for dtype, want in ((np.float32, walk), (np.float64, wide)):
                a = [x.astype(dtype) for x in (q, kc, vc)]
                layout = check_cache(a[0], a[1], a[2], None, tab)[1]
                plan = plan_decode(a[0], layout, decode_variants(a[0], layout), 0.5, None)
                assert plan.walk == want
                # One chunk: an item per kv head, or one for both heads.
                assert len(plan.items) == (1 if want.startswith("head") else 2)
    assert isinstance(walk_flag("rows"), RowWalk) and isinstance(walk_flag("tiles"), TileWalk)
    assert isinstance(walk_flag("tiles-stream"), TileWalk)  # (a runtime flag tells it apart)
    assert walk_prefetches("tiles") and not walk_prefetches("tiles-stream")
    assert isinstance(walk_flag("head-tiles"), HeadTilesWalk)
    assert isinstance(walk_flag("head-rows"), HeadRowsWalk)


def test_the_head_walk_keeps_fine_chunks_over_one_token_pages(monkeypatch):
    """Its tiles are 256 keys, but many threads still get one item per 64 keys
    (the head-tiles walk's chunks), not per tile."""
    import flashtile.decode_planning as decode_planning

    monkeypatch.setattr(decode_planning, "call_threads", lambda size: 16)
    q, k = np.zeros((1, 12, 1, 64), np.float32), np.zeros((2048, 12, 1, 64), np.float32)
    q, layout = check_cache(q, k, k, None, np.arange(2048)[None])
    with routes.force("decode.tokens.one.d64.short", "head-rows"):
        plan = plan_decode(q, layout, decode_variants(q, layout), 0.125, None)
    assert plan.tile_keys == 256 and len(plan.items) == 32


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])  # (float32: the test above)
def test_single_row_items_widen_each_format(rng, dtype):
    dtype = np.dtype(dtype)  # ml_dtypes registers "bfloat16" with NumPy
    q, k, v = _problem(rng, batch=2, hq=3, hkv=3, tq=1, d=8, t_max=600)
    k, v = k.astype(dtype), v.astype(dtype)
    lengths = np.array([600, 300])
    k, v, table = _paged(rng, k, v, lengths, 5)
    out = flashtile.decode_attention(q, k, v, cache_seqlens=lengths, block_table=table)
    wide = (a.astype(np.float64) for a in (q, k, v))
    want = reference_decode(*wide, cache_seqlens=lengths, block_table=table)
    np.testing.assert_allclose(out, want, **TOL32)


def test_single_row_late_maximum_rebases_from_the_kept_scores(rng):
    # A score far above the first tile's: the row's reference is raised
    # from a copy of the tile's raw scores (there is no key tile to
    # recompute them from), here with softcap applied on the way.
    q, k, v = _problem(rng, batch=1, hq=1, hkv=1, tq=1, d=4, t_max=2000)
    k[0, 0, 1990] = q[0, 0, 0] * 60
    q *= 20
    kp, vp, table = _paged(rng, k, v, [2000], 16)  # paged: the row-wise walk
    for kw in ({}, {"softcap": 400.0}):
        out = flashtile.decode_attention(
            q, kp, vp, cache_seqlens=[2000], num_splits=1, block_table=table, **kw
        )
        want, _ = _dense_decode(q, k, v, [2000], **kw)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_float16_cache_is_widened_exactly(rng):
    q, k, v = _problem(rng, t_max=200)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    lengths = np.array([200, 77, 5])
    out = flashtile.decode_attention(q, k16, v16, cache_seqlens=lengths)
    want, _ = _dense_decode(q, k16.astype(np.float64), v16.astype(np.float64), lengths)
    np.testing.assert_allclose(out, want, **TOL32)
    kp, vp, table = _paged(rng, k16, v16, lengths, 16)
    paged = flashtile.decode_attention(q, kp, vp, cache_seqlens=lengths, block_table=table)
    np.testing.assert_allclose(paged, out, **TOL32)


def test_float16_rows_are_widened_exactly_for_every_pattern():
    bits16 = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, dtype=np.float32)
    copy_row(bits16, got, Float16Bits())
    want = bits16.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_merge_kernel_matches_merge_states(rng):
    from flashtile.cpu.decode import merge_partials

    slots, rows, dv = 5, 3, 4
    part_out = rng.standard_normal((slots, rows, dv)).astype(np.float32)
    part_lse = (rng.standard_normal((slots, rows)) * 30).astype(np.float32)
    part_lse[1, 0] = -np.inf
    part_lse[:, 2] = -np.inf  # a row with no partial at all
    part_out[:, 2] = 0.0
    spans = np.array([[0, 2], [2, 3]], dtype=np.int64)  # B=1, Hkv=2, group 3, Tq=1
    out = np.empty((1, 6, 1, dv), dtype=np.float32)
    lse = np.empty((1, 6, 1), dtype=np.float32)
    merge_partials(part_out, part_lse, spans, out, lse)
    for hk, (s0, count) in enumerate(spans):
        want_o, want_l = part_out[s0], part_lse[s0]
        for s in range(s0 + 1, s0 + count):
            want_o, want_l = flashtile.merge_states(want_o, want_l, part_out[s], part_lse[s])
        np.testing.assert_allclose(out[0, hk * 3 : hk * 3 + 3, 0], want_o, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(
            np.isneginf(lse[0, hk * 3 : hk * 3 + 3, 0]), np.isneginf(want_l)
        )
    assert np.isfinite(out).all()


def test_split_plan_covers_each_visible_range_once():
    ranges = np.array([[0, 5000], [100, 100], [30, 1000]])
    for num_splits in (None, 1, 4, 3000):
        items, spans = plan_splits(ranges, 2, num_splits, threads=2)
        assert sorted(items[:, 4].tolist()) == list(range(len(items)))
        for b, (lo, hi) in enumerate(ranges):
            for hk in range(2):
                s0, count = spans[b * 2 + hk]
                mine = items[(items[:, 0] == b) & (items[:, 1] == hk)]
                assert sorted(mine[:, 4].tolist()) == list(range(s0, s0 + count))
                chunks = sorted(zip(mine[:, 2].tolist(), mine[:, 3].tolist(), strict=True))
                covered = [j for a, c in chunks for j in range(a, c)]
                assert covered == list(range(lo, hi))
    items, _ = plan_splits(np.array([[0, 65536]]), 1, None, threads=2)
    assert len(items) >= 8  # one long sequence still feeds every thread


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_prefill_then_decode_equals_full_causal_attention(rng, page_size, dtype):
    batch, hq, hkv, d, prompt, steps = 2, 4, 2, 8, 13, 6
    total = prompt + steps
    q = rng.standard_normal((batch, hq, total, d)).astype(np.float32)
    k = rng.standard_normal((batch, hkv, total, d)).astype(np.float32)
    v = rng.standard_normal((batch, hkv, total, d)).astype(np.float32)
    if dtype == np.float16:  # compare against the values the cache can hold
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    full = flashtile.attention(q, k, v, causal=True)
    cache = flashtile.KVCache(batch, hkv, d, 32, dtype=dtype, page_size=page_size)
    cache.append(k[:, :, :prompt], v[:, :, :prompt])
    prefill = flashtile.attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], causal=True)
    np.testing.assert_allclose(prefill, full[:, :, :prompt], **TOL32)
    for t in range(prompt, total):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        step = cache.attend(q[:, :, t : t + 1])
        np.testing.assert_allclose(step, full[:, :, t : t + 1], **TOL32)
    assert cache.lengths.tolist() == [total, total]
    # Speculative decoding: several queries at once against the same cache.
    np.testing.assert_allclose(cache.attend(q[:, :, -3:]), full[:, :, -3:], **TOL32)


def test_kv_cache_overflow_is_a_clear_error_and_leaves_the_cache_intact(rng):
    cache = flashtile.KVCache(2, 1, 4, 10, page_size=4)
    cache.append(rng.standard_normal((2, 1, 8, 4)), rng.standard_normal((2, 1, 8, 4)))
    before = (cache.k.copy(), cache.v.copy(), cache.block_table.copy(), cache.lengths.copy())
    with pytest.raises(ValueError, match="capacity of 10: nothing was written"):
        cache.append(rng.standard_normal((2, 1, 3, 4)), rng.standard_normal((2, 1, 3, 4)))
    for now, then in zip((cache.k, cache.v, cache.block_table, cache.lengths), before, strict=True):
        np.testing.assert_array_equal(now, then)
    cache.append(np.ones((1, 1, 2, 4)), np.ones((1, 1, 2, 4)), batch_index=[1])
    assert cache.lengths.tolist() == [8, 10]


def test_kv_cache_page_pool_and_reset(rng):
    cache = flashtile.KVCache(2, 1, 4, 16, page_size=4, num_pages=5)
    cache.append(np.ones((2, 1, 8, 4)), np.ones((2, 1, 8, 4)))  # 4 pages used
    with pytest.raises(ValueError, match="needs 2 new pages but 1 are free"):
        cache.append(np.ones((2, 1, 1, 4)), np.ones((2, 1, 1, 4)))
    cache.reset(batch_index=0)
    assert cache.lengths.tolist() == [0, 8]
    assert (cache.block_table[0] == -1).all()
    cache.append(np.ones((2, 1, 4, 4)), np.ones((2, 1, 4, 4)))  # 2 of the 3 free pages
    # Sequence 0 gave back pages 0 and 1; the lowest free pages are reused.
    assert cache.block_table[0].tolist() == [0, -1, -1, -1]
    assert cache.block_table[1].tolist() == [2, 3, 1, -1]
    q = rng.standard_normal((2, 2, 1, 4)).astype(np.float32)
    assert np.allclose(cache.attend(q), 1.0)


def test_kv_cache_argument_errors():
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        flashtile.KVCache(1, 1, 4, 0)
    with pytest.raises(TypeError, match=r"float16, ml_dtypes\.bfloat16, float32 or float64"):
        flashtile.KVCache(1, 1, 4, 8, dtype=np.int32)
    cache = flashtile.KVCache(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"expected \(2, 2, T, 4\)"):
        cache.append(np.ones((2, 1, 1, 4)), np.ones((2, 1, 1, 4)))
    with pytest.raises(ValueError, match="outside"):
        cache.reset(batch_index=[5])
    assert "contiguous" in repr(cache)


def test_decode_argument_errors(rng):
    q, k, v = _problem(rng, batch=2, hq=4, hkv=2, tq=1, d=8, t_max=16)
    with pytest.raises(ValueError, match="not C-contiguous"):
        flashtile.decode_attention(q, k[:, :, ::2], v[:, :, ::2])
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 16\]"):
        flashtile.decode_attention(q, k, v, cache_seqlens=[3, 17])
    with pytest.raises(ValueError, match="contiguous cache has 3"):
        flashtile.decode_attention(q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]))
    with pytest.raises(ValueError, match="Hkv must divide Hq"):
        flashtile.decode_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        flashtile.decode_attention(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 9 is not a page"):
        flashtile.decode_attention(
            q, k, v, cache_seqlens=[16, 1], block_table=np.array([[0, -1], [9, -1]])
        )
    with pytest.raises(ValueError, match="without cache_seqlens every sequence fills"):
        flashtile.decode_attention(q, k, v, block_table=np.array([[0, 1], [1, -1]]))
    with pytest.raises(TypeError, match="block_table must hold integers"):
        flashtile.decode_attention(q, k, v, block_table=np.zeros((2, 1)))
    with pytest.raises(ValueError, match="share the dtype"):
        flashtile.decode_attention(q, k, v.astype(np.float64))


@pytest.mark.parametrize("where", ["k nan", "k inf", "q nan"])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize("hkv", [1, 2], ids=["gqa", "row-wise"])
def test_a_non_finite_score_gives_nan_like_attention_whatever_the_split(
    rng, where, num_splits, hkv
):
    # A corrupted cache row must not look like an empty sequence (zeros,
    # lse = -inf), and the split count must not change the answer.
    q, k, v = _problem(rng, batch=1, hq=2, hkv=hkv, tq=1, d=8, t_max=600)
    if where == "q nan":
        q[0, 1, 0, 3] = np.nan
    else:
        k[0, 0, 10, 2] = np.nan if where == "k nan" else np.inf
        q[..., 2] = np.abs(q[..., 2])  # +inf in a score (-inf would only hide the key)
    kp, vp, table = _paged(rng, k, v, [600], 16)  # single rows: the row-wise walk
    out, lse = flashtile.decode_attention(
        q, kp, vp, cache_seqlens=[600], num_splits=num_splits, block_table=table, return_lse=True
    )
    want = flashtile.attention(
        q[0], np.repeat(k[0], 2 // hkv, axis=0), np.repeat(v[0], 2 // hkv, axis=0), causal=True
    )
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(out[0]), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(lse[0]), np.isnan(want[..., 0]))
    np.testing.assert_allclose(out[0], want, **TOL32)  # equal_nan: the clean rows agree


def test_float16_cache_refuses_values_it_would_store_as_inf():
    cache = flashtile.KVCache(1, 1, 4, 8, dtype=np.float16)
    cache.append(np.ones((1, 1, 2, 4)), np.ones((1, 1, 2, 4)))
    big = np.ones((1, 1, 1, 4))
    big[0, 0, 0, 1] = 1e5
    with pytest.raises(ValueError, match=r"k holds 100000, beyond float16's range"):
        cache.append(big, np.ones((1, 1, 1, 4)))
    assert cache.lengths.tolist() == [2]  # nothing written
    with pytest.raises(ValueError, match="v holds"):
        cache.append(np.ones((1, 1, 1, 4)), -big)
    assert cache.lengths.tolist() == [2]
    cache.append(np.full((1, 1, 1, 4), 65510.0), np.ones((1, 1, 1, 4)))  # rounds to 65504
    assert cache.k[0, 0, 2, 0] == 65504


def test_dense_decode_oracle_matches_plain_dense_attention(rng):
    # The per-sequence oracle above, on one full sequence, is dense_attention.
    q, k, v = _problem(rng, batch=1, hq=2, hkv=2, tq=3, d=4, t_max=9)
    out, lse = _dense_decode(q, k, v, [9])
    want_out, want_lse = dense_attention(q[0], k[0], v[0], causal=True)
    np.testing.assert_allclose(out[0], want_out, rtol=1e-12)
    np.testing.assert_allclose(lse[0], want_lse, rtol=1e-12)


@pytest.mark.parametrize("page", [None, 256])
def test_long_float16_and_large_page_caches(rng, page):
    # Whole 256-key tiles: in place for float32 pages of 256, widened for float16.
    q, k, v = _problem(rng, batch=2, hq=4, hkv=2, tq=2, d=16, t_max=768)
    lengths = np.array([768, 600])
    want, _ = _dense_decode(q, k, v, lengths)
    if page is None:
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
        got = flashtile.decode_attention(q, k16, v16, cache_seqlens=lengths)
        want, _ = _dense_decode(q, k16.astype(np.float64), v16.astype(np.float64), lengths)
    else:
        kp, vp, table = _paged(rng, k, v, lengths, page)
        got = flashtile.decode_attention(q, kp, vp, cache_seqlens=lengths, block_table=table)
    np.testing.assert_allclose(got, want, **TOL32)


def test_num_splits_beyond_the_length_costs_no_memory(rng):
    q, k, v = _problem(rng, batch=2, hq=2, hkv=2, tq=1, d=4, t_max=40)
    items, _ = plan_splits(np.array([[0, 40], [0, 3]]), 2, 10**6, threads=2)
    assert len(items) == 2 * (40 + 3)
    out = flashtile.decode_attention(q, k, v, num_splits=10**6)
    np.testing.assert_allclose(out, flashtile.decode_attention(q, k, v), **TOL32)


def test_the_row_walk_of_a_long_contiguous_cache(rng):
    """Rows read in place in 1024-key tiles (a contiguous cache of 1024 keys or more):
    GQA rows, several queries, causal and a window, sequences that end inside a tile,
    against the reference. At d 128 a tile's run takes four calls of the IR passes
    (row_passes.quad_steps), each call's halves side by side; the ninth row's values
    read pairs far apart (row_passes.far_values)."""
    q, k, v = _problem(rng, batch=3, hq=6, hkv=2, tq=3, d=128, t_max=2300)
    lengths = np.array([2300, 1500, 1030])
    with contextlib.ExitStack() as forced:
        for name, route in routes.ROUTES.items():
            if name.startswith("decode.contiguous") and "rows" in route.candidates:
                forced.enter_context(routes.force(name, "rows"))
        layout = check_cache(q, k, v, lengths, None)[1]
        plan = plan_decode(q, layout, decode_variants(q, layout, causal=True), 0.25, None)
        assert plan.walk == "rows" and plan.tile_keys == 1024
        for kw in ({"causal": True}, {"causal": True, "window": (700, 0)}):
            out = flashtile.decode_attention(q, k, v, cache_seqlens=lengths, **kw)
            wide = (a.astype(np.float64) for a in (q, k, v))
            np.testing.assert_allclose(
                out, reference_decode(*wide, cache_seqlens=lengths, **kw), **TOL32
            )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "walk, page",
    [
        ("rows", None),
        ("rows", 6),
        ("rows", 5),
        ("head-rows", 1),
        ("head-rows", -1),
        ("head-rows", 64),
        ("head-rows", 5),
    ],
)
@pytest.mark.parametrize(
    "hq, tq",
    [(2, 1), (6, 1), (8, 1), (6, 2), (6, 3)],
    ids=["1row", "3rows", "4rows", "6rows", "9rows"],
)
@pytest.mark.parametrize("d, dv", [(13, 11), (16, 24)], ids=["odd", "lanes"])
def test_the_walks_that_read_rows_fold_keys_in_passes_and_the_rest_one_by_one(
    rng, dtype, walk, page, hq, tq, d, dv
):
    """The row walks' passes (row_passes.ROWS_PER_PASS query rows, four keys for
    one row, four or two value rows; with head dims that are multiples of 8,
    two keys by four rows in LLVM IR, cpu/quad_passes.py) and their
    remainders: items of 1, 3, 4, 6 and 9 rows; runs of every length modulo four
    (sequences of 1, 2, 3, 4, 67, 7, 9 and 600 keys; pages of 6, 5 and 64 keys,
    read by one head's rows or by every head's page by page; one-token pages
    of two kv heads, in order or (page -1) in blocks of 5 tokens shuffled,
    so that runs of tokens end anywhere); unaligned rows; each cache format;
    against the float64 reference on the cache's values."""
    dtype = np.dtype(dtype)
    q, k, v = _problem(rng, batch=8, hq=hq, hkv=2, tq=tq, d=d, dv=dv, t_max=600)
    k, v = k.astype(dtype), v.astype(dtype)
    # (67: a long run of odd length, whose keys one row reads in pairs far
    # apart, row_passes.FAR_RUN; 600: tiles of 256 end mid-page)
    lengths = np.array([1, 2, 3, 4, 67, 7, 9, 600])
    kw = dict(cache_seqlens=lengths, return_lse=True, causal=True)
    if page in (1, -1):  # one-token pages of every kv head: flash-attn's (B, T, Hkv, d) cache
        k, v = (x.transpose(0, 2, 1, 3).reshape(-1, 2, 1, x.shape[3]).copy() for x in (k, v))
        kw["block_table"] = np.arange(k.shape[0]).reshape(8, -1)
        if page == -1:  # token i moves to place at[i]: blocks of 5 in a random order
            at = (5 * rng.permutation(k.shape[0] // 5)[:, None] + np.arange(5)).reshape(-1)
            k[at], v[at], kw["block_table"] = k.copy(), v.copy(), at[kw["block_table"]]
    elif page is not None:
        k, v, kw["block_table"] = _paged(rng, k, v, lengths, page)
    with contextlib.ExitStack() as forced:
        for name, route in routes.ROUTES.items():
            if name.startswith("decode.") and walk in route.candidates:
                forced.enter_context(routes.force(name, walk))
        layout = check_cache(q, k, v, lengths, kw.get("block_table"))[1]
        assert (
            plan_decode(q, layout, decode_variants(q, layout, causal=True), 0.3, None).walk == walk
        )
        out, lse = flashtile.decode_attention(q, k, v, **kw)
    want_out, want_lse = reference_decode(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    np.testing.assert_allclose(out, want_out, **TOL32)
    np.testing.assert_allclose(lse, want_lse, **TOL32)

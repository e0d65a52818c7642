"""Regression tests for inputs that once gave a wrong number or an internal error.

Each test names the defect it guards; every one failed before its fix.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import flashtile as ft


def qkv(rng, *shape, dtype=np.float64):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("offsets", [[0, 15, 10, 20], [0, 2**31 + 5, 20], [0, 25, 20]])
def test_unsigned_cu_seqlens_are_range_checked(rng, dtype, offsets):
    """np.diff of unsigned offsets wraps: decreasing offsets must still be refused."""
    q, k, v = qkv(rng, 2, 20, 8)
    cu = np.array(offsets, dtype=dtype)
    good = np.linspace(0, 20, cu.size).astype(dtype)
    with pytest.raises(ValueError, match=r"cu_seqlens_q .* never decrease"):
        ft.varlen_attention(q, k, v, cu, good)
    with pytest.raises(ValueError, match=r"cu_seqlens_k .* never decrease"):
        ft.varlen_attention(q, k, v, good, cu)


def test_uint64_cu_seqlens_past_int64(rng):
    q, k, v = qkv(rng, 2, 20, 8)
    cu = np.array([0, 2**63 + 5, 20], dtype=np.uint64)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ft.varlen_attention(q, k, v, cu, np.array([0, 10, 20], dtype=np.uint64))


def test_unsigned_cu_seqlens_valid(rng):
    q, k, v = qkv(rng, 2, 20, 8)
    cu = np.array([0, 5, 20], dtype=np.uint32)
    out = ft.varlen_attention(q, k, v, cu, cu)
    ref = ft.varlen_attention(q, k, v, cu.astype(np.int64), cu.astype(np.int64))
    np.testing.assert_array_equal(out, ref)


def test_block_mask_does_not_alias_the_callers_array(rng):
    """Editing the array after block_mask() must not change the results."""
    q, k, v = qkv(rng, 2, 20, 8)
    keep = rng.random((20, 20)) < 0.6
    keep[:, 0] = True
    original = keep.copy()
    bm = ft.block_mask(keep, 4, 4)
    before = ft.attention(q, k, v, mask=bm)
    keep[:, 5:] = ~keep[:, 5:]
    keep[:4] = True
    after = ft.attention(q, k, v, mask=bm)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(before, ft.naive_attention(q, k, v, mask=original)[0], atol=1e-12)
    assert not bm.mask.flags.writeable


def test_hand_built_block_mask_is_checked_against_its_mask(rng):
    """States claiming FULL tiles of a sparse mask, or of the wrong shape, are refused."""
    sparse = np.eye(20, dtype=bool)
    with pytest.raises(ValueError, match=r"tile \(0, 0, 0, 0\) as 2 but its mask makes it 1"):
        ft.BlockMask(sparse, 4, 4, np.full((1, 1, 5, 5), 2, np.int8))
    with pytest.raises(ValueError, match=r"states has shape \(1, 1, 1, 1\), expected"):
        ft.BlockMask(sparse, 4, 4, np.full((1, 1, 1, 1), 2, np.int8))
    with pytest.raises(ValueError, match=r"0 \(empty\), 1 \(partial\) or 2"):
        ft.BlockMask(sparse, 4, 4, np.full((1, 1, 5, 5), 3, np.int8))
    with pytest.raises(TypeError, match="boolean mask"):
        ft.BlockMask(sparse.astype(np.int8), 4, 4)


def test_hand_built_block_mask_partial_is_always_safe(rng):
    """PARTIAL everywhere makes the kernel read the mask: still exact."""
    q, k, v = qkv(rng, 2, 20, 8)
    keep = rng.random((20, 20)) < 0.5
    keep[:, 0] = True
    bm = ft.BlockMask(keep, 4, 8, np.ones((1, 1, 5, 3), np.int16))
    assert bm.states.dtype == np.int8 and not bm.states.flags.writeable
    ref = ft.naive_attention(q, k, v, mask=keep)[0]
    np.testing.assert_allclose(ft.attention(q, k, v, mask=bm), ref, atol=1e-12)
    assert ft.BlockMask(keep, 4, 8).counts() == ft.block_mask(keep, 4, 8).counts()


@pytest.mark.parametrize("side", ["a", "b"])
def test_merge_states_refuses_plus_inf_lse(rng, side):
    """lse = +inf gave a NaN row with only a RuntimeWarning."""
    out = rng.standard_normal((3, 4))
    bad, good = np.array([1.0, np.inf, 0.0]), np.zeros(3)
    lses = (bad, good) if side == "a" else (good, bad)
    with pytest.raises(ValueError, match=rf"lse_{side} holds \+inf at \[1\]"):
        ft.merge_states(out, lses[0], out, lses[1])
    merged, lse = ft.merge_states(out, np.array([1.0, -np.inf, 0.0]), out, good)
    np.testing.assert_allclose(merged, out)
    assert np.isfinite(lse).all()


def _decode_args(rng):
    return rng.standard_normal((1, 2, 1, 4)), *qkv(rng, 1, 2, 6, 4)[:2]


FLAG_CALLS = {
    "attention": lambda rng, **kw: ft.attention(*qkv(rng, 2, 5, 4), **kw),
    "varlen_attention": lambda rng, **kw: ft.varlen_attention(
        *qkv(rng, 2, 5, 4), [0, 5], [0, 5], **kw
    ),
    "decode_attention": lambda rng, **kw: ft.decode_attention(*_decode_args(rng), **kw),
    "tiled_attention": lambda rng, **kw: ft.tiled_attention(*qkv(rng, 2, 5, 4), 2, **kw),
    "reference.decode_attention": lambda rng, **kw: ft.reference.decode_attention(
        *_decode_args(rng), **kw
    ),
}


@pytest.mark.parametrize("call", FLAG_CALLS.values(), ids=FLAG_CALLS.keys())
@pytest.mark.parametrize("value", ["no", 0, 1, None, np.array([True])])
def test_return_lse_accepts_bools_only(rng, call, value):
    """return_lse="no" was taken as true; flags take True/False, as causal does."""
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        call(rng, return_lse=value)
    assert isinstance(call(rng, return_lse=np.bool_(True)), tuple)


@pytest.mark.parametrize("shape", [(2, 0, 5, 4), (0, 2, 5, 4), (0, 0, 5, 4)])
def test_no_heads_gives_empty_results(shape):
    """H = 0 raised ZeroDivisionError; the result is empty, as for B = 0."""
    q = np.zeros(shape)
    out, lse = ft.attention(q, q, q, causal=True, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:-1]
    grads = ft.attention_backward(q, q, q, out, lse, out, causal=True)
    assert [g.shape for g in grads] == [shape] * 3


def test_varlen_no_heads_gives_empty_results():
    q = np.zeros((0, 6, 4))
    out, lse = ft.varlen_attention(q, q, q, [0, 2, 6], [0, 2, 6], return_lse=True)
    assert out.shape == (0, 6, 4) and lse.shape == (0, 6)
    grads = ft.varlen_attention_backward(q, q, q, out, lse, out, [0, 2, 6], [0, 2, 6])
    assert [g.shape for g in grads] == [(0, 6, 4)] * 3


@pytest.mark.parametrize("side", [2**62, 2**63 - 1, 2**64, 10**30, np.uint64(2**64 - 1)])
def test_huge_window_sides_are_unbounded(rng, side):
    """Sides past int64 raised OverflowError; int64's max wrapped around to all zeros."""
    q, k, v = qkv(rng, 2, 9, 4)
    ref = ft.attention(q, k, v, causal=True)
    for window in ((side, side), (side, None), (side, 0)):
        np.testing.assert_array_equal(ft.attention(q, k, v, causal=True, window=window), ref)
    np.testing.assert_array_equal(ft.attention(q, k, v, window=(side, side)), ft.attention(q, k, v))
    qd, kc, vc = rng.standard_normal((1, 2, 1, 4)), *qkv(rng, 1, 2, 6, 4)[:2]
    np.testing.assert_allclose(
        ft.decode_attention(qd, kc, vc, window=(side, 0)), ft.decode_attention(qd, kc, vc)
    )


@pytest.mark.parametrize("splits", [2**63 - 1, 2**64, 10**30])
def test_huge_num_splits(rng, splits):
    """num_splits past int64 raised OverflowError; any count gives the same result."""
    qd, kc, vc = rng.standard_normal((1, 2, 1, 4)), *qkv(rng, 1, 2, 6, 4)[:2]
    np.testing.assert_allclose(
        ft.decode_attention(qd, kc, vc, num_splits=splits), ft.decode_attention(qd, kc, vc)
    )


@pytest.mark.parametrize("blocks", [(10**6, 10**6), (2**70, 3), (5, 2**64)])
def test_block_mask_tiles_larger_than_the_mask(rng, blocks):
    """block_mask(mask, 10**6, 10**6) tried to allocate 931 GiB of padding."""
    keep = rng.random((2, 7, 11)) < 0.5
    bm = ft.block_mask(keep, *blocks)
    assert (bm.block_q, bm.block_k) == blocks
    small = ft.block_mask(keep, min(blocks[0], 7), min(blocks[1], 11))
    np.testing.assert_array_equal(bm.states, small.states)
    q, k, v = qkv(rng, 2, 2, 7, 4)
    k, v = k[:, :, :1].repeat(11, axis=2), v[:, :, :1].repeat(11, axis=2)
    keep[..., 0] = True
    np.testing.assert_allclose(
        ft.attention(q, k, v, mask=ft.block_mask(keep[:, None], *blocks)),
        ft.naive_attention(q, k, v, mask=keep[:, None])[0],
        atol=1e-12,
    )


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_padded_keys_never_poison_whichever_padding_hid_them(rng, poison):
    """NaN keys hidden by key_padding_mask poisoned every row; kv_lengths did not."""
    q, k, v = qkv(rng, 2, 2, 9, 4)
    lengths = np.array([7, 5])
    kpm = np.arange(9) < lengths[:, None]
    for b, n in enumerate(lengths):
        k[b, :, n:] = poison
        v[b, :, n:] = poison
    k_before, v_before = k.copy(), v.copy()
    clean = [np.where(kpm[:, None, :, None], a, 0) for a in (k, v)]
    want, want_lse = ft.attention(q, *clean, kv_lengths=lengths, return_lse=True)
    dout = rng.standard_normal(want.shape)
    want_grads = ft.attention_backward(q, *clean, want, want_lse, dout, kv_lengths=lengths)
    for pad in ({"kv_lengths": lengths}, {"key_padding_mask": kpm}):
        out, lse = ft.attention(q, k, v, return_lse=True, **pad)
        np.testing.assert_allclose(out, want, atol=1e-12)
        grads = ft.attention_backward(q, k, v, out, lse, dout, **pad)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-12)
        np.testing.assert_allclose(ft.naive_attention(q, k, v, **pad)[0], want, atol=1e-12)
        ref_grads = ft.tiled_attention_backward(
            q, k, v, out=out, lse=lse, dout=dout, block_size=4, **pad
        )
        for g, w in zip(ref_grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-12)
    np.testing.assert_array_equal(k, k_before)  # the caller's arrays are not written
    np.testing.assert_array_equal(v, v_before)


def test_no_heads_with_alibi_slopes():
    """H = 0 with (empty) ALiBi slopes failed to reshape them (found by the fuzz test)."""
    q = np.zeros((1, 0, 3, 2), dtype=np.float32)
    out = ft.attention(q, q, q, alibi_slopes=np.zeros(0))
    assert out.shape == q.shape
    assert ft.attention_backward(q, q, q, out, out[..., 0], out, alibi_slopes=np.zeros(0))


def test_float16_mask_does_not_warn(rng):
    """A float16 mask warned 'overflow encountered in cast', and -60000 became -inf
    (a row of them saw no key) (found by the fuzz test)."""
    q, k, v = qkv(rng, 1, 3, 4)
    mask = np.array([[0.5, -np.inf, -60000.0]] * 3, dtype=np.float16)
    mask[1] = -60000.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ft.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, ft.naive_attention(q, k, v, mask=mask.astype(float))[0])
    with pytest.raises(ValueError, match=r"float mask .* not NaN, \+inf"):
        ft.attention(q, k, v, mask=np.full((3, 3), np.inf, dtype=np.float16))


def test_bfloat16_masks_sinks_and_slopes_are_floats(rng):
    """A bf16 model's additive mask, sinks and ALiBi slopes were refused as
    not floats (NumPy's kind for ml_dtypes' bfloat16 is "V"); each now counts
    as the float32 array of the same values."""
    q, k, v = qkv(rng, 2, 3, 4)
    mask = np.array([[0.5, -np.inf, -3e38]] * 3).astype(ml_dtypes.bfloat16)
    mask[1] = [-2.5, 1.0, 0.0]
    sinks = np.array([0.75, -1.5]).astype(ml_dtypes.bfloat16)
    slopes = np.array([0.25, 0.5]).astype(ml_dtypes.bfloat16)
    got = ft.attention(q, k, v, mask=mask, sinks=sinks, alibi_slopes=slopes)
    wide = {"mask": mask, "sinks": sinks, "alibi_slopes": slopes}
    want = ft.attention(q, k, v, **{n: a.astype(np.float32) for n, a in wide.items()})
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"float mask .* not NaN, \+inf"):
        ft.attention(q, k, v, mask=np.full((3, 3), np.nan, dtype=ml_dtypes.bfloat16))


@pytest.mark.parametrize(
    ("scale", "magnitude"), [(1e38, 1.0), (1e300, 1.0), (1.0, 1e19), (1e-30, 1e35)]
)
def test_float32_scores_past_float32_range(rng, scale, magnitude):
    """float32 with a huge scale (1e38) returned all NaN; float64 was fine.

    (Gradients at such scores are ill-posed for any stored lse, whose rounding
    error |lse| * eps enters exp(s - lse).)"""
    q, k, v = (a * np.float32(magnitude) for a in qkv(rng, 2, 6, 4, dtype=np.float32))
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    want, want_lse = ft.attention(q64, k64, v64, scale=scale, causal=True, return_lse=True)
    assert np.isfinite(want).all()
    out, lse = ft.attention(q, k, v, scale=scale, causal=True, return_lse=True)
    assert out.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * magnitude)
    with np.errstate(over="ignore"):  # an lse past float32's range is inf
        np.testing.assert_allclose(lse, want_lse.astype(np.float32), rtol=1e-5)
    cu = [0, 2, 6]
    var = ft.varlen_attention(q, k, v, cu, cu, scale=scale)
    want_var = ft.varlen_attention(q64, k64, v64, cu, cu, scale=scale)
    np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-5 * magnitude)


def _float64_attention(q, k, v, scale, softcap=None):
    """out and lse of the dense formula in float64 (softcap applied)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    s = scale * q @ np.swapaxes(k, -1, -2)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return (p @ v) / p.sum(-1, keepdims=True), m[..., 0] + np.log(p.sum(-1))


def _overflow_cases():
    """Inputs whose float32 (or bf16-product) scores overflow while every
    row's lse would still come out finite: softcap maps an infinite score to
    +-cap; partial sums of q.k that overflow and cancel give -inf for a
    score of 0 (a key silently dropped); bf16 products sum q.k unscaled, so
    below -FLT_MAX a key with a small scaled score is dropped."""
    t, d = 8, 4
    q = np.full((1, 1, t, d), 3e38, np.float32)
    k = np.ones((1, 1, t, d), np.float32) * (np.arange(1, t + 1, dtype=np.float32) * 1e-38)[:, None]
    v = np.arange(t, dtype=np.float32)[None, None, :, None] * np.ones((1, 1, 1, d), np.float32)
    yield "softcap", (q, k, v), {"scale": 1.0, "softcap": 50.0}
    d = 64
    q = np.full((1, 1, t, d), 2.0**63, np.float32)
    k = np.zeros((1, 1, t, d), np.float32)
    k[..., 0, :] = np.tile(np.array([-1, -1, 1, 1], np.float32) * 2.0**64, d // 4)
    k[..., 1:, 0] = -5 * 2.0**-63
    v = np.arange(t, dtype=np.float32)[None, None, :, None] * np.ones((1, 1, 1, d), np.float32)
    yield "cancelling partial sums", (q, k, v), {"scale": 1.0}
    bf16 = ml_dtypes.bfloat16
    q = np.full((1, 2, 4, d), 1e19, np.float32)
    k = np.full((1, 2, 4, d), -4.6875e17, np.float32)
    k[:, :, 0] = -5.47e17
    v = np.arange(4, dtype=np.float32)[None, None, :, None] * np.ones((1, 2, 1, d), np.float32)
    yield "bf16 products below -FLT_MAX", tuple(a.astype(bf16) for a in (q, k, v)), {"scale": 1e-38}


@pytest.mark.parametrize("case", list(_overflow_cases()), ids=lambda c: c[0])
def test_overflow_that_leaves_lse_finite_is_still_computed_right(case):
    """The float32-range bound is checked before the forward: these inputs
    give finite but wrong rows if the bound is left to an lse check after
    the call (an attempt that an independent review caught)."""
    from flashtile.api import check_call
    from flashtile.planning import bf16_products, kernel_arrays

    name, (q, k, v), kw = case
    if name.startswith("bf16") and not bf16_products(q.dtype):
        pytest.skip("bf16 inputs are widened here (no bf16 products): nothing to overflow")
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    want, want_lse = _float64_attention(q, k, v, kw["scale"], kw.get("softcap"))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    # Whatever the BLAS's summation order (OpenBLAS turns the cancelling sums
    # into NaN, which an after-call check would catch), the planner must
    # leave the overflowing dtype before the call.
    variants = {"softcap": kw["softcap"]} if "softcap" in kw else {}
    work = kernel_arrays(check_call(q, k, v, False, kw["scale"], variants))[0].dtype
    assert work == (np.float32 if name.startswith("bf16") else np.float64)


@pytest.mark.parametrize("softcap", [50.0, None], ids=["softcap", "cancelling"])
def test_decoding_overflow_that_leaves_lse_finite_is_caught(softcap):
    """Decoding checks the float32 range after the call; an overflow that
    softcap maps to the cap, or partial sums of q.k that overflow and cancel
    (-inf for a score of 0: the key dropped), can leave every lse finite, so
    the kernel reports non-finite raw scores (cpu/tile_step.flag_non_finite).
    Through a decode-shaped attention call and decode_attention. (Whether
    the cancelling sums end as -inf or NaN depends on the BLAS's summation
    order; the softcap case needs the report whatever the order.)"""
    t = 512  # 8 keys that matter, the rest far below them
    if softcap is not None:
        d = 4
        q = np.full((1, 1, 1, d), 3e38, np.float32)  # q * scale * log2(e) overflows
        scores = np.concatenate([np.arange(1, 9), np.full(t - 8, -100)]).astype(np.float32)
        k = np.ones((1, 1, t, d), np.float32) * (scores * 1e-38)[:, None]
    else:
        d = 64
        q = np.full((1, 1, 1, d), 2.0**63, np.float32)
        k = np.zeros((1, 1, t, d), np.float32)
        k[..., 0, :] = np.tile(np.array([-1, -1, 1, 1], np.float32) * 2.0**64, d // 4)
        k[..., 1:, 0] = -5 * 2.0**-63  # q . k_j = -5, and 0 for key 0
    v = np.arange(t, dtype=np.float32)[None, None, :, None] * np.ones((1, 1, 1, d), np.float32)
    want, want_lse = _float64_attention(q, k, v, 1.0, softcap)
    kw = {} if softcap is None else {"softcap": softcap}
    out, lse = ft.attention(q, k, v, scale=1.0, return_lse=True, **kw)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    out, lse = ft.decode_attention(q, k, v, scale=1.0, return_lse=True, **kw)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    # In 16-key pages the one query row reads the rows in place (cpu/cache_rows.py).
    pages = [a[0].reshape(1, t // 16, 16, d).transpose(1, 0, 2, 3).copy() for a in (k, v)]
    table = np.arange(t // 16)[None, :]
    out, lse = ft.decode_attention(q, *pages, block_table=table, scale=1.0, return_lse=True, **kw)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)


def test_rebase_recompute_reports_a_non_finite_raw_score():
    """A score above the row's reference makes the tile step recompute that
    row's raw scores in its own loop (tile_step.rebase_row), in another
    summation order than BLAS: an overflow there must raise decoding's range
    check too (raw_flag), or softcap would turn it into the cap unseen.
    (End to end, q.k terms near float32's largest value can overflow in one
    order and not the other; which one does depends on the BLAS and the
    vectorisation, so the loop is tested directly.)"""
    from flashtile.cpu.tile_step import one_segment, rebase_row
    from flashtile.cpu.tiles import SEG_LENGTH, QueryTile
    from flashtile.planning import kernel_variants
    from flashtile.variants import Variants

    big = np.finfo(np.float32).max
    q_row = np.array([big, big], dtype=np.float32)  # q . k = 2 * big: inf in any order
    k_rows = np.ones((4, 2), dtype=np.float32)
    s = np.zeros((1, 4), dtype=np.float32)
    segs = one_segment()
    segs[0, SEG_LENGTH] = 4
    tile = QueryTile(0, 0, 1, 0, 1, 4, 4, 0, 0)
    for softcap, empty in ((50.0, False), (None, False), (50.0, True)):
        va = kernel_variants(Variants(False, -1, -1, softcap=softcap), np.float32, 1)
        flag = np.zeros(0 if empty else 1, dtype=np.uint8)
        rebase_row(s, s, 0, 0, 4, q_row, k_rows, np.float32(1.0), segs, tile, va, True, flag)
        assert empty or flag[0] == 1


@pytest.mark.parametrize("slope", [3e38, 1e300])
def test_float32_huge_alibi_slopes(rng, slope):
    """ALiBi slopes past float32's range (in log2 units) gave NaN rows."""
    q, k, v = qkv(rng, 2, 5, 3, dtype=np.float32)
    slopes = np.array([slope, 0.5])
    want = ft.attention(*(a.astype(np.float64) for a in (q, k, v)), alibi_slopes=slopes)
    out = ft.attention(q, k, v, alibi_slopes=slopes)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("scale", [1e38, 1e300])
def test_decode_scores_past_float32_range(rng, cache_dtype, scale):
    """decode_attention returned NaN for float32 scores past float32's range."""
    q = rng.standard_normal((2, 2, 1, 4))
    k, v = (rng.standard_normal((2, 2, 8, 4)).astype(cache_dtype) for _ in range(2))
    lengths = np.array([8, 0])
    out, lse = ft.decode_attention(q, k, v, cache_seqlens=lengths, scale=scale, return_lse=True)
    want = ft.decode_attention(
        q, k.astype(np.float64), v.astype(np.float64), cache_seqlens=lengths, scale=scale
    )
    assert lse.dtype == np.float32 and np.isneginf(lse[1]).all()
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_nan_row_does_not_disable_the_float64_scores():
    """A NaN in one query row made the score bound NaN, so float32 scores past
    float32's range (+inf and -inf in one row) gave NaN in other rows (found by
    the fuzz test)."""
    q = np.array([[[0.36, 0.29], [np.nan, 0.6]], [[-2.71, -1.89], [0.21, 0.22]]], np.float32)
    k = np.array([[[1.3e38, 9.47e37], [-7.04e37, -1.27e38]]], np.float32)
    v = np.array([[[0.1], [-0.54]]], np.float32)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    cu = [0, 1, 2]
    for out, want in (
        (ft.attention(q, k, v), ft.attention(*wide)),
        (ft.varlen_attention(q, k, v, cu, cu), ft.varlen_attention(*wide, cu, cu)),
    ):
        assert np.isnan(out[0, 1]).all()
        out[0, 1] = want[0, 1] = 0
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sizes", [(2**64 - 1, 2**64 - 1, 2**64, 6), (1, 1, 2**62, 2**62), (2**40, 2**20, 8, 8)]
)
def test_kv_cache_too_large_to_allocate(sizes):
    """Sizes past what NumPy can address raised 'Maximum allowed dimension exceeded'
    (no argument named) or a MemoryError; a huge paged pool tried to build a list
    of 2**40 free pages (found by the fuzz test)."""
    batch, kv_heads, head_dim, capacity = (np.uint64(s) if s == 2**64 - 1 else s for s in sizes)
    with pytest.raises(ValueError, match=r"KVCache of batch=.* GiB.*lower batch, kv_heads"):
        ft.KVCache(batch, kv_heads, head_dim, capacity)
    with pytest.raises(ValueError, match=r"KVCache of batch=.* GiB.*lower batch, kv_heads"):
        ft.KVCache(1, 1, 1, 2**40, page_size=1)


def test_float32_kv_cache_refuses_float64_values_past_its_range():
    """float64 values past float32's range were stored as inf in a float32
    KVCache (a RuntimeWarning only), so attention gave NaN for finite inputs;
    the float16 storage already refused them (found by the fuzz test)."""
    cache = ft.KVCache(1, 1, 2, 4)
    big = np.ones((1, 1, 1, 2))
    big[0, 0, 0, 1] = 1e300
    with pytest.raises(ValueError, match=r"v holds 1e\+300, beyond float32's range"):
        cache.append(np.ones((1, 1, 1, 2)), big)
    assert cache.lengths.tolist() == [0]  # nothing written
    cache.append(np.ones((1, 1, 1, 2)), np.full((1, 1, 1, 2), 3e38))  # fits float32
    np.testing.assert_allclose(cache.attend(np.ones((1, 1, 1, 2))), np.float32(3e38))


def test_decode_shaped_call_past_float32_range_is_computed_again_in_float64():
    # One query against many keys runs on the decode kernel without a pass over
    # the keys first; its non-finite lse sends it back to the checked forward.
    from flashtile.api import check_call
    from flashtile.decode_planning import decode_shaped

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 600, 16)).astype(np.float32) for _ in range(2))
    assert decode_shaped(check_call(q, k, v, True, 1e38, {}))
    out, lse = ft.attention(q, k, v, causal=True, scale=1e38, return_lse=True)
    want, want_lse = ft.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True,
                                  scale=1e38, return_lse=True)  # fmt: skip
    assert np.isfinite(out).all() and np.allclose(out, want, rtol=1e-5, atol=1e-6)
    with np.errstate(over="ignore"):  # lse past float32's range is inf, by the policy
        assert lse.dtype == np.float32 and np.array_equal(lse, want_lse.astype(np.float32))

"""The front door (flashtile.frontdoor): a repeated call reuses its checks and
plan and gives exactly what the general path gives; no check is skipped.

Each case runs a call three times through the public function (the first
call checks and prepares the key, the second plans its key count, the
third runs the stored step) and compares every result bit for bit with
the general path (``run_call(check_call(...))``), which never reads the
prepared records.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashtile as ft
from flashtile import call_keys, frontdoor
from flashtile.frontdoor import check_call, run_call

BF16 = np.dtype(ml_dtypes.bfloat16)


def _arrays(shape_q, shape_k, dtype, seed=0, big=1.0):
    rng = np.random.default_rng(seed)
    shape_v = shape_k[:-1] + (shape_k[-1] + 2,)
    q, k, v = ((rng.standard_normal(s) * big).astype(dtype) for s in (shape_q, shape_k, shape_v))
    return q, k, v


def _general(q, k, v, causal=False, scale=None, **variants):
    return run_call(check_call(q, k, v, causal, scale, variants), return_lse=True)


# (q shape, k shape, keywords): forward and decode-shaped routes, 2-D to 4-D, GQA.
CASES = [
    ((1, 4, 16, 32), (1, 4, 16, 32), {"causal": True}),
    ((2, 6, 37, 9), (2, 2, 53, 9), {"window": (7, 3)}),
    ((3, 19, 5), (3, 23, 5), {"causal": True, "softcap": 3.0, "scale": 0.7}),
    ((13, 7), (29, 7), {}),
    ((1, 12, 1, 16), (1, 12, 700, 16), {}),  # a decoding step: the decode kernel
    ((2, 8, 2, 8), (2, 2, 600, 8), {"causal": True}),  # GQA speculative step
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape_q, shape_k, kw", CASES)
def test_prepared_calls_match_the_general_path(shape_q, shape_k, kw, dtype):
    q, k, v = _arrays(shape_q, shape_k, dtype)
    want_out, want_lse = _general(q, k, v, **kw)
    for _ in range(3):
        out, lse = ft.attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
        assert out.dtype == want_out.dtype and lse.dtype == want_lse.dtype
    for _ in range(2):  # without lse: the same output (a stored step's own, reshaped or not)
        out = ft.attention(q, k, v, **kw)
        np.testing.assert_array_equal(out, want_out)
        assert out.dtype == want_out.dtype and out.shape == want_out.shape


@pytest.mark.parametrize("tq", [1, 24])
def test_a_growing_cache_plans_each_key_count(tq):
    """A decoding loop's key count changes every step: each is planned, none
    reuses another's plan."""
    q, k, v = _arrays((1, 4, tq, 16), (1, 4, 700, 16), np.float32, seed=3)
    for tk in (600, 601, 600, 650, 601):
        got = ft.attention(q, k[:, :, :tk].copy(), v[:, :, :tk].copy(), causal=True)
        want = _general(q, k[:, :, :tk].copy(), v[:, :, :tk].copy(), causal=True)[0]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "shape_q, shape_k", [((1, 4, 16, 8), (1, 4, 16, 8)), ((1, 4, 1, 8), (1, 4, 900, 8))]
)
def test_values_that_need_float64_take_it_on_a_prepared_key(shape_q, shape_k):
    """The work dtype reads the values: a prepared float32 key still sends
    scores past float32's range to float64 (forward), or computes the step
    again in float64 (decode-shaped)."""
    q, k, v = _arrays(shape_q, shape_k, np.float32, seed=5)
    for _ in range(3):
        ft.attention(q, k, v)
    huge_q, huge_k = q * np.float32(1e19), k * np.float32(1e19)
    got, lse = ft.attention(huge_q, huge_k, v, return_lse=True)
    want, want_lse = _general(huge_q, huge_k, v)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse, want_lse)
    ref = ft.naive_attention(*(a.astype(np.float64) for a in (huge_q, huge_k, v)))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # and the prepared step still serves ordinary values afterwards
    np.testing.assert_array_equal(ft.attention(q, k, v), _general(q, k, v)[0])


def test_bf16_products_past_float32_are_widened_on_a_prepared_key():
    """bf16 tile products sum ``q . k`` before the scale: a prepared bf16 key
    whose values put those sums past float32's range (the scores, at a tiny
    scale, stay inside it) is widened to float32 products, as a first call is."""
    from flashtile.planning import bf16_products

    if not bf16_products(BF16):
        pytest.skip("no bf16 products here: a bf16 step is widened from the start")
    q, k, v = _arrays((1, 2, 16, 8), (1, 2, 16, 8), BF16, seed=6)
    for _ in range(3):
        ft.attention(q, k, v, scale=1e-20)
    key = call_keys.plain_key(q, k, v, False, 1e-20, False, None, None, {})
    assert frontdoor.prepared(key).steps[16].work == BF16  # a step of bf16 products was stored
    huge_q, huge_k = (a * BF16.type(1e19) for a in (q, k))
    got, lse = ft.attention(huge_q, huge_k, v, scale=1e-20, return_lse=True)
    want, want_lse = _general(huge_q, huge_k, v, scale=1e-20)
    assert np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize(
    "keywords, error",
    [
        ({"causal": 1}, TypeError),
        ({"scale": True}, TypeError),
        ({"scale": float("nan")}, ValueError),
        ({"window": (2.5, 0)}, TypeError),
        ({"window": (2, 0, 1)}, ValueError),
        ({"softcap": -1.0}, ValueError),
        ({"return_lse": 1}, TypeError),
        ({"block_q": 0}, ValueError),
        ({"windw": (2, 0)}, TypeError),
    ],
)
def test_a_prepared_key_never_skips_a_check(keywords, error):
    q, k, v = _arrays((1, 2, 9, 4), (1, 2, 9, 4), np.float32, seed=7)
    for _ in range(3):
        ft.attention(q, k, v, causal=True, window=(2, 0), softcap=5.0, block_q=4)
    with pytest.raises(error):
        ft.attention(q, k, v, **{"causal": True, "window": (2, 0), **keywords})
    with pytest.raises(error):  # also on a second try (nothing was stored)
        ft.attention(q, k, v, **{"causal": True, "window": (2, 0), **keywords})


def test_bad_arrays_on_a_prepared_key_are_refused():
    q, k, v = _arrays((1, 2, 9, 4), (1, 2, 9, 4), np.float32, seed=8)
    for _ in range(3):
        ft.attention(q, k, v)
    with pytest.raises(ValueError, match="keys but v has"):
        ft.attention(q, k, v[:, :, :5])
    with pytest.raises(TypeError, match="share one dtype"):
        ft.attention(q, k, v.astype(np.float64))
    with pytest.raises(ValueError, match="Tk is 0"):
        ft.attention(q, k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("shape_q, shape_k, kw", CASES[:4])
def test_the_backward_reuses_its_forwards_check(monkeypatch, shape_q, shape_k, kw):
    """attention_backward after attention(..., return_lse=True) takes the forward's
    prepared record (no check runs: the check is made to fail) and gives exactly the
    gradients of a checked call; bad out, lse or dout are still refused."""
    q, k, v = _arrays(shape_q, shape_k, np.float32, seed=3)
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    dout = np.random.default_rng(4).standard_normal(out.shape).astype(np.float32)
    causal, scale = kw.get("causal", False), kw.get("scale")
    rest = {n: x for n, x in kw.items() if n not in ("causal", "scale")}
    want = ft.api._backward(check_call(q, k, v, causal, scale, rest), out, lse, dout, None, None)
    monkeypatch.setattr(ft.api, "check_call", lambda *a: pytest.fail("checked again"))
    for _ in range(2):
        got = ft.attention_backward(q, k, v, out, lse, dout, **kw)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="dout has shape"):
        ft.attention_backward(q, k, v, out, lse, dout[..., :1, :], **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape_q, shape_k, kw", CASES[:3])
def test_a_repeated_backward_runs_its_stored_plan(monkeypatch, shape_q, shape_k, kw, dtype):
    """The backward of a prepared key plans its key count once, then runs the
    stored plan on each call's arrays, with exactly the gradients of a checked
    call; once a route moves it is planned again. Values whose bound passes
    float32's range on that key (a huge entry of q and one of k in dims the
    other leaves at zero: ordinary scores, float64 work) are planned again,
    and the stored plan serves ordinary values after them."""
    from flashtile import routes

    q, k, v = _arrays(shape_q, shape_k, dtype, seed=6)
    causal, scale = kw.get("causal", False), kw.get("scale")
    rest = {n: x for n, x in kw.items() if n not in ("causal", "scale")}
    planned = []
    plan = ft.gradients.plan_backward
    monkeypatch.setattr(ft.gradients, "plan_backward", lambda *a: planned.append(a) or plan(*a))

    def both(q, k, move=False):  # three prepared backwards, each against a checked call's
        out, lse = ft.attention(q, k, v, return_lse=True, **kw)
        call = check_call(q, k, v, causal, scale, rest)
        rngs = map(np.random.default_rng, (7, 8, 9))
        douts = [rng.standard_normal(out.shape).astype(dtype) for rng in rngs]
        wants = [ft.api._backward(call, out, lse, dout, None, None) for dout in douts]
        del planned[:]
        if move:
            routes.moved()
        for dout, want in zip(douts, wants, strict=True):
            got = ft.attention_backward(q, k, v, out, lse, dout, **kw)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        return len(planned)

    both(q, k)
    assert both(q, k) == 0  # (the first calls stored it)
    assert both(q, k, move=True) == 1
    if dtype in (np.float32, BF16):  # (the work dtype of float64 and float16 reads no values)
        wide_q, wide_k = q.copy(), k.copy()
        wide_q[..., 0], wide_k[..., 1] = 0, 0
        wide_q[..., 0, 1], wide_k[..., 0, 0] = 1e19, 1e19
        assert both(wide_q, wide_k) == 3  # planned again on each call, in float64
        assert both(q, k) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16], ids=str)
def test_prepared_decode_attention_matches_the_general_path(dtype):
    q, k, v = _arrays((2, 8, 1, 16), (2, 2, 300, 16), dtype, seed=9)
    want = [ft.decode_attention(q, k, v, num_splits=3, return_lse=True, window=(50, 0))]
    frontdoor._PREPARED.clear()  # the general path again, for reference
    for _ in range(3):
        out, lse = ft.decode_attention(q, k, v, num_splits=3, return_lse=True, window=(50, 0))
        np.testing.assert_array_equal(out, want[0][0])
        np.testing.assert_array_equal(lse, want[0][1])
    # a float32 step whose scores overflow is computed again in float64, prepared or not
    for _ in range(3):  # without lse too: the stored step's own output
        out = ft.decode_attention(q, k, v, num_splits=3, window=(50, 0))
        np.testing.assert_array_equal(out, want[0][0])
        assert out.dtype == want[0][0].dtype
    if dtype == np.float32:
        huge = q * np.float32(1e19), k * np.float32(1e19)
        ref = ft.naive_attention(*(a.astype(np.float64) for a in (*huge, v)))[0]
        for _ in range(3):  # the first call, then its stored step's retry: cast back
            got = ft.decode_attention(*huge, v)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
            assert got.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_decode_attention_with_lengths_checks_its_values_on_every_call(monkeypatch, paged, dtype):
    """Calls with ``cache_seqlens`` (and a ``block_table``) of one key check
    their keywords once (a spy on decode_variants), then only the values:
    lengths that change per call give the general path's results bit for bit,
    and bad lengths or table entries get the general path's errors. A second
    cache of the same metadata with the same lengths (a model's next layer)
    reuses the plan (decode_planning.LengthsPlan), which keeps no cache alive."""
    import gc
    import weakref

    from flashtile import decode as decode_module
    from flashtile import decode_planning

    frontdoor._PREPARED.clear()
    resolved, planned = [], []
    variants = decode_module.decode_variants
    monkeypatch.setattr(
        decode_module, "decode_variants", lambda *a, **kw: resolved.append(1) or variants(*a, **kw)
    )
    plan = decode_planning.plan_decode
    monkeypatch.setattr(decode_planning, "plan_decode", lambda *a: planned.append(1) or plan(*a))
    q, k, v = _arrays((2, 4, 1, 16), (2, 2, 64, 16), dtype, seed=3)
    kw = {"window": (20, 0), "return_lse": True}
    if paged:  # pages of 8 keys, shuffled
        k, v = (
            x.reshape(2, 2, 8, 8, -1).transpose(0, 2, 1, 3, 4).reshape(16, 2, 8, -1) for x in (k, v)
        )
        order = np.random.default_rng(4).permutation(16)
        k, v = np.ascontiguousarray(k[order]), np.ascontiguousarray(v[order])
        kw["block_table"] = np.argsort(order).reshape(2, 8)
    k2, v2 = (np.ascontiguousarray(x[::-1]) for x in (k, v))  # (another layer's cache)
    for lengths in ([64, 5], [17, 64], [1, 33]):
        kw["cache_seqlens"] = np.array(lengths)
        for kc, vc in ((k2, v2), (k, v)):
            out, lse = ft.decode_attention(q, kc, vc, **kw)
            saved = dict(frontdoor._PREPARED)
            frontdoor._PREPARED.clear()
            want = ft.decode_attention(q, kc, vc, **kw)  # the general path
            frontdoor._PREPARED.update(saved)
            np.testing.assert_array_equal(out, want[0])
            np.testing.assert_array_equal(lse, want[1])
    assert len(resolved) == 7  # the first call, and the general path's six
    assert len(planned) == 3  # once per lengths (the first call plans on the general path)
    gone = weakref.ref(k2)
    del k2, v2, kc, vc
    gc.collect()
    assert gone() is None
    kw["cache_seqlens"] = np.array([65, 0])
    with pytest.raises(ValueError, match="cache_seqlens must lie"):
        ft.decode_attention(q, k, v, **kw)
    if paged:
        kw["cache_seqlens"], kw["block_table"] = np.array([64, 3]), kw["block_table"] + 16
        with pytest.raises(ValueError, match="is not a page of the cache"):
            ft.decode_attention(q, k, v, **kw)
    assert len(resolved) == 7


def test_prepared_records_are_bounded():
    frontdoor._PREPARED.clear()
    q, k, v = _arrays((1, 1, 3, 4), (1, 1, 3, 4), np.float32)
    for i in range(frontdoor.PREPARED_MAX + 5):
        ft.attention(q, k, v, scale=0.1 + i)
    assert 0 < len(frontdoor._PREPARED) <= frontdoor.PREPARED_MAX


def test_a_prepared_bf16_step_follows_a_switched_route(monkeypatch):
    """Whether bf16 inputs get bf16 products is the ``bf16`` route's answer,
    which can change at run time (forced here): a step planned for the other
    answer is planned again (NumPy API, decode_attention and the torch operator)."""
    from flashtile import routes
    from flashtile.cpu import blas

    monkeypatch.setattr(blas, "bf16_features", lambda: ("avx512bf16",))  # as on such a CPU
    if blas.bf16_available() == ("widen",):
        pytest.skip("no bf16 gemm here (neither AVX512-BF16 nor oneMKL)")
    q, k, v = _arrays((1, 4, 32, 16), (1, 4, 32, 16), BF16, seed=11)
    qd, kd, vd = _arrays((1, 4, 1, 16), (1, 4, 600, 16), BF16, seed=12)
    with routes.force("bf16", blas.bf16_available()[0]):
        first = [ft.attention(q, k, v) for _ in range(3)]
        for _ in range(3):
            ft.decode_attention(qd, kd, vd)
        with routes.force("bf16", "widen"):
            np.testing.assert_array_equal(ft.attention(q, k, v), _general(q, k, v)[0])
            for _ in range(2):  # widened now, as the general path (which raised before)
                got = ft.decode_attention(qd, kd, vd).astype(np.float32)
                want = _general(qd, kd, vd, causal=True)[0].astype(np.float32)
                np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(ft.attention(q, k, v), first[0])


@pytest.mark.parametrize("which", ["k", "v"])
def test_one_key_with_a_short_row_stride(which):
    """NumPy calls an array C-contiguous whatever the stride of a size-1 axis:
    a single key from ``swapaxes`` has a row stride shorter than its row,
    which BLAS refuses as a leading dimension (and then skips the product)."""
    q, k, v = _arrays((1, 2, 4, 16), (1, 2, 1, 16), np.float32, seed=13)
    a = {"k": k, "v": v}[which]
    odd = a.reshape(1, 2, a.shape[-1], 1).swapaxes(-1, -2)
    assert odd.flags.c_contiguous and odd.strides[-2] < a.shape[-1] * odd.itemsize
    args = (q, odd, v) if which == "k" else (q, k, odd)
    got, lse = ft.attention(*args, return_lse=True)
    want, want_lse = ft.attention(*(a.copy() for a in args), return_lse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_the_decode_retry_bounds_the_callers_queries():
    """A float16 step whose retry question is raised (an inf query) answers it
    from the float16 queries on every call, prepared or not."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((1, 8, 1, 16)) * 0.01).astype(np.float16)
    q[0, 0, 0, 0] = np.inf
    k = (rng.standard_normal((1, 8, 1024, 16)) * 0.01).astype(np.float16)
    v = rng.standard_normal((1, 8, 1024, 16)).astype(np.float16)
    kw = {"scale": 1e28, "softcap": 30.0}
    with np.errstate(all="ignore"):
        want = _general(q, k, v, **kw)
        for _ in range(3):
            got = ft.attention(q, k, v, return_lse=True, **kw)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        runs = [ft.decode_attention(q, k, v, causal=False, return_lse=True, **kw) for _ in range(3)]
    for out, lse in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(lse, runs[0][1])

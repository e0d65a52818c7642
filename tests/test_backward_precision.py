"""The backward's precision rule (flashtile/gradients.py, precision.py): the
right gradients or a clear error, never silently wrong ones.

The whole sweep (scores from 1 to 1e30, three dtypes, three head dims, two
score shapes, with and without padded rows) is ``python -m
tests.precision_sweep``; a slice of it runs here.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import flashtile
from dense import dense_extended, rel_err
from flashtile.frontdoor import check_call
from flashtile.gradients import check_gradient_inputs, kernel_gradients
from flashtile.precision import GRADIENT_TOLERANCE, gradients_unreliable
from precision_sweep import judge

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("shape", ["peaked", "offset"])
def test_sweep_slice_is_right_or_refused(dtype, shape):
    verdicts = {}
    for d, mag, padded in [(4, 5e6, False), (64, 1e4, True), (64, 1e12, False), (4, 1e30, True)]:
        verdict, detail = judge(dtype, d, mag, shape, padded)
        verdicts[(d, mag, padded)] = (verdict, detail)
    fine = ("right", "refused", "ill-conditioned", "n/a")  # (precision_sweep.py)
    bad = {key: v for key, v in verdicts.items() if v[0] not in fine}
    assert not bad, bad


def _problem(dtype=np.float32, offset=0.0, seed=0, shape=(2, 3, 19, 8), tk=27):
    rng = np.random.default_rng(seed)
    b, h, tq, d = shape
    q, k, v = (rng.standard_normal((b, h, t, d)) for t in (tq, tk, tk))
    if offset:  # every score raised by offset, the softmax still spread
        q[..., 0] = k[..., 0] = np.sqrt(offset * np.sqrt(d))
    dout = rng.standard_normal((b, h, tq, d))
    return [a.astype(dtype) for a in (q, k, v, dout)]


def _reference(q, k, v, dout, **kw):
    """float64 gradients of the same (float32-valued) inputs by flashtile itself."""
    wide = [a.astype(np.float64) for a in (q, k, v)]
    out, lse = flashtile.attention(*wide, return_lse=True, **kw)
    return flashtile.attention_backward(*wide, out, lse, dout.astype(np.float64), **kw)


def test_the_issue_case_float32_d4_lse_5e6():
    """float32, d = 4, |lse| about 5e6: dv was 31% off with no warning."""
    q, k, v, dout = _problem(offset=5e6, shape=(1, 2, 9, 4))
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    assert np.abs(lse).max() > 4e6
    got = flashtile.attention_backward(q, k, v, out, lse, dout)
    for g, r in zip(got, _reference(q, k, v, dout), strict=True):
        assert g.dtype == np.float32
        assert rel_err(g, r) < 1e-6


def test_the_rule_fails_the_float32_kernel_there_and_not_on_ordinary_scores():
    for offset, unreliable in ((0.0, False), (100.0, False), (5e3, True), (5e6, True)):
        q, k, v, dout = _problem(offset=offset)
        out, lse = flashtile.attention(q, k, v, return_lse=True)
        call = check_call(q, k, v, False, None, {})
        g = kernel_gradients(call, *check_gradient_inputs(call, out, lse, dout))
        assert gradients_unreliable(g.sums, lse, dout, None) is unreliable, offset
        if not unreliable:  # ordinary rows: their P sum to 1 well within the tolerance
            assert np.abs(g.sums - 1).max() < GRADIENT_TOLERANCE / 10


def test_an_lse_below_the_scores_is_caught():
    """The sums catch what no bound on |lse| can: an lse 1e-2 below the
    scores' (another call's, or rounded down) would put every P 1% high; the
    float64 forward gives the right gradients instead."""
    q, k, v, dout = _problem()
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    got = flashtile.attention_backward(q, k, v, out, lse - np.float32(1e-2), dout)
    for g, r in zip(got, _reference(q, k, v, dout), strict=True):
        assert rel_err(g, r) < 1e-6


def test_a_block_of_a_longer_row_gets_its_share_or_a_clear_error():
    """A block's keys recomputed from the whole row's out and lse (how ring
    attention is built) sum to its share of the row: accepted, and the
    block's gradients add up to the whole call's. With scores float32
    cannot resolve, the float64 forward of the block alone would not be the
    share: refused, naming the fix."""
    for offset, refused in ((0.0, False), (5e3, True)):
        q, k, v, dout = _problem(offset=offset, tk=30)
        out, lse = flashtile.attention(q, k, v, return_lse=True)
        whole = flashtile.attention_backward(q, k, v, out, lse, dout)
        halves = (slice(0, 13), slice(13, 30))
        if refused:
            with pytest.raises(ValueError, match=r"a block's share.*float64"):
                flashtile.attention_backward(q, k[:, :, :13], v[:, :, :13], out, lse, dout)
            continue
        parts = [
            flashtile.attention_backward(q, k[:, :, h], v[:, :, h], out, lse, dout) for h in halves
        ]
        assert rel_err(parts[0][0] + parts[1][0], whole[0]) < 1e-5
        for n in (1, 2):
            assert rel_err(np.concatenate([p[n] for p in parts], axis=2), whole[n]) < 1e-6


def test_an_lse_past_float32_is_recomputed():
    """Scores past float32's range: the forward runs in float64 and returns
    lse = inf in float32 (the policy); P recomputed from it would be 0 and
    the gradients silently zero."""
    q, k, v, dout = _problem(shape=(1, 2, 5, 4), tk=7)
    q, k = np.abs(q), np.abs(k)  # every score positive, and past float32's range
    scale = 1e39
    with np.errstate(over="ignore"):
        out, lse = flashtile.attention(q, k, v, scale=scale, return_lse=True)
    assert np.isposinf(lse).all()
    got = flashtile.attention_backward(q, k, v, out, lse, dout, scale=scale)
    ref = _reference(q, k, v, dout, scale=scale)
    assert rel_err(got[2], ref[2]) < 1e-6  # dv: the one-hot routing of dout
    assert np.array_equal(got[2] != 0, ref[2] != 0)


def test_zero_dout_rows_add_exact_zeros_in_float64_too():
    """Rows a loss leaves out (zero dout) may hold any lse: P is capped at
    2**127 (float64 now as float32), so they add exact zeros, never inf * 0."""
    q, k, v, dout = _problem(np.float64)
    dout[:, :, -4:] = 0.0
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    off = lse.copy()
    off[:, :, -4:] -= 5000.0  # P = exp(5000) in those rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = flashtile.attention_backward(q, k, v, out, off, dout)
    for g, r in zip(got, flashtile.attention_backward(q, k, v, out, lse, dout), strict=True):
        assert np.array_equal(g, r)


def test_a_backward_float64_cannot_compute_is_refused_with_the_fix():
    q, k, v, dout = _problem(offset=1e15)
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"even in float64.*-inf or a bool mask"):
        flashtile.attention_backward(q, k, v, out, lse, dout)


def test_padded_rows_hidden_by_huge_additive_values_run_as_before():
    """Rows hidden by -1e9 with zero dout (a padded batch) stay on the float32
    path and match the dense formula; with a nonzero dout they are computed
    in float64, right too."""
    q, k, v, dout = _problem(shape=(1, 2, 11, 8), tk=13)
    mask = np.zeros((11, 13), np.float32)
    mask[-3:] = -1e9
    for zero in (True, False):
        dout_ = dout.copy()
        if zero:
            dout_[:, :, -3:] = 0.0
        out, lse = flashtile.attention(q, k, v, mask=mask, return_lse=True)
        got = flashtile.attention_backward(q, k, v, out, lse, dout_, mask=mask)
        ref = dense_extended(q, k, v, dout_, mask=mask)[2:5]
        for g, r in zip(got, ref, strict=True):
            assert rel_err(g, r) < 1e-5


def test_sinks_with_scores_past_float32():
    q, k, v, dout = _problem(offset=5e3, shape=(1, 2, 7, 8), tk=9)
    sinks = np.array([5e3 + 1.0, -2.0], np.float32)
    out, lse = flashtile.attention(q, k, v, sinks=sinks, return_lse=True)
    got = flashtile.attention_backward(q, k, v, out, lse, dout, sinks=sinks)
    ref = dense_extended(*(a.astype(np.float64) for a in (q, k, v, dout)), sinks=sinks)
    grads = ref[2:5] + (ref[-1],)
    for g, r in zip(got, grads, strict=True):
        assert rel_err(g, r) < 1e-5


def test_float16_gradients_past_65504_are_inf_without_a_warning():
    q, k, v, dout = _problem(np.float16, shape=(1, 1, 16, 4), tk=3)
    dout[:] = 6e4  # dv sums 16 rows of it
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dv = flashtile.attention_backward(q, k, v, out, lse, dout)[2]
    assert np.isinf(dv).any() and dv.dtype == np.float16


def test_scores_whose_products_cancel_are_not_taken_for_a_share():
    """q.k = 1000*1000 - 1000*994 + ...: the float32 forward's lse sits above
    the exact one by the products' rounding (4e-3 at |lse| 1500), which is
    not a longer row's: computed in float64, not refused."""
    rng = np.random.default_rng(2)
    q, k = np.zeros((1, 1, 32, 16)), np.zeros((1, 1, 32, 16))
    q[..., 0] = q[..., 1] = 1000.0
    k[..., 0], k[..., 1] = 1000.0 + rng.uniform(0, 0.01, 32), -994.0
    q[..., 2:], k[..., 2:] = (rng.standard_normal((1, 1, 32, 14)) for _ in range(2))
    v, dout = (rng.standard_normal((1, 1, 32, 16)) for _ in range(2))
    q, k, v, dout = (a.astype(np.float32) for a in (q, k, v, dout))
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    got = flashtile.attention_backward(q, k, v, out, lse, dout)
    for g, r in zip(got, _reference(q, k, v, dout), strict=True):
        assert rel_err(g, r) < 1e-6


def test_a_float32_lse_rounded_up_for_float64_inputs_is_caught():
    """float64 work with an lse given in float32 (rounded up everywhere, by up
    to 8e-3 at |lse| 1e5): the sums cannot see it (a share sums below 1
    too), the lse's resolution can."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 1, 16, 8)) for _ in range(4))
    q *= 0.01
    q[..., 0], k[..., 0] = 3e4, 10 + 0.001 * rng.standard_normal((1, 1, 16))
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    up = lse.astype(np.float32)
    low = up.astype(np.float64) < lse
    up[low] = np.nextafter(up[low], np.float32(np.inf))
    got = flashtile.attention_backward(q, k, v, out, up, dout)
    for g, r in zip(got, flashtile.attention_backward(q, k, v, out, lse, dout), strict=True):
        assert rel_err(g, r) < 1e-9


def test_softcap_gradients_where_tanh_saturates():
    """Scores 7-9 times the cap: 1 - tanh^2 is 1e-6..6e-8 there, and
    float32's 1 - t*t cancelled to 0 (dq 90% off); the kernels' derivative
    does not cancel."""
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((1, 2, 12, 8)) for _ in range(4))
    q[..., 0], k[..., 0] = 3.0, 8.0 + 0.3 * rng.standard_normal((1, 2, 12))
    q, k, v, dout = (a.astype(np.float32) for a in (q, k, v, dout))
    kw = {"softcap": 1.0, "scale": 1.0 / 3.0}
    out, lse = flashtile.attention(q, k, v, return_lse=True, **kw)
    got = flashtile.attention_backward(q, k, v, out, lse, dout, **kw)
    ref = dense_extended(*(a.astype(np.float64) for a in (q, k, v, dout)), **kw)[2:5]
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-4


@pytest.mark.parametrize("lse_dtype", [np.float32, np.float64, np.float16, BF16], ids=str)
@pytest.mark.parametrize("work", [np.float32, np.float64])
def test_the_quick_pass_of_the_rule_never_hides_a_failing_row(work, lse_dtype):
    """``gradients_unreliable``'s three-reduction pass (no sinks) answers
    "reliable" only where ``failing_rows`` finds no row: rows with sums past
    1, NaN, +-inf and large ``lse`` values (some a step either side of the
    rule's rounding limits, 512 and 1024), each alone among ordinary rows."""
    from flashtile.precision import _no_row_fails, failing_rows

    rng = np.random.default_rng(0)
    edges = [x * f for x in (512.0, 1024.0) for f in (1 - 2**-10, 1.0, 1 + 2**-10)]
    specials = [np.nan, np.inf, -np.inf, 1e3, -1e3, 1e6, 1e300, 0.0, *edges]
    tol = GRADIENT_TOLERANCE
    lse_dtype = np.dtype(lse_dtype).type
    for trial in range(200):
        sums = (1.0 - rng.random((2, 3, 5)) * tol * 2).astype(work)
        lse = (rng.standard_normal((2, 3, 5)) * 30).astype(lse_dtype)
        lse[0, 0, 0] = lse_dtype(-edges[trial % len(edges)])  # (large, and answered by the rule)
        where = tuple(rng.integers(0, n) for n in sums.shape)
        if trial % 2:
            with np.errstate(over="ignore"):  # (1e300 in float32: inf)
                lse[where] = lse_dtype(specials[trial // 2 % len(specials)])
        else:
            sums[where] = work([np.nan, 1.0 + 2 * tol, 0.0, np.inf][trial // 2 % 4])
        with np.errstate(over="ignore"):
            fails = bool(failing_rows(np, sums, lse, None).any())
        if _no_row_fails(sums, lse):
            assert not fails, (sums[where], lse[where])
    ordinary = np.ones((2, 3), work), np.zeros((2, 3), lse_dtype)
    assert _no_row_fails(*ordinary)  # (the pass does answer, on ordinary rows)


@pytest.mark.parametrize("lse_dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("work", [np.float32, np.float64])
def test_the_compiled_extremes_are_numpys(work, lse_dtype):
    """The quick pass's compiled reductions give NumPy's ``fmin``/``fmax`` of
    ``lse`` cast to the sums' dtype and of the sums: NaN left out, NaN when
    every entry is one, infinities kept, a float64 ``lse`` past float32's
    range an infinity."""
    from flashtile.cpu.bounds import rule_extremes

    rng = np.random.default_rng(1)
    for trial in range(60):
        lse = (rng.standard_normal(7) * 10).astype(lse_dtype)
        sums = rng.random(7).astype(work)
        picks = rng.integers(0, 7, size=1 + trial % 4)  # (NaN among finite entries too)
        lse[picks] = [np.nan, np.inf, -np.inf, 1e300 if lse_dtype == np.float64 else 1e30][
            trial % 4
        ]
        sums[picks] = np.nan
        if trial % 7 == 0:
            lse[:], sums[:] = np.nan, np.nan
        with np.errstate(over="ignore"):
            wide = lse.astype(work)
        want = (np.fmin.reduce(wide), np.fmax.reduce(wide), np.fmax.reduce(sums))
        np.testing.assert_array_equal(rule_extremes(lse, sums), np.array(want, np.float64))

"""Dense and online softmax: the exercise's examples, invariances and edge cases."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dense import rel_err
from flashtile import online_softmax, online_softmax_normalizer, softmax
from flashtile.reference import online_softmax_steps


def direct_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax of a 1-D float64 row, straight from the definition (stable)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def split(x: np.ndarray, cuts) -> list[np.ndarray]:
    return np.split(x, sorted(cuts))


# --- the exercise's worked examples, to the printed digits -------------------------


def test_worked_example_large_logits():
    got = online_softmax(np.array([1000.0, 1001.0, 1002.0]), 2)
    np.testing.assert_array_equal(np.round(got, 4), [0.09, 0.2447, 0.6652])


def test_worked_example_rising_max():
    got = online_softmax(np.array([0.0, 1.0, 5.0, 2.0, 9.0]), 2)
    np.testing.assert_array_equal(np.round(got, 4), [0.0001, 0.0003, 0.018, 0.0009, 0.9807])


# --- online_softmax -----------------------------------------------------------------


@given(
    x=hnp.arrays(
        np.float64,
        st.integers(1, 40),
        elements=st.floats(-100, 100, allow_nan=False, allow_infinity=False),
    ),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_online_softmax_block_size_invariance(x, data):
    n = x.size
    divisors = [b for b in range(1, n + 1) if n % b == 0]
    non_divisors = [b for b in range(2, n) if n % b != 0]
    choices = [1, data.draw(st.sampled_from(divisors)), n + data.draw(st.integers(1, 5))]
    if non_divisors:
        choices.append(data.draw(st.sampled_from(non_divisors)))
    ref = direct_softmax(x)
    for block_size in choices:
        got = online_softmax(x, block_size)
        assert got.shape == x.shape
        assert rel_err(got, ref) < 1e-13, block_size
        assert abs(got.sum() - 1.0) < 1e-12


@pytest.mark.parametrize("block_size", [1, 3, 4, 12, 50])
def test_online_softmax_sums_to_one_and_matches_definition(rng, block_size):
    x = rng.normal(scale=5.0, size=12)
    got = online_softmax(x, block_size)
    assert abs(got.sum() - 1.0) < 1e-14
    assert rel_err(got, direct_softmax(x)) < 1e-14


@pytest.mark.parametrize("offset", [1e3, 1e4, -1e4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_online_softmax_huge_logits_do_not_overflow(rng, offset, dtype):
    shape_part = rng.normal(size=9)
    x = (offset + shape_part).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = online_softmax(x, 4)
    assert np.all(np.isfinite(got))
    # Exact reference on the values actually passed in (after rounding to dtype).
    ref = direct_softmax(x.astype(np.float64))
    tol = 1e-13 if dtype == np.float64 else 1e-5
    assert rel_err(got, ref) < tol


def test_online_softmax_rows_are_independent(rng):
    x = rng.normal(size=(3, 4, 10)) * 3
    got = online_softmax(x, 3)
    for idx in np.ndindex(3, 4):
        assert rel_err(got[idx], direct_softmax(x[idx])) < 1e-14


def test_online_softmax_all_neg_inf_row_gives_zeros():
    x = np.array([[-np.inf, -np.inf, -np.inf, -np.inf, -np.inf], [0.0, 1.0, 2.0, 3.0, 4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = online_softmax(x, 2)
    np.testing.assert_array_equal(got[0], np.zeros(5))
    assert rel_err(got[1], direct_softmax(x[1])) < 1e-14


def test_an_empty_axis_gives_an_empty_softmax_both_ways():
    # softmax raised NumPy's "zero-size array to reduction operation maximum"
    # where online_softmax returned the empty result.
    for x in (np.array([]), np.zeros((3, 0))):
        np.testing.assert_array_equal(softmax(x), x)
        np.testing.assert_array_equal(online_softmax(x, 2), x)


def test_online_softmax_partially_masked_row():
    x = np.array([-np.inf, -np.inf, 1.0, -np.inf, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = online_softmax(x, 2)
    expected = np.zeros(5)
    expected[[2, 4]] = direct_softmax(np.array([1.0, 3.0]))
    assert got[0] == got[1] == got[3] == 0.0
    assert rel_err(got, expected) < 1e-14


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_online_softmax_keeps_dtype(rng, dtype):
    x = rng.normal(size=11).astype(dtype)
    got = online_softmax(x, 4)
    assert got.dtype == dtype
    tol = {np.float16: 5e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype]
    assert rel_err(got, direct_softmax(x.astype(np.float64))) < tol


@pytest.mark.parametrize("block_size", [1, 7, 64, 4096])
def test_online_softmax_float16_long_row_any_block_size(block_size):
    # DESIGN.md: the running state accumulates in float32 for 16-bit inputs. A float16
    # running sum stalls at 2048 (its spacing there is 2), which would give 4096 equal
    # logits a weight of 1/2048 each instead of 1/4096 (exactly representable).
    x = np.zeros(4096, dtype=np.float16)
    got = online_softmax(x, block_size)
    assert got.dtype == np.float16
    assert rel_err(got, np.full(4096, 1.0 / 4096)) < 2.0**-11


@pytest.mark.parametrize("block_size", [1, 5, 3000])
def test_online_softmax_float16_random_row_any_block_size(rng, block_size):
    x = rng.normal(size=3000).astype(np.float16)
    got = online_softmax(x, block_size)
    # Only the final rounding to float16 (unit roundoff 2**-11) should remain.
    assert rel_err(got, direct_softmax(x.astype(np.float64))) < 2 * 2.0**-11


# --- online_softmax_normalizer and the step trace ----------------------------------


@given(
    x=hnp.arrays(
        np.float64,
        st.integers(1, 30),
        elements=st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
    ),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_normalizer_matches_dense_for_random_splits(x, data):
    cuts = data.draw(st.lists(st.integers(0, x.size), max_size=6))
    m, ell = online_softmax_normalizer(split(x, cuts))
    assert m == x.max()
    expected = np.sum(np.exp(x - x.max()))
    assert abs(ell - expected) <= 1e-13 * expected


def test_normalizer_when_max_rises_in_a_later_block():
    blocks = [np.array([0.0, -1.0]), np.array([3.0, 2.0]), np.array([10.0])]
    m, ell = online_softmax_normalizer(blocks)
    row = np.concatenate(blocks)
    assert m == 10.0
    expected = math.fsum(math.exp(s - 10.0) for s in row)
    assert abs(ell - expected) <= 1e-15 * expected
    # Without the rescale, the old sums would be counted at their own origins.
    assert ell < 1.01


def test_normalizer_when_max_is_in_the_first_block():
    blocks = [np.array([10.0, 0.0]), np.array([3.0]), np.array([-5.0, 9.0])]
    m, ell = online_softmax_normalizer(blocks)
    row = np.concatenate(blocks)
    assert m == 10.0
    expected = math.fsum(math.exp(s - 10.0) for s in row)
    assert abs(ell - expected) <= 1e-15 * expected


def test_normalizer_of_fully_masked_row():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m, ell = online_softmax_normalizer([np.full(3, -np.inf), np.full(2, -np.inf)])
    assert m == -np.inf
    assert ell == 0.0


def test_normalizer_float16_blocks_do_not_stall():
    # Same precision rule for the normaliser: 4096 zero logits have ell = 4096 exactly,
    # but a float16 running sum cannot get past 2048 one unit at a time.
    m, ell = online_softmax_normalizer([np.zeros(1, dtype=np.float16)] * 4096)
    assert m == 0.0
    assert ell == 4096.0


def test_steps_trace_rising_max():
    x = np.array([0.0, 1.0, 5.0, 2.0, 9.0])
    steps = list(online_softmax_steps([x[0:2], x[2:4], x[4:5]]))
    assert [s.m_new for s in steps] == [1.0, 5.0, 9.0]
    assert [s.m_old for s in steps] == [-np.inf, 1.0, 5.0]
    assert [s.block_max for s in steps] == [1.0, 5.0, 9.0]
    assert [s.index for s in steps] == [0, 1, 2]
    expected_rescale = [0.0, math.exp(1.0 - 5.0), math.exp(5.0 - 9.0)]
    for step, expected in zip(steps, expected_rescale, strict=True):
        assert abs(step.rescale - expected) <= 1e-15
    # The running sum after each block is the dense normaliser of the prefix seen so far.
    for step, stop in zip(steps, [2, 4, 5], strict=True):
        prefix = x[:stop]
        expected_ell = math.fsum(math.exp(s - prefix.max()) for s in prefix)
        assert abs(step.ell - expected_ell) <= 1e-15 * expected_ell


def test_steps_rescale_is_one_when_max_does_not_change():
    steps = list(online_softmax_steps([np.array([4.0, 1.0]), np.array([2.0, 3.0])]))
    assert steps[1].m_old == steps[1].m_new == 4.0
    assert steps[1].rescale == 1.0


# --- dense softmax ------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_matches_direct_formula(rng, axis):
    x = rng.normal(scale=4.0, size=(5, 6, 7))
    got = softmax(x, axis=axis)
    ref = np.apply_along_axis(direct_softmax, axis, x)
    assert got.shape == x.shape
    assert rel_err(got, ref) < 1e-14
    np.testing.assert_allclose(got.sum(axis=axis), 1.0, rtol=1e-14)


def test_softmax_fully_masked_row_is_zero_without_warning():
    x = np.array([[-np.inf, -np.inf], [1.0, -np.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = softmax(x)
    np.testing.assert_array_equal(got, [[0.0, 0.0], [1.0, 0.0]])


def test_softmax_huge_logits(rng):
    x = 1e4 + rng.normal(size=8)
    got = softmax(x)
    assert np.all(np.isfinite(got))
    assert rel_err(got, direct_softmax(x)) < 1e-13

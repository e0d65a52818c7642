"""Backward by recomputation against the dense textbook gradient and finite differences."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dense import dense_attention_backward, rel_err
from flashtile import naive_attention, tiled_attention, tiled_attention_backward


def problem(rng, q_shape, k_shape, v_shape, dtype=np.float64):
    q = rng.normal(size=q_shape).astype(dtype)
    k = rng.normal(size=k_shape).astype(dtype)
    v = rng.normal(size=v_shape).astype(dtype)
    return q, k, v


def tiled_grads(q, k, v, dout, block_size, causal=False, scale=None, fwd_block=None):
    out, lse = tiled_attention(
        q, k, v, fwd_block or block_size, causal=causal, scale=scale, return_lse=True
    )
    return tiled_attention_backward(
        q, k, v, out, lse, dout, block_size=block_size, causal=causal, scale=scale
    )


def assert_grads_close(got, ref, tol):
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < tol, name


# (Tq, Tk, d, dv, block_size): Tq != Tk both ways, dv != d, non-dividing blocks.
GRID = [
    (1, 1, 1, 2, 1),
    (7, 7, 3, 3, 3),
    (7, 7, 1, 4, 8),
    (97, 97, 59, 5, 10),
    (97, 97, 64, 64, 32),
    (1, 7, 3, 2, 2),
    (7, 1, 3, 2, 2),
    (7, 97, 59, 3, 13),
    (97, 7, 64, 3, 3),
    (97, 1, 1, 2, 5),
    (1, 97, 3, 1, 96),
    (1025, 7, 3, 2, 4),
    (7, 1025, 1, 2, 300),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: "Tq{}-Tk{}-d{}-dv{}-b{}".format(*c))
def test_backward_matches_dense_formulas(rng, case, causal):
    tq, tk, d, dv, block_size = case
    q, k, v = problem(rng, (tq, d), (tk, d), (tk, dv))
    dout = rng.normal(size=(tq, dv))
    got = tiled_grads(q, k, v, dout, block_size, causal=causal)
    ref = dense_attention_backward(q, k, v, dout, causal=causal)
    assert_grads_close(got, ref, 1e-10)


def test_backward_with_explicit_scale(rng):
    q, k, v = problem(rng, (2, 9, 4), (2, 6, 4), (2, 6, 3))
    dout = rng.normal(size=(2, 9, 3))
    for scale in (0.05, 1.0, 3.0):
        got = tiled_grads(q, k, v, dout, 4, causal=True, scale=scale)
        ref = dense_attention_backward(q, k, v, dout, causal=True, scale=scale)
        assert_grads_close(got, ref, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "q_lead,kv_lead",
    [((2, 3), (2, 3)), ((2, 3), (1, 3)), ((2, 3), (3,)), ((3,), (2, 3)), ((1, 3), (2, 1))],
)
def test_backward_broadcast_leading_dims(rng, q_lead, kv_lead, causal):
    tq, tk, d, dv = 5, 8, 3, 4
    q, k, v = problem(rng, (*q_lead, tq, d), (*kv_lead, tk, d), (*kv_lead, tk, dv))
    batch = np.broadcast_shapes(q_lead, kv_lead)
    dout = rng.normal(size=(*batch, tq, dv))
    dq, dk, dv_ = tiled_grads(q, k, v, dout, 3, causal=causal)
    assert dq.shape == q.shape
    assert dk.shape == k.shape
    assert dv_.shape == v.shape
    ref = dense_attention_backward(q, k, v, dout, causal=causal)
    assert_grads_close((dq, dk, dv_), ref, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "q_lead,k_lead,v_lead",
    [((1, 3), (2, 1), (1, 3)), ((3,), (2, 1), (2, 3)), ((), (2, 3), (1,)), ((2, 1), (1, 3), (3,))],
)
def test_backward_k_and_v_broadcast_differently(rng, q_lead, k_lead, v_lead, causal):
    q, k, v = problem(rng, (*q_lead, 6, 4), (*k_lead, 9, 4), (*v_lead, 9, 2))
    batch = np.broadcast_shapes(q_lead, k_lead, v_lead)
    dout = rng.normal(size=(*batch, 6, 2))
    got = tiled_grads(q, k, v, dout, 4, causal=causal)
    ref = dense_attention_backward(q, k, v, dout, causal=causal)
    assert_grads_close(got, ref, 1e-10)


def test_backward_broadcast_equals_sum_over_copies(rng):
    """k, v shared across the batch: their gradient is the sum of per-batch gradients."""
    q, k, v = problem(rng, (3, 6, 2), (1, 5, 2), (1, 5, 3))
    dout = rng.normal(size=(3, 6, 3))
    dq, dk, dv = tiled_grads(q, k, v, dout, 2)
    per_batch = [tiled_grads(q[b], k[0], v[0], dout[b], 2) for b in range(3)]
    assert rel_err(dq, np.stack([g[0] for g in per_batch])) < 1e-12
    assert rel_err(dk[0], sum(g[1] for g in per_batch)) < 1e-12
    assert rel_err(dv[0], sum(g[2] for g in per_batch)) < 1e-12


@pytest.mark.parametrize("tq,tk,causal", [(3, 4, False), (3, 4, True), (4, 3, True), (4, 3, False)])
def test_backward_matches_finite_differences(rng, tq, tk, causal):
    d, dv = 2, 3
    q, k, v = problem(rng, (tq, d), (tk, d), (tk, dv))
    g = rng.normal(size=(tq, dv))

    def loss(q_, k_, v_):
        return float(np.sum(naive_attention(q_, k_, v_, causal=causal)[0] * g))

    h = 1e-6
    numeric = []
    for which in range(3):
        args = [q, k, v]
        grad = np.zeros_like(args[which])
        for idx in np.ndindex(*args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += h
            minus[which][idx] -= h
            grad[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        numeric.append(grad)
    got = tiled_grads(q, k, v, g, 2, causal=causal)
    for name, a, n in zip(("dq", "dk", "dv"), got, numeric, strict=True):
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fully_masked_rows_have_zero_gradient(rng, block_size):
    tq, tk = 7, 3
    q, k, v = problem(rng, (2, tq, 3), (2, tk, 3), (2, tk, 2))
    dout = rng.normal(size=(2, tq, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv = tiled_grads(q, k, v, dout, block_size, causal=True)
    for g in (dq, dk, dv):
        assert not np.isnan(g).any()
    np.testing.assert_array_equal(dq[:, : tq - tk], 0.0)
    # Row Tq-Tk sees a single key (softmax of one score has zero gradient); later rows
    # see several keys and get a nonzero gradient.
    assert np.all(dq[:, tq - tk + 1 :] != 0.0)
    ref = dense_attention_backward(q, k, v, dout, causal=True)
    assert_grads_close((dq, dk, dv), ref, 1e-10)
    # The upstream gradient of an empty row must not leak into dk, dv.
    dout_poked = dout.copy()
    dout_poked[:, : tq - tk] = 1e6
    poked = tiled_grads(q, k, v, dout_poked, block_size, causal=True)
    assert_grads_close(poked, (dq, dk, dv), 1e-14)


@given(
    tq=st.integers(1, 16),
    tk=st.integers(1, 16),
    d=st.integers(1, 5),
    dv=st.integers(1, 5),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
@settings(max_examples=30, deadline=None)
def test_backward_block_size_invariance(tq, tk, d, dv, causal, seed, data):
    block_a = data.draw(st.integers(1, tk + 3), label="block_a")
    block_b = data.draw(st.integers(1, tk + 3), label="block_b")
    rng = np.random.default_rng(seed)
    q, k, v = problem(rng, (tq, d), (tk, d), (tk, dv))
    dout = rng.normal(size=(tq, dv))
    # Same forward state; only the backward tiling differs.
    grads_a = tiled_grads(q, k, v, dout, block_a, causal=causal, fwd_block=3)
    grads_b = tiled_grads(q, k, v, dout, block_b, causal=causal, fwd_block=3)
    ref = dense_attention_backward(q, k, v, dout, causal=causal)
    assert_grads_close(grads_a, grads_b, 1e-10)
    assert_grads_close(grads_a, ref, 1e-10)


# Accumulation is in float32 for both; float16 adds the rounding of out and of the
# gradients to float16 (unit roundoff 2**-11), hence a few float16 ulps.
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 4 * 2.0**-11)])
def test_backward_output_dtypes(rng, dtype, tol):
    q, k, v = problem(rng, (2, 9, 4), (2, 11, 4), (2, 11, 3), dtype=dtype)
    dout = rng.normal(size=(2, 9, 3)).astype(dtype)
    dq, dk, dv = tiled_grads(q, k, v, dout, 4, causal=True)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    ref = dense_attention_backward(q, k, v, dout, causal=True)
    assert_grads_close((dq, dk, dv), ref, tol)


def test_backward_float64_dtype(rng):
    q, k, v = problem(rng, (4, 2), (5, 2), (5, 3))
    grads = tiled_grads(q, k, v, rng.normal(size=(4, 3)), 2)
    assert all(g.dtype == np.float64 for g in grads)


# The earlier argument order (q, k, v, out, dout, lse, block_size, causal) still runs,
# with a DeprecationWarning that names the new one.
OLD_ORDER_CALLS = {
    "positional-flags": lambda q, k, v, o, lse, g: ((q, k, v, o, g, lse, 3, True), {}),
    "positional-block": lambda q, k, v, o, lse, g: ((q, k, v, o, g, lse, 3), {"causal": True}),
    "keyword-flags": lambda q, k, v, o, lse, g: (
        (q, k, v, o, g, lse),
        {"block_size": 3, "causal": True},
    ),
    "new-order-positional-block": lambda q, k, v, o, lse, g: (
        (q, k, v, o, lse, g, 3),
        {"causal": True},
    ),
}


@pytest.mark.parametrize("spell", OLD_ORDER_CALLS.values(), ids=OLD_ORDER_CALLS.keys())
def test_old_argument_order_warns_and_gives_the_same_gradients(rng, spell):
    q, k, v = problem(rng, (2, 7, 3), (2, 5, 3), (2, 5, 4))
    dout = rng.normal(size=(2, 7, 4))
    out, lse = tiled_attention(q, k, v, 3, causal=True, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new order warns about nothing
        want = tiled_attention_backward(q, k, v, out, lse, dout, block_size=3, causal=True)
    args, kwargs = spell(q, k, v, out, lse, dout)
    with pytest.warns(
        DeprecationWarning, match=r"call tiled_attention_backward\(q, k, v, out, lse, dout"
    ):
        got = tiled_attention_backward(*args, **kwargs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    ref = dense_attention_backward(q, k, v, dout, causal=True)
    assert_grads_close(got, ref, 1e-10)  # and the right gradients, not merely the same


def test_default_block_size_gives_the_same_gradients(rng):
    q, k, v = problem(rng, (70, 3), (90, 3), (90, 2))
    dout = rng.normal(size=(70, 2))
    out, lse = tiled_attention(q, k, v, 7, return_lse=True)
    got = tiled_attention_backward(q, k, v, out, lse, dout)
    assert_grads_close(got, tiled_attention_backward(q, k, v, out, lse, dout, block_size=7), 1e-12)
    assert_grads_close(got, dense_attention_backward(q, k, v, dout), 1e-10)


@pytest.mark.parametrize(
    ("extra", "kwargs", "match"),
    [
        ((3, True, None), {}, "at most 8 positional arguments, got 9"),
        ((3,), {"block_size": 3}, "both positionally and by keyword"),
        ((3, False), {"causal": True}, "both positionally and by keyword"),
    ],
    ids=["too-many", "block_size-twice", "causal-twice"],
)
def test_old_argument_order_refuses_ambiguous_flags(rng, extra, kwargs, match):
    q, k, v = problem(rng, (5, 3), (6, 3), (6, 2))
    out, lse = tiled_attention(q, k, v, 3, return_lse=True)
    dout = np.ones_like(out)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=match):
        tiled_attention_backward(q, k, v, out, dout, lse, *extra, **kwargs)

"""Attention dropout and attention sinks: the generator, the NumPy API, the oracle.

The fast paths are checked against ``tests/dense.py``'s float64 oracle with
the dropout mask of :func:`flashtile.dropout.keep_mask` and the sink as an
extra softmax column; the NumPy reference (``flashtile.reference``) against
the same oracle and finite differences; the mask's statistics, its
independence from tiles, threads and offsets, and the errors.
"""

from __future__ import annotations

import itertools

import numba
import numpy as np
import pytest

import flashtile
from dense import dense_extended, rel_err
from flashtile.dropout import keep_mask, philox
from flashtile.masks import block_mask
from flashtile.reference.attention import naive_attention, tiled_attention
from flashtile.reference.backward import tiled_attention_backward

SEED = 0x1234_5678_9ABC_DEF0  # both 32-bit halves of the key in use


def _qkv(rng, b, hq, hkv, tq, tk, d, dtype=np.float64):
    shapes = ((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, d))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def _factors(p, shape, seed=SEED, offset=0):
    b, h, tq, tk = shape
    return keep_mask(p, seed, offset, b, h, range(tq), range(tk)) / (1.0 - p)


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # Random123's known-answer vectors for Philox-4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((2**32 - 1,) * 4, (2**32 - 1,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    words = philox(*(np.uint32(x) for x in counter + key))
    assert tuple(int(w) for w in words) == expected


CASES = {  # (b, hq, hkv, tq, tk, d, variants)
    "gqa causal": (2, 4, 2, 37, 53, 16, {}),
    "window softcap alibi": (1, 3, 3, 41, 41, 8, {"window": (5, 3), "softcap": 2.0}),
    "tq > tk, padding": (2, 2, 1, 19, 11, 8, {"kv_lengths": np.array([11, 4])}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_sinks", [False, True])
def test_dropout_and_sinks_match_the_oracle(rng, case, with_sinks):
    b, hq, hkv, tq, tk, d, variants = CASES[case]
    causal = case.startswith("gqa")
    q, k, v = _qkv(rng, b, hq, hkv, tq, tk, d)
    dout = rng.standard_normal((b, hq, tq, d))
    sinks = rng.standard_normal(hq) * 2 if with_sinks else None
    kw = dict(causal=causal, dropout_p=0.25, dropout_seed=SEED, dropout_offset=3, **variants)
    if sinks is not None:
        kw["sinks"] = sinks
    factors = _factors(0.25, (b, hq, tq, tk), offset=3)
    want = dense_extended(
        q, k, v, dout, causal=causal, keep=factors, sinks=sinks, **variants
    )  # fmt: skip
    out, lse = flashtile.attention(q, k, v, return_lse=True, block_q=16, block_k=16, **kw)
    grads = flashtile.attention_backward(q, k, v, out, lse, dout, block_q=16, block_k=16, **kw)
    ref_out, ref_lse = tiled_attention(q, k, v, 8, return_lse=True, **kw)
    ref_grads = tiled_attention_backward(q, k, v, ref_out, ref_lse, dout, block_size=8, **kw)
    for got in ((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        assert len(got) == (6 if with_sinks else 5)
        for g, w in zip(got, want, strict=False):
            finite = np.isfinite(w)
            assert np.array_equal(finite, np.isfinite(g))
            assert rel_err(np.where(finite, g, 0), np.where(finite, w, 0)) < 1e-12


def test_float32_dropout_keeps_the_accuracy_rule(rng):
    q, k, v = _qkv(rng, 1, 4, 4, 70, 90, 32)
    kw = dict(causal=True, dropout_p=0.1, dropout_seed=5)
    dout = rng.standard_normal((1, 4, 70, 32))
    factors = _factors(0.1, (1, 4, 70, 90), seed=5)
    want = dense_extended(q, k, v, dout, causal=True, keep=factors)
    q32, k32, v32, do32 = (a.astype(np.float32) for a in (q, k, v, dout))
    naive = dense_extended(q32, k32, v32, do32, causal=True, keep=factors.astype(np.float32))
    out, lse = flashtile.attention(q32, k32, v32, return_lse=True, **kw)
    grads = flashtile.attention_backward(q32, k32, v32, out, lse, do32, **kw)
    for got, w, ref32 in zip(
        (out, *grads), (want[0], *want[2:5]), (naive[0], *naive[2:5]), strict=True
    ):
        # naive float32 here is float64 math on float32 inputs: bound it by float32 eps
        assert rel_err(got, w) < 3 * max(rel_err(ref32, w), 2e-7) + 1e-6


def test_the_mask_does_not_depend_on_tiles_threads_or_the_path(rng):
    """Bit-identical results across tile sizes, thread counts, a block mask's
    gathered tiles (several key segments per tile) and the packed varlen path."""
    q, k, v = _qkv(rng, 1, 2, 2, 96, 96, 8)
    kw = dict(dropout_p=0.3, dropout_seed=11)
    base = flashtile.attention(q, k, v, block_q=32, block_k=32, **kw)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        serial = flashtile.attention(q, k, v, block_q=16, block_k=48, **kw)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_allclose(serial, base, rtol=1e-12, atol=1e-14)
    keep = np.ones((96, 96), dtype=bool)
    keep[:, 32:64] = False  # an empty key block between two kept ones: gathered tiles
    blocks = block_mask(keep, 32, 32)
    masked = flashtile.attention(q, k, v, mask=blocks, **kw)
    dense = flashtile.attention(q, k, v, mask=keep, block_q=16, block_k=16, **kw)
    np.testing.assert_allclose(masked, dense, rtol=1e-12, atol=1e-14)
    # Packed sequences: rows of the packed arrays are the counter's rows (b = 0).
    cu = np.array([0, 40, 96])
    packed = flashtile.varlen_attention(q[0], k[0], v[0], cu, cu, **kw)
    factors = _factors(0.3, (1, 2, 96, 96), seed=11)[0]
    for lo, hi in itertools.pairwise(cu):
        want = dense_extended(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], q[:, :, lo:hi],
            keep=factors[None, :, lo:hi, lo:hi],
        )[0][0]  # fmt: skip
        assert rel_err(packed[:, lo:hi], want) < 1e-12


def test_drop_rate_and_independent_offsets():
    p, n = 0.1, 4 * 256 * 256
    a = keep_mask(p, SEED, 0, 2, 2, range(256), range(256))
    b = keep_mask(p, SEED, 1, 2, 2, range(256), range(256))
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs((1 - a.mean()) - p) < 5 * sigma  # a binomial test, fixed seed
    both = (~a & ~b).mean()  # independent masks: dropped together with probability p**2
    assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / n)
    assert not np.array_equal(a, keep_mask(p, SEED + 1, 0, 2, 2, range(256), range(256)))


def test_reference_gradients_match_finite_differences(rng):
    """The oracle's own check: a fixed seed makes dropout a fixed function."""
    q, k, v = _qkv(rng, 1, 2, 2, 5, 7, 4)
    sinks = rng.standard_normal(2)
    dout = rng.standard_normal((1, 2, 5, 4))
    kw = dict(causal=True, dropout_p=0.4, dropout_seed=9)

    def loss(q, k, v, sinks):
        return float((naive_attention(q, k, v, sinks=sinks, **kw)[0] * dout).sum())

    out, lse = tiled_attention(q, k, v, 3, return_lse=True, sinks=sinks, **kw)
    grads = tiled_attention_backward(q, k, v, out, lse, dout, block_size=3, sinks=sinks, **kw)
    args = [q, k, v, sinks]
    for which, grad in enumerate(grads):
        x = args[which]
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            step = np.zeros_like(x)
            step[idx] = 1e-6
            hi = loss(*(a + step if i == which else a for i, a in enumerate(args)))
            lo = loss(*(a - step if i == which else a for i, a in enumerate(args)))
            numeric[idx] = (hi - lo) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_sinks_edge_cases(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 4, 6, 8)
    # A row that sees no key (Tq > Tk, causal): zeros and lse = the sink.
    q5 = rng.standard_normal((1, 2, 9, 8))
    out, lse = flashtile.attention(q5, k, v, causal=True, sinks=[0.5, -3.0], return_lse=True)
    assert np.all(out[:, :, :3] == 0) and np.all(lse[0, :, :3] == [[0.5], [-3.0]])
    # A sink far above every score takes the whole softmax, without overflow.
    out, lse = flashtile.attention(q, k, v, sinks=[1e4, 1e4], return_lse=True)
    assert np.all(np.abs(out) < 1e-300) and np.allclose(lse, 1e4)
    # -inf: no sink at all.
    out, lse = flashtile.attention(q, k, v, sinks=[-np.inf, -np.inf], return_lse=True)
    plain, plain_lse = flashtile.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"dropout_p": 1.0, "dropout_seed": 1}, ValueError, r"\[0, 1\)"),
        ({"dropout_p": 0.1}, ValueError, "needs a dropout_seed"),
        ({"dropout_p": 0.1, "dropout_seed": 2**64}, ValueError, "dropout_seed"),
        ({"dropout_p": 0.1, "dropout_seed": 1.5}, TypeError, "dropout_seed"),
        ({"dropout_p": 0.1, "dropout_seed": 1, "dropout_offset": -1}, ValueError, "offset"),
        ({"dropout_p": True, "dropout_seed": 1}, TypeError, "dropout_p"),
        ({"dropout_p": 1 - 2.0**-18, "dropout_seed": 1}, ValueError, "rounds to 1"),
        ({"dropout_p": 0.0, "dropout_seed": "abc"}, TypeError, "dropout_seed"),
        ({"dropout_p": 0.0, "dropout_offset": -5}, ValueError, "dropout_offset"),
        ({"sinks": [1.0, 2.0, 3.0]}, ValueError, r"\(Hq,\) = \(2,\)"),
        ({"sinks": [1, 2]}, ValueError, "non-float"),
        ({"sinks": [np.nan, 0.0]}, ValueError, "NaN"),
        ({"sinks": [1e39, 0.0]}, ValueError, "within"),  # past float32's range: NaN rows
    ],
)
def test_bad_dropout_and_sinks_are_refused(rng, keywords, error, match):
    q, k, v = _qkv(rng, 1, 2, 2, 4, 6, 8)
    with pytest.raises(error, match=match):
        flashtile.attention(q, k, v, **keywords)


def test_dropout_counter_limits_name_the_culprit(rng):
    q = rng.standard_normal((2, 2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"\(B, H, T, d\) inputs or fewer"):
        naive_attention(q, q, q, dropout_p=0.1, dropout_seed=1)  # the oracle takes 5-D
    heads = np.zeros((1, 70000, 1, 1))
    with pytest.raises(ValueError, match="up to 65536 heads, got 70000"):
        flashtile.attention(heads, heads, heads, dropout_p=0.1, dropout_seed=1)

"""Packed variable-length batches (``varlen_attention`` and its backward) against
the per-sequence dense oracle, with variants, float32, a long sequence and
sequences that have no queries or no keys.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import flashtile as ft
from dense import dense_varlen_attention, dense_varlen_backward, rel_err
from variant_builders import assert_grads_close, assert_lse_close, f64

# (lengths of q, lengths of k) per sequence: Tq != Tk both ways and a length-1 sequence.
VARLEN_LENGTHS = [
    ([5, 1, 17, 9], [5, 1, 23, 3]),
    ([7, 1, 30], [7, 1, 30]),
]
VARLEN_VARIANTS = [
    ("plain", {}),
    ("window", {"window": (3, 2)}),
    ("alibi", {"alibi_slopes": np.array([0.3, 0.1, 0.7, 0.05])}),
    ("softcap", {"softcap": 1.5}),
    (
        "window-alibi-softcap",
        {"window": (4, None), "alibi_slopes": np.full(4, 0.2), "softcap": 3.0},
    ),
]


def _packed(rng, q_lens, k_lens, hq=4, hkv=2, d=5, dv=3, dtype=np.float64, amp=2.0):
    tq, tk = sum(q_lens), sum(k_lens)
    q = (amp * rng.standard_normal((hq, tq, d))).astype(dtype)
    k = (amp * rng.standard_normal((hkv, tk, d))).astype(dtype)
    v = rng.standard_normal((hkv, tk, dv)).astype(dtype)
    dout = rng.standard_normal((hq, tq, dv)).astype(dtype)
    return q, k, v, dout


def _cu(lens, dtype):
    return np.concatenate([[0], np.cumsum(lens)]).astype(dtype)


@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("vname", "var"), VARLEN_VARIANTS, ids=[n for n, _ in VARLEN_VARIANTS])
@pytest.mark.parametrize("lens", VARLEN_LENGTHS, ids=["ragged", "self"])
def test_varlen_matches_per_sequence_oracle(rng, lens, vname, var, causal, cu_dtype):
    q, k, v, dout = _packed(rng, *lens)
    cu_q, cu_k = _cu(lens[0], cu_dtype), _cu(lens[1], cu_dtype)
    out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **var)
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, causal, **var)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=causal, **var)
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, causal, **var)
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_float32(rng, causal):
    lens = VARLEN_LENGTHS[0]
    q, k, v, dout = _packed(rng, *lens, dtype=np.float32)
    cu_q, cu_k = _cu(lens[0], np.int32), _cu(lens[1], np.int32)
    var = VARLEN_VARIANTS[-1][1]
    out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **var)
    assert out.dtype == np.float32
    want_out, want_lse = dense_varlen_attention(*f64(q, k, v), cu_q, cu_k, causal, **var)
    assert rel_err(out, want_out) < 1e-5
    assert_lse_close(lse, want_lse, 1e-5)
    grads = ft.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=causal, **var)
    want = dense_varlen_backward(*f64(q, k, v, dout), cu_q, cu_k, causal, **var)
    assert_grads_close(grads, want, 1e-5)


def test_varlen_long_sequence(rng):
    lens = ([1025, 3], [1025, 40])
    q, k, v, dout = _packed(rng, *lens, hq=2, hkv=1, d=3, dv=2, amp=1.0)
    cu_q, cu_k = _cu(lens[0], np.int64), _cu(lens[1], np.int64)
    out, lse = ft.varlen_attention(
        q, k, v, cu_q, cu_k, causal=True, window=(50, 0), return_lse=True
    )
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, True, window=(50, 0))
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    grads = ft.varlen_attention_backward(
        q, k, v, out, lse, dout, cu_q, cu_k, causal=True, window=(50, 0)
    )
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, True, window=(50, 0))
    assert_grads_close(grads, want, 1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_empty_sequences_and_rows(rng, causal):
    """A sequence with no keys gives zero rows; one with no queries contributes nothing."""
    q_lens, k_lens = [0, 4, 3, 6], [3, 0, 5, 2]  # causal: the first 4 queries of seq 3 see nothing
    q, k, v, dout = _packed(rng, q_lens, k_lens)
    cu_q, cu_k = _cu(q_lens, np.int64), _cu(k_lens, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, lse = ft.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
        dq, dk, dv = ft.varlen_attention_backward(
            q, k, v, out, lse, dout, cu_q, cu_k, causal=causal
        )
    for a in (out, lse, dq, dk, dv):
        assert not np.isnan(a).any()
    np.testing.assert_array_equal(out[:, 0:4], 0.0)  # sequence 1: no keys
    np.testing.assert_array_equal(lse[:, 0:4], -np.inf)
    np.testing.assert_array_equal(dq[:, 0:4], 0.0)
    np.testing.assert_array_equal(dk[:, 0:3], 0.0)  # sequence 0: no queries
    np.testing.assert_array_equal(dv[:, 0:3], 0.0)
    want_out, want_lse = dense_varlen_attention(q, k, v, cu_q, cu_k, causal)
    assert rel_err(out, want_out) < 1e-12
    assert_lse_close(lse, want_lse, 1e-12)
    want = dense_varlen_backward(q, k, v, dout, cu_q, cu_k, causal)
    assert_grads_close((dq, dk, dv), want, 1e-10)

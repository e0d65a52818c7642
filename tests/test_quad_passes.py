"""The four-row passes in LLVM IR (cpu/quad_passes.py): each pass alone against
NumPy, and a non-finite value row through the decode walk that takes them.
(The walks' own test over head dims that are multiples of 8 is in
test_decode.py.)"""

from __future__ import annotations

import contextlib
import itertools

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import flashtile
from flashtile import routes
from flashtile.cpu.memory import HARDWARE_F16, BFloat16Bits, Float16Bits, FloatValues
from flashtile.cpu.quad_passes import halves, has_quads, quad_scores, quad_values

FORMATS = {
    "float32": (np.float32, FloatValues()),
    "bfloat16": (ml_dtypes.bfloat16, BFloat16Bits()),
    "float16": (np.float16, Float16Bits()),
}


@njit
def _passes(q, s, acc, p, flat, fmt, keys, width, stride, gap):
    """Rows 1-4 of ``q``/``acc`` against ``keys`` rows of ``flat`` from its
    second row (rows ``stride`` elements apart, key ``k`` beside ``k +
    gap``), into ``s`` and ``acc`` from column/row offsets 2 and 1."""
    if has_quads(q, s, flat, fmt, width) and has_quads(acc, p, flat, fmt, width):
        quad_scores(q, 1, flat, fmt, stride, width, stride, keys, gap, s, 2, 0)
        quad_values(acc, 1, p, 2, flat, fmt, stride, width, stride, keys, gap, 2 * stride)
        return True
    return False


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("width", "pad"), [(8, 0), (24, 0), (16, 40)])
def test_each_pass_against_numpy(rng, name, width, pad):
    """Every key count 0-7, each key read beside its neighbour, two or three
    keys on, or across the run's halves (keys without a pair: odd counts,
    the ends of blocks); offsets into every operand, each cache format,
    rows one after another or ``pad`` elements apart (one kv head's rows of
    consecutive tokens in flash-attn's layout; NaN there, never read); the
    rows before and after the run infinite (never read: a read, even
    weighted by zero, would show as inf or NaN); nothing outside the rows
    and columns named is written."""
    dtype, fmt = FORMATS[name]
    if name == "float16" and not HARDWARE_F16:
        pytest.skip("no F16C: float16 caches take the Numba passes")
    for keys, pairs in itertools.product(range(8), (1, 2, 3, "halves")):
        rows = np.full((keys + 2, width + pad), np.nan, dtype)
        rows[1 : keys + 1, :width] = rng.standard_normal((keys, width))
        rows[[0, -1], :width] = np.inf
        flat = rows.view(np.uint16).reshape(-1) if dtype != np.float32 else rows.reshape(-1)
        kv = rows[:, :width].astype(np.float32)[1 : 1 + keys]
        q = rng.standard_normal((6, width)).astype(np.float32)
        s = np.full((6, keys + 4), 7.0, np.float32)
        acc = rng.standard_normal((6, width)).astype(np.float32)
        p = rng.random((6, keys + 4)).astype(np.float32)
        want_s, want_acc = s.copy(), acc.copy()
        want_s[1:5, 2 : 2 + keys] = q[1:5] @ kv.T
        want_acc[1:5] += p[1:5, 2 : 2 + keys] @ kv
        apart = halves(keys) if pairs == "halves" else pairs
        args = (q, s, acc, p, np.ascontiguousarray(flat), fmt, keys, width, width + pad, apart)
        assert _passes(*args)
        np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(acc, want_acc, rtol=1e-5, atol=1e-5)


def test_the_passes_refuse_what_they_cannot_address():
    """Strided row tiles and float64 take the Numba passes (has_quads False)."""
    q = np.zeros((4, 16), np.float32)
    flat = np.zeros(64, np.float32)
    assert not _passes(q[:, ::2], q[:, :8], q, q, flat, FloatValues(), 2, 8, 8, 1)
    args = (q, q, q.astype(np.float64), q, flat.astype(np.float64), FloatValues(), 2, 8, 8, 1)
    assert not _passes(*args)


@pytest.mark.parametrize("name", FORMATS)
def test_an_infinite_value_in_an_odd_runs_last_key_is_not_nan(rng, name):
    """A run of 7 keys ends in one key read on its own by the value pass: an
    infinite value there gives attention's infinity, not NaN (0 * inf)."""
    dtype = FORMATS[name][0]
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 7, 16)).astype(dtype) for _ in "kv")
    v[0, 0, 6, 3] = np.inf
    with contextlib.ExitStack() as forced:
        for route in (r for r in routes.ROUTES if r.startswith("decode.contiguous")):
            if "rows" in routes.ROUTES[route].candidates:
                forced.enter_context(routes.force(route, "rows"))
        out = flashtile.decode_attention(q, k, v)
    wide = [a.astype(np.float32) for a in (q, k, v)]
    want = flashtile.attention(wide[0], *(np.repeat(a, 4, axis=1) for a in wide[1:]))
    assert np.isinf(want).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

"""flashtile's own bf16 gemm (vdpbf16ps) through its Fortran ABI, against NumPy.

The kernels call it by address like a BLAS ``gemm``; this checks it on the
shapes a BLAS must take: every transpose, edges of the micro-kernel's
``MR x NR`` blocks, odd ``k`` (a half pair), leading dimensions past the
operands (strided views), ``alpha``/``beta``, and ``beta = 0`` over a C
full of NaN (never read). Skipped where the CPU lacks AVX512-BF16.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from flashtile.cpu import bf16_gemm

pytestmark = pytest.mark.skipif(
    not bf16_gemm.available(), reason="this CPU has no AVX512-BF16 (vdpbf16ps)"
)
BF16 = ml_dtypes.bfloat16


def _gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)(bf16_gemm.address())
    ints = [ctypes.c_int(x) for x in (m, n, k, lda, ldb, ldc)]
    chars = [ctypes.c_char(t) for t in (trans_a, trans_b)]
    scalars = [ctypes.c_float(x) for x in (alpha, beta)]
    ref = ctypes.byref
    fn(
        ref(chars[0]), ref(chars[1]), ref(ints[0]), ref(ints[1]), ref(ints[2]), ref(scalars[0]),
        a.ctypes.data, ref(ints[3]), b.ctypes.data, ref(ints[4]), ref(scalars[1]),
        c.ctypes.data, ref(ints[5]),
    )  # fmt: skip


def _column_major(x, lead, rng):
    """``x`` stored column-major with leading dimension ``lead`` (>= rows),
    the rows past ``x`` filled with noise (a strided view's neighbours)."""
    rows, cols = x.shape
    store = rng.standard_normal((cols, lead)).astype(x.dtype)
    store[:, :rows] = x.T
    return store


@pytest.mark.parametrize("trans", [(b"N", b"N"), (b"N", b"T"), (b"T", b"N"), (b"t", b"t")])
@pytest.mark.parametrize(
    ("m", "n", "k", "pad"),
    [
        (1, 1, 1, 0), (5, 7, 3, 2), (32, 12, 64, 0), (33, 13, 65, 3), (70, 37, 129, 1),
        (40, 30, 64, 2), (40, 30, 64, 1), (64, 25, 512, 0),
    ],
)  # fmt: skip
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (0, 1)])
def test_matches_numpy(rng, trans, m, n, k, pad, offsets):
    """Even ``k`` and ``ldb`` with an untransposed B read B's whole panels in
    place and copy its last partial one; an odd ``ldb`` or a start one
    element past an aligned word (``offsets`` of A and B) copies every panel."""
    ta, tb = trans
    a = rng.standard_normal((m, k)).astype(BF16)  # op(A)
    b = rng.standard_normal((k, n)).astype(BF16)  # op(B)
    a_stored = a.T if ta in b"Tt" else a
    b_stored = b.T if tb in b"Tt" else b
    lda, ldb, ldc = a_stored.shape[0] + pad, b_stored.shape[0] + pad, m + pad
    a_mem, b_mem = (_column_major(x, ld, rng) for x, ld in ((a_stored, lda), (b_stored, ldb)))
    a_bits = _shifted(a_mem.view(np.uint16), offsets[0])
    b_bits = _shifted(b_mem.view(np.uint16), offsets[1])
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c_mem = _column_major(c0, ldc, rng)
    wide = (a.astype(np.float64), b.astype(np.float64))
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
        c = c_mem.copy()
        if beta == 0.0:
            c[:, :m] = np.nan  # beta = 0: C is not read
        _gemm(ta, tb, m, n, k, alpha, a_bits, lda, b_bits, ldb, beta, c, ldc)
        want = alpha * (wide[0] @ wide[1]) + beta * c0
        # float32 sums of exact products: within float32 rounding of the sum of |terms|
        bound = 4e-7 * (k + 2) * (np.abs(wide[0]) @ np.abs(wide[1]) + np.abs(beta * c0)) + 1e-30
        assert np.all(np.abs(c[:, :m].T - want) <= bound)
        assert np.array_equal(c[:, m:], c_mem[:, m:])  # past the rows: untouched


def _shifted(bits, offset):
    """The same bf16 patterns starting ``offset`` elements into a fresh buffer
    (``offset = 1``: 2 bytes past a 4-byte boundary)."""
    store = np.empty(bits.size + offset, np.uint16)
    store[offset:] = bits.ravel()
    assert offset or store.ctypes.data % 4 == 0
    return store[offset:].reshape(bits.shape)


#: A NaN pattern in both halves: a packed word left unwritten would show.
_UNWRITTEN = 0x7FC07FC0


def _words(low, high):
    return low.astype(np.uint32) | (high.astype(np.uint32) << 16)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize(("k", "c0"), [(7, 0), (8, 0), (8, bf16_gemm.NR), (7, bf16_gemm.NR)])
def test_packed_b_writes_every_word_it_reads(rng, trans, k, c0):
    """``_pack_b`` into a buffer of NaN patterns: each column's pairs (an odd
    ``k``'s last with a zero high half), zeros past ``n`` up to the width."""
    n, nr = 2 * bf16_gemm.NR + 5, bf16_gemm.NR
    op_b = rng.integers(1, 1 << 15, (k, n), dtype=np.uint16)
    stored = op_b.T if trans else op_b  # column-major: stored's columns are contiguous
    ld = stored.shape[0] + 1
    flat = _column_major(stored, ld, rng).ravel()
    width = (n + nr - 1) // nr * nr - c0
    out = np.full((k + 1) // 2 * width, _UNWRITTEN, np.uint32)
    bf16_gemm._pack_b(flat, ld, trans, n, k, out, c0, width)
    padded = np.vstack([op_b, np.zeros((k % 2, n), np.uint16)])
    want = np.zeros(((k + 1) // 2, width), np.uint32)
    want[:, : n - c0] = _words(padded[0::2, c0:], padded[1::2, c0:])
    assert np.array_equal(out.reshape(want.shape), want)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize(("k", "rows"), [(7, bf16_gemm.MR), (8, 5), (8, bf16_gemm.MR)])
def test_packed_a_writes_every_word_it_reads(rng, trans, k, rows):
    mr, m, i0 = bf16_gemm.MR, 40, 3
    op_a = rng.integers(1, 1 << 15, (m, k), dtype=np.uint16)
    stored = op_a.T if trans else op_a
    ld = stored.shape[0] + (0 if trans else 2)  # trans, even k: the word transpose
    flat = _column_major(stored, ld, rng).ravel()
    out = np.full((k + 1) // 2 * mr, _UNWRITTEN, np.uint32)
    bf16_gemm._pack_a(flat, ld, trans, i0, rows, k, out)
    block = np.vstack([op_a[i0 : i0 + rows].T, np.zeros((k % 2, rows), np.uint16)])
    want = np.zeros(((k + 1) // 2, mr), np.uint32)
    want[:, :rows] = _words(block[0::2], block[1::2])
    assert np.array_equal(out.reshape(want.shape), want)


def test_zero_sized_products(rng):
    c = np.full((3, 4), 7.0, np.float32)
    a = np.zeros(4, np.uint16)
    _gemm(b"N", b"N", 0, 3, 2, 1.0, a, 1, a, 2, 0.0, c, 1)
    _gemm(b"N", b"N", 4, 3, 0, 1.0, a, 4, a, 1, 0.5, c, 4)  # k = 0: C = beta C
    assert np.all(c == 3.5)
    nan = np.full(4, 0x7FC0, np.uint16)  # bf16 NaN: alpha = 0 computes no product (BLAS)
    _gemm(b"C", b"c", 2, 2, 2, 0.0, nan, 2, nan, 2, 2.0, c, 4)
    flat = c.ravel()  # (C is column-major with ldc = 4: elements 0, 1, 4, 5)
    assert np.all(flat[[0, 1, 4, 5]] == 7.0) and np.sum(flat == 3.5) == 8

"""Regression tests for inputs that once gave a wrong number or an internal error.

Each test names the defect it guards; every one failed before its fix.
"""

from __future__ import annotations

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

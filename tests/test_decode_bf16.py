"""A bfloat16 KV cache read as bfloat16: the decode kernel widens its tiles.

The oracle is the NumPy reference on the cache's values widened to float64,
so the fast path's only error is float32 arithmetic. A float16 and a
bfloat16 cache both reach the kernel as ``uint16``; the tests here fail if
either were read in the other's format.
"""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

import flashtile
from flashtile.cpu.memory import (
    BFloat16Bits,
    Float16Bits,
    FloatValues,
    cache_operands,
    load_value,
)
from flashtile.reference import decode_attention as reference_decode

BF16 = ml_dtypes.bfloat16
TOL32 = dict(rtol=2e-5, atol=2e-5)


@njit
def _copy(src, dst, fmt):
    for c in range(src.shape[0]):
        dst[c] = load_value(src, c, fmt)


def _widened(bits, fmt):
    out = np.empty(bits.size, dtype=np.float32)
    _copy(bits, out, fmt)
    return out


def _same_floats(got, want):
    nan = np.isnan(want)
    return np.array_equal(np.isnan(got), nan) and np.array_equal(
        got[~nan].view(np.uint32), want[~nan].view(np.uint32)
    )


def test_each_format_flag_reads_its_own_bit_patterns_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    as_bf16 = _widened(bits, BFloat16Bits())
    as_fp16 = _widened(bits, Float16Bits())
    assert _same_floats(as_bf16, bits.view(BF16).astype(np.float32))
    assert _same_floats(as_fp16, bits.view(np.float16).astype(np.float32))
    assert as_bf16[0x3C00] != as_fp16[0x3C00]  # 1.0 in float16, 2**-7 in bfloat16
    # The rule that picks the flag, and a flag that does not fit the array.
    assert isinstance(cache_operands(bits.view(BF16), bits.view(BF16))[2], BFloat16Bits)
    assert isinstance(cache_operands(bits.view(np.float16), bits.view(np.float16))[2], Float16Bits)
    with pytest.raises(TypingError, match="does not match the format flag"):
        _copy(bits, np.empty(bits.size, dtype=np.float32), FloatValues())


def test_float16_widening_without_the_instruction(monkeypatch):
    # Targets without F16C (NUMBA_CPU_NAME=generic) widen in integer ops.
    from flashtile.cpu import memory

    monkeypatch.setattr(memory, "HARDWARE_F16", False)

    @njit  # compiled here, after the patch (not from the cache)
    def widen_all(bits, out):
        for i in range(bits.size):
            out[i] = memory.load_half(bits, i)

    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, dtype=np.float32)
    widen_all(bits, out)
    assert _same_floats(out, bits.view(np.float16).astype(np.float32))
    assert "vcvtph2ps" not in next(iter(widen_all.inspect_asm().values()))


def _problem(rng, batch=3, hq=6, hkv=2, tq=3, d=16, t_max=300):
    q = rng.standard_normal((batch, hq, tq, d)).astype(np.float32)
    k = rng.standard_normal((batch, hkv, t_max, d)).astype(BF16)
    v = rng.standard_normal((batch, hkv, t_max, d)).astype(BF16)
    return q, k, v


def _pages(rng, k, v, page):
    """Every sequence's whole capacity in shuffled pages of ``page`` keys."""
    batch, hkv, t_max, d = k.shape
    per_seq = -(-t_max // page)
    order = rng.permutation(batch * per_seq)
    pad = ((0, 0), (0, 0), (0, per_seq * page - t_max), (0, 0))
    kp, vp = (
        np.pad(a.astype(np.float32), pad)
        .reshape(batch, hkv, per_seq, page, d)
        .transpose(0, 2, 1, 3, 4)
        .reshape(-1, hkv, page, d)
        for a in (k, v)
    )
    out_k, out_v = np.empty_like(kp), np.empty_like(vp)
    out_k[order], out_v[order] = kp, vp
    return out_k.astype(BF16), out_v.astype(BF16), order.reshape(batch, per_seq)


@pytest.mark.parametrize("page", [None, 16, 40])
@pytest.mark.parametrize("variants", [{}, {"window": (50, 0)}, {"causal": False}])
def test_bf16_cache_matches_the_reference_on_its_values(rng, page, variants):
    q, k, v = _problem(rng)
    lengths = np.array([300, 171, 2])  # ragged; 2 < Tq: a query that sees nothing
    table = None
    if page is not None:
        k, v, table = _pages(rng, k, v, page)
    out, lse = flashtile.decode_attention(
        q, k, v, cache_seqlens=lengths, block_table=table, return_lse=True, **variants
    )
    want, want_lse = reference_decode(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
        cache_seqlens=lengths, block_table=table, return_lse=True, **variants,
    )  # fmt: skip
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, want, **TOL32)
    np.testing.assert_allclose(lse, want_lse, **TOL32)


def test_bf16_queries_give_bf16_output_and_float32_lse(rng):
    # The widening path (no bf16 products; those are test_bf16.py's).
    from flashtile import routes

    q, k, v = _problem(rng, batch=1, tq=1)
    with routes.force("bf16", "widen"):
        out, lse = flashtile.decode_attention(q.astype(BF16), k, v, return_lse=True)
        assert out.dtype == BF16 and lse.dtype == np.float32
        want = flashtile.decode_attention(q.astype(BF16).astype(np.float32), k, v)
    np.testing.assert_array_equal(out, want.astype(BF16))


def _peak_bytes(call) -> int:
    call()  # compiled and planned first
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_no_float32_copy_of_a_bf16_cache_per_call(rng):
    # 2 MiB of bf16 keys and values: a widened copy would take 4 MiB.
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 8192, 64)).astype(BF16) for _ in "kv")
    assert _peak_bytes(lambda: flashtile.decode_attention(q, k, v)) < k.nbytes // 4
    # A decode-shaped call to flashtile.attention goes to the same kernel.
    qb = q.astype(BF16)
    out = flashtile.attention(qb, k, v, causal=True)
    want = flashtile.decode_attention(qb, k, v)
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=1e-2)
    assert _peak_bytes(lambda: flashtile.attention(qb, k, v, causal=True)) < k.nbytes // 4


def test_kv_cache_stores_bf16_and_decodes_it(rng):
    batch, hq, hkv, d, prompt = 2, 4, 2, 8, 29
    q = rng.standard_normal((batch, hq, prompt + 1, d)).astype(np.float32)
    k = rng.standard_normal((batch, hkv, prompt + 1, d)).astype(BF16).astype(np.float32)
    v = rng.standard_normal((batch, hkv, prompt + 1, d)).astype(BF16).astype(np.float32)
    full = flashtile.attention(q, k, v, causal=True)
    cache = flashtile.KVCache(batch, hkv, d, 40, dtype=BF16, page_size=8)
    cache.append(k[:, :, :prompt].astype(BF16), v[:, :, :prompt].astype(BF16))
    cache.append(k[:, :, prompt:], v[:, :, prompt:])  # float32, exact in bf16
    assert cache.k.dtype == BF16 and "bfloat16" in repr(cache)
    np.testing.assert_allclose(cache.attend(q[:, :, -2:]), full[:, :, -2:], **TOL32)
    with pytest.raises(ValueError, match="beyond bfloat16's range"):
        cache.append(np.full((2, 2, 1, 8), 3.4e38, np.float32), np.zeros((2, 2, 1, 8)))
    assert cache.lengths.tolist() == [prompt + 1] * 2
    half = flashtile.KVCache(1, 1, 4, 8, dtype=np.float16)  # bf16 reaches 3.4e38
    with pytest.raises(ValueError, match="beyond float16's range"):
        half.append(np.full((1, 1, 1, 4), 1e5, BF16), np.zeros((1, 1, 1, 4), BF16))
    assert half.lengths.tolist() == [0]


def test_context_parallel_decode_reads_torch_bf16_caches_in_place(rng):
    torch = pytest.importorskip("torch")
    from flashtile.distributed.kernels import _cpu_decode, _numpy

    q, k, v = _problem(rng, batch=2, tq=1)
    kt, vt = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (k, v))
    assert np.shares_memory(_numpy(kt, keep_bf16=True), k)
    out, lse = _cpu_decode(torch.from_numpy(q), kt, vt, cache_seqlens=torch.tensor([300, 9]))
    want, want_lse = flashtile.decode_attention(
        q, k, v, cache_seqlens=np.array([300, 9]), return_lse=True
    )
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)


def test_numpy_api_reads_torch_bf16_tensors_in_place(rng):
    # np.asarray raises on a bf16 tensor (NumPy has no bf16): the NumPy API
    # views its memory as ml_dtypes.bfloat16 instead, as for its own arrays.
    torch = pytest.importorskip("torch")
    from flashtile._validate import as_numpy

    q, k, v = _problem(rng, batch=2, tq=1)
    qb = q.astype(BF16)
    qt, kt, vt = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (qb, k, v))
    assert np.shares_memory(as_numpy(kt), k)
    np.testing.assert_array_equal(
        flashtile.decode_attention(qt, kt, vt), flashtile.decode_attention(qb, k, v)
    )
    got = flashtile.attention(qt, kt, vt, causal=True)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, flashtile.attention(qb, k, v, causal=True))
    cache = flashtile.KVCache(2, 2, 16, 8, dtype=BF16)
    cache.append(kt[:, :, :5], vt[:, :, :5])
    np.testing.assert_array_equal(cache.k[:, :, :5], k[:, :, :5])
    for dtype in (torch.float32, torch.bfloat16):  # no gradients in the NumPy API
        with pytest.raises(TypeError, match=r"requires grad.*flashtile\.torch\.attention"):
            flashtile.attention(qt.to(dtype).requires_grad_(), kt, vt)

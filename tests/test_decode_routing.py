"""Decode-shaped calls on the split-KV kernel, cached plans, serial small calls.

``flashtile.attention`` sends a few queries against many keys to the decode
kernel (``decode_planning.decode_shaped``); the results must be the forward kernel's
(explicit tile sizes keep a call on the forward kernel) and the reference's,
and gradients through the torch op must stay right.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import flashtile
from flashtile import api, decode_planning, frontdoor, planning
from flashtile.reference import naive_attention


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def routed(monkeypatch):
    """A list that grows by one for every call planned on the decode kernel."""
    calls = []
    original = frontdoor.plan_decode_call

    def counting(call):
        calls.append(call.shapes)
        return original(call)

    monkeypatch.setattr(frontdoor, "plan_decode_call", counting)
    return calls


def _call(q, k, v, causal=False, **variants):
    return api.check_call(q, k, v, causal, None, variants)


def test_the_rule():
    z = np.zeros
    q, k = z((1, 4, 1, 8)), z((1, 2, decode_planning.DECODE_MIN_KEYS, 8))
    assert decode_planning.decode_shaped(_call(q, k, k, True))
    assert not decode_planning.decode_shaped(_call(q, k[:, :, :-1], k[:, :, :-1]))  # too few keys
    many = z((1, 4, decode_planning.DECODE_MAX_QUERIES + 1, 8))
    assert not decode_planning.decode_shaped(_call(many, k, k))
    # One query per head goes to the decode kernel, MHA too; several MHA
    # queries stay on the forward kernel while their (batch, kv head) pairs
    # fill the threads, and a single pair does not.
    mha = z((numba.get_num_threads(), 2, 1, 8))
    kk = z((mha.shape[0], 2, 512, 8))
    assert decode_planning.decode_shaped(_call(mha, kk, kk))
    mha2 = np.concatenate([mha, mha], axis=2)
    assert not decode_planning.decode_shaped(_call(mha2, kk, kk))
    one = _call(mha2[:1, :1], kk[:1, :1], kk[:1, :1])
    assert decode_planning.decode_shaped(one) == (numba.get_num_threads() > 1)
    assert not decode_planning.decode_shaped(_call(q, k, k), block_q=16)  # forward tiles asked for
    assert not decode_planning.decode_shaped(_call(q, k, k, mask=z((1, 512), dtype=bool)))
    short = np.array([500])
    assert decode_planning.decode_shaped(_call(q, k, k, True, kv_lengths=short))
    # With fewer valid keys the decode kernel would move the window and the
    # causal limit of several queries: those stay on the forward kernel.
    assert not decode_planning.decode_shaped(_call(q, k, k, True, kv_lengths=short, window=(8, 0)))
    q3 = z((1, 4, 3, 8))
    assert not decode_planning.decode_shaped(_call(q3, k, k, True, kv_lengths=short))
    assert decode_planning.decode_shaped(_call(q3, k, k, False, kv_lengths=short))
    # A right side of 0 without causal limits keys by position just as causal does.
    right_zero = _call(q3, k, k, False, kv_lengths=short, window=(None, 0))
    assert not decode_planning.decode_shaped(right_zero)
    assert decode_planning.decode_shaped(_call(q, k, k, False, kv_lengths=short, window=(None, 4)))


CASES = [  # (B, Hq, Hkv, Tq, Tk, d, variants)
    (2, 6, 2, 1, 1025, 59, {"causal": True}),
    (1, 4, 1, 3, 600, 64, {"causal": True, "window": (100, 0)}),
    (2, 6, 3, 8, 512, 7, {"alibi_slopes": np.linspace(0.1, 1.0, 6), "softcap": 5.0}),
    (3, 4, 1, 1, 700, 16, {"causal": True, "kv_lengths": np.array([700, 5, 0])}),
    (2, 2, 1, 5, 999, 3, {"kv_lengths": np.array([300, 998])}),
]


@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "kw"), CASES)
def test_decode_route_equals_forward_kernel_and_reference(routed, b, hq, hkv, tq, tk, d, kw):
    rng = np.random.default_rng(tq * tk + d)
    q = rng.standard_normal((b, hq, tq, d))
    k, v = (rng.standard_normal((b, hkv, tk, d)) for _ in range(2))
    out, lse = flashtile.attention(q, k, v, return_lse=True, **kw)
    assert len(routed) == 1
    fwd, fwd_lse = flashtile.attention(q, k, v, return_lse=True, block_q=16, **kw)
    assert len(routed) == 1  # explicit tiles: the forward kernel
    np.testing.assert_allclose(out, fwd, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, fwd_lse, rtol=1e-12, atol=1e-12)  # -inf rows alike
    ref = naive_attention(q, k, v, **kw)[0]
    assert _rel(out, ref) < 1e-12
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    assert _rel(flashtile.attention(q32, k32, v32, **kw), ref) < 1e-5


def test_plans_are_cached_and_small_calls_run_serially():
    q = np.ones((1, 4, 16, 32), dtype=np.float32)
    first = planning.plan_forward(_call(q, q, q, True))
    again = planning.plan_forward(_call(q + 1, q, q, True))
    assert again.items is first.items and again.q4 is not first.q4
    assert first.threads == 1  # (1, 4, 16, 32) is far below SERIAL_WORK
    other = planning.plan_forward(_call(q, q, q, False))
    assert other.items is not first.items
    big = np.ones((1, 8, 512, 64), dtype=np.float32)
    assert planning.plan_forward(_call(big, big, big)).threads == numba.get_num_threads()


torch = pytest.importorskip("torch")


def test_torch_op_decode_route_gradients(routed):
    """A routed forward (GQA, causal, kv_lengths) and the backward through the op."""
    import flashtile.torch as ftt

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 2, 59, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 700, 59, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    lengths = torch.tensor([700, 300])
    out = ftt.attention(q, k, v, enable_gqa=True, kv_lengths=lengths)
    assert len(routed) == 1
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = torch.arange(700)[None, None, None, :] < lengths[:, None, None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        torch.testing.assert_close(got, want)


def test_hook_reads_only_a_static_cache_s_filled_slots(routed):
    """A decoding step's prefix mask becomes kv_lengths: NaN in the unfilled
    slots of the buffer never reaches the result (a mask would read them)."""
    from flashtile.torch.hf import tiled_attention_forward

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 1024, 16, generator=gen) for _ in range(2))
    filled = 600
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    mask = (torch.arange(1024) < filled).expand(2, 1, 1, 1024)
    module = torch.nn.Module()
    out, _ = tiled_attention_forward(module, q, k, v, mask)
    assert len(routed) == 1
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :filled], v[:, :, :filled], enable_gqa=True
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_right_window_of_zero_with_short_kv_lengths_is_exact():
    # Routed to the decode kernel this call moved its queries (error 0.03).
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 3, 16))
    k, v = (rng.standard_normal((1, 1, 600, 16)) for _ in range(2))
    kw = {"window": (None, 0), "kv_lengths": np.array([300])}
    assert _rel(flashtile.attention(q, k, v, **kw), naive_attention(q, k, v, **kw)[0]) < 1e-12

"""Every validation error: the right exception type and a message naming the
values, the same on every entry point (naive, reference, fast, their backwards,
varlen), for the core inputs and for the variants.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashtile as ft
from flashtile import (
    attention_memory_elements,
    naive_attention,
    online_attention,
    online_softmax,
    tiled_attention,
    tiled_attention_backward,
)


def z(*shape, dtype=np.float64):
    return np.zeros(shape, dtype=dtype)


def _backward(backward, **fixed):
    """A backward entry called like a forward: zero ``out``/``lse``/``dout`` shaped
    for ``q`` and ``v`` (both backwards take ``out, lse, dout``)."""

    def call(q, k, v, **kw):
        lead = np.shape(q)[:-1]
        out = z(*lead, np.shape(v)[-1])
        return backward(q, k, v, out, z(*lead), out, **fixed, **kw)

    return call


# Every entry point, called as f(q, k, v, **kwargs).
CALLS = {
    "naive": naive_attention,
    "reference": lambda q, k, v, **kw: tiled_attention(q, k, v, 2, **kw),
    "reference-backward": _backward(tiled_attention_backward, block_size=2),
    "fast": ft.attention,
    "fast-backward": _backward(ft.attention_backward),
}
ATTENTION_CALLS = list(CALLS.values())
ids = list(CALLS)


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_one_dimensional_q(call):
    with pytest.raises(ValueError, match=r"q has shape \(4,\).*at least 2 dims"):
        call(z(4), z(6, 4), z(6, 3))


@pytest.mark.parametrize("name,index", [("k", 1), ("v", 2)])
def test_one_dimensional_k_or_v(name, index):
    args = [z(5, 4), z(6, 4), z(6, 3)]
    args[index] = z(7)
    with pytest.raises(ValueError, match=rf"{name} has shape \(7,\)"):
        tiled_attention(*args, 2)


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_mismatched_head_dims(call):
    with pytest.raises(ValueError, match=r"q has head dim d=4 but k has d=5") as info:
        call(z(5, 4), z(6, 5), z(6, 3))
    assert "(5, 4)" in str(info.value)
    assert "(6, 5)" in str(info.value)


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_mismatched_key_and_value_lengths(call):
    with pytest.raises(ValueError, match=r"k has Tk=6 keys but v has 7 values"):
        call(z(5, 4), z(6, 4), z(7, 3))


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_non_broadcastable_leading_dims(call):
    with pytest.raises(ValueError, match=r"leading dims do not broadcast: q \(2,\), k \(3,\)"):
        call(z(2, 5, 4), z(3, 6, 4), z(3, 6, 3))


@pytest.mark.parametrize("bad", [0, -1])
def test_block_size_not_positive(bad):
    with pytest.raises(ValueError, match=rf"block_size must be >= 1, got {bad}"):
        tiled_attention(z(5, 4), z(6, 4), z(6, 3), bad)
    with pytest.raises(ValueError, match=rf"block_size must be >= 1, got {bad}"):
        online_softmax(z(5), bad)
    with pytest.raises(ValueError, match=rf"block_size must be >= 1, got {bad}"):
        online_attention(z(5, 4), z(6, 4), z(6, 3), bad)
    with pytest.raises(ValueError, match=rf"block_size must be >= 1, got {bad}"):
        tiled_attention_backward(z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5), z(5, 3), block_size=bad)


@pytest.mark.parametrize(
    "bad,shown",
    [(2.5, r"2\.5 of type float"), (True, r"True of type bool"), ("3", r"'3' of type str")],
)
def test_block_size_not_an_integer(bad, shown):
    with pytest.raises(TypeError, match=rf"block_size must be a positive integer, got {shown}"):
        tiled_attention(z(5, 4), z(6, 4), z(6, 3), bad)
    with pytest.raises(TypeError, match=rf"block_size must be a positive integer, got {shown}"):
        online_softmax(z(5), bad)
    with pytest.raises(TypeError, match=rf"block_size must be a positive integer, got {shown}"):
        tiled_attention_backward(z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5), z(5, 3), block_size=bad)


def test_numpy_integer_block_size_is_accepted():
    out = tiled_attention(np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 1)), np.int64(3))
    np.testing.assert_array_equal(out, np.ones((3, 1)))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_])
@pytest.mark.parametrize("name,index", [("q", 0), ("k", 1), ("v", 2)])
def test_non_float_dtypes_are_refused(name, index, dtype):
    args = [z(5, 4), z(6, 4), z(6, 3)]
    args[index] = args[index].astype(dtype)
    pattern = rf"{name} has dtype {np.dtype(dtype).name}.*floating point"
    with pytest.raises(TypeError, match=pattern):
        tiled_attention(*args, 2)
    with pytest.raises(TypeError, match=pattern):
        naive_attention(*args)


def test_python_int_lists_are_refused():
    with pytest.raises(TypeError, match=r"q has dtype int"):
        tiled_attention([[1, 2]], np.ones((3, 2)), np.ones((3, 2)), 2)


@pytest.mark.parametrize("name,index", [("q", 0), ("k", 1), ("v", 2)])
def test_complex_dtype_is_refused(name, index):
    args = [z(5, 4), z(6, 4), z(6, 3)]
    args[index] = args[index].astype(np.complex128)
    with pytest.raises(TypeError, match=rf"{name} has dtype complex128"):
        tiled_attention(*args, 2)


def test_complex_input_to_online_softmax_is_refused():
    with pytest.raises(TypeError, match=r"x has dtype complex64"):
        online_softmax(np.zeros(4, dtype=np.complex64), 2)


def test_integer_input_to_online_softmax_is_refused():
    with pytest.raises(TypeError, match=r"x has dtype int64"):
        online_softmax(np.arange(4), 2)


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_mixed_dtypes(call):
    with pytest.raises(TypeError, match=r"share one dtype, got float32, float64, float64"):
        call(z(5, 4, dtype=np.float32), z(6, 4), z(6, 3))


def test_mixed_dtypes_in_v():
    with pytest.raises(TypeError, match=r"got float64, float64, float16"):
        tiled_attention(z(5, 4), z(6, 4), z(6, 3, dtype=np.float16), 2)


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_empty_query_sequence(call):
    with pytest.raises(ValueError, match=r"Tq is 0 \(q \(0, 4\)"):
        call(z(0, 4), z(6, 4), z(6, 3))


@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_empty_key_sequence(call):
    with pytest.raises(ValueError, match=r"Tk is 0 \(q \(5, 4\), k \(0, 4\), v \(0, 3\)"):
        call(z(5, 4), z(0, 4), z(0, 3))


@pytest.mark.parametrize(
    "label,shapes", [("d", ((5, 0), (6, 0), (6, 3))), ("dv", ((5, 4), (6, 4), (6, 0)))]
)
def test_zero_width_heads(label, shapes):
    with pytest.raises(ValueError, match=rf"^{label} is 0"):
        tiled_attention(*(z(*s) for s in shapes), 2)


@pytest.mark.parametrize("bad", [1, 0, "yes", None, np.array([True])])
@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_causal_must_be_a_bool(call, bad):
    with pytest.raises(TypeError, match=r"causal must be True or False, got"):
        call(z(5, 4), z(6, 4), z(6, 3), causal=bad)


def test_causal_message_names_the_value():
    with pytest.raises(TypeError, match=r"causal must be True or False, got 'yes'"):
        tiled_attention(z(5, 4), z(6, 4), z(6, 3), 2, causal="yes")


def test_numpy_bool_causal_is_accepted():
    out = tiled_attention(np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 1)), 2, causal=np.True_)
    np.testing.assert_array_equal(out, np.ones((3, 1)))


@pytest.mark.parametrize("bad,shown", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
@pytest.mark.parametrize("call", ATTENTION_CALLS, ids=ids)
def test_scale_must_be_finite(call, bad, shown):
    with pytest.raises(ValueError, match=rf"scale must be finite, got {shown}"):
        call(z(5, 4), z(6, 4), z(6, 3), scale=bad)


@pytest.mark.parametrize("bad", ["0.5", True, 1j])
def test_scale_must_be_a_real_number(bad):
    with pytest.raises(TypeError, match=r"scale must be a real number or None, got"):
        tiled_attention(z(5, 4), z(6, 4), z(6, 3), 2, scale=bad)


# (lse and dout passed in the earlier order are recognised: see test_backward.py)
@pytest.mark.parametrize(
    "out_shape,lse_shape,dout_shape,match",
    [
        ((5, 3), (5,), (5,), r"dout has shape \(5,\), expected \(5, 3\)"),
        ((5, 3), (5, 3), (5, 3), r"lse has shape \(5, 3\), expected \(5,\)"),
        ((3, 5), (5,), (5, 3), r"out has shape \(3, 5\), expected \(5, 3\)"),
        ((5, 3), (6,), (5, 3), r"lse has shape \(6,\), expected \(5,\)"),
        ((5, 3), (5,), (1, 5, 3), r"dout has shape \(1, 5, 3\), expected \(5, 3\)"),
    ],
)
@pytest.mark.parametrize("backward", ["reference", "fast"])
def test_backward_wrong_state_shapes(backward, out_shape, lse_shape, dout_shape, match):
    states = (z(*out_shape), z(*lse_shape), z(*dout_shape))
    with pytest.raises(ValueError, match=match):
        if backward == "reference":
            tiled_attention_backward(z(5, 4), z(6, 4), z(6, 3), *states, block_size=2)
        else:
            ft.attention_backward(z(5, 4), z(6, 4), z(6, 3), *states)


def test_backward_state_shape_uses_broadcast_batch():
    q, k, v = z(2, 5, 4), z(1, 6, 4), z(1, 6, 3)
    with pytest.raises(ValueError, match=r"out has shape \(1, 5, 3\), expected \(2, 5, 3\)"):
        tiled_attention_backward(q, k, v, z(1, 5, 3), z(2, 5), z(2, 5, 3), block_size=2)


def test_backward_integer_state_is_refused():
    with pytest.raises(TypeError, match=r"dout has dtype int64"):
        tiled_attention_backward(
            z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5), z(5, 3, dtype=np.int64), block_size=2
        )


@pytest.mark.parametrize("bad", [0, -3])
def test_memory_elements_needs_positive_tokens(bad):
    with pytest.raises(ValueError, match=rf"tokens must be >= 1, got {bad}"):
        attention_memory_elements(bad)


@pytest.mark.parametrize("bad", [2.0, True, "4096"])
def test_memory_elements_needs_an_integer(bad):
    with pytest.raises(TypeError, match=r"tokens must be a positive integer"):
        attention_memory_elements(bad)


def test_online_softmax_scalar_is_refused():
    with pytest.raises(ValueError, match=r"x is a scalar"):
        online_softmax(np.float64(1.0), 1)


# --------------------------------------------------------------------------------------
# Variants: GQA heads, window, ALiBi, softcap, padding, masks, varlen
# --------------------------------------------------------------------------------------


_B, _HQ, _HKV, _TQ, _TK, _D = 2, 4, 2, 5, 9, 8

BAD_INPUTS = [
    # (id, overrides, exceptions, substrings the message must contain)
    (
        "heads-6-4",
        {"q": np.zeros((_B, 6, _TQ, _D)), "k": np.zeros((_B, 4, _TK, _D))},
        ValueError,
        ["6", "4"],
    ),
    ("window-minus-2", {"window": (-2, 0)}, ValueError, ["-2"]),
    ("window-right-minus-5", {"window": (3, -5)}, ValueError, ["-5"]),
    ("alibi-shape-5", {"alibi_slopes": np.ones(5)}, ValueError, ["(5,)"]),
    ("alibi-shape-3x4", {"alibi_slopes": np.ones((3, 4))}, ValueError, ["(3, 4)"]),
    ("alibi-nan", {"alibi_slopes": np.full(_HQ, np.nan)}, ValueError, ["finite", "nan"]),
    ("softcap-zero", {"softcap": 0.0}, ValueError, ["softcap", "0"]),
    ("softcap-negative", {"softcap": -1.5}, ValueError, ["softcap", "-1.5"]),
    ("kv_lengths-shape", {"kv_lengths": np.array([9, 9, 9])}, ValueError, ["kv_lengths", "(3,)"]),
    ("kv_lengths-too-long", {"kv_lengths": np.array([9, 12])}, ValueError, ["12", "9"]),
    (
        "kv_lengths-and-key_padding_mask",
        {"kv_lengths": np.array([9, 9]), "key_padding_mask": np.ones((_B, _TK), dtype=bool)},
        ValueError,
        ["kv_lengths", "key_padding_mask"],
    ),
    ("mask-shape", {"mask": np.ones((3, 5), dtype=bool)}, ValueError, ["(3, 5)"]),
    ("mask-int", {"mask": np.ones((_TQ, _TK), dtype=np.int64)}, (TypeError, ValueError), ["int64"]),
    ("mask-scalar", {"mask": np.array(True)}, ValueError, ["mask is a scalar"]),
    ("mask-nan", {"mask": np.full((_TQ, _TK), np.nan)}, ValueError, ["not NaN, +inf"]),
    ("mask-inf", {"mask": np.full((_TQ, _TK), np.inf)}, ValueError, ["not NaN, +inf"]),
]


def _assert_message_names(excinfo, needles):
    msg = str(excinfo.value)
    assert "unexpected keyword" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("entry", list(CALLS))
@pytest.mark.parametrize(
    ("overrides", "exc", "needles"),
    [b[1:] for b in BAD_INPUTS],
    ids=[b[0] for b in BAD_INPUTS],
)
def test_bad_variant_inputs_name_the_values(entry, overrides, exc, needles):
    kw = dict(overrides)
    q = kw.pop("q", np.zeros((_B, _HQ, _TQ, _D)))
    k = kw.pop("k", np.zeros((_B, _HKV, _TK, _D)))
    v = np.zeros(k.shape)
    with pytest.raises(exc) as excinfo:
        CALLS[entry](q, k, v, **kw)
    _assert_message_names(excinfo, needles)


BAD_VARLEN = [
    ("cu_q-not-from-0", {"cu_seqlens_q": [1, 4, 9]}, ["cu_seqlens_q"]),
    (
        "cu_k-decreasing",
        {"cu_seqlens_q": [0, 3, 6, 9], "cu_seqlens_k": [0, 7, 5, 12]},
        ["cu_seqlens_k"],
    ),
    ("cu_q-not-total", {"cu_seqlens_q": [0, 4, 8]}, ["cu_seqlens_q", "8", "9"]),
    ("cu_k-not-total", {"cu_seqlens_k": [0, 6, 11]}, ["cu_seqlens_k", "11", "12"]),
    ("cu-different-counts", {"cu_seqlens_k": [0, 3, 6, 12]}, ["cu_seqlens"]),
    ("heads-3-2", {"q": np.zeros((3, 9, 4))}, ["3", "2"]),
    ("window-minus-2", {"window": (-2, 0)}, ["-2"]),
    ("softcap-zero", {"softcap": 0.0}, ["softcap"]),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize(
    ("overrides", "needles"), [b[1:] for b in BAD_VARLEN], ids=[b[0] for b in BAD_VARLEN]
)
def test_bad_varlen_inputs_name_the_values(overrides, needles, backward):
    kw = dict(overrides)
    q = kw.pop("q", np.zeros((2, 9, 4)))
    k = v = np.zeros((2, 12, 4))
    cu_q = np.asarray(kw.pop("cu_seqlens_q", [0, 4, 9]), dtype=np.int64)
    cu_k = np.asarray(kw.pop("cu_seqlens_k", [0, 5, 12]), dtype=np.int64)
    with pytest.raises(ValueError) as excinfo:
        if backward:
            out, lse = np.zeros(q.shape), np.zeros(q.shape[:-1])
            ft.varlen_attention_backward(q, k, v, out, lse, out, cu_q, cu_k, **kw)
        else:
            ft.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    _assert_message_names(excinfo, needles)


def test_softcap_accepts_a_zero_dim_array(rng):
    q, k, v = (rng.standard_normal((1, 2, t, 4)) for t in (6, 9, 9))
    a = ft.attention(q, k, v, softcap=np.array(2.0))
    np.testing.assert_array_equal(a, ft.attention(q, k, v, softcap=2.0))


def test_log2_units_are_defined_once_and_right():
    import math

    from flashtile.units import LN2, LOG2E

    assert math.log2(math.e) == LOG2E and math.log(2) == LN2 and LOG2E * LN2 == 1.0

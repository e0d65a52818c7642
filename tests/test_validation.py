"""Every validation error: the right exception type and a message naming the values."""

from __future__ import annotations

import numpy as np
import pytest

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


def call_tiled(q, k, v, **kw):
    return tiled_attention(q, k, v, 2, **kw)


def call_naive(q, k, v, **kw):
    return naive_attention(q, k, v, **kw)


def call_backward(q, k, v, **kw):
    return tiled_attention_backward(q, k, v, z(5, 3), z(5, 3), z(5), 2, **kw)


ATTENTION_CALLS = [call_tiled, call_naive, call_backward]
ids = ["tiled", "naive", "backward"]


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
        tiled_attention_backward(z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5, 3), z(5), bad)


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
        tiled_attention_backward(z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5, 3), z(5), bad)


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


@pytest.mark.parametrize("call", [call_tiled, call_naive], ids=ids[:2])
def test_empty_query_sequence(call):
    with pytest.raises(ValueError, match=r"Tq is 0 \(q \(0, 4\)"):
        call(z(0, 4), z(6, 4), z(6, 3))


@pytest.mark.parametrize("call", [call_tiled, call_naive], ids=ids[:2])
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


@pytest.mark.parametrize(
    "out_shape,dout_shape,lse_shape,match",
    [
        # lse and dout swapped
        ((5, 3), (5,), (5, 3), r"dout has shape \(5,\), expected \(5, 3\)"),
        ((5, 3), (5, 3), (5, 3), r"lse has shape \(5, 3\), expected \(5,\)"),
        ((3, 5), (5, 3), (5,), r"out has shape \(3, 5\), expected \(5, 3\)"),
        ((5, 3), (5, 3), (6,), r"lse has shape \(6,\), expected \(5,\)"),
        ((5, 3), (1, 5, 3), (5,), r"dout has shape \(1, 5, 3\), expected \(5, 3\)"),
    ],
)
def test_backward_wrong_state_shapes(out_shape, dout_shape, lse_shape, match):
    with pytest.raises(ValueError, match=match):
        tiled_attention_backward(
            z(5, 4), z(6, 4), z(6, 3), z(*out_shape), z(*dout_shape), z(*lse_shape), 2
        )


def test_backward_state_shape_uses_broadcast_batch():
    q, k, v = z(2, 5, 4), z(1, 6, 4), z(1, 6, 3)
    with pytest.raises(ValueError, match=r"out has shape \(1, 5, 3\), expected \(2, 5, 3\)"):
        tiled_attention_backward(q, k, v, z(1, 5, 3), z(2, 5, 3), z(2, 5), 2)


def test_backward_integer_state_is_refused():
    with pytest.raises(TypeError, match=r"dout has dtype int64"):
        tiled_attention_backward(
            z(5, 4), z(6, 4), z(6, 3), z(5, 3), z(5, 3, dtype=np.int64), z(5), 2
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

"""Elementwise helpers that translated mods call (:mod:`.mod_source`): torch's
semantics where Triton's operators differ (integer division and remainder
round toward zero in Triton, toward minus infinity in torch), and functions
Triton lacks or whose libdevice form does not run in the interpreter.

Each takes and returns tiles (or 0-d tensors) of one kind; float ones are
float32. Conditions combine by nested ``tl.where``, not ``&``: Triton's
interpreter mishandles bool operators between a tile and a 0-d tensor.
"""

import triton.language as tl

from .tiles import device_fn, tanh  # noqa: F401  (tanh: for the generated modules)


@device_fn
def trunc(x):
    """Round toward zero (float)."""
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@device_fn
def rint(x):
    """Round half to even (float), as ``torch.round``."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((r - x) == 0.5, tl.where(odd, r - 1.0, r), r)


@device_fn
def int_floordiv(a, b):
    """``a // b`` of integers, rounded toward minus infinity (Python's, torch's)."""
    q = a // b
    return tl.where((a % b) != 0, tl.where((a < 0) != (b < 0), q - 1, q), q)


@device_fn
def int_remainder(a, b):
    """``a % b`` of integers with the divisor's sign (Python's, torch's)."""
    r = a % b
    return tl.where(r != 0, tl.where((r < 0) != (b < 0), r + b, r), r)


@device_fn
def float_remainder(a, b):
    """``a - b * floor(a / b)`` (torch.remainder of floats)."""
    return a - b * tl.floor(a / b)


@device_fn
def power(a, b):
    """``a ** b`` of floats: ``|a| ** b`` by ``exp2``/``log2``, with the sign of
    a negative base to an odd integer power, NaN for a negative base to a
    non-integer power, and ``0 ** b`` as 0, 1 or inf."""
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = (b - 2.0 * tl.floor(b * 0.5)) != 0.0
    negative = tl.where(whole, tl.where(odd, -mag, mag), float("nan"))
    out = tl.where(a < 0, negative, mag)
    zero = tl.where(b > 0, 0.0, tl.where(b == 0, 1.0, float("inf")))
    return tl.where(a == 0, zero, tl.where(b == 0, 1.0, out))

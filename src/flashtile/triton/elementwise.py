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
    """Round half to even (float), as ``torch.round``; from 2**23 on every
    float32 is an integer (and ``x + 0.5`` would round)."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    near = tl.where((r - x) == 0.5, tl.where(odd, r - 1.0, r), r)
    return tl.where(tl.abs(x) >= 8388608.0, x, near)


@device_fn
def log1p(x):
    """``log(1 + x)``, accurate for small ``x`` (``log(u) * x / (u - 1)``,
    ``u = 1 + x``, exact where ``u`` rounds to 1)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@device_fn
def expm1(x):
    """``exp(x) - 1``, accurate for small ``x`` (``(u - 1) * x / log(u)``,
    ``u = exp(x)``)."""
    u = tl.exp(x)
    small = tl.where(u == 1.0, x, (u - 1.0) * (x / tl.log(u)))
    return tl.where(tl.abs(x) < 0.5, small, u - 1.0)


@device_fn
def int_floordiv(a, b):
    """``a // b`` of integers, rounded toward minus infinity (Python's, torch's)."""
    q = a // b
    return tl.where((a % b) != 0, tl.where((a < 0) != (b < 0), q - 1, q), q)


@device_fn
def remainder(a, b):
    """``a % b`` with the divisor's sign (Python's, torch's), of integers or
    floats: Triton's ``%`` is C's (the dividend's sign; exact for floats)."""
    r = a % b
    return tl.where(r != 0, tl.where((r < 0) != (b < 0), r + b, r), r)


@device_fn
def float_floordiv(a, b):
    """``a // b`` of floats, as Python and torch compute it: from the exact
    remainder, not from a rounded quotient (``1.0 // 0.1`` is 9)."""
    mod = a % b
    div = (a - mod) / b
    div = tl.where(mod != 0, tl.where((b < 0) != (mod < 0), div - 1.0, div), div)
    whole = tl.floor(div)
    return tl.where(div - whole > 0.5, whole + 1.0, whole)


@device_fn
def power(a, b):
    """``a ** b`` of floats: ``|a| ** b`` by ``exp2``/``log2``, with the sign of
    a negative base to an odd integer power, NaN for a negative base to a
    non-integer power, and ``0 ** b`` as 0, 1 or inf (``-0.0`` to an odd
    power keeps its sign)."""
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = (b - 2.0 * tl.floor(b * 0.5)) != 0.0
    negative = tl.where(whole, tl.where(odd, -mag, mag), float("nan"))
    out = tl.where(a < 0, negative, mag)
    zero = tl.where(b > 0, 0.0, tl.where(b == 0, 1.0, float("inf")))
    zero = tl.where(1.0 / a < 0, tl.where(whole, tl.where(odd, -zero, zero), zero), zero)  # (-0.0)
    out = tl.where(a == 0, zero, out)
    return tl.where(b == 0, 1.0, tl.where(a == 1.0, 1.0, out))  # (nan ** 0, 1 ** nan: 1)

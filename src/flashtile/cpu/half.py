"""bfloat16 inside the kernels: bit patterns in ``uint16`` arrays, widened and rounded here.

Numba has no bfloat16 type, so a bf16 array (``ml_dtypes.bfloat16`` or a
torch tensor's storage) reaches a kernel as a ``uint16`` view of the same
memory: no copy. A bf16 number is the top half of a float32, so widening is
a 16-bit shift (exact) and narrowing rounds the low half away to nearest
even (:func:`bf16_bits`). Both are LLVM bit operations, so loops over them
vectorise.

Inside the forward kernel's arrays a ``uint16`` element is always a bf16
pattern (float16 inputs are widened to float32 before they reach it). The
helpers below dispatch on the array dtype at compile time, so one kernel
source serves float32, float64 and bf16 storage:

* :func:`widen`: an element as a number (bf16 -> float32; floats unchanged);
* :func:`narrow`: a number as an element of a given array (rounded to bf16
  for ``uint16``; floats unchanged); :func:`narrow_operand` the same for a
  product's operand, by the CPU's conversion instruction where it has one;
* :func:`split_scale`: where the score scale goes (into the float query
  tile, or, for bf16 operands, into the ``gemm``'s ``alpha`` so the queries
  are not rounded a second time);
* :func:`prob_buffer` / :func:`prob_tile`: where the softmax writes ``P``,
  the value product's operand (rounded to bf16 into its own buffer as it is
  computed, as FlashAttention does on GPUs, or in place over float scores).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import config
from numba.extending import intrinsic, overload

from .._validate import BFLOAT16
from . import FASTMATH
from .vectors import wide_vectors


class _BFloat(ir.types._BaseFloatType):
    """LLVM's ``bfloat`` type, which llvmlite's IR builder does not name."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()


def target_has(*features: str) -> bool:
    """Whether the CPU Numba compiles for has any of ``features`` (LLVM names,
    e.g. ``"avx512bf16"``), by Numba's own rule: ``NUMBA_CPU_FEATURES`` when
    set (``""`` under ``NUMBA_CPU_NAME=generic``: none), else the host's.

    Code that needs an instruction LLVM would otherwise lower to a runtime
    helper (which Numba does not link) asks this first. Numba's cache is
    keyed by the CPU's name and features, so code built one way is never
    loaded on the other kind.
    """
    have = config.CPU_FEATURES
    if have is None:
        have = binding.get_host_cpu_features().flatten()
    return any(f"+{name}" in have.split(",") for name in features)


def _converts_bf16() -> bool:
    """Whether one instruction rounds float32 to bf16 (AVX512-BF16's
    ``vcvtneps2bf16``, or AVX-NE-CONVERT); elsewhere the rounding is spelled
    out in integer operations."""
    return target_has("avx512bf16", "avxneconvert")


#: One instruction rounds float32 to bf16 here (:func:`_converts_bf16`).
HARDWARE_BF16 = _converts_bf16()


@intrinsic
def bf16_value(typingctx, bits):
    """The float32 value of the bf16 pattern ``bits`` (uint16): exact."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.zext(builder.trunc(args[0], ir.IntType(16)), i32)
        return builder.bitcast(builder.shl(v, i32(16)), ir.FloatType())

    return types.float32(bits), codegen


def _round_to_bf16(builder, f):
    """IR: the bf16 pattern (i16) nearest to the float32 value ``f``, ties to even.

    Adds ``0x7fff`` plus the lowest kept bit, then drops the low 16 bits; a
    NaN keeps its sign and top mantissa bits and is made quiet (adding could
    carry it into infinity).
    """
    i32, i16 = ir.IntType(32), ir.IntType(16)
    u = builder.bitcast(f, i32)
    lsb = builder.and_(builder.lshr(u, i32(16)), i32(1))
    rounded = builder.lshr(builder.add(u, builder.add(lsb, i32(0x7FFF))), i32(16))
    quiet_nan = builder.or_(builder.lshr(u, i32(16)), i32(0x40))
    is_nan = builder.icmp_unsigned(">", builder.and_(u, i32(0x7FFFFFFF)), i32(0x7F800000))
    return builder.trunc(builder.select(is_nan, quiet_nan, rounded), i16)


def _float32_arg(builder, x):
    return x if x.type == ir.FloatType() else builder.fptrunc(x, ir.FloatType())


@intrinsic
def bf16_bits(typingctx, x):
    """The bf16 pattern (uint16) nearest to the float32 ``x``, ties to even,
    exactly as ``ml_dtypes`` rounds (denormals included): for what a caller
    receives (outputs, gradients)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        return _round_to_bf16(builder, _float32_arg(builder, args[0]))

    return types.uint16(x), codegen


@intrinsic
def bf16_operand_bits(typingctx, x):
    """:func:`bf16_bits` for a product's operand inside a kernel (``P``, ``dS``).

    Where the CPU has the instruction (:data:`HARDWARE_BF16`) LLVM's
    ``fptrunc`` to ``bfloat`` emits it: one instruction for eight or sixteen
    values against some ten integer operations, the same rounding, except
    that float32 denormals (below 1.2e-38) become zero, a difference no
    product of probabilities or score gradients can see.
    """
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        f = _float32_arg(builder, args[0])
        if HARDWARE_BF16:
            return builder.bitcast(builder.fptrunc(f, _BFloat()), ir.IntType(16))
        return _round_to_bf16(builder, f)

    return types.uint16(x), codegen


def widen(x):
    """An array element as a number: bf16 bits (uint16) -> float32, floats as they are."""
    raise NotImplementedError("widen is only available inside Numba kernels")


@overload(widen, fastmath=FASTMATH, inline="always")
def _widen(x):
    if x == types.uint16:
        return lambda x: bf16_value(x)
    if isinstance(x, types.Float):
        return lambda x: x
    return None


def narrow(x, like):
    """``x`` as an element of array ``like``: rounded to bf16 bits for uint16, else as is."""
    raise NotImplementedError("narrow is only available inside Numba kernels")


def narrow_operand(x, like):
    """:func:`narrow` for a product's operand (bf16 via :func:`bf16_operand_bits`)."""
    raise NotImplementedError("narrow_operand is only available inside Numba kernels")


def _narrowing(to_bits):
    """The overload of :func:`narrow` or :func:`narrow_operand`: one dtype
    rule (bf16 bits for ``uint16``, floats as they are) for either rounding."""

    def overload_impl(x, like):
        if like.dtype == types.uint16:
            return lambda x, like: to_bits(np.float32(x))
        return lambda x, like: x

    return overload_impl


overload(narrow, fastmath=FASTMATH, inline="always")(_narrowing(bf16_bits))
overload(narrow_operand, fastmath=FASTMATH, inline="always")(_narrowing(bf16_operand_bits))


def work_empty(shape, q):
    """``np.empty(shape)`` in the work dtype of operands like ``q``: float32
    for bf16 bits (``uint16``), else ``q``'s own float dtype."""
    raise NotImplementedError("work_empty is only available inside Numba kernels")


@overload(work_empty, fastmath=FASTMATH, inline="always")
def _work_empty(shape, q):
    if q.dtype == types.uint16:
        return lambda shape, q: np.empty(shape, dtype=np.float32)
    return lambda shape, q: np.empty(shape, dtype=q.dtype)


def split_scale(q, work, c):
    """``(q_mult, s_mult)``: scores are ``s_mult * (q_mult * Q) K^T``, with
    ``q_mult * s_mult = c``; both in the dtype of the ``work`` array."""
    raise NotImplementedError("split_scale is only available inside Numba kernels")


@overload(split_scale, fastmath=FASTMATH)
def _split_scale(q, work, c):
    if q.dtype == types.uint16:  # bf16 operands: scale the product, not the rounded queries
        return lambda q, work, c: (work.dtype.type(1.0), work.dtype.type(c))
    return lambda q, work, c: (work.dtype.type(c), work.dtype.type(1.0))


def prob_buffer(q, n, floats):
    """A flat buffer for ``n`` rounded probabilities when ``q`` holds bf16,
    else an empty view of the float buffer ``floats`` (no allocation)."""
    raise NotImplementedError("prob_buffer is only available inside Numba kernels")


@overload(prob_buffer, fastmath=FASTMATH)
def _prob_buffer(q, n, floats):
    if q.dtype == types.uint16:
        return lambda q, n, floats: np.empty(n, dtype=np.uint16)
    return lambda q, n, floats: floats[:0]


def prob_tile(s, p_buf):
    """Where the softmax writes the probabilities of the scores ``s (rows, n)``:
    a C-contiguous ``(rows, n)`` view of ``p_buf`` for bf16 (``uint16``, from
    :func:`prob_buffer`; rounded as they are computed, the scores kept), else
    ``s`` itself (in place)."""
    raise NotImplementedError("prob_tile is only available inside Numba kernels")


@overload(prob_tile, fastmath=FASTMATH, inline="always")
def _prob_tile(s, p_buf):
    if p_buf.dtype == types.uint16:
        return lambda s, p_buf: p_buf[: s.shape[0] * s.shape[1]].reshape(s.shape)
    return lambda s, p_buf: s


@njit(fastmath=FASTMATH, cache=True)
def _round_all(src, dst):
    wide_vectors()
    for i in range(src.size):
        dst[i] = bf16_bits(src[i])


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """A float32 array rounded to ``ml_dtypes.bfloat16`` exactly as ml_dtypes
    rounds (:func:`bf16_bits`), by a compiled loop: ``astype`` took 1.0 ms for
    half a million values here, this 0.2 ms."""
    out = np.empty(a.shape, np.uint16)
    _round_all(np.ascontiguousarray(a, dtype=np.float32).reshape(-1), out.reshape(-1))
    return out.view(BFLOAT16)

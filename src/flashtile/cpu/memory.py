"""Memory helpers for the decode kernel: software prefetch and 16-bit cache loads.

Decoding is a stream: each K/V row is read once, with a few FMAs per byte.
The hardware prefetchers alone leave each core waiting on DRAM between tiles
(measured: 15.7 GB/s of the machine's ~23 GB/s). :func:`prefetch_rows`
asks for the *next* tile's cache lines while the current one is computed,
which closes most of that gap (20.9 GB/s in the same run).

Numba has no float16 arrays, so a float16 cache travels as its ``uint16``
bit patterns and :func:`load_half` widens them with LLVM's own
``half`` type (18 G elements/s per core here, against 4 for a bit-twiddling
version in Numba, whose int32 arithmetic is promoted to int64). A bfloat16
cache travels as ``uint16`` too; its patterns are the top halves of float32s,
widened by a 16-bit shift (:func:`.half.bf16_value`).

Both formats reach the kernel as ``uint16``, so the kernel cannot tell them
apart from the array: :func:`cache_operands` (the one rule) pairs each cache
with a *format flag*, an instance of :class:`FloatValues`,
:class:`Float16Bits` or :class:`BFloat16Bits`. Each is its own Numba type,
so the conversion is chosen at compile time and a flag that does not match
the array's dtype fails to compile instead of misreading the bits. A
prepared decode step keeps its answer (:func:`.launch.decode_launch`).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from . import FASTMATH
from .half import bf16_value, target_has

#: Bytes per cache line on x86-64.
CACHE_LINE = 64


def _item_pointer(context, builder, signature, args):
    """LLVM pointer to ``arr[index]`` for an intrinsic called as ``f(arr, index)``."""
    aty = signature.args[0]
    ary = context.make_array(aty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to load the cache line holding ``arr[index]`` (1-D array).

    Compiles to one ``prefetcht0``; it never faults, so an index past the end
    is harmless (but pointless).
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature, args)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw = read, locality = 3 (keep in all levels), cache = data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def unmanaged(typingctx, arr):
    """``arr`` itself without its reference count: the same data, shape and
    strides, with no meminfo, so that Numba's increments and decrements of
    it do nothing (a test of a null pointer, or no call at all where LLVM
    sees the null).

    For the arrays of a per-key loop. Numba takes and drops a reference for
    each row view and for each inlined helper whose arguments its pruning
    pass cannot pair up, and each is an atomic update of the array's count (a
    locked instruction, which also holds back the loads of the stream behind
    it). In the row walks of decoding they took a fifth of a step's samples
    (perf, (1, 12, 1, 64) against 2048 keys on the AVX2 AMD EPYC).

    Safe for the arguments of a function that Numba calls (never inlined,
    ``inline="never"``, the default): its caller holds them until it
    returns. Inlined into its caller, an argument may be a temporary that
    Numba frees right after this call. The result must not outlive what it
    aliases: never returned, stored or boxed to Python (an array with no
    owner)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
        return ary._getvalue()

    return arr(arr), codegen


@njit(fastmath=FASTMATH, cache=True)
def prefetch_rows(a, j0, j1):
    """Prefetch rows ``[j0, j1)`` of the 2-D C-contiguous array ``a``."""
    step = max(1, CACHE_LINE // a.itemsize)
    for j in range(j0, j1):
        row = a[j]
        for c in range(0, row.shape[0], step):
            prefetch(row, c)


@intrinsic
def load_half(typingctx, arr, index):
    """``float32`` of the float16 whose bit pattern is ``arr[index]`` (uint16 1-D).

    A load of LLVM's ``half`` type and an ``fpext`` to float: exact (IEEE
    widening keeps subnormals, infinities and NaNs), and in a loop LLVM
    vectorises it to the hardware's conversion (``vcvtph2ps`` with F16C).
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint16):
        return None
    sig = types.float32(arr, index)

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature, args)
        if HARDWARE_F16:
            half = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()))
            return builder.fpext(half, ir.FloatType())
        return _widen_half_bits(builder, builder.load(ptr))

    return sig, codegen


#: Whether LLVM widens float16 with an instruction here (F16C's ``vcvtph2ps``);
#: without it ``fpext`` from ``half`` becomes a call to a helper Numba does
#: not link (``NUMBA_CPU_NAME=generic``), so :func:`_widen_half_bits` is used.
HARDWARE_F16 = target_has("f16c", "avx512fp16")


def _widen_half_bits(builder, bits):
    """IR: the float32 of the float16 pattern ``bits`` (i16), in integer
    operations: exact for normals, subnormals, zeros, infinities and NaNs."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    h = builder.zext(bits, i32)
    sign = builder.shl(builder.and_(h, i32(0x8000)), i32(16))
    mag = builder.and_(h, i32(0x7FFF))
    shifted = builder.shl(mag, i32(13))
    normal = builder.add(shifted, i32((127 - 15) << 23))  # rebias the exponent
    special = builder.or_(shifted, i32(0x7F800000))  # inf, NaN (payload kept)
    tiny = builder.fmul(builder.sitofp(mag, f32), ir.Constant(f32, 2.0**-24))  # subnormal, 0
    body = builder.select(
        builder.icmp_unsigned(">=", mag, i32(0x7C00)),
        special,
        builder.select(
            builder.icmp_unsigned(">=", mag, i32(0x0400)), normal, builder.bitcast(tiny, i32)
        ),
    )
    return builder.bitcast(builder.or_(body, sign), f32)


def load_value(row, c, fmt):
    """``row[c]`` as a number, read in the format ``fmt`` (a flag below): float
    values as they are, 16-bit patterns (``uint16``) widened exactly to
    float32. A flag that does not fit the row's dtype does not compile."""
    raise NotImplementedError("load_value is only available inside Numba kernels")


def is_flag(fmt, flag) -> bool:
    """Whether the Numba type ``fmt`` is the flag class ``flag`` (a format
    flag here; the decode walk flags of :mod:`.cache_rows` too)."""
    return isinstance(fmt, types.BaseNamedTuple) and fmt.instance_class is flag


@overload(load_value, fastmath=FASTMATH, inline="always")
def _load_value(row, c, fmt):
    bits = row.dtype == types.uint16
    if bits and is_flag(fmt, Float16Bits):
        return lambda row, c, fmt: load_half(row, c)
    if bits and is_flag(fmt, BFloat16Bits):
        return lambda row, c, fmt: bf16_value(row[c])
    if bits or not is_flag(fmt, FloatValues):  # never guess what 16 bits mean
        raise TypingError(f"a {row.dtype} cache does not match the format flag {fmt}")
    return lambda row, c, fmt: row[c]


class FloatValues(NamedTuple):
    """Format flag: the cache holds float32 or float64 values, read as they are."""


class Float16Bits(NamedTuple):
    """Format flag: the ``uint16`` cache holds float16 bit patterns."""


class BFloat16Bits(NamedTuple):
    """Format flag: the ``uint16`` cache holds bfloat16 bit patterns."""


_BITS = {np.dtype(np.float16): Float16Bits(), np.dtype(ml_dtypes.bfloat16): BFloat16Bits()}


def cache_operands(k, v):
    """``(k, v, flag)`` as the decode kernel takes a cache of any supported dtype:
    float32/float64 arrays as they are with :class:`FloatValues`, 16-bit
    ones as ``uint16`` views of the same memory (no copy) with the flag of
    their format."""
    flag = _BITS.get(k.dtype)
    if flag is None:
        return k, v, FloatValues()
    return k.view(np.uint16), v.view(np.uint16), flag

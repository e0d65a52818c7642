"""Memory helpers for the decode kernel: software prefetch and float16 loads.

Decoding is a stream: each K/V row is read once, with a few FMAs per byte.
The hardware prefetchers alone leave each core waiting on DRAM between tiles
(measured: 15.7 GB/s of the machine's ~23 GB/s). :func:`prefetch_rows`
asks for the *next* tile's cache lines while the current one is computed,
which closes most of that gap (20.9 GB/s in the same run).

Numba has no float16 arrays, so a float16 cache travels as its ``uint16``
bit patterns and :func:`half_row_to_float` widens them with LLVM's own
``half`` type (18 G elements/s per core here, against 4 for a bit-twiddling
version in Numba, whose int32 arithmetic is promoted to int64).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import FASTMATH

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
        half = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()))
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@njit(fastmath=FASTMATH, cache=True)
def half_row_to_float(src, dst):
    """``dst[:] = the float16 values whose bit patterns are src (uint16)``, exactly."""
    for c in range(src.shape[0]):
        dst[c] = load_half(src, c)

"""What AMX tiles deliver on this CPU, against oneMKL's bf16 products.

flashtile's bf16 tile products go to oneMKL's ``gemm_bf16bf16f32``, which
uses AMX where the CPU has it. This script asks whether a product written
directly on the tiles would do better at attention's tile shapes, which is
the one way left to speed up the bf16 forward on such CPUs. It emits the
tile instructions from Numba through LLVM's AMX intrinsics (nothing here is
part of the library) and times, on one core, in GFLOP/s:

* ``tdpbf16ps`` alone, the four accumulators of a 2 x 2 block fed by tiles
  already loaded (the multiply rate);
* the same block with its four tile loads per step from L1 (the rate of a
  product whose operands are already in AMX's layouts and in L1), at 2 and
  16 steps of K = 32;
* the whole product from pre-packed operands, C stored: the best case for a
  hand-written tile loop (no packing counted) at the forward's tile shapes;
* oneMKL's ``gemm_bf16bf16f32`` at the same shapes, packing included.

Usage: ``python scripts/amx_rates.py [rounds]`` (Linux x86-64 with AMX-BF16;
oneMKL installed for the last rows). Medians of shuffled interleaved rounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from flashtile.cpu.blas import bf16_library, bf16_products, gemm_for, gemm_scaled
from flashtile.cpu.blas_threads import single_threaded
from flashtile.cpu.half import target_has

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_BYTES = _I8.as_pointer()


def _emit(builder, name, argtypes, args):
    function = ir.FunctionType(ir.VoidType(), argtypes)
    builder.call(cgutils.get_or_insert_function(builder.module, function, name), args)


@intrinsic
def tile_config(typingctx, config):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        _emit(builder, "llvm.x86.ldtilecfg", [_BYTES], [builder.bitcast(data, _BYTES)])
        return context.get_dummy_value()

    return types.void(config), codegen


@intrinsic
def tile_release(typingctx):
    def codegen(context, builder, signature, args):
        _emit(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


def _memory(name, tile):
    """``name`` (tile load or store) of tile ``tile`` at ``array[i, j]``, row stride the array's."""

    @intrinsic
    def op(typingctx, array, i, j):
        def codegen(context, builder, signature, args):
            aty = signature.args[0]
            ary = context.make_array(aty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, args[1:], wraparound=False)
            stride = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
            address = builder.bitcast(ptr, _BYTES)
            _emit(builder, name, [_I8, _BYTES, _I64], [_I8(tile), address, stride])
            return context.get_dummy_value()

        return types.void(array, i, j), codegen

    return op


def _register(name, *tiles):
    @intrinsic
    def op(typingctx):
        def codegen(context, builder, signature, args):
            _emit(builder, name, [_I8] * len(tiles), [_I8(t) for t in tiles])
            return context.get_dummy_value()

        return types.void(), codegen

    return op


# Tiles 0-3: a 2 x 2 block of accumulators; 4, 5: A's row blocks; 6, 7: B's column blocks.
LOAD = [_memory("llvm.x86.tileloadd64", t) for t in range(8)]
STORE = [_memory("llvm.x86.tilestored64", t) for t in range(4)]
ZERO = [_register("llvm.x86.tilezero", t) for t in range(4)]
PAIRS = ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7))  # (accumulator, A tile, B tile)
DOT = [_register("llvm.x86.tdpbf16ps", c, a, b) for c, a, b in PAIRS]
load_a0, load_a1, load_b0, load_b1 = LOAD[4:]
dot0, dot1, dot2, dot3 = DOT
zero0, zero1, zero2, zero3 = ZERO
store0, store1, store2, store3 = STORE

CONFIG = np.zeros(64, dtype=np.uint8)
CONFIG[0] = 1  # palette 1; every tile 16 rows of 64 bytes
CONFIG[16:32:2] = 64
CONFIG[48:56] = 16


@njit
def dots_only(a, b, n):
    """``n`` steps of four ``tdpbf16ps`` on tiles loaded once: ``a (32, 32)``, ``b (16, 64)``."""
    tile_config(CONFIG)
    load_a0(a, 0, 0)
    load_a1(a, 16, 0)
    load_b0(b, 0, 0)
    load_b1(b, 0, 32)
    zero0(), zero1(), zero2(), zero3()
    for _ in range(n):
        dot0(), dot1(), dot2(), dot3()
    tile_release()


@njit
def dots_with_loads(a, b, n, steps):
    """``n`` 32 x 32 blocks of ``a (32, 32 steps) @ packed b (16 steps, 64)``, all from L1."""
    tile_config(CONFIG)
    for _ in range(n):
        zero0(), zero1(), zero2(), zero3()
        for s in range(steps):
            load_a0(a, 0, 32 * s)
            load_a1(a, 16, 32 * s)
            load_b0(b, 16 * s, 0)
            load_b1(b, 16 * s, 32)
            dot0(), dot1(), dot2(), dot3()
    tile_release()


@njit
def tile_product(a, b, c, reps):
    """``c = a @ B`` from packed operands: ``a (m, k)`` row-major bf16,
    ``b (k / 2, 2 n)`` in AMX's pair layout; 32 x 32 blocks of ``c`` (m, n
    and k multiples of 32)."""
    steps = a.shape[1] // 32
    for _ in range(reps):
        tile_config(CONFIG)
        for j in range(0, c.shape[1], 32):
            for i in range(0, c.shape[0], 32):
                zero0(), zero1(), zero2(), zero3()
                for s in range(steps):
                    load_a0(a, i, 32 * s)
                    load_a1(a, i + 16, 32 * s)
                    load_b0(b, 16 * s, 2 * j)
                    load_b1(b, 16 * s, 2 * j + 32)
                    dot0(), dot1(), dot2(), dot3()
                store0(c, i, j)
                store1(c, i, j + 16)
                store2(c, i + 16, j)
                store3(c, i + 16, j + 16)
        tile_release()


@njit
def mkl_product(fn, a, b, c, trans_b, reps):
    for _ in range(reps):
        gemm_scaled(fn, a, b, c, False, trans_b, 1.0, 0.0)


def _bits(rng, shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16)


def main(rounds: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if not (target_has("amx-tile") and target_has("amx-bf16")):
        sys.exit("this CPU has no AMX-BF16")
    request = (ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18))
    if libc.syscall(*request) != 0:  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
        sys.exit("the kernel did not grant this process AMX's tile state")
    rng = np.random.default_rng(0)
    block = 4 * 16 * 16 * 32 * 2  # flops of one step: four 16 x 16 x 32 products
    a_tiles, b_tiles = _bits(rng, (32, 32)), _bits(rng, (16, 64))
    cases = {"tdpbf16ps alone": (lambda r: dots_only(a_tiles, b_tiles, 2000 * r), 2000 * block)}
    for steps in (2, 16):
        a, b = _bits(rng, (32, 32 * steps)), _bits(rng, (16 * steps, 64))
        cases[f"with tile loads, L1, {steps} steps"] = (
            lambda r, a=a, b=b, s=steps: dots_with_loads(a, b, 2000 // s * r, s),
            2000 // steps * steps * block,
        )
    for m, n, k, trans_b in ((256, 512, 64, True), (256, 64, 512, False)):
        flops = 2 * m * n * k
        a, c = _bits(rng, (m, k)), np.zeros((m, n), np.float32)
        packed = _bits(rng, (k // 2, 2 * n))
        cases[f"tile loop {m}x{n}x{k}, packed"] = (
            lambda r, a=a, p=packed, c=c: tile_product(a, p, c, 10 * r),
            10 * flops,
        )
        if bf16_products():
            fn = gemm_for(ml_dtypes.bfloat16).address
            b = _bits(rng, (n, k) if trans_b else (k, n))
            cases[f"{bf16_library()} bf16 gemm {m}x{n}x{k}"] = (
                lambda r, a=a, b=b, c=c, t=trans_b, fn=fn: mkl_product(fn, a, b, c, t, 10 * r),
                10 * flops,
            )
    entry = gemm_for(ml_dtypes.bfloat16) if bf16_products() else None
    pinned = contextlib.nullcontext() if entry is None else single_threaded(entry)
    with pinned:  # one core for oneMKL too, whatever its threading
        _time(cases, rounds, rng)


def _time(cases, rounds, rng) -> None:
    for run, _ in cases.values():
        run(1)
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name in rng.permutation(list(cases)):
            start = time.perf_counter()
            cases[name][0](5)
            times[name].append((time.perf_counter() - start) / 5)
    print(f"one core, medians of {rounds} shuffled rounds")
    for name, (_, flops) in cases.items():
        print(f"{name:42s} {flops / np.median(times[name]) / 1e9:7.0f} GFLOP/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)

"""Calling a user's compiled score and mask functions from inside the kernels.

A ``score_mod`` or ``mask_mod`` (:mod:`flashtile.mods`) is compiled into
*row functions*: C-callable functions that transform one row of scores at a
time. The kernels hold only their addresses (integers in
:class:`.tiles.KernelVariants`, 0 = off) and call them through
:func:`call_row`, so one compiled kernel serves every mod: a new mod compiles
its few small row functions, never the kernel.

Every row function has the one signature (ten machine words)::

    row(s, aux, n, b, h, i, col0, floats, ints, grads)

``s``/``aux`` point at ``n`` scores (and a second row: the chain factors or
the raw scores) of query ``i`` of query head ``h`` in batch entry ``b``,
against keys ``col0, col0 + 1, ...``; ``floats``/``ints`` at the mod's
captured tables, flattened; ``grads`` at the gradient buffer of the captured
float tables (the backward's captured-gradient function only).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL
from . import FASTMATH


@intrinsic
def call_row(typingctx, address, s, aux, n, b, h, i, col0, floats, ints, grads):
    """Call the row function at ``address`` with the ten integer arguments
    (pointers as integers: ``array.ctypes.data``)."""
    arguments = (address, s, aux, n, b, h, i, col0, floats, ints, grads)
    if not all(isinstance(t, types.Integer) for t in arguments):
        return None
    sig = types.void(*(types.unliteral(t) for t in arguments))

    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        values = [
            context.cast(builder, a, t, types.int64)
            for a, t in zip(args[1:], signature.args[1:], strict=True)
        ]
        function = ir.FunctionType(ir.VoidType(), [word] * len(values))
        target = builder.inttoptr(args[0], function.as_pointer())
        builder.call(target, values)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=FASTMATH, cache=True, inline="always")
def pointer(a):
    """The address of an array's first element, 0 for an empty array."""
    return np.int64(a.ctypes.data) if a.size > 0 else np.int64(0)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def mask_states(count_fn, batch, heads, tq, tk, block_q, block_k, floats, ints):
    """``(batch, heads, ceil(tq/block_q), ceil(tk/block_k))`` int8 tile states
    (``TILE_*``) of a compiled mask, counted row by row by ``count_fn`` (the
    float64 ``mask_count`` row function's address: ``aux[0]`` = kept keys); a tile stops being read
    once it has shown kept and hidden keys (partial). Memory: the states."""
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    states = np.empty((batch, heads, nq, nk), dtype=np.int8)
    fp, ip = pointer(floats), pointer(ints)
    for job in prange(batch * heads * nq):
        b, rest = job // (heads * nq), job % (heads * nq)
        h, qb = rest // nq, rest % nq
        count = np.zeros(1, dtype=np.float64)
        i0, i1 = qb * block_q, min(qb * block_q + block_q, tq)
        for kb in range(nk):
            j0 = kb * block_k
            n = min(block_k, tk - j0)
            kept, seen = 0, 0
            for i in range(i0, i1):
                call_row(count_fn, 0, count.ctypes.data, n, b, h, i, j0, fp, ip, 0)
                kept += int(count[0])
                seen += n
                if 0 < kept < seen:
                    break  # partial: the rest cannot change that
            full = kept == (i1 - i0) * n
            states[b, h, qb, kb] = TILE_FULL if full else (TILE_PARTIAL if kept else TILE_EMPTY)
    return states

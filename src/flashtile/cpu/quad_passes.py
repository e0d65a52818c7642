"""Four query rows against two keys per step: the row walk's passes in LLVM IR.

A GQA group of four query heads (or four queries of one head) reads each key
row once for four dot products and each value row once for four accumulator
rows (:mod:`.cache_rows`). Written as Numba loops, those passes ran at
under half of what the core's FMAs allow: each loop over a row's elements
has a runtime length, so LLVM wraps it in alias checks and remainder loops,
and the score pass reduces four vector sums to scalars for every key. Here the
loops are written in LLVM IR over 8-float vectors (any head dim that is a
multiple of 8; AVX2 registers, and the same code on AVX-512 CPUs):

- :func:`quad_scores`: for two keys at once, eight vector sums (four rows by
  two keys) over the row, each key element loaded once and each query
  element once per two keys; the eight sums are reduced together, as a
  transpose (three rounds of pairwise shuffles and adds), into eight
  scores;
- :func:`quad_values`: for two keys at once, each accumulator vector of the
  four rows loaded, given both keys' weighted value vectors, and stored.

Each call reads the rows of one run, two rows side by side
(:func:`.row_passes.quad_run`): the two halves of a long page's run
(:func:`halves`; a contiguous cache is one long page; in the pieces of
:func:`.row_passes.quad_steps`), neighbours in a short one, or neighbouring
rows of one kv head in a run of consecutive tokens of one-token pages
(flash-attn's layout), ``kv heads * d`` elements apart
(:func:`.cache_heads.head_quads`). Over a long run (a contiguous cache, a
run of tokens) each row read prefetches the row :data:`FETCH_ROWS` on.
Cache formats: float32, bf16 bit patterns (widened by a shift) and float16
patterns where the CPU converts them (F16C); :func:`has_quads` says whether
a call's types and width have these passes, and compiles to a constant
where the types decide. Measured: docs/decoding.md, "Four query rows in
LLVM IR".
"""

from __future__ import annotations

import contextlib

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import FASTMATH
from .memory import HARDWARE_F16, BFloat16Bits, Float16Bits, FloatValues, is_flag

#: Floats per vector of the passes.
LANES = 8
#: Query rows per pass.
QUAD = 4
#: Rows ahead that a pass over a long run prefetches (the callers' ``fetch``,
#: in elements): the two rows read side by side are two streams, which the
#: hardware prefetcher follows worse than one (one thread streaming GQA 32/8,
#: d 128, from memory, AVX2 AMD EPYC: the score pass 10.2 GB/s without,
#: 13.6 with, the Numba pass 12.6-14.5).
FETCH_ROWS = 4


@njit(cache=True, inline="always")
def halves(keys):
    """The ``gap`` that reads a run of ``keys`` keys as its two halves side by
    side (:func:`quad_scores`): two streams far apart, where the hardware
    prefetcher follows neighbouring rows as two streams in one place. One
    thread streaming a contiguous cache from memory (GQA 32/8, d 128, AVX2
    AMD EPYC): the score pass 14.7 GB/s over neighbours in runs of 32 keys,
    25.2 over the halves of runs of 256 (27.1 of 1024); the value pass 14.3
    and 19.1. Over flash-attn's one-token pages, whose neighbours already
    lie ``kv heads * d`` apart, neighbours read faster (17.4 against 15.0
    GB/s)."""
    return (keys + 1) // 2


_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, LANES)
_FAST = tuple(sorted(FASTMATH))  # (the kernels' flags: no nnan/ninf, see cpu/__init__.py)


def _rows(a) -> bool:
    """Whether ``a`` is a C-contiguous 2-D float32 array type (rows the passes
    address by their first stride, elements one apart)."""
    return (
        isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C"
        and a.dtype == types.float32
    )  # fmt: skip


def _supported(q, other, flat, fmt) -> bool:
    """Whether the passes exist for float32 row tiles ``q`` and ``other`` (the
    scores or the weights; :func:`_rows`) and a flat cache of ``flat``'s
    dtype read as ``fmt`` (a Numba type check)."""
    if not (_rows(q) and _rows(other)):
        return False
    if not (isinstance(flat, types.Array) and flat.ndim == 1 and flat.layout == "C"):
        return False
    if flat.dtype == types.float32:
        return is_flag(fmt, FloatValues)
    if flat.dtype == types.uint16:
        return is_flag(fmt, BFloat16Bits) or (is_flag(fmt, Float16Bits) and HARDWARE_F16)
    return False


def has_quads(q, other, flat, fmt, width):
    """Whether :func:`quad_scores` (``q`` the queries, ``other`` the scores)
    or :func:`quad_values` (the accumulators and the weights) run for these
    operands: the types have the passes (:func:`_supported`) and ``width``
    is a multiple of :data:`LANES`. Only callable from compiled code."""
    raise NotImplementedError("has_quads is only available inside Numba kernels")


@overload(has_quads, inline="always")
def _has_quads(q, other, flat, fmt, width):
    if not _supported(q, other, flat, fmt):
        return lambda q, other, flat, fmt, width: False
    return lambda q, other, flat, fmt, width: width % LANES == 0


def _data(context, builder, array_type, value):
    """The data pointer of an array argument (its element type)."""
    return context.make_array(array_type)(context, builder, value).data


def _splat(builder, scalar):
    vector = builder.insert_element(ir.Constant(_VF, None), scalar, _I32(0))
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(_I32, LANES), [0] * 8))


def _load_floats(builder, pointer):
    return builder.load(builder.bitcast(pointer, _VF.as_pointer()), align=4)


def _load_row(builder, pointer, fmt):
    """:data:`LANES` cache elements from ``pointer`` (the cache's element type)
    as float32: as they are, or 16-bit patterns widened exactly."""
    if is_flag(fmt, FloatValues):
        return _load_floats(builder, pointer)
    if is_flag(fmt, Float16Bits):
        halves = ir.VectorType(ir.HalfType(), LANES)
        return builder.fpext(
            builder.load(builder.bitcast(pointer, halves.as_pointer()), align=2), _VF
        )
    bits = builder.load(
        builder.bitcast(pointer, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2
    )
    wide = builder.shl(
        builder.zext(bits, ir.VectorType(_I32, LANES)),
        ir.Constant(ir.VectorType(_I32, LANES), [16] * 8),
    )
    return builder.bitcast(wide, _VF)


def _prefetch(builder, pointer):
    """Hint the CPU to load the line of ``pointer`` (``prefetcht0``)."""
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(pointer, i8p), _I32(0), _I32(3), _I32(1)])


def _prefetch_rows(builder, rows, index, fetch):
    """Prefetch element ``index + fetch`` of each of ``rows`` (pointers), unless
    ``fetch`` is 0 (a branch on a loop invariant: LLVM takes it out of the
    loop)."""
    with builder.if_then(builder.icmp_signed("!=", fetch, _I64(0))):
        for row in rows:
            _prefetch(builder, builder.gep(row, [builder.add(index, fetch)]))


def _fma(builder, acc, x, y):
    """``acc + x * y`` with fast-math flags (one fused multiply-add)."""
    return builder.fadd(acc, builder.fmul(x, y, flags=_FAST), flags=_FAST)


class _Loop:
    """A counted IR loop ``for i in range(start, stop, step)`` with extra
    loop-carried values: ``with _Loop(...) as loop:`` emits the body at
    ``loop.index``; ``loop.carry(initial)`` declares a carried value (set the
    next iteration's with ``loop.next``); after the block, ``loop.results``
    holds each carried value's final value (its initial one when the loop
    ran no iteration)."""

    def __init__(self, builder, start, stop, step, name):
        self.builder, self.start, self.stop, self.step, self.name = builder, start, stop, step, name
        self._carried, self._next = [], []

    def __enter__(self):
        b = self.builder
        self.entry = b.block
        self.body = b.append_basic_block(f"{self.name}.body")
        self.done = b.append_basic_block(f"{self.name}.done")
        b.cbranch(b.icmp_signed("<", self.start, self.stop), self.body, self.done)
        b.position_at_end(self.body)
        self.index = b.phi(self.start.type)
        self.index.add_incoming(self.start, self.entry)
        return self

    def carry(self, initial):
        phi = self.builder.phi(initial.type)
        phi.add_incoming(initial, self.entry)
        self._carried.append((phi, initial))
        self._next.append(None)
        return phi

    def next(self, phi, value):
        self._next[[p for p, _ in self._carried].index(phi)] = value

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        b = self.builder
        following = b.add(self.index, self.step)
        end = b.block
        self.index.add_incoming(following, end)
        for (phi, _), value in zip(self._carried, self._next, strict=True):
            phi.add_incoming(value, end)
        b.cbranch(b.icmp_signed("<", following, self.stop), self.body, self.done)
        b.position_at_end(self.done)
        self.results = []
        for (_, initial), value in zip(self._carried, self._next, strict=True):
            out = b.phi(initial.type)
            out.add_incoming(initial, self.entry)
            out.add_incoming(value, end)
            self.results.append(out)
        return False


def _reduce8(builder, sums):
    """The eight lane sums of the eight vectors ``sums``, as one vector (element
    ``i`` the sum of ``sums[i]``): pairwise shuffles and adds, a transpose."""
    even = ir.Constant(ir.VectorType(_I32, LANES), [0, 2, 8, 10, 4, 6, 12, 14])
    odd = ir.Constant(ir.VectorType(_I32, LANES), [1, 3, 9, 11, 5, 7, 13, 15])

    def pair(a, b):
        return builder.fadd(
            builder.shuffle_vector(a, b, even), builder.shuffle_vector(a, b, odd), flags=_FAST
        )

    quads = [pair(pair(sums[i], sums[i + 1]), pair(sums[i + 2], sums[i + 3])) for i in (0, 4)]
    low = ir.Constant(ir.VectorType(_I32, LANES), [0, 1, 2, 3, 8, 9, 10, 11])
    high = ir.Constant(ir.VectorType(_I32, LANES), [4, 5, 6, 7, 12, 13, 14, 15])
    return builder.fadd(
        builder.shuffle_vector(quads[0], quads[1], low),
        builder.shuffle_vector(quads[0], quads[1], high),
        flags=_FAST,
    )


def _row_starts(context, builder, array_type, value, first, step):
    """Pointers to the :data:`QUAD` rows of an array argument that start at
    elements ``first + r * step``."""
    base = _data(context, builder, array_type, value)
    return [
        builder.gep(base, [builder.add(first, builder.mul(_I64(r), step))]) for r in range(QUAD)
    ]


@contextlib.contextmanager
def _pairs(builder, keys, gap):
    """Emit a loop over the first keys ``k`` of the pairs ``(k, k + gap)`` of
    ``keys`` keys, in blocks of ``2 * gap`` (``gap`` >= 1): yields ``k``."""
    with _Loop(builder, _I64(0), keys, builder.shl(gap, _I64(1)), "block") as block:
        end = builder.add(block.index, gap)
        end = builder.select(builder.icmp_signed("<", end, keys), end, keys)
        with _Loop(builder, block.index, end, _I64(1), "pair") as pair:
            yield pair.index


def _key_pair(builder, start, index, gap, stride, keys):
    """``(last, [row, its pair's row])`` of key ``index`` and key ``index +
    gap`` of the rows from ``start``, ``stride`` elements apart: ``last``
    whether ``index`` has no pair (``index + gap`` past the keys), whose
    pair's row is then its own row again (nothing past the run is read)."""
    last = builder.icmp_signed(">=", builder.add(index, gap), keys)
    first = builder.gep(start, [builder.mul(index, stride)])
    second = builder.gep(first, [builder.mul(gap, stride)])
    return last, [first, builder.select(last, first, second)]


@intrinsic
def _scores(
    typingctx, q, q0, q_step, flat, fmt, o, width, stride, keys, gap, s, s0, s_step, fetch
):  # fmt: skip
    """``s[s0 + r * s_step + k] = q[q0 + r * q_step :][:width] . flat[o + k * stride:][:width]``
    for the four rows ``r`` and the ``keys`` keys ``k`` (flat element
    offsets; ``width`` a multiple of :data:`LANES`), two keys per step, ``k``
    and ``k + gap`` (:func:`_pairs`; a key without a pair read twice, its
    second score not kept)."""
    if not _supported(q, s, flat, fmt):
        return None
    i64 = types.int64
    sig = types.void(q, i64, i64, flat, fmt, i64, i64, i64, i64, i64, s, i64, i64, i64)

    def codegen(context, builder, signature, args):
        q, q0, q_step, flat, _, o, width, stride, keys, gap, s, s0, s_step, fetch = args
        b = builder
        rows = _row_starts(context, b, signature.args[0], q, q0, q_step)
        start = b.gep(_data(context, b, signature.args[3], flat), [o])
        out = b.gep(_data(context, b, signature.args[10], s), [s0])
        with _pairs(b, keys, gap) as index:
            last, key = _key_pair(b, start, index, gap, stride, keys)
            with _Loop(b, _I64(0), width, _I64(LANES), "dot") as dot:
                sums = [dot.carry(ir.Constant(_VF, None)) for _ in range(2 * QUAD)]
                x = [_load_row(b, b.gep(k, [dot.index]), fmt) for k in key]
                _prefetch_rows(b, key, dot.index, fetch)
                for r in range(QUAD):
                    y = _load_floats(b, b.gep(rows[r], [dot.index]))
                    for k in range(2):
                        dot.next(sums[2 * r + k], _fma(b, sums[2 * r + k], y, x[k]))
            total = _reduce8(b, dot.results)  # (zeros for an empty row: the initial values)
            for r in range(QUAD):
                row = b.gep(out, [b.add(b.mul(_I64(r), s_step), index)])
                # The second key's score first: a key without a pair has its second
                # score land on its own place, which its first score then takes.
                second = b.select(last, row, b.gep(row, [gap]))
                b.store(b.extract_element(total, _I32(2 * r + 1)), second)
                b.store(b.extract_element(total, _I32(2 * r)), row)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _values(
    typingctx, acc, a0, a_step, p, p0, p_step, flat, fmt, o, width, stride, keys, gap, fetch
):  # fmt: skip
    """``acc[a0 + r * a_step + c] += sum_k p[p0 + r * p_step + k] * flat[o + k * stride + c]``
    for the four rows ``r``, ``c < width`` and the ``keys`` keys ``k``, two
    keys per step, ``k`` and ``k + gap`` (a key without a pair: its pair's
    row taken as zeros)."""
    if not _supported(acc, p, flat, fmt):
        return None
    i64 = types.int64
    sig = types.void(acc, i64, i64, p, i64, i64, flat, fmt, i64, i64, i64, i64, i64, i64)

    def codegen(context, builder, signature, args):
        acc, a0, a_step, p, p0, p_step, flat, _, o, width, stride, keys, gap, fetch = args
        b = builder
        rows = _row_starts(context, b, signature.args[0], acc, a0, a_step)
        weights = _row_starts(context, b, signature.args[3], p, p0, p_step)
        start = b.gep(_data(context, b, signature.args[6], flat), [o])
        with _pairs(b, keys, gap) as index:
            last, value = _key_pair(b, start, index, gap, stride, keys)
            w = []
            for row in weights:
                _, (first, second) = _key_pair(b, row, index, gap, _I64(1), keys)
                second = b.select(last, ir.Constant(_F32, 0.0), b.load(second))
                w.append([_splat(b, b.load(first)), _splat(b, second)])
            with _Loop(b, _I64(0), width, _I64(LANES), "add") as add:
                x = [_load_row(b, b.gep(v, [add.index]), fmt) for v in value]
                # (a key without a pair: no second row, not 0 times it, NaN for inf)
                x[1] = b.select(last, ir.Constant(_VF, None), x[1])
                _prefetch_rows(b, value, add.index, fetch)
                for r in range(QUAD):
                    slot = b.bitcast(b.gep(rows[r], [add.index]), _VF.as_pointer())
                    total = _fma(b, _fma(b, b.load(slot, align=4), w[r][0], x[0]), w[r][1], x[1])
                    b.store(total, slot, align=4)
        return context.get_dummy_value()

    return sig, codegen


def quad_scores(q_tile, r, flat, fmt, o, width, stride, keys, gap, s, t, fetch):
    """``s[r + i, t + k] = q_tile[r + i] . key_k`` for ``i < 4`` and the
    ``keys`` key rows ``key_k`` from flat offset ``o``, ``stride`` elements
    apart (``width`` for consecutive rows; each ``width`` elements, read in
    format ``fmt``). Key ``k`` is read beside key ``k + gap``, in blocks of
    ``2 * gap`` keys (``gap`` at least 1): ``gap`` 1 pairs neighbours, :func:`halves` the run's
    two halves (two streams far apart). Each row read prefetches ``fetch``
    elements ahead of itself (0: none). Only callable from compiled code,
    where :func:`has_quads` holds (elsewhere it compiles to nothing)."""
    raise NotImplementedError("quad_scores is only available inside Numba kernels")


@overload(quad_scores, inline="always")
def _quad_scores(q_tile, r, flat, fmt, o, width, stride, keys, gap, s, t, fetch):
    if not _supported(q_tile, s, flat, fmt):
        return lambda q_tile, r, flat, fmt, o, width, stride, keys, gap, s, t, fetch: None

    def impl(q_tile, r, flat, fmt, o, width, stride, keys, gap, s, t, fetch):
        q_step = q_tile.strides[0] // q_tile.itemsize
        s_step = s.strides[0] // s.itemsize
        _scores(
            q_tile, np.int64(r * q_step), np.int64(q_step), flat, fmt, np.int64(o),
            np.int64(width), np.int64(stride), np.int64(keys), np.int64(max(gap, 1)), s,
            np.int64(r * s_step + t), np.int64(s_step), np.int64(fetch),
        )  # fmt: skip

    return impl


def quad_values(acc, r, p, t, flat, fmt, o, width, stride, keys, gap, fetch):
    """``acc[r + i] += sum_k p[r + i, t + k] * value_k`` for ``i < 4`` and the
    ``keys`` value rows ``value_k`` from flat offset ``o``, ``stride``
    elements apart (``width`` elements each, format ``fmt``), in the pairs
    and with the prefetch of :func:`quad_scores`. Only callable from
    compiled code, where :func:`has_quads` holds (elsewhere it compiles to
    nothing)."""
    raise NotImplementedError("quad_values is only available inside Numba kernels")


@overload(quad_values, inline="always")
def _quad_values(acc, r, p, t, flat, fmt, o, width, stride, keys, gap, fetch):
    if not _supported(acc, p, flat, fmt):
        return lambda acc, r, p, t, flat, fmt, o, width, stride, keys, gap, fetch: None

    def impl(acc, r, p, t, flat, fmt, o, width, stride, keys, gap, fetch):
        a_step = acc.strides[0] // acc.itemsize
        p_step = p.strides[0] // p.itemsize
        _values(
            acc, np.int64(r * a_step), np.int64(a_step), p, np.int64(r * p_step + t),
            np.int64(p_step), flat, fmt, np.int64(o), np.int64(width), np.int64(stride),
            np.int64(keys), np.int64(max(gap, 1)), np.int64(fetch),
        )  # fmt: skip

    return impl

"""flashtile's own bf16 ``gemm`` on AVX512-BF16: ``vdpbf16ps`` where oneMKL does not use it.

oneMKL's ``gemm_bf16bf16f32`` runs bf16 products on AMX on Intel Xeons, but
on other CPUs with AVX512-BF16 (AMD's Zen 4 and later) it gains nothing over
its float32 ``sgemm``: Intel's instruction-set dispatch serves only Intel
processors. ``vdpbf16ps`` multiplies 32 bf16 pairs into 16 float32 sums per
instruction, twice a float32 FMA's products, and this module's product uses
it directly: on an AMD EPYC (Zen 4) one core ran the forward's 512 x 256 x 64
score product in 97 us (173 GFLOP/s) against oneMKL's 45 GFLOP/s
(docs/design.md, "bfloat16").

:func:`address` is the product as a Fortran ``gemm`` (the 13 by-reference
arguments of ``sgemm``, bf16 operands as ``uint16``, float32 ``alpha``,
``beta`` and ``C``), so the kernels call it through the same function
pointer as a BLAS (:func:`flashtile.cpu.blas.gemm_scaled`). Column-major, as
Fortran: ``C (m x n) = alpha op(A) op(B) + beta C``.

The product is the textbook blocked one, in two levels:

* *packing*: ``op(A)`` is copied in panels of :data:`MR` rows, each row's
  elements in pairs along ``k`` (the instruction's operand: element pairs
  ``(A[i, 2p], A[i, 2p + 1])`` for 16 consecutive ``i``); ``op(B)`` is
  read in panels of :data:`NR` columns, as the matching pairs
  ``(B[2p, j], B[2p + 1, j])``, one 32-bit word each. Where a column of
  ``op(B)`` already lies in memory as aligned words (not transposed, even
  ``ldb`` and ``k``, data on a 4-byte boundary: the kernels' ``P``, ``dS``
  and row-major operand tiles), its whole panels are read in place; the
  rest of ``op(B)`` is copied once, as rows of words along ``n``
  (:func:`_pack_b`). An odd ``k`` pads the last pair with zeros in both
  operands. The copies of aligned words and of interleaved rows index with
  unsigned integers: a signed index makes Numba emit negative-index code
  that keeps the loops scalar (the rare unaligned copies along ``k`` stay
  scalar loops). On the Zen 4 above, reading in place and
  vectorised copies took the forward's ``P V`` product (256 x 512 by 512 x
  64) from 185-215 to 84-91 us, and the backward's products with a
  transposed ``B`` (``dV``, ``dK``) from 101 to 46 us;
* *the micro-kernel* (:func:`_dot_panels`, LLVM IR): an ``MR x NR`` block of
  ``C`` in 2 x ``NR`` vector registers (24 of the 32), each step over ``k``
  two vector loads of ``A``'s pairs, ``NR`` broadcasts of ``B``'s words and
  ``2 NR`` ``vdpbf16ps``; ``alpha`` and ``beta`` are applied from the
  registers into ``C`` (``beta = 0`` never reads ``C``, as BLAS). Blocks at
  the edges of ``C`` go through a full-size float32 scratch block instead.

Each product is summed in float32 from exact bf16 products, as oneMKL's
``gemm_bf16bf16f32`` and AMX do (in another order: results agree to float32
rounding of the sums, not bit for bit).
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .half import _BFloat, target_has

#: Rows of ``C`` per micro-kernel block (two vectors of 16 float32 lanes).
MR = 32
#: Columns of ``C`` per micro-kernel block: 2 x 12 accumulators, 2 operand
#: vectors, and room for the broadcasts in the 32 AVX-512 registers.
NR = 12

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V32B = ir.VectorType(_BFloat(), 32)


@functools.cache
def available() -> bool:
    """Whether the CPU Numba compiles for has ``vdpbf16ps`` (AVX512-BF16);
    asked once (LLVM's feature query takes about 0.3 ms)."""
    return target_has("avx512bf16")


@intrinsic
def _dot_panels(
    typingctx, a_pack, b_pack, b_start, b_step, b_col, pairs, c, c_start, ldc, alpha, beta
):  # fmt: skip
    """``C[i, j] = alpha sum_p A2[p, i] . B2[p, j] + beta C[i, j]`` for an
    ``MR x NR`` block: ``a_pack`` holds ``pairs x MR`` words (bf16 pairs),
    ``B2[p, j]`` is ``b_pack[b_start + p * b_step + j * b_col]`` (packed:
    ``b_step`` the packed row's width, ``b_col = 1``; read in place: ``1``
    and the column's stride in words); the block's element ``(i, j)`` is
    ``c[c_start + i + j * ldc]`` (column-major). ``beta = 0`` never reads
    ``c``."""
    intp = types.intp
    sig = types.void(a_pack, b_pack, intp, intp, intp, intp, c, intp, intp, alpha, beta)

    def codegen(context, builder, signature, args):
        a_pack, b_pack, b_start, b_step, b_col, pairs, c, c_start, ldc, alpha, beta = args
        alpha, beta = (
            context.cast(builder, x, t, types.float32)
            for x, t in zip(args[9:], signature.args[9:], strict=True)
        )
        index = pairs.type

        def const(value):
            return ir.Constant(index, value)

        a_base = _data(context, builder, signature.args[0], a_pack, _I32)
        b_base = builder.gep(_data(context, builder, signature.args[1], b_pack, _I32), [b_start])
        dot = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(_V16F, [_V16F, _V32B, _V32B]),
            "llvm.x86.avx512bf16.dpbf16ps.512",
        )
        entry = builder.block
        loop, done = builder.append_basic_block("dot.loop"), builder.append_basic_block("dot.done")
        zero = ir.Constant(_V16F, None)
        builder.cbranch(builder.icmp_signed("<=", pairs, const(0)), done, loop)

        builder.position_at_end(loop)
        p = builder.phi(index)
        sums = [builder.phi(_V16F) for _ in range(2 * NR)]
        a_row = builder.gep(a_base, [builder.mul(p, const(MR))])
        a = [_load(builder, builder.gep(a_row, [const(16 * h)]), _V32B) for h in range(2)]
        b_row = builder.gep(b_base, [builder.mul(p, b_step)])
        steps = []
        for j in range(NR):
            b = builder.bitcast(
                _splat(builder, builder.load(builder.gep(b_row, [builder.mul(const(j), b_col)]))),
                _V32B,
            )
            steps += [builder.call(dot, [sums[2 * j + h], a[h], b]) for h in range(2)]
        following = builder.add(p, const(1))
        body_end = builder.block
        p.add_incoming(const(0), entry)
        p.add_incoming(following, body_end)
        for phi, step in zip(sums, steps, strict=True):
            phi.add_incoming(zero, entry)
            phi.add_incoming(step, body_end)
        builder.cbranch(builder.icmp_signed("<", following, pairs), loop, done)

        builder.position_at_end(done)
        totals = [builder.phi(_V16F) for _ in steps]  # (a block's phis come first)
        for total, step in zip(totals, steps, strict=True):
            total.add_incoming(zero, entry)
            total.add_incoming(step, body_end)
        c_base = builder.gep(_data(context, builder, signature.args[6], c, _F32), [c_start])
        slots = [
            builder.gep(c_base, [builder.add(builder.mul(const(j), ldc), const(16 * h))])
            for j in range(NR)
            for h in range(2)
        ]
        scaled = [builder.fmul(_splat(builder, alpha), total) for total in totals]
        with builder.if_else(builder.fcmp_ordered("==", beta, ir.Constant(_F32, 0.0))) as (
            overwrite,
            blend,
        ):
            with overwrite:  # (beta = 0: C may hold anything, NaN included)
                for slot, value in zip(slots, scaled, strict=True):
                    _store(builder, slot, value)
            with blend:
                for slot, value in zip(slots, scaled, strict=True):
                    old = builder.fmul(_splat(builder, beta), _load(builder, slot, _V16F))
                    _store(builder, slot, builder.fadd(value, old))
        return context.get_dummy_value()

    return sig, codegen


def _data(context, builder, array_type, value, element):
    """The data pointer of an array argument, as a pointer to ``element``."""
    array = context.make_array(array_type)(context, builder, value)
    return builder.bitcast(array.data, element.as_pointer())


def _splat(builder, scalar):
    """A 16-lane vector of a 32-bit ``scalar``."""
    vector = ir.VectorType(scalar.type, 16)
    lane = builder.insert_element(ir.Constant(vector, None), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lane, lane, ir.Constant(_V16I, [0] * 16))


def _load(builder, pointer, vector):
    """A vector load from a 4-byte-aligned address (the buffers promise no more)."""
    return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=4)


def _store(builder, pointer, value):
    builder.store(value, builder.bitcast(pointer, value.type.as_pointer()), align=4)


@njit(cache=True, inline="always")
def _word(low, high):
    """Two bf16 patterns as one 32-bit word, ``low`` first in memory."""
    return np.uint32(low) | (np.uint32(high) << np.uint32(16))


@njit(cache=True, inline="always")
def _aligned_words(x, lead, k):
    """Whether ``x``'s bf16 pairs along ``k`` (its contiguous axis, leading
    dimension ``lead``) are whole aligned 32-bit words: ``lead`` and ``k``
    even, the data 4-byte aligned. Then packing copies words."""
    return lead % 2 == 0 and k % 2 == 0 and x.ctypes.data % 4 == 0


@njit(cache=True)
def _transpose_words(words, lead, first, count, pairs, out, start, stride):
    """``out[start + p * stride + j] = words[(first + j) * lead + p]`` for
    ``j < count``, ``p < pairs``: each of ``count`` word rows read along
    memory, written across the panel. Unsigned indices: no negative-index
    wraparound code in the loop."""
    lead, first, pairs = np.uint64(lead), np.uint64(first), np.uint64(pairs)
    start, stride = np.uint64(start), np.uint64(stride)
    for j in range(np.uint64(count)):
        src = (first + j) * lead
        dst = start + j
        for p in range(pairs):
            out[dst + p * stride] = words[src + p]


@njit(cache=True)
def _interleave_rows(x, even, odd, count, out, start, half_word):
    """``out[start + i] = (x[even + i], x[odd + i])`` as words for ``i < count``;
    with ``half_word``, ``x[even + i]`` alone with a zero high half (the last
    pair of an odd ``k``; ``odd`` unused). Indices are non-negative."""
    start, even, count = np.uint64(start), np.uint64(even), np.uint64(count)
    if half_word:
        for i in range(count):
            out[start + i] = np.uint32(x[even + i])
        return
    odd = np.uint64(odd)
    for i in range(count):
        out[start + i] = np.uint32(x[even + i]) | (np.uint32(x[odd + i]) << np.uint32(16))


@njit(cache=True)
def _copy_pairs(x, ld, k, first, count, out, start, stride):
    """``out[start + p * stride + j]`` = pair ``p`` of line ``first + j`` of
    ``x``, for ``j < count``, where a line (``ld`` elements apart) holds its
    ``k`` elements contiguously, so each pair lies along memory: aligned
    words are copied as words (:func:`_transpose_words`), else two bf16
    patterns at a time (an odd ``k``'s last pair with a zero high half)."""
    if _aligned_words(x, ld, k):
        _transpose_words(x.view(np.uint32), ld // 2, first, count, k // 2, out, start, stride)
        return
    half = k // 2
    for j in range(count):
        at = (first + j) * ld
        for p in range(half):
            out[start + p * stride + j] = _word(x[at + 2 * p], x[at + 2 * p + 1])
        if k % 2:
            out[start + half * stride + j] = x[at + k - 1]


@njit(cache=True)
def _interleave_pairs(x, ld, k, first, count, out, start, stride):
    """``out[start + p * stride + j] = (x[first + j + 2p ld], x[first + j +
    (2p + 1) ld])`` for ``j < count``: pair ``p`` of element ``first + j``
    of lines ``2p`` and ``2p + 1`` of ``x`` (``k`` lines, ``ld`` apart, each
    contiguous), two lines at a time (:func:`_interleave_rows`); an odd
    ``k``'s last line with a zero high half."""
    half = k // 2
    for p in range(half):
        even = first + 2 * p * ld
        _interleave_rows(x, even, even + ld, count, out, start + p * stride, False)
    if k % 2:
        _interleave_rows(x, first + (k - 1) * ld, 0, count, out, start + half * stride, True)


@njit(cache=True)
def _pack_a(a, lda, trans, i0, rows, k, out):
    """Rows ``i0 .. i0 + rows`` of ``op(A)`` (``m x k``) as words of pairs
    along ``k``: ``out[p * MR + i] = (op(A)[i0 + i, 2p], op(A)[i0 + i, 2p + 1])``,
    zeros past the rows and past ``k``. Reads run along memory either way."""
    if rows < MR:  # (an odd k's last pair is written whole, its high half zero)
        out[: (k + 1) // 2 * MR] = 0
    if trans:  # op(A)[i, col] = A[col + i * lda]: row i is contiguous
        _copy_pairs(a, lda, k, i0, rows, out, 0, MR)
    else:  # op(A)[i, col] = A[i + col * lda]: column col is contiguous
        _interleave_pairs(a, lda, k, i0, rows, out, 0, MR)


@njit(cache=True)
def _pack_b(b, ldb, trans, n, k, out, c0, width):
    """Columns ``c0 .. n`` of ``op(B)`` (``k x n``) as rows of words of pairs
    along ``k``: ``out[p * width + col - c0] = (op(B)[2p, col], op(B)[2p + 1,
    col])``, zeros past ``n`` (up to ``width`` columns) and past ``k``. The
    micro-kernel reads a panel's ``NR`` words of step ``p`` together. Reads
    run along memory either way: a transposed ``B`` holds the rows of
    ``op(B)``, interleaved two by two; an untransposed one its columns."""
    cols = n - c0
    if cols < width:  # (an odd k's last pair is written whole, its high half zero)
        for p in range((k + 1) // 2):
            out[p * width + cols : (p + 1) * width] = 0
    if trans:  # op(B)[row, col] = B[col + row * ldb]
        _interleave_pairs(b, ldb, k, c0, cols, out, 0, width)
    else:  # op(B)[row, col] = B[row + col * ldb]: column col is contiguous
        _copy_pairs(b, ldb, k, c0, cols, out, 0, width)


@njit(cache=True)
def _gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Fortran ``gemm``'s product on flat arrays (see the module docstring).
    Blocks at the edges of ``C`` go through a full-size scratch block."""
    if m <= 0 or n <= 0 or k < 0:
        return
    if k == 0 or alpha == 0.0:  # C = beta C, as BLAS (no product: NaN in A or B stays out)
        for j in range(n):
            for i in range(m):
                c[j * ldc + i] = 0.0 if beta == 0.0 else beta * c[j * ldc + i]
        return
    pairs = (k + 1) // 2
    panels = (n + NR - 1) // NR
    # op(B)'s columns as rows of bf16 pairs in memory: whole panels read in place
    in_place = not trans_b and _aligned_words(b, ldb, k)
    whole = n // NR if in_place else 0
    width = (panels - whole) * NR  # the packed columns' row of words
    a_pack = np.empty(pairs * MR, np.uint32)
    b_pack = np.empty(pairs * width, np.uint32)
    edge = np.empty(MR * NR, np.float32)
    if width:
        _pack_b(b, ldb, trans_b, n, k, b_pack, whole * NR, width)
    words = b.view(np.uint32) if in_place else b_pack
    for i0 in range(0, m, MR):
        rows = min(MR, m - i0)
        _pack_a(a, lda, trans_a, i0, rows, k, a_pack)
        for panel in range(panels):
            j0 = panel * NR
            cols = min(NR, n - j0)
            if panel < whole:
                source, start, step, col = words, j0 * (ldb // 2), 1, ldb // 2
            else:
                source, start, step, col = b_pack, j0 - whole * NR, width, 1
            if rows == MR and cols == NR:
                _dot_panels(
                    a_pack, source, start, step, col, pairs, c, i0 + j0 * ldc, ldc, alpha, beta
                )
                continue
            _dot_panels(
                a_pack, source, start, step, col, pairs, edge, 0, MR, np.float32(1.0),
                np.float32(0.0),
            )  # fmt: skip
            for j in range(cols):
                at = (j0 + j) * ldc + i0
                for i in range(rows):
                    value = alpha * edge[j * MR + i]
                    c[at + i] = value if beta == 0.0 else value + beta * c[at + i]


@njit(cache=True, inline="always")
def _extent(rows, cols, lead):
    """Elements a column-major ``rows x cols`` operand spans with leading dimension ``lead``."""
    return 0 if rows <= 0 or cols <= 0 else (cols - 1) * lead + rows


_CHAR = types.CPointer(types.uint8)
_INT = types.CPointer(types.int32)
_FLOAT = types.CPointer(types.float32)
_BF16 = types.CPointer(types.uint16)
_SIGNATURE = types.void(
    _CHAR, _CHAR, _INT, _INT, _INT, _FLOAT, _BF16, _INT, _BF16, _INT, _FLOAT, _FLOAT, _INT
)
#: The transposing flags (``C``: conjugate-transpose, the same for reals).
_TRANSPOSING = (ord("T"), ord("t"), ord("C"), ord("c"))


def _fortran_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """The Fortran ABI around :func:`_gemm` (compiled by :func:`address`)."""
    trans_a, trans_b = ta[0] in _TRANSPOSING, tb[0] in _TRANSPOSING
    rows, cols, depth = m[0], n[0], k[0]
    a_rows, a_cols = (depth, rows) if trans_a else (rows, depth)
    b_rows, b_cols = (cols, depth) if trans_b else (depth, cols)
    _gemm(
        trans_a, trans_b, rows, cols, depth, alpha[0],
        carray(a, _extent(a_rows, a_cols, lda[0])), lda[0],
        carray(b, _extent(b_rows, b_cols, ldb[0])), ldb[0], beta[0],
        carray(c, _extent(rows, cols, ldc[0])), ldc[0],
    )  # fmt: skip


@functools.cache
def address() -> int:
    """The address of the product as a Fortran ``gemm`` (compiled on first
    use; RuntimeError on a CPU without AVX512-BF16, where LLVM cannot emit it)."""
    if not available():
        raise RuntimeError("flashtile's bf16 gemm needs AVX512-BF16 (vdpbf16ps): this CPU lacks it")
    return cfunc(_SIGNATURE, cache=True)(_fortran_gemm).address

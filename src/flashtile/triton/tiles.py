"""Triton building blocks shared by the forward, backward and decoding kernels.

Every kernel works in log2 units: scores are multiplied by ``scale * log2(e)``
once (folded into ``qk_scale``), so the softmax uses ``exp2``, which is one
instruction on the GPU. ``lse`` is converted back to the natural log on store.

Visibility is the rule of :mod:`flashtile.masks`: query ``i`` of a sequence
with ``Tq`` queries and ``Tk`` keys sits at position ``pos = i + Tk - Tq``
(bottom-right) and sees keys ``[lo, hi)`` with ``hi = min(kv_len, pos + right
+ 1)`` when the right side is bounded (causal is ``right = 0``) and ``lo =
max(0, pos - left)`` when the left side is. Both ends never decrease with
``i``, so a block of queries needs one contiguous run of key blocks, and the
key blocks that every query of the block sees need no per-element mask.

**bfloat16 under the interpreter.** Triton 3.9's interpreter stores bfloat16
tensors as their uint16 bit patterns and runs NumPy on those patterns:
``tl.dot`` of two bfloat16 tiles is ``np.matmul`` of the integers (garbage,
errors of 1e10), and so is any arithmetic on bfloat16 values (``x * 0.5``).
Loads, stores and bfloat16 <-> float32 casts are right, except that the cast
float32 -> bfloat16 truncates instead of rounding to nearest even (and flushes
bfloat16 subnormals to zero). So with
``EMULATE_BF16`` (set only when interpreting bfloat16 inputs) tiles are
widened to float32 right after loading (exact), the operands the kernels
narrow to bfloat16 before a product (``P``, ``dS``) and the outputs are
rounded to the nearest bfloat16 by integer bit operations
(:func:`round_bf16`), and the products run in float32. A product of two
bfloat16 numbers is exact in float32 and the GPU's bfloat16 MMA accumulates
in float32, so this is the GPU's arithmetic up to summation order; the code
the GPU runs (``EMULATE_BF16`` off) is checked by ``compile_report``.
"""

import os

import triton
import triton.language as tl

from .. import units

#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when
#: they were defined: ``triton.jit`` reads it when it decorates a function).
try:
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # Triton before 3.4 reads the variable directly
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def device_fn(fn):
    """``triton.jit`` for a helper that kernels call.

    Under the interpreter a helper stays a plain Python function: the
    interpreter re-patches ``triton.language`` on every call of a jit helper
    (about 8 ms, most of a small launch's time), while the kernel's own
    patching already covers the ``tl`` calls inside a plain helper. The
    helper's code is the same either way.
    """
    return fn if INTERPRET else triton.jit(fn)


# Kernels may read module globals only when they are tl.constexpr.
LOG2E = tl.constexpr(units.LOG2E)
LN2 = tl.constexpr(units.LN2)


@device_fn
def row_bounds(pos, kv_len, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys ``[lo, hi)`` that a query at position ``pos`` (scalar or vector) may see."""
    hi = pos * 0 + kv_len
    if HAS_RIGHT:
        hi = tl.minimum(hi, pos + right + 1)
    lo = pos * 0
    if HAS_LEFT:
        lo = tl.maximum(lo, pos - left)
    return lo, hi


@device_fn
def phase_ends(lo, hi, inner_lo, inner_hi, BLOCK: tl.constexpr):
    """Split ``[lo, hi)``, walked in steps of ``BLOCK``, into three phases.

    Blocks in ``[lo, s1)`` and ``[s2, hi)`` need masks; the blocks of
    ``[s1, s2)`` lie wholly inside ``[inner_lo, inner_hi)`` and need none.
    The phases tile ``[lo, hi)`` exactly (only the last block of the range
    may stick out past ``hi``).
    """
    head = tl.cdiv(tl.maximum(inner_lo - lo, 0), BLOCK)
    s1 = tl.minimum(lo + head * BLOCK, hi)
    middle = tl.maximum(tl.minimum(inner_hi, hi) - s1, 0) // BLOCK
    return s1, s1 + middle * BLOCK


@device_fn
def phase_count(lo, s1, s2, hi, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """``(blocks, head)``: the blocks of the masked phase (``[lo, s1)``, then ``[s2, hi)``;
    ``head`` of them lie before ``s1``) or of the unmasked phase (``[s1, s2)``).

    The two masked edges share one loop, so each kernel compiles two copies of
    its loop body, not three.
    """
    head = tl.cdiv(s1 - lo, BLOCK)
    blocks = head + tl.cdiv(hi - s2, BLOCK) if MASKED else (s2 - s1) // BLOCK
    return blocks, head


@device_fn
def phase_block(i, head, lo, s1, s2, hi, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """``(offs, ok)`` of block ``i`` of a phase: its ``BLOCK`` row (or key) indices and
    which of them belong to its part of the range."""
    if MASKED:
        before = i < head
        start = tl.where(before, lo + i * BLOCK, s2 + (i - head) * BLOCK)
        end = tl.where(before, s1, hi)
    else:
        start = s1 + i * BLOCK
        end = s2
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < end


@device_fn
def sequence(
    seq, CuQ, CuK, KvLens, seqlen_q, seqlen_k, KV_LENS: tl.constexpr, VARLEN: tl.constexpr
):
    """``(batch index, first query, first key, Tq, Tk, valid keys)`` of sequence ``seq``."""
    if VARLEN:
        q0 = tl.load(CuQ + seq)
        k0 = tl.load(CuK + seq)
        tq = tl.load(CuQ + seq + 1) - q0
        tk = tl.load(CuK + seq + 1) - k0
        b = seq * 0
    else:
        q0 = seq * 0
        k0 = seq * 0
        tq = seq * 0 + seqlen_q
        tk = seq * 0 + seqlen_k
        b = seq
    kv_len = tk
    if KV_LENS:
        kv_len = tl.load(KvLens + seq)
    return b, q0, k0, tq, tk, kv_len


@device_fn
def program_tile(heads, CuQ, CuK, KvLens, seqlen_q, seqlen_k,
                 BLOCK: tl.constexpr, KV_LENS: tl.constexpr, VARLEN: tl.constexpr):  # fmt: skip
    """What a program of the grid ``(blocks of BLOCK rows, sequences * heads)`` owns:
    ``(start, h, b, q0, k0, tq, tk, kv_len)``: its first row, its head, and its
    sequence (:func:`sequence`; ``b`` as int64, for addressing)."""
    seq = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    start = tl.program_id(0) * BLOCK
    b, q0, k0, tq, tk, kv_len = sequence(seq, CuQ, CuK, KvLens, seqlen_q, seqlen_k, KV_LENS, VARLEN)
    return start, h, b.to(tl.int64), q0, k0, tq, tk, kv_len


@device_fn
def row_slopes(ptrs, ok, BLOCK_M: tl.constexpr, ALIBI: tl.constexpr):
    """ALiBi slopes times ``log2(e)`` for ``BLOCK_M`` rows read at ``ptrs`` (one pointer,
    or one per row); zeros without ALiBi."""
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope2 += tl.load(ptrs + tl.zeros([BLOCK_M], tl.int32), mask=ok, other=0.0) * LOG2E
    return slope2


@device_fn
def load_rows(row_ptrs, row_ok, HEAD: tl.constexpr, BLOCK: tl.constexpr,
              MASK_ROWS: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """A ``tl.dot`` operand: the rows starting at ``row_ptrs`` (one pointer per row,
    unit stride along the row), ``HEAD`` columns padded with zeros to ``BLOCK``;
    rows masked by ``row_ok`` only where ``MASK_ROWS``."""
    cols = tl.arange(0, BLOCK)
    tile = load_tile(row_ptrs[:, None] + cols[None, :], row_ok, cols < HEAD, MASK_ROWS,
                     BLOCK != HEAD)  # fmt: skip
    return mma_in(tile, EMULATE_BF16)


@device_fn
def store_rows(row_ptrs, x, row_ok, HEAD: tl.constexpr, BLOCK: tl.constexpr,
               EMULATE_BF16: tl.constexpr):  # fmt: skip
    """Store the first ``HEAD`` columns of the float32 tile ``x`` in the rows starting at
    ``row_ptrs`` where ``row_ok``, rounded to the pointers' dtype."""
    cols = tl.arange(0, BLOCK)
    mask = row_ok[:, None] & (cols[None, :] < HEAD)
    store_tile(row_ptrs[:, None] + cols[None, :], x, mask, EMULATE_BF16)


@device_fn
def query_block_keys(
    start_m, tq, tk, kv_len, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """Query rows ``[start_m, start_m + BLOCK_M)``: their positions and key bounds, and
    the block's keys ``[lo, hi)`` split into phases at ``s1``, ``s2``.

    The block needs keys from its first row's ``lo`` to its last real row's
    ``hi``; every row sees ``[lo of the last row, hi of the first row)``.
    Returns ``(pos, lo_r, hi_r, lo, s1, s2, hi)``.
    """
    pos = start_m + tl.arange(0, BLOCK_M) + (tk - tq)
    lo_r, hi_r = row_bounds(pos, kv_len, left, right, HAS_LEFT, HAS_RIGHT)
    last = tl.minimum(start_m + BLOCK_M, tq) - 1
    lo, hi_first = row_bounds(start_m + tk - tq, kv_len, left, right, HAS_LEFT, HAS_RIGHT)
    lo_last, hi = row_bounds(last + tk - tq, kv_len, left, right, HAS_LEFT, HAS_RIGHT)
    hi = tl.maximum(lo, hi)
    s1, s2 = phase_ends(lo, hi, lo_last, hi_first, BLOCK_N)
    return pos, lo_r, hi_r, lo, s1, s2, hi


@device_fn
def tanh(x):
    """``tanh`` from ``exp2``: exactly +-1 for large ``|x|`` and never NaN.

    (libdevice's tanh does not run in the interpreter.)
    """
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@device_fn
def round_bf16(x):
    """float32 -> float32 holding the nearest bfloat16 (ties to even), by integer ops."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@device_fn
def mma_in(x, EMULATE_BF16: tl.constexpr):
    """A loaded tile as a ``tl.dot`` operand (float32 when emulating bfloat16)."""
    if EMULATE_BF16:
        x = x.to(tl.float32)
    return x


@device_fn
def operand_like(x, ref, EMULATE_BF16: tl.constexpr):
    """A float32 tile narrowed to the dtype of the operand ``ref`` it multiplies."""
    y = round_bf16(x) if EMULATE_BF16 else x.to(ref.dtype)
    return y


@device_fn
def dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` accumulated in float32; IEEE float32 products for float32 inputs
    (no TF32: flashtile's float32 results stay within a small multiple of float32 error)."""
    acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
    return acc


@device_fn
def load_tile(ptrs, row_ok, col_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where asked (zeros outside)."""
    if ROWS and COLS:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif COLS:
        x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@device_fn
def store_tile(ptrs, x, mask, EMULATE_BF16: tl.constexpr):
    """Store a float32 tile in the pointer's dtype, rounding to nearest."""
    if EMULATE_BF16 and ptrs.dtype.element_ty == tl.bfloat16:
        x = round_bf16(x)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@device_fn
def mod_flag(Ints, bad, qi, kv, tq, lo, hi):
    """Note in ``Ints[0]`` that a mod indexed a captured table out of range at
    a valid element of the tile (rows below ``tq``, keys in ``[lo, hi)``);
    padded rows and keys may reach past a table without it counting."""
    valid = (qi < tq) & (kv >= lo[:, None]) & (kv < hi[:, None])
    # (bad != 0: the interpreter can hold an or of 0-d and tile bools as int32)
    tl.store(Ints + qi * 0 + kv * 0, 1, mask=(bad != 0) & valid)


@device_fn
def scores(
    q, k, pos, offs_n, lo, hi, slope2, qk_scale, cap_in, cap_out, mod,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
    SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr, GRAD: tl.constexpr,
):  # fmt: skip
    """Scores of a ``(BLOCK_M, d)`` query tile against a ``(BLOCK_N, d)`` key tile.

    In log2 units, with the variants in flashtile's order (softcap, then ALiBi,
    then the mask): ``s = scale * q.k``; ``s = softcap * tanh(s / softcap)``;
    ``s -= slope * |pos - j|``; ``-inf`` outside each row's ``[lo, hi)`` when
    ``MASKED``. ``cap_in = scale / softcap``, ``cap_out = softcap * log2(e)``,
    ``slope2`` is the per-row slope times ``log2(e)``.

    A user's mods (:mod:`.mod_source`): ``SCORE_FN`` maps the natural-unit
    score ``x = scale * q.k`` to ``y`` (``GRAD``: the backward's function,
    which also gives ``dy/dx``), and where ``MASKED`` a key ``MASK_FN``
    rejects is hidden too; ``mod = (F, I, G, b, h, tq, shift, scale)``: the
    tables' buffers, the batch entry and query head, the query count and
    ``pos - q_idx``. Returns ``(s, t, x)``: ``t`` is the tanh (for the
    backward's ``1 - t^2``), or ``dy/dx`` with a ``GRAD`` score function,
    else the unscaled product; ``x`` the score a mod was given.
    """
    s = dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), IEEE)
    x = s
    if SOFTCAP:
        t = tanh(s * cap_in)
        s = t * cap_out
    else:
        t = s
        s = s * qk_scale
    if SCORE_FN is not None or MASK_FN is not None:
        floats, ints, b, h, tq = mod[0], mod[1], mod[3], mod[4], mod[5]
        qi = (pos - mod[6])[:, None]
        kv = offs_n[None, :]
    if SCORE_FN is not None:
        x = x * mod[7]
        if GRAD:
            y, t, bad = SCORE_FN(x, b, h, qi, kv, floats, ints)
        else:
            y, bad = SCORE_FN(x, b, h, qi, kv, floats, ints)
        s = tl.broadcast_to(y * LOG2E, x.shape)  # (a result that varies along one axis only)
        mod_flag(ints, bad, qi, kv, tq, lo, hi)
    if ALIBI:
        dist = tl.abs(pos[:, None] - offs_n[None, :]).to(tl.float32)
        s = s - slope2[:, None] * dist
    if MASKED:
        keep = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        if MASK_FN is not None:
            kept, bad = MASK_FN(b, h, qi, kv, floats, ints)
            mod_flag(ints, bad, qi, kv, tq, lo, hi)
            keep = keep & kept
        s = tl.where(keep, s, float("-inf"))
    return s, t, x


@device_fn
def online_block(
    acc, l_i, m_i, s, v, keep, MASKED: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Fold one score tile ``s`` (log2 units) and its value tile into the running state.

    ``m_i`` is the running max, ``l_i`` the normaliser, ``acc`` the unnormalised
    output. In masked tiles a row may have seen no key yet (``m = -inf``): it
    exponentiates against 0 instead, so ``exp2(-inf - -inf)`` never makes NaN.
    With ``DROPOUT`` the probabilities ``keep`` drops (:func:`kept`) leave
    the value product after their sum entered ``l_i``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.exp2(s - m_base[:, None])
    alpha = tl.exp2(m_i - m_base)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(keep, p, 0.0)
    acc = dot(operand_like(p, v, EMULATE_BF16), v, acc * alpha[:, None], IEEE)
    return acc, l_i, m_new


@device_fn
def finish_rows(acc, l_i, m_i):
    """``(out, lse)``: normalise once; a row that saw no key gives zeros and ``-inf``."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return out, lse


@device_fn
def kept(rows, cols, drop):
    """Dropout's keep decisions ``(len(rows), len(cols))`` bool for query rows
    ``rows`` and key rows ``cols`` (row indices of the caller's arrays), by
    :mod:`flashtile.dropout`'s rule: Philox-4x32-10 (``tl.philox``, the same
    rounds and key layout) of counter ``(col // 8, row, bh, offset)`` under
    the seed, the 16-bit half ``col % 2`` of word ``(col // 2) % 4``, kept
    when at least the threshold. ``drop = (bh, seed, offset, threshold,
    scale)``; ``bh = b * 2**16 + h``."""
    bh, seed, offset, threshold, _ = drop
    c0 = (cols[None, :] >> 3) + rows[:, None] * 0
    c1 = rows[:, None] + cols[None, :] * 0
    w0, w1, w2, w3 = tl.philox(
        seed, c0.to(tl.uint32), c1.to(tl.uint32), (c0 * 0 + bh).to(tl.uint32),
        (c0 * 0 + offset).to(tl.uint32),
    )  # fmt: skip
    which = (cols[None, :] >> 1) & 3
    word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    half = ((cols[None, :] & 1) * 16).to(tl.uint32)
    value = ((word >> half) & 0xFFFF).to(tl.int32)
    return value >= threshold


@device_fn
def key_rows(offs_n, n_ok, table_row, stride_page, stride_t, page_size,
             MASKED: tl.constexpr, PAGED: tl.constexpr):  # fmt: skip
    """Element offsets of the rows of keys ``offs_n`` from their sequence's and head's
    base: ``offs_n * stride_t``, or with ``PAGED`` row ``j % page_size`` of page
    ``table_row[j // page_size]`` (:mod:`flashtile.kvlayout`'s rule)."""
    if PAGED:
        if MASKED:
            page = tl.load(table_row + offs_n // page_size, mask=n_ok, other=0)
        else:
            page = tl.load(table_row + offs_n // page_size)
        rows = page.to(tl.int64) * stride_page + (offs_n % page_size).to(tl.int64) * stride_t
    else:
        rows = offs_n.to(tl.int64) * stride_t
    return rows


@device_fn
def listed(Num, Idx, dims, phase, b, h, row):
    """``(count, pointer)`` of a block mask's list (:mod:`.flex`): the blocks
    of row ``row`` of head ``h`` of batch entry ``b`` in ``phase`` (0:
    partial blocks, 1: full ones). ``dims = (Bm, Hm, rows, cols)`` of the
    lists ``Num (2, Bm, Hm, rows)`` and ``Idx (2, Bm, Hm, rows, cols)``
    int32 (``Bm``/``Hm`` of 1 broadcast)."""
    bm, hm, rows, cols = dims
    at = ((phase * bm + b % bm) * hm + h % hm).to(tl.int64) * rows + row
    return tl.load(Num + at), Idx + at * cols


@device_fn
def listed_block(i, walk, end, MAP: tl.constexpr, BLOCK: tl.constexpr):
    """``(offs, ok)`` of tile ``i`` of a listed walk ``walk = (count, pointer)``
    (:func:`listed`): each listed block of ``MAP`` rows is ``MAP // BLOCK``
    tiles; ``ok``: the rows before ``end``."""
    per = MAP // BLOCK
    start = tl.load(walk[1] + i // per) * MAP + (i % per) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < end


@device_fn
def walk_count(lo, s1, s2, hi, walk, BLOCK: tl.constexpr, MASKED: tl.constexpr,
               SPARSE: tl.constexpr, MAP: tl.constexpr):  # fmt: skip
    """``(tiles, head)`` of a phase: :func:`phase_count`'s, or with ``SPARSE``
    the tiles of the listed walk ``walk``."""
    if SPARSE:
        blocks = walk[0] * (MAP // BLOCK)
        head = blocks
    else:
        blocks, head = phase_count(lo, s1, s2, hi, BLOCK, MASKED)
    return blocks, head


@device_fn
def walk_block(i, head, lo, s1, s2, hi, walk, end, BLOCK: tl.constexpr, MASKED: tl.constexpr,
               SPARSE: tl.constexpr, MAP: tl.constexpr):  # fmt: skip
    """``(offs, ok)`` of tile ``i`` of a phase (:func:`phase_block`, or with
    ``SPARSE`` :func:`listed_block` with rows before ``end``)."""
    if SPARSE:
        offs, ok = listed_block(i, walk, end, MAP, BLOCK)
    else:
        offs, ok = phase_block(i, head, lo, s1, s2, hi, BLOCK, MASKED)
    return offs, ok


@device_fn
def attend_range(
    acc, l_i, m_i, q, k_base, v_base, table_row, sk_page, sk_t, sv_page, sv_t, page_size,
    lo, s1, s2, hi, pos, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, rows, k0, drop,
    walk, mod, kv_len,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
    PAGED: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
    SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr, SPARSE: tl.constexpr, MAP_N: tl.constexpr,
):  # fmt: skip
    """Fold the key blocks of one phase (see :func:`phase_count`) into the running state
    ``(acc, l_i, m_i)`` of the query tile ``q``: the loop of the forward and of the
    decoding kernel (contiguous keys, or a paged cache with ``PAGED``). With
    ``DROPOUT``, ``rows`` are the tile's query rows and ``k0`` the first key's
    row in the arrays, ``drop`` the generator's arguments (:func:`kept`).
    With ``SPARSE`` the phase is the listed walk ``walk`` of a block mask
    (keys before ``kv_len``); ``mod``, ``SCORE_FN``, ``MASK_FN``: a user's
    mods (:func:`scores`)."""
    blocks, head = walk_count(lo, s1, s2, hi, walk, BLOCK_N, MASKED, SPARSE, MAP_N)
    for i in range(blocks):
        offs_n, n_ok = walk_block(
            i, head, lo, s1, s2, hi, walk, kv_len, BLOCK_N, MASKED, SPARSE, MAP_N
        )
        k_rows = key_rows(offs_n, n_ok, table_row, sk_page, sk_t, page_size, MASKED, PAGED)
        k = load_rows(k_base + k_rows, n_ok, HEAD_D, BLOCK_D, MASKED, EMULATE_BF16)
        s, _, _ = scores(
            q, k, pos, offs_n, lo_r, hi_r, slope2, qk_scale, cap_in, cap_out, mod,
            SOFTCAP, ALIBI, MASKED, IEEE, SCORE_FN, MASK_FN, False,
        )  # fmt: skip
        v_rows = key_rows(offs_n, n_ok, table_row, sv_page, sv_t, page_size, MASKED, PAGED)
        v = load_rows(v_base + v_rows, n_ok, HEAD_DV, BLOCK_DV, MASKED, EMULATE_BF16)
        keep = kept(rows, k0 + offs_n, drop) if DROPOUT else 0
        # (a score mod may hide every key of an unmasked tile too: -inf rows)
        acc, l_i, m_i = online_block(
            acc, l_i, m_i, s, v, keep, MASKED or SCORE_FN is not None, DROPOUT, IEEE, EMULATE_BF16
        )  # fmt: skip
    return acc, l_i, m_i

"""One plan per call: everything a compiled kernel reads, decided in one place.

:mod:`flashtile.api` validates a call, asks here for its plan, and hands
the plan to :mod:`flashtile.cpu.launch`; the kernels then only execute it
(decoding asks :mod:`flashtile.decode_planning`, which builds on this module).

- :func:`plan_forward` and :func:`plan_backward` take a validated
  :class:`Call` and return a :class:`KernelPlan`: the arrays as 4-D
  contiguous blocks in the work dtype, one row per sequence in the ``seqs``
  table (columns ``SEQ_*``, :mod:`flashtile.cpu.tiles`), the tile sizes
  (:func:`tile_sizes`: the one tile-size policy), the variants in kernel form
  with a boolean mask's block map summarised for those tiles
  (:func:`kernel_variants`, :func:`block_states`), and the work items, one
  ``(sequence, kv head, query block)`` (forward) or ``(sequence, kv head,
  part)`` (backward) each, ordered so that ``prange``'s static schedule gives
  every thread a similar share (:mod:`flashtile.workitems`).
- :func:`call_size`, :func:`call_threads`: a call with little work runs on
  the calling thread (decoding's plans use the same rule).

Decoding's plans (split-KV work items, and the rule that sends a few
queries against many keys to the decode kernel) are
:mod:`flashtile.decode_planning`'s.

A plan that depends only on sizes and flags (no mask, no packed batch) is
cached by them, so a serving loop that repeats a few shapes plans each once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ._validate import BFLOAT16, AttentionShapes, check_block_size, compute_dtype, head_group
from .cpu.launch import numba_threads
from .cpu.tiles import (
    SEQ_BATCH,
    SEQ_COLUMNS,
    SEQ_K_START,
    SEQ_KV_LEN,
    SEQ_Q_START,
    SEQ_TK,
    SEQ_TQ,
    KernelVariants,
)
from .dropout import keep_threshold
from .masks import block_mask
from .precision import FLOAT32_SCORE_LIMIT, bf16_products_fit, bounds, work_dtype
from .units import LOG2E
from .variants import Variants
from .workitems import (
    ITEMS_PER_THREAD,
    backward_items,
    forward_items,
)

#: Default tile sizes (query rows per item x keys), picked by sweeps on the
#: 2-core machine (docs/design.md, performance notes). Forward: a 256 x 512 float32 score
#: tile is 512 KiB; with the query tile and one K/V tile (d=64) about 0.8 MiB
#: stays in L2. The backward holds two score-sized tiles, so 256 x 256. With
#: GQA the rows are shared by the group's query heads.
FWD_BLOCKS = (256, 512)
BWD_BLOCKS = (256, 256)
#: With a boolean mask the tiles default to the block map's granularity,
#: 128 x 128 as in FlexAttention (a BlockMask passed in brings its own):
#: finer tiles let a sparse mask skip more.
MASK_BLOCKS = (128, 128)
#: block_q never goes below this when it shrinks for GQA groups or to give
#: every thread enough work items.
MIN_BLOCK_Q = 16
#: With a sliding window of ``band`` keys per query, a tile of ``block_q``
#: rows needs about ``band + block_q`` keys for ``band`` useful per row, so
#: the default rows shrink toward ``band / 4`` (useful fraction about 80%),
#: not below this many (smaller tile products lose more than they save).
#: Measured at T=4096, window 256: 64 rows 0.79x the time of 256 rows.
MIN_WINDOW_BLOCK_Q = 64

#: A call with less work than this (multiply-adds, ``Tq * Tk * (d + dv)`` per
#: query head, masks ignored) runs on the calling thread. Waking the thread
#: pool costs a few microseconds on an idle machine, and in a process that
#: also runs torch (a second OpenMP runtime whose threads spin after each op)
#: or on a busy machine, a parallel region can wait milliseconds for a
#: descheduled thread. Below this the second core saves less than that.
SERIAL_WORK = 1 << 19

#: Tiles of at most this many query rows (heads stacked) by this many keys,
#: not gathered from a block map, are tiny: a tile product's fixed cost is
#: most of its time there (a 16 x 16 causal tile of 32 dims: two products,
#: 0.8 us in oneMKL), and the route ``blas.tiny`` picks the library
#: (:func:`flashtile.cpu.blas.tiny_library`).
TINY_TILE = 32


class Call(NamedTuple):
    """One validated attention call: the planner's input, on either backend
    (:func:`flashtile.frontdoor.check_call` with NumPy arrays,
    :func:`flashtile.triton.frontdoor.check_call` with GPU tensors).

    Attributes:
        q, k, v: the caller's arrays, validated (float dtype, shapes, layout).
        shapes: their sizes (:func:`flashtile._validate.check_qkv`).
        variants: the resolved variant keywords.
        scale: the score multiplier.
        cu_seqlens: ``(cu_q, cu_k)`` int64 offsets of a packed varlen batch,
            or None for a batched call (the Triton backend's record,
            :func:`flashtile.triton.frontdoor.check_call`, holds int32
            tensors and the longest sequences, ``(cu_q, cu_k, max_q,
            max_k)``, read on the host once).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    shapes: AttentionShapes
    variants: Variants
    scale: float
    cu_seqlens: tuple[np.ndarray, np.ndarray] | None = None


class KernelPlan(NamedTuple):  # a tuple: built on every call, in a fraction of a dataclass's time
    """Everything one forward or backward kernel call reads.

    Attributes:
        q4, k4, v4: ``(NB, H, T, d)`` C-contiguous, in the work dtype (a
            packed varlen batch is ``NB = 1``).
        seqs: ``(S, SEQ_COLUMNS)`` int64 sequence table.
        items: ``(N, 3)`` int64 work items in thread order: forward
            ``(sequence, kv head, i0)``, backward ``(sequence, kv head, part)``.
        parts: backward: parts per ``(sequence, kv head)`` (1 in the forward).
        variants: :class:`KernelVariants`, with the block map for these tiles.
        scale, block_q, block_k: the score multiplier and the tile sizes.
        dtype: the caller's dtype (results are cast back to it).
        out_shape: the caller's leading dims and ``Tq``: the shape of ``lse``
            (``out`` adds ``dv``).
        threads: how many threads run the kernel (:func:`call_threads`).
        size: the call's work (:func:`call_size`; the launcher's join watch
            sorts calls by it, :mod:`flashtile.cpu.launch`).
        small: the library of tiny tiles' products (:data:`TINY_TILE`,
            the route ``blas.tiny``), or None: the backend's.
    """

    q4: np.ndarray
    k4: np.ndarray
    v4: np.ndarray
    seqs: np.ndarray
    items: np.ndarray
    parts: int
    variants: KernelVariants
    scale: float
    block_q: int
    block_k: int
    dtype: np.dtype
    out_shape: tuple[int, ...]
    threads: int
    size: int = 0
    small: str | None = None


def plan_forward(call: Call, block_q=None, block_k=None) -> KernelPlan:
    """The forward kernel's plan for ``call`` (tile sizes default when None)."""
    return _plan(call, block_q, block_k, backward=False)


def plan_backward(call: Call, block_q=None, block_k=None) -> KernelPlan:
    """The backward kernel's plan for ``call`` (tile sizes default when None)."""
    return _plan(call, block_q, block_k, backward=True)


def _plan(call, block_q, block_k, backward):
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None:  # before the schedule cache, which would take 16.0 for 16
            check_block_size(size, name)
    q4, k4, v4 = kernel_arrays(call)
    shapes, va = call.shapes, call.variants
    work = compute_dtype(q4.dtype)  # the state's dtype (float32 for bf16 arrays)
    size = call_size(shapes)
    threads = call_threads(size)
    if backward and va.mods is not None and not va.mods.differentiable:
        raise ValueError(
            f"{va.mods.label} has no derivative here: mods written for the NumPy API run "
            f"the forward only; for gradients write them with torch and call "
            f"flashtile.torch.flex.flex_attention"
        )
    if call.cu_seqlens is None and va.mask_bool is None and va.mods is None:
        lengths = None if va.kv_lengths is None else tuple(va.kv_lengths.tolist())
        key = ScheduleKey(
            *q4.shape[:2], k4.shape[1], shapes.tq, shapes.tk, lengths, va.causal, va.left,
            va.right, va.softcap, work, block_q, block_k, backward, threads,
        )  # fmt: skip
        seqs, block_q, block_k, variants, items, parts = _plain_schedule(key)
        if va.alibi is not None or va.mask_add is not None or va.dropout_p > 0.0:
            variants = kernel_variants(va, work, q4.shape[1])  # this call's own values
    else:
        seqs = sequence_table(call)
        block_q, block_k, variants, items, parts = _schedule(
            seqs, va, (q4.shape[1], k4.shape[1]), (shapes.tq, shapes.tk), work, block_q,
            block_k, backward, threads,
        )  # fmt: skip
    return KernelPlan(
        q4, k4, v4, seqs, items, parts, variants, call.scale, block_q, block_k, call.q.dtype,
        shapes.batch + (shapes.tq,), threads, size,
        _tiny_library(q4, k4, block_q, block_k, variants.states.size > 0),
    )  # fmt: skip


def _tiny_library(q4, k4, block_q, block_k, gathered) -> str | None:
    """:attr:`KernelPlan.small` of float tiles of these sizes (``gathered``:
    a block map's kept blocks are gathered into wider tiles)."""
    rows = block_q * (q4.shape[1] // max(k4.shape[1], 1))  # (GQA: the group's heads stacked)
    if rows > TINY_TILE or block_k > TINY_TILE or gathered or q4.dtype == BFLOAT16:
        return None
    from .cpu.blas import tiny_library  # loads the BLAS, as the kernels will

    return tiny_library()


class ScheduleKey(NamedTuple):
    """Everything the schedule of a plain call (no boolean mask, not packed)
    depends on: the kernel arrays' sizes, the valid keys per batch entry
    (None: all), the positional variants and softcap, the work dtype, the
    requested tile sizes, the direction and the thread count."""

    batch: int
    heads: int
    kv_heads: int
    tq: int
    tk: int
    lengths: tuple | None
    causal: bool
    left: int
    right: int
    softcap: float | None
    work: type
    block_q: int | None
    block_k: int | None
    backward: bool
    threads: int


@lru_cache(maxsize=256)
def _plain_schedule(key: ScheduleKey):
    """:func:`_schedule` of a plain call, cached by its :class:`ScheduleKey`:
    a serving loop repeats a few shapes. The arrays are shared between
    calls; the kernels only read them. Its variants are the plain ones: a
    call with slopes, an additive mask or dropout replaces them with its own."""
    k = key
    seqs = _batch_table(k.batch, k.tq, k.tk, k.lengths)
    va = Variants(causal=k.causal, left=k.left, right=k.right, softcap=k.softcap)
    return (seqs,) + _schedule(
        seqs, va, (k.heads, k.kv_heads), (k.tq, k.tk), k.work, k.block_q, k.block_k, k.backward,
        k.threads,
    )  # fmt: skip


def _schedule(seqs, va, heads, extent, work, block_q, block_k, backward, threads):
    """``(block_q, block_k, KernelVariants, items, parts)`` for a sequence
    table; ``heads = (Hq, Hkv)``, ``extent = (Tq, Tk)`` of the arrays."""
    hq, n_kv = heads
    group = head_group(hq, n_kv)  # MQA too (Hkv = 1)
    block_q, block_k = tile_sizes(va, seqs, group, n_kv, block_q, block_k, backward, threads)
    variants = kernel_variants(va, work, hq)
    if va.mask_bool is not None:
        states = block_states(va, variants.mask_bool, block_q, block_k, *extent)
        variants = variants._replace(states=states)
    elif va.mods is not None and va.mods.has_mask:
        variants = variants._replace(states=va.mods.kernel_states(block_q, block_k, *extent))
    if backward:
        items, parts = backward_items(seqs, n_kv, block_q, threads)
    else:
        items, parts = forward_items(seqs, n_kv, variants, block_q, block_k), 1
    return block_q, block_k, variants, items, parts


def call_size(shapes: AttentionShapes) -> int:
    """A call's work as the thread count weighs it: query rows x keys x (d + dv)."""
    heads = 1
    for n in shapes.batch:
        heads *= n
    return heads * shapes.tq * shapes.tk * (shapes.d + shapes.dv)


def call_threads(size: int) -> int:
    """Threads for a call of ``size`` (:func:`call_size`): Numba's count, or 1
    below SERIAL_WORK (see there)."""
    return 1 if size < SERIAL_WORK else numba_threads()


def as_4d(a, work):
    """``a`` as a 4-D C-contiguous array of dtype ``work``: ``a`` itself when
    it already is one, else a view or a copy."""
    if a.ndim == 4 and a.dtype == work and a.flags.c_contiguous:
        return a  # the common case, without NumPy's calls
    return contiguous(a.reshape((1,) * (4 - a.ndim) + a.shape), work)


def contiguous(a, dtype):
    """``np.ascontiguousarray(a, dtype)``; bfloat16 widened to float32 (a CPU
    without bf16 products) by shifting its bits into place, exact and 2.5x
    faster than ml_dtypes' cast (0.10 against 0.26 ms for half a million values
    on an AVX2 EPYC)."""
    if a.dtype == BFLOAT16 and dtype == np.float32:
        return np.left_shift(a.view(np.uint16), 16, dtype=np.uint32, order="C").view(np.float32)
    return np.ascontiguousarray(a, dtype=dtype)


def as_blocks(q, k, v, shapes4: tuple, work, cache: bool) -> list:
    """``[q, k, v]`` as C-contiguous blocks of ``shapes4`` (a stored plan's
    kernel shapes), in the ``work`` dtype (``k``, ``v`` in their own with
    ``cache``, a decode plan's): each array itself when it already is one
    (a decoding step's usually are: NumPy's reshape and copy functions cost
    microseconds each with Python's code cold between a model's layers),
    else a view or a copy, as :func:`as_4d`."""
    dtypes = (work, k.dtype, v.dtype) if cache else (work, work, work)
    blocks = [q, k, v]
    for i in range(3):
        a, shape, dtype = blocks[i], shapes4[i], dtypes[i]
        if not (a.shape == shape and a.dtype == dtype and a.flags.c_contiguous):
            blocks[i] = contiguous(a.reshape(shape), dtype)
    return blocks


def bf16_products(dtype) -> bool:
    """Whether inputs of ``dtype`` reach the kernels as bfloat16 (the CPU and
    BLAS have bf16 products, :func:`flashtile.cpu.blas.bf16_products`)."""
    if dtype != BFLOAT16:
        return False
    from .cpu.blas import bf16_products as available  # loads the BLAS: only for bf16

    return available()


def kernel_arrays(call: Call):
    """``(q4, k4, v4)``: the arrays as 4-D contiguous blocks in the work dtype
    (the arrays themselves, or views, when they already are). The work dtype
    is float64 also for 16-bit and float32 inputs whose scores could pass
    float32's range (:mod:`flashtile.precision`); bfloat16 stays bfloat16
    where the CPU has bf16 products (:func:`bf16_products`) and they fit the
    call (the unscaled products inside float32's range, and
    :func:`flashtile.precision.bf16_products_fit`)."""
    shapes = call.shapes
    bound, products = bounds(call.scale, call.q, call.k, call.variants, shapes.tq, shapes.tk)
    work = work_dtype(call.q.dtype, bound)
    allowed = bf16_allowed(call.q.dtype, call.scale, shapes.d)
    if work == np.float32 and products < FLOAT32_SCORE_LIMIT and allowed:
        work = BFLOAT16
    return as_4d(call.q, work), as_4d(call.k, work), as_4d(call.v, work)


def bf16_allowed(dtype, scale: float, d: int) -> bool:
    """Whether operands of ``dtype`` at score multiplier ``scale`` and head
    dim ``d`` may keep bf16 tile products, by their metadata (the one rule of
    the forward, :func:`kernel_arrays`, and decoding,
    :func:`flashtile.decode_planning.decode_operands`): bfloat16, the CPU and
    BLAS have bf16 products (:func:`bf16_products`) and the scale fits
    (:func:`flashtile.precision.bf16_products_fit`). The one condition on the
    values, the unscaled products inside float32's range, is the caller's."""
    return dtype == BFLOAT16 and bf16_products_fit(scale, d) and bf16_products(dtype)


def _batch_table(n, tq, tk, lengths):
    seqs = np.zeros((n, SEQ_COLUMNS), dtype=np.int64)
    seqs[:, SEQ_BATCH] = np.arange(n)
    seqs[:, SEQ_TQ], seqs[:, SEQ_TK] = tq, tk
    seqs[:, SEQ_KV_LEN] = tk if lengths is None else lengths
    return seqs


def sequence_table(call: Call):
    """The ``(S, SEQ_COLUMNS)`` sequence table: one row per batch entry, or
    per packed sequence with queries (varlen)."""
    if call.cu_seqlens is None:
        lengths = call.variants.kv_lengths
        n = 1 if len(call.shapes.batch) < 2 else call.shapes.batch[0]
        return _batch_table(n, call.shapes.tq, call.shapes.tk, lengths)
    cq, ck = call.cu_seqlens
    keep = np.diff(cq) > 0  # a sequence without queries has nothing to compute
    seqs = np.zeros((int(keep.sum()), SEQ_COLUMNS), dtype=np.int64)
    seqs[:, SEQ_Q_START], seqs[:, SEQ_TQ] = cq[:-1][keep], np.diff(cq)[keep]
    seqs[:, SEQ_K_START], seqs[:, SEQ_TK] = ck[:-1][keep], np.diff(ck)[keep]
    seqs[:, SEQ_KV_LEN] = seqs[:, SEQ_TK]
    return seqs


def tile_sizes(
    va: Variants, seqs, group, n_kv, block_q, block_k, backward, threads
) -> tuple[int, int]:
    """``(block_q, block_k)`` for a call: the tile-size policy, all of it.

    Explicit sizes are kept (only cut to the data). Defaults: FWD_BLOCKS or
    BWD_BLOCKS; a boolean mask's MASK_BLOCKS, or a BlockMask's (or a
    mask_mod's block map's) own tiles (kept whole, so its summary is reused
    rather than rebuilt; partial tiles stay as small as the map's); with a
    two-sided window, rows shrink toward the band (MIN_WINDOW_BLOCK_Q). A
    default block_q is shared by a GQA group's heads (divided by ``group``)
    and, in the forward, halved until each of ``threads`` gets ITEMS_PER_THREAD
    items (never below MIN_BLOCK_Q).
    """
    bm = va.block_mask
    mapped = va.mods is not None and va.mods.has_mask
    keep_q = block_q is not None or bm is not None or mapped
    if bm is not None:
        defaults = (bm.block_q, bm.block_k)
    elif mapped:  # a mask_mod's block map, at its own tiles
        defaults = va.mods.block
    elif va.mask_bool is not None:
        defaults = MASK_BLOCKS
    else:
        defaults = BWD_BLOCKS if backward else FWD_BLOCKS
        if va.left >= 0 and va.right >= 0:  # a band (see MIN_WINDOW_BLOCK_Q)
            band = va.left + va.right + 1
            rows = 1 << max(band // 4, 1).bit_length() - 1  # largest power of two <= band / 4
            defaults = (min(defaults[0], max(MIN_WINDOW_BLOCK_Q, rows)), defaults[1])
    block_q = check_block_size(defaults[0] if block_q is None else block_q, "block_q")
    block_k = check_block_size(defaults[1] if block_k is None else block_k, "block_k")
    if not keep_q:  # a GQA group shares the tile's rows
        block_q = max(MIN_BLOCK_Q, block_q // group)
    lengths = seqs[:, SEQ_TQ]
    block_q = min(block_q, int(lengths.max(initial=1)))  # buffers fit the data
    block_k = min(block_k, int(seqs[:, SEQ_TK].max(initial=1)))
    if not (keep_q or backward):
        want = ITEMS_PER_THREAD * threads
        while block_q > MIN_BLOCK_Q and n_kv * int((-(-lengths // block_q)).sum()) < want:
            block_q = max(MIN_BLOCK_Q, block_q // 2)
    return block_q, block_k


def kernel_variants(va: Variants, work, heads: int) -> KernelVariants:
    """The variants in kernel form: log2 units, zero-size arrays when off.

    ``heads`` is ``Hq`` (ALiBi slopes become ``(1 or B, Hq)``). The block
    map of a boolean mask depends on the tile sizes: :func:`block_states`.
    """
    empty_f = np.zeros((0, 0, 0, 0), dtype=work)
    alibi = np.zeros((0, 0), dtype=work)
    if va.alibi is not None:  # (Hq, 1, 1) or (B, Hq, 1, 1) -> (1 or B, Hq)
        slopes = np.atleast_2d(va.alibi[..., 0, 0])  # not reshape(-1, Hq): Hq may be 0
        alibi = np.ascontiguousarray(slopes * LOG2E, dtype=work)
    mask_add = empty_f
    if va.mask_add is not None:
        # Finite values lie within +-MASK_LIMIT (variants.py): no overflow in
        # the work dtype (a float16 mask is widened first: -60000 * log2(e) is not float16).
        mask_add = _mask4(va.mask_add.astype(work) * LOG2E)
    mask_bool = np.zeros((0, 0, 0, 0), dtype=np.bool_)
    if va.mask_bool is not None:
        mask_bool = _mask4(va.mask_bool)
    # Read-only always: a BlockMask keeps its mask read-only, and a writeable
    # array would be another Numba type, so another compilation of each kernel.
    mask_bool = mask_bool.view()
    mask_bool.flags.writeable = False
    states = np.zeros((0, 0, 0, 0), dtype=np.int8)
    softcap = 0.0 if va.softcap is None else va.softcap * LOG2E
    seed = va.dropout_seed
    return KernelVariants(
        va.causal, va.left, va.right, softcap, alibi, mask_add, mask_bool, states,
        keep_threshold(va.dropout_p), seed & 0xFFFFFFFF, seed >> 32, va.dropout_offset,
        1.0 / (1.0 - va.dropout_p), *_mod_fields(va.mods, work),
    )  # fmt: skip


#: The mod fields of a call without mods (shared: the kernels only read them).
_NO_MODS = (0, 0, 0, 0, np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros((0, 0)))


def _mod_fields(mods, work) -> tuple:
    """:class:`KernelVariants`' mod fields: the row functions' addresses for
    the work dtype, the captured tables, and an empty gradient buffer (the
    backward's caller sizes it, :mod:`flashtile.torch.flex`)."""
    if mods is None:
        return _NO_MODS
    rows = mods.rows(work)
    return (*rows, mods.floats, mods.ints, np.zeros((0, 0)))


def _mask4(mask, work=None):
    """A broadcastable mask as 4 dims, contiguous (optionally cast)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return np.ascontiguousarray(mask if work is None else mask.astype(work))


def block_states(va: Variants, mask4, block_q, block_k, tq, tk) -> np.ndarray:
    """``(Bm, Hm, ceil(Tq/block_q), ceil(Tk/block_k))`` int8 tile states
    (``TILE_*``) of the bool mask ``mask4``; a BlockMask's own summary when
    its tiles match."""
    blocks = va.block_mask
    if blocks is None or (blocks.block_q, blocks.block_k) != (block_q, block_k):
        # Size-1 (broadcast) dims summarise as one block each, then broadcast.
        bq = block_q if mask4.shape[2] > 1 else 1
        bk = block_k if mask4.shape[3] > 1 else 1
        blocks = block_mask(mask4, bq, bk)
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    shape = (*blocks.states.shape[:2], nq, nk)
    # A fresh writeable copy: one compiled kernel serves every call (a
    # read-only array would be a second type, and a second compilation).
    return np.array(np.broadcast_to(blocks.states, shape), dtype=np.int8, order="C")

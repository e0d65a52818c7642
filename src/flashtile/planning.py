"""One plan per call: everything a compiled kernel reads, decided in one place.

:mod:`flashtile.api` and :mod:`flashtile.decode` validate a call, ask here
for its plan, and hand the plan to :mod:`flashtile.cpu.launch`; the kernels
then only execute it.

- :func:`plan_forward` and :func:`plan_backward` take a validated
  :class:`Call` and return a :class:`KernelPlan`: the arrays as 4-D
  contiguous blocks in the work dtype, one row per sequence in the ``seqs``
  table (columns ``SEQ_*``, :mod:`flashtile.cpu.tiles`), the tile sizes
  (:func:`tile_sizes`: the one tile-size policy), the variants in kernel form
  with a boolean mask's block map summarised for those tiles
  (:func:`kernel_variants`, :func:`block_states`), and the work items, one
  ``(sequence, kv head, query block)`` (forward) or ``(sequence, kv head,
  part)`` (backward) each, ordered so that ``prange``'s static schedule gives
  every thread a similar share (:func:`balance`).
- :func:`plan_decode` returns a :class:`DecodePlan`: a decode step's key
  chunks (split-KV) as work items and the slots their partial results are
  merged from (:func:`plan_splits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from ._validate import BFLOAT16, AttentionShapes, check_block_size, compute_dtype, head_group
from .cpu.tiles import (
    LOG2E,
    SEQ_BATCH,
    SEQ_COLUMNS,
    SEQ_K_START,
    SEQ_KV_LEN,
    SEQ_Q_START,
    SEQ_TK,
    SEQ_TQ,
    KernelVariants,
)
from .kvlayout import CacheLayout
from .masks import TILE_EMPTY, block_key_range, block_mask
from .precision import score_bound, work_dtype
from .variants import Variants

#: Default tile sizes (query rows per item x keys), picked by sweeps on the
#: 2-core machine (docs/benchmarks.md). Forward: a 256 x 512 float32 score
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
#: The forward's default block_q halves until every thread gets this many items.
ITEMS_PER_THREAD = 4
#: With a sliding window of ``band`` keys per query, a tile of ``block_q``
#: rows needs about ``band + block_q`` keys for ``band`` useful per row, so
#: the default rows shrink toward ``band / 4`` (useful fraction about 80%),
#: not below this many (smaller tile products lose more than they save).
#: Measured at T=4096, window 256: 64 rows 0.79x the time of 256 rows.
MIN_WINDOW_BLOCK_Q = 64

#: Decoding: keys per tile. A 256-key K tile of d=128 float32 is 128 KiB, so
#: the tile, its V tile and the prefetched next pair stay in L2.
DECODE_TILE = 256
#: A decode chunk is never shorter than this (unless the sequence is): below
#: it the per-chunk work (loading the queries, writing a partial) stops being small.
MIN_SPLIT_KEYS = 512
#: Automatic splitting aims at this many chunks per thread, so that the
#: static schedule can balance sequences of different lengths.
CHUNKS_PER_THREAD = 4


class Call(NamedTuple):
    """One validated attention call: the planner's input (built by :mod:`flashtile.api`).

    Attributes:
        q, k, v: the caller's arrays, validated (float dtype, shapes, layout).
        shapes: their sizes (:func:`flashtile._validate.check_qkv`).
        variants: the resolved variant keywords.
        scale: the score multiplier.
        cu_seqlens: ``(cu_q, cu_k)`` int64 offsets of a packed varlen batch,
            or None for a batched call.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    shapes: AttentionShapes
    variants: Variants
    scale: float
    cu_seqlens: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class KernelPlan:
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


def plan_forward(call: Call, block_q=None, block_k=None) -> KernelPlan:
    """The forward kernel's plan for ``call`` (tile sizes default when None)."""
    return _plan(call, block_q, block_k, backward=False)


def plan_backward(call: Call, block_q=None, block_k=None) -> KernelPlan:
    """The backward kernel's plan for ``call`` (tile sizes default when None)."""
    return _plan(call, block_q, block_k, backward=True)


def _plan(call, block_q, block_k, backward):
    q4, k4, v4, seqs = lay_out(call, keep_bf16=bf16_products(call.q.dtype))
    n_kv = k4.shape[1]
    group = head_group(q4.shape[1], n_kv)  # MQA too (Hkv = 1)
    va = call.variants
    block_q, block_k = tile_sizes(va, seqs, group, n_kv, block_q, block_k, backward)
    variants = kernel_variants(va, compute_dtype(q4.dtype), q4.shape[1])
    if va.mask_bool is not None:
        states = block_states(va, variants.mask_bool, block_q, block_k, q4.shape[2], k4.shape[2])
        variants = variants._replace(states=states)
    if backward:
        items, parts = backward_items(seqs, n_kv, block_q)
    else:
        items, parts = forward_items(seqs, n_kv, variants, block_q, block_k), 1
    out_shape = call.shapes.batch + (call.shapes.tq,)
    return KernelPlan(
        q4, k4, v4, seqs, items, parts, variants, call.scale, block_q, block_k, call.q.dtype,
        out_shape,
    )  # fmt: skip


def _as4d(a, work):
    return np.ascontiguousarray(a.reshape((1,) * (4 - a.ndim) + a.shape), dtype=work)


def bf16_products(dtype) -> bool:
    """Whether inputs of ``dtype`` reach the kernels as bfloat16 (the CPU and
    BLAS have bf16 products, :func:`flashtile.cpu.blas.bf16_products`)."""
    if dtype != BFLOAT16:
        return False
    from .cpu.blas import bf16_products as available  # loads the BLAS: only for bf16

    return available()


def lay_out(call: Call, keep_bf16: bool = False):
    """``(q4, k4, v4, seqs)``: the arrays as 4-D contiguous blocks in the work
    dtype (bfloat16 kept as it is with ``keep_bf16``) and the sequence table,
    one row per batch entry, or per packed sequence with queries (varlen). The
    work dtype is float64 also for 16-bit and float32 inputs whose scores
    could pass float32's range (:mod:`flashtile.precision`)."""
    shapes = call.shapes
    bound = score_bound(call.scale, call.q, call.k, call.variants, shapes.tq, shapes.tk)
    work = work_dtype(call.q.dtype, bound)
    if keep_bf16 and work == np.float32:  # bf16 products, unless float64 is needed
        work = BFLOAT16
    q4, k4, v4 = (_as4d(a, work) for a in (call.q, call.k, call.v))
    if call.cu_seqlens is None:
        n = q4.shape[0]
        lengths = call.variants.kv_lengths
        seqs = np.zeros((n, SEQ_COLUMNS), dtype=np.int64)
        seqs[:, SEQ_BATCH] = np.arange(n)
        seqs[:, SEQ_TQ], seqs[:, SEQ_TK] = call.shapes.tq, call.shapes.tk
        seqs[:, SEQ_KV_LEN] = call.shapes.tk if lengths is None else lengths
        return q4, k4, v4, seqs
    cq, ck = call.cu_seqlens
    keep = np.diff(cq) > 0  # a sequence without queries has nothing to compute
    seqs = np.zeros((int(keep.sum()), SEQ_COLUMNS), dtype=np.int64)
    seqs[:, SEQ_Q_START], seqs[:, SEQ_TQ] = cq[:-1][keep], np.diff(cq)[keep]
    seqs[:, SEQ_K_START], seqs[:, SEQ_TK] = ck[:-1][keep], np.diff(ck)[keep]
    seqs[:, SEQ_KV_LEN] = seqs[:, SEQ_TK]
    return q4, k4, v4, seqs


def tile_sizes(va: Variants, seqs, group, n_kv, block_q, block_k, backward) -> tuple[int, int]:
    """``(block_q, block_k)`` for a call: the tile-size policy, all of it.

    Explicit sizes are kept (only cut to the data). Defaults: FWD_BLOCKS or
    BWD_BLOCKS; a boolean mask's MASK_BLOCKS, or a BlockMask's own tiles
    (kept whole, so its summary is reused rather than rebuilt); with a
    two-sided window, rows shrink toward the band (MIN_WINDOW_BLOCK_Q). A
    default block_q is shared by a GQA group's heads (divided by ``group``)
    and, in the forward, halved until every thread gets ITEMS_PER_THREAD
    items (never below MIN_BLOCK_Q).
    """
    bm = va.block_mask
    keep_q = block_q is not None or bm is not None
    if bm is not None:
        defaults = (bm.block_q, bm.block_k)
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
        want = ITEMS_PER_THREAD * numba.get_num_threads()
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
    states = np.zeros((0, 0, 0, 0), dtype=np.int8)
    softcap = 0.0 if va.softcap is None else va.softcap * LOG2E
    return KernelVariants(va.causal, va.left, va.right, softcap, alibi, mask_add, mask_bool, states)


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


def forward_items(seqs, n_kv, variants: KernelVariants, block_q, block_k) -> np.ndarray:
    """Work items ``(sequence, kv head, i0)``, balanced for a static schedule.

    An item's cost is its rows times the keys it computes: its key span, or
    with a block map the kept key blocks in it.
    """
    items, spans = enumerate_items(seqs, n_kv, variants, block_q)
    rows = np.minimum(block_q, seqs[items[:, 0], SEQ_TQ] - items[:, 2])
    if variants.states.size > 0:
        keys = block_k * kept_blocks(seqs, n_kv, items, spans, variants.states, block_q, block_k)
    else:
        keys = spans[:, 1] - spans[:, 0]
    return balance(items, rows * keys + 1)


def enumerate_items(seqs, n_kv, variants: KernelVariants, block_q):
    """``(items (N, 3), spans (N, 2))``: every item and the key range it can see."""
    va = variants
    items, spans = [], []
    for s, row in enumerate(seqs.tolist()):
        tq, tk, kv_len = row[SEQ_TQ], row[SEQ_TK], row[SEQ_KV_LEN]
        for i0 in range(0, tq, block_q):
            i1 = min(i0 + block_q, tq)
            lo, hi = block_key_range(i0, i1, tq, tk, va.causal, va.left, va.right, kv_len)
            for hk in range(n_kv):
                items.append((s, hk, i0))
                spans.append((lo, max(lo, hi)))
    return (
        np.array(items, dtype=np.int64).reshape(-1, 3),
        np.array(spans, dtype=np.int64).reshape(-1, 2),
    )


def kept_blocks(seqs, n_kv, items, spans, states, block_q, block_k):
    """Key blocks each item computes with a block map: kept ones in its span.

    A block counts when any query head of the item's group keeps it, as in
    the kernel (:func:`.cpu.tiles.tile_state`).
    """
    kept = states != TILE_EMPTY  # (Bm, Hm, nq, nk)
    if kept.shape[1] > 1:  # per query head: a kv head computes its group's union
        kept = kept.reshape(kept.shape[0], n_kv, -1, *kept.shape[2:]).any(axis=2)
    before = np.zeros(kept.shape[:3] + (kept.shape[3] + 1,), dtype=np.int64)
    np.cumsum(kept, axis=3, out=before[..., 1:])  # kept blocks before block j
    b = seqs[items[:, 0], SEQ_BATCH] % kept.shape[0]
    h = items[:, 1] % kept.shape[1]
    qb = items[:, 2] // block_q
    kb_lo = spans[:, 0] // block_k
    kb_hi = np.maximum(kb_lo, -(-spans[:, 1] // block_k))
    return before[b, h, qb, kb_hi] - before[b, h, qb, kb_lo]


def balance(items: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Order items so that contiguous equal-count chunks carry similar work.

    Numba's ``prange`` hands each thread one contiguous run of items. Sorting
    by cost and interleaving from both ends (largest, smallest, second
    largest, ...) puts a heavy and a light item next to each other, so every
    run gets about the same total (causal, windows, varlen lengths).
    """
    order = np.argsort(-costs, kind="stable")
    zig = np.empty_like(order)
    half = (len(order) + 1) // 2
    zig[0::2] = order[:half]
    zig[1::2] = order[half:][::-1]
    return np.ascontiguousarray(items[zig])


def backward_items(seqs, n_kv, block_q) -> tuple[np.ndarray, int]:
    """``(sequence, kv head, part)`` items and the number of parts.

    One part per ``(sequence, kv head)`` when there are enough of them for
    the threads; otherwise each is split into parts that take every P-th
    query block, so a single head (or MQA at batch 1) still uses every core.
    """
    pairs = len(seqs) * n_kv
    threads = numba.get_num_threads()
    most_blocks = int((-(-seqs[:, SEQ_TQ] // block_q)).max(initial=1))
    parts = 1 if pairs >= threads or pairs == 0 else min(-(-threads // pairs), most_blocks)
    items = np.array(
        [(s, hk, p) for s in range(len(seqs)) for hk in range(n_kv) for p in range(parts)],
        dtype=np.int64,
    ).reshape(-1, 3)
    costs = (seqs[items[:, 0], SEQ_TQ] * seqs[items[:, 0], SEQ_TK]).astype(np.float64)
    return balance(items, costs), parts


class DecodePlan(NamedTuple):
    """Everything the decode kernel reads (see :func:`plan_decode`).

    Attributes:
        q: ``(B, Hq, Tq, d)`` C-contiguous in the work dtype.
        layout: the validated cache (:class:`flashtile.kvlayout.CacheLayout`).
        items: ``(N, 5)`` int64 ``(b, kv head, j_lo, j_hi, slot)`` in thread order.
        spans: ``(B * Hkv, 2)`` int64: first slot and count of each
            ``(b, kv head)``'s partials.
        variants: :class:`KernelVariants` (no mask arrays).
        scale: the score multiplier; tile_keys: keys per tile.
    """

    q: np.ndarray
    layout: CacheLayout
    items: np.ndarray
    spans: np.ndarray
    variants: KernelVariants
    scale: float
    tile_keys: int


def plan_decode(q, layout: CacheLayout, va: Variants, scale, num_splits) -> DecodePlan:
    """The decode kernel's plan for validated ``q (B, Hq, Tq, d)`` and cache.

    ``num_splits``: chunks per sequence, or None to choose (:func:`plan_splits`).
    The work dtype is float64 for a float64 cache, else float32.
    """
    work = compute_dtype(layout.k.dtype)
    tq = q.shape[2]
    ranges = np.zeros((len(layout.seqlens), 2), dtype=np.int64)
    for b, n in enumerate(layout.seqlens.tolist()):  # keys any query of b can see
        ranges[b] = block_key_range(0, tq, tq, n, va.causal, va.left, va.right, n)
    items, spans = plan_splits(ranges, layout.heads, num_splits, numba.get_num_threads())
    variants = kernel_variants(va, work, q.shape[1])
    q_work = np.ascontiguousarray(q, dtype=work)
    return DecodePlan(q_work, layout, items, spans, variants, scale, DECODE_TILE)


def plan_splits(ranges, kv_heads, num_splits, threads, tile=DECODE_TILE):
    """Split each sequence's visible keys into chunks: the decode work items.

    Args:
        ranges: ``(B, 2)`` visible keys ``[lo, hi)`` per sequence.
        num_splits: chunks per sequence, or None: chunks of equal length
            (a multiple of ``tile``, at least MIN_SPLIT_KEYS) sized so that
            the whole batch makes about CHUNKS_PER_THREAD chunks per thread.

    Returns:
        ``items (N, 5)`` int64 rows ``(b, kv head, j_lo, j_hi, slot)`` in the
        order the threads should take them, and ``spans (B * Hkv, 2)``:
        the first slot and the count of each ``(b, kv head)``'s partials.
    """
    lengths = ranges[:, 1] - ranges[:, 0]
    if num_splits is None:
        total = kv_heads * int(lengths.sum())
        chunk = max(MIN_SPLIT_KEYS, -(-total // (CHUNKS_PER_THREAD * threads)))
        chunk = -(-chunk // tile) * tile
        splits = np.maximum(1, -(-lengths // chunk))
        chunks = np.full(len(lengths), chunk, dtype=np.int64)
    else:
        # More chunks than keys would only add empty partials.
        splits = np.minimum(num_splits, np.maximum(lengths, 1))
        chunks = np.maximum(1, -(-lengths // splits))
    # Slots run (b, kv head, chunk)-major, so each pair's partials are adjacent.
    pair_b = np.repeat(np.arange(len(lengths)), kv_heads)
    pair_splits = splits[pair_b]
    first = np.concatenate([[0], np.cumsum(pair_splits)[:-1]])
    slot_pair = np.repeat(np.arange(len(pair_b)), pair_splits)
    b = pair_b[slot_pair]
    chunk_index = np.arange(len(slot_pair)) - first[slot_pair]
    j_lo = np.minimum(ranges[b, 0] + chunk_index * chunks[b], ranges[b, 1])
    j_hi = np.minimum(j_lo + chunks[b], ranges[b, 1])
    items = np.stack([b, slot_pair % kv_heads, j_lo, j_hi, np.arange(len(b))], axis=1)
    spans = np.stack([first, pair_splits], axis=1).astype(np.int64)
    costs = (items[:, 3] - items[:, 2]) + 64  # + the fixed cost of a chunk
    return balance(items, costs), spans

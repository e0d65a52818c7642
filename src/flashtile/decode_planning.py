"""Decoding's plans: a decode step's key chunks as work items, and which
attention calls go to the decode kernel.

- :func:`plan_decode` returns a :class:`DecodePlan`: a decode step's key
  chunks (split-KV) as work items and the slots their partial results are
  merged from (:func:`flashtile.workitems.plan_splits`), the tile length,
  the operands' dtype (:func:`decode_operands`: bf16 products or widened
  16-bit caches) and how items walk the cache
  (:func:`flashtile.workitems.decode_walk`).
- :func:`decode_shaped` is the rule that sends an attention call with a few
  queries against many keys to the decode kernel (:func:`plan_decode_call`).

The forward's and backward's plans, and the pieces shared with them
(variants in kernel form, thread counts), are :mod:`flashtile.planning`'s.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import routes
from ._validate import BFLOAT16, compute_dtype, head_group
from .cpu.launch import numba_threads
from .cpu.tiles import KernelVariants
from .kvlayout import CacheLayout
from .masks import block_key_range
from .planning import Call, as_4d, bf16_allowed, bf16_products, call_threads, kernel_variants
from .variants import Variants
from .workitems import (
    DECODE_TILE,
    HEAD_ROWS,
    HEAD_TILES,
    HEAD_WALKS,
    ROWS,
    TILES,
    decode_tile,
    decode_walk,
    plan_splits,
)

#: Decode-shaped calls (:func:`decode_shaped`): at most DECODE_MAX_QUERIES
#: queries against at least DECODE_MIN_KEYS keys, where the split-KV decode
#: kernel beats the forward kernel: where it stacks a GQA/MQA group's
#: queries into 2..DECODE_MAX_ROWS rows per kv head, for one query per head
#: (MHA too), or where the forward has fewer (batch, kv head) items than
#: threads (the decode kernel splits the keys instead). Measured on the
#: 2-core machine under load, one thread (time on decode / time on forward):
#: GQA 16/4 and 32/8, one query, 512-8192 keys 0.64-0.69; 32 rows 1.0-1.15;
#: MHA, one query, kernels alone 1.1-1.4, but whole calls 0.58-0.91 (12
#: heads, 512-8192 keys): the forward pays a pass over k for the score bound.
DECODE_MAX_QUERIES = 16
DECODE_MAX_ROWS = 16
DECODE_MIN_KEYS = 512
#: The Triton backend's cut-off, beside the CPU's: CUDA calls of at most this
#: many queries (4-D, no gradient wanted, no ``kv_lengths`` or dropout) run
#: the split-KV decode kernel (the rule: :mod:`flashtile.triton.frontdoor`,
#: the GPU route of ``flashtile.torch.attention`` and
#: ``flashtile.triton.attention``). Not measured
#: yet (no session that set it had a GPU); kept here so that a measurement
#: changes one line, next to the CPU's measured one.
TRITON_DECODE_MAX_QUERIES = 8


class DecodePlan(NamedTuple):
    """Everything the decode kernel reads (see :func:`plan_decode`).

    Attributes:
        q: ``(B, Hq, Tq, d)`` C-contiguous in the work dtype, or bf16 for
            bf16 products (:func:`decode_operands`).
        layout: the validated cache (:class:`flashtile.kvlayout.CacheLayout`).
        items: ``(N, 5)`` int64 ``(b, kv head, j_lo, j_hi, slot)`` in thread order
            (with the :data:`~flashtile.workitems.HEAD_WALKS`, one item per
            chunk for kv head 0, standing for every head).
        spans: ``(B * Hkv, 2)`` int64: first slot and count of each
            ``(b, kv head)``'s partials.
        variants: :class:`KernelVariants` (no mask arrays).
        scale: the score multiplier; tile_keys: keys per tile.
        threads: how many threads run the kernel
            (:func:`flashtile.planning.call_threads`).
        walk: how the items walk the cache (:func:`flashtile.workitems.decode_walk`):
            ``"tiles"``, ``"tiles-stream"`` (no software prefetch of the
            next tile), ``"rows"`` (read in place, ``cpu/cache_rows.py``),
            ``"head-tiles"`` or ``"head-rows"`` (every kv head at once).
        small: the library of the tile products where the ``blas.one`` /
            ``blas.few`` routes decide it, else None
            (:func:`flashtile.cpu.blas.small_library`).
        size: the call's work, as the thread count weighs it (as
            :func:`flashtile.planning.call_size` does, over the valid keys;
            the launcher's join watch sorts calls by it).
    """

    q: np.ndarray
    layout: CacheLayout
    items: np.ndarray
    spans: np.ndarray
    variants: KernelVariants
    scale: float
    tile_keys: int
    threads: int
    walk: str
    small: str | None = None
    size: int = 0


def plan_decode(q, layout: CacheLayout, va: Variants, scale, num_splits) -> DecodePlan:
    """The decode kernel's plan for validated ``q (B, Hq, Tq, d)`` and cache.

    ``num_splits``: chunks per sequence, or None to choose (:func:`plan_splits`).
    The work dtype is float64 for a float64 cache, else float32; ``q`` is
    cast to it, or kept bf16 for bf16 products (:func:`decode_operands`).
    Items read rows in place (the ``"rows"`` walk of
    :func:`flashtile.workitems.decode_walk`) in float32 only: float64 work
    (float64 caches and the range fallback of :mod:`flashtile.precision`) is
    not the serving case, and a float64 row walk would be one more compiled
    kernel.
    """
    work = compute_dtype(layout.k.dtype)
    _, hq, tq, d = q.shape
    lengths = tuple(layout.seqlens.tolist())
    size = hq * tq * sum(lengths) * (d + layout.v.shape[3])
    threads = call_threads(size)
    if va.alibi is None:
        variants = _plain_schedule_variants(va.causal, va.left, va.right, va.softcap, work)
    else:
        variants = kernel_variants(va, work, hq)
    rows = (hq // layout.heads) * tq
    longest = max(lengths, default=0)
    walk = decode_walk(rows, layout.page, layout.table.shape[1], layout.heads, d, longest)
    if walk in HEAD_WALKS and num_splits is not None and len(lengths) * num_splits < threads:
        # One item per sequence and split would leave threads idle: per-head items.
        walk = ROWS if walk == HEAD_ROWS else TILES
    in_place = walk in (ROWS, HEAD_ROWS)
    operands = decode_operands(q.dtype, layout, scale, in_place)
    if in_place and operands != np.float32:  # the tiles of the same items instead
        walk = TILES if walk == ROWS else HEAD_TILES
    head_bytes = layout.heads * (d + layout.v.shape[3]) * np.dtype(operands).itemsize
    tile_keys = decode_tile(rows, layout.page, walk, head_bytes)
    split = tile_keys
    if walk == HEAD_ROWS and layout.page == 1:
        # Chunks as fine as the head-tiles walk's tiles (many threads get as many
        # items as before its tiles grew); a chunk's last tile ends at the chunk.
        split = decode_tile(rows, 1, HEAD_TILES, head_bytes)
    items, spans = _decode_splits(
        lengths, tq, va.causal, va.left, va.right, layout.heads, num_splits, threads,
        *((layout.heads, split) if walk in HEAD_WALKS else (1, DECODE_TILE)),
    )  # fmt: skip
    q_work = np.ascontiguousarray(q, dtype=operands)
    from .cpu.blas import small_library  # loads the BLAS (not with flashtile): the kernels will

    small = small_library(rows) if operands != BFLOAT16 else None
    return DecodePlan(
        q_work, layout, items, spans, variants, scale, tile_keys, threads, walk, small, size
    )


class LengthsPlan:
    """The last :func:`plan_decode` plan of a stored call whose plan follows
    its lengths (:func:`flashtile.decode_attention` with ``cache_seqlens`` or
    a block table, ``flash_attn_with_kvcache``'s stored step), for the next
    call with the same lengths: the layers of a model's decoding step attend
    with the same lengths, and all but the first skip planning. The plan is
    kept without its queries and cache (they are the call's own, and a kept
    cache would outlive the user's); what else it depends on is fixed by the
    stored call's key, or compared here (the thread count, the routes'
    :data:`~flashtile.routes.GENERATION`, for bf16 queries whether bf16
    products run). As with the other stored plans, a route's environment
    variable changed meanwhile applies from the next plan (here: the next
    lengths)."""

    __slots__ = ("last",)

    def __init__(self):
        self.last = None  # (what it was planned for, the plan less q and layout, q's dtype)

    def plan(self, q, layout: CacheLayout, va: Variants, scale, num_splits) -> DecodePlan:
        """:func:`plan_decode`'s plan, reused when the last one was planned
        for the same lengths and shapes."""
        products = bf16_products(BFLOAT16) if q.dtype == BFLOAT16 else None  # (as frontdoor.live)
        seen = (
            layout.seqlens.tobytes(), q.shape, q.dtype, layout.k.dtype, layout.table.shape,
            layout.page, numba_threads(), routes.GENERATION[0], products,
        )  # fmt: skip
        last = self.last  # (one read: another thread may store meanwhile)
        if last is not None and last[0] == seen:
            return last[1]._replace(q=np.ascontiguousarray(q, dtype=last[2]), layout=layout)
        plan = plan_decode(q, layout, va, scale, num_splits)
        self.last = (seen, plan._replace(q=None, layout=None), plan.q.dtype)
        return plan


def decode_operands(q_dtype, layout: CacheLayout, scale: float, row_walk: bool) -> np.dtype:
    """The dtype of the decode kernel's tile products: bfloat16 when the
    queries and the cache are bf16 and the forward's rule allows it
    (:func:`flashtile.planning.bf16_allowed`: scores of bf16 operands, ``P``
    rounded to bf16), else the work dtype (a 16-bit cache widened).
    Not for items that read rows in place (``row_walk``): they widen in
    registers, faster than a bf16 gather and gemv per tile (12 heads, d 64,
    16-key pages: the bf16 products took 1.09-1.10x the time). The unscaled
    products' range is checked after the step
    (:func:`flashtile.precision.decode_bound`)."""
    k, v = layout.k.dtype, layout.v.dtype
    bf16 = k == BFLOAT16 and v == BFLOAT16 and not row_walk
    if bf16 and bf16_allowed(q_dtype, scale, layout.k.shape[3]):
        return BFLOAT16
    return compute_dtype(k)


@lru_cache(maxsize=256)
def _decode_splits(lengths, tq, causal, left, right, kv_heads, num_splits, threads, heads, tile):
    """:func:`plan_splits` for sequences of ``lengths`` keys, cached (shared arrays)."""
    ranges = np.zeros((len(lengths), 2), dtype=np.int64)
    for b, n in enumerate(lengths):  # keys any query of b can see
        ranges[b] = block_key_range(0, tq, tq, n, causal, left, right, n)
    return plan_splits(ranges, kv_heads, num_splits, threads, tile, heads)


@lru_cache(maxsize=64)
def _plain_schedule_variants(causal, left, right, softcap, work) -> KernelVariants:
    """:func:`kernel_variants` without slopes or masks, cached (its arrays are empty)."""
    return kernel_variants(Variants(causal, left, right, softcap=softcap), work, 0)


def decode_shaped(call: Call, block_q=None, block_k=None) -> bool:
    """Whether :func:`flashtile.attention` runs ``call`` on the decode kernel.

    The rule (constants and measurements at DECODE_MAX_QUERIES): a batched
    call (not packed) without a mask or explicit tile sizes (those are the
    forward kernel's) or dropout, at most DECODE_MAX_QUERIES queries against at least
    DECODE_MIN_KEYS keys, and either at most DECODE_MAX_ROWS stacked rows
    per kv head (one query per head, or a GQA/MQA group times its queries)
    or fewer ``(batch, kv head)`` pairs than threads. The decode kernel
    places query ``i`` at ``kv_len - Tq + i``, the forward at ``Tk - Tq +
    i``: with ``kv_lengths`` shorter than ``Tk`` they agree only when no
    window, ALiBi distance or causal limit depends on it (no window, no
    slopes, and one query or no causal mask).
    """
    shapes, va = call.shapes, call.variants
    if call.cu_seqlens is not None or block_q is not None or block_k is not None:
        return False
    if va.mask_bool is not None or va.mask_add is not None or 0 in shapes.batch:
        return False
    if va.dropout_p > 0.0 or va.mods is not None:  # the forward kernel's variants
        return False
    if not (shapes.tq <= DECODE_MAX_QUERIES and shapes.tk >= DECODE_MIN_KEYS):
        return False
    heads = shapes.batch[-1] if shapes.batch else 1
    group = heads if call.k.ndim < 3 else head_group(heads, call.k.shape[-3])
    pairs = (shapes.batch[0] if len(shapes.batch) > 1 else 1) * (heads // group)
    stacked = (group > 1 or shapes.tq == 1) and group * shapes.tq <= DECODE_MAX_ROWS
    if not (stacked or pairs < numba_threads()):
        return False
    if va.kv_lengths is None or bool((va.kv_lengths == shapes.tk).all()):
        return True
    # A right side >= 0 (causal is right = 0) limits keys by position, as do a
    # left side and ALiBi distances; with one query only the left side and ALiBi.
    return not (va.left >= 0 or va.alibi is not None or (va.right >= 0 and shapes.tq > 1))


def plan_decode_call(call: Call) -> DecodePlan:
    """The decode kernel's plan for a :func:`decode_shaped` call: its keys and
    values are a contiguous cache of ``Tk`` keys (``kv_lengths`` valid). No
    score bound first (it would read the keys once more): the caller checks
    the step's ``lse`` afterwards, as decoding does (:mod:`flashtile.precision`)."""
    # The arrays as given (a 16-bit cache is read as such: no widened copy
    # per call); plan_decode gives q its dtype.
    q4, k4, v4 = (as_4d(a, a.dtype) for a in (call.q, call.k, call.v))
    n, tk = q4.shape[0], k4.shape[2]
    table, seqlens = _whole_cache(n, tk)
    if call.variants.kv_lengths is not None:
        seqlens = call.variants.kv_lengths
    layout = CacheLayout(k4, v4, table, seqlens, tk, False)
    return plan_decode(q4, layout, call.variants, call.scale, None)


@lru_cache(maxsize=64)
def _whole_cache(n: int, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """``(table, seqlens)`` of ``n`` contiguous caches of ``tk`` keys, all
    valid, cached (shared arrays: the kernel only reads them)."""
    return np.arange(n, dtype=np.int64)[:, None], np.full(n, tk, dtype=np.int64)

"""Work items: which thread computes which part of a call, in which order.

Numba's ``prange`` hands each thread one contiguous run of items (static
schedule), so every list here ends in :func:`balance`, which orders items so
that the runs carry similar work. Forward items are ``(sequence, kv head,
query block)``, backward items ``(sequence, kv head, part)``, decode items
``(sequence, kv head, key chunk, slot)``. The sizes that go into them (tiles,
threads) are :mod:`flashtile.planning`'s choice.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import routes
from .cpu.tiles import SEQ_BATCH, SEQ_KV_LEN, SEQ_TK, SEQ_TQ, KernelVariants
from .masks import TILE_EMPTY, block_key_range

#: The forward's default block_q halves until every thread gets this many items.
ITEMS_PER_THREAD = 4
#: Decoding: keys per tile. A 256-key K tile of d=128 float32 is 128 KiB, so
#: the tile, its V tile and the prefetched next pair stay in L2.
DECODE_TILE = 256
#: Decoding items of one query row (MHA, one query), and items that read the
#: rows in place (the ``rows`` walk), in a contiguous cache or pages of at
#: least this many keys take tiles of this many. One row: the two tile
#: products are then a gemv each, whose fixed cost a longer tile spreads
#: (12 heads, d 64, Tk 2048-8192, 2 threads: 0.88-0.90x the time of 256-key
#: tiles in bf16, 0.93-0.95x in float32). The rows walk: its K and V reads
#: alternate once per tile, and longer runs stream better (AVX2 AMD EPYC,
#: three processes each way: GQA 32/8 d 128 Tk=65536 21.4-21.8 ms against
#: 22.1-22.3, GQA 16/4 d 64 8192 keys 3.05-3.18 ms against 3.38-3.45).
#: BLAS tiles of several rows keep 256 (GQA 32/8, d 128, float32: 512-key
#: tiles took 2x the time), and smaller pages too (a longer tile would gather
#: pages that a 256-key one reads in place).
DECODE_ROW_TILE = 1024
#: A decode chunk is never shorter than this (unless the sequence is), or
#: than this divided by the kv heads of an item of every head: below it the
#: per-chunk work (loading the queries, writing a partial) stops being small.
MIN_SPLIT_KEYS = 512
#: Automatic splitting aims at this many chunks per thread, so that the
#: static schedule can balance sequences of different lengths.
CHUNKS_PER_THREAD = 4


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


def backward_items(seqs, n_kv, block_q, threads) -> tuple[np.ndarray, int]:
    """``(sequence, kv head, part)`` items and the number of parts.

    One part per ``(sequence, kv head)`` when there are enough of them for
    the threads; otherwise each is split into parts that take every P-th
    query block, so a single head (or MQA at batch 1) still uses every core.
    """
    pairs = len(seqs) * n_kv
    most_blocks = int((-(-seqs[:, SEQ_TQ] // block_q)).max(initial=1))
    parts = 1 if pairs >= threads or pairs == 0 else min(-(-threads // pairs), most_blocks)
    items = np.array(
        [(s, hk, p) for s in range(len(seqs)) for hk in range(n_kv) for p in range(parts)],
        dtype=np.int64,
    ).reshape(-1, 3)
    costs = (seqs[items[:, 0], SEQ_TQ] * seqs[items[:, 0], SEQ_TK]).astype(np.float64)
    return balance(items, costs), parts


#: Decode items of at most this many query rows walk the cache by a measured
#: route (:func:`decode_walk`): the decode-shaped calls' limit
#: (:data:`flashtile.decode_planning.DECODE_MAX_ROWS`).
DECODE_ROUTED_ROWS = 16
#: A tile of the head-tiles walk (every kv head at once, :func:`decode_tile`)
#: spans at most this many bytes of K and V rows of all heads: gathered, they
#: stay in L2 while each head's products read them.
HEADS_TILE_BYTES = 256 * 1024

#: How decode items walk their keys (:func:`decode_walk`): BLAS tiles of one
#: kv head, gathered when they span pages; one kv head's rows read in place
#: (cpu/cache_rows.py); every kv head's rows of a tile gathered at once in
#: memory order for BLAS (cpu/decode.py); or every kv head's rows read in
#: place in memory order (cpu/cache_heads.py). The routes of several-row
#: items over contiguous caches also offer "tiles-stream": TILES without the
#: software prefetch of each next tile
#: (:func:`flashtile.cpu.cache_rows.walk_prefetches`).
TILES, ROWS, HEAD_TILES, HEAD_ROWS = "tiles", "rows", "head-tiles", "head-rows"
#: The walks whose items take every kv head of their key chunk.
HEAD_WALKS = (HEAD_TILES, HEAD_ROWS)


def decode_walk(rows: int, page: int, pages: int, kv_heads: int, head_dim: int, keys: int) -> str:
    """How decode items of ``rows`` query rows walk a cache of ``pages``
    pages per sequence of ``page`` keys each, ``kv_heads`` kv heads of head
    dim ``head_dim``, the longest sequence ``keys`` keys (:data:`TILES`,
    ``"tiles-stream"``, :data:`ROWS`, :data:`HEAD_TILES` or :data:`HEAD_ROWS`).

    The walks compute the same; which is fastest depends on the CPU and the
    shape, so it is a measured route (:mod:`flashtile.routes`,
    :func:`~flashtile.routes.decode_route_name`) per cache layout, rows,
    head dim and length class, for items of at most DECODE_ROUTED_ROWS rows
    (more rows keep BLAS tiles):

    - ``contiguous``: one page per sequence or pages of at least a tile,
      whose tiles BLAS reads in place;
    - ``paged``: pages smaller than a DECODE_TILE tile (gathered for BLAS,
      or read in place one head's run per page, or page by page for every
      head);
    - ``tokens``: one-token pages of several kv heads (flash-attn's ``(B, T,
      Hkv, d)`` cache read in place, :mod:`flashtile.flash_attn`): one head's
      keys lie ``Hkv * d`` elements apart, a separate stream per key that the
      hardware prefetcher does not follow, which the two head walks read as
      one stream.

    The walks that read rows in place run float32 work only
    (:func:`flashtile.decode_planning.plan_decode` applies that part).
    """
    if page == 1 and kv_heads > 1 and pages > 1:
        layout = "tokens"
    elif pages > 1 and page < DECODE_TILE:
        layout = "paged"
    else:
        layout = "contiguous"
    if rows > DECODE_ROUTED_ROWS:
        return HEAD_TILES if layout == "tokens" else TILES
    walk = routes.choice(routes.decode_route_name(layout, rows, head_dim, keys))
    # With one kv head the head walk is the row walk without the row walk's
    # prefetch of small pages' separate streams.
    return ROWS if walk == HEAD_ROWS and kv_heads == 1 else walk


def decode_tile(rows: int, page: int, walk: str = TILES, head_bytes: int = 0) -> int:
    """Keys per tile for decode items of ``rows`` query rows over a cache in
    pages of ``page`` keys (a contiguous cache: one page of all its keys).
    Items of the :data:`HEAD_WALKS` read ``head_bytes`` (every kv head's K
    and V row) per key: tiles of at most HEADS_TILE_BYTES, a power of two
    from 16 to DECODE_TILE keys (the head walks' chunks are multiples of
    it: of the head-tiles length for the head-rows walk over one-token
    pages, :func:`flashtile.decode_planning.plan_decode`), but DECODE_TILE
    keys for the head walk that reads rows in place: it
    gathers nothing, and its softmax then runs on longer rows, a tile's
    fixed costs shared by more keys. Pages of 16: GQA 32/8, d 128, 65536
    keys, float32, 2 threads, Zen 4 EPYC, three process pairs, 27.5-27.9 ms
    against 29.2-30.7 with 32-key tiles. One-token pages (flash-attn's
    cache), the kernel alone on the same items, 2 threads, AVX2 AMD EPYC:
    12 heads, d 64, 2048 keys 190 against 262 us; 16384 keys 3.3 against
    3.9-4.3 ms; GQA 32/8, d 128, 16384 keys 5.9 against 6.6-6.7 ms."""
    if walk == HEAD_ROWS:
        return DECODE_TILE
    if walk in HEAD_WALKS:
        keys = max(1, HEADS_TILE_BYTES // head_bytes)
        return min(DECODE_TILE, max(16, 1 << (keys.bit_length() - 1)))
    long_tiles = rows == 1 or walk == ROWS
    return DECODE_ROW_TILE if long_tiles and page >= DECODE_ROW_TILE else DECODE_TILE


def plan_splits(ranges, kv_heads, num_splits, threads, tile=DECODE_TILE, item_heads=1):
    """Split each sequence's visible keys into chunks: the decode work items.

    Args:
        ranges: ``(B, 2)`` visible keys ``[lo, hi)`` per sequence.
        num_splits: chunks per sequence, or None: chunks of equal length
            (a multiple of ``tile``, at least MIN_SPLIT_KEYS) sized so that
            the whole batch makes about CHUNKS_PER_THREAD items per thread.
        item_heads: kv heads per item (1, or ``kv_heads`` for the
            :data:`HEAD_WALKS`: then items exist for kv head 0 only and
            stand for every head of their chunk, and automatic chunks may be
            ``item_heads`` times shorter, down to one ``tile``, so that as
            many items carry the same work).

    Returns:
        ``items (N, 5)`` int64 rows ``(b, kv head, j_lo, j_hi, slot)`` in the
        order the threads should take them, and ``spans (B * Hkv, 2)``:
        the first slot and the count of each ``(b, kv head)``'s partials.
    """
    if item_heads < 1 or kv_heads % item_heads:
        raise ValueError(f"item_heads={item_heads} must divide kv_heads={kv_heads}")
    # Compiled: a decoding loop plans every step anew (its key count grows),
    # and these few dozen NumPy calls on tiny arrays cost 40-70 us a step.
    items, spans = _split_items(ranges, kv_heads, -1 if num_splits is None else num_splits,
                                threads, tile, item_heads)  # fmt: skip
    costs = (items[:, 3] - items[:, 2]) + 64  # + the fixed cost of a chunk
    return balance(items, costs), spans


@njit(cache=True)
def _split_items(ranges, kv_heads, num_splits, threads, tile, item_heads):
    """:func:`plan_splits`' items and spans before balancing (``num_splits``
    -1: automatic). Slots run ``(b, kv head, chunk)``-major, so each pair's
    partials are adjacent; an item of several heads holds its first head's
    slot (head ``u`` of it writes ``count`` slots further per head)."""
    n = ranges.shape[0]
    lengths = ranges[:, 1] - ranges[:, 0]
    splits = np.empty(n, dtype=np.int64)
    chunks = np.empty(n, dtype=np.int64)
    if num_splits < 0:
        total = kv_heads // item_heads * lengths.sum()
        shortest = max(tile, MIN_SPLIT_KEYS // item_heads)  # the same work per item
        chunk = max(shortest, -(-total // (CHUNKS_PER_THREAD * threads)))
        chunk = -(-chunk // tile) * tile
        for b in range(n):
            splits[b] = max(1, -(-lengths[b] // chunk))
            chunks[b] = chunk
    else:
        for b in range(n):  # more chunks than keys would only add empty partials
            splits[b] = min(num_splits, max(lengths[b], 1))
            chunks[b] = max(1, -(-lengths[b] // splits[b]))
    items = np.empty((kv_heads // item_heads * splits.sum(), 5), dtype=np.int64)
    spans = np.empty((n * kv_heads, 2), dtype=np.int64)
    slot, n_items = 0, 0
    for b in range(n):
        for hk in range(kv_heads):
            spans[b * kv_heads + hk, 0] = slot
            spans[b * kv_heads + hk, 1] = splits[b]
            for c in range(splits[b]):
                if hk % item_heads == 0:
                    j_lo = min(ranges[b, 0] + c * chunks[b], ranges[b, 1])
                    items[n_items, 0], items[n_items, 1] = b, hk
                    items[n_items, 2] = j_lo
                    items[n_items, 3] = min(j_lo + chunks[b], ranges[b, 1])
                    items[n_items, 4] = slot
                    n_items += 1
                slot += 1
    return items, spans

"""How one attention call is laid out for the compiled kernels.

:mod:`flashtile.api` validates a call and hands it here: the arrays become
4-D contiguous blocks in the work dtype with one row per sequence
(:class:`Plan`), the tile sizes are chosen (:func:`block_sizes`), and the
work is cut into items, one ``(sequence, kv head, query block)`` each, ordered
so that ``prange``'s static schedule gives every thread a similar share
(:func:`forward_items`, :func:`backward_items`, :func:`balance`). A boolean
mask travels as its block map, summarised for the kernel's tile sizes
(:func:`with_states`). Internal: the public entry points are in
:mod:`flashtile.api` and :mod:`flashtile.decode`.
"""

from __future__ import annotations

import numpy as np

from ._validate import check_block_size, check_qkv, compute_dtype, resolve_scale
from .masks import block_key_range, block_mask
from .variants import resolve_variants

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
#: every thread at least four work items.
MIN_BLOCK_Q = 16
#: With a sliding window of ``band`` keys per query, a tile of ``block_q``
#: rows needs about ``band + block_q`` keys for ``band`` useful per row, so
#: the default rows shrink toward ``band / 4`` (useful fraction about 80%),
#: not below this many (smaller tile products lose more than they save).
#: Measured at T=4096, window 256: 64 rows 0.79x the time of 256 rows.
MIN_WINDOW_BLOCK_Q = 64
LOG2E = 1.4426950408889634


class Plan:
    """One call, laid out for the kernels (see :func:`plan_call`)."""

    def __init__(self, q4, k4, v4, seqs, variants, kernel_variants, scale, dtype, out_shape):
        self.q4, self.k4, self.v4 = q4, k4, v4
        self.seqs = seqs
        self.variants = variants
        self.kv = kernel_variants
        self.scale = scale
        self.dtype = dtype
        self.out_shape = out_shape  # the caller's layout, for reshaping results back


def _as4d(a, work):
    return np.ascontiguousarray(a.reshape((1,) * (4 - a.ndim) + a.shape), dtype=work)


def _mask4(mask, work=None):
    """A broadcastable mask as 4 dims, contiguous (optionally cast)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return np.ascontiguousarray(mask if work is None else mask.astype(work))


def with_states(plan, block_q, block_k):
    """``plan.kv`` with the block map of its bool mask for these tile sizes."""
    if plan.kv.mask_bool.size == 0:
        return plan.kv
    tq, tk = plan.q4.shape[2], plan.k4.shape[2]
    states = block_states(plan.variants, plan.kv.mask_bool, block_q, block_k, tq, tk)
    return plan.kv._replace(states=states)


def block_states(va, mask4, block_q, block_k, tq, tk):
    """``(Bm, Hm, ceil(Tq/block_q), ceil(Tk/block_k))`` tile states of the bool mask."""
    blocks = va.block_mask
    if blocks is None or (blocks.block_q, blocks.block_k) != (block_q, block_k):
        # Size-1 (broadcast) dims summarise as one block each, then broadcast.
        bq = block_q if mask4.shape[2] > 1 else 1
        bk = block_k if mask4.shape[3] > 1 else 1
        blocks = block_mask(mask4, bq, bk)
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    shape = (*blocks.states.shape[:2], nq, nk)
    return np.ascontiguousarray(np.broadcast_to(blocks.states, shape))


def kernel_variants(va, work, batch_heads):
    """The variants in kernel form; the block map is added per call (:func:`with_states`)."""
    from .cpu.tiles import KernelVariants

    empty_f = np.zeros((0, 0, 0, 0), dtype=work)
    alibi = np.zeros((0, 0), dtype=work)
    if va.alibi is not None:  # (Hq, 1, 1) or (B, Hq, 1, 1) -> (1 or B, Hq)
        alibi = np.ascontiguousarray(va.alibi.reshape(-1, batch_heads[1]) * LOG2E, dtype=work)
    mask_add = empty_f
    if va.mask_add is not None:
        # Finite values lie within +-MASK_LIMIT (variants.py): no overflow.
        mask_add = _mask4(va.mask_add * LOG2E, work)
    mask_bool = np.zeros((0, 0, 0, 0), dtype=np.bool_)
    states = np.zeros((0, 0, 0, 0), dtype=np.int8)
    if va.mask_bool is not None:
        mask_bool = _mask4(va.mask_bool)
    softcap = 0.0 if va.softcap is None else va.softcap * LOG2E
    return KernelVariants(va.causal, va.left, va.right, softcap, alibi, mask_add, mask_bool, states)


def check_layout(q, k, v):
    if q.ndim > 4:
        raise ValueError(
            f"q has {q.ndim} dims {q.shape}; flashtile.attention takes (B, H, T, d), "
            f"(H, T, d) or (T, d): merge extra leading dims into B"
        )
    if not (q.ndim == k.ndim == v.ndim and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(
            f"leading dims differ: q {q.shape}, k {k.shape}, v {v.shape}; "
            f"flashtile.attention needs the same batch for q, k and v, and k, v with "
            f"Hq or a divisor of Hq heads (use np.broadcast_to(...).copy() for copies)"
        )
    if q.ndim >= 3 and not (k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0):
        raise ValueError(
            f"Hq={q.shape[-3]}, k has {k.shape[-3]} heads and v {v.shape[-3]}: k and v need "
            f"the same number of heads Hkv, and Hq must be a multiple of Hkv"
        )


def plan_call(q, k, v, causal, scale, variants, block_q, block_k, defaults) -> tuple:
    """Validate one batched call and lay it out for the kernels.

    Returns ``(plan, block_q, block_k)``: 4-D contiguous arrays in the work
    dtype, one ``seqs`` row ``(b, 0, Tq, 0, Tk, kv_len)`` per batch entry,
    the variants in kernel form and the tile sizes.
    """
    q, k, v, shapes = check_qkv(q, k, v)
    check_layout(q, k, v)
    scale = resolve_scale(scale, shapes.d)
    va = resolve_variants(shapes, causal=causal, **variants)
    if va.mask_bool is not None:
        bm = va.block_mask
        defaults = MASK_BLOCKS if bm is None else (bm.block_q, bm.block_k)
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1  # MQA too (Hkv = 1)
    block_q, block_k = block_sizes(block_q, block_k, defaults, va, group, shapes.tq, shapes.tk)
    work = compute_dtype(q.dtype)
    q4, k4, v4 = (_as4d(a, work) for a in (q, k, v))
    n_batch = q4.shape[0]
    kv_len = np.full(n_batch, shapes.tk) if va.kv_lengths is None else va.kv_lengths
    seqs = np.zeros((n_batch, 6), dtype=np.int64)
    seqs[:, 0] = np.arange(n_batch)
    seqs[:, 2], seqs[:, 4], seqs[:, 5] = shapes.tq, shapes.tk, kv_len
    kv = kernel_variants(va, work, q4.shape[:2])
    out_shape = shapes.batch + (shapes.tq,)
    return Plan(q4, k4, v4, seqs, va, kv, scale, q.dtype, out_shape), block_q, block_k


def block_sizes(block_q, block_k, defaults, va, group, tq, tk):
    # A band (see MIN_WINDOW_BLOCK_Q); a bool mask keeps its block map's tiles,
    # so that a BlockMask's summary is reused rather than rebuilt per call.
    if va.left >= 0 and va.right >= 0 and va.mask_bool is None:
        band = va.left + va.right + 1
        rows = 1 << max(band // 4, 1).bit_length() - 1  # largest power of two <= band / 4
        defaults = (min(defaults[0], max(MIN_WINDOW_BLOCK_Q, rows)), defaults[1])
    # A BlockMask's tiles are kept whole (no GQA shrink): its summary is reused.
    keep_q = block_q is not None or (va.mask_bool is not None and va.block_mask is not None)
    block_q = check_block_size(defaults[0] if block_q is None else block_q, "block_q")
    block_k = check_block_size(defaults[1] if block_k is None else block_k, "block_k")
    if not keep_q:  # a GQA group shares the tile's rows
        block_q = max(MIN_BLOCK_Q, block_q // group)
    return min(block_q, tq), min(block_k, tk)  # buffers fit the data


def forward_items(plan, block_q, block_k, auto_q) -> tuple[np.ndarray, int, object]:
    """Work items ``(sequence, kv head, i0)``, balanced for a static schedule.

    Returns ``(items, block_q, kernel variants)``; with ``auto_q`` block_q is
    halved (down to MIN_BLOCK_Q) until every thread gets at least four items.
    The variants carry the block map for the final block_q, and with a map an
    item's cost counts only the key blocks it keeps.
    """
    import numba

    want = 4 * numba.get_num_threads()
    while True:
        items, spans = enumerate_items(plan, block_q)
        if not auto_q or len(items) >= want or block_q <= MIN_BLOCK_Q:
            break
        block_q = max(MIN_BLOCK_Q, block_q // 2)
    kv = with_states(plan, block_q, block_k)
    rows = np.minimum(block_q, plan.seqs[items[:, 0], 2] - items[:, 2])
    if kv.states.size > 0:
        keys = block_k * kept_blocks(plan, items, spans, kv.states, block_q, block_k)
    else:
        keys = spans[:, 1] - spans[:, 0]
    return balance(items, rows * keys + 1), block_q, kv


def enumerate_items(plan, block_q):
    """``(items (N, 3), spans (N, 2))``: every item and the key range it can see."""
    kv = plan.kv
    n_kv = plan.k4.shape[1]
    items, spans = [], []
    for s, (_, _, tq, _, tk, kv_len) in enumerate(plan.seqs.tolist()):
        for i0 in range(0, tq, block_q):
            i1 = min(i0 + block_q, tq)
            lo, hi = block_key_range(i0, i1, tq, tk, kv.causal, kv.left, kv.right, kv_len)
            for hk in range(n_kv):
                items.append((s, hk, i0))
                spans.append((lo, max(lo, hi)))
    return (
        np.array(items, dtype=np.int64).reshape(-1, 3),
        np.array(spans, dtype=np.int64).reshape(-1, 2),
    )


def kept_blocks(plan, items, spans, states, block_q, block_k):
    """Key blocks each item computes with a block map: kept ones in its span.

    A block counts when any query head of the item's group keeps it, as in
    the kernel (:func:`.cpu.tiles.tile_state`).
    """
    kept = states != 0  # (Bm, Hm, nq, nk)
    n_kv = plan.k4.shape[1]
    if kept.shape[1] > 1:  # per query head: a kv head computes its group's union
        kept = kept.reshape(kept.shape[0], n_kv, -1, *kept.shape[2:]).any(axis=2)
    before = np.zeros(kept.shape[:3] + (kept.shape[3] + 1,), dtype=np.int64)
    np.cumsum(kept, axis=3, out=before[..., 1:])  # kept blocks before block j
    b = plan.seqs[items[:, 0], 0] % kept.shape[0]
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


def backward_items(plan, block_q) -> tuple[np.ndarray, int]:
    """``(sequence, kv head, part)`` items and the number of parts.

    One part per ``(sequence, kv head)`` when there are enough of them for
    the threads; otherwise each is split into parts that take every P-th
    query block, so a single head (or MQA at batch 1) still uses every core.
    """
    import numba

    n_kv = plan.k4.shape[1]
    seqs = plan.seqs
    pairs = len(seqs) * n_kv
    threads = numba.get_num_threads()
    most_blocks = int((-(-seqs[:, 2] // block_q)).max(initial=1))
    parts = 1 if pairs >= threads or pairs == 0 else min(-(-threads // pairs), most_blocks)
    items = np.array(
        [(s, hk, p) for s in range(len(seqs)) for hk in range(n_kv) for p in range(parts)],
        dtype=np.int64,
    ).reshape(-1, 3)
    costs = (seqs[items[:, 0], 2] * seqs[items[:, 0], 4]).astype(np.float64)
    return balance(items, costs), parts


def check_cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    cu = np.asarray(cu)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must be int32 or int64 offsets, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"{name} has shape {cu.shape}; expected (S + 1,) offsets, S >= 1")
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"{name} = {cu.tolist()[:8]}{'...' if cu.size > 8 else ''} must start at 0, never "
            f"decrease, and end at the packed length {total}"
        )
    return cu.astype(np.int64)


def plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, variants, blocks, defaults):
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if np.ndim(arr) != 3:
            raise ValueError(
                f"{name} has shape {np.shape(arr)}; varlen_attention takes packed "
                f"(H, total, d) arrays"
            )
    for key in ("mask", "key_padding_mask", "kv_lengths"):
        if variants.get(key) is not None:
            raise ValueError(
                f"{key} is not supported by varlen_attention: sequence boundaries already "
                f"come from cu_seqlens; use flashtile.attention on a padded batch for masks"
            )
    q, k, v, shapes = check_qkv(q, k, v)
    check_layout(q, k, v)
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", shapes.tq)
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", shapes.tk)
    if cq.size != ck.size:
        raise ValueError(
            f"cu_seqlens_q has {cq.size - 1} sequences but cu_seqlens_k has {ck.size - 1}"
        )
    scale = resolve_scale(scale, shapes.d)
    va = resolve_variants(shapes, causal=causal, **variants)
    lq, lk = np.diff(cq), np.diff(ck)
    block_q, block_k = block_sizes(
        *blocks, defaults, va, q.shape[0] // k.shape[0], max(lq.max(), 1), max(lk.max(), 1)
    )
    work = compute_dtype(q.dtype)
    q4, k4, v4 = (_as4d(a, work) for a in (q, k, v))
    seqs = np.stack([np.zeros_like(cq[:-1]), cq[:-1], lq, ck[:-1], lk, lk], axis=1)
    keep = lq > 0
    seqs = np.ascontiguousarray(seqs[keep])
    kv = kernel_variants(va, work, q4.shape[:2])
    plan = Plan(q4, k4, v4, seqs, va, kv, scale, q.dtype, shapes.batch + (shapes.tq,))
    return plan, block_q, block_k

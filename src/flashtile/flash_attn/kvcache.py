"""``flash_attn_with_kvcache``: append to a KV cache in place, then attend, on flashtile's
decode kernels.

flash-attn's caches are ``(batch_cache, seqlen_cache, nheads_k, headdim)``
(or pages ``(num_blocks, page_block_size, nheads_k, headdim)``); flashtile's
decode kernels address ``(pages, nheads_k, page_size, headdim)`` arrays
through a block table (:mod:`flashtile.kvlayout`). Key ``t`` of a cache row
is not next to key ``t + 1`` of the same head in flash-attn's layout, so:

- **CUDA**: the Triton decode kernel takes strides, so the caches are passed
  as transposed views (``(batch_cache, nheads_k, seqlen_cache, headdim)``),
  no copy; ``cache_batch_idx`` becomes a one-page-per-row block table.
- **CPU**: the Numba kernel reads C-contiguous pages. A cache with one kv
  head (MQA) transposes to a contiguous array and is read as such. Otherwise
  the cache is read in place as *one-token pages*: ``(tokens, nheads_k, 1,
  headdim)`` is the same memory, C-contiguous, and a block table lists each
  sequence's tokens. No copy per call; the kernel reads every kv head's
  rows of a chunk of tokens in memory order (its walk a route measured on
  the machine): 1.1-1.2x the time of flashtile's own ``(B, Hkv, T, d)``
  layout with GQA 32/8, d 128, 65536 keys, 0.7-1.2x with one query row per
  head; far less than copying the cache into that layout on every call
  (docs/flash_attn.md has the numbers).
- ``cache_leftpad`` (keys before it are not part of the sequence) shifts
  each sequence's first token; one-token pages express that on both devices.

Rotary embeddings (:mod:`.rotary`) rotate the new keys at positions
``cache_seqlens + j`` and the queries at ``cache_seqlens + i`` (causal or
local) or all at ``cache_seqlens`` (otherwise), as flash-attn does; the
rotated keys are what the cache stores. No gradient is recorded
(flash-attn's function has no backward either).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from flashtile._validate import resolve_scale
from flashtile.decode import decode_checked
from flashtile.kvlayout import check_cache, decode_variants, table_problem
from flashtile.torch.arrays import as_numpy, as_tensor

from . import checks
from .kvcache_steps import kvcache_key, most_keys, prepare_step, run_step
from .pages import block_rows, cache_pages
from .rotary import check_tables, rotate

_NO_KVCACHE = {
    "dropout_p": "flash_attn_with_kvcache is inference only (no dropout), as in flash-attn",
}


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    sinks=None,
    **unsupported,
):
    """Append ``k``/``v`` to the caches in place (if given), then attend ``q`` to them.

    flash-attn 2's ``flash_attn_with_kvcache``, on flashtile's split-KV decode
    kernels (CPU tensors: Numba; CUDA tensors: Triton). Inference only.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, headdim)``,
            or with ``block_table`` pages ``(num_blocks, page_block_size,
            nheads_k, headdim)`` (any page size). Same dtype as ``q``;
            ``nheads`` a multiple of ``nheads_k``. Updated in place.
        k, v: ``(batch, seqlen_new, nheads_k, headdim)`` new keys and values,
            written at positions ``cache_seqlens[b] ... + seqlen_new - 1``
            (needs ``cache_seqlens``; the cache must have room).
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``: rotate the
            first ``rotary_dim`` channels of ``k`` (at ``cache_seqlens + j``)
            and ``q`` (at ``cache_seqlens + i`` if causal or local, else all
            at ``cache_seqlens``); needs ``k``/``v``.
        cache_seqlens: int or ``(batch,)`` integer tensor: keys in the cache
            before appending (default: the whole cache).
        cache_batch_idx: ``(batch,)``: which cache row each batch entry uses
            (default ``0 .. batch - 1``); not with ``block_table``.
        cache_leftpad: ``(batch,)``: the sequence starts at this cache index;
            keys before it are ignored and positions count from it.
        block_table: ``(batch, max_blocks)`` page indices of a paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in
            :func:`flash_attn_func`; causal and windows align bottom-right with
            the sequence's keys after appending.
        rotary_interleaved: GPT-J pairs ``(2i, 2i + 1)`` if True, else
            GPT-NeoX pairs ``(i, i + rotary_dim / 2)``.
        num_splits: key chunks per sequence merged afterwards; 0 = automatic.
        return_softmax_lse: also return ``lse (batch, nheads, seqlen_q)``.
        sinks: flashtile's extension: ``(nheads,)`` sink logits, one extra key
            per head with value zero in every row's softmax (as in
            :func:`flash_attn_func`; no gradient here).

    Returns:
        ``out (batch, seqlen_q, nheads, headdim_v)`` in ``q``'s dtype, and
        ``softmax_lse`` (float32, float64 for float64) if asked. A query that
        sees no key gets zeros and ``lse = -inf`` (flash-attn: ``+inf``).
    """
    checks.refuse_keywords("flash_attn_with_kvcache", unsupported, _NO_KVCACHE)
    with torch.no_grad():
        return _with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, sinks,
        )  # fmt: skip


def _with_kvcache(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
    alibi_slopes, num_splits, return_softmax_lse, sinks,
):  # fmt: skip
    key = None
    if (rotary_cos is None and rotary_sin is None and type(rotary_interleaved) is bool
            and cache_batch_idx is None and cache_leftpad is None and alibi_slopes is None
            and sinks is None):  # fmt: skip
        key = kvcache_key(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
            window_size, softcap, num_splits, return_softmax_lse,
        )  # fmt: skip
        result = None if key is None else _run_prepared(key, q, k_cache, v_cache, k, v,
                                                        cache_seqlens, block_table)  # fmt: skip
        if result is not None:  # (None: a first call, or lengths out of range)
            return result if return_softmax_lse else result[0]
    opts = checks.options(
        0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False, sinks
    )
    splits = checks.num_splits(num_splits)
    for name, flag in (("rotary_interleaved", rotary_interleaved),
                       ("return_softmax_lse", return_softmax_lse)):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    paged = block_table is not None
    cache = _check_caches(q, k_cache, v_cache, paged)
    batch, hq = q.shape[0], q.shape[2]
    checks.check_slopes(opts.alibi, batch, hq)
    device = q.device
    rows = k_cache.shape[1]
    slot, table, capacity = _rows(k_cache, block_table, cache_batch_idx, batch, device)
    new = _check_new(k, v, cache, batch)
    tn = 0 if new is None else new[0].shape[1]
    seqlens = _seqlens(cache_seqlens, new is not None, batch, capacity, tn, device)
    total = seqlens + tn
    if table is not None:
        _check_table(table, total, rows, k_cache.shape[0])
    leftpad = _leftpad(cache_leftpad, total, batch, device)
    if rotary_cos is not None or rotary_sin is not None:
        q, new = _rotary(
            q, new, rotary_cos, rotary_sin, seqlens, rotary_interleaved, opts, capacity
        )
    if new is not None:
        _append(k_cache, v_cache, new, seqlens, slot, table, rows)
    lengths = total if leftpad is None else total - leftpad
    index = (slot, table, leftpad, lengths)
    if not checks.on_gpu(q):  # the page table in NumPy: torch's ops on a few indices cost more
        index = tuple(None if t is None else t.numpy() for t in index)
    k_pages, v_pages, pages_table = cache_pages(k_cache, v_cache, *index)
    store = None if key is None else prepare_step(key, splits, capacity)
    out, lse = _decode(q, k_pages, v_pages, index[3], pages_table, splits, opts, store)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


def _run_prepared(key, q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """:func:`.kvcache_steps.run_step` of a call of ``key``, appending with
    :func:`_append`."""
    new = None if k is None else (k, v)

    def append(seqlens, slot, table):
        _append(k_cache, v_cache, new, seqlens, slot, table, k_cache.shape[1])

    return run_step(key, q, k_cache, v_cache, new, cache_seqlens, block_table, append)


def _rows(k_cache, block_table, cache_batch_idx, batch: int, device):
    """``(slot, table, capacity)``: the cache row of each batch entry (None for a
    paged cache), the block table (None for a contiguous one) and the keys a
    sequence can hold."""
    n_rows, rows = k_cache.shape[:2]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx picks cache rows, but a paged cache's rows are picked by "
                "block_table: reorder block_table's rows instead (flash-attn refuses this too)"
            )
        table = _ints(block_table, "block_table", None, device)
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(
                f"block_table has shape {tuple(table.shape)}; expected (batch, max_blocks) with "
                f"batch = {batch}"
            )
        return None, table, table.shape[1] * rows
    if cache_batch_idx is None:
        if n_rows < batch:
            raise ValueError(
                f"q has batch {batch} but k_cache has {n_rows} rows: pass cache_batch_idx, "
                f"or a cache with a row per batch entry"
            )
        return torch.arange(batch, device=device), None, rows
    slot = _ints(cache_batch_idx, "cache_batch_idx", (batch,), device)
    _in_range(slot, "cache_batch_idx", 0, n_rows - 1, f"k_cache's {n_rows} rows")
    return slot, None, rows


def _seqlens(cache_seqlens, appending: bool, batch: int, capacity: int, tn: int, device):
    """Each sequence's keys before the append, ``(batch,)`` int64, checked."""
    if cache_seqlens is None:
        if appending:
            raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens too")
        seqlens = torch.full((batch,), capacity, device=device, dtype=torch.int64)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), int(cache_seqlens), device=device, dtype=torch.int64)
    else:
        seqlens = _ints(cache_seqlens, "cache_seqlens", (batch,), device)
    most = most_keys(capacity, tn)
    _in_range(seqlens, "cache_seqlens", 0, most, f"capacity {capacity} - {tn} new keys")
    return seqlens


def _leftpad(cache_leftpad, total, batch: int, device):
    """``cache_leftpad`` as ``(batch,)`` int64 within the keys after appending, or None."""
    if cache_leftpad is None:
        return None
    leftpad = _ints(cache_leftpad, "cache_leftpad", (batch,), device)
    if batch and bool(((leftpad < 0) | (leftpad > total)).any()):
        raise ValueError(
            f"cache_leftpad = {leftpad.tolist()[:8]} must lie in [0, keys after appending = "
            f"{total.tolist()[:8]}]"
        )
    return leftpad


def _rotary(q, new, rotary_cos, rotary_sin, seqlens, interleaved: bool, opts, capacity: int):
    """``(q, new)`` rotated at flash-attn's positions: the new keys at ``seqlens +
    t``; the queries there too when causal or local, else all at ``seqlens``.
    Local is flash-attn's rule: a window side of at least the cache's
    ``capacity`` counts as unbounded."""
    if new is None:
        raise ValueError(
            "rotary_cos/rotary_sin rotate the new keys: pass k and v too (as flash-attn "
            "requires), or rotate q yourself (flashtile.flash_attn.apply_rotary_emb)"
        )
    check_tables(rotary_cos, rotary_sin, q.shape[-1])
    batch, tq, device = q.shape[0], q.shape[1], q.device
    local = opts.causal or (
        opts.window is not None and any(0 <= side < capacity for side in opts.window)
    )
    offsets = seqlens[:, None]
    q_at = offsets + torch.arange(tq, device=device) if local else offsets.expand(batch, tq)
    q = rotate(q, rotary_cos, rotary_sin, q_at, interleaved)
    k_at = offsets + torch.arange(new[0].shape[1], device=device)
    return q, (rotate(new[0], rotary_cos, rotary_sin, k_at, interleaved), new[1])


def _check_caches(q, k_cache, v_cache, paged: bool):
    """Shapes, dtypes, devices of ``q`` and the caches; returns ``(nheads_k, d, dv, dtype)``."""
    checks.check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    layout = (
        "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
        if paged
        else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    )
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_tensor(c, name, 4, layout)
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1)")
    checks.check_same({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if k_cache.shape[:3] != v_cache.shape[:3] or 0 in k_cache.shape or 0 in v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share every "
            f"dim but the last, none of them empty"
        )
    if q.shape[1] == 0 or k_cache.shape[3] != q.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}: q needs seqlen_q >= 1 and "
            f"the cache's headdim"
        )
    checks.check_heads(q.shape[2], k_cache.shape[2], "the caches")
    return k_cache.shape[2], k_cache.shape[3], v_cache.shape[3], k_cache.dtype


def _check_new(k, v, cache, batch: int):
    """The new ``(k, v)`` checked against the caches, or None."""
    if k is None and v is None:
        return None
    if k is None or v is None:
        raise ValueError("pass both k and v (new keys and their values), or neither")
    hkv, d, dv, dtype = cache
    checks.check_tensor(k, "k", 4, "(batch, seqlen_new, nheads_k, headdim)")
    checks.check_tensor(v, "v", 4, "(batch, seqlen_new, nheads_k, headdim_v)")
    if k.shape != (batch, k.shape[1], hkv, d) or v.shape != (*k.shape[:3], dv):
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)}: expected ({batch}, seqlen_new, {hkv}, "
            f"{d}) and ({batch}, seqlen_new, {hkv}, {dv}), as the caches"
        )
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"k {k.dtype} and v {v.dtype} must have the caches' dtype {dtype}")
    return k, v


def _ints(x, name: str, shape, device) -> torch.Tensor:
    """An integer tensor (int64, on ``device``) of ``shape`` (any shape when None)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 (or int64) tensor, got {x!r}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {shape}")
    return x.to(device, torch.int64)


def _in_range(x: torch.Tensor, name: str, low: int, high: int, what: str) -> None:
    if x.numel() and bool(((x < low) | (x > high)).any()):
        raise ValueError(
            f"{name} = {x.tolist()[:8]} must lie in [{low}, {high}] ({what}); flash-attn would "
            f"read or write outside the cache"
        )


def _check_table(table, total, rows: int, pages: int) -> None:
    """The block table's entries for every page a sequence uses (after appending) must
    be pages of the cache (a negative index would wrap around in torch's indexing):
    :func:`flashtile.kvlayout.table_problem`'s rule."""
    problem = table_problem(torch, table, total, rows, pages, True)
    if problem:
        raise ValueError(problem + " after appending")


def _append(k_cache, v_cache, new, seqlens, slot, table, rows: int) -> None:
    """Write the new keys and values at ``cache_seqlens[b] + j``, in place. On
    the CPU through NumPy (the same indexing): torch's indexed write of a
    decoding step's few rows took 24 us, 49 between a model's layers."""
    k, v = new
    xp, caches = (torch if checks.on_gpu(k_cache) else np), (k_cache, v_cache)
    if xp is np:  # (the index arrays as NumPy's too, where tensors)
        k_cache, v_cache, k, v = (as_numpy(t) for t in (k_cache, v_cache, k, v))
        index = (seqlens, slot, table)
        seqlens, slot, table = (t.numpy() if type(t) is torch.Tensor else t for t in index)
    on = {"device": seqlens.device} if xp is torch else {}
    at = seqlens[:, None] + xp.arange(k.shape[1], **on)  # (batch, seqlen_new)
    where = (slot[:, None], at) if table is None else block_rows(table, at, rows)
    k_cache[where] = k
    v_cache[where] = v
    if xp is np:  # (torch's own write counts it: autograd then sees the caches changed)
        for cache in caches:
            if not cache.is_inference():  # (no version counter)
                torch.autograd.graph.increment_version(cache)


def _decode(q, k_pages, v_pages, lengths, table, splits, opts, prepared=None):
    """``(out (B, Hq, Tq, dv), lse (B, Hq, Tq))`` from flashtile's decode kernels
    (``lengths`` and ``table``: tensors on the GPU, NumPy arrays on the CPU);
    on the CPU, ``prepared(variants, scale)`` is told the call's checked
    variants and scale, where given."""
    qt = q.transpose(1, 2)
    if checks.on_gpu(q):
        from flashtile import triton as gpu  # needs triton: imported on first use

        keywords = {
            "num_splits": splits, "causal": opts.causal, "scale": opts.scale,
            "window": opts.window, "softcap": opts.softcap, "return_lse": True,
        }  # fmt: skip
        if opts.sinks is not None:
            keywords["sinks"] = opts.sinks
        return gpu.decode_attention(
            qt, k_pages, v_pages, cache_seqlens=lengths, block_table=table,
            alibi_slopes=opts.alibi, **keywords,
        )  # fmt: skip
    alibi = None if opts.alibi is None else opts.alibi.to("cpu", torch.float64).numpy()
    sinks = None if opts.sinks is None else opts.sinks.detach().to("cpu", torch.float64).numpy()
    # flashtile.decode_attention's check and run, taken apart so that the
    # checked variants and scale are kept for later calls (.kvcache_steps).
    q4, layout = check_cache(as_numpy(qt), as_numpy(k_pages), as_numpy(v_pages), lengths,
                             np.ascontiguousarray(table))  # fmt: skip
    variants = decode_variants(
        q4, layout, causal=opts.causal, window=opts.window, alibi_slopes=alibi,
        softcap=opts.softcap, sinks=sinks,
    )  # fmt: skip
    scale = resolve_scale(opts.scale, q4.shape[3])
    out, lse = decode_checked(q4, layout, variants, scale, splits)
    if prepared is not None:
        prepared(variants, scale)
    return as_tensor(out), as_tensor(lse)

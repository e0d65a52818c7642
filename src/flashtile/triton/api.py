"""The entry points on torch tensors: validate, lay out, call the custom ops.

Semantics are flashtile's everywhere (:mod:`flashtile.masks`,
:mod:`flashtile.variants`): causal aligns bottom-right, a query that sees no
key gives a zero row and ``lse = -inf`` (never NaN), ``lse`` is the natural-log
normaliser in float32.
"""

from __future__ import annotations

import torch

from flashtile import op_autograd
from flashtile._validate import (
    check_flag,
    check_num_splits,
    check_sdpa_layout,
    check_softcap,
    resolve_scale,
)
from flashtile.dropout import check_counter_range, check_dropout
from flashtile.masks import normalize_window
from flashtile.merge import add_sinks

from . import checks, launch, ops  # (ops also registers torch.ops.flashtile.triton_*)
from .launch import auto_splits, cdiv, decode_rows_block


def _qkv(q, k, v, enable_gqa: bool, mask=None, varlen=False):
    """q, k, v checked by the shared layout rule and the kernels' limits, last dim unit-stride."""
    q, k, v = (checks.check_tensor(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if varlen:
        layout, who = "packed (H, total, d) tensors", "flashtile.triton.varlen_attention"
        check_sdpa_layout(q, k, v, enable_gqa=True, ranks=(3,), layout=layout, who=who)
    else:
        check_sdpa_layout(q, k, v, enable_gqa=enable_gqa, who="flashtile.triton.attention")
    checks.check_gpu_call(q, k, v, mask)
    return q, k, v


def _scalars(causal, scale, window, softcap, d):
    left, right = normalize_window(window, check_flag(causal, "causal"))
    return resolve_scale(scale, d), left, right, check_softcap(softcap)


def attention(
    q, k, v, *, causal=False, scale=None, window=None, alibi_slopes=None, softcap=None,
    kv_lengths=None, mask=None, enable_gqa=False, return_lse=False, sinks=None, dropout_p=0.0,
):  # fmt: skip
    """Exact attention with the Triton kernels, differentiable w.r.t. ``q``, ``k``, ``v``.

    The keywords of :func:`flashtile.torch.attention`, on CUDA tensors (CPU
    tensors under ``TRITON_INTERPRET=1``).

    Args:
        q: ``(B, Hq, Tq, d)`` (SDPA layout) or ``(Hq, Tq, d)``; float16, bfloat16
            or float32 (float32 accumulation; IEEE float32 products for float32).
        k: ``(B, Hkv, Tk, d)``; v: ``(B, Hkv, Tk, dv)``; ``d``, ``dv`` <= 256.
            ``Hkv != Hq`` needs ``enable_gqa=True`` and ``Hq % Hkv == 0`` (query
            head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never repeated).
        causal: query ``i`` sees key ``j`` iff ``j <= i + Tk - Tq`` (bottom-right)::

                Tq=2, Tk=5     Tq=5, Tk=2
                x x x x .      . .   <- no key: zeros, lse = -inf
                x x x x x      . .
                               . .
                               x .
                               x x

        scale: score multiplier, default ``1/sqrt(d)``.
        window: ``(left, right)``: query at position ``p = i + Tk - Tq`` sees
            keys ``p - left <= j <= p + right`` (None or -1: unbounded side).
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)``: adds ``-slope * |p - j|``.
        softcap: ``softcap * tanh(score / softcap)`` before ALiBi and masking.
        kv_lengths: ``(B,)`` valid keys per batch entry (4-D inputs); keys at
            and beyond it are hidden (positions still align with ``Tk``).
        mask: not supported by the Triton kernels (raises); use ``window``,
            ``causal``, ``kv_lengths``, or the CPU path for arbitrary masks.
        return_lse: also return ``lse (B, Hq, Tq)`` float32 (natural log), which
            carries no gradient.
        sinks: ``(Hq,)`` attention sinks (see :func:`flashtile.torch.attention`),
            differentiable.
        dropout_p: attention dropout (see :func:`flashtile.torch.attention`): the
            CPU kernels' mask for the same seed, drawn from torch's default CPU
            generator.

    Returns:
        ``out (B, Hq, Tq, dv)`` in the input dtype, and ``lse`` if asked.
    """
    q, k, v, unbatched, variants = _prepare(
        q, k, v, causal, scale, window, alibi_slopes, softcap, kv_lengths, mask, enable_gqa
    )
    dropout = _dropout(dropout_p, q.shape[:2])
    out, lse = _forward(q, k, v, *variants, *dropout, checks.sinks(sinks, q.shape[1], q.device))
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _prepare(q, k, v, causal, scale, window, alibi_slopes, softcap, kv_lengths, mask, enable_gqa):
    """Checked 4-D ``q, k, v``, whether they were 3-D, and the ops' variant arguments."""
    q, k, v = _qkv(q, k, v, enable_gqa, mask)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    batch, heads = q.shape[:2]
    scale, left, right, cap = _scalars(causal, scale, window, softcap, q.shape[-1])
    alibi = checks.slopes(alibi_slopes, batch, heads, q.device, per_batch_ok=not unbatched)
    lengths = None
    if kv_lengths is not None:
        if unbatched:
            raise ValueError("kv_lengths needs 4-D (B, H, T, d) inputs, one length per batch entry")
        lengths = checks.int_tensor(kv_lengths, "kv_lengths", (batch,), q.device)
        checks.check_range(lengths, "kv_lengths", 0, k.shape[2], f"Tk = {k.shape[2]}")
    return q, k, v, unbatched, (alibi, lengths, None, None, 0, 0, scale, left, right, cap)


def attention_backward(
    q, k, v, out, lse, dout, *, causal=False, scale=None, window=None, alibi_slopes=None,
    softcap=None, kv_lengths=None, enable_gqa=False,
):  # fmt: skip
    """Gradients ``(dq, dk, dv)`` of :func:`attention` from its ``out`` and ``lse``.

    The Triton counterpart of :func:`flashtile.attention_backward`, for callers
    that keep ``(out, lse)`` themselves. ``q``, ``k``, ``v`` and the keywords
    are exactly as passed to :func:`attention`.

    Args:
        out: ``(B, Hq, Tq, dv)`` the output, in q's dtype; lse: ``(B, Hq, Tq)``
            float32 (``return_lse=True``). dout: the gradient w.r.t. ``out``.

    Returns:
        ``dq, dk, dv`` with the shapes and dtype of ``q, k, v`` (GQA: summed
        over each group). Probabilities are recomputed from ``lse``;
        deterministic (no atomics). NaN for a batch entry where the
        backward's precision rule fails (an ``lse`` below its scores', or
        too large for float32 scores: :func:`flashtile.triton.ops.poisoned`).
    """
    args = _gradient_args(
        q, k, v, out, lse, dout, causal, scale, window, alibi_slopes, softcap, kv_lengths,
        enable_gqa,
    )  # fmt: skip
    unbatched, (dout, q, k, v, out, lse, variants) = args
    grads = torch.ops.flashtile.triton_attention_bwd(
        dout, q, k, v, out, lse, None, *variants, 0.0, None
    )
    return tuple(g[0] for g in grads) if unbatched else grads


def block_gradients(q, k, v, out, lse, dout, **kw):
    """``(dq, dk, dv, sums)`` of one block of a longer row, no precision rule
    applied (the distributed engine's, as the CPU's
    :func:`flashtile.gradients.block_gradients`): :func:`attention_backward`'s
    arguments and results for 4-D inputs, and each row's sum of ``P`` (its
    share of the whole row's, whose ``lse`` it is)."""
    _, (dout, q, k, v, out, lse, variants) = _gradient_args(
        q, k, v, out, lse, dout, kw.get("causal", False), kw.get("scale"), kw.get("window"),
        kw.get("alibi_slopes"), kw.get("softcap"), kw.get("kv_lengths"),
        kw.get("enable_gqa", False),
    )  # fmt: skip
    with ops.on_device(q):
        return launch.backward(dout, q, k, v, out, lse, ops.op_variants(*variants, 0.0, None))


def _gradient_args(
    q, k, v, out, lse, dout, causal, scale, window, alibi_slopes, softcap, kv_lengths, enable_gqa
):  # fmt: skip
    """``(unbatched, (dout, q, k, v, out, lse, variants))`` checked for the backward op."""
    q, k, v, unbatched, variants = _prepare(
        q, k, v, causal, scale, window, alibi_slopes, softcap, kv_lengths, None, enable_gqa
    )
    lead = (1,) if unbatched else ()
    want = (*q.shape[:3], v.shape[3])
    out, lse, dout = (
        checks.check_tensor(t, name).reshape(lead + tuple(t.shape))
        for t, name in ((out, "out"), (lse, "lse"), (dout, "dout"))
    )
    if out.shape != want or dout.shape != want or lse.shape != want[:3]:
        raise ValueError(
            f"out {tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)}: expected "
            f"out and dout {want} and lse {want[:3]} (the forward's, return_lse=True)"
        )
    tensors = (dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype), lse.float().contiguous())
    return unbatched, (*tensors, variants)


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
    causal=False, scale=None, window=None, alibi_slopes=None, softcap=None, return_lse=False,
    sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
):  # fmt: skip
    """Attention over packed variable-length sequences (no padding computed), differentiable.

    Args:
        q: ``(Hq, total_q, d)``; k: ``(Hkv, total_k, d)``; v: ``(Hkv, total_k, dv)``
            (flashtile's packed layout, heads first; GQA as in :func:`attention`).
        cu_seqlens_q, cu_seqlens_k: ``(S + 1,)`` integer offsets starting at 0
            and ending at ``total_q`` / ``total_k``: sequence ``s`` is queries
            ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], cu_k[s+1])``, attended
            on its own, causal/window/ALiBi positions bottom-right within it.
        max_seqlen_q, max_seqlen_k: the longest sequences (computed from the
            offsets when None; they are read on the host either way).
        causal, scale, window, alibi_slopes, softcap, return_lse, sinks, dropout_p: as
            in :func:`attention` (``alibi_slopes`` ``(Hq,)``; dropout's counters read
            rows of the packed arrays with ``b = 0``, as
            :func:`flashtile.varlen_attention`'s).
        dropout_seed, dropout_offset: the generator's seed (None: drawn from
            torch's default generator) and counter offset, as
            :func:`flashtile.varlen_attention` takes them: the same mask.

    Returns:
        ``out (Hq, total_q, dv)`` and, if asked, ``lse (Hq, total_q)`` float32.
    """
    q, k, v = _qkv(q, k, v, True, varlen=True)
    cu_q, cu_k = (
        checks.int_tensor(c, n, (torch.as_tensor(c).numel(),), q.device)
        for c, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"))
    )
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}"
        )
    longest_q = checks.check_cu_seqlens(cu_q, "cu_seqlens_q", q.shape[1])
    longest_k = checks.check_cu_seqlens(cu_k, "cu_seqlens_k", k.shape[1])
    for name, given, longest in (("q", max_seqlen_q, longest_q), ("k", max_seqlen_k, longest_k)):
        if given is not None and given < longest:
            raise ValueError(f"max_seqlen_{name} = {given} but a sequence has {longest}")
    scale, left, right, cap = _scalars(causal, scale, window, softcap, q.shape[-1])
    alibi = checks.slopes(alibi_slopes, 1, q.shape[0], q.device, per_batch_ok=False)
    dropout = _dropout(dropout_p, (1, q.shape[0]), dropout_seed, dropout_offset)
    out, lse = _forward(
        q[None], k[None], v[None], alibi, None, cu_q, cu_k, longest_q, longest_k,
        scale, left, right, cap, *dropout, checks.sinks(sinks, q.shape[0], q.device),
    )  # fmt: skip
    return (out[0], lse[0]) if return_lse else out[0]


def _dropout(dropout_p, batch_heads, seed=None, offset=0) -> tuple[float, torch.Tensor | None]:
    """``(dropout_p, seed words)`` as the ops take them (the rule of
    :func:`flashtile.dropout.check_dropout`): the seed drawn from torch's
    default CPU generator when None (a 0-d tensor, as
    :func:`flashtile.torch.attention` draws it), or ``[seed, offset]``."""
    p = check_dropout(dropout_p, 0 if seed is None else seed, offset)[0]
    if p == 0.0:
        return 0.0, None
    check_counter_range(*batch_heads)
    if seed is None and offset == 0:
        return p, op_autograd.dropout_seed()
    drawn = int(op_autograd.dropout_seed()) if seed is None else seed
    return p, torch.tensor([drawn - (1 << 64) if drawn >= 1 << 63 else drawn, offset])


def _forward(q, k, v, *variants):
    """The forward op (``variants`` end with the sinks), differentiable also
    under ``torch.func``, where the op's own
    autograd does not run (:class:`flashtile.op_autograd.FuncAttention` there);
    forward-mode AD dual tensors are refused (their tangent would be dropped)."""
    if op_autograd.has_tangent(q, k, v):
        raise NotImplementedError(op_autograd.NO_FORWARD_AD)
    if op_autograd.functorch_active():
        return op_autograd.FuncAttention.apply(ops.OPS, q, k, v, *variants)
    return torch.ops.flashtile.triton_attention_fwd(q, k, v, *variants)


def _cache(q, k_cache, v_cache, block_table):
    """Validated ``(q, k_cache, v_cache, table or None)`` of a decoding call."""
    q = checks.check_tensor(q, "q").contiguous()
    k_cache = checks.check_tensor(k_cache, "k_cache")
    v_cache = checks.check_tensor(v_cache, "v_cache")
    if q.ndim != 4 or 0 in q.shape[2:]:
        raise ValueError(f"q has shape {tuple(q.shape)}; decoding takes q (B, Hq, Tq, d), Tq >= 1")
    if k_cache.ndim != 4 or v_cache.ndim != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}: expected "
            f"(B, Hkv, T_max, d / dv), or (num_pages, Hkv, page_size, d / dv) with block_table"
        )
    checks.check_gpu_call(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    batch, hq, _, d = q.shape
    hk = k_cache.shape[1]
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but k_cache has {k_cache.shape[3]}")
    if hk == 0 or hq % hk or k_cache.shape[2] == 0:
        raise ValueError(
            f"Hq={hq} query heads and Hkv={hk} cache heads of {k_cache.shape[2]} rows: Hkv must "
            f"divide Hq (GQA/MQA) and the cache needs rows"
        )
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"q has B={batch} sequences but the contiguous cache has {k_cache.shape[0]}; "
                f"for a paged cache pass block_table"
            )
        return q, k_cache, v_cache, None
    table = torch.as_tensor(block_table)
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(
            f"block_table has shape {tuple(table.shape)}; expected (B, max_pages) with B={batch}"
        )
    return (
        q,
        k_cache,
        v_cache,
        checks.int_tensor(table, "block_table", tuple(table.shape), q.device),
    )


def _seqlens(cache_seqlens, table, batch, capacity, pages, device):
    """``cache_seqlens`` as int32 (default: full), checked against the cache and the table."""
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    else:
        seqlens = checks.int_tensor(cache_seqlens, "cache_seqlens", (batch,), device)
        checks.check_range(
            seqlens, "cache_seqlens", 0, capacity, "the cache's capacity per sequence"
        )
    if table is not None and table.numel():
        page_size = capacity // table.shape[1]
        used = torch.arange(table.shape[1], device=device)[None, :] * page_size < seqlens[:, None]
        bad = used & ((table < 0) | (table >= pages))
        if bool(bad.any()):
            b, p = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of the cache "
                f"(0..{pages - 1}), but sequence {b} has {int(seqlens[b])} keys"
            )
    return seqlens


def decode_attention(
    q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, num_splits=None, causal=True,
    scale=None, window=None, alibi_slopes=None, softcap=None, return_lse=False, sinks=None,
):  # fmt: skip
    """Attention of a few new queries per sequence against a KV cache (split-KV).

    The semantics of :func:`flashtile.decode_attention`.

    Args:
        q: ``(B, Hq, Tq, d)``, Tq small (1 for plain decoding); query ``i`` sits
            at position ``cache_seqlens[b] - Tq + i`` (bottom-right per sequence).
        k_cache, v_cache: ``(B, Hkv, T_max, d / dv)`` contiguous, or
            ``(num_pages, Hkv, page_size, d / dv)`` with ``block_table``: key
            ``j`` of sequence ``b`` is row ``j % page_size`` of page
            ``block_table[b, j // page_size]`` (any page size). Same dtype as
            ``q``; ``Hkv`` divides ``Hq`` (each K/V tile is read once per group).
        cache_seqlens: ``(B,)`` valid keys per sequence (default: all).
        block_table: ``(B, max_pages)`` page indices (entries past a
            sequence's pages are never read).
        num_splits: key chunks per sequence attended in parallel and merged;
            None aims at eight programs per multiprocessor. Any value gives
            the same result up to rounding.
        causal, scale, window, alibi_slopes, softcap: as in :func:`attention`
            (``causal`` defaults to True here).
        return_lse: also return ``lse (B, Hq, Tq)`` float32.
        sinks: ``(Hq,)`` attention sinks, merged after the kernels (in torch:
            a learned sink gets its gradient through the merge).

    Returns:
        ``out (B, Hq, Tq, dv)`` in q's dtype, and ``lse`` if asked; a query that
        sees no key gets zeros and ``lse = -inf``.
    """
    q, k_cache, v_cache, table = _cache(q, k_cache, v_cache, block_table)
    batch, heads, tq, d = q.shape
    pages, hk, page_size = k_cache.shape[:3]
    capacity = page_size if table is None else page_size * table.shape[1]
    seqlens = _seqlens(cache_seqlens, table, batch, capacity, pages, q.device)
    num_splits = check_num_splits(num_splits)
    if num_splits is None:
        longest = capacity if cache_seqlens is None or not batch else int(seqlens.max())
        row_blocks = cdiv(heads // hk * tq, decode_rows_block(heads // hk * tq))
        num_splits = auto_splits(batch, hk, row_blocks, longest, q.device)
    scale, left, right, cap = _scalars(causal, scale, window, softcap, d)
    alibi = checks.slopes(alibi_slopes, batch, heads, q.device, per_batch_ok=True)
    out, lse = torch.ops.flashtile.triton_decode(
        q, k_cache, v_cache, seqlens, table, num_splits, alibi, scale, left, right, cap
    )
    if sinks is not None:
        out, lse = add_sinks(torch, out, lse, checks.sinks(sinks, heads, q.device))
    return (out, lse) if return_lse else out

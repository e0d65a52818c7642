"""The entry points on GPU tensors: each one check, plan and run of the
Triton backend's front door (:mod:`.frontdoor`).

Semantics are flashtile's everywhere (:mod:`flashtile.masks`,
:mod:`flashtile.variants`): causal aligns bottom-right, a query that sees no
key gives a zero row and ``lse = -inf`` (never NaN), ``lse`` is the natural-log
normaliser in float32.
"""

from __future__ import annotations

import torch

from flashtile import op_autograd
from flashtile._validate import AttentionShapes, check_num_splits, resolve_scale
from flashtile.kvlayout import check_cache_shapes, table_problem
from flashtile.merge import add_sinks

from . import checks, frontdoor, launch, ops
from .launch import auto_splits


def attention(
    q, k, v, *, causal=False, scale=None, window=None, alibi_slopes=None, softcap=None,
    kv_lengths=None, mask=None, enable_gqa=False, return_lse=False, sinks=None, dropout_p=0.0,
):  # fmt: skip
    """Exact attention with the Triton kernels, differentiable w.r.t. ``q``, ``k``, ``v``.

    The keywords of :func:`flashtile.torch.attention`, on CUDA tensors (CPU
    tensors under ``TRITON_INTERPRET=1``). The call is checked, planned and
    run by :mod:`flashtile.triton.frontdoor`, as the torch operator's CUDA
    calls are: a decoding step (4-D, at most 8 queries, no gradient wanted,
    no ``kv_lengths`` or dropout) runs the split-KV decode kernel, with the
    same result up to rounding.

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
    keywords = dict(
        window=window, alibi_slopes=alibi_slopes, softcap=softcap, kv_lengths=kv_lengths,
        mask=mask, sinks=sinks, dropout_p=dropout_p,
    )  # fmt: skip
    call = frontdoor.check_call(q, k, v, causal, scale, keywords, enable_gqa=enable_gqa)
    grad = op_autograd.wants_grad(call.q, call.k, call.v, call.variants.sinks)
    return frontdoor.run_plan(call, frontdoor.plan_call(call, grad), return_lse)


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
    call, dout, out, lse = _gradient_call(
        q, k, v, out, lse, dout, causal=causal, scale=scale, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, kv_lengths=kv_lengths, enable_gqa=enable_gqa,
    )  # fmt: skip
    plan = frontdoor.plan_call(call, wants_grad=True)  # the forward's arguments
    grads = torch.ops.flashtile.triton_attention_bwd(
        dout, plan.q, plan.k, plan.v, out, lse, None, *plan.args
    )
    return tuple(g[0] for g in grads) if len(call.shapes.batch) == 1 else grads


def block_gradients(q, k, v, out, lse, dout, **kw):
    """``(dq, dk, dv, sums)`` of one block of a longer row, no precision rule
    applied (the distributed engine's, as the CPU's
    :func:`flashtile.gradients.block_gradients`): :func:`attention_backward`'s
    arguments and results for 4-D inputs, and each row's sum of ``P`` (its
    share of the whole row's, whose ``lse`` it is)."""
    call, dout, out, lse = _gradient_call(q, k, v, out, lse, dout, **kw)
    plan = frontdoor.plan_call(call, wants_grad=True)
    with ops.on_device(plan.q):
        args = ops.kernel_args(*plan.args)
        return launch.backward(dout, plan.q, plan.k, plan.v, out, lse, args)


def _gradient_call(
    q, k, v, out, lse, dout, causal=False, scale=None, enable_gqa=False, window=None,
    alibi_slopes=None, softcap=None, kv_lengths=None,
):  # fmt: skip
    """``(call, dout, out, lse)``: the call checked by the front door
    (:func:`.frontdoor.check_call`; the backward's variants only: no
    dropout or sinks, whose gradients are the forward op's) and the
    forward's ``out``/``lse`` and ``dout`` checked against it, 4-D, in the
    dtypes the backward op takes."""
    keywords = dict(
        window=window, alibi_slopes=alibi_slopes, softcap=softcap, kv_lengths=kv_lengths
    )
    call = frontdoor.check_call(q, k, v, causal, scale, keywords, enable_gqa=enable_gqa)
    lead = (1,) if len(call.shapes.batch) == 1 else ()
    want = (*lead, *call.shapes.batch, call.shapes.tq, call.shapes.dv)
    out, lse, dout = (
        checks.check_tensor(t, name).reshape(lead + tuple(t.shape))
        for t, name in ((out, "out"), (lse, "lse"), (dout, "dout"))
    )
    if out.shape != want or dout.shape != want or lse.shape != want[:3]:
        raise ValueError(
            f"out {tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)}: expected "
            f"out and dout {want} and lse {want[:3]} (the forward's, return_lse=True)"
        )
    dtype = call.q.dtype
    return call, dout.to(dtype).contiguous(), out.to(dtype), lse.float().contiguous()


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
    keywords = dict(
        window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )  # fmt: skip
    call = frontdoor.check_call(
        q, k, v, causal, scale, keywords, (cu_seqlens_q, cu_seqlens_k),
        max_seqlens=(max_seqlen_q, max_seqlen_k),
    )  # fmt: skip
    return frontdoor.run_plan(call, frontdoor.plan_call(call), return_lse)


def _cache(q, k_cache, v_cache, block_table):
    """Validated ``(q, k_cache, v_cache, table or None)`` of a decoding call:
    the layout rule of both backends (:func:`flashtile.kvlayout.check_cache_shapes`)
    and the kernels' limits."""
    q = checks.check_tensor(q, "q").contiguous()
    k_cache = checks.check_tensor(k_cache, "k_cache")
    v_cache = checks.check_tensor(v_cache, "v_cache")
    table = None if block_table is None else torch.as_tensor(block_table)
    check_cache_shapes(q, k_cache, v_cache, table)
    checks.check_gpu_call(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if table is not None:
        table = checks.int_tensor(table, "block_table", tuple(table.shape), q.device)
    return q, k_cache, v_cache, table


def _seqlens(cache_seqlens, table, batch, page_size, pages, device):
    """``cache_seqlens`` as int32 (default: full), checked against the cache
    and the table (:func:`flashtile.kvlayout.table_problem`, read on the host)."""
    capacity = page_size if table is None else page_size * table.shape[1]
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    else:
        seqlens = checks.int_tensor(cache_seqlens, "cache_seqlens", (batch,), device)
        checks.check_range(
            seqlens, "cache_seqlens", 0, capacity, "the cache's capacity per sequence"
        )
    if table is not None:
        given = cache_seqlens is not None
        problem = table_problem(torch, table, seqlens, page_size, pages, given)
        if problem:
            raise ValueError(problem)
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
    seqlens = _seqlens(cache_seqlens, table, batch, page_size, pages, q.device)
    num_splits = check_num_splits(num_splits)
    if num_splits is None:
        longest = capacity if cache_seqlens is None or not batch else int(seqlens.max())
        num_splits = auto_splits(batch, hk, heads // hk * tq, longest, q.device)
    shapes = AttentionShapes((batch, heads), tq, capacity, d, v_cache.shape[3], heads // hk)
    va = frontdoor.check_variants(
        shapes, q.device, causal=causal, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    out, lse = torch.ops.flashtile.triton_decode(
        q, k_cache, v_cache, seqlens, table, num_splits, va.alibi, resolve_scale(scale, d),
        va.left, va.right, va.softcap,
    )  # fmt: skip
    if va.sinks is not None:
        out, lse = add_sinks(torch, out, lse, va.sinks)
    return (out, lse) if return_lse else out

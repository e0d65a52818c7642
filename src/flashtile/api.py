"""The fast public API: validate, plan the work (:mod:`flashtile.planning`), call
the compiled CPU kernel.

Arrays are ``(B, H, T, d)`` (also ``(H, T, d)`` and ``(T, d)``). ``q`` and
``k``/``v`` share the batch dim; ``k``/``v`` may have fewer heads than ``q``
(GQA/MQA, ``Hq % Hkv == 0``) and are never copied per query head. Packed
variable-length batches go through :func:`varlen_attention`.

Variants (keyword-only, the same on every function, semantics in
:mod:`flashtile.variants` and :mod:`flashtile.masks`): ``window=(left,
right)``, ``alibi_slopes``, ``softcap``, ``kv_lengths`` or
``key_padding_mask``, and ``mask`` (bool = keep, float = added, or a
:class:`~flashtile.masks.BlockMask`).

dtypes: float32 and float64 run natively (the running state accumulates in
the input dtype). float16 inputs are upcast to float32, computed, and the
outputs cast back to float16; ``lse`` stays float32. bfloat16 has no NumPy
dtype: convert it to float32 first.
"""

from __future__ import annotations

import numpy as np

from ._validate import check_same_shape
from .planning import (
    BWD_BLOCKS,
    FWD_BLOCKS,
    backward_items,
    forward_items,
    plan_call,
    plan_varlen,
    with_states,
)


def _run_forward(plan, block_q, block_k, auto_q):
    from .cpu.blas import gemm_for, single_threaded_blas
    from .cpu.forward import forward_kernel

    items, block_q, kv = forward_items(plan, block_q, block_k, auto_q)
    out = np.empty(plan.q4.shape[:-1] + (plan.v4.shape[-1],), dtype=plan.q4.dtype)
    lse = np.empty(plan.q4.shape[:-1], dtype=plan.q4.dtype)
    visited = np.empty(len(items), dtype=np.int64)
    gemm_fn = gemm_for(plan.q4.dtype)
    with single_threaded_blas(gemm_fn):
        forward_kernel(
            plan.q4,
            plan.k4,
            plan.v4,
            out,
            lse,
            visited,
            plan.seqs,
            items,
            plan.scale,
            kv,
            block_q,
            block_k,
            gemm_fn,
        )
    return out, lse, int(visited.sum())


def attention(
    q, k, v, *, causal=False, scale=None, return_lse=False, block_q=None, block_k=None, **variants
):
    """Exact attention ``softmax(q k^T * scale) v`` with the fused CPU kernel.

    Args:
        q: ``(B, Hq, Tq, d)``, or ``(Hq, Tq, d)`` or ``(Tq, d)``.
        k: ``(B, Hkv, Tk, d)``; v: ``(B, Hkv, Tk, dv)``; ``Hkv`` divides ``Hq``.
        causal: mask keys after each query, aligned bottom-right: query ``i``
            sees key ``j`` iff ``j <= i + Tk - Tq`` (see :mod:`flashtile.masks`).
        scale: score multiplier, default ``1/sqrt(d)``.
        return_lse: also return ``lse = log(sum_j exp(score_ij))`` ``(..., Tq)``.
        block_q, block_k: tile sizes (tuning knobs; any value is exact).
        **variants: ``window``, ``alibi_slopes``, ``softcap``, ``kv_lengths``,
            ``key_padding_mask``, ``mask`` (see :mod:`flashtile.variants`).

    Returns:
        ``out (..., Tq, dv)`` in the input dtype, and ``lse`` if asked. A query
        that sees no key gets a zero row and ``lse = -inf``.
    """
    plan, block_q_, block_k_ = plan_call(
        q, k, v, causal, scale, variants, block_q, block_k, FWD_BLOCKS
    )
    # Query tiles shrink for threads unless given, or kept from a BlockMask.
    auto_q = block_q is None and plan.variants.block_mask is None
    out, lse, _ = _run_forward(plan, block_q_, block_k_, auto_q=auto_q)
    out = out.reshape(plan.out_shape + out.shape[-1:]).astype(plan.dtype, copy=False)
    if return_lse:
        return out, lse.reshape(plan.out_shape)
    return out


def visited_tiles(q, k, v, *, causal=False, block_q, block_k, **variants) -> int:
    """How many score tiles the forward computes for this call (skips excluded).

    For tests and curious users: shows the causal/window band and a block
    mask's empty tiles being skipped. Runs the forward once.
    """
    plan, bq, bk = plan_call(q, k, v, causal, None, variants, block_q, block_k, FWD_BLOCKS)
    return _run_forward(plan, bq, bk, auto_q=False)[2]


def _run_backward(plan, out, lse, dout, block_q, block_k):
    from .cpu.backward import backward_kernel
    from .cpu.blas import gemm_for, single_threaded_blas

    q4, k4, v4 = plan.q4, plan.k4, plan.v4
    o_shape = plan.out_shape + (v4.shape[-1],)
    out = check_same_shape(out, "out", o_shape, "the forward output")
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of out")
    lse = check_same_shape(lse, "lse", plan.out_shape, "from return_lse=True")

    def like_q4(a, last):
        return np.ascontiguousarray(a, dtype=q4.dtype).reshape(q4.shape[:-1] + last)

    out4, dout4 = like_q4(out, (v4.shape[-1],)), like_q4(dout, (v4.shape[-1],))
    lse4 = like_q4(lse, ())
    items, parts = backward_items(plan, block_q)
    dq = np.empty_like(q4)
    # Part p accumulates its share of dk/dv in slice p; summed below in order.
    dk_parts = np.zeros((parts, *k4.shape), k4.dtype)
    dv_parts = np.zeros((parts, *v4.shape), v4.dtype)
    gemm_fn = gemm_for(q4.dtype)
    with single_threaded_blas(gemm_fn):
        backward_kernel(
            q4,
            k4,
            v4,
            out4,
            lse4,
            dout4,
            dq,
            dk_parts,
            dv_parts,
            plan.seqs,
            items,
            plan.scale,
            with_states(plan, block_q, block_k),
            block_q,
            block_k,
            gemm_fn,
        )
    dk, dv = dk_parts[0], dv_parts[0]
    for p in range(1, parts):  # a fixed order: deterministic sums
        dk += dk_parts[p]
        dv += dv_parts[p]
    return dq, dk, dv


def attention_backward(
    q, k, v, out, lse, dout, *, causal=False, scale=None, block_q=None, block_k=None, **variants
):
    """Gradients ``(dq, dk, dv)`` of :func:`attention`, recomputing score tiles.

    Args:
        q, k, v, causal, scale, variants: exactly as passed to the forward.
        out, lse: the forward's output and ``lse`` (``return_lse=True``).
        dout: gradient of the loss w.r.t. ``out``, same shape as ``out``.

    Returns:
        ``dq``, ``dk``, ``dv`` with the shapes and dtype of ``q``, ``k``, ``v``
        (GQA: ``dk``/``dv`` summed over each group). Nothing of size
        ``Tq x Tk`` is allocated. Parallel over ``(batch, kv head)``;
        deterministic (bit-identical from run to run). Not differentiated:
        masks and ALiBi slopes (constants).
    """
    plan, block_q, block_k = plan_call(
        q, k, v, causal, scale, variants, block_q, block_k, BWD_BLOCKS
    )
    grads = _run_backward(plan, out, lse, dout, block_q, block_k)
    return tuple(
        g.reshape(np.shape(a)).astype(plan.dtype, copy=False)
        for g, a in zip(grads, (q, k, v), strict=True)
    )


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal=False,
    scale=None,
    return_lse=False,
    block_q=None,
    block_k=None,
    **variants,
):
    """Attention over packed variable-length sequences, no padding computed.

    Args:
        q: ``(Hq, total_q, d)``; k: ``(Hkv, total_k, d)``; v: ``(Hkv, total_k, dv)``.
        cu_seqlens_q, cu_seqlens_k: ``(S + 1,)`` int32/int64 offsets; sequence
            ``s`` is queries ``[cu_q[s], cu_q[s+1])`` and keys
            ``[cu_k[s], cu_k[s+1])``. Each sequence is attended on its own,
            with causal/window/ALiBi positions aligned bottom-right within it.
        causal, scale, return_lse, block_q, block_k: as in :func:`attention`.
        **variants: ``window``, ``alibi_slopes`` (``(Hq,)``), ``softcap``.

    Returns:
        ``out (Hq, total_q, dv)`` and, if asked, ``lse (Hq, total_q)``.
    """
    plan, bq, bk = plan_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, variants, (block_q, block_k), FWD_BLOCKS
    )
    out4, lse4, _ = _run_forward(plan, bq, bk, auto_q=block_q is None)
    out = out4[0].astype(plan.dtype, copy=False)
    return (out, lse4[0]) if return_lse else out


def varlen_attention_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal=False,
    scale=None,
    block_q=None,
    block_k=None,
    **variants,
):
    """Gradients ``(dq, dk, dv)`` of :func:`varlen_attention` (packed layout)."""
    plan, bq, bk = plan_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, variants, (block_q, block_k), BWD_BLOCKS
    )
    grads = _run_backward(plan, out, lse, dout, bq, bk)
    return tuple(g[0].astype(plan.dtype, copy=False) for g in grads)


__all__ = [
    "attention",
    "attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
]

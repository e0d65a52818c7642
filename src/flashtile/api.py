"""The fast public API. Every entry point reads: validate the call, plan it
(:mod:`flashtile.planning`: one plan holds everything the kernel reads), run
the plan (:mod:`flashtile.cpu.launch`), shape the results back to the
caller's layout. The forward goes through :mod:`flashtile.frontdoor`, which
does the three steps once per call metadata and then reuses them.

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
the input dtype). ``ml_dtypes.bfloat16`` inputs run the tile products of
the forward and the backward in bf16 where the CPU has bf16 instructions
(the measured ``bf16`` route: :func:`flashtile.cpu.blas.half_path`), else they are
widened like float16: float16 inputs are upcast to float32, computed, and the
outputs cast back; ``lse`` is float32 for 16-bit inputs. Inputs whose scores
could pass float32's range (a ``scale`` of 1e38, values near 1e19, huge ALiBi
slopes) are computed in float64 and cast back (:mod:`flashtile.precision`).
"""

from __future__ import annotations

import numpy as np

from ._validate import check_flag
from .call_keys import plain_key
from .cpu.launch import run_forward
from .frontdoor import (
    check_call,
    prepare,
    prepared,
    prepared_call,
    run_call,
    run_prepared,
)
from .gradients import check_gradient_inputs, checked_gradients, in_dtype
from .merge import sink_gradient
from .planning import plan_forward

__all__ = [
    "attention",
    "attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
]


def _backward(call, out, lse, dout, block_q, block_k, steps=None):
    """The backward of a checked call: ``(dq, dk, dv)`` in the shapes of the
    caller's ``q``, ``k``, ``v`` and its dtype, and ``dsinks`` with sinks;
    right or a ``ValueError`` (:mod:`flashtile.gradients`, which also reads
    ``steps``: a prepared call's backward plans).

    ``out`` and ``lse`` are the forward's, the sinks merged in: ``P = exp(S -
    lse)`` is then the softmax with the sink's column, so the kernels'
    formula needs nothing more, and the sink's own gradient is
    :func:`flashtile.merge.sink_gradient`."""
    out, lse, dout = check_gradient_inputs(call, out, lse, dout)
    g = checked_gradients(call, out, lse, dout, block_q, block_k, steps=steps)
    dtype = call.q.dtype
    grads = tuple(
        in_dtype(x, a, dtype)
        for x, a in zip((g.dq, g.dk, g.dv), (call.q, call.k, call.v), strict=True)
    )
    sinks = call.variants.sinks
    if sinks is None:
        return grads
    return grads + (in_dtype(sink_gradient(np, g.out, g.lse, dout, sinks), sinks, dtype),)


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
            ``key_padding_mask``, ``mask``, ``sinks``, ``dropout_p`` with
            ``dropout_seed`` and ``dropout_offset`` (see :mod:`flashtile.variants`),
            and FlexAttention-style ``score_mod(score, b, h, q_idx, kv_idx)``
            and ``mask_mod(b, h, q_idx, kv_idx)``: plain Python on scalars,
            compiled with Numba, forward only (docs/flex.md).

    Returns:
        ``out (..., Tq, dv)`` in the input dtype, and ``lse`` if asked. A query
        that sees no key gets a zero row and ``lse = -inf`` (``sinks[h]`` with
        sinks).

    A decode-shaped call (a few queries against many keys, no mask; the rule
    is :func:`flashtile.decode_planning.decode_shaped`) runs on the split-KV decode
    kernel of :func:`flashtile.decode_attention`, which splits the keys
    across threads; the result is the same up to rounding.
    """
    key = plain_key(q, k, v, causal, scale, return_lse, block_q, block_k, variants)
    entry = None if key is None else prepared(key)
    if entry is None:  # not seen before: the whole check
        return_lse = check_flag(return_lse, "return_lse")
        call = check_call(q, k, v, causal, scale, variants)
        if key is None:
            return run_call(call, block_q, block_k, return_lse)
        entry = prepare(key, call, block_q, block_k)
    return run_prepared(entry, q, k, v, return_lse)


def visited_tiles(q, k, v, *, causal=False, block_q, block_k, **variants) -> int:
    """How many score tiles the forward computes for this call (skips excluded).

    For tests and curious users: shows the causal/window band and a block
    mask's empty tiles being skipped. Runs the forward once.
    """
    plan = plan_forward(check_call(q, k, v, causal, None, variants), block_q, block_k)
    return int(run_forward(plan)[2].sum())


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
        (GQA: ``dk``/``dv`` summed over each group), and with ``sinks`` also
        ``dsinks (Hq,)``. Nothing of size ``Tq x Tk`` is allocated (dropout's
        mask is regenerated from its seed). Parallel over ``(batch, kv head)``;
        deterministic (bit-identical from run to run). Not differentiated:
        masks and ALiBi slopes (constants).
    """
    # The forward's key (return_lse=True, as training calls it): a backward
    # after its forward, or a repeated one, skips the check.
    key = plain_key(q, k, v, causal, scale, True, block_q, block_k, variants)
    entry = None if key is None else prepared(key)
    if entry is not None:
        call = prepared_call(entry, q, k, v)
    else:
        call = check_call(q, k, v, causal, scale, variants)
        if key is not None:
            entry = prepare(key, call, block_q, block_k)
    steps = None if entry is None else entry.backward  # its plans, reused
    return _backward(call, out, lse, dout, block_q, block_k, steps)


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
        **variants: ``window``, ``alibi_slopes`` (``(Hq,)``), ``softcap``,
            ``sinks``, ``dropout_p``/``dropout_seed``/``dropout_offset`` (the
            counters' rows are rows of the packed arrays, ``b = 0``).

    Returns:
        ``out (Hq, total_q, dv)`` and, if asked, ``lse (Hq, total_q)``.
    """
    return_lse = check_flag(return_lse, "return_lse")
    call = check_call(q, k, v, causal, scale, variants, (cu_seqlens_q, cu_seqlens_k))
    return run_call(call, block_q, block_k, return_lse)


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
    """Gradients ``(dq, dk, dv)`` of :func:`varlen_attention` (packed layout),
    and ``dsinks`` with sinks (as :func:`attention_backward`)."""
    call = check_call(q, k, v, causal, scale, variants, (cu_seqlens_q, cu_seqlens_k))
    return _backward(call, out, lse, dout, block_q, block_k)

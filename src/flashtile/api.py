"""The fast public API. Every entry point reads: validate the call, plan it
(:mod:`flashtile.planning`: one plan holds everything the kernel reads), run
the plan (:mod:`flashtile.cpu.launch`), shape the results back to the
caller's layout.

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
the forward and the backward in bf16 where the CPU has bf16 instructions and
the BLAS is oneMKL (:func:`flashtile.cpu.blas.half_path`), else they are
widened like float16: float16 inputs are upcast to float32, computed, and the
outputs cast back; ``lse`` is float32 for 16-bit inputs. Inputs whose scores
could pass float32's range (a ``scale`` of 1e38, values near 1e19, huge ALiBi
slopes) are computed in float64 and cast back (:mod:`flashtile.precision`).
"""

from __future__ import annotations

import functools

import numpy as np

from ._validate import (
    check_cu_seqlens_pair,
    check_flag,
    check_kernel_layout,
    check_packed,
    check_qkv,
    check_same_shape,
    resolve_scale,
)
from .cpu.launch import run_backward, run_decode, run_forward
from .decode_planning import decode_shaped, plan_decode_call
from .planning import Call, plan_backward, plan_forward
from .precision import decode_bound, decode_overflowed, narrow_lse
from .variants import Variants, clear_padded_keys, resolve_variants


def check_call(q, k, v, causal, scale, variants: dict, cu_seqlens=None) -> Call:
    """Validate one call for the planner (the first step of every entry point).

    Checks the arrays and their layout, the scale, the variant keywords
    (``variants``, as passed to :func:`attention`) and, for a packed batch,
    its offsets ``cu_seqlens = (cu_q, cu_k)``; raises
    ValueError/TypeError naming the values. Also how tests build a
    :class:`~flashtile.planning.Call` to inspect a plan.
    """
    if cu_seqlens is not None:
        check_packed(q, k, v, variants)
    q, k, v, shapes = check_qkv(q, k, v)
    check_kernel_layout(q, k, v)
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens_pair(*cu_seqlens, shapes)
    scale = resolve_scale(scale, shapes.d)
    if variants:
        va = resolve_variants(shapes, causal=causal, **variants)
    else:  # no variant keywords: one shared record per flag (it is frozen)
        va = _plain_variants(check_flag(causal, "causal"))
    kpm = variants.get("key_padding_mask")
    if kpm is not None:  # its keys are still read in their tiles (kv_lengths' are not)
        kept = clear_padded_keys(k, v, np.asarray(kpm))
        k, v = (a.reshape(b.shape) for a, b in zip(kept, (k, v), strict=True))
    return Call(q, k, v, shapes, va, scale, cu_seqlens)


@functools.cache
def _plain_variants(causal: bool) -> Variants:
    """:func:`resolve_variants` of a call without variant keywords (it reads no sizes)."""
    return resolve_variants(None, causal=causal)


def _check_gradient_inputs(call, out, lse, dout):
    """The backward's ``out``, ``lse`` and ``dout``, checked against the call's shapes."""
    o_shape = call.shapes.batch + (call.shapes.tq, call.shapes.dv)
    out = check_same_shape(out, "out", o_shape, "the forward output")
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of out")
    lse = check_same_shape(lse, "lse", o_shape[:-1], "from return_lse=True")
    return out, lse, dout


def run_call(call, block_q=None, block_k=None, return_lse=False):
    """Run a validated call (:func:`check_call`): the decode kernel for a decode-shaped one
    (:func:`~flashtile.decode_planning.decode_shaped`), else the forward kernel;
    the results in the caller's layout and dtype (``lse`` in the compute
    dtype, also where float64 was needed)."""
    out = None
    if decode_shaped(call, block_q, block_k):
        plan = plan_decode_call(call)
        out, lse, flagged, finite = run_decode(plan)
        if _overflowed(call, plan, lse, flagged, finite):  # computed again, in float64
            out = None
    if out is None:
        out, lse, _ = run_forward(plan_forward(call, block_q, block_k))
    lse_shape = call.shapes.batch + (call.shapes.tq,)
    if lse.shape != lse_shape:  # the kernels' 4-D layout, for 2-D and 3-D inputs
        out, lse = out.reshape(lse_shape + out.shape[-1:]), lse.reshape(lse_shape)
    if out.dtype != call.q.dtype:  # float64 was needed, or float16 inputs
        out = out.astype(call.q.dtype)
    return (out, narrow_lse(lse, call.q.dtype)) if return_lse else out


def _overflowed(call, plan, lse, flagged, finite) -> bool:
    """Whether a decode-routed call's float32 scores could have passed float32's
    range: checked, as decoding does, only when a raw score was not finite
    (``flagged``) or a row got a non-finite ``lse`` (the bound is a pass over
    the keys, as long as the step itself)."""
    shapes = call.shapes

    def bound():
        q, k, va = call.q, call.k, call.variants
        return decode_bound(call.scale, q, k, va, shapes.tq, shapes.tk, plan.q.dtype)

    return decode_overflowed(lse, plan.layout.seqlens, bound, flagged, finite)


def _gradient_results(plan, call, grads):
    """``(dq, dk, dv)`` in the shapes of the caller's ``q``, ``k``, ``v`` and its dtype."""
    return tuple(
        g.reshape(a.shape).astype(plan.dtype, copy=False)
        for g, a in zip(grads, (call.q, call.k, call.v), strict=True)
    )


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

    A decode-shaped call (a few queries against many keys, no mask; the rule
    is :func:`flashtile.decode_planning.decode_shaped`) runs on the split-KV decode
    kernel of :func:`flashtile.decode_attention`, which splits the keys
    across threads; the result is the same up to rounding.
    """
    return_lse = check_flag(return_lse, "return_lse")
    call = check_call(q, k, v, causal, scale, variants)
    return run_call(call, block_q, block_k, return_lse)


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
        (GQA: ``dk``/``dv`` summed over each group). Nothing of size
        ``Tq x Tk`` is allocated. Parallel over ``(batch, kv head)``;
        deterministic (bit-identical from run to run). Not differentiated:
        masks and ALiBi slopes (constants).
    """
    call = check_call(q, k, v, causal, scale, variants)
    out, lse, dout = _check_gradient_inputs(call, out, lse, dout)
    plan = plan_backward(call, block_q, block_k)
    grads = run_backward(plan, out, lse, dout)
    return _gradient_results(plan, call, grads)


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
    """Gradients ``(dq, dk, dv)`` of :func:`varlen_attention` (packed layout)."""
    call = check_call(q, k, v, causal, scale, variants, (cu_seqlens_q, cu_seqlens_k))
    out, lse, dout = _check_gradient_inputs(call, out, lse, dout)
    plan = plan_backward(call, block_q, block_k)
    grads = run_backward(plan, out, lse, dout)
    return _gradient_results(plan, call, grads)


__all__ = [
    "attention",
    "attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
]

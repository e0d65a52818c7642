"""The backward of a checked call, with its precision rule: the right gradients or a clear error.

The kernels recompute ``P = exp(S - lse)`` tile by tile from the forward's
``lse``; :func:`flashtile.precision.gradients_unreliable` tells, after the
kernel ran, whether that recomputation can be trusted (no row's ``P`` sums
past 1, and ``|lse|`` is small enough for the work dtype). When it cannot,
:func:`checked_gradients` computes the forward again in float64 (its own
``out`` and ``lse``) and the backward from those, as the forward already
does for scores past float32's range. It raises a ``ValueError`` that names
the fix only where float64 cannot do better either: scores too large for
float64 (``|lse|`` past about ``1e12`` with the softmax spread), or an
``lse`` of a longer row (a block's share, which the caller's float32 cannot
resolve and the float64 forward of the block alone does not give).
Ordinary calls pay a pass over the rows' sums and ``lse``.

Every CPU backward goes through here: :func:`flashtile.attention_backward`,
:func:`flashtile.varlen_attention_backward` (and so the torch operator, the
flash-attn API and transformers), ``flashtile.torch.flex.flex_attention``; the
distributed engine sums each block's :func:`kernel_gradients` over the ring
and applies the same rule to the totals, on every rank together.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import routes
from ._validate import check_same_shape, compute_dtype
from .cpu.launch import run_backward, run_forward
from .frontdoor import check_call, keep_step, live, plan_step, run_call
from .planning import Call, KernelPlan, as_blocks, plan_backward, plan_forward
from .precision import (
    GRADIENT_TOLERANCE,
    bounds,
    finite_max_abs,
    gradients_unreliable,
    narrow_out,
)
from .units import LN2


class Gradients(NamedTuple):
    """A backward's results: ``dq, dk, dv`` as the kernels return them (the
    plan's 4-D shapes), the rows' sums of ``P`` (``(..., Tq)``), the
    ``out`` and ``lse`` they were recomputed from (the caller's, or the
    float64 forward's; ``log2``: ``lse`` in log2 units), and the plan that ran."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    sums: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    plan: KernelPlan
    log2: bool = False


def check_gradient_inputs(call: Call, out, lse, dout):
    """The backward's ``out``, ``lse`` and ``dout``, checked against the call's shapes."""
    o_shape = call.shapes.batch + (call.shapes.tq, call.shapes.dv)
    out = check_same_shape(out, "out", o_shape, "the forward output")
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of out")
    lse = check_same_shape(lse, "lse", o_shape[:-1], "from return_lse=True")
    return out, lse, dout


def kernel_gradients(
    call: Call, out, lse, dout, block_q=None, block_k=None, hook=None, log2=False, steps=None
):  # fmt: skip
    """:class:`Gradients` of one kernel run, no rule applied (checked inputs;
    ``hook(plan) -> plan`` may add buffers to the plan, as flex's captured
    gradients do; ``log2``: ``lse`` in log2 units). The distributed engine's
    blocks: their ``lse`` is the whole row's, so a block's ``P`` sum to its
    share only.

    ``steps``: a prepared call's backward plans by key count
    (:attr:`flashtile.frontdoor.Prepared.backward`; not with a ``hook``). A
    repeated backward (a training loop's) runs its stored plan on this
    call's arrays, the kernel checking the score bound that the plan's work
    dtype needs (:attr:`flashtile.frontdoor.Step.limits`); the first one, or
    one whose values need another work dtype, is planned here, and its plan
    kept where the metadata decided it (:func:`flashtile.frontdoor.plan_step`)."""
    tk = call.shapes.tk
    step = None if steps is None or hook is not None else steps.get(tk)
    if live(step):
        q4, k4, v4 = as_blocks(call.q, call.k, call.v, step.shapes4, step.work, False)
        plan = KernelPlan(q4, k4, v4, *step.plan[3:])
        result = run_backward(plan, out, lse, dout, log2, step.limits)
        if result is not None:  # (None: these values need another work dtype)
            return _gradients(result, out, lse, plan, log2)
    generation = routes.GENERATION[0]  # (before planning: a route moved meanwhile plans again)
    plan = plan_backward(call, block_q, block_k)
    if hook is not None:
        plan = hook(plan)
    elif steps is not None:
        keep_step(steps, tk, plan_step(call, plan, generation))
    return _gradients(run_backward(plan, out, lse, dout, log2), out, lse, plan, log2)


def _gradients(result, out, lse, plan: KernelPlan, log2: bool) -> Gradients:
    dq, dk, dv, sums = result
    return Gradients(dq, dk, dv, sums.reshape(lse.shape), out, lse, plan, log2)


def checked_gradients(
    call: Call, out, lse, dout, block_q=None, block_k=None, hook=None, steps=None
):  # fmt: skip
    """:class:`Gradients` of a whole call that the rule trusts (see the module
    docstring); ``out``, ``lse``, ``dout`` checked (:func:`check_gradient_inputs`);
    ``steps`` as in :func:`kernel_gradients`."""
    grads = kernel_gradients(call, out, lse, dout, block_q, block_k, hook, steps=steps)
    sinks = call.variants.sinks
    if not gradients_unreliable(grads.sums, lse, dout, sinks):
        return grads
    wide = widened(call)
    out64, lse64, log2 = float64_forward(wide, block_q, block_k)
    natural = lse64 * LN2 if log2 else lse64
    shapes = call.shapes
    scores = bounds(call.scale, call.q, call.k, call.variants, shapes.tq, shapes.tk)[0] * LN2
    share = _share_excess(lse, natural, dout, call.q.dtype, scores)
    if share > 0:
        raise ValueError(share_refusal(share, natural))
    grads = kernel_gradients(wide, out64, lse64, dout, block_q, block_k, hook, log2)
    if gradients_unreliable(grads.sums, lse64, dout, sinks):
        raise ValueError(refusal(natural, dout))
    return grads


def _share_excess(lse, own, dout, dtype, scores) -> float:
    """How far the caller's ``lse`` exceeds the call's own (float64, natural
    log) beyond what rounding explains, in rows with a nonzero ``dout`` (0
    if nowhere): an ``lse`` of a longer row, whose blocks' gradients the
    caller sums (their ``P`` sum to a share, which the rule accepts; but the
    float64 recomputation would give the block's own gradient instead).
    Rounding: of ``lse`` and, in the inputs' compute dtype, of scores up to
    ``scores`` in size (:func:`flashtile.precision.bounds`: products that
    cancel round by their terms' size, not the score's)."""
    eps = float(np.finfo(compute_dtype(dtype)).eps) + float(ml_dtypes.finfo(lse.dtype).eps)
    with np.errstate(invalid="ignore", over="ignore"):
        excess = lse.astype(np.float64) - own
        bound = 4 * eps * (np.abs(own) + scores) + GRADIENT_TOLERANCE
        rows = np.isfinite(excess) & (excess > bound) & np.any(dout != 0, axis=-1)
    return float(excess[rows].max()) if rows.any() else 0.0


def share_refusal(excess, own) -> str:
    """The error of a block recomputed from a longer row's ``lse`` that its dtype cannot resolve."""
    return (
        f"attention_backward: lse exceeds this call's own log-sum-exp by up to {excess:.3g} in "
        f"rows with a nonzero dout, so it is a longer row's (a block's share), and at |lse| "
        f"{finite_max_abs(own):.3g} its probabilities cannot be recomputed in the inputs' "
        f"dtype to {GRADIENT_TOLERANCE:.1e}: compute the whole row in float64 (float64 inputs, "
        f"for the forward that merges the blocks too), as ring_attention does"
    )


def widened(call: Call) -> Call:
    """``call`` with float64 ``q``, ``k``, ``v`` (the variants are dtype-free)."""
    return call._replace(**{name: getattr(call, name).astype(np.float64) for name in "qkv"})


def float64_forward(call: Call, block_q=None, block_k=None):
    """``(out, lse, log2)`` of a float64 call for its backward, in the
    caller's shapes: ``lse`` in log2 units (``log2`` True), as the kernels
    compute it, so a one-hot row's is its top score exactly and its ``P``
    exactly 1 (a natural-log ``lse`` multiplied back by ``log2(e)`` is off
    by an ulp or two, which at ``|lse|`` 1e13 is a tenth of a unit); with
    sinks (merged in natural log) the forward of the call itself."""
    if call.variants.sinks is not None:
        return (*run_call(call, block_q, block_k, return_lse=True), False)
    mods = call.variants.mods
    if mods is not None:
        mods.clear_flag()
    out, lse, _ = run_forward(plan_forward(call, block_q, block_k), log2=True)
    if mods is not None:  # a captured table indexed out of range
        mods.check_flag()
    shape = call.shapes.batch + (call.shapes.tq,)
    return out.reshape(shape + (call.shapes.dv,)), lse.reshape(shape), True


def refusal(lse, dout, name="attention_backward") -> str:
    """The error of ``name``, a backward that float64 cannot compute either
    (natural-log ``lse``)."""
    rows = np.any(dout != 0, axis=-1)
    big = finite_max_abs(np.where(rows, lse, 0.0))
    return (
        f"{name}: the gradients cannot be computed to {GRADIENT_TOLERANCE:.1e} "
        f"even in float64: |lse| reaches {big:.3g} in rows with a nonzero dout (float64 "
        f"resolves scores to about 1e-16 of their size, so probabilities recomputed near "
        f"|lse| 1e12 and beyond are off). Use smaller scores (a smaller scale, normalised "
        f"q and k), and hide keys with -inf or a bool mask instead of huge additive values"
    )


def in_dtype(grad: np.ndarray, like: np.ndarray, dtype) -> np.ndarray:
    """A kernel gradient in ``like``'s shape and ``dtype`` (past a 16-bit
    dtype's range: inf, :func:`flashtile.precision.narrow_out`)."""
    return narrow_out(grad.reshape(like.shape), dtype)


def block_gradients(q, k, v, out, lse, dout, *, causal=False, scale=None, **variants):
    """``(dq, dk, dv, sums)`` of one block of a longer row (the distributed
    engine's): :func:`kernel_gradients` with :func:`flashtile.attention_backward`'s
    arguments, no rule applied (``lse`` is the whole row's: the block's ``P``
    sum to its share). Gradients in the shapes of ``q``, ``k``, ``v`` and
    the work dtype; ``sums`` shaped like ``lse``."""
    call = check_call(q, k, v, causal, scale, variants)
    g = kernel_gradients(call, *check_gradient_inputs(call, out, lse, dout))
    grads = (x.reshape(a.shape) for x, a in zip((g.dq, g.dk, g.dv), (q, k, v), strict=True))
    return (*grads, g.sums)

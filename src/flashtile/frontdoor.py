"""The front door of the CPU kernels: check a call, plan it, run it; a
repeated call reuses its checks and its plan.

Every attention call on NumPy arrays or CPU tensors comes through here:
:func:`flashtile.attention` and :func:`flashtile.varlen_attention`
(:mod:`flashtile.api`), the forward of :func:`flashtile.torch.attention`,
and the float64 retry of :func:`flashtile.decode_attention`.

- :func:`check_call`: the one check of an attention call, giving a
  :class:`~flashtile.planning.Call`.
- :func:`plan_call`: the routing, written once: a decode-shaped call
  (:func:`flashtile.decode_planning.decode_shaped`) is planned for the
  split-KV decode kernel, any other for the forward kernel; the planners
  choose the work dtype (:func:`flashtile.planning.kernel_arrays`,
  :func:`flashtile.decode_planning.decode_operands`).
- :func:`run_plan`: runs the plan and shapes the results back to the
  caller's layout and dtype; a decode plan whose float32 scores overflowed
  is run again in float64 (:func:`run_decode_checked`, decoding's retry too).

**Prepared calls.** Everything the check and the plan decide follows from a
call's metadata (array types, shapes, dtypes, contiguity, flags, ``scale``,
the variant keywords that are plain values, the thread count), except the
work dtype, which also reads the values: whether float32 scores stay inside
float32's range (:mod:`flashtile.precision`). An entry point that can name
a call's metadata by a hashable key (:mod:`flashtile.call_keys` for the
NumPy API; the torch operator builds its own) asks :func:`prepared` for the record of
that key. The first call of a key runs the whole check and stores a
:class:`Prepared` record (:func:`prepare`); later calls of the key skip the
check, plan once per key count (a growing KV cache changes it every step),
and then pay only for the score bound of their values (one compiled pass
over ``q`` and ``k``; none for float64 and float16, whose bound follows
from the metadata) and the kernel (:func:`run_prepared`). A value that
needs another work dtype (float64 for huge scores) takes the general path
for that call. The backward of a prepared key keeps its plans the same way
(:attr:`Prepared.backward`, :func:`flashtile.gradients.kernel_gradients`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import routes
from ._validate import (
    BFLOAT16,
    COMPUTE_DTYPES,
    AttentionShapes,
    check_cu_seqlens_pair,
    check_flag,
    check_kernel_layout,
    check_packed,
    check_qkv,
    resolve_scale,
)
from .cpu.launch import (
    NO_LIMITS,
    DecodeLaunch,
    decode_launch,
    run_decode,
    run_forward,
    run_launch,
)
from .decode_planning import DecodePlan, decode_shaped, plan_decode, plan_decode_call
from .kvlayout import CacheLayout
from .merge import add_sinks
from .planning import (
    Call,
    KernelPlan,
    as_blocks,
    bf16_allowed,
    bf16_products,
    plan_forward,
)
from .precision import (
    FLOAT32_SCORE_LIMIT,
    decode_bound,
    decode_overflowed,
    narrow_lse,
    narrow_out,
)
from .variants import Variants, clear_padded_keys, resolve_variants


def check_call(q, k, v, causal, scale, variants: dict, cu_seqlens=None) -> Call:
    """Validate one call for the planner (the first step of every entry point).

    Checks the arrays and their layout, the scale, the variant keywords
    (``variants``, as passed to :func:`flashtile.attention`) and, for a
    packed batch, its offsets ``cu_seqlens = (cu_q, cu_k)``; raises
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


def plan_call(call: Call, block_q=None, block_k=None) -> KernelPlan | DecodePlan:
    """The plan of a checked call: the decode kernel's for a decode-shaped call
    (:func:`~flashtile.decode_planning.decode_shaped`), else the forward's."""
    if decode_shaped(call, block_q, block_k):
        return plan_decode_call(call)
    return plan_forward(call, block_q, block_k)


def run_plan(call: Call, plan, return_lse: bool):
    """Run ``plan`` (:func:`plan_call`); the results in the caller's layout and
    dtype (``lse`` in the compute dtype, also where float64 was needed), with
    the call's attention sinks merged in (:func:`flashtile.merge.add_sinks`)."""
    mods = call.variants.mods
    if mods is not None:
        mods.clear_flag()
    if type(plan) is DecodePlan:
        out, lse = run_decode_checked(plan, call.variants, call.q, None)
    else:
        out, lse, _ = run_forward(plan)
    if mods is not None:  # a captured table indexed out of range
        mods.check_flag()
    if call.variants.sinks is not None:
        out, lse = add_sinks(np, out, lse, call.variants.sinks)
    return _shaped(out, lse, call.shapes, call.q.dtype, return_lse)


def run_call(call: Call, block_q=None, block_k=None, return_lse=False):
    """:func:`plan_call` and :func:`run_plan`: the general path of a checked call."""
    return run_plan(call, plan_call(call, block_q, block_k), return_lse)


def _shaped(out, lse, shapes: AttentionShapes, dtype, return_lse):
    """The kernels' 4-D results in the caller's leading dims and dtype."""
    lse_shape = shapes.batch + (shapes.tq,)
    if lse.shape != lse_shape:  # the kernels' 4-D layout, for 2-D and 3-D inputs
        out, lse = out.reshape(lse_shape + out.shape[-1:]), lse.reshape(lse_shape)
    if out.dtype != dtype:  # float64 was needed, or float16 inputs
        out = narrow_out(out, dtype)
    return (out, narrow_lse(lse, dtype)) if return_lse else out


def run_decode_checked(plan: DecodePlan, va: Variants, q, num_splits, result=None):
    """``(out, lse)`` of a decode plan, computed again in float64 where its
    float32 scores could have passed float32's range (the question is asked
    only when a raw score or a row's ``lse`` was not finite:
    :func:`flashtile.precision.decode_overflowed`). ``q``: the validated
    queries (any layout of the plan's sizes); ``num_splits`` as planned;
    ``result``: :func:`~flashtile.cpu.launch.run_decode`'s of this plan
    where the caller ran it (a prepared step, :func:`_run_step`)."""
    out, lse, flagged, finite = run_decode(plan) if result is None else result
    if finite and not flagged:  # the common case: nothing to ask
        return out, lse
    layout = plan.layout
    tq, capacity = plan.q.shape[2], layout.table.shape[1] * layout.page

    def bound():
        return decode_bound(plan.scale, q, layout.k, va, tq, capacity, plan.q.dtype)

    if not decode_overflowed(lse, layout.seqlens, bound, flagged, finite):
        return out, lse
    wide = layout._replace(k=layout.k.astype(np.float64), v=layout.v.astype(np.float64))
    q4 = q.reshape(plan.q.shape)
    out, lse, _, _ = run_decode(plan_decode(q4, wide, va, plan.scale, num_splits))
    return out, narrow_lse(lse, layout.k.dtype)


class Step(NamedTuple):
    """A prepared call's plan for one key count, without its arrays.

    Attributes:
        plan: the :class:`~flashtile.planning.KernelPlan` (its ``q4, k4, v4``
            None) or :class:`~flashtile.decode_planning.DecodePlan` (``q``
            None, and its layout's ``k``, ``v``).
        shapes: the call's sizes for this key count.
        shapes4: the 4-D shapes of ``q``, ``k``, ``v`` in the kernels' layout.
        work: the dtype ``q`` is given to the kernel in (``k`` and ``v`` too
            in the forward and the backward; a decode plan reads the cache as
            it is).
        limits: the ``(score, products)`` bounds (log2 units) a forward or
            backward kernel checks the call's values against before it
            computes (:func:`flashtile.cpu.launch.run_forward`): float32's
            range for the scores where the work dtype reads the values
            (float32 and bfloat16 inputs), and with bf16 tiles for their
            unscaled products too; no limit where the metadata decides it
            (float64 and float16 inputs, and decode plans, whose range is
            checked after the step).
        products: for bfloat16 inputs, whether bf16 products were available
            when it was planned (:func:`flashtile.planning.bf16_products`: the
            BLAS can be switched at run time; a step planned for the other
            answer is planned again); None for other dtypes.
        num_splits: the decode plan's ``num_splits`` (its float64 retry's too).
        routes: :data:`flashtile.routes.GENERATION` when it was planned
            (a decode plan's walk and a tiny call's library are routes', the
            BLAS can be switched: planned again once that moves).
        launch: a decode plan's kernel call but its arrays
            (:func:`flashtile.cpu.launch.decode_launch`); None for the forward
            and the backward.
        as_is: the kernel's ``out`` is the call's result as it is (the
            caller's layout and dtype), when ``lse`` is not asked for and a
            decode step did not have to compute again in float64.
    """

    plan: KernelPlan | DecodePlan
    shapes: AttentionShapes
    shapes4: tuple
    work: np.dtype
    limits: tuple
    products: bool | None
    num_splits: int | None = None
    routes: int | None = None
    launch: DecodeLaunch | None = None
    as_is: bool = False


class Prepared(NamedTuple):
    """A checked call's metadata, for later calls of the same key.

    ``shapes`` holds the first call's key count (later calls replace it);
    ``steps`` maps a key count to its :class:`Step`, ``backward`` to the
    backward's (:func:`flashtile.gradients.kernel_gradients`).
    """

    shapes: AttentionShapes
    variants: Variants
    scale: float
    block_q: int | None
    block_k: int | None
    steps: dict
    backward: dict


_PREPARED: dict = {}
#: Prepared keys kept at most (a model has a few shapes; a sweep starts over).
PREPARED_MAX = 256
#: Steps kept per prepared key (a decoding loop adds one per generated token).
STEPS_MAX = 64
#: Input dtypes whose work dtype the metadata decides (precision.bounds reads no values).
_BOUND_FREE = frozenset((np.dtype(np.float64), np.dtype(np.float16)))


#: ``prepared(key)``: the record stored for ``key`` (a :class:`Prepared`, or
#: another entry point's under a key of its own tag, :func:`remember`), or
#: None (the dict's own ``get``: no Python call per lookup).
prepared = _PREPARED.get


def prepare(key, call: Call, block_q=None, block_k=None) -> Prepared:
    """Store ``call``'s checked metadata for later calls of ``key`` (a hashable
    name of everything the check read but the key count and the values)."""
    entry = Prepared(call.shapes, call.variants, call.scale, block_q, block_k, {}, {})
    remember(key, entry)
    return entry


def remember(key, entry) -> None:
    """Store ``entry`` as the prepared record of ``key`` (a :class:`Prepared`, or
    another entry point's record under a key of its own tag)."""
    if len(_PREPARED) >= PREPARED_MAX:
        _PREPARED.clear()
    _PREPARED[key] = entry


def prepare_decode(key, plan: DecodePlan, va: Variants, q, num_splits) -> None:
    """Store a :func:`flashtile.decode_attention` call's checked plan for later
    calls of ``key`` (:func:`flashtile.call_keys.decode_key`); ``q``: the
    call's validated queries, ``num_splits`` as checked."""
    (b, hq, tq, d), (_, _, t_max, dv) = plan.q.shape, plan.layout.v.shape
    shapes = AttentionShapes((b, hq), tq, t_max, d, dv)
    entry = Prepared(shapes, va, plan.scale, None, None, {}, {})
    entry.steps[None] = _decode_step(plan, shapes, q.dtype, num_splits)
    remember(key, entry)


def run_prepared_decode(entry: Prepared, q, k_cache, v_cache, return_lse: bool):
    """The result of a :func:`flashtile.decode_attention` call whose key
    :func:`prepare_decode` stored (no check, no planning), or None when its
    step no longer holds (the BLAS was switched, or a route moved: the caller
    plans the call)."""
    step = entry.steps[None]
    if not live(step):
        return None
    return _run_step(step, entry.variants, q, k_cache, v_cache, return_lse)


def live(step: Step | None) -> bool:
    """Whether a stored ``step`` may run: planned under the present routes
    (:data:`flashtile.routes.GENERATION`) and, for bf16 inputs, the present
    answer of :func:`flashtile.planning.bf16_products` (the BLAS can be
    switched at run time). A step that may not is planned again."""
    if step is None or step.routes != routes.GENERATION[0]:
        return False
    return step.products is None or step.products == bf16_products(BFLOAT16)


def run_prepared(entry: Prepared, q, k, v, return_lse: bool):
    """The result of a call whose key :func:`prepare` stored: ``q, k, v`` as the
    key describes them (checked metadata, NumPy arrays in the caller's
    layout). The first call of a key count plans it (:func:`plan_call`) and
    keeps the plan where the call's values did not decide it; later ones
    run it, the kernel checking their score bound first where the work dtype
    reads it (values past it are planned again, as a first call)."""
    tk = k.shape[-2]
    step = entry.steps.get(tk)
    if live(step):  # (else none yet, or planned before a route or the BLAS changed)
        result = _run_step(step, entry.variants, q, k, v, return_lse)
        if result is not None:
            return result  # (None: float64, or widened bf16, for these values)
    call = prepared_call(entry, q, k, v)
    generation = routes.GENERATION[0]  # (before planning: a route moved meanwhile plans again)
    plan = plan_call(call, entry.block_q, entry.block_k)
    keep_step(entry.steps, tk, plan_step(call, plan, generation))
    return run_plan(call, plan, return_lse)


def keep_step(steps: dict, tk: int, step: Step | None) -> None:
    """Store ``step`` (unless None) as ``steps``' plan for ``tk`` keys (at most
    :data:`STEPS_MAX`: a decoding loop adds one per generated token)."""
    if step is not None:
        if len(steps) >= STEPS_MAX:
            steps.clear()
        steps[tk] = step


def prepared_call(entry: Prepared, q, k, v) -> Call:
    """The :class:`~flashtile.planning.Call` of arrays whose key
    :func:`prepare` stored, without the check: the entry's record with this
    call's key count (the backward's, :func:`flashtile.attention_backward`,
    and a key count's first forward)."""
    shapes, tk = entry.shapes, k.shape[-2]
    if shapes.tk != tk:  # AttentionShapes(...) rather than _replace: a few microseconds less
        shapes = AttentionShapes(shapes.batch, shapes.tq, tk, *shapes[3:])
    return Call(q, k, v, shapes, entry.variants, entry.scale)


def plan_step(call: Call, plan, generation: int) -> Step | None:
    """The :class:`Step` of a plan (the forward's, the backward's or a decode
    plan) made at route ``generation``
    (:data:`flashtile.routes.GENERATION`), or None where this call's values
    or arrays decided it: float64 work for float32 or bfloat16 inputs, bf16
    inputs widened for the range of their products, lengths, slopes or
    masks, sinks, dropout's seed or mods; or a route's answer that is not
    settled yet (a tiny call's library given by the fixed rule while another
    route is measured)."""
    va = call.variants
    if va.kv_lengths is not None or va.alibi is not None or va.mask_add is not None:
        return None
    if va.mask_bool is not None or call.cu_seqlens is not None or va.sinks is not None:
        return None
    if va.dropout_p > 0.0 or va.mods is not None:
        return None
    dtype = call.q.dtype
    if type(plan) is DecodePlan:  # chosen by the metadata: its range is checked after the step
        return _decode_step(plan, call.shapes, dtype, None, generation)
    work = plan.q4.dtype
    if work == np.float64 and dtype != np.float64:
        return None  # float32 scores could overflow for these values
    if work != BFLOAT16 and bf16_allowed(dtype, call.scale, call.shapes.d):
        return None  # widened for these values (the range of their products)
    shapes4 = (plan.q4.shape, plan.k4.shape, plan.v4.shape)
    template = plan._replace(q4=None, k4=None, v4=None)
    limits = NO_LIMITS
    if dtype not in _BOUND_FREE:  # (the work dtype reads the values)
        limits = (FLOAT32_SCORE_LIMIT, FLOAT32_SCORE_LIMIT if work == BFLOAT16 else np.inf)
    if plan.small is not None and routes.provisional("blas.tiny"):
        return None
    # Planned again when a route or the BLAS moves: a tiny call's library is a route's.
    as_is = _as_is(call.shapes, shapes4, work, dtype)
    return Step(
        template, call.shapes, shapes4, work, limits, _products(dtype), None, generation, None,
        as_is,
    )  # fmt: skip


def _decode_step(plan: DecodePlan, shapes: AttentionShapes, dtype, num_splits, generation=None):
    """The :class:`Step` of a decode plan (its queries of ``dtype``) made at
    route ``generation`` (None: the present one)."""
    shapes4 = (plan.q.shape, plan.layout.k.shape, plan.layout.v.shape)
    template = plan._replace(q=None, layout=plan.layout._replace(k=None, v=None))
    work = plan.q.dtype
    generation = routes.GENERATION[0] if generation is None else generation
    launch = decode_launch(plan)
    # (The kernel's out is in the work dtype's compute dtype: float32 for bf16.)
    products, as_is = _products(dtype), _as_is(shapes, shapes4, COMPUTE_DTYPES[work], dtype)
    return Step(
        template, shapes, shapes4, work, NO_LIMITS, products, num_splits, generation, launch,
        as_is,
    )  # fmt: skip


def _as_is(shapes: AttentionShapes, shapes4: tuple, out_dtype, dtype) -> bool:
    """:attr:`Step.as_is`: :func:`_shaped` has nothing to do with the kernel's
    ``out`` (for queries of ``shapes4[0]``, in ``out_dtype``) for inputs of
    ``dtype``: the test it makes, made once."""
    return shapes4[0][:-1] == shapes.batch + (shapes.tq,) and out_dtype == dtype


def _products(dtype) -> bool | None:
    """:attr:`Step.products` for inputs of ``dtype``."""
    return bf16_products(dtype) if dtype == BFLOAT16 else None


def _run_step(step: Step, va: Variants, q, k, v, return_lse: bool):
    """A stored step on this call's arrays (no check, no planning), or None
    when a forward step's values do not fit its work dtype (``step.limits``:
    the kernel checks the score bound, and with bf16 products the products'
    bound, before it computes). The casts are those of the planners (a view,
    or a copy for 16-bit inputs widened)."""
    plan, work = step.plan, step.work
    as_is = step.as_is and not return_lse
    if step.launch is not None:  # a decode plan: its kernel call as it was made
        qw, k4, v4 = as_blocks(q, k, v, step.shapes4, work, True)
        result = run_launch(step.launch, qw, k4, v4)
        if result[3] and not result[2]:  # finite, nothing flagged: run_decode_checked's answer
            out, lse = result[0], result[1]
        else:  # its retry reads the plan (and may give float64, cast below)
            as_is = False
            q4 = q.reshape(step.shapes4[0])  # the caller's dtype: the retry's bound reads it
            layout = CacheLayout(k4, v4, *plan.layout[2:])
            run = DecodePlan(qw, layout, *plan[2:])
            out, lse = run_decode_checked(run, va, q4, step.num_splits, result)
    else:
        q4, k4, v4 = as_blocks(q, k, v, step.shapes4, work, False)
        result = run_forward(KernelPlan(q4, k4, v4, *plan[3:]), limits=step.limits)
        if result is None:
            return None
        out, lse, _ = result
    if as_is:
        return out  # (float32 and float64 steps of 4-D inputs: no reshape, no cast)
    return _shaped(out, lse, step.shapes, q.dtype, return_lse)

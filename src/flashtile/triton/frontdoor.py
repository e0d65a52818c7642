"""The front door of the Triton kernels: the protocol of the CPU's, on GPU tensors.

flashtile has two backends and one way through each (:mod:`flashtile.frontdoor`
is the CPU kernels')::

    call = check_call(q, k, v, causal, scale, variants)   # the one check
    plan = plan_call(call)                                # the routing
    result = run_plan(call, plan, return_lse)             # the kernels

- :func:`check_call` validates a call by the shared rules (the layout,
  :func:`flashtile._validate.check_sdpa_layout`; the window, scale, softcap,
  sinks and dropout rules of :mod:`flashtile.variants`) and the Triton
  kernels' own limits (:mod:`.checks`), and gives the same records as the
  CPU's: a :class:`flashtile.planning.Call` whose ``variants`` is the one
  :class:`flashtile.variants.Variants` record, here holding tensors on the
  inputs' device. Shapes, dtypes and flags are read from metadata; only
  ``kv_lengths``, packed offsets and sinks are read on the host (their
  value rules), once per call.
- :func:`plan_call` owns the routing: a decoding step (at most
  :data:`flashtile.decode_planning.TRITON_DECODE_MAX_QUERIES` queries of a
  4-D call, no gradient wanted, no ``kv_lengths`` or dropout, not under a
  ``torch.func`` transform, no forward-mode dual tensors) runs the split-KV
  decode op against the whole of ``k``/``v`` as its cache, any other call
  the differentiable forward op. A
  :class:`TritonPlan` holds the op's arguments, from the record by one
  function (:func:`op_arguments`); dropout's seed is drawn here.
- :func:`run_plan` calls the op, merges the sinks where the decode op
  leaves them out, and gives the results the caller's layout.

:func:`flashtile.triton.attention` and :func:`flashtile.triton.varlen_attention`
are these three steps; :func:`flashtile.torch.attention` takes them for CUDA
tensors after its refusal rule (:func:`flashtile.torch._support.refusal`),
and :func:`flashtile.triton.attention_backward` checks its call here too. The
ops rebuild the kernels' encoding of the record
(:class:`.launch.KernelArgs`) from their schema arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtile import op_autograd
from flashtile._validate import (
    AttentionShapes,
    check_flag,
    check_sdpa_layout,
    check_softcap,
    resolve_scale,
)
from flashtile.decode_planning import TRITON_DECODE_MAX_QUERIES
from flashtile.dropout import check_counter_range, check_dropout
from flashtile.masks import normalize_window
from flashtile.merge import add_sinks
from flashtile.planning import Call
from flashtile.variants import Variants

from . import checks, ops  # (ops also registers torch.ops.flashtile.triton_*)
from .launch import auto_splits


class TritonPlan(NamedTuple):
    """One call's op and its arguments (:func:`plan_call`).

    Attributes:
        decode: run ``flashtile::triton_decode`` (else the forward op).
        q, k, v: the 4-D tensors the op takes (3-D inputs get a batch of 1).
        args: the op's arguments after ``q, k, v``, without the sinks: the
            forward's variant arguments (:func:`op_arguments`), or the decode
            op's ``(cache_seqlens, block_table, num_splits, alibi_slopes,
            scale, window_left, window_right, softcap)``.
        sinks: the ``(Hq,)`` float32 sinks, or None.
    """

    decode: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    args: tuple
    sinks: torch.Tensor | None


def check_call(q, k, v, causal, scale, variants: dict, cu_seqlens=None, *, enable_gqa=False,
               max_seqlens=(None, None)) -> Call:  # fmt: skip
    """Validate one call for :func:`plan_call`; raises ValueError/TypeError
    naming the values and the fix.

    Args:
        q, k, v: ``(B, Hq, Tq, d)``, ``(B, Hkv, Tk, d)``, ``(B, Hkv, Tk, dv)``
            or the same without ``B``; packed ``(H, total, d)`` with
            ``cu_seqlens``. Float16, bfloat16 or float32 on the kernels'
            device (:func:`.checks.check_gpu_call`).
        causal, scale: as :func:`flashtile.triton.attention` takes them.
        variants: the variant keywords of :func:`flashtile.triton.attention`
            (``window``, ``alibi_slopes``, ``softcap``, ``kv_lengths``,
            ``sinks``, ``dropout_p``, ``dropout_seed``, ``dropout_offset``;
            ``mask`` is refused); another keyword is a TypeError.
        cu_seqlens: ``(cu_q, cu_k)`` offsets of a packed batch, or None.
        enable_gqa: whether ``Hkv != Hq`` is meant (always, for packed calls).
        max_seqlens: the caller's ``(max_seqlen_q, max_seqlen_k)``, checked
            against the offsets.

    Returns:
        a :class:`~flashtile.planning.Call` of the tensors (last dim
        unit-stride), their :class:`~flashtile._validate.AttentionShapes`
        (``batch`` the leading dims, query heads last), a
        :class:`~flashtile.variants.Variants` of tensors on ``q``'s device
        (``alibi (B or 1, Hq)`` float32, ``kv_lengths (B,)`` int32, ``sinks
        (Hq,)`` float32; ``dropout_seed`` None when it is to be drawn), the
        scale, and for packed calls ``(cu_q, cu_k, max_q, max_k)``: the
        int32 offsets and the longest sequences.
    """
    packed = cu_seqlens is not None
    q, k, v = _qkv(q, k, v, enable_gqa or packed, variants.get("mask"), packed)
    qs, vs = tuple(q.shape), tuple(v.shape)
    shapes = AttentionShapes(qs[:-2], qs[-2], k.shape[-2], qs[-1], vs[-1], qs[-3] // k.shape[-3])
    if packed:
        cu_seqlens = _packed(q, k, cu_seqlens, max_seqlens)
    va = check_variants(shapes, q.device, causal=causal, **variants)
    return Call(q, k, v, shapes, va, resolve_scale(scale, shapes.d), cu_seqlens)


def _qkv(q, k, v, enable_gqa: bool, mask, packed: bool):
    """q, k, v checked by the shared layout rule and the kernels' limits, last dim unit-stride."""
    q, k, v = (checks.check_tensor(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if packed:
        layout, who = "packed (H, total, d) tensors", "flashtile.triton.varlen_attention"
        check_sdpa_layout(q, k, v, enable_gqa=True, ranks=(3,), layout=layout, who=who)
    else:
        check_sdpa_layout(q, k, v, enable_gqa=enable_gqa, who="flashtile.triton.attention")
    checks.check_gpu_call(q, k, v, mask)
    return q, k, v


def _packed(q, k, cu_seqlens, max_seqlens) -> tuple:
    """``(cu_q, cu_k, max_q, max_k)`` of a packed call, checked (read on the host)."""
    cu_q, cu_k = (
        checks.int_tensor(c, n, (torch.as_tensor(c).numel(),), q.device)
        for c, n in zip(cu_seqlens, ("cu_seqlens_q", "cu_seqlens_k"), strict=True)
    )
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}"
        )
    longest_q = checks.check_cu_seqlens(cu_q, "cu_seqlens_q", q.shape[1])
    longest_k = checks.check_cu_seqlens(cu_k, "cu_seqlens_k", k.shape[1])
    for name, given, longest in zip("qk", max_seqlens, (longest_q, longest_k), strict=True):
        if given is not None and given < longest:
            raise ValueError(f"max_seqlen_{name} = {given} but a sequence has {longest}")
    return cu_q, cu_k, longest_q, longest_k


def check_variants(
    shapes: AttentionShapes, device, *, causal=False, window=None,
    alibi_slopes=None, softcap=None, kv_lengths=None, sinks=None, dropout_p=0.0,
    dropout_seed=None, dropout_offset=0, mask=None,
) -> Variants:  # fmt: skip
    """The :class:`~flashtile.variants.Variants` of the variant keywords for
    a call of ``shapes`` (3-D calls: a batch of one), in tensors on
    ``device``; :func:`check_call`'s, and the decode entry point's
    (:func:`flashtile.triton.decode_attention`). ``mask`` is refused by
    :func:`.checks.check_gpu_call`, before."""
    left, right = normalize_window(window, check_flag(causal, "causal"))
    unbatched = len(shapes.batch) == 1
    batch, heads = (1, *shapes.batch) if unbatched else shapes.batch
    alibi = checks.slopes(alibi_slopes, batch, heads, device, per_batch_ok=not unbatched)
    lengths = None
    if kv_lengths is not None:
        if unbatched:
            raise ValueError("kv_lengths needs 4-D (B, H, T, d) inputs, one length per batch entry")
        lengths = checks.int_tensor(kv_lengths, "kv_lengths", (batch,), device)
        checks.check_range(lengths, "kv_lengths", 0, shapes.tk, f"Tk = {shapes.tk}")
    given = 0 if dropout_seed is None else dropout_seed  # None: the plan draws one
    p, seed, offset = check_dropout(dropout_p, given, dropout_offset)
    if p > 0.0:
        check_counter_range(batch, heads)
    return Variants(
        causal=causal, left=left, right=right, alibi=alibi, softcap=check_softcap(softcap),
        kv_lengths=lengths, sinks=checks.sinks(sinks, heads, device), dropout_p=p,
        dropout_seed=None if dropout_seed is None else seed, dropout_offset=offset,
    )  # fmt: skip


def plan_call(call: Call, wants_grad: bool = False) -> TritonPlan:
    """The op that runs ``call`` and its arguments (the routing, see the
    module docstring); ``wants_grad``: autograd will want gradients."""
    q, k, v = call.q, call.k, call.v
    if len(call.shapes.batch) == 1:  # (H, T, d) and packed (H, total, d): a batch of one
        q, k, v = q[None], k[None], v[None]
    va = call.variants
    if not _decode_step(call, wants_grad):
        return TritonPlan(False, q, k, v, op_arguments(call), va.sinks)
    q = q.contiguous()  # the decode kernel addresses its queries densely
    batch, heads, tq = q.shape[:3]
    hk, tk = k.shape[1], k.shape[2]
    seqlens = torch.full((batch,), tk, dtype=torch.int32, device=q.device)
    splits = auto_splits(batch, hk, heads // hk * tq, tk, q.device)
    args = (seqlens, None, splits, va.alibi, call.scale, va.left, va.right, va.softcap)
    return TritonPlan(True, q, k, v, args, va.sinks)


def _decode_step(call: Call, wants_grad: bool) -> bool:
    """Whether ``call`` runs the decode op: see the module docstring. The
    decode op has no gradient and no batching rule (hence no ``torch.func``),
    and its ``cache_seqlens`` would move the queries' positions, which
    ``kv_lengths`` keeps aligned with ``Tk``; forward-mode dual tensors go to
    the forward, which refuses them (their tangent would be dropped)."""
    va = call.variants
    return (
        len(call.shapes.batch) == 2
        and call.shapes.tq <= TRITON_DECODE_MAX_QUERIES
        and not wants_grad
        and va.kv_lengths is None
        and va.dropout_p == 0.0
        and not op_autograd.functorch_active()
        and not op_autograd.has_tangent(call.q, call.k, call.v)  # the forward refuses them
    )


def op_arguments(call: Call) -> tuple:
    """The forward and backward ops' variant arguments (their schemas' order,
    :mod:`.ops`) for a checked call; dropout's seed drawn from torch's default
    CPU generator when the call gave none (a 0-d tensor, as
    :func:`flashtile.torch.attention` draws it), else ``[seed, offset]``."""
    va = call.variants
    cu_q, cu_k, max_q, max_k = call.cu_seqlens or (None, None, 0, 0)
    seed = None
    if va.dropout_p > 0.0:
        if va.dropout_seed is None and va.dropout_offset == 0:
            seed = op_autograd.dropout_seed()
        else:
            drawn = int(op_autograd.dropout_seed()) if va.dropout_seed is None else va.dropout_seed
            words = drawn - (1 << 64) if drawn >= 1 << 63 else drawn  # int64's range
            seed = torch.tensor([words, va.dropout_offset])
    return (
        va.alibi, va.kv_lengths, cu_q, cu_k, max_q, max_k, call.scale, va.left, va.right,
        va.softcap, va.dropout_p, seed,
    )  # fmt: skip


def run_plan(call: Call, plan: TritonPlan, return_lse: bool):
    """``out`` (and ``lse`` if asked) of a planned call, in the caller's layout
    (3-D inputs give 3-D results): ``out`` in the inputs' dtype, ``lse``
    float32, the sinks merged in."""
    if plan.decode:
        out, lse = torch.ops.flashtile.triton_decode(plan.q, plan.k, plan.v, *plan.args)
        if plan.sinks is not None:
            out, lse = add_sinks(torch, out, lse, plan.sinks)
    else:
        out, lse = forward(plan.q, plan.k, plan.v, *plan.args, plan.sinks)
    if len(call.shapes.batch) == 1:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def forward(q, k, v, *args):
    """The forward op (``args`` end with the sinks), differentiable also
    under ``torch.func``, where the op's own autograd does not run
    (:class:`flashtile.op_autograd.FuncAttention` there); forward-mode AD
    dual tensors are refused (their tangent would be dropped)."""
    if op_autograd.has_tangent(q, k, v):
        raise NotImplementedError(op_autograd.NO_FORWARD_AD)
    if op_autograd.functorch_active():
        return op_autograd.FuncAttention.apply(ops.OPS, q, k, v, *args)
    return torch.ops.flashtile.triton_attention_fwd(q, k, v, *args)

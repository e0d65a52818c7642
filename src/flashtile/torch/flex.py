"""FlexAttention's API on flashtile's CPU kernels, forward and backward.

``flex_attention``, ``create_block_mask``, ``and_masks``, ``or_masks`` and
``noop_mask`` take the names, arguments and defaults of
``torch.nn.attention.flex_attention``, so code written for FlexAttention
runs by changing one import::

    from flashtile.torch.flex import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + T - 1]   # bias: a learned table

    mask = create_block_mask(causal, None, None, T, T)
    out = flex_attention(q, k, v, score_mod=rel_bias, block_mask=mask)
    out.sum().backward()          # q.grad, k.grad, v.grad and bias.grad

The mods are traced and compiled into the kernels (:mod:`.flex_trace`,
:mod:`flashtile.mods`): a full tile skips ``mask_mod``, an empty tile is
never visited, a partial tile applies it element by element, and
``score_mod`` transforms every visible score before the online softmax. The
backward differentiates through ``score_mod`` (by the score, and by every
captured float tensor that requires grad: the gradients are summed in a
fixed order, deterministic run to run). A ``BlockMask`` made by PyTorch's
own ``create_block_mask`` is accepted as it is.

CPU tensors of float32, float64, bfloat16 or float16, ``(B, H, T, d)``;
CUDA tensors (float32, bfloat16, float16) run the same mods in flashtile's
Triton kernels (:mod:`flashtile.triton.flex`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, noop_mask, or_masks

from ..frontdoor import check_call, run_call
from ..gradients import checked_gradients
from .arrays import as_numpy, as_tensor
from .block_masks import block_mask_of_states, block_states, mask_mod_of
from .flex_trace import check_tables_on, compile_mods, trace_mods

__all__ = ["BlockMask", "and_masks", "create_block_mask", "flex_attention", "noop_mask", "or_masks"]


def create_block_mask(
    mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128, _compile=False, **_unused
) -> BlockMask:
    """FlexAttention's ``create_block_mask``, evaluated tile by tile.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = keep) is compiled and
    evaluated row by row inside one compiled pass: memory O(number of tiles),
    never ``Q_LEN x KV_LEN``. ``B``/``H`` of None broadcast (the mod is
    evaluated at ``b``/``h`` = 0). Returns PyTorch's ``BlockMask`` (empty
    tiles left out, full tiles listed apart from partial ones), which
    :func:`flex_attention` and PyTorch's own ``flex_attention`` both take,
    on ``device`` (it is computed on the CPU; ``mask_mod`` must not capture
    tensors on another device).
    """
    device = torch.device(device)
    sizes = {"Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "B": 1 if B is None else B}
    sizes["H"] = 1 if H is None else H
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (or None for B and H), got {value!r}")
    block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(block) != 2 or not all(isinstance(s, int) and s > 0 for s in block):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    from ..mods import mask_block_states

    mods = compile_mods(trace_mods(None, mask_mod, device=device))
    states = mask_block_states(mods, sizes["B"], sizes["H"], Q_LEN, KV_LEN, block)
    mask = block_mask_of_states(states, block, mask_mod, (Q_LEN, KV_LEN))
    return mask if device.type == "cpu" else mask.to(device)


def _call_mods(score_mod, block_mask, tq: int, tk: int):
    """``(mods, tables)``: the call's compiled mods (with the block mask's
    map) and their captured tables; ``(None, [])`` without either."""
    mask_mod = mask_mod_of(block_mask, tq, tk)
    if score_mod is None and mask_mod is None:
        return None, []
    cpu = torch.device("cpu")
    if block_mask is None:
        traced = trace_mods(score_mod, None)
        check_tables_on(traced, cpu)
        return compile_mods(traced), traced.tables
    # The mask function also reads the map: a key in a block it leaves out is
    # hidden whatever mask_mod says (FlexAttention's rule; a kernel tile can
    # stack GQA heads or span map blocks whose states differ).
    states = block_states(block_mask)
    block = tuple(block_mask.BLOCK_SIZE)
    traced = trace_mods(score_mod, mask_mod, (*states.shape, *block))
    check_tables_on(traced, cpu)
    mods = compile_mods(traced, states)
    return dataclasses.replace(mods, states=states, block=block), traced.tables


class _FlexFunction(torch.autograd.Function):
    """``(out, lse)`` of flex attention; the backward gives ``dq``, ``dk``,
    ``dv`` and the gradients of the captured tables that require grad."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mods, tables, *table_tensors):
        variants = {} if mods is None else {"mods": mods}
        call = check_call(as_numpy(q), as_numpy(k), as_numpy(v), False, scale, variants)
        out, lse = run_call(call, return_lse=True)  # (checks the mods' index flag)
        out_t, lse_t = as_tensor(np.ascontiguousarray(out)), as_tensor(np.ascontiguousarray(lse))
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.scale, ctx.mods, ctx.tables = scale, mods, tables
        ctx.mark_non_differentiable(lse_t)
        return out_t, lse_t

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mods = ctx.mods
        variants = {} if mods is None else {"mods": mods}
        arrays = [as_numpy(t) for t in (q, k, v)]
        call = check_call(*arrays, False, ctx.scale, variants)
        capture = mods is not None and mods.has_capture

        def with_buffer(plan):  # the captured tables' gradients, a row per work item
            buf = np.zeros((plan.items.shape[0], mods.floats.size))
            mods.clear_flag()
            return plan._replace(variants=plan.variants._replace(mod_grads=buf))

        dout_n = as_numpy(dout.contiguous().to(q.dtype))
        g = checked_gradients(
            call, as_numpy(out), as_numpy(lse), dout_n, hook=with_buffer if capture else None
        )
        grads = [
            as_tensor(np.ascontiguousarray(x)).to(t.dtype)
            for x, t in zip((g.dq, g.dk, g.dv), (q, k, v), strict=True)
        ]
        table_grads = [None] * len(ctx.tables)
        if capture:
            mods.check_flag()
            total = g.plan.variants.mod_grads.sum(axis=0)  # items in a fixed order: deterministic
            for n, t in enumerate(ctx.tables):
                if t.kind == "f" and t.tensor.requires_grad:
                    part = total[t.offset : t.offset + t.tensor.numel()]
                    table_grads[n] = (
                        torch.from_numpy(part.copy()).reshape(t.tensor.shape).to(t.tensor.dtype)
                    )
        return (*grads, None, None, None, *table_grads)


def flex_attention(
    query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_lse=False, kernel_options=None, *, return_aux=None,
):  # fmt: skip
    """FlexAttention on flashtile's CPU kernels (CUDA tensors: its Triton
    kernels, :mod:`flashtile.triton.flex`): same arguments and results.

    Args:
        query: ``(B, Hq, L, E)``; key: ``(B, Hkv, S, E)``; value: ``(B, Hkv, S, Ev)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied
            to ``scale * q . k`` before the softmax (may return ``-inf`` to hide).
        block_mask: a ``BlockMask`` (:func:`create_block_mask`, or PyTorch's).
        scale: default ``1 / sqrt(E)``.
        enable_gqa: must be True when ``Hq != Hkv`` (as FlexAttention asks).
        return_lse: also return the natural-log logsumexp ``(B, Hq, L)``
            (float32 for 16-bit inputs).
        kernel_options: GPU tuning options of PyTorch's kernels: ignored.
        return_aux: PyTorch's ``AuxRequest`` is not supported (use return_lse).

    A query that sees no key gets zeros and ``lse = -inf``. Differentiable
    in ``query``, ``key``, ``value`` and in the captured float tensors of
    ``score_mod`` that require grad (not through ``lse``).
    """
    if return_aux is not None:
        raise TypeError("return_aux is not supported by flashtile's flex_attention: use return_lse")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, T, E), got {_describe(t)}")
    if query.device.type == "cuda":  # the same mods in the Triton kernels
        from ..triton.flex import flex_attention as on_gpu

        return on_gpu(
            query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
            kernel_options, return_aux=return_aux,
        )  # fmt: skip
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise ValueError(
                f"flashtile's flex_attention runs on CPU tensors (and CUDA ones, with the "
                f"Triton kernels), {name} is on {t.device}"
            )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
            f"for grouped-query attention"
        )
    mods, tables = _call_mods(score_mod, block_mask, query.shape[2], key.shape[2])
    out, lse = _FlexFunction.apply(
        query, key, value, scale, mods, tables, *(t.tensor for t in tables)
    )
    return (out, lse) if return_lse else out


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {tuple(t.shape)}"
    return type(t).__name__

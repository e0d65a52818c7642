"""FlexAttention's ``flex_attention`` on the Triton kernels, forward and backward.

The same arguments and results as :func:`flashtile.torch.flex.flex_attention`
(and PyTorch's), on CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``).
The mods are traced once and written as Triton functions
(:mod:`.mod_source`) that the forward and backward kernels call on each
score tile; a block mask's lists drive the key walk (partial blocks with
``mask_mod``, full ones without, empty ones never visited), as in
PyTorch's own kernels. ``flashtile.torch.flex.flex_attention`` sends CUDA
tensors here.

Differences from the CPU path: scores and mods run in float32 (not float64);
the captured tables' gradients are summed with atomic adds (so they vary in
the last bits from run to run, as PyTorch's do; ``dq``, ``dk``, ``dv`` do
not); a launch's tiles lie inside the block mask's blocks (with blocks
smaller than its tuned tiles, ``BLOCK_SIZE`` under FlexAttention's default
128, it halves its tiles until they fit, down to 16).
"""

from __future__ import annotations

import numpy as np
import torch

from flashtile._validate import check_sdpa_layout, resolve_scale
from flashtile.masks import TILE_FULL, TILE_PARTIAL
from flashtile.torch.block_masks import block_lists, block_states, mask_mod_of

from . import checks, launch
from .mod_source import triton_mods
from .ops import poisoned


def _lists(states: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Num (2, Bm, Hm, rows), Idx (2, Bm, Hm, rows, cols))`` int32 on
    ``device``: per row of ``states``, its partial blocks, then its full ones."""
    partial, full = block_lists(states, TILE_PARTIAL), block_lists(states, TILE_FULL)
    num = torch.stack([partial[0], full[0]]).to(device)
    idx = torch.stack([partial[1], full[1]]).to(device)
    return num.contiguous(), idx.contiguous()


def _map(block_mask, batch: int, heads: int, device):
    """``(kv lists, q lists, block)`` of a block mask (see :class:`.launch.ModArgs`)."""
    states = block_states(block_mask)
    bm, hm = states.shape[:2]
    if bm not in (1, batch) or hm not in (1, heads):
        raise ValueError(
            f"block_mask has B={bm}, H={hm} but the call has B={batch}, H={heads} query heads: "
            f"build it with B and H of the call (or None to broadcast)"
        )
    kv = _lists(states, device)
    q = _lists(np.ascontiguousarray(states.transpose(0, 1, 3, 2)), device)
    return kv, q, tuple(block_mask.BLOCK_SIZE)


class _Flex(torch.autograd.Function):
    """``(out, lse)``; the backward gives ``dq``, ``dk``, ``dv`` and the
    gradients of the captured tables that require grad."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mod_args, *table_tensors):
        var = launch.KernelArgs(scale, mods=mod_args)
        fns = mod_args.fns
        fns.clear_flag()
        out, lse = launch.forward(q, k, v, var)
        fns.check_flag()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mod_args = scale, mod_args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mod_args = ctx.mod_args
        fns = mod_args.fns
        grads = None
        if fns.capture is not None:
            grads = torch.zeros_like(fns.floats)
            mod_args = launch.ModArgs(
                fns, mod_args.kv_lists, mod_args.q_lists, mod_args.block, grads
            )
        var = launch.KernelArgs(ctx.scale, mods=mod_args)
        fns.clear_flag()
        dout = dout.contiguous().to(q.dtype)
        *qkv, sums = launch.backward(dout, q, k, v, out, lse, var)
        fns.check_flag()
        tables = fns.table_grads(grads) if grads is not None else [None] * len(fns.traced.tables)
        dq, dk, dv, *tables = poisoned((*qkv, *tables), sums, lse, dout, None)
        return dq, dk, dv, None, None, *tables


def flex_attention(
    query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_lse=False, kernel_options=None, *, return_aux=None,
):  # fmt: skip
    """FlexAttention on flashtile's Triton kernels (see the module docstring).

    Args:
        query: ``(B, Hq, L, E)``; key: ``(B, Hkv, S, E)``; value: ``(B, Hkv, S, Ev)``;
            float16, bfloat16 or float32, ``E``, ``Ev`` <= 256.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
        block_mask: a ``BlockMask`` (:func:`flashtile.torch.flex.create_block_mask`,
            or PyTorch's), on any device.
        scale: default ``1 / sqrt(E)``.
        enable_gqa: must be True when ``Hq != Hkv``.
        return_lse: also return the logsumexp ``(B, Hq, L)`` float32.
        kernel_options: PyTorch's tuning options: ignored.
        return_aux: not supported (use return_lse).

    Returns:
        ``out (B, Hq, L, Ev)`` in the inputs' dtype (and ``lse``); a query that
        sees no key gets zeros and ``lse = -inf``. Differentiable in q, k, v
        and the captured float tensors of ``score_mod`` that require grad.
    """
    if return_aux is not None:
        raise TypeError("return_aux is not supported by flashtile's flex_attention: use return_lse")
    q, k, v = (checks.check_tensor(t, n) for t, n in ((query, "query"), (key, "key"),
                                                     (value, "value")))  # fmt: skip
    check_sdpa_layout(q, k, v, enable_gqa=enable_gqa, ranks=(4,), who="flex_attention")
    checks.check_gpu_call(q, k, v, names=("query", "key", "value"))
    batch, heads, tq, d = q.shape
    mask_mod = mask_mod_of(block_mask, tq, k.shape[2])
    fns = triton_mods(score_mod, mask_mod, q.device)
    mod_args = launch.ModArgs(fns)
    if block_mask is not None:
        kv, ql, block = _map(block_mask, batch, heads, q.device)
        mod_args = launch.ModArgs(fns, kv, ql, block)
    tables = [t.tensor for t in fns.traced.tables]
    out, lse = _Flex.apply(q, k, v, resolve_scale(scale, d), mod_args, *tables)
    return (out, lse) if return_lse else out

"""The Triton kernels as ``torch.library`` custom ops, with fake and autograd registrations.

Three ops, opaque to the dispatcher, FakeTensor tracing and ``torch.compile``::

    flashtile::triton_attention_fwd(q, k, v, alibi_slopes?, kv_lengths?, cu_seqlens_q?,
        cu_seqlens_k?, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
        softcap?) -> (out, lse)
    flashtile::triton_attention_bwd(dout, q, k, v, out, lse, <the same variants>)
        -> (dq, dk, dv)
    flashtile::triton_decode(q, k_cache, v_cache, cache_seqlens, block_table?, num_splits,
        alibi_slopes?, scale, window_left, window_right, softcap?) -> (out, lse)

``q (B, Hq, Tq, d)``, ``k (B, Hkv, Tk, d)``, ``v (B, Hkv, Tk, dv)`` (packed
sequences: ``B = 1`` and ``cu_seqlens``); ``alibi_slopes (B or 1, Hq)``
float32; ``kv_lengths``/``cu_seqlens``/``cache_seqlens``/``block_table``
int32; ``window_*`` = -1 for an unbounded side (causal is ``window_right =
0``). ``out`` has q's dtype, ``lse`` is float32 ``(B, Hq, Tq)``. The forward's
autograd formula calls the backward op, which recomputes probabilities from
``lse``. Use :func:`flashtile.triton.attention` and friends, which validate
and lay out the inputs, rather than these ops directly.

The ops register for every device: CUDA tensors normally, CPU tensors when
the kernels run in Triton's interpreter (:mod:`flashtile.triton`).
"""

from __future__ import annotations

import contextlib

import torch

from . import launch

_VARIANTS = (
    "Tensor? alibi_slopes, Tensor? kv_lengths, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, float scale, int window_left, int window_right, "
    "float? softcap"
)
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_VARIANTS}) -> (Tensor, Tensor)"
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_VARIANTS}) "
    f"-> (Tensor, Tensor, Tensor)"
)
_DECODE_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
    "int num_splits, Tensor? alibi_slopes, float scale, int window_left, int window_right, "
    "float? softcap) -> (Tensor, Tensor)"
)


def _on(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _variants(alibi, kv_lengths, cu_q, cu_k, max_q, max_k, scale, left, right, softcap):
    return launch.Variants(scale, left, right, softcap, alibi, kv_lengths, cu_q, cu_k, max_q, max_k)


@torch.library.custom_op("flashtile::triton_attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(q, k, v, *variants):
    """``(out, lse)`` of the forward kernel (see the module docstring)."""
    with _on(q):
        return launch.forward(q, k, v, _variants(*variants))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, *variants):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashtile::triton_attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(dout, q, k, v, out, lse, *variants):
    """``(dq, dk, dv)`` of the backward kernels (probabilities recomputed from ``lse``)."""
    # dout arrives with any strides (an expanded gradient has stride 0).
    dout = dout.contiguous()
    with _on(q):
        return launch.backward(dout, q, k, v, out, lse.contiguous(), _variants(*variants))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, *variants):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *variants = inputs
    out, lse = output
    # Only O(T) state is kept: the backward recomputes the score tiles from lse.
    ctx.save_for_backward(q, k, v, out, lse, *variants[:4])
    ctx.args = tuple(variants[4:])
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtile.triton_attention_bwd(
        dout, q, k, v, out, lse, *tensors, *ctx.args
    )
    return (dq, dk, dv) + (None,) * 10


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flashtile.triton.attention has no double backward (create_graph=True through its "
        "gradients); use torch.nn.functional.scaled_dot_product_attention for "
        "higher-order gradients"
    )


attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("flashtile::triton_decode", mutates_args=(), schema=_DECODE_SCHEMA)
def decode(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, alibi, scale, left,
           right, softcap):  # fmt: skip
    """``(out, lse)`` of the split-KV decoding kernels."""
    var = launch.Variants(scale, left, right, softcap, alibi)
    with _on(q):
        return launch.decode(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, var)


@decode.register_fake
def _decode_fake(q, k_cache, v_cache, *args):
    out = q.new_empty((*q.shape[:3], v_cache.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)

"""The Triton kernels as ``torch.library`` custom ops, with fake and autograd registrations.

Three ops, opaque to the dispatcher, FakeTensor tracing and ``torch.compile``::

    flashtile::triton_attention_fwd(q, k, v, alibi_slopes?, kv_lengths?, cu_seqlens_q?,
        cu_seqlens_k?, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
        softcap?, dropout_p, dropout_seed?, sinks?) -> (out, lse)
    flashtile::triton_attention_bwd(dout, q, k, v, out, lse, sinks?, <the same variants>)
        -> (dq, dk, dv)
    flashtile::triton_decode(q, k_cache, v_cache, cache_seqlens, block_table?, num_splits,
        alibi_slopes?, scale, window_left, window_right, softcap?) -> (out, lse)

``q (B, Hq, Tq, d)``, ``k (B, Hkv, Tk, d)``, ``v (B, Hkv, Tk, dv)`` (packed
sequences: ``B = 1`` and ``cu_seqlens``); ``alibi_slopes (B or 1, Hq)``
float32; ``kv_lengths``/``cu_seqlens``/``cache_seqlens``/``block_table``
int32; ``window_*`` = -1 for an unbounded side (causal is ``window_right =
0``). ``out`` has q's dtype, ``lse`` is float32 ``(B, Hq, Tq)``; ``sinks
(Hq,)`` float32 attention sinks, merged into ``out`` and ``lse``
(:func:`flashtile.merge.add_sinks`). The forward's
autograd formula calls the backward op, which recomputes probabilities from
``lse`` (the formula of :mod:`flashtile.op_autograd`, shared with the CPU
ops; so are the ``torch.vmap`` rules, :mod:`flashtile.op_batching`). Use
:func:`flashtile.triton.attention` and friends, which validate
and lay out the inputs, rather than these ops directly.

The ops register for every device: CUDA tensors normally, CPU tensors when
the kernels run in Triton's interpreter (:mod:`flashtile.triton`).
"""

from __future__ import annotations

import contextlib

import torch

from flashtile import op_autograd, op_batching
from flashtile.merge import add_sinks
from flashtile.precision import LAST_RESORT_TOLERANCE, failing_rows

from . import launch

_VARIANTS = (
    "Tensor? alibi_slopes, Tensor? kv_lengths, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, float scale, int window_left, int window_right, "
    "float? softcap, float dropout_p, Tensor? dropout_seed"
)
# No default for the sinks: the dispatcher would leave it out of the call.
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_VARIANTS}, Tensor? sinks) -> (Tensor, Tensor)"
# The backward's sinks come before the variants: inductor's generated code
# leaves a trailing None out of the call.
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks, "
    f"{_VARIANTS}) -> (Tensor, Tensor, Tensor)"
)
_DECODE_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
    "int num_splits, Tensor? alibi_slopes, float scale, int window_left, int window_right, "
    "float? softcap) -> (Tensor, Tensor)"
)


def on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def kernel_args(
    alibi, kv_lengths, cu_q, cu_k, max_q, max_k, scale, left, right, softcap, dropout_p, seed
):
    """The :class:`.launch.KernelArgs` of the ops' variant arguments (schema order)."""
    # The kernels index lengths and offsets densely (no strides passed for them).
    kv_lengths, cu_q, cu_k = (
        None if t is None else t.contiguous() for t in (kv_lengths, cu_q, cu_k)
    )
    # The seed (0-d), or [seed, offset] (int64 words; a CPU tensor: no device sync).
    words = [0] if seed is None else [int(x) for x in seed.reshape(-1).tolist()]
    seed, offset = words[0] % (1 << 64), (words[1] if len(words) > 1 else 0)
    return launch.KernelArgs(
        scale, left, right, softcap, alibi, kv_lengths, cu_q, cu_k, max_q, max_k, dropout_p, seed,
        offset,
    )  # fmt: skip


@torch.library.custom_op("flashtile::triton_attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(q, k, v, *variants):
    """``(out, lse)`` of the forward kernel (see the module docstring), with
    the attention sinks (the last argument) merged in."""
    *variants, sinks = variants  # the callers pass every argument
    with on_device(q):
        out, lse = launch.forward(q, k, v, kernel_args(*variants))
    if sinks is None:
        return out, lse
    return add_sinks(torch, out, lse, sinks)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, *variants):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashtile::triton_attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(dout, q, k, v, out, lse, sinks, *variants):
    """``(dq, dk, dv)`` of the backward kernels (probabilities recomputed from
    ``lse``, which includes the sinks), NaN where the precision rule fails
    (:func:`poisoned`)."""
    # dout arrives with any strides (an expanded gradient has stride 0).
    dout = dout.contiguous()
    with on_device(q):
        *grads, sums = launch.backward(dout, q, k, v, out, lse.contiguous(), kernel_args(*variants))
        return poisoned(grads, sums, lse, dout, sinks)


def poisoned(grads, sums, lse, dout, sinks) -> tuple:
    """``grads`` (fresh tensors, filled in place: ``dq, dk, dv`` then any
    captured tables'), NaN for every batch entry of ``dq, dk, dv`` (the
    whole call for a packed batch, and for the tables) where a row with a nonzero
    ``dout`` fails the backward's precision rule
    (:func:`flashtile.precision.failing_rows`, at
    :data:`~flashtile.precision.LAST_RESORT_TOLERANCE`). The CPU backward
    computes such calls again in float64 or refuses; on a GPU that would mean
    waiting for it on every backward (a host sync), and its kernels have no
    float64: NaN gradients, decided on the device, are what a training
    loop's NaN checks (or ``torch.autograd.detect_anomaly``) catch, instead
    of wrong numbers that nothing would. Per batch entry, so that under
    ``vmap`` one sample's failure is its own."""
    rows = failing_rows(torch, sums, lse, sinks, LAST_RESORT_TOLERANCE) & (dout != 0).any(-1)
    entries = rows.reshape(rows.shape[0], -1).any(1)  # (B,)
    whole = entries.any()
    for n, g in enumerate(grads):
        if g is None:
            continue
        per_entry = n < 3 and g.ndim == rows.ndim + 1 and g.shape[0] == entries.shape[0]
        bad = entries.view(-1, *([1] * (g.ndim - 1))) if per_entry else whole
        g.masked_fill_(bad, float("nan"))
    return tuple(grads)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


#: The forward and backward ops as :mod:`flashtile.op_autograd` takes them: their
#: autograd formula, and under ``torch.func`` :class:`flashtile.op_autograd.FuncAttention`.
OPS = op_autograd.Operators(attention_fwd, attention_bwd, "flashtile.triton.attention")
op_autograd.register(OPS)
_VARIANT_ARGS = (
    op_batching.constant("alibi_slopes", 2), op_batching.constant("kv_lengths", 1),
    op_batching.Arg("cu_seqlens_q", "packed"), op_batching.Arg("cu_seqlens_k", "packed"),
    *(op_batching.Arg(n) for n in ("max_seqlen_q", "max_seqlen_k", "scale", "left", "right")),
    op_batching.Arg("softcap"), op_batching.Arg("dropout_p"),
    op_batching.refused("dropout_seed", "dropout"),
)  # fmt: skip
op_batching.register(
    attention_fwd,
    (*map(op_batching.query, "qkv"), *_VARIANT_ARGS, op_batching.shared("sinks")),
    q_at=0,
)
op_batching.register(
    attention_bwd,
    (
        *map(op_batching.query, ("dout", "q", "k", "v", "out")), op_batching.query("lse", 3),
        op_batching.shared("sinks"), *_VARIANT_ARGS,
    ),
    q_at=1,
)  # fmt: skip


@torch.library.custom_op("flashtile::triton_decode", mutates_args=(), schema=_DECODE_SCHEMA)
def decode(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, alibi, scale, left,
           right, softcap):  # fmt: skip
    """``(out, lse)`` of the split-KV decoding kernels."""
    var = launch.KernelArgs(scale, left, right, softcap, alibi)
    with on_device(q):
        return launch.decode(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, var)


@decode.register_fake
def _decode_fake(q, k_cache, v_cache, *args):
    out = q.new_empty((*q.shape[:3], v_cache.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)

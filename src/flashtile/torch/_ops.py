"""The two torch operators, ``flashtile::attention_fwd`` and ``flashtile::attention_bwd``.

Both are registered with :func:`torch.library.custom_op`, so the dispatcher,
autograd, FakeTensor tracing and ``torch.compile`` all see one opaque op
each, never the NumPy/Numba code inside. Each has a fake (shape-only)
implementation for tracing, and the forward has an autograd formula that
calls the backward op, so a compiled training step traces both.

Schemas (``window_left``/``window_right`` = -1 mean unbounded; ``scale`` and
``softcap`` None mean ``1/sqrt(d)`` and no cap; ``kv_lengths`` None means
every key is valid; ``dropout_seed`` is a 0-d int64 tensor, given when
``dropout_p > 0``; ``sinks (Hq,)`` the attention sinks)::

    attention_fwd(q, k, v, mask?, alibi_slopes?, causal, scale?, window_left,
                  window_right, softcap?, kv_lengths?, dropout_p, dropout_seed?,
                  sinks?) -> (out, lse)
    attention_bwd(dout, q, k, v, out, lse, sinks?, mask?, alibi_slopes?, causal,
                  scale?, window_left, window_right, softcap?, kv_lengths?,
                  dropout_p, dropout_seed?) -> (dq, dk, dv)

The forward merges the sinks into ``out`` and ``lse``; the backward's ``P =
exp(S - lse)`` then includes the sink's column, and it reads the sinks only
for the precision rule (:mod:`flashtile.gradients`: the sums a row's ``P``
must reach, and a float64 recomputation); the sinks' own gradient is
:mod:`flashtile.op_autograd`'s.

``q (B, Hq, Tq, d)``, ``k (B, Hkv, Tk, d)``, ``v (B, Hkv, Tk, dv)`` (or the same
without ``B``) must be CPU float32, float64 or bfloat16; ``out`` is ``(..., Tq,
dv)`` in the same dtype and ``lse`` ``(..., Tq)`` in the accumulation dtype
(float32 for bfloat16). bfloat16 tensors reach the kernels without a copy (as
``ml_dtypes.bfloat16`` views of their memory). ``mask`` is bool (True = keep) or
float (added to the scores), broadcastable to ``(..., Hq, Tq, Tk)``;
``kv_lengths (B,)`` integer valid keys per batch entry. Outputs are always
fresh tensors: the kernels write into new NumPy buffers that
``torch.from_numpy`` wraps without a copy.

:func:`forward` and :func:`backward` are the ops' implementations. In eager
mode (nothing to trace or intercept) :func:`flashtile.torch.attention` calls
:func:`forward` directly when no gradient is wanted, which saves the
dispatcher's cost (about 12 us a call), and :class:`EagerAttention` (the
same autograd formula as an ``autograd.Function``) when one is. A plain
call (no mask, slopes or window, a native dtype) without a gradient skips
:func:`forward` too and runs the kernels itself
(:func:`flashtile.torch._attention._plain_eager`).

Use :func:`flashtile.torch.attention` rather than these ops directly: it
checks devices and dtypes, handles float16/bfloat16 and GQA the way SDPA does,
and gives clearer errors.
"""

import numpy as np
import torch

import flashtile
from flashtile import op_autograd, op_batching

from .arrays import as_numpy, as_tensor

# No defaults: the dispatcher leaves trailing defaulted arguments out of the
# implementation's call, which would shift the sinks (the forward's last).
_VARIANTS = (
    "Tensor? mask, Tensor? alibi_slopes, bool causal, float? scale, int window_left, "
    "int window_right, float? softcap, Tensor? kv_lengths, float dropout_p, "
    "Tensor? dropout_seed"
)
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_VARIANTS}, Tensor? sinks) -> (Tensor, Tensor)"
# The backward's sinks come before the variants: inductor's generated code
# leaves a trailing None out of the call.
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks, "
    f"{_VARIANTS}) -> (Tensor, Tensor, Tensor)"
)
#: dtypes the ops take; flashtile.torch.attention upcasts float16 first.
NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _check_native(q: torch.Tensor) -> None:
    if q.dtype not in NATIVE_DTYPES:
        raise TypeError(
            f"flashtile::attention ops take float32, float64 or bfloat16 tensors, got "
            f"{q.dtype}: call flashtile.torch.attention, which upcasts float16"
        )


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float32 if q.dtype == torch.bfloat16 else q.dtype


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    """A NumPy view of a CPU tensor (no copy; strided views stay strided).

    flashtile copies to a contiguous buffer only when an array is not already
    one, so a contiguous tensor is never copied here or there. NumPy has no
    bfloat16, so 16-bit masks and slopes are widened to float32 first.
    """
    if t is None:
        return None
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _variants(
    mask, alibi_slopes, window_left, window_right, softcap, kv_lengths, dropout_p, dropout_seed,
    sinks=None,
) -> dict:  # fmt: skip
    """The flashtile keywords for the op's variant arguments (only those in use)."""
    kw = {}
    if mask is not None:
        kw["mask"] = _np(mask)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = _np(alibi_slopes)
    if window_left >= 0 or window_right >= 0:
        kw["window"] = (window_left, window_right)
    if softcap is not None:
        kw["softcap"] = softcap
    if kv_lengths is not None:
        kw["kv_lengths"] = kv_lengths.numpy()
    if dropout_p > 0.0:
        kw["dropout_p"], kw["dropout_seed"] = dropout_p, int(dropout_seed)
    if sinks is not None:
        kw["sinks"] = _np(sinks)
    return kw


def forward(q, k, v, mask, alibi_slopes, causal, scale, *variants):
    """``(out, lse)`` from :func:`flashtile.attention` (see the module docstring);
    ``variants``: the schema's arguments from ``window_left`` on."""
    _check_native(q)
    kw = _variants(mask, alibi_slopes, *variants)
    out, lse = flashtile.attention(
        as_numpy(q), as_numpy(k), as_numpy(v), causal=causal, scale=scale, return_lse=True, **kw
    )
    return as_tensor(out), as_tensor(lse)


@torch.library.custom_op(
    "flashtile::attention_fwd", mutates_args=(), device_types="cpu", schema=_FWD_SCHEMA
)
def attention_fwd(q, k, v, *variants):
    """``(out, lse)``: :func:`forward`."""
    return forward(q, k, v, *variants)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, *variants):
    _check_native(q)
    # new_empty is contiguous, as the real outputs are (strides must match).
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op(
    "flashtile::attention_bwd", mutates_args=(), device_types="cpu", schema=_BWD_SCHEMA
)
def attention_bwd(dout, q, k, v, out, lse, *variants):
    """``(dq, dk, dv)``: :func:`backward`."""
    return backward(dout, q, k, v, out, lse, *variants)


def backward(dout, q, k, v, out, lse, sinks, mask, alibi_slopes, causal, scale, *variants):
    """``(dq, dk, dv)`` from :func:`flashtile.attention_backward` (score tiles
    recomputed; ``out`` and ``lse`` include the sinks; their gradient, which
    that also returns, is :mod:`flashtile.op_autograd`'s)."""
    _check_native(q)
    kw = _variants(mask, alibi_slopes, *variants, sinks)
    grads = flashtile.attention_backward(
        *(as_numpy(t) for t in (q, k, v, out)), _np(lse), as_numpy(dout), causal=causal,
        scale=scale, **kw,
    )  # fmt: skip
    return tuple(as_tensor(g) for g in grads[:3])


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, *rest):
    _check_native(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


#: The two ops as :mod:`flashtile.op_autograd` takes them.
OPS = op_autograd.Operators(attention_fwd, attention_bwd, "flashtile.torch.attention")
op_autograd.register(OPS)
_MASK, _SLOPES, _LENGTHS = (
    op_batching.constant("mask", 4), op_batching.constant("alibi_slopes", 2),
    op_batching.constant("kv_lengths", 1),
)  # fmt: skip
_SCALARS = tuple(
    op_batching.Arg(n) for n in ("causal", "scale", "window_left", "window_right", "softcap")
)
_DROPOUT = (op_batching.Arg("dropout_p"), op_batching.refused("dropout_seed", "dropout"))
op_batching.register(
    attention_fwd,
    (
        *map(op_batching.query, "qkv"), _MASK, _SLOPES, *_SCALARS, _LENGTHS, *_DROPOUT,
        op_batching.shared("sinks"),
    ),
    q_at=0,
)  # fmt: skip
op_batching.register(
    attention_bwd,
    (
        *map(op_batching.query, ("dout", "q", "k", "v", "out")), op_batching.query("lse", 3),
        op_batching.shared("sinks"), _MASK, _SLOPES, *_SCALARS, _LENGTHS, *_DROPOUT,
    ),
    q_at=1,
)  # fmt: skip


class EagerAttention(torch.autograd.Function):
    """The forward op's autograd formula without the dispatcher, for eager CPU
    training (plain tensors, nothing tracing or intercepting: the caller's
    test). The same formula (:mod:`flashtile.op_autograd`); the backward
    runs :func:`backward` directly unless a graph is recorded
    (``create_graph=True``: then the backward op, which refuses a double
    backward) or something intercepts it. This skips the custom op's Python
    layers, about 100 us of a small call's forward and backward."""

    @staticmethod
    def forward(ctx, *args):
        output = forward(*args)
        op_autograd.setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        direct = (
            not torch.is_grad_enabled()
            and type(dout) is torch.Tensor
            and nothing_intercepts()
            and not _legacy_batched(dout)
        )
        return op_autograd.gradients(ctx, dout, backward if direct else attention_bwd)


def _legacy_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a batched tensor of ``torch._vmap_internals.vmap`` (gradcheck's
    ``check_batched_grad``), which no torch.func test sees: the backward op's
    batching fallback then runs it one entry at a time. (functorch's own
    test: reading the tensor's dispatch keys as a string cost a small
    training step 14 us.)"""
    return torch._C._functorch.is_legacy_batchedtensor(t)


def nothing_intercepts() -> bool:
    """Whether no recorder or interceptor of ops is active (``torch.compile``,
    ``torch.jit.trace``, a dispatch mode such as FakeTensorMode or a FLOP
    counter, a ``torch.func`` transform): only then may a call skip the
    dispatcher (the eager paths)."""
    # torch.jit.is_tracing() and _get_current_dispatch_mode() read these same
    # two C functions through a Python layer each: a decoding step runs this
    # between a model's layers, with Python's code cold, where that layer
    # costs about 15 us per call.
    return (
        not torch.compiler.is_compiling()
        and not torch._C._is_tracing()
        and torch._C._len_torch_dispatch_stack() == 0
        and not op_autograd.functorch_active()  # vmap's batched tensors have no storage
    )

"""The two torch operators, ``flashtile::attention_fwd`` and ``flashtile::attention_bwd``.

Both are registered with :func:`torch.library.custom_op`, so the dispatcher,
autograd, FakeTensor tracing and ``torch.compile`` all see one opaque op
each, never the NumPy/Numba code inside. Each has a fake (shape-only)
implementation for tracing, and the forward has an autograd formula that
calls the backward op, so a compiled training step traces both.

Schemas (``window_left``/``window_right`` = -1 mean unbounded; ``scale`` and
``softcap`` None mean ``1/sqrt(d)`` and no cap; ``kv_lengths`` None means
every key is valid)::

    attention_fwd(q, k, v, mask?, alibi_slopes?, causal, scale?, window_left,
                  window_right, softcap?, kv_lengths?) -> (out, lse)
    attention_bwd(dout, q, k, v, out, lse, mask?, alibi_slopes?, causal, scale?,
                  window_left, window_right, softcap?, kv_lengths?) -> (dq, dk, dv)

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
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

import flashtile

from .arrays import as_numpy, as_tensor

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? alibi_slopes, bool causal, "
    "float? scale, int window_left, int window_right, float? softcap, Tensor? kv_lengths=None) "
    "-> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
    "Tensor? alibi_slopes, bool causal, float? scale, int window_left, int window_right, "
    "float? softcap, Tensor? kv_lengths=None) -> (Tensor, Tensor, Tensor)"
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


def _variants(mask, alibi_slopes, window_left, window_right, softcap, kv_lengths) -> dict:
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
    return kw


def forward(
    q, k, v, mask, alibi_slopes, causal, scale, window_left, window_right, softcap, kv_lengths
):
    """``(out, lse)`` from :func:`flashtile.attention` (see the module docstring)."""
    _check_native(q)
    kw = _variants(mask, alibi_slopes, window_left, window_right, softcap, kv_lengths)
    out, lse = flashtile.attention(
        as_numpy(q), as_numpy(k), as_numpy(v), causal=causal, scale=scale, return_lse=True, **kw
    )
    return as_tensor(out), as_tensor(lse)


@torch.library.custom_op(
    "flashtile::attention_fwd", mutates_args=(), device_types="cpu", schema=_FWD_SCHEMA
)
def attention_fwd(
    q, k, v, mask, alibi_slopes, causal, scale, window_left, window_right, softcap, kv_lengths=None
):
    """``(out, lse)``: :func:`forward`."""
    return forward(
        q, k, v, mask, alibi_slopes, causal, scale, window_left, window_right, softcap, kv_lengths
    )


@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, mask, alibi_slopes, causal, scale, window_left, window_right, softcap, kv_lengths=None
):
    _check_native(q)
    # new_empty is contiguous, as the real outputs are (strides must match).
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op(
    "flashtile::attention_bwd", mutates_args=(), device_types="cpu", schema=_BWD_SCHEMA
)
def attention_bwd(
    dout, q, k, v, out, lse, mask, alibi_slopes, causal, scale, window_left, window_right, softcap,
    kv_lengths=None,
):  # fmt: skip
    """``(dq, dk, dv)``: :func:`backward`."""
    return backward(
        dout, q, k, v, out, lse, mask, alibi_slopes, causal, scale, window_left, window_right,
        softcap, kv_lengths,
    )  # fmt: skip


def backward(
    dout, q, k, v, out, lse, mask, alibi_slopes, causal, scale, window_left, window_right, softcap,
    kv_lengths,
):  # fmt: skip
    """``(dq, dk, dv)`` from :func:`flashtile.attention_backward` (score tiles recomputed)."""
    _check_native(q)
    kw = _variants(mask, alibi_slopes, window_left, window_right, softcap, kv_lengths)
    grads = flashtile.attention_backward(
        *(as_numpy(t) for t in (q, k, v, out)), _np(lse), as_numpy(dout), causal=causal,
        scale=scale, **kw,
    )  # fmt: skip
    return tuple(as_tensor(g) for g in grads)


@attention_bwd.register_fake
def _attention_bwd_fake(
    dout, q, k, v, out, lse, mask, alibi_slopes, causal, scale, window_left, window_right, softcap,
    kv_lengths=None,
):  # fmt: skip
    _check_native(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, alibi_slopes, causal, scale, window_left, window_right, softcap, lengths = inputs
    out, lse = output
    # Only O(T) state is kept: the backward recomputes score tiles from lse.
    ctx.save_for_backward(q, k, v, out, lse, mask, alibi_slopes, lengths)
    ctx.args = (causal, scale, window_left, window_right, softcap)
    # lse is returned for inspection and merging, not for differentiating.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse, bwd=None):
    """The forward's gradients through ``bwd``: the backward op, or (eager, no
    graph to record) its implementation :func:`backward`."""
    q, k, v, out, lse, mask, alibi_slopes, lengths = ctx.saved_tensors
    bwd = torch.ops.flashtile.attention_bwd if bwd is None else bwd
    dq, dk, dv = bwd(dout, q, k, v, out, lse, mask, alibi_slopes, *ctx.args, lengths)
    # No gradients for the mask, slopes, lengths and the non-tensor arguments.
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flashtile.torch.attention has no double backward (create_graph=True through its "
        "gradients); use torch.nn.functional.scaled_dot_product_attention for "
        "higher-order gradients"
    )


attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


class EagerAttention(torch.autograd.Function):
    """The forward op's autograd formula without the dispatcher, for eager CPU
    training (plain tensors, nothing tracing or intercepting: the caller's
    test). The same :func:`_setup_context` and :func:`_backward`; the backward
    runs :func:`backward` directly unless a graph is recorded
    (``create_graph=True``: then the backward op, which refuses a double
    backward) or something intercepts it. This skips the custom op's Python
    layers, about 100 us of a small call's forward and backward."""

    @staticmethod
    def forward(ctx, *args):
        output = forward(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        direct = (
            not torch.is_grad_enabled()
            and type(dout) is torch.Tensor
            and nothing_intercepts()
            and not _legacy_batched(dout)
        )
        return _backward(ctx, dout, dlse, backward if direct else None)


#: Whether a torch.func transform (vmap, grad, ...) is running (False where torch lacks the test).
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


#: The refusal of forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad).
NO_FORWARD_AD = (
    "flashtile.torch.attention has no forward-mode AD (torch.func.jvp, jacfwd, "
    "torch.autograd.forward_ad dual tensors): use reverse mode (torch.func.grad, vjp, jacrev), "
    "or torch.nn.functional.scaled_dot_product_attention for forward-mode derivatives"
)


def has_tangent(*tensors) -> bool:
    """Whether a ``torch.autograd.forward_ad`` dual level is open and one of the
    tensors carries a tangent (which the operator would otherwise drop)."""
    if forward_ad._current_level < 0:  # the common case: no dual level
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


class FuncAttention(torch.autograd.Function):
    """The forward op's autograd formula for ``torch.func`` transforms (``grad``,
    ``vjp``, ``jacrev``, ``vmap`` of those: per-sample gradients). The
    custom op's own autograd cannot run under them (torch builds it without
    the ``setup_context`` that functorch needs), so under a transform
    :func:`flashtile.torch.attention` applies this instead: the same ops
    (``vmap`` reaches their batching rules, :mod:`._batching`), the same
    :func:`_setup_context` and :func:`_backward`. Forward-mode AD
    (``jvp``, ``jacfwd``) is refused with a clear error."""

    generate_vmap_rule = True  # vmap runs forward/backward over the ops' own rules

    @staticmethod
    def forward(*args):
        return torch.ops.flashtile.attention_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, FuncAttentionBackward.apply)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(NO_FORWARD_AD)


def _legacy_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a batched tensor of ``torch._vmap_internals.vmap`` (gradcheck's
    ``check_batched_grad``), which no torch.func test sees: the backward op's
    batching fallback then runs it one entry at a time."""
    # Python has no name for that dispatch key (only FuncTorchBatched): read its set.
    keys = str(torch._C._dispatch_keys(t)).removeprefix("DispatchKeySet(").removesuffix(")")
    return "Batched" in keys.split(", ")


class FuncAttentionBackward(torch.autograd.Function):
    """The backward op under ``torch.func`` (:class:`FuncAttention`): its own
    autograd refuses a second derivative, as the op's does."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return torch.ops.flashtile.attention_bwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_no_double_backward)


def nothing_intercepts() -> bool:
    """Whether no recorder or interceptor of ops is active (``torch.compile``,
    ``torch.jit.trace``, a dispatch mode such as FakeTensorMode or a FLOP
    counter, a ``torch.func`` transform): only then may a call skip the
    dispatcher (the eager paths)."""
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and _get_current_dispatch_mode() is None
        and not functorch_active()  # vmap's batched tensors have no storage to read
    )

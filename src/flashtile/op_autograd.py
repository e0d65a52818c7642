"""The one autograd formula of flashtile's attention operators, for both backends.

Each backend registers a pair of torch operators of one convention::

    forward(q, k, v, *variants, sinks) -> (out, lse)
    backward(dout, q, k, v, out, lse, sinks, *variants) -> (dq, dk, dv)

The attention sinks ``(Hq,)`` (or None) are merged into ``out`` and ``lse``
by the forward: the backward's ``P = exp(S -
lse)`` already includes the sink's column (the CPU backward reads the sinks
for its precision rule only), and the sinks' own gradient is
:func:`flashtile.merge.sink_gradient`, computed here in torch.

(``flashtile::attention_fwd``/``_bwd`` on the CPU kernels, ``flashtile::
triton_attention_fwd``/``_bwd`` on the Triton kernels). :func:`register`
gives a pair its autograd: the forward keeps only ``q, k, v, out, lse`` and
the variant arguments (O(T) state: the backward recomputes score tiles from
``lse``), ``lse`` carries no gradient, the variants get none but the sinks,
and a second derivative is refused. :class:`FuncAttention` is the same formula for
``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, and ``vmap`` over
them), under which an operator's own autograd cannot run (torch builds it
without the ``setup_context`` that functorch needs); forward-mode AD is
refused there with :data:`NO_FORWARD_AD`.

Importing this module imports torch; ``import flashtile`` does not import it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd import forward_ad

from .merge import sink_gradient


class Operators(NamedTuple):
    """A backend's forward and backward operators and the function named in errors."""

    forward: object
    backward: object
    name: str


#: Whether a torch.func transform (vmap, grad, ...) is running (False where torch lacks the test).
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def has_tangent(*tensors) -> bool:
    """Whether a ``torch.autograd.forward_ad`` dual level is open and one of the
    tensors carries a tangent (which an operator would otherwise drop)."""
    if forward_ad._current_level < 0:  # the common case: no dual level
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def wants_grad(q, k, v, sinks=None) -> bool:
    """Whether autograd will want gradients of an attention call of these
    tensors (``sinks``: learned sinks, or None): both backends' routing reads
    it (a decoding step without gradients may take another kernel)."""
    learned = isinstance(sinks, torch.Tensor) and sinks.requires_grad
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or learned
    )


#: The refusal of forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad).
NO_FORWARD_AD = (
    "flashtile's attention has no forward-mode AD (torch.func.jvp, jacfwd, "
    "torch.autograd.forward_ad dual tensors): use reverse mode (torch.func.grad, vjp, jacrev), "
    "or torch.nn.functional.scaled_dot_product_attention for forward-mode derivatives"
)


def dropout_seed() -> torch.Tensor:
    """A dropout seed for both backends' ops (:mod:`flashtile.dropout`): drawn
    from torch's default CPU generator, so ``torch.manual_seed`` reproduces a
    call, as a 0-d int64 tensor, so ``torch.compile`` traces the draw instead
    of breaking the graph."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


def setup_context(ctx, inputs, output) -> None:
    """Save what the backward reads: ``q, k, v, out, lse`` and the variant
    arguments (tensors saved, the rest kept as they are)."""
    out, lse = output
    variants = inputs[3:]
    tensors = tuple(x if isinstance(x, torch.Tensor) else None for x in variants)
    ctx.save_for_backward(*inputs[:3], out, lse, *tensors)
    ctx.others = tuple(None if isinstance(x, torch.Tensor) else x for x in variants)
    # lse is returned for inspection and merging, not for differentiating.
    ctx.mark_non_differentiable(lse)


def gradients(ctx, dout, backward) -> tuple:
    """The forward's gradients from :func:`setup_context`'s ``ctx`` through
    ``backward`` (the backward operator, or its implementation): ``dq, dk,
    dv``, None for every variant argument and the sinks' gradient."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    *variants, sinks = [t if x is None else x for t, x in zip(tensors, ctx.others, strict=True)]
    dq, dk, dv = backward(dout, q, k, v, out, lse, sinks, *variants)
    dsinks = None
    if sinks is not None:
        dsinks = sink_gradient(torch, out, lse, dout, sinks).to(sinks.dtype)
    return (dq, dk, dv) + (None,) * len(variants) + (dsinks,)


def register(ops: Operators) -> None:
    """Give ``ops.forward`` the autograd formula above (through ``ops.backward``)
    and ``ops.backward`` a refusal of second derivatives."""

    def backward(ctx, dout, _dlse):
        return gradients(ctx, dout, ops.backward)

    def no_double_backward(ctx, *grads):
        raise RuntimeError(double_backward_refusal(ops.name))

    ops.forward.register_autograd(backward, setup_context=setup_context)
    ops.backward.register_autograd(
        no_double_backward, setup_context=lambda ctx, inputs, output: None
    )


def double_backward_refusal(name: str) -> str:
    return (
        f"{name} has no double backward (create_graph=True through its gradients); use "
        f"torch.nn.functional.scaled_dot_product_attention for higher-order gradients"
    )


class FuncAttention(torch.autograd.Function):
    """:func:`register`'s formula for ``torch.func`` transforms:
    ``FuncAttention.apply(ops, q, k, v, *variants)`` with ``ops`` an
    :class:`Operators`. ``vmap`` over it reaches the operators' own batching
    rules (``generate_vmap_rule``), so per-sample gradients are one backward
    call."""

    generate_vmap_rule = True

    @staticmethod
    def forward(ops, *args):
        return ops.forward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ops = inputs[0]
        setup_context(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, dout, dlse):
        ops = ctx.ops
        return (None,) + gradients(ctx, dout, lambda *a: FuncBackward.apply(ops, *a))

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(NO_FORWARD_AD)


def _run_backward(ops, *args):
    return ops.backward(*args)


def _keep_name(ctx, inputs, output):
    ctx.name = inputs[0].name


def _refuse_second(ctx, *grads):
    raise RuntimeError(double_backward_refusal(ctx.name))


class FuncBackward(torch.autograd.Function):
    """The backward operator under ``torch.func`` (:class:`FuncAttention`):
    ``FuncBackward.apply(ops, dout, q, k, v, out, lse, *variants)``; its own
    autograd refuses a second derivative, as the operator's does."""

    generate_vmap_rule = True
    forward = staticmethod(_run_backward)
    setup_context = staticmethod(_keep_name)
    backward = staticmethod(_refuse_second)

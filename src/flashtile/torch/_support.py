"""Which calls :func:`flashtile.torch.attention` runs, and why not: the one rule.

:func:`refusal` returns None for a call the operator computes, or a
:class:`Refusal`: the exception type and message the operator raises for it.
The operator raises exactly that; the SDPA router (:mod:`.routing`) passes a
call it would route on to SDPA with that message as its reason. Both read
this one function, so they cannot disagree about what flashtile supports.

The rule covers what the torch layer decides: types, devices, dtypes, ranks,
heads, sizes, flags, ``scale``, ``window``, the kind of the mask and slopes
(plain tensors, no gradient wanted) and the mask's broadcasting. A call whose
q, k and v are all CUDA tensors (:func:`is_cuda_call`) is the Triton kernels'
(:mod:`flashtile.triton`): for it the rule adds their own metadata checks
(:func:`flashtile.triton.checks.check_gpu_call`: no float64, head dims up to
256, no ``mask``, one device) and refuses it when Triton cannot be imported.
Anything else off the CPU (a CPU/CUDA mix, meta tensors) is refused. The
kernels' own validation still refuses bad values inside an accepted argument
(NaN in a float mask, slopes of the wrong length, a negative ``softcap``) with
a ValueError; the router never passes slopes or softcap, and reading a mask's
values here would cost a pass over it.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from .. import op_autograd
from .._validate import check_sdpa_layout
from ..dropout import check_dropout
from ..masks import normalize_window
from ..op_autograd import NO_FORWARD_AD
from ..variants import sinks_problem

#: Input dtypes accepted; 16-bit floats are computed in float32.
ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Refusal(NamedTuple):
    """Why flashtile cannot run a call: what the operator raises."""

    error: type[Exception]  # ValueError or TypeError; ImportError for a GPU without Triton,
    # NotImplementedError for forward-mode AD dual tensors
    message: str

    def exception(self) -> Exception:
        return self.error(self.message)


def as_constant(t) -> torch.Tensor | None:
    """A mask or slopes argument as a tensor (NumPy arrays and lists are a convenience).

    A list of Python floats becomes float64, not torch's default float32, so
    it is not rounded before the kernel sees it; bools and ints keep their kind.
    """
    if t is None or isinstance(t, torch.Tensor):
        return t
    converted = torch.as_tensor(t)
    if isinstance(t, (list, tuple)) and converted.dtype.is_floating_point:
        converted = torch.as_tensor(t, dtype=torch.float64)
    return converted


def _converted(t, name: str) -> torch.Tensor | Refusal:
    """``t`` as a tensor (:func:`as_constant`), or the Refusal when it cannot be one."""
    try:
        return as_constant(t)
    except (TypeError, ValueError, RuntimeError) as exc:
        return Refusal(TypeError, f"{name} cannot be made a tensor: {exc}")


def _device(t: torch.Tensor, name: str, gpu: bool) -> Refusal | None:
    """CPU tensors always; CUDA ones on the GPU path (q, k, v all on CUDA)."""
    if t.is_cpu or (gpu and t.is_cuda):
        return None
    return Refusal(
        ValueError,
        f"{name} is on device {t.device}, but flashtile.torch.attention runs CPU tensors "
        f"(NumPy/Numba kernels) and CUDA tensors (Triton kernels, all of q, k, v on CUDA); "
        f"move the tensors with .cpu() or .cuda()",
    )


def _tensors(q, k, v, gpu: bool) -> Refusal | None:
    """q, k, v: tensors of one accepted dtype, on the CPU unless ``gpu`` (all on CUDA)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return Refusal(
                TypeError,
                f"{name} is a {type(t).__name__}, not a torch.Tensor: flashtile.torch.attention "
                f"takes tensors (use flashtile.attention for NumPy arrays)",
            )
        if refused := _device(t, name, gpu):
            return refused
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in ACCEPTED_DTYPES:
        return Refusal(
            TypeError,
            f"q, k, v must share one floating dtype (float16, bfloat16, float32 or float64), "
            f"got {q.dtype}, {k.dtype}, {v.dtype}",
        )
    return None


def _layout(q, k, v, enable_gqa: bool) -> Refusal | None:
    """Ranks, heads (GQA only when asked for) and sizes: :func:`check_sdpa_layout`."""
    try:
        check_sdpa_layout(q, k, v, enable_gqa=enable_gqa)
    except ValueError as exc:
        return Refusal(ValueError, str(exc))
    return None


def is_cuda_call(q, k, v) -> bool:
    """q, k and v all CUDA tensors: a call for the Triton kernels (the one device test)."""
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    # Spelled out: a generator over the three costs a microsecond a call.
    return tensors and isinstance(v, torch.Tensor) and q.is_cuda and k.is_cuda and v.is_cuda


@functools.cache
def _triton_missing() -> str | None:
    """Why ``flashtile.triton`` cannot be imported here, or None (asked once per process)."""
    try:
        from ..triton import checks  # noqa: F401  (imports torch and triton)
    except ImportError as exc:
        return str(exc)
    return None


def _gpu(q, k, v, mask) -> Refusal | None:
    """What the Triton kernels add to the rule for CUDA calls (their own checks)."""
    if missing := _triton_missing():
        return Refusal(
            ImportError,
            f"q, k, v are CUDA tensors, which run on flashtile's Triton kernels, but Triton "
            f"cannot be imported ({missing}): pip install 'flashtile[gpu]' (PyTorch's CUDA "
            f"wheels include Triton)",
        )
    from ..triton import checks

    try:
        checks.check_gpu_call(q, k, v, mask)
    except (TypeError, ValueError) as exc:
        return Refusal(type(exc), str(exc))
    return None


def _kv_lengths(kv_lengths, qs, gpu: bool) -> Refusal | None:
    """Valid keys per batch entry: ``(B,)`` integers on the CPU (or CUDA on the
    GPU path), for 4-D inputs."""
    if kv_lengths is None:
        return None
    lengths = _converted(kv_lengths, "kv_lengths")
    if isinstance(lengths, Refusal):
        return lengths
    if refused := _device(lengths, "kv_lengths", gpu):
        return refused
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        return Refusal(TypeError, f"kv_lengths must hold integers, got {lengths.dtype}")
    if len(qs) != 4 or tuple(lengths.shape) != (qs[0],):
        return Refusal(
            ValueError,
            f"kv_lengths has shape {tuple(lengths.shape)}; it needs (B, H, T, d) inputs and "
            f"one length per batch entry, (B,) = ({qs[0] if len(qs) == 4 else 'B'},)",
        )
    return None


def _sinks(sinks, qs, gpu: bool) -> Refusal | None:
    """Attention sinks: :func:`flashtile.variants.sinks_problem`'s rule (a
    gradient may be wanted; the values are the kernels' to check)."""
    if sinks is None:
        return None
    t = _converted(sinks, "sinks")
    if isinstance(t, Refusal):
        return t
    if refused := _device(t, "sinks", gpu):
        return refused
    heads = qs[-3] if len(qs) >= 3 else 0
    problem = sinks_problem(t.shape, t.dtype.is_floating_point, heads)
    return None if problem is None else Refusal(ValueError, problem)


def _dropout(dropout_p) -> Refusal | None:
    """``0 <= dropout_p < 1`` (:func:`flashtile.dropout.check_dropout`'s rule)."""
    try:
        check_dropout(dropout_p, 0, 0)
    except (TypeError, ValueError) as exc:
        return Refusal(type(exc), str(exc))
    return None


def _flag(value, name: str) -> Refusal | None:
    if isinstance(value, (bool, np.bool_)):
        return None
    return Refusal(TypeError, f"{name} must be True or False, got {value!r}")


def _number(value, name: str) -> Refusal | None:
    """None or a real number (``bool`` is refused); ``scale`` must also be finite."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Refusal(TypeError, f"{name} must be a real number or None, got {value!r}")
    if name == "scale" and not math.isfinite(value):
        return Refusal(ValueError, f"scale must be finite, got {value}")
    return None


def _window(window) -> Refusal | None:
    try:
        normalize_window(window, False)  # the library's own rule for windows
    except (TypeError, ValueError) as exc:
        return Refusal(type(exc), str(exc))
    return None


def _constant(t, name: str, floating_only: bool, gpu: bool) -> Refusal | None:
    """A mask or slopes argument: convertible, CPU (or CUDA on the GPU path), bool or
    floating, no gradient wanted."""
    if t is None:
        return None
    t = _converted(t, name)
    if isinstance(t, Refusal):
        return t
    if torch.overrides.has_torch_function((t,)):
        # e.g. torch.nn.attention.bias.CausalBias: its values live in
        # __torch_function__, not in its storage, which the kernels would read.
        return Refusal(
            TypeError,
            f"{name} is a {type(t).__name__}, a tensor subclass with its own "
            f"__torch_function__: pass a plain tensor (for a causal bias, causal=True is "
            f"causal_lower_right; causal_upper_left is SDPA's is_causal)",
        )
    if refused := _device(t, name, gpu):
        return refused
    if t.requires_grad and torch.is_grad_enabled():
        return Refusal(
            ValueError,
            f"{name} requires grad, but flashtile computes no gradient for it (it is a constant "
            f"to the kernels): pass {name}.detach() if it is fixed; for a learned bias use "
            f"torch.nn.functional.scaled_dot_product_attention",
        )
    if t.dtype == torch.bool or t.dtype.is_floating_point:
        return None
    return Refusal(
        TypeError, f"{name} must be {'' if floating_only else 'bool or '}floating, got {t.dtype}"
    )


def _mask_shape(mask, q, k) -> Refusal | None:
    """A mask broadcasts to exactly the scores ``(..., Hq, Tq, Tk)`` (it may not enlarge them)."""
    mask = as_constant(mask)
    target = (*q.shape[:-1], k.shape[-2])
    if mask.ndim == 0:
        return Refusal(
            ValueError,
            "mask is a scalar: pass a tensor that broadcasts to (..., Tq, Tk), or "
            "mask=None to keep every key",
        )
    fits = mask.ndim <= len(target) and all(
        m in (1, t) for m, t in zip(reversed(mask.shape), reversed(target), strict=False)
    )
    if fits:
        return None
    return Refusal(
        ValueError,
        f"mask has shape {tuple(mask.shape)}, which does not broadcast to (..., Tq, Tk) = {target}",
    )


def refusal(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    mask=None,
    enable_gqa=False,
    return_lse=False,
    kv_lengths=None,
    dropout_p=0.0,
    sinks=None,
) -> Refusal | None:
    """Why :func:`flashtile.torch.attention` refuses this call, or None when it runs it.

    Takes the operator's arguments (see there). The first problem found is
    returned, in the order the arguments are read: q/k/v, flags, the layout
    (:func:`flashtile._validate.check_sdpa_layout`), for a CUDA call
    (:func:`is_cuda_call`) the Triton kernels' own limits
    (:func:`flashtile.triton.checks.check_gpu_call`, or a missing Triton),
    then the constants (mask, slopes, kv_lengths, sinks), then the numbers
    (scale, softcap, dropout_p) and the window.
    """
    gpu = is_cuda_call(q, k, v)
    return (
        _tensors(q, k, v, gpu)
        or (op_autograd.has_tangent(q, k, v) and Refusal(NotImplementedError, NO_FORWARD_AD))
        or _flag(causal, "causal")
        or _flag(enable_gqa, "enable_gqa")
        or _flag(return_lse, "return_lse")
        or _layout(q, k, v, enable_gqa)
        or (gpu and _gpu(q, k, v, mask))
        or _constant(mask, "mask", floating_only=False, gpu=gpu)
        or (mask is not None and _mask_shape(mask, q, k))
        or _constant(alibi_slopes, "alibi_slopes", floating_only=True, gpu=gpu)
        or _kv_lengths(kv_lengths, q.shape, gpu)
        or _sinks(sinks, q.shape, gpu)
        or _number(scale, "scale")
        or _number(softcap, "softcap")
        or _dropout(dropout_p)
        or _window(window)
        or None
    )

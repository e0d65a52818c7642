"""``flashtile.torch.attention``: the differentiable front door on torch tensors.

It validates like :func:`torch.nn.functional.scaled_dot_product_attention`
does (layout, devices, dtypes, GQA only when asked for), turns the variant
keywords into the op's flat arguments and calls ``flashtile::attention_fwd``
(:mod:`._ops`), whose autograd formula calls ``flashtile::attention_bwd``.
"""

from __future__ import annotations

import numbers

import torch

from ..masks import normalize_window
from . import _ops  # noqa: F401  (registers torch.ops.flashtile.*)

#: Input dtypes accepted; 16-bit floats are computed in float32.
ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}, but flashtile.torch.attention runs on CPU "
            f"tensors only (its kernels are NumPy/Numba); on GPU use "
            f"torch.nn.functional.scaled_dot_product_attention, or move the tensors with "
            f".cpu()"
        )


def _check_qkv(q, k, v, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} is a {type(t).__name__}, not a torch.Tensor: flashtile.torch.attention "
                f"takes tensors (use flashtile.attention for NumPy arrays)"
            )
        _check_device(t, name)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in ACCEPTED_DTYPES:
        raise TypeError(
            f"q, k, v must share one floating dtype (float16, bfloat16, float32 or float64), "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
            f"flashtile.torch.attention takes (B, H, T, d) tensors as SDPA does (or (H, T, d)), "
            f"all with the same rank"
        )
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk == 0 or hq == 0:
        raise ValueError(f"q has {hq} heads and k {hk}: attention needs at least one head each")
    if hk != hv:
        raise ValueError(f"k has {hk} heads but v has {hv}: they must have the same")
    if hq != hk and not enable_gqa:
        raise ValueError(
            f"q has {hq} heads but k and v have {hk}: pass enable_gqa=True for grouped-query "
            f"attention (as torch SDPA requires), or repeat k and v to {hq} heads"
        )
    if hq % hk:
        raise ValueError(f"enable_gqa needs Hq divisible by Hkv, got Hq={hq} and Hkv={hk}")


def _constant_tensor(t, name: str, work: torch.dtype | None) -> torch.Tensor | None:
    """``mask``/``alibi_slopes`` as a CPU tensor; refused if it asks for a gradient
    that grad mode would compute."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        # NumPy arrays and lists (a convenience for slopes). A list of Python
        # floats becomes float64, not torch's default float32, so it is not
        # rounded before the kernel sees it; bools and ints keep their kind.
        converted = torch.as_tensor(t)
        if isinstance(t, (list, tuple)) and converted.dtype.is_floating_point:
            converted = torch.as_tensor(t, dtype=torch.float64)
        t = converted
    _check_device(t, name)
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, but flashtile computes no gradient for it (it is a constant "
            f"to the kernels): pass {name}.detach() if it is fixed; for a learned bias use "
            f"torch.nn.functional.scaled_dot_product_attention"
        )
    if t.dtype == torch.bool:
        return t
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be {'bool or ' if work else ''}floating, got {t.dtype}")
    return t if work is None else t.to(work)  # a float mask adds in the compute dtype


def _optional_float(value, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {value!r}")
    return float(value)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
):
    """Exact attention on CPU torch tensors, differentiable w.r.t. ``q``, ``k``, ``v``.

    A drop-in for SDPA's common uses, computed by flashtile's fused kernels:
    no ``Tq x Tk`` tensor exists, forward or backward. The forward keeps only
    ``q, k, v, out, lse`` for the backward, which recomputes score tiles.
    Works in eager mode, under autograd and under ``torch.compile``
    (``fullgraph=True``): the work happens in the ``flashtile::attention_fwd``
    and ``flashtile::attention_bwd`` custom ops.

    Args:
        q: ``(B, Hq, Tq, d)`` (SDPA layout) or ``(Hq, Tq, d)``.
        k: ``(B, Hkv, Tk, d)``; v: ``(B, Hkv, Tk, dv)``. ``Hkv != Hq`` needs
            ``enable_gqa=True`` and ``Hq % Hkv == 0`` (query head ``h`` reads
            kv head ``h // (Hq // Hkv)``, as in SDPA); k/v are never repeated.
        causal: hide keys after each query, aligned **bottom-right** as in all
            of flashtile: query ``i`` sees key ``j`` iff ``j <= i + Tk - Tq``.
            SDPA's ``is_causal`` is top-left aligned; the two agree when
            ``Tq == Tk`` (:func:`flashtile.torch.route_sdpa` translates).
        scale: score multiplier, default ``1/sqrt(d)``.
        window: ``(left, right)`` sliding window around each query's position;
            None or -1 for an unbounded side.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` ALiBi slopes (tensor, array or list).
        softcap: ``softcap * tanh(score / softcap)`` before masking.
        mask: bool (True = keep) or float (added to the scores, ``-inf`` hides),
            broadcastable to ``(B, Hq, Tq, Tk)``, as SDPA's ``attn_mask``.
        enable_gqa: allow ``Hkv != Hq`` (as SDPA's ``enable_gqa``).
        return_lse: also return ``lse (B, Hq, Tq)``, the natural-log softmax
            normaliser. It carries no gradient (marked non-differentiable).

    Returns:
        ``out (B, Hq, Tq, dv)`` in the input dtype, and ``lse`` if asked. A
        query that sees no key gets a zero row, ``lse = -inf`` and zero
        gradients, never NaN.

    dtypes: float32 and float64 run natively. float16 and bfloat16 inputs are
    upcast to float32, computed, and ``out`` cast back to the input dtype
    (gradients flow back through the casts in the input dtype); ``lse`` stays
    float32. A float mask is cast to the compute dtype.

    Devices: CPU only. Tensors on any other device (CUDA, meta, ...) raise a
    ValueError naming the alternative; there is no silent fallback.

    Gradients: none for ``mask`` and ``alibi_slopes``; passing either with
    ``requires_grad=True`` (a learned bias) while grad mode is on raises a
    ValueError, so a gradient is never dropped silently. Inputs need not be contiguous
    (transposed views are copied once, inside, when not contiguous).
    """
    _check_qkv(q, k, v, enable_gqa)
    if causal not in (True, False):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    in_dtype = q.dtype
    if in_dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    mask = _constant_tensor(mask, "mask", q.dtype)
    alibi_slopes = _constant_tensor(alibi_slopes, "alibi_slopes", None)
    left, right = normalize_window(window, False)  # validates; causal caps it inside
    out, lse = torch.ops.flashtile.attention_fwd(
        q,
        k,
        v,
        mask,
        alibi_slopes,
        bool(causal),
        _optional_float(scale, "scale"),
        left,
        right,
        _optional_float(softcap, "softcap"),
    )
    out = out.to(in_dtype)
    return (out, lse) if return_lse else out

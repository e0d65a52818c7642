"""Input checks of the Triton entry points: errors name the values and the fix.

Shape, dtype and device checks use tensor metadata only (no device sync, so
``torch.compile`` traces them); value checks (lengths within range, offsets
that never decrease, block tables inside the cache) read the small index
tensors on the host once per call.
"""

from __future__ import annotations

import numpy as np
import torch

from flashtile import _validate, op_autograd
from flashtile.variants import sink_values_problem, sinks_problem

from .tiles import INTERPRET

#: Input dtypes the kernels take (float32 accumulation; float64 runs on the CPU path).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The largest head dim (padded inside to a power of two).
MAX_HEAD_DIM = 256


def check_device(t: torch.Tensor, name: str) -> None:
    """CUDA tensors, or CPU tensors when the kernels run in the interpreter."""
    want = "cpu" if INTERPRET else "cuda"
    if t.device.type == want:
        return
    if INTERPRET:
        raise ValueError(
            f"{name} is on {t.device}, but flashtile.triton was imported with TRITON_INTERPRET=1: "
            f"its kernels run in Triton's interpreter on CPU tensors; import it without "
            f"TRITON_INTERPRET for CUDA tensors"
        )
    raise ValueError(
        f"{name} is on {t.device}, but flashtile.triton runs CUDA tensors: for CPU tensors use "
        f"flashtile.torch.attention, or set TRITON_INTERPRET=1 before importing "
        f"flashtile.triton to run these kernels in Triton's interpreter"
    )


def check_kind(t, name: str) -> None:
    """A float16/bfloat16/float32 tensor on the kernels' device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
    check_device(t, name)
    if t.dtype not in DTYPES:
        hint = ": float64 runs on the CPU path (flashtile.torch.attention)"
        raise TypeError(
            f"{name} has dtype {t.dtype}; the Triton kernels take float16, bfloat16 or float32"
            + (hint if t.dtype == torch.float64 else "")
        )


def check_tensor(t, name: str) -> torch.Tensor:
    """:func:`check_kind`, and ``t`` with unit stride on the last dim."""
    check_kind(t, name)
    if t.ndim and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()  # the kernels address the head dim with unit stride
    return t


def check_head_dims(d: int, dv: int) -> None:
    for name, n in (("head dim d", d), ("value head dim dv", dv)):
        if not 1 <= n <= MAX_HEAD_DIM:
            raise ValueError(
                f"{name} = {n}: the Triton kernels take 1 to {MAX_HEAD_DIM} (padded inside to "
                f"a power of two); use the CPU path (flashtile.torch.attention) for larger"
            )


def check_gpu_call(q, k, v, mask=None, names=("q", "k", "v")) -> None:
    """The kernels' limits on an attention call, beyond the shared layout rule
    (:func:`flashtile._validate.check_sdpa_layout`): each of q, k, v a float16,
    bfloat16 or float32 tensor on the kernels' device, one dtype and one
    device for all three, head dims 1 to 256, and no ``mask``.

    Reads metadata only. :func:`flashtile.torch._support.refusal` calls it
    for CUDA calls, so the operator and the SDPA router refuse what these
    kernels refuse, with the same message.
    """
    listed = ", ".join(names)
    for t, name in zip((q, k, v), names, strict=True):
        check_kind(t, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{listed} have dtypes {q.dtype}, {k.dtype}, {v.dtype}: the Triton kernels take one "
            f"dtype (cast q to the others', e.g. q.to({names[1]}.dtype), or all three to one)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{listed} are on {q.device}, {k.device}, {v.device}: move them to one")
    check_head_dims(q.shape[-1], v.shape[-1])
    if mask is not None:
        raise ValueError(
            "flashtile's Triton kernels take no mask: express it with causal, window or "
            "kv_lengths (flashtile.triton.attention), or run the CPU path "
            "(flashtile.torch.attention on CPU tensors) or "
            "torch.nn.functional.scaled_dot_product_attention for an arbitrary mask"
        )


def slopes(alibi_slopes, batch: int, heads: int, device, per_batch_ok: bool):
    """ALiBi slopes ``(Hq,)`` or ``(B, Hq)`` as a float32 ``(B or 1, Hq)`` tensor, or None."""
    if alibi_slopes is None:
        return None
    learned = isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad
    if learned and torch.is_grad_enabled():
        raise ValueError(
            "alibi_slopes requires grad, but flashtile computes no gradient for it: pass "
            "alibi_slopes.detach() if it is fixed"
        )
    s = torch.as_tensor(alibi_slopes).detach()
    if not (s.dtype.is_floating_point or s.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {s.dtype}")
    if s.shape == (heads,):
        s = s[None, :]
    elif not (per_batch_ok and s.shape == (batch, heads)):
        per_batch = f" or (B, Hq) = ({batch}, {heads})" if per_batch_ok else ""
        raise ValueError(
            f"alibi_slopes has shape {tuple(s.shape)}; expected (Hq,) = ({heads},){per_batch}, "
            f"one slope per query head"
        )
    return s.to(device=device, dtype=torch.float32).contiguous()


def sinks(sinks, heads: int, device) -> torch.Tensor | None:
    """Attention sinks ``(Hq,)`` as a float32 tensor on ``device`` (gradients
    flow through the conversion), or None; finite or ``-inf`` values."""
    if sinks is None:
        return None
    s = torch.as_tensor(sinks)
    if problem := sinks_problem(s.shape, s.dtype.is_floating_point, heads):
        raise ValueError(problem)
    # The values need the host: checked in eager mode only (a compiled graph or a
    # torch.func transform cannot read them; NaN there gives NaN rows, never hidden).
    eager = not torch.compiler.is_compiling() and not op_autograd.functorch_active()
    if eager and (problem := sink_values_problem(torch, s)):
        raise ValueError(problem)
    return s.to(device=device, dtype=torch.float32)


def int_tensor(x, name: str, shape: tuple[int, ...], device) -> torch.Tensor:
    """An index tensor (lengths, offsets, block table) as int32 on ``device``."""
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    return t.to(device=device, dtype=torch.int32).contiguous()


def check_range(t: torch.Tensor, name: str, low: int, high: int, why: str) -> None:
    """Every value of ``t`` in ``[low, high]`` (reads ``t`` on the host)."""
    if t.numel() == 0:
        return
    try:
        lo, hi = int(t.min()), int(t.max())
    except RuntimeError as exc:  # a vmapped tensor has no values to read on the host
        raise ValueError(
            f"{name} cannot be range-checked here ({exc}): under torch.vmap pass {name} "
            f"without a vmapped dimension (the CPU operator takes a vmapped one)"
        ) from None
    if lo < low or hi > high:
        raise ValueError(f"{name} must lie in [{low}, {high}] ({why}), got min {lo} and max {hi}")


def check_cu_seqlens(cu: torch.Tensor, name: str, total: int) -> int:
    """Offsets that start at 0, never decrease and end at ``total``
    (:func:`flashtile._validate.check_cu_seqlens`, on a host copy); returns the longest."""
    # tolist, not .numpy(): under torch.func the offsets are wrapped tensors without storage.
    host = _validate.check_cu_seqlens(np.array(cu.tolist()), name, total)
    return int(np.diff(host).max())

"""Rotary position embeddings as flash-attn applies them (``flash_attn.layers.rotary``).

The first ``rotary_dim = 2 * cos.shape[-1]`` channels of each head are
rotated by the angle of the token's position; the rest pass through. Two
pairings, as in flash-attn:

- interleaved (GPT-J): channels ``(2i, 2i + 1)`` form pair ``i``;
- not interleaved (GPT-NeoX): channels ``(i, i + rotary_dim / 2)`` do.

Pair ``i`` at position ``t`` becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``
with ``cos = cos_table[t, i]``. Computed in float32 (float64 for float64
inputs) and rounded back to the input dtype, in plain torch operations, so
autograd differentiates it. A position past the tables raises a
ValueError (flash-attn checks only integer offsets against them).
"""

from __future__ import annotations

import numbers

import torch


def rotate(x: torch.Tensor, cos, sin, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x (..., H, D)`` rotated at ``positions`` (shape ``x.shape[:-2]``, int64).

    ``cos``, ``sin``: ``(seqlen_ro, rotary_dim / 2)``, ``rotary_dim <= D``.
    Returns a new tensor of ``x``'s dtype.
    """
    half = check_tables(cos, sin, x.shape[-1])
    check_positions(positions, cos.shape[0])
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(x.device, work)[positions][..., None, :]  # (..., 1, rotary_dim / 2)
    s = sin.to(x.device, work)[positions][..., None, :]
    head = x[..., : 2 * half].to(work)
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half :]), dim=-1)


def check_tables(cos, sin, head_dim: int) -> int:
    """``rotary_dim / 2`` of matching ``(seqlen_ro, rotary_dim / 2)`` float tables."""
    if cos is None or sin is None:
        raise TypeError("pass both rotary_cos and rotary_sin (seqlen_ro, rotary_dim / 2)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got "
                f"{type(t).__name__} {getattr(t, 'dtype', '')}"
            )
        if t.ndim != 2:
            raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have one shape"
        )
    half = cos.shape[1]
    if not 0 < 2 * half <= head_dim:
        raise ValueError(
            f"rotary_dim = 2 * {half} = {2 * half} must lie in [2, headdim = {head_dim}]"
        )
    return half


def check_positions(positions: torch.Tensor, seqlen_ro: int) -> None:
    """Rotary positions: integers in ``[0, seqlen_ro)`` (a negative one would
    wrap around to the tables' end, a float one be truncated)."""
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(
            f"rotary positions (seqlen_offsets) must be integers, got {positions.dtype}"
        )
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(
            f"rotary position {int(positions.min())} is negative: seqlen_offsets must be >= 0"
        )
    if positions.numel() and int(positions.max()) >= seqlen_ro:
        raise ValueError(
            f"rotary position {int(positions.max())} is past the cos/sin tables "
            f"({seqlen_ro} positions): build them for at least {int(positions.max()) + 1}"
        )


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets=0,
    cu_seqlens=None,
    max_seqlen=None,
):
    """flash-attn's ``apply_rotary_emb``, differentiable.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads,
            headdim)`` with ``cu_seqlens``.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``; ``rotary_dim <= headdim``.
        interleaved: GPT-J pairs ``(2i, 2i + 1)`` if True, else GPT-NeoX
            pairs ``(i, i + rotary_dim / 2)``.
        inplace: write the result into ``x`` (and return ``x``).
        seqlen_offsets: int or ``(batch,)`` int tensor: token ``t`` of
            sequence ``b`` sits at position ``t + seqlen_offsets[b]``.
        cu_seqlens: ``(batch + 1,)`` offsets of a packed ``x``; positions
            count from each sequence's start. max_seqlen: accepted (flash-attn's
            launch size), not needed.

    Returns:
        The rotated ``x``, same shape and dtype.
    """
    del max_seqlen  # flash-attn's grid size; positions come from cu_seqlens here
    packed = cu_seqlens is not None
    if not isinstance(x, torch.Tensor) or x.ndim != (3 if packed else 4):
        layout = "(total_seqlen, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x has shape {tuple(getattr(x, 'shape', ()))}; expected {layout}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    device = x.device
    if not packed:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device).expand(batch, seqlen)
        sequence = torch.arange(batch, device=device)[:, None]
    else:
        cu = torch.as_tensor(cu_seqlens, device=device).long()
        lengths = cu.diff()
        sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        positions = torch.arange(x.shape[0], device=device) - cu[sequence]
        batch = lengths.numel()
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.is_floating_point() or seqlen_offsets.dtype == torch.bool:
            raise TypeError(f"seqlen_offsets must hold integers, got {seqlen_offsets.dtype}")
        if seqlen_offsets.shape != (batch,):
            raise ValueError(
                f"seqlen_offsets has shape {tuple(seqlen_offsets.shape)}; expected ({batch},) "
                f"or an int"
            )
        positions = positions + seqlen_offsets.to(device).long()[sequence]
    elif isinstance(seqlen_offsets, numbers.Integral) and not isinstance(seqlen_offsets, bool):
        positions = positions + int(seqlen_offsets)
    else:
        raise TypeError(
            f"seqlen_offsets must be an int or a (batch,) tensor, got {seqlen_offsets!r}"
        )
    out = rotate(x, cos, sin, positions, interleaved)
    return x.copy_(out) if inplace else out


#: flash-attn's older name.
apply_rotary_emb_func = apply_rotary_emb

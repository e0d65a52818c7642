"""Input checks shared by the distributed entry points."""

from __future__ import annotations

import numpy as np
import torch

from flashtile._validate import check_sdpa_layout
from flashtile.frontdoor import check_call

from . import kernels
from .comm import with_device
from .layout import check_layout

#: Input dtypes accepted; 16-bit floats travel as they are (see :mod:`.kernels` for the
#: dtype each device computes in).
ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q, k, v, enable_gqa: bool, what: str) -> None:
    """``q (B, Hq, T_local, d)``, ``k``/``v (B, Hkv, T_local, d / dv)`` tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in ACCEPTED_DTYPES:
        raise TypeError(
            f"{what}: q, k, v must share one floating dtype (float16, bfloat16, float32 or "
            f"float64), got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    layout = "(B, H, T_local, d) tensors, each rank its shard of the sequence"
    check_sdpa_layout(q, k, v, enable_gqa=enable_gqa, ranks=(4,), layout=layout, who=what)
    if not q.shape[2] == k.shape[2]:
        raise ValueError(
            f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} must share T_local "
            f"(self-attention over one sharded sequence)"
        )


def checked_shards(team, q, k, v, enable_gqa: bool, layout: str, what: str):
    """``(ring, kernels)`` of a sequence-parallel call: the layout, ``q, k, v``
    and their device checked against the group (``team``, a
    :class:`~.comm.Ring`), and the device's kernels' own limits."""
    check_layout(layout)
    check_qkv(q, k, v, enable_gqa, what)
    ring, device = with_device(team, q, k, v)
    local = kernels.for_device(device)
    local.check(q, k, v)
    return ring, local


def slopes_array(alibi_slopes):
    """ALiBi slopes as a float64 NumPy array (None stays None); a tensor's values, detached
    (flashtile computes no gradient for them)."""
    if isinstance(alibi_slopes, torch.Tensor):
        return alibi_slopes.detach().double().cpu().numpy()
    return alibi_slopes


def check_variants(q: torch.Tensor, scale, softcap, alibi_slopes) -> None:
    """Validate ``scale``/``softcap``/``alibi_slopes`` by flashtile's own check
    (:func:`flashtile.frontdoor.check_call` on a one-query probe of ``q``'s
    batch, heads and head dim: no kernel runs, whatever the device), before
    any message is posted: a rank that raised after posting would leave its
    peers waiting."""
    b, h, _, d = q.shape
    probe = np.zeros((b, h, 1, d), dtype=np.float32)
    keywords = {"softcap": softcap, "alibi_slopes": alibi_slopes}
    check_call(probe, probe, probe, False, scale, keywords)

"""Input checks shared by the distributed entry points."""

from __future__ import annotations

import numpy as np
import torch

import flashtile

from .threads import kernel_threads

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
    if not q.ndim == k.ndim == v.ndim == 4:
        raise ValueError(
            f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: pass "
            f"(B, H, T_local, d) tensors, each rank its shard of the sequence"
        )
    (b, hq, t, d), (bk, hk, tk, dk), (bv, hv, tv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and t == tk == tv and d == dk):
        raise ValueError(
            f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share "
            f"B and T_local (self-attention over one sharded sequence), and q and k the head dim"
        )
    if hk != hv or hk == 0 or hq == 0:
        raise ValueError(f"{what}: k has {hk} heads and v {hv}: they must be equal and > 0")
    if hq != hk and not enable_gqa:
        raise ValueError(
            f"{what}: q has {hq} heads but k and v have {hk}: pass enable_gqa=True for "
            f"grouped-query attention, or repeat k and v to {hq} heads"
        )
    if hq % hk:
        raise ValueError(f"{what}: enable_gqa needs Hq divisible by Hkv, got Hq={hq}, Hkv={hk}")


def slopes_array(alibi_slopes):
    """ALiBi slopes as a float64 NumPy array (None stays None); a tensor's values, detached
    (flashtile computes no gradient for them)."""
    if isinstance(alibi_slopes, torch.Tensor):
        return alibi_slopes.detach().double().cpu().numpy()
    return alibi_slopes


def check_variants(q: torch.Tensor, scale, softcap, alibi_slopes, procs: int) -> None:
    """Let flashtile itself validate ``scale``/``softcap``/``alibi_slopes``, before
    any message is posted: a tiny call with the same keywords (a rank that
    raised after posting would leave its peers waiting). It runs with this
    process's share of threads like every other kernel call here: a larger team
    would keep spinning on cores that other ranks are computing on."""
    b, h, _, d = q.shape
    probe = np.zeros((b, h, 1, d), dtype=np.float32)
    keywords = {"scale": scale, "softcap": softcap, "alibi_slopes": alibi_slopes}
    with kernel_threads(procs):
        flashtile.attention(probe, probe, probe, **keywords)

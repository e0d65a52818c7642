"""Packed variable-length attention on torch tensors: the engine of the varlen functions.

flash-attn packs sequences as ``(total, nheads, headdim)``; flashtile's
varlen kernels take ``(nheads, total, headdim)``. :func:`attend` transposes
and dispatches:

- CPU tensors: :class:`VarlenAttention`, a ``torch.autograd.Function`` over
  the NumPy :func:`flashtile.varlen_attention` and
  :func:`flashtile.varlen_attention_backward` (tensors viewed as NumPy
  arrays without a copy, bfloat16 included: :mod:`flashtile.torch.arrays`).
  The transposed ``q``, ``k``, ``v`` are made contiguous once, here, and
  that copy is what the backward reads (passing the strided views would
  make the kernels copy them in the forward and again in the backward).
- CUDA tensors: :func:`flashtile.triton.varlen_attention` (differentiable;
  it reads the strided views in place).

Sequences without queries or keys are fine (zeros and ``lse = -inf``, or the
sink's logit with sinks); a batch with no query or no key at all never
reaches the kernels (:class:`EmptyAttention`). Per-sequence ALiBi slopes
``(batch, nheads)`` that differ between sequences run one kernel call per
sequence: the varlen kernels take one slope per head.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import flashtile
from flashtile import op_autograd
from flashtile.torch.arrays import as_numpy, as_tensor

from . import checks
from .checks import Options


class Packed(NamedTuple):
    """A checked packed batch: offsets on the host, and the longest sequences."""

    cu_q: np.ndarray  # (S + 1,) int64
    cu_k: np.ndarray
    max_q: int
    max_k: int


def check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """``cu_seqlens_*`` (``(batch + 1,)`` integer tensors) read once on the host, checked."""
    offsets = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, total_q),
                            ("cu_seqlens_k", cu_seqlens_k, total_k)):  # fmt: skip
        if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 (or int64) tensor of offsets, got {cu!r}")
        arr = cu.detach().cpu().numpy().astype(np.int64)
        if arr.ndim != 1 or arr.size < 2:
            raise ValueError(f"{name} has shape {arr.shape}; expected (batch + 1,), batch >= 1")
        if arr[0] != 0 or arr[-1] != total or np.any(np.diff(arr) < 0):
            raise ValueError(
                f"{name} = {arr.tolist()[:8]}{'...' if arr.size > 8 else ''} must start at 0, "
                f"never decrease and end at the packed length {total}"
            )
        offsets.append(arr)
    cu_q, cu_k = offsets
    if cu_q.size != cu_k.size:
        raise ValueError(
            f"cu_seqlens_q has {cu_q.size - 1} sequences but cu_seqlens_k has {cu_k.size - 1}"
        )
    longest = []
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q),
                            ("max_seqlen_k", max_seqlen_k, cu_k)):  # fmt: skip
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {given!r}")
        need = int(np.diff(cu).max())
        if given < need:
            raise ValueError(
                f"{name} = {given} but a sequence has {need}: pass the longest length "
                f"(flash-attn would read past it)"
            )
        longest.append(need)
    return Packed(cu_q, cu_k, *longest)


def draw_seed() -> int:
    """A dropout seed, drawn as :func:`flashtile.op_autograd.dropout_seed` draws
    the operators' (so ``torch.manual_seed`` reproduces a call)."""
    return int(op_autograd.dropout_seed())


def attend(q, k, v, packed: Packed, opts: Options, seed: int):
    """``(out (total_q, Hq, dv), lse (Hq, total_q))`` for flash-attn's packed tensors.

    ``q (total_q, Hq, d)``, ``k (total_k, Hkv, d)``, ``v (total_k, Hkv, dv)``,
    checked; ``seed`` is the dropout seed (read when ``opts.dropout_p > 0``).
    """
    alibi = opts.alibi
    if alibi is not None and alibi.ndim == 2:
        if bool((alibi == alibi[:1]).all()):
            alibi = alibi[0]  # one slope per head: one kernel call
        else:
            return _per_sequence(q, k, v, packed, opts, seed)
    return _attend_once(q, k, v, packed.cu_q, packed.cu_k, opts._replace(alibi=alibi), seed, 0)


def _per_sequence(q, k, v, packed: Packed, opts: Options, seed: int):
    """Sequence by sequence, each with its own row of ``(batch, nheads)`` slopes
    (the kernels take one slope per head); dropout offset ``s`` for sequence ``s``."""
    outs, lses = [], []
    cu_q, cu_k = packed.cu_q, packed.cu_k
    for s in range(cu_q.size - 1):
        qa, qb, ka, kb = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        one_q, one_k = np.array([0, qb - qa]), np.array([0, kb - ka])
        out, lse = _attend_once(
            q[qa:qb], k[ka:kb], v[ka:kb], one_q, one_k, opts._replace(alibi=opts.alibi[s]),
            seed, s,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _attend_once(q, k, v, cu_q, cu_k, opts: Options, seed: int, offset: int):
    if q.shape[0] == 0 or k.shape[0] == 0:
        # Nothing to attend (no query, or no key in any sequence): the kernels
        # refuse empty arrays, and the answer is known (the sinks still checked).
        checks.check_sinks(opts.sinks, q.shape[1])
        out, lse = EmptyAttention.apply(q, k, v, opts.sinks)
        return out, lse
    keywords = {"causal": opts.causal, "scale": opts.scale}
    if opts.window is not None:
        keywords["window"] = opts.window
    if opts.softcap is not None:
        keywords["softcap"] = opts.softcap
    if checks.on_gpu(q):
        return _on_gpu(q, k, v, cu_q, cu_k, opts, keywords, seed, offset)
    if opts.alibi is not None:
        keywords["alibi_slopes"] = opts.alibi.detach().to("cpu", torch.float64).numpy()
    if opts.dropout_p > 0:
        keywords.update(dropout_p=opts.dropout_p, dropout_seed=seed, dropout_offset=offset)
    # One contiguous copy each, in flashtile's (H, total, d) layout, read by both passes.
    qt, kt, vt = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    out, lse = VarlenAttention.apply(qt, kt, vt, opts.sinks, cu_q, cu_k, keywords)
    return out.transpose(0, 1), lse


def _on_gpu(q, k, v, cu_q, cu_k, opts: Options, keywords, seed: int, offset: int):
    from flashtile import triton as gpu  # needs triton: imported on first use

    if opts.dropout_p > 0:  # the CPU path's seed and offset: the same mask
        keywords.update(dropout_p=opts.dropout_p, dropout_seed=seed, dropout_offset=offset)
    if opts.sinks is not None:
        keywords["sinks"] = opts.sinks
    device = q.device
    offsets = (torch.as_tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k))
    out, lse = gpu.varlen_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), *offsets,
        max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max()),
        alibi_slopes=opts.alibi, return_lse=True, **keywords,
    )  # fmt: skip
    return out.transpose(0, 1), lse


class VarlenAttention(torch.autograd.Function):
    """Differentiable :func:`flashtile.varlen_attention` on CPU tensors.

    ``apply(q (Hq, total_q, d), k (Hkv, total_k, d), v (Hkv, total_k, dv),
    sinks (Hq,) or None, cu_q, cu_k, keywords)``, tensors in flashtile's
    packed layout, ``cu_q``/``cu_k`` int64 NumPy offsets, ``keywords`` the
    NumPy function's (``causal``, ``scale``, ``window``, ``alibi_slopes``,
    ``softcap``, ``dropout_p`` with its seed and offset). Returns ``out (Hq,
    total_q, dv)`` and ``lse (Hq, total_q)``, which carries no gradient.
    Gradients flow to ``q``, ``k``, ``v`` and ``sinks``. The backward
    regenerates the forward's dropout mask from the kept seed and offset.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, keywords):
        if sinks is not None:
            keywords = dict(keywords, sinks=_sinks(sinks))
        out, lse = flashtile.varlen_attention(
            as_numpy(q), as_numpy(k), as_numpy(v), cu_q, cu_k, return_lse=True, **keywords
        )
        out, lse = as_tensor(out), as_tensor(lse)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.offsets, ctx.keywords = (cu_q, cu_k), keywords
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        grads = flashtile.varlen_attention_backward(
            *(as_numpy(t) for t in (q, k, v, out, lse, dout)), *ctx.offsets, **ctx.keywords
        )
        dq, dk, dv = (as_tensor(g) for g in grads[:3])
        dsinks = None if sinks is None else as_tensor(grads[3]).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None


def _sinks(sinks: torch.Tensor) -> np.ndarray:
    """Sink logits as float64 NumPy (bfloat16 has no NumPy float kind)."""
    return sinks.detach().to("cpu", torch.float64).numpy()


class EmptyAttention(torch.autograd.Function):
    """A packed batch with no query or no key: ``out`` zeros ``(total_q, Hq, dv)``,
    ``lse (Hq, total_q)`` ``-inf`` (the sink's logit with sinks), and zero
    gradients (``out`` depends on nothing)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        total_q, hq = q.shape[:2]
        out = q.new_zeros((total_q, hq, v.shape[-1]))
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = q.new_full((hq, total_q), -torch.inf, dtype=lse_dtype)
        if sinks is not None:
            lse = lse.copy_(sinks.detach().to(lse_dtype)[:, None].expand(hq, total_q))
        ctx.save_for_backward(q, k, v, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, sinks = ctx.saved_tensors
        zero = torch.zeros_like
        return zero(q), zero(k), zero(v), None if sinks is None else zero(sinks)

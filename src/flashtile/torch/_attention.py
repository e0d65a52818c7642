"""``flashtile.torch.attention``: the differentiable front door on torch tensors.

It refuses what :func:`._support.refusal` names (the rule the SDPA router
reads too: layout, devices, dtypes, GQA only when asked for), turns the
variant keywords into the op's flat arguments and calls
``flashtile::attention_fwd`` (:mod:`._ops`), whose autograd formula calls
``flashtile::attention_bwd``. A call with nothing to trace or intercept
(eager mode: plain tensors, no ``torch.compile``, no tracing, no dispatch
mode) skips the dispatcher's cost: without a gradient wanted it runs the op's
implementation directly (a plain call, such as a decoding step, skips that
layer too: :func:`_plain_eager`), with one the same autograd formula as an
``autograd.Function`` (:class:`._ops.EagerAttention`).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from .. import op_autograd
from .._validate import AttentionShapes, tensors_as_numpy
from ..cpu.launch import numba_threads
from ..frontdoor import check_call, prepare, prepared, run_call, run_prepared
from ..masks import normalize_window
from ..planning import Call
from ..variants import resolve_variants
from . import _ops, _support
from ._support import as_constant, refusal
from .arrays import as_numpy, as_tensor


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
    kv_lengths: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Exact attention on torch tensors (CPU, or CUDA through the Triton kernels),
    differentiable w.r.t. ``q``, ``k``, ``v``.

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
        kv_lengths: ``(B,)`` integers: only the first ``kv_lengths[b]`` keys of
            batch entry ``b`` exist (4-D inputs); the others are never read. A
            static KV cache passes its full buffer with the filled length here.
            Query positions stay ``i + Tk - Tq`` (see :func:`flashtile.attention`).
        dropout_p: attention dropout, as SDPA's: each probability is dropped
            with probability ``dropout_p`` and the kept ones scaled by ``1 / (1 -
            dropout_p)``, by a counter-based generator (:mod:`flashtile.dropout`)
            whose seed is drawn from torch's default CPU generator, so
            ``torch.manual_seed`` reproduces a run; the backward regenerates
            the same mask (nothing of size ``Tq x Tk`` is stored). Applied
            whenever it is > 0 (also in eval mode: pass ``dropout_p=0.0``
            there, as with SDPA). CUDA tensors get the same mask for the same
            seed (the Triton kernels run the same generator).
        sinks: ``(Hq,)`` attention sinks (gpt-oss's ``s_aux``): per query head
            one more logit in every row's softmax, with no value; it is neither
            scaled nor masked. Differentiable (a learned parameter gets its
            gradient); ``lse`` includes it, and a row that sees no key gives
            zeros and ``lse = sinks[h]``.

    Returns:
        ``out (B, Hq, Tq, dv)`` in the input dtype, and ``lse`` if asked. A
        query that sees no key gets a zero row, ``lse = -inf`` (``sinks[h]``
        with sinks) and zero gradients, never NaN.

    dtypes: float32, float64 and bfloat16 run natively (bfloat16 without a
    copy; its tile products run in bf16 where the CPU has bf16 instructions,
    see :func:`flashtile.cpu.blas.half_path`). float16 inputs are upcast to
    float32, computed, and ``out`` cast back (gradients flow back through the
    casts); ``lse`` is float32 for 16-bit inputs. A float mask is cast to the
    compute dtype (float32 for 16-bit inputs).

    A few queries against many keys (a decoding step) run on the split-KV
    decode kernel (:func:`flashtile.decode_planning.decode_shaped` is the rule).

    Devices: CPU tensors run the Numba kernels; CUDA tensors (q, k and v all
    on CUDA, one GPU) run the Triton kernels (:mod:`flashtile.triton`) with the
    same semantics, through the Triton backend's front door
    (:mod:`flashtile.triton.frontdoor`): the differentiable forward, or for a
    decoding step without gradients (at most 8 queries, no ``kv_lengths`` or
    dropout) the split-KV decode kernel. There ``mask`` and float64 are
    refused (ValueError, TypeError), head dims go up to 256, and without
    Triton installed an ImportError names the extra to install. Other
    devices (meta, ...) and mixed devices raise a ValueError naming the
    alternative; there is no silent fallback.

    Gradients: none for ``mask`` and ``alibi_slopes``; passing either with
    ``requires_grad=True`` (a learned bias) while grad mode is on raises a
    ValueError, so a gradient is never dropped silently. Inputs need not be contiguous
    (transposed views are copied once, inside, when not contiguous).

    Raises:
        ValueError, TypeError: the :class:`~._support.Refusal` that
            :func:`~._support.refusal` gives for the call (the SDPA router passes
            such a call on to SDPA with the same message); ``causal``,
            ``enable_gqa`` and ``return_lse`` must be bools. Bad values inside
            an accepted mask, slopes or softcap raise ValueError from the kernels'
            own checks.
        ImportError: CUDA tensors on a machine where Triton cannot be imported
            (also a :class:`~._support.Refusal`).
    """
    plain = mask is None and alibi_slopes is None and window is None and sinks is None
    if plain and type(dropout_p) is float and dropout_p == 0.0:
        result = _plain_eager(q, k, v, causal, scale, softcap, enable_gqa, return_lse, kv_lengths)
        if result is not None:
            return result
    refused = refusal(
        q, k, v, causal=causal, scale=scale, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, mask=mask, enable_gqa=enable_gqa, return_lse=return_lse,
        kv_lengths=kv_lengths, dropout_p=dropout_p, sinks=sinks,
    )  # fmt: skip
    if refused is not None:
        raise refused.exception()
    if _support.is_cuda_call(q, k, v):
        return _on_gpu(
            q, k, v, causal=causal, scale=scale, window=window, alibi_slopes=alibi_slopes,
            softcap=softcap, enable_gqa=enable_gqa, return_lse=return_lse, kv_lengths=kv_lengths,
            sinks=sinks, dropout_p=dropout_p,
        )  # fmt: skip
    in_dtype = q.dtype
    if in_dtype == torch.float16:
        q, k, v = q.float(), k.float(), v.float()
    mask = as_constant(mask)
    if mask is not None and mask.dtype != torch.bool:  # a float mask adds in the compute dtype
        mask = mask.to(torch.float32 if q.dtype == torch.bfloat16 else q.dtype)
    if kv_lengths is not None:
        kv_lengths = as_constant(kv_lengths).to(torch.int64)
    left, right = normalize_window(window, False)  # causal caps it inside
    dropout_p = float(dropout_p)
    seed = op_autograd.dropout_seed() if dropout_p > 0.0 else None
    args = (
        q, k, v, mask, as_constant(alibi_slopes), bool(causal),
        None if scale is None else float(scale), left, right,
        None if softcap is None else float(softcap), kv_lengths, dropout_p, seed,
        as_constant(sinks),
    )  # fmt: skip
    if _eager(q, k, v):
        run = _ops.EagerAttention.apply if op_autograd.wants_grad(q, k, v, sinks) else _ops.forward
        out, lse = run(*args)
    elif op_autograd.functorch_active():  # the op's own autograd does not run under torch.func
        out, lse = op_autograd.FuncAttention.apply(_ops.OPS, *args)
    else:
        out, lse = torch.ops.flashtile.attention_fwd(*args)
    out = out.to(in_dtype)
    return (out, lse) if return_lse else out


def _plain_eager(q, k, v, causal, scale, softcap, enable_gqa, return_lse, kv_lengths):
    """The result of a plain call, straight on the kernels; None for any other.

    Plain (:func:`_plain_key`): no mask, slopes or window; 4-D CPU tensors
    of a native dtype (``_ops.NATIVE_DTYPES``), bool flags, ``scale`` and
    ``softcap`` None or a Python float, ``kv_lengths`` None or a CPU tensor;
    eager. Without a gradient wanted such a call is the decoding step of a
    serving loop (a static cache's passes ``kv_lengths``), where the layers
    of the general path (the op's arguments, NumPy's own validation of what
    the torch rule has checked) cost as much as the kernel. The first call
    of each metadata runs the full validation (:func:`._support.refusal`,
    then :func:`flashtile.frontdoor.check_call`, raising as the general path
    does) and is remembered by :mod:`flashtile.frontdoor`; later ones run
    its prepared plan (:func:`flashtile.frontdoor.run_prepared`), or with
    ``kv_lengths`` check the lengths' values by the one rule
    (:func:`flashtile.variants.resolve_variants`) and plan the call. A call
    that wants a gradient skips the validation the same way, then runs the
    op's autograd formula (:class:`._ops.EagerAttention`, as the general
    path does).
    """
    key = _plain_key(q, k, v, causal, scale, softcap, enable_gqa, return_lse, kv_lengths)
    if key is None:
        return None
    entry = prepared(key)
    if entry is None:
        refused = refusal(
            q, k, v, causal=causal, scale=scale, softcap=softcap, enable_gqa=enable_gqa,
            return_lse=return_lse, kv_lengths=kv_lengths,
        )  # fmt: skip
        if refused is not None:
            raise refused.exception()
    if q.requires_grad or k.requires_grad or v.requires_grad:
        if torch.is_grad_enabled():
            if entry is None:  # checked once, as below (its views detached)
                _prepare(key, *map(as_numpy, (q, k, v)), causal, scale, softcap, kv_lengths)
            return _differentiable(q, k, v, causal, scale, softcap, return_lse, kv_lengths)
        q, k, v = q.detach(), k.detach(), v.detach()  # (NumPy views need detached tensors)
    if torch.bfloat16 in key[_KEY_DTYPES]:
        qn, kn, vn = tensors_as_numpy(q, k, v)  # (ml_dtypes views: NumPy has no bfloat16)
    else:  # (the dtypes known from the key: no test per tensor)
        qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    if entry is None:
        entry = _prepare(key, qn, kn, vn, causal, scale, softcap, kv_lengths)
    if kv_lengths is None:
        result = run_prepared(entry, qn, kn, vn, return_lse)
    else:  # the lengths' values: checked on every call, by the one rule
        lengths = as_numpy(kv_lengths)
        shapes = AttentionShapes(*entry.shapes[:2], kn.shape[2], *entry.shapes[3:])
        va = resolve_variants(shapes, causal=causal, softcap=softcap, kv_lengths=lengths)
        result = run_call(Call(qn, kn, vn, shapes, va, entry.scale), return_lse=return_lse)
    if return_lse:
        return as_tensor(result[0]), as_tensor(result[1])
    return as_tensor(result)


def _prepare(key, qn, kn, vn, causal, scale, softcap, kv_lengths):
    """:func:`flashtile.frontdoor.check_call` of a plain call's first call
    (NumPy views of its tensors), remembered under ``key``."""
    variants = {} if softcap is None else {"softcap": softcap}
    if kv_lengths is not None:
        variants["kv_lengths"] = as_numpy(kv_lengths)
    return prepare(key, check_call(qn, kn, vn, causal, scale, variants))


def _differentiable(q, k, v, causal, scale, softcap, return_lse, kv_lengths):
    """A checked plain call that wants gradients: the op's arguments (its
    schema's order; no mask, slopes, window, dropout or sinks) through
    :class:`._ops.EagerAttention`, as the general path gives them."""
    lengths = None if kv_lengths is None else kv_lengths.to(torch.int64)
    args = (q, k, v, None, None, causal, scale, -1, -1, softcap, lengths, 0.0, None, None)
    out, lse = _ops.EagerAttention.apply(*args)
    return (out, lse) if return_lse else out


#: Where :func:`_plain_key`'s key holds the dtypes of ``q``, ``k``, ``v``.
_KEY_DTYPES = slice(8, 11)


def _plain_key(q, k, v, causal, scale, softcap, enable_gqa, return_lse, kv_lengths):
    """The :mod:`flashtile.frontdoor` key of a plain call (see :func:`_plain_eager`):
    everything its validation reads but the key count; None when the call
    is not plain."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    if not (type(causal) is bool and type(enable_gqa) is bool and type(return_lse) is bool):
        return None
    if not (
        (scale is None or type(scale) is float) and (softcap is None or type(softcap) is float)
    ):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs) == 4 and ks[2] == vs[2] and ks[2] > 0):
        return None
    if _support.is_cuda_call(q, k, v) or not (q.is_cpu and k.is_cpu and v.is_cpu):
        return None  # the Triton kernels' (the one device test), or refused
    dtype = q.dtype  # (read once: each read of a tensor's attribute costs microseconds cold)
    if dtype not in _ops.NATIVE_DTYPES:
        return None  # float16 is upcast on the general path
    lengths = None
    if kv_lengths is not None:
        if type(kv_lengths) is not torch.Tensor or not kv_lengths.is_cpu:
            return None
        lengths = (kv_lengths.dtype, kv_lengths.shape)
    if not _ops.nothing_intercepts() or forward_ad._current_level >= 0:
        return None  # recorded, intercepted, or dual tensors possible: the general path
    return (
        "torch", qs, ks[0], ks[1], ks[3], vs[0], vs[1], vs[3], dtype, k.dtype, v.dtype,
        causal, scale, softcap, enable_gqa, lengths, numba_threads(),
    )  # fmt: skip


def _eager(q, k, v) -> bool:
    """Whether the op may run without the dispatcher (its implementation, or
    with a gradient wanted :class:`._ops.EagerAttention`): plain tensors and
    nothing that records or intercepts ops (``torch.compile``,
    ``torch.jit.trace``, a dispatch mode such as FakeTensorMode or a FLOP
    counter, a ``torch.func`` transform)."""
    return (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and type(v) is torch.Tensor
        and _ops.nothing_intercepts()
    )


def _on_gpu(q, k, v, **keywords):
    """CUDA tensors (accepted by :func:`~._support.refusal`): the Triton
    backend's check, plan and run (:mod:`flashtile.triton.frontdoor`), whose
    plan sends a decoding step without gradients to the split-KV decode
    kernel, and everything else to the differentiable forward."""
    from ..triton import frontdoor  # imported on first use: it needs triton

    causal, scale = keywords.pop("causal"), keywords.pop("scale")
    enable_gqa, return_lse = keywords.pop("enable_gqa"), keywords.pop("return_lse")
    call = frontdoor.check_call(q, k, v, causal, scale, keywords, enable_gqa=enable_gqa)
    grad = op_autograd.wants_grad(q, k, v, keywords["sinks"])
    return frontdoor.run_plan(call, frontdoor.plan_call(call, grad), return_lse)

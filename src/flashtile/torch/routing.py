"""Route ``torch.nn.functional.scaled_dot_product_attention`` calls to flashtile.

Inside ``with route_sdpa() as router:`` the function in
``torch.nn.functional`` is replaced, so code that looks it up at call time
(``F.scaled_dot_product_attention(...)``, Hugging Face's SDPA attention,
``nn.MultiheadAttention``) reaches :meth:`SDPARouter.sdpa`. Each call is
either **routed** to :func:`flashtile.torch.attention` or **passed** through to
the original SDPA with its arguments untouched; ``router.routed``,
``router.passed`` and ``router.reasons`` say what happened. The original is
restored on exit, also when the block raises. Code that bound the function
earlier (``from torch.nn.functional import scaled_dot_product_attention``) is
not affected.

A call is routed when flashtile computes exactly what SDPA would: CPU
tensors of one float dtype, 3-D or 4-D, ``dropout_p == 0``, matching batch
and head dims (``Hkv != Hq`` only with ``enable_gqa``), and an ``attn_mask``
that is None, bool, float32 or of the query's dtype, broadcastable to
``(..., Hq, Tq, Tk)`` and not requiring grad. Everything else passes through,
including calls SDPA itself rejects, so SDPA raises its own error.

Semantics of routed calls:

* ``is_causal=True`` is SDPA's **top-left** mask (query ``i`` sees keys
  ``j <= i``); flashtile's ``causal`` is bottom-right. They agree for
  ``Tq == Tk``. For ``Tq != Tk`` the router translates exactly: with
  ``Tq < Tk`` no query sees a key at or past ``Tq``, so it runs flashtile's
  causal attention on ``k[..., :Tq, :]`` (the dropped keys get zero gradient);
  with ``Tq > Tk`` it uses ``window=(None, Tq - Tk)`` without ``causal``,
  which gives exactly ``j <= i``. An ``attn_mask`` given with ``is_causal``
  applies as well (SDPA in torch 2.13 combines the two; it does not raise).
* A query row that sees no key gives zeros and zero gradients. SDPA in
  torch 2.13 does the same on CPU for bool masks and ``-inf``; older versions
  returned NaN there. A float mask that hides with a large finite value
  (``torch.finfo(dtype).min``, as Hugging Face builds them) differs on fully
  hidden rows: SDPA averages every value there, flashtile still gives zeros
  (values below ``-FLT_MAX / log2(e)`` count as ``-inf`` in flashtile, see
  ``flashtile.variants.MASK_LIMIT``). Partly hidden rows agree.
* A float ``attn_mask`` holding NaN, ``+inf`` or values above that limit is
  refused by flashtile with a ValueError (it is not scanned for here: that
  would cost a pass over the mask).

Under ``torch.compile`` the router is traced like any Python function: the
counters then record the calls made while tracing, not every run.
Replacing a module attribute is process-wide, so do not route from several
threads at once.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ._attention import ACCEPTED_DTYPES, attention


def _broadcasts(shape, target) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (trailing alignment)."""
    if len(shape) > len(target):
        return False
    return all(m in (1, t) for m, t in zip(reversed(shape), reversed(target), strict=False))


def pass_reason(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, extra) -> str | None:
    """Why this SDPA call cannot be routed to flashtile, or None when it can."""
    if extra:
        return f"unknown SDPA arguments {sorted(extra)}"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k, v are not all tensors"
    for t in (q, k, v, attn_mask):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return f"device {t.device.type} (flashtile runs on CPU)"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in ACCEPTED_DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (need one float dtype)"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        return f"dropout_p of type {type(dropout_p).__name__} (SDPA's own handling)"
    if dropout_p != 0:
        return "dropout_p > 0 (flashtile has no dropout)"
    if not isinstance(is_causal, bool):
        return f"is_causal of type {type(is_causal).__name__} (SDPA's own handling)"
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
        return f"rank {q.ndim}/{k.ndim}/{v.ndim} (flashtile takes 3-D or 4-D)"
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        return "batch dims differ (SDPA broadcasts them; flashtile does not)"
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return "empty tensor"
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv or (hq != hk and not (enable_gqa and hq % hk == 0)):
        return f"heads {hq}/{hk}/{hv} without a valid enable_gqa (SDPA broadcasts or raises)"
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return "head dims or key/value lengths differ (SDPA raises)"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return f"scale of type {type(scale).__name__}"
    if scale is not None and not math.isfinite(scale):
        return f"non-finite scale {scale}"
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if attn_mask.ndim < 2:
        return f"attn_mask of rank {attn_mask.ndim} (SDPA takes (..., Tq, Tk))"
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return f"attn_mask dtype {attn_mask.dtype} (SDPA takes bool, float32 or {q.dtype})"
    if attn_mask.requires_grad and torch.is_grad_enabled():
        return "attn_mask requires grad (a learned bias; flashtile gives masks no gradient)"
    if not _broadcasts(attn_mask.shape, (*q.shape[:-1], k.shape[-2])):
        return f"attn_mask shape {tuple(attn_mask.shape)} does not broadcast to the scores"
    return None


def routed_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """What SDPA computes, through :func:`flashtile.torch.attention` (call must be routable).

    Translates SDPA's top-left ``is_causal`` exactly (see the module docstring);
    with an ``attn_mask`` as well, both apply, as in SDPA.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    window = None
    causal = bool(is_causal)
    if causal and tq < tk:  # keys >= Tq are hidden from every query
        k, v = k[..., :tq, :], v[..., :tq, :]
        if attn_mask is not None and attn_mask.shape[-1] != 1:
            attn_mask = attn_mask[..., :tq]
    elif causal and tq > tk:  # j <= i is "at most Tq - Tk after the aligned position"
        causal, window = False, (None, tq - tk)
    return attention(
        q, k, v, causal=causal, scale=scale, window=window, mask=attn_mask, enable_gqa=enable_gqa
    )


class SDPARouter(contextlib.ContextDecorator):
    """Replaces SDPA while active; counts routed and passed calls.

    Attributes:
        routed: calls computed by flashtile.
        passed: calls handed to the original SDPA.
        reasons: ``{reason: count}`` for the passed calls.
        strict: when True a call that cannot be routed raises RuntimeError
            with the reason instead of passing through (for tests and audits).
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.routed = 0
        self.passed = 0
        self.reasons: dict[str, int] = {}
        self._original = None

    def __enter__(self) -> SDPARouter:
        if self._original is not None:
            raise RuntimeError("this SDPARouter is already active; create a new one to nest")
        self._original = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self.sdpa
        return self

    def __exit__(self, *exc_info) -> bool:
        if torch.nn.functional.scaled_dot_product_attention != self.sdpa:
            raise RuntimeError(
                "SDPARouter exited while another router it enclosed is still active: "
                "exit nested routers in reverse order (use them as `with` blocks)"
            )
        torch.nn.functional.scaled_dot_product_attention = self._original
        self._original = None
        return False  # exceptions propagate

    def sdpa(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        **extra,
    ):
        """The stand-in for SDPA: same signature, routed or passed through."""
        reason = pass_reason(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, extra
        )
        if reason is None:
            self.routed += 1
            return routed_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        if self.strict:
            raise RuntimeError(f"route_sdpa(strict=True): SDPA call not routed: {reason}")
        self.passed += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        original = self._original or torch.nn.functional.scaled_dot_product_attention
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            **extra,
        )

    def __repr__(self) -> str:
        return f"SDPARouter(routed={self.routed}, passed={self.passed}, reasons={self.reasons})"


def route_sdpa(strict: bool = False) -> SDPARouter:
    """Context manager routing supported SDPA calls to flashtile (see the module docstring).

    Example::

        with flashtile.torch.route_sdpa() as router:
            loss = model(x).sum()
            loss.backward()
        print(router.routed, router.passed, router.reasons)
    """
    return SDPARouter(strict=strict)

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

A call is routed when :func:`flashtile.torch.attention` accepts it and SDPA
means by it what flashtile computes. The first part is the operator's own
rule (:func:`flashtile.torch._support.refusal`): a call the operator would
refuse passes through with the operator's error message as its reason, so
the router and the operator cannot disagree. The second part is SDPA's:
``dropout_p`` a number, ``is_causal`` a bool and not combined with an
``attn_mask``, an ``attn_mask`` that is a tensor of rank >= 2 and dtype bool,
float32 or the query's, and no unknown keyword. Everything else passes
through, including calls SDPA itself rejects, so SDPA raises its own error.

Devices follow the operator too: CPU tensors run flashtile's CPU kernels, and
a call whose ``query``, ``key`` and ``value`` are all CUDA tensors runs on the
Triton kernels (:mod:`flashtile.triton`) when the operator accepts it. What
those kernels do not take (an ``attn_mask``, float64, head dims above 256,
tensors on two GPUs, a machine without Triton) is part of the same rule, so
such calls pass to SDPA with the operator's message, as do CPU/CUDA mixes.

Tensors whose class defines ``__torch_function__`` (such as the masks of
``torch.nn.attention.bias.causal_upper_left`` / ``causal_lower_right``) are
handed to it first, with the function now in ``torch.nn.functional`` as
SDPA would: a ``CausalBias`` then calls SDPA again with ``is_causal`` or a
plain mask, and that call is routed.

Semantics of routed calls:

* ``is_causal=True`` is SDPA's **top-left** mask (query ``i`` sees keys
  ``j <= i``); flashtile's ``causal`` is bottom-right. They agree for
  ``Tq == Tk``; for ``Tq != Tk`` :func:`top_left_causal` translates exactly.
  An ``attn_mask`` together with ``is_causal=True`` always passes to SDPA: in
  torch 2.13 its math path raises there (3-D inputs, the MATH backend) and
  its CPU flash path applies both, so only SDPA knows which it does.
* A query row that sees no key gives zeros and zero gradients. SDPA in
  torch 2.13 does the same on CPU for bool masks and ``-inf``; older versions
  returned NaN there. A float mask that hides with a large finite value
  (``torch.finfo(dtype).min``, as Hugging Face builds them) differs on fully
  hidden rows: SDPA averages every value there, flashtile still gives zeros
  (values below ``-FLT_MAX / log2(e)`` count as ``-inf`` in flashtile, see
  ``flashtile.variants.MASK_LIMIT``). Partly hidden rows agree.
* ``dropout_p > 0`` runs flashtile's dropout (CPU and CUDA tensors): the same
  distribution as SDPA's, from flashtile's own generator seeded by torch's
  (:mod:`flashtile.dropout`), so the masks differ from SDPA's; like SDPA it
  applies whatever ``dropout_p`` the caller passes (modules pass 0 in eval).
* A float ``attn_mask`` holding NaN, ``+inf`` or values above that limit is
  refused by flashtile with a ValueError (it is not scanned for here: that
  would cost a pass over the mask).

Under ``torch.compile`` the router is traced like any Python function: the
counters then record the calls made while tracing, not every run. Code that
``torch.jit.script`` compiles while the router is active calls SDPA itself
(TorchScript cannot call back into Python).
Replacing a module attribute is process-wide, so do not route from several
threads at once.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ._attention import attention
from ._support import refusal


class TopLeftCausal(NamedTuple):
    """SDPA's ``is_causal`` as flashtile arguments (see :func:`top_left_causal`)."""

    key: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor | None  # a mask or bias over the keys (last axis), cropped alike
    causal: bool
    window: tuple[None, int] | None


def top_left_causal(tq: int, key, value, bias=None) -> TopLeftCausal:
    """SDPA's top-left ``is_causal`` (query ``i`` sees key ``j`` iff ``j <= i``) for flashtile.

    flashtile's ``causal`` is bottom-right (``j <= i + Tk - Tq``). With
    ``Tq < Tk`` no query sees a key at or past ``Tq``, so ``key``, ``value``
    and ``bias`` are cropped to ``Tq`` keys, where the two alignments agree
    (the dropped keys get zero gradient). With ``Tq > Tk`` nothing is cropped
    and ``window=(None, Tq - Tk)`` without ``causal`` gives exactly ``j <= i``.
    """
    tk = key.shape[-2]
    if tq > tk:  # j <= i is "at most Tq - Tk after the bottom-right position"
        return TopLeftCausal(key, value, bias, False, (None, tq - tk))
    if tq < tk:  # keys >= Tq are hidden from every query
        key, value = key[..., :tq, :], value[..., :tq, :]
        bias = None if bias is None else bias[..., :tq]
    return TopLeftCausal(key, value, bias, True, None)


def _sdpa_only_reason(query, attn_mask, dropout_p, is_causal, extra) -> str | None:
    """Why SDPA would not compute what flashtile does (or would raise), or None."""
    if extra:
        return f"unknown SDPA arguments {sorted(extra)}"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        return f"dropout_p of type {type(dropout_p).__name__} (SDPA's own handling)"
    if not isinstance(is_causal, bool):
        return f"is_causal of type {type(is_causal).__name__} (SDPA's own handling)"
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        return "attn_mask is not a tensor (SDPA's own handling)"
    if is_causal:
        return "attn_mask with is_causal=True (SDPA's own handling: some of its paths raise)"
    if attn_mask.ndim < 2:
        return f"attn_mask of rank {attn_mask.ndim} (SDPA takes (..., Tq, Tk))"
    allowed = (torch.bool, torch.float32, getattr(query, "dtype", torch.float32))
    if attn_mask.dtype not in allowed:
        return f"attn_mask dtype {attn_mask.dtype} (SDPA takes bool, float32 or the query's)"
    return None


def pass_reason(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, extra) -> str | None:
    """Why this SDPA call is passed to SDPA rather than routed to flashtile, or None.

    SDPA's own rules first, then flashtile's: a call
    :func:`flashtile.torch.attention` refuses gets the operator's message.
    """
    reason = _sdpa_only_reason(q, attn_mask, dropout_p, is_causal, extra)
    if reason is not None:
        return reason
    # The crop of a top-left is_causal changes no verdict, and checking the
    # call as given keeps the caller's shapes in the message.
    refused = refusal(
        q, k, v, causal=is_causal, scale=scale, mask=attn_mask, enable_gqa=enable_gqa,
        dropout_p=dropout_p,
    )  # fmt: skip
    return None if refused is None else refused.message


def routed_attention(
    q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, dropout_p=0.0
):
    """What SDPA computes, through :func:`flashtile.torch.attention` (call must be routable)."""
    causal, window = False, None
    if is_causal:
        if attn_mask is not None:
            raise ValueError("routed_attention: attn_mask with is_causal=True is SDPA's to handle")
        k, v, _, causal, window = top_left_causal(q.shape[-2], k, v)
    return attention(
        q, k, v, causal=causal, scale=scale, window=window, mask=attn_mask, enable_gqa=enable_gqa,
        dropout_p=float(dropout_p),
    )  # fmt: skip


def _script_as_sdpa(standin, active: bool) -> None:
    """Let ``torch.jit.script`` compile a call to the stand-in as SDPA's own ATen op.

    TorchScript cannot compile the router (a Python method taking any
    arguments); it looks functions up by ``id`` in its builtin table, so the
    installed stand-in is listed there while it is active. Scripted code thus
    calls SDPA itself, as it would outside the router.
    """
    builtins = getattr(torch.jit, "_builtins", None)  # private; absent in a torch without it
    if builtins is None:
        return
    table = builtins._get_builtin_table()
    if active:
        table[id(standin)] = "aten::scaled_dot_product_attention"
    else:
        table.pop(id(standin), None)


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
        self._standin = None

    def __enter__(self) -> SDPARouter:
        if self._original is not None:
            raise RuntimeError("this SDPARouter is already active; create a new one to nest")
        self._original = torch.nn.functional.scaled_dot_product_attention
        self._standin = self.sdpa  # one bound method, so that its id names it while active
        torch.nn.functional.scaled_dot_product_attention = self._standin
        _script_as_sdpa(self._standin, True)
        return self

    def __exit__(self, *exc_info) -> bool:
        if torch.nn.functional.scaled_dot_product_attention is not self._standin:
            raise RuntimeError(
                "SDPARouter exited while another router it enclosed is still active: "
                "exit nested routers in reverse order (use them as `with` blocks)"
            )
        torch.nn.functional.scaled_dot_product_attention = self._original
        _script_as_sdpa(self._standin, False)
        self._original = self._standin = None
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
        tensors = (query, key, value, attn_mask)
        if torch.overrides.has_torch_function(tensors):
            # What SDPA does for such tensors, with the function a subclass
            # compares against (CausalBias) being this stand-in while it is installed.
            return torch.overrides.handle_torch_function(
                torch.nn.functional.scaled_dot_product_attention,
                tensors,
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
        reason = pass_reason(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, extra
        )
        if reason is None:
            self.routed += 1
            return routed_attention(
                query, key, value, attn_mask, is_causal, scale, enable_gqa, dropout_p
            )
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

"""flashtile as a Hugging Face ``transformers`` attention implementation.

``register_transformers()`` adds flashtile's differentiable torch operator
(``flashtile.torch.attention``) to transformers' ``AttentionInterface`` under a
name of your choice (``"tiled"`` by default), so any model whose attention goes
through that interface (Llama, Mistral, Qwen, GPT-2, Gemma 2, ...) can run on it::

    import flashtile.torch as ft
    from transformers import AutoModelForCausalLM

    name = ft.register_transformers()  # "tiled"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

Why the name must not contain ``"flash"``: transformers 5.x reads any
implementation name containing that word as a request for a FlashAttention
kernel (from the ``flash_attn`` package or the kernels hub) and refuses or
redirects it, so flashtile registers as ``"tiled"``.

On a GPU the layers' CUDA tensors go, through the operator, to flashtile's
Triton kernels (:mod:`flashtile.triton.frontdoor`'s plan): prefill and
training to the differentiable forward, a decoding step without gradients
(at most 8 new queries) to the split-KV decode kernel (a static cache's
step, which passes its filled length as ``kv_lengths``, runs the forward
kernel). Those
kernels take no mask: a call with one (transformers builds a 4-D mask for
padded batches and for patterns other than plain causal) raises the
operator's ValueError, which says so; run such batches unpadded or with
``attn_implementation="sdpa"``.

transformers is imported only inside ``register_transformers``, so importing
``flashtile.torch`` does not pull it in.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from ._attention import _plain_eager, attention
from .routing import top_left_causal

__all__ = ["register_transformers", "tiled_attention_forward"]

DEFAULT_NAME = "tiled"


class _Visibility(NamedTuple):
    """Which keys each query sees, as flashtile arguments (k/v possibly cropped)."""

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    window: tuple[int | None, int] | None
    kv_lengths: torch.Tensor | None = None


def _resolve_causal(module: torch.nn.Module, is_causal: bool | None) -> bool:
    """The model's causal flag: the ``is_causal`` kwarg if given, else the module's, else True."""
    if is_causal is not None:
        return bool(is_causal)
    return bool(getattr(module, "is_causal", True))


def _with_position_bias(
    position_bias: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Fold a T5-style additive ``position_bias`` and the mask into one float mask.

    Args:
        position_bias: float, broadcastable to ``(B, H, Tq, Tk)``, added to the scores.
        attention_mask: ``None``, bool (True = keep) or float (additive), same broadcasting.

    Returns:
        float additive mask broadcastable to ``(B, H, Tq, Tk)``; hidden entries are -inf.
    """
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask


def _visibility(
    module, query, key, value, attention_mask, is_causal, sliding_window, position_bias
) -> _Visibility:
    """The mask, causal flag and window that give transformers' visibility rule.

    A mask, when given, is the whole rule. transformers passes none only when
    the pattern is plain causal (or full) with no padding; it then expects
    SDPA's top-left ``is_causal``, and only for ``Tq > 1`` (a single decoding
    query sees the whole cache). A prefill into an empty static cache has
    ``Tk > Tq``: the keys past ``Tq`` are unfilled slots, which the top-left
    crop drops.
    """
    tq = query.shape[-2]
    causal, window = False, None
    if attention_mask is None and tq > 1 and _resolve_causal(module, is_causal):
        key, value, position_bias, causal, window = top_left_causal(tq, key, value, position_bias)
        if causal and sliding_window is not None:
            # Without a mask the window hides nothing (transformers builds a mask as soon
            # as it would), but passing it is exact and lets flashtile skip tiles.
            window = (int(sliding_window) - 1, 0)
    mask = attention_mask
    if position_bias is not None:
        mask = _with_position_bias(position_bias.to(query.dtype), attention_mask)
    elif tq == 1 and (lengths := _filled_lengths(mask, query.shape[0], key.shape[-2])) is not None:
        return _Visibility(key, value, None, False, None, lengths)
    return _Visibility(key, value, mask, bool(causal), window)


def _filled_lengths(mask, batch: int, tk: int) -> torch.Tensor | None:
    """``(B,)`` key counts when a decoding step's bool mask keeps a prefix of the keys.

    A static cache hands over its whole preallocated buffer ``(B, Hkv,
    max_len, d)`` and hides the unfilled slots with the mask, whose row is then
    ``[True] * n + [False] * (max_len - n)``. As ``kv_lengths`` the kernels read
    only the ``n`` filled keys, in place, instead of the whole buffer. Any
    other mask (left padding, a window) gives None and is applied as a mask.
    """
    if mask is None or mask.dtype != torch.bool or mask.ndim != 4:
        return None
    if mask.shape[1:] != (1, 1, tk) or mask.shape[0] not in (1, batch):
        return None
    rows = mask[:, 0, 0]
    lengths = rows.sum(-1)
    if not torch.equal(rows, torch.arange(tk, device=rows.device) < lengths[:, None]):
        return None
    return lengths.expand(batch)


def _warn_no_weights(output_attentions: bool) -> None:
    """Warn that attention weights are never formed."""
    if output_attentions:
        warnings.warn(
            "flashtile attention never forms the attention weights; output_attentions=True"
            " returns None for them. Use attn_implementation='eager' to get them.",
            stacklevel=3,
        )


def tiled_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for one transformers layer, computed by flashtile.

    The function ``register_transformers`` registers; callable directly, e.g. from a
    custom attention module that follows transformers' ``(module, query, key, value,
    attention_mask, **kwargs)`` convention.

    Args:
        module: the calling attention module (read for ``is_causal`` only).
        query: ``(B, Hq, Tq, d)``.
        key, value: ``(B, Hkv, Tk, d)``; ``Hkv`` divides ``Hq`` (GQA/MQA read in place,
            never repeated per query head).
        attention_mask: None, or a 4-D mask broadcastable to ``(B, Hq, Tq, Tk)``: bool
            (True = keep, what the registered ``sdpa_mask`` builds) or float (additive).
            When given it is the whole visibility rule: causality, padding, sliding
            window and KV-cache offsets are already in it. A decoding step's mask
            that keeps a prefix of the keys (a static cache's filled slots) is
            passed as ``kv_lengths`` instead, so the unfilled slots are never read.
        dropout: attention dropout probability (transformers passes the config's
            in training mode, 0 in eval mode): flashtile's dropout, reproducible
            from torch's generator (see :func:`flashtile.torch.attention`).
        scaling: score scale, ``1/sqrt(d)`` if None.
        is_causal: overrides ``module.is_causal``; used only when there is no mask, then
            top-left aligned as in SDPA.
        sliding_window: keys ``j > p - sliding_window`` stay visible (transformers'
            convention); only needed when there is no mask, since a mask already has it.
        softcap: ``softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2).
        position_bias: additive float bias (T5-style), folded into a float mask. A
            learned bias that requires grad raises ValueError (flashtile gives masks no
            gradient), so T5-style models run here for inference (``torch.no_grad()``).
        s_aux: per-head attention-sink logits ``(Hq,)`` (gpt-oss): an extra key with
            that score and a zero value, in training (with its gradient) and inference.

    Returns:
        ``(out, None)`` with ``out`` of shape ``(B, Tq, Hq, d)`` contiguous, the layout
        transformers' sdpa path returns; attention weights are never formed.
    """
    _warn_no_weights(kwargs.get("output_attentions", False))
    step = query.shape[-2] == 1 and attention_mask is None and position_bias is None
    if step and s_aux is None and not dropout:
        # A decoding step: one query sees the whole cache (_visibility's answer,
        # no mask, not causal). The plain path, as attention() would take it,
        # without its layers: between a model's layers Python runs cold, where
        # each layer costs microseconds.
        gqa = key.shape[-3] != query.shape[-3]
        out = _plain_eager(query, key, value, False, scaling, softcap, gqa, False, None)
        if out is not None:  # (Tq = 1: (B, Hq, 1, d) is (B, 1, Hq, d), a view)
            return out.reshape(out.shape[0], 1, out.shape[1], out.shape[3]), None
    seen = _visibility(
        module, query, key, value, attention_mask, is_causal, sliding_window, position_bias
    )
    out = attention(
        query,
        seen.key,
        seen.value,
        causal=seen.causal,
        scale=scaling,
        window=seen.window,
        softcap=softcap,
        mask=seen.mask,
        enable_gqa=bool(key.shape[-3] != query.shape[-3]),
        kv_lengths=seen.kv_lengths,
        dropout_p=float(dropout or 0.0),
        sinks=s_aux,
    )
    return out.transpose(1, 2).contiguous(), None


def register_transformers(name: str = DEFAULT_NAME) -> str:
    """Register flashtile as a transformers attention implementation and return its name.

    Registers, under ``name``:

    - the attention function in ``transformers.AttentionInterface``;
    - transformers' ``sdpa_mask`` in ``transformers.AttentionMaskInterface``, so models
      build the same masks for this name as for ``"sdpa"``: ``None`` when the pattern is
      plain causal or full with no padding, otherwise a 4-D bool mask
      ``(B, 1, Tq, Tk)`` (True = keep). Without a mask function transformers would pass
      no mask at all for an unknown name and padding would be ignored.

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` selects flashtile. Registration is global to
    the process and idempotent.

    Args:
        name: the implementation name; must not contain ``"flash"`` (transformers would
            treat it as a FlashAttention kernel request) nor be a built-in name.

    Returns:
        ``name``.

    Raises:
        ValueError: for a name containing ``"flash"`` or a built-in name.
        ImportError: if transformers is not installed.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if "flash" in name:
        raise ValueError(
            f"name {name!r} contains 'flash': transformers treats such names as a request for a"
            " FlashAttention kernel and refuses them. Use another name, e.g. 'tiled'."
        )
    if "sdpa" in name or "flex_attention" in name or name in ("eager", "paged|eager"):
        raise ValueError(
            f"name {name!r} is, or contains, a name transformers handles itself; use another"
            " name, e.g. 'tiled'."
        )
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "register_transformers needs the transformers package: pip install transformers"
        ) from exc

    AttentionInterface.register(name, tiled_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name

"""flashtile for PyTorch: a differentiable, ``torch.compile``-able attention op on CPU.

* :func:`attention` takes SDPA-layout tensors ``(B, H, T, d)`` and is
  differentiable w.r.t. ``q``, ``k``, ``v``; it runs the
  ``torch.ops.flashtile.attention_fwd`` / ``attention_bwd`` custom ops.
* :func:`route_sdpa` temporarily sends the calls to
  ``torch.nn.functional.scaled_dot_product_attention`` that flashtile supports
  to :func:`attention`, passes every other call through to SDPA untouched,
  and counts which went where and why.
* :func:`register_transformers` registers :func:`attention` with Hugging
  Face transformers (``attn_implementation="tiled"``).

Importing this module needs PyTorch (``pip install 'flashtile[torch]'``);
``import flashtile`` alone never imports torch.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "flashtile.torch needs PyTorch: pip install 'flashtile[torch]' (the CPU wheel)"
    ) from exc

from ._attention import attention
from .hf import register_transformers
from .routing import SDPARouter, route_sdpa

__all__ = ["SDPARouter", "attention", "register_transformers", "route_sdpa"]

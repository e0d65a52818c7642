"""The NumPy reference: readable first, and the oracle for every faster path.

The seed contracts live here: :func:`softmax`, :func:`online_softmax`,
:func:`online_softmax_normalizer`, :func:`naive_attention`,
:func:`tiled_attention`, :func:`online_attention`,
:func:`attention_memory_elements`, the backward
:func:`tiled_attention_backward`, and :func:`decode_attention` against a KV
cache.
"""

from .attention import attention_memory_elements, naive_attention, online_attention, tiled_attention
from .backward import tiled_attention_backward
from .decode import decode_attention
from .softmax import (
    OnlineStep,
    online_softmax,
    online_softmax_normalizer,
    online_softmax_steps,
    online_update,
    softmax,
)

__all__ = [
    "OnlineStep",
    "attention_memory_elements",
    "decode_attention",
    "naive_attention",
    "online_attention",
    "online_softmax",
    "online_softmax_normalizer",
    "online_softmax_steps",
    "online_update",
    "softmax",
    "tiled_attention",
    "tiled_attention_backward",
]

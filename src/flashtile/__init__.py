"""flashtile: exact attention computed tile by tile with an online softmax.

Layout is ``(..., T, d)`` (``(B, H, T, d)`` as in PyTorch SDPA). Causal masks
align bottom-right when ``Tq != Tk``; rows that see no key give zeros and
``lse = -inf``; ``lse`` is the natural-log normaliser ``m + log(ell)``.
"""

from . import tune as tune  # registers the routes' measurements (flashtile.routes)
from .api import attention, attention_backward, varlen_attention, varlen_attention_backward
from .decode import decode_attention
from .kvcache import KVCache
from .masks import BlockMask, block_mask
from .merge import merge_states
from .reference import (
    attention_memory_elements,
    naive_attention,
    online_attention,
    online_softmax,
    online_softmax_normalizer,
    softmax,
    tiled_attention,
    tiled_attention_backward,
)

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "KVCache",
    "attention",
    "attention_backward",
    "attention_memory_elements",
    "block_mask",
    "decode_attention",
    "merge_states",
    "naive_attention",
    "online_attention",
    "online_softmax",
    "online_softmax_normalizer",
    "softmax",
    "tiled_attention",
    "tiled_attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
]

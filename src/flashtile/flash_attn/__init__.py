"""flash-attn 2's Python API on flashtile's kernels: change the import, keep the code.

::

    from flashtile.flash_attn import flash_attn_func  # was: from flash_attn import ...

    out = flash_attn_func(q, k, v, causal=True)  # q (batch, seqlen, nheads, headdim)

or, for code that imports ``flash_attn`` itself, one line before it does::

    import flashtile.flash_attn; flashtile.flash_attn.install()

* :func:`flash_attn_func`, :func:`flash_attn_qkvpacked_func`,
  :func:`flash_attn_kvpacked_func`: fixed length, differentiable, through
  :func:`flashtile.torch.attention` (CPU: Numba kernels; CUDA: Triton).
* :func:`flash_attn_varlen_func`, :func:`flash_attn_varlen_qkvpacked_func`,
  :func:`flash_attn_varlen_kvpacked_func`: packed variable-length batches,
  differentiable (:mod:`.varlen`).
* :func:`flash_attn_with_kvcache`: append to a KV cache in place and attend
  (rotary, paged caches, ``cache_batch_idx``, ``cache_leftpad``), on the
  split-KV decode kernels (:mod:`.kvcache`).
* :func:`apply_rotary_emb`: ``flash_attn.layers.rotary``'s function.
* :func:`install` / :func:`uninstall`: the ``import flash_attn`` shim (:mod:`.shim`).

Signatures, defaults, shapes and return conventions are flash-attn 2.x's
(``__version__`` says which, and that flashtile runs). flashtile adds
float32 and float64 inputs, a ``sinks=`` keyword, and clear errors for
flash-attn 3's keywords and fp8 tensors. Differences: a row that sees no
key has ``softmax_lse = -inf`` (flash-attn: ``+inf``), ``softmax_lse`` is
float64 for float64 inputs, and ``S_dmask`` holds the probabilities also
without dropout. docs/flash_attn.md has the details and the measured cost
of flash-attn's layout. Needs PyTorch.
"""

from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache
from .rotary import apply_rotary_emb
from .shim import FLASH_ATTN_API, VERSION, install, installed, uninstall

#: flash-attn's API version with flashtile's as a local label, e.g. ``2.8.3+flashtile.0.1.0``.
__version__ = VERSION

__all__ = [
    "FLASH_ATTN_API",
    "apply_rotary_emb",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "installed",
    "uninstall",
]

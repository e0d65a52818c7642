"""flashtile on NVIDIA GPUs: Triton kernels for the forward, the backward and decoding.

* :func:`attention` / :func:`varlen_attention`: differentiable, the keywords
  of :func:`flashtile.torch.attention` (no ``mask``), plus ``kv_lengths``;
* :func:`decode_attention`: split-KV decoding against a contiguous or paged
  cache, as :func:`flashtile.decode_attention`;
* :func:`compile_report`: every kernel compiled ahead of time for sm_80 and
  sm_90 with the ptxas in Triton's wheel; no GPU needed.

Needs ``torch`` and ``triton`` (``pip install 'flashtile[gpu]'``; PyTorch's
CUDA wheels already bring a matching Triton). The kernels take CUDA tensors.
With ``TRITON_INTERPRET=1`` set **before this package is imported** they run
in Triton's interpreter on CPU tensors instead (slowly: NumPy per tile); that
is how the test suite checks them on machines without a GPU. ``triton.jit``
reads the variable when it decorates the kernels, so the choice is made once
per process, at import; :data:`INTERPRET` records it.
"""

try:
    import torch as _torch  # noqa: F401
    import triton as _triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "flashtile.triton needs PyTorch and Triton: pip install 'flashtile[gpu]' (PyTorch's "
        "CUDA wheels include Triton)"
    ) from exc

from .api import attention, decode_attention, varlen_attention
from .compile import compile_report
from .tiles import INTERPRET

__all__ = ["INTERPRET", "attention", "compile_report", "decode_attention", "varlen_attention"]

"""flashtile on NVIDIA GPUs: Triton kernels for the forward, the backward and decoding.

* :func:`attention` / :func:`varlen_attention`: differentiable, the keywords
  of :func:`flashtile.torch.attention` (no ``mask``), plus ``kv_lengths``;
  :func:`attention_backward`: the gradients from a kept ``(out, lse)``, as
  :func:`flashtile.attention_backward`;
* :func:`decode_attention`: split-KV decoding against a contiguous or paged
  cache, as :func:`flashtile.decode_attention`;
* :func:`flex_attention`: FlexAttention's API, a user's ``score_mod`` and
  block mask compiled into the forward and backward kernels
  (:mod:`flashtile.triton.flex`);
* :func:`compile_report`: every kernel compiled ahead of time for sm_80 and
  sm_90 with the ptxas in Triton's wheel; no GPU needed.

Needs ``torch`` and ``triton`` (``pip install 'flashtile[gpu]'``; PyTorch's
CUDA wheels already bring a matching Triton). The kernels take CUDA tensors.
With ``TRITON_INTERPRET=1`` they run in Triton's interpreter on CPU tensors
instead (slowly: NumPy per tile); that is how the test suite checks them on
machines without a GPU. ``triton.jit`` reads the variable when it decorates
the kernels, which happens when the names above are first used, so set it
before that (before importing ``flashtile.triton`` is always early enough);
:data:`INTERPRET` records the choice, made once per process.

Importing this package itself imports nothing heavy: ``flashtile --help``
and the ``gpu`` command's parser work without torch or triton.
"""

import importlib

_EXPORTS = {
    "attention": "api",
    "attention_backward": "api",
    "varlen_attention": "api",
    "decode_attention": "api",
    "flex_attention": "flex",
    "compile_report": "compile",
    "INTERPRET": "tiles",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashtile.triton' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    except ImportError as exc:
        if exc.name not in ("torch", "triton"):
            raise
        raise ImportError(
            "flashtile.triton needs PyTorch and Triton: pip install 'flashtile[gpu]' (PyTorch's "
            "CUDA wheels include Triton)"
        ) from exc
    return getattr(module, name)

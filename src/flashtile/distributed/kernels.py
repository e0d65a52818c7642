"""The kernels a rank runs on its own blocks: flashtile's CPU kernels or its Triton kernels.

The ring engine (:mod:`.engine`), Ulysses and :func:`.decode.context_parallel_decode`
reach the local kernels only through a :class:`LocalKernels`, chosen once per
call by the tensors' device (:func:`for_device`):

* CPU tensors (gloo): :func:`flashtile.attention`, :func:`flashtile.attention_backward`
  and :func:`flashtile.decode_attention` on zero-copy NumPy views; blocks are
  computed in float32 (float64 for float64 inputs);
* CUDA tensors (NCCL): :mod:`flashtile.triton`'s kernels, computing in the
  input dtype (float16/bfloat16 on the tensor cores, float32 accumulation).

Either way partial results are merged, and gradients accumulated, in float32
(float64 for float64 inputs) by :func:`flashtile.merge.merge_partials`, the
arithmetic of :func:`flashtile.merge_states`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import flashtile
import flashtile.triton
from flashtile.gradients import block_gradients
from flashtile.torch.arrays import as_numpy


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and gradients summed in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class LocalKernels:
    """One device's kernels, on torch tensors.

    ``compute(dtype)`` is the dtype blocks are computed in for inputs of
    ``dtype``; ``attend(q, k, v, **kw) -> (out, lse)`` and ``grads(q, k, v,
    out, lse, dout, **kw) -> (dq, dk, dv, sums)`` take the keywords of
    :func:`flashtile.attention` (``causal``, ``window``, ``scale``,
    ``softcap``, ``alibi_slopes`` as a NumPy array or None; GQA whenever the
    head counts differ); ``decode(q, k_cache, v_cache, **kw) -> (out, lse)``
    those of :func:`flashtile.decode_attention`; ``check(q, k, v)`` raises
    for inputs the kernels cannot take (called before any message is posted).
    ``sums``: each query row's sum of the recomputed probabilities, for the
    precision rule (:func:`flashtile.precision.gradients_unreliable`), or
    None where the kernels do not report them.
    """

    name: str
    compute: Callable
    attend: Callable
    grads: Callable
    decode: Callable
    check: Callable


def _numpy(x, keep_bf16=False):
    """A tensor argument as NumPy: bfloat16, which NumPy lacks, as an
    ``ml_dtypes.bfloat16`` view of the same memory with ``keep_bf16`` (a KV
    cache, read as bf16 by the decode kernel), else widened to float32."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16 and not keep_bf16:
        x = x.float()
    return as_numpy(x)


def _cpu_attend(q, k, v, **kw):
    out, lse = flashtile.attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True, **kw)
    return torch.from_numpy(out), torch.from_numpy(lse)


def _cpu_grads(q, k, v, out, lse, dout, **kw):
    arrays = (t.numpy() for t in (q, k, v, out, lse, dout))
    return tuple(torch.from_numpy(g) for g in block_gradients(*arrays, **kw))


def _cpu_decode(q, k_cache, v_cache, **kw):
    kw = {key: _numpy(val) for key, val in kw.items()}
    caches = (_numpy(t, keep_bf16=True) for t in (k_cache, v_cache))
    out, lse = flashtile.decode_attention(_numpy(q), *caches, return_lse=True, **kw)
    return torch.from_numpy(np.ascontiguousarray(out)), torch.from_numpy(lse)


def _cpu_check(q, k, v) -> None:
    """Nothing beyond the entry points' own checks (:func:`.inputs.check_variants`)."""


CPU = LocalKernels("cpu", work_dtype, _cpu_attend, _cpu_grads, _cpu_decode, _cpu_check)


def _gpu_keywords(q, k, kw: dict) -> dict:
    """flashtile's keywords as :mod:`flashtile.triton` takes them (slopes as a tensor)."""
    kw = dict(kw, enable_gqa=q.shape[1] != k.shape[1])
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = torch.as_tensor(kw["alibi_slopes"], dtype=torch.float32).to(q.device)
    return kw


def _gpu_attend(q, k, v, **kw):
    with torch.no_grad():
        return flashtile.triton.attention(q, k, v, return_lse=True, **_gpu_keywords(q, k, kw))


def _gpu_grads(q, k, v, out, lse, dout, **kw):
    from flashtile.triton.api import block_gradients

    return block_gradients(q, k, v, out, lse, dout, **_gpu_keywords(q, k, kw))


def _gpu_decode(q, k_cache, v_cache, **kw):
    return flashtile.triton.decode_attention(q, k_cache, v_cache, return_lse=True, **kw)


def _gpu_check(q, k, v) -> None:
    """The Triton kernels' limits (no float64, head dims up to 256, one device)."""
    from flashtile.triton import checks  # imports triton: only for CUDA tensors

    checks.check_gpu_call(q, k, v)


GPU = LocalKernels("triton", lambda dtype: dtype, _gpu_attend, _gpu_grads, _gpu_decode, _gpu_check)


def for_device(device: torch.device) -> LocalKernels:
    """The kernels for tensors on ``device``: :data:`GPU` for CUDA, :data:`CPU` otherwise."""
    return GPU if device.type == "cuda" else CPU

"""Attention implementations the benchmark compares, behind one small interface.

Every provider takes float32 (or ``ml_dtypes.bfloat16``) NumPy arrays ``q, k, v: (B, H, T, d)`` (and
``dout: (B, H, T, d)`` for the backward), uses the default scale
``1/sqrt(d)``, and returns NumPy arrays:

* ``forward(q, k, v, causal) -> out (B, H, T, d)``
* ``forward_backward(q, k, v, dout, causal) -> (out, dq, dk, dv)``, the
  forward and the gradients of ``sum(out * dout)``, all in one timed call.

torch is an optional dependency, imported lazily inside its provider, so
``flashtile demo`` never pays for it and its absence only skips that provider
with a note.
"""

from __future__ import annotations

import numpy as np

import flashtile

#: Keys per tile of the NumPy tiled reference (large tiles keep the matmuls
#: BLAS-efficient; the result is the same for any block size).
TILED_BLOCK = 128


class Provider:
    """One attention implementation. Subclasses set ``name`` and implement the calls."""

    name = "?"
    description = ""

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` when usable here, else ``(False, why)``."""
        return True, ""

    def forward(self, q, k, v, causal: bool) -> np.ndarray:
        raise NotImplementedError

    def forward_backward(self, q, k, v, dout, causal: bool):
        raise NotImplementedError


class FlashtileProvider(Provider):
    """The compiled CPU kernel: ``flashtile.attention`` / ``attention_backward``."""

    name = "flashtile"
    description = "flashtile.attention (fused CPU kernel)"

    def forward(self, q, k, v, causal):
        return flashtile.attention(q, k, v, causal=causal)

    def forward_backward(self, q, k, v, dout, causal):
        out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True)
        dq, dk, dv = flashtile.attention_backward(q, k, v, out, lse, dout, causal=causal)
        return out, dq, dk, dv


class FlashtileDenseProvider(FlashtileProvider):
    """A variant case's dense baseline: flashtile on the same inputs, mask dropped."""

    name = "flashtile-dense"
    description = "flashtile.attention without the case's mask (variants preset)"


class FlashtileBlockMaskProvider(FlashtileProvider):
    """flashtile with a prebuilt :func:`flashtile.block_mask` at the pattern's block size."""

    name = "flashtile-blockmask"
    description = "flashtile.attention(mask=BlockMask, block_q=block_k=pattern block)"


class FlashtilePerSeqProvider(FlashtileProvider):
    """A varlen case's baseline: flashtile.attention on each sequence in turn."""

    name = "flashtile-per-seq"
    description = "flashtile.attention per packed sequence, in a loop (variants preset)"


#: Providers that only differ from flashtile on variant cases: a custom sweep
#: leaves them out unless --providers names them.
VARIANT_ONLY = ("flashtile-dense", "flashtile-blockmask", "flashtile-per-seq")
#: Providers a custom sweep runs only when --providers names them (or a preset does).
OPT_IN = (*VARIANT_ONLY, "flashtile-torch")


def _import_torch():
    """Import torch; a separate function so tests can simulate its absence."""
    import torch

    return torch


def _tensor(a: np.ndarray):
    """A tensor sharing ``a``'s memory (bfloat16 too): no copy is timed."""
    from flashtile.torch.arrays import as_tensor

    return as_tensor(a)


def _array(t) -> np.ndarray:
    """A detached tensor's memory as NumPy (bfloat16 as ``ml_dtypes.bfloat16``)."""
    from flashtile.torch.arrays import as_numpy

    return as_numpy(t)


class TorchSDPAProvider(Provider):
    """``torch.nn.functional.scaled_dot_product_attention`` on 4-D CPU tensors.

    The inputs are passed 4-D on purpose: on CPU only 4-D inputs reach the C++
    flash kernel, 3-D ones silently take the slow math path. ``is_causal`` is
    top-left aligned in torch, which equals flashtile's bottom-right mask
    because every case has ``Tq == Tk``.
    """

    name = "torch-sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention (4-D, CPU)"

    def available(self):
        try:
            torch = _import_torch()
        except ImportError:
            return False, "torch not installed: pip install 'flashtile[torch]'"
        return True, f"torch {torch.__version__}, {torch.get_num_threads()} threads"

    def forward(self, q, k, v, causal):
        torch = _import_torch()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = (_tensor(a) for a in (q, k, v))
        with torch.no_grad():
            out = sdpa(qt, kt, vt, is_causal=causal)
        return _array(out)

    def forward_backward(self, q, k, v, dout, causal):
        torch = _import_torch()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        # Fresh leaves per call, so gradients never accumulate across reps.
        qt, kt, vt = (_tensor(a).requires_grad_() for a in (q, k, v))
        out = sdpa(qt, kt, vt, is_causal=causal)
        out.backward(_tensor(dout))
        return tuple(_array(t) for t in (out, qt.grad, kt.grad, vt.grad))


class FlashtileTorchProvider(TorchSDPAProvider):
    """``flashtile.torch.attention``: the same kernels behind the torch custom ops.

    Timed like ``torch-sdpa`` (tensors shared with the NumPy inputs through
    ``from_numpy``, fresh leaves per call, ``out.backward(dout)``), so its
    time minus ``flashtile``'s is the cost of the torch layer: argument
    checks, two dispatcher calls, autograd and the tensor/array wrapping.
    """

    name = "flashtile-torch"
    description = "flashtile.torch.attention (torch custom op + autograd, same kernels)"

    def forward(self, q, k, v, causal):
        torch = _import_torch()
        from flashtile.torch import attention

        with torch.no_grad():
            out = attention(*(_tensor(a) for a in (q, k, v)), causal=causal)
        return _array(out)

    def forward_backward(self, q, k, v, dout, causal):
        from flashtile.torch import attention

        qt, kt, vt = (_tensor(a).requires_grad_() for a in (q, k, v))
        out = attention(qt, kt, vt, causal=causal)
        out.backward(_tensor(dout))
        return tuple(_array(t) for t in (out, qt.grad, kt.grad, vt.grad))


class NumpyNaiveProvider(Provider):
    """``flashtile.naive_attention``: the dense ``(T, T)`` oracle, in float32.

    Its backward is the dense textbook formula on the stored probabilities
    ``P`` (``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``): what a plain NumPy user
    would write.
    """

    name = "numpy-naive"
    description = "flashtile.naive_attention (dense T x T, NumPy)"

    def forward(self, q, k, v, causal):
        return flashtile.naive_attention(q, k, v, causal)[0]

    def forward_backward(self, q, k, v, dout, causal):
        out, p = flashtile.naive_attention(q, k, v, causal)
        scale = np.float32(1.0 / np.sqrt(q.shape[-1]))
        dv = np.swapaxes(p, -1, -2) @ dout
        dp = dout @ np.swapaxes(v, -1, -2)
        ds = p * (dp - np.sum(dout * out, axis=-1, keepdims=True))
        dq = (ds @ k) * scale
        dk = (np.swapaxes(ds, -1, -2) @ q) * scale
        return out, dq, dk, dv


class NumpyTiledProvider(Provider):
    """``flashtile.tiled_attention`` (block 128) and ``tiled_attention_backward``."""

    name = "numpy-tiled"
    description = f"flashtile.tiled_attention, block {TILED_BLOCK} (NumPy)"

    def forward(self, q, k, v, causal):
        return flashtile.tiled_attention(q, k, v, TILED_BLOCK, causal)

    def forward_backward(self, q, k, v, dout, causal):
        out, lse = flashtile.tiled_attention(q, k, v, TILED_BLOCK, causal, return_lse=True)
        dq, dk, dv = flashtile.tiled_attention_backward(
            q, k, v, out, lse, dout, block_size=TILED_BLOCK, causal=causal
        )
        return out, dq, dk, dv


#: name -> class, in the order the table lists them. torch-sdpa first: the
#: other rows report their speed relative to it.
PROVIDERS: dict[str, type[Provider]] = {
    cls.name: cls
    for cls in (
        TorchSDPAProvider,
        FlashtileProvider,
        FlashtileTorchProvider,
        FlashtileBlockMaskProvider,
        FlashtileDenseProvider,
        FlashtilePerSeqProvider,
        NumpyNaiveProvider,
        NumpyTiledProvider,
    )
}


def make_providers(names=None) -> list[Provider]:
    """Instances for ``names`` (all but :data:`OPT_IN` when None), in canonical order.

    Raises ValueError naming the unknown ones and the valid choices.
    """
    names = [n for n in PROVIDERS if n not in OPT_IN] if names is None else list(names)
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {list(PROVIDERS)}")
    return [cls() for name, cls in PROVIDERS.items() if name in names]

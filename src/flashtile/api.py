"""The fast public API: validate, lay out, call the compiled CPU kernel.

Arrays are ``(B, H, T, d)`` (also ``(H, T, d)`` and ``(T, d)``); ``q``, ``k``
and ``v`` must have identical leading dims (broadcasting would mean copying
K/V per head, which this path refuses to do silently).

dtypes: float32 and float64 run natively (the running state accumulates in
the input dtype). float16 inputs are upcast to float32, computed, and the
outputs cast back to float16; ``lse`` stays float32. bfloat16 has no NumPy
dtype: convert it to float32 first.
"""

from __future__ import annotations

import numpy as np

from ._validate import check_block_size, check_flag, check_qkv, check_same_shape, resolve_scale

#: Default tile sizes (queries x keys), picked by a sweep on the 2-core
#: machine (docs/benchmarks.md). Forward: a 256 x 512 float32 score tile is
#: 512 KiB; with the query tile and one K/V tile (d=64) about 0.8 MiB stays
#: in L2. The backward holds two score-sized tiles (P and dS), so it uses
#: 256 x 256.
FWD_BLOCKS = (256, 512)
BWD_BLOCKS = (256, 256)
#: The forward shrinks block_q (down to this) until every thread gets at
#: least four work items, so short sequences still use all cores.
MIN_BLOCK_Q = 32


def _default_block_q(n_heads: int, tq: int, block_q: int) -> int:
    """Halve ``block_q`` until ``B*H*ceil(Tq/block_q)`` items keep the cores busy."""
    import numba

    want = 4 * numba.get_num_threads()
    while block_q > MIN_BLOCK_Q and n_heads * -(-tq // block_q) < want:
        block_q //= 2
    return block_q


def _prepare(q, k, v, causal, scale, block_q, block_k, defaults):
    q, k, v, shapes = check_qkv(q, k, v)
    if q.ndim > 4:
        raise ValueError(
            f"q has {q.ndim} dims {q.shape}; flashtile.attention takes (B, H, T, d), "
            f"(H, T, d) or (T, d): merge extra leading dims into B"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"leading dims differ: q {q.shape}, k {k.shape}, v {v.shape}; "
            f"flashtile.attention needs the same (B, H) for q, k and v "
            f"(use np.broadcast_to(...).copy() if you really want copies)"
        )
    causal = check_flag(causal, "causal")
    scale = resolve_scale(scale, shapes.d)
    block_q = check_block_size(defaults[0] if block_q is None else block_q, "block_q")
    block_k = check_block_size(defaults[1] if block_k is None else block_k, "block_k")
    block_q, block_k = min(block_q, shapes.tq), min(block_k, shapes.tk)  # buffers fit the data
    work = np.float64 if q.dtype == np.float64 else np.float32

    def as4d(a):
        return np.ascontiguousarray(a.reshape((1,) * (4 - a.ndim) + a.shape), dtype=work)

    return as4d(q), as4d(k), as4d(v), shapes, q.dtype, causal, scale, block_q, block_k


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, block_q=None, block_k=None):
    """Exact attention ``softmax(q k^T * scale) v`` with the fused CPU kernel.

    Args:
        q: ``(B, H, Tq, d)``, or ``(H, Tq, d)`` or ``(Tq, d)``.
        k: ``(B, H, Tk, d)``; v: ``(B, H, Tk, dv)`` (same leading dims as q).
        causal: mask keys after each query, aligned bottom-right: query ``i``
            sees key ``j`` iff ``j <= i + Tk - Tq`` (see :mod:`flashtile.masks`).
        scale: score multiplier, default ``1/sqrt(d)``.
        return_lse: also return ``lse = log(sum_j exp(score_ij))`` ``(..., Tq)``.
        block_q, block_k: tile sizes (tuning knobs; any value is exact).

    Returns:
        ``out (..., Tq, dv)`` in the input dtype, and ``lse`` if asked. A query
        that sees no key gets a zero row and ``lse = -inf``.
    """
    from .cpu.blas import gemm_for, single_threaded_blas
    from .cpu.forward import forward_kernel

    auto_q = block_q is None
    q4, k4, v4, shapes, dtype, causal, scale, block_q, block_k = _prepare(
        q, k, v, causal, scale, block_q, block_k, FWD_BLOCKS
    )
    if auto_q:
        block_q = _default_block_q(q4.shape[0] * q4.shape[1], shapes.tq, block_q)
    out = np.empty(q4.shape[:-1] + (shapes.dv,), dtype=q4.dtype)
    lse = np.empty(q4.shape[:-1], dtype=q4.dtype)
    with single_threaded_blas():
        forward_kernel(q4, k4, v4, out, lse, scale, causal, block_q, block_k, gemm_for(q4.dtype))
    out = out.reshape(shapes.batch + out.shape[-2:]).astype(dtype, copy=False)
    if return_lse:
        return out, lse.reshape(shapes.batch + lse.shape[-1:])
    return out


def attention_backward(
    q, k, v, out, lse, dout, *, causal=False, scale=None, block_q=None, block_k=None
):
    """Gradients ``(dq, dk, dv)`` of :func:`attention`, recomputing score tiles.

    Args:
        q, k, v, causal, scale: exactly as passed to the forward.
        out, lse: the forward's output and ``lse`` (``return_lse=True``).
        dout: gradient of the loss w.r.t. ``out``, same shape as ``out``.

    Returns:
        ``dq``, ``dk``, ``dv`` with the shapes and dtype of ``q``, ``k``, ``v``.
        Nothing of size ``Tq x Tk`` is allocated. Parallel over ``(B, H)``;
        deterministic (bit-identical from run to run).
    """
    from .cpu.backward import backward_kernel
    from .cpu.blas import gemm_for, single_threaded_blas

    q4, k4, v4, shapes, dtype, causal, scale, block_q, block_k = _prepare(
        q, k, v, causal, scale, block_q, block_k, BWD_BLOCKS
    )
    o_shape = shapes.batch + (shapes.tq, shapes.dv)
    out = check_same_shape(out, "out", o_shape, "the forward output")
    dout = check_same_shape(dout, "dout", o_shape, "the gradient of out")
    lse = check_same_shape(lse, "lse", o_shape[:-1], "from return_lse=True")

    def like_q4(a, last):
        return np.ascontiguousarray(a, dtype=q4.dtype).reshape(q4.shape[:-1] + last)

    out4, dout4 = like_q4(out, (shapes.dv,)), like_q4(dout, (shapes.dv,))
    lse4 = like_q4(lse, ())
    dq, dk, dv = np.empty_like(q4), np.empty_like(k4), np.empty_like(v4)
    with single_threaded_blas():
        backward_kernel(
            q4,
            k4,
            v4,
            out4,
            lse4,
            dout4,
            dq,
            dk,
            dv,
            scale,
            causal,
            block_q,
            block_k,
            gemm_for(q4.dtype),
        )
    return tuple(
        g.reshape(np.shape(a)).astype(dtype, copy=False)
        for g, a in zip((dq, dk, dv), (q, k, v), strict=True)
    )

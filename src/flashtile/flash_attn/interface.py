"""flash-attn 2's attention functions (``flash_attn.flash_attn_interface``) on flashtile.

Fixed length (``flash_attn_func`` and its packed forms) runs
:func:`flashtile.torch.attention`: differentiable, ``torch.compile``-able,
CPU tensors on the Numba kernels and CUDA tensors on the Triton kernels.
flash-attn's ``(batch, seqlen, nheads, headdim)`` is passed as the
``(batch, nheads, seqlen, headdim)`` view ``x.transpose(1, 2)``. On the CPU
that view is copied once, here, to the contiguous layout the kernels read,
and the copy is what the backward reads (given the strided view, the
kernels would copy it in the forward and again in the backward). CUDA
tensors go in as strided views (the Triton kernels take strides). The
output is returned contiguous, as flash-attn returns it.

Variable length (the ``varlen`` functions) runs :mod:`.varlen`.

Conventions that are flash-attn's and flashtile's alike: causal and windows
align bottom-right (query ``i`` of ``seqlen_q`` sits at ``i + seqlen_k -
seqlen_q``), ``window_size=(left, right)`` with -1 unbounded, ``softcap``
before ALiBi, ALiBi adds ``-slope * |i + seqlen_k - seqlen_q - j|``, query
head ``h`` reads kv head ``h // (nheads // nheads_k)``.
"""

from __future__ import annotations

import torch

import flashtile.torch as ftt

from . import checks
from .checks import Options
from .probabilities import identity_columns, identity_values
from .varlen import EmptyAttention, Packed, attend, check_offsets, draw_seed

#: Value columns per kernel call when computing ``S_dmask`` on CUDA (the Triton
#: kernels' largest value head dim); the CPU kernels take any width.
_GPU_COLUMNS = 256


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    **unsupported,
):
    """Exact attention of ``q`` to ``k``, ``v``, differentiable w.r.t. ``q``, ``k``, ``v``.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k: ``(batch, seqlen_k, nheads_k, headdim)``; v: ``(batch, seqlen_k,
            nheads_k, headdim_v)``; ``nheads`` a multiple of ``nheads_k``
            (MQA/GQA: query head ``h`` reads kv head ``h // (nheads // nheads_k)``).
        dropout_p: attention dropout probability (0.0 in evaluation); the
            seed comes from torch's default generator.
        softmax_scale: score multiplier, default ``1 / sqrt(headdim)``.
        causal: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``
            (bottom-right); a row that sees no key gives zeros.
        window_size: ``(left, right)``: query ``i`` sees keys ``[i + seqlen_k -
            seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 = unbounded.
        softcap: ``softcap * tanh(score / softcap)`` if > 0 (0.0 = off).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``: adds ``-slope *
            |i + seqlen_k - seqlen_q - j|`` to the scores (no gradient).
        deterministic: accepted; flashtile's backward is always deterministic.
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask``.
        sinks: flashtile's extension: ``(nheads,)`` learnable sink logits, one
            extra key per head with value zero in every row's softmax
            (differentiable; flash-attn 3 calls them ``learnable_sink``).

    Returns:
        ``out (batch, seqlen_q, nheads, headdim_v)`` (contiguous, ``q``'s
        dtype); with ``return_attn_probs`` ``(out, softmax_lse, S_dmask)``:
        ``softmax_lse (batch, nheads, seqlen_q)`` (float32; float64 for float64
        inputs; ``-inf`` for a row that sees no key) and ``S_dmask (batch,
        nheads, seqlen_q, seqlen_k)``, the probabilities (dropped entries
        negated), for testing only (:mod:`.probabilities`).
    """
    checks.refuse_keywords("flash_attn_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    return _fixed(q, k, v, opts, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    **unsupported,
):
    """:func:`flash_attn_func` with ``qkv (batch, seqlen, 3, nheads, headdim)`` stacked.

    The gradient is one ``dqkv`` of ``qkv``'s shape. Other arguments and the
    returns: as :func:`flash_attn_func`.
    """
    checks.refuse_keywords("flash_attn_qkvpacked_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    qkv = checks.check_tensor(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    _stacked(qkv, 2, 3, "qkv", "(batch, seqlen, 3, nheads, headdim)")
    return _fixed(*qkv.unbind(2), opts, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    **unsupported,
):
    """:func:`flash_attn_func` with ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` stacked."""
    checks.refuse_keywords("flash_attn_kvpacked_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    kv = checks.check_tensor(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    _stacked(kv, 2, 2, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _fixed(q, *kv.unbind(2), opts, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    sinks=None,
    **unsupported,
):
    """Attention over packed variable-length sequences, differentiable.

    The arguments not listed below are as in :func:`flash_attn_func`.

    Args:
        q: ``(total_q, nheads, headdim)``; k: ``(total_k, nheads_k, headdim)``;
            v: ``(total_k, nheads_k, headdim_v)``: the sequences' tokens
            concatenated.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` int32 offsets: sequence
            ``b`` is queries ``[cu_q[b], cu_q[b+1])`` and keys ``[cu_k[b],
            cu_k[b+1])``, attended on its own (causal, windows and ALiBi
            bottom-right within it). Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequences (checked).
        block_table: ``(batch, max_blocks)``: k and v are pages
            ``(num_blocks, page_block_size, nheads_k, headdim)`` and sequence
            ``b``'s key ``j`` is row ``j % page_block_size`` of page
            ``block_table[b, j // page_block_size]`` (gathered into a packed
            copy first).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``; slopes that differ
            between sequences run one kernel call per sequence.

    Returns:
        ``out (total_q, nheads, headdim_v)``; with ``return_attn_probs``
        ``(out, softmax_lse (nheads, total_q), S_dmask (batch, nheads,
        max_seqlen_q, max_seqlen_k))``, ``S_dmask`` zero-padded.
    """
    checks.refuse_keywords("flash_attn_varlen_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    if block_table is not None:
        k, v = _gather_pages(k, v, block_table, cu_seqlens_k)
    return _varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, return_attn_probs
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    **unsupported,
):
    """:func:`flash_attn_varlen_func` with ``qkv (total, 3, nheads, headdim)`` stacked
    and one ``cu_seqlens``/``max_seqlen`` for queries and keys."""
    checks.refuse_keywords("flash_attn_varlen_qkvpacked_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    qkv = checks.check_tensor(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    _stacked(qkv, 1, 3, "qkv", "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, opts, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
    **unsupported,
):
    """:func:`flash_attn_varlen_func` with ``kv (total_k, 2, nheads_k, headdim)`` stacked."""
    checks.refuse_keywords("flash_attn_varlen_kvpacked_func", unsupported)
    opts = checks.options(
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
    )
    kv = checks.check_tensor(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    _stacked(kv, 1, 2, "kv", "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return _varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, return_attn_probs
    )


def _stacked(t, axis: int, count: int, name: str, layout: str) -> None:
    if t.shape[axis] != count:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {layout}")


def _fixed(q, k, v, opts: Options, return_probs):
    """The fixed-length functions on checked options: ``out`` or ``(out, lse, S_dmask)``."""
    if not isinstance(return_probs, bool):
        raise TypeError(f"return_attn_probs must be True or False, got {return_probs!r}")
    checks.check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    checks.check_tensor(k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")
    checks.check_tensor(v, "v", 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    checks.check_same({"q": q, "k": k, "v": v})
    batch, _, hq, d = q.shape
    if k.shape[0] != batch or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q (batch, "
            f"seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim) and v (batch, "
            f"seqlen_k, nheads_k, headdim_v)"
        )
    checks.check_heads(hq, k.shape[2])
    checks.check_slopes(opts.alibi, batch, hq)
    if q.shape[1] == 0 or k.shape[1] == 0:  # no query or no key: zeros, as flash-attn gives
        return _empty(q, k, v, opts, return_probs)
    qt, kt, vt = (_heads_first(x) for x in (q, k, v))
    probs = None
    if return_probs:  # before the call: dropout's runs replay the generator state it sees

        def run(c0, c1, dropout):
            values = identity_values(kt.shape[2], kt.shape[:2], c0, c1, qt)
            return _attention(qt, kt, values, opts, dropout)[0]

        width = _GPU_COLUMNS if q.is_cuda else kt.shape[2]
        probs = identity_columns(run, kt.shape[2], width, opts.dropout_p, q.device)
    out, lse = _attention(qt, kt, vt, opts, True)
    out = out.transpose(1, 2).contiguous()
    return (out, lse, probs) if return_probs else out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``(batch, seqlen, nheads, d)`` as ``(batch, nheads, seqlen, d)``: a view for the
    Triton kernels (they take strides), one contiguous copy for the CPU kernels."""
    x = x.transpose(1, 2)
    return x if x.is_cuda else x.contiguous()


def _attention(qt, kt, vt, opts: Options, dropout: bool):
    """``(out, lse)`` of :func:`flashtile.torch.attention` in its ``(B, H, T, d)`` layout."""
    keywords = {}
    if dropout and opts.dropout_p > 0:
        keywords["dropout_p"] = opts.dropout_p
    if opts.sinks is not None:
        keywords["sinks"] = opts.sinks
    return ftt.attention(
        qt, kt, vt, causal=opts.causal, scale=opts.scale, window=opts.window,
        alibi_slopes=opts.alibi, softcap=opts.softcap, enable_gqa=True, return_lse=True,
        **keywords,
    )  # fmt: skip


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, return_probs):
    """The varlen functions on checked options: ``out`` or ``(out, lse, S_dmask)``."""
    if not isinstance(return_probs, bool):
        raise TypeError(f"return_attn_probs must be True or False, got {return_probs!r}")
    checks.check_tensor(q, "q", 3, "(total_q, nheads, headdim)")
    checks.check_tensor(k, "k", 3, "(total_k, nheads_k, headdim)")
    checks.check_tensor(v, "v", 3, "(total_k, nheads_k, headdim_v)")
    checks.check_same({"q": q, "k": k, "v": v})
    if k.shape[2] != q.shape[2] or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q (total_q, "
            f"nheads, headdim), k (total_k, nheads_k, headdim), v (total_k, nheads_k, headdim_v)"
        )
    checks.check_heads(q.shape[1], k.shape[1])
    packed = check_offsets(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k
    )
    checks.check_slopes(opts.alibi, packed.cu_q.size - 1, q.shape[1])
    seed = draw_seed() if opts.dropout_p > 0 else 0  # both paths take it, with its offsets
    probs = None
    if return_probs:  # (padded to the lengths passed, as flash-attn's; checked >= the longest)
        probs = _varlen_probabilities(q, k, packed, opts, seed, (max_seqlen_q, max_seqlen_k))
    out, lse = attend(q, k, v, packed, opts, seed)
    out = out.contiguous()
    return (out, lse, probs) if return_probs else out


def _varlen_probabilities(q, k, packed: Packed, opts: Options, seed: int, padded) -> torch.Tensor:
    """``S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)``, zero-padded;
    ``padded``: the ``(max_seqlen_q, max_seqlen_k)`` passed (at least the
    longest sequences, ``packed.max_q`` and ``packed.max_k``)."""
    batch, hq = packed.cu_q.size - 1, q.shape[1]
    dense = q.new_zeros((batch, int(padded[0]), hq, int(padded[1])))
    if packed.max_q == 0 or packed.max_k == 0:
        return dense.permute(0, 2, 1, 3)
    device = q.device
    seq_q, pos_q = _rows(packed.cu_q, device)
    pos_k = _rows(packed.cu_k, device)[1]

    def run(c0, c1, dropout):
        values = q.new_zeros((k.shape[0], k.shape[1], c1 - c0))
        inside = (pos_k >= c0) & (pos_k < c1)
        values[torch.nonzero(inside)[:, 0], :, pos_k[inside] - c0] = 1
        call = opts if dropout else opts._replace(dropout_p=0.0)
        return attend(q, k, values, packed, call, seed)[0]

    width = _GPU_COLUMNS if checks.on_gpu(q) else packed.max_k
    columns = identity_columns(run, packed.max_k, width, opts.dropout_p, device)
    dense[seq_q, pos_q, :, : packed.max_k] = columns
    return dense.permute(0, 2, 1, 3)


def _rows(cu, device):
    """Each packed row's sequence and its position in it, for offsets ``cu``."""
    cu = torch.as_tensor(cu, device=device)
    lengths = cu.diff()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    return sequence, torch.arange(int(cu[-1]), device=device) - cu[sequence]


def _empty(q, k, v, opts: Options, return_probs: bool):
    """:func:`_fixed` of a batch without queries or keys: zeros, ``lse = -inf`` (the
    sink's logit with sinks), zero gradients (:class:`.varlen.EmptyAttention`)."""
    (batch, tq, hq, d), tk = q.shape, k.shape[1]
    checks.check_sinks(opts.sinks, hq)
    out, lse = EmptyAttention.apply(
        q.reshape(batch * tq, hq, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        opts.sinks,
    )  # fmt: skip
    out = out.reshape(batch, tq, hq, v.shape[3])
    lse = lse.reshape(hq, batch, tq).transpose(0, 1)
    if not return_probs:
        return out
    return out, lse, q.new_zeros((batch, hq, tq, tk))


def _gather_pages(k, v, block_table, cu_seqlens_k):
    """Paged ``k``/``v`` ``(num_blocks, page_block_size, nheads_k, d)`` gathered into
    packed ``(total_k, nheads_k, d)`` tensors (differentiable, a copy)."""
    for name, t in (("k", k), ("v", v)):
        checks.check_tensor(t, name, 4, "(num_blocks, page_block_size, nheads_k, headdim) pages")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must hold the same pages "
            f"(num_blocks, page_block_size)"
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (
        torch.int32, torch.int64,
    ):  # fmt: skip
        raise TypeError(
            f"block_table must be an int32 tensor (batch, max_blocks), got "
            f"{type(block_table).__name__} {getattr(block_table, 'dtype', '')}"
        )
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise TypeError("cu_seqlens_k must be an int32 tensor of offsets")
    offsets = cu_seqlens_k.detach().long()
    if block_table.ndim != 2 or block_table.shape[0] != offsets.numel() - 1:
        raise ValueError(
            f"block_table has shape {tuple(block_table.shape)}; expected (batch, max_blocks) "
            f"with batch = {offsets.numel() - 1} (cu_seqlens_k's sequences)"
        )
    if offsets.numel() and bool((offsets.diff() < 0).any() or offsets[0] != 0):
        raise ValueError(f"cu_seqlens_k must start at 0 and never decrease, got {offsets.tolist()}")
    page = k.shape[1]
    seq, pos = _rows(offsets, k.device)
    if seq.numel() and int(seq.max()) >= block_table.shape[0]:
        raise ValueError(
            f"cu_seqlens_k has {cu_seqlens_k.numel() - 1} sequences but block_table "
            f"{tuple(block_table.shape)} has rows for {block_table.shape[0]}"
        )
    if pos.numel() and int(pos.max()) >= block_table.shape[1] * page:
        raise ValueError(
            f"a sequence has {int(pos.max()) + 1} keys but block_table holds "
            f"{block_table.shape[1]} pages of {page}"
        )
    blocks = block_table.to(k.device).long()[seq, pos // page]
    if blocks.numel() and bool(((blocks < 0) | (blocks >= k.shape[0])).any()):
        raise ValueError(f"block_table points outside the {k.shape[0]} pages of k and v")
    return k[blocks, pos % page], v[blocks, pos % page]

"""Launch the kernels on validated tensors: outputs, grids, strides, configurations.

Inputs arrive from :mod:`.api` checked and laid out: ``q (B, Hq, Tq, d)``,
``k (B, Hkv, Tk, d)``, ``v (B, Hkv, Tk, dv)`` with unit stride along the head
dim (other strides are passed through), or for packed variable-length
batches ``(1, H, total, d)`` with ``cu_seqlens``. Outputs are new contiguous
tensors: ``out`` in the input dtype, ``lse`` float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dropout import keep_threshold
from ..units import LOG2E
from .backward import attn_bwd_delta, attn_bwd_dkdv, attn_bwd_dq
from .configs import DECODE_MAX_ROWS, NOT_WITH_MODS, head_block
from .decode import decode_merge, decode_split
from .forward import attn_fwd
from .tiles import INTERPRET
from .tuning import pick


@dataclass(frozen=True)
class KernelArgs:
    """A call's variant arguments as the kernels take them: the Triton
    kernels' encoding of the one variants record
    (:class:`flashtile.variants.Variants`, checked by :mod:`.frontdoor`),
    rebuilt inside the ops from their schema arguments
    (:func:`.ops.kernel_args`), as :class:`flashtile.cpu.tiles.KernelVariants`
    is the CPU kernels' encoding.

    ``left``/``right`` = -1 mean unbounded (causal is ``right = 0``);
    ``alibi`` is ``(B or 1, Hq)`` float32, ``kv_lengths`` ``(B,)`` int32,
    ``cu_q``/``cu_k`` ``(S + 1,)`` int32 with ``max_q``/``max_k`` the longest
    sequence, all on the inputs' device; ``dropout_p`` and its ``seed``
    (:mod:`flashtile.dropout`).
    """

    scale: float
    left: int = -1
    right: int = -1
    softcap: float | None = None
    alibi: torch.Tensor | None = None
    kv_lengths: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    mods: ModArgs | None = None

    def dropout_args(self) -> tuple[int, int, int, float]:
        """``(seed, offset, threshold, scale)``: the kernels' dropout scalars
        (:mod:`flashtile.dropout`'s rule)."""
        p = self.dropout_p
        return self.seed, self.offset, keep_threshold(p), 1.0 / (1.0 - p)

    def scalars(self) -> tuple[float, float, float, float]:
        """``(scale, qk_scale, cap_in, cap_out)``: the kernels work in log2 units."""
        cap = self.softcap
        cap_in, cap_out = (self.scale / cap, cap * LOG2E) if cap else (0.0, 0.0)
        return self.scale, self.scale * LOG2E, cap_in, cap_out

    def flags(self, dtype: torch.dtype) -> dict[str, bool]:
        """The kernels' compile-time switches for this call."""
        return {
            "HAS_LEFT": self.left >= 0,
            "HAS_RIGHT": self.right >= 0,
            "SOFTCAP": self.softcap is not None,
            "ALIBI": self.alibi is not None,
            "DROPOUT": self.dropout_p > 0.0,
            "IEEE": dtype == torch.float32,
            "EMULATE_BF16": INTERPRET and dtype == torch.bfloat16,
        }

    def pointers(self, device) -> tuple[torch.Tensor, ...]:
        """``(Slopes, KvLens, CuQ, CuK)``, a 1-element dummy where unused."""
        dummy_f = torch.zeros(1, dtype=torch.float32, device=device)
        dummy_i = torch.zeros(1, dtype=torch.int32, device=device)
        alibi = dummy_f if self.alibi is None else self.alibi
        return (
            alibi,
            _or(self.kv_lengths, dummy_i),
            _or(self.cu_q, dummy_i),
            _or(self.cu_k, dummy_i),
        )

    def slope_batch_stride(self) -> int:
        return 0 if self.alibi is None or self.alibi.shape[0] == 1 else self.alibi.stride(0)

    def mod_args(self, kernel: str, device) -> tuple[tuple, dict]:
        """``(arguments, switches)`` of the mods for ``kernel`` ("attn_fwd",
        "attn_bwd_dkdv" or "attn_bwd_dq"): the tables' buffers ``F``, ``I``
        (and ``G``, the captured gradients', for the dq kernel) and the block
        lists ``Num``, ``Idx``, then the lists' sizes; dummies and None where
        there are none."""
        mods = self.mods
        grads = kernel == "attn_bwd_dq"
        dummy_f = torch.zeros(1, dtype=torch.float32, device=device)
        dummy_i = torch.zeros(1, dtype=torch.int32, device=device)
        fns = None if mods is None else mods.fns
        lists = (
            None if mods is None else (mods.q_lists if kernel == "attn_bwd_dkdv" else mods.kv_lists)
        )
        tables = (dummy_f, dummy_i.long()) if fns is None else (fns.floats, fns.ints)
        num, idx = (dummy_i, dummy_i) if lists is None else lists
        dims = (1, 1, 1, 1) if lists is None else tuple(idx.shape[1:])
        switches = {"SCORE_FN": None, "MASK_FN": None, "SPARSE": lists is not None,
                    "MAP_M": 1 if mods is None else mods.block[0],
                    "MAP_N": 1 if mods is None else mods.block[1]}  # fmt: skip
        if fns is not None:
            switches["SCORE_FN"] = fns.score if kernel == "attn_fwd" else fns.score_grad
            switches["MASK_FN"] = fns.mask if lists is not None else None
        if not grads:
            return (*tables, num, idx, *dims), switches
        want = mods is not None and mods.grads is not None
        switches["CAPTURE_FN"] = fns.capture if want else None
        return (*tables, mods.grads if want else dummy_f, num, idx, *dims), switches


@dataclass(frozen=True)
class ModArgs:
    """A user's mods as the kernels take them (:mod:`.flex`): the compiled
    functions and tables (:class:`~.mod_source.TritonMods`), a block mask's
    lists (``kv_lists``: per query block, its partial then full key blocks;
    ``q_lists``: per key block, its query blocks; each ``(Num, Idx)`` int32,
    ``(2, Bm, Hm, rows)`` and ``(2, Bm, Hm, rows, cols)``), the map's
    ``block`` ``(rows, cols)`` per block, and the captured tables' gradient
    buffer (float32, laid out like ``fns.floats``) when the backward wants it."""

    fns: object
    kv_lists: tuple | None = None
    q_lists: tuple | None = None
    block: tuple[int, int] = (1, 1)
    grads: torch.Tensor | None = None

    def fits(self, kernel: str, config) -> bool:
        """Whether ``kernel`` may launch with ``config`` for these mods: not
        one of :data:`.configs.NOT_WITH_MODS`, and tiles that lie inside
        the map's blocks."""
        if (kernel, config) in NOT_WITH_MODS:
            return False
        if self.kv_lists is None:
            return True
        return self.block[0] % config.block_m == 0 and self.block[1] % config.block_n == 0


def _or(t, default):
    return default if t is None else t


def _sequences(var: KernelArgs, batch: int, tq: int, tk: int) -> tuple[int, int, int]:
    """``(sequences, longest Tq, longest Tk)``: packed ones count from ``cu_seqlens``."""
    if var.cu_q is None:
        return batch, tq, tk
    return var.cu_q.shape[0] - 1, var.max_q, var.max_k


def _blocks(q, v) -> dict[str, int]:
    d, dv = q.shape[-1], v.shape[-1]
    return {"HEAD_D": d, "HEAD_DV": dv, "BLOCK_D": head_block(d), "BLOCK_DV": head_block(dv)}


def _tune_key(var: KernelArgs, q, longest: int) -> tuple:
    """Shape class for the tuner: dtype, head dims, switches, sequence length
    bucket, and the mods (their functions and map blocks)."""
    flags = tuple(sorted(var.flags(q.dtype).items()))
    mods = None if var.mods is None else (var.mods.fns.traced.source, var.mods.block)
    bucket = min(1 << longest.bit_length(), 8192)
    return (q.dtype, q.shape[-1], flags, var.cu_q is not None, bucket, mods)


def _run(kernel, name, q, block_d, key, grid_of, args, consts, var: KernelArgs):
    """Pick a configuration (tuning on first use on a GPU) and launch ``kernel``."""

    def launch(c):
        kernel[grid_of(c)](
            *args, **consts, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    fits = None if var.mods is None else var.mods.fits
    config = pick(name, q.element_size(), block_d, key, launch, fits)
    if var.mods is not None and var.mods.grads is not None:
        var.mods.grads.zero_()  # (the tuner's launches added into it too: atomic adds)
    launch(config)


def _strides(*tensors, dims=3):
    return [s for t in tensors for s in t.stride()[:dims]]


def forward(q, k, v, var: KernelArgs):
    """``(out (B, Hq, Tq, dv), lse (B, Hq, Tq) float32)``."""
    batch, heads, tq, _ = q.shape
    out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    seqs, max_q, max_k = _sequences(var, batch, tq, k.shape[2])
    if seqs * heads == 0 or max_q == 0:
        return out, lse
    blocks = _blocks(q, v)
    mod_args, mod_consts = var.mod_args("attn_fwd", q.device)
    consts = {**blocks, **var.flags(q.dtype), "KV_LENS": var.kv_lengths is not None,
              "VARLEN": var.cu_q is not None, **mod_consts}  # fmt: skip
    args = (
        q, k, v, out, lse, *var.pointers(q.device), *mod_args[:4], *_strides(q, k, v, out),
        *lse.stride()[:2], var.slope_batch_stride(), heads, heads // k.shape[1], tq, k.shape[2],
        var.left, var.right, *var.scalars(), *var.dropout_args(), *mod_args[4:],
    )  # fmt: skip
    key = _tune_key(var, q, max(max_q, max_k))
    grid = lambda c: (cdiv(max_q, c.block_m), seqs * heads)  # noqa: E731
    _run(attn_fwd, "attn_fwd", q, blocks["BLOCK_D"], key, grid, args, consts, var)
    return out, lse


def backward(dout, q, k, v, out, lse, var: KernelArgs):
    """``(dq, dk, dv, sums)``: the gradients shaped like ``q, k, v``
    (contiguous, input dtype) and each query row's sum of the recomputed
    probabilities, shaped like ``lse`` (the precision rule's,
    :func:`flashtile.precision.failing_rows`)."""
    batch, heads, tq, _ = q.shape
    hk = k.shape[1]
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    sums = torch.zeros_like(lse)
    seqs, max_q, max_k = _sequences(var, batch, tq, k.shape[2])
    if seqs * hk == 0 or max_k == 0:
        return dq.zero_(), dk, dv, sums
    delta = torch.empty_like(lse)
    blocks = _blocks(q, v)
    varlen = var.cu_q is not None
    if max_q > 0:
        c = pick("attn_bwd_delta", 4, blocks["BLOCK_DV"], None, None)
        attn_bwd_delta[(cdiv(max_q, c.block_m), seqs * heads)](
            out, dout, delta, var.pointers(q.device)[2], *_strides(out, dout),
            *delta.stride()[:2], heads, tq, HEAD_DV=blocks["HEAD_DV"],
            BLOCK_DV=blocks["BLOCK_DV"], BLOCK_M=c.block_m, VARLEN=varlen, num_warps=c.num_warps,
        )  # fmt: skip
    consts = {**blocks, **var.flags(q.dtype), "KV_LENS": var.kv_lengths is not None,
              "VARLEN": varlen}  # fmt: skip
    common = (*var.pointers(q.device),)
    sizes = (tq, k.shape[2], var.left, var.right, *var.scalars(), *var.dropout_args())
    key = _tune_key(var, q, max(max_q, max_k))
    mod_args, mod_consts = var.mod_args("attn_bwd_dkdv", q.device)
    kv_args = (
        q, k, v, dout, lse, delta, dk, dv, *common, *mod_args[:4], *_strides(q, k, v, dout),
        *lse.stride()[:2], *_strides(dk, dv), var.slope_batch_stride(), hk, heads // hk, *sizes,
        *mod_args[4:],
    )  # fmt: skip
    grid = lambda c: (cdiv(max_k, c.block_n), seqs * hk)  # noqa: E731
    _run(attn_bwd_dkdv, "attn_bwd_dkdv", q, blocks["BLOCK_D"], key, grid, kv_args,
         {**consts, **mod_consts}, var)  # fmt: skip
    if max_q == 0:
        return dq, dk, dv, sums
    mod_args, mod_consts = var.mod_args("attn_bwd_dq", q.device)
    q_args = (
        q, k, v, dout, lse, delta, dq, sums, *common, *mod_args[:5], *_strides(q, k, v, dout),
        *lse.stride()[:2], *_strides(dq), var.slope_batch_stride(), heads, heads // hk, *sizes,
        *mod_args[5:],
    )  # fmt: skip
    grid = lambda c: (cdiv(max_q, c.block_m), seqs * heads)  # noqa: E731
    _run(attn_bwd_dq, "attn_bwd_dq", q, blocks["BLOCK_D"], key, grid, q_args,
         {**consts, **mod_consts}, var)  # fmt: skip
    return dq, dk, dv, sums


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_rows_block(rows: int) -> int:
    """Rows of one decoding tile: the group's queries padded to a power of two, 16 to 64."""
    return min(DECODE_MAX_ROWS, head_block(rows))


#: Decoding programs per multiprocessor that ``num_splits=None`` aims at: several
#: can be resident on one, and many short chunks leave a short tail when the
#: last programs run alone.
PROGRAMS_PER_SM = 8


def auto_splits(batch: int, heads_kv: int, rows: int, longest: int, device) -> int:
    """Key chunks per sequence for ``rows`` stacked query rows per kv head
    (a GQA group times the queries): about PROGRAMS_PER_SM programs per
    multiprocessor, each chunk at least four 64-key tiles."""
    sms = 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, batch * heads_kv * cdiv(rows, decode_rows_block(rows)))
    return max(1, min(cdiv(PROGRAMS_PER_SM * sms, programs), cdiv(longest, 256)))


def decode(q, k_cache, v_cache, seqlens, table, num_splits: int, var: KernelArgs):
    """``(out (B, Hq, Tq, dv), lse (B, Hq, Tq) float32)`` against a (paged) cache.

    ``seqlens (B,)`` int32; ``table (B, pages)`` int32 or None (contiguous).
    """
    batch, heads, tq, d = q.shape
    hk, dv = k_cache.shape[1], v_cache.shape[3]
    group, rows = heads // hk, heads * tq
    out = torch.empty((batch, rows, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, rows), dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out.view(batch, heads, tq, dv), lse.view(batch, heads, tq)
    block_m = decode_rows_block(group * tq)
    row_blocks = cdiv(group * tq, block_m)
    if num_splits > 1:
        part_out = torch.empty((batch, rows, num_splits, dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, rows, num_splits), dtype=torch.float32, device=q.device)
        targets = (part_out, part_lse, *part_out.stride()[:3], *part_lse.stride())
    else:  # one chunk: the split kernel writes the result
        targets = (out, lse, out.stride(0), out.stride(1), 0, lse.stride(0), lse.stride(1), 0)
    paged = table is not None
    table_arg = table if paged else seqlens
    blocks = _blocks(q, v_cache)
    flags = var.flags(q.dtype)
    if flags.pop("DROPOUT"):  # (the front door sends a call with dropout to the forward)
        raise ValueError("the decode kernel has no dropout: run the forward (dropout_p > 0)")
    consts = {**blocks, **flags, "PAGED": paged}
    args = (
        q.reshape(batch, rows, d), k_cache, v_cache, *targets[:2], table_arg, seqlens,
        var.pointers(q.device)[0], rows * d, *_strides(k_cache, v_cache), *targets[2:],
        table_arg.stride(0), var.slope_batch_stride(), hk, group, tq, num_splits,
        k_cache.shape[2], var.left, var.right, *var.scalars()[1:],
    )  # fmt: skip

    def launch(c):
        decode_split[(num_splits, batch * hk, row_blocks)](
            *args, **consts, BLOCK_M=block_m, BLOCK_N=c.block_n, num_warps=c.num_warps,
            num_stages=c.num_stages,
        )  # fmt: skip

    key = (q.dtype, d, tuple(sorted(consts.items())), block_m, num_splits > 1)
    launch(pick("decode_split", q.element_size(), blocks["BLOCK_D"], key, launch))
    if num_splits > 1:
        c = pick("decode_merge", 4, blocks["BLOCK_DV"], None, None)
        decode_merge[(cdiv(batch * rows, c.block_m),)](
            part_out, part_lse, out, lse, batch * rows, num_splits, HEAD_DV=dv,
            BLOCK_DV=blocks["BLOCK_DV"], BLOCK_R=c.block_m,
            EMULATE_BF16=consts["EMULATE_BF16"], num_warps=c.num_warps,
        )  # fmt: skip
    return out.view(batch, heads, tq, dv), lse.view(batch, heads, tq)

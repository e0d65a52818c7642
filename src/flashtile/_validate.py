"""Input checks shared by every attention path.

Every public function validates at its boundary with these helpers, so a
mistake gets the same message whichever path the user called. Messages name
the offending values and say how to fix them.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import NamedTuple

import ml_dtypes
import numpy as np

#: NumPy's bfloat16, from ml_dtypes (NumPy itself has none).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: dtypes the library accepts; 16-bit floats accumulate in float32.
SUPPORTED_DTYPES = (np.float16, BFLOAT16, np.float32, np.float64)
_SUPPORTED = frozenset(np.dtype(t) for t in SUPPORTED_DTYPES)  # one hash per check


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the running state accumulates in for inputs of ``dtype``."""
    return _FLOAT64 if dtype == _FLOAT64 else _FLOAT32


_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
#: :func:`compute_dtype` of each supported dtype, for per-call code that
#: reads it without a Python call (the kernels' launchers).
COMPUTE_DTYPES = {np.dtype(t): compute_dtype(np.dtype(t)) for t in SUPPORTED_DTYPES}


def is_float(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype: NumPy's, or ml_dtypes' bfloat16
    (whose NumPy kind is ``"V"``), so a bf16 model's masks, sinks and slopes
    count as floats wherever a float is asked for."""
    return dtype.kind == "f" or dtype == BFLOAT16


def as_numpy(x) -> np.ndarray:
    """``x`` as a NumPy array without a copy where none is needed:
    ``np.asarray``, except for torch tensors, which are viewed through
    ``Tensor.numpy()`` (bfloat16 ones, which NumPy cannot name, as an
    ``ml_dtypes.bfloat16`` view of the same memory). A tensor that requires
    grad is refused: the NumPy API computes no gradients."""
    if type(x) is np.ndarray:
        return x
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    if torch is None or not isinstance(x, torch.Tensor):
        return np.asarray(x)
    if x.requires_grad:
        raise TypeError(
            f"a tensor that requires grad ({x.dtype}, shape {tuple(x.shape)}) reached "
            f"flashtile's NumPy API, which computes no gradients: use "
            f"flashtile.torch.attention, or pass tensor.detach()"
        )
    return tensors_as_numpy(x)[0]


def tensors_as_numpy(*tensors) -> list[np.ndarray]:
    """Torch tensors that do not require grad as NumPy views of their memory,
    several in one call (a bf16 decoding step converts three): bfloat16 as
    ``ml_dtypes.bfloat16`` (``Tensor.numpy()`` raises on bf16); GPU tensors
    are refused by ``Tensor.numpy()``, as ``np.asarray`` does."""
    torch = sys.modules["torch"]  # imported: the tensors are its
    views = []
    for x in tensors:
        if x.dtype == torch.bfloat16:
            views.append(x.view(torch.int16).numpy().view(BFLOAT16))
        else:
            views.append(x.numpy())
    return views


def as_float_array(x, name: str) -> np.ndarray:
    """:func:`as_numpy`, refusing anything that is not a real floating dtype."""
    arr = as_numpy(x)
    if arr.dtype not in _SUPPORTED:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; flashtile computes in floating point "
            f"(float16, ml_dtypes.bfloat16, float32 or float64): pass {name}.astype(np.float32) "
            f"or np.asarray({name}, dtype=np.float64)"
        )
    return arr


def check_block_size(block_size, name: str = "block_size") -> int:
    """A positive Python/NumPy integer (``bool`` is refused)."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive integer, got {block_size!r} "
            f"of type {type(block_size).__name__}"
        )
    if block_size < 1:
        raise ValueError(f"{name} must be >= 1, got {block_size}")
    return int(block_size)


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def resolve_scale(scale, head_dim: int) -> float:
    """``scale`` if given (a finite real number), else ``1/sqrt(head_dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


class AttentionShapes(NamedTuple):
    """Sizes of one attention call, layout ``(..., H, T, d)``."""

    batch: tuple[int, ...]  # broadcast leading dims of q, k and v (query heads last)
    tq: int
    tk: int
    d: int
    dv: int
    group: int = 1  # query heads per kv head (GQA/MQA); 1 = one kv head each


def check_qkv(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray, AttentionShapes]:
    """Validate ``q (..., Tq, d)``, ``k (..., Tk, d)``, ``v (..., Tk, dv)``.

    Leading dims broadcast against each other, except that the head axis
    (third from the end) may be grouped: ``k``/``v`` with ``Hkv`` heads serve
    ``Hq`` query heads when ``Hkv`` divides ``Hq`` (GQA/MQA; query head ``h``
    reads kv head ``h // (Hq // Hkv)``). The three arrays must share one
    floating dtype. Empty sequences and zero-width heads are refused.
    """
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    v = as_float_array(v, "v")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim < 2:
            raise ValueError(
                f"{name} has shape {arr.shape}; attention needs at least 2 dims "
                f"(..., T, d): for a single vector use {name}[None, :]"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: "
            f"cast them, e.g. k.astype(q.dtype)"
        )
    tq, d = q.shape[-2:]
    tk, dk = k.shape[-2:]
    tv, dv = v.shape[-2:]
    if dk != d:
        raise ValueError(
            f"q has head dim d={d} but k has d={dk} (q {q.shape}, k {k.shape}): "
            f"queries and keys must have the same last dimension"
        )
    if tv != tk:
        raise ValueError(
            f"k has Tk={tk} keys but v has {tv} values (k {k.shape}, v {v.shape}): "
            f"every key needs exactly one value row"
        )
    for label, size in (("Tq", tq), ("Tk", tk), ("d", d), ("dv", dv)):
        if size == 0:
            raise ValueError(
                f"{label} is 0 (q {q.shape}, k {k.shape}, v {v.shape}): "
                f"empty sequences and zero-width heads are not supported"
            )
    group = 1
    if q.ndim >= 3 and k.ndim >= 3 and v.ndim >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if v.shape[-3] == hkv and 1 < hkv < hq:
            if hq % hkv:
                raise ValueError(
                    f"Hq={hq} and Hkv={hkv}: for grouped-query attention Hq must be a "
                    f"multiple of Hkv (q {q.shape}, k {k.shape})"
                )
            group = hq // hkv
    kv_lead = (*k.shape[:-3], k.shape[-3] * group) if group > 1 else k.shape[:-2]
    v_lead = v.shape[:-2] if group == 1 else kv_lead
    if q.shape[:-2] == kv_lead == v_lead:  # the common case: nothing to broadcast
        return q, k, v, AttentionShapes(kv_lead, tq, tk, d, dv, group)
    try:
        batch = np.broadcast_shapes(q.shape[:-2], kv_lead, v_lead)
    except ValueError:
        raise ValueError(
            f"leading dims do not broadcast: q {q.shape[:-2]}, k {k.shape[:-2]}, "
            f"v {v.shape[:-2]} (layout is (..., T, d); give each a shape that "
            f"broadcasts, e.g. (B, H, T, d) or (1, H, T, d))"
        ) from None
    return q, k, v, AttentionShapes(batch, tq, tk, d, dv, group)


def check_softcap(softcap) -> float | None:
    """None, or a finite positive real number (``bool`` is refused) as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, np.ndarray) and softcap.ndim == 0:
        softcap = softcap.item()
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and > 0 (e.g. 50.0), got {softcap}")
    return float(softcap)


#: The layout of :func:`check_sdpa_layout` in its messages, by accepted ranks.
SDPA_LAYOUT = "(B, H, T, d) tensors as SDPA does (or (H, T, d))"


def _shapes(q, k, v) -> str:
    """The three shapes, for messages (built only when one is raised)."""
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def check_sdpa_layout(
    q, k, v, *, enable_gqa: bool, ranks=(3, 4), layout=SDPA_LAYOUT, who="flashtile.torch.attention"
) -> None:
    """SDPA's layout without broadcasting: ``q (B, Hq, Tq, d)``, ``k (B, Hkv, Tk, d)``,
    ``v (B, Hkv, Tk, dv)`` (or without ``B``), one rank from ``ranks`` for all three.

    ``Hkv != Hq`` needs ``enable_gqa`` and ``Hq % Hkv == 0``; Tq, Tk, d, dv
    must not be 0 (an empty batch is fine). Reads only ``.ndim`` and
    ``.shape``, so it checks NumPy arrays and torch tensors (any device)
    alike; raises ValueError naming the shapes and the fix (``who`` is the
    function named in the message about ranks).
    """
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)  # read once: torch sizes are slow
    if not (len(qs) == len(ks) == len(vs) and len(qs) in ranks):
        raise ValueError(f"{_shapes(q, k, v)}: {who} takes {layout}, all with the same rank")
    hq, hk, hv = qs[-3], ks[-3], vs[-3]
    if hk == 0 or hq == 0:
        raise ValueError(f"q has {hq} heads and k {hk}: attention needs at least one head each")
    if hk != hv:
        raise ValueError(f"k has {hk} heads but v has {hv}: they must have the same")
    if hq != hk and not enable_gqa:
        raise ValueError(
            f"q has {hq} heads but k and v have {hk}: pass enable_gqa=True for grouped-query "
            f"attention (as torch SDPA requires), or repeat k and v to {hq} heads"
        )
    if hq % hk:
        raise ValueError(f"enable_gqa needs Hq divisible by Hkv, got Hq={hq} and Hkv={hk}")
    if not (qs[:-3] == ks[:-3] == vs[:-3]):
        raise ValueError(
            f"batch dims differ ({_shapes(q, k, v)}): they are not broadcast (SDPA does); "
            f"expand the smaller ones, e.g. k.expand(B, -1, -1, -1)"
        )
    if qs[-1] != ks[-1]:
        raise ValueError(
            f"q and k have head dims {qs[-1]} and {ks[-1]} ({_shapes(q, k, v)}): "
            f"queries and keys must have the same last dimension"
        )
    if ks[-2] != vs[-2]:
        raise ValueError(
            f"k has {ks[-2]} keys but v has {vs[-2]} values ({_shapes(q, k, v)}): "
            f"every key needs exactly one value row"
        )
    for label, size in (("Tq", qs[-2]), ("Tk", ks[-2]), ("d", qs[-1]), ("dv", vs[-1])):
        if size == 0:
            raise ValueError(
                f"{label} is 0 ({_shapes(q, k, v)}): empty sequences and zero-width heads are "
                f"not supported (an empty batch is)"
            )


def check_same_shape(arr, name: str, expected: tuple[int, ...], hint: str) -> np.ndarray:
    """``arr`` as a float array of exactly ``expected`` shape."""
    arr = as_float_array(arr, name)
    if arr.shape != tuple(expected):
        raise ValueError(f"{name} has shape {arr.shape}, expected {tuple(expected)} ({hint})")
    return arr


def head_group(hq: int, hkv: int) -> int:
    """Query heads per kv head (GQA/MQA), at least 1; with no heads (H = 0) the
    call is empty and gives empty results, as for B = 0."""
    return max(1, hq // hkv) if hkv else 1


def check_kernel_layout(q, k, v) -> None:
    """The compiled kernels' layout: at most 4 dims, the same leading dims for
    ``q``, ``k`` and ``v`` (no broadcasting), and ``Hkv`` dividing ``Hq``."""
    if q.ndim > 4:
        raise ValueError(
            f"q has {q.ndim} dims {q.shape}; flashtile.attention takes (B, H, T, d), "
            f"(H, T, d) or (T, d): merge extra leading dims into B"
        )
    if not (q.ndim == k.ndim == v.ndim and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(
            f"leading dims differ: q {q.shape}, k {k.shape}, v {v.shape}; "
            f"flashtile.attention needs the same batch for q, k and v, and k, v with "
            f"Hq or a divisor of Hq heads (use np.broadcast_to(...).copy() for copies)"
        )
    if q.ndim >= 3 and not (
        k.shape[-3] == v.shape[-3]
        and head_group(q.shape[-3], k.shape[-3]) * k.shape[-3] == q.shape[-3]
    ):
        raise ValueError(
            f"Hq={q.shape[-3]}, k has {k.shape[-3]} heads and v {v.shape[-3]}: k and v need "
            f"the same number of heads Hkv, and Hq must be a multiple of Hkv"
        )


def check_packed(q, k, v, variants: dict) -> None:
    """A packed varlen call: ``(H, total, d)`` arrays and no mask keywords."""
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if np.ndim(arr) != 3:
            raise ValueError(
                f"{name} has shape {np.shape(arr)}; varlen_attention takes packed "
                f"(H, total, d) arrays"
            )
    for key in ("mask", "key_padding_mask", "kv_lengths", "score_mod", "mask_mod", "mods"):
        if variants.get(key) is not None:
            raise ValueError(
                f"{key} is not supported by varlen_attention: sequence boundaries already "
                f"come from cu_seqlens; use flashtile.attention on a padded batch for masks"
            )


def check_cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    """``(S + 1,)`` offsets from 0 to ``total``, never decreasing, as int64."""
    cu = np.asarray(cu)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must be int32 or int64 offsets, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"{name} has shape {cu.shape}; expected (S + 1,) offsets, S >= 1")
    # Range first, then differences in int64: np.diff of unsigned offsets wraps
    # around, so a decreasing (or past-int64) uint array would pass.
    in_range = cu.min() >= 0 and cu.max() <= total
    if not in_range or cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu.astype(np.int64)) < 0):
        raise ValueError(
            f"{name} = {cu.tolist()[:8]}{'...' if cu.size > 8 else ''} must start at 0, never "
            f"decrease, and end at the packed length {total}"
        )
    return cu.astype(np.int64)


def check_cu_seqlens_pair(cu_q, cu_k, shapes: AttentionShapes) -> tuple[np.ndarray, np.ndarray]:
    """Both varlen offset arrays (:func:`check_cu_seqlens`), with as many sequences."""
    cq = check_cu_seqlens(cu_q, "cu_seqlens_q", shapes.tq)
    ck = check_cu_seqlens(cu_k, "cu_seqlens_k", shapes.tk)
    if cq.size != ck.size:
        raise ValueError(
            f"cu_seqlens_q has {cq.size - 1} sequences but cu_seqlens_k has {ck.size - 1}"
        )
    return cq, ck


def check_num_splits(num_splits) -> int | None:
    """Decoding's key chunks per sequence: a positive integer, or None to choose."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    # More chunks than keys only add empty partials; the cap keeps it an int64.
    return min(int(num_splits), 2**62)

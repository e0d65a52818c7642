"""The attention variants: one keyword set, validated once, shared by every path.

``resolve_variants`` turns the user's keywords into a :class:`Variants`
record that the NumPy reference and the compiled kernels both read, so the
semantics cannot drift apart. The score of query ``i`` and key ``j`` is built
in this order (``p = i + Tk - Tq`` is the query's position)::

    s = scale * q_i . k_j
    s = score_mod(s, b, h, i, j)             if score_mod (never with softcap)
    s = softcap * tanh(s / softcap)          if softcap
    s = s - slope[h] * |p - j|               if alibi_slopes (ALiBi)
    s = s + mask[i, j]                       if mask is a float array
    s = -inf where hidden                    causal, window, padding, bool mask, mask_mod

and a row whose every score is ``-inf`` gives zeros and ``lse = -inf``.
Visibility by position (causal, window, padding) is :mod:`flashtile.masks`.

``score_mod``/``mask_mod`` are a user's functions (FlexAttention's
convention), compiled into the kernels (:mod:`flashtile.mods`); a mask_mod
is summarised per tile, so empty tiles are skipped and full ones unmasked.

Two variants act after the scores:

- ``sinks`` (one logit per query head, gpt-oss's ``s_aux``): an extra key
  of score ``sinks[h]`` and value zero in every row's softmax, neither scaled
  nor masked. It is merged into the result as a partial of its own
  (:func:`flashtile.merge.add_sinks`): ``lse`` includes it, a row that sees no
  key gives zeros and ``lse = sinks[h]``.
- ``dropout_p`` with ``dropout_seed`` and ``dropout_offset``: each
  probability is kept with probability ``1 - p`` and scaled by ``1 / (1 -
  p)`` (:mod:`flashtile.dropout`: the decisions, reproducible from the seed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ._validate import BFLOAT16, AttentionShapes, as_numpy, check_flag, check_softcap, is_float
from .dropout import check_counter_range, check_dropout
from .masks import BlockMask, normalize_window
from .mods import Mods, mask_block_states
from .numpy_mods import cached_numpy_mods
from .units import LOG2E

#: Float mask values below ``-MASK_LIMIT`` count as ``-inf`` (hidden), and
#: values above it are refused. The kernels work in log2 units, where a
#: float32 score beyond ``FLT_MAX / log2(e)`` overflows; fixing the rule here
#: makes every path and dtype agree. ``finfo(float32).min``, which Hugging Face
#: masks use for hidden positions, lies below it.
MASK_LIMIT = float(np.finfo(np.float32).max) / LOG2E


@dataclass(frozen=True)
class Variants:
    """Normalised variant keywords (see the module docstring for semantics):
    the one record of both backends. :func:`resolve_variants` fills it with
    NumPy arrays for the CPU kernels (:mod:`flashtile.frontdoor`);
    :func:`flashtile.triton.frontdoor.check_variants` with tensors on the
    inputs' device for the Triton kernels (``alibi (B or 1, Hq)`` float32,
    ``kv_lengths`` int32, ``sinks`` float32, ``dropout_seed`` None when the
    plan draws it; no masks or mods there). Each backend encodes it for its
    kernels: :class:`flashtile.cpu.tiles.KernelVariants`,
    :class:`flashtile.triton.launch.KernelArgs`.

    Attributes:
        causal: bottom-right causal mask.
        left, right: window sides, -1 = unbounded (``right <= 0`` if causal).
        alibi: float64 slopes shaped to broadcast over ``(..., Hq, 1, 1)``
            scores, or None.
        softcap: the cap (> 0) or None.
        kv_lengths: ``(B,)`` int64 valid keys per batch entry, or None.
        mask_bool: bool array broadcastable to ``(..., Tq, Tk)``, or None.
        mask_add: float array broadcastable to ``(..., Tq, Tk)``, or None.
        block_mask: the user's :class:`BlockMask` when one was passed.
        sinks: ``(Hq,)`` float64 sink logits, or None.
        dropout_p, dropout_seed, dropout_offset: dropout's probability (0 =
            off), the generator's seed and counter offset (0 when off).
        mods: the compiled score/mask functions (:class:`flashtile.mods.Mods`,
            with the mask's block map), or None.
    """

    causal: bool = False
    left: int = -1
    right: int = -1
    alibi: np.ndarray | None = None
    softcap: float | None = None
    kv_lengths: np.ndarray | None = None
    mask_bool: np.ndarray | None = None
    mask_add: np.ndarray | None = None
    block_mask: BlockMask | None = None
    sinks: np.ndarray | None = None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: int = 0
    mods: Mods | None = None


def _heads_and_batch(shapes: AttentionShapes, what: str) -> tuple[int, int]:
    if len(shapes.batch) < 1:
        raise ValueError(f"{what} needs a head axis: pass (H, T, d) or (B, H, T, d) arrays")
    heads = shapes.batch[-1]
    batch = shapes.batch[-2] if len(shapes.batch) >= 2 else 1
    return batch, heads


def _check_alibi(alibi_slopes, shapes: AttentionShapes) -> np.ndarray:
    slopes = as_numpy(alibi_slopes)
    if not (is_float(slopes.dtype) or slopes.dtype.kind in "iu"):
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {slopes.dtype}")
    batch, heads = _heads_and_batch(shapes, "alibi_slopes")
    if not np.all(np.isfinite(slopes)):
        raise ValueError(f"alibi_slopes must be finite, got {slopes.tolist()}")
    if slopes.shape == (heads,):
        return slopes.astype(np.float64)[:, None, None]
    if len(shapes.batch) >= 2 and slopes.shape == (batch, heads):
        return slopes.astype(np.float64)[:, :, None, None]
    per_batch = (
        f" or (B, Hq) = ({batch}, {heads})"
        if len(shapes.batch) >= 2
        else " (per-batch slopes (B, Hq) need 4-D (B, H, T, d) inputs)"
    )
    raise ValueError(
        f"alibi_slopes has shape {slopes.shape}; expected (Hq,) = ({heads},){per_batch}, "
        f"one slope per query head"
    )


def _check_padding(kv_lengths, key_padding_mask, shapes: AttentionShapes):
    """``(kv_lengths or None, key padding as a (B, 1, 1, Tk) bool mask or None)``."""
    if kv_lengths is not None and key_padding_mask is not None:
        raise ValueError("pass kv_lengths or key_padding_mask, not both (they say the same)")
    if kv_lengths is None and key_padding_mask is None:
        return None, None
    if len(shapes.batch) != 2:
        raise ValueError(
            f"key padding needs 4-D (B, H, T, d) inputs, got leading dims {shapes.batch}"
        )
    batch = shapes.batch[0]
    if kv_lengths is not None:
        lengths = np.asarray(kv_lengths)
        if lengths.dtype.kind not in "iu":
            raise TypeError(f"kv_lengths must be integers, got dtype {lengths.dtype}")
        if lengths.shape != (batch,):
            raise ValueError(f"kv_lengths has shape {lengths.shape}, expected (B,) = ({batch},)")
        if lengths.size and (lengths.min() < 0 or lengths.max() > shapes.tk):
            raise ValueError(
                f"kv_lengths must lie in [0, Tk={shapes.tk}], got min {lengths.min()} "
                f"and max {lengths.max()}"
            )
        return lengths.astype(np.int64), None
    kpm = np.asarray(key_padding_mask)
    if kpm.dtype != bool:
        raise TypeError(f"key_padding_mask must be boolean (True = keep), got {kpm.dtype}")
    if kpm.shape != (batch, shapes.tk):
        raise ValueError(
            f"key_padding_mask has shape {kpm.shape}, expected (B, Tk) = ({batch}, {shapes.tk})"
        )
    return None, kpm[:, None, None, :]


def _check_mask(mask, shapes: AttentionShapes):
    """``(bool mask or None, additive mask or None, BlockMask or None)``."""
    if mask is None:
        return None, None, None
    blocks = None
    target = (*shapes.batch, shapes.tq, shapes.tk)
    if isinstance(mask, BlockMask):
        # A BlockMask stores its mask as 4-D (Bm, Hm, Tq, Tk): drop the
        # leading 1s it added for (H, T, d) and (T, d) inputs.
        blocks, mask = mask, mask.mask
        while mask.ndim > len(target) and mask.shape[0] == 1:
            mask = mask[0]
    mask = as_numpy(mask)
    if mask.ndim == 0:
        raise ValueError(
            "mask is a scalar: pass an array that broadcasts to (..., Tq, Tk), or "
            "mask=None to keep every key"
        )
    try:
        np.broadcast_shapes(mask.shape, target)
        fits = mask.ndim <= len(target) and np.broadcast_shapes(mask.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask has shape {mask.shape}, which does not broadcast to (..., Tq, Tk) = {target}"
        )
    if mask.dtype == bool:
        return mask, None, blocks
    if not is_float(mask.dtype):
        raise TypeError(
            f"mask has dtype {mask.dtype}: pass a bool mask (True = keep) or a float mask "
            f"added to the scores (-inf = hidden)"
        )
    if mask.dtype == BFLOAT16:  # (exact: every bfloat16 is a float32)
        mask = mask.astype(np.float32)
    # In the mask's own dtype: float16 cannot hold MASK_LIMIT (casting it warns).
    limit = min(MASK_LIMIT, float(np.finfo(mask.dtype).max))
    if np.isnan(mask).any() or (mask > limit).any():
        raise ValueError(
            f"a float mask may hold values up to {MASK_LIMIT:.3g} and -inf (hidden), not "
            f"NaN, +inf or larger values: they would turn whole rows into NaN"
        )
    if (mask < -limit).any():  # hidden, for every path and dtype
        mask = np.where(mask < -limit, -np.inf, mask)
    return None, mask, None


def resolve_variants(
    shapes: AttentionShapes,
    *,
    causal=False,
    window=None,
    alibi_slopes=None,
    softcap=None,
    kv_lengths=None,
    key_padding_mask=None,
    mask=None,
    sinks=None,
    dropout_p=0.0,
    dropout_seed=None,
    dropout_offset=0,
    score_mod=None,
    mask_mod=None,
    mods=None,
) -> Variants:
    """Validate the variant keywords against ``shapes`` and normalise them.

    ``score_mod``/``mask_mod`` are plain Python functions (compiled with
    Numba, :func:`flashtile.numpy_mods.numpy_mods`); ``mods`` a compiled
    :class:`~flashtile.mods.Mods` (how :mod:`flashtile.torch.flex` passes
    its traced mods)."""
    causal = check_flag(causal, "causal")
    left, right = normalize_window(window, causal)
    alibi = None if alibi_slopes is None else _check_alibi(alibi_slopes, shapes)
    lengths, padding = _check_padding(kv_lengths, key_padding_mask, shapes)
    mask_bool, mask_add, blocks = _check_mask(mask, shapes)
    if padding is not None:
        mask_bool = padding if mask_bool is None else (mask_bool & padding)
        blocks = None  # the summary no longer describes the combined mask
    mods = _check_mods(shapes, score_mod, mask_mod, mods, softcap, mask_bool, mask_add)
    return Variants(
        causal=causal,
        left=left,
        right=right,
        alibi=alibi,
        softcap=check_softcap(softcap),
        kv_lengths=lengths,
        mask_bool=mask_bool,
        mask_add=mask_add,
        block_mask=blocks,
        sinks=None if sinks is None else check_sinks(sinks, shapes),
        **_dropout_fields(dropout_p, dropout_seed, dropout_offset, shapes),
        mods=mods,
    )


def _check_mods(shapes, score_mod, mask_mod, mods, softcap, mask_bool, mask_add) -> Mods | None:
    """The call's compiled mods, or None; refuses combinations with two
    meanings (a score_mod with softcap, a mask_mod with a mask)."""
    if mods is not None and not isinstance(mods, Mods):
        raise TypeError(f"mods must be a flashtile.mods.Mods record, got {type(mods).__name__}")
    if mods is None and (score_mod is not None or mask_mod is not None):
        # a flag of its own per call: threads may share the compiled mods
        shared = cached_numpy_mods(score_mod, mask_mod)
        mods = dataclasses.replace(shared, ints=shared.ints.copy())
    elif mods is not None and (score_mod is not None or mask_mod is not None):
        raise ValueError("pass score_mod/mask_mod or mods, not both")
    if mods is None:
        return None
    if mods.has_score and softcap is not None:
        raise ValueError(
            "softcap and score_mod both change the scores: write the cap inside score_mod "
            "(score = cap * tanh(score / cap))"
        )
    if mods.has_mask and (mask_bool is not None or mask_add is not None):
        raise ValueError(
            "mask_mod and a mask (mask=, key_padding_mask=) both hide keys: combine them "
            "into one mask_mod (kv_lengths may go with a mask_mod)"
        )
    batch, heads = _heads_and_batch(shapes, "score_mod/mask_mod")
    mods.check_extent(batch, heads, shapes.tq, shapes.tk)
    if mods.has_mask and mods.states is None:
        mods = _with_states(mods, batch, heads, shapes.tq, shapes.tk)
    return mods


def _with_states(mods: Mods, batch: int, heads: int, tq: int, tk: int) -> Mods:
    """A copy of ``mods`` carrying its mask's block map for these sizes (the
    map is kept in ``mods`` per size: computing it reads every entry)."""
    key = (batch, heads, tq, tk)
    states = mods._maps.get(key)
    if states is None:
        states = mask_block_states(mods, batch, heads, tq, tk, mods.block)
        mods._maps[key] = states
    return dataclasses.replace(mods, states=states)


def check_sinks(sinks, shapes: AttentionShapes) -> np.ndarray:
    """``(Hq,)`` float64 sink logits by the rule of :func:`sinks_problem`."""
    hq = _heads_and_batch(shapes, "sinks")[1]
    arr = np.asarray(as_numpy(sinks))
    problem = sinks_problem(arr.shape, is_float(arr.dtype), hq) or sink_values_problem(np, arr)
    if problem:
        raise ValueError(problem)
    return arr.astype(np.float64)


def sinks_problem(shape, floating: bool, heads: int) -> str | None:
    """What is wrong with sinks of ``shape`` (``floating``: a float dtype) for
    ``heads`` query heads, or None: the one metadata rule of every path."""
    if floating and tuple(shape) == (heads,):
        return None
    return (
        f"sinks must be floats of shape (Hq,) = ({heads},), one logit per query head, got "
        f"shape {tuple(shape)}{'' if floating else ' of a non-float dtype'}"
    )


def sink_values_problem(xp, sinks) -> str | None:
    """What is wrong with the sink values (NumPy, or torch with ``xp = torch``),
    or None. A sink is finite or ``-inf`` (no sink for that head), and within
    :data:`MASK_LIMIT`, as float mask values are: past float32's range in log2
    units a float32 merge would turn the row into NaN."""
    bad = xp.isnan(sinks) | (xp.abs(sinks) > MASK_LIMIT) & ~xp.isneginf(sinks)
    if not bool(bad.any()):
        return None
    return (
        f"sinks must be -inf (no sink) or within +-{MASK_LIMIT:.3g}, not NaN, +inf or larger "
        f"values: they would turn the rows into NaN"
    )


def _dropout_fields(dropout_p, dropout_seed, dropout_offset, shapes: AttentionShapes) -> dict:
    """Variants' dropout fields, validated (:func:`flashtile.dropout.check_dropout`)."""
    p, seed, offset = check_dropout(dropout_p, dropout_seed, dropout_offset)
    if p > 0.0:  # the kernels see (B, H, T, d): missing leading dims are 1
        if len(shapes.batch) > 2:
            raise ValueError(
                f"dropout takes (B, H, T, d) inputs or fewer dims, got leading dims "
                f"{shapes.batch}: its counters name a batch entry and a head"
            )
        dims = (1, 1) + tuple(shapes.batch)
        check_counter_range(dims[-2], dims[-1])
    return {"dropout_p": p, "dropout_seed": seed, "dropout_offset": offset}


def existing_keys(va: Variants, key_padding_mask, tk: int) -> np.ndarray | None:
    """``(B, Tk)`` bool of the keys that padding leaves (True = the key exists), or None."""
    if va.kv_lengths is not None:
        return np.arange(tk) < va.kv_lengths[:, None]
    return None if key_padding_mask is None else np.asarray(key_padding_mask)


def clear_padded_keys(k, v, keep):
    """``(k, v)`` with the key rows that padding hides zeroed if they hold NaN or inf.

    Padding (``kv_lengths`` or ``key_padding_mask``) says those keys do not
    exist, so their values must never reach a result, whichever of the two
    hid them. A hidden key inside a tile still enters ``P V`` with weight 0,
    and ``0 * NaN = NaN``. Only the hidden rows are read; when one is not
    finite, new arrays are returned (the caller's are never written).

    Args:
        k, v: ``(B or 1, H, Tk, d / dv)``, or fewer leading dims (broadcast).
        keep: ``(B, Tk)`` bool, True = the key exists; or None.
    """
    if keep is None or keep.all():
        return k, v
    b_idx, j_idx = np.nonzero(~keep)
    cleared = []
    for a in (k, v):
        a4 = a.reshape((1,) * (4 - a.ndim) + a.shape)
        if not np.isfinite(a4[b_idx % a4.shape[0], :, j_idx]).all():
            a = np.where(keep[:, None, :, None], a4, 0)
        cleared.append(a)
    return tuple(cleared)

"""Argument checks shared by the flash-attn functions: errors name the values and the fix.

flash-attn 2's conventions are translated here into flashtile's keywords
once: ``window_size=(-1, -1)`` becomes ``window=None``, ``softcap=0.0``
becomes ``softcap=None``, ``num_splits=0`` becomes ``None`` (automatic).
Keywords of flash-attn 3 (or of nothing) get a TypeError that says what to
pass instead, fp8 tensors a TypeError that says to cast them.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from flashtile.dropout import check_dropout
from flashtile.variants import sink_values_problem, sinks_problem

#: dtypes the functions take (as flashtile.torch.attention does; float64 runs on the CPU).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Keywords of flash-attn 3 (hopper/flash_attn_interface.py) and of other
#: flash-attn forks, with what to do instead. Anything else unknown gets the
#: generic message naming the flash-attn 2 signature.
_FOREIGN_KEYWORDS = {
    "q_descale": "an FP8 descaling factor of flash-attn 3; flashtile computes in float16, "
    "bfloat16, float32 or float64: pass unquantized tensors and drop the descale factors",
    "qv": "flash-attn 3's extra query-value operand (MLA); compute q @ k^T + qv @ v^T "
    "scores outside, or drop it",
    "attention_chunk": "flash-attn 3's chunked attention; a sliding window is "
    "window_size=(left, right)",
    "pack_gqa": "a flash-attn 3 scheduling knob; drop it (flashtile never repeats k/v per "
    "query head)",
    "sm_margin": "a flash-attn 3 scheduling knob; drop it",
    "scheduler_metadata": "a flash-attn 3 scheduling knob; drop it",
    "seqused_q": "flash-attn 3's per-sequence used lengths; pass the real lengths in "
    "cu_seqlens_q / cu_seqlens_k",
    "page_table": "flash-attn 3's name for the paged cache's table; flash-attn 2 (and "
    "flashtile) call it block_table",
    "learnable_sink": "flash-attn 3's attention sinks; flashtile takes them as sinks= "
    "(one logit per query head)",
    "s_aux": "attention sinks; flashtile takes them as sinks= (one logit per query head)",
    "rotary_seqlens": "flash-attn 3's rotary positions; flash-attn 2 rotates at cache_seqlens",
    "cu_seqlens_k_new": "flash-attn 3's packed new keys; pass k, v as (batch, seqlen_new, "
    "nheads_k, headdim)",
}
for _alias, _of in (("k_descale", "q_descale"), ("v_descale", "q_descale"),
                    ("seqused_k", "seqused_q")):  # fmt: skip
    _FOREIGN_KEYWORDS[_alias] = _FOREIGN_KEYWORDS[_of]


def refuse_keywords(function: str, keywords: dict, extra: dict | None = None) -> None:
    """TypeError for keywords that ``function`` (flash-attn 2's signature) lacks."""
    if not keywords:
        return
    name = sorted(keywords)[0]
    why = (extra or {}).get(name) or _FOREIGN_KEYWORDS.get(name)
    if why is None:
        why = (
            "flashtile.flash_attn follows flash-attn 2.x's signatures; check the spelling, "
            f"see help(flashtile.flash_attn.{function})"
        )
    raise TypeError(f"{function}() got an unexpected keyword argument {name!r}: {why}")


def check_tensor(t, name: str, ndim: int, layout: str) -> torch.Tensor:
    """A float tensor of rank ``ndim`` (flash-attn's ``layout``, named in the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}; flash_attn functions take torch tensors")
    if t.dtype not in DTYPES:
        if "float8" in str(t.dtype):
            raise TypeError(
                f"{name} has dtype {t.dtype}: FP8 attention is flash-attn 3's; flashtile takes "
                f"float16, bfloat16, float32 or float64: pass {name}.to(torch.bfloat16)"
            )
        raise TypeError(
            f"{name} has dtype {t.dtype}; flashtile takes float16, bfloat16, float32 or float64"
        )
    if t.ndim != ndim:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} is on {t.device}: flashtile runs CPU tensors on its Numba kernels and "
            f"CUDA tensors on its Triton kernels; move the tensors to one of them"
        )
    return t


def check_same(tensors: dict[str, torch.Tensor]) -> None:
    """One dtype and one device for all the named tensors."""
    (first, t0), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(
                f"{first} has dtype {t0.dtype} but {name} has {t.dtype}: cast them to one "
                f"dtype, e.g. {name}.to({first}.dtype)"
            )
        if t.device != t0.device:
            raise ValueError(f"{first} is on {t0.device} but {name} is on {t.device}: move them")


def check_heads(hq: int, hkv: int, what: str = "k and v") -> None:
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q has {hq} heads and {what} {hkv}: the number of query heads must be a multiple "
            f"of the number of key/value heads (MQA/GQA)"
        )


class Options(NamedTuple):
    """flash-attn's keywords in flashtile's terms (see :func:`options`)."""

    dropout_p: float
    scale: float | None
    causal: bool
    window: tuple[int, int] | None  # None = unbounded on both sides
    softcap: float | None
    alibi: torch.Tensor | None
    sinks: torch.Tensor | None


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def options(
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, sinks
) -> Options:
    """flash-attn 2's keywords checked and translated (``deterministic`` is only
    checked: flashtile's CPU backward is always deterministic, its Triton
    backward has no atomics)."""
    _flag(causal, "causal")
    _flag(deterministic, "deterministic")
    check_dropout(dropout_p, 0, 0)  # the one rule (TypeError / ValueError)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
    return Options(
        float(dropout_p), softmax_scale, causal, window(window_size), cap(softcap),
        slopes(alibi_slopes), None if sinks is None else _sinks(sinks),
    )  # fmt: skip


def _sinks(sinks) -> torch.Tensor:
    """``sinks`` as a float tensor (a list too; gradients kept); its shape and
    values are :func:`check_sinks`'s, once the heads are known."""
    t = sinks if isinstance(sinks, torch.Tensor) else torch.as_tensor(sinks)
    if not t.is_floating_point():
        raise TypeError(f"sinks must be floats (one logit per query head), got dtype {t.dtype}")
    return t


def check_sinks(sinks, heads: int) -> None:
    """The one sinks rule (:func:`flashtile.variants.sinks_problem` and, in eager
    mode, the values' :func:`flashtile.variants.sink_values_problem`)."""
    if sinks is None:
        return
    problem = sinks_problem(sinks.shape, True, heads)
    if problem is None and not torch.compiler.is_compiling():
        problem = sink_values_problem(torch, sinks.detach())
    if problem:
        raise ValueError(problem)


def window(window_size) -> tuple[int, int] | None:
    """``window_size=(left, right)``, -1 = unbounded side, as flashtile's ``window``
    (None when both sides are unbounded)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size must be a pair (left, right) with -1 for an unbounded side, got "
            f"{window_size!r}"
        ) from None
    sides = []
    for side_name, side in (("left", left), ("right", right)):
        if isinstance(side, torch.Tensor) and side.numel() == 1:
            side = int(side)  # flash-attn's own tests pass torch.randint results
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size {side_name} must be an int, got {side!r}")
        if side < -1:
            raise ValueError(
                f"window_size {side_name}={side}: use a count >= 0, or -1 for unbounded"
            )
        sides.append(int(side))
    return None if sides == [-1, -1] else (sides[0], sides[1])


def cap(softcap) -> float | None:
    """``softcap``: 0.0 = off (flash-attn's default), else a finite positive float."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0 = off), got {softcap!r}")
    softcap = float(softcap)
    if softcap == 0.0:
        return None
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be 0.0 (off) or finite and > 0, got {softcap}")
    return softcap


def slopes(alibi_slopes) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        raise TypeError(
            f"alibi_slopes must be a float tensor (nheads,) or (batch, nheads), got "
            f"{type(alibi_slopes).__name__}"
        )
    if alibi_slopes.ndim not in (1, 2):
        raise ValueError(
            f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected (nheads,) or "
            f"(batch, nheads)"
        )
    return alibi_slopes


def check_slopes(alibi: torch.Tensor | None, batch: int, heads: int) -> None:
    if alibi is None:
        return
    if alibi.shape[-1] != heads or (alibi.ndim == 2 and alibi.shape[0] != batch):
        raise ValueError(
            f"alibi_slopes has shape {tuple(alibi.shape)}; expected ({heads},) or "
            f"({batch}, {heads}): one slope per query head (and batch entry)"
        )


def num_splits(value) -> int | None:
    """flash-attn's ``num_splits``: 0 = automatic (None for flashtile), else >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0 = automatic), got {value!r}")
    if value < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = automatic), got {value}")
    return None if value == 0 else int(value)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` runs on flashtile's Triton kernels (CUDA tensors); the tests
    replace it to run those paths in Triton's interpreter on CPU tensors."""
    return t.is_cuda

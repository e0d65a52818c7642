"""What one benchmark case is, and its FLOP count.

A case is one attention problem ``q, k, v: (B, H, T, d)`` (float32, or
bfloat16 with ``--dtype bfloat16``) with
``Tq == Tk == T``, run either forward only (``fwd``) or forward then backward
(``fwd+bwd``). Providers are timed on the same case side by side.

FLOP convention (the one FlashAttention's benchmarks use, written next to the
benchmark as the Triton tutorial does): the forward is two matmuls,
``S = q k^T`` and ``O = P v``, each ``2 * B * H * Tq * Tk * d``, so
``4 * B * H * Tq * Tk * d``; a causal mask halves it. The backward is five
matmuls against the forward's two, i.e. 2.5x the forward, so
``fwd+bwd = 3.5 x fwd``. The softmax ``exp`` is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MODES = ("fwd", "fwd+bwd")

#: Providers that compute the whole problem in NumPy; they are limited to
#: modest T so that a sweep finishes (numpy-naive also holds a T x T matrix).
SLOW_PROVIDERS = frozenset({"numpy-naive", "numpy-tiled"})
#: Above this T the slow providers are never run for fwd+bwd (minutes per call).
SLOW_BWD_MAX_T = 2048
#: Input dtypes a case can have (``--dtype``); the NumPy providers run float32 only.
DTYPES = ("float32", "bfloat16")


class Variant(Protocol):
    """What a case needs of its variant (:class:`.variant_cases.Variant` is the one)."""

    def describe(self, H: int) -> str:
        """A short name, e.g. ``window=(256,0)``; ``H`` is the case's query heads."""

    def pairs(self, T: int, causal: bool) -> int:
        """Visible ``(query, key)`` pairs per (batch, head)."""


@dataclass(frozen=True)
class Case:
    """One benchmark problem.

    Attributes:
        T: sequence length (queries and keys).
        d: head dimension.
        causal: bottom-right causal mask (identical to top-left as Tq == Tk).
        mode: ``"fwd"`` or ``"fwd+bwd"``.
        B, H: batch and heads.
        providers: provider names for this case, or None for "whatever the
            run selected" (presets use it to add numpy-naive to one row only).
        variant: window, block-sparse mask, GQA or varlen (see
            :mod:`.variant_cases`); its FLOPs count visible pairs only.
        dtype: the inputs' dtype, one of :data:`DTYPES` (bfloat16: the same
            standard-normal values rounded; outputs come back in bfloat16).
    """

    T: int
    d: int
    causal: bool
    mode: str
    B: int = 1
    H: int = 8
    providers: tuple[str, ...] | None = None
    variant: Variant | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype != "float32" and self.variant is not None:
            raise ValueError(f"variant cases run float32 only, got dtype {self.dtype!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("T", "d", "B", "H"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.variant is not None and self.mode != "fwd":
            raise ValueError(f"variant cases are forward only, got mode {self.mode!r}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``fwd T=4096 d=64 causal``."""
        mask = "causal" if self.causal else "full"
        label = f"{self.mode} T={self.T} d={self.d} {mask}"
        if self.dtype != "float32":
            label += " bf16"
        if self.variant is None:
            return label
        pairs = self.variant.pairs(self.T, self.causal)
        count = f"{pairs / 1e6:.3g}M" if pairs >= 1e6 else str(pairs)
        return f"{label} {self.variant.describe(self.H)}, {count} pairs/head"

    @property
    def flops(self) -> float:
        """FLOPs of the case; a variant case counts ``4 * B * H * d`` per visible pair."""
        if self.variant is not None:
            return 4.0 * self.B * self.H * self.d * self.variant.pairs(self.T, self.causal)
        return attention_flops(self.B, self.H, self.T, self.T, self.d, self.causal, self.mode)


def attention_flops(B: int, H: int, tq: int, tk: int, d: int, causal: bool, mode: str) -> float:
    """FLOPs of one attention call under the convention in the module docstring.

    ``fwd = 4 * B * H * tq * tk * d`` (halved when causal) and
    ``fwd+bwd = 3.5 * fwd`` (the backward is 2.5x the forward).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd = 4.0 * B * H * tq * tk * d
    if causal:
        fwd /= 2.0
    return fwd * 3.5 if mode == "fwd+bwd" else fwd


def slow_skip_reason(provider: str, case: Case, max_slow_t: int) -> str | None:
    """Why ``provider`` is not run on ``case`` (None when it is run).

    The NumPy providers are 10-20x slower than a fused kernel; past these
    limits one call takes tens of seconds to minutes and tells nothing new.
    """
    if provider not in SLOW_PROVIDERS:
        return None
    if case.dtype != "float32":
        return f"{provider} runs float32 only"
    t = case.T
    if t > max_slow_t:
        return f"{provider} runs only up to T={max_slow_t} (--max-slow-T)"
    if case.mode == "fwd+bwd" and t > SLOW_BWD_MAX_T:
        return f"{provider} fwd+bwd runs only up to T={SLOW_BWD_MAX_T}"
    return None


def sweep(Ts, ds, causal: str, mode: str, B: int, H: int, providers=None) -> list[Case]:
    """Cartesian product of ``Ts x ds x causal x mode`` as cases.

    ``causal`` is ``"yes"``, ``"no"`` or ``"both"``; ``mode`` is ``"fwd"``,
    ``"fwd+bwd"`` or ``"both"``.
    """
    flags = {"yes": (True,), "no": (False,), "both": (False, True)}[causal]
    modes = MODES if mode == "both" else (mode,)
    return [Case(T, d, c, m, B, H, providers) for m in modes for d in ds for T in Ts for c in flags]

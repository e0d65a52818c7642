"""Verify, then time, every provider on every case, side by side.

For one case the runner

1. builds float32 inputs ``q, k, v, dout: (B, H, T, d)`` from a fixed seed;
2. computes a float64 reference with :func:`flashtile.tiled_attention` (and
   :func:`flashtile.tiled_attention_backward` for ``fwd+bwd``), with the
   variant keywords for a variant case (:mod:`.variant_cases`; a provider
   that solves another problem, the dense baseline, gets that one's);
3. calls each provider once and compares ``out`` (and ``dq, dk, dv``) with
   the reference by the relative norm error ``||x - ref|| / ||ref||``; a
   provider at or above :data:`TOLERANCE` is reported ``FAILED`` and never
   timed (a fast wrong answer is not a result). This call is also the warm-up
   (Numba compiles here, BLAS threads start);
4. measures the peak extra memory of one call (see :mod:`.memory`);
5. times the providers in interleaved, shuffled rounds (:mod:`.timing`) so
   that slow drifts of a shared, noisy machine hit all of them alike, and
   reports the median. A provider stops early once its timed calls add up to
   ``time_budget`` seconds (at least one call is always timed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import numpy as np

import flashtile
from flashtile._validate import BFLOAT16
from flashtile.progress import Progress

from . import variant_cases, variant_providers
from .cases import Case, slow_skip_reason
from .memory import peak_memory
from .providers import Provider
from .timing import interleaved_times

#: Relative norm error a float32 provider must stay under (float32 attention
#: lands around 1e-7..1e-6; 1e-4 leaves room for long sums, not for bugs).
TOLERANCE = 1e-4
#: The same for bfloat16 inputs and outputs: the output's own rounding is
#: about 2e-3 (a wrong answer is near 1).
BF16_TOLERANCE = 2e-2
REFERENCE_BLOCK = 128
SEED = 20240526


@dataclass
class Result:
    """One provider on one case. ``status`` is ok, FAILED, ERROR or skipped."""

    case: Case
    provider: str
    status: str = "ok"
    note: str = ""
    rel_err: float | None = None
    errors: dict = field(default_factory=dict)  # per output: out, dq, dk, dv
    times: list = field(default_factory=list)  # seconds, in call order
    rss_peak: float | None = None  # bytes
    traced_peak: float | None = None  # bytes
    speedup_vs_torch: float | None = None
    speedup_vs_naive: float | None = None
    flops: float | None = None  # the work the provider is credited (default: the case's)

    @property
    def median_s(self) -> float | None:
        return median(self.times) if self.times else None

    @property
    def gflops(self) -> float | None:
        t = self.median_s
        return (self.flops or self.case.flops) / t / 1e9 if t else None


def rel_err(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; NaN/inf in ``x`` give inf."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape}, expected {ref.shape}")
    if not np.all(np.isfinite(x)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(x - ref))
    return diff / denom if denom > 0 else diff


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Seeded standard-normal float32 ``q, k, v, dout: (B, H, T, d)`` (k, v: GQA heads)."""
    if case.variant is not None:
        return variant_cases.make_inputs(case, SEED)
    rng = np.random.default_rng([SEED, case.B, case.H, case.T, case.d])
    shape = (case.B, case.H, case.T, case.d)
    dtype = np.float32 if case.dtype == "float32" else BFLOAT16
    return {
        n: rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
        for n in ("q", "k", "v", "dout")
    }


class ReferenceCache:
    """Float64 reference results, shared by the cases that need the same ones."""

    def __init__(self):
        self._fwd: dict = {}
        self._bwd: dict = {}

    def get(self, case: Case, inputs) -> dict[str, np.ndarray]:
        """``{"out": ...}``, plus ``dq, dk, dv`` for fwd+bwd, all float64."""
        key = (case.B, case.H, case.T, case.d, case.causal, case.variant, case.dtype)
        if case.variant is not None:
            if key not in self._fwd:
                self._fwd[key] = variant_cases.reference(case, inputs)
            return self._fwd[key]
        q, k, v, dout = (inputs[n].astype(np.float64) for n in ("q", "k", "v", "dout"))
        if key not in self._fwd:
            self._fwd[key] = flashtile.tiled_attention(
                q, k, v, REFERENCE_BLOCK, case.causal, return_lse=True
            )
        out, lse = self._fwd[key]
        ref = {"out": out}
        if case.mode == "fwd+bwd":
            if key not in self._bwd:
                self._bwd[key] = flashtile.tiled_attention_backward(
                    q, k, v, out, lse, dout, block_size=REFERENCE_BLOCK, causal=case.causal
                )
            ref.update(zip(("dq", "dk", "dv"), self._bwd[key], strict=True))
        return ref


def _call(provider: Provider, case: Case, inputs):
    """A zero-argument function running ``provider`` on ``case`` once."""
    if case.variant is not None:
        return variant_providers.make_call(provider, case, inputs)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    if case.mode == "fwd":
        return lambda: (provider.forward(q, k, v, case.causal),)
    return lambda: provider.forward_backward(q, k, v, dout, case.causal)


def _verify(result: Result, call, ref) -> bool:
    """Run ``call`` once, fill ``result``'s errors; True if it may be timed."""
    try:
        outputs = call()
        names = list(ref)
        if len(outputs) != len(names):
            raise ValueError(f"returned {len(outputs)} arrays, expected {len(names)}")
        result.errors = {n: rel_err(x, ref[n]) for n, x in zip(names, outputs, strict=True)}
    except Exception as exc:  # a crashing provider must not stop the sweep
        result.status, result.note = "ERROR", f"{type(exc).__name__}: {exc}"
        return False
    worst = max(result.errors, key=result.errors.get)
    result.rel_err = result.errors[worst]
    tolerance = TOLERANCE if result.case.dtype == "float32" else BF16_TOLERANCE
    if not result.rel_err < tolerance:
        result.status = "FAILED"
        result.note = f"{worst}: rel err {result.rel_err:.2e} >= {tolerance:.0e}, not timed"
        return False
    return True


def _prepare(
    provider: Provider,
    case: Case,
    inputs,
    refs: ReferenceCache,
    max_slow_t: int,
    measure_memory: bool,
    progress: Progress,
):
    """The Result of ``provider`` on ``case`` and its verified call (None: not to time)."""
    res = Result(case, provider.name)
    if case.variant is not None:
        reason = variant_providers.skip_reason(provider.name, case, max_slow_t)
    else:
        reason = slow_skip_reason(provider.name, case, max_slow_t)
    if reason:
        res.status, res.note = "skipped", reason
        return res, None
    solved = variant_providers.provider_case(provider.name, case)
    res.flops = solved.flops
    progress.show(f"{case.label}: float64 reference")
    ref = refs.get(solved, inputs)
    progress.show(f"{case.label}: verify {provider.name}")
    call = _call(provider, case, inputs)
    if not _verify(res, call, ref):
        return res, None
    if measure_memory:
        progress.show(f"{case.label}: memory {provider.name}")
        mem = peak_memory(call)
        res.rss_peak, res.traced_peak = mem.rss, mem.traced
    return res, call


def _speedups(results: list[Result]) -> None:
    """Fill each result's time ratio to torch-sdpa and numpy-naive on the same case."""
    by_name = {res.provider: res for res in results}
    for res in results:
        for other, attr in (
            ("torch-sdpa", "speedup_vs_torch"),
            ("numpy-naive", "speedup_vs_naive"),
        ):
            base = by_name.get(other)
            if res.median_s and base is not None and base.median_s:
                setattr(res, attr, base.median_s / res.median_s)


def run_case(
    case: Case,
    providers: list[Provider],
    refs: ReferenceCache,
    *,
    reps: int = 5,
    time_budget: float = 3.0,
    max_slow_t: int = 4096,
    measure_memory: bool = True,
    progress: Progress | None = None,
) -> list[Result]:
    """Verify, measure and time ``providers`` on ``case``; one Result each.

    ``providers`` must already be available (see :meth:`Provider.available`);
    the case's own provider list, slow-provider limits and unsupported modes
    are applied here and give ``skipped`` results with the reason.
    """
    progress = progress or Progress(0)
    if case.providers is not None:
        providers = [p for p in providers if p.name in case.providers]
    inputs = make_inputs(case)
    results, calls = [], {}
    for p in providers:
        res, call = _prepare(p, case, inputs, refs, max_slow_t, measure_memory, progress)
        results.append(res)
        if call is not None:
            calls[p.name] = call

    def show(name: str, r: int) -> None:
        progress.show(f"{case.label}: time {name} ({r + 1}/{reps})")

    times = interleaved_times(calls, reps, budget=time_budget, on_call=show)
    for res in results:
        res.times = times.get(res.provider, [])
    _speedups(results)
    progress.step()
    return results

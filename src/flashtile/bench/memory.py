"""Peak extra memory of one call, measured two ways.

1. **Peak RSS increase** (the figure the table shows). Numba's runtime (NRT)
   and torch allocate with ``malloc`` behind Python's back, so only the
   process's resident set sees them. On Linux we (a) return freed heap pages
   to the OS with glibc's ``malloc_trim(0)``, so memory cached from an earlier
   call cannot hide this call's allocations, (b) reset the kernel's RSS
   high-water mark by writing ``5`` to ``/proc/self/clear_refs``, (c) read
   ``VmRSS`` before and ``VmHWM`` after the call. The difference is the peak of
   every page the call touched, its outputs included. Where the reset is not
   possible (not Linux, or no permission) we fall back to
   ``resource.getrusage`` and report the increase of ``ru_maxrss``, which is
   zero unless the call beats the process's previous peak: a lower bound.
2. **tracemalloc peak**: the peak of allocations Python and NumPy report
   (NumPy registers its data buffers with tracemalloc). It misses Numba NRT
   and torch buffers entirely; it is shown as a cross-check for NumPy paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import resource
import sys
import tracemalloc
from dataclasses import dataclass

MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class PeakMemory:
    """Peak extra bytes of one call: ``rss`` (see ``method``) and ``traced``."""

    rss: float | None
    traced: float | None
    method: str


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            text = fh.read()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc only; no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def rss_method() -> str:
    """A one-line description of how the peak RSS figure is obtained here."""
    if _reset_hwm():
        return "peak RSS increase: VmHWM after - VmRSS before, HWM reset via /proc/self/clear_refs"
    return "ru_maxrss increase (lower bound: counts only growth past the process's old peak)"


def _maxrss_bytes() -> float:
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def measure_rss(fn) -> tuple[float, str]:
    """Run ``fn()`` once; return (peak extra resident bytes, method name)."""
    gc.collect()
    _malloc_trim()
    if _reset_hwm():
        before = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
        return max(0, peak - before) * 1024.0, "hwm"
    before = _maxrss_bytes()
    fn()
    return max(0.0, _maxrss_bytes() - before), "maxrss"


def measure_traced(fn) -> float:
    """Run ``fn()`` once under tracemalloc; return its peak traced bytes."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return max(0.0, float(peak - base))


def peak_memory(fn) -> PeakMemory:
    """Both figures for ``fn``; runs it twice (tracing slows the call, so apart)."""
    rss, method = measure_rss(fn)
    traced = measure_traced(fn)
    return PeakMemory(rss, traced, method)

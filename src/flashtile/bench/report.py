"""Turn benchmark results into a table (text or markdown), JSON and a plot."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict

from .cases import attention_flops
from .memory import MIB
from .runner import BF16_TOLERANCE, TOLERANCE, Result

FLOP_NOTE = (
    "GFLOP/s counts fwd = 4*B*H*T^2*d (halved when causal) and fwd+bwd = 3.5 x fwd "
    "(bwd = 2.5 x fwd); ms is the median of reps timed in shuffled rounds interleaved with the "
    "other providers"
)
VARIANT_FLOP_NOTE = (
    "variant cases (label ends in pairs/head) count useful work only: fwd = 4*B*H*d*pairs, "
    "pairs = the exact number of visible (query, key) pairs per head (causal: T(T+1)/2); "
    "torch-sdpa given a dense mask is credited the same useful pairs, flashtile-dense the "
    "dense pairs it computes"
)
SPEEDUP_NOTE = "vs torch = time(torch-sdpa) / time(provider): above 1 means faster than torch"
PLOT_HINT = "--plot needs matplotlib: pip install 'flashtile[plot]'"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _columns(results: list[Result]) -> list[tuple[str, callable]]:
    """(title, cell function) per column; the speedup columns only when measured."""
    cols = [
        ("case", lambda r: r.case.label),
        ("provider", lambda r: r.provider),
        ("ms", lambda r: _fmt(r.median_s and r.median_s * 1e3, ".2f") if r.times else r.status),
        ("reps", lambda r: str(len(r.times)) if r.times else "-"),
        ("GFLOP/s", lambda r: _fmt(r.gflops, ".1f")),
    ]
    if any(r.speedup_vs_torch is not None for r in results):
        cols.append(("vs torch", lambda r: _fmt(r.speedup_vs_torch, ".2f", "x")))
    if any(r.speedup_vs_naive is not None for r in results):
        cols.append(("vs naive", lambda r: _fmt(r.speedup_vs_naive, ".1f", "x")))
    cols += [
        ("rel err", lambda r: _fmt(r.rel_err, ".1e")),
        ("+RSS MiB", lambda r: _fmt(r.rss_peak and r.rss_peak / MIB, ".1f")),
        ("traced MiB", lambda r: _fmt(r.traced_peak and r.traced_peak / MIB, ".1f")),
        ("note", lambda r: r.note),
    ]
    return cols


def format_table(results: list[Result], markdown: bool = False) -> str:
    """All results, one row per (case, provider), as aligned text or markdown."""
    if not results:
        return "(no results)"
    cols = _columns(results)
    titles = [t for t, _ in cols]
    rows = [[fn(r) for _, fn in cols] for r in results]
    if markdown:
        right = ["---" if t in ("case", "provider", "note") else "---:" for t in titles]
        lines = ["| " + " | ".join(titles) + " |", "| " + " | ".join(right) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(t), *(len(row[i]) for row in rows)) for i, t in enumerate(titles)]

    def line(cells):
        parts = [
            c.ljust(w) if t in ("case", "provider", "note") else c.rjust(w)
            for c, w, t in zip(cells, widths, titles, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(titles), line(["-" * w for w in widths])]
    previous = None
    for r, row in zip(results, rows, strict=True):
        if previous is not None and r.case != previous:
            out.append("")  # a blank line between cases
        previous = r.case
        out.append(line(row))
    return "\n".join(out)


def footnotes(results: list[Result], memory_method: str | None) -> list[str]:
    """The definitions behind the table's columns, one line each."""
    notes = [FLOP_NOTE]
    if any(r.case.variant is not None for r in results):
        notes.append(VARIANT_FLOP_NOTE)
    if any(r.speedup_vs_torch is not None for r in results):
        notes.append(SPEEDUP_NOTE)
    if any(r.speedup_vs_naive is not None for r in results):
        notes.append("vs naive = time(numpy-naive) / time(provider), same case")
    limit = f">= {TOLERANCE:.0e}"
    if any(r.case.dtype != "float32" for r in results):
        limit += f" ({BF16_TOLERANCE:.0e} for bfloat16, on the same rounded inputs)"
    notes.append(
        f"rel err = max over outputs of ||x - ref|| / ||ref|| vs a float64 tiled reference; "
        f"{limit} is FAILED and not timed"
    )
    if memory_method:
        notes.append(f"+RSS MiB = {memory_method} (sees NumPy, Numba NRT and torch buffers)")
        notes.append(
            "traced MiB = tracemalloc peak of the same call: NumPy/Python allocations only"
        )
    return notes


def _clean(x):
    """JSON has no inf/NaN: write them as null."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def result_record(r: Result) -> dict:
    c = r.case
    return {
        "mode": c.mode,
        "T": c.T,
        "d": c.d,
        "causal": c.causal,
        "B": c.B,
        "H": c.H,
        "dtype": c.dtype,
        "provider": r.provider,
        "status": r.status,
        "note": r.note,
        "variant": None if c.variant is None else dataclasses.asdict(c.variant),
        "pairs_per_head": None if c.variant is None else c.variant.pairs(c.T, c.causal),
        "flops": r.flops or attention_flops(c.B, c.H, c.T, c.T, c.d, c.causal, c.mode),
        "rel_err": _clean(r.rel_err),
        "errors": {k: _clean(v) for k, v in r.errors.items()},
        "reps": len(r.times),
        "times_ms": [t * 1e3 for t in r.times],
        "median_ms": r.median_s and r.median_s * 1e3,
        "gflops": r.gflops,
        "speedup_vs_torch": r.speedup_vs_torch,
        "speedup_vs_naive": r.speedup_vs_naive,
        "rss_peak_mib": r.rss_peak and r.rss_peak / MIB,
        "traced_peak_mib": r.traced_peak and r.traced_peak / MIB,
    }


def to_json(
    results, machine: dict, ceiling, config: dict, notes, memory_method, startup=None, targets=()
):
    """Everything one run measured, as indented JSON text."""
    doc = {
        "machine": machine,
        "ceiling_sgemm_gflops": ceiling,
        "config": config,
        "notes": list(notes),
        "memory_method": memory_method,
        "flop_convention": FLOP_NOTE,
        "tolerance": TOLERANCE,
        "results": [result_record(r) for r in results],
        "startup_seconds": startup,
        "targets": list(targets),
    }
    return json.dumps(doc, indent=2)


def require_matplotlib():
    """Import matplotlib's pyplot headless; ImportError with the install hint."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    return plt


def plot(results: list[Result], path: str, ceiling: float | None = None) -> None:
    """GFLOP/s vs T, one line per provider, one panel per (mode, mask, d)."""
    plt = require_matplotlib()
    panels = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.gflops is not None:
            variant = "" if r.case.variant is None else r.case.variant.describe(r.case.H)
            key = (r.case.mode, r.case.causal, r.case.d, variant)
            panels[key][r.provider].append((r.case.T, r.gflops))
    if not panels:
        raise ValueError("nothing was timed, so there is nothing to plot")
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        mode, causal, d, variant = key
        for provider, points in sorted(panels[key].items()):
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=provider)
        if ceiling:
            ax.axhline(ceiling, color="grey", linestyle="--", linewidth=1, label="sgemm ceiling")
        ax.set_xscale("log", base=2)
        ts = sorted({t for points in panels[key].values() for t, _ in points})
        ax.set_xticks(ts, labels=[str(t) for t in ts])
        ax.minorticks_off()
        ax.set_title(f"{mode}, {'causal' if causal else 'full'}, d={d} {variant}".rstrip())
        ax.set_xlabel("T")
        ax.set_ylabel("GFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

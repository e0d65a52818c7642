"""``flashtile report``: the benchmark page and its plots, drawn from results.

``flashtile bench --json PATH`` keeps what a run measured and printed (any
preset). This module turns a set of those files into one Markdown page
(docs/benchmarks.md) and its plots, so the page states what the results
say and nothing else: per preset, the machine and library versions, the
command that reruns it, its tables and target lines; at the top, the plots:

- flashtile's speed-up over torch SDPA against T, forward and forward +
  backward, float32 and bfloat16 (the ``core`` runs);
- decoding bandwidth against the measured read ceiling (``decode``);
- bfloat16 against float32 time, for both libraries (``core`` in each dtype);
- small calls' time per call against torch SDPA (``calls``).

The page is a pure function of the JSON files (no dates or paths of its
own), so the same files give the same bytes; the PNGs are drawn by
matplotlib, whose bytes vary with its version, and are not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from .cli import add_parser as bench_parser

#: Lines of a run's printout that describe its setup (shown as one block).
SETUP = ("machine", "software", "bfloat16", "route", "ceiling", "cases", "note", "startup")
#: The order presets appear on the page (others follow, by name).
ORDER = ("core", "torch-op", "calls", "variants", "decode", "flex", "generate")


def load(paths) -> list[tuple[str, dict]]:
    """``(name, run)`` of each JSON file, in page order (the name is the
    file's stem: ``core``, ``core-bf16``)."""
    runs = [(Path(p).stem, json.loads(Path(p).read_text())) for p in paths]
    rank = {name: n for n, name in enumerate(ORDER)}

    def key(item):
        name, run = item
        preset = run["config"].get("preset") or ""
        return rank.get(preset, len(ORDER)), preset, name

    return sorted(runs, key=key)


def command(name: str, run: dict) -> str:
    """The command line that reruns ``run`` (kept as ``docs/bench/NAME.json``):
    every option of ``flashtile bench`` whose recorded value is not its
    default (a preset's own ``reps`` counts as its default)."""
    config = run["config"]
    parser = bench_parser(argparse.ArgumentParser().add_subparsers())
    parts = ["flashtile bench"] + ([f"--preset {config['preset']}"] if config["preset"] else [])
    for action in parser._actions:
        key, flag = action.dest, (action.option_strings or [""])[-1]
        value = config.get(key, action.default)
        default = _default_reps(config["preset"]) if key == "reps" else action.default
        if key in ("preset", "help") or not flag.startswith("--") or value == default:
            continue
        if value is True:
            parts.append(flag)
        elif isinstance(value, list | tuple):
            parts.append(f"{flag} {' '.join(str(v) for v in value)}")
        elif value is not None and value is not False:
            parts.append(f"{flag} {value}")
    parts.append(f"--json docs/bench/{name}.json")
    return " ".join(parts)


def _default_reps(preset: str) -> int | None:
    from .presets import PRESETS

    found = PRESETS.get(preset)
    return found.reps if found else None


def setup_lines(run: dict) -> list[str]:
    """The lines of a run's printout that describe its machine and setup."""
    return [line for line in run["lines"] if line.split(":")[0].strip() in SETUP]


def section(name: str, run: dict, seen: set) -> list[str]:
    """The page's lines for one run: heading, setup, command, the printout's
    tables (Markdown as is, text in blocks) and its notes as a list (a note
    or setup line already in ``seen``, an earlier section's or the page's,
    is left out)."""
    preset = run["config"].get("preset") or "custom"
    title = preset if name == preset else f"{preset} ({name.removeprefix(preset + '-')})"
    lines = [f"## {title}", "", f"Measures: {run['measures']}.", ""]
    setup = setup_lines(run)
    own = [line for line in setup if line not in seen]
    if own:
        lines += ["```text", *own, "```", ""]
    lines += [f"Rerun: `{command(name, run)}`", ""]
    block: list[str] = []

    def flush():
        while block and not block[-1].strip():
            block.pop()
        if block:
            lines.extend(["```text", *block, "```", ""])
        block.clear()

    kind = None
    for line in run["lines"]:
        if line in setup or line.startswith("wrote "):
            continue
        now = "table" if line.startswith("|") else "bullet" if line.startswith("* ") else "text"
        if now != kind:
            flush()
            if kind in ("table", "bullet"):
                lines.append("")
            kind = now
        if now == "text":
            if line.strip() or block:
                block.append(line)
        elif now == "table":
            lines.append(line)
        elif line not in seen:
            seen.add(line)
            lines.append("- " + line[2:])
    flush()
    while lines and not lines[-1]:
        lines.pop()
    return [*lines, ""]


def page(runs, images: dict[str, str]) -> str:
    """The whole page: header, the plots (``images``: caption -> relative
    path), then one section per run."""
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `flashtile report docs/bench/*.json` from the runs' JSON: "
        "do not edit by hand. -->",
        "",
        "Every figure here comes from a `flashtile bench --json` run kept in",
        "`docs/bench/`; `flashtile report docs/bench/*.json` draws this page and its",
        "plots from them. Times are medians of interleaved rounds in one process, on",
        "the machine named below: the CPU matters (Intel Xeons with AMX and AMD",
        "EPYCs rank the routes differently), so rerun on yours. What moved the",
        "numbers, and why, is in [design notes](design.md#performance-notes).",
        "",
    ]
    # The setup most runs share heads the page; a section prints only its own.
    setups = [setup_lines(run) for _, run in runs]
    common = list(dict.fromkeys(
        line for setup in setups for line in setup
        if 2 * sum(line in other for other in setups) > len(setups)
    ))  # fmt: skip
    if common:
        lines += [
            "The machine of the runs below (a section names its own where it differs):",
            "", "```text", *common, "```", "",
        ]  # fmt: skip
    for caption, path in images.items():
        lines += [f"![{caption}]({path})", ""]
    seen: set[str] = set(common)
    for name, run in runs:
        lines += section(name, run, seen)
    return "\n".join(lines).rstrip("\n") + "\n"


def _times(run: dict) -> dict:
    """``(mode, causal, d, T) -> {provider: median ms}`` of a run's timed results."""
    out = defaultdict(dict)
    for r in run.get("results", []):
        if r["median_ms"]:
            out[(r["mode"], r["causal"], r["d"], r["T"])][r["provider"]] = r["median_ms"]
    return out


def _core_speedups(run: dict) -> dict:
    """``(mode, causal, d) -> [(T, speed-up over SDPA)]`` of a core run."""
    lines = defaultdict(list)
    for (mode, causal, d, t), times in sorted(_times(run).items()):
        if "flashtile" in times and "torch-sdpa" in times:
            lines[(mode, causal, d)].append((t, times["torch-sdpa"] / times["flashtile"]))
    return lines


_CORE = "flashtile's speed-up over torch SDPA (core preset)"
_DECODE = "decoding bandwidth against the read ceiling (decode preset)"
_BF16 = "bfloat16 against float32 time, both libraries (core preset)"
_CALLS = "the fixed cost of small calls against torch SDPA (calls preset)"


def _cores(runs) -> dict:
    """The core runs by dtype."""
    return {run["config"].get("dtype", "float32"): run for _, run in runs
            if run["config"].get("preset") == "core"}  # fmt: skip


def _records(runs, preset: str) -> list:
    return next((run.get("records") or [] for _, run in runs
                 if run["config"].get("preset") == preset), [])  # fmt: skip


def captions(runs) -> dict[str, str]:
    """caption -> file name of the plots the runs allow (the page's images)."""
    cores, found = _cores(runs), {}
    if cores:
        found[_CORE] = "bench-core.png"
    if _records(runs, "decode"):
        found[_DECODE] = "bench-decode.png"
    if {"float32", "bfloat16"} <= cores.keys():
        found[_BF16] = "bench-bf16.png"
    if _records(runs, "calls"):
        found[_CALLS] = "bench-calls.png"
    return found


def plots(runs, directory: Path) -> None:
    """Draw :func:`captions`' plots into ``directory``."""
    from .report import require_matplotlib

    plt = require_matplotlib()
    directory.mkdir(parents=True, exist_ok=True)
    files = captions(runs)
    cores = _cores(runs)
    if _CORE in files:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for ax, mode in zip(axes, ("fwd", "fwd+bwd"), strict=True):
            for dtype, run in sorted(cores.items()):
                for (m, causal, d), points in _core_speedups(run).items():
                    if m == mode:
                        ts, ys = zip(*points, strict=True)
                        label = f"{dtype}, {'causal' if causal else 'full'}, d={d}"
                        ax.plot(ts, ys, marker="o", label=label)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set(title=mode, xlabel="T", xscale="log")
            ax.minorticks_off()
            ax.set_xticks([1024, 2048, 4096], ["1024", "2048", "4096"])
            ax.legend(fontsize=7)
        axes[0].set_ylabel("speed-up over torch SDPA")
        _save(fig, directory / files[_CORE])
    if _DECODE in files:
        rows = _records(runs, "decode")
        series = {
            "flashtile": [r["kv_bytes"] / r["flashtile"] / 1e9 for r in rows],
            "read ceiling (same bytes)": [
                r["kv_bytes"] / r["read"] / 1e9 if r["read"] else 0.0 for r in rows
            ],
        }
        _bars(plt, [r["case"] for r in rows], series, directory / files[_DECODE],
              ylabel="GB/s", title="decoding: bandwidth against the read ceiling")  # fmt: skip
    if _BF16 in files:
        times = {dtype: _times(run) for dtype, run in cores.items()}
        cases = sorted(times["float32"].keys() & times["bfloat16"].keys())
        labels = [f"{m} T={t} {'causal' if c else 'full'} d={d}" for m, c, d, t in cases]
        series = {
            provider: [
                _ratio(times["float32"][case].get(provider), times["bfloat16"][case].get(provider))
                for case in cases
            ]
            for provider in ("flashtile", "torch-sdpa")
        }
        _bars(plt, labels, series, directory / files[_BF16], one=True,
              ylabel="float32 time / bfloat16 time", title="bfloat16 against float32")  # fmt: skip
    if _CALLS in files:
        rows = _records(runs, "calls")
        series = {
            "flashtile": [r["flashtile"] for r in rows],
            "torch SDPA (last: the kernel alone)": [r["other"] for r in rows],
        }
        _bars(plt, [r["case"] for r in rows], series, directory / files[_CALLS],
              ylabel="us per call", yscale="log", title="small calls: time per call")  # fmt: skip


def _ratio(a, b) -> float:
    return a / b if a and b else 0.0


def _bars(plt, labels, series: dict, path: Path, one: bool = False, **axes) -> None:
    """Two bars per label (``series``: legend -> values), a line at 1 with ``one``."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = range(len(labels))
    for n, (name, ys) in enumerate(series.items()):
        ax.bar([x - 0.2 + 0.4 * n for x in xs], ys, 0.4, label=name)
    if one:
        ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=7)
    ax.set(**axes)
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``report`` to ``flashtile``'s subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="draw the benchmark page and its plots from `flashtile bench --json` files",
        description=(
            "Render runs of `flashtile bench --json` into one Markdown page (tables per "
            "preset with the machine, versions and the command that reruns it) and its "
            "plots. The page is a function of the files alone."
        ),
    )
    parser.add_argument("runs", nargs="+", help="JSON files of flashtile bench --json")
    parser.add_argument("--out", default="docs/benchmarks.md", help="the page to write")
    parser.add_argument(
        "--no-plots", action="store_true", help="write the page only (its images as they are)"
    )
    parser.set_defaults(func=run_report)
    return parser


def run_report(args) -> int:
    runs = load(args.runs)
    out = Path(args.out)
    images = captions(runs)
    if not args.no_plots:
        plots(runs, out.parent / "img")
    out.write_text(page(runs, {caption: f"img/{name}" for caption, name in images.items()}))
    print(f"wrote {out} ({len(runs)} runs, {len(images)} plots)", file=sys.stdout)
    return 0

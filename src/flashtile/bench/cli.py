"""``flashtile bench``: options, and the run from cases to table, JSON and plot.

A bare ``flashtile bench`` runs the ``issue`` preset. ``--T/--d/--causal/--mode``
describe a custom sweep instead (their cartesian product) and cannot be
combined with ``--preset``. The exit status is 1 when a provider FAILED
verification or raised, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..cli import positive_float as _positive_float
from ..cli import positive_int as _positive_int
from .cases import PRESETS, sweep
from .machine import header_lines, machine_info, sgemm_gflops
from .memory import rss_method
from .providers import OPT_IN, PROVIDERS, make_providers
from .report import footnotes, format_table, plot, require_matplotlib, to_json
from .runner import Progress, ReferenceCache, run_case
from .startup import measure_startup, startup_lines
from .torch_op import target_lines as torch_op_targets
from .variant_providers import target_lines

SWEEP_OPTIONS = ("T", "d", "causal", "mode")
DEFAULT_T = (1024, 4096)
DEFAULT_D = (64,)
DEFAULT_H = 8


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object and return its parser."""
    p = subparsers.add_parser(
        "bench",
        help="verify then time attention providers side by side (default: the issue preset)",
        description=(
            "Verify every provider against a float64 reference, then time it side by side "
            "with the others. Without case options this runs the 'issue' preset."
        ),
    )
    cases = p.add_argument_group("cases (a custom sweep; not with --preset)")
    cases.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="issue (default), quick, variants (issue 4: window, block-sparse, GQA, varlen), "
        "or torch-op (issue 5: flashtile.torch.attention vs SDPA and vs the bare kernels)",
    )
    cases.add_argument(
        "--T",
        nargs="+",
        type=_positive_int,
        metavar="T",
        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_T))})",
    )
    cases.add_argument(
        "--d", nargs="+", type=_positive_int, metavar="D", help="head dims (default 64)"
    )
    cases.add_argument("--causal", choices=("both", "yes", "no"), help="default both")
    cases.add_argument("--mode", choices=("fwd", "fwd+bwd", "both"), help="default both")
    p.add_argument("--B", type=_positive_int, default=1, help="batch (default 1)")
    p.add_argument(
        "--H",
        type=_positive_int,
        default=None,
        help=f"heads (default {DEFAULT_H}; the quick preset uses 2)",
    )
    p.add_argument(
        "--providers",
        nargs="+",
        choices=list(PROVIDERS),
        metavar="NAME",
        help=f"subset of {', '.join(PROVIDERS)} (replaces a preset's per-case choice)",
    )
    p.add_argument("--reps", type=_positive_int, help="timed calls (default 5; 9 with --decode)")
    p.add_argument(
        "--time-budget",
        type=_positive_float,
        default=3.0,
        metavar="S",
        help="stop timing a provider once its calls add up to S seconds (default 3)",
    )
    p.add_argument(
        "--max-slow-T",
        type=_positive_int,
        default=4096,
        metavar="T",
        help="largest T for numpy-naive / numpy-tiled, and for torch-sdpa given a dense "
        "T x T mask in the variants preset (default 4096)",
    )
    p.add_argument("--json", metavar="PATH", help="write every number and the machine as JSON")
    p.add_argument("--plot", metavar="PATH", help="GFLOP/s vs T per provider (needs matplotlib)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--no-ceiling", action="store_true", help="skip the sgemm ceiling measurement")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory calls")
    p.add_argument(
        "--startup",
        action="store_true",
        help="also time import + first call in new processes, cold (empty Numba cache) and warm",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="instead of the attention cases: KV-cache decoding (issue 6) in GB/s against "
        "torch SDPA and a measured memory-read ceiling (uses --reps, default 9 here)",
    )
    return p


def _build_cases(args):
    """The case list and the preset name (None for a custom sweep); ValueError on conflicts."""
    given = [f"--{o}" for o in SWEEP_OPTIONS if getattr(args, o) is not None]
    preset = args.preset
    if preset and given:
        raise ValueError(
            f"--preset {preset} fixes the cases, so {' '.join(given)} cannot be added: "
            "drop --preset for a custom sweep, or drop the case options"
        )
    if preset is None and not given:
        preset = "issue"
    if preset:
        build, default_h = PRESETS[preset]
        cases = build(args.B, args.H or default_h)
    else:
        cases = sweep(
            args.T or DEFAULT_T,
            args.d or DEFAULT_D,
            args.causal or "both",
            args.mode or "both",
            args.B,
            args.H or DEFAULT_H,
        )
    if args.providers:  # an explicit choice overrides the preset's per-case providers
        cases = [dataclasses.replace(c, providers=None) for c in cases]
        wanted = list(args.providers)
    else:
        wanted = [n for n in PROVIDERS if n not in OPT_IN]
        if all(c.providers is not None for c in cases):
            wanted = [n for n in PROVIDERS if any(n in c.providers for c in cases)]
    return cases, preset, wanted


def run_bench(args, out=None) -> int:
    """Run ``flashtile bench`` for parsed ``args``; print to ``out`` (stdout)."""
    out = out or sys.stdout
    if args.decode:
        from .decode import run_decode_bench

        return run_decode_bench(out, reps=args.reps or 9)
    try:
        cases, preset, wanted = _build_cases(args)
        if args.plot:
            require_matplotlib()  # fail before a long sweep, not after
    except (ValueError, ImportError) as exc:
        print(f"flashtile bench: error: {exc}", file=sys.stderr)
        return 2

    notes, providers = [], []
    for p in make_providers(wanted):
        ok, why = p.available()
        if ok:
            providers.append(p)
        else:
            notes.append(f"skipped {p.name}: {why}")
    torch_threads = None
    if any(p.name == "torch-sdpa" for p in providers):
        from .providers import _import_torch

        torch_threads = _import_torch().get_num_threads()

    info = machine_info(torch_threads)
    ceiling = None if args.no_ceiling else sgemm_gflops()
    for line in header_lines(info, ceiling):
        print(line, file=out)
    H = cases[0].H if cases else args.H
    print(
        f"cases   : {len(cases)} ({preset or 'custom'}), fp32, B={args.B}, H={H}; "
        f"providers: {', '.join(p.name for p in providers) or 'none'}",
        file=out,
    )
    for note in notes:
        print(f"note    : {note}", file=out)
    startup = None
    if args.startup:
        startup = measure_startup()
        for line in startup_lines(startup):
            print(line, file=out)
    out.flush()
    if not providers:
        print("flashtile bench: error: no provider is available", file=sys.stderr)
        return 1

    refs, results = ReferenceCache(), []
    progress = Progress(len(cases))
    try:
        for case in cases:
            results += run_case(
                case,
                providers,
                refs,
                reps=args.reps or 5,
                time_budget=args.time_budget,
                max_slow_t=args.max_slow_T,
                measure_memory=not args.no_memory,
                progress=progress,
            )
    finally:
        progress.close()

    memory_method = None if args.no_memory else rss_method()
    print("", file=out)
    print(format_table(results, markdown=args.markdown), file=out)
    print("", file=out)
    for note in footnotes(results, memory_method):
        print(f"* {note}", file=out)
    targets = target_lines(results) + torch_op_targets(results)
    for line in targets:
        print(f"* target: {line}", file=out)

    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
        config["preset"] = preset
        text = to_json(results, info, ceiling, config, notes, memory_method, startup, targets)
        Path(args.json).write_text(text + "\n")
        print(f"wrote {args.json}", file=out)
    if args.plot:
        try:
            plot(results, args.plot, ceiling)
        except ValueError as exc:
            print(f"flashtile bench: plot not written: {exc}", file=sys.stderr)
        else:
            print(f"wrote {args.plot}", file=out)
    return 1 if any(r.status in ("FAILED", "ERROR") for r in results) else 0

"""``flashtile bench``: options, and the run from cases to table, JSON and plot.

A bare ``flashtile bench`` runs the ``core`` preset; ``--preset NAME`` picks
another (:mod:`.presets`), ``--decode`` is ``--preset decode``.
``--T/--d/--causal/--mode`` describe a custom sweep instead (their cartesian
product) and cannot be combined with a preset. ``--new-tokens`` and
``--cache`` belong to ``--preset generate`` only. The exit status is 2 for
options that contradict each other, 1 when a provider FAILED verification or
raised, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

from ..argtypes import positive_float, positive_int
from ..progress import Progress
from .cases import DTYPES, Case, sweep
from .generate import CACHE_KINDS, DEFAULT_NEW_TOKENS
from .machine import header_lines, machine_info, sgemm_gflops
from .memory import rss_method
from .presets import DEFAULT, PRESETS, Preset
from .providers import OPT_IN, PROVIDERS, TorchSDPAProvider, _import_torch, make_providers
from .report import footnotes, format_table, plot, require_matplotlib, to_json
from .runner import ReferenceCache, run_case
from .startup import measure_startup, startup_lines

SWEEP_OPTIONS = ("T", "d", "causal", "mode")
DEFAULT_T = (1024, 4096)
DEFAULT_D = (64,)
DEFAULT_B = 1
DEFAULT_H = 8
DEFAULT_REPS = 5
DEFAULT_TIME_BUDGET = 3.0
DEFAULT_MAX_SLOW_T = 4096
#: Options of the attention benches that a preset with its own run (decode,
#: generate) does not read, with their defaults: giving one there is an
#: error, not ignored.
ATTENTION_ONLY = {
    "B": DEFAULT_B,
    "H": None,
    "providers": None,
    "time_budget": DEFAULT_TIME_BUDGET,
    "max_slow_T": DEFAULT_MAX_SLOW_T,
    "plot": None,
    "markdown": False,
    "no_ceiling": False,
    "no_memory": False,
    "startup": False,
    "dtype": "float32",
}
#: Options that only a preset's own run reads (``Preset.options``), unset by default.
RUN_ONLY = ("new_tokens", "cache")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object and return its parser."""
    p = subparsers.add_parser(
        "bench",
        help=f"verify then time attention providers side by side (default: --preset {DEFAULT})",
        description=(
            "Verify every provider against a float64 reference, then time it side by side\n"
            f"with the others. Without case options this runs the '{DEFAULT}' preset."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_presets_help(),
    )
    _add_case_options(p)
    _add_run_options(p)
    _add_output_options(p)
    p.set_defaults(func=run_bench)
    return p


def _presets_help(width: int = 79) -> str:
    """The presets and what each measures, wrapped in a hanging indent."""
    lines = ["presets:"]
    for name, preset in PRESETS.items():
        first = f"  {name:<9} "
        lines.append(
            textwrap.fill(
                preset.measures, width, initial_indent=first, subsequent_indent=" " * len(first)
            )
        )
    return "\n".join(lines)


def _add_case_options(p: argparse.ArgumentParser) -> None:
    cases = p.add_argument_group("cases (a preset, or a custom sweep of the options below)")
    which = cases.add_mutually_exclusive_group()
    which.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"a named benchmark (default {DEFAULT}; the list is at the end)",
    )
    which.add_argument(
        "--decode", dest="preset", action="store_const", const="decode", help="= --preset decode"
    )
    cases.add_argument(
        "--T",
        nargs="+",
        type=positive_int,
        metavar="T",
        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_T))})",
    )
    cases.add_argument(
        "--d", nargs="+", type=positive_int, metavar="D", help="head dims (default 64)"
    )
    cases.add_argument("--causal", choices=("both", "yes", "no"), help="default both")
    cases.add_argument("--mode", choices=("fwd", "fwd+bwd", "both"), help="default both")
    cases.add_argument("--B", type=positive_int, default=DEFAULT_B, help="batch (default 1)")
    cases.add_argument(
        "--H", type=positive_int, help=f"heads (default {DEFAULT_H}; the quick preset uses 2)"
    )
    cases.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="inputs' dtype (default float32; bfloat16: the bf16 paths, torch in bf16 too)",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("providers and timing")
    run.add_argument(
        "--providers",
        nargs="+",
        choices=list(PROVIDERS),
        metavar="NAME",
        help=f"subset of {', '.join(PROVIDERS)} (replaces a preset's per-case choice)",
    )
    run.add_argument(
        "--reps", type=positive_int, help=f"timed calls (default {DEFAULT_REPS}; 9 for decode)"
    )
    run.add_argument(
        "--time-budget",
        type=positive_float,
        default=DEFAULT_TIME_BUDGET,
        metavar="S",
        help="stop timing a provider once its calls add up to S seconds (default 3)",
    )
    run.add_argument(
        "--new-tokens",
        type=positive_int,
        metavar="N",
        help=f"--preset generate: new tokens per timed call (default {DEFAULT_NEW_TOKENS})",
    )
    run.add_argument(
        "--cache",
        choices=CACHE_KINDS,
        help=f"--preset generate: the models' KV cache (default {CACHE_KINDS[0]})",
    )
    run.add_argument(
        "--max-slow-T",
        type=positive_int,
        default=DEFAULT_MAX_SLOW_T,
        metavar="T",
        help="largest T for numpy-naive / numpy-tiled, and for torch-sdpa given a dense "
        "T x T mask in the variants preset (default 4096)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every number and the machine as JSON")
    out.add_argument("--plot", metavar="PATH", help="GFLOP/s vs T per provider (needs matplotlib)")
    out.add_argument("--markdown", action="store_true", help="print the table as markdown")
    out.add_argument("--no-ceiling", action="store_true", help="skip the sgemm ceiling measurement")
    out.add_argument("--no-memory", action="store_true", help="skip the peak-memory calls")
    out.add_argument(
        "--startup",
        action="store_true",
        help="also time import + first call in new processes, cold (empty Numba cache) and warm",
    )


class Plan(NamedTuple):
    """What one ``flashtile bench`` run does."""

    name: str | None  # the preset's name; None for a custom sweep
    preset: Preset | None
    cases: list[Case]
    providers: list[str]  # the provider names wanted, in canonical order


def plan_run(args) -> Plan:
    """The preset or sweep that ``args`` ask for; ValueError on contradicting options."""
    given = [f"--{o}" for o in SWEEP_OPTIONS if getattr(args, o) is not None]
    name = args.preset
    if name and given:
        raise ValueError(
            f"--preset {name} fixes the cases, so {' '.join(given)} cannot be added: "
            "drop --preset for a custom sweep, or drop the case options"
        )
    if name is None and not given:
        name = DEFAULT
    preset = PRESETS[name] if name else None
    own = preset is not None and preset.run is not None
    reads = preset.options if own else ()
    unused = [o for o in RUN_ONLY if getattr(args, o) is not None and o not in reads]
    if own:
        unused += [o for o, d in ATTENTION_ONLY.items() if getattr(args, o) != d]
    if unused:
        flags = " ".join("--" + o.replace("_", "-") for o in unused)
        what = f"--preset {name}" if name else "a custom sweep"
        raise ValueError(f"{what} does not use {flags}: drop them")
    if own:
        return Plan(name, preset, [], [])
    if preset is not None:
        cases = preset.cases(args.B, args.H or preset.H)
    else:
        ts, ds = args.T or DEFAULT_T, args.d or DEFAULT_D
        causal, mode = args.causal or "both", args.mode or "both"
        cases = sweep(ts, ds, causal, mode, args.B, args.H or DEFAULT_H)
    if args.dtype != "float32":  # raises for variant cases (float32 only)
        cases = [dataclasses.replace(c, dtype=args.dtype) for c in cases]
    if args.providers:  # an explicit choice overrides the preset's per-case providers
        cases = [dataclasses.replace(c, providers=None) for c in cases]
        wanted = list(args.providers)
    else:
        wanted = [n for n in PROVIDERS if n not in OPT_IN]
        if all(c.providers is not None for c in cases):
            wanted = [n for n in PROVIDERS if any(n in c.providers for c in cases)]
    return Plan(name, preset, cases, wanted)


def run_bench(args, out=None) -> int:
    """Run ``flashtile bench`` for parsed ``args``; print to ``out`` (stdout)."""
    out = out or sys.stdout
    try:
        plan = plan_run(args)
        if args.plot:
            require_matplotlib()  # fail before a long sweep, not after
    except (ValueError, ImportError) as exc:
        print(f"flashtile bench: error: {exc}", file=sys.stderr)
        return 2
    reps = args.reps or (plan.preset.reps if plan.preset else DEFAULT_REPS)
    if args.json:  # what is printed is kept for the report (flashtile report)
        out = _Tee(out)
    if plan.preset is not None and plan.preset.run is not None:
        options = {o: getattr(args, o) for o in plan.preset.options}
        records = [] if "records" in inspect.signature(plan.preset.run).parameters else None
        if records is not None:
            options["records"] = records
        status = plan.preset.run(out, reps=reps, **options)
        if args.json:
            doc = {"machine": machine_info(None), "config": _config(args, plan, reps)}
            _write_json(args.json, dict(doc, records=records or []), out)
        return status

    providers, notes = _available(plan.providers)
    info = machine_info(_torch_threads(providers))
    ceiling = None if args.no_ceiling else sgemm_gflops()
    for line in header_lines(info, ceiling):
        print(line, file=out)
    H = plan.cases[0].H if plan.cases else args.H
    print(
        f"cases   : {len(plan.cases)} ({plan.name or 'custom'}), {args.dtype}, B={args.B}, "
        f"H={H}; "
        f"providers: {', '.join(p.name for p in providers) or 'none'}",
        file=out,
    )
    for note in notes:
        print(f"note    : {note}", file=out)
    startup = measure_startup() if args.startup else None
    for line in startup_lines(startup or {}):
        print(line, file=out)
    out.flush()
    if not providers:
        print("flashtile bench: error: no provider is available", file=sys.stderr)
        return 1

    results = _run_cases(plan.cases, providers, args, reps)
    memory_method = None if args.no_memory else rss_method()
    print(f"\n{format_table(results, markdown=args.markdown)}\n", file=out)
    for note in footnotes(results, memory_method):
        print(f"* {note}", file=out)
    targets = plan.preset.targets(results) if plan.preset and plan.preset.targets else []
    for line in targets:
        print(f"* target: {line}", file=out)
    if args.json:
        config = _config(args, plan, reps)
        text = to_json(results, info, ceiling, config, notes, memory_method, startup, targets)
        _write_json(args.json, json.loads(text), out)
    if args.plot:
        _write_plot(results, args.plot, ceiling, out)
    return 1 if any(r.status in ("FAILED", "ERROR") for r in results) else 0


class _Tee:
    """``out`` that also keeps every line written to it (:attr:`lines`)."""

    def __init__(self, out):
        self.out, self.text = out, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    @property
    def lines(self) -> list[str]:
        return "".join(self.text).splitlines()


def _config(args, plan, reps) -> dict:
    """The run's options (the report shows them as the command that reruns it)."""
    skip = ("func", "command", "json", "plot")  # (outputs of the run, not what it measures)
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config["preset"], config["reps"] = plan.name, reps
    return config


def _write_json(path: str, doc: dict, out: _Tee) -> None:
    """Write a run's JSON with what it printed (``lines``) and the preset's
    one-line description."""
    preset = PRESETS.get(doc["config"]["preset"] or "")
    doc = dict(doc, measures=preset.measures if preset else "a custom sweep", lines=out.lines)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}", file=out.out)


def _available(names: list[str]):
    """The providers among ``names`` usable here, and a note for each one skipped."""
    providers, notes = [], []
    for p in make_providers(names):
        ok, why = p.available()
        if ok:
            providers.append(p)
        else:
            notes.append(f"skipped {p.name}: {why}")
    return providers, notes


def _torch_threads(providers) -> int | None:
    """torch's thread count when a torch provider runs (torch is not imported otherwise)."""
    if not any(isinstance(p, TorchSDPAProvider) for p in providers):
        return None
    return _import_torch().get_num_threads()


def _run_cases(cases, providers, args, reps: int) -> list:
    """Every case's results, in order, with a progress line on a terminal."""
    refs, results = ReferenceCache(), []
    progress = Progress(len(cases), "bench")
    try:
        for case in cases:
            results += run_case(
                case,
                providers,
                refs,
                reps=reps,
                time_budget=args.time_budget,
                max_slow_t=args.max_slow_T,
                measure_memory=not args.no_memory,
                progress=progress,
            )
    finally:
        progress.close()
    return results


def _write_plot(results, path: str, ceiling, out) -> None:
    try:
        plot(results, path, ceiling)
    except ValueError as exc:
        print(f"flashtile bench: plot not written: {exc}", file=sys.stderr)
    else:
        print(f"wrote {path}", file=out)

"""``flashtile learn``: a small lab for the online softmax and FlashAttention.

Sub-commands: ``list`` (the default), ``show NAME``, ``start NAME``,
``check NAME FILE`` and ``hint NAME``. :func:`add_parser` registers them on
the main parser and :func:`run_learn` executes the parsed arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from ..argtypes import positive_float
from . import state
from .catalog import EXERCISES, Exercise, lookup


def _exercise(text: str) -> Exercise:
    """argparse type: an exercise name or chapter number, with the choices on error."""
    try:
        return lookup(text)
    except KeyError as exc:
        raise argparse.ArgumentTypeError(exc.args[0]) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``learn`` and its sub-commands on ``subparsers``; return its parser."""
    names = ", ".join(EXERCISES)
    learn = subparsers.add_parser(
        "learn",
        help="exercises on the online softmax and tiled attention, with a checker",
        description=f"Exercises: {names}. Without a sub-command, list them.",
    )
    sub = learn.add_subparsers(dest="learn_command", metavar="{list,show,start,check,hint}")
    sub.add_parser("list", help="the exercises, one line each")
    show = sub.add_parser("show", help="the full statement of an exercise")
    show.add_argument("name", type=_exercise, metavar="NAME", help=names)
    start = sub.add_parser("start", help="write a starter file to fill in")
    start.add_argument("name", type=_exercise, metavar="NAME", help=names)
    start.add_argument("--dir", default=".", help="folder for NAME.py (default: here)")
    start.add_argument("--force", action="store_true", help="overwrite an existing file")
    check = sub.add_parser("check", help="grade your file in a separate process")
    check.add_argument("name", type=_exercise, metavar="NAME", help=names)
    check.add_argument("file", metavar="FILE", help="your solution, a .py file")
    check.add_argument(
        "--timeout", type=positive_float, default=10.0, help="seconds before stopping (default 10)"
    )
    hint = sub.add_parser("hint", help="one more hint per call")
    hint.add_argument("name", type=_exercise, metavar="NAME", help=names)
    group = hint.add_mutually_exclusive_group()
    group.add_argument("--reset", action="store_true", help="start the hints over")
    group.add_argument("--solution", action="store_true", help="print a reference solution")
    learn.set_defaults(func=run_learn)
    return learn


def _list(out: TextIO) -> int:
    width = max(len(name) for name in EXERCISES)
    print("flashtile learn exercises:", file=out)
    for ex in EXERCISES.values():
        origin = "seed" if ex.source == "seed" else f"ex {ex.source}"
        print(f"  {ex.name:<{width}}  [{origin:>7}]  {ex.summary}", file=out)
    print("\nflashtile learn show NAME | start NAME | check NAME FILE | hint NAME", file=out)
    return 0


def _show(ex: Exercise, out: TextIO) -> int:
    origin = "from the coding exercise" if ex.source == "seed" else f"exercise {ex.source}"
    print(f"{ex.name} ({origin}): {ex.summary}\n", file=out)
    print(ex.statement, file=out)
    print(f"Start with: flashtile learn start {ex.name}", file=out)
    return 0


def _start(ex: Exercise, folder: str, force: bool, out: TextIO) -> int:
    path = Path(folder) / f"{ex.name}.py"
    if path.exists() and not force:
        print(f"error: {path} already exists; pass --force to overwrite it", file=out)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ex.starter, encoding="utf-8")
    print(f"wrote {path}", file=out)
    print(f"next: fill it in, then run  flashtile learn check {ex.name} {path}", file=out)
    return 0


def _hint(ex: Exercise, reset: bool, solution: bool, out: TextIO) -> int:
    if solution:
        print(f"# A reference solution of {ex.name}:\n", file=out)
        print(ex.solution, file=out, end="")
        return 0
    if reset:
        state.set_hints_shown(ex.name, 0)
        print(f"hints for {ex.name} reset", file=out)
        return 0
    total = len(ex.hints)
    shown = min(state.hints_shown(ex.name) + 1, total)
    state.set_hints_shown(ex.name, shown)
    for i, text in enumerate(ex.hints[:shown], start=1):
        print(f"Hint {i}/{total}: {text}", file=out)
    if shown == total:
        print("That was the last hint (--solution shows an answer, --reset starts over).", file=out)
    return 0


def run_learn(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Execute a parsed ``learn`` command; the exit status (check: 0 iff all pass)."""
    out = out or sys.stdout
    command = getattr(args, "learn_command", None) or "list"
    if command == "list":
        return _list(out)
    if command == "show":
        return _show(args.name, out)
    if command == "start":
        return _start(args.name, args.dir, args.force, out)
    if command == "hint":
        return _hint(args.name, args.reset, args.solution, out)
    from .runner import check  # subprocess machinery only when grading

    return check(args.name.name, args.file, timeout=args.timeout, out=out)

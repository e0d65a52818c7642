"""The ``flashtile`` command line: ``demo``, ``trace``, ``bench``, and the
learning lab's ``learn``, ``io`` and ``plot``."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def _parse_vector(text: str) -> np.ndarray:
    try:
        values = [float(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--x must be numbers separated by spaces or commas, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("--x is empty: give at least one number")
    return np.array(values)


def positive_int(text: str) -> int:
    """argparse type: a positive integer, with a clear message otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a positive number, with a clear message otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashtile",
        description="Exact attention computed tile by tile with an online softmax.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="tiled vs naive attention, memory table, a row walked through")
    trace = sub.add_parser("trace", help="the online softmax of a vector, block by block")
    trace.add_argument(
        "--x",
        type=_parse_vector,
        required=True,
        help='e.g. "0 1 5 2 9"; starting with a negative value, write --x="-3 1 2"',
    )
    trace.add_argument("--block-size", type=positive_int, default=2)
    # bench.cli needs only NumPy; torch is imported when its provider is checked.
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    from .iomodel import add_io_parser
    from .learn.cli import add_learn_parser
    from .plots import add_plot_parser

    add_learn_parser(sub)
    add_io_parser(sub)
    add_plot_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .walkthrough import demo_text

        print(demo_text())
    elif args.command == "trace":
        from .walkthrough import trace_table

        print(trace_table(args.x, args.block_size))
    elif args.command == "bench":
        from .bench.cli import run_bench

        return run_bench(args)
    elif args.command == "learn":
        from .learn.cli import run_learn

        return run_learn(args)
    elif args.command == "io":
        from .iomodel import run_io

        return run_io(args)
    elif args.command == "plot":
        from .plots import run_plot

        return run_plot(args)
    return 0


def entry() -> int:
    """Console-script entry: ``main`` that exits quietly when the reader
    closes the pipe early (``flashtile demo | head``)."""
    try:
        return main()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error at interpreter exit
        return 0


if __name__ == "__main__":
    sys.exit(entry())

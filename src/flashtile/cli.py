"""The ``flashtile`` command line: ``demo``, ``trace``, ``bench``, ``report``,
``precompile``, ``tune``, ``gpu``, and the learning lab's ``learn``, ``io``
and ``plot``.

Every subcommand lives with the code it runs and registers itself through an
``add_parser(subparsers)`` function that sets ``func``, the function that runs
it; ``main`` only parses and calls ``args.func(args)``. Nothing imports this
module back (the shared argparse types are in :mod:`flashtile.argtypes`).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import precompile, tune
from .bench import cli as bench_cli
from .bench import page as bench_page
from .learn import cli as learn_cli
from .learn import io_table, plots, walkthrough
from .triton import cli as gpu_cli

#: One registration function per group of subcommands, in ``--help`` order.
SUBCOMMANDS = (
    walkthrough.add_parsers,  # demo, trace
    bench_cli.add_parser,
    bench_page.add_parser,  # report: the benchmark page from bench's JSON
    precompile.add_parser,  # the CPU kernels into Numba's cache
    tune.add_parser,  # the CPU-dependent routes, measured
    gpu_cli.add_parser,  # gpu compile
    learn_cli.add_parser,
    io_table.add_parser,
    plots.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashtile",
        description="Exact attention computed tile by tile with an online softmax.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (the process's arguments when None) and run the subcommand;
    its exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


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

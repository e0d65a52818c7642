"""``flashtile gpu compile``: the ahead-of-time compile report on the command line.

:func:`add_parser` registers the ``gpu`` command on ``flashtile``'s
subparsers and sets ``func``; building the parser imports neither torch nor
triton.
"""

from __future__ import annotations

import argparse
import json
import os

from .configs import TABLE

DTYPES = ("fp16", "bf16", "fp32")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``gpu`` (with ``compile``) to ``flashtile``'s subparsers."""
    gpu = subparsers.add_parser("gpu", help="the Triton GPU kernels (flashtile.triton)")
    sub = gpu.add_subparsers(dest="gpu_command", required=True)
    comp = sub.add_parser(
        "compile",
        help="compile every kernel ahead of time for NVIDIA archs (no GPU needed)",
        description=(
            "Compile every Triton kernel in every configuration it may launch with, "
            "with the ptxas in Triton's wheel, and report shared memory against each "
            "arch's limit per block. Exit status 1 if any compile fails or overflows."
        ),
    )
    comp.add_argument("--arch", type=int, action="append", help="e.g. 80, 90 (default: both)")
    comp.add_argument("--dtype", choices=DTYPES, action="append", help="default: all three")
    comp.add_argument("--head-dim", type=int, action="append", help="default: 64, 128, 256")
    comp.add_argument("--kernel", choices=sorted(TABLE), action="append", help="default: all")
    comp.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: cores)"
    )
    comp.add_argument("--json", metavar="PATH", help="also write every compile's row as JSON")
    comp.set_defaults(func=run_compile)
    return gpu


def run_compile(args) -> int:
    from .compile import DTYPES as ALL_DTYPES
    from .compile import HEAD_DIMS, KERNELS, compile_report, summary

    rows = compile_report(
        tuple(args.arch or (80, 90)),
        dtypes=tuple(args.dtype or ALL_DTYPES),
        head_dims=tuple(args.head_dim or HEAD_DIMS),
        kernels=tuple(args.kernel or KERNELS),
        jobs=max(1, args.jobs),
    )
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1

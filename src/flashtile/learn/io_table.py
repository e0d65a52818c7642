"""``flashtile io``: the HBM-traffic table of :mod:`.iomodel` and the scaling claims it shows.

For each sequence length ``N`` and SRAM size ``M`` the table gives the bytes
standard attention and the tiled loop nest move, their ratio, and how close
the simulated count comes to the closed form; the claims below it read the
paper's scaling laws (``N^2 d^2 / M``) off the same numbers.
"""

from __future__ import annotations

import itertools
import sys

from ..argtypes import positive_int
from .iomodel import (
    check_sizes,
    check_sram,
    closed_forms,
    paper_blocks,
    parse_sram,
    standard_backward_io,
    standard_forward_io,
    tiled_backward_io,
    tiled_forward_io,
)


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _format(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def io_table(ns, d: int, srams, backward: bool = False, bytes_per_element: int = 4) -> str:
    """The ``flashtile io`` report: traffic per ``(N, M)``, then the scaling claims."""
    ns, srams, bpe = sorted(set(ns)), sorted(set(srams)), bytes_per_element
    for n in ns:
        for sram in srams:
            check_sizes(n, d, bpe), check_sram(sram, d)  # fail before printing anything
    fwd = [("N", "M (elems)", "Br x Bc (kv)", "standard", "tiled kv-outer", "tiled q-outer")]
    fwd[0] += ("std/tiled", "sim/closed kv", "sim/closed q")
    bwd = [("N", "M (elems)", "Br x Bc", "standard bwd", "tiled bwd", "std/tiled", "sim/closed")]
    tiled = {}
    for n in ns:
        std, std_b = standard_forward_io(n, d, bpe), standard_backward_io(n, d, bpe)
        for sram in srams:
            key = (str(n), str(sram), "{} x {}".format(*paper_blocks(d, sram)))
            kv = tiled_forward_io(n, d, sram, "kv-outer", bytes_per_element=bpe)
            qo = tiled_forward_io(n, d, sram, "q-outer", bytes_per_element=bpe)
            closed = closed_forms(n, d, sram)
            tiled[n, sram] = kv.total
            fwd.append(
                (*key, _human(std.total_bytes), _human(kv.total_bytes), _human(qo.total_bytes))
                + (f"{std.total / kv.total:.1f}x", f"{kv.total / closed['tiled_forward']:.2f}")
                + (f"{qo.total / closed['tiled_forward_q_outer']:.2f}",)
            )
            if backward:
                tb = tiled_backward_io(n, d, sram, bytes_per_element=bpe)
                bwd.append(
                    (*key, _human(std_b.total_bytes), _human(tb.total_bytes))
                    + (f"{std_b.total / tb.total:.1f}x",)
                    + (f"{tb.total / closed['tiled_backward']:.2f}",)
                )
    out = [
        f"HBM traffic per head (reads + writes), d={d}, {bpe} bytes per element",
        "forward: standard = Algorithm 0 (S and P round-trip HBM); tiled = simulated loop nest",
        "(q-outer swaps the blocks: Br = Bc(kv) query rows stay on chip, Bc = Br(kv) stream)",
        "",
        *_format(fwd),
    ]
    if backward:
        out += ["", "backward: standard reads the saved P; tiled recomputes P (Algorithm 4)", ""]
        out += _format(bwd)
    out += [
        "",
        "closed forms (elements): standard fwd 4N^2 + 4Nd, bwd 7N^2 + 8Nd (exact); tiled fwd",
        "12 N^2 d^2/M (kv-outer), 8 N^2 d^2/M (q-outer), bwd 20 N^2 d^2/M (leading terms)",
        "",
        *_claims(ns, d, srams, tiled, bpe),
    ]
    return "\n".join(out)


def _claims(ns, d: int, srams, tiled: dict, bpe: int) -> list[str]:
    """One line per scaling claim, with the numbers from this table."""
    n, lines = ns[-1], []
    for small, big in itertools.pairwise(srams):
        grow = tiled[n, small] / tiled[n, big]
        lines.append(
            f"- M {big} -> {small} (x{small / big:.3g}) at N={n}: tiled traffic x{grow:.2f} "
            f"(N^2 d^2/M predicts x{big / small:.3g})"
        )
    std = standard_forward_io(n, d, bpe).total_bytes
    lines.append(f"- standard traffic at N={n} is {_human(std)} for every M: it never uses SRAM")
    for lo, hi in list(itertools.pairwise(ns))[-1:]:
        grow = standard_forward_io(hi, d).total / standard_forward_io(lo, d).total
        lines.append(
            f"- N {lo} -> {hi} (x{hi / lo:.3g}): standard traffic x{grow:.2f} "
            f"(N^2 predicts x{(hi / lo) ** 2:.3g}); tiled at M={srams[-1]} "
            f"x{tiled[hi, srams[-1]] / tiled[lo, srams[-1]]:.2f} (also ~N^2)"
        )
    sram = srams[-1]
    lines.append(
        f"- standard/tiled tends to 4N^2 / (12 N^2 d^2/M) = M/(3 d^2) = "
        f"{sram / (3 * d * d):.1f}x at M={sram}: it grows with SRAM, not N"
    )
    return lines


def add_parser(subparsers):
    """Register ``io`` on an ``add_subparsers()`` object and return its parser."""
    p = subparsers.add_parser(
        "io",
        help="HBM traffic of standard vs tiled attention (the FlashAttention IO argument)",
        description="Count HBM reads and writes of standard attention and of the tiled "
        "loop nest with the FlashAttention paper's block sizes, over N and SRAM size M.",
    )
    p.add_argument("--N", nargs="+", type=positive_int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--d", type=positive_int, default=64, help="head dim (default 64)")
    p.add_argument(
        "--sram",
        nargs="+",
        default=["32768", "65536", "131072"],
        help="SRAM sizes M: elements (65536) or bytes with a unit (100KB, 64KiB)",
    )
    p.add_argument("--backward", action="store_true", help="also the backward pass")
    p.add_argument("--bytes-per-element", type=positive_int, default=4, help="default 4")
    p.set_defaults(func=run_io)
    return p


def run_io(args, out=None) -> int:
    """Print the ``flashtile io`` table; 2 with a message on stderr for bad sizes."""
    out = sys.stdout if out is None else out
    try:
        srams = [parse_sram(s, args.bytes_per_element) for s in args.sram]
        text = io_table(args.N, args.d, srams, args.backward, args.bytes_per_element)
    except (ValueError, TypeError) as exc:
        print(f"flashtile io: error: {exc}", file=sys.stderr)
        return 2
    print(text, file=out)
    return 0

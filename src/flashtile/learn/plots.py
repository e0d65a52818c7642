"""``flashtile plot``: the algorithm's pictures as PNG files.

Four figures: ``memory`` (score storage vs online state over T), ``io`` (HBM
traffic vs N from :mod:`.iomodel`), ``mask`` (a block mask's tile
states) and ``trace`` (the online normaliser of one row, block by block).

matplotlib is optional (``pip install 'flashtile[plot]'``) and imported only
when a figure is drawn. Figures are built on ``matplotlib.figure.Figure`` and
saved through its Agg canvas, never through pyplot, so nothing needs a display
and no global backend state is touched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..argtypes import VECTOR_HELP, number_vector, positive_int
from ..masks import block_mask, normalize_window, visible
from ..reference import attention_memory_elements, online_softmax_steps
from .iomodel import parse_sram, standard_forward_io, tiled_forward_io

PLOT_HINT = "flashtile plot needs matplotlib: pip install 'flashtile[plot]'"

#: Tile-state colours, indexed by BlockMask.EMPTY / PARTIAL / FULL.
STATE_COLOURS = ("#d9d9d9", "#f4a261", "#2a6f97")
STATE_NAMES = ("skipped (no visible pair)", "partial (mask read per entry)", "full (no mask)")


def _figure(**kwargs):
    """A new matplotlib ``Figure``; ImportError naming the extra when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    return Figure(**kwargs)


def _save(fig, path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps a legend placed outside the axes
    return path


_OFFSET = {"textcoords": "offset points", "fontsize": "small"}


def plot_memory(path, max_tokens: int = 65536) -> Path:
    """Log-log plot of ``T^2`` score elements vs ``T`` online-state elements per head."""
    tokens = 2 ** np.arange(4, int(np.log2(max_tokens)) + 1)
    if tokens.size < 2:
        raise ValueError(f"--max-T {max_tokens}: give at least 32 so the plot has a line")
    mem = [attention_memory_elements(int(t)) for t in tokens]
    fig = _figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    ax.loglog(tokens, [m["naive_scores"] for m in mem], "o-", base=2, label="naive scores: T^2")
    ax.loglog(tokens, [m["online_state"] for m in mem], "s-", base=2, label="online state: T")
    if 4096 in tokens:  # the chapter's worked example
        for value in (4096**2, 4096):
            ax.annotate(f"T=4096: {value:,}", (4096, value), xytext=(8, -14), **_OFFSET)
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("elements per head (per statistic)")
    ax.set_title("Memory: dense score matrix vs online-softmax row state")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_io(path, ns, d: int, srams, bytes_per_element: int = 4) -> Path:
    """HBM bytes vs N: standard attention, and the tiled forward for each SRAM size."""
    ns, srams = sorted(set(ns)), sorted(set(srams))
    if len(ns) < 2:
        raise ValueError("plot io needs at least two values of --N to draw lines")
    fig = _figure(figsize=(6.8, 4.6))
    ax = fig.add_subplot()
    std = [standard_forward_io(n, d, bytes_per_element).total_bytes for n in ns]
    ax.loglog(ns, std, "k--o", base=2, label="standard (S, P through HBM)")
    for sram in srams:  # smallest SRAM first: the legend then lists the lines top to bottom
        tiled = [tiled_forward_io(n, d, sram, bytes_per_element=bytes_per_element) for n in ns]
        ax.loglog(ns, [t.total_bytes for t in tiled], "o-", base=2, label=f"tiled, M={sram:,}")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(f"HBM bytes read + written ({bytes_per_element} B/element)")
    ax.set_title(f"Forward HBM traffic per head, d={d} (tiled: simulated Algorithm 1)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(title="M = SRAM elements", fontsize="small")
    return _save(fig, path)


def example_mask(tokens: int, block: int, window: int, pad: int):
    """The default picture: causal + sliding window + key padding, as a BlockMask.

    ``window`` keys to the left of each query (-1: none); the last ``pad`` keys
    are padding. Returns ``(BlockMask, visible (T, T) bool)``.
    """
    if not 0 <= pad < tokens:
        raise ValueError(f"--pad {pad}: give 0 <= pad < T = {tokens}")
    left, right = normalize_window((window, 0), causal=True)
    idx = np.arange(tokens)
    keep = visible(idx, idx, tokens, tokens, True, left, right, kv_len=tokens - pad)
    return block_mask(keep, block, block), keep


def plot_mask(path, tokens: int = 64, block: int = 8, window: int = 24, pad: int = 10) -> Path:
    """Tiles coloured skipped / partial / full, visible pairs darkened inside them."""
    bm, keep = example_mask(tokens, block, window, pad)
    states = bm.states[0, 0]
    palette = np.array([_rgb(c) for c in STATE_COLOURS])
    tile_of = np.arange(tokens) // block
    tile_state = states[tile_of[:, None], tile_of[None, :]]  # (T, T): each entry's tile state
    image = palette[tile_state]
    # Hidden entries of computed tiles are faded, so a partial tile shows
    # which of its entries survive (a full tile has none hidden).
    faded = ~keep & (tile_state != bm.EMPTY)
    image[faded] = 0.35 * image[faded] + 0.65
    fig = _figure(figsize=(6.8, 5.6))
    from matplotlib.patches import Patch  # after _figure: a missing matplotlib gets the hint

    ax = fig.add_subplot()
    ax.imshow(image, interpolation="nearest", extent=(0, tokens, tokens, 0))
    edges = np.arange(0, tokens + 1, block)
    ax.vlines(edges, 0, tokens, colors="white", linewidth=1.2)
    ax.hlines(edges, 0, tokens, colors="white", linewidth=1.2)
    counts = bm.counts()
    handles = [
        Patch(color=c, label=f"{name}: {n}")
        for c, name, n in zip(STATE_COLOURS, STATE_NAMES, counts.values(), strict=True)
    ]
    pale = tuple(0.35 * c + 0.65 for c in _rgb(STATE_COLOURS[bm.PARTIAL]))
    handles.append(Patch(color=pale, label="hidden entry inside a partial tile"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    win = "no window" if window < 0 else f"window {window}"
    ax.set_title(f"Block mask, T={tokens}, {block}x{block} tiles: causal, {win}, {pad} pad keys")
    ax.set_xlabel("key index j")
    ax.set_ylabel("query index i")
    return _save(fig, path)


def _rgb(colour: str) -> tuple[float, float, float]:
    return tuple(int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))


def plot_trace(path, x, block_size: int) -> Path:
    """Scores with the running max per block (top) and the running sum ``ell`` (bottom)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"trace needs a non-empty 1-D vector, got shape {x.shape}")
    blocks = [x[i : i + block_size] for i in range(0, x.size, block_size)]
    steps = list(online_softmax_steps(blocks))
    fig = _figure(figsize=(7.2, 5.6))
    top, bottom = fig.subplots(2, 1)
    top.plot(np.arange(x.size), x, "o", color="#555555", label="score x[t]")
    for step in steps:
        start = step.index * block_size
        stop = start + step.block.size
        top.hlines(step.m_new, start - 0.4, stop - 0.6, colors="#d62828", linewidth=2.5)
        if step.index:
            top.axvline(start - 0.5, color="grey", linestyle=":", linewidth=1)
    top.plot([], [], color="#d62828", linewidth=2.5, label="running max m after the block")
    top.set_xlabel("position t in the row")
    top.set_ylabel("score")
    top.set_title(f"Online softmax of {x.size} scores in blocks of {block_size}")
    top.legend(fontsize="small")
    index = [s.index for s in steps]
    bars = bottom.bar(index, [s.ell for s in steps], color="#2a6f97", label="running sum ell")
    labels = [f"x{s.rescale:.3g}" if s.index else "" for s in steps]
    bottom.bar_label(bars, labels=labels, fontsize="small", padding=2)
    bottom.set_xticks(index)
    bottom.set_xlabel("block (label: rescale exp(m_old - m_new) applied to the old sum)")
    bottom.set_ylabel("ell = sum exp(x - m)")
    bottom.margins(y=0.2)
    bottom.legend(fontsize="small")
    return _save(fig, path)


def add_parser(subparsers):
    """Register ``plot`` with its sub-commands memory / io / mask / trace."""
    p = subparsers.add_parser("plot", help="draw the algorithm's pictures as PNG files")
    kinds = p.add_subparsers(dest="plot", required=True, metavar="{memory,io,mask,trace}")

    def kind(name: str, help_: str):
        k = kinds.add_parser(name, help=help_, description=help_)
        k.add_argument("--out", help=f"PNG path (default ./flashtile-{name}.png)")
        return k

    mem = kind("memory", "score storage T^2 vs online state T, log scale")
    mem.add_argument("--max-T", type=positive_int, default=65536, help="largest T (default 65536)")
    io = kind("io", "HBM bytes vs N for several SRAM sizes (the IO model of `flashtile io`)")
    io.add_argument("--N", nargs="+", type=positive_int, default=[512, 1024, 2048, 4096, 8192])
    io.add_argument("--d", type=positive_int, default=64, help="head dim (default 64)")
    io.add_argument("--sram", nargs="+", default=["16384", "65536", "262144"], help="M")
    io.add_argument("--bytes-per-element", type=positive_int, default=4)
    mask = kind("mask", "a block mask's tiles: skipped, partial, full (causal+window+padding)")
    mask.add_argument("--T", type=positive_int, default=64, help="sequence length (default 64)")
    mask.add_argument("--block", type=positive_int, default=8, help="tile size (default 8)")
    mask.add_argument("--window", type=int, default=24, help="keys left of a query; -1 = none")
    mask.add_argument("--pad", type=int, default=10, help="padding keys at the end (default 10)")
    trace = kind("trace", "running max and normaliser per block of one score row")
    trace.add_argument("--x", type=number_vector, required=True, help=VECTOR_HELP)
    trace.add_argument("--block-size", type=positive_int, default=2)
    p.set_defaults(func=run_plot)
    return p


def run_plot(args, out=None) -> int:
    """Draw the chosen figure and print its path; 1 without matplotlib, 2 for bad options."""
    out = sys.stdout if out is None else out
    path = args.out or f"flashtile-{args.plot}.png"
    try:
        if args.plot == "memory":
            written = plot_memory(path, args.max_T)
        elif args.plot == "io":
            srams = [parse_sram(s, args.bytes_per_element) for s in args.sram]
            written = plot_io(path, args.N, args.d, srams, args.bytes_per_element)
        elif args.plot == "mask":
            written = plot_mask(path, args.T, args.block, args.window, args.pad)
        else:
            written = plot_trace(path, args.x, args.block_size)
    except ImportError as exc:
        print(f"flashtile plot: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"flashtile plot {args.plot}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"flashtile plot {args.plot}: cannot write {path}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {written}", file=out)
    return 0

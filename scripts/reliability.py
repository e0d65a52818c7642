"""Reproduce the reliability figures of docs/reliability.md: threads, leaks, sizes.

    python scripts/reliability.py threads [--threads 4] [--T 2048]
    python scripts/reliability.py leaks [--iterations 300] [--T 512]
    python scripts/reliability.py sizes [--T 50000] [--elements 2**31]

Each prints what it checked and exits non-zero if the check failed. The
defaults are the sizes of the figures; pass smaller ones for a quick look
(``sizes`` at T=50,000 and 2**31 elements needs minutes and about 17 GiB).
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time

import numpy as np

import flashtile as ft
from flashtile.argtypes import positive_int


def inputs(t: int, heads: int = 4, d: int = 64, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.standard_normal((1, heads, t, d), dtype=np.float64).astype(dtype) for _ in "qkv"
    )


def threads(args) -> bool:
    """The same calls from several Python threads at once give bit-identical results."""
    q, k, v = inputs(args.T)
    want = ft.attention(q, k, v, causal=True, return_lse=True)
    want_grads = ft.attention_backward(q, k, v, *want, dout=want[0], causal=True)
    results = [None] * args.threads

    def work(i):
        out = ft.attention(q, k, v, causal=True, return_lse=True)
        results[i] = (out, ft.attention_backward(q, k, v, *out, dout=out[0], causal=True))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    same = all(
        all(np.array_equal(a, b) for a, b in zip((*out, *grads), (*want, *want_grads), strict=True))
        for out, grads in results
    )
    print(f"{args.threads} threads, T={args.T}: results bit-identical to one call: {same}")
    return same


def rss_mib() -> float:
    """Resident memory now (MiB), from /proc; the peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def leaks(args) -> bool:
    """RSS stays flat over many forward, backward, decode and merge calls."""
    q, k, v = inputs(args.T)
    cache = ft.KVCache(1, 4, 64, args.T + args.iterations, page_size=16)
    cache.append(k, v)
    # RSS after the first sixth (caches, pools and compiled code in place) and at the end.
    at = {max(1, args.iterations // 6), args.iterations}
    marks = {}
    for i in range(1, args.iterations + 1):
        out, lse = ft.attention(q, k, v, causal=True, return_lse=True, window=(128, 0))
        ft.attention_backward(q, k, v, out, lse, out, causal=True, window=(128, 0))
        ft.merge_states(out, lse, out, lse)
        cache.append(k[:, :, :1], v[:, :, :1])
        cache.attend(q[:, :, :1])
        if i in at:
            marks[i] = rss_mib()
    first, last = marks[min(at)], marks[max(at)]
    grew = last - first
    print(
        f"{args.iterations} iterations: RSS {first:.1f} MiB after {min(marks)}, {last:.1f} MiB "
        f"after {max(marks)} (grew {grew:+.1f} MiB)"
    )
    return grew < 16


def sizes(args) -> bool:
    """A long sequence (causal, T=50,000) and an input of 2**31 elements match
    the reference on sampled rows (no int32 index overflow, no wrong tile)."""
    q, k, v = inputs(args.T, heads=1)
    start = time.perf_counter()
    out = ft.attention(q, k, v, causal=True)
    seconds = time.perf_counter() - start
    rows = np.unique(np.linspace(0, args.T - 1, 7).astype(int))
    err = 0.0
    for i in rows:  # row i sees keys 0..i
        qi, ki, vi = (
            a[:, :, sl].astype(np.float64)
            for a, sl in ((q, [i]), (k, slice(i + 1)), (v, slice(i + 1)))
        )
        err = max(err, float(np.abs(out[:, :, [i]] - ft.naive_attention(qi, ki, vi)[0]).max()))
    print(f"T={args.T} causal: {seconds:.1f} s, max error on {len(rows)} sampled rows {err:.2e}")
    ok = err < 1e-4
    # q of ``elements`` entries: (1, 1, elements / 64, 64) queries against a few keys.
    tq = max(1, args.elements // 64)
    rng = np.random.default_rng(1)
    q = np.empty((1, 1, tq, 64), dtype=np.float32)
    for i0 in range(0, tq, 1 << 24):  # filled in slices: no float64 temporary
        q[0, 0, i0 : i0 + (1 << 24)] = rng.standard_normal((min(1 << 24, tq - i0), 64), np.float32)
    k, v = (rng.standard_normal((1, 1, 256, 64), np.float32) for _ in "kv")
    out = ft.attention(q, k, v)
    rows = np.array([0, tq // 2, tq - 1])
    ref = ft.naive_attention(q[:, :, rows].astype(float), k.astype(float), v.astype(float))[0]
    err = float(np.abs(out[:, :, rows] - ref).max())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        f"q with {q.size:,} elements: max error on rows {rows.tolist()} {err:.2e} "
        f"(peak RSS {peak:.2f} GiB)"
    )
    return ok and err < 1e-4


def _count(text: str) -> int:
    """``2**31`` or a plain positive integer."""
    base, _, power = text.partition("**")
    try:
        value = int(base) ** int(power) if power else int(base)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 2**31 or 1000000, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    p = sub.add_parser("threads")
    p.add_argument("--threads", type=positive_int, default=4)
    p.add_argument("--T", type=positive_int, default=2048)
    p = sub.add_parser("leaks")
    p.add_argument("--iterations", type=positive_int, default=300)
    p.add_argument("--T", type=positive_int, default=512)
    p = sub.add_parser("sizes")
    p.add_argument("--T", type=positive_int, default=50_000)
    p.add_argument("--elements", type=_count, default=2**31, help="e.g. 2**31 or 1000000")
    args = parser.parse_args(argv)
    return 0 if {"threads": threads, "leaks": leaks, "sizes": sizes}[args.check](args) else 1


if __name__ == "__main__":
    sys.exit(main())

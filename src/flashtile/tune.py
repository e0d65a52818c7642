"""``flashtile tune``: measure the CPU-dependent routes on this machine.

The measurements of :mod:`flashtile.routes`: each times every candidate of
one route on a short representative problem, side by side in interleaved
rounds (:func:`flashtile.bench.timing.interleaved_times`, medians), with the
candidate forced. Importing this module registers them, so a route that is
asked for with nothing stored is measured on first use.

- ``blas``: the forward and backward of ``(1, 8, 1024, 64)`` float32, causal,
  with each BLAS library.
- ``blas.one``, ``blas.few``: with oneMKL as the BLAS, decode steps in
  BLAS tiles, float32, d 64 against 2048 keys, of 12 heads (one query row
  per tile) or of 32 query heads over 8 kv heads (4 rows), its small
  products in each library.
- ``blas.tiny``: with oneMKL as the BLAS, forwards and backwards of ``(1, 4,
  16, 32)`` float32, causal, the products of their 16 x 16 tiles in each
  library.
- ``bf16``: the same at 2048 keys in bfloat16, with each way of running its products
  (flashtile's ``vdpbf16ps`` gemm, oneMKL's bf16 gemm, widened to float32).
- ``decode.<layout>.<rows>.<d>.<keys>``: decode steps, float32, 8 kv
  heads of d 64 or 128, 1, 4 or 16 query rows per item (8, 32 or 128 query
  heads), against 2048 keys ("short") or 64 MiB of keys and values ("long":
  16384 or 8192 keys, more than most L2 and L3 caches hold per core), the
  cache contiguous, in shuffled 16-key pages, or in one-token pages
  (flash-attn's layout).

The 2048-key decode problems time :data:`SHORT_STEPS` steps per call (the
times the routes report are theirs). The
decode walks and ``bf16`` are measured under a context (:func:`tiles_library`:
the library that runs their BLAS tiles) and measured again under another.
A whole ``flashtile tune`` takes about ten seconds once the kernels are
compiled (``flashtile precompile`` compiles them, then tunes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from statistics import median

import numpy as np

from . import route_cache, routes
from .api import attention, attention_backward
from .bench.timing import interleaved_times
from .decode import decode_attention

#: Interleaved rounds per measurement (medians of these).
ROUNDS = 5
#: The decode measurements' kv heads, and the bytes of keys and values of
#: the "long" class (the "short" class has SHORT_PROBLEM_KEYS keys).
DECODE_HEADS, LONG_BYTES, SHORT_PROBLEM_KEYS = 8, 64 << 20, 2048
#: Query rows per item of the decode measurements of each rows class
#: (:func:`flashtile.routes.decode_route_name`): GQA 32/8, and 16 rows.
CLASS_ROWS = {"one": 1, "few": 4, "many": 16}
#: Keys per page of the decode measurements' "paged" layout.
PAGE = 16
#: Decode steps per timing of the 2048-key problems (one is some 0.1-0.3
#: ms): a force moves the routes, so a force's first step is planned again
#: (a few hundred us), which the steps of a model's loop are not; timed
#: one by one, two walks within 10% of each other swapped ranks from run
#: to run on a 2-core AVX2 EPYC.
SHORT_STEPS = 10


def _timed(calls: dict) -> dict[str, float]:
    """Median seconds of each warmed-up call over ROUNDS interleaved rounds."""
    for call in calls.values():
        call()
    return {name: median(t) for name, t in interleaved_times(calls, ROUNDS).items()}


def measure_blas(route: routes.Route, candidates: tuple[str, ...]) -> dict[str, float]:
    """Forward + backward of ``(1, 8, 1024, 64)`` float32 causal with each library."""
    from .cpu import blas  # SciPy's BLAS and the MKL probe: loaded on first use, as the kernels

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 8, 1024, 64), dtype=np.float32) for _ in range(4))

    def step(library: str) -> None:
        blas.set_backend(library)
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        attention_backward(q, k, v, out, lse, dout, causal=True)

    with _backend_restored():
        return _timed({c: functools.partial(step, c) for c in candidates})


@contextlib.contextmanager
def _backend_restored():
    """The BLAS backend in force before the block, put back after it: a
    measurement switches it. An explicit ``set_backend`` stays; ``"auto"``
    resolves again (the measured route may have moved)."""
    from .cpu import blas

    before = blas.pinned()
    try:
        yield
    finally:
        blas.reset_backend(before)


def measure_small(route: routes.Route, candidates: tuple[str, ...]) -> dict[str, float]:
    """:data:`SHORT_STEPS` decode steps of one or four query rows per tile
    (``blas.one``, ``blas.few``) in BLAS tiles, oneMKL the BLAS, its small
    products in each library."""
    rows = 1 if route.name == "blas.one" else CLASS_ROWS["few"]
    kv_heads = 12 if rows == 1 else DECODE_HEADS
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, kv_heads * rows, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, kv_heads, SHORT_PROBLEM_KEYS, 64), np.float32) for _ in "kv")
    walk = routes.decode_route_name("contiguous", rows, 64, SHORT_PROBLEM_KEYS)

    def step(library: str) -> None:
        with routes.force(route.name, library), routes.force(walk, "tiles"):
            for _ in range(SHORT_STEPS):
                decode_attention(q, k, v)

    return _timed_on_mkl(step, candidates)


def _timed_on_mkl(step, candidates: tuple[str, ...]) -> dict[str, float]:
    """:func:`_timed` of ``step(candidate)`` for each candidate, oneMKL the
    backend meanwhile (the small-product routes decide only then)."""
    from .cpu import blas

    with _backend_restored():
        blas.set_backend("mkl")
        return _timed({c: functools.partial(step, c) for c in candidates})


#: Calls per timing of the ``blas.tiny`` measurement (one is some 60 us).
TINY_CALLS = 100


def measure_tiny(route: routes.Route, candidates: tuple[str, ...]) -> dict[str, float]:
    """TINY_CALLS forwards and backwards of ``(1, 4, 16, 32)`` float32, causal
    (16 x 16 tiles), oneMKL the BLAS, the tiny tiles' products in each library."""
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((1, 4, 16, 32), dtype=np.float32) for _ in range(4))

    def calls(library: str) -> None:
        with routes.force(route.name, library):
            for _ in range(TINY_CALLS):
                out, lse = attention(q, k, v, causal=True, return_lse=True)
                attention_backward(q, k, v, out, lse, dout, causal=True)

    return _timed_on_mkl(calls, candidates)


def measure_bf16(route: routes.Route, candidates: tuple[str, ...]) -> dict[str, float]:
    """Forward + backward of ``(1, 8, 2048, 64)`` bfloat16 causal with each
    way of running its products (the ``bf16`` route's candidates this CPU
    can run). Longer than the BLAS measurement: at 1024 keys the first
    version of flashtile's bf16 gemm and oneMKL's were within noise on an
    AMD EPYC (Zen 4), at 2048 3-13% apart (the present one: 59 against 109
    ms there)."""
    import ml_dtypes

    from .cpu import blas  # (limits the route: only what this CPU can run is timed)

    candidates = tuple(c for c in candidates if c in blas.bf16_available())
    rng = np.random.default_rng(0)
    q, k, v, dout = (
        rng.standard_normal((1, 8, 2048, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
        for _ in range(4)
    )

    def step(library: str) -> None:
        with routes.force(route.name, library):
            out, lse = attention(q, k, v, causal=True, return_lse=True)
            attention_backward(q, k, v, out, lse, dout, causal=True)

    return _timed({c: functools.partial(step, c) for c in candidates})


def _decode_problem(layout: str, rows: int, d: int, long: bool):
    """``(q, k, v, block_table, cache_seqlens)`` of one decode step on the
    measurements' buffers viewed in ``layout``."""
    heads = DECODE_HEADS
    keys = LONG_BYTES // (8 * heads * d) if long else SHORT_PROBLEM_KEYS
    # Constant keys and values (the time does not read them; filling 64 MiB
    # with random numbers would take longer than the measurement).
    k, v = (np.full(keys * heads * d, 0.01, dtype=np.float32) for _ in range(2))
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, heads * rows, 1, d), dtype=np.float32)
    if layout == "contiguous":
        shape, table = (1, heads, keys, d), np.zeros((1, 1), dtype=np.int64)
    elif layout == "paged":
        shape, table = (keys // PAGE, heads, PAGE, d), rng.permutation(keys // PAGE)[None]
    else:  # one-token pages: (keys, heads, d) token-major
        shape, table = (keys, heads, 1, d), np.arange(keys)[None]
    return q, k.reshape(shape), v.reshape(shape), table, np.array([keys])


def measure_decode(route: routes.Route, candidates: tuple[str, ...]) -> dict[str, float]:
    """Decode steps per candidate walk (:data:`SHORT_STEPS` per timing at 2048
    keys, one at 64 MiB), on the route's layout, rows, head dim and length
    class."""
    _, layout, rows_class, d_class, keys_class = route.name.split(".")
    rows = CLASS_ROWS[rows_class]
    d = 64 if d_class == "d64" else 128
    q, k, v, table, lengths = _decode_problem(layout, rows, d, keys_class == "long")
    steps = 1 if keys_class == "long" else SHORT_STEPS

    def step(walk: str) -> None:
        with routes.force(route.name, walk):
            for _ in range(steps):
                decode_attention(q, k, v, cache_seqlens=lengths, block_table=table)

    return _timed({c: functools.partial(step, c) for c in candidates})


def tiles_library(route: routes.Route) -> str:
    """What runs the float32 tile products of ``route``'s measurement (its
    context, :func:`flashtile.routes.depends`): the BLAS backend, or with
    oneMKL the small-product route of a decode class's rows (the ``bf16``
    route's widened candidate, and the decode walks' tiles; the walks that
    read rows in place and the bf16 gemms run no BLAS)."""
    from .cpu import blas

    rows_class = route.name.split(".")[2] if route.name.startswith("decode.") else "many"
    return f"tiles on {blas.small_library(CLASS_ROWS[rows_class]) or blas.backend()}"


routes.register("blas", measure_blas)
routes.register("blas.one", measure_small)
routes.register("blas.few", measure_small)
routes.register("blas.tiny", measure_tiny)
routes.register("bf16", measure_bf16)
routes.depends("bf16", tiles_library)
for _name in routes.ROUTES:
    if _name.startswith("decode."):
        routes.register(_name, measure_decode)
        routes.depends(_name, tiles_library)


def print_routes(out=print, measure: bool = True) -> None:
    """One line per route: its choice in force, why, and what it decides
    (``measure``: a route not measured yet is measured now, as a first call
    would; False: it shows its fixed rule)."""
    from .cpu import blas  # which libraries this process can load

    blas.available()
    for name, choice, why, doc in routes.report(measure):
        out(f"  {name:36s} {choice:12s} {why}  [{doc}]")


def run_tune(args: argparse.Namespace) -> int:
    """``flashtile tune``: measure every route (or ``--route``), store, print."""
    started = time.perf_counter()
    routes.tune(args.route or None)
    print(f"routes for {route_cache.machine_key()}")
    print(f"cache: {route_cache.cache_dir() / route_cache.CACHE_FILE}")
    print_routes(measure=False)  # (--route: the others as they stand)
    print(f"tuned in {time.perf_counter() - started:.1f} s")
    return 0


def add_parser(subparsers) -> None:
    """Register ``flashtile tune``."""
    parser = subparsers.add_parser(
        "tune",
        help="measure the CPU-dependent routes on this machine and keep the fastest",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--route", action="append", choices=sorted(routes.ROUTES),
        help="measure only this route (repeatable); default: all",
    )  # fmt: skip
    parser.set_defaults(func=run_tune)

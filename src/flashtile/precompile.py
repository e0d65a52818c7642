"""``flashtile precompile``: compile the CPU kernels before their first call.

The Numba kernels compile on first use, 15-55 seconds each, and are kept
in Numba's on-disk cache (next to the kernel modules, or Numba's own cache
directory for a read-only install). One kernel is compiled per dtype and
path: the forward and backward per work dtype, decoding per query dtype,
cache format and walk (:mod:`flashtile.cpu.decode`). This command makes the
calls that compile each of them on tiny inputs, in several processes at
once, so that a container image, a CI job or a test run pays the
compilation once, up front, and in parallel, instead of in the first
request (``make test`` runs it before pytest, so that its two workers do
not both compile the same kernel).

Each task is one public call (:data:`TASKS`): whichever kernel that call
runs on this machine (the BLAS backend and the CPU's bf16 instructions
choose, e.g., bf16 products or widening) is the one compiled, as it would
be for a user. A task that finds its kernel cached takes a second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import time

import ml_dtypes
import numpy as np

from .argtypes import positive_int

#: Dtypes a task can be selected by (``--dtype``).
DTYPES = ("float32", "float64", "bfloat16", "float16")


def _array(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _forward(dtype):
    import flashtile

    q, k, v = (_array((1, 2, 8, 16), dtype, s) for s in range(3))
    flashtile.attention(q, k, v, causal=True)


def _backward(dtype):
    import flashtile

    q, k, v = (_array((1, 2, 8, 16), dtype, s) for s in range(3))
    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
    flashtile.attention_backward(q, k, v, out, lse, np.ones_like(out), causal=True)


def _decode(q_dtype, cache_dtype, paged):
    """One decode step: GQA (2 query heads per kv head) against a contiguous
    cache, or MHA against 16-key pages (the row walk, :mod:`flashtile.cpu.cache_rows`)."""
    import flashtile

    if paged:  # one query row per item, pages smaller than a tile: rows read in place
        q = _array((1, 1, 1, 16), q_dtype)
        k, v = (_array((4, 1, 16, 16), cache_dtype, s) for s in (1, 2))
        extra = {"block_table": np.arange(4).reshape(1, 4), "cache_seqlens": np.array([64])}
    else:
        q = _array((1, 2, 1, 16), q_dtype)
        k, v = (_array((1, 1, 64, 16), cache_dtype, s) for s in (1, 2))
        extra = {}
    flashtile.decode_attention(q, k, v, **extra)


_BF16 = ml_dtypes.bfloat16

#: ``(name, dtype it is selected by, kernel, function, arguments)``; the
#: slowest compilations of each kernel first.
TASKS = (
    ("forward float64", "float64", "forward", _forward, (np.float64,)),
    ("forward float32", "float32", "forward", _forward, (np.float32,)),
    ("forward bfloat16", "bfloat16", "forward", _forward, (_BF16,)),
    ("backward float64", "float64", "backward", _backward, (np.float64,)),
    ("backward float32", "float32", "backward", _backward, (np.float32,)),
    ("backward bfloat16", "bfloat16", "backward", _backward, (_BF16,)),
    ("decode float32, 16-key pages", "float32", "decode", _decode, (np.float32, np.float32, True)),
    ("decode float16 cache, 16-key pages", "float16", "decode", _decode,
     (np.float16, np.float16, True)),
    ("decode bfloat16, 16-key pages", "bfloat16", "decode", _decode, (_BF16, _BF16, True)),
    ("decode float64", "float64", "decode", _decode, (np.float64, np.float64, False)),
    ("decode float32", "float32", "decode", _decode, (np.float32, np.float32, False)),
    ("decode float16 cache", "float16", "decode", _decode, (np.float16, np.float16, False)),
    ("decode float32 queries, bfloat16 cache", "bfloat16", "decode", _decode,
     (np.float32, _BF16, False)),
    ("decode bfloat16", "bfloat16", "decode", _decode, (_BF16, _BF16, False)),
)  # fmt: skip

#: How the kernels share the processes: each kernel's signatures compile in
#: one process, in turn. Numba's cache index is one file per function, which
#: two processes saving at once can leave pointing at the other's code
#: (numba/numba#10128); the forward and backward together take about as long
#: as decoding's eight.
_GROUPS = (("decode",), ("forward", "backward"))


def _run(indices, worker=False) -> list[tuple[int, float]]:
    """Run the tasks ``indices`` of :data:`TASKS` in turn; ``(index, seconds)``
    each. ``worker``: in a process of its own, beside others
    (:func:`_lock_cache_saves`)."""
    if worker:
        _lock_cache_saves()
    done = []
    for i in indices:
        function, arguments = TASKS[i][3:]
        start = time.perf_counter()
        function(*arguments)
        done.append((i, time.perf_counter() - start))
    return done


def _lock_cache_saves() -> None:
    """Make this worker's saves into Numba's cache take an exclusive file
    lock, so that the processes of one :func:`precompile` never write one
    function's index at once (the kernels' helpers are shared between the
    groups). Without ``fcntl`` or the Numba class this wraps, saves stay as
    they are."""
    try:
        import fcntl

        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return
    save = IndexDataCacheFile.save
    if getattr(save, "locked", False):
        return

    def locked(self, key, data):
        with open(os.path.join(self._cache_path, ".flashtile-precompile.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            save(self, key, data)

    locked.locked = True
    IndexDataCacheFile.save = locked


def precompile(dtypes=DTYPES, jobs: int = 1, report=print) -> list[tuple[str, float]]:
    """Compile the kernels of every task selected by ``dtypes`` (a subset of
    :data:`DTYPES`) in up to ``jobs`` processes (1: in this one; at most one
    per kernel group, :data:`_GROUPS`); ``report`` gets a line per task.
    Returns ``(task name, seconds)`` in task order.
    """
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"precompile: unknown dtypes {unknown}; choose from {list(DTYPES)}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"precompile: jobs must be an integer >= 1, got {jobs!r}")
    chosen = [i for i, task in enumerate(TASKS) if task[1] in dtypes]
    groups = [[i for i in chosen if TASKS[i][2] in kernels] for kernels in _GROUPS]
    groups = [g for g in groups if g]
    seconds = {}
    if jobs == 1 or len(groups) < 2:
        for i in chosen:
            seconds.update(_run([i]))
            report(f"{TASKS[i][0]}: {seconds[i]:.1f} s")
    else:  # fresh interpreters: a forked child would inherit Numba's thread pool
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = [pool.submit(_run, g, True) for g in groups]
            for done in concurrent.futures.as_completed(futures):
                for i, took in done.result():
                    seconds[i] = took
                    report(f"{TASKS[i][0]}: {took:.1f} s")
    return [(TASKS[i][0], seconds[i]) for i in chosen]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``precompile`` to ``flashtile``'s subparsers."""
    parser = subparsers.add_parser(
        "precompile",
        help="compile the CPU kernels into Numba's cache before their first call",
        description=(
            "Compile the Numba kernels of the forward, backward and decoding for the "
            "chosen dtypes (15-55 s each), in parallel processes, into Numba's on-disk "
            "cache; later calls in any process load them in about a second."
        ),
    )
    parser.add_argument("--dtype", choices=DTYPES, action="append", help="default: all four")
    parser.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="processes (default: cores)"
    )
    parser.set_defaults(func=run_precompile)
    return parser


def run_precompile(args) -> int:
    start = time.perf_counter()
    done = precompile(tuple(args.dtype or DTYPES), args.jobs)
    print(f"{len(done)} tasks in {time.perf_counter() - start:.1f} s")
    return 0

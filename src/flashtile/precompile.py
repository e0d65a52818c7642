"""``flashtile precompile``: compile the CPU kernels before their first call.

The Numba kernels compile on first use, 10-60 seconds each, and are kept
in Numba's on-disk cache. One kernel is compiled per path and operand
dtype: the forward and the backward per work dtype (float16 inputs run on
the float32 kernels), decoding per query operands, cache format and walk
(:mod:`flashtile.cpu.decode`). This command makes the calls that compile
each of them on tiny inputs, in several processes at once, so that a
container image, a CI job or a test run pays the compilation once, up
front, and in parallel, instead of in the first request (``make test``
runs it before pytest, so that its two workers do not both compile the
same kernel).

Each task is one public call (:data:`TASKS`): whichever kernel that call
runs on this machine (the routes and the CPU's bf16 instructions choose,
e.g., bf16 products or widening) is the one compiled, as it would
be for a user. A task whose kernel is cached takes about a second.

Where the cache is, and when it is used (Numba's rules): ``NUMBA_CACHE_DIR``
when set; else next to the kernel modules (``flashtile/cpu/__pycache__``)
when the process can write there, else a per-user directory
(``~/.cache/numba``, under ``XDG_CACHE_HOME`` if set); a process that
cannot write to a directory does not read it either. Entries are keyed by
the CPU model and its features, so a cache built on one kind of CPU is not
used on another. For a container image: precompile as the user that
serves (or with the same ``NUMBA_CACHE_DIR``, writable at run time), on
the CPU model it will run on (or with ``NUMBA_CPU_NAME=generic`` at build
and run time: portable code, without AVX-512).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import operator
import os
import time

import numpy as np

from . import routes, tune
from ._validate import BFLOAT16
from .argtypes import positive_int
from .progress import Progress

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


def _decode(q_dtype, cache_dtype, case):
    """One decode step of ``case``, its walk forced (:mod:`flashtile.routes`: the kernel
    compiled is the same whatever was measured): GQA (2 query heads per kv
    head) against a contiguous cache in BLAS tiles; MHA against 16-key pages
    read row by row (:mod:`flashtile.cpu.cache_rows`); or GQA against
    one-token pages of 2 kv heads, all heads at once (``"head-tiles"``,
    ``"head-rows"``)."""
    import flashtile
    from flashtile import routes

    if case == "paged":  # one query row per item, pages smaller than a tile: rows read in place
        q = _array((1, 1, 1, 16), q_dtype)
        k, v = (_array((4, 1, 16, 16), cache_dtype, s) for s in (1, 2))
        extra = {"block_table": np.arange(4).reshape(1, 4), "cache_seqlens": np.array([64])}
        layout, rows, walk = "paged", 1, "rows"
    elif case in ("head-tiles", "head-rows"):  # one-token pages; rows: 2 query heads per kv head
        q = _array((1, 4, 1, 16), q_dtype)
        k, v = (_array((64, 2, 1, 16), cache_dtype, s) for s in (1, 2))
        extra = {"block_table": np.arange(64).reshape(1, 64), "cache_seqlens": np.array([64])}
        layout, rows, walk = "tokens", 2, case
    else:
        q = _array((1, 2, 1, 16), q_dtype)
        k, v = (_array((1, 1, 64, 16), cache_dtype, s) for s in (1, 2))
        extra = {"block_table": np.zeros((1, 1), dtype=np.int64), "cache_seqlens": np.array([64])}
        layout, rows, walk = "contiguous", 2, "tiles"
    with routes.force(routes.decode_route_name(layout, rows, 16, 64), walk):
        flashtile.decode_attention(q, k, v, **extra)


#: ``(name, dtype it is selected by, function, arguments)``, the slowest
#: compilations first so that the processes finish about together. float16
#: inputs run the forward and backward on the float32 kernels: their tasks
#: compile those (nothing, after the float32 ones). Decoding's walks
#: (:func:`flashtile.workitems.decode_walk`) are routes measured on the
#: machine: every walk of float32 work is compiled (the measurement runs
#: them all), and for 16-bit caches and float64 (the range fallback) the
#: walks measured fastest on the machines so far; another one compiles on
#: its first use.
TASKS = (
    ("forward float64", "float64", _forward, (np.float64,)),
    ("forward float32", "float32", _forward, (np.float32,)),
    ("forward bfloat16", "bfloat16", _forward, (BFLOAT16,)),
    ("decode float32, 16-key pages", "float32", _decode, (np.float32, np.float32, "paged")),
    ("decode float16 cache, 16-key pages", "float16", _decode, (np.float16, np.float16, "paged")),
    ("decode bfloat16, 16-key pages", "bfloat16", _decode, (BFLOAT16, BFLOAT16, "paged")),
    ("backward float64", "float64", _backward, (np.float64,)),
    ("backward float32", "float32", _backward, (np.float32,)),
    ("backward bfloat16", "bfloat16", _backward, (BFLOAT16,)),
    ("decode float32, one-token pages", "float32", _decode,
     (np.float32, np.float32, "head-tiles")),
    ("decode float32, one-token pages in place", "float32", _decode,
     (np.float32, np.float32, "head-rows")),
    ("decode float16 cache, one-token pages in place", "float16", _decode,
     (np.float16, np.float16, "head-rows")),
    ("decode bfloat16, one-token pages in place", "bfloat16", _decode,
     (BFLOAT16, BFLOAT16, "head-rows")),
    ("decode float64, one-token pages", "float64", _decode,
     (np.float64, np.float64, "head-tiles")),
    ("decode float64", "float64", _decode, (np.float64, np.float64, "contiguous")),
    ("decode float32", "float32", _decode, (np.float32, np.float32, "contiguous")),
    ("decode float16 cache", "float16", _decode, (np.float16, np.float16, "contiguous")),
    ("decode float32 queries, bfloat16 cache", "bfloat16", _decode,
     (np.float32, BFLOAT16, "contiguous")),
    ("decode bfloat16", "bfloat16", _decode, (BFLOAT16, BFLOAT16, "contiguous")),
    ("forward float16", "float16", _forward, (np.float16,)),
    ("backward float16", "float16", _backward, (np.float16,)),
)  # fmt: skip


def _run(index: int, worker: bool = False) -> float:
    """Run task ``index`` of :data:`TASKS`; its wall time in seconds. A
    failure is re-raised as a ``RuntimeError`` naming the task. ``worker``:
    in a pool process, beside others (:func:`lock_cache_saves`)."""
    if worker:
        lock_cache_saves()
    name, _, function, arguments = TASKS[index]
    start = time.perf_counter()
    try:
        with _no_tuning():
            function(*arguments)
    except Exception as error:
        raise RuntimeError(f"precompile: {name!r} failed: {error!r}") from error
    return time.perf_counter() - start


@contextlib.contextmanager
def _no_tuning():
    """No route measured while compiling (beside other processes, or with
    half the kernels still to compile): :func:`run_precompile` tunes after."""
    before = os.environ.get("FLASHTILE_TUNE")
    os.environ["FLASHTILE_TUNE"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLASHTILE_TUNE", None)
        else:
            os.environ["FLASHTILE_TUNE"] = before


def lock_cache_saves() -> None:
    """Make this process's saves into Numba's cache take an exclusive file
    lock (``flock`` on a file in the cache directory; idempotent).

    Numba saves a compiled signature by reading the function's index file,
    picking a data file name and writing both back, unlocked. Two processes
    saving signatures of one function at once can each pick the same name,
    and the index then loses one entry or points it at the other's code
    (measured: 32-34 of 36 entries kept by two processes, all 36 with the
    lock; numba/numba#10128 is a relative). Every process that may compile
    beside others (the workers of :func:`precompile`, pytest's workers)
    takes this lock around its saves; loads stay unlocked (Numba replaces
    each file whole). Where the lock cannot be taken (no ``fcntl``, a
    file system without locks, the Numba class this wraps gone), saves
    stay as Numba makes them.
    """
    try:
        import fcntl

        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return
    save = IndexDataCacheFile.save
    if getattr(save, "flashtile_locked", False):
        return

    def locked(self, key, data):
        path = os.path.join(self._cache_path, ".flashtile-cache.lock")
        try:  # read-only: anyone's lock file will do
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:  # no lock file here: save as Numba would
            return save(self, key, data)
        try:
            with contextlib.suppress(OSError):  # a file system without locks: save unlocked
                fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    locked.flashtile_locked = True
    IndexDataCacheFile.save = locked


def _dtype_names(dtypes) -> list[str]:
    """``dtypes`` (a name or dtype, or an iterable of them) as names of :data:`DTYPES`."""
    if isinstance(dtypes, str) or not hasattr(dtypes, "__iter__"):
        dtypes = [dtypes]
    names = []
    for d in dtypes:
        if isinstance(d, str) and d in DTYPES:
            names.append(d)
            continue
        try:
            if d is None:  # np.dtype(None) would be float64
                raise TypeError
            names.append(np.dtype(d).name)  # "f4", np.float32, ml_dtypes.bfloat16
        except TypeError:
            if not isinstance(d, str):
                message = f"precompile: {d!r} is not a dtype; use names from {list(DTYPES)}"
                raise TypeError(message) from None
            names.append(d)  # reported below
    unknown = sorted(set(names) - set(DTYPES))
    if unknown or not names:
        raise ValueError(f"precompile: unknown dtypes {unknown}; choose from {list(DTYPES)}")
    return names


#: Tasks that compile another task's kernels (float16 inputs run on the
#: float32 forward and backward): left out when that task runs too.
_SAME_KERNELS = {"forward float16": "forward float32", "backward float16": "backward float32"}


def precompile(dtypes=DTYPES, jobs: int = 1, report=None) -> list[tuple[str, float]]:
    """Compile the kernels of every task of ``dtypes`` (names from
    :data:`DTYPES`, or dtypes) in ``jobs`` processes (1: in this one);
    ``report`` gets a line per task as it finishes (default: printed, under a
    progress bar on a terminal). Returns ``(task name, seconds)`` in task
    order. A task that fails raises ``RuntimeError`` naming it, at once (the
    other processes are stopped).
    """
    names = _dtype_names(dtypes)
    if isinstance(jobs, bool) or not hasattr(type(jobs), "__index__"):
        raise TypeError(f"precompile: jobs must be an integer, got {jobs!r}")
    jobs = operator.index(jobs)
    if jobs < 1:
        raise ValueError(f"precompile: jobs must be >= 1, got {jobs}")
    selected = {task[0] for task in TASKS if task[1] in names}
    chosen = [
        i for i, task in enumerate(TASKS)
        if task[0] in selected and _SAME_KERNELS.get(task[0]) not in selected
    ]  # fmt: skip
    with Progress(len(chosen), "precompile") as progress:
        seconds = _compile(chosen, jobs, report or progress.note, progress)
    return [(TASKS[i][0], seconds[i]) for i in chosen]


def _compile(chosen, jobs, report, progress) -> dict[int, float]:
    """Seconds per task index of compiling the ``chosen`` tasks."""
    seconds = {}

    def finished(i, took):
        seconds[i] = took
        progress.step()
        report(f"{TASKS[i][0]}: {took:.1f} s")

    if jobs == 1 or len(chosen) < 2:
        for i in chosen:
            progress.show(TASKS[i][0])
            finished(i, _run(i))
        return seconds
    # Fresh interpreters: a forked child would inherit Numba's thread pool.
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(chosen)), mp_context=context)
    failed = True
    try:
        futures = {pool.submit(_run, i, True): i for i in chosen}
        for done in concurrent.futures.as_completed(futures):
            finished(futures[done], done.result())  # a task's failure raises here
        failed = False
    finally:
        if failed:  # stop the compilations still running (no public way before 3.14)
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
        pool.shutdown(wait=not failed, cancel_futures=True)
    return seconds


def cache_directory() -> str | None:
    """Where Numba keeps the forward kernel's compiled code in this process
    (see the module docstring), or None if Numba does not say."""
    from .cpu.forward import forward_call

    return getattr(getattr(forward_call, "_cache", None), "_cache_path", None)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``precompile`` to ``flashtile``'s subparsers."""
    parser = subparsers.add_parser(
        "precompile",
        help="compile the CPU kernels into Numba's cache before their first call",
        description=(
            "Compile the Numba kernels of the forward, backward and decoding for the "
            "chosen dtypes (10-60 s each), in parallel processes, into Numba's on-disk "
            "cache; later calls in any process that can write to that cache (the same "
            "user, or the same NUMBA_CACHE_DIR) on the same CPU model load them in "
            "about a second."
        ),
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, action="append", help="repeat for several (default: all four)"
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="processes (default: cores)"
    )
    parser.add_argument(
        "--no-tune", action="store_true",
        help="do not measure the CPU-dependent routes afterwards (flashtile tune)",
    )  # fmt: skip
    parser.set_defaults(func=run_precompile)
    return parser


def run_precompile(args) -> int:
    lock_cache_saves()  # this process compiles too, with jobs 1
    start = time.perf_counter()
    dtypes = tuple(args.dtype or DTYPES)
    done = precompile(dtypes, args.jobs)
    print(f"{len(done)} tasks in {time.perf_counter() - start:.1f} s; cache: {cache_directory()}")
    if not args.no_tune and "float32" in dtypes:  # the measurements run float32 kernels
        start = time.perf_counter()
        routes.tune()
        print(f"routes measured in {time.perf_counter() - start:.1f} s:")
        tune.print_routes()
    return 0

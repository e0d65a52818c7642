"""How many kernel threads each process uses: the node's cores shared by its processes.

Numba starts as many threads as the machine has cores; two processes on one
machine would each start them all and fight over the cores. Every entry point
of :mod:`flashtile.distributed` therefore runs its kernels with

1. the count given to :func:`set_num_threads`, else
2. the ``FLASHTILE_NUM_THREADS`` environment variable, else
3. ``cores // processes on this node``, where cores are those this process may
   run on and the processes on the node are torchrun's ``LOCAL_WORLD_SIZE``
   (else the group's size, which is right when every process is on one node),

at least 1 and at most Numba's ``NUMBA_NUM_THREADS``. The count applies
inside the call only; the caller's own setting is restored afterwards.

Numba's pool keeps the ``NUMBA_NUM_THREADS`` threads it started with, and
with the OpenMP layer the idle ones spin after each parallel region, on cores
that the other ranks are computing on (measured with two ranks on two cores:
a 1 ms ``torch.cat`` on the other rank took 100-180 ms). The OpenMP runtime
and Numba read their settings when they start, so the fix belongs in the
launch environment: ``NUMBA_NUM_THREADS=<threads per process>`` (or
``OMP_WAIT_POLICY=PASSIVE``). The first call warns once when neither is set
and the pool is larger than this process's share.
"""

from __future__ import annotations

import contextlib
import os
import warnings

ENV_VAR = "FLASHTILE_NUM_THREADS"
_chosen: int | None = None

_warned = False


def _positive(value, what: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and n != value):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return n


def set_num_threads(n: int | None) -> None:
    """Use ``n`` kernel threads in each distributed call (None: back to the default)."""
    global _chosen
    _chosen = None if n is None else _positive(n, "set_num_threads(n)")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_process(group_size: int) -> int:
    """The thread count the rules in the module docstring give."""
    import numba

    if _chosen is not None:
        n = _chosen
    elif os.environ.get(ENV_VAR, "").strip():
        n = _positive(os.environ[ENV_VAR], ENV_VAR)
    else:
        local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        procs = _positive(local, "LOCAL_WORLD_SIZE") if local else group_size
        n = _cores() // max(1, procs)
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


def _spinning_layer() -> bool:
    """Whether Numba's threading layer is (or by default will be) OpenMP."""
    import numba

    try:
        return numba.threading_layer() == "omp"
    except ValueError:  # not started yet: only an explicit choice rules OpenMP out
        return numba.config.THREADING_LAYER not in ("workqueue", "tbb")


def _warn_if_pool_spins(share: int) -> None:
    global _warned
    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    if _warned or pool <= share or os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return
    _warned = True
    if _spinning_layer():
        warnings.warn(
            f"Numba's thread pool has {pool} threads but this process uses {share}: the idle "
            f"OpenMP threads spin on cores other processes compute on. Launch with "
            f"NUMBA_NUM_THREADS={share} (or OMP_WAIT_POLICY=PASSIVE) in the environment",
            RuntimeWarning,
            stacklevel=5,  # the distributed call (kernel_threads is entered one level down)
        )


@contextlib.contextmanager
def kernel_threads(group_size: int):
    """Run the body with :func:`threads_per_process` Numba threads, then restore."""
    import numba

    share = threads_per_process(group_size)
    _warn_if_pool_spins(share)
    before = numba.get_num_threads()
    numba.set_num_threads(share)
    try:
        yield
    finally:
        numba.set_num_threads(before)

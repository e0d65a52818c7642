"""Run a plan on the compiled kernels: allocate the outputs (decoding's are
allocated in compiled code), set the thread count, call (the kernels pin
their BLAS themselves, :mod:`.blas_threads`).

Each function takes a plan from :mod:`flashtile.planning` and returns the
kernel's results in the work dtype and the kernel's 4-D layout; shaping them
back to the caller's layout is the entry point's job.

The kernel modules import SciPy's BLAS and probe for MKL (about half a
second), so they are imported on first use, not with ``flashtile``.
"""

from __future__ import annotations

import functools
import os
import time
import types
from typing import NamedTuple

import numba
import numpy as np

from .._validate import BFLOAT16, COMPUTE_DTYPES
from ..cpuset import usable_cpus
from ..units import LN2, LOG2E


@numba.njit  # not cached: it reads Numba's thread-count functions as ctypes globals
def _swap_threads(n):
    """Set the calling thread's Numba thread count to ``n``; return the old one.

    Compiled: the Python ``numba.set_num_threads`` takes a lock on every call."""
    saved = numba.get_num_threads()
    numba.set_num_threads(n)
    return saved


#: :func:`run_forward`'s ``limits`` when nothing is to be checked.
NO_LIMITS = (np.inf, np.inf)

#: The CPUs this process may use (affinity, and a container's CPU quota:
#: :func:`flashtile.cpuset.usable_cpus`), read once; with NUMBA_NUM_THREADS
#: set, the user's pool size instead.
_USABLE = numba.config.NUMBA_NUM_THREADS if "NUMBA_NUM_THREADS" in os.environ else usable_cpus()


@numba.njit  # not cached, as _swap_threads
def numba_threads():
    """The kernels' thread count for the calling thread: Numba's
    (``numba.get_num_threads()``), at most the CPUs the process may use
    (``_USABLE``: a quota-limited container's Numba pool is larger than its
    quota). Compiled: the Python function costs about 2 us, this 0.2, and
    planning asks on every call; once per process on first use, as
    :func:`_swap_threads` (a few hundred ms, with Numba's own start-up)."""
    return min(numba.get_num_threads(), _USABLE)


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The kernel modules' entry points, imported once on first use (an import
    statement in each call costs about a microsecond)."""
    from . import clear_stale_kernels
    from .backward import backward_call
    from .blas import gemm_for
    from .blas_threads import unpin_blas
    from .cache_rows import walk_flag, walk_prefetches
    from .decode import decode_call
    from .forward import forward_call
    from .half import to_bfloat16
    from .memory import cache_operands

    cache = getattr(getattr(forward_call, "_cache", None), "_cache_path", None)
    if cache is not None:  # where Numba keeps this directory's kernels, if elsewhere
        clear_stale_kernels(cache)
    return types.SimpleNamespace(
        backward_call=backward_call, gemm_for=gemm_for, forward_call=forward_call,
        unpin_blas=unpin_blas, decode_call=decode_call,
        cache_operands=cache_operands, to_bfloat16=to_bfloat16, walk_flag=walk_flag,
        walk_prefetches=walk_prefetches,
    )  # fmt: skip


# The join watch. A call on several threads ends at a join, where the
# calling thread waits for every thread of the pool. When another process
# keeps a core busy, the pool thread on that core may not run until the
# other process's time slice ends: Numba's OpenMP threads spin for a while
# after each parallel region, so under a steady stream of calls they use up
# their share of that core and are descheduled now and then. With a
# pure-Python loop on one of two cores, one decoding step in ten waited 4-8
# ms and the mean time was about 4x the median; on one thread it was about
# half that mean (docs/decoding.md). For a small call the second core
# saves less than its waits cost on average.
#
# So the launcher measures both ways. Per kernel and size class of work
# (its bit length: a factor of 2) it keeps the fastest wall time of a
# parallel call and moving means of the parallel and the serial times (a
# new time weighs 1/JOIN_WEIGHT; the parallel mean starts at the second
# call, the first one pays for loading the kernel). A call whose fastest
# run is under JOIN_SMALL_NS is watched: when the parallel mean passes
# JOIN_MARGIN x the serial one (before any serial run, 2 x threads x the
# fastest parallel time), its size class runs on one thread for
# JOIN_HOLD_NS, the serial calls timed, then on its threads again, the
# parallel mean restarting from the serial one: under a steady load a hold
# costs the one or two waits that end the next one. Taking turns call by
# call would not do: the pool's threads, woken now and then, spin beside
# the serial calls. On a quiet machine the watch costs two clock reads and
# a mean per parallel call. The results do not depend on the thread count
# (a plan's items and their merge order are fixed). FLASHTILE_JOIN_WATCH=0
# turns it off.

#: A parallel call is watched while its fastest run took less than this (ns):
#: for larger calls the other cores save more than the waits cost.
JOIN_SMALL_NS = 2_000_000
#: The moving means' weight of a new time: 1 / JOIN_WEIGHT.
JOIN_WEIGHT = 64
#: A hold starts when the parallel mean passes JOIN_MARGIN x the serial one
#: (the first parallel call after a hold wakes the pool: slower than the rest).
JOIN_MARGIN = 1.25
#: How long a watched size class then runs on one thread (ns).
JOIN_HOLD_NS = 1_000_000_000
#: Whether the join watch is on.
JOIN_WATCH = os.environ.get("FLASHTILE_JOIN_WATCH", "1") != "0"
#: ``(kernel, size class) -> [fastest parallel time, parallel mean (0: from
#: the next call, or the serial mean), serial mean (0: none yet), end of the
#: hold (on ``_clock``; 0: none)]`` (times in ns).
_WATCH: dict = {}
#: The watch's clock (a name of its own: the tests plant one).
_clock = time.perf_counter_ns


def reset_join_watch() -> None:
    """Forget the join watch's records (tests)."""
    _WATCH.clear()


def _watched(state: list, threads: int, elapsed: int, end: int) -> None:
    """Fold a small call's time on ``threads`` into its ``state`` (see
    ``_WATCH``); hold it to one thread where the parallel mean is the slower."""
    if threads == 1:  # (a call of a hold)
        state[2] = state[2] + (elapsed - state[2]) / JOIN_WEIGHT if state[2] else elapsed
        return
    state[0] = min(state[0], elapsed)
    if not state[1]:
        state[1] = state[2] or elapsed
    state[1] += (elapsed - state[1]) / JOIN_WEIGHT
    if state[1] > (JOIN_MARGIN * state[2] or 2 * threads * state[0]):
        state[1], state[3] = 0, end + JOIN_HOLD_NS


def _call(threads, size, entry, kernel, *args):
    """``kernel(*args, entry.address, entry.threads)`` on the plan's
    ``threads`` (:func:`flashtile.planning.call_threads`), or on one where
    the join watch (above) finds that faster; ``size``: the call's work
    (:func:`flashtile.planning.call_size`, an int); ``entry``: the kernel's
    :func:`.blas.gemm_for`.

    The kernel pins a threaded BLAS to one thread while it runs
    (:mod:`.blas_threads`, from ``entry.threads``): with several kernel
    threads it must not start its own, and with one it keeps the products
    bit-identical from call to call (a threaded MKL's result depends on its
    thread count). The pin is a kernel's first step and its restore its
    last, so an exception raised in the kernel's body (an allocation that
    failed) comes after its pin: it is unpinned here
    (:func:`_raised_by_kernel`). With one thread, Numba's count is set to 1 for the
    call, so the pool is never woken; with a pool larger than the CPUs the
    process may use, to the plan's count; otherwise (several threads on an
    uncapped pool, where ``numba_threads()`` is the calling thread's own
    count) it is left alone.
    """
    watched = threads > 1 and JOIN_WATCH
    if watched:  # (inline: the parallel path's cost is part of every call)
        key = (kernel, size.bit_length())
        state = _WATCH.get(key)
        start = _clock()
        if state is not None and start < state[3]:
            threads = 1
    swap = threads <= 1 or _USABLE < numba.config.NUMBA_NUM_THREADS
    saved = _swap_threads(threads) if swap else 0
    try:
        result = kernel(*args, entry.address, entry.threads)
    except Exception as error:
        if _raised_by_kernel(error):
            _kernels().unpin_blas(entry.threads)
        raise
    finally:
        if swap:
            _swap_threads(saved)
    if watched:
        end = _clock()
        if state is None:
            _WATCH[key] = [end - start, 0, 0, 0]
        elif state[0] < JOIN_SMALL_NS:
            _watched(state, threads, end - start, end)
        elif end - start < state[0]:  # (a large call: its fastest, the mean from the next)
            state[0], state[1] = end - start, 0
    return result


#: Numba's own Python code (its dispatcher's compiling and caching).
_NUMBA_CODE = os.path.dirname(numba.__file__) + os.sep


def _raised_by_kernel(error: Exception) -> bool:
    """Whether an exception from a kernel call came from its compiled body,
    after its pin: not a ``TypeError`` (the dispatcher refusing the
    arguments) and no frame below the call in Numba's Python (compiling,
    reading its cache), which runs before the kernel does. Compiled code
    raises with no frame below, or one that names the kernel's source."""
    if isinstance(error, TypeError):
        return False
    frame = error.__traceback__.tb_next
    while frame is not None:
        if frame.tb_frame.f_code.co_filename.startswith(_NUMBA_CODE):
            return False
        frame = frame.tb_next
    return True


def run_forward(plan, log2=False, limits=NO_LIMITS) -> tuple[np.ndarray, ...] | None:
    """``(out (NB, Hq, TQ, dv), lse (NB, Hq, TQ), tiles computed per item)``
    of a forward plan; ``lse`` in natural log, or in log2 units with ``log2``
    (the float64 backward's own: exact for a one-hot row, see
    :mod:`flashtile.gradients`).

    ``out`` has the dtype of ``plan.q4`` (bfloat16 too: the kernel reads and
    writes its bits as ``uint16``, :mod:`.half`); ``lse`` the work dtype.
    ``limits``: ``(score, products)`` bounds the call's values must stay
    under, checked in the kernel call; None when they do not (nothing
    computed). The kernel's bound has no additive term: only for plans
    without ALiBi slopes or an additive mask (:func:`flashtile.precision.bounds`
    adds theirs).
    """
    kernels = _kernels()
    q4, k4, v4 = plan.q4, plan.k4, plan.v4
    lse = np.empty(q4.shape[:-1], dtype=COMPUTE_DTYPES[q4.dtype])
    half = q4.dtype == BFLOAT16
    if half:  # Numba has no bf16: the same memory as uint16
        q4, k4, v4 = q4.view(np.uint16), k4.view(np.uint16), v4.view(np.uint16)
    out, visited, fits = _call(
        plan.threads, plan.size, kernels.gemm_for(plan.q4.dtype, plan.small),
        kernels.forward_call, q4, k4, v4, lse, plan.seqs, plan.items, plan.scale,
        tuple(plan.variants), plan.block_q, plan.block_k, 1.0 if log2 else LN2, *limits,
    )  # fmt: skip
    if not fits:
        return None
    return (out.view(BFLOAT16) if half else out), lse, visited


def run_backward(plan, out, lse, dout, log2=False, limits=NO_LIMITS) -> tuple | None:
    """``(dq, dk, dv, sums)`` for a backward plan: the gradients shaped like
    ``plan.q4``, ``k4``, ``v4`` (``dq`` in the dtype of ``q4``, ``dk``/``dv``
    in the work dtype, or rounded to bf16 for bf16 inputs), and each query
    row's sum of the recomputed probabilities, ``sums (NB, Hq, TQ)`` in the
    work dtype (:func:`flashtile.precision.gradients_unreliable` reads it).
    ``lse`` in natural log, or in log2 units with ``log2``; ``limits`` as in
    :func:`run_forward` (None when the values pass them: nothing computed).

    ``out``, ``lse``, ``dout`` hold the caller's validated arrays (any layout
    with the plan's sizes); the parts' ``dk``/``dv`` are summed in a fixed
    order, so the result is deterministic.
    """
    kernels = _kernels()
    q4, k4, v4 = plan.q4, plan.k4, plan.v4
    rows = q4.shape[:-1]
    work = COMPUTE_DTYPES[q4.dtype]  # lse and the dk/dv sums (float32 for bf16)
    out4 = np.ascontiguousarray(out, dtype=q4.dtype).reshape(rows + v4.shape[-1:])
    dout4 = np.ascontiguousarray(dout, dtype=q4.dtype).reshape(rows + v4.shape[-1:])
    lse4 = np.ascontiguousarray(lse, dtype=work).reshape(rows)
    dq = np.empty_like(q4)
    # Part p accumulates its share of dk/dv in slice p; summed into slice 0.
    dk = np.zeros((plan.parts, *k4.shape), work)
    dv = np.zeros((plan.parts, *v4.shape), work)
    half = q4.dtype == BFLOAT16
    bits = (q4, k4, v4, out4, lse4, dout4, dq)
    if half:  # Numba has no bf16: the same memory as uint16
        bits = tuple(a if a is lse4 else a.view(np.uint16) for a in bits)
    sums, fits = _call(
        plan.threads, plan.size, kernels.gemm_for(q4.dtype, plan.small), kernels.backward_call,
        *bits, dk, dv, plan.seqs, plan.items, plan.scale, tuple(plan.variants), plan.block_q,
        plan.block_k, 1.0 if log2 else LOG2E, *limits,
    )  # fmt: skip
    if not fits:
        return None
    dk, dv = dk[0], dv[0]
    if half:  # compiled rounding: ml_dtypes' astype is 5x slower
        dk, dv = kernels.to_bfloat16(dk), kernels.to_bfloat16(dv)
    return dq, dk, dv, sums[..., 0]


class DecodeLaunch(NamedTuple):
    """A decode plan's kernel call but its arrays ``q, k, v``
    (:func:`decode_launch`), in the kernel's argument order from ``fmt``.

    Attributes:
        threads, size: the plan's thread count and work (:func:`_call`).
        gemm: :func:`.blas.gemm_for`'s entry; kernel: ``decode_call``.
        cache_bits, q_bits: whether the kernel reads the cache's, and the
            queries', bit patterns (``uint16`` views: 16-bit values).
        fmt: the cache's format flag (:func:`.memory.cache_operands`).
        walk: :func:`.cache_rows.walk_flag` of the plan's walk.
        table, seqlens, items, spans, scale, tile_keys: the plan's.
        check_raw: whether the kernel reports raw scores that are not finite
            (float32 work: :mod:`flashtile.precision`).
        variants: the plan's :class:`.tiles.KernelVariants` as a plain tuple.
        ahead: :func:`.cache_rows.walk_prefetches` of the plan's walk.
    """

    threads: int
    size: int
    gemm: object
    kernel: object
    cache_bits: bool
    q_bits: bool
    fmt: object
    walk: object
    table: np.ndarray
    seqlens: np.ndarray
    items: np.ndarray
    spans: np.ndarray
    check_raw: bool
    scale: float
    variants: tuple
    tile_keys: int
    ahead: bool


def decode_launch(plan) -> DecodeLaunch:
    """The decode kernel call of ``plan`` but its arrays, as :func:`run_launch`
    takes it. Everything in it follows from the plan's metadata, so a
    repeated call of the same metadata (a prepared step,
    :mod:`flashtile.frontdoor`) keeps it and runs it on its own arrays: a
    decoding step between a model's layers runs with Python's code and data
    evicted from the caches, where each Python step skipped saves several
    microseconds."""
    kernels = _kernels()
    q, k = plan.q, plan.layout.k
    bits, _, fmt = kernels.cache_operands(k, k)  # (views of 16-bit values' bits)
    return DecodeLaunch(
        plan.threads, plan.size, kernels.gemm_for(q.dtype, small=plan.small), kernels.decode_call,
        bits is not k, q.dtype == BFLOAT16, fmt, kernels.walk_flag(plan.walk), plan.layout.table,
        plan.layout.seqlens, plan.items, plan.spans, COMPUTE_DTYPES[q.dtype] == np.float32,
        plan.scale, tuple(plan.variants), plan.tile_keys, kernels.walk_prefetches(plan.walk),
    )  # fmt: skip


def run_launch(launch: DecodeLaunch, q, k, v) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """:func:`run_decode` of the plan that gave ``launch`` (:func:`decode_launch`),
    on arrays ``q, k, v`` of its shapes and dtypes: ``q (B, Hq, Tq, d)``
    C-contiguous in the plan's work dtype, ``k, v`` its cache arrays."""
    threads, size, gemm_fn, kernel, cache_bits, q_bits, *rest = launch
    # Numba has no 16-bit floats: the kernel widens the bit patterns itself
    # (or, for bf16 products, multiplies them as they are). The views are
    # cache_operands' answer, kept in the launch: asked on every call, its
    # dtype tests cost microseconds between a model's layers.
    if cache_bits:
        k, v = k.view(np.uint16), v.view(np.uint16)
    if q_bits:
        q = q.view(np.uint16)
    return _call(threads, size, gemm_fn, kernel, q, k, v, *rest)


def run_decode(plan) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """``(out (B, Hq, Tq, dv), lse (B, Hq, Tq), flagged, finite)`` of a decode
    plan, in the work dtype; ``flagged``: some raw score was not finite,
    ``finite``: every ``lse`` is (the caller checks the float32 range from
    those, :func:`flashtile.precision.decode_overflowed`)."""
    return run_launch(decode_launch(plan), plan.q, plan.layout.k, plan.layout.v)

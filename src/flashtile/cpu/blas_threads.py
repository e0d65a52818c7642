"""The BLAS a kernel call uses, pinned to one thread while the call runs.

Inside a ``prange`` every kernel thread already owns a core, so unless the
kernel calls a sequential MKL (``GemmEntry.pinned`` is False) the BLAS it
calls is pinned to one thread for the duration of the call; otherwise
OpenBLAS spawns its own threads inside the OpenMP region and warns "Detect
OpenMP Loop and this application may hang". With one kernel thread the pin
also keeps a threaded MKL's products bit-identical from call to call (its
result depends on its thread count).

Only the library the call uses (``GemmEntry.library``) is pinned, with a
count per library: calls overlapping from several Python threads pin once,
and the last to leave restores the user's thread count, so the user's own
BLAS threading is never left changed. NumPy's 64-bit-integer (ILP64)
OpenBLAS, which no kernel calls, is left alone.

Every kernel call on OpenBLAS pays this, so it is kept small: on an AMD
EPYC (Zen 4) with SciPy's OpenBLAS at 2 threads, a context manager over
every loaded BLAS cost 4.0-6.5 us a call; :func:`pin` and :func:`unpin` on
the one library cost about 1.6 (a read and two writes of its count through
threadpoolctl's controllers).
"""

from __future__ import annotations

import contextlib
import functools
import threading

from threadpoolctl import ThreadpoolController

from .blas import GemmEntry

#: 32-bit-integer (LP64) sgemm symbols: what SciPy's ``cython_blas`` and oneMKL's
#: LP64 interface export. An OpenBLAS without them is an ILP64 build
#: (``..._64_`` symbols, NumPy's own), which the kernels never call.
_LP64_SGEMM = ("sgemm_", "scipy_sgemm_", "sgemm")

_lock = threading.Lock()
#: library -> [overlapping pins, [(controller, the user's count)]]
_pins: dict[str, list] = {}


@functools.cache
def controllers(library: str) -> tuple:
    """threadpoolctl's controllers of ``library`` (``"mkl"``, ``"openblas"``),
    the LP64 builds the kernels can call, scanned (~3 ms) once; the library
    is loaded (a :class:`~.blas.GemmEntry` of it exists). Each reads and
    sets its thread count with one ctypes call, where
    ``ThreadpoolController.limit`` re-reads every library's state first
    (35-46 us a call)."""
    return tuple(
        c
        for c in ThreadpoolController().lib_controllers
        if c.user_api == "blas" and c.internal_api == library and lp64(c)
    )


def lp64(controller) -> bool:
    """Whether the kernels can call this BLAS: not an ILP64-only OpenBLAS."""
    if controller.internal_api != "openblas":
        return True
    return any(hasattr(controller.dynlib, name) for name in _LP64_SGEMM)


def pin(entry: GemmEntry) -> None:
    """Pin ``entry``'s library to one thread (the first of overlapping calls
    does); every call is followed by :func:`unpin` with the same entry."""
    with _lock:
        state = _pins.setdefault(entry.library, [0, []])
        if state[0] == 0:
            state[1] = []
            for c in controllers(entry.library):
                n = c.get_num_threads()
                if n != 1:
                    c.set_num_threads(1)
                    state[1].append((c, n))
        state[0] += 1


def unpin(entry: GemmEntry) -> None:
    """Undo :func:`pin`: the last of overlapping calls restores the counts."""
    with _lock:
        state = _pins[entry.library]
        state[0] -= 1
        if state[0] == 0:
            for c, n in state[1]:
                c.set_num_threads(n)
            state[1] = []


@contextlib.contextmanager
def single_threaded(entry: GemmEntry):
    """:func:`pin` and :func:`unpin` around a block, unless ``entry`` needs no
    pin (a sequential MKL, flashtile's own bf16 gemm)."""
    if not entry.pinned:
        yield
        return
    pin(entry)
    try:
        yield
    finally:
        unpin(entry)

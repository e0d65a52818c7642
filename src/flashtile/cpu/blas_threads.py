"""The BLAS a kernel call uses, pinned to one thread while the call runs.

Inside a ``prange`` every kernel thread already owns a core, so unless the
kernel calls a sequential MKL or flashtile's own bf16 gemm
(``GemmEntry.pinned`` is False) the BLAS it calls is pinned to one thread
for the duration of the call; otherwise OpenBLAS spawns its own threads
inside the OpenMP region and warns "Detect OpenMP Loop and this application
may hang". With one kernel thread the pin also keeps a threaded MKL's
products bit-identical from call to call (its result depends on its thread
count).

Only the library the call's ``gemm`` lives in is pinned (the shared object
holding its address, :func:`controllers`), with a count per entry: calls
overlapping from several Python threads pin once, and the last to leave
restores the user's thread count, so the user's own BLAS threading is never
left changed. NumPy's 64-bit-integer (ILP64) OpenBLAS, which no kernel
calls, is left alone.

Every kernel call on OpenBLAS pays this, so it is kept small: on an AMD
EPYC (Zen 4) with SciPy's OpenBLAS at 2 threads, :func:`pin` and
:func:`unpin` around a call cost 2.8-3.3 us, against 4.0-6.5 for the earlier
context manager over every loaded BLAS (most of it is threadpoolctl's
reading and two settings of the count, 1.5 us).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

from threadpoolctl import ThreadpoolController

from .blas import GemmEntry

#: 32-bit-integer (LP64) sgemm symbols: what SciPy's ``cython_blas`` and oneMKL's
#: LP64 interface export. An OpenBLAS without them is an ILP64 build
#: (``..._64_`` symbols, NumPy's own), which the kernels never call.
_LP64_SGEMM = ("sgemm_", "scipy_sgemm_", "sgemm")

_lock = threading.Lock()
#: entry address -> [overlapping pins, [(controller, the user's count)]]
_pins: dict[int, list] = {}


@functools.cache
def controllers(address: int, library: str) -> tuple:
    """threadpoolctl's controllers to pin for the ``gemm`` at ``address``
    (``library``: its :class:`~.blas.GemmEntry` label), the first of: the
    library file holding the address (oneMKL's); the loaded BLAS of that
    kind (SciPy's ``cython_blas`` hands out wrappers of its own, and
    ``"openblas"`` is flashtile's name for whatever BLAS SciPy links);
    every LP64 BLAS threadpoolctl lists (a SciPy built against oneMKL or
    FlexiBLAS). Scanned (~3 ms) once per entry. Each reads and sets its
    thread count with one ctypes call, where ``ThreadpoolController.limit``
    re-reads every library's state first (35-46 us a call)."""
    blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas" and lp64(c)]
    path = _library_file(address)
    own = [c for c in blas if path is not None and os.path.realpath(c.filepath) == path]
    kind = [c for c in blas if c.internal_api == library]
    return tuple(own or kind or blas)


def _library_file(address: int) -> str | None:
    """The real path of the shared object holding ``address`` (``dladdr``),
    or None where it cannot be told."""

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p),
        ]  # fmt: skip

    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError):  # no dladdr on this platform
        return None
    info = DlInfo()
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def lp64(controller) -> bool:
    """Whether the kernels can call this BLAS: not an ILP64-only OpenBLAS."""
    if controller.internal_api != "openblas":
        return True
    return any(hasattr(controller.dynlib, name) for name in _LP64_SGEMM)


def pin(entry: GemmEntry) -> None:
    """Pin ``entry``'s library to one thread (the first of overlapping calls
    does); each successful call is followed by :func:`unpin` with the same
    entry. If setting a count fails, the counts already set are restored and
    the error is raised: nothing stays pinned."""
    with _lock:
        state = _pins.setdefault(entry.address, [0, []])
        if state[0] == 0:
            saved = []
            try:
                for c in controllers(entry.address, entry.library):
                    n = c.get_num_threads()
                    if n != 1:
                        saved.append((c, n))
                        c.set_num_threads(1)
            except BaseException:
                _restore(saved)
                raise
            state[1] = saved
        state[0] += 1


def unpin(entry: GemmEntry) -> None:
    """Undo :func:`pin`: the last of overlapping calls restores the counts
    (each one, even if restoring another fails; the first error is raised)."""
    with _lock:
        state = _pins[entry.address]
        state[0] -= 1
        if state[0] == 0:
            saved, state[1] = state[1], []
            _restore(saved)


def _restore(saved) -> None:
    """Set each ``(controller, count)`` of ``saved``; raise the first failure
    after trying them all."""
    failure = None
    for c, n in saved:
        try:
            c.set_num_threads(n)
        except BaseException as error:  # (the others are still restored)
            failure = failure or error
    if failure is not None:
        raise failure


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

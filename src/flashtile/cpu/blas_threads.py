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
holding its address, :func:`controllers`); NumPy's 64-bit-integer (ILP64)
OpenBLAS, which no kernel calls, is left alone.

The kernels pin and restore in compiled code (:func:`pin_blas` first,
:func:`unpin_blas` last), on a :func:`thread_table` of the libraries' own
thread-count functions. Kernel calls from several Python threads overlap
(Numba releases the GIL inside a parallel region), so the table counts the
calls holding a pin: the first saves the user's count and sets one thread,
the last restores it. Pins and unpins themselves run with the GIL held,
outside the parallel regions, so they never interleave. On an AMD EPYC
(Zen 4) with SciPy's OpenBLAS at 2 threads the Python pin this replaces
(threadpoolctl's controllers, a lock and a count per entry) cost 2.8-3.3 us
a call, and two Python calls more on every kernel call's path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from threadpoolctl import ThreadpoolController

#: 32-bit-integer (LP64) sgemm symbols: what SciPy's ``cython_blas`` and oneMKL's
#: LP64 interface export. An OpenBLAS without them is an ILP64 build
#: (``..._64_`` symbols, NumPy's own), which the kernels never call.
_LP64_SGEMM = ("sgemm_", "scipy_sgemm_", "sgemm")

#: Each library's process-wide thread-count getter and setter (threadpoolctl's
#: ``internal_api`` names). Every getter returns a C ``int`` and every setter
#: takes one, but BLIS's take its 64-bit ``dim_t``: the setter is passed a
#: 64-bit integer (an ``int`` parameter reads its low half) and the getter's
#: low 32 bits are read. oneMKL's process-wide setter, not threadpoolctl's
#: thread-local one (the kernel's worker threads call MKL, not the caller);
#: its getter answers for the calling thread, whose own count
#: (``MKL_Set_Num_Threads_Local``, as in threadpoolctl's limits) is cleared
#: around the read (:data:`_LOCAL`).
_COUNT_FUNCTIONS = {
    "openblas": ("openblas_get_num_threads", "openblas_set_num_threads"),
    "mkl": ("MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
    "blis": ("bli_thread_get_num_threads", "bli_thread_set_num_threads"),
    "flexiblas": ("flexiblas_get_num_threads", "flexiblas_set_num_threads"),
}
#: A library's setter of the calling thread's own count, returning the
#: previous one (0: none, the process-wide count applies). A count of the
#: calling thread's own still governs the products that thread runs itself
#: (a one-thread plan, under a threaded oneMKL layer that the user chose):
#: the pin sets the process-wide count only.
_LOCAL = {"mkl": "MKL_Set_Num_Threads_Local"}
#: OpenBLAS symbol prefixes: SciPy's wheels prefix theirs with ``scipy_``.
_OPENBLAS_PREFIXES = ("", "scipy_")

#: The columns of a :func:`thread_table` row.
GET, SET, LOCAL, SAVED, DEPTH = 0, 1, 2, 3, 4


@functools.cache
def controllers(address: int, library: str) -> tuple:
    """threadpoolctl's controllers to pin for the ``gemm`` at ``address``
    (``library``: its :class:`~.blas.GemmEntry` label), the first of: the
    library file holding the address (oneMKL's); the loaded BLAS of that
    kind (SciPy's ``cython_blas`` hands out wrappers of its own, and
    ``"openblas"`` is flashtile's name for whatever BLAS SciPy links);
    every LP64 BLAS threadpoolctl lists (a SciPy built against oneMKL or
    FlexiBLAS). Scanned (~3 ms) once per entry."""
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


#: Shared thread tables by their libraries' functions (see :func:`thread_table`).
_tables: dict[tuple, np.ndarray] = {}
_tables_lock = threading.Lock()


def thread_table(address: int, library: str) -> np.ndarray:
    """``(n, 5)`` int64, a row per library :func:`controllers` names: the
    addresses of its thread-count getter and setter (columns ``GET``,
    ``SET``) and of its setter of the calling thread's own count (``LOCAL``,
    0 where it has none), the user's count saved by the first pin
    (``SAVED``) and the calls holding a pin (``DEPTH``). A library without
    those functions cannot be pinned and has no row. Each
    :class:`~.blas.GemmEntry` keeps one, which its kernel calls pin; entries
    of the same libraries share it (the sgemm and dgemm of one OpenBLAS), so
    their pins are counted together. (Entries whose libraries overlap
    without being the same, which only the every-LP64-BLAS fallback of
    :func:`controllers` gives, count apart.)"""
    functions = tuple(fns for c in controllers(address, library) if (fns := _count_functions(c)))
    with _tables_lock:  # one table per set of libraries, also for concurrent first calls
        if functions not in _tables:
            rows = [(*fns, 0, 0) for fns in functions]
            _tables[functions] = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
        return _tables[functions]


def _count_functions(controller) -> tuple[int, int, int] | None:
    """``(getter, setter, local setter or 0)`` addresses of a controller's
    library, or None."""
    api = controller.internal_api
    names = _COUNT_FUNCTIONS.get(api)
    if names is None:
        return None
    local = getattr(controller.dynlib, _LOCAL[api], None) if api in _LOCAL else None
    prefixes = _OPENBLAS_PREFIXES if api == "openblas" else ("",)
    for prefix in prefixes:
        found = [getattr(controller.dynlib, prefix + name, None) for name in names]
        if None not in found:
            return (*(_address(f) for f in found), 0 if local is None else _address(local))
    return None


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


@intrinsic
def _get_count(typingctx, address):
    """Call the getter at ``address``: its C ``int`` result as an int64."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        function = ir.FunctionType(ir.IntType(32), [])
        result = builder.call(builder.inttoptr(args[0], function.as_pointer()), [])
        return builder.sext(result, ir.IntType(64))

    return types.int64(address), codegen


@intrinsic
def _set_count(typingctx, address, count):
    """Call the setter at ``address`` with ``count`` (as a 64-bit integer:
    see :data:`_COUNT_FUNCTIONS`)."""
    if not (isinstance(address, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        function = ir.FunctionType(ir.VoidType(), [ir.IntType(64)])
        value = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.call(builder.inttoptr(args[0], function.as_pointer()), [value])
        return context.get_dummy_value()

    return types.void(address, count), codegen


@intrinsic
def _set_local(typingctx, address, count):
    """Call the thread-local setter at ``address`` (C ``int`` in and out)
    with ``count``; its result (the previous local count) as an int64."""
    if not (isinstance(address, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        function = ir.FunctionType(i32, [i32])
        value = context.cast(builder, args[1], signature.args[1], types.int32)
        result = builder.call(builder.inttoptr(args[0], function.as_pointer()), [value])
        return builder.sext(result, ir.IntType(64))

    return types.int64(address, count), codegen


@njit(cache=True, inline="always")
def _process_count(row):
    """A table row's process-wide thread count (the calling thread's own one
    cleared for the read, where the library has one)."""
    if row[LOCAL] == 0:
        return _get_count(row[GET])
    own = _set_local(row[LOCAL], 0)
    count = _get_count(row[GET])
    _set_local(row[LOCAL], own)
    return count


@njit(cache=True)
def pin_blas(table):
    """Pin each library of a :func:`thread_table` to one thread: the first
    of overlapping calls saves its count and sets 1. A kernel's first step;
    :func:`unpin_blas` its last. Called with the GIL held (outside any
    parallel region): pins and unpins never interleave."""
    for i in range(table.shape[0]):
        if table[i, DEPTH] == 0:
            count = _process_count(table[i])
            table[i, SAVED] = count
            if count > 1:
                _set_count(table[i, SET], 1)
        table[i, DEPTH] += 1


@njit(cache=True)
def unpin_blas(table):
    """Undo :func:`pin_blas`: the last of overlapping calls restores the
    count it saved. A table nobody pins is left alone."""
    for i in range(table.shape[0]):
        if table[i, DEPTH] == 0:
            continue
        table[i, DEPTH] -= 1
        if table[i, DEPTH] == 0 and table[i, SAVED] > 1:
            _set_count(table[i, SET], table[i, SAVED])


@contextlib.contextmanager
def single_threaded(entry):
    """``entry``'s libraries (a :class:`~.blas.GemmEntry`) pinned to one thread
    around a block of Python code (the kernels pin themselves), counted with
    the kernels' pins: the last to leave restores the user's counts."""
    pin_blas(entry.threads)
    try:
        yield
    finally:
        unpin_blas(entry.threads)

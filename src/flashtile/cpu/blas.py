"""BLAS ``gemm`` for the kernels, and keeping BLAS single-threaded while they run.

The kernels' tile products are Fortran ``sgemm``/``dgemm`` calls through a
function pointer, from one of two libraries (the *backend*):

* ``"mkl"``: Intel oneMKL's ``libmkl_rt`` from the PyPI ``mkl`` package
  (``pip install 'flashtile[mkl]'``, Linux x86-64), else one the system
  linker finds. On this project's AVX-512 machine its sgemm runs the
  attention tile shapes (K = 64 inner dimension) 20-40% faster than
  OpenBLAS, which is most of the gap to PyTorch's CPU flash kernel (itself
  built on MKL). The kernels already run one BLAS call per core, so when
  flashtile is the first to load it and ``MKL_THREADING_LAYER`` is unset it
  selects MKL's *sequential* threading layer. That setting is process-wide:
  other users of the same ``libmkl_rt`` (NumPy built on it, say) then run
  single-threaded too; set ``MKL_THREADING_LAYER`` (e.g. ``INTEL``) to keep
  threads, and flashtile pins MKL around its calls instead. PyTorch links
  its own MKL and is not affected.
* ``"openblas"``: the OpenBLAS SciPy ships, always present (via
  ``scipy.linalg.cython_blas``).

The default is ``"auto"``: the measured route (:mod:`flashtile.routes`,
``"blas"``: each library timed on the forward and backward of this machine,
once), and with nothing measured MKL when the package is installed, else
OpenBLAS. The ranking is the CPU's: oneMKL was 20-40% faster on Intel
Xeons with AVX-512 and 9% slower on an AMD EPYC of the Zen 4 class. The
environment variable ``FLASHTILE_BLAS`` (``auto``/``mkl``/``openblas``)
or :func:`set_backend` chooses explicitly; :func:`backend` says which one
runs. Both give results equal to float32 rounding, each deterministic run to
run (tested), but not bit-identical to each other.

Calling ``gemm`` directly rather than Numba's ``np.dot`` buys two things:
``beta = 1`` (accumulate into the output: ``acc += P V`` without a
temporary and an extra pass) and leading dimensions (any row-strided view).
The function's address is passed to the kernels as an integer argument
(:func:`fortran_gemm` calls it), so it is looked up at run time and the
compiled kernels stay cacheable (one compiled kernel serves both backends).
An integer rather than a ctypes function object: unboxing one of those cost
3-4 us of every kernel call, and the flags, sizes and scalars now live on
the stack instead of in three arrays allocated per product (a tiny causal
call, 4 heads of 16 x 16: the kernel 23.9 -> 18.3 us on one thread).

Inside a ``prange`` every kernel thread already owns a core, so unless the
kernel calls a sequential MKL or flashtile's own bf16 gemm, the BLAS it
calls is pinned to one thread for the duration of the call
(:mod:`.blas_threads`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import threading
from pathlib import Path
from typing import NamedTuple

import llvmlite.binding as llvm
import ml_dtypes
import numpy as np
import scipy.linalg.cython_blas
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import routes
from . import FASTMATH, bf16_gemm
from .blas_threads import thread_table

_TRANS, _NOTRANS = ord("T"), ord("N")


def _capsule_pointer(name: str) -> int:
    capsule = scipy.linalg.cython_blas.__pyx_capi__[name]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))


#: ``FLASHTILE_BLAS`` values, and what :func:`set_backend` accepts.
CHOICES = ("auto", "mkl", "openblas")
# oneMKL's single dynamic library dispatches on these run-time settings.
_MKL_THREADING_SEQUENTIAL = 1
_MKL_INTERFACE_LP64 = 0  # 32-bit integers, as gemm() passes them

_lock = threading.Lock()
_choice: str | None = None  # None: read FLASHTILE_BLAS on first use
_explicit = False  # _choice came from set_backend with a library's name


def _mkl_path() -> str | None:
    """Path of ``libmkl_rt`` from the PyPI ``mkl`` package, else a system one."""
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            return str(Path(f.locate()).resolve())
    return ctypes.util.find_library("mkl_rt")


#: Why :func:`_mkl` returned None (for the error of an explicit "mkl").
_mkl_problem = "oneMKL is not installed: pip install 'flashtile[mkl]' (Linux x86-64)"


def _already_loaded(path: str) -> bool:
    """Whether this process has loaded the library at ``path`` already."""
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """oneMKL's ``libmkl_rt`` set up for the kernels, or None (see ``_mkl_problem``).

    The threading layer is process-wide. flashtile chooses the sequential one
    only when nobody else has chosen: the library was not loaded before and
    ``MKL_THREADING_LAYER`` is unset. Otherwise the layer in force stays and
    MKL is pinned to one thread around each kernel call, like OpenBLAS.
    """
    global _mkl_problem
    path = _mkl_path()
    if path is None:
        return None
    interface = os.environ.get("MKL_INTERFACE_LAYER", "")
    if "ILP64" in interface.upper():
        _mkl_problem = (
            f"MKL_INTERFACE_LAYER={interface!r} selects 64-bit integers and the kernels "
            "pass 32-bit ones"
        )
        return None
    try:
        loaded_before = _already_loaded(path)
        lib = ctypes.CDLL(path)  # RTLD_LOCAL: its sgemm_ does not shadow OpenBLAS's
        set_threading, set_interface = lib.MKL_Set_Threading_Layer, lib.MKL_Set_Interface_Layer
    except (OSError, AttributeError) as err:
        _mkl_problem = f"{path} cannot be used: {err}"
        return None
    lib.sequential = False
    if not (loaded_before or os.environ.get("MKL_THREADING_LAYER")):
        # Takes effect only before MKL's first call; returns the layer in force.
        lib.sequential = set_threading(_MKL_THREADING_SEQUENTIAL) == _MKL_THREADING_SEQUENTIAL
    if set_interface(_MKL_INTERFACE_LP64) != _MKL_INTERFACE_LP64:
        _mkl_problem = "this process's MKL already runs with 64-bit integers (ILP64)"
        return None
    return lib


def available() -> tuple[str, ...]:
    """The backends this process can load (``"openblas"`` always)."""
    return ("mkl", "openblas") if _mkl() is not None else ("openblas",)


routes.limit("blas", available)


def _resolve(choice: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"BLAS backend must be one of {CHOICES}, got {choice!r}")
    if choice == "auto":  # the measured route, or the fixed rule: MKL when installed
        chosen = routes.choice("blas")
        return chosen if chosen in available() else "openblas"
    if choice == "mkl" and _mkl() is None:
        raise ValueError(f"BLAS backend 'mkl' requested but {_mkl_problem}; or choose 'openblas'")
    return choice


def backend() -> str:
    """The BLAS library the kernels call now: ``"mkl"`` or ``"openblas"``."""
    global _choice
    if _choice is not None:
        return _choice
    env = os.environ.get("FLASHTILE_BLAS", "auto").strip().lower() or "auto"
    try:  # outside the lock: a first measurement of the route sets backends itself
        resolved = _resolve(env)
    except ValueError as err:
        raise ValueError(f"FLASHTILE_BLAS={env!r}: {err}") from None
    if env == "auto" and routes.provisional("blas"):
        return resolved  # the fixed rule while another route is measured: not kept
    with _lock:
        if _choice is None:  # (a set_backend meanwhile wins)
            _choice = resolved
        return _choice


def set_backend(choice: str) -> str:
    """Choose the kernels' BLAS (``"auto"``, ``"mkl"`` or ``"openblas"``).

    Returns the backend now in use. Raises ``ValueError`` for an unknown
    name, or for ``"mkl"`` when oneMKL is not installed. Results of the two
    backends agree to float32 rounding, not bit for bit.
    """
    global _choice, _explicit
    resolved = _resolve(choice)
    with _lock:
        _choice, _explicit = resolved, choice != "auto"
    routes.moved()  # plans kept across calls, and the decode walks, read the backend
    return resolved


def pinned() -> str | None:
    """The library :func:`set_backend` chose by name in this process, or None
    (nothing chosen yet, or ``auto``: the route's, resolved again after a
    measurement)."""
    return _choice if _explicit else None


def reset_backend(choice: str | None = None) -> None:
    """Put back the backend in force (the ``backend()`` of an earlier moment,
    or None: the next :func:`backend` resolves ``FLASHTILE_BLAS``, or the
    route, again)."""
    global _choice, _explicit
    with _lock:
        _choice, _explicit = choice, choice is not None
    routes.moved()


#: CPU features (LLVM's names) with bf16 dot-product instructions.
BF16_FEATURES = ("avx512bf16", "amx-bf16")


@functools.cache
def bf16_features() -> tuple[str, ...]:
    """This CPU's bf16 instruction sets among :data:`BF16_FEATURES` (none: empty)."""
    features = llvm.get_host_cpu_features()
    return tuple(f for f in BF16_FEATURES if features.get(f, False))


def bf16_available() -> tuple[str, ...]:
    """The ``"bf16"`` route's candidates this process can run, the fixed
    rule's first: oneMKL first where the CPU has AMX (it runs its tiles
    there), flashtile's product first elsewhere with AVX512-BF16 (oneMKL's
    instruction-set dispatch serves only Intel processors: on an AMD EPYC
    its bf16 products ran at its float32 rate). oneMKL's bf16 gemm without
    bf16 instructions is emulated, slower than widening: not a candidate."""
    features = bf16_features()
    own = ("vdpbf16ps",) if bf16_gemm.available() else ()
    mkl = ("mkl",) if features and _mkl_path() is not None else ()  # (found, not loaded)
    return (*(mkl + own if "amx-bf16" in features else own + mkl), "widen")


routes.limit("bf16", bf16_available)


def bf16_library() -> str:
    """Where bfloat16 inputs' tile products run: ``"vdpbf16ps"``, ``"mkl"``
    or ``"widen"`` (the ``"bf16"`` route: flashtile's ``vdpbf16ps`` product,
    :mod:`.bf16_gemm`; oneMKL's ``gemm_bf16bf16f32``; or no bf16 products,
    the operands widened to float32 before the kernels)."""
    chosen = routes.choice("bf16")
    usable = bf16_available()
    if chosen in usable:
        return chosen
    why = routes.explain("bf16")[1]
    if why.startswith("forced"):
        raise ValueError(
            f"bf16 products {chosen!r} cannot run here ({why}; this process has "
            f"{usable}): unset FLASHTILE_BF16 or choose one of those"
        )
    return usable[0]  # (an answer given before this module limited the route)


def bf16_products() -> bool:
    """Whether bfloat16 inputs run their tile products in bf16 (else they are
    widened to float32 first): :func:`bf16_library` is not ``"widen"``."""
    return bf16_library() != "widen"


def half_path() -> str:
    """One line for reports (the bench header): how bfloat16 inputs run here."""
    library = bf16_library()
    features = "+".join(bf16_features()) or "no bf16 instructions"
    if library == "widen":
        why = routes.explain("bf16", measure=False)[1] if bf16_available() != ("widen",) else ""
        return f"bf16 widened to float32 ({features}{'; ' + why if why else ''})"
    name = "flashtile's vdpbf16ps gemm" if library == "vdpbf16ps" else "oneMKL"
    return f"bf16 tile products ({name}, {features})"


#: With MKL, tile products of fewer rows than this (decoding: a GQA group of
#: one query token, or one row in MHA decoding) run where the routes
#: ``blas.one`` (one row) and ``blas.few`` (2 to 7) say
#: (:mod:`flashtile.routes`), measured on a decoding step. OpenBLAS's
#: small-call overhead is lower: on an Intel Xeon 4 x 128 @ 128 x 256 and
#: back took 8.9 us there, 13.7 us in MKL (at 8 rows MKL was 1.9x faster),
#: while one row ran as fast in a sequential MKL, which needs no pin (the
#: fixed rules); on an AMD EPYC (Zen 4) OpenBLAS won at one row too.
SMALL_TILE_ROWS = 8
#: The routes of tile products of 1 and of 2 to SMALL_TILE_ROWS - 1 rows.
_SMALL_ROUTES = ("blas.one", "blas.few")
for _route in (*_SMALL_ROUTES, "blas.tiny"):
    routes.limit(_route, available)


#: oneMKL's mixed-precision gemm: bf16 operands, float32 ``alpha``, ``beta``
#: and ``C``, the Fortran ``sgemm`` arguments otherwise (so :func:`gemm` calls
#: it unchanged, with ``uint16`` views of the bf16 operands).
_BF16_GEMM = "gemm_bf16bf16f32"


class GemmEntry(NamedTuple):
    """A ``gemm`` the kernels call: what :func:`gemm_for` returns.

    Attributes:
        address: the Fortran function's address, the kernels' ``gemm_fn``
            argument (:func:`fortran_gemm` calls it).
        library: ``"mkl"``, ``"openblas"`` or ``"vdpbf16ps"`` (flashtile's
            bf16 gemm, :mod:`.bf16_gemm`).
        pinned: whether kernel calls must pin BLAS to one thread: all but
            a sequential MKL and flashtile's own bf16 gemm.
        threads: the :func:`.blas_threads.thread_table` the kernels pin
            (no rows when not ``pinned``): their ``blas_threads`` argument.
    """

    address: int
    library: str
    pinned: bool
    threads: np.ndarray


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: The thread table of an entry that needs no pin.
_NO_PIN = np.zeros((0, 5), dtype=np.int64)


@functools.cache
def _entry(library: str, dtype) -> GemmEntry:
    names = {np.dtype(np.float32): "sgemm", np.dtype(np.float64): "dgemm", _BFLOAT16: _BF16_GEMM}
    name = names[np.dtype(dtype)]
    if library == "vdpbf16ps":  # a Numba cfunc, no BLAS: nothing to pin
        return GemmEntry(bf16_gemm.address(), library, False, _NO_PIN)
    if name == _BF16_GEMM and library != "mkl":
        raise ValueError("bfloat16 tile products need a bf16 gemm: check bf16_products() first")
    if library == "mkl":
        address = ctypes.cast(getattr(_mkl(), name + "_"), ctypes.c_void_p).value
        if _mkl().sequential:
            return GemmEntry(address, library, False, _NO_PIN)
    else:
        address = _capsule_pointer(name)
    return GemmEntry(address, library, True, thread_table(address, library))


def small_library(rows: int) -> str | None:
    """The library of tile products of ``rows`` rows where the routes
    ``blas.one``/``blas.few`` decide it (oneMKL the backend, fewer than
    :data:`SMALL_TILE_ROWS` rows): the route's answer; else None (the
    backend's). Read when a decode call is planned, as its walk is."""
    return _mkl_route(_SMALL_ROUTES[rows > 1]) if 0 < rows < SMALL_TILE_ROWS else None


def tiny_library() -> str | None:
    """The library of a tiny call's tile products
    (:data:`flashtile.planning.TINY_TILE`) where the route ``blas.tiny``
    decides it (oneMKL the backend): the route's answer; else None (the
    backend's). Read when a forward or backward is planned."""
    return _mkl_route("blas.tiny")


def _mkl_route(name: str) -> str | None:
    """Route ``name``'s library where oneMKL is the backend (the small-product
    routes only move products off oneMKL); else None, the backend's."""
    return routes.choice(name) if (_choice or backend()) == "mkl" else None


def gemm_for(dtype, small: str | None = None) -> GemmEntry:
    """The ``gemm`` for float32 or float64 operands, from the current
    :func:`backend` (or with oneMKL the backend, from ``small``: a plan's
    :func:`small_library` or :func:`tiny_library`), or for bfloat16 operands
    (float32 results), from :func:`bf16_library`."""
    if dtype == _BFLOAT16:
        return _entry(bf16_library(), dtype)
    library = _choice or backend()  # (backend() takes a lock: asked on every call)
    if library == "mkl" and small is not None:
        library = small
    return _entry(library, dtype)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def gemm(fn, a, b, c, trans_a, trans_b, beta):
    """``c = op(a) @ op(b) + beta * c``: :func:`gemm_scaled` with ``alpha = 1``."""
    gemm_scaled(fn, a, b, c, trans_a, trans_b, 1.0, beta)


@njit(fastmath=FASTMATH, cache=True)
def gemm_scaled(fn, a, b, c, trans_a, trans_b, alpha, beta):
    """``c = alpha * op(a) @ op(b) + beta * c`` on row-major 2-D arrays.

    ``op(x)`` is ``x.T`` when its flag is set. Rows may be strided (views of
    larger arrays) but each row must be contiguous. ``fn`` is the ``address``
    of a :func:`gemm_for` entry for the operands' dtype (either backend: both
    take the same Fortran arguments); bf16 operands are ``uint16`` views and
    ``c`` is float32. Row-major ``C = A B`` is column-major ``C^T = B^T A^T``,
    hence the swapped operands below.
    """
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    fortran_gemm(
        fn, _TRANS if trans_b else _NOTRANS, _TRANS if trans_a else _NOTRANS, n, m, k, alpha,
        b, _leading(b), a, _leading(a), beta, c, _leading(c),
    )  # fmt: skip


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _leading(x):
    """The leading dimension of row-major ``x`` for BLAS: its row stride, or
    for a one-row matrix its width. NumPy calls an array C-contiguous
    whatever the stride of a size-1 axis, so one row (a single key, a
    ``swapaxes`` view) may carry a row stride shorter than the row, which
    BLAS refuses (``lda >= cols``) and then skips the product."""
    return x.strides[0] // x.itemsize if x.shape[0] > 1 else max(x.shape[1], 1)


@intrinsic
def fortran_gemm(
    typingctx, address, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
):  # fmt: skip
    """Call the Fortran ``gemm`` at ``address`` (an integer): ``C = alpha
    op(A) op(B) + beta C`` in column-major terms, the 13 arguments of its
    ABI (by reference). The flags, sizes and scalars go in stack slots of
    the caller (32-bit integers, ``alpha``/``beta`` in the dtype of ``c``)
    and the arrays pass their data pointers, so a call allocates nothing.
    An integer address is one machine word to pass into a kernel (a ctypes
    function object costs microseconds to unbox on every call)."""
    arrays = all(isinstance(t, types.Array) for t in (a, b, c))
    if not (arrays and isinstance(address, types.Integer)):
        return None
    int32, scalar = types.int32, c.dtype
    arguments = (address, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    sig = types.void(*(types.unliteral(t) for t in arguments))

    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()

        def slot(i, to):  # a stack slot holding argument i as ``to``
            value = context.cast(builder, args[i], signature.args[i], to)
            return builder.bitcast(cgutils.alloca_once_value(builder, value), pointer)

        def data(i):
            array = context.make_array(signature.args[i])(context, builder, args[i])
            return builder.bitcast(array.data, pointer)

        refs = [slot(1, types.uint8), slot(2, types.uint8)]
        refs += [slot(i, int32) for i in (3, 4, 5)]
        refs += [slot(6, scalar), data(7), slot(8, int32), data(9), slot(10, int32)]
        refs += [slot(11, scalar), data(12), slot(13, int32)]
        function = ir.FunctionType(ir.VoidType(), [pointer] * len(refs))
        target = builder.inttoptr(args[0], function.as_pointer())
        builder.call(target, refs)
        return context.get_dummy_value()

    return sig, codegen

"""BLAS ``gemm`` for the kernels, and keeping BLAS single-threaded while they run.

The kernels call SciPy's BLAS (the OpenBLAS SciPy ships) through the Fortran
``sgemm``/``dgemm`` entry points that ``scipy.linalg.cython_blas`` exports.
Calling ``gemm`` directly rather than Numba's ``np.dot`` buys two things:
``beta = 1`` (accumulate into the output: ``acc += P V`` without a
temporary and an extra pass) and leading dimensions (any row-strided view).
The function pointer is passed to the kernels as an argument, so it is looked
up at run time and the compiled kernels stay cacheable.

Inside a ``prange`` every kernel thread already owns a core, so
:func:`single_threaded_blas` pins every loaded BLAS to one thread for the
duration of a kernel call; otherwise OpenBLAS spawns its own threads inside
the OpenMP region and warns "Detect OpenMP Loop and this application may
hang".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import numpy as np
import scipy.linalg.cython_blas
from numba import njit
from threadpoolctl import ThreadpoolController

from . import FASTMATH

#: Fortran gemm: 13 arguments, all passed by pointer.
_GEMM_PROTO = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))
_TRANS, _NOTRANS = ord("T"), ord("N")


def _capsule_pointer(name: str) -> int:
    capsule = scipy.linalg.cython_blas.__pyx_capi__[name]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))


@functools.cache
def gemm_for(dtype) -> ctypes._CFuncPtr:
    """The ``gemm`` entry point (a ctypes function) for float32 or float64."""
    name = {np.dtype(np.float32): "sgemm", np.dtype(np.float64): "dgemm"}[np.dtype(dtype)]
    return _GEMM_PROTO(_capsule_pointer(name))


@njit(fastmath=FASTMATH, cache=True)
def gemm(fn, a, b, c, trans_a, trans_b, beta):
    """``c = op(a) @ op(b) + beta * c`` on row-major 2-D arrays.

    ``op(x)`` is ``x.T`` when its flag is set. Rows may be strided (views of
    larger arrays) but each row must be contiguous. ``fn`` comes from
    :func:`gemm_for` for the arrays' dtype. Row-major ``C = A B`` is
    column-major ``C^T = B^T A^T``, hence the swapped operands below.
    """
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    ints = np.empty(6, dtype=np.int32)
    ints[0], ints[1], ints[2] = n, m, k
    ints[3] = b.strides[0] // b.itemsize
    ints[4] = a.strides[0] // a.itemsize
    ints[5] = c.strides[0] // c.itemsize
    scalars = np.empty(2, dtype=c.dtype)
    scalars[0], scalars[1] = 1.0, beta
    flags = np.empty(2, dtype=np.uint8)
    flags[0] = _TRANS if trans_b else _NOTRANS
    flags[1] = _TRANS if trans_a else _NOTRANS
    fn(
        flags[0:].ctypes,
        flags[1:].ctypes,
        ints[0:].ctypes,
        ints[1:].ctypes,
        ints[2:].ctypes,
        scalars[0:].ctypes,
        b.ctypes,
        ints[3:].ctypes,
        a.ctypes,
        ints[4:].ctypes,
        scalars[1:].ctypes,
        c.ctypes,
        ints[5:].ctypes,
    )


@functools.cache
def _controller() -> ThreadpoolController:
    return ThreadpoolController()  # scans the loaded libraries once (~3 ms)


_pin_lock = threading.Lock()
_pin_depth = 0
_pin_saved = None


@contextlib.contextmanager
def single_threaded_blas():
    """Pin BLAS to one thread while any kernel call is running.

    Calls may overlap (several Python threads calling flashtile): the first
    to enter pins, the last to leave restores, so the user's own BLAS
    threading is never left changed.
    """
    global _pin_depth, _pin_saved
    with _pin_lock:
        if _pin_depth == 0:
            _pin_saved = _controller().limit(limits=1, user_api="blas")
        _pin_depth += 1
    try:
        yield
    finally:
        with _pin_lock:
            _pin_depth -= 1
            if _pin_depth == 0:
                _pin_saved.restore_original_limits()
                _pin_saved = None

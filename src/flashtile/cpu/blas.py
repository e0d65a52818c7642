"""Keep BLAS single-threaded while a parallel kernel runs.

Numba's ``np.dot`` calls SciPy's OpenBLAS. Inside a ``prange`` every kernel
thread already owns a core, so a multi-threaded BLAS would oversubscribe the
machine (OpenBLAS then warns "Detect OpenMP Loop and this application may
hang"). :func:`single_threaded_blas` pins every loaded BLAS to one thread for
the duration of a kernel call and restores it afterwards.
"""

from __future__ import annotations

import contextlib
import functools

import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS the kernels call)
from threadpoolctl import ThreadpoolController


@functools.cache
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


@contextlib.contextmanager
def single_threaded_blas():
    with _controller().limit(limits=1, user_api="blas"):
        yield

"""The kernels' BLAS backends (oneMKL, SciPy's OpenBLAS): choice, errors, results.

The rest of the suite runs on the default backend (MKL where the ``mkl``
package is installed); here every installed backend runs the forward and the
backward on awkward shapes against the dense float64 formula, and the two
backends are checked against each other.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import numba
import numpy as np
import pytest

import flashtile as ft
import flashtile.cpu.blas as blas
import flashtile.cpu.blas_threads as blas_threads
import flashtile.cpu.launch as launch
from dense import dense_attention, dense_attention_backward, rel_err
from flashtile import routes, tune

INSTALLED = ["openblas"] + (["mkl"] if blas._mkl() is not None else [])


@pytest.fixture
def restore_backend():
    saved = blas._choice, blas._explicit
    yield
    blas._choice, blas._explicit = saved
    routes.moved()  # plans kept under the test's backend are planned again


@pytest.fixture(params=INSTALLED)
def backend(request, restore_backend):
    assert blas.set_backend(request.param) == request.param
    assert blas.backend() == request.param
    return request.param


def _inputs(rng, shape, dtype):
    (b, h, tq, tk, d) = shape
    q = rng.standard_normal((b, h, tq, d)).astype(dtype)
    k = rng.standard_normal((b, h, tk, d)).astype(dtype)
    v = rng.standard_normal((b, h, tk, d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 2, 97, 97, 59), (2, 1, 33, 300, 64), (1, 3, 515, 515, 7)])
def test_each_backend_matches_the_dense_formula(rng, backend, shape, dtype):
    q, k, v = _inputs(rng, shape, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    out, lse = ft.attention(q, k, v, causal=True, return_lse=True, block_q=64, block_k=96)
    grads = ft.attention_backward(q, k, v, out, lse, do, causal=True, block_q=64, block_k=96)
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    ref, _ = dense_attention(*f64[:3], True)
    ref_grads = dense_attention_backward(*f64, True)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(out, ref) < tol
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 10 * tol


def test_each_backend_is_deterministic_and_they_agree(rng, restore_backend):
    q, k, v = _inputs(rng, (1, 4, 700, 700, 64), np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    results = {}
    for name in INSTALLED:
        blas.set_backend(name)
        runs = []
        for offset in (0, 3):  # misaligned copies: MKL's paths can depend on alignment
            qs, ks, vs, dos = (_misaligned(a, offset) for a in (q, k, v, do))
            out, lse = ft.attention(qs, ks, vs, causal=True, return_lse=True)
            runs.append((out, *ft.attention_backward(qs, ks, vs, out, lse, dos, causal=True)))
        for a, b in zip(*runs, strict=True):
            np.testing.assert_array_equal(a, b)
        results[name] = runs[0]
    for a, b in zip(results["openblas"], results[INSTALLED[-1]], strict=True):
        assert rel_err(b, a) < 1e-5


def _misaligned(a, offset):
    """A copy of ``a`` starting ``offset`` elements into a fresh buffer."""
    buf = np.empty(a.size + offset, dtype=a.dtype)[offset:].reshape(a.shape)
    buf[...] = a
    return buf


def test_unknown_backend_is_a_clear_error(restore_backend):
    with pytest.raises(ValueError, match=r"one of \('auto', 'mkl', 'openblas'\), got 'cublas'"):
        blas.set_backend("cublas")


def test_environment_variable_chooses_and_is_checked(monkeypatch, restore_backend):
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.setenv("FLASHTILE_BLAS", "OpenBLAS")
    assert blas.backend() == "openblas"
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.setenv("FLASHTILE_BLAS", "atlas")
    with pytest.raises(ValueError, match="FLASHTILE_BLAS='atlas'"):
        blas.backend()


def test_missing_mkl_is_a_clear_error_and_auto_falls_back(monkeypatch, restore_backend):
    monkeypatch.setattr(blas, "_mkl", lambda: None)
    with pytest.raises(ValueError, match=r"pip install 'flashtile\[mkl\]'"):
        blas.set_backend("mkl")
    assert blas.set_backend("auto") == "openblas"


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_mkl_is_the_default_when_installed(monkeypatch, restore_backend, tmp_path):
    # With nothing measured (an empty routes cache, no measuring), the fixed rule.
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.delenv("FLASHTILE_BLAS", raising=False)
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHTILE_TUNE", "0")
    monkeypatch.setattr(routes, "_chosen", {})
    assert blas.backend() == "mkl"
    # A measurement that found OpenBLAS faster is followed.
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.setattr(routes, "_chosen", {"blas": ("openblas", "planted")})
    assert blas.backend() == "openblas"


class _FakeLibrary:
    """A BLAS thread count behind a getter and a setter that are C functions
    (ctypes callbacks), as :func:`blas_threads.thread_table` rows hold them;
    records every count set. With ``local``, also a count of the calling
    thread's own, as oneMKL's: its getter answers that one when set (not 0),
    and its local setter returns the previous one."""

    def __init__(self, count, local=None):
        self.count, self.local, self.sets = count, local, []
        self._get = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: self.local or self.count)
        self._set = ctypes.CFUNCTYPE(None, ctypes.c_int64)(self._record)
        self._set_local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(self._record_local)

    def _record(self, n):
        self.sets.append(n)
        self.count = n

    def _record_local(self, n):
        previous, self.local = self.local, n
        return previous

    def row(self) -> list[int]:
        local = 0 if self.local is None else _address(self._set_local)
        return [_address(self._get), _address(self._set), local, 0, 0]


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def test_the_compiled_pin_counts_overlapping_calls_and_restores_once():
    """The first of overlapping pins saves the count and sets one thread, the
    last unpin restores it; an unpin of a table nobody pins changes nothing."""
    four, one = _FakeLibrary(4), _FakeLibrary(1)
    table = np.array([four.row(), one.row()], dtype=np.int64)
    blas_threads.pin_blas(table)
    assert (four.count, one.count) == (1, 1) and one.sets == []  # one thread already: untouched
    blas_threads.pin_blas(table)  # a second call while the first runs
    blas_threads.unpin_blas(table)
    assert four.sets == [1]  # the other call still holds its pin
    blas_threads.unpin_blas(table)
    assert (four.sets, one.sets) == ([1, 4], [])
    assert list(table[:, blas_threads.DEPTH]) == [0, 0]
    blas_threads.unpin_blas(table)
    assert four.sets == [1, 4]


@pytest.mark.parametrize("own", [1, 3])
def test_the_pin_reads_the_process_wide_count_under_a_threads_own(own):
    """oneMKL's getter answers the calling thread's own count (a
    threadpool_limits block sets it): the pin reads and restores the
    process-wide one (here 4), and leaves the thread's own as it was."""
    mkl = _FakeLibrary(4, local=own)
    table = np.array([mkl.row()], dtype=np.int64)
    blas_threads.pin_blas(table)
    assert (mkl.count, mkl.local) == (1, own)
    blas_threads.unpin_blas(table)
    assert (mkl.sets, mkl.count, mkl.local) == ([1, 4], 4, own)


@pytest.mark.parametrize("kernel", ["forward", "backward", "decode"])
def test_each_kernel_pins_its_blas_while_it_runs(kernel, monkeypatch, restore_backend, rng):
    """Every kernel call on OpenBLAS sets one thread before its products and
    the user's count (here 2) after, in compiled code."""
    blas.set_backend("openblas")
    entry = blas.gemm_for(np.float32)
    assert entry.pinned and entry.threads.shape[0] >= 1
    library = _FakeLibrary(2)
    fake = entry._replace(threads=np.array([library.row()], dtype=np.int64))
    monkeypatch.setattr(launch._kernels(), "gemm_for", lambda *args, **keywords: fake)
    q = rng.standard_normal((1, 2, 1 if kernel == "decode" else 40, 16), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, 300, 16), dtype=np.float32) for _ in range(2))
    if kernel == "decode":
        ft.decode_attention(q, k, v)
    elif kernel == "forward":
        ft.attention(q, k, v)
    else:
        out, lse = ft.attention(q, k, v, return_lse=True)
        library.sets.clear()
        ft.attention_backward(q, k, v, out, lse, np.ones_like(out))
    assert library.sets == [1, 2]


@numba.njit
def _failing_kernel(gemm_fn, blas_threads_table):
    """A compiled kernel whose body raises after its pin (as a failed allocation)."""
    blas_threads.pin_blas(blas_threads_table)
    raise IndexError("in the kernel")


def test_a_kernel_that_raises_after_its_pin_is_unpinned():
    library = _FakeLibrary(3)
    entry = blas.GemmEntry(0, "openblas", True, np.array([library.row()], dtype=np.int64))
    with pytest.raises(IndexError, match="in the kernel"):
        launch._call(1, 0, entry, _failing_kernel)
    assert library.sets == [1, 3] and entry.threads[0, blas_threads.DEPTH] == 0


def test_a_call_refused_by_the_dispatcher_leaves_the_others_pin():
    """Dispatch errors (no kernel ran, nothing pinned: arguments it cannot
    take, or a failure in its Python, such as a compilation) must not release
    the pin another call holds."""
    library = _FakeLibrary(3)
    entry = blas.GemmEntry(0, "openblas", True, np.array([library.row()], dtype=np.int64))
    blas_threads.pin_blas(entry.threads)  # a call running in another thread

    @numba.njit
    def uncompilable(gemm_fn, table):  # fails in Numba's Python, compiling
        return table + "text"

    with pytest.raises(TypeError):  # the kernel's argument count is wrong
        launch._call(1, 0, entry, _failing_kernel, np.zeros(1))
    with pytest.raises(numba.core.errors.TypingError):
        launch._call(1, 0, entry, uncompilable)
    assert library.count == 1 and entry.threads[0, blas_threads.DEPTH] == 1
    blas_threads.unpin_blas(entry.threads)
    assert library.count == 3


def test_overlapping_blocks_restore_the_users_count_once(restore_backend):
    """Python blocks (single_threaded) overlapping from several threads pin
    once; the last to leave restores the count the user had (here 2), never 1."""
    blas.set_backend("openblas")
    entry = blas.gemm_for(np.float32)
    (c, *_) = blas_threads.controllers(entry.address, entry.library)
    user = c.get_num_threads()
    c.set_num_threads(2)
    try:
        first, second = blas_threads.single_threaded(entry), blas_threads.single_threaded(entry)
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        inside = _callable_openblas_threads()
        assert inside and all(n == 1 for n in inside)
        ft.attention(*np.ones((3, 1, 2, 5, 8), dtype=np.float32))  # a kernel's own pin inside
        assert all(n == 1 for n in _callable_openblas_threads())
        second.__exit__(None, None, None)
        assert c.get_num_threads() == 2
    finally:
        c.set_num_threads(user)


def test_the_pin_takes_the_entrys_library_or_else_every_lp64_blas(restore_backend):
    """SciPy's OpenBLAS entry pins that OpenBLAS alone; an entry of no known
    library (a SciPy linked against another BLAS) pins every LP64 BLAS."""
    blas.set_backend("openblas")
    entry = blas.gemm_for(np.float32)
    chosen = blas_threads.controllers(entry.address, entry.library)
    assert chosen and all(c.internal_api == "openblas" for c in chosen)
    every = blas_threads.controllers(entry.address, "another-blas")
    assert {c.filepath for c in chosen} < {c.filepath for c in every} or len(every) == 1


def _callable_openblas_threads() -> list[int]:
    """Thread counts of the loaded OpenBLAS builds the kernels can call (LP64:
    NumPy's ILP64 copy is left alone, since no kernel calls it)."""
    from threadpoolctl import ThreadpoolController

    libs = [c for c in ThreadpoolController().lib_controllers if c.internal_api == "openblas"]
    return [c.num_threads for c in libs if blas_threads.lp64(c)]


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_mkl_runs_sequential_so_nothing_is_pinned(restore_backend):
    from threadpoolctl import threadpool_info

    blas.set_backend("mkl")
    assert blas._mkl().sequential
    entry = blas.gemm_for(np.float32)
    assert entry.library == "mkl" and not entry.pinned and entry.threads.shape[0] == 0
    before = [lib["num_threads"] for lib in threadpool_info()]
    with blas_threads.single_threaded(entry):
        inside = [lib["num_threads"] for lib in threadpool_info()]
    assert inside == before


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
@pytest.mark.parametrize("route, rows", [("blas.one", 1), ("blas.few", 4)])
def test_small_products_run_where_their_route_says(route, rows, restore_backend, monkeypatch, rng):
    """With MKL the BLAS, tiles of fewer than SMALL_TILE_ROWS rows take the
    library of route blas.one (one row) or blas.few (2-7 rows); an OpenBLAS
    entry is pinned. Each gives a decoding step's result."""
    monkeypatch.setattr(tune, "ROUNDS", 1)
    blas.set_backend("mkl")
    assert blas.small_library(blas.SMALL_TILE_ROWS) is None  # the backend's: oneMKL
    q = rng.standard_normal((1, 2 * rows, 1, 16), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, 700, 16), dtype=np.float32) for _ in range(2))
    want = ft.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    walk = routes.decode_route_name("contiguous", rows, 16, 700)
    kernels, ran = launch._kernels(), []

    def recorded(dtype, small=None):
        ran.append(blas.gemm_for(dtype, small).library)
        return blas.gemm_for(dtype, small)

    monkeypatch.setattr(kernels, "gemm_for", recorded)
    for library in ("openblas", "mkl"):
        with routes.force(route, library), routes.force(walk, "tiles"):
            entry = blas.gemm_for(np.float32, small=blas.small_library(rows))
            assert entry.library == library and entry.pinned == (library == "openblas")
            assert rel_err(ft.decode_attention(q, k, v), want) < 1e-5
            assert ran[-1] == library  # the planned call ran on it
    blas.set_backend("openblas")  # the measurement runs on oneMKL, then restores this
    times = tune.measure_small(routes.ROUTES[route], ("openblas", "mkl"))
    assert set(times) == {"openblas", "mkl"}
    assert blas.backend() == blas.pinned() == "openblas" and route not in routes._forced


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_the_tiny_route_is_measured_on_mkl_and_restores_the_backend(restore_backend):
    """``blas.tiny`` decides only with oneMKL the backend; its measurement runs
    each candidate on oneMKL and puts back an explicit OpenBLAS."""
    blas.set_backend("openblas")
    assert blas.tiny_library() is None
    times = tune.measure_tiny(routes.ROUTES["blas.tiny"], ("openblas", "mkl"))
    assert set(times) == {"openblas", "mkl"} and all(t > 0 for t in times.values())
    assert blas.backend() == blas.pinned() == "openblas" and "blas.tiny" not in routes._forced
    blas.set_backend("mkl")
    assert blas.tiny_library() == "mkl"  # (the suite's fixed rule)


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_the_small_products_fixed_rules(restore_backend):
    """Nothing measured (the suite's routes): one row stays on a sequential
    oneMKL, 2 to 7 rows go to OpenBLAS, 8 rows stay on oneMKL."""
    blas.set_backend("mkl")
    libraries = [blas.small_library(rows) for rows in (1, 2, 7, 8)]
    assert libraries == ["mkl", "openblas", "openblas", None]
    blas.set_backend("openblas")
    assert blas.small_library(1) is None


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_a_threaded_mkl_chosen_by_the_user_is_kept_and_pinned():
    """MKL_THREADING_LAYER set: flashtile leaves MKL threaded, pins it per call."""
    script = """
import numpy as np
from threadpoolctl import threadpool_info
import flashtile as ft
import flashtile.cpu.blas as blas
import flashtile.cpu.blas_threads as blas_threads
import flashtile.cpu.launch as launch
assert blas.backend() == "mkl" and not blas._mkl().sequential
entry = blas.gemm_for(np.float32)
mkl = lambda: [i["num_threads"] for i in threadpool_info() if i["internal_api"] == "mkl"]
before = mkl()
with blas_threads.single_threaded(entry):
    assert mkl() == [1], mkl()
assert mkl() == before, (mkl(), before)
q = np.random.default_rng(0).standard_normal((1, 2, 300, 16), dtype=np.float32)
np.save("out.npy", ft.attention(q, q, q, causal=True))
"""
    env = {**os.environ, "MKL_THREADING_LAYER": "INTEL", "FLASHTILE_BLAS": "mkl"}
    with tempfile.TemporaryDirectory() as cwd:
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        got = np.load(os.path.join(cwd, "out.npy"))
    q = np.random.default_rng(0).standard_normal((1, 2, 300, 16), dtype=np.float32)
    assert rel_err(got, ft.attention(q, q, q, causal=True)) < 1e-6


@pytest.mark.skipif("mkl" not in INSTALLED, reason="oneMKL not installed")
def test_an_ilp64_mkl_is_refused_with_its_reason(monkeypatch, restore_backend):
    monkeypatch.setenv("MKL_INTERFACE_LAYER", "ILP64")
    monkeypatch.setattr(blas, "_mkl_problem", blas._mkl_problem)  # restored afterwards
    assert blas._mkl.__wrapped__() is None  # the uncached loader, as on first use
    monkeypatch.setattr(blas, "_mkl", lambda: None)
    with pytest.raises(ValueError, match="MKL_INTERFACE_LAYER='ILP64' selects 64-bit"):
        blas.set_backend("mkl")

"""``flashtile precompile``: its tasks reach the kernels they are named for."""

from __future__ import annotations

import subprocess
import sys

import numba
import numpy as np
import pytest

import flashtile.cpu.launch as launch
from flashtile import routes
from flashtile._validate import BFLOAT16
from flashtile.cli import main
from flashtile.planning import bf16_products
from flashtile.precompile import DTYPES, TASKS, lock_cache_saves, precompile


def _recorded_calls(monkeypatch):
    """Replace the kernel launch with a recorder of ``(kernel name, argument
    types)`` that returns empty results of the right shapes: the tasks' routes
    without compiling anything."""
    calls = []

    def record(threads, size, entry, kernel, *args):
        name = kernel.py_func.__name__
        calls.append((name, [numba.typeof(a) for a in args]))
        if name == "forward_call":
            q4, v4, lse, items = args[0], args[2], args[3], args[5]
            lse[...] = 0
            out = np.zeros(q4.shape[:-1] + v4.shape[-1:], q4.dtype)
            return out, np.zeros(len(items), int), True
        if name == "decode_call":
            q, v = args[0], args[2]
            work = np.float64 if q.dtype == np.float64 else np.float32
            return (
                np.zeros(q.shape[:3] + v.shape[3:], work),
                np.zeros(q.shape[:3], work),
                False,
                True,
            )
        if name == "backward_call":  # its rows' P sum to 1
            q4, lse = args[0], args[4]
            return np.ones(q4.shape[:3] + (1,), lse.dtype), True
        return None

    monkeypatch.setattr(launch, "_call", record)
    return calls


def test_each_task_reaches_its_kernel(monkeypatch):
    calls = _recorded_calls(monkeypatch)
    products = bf16_products(BFLOAT16)
    half = "uint16" if products else "float32"  # bf16 operands, or widened
    kernels_of = {}
    for name, tag, function, arguments in TASKS:
        calls.clear()
        function(*arguments)
        kernel, types = calls[-1]
        if kernel == "decode_call":  # q, cache, format flag, walk flag
            route = (kernel, str(types[0].dtype), str(types[1].dtype), str(types[3]), str(types[4]))
        else:
            route = (kernel, str(types[0].dtype))
        kernels_of[name] = (tag, *route)  # tag: the --dtype that selects the task
    f32, f64, bits, f16, bf16 = "float32", "float64", "uint16", "float16", "bfloat16"
    tiles = "TileWalk"

    def decode(tag, q, cache, fmt, walk):  # the decode kernel's queries, cache, flags
        return (tag, "decode_call", q, cache, f"{fmt}()", f"{walk}()")

    assert kernels_of == {
        "forward float64": (f64, "forward_call", f64),
        "forward float32": (f32, "forward_call", f32),
        "forward bfloat16": (bf16, "forward_call", half),
        "forward float16": (f16, "forward_call", f32),
        "backward float64": (f64, "backward_call", f64),
        "backward float32": (f32, "backward_call", f32),
        "backward bfloat16": (bf16, "backward_call", half),
        "backward float16": (f16, "backward_call", f32),
        "decode float32, 16-key pages": decode(f32, f32, f32, "FloatValues", "RowWalk"),
        "decode float32, one-token pages": decode(f32, f32, f32, "FloatValues", "HeadTilesWalk"),
        "decode float32, one-token pages in place": decode(
            f32, f32, f32, "FloatValues", "HeadRowsWalk"
        ),
        "decode float16 cache, one-token pages in place": decode(
            f16, f32, bits, "Float16Bits", "HeadRowsWalk"
        ),
        "decode bfloat16, one-token pages in place": decode(
            bf16, f32, bits, "BFloat16Bits", "HeadRowsWalk"
        ),
        "decode float64, one-token pages": decode(f64, f64, f64, "FloatValues", "HeadTilesWalk"),
        "decode float16 cache, 16-key pages": decode(f16, f32, bits, "Float16Bits", "RowWalk"),
        # bf16 queries read row by row are widened (decode_planning.decode_operands)
        "decode bfloat16, 16-key pages": decode(bf16, f32, bits, "BFloat16Bits", "RowWalk"),
        "decode float64": decode(f64, f64, f64, "FloatValues", "TileWalk"),
        "decode float32": decode(f32, f32, f32, "FloatValues", "TileWalk"),
        "decode float16 cache": decode(f16, f32, bits, "Float16Bits", "TileWalk"),
        "decode float32 queries, bfloat16 cache": decode(bf16, f32, bits, "BFloat16Bits", tiles),
        "decode bfloat16": decode(bf16, half, bits, "BFloat16Bits", "TileWalk"),
    }
    assert {task[1] for task in TASKS} == set(DTYPES)


def test_the_float32_tasks_from_the_command_line(capsys, monkeypatch):
    tuned = []  # the routes are measured after compiling (not here: planted)
    monkeypatch.setattr(routes, "tune", lambda names=None: tuned.append(names))
    monkeypatch.setenv("FLASHTILE_TUNE", "0")  # the report: stored routes or the fixed rules
    monkeypatch.setattr(routes, "_chosen", {})  # (this process's answers left as they were)
    assert main(["precompile", "--dtype", "float32", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [name for name, dtype, *_ in TASKS if dtype == "float32"]
    assert [line.split(":")[0] for line in lines[: len(names)]] == names
    assert lines[len(names)].startswith(f"{len(names)} tasks in ")
    assert tuned == [None] and lines[len(names) + 1].startswith("routes measured in ")
    assert main(["precompile", "--dtype", "float64", "--jobs", "1"]) == 0  # no float32: no tuning
    assert main(["precompile", "--dtype", "float32", "--jobs", "1", "--no-tune"]) == 0
    assert tuned == [None]


def test_precompile_names_what_it_refuses():
    with pytest.raises(ValueError, match=r"unknown dtypes \['float8'\]"):
        precompile(("float32", "float8"))
    with pytest.raises(TypeError, match="not a dtype"):
        precompile([object()])
    with pytest.raises(TypeError, match="None is not a dtype"):
        precompile(None)
    with pytest.raises(ValueError, match="unknown dtypes"):
        precompile([])
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        precompile("float32", jobs=0)
    with pytest.raises(TypeError, match="jobs must be an integer, got '2'"):
        precompile("float32", jobs="2")


def test_locked_saves_save_and_load(monkeypatch, tmp_path):
    from numba.core import caching

    monkeypatch.setattr(caching.IndexDataCacheFile, "save", caching.IndexDataCacheFile.save)
    lock_cache_saves()
    locked = caching.IndexDataCacheFile.save
    lock_cache_saves()  # idempotent: not wrapped twice
    assert caching.IndexDataCacheFile.save is locked and locked.flashtile_locked
    index = caching.IndexDataCacheFile(str(tmp_path), "f-1.py311", "stamp")
    index.save(("sig", 1), b"compiled 1")
    assert (tmp_path / ".flashtile-cache.lock").exists()

    def no_locks(fd, op):  # a file system without locks: the save still happens
        raise OSError(37, "No locks available")

    monkeypatch.setattr("fcntl.flock", no_locks)
    index.save(("sig", 2), b"compiled 2")
    assert index.load(("sig", 1)) == b"compiled 1"
    assert index.load(("sig", 2)) == b"compiled 2"


def test_precompile_skips_tasks_whose_kernels_another_compiles(monkeypatch):
    import flashtile.precompile as pc

    ran = []
    monkeypatch.setattr(pc, "_run", lambda i, worker=False: ran.append(TASKS[i][0]) or 0.0)
    precompile(("float32", "float16"), report=lambda line: None)
    assert "forward float16" not in ran and "forward float32" in ran
    ran.clear()
    precompile("float16", report=lambda line: None)
    assert "forward float16" in ran and "backward float16" in ran


def test_cached_kernels_of_older_sources_are_cleared_wherever_numba_keeps_them(tmp_path):
    """A cache directory whose fingerprint is not the present sources' loses
    its compiled code (kernels built against older helpers); one that
    matches keeps it."""
    from flashtile.cpu import STAMP, clear_stale_kernels

    stale = [tmp_path / "forward.forward_call-1.py311.nbi", tmp_path / "forward.x.py311.1.nbc"]
    for path in stale:
        path.write_bytes(b"old")
    (tmp_path / STAMP).write_text("an older fingerprint")
    (tmp_path / "other.txt").write_text("kept")
    clear_stale_kernels(tmp_path)
    assert not any(path.exists() for path in stale) and (tmp_path / "other.txt").exists()
    fresh = tmp_path / "forward.forward_call-1.py311.nbi"
    fresh.write_bytes(b"new")
    clear_stale_kernels(tmp_path)  # the fingerprint now matches: kept
    assert fresh.exists()
    clear_stale_kernels(tmp_path / "missing" / "dir")  # created, nothing to clear
    assert (tmp_path / "missing" / "dir" / STAMP).is_file()


def test_numbas_pedantic_scope_warning_is_silenced_for_the_kernels_only():
    """A first compile of the softcap kernels raises Numba's internal
    NumbaIRAssumptionWarning, which Numba attributes to the kernel module's
    file path: silenced there, and nowhere else."""
    import warnings

    from numba.core.errors import NumbaIRAssumptionWarning

    from flashtile.cpu import quiet_scope_warnings

    kernel_file = launch.__file__.replace("launch.py", "forward.py")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_scope_warnings()  # (what importing flashtile.cpu does)
        warnings.warn_explicit("phi not in scope", NumbaIRAssumptionWarning, kernel_file, 252)
        warnings.warn_explicit("phi not in scope", NumbaIRAssumptionWarning, "/elsewhere/x.py", 1)
        warnings.warn_explicit("other", UserWarning, kernel_file, 252)
    assert [(w.filename, w.category) for w in seen] == [
        ("/elsewhere/x.py", NumbaIRAssumptionWarning),
        (kernel_file, UserWarning),
    ]
    # Importing the package installs it (pytest's collection undid that here).
    check = (
        "import warnings, flashtile.cpu as c;"
        "assert any(f[0] == 'ignore' and f[2] is c.NumbaIRAssumptionWarning"
        " and f[3].match('/a/flashtile/cpu/forward') for f in warnings.filters)"
    )
    subprocess.run([sys.executable, "-c", check], check=True)

"""The measured routes' cache file (:mod:`flashtile.routes`): where it lives,
the key of this machine and software, reads that never fail a call and
atomic writes.

``routes.json`` in ``FLASHTILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashtile``,
else ``~/.cache/flashtile``: ``{machine key: {route: entry}}``, an entry
``{"choice", "times", "under"?}`` (:func:`flashtile.routes.depends`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path

import numba

from .cpu import kernel_fingerprint

#: The file that keeps the measured choices, in :func:`cache_dir`.
CACHE_FILE = "routes.json"
#: Bump when a route's candidates or measurement change meaning: older
#: entries are then ignored.
FORMAT = 1
#: Libraries whose code runs the candidates (their versions key the cache).
LIBRARIES = ("flashtile", "numba", "llvmlite", "numpy", "scipy", "mkl")
#: /proc/cpuinfo flags that change which code the compilers and BLAS emit.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cache_dir() -> Path:
    """Where ``routes.json`` lives (see the module docstring)."""
    if os.environ.get("FLASHTILE_CACHE_DIR"):
        return Path(os.environ["FLASHTILE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashtile"


def cpu_model() -> tuple[str, list[str]]:
    """``(model name, features of CPU_FEATURES present)`` from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags":
            present = set(value.split())
            return model, [f for f in CPU_FEATURES if f in present]
    return model, flags


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


@functools.cache
def machine_key() -> str:
    """The cache key of this machine and software: measurements made under
    another key are not used. It names the kernels' sources too
    (:func:`flashtile.cpu.kernel_fingerprint`): a kernel changed within a
    version (a development tree, an install from git) ranks its candidates
    anew, where the old entries kept the old ranking (the decode walks moved
    in 8 of 36 classes when the row passes changed). Computed once per
    process (the version lookups take about 5 ms, and every route's first
    answer reads the cache)."""
    model, flags = cpu_model()
    versions = ",".join(f"{lib}={_version(lib)}" for lib in LIBRARIES)
    threads = numba.config.NUMBA_NUM_THREADS  # the kernels' pool
    kernels = kernel_fingerprint()[:16]
    return f"v{FORMAT}|{model}|{'+'.join(flags)}|threads={threads}|{versions}|kernels={kernels}"


def _read_all() -> dict:
    try:
        data = json.loads((cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError, RecursionError):  # (RecursionError: nested thousands deep)
        return {}
    return data if isinstance(data, dict) else {}


def read_cache() -> dict:
    """This machine's entries (empty when the file is missing, unreadable or
    corrupt, or holds none for this machine)."""
    entry = _read_all().get(machine_key())
    return entry if isinstance(entry, dict) else {}


def write_entry(name: str, entry: dict) -> None:
    """Store route ``name``'s entry for this machine, atomically (a rename), and
    quietly give up when the directory cannot be written (read-only homes)."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        data = _read_all()
        key = machine_key()
        mine = data.get(key) if isinstance(data.get(key), dict) else {}
        data[key] = {**mine, name: entry}
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".routes-", suffix=".json")
    except OSError:
        return
    try:
        # mkstemp makes the file private (0600): a cache measured at an image's
        # build, as another user, would be unreadable to the service.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, directory / CACHE_FILE)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)

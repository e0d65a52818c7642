"""Compiled CPU kernels (Numba). Import-time cheap: kernels compile on first
use and are cached on disk next to their modules (``cache=True``).

Numba decides whether a cached kernel is stale from the kernel's own source
file only, so an edit to a helper module (``rowops.py``, ``tiles.py``,
``masks.py``) would silently keep running the old code. Importing this
package therefore fingerprints every source file the kernels are built from
and clears the cached kernels when the fingerprint changes: in the
``__pycache__`` next to the modules here, and in the directory Numba
actually caches them in when that is another one (``NUMBA_CACHE_DIR``, or
its user-wide directory for a read-only install), which the launcher
checks before the first kernel call (:func:`clear_stale_kernels`). A stale
kernel there can be worse than slow: one compiled against an older
:mod:`.blas_threads` table layout would call a wrong address.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

from numba.core.cpu_options import ParallelOptions
from numba.core.errors import NumbaIRAssumptionWarning


def quiet_scope_warnings() -> None:
    """Ignore Numba's NumbaIRAssumptionWarning raised at this package's
    kernels (called on import). Compiling a kernel whose inlined helpers hold
    conditional expressions (the softcap's tanh, the exp2's clamps) makes
    Numba's internal pedantic check report phi variables "not in scope"
    after inlining: a dozen screens of "please report" text on a first
    compile, and in ``flashtile precompile``. The check does not touch the
    code generated, and the results are tested against the reference. Only
    this category, raised at this package's files (Numba names the module by
    its file's path, hence the pattern). A first import inside
    ``warnings.catch_warnings()`` (pytest's collection) loses the filter
    with the block; calling this again restores it."""
    warnings.filterwarnings(
        "ignore", category=NumbaIRAssumptionWarning, module=r".*flashtile[/\\.]cpu[/\\.]"
    )


quiet_scope_warnings()

#: LLVM fast-math flags for every kernel: reassociation (vectorised sums and
#: maxima), FMA contraction, and approximate reciprocals/functions. Not
#: ``nnan``/``ninf``: the kernels use ``-inf`` as the "saw no key yet" state
#: and must compare against it, which ``fastmath=True`` would fold away.
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}


def prange_only() -> ParallelOptions:
    """Numba's ``parallel`` option of a kernel's entry call: its ``prange`` loop
    runs on the thread pool, and nothing else becomes a parallel loop (a
    final sum of arrays stays serial; an array expression such as
    ``np.isfinite(a)`` compiles as a subroutine that Numba warns has nothing
    parallel: write it as a loop). An options object, not a dict: Numba
    parses a dict again at each compile and pops its keys, so a kernel's
    second signature would get every parallel option.

    The parallel kernel is inlined into its entry call (``inline="always"``)
    rather than called: Numba optimises every callee's code again in each
    caller's module, so each level less saves a pass over the whole kernel
    (docs/design.md, "Compilation")."""
    serial = (
        "comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil", "fusion",
    )  # fmt: skip
    return ParallelOptions(dict.fromkeys(serial, False) | {"prange": True})


#: The fingerprint's file in a cache directory.
STAMP = "flashtile-kernels.sha256"


@functools.cache
def kernel_fingerprint() -> str:
    """SHA-256 (hex) of the kernels' sources: the key of the compiled kernels
    on disk (:func:`clear_stale_kernels`) and of the routes measured with
    them (:func:`flashtile.route_cache.machine_key`)."""
    here = Path(__file__).resolve().parent
    # (and the modules outside this package whose compiled code they call)
    sources = sorted(here.glob("*.py"))
    sources += [here.parent / name for name in ("masks.py", "dropout.py", "units.py")]
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


def clear_stale_kernels(cache: str | os.PathLike) -> None:
    """Delete Numba's cached code (``*.nbi``, ``*.nbc``) in ``cache`` unless
    its fingerprint file matches the present sources, then record them.
    A directory that cannot be written is left as it is (Numba then caches
    elsewhere, or not at all)."""
    cache, digest = Path(cache), kernel_fingerprint()
    stamp = cache / STAMP
    try:
        if stamp.is_file() and stamp.read_text() == digest:
            return
        for path in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            path.unlink()
        cache.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # a read-only install: Numba falls back to its user-wide directory
        pass


clear_stale_kernels(Path(__file__).resolve().parent / "__pycache__")

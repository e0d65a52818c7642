"""Compiled CPU kernels (Numba). Import-time cheap: kernels compile on first
use and are cached on disk next to their modules (``cache=True``).

Numba decides whether a cached kernel is stale from the kernel's own source
file only, so an edit to a helper module (``rowops.py``, ``tiles.py``,
``masks.py``) would silently keep running the old code. Importing this
package therefore fingerprints every source file the kernels are built from
and clears the cached kernels when the fingerprint changes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: LLVM fast-math flags for every kernel: reassociation (vectorised sums and
#: maxima), FMA contraction, and approximate reciprocals/functions. Not
#: ``nnan``/``ninf``: the kernels use ``-inf`` as the "saw no key yet" state
#: and must compare against it, which ``fastmath=True`` would fold away.
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}


def _clear_stale_kernel_cache() -> None:
    here = Path(__file__).resolve().parent
    sources = sorted(here.glob("*.py")) + [here.parent / "masks.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "flashtile-kernels.sha256"
    try:
        if stamp.is_file() and stamp.read_text() == digest:
            return
        for path in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            path.unlink()
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # a read-only install: Numba falls back to its own cache dir
        pass


_clear_stale_kernel_cache()

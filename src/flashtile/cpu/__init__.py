"""Compiled CPU kernels (Numba). Import-time cheap: kernels compile on first
use and are cached on disk next to their modules (``cache=True``)."""

#: LLVM fast-math flags for every kernel: reassociation (vectorised sums and
#: maxima), FMA contraction, and approximate reciprocals/functions. Not
#: ``nnan``/``ninf``: the kernels use ``-inf`` as the "saw no key yet" state
#: and must compare against it, which ``fastmath=True`` would fold away.
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}

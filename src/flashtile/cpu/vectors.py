"""Full-width vector loops on AVX-512 CPUs: LLVM's per-function width hint.

LLVM tunes its code for Intel's AVX-512 server cores (Skylake-SP through
Sapphire and Emerald Rapids) with a preference for 256-bit vectors: the
kernels' loops (the exponential, row maxima, the bf16 rounding of ``P``,
loads and stores of tiles) were vectorised eight floats wide, half of what
the registers hold, because early AVX-512 cores clocked down on 512-bit
instructions. :func:`wide_vectors` lifts that for the compiled function that
calls it, as clang's ``-mprefer-vector-width=512`` does: it sets the
function's ``"prefer-vector-width"="512"`` attribute, so its loops use
512-bit vectors where the target has them (elsewhere the attribute changes
nothing: LLVM never uses wider vectors than the target has).

Measured on the 2-core Emerald Rapids VM, one thread, the loops compiled
both ways in one process: the bf16 path's row max and exponential over an
L2-resident 256 x 512 tile 0.73x the time per element, the float32
exponential 0.75x. Whole kernels moved less, inside this shared machine's
noise (``scripts/compare_trees.py``, one thread: bf16 forward 0.79-0.95x,
float32 unchanged: most of their time is oneMKL's products); see
docs/design.md, "Vector width".

Each kernel function with hot loops calls it first (inside a ``prange``
body for the parallel kernels: Numba compiles that body as a function of
its own); helpers that Numba inlines take the caller's attribute.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic

#: The LLVM function attribute clang's ``-mprefer-vector-width=512`` sets.
PREFER_512 = '"prefer-vector-width"="512"'


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the calling compiled function's loops 512 bits wide
    (see the module docstring). A no-op at run time."""

    def codegen(context, builder, signature, args):
        # llvmlite's attribute set accepts only a fixed list of names; LLVM
        # reads a "key"="value" attribute written verbatim in the definition.
        set.add(builder.function.attributes, PREFER_512)
        return context.get_dummy_value()

    return types.none(), codegen

"""The kernels' unit for scores: exponents of two, and the two constants of it.

Every kernel (CPU and GPU) multiplies its scores by ``log2(e)`` once, so
that its softmax exponentiates with ``exp2`` (a short polynomial on the CPU,
one instruction on a GPU), and turns ``lse`` back into a natural log with
``ln(2)``. The float mask limit (:data:`flashtile.variants.MASK_LIMIT`) and
the float32 range checks (:mod:`flashtile.precision`) are set in the same
unit. Defined here once, for every backend.
"""

#: ``log2(e)``: a score times this is an exponent of 2 (``exp(x) = 2**(x log2(e))``).
LOG2E = 1.4426950408889634
#: ``ln(2)``: an lse in log2 units times this is the natural-log lse.
LN2 = 0.6931471805599453

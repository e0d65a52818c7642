"""CPU tensors and NumPy arrays as views of each other, bfloat16 included.

NumPy has no bfloat16; ``ml_dtypes.bfloat16`` is the NumPy dtype flashtile's
kernels read. Both directions share memory (no copy), through a 16-bit
integer view of the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validate import BFLOAT16, tensors_as_numpy


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as NumPy (detached; bfloat16 as ``ml_dtypes.bfloat16``,
    by the NumPy API's own rule, :func:`flashtile._validate.tensors_as_numpy`)."""
    return tensors_as_numpy(t.detach() if t.requires_grad else t)[0]


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (``ml_dtypes.bfloat16`` as ``torch.bfloat16``)."""
    # (The kind first: NumPy's == between a built-in dtype and a user one such
    # as ml_dtypes' walks its casting tables, about 10 us on a decoding
    # step's cold path.)
    if a.dtype.kind == "V" and a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)

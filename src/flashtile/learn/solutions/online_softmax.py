"""Reference solution: online_softmax (flashtile learn)."""

import numpy as np


def online_softmax(x, block_size):
    """Softmax of the 1-D array ``x``, visiting ``block_size`` entries at a time."""
    m = -np.inf
    ell = 0.0
    for start in range(0, len(x), block_size):
        block = x[start : start + block_size]
        m_new = max(m, float(block.max()))
        # The old sum is relative to the old max: move it to the new one first.
        ell = ell * np.exp(m - m_new) + float(np.exp(block - m_new).sum())
        m = m_new
    return np.exp(x - m) / ell

"""Planted bug: the old sum is never moved to the new maximum."""

import numpy as np


def online_softmax(x, block_size):
    m = -np.inf
    ell = 0.0
    for start in range(0, len(x), block_size):
        block = x[start : start + block_size]
        m = max(m, float(block.max()))
        ell = ell + float(np.exp(block - m).sum())  # missing: ell * exp(m_old - m)
    return np.exp(x - m) / ell

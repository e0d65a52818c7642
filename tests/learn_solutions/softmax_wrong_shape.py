"""Planted bug: returns a column instead of a 1-D array."""

import numpy as np


def online_softmax(x, block_size):
    m = -np.inf
    ell = 0.0
    for start in range(0, len(x), block_size):
        block = x[start : start + block_size]
        m_new = max(m, float(block.max()))
        ell = ell * np.exp(m - m_new) + float(np.exp(block - m_new).sum())
        m = m_new
    return (np.exp(x - m) / ell)[:, None]

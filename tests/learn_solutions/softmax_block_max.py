"""Planted mistake: each block is shifted by its *own* max, not the running max."""

import numpy as np


def online_softmax(x, block_size):
    x = np.asarray(x, dtype=float)
    m, ell = -np.inf, 0.0
    for start in range(0, len(x), block_size):
        block = x[start : start + block_size]
        m = block.max()  # forgets every earlier block
        ell = ell + np.exp(block - m).sum()
    return np.exp(x - m) / ell

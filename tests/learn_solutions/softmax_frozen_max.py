"""Planted mistake: the first block's max is kept for good (never raised)."""

import numpy as np


def online_softmax(x, block_size):
    x = np.asarray(x, dtype=float)
    m = x[:block_size].max()
    ell = 0.0
    for start in range(0, len(x), block_size):
        ell = ell + np.exp(x[start : start + block_size] - m).sum()
    return np.exp(x - m) / ell

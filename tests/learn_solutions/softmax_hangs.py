"""Planted bug: the loop index never advances."""

import numpy as np


def online_softmax(x, block_size):
    start = 0
    while start < len(x):
        block = x[start : start + block_size]  # noqa: F841 (forgot start += block_size)
    return np.exp(x)

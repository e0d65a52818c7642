"""Planted mistake: a two-pass softmax through Python's built-in max and sum."""

import numpy as np


def online_softmax(x, block_size):
    m = max(x)
    e = np.exp(x - m)
    return e / sum(e)

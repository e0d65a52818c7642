"""Planted shortcut: a correct two-pass softmax that does not stream."""

import numpy as np


def online_softmax(x, block_size):
    e = np.exp(x - x.max())
    return e / e.sum()

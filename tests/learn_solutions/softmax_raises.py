"""Planted bug: a typo that raises at call time."""

import numpy as np


def helper(block):
    return np.exp(block).summ()


def online_softmax(x, block_size):
    return helper(x[:block_size])

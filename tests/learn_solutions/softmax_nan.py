"""Planted bug: the sum starts at zero and is divided into, giving 0/0."""

import numpy as np


def online_softmax(x, block_size):
    return np.zeros(len(x)) / np.zeros(len(x))

"""Planted shortcut: correct attention that forms the full score matrix."""

import numpy as np


def online_attention(Q, K, V, block_size):
    scores = Q @ K.T / np.sqrt(Q.shape[1])
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ V

"""Reference solution: online_attention (flashtile learn)."""

import numpy as np


def online_attention(Q, K, V, block_size):
    """``softmax(Q K^T / sqrt(d)) V`` computed over blocks of ``block_size`` keys."""
    n_q, d = Q.shape
    m = np.full(n_q, -np.inf)
    ell = np.zeros(n_q)
    acc = np.zeros((n_q, V.shape[1]))
    for start in range(0, K.shape[0], block_size):
        k_block = K[start : start + block_size]
        v_block = V[start : start + block_size]
        scores = Q @ k_block.T / np.sqrt(d)
        m_new = np.maximum(m, scores.max(axis=1))
        alpha = np.exp(m - m_new)  # shrinks what was summed against the old max
        p = np.exp(scores - m_new[:, None])
        ell = ell * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ v_block
        m = m_new
    return acc / ell[:, None]

"""Reference solution: causal_tiled, exercise 26.4 (flashtile learn)."""

import numpy as np


def causal_tiled_attention(q, k, v, block_size):
    """Causal ``softmax(q k^T / sqrt(d)) v`` over blocks of ``block_size`` keys."""
    T, d = q.shape
    m = np.full(T, -np.inf)
    ell = np.zeros(T)
    acc = np.zeros((T, v.shape[1]))
    q_pos = np.arange(T)[:, None]
    for start in range(0, T, block_size):
        stop = min(start + block_size, T)
        k_pos = np.arange(start, stop)[None, :]
        scores = q @ k[start:stop].T / np.sqrt(d)
        scores = np.where(k_pos <= q_pos, scores, -np.inf)
        m_new = np.maximum(m, scores.max(axis=1))
        # m_new is the running max, finite from the first block on (every
        # query sees key 0), so a block wholly in a row's future adds
        # exp(-inf - m_new) = 0. The guard keeps the loop safe where a row
        # may have seen no key yet (m_new = -inf), e.g. when reused for Tq > Tk.
        base = np.where(np.isfinite(m_new), m_new, 0.0)
        alpha = np.exp(m - base)
        p = np.exp(scores - base[:, None])
        ell = ell * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ v[start:stop]
        m = m_new
    return acc / ell[:, None]

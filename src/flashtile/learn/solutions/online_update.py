"""Reference solution: online_update, exercise 26.2 (flashtile learn)."""

import numpy as np


def online_update(m, ell, acc, scores, values):
    """Fold one block of ``scores`` (n, B) and ``values`` (B, d_v) into the state."""
    m_new = np.maximum(m, scores.max(axis=1))
    # exp(s - m_new) = exp(s - m) * exp(m - m_new): one factor for every old term,
    # in the normaliser and in the numerator alike.
    alpha = np.exp(m - m_new)
    p = np.exp(scores - m_new[:, None])
    ell_new = ell * alpha + p.sum(axis=1)
    acc_new = acc * alpha[:, None] + p @ values
    return m_new, ell_new, acc_new

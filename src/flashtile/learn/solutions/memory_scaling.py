"""Reference solution: memory_scaling, exercise 26.3 (flashtile learn)."""


def memory_elements(T):
    """``{"naive_scores": ..., "online_state": ...}`` element counts for ``T`` tokens."""
    # One score per (query, key) pair against one running entry per query.
    return {"naive_scores": T * T, "online_state": T}


def score_matrix_bytes(T, heads, bytes_per_element):
    """Bytes of the ``T x T`` score matrices of ``heads`` heads."""
    return T * T * heads * bytes_per_element

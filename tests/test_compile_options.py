"""The entry calls' parallel option (flashtile.cpu.prange_only): only the
``prange`` runs on the pool, for every signature a kernel compiles."""

import numpy as np
from numba import njit, prange

from flashtile.cpu import prange_only


def test_every_signature_gets_only_its_prange_as_a_parallel_loop():
    # Numba pops the keys of a dict option at each compile: the second
    # signature would get every option, and np.zeros and .sum() loops of
    # their own. An options object keeps the first compile's meaning.
    @njit(parallel=prange_only())
    def entry(a):
        for i in prange(a.size):
            a[i] += 1
        return np.zeros(3).sum()

    for dtype in (np.float32, np.float64, np.int64):
        a = np.zeros(10, dtype)
        assert entry(a) == 0 and (a == 1).all()
    for sig in entry.signatures:
        assert len(entry.overloads[sig].metadata["parfor_diagnostics"].initial_parfors) == 1, sig

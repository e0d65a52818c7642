"""Before/after guard for a change to the kernels: two flashtile source trees
timed side by side in ONE process.

usage: python scripts/compare_trees.py OLD_SRC NEW_SRC [rounds] [--decode] [--only TEXT]
(e.g. ``git worktree add /tmp/base <rev>`` and ``/tmp/base/src`` as OLD_SRC).
With ``NUMBA_NUM_THREADS=1`` the default mode times CPU seconds on one thread.

``--decode`` times only decoding (GQA 32/8, d 128: Tk=8192, Tk=65536 and
Tk=65536 in shuffled pages of 16 keys; MHA with one query, 12 heads, d 64,
Tk=32768), first on one thread in CPU seconds
(``time.process_time``: on a shared machine, time slicing by other jobs then
does not count), then on two threads in wall seconds.

Each tree's ``flashtile`` package is copied to a temporary folder under its own
name (the package uses relative imports only), the two are checked to agree on
every case, then the core preset's cases (and one decode case) are timed in
shuffled interleaved rounds. Prints medians, new/old ratios, and the spread of
the old tree's rounds (min..max over the median): a ratio inside that spread is
noise.

Caveat: Numba's dispatcher caches argument types by name, so two trees' records
of the same name (``KernelVariants``) can send the second tree's calls through
the slow dispatch path (about 0.5 ms a call). Negligible for the cases here
(tens to hundreds of ms); for sub-millisecond calls compare the compiled entry
points directly.
"""

import importlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import ml_dtypes
import numpy as np


def load_trees(old_src: str, new_src: str) -> dict:
    """Both trees' packages, imported as ``flashtile_old`` and ``flashtile_new``."""
    tmp = tempfile.mkdtemp(prefix="compare_trees_")
    skip = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
    for tag, src in (("old", old_src), ("new", new_src)):
        shutil.copytree(
            os.path.join(src, "flashtile"), os.path.join(tmp, f"flashtile_{tag}"), ignore=skip
        )
    sys.path.insert(0, tmp)
    return {tag: importlib.import_module(f"flashtile_{tag}") for tag in ("old", "new")}


#: (label, T, d, causal, mode): the core preset's cases, bfloat16 ones and one
#: decode case (a label with "bf16" runs on ml_dtypes.bfloat16 inputs).
CASES = [
    ("fwd T=4096 full", 4096, 64, False, "fwd"),
    ("fwd bf16 T=4096 full", 4096, 64, False, "fwd"),
    ("fwd bf16 T=4096 causal", 4096, 64, True, "fwd"),
    ("fwd+bwd bf16 T=2048 causal", 2048, 64, True, "bwd"),
    ("fwd T=4096 causal", 4096, 64, True, "fwd"),
    ("fwd T=1024 causal", 1024, 64, True, "fwd"),
    ("fwd T=1024 full", 1024, 64, False, "fwd"),
    ("fwd+bwd T=2048 causal", 2048, 64, True, "bwd"),
    ("fwd+bwd T=2048 full", 2048, 64, False, "bwd"),
    ("fwd T=2048 d=128 causal", 2048, 128, True, "fwd"),
    ("decode Tk=65536 GQA32/8 d128", 65536, 128, True, "dec"),
]


def make_inputs() -> dict:
    rng = np.random.default_rng(0)
    data = {}
    for label, t, d, _, mode in CASES:
        if mode == "dec":  # one query per sequence, 32 query heads on 8 kv heads
            q = rng.standard_normal((1, 32, 1, d), dtype=np.float32)
            k = rng.standard_normal((1, 8, t, d), dtype=np.float32)
            data[label] = (q, k, k.copy())
        else:
            dtype = ml_dtypes.bfloat16 if "bf16" in label else np.float32
            data[label] = tuple(
                rng.standard_normal((1, 8, t, d), dtype=np.float32).astype(dtype) for _ in range(3)
            )
    return data


def run(ft, q, k, v, causal, mode) -> tuple:
    if mode == "dec":
        return (ft.decode_attention(q, k, v),)
    if mode == "fwd":
        return (ft.attention(q, k, v, causal=causal),)
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True)
    return ft.attention_backward(q, k, v, out, lse, out, causal=causal)


def main(old_src: str, new_src: str, rounds: int) -> None:
    import numba

    mods, data = load_trees(old_src, new_src), make_inputs()
    for label, _, _, causal, mode in CASES:  # warm-up (compiles) and agreement
        old, new = (run(mods[tag], *data[label], causal, mode) for tag in ("old", "new"))
        tol = 2e-2 if "bf16" in label else 1e-4  # one bf16 rounding apart at most
        for x, y in zip(old, new, strict=True):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            assert np.allclose(x, y, rtol=tol, atol=tol / 10), label
    times = {(case[0], tag): [] for case in CASES for tag in ("old", "new")}
    # One thread (NUMBA_NUM_THREADS=1): CPU seconds, so that time slicing by
    # other jobs on a shared machine does not count; else wall seconds.
    clock = time.process_time if numba.get_num_threads() == 1 else time.perf_counter
    for r in range(rounds):
        order = [(case, tag) for case in CASES for tag in ("old", "new")]
        random.Random(r).shuffle(order)
        for (label, _, _, causal, mode), tag in order:
            t0 = clock()
            run(mods[tag], *data[label], causal, mode)
            times[(label, tag)].append(clock() - t0)
    print(f"{'case':32s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s}  spread of old")
    for label, *_ in CASES:
        old, new = times[(label, "old")], times[(label, "new")]
        o, n = statistics.median(old), statistics.median(new)
        spread = f"{min(old) / o:.2f}..{max(old) / o:.2f}"
        print(f"{label:32s} {o * 1e3:9.2f} {n * 1e3:9.2f} {n / o:8.3f}  {spread}")


def decode_inputs() -> dict:
    """label -> (q, k, v, block_table): the decoding cases of ``--decode``."""
    rng = np.random.default_rng(0)
    data = {}
    for t in (8192, 65536):
        q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
        k = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
        v = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
        data[f"decode Tk={t}"] = (q, k, v, None)
    n, page = 65536 // 16, 16
    order = rng.permutation(n)
    pk, pv = (np.empty((n, 8, page, 128), dtype=np.float32) for _ in range(2))
    pk[order] = k[0].reshape(8, n, page, 128).transpose(1, 0, 2, 3)
    pv[order] = v[0].reshape(8, n, page, 128).transpose(1, 0, 2, 3)
    data["decode Tk=65536 paged 16"] = (q, pk, pv, order[None, :])
    # MHA: one row per work item. Not a GPT-2 step (2048 keys): under a
    # millisecond the caveat above (the second tree's slow dispatch) showed
    # as a 1.8-2.2x "regression" that two processes timed in turn did not.
    for t in (32768,):
        q = rng.standard_normal((1, 12, 1, 64), dtype=np.float32)
        k = rng.standard_normal((1, 12, t, 64), dtype=np.float32)
        v = rng.standard_normal((1, 12, t, 64), dtype=np.float32)
        data[f"decode MHA 12 d64 Tk={t}"] = (q, k, v, None)
    return data


def main_decode(old_src: str, new_src: str, rounds: int) -> None:
    import numba

    mods, data = load_trees(old_src, new_src), decode_inputs()
    for label, (q, k, v, table) in data.items():  # warm-up (compiles) and agreement
        old, new = (mods[t].decode_attention(q, k, v, block_table=table) for t in ("old", "new"))
        assert np.allclose(old, new, rtol=1e-4, atol=1e-5), label
    for threads, clock in ((1, time.process_time), (2, time.perf_counter)):
        numba.set_num_threads(threads)
        times = {(label, tag): [] for label in data for tag in ("old", "new")}
        for r in range(rounds):
            order = list(times)
            random.Random(r).shuffle(order)
            for label, tag in order:
                q, k, v, table = data[label]
                reps = max(1, (64 << 20) // (k.nbytes + v.nbytes))  # short calls: repeated
                t0 = clock()
                for _ in range(reps):
                    mods[tag].decode_attention(q, k, v, block_table=table)
                times[(label, tag)].append((clock() - t0) / reps)
        what = "CPU s" if threads == 1 else "wall s"
        print(f"{threads} thread(s), {what}, load {os.getloadavg()[0]:.1f}")
        for label in data:
            o, n = (statistics.median(times[(label, tag)]) for tag in ("old", "new"))
            ms = f"old {o * 1e3:8.2f} ms  new {n * 1e3:8.2f} ms"
            print(f"  {label:28s} {ms}  new/old {n / o:.3f}")


if __name__ == "__main__":
    if "--only" in sys.argv:  # --only TEXT: the cases whose label contains TEXT
        at = sys.argv.index("--only")
        CASES[:] = [c for c in CASES if sys.argv[at + 1] in c[0]]
        del sys.argv[at : at + 2]
    args = [a for a in sys.argv[1:] if a != "--decode"]
    rounds = int(args[2]) if len(args) > 2 else 11
    (main_decode if "--decode" in sys.argv else main)(args[0], args[1], rounds)

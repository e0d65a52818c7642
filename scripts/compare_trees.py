"""Before/after guard for a change to the kernels: two flashtile source trees
timed side by side, each in a process of its own, in interleaved rounds.

usage: python scripts/compare_trees.py OLD_SRC NEW_SRC [rounds] [--decode] [--only TEXT]
(e.g. ``git worktree add /tmp/base <rev>`` and ``/tmp/base/src`` as OLD_SRC).
With ``NUMBA_NUM_THREADS=1`` the default mode times CPU seconds on one thread.

``--decode`` times only decoding (GQA 32/8, d 128: Tk=8192, Tk=65536 in
float32 and bf16, and Tk=65536 in shuffled pages of 16 keys; MHA with one query, 12 heads, d 64:
Tk=2048 and 32768 in float32 and bf16, Tk=32768 in shuffled pages of 16
keys), first on one thread in CPU seconds
(``time.process_time``: on a shared machine, time slicing by other jobs then
does not count), then on two threads in wall seconds.

Each tree runs in a worker process that imports ``flashtile`` from that tree
and builds the same seeded inputs; the parent checks that the two agree on
every case, then asks them in turn (shuffled rounds, one process working at
a time) to time each case, and prints medians, new/old ratios and the spread
of the old tree's rounds (min..max over the median): a ratio inside that
spread is noise. Separate processes, because two trees imported into one
process share Numba's dispatcher state: records of one name
(``KernelVariants``) sent the second tree's calls through a slow dispatch
path, and the tree imported second read 5-40% slower on calls of a few
milliseconds whichever tree it was (2026-12-01).
"""

import multiprocessing
import os
import random
import statistics
import sys
import time
import traceback

import ml_dtypes
import numpy as np

#: ``--only TEXT``: time only the cases whose label contains TEXT.
ONLY = ""


class Tree:
    """A worker process running one source tree's ``flashtile``."""

    def __init__(self, src: str, decode: bool):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # A daemon: a failed agreement check in the parent does not wait on it.
        self.process = ctx.Process(
            target=_serve, args=(os.path.abspath(src), child, decode), daemon=True
        )
        self.process.start()

    def ask(self, *message):
        self.conn.send(message)
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self):
        self.conn.send(("stop",))
        self.process.join()


def _serve(src: str, conn, decode: bool) -> None:
    """The worker: imports ``flashtile`` from ``src`` and answers the parent."""
    sys.path.insert(0, src)
    # OpenMP threads spin for a while after a parallel region (KMP_BLOCKTIME,
    # 200 ms by default): the tree timed next then shared the 2 cores with
    # them, and two-thread ratios of one unchanged path moved by 35%. Passive
    # waiting, set before Numba starts its pool, keeps each timing its own.
    os.environ["OMP_WAIT_POLICY"] = "passive"
    import numba

    import flashtile as ft

    assert ft.__file__.startswith(os.path.join(src, "")), (ft.__file__, src)
    data = decode_inputs() if decode else make_inputs()
    call = run_decode if decode else run_case
    while (message := conn.recv())[0] != "stop":
        try:
            kind, *args = message
            if kind == "threads":
                numba.set_num_threads(args[0])
                conn.send(None)
            elif kind == "result":
                conn.send(call(ft, data, args[0]))
            else:  # ("time", label, reps, cpu): seconds per call
                label, reps, cpu = args
                clock = time.process_time if cpu else time.perf_counter
                t0 = clock()
                for _ in range(reps):
                    call(ft, data, label)
                conn.send((clock() - t0) / reps)
        except Exception:  # sent back with its traceback: the parent raises it
            conn.send(RuntimeError(f"in the worker of {src}:\n{traceback.format_exc()}"))


#: (label, T, d, causal, mode): the core preset's cases, bfloat16 ones, one
#: decode case and two small calls (a label with "bf16" runs on
#: ml_dtypes.bfloat16 inputs; below SMALL_T, 4 heads).
CASES = [
    ("fwd T=4096 full", 4096, 64, False, "fwd"),
    ("fwd bf16 T=4096 full", 4096, 64, False, "fwd"),
    ("fwd bf16 T=4096 causal", 4096, 64, True, "fwd"),
    ("fwd+bwd bf16 T=2048 causal", 2048, 64, True, "bwd"),
    ("fwd T=4096 causal", 4096, 64, True, "fwd"),
    ("fwd T=1024 causal", 1024, 64, True, "fwd"),
    ("fwd T=1024 full", 1024, 64, False, "fwd"),
    ("fwd+bwd T=2048 causal", 2048, 64, True, "bwd"),
    ("fwd+bwd T=4096 causal", 4096, 64, True, "bwd"),
    ("fwd T=4096 causal softcap 30", 4096, 64, True, "fwd"),
    ("fwd+bwd T=4096 causal softcap 30", 4096, 64, True, "bwd"),
    ("fwd+bwd T=2048 full", 2048, 64, False, "bwd"),
    ("fwd T=2048 d=128 causal", 2048, 128, True, "fwd"),
    ("decode Tk=65536 GQA32/8 d128", 65536, 128, True, "dec"),
    ("tiny H=4 T=16 d=32 causal", 16, 32, True, "fwd"),
    ("small H=4 T=64 d=32 causal", 64, 32, True, "fwd"),
]
#: Cases shorter than this run on 4 heads, timed over SMALL_REPS calls (their
#: cost is the per-call one: a single call is below the clock's resolution).
SMALL_T = 256
SMALL_REPS = 500


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
            heads = 4 if t < SMALL_T else 8
            data[label] = tuple(
                rng.standard_normal((1, heads, t, d), dtype=np.float32).astype(dtype)
                for _ in range(3)
            )
    return data


def run_case(ft, data: dict, label: str) -> tuple:
    """One case of :data:`CASES` on the tree's ``flashtile``: its results."""
    _, _, _, causal, mode = next(c for c in CASES if c[0] == label)
    q, k, v = data[label]
    if mode == "dec":
        return (ft.decode_attention(q, k, v),)
    kw = {"causal": causal, "softcap": 30.0} if "softcap" in label else {"causal": causal}
    if mode == "fwd":
        return (ft.attention(q, k, v, **kw),)
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    return ft.attention_backward(q, k, v, out, lse, out, **kw)


def compare(trees: dict, labels: list, rounds: int, cpu: bool, reps=None) -> dict:
    """``{(label, tag): seconds per call, one per round}``: shuffled rounds in
    which each tree times each case (``reps[label]`` calls, default 1)."""
    times = {(label, tag): [] for label in labels for tag in trees}
    for r in range(rounds):
        order = list(times)
        random.Random(r).shuffle(order)
        for label, tag in order:
            count = 1 if reps is None else reps[label]
            times[(label, tag)].append(trees[tag].ask("time", label, count, cpu))
    return times


def check_agreement(trees: dict, labels: list, tolerance) -> None:
    """Both trees' results for each case (their warm-up too: compiles)."""
    for label in labels:
        old, new = (trees[tag].ask("result", label) for tag in ("old", "new"))
        rtol, atol = tolerance(label)
        for x, y in zip(old, new, strict=True):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            assert np.allclose(x, y, rtol=rtol, atol=atol), label


def start(old_src: str, new_src: str, decode: bool) -> dict:
    return {"old": Tree(old_src, decode), "new": Tree(new_src, decode)}


def main(old_src: str, new_src: str, rounds: int) -> None:
    import numba

    trees = start(old_src, new_src, decode=False)
    labels = [case[0] for case in CASES if ONLY in case[0]]
    # bf16: one bf16 rounding apart at most.
    check_agreement(trees, labels, lambda x: (2e-2, 2e-3) if "bf16" in x else (1e-4, 1e-5))
    # One thread (NUMBA_NUM_THREADS=1): CPU seconds, so that time slicing by
    # other jobs on a shared machine does not count; else wall seconds.
    reps = {c[0]: SMALL_REPS if c[1] < SMALL_T else 1 for c in CASES}
    times = compare(trees, labels, rounds, cpu=numba.get_num_threads() == 1, reps=reps)
    for tree in trees.values():
        tree.close()
    print(f"{'case':32s} {'old us':>10s} {'new us':>10s} {'new/old':>8s}  spread of old")
    for label in labels:
        old, new = times[(label, "old")], times[(label, "new")]
        o, n = statistics.median(old), statistics.median(new)
        spread = f"{min(old) / o:.2f}..{max(old) / o:.2f}"
        print(f"{label:32s} {o * 1e6:10.1f} {n * 1e6:10.1f} {n / o:8.3f}  {spread}")


def decode_inputs() -> dict:
    """label -> (q, k, v, block_table): the decoding cases of ``--decode``."""
    rng = np.random.default_rng(0)
    data = {}
    for t in (8192, 65536):
        q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
        k = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
        v = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
        data[f"decode Tk={t}"] = (q, k, v, None)
        bf16 = ml_dtypes.bfloat16
        data[f"decode GQA bf16 Tk={t}"] = (q.astype(bf16), k.astype(bf16), v.astype(bf16), None)
    n, page = 65536 // 16, 16
    order = rng.permutation(n)
    pk, pv = (np.empty((n, 8, page, 128), dtype=np.float32) for _ in range(2))
    pk[order] = k[0].reshape(8, n, page, 128).transpose(1, 0, 2, 3)
    pv[order] = v[0].reshape(8, n, page, 128).transpose(1, 0, 2, 3)
    data["decode Tk=65536 paged 16"] = (q, pk, pv, order[None, :])
    # MHA: one row per work item, float32 and bf16; in shuffled 16-key pages
    # such items read their rows in place (cpu/cache_rows.py, seventh session).
    bf16 = ml_dtypes.bfloat16
    for t in (2048, 32768):
        q = rng.standard_normal((1, 12, 1, 64), dtype=np.float32)
        k = rng.standard_normal((1, 12, t, 64), dtype=np.float32)
        v = rng.standard_normal((1, 12, t, 64), dtype=np.float32)
        data[f"decode MHA 12 d64 Tk={t}"] = (q, k, v, None)
        data[f"decode MHA bf16 Tk={t}"] = (q.astype(bf16), k.astype(bf16), v.astype(bf16), None)
    q, k, v, _ = data["decode MHA 12 d64 Tk=32768"]
    n = 32768 // 16
    order = rng.permutation(n)
    pk, pv = (np.empty((n, 12, 16, 64), dtype=np.float32) for _ in range(2))
    pk[order] = k[0].reshape(12, n, 16, 64).transpose(1, 0, 2, 3)
    pv[order] = v[0].reshape(12, n, 16, 64).transpose(1, 0, 2, 3)
    data["decode MHA Tk=32768 paged 16"] = (q, pk, pv, order[None, :])
    data["decode MHA bf16 Tk=32768 paged 16"] = (
        q.astype(bf16),
        pk.astype(bf16),
        pv.astype(bf16),
        order[None, :],
    )
    return data


def run_decode(ft, data: dict, label: str) -> np.ndarray:
    q, k, v, table = data[label]
    return ft.decode_attention(q, k, v, block_table=table)


#: The decoding cases (labels of :func:`decode_inputs`) and their K/V bytes.
DECODE_CASES = {
    "decode Tk=8192": 2 * 8 * 8192 * 128 * 4,
    "decode Tk=65536": 2 * 8 * 65536 * 128 * 4,
    "decode Tk=65536 paged 16": 2 * 8 * 65536 * 128 * 4,
    "decode GQA bf16 Tk=8192": 2 * 8 * 8192 * 128 * 2,
    "decode GQA bf16 Tk=65536": 2 * 8 * 65536 * 128 * 2,
    "decode MHA 12 d64 Tk=2048": 2 * 12 * 2048 * 64 * 4,
    "decode MHA 12 d64 Tk=32768": 2 * 12 * 32768 * 64 * 4,
    "decode MHA bf16 Tk=2048": 2 * 12 * 2048 * 64 * 2,
    "decode MHA bf16 Tk=32768": 2 * 12 * 32768 * 64 * 2,
    "decode MHA Tk=32768 paged 16": 2 * 12 * 32768 * 64 * 4,
    "decode MHA bf16 Tk=32768 paged 16": 2 * 12 * 32768 * 64 * 2,
}


def main_decode(old_src: str, new_src: str, rounds: int) -> None:
    trees = start(old_src, new_src, decode=True)
    labels = [label for label in DECODE_CASES if ONLY in label]
    check_agreement(trees, labels, lambda x: (2e-2, 2e-3) if "bf16" in x else (1e-4, 1e-5))
    reps = {label: max(1, (64 << 20) // size) for label, size in DECODE_CASES.items()}
    for threads, cpu in ((1, True), (2, False)):
        for tree in trees.values():
            tree.ask("threads", threads)
        times = compare(trees, labels, rounds, cpu, reps)
        what = "CPU s" if cpu else "wall s"
        print(f"{threads} thread(s), {what}, load {os.getloadavg()[0]:.1f}")
        for label in labels:
            o, n = (statistics.median(times[(label, tag)]) for tag in ("old", "new"))
            ms = f"old {o * 1e3:8.2f} ms  new {n * 1e3:8.2f} ms"
            print(f"  {label:28s} {ms}  new/old {n / o:.3f}")
    for tree in trees.values():
        tree.close()


if __name__ == "__main__":
    if "--only" in sys.argv:  # --only TEXT: the cases whose label contains TEXT
        at = sys.argv.index("--only")
        ONLY = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    args = [a for a in sys.argv[1:] if a != "--decode"]
    rounds = int(args[2]) if len(args) > 2 else 11
    (main_decode if "--decode" in sys.argv else main)(args[0], args[1], rounds)

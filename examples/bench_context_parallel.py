"""Scaling and accuracy of flashtile.distributed on one machine (no torchrun needed).

Scaling (the default): the same causal attention, forward + backward, timed as

- 1 process x P threads: ``flashtile.torch.attention`` on the whole sequence;
- P processes x 1 thread: ``ring_attention`` (zigzag, then contiguous) and
  ``ulysses_attention``, each rank on its ``T / P`` tokens;

efficiency = t(1 process) / t(P processes), 1.0 being perfect. Every rank
checks its result against one-process flashtile on a small problem first.
The bytes each rank sends are counted at the ring's and the all-to-all's
send calls (not computed from a formula). Output is a Markdown table.

Accuracy (``--errors``): relative error against float64 of the ring's output
and gradients, for float32 and bfloat16 inputs, as the world size grows;
and, in one process, what merging partial results in bfloat16 instead of
float32 would cost.

Run::

    python examples/bench_context_parallel.py                   # T=16384, H=8, d=64, 2 processes
    python examples/bench_context_parallel.py --seq 1024 --repeats 1   # a quick check
    python examples/bench_context_parallel.py --errors          # worlds 1, 2, 4, 8 at T=1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import flashtile
import flashtile.distributed as fd
import flashtile.distributed.engine as engine
import flashtile.distributed.ulysses as ulysses

#: Bytes and messages this rank sends, by phase of the timed calls.
SENT = {"phase": None, "forward": [0, 0], "backward": [0, 0]}


def _count_sends():
    """Wrap the ring's shift and Ulysses' all-to-all to count what this rank sends."""
    shift, a2a = engine.shift, ulysses.all_to_all

    def count(nbytes):
        if SENT["phase"]:
            SENT[SENT["phase"]][0] += nbytes
            SENT[SENT["phase"]][1] += 1

    def counted_shift(ring, send, recv, tag=0):
        count(send.numel() * send.element_size())
        return shift(ring, send, recv, tag)

    def counted_a2a(x, group):
        count(x.numel() * x.element_size() * (x.shape[0] - 1) // x.shape[0])  # own slot stays
        return a2a(x, group)

    engine.shift, ulysses.all_to_all = counted_shift, counted_a2a


def _problem(args, seq, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (1, args.heads, seq, args.dim)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(4)]  # q, k, v, dout


def _attend(kind, layout):
    if kind == "one":
        import flashtile.torch as ftt

        return lambda q, k, v: ftt.attention(q, k, v, causal=True)
    fn = fd.ring_attention if kind == "ring" else fd.ulysses_attention
    return lambda q, k, v: fn(q, k, v, causal=True, layout=layout)


def _local(tensors, rank, world, layout):
    return [fd.shard_sequence(t, rank, world, layout=layout).requires_grad_() for t in tensors[:3]]


def _verify(args, attend, rank, world, layout):
    q, k, v, _ = _problem(args, 64 * world, seed=1)
    ours = attend(*_local((q, k, v), rank, world, layout)).detach().numpy()
    ref = flashtile.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
    err = np.linalg.norm(ours - fd.shard_sequence(ref, rank, world, layout=layout))
    if err > 1e-5 * np.linalg.norm(ref) / world**0.5:
        raise AssertionError(f"rank {rank}: result differs from one process (error {err:.2e})")


def _time_one(attend, q, k, v, dout):
    dist.barrier()
    start = time.perf_counter()
    SENT["phase"] = "forward"
    out = attend(q, k, v)
    dist.barrier()
    mid = time.perf_counter()
    SENT["phase"] = "backward"
    out.backward(dout)
    SENT["phase"] = None
    dist.barrier()
    end = time.perf_counter()
    for x in (q, k, v):
        x.grad = None
    return mid - start, end - start


def _scaling_worker(rank, world, port, args, config, out_path):
    kind, layout, threads = config
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    fd.set_num_threads(threads)
    import numba

    numba.set_num_threads(threads)  # the one-process baseline runs outside flashtile.distributed
    torch.set_num_threads(threads)  # torch's own ops too (torchrun sets OMP_NUM_THREADS=1)
    attend = _attend(kind, layout)
    _verify(args, attend, rank, world, layout)
    q, k, v, dout = _problem(args, args.seq)
    q, k, v = _local((q, k, v), rank, world, layout)
    dout = fd.shard_sequence(dout, rank, world, layout=layout)
    _time_one(attend, q, k, v, dout)  # warm-up
    _count_sends()
    times = [_time_one(attend, q, k, v, dout) for _ in range(args.repeats)]
    if rank == 0:
        with open(out_path, "w") as fh:
            sent = {ph: [n / args.repeats for n in SENT[ph]] for ph in ("forward", "backward")}
            json.dump({"times": times, "sent": sent}, fh)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(worker, world, threads, *extra) -> dict:
    """Run ``worker`` in ``world`` fresh processes whose Numba pools have ``threads`` threads
    (a larger pool's idle OpenMP threads would spin on the other ranks' cores)."""
    os.environ["NUMBA_NUM_THREADS"] = str(threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            args = (world, _free_port(), *extra, path)
            torch.multiprocessing.spawn(worker, args=args, nprocs=world)
            with open(path) as fh:
                return json.load(fh)
    finally:
        del os.environ["NUMBA_NUM_THREADS"]


def scaling(args) -> None:
    p = args.procs
    configs = {
        f"1 process x {p} threads": ("one", "contiguous", p, 1),
        f"{p} processes x 1 thread, ring zigzag": ("ring", "zigzag", 1, p),
        f"{p} processes x 1 thread, ring contiguous": ("ring", "contiguous", 1, p),
        f"{p} processes x 1 thread, Ulysses": ("ulysses", "zigzag", 1, p),
    }
    if args.heads % p:
        del configs[f"{p} processes x 1 thread, Ulysses"]
    configs["1 process x 1 thread"] = ("one", "contiguous", 1, 1)  # the serial work
    results = {name: [] for name in configs}
    for _ in range(args.rounds):  # rounds interleave the configurations against drift
        for name, (kind, layout, threads, world) in configs.items():
            res = _launch(_scaling_worker, world, threads, args, (kind, layout, threads))
            results[name].append(res)
    print(
        f"\ncausal attention forward + backward, float32, B=1, H={args.heads}, "
        f"T={args.seq}, d={args.dim}; {args.rounds} round(s) x {args.repeats} repeat(s), "
        f"median of each, best round; CPU: {_cpu_name()}\n"
    )
    print(
        "| configuration | forward s | fwd + bwd s | efficiency | speed-up over 1 thread "
        "| sent per rank: forward | backward |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    best = {
        name: [min(statistics.median(t[i] for t in r["times"]) for r in runs) for i in (0, 1)]
        for name, runs in results.items()
    }
    base, serial = best[f"1 process x {p} threads"][1], best["1 process x 1 thread"][1]
    for name, (fwd, total) in best.items():
        sent = " | ".join(_sent(*results[name][0]["sent"][ph]) for ph in ("forward", "backward"))
        print(
            f"| {name} | {fwd:.3f} | {total:.3f} | {base / total:.2f} | {serial / total:.2f} "
            f"| {sent} |"
        )
    print(
        f"\nefficiency = t({p} threads in 1 process) / t; the speed-up over 1 thread "
        f"({p} being ideal) shows how far the one-process baseline itself is from ideal"
    )


def _sent(nbytes: float, messages: float) -> str:
    """``8.0 MiB = 4 x 2.00 MiB``: a ring step's message is one line of the table."""
    if not messages:
        return "-"
    return f"{nbytes / 2**20:.1f} MiB = {messages:.0f} x {nbytes / messages / 2**20:.2f} MiB"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def _errors_worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    torch.set_num_threads(1)
    whole = _problem(args, args.error_seq, seed=2)
    shard = lambda t: fd.shard_sequence(t, rank, world, dim=-2)  # noqa: E731
    errors = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        q, k, v, dout = (t.to(dtype) for t in whole)  # the reference sees the same values
        exact = [x.double().numpy() for x in (q, k, v, dout)]
        out, lse = flashtile.attention(*exact[:3], causal=True, return_lse=True)
        refs = [out, *flashtile.attention_backward(*exact[:3], out, lse, exact[3], causal=True)]
        xs = [shard(x).requires_grad_() for x in (q, k, v)]
        got = fd.ring_attention(*xs, causal=True)
        got.backward(shard(dout))
        for label, g, ref in zip(
            ("out", "dq", "dk", "dv"), [got] + [x.grad for x in xs], refs, strict=True
        ):
            ref = shard(torch.from_numpy(ref))
            g = g.detach().double()
            sums = torch.stack([((g - ref) ** 2).sum(), (ref**2).sum()])
            dist.all_reduce(sums)  # the error of the whole sequence
            errors[f"{name} {label}"] = float((sums[0] / sums[1]).sqrt())
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(errors, fh)
    dist.destroy_process_group()


def _merged_in(parts: int, whole, dtype) -> float:
    """One process: keys in ``parts`` pieces, partial results rounded to ``dtype`` and
    merged with their running sum held in ``dtype`` (non-causal); error against float64."""
    q, k, v = (t.to(torch.bfloat16).float().numpy() for t in whole[:3])
    ref = flashtile.attention(*(x.astype(np.float64) for x in (q, k, v)))
    rnd = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dtype).float().numpy()  # noqa: E731
    out = lse = None
    for keys in np.array_split(np.arange(k.shape[2]), parts):
        o, o_lse = flashtile.attention(q, k[:, :, keys], v[:, :, keys], return_lse=True)
        o = rnd(o)
        out, lse = (o, o_lse) if out is None else flashtile.merge_states(out, lse, o, o_lse)
        out = rnd(out)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def errors(args) -> None:
    cores = len(os.sched_getaffinity(0))
    rows = {w: _launch(_errors_worker, w, max(1, cores // w), args) for w in args.worlds}
    whole = _problem(args, args.error_seq, seed=2)
    print(
        f"\nrelative error against float64 of ring_attention (zigzag, causal), B=1, "
        f"H={args.heads}, T={args.error_seq}, d={args.dim}; inputs rounded to the dtype, "
        f"the reference on the same values\n"
    )
    print(
        "| ranks | fp32 out | fp32 dq | fp32 dk | fp32 dv | bf16 out | bf16 dq | bf16 dk "
        "| bf16 dv | bf16 partials merged in bf16 (one process) |"
    )
    print("| ---: " * 10 + "|")
    for world, err in rows.items():
        cells = " | ".join(
            f"{err[f'{n} {x}']:.2e}"
            for n in ("float32", "bfloat16")
            for x in ("out", "dq", "dk", "dv")
        )
        print(f"| {world} | {cells} | {_merged_in(world, whole, torch.bfloat16):.2e} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=16384, help="sequence length T (scaling)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--procs", type=int, default=2, help="processes (and the baseline's threads)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of every configuration")
    p.add_argument("--errors", action="store_true", help="measure error growth instead")
    p.add_argument("--error-seq", type=int, default=1024, help="T for --errors")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8], help="for --errors")
    args = p.parse_args(argv)
    if args.errors:
        errors(args)
    else:
        scaling(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

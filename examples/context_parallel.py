"""Train the tiny GPT with its sequence split across processes (context parallelism).

Every process holds the whole model (the same weights: the same seed) and the
same batch, but only its shard of each sequence: ``T / P`` tokens in the
zigzag layout, at their true positions (``sequence_positions``). Attention
runs across the processes with ``flashtile.distributed.ring_attention`` (or
``--attention ulysses``); everything else in the model works token by token,
so it needs no communication. The loss is the mean over the whole sequence
(the mean of the processes' means) and the parameter gradients are averaged
with one all-reduce per step, so every process takes the same optimizer step
that one process would take on the whole sequence.

Rank 0 also trains a one-process twin (flashtile attention on the whole
sequence, same weights, same batches) and prints both loss curves side by
side. Run::

    torchrun --nproc-per-node 2 examples/context_parallel.py                  # 512 tokens, 30 steps
    torchrun --nproc-per-node 2 examples/context_parallel.py --attention ulysses
    torchrun --nproc-per-node 4 examples/context_parallel.py --dtype float64  # equal to ~1e-15

It exits with status 1 if the curves differ by more than train_tiny_gpt.py's
tolerance for the dtype. The model, corpus and schedule are those of
examples/train_tiny_gpt.py (imported, not copied).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

# Each process's Numba pool gets its share of the cores, before Numba starts: a pool of
# every core would leave idle OpenMP threads spinning where the other ranks compute.
_share = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
os.environ.setdefault("NUMBA_NUM_THREADS", str(max(1, _share)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashtile.distributed as fd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny_gpt as tg  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--context", type=int, default=512, help="whole sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(tg.DTYPES), default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=fd.LAYOUTS, default="zigzag")
    p.add_argument("--attention", choices=("ring", "ulysses"), default="ring")
    p.add_argument("--no-reference", action="store_true", help="skip the one-process twin")
    p.add_argument("--print-every", type=int, default=None)
    return p.parse_args(argv)


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Replace each gradient by the mean over processes (one all-reduce of all of them)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    at = 0
    for g in grads:
        g.copy_(flat[at : at + g.numel()].view_as(g))
        at += g.numel()


def sharded_step(model, opt, x, y, positions, lr: float, world: int) -> float:
    """tg.train_step for a shard of the sequence; returns the whole sequence's mean loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = model(x, y, positions)  # the mean over this process's tokens
    loss.backward()
    average_gradients(model, world)  # equal shard sizes: the mean of means is the mean
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def train(args: argparse.Namespace, rank: int, world: int) -> bool:
    """Train the sharded model (and the twin on rank 0); print the curves; True if they match."""
    model, data, cfg = tg.build(args)
    attend = fd.ring_attention if args.attention == "ring" else fd.ulysses_attention
    tg.ATTENTION["context-parallel"] = lambda q, k, v: attend(
        q, k, v, causal=True, layout=args.layout
    )
    twin = copy.deepcopy(model) if rank == 0 and not args.no_reference else None
    model.set_kind("context-parallel")
    opt = tg.make_optimizer(model, args.lr)
    twin_opt = tg.make_optimizer(twin, args.lr) if twin is not None else None
    positions = fd.sequence_positions(args.context, rank, world, layout=args.layout)
    shard = lambda t: fd.shard_sequence(t, rank, world, layout=args.layout, dim=1)  # noqa: E731
    if rank == 0:
        print(
            f"tiny GPT, context {args.context} split over {world} processes "
            f"({args.attention}, {args.layout}), {args.dtype}, {args.steps} steps; "
            f"vocab {cfg.vocab}\n"
        )
        print(f"{'step':>6}  {'split across ranks':>20}  {'one process':>16}  {'|diff|':>9}")
    every = args.print_every or max(1, args.steps // 10)
    max_diff, seconds = 0.0, 0.0
    for step, (x, y) in enumerate(tg.batches(data, args, args.steps)):
        lr = tg.lr_at(step, args)
        start = time.perf_counter()
        loss = sharded_step(model, opt, shard(x), shard(y), positions, lr, world)
        seconds += (time.perf_counter() - start) if step > 0 else 0.0
        if twin is None:
            if rank == 0 and (step % every == 0 or step == args.steps - 1):
                print(f"{step:>6}  {loss:>20.12f}")
            continue
        ref = tg.train_step(twin, twin_opt, x, y, lr)
        max_diff = max(max_diff, abs(loss - ref))
        if step % every == 0 or step == args.steps - 1:
            print(f"{step:>6}  {loss:>20.12f}  {ref:>16.12f}  {abs(loss - ref):>9.2e}")
    ok = max_diff <= tg.TOLERANCE[tg.DTYPES[args.dtype]]
    if twin is not None:
        tol = tg.TOLERANCE[tg.DTYPES[args.dtype]]
        print(
            f"\nmax |loss diff| over {args.steps} steps: {max_diff:.3e} (tolerance {tol:.0e} "
            f"for {args.dtype}): {'MATCH' if ok else 'MISMATCH'}"
        )
    if rank == 0 and args.steps > 1:
        tokens = (args.steps - 1) * args.batch * args.context
        print(
            f"sharded training: {tokens / seconds:,.0f} tokens/s over {world} processes "
            f"(steps 1..{args.steps - 1}{', rank 0 also trains the twin' if twin else ''})"
        )
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g.: torchrun --nproc-per-node 2 " + " ".join(sys.argv))
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ok = torch.tensor([float(train(args, rank, world))])
        dist.broadcast(ok, src=0)  # every process exits with rank 0's verdict
    finally:
        dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())

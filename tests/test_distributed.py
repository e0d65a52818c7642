"""flashtile.distributed across real processes: 2, 3 and 4 gloo ranks on localhost.

One process group per world size runs every case (spawning is the slow part);
each rank records a traceback per failing case, and the parent turns them into
one failing test per (world size, case). Every rank builds the same whole
problem from a seed, computes the one-process answer with flashtile itself,
and checks its own shard of it: float64 to 1e-10 relative, float32 within 3x
of one-process flashtile's own float32 error against float64.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import socket
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="flashtile.distributed runs on torch.distributed")

import torch.distributed as dist  # noqa: E402

import flashtile  # noqa: E402
import flashtile.distributed as fd  # noqa: E402
from dense import rel_err  # noqa: E402
from distributed_cases import CASES, WORLD_SIZES, WORLD_TIMEOUT, case, small_shard  # noqa: E402
from distributed_fault_cases import FAULT_SECONDS  # noqa: E402  (and registers its cases)

# ------------------------------------------------------------------ helpers run in each rank


def _problem(seed, world, *, b=2, hq=2, hkv=2, chunk=3, d=5, dv=None, layout="zigzag", dtype):
    """The whole ``q, k, v, dout`` (the same on every rank) as float64 NumPy arrays."""
    n = 2 * world * chunk if layout == "zigzag" else world * chunk
    rng = np.random.default_rng(seed)
    shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, dv or d), (b, hq, n, dv or d)]
    arrays = [rng.standard_normal(s) for s in shapes]
    return [a.astype(dtype).astype(np.float64) for a in arrays]  # values exact in dtype


def _run_and_check(fn, whole, rank, world, *, layout, dtype, keywords, tol=None):
    """Run ``fn`` on this rank's shard (forward + backward); compare with one process."""
    q, k, v, dout = whole

    def shard(x):  # lse is (B, H, T): its sequence axis is the last
        return fd.shard_sequence(x, rank, world, layout=layout, dim=-1 if x.ndim == 3 else -2)

    ours = [torch.from_numpy(shard(x)).to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = fn(*ours, layout=layout, return_lse=True, **keywords)
    out.backward(torch.from_numpy(shard(dout)).to(dtype))
    got = [out, lse] + [x.grad for x in ours]

    plain = {key: val for key, val in keywords.items() if key not in ("enable_gqa", "group")}
    work = np.float64 if dtype == torch.float64 else np.float32

    def one_process(a):
        args = [x.astype(a) for x in (q, k, v)]
        o, o_lse = flashtile.attention(*args, return_lse=True, **plain)
        return [o, o_lse, *flashtile.attention_backward(*args, o, o_lse, dout.astype(a), **plain)]

    exact, same_dtype = one_process(np.float64), one_process(work)
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, g, ref, ref_same in zip(names, got, exact, same_dtype, strict=True):
        err = rel_err(g.detach().double().numpy(), shard(ref))
        bound = tol if tol is not None else 3 * rel_err(shard(ref_same), shard(ref)) + 1e-12
        assert err <= bound, f"rank {rank}: {name} error {err:.2e} > {bound:.2e}"
    assert out.dtype == dtype and out.shape == (*ours[0].shape[:-1], dout.shape[-1])


# ------------------------------------------------------------------ cases


@case()
def ring_zigzag_causal_float64(rank, world):
    whole = _problem(1, world, dtype=np.float64)
    kw = {"causal": True}
    _run_and_check(
        fd.ring_attention,
        whole,
        rank,
        world,
        layout="zigzag",
        dtype=torch.float64,
        keywords=kw,
        tol=1e-10,
    )


@case()
def ring_contiguous_causal_gqa_float64(rank, world):
    whole = _problem(2, world, hq=4, hkv=2, dv=3, layout="contiguous", dtype=np.float64)
    kw = {"causal": True, "enable_gqa": True, "scale": 0.7}
    _run_and_check(
        fd.ring_attention,
        whole,
        rank,
        world,
        layout="contiguous",
        dtype=torch.float64,
        keywords=kw,
        tol=1e-10,
    )


@case()
def ring_noncausal_float32(rank, world):
    for layout in ("zigzag", "contiguous"):
        whole = _problem(3, world, chunk=4, d=8, layout=layout, dtype=np.float32)
        _run_and_check(
            fd.ring_attention,
            whole,
            rank,
            world,
            layout=layout,
            dtype=torch.float32,
            keywords={"causal": False},
        )


@case()
def ring_windows_float64(rank, world):
    # Windows narrower than a chunk, spanning several chunks, one-sided, two-sided.
    windows = [(True, (2, 0)), (True, (7, None)), (False, (1, 4)), (False, (None, 2))]
    for layout in ("zigzag", "contiguous"):
        for causal, window in windows:
            whole = _problem(4, world, chunk=3, layout=layout, dtype=np.float64)
            kw = {"causal": causal, "window": window, "softcap": 2.0}
            _run_and_check(
                fd.ring_attention,
                whole,
                rank,
                world,
                layout=layout,
                dtype=torch.float64,
                keywords=kw,
                tol=1e-10,
            )


@case(2, 4)
def ring_bfloat16_within_one_process_error(rank, world):
    # bf16 inputs compute and merge in float32; the error is the output's own rounding.
    q, k, v, _ = _problem(5, world, chunk=8, d=16, dtype=np.float32)
    shard = lambda x: fd.shard_sequence(x, rank, world)  # noqa: E731
    bf = lambda x: torch.from_numpy(x).to(torch.bfloat16)  # noqa: E731
    whole16 = [bf(x).double().numpy() for x in (q, k, v)]  # what bf16 inputs hold
    ref = flashtile.attention(*whole16, causal=True)
    # One process on bf16 inputs: computed in float32, the output rounded to bf16.
    one = torch.from_numpy(
        flashtile.attention(*(x.astype(np.float32) for x in whole16), causal=True)
    ).to(torch.bfloat16)
    ins = [bf(shard(x)).requires_grad_() for x in (q, k, v)]
    ours = fd.ring_attention(*ins, causal=True)
    assert ours.dtype == torch.bfloat16
    got = ours.detach().double().numpy()
    err, err_one = rel_err(got, shard(ref)), rel_err(one.double().numpy(), ref)
    assert err <= 2 * err_one, f"rank {rank}: bf16 ring error {err:.2e}, one process {err_one:.2e}"
    ours.float().square().sum().backward()  # (bf16 dout: the precision rule reads it)
    assert all(x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in ins)


@case()
def ulysses_matches_one_process(rank, world):
    for layout in ("zigzag", "contiguous"):
        whole = _problem(6, world, hq=2 * world, hkv=world, layout=layout, dtype=np.float64)
        slopes = np.linspace(0.1, 0.8, 2 * world)
        kw = {"causal": True, "enable_gqa": True, "alibi_slopes": slopes, "window": (4, 0)}
        _run_and_check(
            fd.ulysses_attention,
            whole,
            rank,
            world,
            layout=layout,
            dtype=torch.float64,
            keywords=kw,
            tol=1e-10,
        )
    whole = _problem(7, world, hq=world, hkv=world, chunk=4, d=8, dtype=np.float32)
    _run_and_check(
        fd.ulysses_attention,
        whole,
        rank,
        world,
        layout="zigzag",
        dtype=torch.float32,
        keywords={"causal": False, "softcap": 3.0},
    )


@case()
def ring_gradients_are_deterministic(rank, world):
    q, k, v, dout = (torch.from_numpy(x).float() for x in _problem(8, world, dtype=np.float32))
    runs = []
    for _ in range(2):
        xs = [fd.shard_sequence(x, rank, world).requires_grad_() for x in (q, k, v)]
        fd.ring_attention(*xs, causal=True).backward(fd.shard_sequence(dout, rank, world))
        runs.append([x.grad for x in xs])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@case()
def shard_gather_round_trip(rank, world):
    for layout in ("zigzag", "contiguous"):
        x = torch.arange(2 * 3 * 4 * world * 2, dtype=torch.float32).reshape(2, 3, 4 * world, 2)
        back = fd.gather_sequence(fd.shard_sequence(x, rank, world, layout=layout), layout=layout)
        assert torch.equal(back, x)
        ids = torch.arange(6 * world).reshape(1, -1)
        local = fd.shard_sequence(ids, rank, world, layout=layout, dim=-1)
        assert torch.equal(local[0], fd.sequence_positions(6 * world, rank, world, layout=layout))
        assert torch.equal(fd.gather_sequence(local, layout=layout, dim=1), ids)


def _split_cache(n, world, tail):
    """Lengths of each rank's part of ``n`` keys: ranks other than ``tail`` take
    consecutive pieces (rank 0 none), ``tail`` the rest, which ends with the newest."""
    sizes = [0] + [max(0, n // world - r) for r in range(1, world)]
    sizes[tail] = 0
    sizes[tail] = n - sum(sizes)
    return sizes


@case()
def context_parallel_decode_matches_one_process(rank, world):
    rng = np.random.default_rng(9)
    b, hq, hkv, n, d = 2, 4, 2, 23, 6
    for dtype, tq, tail in [(np.float64, 1, None), (np.float64, 3, 0), (np.float16, 2, None)]:
        q = rng.standard_normal((b, hq, tq, d))
        kc, vc = (rng.standard_normal((b, hkv, n, d)).astype(dtype) for _ in range(2))
        ref = flashtile.decode_attention(q, kc, vc, causal=True)
        sizes = _split_cache(n, world, world - 1 if tail is None else tail)
        order = [r for r in range(world) if r != (world - 1 if tail is None else tail)]
        order.append(world - 1 if tail is None else tail)  # the tail's part comes last
        start = sum(sizes[r] for r in order[: order.index(rank)])
        lo, hi = start, start + sizes[rank]
        local = [np.zeros((b, hkv, 8 + hi - lo, d), dtype) for _ in range(2)]  # spare room
        local[0][:, :, : hi - lo], local[1][:, :, : hi - lo] = kc[:, :, lo:hi], vc[:, :, lo:hi]
        out = fd.context_parallel_decode(
            torch.from_numpy(q),
            *map(torch.from_numpy, local),
            tail_rank=tail,
            cache_seqlens=torch.full((b,), hi - lo),
            num_splits=2,
        )
        tol = 1e-12 if dtype == np.float64 else 1e-6
        assert rel_err(out.numpy(), ref) <= tol, (dtype, tq, tail, rel_err(out.numpy(), ref))


@contextlib.contextmanager
def _on_triton_kernels():
    """This rank runs the Triton kernels (in Triton's interpreter, on its CPU
    tensors) where a CUDA tensor would: the GPU path of ring, Ulysses and decoding."""
    os.environ["TRITON_INTERPRET"] = "1"  # before flashtile.triton builds its kernels
    import flashtile.distributed.kernels as kernels
    import flashtile.triton

    assert flashtile.triton.INTERPRET, "Triton was set up without its interpreter"
    saved, kernels.for_device = kernels.for_device, lambda device: kernels.GPU
    try:
        yield
    finally:
        kernels.for_device = saved  # the later cases run the CPU kernels again


if importlib.util.find_spec("triton") is not None:  # the gpu extra (in dev)

    @case(2)
    def ring_and_decode_on_the_triton_kernels(rank, world):
        whole = _problem(11, world, hq=4, hkv=2, chunk=5, d=16, dtype=np.float32)
        kw = {"causal": True, "enable_gqa": True, "window": (7, 0), "softcap": 5.0}
        rng = np.random.default_rng(12)
        q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
        kc, vc = (rng.standard_normal((1, 2, 2 * 9, 16)).astype(np.float32) for _ in range(2))
        mine = [torch.from_numpy(c[:, :, 9 * rank : 9 * (rank + 1)].copy()) for c in (kc, vc)]
        with _on_triton_kernels():
            # Ulysses runs the same engine and kernels, with the ring left out.
            _run_and_check(
                fd.ring_attention, whole, rank, world, layout="zigzag", dtype=torch.float32,
                keywords=kw,
            )  # fmt: skip
            out = fd.context_parallel_decode(torch.from_numpy(q), *mine)
        assert rel_err(out.numpy(), flashtile.decode_attention(q, kc, vc)) <= 1e-6


@case(4)
def ring_on_a_subgroup(rank, world):
    # Ranks 1 and 3 form their own ring (point-to-point peers are global ranks 3 and 1).
    sub = dist.new_group([1, 3])
    if rank not in (1, 3):
        return
    whole = _problem(10, 2, dtype=np.float64)
    kw = {"causal": True, "group": sub}
    _run_and_check(
        fd.ring_attention,
        whole,
        [1, 3].index(rank),
        2,
        layout="zigzag",
        dtype=torch.float64,
        keywords=kw,
        tol=1e-10,
    )


@case(3)
def clear_errors_before_any_message(rank, world):
    x = torch.zeros(1, 2, 5, 4)  # 15 tokens: not a multiple of 2 x 3
    with pytest.raises(ValueError, match=r"sequence length 15 \(5 tokens per rank x 3 ranks\).*6"):
        fd.ring_attention(x, x, x)
    y = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="ulysses_attention"):
        fd.ulysses_attention(y, y, y)  # 2 heads over 3 ranks
    with pytest.raises(ValueError, match="alibi_slopes"):
        fd.ring_attention(y, y, y, alibi_slopes=[0.1, 0.2])
    with pytest.raises(ValueError, match="softcap"):
        fd.ring_attention(y, y, y, softcap=-1.0)
    with pytest.raises(ValueError, match="enable_gqa"):
        fd.ring_attention(y, y[:, :1], y[:, :1])
    with pytest.raises(ValueError, match="gloo"):
        fd.ring_attention(*(torch.zeros(1, 2, 4, 4, device="meta") for _ in range(3)))
    fd.ring_attention(y, y, y)  # the group still works after the refusals


@case(2)
def example_trains_like_one_process(rank, world):
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"
    spec = importlib.util.spec_from_file_location("context_parallel", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--steps", "3", "--context", "32", "--dtype", "float64"])
    assert example.train(args, rank, world)  # rank 0 compares with its one-process twin


# ------------------------------------------------------------------ process plumbing


def _worker(rank, world, port, out_dir):
    stacks = _arm_stacks(out_dir, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    results, seconds = {}, {}
    for name, (fn, worlds) in CASES.items():
        if world in worlds:
            print(f"{CASE_MARK}{time.strftime('%X')} {name}", file=stacks, flush=True)
            start = time.perf_counter()
            try:
                fn(rank, world)
                results[name] = None
            except Exception:  # recorded; the parent fails that case with this traceback
                results[name] = traceback.format_exc()
            seconds[name] = round(time.perf_counter() - start, 2)
            dist.barrier()  # cases never overlap (nor does a rank leave while others work)
    if os.environ.get("FLASHTILE_TEST_TIMES"):
        print(f"rank {rank} of {world}: seconds per case {seconds}", flush=True)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


#: Seconds between two dumps of a rank's Python stacks into its log
#: (``rank<N>.log`` in the world's directory, beside the cases it started).
STACKS_EVERY = 30
#: The start of a log line that names the case a rank started.
CASE_MARK = "case started: "


def _arm_stacks(out_dir, rank):
    """Open this rank's log; every :data:`STACKS_EVERY` s its threads' stacks
    are appended, and when the parent terminates the rank (a world that hangs
    shows where each rank waited)."""
    import faulthandler
    import signal

    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(STACKS_EVERY, repeat=True, file=log)
    faulthandler.register(signal.SIGTERM, file=log, chain=True)
    return log


def _logs(out_dir, world) -> str:
    """Each rank's last case started and the end of its log (the stacks last
    dumped), for a failure message."""
    parts = []
    for rank in range(world):
        path = pathlib.Path(out_dir) / f"rank{rank}.log"
        text = path.read_text() if path.exists() else "(no log)"
        cases = [line for line in text.splitlines() if line.startswith(CASE_MARK)]
        parts.append(f"--- rank {rank}, {cases[-1] if cases else 'no case started'}:")
        parts.append(text[-5000:])
    return "\n".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_forkserver() -> None:
    """Start the fork server that every test here spawns ranks from (once per
    pytest worker, whichever test comes first).

    It imports torch and flashtile once for every rank of every world (a
    fresh interpreter per rank spends seconds on imports); it runs no
    kernel, so no thread pool exists yet when it forks. Its ranks get
    one-thread Numba pools, as a launch for this machine would give them
    (see threads.py): a rank's idle pool threads would spin on the cores the
    other ranks compute on."""
    multiprocessing.set_forkserver_preload(["torch.distributed", "flashtile.distributed", __name__])
    saved = os.environ.get("NUMBA_NUM_THREADS")
    os.environ["NUMBA_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop("NUMBA_NUM_THREADS")
        if saved is not None:
            os.environ["NUMBA_NUM_THREADS"] = saved


def _run_world(world: int, out_dir: str) -> list[dict]:
    """Every case in one group of ``world`` ranks; each rank's ``{case: traceback or None}``."""
    _start_forkserver()
    ctx = torch.multiprocessing.start_processes(
        _worker,
        args=(world, _free_port(), out_dir),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + WORLD_TIMEOUT
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {WORLD_TIMEOUT} s")
    except Exception as exc:  # a rank raised outside the cases, or the world hung
        pytest.fail(f"{exc}\nThe ranks' logs:\n{_logs(out_dir, world)}")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]


def _killed_worker(rank, world, port, out_dir):
    """Rank 1 kills itself (SIGKILL) in the middle of a ring forward; the
    others record what they raised and how long it took."""
    import signal

    from flashtile.distributed import kernels

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    torch.set_num_threads(1)
    if rank == 1:
        kernels.CPU = kernels.LocalKernels(
            *(getattr(kernels.CPU, f) for f in ("name", "compute")),
            lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL),
            *(getattr(kernels.CPU, f) for f in ("grads", "decode", "check")),
        )
    x = small_shard(world)
    start, outcome = time.perf_counter(), "finished"
    try:
        fd.ring_attention(x, x, x)
        fd.ring_attention(x, x, x)
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"outcome": outcome, "seconds": time.perf_counter() - start}, fh)
    os._exit(0)  # (the group cannot be destroyed cleanly without rank 1)


def test_a_killed_rank_makes_the_others_raise(tmp_path):
    world = 3
    _start_forkserver()
    ctx = torch.multiprocessing.start_processes(
        _killed_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=False,
        start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    for proc in ctx.processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [p for p in ctx.processes if p.is_alive()]
    for proc in hung:
        proc.kill()
    assert not hung, "a rank hung after its peer was killed"
    for rank in (0, 2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["outcome"].startswith("PeerFailure: "), result
        assert "went away" in result["outcome"], result
        assert result["seconds"] < FAULT_SECONDS, result


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``worlds(P)``: the ranks' results of a group of ``P``, run on first use only."""
    cache = {}

    def results(world: int) -> list[dict]:
        if world not in cache:
            try:
                cache[world] = _run_world(world, str(tmp_path_factory.mktemp(f"world{world}")))
            except pytest.fail.Exception as failed:  # every case of that world fails with it
                cache[world] = failed
        if isinstance(cache[world], BaseException):
            pytest.fail(f"the world of {world} ranks failed:\n{cache[world]}")
        return cache[world]

    return results


@pytest.mark.parametrize(
    "world, name", [(w, n) for w in WORLD_SIZES for n in CASES if w in CASES[n][1]]
)
def test_case(worlds, world, name):
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(worlds(world)) if res[name]]
    assert not failures, "\n".join(failures)

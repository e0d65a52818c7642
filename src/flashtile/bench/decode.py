"""``flashtile bench --preset decode``: decoding against a KV cache, in GB/s.

A decode step is a read of the cache, so the figure of merit is bytes of K/V
read per second, as a fraction of a **read ceiling measured with it**: a
multithreaded streaming sum of the same arrays (the same bytes, so the same
cache and page behaviour), timed in the same interleaved rounds as the
decode call, by torch's ``sum`` (its thread pool) and by a Numba ``prange``
sum, whichever is faster (for a 16-bit cache: the ceiling of *its* bytes).
torch SDPA on the same tensors (4-D,
``enable_gqa=True``) is shown beside it. Every case checks its answer
(against SDPA, or the contiguous cache for the paged ones) before timing,
and the contenders are timed interleaved (:mod:`.timing`), so a noisy
neighbour hits them all.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import ml_dtypes
import numpy as np
from numba import get_num_threads, njit, prange

from ..decode import decode_attention
from .targets import target_line
from .timing import interleaved_medians

#: The measured shape: q (B, 32, 1, 128) against an 8-head GQA cache (Llama-style).
HQ, HKV, D = 32, 8, 128

#: Targets: (floor, stretch) of the fraction of the read ceiling per cache
#: length (none at other lengths), the time ratio paged / contiguous per page
#: size, and the padded batch against its valid bytes at the one-sequence speed.
CEILING_FLOORS = {65536: (0.75, 0.85), 8192: (0.70, None)}
PAGED_LIMITS = {16: 1.25, 256: 1.1}
BATCH_LIMIT = 1.2
#: time(float32 cache) / time(bfloat16 cache): (floor, stretch); half the bytes.
BF16_SPEEDUP = (1.7, 1.9)


@dataclasses.dataclass
class DecodeRow:
    """One line of the table (times in seconds, medians)."""

    case: str
    kv_bytes: int
    flashtile: float
    torch: float | None = None
    baseline: float | None = None  # the contiguous / one-sequence time it is judged by
    read: float | None = None  # a streaming read of the same bytes (the ceiling)
    note: str = ""

    @property
    def fraction(self) -> float | None:
        """GB/s as a fraction of the read ceiling: ``time(read) / time(flashtile)``."""
        return None if self.read is None else self.read / self.flashtile

    def gbps(self, seconds: float | None) -> float | None:
        return None if seconds is None else self.kv_bytes / seconds / 1e9


@njit(parallel=True, fastmath=True, cache=True)
def parallel_sum(a, parts):
    """Sum of float32 ``a``, one contiguous share per thread (``parts``: one per thread)."""
    n, p = a.shape[0], parts.shape[0]
    for t in prange(p):
        total = np.float32(0.0)
        for i in range(t * n // p, (t + 1) * n // p):
            total += a[i]
        parts[t] = total
    return parts.sum()


def read_calls(arrays, torch=None) -> dict:
    """Zero-argument streaming reads of every byte of ``arrays`` (C-contiguous).

    ``{"read-numba": ..., "read-torch": ...}`` (the torch one when ``torch`` is
    given): each sums the arrays' bytes seen as float32 (any dtype: only the
    bytes count), the Numba one with one contiguous share per thread.
    """
    flat = [np.ascontiguousarray(a).reshape(-1).view(np.float32) for a in arrays]
    parts = np.zeros(get_num_threads(), dtype=np.float32)
    calls = {"read-numba": lambda: [parallel_sum(a, parts) for a in flat]}
    if torch is not None:
        tensors = [torch.from_numpy(a) for a in flat]
        calls["read-torch"] = lambda: [t.sum() for t in tensors]
    return calls


def timed_with_read(calls: dict, arrays, torch, reps: int) -> tuple[dict, float]:
    """Medians of ``calls`` and of the reads of ``arrays``, all interleaved; the
    second value is the faster read's median (the ceiling of this case)."""
    reads = read_calls(arrays, torch)
    times = interleaved_medians({**calls, **reads}, reps)
    return times, min(times.pop(name) for name in reads)


def _cache(rng, batch: int, t_max: int):
    q = rng.standard_normal((batch, HQ, 1, D), dtype=np.float32)
    k = rng.standard_normal((batch, HKV, t_max, D), dtype=np.float32)
    v = rng.standard_normal((batch, HKV, t_max, D), dtype=np.float32)
    return q, k, v


def _paged(rng, k, v, page: int):
    """One sequence's cache cut into shuffled pages, and its block table."""
    _, hkv, t, d = k.shape
    n = t // page
    order = rng.permutation(n)
    pages_k = np.empty((n, hkv, page, d), dtype=k.dtype)
    pages_v = np.empty_like(pages_k)
    pages_k[order] = k[0].reshape(hkv, n, page, d).transpose(1, 0, 2, 3)
    pages_v[order] = v[0].reshape(hkv, n, page, d).transpose(1, 0, 2, 3)
    return pages_k, pages_v, order[None, :]


def _check(got, want, what: str) -> None:
    err = float(np.max(np.abs(got - want)))
    if not err < 1e-4:
        raise AssertionError(f"{what}: max abs error {err:.2e} (expected < 1e-4)")


def _sdpa(torch, q, k, v):
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

    def call():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    return call


def run_decode_cases(lengths=(8192, 65536), reps: int = 9, seed: int = 0) -> list[DecodeRow]:
    """Time every decode case; ``lengths``: the single-sequence cache lengths.

    The longest length also gets the paged caches (pages of 16 and 256 keys),
    the float16 and bfloat16 caches and the batch of 16, each judged against
    the contiguous float32 one-sequence call timed interleaved with it.
    """
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(seed)
    rows = []
    longest = max(lengths)
    for t in lengths:
        q, k, v = _cache(rng, 1, t)
        ours = partial(decode_attention, q, k, v)
        calls = {"flashtile": ours}
        if torch is not None:
            calls["torch"] = _sdpa(torch, q, k, v)
            _check(ours(), calls["torch"]().numpy(), f"Tk={t} against torch SDPA")
        times, read = timed_with_read(calls, (k, v), torch, reps)
        rows.append(
            DecodeRow(f"Tk={t}", k.nbytes * 2, times["flashtile"], times.get("torch"), read=read)
        )
        if t != longest:
            continue
        for page in PAGED_LIMITS:
            pk, pv, table = _paged(rng, k, v, page)
            paged = partial(decode_attention, q, pk, pv, block_table=table)
            _check(paged(), ours(), f"page size {page} against the contiguous cache")
            calls = {"paged": paged, "contiguous": ours}
            times, read = timed_with_read(calls, (pk, pv), torch, reps)
            row = DecodeRow(f"Tk={t}, paged {page}", k.nbytes * 2, times["paged"], read=read)
            rows.append(dataclasses.replace(row, baseline=times["contiguous"]))
        for name in ("float16", "bfloat16"):
            rows.append(_half_row(q, k, v, name, ours, torch, reps))
        rows.append(_batch_row(rng, torch, reps, t, ours, k.nbytes * 2))
    return rows


def _half_row(q, k, v, name: str, single, torch, reps: int) -> DecodeRow:
    """The cache ``k, v`` stored as ``name`` (16 bits), timed interleaved with
    ``single`` (the float32 cache) and a read of its own bytes; checked
    against the float32 call on the rounded values first."""
    dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
    k16, v16 = k.astype(dtype), v.astype(dtype)
    half = partial(decode_attention, q, k16, v16)
    want = decode_attention(q, k16.astype(np.float32), v16.astype(np.float32))
    _check(half(), want, f"{name} cache against float32 on its values")
    del want
    times, read = timed_with_read({name: half, "float32": single}, (k16, v16), torch, reps)
    row = DecodeRow(f"Tk={k.shape[2]}, {name} cache", k16.nbytes * 2, times[name], read=read)
    return dataclasses.replace(row, baseline=times["float32"])


def _batch_row(rng, torch, reps: int, longest: int, single, single_bytes: int) -> DecodeRow:
    """16 sequences of ``longest/64 .. longest/2`` keys (1k..32k for a cache of
    65536) in one padded cache, of which only the valid keys are read.

    Its baseline is its valid bytes at the speed of ``single`` (the one long
    sequence, ``single_bytes`` of K/V), timed interleaved with it.
    """
    lengths = np.linspace(longest // 64, longest // 2, 16).astype(np.int64)
    q, k, v = _cache(rng, len(lengths), int(lengths.max()))
    ours = partial(decode_attention, q, k, v, cache_seqlens=lengths)
    valid = int(lengths.sum()) * HKV * D * 4 * 2
    calls = {"flashtile": ours, "single": single}
    if torch is not None:  # SDPA needs a padding mask: it reads every padded key
        mask = torch.from_numpy(np.arange(k.shape[2])[None, :] < lengths[:, None])
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        mask = mask[:, None, None, :]

        def sdpa():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, attn_mask=mask, enable_gqa=True
                )

        calls["torch"] = sdpa
        _check(ours(), sdpa().numpy(), "batch of 16 against torch SDPA with a padding mask")
    times = interleaved_medians(calls, reps)
    return DecodeRow(
        f"B=16, lengths {lengths[0]}..{lengths[-1]}",
        valid,
        times["flashtile"],
        times.get("torch"),
        times["single"] * valid / single_bytes,
        note="baseline: its valid bytes at the one-sequence speed",
    )


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def decode_table(rows: list[DecodeRow]) -> list[str]:
    """Markdown table lines."""
    lines = [
        "| case | K/V MiB | flashtile ms | GB/s | read ceiling GB/s | % of ceiling | torch ms "
        "| x torch | vs baseline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        speedup = None if r.torch is None else r.torch / r.flashtile
        vs_base = None if r.baseline is None else r.flashtile / r.baseline
        frac = "-" if r.fraction is None else f"{100 * r.fraction:.0f}%"
        lines.append(
            f"| {r.case} | {r.kv_bytes / 2**20:.0f} | {r.flashtile * 1e3:.2f} "
            f"| {r.gbps(r.flashtile):.1f} | {_fmt(r.gbps(r.read), '.1f')} | {frac} "
            f"| {_fmt(r.torch and r.torch * 1e3, '.2f')} | {_fmt(speedup, '.2f')} "
            f"| {_fmt(vs_base, '.2f')} |"
        )
    return lines


def target_lines(rows: list[DecodeRow]) -> list[str]:
    """The decode targets, each with the measured value and a verdict."""
    lines = []
    for r in rows:
        if r.case.startswith("Tk=") and "," not in r.case:  # one contiguous sequence
            floor, stretch = CEILING_FLOORS.get(int(r.case[len("Tk=") :]), (None, None))
            what = f"{r.case}: GB/s / read ceiling GB/s"
            lines.append(target_line(what, r.fraction, floor, at_least=True, stretch=stretch))
        elif ", paged " in r.case:
            limit = PAGED_LIMITS[int(r.case.rsplit(" ", 1)[1])]
            what = f"{r.case}: time(paged) / time(contiguous)"
            lines.append(target_line(what, r.flashtile / r.baseline, limit, at_least=False))
        elif r.case.endswith("bfloat16 cache"):
            what = f"{r.case}: time(float32 cache) / time(bfloat16 cache)"
            floor, stretch = BF16_SPEEDUP
            speedup = r.baseline / r.flashtile
            lines.append(target_line(what, speedup, floor, at_least=True, stretch=stretch))
            what = f"{r.case}: GB/s / read ceiling GB/s of its bytes"
            lines.append(target_line(what, r.fraction, None, at_least=True))
        elif r.case.startswith("B=16"):
            what = f"{r.case}: time(batch) / time(its valid bytes at one-sequence speed)"
            lines.append(target_line(what, r.flashtile / r.baseline, BATCH_LIMIT, at_least=False))
    return lines


def run_decode_bench(out, reps: int = 9, lengths=(8192, 65536), records=None) -> int:
    """Print the decode table, its read ceilings and the targets to ``out``
    (and each row, as a dict, to ``records`` when given: the report's plot)."""
    import os

    import numba

    from .machine import header_lines, machine_info

    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    for line in header_lines(machine_info(threads), None):
        print(line, file=out)
    print(
        f"decode  : q (B, {HQ}, 1, {D}) against a GQA cache (B, {HKV}, Tk, {D}), fp32 "
        f"(16-bit rows: the same values rounded), {numba.get_num_threads()} threads; "
        f"read ceiling per case: a parallel sum of the same bytes (torch or Numba, the "
        f"faster), timed interleaved; medians of {reps}; "
        f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        file=out,
    )
    rows = run_decode_cases(lengths, reps)
    if records is not None:
        records += [dataclasses.asdict(r) for r in rows]
    print("", file=out)
    for line in decode_table(rows):
        print(line, file=out)
    print("", file=out)
    for line in target_lines(rows):
        print(f"* target: {line}", file=out)
    return 0

"""Compile every kernel ahead of time for NVIDIA architectures, without a GPU.

``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget(
"cuda", arch, 32))`` runs Triton's whole pipeline down to a cubin with the
ptxas shipped in Triton's wheel. :func:`compile_report` does that for every
kernel, in every configuration :mod:`.configs` lets it launch with, for each
dtype and head-dim bucket, plus one compile per kernel with every variant
switched on (and a head dim that is not a power of two), and reports the
shared memory each needs against the architecture's limit per block.

The interpreter replaces the kernels by Python functions, so a process that
imported :mod:`flashtile.triton` with ``TRITON_INTERPRET=1`` compiles in a
child process without it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time

from . import backward, decode, forward
from .configs import NOT_WITH_MODS, Config, candidates, head_block
from .tiles import INTERPRET

#: Shared memory one block may use (opt-in maximum), bytes.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
KERNELS = {
    "attn_fwd": forward.attn_fwd,
    "attn_bwd_delta": backward.attn_bwd_delta,
    "attn_bwd_dkdv": backward.attn_bwd_dkdv,
    "attn_bwd_dq": backward.attn_bwd_dq,
    "decode_split": decode.decode_split,
    "decode_merge": decode.decode_merge,
}
DTYPES = ("fp16", "bf16", "fp32")
HEAD_DIMS = (64, 128, 256)
_DATA = {"Q", "K", "V", "DOut", "DQ", "DK", "DV"}
_FLOAT32 = {"Lse", "Delta", "Sums", "Slopes", "PartOut", "PartLse", "Floats", "Grads"}
_INT32 = {"KvLens", "CuQ", "CuK", "Table", "SeqLens", "Num", "Idx"}
_INT64_POINTERS = {"Ints"}
_FLOATS = {"scale", "qk_scale", "cap_in", "cap_out", "drop_scale"}
_INT64 = {"seed"}  # dropout's 64-bit seed
_FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "ALIBI", "KV_LENS", "VARLEN", "PAGED", "DROPOUT")


def _signature(fn, dtype: str, out_type: str) -> dict[str, str]:
    """Triton types of ``fn``'s arguments, by name (``Out`` is ``out_type``)."""
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in _DATA or (name == "Out" and out_type == "data"):
            sig[name] = f"*{dtype}"
        elif name in _FLOAT32 or name in ("Out", "Lse"):
            sig[name] = "*fp32"
        elif name in _INT32:
            sig[name] = "*i32"
        elif name in _INT64_POINTERS:
            sig[name] = "*i64"
        else:
            sig[name] = "fp32" if name in _FLOATS else "i64" if name in _INT64 else "i32"
    return sig


def _aligned(fn) -> dict:
    """Divisibility by 16 for every pointer and stride, as the launcher's specialization
    gives typical launches (contiguous tensors, head dims and lengths multiples of 16):
    it decides vectorised and asynchronous (pipelined) loads, hence the shared memory."""
    stride = re.compile(r"^s[a-z]{1,2}_[bhtrs]$")
    return {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(fn.params)
        if not p.is_constexpr and (p.name[0].isupper() or stride.match(p.name))
    }


#: The kernels that take a user's mods (:mod:`.flex`).
MOD_KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")


@functools.cache
def sample_mods():
    """The Triton functions of a typical pair of mods: a learned relative
    bias (a float table that takes a gradient) and a causal document mask
    (an integer table), as :mod:`.mod_source` writes them."""
    import torch

    from .mod_source import triton_mods

    bias = torch.zeros(4, 255, requires_grad=True)
    docs = torch.zeros(128, dtype=torch.int64)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 127]

    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    return triton_mods(rel_bias, document, torch.device("cpu"))


def _mod_constants(kernel: str) -> dict:
    """The mods' switches of :func:`sample_mods` for ``kernel``: a block
    mask's walk of 128 x 128 blocks."""
    fns = sample_mods()
    return {
        "SCORE_FN": fns.score if kernel == "attn_fwd" else fns.score_grad,
        "MASK_FN": fns.mask, "CAPTURE_FN": fns.capture, "SPARSE": True, "MAP_M": 128,
        "MAP_N": 128, "HAS_RIGHT": False,
    }  # fmt: skip


def _constants(fn, dtype: str, d: int, config: Config, all_variants, block_m: int):
    """The compile-time arguments ``fn`` takes, for one configuration
    (``all_variants``: False, True, or "mods": :func:`sample_mods`)."""
    mods = all_variants == "mods"
    all_variants = all_variants is True
    values = {
        "HEAD_D": d, "HEAD_DV": d, "BLOCK_D": head_block(d), "BLOCK_DV": head_block(d),
        "BLOCK_M": block_m, "BLOCK_N": config.block_n, "BLOCK_R": config.block_m,
        "IEEE": dtype == "fp32", "EMULATE_BF16": False,
        **{flag: all_variants for flag in _FLAGS}, "HAS_RIGHT": True,
        "SCORE_FN": None, "MASK_FN": None, "CAPTURE_FN": None, "SPARSE": False, "MAP_M": 1,
        "MAP_N": 1, **(_mod_constants(fn.__name__) if mods else {}),
    }  # fmt: skip
    return {p.name: values[p.name] for p in fn.params if p.is_constexpr}


def _compile_one(kernel: str, arch: int, dtype: str, d: int, config: Config, all_variants=False,
                 block_m: int | None = None, limits: dict | None = None) -> dict:  # fmt: skip
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = KERNELS[kernel]
    block_m = config.block_m if block_m is None else block_m
    # The decode kernel writes partials in float32, or the output itself with one split.
    out_type = "fp32" if kernel == "decode_split" and not all_variants else "data"
    signature = _signature(fn, dtype, out_type)
    constants = _constants(fn, dtype, d, config, all_variants, block_m)
    source = ASTSource(fn, signature, constants, attrs=_aligned(fn))
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages,
               "enable_fp_fusion": True}  # fmt: skip
    label = f"d={d} {config.label()}" + (f" rows={block_m}" if kernel == "decode_split" else "")
    variants = "mods" if all_variants == "mods" else "all" if all_variants else "causal"
    row = {"kernel": kernel, "arch": arch, "dtype": dtype, "head_dim": d,
           "config": label, "variants": variants}  # fmt: skip
    start = time.perf_counter()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        shared, error = int(compiled.metadata.shared), None
        limit = {**SHARED_LIMIT, **(limits or {})}.get(arch, SHARED_LIMIT[80])
        if shared > limit:
            error = f"needs {shared} B of shared memory, sm_{arch} has {limit} B per block"
    except Exception as exc:  # a compile error is a result of the report
        shared, error = None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    row.update(shared_bytes=shared, ok=error is None, error=error,
               seconds=round(time.perf_counter() - start, 2))  # fmt: skip
    return row


def _with_mods(kernel: str, options: list[Config]) -> list[Config]:
    """The configurations ``kernel`` may launch with for a call with mods."""
    return [c for c in options if (kernel, c) not in NOT_WITH_MODS]


def _worst_jobs(archs, dtypes, head_dims, kernels):
    """One compile per kernel, arch and dtype: every variant on, the largest head-dim
    bucket with a head dim that needs padding, the largest tiles, 64 decoding rows."""
    jobs = []
    block_d = head_block(max(head_dims))
    for arch in archs:
        for kernel in kernels:
            for dtype in dtypes:
                options = candidates(kernel, 4 if dtype == "fp32" else 2, block_d)
                config = max(options, key=lambda c: (c.block_m * c.block_n * c.num_stages, c))
                rows = 64 if kernel == "decode_split" else None
                jobs.append((kernel, arch, dtype, block_d * 3 // 4 + 8, config, True, rows))
                if kernel in MOD_KERNELS:
                    options = _with_mods(kernel, options)
                    config = max(options, key=lambda c: (c.block_m * c.block_n * c.num_stages, c))
                    jobs.append((kernel, arch, dtype, block_d * 3 // 4 + 8, config, "mods", None))
    return jobs


def _jobs(archs, dtypes, head_dims, kernels):
    """Every compile of the report, as ``_compile_one`` arguments."""
    jobs = []
    for arch in archs:
        for kernel in kernels:
            for dtype in dtypes:
                size = 4 if dtype == "fp32" else 2
                for d in head_dims:
                    for config in candidates(kernel, size, head_block(d)):
                        rows = (16, 64) if kernel == "decode_split" else (None,)
                        jobs += [(kernel, arch, dtype, d, config, False, m) for m in rows]
            # Every switch on, a padded head dim (80 -> 128): the variants' code paths.
            config = candidates(kernel, 2, 128)[0]
            jobs.append((kernel, arch, "bf16", 80, config, True, None))
            if kernel in MOD_KERNELS:  # and a user's mods with a block mask
                config = _with_mods(kernel, candidates(kernel, 2, 128))[0]
                jobs.append((kernel, arch, "bf16", 80, config, "mods", None))
    return jobs


def compile_report(
    archs=(80, 90),
    *,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    kernels=tuple(KERNELS),
    jobs=1,
    worst_only=False,
    limits=None,
) -> list[dict]:
    """Compile every kernel ahead of time; one dict per compile.

    Args:
        archs: compute capabilities as ints (80 = A100 sm_80, 90 = H100/H200 sm_90).
        dtypes: any of ``"fp16"``, ``"bf16"``, ``"fp32"``.
        head_dims: head dims to compile for (each bucket's largest, 64/128/256,
            covers the tile sizes of every head dim up to it).
        kernels: names from :data:`KERNELS`.
        jobs: compiles run in this many processes at once (each compile takes
            one core for 2-30 s; the full report is about 200 compiles).
        worst_only: compile only each kernel's worst case per arch and dtype:
            every variant on, the largest head-dim bucket (with a head dim that
            needs padding), the configuration with the largest tiles; and for
            the kernels that take mods, the same with :func:`sample_mods` and
            a block mask instead of the variants.
        limits: ``{arch: bytes}`` of shared memory per block, overriding
            :data:`SHARED_LIMIT` (other archs: sm_80's limit).

    Returns:
        dicts with ``kernel, arch, dtype, head_dim, config, variants`` ("causal",
        "all" or "mods"), ``shared_bytes, ok, error, seconds``. ``ok`` is False when the compile
        failed (``error`` says why) or the kernel needs more shared memory
        per block than the architecture has (sm_80: 163 KiB, sm_90: 227 KiB).
    """
    for arch in archs:
        if not isinstance(arch, int) or arch < 70:
            raise ValueError(f"archs holds compute capabilities like 80 or 90, got {arch!r}")
    unknown = [x for x in dtypes if x not in DTYPES] + [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown dtypes or kernels {unknown}: choose from {DTYPES}, {KERNELS}")
    if INTERPRET:
        args = [list(archs), list(dtypes), list(head_dims), list(kernels), jobs, worst_only, limits]
        return _in_child(args)
    todo = (_worst_jobs if worst_only else _jobs)(archs, dtypes, head_dims, kernels)
    todo = [(*job, limits) for job in todo]
    if jobs <= 1:
        return [_compile_one(*job) for job in todo]
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_compile_job, todo))


def _compile_job(job: tuple) -> dict:
    return _compile_one(*job)


def _in_child(args: list) -> list[dict]:
    """Run the report in a Python without ``TRITON_INTERPRET`` (the kernels must be jitted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    code = (
        "import json, sys; from flashtile.triton import compile_report; "
        "a = json.loads(sys.argv[1]); limits = a[6] and {int(k): v for k, v in a[6].items()}; "
        "rows = compile_report(a[0], dtypes=a[1], head_dims=a[2], kernels=a[3], jobs=a[4], "
        "worst_only=a[5], limits=limits); "
        "print(json.dumps(rows))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the compile report's child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> str:
    """A short text table: compiles, failures and the largest shared memory per kernel/arch."""
    lines = [f"{'kernel':16} {'arch':>5} {'compiles':>8} {'failed':>6} {'max shared KiB':>14}"]
    for kernel, arch in sorted({(r["kernel"], r["arch"]) for r in rows}):
        group = [r for r in rows if r["kernel"] == kernel and r["arch"] == arch]
        shared = max((r["shared_bytes"] or 0) for r in group) / 1024
        failed = sum(not r["ok"] for r in group)
        lines.append(f"{kernel:16} {'sm_' + str(arch):>5} {len(group):8} {failed:6} {shared:14.1f}")
    lines += [f"FAILED {r['kernel']} sm_{r['arch']} {r['dtype']} {r['config']}: {r['error']}"
              for r in rows if not r["ok"]]  # fmt: skip
    return "\n".join(lines)

"""Torch mods traced into the scalar functions of :mod:`flashtile.mods`.

A ``score_mod``/``mask_mod`` written for FlexAttention is a function of
scalar tensors. It is traced as FlexAttention runs it, under ``torch.vmap``
(so ``bias[h][q_idx - kv_idx]`` indexes as the user means), by
``make_fx`` with PyTorch's core decompositions, on a batch of one: a graph
of a few elementwise ATen operations and reads of captured tensors. The
graph is translated line by line into Python that Numba compiles
(:func:`translate`); captured tensors become flat tables.

Derivatives are torch's own: the traced function, with each captured
element it reads turned into an input, goes through
``torch.func.grad_and_value`` and is traced again, giving the derivative by
the score and by every read of a captured float tensor that requires grad.
The backward scatters ``dS`` times the latter into the tables' gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..mod_snapshot import snapshot
from ..mods import LOCK, Mods, compiled_module, module_source
from ..route_cache import cache_dir
from . import trace_cache
from .fx_translate import (
    MASK_INPUTS,
    SCORE_INPUTS,
    Expr,
    Table,
    Translator,
    Unsupported,
    dtype_kind,
)

# One traced graph per mod: a mod defined once and called every step is
# traced once (its captured tensors' values are read again on every call;
# a captured tensor replaced by another, resized, or whose requires_grad
# changed, makes it traced again).
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _one(value, dtype, device):
    return torch.tensor([value], dtype=dtype, device=device)


def _indices(device):
    return tuple(_one(n, torch.int32, device) for n in (0, 0, 0, 0))


def _trace(fn, args, what):
    """``make_fx`` of ``fn`` with PyTorch's core decompositions, dead code removed."""
    from torch._decomp import core_aten_decompositions

    try:
        gm = make_fx(fn, decomposition_table=core_aten_decompositions())(*args)
    except Unsupported:
        raise
    except Exception as exc:  # make_fx's data-dependent errors and the user's own
        message = str(exc)
        if isinstance(exc, RuntimeError) and "device" in message and "expected" in message:
            raise ValueError(
                f"{what} could not be traced on {args[-1].device} ({str(exc).splitlines()[0]}): "
                f"a tensor it captures is on another device; move the tensor to the inputs' "
                f"device"
            ) from exc
        raise Unsupported(
            f"{what} could not be traced ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
            f"write it with torch operations on its scalar tensors (torch.where, not Python "
            f"if; no .item())"
        ) from exc
    gm.graph.eliminate_dead_code()
    return gm


class _ReadsAsInputs(torch.fx.Interpreter):
    """Runs a traced mod with the captured elements it reads given as inputs."""

    def __init__(self, gm, read_nodes):
        super().__init__(gm)
        self.read_nodes = read_nodes
        self.read_values = {}

    def run_node(self, n):
        if n in self.read_nodes:
            return self.read_values[n]
        return super().run_node(n)


@dataclass
class TracedMods:
    """What tracing a pair of mods gives: the source of their scalar
    functions, the kinds it defines, and the captured tables."""

    source: str
    kinds: tuple[str, ...]
    tables: list[Table]
    n_floats: int
    n_ints: int
    limits: tuple[tuple[str, int], ...]
    map_offset: int
    mapped: bool


def trace_mods(score_mod, mask_mod, block_map=None, dialect=Translator, device=None) -> TracedMods:
    """Trace and translate a pair of torch mods (either may be None).

    ``block_map = (Bm, Hm, nQ, nK, BQ, BK)``: the shape and blocks of a
    BlockMask's tile states, which the mask function then also reads (a key
    in a block the map leaves out is hidden, whatever ``mask_mod`` says:
    FlexAttention's rule); :func:`compile_mods` copies the states in.
    ``dialect``: the :class:`Translator` class that writes the functions
    (Numba's for the CPU kernels; :mod:`flashtile.triton.mod_source`'s);
    ``device``: where the mods are traced (the captured tensors': the
    inputs'; default the CPU)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (score_mod, mask_mod, block_map, dialect, device)
    with LOCK:  # make_fx is not re-entrant across threads
        cached = _lookup(key)
        if cached is not None:
            return cached
        traced, reusable = _stored_or_traced(score_mod, mask_mod, block_map, dialect, device)
        checks = snapshot((score_mod, mask_mod), _tensor_check) if reusable else None
        if checks is not None:  # else traced again on every call
            _store(key, (traced, checks))
        return traced


def _stored_or_traced(score_mod, mask_mod, block_map, dialect, device):
    """``(traced, reusable)``: the mods' trace from :mod:`.trace_cache` (the
    same code capturing the same layouts, traced before), else traced now
    and stored there; ``reusable`` is False for a trace that depends on a
    captured tensor's values (read into Python: ``w.item()`` is seen while
    tracing; ``w.tolist()`` is not, but leaves the tensor out of the
    tables), which is then traced again on every call."""
    context = (block_map, f"{dialect.__module__}.{dialect.__qualname__}", str(device))
    found = trace_cache.trace_key((score_mod, mask_mod), context)
    if found is not None:
        stored = trace_cache.load(*found, device)
        if stored is not None:
            with contextlib.suppress(TypeError):  # (an entry of other fields: traced again)
                return TracedMods(**stored), True
    with trace_cache.ValueReads() as reads:
        traced = _trace_all(score_mod, mask_mod, block_map, dialect, device)
    tables = {id(t.tensor) for t in traced.tables}
    leaves = [] if found is None else found[1]
    unread = [x for x in leaves if isinstance(x, torch.Tensor) and id(x) not in tables]
    reusable = not reads.seen and not unread
    if found is not None and reusable:
        plain = {f.name: getattr(traced, f.name) for f in fields(traced)}
        trace_cache.store(*found, plain, plain.pop("tables"))
    return traced, reusable


def _trace_all(score_mod, mask_mod, block_map, dialect, device) -> TracedMods:
    translator = dialect("score_mod/mask_mod")
    functions, kinds = [], []
    if score_mod is not None:
        functions += _score_functions(score_mod, translator, device)
        kinds += ["score", "score_grad"]
        if any(translator.tables[t].tensor.requires_grad for _, t, _ in translator.reads):
            kinds.append("capture")
    if mask_mod is not None:
        functions.append(_mask_function(mask_mod, translator, device))
        kinds.append("mask")
    map_size = 0 if block_map is None else int(np.prod(block_map[:4]))
    n_floats, n_ints = _layout(translator.tables, map_size)
    names = () if block_map is None else ("BM", "HM", "NQ", "NK", "BQ", "BK")
    offsets = translator.constants(
        [*(f"T{n}" for n in range(len(translator.tables))), "MAP", *names],
        [*(t.offset for t in translator.tables), n_ints - map_size, *(block_map or ())],
    )
    return TracedMods(
        offsets + "\n".join(functions), tuple(kinds), translator.tables, n_floats, n_ints,
        tuple(sorted(translator.direct)), n_ints - map_size, block_map is not None,
    )  # fmt: skip


def _tensor_check(value):
    """A check that a captured tensor is still the one traced, of the same
    shape, dtype and ``requires_grad`` (the generated code bakes in its
    layout, and whether it takes a gradient); None for other values."""
    if not isinstance(value, torch.Tensor):
        return None
    shape, dtype, grad = value.shape, value.dtype, value.requires_grad
    return lambda now: (
        now is value and now.shape == shape and now.dtype == dtype and now.requires_grad == grad
    )


def _layout(tables, map_size: int) -> tuple[int, int]:
    """Place the tables in the float and int buffers (int slot 0 is the
    flag, the block map's states last)."""
    n_floats, n_ints = 0, 1
    for t in tables:
        if t.kind == "f":
            t.offset, n_floats = n_floats, n_floats + t.tensor.numel()
        else:
            t.offset, n_ints = n_ints, n_ints + t.tensor.numel()
    return max(n_floats, 1), n_ints + map_size


def _score_functions(score_mod, tr: Translator, device) -> list[str]:
    """``_score``, ``_score_grad`` and ``_score_capture`` (see :mod:`flashtile.mods`)."""

    def positional(score, b, h, q_idx, kv_idx):  # (make_fx reads the signature it traces)
        return score_mod(score, b, h, q_idx, kv_idx)

    sample = (_one(0.0, torch.float32, device), *_indices(device))
    gm = _trace(torch.vmap(positional), sample, "score_mod")
    tr.lines = []
    value = _one_output(tr.translate(gm, SCORE_INPUTS), "f", "score_mod")
    forward_lines, reads, nodes = tr.lines, list(tr.reads), list(tr.read_nodes)
    # The derivative by x and by the reads of captured float tensors that require grad.
    wanted = [
        n for n, (_, t, _) in enumerate(reads)
        if tr.tables[t].kind == "f" and tr.tables[t].tensor.requires_grad
    ]  # fmt: skip
    grad_lines, grads, gvalue = _derivative(gm, nodes, reads, wanted, tr, device)
    tr.lines = []
    score = tr.function("_score", "x, b, h, qi, kv, F, I", forward_lines, value.text)
    both = tr.function(
        "_score_grad", "x, b, h, qi, kv, F, I", forward_lines + grad_lines,
        f"{gvalue.text}, {grads[0].text}",
    )  # fmt: skip
    scatter = [
        tr.scatter(reads[n][1], reads[n][2], grads[1 + m].text) for m, n in enumerate(wanted)
    ]
    capture = tr.function(
        "_score_capture", tr.CAPTURE_PARAMS, forward_lines + grad_lines + scatter, "0"
    )
    return [score, both, capture]


def _sample(table: Table, device):
    """A value of one element of ``table``'s dtype, to trace with."""
    dtype = table.tensor.dtype
    if table.kind == "f":
        return _one(0.5, torch.float32, device)
    return _one(*((False, torch.bool) if dtype == torch.bool else (0, torch.int64)), device)


def _derivative(gm, read_nodes, reads, wanted, tr: Translator, device):
    """``(lines, grads, value)``: lines computing the mod's value and its
    derivatives by ``x`` and by the ``wanted`` reads, traced through
    ``torch.func.grad_and_value`` of the (batch-of-one) graph ``gm`` with
    its reads as inputs."""
    runner = _ReadsAsInputs(gm, set(read_nodes))
    count = len(read_nodes)

    def with_reads(x, *rest):
        runner.read_values = dict(zip(read_nodes, rest[:count], strict=True))
        return runner.run(x, *rest[count:]).sum()  # one element: the value itself

    argnums = (0, *(1 + n for n in wanted))
    samples = [_sample(tr.tables[t], device) for _, t, _ in reads]
    fn = torch.func.grad_and_value(with_reads, argnums=argnums)
    sample = (_one(0.0, torch.float32, device), *samples, *_indices(device))
    ggm = _trace(fn, sample, "score_mod's derivative")
    saved, tr.lines = tr.lines, []
    read_exprs = [Expr(name, dtype_kind(tr.tables[t].tensor.dtype)) for name, t, _ in reads]
    inputs = [Expr("x", "f"), *read_exprs, *(Expr(n, "i") for n in SCORE_INPUTS[1:])]
    outputs = tr.translate(ggm, inputs)
    lines, tr.lines = tr.lines, saved
    return lines, outputs[:-1], outputs[-1]


def _one_output(outputs, kind: str, what: str) -> Expr:
    """The mod's one scalar result, of the kind it must have."""
    wanted = {"f": "a float score", "b": "a bool (True = keep)"}[kind]
    if len(outputs) != 1 or not isinstance(outputs[0], Expr):
        raise Unsupported(
            f"{what} must return one value per (b, h, q_idx, kv_idx), {wanted}; it returned "
            f"{len(outputs)} values or a whole tensor"
        )
    if outputs[0].kind != kind:
        got = {"f": "a float", "i": "an integer", "b": "a bool"}[outputs[0].kind]
        raise Unsupported(f"{what} must return {wanted}, it returned {got}")
    return outputs[0]


def _mask_function(mask_mod, tr: Translator, device) -> str:
    """``_mask``: the mod's answer (a block map is read by the row loop:
    :data:`flashtile.mods.LOOPS`)."""

    def positional(b, h, q_idx, kv_idx):  # (default arguments, bound methods)
        return mask_mod(b, h, q_idx, kv_idx)

    gm = _trace(torch.vmap(positional), _indices(device), "mask_mod")
    tr.lines = []
    value = _one_output(tr.translate(gm, MASK_INPUTS), "b", "mask_mod")
    lines, tr.lines = tr.lines, []
    return tr.function("_mask", "b, h, qi, kv, F, I", lines, value.text)


def _split(key):
    """``(holder, rest)``: the mod the weak cache is keyed by, and the rest of
    the key (which must not hold the holder: it would never be freed)."""
    score_mod, mask_mod, *rest = key
    if score_mod is not None:
        return score_mod, ("score", mask_mod, *rest)
    return mask_mod, ("mask", None, *rest)


def _lookup(key):
    """The traced mods of ``key`` if still valid for what the mods capture now."""
    holder, rest = _split(key)
    try:
        entry = _TRACED.get(holder)
    except TypeError:
        return None
    found = entry.get(rest) if entry else None
    if found is None:
        return None
    traced, checks = found
    return traced if all(check() for check in checks) else None


def _store(key, value):
    holder, rest = _split(key)
    with contextlib.suppress(TypeError):  # not weak-referenceable: traced again next time
        _TRACED.setdefault(holder, {})[rest] = value


def check_tables_on(traced: TracedMods, device) -> None:
    """Raise unless every tensor the mods capture is on ``device`` (the
    inputs'): the kernels read the tables where the inputs are."""
    for t in traced.tables:
        if t.tensor.device != device:
            raise ValueError(
                f"a mod captures a tensor on {t.tensor.device}, the inputs are on {device}: "
                f"move the tensor to the inputs' device"
            )


def compile_mods(traced: TracedMods, states=None) -> Mods:
    """The :class:`Mods` of traced mods: the module compiled (or loaded from
    the disk cache) and the tables' current values copied into its buffers
    (and a block map's ``states``, when traced with one)."""
    directory = cache_dir() / "mods"

    def load(bits: int) -> dict:
        args = (traced.source, traced.kinds, traced.n_floats, traced.n_ints, True, bits)
        args += (traced.mapped,)
        return compiled_module(module_source(*args), directory)

    floats = np.zeros(traced.n_floats)
    ints = np.zeros(traced.n_ints, dtype=np.int64)
    for t in traced.tables:  # (a table on a GPU: copied, for create_block_mask)
        flat = t.tensor.detach().reshape(-1).cpu()
        if t.kind == "f":
            floats[t.offset : t.offset + flat.numel()] = flat.double().numpy()
        else:
            ints[t.offset : t.offset + flat.numel()] = flat.long().numpy()
    if states is not None:
        ints[traced.map_offset :] = states.reshape(-1)
    return Mods(traced.kinds, floats, ints, load, label="score_mod/mask_mod", limits=traced.limits)

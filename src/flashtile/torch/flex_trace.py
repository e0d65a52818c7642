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
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..mods import Mods, compiled_module, module_source
from ..routes import cache_dir

# One traced graph per mod: a mod defined once and called every step is
# traced once (its captured tensors' values are read again on every call).
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: The positional inputs of the scalar functions.
SCORE_INPUTS = ("x", "b", "h", "qi", "kv")
MASK_INPUTS = ("b", "h", "qi", "kv")

_UNARY = {
    "neg": "(-{0})",
    "abs": "abs({0})",
    "exp": "math.exp({0})",
    "exp2": "(2.0 ** {0})",
    "expm1": "math.expm1({0})",
    "log": "math.log({0})",
    "log2": "math.log2({0})",
    "log10": "math.log10({0})",
    "log1p": "math.log1p({0})",
    "sqrt": "math.sqrt({0})",
    "rsqrt": "(1.0 / math.sqrt({0}))",
    "reciprocal": "(1.0 / {0})",
    "sin": "math.sin({0})",
    "cos": "math.cos({0})",
    "tan": "math.tan({0})",
    "tanh": "math.tanh({0})",
    "erf": "math.erf({0})",
    "erfc": "math.erfc({0})",
    "sigmoid": "(1.0 / (1.0 + math.exp(-{0})))",
    "floor": "math.floor({0})",
    "ceil": "math.ceil({0})",
    "trunc": "math.trunc({0})",
    "round": "round({0})",
    "sign": "(({0} > 0) - ({0} < 0))",
    "sgn": "(({0} > 0) - ({0} < 0))",
    "isnan": "({0} != {0})",
    "logical_not": "(not {0})",
}
_BINARY = {
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "true_divide": "({0} / {1})",
    "floor_divide": "({0} // {1})",
    "remainder": "({0} % {1})",
    "fmod": "math.fmod({0}, {1})",
    "pow": "({0} ** {1})",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "maximum": "max({0}, {1})",
    "minimum": "min({0}, {1})",
    "logical_and": "({0} and {1})",
    "logical_or": "({0} or {1})",
    "logical_xor": "(bool({0}) != bool({1}))",
}
_BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
_IDENTITY = {
    "alias", "clone", "detach", "lift_fresh_copy", "view", "_unsafe_view", "reshape",
    "expand", "squeeze", "unsqueeze", "contiguous", "sum", "mean", "permute",
}  # fmt: skip
_CONSTANT = {
    "full_like", "scalar_tensor", "full", "new_full", "ones_like", "zeros_like", "new_ones",
    "new_zeros",
}  # fmt: skip


class Unsupported(TypeError):
    """A mod uses something that cannot be compiled into the kernels."""


@dataclass
class Table:
    """A captured tensor, flattened into the float or the int buffer."""

    tensor: torch.Tensor
    kind: str  # "f" (float64 buffer) or "i" (int64 buffer, bools as 0/1)
    offset: int = 0


@dataclass(frozen=True)
class Expr:
    """A scalar value: Python source and its kind ("f", "i" or "b")."""

    text: str
    kind: str


@dataclass(frozen=True)
class View:
    """A captured tensor indexed on its first ``len(index)`` dims."""

    table: int
    index: tuple[str, ...]
    batched: bool


_BATCH = object()  # ``arange(0, 1)``: vmap's own batch index


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point else "i"


def _literal(value) -> Expr:
    if isinstance(value, bool):
        return Expr(repr(value), "b")
    if isinstance(value, int):
        return Expr(repr(value), "i")
    if isinstance(value, float):
        if math.isnan(value):
            return Expr("math.nan", "f")
        if math.isinf(value):
            return Expr("math.inf" if value > 0 else "(-math.inf)", "f")
        return Expr(repr(value), "f")
    raise Unsupported(f"a constant {value!r} of type {type(value).__name__}")


_CAST = {"f": "float({0})", "i": "int({0})", "b": "bool({0})"}


class Translator:
    """Translates traced graphs into lines of Python over scalars; the
    captured tensors of every graph it translates share one table list."""

    def __init__(self, what: str):
        self.what = what
        self.tables: list[Table] = []
        self.lines: list[str] = []
        self.reads: list[tuple[str, int, str]] = []  # (value name, table, offset name)
        self.read_nodes: list = []  # the graph node of each read, in the same order
        # (input name, dim size): dims indexed by an input itself, whose
        # range is checked once per call instead of per element
        self.direct: set[tuple[str, int]] = set()
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def table(self, tensor: torch.Tensor) -> int:
        for n, t in enumerate(self.tables):
            if t.tensor is tensor:
                return n
        if tensor.device.type != "cpu":
            raise Unsupported(f"{self.what} captures a tensor on {tensor.device}: CPU only")
        kind = "f" if tensor.dtype.is_floating_point else "i"
        if tensor.is_complex():
            raise Unsupported(f"{self.what} captures a complex tensor")
        self.tables.append(Table(tensor, kind))
        return len(self.tables) - 1

    def translate(self, gm, inputs, read_inputs=None) -> list:
        """Emit the lines of ``gm`` (placeholders bound to ``inputs``: names
        or :class:`Expr`); return its flat outputs as :class:`Expr`."""
        env = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        bound = list(inputs) + list(read_inputs or ())
        for node, value in zip(placeholders, bound, strict=True):
            env[node] = value if isinstance(value, Expr) else Expr(value, _kind_of(node))
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                env[node] = View(self.table(getattr(gm, node.target)), (), False)
            elif node.op == "call_function":
                env[node] = self._call(node, env)
            elif node.op == "output":
                flat, _ = torch.utils._pytree.tree_flatten(node.args[0])
                return [env[n] if isinstance(n, torch.fx.Node) else _literal(n) for n in flat]
        raise Unsupported(f"{self.what}: a traced graph without output")

    def _arg(self, a, env):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, list | tuple):
            return [self._arg(x, env) for x in a]
        if a is None or isinstance(
            a, torch.dtype | torch.device | torch.layout | torch.memory_format
        ):
            return a
        return _literal(a)

    def _call(self, node, env):
        op = node.target.__name__.split(".")[0]
        args = [self._arg(a, env) for a in node.args]
        kwargs = {k: self._arg(a, env) for k, a in node.kwargs.items()}
        if op == "arange":
            return _BATCH
        if op in ("index", "select"):
            return self._index(op, args, node)
        if any(isinstance(a, View) for a in args):
            raise Unsupported(
                f"{self.what} computes with a whole captured tensor ({op}); index it "
                f"down to one element first (bias[h, q_idx - kv_idx])"
            )
        kind = _kind_of(node)
        text = self._expression(op, args, kwargs, node)
        name = self._name("v")
        self.lines.append(f"{name} = {_CAST[kind].format(text)}")
        return Expr(name, kind)

    def _expression(self, op, args, kwargs, node) -> str:
        texts = [a.text if isinstance(a, Expr) else a for a in args]
        if op in _IDENTITY or op == "_to_copy" or op == "to" or op == "copy":
            return texts[0] if op != "copy" else texts[1]
        if op in _CONSTANT:
            value = args[-1] if op in ("full_like", "full", "new_full") else args[0]
            if op in ("ones_like", "zeros_like", "new_ones", "new_zeros"):
                value = _literal(1 if "ones" in op else 0)
            return value.text
        if op in _UNARY:
            return _UNARY[op].format(texts[0])
        if op in ("add", "sub", "rsub"):
            alpha = kwargs.get("alpha")
            other = texts[1] if alpha is None else f"({alpha.text} * {texts[1]})"
            if op == "rsub":
                return f"({other} - {texts[0]})"
            return f"({texts[0]} {'+' if op == 'add' else '-'} {other})"
        if op == "div" and "rounding_mode" in kwargs:
            mode = node.kwargs["rounding_mode"]
            if mode == "floor":
                return f"({texts[0]} // {texts[1]})"
            if mode == "trunc":
                return f"math.trunc({texts[0]} / {texts[1]})"
        if op in _BINARY:
            return _BINARY[op].format(*texts[:2])
        if op in _BITWISE or op == "bitwise_not":
            boolean = all(a.kind == "b" for a in args if isinstance(a, Expr))
            if op == "bitwise_not":
                return f"(not {texts[0]})" if boolean else f"(~{texts[0]})"
            if boolean:
                return _BINARY["logical_" + op.split("_")[1]].format(*texts)
            return f"({texts[0]} {_BITWISE[op]} {texts[1]})"
        if op == "where":
            return f"({texts[1]} if {texts[0]} else {texts[2]})"
        if op == "masked_fill":
            return f"({texts[2]} if {texts[1]} else {texts[0]})"
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo = args[1] if op in ("clamp", "clamp_min") and len(args) > 1 else None
            hi = args[2] if op == "clamp" and len(args) > 2 else None
            lo, hi = kwargs.get("min", lo), kwargs.get("max", hi)
            if op == "clamp_max":
                hi = args[1]
            text = texts[0]
            if lo is not None:
                text = f"max({text}, {lo.text})"
            if hi is not None:
                text = f"min({text}, {hi.text})"
            return text
        raise Unsupported(
            f"{self.what} uses torch's {node.target}, which flashtile cannot compile into "
            f"its kernels: mods may use elementwise arithmetic, comparisons, torch.where, "
            f"clamp, abs, exp/log, tanh/sigmoid/erf, floor/ceil/round, and captured tensors "
            f"indexed by b, h, q_idx, kv_idx"
        )

    def _index(self, op, args, node):
        src = args[0]
        if op == "select":
            dim, idx = node.args[1], args[2]
            if isinstance(src, Expr):  # vmap's batch dim of a scalar
                return src
            if dim != 0 or src.batched:
                raise Unsupported(f"{self.what} selects dim {dim} of a captured tensor")
            return self._extend(src, [idx], node)
        if not isinstance(src, View):
            raise Unsupported(f"{self.what} indexes a computed value; index captured tensors")
        indices = list(args[1])
        if src.batched:
            if not indices or indices[0] is not _BATCH:
                raise Unsupported(f"{self.what} indexes a captured tensor in an unusual way")
            indices = indices[1:]
        if any(i is None or i is _BATCH or i.kind == "f" for i in indices):
            raise Unsupported(
                f"{self.what} indexes a captured tensor with slices, floats or masks: index "
                f"each dim by an integer (b, h, q_idx, kv_idx or arithmetic on them)"
            )
        return self._extend(src, indices, node)

    def _extend(self, view: View, indices, node):
        index = view.index + tuple(i.text for i in indices)
        tensor = self.tables[view.table].tensor
        if len(index) < tensor.dim():
            return View(view.table, index, True)
        offset = self._name("o")
        self.lines.append(f"{offset} = 0")
        strides = _c_strides(tensor.shape)
        for dim, (text, size) in enumerate(zip(index, tensor.shape, strict=True)):
            if text in SCORE_INPUTS[1:]:  # b, h, q_idx or kv_idx: never negative
                self.direct.add((text, size))
                self.lines.append(f"{offset} += {text} * {strides[dim]}")
                continue
            t = self._name("t")
            # No branch that stores: a flag store inside the row loop made
            # it 10-20x slower. Out of range is noted in ``bad`` (the loop
            # sets the flag once) and the index clamped to a safe read.
            self.lines += [
                f"{t} = {text}",
                f"{t} = {t} + {size} if {t} < 0 else {t}",
                f"bad = bad | ({t} < 0) | ({t} >= {size})",
                f"{t} = min(max({t}, 0), {size - 1})",
                f"{offset} += {t} * {strides[dim]}",
            ]
        name = self._name("r")
        table = self.tables[view.table]
        where = "F" if table.kind == "f" else "I"
        value = f"{where}[np.uintp(T{view.table} + {offset})]"  # unsigned: no wraparound test
        kind = _kind(tensor.dtype)
        self.lines.append(f"{name} = {_CAST[kind].format(value)}")
        self.reads.append((name, view.table, offset))
        self.read_nodes.append(node)
        return Expr(name, kind)


def _c_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _kind_of(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _kind(val.dtype)
    if isinstance(val, bool):
        return "b"
    return "i" if isinstance(val, int) else "f"


def _one(value, dtype):
    return torch.tensor([value], dtype=dtype)


def _indices():
    return tuple(_one(n, torch.int32) for n in (0, 0, 0, 0))


def _trace(fn, args, what):
    """``make_fx`` of ``fn`` with PyTorch's core decompositions, dead code removed."""
    from torch._decomp import core_aten_decompositions

    try:
        gm = make_fx(fn, decomposition_table=core_aten_decompositions())(*args)
    except Unsupported:
        raise
    except Exception as exc:  # make_fx's data-dependent errors and the user's own
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


def trace_mods(score_mod, mask_mod) -> TracedMods:
    """Trace and translate a pair of torch mods (either may be None)."""
    key = (score_mod, mask_mod)
    cached = _lookup(key)
    if cached is not None:
        return cached
    translator = Translator("score_mod/mask_mod")
    functions, kinds = [], []
    if score_mod is not None:
        functions += _score_functions(score_mod, translator)
        kinds += ["score", "score_grad"]
        if any(translator.tables[t].tensor.requires_grad for _, t, _ in translator.reads):
            kinds.append("capture")
    if mask_mod is not None:
        functions.append(_mask_function(mask_mod, translator))
        kinds.append("mask")
    n_floats, n_ints = _layout(translator.tables)
    offsets = "".join(f"T{n} = {t.offset}\n" for n, t in enumerate(translator.tables))
    traced = TracedMods(
        offsets + "\n".join(functions), tuple(kinds), translator.tables, n_floats, n_ints,
        tuple(sorted(translator.direct)),
    )  # fmt: skip
    _store(key, traced)
    return traced


def _layout(tables) -> tuple[int, int]:
    """Place the tables in the float and int buffers (int slot 0 is the flag)."""
    n_floats, n_ints = 0, 1
    for t in tables:
        if t.kind == "f":
            t.offset, n_floats = n_floats, n_floats + t.tensor.numel()
        else:
            t.offset, n_ints = n_ints, n_ints + t.tensor.numel()
    return max(n_floats, 1), n_ints


def _function(header: str, lines, result: str) -> str:
    """A scalar function of :mod:`flashtile.mods`: ``lines``, then ``return
    result, bad`` (``bad``: a captured table was indexed out of range)."""
    body = "".join(f"    {line}\n" for line in ["bad = False", *lines])
    return (
        f"@njit(inline='always', error_model='numpy')\ndef {header}:\n{body}"
        f"    return {result}, bad\n"
    )


def _score_functions(score_mod, tr: Translator) -> list[str]:
    """``_score``, ``_score_grad`` and ``_score_capture`` (see :mod:`flashtile.mods`)."""
    gm = _trace(torch.vmap(score_mod), (_one(0.0, torch.float32), *_indices()), "score_mod")
    tr.lines = []
    value = _one_output(tr.translate(gm, SCORE_INPUTS), "f", "score_mod")
    forward_lines, reads, nodes = tr.lines, list(tr.reads), list(tr.read_nodes)
    # The derivative by x and by the reads of captured float tensors that require grad.
    wanted = [
        n for n, (_, t, _) in enumerate(reads)
        if tr.tables[t].kind == "f" and tr.tables[t].tensor.requires_grad
    ]  # fmt: skip
    grad_lines, grads, gvalue = _derivative(gm, nodes, reads, wanted, tr)
    tr.lines = []
    score = _function("_score(x, b, h, qi, kv, F, I)", forward_lines, value.text)
    both = _function(
        "_score_grad(x, b, h, qi, kv, F, I)", forward_lines + grad_lines,
        f"{gvalue.text}, {grads[0].text}",
    )  # fmt: skip
    scatter = [
        f"G[T{reads[n][1]} + {reads[n][2]}] += g * {grads[1 + m].text}"
        for m, n in enumerate(wanted)
    ]
    capture = _function(
        "_score_capture(x, g, b, h, qi, kv, F, I, G)", forward_lines + grad_lines + scatter,
        "0",
    )  # fmt: skip
    return [score, both, capture]


def _sample(table: Table):
    """A value of one element of ``table``'s dtype, to trace with."""
    dtype = table.tensor.dtype
    if table.kind == "f":
        return _one(0.5, torch.float32)
    return _one(False, torch.bool) if dtype == torch.bool else _one(0, torch.int64)


def _derivative(gm, read_nodes, reads, wanted, tr: Translator):
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
    samples = [_sample(tr.tables[t]) for _, t, _ in reads]
    fn = torch.func.grad_and_value(with_reads, argnums=argnums)
    ggm = _trace(fn, (_one(0.0, torch.float32), *samples, *_indices()), "score_mod's derivative")
    saved, tr.lines = tr.lines, []
    read_exprs = [Expr(name, _kind(tr.tables[t].tensor.dtype)) for name, t, _ in reads]
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


def _mask_function(mask_mod, tr: Translator) -> str:
    gm = _trace(torch.vmap(mask_mod), _indices(), "mask_mod")
    tr.lines = []
    value = _one_output(tr.translate(gm, MASK_INPUTS), "b", "mask_mod")
    lines, tr.lines = tr.lines, []
    return _function("_mask(b, h, qi, kv, F, I)", lines, value.text)


def _lookup(key):
    score_mod, mask_mod = key
    try:
        entry = _TRACED.get(score_mod if score_mod is not None else mask_mod)
    except TypeError:
        return None
    return entry.get(key) if entry else None


def _store(key, traced):
    holder = key[0] if key[0] is not None else key[1]
    with contextlib.suppress(TypeError):  # not weak-referenceable: traced again next time
        _TRACED.setdefault(holder, {})[key] = traced


def compile_mods(traced: TracedMods) -> Mods:
    """The :class:`Mods` of traced mods: the module compiled (or loaded from
    the disk cache) and the tables' current values copied into its buffers."""
    source = module_source(traced.source, traced.kinds, traced.n_floats, traced.n_ints, True)
    namespace = compiled_module(source, cache_dir() / "mods")
    floats = np.zeros(traced.n_floats)
    ints = np.zeros(traced.n_ints, dtype=np.int64)
    for t in traced.tables:
        flat = t.tensor.detach().reshape(-1)
        if t.kind == "f":
            floats[t.offset : t.offset + flat.numel()] = flat.double().numpy()
        else:
            ints[t.offset : t.offset + flat.numel()] = flat.long().numpy()
    return Mods(
        traced.kinds, floats, ints, namespace, label="score_mod/mask_mod", limits=traced.limits
    )

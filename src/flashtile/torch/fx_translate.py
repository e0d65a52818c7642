"""Traced FX graphs of torch mods translated into Python over scalars.

:mod:`.flex_trace` traces a mod into a graph of a few elementwise ATen
operations and reads of captured tensors (under ``torch.vmap``, on a batch
of one). :class:`Translator` turns each node into one line of Python that
Numba compiles: arithmetic, comparisons, ``math`` functions and reads of
captured tensors, which become flat tables (:class:`Table`) read at a
computed offset. An operation it does not know raises :class:`Unsupported`
(a ``TypeError``) that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
    "rsqrt": "(WORK(1.0) / math.sqrt({0}))",
    "reciprocal": "(WORK(1.0) / {0})",
    "sin": "math.sin({0})",
    "cos": "math.cos({0})",
    "tan": "math.tan({0})",
    "tanh": "tanh_pair({0})[0]",  # (float32: vectorised, unlike libm's; float64: libm)
    "erf": "math.erf({0})",
    "erfc": "math.erfc({0})",
    "sigmoid": "(WORK(1.0) / (WORK(1.0) + math.exp(-{0})))",
    "floor": "np.floor({0})",  # (math.floor gives an int64: wrong for inf, NaN, 1e30)
    "ceil": "np.ceil({0})",
    "trunc": "np.trunc({0})",
    "round": "np.rint({0})",  # half to even, as torch
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
    made: bool = False  # made by the mod's own code (torch.tensor(7)), not captured


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


def dtype_kind(dtype: torch.dtype) -> str:
    """A value's kind in the generated code: "f" (the work float, ``WORK``:
    float32 or float64), "i" (int64) or "b" (bool)."""
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
            return Expr("WORK(math.nan)", "f")
        if math.isinf(value):
            return Expr("WORK(math.inf)" if value > 0 else "WORK(-math.inf)", "f")
        return Expr(f"WORK({value!r})", "f")
    raise Unsupported(f"a constant {value!r} of type {type(value).__name__}")


#: How the literal 1 is written (an int, or a float of the work dtype).
_ONES = ("1", "WORK(1)", "WORK(1.0)")
_ONE = Expr("1", "i")
_CAST = {"f": "WORK({0})", "i": "int({0})", "b": "bool({0})"}
#: Operations whose result is a bool whatever their arguments.
_PREDICATES = {
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "logical_not", "isnan",
}  # fmt: skip
_ORDER = {"b": 0, "i": 1, "f": 2}
#: Arithmetic whose integer or bool operands become the work float first
#: when its result is a float (torch's promotion: an int64 tensor times a
#: float32 one is float32; Numba's scalars would widen to float64).
_PROMOTING = {
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder",
    "maximum", "minimum",
}  # fmt: skip


def _natural_kind(op, args) -> str:
    """The kind the generated expression of ``op`` has before its cast."""
    if op in _PREDICATES:
        return "b"
    if op in _UNARY and op not in ("neg", "abs", "sign", "sgn"):
        return "f"
    kinds = [a.kind for a in args if isinstance(a, Expr)]
    if op in ("copy",) and len(kinds) > 1:
        kinds = kinds[1:]
    if op in ("where", "masked_fill") and kinds:
        kinds = kinds[1:] if op == "where" else [kinds[0], *kinds[2:]]
    return max(kinds, key=_ORDER.get) if kinds else "f"


def _cast(text: str, natural: str, kind: str) -> str:
    """``text`` (of kind ``natural``) as ``kind``: Numba has no float(bool)."""
    if natural == "b" and kind != "b":
        one, zero = ("WORK(1.0)", "WORK(0.0)") if kind == "f" else ("1", "0")
        return f"({one} if {text} else {zero})"
    return _CAST[kind].format(text)


class Translator:
    """Translates traced graphs into lines of Python over scalars; the
    captured tensors of every graph it translates share one table list.

    This class writes for Numba (scalars, ``math``, NumPy's scalar
    functions); a subclass writes another dialect by replacing the op
    tables and the few methods below that spell an operation
    (:mod:`flashtile.triton.mod_source` writes Triton, over tiles).
    """

    UNARY = _UNARY
    BINARY = _BINARY

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
        # value name -> its argument, for tanh values ("square NAME" for t*t)
        self._tanhs: dict[str, Expr] = {}

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def table(self, tensor: torch.Tensor, made: bool = False) -> int:
        for n, t in enumerate(self.tables):
            if t.tensor is tensor:
                return n
        kind = "f" if tensor.dtype.is_floating_point else "i"
        if tensor.is_complex():
            raise Unsupported(f"{self.what} captures a complex tensor")
        self.tables.append(Table(tensor, kind, made=made))
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
                tensor = getattr(gm, node.target)
                # torch.tensor(...) in the mod's code: a constant lifted into the graph
                made = any(u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users)
                view = View(self.table(tensor, made), (), False)
                # a 0-d tensor (a learned temperature) is one element already
                env[node] = self._extend(view, [], node) if tensor.dim() == 0 else view
            elif node.op == "call_function":
                env[node] = self._call(node, env)
            elif node.op == "output":
                flat, _ = torch.utils._pytree.tree_flatten(node.args[0])
                return [env[n] if isinstance(n, torch.fx.Node) else self.literal(n) for n in flat]
        raise Unsupported(f"{self.what}: a traced graph without output")

    def _arg(self, a, env):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, list | tuple):
            return [self._arg(x, env) for x in a]
        if a is None or isinstance(
            a, str | torch.dtype | torch.device | torch.layout | torch.memory_format
        ):
            return a  # (a string: div's rounding_mode)
        return self.literal(a)

    def _call(self, node, env):
        op = node.target.__name__.split(".")[0]
        if op.endswith("_") and not op.endswith("__"):  # in place (derivative graphs): the same
            op = op[:-1]
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
        if kind == "f" and op in _PROMOTING:
            args = [self.promote(a) if isinstance(a, Expr) else a for a in args]
        text = self._tanh_derivative(op, args, kwargs) or self._expression(op, args, kwargs, node)
        name = self._name("v")
        self.lines.append(f"{name} = {self.cast(text, _natural_kind(op, args), kind)}")
        if op == "tanh":
            self._tanhs[name] = args[0]
        elif op == "mul" and args[0] == args[1] and args[0].text in self._tanhs:
            self._tanhs[f"square {name}"] = self._tanhs[args[0].text]
        return Expr(name, kind)

    def _tanh_derivative(self, op, args, kwargs) -> str | None:
        """``1 - t*t`` of ``t = tanh(a)`` (torch's derivative of tanh) as
        :meth:`tanh_derivative` writes it, or None for any other operation."""
        if op not in ("sub", "rsub") or len(args) != 2 or kwargs.get("alpha", _ONE) != _ONE:
            return None
        one, square = args if op == "sub" else args[::-1]
        ok = all(isinstance(x, Expr) for x in args) and one.text in _ONES
        a = self._tanhs.get(f"square {square.text}") if ok else None
        return None if a is None else self.tanh_derivative(a)

    def _expression(self, op, args, kwargs, node) -> str:
        texts = [a.text if isinstance(a, Expr) else a for a in args]
        if op in _IDENTITY or op == "_to_copy" or op == "to" or op == "copy":
            return texts[0] if op != "copy" else texts[1]
        if op in _CONSTANT:
            value = args[-1] if op in ("full_like", "full", "new_full") else args[0]
            if op in ("ones_like", "zeros_like", "new_ones", "new_zeros"):
                value = self.literal(1 if "ones" in op else 0)
            return value.text
        if op == "round" and "decimals" in kwargs:  # torch: round(x * 10**d) / 10**d
            scale = repr(10.0 ** node.kwargs["decimals"])
            return f"({self.UNARY['round'].format(f'({texts[0]} * {scale})')} / {scale})"
        if op in self.UNARY:
            return self.unary(op, args[0])
        if op in ("add", "sub", "rsub"):
            alpha = kwargs.get("alpha")
            other = texts[1] if alpha is None else f"({alpha.text} * {texts[1]})"
            if op == "rsub":
                return f"({other} - {texts[0]})"
            return f"({texts[0]} {'+' if op == 'add' else '-'} {other})"
        if op == "div" and "rounding_mode" in kwargs:
            mode = node.kwargs["rounding_mode"]
            if mode == "floor":
                return self.binary("floor_divide", args[0], args[1])
            if mode == "trunc":
                return self.UNARY["trunc"].format(f"({texts[0]} / {texts[1]})")
        if op == "pow":
            return self.power(args[0], args[1])
        if op == "fmod":
            return self.fmod(args[0], args[1])
        if op in self.BINARY:
            return self.binary(op, args[0], args[1])
        if op in _BITWISE or op == "bitwise_not":
            boolean = all(a.kind == "b" for a in args if isinstance(a, Expr))
            if op == "bitwise_not":
                return self.UNARY["logical_not"].format(texts[0]) if boolean else f"(~{texts[0]})"
            if boolean:
                return self.BINARY["logical_" + op.split("_")[1]].format(*texts)
            return f"({texts[0]} {_BITWISE[op]} {texts[1]})"
        if op == "where":
            return self.where(texts[0], texts[1], texts[2])
        if op == "masked_fill":
            return self.where(texts[1], texts[2], texts[0])
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo = args[1] if op in ("clamp", "clamp_min") and len(args) > 1 else None
            hi = args[2] if op == "clamp" and len(args) > 2 else None
            lo, hi = kwargs.get("min", lo), kwargs.get("max", hi)
            if op == "clamp_max":
                hi = args[1]
            text = texts[0]
            if lo is not None:
                text = self.BINARY["maximum"].format(text, lo.text)
            if hi is not None:
                text = self.BINARY["minimum"].format(text, hi.text)
            return text
        raise Unsupported(
            f"{self.what} uses torch's {node.target}, which flashtile cannot compile into "
            f"its kernels: mods may use elementwise arithmetic, comparisons, torch.where, "
            f"clamp, abs, exp/log, tanh/sigmoid/erf, floor/ceil/round, and captured tensors "
            f"indexed by b, h, q_idx, kv_idx"
        )

    # The spelling of operations (the Numba dialect; subclasses replace them).

    def literal(self, value) -> Expr:
        """A Python constant as a value."""
        return _literal(value)

    def cast(self, text: str, natural: str, kind: str) -> str:
        """``text`` (of kind ``natural``) as a value of ``kind``."""
        return _cast(text, natural, kind)

    def unary(self, op: str, a: Expr) -> str:
        return self.UNARY[op].format(a.text)

    def binary(self, op: str, a: Expr, b: Expr) -> str:
        return self.BINARY[op].format(a.text, b.text)

    def promote(self, a: Expr) -> Expr:
        """An operand of float arithmetic as the work float (torch's
        promotion of an integer or bool operand)."""
        return a if a.kind == "f" else Expr(self.cast(a.text, a.kind, "f"), "f")

    def tanh_derivative(self, a: Expr) -> str | None:
        """``1 - tanh(a)**2`` without the cancellation of ``1 - t*t`` (in
        float32 it is 0 from ``|a|`` 9 on), or None to keep ``1 - t*t``."""
        return f"tanh_pair({a.text})[1]"

    def where(self, cond: str, a: str, b: str) -> str:
        return f"({a} if {cond} else {b})"

    def either(self, a: str, b: str) -> str:
        """``a or b`` of bools, without a branch."""
        return f"({a} | {b})"

    def power(self, a: Expr, b: Expr) -> str:
        if a.kind == "f" or b.kind == "f":
            # (Numba's float ** int raises on 0 ** -n, numpy error model or not)
            return f"np.power(float({a.text}), float({b.text}))"
        return self.BINARY["pow"].format(a.text, b.text)

    def fmod(self, a: Expr, b: Expr) -> str:
        """C's remainder (the dividend's sign); Numba's np.fmod of ints is not."""
        if a.kind != "f" and b.kind != "f":
            return f"({a.text} - {b.text} * math.trunc({a.text} / {b.text}))"
        return f"np.fmod({a.text}, {b.text})"

    #: The parameters of the function that adds a captured table's gradient.
    CAPTURE_PARAMS = "x, g, b, h, qi, kv, F, I, G"

    def function(self, name: str, params: str, lines, result: str) -> str:
        """A scalar function of :mod:`flashtile.mods`: ``lines``, then ``return
        result, bad`` (``bad``: a captured table was indexed out of range)."""
        body = "".join(f"    {line}\n" for line in ["bad = False", *lines])
        return (
            f"@njit(inline='always', error_model='numpy')\ndef {name}({params}):\n{body}"
            f"    return {result}, bad\n"
        )

    def scatter(self, table: int, offset: str, grad: str) -> str:
        """The line adding ``g * grad`` to the gradient of a captured element."""
        return f"G[T{table} + {offset}] += g * {grad}"

    def constants(self, names, values) -> str:
        """Module-level integer constants (the tables' offsets)."""
        return "".join(f"{n} = {v}\n" for n, v in zip(names, values, strict=True))

    #: Whether a dim indexed by ``b``, ``h``, ``q_idx`` or ``kv_idx`` itself
    #: skips the per-element check (the call's extent is checked once).
    DIRECT = True

    def load(self, buffer: str, table: int, offset: str, kind: str) -> str:
        """Read element ``offset`` of table ``table`` from the float (``"f"``)
        or int buffer, as a value of ``kind``."""
        where = "F" if buffer == "f" else "I"
        return _CAST[kind].format(f"{where}[np.uintp(T{table} + {offset})]")  # (no wraparound)

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
        self.lines.append(f"{offset} = {self.literal(0).text}")
        strides = _c_strides(tensor.shape)
        for dim, (text, size) in enumerate(zip(index, tensor.shape, strict=True)):
            if self.DIRECT and text in SCORE_INPUTS[1:]:  # b, h, q_idx or kv_idx: never negative
                self.direct.add((text, size))
                self.lines.append(f"{offset} += {text} * {strides[dim]}")
                continue
            t = self._name("t")
            low = self.BINARY["maximum"].format(t, 0)
            # No branch that stores: a flag store inside the row loop kept it
            # scalar (docs/design.md, performance notes). Out of range is noted
            # in ``bad`` (the loop sets the flag once), the index clamped.
            self.lines += [
                f"{t} = {text}",
                f"{t} = {self.where(f'{t} < 0', f'{t} + {size}', t)}",
                f"bad = {self.either('bad', self.either(f'({t} < 0)', f'({t} >= {size})'))}",
                f"{t} = {self.BINARY['minimum'].format(low, size - 1)}",
                f"{offset} += {t} * {strides[dim]}",
            ]
        name = self._name("r")
        table = self.tables[view.table]
        kind = dtype_kind(tensor.dtype)
        self.lines.append(f"{name} = {self.load(table.kind, view.table, offset, kind)}")
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
        return dtype_kind(val.dtype)
    if isinstance(val, bool):
        return "b"
    return "i" if isinstance(val, int) else "f"

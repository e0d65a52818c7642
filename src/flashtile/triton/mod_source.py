"""Torch mods as Triton functions over tiles, for the GPU kernels.

The same traced graphs as the CPU kernels' (:mod:`flashtile.torch.flex_trace`),
written in another dialect of :class:`~flashtile.torch.fx_translate.Translator`:
each value is a tile (or a 0-d tensor), ``x`` a ``(BLOCK_M, BLOCK_N)``
float32 score tile, ``b``/``h`` int32 scalars, ``qi`` a ``(BLOCK_M, 1)`` and
``kv`` a ``(1, BLOCK_N)`` int32 tile; float values are float32. Captured
tables are read from a float32 and an int64 buffer on the inputs' device
(:class:`TritonMods`), every index clamped to its table (an index out of
range is noted in ``bad``, which the kernels reduce into the int buffer's
slot 0 over the tile's valid elements).

The functions: ``_score(x, b, h, qi, kv, F, I) -> (y, bad)``,
``_score_grad(...) -> (y, dy/dx, bad)``, ``_score_capture(x, g, b, h, qi, kv,
F, I, G, ok) -> (0, bad)`` (adds ``g * dy/d element`` to ``G``, laid out like
``F``, with atomic adds where ``ok``) and ``_mask(b, h, qi, kv, F, I) ->
(keep, bad)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..mods import compiled_module
from ..route_cache import cache_dir
from ..torch.flex_trace import TracedMods, check_tables_on, trace_mods
from ..torch.fx_translate import Expr, Translator, Unsupported

_FLOAT_UNARY = {
    "exp": "tl.exp({0})",
    "exp2": "tl.exp2({0})",
    "expm1": "expm1({0})",
    "log": "tl.log({0})",
    "log2": "tl.log2({0})",
    "log10": "(tl.log2({0}) * 0.30102999566398120)",
    "log1p": "log1p({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})",
    "reciprocal": "(1.0 / {0})",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "tan": "(tl.sin({0}) / tl.cos({0}))",
    "tanh": "tanh({0})",
    "erf": "tl.erf({0})",
    "erfc": "(1.0 - tl.erf({0}))",
    "sigmoid": "tl.sigmoid({0})",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    "trunc": "trunc({0})",
    "round": "rint({0})",
}
# The operators Python spells alike for scalars and tiles come from the
# Numba dialect's tables; the rest is Triton's.
_UNARY = {
    **Translator.UNARY,
    **_FLOAT_UNARY,
    "abs": "tl.abs({0})",
    "sign": "(tl.where({0} > 0, 1, 0) - tl.where({0} < 0, 1, 0))",
    "sgn": "(tl.where({0} > 0, 1, 0) - tl.where({0} < 0, 1, 0))",
    "logical_not": "({0} == 0)",
}
_BINARY = {
    **Translator.BINARY,
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    # (by tl.where: the interpreter mishandles & and | between a tile and a 0-d tensor)
    "logical_and": "tl.where({0} != 0, {1} != 0, False)",
    "logical_or": "tl.where({0} != 0, True, {1} != 0)",
    "logical_xor": "(({0} != 0) != ({1} != 0))",
    # (kind-dependent: written by TritonTranslator.binary)
    "floor_divide": None,
    "remainder": None,
    "pow": None,
}
_TYPES = {"f": "tl.float32", "i": "tl.int32", "b": "tl.int1"}

PRELUDE = """
import triton.language as tl

from flashtile.triton.elementwise import (
    device_fn, expm1, float_floordiv, int_floordiv, log1p, power, remainder, rint, tanh, trunc,
)
"""


class TritonTranslator(Translator):
    """The Triton dialect: tiles, ``tl`` functions, casts by ``.to``."""

    UNARY = _UNARY
    BINARY = _BINARY
    DIRECT = False  # padded rows and keys reach past the call's extent: always clamp
    CAPTURE_PARAMS = "x, g, b, h, qi, kv, F, I, G, ok"

    def literal(self, value) -> Expr:
        plain = super().literal(value)
        if plain.kind == "f":
            text = repr(float(value)) if math.isfinite(value) else f'float("{value}")'
        else:
            text = repr(value)
        dtype = _TYPES[plain.kind]
        if plain.kind == "i" and not -(2**31) <= value < 2**31:
            dtype = "tl.int64"
        return Expr(f"tl.full([], {text}, {dtype})", plain.kind)

    def cast(self, text: str, natural: str, kind: str) -> str:
        if kind == "b":
            return f"(({text}) != 0)"
        return f"({text}).to({_TYPES[kind]})"

    def unary(self, op: str, a: Expr) -> str:
        text = a.text if a.kind == "f" or op not in _FLOAT_UNARY else f"({a.text}).to(tl.float32)"
        return self.UNARY[op].format(text)

    def binary(self, op: str, a: Expr, b: Expr) -> str:
        ints = a.kind != "f" and b.kind != "f"
        if op == "floor_divide":
            fn = "int_floordiv" if ints else "float_floordiv"
            return f"{fn}({a.text}, {b.text})" if ints else f"{fn}({self._f(a)}, {self._f(b)})"
        if op == "remainder":
            texts = (a.text, b.text) if ints else (self._f(a), self._f(b))
            return f"remainder({texts[0]}, {texts[1]})"
        if op == "pow":
            return self.power(a, b)
        return self.BINARY[op].format(a.text, b.text)

    def promote(self, a: Expr) -> Expr:
        return a  # (Triton promotes an integer operand of float arithmetic itself)

    def tanh_derivative(self, a: Expr) -> None:
        return None  # (1 - t*t, as torch's GPU kernels)

    def where(self, cond: str, a: str, b: str) -> str:
        return f"tl.where({cond}, {a}, {b})"

    def either(self, a: str, b: str) -> str:
        return f"tl.where({a}, True, {b})"

    def power(self, a: Expr, b: Expr) -> str:
        if a.kind == "f" or b.kind == "f":
            return f"power(({a.text}).to(tl.float32), ({b.text}).to(tl.float32))"
        raise Unsupported(
            f"{self.what} raises an integer to an integer power, which the Triton kernels do "
            f"not compile: multiply, or use float operands"
        )

    def fmod(self, a: Expr, b: Expr) -> str:
        # (Triton's % is C's fmod: the dividend's sign, exact for floats)
        if a.kind != "f" and b.kind != "f":
            return f"({a.text} % {b.text})"
        return f"({self._f(a)} % {self._f(b)})"

    @staticmethod
    def _f(a: Expr) -> str:
        return a.text if a.kind == "f" else f"({a.text}).to(tl.float32)"

    def load(self, buffer: str, table: int, offset: str, kind: str) -> str:
        where = "F" if buffer == "f" else "I"
        return self.cast(f"tl.load({where} + (T{table} + {offset}))", buffer, kind)

    def function(self, name: str, params: str, lines, result: str) -> str:
        body = "".join(f"    {line}\n" for line in ["bad = qi < 0", *lines])
        return f"@device_fn\ndef {name}({params}):\n{body}    return {result}, bad\n"

    def scatter(self, table: int, offset: str, grad: str) -> str:
        # (the offset may be a scalar or a row or column: broadcast to the tile)
        return f"tl.atomic_add(G + (T{table} + {offset} + qi * 0 + kv * 0), g * {grad}, mask=ok)"

    def constants(self, names, values) -> str:
        return "".join(f"{n} = tl.constexpr({v})\n" for n, v in zip(names, values, strict=True))


@dataclass(eq=False)
class TritonMods:
    """A pair of mods compiled for the Triton kernels.

    Attributes:
        score, score_grad, capture, mask: the functions (None where absent;
            ``capture`` only when a captured float table requires grad).
        floats: float32 ``(n_floats,)`` and ints: int64 ``(n_ints,)`` buffers
            of the captured tables on the inputs' device (``ints[0]``: the
            out-of-range flag).
        traced: what tracing gave (the tables, for the gradients).
    """

    score: object
    score_grad: object
    capture: object
    mask: object
    floats: torch.Tensor
    ints: torch.Tensor
    traced: TracedMods

    def clear_flag(self) -> None:
        self.ints[:1].zero_()

    def check_flag(self) -> None:
        """Raise if a mod indexed a captured table out of range during the call."""
        if int(self.ints[0]):
            self.clear_flag()
            raise IndexError(
                "score_mod/mask_mod indexed a captured tensor out of its range (b, h, q_idx or "
                "kv_idx reached past a table's size): size the table for every index the call "
                "passes"
            )

    def table_grads(self, grads: torch.Tensor) -> list:
        """The gradients of the captured tables that require grad, from the
        float buffer's gradient ``grads`` (None for the others)."""
        out = []
        for t in self.traced.tables:
            if t.kind == "f" and t.tensor.requires_grad:
                part = grads[t.offset : t.offset + t.tensor.numel()]
                out.append(part.reshape(t.tensor.shape).to(t.tensor.dtype))
            else:
                out.append(None)
        return out


def triton_mods(score_mod, mask_mod, device) -> TritonMods:
    """Trace ``score_mod``/``mask_mod`` (either may be None) into Triton
    functions (the module cached on disk by its source, like the CPU
    kernels' mods) and copy the tables they capture to ``device``."""
    traced = trace_mods(score_mod, mask_mod, None, TritonTranslator, device)
    names = compiled_module(PRELUDE + traced.source, cache_dir() / "mods")
    floats = torch.zeros(traced.n_floats, dtype=torch.float32, device=device)
    ints = torch.zeros(traced.n_ints, dtype=torch.int64, device=device)
    check_tables_on(traced, device)
    for t in traced.tables:
        flat = t.tensor.detach().reshape(-1).to(device)
        target = floats if t.kind == "f" else ints
        target[t.offset : t.offset + flat.numel()] = flat.to(target.dtype)

    def get(kind, name):
        return names[name] if kind in traced.kinds else None

    return TritonMods(
        get("score", "_score"), get("score_grad", "_score_grad"),
        get("capture", "_score_capture"), get("mask", "_mask"), floats, ints, traced,
    )  # fmt: skip

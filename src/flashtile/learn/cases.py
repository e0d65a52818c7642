"""The graded cases of every exercise, with expected values from flashtile itself.

Expected values come from the library's reference (``flashtile.softmax``,
``online_softmax``, ``online_attention``, ``tiled_attention``,
``reference.online_update``, ``attention_memory_elements``), so the lab and
the library can never disagree. Inputs are seeded and small: the whole
catalogue runs in well under a second for a correct solution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import flashtile as ft
from flashtile.reference import online_update as ref_update


@dataclass(frozen=True)
class Stream:
    """Instrument argument ``arg`` of a case: at most ``block_size`` rows per operation."""

    arg: int
    label: str
    block_size: int
    mode: str  # "reductions" (a score row) or "everything" (K, V)
    unit: str = "rows"


@dataclass(frozen=True)
class Case:
    """One graded call of the learner's function ``func``.

    ``make`` builds the arguments; ``expect`` maps them to the expected result
    (an array, a tuple of arrays named by ``labels``, a dict or an int).
    ``drive``, when set, calls the learner's function itself (several times).
    """

    name: str
    func: str
    make: Callable[[], tuple]
    expect: Callable[..., Any]
    labels: tuple[str, ...] = ()
    streams: tuple[Stream, ...] = ()
    drive: Callable[..., Any] | None = None
    meta: dict = field(default_factory=dict)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# --------------------------------------------------------------- online_softmax


def _softmax_case(name, x, block_size, stream=False):
    x = np.asarray(x, dtype=np.float64)
    streams = (Stream(0, "x", block_size, "reductions", "entries"),) if stream else ()
    return Case(
        name,
        "online_softmax",
        lambda: (x.copy(), block_size),
        lambda x, b: ft.online_softmax(x, b),
        streams=streams,
    )


def _online_softmax_cases() -> list[Case]:
    later = np.concatenate([_rng(1).uniform(-1, 1, 9), [6.0, 0.5]])
    return [
        _softmax_case("seed example: logits near 1000, block_size=2", [1000, 1001, 1002], 2),
        _softmax_case("seed example: max grows 1 -> 5 -> 9, block_size=2", [0, 1, 5, 2, 9], 2),
        _softmax_case("max appears only in a later block (n=11, block_size=3)", later, 3),
        _softmax_case("block_size=1 (n=7)", _rng(2).standard_normal(7), 1),
        _softmax_case("block_size divides n (n=12, block_size=4)", _rng(3).standard_normal(12), 4),
        _softmax_case("block_size larger than n (n=5, block_size=8)", _rng(4).normal(size=5), 8),
        _softmax_case("logits near 1000, uneven blocks", 1000 + 5 * _rng(5).random(10), 3),
        _softmax_case("logits near -1000, uneven blocks", -1000 - 5 * _rng(6).random(10), 4),
        # Spreads beyond ~709 (where exp overflows or underflows to 0): only
        # a *running* max over every block seen so far survives these.
        _softmax_case("a later logit 800 above the first (block_size=1)", [0.0, 800.0, 1.0], 1),
        _softmax_case(
            "the first block 800 above every later one (block_size=2)",
            [800.0, 1.0, 0.0, -5.0, 3.0],
            2,
        ),
        _softmax_case(
            "streaming: no whole-row max or sum (n=12, block_size=3)",
            np.concatenate([_rng(7).standard_normal(10), [4.0, 1.0]]),
            3,
            stream=True,
        ),
    ]


# ------------------------------------------------------------ attention helpers


def _qkv(seed, n_q, n_k, d, d_v, scale=1.0):
    rng = _rng(seed)
    return (
        scale * rng.standard_normal((n_q, d)),
        scale * rng.standard_normal((n_k, d)),
        rng.standard_normal((n_k, d_v)),
    )


def _kv_streams(block_size, names):
    """K and V instrumented, named as the exercise's signature names them."""
    return (
        Stream(1, names[0], block_size, "everything"),
        Stream(2, names[1], block_size, "everything"),
    )


def _attention_case(name, func, qkv, block_size, causal, stream=False):
    q, k, v = qkv

    def expect(q, k, v, b):
        return ft.tiled_attention(q, k, v, block_size=b, causal=causal)

    return Case(
        name,
        func,
        lambda: (q.copy(), k.copy(), v.copy(), block_size),
        expect,
        streams=_kv_streams(block_size, ("k", "v") if causal else ("K", "V")) if stream else (),
    )


def _spread_scores(seed, last: bool):
    """Q, K, V (d=4, n_k=7) where one key scores about 800 above the rest for
    every query: the last key (the running max must move) or the first (it
    must stay)."""
    q, k, v = _qkv(seed, 2, 7, 4, 3)
    q[:, 0] = 40.0
    k[:, 0] = 0.0
    k[-1 if last else 0, 0] = 40.0  # scores 40 * 40 / sqrt(4) = 800 for that key
    return q, k, v


def _online_attention_cases() -> list[Case]:
    def case(name, qkv, b, stream=False):
        return _attention_case(name, "online_attention", qkv, b, False, stream)

    q, k, v = _qkv(18, 2, 9, 4, 3)
    k = 0.1 * k
    k[-1] = 3.0 * q[0]  # row 0's only large score is the very last key
    spread = _spread_scores(46, last=True)
    spread_first = _spread_scores(47, last=False)
    return [
        case("small example (n_q=2, n_k=4, d=3, block_size=2)", _qkv(11, 2, 4, 3, 3), 2),
        case("block_size=1", _qkv(12, 3, 5, 4, 4), 1),
        case("block_size divides n_k (n_k=8, block_size=4)", _qkv(13, 3, 8, 4, 4), 4),
        case("block_size larger than n_k (n_k=5, block_size=16)", _qkv(14, 3, 5, 4, 4), 16),
        case("n_q != n_k (n_q=3, n_k=10, block_size=4)", _qkv(15, 3, 10, 4, 4), 4),
        case("d != d_v (d=4, d_v=6, n_k=7, block_size=3)", _qkv(16, 4, 7, 4, 6), 3),
        case("scores near 1000 (scaled Q and K)", _qkv(17, 3, 7, 4, 3, scale=22.0), 3),
        case("a row whose max is only in the last block (n_k=9, block_size=4)", (q, k, v), 4),
        case("a last key scoring 800 above the others (n_k=7, block_size=3)", spread, 3),
        case("a first key scoring 800 above the others (n_k=7, block_size=3)", spread_first, 3),
        case("streaming: K and V read block by block", _qkv(19, 3, 10, 4, 3), 3, stream=True),
    ]


def _causal_cases() -> list[Case]:
    def case(name, qkv, b, stream=False):
        return _attention_case(name, "causal_tiled_attention", qkv, b, True, stream)

    return [
        case("T=5, block_size=2 (uneven last block)", _qkv(21, 5, 5, 3, 3), 2),
        case("block_size=1 (T=6)", _qkv(22, 6, 6, 4, 4), 1),
        case("block_size divides T (T=8, block_size=4)", _qkv(23, 8, 8, 4, 4), 4),
        case("block_size larger than T (T=5, block_size=16)", _qkv(24, 5, 5, 4, 4), 16),
        case("T=11, block_size=4, d != d_v (d=4, d_v=6)", _qkv(25, 11, 11, 4, 6), 4),
        case("scores near 1000, uneven blocks (T=9, block_size=4)", _qkv(26, 9, 9, 4, 3, 22.0), 4),
        case("streaming: k and v read block by block", _qkv(27, 10, 10, 4, 3), 3, stream=True),
    ]


# ------------------------------------------------------------------ stable_rows


def _stable_cases() -> list[Case]:
    def case(name, x):
        x = np.asarray(x, dtype=np.float64)
        return Case(name, "stable_softmax", lambda: (x.copy(),), ft.softmax)

    shifted = _rng(31).standard_normal((3, 5)) + np.array([[0.0], [500.0], [-500.0]])
    return [
        case("a small row [1, 2, 3]", [1.0, 2.0, 3.0]),
        case("logits near 1000 (exp would overflow)", [1000.0, 1001.0, 1002.0, 999.0]),
        case("logits near -1000 (exp would underflow to 0/0)", [-1000.0, -1001.0, -1003.0]),
        case("several rows at very different scales (3 x 5)", shifted),
        case("masked entries (-inf) in a row", [[0.0, -np.inf, 1.0], [-np.inf, 2.0, 2.0]]),
        case("a row of equal values", [7.0, 7.0, 7.0, 7.0]),
    ]


# ---------------------------------------------------------------- online_update


def _expected_update(m, ell, acc, scores, values):
    m_new, ell_new, rescale, p = ref_update(m, ell, scores)
    return m_new, ell_new, acc * rescale[:, None] + p @ values


def _state(seed, n, d_v, m_shift):
    """A consistent running state: the summary of some random earlier scores."""
    rng = _rng(seed)
    old = rng.standard_normal((n, 4)) + m_shift
    m = old.max(axis=1)
    p = np.exp(old - m[:, None])
    return m, p.sum(axis=1), p @ rng.standard_normal((4, d_v))


def _update_cases() -> list[Case]:
    labels = ("m_new", "ell_new", "acc_new")

    def case(name, args):
        return Case(
            name,
            "online_update",
            lambda: tuple(a.copy() for a in args),
            _expected_update,
            labels=labels,
        )

    rng = _rng(41)
    empty = (np.full(3, -np.inf), np.zeros(3), np.zeros((3, 2)))
    blk = rng.standard_normal((3, 4))
    vals = rng.standard_normal((4, 2))
    low = _state(42, 3, 2, m_shift=-3.0)
    high = _state(43, 3, 2, m_shift=+5.0)
    big = _state(44, 2, 3, m_shift=1000.0)
    big_blk = 1000.0 + 4 * rng.standard_normal((2, 3))
    return [
        case("first block from the empty state (m=-inf, ell=0, acc=0)", (*empty, blk, vals)),
        case("a later block with a larger max (old state must shrink)", (*low, blk, vals)),
        case("a later block with a smaller max", (*high, blk, vals)),
        case("scores near 1000", (*big, big_blk, rng.standard_normal((3, 3)))),
        case("one query row, a block of one key", (*(a[:1] for a in low), blk[:1, :1], vals[:1])),
        _fold_case(labels),
    ]


def _fold_case(labels) -> Case:
    """Drive the learner's update over uneven blocks and compare with dense attention."""
    q, k, v = _qkv(45, 4, 11, 3, 2, scale=3.0)
    bounds = [(0, 3), (3, 4), (4, 9), (9, 11)]

    def drive(fn, q, k, v):
        m, ell, acc = np.full(len(q), -np.inf), np.zeros(len(q)), np.zeros((len(q), v.shape[1]))
        for start, stop in bounds:
            scores = q @ k[start:stop].T / np.sqrt(q.shape[1])
            m, ell, acc = _unpack(fn(m, ell, acc, scores, v[start:stop]))
        return np.asarray(acc) / np.asarray(ell)[:, None]

    return Case(
        "folding uneven blocks (3, 1, 5, 2 keys) gives attention: acc / ell",
        "online_update",
        lambda: (q.copy(), k.copy(), v.copy()),
        lambda q, k, v: ft.naive_attention(q, k, v)[0],
        drive=drive,
    )


class ShapeProblem(Exception):
    """The learner returned something of the wrong kind (reported, not a crash)."""


def _unpack(result):
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise ShapeProblem(
            f"online_update must return (m_new, ell_new, acc_new); got {_describe(result)}"
        )
    return result


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of length {len(value)}"
    return repr(value) if value is None else f"a {type(value).__name__}"


# --------------------------------------------------------------- memory_scaling


def _memory_cases() -> list[Case]:
    def elements(name, T):
        return Case(name, "memory_elements", lambda: (T,), ft.attention_memory_elements)

    def nbytes(name, *args):
        return Case(name, "score_matrix_bytes", lambda: args, lambda t, h, b: t * t * h * b)

    return [
        elements("memory_elements(4096): the chapter's numbers", 4096),
        elements("memory_elements(1)", 1),
        elements("memory_elements(1000)", 1000),
        nbytes("score_matrix_bytes(32768, 32, 2): 32k tokens, 32 heads, fp16", 32768, 32, 2),
        nbytes("score_matrix_bytes(4096, 1, 4): one head in fp32", 4096, 1, 4),
    ]


CASES: dict[str, Callable[[], list[Case]]] = {
    "online_softmax": _online_softmax_cases,
    "online_attention": _online_attention_cases,
    "stable_rows": _stable_cases,
    "online_update": _update_cases,
    "memory_scaling": _memory_cases,
    "causal_tiled": _causal_cases,
}

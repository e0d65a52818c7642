"""An HBM-traffic model of the FlashAttention argument (printed by ``flashtile io``).

The model has two memories: a large slow HBM holding every ``N x d`` matrix and
an on-chip SRAM of ``M`` elements. It counts the elements that cross between
them, per HBM array, for one attention head:

- **standard** attention (the FlashAttention paper's Algorithm 0) writes
  ``S = Q K^T`` and ``P = softmax(S)`` to HBM and reads them back;
- **tiled** attention loads tiles of ``Br`` query rows and ``Bc`` key rows into
  SRAM and keeps ``S``/``P`` on chip. The counts come from running the loop
  nest and adding up every tile it loads or stores, so edge tiles (``N`` not a
  multiple of a block) are counted exactly.

Block sizes follow the paper: ``Bc = ceil(M / (4 d))`` key rows, so ``K_j``
and ``V_j`` fill about half of the SRAM, and ``Br = min(Bc, d)`` query rows.
The loop orders are

- ``"kv-outer"`` (FlashAttention, Algorithm 1): for each key/value tile, visit
  every query tile and read and write back its ``O_i, l_i, m_i``;
- ``"q-outer"`` (FlashAttention-2): for each query tile, stream every key/value
  tile and write ``O_i`` and the log-sum-exp once. The resident (outer) tile
  gets the large block here, ``Br = ceil(M / (4 d))``, ``Bc = min(Br, d)``:
  with the paper's ``Br <= d`` the query-outer traffic would be ``~2 N^2`` for
  every ``M`` (pass ``blocks=`` to see it).

Closed forms in elements (the constants are this model's):

- standard forward ``4 N^2 + 4 N d``: S and P are each written once and read
  once, Q, K, V read and O written once (exact);
- standard backward ``7 N^2 + 8 N d``: P read twice, dP written and read,
  dS written and read twice (exact);
- tiled ``c N^2 d^2 / M`` over ``Tc ~ N / Bc = 4 N d / M`` passes: ``c = 12``
  kv-outer forward (each pass reads Q, O and writes O), ``c = 8`` q-outer
  (reads K, V), ``c = 20`` backward (reads Q, O, dO, dQ, writes dQ).

The tiled forms are leading terms: they drop the one-pass ``O(N d)`` traffic
and the ``O(N)`` statistics, so simulated / closed form is near 1 when the
loop makes many passes (``M << N d``) and grows when it makes only a few.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .._validate import check_block_size

ORDERS = ("kv-outer", "q-outer")

#: Leading-term constants ``c`` of the tiled closed forms ``c * N^2 d^2 / M``.
TILED_CONSTANTS = {"kv-outer": 12, "q-outer": 8, "backward": 20}


@dataclass(frozen=True)
class IOCount:
    """HBM traffic of one attention head.

    Attributes:
        reads, writes: elements moved HBM -> SRAM and SRAM -> HBM.
        bytes_per_element: storage size of one element (4 for float32).
        by_array: ``{name: (reads, writes)}`` in elements per HBM array, in
            first-touch order (``"Q"``, ``"S"``, ``"l"``, ``"dQ"``, ...).
    """

    reads: int
    writes: int
    bytes_per_element: int = 4
    by_array: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Elements moved in both directions."""
        return self.reads + self.writes

    @property
    def read_bytes(self) -> int:
        return self.reads * self.bytes_per_element

    @property
    def write_bytes(self) -> int:
        return self.writes * self.bytes_per_element

    @property
    def total_bytes(self) -> int:
        return self.total * self.bytes_per_element


class Blocks(NamedTuple):
    """Tile shape: ``br`` query rows by ``bc`` key rows."""

    br: int
    bc: int


class _Tally:
    """Accumulates ``[reads, writes]`` per HBM array while a loop nest runs."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def read(self, name: str, elements: int) -> None:
        self.counts.setdefault(name, [0, 0])[0] += elements

    def write(self, name: str, elements: int) -> None:
        self.counts.setdefault(name, [0, 0])[1] += elements

    def result(self, bytes_per_element: int) -> IOCount:
        rows = {name: (r, w) for name, (r, w) in self.counts.items()}
        reads, writes = (sum(col) for col in zip(*rows.values(), strict=True))
        return IOCount(reads, writes, bytes_per_element, rows)


def check_sizes(n, d, bytes_per_element) -> tuple[int, int, int]:
    """``(n, d, bytes_per_element)`` as positive ints; ValueError naming the bad one."""
    return (
        check_block_size(n, "N (sequence length)"),
        check_block_size(d, "d (head dim)"),
        check_block_size(bytes_per_element, "bytes_per_element"),
    )


def check_sram(sram, d: int) -> int:
    """``sram`` as a positive int that holds one row of Q, K, V and O (``M >= 4 d``)."""
    sram = check_block_size(sram, "M (SRAM size in elements)")
    if sram < 4 * d:
        raise ValueError(
            f"an SRAM of M={sram} elements cannot hold one row each of Q, K, V and O "
            f"(4*d = {4 * d} elements at d={d}): give M >= {4 * d}"
        )
    return sram


def paper_blocks(d: int, sram: int) -> Blocks:
    """The FlashAttention paper's tile shape for head dim ``d`` and ``sram`` elements.

    ``Bc = ceil(M / (4 d))`` key rows and ``Br = min(Bc, d)`` query rows.
    Raises ValueError when ``M < 4 d`` (not even one row of each operand fits).
    """
    d = check_block_size(d, "d (head dim)")
    bc = math.ceil(check_sram(sram, d) / (4 * d))
    return Blocks(br=min(bc, d), bc=bc)


def default_blocks(d: int, sram: int, order: str = "kv-outer") -> Blocks:
    """Paper blocks for ``"kv-outer"``; for ``"q-outer"`` the two roles swapped."""
    blocks = paper_blocks(d, sram)
    if _check_order(order) == "q-outer":
        return Blocks(br=blocks.bc, bc=blocks.br)  # the resident query tile gets the big block
    return blocks


def _check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


def _resolve_blocks(blocks, d: int, sram: int, order: str) -> Blocks:
    if blocks is None:
        return default_blocks(d, sram, order)
    try:
        br, bc = blocks
    except (TypeError, ValueError):
        raise ValueError(f"blocks must be a pair (Br, Bc), got {blocks!r}") from None
    return Blocks(check_block_size(br, "Br"), check_block_size(bc, "Bc"))


def tile_sizes(n: int, block: int) -> list[int]:
    """Rows of each tile when ``n`` rows are cut into tiles of ``block``; the last may be short."""
    full, rest = divmod(n, block)
    return [block] * full + ([rest] if rest else [])


#: Standard attention as steps of (arrays read, arrays written), each array whole.
#: Forward: the paper's Algorithm 0. Backward: its Algorithm 3, with P saved by the
#: forward: dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)); dQ = dS K; dK = dS^T Q.
STANDARD_STEPS = {
    "forward": ((("Q", "K"), ("S",)), (("S",), ("P",)), (("P", "V"), ("O",))),
    "backward": (
        (("P", "dO"), ("dV",)),
        (("dO", "V"), ("dP",)),
        (("P", "dP"), ("dS",)),
        (("dS", "K"), ("dQ",)),
        (("dS", "Q"), ("dK",)),
    ),
}
_SQUARE = frozenset({"S", "P", "dP", "dS"})  # the N x N arrays; all others are N x d


def _standard_io(pass_: str, n: int, d: int, bytes_per_element: int) -> IOCount:
    n, d, bpe = check_sizes(n, d, bytes_per_element)
    t = _Tally()
    for reads, writes in STANDARD_STEPS[pass_]:
        for name in reads:
            t.read(name, n * n if name in _SQUARE else n * d)
        for name in writes:
            t.write(name, n * n if name in _SQUARE else n * d)
    return t.result(bpe)


#: Most tile pairs a simulation visits (about half a second of Python); beyond it the
#: loop nest is refused rather than left running for minutes.
MAX_TILE_PAIRS = 250_000


def _tiles(n: int, br: int, bc: int) -> tuple[list[int], list[int]]:
    """Query and key/value tile sizes, refusing nests too large to simulate."""
    q_tiles, kv_tiles = tile_sizes(n, br), tile_sizes(n, bc)
    pairs = len(q_tiles) * len(kv_tiles)
    if pairs > MAX_TILE_PAIRS:
        raise ValueError(
            f"simulating N={n} with {br} x {bc} tiles visits {pairs:,} tile pairs "
            f"(limit {MAX_TILE_PAIRS:,}): use a larger M or closed_forms()"
        )
    return q_tiles, kv_tiles


def standard_forward_io(n: int, d: int, bytes_per_element: int = 4) -> IOCount:
    """HBM traffic of standard attention's forward: ``4 N^2 + 4 N d`` elements.

    Read Q, K, write S; read S, write P; read P, V, write O
    (:data:`STANDARD_STEPS`). No SRAM size enters: every intermediate makes
    a full round trip through HBM whatever fits on chip.
    """
    return _standard_io("forward", n, d, bytes_per_element)


def standard_backward_io(n: int, d: int, bytes_per_element: int = 4) -> IOCount:
    """HBM traffic of standard attention's backward: ``7 N^2 + 8 N d`` elements.

    Reads the ``N x N`` P saved by the forward, writes and rereads dP and dS
    (dS twice, for dQ and for dK); see :data:`STANDARD_STEPS`.
    """
    return _standard_io("backward", n, d, bytes_per_element)


def tiled_forward_io(
    n: int,
    d: int,
    sram: int,
    order: str = "kv-outer",
    blocks=None,
    bytes_per_element: int = 4,
) -> IOCount:
    """HBM traffic of the tiled forward, simulated tile by tile.

    Args:
        n, d: sequence length and head dim (Q, K, V, O are ``n x d``).
        sram: SRAM size ``M`` in elements (at least ``4 d``).
        order: ``"kv-outer"`` (Algorithm 1: ``O_i, l_i, m_i`` go to HBM and
            back on every key/value pass, after an initial zero-fill) or
            ``"q-outer"`` (FlashAttention-2: ``Q_i`` loaded once, ``O_i`` and
            the log-sum-exp ``L_i`` written once, K and V streamed per query tile).
        blocks: ``(Br, Bc)`` to override :func:`default_blocks`.
        bytes_per_element: for the byte counts.
    """
    n, d, bpe = check_sizes(n, d, bytes_per_element)
    sram = check_sram(sram, d)
    order = _check_order(order)
    br, bc = _resolve_blocks(blocks, d, sram, order)
    q_tiles, kv_tiles = _tiles(n, br, bc)
    t = _Tally()
    if order == "kv-outer":
        t.write("O", n * d)  # Algorithm 1 zero-fills O, l and sets m = -inf in HBM first
        t.write("l", n)
        t.write("m", n)
        for cols in kv_tiles:
            t.read("K", cols * d)
            t.read("V", cols * d)
            for rows in q_tiles:
                for name, size in (("Q", rows * d), ("O", rows * d), ("l", rows), ("m", rows)):
                    t.read(name, size)
                for name, size in (("O", rows * d), ("l", rows), ("m", rows)):
                    t.write(name, size)
    else:
        for rows in q_tiles:
            t.read("Q", rows * d)
            for cols in kv_tiles:  # O_i, l_i, m_i stay on chip across this loop
                t.read("K", cols * d)
                t.read("V", cols * d)
            t.write("O", rows * d)
            t.write("L", rows)  # log-sum-exp, all the backward needs
    return t.result(bpe)


def tiled_backward_io(
    n: int, d: int, sram: int, blocks=None, bytes_per_element: int = 4
) -> IOCount:
    """HBM traffic of the tiled backward by recomputation (Algorithm 4), simulated.

    dQ, dK, dV are zero-filled in HBM; for each key/value tile ``j`` (K_j, V_j
    read, dK_j, dV_j accumulated on chip and written once at the end) every
    query tile reads ``Q_i, O_i, dO_i, dQ_i, l_i, m_i``, recomputes ``P_ij``
    on chip and writes ``dQ_i`` back. No ``N x N`` array touches HBM.
    ``blocks`` overrides :func:`paper_blocks` as ``(Br, Bc)``.
    """
    n, d, bpe = check_sizes(n, d, bytes_per_element)
    sram = check_sram(sram, d)
    br, bc = _resolve_blocks(blocks, d, sram, "kv-outer")
    q_tiles, kv_tiles = _tiles(n, br, bc)
    t = _Tally()
    for name in ("dQ", "dK", "dV"):
        t.write(name, n * d)
    for cols in kv_tiles:
        t.read("K", cols * d)
        t.read("V", cols * d)
        for rows in q_tiles:
            for name in ("Q", "O", "dO", "dQ"):
                t.read(name, rows * d)
            t.read("l", rows)
            t.read("m", rows)
            t.write("dQ", rows * d)
        t.write("dK", cols * d)
        t.write("dV", cols * d)
    return t.result(bpe)


def closed_forms(n: int, d: int, sram: int) -> dict[str, float]:
    """The closed forms of the module table, in elements.

    Keys: ``standard_forward``, ``standard_backward`` (exact),
    ``tiled_forward`` (kv-outer), ``tiled_forward_q_outer``, ``tiled_backward``
    (leading terms ``c N^2 d^2 / M`` with ``c`` from :data:`TILED_CONSTANTS`).
    """
    n, d, _ = check_sizes(n, d, 1)
    sram = check_sram(sram, d)
    pass_term = n * n * d * d / sram
    return {
        "standard_forward": 4 * n * n + 4 * n * d,
        "standard_backward": 7 * n * n + 8 * n * d,
        "tiled_forward": TILED_CONSTANTS["kv-outer"] * pass_term,
        "tiled_forward_q_outer": TILED_CONSTANTS["q-outer"] * pass_term,
        "tiled_backward": TILED_CONSTANTS["backward"] * pass_term,
    }


# ---- flashtile io: the table -------------------------------------------------

_SRAM_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "KIB": 2**10, "MIB": 2**20}


def parse_sram(text: str, bytes_per_element: int = 4) -> int:
    """SRAM size in elements from ``"65536"`` (elements) or ``"100KB"``/``"64KiB"``/``"512B"``.

    Byte sizes (KB = 1000, KiB = 1024 bytes) are divided by ``bytes_per_element``
    and rounded down: a partial element holds nothing.
    """
    raw = text.strip().replace(" ", "")
    number = raw.rstrip("KkMmIiBb")
    unit = raw[len(number) :].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if value <= 0 or (unit and unit not in _SRAM_UNITS) or (not unit and value != int(value)):
        raise ValueError(
            f"--sram {text!r}: give elements (e.g. 65536) or bytes with a unit "
            f"(e.g. 100KB, 64KiB, 512B)"
        )
    if not unit:
        return int(value)
    return int(value * _SRAM_UNITS[unit]) // check_block_size(
        bytes_per_element, "bytes per element"
    )

"""The exercises of ``flashtile learn``: statements, starter files and hints.

Two come from the coding exercise the project started from
(``online_softmax``, ``online_attention``), four from the textbook chapter's
exercises 26.1 to 26.4. Statements are written for this lab; the graded cases
live in :mod:`flashtile.learn.cases` and the reference solutions in
:mod:`flashtile.learn.solutions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Exercise:
    """One lab exercise: what to write, a file to start from, hints in order."""

    name: str
    source: str  # where it comes from: "seed" or "26.x"
    summary: str
    statement: str
    starter: str
    hints: tuple[str, ...]

    @property
    def solution(self) -> str:
        """Source of the reference solution (it passes ``learn check``)."""
        return resources.files("flashtile.learn.solutions").joinpath(f"{self.name}.py").read_text()


_ONLINE_SOFTMAX = Exercise(
    name="online_softmax",
    source="seed",
    summary="softmax of a vector in one streaming pass (running max and running sum)",
    statement="""\
Write online_softmax(x, block_size) for a 1-D float array x.

Walk over x in consecutive blocks of block_size entries (the last block may be
shorter). Carry only two numbers from block to block: the largest score seen
so far, m, and the sum of exp(score - m) over everything seen so far, ell.
Start from m = -inf and ell = 0. When a block brings a larger maximum, the
old sum was measured against the old m, so multiply it by exp(m_old - m_new)
before adding the new block's terms. After the last block, one elementwise
pass gives the answer: exp(x - m) / ell.

Requirements:
  * the result has the shape of x and sums to 1;
  * every block_size (1, a divisor of len(x), larger than len(x)) gives the
    same answer;
  * logits around 1000 must not overflow;
  * it must stream: no max or sum over the whole row at once. The checker
    hands you an instrumented array and reports "does not stream" if any
    reduction reads more than block_size entries.

Examples:
  online_softmax(np.array([1000.0, 1001.0, 1002.0]), 2) -> [0.09, 0.2447, 0.6652]
  online_softmax(np.array([0.0, 1.0, 5.0, 2.0, 9.0]), 2)
      -> [0.0001, 0.0003, 0.018, 0.0009, 0.9807]   (the max goes 1 -> 5 -> 9)
""",
    starter='''\
"""Exercise online_softmax: a streaming softmax (flashtile learn)."""

import numpy as np


def online_softmax(x, block_size):
    """Softmax of the 1-D array ``x``, visiting ``block_size`` entries at a time.

    Keep a running max ``m`` and a running sum ``ell`` of ``exp(x_i - m)``;
    rescale the sum when the max grows. Return ``exp(x - m) / ell``.
    """
    raise NotImplementedError("online_softmax")
''',
    hints=(
        "Start with m = -np.inf and ell = 0.0, and loop "
        "`for start in range(0, len(x), block_size)` over `x[start:start + block_size]`.",
        "For each block: m_new = max(m, block.max()). The old sum is measured against m, "
        "so it becomes ell * np.exp(m - m_new); exp(-inf) is 0, so the first block needs "
        "no special case.",
        "Then add the block's own terms, np.exp(block - m_new).sum(), and set m = m_new. "
        "Forgetting the rescale only shows up when a later block has a larger max.",
        "After the loop return np.exp(x - m) / ell. Do not call x.max() or a sum over the "
        "whole row: that is the two-pass softmax the exercise replaces.",
    ),
)

_ONLINE_ATTENTION = Exercise(
    name="online_attention",
    source="seed",
    summary="exact attention over key blocks without forming the score matrix",
    statement="""\
Write online_attention(Q, K, V, block_size) returning softmax(Q K^T / sqrt(d)) V.

Shapes: Q (n_q, d), K (n_k, d), V (n_k, d_v); the result is (n_q, d_v).
Visit the keys in blocks of block_size (the last one may be shorter). For
every query row keep three running quantities: the max score m (n_q,), the
normaliser ell (n_q,) and an unnormalised output acc (n_q, d_v). For one
block K_b, V_b:
  scores = Q @ K_b.T / sqrt(d)              (n_q, B)
  raise m to include the block's row maxima; the factor exp(m_old - m_new)
  shrinks both ell and acc, which were measured against the old max;
  p = exp(scores - m_new); ell += row sums of p; acc += p @ V_b.
Divide acc by ell once, after the last block.

Requirements: any block_size gives the same answer; n_q may differ from n_k
and d from d_v; huge scores must not overflow; and it must stream: the
checker instruments K and V and reports "does not stream" if any operation
reads more than block_size keys at once (for example Q @ K.T).
""",
    starter='''\
"""Exercise online_attention: FlashAttention's forward pass (flashtile learn)."""

import numpy as np


def online_attention(Q, K, V, block_size):
    """``softmax(Q K^T / sqrt(d)) V`` computed over blocks of ``block_size`` keys.

    Q is (n_q, d), K is (n_k, d), V is (n_k, d_v); return an (n_q, d_v) array.
    Keep a running max, normaliser and unnormalised output per query row.
    """
    raise NotImplementedError("online_attention")
''',
    hints=(
        "Set up m = np.full(n_q, -np.inf), ell = np.zeros(n_q), acc = np.zeros((n_q, d_v)) "
        "and loop over `K[start:start + block_size]`, `V[start:start + block_size]`.",
        "scores = Q @ K_b.T / np.sqrt(d) has shape (n_q, B); its row maxima are "
        "scores.max(axis=1). m_new = np.maximum(m, that).",
        "alpha = np.exp(m - m_new) rescales the old state: ell = ell * alpha + p.sum(axis=1) "
        "and acc = acc * alpha[:, None] + p @ V_b, with p = np.exp(scores - m_new[:, None]).",
        "Return acc / ell[:, None] after the loop. Never write Q @ K.T: that is the full "
        "score matrix the algorithm exists to avoid.",
    ),
)

_STABLE_ROWS = Exercise(
    name="stable_rows",
    source="26.1",
    summary="a numerically stable softmax over the rows of an array",
    statement="""\
Exercise 26.1, stable rows. Write stable_softmax(x): the softmax along the
last axis of a 1-D or 2-D float array (each row on its own).

Computing exp(x) directly overflows to inf for logits near 1000 and
underflows to 0 (then 0/0) for logits near -1000. Softmax does not change
when the same constant is subtracted from every entry of a row, so shift each
row by its own maximum first: the largest term becomes exp(0) = 1 and the sum
is at least 1. Entries equal to -inf are masked and get probability 0 (each
graded row has at least one finite entry).

Think about: the shift is the row maximum. In the online version the maximum
is not known until the row ends; why must it be remembered and updated, and
what happens to terms already summed against an older maximum?
""",
    starter='''\
"""Exercise 26.1 (stable_rows): a numerically stable softmax (flashtile learn)."""

import numpy as np


def stable_softmax(x):
    """Softmax along the last axis of ``x`` (1-D or 2-D) that never overflows.

    Rows with very large or very negative logits must still sum to 1;
    ``-inf`` entries get probability 0.
    """
    raise NotImplementedError("stable_softmax")
''',
    hints=(
        "softmax(x) equals softmax(x - c) for any constant c added to the whole row.",
        "Take m = x.max(axis=-1, keepdims=True): keepdims keeps a (rows, 1) shape that "
        "broadcasts back against x for 1-D and 2-D input alike.",
        "e = np.exp(x - m); return e / e.sum(axis=-1, keepdims=True).",
    ),
)

_ONLINE_UPDATE = Exercise(
    name="online_update",
    source="26.2",
    summary="derive the online update, numerator included: fold one block into the state",
    statement="""\
Exercise 26.2, derive the online update. Write
online_update(m, ell, acc, scores, values) -> (m_new, ell_new, acc_new).

The state of n query rows after some key blocks: m (n,) the largest score
seen, ell (n,) the sum of exp(s - m) over those scores, acc (n, d_v) the sum
of exp(s - m) * v over the same keys (the numerator). A new block brings
scores (n, B) and the matching values (B, d_v). Return the state that covers
the old keys and the new block together. An empty state is m = -inf,
ell = 0, acc = 0.

Derivation to do on paper first: split the new normaliser into the old keys
and the block, and write each term exp(s - m_new) as exp(s - m_old) times
exp(m_old - m_new). The old sum is ell, so it scales by one factor. The same
factor scales the numerator, because every term of acc carries the same
exp(s - m_old). The checker also folds your update over uneven blocks and
compares acc / ell with dense attention.
""",
    starter='''\
"""Exercise 26.2 (online_update): one step of the online softmax (flashtile learn)."""

import numpy as np


def online_update(m, ell, acc, scores, values):
    """Fold one block of ``scores`` (n, B) and ``values`` (B, d_v) into the state.

    ``m`` (n,) running max, ``ell`` (n,) running normaliser, ``acc`` (n, d_v)
    unnormalised output. Return ``(m_new, ell_new, acc_new)``.
    """
    raise NotImplementedError("online_update")
''',
    hints=(
        "m_new = np.maximum(m, scores.max(axis=1)).",
        "The old terms were exp(s - m); against m_new they are exp(s - m) * exp(m - m_new). "
        "Call that factor alpha = np.exp(m - m_new) (0 for an empty row, since m = -inf).",
        "p = np.exp(scores - m_new[:, None]); ell_new = ell * alpha + p.sum(axis=1).",
        "acc_new = acc * alpha[:, None] + p @ values: the numerator uses the same alpha.",
    ),
)

_MEMORY = Exercise(
    name="memory_scaling",
    source="26.3",
    summary="count score storage: T x T for naive attention vs O(T) row state",
    statement="""\
Exercise 26.3, memory scaling. Write two small functions.

memory_elements(T) returns a dict with two integer entries:
  "naive_scores": how many scores dense attention stores for T tokens (one
                  score per query-key pair, for one head);
  "online_state": how many entries one running statistic (for example the
                  running max) needs in the tiled forward pass: one per query.
At T = 4096 the first is 16,777,216 and the second 4096; flashtile's own
flashtile.attention_memory_elements(T) gives the same numbers.

score_matrix_bytes(T, heads, bytes_per_element) returns the bytes of the
full score matrices of all heads, e.g. for the follow-up question: 32k tokens,
32 heads, fp16 (2 bytes). Compare the answer with the memory of a GPU.

Think about: why is the tiled state O(T) and not O(T * block_size)?
""",
    starter='''\
"""Exercise 26.3 (memory_scaling): storage of naive vs tiled attention (flashtile learn)."""


def memory_elements(T):
    """``{"naive_scores": ..., "online_state": ...}`` element counts for ``T`` tokens."""
    raise NotImplementedError("memory_elements")


def score_matrix_bytes(T, heads, bytes_per_element):
    """Bytes of the ``T x T`` score matrices of ``heads`` heads."""
    raise NotImplementedError("score_matrix_bytes")
''',
    hints=(
        "Every query has a score against every key: T queries times T keys.",
        "The tiled pass keeps one running max (and one normaliser, one output row) per "
        "query, so one statistic needs T entries.",
        "score_matrix_bytes is T * T * heads * bytes_per_element; return Python ints.",
    ),
)

_CAUSAL = Exercise(
    name="causal_tiled",
    source="26.4",
    summary="tiled causal attention, correct for uneven block sizes",
    statement="""\
Exercise 26.4, tiled causal attention. Write
causal_tiled_attention(q, k, v, block_size) for self-attention: q, k (T, d),
v (T, d_v), result (T, d_v). Query i may attend to keys 0..i only.

Start from the online attention loop (exercise online_attention) and, inside
each key block, set the scores of future keys (key index > query index) to
-inf before the block's maxima and exponentials. Take care: a query meets
blocks where every key is in its future. Their scores are all -inf, so the
block's own maximum is -inf, and exponentiating against it gives
exp(-inf - (-inf)) = NaN. Exponentiate against the running maximum over all
blocks so far instead (finite from the first block on: every query sees key
0); such a block then adds exp(-inf) = 0 and leaves the row's state as it was.

The checker compares with flashtile.tiled_attention(..., causal=True) for
block sizes that do and do not divide T, block size 1 and larger than T,
d != d_v and huge scores, and it instruments k and v: no operation may read
more than block_size keys at once.
""",
    starter='''\
"""Exercise 26.4 (causal_tiled): tiled causal attention (flashtile learn)."""

import numpy as np


def causal_tiled_attention(q, k, v, block_size):
    """Causal ``softmax(q k^T / sqrt(d)) v`` over blocks of ``block_size`` keys.

    q and k are (T, d), v is (T, d_v); query i sees keys 0..i. Return (T, d_v).
    """
    raise NotImplementedError("causal_tiled_attention")
''',
    hints=(
        "Positions: q_pos = np.arange(T)[:, None] and k_pos = np.arange(start, stop)[None, :]; "
        "a key is visible when k_pos <= q_pos.",
        "scores = np.where(k_pos <= q_pos, scores, -np.inf) before taking the block maxima.",
        "A row whose whole block is masked has a block maximum of -inf: never exponentiate "
        "against the block's own max. Against the running max, m_new = np.maximum(m, "
        "scores.max(axis=1)), it is harmless: np.exp(scores - m_new[:, None]) is 0 there. "
        "(m_new is finite from the first block on, since every query sees key 0; where a row "
        "may have seen no key yet, use base = np.where(np.isfinite(m_new), m_new, 0.0).)",
        "Every query sees at least key 0, so ell > 0 at the end: return acc / ell[:, None].",
    ),
)

EXERCISES: dict[str, Exercise] = {
    ex.name: ex
    for ex in (_ONLINE_SOFTMAX, _ONLINE_ATTENTION, _STABLE_ROWS, _ONLINE_UPDATE, _MEMORY, _CAUSAL)
}

#: Other names a learner may type: the chapter's numbers.
ALIASES = {"26.1": "stable_rows", "26.2": "online_update", "26.3": "memory_scaling"}
ALIASES["26.4"] = "causal_tiled"


def lookup(name: str) -> Exercise:
    """The exercise called ``name`` (or its chapter number); KeyError with the choices."""
    key = ALIASES.get(name, name)
    if key not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; choose one of: {', '.join(EXERCISES)}")
    return EXERCISES[key]

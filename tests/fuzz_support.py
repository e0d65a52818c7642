"""Shared pieces of the fuzz tests: hostile-but-fair draws and the verdict on a call.

Every fuzzed call must either raise ``ValueError``/``TypeError`` with a
message naming one of its arguments, or give what the float64 dense oracle
gives, except where the NaN/inf policy (README "Semantics") allows anything:
rows whose query holds NaN/inf, and every row once a key or value that
padding does not hide holds NaN/inf.

Each argument is hostile (a wrong type, a bad size, an odd dtype) in about
one draw of ``ODDS + 1``, so about half the calls go through and are checked
against the oracle; fair but extreme values (huge scales and magnitudes,
NaN/inf entries, empty batches) are drawn more often.

Budget: the default is a small, derandomised run that fits ``make test``;
``FLASHTILE_FUZZ=long`` (``make fuzz``) runs ``LONG_FACTOR`` times as many
examples with fresh randomness, and shrinks a failure (about 6 minutes on 2
cores; ``FLASHTILE_FUZZ_FACTOR`` changes the factor).
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

LONG = os.environ.get("FLASHTILE_FUZZ") == "long"
LONG_FACTOR = int(os.environ.get("FLASHTILE_FUZZ_FACTOR", "12"))


def fuzz_settings(small: int) -> settings:
    """Hypothesis settings: ``small`` examples (derandomised, not shrunk: each
    example calls compiled kernels, and the failing one is printed anyway), or
    with ``FLASHTILE_FUZZ=long`` ``LONG_FACTOR * small`` fresh ones, shrunk."""
    phases = list(Phase) if LONG else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(
        phases=phases,
        max_examples=LONG_FACTOR * small if LONG else small,
        deadline=None,
        derandomize=not LONG,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


#: Integers a hostile caller passes where a count or size belongs.
HOSTILE_INTS = (
    0,
    -1,
    -2,
    2**31,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    -(2**64),
    True,
    1.5,
    "3",
    np.int64(3),
    np.uint64(2**64 - 1),
)
#: Values a hostile caller passes where True/False belongs.
HOSTILE_FLAGS = ("no", "", 0, 1, None, 2, np.array(True), [True])
#: Input dtypes: the supported ones, and the ones that must be refused.
FLOAT_DTYPES = (np.float32, np.float64, np.float16)
ODD_DTYPES = (np.dtype(">f8"), np.dtype(">f4"), np.int32, np.uint8, np.bool_, np.complex64)
#: Values sprinkled into float inputs.
SPECIALS = (np.nan, np.inf, -np.inf, 1e30, -1e30, 1e300, 0.0, 5e-324)


#: One argument in about ``ODDS + 1`` is hostile, so that a call with a dozen
#: arguments is still fair about half the time: refusals are checked, and so
#: are the numbers of the calls that go through.
ODDS = 15


def mostly(good, bad, odds: int = ODDS):
    """``good`` in about ``odds`` draws of ``odds + 1``, else ``bad``."""
    return st.sampled_from([True] * odds + [False]).flatmap(lambda fair: good if fair else bad)


def odd(odds: int = ODDS):
    """True in about one draw of ``odds + 1``: make this argument hostile."""
    return mostly(st.just(False), st.just(True), odds)


def ints(lo: int, hi: int, hostile=HOSTILE_INTS):
    """Mostly integers in ``[lo, hi]``, sometimes a hostile one."""
    return mostly(st.integers(lo, hi), st.sampled_from(hostile))


def sizes(hi: int):
    """A size in ``[1, hi]``, sometimes 0 (empty axes are refused or empty)."""
    return mostly(st.integers(1, hi), st.just(0))


def flags():
    good = st.sampled_from([True, False, np.bool_(True), np.bool_(False)])
    return mostly(good, st.sampled_from(HOSTILE_FLAGS))


def dtypes(odd: bool = True):
    good = st.sampled_from(FLOAT_DTYPES)
    return mostly(good, st.sampled_from(ODD_DTYPES)) if odd else good


@st.composite
def arrays(draw, shape, dtype, specials: bool = True, layouts: bool = True):
    """A standard-normal array of ``shape`` in ``dtype``, maybe with special
    values sprinkled in, maybe huge, maybe not C-contiguous."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(mostly(st.just(1.0), st.sampled_from([1e-20, 1e4, 1e19, 1e38]), 3))
    a = rng.standard_normal(shape) * magnitude
    if specials and a.size and draw(st.integers(0, 7)) == 0:
        picks = draw(st.lists(st.sampled_from(SPECIALS), min_size=1, max_size=3))
        where = rng.integers(0, a.size, size=len(picks))
        a.reshape(-1)[where] = picks
    with np.errstate(over="ignore", invalid="ignore"):
        a = a.astype(dtype)
    layout = draw(st.sampled_from(["c", "c", "c", "f", "strided", "reversed"])) if layouts else "c"
    if layout == "f":
        a = np.asfortranarray(a)
    elif layout == "strided" and a.ndim:
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
        wide[..., ::2] = a
        a = wide[..., ::2]
    elif layout == "reversed" and a.ndim:
        a = np.ascontiguousarray(a[..., ::-1])[..., ::-1]
    return a


#: Scales that are fair but extreme (scores past float32's range), and refused ones.
EXTREME_SCALES = (0.0, -1.0, 1e38, 1e300, 2**70, np.float32(0.5))
HOSTILE_SCALES = (np.nan, np.inf, "1", True)


def maybe(strategy, p_none: int = 2):
    """None most of the time (``p_none`` in ``p_none + 1``), else a draw."""
    return st.one_of(*([st.none()] * p_none), strategy)


def scales():
    fair = st.one_of(st.none(), st.floats(-3, 3), st.none(), st.sampled_from(EXTREME_SCALES))
    return mostly(fair, st.sampled_from(HOSTILE_SCALES))


def windows():
    side = st.one_of(st.integers(-1, 7), st.none())
    odd = st.one_of(
        st.tuples(ints(-1, 7), ints(-1, 7)), st.sampled_from([(1,), (1, 2, 3), "ab", 5, [2, None]])
    )
    return mostly(st.tuples(side, side), odd)


def softcaps():
    return mostly(st.floats(0.1, 50), st.sampled_from([0.0, -1.0, np.nan, np.inf, "1", True]))


def names_an_argument(message: str, names) -> bool:
    """Whether ``message`` mentions one of ``names`` as a whole word."""
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_0-9])", message) for n in names)


def call_or_refusal(fn, names):
    """``fn()``, or None when it raised ValueError/TypeError naming an argument.

    Any other exception propagates: the fuzz test fails on it.
    """
    try:
        return fn()
    except (ValueError, TypeError) as e:
        assert names_an_argument(str(e), names), f"the error names no argument: {e!r}"
        return None


def as64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def max_abs(*arrays) -> float:
    """Largest finite magnitude over ``arrays`` (0 when there is none)."""
    best = 0.0
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        finite = a[np.isfinite(a)]
        if finite.size:
            best = max(best, float(np.abs(finite).max()))
    return best


def conditioning(dtype, scale: float, d: int, q, k, extra: float = 0.0) -> float:
    """Relative error a correct computation may make: eps times the score range.

    Softmax turns an absolute score error into a relative weight error, so an
    exact tiled algorithm in ``dtype`` is accurate to about
    ``eps * (1 + max|score|)`` (times a small factor for the sums).
    """
    eps = float(np.finfo(np.float64 if np.dtype(dtype) == np.float64 else np.float32).eps)
    with np.errstate(over="ignore"):
        product = float(d * max_abs(q) * max_abs(k))  # the oracle computes q.k first
        bound = float(abs(scale) * product + extra)
    if not math.isfinite(product):
        return math.inf
    return 8.0 * (d + 2) * eps * (1.0 + bound) if math.isfinite(bound) else math.inf


def check_rows(out, ref, free, cond: float, value_scale: float, out_dtype, what: str):
    """``out`` matches ``ref`` on every row that is not ``free``.

    Well-conditioned calls (``cond`` small) are compared within ``cond``
    (plus the output dtype's rounding); ill-conditioned ones, where no
    float32 computation can match float64, must still give finite rows
    inside the values' range (attention is a convex combination of values).
    """
    out = np.asarray(out, dtype=np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape}, oracle {ref.shape}"
    if not math.isfinite(cond):  # scores past float64's range: NaN allowed anywhere
        return
    keep = ~np.broadcast_to(free, out.shape[:-1])
    with np.errstate(over="ignore", under="ignore"):  # the oracle rounded to out's dtype
        want = ref[keep].astype(out_dtype).astype(np.float64)
    got = out[keep]
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)], err_msg=what)
    got, want = got[np.isfinite(want)], want[np.isfinite(want)]
    assert np.isfinite(got).all(), f"{what}: NaN/inf where the NaN policy allows none"
    big = max(value_scale, 1e-300)
    if cond < 1e-2:
        rounding = 4 * float(np.finfo(out_dtype).eps) if np.dtype(out_dtype).kind == "f" else 0
        np.testing.assert_allclose(got, want, rtol=0, atol=(cond + rounding) * big, err_msg=what)
    else:
        assert (np.abs(got) <= big * (1 + 1e-3)).all(), f"{what}: outside the values' range"


def check_narrowed(got, want, atol: float, what: str):
    """``got`` (results rounded to its dtype, float16 too) is ``want`` (the
    float64 oracle) within ``atol``: each entry is what some value within
    ``atol`` of ``want`` rounds to, so it lies between the roundings of
    ``want - atol`` and ``want + atol`` (rounding is monotone). Past the
    dtype's range those are infinities: a float16 gradient whose true value
    is 0 but whose float32 error (allowed by ``atol``) passes 65504 comes
    back as inf. No NaN anywhere."""
    g = np.asarray(got, dtype=np.float64)
    assert not np.isnan(g).any(), f"{what}: NaN"
    with np.errstate(over="ignore", invalid="ignore"):  # (the ends may round to inf)
        lo = (want - atol).astype(got.dtype).astype(np.float64)
        hi = (want + atol).astype(got.dtype).astype(np.float64)
    outside = ~((lo <= g) & (g <= hi))
    assert not outside.any(), (
        f"{what}: {int(outside.sum())} of {g.size} outside the tolerance {atol:.3g} (after "
        f"rounding to {got.dtype}): got {g[outside][:4]}, oracle {want[outside][:4]}"
    )


def check_lse(lse, ref_lse, free, cond: float):
    """``lse`` matches the oracle rounded to its dtype (past float32's range: +-inf)."""
    if not math.isfinite(cond):
        return
    with np.errstate(over="ignore"):
        ref_lse = ref_lse.astype(lse.dtype).astype(np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    keep = ~np.broadcast_to(free, lse.shape)
    got, want = lse[keep], ref_lse[keep]
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="lse = -inf rows")
    fin = np.isfinite(want)
    if cond < 1e-2:
        tol = cond * (1 + np.abs(want[fin])) + 1e-6 * np.abs(want[fin])
        assert (np.abs(got[fin] - want[fin]) <= tol).all(), "lse differs from the oracle"

"""CPU-dependent routes (issue 32): every route forced in turn against the
oracle, and the tuner's choice from planted measurements, cache and all."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import flashtile
from flashtile import call_keys, frontdoor, route_cache, routes, tune
from flashtile.cli import main
from flashtile.cpu import blas
from flashtile.decode_planning import plan_decode
from flashtile.frontdoor import check_call
from flashtile.kvlayout import check_cache, decode_variants
from flashtile.planning import plan_forward
from flashtile.reference import decode_attention as reference_decode
from flashtile.workitems import plan_splits

TOL32 = dict(rtol=3e-5, atol=3e-5)


def planted_context(route) -> str:
    """The context of every route that has one, under the ``store`` fixture."""
    return "tiles on planted"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty routes cache of the test's own; this process's answers
    forgotten before and after (other tests see the machine's routes again);
    the routes' contexts planted (the real ones resolve, and may measure,
    the BLAS routes)."""
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHTILE_TUNE", "1")  # (the suite runs the fixed rules: conftest)
    monkeypatch.setattr(routes, "_chosen", {})
    monkeypatch.setattr(routes, "_under", {})
    monkeypatch.setattr(routes, "_contexts", dict.fromkeys(routes._contexts, planted_context))
    return tmp_path / route_cache.CACHE_FILE


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The walk of every decode kernel call the test makes, in order."""
    from flashtile.cpu import cache_rows, launch

    seen, run = [], launch.run_launch  # every decode kernel call, prepared (frontdoor's) or not
    names = {
        (type(flag), cache_rows.walk_prefetches(name)): name
        for name, flag in cache_rows._WALKS.items()
    }

    def spy(call, q, k, v):
        seen.append(names[type(call.walk), call.ahead])
        return run(call, q, k, v)

    monkeypatch.setattr(launch, "run_launch", spy)
    monkeypatch.setattr(frontdoor, "run_launch", spy)
    return seen


def _layouts(rng, k, v, lengths):
    """The same caches ``(B, Hkv, T, d)`` as a contiguous cache, in shuffled
    16-key pages, and in one-token pages (flash-attn's token-major layout):
    ``{name: (k, v, block_table)}``."""
    batch, hkv, t, _ = k.shape
    out = {"contiguous": (k, v, np.arange(batch)[:, None])}
    per = -(-t // 16)
    order = rng.permutation(batch * per)
    pad = per * 16 - t
    paged = []
    for a in (k, v):
        a = np.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))
        pages = a.reshape(batch, hkv, per, 16, -1).transpose(0, 2, 1, 3, 4)
        pool = np.empty_like(pages.reshape(batch * per, hkv, 16, -1))
        pool[order] = pages.reshape(batch * per, hkv, 16, -1)
        paged.append(pool)
    out["paged"] = (*paged, order.reshape(batch, per))
    tokens = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(batch * t, hkv, 1, -1)
              for a in (k, v)]  # fmt: skip
    out["tokens"] = (*tokens, np.arange(batch * t).reshape(batch, t))
    return out


VARIANTS = [{}, {"window": (40, 0)}, {"softcap": 5.0}, {"alibi": True}]


@pytest.mark.parametrize("variants", VARIANTS, ids=["plain", "window", "softcap", "alibi"])
@pytest.mark.parametrize("heads", [(6, 6, 1), (6, 2, 2)], ids=["one-row", "several-rows"])
def test_every_decode_walk_on_every_layout_matches_the_reference(rng, variants, heads):
    hq, hkv, tq = heads
    batch, t, d = 2, 300, 12
    q = rng.standard_normal((batch, hq, tq, d)).astype(np.float32)
    k, v = (rng.standard_normal((batch, hkv, t, d)).astype(np.float32) for _ in range(2))
    lengths = np.array([300, 157])
    kw = dict(variants)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, hq)
    want, want_lse = reference_decode(
        *(a.astype(np.float64) for a in (q, k, v)), cache_seqlens=lengths, return_lse=True, **kw
    )
    rows = "one" if hq == hkv and tq == 1 else "few"
    for layout, (kc, vc, table) in _layouts(rng, k, v, lengths).items():
        name = f"decode.{layout}.{rows}.d64.short"
        for walk in routes.ROUTES[name].candidates:
            with routes.force(name, walk):
                out, lse = flashtile.decode_attention(
                    q, kc, vc, cache_seqlens=lengths, block_table=table, num_splits=2,
                    return_lse=True, **kw,
                )  # fmt: skip
            np.testing.assert_allclose(out, want, **TOL32, err_msg=f"{layout} {walk}")
            np.testing.assert_allclose(lse, want_lse, **TOL32, err_msg=f"{layout} {walk}")


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.float64])
def test_the_walks_of_one_token_pages_in_other_dtypes(rng, dtype):
    dtype = np.dtype(dtype)  # ml_dtypes registers "bfloat16" with NumPy
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32 if dtype.itemsize == 2 else dtype)
    k, v = (rng.standard_normal((1, 2, 600, 8)).astype(dtype) for _ in range(2))
    lengths = np.array([600])
    want = reference_decode(*(a.astype(np.float64) for a in (q, k, v)), cache_seqlens=lengths)
    kc, vc, table = _layouts(rng, k, v, lengths)["tokens"]
    for walk in routes.ROUTES["decode.tokens.few.d64.short"].candidates:
        with routes.force("decode.tokens.few.d64.short", walk):
            out = flashtile.decode_attention(q, kc, vc, cache_seqlens=lengths, block_table=table)
        tol = 1e-9 if dtype == np.float64 else 3e-5
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol, err_msg=walk)


def test_the_fastest_planted_measurement_is_chosen_stored_and_read_back(store, monkeypatch):
    name = "decode.paged.few.d64.short"
    seen = []

    def planted(route, candidates):
        seen.append((route.name, candidates))
        return {"tiles": 2.0e-3, "rows": 1.0e-3, "head-rows": 3.0e-3}

    monkeypatch.setitem(routes._measures, name, planted)
    measured = "(rows 1.00 ms, tiles 2.00 ms, head-rows 3.00 ms; tiles on planted)"
    assert routes.explain(name) == ("rows", f"measured now {measured}")
    assert seen == [(name, ("tiles", "rows", "head-rows"))]
    entry = json.loads(store.read_text())[route_cache.machine_key()][name]
    assert entry == {
        "choice": "rows",
        "times": {"tiles": 2.0e-3, "rows": 1.0e-3, "head-rows": 3.0e-3},
        "under": "tiles on planted",
    }
    # A later process (this one's answers forgotten) reads it without measuring.
    routes.forget()
    assert routes.explain(name) == ("rows", f"measured {measured}")
    assert len(seen) == 1
    # The environment variable wins over the measurement; forcing (the
    # measurement's own, precompile's) over both.
    monkeypatch.setenv("FLASHTILE_DECODE_WALK", "tiles")
    assert routes.explain(name) == ("tiles", "forced by FLASHTILE_DECODE_WALK")
    with routes.force(name, "rows"):
        assert routes.choice(name) == "rows"
    monkeypatch.delenv("FLASHTILE_DECODE_WALK")
    with routes.force(name, "tiles"):
        assert routes.choice(name) == "tiles"
    assert routes.choice(name) == "rows"


def test_a_failed_measurement_gives_the_fixed_rule_not_an_error(store, monkeypatch, rng):
    calls = []

    def failing(route, candidates):
        calls.append(route.name)
        raise MemoryError("64 MiB")

    name = "decode.contiguous.one.d64.short"
    monkeypatch.setitem(routes._measures, name, failing)
    monkeypatch.setattr(blas, "_choice", "openblas")  # (the BLAS route: not measured here)
    q, k, v = (rng.standard_normal((1, 2, t, 8)).astype(np.float32) for t in (1, 600, 600))
    for _ in range(2):  # measured once, then the answer kept
        out = flashtile.decode_attention(q, k, v, block_table=[[0]], cache_seqlens=[600])
        np.testing.assert_allclose(out, reference_decode(q, k, v), **TOL32)
    assert calls == [name] and not store.exists()
    assert routes.explain(name) == (
        "tiles",
        "fixed rule (the measurement failed: MemoryError('64 MiB'))",
    )


def test_another_machines_measurements_are_not_used(store, monkeypatch):
    name = "decode.contiguous.one.d64.short"
    other = {"v1|another CPU|avx512f|threads=2|": {name: {"choice": "rows", "times": {}}}}
    # Nor this machine's, measured with other kernels (sources changed since).
    key = route_cache.machine_key()
    stale = key.rsplit("|kernels=", 1)[0] + "|kernels=0123456789abcdef"
    assert stale != key
    other[stale] = other["v1|another CPU|avx512f|threads=2|"]
    store.write_text(json.dumps(other))
    monkeypatch.setenv("FLASHTILE_TUNE", "0")
    assert routes.explain(name) == ("tiles", "fixed rule (not measured)")


ENTRY = '{"KEY": {"decode.paged.one.d64.short": ENTRY}}'


@pytest.mark.parametrize(
    "text",
    [
        "{not json", "[1, 2]", '{"KEY": 3}', ENTRY.replace("ENTRY", '{"choice": "x"}'),
        ENTRY.replace("ENTRY", '{"choice": "tiles"}'),
        ENTRY.replace("ENTRY", '{"choice": "tiles", "times": {"tiles": null}}'),
        ENTRY.replace("ENTRY", '{"choice": "tiles", "times": {"tiles": "1.0", "rows": 2}}'),
        "[" * 3000,  # (json raised RecursionError)
    ],
)  # fmt: skip
def test_a_corrupt_cache_falls_back_to_the_fixed_rule(store, monkeypatch, text):
    store.write_text(text.replace("KEY", route_cache.machine_key()))
    monkeypatch.setenv("FLASHTILE_TUNE", "0")
    assert routes.explain("decode.paged.one.d64.short") == ("rows", "fixed rule (not measured)")


def test_an_entry_measured_before_a_candidate_was_added_is_measured_again(store, monkeypatch):
    name = "decode.paged.one.d64.short"  # head-rows joined its candidates later
    old = {name: {"choice": "rows", "times": {"tiles": 2.0e-3, "rows": 1.0e-3}}}
    store.write_text(json.dumps({route_cache.machine_key(): old}))
    planted = {"tiles": 2.0e-3, "rows": 1.0e-3, "head-rows": 0.5e-3}
    monkeypatch.setitem(routes._measures, name, lambda route, candidates: planted)
    assert routes.explain(name)[0] == "head-rows"
    assert json.loads(store.read_text())[route_cache.machine_key()][name]["times"] == planted
    assert store.stat().st_mode & 0o777 == 0o644  # readable by a service's other user


def test_an_entry_serves_only_under_the_context_it_was_measured_in(store, monkeypatch):
    # A decode walk measured with OpenBLAS running its tiles (FLASHTILE_BLAS,
    # set_backend) is measured again under oneMKL, and the other way round.
    name, under, seen = "decode.contiguous.few.d64.short", ["tiles on a"], []
    monkeypatch.setitem(routes._contexts, name, lambda route: under[0])

    def planted(route, candidates):
        seen.append(under[0])
        fast, slow = (1e-3, 2e-3) if under[0] == "tiles on a" else (3e-3, 1e-3)
        return {"tiles": fast, "rows": slow, "tiles-stream": 3e-3 if fast < 3e-3 else 2e-3}

    monkeypatch.setitem(routes._measures, name, planted)
    assert routes.choice(name) == "tiles"
    routes.forget()  # (a later process under the same context reads it)
    assert routes.explain(name) == ("tiles", "measured (tiles 1.00 ms, rows 2.00 ms, "
                                    "tiles-stream 3.00 ms; tiles on a)")  # fmt: skip
    under[0] = "tiles on b"
    routes.moved()  # (as set_backend does: the answer is resolved again)
    # A report that does not measure leaves no answer of the old context behind.
    assert routes.explain(name, measure=False)[1] == "fixed rule (not measured yet)"
    assert routes.choice(name) == "rows" and seen == ["tiles on a", "tiles on b"]
    entry = json.loads(store.read_text())[route_cache.machine_key()][name]
    assert entry["choice"] == "rows" and entry["under"] == "tiles on b"
    routes.moved()  # (nothing it depends on moved: the answer stands)
    assert routes.choice(name) == "rows" and len(seen) == 2

    # A context that cannot be resolved (a BLAS that fails to load) gives the
    # fixed rule, in a report and in a tuning alike: the kernel call reports it.
    def unusable(route):
        raise ValueError("FLASHTILE_BLAS='mkl': BLAS backend 'mkl' requested but ...")

    monkeypatch.setitem(routes._contexts, name, unusable)
    routes.moved()
    assert routes.explain(name) == (
        routes._fixed(routes.ROUTES[name]),
        "fixed rule (its context could not be resolved)",
    )
    assert routes.tune([name]) == {name: {}} and len(seen) == 2


def test_a_report_measures_nothing_through_a_context(store, monkeypatch):
    # A report (measure=False) resolves a route's context without measuring
    # the routes it asks (the BLAS routes, for the walks), nor remembers it.
    name, other, seen = "decode.contiguous.one.d64.short", "decode.paged.one.d64.short", []
    monkeypatch.setitem(routes._contexts, name, lambda route: f"after {routes.choice(other)}")

    def planted(route, candidates):
        seen.append(route.name)
        return {c: (i + 1) * 1e-3 for i, c in enumerate(candidates)}

    monkeypatch.setitem(routes._measures, name, planted)
    monkeypatch.setitem(routes._measures, other, planted)
    assert routes.explain(name, measure=False)[1] == "fixed rule (not measured yet)"
    assert seen == [] and name not in routes._chosen and other not in routes._chosen
    assert routes.choice(name) == "tiles" and seen == [other, name]
    assert routes.explain(name)[1].endswith("; after tiles)")


def test_the_decode_walks_and_bf16_measure_under_the_library_of_their_tiles(monkeypatch):
    from flashtile.cpu import blas

    one, many = (routes.ROUTES[f"decode.paged.{rows}.d64.short"] for rows in ("one", "many"))
    assert routes._contexts[one.name] is tune.tiles_library
    assert routes._contexts["bf16"] is tune.tiles_library
    monkeypatch.setattr(blas, "_choice", "openblas")
    assert tune.tiles_library(one) == tune.tiles_library(many) == "tiles on openblas"
    if "mkl" in blas.available():
        monkeypatch.setattr(blas, "_choice", "mkl")
        assert tune.tiles_library(many) == tune.tiles_library(routes.ROUTES["bf16"])
        assert tune.tiles_library(many) == "tiles on mkl"
        for library in ("openblas", "mkl"):  # one row: the blas.one route's library
            with routes.force("blas.one", library):
                assert tune.tiles_library(one) == f"tiles on {library}"


def test_an_unwritable_cache_directory_never_fails_a_call(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(blocker / "sub"))  # under a file: no mkdir
    monkeypatch.setattr(routes, "_chosen", {})
    monkeypatch.setitem(
        routes._measures, "decode.paged.one.d64.short", lambda r, c: {"tiles": 2, "rows": 1}
    )
    assert routes.choice("decode.paged.one.d64.short") == "rows"


def test_forcing_names_what_it_accepts(monkeypatch):
    with (
        pytest.raises(ValueError, match="has no candidate 'head-tiles'"),
        routes.force("decode.paged.one.d64.short", "head-tiles"),
    ):
        pass
    monkeypatch.setenv("FLASHTILE_DECODE_WALK", "diagonal")
    with pytest.raises(ValueError, match=r"FLASHTILE_DECODE_WALK='diagonal' is not one of"):
        routes.choice("decode.paged.one.d64.short")
    # A walk another layout has leaves this one to its route.
    monkeypatch.setenv("FLASHTILE_DECODE_WALK", "head-tiles")
    assert routes.choice("decode.tokens.one.d64.short") == "head-tiles"
    assert routes.choice("decode.paged.one.d64.short") in ("tiles", "rows", "head-rows")


def test_the_blas_route_resolves_auto(monkeypatch):
    monkeypatch.delenv("FLASHTILE_BLAS", raising=False)
    try:
        with routes.force("blas", "openblas"):
            assert blas.set_backend("auto") == "openblas"
            blas.reset_backend()
            assert blas.backend() == "openblas"
        if "mkl" in blas.available():
            with routes.force("blas", "mkl"):
                assert blas.set_backend("auto") == "mkl"
    finally:
        blas.reset_backend()


def test_the_tune_command_measures_stores_and_reports(store, monkeypatch, capsys):
    planted = {"tiles": 3e-3, "rows": 1e-3}
    monkeypatch.setitem(routes._measures, "decode.paged.one.d64.short", lambda r, c: planted)
    other = "decode.contiguous.one.d64.short"  # --route: the others are not measured
    monkeypatch.setitem(routes._measures, other, lambda r, c: pytest.fail("measured"))
    assert main(["tune", "--route", "decode.paged.one.d64.short"]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line.split(None, 2)[1:] for line in text.splitlines()[2:-1]}
    assert lines["decode.paged.one.d64.short"][0] == "rows"
    assert lines["decode.paged.one.d64.short"][1].startswith(
        "measured now (rows 1.00 ms, tiles 3.00 ms; tiles on planted)"
    )
    assert lines[other][1].startswith("fixed rule (not measured yet)")
    assert str(store) in text


def test_the_measurements_time_every_candidate(monkeypatch, walks):
    # The real measurement (one route, one round): every candidate timed, and
    # run as itself, even under a variable that forces another walk.
    route = routes.ROUTES["decode.tokens.few.d64.short"]
    monkeypatch.setattr(tune, "ROUNDS", 1)
    monkeypatch.setenv("FLASHTILE_DECODE_WALK", "tiles")
    times = tune.measure_decode(route, route.candidates)
    assert set(times) == set(route.candidates) and all(t > 0 for t in times.values())
    assert sorted(set(walks)) == sorted(route.candidates)  # (warm-up and timed calls)


def test_a_prepared_call_is_planned_again_when_a_route_moves(rng, walks):
    # decode_attention on a whole contiguous cache keeps its plan between
    # calls; forcing a route (or tuning) must reach it.
    q, k, v = (rng.standard_normal((1, 3, t, 8)).astype(np.float32) for t in (1, 700, 700))
    name = routes.decode_route_name("contiguous", 1, 8, 700)
    for walk in ("tiles", "rows", "tiles"):
        with routes.force(name, walk):
            for _ in range(2):
                np.testing.assert_allclose(
                    flashtile.decode_attention(q, k, v), reference_decode(q, k, v), **TOL32
                )
    assert walks == ["tiles", "tiles", "rows", "rows", "tiles", "tiles"]


def test_a_prepared_attention_call_is_planned_again_too(rng, walks):
    q, k, v = (rng.standard_normal((1, 2, t, 8)).astype(np.float32) for t in (1, 600, 600))
    name = routes.decode_route_name("contiguous", 1, 8, 600)
    want = reference_decode(q, k, v)
    for walk in ("tiles", "rows"):
        with routes.force(name, walk):
            for _ in range(2):
                np.testing.assert_allclose(flashtile.attention(q, k, v), want, **TOL32)
    assert walks == ["tiles", "tiles", "rows", "rows"]


def test_an_explicit_split_count_too_small_for_the_threads_takes_per_head_items(rng, monkeypatch):
    import flashtile.decode_planning as decode_planning

    monkeypatch.setattr(decode_planning, "call_threads", lambda size: 2)  # whatever the size
    monkeypatch.setattr(decode_planning, "numba_threads", lambda: 2)
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((64, 4, 1, 16)).astype(np.float32) for _ in range(2))
    layout = check_cache(q, k, v, np.array([64]), np.arange(64)[None])[1]
    name = routes.decode_route_name("tokens", 2, 16, 64)
    for walk, per_head in (("head-rows", "rows"), ("head-tiles", "tiles")):
        with routes.force(name, walk):
            plans = [
                plan_decode(q, layout, decode_variants(q, layout), 0.25, n) for n in (None, 2, 1)
            ]
            assert [p.walk for p in plans] == [walk, walk, per_head]  # 1 item for 2 threads
            assert [len(p.items) for p in plans[1:]] == [2, 4]


def test_the_blas_measurement_keeps_an_explicit_choice(monkeypatch):
    monkeypatch.setattr(tune, "ROUNDS", 1)
    route, usable = routes.ROUTES["blas"], blas.available()
    try:
        blas.set_backend("openblas")  # chosen by name: kept
        assert set(tune.measure_blas(route, usable)) == set(usable)
        assert blas.pinned() == "openblas" and blas.backend() == "openblas"
        blas.set_backend("auto")  # the route's: resolved again afterwards
        tune.measure_blas(route, usable)
        assert blas.pinned() is None
    finally:
        blas.reset_backend()


def test_head_walk_items_keep_the_threads_busy():
    # An item of every kv head carries their work: automatic chunks shorten
    # so that as many items are made; an explicit split count too small for
    # the threads takes per-head items instead.
    ranges = np.array([[0, 2048]])
    per_head, _ = plan_splits(ranges, 8, None, 16)
    heads, _ = plan_splits(ranges, 8, None, 16, tile=32, item_heads=8)
    assert len(per_head) == 32 and len(heads) == 32
    with pytest.raises(ValueError, match="item_heads=3 must divide kv_heads=8"):
        plan_splits(ranges, 8, None, 16, item_heads=3)


def test_the_bench_header_names_the_routes_in_force():
    from flashtile.bench.machine import _route_lines, machine_info

    info = machine_info()
    assert set(info["routes"]) == set(routes.ROUTES)
    chosen = {"blas": "mkl (measured)", "blas.one": "openblas (measured (x))"}
    chosen |= {"blas.few": "mkl (forced by FLASHTILE_BLAS_SMALL)"}
    chosen |= {"decode.a": "rows (x)", "decode.b": "rows (y)", "bf16": "widen (fixed)"}
    lines = _route_lines({**chosen, "decode.c": "tiles"})
    assert lines == [
        "route   : blas = mkl (measured); blas.one = openblas; "
        "blas.few = mkl (forced by FLASHTILE_BLAS_SMALL)",
        "route   : bf16 = widen (fixed)",
        "route   : decode walks of 3 classes: rows 2, tiles 1 (flashtile tune lists them)",
    ]


def test_a_tiny_calls_products_run_where_blas_tiny_says(rng, monkeypatch):
    """With oneMKL the BLAS, a tiny call's forward and backward run their
    products in the route's library, each right against float64; a prepared
    call follows the route when it moves, a larger call keeps the backend's."""
    from flashtile.cpu import launch
    from flashtile.tune import _backend_restored

    if "mkl" not in blas.available():
        pytest.skip("no oneMKL here: the route decides nothing")
    kernels = launch._kernels()
    used, real = [], kernels.gemm_for
    monkeypatch.setattr(
        kernels, "gemm_for", lambda d, small=None: used.append(small) or real(d, small)
    )
    q, k, v, dout = (rng.standard_normal((1, 4, 16, 32)).astype(np.float32) for _ in range(4))
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    with _backend_restored():
        blas.set_backend("mkl")
        want = flashtile.attention(*wide[:3], causal=True, return_lse=True)
        want_grads = flashtile.attention_backward(*wide[:3], *want, wide[3], causal=True)
        for library in routes.ROUTES["blas.tiny"].candidates:
            with routes.force("blas.tiny", library):
                used.clear()
                for _ in range(2):  # (the second call runs the prepared plan)
                    out, lse = flashtile.attention(q, k, v, causal=True, return_lse=True)
                grads = flashtile.attention_backward(q, k, v, out, lse, dout, causal=True)
                assert used == [library] * 3
            np.testing.assert_allclose(out, want[0], **TOL32)
            for got, expected in zip(grads, want_grads, strict=True):
                np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        used.clear()
        big = [rng.standard_normal((1, 2, 128, 32)).astype(np.float32) for _ in range(3)]
        flashtile.attention(*big, causal=True)
        assert used == [None]
        # not tiny: one query row against many keys, a GQA group's stacked rows,
        # bf16 products; bf16 widened to float32 (a CPU without them) is tiny
        bf16_tiny = None if blas.bf16_products() else blas.tiny_library()
        for q_shape, k_shape, dtype, small in [
            ((1, 2, 1, 32), (1, 2, 600, 32), np.float32, None),
            ((1, 8, 16, 32), (1, 2, 16, 32), np.float32, None),
            ((1, 2, 16, 32), (1, 2, 16, 32), ml_dtypes.bfloat16, bf16_tiny),
        ]:
            arrays = (rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, k_shape))
            assert plan_forward(check_call(*arrays, True, None, {})).small == small
        # forced by its variable: settled, so a prepared call keeps its step
        monkeypatch.setenv("FLASHTILE_BLAS_SMALL", "openblas")
        monkeypatch.setattr(routes, "_chosen", {})  # (nothing remembered: the variable decides)
        assert not routes.provisional("blas.tiny")
        flashtile.attention(q, k, v)
        key = call_keys.plain_key(q, k, v, False, None, False, None, None, {})
        assert frontdoor.prepared(key).steps[16].plan.small == "openblas"

"""``flashtile bench``: cases, verification before timing, output formats.

Mostly the NumPy providers run here, at tiny sizes, so the file takes seconds;
torch and the compiled kernel are simulated as absent where that matters. The
variants preset runs shrunk to T=64 with the compiled kernel and, when
installed, torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest

from flashtile.bench import cases, memory, presets, providers, runner, variant_cases
from flashtile.bench.cases import Case, attention_flops
from flashtile.bench.variant_cases import Variant
from flashtile.cli import build_parser, main

QUICK_NUMPY = ["bench", "--preset", "quick", "--reps", "2", "--no-ceiling"]
NUMPY_ONLY = ["--providers", "numpy-naive", "numpy-tiled"]


def test_quick_preset_runs_end_to_end_and_prints_a_table(capsys):
    assert main(QUICK_NUMPY + NUMPY_ONLY) == 0
    text = capsys.readouterr().out
    assert text.startswith("machine : ")
    assert "H=2" in text
    header = next(line for line in text.splitlines() if line.startswith("case "))
    for column in ("provider", "ms", "GFLOP/s", "rel err", "+RSS MiB"):
        assert column in header
    for label in ("fwd T=64 d=32 full", "fwd+bwd T=256 d=32 causal"):
        rows = [line for line in text.splitlines() if line.startswith(label)]
        assert [row.split()[len(label.split())] for row in rows] == ["numpy-naive", "numpy-tiled"]
    rows = [line for line in text.splitlines() if line.startswith("fwd")]
    assert len(rows) == 16 and not [r for r in rows if "FAILED" in r or "ERROR" in r]


def test_markdown_table(capsys):
    assert main([*QUICK_NUMPY, "--providers", "numpy-tiled", "--markdown", "--no-memory"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("| case | provider | ms |") for line in lines)
    assert any(line.startswith("| fwd T=64 d=32 full | numpy-tiled |") for line in lines)


def test_a_wrong_provider_is_failed_and_never_timed(monkeypatch):
    calls = []

    def zeros(self, q, k, v, causal):
        calls.append(q.shape)
        return np.zeros_like(q)

    monkeypatch.setattr(providers.NumpyTiledProvider, "forward", zeros)
    case = Case(64, 16, False, "fwd", H=2)
    good, bad = providers.make_providers(["numpy-naive", "numpy-tiled"])
    results = runner.run_case(
        case, [good, bad], runner.ReferenceCache(), reps=3, measure_memory=False
    )
    by_name = {r.provider: r for r in results}
    assert by_name["numpy-tiled"].status == "FAILED"
    assert by_name["numpy-tiled"].times == []
    assert by_name["numpy-tiled"].rel_err == pytest.approx(1.0)  # ||0 - ref|| / ||ref||
    assert len(calls) == 1  # the verification call only
    assert by_name["numpy-naive"].status == "ok"
    assert len(by_name["numpy-naive"].times) == 3


def test_a_failed_provider_shows_in_the_table_and_exit_status(monkeypatch, capsys):
    monkeypatch.setattr(
        providers.NumpyTiledProvider, "forward", lambda self, q, k, v, causal: np.zeros_like(q)
    )
    args = [*QUICK_NUMPY, *NUMPY_ONLY, "--no-memory"]
    assert main(args) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if "numpy-tiled" in line]
    fwd_rows = [row for row in rows if row.startswith("fwd ")]
    assert fwd_rows and all("FAILED" in row and "not timed" in row for row in fwd_rows)


def test_a_crashing_provider_is_an_error_not_a_crash(monkeypatch):
    def boom(self, q, k, v, dout, causal):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(providers.NumpyTiledProvider, "forward_backward", boom)
    case = Case(32, 8, True, "fwd+bwd", H=1)
    [res] = runner.run_case(
        case,
        providers.make_providers(["numpy-tiled"]),
        runner.ReferenceCache(),
        measure_memory=False,
    )
    assert res.status == "ERROR" and "kernel exploded" in res.note and not res.times


def test_flop_formula():
    fwd = 4 * 1 * 8 * 4096 * 4096 * 64
    assert attention_flops(1, 8, 4096, 4096, 64, False, "fwd") == fwd
    assert attention_flops(1, 8, 4096, 4096, 64, True, "fwd") == fwd / 2
    assert attention_flops(1, 8, 4096, 4096, 64, False, "fwd+bwd") == 3.5 * fwd
    assert attention_flops(2, 4, 100, 300, 32, True, "fwd+bwd") == 3.5 * 2 * 2 * 4 * 100 * 300 * 32
    assert Case(2048, 64, True, "fwd+bwd").flops == 3.5 * 2 * 8 * 2048**2 * 64
    with pytest.raises(ValueError, match="mode must be one of"):
        attention_flops(1, 1, 1, 1, 1, False, "bwd")


def test_json_has_the_numbers_and_the_machine(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main([*QUICK_NUMPY, "--providers", "numpy-tiled", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert {
        "machine",
        "ceiling_sgemm_gflops",
        "config",
        "notes",
        "memory_method",
        "flop_convention",
        "tolerance",
        "results",
    } <= set(doc)
    assert {"cpu", "isa", "numpy", "numba", "kernel_blas", "bf16_path", "torch"} <= set(
        doc["machine"]
    )
    assert doc["config"]["preset"] == "quick"
    assert len(doc["results"]) == 8
    rec = doc["results"][0]
    assert {
        "mode",
        "T",
        "d",
        "causal",
        "B",
        "H",
        "provider",
        "status",
        "flops",
        "rel_err",
        "times_ms",
        "median_ms",
        "gflops",
        "speedup_vs_torch",
        "rss_peak_mib",
        "traced_peak_mib",
    } <= set(rec)
    assert rec["status"] == "ok" and rec["gflops"] > 0 and len(rec["times_ms"]) == 2
    assert rec["flops"] == attention_flops(1, 2, rec["T"], rec["T"], 32, rec["causal"], rec["mode"])


def test_missing_torch_is_skipped_with_a_note(monkeypatch, capsys):
    def no_torch():
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(providers, "_import_torch", no_torch)
    args = [*QUICK_NUMPY, "--providers", "torch-sdpa", "numpy-tiled", "--no-memory"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "note    : skipped torch-sdpa: torch not installed" in text
    assert "providers: numpy-tiled" in text
    assert not [line for line in text.splitlines() if line.startswith("fwd") and "torch" in line]


def test_slow_providers_are_limited():
    big = Case(8192, 64, False, "fwd")
    bwd = Case(4096, 64, False, "fwd+bwd")
    assert cases.slow_skip_reason("numpy-naive", big, 4096)
    assert cases.slow_skip_reason("numpy-naive", big, 8192) is None
    assert cases.slow_skip_reason("numpy-tiled", bwd, 8192)
    assert cases.slow_skip_reason("numpy-tiled", Case(2048, 64, False, "fwd+bwd"), 4096) is None
    assert cases.slow_skip_reason("torch-sdpa", big, 1) is None


def _plan(*argv):
    from flashtile.bench.cli import plan_run

    return plan_run(build_parser().parse_args(["bench", *argv]))


def test_bare_bench_is_the_core_preset():
    plan = _plan()
    assert plan.name == "core" and len(plan.cases) == 7
    assert plan.providers == ["torch-sdpa", "flashtile", "numpy-naive"]
    assert [c for c in plan.cases if "numpy-naive" in c.providers] == [
        Case(4096, 64, False, "fwd", 1, 8, ("flashtile", "torch-sdpa", "numpy-naive"))
    ]


def test_preset_and_case_options_conflict(capsys):
    assert main(["bench", "--preset", "quick", "--T", "128"]) == 2
    assert "--preset quick fixes the cases" in capsys.readouterr().err


def test_bad_option_values_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--T", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert main([*QUICK_NUMPY, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'flashtile[plot]'" in capsys.readouterr().err


def test_peak_rss_sees_a_large_allocation():
    if memory.rss_method().startswith("ru_maxrss"):
        pytest.skip("needs /proc/self/clear_refs (Linux) to reset the RSS peak")
    size = 64 * 1024 * 1024
    rss, method = memory.measure_rss(lambda: np.ones(size, dtype=np.uint8))
    assert method == "hwm" and rss >= 0.9 * size
    assert memory.measure_traced(lambda: np.ones(size, dtype=np.uint8)) >= size


# Compiles three small cached kernels instead of all of them: the mechanism
# (an empty cache dir, then a second process that finds the cache) is the
# same, and the full cold compile would add a minute to the suite. Only the
# calls are timed: the imports' time varies more on a loaded machine than
# these kernels' compile costs. (One kernel's compile, ~0.4 s, was within the
# noise of Numba's own first-use set-up, ~0.5 s cold or warm.)
CHEAP_PROBE = """
import json, time
import numpy as np
from flashtile.cpu.rowops import exp2_bf16_f32, exp2_shifted_f32, row_max
x, p = np.zeros((1, 8), dtype=np.float32), np.zeros((1, 8), dtype=np.uint16)
t0 = time.perf_counter()
row_max(x, 0, 0, 8)
exp2_shifted_f32(x, x, 0, 0, 8, 0.0)
exp2_bf16_f32(x, p, 0, 0, 8, 0.0)
t1 = time.perf_counter()
print(json.dumps({"forward": t1 - t0, "forward+backward": t1 - t0}))
"""


def test_startup_measures_cold_then_warm_in_new_processes():
    from flashtile.bench.startup import measure_startup, startup_lines

    times = measure_startup(CHEAP_PROBE)
    assert set(times) == {"cold", "warm"}
    for t in times.values():
        assert 0 < t["forward"] <= t["forward+backward"]
    assert times["warm"]["forward+backward"] < times["cold"]["forward+backward"]
    assert [line.split(":")[1].split()[0] for line in startup_lines(times)] == ["cold", "warm"]


# --- the variants preset, shrunk ------------------------------------------------------

SMALL_VARIANTS = {
    "T": 64,
    "long_T": 256,
    "window": 16,
    "block": 16,
    "density": 0.25,
    "gqa": (4, 64, 32),
    "seqlens": (8, 24, 40, 64),
}


def small_variant_cases(B=1, H=2):
    return variant_cases.variant_cases(B, H, **SMALL_VARIANTS)


def test_variants_preset_runs_end_to_end_verified(monkeypatch, tmp_path, capsys):
    small = dataclasses.replace(presets.PRESETS["variants"], cases=small_variant_cases, H=2)
    monkeypatch.setitem(presets.PRESETS, "variants", small)
    path = tmp_path / "variants.json"
    args = ["bench", "--preset", "variants", "--reps", "2", "--no-ceiling", "--no-memory"]
    assert main([*args, "--max-slow-T", "64", "--markdown", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(path.read_text())
    has_torch = providers.TorchSDPAProvider().available()[0]
    names = [(r["T"], r["provider"]) for r in doc["results"]]
    expected = [
        (64, "flashtile"),  # window
        (256, "flashtile"),  # the same window, 4x longer
        (64, "flashtile"),  # block-sparse
        (64, "flashtile-blockmask"),
        (64, "flashtile-dense"),
        (64, "flashtile"),  # GQA
        (136, "flashtile"),  # varlen, packed
        (136, "flashtile-per-seq"),
    ]
    assert [n for n in names if n[1] != "torch-sdpa"] == expected
    torch_ts = [64, 256, 64, 64, 136] if has_torch else []  # window x 2, sparse, GQA, varlen
    assert [t for t, name in names if name == "torch-sdpa"] == torch_ts
    for rec in doc["results"]:
        if rec["T"] == 256 and rec["provider"] == "torch-sdpa":  # dense mask above --max-slow-T
            assert rec["status"] == "skipped" and "--max-slow-T" in rec["note"]
            continue
        assert rec["status"] == "ok" and rec["rel_err"] < 1e-5 and rec["reps"] == 2, rec
        pairs = 64 * 64 if rec["provider"] == "flashtile-dense" else rec["pairs_per_head"]
        assert rec["flops"] == 4 * rec["B"] * rec["H"] * rec["d"] * pairs
    sparse = [r for r in doc["results"] if r["variant"]["sparse_block"]]
    assert sparse[0]["pairs_per_head"] == 16 * 16 * round(0.25 * 16)
    assert "| fwd T=64 d=64 causal window=(16,0), 952 pairs/head | flashtile |" in text
    targets = [line[len("* target: ") :] for line in text.splitlines() if "* target: " in line]
    assert targets == doc["targets"]
    kinds = [
        "time(flashtile) / (0.2500 x time(flashtile-dense))",
        "time(flashtile-blockmask) / (0.2500 x time(flashtile-dense))",
        "varlen 4 seqs 8..64 T=136",
        "linearity: time(T=256) / (4 x time(T=64))",
    ]
    if has_torch:
        kinds += ["window=(16,0) T=64 d=64 causal: time(torch-sdpa", "GQA 8q/2kv"]
    assert len(targets) == len(kinds)
    for kind in kinds:
        assert any(kind in line for line in targets), kind


def test_variant_pair_counts_masks_and_flops():
    from flashtile.masks import visible

    idx = np.arange(50)
    for causal, window in [(True, (7, 0)), (False, (3, 5)), (True, None), (False, None)]:
        left, right = (-1, -1) if window is None else window
        brute = visible(idx, idx, 50, 50, causal, left, right).sum()
        assert variant_cases.positional_pairs(50, causal, window) == brute
    assert variant_cases.positional_pairs(4096, True, (256, 0)) == 257 * 4096 - 256 * 257 // 2
    pattern = variant_cases.block_pattern(100, 16, 0.25, 3)  # 7 x 7 blocks, the last one short
    assert pattern.shape == (7, 7) and pattern.sum() == round(0.25 * 49)
    assert np.diag(pattern).all()
    va = Variant(sparse_block=16, sparse_density=0.25, seed=3)
    mask = variant_cases.sparse_mask(va, 100)
    assert mask.shape == (100, 100) and mask.diagonal().all()
    case = Case(100, 8, False, "fwd", 2, 3, variant=va)
    assert case.flops == 4 * 2 * 3 * 8 * mask.sum()
    assert "block-sparse 25% of 16x16" in case.label and "pairs/head" in case.label
    assert Case(100, 8, False, "fwd", 2, 3, variant=va.without_mask()).flops == 4 * 6 * 8 * 100**2
    with pytest.raises(ValueError, match="forward only"):
        Case(64, 8, True, "fwd+bwd", variant=Variant(window=(4, 0)))


def test_windowed_reference_in_chunks_equals_one_call(monkeypatch):
    import flashtile

    monkeypatch.setattr(variant_cases, "REFERENCE_CHUNK", 16)
    case = Case(100, 8, True, "fwd", 1, 2, variant=Variant(window=(10, 0)))
    inputs = runner.make_inputs(case)
    ref = variant_cases.reference(case, inputs)["out"]
    q, k, v = (inputs[n].astype(np.float64) for n in "qkv")
    whole = flashtile.tiled_attention(q, k, v, 32, True, window=(10, 0))
    np.testing.assert_allclose(ref, whole, rtol=0, atol=1e-13)


def test_variant_only_providers_stay_out_of_custom_sweeps():
    plan = _plan("--T", "64")
    assert plan.name is None and plan.preset is None
    assert plan.providers == ["torch-sdpa", "flashtile", "numpy-naive", "numpy-tiled"]
    plan = _plan("--preset", "variants")
    assert plan.name == "variants"
    assert plan.providers == [
        "torch-sdpa",
        "flashtile",
        "flashtile-blockmask",
        "flashtile-dense",
        "flashtile-per-seq",
    ]


def test_torch_op_preset_runs_verified_and_reports_ratio_and_overhead(monkeypatch, capsys):
    pytest.importorskip("torch")
    from flashtile.bench import torch_op

    monkeypatch.setattr(torch_op, "SHAPES", ((64, 16, True), (32, 16, False)))
    args = ["bench", "--preset", "torch-op", "--H", "2", "--reps", "2"]
    assert main([*args, "--no-ceiling", "--no-memory"]) == 0
    text = capsys.readouterr().out
    rows = [line.split()[4] for line in text.splitlines() if line.startswith("fwd+bwd T=")]
    assert rows == ["torch-sdpa", "flashtile", "flashtile-torch"] * 2
    targets = [line for line in text.splitlines() if line.startswith("* target: ")]
    assert len(targets) == 4
    assert (
        "time(torch-sdpa) / time(flashtile-torch)" in targets[0] and "target >= 0.8" in targets[0]
    )
    assert "torch-layer overhead" in targets[1] and "target <= 5%: " in targets[1]
    assert all("no target at this size" in line for line in targets[2:])
    assert "flashtile-torch" not in [p.name for p in providers.make_providers()]  # opt-in


def test_decode_bench_cases_verify_and_report_targets():
    from flashtile.bench import decode
    from flashtile.bench.decode import decode_table, run_decode_cases, target_lines

    rows = run_decode_cases(lengths=(256, 1024), reps=1)
    names = [r.case for r in rows]
    assert names[:4] == ["Tk=256", "Tk=1024", "Tk=1024, paged 16", "Tk=1024, paged 256"]
    assert names[-1] == "B=16, lengths 16..512"
    assert all(r.flashtile > 0 for r in rows)
    assert all(r.read > 0 and r.fraction == r.read / r.flashtile for r in rows[:-1])
    assert rows[-1].read is None  # the padded batch is judged by its valid bytes instead
    table = decode_table(rows)
    assert len(table) == 2 + len(rows) and "| % of ceiling |" in table[0]
    lines = target_lines(rows)
    paged = [line for line in lines if ", paged " in line]
    assert [line.split(":")[0] for line in paged] == ["Tk=1024, paged 16", "Tk=1024, paged 256"]
    assert "time(paged) / time(contiguous) = " in paged[0] and "(target <= 1.25: " in paged[0]
    assert any(line.startswith("B=16, lengths 16..512: ") for line in lines)
    assert lines[0].startswith("Tk=256: GB/s / read ceiling GB/s = ")  # no floor at this length
    assert lines[0].endswith(" (no target at this size)")
    floors = decode.target_lines([dataclasses.replace(rows[1], case="Tk=65536")])
    assert "(target >= 0.75: " in floors[0] and "; stretch 0.85)" in floors[0]


def test_decode_preset_runs_end_to_end(monkeypatch, capsys):
    from flashtile.bench import decode

    run = functools.partial(decode.run_decode_bench, lengths=(256,))
    small = dataclasses.replace(presets.PRESETS["decode"], run=run)
    monkeypatch.setitem(presets.PRESETS, "decode", small)
    assert main(["bench", "--decode", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine : ")
    header = next(line for line in lines if line.startswith("decode  : "))
    assert header.startswith("decode  : q (B, 32, 1, 128)") and "read ceiling" in header
    rows = [line.split(" | ")[0] for line in lines if line.startswith("| Tk=")]
    assert rows == [
        "| Tk=256",
        "| Tk=256, paged 16",
        "| Tk=256, paged 256",
        "| Tk=256, float16 cache",
        "| Tk=256, bfloat16 cache",
    ]
    bf16 = [line for line in lines if line.startswith("* target: Tk=256, bfloat16 cache: ")]
    assert "time(float32 cache) / time(bfloat16 cache) = " in bf16[0]
    assert "(target >= 1.7: " in bf16[0] and "; stretch 1.9)" in bf16[0]
    assert "read ceiling GB/s of its bytes = " in bf16[1]
    assert any(line.startswith("* target: Tk=256, paged 16: time(paged)") for line in lines)


def test_decode_is_a_preset_and_refuses_the_options_it_would_ignore(capsys):
    for argv in (["--decode"], ["--preset", "decode"]):
        plan = _plan(*argv, "--reps", "3")
        assert plan.name == "decode" and plan.preset.run is not None and not plan.cases
    assert main(["bench", "--decode", "--plot", "x.png", "--B", "2"]) == 2
    assert "--preset decode does not use --B --plot: drop them" in capsys.readouterr().err
    assert main(["bench", "--decode", "--T", "64"]) == 2
    assert "--preset decode fixes the cases" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--decode", "--preset", "core"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_generate_preset_runs_end_to_end_with_identical_tokens(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from flashtile.bench import generate

    tiny = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}
    llama = {**tiny, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    gpt2 = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64, "vocab_size": 128}
    cases = (
        generate.ModelCase("tiny gpt2", "gpt2", gpt2, prompt=9, floor=1e-3),
        generate.ModelCase("tiny llama", "llama", llama, prompt=16, floor=1e9),
    )
    monkeypatch.setattr(generate, "CASES", cases)
    argv = ["bench", "--preset", "generate", "--reps", "2", "--new-tokens", "3"]
    for kind in generate.CACHE_KINDS:
        assert main([*argv, "--cache", kind]) == 0
        lines = capsys.readouterr().out.splitlines()
        rows = [line for line in lines if line.startswith("| tiny ")]
        assert [r.split(" | ")[0] for r in rows] == ["| tiny gpt2", "| tiny llama"]
        assert all(f"| 3 | {kind} |" in r and r.endswith("| identical |") for r in rows)
        targets = [line for line in lines if line.startswith("* target: ")]
        assert "tiny gpt2, prompt 9: tokens/s(flashtile) / tokens/s(sdpa) = " in targets[0]
        assert "(target >= 0.001x: met" in targets[0] and ": missed" in targets[1]


def test_generate_exits_1_and_says_so_when_tokens_differ(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from flashtile.bench import generate

    def differ(case, *args):
        raise generate.TokensDiffer(f"{case.label}: differ at new token 3")

    monkeypatch.setattr(generate, "run_generate_case", differ)
    assert main(["bench", "--preset", "generate", "--reps", "1"]) == 1
    out, err = capsys.readouterr()
    assert "* FAILED: GPT-2 small shape (12 layers, 12 heads, d 64): differ at" in out
    assert "flashtile bench: FAILED: Llama shape" in err


def test_generate_refuses_different_tokens_and_foreign_options(capsys):
    from flashtile.bench.generate import TokensDiffer, check_tokens

    check_tokens([5, 6, 7], [5, 6, 7], "same")
    differ = "at new token 1 \\(flashtile \\[9, 7\\], sdpa \\[6, 7\\]"
    with pytest.raises(TokensDiffer, match=differ):
        check_tokens([5, 9, 7], [5, 6, 7], "m")
    with pytest.raises(TokensDiffer, match="at new token 2"):
        check_tokens([5, 6], [5, 6, 7], "m")
    assert main(["bench", "--decode", "--new-tokens", "4"]) == 2
    assert "--preset decode does not use --new-tokens: drop them" in capsys.readouterr().err
    assert main(["bench", "--T", "64", "--cache", "static"]) == 2
    assert "a custom sweep does not use --cache: drop them" in capsys.readouterr().err
    assert main(["bench", "--preset", "generate", "--B", "2"]) == 2
    assert "--preset generate does not use --B: drop them" in capsys.readouterr().err


def test_help_lists_every_preset_by_what_it_measures(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    words = " ".join(text.split())  # the epilog is wrapped to the terminal
    for name, preset in presets.PRESETS.items():
        assert f" {name} {preset.measures}" in words
    assert "issue" not in text.lower()
    assert set(presets.PRESETS) >= {"core", "quick", "variants", "torch-op", "decode", "generate"}


def test_rounds_are_shuffled_then_reversed_and_slow_calls_stop_at_the_budget(monkeypatch):
    from flashtile.bench import timing

    names = ["a", "b", "c", "d"]
    orders = timing.round_orders(names, 6, seed=1)
    assert all(sorted(o) == names for o in orders)
    assert all(orders[r + 1] == orders[r][::-1] for r in (0, 2, 4))
    assert len({tuple(o) for o in orders[::2]}) > 1  # reshuffled, not one fixed order
    # Every provider's mean position within its rounds is the same.
    assert {sum(o.index(n) for o in orders) for n in names} == {9}
    assert timing.round_orders(names, 6, seed=1) == orders  # seeded: reruns repeat it

    clock = iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    seen = []
    calls = {"fast": lambda: None, "slow": lambda: [next(clock), next(clock)]}
    times = timing.interleaved_times(calls, 5, budget=6.0, on_call=lambda n, r: seen.append((n, r)))
    assert times["fast"] == [1.0] * 5  # every round
    assert times["slow"] == [3.0, 3.0]  # 3 s a call: stops once 6 s are spent
    assert [r for n, r in seen if n == "slow"] == [0, 1]


def test_one_target_line_format():
    from flashtile.bench.targets import target_line

    assert (
        target_line("T=64: time(a) / time(b)", 12.345, 10, at_least=True, unit="x", stretch=20)
        == "T=64: time(a) / time(b) = 12.35x (target >= 10x: met; stretch 20x)"
    )
    assert target_line("r", 1.6, 1.5, at_least=False) == "r = 1.60 (target <= 1.5: missed)"
    assert target_line("o", 0.031, 0.05, at_least=False, unit="%") == (
        "o = +3.1% (target <= 5%: met)"
    )
    assert target_line("o", -0.02, None, at_least=False, unit="%") == (
        "o = -2.0% (no target at this size)"
    )
    with pytest.raises(ValueError, match="unit must be one of"):
        target_line("r", 1.0, 1.0, at_least=True, unit="s")


def test_bfloat16_cases_run_the_bf16_paths(capsys):
    args = ["bench", "--T", "64", "--d", "16", "--H", "2", "--dtype", "bfloat16", "--reps", "1"]
    providers = ["--providers", "flashtile", "torch-sdpa", "numpy-tiled"]
    assert main([*args, *providers, "--no-ceiling", "--no-memory"]) == 0
    text = capsys.readouterr().out
    assert "bfloat16: " in text and "bfloat16, B=1" in text
    rows = [line for line in text.splitlines() if line.startswith("fwd")]
    assert len(rows) == 12 and all(" bf16 " in r for r in rows)
    assert all("float32 only" in r for r in rows if "numpy-tiled" in r)
    assert not [r for r in rows if "FAILED" in r or "ERROR" in r]
    with pytest.raises(ValueError, match="float32 only"):
        Case(64, 16, False, "fwd", variant=Variant(kv_heads=1), dtype="bfloat16")


def test_the_loaded_step_alone_pools_each_providers_processes(monkeypatch):
    # The calls preset's loaded step with each provider alone in a process of
    # its own: processes taking turns, their calls pooled, the marked line of
    # their output read, a failed one reported; the child's body times the step.
    import types

    from flashtile.bench import calls

    seen = []

    def run(argv, **kwargs):
        who = "flashtile" if "'flashtile'" in argv[-1] else "SDPA"
        seen.append(who)
        times = [1.0, 2.0, 9.0] if who == "flashtile" else [3.0, 3.0, 3.0]
        out = f"a line\n{calls._ALONE_MARK}{json.dumps(times)}\nanother\n"
        return types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    monkeypatch.setattr(calls.subprocess, "run", run)
    monkeypatch.setattr(calls, "ALONE_ROUNDS", 2)
    got = calls._alone_times(2)
    assert sorted(seen) == ["SDPA", "SDPA", "flashtile", "flashtile"]
    mean, median = (f"{calls.ALONE}, {stat}" for stat in ("mean", "median"))
    assert got[(mean, "flashtile")] == [4.0] and got[(median, "flashtile")] == [2.0]
    assert got[(mean, "SDPA")] == got[(median, "SDPA")] == [3.0]
    failed = types.SimpleNamespace(returncode=-9, stdout="", stderr="Killed")
    monkeypatch.setattr(calls.subprocess, "run", lambda argv, **kwargs: failed)
    with pytest.raises(RuntimeError, match=r"failed \(exit -9\):\nKilled"):
        calls._alone_times(2)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(calls, "ALONE_CALLS", 3)
    monkeypatch.setattr(calls, "ALONE_WARMUP", 2)
    times = calls.step_alone("flashtile", torch.get_num_threads())
    assert len(times) == 3 and all(t > 0 for t in times)

"""The HBM-traffic model behind ``flashtile io``: hand counts, scaling, closed forms, errors."""

from __future__ import annotations

import argparse
import io
import math

import pytest

from flashtile.learn.io_table import add_parser, io_table, run_io
from flashtile.learn.iomodel import (
    Blocks,
    closed_forms,
    default_blocks,
    paper_blocks,
    parse_sram,
    standard_backward_io,
    standard_forward_io,
    tile_sizes,
    tiled_backward_io,
    tiled_forward_io,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["io", *argv])


# ---- counts by hand: N=4, d=2, M=16 ----------------------------------------
# paper_blocks: Bc = ceil(16 / (4*2)) = 2, Br = min(2, d=2) = 2, so Tc = Tr = 2.


def test_paper_blocks_tiny():
    assert paper_blocks(2, 16) == Blocks(br=2, bc=2)
    assert paper_blocks(64, 32768) == Blocks(br=64, bc=128)  # Bc = 32768/256, Br capped at d
    assert paper_blocks(64, 1000) == Blocks(br=4, bc=4)  # ceil(1000/256) = 4
    assert default_blocks(64, 32768, "q-outer") == Blocks(br=128, bc=64)  # roles swapped


def test_standard_forward_by_hand():
    c = standard_forward_io(4, 2, bytes_per_element=2)
    # reads: Q 8 + K 8 + S 16 + P 16 + V 8 = 56; writes: S 16 + P 16 + O 8 = 40
    assert (c.reads, c.writes) == (56, 40)
    assert c.by_array["S"] == (16, 16) and c.by_array["P"] == (16, 16)
    assert c.total == 4 * 4**2 + 4 * 4 * 2  # the closed form 4N^2 + 4Nd is exact
    assert (c.read_bytes, c.write_bytes, c.total_bytes) == (112, 80, 192)


def test_standard_backward_by_hand():
    c = standard_backward_io(4, 2)
    # reads: P 16+16, dP 16, dS 16+16 (N^2 arrays) = 80; dO 8+8, V 8, K 8, Q 8 = 40
    # writes: dP 16, dS 16 = 32; dV 8, dQ 8, dK 8 = 24
    assert (c.reads, c.writes) == (120, 56)
    assert c.by_array["dS"] == (32, 16)
    assert c.total == closed_forms(4, 2, 16)["standard_backward"] == 7 * 16 + 8 * 8


def test_tiled_forward_kv_outer_by_hand():
    c = tiled_forward_io(4, 2, 16)
    # init: write O 4*2 = 8, l 4, m 4                                   -> writes 16
    # per K/V tile j (2 of them): read K_j 2*2 = 4, V_j 4                  -> reads 8
    #   per Q tile i (2 of them): read Q_i 4, O_i 4, l_i 2, m_i 2          -> reads 12
    #                             write O_i 4, l_i 2, m_i 2                -> writes 8
    # reads  = 2 * (8 + 2 * 12) = 64
    # writes = 16 + 2 * 2 * 8   = 48
    assert (c.reads, c.writes) == (64, 48)
    assert c.by_array["K"] == (8, 0)  # every K tile loaded exactly once
    assert c.by_array["Q"] == (16, 0)  # all of Q once per K/V pass: Tc * N * d = 2 * 8
    assert c.by_array["O"] == (16, 8 + 16)  # zero-fill plus one write-back per pass
    assert not {"S", "P"} & set(c.by_array)  # the N x N matrices never reach HBM


def test_tiled_forward_q_outer_by_hand():
    c = tiled_forward_io(4, 2, 16, order="q-outer")
    # blocks swapped: Br = 2, Bc = min(2, 2) = 2
    # per Q tile i (2 of them): read Q_i 4; per K/V tile (2): read K_j 4 + V_j 4 = 8
    #                           write O_i 4 and the log-sum-exp L_i 2
    # reads = 2 * (4 + 2 * 8) = 40; writes = 2 * (4 + 2) = 12
    assert (c.reads, c.writes) == (40, 12)
    assert c.by_array["O"] == (0, 8)  # written once, never read back


def test_tiled_backward_by_hand():
    c = tiled_backward_io(4, 2, 16)
    # init: write dQ, dK, dV 8 each                                        -> writes 24
    # per K/V tile j (2): read K_j 4, V_j 4                                 -> reads 8
    #   per Q tile i (2): read Q_i, O_i, dO_i, dQ_i 4 each, l_i, m_i 2 each -> reads 20
    #                     write dQ_i 4                                      -> writes 4
    #   write dK_j 4, dV_j 4                                                -> writes 8
    # reads = 2 * (8 + 2 * 20) = 96; writes = 24 + 2 * (2 * 4 + 8) = 56
    assert (c.reads, c.writes) == (96, 56)
    assert c.by_array["dQ"] == (16, 8 + 16)


# ---- edge tiles -----------------------------------------------------------


def test_edge_tiles_counted_exactly():
    # N=5, d=2, M=24: Bc = ceil(24/8) = 3, Br = min(3, 2) = 2
    # K/V tiles [3, 2], Q tiles [2, 2, 1]: the last tiles are short
    assert tile_sizes(5, 3) == [3, 2] and tile_sizes(5, 2) == [2, 2, 1]
    c = tiled_forward_io(5, 2, 24)
    # init writes: O 10, l 5, m 5 = 20
    # K, V: each tile read once: (3 + 2) * 2 = 10 each -> reads 20
    # per K/V tile (2): the Q tiles read Q 10, O 10, l 5, m 5 = 30; write O 10, l 5, m 5 = 20
    # reads = 20 + 2 * 30 = 80; writes = 20 + 2 * 20 = 60
    assert (c.reads, c.writes) == (80, 60)
    q = tiled_forward_io(5, 2, 24, order="q-outer")
    # swapped: Q tiles [3, 2], K/V tiles [2, 2, 1]; per Q tile all of K, V: 2 * 5 * 2 = 20
    # reads = Q 10 + 2 * 20 = 50; writes = O 10 + L 5 = 15
    assert (q.reads, q.writes) == (50, 15)


@pytest.mark.parametrize("n", [1, 7, 100, 129, 1000])
@pytest.mark.parametrize(("d", "sram"), [(2, 24), (8, 100), (64, 32768), (64, 5000)])
def test_simulation_matches_exact_pass_formula(n, d, sram):
    # With Tc = ceil(N / Bc) passes, Algorithm 1 moves exactly
    # reads 2Nd + Tc (2Nd + 2N) and writes (Nd + 2N)(Tc + 1); edge tiles included.
    tc = math.ceil(n / paper_blocks(d, sram).bc)
    c = tiled_forward_io(n, d, sram)
    assert (c.reads, c.writes) == (2 * n * d + tc * (2 * n * d + 2 * n), (n * d + 2 * n) * (tc + 1))
    b = tiled_backward_io(n, d, sram)
    assert (b.reads, b.writes) == (2 * n * d + tc * (4 * n * d + 2 * n), 5 * n * d + tc * n * d)


# ---- scaling claims and closed forms ---------------------------------------


def test_halving_sram_about_doubles_tiled_traffic():
    n, d = 16384, 64
    for sram in (65536, 131072):
        for order in ("kv-outer", "q-outer"):
            grow = tiled_forward_io(n, d, sram // 2, order).total
            grow /= tiled_forward_io(n, d, sram, order).total
            assert 1.9 < grow < 2.0
        grow = tiled_backward_io(n, d, sram // 2).total / tiled_backward_io(n, d, sram).total
        assert 1.9 < grow < 2.0


def test_standard_ignores_sram_and_grows_as_n_squared():
    table = io_table([2048, 4096], 64, [32768, 131072])
    rows = [line.split() for line in table.splitlines() if line.split()[:1] == ["4096"]]
    assert len(rows) == 2 and rows[0][5:7] == rows[1][5:7]  # same standard bytes for both M
    # doubling N: (4 (2N)^2 + 8Nd) / (4N^2 + 4Nd) = 4 - 2d / (N + d), tending to 4
    for n, low in ((1024, 3.8), (8192, 3.98)):
        assert low < standard_forward_io(2 * n, 64).total / standard_forward_io(n, 64).total < 4
        assert low < standard_backward_io(2 * n, 64).total / standard_backward_io(n, 64).total < 4


def test_simulated_within_constant_factor_of_closed_form():
    # Stated bound: 1 <= simulated / (c N^2 d^2 / M) <= 1.5 whenever M = 4d * 2^k <= N d / 4
    # (at least 16 passes). Below 1 is impossible there: Bc = M/(4d) exactly, so the
    # loop makes at least 4Nd/M passes and moves at least c N d per pass.
    ratios = []
    for n in (512, 1000, 4096):
        for d in (16, 64, 128):
            for sram in (64 * d, 256 * d, 1024 * d):
                if sram > n * d / 4:
                    continue
                closed = closed_forms(n, d, sram)
                ratios += [
                    tiled_forward_io(n, d, sram).total / closed["tiled_forward"],
                    tiled_forward_io(n, d, sram, "q-outer").total / closed["tiled_forward_q_outer"],
                    tiled_backward_io(n, d, sram).total / closed["tiled_backward"],
                ]
    assert len(ratios) >= 18
    assert min(ratios) >= 1.0 and max(ratios) <= 1.5


def test_tiled_beats_standard_by_about_m_over_3d2():
    # standard / tiled -> 4N^2 / (12 N^2 d^2 / M) = M / (3 d^2) for long sequences
    n, d, sram = 16384, 64, 131072
    saving = standard_forward_io(n, d).total / tiled_forward_io(n, d, sram).total
    assert 0.9 * sram / (3 * d * d) < saving < sram / (3 * d * d)


# ---- errors ----------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match=r"M >= 256"):
        paper_blocks(64, 255)  # M < 4d: not one row each of Q, K, V, O fits
    with pytest.raises(ValueError, match="M >= 8"):
        tiled_forward_io(4, 2, 7)
    with pytest.raises(ValueError, match="N"):
        standard_forward_io(0, 64)
    with pytest.raises(TypeError, match="d"):
        tiled_backward_io(16, True, 1024)
    with pytest.raises(TypeError, match="M"):
        tiled_forward_io(16, 2, 64.0)
    with pytest.raises(ValueError, match="order"):
        tiled_forward_io(16, 2, 64, order="row-major")
    with pytest.raises(ValueError, match="pair"):
        tiled_forward_io(16, 2, 64, blocks=4)
    with pytest.raises(ValueError, match="Bc"):
        tiled_forward_io(16, 2, 64, blocks=(2, 0))
    with pytest.raises(ValueError, match="tile pairs"):
        tiled_forward_io(10**6, 64, 256)  # 10^12 tile pairs: refused, not run


def test_parse_sram():
    assert parse_sram("65536") == 65536
    assert parse_sram("100KB", bytes_per_element=2) == 50_000
    assert parse_sram("64KiB") == 16384
    assert parse_sram("1MiB", 2) == 2**19
    assert parse_sram("1023B", 4) == 255  # a partial element holds nothing
    for bad in ("", "abc", "-5", "1.5", "64XB", "0KB"):
        with pytest.raises(ValueError, match="--sram"):
            parse_sram(bad)


# ---- the command -----------------------------------------------------------


def test_io_command_prints_table_and_claims():
    out = io.StringIO()
    assert run_io(_parse("--N", "1024", "4096", "--sram", "32768", "65536"), out=out) == 0
    text = out.getvalue()
    assert "sim/closed kv" in text and "64 x 128" in text
    assert "M 65536 -> 32768 (x0.5) at N=4096: tiled traffic x1.9" in text
    assert "standard traffic at N=4096 is 260.0 MiB for every M" in text
    assert "(N^2 predicts x16)" in text
    assert "backward" not in text


def test_io_command_backward_and_bytes():
    out = io.StringIO()
    args = _parse("--N", "2048", "--sram", "128KiB", "--bytes-per-element", "2", "--backward")
    assert run_io(args, out=out) == 0
    text = out.getvalue()
    assert "2 bytes per element" in text and "65536" in text  # 128 KiB / 2 B
    assert "tiled bwd" in text and "Algorithm 4" in text


def test_io_command_errors(capsys):
    assert run_io(_parse("--d", "64", "--sram", "100"), out=io.StringIO()) == 2
    assert "M >= 256" in capsys.readouterr().err
    assert run_io(_parse("--sram", "lots"), out=io.StringIO()) == 2
    assert "--sram 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--N", "0")

"""flashtile.distributed without processes: block plans, layouts, thread counts, early errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch", reason="flashtile.distributed runs on torch.distributed")

import torch

from dense import variant_visibility
from flashtile.distributed import (
    ring_attention,
    sequence_positions,
    set_num_threads,
    shard_sequence,
)
from flashtile.distributed.blocks import band, plan_blocks
from flashtile.distributed.layout import segments, to_layout_order, to_sequence_order
from flashtile.distributed.threads import ENV_VAR, threads_per_process

BANDS = [
    (False, None),
    (True, None),
    (True, (0, None)),
    (True, (2, 0)),
    (True, (4, 0)),
    (True, (13, 0)),
    (False, (1, 1)),
    (False, (0, 0)),
    (False, (3, 7)),
    (False, (None, 2)),
    (False, (5, None)),
    (False, (0, 4)),
]


def _global_visibility(total, causal, window):
    return variant_visibility((1, 1, total, total), causal, window=window)[0, 0]


def _covered(blocks, n_q, n_k):
    """How many blocks make each (local query, local key) pair visible, by flashtile's rule."""
    count = np.zeros((n_q, n_k), dtype=int)
    for blk in blocks:
        shape = (1, 1, blk.q1 - blk.q0, blk.k1 - blk.k0)
        vis = variant_visibility(shape, blk.causal, window=blk.window)[0, 0]
        count[blk.q0 : blk.q1, blk.k0 : blk.k1] += vis
        if blk.full:
            assert vis.all()
    return count


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_blocks_cover_exactly_the_visible_pairs(layout, world, chunk):
    total = chunk * (2 * world if layout == "zigzag" else world)
    for (causal, window), rank, src in itertools.product(BANDS, range(world), range(world)):
        mine, theirs = segments(total, rank, world, layout), segments(total, src, world, layout)
        rows = np.concatenate([np.arange(s, s + n) for s, n in mine])
        cols = np.concatenate([np.arange(s, s + n) for s, n in theirs])
        want = _global_visibility(total, causal, window)[np.ix_(rows, cols)]
        blocks = plan_blocks(mine, theirs, *band(causal, window))
        got = _covered(blocks, len(rows), len(cols))
        assert got.max(initial=0) <= 1, (causal, window, rank, src, blocks)
        np.testing.assert_array_equal(got == 1, want, err_msg=f"{causal} {window} {rank} {src}")


def test_zigzag_causal_steps_do_equal_work():
    # Zigzag balances causal work: every step against another rank's keys is the same size.
    total, world = 64, 4
    lo, hi = band(True, None)
    for rank in range(world):
        for src in set(range(world)) - {rank}:
            mine, theirs = (
                segments(total, rank, world, "zigzag"),
                segments(total, src, world, "zigzag"),
            )
            blocks = plan_blocks(mine, theirs, lo, hi)
            # One full call per remote step, of 2 C^2 pairs (C = 8 tokens per chunk).
            assert len(blocks) == 1 and blocks[0].full
            assert (blocks[0].q1 - blocks[0].q0) * (blocks[0].k1 - blocks[0].k0) == 2 * 8 * 8


def test_own_shard_under_causal_is_one_call():
    for layout in ("zigzag", "contiguous"):
        mine = segments(24, 1, 3, layout)
        blocks = plan_blocks(mine, mine, *band(True, None))
        assert [(b.q0, b.q1, b.k0, b.k1, b.causal) for b in blocks] == [(0, 8, 0, 8, True)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_and_sequence_order_round_trip(layout):
    world, total = 3, 18
    x = np.arange(2 * total * 4).reshape(2, total, 4)
    shards = [shard_sequence(x, r, world, layout=layout, dim=1) for r in range(world)]
    assert all(s.shape == (2, total // world, 4) for s in shards)
    np.testing.assert_array_equal(to_sequence_order(np.concatenate(shards, 1), world, layout, 1), x)
    np.testing.assert_array_equal(to_layout_order(x, world, layout, 1), np.concatenate(shards, 1))
    t = torch.arange(total)
    for r in range(world):
        pos = sequence_positions(total, r, world, layout=layout)
        assert pos.dtype == torch.int64
        assert torch.equal(pos, shard_sequence(t, r, world, layout=layout, dim=0))


def test_zigzag_positions_example():
    assert sequence_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sequence_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_length_errors_name_the_multiple():
    with pytest.raises(ValueError, match=r"multiple of 6 .*pad it to 24.*contiguous"):
        sequence_positions(21, 0, 3)
    with pytest.raises(ValueError, match=r"multiple of 3 \(the world size\); pad it to 24"):
        shard_sequence(np.zeros((22, 2)), 0, 3, layout="contiguous", dim=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        sequence_positions(8, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="rank=2"):
        sequence_positions(8, 2, 2)
    with pytest.raises(ValueError, match="out of range"):
        shard_sequence(np.zeros((4, 2)), 0, 2, dim=2)


def test_band_validates_window():
    assert band(True, (3, 5)) == (-3, 0)
    assert band(False, (None, -1)) == (-np.inf, np.inf)
    with pytest.raises(ValueError, match="pair"):
        band(False, 3)
    with pytest.raises(ValueError, match="window left=-2"):
        band(False, (-2, 0))
    with pytest.raises(TypeError, match="causal"):
        band(1, None)


def test_threads_rules(monkeypatch):
    import numba

    top = numba.config.NUMBA_NUM_THREADS
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("flashtile.distributed.threads._cores", lambda: 8)
    assert threads_per_process(2) == min(4, top)
    assert threads_per_process(16) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads_per_process(2) == 1
    monkeypatch.setenv(ENV_VAR, "1")
    assert threads_per_process(2) == 1
    monkeypatch.setenv(ENV_VAR, "zero")
    with pytest.raises(ValueError, match=ENV_VAR):
        threads_per_process(2)
    try:
        set_num_threads(1)
        assert threads_per_process(2) == 1
        with pytest.raises(ValueError, match="positive"):
            set_num_threads(0)
    finally:
        set_num_threads(None)


def test_needs_an_initialised_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.zeros(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)


def test_warns_once_when_idle_pool_threads_would_spin(monkeypatch):
    import warnings

    import numba

    from flashtile.distributed import threads

    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 4)
    monkeypatch.setattr(threads, "_spinning_layer", lambda: True)
    monkeypatch.setattr(threads, "_warned", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads._warn_if_pool_spins(1)  # passive threads sleep: nothing to say
        monkeypatch.delenv("OMP_WAIT_POLICY")
        threads._warn_if_pool_spins(4)  # the pool is this process's share
    with pytest.warns(RuntimeWarning, match="NUMBA_NUM_THREADS=1 "):
        threads._warn_if_pool_spins(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads._warn_if_pool_spins(1)  # once per process

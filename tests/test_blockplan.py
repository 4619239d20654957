"""blockplan.py: an epoch's order looked up at any position, checked against the whole
order built the plain way."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from shardkit.order import blockplan

ROUND_KEYS = blockplan.key(7, n=blockplan.ROUNDS)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, blockplan.SMALL, blockplan.SMALL + 1, 300_001])
def test_permute_is_a_permutation_with_its_inverse(n: int) -> None:
    x = np.arange(n)
    y = blockplan.permute(x, n, ROUND_KEYS)
    assert np.array_equal(np.sort(y), x)
    assert np.array_equal(blockplan.permute(y, n, ROUND_KEYS, inverse=True), x)
    if n > 16:  # (3 values: one key in 6 leaves them be)
        assert not np.array_equal(y, x)
        assert not np.array_equal(y, blockplan.permute(x, n, blockplan.key(8, n=blockplan.ROUNDS)))
    some = np.array([0, n - 1, n // 2])  # looked up alone, a value goes where it goes in the whole
    assert np.array_equal(blockplan.permute(some, n, ROUND_KEYS), y[some])


def test_small_permutations_come_in_every_order_about_equally() -> None:
    """The orders of 4 values over 2,400 keys: each of the 24 about 100 times (a 6-round
    Feistel network on so few bits gives some orders twice as often as others)."""
    seen = Counter(tuple(blockplan.permute(np.arange(4), 4, blockplan.key(e, n=6)).tolist()) for e in range(2400))
    assert len(seen) == 24
    chi2 = sum((c - 100) ** 2 / 100 for c in seen.values())
    assert chi2 < 50  # 23 degrees of freedom: p < 0.001 above 49.7


def test_feistel_orders_mix_where_they_start() -> None:
    """Above SMALL values: consecutive values land far apart, in both halves of the range."""
    n = blockplan.SMALL * 3
    y = blockplan.permute(np.arange(1000), n, ROUND_KEYS)
    assert np.median(np.abs(np.diff(y))) > n / 10
    assert 400 < (y < n // 2).sum() < 600


def whole_order(counts: list[int], block: int, keys: np.ndarray) -> list[int]:
    """The epoch built the plain way: every block listed, then the blocks permuted."""
    blocks, first = [], 0
    for c in counts:
        blocks += [list(range(first + s, first + min(s + block, c))) for s in range(0, c, block)]
        first += c
    order = blockplan.permute(np.arange(len(blocks)), len(blocks), keys) if blocks else []
    return [i for b in order for i in blocks[b]]


def test_block_order_matches_the_whole_order_at_any_position() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        counts = rng.integers(0, 30, size=int(rng.integers(0, 8))).tolist()
        block, keys = int(rng.integers(1, 9)), blockplan.key(trial, n=blockplan.ROUNDS)
        order = blockplan.BlockOrder(np.array(counts, dtype=np.int64), block, keys)
        expected = whole_order(counts, block, keys)
        assert order.total == len(expected)
        assert order.ids(np.arange(order.total)).tolist() == expected, (counts, block)
        if expected:
            some = rng.integers(0, order.total, size=20)
            assert order.ids(some).tolist() == [expected[i] for i in some]


def test_block_order_of_many_blocks() -> None:
    """More blocks than SMALL (the Feistel network), short blocks in most shards."""
    counts = np.random.default_rng(1).integers(0, 40, size=12_000)
    order = blockplan.BlockOrder(counts, 3, ROUND_KEYS)
    assert order.blocks > blockplan.SMALL
    assert order.ids(np.arange(order.total)).tolist() == whole_order(counts.tolist(), 3, ROUND_KEYS)


def test_unshuffled_block_order_is_the_samples_own() -> None:
    order = blockplan.BlockOrder(np.array([5, 0, 3]), 2, None)
    assert order.ids(np.arange(8)).tolist() == list(range(8))


def test_window_order_permutes_within_windows_and_each_window_alone() -> None:
    """Windows of 80 start at 10 samples and double: 10, 20, 40, then 80 each."""
    assert blockplan.ramp(80).tolist() == [0, 10, 30, 70]
    k = blockplan.key(3)[0]
    stream = blockplan.window_order(k, 0, 403, 80)
    assert sorted(stream.tolist()) == list(range(403))
    bounds = [0, 10, 30, 70, 150, 230, 310, 390, 403]
    for start, stop in zip(bounds, bounds[1:]):
        window = stream[start:stop]
        assert sorted(window.tolist()) == list(range(start, stop))
        assert np.array_equal(window, blockplan.window_order(k, start, stop, 80))
        for i in (start, stop - 1):
            assert blockplan.window_bounds(i, 80) == (start, stop if stop < 403 else 470)
    assert blockplan.window_of(np.array([0, 9, 10, 69, 70, 149, 150]), 80).tolist() == [0, 0, 1, 2, 3, 3, 4]
    assert not np.array_equal(stream, np.arange(403))
    assert not np.array_equal(stream, blockplan.window_order(blockplan.key(4)[0], 0, 403, 80))


def test_block_order_with_a_block_per_shard_keeps_each_block_whole() -> None:
    """A compressed shard is one block: its samples come together, in order; the others in
    blocks of 4, and the whole is a permutation."""
    counts, block = np.array([10, 7, 9, 0, 5]), np.array([4, 7, 4, 4, 5])
    keys = blockplan.key(11, n=blockplan.ROUNDS)
    ids = blockplan.BlockOrder(counts, block, keys).ids(np.arange(int(counts.sum())))
    assert sorted(ids.tolist()) == list(range(31))
    assert not np.array_equal(ids, np.arange(31))
    where = {int(i): p for p, i in enumerate(ids)}
    assert [where[i] for i in range(10, 17)] == list(range(where[10], where[10] + 7))  # shard 1 whole
    assert [where[i] for i in range(26, 31)] == list(range(where[26], where[26] + 5))  # shard 4 whole
    assert np.array_equal(ids[5:9], blockplan.BlockOrder(counts, block, keys).ids(np.arange(5, 9)))


def whole_mix(counts: list[int], keys: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Every draw of every part, sorted by its key: the mixed epoch built whole."""
    mix = blockplan.Interleave(np.array(counts), keys)
    part = np.repeat(np.arange(len(counts)), counts)
    draw = np.concatenate([np.arange(c) for c in counts])
    order = np.lexsort((draw, part, mix._key(part, draw)))
    return part[order], draw[order]


@pytest.mark.parametrize("shuffle", [False, True])
def test_interleave_at_any_range_matches_the_whole_mix(shuffle: bool) -> None:
    rng = np.random.default_rng(2)
    for trial in range(150):
        counts = rng.integers(1, 50, size=int(rng.integers(1, 7))).tolist()
        keys = blockplan.key(trial) if shuffle else None
        part, draw = whole_mix(counts, keys)
        mix = blockplan.Interleave(np.array(counts), keys)
        lo = int(rng.integers(0, len(part) + 1))
        hi = int(rng.integers(lo, len(part) + 1))
        got_part, got_draw = mix.at(lo, hi)
        assert got_part.tolist() == part[lo:hi].tolist() and got_draw.tolist() == draw[lo:hi].tolist()
        positions = rng.permutation(len(part))[: len(part) // 2]
        got_part, got_draw = mix.draws(positions)
        assert np.array_equal(got_part, part[positions]) and np.array_equal(got_draw, draw[positions])
        for d in range(len(counts)):  # a part's draws come in order, each once
            assert draw[part == d].tolist() == list(range(counts[d]))


def test_evenly_spread_mix_is_the_one_shardkit_always_made() -> None:
    """The formula of shardkit 0.1 (dataset d's i-th draw at (i + 0.5) / counts[d])."""
    for counts in ([6, 2], [3, 3, 3], [7, 5, 1, 9], [100, 3, 77]):
        c = np.array(counts)
        labels = np.repeat(np.arange(len(c)), c)
        within = np.arange(len(labels)) - np.repeat(np.cumsum(c) - c, c)
        before = labels[np.argsort((within + 0.5) / np.repeat(c, c), kind="stable")]
        assert np.array_equal(blockplan.Interleave(c, None).at(0, len(labels))[0], before)


def test_shuffled_mix_keeps_every_stretch_in_proportion() -> None:
    """Part d's j-th draw lies in the j-th 1/counts[d] of the epoch: any stretch of positions
    holds each part in proportion, give or take two."""
    counts = np.array([500, 300, 200])
    part, _ = blockplan.Interleave(counts, blockplan.key(1)).at(0, 1000)
    for lo in range(0, 1000, 100):
        got = np.bincount(part[lo : lo + 100], minlength=3)
        assert np.all(np.abs(got - counts / 10) <= 2), got
    assert not np.array_equal(part, blockplan.Interleave(counts, None).at(0, 1000)[0])


def test_interleave_of_a_billion_positions_looks_up_a_range_alone() -> None:
    counts = np.full(1000, 1_000_000)
    part, draw = blockplan.Interleave(counts, blockplan.key(1)).at(500_000_000, 500_010_000)
    assert len(part) == 10_000
    assert np.all(np.abs(draw - 500_000) < 10)  # halfway through every part
    assert math.isclose(np.bincount(part, minlength=1000).mean(), 10)

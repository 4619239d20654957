"""partition.py: who reads which sample, as plain arithmetic (no files, one tiny DataLoader)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shardkit.order import partition, turns
from shardkit.order.partition import Layout
from shardkit.order.progress import Progress, Segments
from shardkit.order.progress import remaining as remaining_spans

# 3 workers on a 2-core runner is deliberate: torch warns, and warnings are errors here
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

# Shard sample counts: empty, tiny (fewer samples than W*N for most layouts), uneven, with
# empty shards, with shards longer than a block, and the 120-sample fixture's shape.
COUNTS = {
    "none": [],
    "empty-shard": [0],
    "one": [1],
    "three": [3],
    "uneven": [5, 0, 2, 9],
    "blocks": [13, 1, 70, 100, 3],
    "fixture": [7] * 17 + [1],
    "big": [250],
}
LAYOUTS = list(itertools.product(range(1, 6), range(1, 6)))  # (world size, workers per rank)


def layout(
    world: int,
    workers: int,
    *,
    shuffle: bool = True,
    remainder: str = "repeat",
    seed: int = 3,
    epoch: int = 0,
    window: int = 16,
    segment: int = 0,
) -> Layout:
    return Layout(world, workers, seed, epoch, shuffle, window, remainder, segment)


def global_sequence(counts: list[int], *, seed: int, epoch: int, shuffle: bool, block: int) -> np.ndarray:
    """The whole epoch's sequence of sample ids (what a worker looks up a part of)."""
    order = partition.epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, block=block)
    return order.ids(np.arange(order.total))


def worker_stream(sequence: np.ndarray, lay: Layout, rank: int, worker: int) -> np.ndarray:
    return sequence[partition.worker_positions(len(sequence), lay, rank, worker)]


def remaining(sequence: np.ndarray, lay: Layout, progress: Progress) -> np.ndarray:
    """The ids of `sequence` that `progress` has not delivered, in order."""
    spans = remaining_spans(len(sequence), lay, progress)
    return np.concatenate([sequence[a:b] for a, b in spans.tolist()] or [np.empty(0, np.int64)])


def streams(sequence: np.ndarray, lay: Layout) -> dict[tuple[int, int], np.ndarray]:
    """{(rank, worker): ids} for every worker of every rank."""
    return {(r, w): worker_stream(sequence, lay, r, w) for r in range(lay.world_size) for w in range(lay.num_workers)}


def rank_ids(st: dict[tuple[int, int], np.ndarray], rank: int) -> list[int]:
    return [int(i) for (r, _), ids in sorted(st.items()) if r == rank for i in ids]


# ---------------------------------------------------------------- ranks and workers


@pytest.mark.parametrize("remainder", partition.REMAINDERS)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("name", COUNTS)
def test_every_layout_splits_the_epoch_evenly(name: str, shuffle: bool, remainder: str) -> None:
    counts = COUNTS[name]
    total = sum(counts)
    seq = global_sequence(counts, seed=1, epoch=2, shuffle=shuffle, block=4)
    for world, workers in LAYOUTS:
        lay = layout(world, workers, shuffle=shuffle, remainder=remainder, window=5)
        st = streams(seq, lay)
        per_rank = partition.per_rank(total, world, remainder)
        expected = -(-total // world) if remainder == "repeat" else total // world
        assert per_rank == expected
        sizes = {r: [len(st[r, w]) for w in range(workers)] for r in range(world)}
        where = f"{name} W={world} N={workers}"
        # per-worker sizes depend only on (R, N): identical on every rank, so equal batch counts
        assert all(s == sizes[0] for s in sizes.values()), where
        assert max(sizes[0], default=0) - min(sizes[0], default=0) <= 1, where
        ranks = [rank_ids(st, r) for r in range(world)]
        for r, ids in enumerate(ranks):
            assert len(ids) == per_rank, where
            assert len(set(ids)) == len(ids), f"{where}: rank {r} repeats a sample"
            assert all(0 <= i < total for i in ids), where
        union = set(itertools.chain.from_iterable(ranks))
        delivered = sum(len(ids) for ids in ranks)
        if remainder == "repeat":
            assert union == set(range(total)), where
            assert delivered - total == world * per_rank - total < world, where
        else:
            assert union <= set(range(total)), where
            assert total - len(union) < world, where
            assert delivered == len(union), f"{where}: drop must not repeat samples across ranks"


def test_worker_bounds_are_contiguous_and_cover_the_rank() -> None:
    for rank_total, workers in itertools.product(range(0, 30), range(1, 7)):
        bounds = [partition.worker_bounds(rank_total, workers, w) for w in range(workers)]
        assert bounds[0][0] == 0 and bounds[-1][1] == rank_total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        sizes = [b - a for a, b in bounds]
        assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1


def test_batched_worker_bounds_split_whole_batches() -> None:
    """With a batch size, workers get whole batches (only the rank's last one may be short),
    so the rank yields ceil(R / B) batches whatever the number of workers."""
    for rank_total, workers, batch in itertools.product(range(0, 40), range(1, 6), range(1, 7)):
        bounds = [partition.worker_bounds(rank_total, workers, w, batch) for w in range(workers)]
        assert bounds[0][0] == 0 and bounds[-1][1] == rank_total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        sizes = [b - a for a, b in bounds]
        assert sum(-(-s // batch) for s in sizes) == -(-rank_total // batch)
        last = max((w for w, s in enumerate(sizes) if s), default=None)
        assert all(s % batch == 0 for w, s in enumerate(sizes) if w != last)
        full = [-(-s // batch) for s in sizes]
        assert max(full) - min(full) <= 1
    assert partition.worker_bounds(10, 3, 1) == partition.worker_bounds(10, 3, 1, batch=1)


def test_worker_stream_window_shuffle_permutes_only_within_windows() -> None:
    """Windows start small (a first batch needs few blocks) and double up to `window`."""
    seq = global_sequence([40, 33, 27], seed=5, epoch=1, shuffle=True, block=8)
    plain = worker_stream(seq, layout(2, 3, shuffle=False), 1, 2)
    mixed = worker_stream(seq, layout(2, 3, window=6), 1, 2)
    again = worker_stream(seq, layout(2, 3, window=6), 1, 2)
    assert np.array_equal(mixed, again)  # reproducible
    assert not np.array_equal(mixed, plain)
    start, size = 0, 1  # windows of 6 // 8 (at least 1), doubling up to 6: 1, 2, 4, 6, 6, ...
    while start < len(plain):
        assert sorted(mixed[start : start + size]) == sorted(plain[start : start + size])
        start, size = start + size, min(6, 2 * size)
    # the input sequence is left untouched
    assert np.array_equal(seq, global_sequence([40, 33, 27], seed=5, epoch=1, shuffle=True, block=8))


def test_per_rank_rejects_unknown_remainder() -> None:
    with pytest.raises(ValueError, match="remainder"):
        partition.per_rank(10, 2, "pad")


# ---------------------------------------------------------------- global order


@pytest.mark.parametrize("name", ["uneven", "blocks", "fixture", "big"])
def test_global_sequence_is_a_reproducible_permutation(name: str) -> None:
    counts = COUNTS[name]
    total = sum(counts)
    seq = global_sequence(counts, seed=7, epoch=3, shuffle=True, block=4)
    assert seq.dtype == np.int64
    assert sorted(seq.tolist()) == list(range(total))
    assert np.array_equal(seq, global_sequence(counts, seed=7, epoch=3, shuffle=True, block=4))
    assert not np.array_equal(seq, global_sequence(counts, seed=7, epoch=4, shuffle=True, block=4))
    assert not np.array_equal(seq, global_sequence(counts, seed=8, epoch=3, shuffle=True, block=4))
    assert not np.array_equal(seq, np.arange(total))
    for seed, epoch in [(0, 0), (7, 3), (-1, 2**40)]:
        plain = global_sequence(counts, seed=seed, epoch=epoch, shuffle=False, block=4)
        assert np.array_equal(plain, np.arange(total))


def test_global_sequence_keeps_blocks_of_one_shard_together() -> None:
    counts = [10, 0, 7, 16]
    block = 4
    first = np.concatenate([[0], np.cumsum(counts)])
    seq = global_sequence(counts, seed=2, epoch=0, shuffle=True, block=block)
    # cut the sequence where it stops counting up by one: every run is whole blocks of one shard
    runs = np.split(seq, np.flatnonzero(np.diff(seq) != 1) + 1)
    blocks = set()
    for shard, n in enumerate(counts):
        for start in range(0, n, block):
            blocks.add(tuple(range(first[shard] + start, first[shard] + min(start + block, n))))
    found = set()
    for run in runs:
        run = run.tolist()
        while run:
            head = next(b for b in blocks if b[0] == run[0])
            assert tuple(run[: len(head)]) == head
            found.add(head)
            run = run[len(head) :]
    assert found == blocks


def test_global_sequence_of_nothing() -> None:
    for counts in ([], [0], [0, 0]):
        assert global_sequence(counts, seed=0, epoch=0, shuffle=True, block=64).tolist() == []
        assert partition.per_rank(0, 3, "repeat") == 0 == partition.per_rank(0, 3, "drop")


def test_shuffle_mixes_classes_of_a_class_sorted_dataset() -> None:
    """10 shards of 100 samples, each shard one class (as when packing without shuffle):
    every 32-sample stretch a worker yields must hold several classes, not one."""
    counts = [100] * 10
    seq = global_sequence(counts, seed=0, epoch=0, shuffle=True, block=64)
    lay = layout(2, 2, window=1024)
    for (rank, worker), ids in streams(seq, lay).items():
        classes = ids // 100
        windows = [set(classes[i : i + 32].tolist()) for i in range(0, len(ids) - 31, 32)]
        assert len(windows) >= 7
        assert min(len(w) for w in windows) >= 2, (rank, worker)
        # (2.25: the first windows are 1/8 and 1/4 of the window, two or three blocks each;
        # 2.4-2.6 by the draw)
        assert np.mean([len(w) for w in windows]) >= 2.25, (rank, worker)
    # the same check fails without shuffling: the test does tell the two apart
    plain = global_sequence(counts, seed=0, epoch=0, shuffle=False, block=64)
    ids = worker_stream(plain, layout(2, 2, shuffle=False), 0, 0)
    assert len(set((ids[:32] // 100).tolist())) == 1


# ---------------------------------------------------------------- resume


def delivered(sequence: np.ndarray, lay: Layout, progress: Progress) -> list[int]:
    return [int(i) for (r, w), ids in streams(sequence, lay).items() for i in ids[: progress.yielded[w]]]


def progress_after(sequence: np.ndarray, lay: Layout, batch_size: int, batches: int) -> Progress:
    """Progress of a DataLoader that handed out `batches` batches on every rank."""
    r = partition.per_rank(len(sequence), lay.world_size, lay.remainder)
    sizes = [b - a for a, b in (partition.worker_bounds(r, lay.num_workers, w) for w in range(lay.num_workers))]
    seen = min(batches * batch_size, r)
    return Progress(lay.world_size, lay.num_workers, turns.yielded_after(sizes, batch_size, seen))


RESUMES = [
    # (counts, (W, N) before, (W, N) after, batch size, batches before the checkpoint)
    ([7] * 17 + [1], (2, 3), (3, 2), 5, 3),
    ([7] * 17 + [1], (1, 1), (4, 5), 8, 7),
    ([13, 1, 70, 100, 3], (5, 4), (1, 1), 2, 4),
    ([13, 1, 70, 100, 3], (3, 1), (2, 5), 16, 1),
    ([5, 0, 2, 9], (2, 2), (5, 3), 1, 2),
    ([250], (4, 3), (3, 4), 4, 0),
    ([250], (2, 2), (2, 2), 7, 9),
]


@pytest.mark.parametrize("remainder", partition.REMAINDERS)
@pytest.mark.parametrize("counts, before, after, batch, k", RESUMES)
def test_elastic_resume_delivers_the_rest_once(counts, before, after, batch, k, remainder) -> None:
    total = sum(counts)
    seq = global_sequence(counts, seed=4, epoch=6, shuffle=True, block=4)
    first = layout(*before, remainder=remainder, seed=4, epoch=6)
    prog = progress_after(seq, first, batch, k)
    done = delivered(seq, first, prog)
    rest = remaining(seq, first, prog)
    assert set(rest.tolist()).isdisjoint(done)
    assert set(rest.tolist()) | set(done) == set(range(total))
    assert len(set(rest.tolist())) == len(rest) == total - len(set(done))
    # the rest keeps the sequence's order
    pos = {int(v): i for i, v in enumerate(seq)}
    assert all(pos[int(a)] < pos[int(b)] for a, b in itertools.pairwise(rest))

    second = layout(*after, remainder=remainder, seed=4, epoch=6, segment=1)
    st = streams(rest, second)
    later = [int(i) for ids in st.values() for i in ids]
    per_rank = partition.per_rank(len(rest), second.world_size, remainder)
    for r in range(second.world_size):
        ids = rank_ids(st, r)
        assert len(ids) == per_rank and len(set(ids)) == len(ids)
    if remainder == "repeat":
        assert set(later) == set(rest.tolist())
        assert set(done) | set(later) == set(range(total))
        assert len(later) - len(rest) < second.world_size  # padding only
    else:
        assert set(later) <= set(rest.tolist()) and len(later) == len(set(later))
        assert len(rest) - len(later) < second.world_size
    assert set(done).isdisjoint(later)


def test_chained_resumes_deliver_every_sample() -> None:
    counts = [13, 1, 70, 100, 3]
    total = sum(counts)
    seq = global_sequence(counts, seed=9, epoch=2, shuffle=True, block=8)
    epoch = seq
    left = Segments(total)  # what the dataset keeps: spans, not ids
    seen: list[int] = []
    segments = [((3, 2), 4, 5), ((2, 5), 3, 2), ((4, 1), 6, 1)]
    for segment, ((world, workers), batch, k) in enumerate(segments):
        lay = layout(world, workers, seed=9, epoch=2, segment=segment)
        prog = progress_after(seq, lay, batch, k)
        assert sum(prog.yielded) > 0
        got = delivered(seq, lay, prog)
        assert set(got).isdisjoint(seen)
        seen += got
        seq = remaining(seq, lay, prog)
        left = left.after(lay, prog)
        assert left.left == len(seq)
        assert set(seq.tolist()) == set(range(total)) - set(seen)
    final = layout(3, 3, seed=9, epoch=2, segment=len(segments))
    for (rank, worker), ids in streams(seq, final).items():
        positions = partition.worker_positions(left.left, final, rank, worker)
        assert np.array_equal(epoch[left.base(positions)], ids)
    tail = [int(i) for ids in streams(seq, final).values() for i in ids]
    assert set(seen) | set(tail) == set(range(total))
    assert set(seen).isdisjoint(tail)
    assert len(tail) - len(seq) < 3


def test_remaining_of_a_finished_or_untouched_segment() -> None:
    seq = global_sequence([7] * 5, seed=0, epoch=0, shuffle=True, block=2)
    lay = layout(2, 2)
    assert np.array_equal(remaining(seq, lay, Progress(2, 2, (0, 0))), seq)
    r = partition.per_rank(len(seq), 2, "repeat")
    full = tuple(b - a for a, b in (partition.worker_bounds(r, 2, w) for w in range(2)))
    assert remaining(seq, lay, Progress(2, 2, full)).tolist() == []


def test_progress_json_round_trip_and_validation() -> None:
    p = Progress(3, 2, (4, 5))
    assert Progress.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="worker counts"):
        Progress.from_json({"world_size": 3, "num_workers": 2, "yielded": [1, 2, 3]})


# ---------------------------------------------------------------- yielded_after vs torch


class _Tagged(IterableDataset):
    """Each worker yields (worker id, i) for i < its size."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __iter__(self):
        info = get_worker_info()
        w = 0 if info is None else info.id
        return iter([(w, i) for i in range(self.sizes[w])])


@pytest.mark.parametrize(
    "sizes, batch_size, drop_last",
    [
        ([9, 9, 8], 4, False),  # uneven last batches
        ([5, 4], 5, False),  # one worker one batch short
        ([12, 12, 11], 3, True),
        ([3, 2, 2], 2, True),
        ([1, 0, 0], 4, False),  # workers with nothing to give
        ([17], 5, False),
    ],
)
def test_yielded_after_matches_a_real_dataloader(sizes: list[int], batch_size: int, drop_last: bool) -> None:
    loader = DataLoader(_Tagged(sizes), num_workers=len(sizes), batch_size=batch_size, drop_last=drop_last)
    taken = [0] * len(sizes)
    seen = 0
    checks = [(0, tuple(taken))]
    for worker_ids, positions in loader:
        w = int(worker_ids[0])
        assert torch.all(worker_ids == w)  # a batch comes from one worker
        assert positions.tolist() == list(range(taken[w], taken[w] + len(positions)))
        taken[w] += len(positions)
        seen += len(positions)
        checks.append((seen, tuple(taken)))
    assert seen == (sum(s // batch_size * batch_size for s in sizes) if drop_last else sum(sizes))
    for seen, expected in checks:
        assert turns.yielded_after(sizes, batch_size, seen, drop_last) == expected, seen


def test_yielded_after_round_robin_by_hand() -> None:
    assert turns.yielded_after([10, 10], 3, 0) == (0, 0)
    assert turns.yielded_after([10, 10], 3, 3) == (3, 0)
    assert turns.yielded_after([10, 10], 3, 9) == (6, 3)
    assert turns.yielded_after([10, 10], 3, 19) == (10, 9)  # the two last batches hold one sample each
    assert turns.yielded_after([10, 10], 3, 20) == (10, 10)
    assert turns.yielded_after([10, 10], 3, 18, drop_last=True) == (9, 9)


@pytest.mark.parametrize(
    "seen, drop_last, message",
    [
        (21, False, "hands out 0 to 20 samples"),
        (-1, False, "hands out 0 to 20 samples"),
        (20, True, "hands out 0 to 18 samples"),
        (4, False, "not a whole number of batches of this loader: it hands out 3 and then 6"),
        (17, False, "it hands out 15 and then 18"),
    ],
)
def test_yielded_after_refuses_what_no_loader_hands_out(seen: int, drop_last: bool, message: str) -> None:
    with pytest.raises(ValueError, match=f"samples_seen={seen}.*{message}"):
        turns.yielded_after([10, 10], 3, seen, drop_last)


# ---------------------------------------------------------------- world()


def test_world_from_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert partition.world(2, 5) == (2, 5)
    with pytest.raises(ValueError, match="both"):
        partition.world(1, None)
    with pytest.raises(ValueError, match="outside"):
        partition.world(3, 3)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert partition.world() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert partition.world() == (3, 4)
    assert partition.worker() == (0, 1)


def test_repeat_pads_with_the_first_samples_of_the_order() -> None:
    """With repeat, the samples delivered twice are exactly the first ones of the order."""
    counts = [5, 0, 2, 9]
    seq = global_sequence(counts, seed=1, epoch=0, shuffle=True, block=3)
    lay = layout(3, 2)
    c = Counter(int(i) for ids in streams(seq, lay).values() for i in ids)
    twice = sorted(i for i, n in c.items() if n == 2)
    assert max(c.values()) == 2
    assert twice == sorted(seq[: 3 * 6 - 16].tolist())


def test_taken_after_a_number_of_batches_matches_the_count_of_samples() -> None:
    """`taken_after` (by batches handed out) agrees with `yielded_after` (by samples)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        counts = rng.integers(0, 40, rng.integers(1, 6)).tolist()
        size = int(rng.integers(1, 9))
        batches = sum(-(-c // size) for c in counts)
        for k in range(batches + 1):
            taken = turns.taken_after(counts, size, k)
            assert turns.yielded_after(counts, size, sum(taken)) == taken
            assert sum(-(-t // size) for t in taken) == k

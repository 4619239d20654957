"""Global batches (globalbatch.py), as arithmetic: the batches of an epoch are the same for
every world size and num_workers, each sample comes once, resume continues the sequence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardkit.order import globalbatch


def plan(
    total: int,
    size: int,
    *,
    shuffle: bool = True,
    remainder: str = "repeat",
    window: int = 64,
    piece: int = 4,
    epoch: int = 0,
    seed: int = 5,
) -> globalbatch.GlobalBatches:
    return globalbatch.plan(
        total, size, remainder=remainder, shuffle=shuffle, window=window, piece=piece, seed=seed, epoch=epoch
    )


def loader_batches(
    gb: globalbatch.GlobalBatches, world: int, workers: int, start: int = 0, skip: dict[int, int] | None = None
) -> list[np.ndarray]:
    """The global batches as W ranks' DataLoaders hand them over (batch j of a rank from
    worker j % N), each global batch the ranks' slices side by side."""
    b = gb.size // world
    per_rank = []
    for rank in range(world):
        streams = [
            np.concatenate(
                [
                    np.empty(0, np.int64),
                    *globalbatch.worker_chunks(gb, start, world, rank, workers, w, (skip or {}).get(w, 0), chunk=3 * b),
                ]
            )
            for w in range(workers)
        ]
        local = [s.reshape(-1, b) for s in streams]
        taken = [0] * workers
        out = []
        for j in itertools.count():  # round robin over the workers, as torch's DataLoader takes them
            w = j % workers
            if taken[w] == len(local[w]):
                break
            out.append(local[w][taken[w]])
            taken[w] += 1
        per_rank.append(out)
    return [np.concatenate(parts) for parts in zip(*per_rank)]


@pytest.mark.parametrize("total,size", [(1000, 12), (37, 6), (64, 64), (5, 12), (2000, 48)])
@pytest.mark.parametrize("remainder", ["repeat", "drop"])
def test_the_same_batches_under_every_layout(total: int, size: int, remainder: str) -> None:
    gb = plan(total, size, remainder=remainder)
    whole = loader_batches(gb, 1, 1)
    assert len(whole) == gb.batches
    for world in (w for w in range(1, size + 1) if size % w == 0):
        for workers in (1, 2, 3, 5):
            got = loader_batches(gb, world, workers)
            assert len(got) == len(whole) and all((a == b).all() for a, b in zip(got, whole)), (world, workers)


@pytest.mark.parametrize("remainder", ["repeat", "drop"])
def test_each_sample_once_and_a_shuffle_by_seed_and_epoch(remainder: str) -> None:
    total, size = 1003, 16
    gb = plan(total, size, remainder=remainder)
    flat = np.concatenate(loader_batches(gb, 1, 1))
    counts = np.bincount(flat, minlength=total)
    if remainder == "repeat":  # padded by the sequence's start: every sample, the first few twice
        assert counts.min() == 1 and counts.sum() == gb.batches * size and counts.max() <= 2
    else:
        assert counts.max() == 1 and counts.sum() == total // size * size
    assert not (flat[: total // 2] == np.arange(total // 2)).all()  # shuffled
    again = np.concatenate(loader_batches(plan(total, size, remainder=remainder), 4, 3))
    assert (again == flat).all()
    for other in (plan(total, size, remainder=remainder, epoch=1), plan(total, size, remainder=remainder, seed=6)):
        assert not (np.concatenate(loader_batches(other, 1, 1)) == flat).all()
    plain = np.concatenate(loader_batches(plan(total, size, remainder=remainder, shuffle=False), 2, 2))
    assert (plain == np.arange(len(plain)) % total).all()


def test_a_batch_takes_runs_of_pieces_from_its_window() -> None:
    gb = plan(4096, 64, window=256, piece=8)
    batches = loader_batches(gb, 1, 1)
    for k, batch in enumerate(batches):
        window = k * 64 // 256
        assert ((batch // 256) == window).all()  # within its window
        runs = batch.reshape(-1, 8)
        assert (np.diff(runs, axis=1) == 1).all()  # pieces of 8 consecutive positions
    assert len({tuple(sorted(b // 8 % 32)) for b in batches[:4]}) == 4  # the window's pieces spread over its batches


def test_resume_at_a_batch_under_any_layout() -> None:
    gb = plan(999, 12)
    whole = loader_batches(gb, 1, 1)
    for start in (0, 1, 7, 40, gb.batches):
        for world, workers in ((1, 1), (4, 2), (3, 3), (12, 1)):
            got = loader_batches(gb, world, workers, start=start)
            assert len(got) == len(whole) - start
            assert all((a == b).all() for a, b in zip(got, whole[start:]))


def test_a_worker_skips_the_batches_it_yielded() -> None:
    gb = plan(500, 8)
    b = 8 // 2
    full = [np.concatenate(list(globalbatch.worker_chunks(gb, 0, 2, 1, 3, w))) for w in range(3)]
    for w in range(3):
        for k in (0, 1, 5):
            got = np.concatenate([np.empty(0, np.int64), *globalbatch.worker_chunks(gb, 0, 2, 1, 3, w, skip=k * b)])
            assert (got == full[w][k * b :]).all()


def test_batches_done_from_worker_counts() -> None:
    assert globalbatch.batches_done(3, [8, 8, 4], 4) == 5
    assert globalbatch.batches_done(2, [0, 0], 4) == 0
    with pytest.raises(ValueError, match=r"worker counts \[4, 8\] are not those of a loader that handed out 3 batches"):
        globalbatch.batches_done(2, [4, 8], 4)


def test_a_world_size_that_does_not_divide_the_batch_is_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=12 does not split evenly over world size 5: use a world "
        r"size that divides it \(1, 2, 3, 4, 6, 12\)",
    ):
        globalbatch.local_size(12, 5)
    assert globalbatch.local_size(12, 4) == 3


@pytest.mark.parametrize("remainder", ["repeat", "drop"])
def test_pieces_are_the_halves_of_the_blocks(remainder: str) -> None:
    """With the sequence's blocks known, a window's pieces are half blocks: a rank reads
    each of its pieces as one run of a shard, whatever short blocks shifted the blocks."""
    from shardkit.order import partition

    counts = [7, 13, 64, 5, 30, 1, 22]
    order = partition.epoch_order(counts, seed=2, epoch=0, shuffle=True, block=8)
    gb = globalbatch.plan(
        order.total, 12, remainder=remainder, shuffle=True, window=48, piece=4, seed=1, epoch=0, bounds=order.bounds
    )
    slots = np.arange(gb.slots)
    positions = gb.positions(slots)
    assert sorted(positions.tolist()) == sorted((np.arange(gb.slots) % order.total).tolist())
    starts, stops = order.bounds(0, order.total)
    block_of = np.searchsorted(starts, positions, side="right") - 1
    cut = np.flatnonzero((np.diff(positions) != 1) | (np.diff(block_of) != 0)) + 1
    runs = np.split(positions, cut)  # what a reader of the whole sequence reads as one range each
    windows = -(-gb.slots // gb.window)
    # two halves a block, and a cut where a window's edge or the padding's wrap splits one
    assert len(starts) < len(runs) <= 2 * len(starts) + windows + 2 * (remainder == "repeat")
    assert all(int(r[-1]) < stops[block_of[i]] for i, r in zip(np.append(0, cut), runs))

"""`check_save_load`: the one save-and-resume check, run against every stateful reader.

Shaped as torchdata's `run_test_save_load_state` (test/nodes/utils.py): read k items,
save the state, build the reader afresh, load the state, read to the end, and assert that
the pieces hold every sample of the epoch exactly once. The ways to save and to load are
small functions, so one check serves a StatefulDataLoader's own state, a plain DataLoader's
`resume_state`, an elastic resume into another layout and a dataset iterator's state::

    check_save_load(lambda: StatefulDataLoader(ds(), num_workers=2, batch_size=5), 3)
    check_save_load([first, other_layout], 4, save=resume_state(epoch=2), load=into_dataset)
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Iterable, Iterator, NamedTuple, Sequence

Build = Callable[[], Any]  # a DataLoader, a StatefulDataLoader, or a dataset read directly
Save = Callable[[Any, Iterator[Any], int, Any], Any]  # (reader, its live iterator, samples read, state it resumed from)
Load = Callable[[Any, Any], Iterable[Any]]  # (fresh reader, state) -> what to read to the end


def sample_keys(item: Any) -> list[Hashable]:
    """The keys one item holds: a sample's `__key__`, or a batch's list of them."""
    key = item["__key__"]
    return [key] if isinstance(key, str) else list(key)


def loader_state(reader: Any, it: Iterator[Any], seen: int, resumed_from: Any) -> Any:
    """The reader's own `state_dict()` (a StatefulDataLoader's), taken mid-pass."""
    return reader.state_dict()


def iterator_state(reader: Any, it: Iterator[Any], seen: int, resumed_from: Any) -> Any:
    """The state of the pass itself: what a StatefulDataLoader's worker saves."""
    return it.state_dict()


def resume_state(epoch: int, **layout: Any) -> Save:
    """A plain DataLoader's checkpoint: its dataset's `resume_state` for the samples handed
    out so far, chained onto the state this pass resumed from."""

    def save(loader: Any, it: Iterator[Any], seen: int, resumed_from: Any) -> Any:
        return loader.dataset.resume_state(
            epoch=epoch,
            samples_seen=seen,
            batch_size=loader.batch_size,
            num_workers=loader.num_workers,
            resumed_from=resumed_from,
            **layout,
        )

    return save


def into_loader(reader: Any, state: Any) -> Iterable[Any]:
    reader.load_state_dict(state)
    return reader


def into_dataset(loader: Any, state: Any) -> Iterable[Any]:
    loader.dataset.load_state_dict(state)
    return loader


def into_dataset_at(epoch: int) -> Load:
    """`into_dataset`, then the training loop's `set_epoch(epoch)` (`for epoch in range(start, n)`)."""

    def load(loader: Any, state: Any) -> Iterable[Any]:
        loader.dataset.load_state_dict(state)
        loader.dataset.set_epoch(epoch)
        return loader

    return load


def into_iterator(dataset: Any, state: Any) -> Iterable[Any]:
    it = iter(dataset)
    it.load_state_dict(state)
    return it


class Resumed(NamedTuple):
    pieces: list[list[Hashable]]  # keys read before the first stop, between stops, after the last
    states: list[Any]  # the state saved at each stop
    reader: Any  # the last build, read to its end (its next pass is the next epoch)


def check_save_load(
    build: Build | Sequence[Build],
    stops: int | Sequence[int],
    *,
    save: Save = loader_state,
    load: Load = into_loader,
    expected: Iterable[Hashable] | None = None,
    keys: Callable[[Any], list[Hashable]] = sample_keys,
    same_order: bool = False,
) -> Resumed:
    """Read `stops[0]` items of `build()`, save, load into a fresh build, read `stops[1]`
    items, ... then to the end; assert the pieces hold `expected` (default: one whole pass
    of a fresh first build) exactly once each, in its order too if `same_order`. `build` is
    one function for every stage or one per stage (the last one serves the rest)."""
    builds = list(build) if isinstance(build, Sequence) else [build]
    stops = [stops] if isinstance(stops, int) else list(stops)
    pieces: list[list[Hashable]] = []
    states: list[Any] = []
    reader = builds[0]()
    source: Iterable[Any] = reader
    for stage, stop in enumerate(stops):
        it = iter(source)
        piece = [k for _ in range(stop) for k in keys(next(it))]
        states.append(save(reader, it, len(piece), states[-1] if states else None))
        del it  # a plain DataLoader's workers stop here, before the next build starts its own
        pieces.append(piece)
        reader = builds[min(stage + 1, len(builds) - 1)]()
        source = load(reader, states[-1])
    pieces.append([k for item in source for k in keys(item)])
    want = list(expected) if expected is not None else [k for item in builds[0]() for k in keys(item)]
    got = [k for piece in pieces for k in piece]
    if same_order:
        assert got == want, f"resumed in another order (pieces of {[len(p) for p in pieces]})"
    missing, repeated = Counter(want) - Counter(got), Counter(got) - Counter(want)
    assert not missing and not repeated, (
        f"after resuming at {stops}: missing {sorted(missing.items())[:5]}, "
        f"repeated or foreign {sorted(repeated.items())[:5]}"
    )
    return Resumed(pieces, states, reader)

"""Resuming an epoch part way: what `load_state_dict` takes from a saved loader's state (the
epoch its next pass runs, and the progress to resume that pass from) and the state
`resume_state` writes for a plain DataLoader, each checked against the dataset's `Ordering`
(the state's schema is state.py's; EpochDataset, epochs.py, holds the result)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..order import digest, turns
from ..order.progress import Progress
from . import state
from .ordering import Ordering


def loaded(
    saved: dict[str, Any], found: list[dict[str, Any]], ordering_of: Callable[[], Ordering], batch_size: int | None
) -> tuple[int, list[dict[str, Any]] | None]:
    """(the epoch to run next, the history to resume its first pass from, or None to start
    it over) from `saved`, whose states `found` are this dataset's order's (`state.check_order`).
    `ordering_of` gives the dataset's ordering, asked only where a pass is resumed part way."""
    workers = [s for s in found if state.is_worker(s)]
    if not workers:
        return int(found[0][state.EPOCH]), None
    loader = state.find_loader(saved)
    epoch = int(workers[0][state.EPOCH])
    state.check_layout(workers)
    if loader.get(state.LOADER_FINISHED):  # StatefulDataLoader, after a whole pass
        return epoch + 1, None
    lag = loader.get(state.LOADER_LAG, 0)
    if lag:  # the workers' counts are `lag` batches old, and which worker made each is not recorded
        raise ValueError(
            f"this StatefulDataLoader state was taken {lag} step(s) after its last snapshot of the workers "
            "(snapshot_every_n_steps > 1): resume it under the same layout with the loader's own "
            "load_state_dict, or checkpoint with snapshot_every_n_steps=1 to resume under a new layout "
            "(a loader with in_order=False gives such states too, and no resume of it is exact: "
            "checkpoint with in_order=True, the default)"
        )
    ordering = ordering_of()
    earlier = list(workers[0].get(state.HISTORY, []))
    ordering.check_history(epoch, earlier)
    for s in workers:
        ordering.check_worker(epoch, earlier, s)
    _check_snapshot(
        loader,
        workers,
        ordering.worker_sizes(epoch, earlier, int(workers[0][state.WORLD_SIZE]), int(workers[0][state.NUM_WORKERS])),
        batch_size,
    )
    return epoch, ordering.record(epoch, state.history_of(workers))


def loader_state(
    ordering: Ordering,
    *,
    epoch: int,
    samples_seen: int,
    num_workers: int,
    batch_size: int,
    batch: int,
    world: int,
    rank_of: Callable[[], int],
    drop_last: bool,
    resumed_from: dict[str, Any] | None,
    resumed: dict[str, Any] | None,
) -> dict[str, Any]:
    """The loader state after a plain DataLoader of `num_workers` workers over `world` ranks
    handed out `samples_seen` samples of `epoch` in batches of `batch_size` (see
    EpochDataset.resume_state; `batch`: the dataset's own batch, 1 if it yields samples),
    counted from `resumed_from`'s progress if that pass was resumed (`resumed`: the resume
    the dataset holds, which must be that one). `rank_of`: this rank, asked last."""
    history: list[dict[str, Any]] = []
    if resumed_from is not None:
        earlier = [s for s in state.find_states(resumed_from) if state.is_worker(s)]
        if not earlier or any(s[state.EPOCH] != epoch for s in earlier):
            raise ValueError(f"resumed_from is not a resume state of epoch {epoch}")
        state.check_order(earlier, ordering.key)
        before = list(earlier[0].get(state.HISTORY, []))
        ordering.check_history(epoch, before)
        for s in earlier:
            ordering.check_worker(epoch, before, s)
        history = ordering.record(epoch, state.history_of(earlier))
        if resumed is not None and resumed["epoch"] == epoch and _plain(resumed["history"]) != _plain(history):
            raise ValueError(
                f"resumed_from is not the state this dataset resumed epoch {epoch} from (a stale "
                "checkpoint?): the new state would count from other progress and repeat or skip "
                "samples; pass the state given to load_state_dict"
            )
    elif resumed is not None and resumed["epoch"] == epoch:
        raise ValueError("this epoch was itself resumed from a partial state: pass that state as resumed_from")
    workers = max(num_workers, 1)
    sizes = ordering.worker_sizes(epoch, history, world, workers)
    yielded = turns.yielded_after(sizes, batch_size, samples_seen, drop_last)
    if samples_seen == turns.pass_length(sizes, batch_size, drop_last):
        yielded = tuple(sizes)  # a whole pass: what drop_last dropped is done with too
    saved = state.loader_state(epoch, world, workers, batch, ordering.key, history, yielded)
    rank = min(rank_of(), world - 1)
    for w, entry in enumerate(saved[state.WORKERS]):  # what a worker's own state would say it delivered
        one = Progress(world, workers, tuple(k * (i == w) for i, k in enumerate(yielded)), batch)
        entry[state.DIGEST] = state.digest_entry(rank, digest.text(ordering.fingerprint(epoch, history, one, rank, w)))
    return saved


def _plain(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A history's progress, fingerprints aside (an earlier version's states have none)."""
    return [{k: v for k, v in h.items() if k != state.DIGEST} for h in history]


def _check_snapshot(
    loader: dict[str, Any], workers: list[dict[str, Any]], sizes: list[int], batch_size: int | None
) -> None:
    """Refuse a StatefulDataLoader state whose worker snapshots are not those of the batch
    its own count says it is at (a worker's snapshot from another checkpoint: its samples
    since would come again, or never)."""
    main = loader.get(state.LOADER_SNAPSHOT, {}).get(state.MAIN_SNAPSHOT, {})
    batches = main.get(state.BATCHES_YIELDED)
    seen = (main.get(state.SAMPLER_STATE) or {}).get(state.SAMPLES_YIELDED)
    if not isinstance(batches, int) or not isinstance(seen, int) or batches <= 0 or loader.get(state.LOADER_LAG):
        return
    size = batch_size or seen // batches  # items of a DataLoader batch: a batching dataset's batch is one item
    counts = [0] * len(sizes)
    for s in workers:
        counts[int(s[state.WORKER])] = int(s[state.YIELDED])
    want = turns.taken_after(sizes, size, batches)
    # a worker at its end may have read a short last batch that drop_last dropped
    off = [w for w, (a, b) in enumerate(zip(counts, want)) if a != b and not (a == sizes[w] and b > a - size)]
    if off:
        w = off[0]
        raise ValueError(
            f"this StatefulDataLoader state is at its batch {batches}, but its snapshot of worker {w} "
            f"counts {counts[w]} samples, not {want[w]} (a stale or mixed-up state): resuming from it "
            "would repeat or skip that worker's samples"
        )

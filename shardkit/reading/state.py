"""The resume state's schema: the keys of every state dict shardkit writes, how one is
made, and how one is read back (strictly: a value that no pass could have written is
refused with one line saying which).

Three shapes, all marked ``{MARK: 1}``:

- an epoch state, ``state_dict()`` of a dataset: ``{MARK, EPOCH}``;
- a worker state, what a worker's iterator saves (StatefulDataLoader keeps one a worker):
  ``{MARK, EPOCH, WORLD_SIZE, NUM_WORKERS, BATCH, WORKER, YIELDED, ORDER, HISTORY}``;
- a loader state, ``resume_state(...)`` for a plain DataLoader: the worker state's keys
  but WORKER and YIELDED, plus ``WORKERS``: ``[{WORKER, YIELDED}, ...]``.

HISTORY lists the earlier interrupted segments of the epoch (progress.Progress as JSON),
ORDER what the epoch's order depends on (a state saved under another order would resume
the wrong samples).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .. import checks
from ..order.progress import Progress

MARK = "shardkit"  # identifies our state inside a StatefulDataLoader state dict
EPOCH, WORLD_SIZE, NUM_WORKERS, BATCH = "epoch", "world_size", "num_workers", "batch"
WORKER, YIELDED, WORKERS, ORDER, HISTORY = "worker", "yielded", "workers", "order", "history"
DIGEST = "digest"  # a fingerprint of what was delivered (digest.py): a worker's, or a history segment's
RANK, SUMS = "rank", "sums"  # a DIGEST's: the rank that delivered, and digest.text of what it did
SHUFFLE_VERSION_KEY = "shuffle_version"
# torchdata's StatefulDataLoader's own keys, read to place our states in its checkpoint
LOADER_FINISHED, LOADER_LAG = "_iterator_finished", "_steps_since_snapshot"
LOADER_SNAPSHOT, MAIN_SNAPSHOT = "_snapshot", "_main_snapshot"
BATCHES_YIELDED, SAMPLER_STATE, SAMPLES_YIELDED = "_sampler_iter_yielded", "_sampler_iter_state", "samples_yielded"

MAX_EPOCH = 2**32 - 1  # far past any run; a mixture counts epoch x samples of a part in 64 bits
# The shuffled orders' generation: 2 since shardkit 0.2 (blocks permuted by a Feistel network, windows
# by hashes, mixtures by jittered keys); a state of another generation names other samples.
SHUFFLE_VERSION = 2


def epoch_state(epoch: int) -> dict[str, Any]:
    return {MARK: 1, EPOCH: epoch}


def worker_state(
    epoch: int,
    world: int,
    num_workers: int,
    batch: int,
    worker: int,
    yielded: int,
    order: dict[str, Any],
    history: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        MARK: 1,
        EPOCH: epoch,
        WORLD_SIZE: world,
        NUM_WORKERS: num_workers,
        BATCH: batch,
        WORKER: worker,
        YIELDED: yielded,
        ORDER: order,
        HISTORY: history,
    }


def loader_state(
    epoch: int,
    world: int,
    num_workers: int,
    batch: int,
    order: dict[str, Any],
    history: list[dict[str, Any]],
    yielded: tuple[int, ...],
) -> dict[str, Any]:
    return {
        MARK: 1,
        EPOCH: epoch,
        WORLD_SIZE: world,
        NUM_WORKERS: num_workers,
        BATCH: batch,
        ORDER: order,
        HISTORY: history,
        WORKERS: [{WORKER: w, YIELDED: k} for w, k in enumerate(yielded)],
    }


def digest_entry(rank: int, sums: str) -> dict[str, Any]:
    """A DIGEST: what `rank`'s worker delivered, as digest.text writes it."""
    return {RANK: rank, SUMS: sums}


def is_worker(s: dict[str, Any]) -> bool:
    """Whether a state found by `find_states` is one worker's progress (else an epoch state)."""
    return WORKER in s


def check_layout(workers: list[dict[str, Any]]) -> None:
    first = workers[0]
    if any(s[EPOCH] != first[EPOCH] or s[NUM_WORKERS] != first[NUM_WORKERS] for s in workers):
        raise ValueError("state dict mixes workers of different epochs or layouts")
    ids = [int(s[WORKER]) for s in workers]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"state dict holds {len(ids)} worker states for {first[NUM_WORKERS]} workers (the states "
            "of several loaders?): pass the state of this dataset's loader only"
        )


def history_of(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The progress behind a loader's worker states: their own history, then how far they got."""
    check_layout(workers)
    first = workers[0]
    yielded = [0] * int(first[NUM_WORKERS])
    for s in workers:
        yielded[int(s[WORKER])] = int(s[YIELDED])
    progress = Progress(int(first[WORLD_SIZE]), int(first[NUM_WORKERS]), tuple(yielded), int(first.get(BATCH, 1)))
    return [*first.get(HISTORY, []), progress.to_json()]


def _dicts(state: Any) -> Iterator[dict[str, Any]]:
    """Every dict inside `state`, itself included, depth first (not inside our own states)."""
    if isinstance(state, dict):
        yield state
        if state.get(MARK) == 1:
            return
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        for value in state:
            yield from _dicts(value)


def find_loader(state: Any) -> dict[str, Any]:
    """The StatefulDataLoader state dict inside `state` (a training checkpoint may nest
    it), or {}."""
    loaders = [d for d in _dicts(state) if LOADER_FINISHED in d or LOADER_LAG in d]
    if len(loaders) > 1:
        raise ValueError(
            f"this state holds the states of {len(loaders)} DataLoaders: pass the state of this dataset's loader only"
        )
    return loaders[0] if loaders else {}


def find_states(state: Any) -> list[dict[str, Any]]:
    """Our state dicts anywhere inside `state` (e.g. a StatefulDataLoader state dict), a
    loader state split into one dict a worker, each checked."""
    found: list[dict[str, Any]] = []
    for d in _dicts(state):
        if d.get(MARK) == 1:
            if WORKERS in d and not (
                isinstance(d[WORKERS], (list, tuple)) and all(isinstance(w, dict) for w in d[WORKERS])
            ):
                raise ValueError(f"not a valid shardkit state: '{WORKERS}' must be a list of dicts")
            found += [{**d, **w} for w in d[WORKERS]] if WORKERS in d else [d]
    for s in found:
        _check_state(s)
    return found


def _check_state(s: dict[str, Any]) -> None:
    """Refuse a state whose values could not have come from a pass: one line saying which."""
    try:
        checks.integer(EPOCH, s[EPOCH], 0, MAX_EPOCH)
        if not isinstance(s.get(ORDER, {}), dict):
            raise TypeError(f"{ORDER} must be a dict")
        if not isinstance(s.get(HISTORY, []), (list, tuple)):
            raise TypeError(f"{HISTORY} must be a list")
        for h in s.get(HISTORY, []):
            Progress.from_json(h)
        if is_worker(s):
            workers = checks.integer(NUM_WORKERS, s[NUM_WORKERS], 1)
            checks.integer(WORKER, s[WORKER], 0, workers - 1)
            checks.integer(WORLD_SIZE, s[WORLD_SIZE], 1)
            checks.integer(YIELDED, s[YIELDED], 0)
            checks.integer(BATCH, s.get(BATCH, 1), 1)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a valid shardkit state ({type(e).__name__}: {e})") from None


def check_order(found: list[dict[str, Any]], order: dict[str, Any]) -> None:
    """Refuse progress saved from a dataset whose epochs have another order (another
    dataset, seed, shuffle, ...): it would resume the wrong samples. What a state saved by
    an earlier shardkit version did not record (all of it, or a mixture's parts) is taken
    as it is, but for the shuffle version: a shuffled order that records none is of the
    first generation, whose samples sit elsewhere."""
    saved = next((s[ORDER] for s in found if ORDER in s), None)
    if saved is None:
        return
    differ = [k for k in saved if k != SHUFFLE_VERSION_KEY and not _same(saved[k], order.get(k))]
    if differ:
        said = ", ".join(f"{k} {saved[k]!r} there, {order.get(k)!r} here" for k in differ)
        raise ValueError(f"this state was saved from a dataset whose epochs have another order ({said})")
    if saved.get(SHUFFLE_VERSION_KEY) != order.get(SHUFFLE_VERSION_KEY):
        raise ValueError(
            f"this state was saved by a shardkit whose shuffled order differs from this one's (shuffle version "
            f"{saved.get(SHUFFLE_VERSION_KEY, 1)}, here {order.get(SHUFFLE_VERSION_KEY)}): its counts would resume "
            "other samples; finish that epoch with the shardkit that saved it, or start the epoch over "
            f"(load_state_dict({{'{MARK}': 1, '{EPOCH}': N}}))"
        )


def _same(saved: Any, here: Any) -> bool:
    """Whether a saved value of the order matches this dataset's: a mixture's parts item by
    item, on the keys the saved part has (an earlier version recorded fewer)."""
    if isinstance(saved, list) and isinstance(here, list) and all(isinstance(x, dict) for x in saved + here):
        return len(saved) == len(here) and all(all(a[k] == b.get(k) for k in a) for a, b in zip(saved, here))
    return bool(saved == here)

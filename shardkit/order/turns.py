"""How a torch DataLoader takes a rank's samples from its workers: batch by batch, worker
by worker in turn (its default `in_order=True`), an exhausted worker dropping out of the
turn. A checkpoint records a count (samples or batches handed out); these say how many of
each worker's samples that count took, so that a resume skips exactly those.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_length(counts: Sequence[int], batch_size: int, drop_last: bool = False) -> int:
    """Samples a torch DataLoader hands out in a pass over workers holding `counts`."""
    return sum(c - c % batch_size if drop_last else c for c in counts)


def yielded_after(
    counts: Sequence[int], batch_size: int, samples_seen: int, drop_last: bool = False
) -> tuple[int, ...]:
    """Per-worker samples a torch DataLoader has taken after it handed out `samples_seen`
    samples: batches come from workers in turn, an exhausted worker drops out of the turn.
    Raises ValueError for a count no such loader hands out: negative, past the pass, or
    not a whole number of its batches."""
    whole = pass_length(counts, batch_size, drop_last)
    if not 0 <= samples_seen <= whole:
        raise ValueError(
            f"samples_seen={samples_seen}: a pass of this loader hands out 0 to {whole} samples (per rank)"
        )
    left = [c // batch_size if drop_last else -(-c // batch_size) for c in counts]
    taken = [0] * len(counts)
    seen = 0
    while seen < samples_seen and any(left):
        for w, c in enumerate(counts):
            if left[w] and seen < samples_seen:
                n = min(batch_size, c - taken[w])
                taken[w] += n
                seen += n
                left[w] -= 1
    if seen != samples_seen:
        raise ValueError(
            f"samples_seen={samples_seen} is not a whole number of batches of this loader: "
            f"it hands out {seen - n} and then {seen}"
        )
    return tuple(taken)


def taken_after(counts: Sequence[int], batch_size: int, batches: int) -> tuple[int, ...]:
    """Per-worker samples a torch DataLoader has taken after handing out `batches` batches
    from workers holding `counts` (in turn, an exhausted worker dropping out)."""
    rounds = min(batches // len(counts), min(c // batch_size for c in counts)) if counts else 0
    taken, handed = [rounds * batch_size] * len(counts), rounds * len(counts)  # whole rounds at once
    while handed < batches and any(t < c for t, c in zip(taken, counts)):
        for w, c in enumerate(counts):
            if taken[w] < c and handed < batches:
                taken[w] += min(batch_size, c - taken[w])
                handed += 1
    return tuple(taken)

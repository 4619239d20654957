"""A compact fingerprint of a multiset of epoch positions: its size and the sums of its
positions, their squares and their cubes, modulo 2**64 (32 bytes, 64 hex digits).

Why these sums: the fingerprint of a span [a, b) has a closed form (Faulhaber), so what a
state says was delivered (spans worked out from its counts) costs its number of spans,
while what a worker did deliver is summed position by position as it goes. The two agree
unless a sample was repeated or skipped: a repeat and a skip change the sum of the
positions; several that keep it need matching squares and cubes too (a fingerprint
against accidents, not an adversary's forgery).
"""

from __future__ import annotations

import numpy as np

MOD = 1 << 64
Digest = tuple[int, int, int, int]
ZERO: Digest = (0, 0, 0, 0)
_U = np.uint64


def add(*digests: Digest) -> Digest:
    out = [0, 0, 0, 0]
    for d in digests:
        for k in range(4):
            out[k] = (out[k] + d[k]) % MOD
    return (out[0], out[1], out[2], out[3])


def of_positions(p: np.ndarray) -> Digest:
    """The fingerprint of the positions `p` (non-negative, below 2**40)."""
    x = np.asarray(p, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        sq = x * x
        cube = sq * x
        sums = [int(v.sum(dtype=np.uint64)) for v in (x, sq, cube)]
    return (len(x) % MOD, sums[0] % MOD, sums[1] % MOD, sums[2] % MOD)


def _below(n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sums of p, p**2, p**3 over p in [0, n), modulo 2**64: each factor divided exactly
    (it is below 2**42) before the products wrap."""
    n = n.astype(np.int64)
    a, b, c = n - 1, n.copy(), 2 * n - 1  # sum p = a b / 2; sum p^2 = a b c / 6; sum p^3 = (a b / 2)^2
    even_a = a % 2 == 0
    a2, b2 = np.where(even_a, a // 2, a), np.where(even_a, b, b // 2)
    s1 = a2.astype(np.uint64) * b2.astype(np.uint64)
    thirds = [x % 3 == 0 for x in (a2, b2, c)]
    a3 = np.where(thirds[0], a2 // 3, a2)
    b3 = np.where(~thirds[0] & thirds[1], b2 // 3, b2)
    c3 = np.where(~thirds[0] & ~thirds[1], c // 3, c)
    s2 = a3.astype(np.uint64) * b3.astype(np.uint64) * c3.astype(np.uint64)
    s3 = s1 * s1
    zero = n <= 0
    return (np.where(zero, _U(0), s1), np.where(zero, _U(0), s2), np.where(zero, _U(0), s3))


def of_spans(starts: np.ndarray, stops: np.ndarray) -> Digest:
    """The fingerprint of the positions of spans [starts, stops), repeats counted."""
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    if not len(starts):
        return ZERO
    with np.errstate(over="ignore"):
        hi, lo = _below(stops), _below(starts)
        sums = [int((h - low).sum(dtype=np.uint64)) % MOD for h, low in zip(hi, lo)]
    return (int((stops - starts).sum()) % MOD, sums[0], sums[1], sums[2])


def text(d: Digest) -> str:
    return "".join(f"{v:016x}" for v in d)


def parse(s: str) -> Digest:
    if not isinstance(s, str) or len(s) != 64:
        raise ValueError(f"a digest is 64 hex digits, not {s!r}")
    v = [int(s[i : i + 16], 16) for i in range(0, 64, 16)]
    return (v[0], v[1], v[2], v[3])

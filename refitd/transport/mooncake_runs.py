"""Runs of bytes for the Mooncake writer (refitd.transport.mooncake): registered ranges and
a vectorised containment check, runs grouped into the batches posted to the engines, and
the contiguous runs of a strided view.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

Batch = tuple[int, list[int], list[int], list[int]]  # route, locals, remotes, lengths
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # int64 local addresses, remote, nbytes


class Ranges:
    """Sorted, disjoint (address, nbytes) ranges and a containment check."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = sorted((int(a), int(n)) for a, n in ranges)
        self._starts = [a for a, _ in self.ranges]

    def contains(self, addr: int, nbytes: int) -> bool:
        i = bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + nbytes <= self.ranges[i][0] + self.ranges[i][1]

    def outside(self, addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Positions of the (addr, nbytes) runs that no one range contains."""
        if not self.ranges:
            return np.arange(addr.size)
        starts = np.array(self._starts, np.int64)
        ends = starts + np.array([n for _, n in self.ranges], np.int64)
        i = np.searchsorted(starts, addr, side="right") - 1
        ok = (i >= 0) & (addr + nbytes <= ends[np.maximum(i, 0)])
        return np.flatnonzero(~ok)


def batches(runs: Runs, most: int, nbytes: int, routes: int) -> list[Batch]:
    """Runs grouped into batches of at most `most` requests and about `nbytes` bytes,
    spread over the routes batch by batch."""
    local, remote, n = runs
    if not n.size:
        return []
    before = np.cumsum(n) - n
    k = np.arange(n.size)
    starts = np.flatnonzero((k % most == 0) | (np.diff(before // nbytes, prepend=-1) != 0))
    ends = [*starts[1:].tolist(), n.size]
    return [
        (b % routes, local[a:e].tolist(), remote[a:e].tolist(), n[a:e].tolist())
        for b, (a, e) in enumerate(zip(starts.tolist(), ends, strict=True))
    ]


def view_runs(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[list[np.ndarray], int]:
    """Element offsets of the contiguous runs of a view under each of several stride sets
    (one array per set, runs in the same order) and the elements per run: the innermost
    dimensions contiguous under every set make one run."""
    dims = [(n, [s[k] for s in strides]) for k, n in enumerate(shape) if n != 1]
    run, k = 1, len(dims)
    while k and all(st == run for st in dims[k - 1][1]):
        run *= dims[k - 1][0]
        k -= 1
    offs = [np.zeros(1, np.int64) for _ in strides]
    for n, sts in dims[:k]:
        step = np.arange(n, dtype=np.int64)
        offs = [(o[:, None] + step * st).ravel() for o, st in zip(offs, sts, strict=True)]
    return offs, run

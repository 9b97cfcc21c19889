"""Message packing equals a plain next-fit over each pair's copies, whatever the sizes
(copies over a bucket go alone; runs where neighbours cannot share are cut early)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.buckets import pack


def next_fit(runs: list[list[int]], bucket: int) -> list[tuple[int, int, int]]:
    """(first copy, end, pair) of every message, one copy at a time."""
    out, at = [], 0
    for p, sizes in enumerate(runs):
        start, total = at, 0
        for i, n in enumerate(sizes):
            if at + i > start and total + n > bucket:
                out.append((start, at + i, p))
                start, total = at + i, 0
            total += n
        if sizes:
            out.append((start, at + len(sizes), p))
        at += len(sizes)
    return out


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=8),
    st.integers(1, 48),
)
def test_pack_is_next_fit(runs: list[list[int]], bucket: int) -> None:
    sizes = np.array([n for r in runs for n in r], np.int64)
    starts = np.cumsum([0] + [len(r) for r in runs[:-1]])
    s, e, p = pack(starts, sizes, bucket)
    assert list(zip(s.tolist(), e.tolist(), p.tolist(), strict=True)) == next_fit(runs, bucket)

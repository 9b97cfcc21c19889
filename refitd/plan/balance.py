"""Source replica choice: minimise the largest number of bytes any source slot sends.

Every copy has one or more candidate source slots (DP replicas, every TP rank holding a
replicated tensor). A copy whose destination slot is a candidate stays local. The rest are
assigned by water-filling: fixed copies first, then classes of identical candidate sets
from the most to the least constrained, equal-sized copies at once, largest first, each
class topping up its least loaded candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Choices:
    """Copies of one batch: candidate source slots (dense slot indices) per copy."""

    cand: np.ndarray  # [N, R] int64 dense slot index
    nbytes: np.ndarray  # [N] int64 bytes this copy sends if remote
    dst: np.ndarray  # [N] int64 dense slot index of the destination


def choose_replicas(
    batches: list[Choices], n_slots: int, load: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """The chosen candidate column per copy of every batch, and the resulting send load
    per slot (remote bytes, on top of `load` when given)."""
    load = np.zeros(n_slots, dtype=np.float64) if load is None else load.astype(np.float64)
    cols: list[np.ndarray] = []
    flex: dict[int, list[tuple[int, np.ndarray]]] = {}
    for b, ch in enumerate(batches):
        n, r = ch.cand.shape
        col = np.zeros(n, dtype=np.int64)
        if r == 1:
            remote = ch.cand[:, 0] != ch.dst
            load += np.bincount(ch.cand[remote, 0], weights=ch.nbytes[remote], minlength=n_slots)
        else:
            hit = ch.cand == ch.dst[:, None]
            local = hit.any(axis=1)
            col[local] = hit[local].argmax(axis=1)
            idx = np.flatnonzero(~local)
            if idx.size:
                flex.setdefault(r, []).append((b, idx))
        cols.append(col)
    for r in sorted(flex):
        _fill(batches, cols, flex[r], r, load)
    return cols, load


def _fill(
    batches: list[Choices],
    cols: list[np.ndarray],
    parts: list[tuple[int, np.ndarray]],
    r: int,
    load: np.ndarray,
) -> None:
    """Water-fill every copy with r candidates: per class of candidate set, per size."""
    batch_of = np.concatenate([np.full(i.size, b, dtype=np.int64) for b, i in parts])
    row_of = np.concatenate([i for _, i in parts])
    cand = np.concatenate([batches[b].cand[i] for b, i in parts])
    nbytes = np.concatenate([batches[b].nbytes[i] for b, i in parts])
    dst = np.concatenate([batches[b].dst[i] for b, i in parts])
    classes, cls = _candidate_classes(cand, load.size)
    # class, then size descending, then destination: equal-sized runs per class.
    order = np.lexsort((dst, -nbytes, cls))
    c_sorted = cls[order]
    b_sorted = nbytes[order]
    change = np.flatnonzero((np.diff(c_sorted) != 0) | (np.diff(b_sorted) != 0)) + 1
    starts = np.r_[0, change]
    ends = np.r_[change, order.size]
    chosen = np.empty(order.size, dtype=np.int64)
    load_l = load.tolist()  # per-run work on Python lists: runs are many and small
    classes_l = classes.tolist()
    c_first = c_sorted[starts].tolist()
    b_first = b_sorted[starts].tolist()
    picks: list[int] = []
    for s, e, cl, size in zip(starts.tolist(), ends.tolist(), c_first, b_first, strict=True):
        slots = classes_l[cl]
        counts = _waterfill([load_l[x] for x in slots], float(size), e - s)
        for x, k in zip(slots, counts, strict=True):
            if k:
                load_l[x] += k * size
                picks.extend([x] * k)
    chosen[order] = picks
    load[:] = load_l
    col = (cand == chosen[:, None]).argmax(axis=1)
    for b, _ in parts:
        m = batch_of == b
        cols[b][row_of[m]] = col[m]


def _candidate_classes(cand: np.ndarray, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(each class's sorted candidate set, the class of every row) for rows of candidate
    slots, rows with the same set in one class. Rows are keyed by an order-free hash (a
    sum of random per-slot words, so rows are never sorted: a tensor replicated on all of
    128 slots has 128 candidates per copy); a second independent hash checks the grouping,
    and on a collision the rows are grouped exactly instead."""
    w = np.random.default_rng(0xB1A5).integers(1, 2**63, size=(2, n_slots), dtype=np.uint64)
    h1 = w[0][cand].sum(axis=1, dtype=np.uint64)
    _, first, cls = np.unique(h1, return_index=True, return_inverse=True)
    cls = cls.reshape(-1)
    h2 = w[1][cand].sum(axis=1, dtype=np.uint64)
    if (h2 == h2[first][cls]).all():
        return np.sort(cand[first], axis=1), cls
    classes, cls = np.unique(np.sort(cand, axis=1), axis=0, return_inverse=True)
    return classes, cls.reshape(-1)


def _waterfill(loads: list[float], size: float, m: int) -> list[int]:
    """How many of m equal items of `size` each candidate takes so the largest resulting
    load is as small as possible (the items go to the least loaded first)."""
    r = len(loads)
    order = sorted(range(r), key=loads.__getitem__)
    ls = [loads[i] for i in order]
    take = [0] * r
    if size <= 0:  # weightless items: dealt evenly, least loaded first
        for j in range(r):
            take[j] = m // r + (j < m % r)
    else:
        cum, level, k = 0.0, 0.0, r
        for j in range(r):
            cum += ls[j]
            level = (m * size + cum) / (j + 1)
            if j + 1 == r or level <= ls[j + 1]:
                k = j + 1
                break
        for j in range(k):
            take[j] = max(math.floor((level - ls[j]) / size + 1e-9), 0)
        over = sum(take) - m
        if over > 0:  # float rounding: take back from the highest resulting loads
            for j in sorted(range(r), key=lambda j: -(ls[j] + take[j] * size))[:over]:
                take[j] -= 1
        rest = m - sum(take)
        if rest > 0:
            for j in sorted(range(r), key=lambda j: ls[j] + take[j] * size)[:rest]:
                take[j] += 1
    counts = [0] * r
    for j, i in enumerate(order):
        counts[i] = take[j]
    return counts

"""Source replica choice: minimise the largest number of bytes any source slot sends.

Every copy has one or more candidate source slots (DP replicas, every TP rank holding a
replicated tensor). A copy whose destination slot is a candidate stays local. The rest are
assigned by water-filling: fixed copies first, then classes of identical candidate sets
from the most to the least constrained, equal-sized copies at once, largest first, each
class topping up its least loaded candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refitd.plan.grouping import unique_groups
from refitd.plan.rowwise import row_sum
from refitd.plan.sides import sort_by
from refitd.plan.waterfill import fill_runs


@dataclass(slots=True)
class Choices:
    """Copies of one batch. Candidates come as sets: copy i may be sent by any slot of
    `sets[cls[i]]`, and the chosen column indexes that row. Copies of one tensor pattern
    share a few sets (the same replicas hold every layer of a stage), so the sets stay
    small where a [copies, candidates] matrix would not (15 M entries at 1,024 ranks)."""

    sets: np.ndarray  # [K, R] int64 dense slot indices of each candidate set
    cls: np.ndarray  # [N] int64 candidate set of each copy
    nbytes: np.ndarray  # [N] int64 bytes this copy sends if remote
    dst: np.ndarray  # [N] int64 dense slot index of the destination (-1: none)

    @classmethod
    def of_rows(cls, cand: np.ndarray, nbytes: np.ndarray, dst: np.ndarray) -> Choices:
        """One candidate row per copy ([N, R] dense slot indices)."""
        return cls(cand, np.arange(cand.shape[0]), nbytes, dst)


class _Columns:
    """Column of a slot in a copy's candidate set: with a few candidates by comparing
    each column, else by binary search over the (set, slot) pairs (never a [copies,
    candidates] comparison for wide sets)."""

    _SCAN = 8  # up to this many candidates, compare column by column

    def __init__(self, sets: np.ndarray, n_slots: int) -> None:
        k, self.r = sets.shape
        self.n_slots = n_slots
        if self.r <= self._SCAN:
            self.by_column = np.ascontiguousarray(sets.T)
            return
        keys = (np.arange(k, dtype=np.int64)[:, None] * n_slots + sets).reshape(-1)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def of(self, cls: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Column of `slot` in set `cls` per copy (its first), -1 where it is not there."""
        if self.r <= self._SCAN:
            out = np.full(cls.size, -1, np.int64)
            for j in range(self.r - 1, -1, -1):  # the first match is written last
                out[np.take(self.by_column[j], cls) == slot] = j
            return out
        if not self.keys.size:
            return np.full(cls.size, -1, np.int64)
        q = cls * self.n_slots + slot
        i = np.minimum(np.searchsorted(self.keys, q), self.keys.size - 1)
        found = (self.keys[i] == q) & (slot >= 0)
        return np.where(found, self.order[i] % self.r, -1)


def choose_replicas(
    batches: list[Choices], n_slots: int, load: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """The chosen candidate column per copy of every batch, and the resulting send load
    per slot (remote bytes, on top of `load` when given)."""
    load = np.zeros(n_slots, dtype=np.float64) if load is None else load.astype(np.float64)
    cols: list[np.ndarray] = []
    columns: list[_Columns | None] = []
    flex: dict[int, list[tuple[int, np.ndarray]]] = {}
    for b, ch in enumerate(batches):
        r = ch.sets.shape[1]
        col = np.zeros(ch.cls.size, dtype=np.int64)
        if r == 1:
            first = ch.sets[ch.cls, 0]
            remote = first != ch.dst
            load += np.bincount(first[remote], weights=ch.nbytes[remote], minlength=n_slots)
            columns.append(None)
        else:
            at = _Columns(ch.sets, n_slots)
            hit = at.of(ch.cls, ch.dst)
            local = hit >= 0
            col[local] = hit[local]
            idx = np.flatnonzero(~local)
            if idx.size:
                flex.setdefault(r, []).append((b, idx))
            columns.append(at)
        cols.append(col)
    for r in sorted(flex):
        _fill(batches, columns, cols, flex[r], load)
    return cols, load


def _fill(
    batches: list[Choices],
    columns: list[_Columns | None],
    cols: list[np.ndarray],
    parts: list[tuple[int, np.ndarray]],
    load: np.ndarray,
) -> None:
    """Water-fill every copy of `parts` (all with r candidates): per class of candidate
    set (equal sets of several batches are one class), per size."""
    set_base = np.cumsum([0] + [batches[b].sets.shape[0] for b, _ in parts])
    classes, class_of_set = _candidate_classes(
        np.concatenate([batches[b].sets for b, _ in parts]), load.size
    )
    cls = np.concatenate(
        [
            class_of_set[base + batches[b].cls[i]]
            for base, (b, i) in zip(set_base[:-1], parts, strict=True)
        ]
    )
    nbytes = np.concatenate([batches[b].nbytes[i] for b, i in parts])
    dst = np.concatenate([batches[b].dst[i] for b, i in parts])
    # class, then size descending, then destination: equal-sized runs per class.
    order = sort_by(cls, nbytes.max(initial=0) - nbytes, dst + 1)
    c_sorted = cls[order]
    b_sorted = nbytes[order]
    change = np.flatnonzero((np.diff(c_sorted) != 0) | (np.diff(b_sorted) != 0)) + 1
    starts = np.r_[0, change]
    ends = np.r_[change, order.size]
    runs = fill_runs(classes, c_sorted[starts], b_sorted[starts], ends - starts, load)
    chosen = np.empty(order.size, dtype=np.int64)
    chosen[order] = np.repeat(classes[c_sorted[starts]].reshape(-1), runs.reshape(-1))
    at = 0
    for b, i in parts:
        got = columns[b].of(batches[b].cls[i], chosen[at : at + i.size])  # type: ignore[union-attr]
        cols[b][i] = got
        at += i.size


def _candidate_classes(cand: np.ndarray, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(each class's sorted candidate set, the class of every row) for rows of candidate
    slots, rows with the same set in one class. Rows are keyed by an order-free hash (a
    sum of random per-slot words, so rows are never sorted: a tensor replicated on all of
    128 slots has 128 candidates per copy), and on a collision grouped exactly instead."""
    w = _hash_words(0xB1A5, n_slots)
    groups = _hash_groups(row_sum(w[0][cand]), row_sum(w[1][cand]))
    if groups is not None:
        first, cls = groups
        return np.sort(cand[first], axis=1), cls
    classes, cls = np.unique(np.sort(cand, axis=1), axis=0, return_inverse=True)
    return classes, cls.reshape(-1)


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows, the index of each row among them) of a non-negative int
    matrix, like np.unique(axis=0) but keyed by a positional hash (one 1-D unique instead
    of a sort of row records), and on a collision grouped exactly instead."""
    if not rows.size:
        return np.unique(rows, axis=0, return_inverse=True)
    w = _hash_words(0x5EED, rows.shape[1])
    r = rows.astype(np.uint64)
    groups = _hash_groups(row_sum(r * w[0]), row_sum(r * w[1]))
    if groups is not None:
        first, inv = groups
        return rows[first], inv
    out, inv = np.unique(rows, axis=0, return_inverse=True)
    return out, inv.reshape(-1)


def _hash_words(seed: int, n: int) -> np.ndarray:
    """[2, n] random 64-bit words: two independent row hashes over n keys."""
    return np.random.default_rng(seed).integers(1, 2**63, size=(2, n), dtype=np.uint64)


def _hash_groups(h1: np.ndarray, h2: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(first row of each group, group of every row) of rows grouped by hash h1, when the
    independent hash h2 agrees within every group; None on a collision."""
    _, first, inv = unique_groups(h1)
    return (first, inv) if (h2 == h2[first][inv]).all() else None

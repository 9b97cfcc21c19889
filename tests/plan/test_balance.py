"""Replica choice: candidate sets shared by many copies give the choice one row per copy
gives, local copies stay local, the busiest slot is within one copy of the ideal, and
runs water-filled together take what they take one at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.balance import Choices, choose_replicas, unique_rows
from refitd.plan.waterfill import _waterfill, fill_runs

FEW = settings(max_examples=60, deadline=None)


@st.composite
def copies(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(sets [K, R], set of each copy, bytes, destination slot (-1: none), slot count)."""
    n_slots = draw(st.integers(2, 12))
    r = draw(st.integers(1, n_slots))
    k = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sets = np.stack([rng.choice(n_slots, r, replace=False) for _ in range(k)])
    n = draw(st.integers(1, 60))
    cls = rng.integers(0, k, n)
    nbytes = rng.choice([0, 1, 7, 64, 4096], n)
    dst = rng.integers(-1, n_slots, n)
    return sets, cls, nbytes, dst, n_slots


@FEW
@given(copies())
def test_shared_sets_choose_as_rows(case: tuple) -> None:
    sets, cls, nbytes, dst, n_slots = case
    rng = np.random.default_rng(len(cls))
    # one row per copy, each in its own column order
    rows = np.stack([rng.permutation(sets[c]) for c in cls])
    (col_sets,), load_sets = choose_replicas([Choices(sets, cls, nbytes, dst)], n_slots)
    (col_rows,), load_rows = choose_replicas([Choices.of_rows(rows, nbytes, dst)], n_slots)
    by_sets = sets[cls, col_sets]
    by_rows = rows[np.arange(cls.size), col_rows]
    assert (by_sets == by_rows).all()
    assert np.allclose(load_sets, load_rows)
    # a destination among the candidates receives locally and loads nobody
    local = (sets[cls] == dst[:, None]).any(axis=1)
    assert (by_sets[local] == dst[local]).all()
    remote = ~local
    expect = np.bincount(by_sets[remote], weights=nbytes[remote], minlength=n_slots)
    assert np.allclose(load_sets, expect)


@FEW
@given(copies())
def test_busiest_slot_within_one_copy_of_ideal(case: tuple) -> None:
    """With one candidate set and no local copies, water-filling leaves the busiest slot
    at most one (largest) copy above the even share."""
    sets, _, nbytes, _, n_slots = case
    n = nbytes.size
    choice = Choices(sets[:1], np.zeros(n, np.int64), nbytes, np.full(n, -1))
    (col,), load = choose_replicas([choice], n_slots)
    assert col.min() >= 0 and col.max() < sets.shape[1]
    even = nbytes.sum() / sets.shape[1]
    assert load.max() <= even + nbytes.max() + 1e-6
    assert load[np.setdiff1d(np.arange(n_slots), sets[0])].sum() == 0


def test_sets_of_several_batches_share_the_load() -> None:
    """Two batches with the same set (in other orders) are water-filled as one class."""
    a = Choices(np.array([[0, 1]]), np.zeros(4, np.int64), np.full(4, 10), np.full(4, -1))
    b = Choices(np.array([[1, 0]]), np.zeros(4, np.int64), np.full(4, 10), np.full(4, -1))
    cols, load = choose_replicas([a, b], 2)
    assert load.tolist() == [40.0, 40.0]
    assert sum((a.sets[0, c] == 0).sum() for c in cols[:1]) + (b.sets[0, cols[1]] == 0).sum() == 4


@FEW
@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_unique_rows_equals_numpy(n: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, (n, width))  # few values: many equal rows, some permutations
    got, inv = unique_rows(rows)
    want = np.unique(rows, axis=0)
    assert (got[inv] == rows).all() and len(got) == len(want)
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
    assert len(set(inv.tolist())) == len(got)


@st.composite
def runs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(classes [K, R], class, size and count of each run (a class's runs adjacent),
    starting loads): overlapping classes, equal loads, weightless and single items."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_slots = draw(st.integers(2, 300))  # many slots: wide waves of disjoint classes
    r = draw(st.integers(1, min(n_slots, 12)))
    k = draw(st.integers(1, 60))
    classes = np.stack([np.sort(rng.choice(n_slots, r, replace=False)) for _ in range(k)])
    per_class = rng.integers(1, 4, k)
    run_class = np.repeat(rng.permutation(k), per_class)
    run_size = rng.choice([0, 1, 3, 7, 4096, 10**9 + 7], run_class.size)
    run_count = rng.choice([1, 1, 2, 3, 5, 17, 200], run_class.size)
    load = rng.choice([0.0, 1.0, 3.0, 1e9], n_slots) * rng.integers(0, 3, n_slots)
    return classes, run_class, run_size, run_count, load


def _one_run_at_a_time(case: tuple) -> tuple[list[list[int]], list[float]]:
    """(counts, loads) of the runs of `case` dealt by _waterfill one at a time."""
    classes, run_class, run_size, run_count, load = case
    want_load = load.tolist()
    want = []
    for c, size, m in zip(run_class.tolist(), run_size.tolist(), run_count.tolist(), strict=True):
        slots = classes[c].tolist()
        got = _waterfill([want_load[x] for x in slots], float(size), m)
        assert sum(got) == m and min(got) >= 0
        for x, n in zip(slots, got, strict=True):
            want_load[x] += n * size
        want.append(got)
    return want, want_load


@settings(max_examples=150, deadline=None)
@given(runs())
def test_waves_fill_as_one_run_at_a_time(case: tuple) -> None:
    """Runs dealt wave by wave in NumPy take what one run at a time takes, to the bit."""
    classes, run_class, run_size, run_count, load = case
    want, want_load = _one_run_at_a_time(case)
    new_load = load.copy()
    counts = fill_runs(classes, run_class, run_size, run_count, new_load)
    assert counts.tolist() == want
    assert new_load.tolist() == want_load


def test_wide_class_with_a_slot_twice_raises_it_per_column() -> None:
    """A slot listed twice in a class of hundreds of candidates takes items in both
    columns and its load rises by both."""
    r = 300
    classes = np.r_[0, np.arange(r - 1)][None, :]  # slot 0 in columns 0 and 1
    load = np.full(r - 1, 5.0)
    load[0] = 0.0
    case = (classes, np.zeros(3, np.int64), np.array([4, 4, 2]), np.array([1, 3, 700]), load)
    want, want_load = _one_run_at_a_time(case)
    new_load = load.copy()
    assert fill_runs(*case[:4], new_load).tolist() == want
    assert new_load.tolist() == want_load

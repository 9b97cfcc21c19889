"""Dense slot numbering and unique groups equal np.unique's answers; sort_by is the stable
lexicographic order whichever sort it picks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.grouping import dense_index, unique_groups
from refitd.plan.sides import sort_by


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=60), st.booleans())
def test_dense_index_equals_unique(values: list[int], small: bool) -> None:
    a = np.array(values, np.int64) % (64 if small else 2**40)
    distinct, position = dense_index(a)
    want, inverse = np.unique(a, return_inverse=True)
    assert np.array_equal(distinct, want) and distinct.dtype == a.dtype
    assert np.array_equal(position, inverse.reshape(-1))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=60), st.integers(1, 2**64 - 1))
def test_unique_groups_equals_unique(values: list[int], modulus: int) -> None:
    a = np.array([v % modulus for v in values], np.uint64)
    got = unique_groups(a)
    want = np.unique(a, return_index=True, return_inverse=True)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w.reshape(-1))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**20), st.integers(0, 9)), max_size=80),
    st.booleans(),
)
def test_sort_by_is_the_stable_lexicographic_order(rows: list, shuffled: bool) -> None:
    keys = [np.array(c, np.int64) for c in zip(*rows, strict=True)] or [np.zeros(0, np.int64)] * 3
    want = np.lexsort(keys[::-1]) if rows else np.zeros(0, np.int64)
    assert np.array_equal(sort_by(*keys, shuffled=shuffled), want)
    assert np.array_equal(sort_by(keys[0] * 0 + 7, shuffled=shuffled), np.arange(len(rows)))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**40), st.integers(0, 7), st.integers(0, 2**40)), max_size=80
    ),
    st.booleans(),
    st.booleans(),
)
def test_sort_by_keys_too_wide_for_one_int64(rows: list, shuffled: bool, dedupe: bool) -> None:
    # three keys of up to 2**40 values need more than one combined int64 key
    rows = sorted(set(rows), key=lambda r: hash(r)) if dedupe else rows
    keys = [np.array(c, np.int64) for c in zip(*rows, strict=True)] or [np.zeros(0, np.int64)] * 3
    want = np.lexsort(keys[::-1]) if rows else np.zeros(0, np.int64)
    assert np.array_equal(sort_by(*keys, unique=dedupe, shuffled=shuffled), want)


def test_sort_by_of_many_keys_by_digits_is_the_stable_order() -> None:
    # enough keys for the radix passes: one to four 16-bit digits, with ties, and keys
    # that never repeat (unique) over the whole width of an int64
    rng = np.random.default_rng(7)
    n = 20_000
    for top in (2**20, 2**40, 2**60):
        keys = [rng.integers(0, 50, n), rng.integers(0, top // 64, n)]
        want = np.lexsort(keys[::-1])
        assert np.array_equal(sort_by(*keys, shuffled=True), want)
    wide = rng.choice(2**62, size=n, replace=False)
    assert np.array_equal(sort_by(wide, unique=True), np.argsort(wide, kind="stable"))

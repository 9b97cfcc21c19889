"""Dense slot numbering and unique groups equal np.unique's answers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.grouping import dense_index, unique_groups


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

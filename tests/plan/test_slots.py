"""Dense slot numbering equals np.unique's, by counting or (large values) by sorting."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.slots import dense_index


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=60), st.booleans())
def test_dense_index_equals_unique(values: list[int], small: bool) -> None:
    a = np.array(values, np.int64) % (64 if small else 2**40)
    distinct, position = dense_index(a)
    want, inverse = np.unique(a, return_inverse=True)
    assert np.array_equal(distinct, want) and distinct.dtype == a.dtype
    assert np.array_equal(position, inverse.reshape(-1))

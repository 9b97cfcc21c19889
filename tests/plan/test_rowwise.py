"""Column-walking row reductions equal NumPy's axis=1 ones, and the one-run test of a
block agrees with the element offsets of a real row-major array."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.plan.program import contiguous_blocks
from refitd.plan.rowwise import row_max, row_prod, row_sum

FEW = settings(max_examples=80, deadline=None)


@FEW
@given(st.integers(0, 40), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_row_reductions_equal_numpy(rows: int, cols: int, seed: int) -> None:
    a = np.random.default_rng(seed).integers(0, 1000, (rows, cols))
    assert np.array_equal(row_prod(a), a.prod(axis=1))
    assert np.array_equal(row_max(a), a.max(axis=1))
    assert np.array_equal(row_sum(a), a.sum(axis=1))
    u = a.astype(np.uint64) * np.uint64(2**61)  # wraps
    assert np.array_equal(row_sum(u), u.sum(axis=1, dtype=np.uint64))
    assert np.array_equal(row_prod(a[:, :0]), np.ones(rows, a.dtype))


@st.composite
def blocks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(full shape, block shape, block offset) of an ndim-d tensor."""
    ndim = draw(st.integers(0, 4))
    full = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    shape = tuple(draw(st.integers(1, f)) for f in full)
    off = tuple(draw(st.integers(0, f - s)) for f, s in zip(full, shape, strict=True))
    return full, shape, off


@FEW
@given(st.lists(blocks(), min_size=1, max_size=12), st.integers(1, 3))
def test_contiguous_blocks_match_row_major_offsets(cases: list, pad: int) -> None:
    d = max(len(f) for f, _, _ in cases) + pad - 1 or 1
    shape = np.ones((len(cases), d), np.int64)
    full = np.ones((len(cases), d), np.int64)
    ndim = np.array([len(f) for f, _, _ in cases], np.int64)
    expected = []
    for i, (f, s, o) in enumerate(cases):
        shape[i, : len(s)], full[i, : len(f)] = s, f
        flat = np.arange(int(np.prod(f))).reshape(f)
        region = flat[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))].reshape(-1)
        expected.append(bool(np.array_equal(region, np.arange(region[0], region[0] + region.size))))
    assert contiguous_blocks(shape, full, ndim).tolist() == expected

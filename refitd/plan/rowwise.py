"""Reductions across the few columns of a tall 2-D array (shapes, offsets: [N, d], d <= 8).

NumPy reduces `axis=1` row by row, which for two to four columns costs about ten times a
pass per column; these walk the columns instead. Results equal `a.prod(axis=1)`,
`a.sum(axis=1)` and `a.max(axis=1)`.
"""

from __future__ import annotations

import numpy as np

_FEW = 8  # up to this many columns, a pass per column beats NumPy's axis=1 reduction


def row_prod(a: np.ndarray) -> np.ndarray:
    """Product of each row (1 for a row of no columns)."""
    if a.shape[1] == 0:
        return np.ones(a.shape[0], a.dtype)
    out = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        out *= a[:, j]
    return out


def row_sum(a: np.ndarray) -> np.ndarray:
    """Sum of each row in `a`'s dtype (unsigned sums wrap, as hashes want); at least one
    column."""
    if a.shape[1] > _FEW:  # wide rows: NumPy's own row reduction reads them contiguously
        return a.sum(axis=1, dtype=a.dtype)
    out = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        out += a[:, j]
    return out


def row_max(a: np.ndarray) -> np.ndarray:
    """Maximum of each row; `a` must have at least one column."""
    out = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        np.maximum(out, a[:, j], out=out)
    return out

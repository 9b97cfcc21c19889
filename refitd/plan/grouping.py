"""Grouping equal values: np.unique's answers by cheaper means.

dense_index numbers slots by counting; unique_groups finds equal values with one stable
argsort (timsort: the planner's keys come in long runs of a few values, a layer's pattern
repeated, where it is several times faster than the SIMD quicksort) and reads the first
occurrences and the inverse off it, which np.unique gets by more passes. sum_before_in_runs
sums within runs of adjacent elements.
"""

from __future__ import annotations

import numpy as np


def dense_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values ascending, each value's position among them) of non-negative
    integers, as np.unique(values, return_inverse=True) gives, by counting when the
    values are few and small (slot numbers: a few hundred distinct over 10^5 tensors,
    where the sort or hash of np.unique costs ten times more)."""
    if not values.size:
        return np.zeros(0, values.dtype), np.zeros(0, np.int64)
    top = int(values.max())
    if int(values.min()) < 0 or top > 4 * values.size + 1024:
        distinct, inverse = np.unique(values, return_inverse=True)
        return distinct, inverse.reshape(-1)
    present = np.bincount(values, minlength=top + 1) > 0
    distinct = np.flatnonzero(present).astype(values.dtype)
    position = np.cumsum(present) - 1
    return distinct, position[values]


def unique_groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the distinct values ascending, the first occurrence of each, the group of every
    element): np.unique(values, return_index=True, return_inverse=True) of a 1-D array."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    new = np.r_[True, ranked[1:] != ranked[:-1]] if values.size else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    inverse = np.empty(values.size, np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ranked[starts], order[starts], inverse  # stable: a run starts at its first


def sum_before_in_runs(values: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per element, the sum of the (non-negative) values before it in its run (runs of
    adjacent elements start where `first`)."""
    cum = np.cumsum(values)
    before = cum - values
    return before - np.maximum.accumulate(np.where(first, before, 0))

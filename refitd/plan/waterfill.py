"""Water-filling runs of equal items over candidate slots, in order, wave by wave.

A run is m equal items of one size that go to the candidates of its class so that the
largest resulting load is as small as possible; each run sees the loads the runs before
it left. Runs over disjoint slots cannot see each other, so they are dealt in waves (a
run's wave: one past the last wave that touched any of its slots) and every run of a
wave is filled at once in NumPy, with the same arithmetic, in the same order per slot,
as one run at a time: the result is the same to the bit. Waves of few runs over few
candidates (relay senders: thousands of runs over ~10 replicas, four runs a wave) cost
NumPy more per call than they hold: successive ones are dealt one run at a time in Python.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

_FEW = 160  # a wave under this many slot visits (runs x (candidates + 8)) goes one run at a
#             time in Python: a NumPy wave costs about that many visits


def fill_runs(
    classes: np.ndarray,
    run_class: np.ndarray,
    run_size: np.ndarray,
    run_count: np.ndarray,
    load: np.ndarray,
) -> np.ndarray:
    """[runs, r] how many items of each run each slot of its class (a row of `classes`,
    distinct slots) takes; runs in order, those of a class adjacent. `load` (float64 per
    slot) is raised by what they take."""
    counts = np.zeros((run_class.size, classes.shape[1]), np.int64)
    if not run_class.size:
        return counts
    r = classes.shape[1]
    # a slot twice in one class is raised twice per run: one run at a time
    repeats = r > 1 and bool((np.diff(classes, axis=1) == 0).any())
    wave = np.arange(run_class.size) if repeats else _waves(classes, run_class, load.size)
    by_wave = np.argsort(wave, kind="stable")
    edge = [0, *(np.flatnonzero(np.diff(wave[by_wave])) + 1).tolist(), wave.size]
    # a wave of single items costs NumPy an argmin: a quarter of a wave
    cost = np.where(np.maximum.reduceat(run_count[by_wave], edge[:-1]) > 1, 1, 4).tolist()
    few = [
        repeats or (hi - lo) * (r + 8) * c < _FEW
        for lo, hi, c in zip(edge[:-1], edge[1:], cost, strict=True)
    ]
    # successive waves of few runs are one stretch, dealt one run at a time
    for one_by_one, group in itertools.groupby(range(len(few)), few.__getitem__):
        waves = list(group)
        if one_by_one:
            idx = by_wave[edge[waves[0]] : edge[waves[-1] + 1]]
            counts[idx] = _one_at_a_time(
                classes[run_class[idx]], run_size[idx], run_count[idx], load
            )
            continue
        for w in waves:
            idx = by_wave[edge[w] : edge[w + 1]]
            slots = classes[run_class[idx]]
            sizes = run_size[idx]
            got = _waterfill_rows(load[slots], sizes, run_count[idx])
            counts[idx] = got
            load[slots] += got * sizes[:, None]
    return counts


def _one_at_a_time(
    slots: np.ndarray, sizes: np.ndarray, m: np.ndarray, load: np.ndarray
) -> list[list[int]]:
    """_waterfill of runs in order (candidate slots per row), each seeing the loads the
    ones before it left; `load` is raised by what they take."""
    touched = np.unique(slots)
    level = dict(zip(touched.tolist(), load[touched].tolist(), strict=True))
    out = []
    for row, z, n in zip(slots.tolist(), sizes.tolist(), m.tolist(), strict=True):
        got = _waterfill([level[x] for x in row], float(z), n)
        for x, t in zip(row, got, strict=True):
            if t:
                level[x] += t * z
        out.append(got)
    load[touched] = list(level.values())
    return out


def _waves(classes: np.ndarray, run_class: np.ndarray, n_slots: int) -> np.ndarray:
    """The wave of every run: a class's runs take successive waves, starting past the
    last wave of any earlier run on one of its slots."""
    starts = np.flatnonzero(np.r_[True, run_class[1:] != run_class[:-1]])
    n_runs = np.diff(np.r_[starts, run_class.size])
    last = [0] * n_slots  # per slot: the first wave after its last run
    base = []
    rows = classes[run_class[starts]].tolist()
    for slots, n in zip(rows, n_runs.tolist(), strict=True):
        b = max(map(last.__getitem__, slots))
        for x in slots:
            last[x] = b + n
        base.append(b)
    return np.repeat(np.array(base, np.int64), n_runs) + (
        np.arange(run_class.size) - np.repeat(starts, n_runs)
    )


def _waterfill_rows(loads: np.ndarray, sizes: np.ndarray, m: np.ndarray) -> np.ndarray:
    """_waterfill of every row at once: loads [k, r] float64, sizes and m [k] int64."""
    one = m == 1  # the least loaded (the first of equals) takes it
    if one.all():
        counts = np.zeros(loads.shape, np.int64)
        counts[np.arange(m.size), np.argmin(loads, axis=1)] = 1
        return counts
    if not one.any():
        return _waterfill_many(loads, sizes, m)
    counts = np.zeros(loads.shape, np.int64)
    counts[one] = _waterfill_rows(loads[one], sizes[one], m[one])
    counts[~one] = _waterfill_many(loads[~one], sizes[~one], m[~one])
    return counts


def _waterfill_many(loads: np.ndarray, sizes: np.ndarray, m: np.ndarray) -> np.ndarray:
    """_waterfill of rows of more than one item each."""
    k, r = loads.shape
    rows = np.arange(k)[:, None]
    j = np.arange(r)
    size = sizes.astype(np.float64)
    unit = np.where(size > 0, size, 1.0)[:, None]
    o = np.argsort(loads, axis=1, kind="stable")
    ls = loads[rows, o]
    level = ((m * size)[:, None] + np.cumsum(ls, axis=1)) / (j + 1.0)
    stop = np.ones((k, r), bool)
    np.less_equal(level[:, :-1], ls[:, 1:], out=stop[:, :-1])
    last = np.argmax(stop, axis=1)[:, None]
    take = np.floor((level[rows, last] - ls) / unit + 1e-9).astype(np.int64)
    take[(j > last) | (take < 0)] = 0
    over = take.sum(axis=1) - m
    if (over > 0).any():  # float rounding: take back from the highest resulting loads
        take -= _first(-(ls + take * unit), over)
    rest = m - take.sum(axis=1)
    if (rest > 0).any():
        take += _first(ls + take * unit, rest)
    weightless = size <= 0  # dealt evenly, least loaded first
    if weightless.any():
        even = m[:, None] // r + (j < (m % r)[:, None])
        take = np.where(weightless[:, None], even, take)
    counts = np.empty_like(take)
    counts[rows, o] = take
    return counts


def _first(keys: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Mask of the first n[i] elements of row i in its stable ascending order of keys."""
    o = np.argsort(keys, axis=1, kind="stable")
    mask = np.empty(keys.shape, bool)
    mask[np.arange(keys.shape[0])[:, None], o] = np.arange(keys.shape[1]) < n[:, None]
    return mask


def _waterfill(loads: list[float], size: float, m: int) -> list[int]:
    """How many of m equal items of `size` each candidate takes so the largest resulting
    load is as small as possible (the items go to the least loaded first)."""
    r = len(loads)
    if m == 1:  # most runs: the least loaded (the first of equals) takes it
        counts = [0] * r
        counts[loads.index(min(loads))] = 1
        return counts
    order = sorted(range(r), key=loads.__getitem__)
    ls = [loads[i] for i in order]
    if size <= 0:  # weightless items: dealt evenly, least loaded first
        q, e = divmod(m, r)
        take = [q + 1] * e + [q] * (r - e)
    else:
        total, cum, level, k = m * size, 0.0, 0.0, 0
        for x in ls:  # the k least loaded rise to a common level
            if k and level <= x:
                break
            cum += x
            k += 1
            level = (total + cum) / k
        take = [max(math.floor((level - x) / size + 1e-9), 0) for x in ls[:k]]
        take += [0] * (r - k)
        left = m - sum(take)
        if left < 0:  # float rounding: take back from the highest resulting loads
            after = [-(x + t * size) for x, t in zip(ls, take, strict=True)]
            for j in sorted(range(r), key=after.__getitem__)[:-left]:
                take[j] -= 1
        elif left:  # the floors' remainder: to the lowest resulting loads
            after = [x + t * size for x, t in zip(ls, take, strict=True)]
            if left == 1:
                take[after.index(min(after))] += 1
            else:
                for j in sorted(range(r), key=after.__getitem__)[:left]:
                    take[j] += 1
    counts = [0] * r
    for i, t in zip(order, take, strict=True):
        counts[i] = t
    return counts

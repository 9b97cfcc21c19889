"""One side's registrations as grouped columns: canonical tensors, geometries, patterns.

_group sorts a side's specs by (canonical, geometry, slot) and gives canonical tensors with
the same geometry sequence one pattern id, so the planner intersects each pattern once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from refitd.plan.grouping import unique_groups
from refitd.plan.layout import TensorSpec
from refitd.plan.table import Geo, SpecTable


@dataclass(slots=True)
class Side:
    """Columnar view of one side's specs; canonicals are the groups of `order`."""

    specs: Sequence[TensorSpec]
    base: int
    names: dict[str, int]
    canon: np.ndarray
    geo: np.ndarray
    geos: list[Geo]
    slot: np.ndarray
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pattern: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def who(self, i: int) -> str:
        s = self.specs[i]
        return f"tensor {s.name!r} (canonical {s.canonical!r}), pool {s.pool!r}, rank {s.rank}"

    def members(self, c: int) -> np.ndarray:
        return self.order[self.start[c] : self.start[c] + self.count[c]]


def sort_by(*keys: np.ndarray, unique: bool = False, shuffled: bool = False) -> np.ndarray:
    """Stable order by several non-negative integer keys, the first most significant: one
    argsort of a combined key when it fits in int64 (a radix sort when it fits in 16
    bits); keys too wide for one combined key are combined in parts, sorted least
    significant part first, each later pass stable (lexsort's order, without a pass per
    key). `unique`: the keys together never repeat, so the faster unstable sort gives the
    same order. `shuffled`: the keys come in no useful order (a stable sort gains nothing
    from runs), so positions join the key as its last part where that fits, and the
    unstable sort gives the stable order."""
    if not all(k.size for k in keys):
        return np.zeros(0, np.int64)
    parts = _combined(keys)
    if parts is None:
        return np.lexsort(keys[::-1])
    (combined, span), *higher = parts
    order = _argsort(combined, span, unique and not higher, shuffled or bool(higher))
    for part, span in higher:
        order = order[_argsort(part[order], span, False, False)]
    return order


def _combined(keys: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, int]] | None:
    """The keys combined into as few int64 keys as fit below 2**62, least significant
    first, each with its span; None when a key is negative or alone too wide."""
    parts: list[tuple[np.ndarray, int]] = []
    combined = np.zeros(keys[0].size, np.int64)
    span = 1
    for k in reversed(keys):
        lo, hi = int(k.min()), int(k.max())
        if lo < 0 or hi + 1 >= 2**62:
            return None
        if span * (hi + 1) >= 2**62:
            parts.append((combined, span))
            combined = np.zeros(k.size, np.int64)
            span = 1
        combined += k * span
        span *= hi + 1
    parts.append((combined, span))
    return parts


def _argsort(combined: np.ndarray, span: int, unique: bool, shuffled: bool) -> np.ndarray:
    """Stable argsort of one combined key of `span` values (see sort_by). Keys in no
    useful order go by 16-bit digits, least significant first (a stable radix pass
    each): up to four passes cost less than one comparison sort of int64 keys."""
    n = combined.size
    if span <= 1 << 16:
        return np.argsort(combined.astype(np.uint16), kind="stable")
    if (shuffled or unique) and n >= _RADIX_MIN:
        return _radix_argsort(combined, span)
    if shuffled and not unique and span * n < 2**62:
        combined *= n
        combined += np.arange(n)
        unique = True
    return np.argsort(combined, kind="quicksort" if unique else "stable")


_RADIX_MIN = 1 << 12  # below this many keys one comparison sort is as fast


def _radix_argsort(combined: np.ndarray, span: int) -> np.ndarray:
    """Stable argsort of non-negative int64 keys below `span` (< 2**64), 16 bits a pass."""
    order = np.argsort((combined & 0xFFFF).astype(np.uint16), kind="stable")
    shift = 16
    while span > 1 << shift:
        digit = ((combined[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
        shift += 16
    return order


def side_of(table: SpecTable, base: int) -> Side:
    """The columns of one side (ungrouped); base: its first plan tensor index."""
    canon, geo, slot = table.columns()
    return Side(table.specs, base, table.canonical_ids, canon, geo, table.geos, slot)


def group(side: Side) -> None:
    """Sort by (canonical, geometry, slot) and give canonicals with the same geometry
    sequence the same pattern id (hashed, then verified exactly)."""
    nc = len(side.names)
    side.order = sort_by(side.canon, side.geo, side.slot)
    side.count = np.bincount(side.canon, minlength=nc)
    side.start = np.cumsum(side.count) - side.count
    if nc == 0:
        side.pattern = np.zeros(0, np.int64)
        return
    g = side.geo[side.order]
    pos = np.arange(g.size) - np.repeat(side.start, side.count)
    weights = np.random.default_rng(0x5EED).integers(
        1, 2**62, size=int(side.count.max()), dtype=np.int64
    ).astype(np.uint64) | np.uint64(1)
    h = np.add.reduceat((g.astype(np.uint64) + np.uint64(1)) * weights[pos], side.start)
    h ^= side.count.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    _, firsts, pat = unique_groups(h)
    # exact check of every member against its pattern's first canonical
    rep = firsts[pat]
    canon_sorted = side.canon[side.order]
    same = (side.count[rep] == side.count).all() and (
        g == g[side.start[rep[canon_sorted]] + pos]
    ).all()
    if not same:
        seen: dict[bytes, int] = {}
        pat = np.array(
            [
                seen.setdefault(g[a : a + n].tobytes(), len(seen))
                for a, n in zip(side.start.tolist(), side.count.tolist(), strict=True)
            ],
            np.int64,
        )
    side.pattern = pat


def member_table(side: Side, cs: np.ndarray) -> np.ndarray:
    """[links, positions] spec indices of each link's canonical (same count for all)."""
    n = int(side.count[cs[0]])
    return side.order[side.start[cs][:, None] + np.arange(n)[None, :]]

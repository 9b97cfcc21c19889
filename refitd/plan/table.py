"""SpecTable: one side's registrations (source or destination pools) as columns.

The planner works on integer columns (canonical id, geometry id, slot, ...) and on the few
distinct geometries; turning ~10^5 TensorSpec objects into those columns is the Python
part of planning. A controller can keep a SpecTable per side and `add` each worker's specs
as it registers, so a plan starts from ready columns (`build_plan_from_table`); a removal
or a moved registration rebuilds the table. `SpecTable.from_specs` is the one-shot path.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, count, islice
from operator import attrgetter, eq
from typing import overload

import numpy as np

from refitd.plan.layout import Box, TensorSpec

_BOXES = attrgetter("boxes")
_CANON = attrgetter("canonical")
_SLOT = attrgetter("slot")
_RANK = attrgetter("rank")
_NAME = attrgetter("name")
_GEO_REST = attrgetter("global_shape", "local_shape", "pool", "dtype", "storage")
_NAMES_SLICE = 4096  # names hashed per join


@dataclass(frozen=True, slots=True)
class Geo:
    """Everything about a registered tensor's layout except where it lives and its names."""

    pool: str
    global_shape: tuple[int, ...]
    dtype: str
    storage: str
    local_shape: tuple[int, ...]
    boxes: tuple[Box, ...]

    def sans_pool(self) -> tuple:
        """This geometry without its pool: replicas across pools (and twins) share it."""
        return (self.global_shape, self.dtype, self.storage, self.local_shape, self.boxes)

    @property
    def cover(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        return tuple(sorted((b.offset, b.shape) for b in self.boxes if all(b.shape)))


def _intern(values: list, ids: dict, order: list) -> Iterable[int]:
    """Ids of `values` in `ids` (new values appended to `order`)."""
    for v in dict.fromkeys(values):
        if v not in ids:
            ids[v] = len(order)
            order.append(v)
    return map(ids.__getitem__, values)


def _canonical_column(specs: list[TensorSpec], ids: dict[str, int], order: list[str]) -> bytes:
    """The canonical name ids of `specs` as int32 bytes (new names appended to `order`),
    in one dict pass: a name not yet in `ids` is entered under its spec's position (past
    every id), and those are renumbered in order of first appearance afterwards."""
    base = len(order)
    n = len(specs)
    codes = np.fromiter(map(ids.setdefault, map(_CANON, specs), count(base)), np.int64, n)
    firsts = np.flatnonzero(codes == np.arange(base, base + n))
    if len(firsts):
        fresh = [specs[i].canonical for i in firsts.tolist()]
        ids.update(zip(fresh, range(base, base + len(fresh)), strict=True))
        order.extend(fresh)
        dense = np.empty(n, np.int64)
        dense[firsts] = np.arange(base, base + len(fresh))
        temporary = codes >= base
        codes[temporary] = dense[codes[temporary] - base]
    return codes.astype(np.int32).tobytes()


def _geo_groups(specs: list[TensorSpec]) -> tuple[np.ndarray, np.ndarray]:
    """(the first spec of each group, each spec's group), groups in order of first
    appearance, where a group's specs have the same boxes object and equal other
    geometry fields. Two passes: box tuples by identity (hashing one by value calls a
    Python __hash__ per Box), the rest by value: each spec's compared with its group's
    first (no hashing), and hashed only where a group holds unequal ones."""
    n = len(specs)
    by_boxes: dict[int, int] = {}
    key = np.fromiter(map(by_boxes.setdefault, map(id, map(_BOXES, specs)), count()), np.int64, n)
    heads = np.fromiter(by_boxes.values(), np.int64, len(by_boxes))
    head_rest = [_GEO_REST(specs[i]) for i in heads.tolist()]
    number = np.empty(n, np.int64)
    number[heads] = np.arange(heads.size)
    group = number[key]
    if all(map(eq, map(_GEO_REST, specs), map(head_rest.__getitem__, group.tolist()))):
        return heads, group
    by_rest: dict[tuple, int] = {}
    rest = np.fromiter(map(by_rest.setdefault, map(_GEO_REST, specs), count()), np.int64, n)
    key = _split(key, rest)
    firsts = np.flatnonzero(key == np.arange(n))
    group = np.empty(n, np.int64)
    group[firsts] = np.arange(len(firsts))
    return firsts, group[key]


def _split(key: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The position of the first spec with the same key and the same `ids`, per spec."""
    order = np.lexsort((ids, key))  # stable: each run starts at its first spec
    k, v = key[order], ids[order]
    start = np.ones(len(order), bool)
    start[1:] = (k[1:] != k[:-1]) | (v[1:] != v[:-1])
    out = np.empty_like(key)
    out[order] = order[start][np.cumsum(start) - 1]
    return out


@dataclass
class SpecTable:
    """Registered specs of one side with their integer columns, in registration order."""

    specs: list[TensorSpec] = field(default_factory=list)
    canonicals: list[str] = field(default_factory=list)
    geos: list[Geo] = field(default_factory=list)
    _canon_ids: dict[str, int] = field(default_factory=dict)
    _geo_ids: dict[Geo, int] = field(default_factory=dict)
    _canon: array = field(default_factory=lambda: array("i"))
    _geo: array = field(default_factory=lambda: array("i"))
    _slot: array = field(default_factory=lambda: array("i"))
    _rank: array = field(default_factory=lambda: array("i"))
    _names_digest: bytes | None = None  # of the canonical and local names, made when asked
    _signature: bytes | None = None  # layout_signature(), made when asked

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec]) -> SpecTable:
        t = cls()
        t.add(specs)
        return t

    @classmethod
    def of_worker(cls, specs: Iterable[TensorSpec]) -> SpecTable:
        """One worker's table as the controller keeps it from its registration on: its
        layout signature made now, so catch-ups only read it."""
        t = cls.from_specs(specs)
        t.layout_signature()
        return t

    @classmethod
    def from_tables(cls, tables: Iterable[SpecTable]) -> SpecTable:
        """The rows of `tables` in order, as one table (equal to from_specs of their specs
        up to the order of ids): a controller keeps one small table per worker and joins
        the workers a plan reads without tabulating their specs again."""
        t = cls()
        for other in tables:
            t.extend(other)
        return t

    @property
    def canonical_ids(self) -> dict[str, int]:
        """Canonical name -> id, in id order."""
        return self._canon_ids

    def __len__(self) -> int:
        return len(self.specs)

    def add(self, specs: Iterable[TensorSpec]) -> None:
        """Append registrations: a few C-level passes over the specs (no Python code per
        spec) group them by geometry, one spec per group makes a Geo, compared by value
        with those already known, and NumPy spreads the ids back over the rows."""
        new = specs if isinstance(specs, list) else list(specs)
        if not new:
            return
        first, key = _geo_groups(new)
        geo_ids = []
        for i in first.tolist():
            s = new[i]
            g = Geo(s.pool, s.global_shape, s.dtype, s.storage, s.local_shape, s.boxes)
            gid = self._geo_ids.setdefault(g, len(self.geos))
            if gid == len(self.geos):
                self.geos.append(g)
            geo_ids.append(gid)
        self._geo.frombytes(np.array(geo_ids, np.int32)[key].tobytes())
        self._canon.frombytes(_canonical_column(new, self._canon_ids, self.canonicals))
        self._slot.frombytes(np.fromiter(map(_SLOT, new), np.int32, len(new)).tobytes())
        self._rank.frombytes(np.fromiter(map(_RANK, new), np.int32, len(new)).tobytes())
        self.specs.extend(new)
        self._names_digest = self._signature = None

    def extend(self, other: SpecTable) -> None:
        """Append another table's rows: its geometry and canonical ids mapped onto ours
        (one dict look-up per distinct geometry and name, the columns remapped at once)."""
        if not other.specs:
            return
        geo_ids = []
        for g in other.geos:
            gid = self._geo_ids.setdefault(g, len(self.geos))
            if gid == len(self.geos):
                self.geos.append(g)
            geo_ids.append(gid)
        geo_map = np.array(geo_ids, np.int32)
        canon_map = np.fromiter(
            _intern(other.canonicals, self._canon_ids, self.canonicals),
            np.int32,
            count=len(other.canonicals),
        )
        self._geo.frombytes(geo_map[np.frombuffer(other._geo, np.int32)].tobytes())
        self._canon.frombytes(canon_map[np.frombuffer(other._canon, np.int32)].tobytes())
        self._slot.extend(other._slot)
        self._rank.extend(other._rank)
        self.specs.extend(other.specs)
        self._names_digest = self._signature = None

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(canonical id, geometry id, slot) per spec, as int64 arrays."""
        return (
            np.frombuffer(self._canon, dtype=np.int32).astype(np.int64),
            np.frombuffer(self._geo, dtype=np.int32).astype(np.int64),
            np.frombuffer(self._slot, dtype=np.int32).astype(np.int64),
        )

    def ranks(self) -> np.ndarray:
        """Worker rank per spec, as int64."""
        return np.frombuffer(self._rank, dtype=np.int32).astype(np.int64)

    def layout_signature(self) -> bytes:
        """A digest of the registrations without where they live (pool, rank, slot): equal
        for two workers that hold the same tensors (names, canonical tensors, shapes,
        dtypes, storage, boxes) in the same order, such as two replicas' rank k."""
        if self._signature is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr([g.sans_pool() for g in self.geos]).encode())
            h.update("\0".join(self.canonicals).encode() + b"\1")
            _hash_names(h, self.specs, b"\1")
            h.update(memoryview(self._canon).cast("B"))
            h.update(memoryview(self._geo).cast("B"))
            self._signature = h.digest()
        return self._signature

    def digest_into(self, h: hashlib._Hash) -> None:
        """Feed everything that identifies these registrations into a hash (the pool is
        part of each geometry)."""
        h.update(repr(self.geos).encode())
        if self._names_digest is None:
            # names only matter for identity; hashed once per content of the table
            names = hashlib.sha256()  # SHA-NI where the CPU has it: twice blake2b's speed
            names.update("\0".join(self.canonicals).encode() + b"\1")
            if self.specs:
                _hash_names(names, self.specs, b"\0")
            self._names_digest = names.digest()
        h.update(self._names_digest)
        for col in (self._canon, self._geo, self._slot, self._rank):
            h.update(memoryview(col).cast("B"))


def _hash_names(h: hashlib._Hash, specs: list[TensorSpec], end: bytes) -> None:
    """Feed the specs' local names, joined by NUL, then `end` into `h`: in slices whose
    text stays in cache while it is encoded and hashed (the same bytes as one join)."""
    for lo in range(0, len(specs), _NAMES_SLICE):
        if lo:
            h.update(b"\0")
        h.update("\0".join(map(_NAME, specs[lo : lo + _NAMES_SLICE])).encode())
    h.update(end)


class JoinedSpecs(Sequence[TensorSpec]):
    """The specs of several tables end to end, as they were when joined (tables only grow
    at their end), without a list of them: a list would write every spec's reference
    count, which in a forked planning process copies every page of registrations it
    shares with the controller (millions of specs at 4,096 ranks)."""

    def __init__(self, *tables: SpecTable) -> None:
        self._parts = [(t.specs, len(t)) for t in tables]
        self._ends = list(accumulate(n for _, n in self._parts))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> TensorSpec: ...
    @overload
    def __getitem__(self, i: slice) -> list[TensorSpec]: ...
    def __getitem__(self, i: int | slice) -> TensorSpec | list[TensorSpec]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        k = i + n if i < 0 else i
        if not 0 <= k < n:
            raise IndexError(f"spec {i} of {n}")
        base = 0
        for (specs, _), end in zip(self._parts, self._ends, strict=True):
            if k < end:
                return specs[k - base]
            base = end
        raise AssertionError("unreachable")

    def __iter__(self) -> Iterator[TensorSpec]:
        return chain.from_iterable(islice(specs, count) for specs, count in self._parts)

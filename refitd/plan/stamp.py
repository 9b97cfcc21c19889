"""Identical destination pools: plan one pool, stamp its copies onto the others.

Inference pools often hold the same layout rank by rank (replicas of one serving
configuration). The planner then intersects, chooses replicas and relays for the first
pool only and repeats its copies for every other pool of the class: a pool's copy goes to
the same position of its own rank from the same source, its relay sender the same member
of its own pool. The first pool's replica choice already spreads its reads over the source
replicas, so every source slot sends its share once per pool: the plan's balance is the
first pool's (without relays, each pool reads the replica rotated by its share of the
replica set instead, which also spreads the few copies of a small tensor). Relays stay
within a pool; the relay level counts every direct copy once per pool (relay.py's `fan`),
so the sources shed as much as the pools can absorb. Where a pool holds too few replicas
of its blocks for that (`sheds_enough`), the planner plans the whole side instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from refitd.plan.copies import CopyTable
from refitd.plan.intersect import Batch
from refitd.plan.layout import TensorSpec
from refitd.plan.program.build import concat_ranges
from refitd.plan.sides import Side
from refitd.plan.stamp_schedule import PoolSlots
from refitd.plan.table import SpecTable

# a stamped plan's busiest source slot may send this much more than the least any plan of
# all pools needs (else the planner plans them all at once)
_SEND_SLACK = 1.05


class _Rows(Sequence[TensorSpec]):
    """Some rows of a spec sequence, by position (the first pool's specs)."""

    def __init__(self, specs: Sequence[TensorSpec], rows: np.ndarray) -> None:
        self._specs, self._rows = specs, rows

    def __len__(self) -> int:
        return int(self._rows.size)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [self._specs[int(r)] for r in self._rows[i]]
        return self._specs[int(self._rows[i])]

    def __iter__(self) -> Iterator[TensorSpec]:
        return (self._specs[int(r)] for r in self._rows)


@dataclass(frozen=True, slots=True)
class PoolStamp:
    """rows[p, i]: the destination side's row at position i of pool p (pools in name
    order, positions in (rank, registration) order); every pool holds the same canonical
    tensors and geometries (the pool aside) at every position, on slots of its own."""

    rows: np.ndarray

    @property
    def pools(self) -> int:
        return int(self.rows.shape[0])

    @staticmethod
    def of(table: SpecTable, dst: Side, src_slots: np.ndarray, min_specs: int) -> PoolStamp | None:
        """The stamp of the destination side, or None unless it is two or more pools of
        one layout, each of at least `min_specs` tensors, on slots that no other pool and
        no source uses."""
        pools = sorted({g.pool for g in table.geos})
        if len(pools) < 2 or not dst.slot.size:
            return None
        pool_ids = {p: i for i, p in enumerate(pools)}
        shapes: dict[tuple, int] = {}
        pool_of_geo = np.array([pool_ids[g.pool] for g in table.geos], np.int64)
        key_of_geo = np.array(
            [shapes.setdefault(g.sans_pool(), len(shapes)) for g in table.geos], np.int64
        )
        pool = pool_of_geo[dst.geo]
        counts = np.bincount(pool, minlength=len(pools))
        if (counts != counts[0]).any() or counts[0] < min_specs:
            return None
        ranks = table.ranks()
        rows = _by_worker(pool, ranks).reshape(len(pools), -1)
        for col in (dst.canon, key_of_geo[dst.geo], ranks):
            if (col[rows] != col[rows[0]][None, :]).any():
                return None
        if not _own_slots(dst.slot[rows], src_slots):
            return None
        return PoolStamp(rows)

    def first_side(self, dst: Side) -> Side:
        """The first pool's rows as a side of their own (base and ids unchanged)."""
        r = self.rows[0]
        return Side(
            _Rows(dst.specs, r),
            dst.base,
            dst.names,
            dst.canon[r],
            dst.geo[r],
            dst.geos,
            dst.slot[r],
        )

    def sources(self, batches: list[Batch], cols: list[np.ndarray]) -> np.ndarray:
        """[pools, copies] source spec of every first-pool copy (batch order, as the
        planner's copy table has them) for each pool, the chosen candidate column moved
        on by the pool's share of the candidates: in a plan without relays, pools then
        read different replicas and the few copies of a small tensor spread over them."""
        k = self.pools
        out = np.empty((k, sum(b.piece.size for b in batches)), np.int64)
        at = 0
        for b, col in zip(batches, cols, strict=True):
            r, n = b.cand_pos.shape[1], b.piece.size
            for p in range(k):
                out[p, at : at + n] = b.chosen_src((col + p * r // k) % r)
            at += n
        return out

    def pool_slots(self, dst: Side, copies: int) -> PoolSlots:
        """The pools' slots, for a stamp of `copies` first-pool copies (stamp_schedule)."""
        first, at = np.unique(dst.slot[self.rows[0]], return_index=True)
        return PoolSlots(self.pools, copies, first, dst.slot[self.rows[:, at]])

    def sheds_enough(self, t: CopyTable, nbytes: np.ndarray, first: Side, sources: Side) -> bool:
        """Whether the first pool's copies with relays chosen (`t`, wire bytes `nbytes`),
        stamped, keep the busiest source slot within _SEND_SLACK of what any plan of all
        pools needs: with `s` source slots and `h` destination slots, each forwarding no
        more than a source slot sends, the busiest source sends at least all bytes over
        (s + h); relays across pools could not do better."""
        direct = t.feed < 0
        slots, dense = np.unique(sources.slot, return_inverse=True)
        send = np.bincount(dense[t.src[direct]], weights=nbytes[direct], minlength=slots.size)
        hubs = self.pools * np.unique(first.slot).size
        need = self.pools * float(nbytes.sum()) / (slots.size + hubs)
        return self.pools * float(send.max(initial=0.0)) <= _SEND_SLACK * need

    def stamp(self, t: CopyTable, base: int, sources: np.ndarray | None = None) -> CopyTable:
        """The first pool's copies (destinations as first-pool rows + base, relays fed
        within it) repeated for every pool, pool by pool, their locations and shapes kept
        once (CopyTable.period); `sources`: each pool's sources of the direct copies
        (default: the first pool's)."""
        k, n = self.pools, t.src.size
        relay = t.feed >= 0
        dst = base + self.rows[:, t.dst - base]
        src = _per_pool(t.src, k) if sources is None else sources
        src[:, relay] = base + self.rows[:, t.src[relay] - base]
        feed = _per_pool(t.feed, k)
        feed[:, relay] += (np.arange(k, dtype=np.int64) * n)[:, None]
        return CopyTable(
            src=src.reshape(-1),
            dst=dst.reshape(-1),
            src_loc=t.src_loc,
            dst_loc=t.dst_loc,
            shape=t.shape,
            ndim=t.ndim,
            wire=t.wire,
            esize=t.esize,
            feed=feed.reshape(-1),
            cid=np.arange(k * n),
            period=n,
        )


def _per_pool(column: np.ndarray, k: int) -> np.ndarray:
    """[k, ...] the column once per pool (a broadcast copy: np.tile is several times
    slower on millions of rows)."""
    out = np.empty((k, *column.shape), column.dtype)
    out[:] = column
    return out


def _by_worker(pool: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Rows in (pool, rank, row) order. A worker's rows are registered together, so the
    runs of one worker are sorted (a few thousand) rather than the rows (millions)."""
    key = pool * (int(rank.max()) + 1) + rank
    start = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
    end = np.r_[start[1:], key.size]
    runs = np.argsort(key[start], kind="stable")
    return concat_ranges(start[runs], end[runs])


def _own_slots(slots: np.ndarray, src_slots: np.ndarray) -> bool:
    """Each pool's slots are its own (none shared with a source or another pool) and a
    slot of the first pool holds the same positions as its counterpart in every pool.
    Marks per slot id rather than sorts: millions of rows over a few thousand slots."""
    if slots.min() < 0:
        return False
    big = int(max(slots.max(), src_slots.max(initial=0))) + 1
    k = slots.shape[0]
    held = np.zeros((k, big), bool)
    held[np.arange(k)[:, None], slots] = True
    if held[:, src_slots].any() or (held.sum(axis=0) > 1).any():
        return False  # a slot of a source, or one holding ranks of two pools
    distinct = held.sum(axis=1)
    if (distinct != distinct[0]).any():
        return False
    # each first-pool slot has one counterpart per pool: with as many distinct slots on
    # both sides, the map is one to one
    last = np.empty(big, np.int64)
    for s in slots[1:]:
        last[slots[0]] = s  # for a slot seen twice, the last write wins
        if (last[slots[0]] != s).any():
            return False
    return True

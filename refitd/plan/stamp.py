"""Identical destination pools: plan one pool, stamp its copies onto the others.

Inference pools often hold the same layout rank by rank (replicas of one serving
configuration). The planner then intersects, chooses replicas and relays for the first
pool only and repeats its copies for every other pool of the class: a pool's copy goes to
the same position of its own rank, its source the candidate replica rotated by the pool's
share of the replica set (so pools read different trainer replicas where there are
several), its relay sender the same member of its own pool. Relays stay within a pool;
the relay level counts every direct copy once per pool (relay.py's `fan`), so the sources
shed as much as the pools can absorb.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from refitd.plan.copies import CopyTable
from refitd.plan.intersect import Batch
from refitd.plan.layout import TensorSpec
from refitd.plan.sides import Side, sort_by
from refitd.plan.table import SpecTable

# stamped sources may send this much more than relays across pools would let them
_SEND_SLACK = 1.02


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
    def of(table: SpecTable, dst: Side, src_slots: np.ndarray) -> PoolStamp | None:
        """The stamp of the destination side, or None unless it is two or more pools of
        one layout on slots that no other pool and no source uses."""
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
        if (counts != counts[0]).any():
            return None
        rows = sort_by(pool, table.ranks(), np.arange(pool.size)).reshape(len(pools), -1)
        for col in (dst.canon, key_of_geo[dst.geo], table.ranks()):
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
        """[pools, copies] source spec of every first-pool copy (batch order, as
        _copy_table writes them) for each pool: the chosen candidate column moved on by
        the pool's share of the candidates."""
        k = self.pools
        out = np.empty((k, sum(b.piece.size for b in batches)), np.int64)
        at = 0
        for b, col in zip(batches, cols, strict=True):
            r, n = b.cand_pos.shape[1], b.piece.size
            for p in range(k):
                out[p, at : at + n] = b.chosen_src((col + p * r // k) % r)
            at += n
        return out

    def keeps_relays(
        self,
        nbytes: np.ndarray,
        group: np.ndarray,
        relayable: np.ndarray,
        source_slots: int,
        first_slots: np.ndarray,
    ) -> bool:
        """Whether relays within a pool shed about as much from the sources as relays
        across pools would. A block of g copies in a pool keeps one direct copy per pool
        when stamped (one in all pools otherwise), so stamped relays may carry
        (1 - 1/g) of its bytes against (1 - 1/(pools g)); either way the destination
        slots relay at most what a source slot sends, a share hubs / (hubs + sources).
        The first pool's copies: wire bytes, relay group, relayable."""
        total = float(nbytes.sum())
        if total <= 0:
            return True
        _, inv, count = np.unique(group[relayable], return_inverse=True, return_counts=True)
        g = count[inv].astype(np.float64)
        nb = nbytes[relayable]
        hubs = self.pools * np.unique(first_slots).size
        cap = hubs / (hubs + source_slots)
        stamped = min(float((nb * (1 - 1 / g)).sum()) / total, cap)
        across = min(float((nb * (1 - 1 / (self.pools * g))).sum()) / total, cap)
        return 1 - stamped <= _SEND_SLACK * (1 - across)

    def stamp(self, t: CopyTable, sources: np.ndarray, base: int) -> CopyTable:
        """The first pool's copies (destinations as first-pool rows + base, relays fed
        within it) repeated for every pool, pool by pool."""
        k, n = self.pools, t.src.size
        relay = t.feed >= 0
        dst = base + self.rows[:, t.dst - base]
        src = sources.copy()
        src[:, relay] = base + self.rows[:, t.src[relay] - base]
        feed = np.tile(t.feed, k)
        step = np.repeat(np.arange(k, dtype=np.int64) * n, n)
        feed[feed >= 0] += step[feed >= 0]
        return CopyTable(
            src=src.reshape(-1),
            dst=dst.reshape(-1),
            src_loc=np.tile(t.src_loc, (k, 1)),
            dst_loc=np.tile(t.dst_loc, (k, 1)),
            shape=np.tile(t.shape, (k, 1)),
            ndim=np.tile(t.ndim, k),
            wire=np.tile(t.wire, k),
            esize=np.tile(t.esize, k),
            feed=feed,
            cid=np.arange(k * n),
        )


def _own_slots(slots: np.ndarray, src_slots: np.ndarray) -> bool:
    """Each pool's slots are its own (none shared with a source or another pool) and a
    slot of the first pool holds the same positions as its counterpart in every pool."""
    if np.isin(slots, src_slots).any():
        return False
    own = [np.unique(s) for s in slots]
    if np.unique(np.concatenate(own)).size != sum(u.size for u in own):
        return False  # a slot holding ranks of two pools
    big = int(slots.max()) + 1
    return all(
        np.unique(slots[0] * big + s).size == u.size == own[0].size
        for s, u in zip(slots[1:], own[1:], strict=True)
    )

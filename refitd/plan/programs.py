"""Every slot's program from a plan's columns, in one vectorised pass grouped by slot.

A plan keeps its remote copies in message order and its messages by id; a slot's program
is the slices of those columns that it sends, receives and copies locally, plus the rows of
the plan's tensor table that they touch. The sort by slot is done once per plan
(`ProgramIndex`); each program is then a handful of NumPy takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refitd.plan.layout import TensorSpec
from refitd.plan.program import (
    DTYPES,
    STORAGES,
    CopyColumns,
    MessageColumns,
    SlotProgram,
    TensorColumns,
)


def _ranges(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start[k], end[k]) for all k."""
    lens = end - start
    total = int(lens.sum())
    if not total:
        return np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens
    return np.repeat(start - first, lens) + np.arange(total)


@dataclass(slots=True)
class PlanTensors:
    """The plan's tensors as columns (program tensor tables are slices of these)."""

    slot: np.ndarray
    rank: np.ndarray
    pool: np.ndarray
    dtype: np.ndarray
    storage: np.ndarray
    ndim: np.ndarray
    local_shape: np.ndarray  # [T, D]
    name_start: np.ndarray
    name_end: np.ndarray
    names: np.ndarray  # uint8, all names back to back
    pools: tuple[str, ...]

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], slot: np.ndarray, dims: int) -> PlanTensors:
        """One pass over the specs (geometry attributes are read per distinct object)."""
        n = len(specs)
        pools = sorted({s.pool for s in specs})
        pool_id = {p: i for i, p in enumerate(pools)}
        dt_id = {d: i for i, d in enumerate(DTYPES)}
        st_id = {s: i for i, s in enumerate(STORAGES)}
        shapes: dict[tuple[int, ...], int] = {}
        rows = []
        for s in specs:  # (pool, dtype, storage, local shape id, rank)
            sid = shapes.setdefault(s.local_shape, len(shapes))
            rows.append((pool_id[s.pool], dt_id[s.dtype], st_id[s.storage], sid, s.rank))
        cols = np.array(rows, np.int64).reshape(n, 5)
        d = max([dims, 1] + [len(x) for x in shapes])
        shape_tab = np.ones((max(len(shapes), 1), d), np.int64)
        nd_tab = np.zeros(max(len(shapes), 1), np.int64)
        for sh, i in shapes.items():
            shape_tab[i, : len(sh)] = sh
            nd_tab[i] = len(sh)
        encoded = [s.name.encode() for s in specs]
        lens = np.fromiter(map(len, encoded), np.int64, count=n)
        end = np.cumsum(lens)
        return cls(
            slot=slot,
            rank=cols[:, 4],
            pool=cols[:, 0],
            dtype=cols[:, 1].astype(np.uint8),
            storage=cols[:, 2].astype(np.uint8),
            ndim=nd_tab[cols[:, 3]].astype(np.uint8),
            local_shape=shape_tab[cols[:, 3]],
            name_start=end - lens,
            name_end=end,
            names=np.frombuffer(b"".join(encoded), np.uint8),
            pools=tuple(pools),
        )

    def table(self, idx: np.ndarray, slot: int) -> TensorColumns:
        """Rows `idx` (ascending plan indices); names only for tensors held on `slot`."""
        mine = self.slot[idx] == slot
        a = np.where(mine, self.name_start[idx], 0)
        b = np.where(mine, self.name_end[idx], 0)
        names = self.names[_ranges(a, b)].tobytes()
        used = np.unique(self.pool[idx])
        return TensorColumns(
            index=idx,
            slot=self.slot[idx],
            rank=self.rank[idx],
            pool=np.searchsorted(used, self.pool[idx]),
            dtype=self.dtype[idx],
            storage=self.storage[idx],
            ndim=self.ndim[idx],
            local_shape=self.local_shape[idx],
            name_end=np.cumsum(b - a),
            names=names,
            pools=tuple(self.pools[i] for i in used.tolist()),
        )


@dataclass(slots=True)
class CopyCols:
    """Plan-wide copy columns (remote copies in message order, or local copies)."""

    src: np.ndarray
    dst: np.ndarray
    src_loc: np.ndarray
    dst_loc: np.ndarray
    shape: np.ndarray
    ndim: np.ndarray
    wire: np.ndarray

    def take(self, rows: np.ndarray) -> CopyColumns:
        return CopyColumns(
            src=self.src[rows],
            dst=self.dst[rows],
            src_off=self.src_loc[rows],
            dst_off=self.dst_loc[rows],
            shape=self.shape[rows],
            ndim=self.ndim[rows].astype(np.uint8),
            wire=self.wire[rows].astype(np.uint8),
        )


@dataclass(slots=True)
class Messages:
    """Plan-wide message columns, indexed by message id."""

    round: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray


class ProgramIndex:
    """Per-slot positions of every message, copy and local copy (sorted once per plan)."""

    def __init__(
        self, digest: str, remote: CopyCols, local: CopyCols, msgs: Messages, tensors: PlanTensors
    ) -> None:
        self.digest, self.remote, self.local, self.msgs, self.tensors = (
            digest,
            remote,
            local,
            msgs,
            tensors,
        )
        slot_of = tensors.slot
        self.by_src = np.argsort(msgs.src, kind="stable")  # ids ascending within a slot
        self.by_dst = np.argsort(msgs.dst, kind="stable")
        self.src_keys = msgs.src[self.by_src]
        self.dst_keys = msgs.dst[self.by_dst]
        lslot = slot_of[local.src]
        self.local_order = np.argsort(lslot, kind="stable")
        self.local_keys = lslot[self.local_order]

    def _msgs(self, ids: np.ndarray, pos: int) -> tuple[MessageColumns, np.ndarray]:
        m = self.msgs
        rows = _ranges(m.start[ids], m.end[ids])
        lens = m.end[ids] - m.start[ids]
        end = pos + np.cumsum(lens)
        cols = MessageColumns(
            id=ids.astype(np.int64),
            round=m.round[ids],
            src_slot=m.src[ids],
            dst_slot=m.dst[ids],
            start=end - lens,
            end=end,
            nbytes=m.nbytes[ids],
        )
        return cols, rows

    def program(self, slot: int) -> SlotProgram:
        lo, hi = np.searchsorted(self.src_keys, [slot, slot + 1])
        send, send_rows = self._msgs(self.by_src[lo:hi], 0)
        lo, hi = np.searchsorted(self.dst_keys, [slot, slot + 1])
        recv, recv_rows = self._msgs(self.by_dst[lo:hi], send_rows.size)
        lo, hi = np.searchsorted(self.local_keys, [slot, slot + 1])
        local_rows = self.local_order[lo:hi]
        remote_rows = np.concatenate([send_rows, recv_rows])
        r, loc = self.remote.take(remote_rows), self.local.take(local_rows)
        copies = CopyColumns(
            *(
                np.concatenate([getattr(r, f), getattr(loc, f)])
                for f in ("src", "dst", "src_off", "dst_off", "shape", "ndim", "wire")
            )
        )
        used = np.unique(np.concatenate([copies.src, copies.dst]))
        return SlotProgram(
            digest=self.digest,
            slot=slot,
            table=self.tensors.table(used, slot),
            copies=copies,
            send=send,
            recv=recv,
            local_start=int(remote_rows.size),
        )

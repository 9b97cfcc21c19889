"""Every slot's program from a plan's columns, in one vectorised pass grouped by slot.

A plan keeps its remote copies in message order and its messages by id; a slot's program
is the slices of those columns that it sends, receives and copies locally, plus the rows of
the plan's tensor table that they touch. The sort by slot is done once per plan
(`ProgramIndex`); each program is then a handful of NumPy takes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import pairwise

import numpy as np

from refitd.plan.copies import Pieces
from refitd.plan.grouping import dense_index
from refitd.plan.program.codec import narrow_dtypes
from refitd.plan.program.columns import (
    DTYPES,
    STORAGES,
    CopyColumns,
    MessageColumns,
    SlotProgram,
    TensorColumns,
    copy_flags,
)
from refitd.plan.rowwise import row_max, row_prod
from refitd.plan.sides import sort_by
from refitd.plan.table import SpecTable
from refitd.plan.wire import NVFP4


def concat_ranges(start: np.ndarray, end: np.ndarray) -> np.ndarray:
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
    pools: tuple[str, ...]

    @classmethod
    def of(
        cls, tables: Sequence[SpecTable], counts: Sequence[int], slot: np.ndarray, dims: int
    ) -> PlanTensors:
        """From the sides' SpecTables (in plan index order, the first `counts` rows of
        each): attributes are read per distinct geometry, then gathered."""
        geos = [g for t in tables for g in t.geos]
        pools = sorted({g.pool for g in geos})
        pool_id = {p: i for i, p in enumerate(pools)}
        d = max([dims, 1] + [len(g.local_shape) for g in geos])
        n = max(len(geos), 1)
        g_pool = np.zeros(n, np.int64)
        g_dtype = np.zeros(n, np.uint8)
        g_storage = np.zeros(n, np.uint8)
        g_ndim = np.zeros(n, np.uint8)
        g_shape = np.ones((n, d), np.int64)
        dt_id = {x: i for i, x in enumerate(DTYPES)}
        st_id = {x: i for i, x in enumerate(STORAGES)}
        for i, g in enumerate(geos):
            g_pool[i] = pool_id[g.pool]
            g_dtype[i] = dt_id[g.dtype]
            g_storage[i] = st_id[g.storage]
            g_ndim[i] = len(g.local_shape)
            g_shape[i, : len(g.local_shape)] = g.local_shape
        gid, rank = _geo_and_rank(tables, counts)
        return cls(
            slot=slot,
            rank=rank,
            pool=g_pool[gid],
            dtype=g_dtype[gid],
            storage=g_storage[gid],
            ndim=g_ndim[gid],
            local_shape=np.take(g_shape, gid, axis=0),
            pools=tuple(pools),
        )


def _geo_and_rank(
    tables: Sequence[SpecTable], counts: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(geometry id into the tables' geos end to end, rank) of the first `counts` rows of
    each table, in order."""
    parts, ranks, base = [], [], 0
    for t, n_rows in zip(tables, counts, strict=True):  # tables may have grown since
        parts.append(t.columns()[1][:n_rows] + base)
        ranks.append(t.ranks()[:n_rows])
        base += len(t.geos)
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(parts), np.concatenate(ranks)


def worker_columns(
    tables: Sequence[SpecTable], counts: Sequence[int]
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(the pools sorted by name, each row's pool index into them, each row's rank) of the
    first `counts` rows of each table: who registered every plan tensor, as columns, so
    per-worker facts are found without a pass over the TensorSpec objects."""
    geos = [g for t in tables for g in t.geos]
    pools = sorted({g.pool for g in geos})
    pool_id = {p: i for i, p in enumerate(pools)}
    g_pool = np.array([pool_id[g.pool] for g in geos] or [0], np.int64)
    gid, rank = _geo_and_rank(tables, counts)
    return tuple(pools), g_pool[gid], rank


@dataclass(slots=True)
class Messages:
    """Plan-wide message columns, indexed by message id."""

    round: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    path: np.ndarray  # uint8 code into links.PATHS


def _pad(a: np.ndarray, d: int, fill: int) -> np.ndarray:
    """[N, k] -> [N, d] columns, `fill` past k."""
    extra = d - a.shape[1]
    return a if extra <= 0 else np.pad(a, ((0, 0), (0, extra)), constant_values=fill)


@dataclass(slots=True)
class _PieceColumns:
    """The per-piece columns of program copies that need every piece (the flags need each
    copy's shape, dtypes and tensors), computed once per plan; offsets and shapes are
    gathered per chunk of program rows."""

    src: np.ndarray
    dst: np.ndarray
    wire: np.ndarray  # uint8
    ndim: np.ndarray  # uint8
    flags: np.ndarray  # uint8

    @classmethod
    def of(cls, copies: Pieces, t: PlanTensors) -> _PieceColumns:
        c = copies.columns(("src", "dst", "wire", "ndim"))
        src, dst, ndim = c["src"], c["dst"], c["ndim"].astype(np.uint8)
        flags = np.empty(src.size, np.uint8)
        d = t.local_shape.shape[1]
        for a in range(0, src.size, CHUNK_ROWS):  # transients of one chunk's size, reused
            r = slice(a, min(a + CHUNK_ROWS, src.size))
            s, e = src[r], dst[r]
            flags[r] = copy_flags(
                c["wire"][r],
                t.dtype[s],
                t.dtype[e],
                t.storage[e] == 0,
                t.storage[e] == STORAGES.index(NVFP4),
                _pad(copies.column("shape", np.arange(a, r.stop)), d, 1),
                np.take(t.local_shape, s, axis=0),
                np.take(t.local_shape, e, axis=0),
                ndim[r],
            )
        return cls(src, dst, c["wire"].astype(np.uint8), ndim, flags)


def _copy_table(
    copies: Pieces, piece: _PieceColumns, t: PlanTensors, rows: np.ndarray
) -> CopyColumns:
    """Rows `rows` of the plan's copies (remote pieces, then local copies): the per-piece
    columns taken, offsets and shapes gathered straight from the planner's copy table."""
    d = t.local_shape.shape[1]
    src, dst = np.take(piece.src, rows), np.take(piece.dst, rows)  # take: faster than a[rows]
    loc = copies.subset(rows).columns(("src_loc", "dst_loc", "shape"))
    return CopyColumns(
        src=src,
        dst=dst,
        src_off=_pad(loc["src_loc"], d, 0),
        dst_off=_pad(loc["dst_loc"], d, 0),
        shape=_pad(loc["shape"], d, 1),
        ndim=np.take(piece.ndim, rows),
        wire=np.take(piece.wire, rows),
        src_dtype=t.dtype[src],
        dst_dtype=t.dtype[dst],
        flags=np.take(piece.flags, rows),
    )


def _range_max(a: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Maximum of every range of rows of `a` (1-D, or 2-D: over the rows' columns too;
    ranges back to back from 0 to the end, range i starting at lo[i]); an empty range
    gives the (maximum of the) row at its start (0 at the end), as reduceat does. One
    reduceat over the non-empty ranges' starts in the flat array (each ends where the
    next non-empty one starts), without a copy of `a`."""
    d = a.shape[1] if a.ndim == 2 else 1
    top = np.zeros(lo.size, a.dtype)
    full = np.diff(np.r_[lo, a.shape[0]]) > 0
    if full.any():
        top[full] = np.maximum.reduceat(a.reshape(-1), lo[full] * d)
    empty = np.flatnonzero(~full & (lo < a.shape[0]))
    if empty.size:
        top[empty] = row_max(a[lo[empty]]) if a.ndim == 2 else a[lo[empty]]
    return top


CHUNK_ROWS = 1 << 18  # program copy rows taken at once by default (about 25 MB of columns)


def _within(counts: np.ndarray) -> np.ndarray:
    """Position of every element inside its group, for groups of `counts` in order."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


def _chunk_starts(rows: np.ndarray, chunk_rows: int) -> np.ndarray:
    """First dense slot of each chunk of slots, chunks of about `chunk_rows` program rows.
    A chunk never ends with a slot without copies: such a slot's narrowest dtypes are
    read from the row at its start (_range_max), the next slot's first row."""
    starts, taken, last = [0], 0, 0
    for k, n in enumerate(rows.tolist()):
        if last and taken >= chunk_rows:  # slot k - 1 has copies
            starts.append(k)
            taken = 0
        taken, last = taken + n, n
    return np.array(starts, np.int64)


def _narrowest(cols: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, list[str]]:
    """Per column (values, first row of each slot's range), the narrowest travelling dtype
    of each slot's range (codec.narrow_dtypes)."""
    out: dict[str, list[str]] = {}
    for name, (a, lo) in cols.items():
        a = a if a.ndim == 1 or a.shape[1] else a.reshape(-1)
        out[name] = narrow_dtypes(_range_max(a, lo)).tolist()
    return out


class ProgramIndex:
    """Every slot's program, built in one pass over the plan's columns.

    Program copy rows are laid out slot after slot (sends' copies, receives' copies, local
    copies); their columns are taken from the plan's a chunk of slots at a time, when a
    slot of the chunk is first asked for, so a pass over every slot (`programs`) never
    holds the whole table: at 4,096 ranks it would be 0.8 GB of fresh pages. A program
    is then slices (views) of its chunk's columns, of the message columns ordered by
    slot, and of the tensor rows each slot touches."""

    def __init__(
        self,
        digest: str,
        copies: Pieces,
        n_remote: int,
        msgs: Messages,
        tensors: PlanTensors,
        chunk_rows: int = CHUNK_ROWS,
    ) -> None:
        """`copies`: the plan's remote pieces in message order, then its local copies;
        `chunk_rows`: about how many program copy rows are taken at once."""
        self.digest, self.tensors = digest, tensors
        self.slots, self._dense = dense_index(tensors.slot)
        n_slots = self.slots.size
        send = self._side(msgs, msgs.src)
        recv = self._side(msgs, msgs.dst)
        lslot = self._dense[copies.column("src", np.arange(n_remote, copies.rows.size))]
        l_order = np.argsort(lslot, kind="stable")
        l_cnt = np.bincount(lslot, minlength=n_slots)
        total = send["copies"] + recv["copies"] + l_cnt
        base = np.cumsum(total) - total
        rows = np.empty(int(total.sum()), np.int64)
        rows[np.repeat(base, send["copies"]) + _within(send["copies"])] = send["rows"]
        at = base + send["copies"]
        rows[np.repeat(at, recv["copies"]) + _within(recv["copies"])] = recv["rows"]
        at = at + recv["copies"]
        rows[np.repeat(at, l_cnt) + _within(l_cnt)] = l_order + n_remote
        self._rows, self._pieces = rows, copies
        self._piece = _PieceColumns.of(copies, tensors)
        self.copy_lo, self.copy_hi = base, base + total
        # chunk i holds dense slots [_bounds[i], _bounds[i + 1])
        self._bounds = np.r_[_chunk_starts(total, chunk_rows), n_slots]
        self._built: dict[int, tuple[int, CopyColumns, dict[str, list[str]]]] = {}
        self.local_start = send["copies"] + recv["copies"]
        self.send = self._messages(msgs, send, np.zeros(n_slots, np.int64))
        self.recv = self._messages(msgs, recv, send["copies"])
        self._send_lo, self._send_hi = send["lo"].tolist(), send["hi"].tolist()
        self._recv_lo, self._recv_hi = recv["lo"].tolist(), recv["hi"].tolist()
        self._tables(n_slots)
        self._narrow()

    def _narrow(self) -> None:
        """Per slot and integer column of messages and tensors, the narrowest travelling
        dtype (codec.narrow_dtypes): one maximum per slot and column, from reduceat over
        the slot-major columns (copy columns: per chunk, `_copies_of`)."""
        cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for side, m, lo in (("send", self.send, self._send_lo), ("recv", self.recv, self._recv_lo)):
            for f in fields(MessageColumns):
                cols[f"{side}.{f.name}"] = (getattr(m, f.name), np.array(lo, np.int64))
        for name in ("index", "slot", "rank", "pool", "local_shape"):
            cols[f"tensors.{name}"] = (self.table_cols[name], self.table_lo)
        self.narrow = _narrowest(cols)

    def _copies_of(self, k: int) -> tuple[int, CopyColumns, dict[str, list[str]]]:
        """(first dense slot, copy columns, narrowest dtypes per slot) of the chunk of
        slots holding dense slot k, taken on first use and kept (`programs` drops them)."""
        i = int(np.searchsorted(self._bounds, k, side="right")) - 1
        chunk = self._built.get(i)
        if chunk is None:
            k0, k1 = int(self._bounds[i]), int(self._bounds[i + 1])
            a, b = int(self.copy_lo[k0]), int(self.copy_hi[k1 - 1])
            c = _copy_table(self._pieces, self._piece, self.tensors, self._rows[a:b])
            lo = self.copy_lo[k0:k1] - a
            names = ("src", "dst", "src_off", "dst_off", "shape")
            chunk = (k0, c, _narrowest({f"copies.{n}": (getattr(c, n), lo) for n in names}))
            self._built[i] = chunk
        return chunk

    def programs(self) -> Iterator[SlotProgram]:
        """Every slot's program, slots ascending; each chunk's columns are dropped once its
        slots' programs are made, so the pass holds one chunk at a time."""
        for i, (k0, k1) in enumerate(pairwise(self._bounds.tolist())):
            for k in range(k0, k1):
                yield self.program(int(self.slots[k]))
            self._built.pop(i, None)

    def _side(self, msgs: Messages, slot_of_msg: np.ndarray) -> dict[str, np.ndarray]:
        """Messages of one direction grouped by this end's slot, ids ascending."""
        dense = np.searchsorted(self.slots, slot_of_msg)
        order = sort_by(dense)
        slot = dense[order]
        start, end = np.take(msgs.start, order), np.take(msgs.end, order)
        lens = end - start
        n = self.slots.size
        return {
            "order": order,
            "lens": lens,
            "rows": concat_ranges(start, end),
            "msgs": np.bincount(slot, minlength=n),
            "copies": np.bincount(slot, weights=lens, minlength=n).astype(np.int64),
        }

    def _messages(self, msgs: Messages, side: dict, offset: np.ndarray) -> MessageColumns:
        """Message columns of all slots back to back, start/end relative to each program."""
        o, lens, cnt = side["order"], side["lens"], side["msgs"]
        end = np.cumsum(lens)
        slot_base = np.cumsum(side["copies"]) - side["copies"]
        end = end - np.repeat(slot_base - offset, cnt)
        self_lo = np.cumsum(cnt) - cnt
        m = MessageColumns(
            id=o.astype(np.int64, copy=False),
            round=np.take(msgs.round, o),
            src_slot=np.take(msgs.src, o),
            dst_slot=np.take(msgs.dst, o),
            start=end - lens,
            end=end,
            nbytes=np.take(msgs.nbytes, o),
            path=np.take(msgs.path, o).astype(np.uint8, copy=False),
        )
        side["lo"], side["hi"] = self_lo, self_lo + cnt
        return m

    def _tables(self, n_slots: int) -> None:
        """Per slot, its own tensors in plan index order; their columns taken once. Empty
        shards (a zero-sized local shape) are left out: nothing reads or writes them, so
        their slot maps no memory for them."""
        t = self.tensors
        k = self._dense
        cols = {
            "slot": t.slot,
            "rank": t.rank,
            "pool": t.pool,
            "dtype": t.dtype,
            "storage": t.storage,
            "ndim": t.ndim,
            "local_shape": t.local_shape,
        }
        held = row_prod(t.local_shape) > 0
        if held.all() and not (np.diff(k) < 0).any():
            # registered slot by slot with no empty shard (the usual case): the columns
            # are already in program order, and millions of rows need no gathering
            idx = np.arange(k.size)
            self.table_cols = {"index": idx, **cols}
        else:
            held_at = np.flatnonzero(held)
            idx = held_at[np.argsort(k[held_at], kind="stable")]
            k = k[held_at]
            self.table_cols = {"index": idx}
            self.table_cols |= {n: np.take(c, idx, axis=0) for n, c in cols.items()}
        counts = np.bincount(k, minlength=n_slots)
        self.table_hi = np.cumsum(counts)
        self.table_lo = self.table_hi - counts

    def held_tensors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every program's table.index end to end, slots ascending, and the offsets
        [slots + 1] of each slot's part: the tensors whose memory handles go with it."""
        return self.table_cols["index"], np.r_[0, self.table_hi].astype(np.int64)

    def program(self, slot: int) -> SlotProgram:
        k = int(np.searchsorted(self.slots, slot))
        if k >= self.slots.size or int(self.slots[k]) != slot:
            raise KeyError(f"slot {slot} holds no tensor of this plan")
        k0, c, narrow = self._copies_of(k)
        at = int(self.copy_lo[k0])
        a, b = int(self.copy_lo[k]) - at, int(self.copy_hi[k]) - at
        copies = CopyColumns(*(getattr(c, f.name)[a:b] for f in fields(CopyColumns)))
        ta, tb = int(self.table_lo[k]), int(self.table_hi[k])
        table = TensorColumns(
            **{n: col[ta:tb] for n, col in self.table_cols.items()}, pools=self.tensors.pools
        )
        return SlotProgram(
            digest=self.digest,
            slot=slot,
            wire_dtypes={n: d[k] for n, d in self.narrow.items()}
            | {n: d[k - k0] for n, d in narrow.items()},
            table=table,
            copies=copies,
            send=self._slice(self.send, self._send_lo[k], self._send_hi[k]),
            recv=self._slice(self.recv, self._recv_lo[k], self._recv_hi[k]),
            local_start=int(self.local_start[k]),
        )

    @staticmethod
    def _slice(m: MessageColumns, lo: int, hi: int) -> MessageColumns:
        return MessageColumns(
            m.id[lo:hi], m.round[lo:hi], m.src_slot[lo:hi], m.dst_slot[lo:hi],
            m.start[lo:hi], m.end[lo:hi], m.nbytes[lo:hi], m.path[lo:hi],
        )  # fmt: skip

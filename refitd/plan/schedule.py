"""Messages and rounds: remote copies cut to buckets, packed per slot pair, scheduled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from refitd.plan import buckets as bk
from refitd.plan.config import PlanConfig
from refitd.plan.copies import CopyTable, Pieces
from refitd.plan.errors import PlanError
from refitd.plan.layout import TensorSpec
from refitd.plan.sides import sort_by
from refitd.plan.wire import PLAIN, RAW_CODE


@dataclass(slots=True)
class ScheduledMessages:
    """Copies of one kind (direct or relay), cut to pieces, sorted and bucketed into
    messages. The pieces are rows of the plan's copy table (`rows`, in message order),
    cut along dim 0 where `step` (row offset) and `len0` (rows) say so."""

    rows: np.ndarray  # [P] copy-table row of every piece, in message order
    step: np.ndarray | None  # [P] row offset of the piece along dim 0 (None: none cut)
    len0: np.ndarray | None  # [P] its length along dim 0
    copy_bytes: np.ndarray  # [P] wire bytes of every piece
    start: np.ndarray  # [M] first piece of each message
    end: np.ndarray  # [M]
    round: np.ndarray  # [M]
    src: np.ndarray  # [M] source slot
    dst: np.ndarray  # [M] destination slot
    nbytes: np.ndarray  # [M]
    round_of_copy: np.ndarray  # [copies before splitting] last round carrying it
    # [M] messages of the lane carrying each message (direct copies on lanes; else empty)
    lane_span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # the pieces of cut copies, for relays that forward them: per copy the position of its
    # first piece (-1: not here), how many and rows per piece; per piece its round
    piece_first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    piece_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    piece_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    piece_round: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def need_of(self, feed: np.ndarray, step: np.ndarray | None) -> np.ndarray:
        """Round after which a relay piece may go: after the round of the feed's piece
        with the same rows (a copy cut along dim 0 is cut the same way for its relays, so
        piece k is forwarded while piece k+1 is still on the wire), else after the feed's
        last piece."""
        need = self.round_of_copy[feed] + 1
        if step is None or not self.piece_round.size:
            return need
        per = np.maximum(self.piece_rows[feed], 1)
        k = step // per
        first = self.piece_first[feed]
        hit = (first >= 0) & (k * per == step) & (k < self.piece_count[feed])
        return np.where(hit, self.piece_round[np.where(hit, first + k, 0)] + 1, need)

    def pieces(self, table: CopyTable) -> Pieces:
        """The pieces as rows of the plan's copy table."""
        return Pieces(table, self.rows, self.step, self.len0)

    def pair_last_round(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Per (src, dst) slot pair, the last round of its messages here (-1 if none)."""
        if not self.src.size:
            return np.full(src.size, -1, np.int64)
        big = int(max(self.src.max(), self.dst.max(), src.max(), dst.max())) + 1
        key = self.src * big + self.dst
        if (key[1:] >= key[:-1]).all():  # messages come pair by pair (as bucketed)
            first = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
            k, r = key[first], np.maximum.reduceat(self.round, first)
        else:
            order = np.lexsort((self.round, key))
            k, r = key[order], self.round[order]
            last = np.r_[k[1:] != k[:-1], True]
            k, r = k[last], r[last]
        q = src * big + dst
        i = np.minimum(np.searchsorted(k, q), k.size - 1)
        return np.where(k[i] == q, r[i], -1)


@dataclass(frozen=True, slots=True)
class BucketScheduler:
    """Turns selected remote copies into messages with rounds. slot_of: the slot of each
    plan tensor; dense: its slot's index in the sorted slots; n_slots: how many slots;
    tensors: the plan's tensors (a cut keeps the blocks of the destination's storage)."""

    config: PlanConfig
    slot_of: np.ndarray
    dense: np.ndarray
    n_slots: int
    tensors: Sequence[TensorSpec]

    def messages(
        self,
        table: CopyTable,
        nb: np.ndarray,
        mask: np.ndarray,
        feeds: ScheduledMessages | None,
        need_rounds: bool,
    ) -> ScheduledMessages:
        """Split, sort and bucket the selected remote copies; rounds per message.

        Direct copies (feeds None): each source's peers over `fanout` lanes. Relays: a
        message's round is above the round of every message that wrote what it forwards
        (and above the pair's direct messages), and a pair's messages take successive
        rounds.
        """
        rows, step, len0 = self.split(table, np.flatnonzero(mask), nb)
        rs = self.slot_of[table.src[rows]]
        rd = self.slot_of[table.dst[rows]]
        rnb = nb[rows]
        if step is not None and len0 is not None:
            p = np.flatnonzero(len0 != np.take(table.shape[:, 0], rows))  # the cut pieces
            r = rows[p]
            shape = np.take(table.shape, r, axis=0)
            shape[:, 0] = len0[p]
            wires = self.config.wires
            rnb[p] = wires.segment_nbytes(table.wire[r], shape, table.ndim[r], table.esize[r])
        need = None
        if feeds is None:
            # a pair's copies largest first: next-fit then pairs the small ones up
            large = nb[rows]
            order = sort_by(
                rs, rd, int(large.max(initial=0)) - large, table.dst[rows], shuffled=True
            )
        else:
            need = feeds.need_of(table.feed[rows], step)
            order = sort_by(rs, rd, need, table.dst[rows], shuffled=True)
            need = need[order]
        rows, rs, rd, rnb = rows[order], rs[order], rd[order], rnb[order]
        if step is not None and len0 is not None:
            step, len0 = step[order], len0[order]
        z = np.zeros(0, np.int64)
        if not rs.size:
            return ScheduledMessages(rows, step, len0, rnb, z, z, z, z, z, z, z)
        pair_first = np.r_[0, np.flatnonzero((np.diff(rs) != 0) | (np.diff(rd) != 0)) + 1]
        ms, me, mp = bk.pack(pair_first, rnb, self.config.bucket_bytes)
        m_round, span = self._rounds(table, rows, rnb, pair_first, ms, mp, rs, rd, feeds, need)
        csum = np.r_[0, np.cumsum(rnb)]
        out = ScheduledMessages(
            rows,
            step,
            len0,
            rnb,
            ms,
            me,
            m_round,
            rs[pair_first][mp],
            rd[pair_first][mp],
            csum[me] - csum[ms],
            z,
            z if span is None else span[mp],
        )
        if need_rounds:
            _record_copy_rounds(out, table)
        return out

    def _rounds(
        self,
        table: CopyTable,
        rows: np.ndarray,
        rnb: np.ndarray,
        pair_first: np.ndarray,
        ms: np.ndarray,
        mp: np.ndarray,
        rs: np.ndarray,
        rd: np.ndarray,
        feeds: ScheduledMessages | None,
        need: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(the round of every message, with lanes the messages of each pair's lane)
        (rows: the table row of every piece; ms: first piece, mp: pair of each message)."""
        p_msgs = np.bincount(mp, minlength=pair_first.size)
        k = np.arange(mp.size) - (np.cumsum(p_msgs) - p_msgs)[mp]
        if feeds is not None and need is not None:
            m_need = np.maximum.reduceat(need, ms)
            after = feeds.pair_last_round(rs[pair_first], rd[pair_first]) + 1
            return bk.successive_rounds(np.maximum(m_need, after[mp]), mp, k), None
        p_src = self.dense[table.src[rows[pair_first]]]
        p_dst = self.dense[table.dst[rows[pair_first]]]
        if self.config.schedule == "serial":
            m_bytes = np.add.reduceat(rnb, ms) if ms.size else rnb[:0]
            return bk.serial_rounds(p_src, p_dst, mp, m_bytes, self.n_slots), None
        p_round, span = bk.assign_rounds(p_src, p_dst, p_msgs, self.n_slots, self.config.fanout)
        return p_round[mp] + k, span

    def split(
        self, t: CopyTable, idx: np.ndarray, nb: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Cut copies larger than a bucket along dim 0, at whole blocks of the wire and of
        the destination's storage (the receiver quantizes a raw copy into that storage
        block by block): (the table row of every piece, its row offset along dim 0, its
        length there), or (idx, None, None) when nothing is cut."""
        bucket = self.config.bucket_bytes
        nbi = nb[idx]
        big = (nbi > bucket) & (t.ndim[idx] >= 1)
        if not big.any():
            return idx, None, None
        rows = np.take(t.shape[:, 0], idx)
        cut = np.flatnonzero(big)  # few: the rest stay whole
        c_rows = rows[cut]
        wires, c_idx = self.config.wires, idx[cut]
        gran = np.maximum(
            wires.split_granularity(t.wire[c_idx], t.ndim[c_idx]),
            wires.split_granularity(self._storage_wire(t.dst[c_idx]), t.ndim[c_idx]),
        )
        c_pieces, c_per = bk.split_rows(c_rows, nbi[cut] // np.maximum(c_rows, 1), gran, bucket)
        pieces = np.ones(idx.size, np.int64)
        pieces[cut] = c_pieces
        per = np.zeros(idx.size, np.int64)  # rows per piece, 0: whole
        per[cut] = c_per
        rep = np.repeat(np.arange(idx.size), pieces)
        k = np.arange(rep.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        per, rows = per[rep], rows[rep]
        step = per * k
        len0 = np.where(per > 0, np.minimum(per, rows - step), rows)
        return idx[rep], step, len0

    def _storage_wire(self, dst: np.ndarray) -> np.ndarray:
        """Code of the wire whose blocks each destination's storage keeps (raw for plain
        storage, which lands values as they come)."""
        storages = [self.tensors[d].storage for d in dst.tolist()]
        wires = self.config.wires
        code = {s: None if s == PLAIN else wires.for_storage(s) for s in set(storages)}
        return np.array([RAW_CODE if code[s] is None else code[s] for s in storages], np.int64)


def _record_copy_rounds(out: ScheduledMessages, table: CopyTable) -> None:
    """The last round carrying each copy (its pieces may be several), and with cut copies
    where each copy's pieces are and their rounds, for relays that forward them
    (ScheduledMessages.need_of). Direct pieces are sorted by keys equal for all pieces of a
    copy, stably, so each copy's pieces stay adjacent and in row order."""
    n = table.src.size
    piece_round = np.repeat(out.round, out.end - out.start)
    cid = table.cid[out.rows]
    first = np.r_[0, np.flatnonzero(np.diff(cid)) + 1] if cid.size else cid
    if first.size != np.count_nonzero(np.bincount(cid, minlength=n)):
        raise PlanError("bucketing: the pieces of a copy are not adjacent")  # never: sorted
    out.round_of_copy = np.zeros(n, np.int64)
    out.round_of_copy[cid[first]] = np.maximum.reduceat(piece_round, first) if cid.size else 0
    if out.step is None:
        return
    count = np.diff(np.r_[first, cid.size])
    out.piece_first = np.full(n, -1, np.int64)
    out.piece_first[cid[first]] = first
    out.piece_count = np.zeros(n, np.int64)
    out.piece_count[cid[first]] = count
    out.piece_rows = np.zeros(n, np.int64)
    cut = first[count > 1]
    out.piece_rows[cid[cut]] = out.step[cut + 1] - out.step[cut]
    out.piece_round = piece_round

"""The Plan: columnar copies, messages and rounds of a whole cluster, its statistics, and
the slot programs derived from it on demand.

Stats: send_imbalance = source_max_send_bytes / ideal_send_bytes, both over source slots
(ideal = bytes leaving source slots / source slots); max_send_bytes is over all slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refitd.plan.config import PlanConfig
from refitd.plan.copies import CopyTable, Pieces
from refitd.plan.grouping import dense_index
from refitd.plan.layout import TensorSpec
from refitd.plan.links import PATHS, path_summary
from refitd.plan.program.build import (
    CHUNK_ROWS,
    Messages,
    PlanTensors,
    ProgramIndex,
    concat_ranges,
    worker_columns,
)
from refitd.plan.program.columns import SlotProgram
from refitd.plan.schedule import BucketScheduler, ScheduledMessages
from refitd.plan.sides import sort_by
from refitd.plan.stamp_schedule import PoolSlots, stamped_messages
from refitd.plan.table import SpecTable


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Byte and count totals of a plan (bytes are wire bytes, alignment included).

    send_imbalance and ideal_send_bytes are over source slots (see the module docstring);
    relay_bytes/relay_copies: remote copies forwarded by destination slots; pools_stamped:
    identical destination pools planned once and stamped (planner.py), 0 when none.
    """

    copies: int
    local_copies: int
    messages: int
    rounds: int
    total_bytes: int
    local_bytes: int
    remote_bytes: int
    source_slots: int
    max_send_bytes: int
    ideal_send_bytes: float
    send_imbalance: float
    max_recv_bytes: int
    source_max_send_bytes: int = 0
    relay_bytes: int = 0
    relay_copies: int = 0
    pools_stamped: int = 0


class Plan:
    """A whole-cluster plan: columnar copies, messages and rounds; SlotPrograms on demand."""

    def __init__(
        self,
        model: str,
        epoch: int,
        digest: str,
        tensors: Sequence[TensorSpec],
        table: CopyTable,
        slot_of_tensor: np.ndarray,
        config: PlanConfig,
        sources_count: int,
        tables: Sequence[SpecTable] | None = None,
        pools_stamped: int = 0,
        pools: PoolSlots | None = None,
    ) -> None:
        """`tables`: SpecTables whose rows, in order, are `tensors` (the two sides', or one
        per worker); without them the program index tabulates `tensors` itself. `pools`:
        the table is stamped pools reading the same sources (stamp_schedule), bucketed
        and scheduled once."""
        self.model, self.epoch, self.digest, self.tensors = model, epoch, digest, tensors
        self.config = config
        self._n_src = sources_count
        self._tables = None if tables is None else (tuple(tables), [len(t) for t in tables])
        self._slot_of = slot_of_tensor
        slots, self._dense = dense_index(slot_of_tensor)
        self._all_slots = slots
        local = slot_of_tensor[table.src] == slot_of_tensor[table.dst]
        nb = table.per_copy(
            config.wires.segment_nbytes(table.wire, table.shape, table.ndim, table.esize)
        )
        # local copies from source tensors first; local relays run after all receives
        lidx = np.flatnonzero(local)
        lidx = lidx[np.argsort(table.feed[lidx] >= 0, kind="stable")]
        self._local = Pieces(table, lidx)
        relays, remote_nb = self._schedule(table, nb, local, pools)
        self._m_path, self._m_fallback = config.links.choose(self._m_src, self._m_dst)
        self._remote_table: CopyTable | None = None  # relay_feeds' whole table
        # per message rather than per copy: a message's bytes are its copies' (integers,
        # summed exactly in float64 either way), and messages are several times fewer
        dense_slot = np.zeros(int(slots.max(initial=0)) + 1, np.int64)
        dense_slot[slots] = np.arange(slots.size)
        self._send_load = np.bincount(
            dense_slot[self._m_src], weights=self._m_bytes, minlength=slots.size
        )
        self._recv_load = np.bincount(
            dense_slot[self._m_dst], weights=self._m_bytes, minlength=slots.size
        )
        self.stats = self._statistics(int(nb[local].sum()), int(remote_nb.sum()), relays)
        if pools_stamped:
            self.stats = dataclasses.replace(self.stats, pools_stamped=pools_stamped)
        self._readers: dict[tuple[str, int], list[int]] | None = None
        self._index: ProgramIndex | None = None

    def _schedule(
        self, table: CopyTable, nb: np.ndarray, local: np.ndarray, pools: PoolSlots | None
    ) -> tuple[ScheduledMessages, np.ndarray]:
        """Bucket the remote copies (direct ones, then relays after what they forward) and
        keep all messages ordered by (round, src, dst): (the relay messages, the wire
        bytes of every remote copy)."""
        sched = BucketScheduler(
            self.config, self._slot_of, self._dense, self._all_slots.size, self.tensors
        )
        stamped = None if pools is None else stamped_messages(sched, table, nb, local, pools)
        if stamped is not None:
            direct, relays = stamped
        else:
            table = table.whole()
            relay = table.feed >= 0
            any_relay = bool(relay.any())
            direct = sched.messages(table, nb, ~local & ~relay, None, any_relay)
            relays = sched.messages(table, nb, ~local & relay, direct, False)
        n_direct = direct.rows.size
        # every copy in program index order, remote and local ones views of it: the
        # program index takes it as it is (no second copy of millions of rows)
        self._copies = Pieces.concat([direct.pieces(table), relays.pieces(table), self._local])
        n_remote = n_direct + relays.rows.size
        self._remote = self._copies.subset(slice(0, n_remote))
        self._local = self._copies.subset(slice(n_remote, None))
        m_round = np.concatenate([direct.round, relays.round])
        m_src = np.concatenate([direct.src, relays.src])
        m_dst = np.concatenate([direct.dst, relays.dst])
        m_order = _by_round(m_round, m_src, m_dst, n_direct=direct.src.size)
        self._m_round = m_round[m_order]
        self._m_src, self._m_dst = m_src[m_order], m_dst[m_order]
        # the other columns are placed from the two parts: no joined copy to gather from
        at = np.empty_like(m_order)
        at[m_order] = np.arange(m_order.size)
        self._m_start = _placed(at, direct.start, relays.start, n_direct)
        self._m_end = _placed(at, direct.end, relays.end, n_direct)
        self._m_bytes = _placed(at, direct.nbytes, relays.nbytes)
        return relays, np.concatenate([direct.copy_bytes, relays.copy_bytes])

    def _statistics(
        self, local_bytes: int, remote_bytes: int, relays: ScheduledMessages
    ) -> PlanStats:
        """Totals and loads (see the module docstring for the imbalance)."""
        send, recv = self._send_load, self._recv_load
        is_source = np.zeros(self._all_slots.size, dtype=bool)
        is_source[self._dense[: self._n_src]] = True
        n_src_slots = int(is_source.sum())
        src_send = send[is_source]
        ideal = float(src_send.sum()) / n_src_slots if n_src_slots else 0.0
        src_max = int(src_send.max()) if src_send.size else 0
        return PlanStats(
            copies=int(self._local.rows.size + self._remote.rows.size),
            local_copies=int(self._local.rows.size),
            messages=int(self._m_start.size),
            rounds=int(self._m_round.max()) + 1 if self._m_round.size else 0,
            total_bytes=remote_bytes + local_bytes,
            local_bytes=local_bytes,
            remote_bytes=remote_bytes,
            source_slots=n_src_slots,
            max_send_bytes=int(send.max()) if send.size else 0,
            ideal_send_bytes=ideal,
            send_imbalance=src_max / ideal if ideal else 1.0,
            max_recv_bytes=int(recv.max()) if recv.size else 0,
            source_max_send_bytes=src_max,
            relay_bytes=int(relays.copy_bytes.sum()),
            relay_copies=int(relays.rows.size),
        )

    def slots(self) -> list[int]:
        """Every slot that holds a registered tensor (source or destination)."""
        return self._all_slots.tolist()

    def source_slots_of(self, pool: str, rank: int) -> list[int]:
        """Slots that read the tensors of source worker (pool, rank); relays, which read
        destination tensors, don't count. Computed for all workers on the first call."""
        if self._readers is None:
            # marks rather than np.unique: a hash of every copy's source (10^7 at 4,096
            # ranks) for a few million distinct tensors
            read = np.zeros(self._slot_of.size, bool)
            read[self._remote.column("src")] = True
            read[self._local.column("src")] = True
            used = np.flatnonzero(read[: self._n_src])
            pools, pool_of, rank_of = self._workers()
            readers: dict[tuple[str, int], list[int]] = {}
            for p, r, slot in _distinct(pool_of[used], rank_of[used], self._slot_of[used]):
                readers.setdefault((pools[p], r), []).append(slot)
            self._readers = readers
        return list(self._readers.get((pool, rank), []))

    def source_workers(self) -> set[tuple[str, int]]:
        """(pool, rank) of every source worker with a tensor in the plan."""
        pools, pool_of, rank_of = self._workers()
        n = self._n_src
        return {(pools[p], r) for p, r in _distinct(pool_of[:n], rank_of[:n])}

    def holders(self) -> dict[int, tuple[tuple[str, int], ...]]:
        """slot -> (pool, rank) of the workers with tensors of the plan on it, sorted."""
        pools, pool_of, rank_of = self._workers()
        out: dict[int, list[tuple[str, int]]] = {}
        for slot, p, r in _distinct(self._slot_of, pool_of, rank_of):
            out.setdefault(slot, []).append((pools[p], r))  # pools are sorted by name
        return {slot: tuple(keys) for slot, keys in out.items()}

    def _workers(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """(pools, pool index, rank) of every plan tensor (worker_columns)."""
        if self._index is not None:
            t = self._index.tensors
            return t.pools, t.pool, t.rank
        return worker_columns(*self._sides())

    def _sides(self) -> tuple[Sequence[SpecTable], list[int]]:
        """The SpecTables whose first rows are the plan's tensors, and those row counts."""
        if self._tables is not None:
            return self._tables
        own = (
            SpecTable.from_specs(self.tensors[: self._n_src]),
            SpecTable.from_specs(self.tensors[self._n_src :]),
        )
        return own, [self._n_src, len(self.tensors) - self._n_src]

    def message_columns(self) -> dict[str, np.ndarray]:
        """Every remote message as columns, row = message id: src and dst slot, round, wire
        bytes, relay (it forwards received blocks), path (a code into links.PATHS). For
        tools such as the link model."""
        return {
            "path": self._m_path.copy(),
            "src": self._m_src.copy(),
            "dst": self._m_dst.copy(),
            "round": self._m_round.copy(),
            "nbytes": self._m_bytes.copy(),
            "relay": self._remote.column("feed", self._m_start) >= 0,
        }

    def relay_feeds(self) -> tuple[np.ndarray, np.ndarray]:
        """(relay message id, feeding message id) pairs: the remote messages that write a
        region a relay message forwards (what its sender must have received first; feeds by
        local copies are left out, they run before any receive). For the link model."""
        if self._remote_table is None:
            self._remote_table = self._remote.take()
        t = self._remote_table
        n = t.src.size
        msg = np.repeat(np.arange(self._m_start.size), self._m_end - self._m_start)
        msg_of_row = np.empty(n, np.int64)
        msg_of_row[concat_ranges(self._m_start, self._m_end)] = msg
        relay = np.flatnonzero(t.feed >= 0)
        order = np.argsort(t.cid, kind="stable")
        lo = np.searchsorted(t.cid[order], t.feed[relay], side="left")
        hi = np.searchsorted(t.cid[order], t.feed[relay], side="right")
        r = np.repeat(relay, hi - lo)
        f = order[concat_ranges(lo, hi)]
        d = np.arange(t.shape.shape[1])
        live = d < t.ndim[r][:, None]
        a0, an = t.src_loc[r], t.shape[r]
        b0, bn = t.dst_loc[f], t.shape[f]
        hit = ((a0 < b0 + bn) & (b0 < a0 + an) | ~live).all(axis=1) & (t.dst[f] == t.src[r])
        pairs = np.unique(np.c_[msg_of_row[r[hit]], msg_of_row[f[hit]]], axis=0)
        return pairs[:, 0].copy(), pairs[:, 1].copy()

    def link_summary(self) -> dict[str, object]:
        """Messages and bytes per path, local copies, and the fallbacks of a forced links
        mode (links.path_summary): what refit records and the status show."""
        st = self.stats
        return path_summary(
            self._m_path,
            self._m_bytes,
            self._m_fallback,
            st.local_copies,
            st.local_bytes,
            self.config.links.mode,
        )

    def message_path(self, mid: int) -> str:
        """The path of message `mid`."""
        return PATHS[int(self._m_path[mid])]

    def send_bytes(self) -> dict[int, int]:
        """Remote bytes each slot sends."""
        return {int(s): int(b) for s, b in zip(self._all_slots, self._send_load, strict=True)}

    def recv_bytes(self) -> dict[int, int]:
        """Remote bytes each slot receives."""
        return {int(s): int(b) for s, b in zip(self._all_slots, self._recv_load, strict=True)}

    @property
    def source_count(self) -> int:
        """`tensors[:source_count]` are source specs, the rest destination specs."""
        return self._n_src

    def program_index(self, chunk_rows: int = CHUNK_ROWS) -> ProgramIndex:
        """Per-slot positions of all messages and copies, built once per plan (its copy
        columns taken about `chunk_rows` rows at a time: ProgramIndex)."""
        if self._index is None:
            tables, counts = self._sides()
            dims = self._remote.table.shape.shape[1]
            tensors = PlanTensors.of(tables, counts, self._slot_of, dims)
            msgs = Messages(
                self._m_round,
                self._m_src,
                self._m_dst,
                self._m_start,
                self._m_end,
                self._m_bytes,
                self._m_path,
            )
            n_remote = self._remote.rows.size
            self._index = ProgramIndex(
                self.digest, self._copies, n_remote, msgs, tensors, chunk_rows
            )
        return self._index

    def release_index(self) -> None:
        """Drop the program index; the next program() builds it again. For an owner that
        holds every slot's encoded program and asks for programs again only on rare paths
        (190 MB at 1,024 ranks)."""
        self._index = None

    def program(self, slot: int) -> SlotProgram:
        """What the transfer process of `slot` executes (columns), messages ordered by
        (round, id)."""
        return self.program_index().program(slot)

    def programs(self, slots: Sequence[int] | None = None) -> dict[int, SlotProgram]:
        """The programs of `slots` (default: every slot), from one index pass."""
        index = self.program_index()
        return {s: index.program(s) for s in (self.slots() if slots is None else slots)}


def _distinct(*cols: np.ndarray) -> list[tuple[int, ...]]:
    """The distinct rows of non-negative integer columns, sorted (first column most
    significant), as tuples of ints: a few thousand workers from millions of tensors."""
    if not cols[0].size:
        return []
    # a worker's tensors are registered together: runs of equal rows shrink millions of
    # rows to a few thousand before the sort
    run = np.ones(cols[0].size, bool)
    run[1:] = np.logical_or.reduce([c[1:] != c[:-1] for c in cols])
    cols = tuple(c[run] for c in cols)
    order = sort_by(*cols)
    keep = np.ones(order.size, bool)
    sorted_cols = [c[order] for c in cols]
    keep[1:] = np.logical_or.reduce([np.diff(c) != 0 for c in sorted_cols])
    return list(zip(*(c[keep].tolist() for c in sorted_cols), strict=True))


def _placed(at: np.ndarray, first: np.ndarray, then: np.ndarray, shift: int = 0) -> np.ndarray:
    """np.concatenate([first, then + shift])[order] for `at` the inverse of `order`: each
    part written to its places, without the joined column to gather from."""
    out = np.empty(at.size, np.result_type(first, then))
    out[at[: first.size]] = first
    out[at[first.size :]] = then + shift if shift else then
    return out


def _by_round(m_round: np.ndarray, src: np.ndarray, dst: np.ndarray, n_direct: int) -> np.ndarray:
    """sort_by(m_round, src, dst) of the direct messages followed by the relays, each in
    (src, dst) order as bucketed: the two merged by (src, dst), then one stable pass by
    round (rounds are few), instead of a sort of the three keys together."""
    big = int(max(src.max(initial=0), dst.max(initial=0))) + 1
    key = src * big + dst
    dk, rk = key[:n_direct], key[n_direct:]
    if m_round.size < 2 or (np.diff(dk) < 0).any() or (np.diff(rk) < 0).any():
        return sort_by(m_round, src, dst)
    merged = np.empty(key.size, np.int64)  # stable: on equal pairs the direct ones first
    merged[np.arange(dk.size) + np.searchsorted(rk, dk, "left")] = np.arange(dk.size)
    merged[np.arange(rk.size) + np.searchsorted(dk, rk, "right")] = np.arange(n_direct, key.size)
    return merged[sort_by(m_round[merged])]

"""Flow-level link model: replay a plan's messages on hosts, NICs and NVLink.

Input is plain NumPy columns per message (source slot, destination slot, round, wire bytes,
relay flag) and a Topology (slot -> host and NIC, NIC rate, NVLink rate), so the model does
not depend on the planner's classes (`messages_from_plan` is the one adapter). A message
between two slots of one host uses the sender's NVLink out and the receiver's NVLink in;
between hosts, the sender's NIC out and the receiver's NIC in (full duplex: each direction
is its own resource). Concurrent flows share every resource max-min fairly (progressive
filling), recomputed at every event (a flow ending or starting): an event-driven
flow-level simulation, vectorised over the live flows.

Messages are cut into chunks of `chunk_bytes` as the executor cuts them (WIRE_CHUNK), and
each slot runs its chunks in the executor's order, (round, chunk index, message id). How
much of that order runs at once is the transport's (ExecMode):
- STREAM (NCCL as the executor drives it today): every (round, chunk, message) step is one
  NCCL group on the slot's one stream, so a slot moves one chunk at a time, sending or
  receiving, and a chunk moves when it is the current step of both its ends.
- GROUP (NCCL, one group per (round, chunk index) step): all of a slot's chunks of a step
  move together; the slot's next step starts when they all ended.
- POSTED (Gloo): every chunk is posted at once in that order and moves as soon as both ends
  posted it and the chunks before it between the same two slots (one connection) ended;
  a slot's poster stops at a chunk of a relay message until all its receives of smaller
  rounds ended (the executor's relay rule), so later posts of that slot wait too.

Sharing.UNEVEN replaces max-min fairness with strict priority by receiver, the other end of
what TCP does on a shaped link; it brackets the measured time from above (docs/simulate.md).

lower_bound: the busiest resource's bytes over its rate (NIC send or receive, NVLink send or
receive), the time no schedule can beat on this topology.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from refitd.plan.program.build import concat_ranges

DEFAULT_CHUNK_BYTES = 32 << 20  # the executor's WIRE_CHUNK
GBIT = 1e9 / 8  # bytes per second in one Gbit/s


class ExecMode(StrEnum):
    STREAM = "stream"
    GROUP = "group"
    POSTED = "posted"


class Sharing(StrEnum):
    """How concurrent flows share a resource. FAIR: max-min fair (the fluid ideal).
    UNEVEN: strict priority by receiving resource (the lower first), the extreme of TCP
    flows from one sender that do not share a shaped link evenly (one runs while the
    other waits); a real run lies between the two."""

    FAIR = "fair"
    UNEVEN = "uneven"


@dataclass(frozen=True)
class Topology:
    """Where each slot sits. Arrays are indexed by slot id (0..max slot id).

    host: host of each slot; nic: NIC of each slot (one per GPU, or one per host);
    nic_rate: bytes/s of one NIC per direction; nvlink_rate: bytes/s of one slot's
    NVLink (or host-local path) per direction.
    """

    host: np.ndarray
    nic: np.ndarray
    nic_rate: float
    nvlink_rate: float

    @classmethod
    def gpu_hosts(
        cls,
        n_slots: int,
        gpus_per_host: int = 8,
        nic_gbit: float = 400.0,
        nvlink_gbyte: float = 450.0,
    ) -> Topology:
        """Hosts of `gpus_per_host` consecutive slots, one NIC per GPU."""
        s = np.arange(n_slots)
        return cls(s // gpus_per_host, s.copy(), nic_gbit * GBIT, nvlink_gbyte * 1e9)

    @classmethod
    def host_nics(
        cls, host_of_slot: np.ndarray, nic_gbit: float, local_gbyte: float = 10.0
    ) -> Topology:
        """One NIC per host shared by its slots (e.g. emulated hosts with a shaped link)."""
        h = np.asarray(host_of_slot, dtype=np.int64)
        return cls(h, h.copy(), nic_gbit * GBIT, local_gbyte * 1e9)


@dataclass(frozen=True)
class MessageTable:
    """One row per message: slots, round, wire bytes, whether it forwards (relay), id.
    feeds: (relay message row, feeding message row) pairs, the messages that deliver what a
    relay forwards; a relay without any waits for every receive of a smaller round."""

    src: np.ndarray
    dst: np.ndarray
    round: np.ndarray
    nbytes: np.ndarray
    relay: np.ndarray
    id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    feeds: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64))
    )

    @classmethod
    def of(
        cls,
        src: Any,
        dst: Any,
        round: Any,
        nbytes: Any,
        relay: Any = None,
        feeds: tuple[Any, Any] | None = None,
    ) -> MessageTable:
        src = np.asarray(src, dtype=np.int64)
        relay = np.zeros(src.size, bool) if relay is None else np.asarray(relay, dtype=bool)
        pairs = ([], []) if feeds is None else feeds
        return cls(
            src,
            np.asarray(dst, dtype=np.int64),
            np.asarray(round, dtype=np.int64),
            np.asarray(nbytes, dtype=np.int64),
            relay,
            np.arange(src.size, dtype=np.int64),
            (np.asarray(pairs[0], dtype=np.int64), np.asarray(pairs[1], dtype=np.int64)),
        )


@dataclass(frozen=True)
class Bound:
    """The lower bound and which resource sets it."""

    seconds: float
    resource: str  # e.g. "nic 3 recv"
    nic_send_max: int
    nic_recv_max: int
    nvlink_send_max: int
    nvlink_recv_max: int


@dataclass(frozen=True)
class Result:
    makespan: float
    events: int
    chunks: int
    finish: np.ndarray  # [chunks] end time of each chunk, in chunk order
    slot_busy_end: np.ndarray  # [slots] time each slot's last chunk ended


def lower_bound(msgs: MessageTable, topo: Topology) -> Bound:
    """max over NICs / slots of bytes sent or received over the resource's rate."""
    inter = topo.host[msgs.src] != topo.host[msgs.dst]
    n_nic = int(topo.nic.max()) + 1
    n_slot = topo.host.size
    b = msgs.nbytes.astype(np.float64)
    parts = {
        "nic send": np.bincount(topo.nic[msgs.src[inter]], b[inter], n_nic),
        "nic recv": np.bincount(topo.nic[msgs.dst[inter]], b[inter], n_nic),
        "nvlink send": np.bincount(msgs.src[~inter], b[~inter], n_slot),
        "nvlink recv": np.bincount(msgs.dst[~inter], b[~inter], n_slot),
    }
    best, where = 0.0, "none"
    for name, load in parts.items():
        rate = topo.nvlink_rate if name.startswith("nvlink") else topo.nic_rate
        if load.size and load.max() / rate > best:
            best, where = float(load.max() / rate), f"{name.split()[0]} {int(load.argmax())} "
            where += name.split()[1]
    return Bound(
        best,
        where,
        *(int(parts[k].max(initial=0)) for k in parts),
    )


@dataclass
class _Chunks:
    """Messages cut into chunks, sorted by the executor's key (round, chunk index, id);
    msg: the message row of each chunk."""

    msg: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    round: np.ndarray
    index: np.ndarray
    nbytes: np.ndarray
    relay: np.ndarray
    res_out: np.ndarray
    res_in: np.ndarray


def _chunks(msgs: MessageTable, topo: Topology, chunk_bytes: int) -> tuple[_Chunks, np.ndarray]:
    """Chunks and the capacity of every resource (NIC out/in per NIC, NVLink out/in per
    slot); resources are numbered [nic out | nic in | nvlink out | nvlink in]."""
    n = np.maximum(-(-msgs.nbytes // chunk_bytes), 1)
    m = np.repeat(np.arange(msgs.src.size), n)
    k = np.arange(m.size) - np.repeat(np.cumsum(n) - n, n)
    nb = np.minimum(msgs.nbytes[m] - k * chunk_bytes, chunk_bytes)
    order = np.lexsort((msgs.id[m], k, msgs.round[m]))
    m, k, nb = m[order], k[order], nb[order]
    src, dst = msgs.src[m], msgs.dst[m]
    n_nic = int(topo.nic.max()) + 1
    n_slot = topo.host.size
    inter = topo.host[src] != topo.host[dst]
    res_out = np.where(inter, topo.nic[src], 2 * n_nic + src)
    res_in = np.where(inter, n_nic + topo.nic[dst], 2 * n_nic + n_slot + dst)
    cap = np.r_[np.full(2 * n_nic, topo.nic_rate), np.full(2 * n_slot, topo.nvlink_rate)]
    c = _Chunks(m, src, dst, msgs.round[m], k, nb, msgs.relay[m], res_out, res_in)
    return c, cap


def fair_rates(res_out: np.ndarray, res_in: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows that each use two resources (progressive filling)."""
    n = res_out.size
    rate = np.zeros(n)
    if not n:
        return rate
    left = cap.astype(np.float64).copy()
    live = np.ones(n, dtype=bool)
    while True:
        ro, ri = res_out[live], res_in[live]
        cnt = np.bincount(ro, minlength=cap.size) + np.bincount(ri, minlength=cap.size)
        used = cnt > 0
        share = np.where(used, left / np.maximum(cnt, 1), np.inf)
        tight = int(share.argmin())
        delta = float(share[tight])
        rate[live] += delta
        left -= delta * cnt
        full = left <= 1e-9 * cap
        full[tight] = True
        stop = full[ro] | full[ri]
        if stop.all():
            return rate
        idx = np.flatnonzero(live)
        live[idx[stop]] = False


def priority_rates(
    res_out: np.ndarray, res_in: np.ndarray, cap: np.ndarray, order: np.ndarray
) -> np.ndarray:
    """Rates under strict priority: flows in `order` each take what their two resources
    have left."""
    left = cap.astype(np.float64).copy()
    rate = np.zeros(res_out.size)
    for i in order.tolist():
        o, n = int(res_out[i]), int(res_in[i])
        rate[i] = r = min(left[o], left[n])
        left[o] -= r
        left[n] -= r
    return rate


def _segments(keys: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, start) so order[start[g]:start[g+1]] lists, in index order, the rows whose
    key is g."""
    order = np.argsort(keys, kind="stable")
    start = np.r_[0, np.cumsum(np.bincount(keys, minlength=n_groups))]
    return order, start


def simulate(
    msgs: MessageTable,
    topo: Topology,
    mode: ExecMode = ExecMode.STREAM,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_events: int = 10_000_000,
    fast: bool = True,
    sharing: Sharing = Sharing.FAIR,
) -> Result:
    """Makespan of the messages on the topology under the executor's order (module doc).
    fast: STREAM on a topology with a NIC per slot takes the one-pass path (same result).
    sharing: how flows share a resource (Sharing)."""
    c, cap = _chunks(msgs, topo, chunk_bytes)
    n_slot = topo.host.size
    if fast and mode == ExecMode.STREAM and np.unique(topo.nic).size == topo.nic.size:
        return _stream_exclusive(c, cap, n_slot)
    engine = (
        _PostedEngine(c, n_slot, msgs.feeds) if mode == ExecMode.POSTED else _Steps(c, n_slot, mode)
    )
    finish = np.full(c.src.size, np.nan)
    rem = c.nbytes.astype(np.float64)
    active = np.zeros(0, np.int64)
    t, events = 0.0, 0
    new = engine.start()
    while True:
        active = np.r_[active, new]
        if not active.size:
            break
        events += 1
        if events > max_events:
            raise RuntimeError(f"link model: more than {max_events} events")
        ro, ri = c.res_out[active], c.res_in[active]
        if sharing == Sharing.FAIR:
            rate = fair_rates(ro, ri, cap)
        else:
            rate = priority_rates(ro, ri, cap, np.lexsort((active, ri)))
        moving = rate > 0  # under Sharing.UNEVEN a flow may wait at rate 0
        dt = float((rem[active][moving] / rate[moving]).min())
        t += dt
        rem[active] -= rate * dt
        done_mask = rem[active] <= np.maximum(rate * dt * 1e-9, 1.0)
        done = active[done_mask]
        active = active[~done_mask]
        finish[done] = t
        new = engine.done(done)
    if np.isnan(finish).any():
        raise RuntimeError(
            f"link model: {int(np.isnan(finish).sum())} chunks never started (order deadlock)"
        )
    busy = np.zeros(n_slot)
    np.maximum.at(busy, c.src, finish)
    np.maximum.at(busy, c.dst, finish)
    return Result(t, events, int(c.src.size), finish, busy)


def _stream_exclusive(c: _Chunks, cap: np.ndarray, n_slot: int) -> Result:
    """STREAM where no two slots share a resource (a NIC per slot): a slot moves one chunk at
    a time, so no flow ever shares a resource and every chunk runs at its path's rate; a
    chunk starts when both ends finished their previous chunk (chunks are in key order,
    which is every slot's order). Same result as the event loop, in one pass."""
    dur = (c.nbytes / np.minimum(cap[c.res_out], cap[c.res_in])).tolist()
    free = [0.0] * n_slot
    finish = [0.0] * len(dur)
    for i, (s, d, t) in enumerate(zip(c.src.tolist(), c.dst.tolist(), dur, strict=True)):
        end = max(free[s], free[d]) + t
        free[s] = free[d] = finish[i] = end
    return Result(max(free, default=0.0), len(dur), len(dur), np.array(finish), np.array(free))


class _Steps:
    """STREAM / GROUP: each slot runs its steps in order; a chunk moves when both of its
    ends are at its step."""

    def __init__(self, c: _Chunks, n_slot: int, mode: ExecMode) -> None:
        n = c.src.size
        # chunks are in key order already; a step is (round, index[, chunk]) in that order
        if mode == ExecMode.STREAM:
            step = np.arange(n)
        else:
            new = np.r_[True, (np.diff(c.round) != 0) | (np.diff(c.index) != 0)]
            step = np.cumsum(new) - 1
        # per slot, its ops (chunk ids) in order; both ends of every chunk
        slot = np.r_[c.src, c.dst]
        chunk = np.r_[np.arange(n), np.arange(n)]
        o = np.lexsort((chunk, slot))
        self.op_chunk = chunk[o]
        op_slot = slot[o]
        op_step = step[self.op_chunk]
        first = np.r_[True, (np.diff(op_slot) != 0) | (np.diff(op_step) != 0)]
        self.grp_start = np.flatnonzero(first)  # groups: (slot, step) runs of ops
        self.grp_end = np.r_[self.grp_start[1:], op_slot.size]
        grp_slot = op_slot[self.grp_start]
        self.slot_grp = np.r_[0, np.cumsum(np.bincount(grp_slot, minlength=n_slot))]
        self.cur = self.slot_grp[:-1].copy()  # current group of each slot
        self.left = np.zeros(n_slot, np.int64)
        self.ready = np.zeros(n, np.int8)
        self.src, self.dst = c.src, c.dst

    def _enter(self, slots: np.ndarray) -> np.ndarray:
        """Slots enter their current group; chunks ready at both ends start."""
        slots = slots[self.cur[slots] < self.slot_grp[slots + 1]]
        g = self.cur[slots]
        self.left[slots] = self.grp_end[g] - self.grp_start[g]
        ops = self.op_chunk[concat_ranges(self.grp_start[g], self.grp_end[g])]
        np.add.at(self.ready, ops, 1)
        ops = np.unique(ops)
        return ops[self.ready[ops] == 2]

    def start(self) -> np.ndarray:
        return self._enter(np.arange(self.cur.size))

    def done(self, chunks: np.ndarray) -> np.ndarray:
        ends = np.r_[self.src[chunks], self.dst[chunks]]
        np.subtract.at(self.left, ends, 1)
        ends = np.unique(ends)
        fin = ends[self.left[ends] == 0]
        self.cur[fin] += 1
        return self._enter(fin)


class _PostedEngine:
    """POSTED: per (src, dst) pair chunks move one after another; a chunk moves once both
    ends posted it; a slot's posting stops at a relay chunk until its receives ended, in
    posting order, up to the last one of a message feeding the relay (never more than its
    receives of smaller rounds), as the executor's poster waits."""

    def __init__(self, c: _Chunks, n_slot: int, feeds: tuple[np.ndarray, np.ndarray]) -> None:
        n = c.src.size
        self.c = c
        pair = c.src * n_slot + c.dst
        _, self.pair_id = np.unique(pair, return_inverse=True)
        n_pair = int(self.pair_id.max()) + 1 if n else 0
        self.pair_order, self.pair_start = _segments(self.pair_id, n_pair)
        self.pair_next = self.pair_start[:-1].copy()  # next chunk (position) per pair
        self.pair_busy = np.zeros(n_pair, bool)
        # per slot, its ops in key order (chunk order); for relay sends, receives needed
        slot = np.r_[c.src, c.dst]
        chunk = np.r_[np.arange(n), np.arange(n)]
        is_send = np.r_[np.ones(n, bool), np.zeros(n, bool)]
        o = np.lexsort((chunk, slot))
        op_slot, op_chunk, op_send = slot[o], chunk[o], is_send[o]
        self.recv_order, self.recv_start = _segments(c.dst, n_slot)
        # receives of a smaller round at the sender, for relay chunks
        need = np.zeros(op_chunk.size, np.int64)
        relay = op_send & c.relay[op_chunk]
        if relay.any():
            rr = c.round[self.recv_order]
            rs = c.dst[self.recv_order]
            key = rs * (int(c.round.max()) + 2) + rr
            q = op_slot[relay] * (int(c.round.max()) + 2) + c.round[op_chunk[relay]]
            need[relay] = np.searchsorted(key, q) - self.recv_start[op_slot[relay]]
            fed = self._fed_prefix(c, feeds)  # per message; -1: not known
            f = fed[c.msg[op_chunk[relay]]]
            need[relay] = np.where(f >= 0, np.minimum(need[relay], f), need[relay])
        starts = np.r_[0, np.cumsum(np.bincount(op_slot, minlength=n_slot))]
        seg_base = np.repeat(np.arange(n_slot), np.diff(starts))
        # running max of `need` within each slot's run (offset per slot keeps runs apart)
        big = int(need.max(initial=0)) + 1
        self.op_req = np.maximum.accumulate(need + seg_base * big) - seg_base * big
        self.op_chunk, self.op_start = op_chunk, starts
        self.posted = starts[:-1].copy()  # ops posted per slot (end position)
        self.recv_done = np.zeros(n_slot, np.int64)  # completed prefix of receives
        self.recv_next = self.recv_start[:-1].copy()
        self.ends_posted = np.zeros(n, np.int8)
        self.finished = np.zeros(n, bool)
        self.n_slot = n_slot

    def _fed_prefix(self, c: _Chunks, feeds: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Per message row: how many of its sender's receives, in posting order, end with
        the last chunk of a message feeding it (-1: no feeds given)."""
        n_msg = int(c.msg.max()) + 1 if c.msg.size else 0
        out = np.full(n_msg, -1, np.int64)
        relay_msg, feed_msg = feeds
        if not relay_msg.size:
            return out
        pos = np.empty(c.src.size, np.int64)  # a chunk's place among its receiver's receives
        pos[self.recv_order] = np.arange(c.src.size) - self.recv_start[c.dst[self.recv_order]]
        last = np.full(n_msg, -1, np.int64)  # per message, its last receive's place + 1
        np.maximum.at(last, c.msg, pos + 1)
        np.maximum.at(out, relay_msg, last[feed_msg])
        return out

    def _post(self, slots: np.ndarray) -> None:
        """Advance the posters of these slots as far as the relay rule allows."""
        for s in slots.tolist():
            lo, hi = int(self.posted[s]), int(self.op_start[s + 1])
            if lo >= hi:
                continue
            end = lo + int(np.searchsorted(self.op_req[lo:hi], self.recv_done[s], side="right"))
            if end > lo:
                np.add.at(self.ends_posted, self.op_chunk[lo:end], 1)
                self.posted[s] = end

    def _startable(self) -> np.ndarray:
        """Next chunk of every idle pair, where both ends posted it."""
        pairs = np.flatnonzero(~self.pair_busy & (self.pair_next < self.pair_start[1:]))
        heads = self.pair_order[self.pair_next[pairs]]
        ok = self.ends_posted[heads] == 2
        self.pair_busy[pairs[ok]] = True
        return heads[ok]

    def start(self) -> np.ndarray:
        self._post(np.arange(self.n_slot))
        return self._startable()

    def done(self, chunks: np.ndarray) -> np.ndarray:
        self.finished[chunks] = True
        p = self.pair_id[chunks]
        self.pair_busy[p] = False
        self.pair_next[p] += 1
        touched = np.unique(self.c.dst[chunks])
        for s in touched.tolist():  # completed receive prefix (in posting order)
            i, hi = int(self.recv_next[s]), int(self.recv_start[s + 1])
            while i < hi and self.finished[self.recv_order[i]]:
                i += 1
            self.recv_done[s] = i - self.recv_start[s]
            self.recv_next[s] = i
        self._post(touched)
        return self._startable()


def messages_from_plan(plan: Any) -> MessageTable:
    """The adapter from a Plan (its message_columns; row i is message id i, the id the
    executor orders by)."""
    m = plan.message_columns()
    feeds = plan.relay_feeds() if m["relay"].any() else None
    return MessageTable.of(m["src"], m["dst"], m["round"], m["nbytes"], m["relay"], feeds)

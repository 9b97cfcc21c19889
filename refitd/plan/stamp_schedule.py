"""Messages and rounds of stamped pools: the first pool's schedule repeated for the others.

A stamped plan's copy table holds pool p's copy i at row p * n + i, each the first pool's
copy i on pool p's slots, reading the same source slot (relays: the same member of its
own pool). Its messages are then the first pool's, bucketed once, on each pool's slots.
Rounds merge the pools as one schedule over all of them would: a source slot's lane
carries its pairs of every pool back to back, pool after pool, so pool p's message goes
p lane-lengths after the first pool's; a relay goes after the rounds of what it forwards
in its own pool, and a pair's messages take successive rounds, as bucketing gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refitd.plan import buckets as bk
from refitd.plan.copies import CopyTable
from refitd.plan.schedule import BucketScheduler, ScheduledMessages


@dataclass(frozen=True, slots=True)
class PoolSlots:
    """The pools of a stamped copy table: `pools` pools of `copies` copies each (pool p's
    copy i at row p * copies + i); first: the first pool's slots, sorted; slots[p, j]:
    pool p's counterpart of first[j]. Other slots (the sources') are every pool's."""

    pools: int
    copies: int
    first: np.ndarray
    slots: np.ndarray

    def of_pool(self, p: int, slot: np.ndarray) -> np.ndarray:
        """Pool p's slot of each of `slot` (first-pool slots or a source's)."""
        i = np.minimum(np.searchsorted(self.first, slot), self.first.size - 1)
        return np.where(self.first[i] == slot, self.slots[p][i], slot)


def stamped_messages(
    sched: BucketScheduler,
    table: CopyTable,
    nb: np.ndarray,
    local: np.ndarray,
    pools: PoolSlots,
) -> tuple[ScheduledMessages, ScheduledMessages] | None:
    """(direct, relay) messages of the whole stamped table from the first pool's, or None
    where a relay sender also sends direct copies (its relay rounds would then hang on
    the direct rounds of its own pair)."""
    n = pools.copies
    first = table.first(n)
    relay = first.feed >= 0
    d0 = sched.messages(first, nb[:n], ~local[:n] & ~relay, None, bool(relay.any()))
    r0 = sched.messages(first, nb[:n], ~local[:n] & relay, d0, False)
    if not d0.lane_span.size and d0.src.size:
        return None  # not the lanes schedule
    direct_sender = np.zeros(int(max(d0.src.max(initial=0), r0.src.max(initial=0))) + 1, bool)
    direct_sender[d0.src] = True
    if direct_sender[r0.src].any():
        return None
    return _direct(d0, pools), _relays(d0, r0, first, pools)


def _direct(d0: ScheduledMessages, pools: PoolSlots) -> ScheduledMessages:
    """The first pool's direct messages for every pool, in (source slot, pool, first-pool
    order) order: each source's run of messages once per pool, so the messages stay in
    (src, dst) order where the pools' slots ascend with the pool."""
    k, m = pools.pools, d0.src.size
    run = np.r_[0, np.flatnonzero(d0.src[1:] != d0.src[:-1]) + 1] if m else np.zeros(0, np.int64)
    run_len = np.diff(np.r_[run, m])
    at = np.repeat(run, run_len)  # first message of each message's source run
    pos = np.arange(k, dtype=np.int64)[:, None] * np.repeat(run_len, run_len)[None, :]
    order = np.empty(k * m, np.int64)  # order[place] = pool-major index of the message
    order[(k * at + pos + (np.arange(m) - at)).reshape(-1)] = np.arange(k * m)
    pool = np.arange(k, dtype=np.int64)[:, None]
    rounds = d0.round[None, :] + pool * d0.lane_span[None, :]
    dst = np.stack([pools.of_pool(p, d0.dst) for p in range(k)])
    out = _repeat(d0, pools, rounds.reshape(-1), np.tile(d0.src, k), dst.reshape(-1))
    return _reorder(out, order)


def _relays(
    d0: ScheduledMessages, r0: ScheduledMessages, first: CopyTable, pools: PoolSlots
) -> ScheduledMessages:
    """The first pool's relay messages for every pool, pool by pool; pool p's rounds after
    the rounds of its own pool's feeds (a feed's pieces all go on one pair, so on one
    lane: pool p's feed rounds are the first pool's moved on by p lane-lengths)."""
    k, m = pools.pools, r0.src.size
    span_of_copy = np.zeros(pools.copies, np.int64)
    span_of_copy[d0.rows] = np.repeat(d0.lane_span, d0.end - d0.start)
    feed = first.feed[r0.rows]
    need, shift = d0.need_of(feed, r0.step), span_of_copy[feed]
    pair = np.r_[0, np.flatnonzero((np.diff(r0.src) != 0) | (np.diff(r0.dst) != 0)) + 1]
    mp = np.repeat(np.arange(pair.size), np.diff(np.r_[pair, m])) if m else r0.src
    kth = np.arange(m) - pair[mp] if m else mp
    rounds = np.empty((k, m), np.int64)
    for p in range(k):
        m_need = np.maximum.reduceat(need + p * shift, r0.start) if m else r0.src
        rounds[p] = bk.successive_rounds(m_need, mp, kth)
    src = np.stack([pools.of_pool(p, r0.src) for p in range(k)]).reshape(-1)
    dst = np.stack([pools.of_pool(p, r0.dst) for p in range(k)]).reshape(-1)
    return _repeat(r0, pools, rounds.reshape(-1), src, dst)


def _repeat(
    s: ScheduledMessages, pools: PoolSlots, rounds: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> ScheduledMessages:
    """Messages `s` once per pool, pool by pool: pool p's pieces are its own rows of the
    table, its messages those pieces with the rounds and slots given."""
    k, n, z = pools.pools, pools.copies, np.zeros(0, np.int64)
    pool = np.arange(k, dtype=np.int64)[:, None]
    n_pieces = s.rows.size
    return ScheduledMessages(
        rows=(s.rows[None, :] + pool * n).reshape(-1),
        step=None if s.step is None else np.tile(s.step, k),
        len0=None if s.len0 is None else np.tile(s.len0, k),
        copy_bytes=np.tile(s.copy_bytes, k),
        start=(s.start[None, :] + pool * n_pieces).reshape(-1),
        end=(s.end[None, :] + pool * n_pieces).reshape(-1),
        round=rounds,
        src=src,
        dst=dst,
        nbytes=np.tile(s.nbytes, k),
        round_of_copy=z,
    )


def _reorder(s: ScheduledMessages, order: np.ndarray) -> ScheduledMessages:
    """The same pieces, the messages in `order`."""
    s.start, s.end, s.round = s.start[order], s.end[order], s.round[order]
    s.src, s.dst, s.nbytes = s.src[order], s.dst[order], s.nbytes[order]
    return s

"""Buckets and rounds, on columnar copy tables.

Copies between one (source slot, destination slot) pair are coalesced into messages of at
most bucket_bytes (a larger copy is first cut along its outermost dim, at quantization
block boundaries when the wire has blocks: wire.WireRegistry.split_granularity). Each
slot's peers are visited in a rotated order over `fanout` lanes, so a slot talks to a few
peers at a time, every lane stays busy and destinations are not all hit by everyone in the
same round.
"""

from __future__ import annotations

import heapq

import numpy as np

from refitd.plan.grouping import sum_before_in_runs
from refitd.plan.sides import sort_by


def _ceil(a: np.ndarray, b: int | np.ndarray) -> np.ndarray:
    return -(-a // b)


def split_rows(
    shape0: np.ndarray, row_bytes: np.ndarray, gran: np.ndarray, bucket: int
) -> tuple[np.ndarray, np.ndarray]:
    """(pieces per copy, rows per piece) so each piece fits the bucket where possible."""
    rows_fit = np.maximum(bucket // np.maximum(row_bytes, 1), 1)
    per = np.maximum(rows_fit // gran * gran, gran)
    per = np.minimum(per, np.maximum(shape0, 1))
    return _ceil(np.maximum(shape0, 1), per), per


def pack(pair_start: np.ndarray, nbytes: np.ndarray, bucket: int):
    """Next-fit packing of each pair's run of copies (the runs, starting at `pair_start`,
    tile the copies in order): (message first copy, message end, pair index) for all
    messages, pairs in order and messages in order within a pair."""
    cum = np.cumsum(nbytes)
    before = cum - nbytes
    # a copy that cannot share a message with the one before it (together over a bucket)
    # starts a message wherever the run began, so the runs between such copies are
    # packed independently: most are one copy long and leave the loop at once
    first = np.zeros(nbytes.size, dtype=bool)
    first[pair_start] = True
    first[1:] |= nbytes[1:] + nbytes[:-1] > bucket
    cur = np.flatnonzero(first)
    pair = np.repeat(
        np.arange(pair_start.size), np.diff(np.searchsorted(cur, np.r_[pair_start, nbytes.size]))
    )
    pair_end = np.r_[cur[1:], nbytes.size]
    starts, ends, pairs = [], [], []
    while cur.size:
        end = np.searchsorted(cum, before[cur] + bucket, side="right")
        end = np.minimum(np.maximum(end, cur + 1), pair_end)
        starts.append(cur)
        ends.append(end)
        pairs.append(pair)
        live = end < pair_end
        cur = end[live]
        pair_end = pair_end[live]
        pair = pair[live]
    s = np.concatenate(starts)
    e = np.concatenate(ends)
    p = np.concatenate(pairs)
    order = sort_by(p, s)
    return s[order], e[order], p[order]


def assign_rounds(
    pair_src: np.ndarray,
    pair_dst: np.ndarray,
    pair_msgs: np.ndarray,
    n_slots: int,
    fanout: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(first round of each pair, messages of the lane it is dealt to): a source's peers
    in rotated order (starting after itself) dealt over `fanout` lanes; a lane sends its
    pairs' messages back to back."""
    rot = (pair_dst - pair_src) % n_slots
    order = np.lexsort((rot, pair_src))
    src_sorted = pair_src[order]
    first = np.r_[0, np.flatnonzero(np.diff(src_sorted)) + 1]
    group_start = np.repeat(first, np.diff(np.r_[first, order.size]))
    j = np.arange(order.size) - group_start
    lane = j % max(fanout, 1)
    order2 = np.lexsort((j, lane, src_sorted))
    m = pair_msgs[order][order2]
    key_src = src_sorted[order2]
    key_lane = lane[order2]
    new = np.r_[True, (np.diff(key_src) != 0) | (np.diff(key_lane) != 0)]
    base = sum_before_in_runs(m, new)
    run = np.flatnonzero(new)
    lane_msgs = np.repeat(np.add.reduceat(m, run), np.diff(np.r_[run, m.size])) if m.size else m
    rounds = np.empty(order.size, dtype=np.int64)
    rounds[order[order2]] = base
    span = np.empty(order.size, dtype=np.int64)
    span[order[order2]] = lane_msgs
    return rounds, span


def successive_rounds(need: np.ndarray, pair: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Rounds of messages given in pair order (k: index within the pair): message k of a
    pair goes no earlier than its `need` and after message k-1 of the same pair, i.e.
    round_k = k + max over j <= k of (need_j - j)."""
    if not need.size:
        return need
    v = need - k
    # pairs apart by more than v's range: one running maximum over all pairs restarts at
    # each pair (in place: a few passes over millions of messages)
    apart = pair * (int(v.max() - v.min()) + 1)
    v += apart
    np.maximum.accumulate(v, out=v)
    v -= apart
    v += k
    return v


def serial_rounds(
    pair_src: np.ndarray,
    pair_dst: np.ndarray,
    msg_pair: np.ndarray,
    msg_bytes: np.ndarray,
    n_slots: int,
) -> np.ndarray:
    """Rounds of messages (given in pair order) from a list schedule in which every slot
    moves one message at a time, sending or receiving (an executor that runs one transfer
    per slot at a time, e.g. NCCL on one stream): whenever both ends of pairs are idle, the
    pair with the most bytes goes next and sends all its messages back to back. Time is
    counted in bytes (every link alike). A message's round is the rank of its start time,
    so every slot meets its messages in schedule order and has at most one per round."""
    if not msg_pair.size:
        return np.zeros(0, np.int64)
    pair_bytes = np.bincount(msg_pair, weights=msg_bytes, minlength=pair_src.size).astype(np.int64)
    start = _list_schedule(pair_src.tolist(), pair_dst.tolist(), pair_bytes.tolist(), n_slots)
    first = np.r_[0, np.flatnonzero(np.diff(msg_pair)) + 1]
    run = np.diff(np.r_[first, msg_pair.size])
    before = np.cumsum(msg_bytes) - msg_bytes
    before -= np.repeat(before[first], run)
    msg_start = np.asarray(start, dtype=np.int64)[msg_pair] + before
    return np.unique(msg_start, return_inverse=True)[1].astype(np.int64)


def _list_schedule(src: list[int], dst: list[int], nbytes: list[int], n_slots: int) -> list[int]:
    """Start (in bytes) of each pair: largest ready pair first, both ends idle."""
    free = [0] * n_slots
    start = [0] * len(src)
    heap = [(0, -b, p) for p, b in enumerate(nbytes)]
    heapq.heapify(heap)
    while heap:
        at, neg, p = heapq.heappop(heap)
        s, d = src[p], dst[p]
        ready = max(free[s], free[d])
        if ready > at:  # an end got busy since: retry when it is idle
            heapq.heappush(heap, (ready, neg, p))
            continue
        start[p] = ready
        free[s] = free[d] = ready + nbytes[p]
    return start

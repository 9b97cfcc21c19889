"""Weighted shares of one link between two lanes, through the executor's own gate.

`Share` / `LinkShares` admit each lane's send chunks to one peer; a wire thread plays the
connection behind them: chunks leave first posted, first sent, at a fixed rate, and each
completion is reported back as the executor's send-waiter does. A second lane starts while
the first is sending; its share of the bytes that left while it was sending must be its
weight's share, at 1:1 and at 3:1.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from refitd.executor.shares import LinkShares, Share

PEER = 1
CHUNK = 1 << 20
RATE = 100e6  # bytes per second the wire drains
PACK_S = 0.001  # a lane's work between two chunks (packing the next)


def _lane(share: Share, chunks: int, wire: queue.SimpleQueue, started: list[float]) -> None:
    started.append(time.monotonic())
    share.expect({PEER: chunks * CHUNK})
    deadline = time.monotonic() + 30.0
    try:
        for _ in range(chunks):
            time.sleep(PACK_S)
            share.admit(PEER, CHUNK, deadline, threading.Event(), lambda: None)
            wire.put(share)
    finally:
        wire.put(None)


def _wire(wire: queue.SimpleQueue, lanes: int, sent: list[tuple[float, int]]) -> None:
    """One connection: chunks leave in posting order at RATE; each completion is reported."""
    done = 0
    while done < lanes:
        share = wire.get()
        if share is None:
            done += 1
            continue
        time.sleep(CHUNK / RATE)
        sent.append((time.monotonic(), share.lane))
        share.sent(PEER, CHUNK)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
def test_a_second_lane_gets_its_weights_share_of_the_link(weights) -> None:
    shares = LinkShares()
    wire: queue.SimpleQueue = queue.SimpleQueue()
    sent: list[tuple[float, int]] = []
    starts: list[list[float]] = [[], []]
    line = threading.Thread(target=_wire, args=(wire, 2, sent), daemon=True)
    line.start()
    big = threading.Thread(
        target=_lane, args=(Share(shares, 0, weights[0]), 90, wire, starts[0]), daemon=True
    )
    big.start()
    while len(sent) < 10:  # the first lane has the link to itself for a while
        time.sleep(0.005)
    small = threading.Thread(
        target=_lane, args=(Share(shares, 1, weights[1]), 24, wire, starts[1]), daemon=True
    )
    small.start()
    for t in (big, small, line):
        t.join(30.0)
    assert not line.is_alive()
    t0 = starts[1][0]
    t1 = max(t for t, lane in sent if lane == 1)
    during = [lane for t, lane in sent if t0 <= t <= t1]
    share = during.count(1) / len(during)
    target = weights[1] / sum(weights)
    assert during.count(0) > 0  # neither starves
    assert abs(share / target - 1) <= 0.10, (share, target, len(during))

"""Weighted shares of one link between two lanes, through the executor's own gate.

`Share` / `LinkShares` admit each lane's send chunks to one peer; a wire thread plays the
connection behind them: chunks leave first posted, first sent, at a fixed rate, and each
completion is reported back as the executor's send-waiter does. A second lane starts while
the first is sending; its share of the bytes that left while it was sending must be its
weight's share, at 1:1 and at 3:1. With chunks of several MiB and a small second lane, the
lanes take turns by pieces of each chunk (Share.pieces), as the executor posts them.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from refitd.executor.shares import LinkShares, Share, pieces
from refitd.plan.lanes import LANE_PIECE

PEER = 1
CHUNK = 1 << 20
RATE = 100e6  # bytes per second the wire drains
PACK_S = 0.001  # a lane's work between two chunks (packing the next)


def _lane(
    share: Share, chunks: int, chunk: int, wire: queue.SimpleQueue, started: list[float]
) -> None:
    """A refit's poster: each chunk's pieces, each admitted on its own, posted in order."""
    started.append(time.monotonic())
    share.expect({PEER: chunks * chunk})
    deadline = time.monotonic() + 30.0
    try:
        for _ in range(chunks):
            time.sleep(PACK_S)
            for _at, n in share.pieces(chunk):
                share.admit(PEER, n, deadline, threading.Event(), lambda: None)
                wire.put((share, n))
    finally:
        wire.put(None)


def _wire(wire: queue.SimpleQueue, lanes: int, sent: list[tuple[float, int, int]]) -> None:
    """One connection: sends leave in posting order at RATE; each completion is reported."""
    done = 0
    while done < lanes:
        item = wire.get()
        if item is None:
            done += 1
            continue
        share, n = item
        time.sleep(n / RATE)
        sent.append((time.monotonic(), share.lane, n))
        share.sent(PEER, n)


def _second_lanes_share(weights, big: tuple[int, int], small: tuple[int, int], piece: int):
    """Lane 0 sends big = (chunks, bytes each); once it has the link to itself for a while,
    lane 1 sends small; lane 1's part of the bytes that left while it was sending."""
    shares = LinkShares()
    wire: queue.SimpleQueue = queue.SimpleQueue()
    sent: list[tuple[float, int, int]] = []
    starts: list[list[float]] = [[], []]
    line = threading.Thread(target=_wire, args=(wire, 2, sent), daemon=True)
    line.start()
    lanes = []
    for lane, (chunks, nbytes) in enumerate((big, small)):
        share = Share(shares, lane, weights[lane], piece)
        lanes.append(
            threading.Thread(target=_lane, args=(share, chunks, nbytes, wire, starts[lane]))
        )
        lanes[-1].start()
        alone = time.monotonic() + 30.0
        while not lane and sum(n for _, _, n in sent) < 10 * CHUNK:  # lane 0 alone first
            assert time.monotonic() < alone, "the first lane sent nothing for 30 s"
            time.sleep(0.005)
    for t in (*lanes, line):
        t.join(30.0)
    assert not line.is_alive()
    t0 = starts[1][0]
    t1 = max(t for t, lane, _ in sent if lane == 1)
    during = [(lane, n) for t, lane, n in sent if t0 <= t <= t1]
    mine = sum(n for lane, n in during if lane == 1)
    assert mine < sum(n for _, n in during)  # neither starves
    return mine / sum(n for _, n in during)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
def test_a_second_lane_gets_its_weights_share_of_the_link(weights) -> None:
    share = _second_lanes_share(weights, (90, CHUNK), (24, CHUNK), 0)
    target = weights[1] / sum(weights)
    assert abs(share / target - 1) <= 0.10, (share, target)


def test_a_small_second_lane_takes_turns_by_pieces_of_large_chunks() -> None:
    """Chunks of 4 MiB, a second lane of 8 of them at 3:1: by whole chunks each of the first
    lane's chunks between the second's moves its share by a tenth; by pieces it stays
    within 10 % of its weight's share."""
    weights = (1.0, 3.0)
    share = _second_lanes_share(weights, (24, 4 * CHUNK), (8, 4 * CHUNK), LANE_PIECE)
    assert abs(share / 0.75 - 1) <= 0.10, share


@pytest.mark.parametrize("nbytes", [1, 64, LANE_PIECE, LANE_PIECE + 16, 4 * LANE_PIECE + 3])
def test_pieces_cover_a_chunk_in_order(nbytes: int) -> None:
    cuts = pieces(nbytes, LANE_PIECE)
    assert [at for at, _ in cuts] == [sum(n for _, n in cuts[:k]) for k in range(len(cuts))]
    assert sum(n for _, n in cuts) == nbytes and all(0 < n <= LANE_PIECE for _, n in cuts)
    assert len(cuts) == -(-nbytes // LANE_PIECE)
    assert pieces(nbytes, 0) == [(0, nbytes)]

"""Weighted sharing of each link between the refits of several models that run at once.

A transfer process runs one refit per lane (one lane per model refitting at that moment);
their sends to one peer go through one connection, first posted first sent. `LinkShares`
decides the order in which the lanes post their sends to each peer: weighted fair
queueing by bytes. Each lane's bytes admitted so far, divided by its weight, is its served
count; while other lanes have bytes waiting or in flight to the same peer, the lane with
the smallest count posts next (a lane whose bytes all went out stops counting). Bytes
posted are queued first in, first out on the connection, so a lane that posted far ahead
would hold a later lane behind all of it: per peer, at most a window of bytes is posted and
not yet sent, a lane alone included (a chunk larger than the window goes alone). The window
is time, not bytes: `window_s` of the link's drain rate, measured from the sends'
completions over spans of RATE_SPAN_S (START_WINDOW until a rate is known; never under
`min_window` nor over `window` bytes), so a lane that starts waits about `window_s` (one
chunk, at least) behind the others on a slow link, while a fast link keeps up to `window`
posted to stay busy. A lane's turn is one send: a refit with a `piece` size (the controller
sets one while several models can refit at once) sends each larger chunk as several matched
sends of about that size (`pieces`: both ends cut a chunk alike from its size alone), each
admitted on its own, so the lanes alternate at that grain whatever the plan's chunk sizes.
A lane counts as sending to a peer while it has bytes waiting or in flight there, and also,
for up to `hold_s` after its last admission or completion there, while bytes it expects to
send there (`expect`) are not yet admitted: with a window of one send, a lane is otherwise
idle for a moment after each completion, and a lane that always waits would take every
turn. A lane that starts while others run begins at their smallest
count, so idle time earns no credit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from refitd.executor.chunks import Chunk
from refitd.executor.errors import ExecutionError
from refitd.plan.lanes import lane_tag

SHARE_WINDOW = 16 << 20  # the window's ceiling in bytes
SHARE_WINDOW_S = 0.01  # seconds of the link's drain rate posted and not yet sent, per peer
MIN_WINDOW = 1 << 20  # the window's floor in bytes
SHARE_HOLD_S = 0.05  # how long expected bytes keep a lane's turn with nothing in flight
START_WINDOW = 4 << 20  # the window until the link's rate is known
_PIECE_ALIGN = 64  # pieces start at multiples of this
RATE_SPAN_S = 0.05  # the rate is measured over spans at least this long
_RATE_GAIN = 0.5  # weight of each span in the rate's moving average


def gated_bytes(
    chunks: Iterable[Chunk], skip: Container[int], one_sided: Container[int],
    peer: Callable[[int], int],
) -> dict[int, int]:  # fmt: skip
    """Bytes a refit sends through the link gates (two-sided sends of messages not skipped),
    per peer rank: what its Share expects."""
    out: dict[int, int] = {}
    for ch in chunks:
        if ch.mid not in skip and id(ch) not in one_sided:
            dst = peer(ch.dst_slot)
            out[dst] = out.get(dst, 0) + ch.nbytes
    return out


def pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the sends a chunk of `nbytes` goes in: equal cuts of at most about
    `piece` bytes at multiples of 64 (one when `piece` is 0 or the chunk no larger). Sender
    and receiver derive the same cuts from the chunk's size."""
    if piece <= 0 or nbytes <= piece:
        return [(0, nbytes)]
    n = -(-nbytes // piece)
    size = -(-nbytes // n // _PIECE_ALIGN) * _PIECE_ALIGN
    return [(at, min(size, nbytes - at)) for at in range(0, nbytes, size)]


@dataclass(frozen=True)
class Share:
    """One refit's place on the links: its lane, its model's weight, the process's gates
    (none: the refit posts as it goes, in lane 0), and the piece size its two-sided chunks
    go in (0: whole; both ends of every chunk of a refit have the same)."""

    shares: LinkShares | None = None
    lane: int = 0
    weight: float = 0.0  # 0: 1
    piece: int = 0

    def pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """The sends (offset, bytes) of a two-sided chunk of `nbytes` (module `pieces`)."""
        return pieces(nbytes, self.piece)

    def tag(self, tag: int) -> int:
        return lane_tag(tag, self.lane) if self.lane else tag

    def admit(
        self, peer: int, nbytes: int, deadline: float, abort: threading.Event,
        flush: Callable[[], None],
    ) -> bool:  # fmt: skip
        """Wait for this lane's share of the link to `peer` (LinkShares.acquire); True when
        other lanes share the link (the caller posts at once, in the order admitted)."""
        if self.shares is None:
            return False
        weight = self.weight if self.weight > 0 else 1.0
        return self.shares.acquire(peer, self.lane, weight, nbytes, deadline, abort, flush)

    def expect(self, peer_bytes: dict[int, int]) -> None:
        """The bytes this refit will send to each peer (its turns are kept for them)."""
        if self.shares is not None:
            self.shares.expect(self.lane, peer_bytes)

    def sent(self, peer: int, nbytes: int) -> None:
        if self.shares is not None:
            self.shares.release(peer, self.lane, nbytes)

    def leave(self) -> None:
        if self.shares is not None:
            self.shares.leave(self.lane)


@dataclass
class _Link:
    inflight: int = 0
    by_lane: dict[int, int] = field(default_factory=dict)  # lane -> bytes in flight
    waiting: dict[int, int] = field(default_factory=dict)  # lane -> chunks waiting
    served: dict[int, float] = field(default_factory=dict)  # lane -> bytes / weight
    left: dict[int, int] = field(default_factory=dict)  # lane -> expected, not yet admitted
    touched: dict[int, float] = field(default_factory=dict)  # lane -> last admit/completion
    rate: float = 0.0  # bytes per second the link drains (0: not measured yet)
    mark: float = 0.0  # the last completion
    span: float = 0.0  # when the current measuring span began (0: at the next completion)
    span_bytes: int = 0  # bytes completed in it

    def drained(self, nbytes: int, now: float) -> None:
        """`nbytes` completed now. The rate is taken over spans of RATE_SPAN_S: single
        completions come in bursts while the socket's buffer fills."""
        self.mark = now
        if not self.span:
            self.span, self.span_bytes = now, 0
            return
        self.span_bytes += nbytes
        if now - self.span >= RATE_SPAN_S:
            seen = self.span_bytes / (now - self.span)
            self.rate = seen if not self.rate else self.rate + _RATE_GAIN * (seen - self.rate)
            self.span, self.span_bytes = now, 0

    def active(self, hold_s: float, now: float) -> set[int]:
        """Lanes sending to the peer (module docstring)."""
        held = {k for k, v in self.left.items() if v and now - self.touched[k] < hold_s}
        busy = {k for k, v in self.by_lane.items() if v}
        return busy | held | {k for k, v in self.waiting.items() if v}

    def join(self, lane: int, hold_s: float, now: float) -> None:
        """A lane not sending yet starts at the smallest count of those sending (none: all
        counts start over)."""
        active = self.active(hold_s, now)
        if lane in active:
            return
        others = [self.served.get(k, 0.0) for k in active]
        self.served[lane] = max(self.served.get(lane, 0.0), min(others, default=0.0))
        if not others:
            self.served = {lane: 0.0}


class LinkShares:
    """The per-peer send gates of one transfer process, shared by its running refits."""

    def __init__(
        self,
        window: int = SHARE_WINDOW,
        window_s: float = SHARE_WINDOW_S,
        min_window: int = MIN_WINDOW,
        hold_s: float = SHARE_HOLD_S,
    ) -> None:
        self.window = window
        self.hold_s = hold_s
        self.window_s = window_s
        self.min_window = min_window
        self._cv = threading.Condition()
        self._links: dict[int, _Link] = {}

    def acquire(
        self,
        peer: int,
        lane: int,
        weight: float,
        nbytes: int,
        deadline: float,
        abort: threading.Event,
        before_wait: Callable[[], None],
    ) -> bool:
        """Admit `nbytes` of `lane` to `peer`; `before_wait` runs once before blocking (the
        caller posts what it holds back, so a wait never stands on its own unposted bytes).
        Returns whether other lanes had bytes waiting or in flight to `peer`."""
        flushed = False
        with self._cv:
            link = self._links.setdefault(peer, _Link())
            link.join(lane, self.hold_s, time.monotonic())
            link.waiting[lane] = link.waiting.get(lane, 0) + 1
            try:
                while not self._may_post(link, lane, nbytes):
                    if not flushed:
                        flushed = True
                        self._cv.release()
                        try:
                            before_wait()
                        finally:
                            self._cv.acquire()
                        continue
                    if abort.is_set():
                        raise ExecutionError(f"send to rank {peer}: aborted")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExecutionError(
                            f"send to rank {peer}: timed out waiting for its share of the link"
                        )
                    self._cv.wait(min(left, self.hold_s / 2))  # a held turn lapses
            finally:
                link.waiting[lane] -= 1
            now = time.monotonic()
            if not link.inflight and now - link.mark > self.hold_s:
                link.span = 0.0  # busy again after a pause: a new span at its first completion
            if lane in link.left:
                link.left[lane] = max(0, link.left[lane] - nbytes)
                link.touched[lane] = now
            link.inflight += nbytes
            link.by_lane[lane] = link.by_lane.get(lane, 0) + nbytes
            link.served[lane] = link.served.get(lane, 0.0) + nbytes / max(weight, 1e-9)
            self._cv.notify_all()
            return bool(link.active(self.hold_s, now) - {lane})

    def window_of(self, link: _Link) -> float:
        """Bytes that may be posted and not yet sent to the link's peer (module docstring)."""
        if not link.rate:
            return min(START_WINDOW, self.window)
        return min(self.window, max(self.min_window, link.rate * self.window_s))

    def _may_post(self, link: _Link, lane: int, nbytes: int) -> bool:
        if link.inflight and link.inflight + nbytes > self.window_of(link):
            return False
        mine = link.served[lane]
        others = link.active(self.hold_s, time.monotonic()) - {lane}
        return all(mine <= link.served.get(k, 0.0) for k in others)

    def expect(self, lane: int, peer_bytes: dict[int, int]) -> None:
        """`lane` will send `peer_bytes[peer]` bytes to each peer (module docstring)."""
        with self._cv:
            now = time.monotonic()
            for peer, nbytes in peer_bytes.items():
                link = self._links.setdefault(peer, _Link())
                link.join(lane, self.hold_s, now)
                link.left[lane] = nbytes
                link.touched[lane] = now

    def release(self, peer: int, lane: int, nbytes: int) -> None:
        """`nbytes` of `lane` to `peer` were sent."""
        with self._cv:
            link = self._links.get(peer)
            if link is None:
                return
            take = min(nbytes, link.by_lane.get(lane, 0))
            now = time.monotonic()
            link.drained(take, now)
            if lane in link.touched:
                link.touched[lane] = now
            link.inflight -= take
            link.by_lane[lane] = link.by_lane.get(lane, 0) - take
            self._cv.notify_all()

    def leave(self, lane: int) -> None:
        """The lane's refit ended: what it still counts in flight is dropped."""
        with self._cv:
            for link in self._links.values():
                link.inflight -= link.by_lane.pop(lane, 0)
                link.waiting.pop(lane, None)
                link.left.pop(lane, None)
                link.touched.pop(lane, None)
            self._cv.notify_all()

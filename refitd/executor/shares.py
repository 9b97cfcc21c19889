"""Weighted sharing of each link between the refits of several models that run at once.

A transfer process runs one refit per lane (one lane per model refitting at that moment);
their sends to one peer go through one connection, first posted first sent. `LinkShares`
decides the order in which the lanes post their send chunks to each peer: weighted fair
queueing by bytes. Each lane's bytes admitted so far, divided by its weight, is its served
count; while other lanes have bytes waiting or in flight to the same peer, the lane with
the smallest count posts next (a lane whose bytes all went out stops counting). At most `window` bytes are posted and not yet sent per peer, a lane alone included
(a chunk larger than the window goes alone): bytes posted are queued first in, first out
on the connection, so a lane that posted a whole refit ahead would hold a later lane
behind all of it. A lane that starts while others run begins at their smallest count, so
idle time earns no credit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from refitd.executor.errors import ExecutionError
from refitd.plan.lanes import lane_tag

SHARE_WINDOW = 16 << 20  # bytes posted and not yet sent, per peer


@dataclass(frozen=True)
class Share:
    """One refit's place on the links: its lane, its model's weight, the process's gates
    (none: the refit posts as it goes, in lane 0)."""

    shares: LinkShares | None = None
    lane: int = 0
    weight: float = 0.0  # 0: 1

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

    def active(self) -> set[int]:
        return {k for k, v in self.by_lane.items() if v} | {k for k, v in self.waiting.items() if v}


class LinkShares:
    """The per-peer send gates of one transfer process, shared by its running refits."""

    def __init__(self, window: int = SHARE_WINDOW) -> None:
        self.window = window
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
            active = link.active()
            if lane not in active:
                others = [link.served.get(k, 0.0) for k in active]
                link.served[lane] = max(link.served.get(lane, 0.0), min(others, default=0.0))
                if not others:
                    link.served = {lane: 0.0}
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
                    self._cv.wait(min(left, 0.1))
            finally:
                link.waiting[lane] -= 1
            link.inflight += nbytes
            link.by_lane[lane] = link.by_lane.get(lane, 0) + nbytes
            link.served[lane] = link.served.get(lane, 0.0) + nbytes / max(weight, 1e-9)
            self._cv.notify_all()
            return bool(link.active() - {lane})

    def _may_post(self, link: _Link, lane: int, nbytes: int) -> bool:
        if link.inflight and link.inflight + nbytes > self.window:
            return False
        mine = link.served[lane]
        return all(mine <= link.served.get(k, 0.0) for k in link.active() - {lane})

    def release(self, peer: int, lane: int, nbytes: int) -> None:
        """`nbytes` of `lane` to `peer` were sent."""
        with self._cv:
            link = self._links.get(peer)
            if link is None:
                return
            take = min(nbytes, link.by_lane.get(lane, 0))
            link.inflight -= take
            link.by_lane[lane] = link.by_lane.get(lane, 0) - take
            self._cv.notify_all()

    def leave(self, lane: int) -> None:
        """The lane's refit ended: what it still counts in flight is dropped."""
        with self._cv:
            for link in self._links.values():
                link.inflight -= link.by_lane.pop(lane, 0)
                link.waiting.pop(lane, None)
            self._cv.notify_all()

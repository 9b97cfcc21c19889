"""Which receive chunks of a running refit are complete, and the completion of one-sided
receive chunks in the order they land.

`Receipts` keeps a flag per receive chunk (its position in posting order): a relay send
chunk waits for exactly the receives that feed it (feeds.py), the local relay copies for
all. Receives on a collective path complete in posting order (the receiver thread); those
on a one-sided path complete as their doorbells show them (`BellWatch`), so a chunk that
lands late holds back only the relays it feeds, never the chunks posted after it. Chunks
of one message land in order (one doorbell count), so only the oldest pending chunk of
each message is looked at.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from refitd.executor.chunks import Chunk
from refitd.executor.errors import ExecutionError
from refitd.executor.onesided import BellWork
from refitd.transport.base import Work

ONE_SIDED = -2  # the ring of a one-sided chunk (onesided.py): written by the sender


@dataclass
class Posted:
    """An op the poster posted, for the thread that completes it."""

    chunk: Chunk
    work: Work
    buf: torch.Tensor
    ring: int  # staging ring slot (>= 0: staged), -1 for a zero-copy chunk, ONE_SIDED
    at: int  # the piece of the chunk this op carries (Share.pieces): its offset, its bytes
    nbytes: int

    @property
    def last(self) -> bool:
        """The chunk's last piece (or the whole chunk): its completion completes the chunk."""
        return self.at + self.nbytes >= self.chunk.nbytes


class Receipts:
    """Completion flags of one refit's receive chunks, on the execution's condition."""

    def __init__(self, count: int, progress: threading.Condition) -> None:
        self.flags = np.zeros(count, bool)
        self.done = 0
        self._progress = progress

    def completed(self, pos: int) -> None:
        """Receive chunk `pos` is complete (call holding the condition's lock)."""
        if not self.flags[pos]:
            self.flags[pos] = True
            self.done += 1
            self._progress.notify_all()

    def _missing(self, need: np.ndarray | None) -> int:
        if need is None:
            return len(self.flags) - self.done
        return int(need.size - np.count_nonzero(self.flags[need]))

    def ready(self, need: np.ndarray | None) -> bool:
        with self._progress:
            return not self._missing(need)

    def wait(
        self, need: np.ndarray | None, deadline: float, abort: threading.Event, what: str
    ) -> None:
        """Block until the receive chunks at positions `need` (None: all) are complete."""
        self.wait_any([need], deadline, abort, what)

    def wait_any(
        self, needs: list[np.ndarray | None], deadline: float, abort: threading.Event, what: str
    ) -> None:
        """Block until the receive chunks of one of `needs` are complete."""
        with self._progress:
            while missing := min(self._missing(n) for n in needs):
                if abort.is_set():
                    raise ExecutionError(f"{what}: aborted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutionError(
                        f"{what}: timed out waiting for {missing} receive chunks it needs"
                    )
                self._progress.wait(min(left, 0.1))


class HeldRelays:
    """One-sided relay send chunks whose feeds have not all landed, held per message in
    chunk order (a doorbell counts a message's chunks in order), so that the relays of
    other messages, whose feeds landed, go first."""

    def __init__(self, receipts: Receipts, need: dict[int, np.ndarray]) -> None:
        self._receipts, self._need = receipts, need
        self._held: dict[int, deque[Chunk]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, ch: Chunk) -> bool:
        """Whether chunk `ch` waits here: it forwards what has not all landed, or an
        earlier chunk of its message waits."""
        need = self._need.get(id(ch))
        if need is None or (ch.mid not in self._held and self._receipts.ready(need)):
            return False
        self._held.setdefault(ch.mid, deque()).append(ch)
        return True

    def ready(self) -> list[Chunk]:
        """The held chunks whose feeds landed now (taken out), in posting order."""
        out = []
        for mid in list(self._held):
            chunks = self._held[mid]
            while chunks and self._receipts.ready(self._need[id(chunks[0])]):
                out.append(chunks.popleft())
            if not chunks:
                del self._held[mid]
        return sorted(out, key=lambda c: c.key)

    def wait(self, deadline: float, abort: threading.Event, what: str) -> None:
        """Block until some held chunk can go."""
        heads = [self._need[id(c[0])] for c in self._held.values()]
        self._receipts.wait_any(heads, deadline, abort, what)


class BellWatch:
    """Completes the one-sided receive chunks `posted` (each with its BellWork; None ends
    the stream) as their doorbells show them: `complete(item)` after the chunk is in place.
    At the deadline or on abort the oldest pending chunk's wait raises; errors name the
    chunk (`describe`), and what the poster still queues is drained."""

    def __init__(
        self, posted: queue.SimpleQueue[Posted | None], complete: Callable[[Posted], None],
        describe: Callable[[Chunk], str], deadline: float, abort: threading.Event,
    ) -> None:  # fmt: skip
        self.posted, self.complete, self.describe = posted, complete, describe
        self.deadline, self.abort = deadline, abort
        self.pending: dict[int, deque[Posted]] = {}  # message id -> its chunks, in order
        self.closed = False  # the poster's None was taken
        self.waited_s = 0.0

    def run(self) -> None:
        try:
            self._watch()
        finally:
            while not self.closed:  # failed: the poster still puts chunks, then None
                self._take(self.posted.get())

    def _take(self, item: Posted | None) -> None:
        if item is None:
            self.closed = True
        else:
            self.pending.setdefault(item.chunk.mid, deque()).append(item)

    def _watch(self) -> None:
        pause = 20e-6
        while True:
            if not self.pending and not self.closed:  # nothing to look at: wait for more
                tw = time.monotonic()
                self._take(self.posted.get())
                self.waited_s += time.monotonic() - tw
            while not self.closed and not self.posted.empty():
                self._take(self.posted.get())
            if self._landed():
                pause = 20e-6
                continue
            if self.closed and not self.pending:
                return
            if self.abort.is_set() or time.monotonic() >= self.deadline:
                heads = (c[0] for c in self.pending.values())
                oldest = min(heads, key=lambda it: it.chunk.key)
                _named(_bell(oldest).expire, self.describe(oldest.chunk))  # unless landed
                continue
            time.sleep(pause)  # the engines' threads do the copying: leave them the cores
            self.waited_s += pause
            pause = min(pause * 2, 1e-3)

    def _landed(self) -> bool:
        """Complete every pending chunk whose doorbell shows it; whether any was."""
        moved = False
        for mid in list(self.pending):
            chunks = self.pending[mid]
            while chunks and _bell(chunks[0]).landed():
                item = chunks.popleft()
                _named(_bell(item).finish, self.describe(item.chunk))
                self.complete(item)
                moved = True
            if not chunks:
                del self.pending[mid]
        return moved


def _named(step: Callable[[], None], what: str) -> None:
    """Run one chunk's step; a failure names the chunk."""
    try:
        step()
    except Exception as e:
        raise ExecutionError(f"{what}: {e}") from e


def _bell(item: Posted) -> BellWork:
    return cast(BellWork, item.work)  # the poster queues one-sided receives only

"""Seconds and chunk counts per message of one refit, as its threads post and complete them."""

from __future__ import annotations

import threading
import time

from refitd.executor.chunks import Chunk
from refitd.slot_protocol import MessageStat


class MessageStats:
    """Per (direction, message): a message's seconds run from its first chunk posted to its
    last chunk completed so far. Safe to call from the poster and both waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, int], MessageStat] = {}
        self._started: dict[tuple[str, int], float] = {}

    def posted(self, direction: str, ch: Chunk, zero_copy: bool) -> None:
        key = (direction, ch.mid)
        with self._lock:
            s = self._stats.get(key)
            if s is None:
                peer = ch.dst_slot if direction == "send" else ch.src_slot
                s = self._stats[key] = MessageStat(ch.mid, direction, peer, ch.msg_nbytes, 0.0)
                self._started[key] = time.monotonic()
            if zero_copy:
                s.zero_copy_chunks += 1
            else:
                s.staged_chunks += 1

    def finished(self, direction: str, mid: int) -> None:
        """A chunk of the message completed: its seconds run until now."""
        key = (direction, mid)
        with self._lock:
            self._stats[key].seconds = time.monotonic() - self._started[key]

    def sorted(self) -> list[MessageStat]:
        with self._lock:
            return sorted(self._stats.values(), key=lambda s: (s.direction, s.id))

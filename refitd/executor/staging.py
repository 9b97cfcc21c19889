"""The staging pool: bounded buffers that chunks which cannot go zero-copy are packed into
(sends) or received into and unpacked from (receives), reused across refits."""

from __future__ import annotations

import threading
import time

import torch

from refitd.executor.errors import ExecutionError


class StagingRing:
    """Staging buffers of `chunk` bytes, a ring per side: the k-th staged chunk of a side
    uses buffer k mod n, so views into it are cut once. Chunks complete in posting order on
    each side, so waiting for buffer k mod n is waiting for chunk k - n. Buffers are
    allocated on first use and reused across refits; sends and receives get half the cap
    each. `peak_bytes`: what was ever allocated, never more than the cap."""

    def __init__(
        self, cap_bytes: int, chunk: int, device: torch.device, most: int | None = None
    ) -> None:
        """`most`: the most staged chunks either side has (no more buffers are useful)."""
        self.chunk = chunk
        self.device = device
        self.per_side = (cap_bytes // 2) // chunk
        if self.per_side < 1:
            raise ValueError(
                f"staging cap {cap_bytes} bytes is below two wire chunks ({2 * chunk} bytes)"
            )
        if most is not None:
            self.per_side = min(self.per_side, max(most, 1))
        self._bufs: dict[str, list[torch.Tensor | None]] = {
            s: [None] * self.per_side for s in ("send", "recv")
        }
        self._busy: dict[str, list[bool]] = {s: [False] * self.per_side for s in ("send", "recv")}
        self._cv = threading.Condition()
        self.peak_bytes = 0

    def slot_of(self, ordinal: int) -> int:
        return ordinal % self.per_side

    def reset(self) -> None:
        with self._cv:
            for s in self._busy:
                self._busy[s] = [False] * self.per_side

    def acquire(
        self, side: str, slot: int, deadline: float, abort: threading.Event, what: str
    ) -> torch.Tensor:
        with self._cv:
            while self._busy[side][slot]:
                if abort.is_set():
                    raise ExecutionError("aborted while waiting for a staging buffer")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutionError(
                        f"{what}: timed out waiting for a free {side} staging buffer (earlier "
                        "messages still in flight: a peer is slow, stuck or absent)"
                    )
                self._cv.wait(min(left, 0.1))
            self._busy[side][slot] = True
            buf = self._bufs[side][slot]
            if buf is None:
                pin = self.device.type == "cpu" and torch.cuda.is_available()
                buf = torch.empty(self.chunk, dtype=torch.uint8, device=self.device, pin_memory=pin)
                self._bufs[side][slot] = buf
                n = sum(b is not None for s in self._bufs.values() for b in s)
                self.peak_bytes = self.chunk * n
            return buf

    def release(self, side: str, slot: int) -> None:
        with self._cv:
            self._busy[side][slot] = False
            self._cv.notify_all()

"""GcPause: a caller-owned, thread-safe pause of Python's cyclic garbage collector.

Planning a large cluster allocates ~10^5 short-lived tuples and small objects next to
~10^5 live TensorSpecs; every allocation-triggered collection walks the live ones again.
Reference counting frees everything either way, so pausing the cyclic collector for such a
burst is safe, but the collector's switch is process-wide. The planner therefore never
touches it: a caller that plans (the controller, a benchmark) owns one GcPause and wraps
its planning calls in it. Threads entering the same GcPause share one pause: the collector
is switched off by the first to enter and back on only when the last one leaves, and only
if it was on before the first entered (a collector the application switched off stays off).
"""

from __future__ import annotations

import gc
import threading
from types import TracebackType


class GcPause:
    """Reference-counted `with` block that keeps cyclic GC off while anyone is inside.

    One object per owner (e.g. one per controller); re-entrant, and safe to enter from
    several threads at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._resume = False  # whether the collector was on when the first holder entered

    @property
    def holders(self) -> int:
        """How many `with` blocks are inside right now."""
        with self._lock:
            return self._holders

    def __enter__(self) -> GcPause:
        with self._lock:
            if self._holders == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._holders += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._resume:
                gc.enable()

"""Process set-up shared by the long-running commands (`refitd serve`, `refitd agent`)."""

from __future__ import annotations

import logging
import signal
import threading

from refitd.config import Settings


def start_daemon_process(settings: Settings) -> threading.Event:
    """Configure logging at settings.log_level and return an event set on SIGINT/SIGTERM."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop

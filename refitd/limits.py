"""Process limits every refitd process sets at start (workers, agents, transfer processes,
the controller and the CLI)."""

from __future__ import annotations

import contextlib
import resource


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it);
    returns the (soft, hard) limits now in force. Sockets, pipes and the segments' creator
    descriptors all count against it, and 1024 is a common default soft limit."""
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = (1 << 20) if hard == inf else hard  # "unlimited" is capped by fs.nr_open
    if soft != inf and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)

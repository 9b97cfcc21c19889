"""The executor's error, importable without torch (the node agent maps it, never raises it)."""

from __future__ import annotations


class ExecutionError(RuntimeError):
    """A refit of one slot failed: which message, which peer, why."""

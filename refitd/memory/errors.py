"""The error of worker memory that moved or was released, importable without torch (the
node agent relays it)."""

from __future__ import annotations


class StorageMovedError(RuntimeError):
    """A registered tensor's storage moved or was released: it must be registered again."""

"""Interner: one shared object for each distinct registered value.

The ranks of a model register the same local names, canonical names, shapes and boxes over
and over (786,368 tensors of 1,024 kimi-k2 ranks hold about 3,000 distinct names). Decoded
from protobuf, each is a fresh object: 1.1 KB per tensor, 0.9 GB at that scale. Sharing one
object per value keeps a registered tensor at its TensorSpec (~130 bytes).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

V = TypeVar("V", bound=Hashable)

DEFAULT_LIMIT = 1 << 21  # distinct values kept before the table starts over


class Interner:
    """Values by value; owned by the registry (one per controller). The table starts over
    once it holds `limit` values, so a long-lived daemon's memory stays bounded whatever
    it is sent: interning is only ever a saving, never needed for correctness."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._values: dict[Hashable, Hashable] = {}

    def __call__(self, value: V) -> V:
        kept = self._values.get(value)
        if kept is None:
            if len(self._values) >= self._limit:
                self._values.clear()
            self._values[value] = kept = value
        return kept  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._values)

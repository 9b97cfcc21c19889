"""Adapter slots of an inference rank: refits land in a spare slot while the engine serves
another, and COMMIT flips which slot is served (no pause, no copy).

An engine that serves LoRA adapters from stacked buffers (vLLM's `lora_a_stacked` /
`lora_b_stacked`) gives two of its adapter slots to one adapter. The rank registers the
views of the slot it does not serve (the spare); a refit writes only there. On COMMIT of
version v the client calls the engine's `flip(v, slot)` hook: from then on the engine
serves `slot`, and the hook returns once no request reads the previous slot any more.
The client then registers the previous slot as the next spare, and only then acks the
COMMIT; the controller writes an adapter pool only after that registration. A refit that
fails writes only the spare: the served slot and version stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Targets = Callable[[int], Mapping[str, Any]]  # slot -> what register() takes for it
FlipHook = Callable[[int, int], None]  # (version, slot now served)


@dataclass(slots=True)
class AdapterSlots:
    """The two slots one adapter alternates between, and which one is served."""

    targets: Targets
    slots: tuple[int, int] = (0, 1)
    serving: int | None = None  # None until a first version is committed

    def __post_init__(self) -> None:
        if len(self.slots) != 2 or self.slots[0] == self.slots[1]:
            raise ValueError(f"adapter slots {self.slots}: expected two different slots")

    @property
    def spare(self) -> int:
        """The slot refits write: the one not served."""
        a, b = self.slots
        return b if self.serving == a else a

"""Readiness (`/readyz`): the controller is ready to refit, not merely up.

Ready when gRPC serves, the database answers, the rendezvous store runs, the embedded node
agent (when `refitd serve` runs one) has its command stream open, and the members restored
from the data dir that a refit needs but cannot call back are back: each restored slot held
by a connected agent (its agent reconnected, or a newer agent took it) and each restored
inference rank registered again and subscribed; those that do not come back are waited for a lease
(`heartbeat_timeout_s`) from the controller's start. Trainer ranks are not waited for: a
restored one registers again on its next call (Refit answers NOT_FOUND, as a heartbeat
does), and a refit's barrier waits for its ranks. Members that join later are not waited
for either: the controller cannot know of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from refitd.server.registry import Registry
from refitd.server.streams import EventHub

RankKey = tuple[str, str, int]  # (model, pool, rank)


@dataclass(frozen=True)
class LocalAgent:
    """The node agent `refitd serve` runs in its own process: its host and devices."""

    host: str
    devices: tuple[str, ...]


class Readiness:
    """The readiness checks of one controller; the restored members are taken from the
    registry when it is made (right after the restore), and leave the checks once back."""

    def __init__(
        self,
        registry: Registry,
        events: EventHub,
        lease_s: float,
        local_agent: LocalAgent | None,
    ) -> None:
        self.registry = registry
        self.events = events
        self.lease_s = lease_s
        self.local_agent = local_agent
        self.since = time.monotonic()
        with registry.lock:
            self._slots = {
                s for a in registry.agents.values() if not a.incarnation for s in a.slot_ids
            }
            self._ranks: set[RankKey] = {
                (w.model, w.pool, w.rank)
                for w in registry.workers.values()
                if not w.live and w.role == "destination"
            }

    def checks(self) -> dict[str, bool]:
        """The checks of this module (the controller adds gRPC, database and store)."""
        return {"local_agent": not self._local_missing(), "restored": not self._restored()}

    def waiting(self) -> list[str]:
        """What readiness waits for, in words (empty: these checks pass)."""
        out = [f"embedded agent slot {d}" for d in self._local_missing()]
        out += self._restored()
        return out

    def _local_missing(self) -> list[str]:
        """Devices of the embedded agent without a connected agent."""
        la = self.local_agent
        if la is None:
            return []
        return [d for d in la.devices if not self.registry.serves(la.host, d)]

    def _restored(self) -> list[str]:
        """Restored members not back yet, within a lease of the start; once none is left
        (or the lease passed) the check passes for good."""
        if not (self._slots or self._ranks):
            return []
        if time.monotonic() - self.since > self.lease_s:
            self._slots, self._ranks = set(), set()
            return []
        reg = self.registry
        with reg.lock:
            slots = {
                x: sl
                for x, sl, a in reg.slot_agents(sorted(self._slots))
                if not a or not a.connected
            }
            held = {k: w for k in self._ranks if (w := reg.rank_worker(*k)) is not None}
        subscribed = set(self.events.subscribed(w.worker_id for w in held.values()))
        ranks = {k for k, w in held.items() if not w.live or w.worker_id not in subscribed}
        self._slots, self._ranks = set(slots), ranks
        return [
            f"restored slot {x} ({sl.device} of host {sl.host!r})" if sl else f"restored slot {x}"
            for x, sl in sorted(slots.items())
        ] + [
            f"restored inference rank {r} of pool {p!r} of model {m!r}" for m, p, r in sorted(ranks)
        ]

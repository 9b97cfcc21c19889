"""Liveness: leases of workers and agents (renewed by their calls and heartbeats, found
silent by the lease watcher), their Commands streams, and the wait for a sign of life of a
rank's holder. Renewals take only the lease lock, never the registry lock."""

from __future__ import annotations

import time
from collections.abc import Iterable

from refitd.server.errors import not_found
from refitd.server.members import Agent, Worker
from refitd.server.registry.state import RegistryState


class Liveness(RegistryState):
    """Leases and Commands-stream connections of registered members."""

    def touch_worker(self, worker_id: str) -> tuple[Worker, int]:
        """Renew a worker's lease; returns it and its model's epoch. A worker restored from
        the database (not re-registered since a controller restart) gets NOT_FOUND: that
        tells its client to register again (with its worker_id and held version), which
        makes it live. Leases do not take the registry lock (see `_lease_lock`)."""
        w = self.workers.get(worker_id)
        if w is None:
            raise not_found(f"worker_id {worker_id!r} is not registered")
        if not w.live:
            raise not_found(
                f"{w.describe()} was restored after a controller restart; register again"
            )
        with self._renewed:
            w.last_seen = time.monotonic()
            self._renewed.notify_all()
        m = self.models.get(w.model)
        return w, m.epoch if m is not None else 0

    def touch_agent(self, agent_id: str) -> Agent:
        """Renew an agent's lease; NOT_FOUND when it is not registered (no registry lock)."""
        a = self.agents.get(agent_id)
        if a is None:
            raise not_found(f"agent_id {agent_id!r} is not registered")
        with self._lease_lock:
            a.last_seen = time.monotonic()
        return a

    def renew_worker(self, w: Worker) -> None:
        """A call of the worker renews its lease."""
        with self._renewed:
            w.last_seen = time.monotonic()
            self._renewed.notify_all()

    def agent_connected(self, agent: Agent) -> None:
        """Its Commands stream opened (the lease counts from here)."""
        with self.lock, self._lease_lock:
            agent.last_seen = time.monotonic()
            agent.connected = True

    def agent_disconnected(self, agent: Agent) -> None:
        """Its Commands stream closed: the agent, and the registry's current Agent of that
        id (a re-registration on the stream replaces it), no longer hold their slots."""
        with self.lock:
            current = self.agents.get(agent.agent_id, agent)
            agent.connected = current.connected = False

    def renewed(self, w: Worker, seen: float, until: float) -> bool:
        """Wait until `w` renews its lease after `seen` (its last_seen then), or the
        monotonic time `until`: True when it did."""
        with self._renewed:
            return self._renewed.wait_for(
                lambda: w.last_seen > seen, max(0.0, until - time.monotonic())
            )

    def silent(self, cutoff: float) -> tuple[list[Worker], list[Agent]]:
        """Live workers and agents last seen before `cutoff` (monotonic)."""
        with self.lock:
            workers = [w for w in self.workers.values() if w.live and w.last_seen < cutoff]
            agents = [a for a in self.agents.values() if a.last_seen and a.last_seen < cutoff]
            return workers, agents

    def still_silent(self, agent_ids: Iterable[str], cutoff: float) -> list[Agent]:
        """The current agents of these ids still last seen before `cutoff`."""
        with self.lock:
            agents = (self.agents.get(x) for x in agent_ids)
            return [a for a in agents if a is not None and a.last_seen and a.last_seen < cutoff]

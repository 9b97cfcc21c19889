"""What the registry answers: look-ups of one member (NOT_FOUND when absent), and the
snapshots a refit, the status, readiness and the gauges read, each under the registry lock
(a look-up of one member reads its dict without it)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from refitd.server.errors import not_found, precondition
from refitd.server.members import Agent, Model, Slot, Worker
from refitd.server.planning import WorkerKey
from refitd.server.registry.state import RegistryState


class Queries(RegistryState):
    """Read-only look-ups and snapshots of the members."""

    # One entry each, read without the registry lock (a dict read is atomic): the calls on
    # the gRPC server's loop look members up, and must not wait for a registration.
    def model(self, name: str) -> Model:
        m = self.models.get(name)
        if m is None:
            raise not_found(f"model {name!r} is not registered")
        return m

    def agent(self, agent_id: str) -> Agent:
        a = self.agents.get(agent_id)
        if a is None:
            raise not_found(f"agent_id {agent_id!r} is not registered")
        return a

    def worker(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise not_found(f"worker_id {worker_id!r} is not registered")
        return w

    def rank_worker(self, model: str, pool: str, rank: int) -> Worker | None:
        """The worker registered as `rank` of `pool` of `model` (None: none)."""
        with self.lock:
            m = self.models.get(model)
            p = m.pools.get(pool) if m is not None else None
            return self.workers.get(p.ranks.get(rank, "")) if p is not None else None

    def pool_workers(self, model: str, pool: str) -> list[Worker]:
        with self.lock:
            p = self.model(model).pools[pool]
            return [self.workers[w] for _, w in sorted(p.ranks.items()) if w in self.workers]

    def serves(self, host: str, device: str) -> bool:
        """Whether a connected agent holds the slot of `device` on `host`."""
        with self.lock:
            for s in self.slots.values():
                if s.host == host and s.device == device:
                    a = self.agents.get(s.agent_id or "")
                    return a is not None and a.connected
            return False

    def slot_for(self, host: str, device: str) -> Slot:
        with self.lock:
            for s in self.slots.values():
                if s.host == host and s.device == device and s.agent_id in self.agents:
                    return s
        raise precondition(
            f"no node agent serves device {device} on host {host!r}; start `refitd agent` "
            f"there (or `refitd serve` with that device)"
        )

    def has_model(self, name: str) -> bool:
        with self.lock:
            return name in self.models

    def model_names(self) -> list[str]:
        with self.lock:
            return list(self.models)

    def committed_version(self, model: str) -> int:
        """The committed version of `model` (0: none, or not registered)."""
        with self.lock:
            m = self.models.get(model)
            return m.committed_version if m is not None else 0

    def live_destinations(self, model: str) -> tuple[int, list[Worker]]:
        """(committed version, live destination workers) of `model`; (0, []) without one."""
        with self.lock:
            mdl = self.models.get(model)
            if mdl is None or mdl.committed_version <= 0:
                return 0, []
            return mdl.committed_version, [
                self.workers[wid]
                for p in mdl.destination_pools()
                for wid in p.ranks.values()
                if wid in self.workers and self.workers[wid].live
            ]

    def delta_slots(self, device_slots: bool) -> frozenset[int]:
        """Slots whose messages can take the delta path (its payloads are host memory): CPU
        slots, and with `device_slots` (a transport that carries host buffers) CUDA slots,
        which stage through pinned host memory."""
        kinds = ("cpu", "cuda") if device_slots else ("cpu",)
        with self.lock:
            return frozenset(i for i, sl in self.slots.items() if sl.device.split(":")[0] in kinds)

    def identities(self, model: str) -> dict[WorkerKey, str]:
        """(pool, rank) -> identity of its live registration: a new identity means new
        memory handles (the slots holding its tensors need their program again)."""
        with self.lock:
            return {
                (w.pool, w.rank): f"{w.worker_id}@{w.registered_at!r}"
                for w in self.workers.values()
                if w.live and w.model == model
            }

    def memory_index(
        self, model: str, holders: Collection[WorkerKey]
    ) -> dict[WorkerKey, dict[str, bytes]]:
        """(pool, rank) -> tensor name -> memory handle, of the live workers `holders` of
        the model: only the workers of the slots being loaded are looked at (their own
        dicts, which a registration replaces and never changes)."""
        out: dict[WorkerKey, dict[str, bytes]] = {}
        with self.lock:
            m = self.models.get(model)
            for pool, rank in holders:
                p = m.pools.get(pool) if m is not None else None
                w = self.workers.get(p.ranks.get(rank, "")) if p is not None else None
                if w is not None and w.live:
                    out[(pool, rank)] = w.memory
        return out

    def slot_sites(self, slots: Iterable[int]) -> list[tuple[int, str, str, tuple[str, ...]]]:
        """(slot, host, device kind, paths its agent offers) of each known slot: what the
        planner picks each link's path from (an unknown slot is left out: collective)."""
        with self.lock:
            out = []
            for slot in slots:
                s = self.slots.get(slot)
                if s is None:
                    continue
                a = self.agents.get(s.agent_id or "")
                offers = a.links if a is not None else ()
                out.append((slot, s.host, s.device.split(":")[0], offers))
            return out

    def slot_agents(self, slots: Sequence[int]) -> list[tuple[int, Slot | None, Agent | None]]:
        """Each slot with its registration and the agent holding it (None when unknown)."""
        with self.lock:
            out = []
            for slot in slots:
                owner = self.slots.get(slot)
                out.append((slot, owner, self.agents.get(owner.agent_id or "") if owner else None))
            return out

    def pool_complete(self, model: str, pool: str) -> bool:
        """Every rank of the pool registered, and live (a rank restored after a controller
        restart counts once it registered again)."""
        with self.lock:
            p = self.model(model).pools.get(pool)
            return (
                p is not None
                and p.complete
                and all(self.workers[w].live for w in p.ranks.values() if w in self.workers)
            )

    def paused_workers(self, worker_ids: Iterable[str] | None = None) -> list[Worker]:
        """Live workers (all, or of these ids) that re-registered paused by a refit."""
        with self.lock:
            pool = (
                self.workers.values() if worker_ids is None else map(self.workers.get, worker_ids)
            )
            return [w for w in pool if w is not None and w.live and w.paused_in]

    def gauges(self) -> tuple[dict[tuple[str, str], int], int, int]:
        """((model, pool) -> ranks registered, slots, agents connected)."""
        with self.lock:
            pools = {(m.name, p.name): len(p.ranks) for m in self.models.values()
                     for p in m.pools.values()}  # fmt: skip
            return pools, len(self.slots), sum(1 for a in self.agents.values() if a.connected)

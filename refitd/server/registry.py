"""Who is where: models, pools, workers, device slots and agents, with membership epochs.

Every change of membership (a worker or an agent registers or leaves) bumps the epoch of
the models it touches: what a refit needs from the registry (workers, memory handles,
agents) is looked up again. The plan digest is the layout identity, not the epoch: a rank
that registers the same layout again leaves the model's spec tables as they are, so its
plan is reused and only the slots holding its tensors get their program again. The
registry is the controller's in-memory view, written through to StateDB.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence

from refitd._proto import refitd_pb2 as pb
from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable
from refitd.server.database import StateDB
from refitd.server.errors import ControlError, invalid, not_found, precondition
from refitd.server.interning import Interner
from refitd.server.members import Agent, Model, Pool, Slot, Worker
from refitd.server.planning import WorkerKey
from refitd.server.validation import check_device, check_worker_header, specs_from_request


class Registry:
    """Membership of the cluster, persisted through StateDB; thread-safe."""

    def __init__(self, db: StateDB) -> None:
        self.db = db
        self.lock = threading.RLock()
        # Lease renewals (last_seen of workers and agents) take only this lock, never
        # `lock`: a heartbeat must not queue behind a burst of registrations, which hold
        # `lock` through their SQLite writes (1,024 registering ranks starved heartbeats
        # past their lease). Look-ups in the dicts are atomic reads.
        self._lease_lock = threading.Lock()
        self._renewed = threading.Condition(self._lease_lock)  # a worker's lease was renewed
        # Registrations validate one at a time: each is ~50 ms of Python for a rank of
        # ~1,000 tensors, and several at once leave the GIL to the gRPC poller and the
        # heartbeat handlers only between them (heartbeats then waited 20 s in a burst).
        self._validating = threading.Lock()
        self._intern = Interner()  # names, shapes and boxes shared by the registered ranks
        self.models: dict[str, Model] = {}
        self.workers: dict[str, Worker] = {}
        self.agents: dict[str, Agent] = {}
        self.slots: dict[int, Slot] = {}
        self._incarnations = 0
        self._restore()

    def _restore(self) -> None:
        """Rebuild the view from the database; restored entries wait for re-registration."""
        for name, epoch, committed in self.db.models():
            # +1: communicators and plans of the previous controller are gone.
            self.models[name] = Model(name, epoch + 1, committed)
        for slot_id, host, device, agent_id in self.db.slots():
            self.slots[slot_id] = Slot(slot_id, host, device, agent_id)
        for agent_id, host, pid in self.db.agents():
            ids = [s.slot_id for s in self.slots.values() if s.agent_id == agent_id]
            self.agents[agent_id] = Agent(agent_id, host, pid, ids, 0.0, 0.0, 0)
        for worker_id, blob, slot in self.db.workers():
            req = pb.RegisterWorkerRequest.FromString(blob)
            try:
                self._insert_worker(req, worker_id, slot, live=False)
            except Exception:  # a row a newer validation refuses: drop it, it re-registers
                self.db.delete_worker(worker_id)
        for model in self.models.values():
            self.db.save_model(model.name, model.epoch, model.committed_version)

    # --- models
    def model(self, name: str) -> Model:
        with self.lock:
            m = self.models.get(name)
            if m is None:
                raise not_found(f"model {name!r} is not registered")
            return m

    def _bump(self, model: Model) -> None:
        model.epoch += 1
        self.db.save_model(model.name, model.epoch, model.committed_version)

    # --- agents
    def register_agent(
        self,
        host: str,
        devices: list[str],
        pid: int,
        agent_id: str = "",
        batch_execute: bool = False,
        data_plane_address: str = "",
        links: tuple[str, ...] = (),
    ) -> Agent:
        """Register (or re-register) a node agent; returns it with its global slot ids."""
        if not host:
            raise invalid("field host of RegisterAgent is empty")
        if not devices:
            raise invalid(f"agent on host {host!r} registers no slots")
        for i, d in enumerate(devices):
            check_device(d, f"slots[{i}] of agent on host {host!r}")
        if len(set(devices)) != len(devices):
            raise invalid(f"agent on host {host!r} lists a device twice: {devices}")
        with self.lock:
            if agent_id and agent_id not in self.agents:
                agent_id = ""  # unknown id (e.g. its state was wiped): treat as new
            agent_id = agent_id or uuid.uuid4().hex[:12]
            for d in devices:
                owner = next(
                    (
                        a
                        for a in self.agents.values()
                        if a.agent_id != agent_id
                        and a.connected
                        and any(
                            self.slots[s].host == host and self.slots[s].device == d
                            for s in a.slot_ids
                        )
                    ),
                    None,
                )
                if owner is not None:
                    raise precondition(
                        f"device {d} of host {host!r} is served by connected agent {owner.agent_id}"
                    )
            ids = []
            for d in devices:
                sid = self.db.slot_id(host, d, agent_id)
                self.slots[sid] = Slot(sid, host, d, agent_id)
                ids.append(sid)
            for a in self.agents.values():  # a slot moves to its newest agent
                if a.agent_id != agent_id:
                    a.slot_ids = [s for s in a.slot_ids if s not in ids]
            self._incarnations += 1
            now = time.monotonic()
            old = self.agents.get(agent_id)
            agent = Agent(agent_id, host, pid, ids, time.time(), now, self._incarnations)
            if old is not None:  # re-registration on an open stream (a slot restarted)
                agent.connected = old.connected
            agent.batch_execute = batch_execute
            agent.data_plane_address = data_plane_address
            agent.links = tuple(sorted(set(links)))
            self.agents[agent_id] = agent
            self.db.save_agent(agent_id, host, pid)
            for m in self.models.values():
                self._bump(m)
            return agent

    def agent(self, agent_id: str) -> Agent:
        with self.lock:
            a = self.agents.get(agent_id)
            if a is None:
                raise not_found(f"agent_id {agent_id!r} is not registered")
            return a

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

    # --- workers
    def register_worker(
        self, req: pb.RegisterWorkerRequest, judge: Callable[[Worker], str] | None = None
    ) -> Worker:
        """Validate and register a worker. Re-registering (model, pool, rank) replaces its
        holder when that is the same worker (its worker_id) or a restored one; a live
        holder of another identity is passed to `judge` (outside the locks, once the
        registration is otherwise valid), which returns its id when it is gone (replaced)
        or raises when it is alive. Without `judge` such a holder is refused."""
        check_worker_header(req)
        slot = self.slot_for(req.host, req.device)
        with self._validating:  # the costly part, outside the lock, one at a time
            specs = specs_from_request(req, slot.slot_id, self._intern)
            table = SpecTable.of_worker(specs)
        with self.lock:
            holder = self._other_live_holder(req)
            if holder is not None:  # refused for its own faults before any wait
                self._check_pools(req, specs)
        replacing = judge(holder) if holder is not None and judge is not None else ""
        with self.lock:
            return self._insert_worker(
                req, "", slot.slot_id, live=True, specs=specs, table=table, replacing=replacing
            )

    def _insert_worker(
        self,
        req: pb.RegisterWorkerRequest,
        worker_id: str,
        slot: int,
        live: bool,
        specs: list[TensorSpec] | None = None,
        table: SpecTable | None = None,
        replacing: str = "",
    ) -> Worker:
        """Check a registration against its model and pool, then add (or replace) the
        worker, its pool entry and its specs (lock held); `table`: the specs' SpecTable
        when the caller made it; `replacing`: a live holder of the rank found gone."""
        role = check_worker_header(req)
        if specs is None:
            specs = specs_from_request(req, slot, self._intern)
        model, pool = self._check_pools(req, specs)
        holder = self._other_live_holder(req) if live else None
        if holder is not None and holder.worker_id != replacing:
            raise rank_taken(holder, req, "it is live")
        if pool is None:
            pool = Pool(req.pool, role, req.pool_size)
            model.pools[req.pool] = pool
        pool.size = req.pool_size
        pool.staged = req.staged
        pool.snapshot = req.snapshot
        old_id, old = self._replaced_rank(pool, req)
        worker = self._new_worker(req, worker_id, slot, live, role, specs, model)
        worker.table = table
        self.models[req.model] = model
        pool.ranks[req.rank] = worker.worker_id
        self.workers[worker.worker_id] = worker
        if old_id is None:
            model.tables.add(role, worker.spec_table())
            if pool.shapes is not None:
                for t in worker.specs:
                    pool.shapes.setdefault(t.canonical, (t.global_shape, req.rank))
        elif old is None or old.specs != worker.specs:
            model.tables.invalidate()
            pool.shapes = None
        # else: the rank registered the same layout again (a restart: only its memory
        # handles changed), so the tables, and with them the plan digest, stay as they are
        if live:
            self.db.save_worker(
                worker.worker_id, req.model, req.pool, req.rank, req.SerializeToString(), slot
            )
            self._bump(model)
        return worker

    @staticmethod
    def _check_pool_role(
        model: Model, pool: Pool | None, req: pb.RegisterWorkerRequest, role: str
    ) -> None:
        """A rank agrees with its pool's role and size; a model has one source pool."""
        if pool is not None and pool.role != role:
            raise precondition(
                f"rank {req.rank} of pool {req.pool!r} registers as {role}, but the pool is "
                f"a {pool.role} pool"
            )
        if (
            pool is not None
            and pool.size != req.pool_size
            and len(pool.ranks) > (1 if req.rank in pool.ranks else 0)
        ):
            raise precondition(
                f"rank {req.rank} of pool {req.pool!r} says pool_size={req.pool_size}, the "
                f"registered ranks say {pool.size}"
            )
        if role == "source":
            src = model.source_pool()
            if src is not None and src.name != req.pool:
                raise precondition(
                    f"model {req.model!r} already has source pool {src.name!r}; pool "
                    f"{req.pool!r} cannot be a second source"
                )

    def _check_pools(
        self, req: pb.RegisterWorkerRequest, specs: list[TensorSpec]
    ) -> tuple[Model, Pool | None]:
        """A registration checked against its model and pool (lock held): its model (new
        or registered) and pool (None: new)."""
        role = check_worker_header(req)
        model = self.models.get(req.model) or Model(req.model)
        pool = model.pools.get(req.pool)
        self._check_pool_role(model, pool, req, role)
        self._check_staged(pool, req, role)
        self._check_against_pool(model, req, specs)
        return model, pool

    def _other_live_holder(self, req: pb.RegisterWorkerRequest) -> Worker | None:
        """The live worker of another identity holding the rank `req` registers (lock
        held): a rank is registered by one process at a time."""
        holder = self.rank_worker(req.model, req.pool, req.rank)
        if holder is None or not holder.live or holder.worker_id == req.worker_id:
            return None
        return holder

    def _replaced_rank(
        self, pool: Pool, req: pb.RegisterWorkerRequest
    ) -> tuple[str | None, Worker | None]:
        """(worker id, worker) that held the rank before (removed here), if any."""
        old_id = pool.ranks.get(req.rank)
        if req.worker_id and req.worker_id != old_id and req.worker_id in self.workers:
            raise precondition(
                f"worker_id {req.worker_id} belongs to another rank; it cannot register as "
                f"rank {req.rank} of pool {req.pool!r}"
            )
        if old_id is None:
            return None, None
        old = self.workers.pop(old_id, None)
        self.db.delete_worker(old_id)
        return old_id, old

    @staticmethod
    def _new_worker(
        req: pb.RegisterWorkerRequest, worker_id: str, slot: int, live: bool, role: str,
        specs: list[TensorSpec], model: Model,
    ) -> Worker:  # fmt: skip
        """The Worker of a registration; a held version counts only when it is the
        committed one, a paused refit only for a live destination."""
        dest = role == "destination"
        return Worker(
            worker_id=worker_id or req.worker_id or uuid.uuid4().hex[:12],
            model=req.model,
            pool=req.pool,
            role=role,
            rank=req.rank,
            pool_size=req.pool_size,
            host=req.host,
            device=req.device,
            pid=req.pid,
            slot=slot,
            specs=tuple(specs),
            memory={s.name: t.memory for s, t in zip(specs, req.tensors, strict=True)},
            registered_at=time.time(),
            last_seen=time.monotonic(),
            live=live,
            holds=req.held_version
            if 0 < req.held_version == model.committed_version and dest
            else 0,
            paused_in=req.paused_refit_id if live and dest else 0,
        )

    def _check_staged(self, pool: Pool | None, req: pb.RegisterWorkerRequest, role: str) -> None:
        """Staged mode is a destination pool's choice, snapshot a source pool's; the same for
        all ranks of the pool."""
        if req.staged and role != "destination":
            raise invalid(
                f"rank {req.rank} of pool {req.pool!r} sets staged, but only destination "
                "(inference) pools can be staged"
            )
        if req.snapshot and role != "source":
            raise invalid(
                f"rank {req.rank} of pool {req.pool!r} sets snapshot, but only source "
                "(trainer) pools can be snapshotted"
            )
        if pool is None:
            return
        others = sorted(r for r in pool.ranks if r != req.rank)
        if others and pool.snapshot != req.snapshot:
            raise precondition(
                f"rank {req.rank} of pool {req.pool!r} registers snapshot={req.snapshot}, but "
                f"ranks {others} of the pool registered snapshot={pool.snapshot}: all ranks of "
                "a pool must agree on snapshot"
            )
        if others and pool.staged != req.staged:
            mode = {True: "staged", False: "in-place"}
            raise precondition(
                f"rank {req.rank} of pool {req.pool!r} registers {mode[req.staged]}, but "
                f"ranks {others} of the pool registered {mode[pool.staged]}: all ranks of a "
                "pool must agree on staged"
            )

    def _check_against_pool(
        self, model: Model, req: pb.RegisterWorkerRequest, specs: list[TensorSpec]
    ) -> None:
        """A canonical tensor has one global shape within a pool."""
        pool = model.pools.get(req.pool)
        if pool is None:
            return
        if req.rank in pool.ranks:  # a replaced rank: its own shapes don't count
            known = self._pool_shapes(pool, skip=req.rank)
        else:
            if pool.shapes is None:
                pool.shapes = self._pool_shapes(pool)
            known = pool.shapes
        for s in specs:
            if s.canonical in known and known[s.canonical][0] != s.global_shape:
                shape, rank = known[s.canonical]
                raise invalid(
                    f"tensor {s.name!r} of rank {req.rank} in pool {req.pool!r}: global_shape "
                    f"{list(s.global_shape)} disagrees with {list(shape)} registered by rank "
                    f"{rank} for {s.canonical!r}"
                )

    def _pool_shapes(
        self, pool: Pool, skip: int | None = None
    ) -> dict[str, tuple[tuple[int, ...], int]]:
        known: dict[str, tuple[tuple[int, ...], int]] = {}
        for rank, wid in pool.ranks.items():
            if rank == skip or wid not in self.workers:
                continue
            for s in self.workers[wid].specs:
                known.setdefault(s.canonical, (s.global_shape, rank))
        return known

    def rank_worker(self, model: str, pool: str, rank: int) -> Worker | None:
        """The worker registered as `rank` of `pool` of `model` (None: none)."""
        with self.lock:
            m = self.models.get(model)
            p = m.pools.get(pool) if m is not None else None
            return self.workers.get(p.ranks.get(rank, "")) if p is not None else None

    def renewed(self, w: Worker, seen: float, until: float) -> bool:
        """Wait until `w` renews its lease after `seen` (its last_seen then), or the
        monotonic time `until`: True when it did."""
        with self._renewed:
            return self._renewed.wait_for(
                lambda: w.last_seen > seen, max(0.0, until - time.monotonic())
            )

    def worker(self, worker_id: str) -> Worker:
        with self.lock:
            w = self.workers.get(worker_id)
            if w is None:
                raise not_found(f"worker_id {worker_id!r} is not registered")
            return w

    def unregister_worker(self, worker_id: str) -> Worker:
        with self.lock:
            w = self.worker(worker_id)
            del self.workers[worker_id]
            model = self.models[w.model]
            pool = model.pools[w.pool]
            pool.ranks.pop(w.rank, None)
            pool.shapes = None
            if not pool.ranks:
                del model.pools[w.pool]
            model.tables.invalidate()
            self.db.delete_worker(worker_id)
            self._bump(model)
            return w

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

    def pool_workers(self, model: str, pool: str) -> list[Worker]:
        with self.lock:
            p = self.model(model).pools[pool]
            return [self.workers[w] for _, w in sorted(p.ranks.items()) if w in self.workers]

    def set_committed(self, model: str, version: int) -> None:
        with self.lock:
            self.models[model].committed_version = version

    # --- leases and connections (every change of a worker or agent field goes through here)
    def renew_worker(self, w: Worker) -> None:
        """A call of the worker renews its lease."""
        with self._renewed:
            w.last_seen = time.monotonic()
            self._renewed.notify_all()

    def touch_agent(self, agent_id: str) -> Agent:
        """Renew an agent's lease; NOT_FOUND when it is not registered (no registry lock)."""
        a = self.agents.get(agent_id)
        if a is None:
            raise not_found(f"agent_id {agent_id!r} is not registered")
        with self._lease_lock:
            a.last_seen = time.monotonic()
        return a

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

    # --- versions held and paused refits
    def set_holds(self, workers: Iterable[Worker], version: int) -> None:
        """The registered memory of `workers` holds `version` (0: nothing trusted)."""
        with self.lock:
            for w in workers:
                w.holds = version

    def told_outcome(self, w: Worker, refit_id: int, holds: int | None = None) -> bool:
        """`w` was told how refit `refit_id` (0: whichever paused it) ended; True when that
        was the refit its registration was paused in (then cleared). `holds`: the version
        its memory holds now."""
        with self.lock:
            if holds is not None:
                w.holds = holds
            if w.paused_in and refit_id in (0, w.paused_in):
                w.paused_in = 0
                return True
            return False

    def paused_workers(self, worker_ids: Iterable[str] | None = None) -> list[Worker]:
        """Live workers (all, or of these ids) that re-registered paused by a refit."""
        with self.lock:
            pool = (
                self.workers.values() if worker_ids is None else map(self.workers.get, worker_ids)
            )
            return [w for w in pool if w is not None and w.live and w.paused_in]

    # --- what a refit reads
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

    def host_slots(self) -> frozenset[int]:
        """Slots on CPU devices (host memory)."""
        with self.lock:
            return frozenset(i for i, sl in self.slots.items() if sl.device.startswith("cpu"))

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

    def gauges(self) -> tuple[dict[tuple[str, str], int], int, int]:
        """((model, pool) -> ranks registered, slots, agents connected)."""
        with self.lock:
            pools = {(m.name, p.name): len(p.ranks) for m in self.models.values()
                     for p in m.pools.values()}  # fmt: skip
            return pools, len(self.slots), sum(1 for a in self.agents.values() if a.connected)


def rank_taken(holder: Worker, req: pb.RegisterWorkerRequest, why: str) -> ControlError:
    """The refusal of a second process registering a rank that a live worker holds."""
    return precondition(
        f"rank {req.rank} of pool {req.pool!r} of model {req.model!r} is held by live "
        f"{holder.describe()}, pid {holder.pid} on host {holder.host!r} ({why}); a rank "
        "is registered by one process at a time: stop that process (or close its client) "
        "first, or register this one as another rank"
    )

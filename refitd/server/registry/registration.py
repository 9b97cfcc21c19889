"""Registration: workers and agents registered, replaced and unregistered (each a change of
membership that bumps the epochs of the models it touches), the restore from StateDB, and the
versions members hold. Every change is written through to StateDB under the registry lock."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable

from refitd._proto import refitd_pb2 as pb
from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable
from refitd.rpc.process import HOLDER_METADATA
from refitd.server.errors import ControlError, invalid, precondition
from refitd.server.members import Agent, Model, Pool, ProcessId, Slot, Worker
from refitd.server.registry.pool_checks import (
    check_against_pool,
    check_pool_role,
    check_staged,
)
from refitd.server.registry.queries import Queries
from refitd.server.validation import check_device, check_worker_header, specs_from_request


class Registrar(Queries):
    """Registering, replacing and unregistering members; what they hold."""

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

    def _bump(self, model: Model) -> None:
        model.epoch += 1
        self.db.save_model(model.name, model.epoch, model.committed_version)

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

    def register_worker(
        self,
        req: pb.RegisterWorkerRequest,
        judge: Callable[[Worker], str] | None = None,
        named: Callable[[Worker], object] | None = None,
    ) -> Worker:
        """Validate and register a worker. Re-registering (model, pool, rank) replaces its
        holder when that is the same worker (its worker_id) or a restored one; a live
        holder of another identity is passed to `judge` (outside the locks, once the
        registration is otherwise valid), which returns its id when it is gone (replaced)
        or raises when it is alive. Without `judge` such a holder is refused. `named`
        sees such a holder first, before the costly validation of the tensors, and raises
        when the registrant must look the holder up and name it (it registers again)."""
        check_worker_header(req)
        slot = self.slot_for(req.host, req.device)
        if named is not None:
            with self.lock:
                first = self._other_live_holder(req)
            if first is not None:
                named(first)
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
        pool.adapter = req.adapter
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
        self._registered.notify_all()
        return worker

    def _check_pools(
        self, req: pb.RegisterWorkerRequest, specs: list[TensorSpec]
    ) -> tuple[Model, Pool | None]:
        """A registration checked against its model and pool (lock held): its model (new
        or registered) and pool (None: new)."""
        role = check_worker_header(req)
        model = self.models.get(req.model) or Model(req.model)
        pool = model.pools.get(req.pool)
        check_pool_role(model, pool, req, role)
        check_staged(pool, req, role)
        check_against_pool(model, req, specs, self.workers)
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
            process=process_id(req.process) if req.HasField("process") else None,
        )

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
            model.tables.remove((w.pool, w.rank), w.specs)
            self.db.delete_worker(worker_id)
            self._bump(model)
            return w

    def set_committed(self, model: str, version: int) -> None:
        with self.lock:
            self.models[model].committed_version = version

    def set_holds(self, workers: Iterable[Worker], version: int) -> None:
        """The registered memory of `workers` holds `version` (0: nothing trusted)."""
        with self.lock:
            for w in workers:
                w.holds = version

    def mark_flips(self, workers: Iterable[Worker]) -> None:
        """COMMIT goes to `workers`: those of adapter pools flip to the slot just written and
        register their old slot as the next spare; until then no refit may write them."""
        with self.lock:
            for w in workers:
                pool = self.models[w.model].pools.get(w.pool) if w.model in self.models else None
                now = self.workers.get(w.worker_id)
                if pool is not None and pool.adapter and now is not None:
                    now.flip_pending = True

    def await_flips(self, model: str, timeout_s: float) -> list[Worker]:
        """Wait until no adapter-pool worker of `model` is flipping (each registered its
        spare slot again, or left), `timeout_s` at most; the workers still flipping."""
        deadline = time.monotonic() + timeout_s
        with self._registered:
            while True:
                pending = [w for w in self.workers.values() if w.model == model and w.flip_pending]
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    return pending
                self._registered.wait(min(left, 0.05))  # removals do not notify: look again

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


def process_id(p: pb.ProcessIdentity) -> ProcessId:
    return ProcessId(p.boot_id, p.pid_namespace, p.pid, p.start_ticks)


def rank_taken(
    holder: Worker, req: pb.RegisterWorkerRequest, why: str, named: bool = False
) -> ControlError:
    """The refusal of a second process registering a rank that a live worker holds;
    `named`: with the holder's process identity for the registrant to look up
    (trailing metadata, refitd.rpc.process)."""
    trailers = ()
    if named and holder.process is not None:
        p = holder.process
        ident = pb.ProcessIdentity(
            boot_id=p.boot_id, pid_namespace=p.pid_namespace, pid=p.pid, start_ticks=p.start_ticks
        )
        trailers = ((HOLDER_METADATA, ident.SerializeToString()),)
    return precondition(
        f"rank {req.rank} of pool {req.pool!r} of model {req.model!r} is held by live "
        f"{holder.describe()}, pid {holder.pid} on host {holder.host!r} ({why}); a rank "
        "is registered by one process at a time: stop that process (or close its client) "
        "first, or register this one as another rank",
        trailers,
    )

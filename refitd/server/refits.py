"""The refit state machine: one refit per model at a time, coalescing to the newest version.

requested -> sources ready -> transferring -> landed -> committed, or failed with a reason
(superseded for versions coalesced into a newer one). A refit starts when every rank of the
source pool has asked for its version (a barrier with a timeout). While one runs for a
model, newer requests wait; when it ends only the newest fully-requested version runs and
every older pending version returns SUPERSEDED. Each model has one driver thread; RPC
threads only record requests and wait on the run they joined. Every phase has a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.database import RefitRecord, StateDB
from refitd.server.errors import ControlError, ErrorKind, precondition
from refitd.server.metrics import ControllerMetrics
from refitd.server.planning import ControllerPlan, PlanCache, PlanOptions, make_digest, make_plan
from refitd.server.registry import Registry, Worker
from refitd.server.streams import AgentHub, EventHub, Gather, GatherBoard, PhaseFailed

log = logging.getLogger("refitd.controller")

STATE_NAMES = {
    pb.REFIT_STATE_REQUESTED: "requested",
    pb.REFIT_STATE_SOURCES_READY: "sources_ready",
    pb.REFIT_STATE_TRANSFERRING: "transferring",
    pb.REFIT_STATE_LANDED: "landed",
    pb.REFIT_STATE_COMMITTED: "committed",
    pb.REFIT_STATE_FAILED: "failed",
    pb.REFIT_STATE_SUPERSEDED: "superseded",
}
FINAL = (pb.REFIT_STATE_COMMITTED, pb.REFIT_STATE_FAILED, pb.REFIT_STATE_SUPERSEDED)


@dataclass
class RefitRun:
    """One requested version of one model, from its first Refit call to its end."""

    refit_id: int
    model: str
    version: int
    source_pool: str
    pool_size: int
    first_ask: float
    asked: set[int] = field(default_factory=set)
    state: int = pb.REFIT_STATE_REQUESTED
    reason: str = ""
    readers: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> slots
    released: set[int] = field(default_factory=set)
    source_waiters: int = 0  # Refit calls waiting for their sources to be read
    started: float = 0.0
    seconds: float = 0.0
    bytes: int = 0
    slot_stats: dict[int, tuple[int, float]] = field(default_factory=dict)
    detail: dict[str, float | str | int] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def sources_read(self, rank: int) -> bool:
        if self.final:
            return True
        if self.state < pb.REFIT_STATE_TRANSFERRING:
            return False
        return self.readers.get(rank, frozenset()) <= self.released


@dataclass
class ModelRefits:
    """Requests and the running refit of one model; `cond` guards both."""

    name: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, RefitRun] = field(default_factory=dict)
    running: RefitRun | None = None
    driver: threading.Thread | None = None


@dataclass
class SlotState:
    """What a slot's transfer process holds: its agent incarnation, comm epoch, programs."""

    incarnation: int
    comm_epoch: int = 0
    loaded: set[str] = field(default_factory=set)


class RefitCoordinator:
    """Drives refits over the registry, the agents' command streams and the workers' events."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        db: StateDB,
        metrics: ControllerMetrics,
        store_address: tuple[str, int] | None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.db = db
        self.metrics = metrics
        self.store_address = store_address
        self.board = GatherBoard()
        self.events = EventHub(self.board)
        self.agents = AgentHub(self.board)
        self.plans = PlanCache(settings.plan_cache_size)
        self.plan_options = PlanOptions(settings.bucket_bytes, settings.sender_quantization)
        self._models: dict[str, ModelRefits] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._digests: dict[tuple[str, int], str] = {}
        self._slots: dict[int, SlotState] = {}
        self._comm_key: tuple | None = None
        self._comm_epoch = 0
        self.history: list[RefitRecord] = list(reversed(db.refits(settings.history_size)))

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            models = list(self._models.values())
        for m in models:
            with m.cond:
                m.cond.notify_all()
        for m in models:
            if m.driver is not None:
                m.driver.join(timeout=5)

    def _model(self, name: str) -> ModelRefits:
        with self._lock:
            m = self._models.get(name)
            if m is None:
                m = self._models[name] = ModelRefits(name)
                m.driver = threading.Thread(
                    target=self._drive, args=(m,), name=f"refit-{name}", daemon=True
                )
                m.driver.start()
            return m

    def running(self, model: str) -> RefitRun | None:
        with self._lock:
            m = self._models.get(model)
        return m.running if m else None

    # ------------------------------------------------------------------ Refit RPC
    def request(
        self, worker_id: str, version: int, wait: int, timeout_s: float
    ) -> pb.RefitResponse:
        """A trainer rank asks for `version`; waits as asked (sources read by default)."""
        w = self.registry.worker(worker_id)
        if w.role != "source":
            raise precondition(
                f"{w.describe()} is a destination; only source (trainer) ranks call Refit"
            )
        if not w.live:
            raise precondition(f"{w.describe()} was restored after a restart; re-register it")
        if version <= 0:
            raise ControlError(ErrorKind.INVALID, f"field version must be > 0, got {version}")
        committed = self.registry.model(w.model).committed_version
        m = self._model(w.model)
        with m.cond:
            run = m.running if m.running and m.running.version == version else None
            if version <= committed:
                raise precondition(
                    f"version {version} of model {w.model!r} is not newer than the committed "
                    f"version {committed}"
                )
            if run is None and m.running is not None and version < m.running.version:
                raise precondition(
                    f"version {version} of model {w.model!r} is older than the running "
                    f"version {m.running.version}"
                )
            if run is None:
                run = m.pending.get(version)
                if run is None:
                    refit_id = self.db.start_refit(w.model, version, "requested")
                    run = RefitRun(
                        refit_id, w.model, version, w.pool, w.pool_size, time.monotonic()
                    )
                    m.pending[version] = run
            run.asked.add(w.rank)
            m.cond.notify_all()
            if wait == pb.WAIT_ACCEPTED:
                return self._response(run)
            deadline = time.monotonic() + (timeout_s or self.settings.refit_wait_timeout_s)
            if wait == pb.WAIT_COMMITTED:
                done = lambda: run.final  # noqa: E731
            else:
                done = lambda: run.sources_read(w.rank)  # noqa: E731
            sources_wait = wait != pb.WAIT_COMMITTED
            run.source_waiters += sources_wait
            try:
                self._wait(m, run, done, deadline, timeout_s)
            finally:
                run.source_waiters -= sources_wait
            return self._response(run)

    def _wait(
        self,
        m: ModelRefits,
        run: RefitRun,
        done: Callable[[], bool],
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Under m.cond: wait until done() or raise DEADLINE at the deadline."""
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                waited = timeout_s or self.settings.refit_wait_timeout_s
                raise ControlError(
                    ErrorKind.DEADLINE,
                    f"version {run.version} of model {run.model!r}: still "
                    f"{STATE_NAMES[run.state]} after {waited:g}s; the refit goes on",
                )
            m.cond.wait(min(left, 1.0))

    def _response(self, run: RefitRun) -> pb.RefitResponse:
        return pb.RefitResponse(
            version=run.version,
            state=run.state,
            message=run.reason,
            seconds=run.seconds,
            bytes=run.bytes,
        )

    # ------------------------------------------------------------------ driver
    def _drive(self, m: ModelRefits) -> None:
        while not self._stop.is_set():
            with m.cond:
                run = self._next_run(m)
                if run is None:
                    continue
                m.running = run
            try:
                self._execute(run, m)
            except Exception as e:  # a bug must fail the refit, never kill the driver
                log.exception("refit %s of %s crashed", run.version, run.model)
                self._finish(m, run, pb.REFIT_STATE_FAILED, f"internal error: {e!r}")
            with m.cond:
                m.running = None
                m.cond.notify_all()

    def _next_run(self, m: ModelRefits) -> RefitRun | None:
        """Under m.cond: the version to run now, after timing out and superseding; or wait."""
        now = time.monotonic()
        for run in list(m.pending.values()):
            missing = sorted(set(range(run.pool_size)) - run.asked)
            if missing and now - run.first_ask > self.settings.barrier_timeout_s:
                del m.pending[run.version]
                self._end(
                    m,
                    run,
                    pb.REFIT_STATE_FAILED,
                    f"ranks {missing} of pool {run.source_pool} never asked for version "
                    f"{run.version} (barrier timeout {self.settings.barrier_timeout_s:g}s)",
                )
        ready = [r for r in m.pending.values() if len(r.asked) >= r.pool_size]
        if not ready or m.running is not None:
            deadlines = [r.first_ask + self.settings.barrier_timeout_s for r in m.pending.values()]
            m.cond.wait(max(0.0, min([now + 1.0, *deadlines]) - now) + 1e-3)
            return None
        run = max(ready, key=lambda r: r.version)
        for older in [r for r in m.pending.values() if r.version < run.version]:
            del m.pending[older.version]
            self._end(
                m,
                older,
                pb.REFIT_STATE_SUPERSEDED,
                f"coalesced into version {run.version} (a newer version was requested "
                "while a refit ran)",
            )
        del m.pending[run.version]
        return run

    def _set_state(self, m: ModelRefits, run: RefitRun, state: int) -> None:
        with m.cond:
            run.state = state
            m.cond.notify_all()

    def _execute(self, run: RefitRun, m: ModelRefits) -> None:
        run.started = time.monotonic()
        s = self.settings
        self.metrics.refits_started.labels(run.model).inc()
        paused: list[str] = []
        executed = False
        plan: ControllerPlan | None = None
        try:
            plan, dest_workers = self._prepare(run)
            run.readers = {
                rank: plan.readers.get((run.source_pool, rank), frozenset())
                for rank in range(run.pool_size)
            }
            self._set_state(m, run, pb.REFIT_STATE_SOURCES_READY)
            self._connect(plan)
            self._load(plan, run.model)
            self._broadcast(
                dest_workers, pb.EVENT_KIND_PAUSE, run, s.pause_timeout_s, "pause", paused
            )
            self._set_state(m, run, pb.REFIT_STATE_TRANSFERRING)
            executed = True
            last_done = self._transfer(plan, run, m)
            self._set_state(m, run, pb.REFIT_STATE_LANDED)
            self._broadcast(
                dest_workers, pb.EVENT_KIND_COMMIT, run, s.commit_timeout_s, "commit", []
            )
            run.seconds = time.monotonic() - run.started
            epoch = self.registry.model(run.model).epoch
            self.db.commit_version(
                run.model, run.version, run.refit_id, run.bytes, run.seconds, epoch
            )
            self.registry.set_committed(run.model, run.version)
            run.detail["control_end_s"] = time.monotonic() - last_done
            self._finish(m, run, pb.REFIT_STATE_COMMITTED, "")
        except (PhaseFailed, ControlError) as e:
            reason = e.message if isinstance(e, ControlError) else str(e)
            if plan is not None:
                self._abort(plan, run, reason)
            kind = pb.EVENT_KIND_INCOMPLETE if executed else pb.EVENT_KIND_ABORT
            for wid in paused:
                self.events.send(wid, self._event(run, kind, reason), None)
            self._finish(m, run, pb.REFIT_STATE_FAILED, reason)

    def _prepare(self, run: RefitRun) -> tuple[ControllerPlan, list[Worker]]:
        """Preconditions, then the plan (cached by digest) and the destination workers."""
        reg = self.registry
        with reg.lock:
            model = reg.model(run.model)
            src = model.pools.get(run.source_pool)
            if src is None or not src.complete:
                have = sorted(src.ranks) if src else []
                raise precondition(
                    f"source pool {run.source_pool!r} of model {run.model!r} has ranks {have} "
                    f"of {run.pool_size} registered"
                )
            dests = model.destination_pools()
            if not dests:
                raise precondition(f"model {run.model!r} has no destination pool registered")
            for p in [src, *dests]:
                if not p.complete:
                    missing = sorted(set(range(p.size)) - set(p.ranks))
                    raise precondition(
                        f"destination pool {p.name!r} of model {run.model!r} misses ranks "
                        f"{missing} of {p.size}"
                    )
                stale = [r for r, w in p.ranks.items() if not reg.workers[w].live]
                if stale:
                    raise precondition(
                        f"ranks {sorted(stale)} of pool {p.name!r} have not re-registered "
                        f"since the controller restarted"
                    )
            src_workers = [reg.workers[w] for _, w in sorted(src.ranks.items())]
            dest_workers = [reg.workers[w] for p in dests for _, w in sorted(p.ranks.items())]
            epoch = model.epoch
            key = (run.model, epoch)
            digest = self._digests.get(key)
            sources = [t for w in src_workers for t in w.specs]
            destinations = [t for w in dest_workers for t in w.specs]
        if digest is None:
            digest = make_digest(run.model, epoch, sources, destinations, self.plan_options)
            self._digests = {k: v for k, v in self._digests.items() if k[0] != run.model}
            self._digests[key] = digest
        plan = self.plans.get(digest)
        if plan is None:
            plan = make_plan(run.model, epoch, sources, destinations, self.plan_options)
            self.plans.put(plan)
        run.detail["digest"] = plan.digest
        with reg.lock:
            for slot in plan.slots:
                owner = reg.slots.get(slot)
                if (
                    owner is None
                    or owner.agent_id is None
                    or not self.agents.connected(owner.agent_id)
                ):
                    where = f"{owner.device} of host {owner.host!r}" if owner else "?"
                    raise precondition(
                        f"slot {slot} ({where}) of the plan has no connected node agent"
                    )
        return plan, dest_workers

    def _slot_agents(self, plan: ControllerPlan) -> dict[str, list[int]]:
        """agent id -> its slots in the plan; resets slot state of re-registered agents."""
        out: dict[str, list[int]] = {}
        with self.registry.lock:
            for slot in plan.slots:
                agent = self.registry.agents[self.registry.slots[slot].agent_id or ""]
                st = self._slots.get(slot)
                if st is None or st.incarnation != agent.incarnation:
                    self._slots[slot] = SlotState(agent.incarnation)
                out.setdefault(agent.agent_id, []).append(slot)
        return out

    def _connect(self, plan: ControllerPlan) -> None:
        by_agent = self._slot_agents(plan)
        key = (tuple(plan.slots), tuple(self._slots[s].incarnation for s in plan.slots))
        if key == self._comm_key and all(
            self._slots[s].comm_epoch == self._comm_epoch for s in plan.slots
        ):
            return
        if self.store_address is None:
            raise PhaseFailed("the rendezvous store is not running (rendezvous disabled)")
        self._comm_epoch += 1
        ranks = {slot: i for i, slot in enumerate(plan.slots)}
        g = Gather("connect")
        gid = self.board.add(g)
        try:
            for agent_id, slots in by_agent.items():
                cmd = pb.AgentCommand(
                    connect=pb.ConnectCommand(
                        epoch=self._comm_epoch,
                        store_host=self.store_address[0],
                        store_port=self.store_address[1],
                        world_size=len(ranks),
                        comm_rank=ranks,
                        transport=self.settings.transport,
                        timeout_s=self.settings.connect_timeout_s,
                        store_token=self.settings.store_token,
                    )
                )
                keys = [(s, pb.REPORT_KIND_CONNECTED) for s in slots]
                self.agents.send(agent_id, cmd, g, keys)
            g.wait(self.settings.connect_timeout_s)
        finally:
            self.agents.forget(g)
            self.board.remove(gid)
        for s in plan.slots:
            self._slots[s].comm_epoch = self._comm_epoch
            self._slots[s].loaded.clear()
        self._comm_key = key

    def _load(self, plan: ControllerPlan, model: str) -> None:
        todo = [s for s in plan.slots if plan.digest not in self._slots[s].loaded]
        if not todo:
            return
        by_agent = self._slot_agents(plan)
        g = Gather("load program")
        gid = self.board.add(g)
        try:
            with self.registry.lock:
                memory = self._memory_index(model)
            for agent_id, slots in by_agent.items():
                for slot in slots:
                    if slot not in todo:
                        continue
                    prog = plan.programs[slot]
                    handles = [
                        pb.TensorHandle(index=i, memory=memory.get(spec.key, b""))
                        for i, spec in prog.tensors.items()
                    ]
                    cmd = pb.AgentCommand(
                        load=pb.LoadProgramCommand(
                            model=model,
                            digest=plan.digest,
                            slot=slot,
                            program=plan.program_bytes(slot),
                            handles=handles,
                        )
                    )
                    self.agents.send(agent_id, cmd, g, [(slot, pb.REPORT_KIND_LOADED)])
            g.wait(self.settings.load_timeout_s)
        finally:
            self.agents.forget(g)
            self.board.remove(gid)
        for s in todo:
            self._slots[s].loaded.add(plan.digest)

    def _memory_index(self, model: str) -> dict[tuple[str, int, str], bytes]:
        """(pool, rank, name) -> memory handle of the model's live workers (lock held)."""
        return {
            (w.pool, w.rank, name): mem
            for w in self.registry.workers.values()
            if w.live and w.model == model
            for name, mem in w.memory.items()
        }

    def _event(self, run: RefitRun, kind: int, reason: str = "") -> pb.VersionEvent:
        return pb.VersionEvent(
            kind=kind,
            model=run.model,
            version=run.version,
            reason=reason,
            refit_id=run.refit_id,
        )

    def _broadcast(
        self,
        workers: list[Worker],
        kind: int,
        run: RefitRun,
        timeout_s: float,
        what: str,
        sent: list[str],
    ) -> None:
        """Send an event to every subscribed destination worker (appended to `sent`) and
        wait for their acks."""
        g = Gather(f"{what} of version {run.version}")
        gid = self.board.add(g)
        try:
            for w in workers:
                ev = self._event(run, kind)
                ev.pool = w.pool
                if self.events.send(w.worker_id, ev, g):
                    sent.append(w.worker_id)
            g.wait(timeout_s)
        finally:
            self.events.forget(g)
            self.board.remove(gid)

    def _transfer(self, plan: ControllerPlan, run: RefitRun, m: ModelRefits) -> float:
        """ExecuteCommand to every slot; returns when all are DONE (monotonic time)."""
        by_agent = self._slot_agents(plan)
        g = Gather(f"transfer of version {run.version}")
        gid = self.board.add(g)
        last_done = [0.0]

        def on_report(r: pb.AgentReport) -> None:
            if r.kind == pb.REPORT_KIND_SOURCES_RELEASED:
                with m.cond:
                    run.released.add(r.slot)
                    if run.source_waiters:
                        m.cond.notify_all()
            elif r.kind == pb.REPORT_KIND_DONE:
                moved = r.bytes_sent + r.bytes_received + r.bytes_local
                run.slot_stats[r.slot] = (moved, r.seconds)
                run.bytes += r.bytes_sent + r.bytes_local
                last_done[0] = time.monotonic()

        try:
            for agent_id, slots in by_agent.items():
                for slot in slots:
                    cmd = pb.AgentCommand(
                        execute=pb.ExecuteCommand(
                            model=run.model,
                            digest=plan.digest,
                            slot=slot,
                            version=run.version,
                            refit_id=run.refit_id,
                            timeout_s=self.settings.transfer_timeout_s,
                        )
                    )
                    keys = [(slot, pb.REPORT_KIND_SOURCES_RELEASED), (slot, pb.REPORT_KIND_DONE)]
                    self.agents.send(agent_id, cmd, g, keys, on_report)
            run.detail["control_start_s"] = time.monotonic() - run.started
            g.wait(self.settings.transfer_timeout_s)
        finally:
            self.agents.forget(g)
            self.board.remove(gid)
        return last_done[0] or time.monotonic()

    def _abort(self, plan: ControllerPlan, run: RefitRun, reason: str) -> None:
        """AbortCommand to every connected agent of the plan; their comm is rebuilt next time."""
        try:
            by_agent = self._slot_agents(plan)
        except KeyError:
            by_agent = {}
        for agent_id in by_agent:
            try:
                cmd = pb.AgentCommand(abort=pb.AbortCommand(refit_id=run.refit_id, reason=reason))
                self.agents.send(agent_id, cmd, None)
            except PhaseFailed:
                pass
        self._comm_key = None

    # ------------------------------------------------------------------ endings
    def _finish(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        with m.cond:
            self._end(m, run, state, reason)

    def _end(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        """Record a final state (caller holds the model's cond) and wake its waiters."""
        if run.final:
            return
        if run.started and not run.seconds:
            run.seconds = time.monotonic() - run.started
        run.state = state
        run.reason = reason
        record = RefitRecord(
            refit_id=run.refit_id,
            model=run.model,
            version=run.version,
            state=STATE_NAMES[state],
            reason=reason,
            started_at=time.time() - (time.monotonic() - run.first_ask),
            ended_at=time.time(),
            bytes=run.bytes,
            seconds=run.seconds,
            detail={
                **run.detail,
                "slots": {
                    str(k): {"bytes": b, "seconds": sec} for k, (b, sec) in run.slot_stats.items()
                },
            },
        )
        try:
            self.db.end_refit(record)
        except Exception:
            log.exception("could not record refit %s", run.refit_id)
        self.history.append(record)
        del self.history[: -self.settings.history_size]
        mt = self.metrics
        if state == pb.REFIT_STATE_COMMITTED:
            mt.refits_committed.labels(run.model).inc()
            mt.refit_bytes.labels(run.model).inc(run.bytes)
            mt.refit_duration.labels(run.model).observe(run.seconds)
            for part in ("control_start_s", "control_end_s"):
                if part in run.detail:
                    mt.control_overhead.labels(run.model, part[8:-2]).observe(
                        float(run.detail[part])
                    )
            for slot, (b, sec) in run.slot_stats.items():
                mt.slot_bytes.labels(str(slot)).inc(b)
                if sec > 0:
                    mt.slot_throughput.labels(str(slot)).set(b / sec)
        elif state == pb.REFIT_STATE_FAILED:
            mt.refits_failed.labels(run.model).inc()
            log.warning("refit %s of %s failed: %s", run.version, run.model, reason)
        else:
            mt.refits_superseded.labels(run.model).inc()
        m.cond.notify_all()

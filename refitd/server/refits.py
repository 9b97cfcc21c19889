"""The refit state machine: one refit per model at a time, coalescing to the newest version.

requested -> sources ready -> transferring -> landed -> committed, or failed with a reason
(superseded for versions coalesced into a newer one). A refit transfers once every rank of
the source pool has asked for its version (a barrier with a timeout). While one runs for a
model, newer requests wait; when it ends only the newest fully-requested version runs and
every older pending version returns SUPERSEDED. Each model has one driver thread; RPC
threads only record requests and wait on an Event of the run they joined (no polling, no
spurious wake-ups). Every phase has a timeout.

Speed (the critical path from the last Refit to every agent started, and from the last DONE
to committed):
- early pause: with `early_pause` the driver prepares the plan, the communicator and the
  PAUSE handshake as soon as the first trainer rank asks, overlapping them with the barrier.
  Safe because nothing is written before every rank asked: a barrier that fails sends ABORT
  (weights untouched, the pools resume the version they serve). The cost: a pool pauses for
  the barrier skew (the time between the first and the last rank's Refit).
- one ExecuteCommand per agent for all its slots, reports batched per agent;
- everything the refit needs from the registry is cached per membership epoch (a change of
  membership bumps the epoch, so the cache is never stale); the plan is cached by its
  layout digest, so a restart that keeps every layout reuses it, and only the slots whose
  workers registered again (new memory handles) get their program again;
- committed = landed in full on every destination pool and recorded in the version log (one
  SQLite transaction); COMMIT events then go out and their acks are collected off the
  critical path (a refused or missing COMMIT ack is logged and counted, the version stays).

Version safety: weights are written in place only after every destination worker acked
PAUSE (a worker without a subscription cannot pause, so the refit does not start). A refit
that fails after writing is retried (`refit_retries` within `refit_retry_budget_s`) while
the pools stay paused, but only while no trainer rank has got control back since its
weights were read (it may be changing them: re-reading would tear the version). Otherwise
the subscribers get INCOMPLETE: their weights must not be served.

Verification (`verify_checksums`): every slot reports a checksum per message it sent (over
its sources) and received (read back from what landed); a mismatch fails the attempt like
any transfer failure (retried or INCOMPLETE). The controller compares integers only.

Staged pools (registered with `staged`) are not paused for the transfer: their tensors land
in staging buffers of the transfer processes. Once every slot is DONE they are paused and
an ApplyCommand copies staging -> live on the slots holding them, then the commit goes on as
above. A failure before the apply leaves their weights untouched (they were never paused,
or get ABORT); a failed apply is retried from the intact staging (no re-transfer, so also
after the trainer got its weights back) within the retry budget, else INCOMPLETE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.plan.gc_pause import GcPause
from refitd.plan.planner import Plan
from refitd.server.database import RefitRecord, StateDB
from refitd.server.delta_refits import DeltaRefits
from refitd.server.errors import ControlError, ErrorKind, precondition
from refitd.server.metrics import ControllerMetrics
from refitd.server.planning import (
    ControllerPlan,
    PlanCache,
    PlanOptions,
    SlotInputs,
    WorkerKey,
    make_digest,
    make_plan,
    stale_slots,
)
from refitd.server.registry import Registry, Worker
from refitd.server.streams import (
    AckTally,
    AgentHub,
    EventHub,
    Gather,
    GatherBoard,
    PhaseFailed,
)

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
OUTCOMES_KEPT = 256  # ended versions remembered per model (one outcome per version)
ATTEMPT_SHIFT = 40  # execute/abort ids: refit_id | attempt << 40 (a retry is a new attempt)


def attempt_id(refit_id: int, attempt: int) -> int:
    """Id of one attempt of a refit, carried by ExecuteCommand/AbortCommand.refit_id."""
    return refit_id | attempt << ATTEMPT_SHIFT


class _Switch(Exception):
    """An early-started run must yield to another version whose barrier completed first."""


@dataclass
class RefitRun:
    """One requested version of one model, from its first Refit call to its end.

    The rank events and counters are guarded by the model's cond.
    """

    refit_id: int
    model: str
    version: int
    source_pool: str
    pool_size: int
    first_ask: float
    last_ask: float = 0.0
    asked: set[int] = field(default_factory=set)
    state: int = pb.REFIT_STATE_REQUESTED
    reason: str = ""
    readers: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> slots
    slot_ranks: dict[int, list[int]] = field(default_factory=dict)  # slot -> ranks it reads
    unread: dict[int, int] = field(default_factory=dict)  # rank -> reader slots not released
    released: set[int] = field(default_factory=set)
    rank_read: dict[int, threading.Event] = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    handed_back: bool = False  # a rank's Refit returned before the end: its weights may change
    lost: str = ""  # a source rank left during the barrier: why the run fails at once
    commit_acks: CommitAcks | None = None  # set before the run turns COMMITTED
    attempt: int = 0
    started: float = 0.0
    seconds: float = 0.0
    bytes: int = 0
    slot_stats: dict[int, tuple[int, float]] = field(default_factory=dict)
    detail: dict[str, float | str | int] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def barrier_done(self) -> bool:
        return len(self.asked) >= self.pool_size

    def rank_event(self, rank: int) -> threading.Event:
        ev = self.rank_read.get(rank)
        if ev is None:
            ev = self.rank_read[rank] = threading.Event()
            if self.final or (
                self.state >= pb.REFIT_STATE_TRANSFERRING and self.unread.get(rank, 0) == 0
            ):
                ev.set()
        return ev

    def start_transfer(self, readers: dict[int, frozenset[int]]) -> None:
        """TRANSFERRING: ranks nobody reads are released at once."""
        self.readers = readers
        self.released = set()
        self.slot_ranks = {}
        for rank, slots in readers.items():
            for slot in slots:
                self.slot_ranks.setdefault(slot, []).append(rank)
        self.unread = {rank: len(slots) for rank, slots in readers.items()}
        self.state = pb.REFIT_STATE_TRANSFERRING
        for rank, n in self.unread.items():
            if n == 0:
                self.rank_event(rank).set()

    def release(self, slot: int) -> None:
        if slot in self.released:
            return
        self.released.add(slot)
        for rank in self.slot_ranks.get(slot, ()):
            self.unread[rank] -= 1
            if self.unread[rank] == 0:
                self.rank_event(rank).set()

    def reset_sources(self) -> None:
        """Before a retry re-reads the sources: no rank counts as read any more."""
        for ev in self.rank_read.values():
            ev.clear()
        self.unread = {}
        self.released = set()

    def end_events(self) -> None:
        for ev in self.rank_read.values():
            ev.set()
        self.finished.set()


@dataclass
class ModelRefits:
    """Requests and the running refit of one model; `cond` guards both (the driver waits)."""

    name: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, RefitRun] = field(default_factory=dict)
    running: RefitRun | None = None
    driver: threading.Thread | None = None
    catch_up: bool = False  # a destination rank lacks the committed version
    # Failed and superseded versions (newest OUTCOMES_KEPT): a rank asking later for one
    # gets its recorded outcome instead of starting a second run of the same version.
    ended: dict[int, RefitRun] = field(default_factory=dict)


@dataclass
class SlotState:
    """What a slot's transfer process holds: its agent incarnation, comm epoch, and per
    model the plan digest last loaded with the inputs its handles came from (see
    planning.slot_inputs). One per model: loading a plan may free the model's older ones
    there (their staging buffers), so only the last is known to be loaded."""

    incarnation: int
    comm_epoch: int = 0
    loaded: dict[str, tuple[str, SlotInputs]] = field(default_factory=dict)

    def inputs(self, model: str, digest: str) -> SlotInputs | None:
        """The inputs the slot loaded `digest` with, if it is the model's loaded plan."""
        last = self.loaded.get(model)
        return last[1] if last is not None and last[0] == digest else None


@dataclass
class Membership:
    """What a refit of (model, epoch) needs from the registry, computed once per epoch."""

    model: str
    epoch: int
    plan: ControllerPlan
    dest_workers: list[Worker]
    by_agent: dict[str, list[int]]  # agent id -> its slots in the plan
    batch_agents: frozenset[str]  # agents that take one ExecuteCommand for all their slots
    readers: dict[int, frozenset[int]]  # source rank -> slots reading it
    members: frozenset[str]  # destination workers and agents: losing one fails the refit
    staged_pools: frozenset[str] = frozenset()  # written through staging, applied at the end
    snapshot_pools: frozenset[str] = frozenset()  # sources copied to a snapshot, then released

    def in_place(self) -> list[Worker]:
        """Destination workers written in place by the transfer (paused before it)."""
        return [w for w in self.dest_workers if w.pool not in self.staged_pools]

    def staged(self) -> list[Worker]:
        """Destination workers of staged pools (paused only for the apply)."""
        return [w for w in self.dest_workers if w.pool in self.staged_pools]


class DataPlaneTurn:
    """This driver's turn on the shared refit communicator (acquired at construction);
    release() is idempotent so every exit path can call it."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        lock.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


@dataclass
class RetryBudget:
    """Retries of one refit after failures that may have written."""

    first_error: str = ""
    until: float = 0.0
    safe: bool = True

    def explain(self, run: RefitRun, reason: str, retries: int) -> str:
        if run.attempt:
            if reason == self.first_error:
                return f"{reason} (after {run.attempt} retries)"
            return f"{self.first_error} (after {run.attempt} retries: {reason})"
        if not self.safe and retries:
            return f"{reason} (not retried: trainer ranks already had their weights back)"
        return reason


@dataclass
class CommitAcks:
    """COMMIT acks collected after a commit, off the critical path (waited for only by
    Refit calls with WAIT_SERVED)."""

    gather: AckTally
    gid: int
    version: int
    deadline: float
    timeout_s: float


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
        self.delta = DeltaRefits(settings)  # delta refits (docs/delta.md); off by default
        # Plan and program builds of this controller share one pause of the cyclic GC.
        self.gc_pause = GcPause()
        self.plan_options = PlanOptions(
            bucket_bytes=settings.bucket_bytes,
            sender_quantization=settings.sender_quantization,
            relay=settings.relay,
            allow_dtype_cast=settings.allow_dtype_cast,
        )
        self._models: dict[str, ModelRefits] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._membership: dict[str, Membership] = {}
        self._slots: dict[int, SlotState] = {}
        self._comm_key: tuple | None = None
        self._comm_epoch = 0
        # (model, digest, epoch) connected and loaded on every slot of its plan: the same
        # digest in a later epoch may need some slots loaded again (new memory handles)
        self._ready: tuple[str, str, int] | None = None
        # The refit communicator is one for all models: refits (and catch-ups) of different
        # models take turns on it rather than reconnecting it under each other.
        self._data_plane = threading.Lock()
        self._commit_acks: list[CommitAcks] = []
        self._catch_up_tried: set[tuple[str, float, int]] = set()  # (worker, registered, v)
        # Building slot programs is pure Python (about 90 s for 1024 kimi-k2 slots) that
        # starves the gRPC threads of the GIL: heartbeats queue unanswered meanwhile. No
        # lease expires while programs are built, nor for as long again after (at most
        # heartbeat_timeout_s), while the queued heartbeats are answered.
        for refit_id in db.interrupt_unfinished("the controller restarted during the refit"):
            log.warning("refit %s was interrupted by a controller restart: failed", refit_id)
        self.history: list[RefitRecord] = list(reversed(db.refits(settings.history_size)))
        self._leases = threading.Thread(target=self._watch_leases, name="refit-leases", daemon=True)
        self._leases.start()

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
        self._leases.join(timeout=5)

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

    def pending(self, model: str) -> list[dict[str, object]]:
        """Versions of `model` requested and waiting (for their barrier, or their turn),
        each with the source ranks that asked for it."""
        with self._lock:
            m = self._models.get(model)
        if m is None:
            return []
        with m.cond:
            return [
                {"version": v, "asked": sorted(r.asked), "pool_size": r.pool_size}
                for v, r in sorted(m.pending.items())
            ]

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
        w.last_seen = time.monotonic()  # a Refit call renews the lease like a heartbeat
        committed = self.registry.model(w.model).committed_version
        m = self._model(w.model)
        with m.cond:
            run = m.running if m.running and m.running.version == version else None
            if version <= committed:
                raise precondition(
                    f"version {version} of model {w.model!r} is not newer than the committed "
                    f"version {committed}"
                )
            ended = m.ended.get(version)
            if ended is not None:  # one outcome per version: every rank gets the same one
                return self._response(ended)
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
            run.last_ask = time.monotonic()
            m.cond.notify()  # the driver is the only waiter on m.cond
            if wait == pb.WAIT_ACCEPTED:
                run.handed_back = True
                return self._response(run)
            final = wait in (pb.WAIT_COMMITTED, pb.WAIT_SERVED)
            ready = run.finished if final else run.rank_event(w.rank)
        waited = timeout_s or self.settings.refit_wait_timeout_s
        deadline = time.monotonic() + waited
        while True:
            ok = ready.wait(max(0.0, deadline - time.monotonic()))
            with m.cond:
                # A retry clears the rank events (under m.cond) before re-reading sources:
                # a waiter woken just before that goes back to waiting.
                if ready.is_set() or run.final or not ok:
                    if not run.final:
                        run.handed_back = True
                    response = self._response(run)
                    break
        if not ok:
            raise ControlError(
                ErrorKind.DEADLINE,
                f"version {run.version} of model {run.model!r}: still "
                f"{STATE_NAMES[run.state]} after {waited:g}s; the refit goes on",
            )
        if wait == pb.WAIT_SERVED and response.state == pb.REFIT_STATE_COMMITTED:
            response.served, response.message = self._await_served(run, deadline)
        return response

    def _await_served(self, run: RefitRun, deadline: float) -> tuple[bool, str]:
        """WAIT_SERVED: (True, "") once every destination rank acked COMMIT of the run;
        else, once each has acked, refused or been lost, or at the commit timeout (or the
        call's deadline, whichever is first): (False, naming every rank that did not ack
        and why). Every rank not named serves the version; it stays committed anyway."""
        acks = run.commit_acks
        if acks is None:
            return False, f"version {run.version}: no COMMIT acks are collected for it"
        failed, silent = acks.gather.settle(
            max(0.0, min(deadline, acks.deadline) - time.monotonic())
        )
        if not failed and not silent:
            return True, ""
        why = [failed[k] for k in sorted(failed)]
        if silent:
            names = []
            for wid in silent:
                try:
                    names.append(self.registry.worker(wid).describe())
                except ControlError:
                    names.append(f"worker {wid} (gone)")
            within = (
                f"within {acks.timeout_s:g}s (commit timeout)"
                if time.monotonic() >= acks.deadline
                else "before the call's timeout"
            )
            why.append(f"no COMMIT ack {within} from {', '.join(names)}")
        return False, (
            f"version {run.version} is committed, but not served by every destination rank: "
            + "; ".join(why)
        )

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
                catch_up = run is None and m.catch_up and not m.pending
                if catch_up:
                    m.catch_up = False
                m.running = run
            if catch_up:
                try:
                    self._catch_up(m)
                except Exception:
                    log.exception("catch-up of model %s", m.name)
                continue
            if run is None:
                continue
            try:
                self._execute(run, m)
            except Exception as e:  # a bug must fail the refit, never kill the driver
                log.exception("refit %s of %s crashed", run.version, run.model)
                self._finish(m, run, pb.REFIT_STATE_FAILED, f"internal error: {e!r}")
            with m.cond:
                m.running = None

    def _next_run(self, m: ModelRefits) -> RefitRun | None:
        """Under m.cond: the version to run now, after timing out and superseding; or wait.

        The newest fully-requested version runs; with early_pause, when none is, the newest
        requested one starts its preparation and waits for its barrier inside _execute.
        """
        now = time.monotonic()
        self._expire_barriers(m, now)
        ready = [r for r in m.pending.values() if r.barrier_done]
        if ready:
            run = max(ready, key=lambda r: r.version)
            self._supersede_older(m, run)
        elif self.settings.early_pause and m.pending:
            run = max(m.pending.values(), key=lambda r: r.version)
        else:
            if not m.catch_up:
                deadlines = [
                    r.first_ask + self.settings.barrier_timeout_s for r in m.pending.values()
                ]
                m.cond.wait(max(0.0, min([now + 1.0, *deadlines]) - now) + 1e-3)
            return None
        del m.pending[run.version]
        return run

    def _expire_barriers(self, m: ModelRefits, now: float) -> None:
        for run in list(m.pending.values()):
            if not run.barrier_done and now - run.first_ask > self.settings.barrier_timeout_s:
                del m.pending[run.version]
                self._end(m, run, pb.REFIT_STATE_FAILED, self._barrier_reason(run))

    def _barrier_reason(self, run: RefitRun) -> str:
        missing = sorted(set(range(run.pool_size)) - run.asked)
        return (
            f"ranks {missing} of pool {run.source_pool} never asked for version "
            f"{run.version} (barrier timeout {self.settings.barrier_timeout_s:g}s)"
        )

    def source_gone(self, w: Worker, cause: str) -> None:
        """A source rank left (lease expired, or unregistered): every refit of its model
        still in its barrier fails at once, naming it, instead of at the barrier timeout.
        Pending runs end here; the running one (early pause) fails in _await_barrier."""
        if w.role != "source":
            return
        with self._lock:
            m = self._models.get(w.model)
        if m is None:
            return
        with m.cond:
            waiting = [r for r in m.pending.values() if not r.barrier_done]
            if m.running is not None and not m.running.barrier_done:
                waiting.append(m.running)
            for run in waiting:
                if run.source_pool != w.pool or run.final:
                    continue
                missing = sorted(set(range(run.pool_size)) - run.asked)
                run.lost = (
                    f"{w.describe()} {cause} while version {run.version} waited in its "
                    f"barrier (ranks {missing} of pool {run.source_pool} had not asked)"
                )
                if m.pending.get(run.version) is run:
                    del m.pending[run.version]
                    self._end(m, run, pb.REFIT_STATE_FAILED, run.lost)
            m.cond.notify_all()

    def _supersede_older(self, m: ModelRefits, run: RefitRun) -> None:
        for older in [r for r in m.pending.values() if r.version < run.version]:
            del m.pending[older.version]
            self._end(
                m,
                older,
                pb.REFIT_STATE_SUPERSEDED,
                f"coalesced into version {run.version} (a newer version was requested "
                "while a refit ran)",
            )

    def _await_barrier(self, m: ModelRefits, run: RefitRun) -> None:
        """Wait until every source rank asked for the early-started run; raise _Switch when
        another pending version completes its barrier first, PhaseFailed at the timeout."""
        deadline = run.first_ask + self.settings.barrier_timeout_s
        with m.cond:
            while not run.barrier_done:
                if run.lost:
                    raise PhaseFailed(run.lost)
                if any(r.barrier_done for r in m.pending.values()):
                    raise _Switch()
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise PhaseFailed(self._barrier_reason(run))
                m.cond.wait(left)
            if any(r.barrier_done and r.version > run.version for r in m.pending.values()):
                raise _Switch()

    def _set_state(self, m: ModelRefits, run: RefitRun, state: int) -> None:
        with m.cond:
            run.state = state

    def _execute(self, run: RefitRun, m: ModelRefits) -> None:
        """One refit: prepare, pause, (barrier), transfer, commit; retried after a failure
        that wrote while it is safe; failures end with ABORT or INCOMPLETE to the paused."""
        run.started = time.monotonic()
        s = self.settings
        self.metrics.refits_started.labels(run.model).inc()
        self._settle_commit_acks()
        paused: set[str] = set()
        written: dict[str, Worker] = {}  # workers whose live weights may have been written
        retry = RetryBudget()
        while True:
            plan: ControllerPlan | None = None
            turn = DataPlaneTurn(self._data_plane)
            try:
                if not run.barrier_done and not self._source_pool_complete(run):
                    # Early pause needs the whole source pool registered; ranks still
                    # registering ask within the barrier timeout, so wait for them first.
                    turn.release()
                    self._await_barrier(m, run)
                    turn = DataPlaneTurn(self._data_plane)
                ms = self._membership_for(run)
                plan = ms.plan
                self._set_state(m, run, pb.REFIT_STATE_SOURCES_READY)
                self._connect_and_load(ms)
                todo = [w for w in ms.in_place() if w.worker_id not in paused]
                if todo:
                    t = time.monotonic()
                    self._broadcast(todo, pb.EVENT_KIND_PAUSE, run, s.pause_timeout_s, ms, paused)
                    run.detail["pause_s"] = time.monotonic() - t
                if not run.barrier_done:
                    # Other models may use the communicator while this one waits for its
                    # ranks; it is checked (a dict compare) or rebuilt after the barrier.
                    turn.release()
                    self._await_barrier(m, run)
                    turn = DataPlaneTurn(self._data_plane)
                    ms = self._membership_for(run)
                    self._connect_and_load(ms)
                    todo = [w for w in ms.in_place() if w.worker_id not in paused]
                    if todo:  # registered during the barrier: they pause too
                        self._broadcast(
                            todo, pb.EVENT_KIND_PAUSE, run, s.pause_timeout_s, ms, paused
                        )
                self._mark_writing(run)
                with m.cond:
                    run.start_transfer(ms.readers)
                written.update((w.worker_id, w) for w in ms.in_place())
                last_done = self._transfer(ms, run, m)
                run.detail["transfer_done_at"] = last_done  # monotonic, like executes_sent_at
                if ms.staged_pools:
                    self._apply(ms, run, paused, written)
                turn.release()
                self._commit(m, run, ms, last_done)
                return
            except _Switch:
                turn.release()
                self._events_to(paused, run, pb.EVENT_KIND_ABORT, "a newer version is ready")
                with m.cond:
                    run.state = pb.REFIT_STATE_REQUESTED
                    m.pending[run.version] = run
                return
            except Exception as e:  # every failure ends with ABORT or INCOMPLETE to the paused
                turn.release()
                if isinstance(e, ControlError):
                    reason = e.message
                elif isinstance(e, PhaseFailed):
                    reason = str(e)
                else:
                    log.exception("refit %s of %s: internal error", run.version, run.model)
                    reason = f"internal error: {e!r}"
                if plan is not None:
                    self._abort(plan, run, reason)
                if written:
                    self.delta.failed(run.model, written.values())  # torn: the retry is dense
                    if retry.first_error == "":
                        retry.first_error = reason
                        retry.until = time.monotonic() + s.refit_retry_budget_s
                    if self._retry(m, run, retry, reason):
                        continue
                    reason = retry.explain(run, reason, s.refit_retries)
                for w in written.values():
                    w.holds = 0  # torn: it cannot be the source of a catch-up
                self._events_to(paused & written.keys(), run, pb.EVENT_KIND_INCOMPLETE, reason)
                self._events_to(paused - written.keys(), run, pb.EVENT_KIND_ABORT, reason)
                self._finish(m, run, pb.REFIT_STATE_FAILED, reason)
                return

    def _apply(
        self, ms: Membership, run: RefitRun, paused: set[str], written: dict[str, Worker]
    ) -> None:
        """Pause the staged pools, then ApplyCommand (staging -> live) to the agents of
        their slots and wait for every DONE. A failed apply is sent again (it is
        idempotent, and the transfer processes refuse it unless their staging holds this
        attempt's transfer in full) while within refit_retries and refit_retry_budget_s."""
        s = self.settings
        staged = ms.staged()
        todo = [w for w in staged if w.worker_id not in paused]
        t = run.detail["staged_pause_at"] = time.monotonic()
        if todo:
            self._broadcast(todo, pb.EVENT_KIND_PAUSE, run, s.pause_timeout_s, ms, paused)
        run.detail["staged_pause_s"] = time.monotonic() - t
        slots = {w.slot for w in staged}
        by_agent = {
            agent: [slot for slot in agent_slots if slot in slots]
            for agent, agent_slots in ms.by_agent.items()
        }
        written.update((w.worker_id, w) for w in staged)
        filled = attempt_id(run.refit_id, run.attempt)
        until = time.monotonic() + s.refit_retry_budget_s
        tries = 0
        t = time.monotonic()
        while True:
            g, gid = self._gather(f"apply of version {run.version}", ms)
            try:
                for agent_id, agent_slots in by_agent.items():
                    if not agent_slots:
                        continue
                    cmd = pb.AgentCommand(
                        apply=pb.ApplyCommand(
                            model=run.model,
                            digest=ms.plan.digest,
                            slots=agent_slots,
                            version=run.version,
                            refit_id=filled,
                            timeout_s=s.commit_timeout_s,
                        )
                    )
                    keys = [(slot, pb.REPORT_KIND_DONE) for slot in agent_slots]
                    self.agents.send(agent_id, cmd, g, keys)
                g.wait(s.commit_timeout_s)
                run.detail["apply_s"] = time.monotonic() - t
                return
            except PhaseFailed as e:
                tries += 1
                if tries > s.refit_retries or time.monotonic() >= until:
                    raise PhaseFailed(f"{e} (apply tried {tries} times)") from e
                log.warning(
                    "refit %s of %s: apply failed (%s); applying again from staging",
                    run.version,
                    run.model,
                    e,
                )
                time.sleep(0.2)
            finally:
                self.agents.forget(g)
                self.board.remove(gid)

    def _retry(self, m: ModelRefits, run: RefitRun, retry: RetryBudget, reason: str) -> bool:
        """After a failure that may have written: go again (pools stay paused) when it is
        safe (no trainer rank got control back: the sources are unchanged) and within the
        budget. A failure before the transfer of a retry (the lost member is not back yet)
        waits a little and does not count as an attempt."""
        transferring = run.state == pb.REFIT_STATE_TRANSFERRING
        with m.cond:
            retry.safe = not run.handed_back
            go = (
                retry.safe
                and time.monotonic() < retry.until
                and (run.attempt < self.settings.refit_retries or not transferring)
                and (run.attempt > 0 or transferring)
            )
            if go:
                run.reset_sources()
                run.state = pb.REFIT_STATE_SOURCES_READY
        if not go:
            return False
        if transferring:
            run.attempt += 1
            run.detail["retries"] = run.attempt
            log.warning(
                "refit %s of %s: attempt %d failed (%s); retrying with the pools paused",
                run.version,
                run.model,
                run.attempt,
                reason,
            )
        else:
            time.sleep(0.2)
        return True

    def _mark_writing(self, run: RefitRun) -> None:
        """Persisted before the first write: a controller restarted mid-refit then knows the
        ranks it paused may hold torn weights (INCOMPLETE) rather than untouched ones."""
        if not run.detail.get("wrote"):
            run.detail["wrote"] = True
            self.db.mark_refit(run.refit_id, "transferring")

    def _commit(self, m: ModelRefits, run: RefitRun, ms: Membership, last_done: float) -> None:
        """LANDED -> version log -> COMMITTED; COMMIT events go out, their acks are settled
        later (off the critical path; Refit calls with WAIT_SERVED wait for them)."""
        gone = set(w.worker_id for w in ms.dest_workers) - set(
            self.events.subscribed(w.worker_id for w in ms.dest_workers)
        )
        if gone:
            raise PhaseFailed(
                f"destination workers {sorted(gone)} lost their subscription during the transfer"
            )
        run.state = pb.REFIT_STATE_LANDED
        run.seconds = time.monotonic() - run.started
        self.db.commit_version(
            run.model, run.version, run.refit_id, run.bytes, run.seconds, ms.epoch
        )
        self.registry.set_committed(run.model, run.version)
        for w in ms.dest_workers:
            w.holds = run.version
        density = (run.detail.get("delta") or {}).get("density")
        self.delta.committed(run.model, run.version, ms.plan.digest, ms.dest_workers, density)
        run.detail["control_end_s"] = time.monotonic() - last_done
        # The acks are awaited from the start (WAIT_SERVED callers wait on them from the
        # moment the run is COMMITTED), the events go out right after.
        g = AckTally(f"commit of version {run.version}")
        for w in ms.dest_workers:
            g.pending.add(w.worker_id)
            g.members[w.worker_id] = w.worker_id
        timeout = self.settings.commit_timeout_s
        acks = CommitAcks(g, self.board.add(g), run.version, time.monotonic() + timeout, timeout)
        with self._lock:
            self._commit_acks.append(acks)
        with m.cond:
            run.commit_acks = acks
            self._set_final(run, pb.REFIT_STATE_COMMITTED, "")
        for w in ms.dest_workers:
            if w.paused_in == run.refit_id:
                w.paused_in = 0
            ev = self._event(run, pb.EVENT_KIND_COMMIT)
            ev.pool = w.pool
            if not self.events.send(w.worker_id, ev, g):
                g.lose(w.worker_id, f"{w.describe()} lost its subscription before its COMMIT")
        self._record(run, pb.REFIT_STATE_COMMITTED, "")

    def _settle_commit_acks(self) -> None:
        """Forget COMMIT ack gathers that completed or passed their deadline, logging the
        workers that refused or never acked (the version stays committed)."""
        now = time.monotonic()
        with self._lock:
            due = [a for a in self._commit_acks if a.gather.done or now >= a.deadline]
            self._commit_acks = [a for a in self._commit_acks if a not in due]
        for acks in due:
            g = acks.gather
            self.events.forget(g)
            self.board.remove(acks.gid)
            with g.cond:
                why = [*g.failed.values(), *(f"no ack from worker {k}" for k in sorted(g.pending))]
            if why:
                log.warning("version %s: COMMIT not acknowledged: %s", acks.version, "; ".join(why))

    # ------------------------------------------------------------------ membership
    def _source_pool_complete(self, run: RefitRun) -> bool:
        with self.registry.lock:
            pool = self.registry.model(run.model).pools.get(run.source_pool)
            return pool is not None and pool.complete

    def _membership_for(self, run: RefitRun) -> Membership:
        """The cached Membership of the model's epoch, checked for liveness, else built."""
        model = self.registry.model(run.model)
        ms = self._membership.get(run.model)
        if ms is None or ms.epoch != model.epoch:
            ms = self._build_membership(run)
            self._membership[run.model] = ms
        for agent_id in ms.by_agent:
            if not self.agents.connected(agent_id):
                slots = ms.by_agent[agent_id]
                raise precondition(
                    f"slots {slots} of the plan have no connected node agent (agent {agent_id})"
                )
        subscribed = set(self.events.subscribed(w.worker_id for w in ms.dest_workers))
        for w in ms.dest_workers:
            if w.worker_id not in subscribed:
                raise precondition(
                    f"{w.describe()} is not subscribed: it cannot pause, so its weights cannot "
                    "be written"
                )
        run.detail["digest"] = ms.plan.digest
        return ms

    def _build_membership(self, run: RefitRun) -> Membership:
        """Preconditions, then the plan (cached by digest) and what the refit needs."""
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
            tables = model.tables
            sources, destinations = tables.snapshot(
                lambda: (
                    [t for w in src_workers for t in w.specs],
                    [t for w in dest_workers for t in w.specs],
                )
            )
        try:
            digest = make_digest(run.model, sources, destinations, self.plan_options)
            plan = self.plans.get(digest)
            if plan is None:
                plan = make_plan(
                    run.model, epoch, sources, destinations, self.plan_options, self.gc_pause
                )
                self.plans.put(plan)
                self._built(run.model, "refit")
        finally:
            with reg.lock:
                tables.release()
        by_agent: dict[str, list[int]] = {}
        batch: set[str] = set()
        with reg.lock:
            for slot in plan.slots:
                owner = reg.slots.get(slot)
                agent = reg.agents.get(owner.agent_id or "") if owner else None
                if agent is None or not self.agents.connected(agent.agent_id):
                    where = f"{owner.device} of host {owner.host!r}" if owner else "?"
                    raise precondition(
                        f"slot {slot} ({where}) of the plan has no connected node agent"
                    )
                by_agent.setdefault(agent.agent_id, []).append(slot)
                if agent.batch_execute:
                    batch.add(agent.agent_id)
        readers = {rank: plan.readers(run.source_pool, rank) for rank in range(run.pool_size)}
        members = frozenset([*(w.worker_id for w in dest_workers), *by_agent])
        return Membership(
            run.model,
            epoch,
            plan,
            dest_workers,
            by_agent,
            frozenset(batch),
            readers,
            members,
            frozenset(p.name for p in dests if p.staged),
            frozenset([src.name] if src.snapshot else []),
        )

    # ------------------------------------------------------------------ agents
    def _slot_agents(self, plan: ControllerPlan) -> dict[str, list[int]]:
        """agent id -> its slots in the plan; resets slot state of re-registered agents."""
        out: dict[str, list[int]] = {}
        with self.registry.lock:
            for slot in plan.slots:
                agent = self.registry.agents[self.registry.slots[slot].agent_id or ""]
                st = self._slots.get(slot)
                if st is None or st.incarnation != agent.incarnation:
                    self._slots[slot] = SlotState(agent.incarnation)
                    self._ready = None
                out.setdefault(agent.agent_id, []).append(slot)
        return out

    def _connect_and_load(self, ms: Membership) -> None:
        """Communicator and programs in place on every slot (a dict compare when they are)."""
        ready = (ms.model, ms.plan.digest, ms.epoch)
        if self._ready == ready:
            return
        self._connect(ms)
        self._load(ms)
        self._ready = ready

    def _gather(self, what: str, ms: Membership) -> tuple[Gather, int]:
        g = Gather(what)
        g.watch = ms.members
        return g, self.board.add(g)

    def _connect(self, ms: Membership) -> None:
        plan = ms.plan
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
        g, gid = self._gather("connect", ms)
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

    def _load(self, ms: Membership) -> None:
        """LoadProgramCommand to the slots whose program of this plan is missing or was
        loaded with other workers' memory handles; the others keep theirs."""
        plan = ms.plan
        with self.registry.lock:
            identity = self._identities(ms.model)
        todo = stale_slots(
            plan,
            lambda slot: self._slots[slot].inputs(ms.model, plan.digest),
            lambda key: identity.get(key, ""),
            ms.staged_pools,
            ms.snapshot_pools,
        )
        if not todo:
            return
        g, gid = self._gather("load program", ms)
        try:
            with self.registry.lock:
                memory = self._memory_index(
                    ms.model, {k for inputs in todo.values() for k, _ in inputs[0]}
                )
            for agent_id, slots in ms.by_agent.items():
                for slot in slots:
                    if slot not in todo:
                        continue
                    payload = plan.load_payload(slot)
                    handles = [
                        pb.TensorHandle(
                            index=i,
                            memory=memory.get(key, b""),
                            staged=key[0] in ms.staged_pools,
                            snapshot=key[0] in ms.snapshot_pools,
                        )
                        for i, key in payload.tensors
                    ]
                    cmd = pb.AgentCommand(
                        load=pb.LoadProgramCommand(
                            model=ms.model,
                            digest=plan.digest,
                            slot=slot,
                            program=payload.program,
                            handles=handles,
                        )
                    )
                    self.agents.send(agent_id, cmd, g, [(slot, pb.REPORT_KIND_LOADED)])
            g.wait(self.settings.load_timeout_s)
        finally:
            self.agents.forget(g)
            self.board.remove(gid)
        for s, inputs in todo.items():
            self._slots[s].loaded[ms.model] = (plan.digest, inputs)
        self.metrics.programs_sent.labels(ms.model).inc(len(todo))
        self.plans.programs_sent += len(todo)

    def _identities(self, model: str) -> dict[WorkerKey, str]:
        """(pool, rank) -> identity of its live registration (lock held): a new one means
        new memory handles."""
        return {
            (w.pool, w.rank): f"{w.worker_id}@{w.registered_at!r}"
            for w in self.registry.workers.values()
            if w.live and w.model == model
        }

    def _built(self, model: str, kind: str) -> None:
        """Count a plan built (kind: refit or catch_up)."""
        self.metrics.plans_built.labels(model, kind).inc()
        self.plans.built += 1

    def _memory_index(
        self, model: str, holders: set[WorkerKey]
    ) -> dict[tuple[str, int, str], bytes]:
        """(pool, rank, name) -> memory handle of the live workers `holders` of the model
        (lock held): only the workers of the slots being loaded are looked at."""
        m = self.registry.models.get(model)
        out: dict[tuple[str, int, str], bytes] = {}
        for pool, rank in holders:
            p = m.pools.get(pool) if m is not None else None
            w = self.registry.workers.get(p.ranks.get(rank, "")) if p is not None else None
            if w is not None and w.live:
                out.update(((pool, rank, name), mem) for name, mem in w.memory.items())
        return out

    # ------------------------------------------------------------------ events
    def _event(self, run: RefitRun, kind: int, reason: str = "") -> pb.VersionEvent:
        return pb.VersionEvent(
            kind=kind,
            model=run.model,
            version=run.version,
            reason=reason,
            refit_id=run.refit_id,
        )

    def _events_to(self, worker_ids: set[str], run: RefitRun, kind: int, reason: str) -> None:
        """Tell paused workers how the refit ended (ABORT: resume; INCOMPLETE: do not serve)."""
        for wid in sorted(worker_ids):
            try:
                w = self.registry.worker(wid)
            except ControlError:
                continue  # gone meanwhile
            if w.paused_in == run.refit_id:
                w.paused_in = 0  # told here: settle_paused has nothing left to say
            ev = self._event(run, kind, reason)
            ev.pool = w.pool
            self.events.send(wid, ev, None)

    def _broadcast(
        self,
        workers: list[Worker],
        kind: int,
        run: RefitRun,
        timeout_s: float,
        ms: Membership,
        acked: set[str],
    ) -> None:
        """Send an event to the destination workers and wait for all their acks; those that
        acked are added to `acked` (even when the phase fails: they did pause)."""
        what = "pause" if kind == pb.EVENT_KIND_PAUSE else "commit"
        if kind == pb.EVENT_KIND_PAUSE:  # an earlier refit's answer goes first on the stream
            self.settle_paused([w.worker_id for w in workers])
        g, gid = self._gather(f"{what} of version {run.version}", ms)
        sent: list[str] = []
        try:
            for w in workers:
                ev = self._event(run, kind)
                ev.pool = w.pool
                if not self.events.send(w.worker_id, ev, g):
                    raise PhaseFailed(f"{w.describe()} is not subscribed: it cannot pause")
                sent.append(w.worker_id)
            g.wait(timeout_s)
        finally:
            with g.cond:
                pending = set(g.pending)
            # A worker that was sent PAUSE may pause even if it acks late: tell it the end.
            acked.update(w for w in sent if w not in pending or g.failure is not None)
            self.events.forget(g)
            self.board.remove(gid)

    # ------------------------------------------------------------------ transfer
    def _transfer(self, ms: Membership, run: RefitRun, m: ModelRefits) -> float:
        """ExecuteCommand to every slot (one per agent); returns when all are DONE."""
        plan = ms.plan
        g, gid = self._gather(f"transfer of version {run.version}", ms)
        last_done = [0.0]
        exec_id = attempt_id(run.refit_id, run.attempt)
        verify = self.settings.verify_checksums
        # sender side? -> message id -> (reporting slot, checksum)
        sums: dict[bool, dict[int, tuple[int, int]]] = {True: {}, False: {}}

        def on_report(r: pb.AgentReport) -> None:
            if r.kind == pb.REPORT_KIND_SOURCES_RELEASED:
                with m.cond:
                    run.release(r.slot)
            elif r.kind == pb.REPORT_KIND_DONE:
                moved = r.bytes_sent + r.bytes_received + r.bytes_local
                run.slot_stats[r.slot] = (moved, r.seconds)
                run.bytes += r.bytes_sent + r.bytes_local
                for c in r.checksums:
                    sums[c.sent][c.message_id] = (r.slot, c.checksum)
                self.delta.reported(run.model, plan.digest, exec_id, r)
                if r.snapshot_bytes or r.snapshot_fallback:
                    snaps = run.detail.setdefault("snapshot", {})
                    snaps[str(r.slot)] = {
                        "bytes": r.snapshot_bytes,
                        "fallback": r.snapshot_fallback,
                    }
                last_done[0] = time.monotonic()

        timeout = self.settings.transfer_timeout_s
        with self.registry.lock:
            mdl = self.registry.models.get(run.model)
            committed = mdl.committed_version if mdl is not None else 0
            host_slots = frozenset(
                i for i, sl in self.registry.slots.items() if sl.device.startswith("cpu")
            )
        deltas = self.delta.commands(
            run.model, plan, ms.dest_workers, ms.staged_pools, committed, exec_id, run.detail,
            host_slots,
        )  # fmt: skip
        try:
            for agent_id, slots in ms.by_agent.items():
                batched = agent_id in ms.batch_agents
                batches = [slots] if batched else [[slot] for slot in slots]
                for batch in batches:
                    cmd = pb.AgentCommand(
                        execute=pb.ExecuteCommand(
                            model=run.model,
                            digest=plan.digest,
                            slot=batch[0],
                            slots=batch if batched else (),
                            version=run.version,
                            refit_id=exec_id,
                            timeout_s=timeout,
                            verify=verify,
                            delta=[deltas[s] for s in batch if s in deltas],
                        )
                    )
                    keys = [
                        (slot, kind)
                        for slot in batch
                        for kind in (pb.REPORT_KIND_SOURCES_RELEASED, pb.REPORT_KIND_DONE)
                    ]
                    self.agents.send(agent_id, cmd, g, keys, on_report)
            sent = time.monotonic()
            run.detail["control_start_s"] = sent - max(run.started, run.last_ask)
            run.detail["last_ask_at"] = run.last_ask  # monotonic: for benchmarks on this host
            run.detail["executes_sent_at"] = sent
            g.wait(timeout)
        finally:
            self.agents.forget(g)
            self.board.remove(gid)
            self.delta.finish_attempt(exec_id, run.detail)
        if verify:
            t = time.monotonic()
            mismatch = compare_checksums(plan.plan, sums[True], sums[False])
            if mismatch:
                raise PhaseFailed(f"transfer of version {run.version}: {mismatch}")
            run.detail.update(verified=True, verify_check_s=time.monotonic() - t)
        return last_done[0] or time.monotonic()

    def _abort(self, plan: ControllerPlan, run: RefitRun, reason: str) -> None:
        """AbortCommand (this attempt's id) to every connected agent of the plan; the
        communicator is rebuilt and programs reloaded before the next execute."""
        try:
            by_agent = self._slot_agents(plan)
        except KeyError:
            by_agent = {}
        for agent_id in by_agent:
            try:
                cmd = pb.AgentCommand(
                    abort=pb.AbortCommand(
                        refit_id=attempt_id(run.refit_id, run.attempt), reason=reason
                    )
                )
                self.agents.send(agent_id, cmd, None)
            except PhaseFailed:
                pass
        self._comm_key = None
        self._ready = None

    # ------------------------------------------------------------------ catch-up
    def _behind(self, model: str) -> tuple[int, list[Worker], list[Worker]]:
        """(committed version, subscribed destination ranks that lack it and were not tried
        yet, live destination ranks that hold it)."""
        reg = self.registry
        with reg.lock:
            mdl = reg.models.get(model)
            if mdl is None or mdl.committed_version <= 0:
                return 0, [], []
            v = mdl.committed_version
            dests = [
                reg.workers[wid]
                for p in mdl.destination_pools()
                for wid in p.ranks.values()
                if wid in reg.workers and reg.workers[wid].live
            ]
        subscribed = set(self.events.subscribed(w.worker_id for w in dests))
        behind = [
            w
            for w in dests
            if w.holds != v
            and w.worker_id in subscribed
            and (w.worker_id, w.registered_at, v) not in self._catch_up_tried
        ]
        holders = [w for w in dests if w.holds == v]
        return v, behind, holders

    def _find_catch_ups(self) -> None:
        with self.registry.lock:
            names = list(self.registry.models)
        for name in names:
            if self._behind(name)[1]:
                m = self._model(name)
                with m.cond:
                    if not m.catch_up:
                        m.catch_up = True
                        m.cond.notify()

    def _catch_up(self, m: ModelRefits) -> None:
        """Copy the committed version into destination ranks that registered without it (a
        restarted inference instance), from inference replicas that serve it: the trainer's
        memory has moved on. PAUSE and COMMIT go to the caught-up ranks only; the replicas
        read from keep serving (they are only read). Without a replica that covers the
        ranks (e.g. a single-replica pool), they get the next version instead."""
        version, behind, holders = self._behind(m.name)
        if not behind:
            return
        for w in behind:
            self._catch_up_tried.add((w.worker_id, w.registered_at, version))
        who = ", ".join(w.describe() for w in behind)
        sources = [w for w in holders if all(t.storage == "plain" for t in w.specs)]
        if not sources:
            log.info("%s: no replica holds version %s; caught up by the next refit", who, version)
            return
        model = self.registry.model(m.name)
        src_specs = [t for w in sources for t in w.specs]
        dst_specs = [t for w in behind for t in w.specs]
        try:
            plan = make_plan(
                m.name, model.epoch, src_specs, dst_specs, self.plan_options, self.gc_pause
            )
            self._built(m.name, "catch_up")
        except ControlError as e:
            log.info("%s: catch-up to version %s impossible (%s); next refit", who, version, e)
            return
        by_agent: dict[str, list[int]] = {}
        batch: set[str] = set()
        with self.registry.lock:
            for slot in plan.slots:
                owner = self.registry.slots.get(slot)
                agent = self.registry.agents.get(owner.agent_id or "") if owner else None
                if agent is None or not self.agents.connected(agent.agent_id):
                    log.info("%s: catch-up waits: slot %s has no connected agent", who, slot)
                    return
                by_agent.setdefault(agent.agent_id, []).append(slot)
                if agent.batch_execute:
                    batch.add(agent.agent_id)
        ms = Membership(
            m.name,
            model.epoch,
            plan,
            behind,
            by_agent,
            frozenset(batch),
            {},
            frozenset([*(w.worker_id for w in behind), *by_agent]),
        )
        refit_id = self.db.start_refit(m.name, version, "requested")
        run = RefitRun(refit_id, m.name, version, "", 0, time.monotonic())
        run.started = run.first_ask
        run.detail["catch_up"] = [w.worker_id for w in behind]
        paused: set[str] = set()
        wrote = False
        turn = DataPlaneTurn(self._data_plane)
        try:
            self._connect_and_load(ms)
            self._broadcast(
                behind, pb.EVENT_KIND_PAUSE, run, self.settings.pause_timeout_s, ms, paused
            )
            self._mark_writing(run)
            with m.cond:
                run.start_transfer({})
            wrote = True
            self._transfer(ms, run, m)
            self.delta.committed(m.name, version, plan.digest, behind, None, how="catch_up")
            for w in behind:
                w.holds = version
                ev = self._event(run, pb.EVENT_KIND_COMMIT)
                ev.pool = w.pool
                self.events.send(w.worker_id, ev, None)
            turn.release()
            log.info("%s caught up to version %s from %d replica ranks", who, version, len(sources))
            self._finish(m, run, pb.REFIT_STATE_COMMITTED, "")
        except Exception as e:
            turn.release()
            reason = str(e.message if isinstance(e, ControlError) else e)
            self._abort(plan, run, reason)
            kind = pb.EVENT_KIND_INCOMPLETE if wrote else pb.EVENT_KIND_ABORT
            self._events_to(paused, run, kind, f"catch-up to version {version} failed: {reason}")
            self._finish(m, run, pb.REFIT_STATE_FAILED, f"catch-up: {reason}")

    # ------------------------------------------------------------------ paused re-registrations
    def settle_paused(self, worker_ids: Iterable[str] | None = None) -> None:
        """Tell subscribed ranks that re-registered while paused by a refit that has ended
        (a controller restart, or a lease lost mid-refit) how it ended: COMMIT when its
        version landed, ABORT when nothing was written, INCOMPLETE when weights may be torn
        (or the refit is unknown). Refits still running here are settled when they end."""
        reg = self.registry
        with reg.lock:
            pool = reg.workers.values() if worker_ids is None else map(reg.workers.get, worker_ids)
            waiting = [w for w in pool if w is not None and w.live and w.paused_in]
        if not waiting:
            return
        subscribed = set(self.events.subscribed(w.worker_id for w in waiting))
        for w in waiting:
            rid = w.paused_in
            if w.worker_id not in subscribed:
                continue
            outcome = self.db.refit_outcome(rid)
            if outcome is not None and outcome.state not in ("committed", "failed", "superseded"):
                continue  # still running: it tells its paused ranks itself
            ev = pb.VersionEvent(model=w.model, pool=w.pool, refit_id=rid)
            if outcome is None:
                ev.kind = pb.EVENT_KIND_INCOMPLETE
                ev.reason = f"refit {rid} is unknown here: weights written during it are untrusted"
            elif outcome.state == "committed":
                ev.kind, ev.version = pb.EVENT_KIND_COMMIT, outcome.version
                w.holds = outcome.version  # landed in full; a catch-up follows if it is older
            else:
                ev.version = outcome.version
                ev.kind = pb.EVENT_KIND_INCOMPLETE if outcome.wrote else pb.EVENT_KIND_ABORT
                ev.reason = f"refit {rid} of version {outcome.version} failed: {outcome.reason}"
            w.paused_in = 0
            log.warning(
                "%s re-registered paused by refit %s: sent %s",
                w.describe(),
                rid,
                pb.EventKind.Name(ev.kind),
            )
            self.events.send(w.worker_id, ev, None)

    # ------------------------------------------------------------------ leases
    def _watch_leases(self) -> None:
        """Expire workers and agents silent for heartbeat_timeout_s; settle COMMIT acks."""
        s = self.settings
        period = min(s.heartbeat_interval_s, s.heartbeat_timeout_s / 4, 0.5)
        while not self._stop.wait(period):
            try:
                self._expire(time.monotonic() - s.heartbeat_timeout_s)
                self._settle_commit_acks()
                self.settle_paused()
                self._find_catch_ups()
            except Exception:
                log.exception("lease watcher")

    def _expire(self, cutoff: float) -> None:
        timeout = self.settings.heartbeat_timeout_s
        reg = self.registry
        with reg.lock:
            workers = [w for w in reg.workers.values() if w.live and w.last_seen < cutoff]
            agents = [a for a in reg.agents.values() if a.last_seen and a.last_seen < cutoff]
        # An open Subscribe stream is a lease of its own (gRPC keepalive watches it).
        streaming = set(self.events.subscribed(w.worker_id for w in workers))
        workers = [w for w in workers if w.worker_id not in streaming]
        agents = [a for a in agents if self.agents.connected(a.agent_id)]
        with reg.lock:  # again: a stream opened (or a re-registration) meanwhile renews it
            agents = [
                a
                for a in (reg.agents.get(x.agent_id) for x in agents)
                if a is not None and a.last_seen and a.last_seen < cutoff
            ]
        for w in workers:
            reason = f"{w.describe()} missed its heartbeats for {timeout:g}s (lease expired)"
            log.warning("%s; unregistering it", reason)
            try:
                reg.unregister_worker(w.worker_id)
            except ControlError:
                continue
            self.board.member_gone(w.worker_id, reason)
            self.source_gone(w, f"missed its heartbeats for {timeout:g}s (lease expired)")
        for a in agents:
            reason = (
                f"agent {a.agent_id} on host {a.host!r} missed its heartbeats for {timeout:g}s "
                "(lease expired)"
            )
            log.warning("%s", reason)
            self.agents.drop(a.agent_id, reason)

    # ------------------------------------------------------------------ endings
    def _finish(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        """Final state: waiters wake first, then the history row and metrics are written."""
        with m.cond:
            if run.final:
                return
            self._set_final(run, state, reason)
            self._remember(m, run)
        self._record(run, state, reason)

    def _end(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        """Record a final state (caller holds the model's cond) and wake its waiters."""
        if run.final:
            return
        self._set_final(run, state, reason)
        self._remember(m, run)
        self._record(run, state, reason)

    @staticmethod
    def _remember(m: ModelRefits, run: RefitRun) -> None:
        """Keep a failed or superseded version's outcome (caller holds m.cond); a committed
        one needs no entry: asking for it again is refused as not newer than committed."""
        if run.state == pb.REFIT_STATE_COMMITTED:
            return
        m.ended[run.version] = run
        while len(m.ended) > OUTCOMES_KEPT:
            del m.ended[min(m.ended)]

    def _set_final(self, run: RefitRun, state: int, reason: str) -> None:
        if run.started and not run.seconds:
            run.seconds = time.monotonic() - run.started
        run.state = state
        run.reason = reason
        run.end_events()

    def _record(self, run: RefitRun, state: int, reason: str) -> None:
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
                "barrier_s": max(0.0, run.last_ask - run.first_ask) if run.last_ask else 0.0,
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


def compare_checksums(
    plan: Plan, sent: dict[int, tuple[int, int]], landed: dict[int, tuple[int, int]]
) -> str | None:
    """None when every message's sender and receiver checksums (id -> (slot, checksum))
    agree; else why not, naming the messages, slots and destination tensors (pool, rank,
    name) involved (the first 4 messages)."""
    ids = sent.keys() | landed.keys()
    bad = sorted(i for i in ids if i not in sent or i not in landed or sent[i][1] != landed[i][1])
    if not bad:
        if len(ids) != plan.stats.messages:  # e.g. an agent that does not verify
            return (
                f"checksums of {plan.stats.messages - len(ids)} of {plan.stats.messages} "
                "messages were not reported"
            )
        return None
    lines = []
    for mid in bad[:4]:
        if mid not in sent or mid not in landed:
            side = "sender" if mid not in sent else "receiver"
            slot = (landed.get(mid) or sent[mid])[0]
            lines.append(f"message {mid}: no {side} checksum (other end: slot {slot})")
            continue
        (src_slot, a), (dst_slot, b) = sent[mid], landed[mid]
        program = plan.program(dst_slot)
        tensors = sorted(
            {
                (s.pool, s.rank, s.name)
                for m in program.recvs
                if m.id == mid
                for s in (plan.tensors[c.dst_tensor] for c in m.copies)
            }
        )
        names = ", ".join(f"({p!r}, {r}, {n!r})" for p, r, n in tensors[:8])
        more = f" and {len(tensors) - 8} more" if len(tensors) > 8 else ""
        lines.append(
            f"message {mid} from slot {src_slot} to slot {dst_slot}: sent {a:#018x} != "
            f"landed {b:#018x}; destination tensors (pool, rank, name): {names}{more}"
        )
    extra = f" (and {len(bad) - 4} more messages)" if len(bad) > 4 else ""
    return f"checksum mismatch in {len(bad)} messages{extra}: " + "; ".join(lines)

"""The refit coordinator: one refit per model at a time, coalescing to the newest version.

It composes the pieces of refitd.server.refit (see the package docstring) and serves the
Refit RPC: a trainer rank's request joins a run (scheduler), waits as asked, and the
model's driver thread runs the next run through the attempt lifecycle (or a catch-up).
Every phase has a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.plan.gc_pause import GcPause
from refitd.refit_states import STATE_NAMES
from refitd.server.database import RefitRecord, StateDB
from refitd.server.delta.refits import DeltaRefits
from refitd.server.errors import ControlError, ErrorKind, not_found, precondition
from refitd.server.loop import Signal
from refitd.server.members import Worker
from refitd.server.metrics import ControllerMetrics
from refitd.server.plan_process import FORK_SUPPORT_VAR, PlanningProcess, fork_safe
from refitd.server.planning import PlanCache, PlanOptions
from refitd.server.refit.acks import CommitAckBook
from refitd.server.refit.ahead import PlansAhead
from refitd.server.refit.catchup import CatchUps
from refitd.server.refit.commander import AgentCommander
from refitd.server.refit.events import WorkerEvents
from refitd.server.refit.leases import LeaseWatcher, PausedSettler, RankClaims
from refitd.server.refit.lifecycle import RefitLifecycle
from refitd.server.refit.membership import Memberships
from refitd.server.refit.records import RefitRecords
from refitd.server.refit.run import ModelRefits, RefitRun
from refitd.server.refit.scheduler import Scheduler
from refitd.server.registry import Registry
from refitd.server.streams import AgentHub, EventHub, GatherBoard

log = logging.getLogger("refitd.controller")


@dataclass
class Ask:
    """One Refit call recorded in its run: what it waits for (None: nothing), and until when."""

    m: ModelRefits
    run: RefitRun
    rank: int
    wait: int
    ready: Signal | None
    deadline: float  # monotonic
    waited: float  # the wait it was given, in seconds


class RefitCoordinator:
    """Drives refits over the registry, the agents' command streams and the workers' events."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        db: StateDB,
        metrics: ControllerMetrics,
        store_address: tuple[str, int] | None,
        board: GatherBoard,
        events: EventHub,
        agents: AgentHub,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.plans = PlanCache(settings.plan_cache_size)
        self.delta = DeltaRefits(settings)  # delta refits (docs/delta.md); off by default
        # Plan and program builds of this controller share one pause of the cyclic GC.
        self.gc_pause = GcPause()
        self.plan_options = PlanOptions(
            bucket_bytes=settings.bucket_bytes,
            sender_quantization=settings.sender_quantization,
            relay=settings.relay,
            relay_chain=settings.relay_chain,
            allow_dtype_cast=settings.allow_dtype_cast,
            schedule=settings.plan_schedule,
            transport=settings.transport,
            links=settings.links,
        )
        self._stop = threading.Event()
        self.records = RefitRecords(settings, db, metrics, registry)
        self.scheduler = Scheduler(settings, self.records, self._stop, self._drive)
        # refit plans are built by forked planning processes (plan_process.py)
        self.planner = self._planner(settings)
        self.memberships = Memberships(
            registry, agents, events, self.plans, self.plan_options, self.gc_pause, metrics,
            self.planner, settings.commit_timeout_s, settings.pool_cadence,
        )  # fmt: skip
        self.commander = AgentCommander(
            settings, registry, agents, board, self.delta, store_address, metrics, self.plans
        )
        self.settler = PausedSettler(registry, events, db)
        self.claims = RankClaims(settings, registry, events)
        self.events = WorkerEvents(registry, events, board, self.settler.settle)
        self.acks = CommitAckBook(registry, events, board)
        self.lifecycle = RefitLifecycle(
            settings, metrics, self.scheduler, self.memberships, self.commander, self.events,
            self.acks, self.records, self.delta,
        )  # fmt: skip
        self.catch_ups = CatchUps(
            settings, registry, self.scheduler, self.memberships, self.commander,
            self.events, self.records, self.delta,
        )  # fmt: skip
        self.ahead = PlansAhead(registry, self.scheduler, self.memberships)
        chores = [self.acks.settle, self.settler.settle, self.catch_ups.find]
        if settings.plan_ahead:
            chores.append(self.ahead.find)
        self.leases = LeaseWatcher(
            settings, registry, board, events, agents, self.source_gone, chores
        )
        self.leases.start()

    @staticmethod
    def _planner(settings: Settings) -> PlanningProcess | None:
        """The planning processes, when set and safe (gRPC's fork handlers off)."""
        if not settings.plan_process:
            return None
        if not fork_safe():
            log.warning(
                "refit plans are built in the controller's process: %s is not 0, so a "
                "forked planning process could break gRPC (set it before gRPC is imported)",
                FORK_SUPPORT_VAR,
            )
            return None
        return PlanningProcess(timeout_s=settings.plan_timeout_s)

    @property
    def history(self) -> list[RefitRecord]:
        """The last refits (oldest first), as recorded."""
        return self.records.history

    def stop(self) -> None:
        self._stop.set()
        self.scheduler.stop()
        self.leases.stop()

    def running(self, model: str) -> RefitRun | None:
        return self.scheduler.running(model)

    def pending(self, model: str) -> list[dict[str, object]]:
        """Versions of `model` requested and waiting (for their barrier, or their turn),
        each with the source ranks that asked for it."""
        return self.scheduler.pending(model)

    def source_gone(self, w: Worker, cause: str) -> None:
        """A source rank left: refits of its model in their barrier fail at once."""
        self.scheduler.source_gone(w, cause)

    def settle_paused(self, worker_ids: Iterable[str] | None = None) -> None:
        """Tell ranks re-registered paused by an ended refit how it ended."""
        self.settler.settle(worker_ids)

    # ------------------------------------------------------------------ Refit RPC
    # A Refit call is `ask` (recorded, never blocks long), a wait on `Ask.ready` until
    # `Ask.deadline` (the gRPC handler awaits it on the server's loop), then `answer`.
    def ask(self, worker_id: str, version: int, wait: int, timeout_s: float) -> Ask:
        """A trainer rank asks for `version`: the call recorded in its run, and what it
        waits for (nothing when `Ask.ready` is None: answer at once)."""
        w = self.registry.worker(worker_id)
        if w.role != "source":
            raise precondition(
                f"{w.describe()} is a destination; only source (trainer) ranks call Refit"
            )
        if not w.live:  # NOT_FOUND, as for a heartbeat: its client registers again, asks again
            raise not_found(
                f"{w.describe()} was restored after a controller restart; register again"
            )
        if version <= 0:
            raise ControlError(ErrorKind.INVALID, f"field version must be > 0, got {version}")
        self.registry.renew_worker(w)  # a Refit call renews the lease like a heartbeat
        committed = self.registry.model(w.model).committed_version
        m, run, ready = self.scheduler.join(w, version, committed, wait)
        waited = timeout_s or self.settings.refit_wait_timeout_s
        return Ask(m, run, w.rank, wait, ready, time.monotonic() + waited, waited)

    def woke(self, a: Ask, came: bool) -> pb.RefitResponse | None:
        """After a wait on `a.ready` (`came`: it was set in time): the run's answer now, or
        None when the wake-up was stale (a retry cleared the event): wait again."""
        assert a.ready is not None
        return self.scheduler.woke(a.m, a.run, a.rank, a.ready, came)

    def answer(self, a: Ask, came: bool, response: pb.RefitResponse) -> pb.RefitResponse:
        """The call's answer once its wait ended: DEADLINE when its event did not come;
        with WAIT_SERVED, after the COMMIT acks (this may block until the deadline)."""
        if not came:
            raise ControlError(
                ErrorKind.DEADLINE,
                f"version {a.run.version} of model {a.run.model!r}: still "
                f"{STATE_NAMES[a.run.state]} after {a.waited:g}s; the refit goes on",
            )
        if a.wait == pb.WAIT_SERVED and response.state == pb.REFIT_STATE_COMMITTED:
            response.served, response.message = self.acks.await_served(a.run, a.deadline)
        return response

    # ------------------------------------------------------------------ driver
    def _drive(self, m: ModelRefits) -> None:
        """The model's driver thread: runs its next refit, or a catch-up, until stopped."""
        while not self._stop.is_set():
            with m.cond:
                run = self.scheduler.next_run(m)
                catch_up = run is None and m.catch_up and not m.pending
                if catch_up:
                    m.catch_up = False
                ahead = run is None and not catch_up and m.plan_ahead and not m.pending
                if ahead:
                    m.plan_ahead = False
                m.running = run
            if catch_up or ahead:
                try:
                    (self.catch_ups if catch_up else self.ahead).run(m)
                except Exception:
                    log.exception(
                        "%s of model %s", "catch-up" if catch_up else "plan ahead", m.name
                    )
                continue
            if run is None:
                continue
            try:
                self.lifecycle.execute(run, m)
            except Exception as e:  # a bug must fail the refit, never kill the driver
                log.exception("refit %s of %s crashed", run.version, run.model)
                self.records.finish(m, run, pb.REFIT_STATE_FAILED, f"internal error: {e!r}")
            with m.cond:
                m.running = None

"""Catch-up of restarted destination ranks: the committed version copied into ranks that
registered without it, from inference replicas that serve it (the trainer's memory has
moved on). PAUSE and COMMIT go to the caught-up ranks only; the replicas read from keep
serving. Without a replica that covers the ranks, they get the next version instead."""

from __future__ import annotations

import logging
import time

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.delta.refits import DeltaRefits
from refitd.server.errors import ControlError
from refitd.server.members import Worker
from refitd.server.refit.commander import AgentCommander
from refitd.server.refit.events import WorkerEvents
from refitd.server.refit.membership import Memberships
from refitd.server.refit.records import RefitRecords
from refitd.server.refit.run import ModelRefits, RefitRun
from refitd.server.refit.scheduler import Scheduler
from refitd.server.registry import Registry

log = logging.getLogger("refitd.controller")


class CatchUps:
    """Finds destination ranks behind the committed version and catches them up."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        scheduler: Scheduler,
        memberships: Memberships,
        commander: AgentCommander,
        events: WorkerEvents,
        records: RefitRecords,
        delta: DeltaRefits,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.scheduler = scheduler
        self.memberships = memberships
        self.commander = commander
        self.events = events
        self.records = records
        self.delta = delta
        self._tried: set[tuple[str, float, int]] = set()  # (worker, registered, version)

    def behind(self, model: str) -> tuple[int, list[Worker], list[Worker]]:
        """(committed version, subscribed destination ranks that lack it and were not tried
        yet, live destination ranks that hold it). A rank of a pool on its own cadence
        (pool_every) that holds a version keeps it until the pool's next turn."""
        v, dests = self.registry.live_destinations(model)
        if not dests:
            return v, [], []
        subscribed = self.events.subscribed(w.worker_id for w in dests)
        cadence = self.settings.pool_cadence
        behind = [
            w
            for w in dests
            if w.holds != v
            and (w.holds == 0 or cadence(model, w.pool) == 1)  # a pool on its cadence keeps one
            and w.worker_id in subscribed
            and (w.worker_id, w.registered_at, v) not in self._tried
        ]
        holders = [w for w in dests if w.holds == v]
        return v, behind, holders

    def find(self) -> None:
        """Flag every model with a rank behind: its driver runs the catch-up."""
        for name in self.registry.model_names():
            if self.behind(name)[1]:
                m = self.scheduler.model(name)
                with m.cond:
                    if not m.catch_up:
                        m.catch_up = True
                        m.cond.notify()

    def run(self, m: ModelRefits) -> None:
        """Catch up the model's ranks behind, from the replicas that hold the version."""
        version, behind, holders = self.behind(m.name)
        if not behind:
            return
        for w in behind:
            self._tried.add((w.worker_id, w.registered_at, version))
        who = ", ".join(w.describe() for w in behind)
        model = self.registry.model(m.name)
        # An adapter pool's registered memory is its spare slot, not the version it serves.
        sources = [
            w
            for w in holders
            if all(t.storage == "plain" for t in w.specs) and not model.pools[w.pool].adapter
        ]
        if not sources:
            log.info("%s: no replica holds version %s; caught up by the next refit", who, version)
            return
        ms = self.memberships
        try:
            plan = ms.catch_up_plan(
                m.name,
                model.epoch,
                [w.spec_table() for w in sources],
                [w.spec_table() for w in behind],
            )
        except ControlError as e:
            log.info("%s: catch-up to version %s impossible (%s); next refit", who, version, e)
            return
        try:
            membership = ms.for_catch_up(m.name, model.epoch, plan, behind)
        except ControlError as e:
            log.info("%s: catch-up waits: %s", who, e.message)
            return
        refit_id = self.records.start(m.name, version)
        run = RefitRun(refit_id, m.name, version, "", 0, time.monotonic())
        run.started = run.first_ask
        run.detail["catch_up"] = [w.worker_id for w in behind]
        run.detail["catch_up_plan"] = plan.kind
        paused: set[str] = set()
        wrote = False
        turn = self.commander.turn(m.name)
        try:
            self.commander.prepare(membership)
            self.events.pause(behind, run, self.settings.pause_timeout_s, membership, paused)
            self.records.mark_writing(run)
            with m.cond:
                run.start_transfer({})
            wrote = True
            self.commander.transfer(membership, run, m.cond)
            self.delta.committed(m.name, version, plan.digest, behind, None, how="catch_up")
            self.registry.set_holds(behind, version)
            self.registry.mark_flips(behind)
            self.events.commit(run, behind, None)
            turn.release()
            log.info("%s caught up to version %s from %d replica ranks", who, version, len(sources))
            self.records.finish(m, run, pb.REFIT_STATE_COMMITTED, "")
        except Exception as e:
            turn.release()
            reason = str(e.message if isinstance(e, ControlError) else e)
            self.commander.abort(membership, run, reason)
            kind = pb.EVENT_KIND_INCOMPLETE if wrote else pb.EVENT_KIND_ABORT
            self.events.tell(paused, run, kind, f"catch-up to version {version} failed: {reason}")
            self.records.finish(m, run, pb.REFIT_STATE_FAILED, f"catch-up: {reason}")

"""The attempt lifecycle of one refit: prepare, pause, (barrier), transfer, (apply), commit;
retried after a failure that wrote while it is safe; every failure ends with ABORT or
INCOMPLETE to the paused workers.

Version safety: weights are written in place only after every destination worker acked
PAUSE (a worker without a subscription cannot pause, so the refit does not start). A refit
that fails after writing is retried (`refit_retries` within `refit_retry_budget_s`) while
the pools stay paused, but only while no trainer rank has got control back since its
weights were read (it may be changing them: re-reading would tear the version). Otherwise
the subscribers get INCOMPLETE: their weights must not be served.

Early pause: with `early_pause` the plan, the communicator and the PAUSE handshake are
prepared as soon as the first trainer rank asks, overlapping them with the barrier. Safe
because nothing is written before every rank asked: a barrier that fails sends ABORT.

Staged pools are not paused for the transfer: their tensors land in staging buffers. Once
every slot is DONE they are paused and an ApplyCommand copies staging -> live; a failed
apply is retried from the intact staging within the retry budget, else INCOMPLETE.

Committed = landed in full on every destination pool and recorded in the version log (one
SQLite transaction); COMMIT events then go out and their acks are collected off the
critical path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.database import StateDB
from refitd.server.delta_refits import DeltaRefits
from refitd.server.errors import ControlError
from refitd.server.metrics import ControllerMetrics
from refitd.server.refit.acks import CommitAckBook
from refitd.server.refit.dataplane import DataPlane
from refitd.server.refit.events import WorkerEvents
from refitd.server.refit.membership import Membership, Memberships
from refitd.server.refit.records import RefitRecords
from refitd.server.refit.run import ModelRefits, RefitRun
from refitd.server.refit.scheduler import Scheduler, Switch
from refitd.server.registry import Registry, Worker
from refitd.server.streams import PhaseFailed

log = logging.getLogger("refitd.controller")


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


def failure_reason(e: Exception, run: RefitRun) -> str:
    """The refit's failure reason for an exception raised by one of its phases."""
    if isinstance(e, ControlError):
        return e.message
    if isinstance(e, PhaseFailed):
        return str(e)
    log.exception("refit %s of %s: internal error", run.version, run.model)
    return f"internal error: {e!r}"


class RefitLifecycle:
    """Runs the attempts of one refit to its final state."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        db: StateDB,
        metrics: ControllerMetrics,
        scheduler: Scheduler,
        memberships: Memberships,
        dataplane: DataPlane,
        events: WorkerEvents,
        acks: CommitAckBook,
        records: RefitRecords,
        delta: DeltaRefits,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.db = db
        self.metrics = metrics
        self.scheduler = scheduler
        self.memberships = memberships
        self.dataplane = dataplane
        self.events = events
        self.acks = acks
        self.records = records
        self.delta = delta

    def execute(self, run: RefitRun, m: ModelRefits) -> None:
        """One refit: prepare, pause, (barrier), transfer, commit; retried after a failure
        that wrote while it is safe; failures end with ABORT or INCOMPLETE to the paused."""
        run.started = time.monotonic()
        s = self.settings
        self.metrics.refits_started.labels(run.model).inc()
        self.acks.settle()
        paused: set[str] = set()
        written: dict[str, Worker] = {}  # workers whose live weights may have been written
        retry = RetryBudget()
        while True:
            ms: Membership | None = None
            turn = self.dataplane.turn()
            try:
                if not run.barrier_done and not self.memberships.source_pool_complete(run):
                    # Early pause needs the whole source pool registered; ranks still
                    # registering ask within the barrier timeout, so wait for them first.
                    turn.release()
                    self.scheduler.await_barrier(m, run)
                    turn = self.dataplane.turn()
                ms = self.memberships.for_run(run)
                with m.cond:
                    run.state = pb.REFIT_STATE_SOURCES_READY
                self.dataplane.prepare(ms)
                todo = [w for w in ms.in_place() if w.worker_id not in paused]
                if todo:
                    t = time.monotonic()
                    self.events.pause(todo, run, s.pause_timeout_s, ms, paused)
                    run.detail["pause_s"] = time.monotonic() - t
                if not run.barrier_done:
                    # Other models may use the communicator while this one waits for its
                    # ranks; it is checked (a dict compare) or rebuilt after the barrier.
                    turn.release()
                    self.scheduler.await_barrier(m, run)
                    turn = self.dataplane.turn()
                    ms = self.memberships.for_run(run)
                    self.dataplane.prepare(ms)
                    todo = [w for w in ms.in_place() if w.worker_id not in paused]
                    if todo:  # registered during the barrier: they pause too
                        self.events.pause(todo, run, s.pause_timeout_s, ms, paused)
                self.records.mark_writing(run)
                with m.cond:
                    run.start_transfer(ms.readers)
                written.update((w.worker_id, w) for w in ms.in_place())
                last_done = self.dataplane.transfer(ms, run, m.cond)
                run.detail["transfer_done_at"] = last_done  # monotonic, like executes_sent_at
                if ms.staged_pools:
                    self._apply(ms, run, paused, written)
                turn.release()
                self._commit(m, run, ms, last_done)
                return
            except Switch:
                turn.release()
                self.events.tell(paused, run, pb.EVENT_KIND_ABORT, "a newer version is ready")
                self.scheduler.requeue(m, run)
                return
            except Exception as e:  # every failure ends with ABORT or INCOMPLETE to the paused
                turn.release()
                reason = failure_reason(e, run)
                if ms is not None:
                    self.dataplane.abort(ms, run, reason)
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
                self.events.tell(paused & written.keys(), run, pb.EVENT_KIND_INCOMPLETE, reason)
                self.events.tell(paused - written.keys(), run, pb.EVENT_KIND_ABORT, reason)
                self.records.finish(m, run, pb.REFIT_STATE_FAILED, reason)
                return

    def _apply(
        self, ms: Membership, run: RefitRun, paused: set[str], written: dict[str, Worker]
    ) -> None:
        """Pause the staged pools, then apply (staging -> live) on the slots of their
        workers. A failed apply is sent again (it is idempotent) while within
        refit_retries and refit_retry_budget_s."""
        s = self.settings
        staged = ms.staged()
        todo = [w for w in staged if w.worker_id not in paused]
        t = run.detail["staged_pause_at"] = time.monotonic()
        if todo:
            self.events.pause(todo, run, s.pause_timeout_s, ms, paused)
        run.detail["staged_pause_s"] = time.monotonic() - t
        slots = {w.slot for w in staged}
        written.update((w.worker_id, w) for w in staged)
        until = time.monotonic() + s.refit_retry_budget_s
        tries = 0
        t = time.monotonic()
        while True:
            try:
                self.dataplane.apply(ms, run, slots)
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

    def _commit(self, m: ModelRefits, run: RefitRun, ms: Membership, last_done: float) -> None:
        """LANDED -> version log -> COMMITTED; COMMIT events go out, their acks are settled
        later (off the critical path; Refit calls with WAIT_SERVED wait for them)."""
        ids = [w.worker_id for w in ms.dest_workers]
        gone = set(ids) - self.events.subscribed(ids)
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
        acks = self.acks.open(run, ms.dest_workers, self.settings.commit_timeout_s)
        with m.cond:
            run.commit_acks = acks
            run.set_final(pb.REFIT_STATE_COMMITTED, "")
        self.events.commit(run, ms.dest_workers, acks.gather)
        self.records.record(run, pb.REFIT_STATE_COMMITTED, "")

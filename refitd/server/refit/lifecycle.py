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

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.errors import ControlError
from refitd.server.members import Worker
from refitd.server.metrics import ControllerMetrics
from refitd.server.refit.membership import Membership
from refitd.server.refit.run import CommitAcks, ModelRefits, RefitRun
from refitd.server.refit.scheduler import Switch
from refitd.server.streams import Gather, PhaseFailed

log = logging.getLogger("refitd.controller")


# ---------------------------------------------------------------------- what it depends on
class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The clock of the process."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Turn(Protocol):
    def release(self) -> None: ...


class CommanderPort(Protocol):
    """The agents' side (commander.AgentCommander)."""

    def turn(self, model: str) -> Turn: ...
    def prepare(self, ms: Membership) -> None: ...
    def transfer(self, ms: Membership, run: RefitRun, cond: threading.Condition) -> float: ...
    def apply(self, ms: Membership, run: RefitRun, slots: set[int]) -> None: ...
    def abort(self, ms: Membership, run: RefitRun, reason: str) -> None: ...


class EventSink(Protocol):
    """The destination workers' side (events.WorkerEvents)."""

    def subscribed(self, worker_ids: Iterable[str]) -> set[str]: ...
    def pause(
        self, workers: list[Worker], run: RefitRun, timeout_s: float, ms: Membership,
        acked: set[str],
    ) -> None: ...  # fmt: skip
    def tell(self, worker_ids: set[str], run: RefitRun, kind: int, reason: str) -> None: ...
    def commit(self, run: RefitRun, workers: list[Worker], acks: Gather | None) -> None: ...


class MembershipSource(Protocol):
    """Registry snapshot and plan (membership.Memberships)."""

    def source_pool_complete(self, run: RefitRun) -> bool: ...
    def for_run(self, run: RefitRun) -> Membership: ...


class BarrierPort(Protocol):
    """The barrier of early-started runs (scheduler.Scheduler)."""

    def await_barrier(self, m: ModelRefits, run: RefitRun) -> None: ...
    def requeue(self, m: ModelRefits, run: RefitRun) -> None: ...


class VersionStore(Protocol):
    """Where versions and outcomes are recorded (records.RefitRecords)."""

    def mark_writing(self, run: RefitRun) -> None: ...
    def commit(self, run: RefitRun, epoch: int, workers: list[Worker]) -> None: ...
    def torn(self, workers: Iterable[Worker]) -> None: ...
    def finish(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None: ...
    def record(self, run: RefitRun, state: int, reason: str) -> None: ...


class AckBook(Protocol):
    """COMMIT acks (acks.CommitAckBook)."""

    def open(self, run: RefitRun, workers: list[Worker], timeout_s: float) -> CommitAcks: ...
    def settle(self) -> None: ...


class DeltaBook(Protocol):
    """Delta-refit bookkeeping (delta.refits.DeltaRefits)."""

    def failed(self, model: str, workers: Iterable[Worker]) -> None: ...
    def committed(
        self, model: str, version: int, digest: str, workers: Iterable[Worker],
        density: float | None, how: str = "refit",
    ) -> None: ...  # fmt: skip


# ---------------------------------------------------------------------- the state machine
class Phase(enum.Enum):
    """Where an attempt is. PREPARE -> PAUSE -> (BARRIER -> PREPARE -> PAUSE) -> TRANSFER
    -> (APPLY) -> COMMIT -> COMMITTED; any phase -> RETRY -> PREPARE, or -> FAILED; an
    early-started run whose barrier another version beat -> REQUEUED."""

    PREPARE = "prepare"
    PAUSE = "pause"
    BARRIER = "barrier"
    TRANSFER = "transfer"
    APPLY = "apply"
    COMMIT = "commit"
    RETRY = "retry"
    COMMITTED = "committed"
    FAILED = "failed"
    REQUEUED = "requeued"


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
class Attempts:
    """The state of one refit across its attempts."""

    run: RefitRun
    m: ModelRefits
    turn: Turn
    paused: set[str] = field(default_factory=set)  # workers that acked (or may act on) PAUSE
    written: dict[str, Worker] = field(default_factory=dict)  # live weights maybe written
    retry: RetryBudget = field(default_factory=RetryBudget)
    ms: Membership | None = None
    phase: Phase = Phase.PREPARE


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
        metrics: ControllerMetrics,
        barrier: BarrierPort,
        memberships: MembershipSource,
        commander: CommanderPort,
        events: EventSink,
        acks: AckBook,
        store: VersionStore,
        delta: DeltaBook,
        clock: Clock | None = None,
        on_phase: Callable[[RefitRun, Phase], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.barrier = barrier
        self.memberships = memberships
        self.commander = commander
        self.events = events
        self.acks = acks
        self.store = store
        self.delta = delta
        self.clock = clock or SystemClock()
        self._on_phase = on_phase

    def _enter(self, a: Attempts, phase: Phase) -> None:
        """`a` enters `phase`; the refit's record keeps when (seconds since the refit
        started) each phase was last entered, for the status page and benchmarks."""
        a.phase = phase
        at = a.run.detail.setdefault("phase_at_s", {})
        at[phase.value] = round(self.clock.monotonic() - a.run.started, 4)
        if self._on_phase is not None:
            self._on_phase(a.run, phase)

    def execute(self, run: RefitRun, m: ModelRefits) -> None:
        """One refit: prepare, pause, (barrier), transfer, commit; retried after a failure
        that wrote while it is safe; failures end with ABORT or INCOMPLETE to the paused."""
        run.started = self.clock.monotonic()
        self.metrics.refits_started.labels(run.model).inc()
        self.acks.settle()
        a = Attempts(run, m, self.commander.turn(run.model))
        while self._attempt(a):
            a.turn = self.commander.turn(run.model)

    def _attempt(self, a: Attempts) -> bool:
        """One attempt; True when the refit goes again (the turn is released either way)."""
        a.ms = None
        try:
            self._prepare(a)
            last_done = self._write(a)
            a.turn.release()
            self._enter(a, Phase.COMMIT)
            self._commit(a, last_done)
            self._enter(a, Phase.COMMITTED)
            return False
        except Switch:
            a.turn.release()
            self.events.tell(a.paused, a.run, pb.EVENT_KIND_ABORT, "a newer version is ready")
            self.barrier.requeue(a.m, a.run)
            self._enter(a, Phase.REQUEUED)
            return False
        except Exception as e:  # every failure ends with ABORT or INCOMPLETE to the paused
            a.turn.release()
            return self._failed(a, failure_reason(e, a.run))

    def _prepare(self, a: Attempts) -> None:
        """Membership, plan, communicator and programs ready and the in-place destination
        workers paused, with the barrier passed (waited for here when not yet)."""
        run = a.run
        self._enter(a, Phase.PREPARE)
        if not run.barrier_done and not self.memberships.source_pool_complete(run):
            # Early pause needs the whole source pool registered; ranks still
            # registering ask within the barrier timeout, so wait for them first.
            self._await_barrier(a)
        self._ready(a, timed="pause_s")
        if not run.barrier_done:
            # Other models may use the communicator while this one waits for its
            # ranks; it is checked (a dict compare) or rebuilt after the barrier.
            self._await_barrier(a)
            self._ready(a)  # those registered during the barrier pause too

    def _ready(self, a: Attempts, timed: str = "") -> None:
        """The current Membership prepared on the agents; its in-place workers paused."""
        a.ms = ms = self.memberships.for_run(a.run)
        with a.m.cond:
            a.run.state = pb.REFIT_STATE_SOURCES_READY
        self.commander.prepare(ms)
        todo = [w for w in ms.in_place() if w.worker_id not in a.paused]
        if todo:
            self._enter(a, Phase.PAUSE)
            t = self.clock.monotonic()
            a.run.detail.setdefault("pause_sent_at", t)  # monotonic: the first PAUSE out
            self.events.pause(todo, a.run, self.settings.pause_timeout_s, ms, a.paused)
            # the last PAUSE ack (monotonic): a start that waited for it waited on the ranks
            a.run.detail["paused_at"] = done = self.clock.monotonic()
            if timed:
                a.run.detail[timed] = done - t

    def _await_barrier(self, a: Attempts) -> None:
        """Wait for the barrier without holding the communicator."""
        self._enter(a, Phase.BARRIER)
        a.turn.release()
        self.barrier.await_barrier(a.m, a.run)
        a.turn = self.commander.turn(a.run.model)

    def _write(self, a: Attempts) -> float:
        """Transfer (and apply staged pools); returns the time of the last DONE."""
        run, ms = a.run, a.ms
        assert ms is not None
        self._enter(a, Phase.TRANSFER)
        self.store.mark_writing(run)
        with a.m.cond:
            run.start_transfer(ms.readers)
        a.written.update((w.worker_id, w) for w in ms.in_place())
        last_done = self.commander.transfer(ms, run, a.m.cond)
        run.detail["transfer_done_at"] = last_done  # monotonic, like executes_sent_at
        if ms.staged_pools:
            self._enter(a, Phase.APPLY)
            self._apply(a, ms)
        return last_done

    def _failed(self, a: Attempts, reason: str) -> bool:
        """After a failed attempt: abort it; go again when allowed, else FAILED with
        ABORT (untouched) or INCOMPLETE (maybe written) to the paused workers."""
        run, s = a.run, self.settings
        if a.ms is not None:
            self.commander.abort(a.ms, run, reason)
        if a.written:
            self.delta.failed(run.model, a.written.values())  # torn: the retry is dense
            if a.retry.first_error == "":
                a.retry.first_error = reason
                a.retry.until = self.clock.monotonic() + s.refit_retry_budget_s
            if self._retry(a, reason):
                self._enter(a, Phase.RETRY)
                return True
            reason = a.retry.explain(run, reason, s.refit_retries)
        self.store.torn(a.written.values())  # torn: not the source of a catch-up
        self.events.tell(a.paused & a.written.keys(), run, pb.EVENT_KIND_INCOMPLETE, reason)
        self.events.tell(a.paused - a.written.keys(), run, pb.EVENT_KIND_ABORT, reason)
        self.store.finish(a.m, run, pb.REFIT_STATE_FAILED, reason)
        self._enter(a, Phase.FAILED)
        return False

    def _require_subscribed(self, ms: Membership) -> None:
        """Every destination worker of the refit still subscribed, or PhaseFailed naming
        those that are not (a version lands in every pool of the model or in none)."""
        ids = [w.worker_id for w in ms.dest_workers]
        gone = set(ids) - self.events.subscribed(ids)
        if gone:
            raise PhaseFailed(
                f"destination workers {sorted(gone)} lost their subscription during the transfer"
            )

    def _apply(self, a: Attempts, ms: Membership) -> None:
        """Pause the staged pools, then apply (staging -> live) on the slots of their
        workers, unless a destination worker of another pool was lost meanwhile (the
        staged pools then keep their live weights). A failed apply is sent again (it is
        idempotent) while within refit_retries and refit_retry_budget_s."""
        s, run, clock = self.settings, a.run, self.clock
        staged = ms.staged()
        todo = [w for w in staged if w.worker_id not in a.paused]
        t = run.detail["staged_pause_at"] = clock.monotonic()
        if todo:
            self.events.pause(todo, run, s.pause_timeout_s, ms, a.paused)
        run.detail["staged_pause_s"] = clock.monotonic() - t
        self._require_subscribed(ms)
        slots = {w.slot for w in staged}
        a.written.update((w.worker_id, w) for w in staged)
        until = clock.monotonic() + s.refit_retry_budget_s
        tries = 0
        t = clock.monotonic()
        while True:
            try:
                self.commander.apply(ms, run, slots)
                run.detail["apply_s"] = clock.monotonic() - t
                return
            except PhaseFailed as e:
                tries += 1
                if tries > s.refit_retries or clock.monotonic() >= until:
                    raise PhaseFailed(f"{e} (apply tried {tries} times)") from e
                log.warning(
                    "refit %s of %s: apply failed (%s); applying again from staging",
                    run.version,
                    run.model,
                    e,
                )
                clock.sleep(0.2)

    def _retry(self, a: Attempts, reason: str) -> bool:
        """After a failure that may have written: go again (pools stay paused) when it is
        safe (no trainer rank got control back: the sources are unchanged) and within the
        budget. A failure before the transfer of a retry (the lost member is not back yet)
        waits a little and does not count as an attempt."""
        run, retry = a.run, a.retry
        transferring = run.state == pb.REFIT_STATE_TRANSFERRING
        with a.m.cond:
            retry.safe = not run.handed_back
            go = (
                retry.safe
                and self.clock.monotonic() < retry.until
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
            self.clock.sleep(0.2)
        return True

    def _commit(self, a: Attempts, last_done: float) -> None:
        """LANDED -> version log -> COMMITTED; COMMIT events go out, their acks are settled
        later (off the critical path; Refit calls with WAIT_SERVED wait for them)."""
        run, ms, clock = a.run, a.ms, self.clock
        assert ms is not None
        self._require_subscribed(ms)
        run.state = pb.REFIT_STATE_LANDED
        run.seconds = clock.monotonic() - run.started
        self.store.commit(run, ms.epoch, ms.dest_workers)
        density = (run.detail.get("delta") or {}).get("density")
        self.delta.committed(run.model, run.version, ms.plan.digest, ms.dest_workers, density)
        run.detail["control_end_s"] = clock.monotonic() - last_done
        # The acks are awaited from the start (WAIT_SERVED callers wait on them from the
        # moment the run is COMMITTED), the events go out right after.
        acks = self.acks.open(run, ms.dest_workers, self.settings.commit_timeout_s)
        with a.m.cond:
            run.commit_acks = acks
            run.set_final(pb.REFIT_STATE_COMMITTED, "")
        self.events.commit(run, ms.dest_workers, acks.gather)
        self.store.record(run, pb.REFIT_STATE_COMMITTED, "")

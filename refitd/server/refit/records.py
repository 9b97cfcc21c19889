"""How refits end: the final state set under the model's cond (waiters wake first), then
the history row (SQLite and the in-memory history of the status page) and the metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.refit_states import STATE_NAMES
from refitd.server.database import RefitRecord, StateDB
from refitd.server.members import Worker
from refitd.server.metrics import ControllerMetrics
from refitd.server.refit.run import ModelRefits, RefitRun
from refitd.server.registry import Registry

log = logging.getLogger("refitd.controller")


class RefitRecords:
    """Final states of runs, the version log, the refit history and the refit metrics of
    one controller."""

    def __init__(
        self, settings: Settings, db: StateDB, metrics: ControllerMetrics, registry: Registry
    ) -> None:
        self.settings = settings
        self.db = db
        self.metrics = metrics
        self.registry = registry
        for refit_id in db.interrupt_unfinished("the controller restarted during the refit"):
            log.warning("refit %s was interrupted by a controller restart: failed", refit_id)
        self.history: list[RefitRecord] = list(reversed(db.refits(settings.history_size)))

    def start(self, model: str, version: int) -> int:
        """A new refit row (state requested); returns its refit id."""
        return self.db.start_refit(model, version, "requested")

    def mark_writing(self, run: RefitRun) -> None:
        """Persisted before the first write: a controller restarted mid-refit then knows the
        ranks it paused may hold torn weights (INCOMPLETE) rather than untouched ones."""
        if not run.detail.get("wrote"):
            run.detail["wrote"] = True
            self.db.mark_refit(run.refit_id, "transferring")

    def commit(self, run: RefitRun, epoch: int, workers: list[Worker]) -> None:
        """`run`'s version landed in full in `workers`: logged (one SQLite transaction) and
        made the model's committed version, which the workers now hold."""
        self.db.commit_version(run.model, run.version, run.refit_id, run.bytes, run.seconds, epoch)
        self.registry.set_committed(run.model, run.version)
        self.registry.set_holds(workers, run.version)
        self.registry.mark_flips(workers)

    def torn(self, workers: Iterable[Worker]) -> None:
        """The weights of `workers` may be torn: none can be the source of a catch-up."""
        self.registry.set_holds(workers, 0)

    def finish(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        """Final state: waiters wake first, then the history row and metrics are written."""
        with m.cond:
            ended = m.end(run, state, reason)
        if ended:
            self.record(run, state, reason)

    def end(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        """Record a final state (caller holds the model's cond) and wake its waiters."""
        if m.end(run, state, reason):
            self.record(run, state, reason)

    def record(self, run: RefitRun, state: int, reason: str) -> None:
        """The history row of an ended run, and its metrics."""
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
        self._count(run, state, reason)

    def _count(self, run: RefitRun, state: int, reason: str) -> None:
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

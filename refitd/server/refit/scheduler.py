"""The barrier and coalescing: which version of a model runs next.

A refit transfers once every rank of the source pool has asked for its version (a barrier
with a timeout). While one runs for a model, newer requests wait; when it ends only the
newest fully-requested version runs and every older pending version returns SUPERSEDED.
One outcome per attempt: a failed or superseded run stays the answer for its version until
every rank of the source pool was told it; the next ask for that version starts a new run.
Each model has one driver thread; Refit calls only record requests and wait on a Signal of
the run they joined (no polling, no spurious wake-ups).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.errors import precondition
from refitd.server.loop import Signal
from refitd.server.members import Worker
from refitd.server.refit.records import RefitRecords
from refitd.server.refit.run import ModelRefits, RefitRun
from refitd.server.streams import PhaseFailed


class Switch(Exception):
    """An early-started run must yield to another version whose barrier completed first."""


class Scheduler:
    """The models' request books and driver threads; picks each model's next run."""

    def __init__(
        self,
        settings: Settings,
        records: RefitRecords,
        stop: threading.Event,
        drive: Callable[[ModelRefits], None],
    ) -> None:
        self.settings = settings
        self.records = records
        self._stop = stop
        self._drive = drive
        self._models: dict[str, ModelRefits] = {}
        self._lock = threading.Lock()

    def model(self, name: str) -> ModelRefits:
        """The model's book, created with its driver thread on first use."""
        with self._lock:
            m = self._models.get(name)
            if m is None:
                m = self._models[name] = ModelRefits(name)
                m.driver = threading.Thread(
                    target=self._drive, args=(m,), name=f"refit-{name}", daemon=True
                )
                m.driver.start()
            return m

    def get(self, name: str) -> ModelRefits | None:
        with self._lock:
            return self._models.get(name)

    def models(self) -> list[ModelRefits]:
        with self._lock:
            return list(self._models.values())

    def stop(self) -> None:
        """Wake every driver (the stop event is set) and join them."""
        models = self.models()
        for m in models:
            with m.cond:
                m.cond.notify_all()
        for m in models:
            if m.driver is not None:
                m.driver.join(timeout=5)

    def running(self, model: str) -> RefitRun | None:
        m = self.get(model)
        return m.running if m else None

    def pending(self, model: str) -> list[dict[str, object]]:
        """Versions of `model` requested and waiting (for their barrier, or their turn),
        each with the source ranks that asked for it."""
        m = self.get(model)
        if m is None:
            return []
        with m.cond:
            return [
                {"version": v, "asked": sorted(r.asked), "pool_size": r.pool_size}
                for v, r in sorted(m.pending.items())
            ]

    # ------------------------------------------------------------------ requests
    def join(
        self, w: Worker, version: int, committed: int, wait: int
    ) -> tuple[ModelRefits, RefitRun, Signal | None]:
        """Record source rank `w`'s ask for `version` (a new run, or the one pending or
        running); returns the run and the event to wait on (None: answer at once)."""
        m = self.model(w.model)
        with m.cond:
            running = m.running
            run = running if running and running.version == version and not running.final else None
            if version <= committed:
                raise precondition(
                    f"version {version} of model {w.model!r} is not newer than the committed "
                    f"version {committed}"
                )
            ended = m.ended.get(version)
            if ended is not None and not ended.all_told:
                # One outcome per attempt: a rank asking late gets the ended run's outcome.
                ended.told.add(w.rank)
                return m, ended, None
            if ended is not None:  # every rank was told: this ask starts a new attempt
                del m.ended[version]
            if run is None and m.running is not None and version < m.running.version:
                raise precondition(
                    f"version {version} of model {w.model!r} is older than the running "
                    f"version {m.running.version}"
                )
            if run is None:
                run = m.pending.get(version)
                if run is None:
                    refit_id = self.records.start(w.model, version)
                    run = RefitRun(
                        refit_id, w.model, version, w.pool, w.pool_size, time.monotonic()
                    )
                    m.pending[version] = run
            run.asked.add(w.rank)
            run.last_ask = time.monotonic()
            m.cond.notify()  # the driver is the only waiter on m.cond
            if wait == pb.WAIT_ACCEPTED:
                run.handed_back = True
                return m, run, None
            final = wait in (pb.WAIT_COMMITTED, pb.WAIT_SERVED)
            return m, run, run.finished if final else run.rank_event(w.rank)

    @staticmethod
    def woke(
        m: ModelRefits, run: RefitRun, rank: int, ready: Signal, came: bool
    ) -> pb.RefitResponse | None:
        """After a wait on `ready` (`came`: it was set in time): the run's answer now, with
        source rank `rank` counted as told when that answer is the final state; None when
        the wake-up was stale: a retry clears the rank events (under m.cond) before
        re-reading sources, so a waiter woken just before that waits again."""
        with m.cond:
            if ready.is_set() or run.final or not came:
                if run.final:
                    run.told.add(rank)
                else:
                    run.handed_back = True
                return run.response()
            return None

    # ------------------------------------------------------------------ next run
    def next_run(self, m: ModelRefits) -> RefitRun | None:
        """Under m.cond: the version to run now, after timing out and superseding; or wait.

        The newest fully-requested version runs; with early_pause, when none is, the newest
        requested one starts its preparation and waits for its barrier in the lifecycle.
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
            if not m.catch_up and not m.plan_ahead:
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
                self.records.end(m, run, pb.REFIT_STATE_FAILED, self.barrier_reason(run))

    def barrier_reason(self, run: RefitRun) -> str:
        return (
            f"ranks {run.missing_ranks()} of pool {run.source_pool} never asked for version "
            f"{run.version} (barrier timeout {self.settings.barrier_timeout_s:g}s)"
        )

    def _supersede_older(self, m: ModelRefits, run: RefitRun) -> None:
        for older in [r for r in m.pending.values() if r.version < run.version]:
            del m.pending[older.version]
            self.records.end(
                m,
                older,
                pb.REFIT_STATE_SUPERSEDED,
                f"coalesced into version {run.version} (a newer version was requested "
                "while a refit ran)",
            )

    def requeue(self, m: ModelRefits, run: RefitRun) -> None:
        """An early-started run that yielded (Switch) waits again for its turn."""
        with m.cond:
            run.state = pb.REFIT_STATE_REQUESTED
            m.pending[run.version] = run

    # ------------------------------------------------------------------ barrier
    def source_gone(self, w: Worker, cause: str) -> None:
        """A source rank left (lease expired, or unregistered): every refit of its model
        still in its barrier fails at once, naming it, instead of at the barrier timeout.
        Pending runs end here; the running one (early pause) fails in await_barrier."""
        if w.role != "source":
            return
        m = self.get(w.model)
        if m is None:
            return
        with m.cond:
            waiting = [r for r in m.pending.values() if not r.barrier_done]
            if m.running is not None and not m.running.barrier_done:
                waiting.append(m.running)
            for run in waiting:
                if run.source_pool != w.pool or run.final:
                    continue
                run.lost = (
                    f"{w.describe()} {cause} while version {run.version} waited in its "
                    f"barrier (ranks {run.missing_ranks()} of pool {run.source_pool} had not "
                    "asked)"
                )
                if m.pending.get(run.version) is run:
                    del m.pending[run.version]
                    self.records.end(m, run, pb.REFIT_STATE_FAILED, run.lost)
            m.cond.notify_all()

    def await_barrier(self, m: ModelRefits, run: RefitRun) -> None:
        """Wait until every source rank asked for the early-started run; raise Switch when
        another pending version completes its barrier first, PhaseFailed at the timeout."""
        deadline = run.first_ask + self.settings.barrier_timeout_s
        with m.cond:
            while not run.barrier_done:
                if run.lost:
                    raise PhaseFailed(run.lost)
                if any(r.barrier_done for r in m.pending.values()):
                    raise Switch()
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise PhaseFailed(self.barrier_reason(run))
                m.cond.wait(left)
            if any(r.barrier_done and r.version > run.version for r in m.pending.values()):
                raise Switch()

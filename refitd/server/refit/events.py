"""Version events to destination workers over their Subscribe streams: PAUSE (waited for
every ack), COMMIT (acks collected off the critical path), ABORT (resume: weights
untouched) and INCOMPLETE (weights may be torn: do not serve)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from refitd._proto import refitd_pb2 as pb
from refitd.server.errors import ControlError
from refitd.server.members import Worker
from refitd.server.refit.membership import Membership
from refitd.server.refit.run import RefitRun
from refitd.server.registry import Registry
from refitd.server.streams import EventHub, Gather, GatherBoard, PhaseFailed


def version_event(run: RefitRun, kind: int, pool: str, reason: str = "") -> pb.VersionEvent:
    return pb.VersionEvent(
        kind=kind,
        model=run.model,
        pool=pool,
        version=run.version,
        reason=reason,
        refit_id=run.refit_id,
    )


class WorkerEvents:
    """Sends a refit's version events to its destination workers."""

    def __init__(
        self,
        registry: Registry,
        hub: EventHub,
        board: GatherBoard,
        settle_paused: Callable[[Iterable[str]], None],
    ) -> None:
        self.registry = registry
        self.hub = hub
        self.board = board
        self._settle_paused = settle_paused

    def subscribed(self, worker_ids: Iterable[str]) -> set[str]:
        return set(self.hub.subscribed(worker_ids))

    def tell(self, worker_ids: set[str], run: RefitRun, kind: int, reason: str) -> None:
        """Tell paused workers how the refit ended (ABORT: resume; INCOMPLETE: do not serve)."""
        for wid in sorted(worker_ids):
            try:
                w = self.registry.worker(wid)
            except ControlError:
                continue  # gone meanwhile
            self.registry.told_outcome(w, run.refit_id)  # settle_paused has nothing to say
            self.hub.send(wid, version_event(run, kind, w.pool, reason), None)

    def pause(
        self, workers: list[Worker], run: RefitRun, timeout_s: float, ms: Membership,
        acked: set[str],
    ) -> None:  # fmt: skip
        """Send PAUSE to the destination workers and wait for all their acks; those that
        acked are added to `acked` (even when the phase fails: they did pause)."""
        # An earlier refit's answer goes first on the stream.
        self._settle_paused([w.worker_id for w in workers])
        g = Gather(f"pause of version {run.version}")
        g.watch = ms.members
        gid = self.board.add(g)
        sent: list[str] = []
        try:
            for w in workers:
                if not self.hub.send(
                    w.worker_id, version_event(run, pb.EVENT_KIND_PAUSE, w.pool), g
                ):
                    raise PhaseFailed(f"{w.describe()} is not subscribed: it cannot pause")
                sent.append(w.worker_id)
            g.wait(timeout_s)
        finally:
            with g.cond:
                pending = set(g.pending)
            # A worker that was sent PAUSE may pause even if it acks late: tell it the end.
            acked.update(w for w in sent if w not in pending or g.failure is not None)
            self.hub.forget(g)
            self.board.remove(gid)

    def commit(self, run: RefitRun, workers: list[Worker], acks: Gather | None) -> None:
        """COMMIT to each worker (its ack counted in `acks` when given); a worker without
        a subscription is counted lost."""
        for w in workers:
            self.registry.told_outcome(w, run.refit_id)
            ev = version_event(run, pb.EVENT_KIND_COMMIT, w.pool)
            if not self.hub.send(w.worker_id, ev, acks) and acks is not None:
                acks.lose(w.worker_id, f"{w.describe()} lost its subscription before its COMMIT")

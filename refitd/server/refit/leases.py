"""Leases: workers and agents silent for heartbeat_timeout_s expire; a rank held by a live
worker cannot be registered by a second process; ranks that re-registered while paused by
an ended refit are told its outcome. The watcher thread also settles COMMIT acks and looks
for ranks to catch up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.database import StateDB
from refitd.server.errors import ControlError
from refitd.server.members import Worker
from refitd.server.registry import Registry, rank_taken
from refitd.server.registry.registration import process_id
from refitd.server.streams import AgentHub, EventHub, GatherBoard

log = logging.getLogger("refitd.controller")


class PausedSettler:
    """Tells ranks that re-registered paused by an ended refit how it ended."""

    def __init__(self, registry: Registry, hub: EventHub, db: StateDB) -> None:
        self.registry = registry
        self.hub = hub
        self.db = db

    def settle(self, worker_ids: Iterable[str] | None = None) -> None:
        """Tell subscribed ranks that re-registered while paused by a refit that has ended
        (a controller restart, or a lease lost mid-refit) how it ended: COMMIT when its
        version landed, ABORT when nothing was written, INCOMPLETE when weights may be torn
        (or the refit is unknown). Refits still running here are settled when they end."""
        waiting = self.registry.paused_workers(worker_ids)
        if not waiting:
            return
        subscribed = set(self.hub.subscribed(w.worker_id for w in waiting))
        for w in waiting:
            rid = w.paused_in
            if w.worker_id not in subscribed:
                continue
            outcome = self.db.refit_outcome(rid)
            if outcome is not None and outcome.state not in ("committed", "failed", "superseded"):
                continue  # still running: it tells its paused ranks itself
            ev = pb.VersionEvent(model=w.model, pool=w.pool, refit_id=rid)
            holds: int | None = None
            if outcome is None:
                ev.kind = pb.EVENT_KIND_INCOMPLETE
                ev.reason = f"refit {rid} is unknown here: weights written during it are untrusted"
            elif outcome.state == "committed":
                ev.kind, ev.version = pb.EVENT_KIND_COMMIT, outcome.version
                holds = outcome.version  # landed in full; a catch-up follows if it is older
            else:
                ev.version = outcome.version
                ev.kind = pb.EVENT_KIND_INCOMPLETE if outcome.wrote else pb.EVENT_KIND_ABORT
                ev.reason = f"refit {rid} of version {outcome.version} failed: {outcome.reason}"
            self.registry.told_outcome(w, rid, holds)
            log.warning(
                "%s re-registered paused by refit %s: sent %s",
                w.describe(),
                rid,
                pb.EventKind.Name(ev.kind),
            )
            self.hub.send(w.worker_id, ev, None)


class RankClaims:
    """Whether a registration may take a rank another worker holds: the same worker again
    (its client re-registering) or a restored one may; a new process may once the holder is
    gone. Gone is proven at once by a registrant on the holder's host that found no process
    of the holder's pid and start time there (`predecessor`); a registrant that could look
    the holder up but has not is refused at once with the holder named, so it can. Otherwise
    gone means subscription closed and heartbeats stopped, or lease expired. A holder that
    is alive is named in the refusal."""

    def __init__(self, settings: Settings, registry: Registry, events: EventHub) -> None:
        self.settings = settings
        self.registry = registry
        self.events = events

    @property
    def silence_s(self) -> float:
        """How long a holder must be silent for its heartbeats to count as stopped: two
        heartbeat periods and a second for a loaded host, at most the lease."""
        s = self.settings
        return min(s.heartbeat_timeout_s, 2 * s.heartbeat_period_s + 1.0)

    def replaced(self, holder: Worker, req: pb.RegisterWorkerRequest) -> str:
        """The id of `holder`, a live worker of another identity holding `req`'s rank, when
        it is gone (this registration replaces it). A holder whose subscription is open, or
        that renews its lease within `silence_s` of when it was last heard, is alive:
        FAILED_PRECONDITION naming it. Waits at most `silence_s` (outside the registry lock),
        unless the registrant can look the holder up on its own host."""
        if self._proven_gone(holder, req):
            return holder.worker_id
        seen = holder.last_seen
        gone = (
            not self.events.subscribed([holder.worker_id])
            and not self.registry.renewed(holder, seen, seen + self.silence_s)
            and not self.events.subscribed([holder.worker_id])  # nor subscribed meanwhile
        )
        if gone:
            return holder.worker_id
        if self.events.subscribed([holder.worker_id]):
            raise rank_taken(holder, req, "its subscription is open")
        heard = time.monotonic() - holder.last_seen
        raise rank_taken(holder, req, f"it renewed its lease {heard:.1f}s ago")

    def must_name(self, holder: Worker, req: pb.RegisterWorkerRequest) -> None:
        """Refuse at once, naming `holder`, a registrant that names no predecessor but could
        look the holder up on its own host: checked before the tensors are validated, as
        the registrant registers again (naming it) once it found it gone."""
        if not req.HasField("predecessor"):
            self._proven_gone(holder, req)

    @staticmethod
    def _proven_gone(holder: Worker, req: pb.RegisterWorkerRequest) -> bool:
        """True when the registrant, on the holder's boot and pid namespace, names the
        holder's process as its predecessor (it found it gone). A registrant that could
        look it up but names none is refused with the holder named; False for the others
        (another host, or a client without a process identity): the controller waits."""
        if not req.HasField("process") or holder.process is None:
            return False
        registrant = process_id(req.process)
        if not registrant.sees(holder.process):
            return False
        if req.HasField("predecessor") and process_id(req.predecessor) == holder.process:
            log.warning(
                "%s replaced: its process (pid %d on host %r) was found gone there by the "
                "new one (pid %d)",
                holder.describe(),
                holder.pid,
                holder.host,
                registrant.pid,
            )
            return True
        raise rank_taken(
            holder,
            req,
            "it ran on this process's host and pid namespace; once it is gone there, a "
            "registration naming it predecessor takes the rank",
            named=True,
        )


class LeaseWatcher:
    """The thread expiring silent workers and agents, and running the periodic chores."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        board: GatherBoard,
        events: EventHub,
        agents: AgentHub,
        source_gone: Callable[[Worker, str], None],
        chores: list[Callable[[], None]],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.board = board
        self.events = events
        self.agents = agents
        self._source_gone = source_gone
        self._chores = chores
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="refit-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        """Expire workers and agents silent for heartbeat_timeout_s; run the chores."""
        s = self.settings
        period = min(s.heartbeat_period_s, s.heartbeat_timeout_s / 4, 0.5)
        while not self._stop.wait(period):
            try:
                self.expire(time.monotonic() - s.heartbeat_timeout_s)
                for chore in self._chores:
                    if self._stop.is_set():  # the database closes once stop returns
                        break
                    chore()
            except Exception:
                log.exception("lease watcher")

    def expire(self, cutoff: float) -> None:
        """Unregister workers and drop agents last seen before `cutoff` (monotonic); a
        stopped watcher leaves the rest as they are (thousands of workers going silent at
        a shutdown would otherwise outlast stop's join and write to a closed database)."""
        timeout = self.settings.heartbeat_timeout_s
        reg = self.registry
        workers, agents = reg.silent(cutoff)
        # An open Subscribe stream is a lease of its own (gRPC keepalive watches it).
        streaming = set(self.events.subscribed(w.worker_id for w in workers))
        workers = [w for w in workers if w.worker_id not in streaming]
        agents = [a for a in agents if self.agents.connected(a.agent_id)]
        # Again: a stream opened (or a re-registration) meanwhile renews it.
        agents = reg.still_silent([a.agent_id for a in agents], cutoff)
        for w in workers:
            if self._stop.is_set():
                return
            if w.last_seen >= cutoff:  # a heartbeat came in meanwhile
                continue
            reason = f"{w.describe()} missed its heartbeats for {timeout:g}s (lease expired)"
            log.warning("%s; unregistering it", reason)
            try:
                reg.unregister_worker(w.worker_id)
            except ControlError:
                continue
            self.board.member_gone(w.worker_id, reason)
            self._source_gone(w, f"missed its heartbeats for {timeout:g}s (lease expired)")
        for a in agents:
            if self._stop.is_set():
                return
            reason = (
                f"agent {a.agent_id} on host {a.host!r} missed its heartbeats for {timeout:g}s "
                "(lease expired)"
            )
            log.warning("%s", reason)
            self.agents.drop(a.agent_id, reason)

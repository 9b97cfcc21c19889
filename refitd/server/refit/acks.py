"""COMMIT acks: collected after a commit, off the critical path. A refused or missing ack
is logged and counted; the version stays committed. Refit calls with WAIT_SERVED wait for
them (`await_served`)."""

from __future__ import annotations

import logging
import threading
import time

from refitd.server.errors import ControlError
from refitd.server.members import Worker
from refitd.server.refit.run import CommitAcks, RefitRun
from refitd.server.registry import Registry
from refitd.server.streams import AckTally, EventHub, GatherBoard

log = logging.getLogger("refitd.controller")


class CommitAckBook:
    """The COMMIT ack tallies of recent commits until they settle."""

    def __init__(self, registry: Registry, hub: EventHub, board: GatherBoard) -> None:
        self.registry = registry
        self.hub = hub
        self.board = board
        self._open: list[CommitAcks] = []
        self._lock = threading.Lock()

    def open(self, run: RefitRun, workers: list[Worker], timeout_s: float) -> CommitAcks:
        """A tally awaiting the COMMIT ack of each of `workers`."""
        g = AckTally(f"commit of version {run.version}")
        for w in workers:
            g.pending.add(w.worker_id)
            g.members[w.worker_id] = w.worker_id
        acks = CommitAcks(
            g, self.board.add(g), run.version, time.monotonic() + timeout_s, timeout_s
        )
        with self._lock:
            self._open.append(acks)
        return acks

    def settle(self) -> None:
        """Forget COMMIT ack gathers that completed or passed their deadline, logging the
        workers that refused or never acked (the version stays committed)."""
        now = time.monotonic()
        with self._lock:
            due = [a for a in self._open if a.gather.done or now >= a.deadline]
            self._open = [a for a in self._open if a not in due]
        for acks in due:
            g = acks.gather
            self.hub.forget(g)
            self.board.remove(acks.gid)
            with g.cond:
                why = [*g.failed.values(), *(f"no ack from worker {k}" for k in sorted(g.pending))]
            if why:
                log.warning("version %s: COMMIT not acknowledged: %s", acks.version, "; ".join(why))

    def await_served(self, run: RefitRun, deadline: float) -> tuple[bool, str]:
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

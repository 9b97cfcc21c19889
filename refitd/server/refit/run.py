"""One refit run of one model: its states, rank events and attempt ids.

requested -> sources ready -> transferring -> landed -> committed, or failed with a reason
(superseded for versions coalesced into a newer one). A RefitRun lives from the first Refit
call asking for its version to its final state; ModelRefits holds the requests and the
running refit of one model, guarded by its condition (the model's driver waits on it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from refitd._proto import refitd_pb2 as pb
from refitd.server.loop import Signal
from refitd.server.streams import AckTally

FINAL = (pb.REFIT_STATE_COMMITTED, pb.REFIT_STATE_FAILED, pb.REFIT_STATE_SUPERSEDED)
OUTCOMES_KEPT = 256  # ended versions remembered per model (one outcome per attempt)
ATTEMPT_SHIFT = 40  # execute/abort ids: refit_id | attempt << 40 (a retry is a new attempt)


def attempt_id(refit_id: int, attempt: int) -> int:
    """Id of one attempt of a refit, carried by ExecuteCommand/AbortCommand.refit_id."""
    return refit_id | attempt << ATTEMPT_SHIFT


@dataclass
class CommitAcks:
    """COMMIT acks collected after a commit, off the critical path (waited for only by
    Refit calls with WAIT_SERVED)."""

    gather: AckTally
    gid: int
    version: int
    deadline: float
    timeout_s: float


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
    told: set[int] = field(default_factory=set)  # source ranks given its final state
    state: int = pb.REFIT_STATE_REQUESTED
    reason: str = ""
    readers: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> slots
    slot_ranks: dict[int, list[int]] = field(default_factory=dict)  # slot -> ranks it reads
    unread: dict[int, int] = field(default_factory=dict)  # rank -> reader slots not released
    released: set[int] = field(default_factory=set)
    rank_read: dict[int, Signal] = field(default_factory=dict)
    finished: Signal = field(default_factory=Signal)
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

    @property
    def all_told(self) -> bool:
        """Every rank of the source pool got this run's final state (an ended run is then
        no longer the answer for its version: asking again starts a new run)."""
        return self.final and self.told.issuperset(range(self.pool_size))

    def missing_ranks(self) -> list[int]:
        """Source ranks that have not asked for this version yet."""
        return sorted(set(range(self.pool_size)) - self.asked)

    def rank_event(self, rank: int) -> Signal:
        ev = self.rank_read.get(rank)
        if ev is None:
            ev = self.rank_read[rank] = Signal()
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

    def set_final(self, state: int, reason: str) -> None:
        """Enter a final state and wake every waiter (caller holds the model's cond)."""
        if self.started and not self.seconds:
            self.seconds = time.monotonic() - self.started
        self.state = state
        self.reason = reason
        self.end_events()

    def response(self) -> pb.RefitResponse:
        return pb.RefitResponse(
            version=self.version,
            state=self.state,
            message=self.reason,
            seconds=self.seconds,
            bytes=self.bytes,
        )


@dataclass
class ModelRefits:
    """Requests and the running refit of one model; `cond` guards both (the driver waits)."""

    name: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, RefitRun] = field(default_factory=dict)
    running: RefitRun | None = None
    driver: threading.Thread | None = None
    catch_up: bool = False  # a destination rank lacks the committed version
    plan_ahead: bool = False  # the membership settled: build the next plan while idle
    # Failed and superseded runs by version (newest OUTCOMES_KEPT): a rank asking for the
    # version before every rank of the pool was told the outcome gets that outcome; once
    # every rank was told, asking again starts a new run (a retry of the version).
    ended: dict[int, RefitRun] = field(default_factory=dict)

    def end(self, run: RefitRun, state: int, reason: str) -> bool:
        """Give `run` its final state and remember it (caller holds cond); False when it
        had one already (the first final state stands)."""
        if run.final:
            return False
        run.set_final(state, reason)
        self.remember(run)
        return True

    def remember(self, run: RefitRun) -> None:
        """Keep a failed or superseded run's outcome (caller holds cond); a committed one
        needs no entry: asking for its version again is refused as not newer than committed."""
        if run.state == pb.REFIT_STATE_COMMITTED:
            return
        self.ended[run.version] = run
        while len(self.ended) > OUTCOMES_KEPT:
            del self.ended[min(self.ended)]

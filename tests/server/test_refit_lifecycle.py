"""The attempt lifecycle of a refit as a state machine, without gRPC or processes.

RefitLifecycle depends on small interfaces (refit/lifecycle.py); here they are in-memory
implementations scripted to answer, fail, time out or lose a member, next to the real
pieces that need no process (Scheduler for the barrier, Gather/GatherBoard for a phase
that loses a member, DeltaRefits, a real plan of a tiny model). Every test asserts what
changed: the run's state and reason, the events each worker was sent, what was recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings, load_settings
from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import megatron_layout
from refitd.server.delta.refits import DeltaRefits
from refitd.server.errors import precondition
from refitd.server.members import Worker
from refitd.server.metrics import ControllerMetrics
from refitd.server.planning import PlanOptions, make_plan
from refitd.server.refit.lifecycle import Phase, RefitLifecycle
from refitd.server.refit.membership import Membership, SlotOwners
from refitd.server.refit.run import CommitAcks, ModelRefits, RefitRun, attempt_id
from refitd.server.refit.scheduler import Scheduler
from refitd.server.streams import AckTally, Gather, GatherBoard, PhaseFailed

MODEL = "m"
EPOCH = 3


# ---------------------------------------------------------------------- the tiny cluster
def _specs(pool: str, slot: int, rank: int = 0, size: int = 1) -> list[TensorSpec]:
    lay = megatron_layout((64, 32), tp_rank=rank, tp_size=size, partition_dim=0)
    return [
        TensorSpec(MODEL, pool, rank, slot, "w", "w", (64, 32), "float32", lay.local_shape,
                   lay.boxes)
    ]  # fmt: skip


def _worker(pool: str, role: str, slot: int, rank: int = 0, size: int = 1) -> Worker:
    return Worker(
        worker_id=f"{pool}-{rank}",
        model=MODEL,
        pool=pool,
        role=role,
        rank=rank,
        pool_size=size,
        host="h",
        device=f"cpu:{slot}",
        pid=1,
        slot=slot,
        specs=tuple(_specs(pool, slot, rank, size)),
        memory={},
        registered_at=1.0,
        last_seen=1.0,
    )


def _membership(staged: bool = False) -> Membership:
    """Trainer (2 ranks, slots 0-1) -> pool "infer" (slot 2), and a staged pool (slot 3)."""
    src = [_worker("trainer", "source", s, s, 2) for s in (0, 1)]
    dests = [_worker("infer", "destination", 2)]
    if staged:
        dests.append(_worker("staged", "destination", 3))
    plan = make_plan(
        MODEL,
        EPOCH,
        [t for w in src for t in w.specs],
        [t for w in dests for t in w.specs],
        PlanOptions(bucket_bytes=1 << 20),
    )
    owners = SlotOwners({"agent": list(plan.slots)}, frozenset({"agent"}), {})
    readers = {r: plan.readers("trainer", r) for r in range(2)}
    members = frozenset([*(w.worker_id for w in dests), "agent"])
    return Membership(
        MODEL, EPOCH, plan, dests, owners, readers, members,
        frozenset({"staged"}) if staged else frozenset(),
    )  # fmt: skip


# ---------------------------------------------------------------------- the interfaces
class FakeClock:
    """Monotonic time that moves only when slept on (or advanced by a double)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Turn:
    def __init__(self, commander: ScriptedCommander) -> None:
        self.commander = commander
        self.held = True
        commander.held += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.commander.held -= 1


@dataclass
class ScriptedCommander:
    """Answers each transfer/apply from a script: "ok", "fail", "timeout" or "lose" (a
    member leaves while the transfer waits on a real Gather)."""

    clock: FakeClock
    transfers: list[str] = field(default_factory=list)
    applies: list[str] = field(default_factory=list)
    step_s: float = 0.0  # fake time each transfer takes
    board: GatherBoard = field(default_factory=GatherBoard)
    waiting: threading.Event = field(default_factory=threading.Event)
    timeout_s: float = 30.0
    held: int = 0
    prepared: int = 0
    transferred: list[int] = field(default_factory=list)  # attempt ids
    applied: list[set[int]] = field(default_factory=list)
    aborted: list[tuple[int, str]] = field(default_factory=list)

    def turn(self, model: str) -> Turn:
        assert self.held == 0, "a turn was taken twice"
        return Turn(self)

    def prepare(self, ms: Membership) -> None:
        assert self.held == 1, "prepared without the turn"
        self.prepared += 1

    def transfer(self, ms: Membership, run: RefitRun, cond: threading.Condition) -> float:
        assert self.held == 1, "transferred without the turn"
        self.transferred.append(attempt_id(run.refit_id, run.attempt))
        self.clock.now += self.step_s
        what = self.transfers.pop(0) if self.transfers else "ok"
        if what == "fail":
            raise PhaseFailed(f"transfer of version {run.version}: slot 2 reported an error")
        if what == "timeout":
            raise PhaseFailed(f"transfer of version {run.version}: timed out after 3s")
        if what == "lose":
            g = Gather(f"transfer of version {run.version}")
            g.watch = ms.members
            g.pending = {(s, pb.REPORT_KIND_DONE) for s in ms.plan.slots}
            gid = self.board.add(g)
            try:
                self.waiting.set()
                g.wait(self.timeout_s)
            finally:
                self.board.remove(gid)
        with cond:
            for slot in ms.plan.slots:
                run.release(slot)
        return self.clock.now

    def apply(self, ms: Membership, run: RefitRun, slots: set[int]) -> None:
        self.applied.append(set(slots))
        if (self.applies.pop(0) if self.applies else "ok") == "fail":
            raise PhaseFailed(f"apply of version {run.version}: staging incomplete")

    def abort(self, ms: Membership, run: RefitRun, reason: str) -> None:
        self.aborted.append((attempt_id(run.refit_id, run.attempt), reason))


@dataclass
class RecordingEvents:
    """Events per worker, in order; PAUSE answered by every worker unless scripted."""

    sent: list[tuple[str, str, str]] = field(default_factory=list)  # (worker, kind, reason)
    unsubscribed: set[str] = field(default_factory=set)
    pause_fails_after: int | None = None  # ack this many, then time out

    def subscribed(self, worker_ids: Iterable[str]) -> set[str]:
        return set(worker_ids) - self.unsubscribed

    def pause(self, workers: list[Worker], run: RefitRun, timeout_s: float, ms: Membership,
              acked: set[str]) -> None:  # fmt: skip
        for i, w in enumerate(workers):
            self.sent.append((w.worker_id, "PAUSE", ""))
            if self.pause_fails_after is not None and i >= self.pause_fails_after:
                raise PhaseFailed(f"pause of version {run.version}: timed out after {timeout_s:g}s")
            acked.add(w.worker_id)

    def tell(self, worker_ids: set[str], run: RefitRun, kind: int, reason: str) -> None:
        for wid in sorted(worker_ids):
            self.sent.append((wid, pb.EventKind.Name(kind)[len("EVENT_KIND_") :], reason))

    def commit(self, run: RefitRun, workers: list[Worker], acks: Gather | None) -> None:
        for w in workers:
            self.sent.append((w.worker_id, "COMMIT", ""))

    def kinds(self, worker_id: str) -> list[str]:
        return [k for w, k, _ in self.sent if w == worker_id]


@dataclass
class ScriptedMemberships:
    ms: Membership
    fail_from: int | None = None  # the for_run call (0-based) from which it is refused
    calls: int = 0

    def source_pool_complete(self, run: RefitRun) -> bool:
        return True

    def for_run(self, run: RefitRun) -> Membership:
        self.calls += 1
        if self.fail_from is not None and self.calls > self.fail_from:
            raise precondition("infer-0 is not subscribed: it cannot pause")
        return self.ms


@dataclass
class MemoryStore:
    """The version log, the holds of workers and the outcomes, in memory."""

    writing: list[int] = field(default_factory=list)
    committed: list[tuple[int, int]] = field(default_factory=list)  # (version, epoch)
    holds: dict[str, int] = field(default_factory=dict)
    records: list[tuple[int, str]] = field(default_factory=list)  # (version, state)
    next_id: int = 1

    def start(self, model: str, version: int) -> int:
        self.next_id += 1
        return self.next_id

    def mark_writing(self, run: RefitRun) -> None:
        self.writing.append(run.refit_id)

    def commit(self, run: RefitRun, epoch: int, workers: list[Worker]) -> None:
        self.committed.append((run.version, epoch))
        for w in workers:
            self.holds[w.worker_id] = w.holds = run.version

    def torn(self, workers: Iterable[Worker]) -> None:
        for w in workers:
            self.holds[w.worker_id] = w.holds = 0

    def finish(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        with m.cond:
            ended = m.end(run, state, reason)
        if ended:
            self.record(run, state, reason)

    def end(self, m: ModelRefits, run: RefitRun, state: int, reason: str) -> None:
        if m.end(run, state, reason):
            self.record(run, state, reason)

    def record(self, run: RefitRun, state: int, reason: str) -> None:
        self.records.append((run.version, pb.RefitState.Name(state)))


@dataclass
class MemoryAcks:
    opened: list[int] = field(default_factory=list)
    settled: int = 0

    def open(self, run: RefitRun, workers: list[Worker], timeout_s: float) -> CommitAcks:
        self.opened.append(run.version)
        return CommitAcks(AckTally("commit"), 0, run.version, timeout_s, timeout_s)

    def settle(self) -> None:
        self.settled += 1


# ---------------------------------------------------------------------- the harness
@dataclass
class Harness:
    settings: Settings
    clock: FakeClock
    commander: ScriptedCommander
    events: RecordingEvents
    members: ScriptedMemberships
    store: MemoryStore
    acks: MemoryAcks
    scheduler: Scheduler
    lifecycle: RefitLifecycle
    model: ModelRefits
    phases: list[Phase]

    def run(self, version: int = 7, asked: Iterable[int] = (0, 1)) -> RefitRun:
        run = RefitRun(self.store.start(MODEL, version), MODEL, version, "trainer", 2,
                       time.monotonic())  # fmt: skip
        run.asked.update(asked)
        run.last_ask = run.first_ask
        self.model.running = run
        self.lifecycle.execute(run, self.model)
        assert self.commander.held == 0, "the communicator turn was not given back"
        return run


def _harness(tmp_path: Path, staged: bool = False, **kw: object) -> Harness:
    base: dict[str, object] = dict(
        data_dir=tmp_path, refit_retries=2, refit_retry_budget_s=30.0, barrier_timeout_s=0.3,
        pause_timeout_s=3.0, commit_timeout_s=3.0,
    )  # fmt: skip
    base.update(kw)
    settings = load_settings(None, **base)
    clock = FakeClock()
    commander = ScriptedCommander(clock)
    events = RecordingEvents()
    members = ScriptedMemberships(_membership(staged))
    store = MemoryStore()
    acks = MemoryAcks()
    phases: list[Phase] = []
    scheduler = Scheduler(settings, store, threading.Event(), lambda m: None)  # type: ignore[arg-type]
    lifecycle = RefitLifecycle(
        settings, ControllerMetrics(), scheduler, members, commander, events, acks, store,
        DeltaRefits(settings), clock, on_phase=lambda run, p: phases.append(p),
    )  # fmt: skip
    return Harness(settings, clock, commander, events, members, store, acks, scheduler, lifecycle,
                   ModelRefits(MODEL), phases)  # fmt: skip


P = Phase


# ---------------------------------------------------------------------- the paths
def test_commit(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    run = h.run()
    assert run.state == pb.REFIT_STATE_COMMITTED and run.reason == ""
    assert h.phases == [P.PREPARE, P.PAUSE, P.TRANSFER, P.COMMIT, P.COMMITTED]
    assert h.events.kinds("infer-0") == ["PAUSE", "COMMIT"]
    assert h.store.committed == [(7, EPOCH)] and h.store.holds == {"infer-0": 7}
    assert h.store.writing == [run.refit_id] and h.store.records == [(7, "REFIT_STATE_COMMITTED")]
    assert h.acks.opened == [7] and h.acks.settled == 1 and run.commit_acks is not None
    assert all(run.rank_event(r).is_set() for r in (0, 1)) and run.finished.is_set()
    assert h.commander.aborted == [] and run.attempt == 0
    # the record says when each phase began and when the last PAUSE ack came
    at = run.detail["phase_at_s"]
    assert list(at) == [p.value for p in h.phases] and list(at.values()) == sorted(at.values())
    assert run.started <= run.detail["paused_at"] <= run.started + at["transfer"]


def test_barrier_timeout_aborts_the_paused(tmp_path: Path) -> None:
    """Early pause: rank 1 never asks; nothing was written, so the paused pool gets ABORT."""
    h = _harness(tmp_path)
    run = h.run(asked=[0])
    assert run.state == pb.REFIT_STATE_FAILED
    assert run.reason.startswith("ranks [1] of pool trainer never asked for version 7")
    assert h.phases == [P.PREPARE, P.PAUSE, P.BARRIER, P.FAILED]
    assert h.events.kinds("infer-0") == ["PAUSE", "ABORT"]
    assert h.commander.transferred == [] and h.store.writing == [] and h.store.committed == []
    assert len(h.commander.aborted) == 1  # the prepared communicator is reset


def test_barrier_completed_by_another_version_requeues(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    newer = RefitRun(99, MODEL, 8, "trainer", 2, time.monotonic(), asked={0, 1})
    h.model.pending[8] = newer
    run = h.run(asked=[0])
    assert h.phases[-1] == P.REQUEUED and run.state == pb.REFIT_STATE_REQUESTED
    assert h.model.pending == {7: run, 8: newer} and not run.final
    assert h.events.sent[-1] == ("infer-0", "ABORT", "a newer version is ready")
    assert h.store.records == []


def test_precondition_failure_before_anything(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.members.fail_from = 0
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED
    assert run.reason == "infer-0 is not subscribed: it cannot pause"
    assert h.phases == [P.PREPARE, P.FAILED]
    assert h.events.sent == [] and h.commander.aborted == [] and h.commander.transferred == []


def test_pause_timeout_aborts_who_may_have_paused(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.events.pause_fails_after = 0
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED and "pause of version 7: timed out" in run.reason
    assert h.events.kinds("infer-0") == ["PAUSE"]  # raised before it counted as paused
    assert h.commander.transferred == [] and len(h.commander.aborted) == 1


def test_transfer_failure_is_retried_with_the_pools_paused(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.commander.transfers = ["fail"]
    run = h.run()
    assert run.state == pb.REFIT_STATE_COMMITTED and run.attempt == 1
    assert run.detail["retries"] == 1
    assert h.phases == [P.PREPARE, P.PAUSE, P.TRANSFER, P.RETRY, P.PREPARE, P.TRANSFER,
                        P.COMMIT, P.COMMITTED]  # fmt: skip
    assert h.events.kinds("infer-0") == ["PAUSE", "COMMIT"]  # paused once, across attempts
    rid = run.refit_id
    assert h.commander.transferred == [attempt_id(rid, 0), attempt_id(rid, 1)]
    assert [a for a, _ in h.commander.aborted] == [attempt_id(rid, 0)]


def test_retries_exhausted_end_incomplete(tmp_path: Path) -> None:
    h = _harness(tmp_path, refit_retries=2)
    h.commander.transfers = ["timeout", "fail", "fail"]
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED and run.attempt == 2
    assert run.reason == (
        "transfer of version 7: timed out after 3s (after 2 retries: transfer of version 7: "
        "slot 2 reported an error)"
    )
    assert len(h.commander.transferred) == 3 and h.phases.count(P.RETRY) == 2
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]
    assert h.store.holds == {"infer-0": 0} and h.store.committed == []


def test_retry_budget_in_time(tmp_path: Path) -> None:
    h = _harness(tmp_path, refit_retries=10, refit_retry_budget_s=1.0)
    h.commander.transfers = ["fail"] * 10
    h.commander.step_s = 0.6  # the budget counts from the first failure: 2 retries fit in it
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED and len(h.commander.transferred) == 3
    assert run.reason.endswith("(after 2 retries)")
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]


def test_not_retried_once_a_trainer_rank_had_its_weights_back(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.commander.transfers = ["fail"]

    def handed_back(run: RefitRun, phase: Phase) -> None:
        if phase is P.TRANSFER:
            run.handed_back = True  # a rank's Refit returned when its sources were read

    h.lifecycle._on_phase = handed_back
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED and len(h.commander.transferred) == 1
    assert run.reason.endswith("(not retried: trainer ranks already had their weights back)")
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]


def test_member_lost_mid_transfer_fails_at_once(tmp_path: Path) -> None:
    """A destination worker leaves while the transfer waits: the attempt fails at once
    (not at the 30 s transfer timeout); it cannot be prepared again without it, so the
    refit ends INCOMPLETE once the retry budget is spent."""
    h = _harness(tmp_path, refit_retry_budget_s=1.0)
    h.commander.transfers = ["lose"]
    h.members.fail_from = 1  # the next Membership misses the lost worker

    def lose() -> None:
        assert h.commander.waiting.wait(10)
        h.commander.board.member_gone("infer-0", "infer-0 missed its heartbeats (lease expired)")

    t = threading.Thread(target=lose)
    t.start()
    clock0 = h.clock.now
    started = time.monotonic()
    run = h.run()
    t.join(10)
    assert time.monotonic() - started < 10  # well under the 30 s transfer timeout
    assert run.state == pb.REFIT_STATE_FAILED
    assert "infer-0 missed its heartbeats (lease expired)" in run.reason
    assert run.reason.endswith("(after 1 retries: infer-0 is not subscribed: it cannot pause)")
    assert run.attempt == 1  # failing to prepare a retry is not one more attempt
    assert h.phases[:5] == [P.PREPARE, P.PAUSE, P.TRANSFER, P.RETRY, P.PREPARE]
    assert set(h.phases[4:-1]) == {P.PREPARE, P.RETRY} and h.phases[-1] is P.FAILED
    assert h.commander.transferred == [attempt_id(run.refit_id, 0)]
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]
    assert h.clock.now - clock0 >= 1.0  # waited out the budget between tries


def test_staged_pool_paused_and_applied_after_the_transfer(tmp_path: Path) -> None:
    h = _harness(tmp_path, staged=True)
    h.commander.applies = ["fail"]
    run = h.run()
    assert run.state == pb.REFIT_STATE_COMMITTED
    assert h.phases == [P.PREPARE, P.PAUSE, P.TRANSFER, P.APPLY, P.COMMIT, P.COMMITTED]
    assert h.commander.applied == [{3}, {3}]  # applied again from intact staging
    assert [w for w, k, _ in h.events.sent if k == "PAUSE"] == ["infer-0", "staged-0"]
    assert h.store.holds == {"infer-0": 7, "staged-0": 7}


def test_apply_exhausted_is_incomplete_for_the_staged(tmp_path: Path) -> None:
    h = _harness(tmp_path, staged=True, refit_retries=0)
    h.commander.applies = ["fail"]
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED
    assert run.reason.endswith("(apply tried 1 times)")
    assert h.events.kinds("staged-0") == ["PAUSE", "INCOMPLETE"]
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]


def test_subscription_lost_before_commit(tmp_path: Path) -> None:
    h = _harness(tmp_path, refit_retries=0)

    def unsubscribe(run: RefitRun, phase: Phase) -> None:
        if phase is P.COMMIT:
            h.events.unsubscribed.add("infer-0")

    h.lifecycle._on_phase = unsubscribe
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED
    assert (
        run.reason == "destination workers ['infer-0'] lost their subscription during the transfer"
    )
    assert h.store.committed == []


def test_destination_lost_before_apply_leaves_the_staged_pool_untouched(tmp_path: Path) -> None:
    """An in-place pool's worker (a draft) lost after the transfer: the staged pool (its
    policy) is never applied and resumes its version; nothing is committed."""
    h = _harness(tmp_path, staged=True, refit_retries=0)

    def unsubscribe(run: RefitRun, phase: Phase) -> None:
        if phase is P.APPLY:
            h.events.unsubscribed.add("infer-0")

    h.lifecycle._on_phase = unsubscribe
    run = h.run()
    assert run.state == pb.REFIT_STATE_FAILED
    assert "['infer-0'] lost their subscription" in run.reason, run.reason
    assert h.commander.applied == []
    assert h.events.kinds("staged-0") == ["PAUSE", "ABORT"]
    assert h.events.kinds("infer-0") == ["PAUSE", "INCOMPLETE"]
    assert h.store.committed == []


@pytest.mark.parametrize("early_pause", [True, False])
def test_older_versions_are_superseded(tmp_path: Path, early_pause: bool) -> None:
    h = _harness(tmp_path, early_pause=early_pause)
    m = h.model
    now = time.monotonic()
    runs = {v: RefitRun(v, MODEL, v, "trainer", 2, now, asked={0, 1}) for v in (4, 5, 6)}
    m.pending.update(runs)
    with m.cond:
        chosen = h.scheduler.next_run(m)
    assert chosen is runs[6] and m.pending == {}
    for v in (4, 5):
        assert runs[v].state == pb.REFIT_STATE_SUPERSEDED
        assert runs[v].reason.startswith("coalesced into version 6")
        assert m.ended[v] is runs[v]
    assert h.store.records == [(4, "REFIT_STATE_SUPERSEDED"), (5, "REFIT_STATE_SUPERSEDED")]

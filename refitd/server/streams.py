"""The controller's two outgoing streams and the waits on their answers.

EventHub: one Subscribe (or Events) stream per worker (version events, acked with Ack or on
the Events stream).
AgentHub: one Commands stream per agent (commands, answered with Report).
Gather: a phase of a refit waiting for a set of answers (acks or reports), failing on the
first bad answer, on a member leaving (one it waits for, or any member of the refit it
watches), or on its timeout. Nothing here blocks without one. The answer paths (Ack, Report)
are a dict pop and a set discard under short locks; waiters are woken once per phase.
Streams are sent by their handlers, coroutines on the gRPC server's loop (server/loop.py):
any thread queues an item, and the loop is woken once per burst.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from refitd._proto import refitd_pb2 as pb
from refitd.server.loop import Soon

T = TypeVar("T")


class PhaseFailed(Exception):
    """A refit phase ended badly; the message is the refit's failure reason."""


class Stream(Generic[T]):
    """One open server stream: items queued by any thread, sent by its handler on the
    server's loop (reached through `soon`). An open stream holds no thread."""

    def __init__(self, owner: str, soon: Soon) -> None:
        self.owner = owner
        self._soon = soon
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = threading.Event()

    def put(self, item: T) -> None:
        self._items.append(item)
        self._soon(self._wake)

    def close(self) -> None:
        self.closed.set()
        self._soon(self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def items(self) -> AsyncIterator[T]:
        """Yield queued items until closed. The call's cancellation (its client went, or
        the server stops) ends it where it waits."""
        loop = asyncio.get_running_loop()
        while not self.closed.is_set():
            if self._items:
                yield self._items.popleft()
                continue
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


@dataclass
class Gather:
    """Waits until every key has answered; the first failure wins."""

    what: str
    pending: set = field(default_factory=set)
    members: dict = field(default_factory=dict)  # key -> member id (agent or worker)
    watch: frozenset[str] = frozenset()  # members whose loss fails it even when answered
    failure: str | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)

    def complete(self, key: object) -> None:
        with self.cond:
            self.pending.discard(key)
            if not self.pending:
                self.cond.notify_all()

    def fail(self, reason: str) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = reason
            self.cond.notify_all()

    def lose(self, member: str, reason: str) -> None:
        """`member` left or refused: the phase fails (AckTally records it and goes on)."""
        self.fail(reason)

    def involves(self, member: str) -> bool:
        with self.cond:
            if member in self.watch:
                return True
            return any(self.members.get(k) == member for k in self.pending)

    @property
    def done(self) -> bool:
        return not self.pending or self.failure is not None

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.pending and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(str(k) for k in self.pending)
                    raise PhaseFailed(
                        f"{self.what}: timed out after {timeout_s:g}s waiting for "
                        f"{', '.join(missing[:16])}{' ...' if len(missing) > 16 else ''}"
                    )
                self.cond.wait(left)
            if self.failure is not None:
                raise PhaseFailed(self.failure)


@dataclass
class AckTally(Gather):
    """Answers of every member, each failure recorded on its own: a member lost or
    refusing does not end the wait for the others (the COMMIT acks of a version)."""

    failed: dict = field(default_factory=dict)  # member -> why it will not answer

    def lose(self, member: str, reason: str) -> None:
        with self.cond:
            if member in self.pending:
                self.pending.discard(member)
                self.failed[member] = reason
                if not self.pending:
                    self.cond.notify_all()

    def settle(self, timeout_s: float) -> tuple[dict[str, str], list[str]]:
        """Wait until every member answered or failed, `timeout_s` at most: (the failed
        members and why, the members still silent)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.pending and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            return dict(self.failed), sorted(str(k) for k in self.pending)


class GatherBoard:
    """The gathers in progress, so a member that leaves fails the ones waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[int] = set()
        self._gathers: dict[int, Gather] = {}
        self._ids = itertools.count(1)

    def add(self, g: Gather) -> int:
        with self._lock:
            gid = next(self._ids)
            self._gathers[gid] = g
            return gid

    def remove(self, gid: int) -> None:
        with self._lock:
            self._gathers.pop(gid, None)

    def member_gone(self, member: str, reason: str) -> None:
        with self._lock:
            gathers = list(self._gathers.values())
        for g in gathers:
            if g.involves(member):
                g.lose(member, reason)


class EventHub:
    """Subscribe streams by worker id, and the acks the controller waits for."""

    def __init__(self, board: GatherBoard, soon: Soon) -> None:
        self._lock = threading.Lock()
        self._soon = soon
        self._streams: dict[str, Stream[pb.VersionEvent]] = {}
        # Ids go on rising across controller restarts (microseconds since the epoch at
        # start): a client drops events whose id is not above the last one it handled.
        self._event_ids = itertools.count(time.time_ns() // 1000)
        self._waiting: dict[int, tuple[Gather, str]] = {}  # event id -> (gather, worker id)
        self.board = board

    def open(self, worker_id: str) -> Stream[pb.VersionEvent]:
        """A new stream for the worker; an older one of the same worker is closed."""
        s: Stream[pb.VersionEvent] = Stream(worker_id, self._soon)
        with self._lock:
            old = self._streams.get(worker_id)
            self._streams[worker_id] = s
        if old is not None:
            old.close()
        return s

    def close(self, s: Stream[pb.VersionEvent], reason: str) -> None:
        with self._lock:
            if self._streams.get(s.owner) is s:
                del self._streams[s.owner]
            else:
                s = None  # type: ignore[assignment]  # replaced by a newer stream: not gone
        if s is not None:
            s.close()
            self.board.member_gone(s.owner, reason)

    def subscribed(self, worker_ids: Iterable[str]) -> list[str]:
        with self._lock:
            return [w for w in worker_ids if w in self._streams]

    def next_id(self) -> int:
        return next(self._event_ids)

    def send(self, worker_id: str, event: pb.VersionEvent, gather: Gather | None) -> bool:
        """Queue an event (event_id assigned here); False when the worker has no stream."""
        event.event_id = self.next_id()
        with self._lock:
            s = self._streams.get(worker_id)
            if s is None:
                return False
            if gather is not None:
                self._waiting[event.event_id] = (gather, worker_id)
                gather.pending.add(worker_id)
                gather.members[worker_id] = worker_id
        s.put(event)
        return True

    def forget(self, gather: Gather) -> None:
        with self._lock:
            for eid in [e for e, (g, _) in self._waiting.items() if g is gather]:
                del self._waiting[eid]

    def ack(self, req: pb.AckRequest, describe: str) -> None:
        with self._lock:
            entry = self._waiting.pop(req.event_id, None)
        if entry is None or entry[1] != req.worker_id:
            return  # an ack nobody waits for (late, or HELLO/COMMIT of an ended refit)
        gather, worker_id = entry
        if req.moved_tensors:
            gather.lose(
                worker_id,
                f"{describe} reports moved storage of tensors {list(req.moved_tensors)}; it "
                f"must re-register them",
            )
        elif not req.ok:
            gather.lose(
                worker_id, f"{describe} refused {gather.what}: {req.message or 'no reason given'}"
            )
        else:
            gather.complete(worker_id)


class AgentHub:
    """Commands streams by agent id, and the reports the controller waits for."""

    def __init__(self, board: GatherBoard, soon: Soon) -> None:
        self._lock = threading.Lock()
        self._soon = soon
        self._streams: dict[str, Stream[pb.AgentCommand]] = {}
        self._command_ids = itertools.count(1)
        self._waiting: dict[int, tuple[Gather, Callable[[pb.AgentReport], None] | None]] = {}
        self.board = board

    def open(self, agent_id: str) -> Stream[pb.AgentCommand]:
        s: Stream[pb.AgentCommand] = Stream(agent_id, self._soon)
        with self._lock:
            old = self._streams.get(agent_id)
            self._streams[agent_id] = s
        if old is not None:
            old.close()
        return s

    def close(self, s: Stream[pb.AgentCommand], reason: str) -> bool:
        """Close a stream; True when it was the agent's current one (the agent is gone)."""
        with self._lock:
            current = self._streams.get(s.owner) is s
            if current:
                del self._streams[s.owner]
        s.close()
        if current:
            self.board.member_gone(s.owner, reason)
        return current

    def connected(self, agent_id: str) -> bool:
        with self._lock:
            return agent_id in self._streams

    def drop(self, agent_id: str, reason: str) -> bool:
        """End an agent's stream (its lease expired); True when it had one."""
        with self._lock:
            s = self._streams.get(agent_id)
        return s is not None and self.close(s, reason)

    def send(
        self,
        agent_id: str,
        command: pb.AgentCommand,
        gather: Gather | None,
        keys: Iterable[object] = (),
        on_report: Callable[[pb.AgentReport], None] | None = None,
    ) -> int:
        """Queue a command; its answers (keys (slot, kind)) complete `gather`."""
        command.command_id = next(self._command_ids)
        with self._lock:
            s = self._streams.get(agent_id)
            if s is None:
                raise PhaseFailed(f"agent {agent_id} is not connected")
            if gather is not None:
                self._waiting[command.command_id] = (gather, on_report)
                for k in keys:
                    gather.pending.add(k)
                    gather.members[k] = agent_id
        s.put(command)
        return command.command_id

    def forget(self, gather: Gather) -> None:
        with self._lock:
            for cid in [c for c, (g, _) in self._waiting.items() if g is gather]:
                del self._waiting[cid]

    def report(self, r: pb.AgentReport, slots: Iterable[int] | None = None) -> None:
        """Route a report (and the batched ones in r.more) to the gather of its command.

        `slots`: the slots the reporting agent serves; batched reports for others are dropped.
        """
        allowed = None if slots is None else set(slots)
        for item in (r, *r.more):
            if allowed is not None and item.slot not in allowed:
                continue
            with self._lock:
                entry = self._waiting.get(item.command_id)
            if entry is None:
                continue  # answer to a command of an ended phase
            gather, on_report = entry
            if item.kind == pb.REPORT_KIND_FAILED:
                gather.fail(f"slot {item.slot} on agent {r.agent_id}: {item.message or 'failed'}")
                continue
            if on_report is not None:
                on_report(item)
            gather.complete((item.slot, item.kind))

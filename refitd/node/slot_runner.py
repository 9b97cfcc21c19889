"""One device slot of the node agent: its transfer process, the thread that runs the slot's
commands in order, and the one record of the refits aborted on it.

Executes run on a thread per lane (one lane per model refitting at once), in order within
a lane, so a model's refit does not wait behind another's; a connect (which replaces the
communicator) and a restart wait until no execute is queued or running.

A controller command is decoded once (refitd.node.codec), sent to the transfer process, and
its typed report (or a `Failed` naming the slot, host and device) goes to the agent's
reporter with the seconds it took. An abort goes to the process at once, ahead of queued
commands; an execute of an aborted refit is refused here. Both take one lock around
"check or record, then send", so an execute is either refused or reaches the process before
the abort that stops it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from refitd._proto import refitd_pb2 as pb
from refitd.node.codec import SlotContext, decode, refit_id_of
from refitd.node.process_handle import TransferProcessHandle
from refitd.slot_protocol import Failed, Report, SlotCommand, SourcesReleased, verb_of

log = logging.getLogger(__name__)
ABORTED_KEPT = 64  # refit ids of aborts remembered per slot
# (slot, command id, refit id, report, seconds): queues a report for the controller
ReportSink = Callable[[int, int, int, Report, float], None]


class _Restart:
    """Queued by the heartbeat: restart the transfer process if it died."""


class SlotRunner:
    """One device slot: its transfer process and a thread running its commands in order."""

    def __init__(
        self,
        context: SlotContext,
        device: str,
        host: str,
        report: ReportSink,
        restarted: Callable[[int], None],
    ) -> None:
        self.slot = context.slot
        self.device = device
        self.context = context
        self.host = host
        self._report = report
        self._restarted = restarted
        self.process = self._spawn()
        self._aborted: dict[int, None] = {}  # refit ids aborted, oldest first
        self._lock = threading.Lock()
        self._queue: queue.Queue[pb.AgentCommand | _Restart | None] = queue.Queue()
        self._lanes: dict[int, queue.Queue[pb.AgentCommand | None]] = {}
        self._executing = 0  # executes queued or running in the lanes
        self._drained = threading.Condition()
        self._thread = threading.Thread(
            target=self._loop, name=f"refitd-slot-{self.slot}", daemon=True
        )
        self._thread.start()

    def _spawn(self) -> TransferProcessHandle:
        return TransferProcessHandle(self.slot, self.device, self.context.options)

    def submit(self, cmd: pb.AgentCommand) -> None:
        """Run a controller command after those queued before it."""
        self._queue.put(cmd)

    def restart_if_dead(self) -> None:
        """Restart the transfer process (in turn with the commands) if it died."""
        self._queue.put(_Restart())

    def abort(self, cmd: pb.AgentCommand) -> None:
        """Stop this slot's running refit now, and refuse a later execute of its refit."""
        abort, refit_id = decode(cmd, self.context), cmd.abort.refit_id
        log.info("slot %d: aborting refit %d: %s", self.slot, refit_id, cmd.abort.reason)
        try:
            with self._lock:
                if refit_id:
                    self._aborted[refit_id] = None
                    while len(self._aborted) > ABORTED_KEPT:
                        del self._aborted[next(iter(self._aborted))]
                if not self.alive():
                    return
                pending = self.process.send(abort)
            pending.result()
        except Exception as exc:
            log.warning("slot %d: abort of refit %d: %r", self.slot, refit_id, exc)

    def alive(self) -> bool:
        return self.process.alive()

    def restart(self) -> None:
        """Replace a dead transfer process (its communicator and programs are gone)."""
        code = self.process.process.exitcode
        log.warning("slot %d: transfer process died (exit code %s); restarting it", self.slot, code)
        try:
            self.process.close(timeout_s=1.0)
        except Exception as exc:
            log.debug("slot %d: closing the dead process: %r", self.slot, exc)
        self.process = self._spawn()
        self._restarted(self.slot)

    def close(self) -> None:
        for q in self._lanes.values():
            q.put(None)
        self._queue.put(None)
        try:
            self.process.close()
        except Exception as exc:
            log.warning("slot %d: closing transfer process: %r", self.slot, exc)
        self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Restart):
                self._drain_executes()
                if not self.alive():
                    self._restart_quietly()
                continue
            which = item.WhichOneof("command")
            if which == "execute":
                self._to_lane(item)
                continue
            if which == "connect":
                self._drain_executes()
            self._serve(item)
            if not self.alive():
                self._drain_executes()
                self._restart_quietly()

    def _to_lane(self, cmd: pb.AgentCommand) -> None:
        """Queue an execute on its lane's thread (made on the lane's first execute)."""
        lane = cmd.execute.lane
        with self._drained:
            self._executing += 1
        q = self._lanes.get(lane)
        if q is None:
            q = self._lanes[lane] = queue.Queue()
            threading.Thread(
                target=self._lane_loop, args=(q,), name=f"refitd-slot-{self.slot}-lane-{lane}",
                daemon=True,
            ).start()  # fmt: skip
        q.put(cmd)

    def _lane_loop(self, q: queue.Queue[pb.AgentCommand | None]) -> None:
        while (cmd := q.get()) is not None:
            try:
                self._serve(cmd)
            finally:
                with self._drained:
                    self._executing -= 1
                    self._drained.notify_all()
            if not self.alive():
                self._queue.put(_Restart())

    def _drain_executes(self) -> None:
        """Wait until no execute is queued or running (each is bounded by its own wait)."""
        with self._drained:
            self._drained.wait_for(lambda: self._executing == 0)

    def _restart_quietly(self) -> None:
        try:
            self.restart()
        except Exception as exc:
            log.error("slot %d: restarting the transfer process failed: %r", self.slot, exc)

    def _serve(self, cmd: pb.AgentCommand) -> None:
        """Run one controller command and report its outcome."""
        which = cmd.WhichOneof("command")
        refit_id = refit_id_of(cmd)
        start = time.perf_counter()
        report: Report
        try:
            report = self._run(decode(cmd, self.context), cmd.command_id, refit_id)
        except Exception as exc:
            log.warning("slot %d: %s failed: %s", self.slot, which, exc)
            where = f"slot {self.slot} ({self.host} {self.device})"
            report = Failed(type(exc).__name__, f"{where} {which}: {exc}")
        self._report(self.slot, cmd.command_id, refit_id, report, time.perf_counter() - start)

    def _run(self, typed: SlotCommand[Any], command_id: int, refit_id: int) -> Any:
        """Send a typed command to the transfer process and wait for its typed report."""
        verb = verb_of(typed)
        if not self.alive():
            self._restart_quietly()
            if not verb.fresh:
                raise RuntimeError(
                    "transfer process had died and was restarted; the controller "
                    "reconnects and reloads this slot"
                )
        with self._lock:
            if verb.refit and refit_id in self._aborted:
                raise RuntimeError(f"refit {refit_id} was aborted before it started")
            pending = self.process.send(typed)

        def released(event: SourcesReleased) -> None:
            self._report(self.slot, command_id, refit_id, event, 0.0)

        return pending.result(released)

"""One device slot of the node agent: its transfer process and the thread that runs the
slot's commands in order (the node agent's `SlotRunner`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from refitd._proto import refitd_pb2 as pb
from refitd.node.codec import Outcome, SlotContext, apply_timeout, outcome_of, slot_command
from refitd.node.process_handle import TransferProcessHandle, wait_execute
from refitd.slot_protocol import Applied, Apply, Connect, Executed, Load, Loaded

if TYPE_CHECKING:
    from refitd.node.agent import AgentOptions, NodeAgent

log = logging.getLogger(__name__)


class SlotRunner:
    """One device slot: its transfer process and a thread running its commands in order."""

    def __init__(self, agent: NodeAgent, slot: int, device: str, options: AgentOptions) -> None:
        self.agent = agent
        self.slot = slot
        self.device = device
        self.options = options
        self._spawn = lambda: TransferProcessHandle(slot=slot, device=device)
        self.context = SlotContext(
            slot,
            agent.data_plane.address,
            agent.data_plane.interface,
            options.connect_timeout_s,
            options.transfer_timeout_s,
            options.staging_bytes,
            options.snapshot_bytes,
        )
        self.process = self._spawn()
        self._aborted: dict[int, None] = {}  # refit ids aborted (latest 64)
        self._queue: queue.Queue[pb.AgentCommand | str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"refitd-slot-{slot}", daemon=True)
        self._thread.start()

    def submit(self, cmd: pb.AgentCommand | str) -> None:
        self._queue.put(cmd)

    def abort(self, refit_id: int, reason: str) -> None:
        log.info("slot %d: aborting refit %d: %s", self.slot, refit_id, reason)
        self._aborted[refit_id] = None
        while len(self._aborted) > 64:
            del self._aborted[next(iter(self._aborted))]
        if not self.process.process.is_alive():
            return
        try:
            self.process.abort(timeout_s=self.options.rpc_timeout_s, refit_id=refit_id)
        except Exception as exc:
            log.warning("slot %d: abort of refit %d: %r", self.slot, refit_id, exc)

    def alive(self) -> bool:
        return self.process.process.is_alive()

    def restart(self) -> None:
        """Replace a dead transfer process (its communicator and programs are gone)."""
        code = self.process.process.exitcode
        log.warning("slot %d: transfer process died (exit code %s); restarting it", self.slot, code)
        try:
            self.process.close(timeout_s=1.0)
        except Exception as exc:
            log.debug("slot %d: closing the dead process: %r", self.slot, exc)
        self.process = self._spawn()
        self.agent.slot_restarted(self.slot)

    def close(self) -> None:
        self._queue.put(None)
        try:
            self.process.close()
        except Exception as exc:
            log.warning("slot %d: closing transfer process: %r", self.slot, exc)
        self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        while True:
            cmd = self._queue.get()
            if cmd is None:
                return
            if cmd == "restart":
                if not self.alive():
                    self._restart_quietly()
                continue
            which = cmd.WhichOneof("command")
            refit_id = cmd.execute.refit_id if which == "execute" else 0
            start = time.perf_counter()
            try:
                if which == "execute" and refit_id in self._aborted:
                    raise RuntimeError(f"refit {refit_id} was aborted before it started")
                if not self.alive():
                    self._restart_quietly()
                    if which != "connect":
                        raise RuntimeError(
                            "transfer process had died and was restarted; the controller "
                            "reconnects and reloads this slot"
                        )
                outcome = self._run(cmd)
            except Exception as exc:
                log.warning("slot %d: %s failed: %s", self.slot, which, exc)
                outcome = Outcome(
                    pb.REPORT_KIND_FAILED,
                    seconds=time.perf_counter() - start,
                    message=f"slot {self.slot} ({self.agent.host} {self.device}) {which}: {exc}",
                )
            self.agent.report(self.slot, cmd.command_id, refit_id, outcome)
            if not self.alive():
                self._restart_quietly()

    def _restart_quietly(self) -> None:
        try:
            self.restart()
        except Exception as exc:
            log.error("slot %d: restarting the transfer process failed: %r", self.slot, exc)

    def _run(self, cmd: pb.AgentCommand) -> Outcome:
        """Convert the controller's command (once), run it on the transfer process, and turn
        its typed reply into the report."""
        start = time.perf_counter()
        typed = slot_command(cmd, self.context)
        kind = pb.REPORT_KIND_DONE
        reply: Loaded | Applied | Executed | None = None
        if isinstance(typed, Connect):
            self.process.connect_with(typed)
            kind = pb.REPORT_KIND_CONNECTED
        elif isinstance(typed, Load):
            reply = self.process.load_with(typed, self.options.load_timeout_s)
            kind = pb.REPORT_KIND_LOADED
        elif isinstance(typed, Apply):
            timeout_s = apply_timeout(cmd.apply, self.context)
            reply = self.process.apply(typed.digest, typed.refit_id, timeout_s)
        else:

            def released() -> None:
                outcome = Outcome(pb.REPORT_KIND_SOURCES_RELEASED)
                self.agent.report(self.slot, cmd.command_id, typed.refit_id, outcome)

            pending = self.process.send(typed)
            reply = wait_execute(pending, typed.timeout_s, released)
        return outcome_of(reply, kind, time.perf_counter() - start)

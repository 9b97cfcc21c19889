"""The node agent: one per host, it serves the controller's commands on its device slots.

It registers its slots (AgentControl.RegisterAgent), opens the Commands stream and hands
each command to the runner of every slot it names (slot_runner.py: one transfer process per
slot, commands of one slot in order on its thread, different slots at the same time), which
reports CONNECTED, LOADED, SOURCES_RELEASED, DONE or FAILED with bytes and seconds (an
ApplyCommand, which copies a staged pool's staging buffers in place, answers DONE too). One
ExecuteCommand names all the agent's slots of a refit (`slots`), and reports go out batched
(whatever is queued when the reporter thread is free goes in one Report call). An abort
goes to every slot at once, ahead of their queued commands, so an execute of that refit that
has not started yet fails at once. A transfer process that dies is restarted and the agent
registers again (its slots get a new incarnation: the controller reconnects and reloads
them). When the controller goes away the agent registers again with backoff; every call has
a deadline and every wait a timeout.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.limits import raise_nofile_limit
from refitd.memory.segment_names import reap_orphaned_segments
from refitd.node.address import DataPlaneAddress, choose_data_plane
from refitd.node.codec import (
    CommandError,
    SlotContext,
    refit_id_of,
    report_proto,
    target_slots,
    verb_of_proto,
)
from refitd.node.process_handle import start_transfer_server
from refitd.node.slot_runner import SlotRunner
from refitd.plan.links import RDMA_AUTO
from refitd.rpc.connection import Backoff, ControllerConnection, RefitError, security_for
from refitd.slot_protocol import Failed, Report, SlotOptions

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 60.0  # orphaned shared memory of killed workers is unlinked this often
RECONNECT_MAX_S = 1.0  # longest wait between attempts to register again


def offered_links(settings: Settings) -> tuple[str, ...]:
    """One-sided paths every transfer process of this agent can take (refitd.transport.paths):
    mapped always; rdma where Mooncake Transfer Engine imports and, with rdma_protocol=rdma,
    the host has an RDMA device; `rdma-auto` (the links setting `auto` may pick rdma) with an
    RDMA fabric (rdma_protocol=rdma) or where `rdma_auto` asks for it over TCP."""
    from refitd.transport.mooncake_env import mooncake_unavailable_reason, rdma_devices_present

    why = mooncake_unavailable_reason()
    if why is None and settings.rdma_protocol == "rdma" and not rdma_devices_present():
        why = "rdma_protocol=rdma but this host has no RDMA device"
    if why is not None:
        log.info("the rdma path is not offered: %s", why)
        return ("mapped",)
    if settings.rdma_protocol == "rdma" or settings.rdma_auto:
        return ("mapped", "rdma", RDMA_AUTO)
    return ("mapped", "rdma")


class NodeAgent:
    """Registers with the controller and serves its commands until `stop` is set."""

    def __init__(
        self,
        controller_address: str,
        host: str,
        devices: list[str],
        settings: Settings,
        data_plane: DataPlaneAddress | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a node agent needs at least one device slot (e.g. cpu:0)")
        self.address = controller_address
        self.host = host
        self.devices = list(devices)
        # Chosen before anything starts: a loopback one with a remote controller refuses.
        self.data_plane = data_plane or choose_data_plane(settings, controller_address)
        self.settings = settings
        self.slot_options = SlotOptions.from_settings(settings)
        self.links = offered_links(settings)
        self.agent_id = ""
        self.slots: dict[int, SlotRunner] = {}
        self.heartbeat_interval_s = 1.0
        self._conn = ControllerConnection(
            controller_address, settings.rpc_timeout_s, security_for(settings)
        )
        self._stream: Any = None
        self._stream_lock = threading.Lock()
        self._reports: queue.SimpleQueue[pb.AgentReport | None] = queue.SimpleQueue()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True)
        self._reporter.start()
        self._restarted = threading.Event()
        self._reaped_at = 0.0

    def reap_shared_memory(self, every_s: float = REAP_INTERVAL_S) -> None:
        """Unlink shared memory left by workers that died without closing (kill -9)."""
        if time.monotonic() - self._reaped_at < every_s:
            return
        self._reaped_at = time.monotonic()
        removed = reap_orphaned_segments()
        if removed:
            log.info(
                "agent %s: unlinked %d orphaned shared-memory segments", self.host, len(removed)
            )

    # ------------------------------------------------------------------ main loop
    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; reconnect (and register again) with backoff."""
        backoff = Backoff(maximum_s=RECONNECT_MAX_S)
        watcher = threading.Thread(target=self._cancel_on, args=(stop,), daemon=True)
        watcher.start()
        try:
            while not stop.is_set():
                try:
                    self._register()
                    backoff.reset()
                    self._serve(stop)
                except RefitError as err:
                    log.info("agent %s: %s", self.host, err)
                except grpc.RpcError as err:
                    if not stop.is_set():
                        log.info("agent %s: command stream ended: %s", self.host, err.details())
                except Exception:
                    log.exception("agent %s: unexpected error; starting over", self.host)
                if backoff.wait(stop):
                    break
        finally:
            self.close()

    def _registration(self) -> pb.RegisterAgentRequest:
        return pb.RegisterAgentRequest(
            host=self.host,
            slots=[pb.SlotInfo(device=d) for d in self.devices],
            pid=os.getpid(),
            agent_id=self.agent_id,
            batch_execute=True,
            data_plane_address=self.data_plane.address,
            links=self.links,
        )

    def _register(self) -> None:
        resp = self._conn.call(
            self._conn.agents.RegisterAgent, self._registration(), f"register agent {self.host}"
        )
        if len(resp.slot_ids) != len(self.devices):
            raise RefitError(
                f"controller assigned {len(resp.slot_ids)} slot ids for {len(self.devices)} devices"
            )
        self.agent_id = resp.agent_id
        self.heartbeat_interval_s = resp.heartbeat_interval_s or 1.0
        wanted = dict(zip(resp.slot_ids, self.devices, strict=True))
        for slot_id in list(self.slots):
            if wanted.get(slot_id) != self.slots[slot_id].device:
                self.slots.pop(slot_id).close()
        missing = [(s, d) for s, d in wanted.items() if s not in self.slots]
        if missing:  # start transfer processes in parallel (each forks, then connects)
            with ThreadPoolExecutor(len(missing)) as pool:
                runners = pool.map(lambda sd: self._runner(*sd), missing)
                self.slots.update({r.slot: r for r in runners})
        log.info("agent %s registered as %s with slots %s", self.host, self.agent_id, wanted)

    def _runner(self, slot: int, device: str) -> SlotRunner:
        context = SlotContext(
            slot,
            self.data_plane.address,
            self.data_plane.interface,
            self.slot_options,
        )
        return SlotRunner(context, device, self.host, self.report, self.slot_restarted)

    def _serve(self, stop: threading.Event) -> None:
        stream = self._conn.agents.Commands(pb.AgentStreamRequest(agent_id=self.agent_id))
        with self._stream_lock:
            self._stream = stream
        if stop.is_set():
            stream.cancel()
        beat = threading.Thread(target=self._heartbeat, args=(stream, stop), daemon=True)
        beat.start()
        try:
            for cmd in stream:
                self._dispatch(cmd)
        finally:
            with self._stream_lock:
                self._stream = None
            stream.cancel()
            beat.join(timeout=self.heartbeat_interval_s + self.settings.rpc_timeout_s)

    def _dispatch(self, cmd: pb.AgentCommand) -> None:
        """Hand a controller command to the runners of the slots it is for."""
        try:
            verb = verb_of_proto(cmd)
        except CommandError as err:
            log.warning("agent %s: unknown command: %s", self.host, err)
            return
        for slot in target_slots(cmd, self.slots):
            runner = self.slots.get(slot)
            if runner is None:
                failed = Failed("KeyError", f"agent {self.host} has no slot {slot}")
                self.report(slot, cmd.command_id, refit_id_of(cmd), failed, 0.0)
            elif verb.all_slots:
                runner.abort(cmd)
            else:
                runner.submit(cmd)

    # ------------------------------------------------------------------ controller calls
    def report(
        self, slot: int, command_id: int, refit_id: int, report: Report, seconds: float
    ) -> None:
        """Queue one report; the reporter thread sends what is queued in one call."""
        self._reports.put(report_proto(self.agent_id, slot, command_id, refit_id, report, seconds))

    def _report_loop(self) -> None:
        """Send queued reports, batched (AgentReport.more), in the order they were queued."""
        while (first := self._reports.get()) is not None:
            batch = [first]
            end = False
            while len(batch) < 256:
                try:
                    item = self._reports.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    end = True
                    break
                batch.append(item)
            head = pb.AgentReport()
            head.CopyFrom(batch[0])
            head.agent_id = self.agent_id
            head.more.extend(batch[1:])
            self._send_report(head)
            if end:
                return

    def _send_report(self, req: pb.AgentReport) -> None:
        """One Report call; retried briefly, then dropped (the controller's timeout covers it)."""
        slot = req.slot
        for attempt in range(3):
            try:
                self._conn.call(self._conn.agents.Report, req, f"report slot {slot}")
                return
            except RefitError as err:
                if not err.transient or attempt == 2:
                    log.warning("agent %s: report dropped: %s", self.host, err)
                    return
                time.sleep(0.2 * (attempt + 1))

    def slot_restarted(self, slot: int) -> None:
        """A transfer process was replaced: register again so the controller knows."""
        self._restarted.set()

    def _reregister_after_restart(self) -> None:
        self._conn.call(
            self._conn.agents.RegisterAgent, self._registration(), f"register agent {self.host}"
        )
        log.info("agent %s: registered again after a transfer process restart", self.host)

    def _heartbeat(self, stream: Any, stop: threading.Event) -> None:
        """Beat while the stream lives; a controller that stops answering ends the stream.
        Also the lease of the transfer processes: a dead one is restarted."""
        last_ok = time.monotonic()
        while not stop.wait(self.heartbeat_interval_s) and stream.is_active():
            self.reap_shared_memory()
            for runner in list(self.slots.values()):
                if not runner.alive():
                    runner.restart_if_dead()
            if self._restarted.is_set():
                self._restarted.clear()
                try:
                    self._reregister_after_restart()
                except RefitError as err:
                    log.warning("agent %s: %s", self.host, err)
                    self._restarted.set()
            try:
                self._conn.call(
                    self._conn.agents.AgentHeartbeat,
                    pb.AgentHeartbeatRequest(agent_id=self.agent_id),
                    "agent heartbeat",
                    timeout_s=max(2.0, self.heartbeat_interval_s * 3),
                )
                last_ok = time.monotonic()
            except RefitError as err:
                silent = time.monotonic() - last_ok
                if (
                    err.code == grpc.StatusCode.NOT_FOUND
                    or silent > self.settings.heartbeat_timeout_s
                ):
                    log.info("agent %s: reconnecting (%s)", self.host, err)
                    stream.cancel()
                    return

    def _cancel_on(self, stop: threading.Event) -> None:
        stop.wait()
        with self._stream_lock:
            if self._stream is not None:
                self._stream.cancel()

    def close(self) -> None:
        """Stop every transfer process and close the channel."""
        for runner in self.slots.values():
            runner.close()
        self.slots.clear()
        self._reports.put(None)
        self._reporter.join(timeout=5.0)
        self._conn.close()


def run_node_agent(
    controller_address: str,
    host: str,
    devices: list[str],
    settings: Settings,
    stop_event: threading.Event,
    data_plane: DataPlaneAddress | None = None,
) -> None:
    """Run a node agent until stop_event is set (used by `refitd serve` and `refitd agent`)."""
    raise_nofile_limit()
    start_transfer_server()
    NodeAgent(controller_address, host, devices, settings, data_plane).run(stop_event)

"""gRPC peers of the controller for its tests: an agent that answers commands without moving
bytes (the bytes path is tested end to end with the real agent elsewhere), and workers.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.plan.program import SlotProgram, decode_program


def tensor(
    name: str, gshape: list[int], offset: list[int], shape: list[int]
) -> pb.TensorRegistration:
    return pb.TensorRegistration(
        name=name,
        global_shape=gshape,
        dtype="float32",
        local_shape=shape,
        boxes=[pb.Box(offset=offset, shape=shape, local_offset=[0] * len(shape))],
        memory=b"handle:" + name.encode(),
    )


def row_shard(name: str, rows: int, cols: int, rank: int, size: int) -> pb.TensorRegistration:
    """Rank `rank` of `size` holding rows [rank*rows/size, ...) of a [rows, cols] tensor."""
    r = rows // size
    return tensor(name, [rows, cols], [rank * r, 0], [r, cols])


@dataclass
class EchoAgent:
    """A node agent over real gRPC whose slots answer every command at once.

    fail_execute: slot -> message reported as FAILED on execute; silent: slots that never
    answer an execute (to drive a timeout); fail_connect: slot -> message reported as FAILED
    on connect.
    """

    address: str
    host: str
    devices: list[str]
    fail_execute: dict[int, str] = field(default_factory=dict)
    silent: set[int] = field(default_factory=set)
    fail_connect: dict[int, str] = field(default_factory=dict)
    commands: list[pb.AgentCommand] = field(default_factory=list)
    programs: dict[int, SlotProgram] = field(default_factory=dict)

    def start(self) -> EchoAgent:
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pbg.AgentControlStub(self.channel)
        resp = self.stub.RegisterAgent(
            pb.RegisterAgentRequest(
                host=self.host, slots=[pb.SlotInfo(device=d) for d in self.devices], pid=1
            ),
            timeout=10,
        )
        self.agent_id = resp.agent_id
        self.slot_ids = list(resp.slot_ids)
        self.stream = self.stub.Commands(pb.AgentStreamRequest(agent_id=self.agent_id))
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self._connected() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def _connected(self) -> bool:
        status = pbg.RefitStub(self.channel).GetStatus(pb.StatusRequest(), timeout=5)
        import json

        agents = json.loads(status.json)["agents"]
        return any(a["agent_id"] == self.agent_id and a["connected"] for a in agents)

    def _report(self, cmd: pb.AgentCommand, slot: int, kind: int, **kw: object) -> None:
        self.stub.Report(
            pb.AgentReport(
                agent_id=self.agent_id, slot=slot, command_id=cmd.command_id, kind=kind, **kw
            ),
            timeout=10,
        )

    def _loop(self) -> None:
        try:
            for cmd in self.stream:
                self.commands.append(cmd)
                which = cmd.WhichOneof("command")
                if which == "connect":
                    for slot in self.slot_ids:
                        if slot in self.fail_connect:
                            msg = self.fail_connect[slot]
                            self._report(cmd, slot, pb.REPORT_KIND_FAILED, message=msg)
                        elif slot in cmd.connect.comm_rank:
                            prog = self.programs.get(slot)
                            held = [prog.digest] if prog is not None else []
                            self._report(cmd, slot, pb.REPORT_KIND_CONNECTED, loaded_plans=held)
                elif which == "load":
                    self.programs[cmd.load.slot] = decode_program(cmd.load.program)
                    self._report(cmd, cmd.load.slot, pb.REPORT_KIND_LOADED)
                elif which == "execute":
                    slot = cmd.execute.slot
                    if slot in self.silent:
                        continue
                    if slot in self.fail_execute:
                        self._report(
                            cmd, slot, pb.REPORT_KIND_FAILED, message=self.fail_execute[slot]
                        )
                        continue
                    prog = self.programs[slot]
                    sent = sum(m.nbytes for m in prog.sends)
                    self._report(cmd, slot, pb.REPORT_KIND_SOURCES_RELEASED)
                    self._report(cmd, slot, pb.REPORT_KIND_DONE, bytes_sent=sent, seconds=0.001)
        except grpc.RpcError:
            pass

    def kinds(self) -> list[str]:
        return [c.WhichOneof("command") for c in self.commands]

    def stop(self) -> None:
        self.stream.cancel()
        self.channel.close()


@dataclass
class Subscriber:
    """A destination worker's event stream; acks every event (or refuses, as told), with an
    Ack call each (Subscribe), or on the stream itself (`on_stream`: Events)."""

    stub: pbg.RefitStub
    worker_id: str
    refuse: str = ""
    moved: list[str] = field(default_factory=list)
    events: list[pb.VersionEvent] = field(default_factory=list)
    on_stream: bool = False
    error: Exception | None = None  # how its stream ended, when not by stop()

    def start(self) -> Subscriber:
        subscribe = pb.SubscribeRequest(worker_id=self.worker_id)
        self.requests: queue.SimpleQueue[pb.EventsRequest | None] = queue.SimpleQueue()
        if self.on_stream:
            self.requests.put(pb.EventsRequest(subscribe=subscribe))
            self.stream = self.stub.Events(iter(self.requests.get, None))
        else:
            self.stream = self.stub.Subscribe(subscribe)
        self.hello = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        assert self.hello.wait(10)
        return self

    def _loop(self) -> None:
        try:
            for ev in self.stream:
                self.events.append(ev)
                if ev.kind == pb.EVENT_KIND_HELLO:
                    self.hello.set()
                    continue
                refuse = bool(self.refuse) and ev.kind == pb.EVENT_KIND_PAUSE
                ack = pb.AckRequest(
                    worker_id=self.worker_id,
                    event_id=ev.event_id,
                    ok=not refuse,
                    message=self.refuse if refuse else "",
                    moved_tensors=self.moved if ev.kind == pb.EVENT_KIND_PAUSE else [],
                )
                if self.on_stream:
                    self.requests.put(pb.EventsRequest(ack=ack))
                else:
                    self.stub.Ack(ack, timeout=10)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the test closed its channel
            self.error = e
        self.requests.put(None)

    def kinds(self) -> list[tuple[int, int]]:
        return [(e.kind, e.version) for e in self.events]

    def stop(self) -> None:
        self.stream.cancel()

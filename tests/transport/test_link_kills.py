"""One-sided links when a transfer process dies or stalls (real processes). Mapped: a
destination that dies mid-write (kill -9) does not stop its sender, which finishes; a sender
that dies leaves its destination waiting until the abort, which ends the wait at once. Rdma
(Mooncake over TCP on loopback): a destination killed mid-write fails its sender's refit
with a TransportError naming the peer slot and the message; a stopped destination (SIGSTOP)
fails it at the transfer deadline, never a hang. Fresh processes then land the next refit
bit for bit."""

from __future__ import annotations

import datetime
import os
import re
import signal
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from refitd.memory.arena import SharedTensorArena
from refitd.memory.segment_names import reap_orphaned_segments
from refitd.node.process_handle import TransferProcessError, TransferProcessHandle
from refitd.plan.layouts import make_spec, megatron_layout
from refitd.plan.links import LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import encode_program
from refitd.slot_protocol import Abort, Connect, Execute, Load
from refitd.transport.mooncake_env import mooncake_unavailable_reason

pytestmark = pytest.mark.slow
RDMA_REASON = mooncake_unavailable_reason()
needs_rdma = pytest.mark.skipif(RDMA_REASON is not None, reason=f"rdma path: {RDMA_REASON}")
ROWS, COLS, TENSORS = 2048, 4096, 8  # 8 x 16 MiB: the sender writes for a while
ENGINE_PORTS = range(15000, 17001)  # where Mooncake's engines listen by default


def _engine_ports(pid: int) -> set[int]:
    """The ports the Mooncake engines of a process listen on."""
    listening = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in listening if c.status == psutil.CONN_LISTEN} & set(ENGINE_PORTS)


class _Link:
    """Slot 0 holds the sources, slot 1 the destinations, one host: every message on `path`."""

    def __init__(self, path: str = "mapped") -> None:
        shape = (ROWS, COLS)
        spec = dict(model="m", global_shape=shape, dtype="bfloat16", layout=megatron_layout(shape))
        self.src = [make_spec(pool="t", rank=0, slot=0, name=f"w{k}", **spec)
                    for k in range(TENSORS)]  # fmt: skip
        self.dst = [make_spec(pool="i", rank=0, slot=1, name=f"w{k}", **spec)
                    for k in range(TENSORS)]  # fmt: skip
        sites = [SlotSite(s, "h", "cpu", ("mapped", "rdma")) for s in (0, 1)]
        self.plan = build_plan("m", 1, self.src, self.dst,
                               PlanConfig(links=LinkPolicy.of(path, sites)))  # fmt: skip
        assert self.plan.link_summary()[path]["messages"] > 0
        gen = torch.Generator().manual_seed(7)
        self.tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in self.src]
        self.tensors += [torch.zeros(shape, dtype=torch.bfloat16) for _ in self.dst]
        self.arenas = [SharedTensorArena(prefix="refitd-test") for _ in (0, 1)]
        self.handles = {
            i: self.arenas[s.slot].register({f"t{i}": t})[f"t{i}"]
            for i, (s, t) in enumerate(zip(self.src + self.dst, self.tensors, strict=True))
        }
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))  # fmt: skip
        self.procs: dict[int, TransferProcessHandle] = {}
        self.epoch = 0

    def start(self, slots: tuple[int, ...] = (0, 1)) -> None:
        """(Re)start the slots' processes, connect all and load the plan everywhere."""
        for s in slots:
            self.procs[s] = TransferProcessHandle(s)
        self.epoch += 1
        pend = [h.send(Connect(self.epoch, "127.0.0.1", self.store.port, s, 2, "gloo", 30.0,
                               slot_ranks={0: 0, 1: 1}))
                for s, h in self.procs.items()]  # fmt: skip
        for p in pend:
            p.result()
        for s, h in self.procs.items():
            prog = self.plan.program(s)
            handles = {i: self.handles[i].to_bytes() for i in prog.tensors}
            h.send(Load(self.plan.digest, encode_program(prog), handles)).result()

    def execute(self, slot: int, refit_id: int, timeout_s: float = 30.0):
        return self.procs[slot].send(Execute(self.plan.digest, 1, refit_id, timeout_s))

    def kill(self, slot: int) -> None:
        os.kill(self.procs[slot].process.pid, signal.SIGKILL)
        self.procs[slot].process.join(10)
        self.procs.pop(slot).close()

    def writing(self, timeout_s: float = 30.0) -> None:
        """Wait until the first bytes landed in the destination (it is being written)."""
        dst = self.tensors[len(self.src) :]
        deadline = time.monotonic() + timeout_s
        heads = [t.view(-1)[:4096].view(torch.int16) for t in dst]  # a scan of all is slow
        while not any(bool(h.any()) for h in heads):
            assert time.monotonic() < deadline, "no byte landed"
            time.sleep(0.001)

    def landed(self) -> bool:
        n = len(self.src)
        return all(torch.equal(self.tensors[n + k], self.tensors[k]) for k in range(n))

    def close(self) -> None:
        for h in self.procs.values():
            h.close()
        for a in self.arenas:
            a.close()
        reap_orphaned_segments()  # the doorbells and staging of killed processes


def test_a_destination_killed_mid_write_does_not_stop_its_sender() -> None:
    link = _Link()
    try:
        link.start()
        sender = link.execute(0, 1)
        receiver = link.execute(1, 1)
        time.sleep(0.01)  # the sender is writing (128 MiB)
        link.kill(1)
        t0 = time.monotonic()
        done = sender.result(timeout_s=60)
        assert done.report.sent_bytes == link.plan.stats.remote_bytes
        assert time.monotonic() - t0 < 30
        with pytest.raises(TransferProcessError):
            receiver.result(timeout_s=5)
        for t in link.tensors[len(link.src) :]:
            t.zero_()
        link.start((1,))  # a fresh destination process; every slot reconnects and reloads
        pend = [link.execute(s, 2) for s in (0, 1)]
        for p in pend:
            p.result(timeout_s=60)
        assert link.landed()
    finally:
        link.close()


def test_a_sender_killed_leaves_its_destination_waiting_until_the_abort() -> None:
    link = _Link()
    try:
        link.start()
        receiver = link.execute(1, 1, timeout_s=120)
        link.kill(0)  # the sender dies before it writes anything
        time.sleep(0.3)
        t0 = time.monotonic()
        link.procs[1].send(Abort(1)).result()
        with pytest.raises(TransferProcessError, match="aborted"):
            receiver.result(timeout_s=10)
        assert time.monotonic() - t0 < 5  # the abort ends the wait at once, not the deadline
        link.start((0,))
        pend = [link.execute(s, 2) for s in (0, 1)]
        for p in pend:
            p.result(timeout_s=60)
        assert link.landed()
    finally:
        link.close()


def _again(link: _Link, refit_id: int, restart: tuple[int, ...]) -> None:
    """Fresh processes for `restart`, every slot reconnected and reloaded: the next refit
    lands bit for bit."""
    for t in link.tensors[len(link.src) :]:
        t.zero_()
    link.start(restart)
    pend = [link.execute(s, refit_id) for s in (0, 1)]
    for p in pend:
        p.result(timeout_s=60)
    assert link.landed()


@needs_rdma
def test_rdma_destination_killed_mid_write_fails_its_sender_naming_peer_and_message() -> None:
    link = _Link("rdma")
    try:
        link.start()
        sent = {int(m) for m in link.plan.program(0).send.id}
        sender = link.execute(0, 1)
        receiver = link.execute(1, 1)
        link.writing()
        link.kill(1)
        t0 = time.monotonic()
        with pytest.raises(TransferProcessError) as e:
            sender.result(timeout_s=60)
        msg = str(e.value)
        named = re.search(r"message (\d+)", msg)  # the one in flight: any, on a loaded box
        assert "to slot 1" in msg and named and int(named.group(1)) in sent, msg
        assert time.monotonic() - t0 < 20, msg
        with pytest.raises(TransferProcessError):
            receiver.result(timeout_s=5)
        engines = _engine_ports(link.procs[0].process.pid)
        assert engines
        _again(link, 2, (1,))
        # the survivor kept its engines (and their registrations) across the reconnect
        assert engines <= _engine_ports(link.procs[0].process.pid)
    finally:
        link.close()


@needs_rdma
def test_rdma_stopped_destination_times_out_the_write_never_hangs() -> None:
    link = _Link("rdma")
    pid = 0
    try:
        link.start()
        pid = link.procs[1].process.pid
        # stopped before the refit: stopped after its first bytes, a sender on a loaded box
        # can have written all 128 MiB before the signal lands
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        sender = link.execute(0, 1, timeout_s=4.0)
        receiver = link.execute(1, 1, timeout_s=4.0)
        with pytest.raises(TransferProcessError) as e:
            sender.result(timeout_s=30)
        msg = str(e.value)
        assert "to slot 1" in msg and ("timed out" in msg or "does not answer" in msg), msg
        assert time.monotonic() - t0 < 15, msg
        os.kill(pid, signal.SIGCONT)
        pid = 0
        with pytest.raises(TransferProcessError):
            receiver.result(timeout_s=15)
        _again(link, 2, ())
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        link.close()

"""kill -9 during a refit, over a real `refitd serve`, agent, transfer processes and workers.

The inference rank is its own process (_inference_worker.py); its pause hook can hold a
refit in the PAUSE phase (a gate file) so the kill lands at a known phase. Each case checks
that the refit ends within its timeouts with a clear reason, that nobody hangs, and that
after the member is back the next refit commits bit for bit.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from _child_lines import ChildLines

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.client import RefitError, TrainerClient
from refitd.demo.gpt import ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon, free_port
from refitd.node.process_handle import PROCESS_NAME_PREFIX

from ._inference_worker import SEED, TINY

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("_inference_worker.py"))
FAST = [
    "--heartbeat-interval-s", "0.3",
    "--heartbeat-timeout-s", "5",
    "--pause-timeout-s", "20",
    "--transfer-timeout-s", "20",
    "--connect-timeout-s", "30",
    "--load-timeout-s", "30",
    "--log-level", "info",
]  # fmt: skip


class Worker(ChildLines):
    """An inference worker process and the lines it prints."""

    def __init__(
        self, address: str, model: str, gate: Path, pool: str = "infer", device: str = "cpu:1"
    ) -> None:
        args = [address, model, "--gate", str(gate), "--pool", pool, "--device", device]
        super().__init__([sys.executable, WORKER, *args], "worker")


def status(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        return json.loads(pbg.RefitStub(ch).GetStatus(pb.StatusRequest(), timeout=5).json)


def wait_subscribed(address: str, model: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in status(address)["models"]:
            ranks = [r for p in m["pools"] if p["role"] == "destination" for r in p["ranks"]]
            if m["name"] == model and ranks and all(r["subscribed"] for r in ranks):
                return
        time.sleep(0.05)
    raise AssertionError(f"inference ranks of {model} never subscribed")


class Trainer:
    """One trainer rank on cpu:0 in this process, filled from the shared generator."""

    def __init__(self, address: str, model: str) -> None:
        self.gen = WeightGenerator(SEED)
        self.shards = rank_shards(TINY, ParallelLayout(), 0)
        self.src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in self.shards}
        self.client = TrainerClient(address, model, rank=0, pool_size=1, device="cpu:0")
        self.client.register(self.src)

    def refit(self, version: int, timeout: float = 60.0) -> tuple[str, str, float]:
        """(state, message, seconds) of a WAIT_COMMITTED refit of `version`."""
        for s in self.shards:
            self.gen.fill(self.src[s.name], s, version)
        t0 = time.monotonic()
        try:
            r = self.client.refit(version, wait="committed", timeout=timeout)
            return r.state, r.message, time.monotonic() - t0
        except RefitError as e:
            return "failed", str(e), time.monotonic() - t0

    def refit_async(self, version: int) -> queue.Queue:
        out: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: out.put(self.refit(version)), daemon=True).start()
        return out


def transfer_processes(root: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(root).children(recursive=True)
        if p.name().startswith(PROCESS_NAME_PREFIX)
    ]


@pytest.fixture(scope="module")
def agent_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, list]]:
    """A controller without embedded agent and a `refitd agent` process (restartable)."""
    port = free_port()
    agent_cmd = [
        sys.executable, "-m", "refitd.cli.main", "agent",
        "--controller", f"127.0.0.1:{port}",
        "--devices", "cpu:0,cpu:1",
        "--log-level", "info",
    ]  # fmt: skip
    agents = [subprocess.Popen(agent_cmd)]
    d = Daemon(
        cpu_slots=2,
        grpc_port=port,
        extra_args=[*FAST, "--no-embedded-agent", "--refit-retries", "0"],
    )
    try:
        d.start()
        yield d, [agent_cmd, agents]
    finally:
        for a in agents:
            a.kill()
            a.wait(10)
        d.stop()


def test_kill_inference_worker_during_pause(agent_daemon, tmp_path: Path) -> None:
    d, _ = agent_daemon
    w = Worker(d.address, "kill-infer", tmp_path)
    trainer = Trainer(d.address, "kill-infer")
    w2 = None
    try:
        w.expect("ready")
        wait_subscribed(d.address, "kill-infer")
        (tmp_path / "1").touch()
        assert (r := trainer.refit(1))[0] == "committed", r
        assert w.expect("commit 1") == "commit 1 ok"
        pending = trainer.refit_async(2)
        w.expect("paused 2")
        w.kill()  # in its pause hook: the controller waits for its PAUSE ack
        state, message, seconds = pending.get(timeout=30)
        assert state == "failed"
        assert "closed its subscription" in message, message
        assert seconds < 15  # well within the 20 s pause timeout
        # Restarted, it registers again (the same rank) and the next refit commits.
        w2 = Worker(d.address, "kill-infer", tmp_path)
        assert w2.expect("ready") == "ready 1"
        wait_subscribed(d.address, "kill-infer")
        (tmp_path / "3").touch()
        assert (r := trainer.refit(3))[0] == "committed", r
        assert w2.expect("commit 3") == "commit 3 ok"
    finally:
        trainer.client.close()
        for x in (w, w2):
            if x is not None and x.proc.poll() is None:
                x.kill()


def test_kill_agent_during_a_refit(agent_daemon, tmp_path: Path) -> None:
    d, (agent_cmd, agents) = agent_daemon
    w = Worker(d.address, "kill-agent", tmp_path)
    trainer = Trainer(d.address, "kill-agent")
    try:
        w.expect("ready")
        wait_subscribed(d.address, "kill-agent")
        (tmp_path / "1").touch()
        assert (r := trainer.refit(1))[0] == "committed", r
        w.expect("commit 1")
        pending = trainer.refit_async(2)
        w.expect("paused 2")  # held in PAUSE by the gate
        agents[-1].kill()
        agents[-1].wait(10)
        state, message, seconds = pending.get(timeout=30)
        assert state == "failed"
        assert "disconnected" in message and "agent" in message, message
        assert seconds < 15
        (tmp_path / "2").touch()
        assert w.expect("abort 2").startswith("abort 2")  # never written: resume v1
        # The agent's transfer processes exit with it (no orphan left in a collective).
        agents.append(subprocess.Popen(agent_cmd))
        deadline = time.monotonic() + 60
        while sum(s["connected"] for s in status(d.address)["slots"]) < 2:
            assert time.monotonic() < deadline, "restarted agent never connected"
            time.sleep(0.2)
        (tmp_path / "3").touch()
        assert (r := trainer.refit(3))[0] == "committed", r
        assert w.expect("commit 3") == "commit 3 ok"
    finally:
        trainer.client.close()
        if w.proc.poll() is None:
            w.kill()


@pytest.fixture(scope="module")
def daemon_with_retries() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=[*FAST, "--refit-retries", "2"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_kill_transfer_process_is_retried_while_paused(
    daemon_with_retries: Daemon, tmp_path: Path
) -> None:
    """A transfer process dies after the pool paused: the refit is retried with the pool
    still paused (trainer ranks wait for the commit, so their weights are unchanged) and
    commits bit for bit; the subscriber never sees INCOMPLETE."""
    d = daemon_with_retries
    w = Worker(d.address, "kill-tp", tmp_path)
    trainer = Trainer(d.address, "kill-tp")
    try:
        w.expect("ready")
        wait_subscribed(d.address, "kill-tp")
        (tmp_path / "1").touch()
        assert (r := trainer.refit(1))[0] == "committed", r
        w.expect("commit 1")
        pending = trainer.refit_async(2)
        w.expect("paused 2")
        victims = transfer_processes(d.process.pid)  # type: ignore[union-attr]
        assert len(victims) == 2, victims
        victims[0].kill()
        victims[0].wait(10)
        (tmp_path / "2").touch()
        state, message, _ = pending.get(timeout=60)
        assert state == "committed", message
        assert w.expect("commit 2") == "commit 2 ok"
        doc = status(d.address)
        last = next(r for r in doc["refits"] if r["version"] == 2)
        assert last["state"] == "committed" and last.get("retries", 0) >= 1, last
        (tmp_path / "3").touch()
        assert (r := trainer.refit(3))[0] == "committed", r
        assert w.expect("commit 3") == "commit 3 ok"
    finally:
        trainer.client.close()
        if w.proc.poll() is None:
            w.kill()


def test_abort_reaches_a_slot_before_its_execute() -> None:
    """An abort that arrives before its refit's execute makes that execute fail at once
    (the slot runner's record of aborted refits); an execute of another refit still reaches
    the transfer process (and fails there: nothing is loaded)."""
    from refitd.node.codec import SlotContext
    from refitd.node.slot_runner import SlotRunner
    from refitd.slot_protocol import Failed

    reports: queue.Queue = queue.Queue()
    runner = SlotRunner(
        SlotContext(0), "cpu:0", "test-host", lambda *r: reports.put(r), lambda slot: None
    )

    def execute(command_id: int, refit_id: int) -> Failed:
        runner.submit(
            pb.AgentCommand(
                command_id=command_id,
                execute=pb.ExecuteCommand(
                    digest="d", version=1, refit_id=refit_id, slots=[0], timeout_s=5
                ),
            )
        )
        slot, got_id, got_refit, report, _ = reports.get(timeout=30)
        assert (slot, got_id, got_refit) == (0, command_id, refit_id)
        assert isinstance(report, Failed), report
        return report

    try:
        runner.abort(pb.AgentCommand(abort=pb.AbortCommand(refit_id=41, reason="test")))
        assert "refit 41 was aborted before it started" in execute(1, 41).error
        assert "not loaded" in execute(2, 42).error
    finally:
        runner.close()


def test_lease_of_a_silent_worker_expires(agent_daemon) -> None:
    """A worker that stops heartbeating (and has no subscription) is unregistered within
    heartbeat_timeout_s, and the model's membership epoch moves on."""
    d, _ = agent_daemon
    with grpc.insecure_channel(d.address) as ch:
        stub = pbg.RefitStub(ch)
        tensor = pb.TensorRegistration(
            name="w",
            global_shape=[4],
            dtype="float32",
            local_shape=[4],
            boxes=[pb.Box(offset=[0], shape=[4], local_offset=[0])],
            memory=b"x",
        )
        resp = stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                model="lease",
                pool="trainer",
                role=pb.ROLE_SOURCE,
                rank=0,
                pool_size=1,
                host=socket.gethostname(),
                device="cpu:0",
                pid=1,
                tensors=[tensor],
            ),
            timeout=10,
        )
        t0 = time.monotonic()
        while True:
            doc = json.loads(stub.GetStatus(pb.StatusRequest(), timeout=5).json)
            m = next((m for m in doc["models"] if m["name"] == "lease"), None)
            if m is not None and not any(p["ranks"] for p in m["pools"]):
                break
            assert time.monotonic() - t0 < 15, "silent worker was never expired"
            time.sleep(0.1)
        assert m["epoch"] > resp.epoch
        assert time.monotonic() - t0 > 4.0  # not long before its 5 s lease


def test_restarted_inference_rank_catches_up_from_a_replica(tmp_path: Path) -> None:
    """Two inference replicas (pools on cpu:1 and cpu:2). One is killed and restarted after
    the trainer has moved on (its memory holds the next step): the controller copies the
    committed version from the other replica, so it serves v1 without a refit."""
    d = Daemon(cpu_slots=3, extra_args=FAST)
    d.start()
    a = b = a2 = None
    trainer = None
    try:
        for v in (1, 2):
            (tmp_path / str(v)).touch()
        a = Worker(d.address, "catch-up", tmp_path, "infer-a", "cpu:1")
        b = Worker(d.address, "catch-up", tmp_path, "infer-b", "cpu:2")
        trainer = Trainer(d.address, "catch-up")
        a.expect("ready")
        b.expect("ready")
        wait_subscribed(d.address, "catch-up")
        assert (r := trainer.refit(1))[0] == "committed", r
        assert a.expect("commit 1") == "commit 1 ok"
        assert b.expect("commit 1") == "commit 1 ok"
        a.kill()
        for s in trainer.shards:  # the next training step: the trainer no longer holds v1
            trainer.gen.fill(trainer.src[s.name], s, 2)
        a2 = Worker(d.address, "catch-up", tmp_path, "infer-a", "cpu:1")
        assert a2.expect("ready") == "ready 1"
        assert a2.expect("paused 1", timeout_s=30) == "paused 1"
        assert a2.expect("commit 1", timeout_s=30) == "commit 1 ok"
        doc = status(d.address)
        caught = [r for r in doc["refits"] if r.get("catch_up")]
        assert caught and caught[0]["state"] == "committed" and caught[0]["version"] == 1
        assert (r := trainer.refit(2))[0] == "committed", r
        assert a2.expect("commit 2") == "commit 2 ok"
        assert b.expect("commit 2") == "commit 2 ok"
    finally:
        if trainer is not None:
            trainer.client.close()
        for x in (a, b, a2):
            if x is not None and x.proc.poll() is None:
                x.kill()
        d.stop()

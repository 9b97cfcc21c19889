"""Leases over real gRPC: a silent agent is dropped within heartbeat_timeout_s and the
running refit fails on it; a trainer rank that dies before asking fails the refit when its
lease expires, naming it (not at the barrier timeout); a rank held by a live worker is not
registered by a second process until the holder's heartbeats stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.rpc.process import register_rank
from refitd.server.controller import Controller

from .conftest import Cluster, controller_settings, make_cluster
from .peers import EchoAgent, row_shard
from .test_refit_states import last_event, status

pytestmark = pytest.mark.slow


@pytest.fixture
def short_leases(tmp_path: Path) -> Iterator[Controller]:
    c = Controller(
        controller_settings(
            tmp_path,
            heartbeat_interval_s=0.2,
            heartbeat_timeout_s=1.5,
            transfer_timeout_s=10.0,
            barrier_timeout_s=2.0,
            refit_retry_budget_s=0.5,
        )
    ).start()
    yield c
    c.stop()


def test_silent_agent_is_dropped_and_fails_the_refit(short_leases: Controller) -> None:
    ch = grpc.insecure_channel(short_leases.grpc_address)
    cl = make_cluster(short_leases, pbg.RefitStub(ch))
    try:
        cl.agent.silent.update(cl.agent.slot_ids)  # never reports, never heartbeats
        t0 = time.monotonic()
        out = cl.refit(1)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, pb.RefitResponse) for r in out), out
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out), out
        assert (
            f"agent {cl.agent.agent_id} on host {cl.host!r} missed its heartbeats for 1.5s "
            "(lease expired)" in out[0].message
        ), out[0].message
        assert elapsed < 5.0  # the lease, not the 10 s transfer timeout
        assert (
            last_event(cl.subscribers[0], pb.EVENT_KIND_INCOMPLETE).kind == pb.EVENT_KIND_INCOMPLETE
        )
    finally:
        cl.stop()
        ch.close()


def test_dead_trainer_rank_fails_the_barrier_at_its_lease(tmp_path: Path) -> None:
    """Rank 0 asks (and heartbeats); rank 1 never asks and stops heartbeating (it died):
    the refit fails when rank 1's lease expires, naming it, not at the barrier timeout."""
    c = Controller(
        controller_settings(
            tmp_path, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, barrier_timeout_s=60.0
        )
    ).start()
    ch = grpc.insecure_channel(c.grpc_address)
    stub = pbg.RefitStub(ch)
    cl = make_cluster(c, stub)
    alive = threading.Event()

    def heartbeat_rank0() -> None:
        while not alive.wait(0.2):
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=cl.trainers[0]), timeout=5)

    beats = threading.Thread(target=heartbeat_rank0, daemon=True)
    beats.start()
    try:
        doc = json.loads(stub.GetStatus(pb.StatusRequest(model=cl.model), timeout=5).json)
        epoch0 = doc["models"][0]["epoch"]
        t0 = time.monotonic()
        (r,) = cl.refit(1, ranks=[0])  # rank 1 never asks (it died)
        elapsed = time.monotonic() - t0
        assert r.state == pb.REFIT_STATE_FAILED
        assert f"worker {cl.trainers[1]} (rank 1 of pool 'trainer')" in r.message, r.message
        assert "lease expired" in r.message and "barrier" in r.message, r.message
        assert "rank 0 of" not in r.message, r.message
        assert elapsed < 1.5 + 5.0, elapsed  # its lease (+ margin), far from the 60 s barrier
        # It left the pool and the epoch moved on.
        doc = json.loads(stub.GetStatus(pb.StatusRequest(model=cl.model), timeout=5).json)
        m = doc["models"][0]
        trainer = next(p for p in m["pools"] if p["name"] == "trainer")
        assert [x["rank"] for x in trainer["ranks"]] == [0]
        assert m["epoch"] > epoch0
    finally:
        alive.set()
        beats.join(5)
        cl.stop()
        ch.close()
        c.stop()


def test_trainer_rank_that_unregisters_fails_the_barrier_at_once(
    cluster: Cluster, stub: pbg.RefitStub
) -> None:
    """close() of a trainer rank while rank 0 waits for it in the barrier: the refit fails
    at once, naming the rank that left (the barrier timeout would name 'never asked')."""
    out: list = []
    asking = threading.Thread(target=lambda: out.extend(cluster.refit(1, ranks=[0])))
    asking.start()
    deadline = time.monotonic() + 10
    while status(stub, cluster.model)["models"][0]["running"] is None:
        assert time.monotonic() < deadline, "rank 0's request never started a refit"
        time.sleep(0.01)
    stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id=cluster.trainers[1]), timeout=5)
    asking.join(30)
    (r,) = out
    assert r.state == pb.REFIT_STATE_FAILED
    assert f"worker {cluster.trainers[1]} (rank 1 of pool 'trainer') unregistered" in r.message
    assert "barrier timeout" not in r.message, r.message


def test_agent_lease_counts_from_its_command_stream(tmp_path: Path) -> None:
    """A real agent spawns its transfer processes between RegisterAgent and opening its
    command stream, which on a loaded host takes longer than a lease: once the stream is
    open and it heartbeats, it must not be dropped for the time before."""
    c = Controller(
        controller_settings(tmp_path, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    ).start()
    ch = grpc.insecure_channel(c.grpc_address)
    agents = pbg.AgentControlStub(ch)
    stop = threading.Event()
    try:
        resp = agents.RegisterAgent(
            pb.RegisterAgentRequest(host="slow", slots=[pb.SlotInfo(device="cpu:0")], pid=1),
            timeout=10,
        )
        time.sleep(1.0)  # the slow start itself (two leases), not a synchronisation
        stream = agents.Commands(pb.AgentStreamRequest(agent_id=resp.agent_id))
        ended = threading.Event()

        def read() -> None:
            try:
                for _ in stream:
                    pass
                ended.set()  # closed by the controller
            except grpc.RpcError:
                pass  # cancelled by the test

        threading.Thread(target=read, daemon=True).start()

        def beat() -> None:
            while not stop.wait(0.1):
                agents.AgentHeartbeat(pb.AgentHeartbeatRequest(agent_id=resp.agent_id), timeout=5)

        threading.Thread(target=beat, daemon=True).start()
        stub = pbg.RefitStub(ch)
        deadline = time.monotonic() + 10
        while not any(a["connected"] for a in status_doc(stub)["agents"]):
            assert time.monotonic() < deadline, "the agent never connected"
            time.sleep(0.01)
        # The lease watcher runs every 0.1 s: several passes while it heartbeats.
        assert not ended.wait(1.0), "the controller dropped a heartbeating agent"
        assert any(a["connected"] for a in status_doc(stub)["agents"])
        stream.cancel()
    finally:
        stop.set()
        ch.close()
        c.stop()


def status_doc(stub: pbg.RefitStub) -> dict:
    return json.loads(stub.GetStatus(pb.StatusRequest(), timeout=5).json)


def test_heartbeats_are_answered_while_the_registry_is_busy(short_leases: Controller) -> None:
    """A burst of registrations holds the registry lock through its SQLite writes; worker
    and agent heartbeats renew their leases without it, so none expires meanwhile (1,024
    registering ranks had starved hundreds of heartbeats past a 10 s lease)."""
    ch = grpc.insecure_channel(short_leases.grpc_address)
    stub = pbg.RefitStub(ch)
    agents = pbg.AgentControlStub(ch)
    cl = make_cluster(short_leases, stub)
    reg = short_leases.registry
    held, release = threading.Event(), threading.Event()

    def busy() -> None:
        with reg.lock:  # as a registration does while it writes to the database
            held.set()
            release.wait(10)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        assert held.wait(5)
        before = reg.workers[cl.trainers[0]].last_seen
        t0 = time.monotonic()
        for _ in range(3):
            resp = stub.Heartbeat(pb.HeartbeatRequest(worker_id=cl.trainers[0]), timeout=2)
            agents.AgentHeartbeat(pb.AgentHeartbeatRequest(agent_id=cl.agent.agent_id), timeout=2)
        assert time.monotonic() - t0 < 2.0
        assert resp.epoch == reg.models[cl.model].epoch
        assert reg.workers[cl.trainers[0]].last_seen > before
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(worker_id="nosuchworker"), timeout=2)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nosuchworker" in (e.value.details() or "")
    finally:
        release.set()
        t.join(5)
        cl.agent.stop()
        ch.close()


def test_heartbeat_period_handed_out_is_a_fraction_of_the_lease(tmp_path: Path) -> None:
    """Workers and agents are told to beat every heartbeat_interval_s, but never less often
    than three times a lease, whatever the two settings say."""
    c = Controller(
        controller_settings(tmp_path, heartbeat_interval_s=2.5, heartbeat_timeout_s=3.0)
    ).start()
    ch = grpc.insecure_channel(c.grpc_address)
    try:
        resp = pbg.AgentControlStub(ch).RegisterAgent(
            pb.RegisterAgentRequest(host="hb-host", slots=[pb.SlotInfo(device="cpu:0")], pid=1),
            timeout=10,
        )
        assert resp.heartbeat_interval_s == pytest.approx(1.0)  # a third of the 3 s lease
        assert c.settings.heartbeat_period_s == pytest.approx(1.0)
    finally:
        ch.close()
        c.stop()


def test_a_rank_held_by_a_live_trainer_is_refused_until_its_heartbeats_stop(
    short_leases: Controller,
) -> None:
    """A second process registering rank 0 of a pool of 1 while the first one heartbeats
    is refused, naming the holder; the holder's own re-registration goes through; once its
    heartbeats stop, a new process takes the rank over."""
    ch = grpc.insecure_channel(short_leases.grpc_address)
    stub = pbg.RefitStub(ch)
    agent = EchoAgent(short_leases.grpc_address, "dup-host", ["cpu:0"]).start()

    def request(pid: int, worker_id: str = "") -> pb.RegisterWorkerRequest:
        return pb.RegisterWorkerRequest(
            model="dup", pool="train", role=pb.ROLE_SOURCE, rank=0, pool_size=1,
            host="dup-host", device="cpu:0", pid=pid, worker_id=worker_id,
            tensors=[row_shard("w", 4, 8, 0, 1)],
        )  # fmt: skip

    first = stub.RegisterWorker(request(7), timeout=5).worker_id
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=first), timeout=5)

    beats = threading.Thread(target=beat, daemon=True)
    beats.start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterWorker(request(8), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            f"rank 0 of pool 'train' of model 'dup' is held by live worker {first} (rank 0 of "
            "pool 'train'), pid 7 on host 'dup-host' (it renewed its lease" in e.value.details()
        ), e.value.details()
        assert stub.RegisterWorker(request(7, first), timeout=5).worker_id == first
        stop.set()
        beats.join(5)
        second = stub.RegisterWorker(request(9), timeout=5).worker_id
        assert second != first
        assert short_leases.registry.worker(second).pid == 9
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=first), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stop.set()
        beats.join(5)
        agent.stop()
        ch.close()


def _identity(pid: int) -> pb.ProcessIdentity:
    """The identity of process `pid` on this host, read from /proc here."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return pb.ProcessIdentity(
        boot_id=Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        pid_namespace=os.readlink("/proc/self/ns/pid"),
        pid=pid,
        start_ticks=int(raw[raw.rindex(")") + 2 :].split()[19]),
    )


def test_a_restart_on_the_holders_host_takes_the_rank_at_once_once_the_holder_is_gone(
    controller: Controller,
) -> None:
    """The rank's holder is a real process on this host. A registration from this host
    while it runs is refused at once, naming it (not granted after the holder's silence);
    once it is killed, the next registration takes the rank at once, well inside the
    silence a holder on another host is waited for."""
    s = controller.settings
    silence_s = min(s.heartbeat_timeout_s, 2 * s.heartbeat_period_s + 1.0)
    assert silence_s >= 4.0
    ch = grpc.insecure_channel(controller.grpc_address)
    stub = pbg.RefitStub(ch)
    agent = EchoAgent(controller.grpc_address, "pid-host", ["cpu:0"]).start()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])

    def request() -> pb.RegisterWorkerRequest:
        return pb.RegisterWorkerRequest(
            model="restart", pool="train", role=pb.ROLE_SOURCE, rank=0, pool_size=1,
            host="pid-host", device="cpu:0", pid=os.getpid(),
            tensors=[row_shard("w", 4, 8, 0, 1)],
        )  # fmt: skip

    try:
        first_req = request()
        first_req.process.CopyFrom(_identity(holder.pid))
        first = stub.RegisterWorker(first_req, timeout=5).worker_id
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            register_rank(stub.RegisterWorker, request(), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"held by live worker {first}" in e.value.details(), e.value.details()
        assert "once it is gone there" in e.value.details(), e.value.details()
        assert time.monotonic() - t0 < silence_s / 2
        # refused for the holder before its tensors are validated (a restart registers
        # again naming the holder: its tensors are checked once)
        bad = request()
        bad.tensors[0].dtype = "no-such-dtype"
        bad.process.CopyFrom(_identity(os.getpid()))
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterWorker(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()

        holder.kill()
        holder.wait(10)
        t0 = time.monotonic()
        second = register_rank(stub.RegisterWorker, request(), timeout=30).worker_id
        assert time.monotonic() - t0 < silence_s / 2
        assert second != first
        assert controller.registry.worker(second).pid == os.getpid()
    finally:
        holder.kill()
        holder.wait(10)
        agent.stop()
        ch.close()


def test_a_stopped_watcher_expires_no_more_leases(short_leases: Controller) -> None:
    """Stopping the controller stops the watcher before the database closes: an expiry
    pass still running (thousands of workers silent at once at a shutdown) leaves the
    remaining workers and agents as they are instead of writing to a closed database."""
    ch = grpc.insecure_channel(short_leases.grpc_address)
    cl = make_cluster(short_leases, pbg.RefitStub(ch))
    try:
        leases = short_leases.refits.leases
        leases.stop()
        leases.expire(time.monotonic() + 3600)  # every lease counts as expired
        for wid in (*cl.trainers, *cl.inference):
            assert short_leases.registry.worker(wid).worker_id == wid
        assert short_leases.agents.connected(cl.agent.agent_id)
    finally:
        cl.stop()
        ch.close()

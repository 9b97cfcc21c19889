"""The refit state machine over real gRPC: an agent peer answers commands, a subscriber acks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.refit_states import state_name
from refitd.server.controller import Controller

from .conftest import Cluster, controller_settings, make_cluster
from .peers import Subscriber

pytestmark = pytest.mark.slow


def test_state_names_users_see() -> None:
    """The names the status document, the refit history and RefitResult.state carry, one
    per RefitState of the proto (an unknown state, from a newer controller, is unspecified)."""
    assert [state_name(s) for s in pb.RefitState.values()] == [
        *("unspecified", "requested", "sources_ready", "transferring", "landed"),
        *("committed", "failed", "superseded"),
    ]
    assert state_name(99) == "unspecified"


def last_event(sub: Subscriber, kind: int, timeout_s: float = 5.0) -> pb.VersionEvent:
    """The subscriber's last event once it is of `kind` (events trail the Refit answer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.events and sub.events[-1].kind == kind:
            break
        time.sleep(0.01)
    return sub.events[-1]


def status(stub: pbg.RefitStub, model: str) -> dict:
    return json.loads(stub.GetStatus(pb.StatusRequest(model=model), timeout=5).json)


def test_refit_commits_and_subscriber_sees_versions_in_order(cluster: Cluster) -> None:
    for v in (1, 2):
        out = cluster.refit(v)
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in out), out
    # Committed = landed and logged; COMMIT events reach subscribers right after.
    deadline = time.monotonic() + 5
    while len(cluster.subscribers[0].events) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    kinds = cluster.subscribers[0].kinds()
    assert kinds == [
        (pb.EVENT_KIND_HELLO, 0),
        (pb.EVENT_KIND_PAUSE, 1),
        (pb.EVENT_KIND_COMMIT, 1),
        (pb.EVENT_KIND_PAUSE, 2),
        (pb.EVENT_KIND_COMMIT, 2),
    ]
    ids = [e.event_id for e in cluster.subscribers[0].events]
    assert ids == sorted(ids)
    # The first refit connects and loads, the second replays the cached plan.
    assert cluster.agent.kinds() == ["connect", *["load"] * 3, *["execute"] * 3, *["execute"] * 3]
    st = status(cluster.stub, cluster.model)
    m = st["models"][0]
    assert m["committed_version"] == 2
    assert [v["version"] for v in m["versions"]] == [2, 1]
    assert st["refits"][0]["state"] == "committed"
    # Both trainer ranks send their half of the 4x8 float32 tensor to the inference slot.
    assert st["refits"][0]["bytes"] == 4 * 8 * 4


def test_default_wait_returns_when_sources_read(cluster: Cluster) -> None:
    out = cluster.refit(1, wait=pb.WAIT_SOURCES_READ)
    assert all(
        r.state in (pb.REFIT_STATE_TRANSFERRING, pb.REFIT_STATE_LANDED, pb.REFIT_STATE_COMMITTED)
        for r in out
    ), out
    deadline = time.monotonic() + 10
    while status(cluster.stub, cluster.model)["models"][0]["committed_version"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_preconditions_name_the_problem(cluster: Cluster) -> None:
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(3))
    err = cluster.refit(2, ranks=[0])[0]
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not newer than the committed version 3" in err.details()
    with pytest.raises(grpc.RpcError) as e:
        cluster.stub.Refit(pb.RefitRequest(worker_id=cluster.inference[0], version=4), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only source (trainer) ranks call Refit" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        cluster.stub.Refit(pb.RefitRequest(worker_id="nobody", version=4), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nobody'" in e.value.details()


def test_barrier_timeout_names_missing_ranks(cluster: Cluster) -> None:
    (r,) = cluster.refit(1, ranks=[0])
    assert r.state == pb.REFIT_STATE_FAILED
    assert "ranks [1] of pool trainer never asked for version 1" in r.message


def test_failed_transfer_keeps_last_version(controller: Controller, stub: pbg.RefitStub) -> None:
    cl = make_cluster(controller, stub)
    try:
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl.refit(1))
        bad_slot = cl.agent.slot_ids[2]
        cl.agent.fail_execute[bad_slot] = "recv from slot 0 timed out"
        out = cl.refit(2)
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out), out
        # Trainer ranks wait for the commit (sources unchanged): retried twice, pool paused.
        assert out[0].message == (
            f"slot {bad_slot} on agent {cl.agent.agent_id}: recv from slot 0 timed out "
            "(after 2 retries)"
        )
        assert status(stub, cl.model)["models"][0]["committed_version"] == 1
        assert cl.agent.kinds().count("abort") == 3
        last_event(cl.subscribers[0], pb.EVENT_KIND_INCOMPLETE)
        v2 = [e.kind for e in cl.subscribers[0].events if e.version == 2]
        assert v2 == [pb.EVENT_KIND_PAUSE, pb.EVENT_KIND_INCOMPLETE]  # paused until the end
        # Each attempt reconnects (an abort drops the communicator); so does the next refit.
        del cl.agent.fail_execute[bad_slot]
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl.refit(3))
        assert cl.agent.kinds().count("connect") == 4  # v1, the 2 retries of v2, v3
    finally:
        cl.stop()


def test_silent_slot_times_out(controller: Controller, stub: pbg.RefitStub) -> None:
    cl = make_cluster(controller, stub)
    try:
        cl.agent.silent.add(cl.agent.slot_ids[0])
        out = cl.refit(1)
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out)
        assert "transfer of version 1: timed out after 3s" in out[0].message
        assert status(stub, cl.model)["models"][0]["committed_version"] == 0
    finally:
        cl.stop()


def test_refused_pause_aborts_untouched_pool(controller: Controller, stub: pbg.RefitStub) -> None:
    cl = make_cluster(controller, stub)
    try:
        cl.subscribers[0].refuse = "engine busy"
        out = cl.refit(1)
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out)
        assert "refused pause of version 1: engine busy" in out[0].message
        assert last_event(cl.subscribers[0], pb.EVENT_KIND_ABORT).kind == pb.EVENT_KIND_ABORT
        assert "execute" not in cl.agent.kinds()
        cl.subscribers[0].refuse = ""
        cl.subscribers[0].moved = ["w"]
        out = cl.refit(2)
        assert "moved storage of tensors ['w']; it must re-register" in out[0].message
    finally:
        cl.stop()


def test_newer_requests_coalesce_to_newest(controller: Controller, stub: pbg.RefitStub) -> None:
    cl = make_cluster(controller, stub)
    try:
        slot = cl.agent.slot_ids[0]
        cl.agent.silent.add(slot)  # v1 stalls in transfer until its timeout
        results: dict[int, list] = {}
        threads = [threading.Thread(target=lambda: results.__setitem__(1, cl.refit(1)))]
        threads[0].start()
        deadline = time.monotonic() + 5
        while status(stub, cl.model)["models"][0]["running"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for v in (2, 3):
            t = threading.Thread(target=lambda v=v: results.__setitem__(v, cl.refit(v)))
            t.start()
            threads.append(t)
        # v2 and v3 fully requested (both ranks asked) while v1 runs.
        deadline = time.monotonic() + 10
        while [
            (p["version"], p["asked"]) for p in status(stub, cl.model)["models"][0]["pending"]
        ] != [(2, [0, 1]), (3, [0, 1])]:
            assert time.monotonic() < deadline, status(stub, cl.model)["models"][0]
            time.sleep(0.01)
        cl.agent.silent.discard(slot)
        for t in threads:
            t.join(30)
        # v1's transfer timed out, its retry (pool still paused) committed once the slot
        # answered again; meanwhile v2 and v3 were requested: v3 runs, v2 is coalesced.
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in results[1]), results[1]
        assert all(r.state == pb.REFIT_STATE_SUPERSEDED for r in results[2])
        assert "coalesced into version 3" in results[2][0].message
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in results[3])
        assert status(stub, cl.model)["models"][0]["committed_version"] == 3
    finally:
        cl.stop()


def test_agent_gone_fails_running_refit(tmp_path: Path) -> None:
    """The agent leaves mid-transfer: the refit fails at once, retries wait for it within
    the retry budget (pool paused), then the subscriber is told INCOMPLETE."""
    c = Controller(
        controller_settings(tmp_path, refit_retry_budget_s=1.0, transfer_timeout_s=30.0)
    ).start()
    ch = grpc.insecure_channel(c.grpc_address)
    stub = pbg.RefitStub(ch)
    cl = make_cluster(c, stub)

    def stop_agent_in_transfer() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            running = status(stub, cl.model)["models"][0]["running"]
            if running is not None and running["state"] == "transferring":
                break
            time.sleep(0.01)
        cl.agent.stop()

    try:
        cl.agent.silent.add(cl.agent.slot_ids[1])
        t0 = time.monotonic()
        stopper = threading.Thread(target=stop_agent_in_transfer, daemon=True)
        stopper.start()
        out = cl.refit(1)
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out)
        gone = f"agent {cl.agent.agent_id} on host {cl.host!r} disconnected"
        assert out[0].message.startswith(gone + " (after 1 retries: "), out[0].message
        assert "have no connected node agent" in out[0].message
        assert time.monotonic() - t0 < 15  # the agent's loss, not the 30 s transfer timeout
        stopper.join(5)
        assert (
            last_event(cl.subscribers[0], pb.EVENT_KIND_INCOMPLETE).kind == pb.EVENT_KIND_INCOMPLETE
        )
    finally:
        for s in cl.subscribers:
            s.stop()
        ch.close()
        c.stop()

"""Registration over real gRPC: validation messages, epochs, one process per rank, unknown
ids."""

from __future__ import annotations

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller

from .conftest import Cluster, register
from .peers import EchoAgent, Subscriber, row_shard, tensor

pytestmark = pytest.mark.slow


def request(cl: Cluster, **kw: object) -> pb.RegisterWorkerRequest:
    base: dict[str, object] = dict(
        model=cl.model,
        pool="infer2",
        role=pb.ROLE_DESTINATION,
        rank=0,
        pool_size=1,
        host=cl.host,
        device="cpu:2",
        tensors=[row_shard("w", 4, 8, 0, 1)],
    )
    base.update(kw)
    return pb.RegisterWorkerRequest(**base)  # type: ignore[arg-type]


def refused(stub: pbg.RefitStub, req: pb.RegisterWorkerRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterWorker(req, timeout=5)
    return e.value


# an empty shard (torch.chunk gives trailing ranks nothing): no boxes, a local dim of 0
EMPTY: dict[str, object] = dict(
    name="w", global_shape=[4, 8], dtype="float32", local_shape=[0, 8], boxes=[], memory=b"x"
)

CASES = [
    (
        dict(rank=2, pool_size=2),
        "INVALID_ARGUMENT",
        "field rank 2 of pool 'infer2' is outside [0, pool_size=2)",
    ),
    (dict(device="gpu0"), "INVALID_ARGUMENT", "device 'gpu0' must look like 'cpu:K' or 'cuda:K'"),
    (dict(role=pb.ROLE_UNSPECIFIED), "INVALID_ARGUMENT", "field role of rank 0 in pool 'infer2'"),
    (
        dict(tensors=[tensor("w", [4, 8], [0, 0], [4, 8])] * 2),
        "INVALID_ARGUMENT",
        "tensor 'w' of rank 0 in pool 'infer2': duplicate tensor name",
    ),
    (
        dict(tensors=[tensor("w", [4, 8], [2, 0], [4, 8])]),
        "INVALID_ARGUMENT",
        "tensor 'w' of rank 0 in pool 'infer2': box 0 dim 0: offset 2 + shape 4 exceeds global_shape 4",
    ),
    (
        dict(tensors=[tensor("w", [4, 8], [0], [4, 8])]),
        "INVALID_ARGUMENT",
        "box 0 offset [0] has 1 dims, global_shape [4, 8] has 2",
    ),
    (
        dict(
            tensors=[
                pb.TensorRegistration(
                    name="w",
                    global_shape=[2],
                    dtype="float33",
                    local_shape=[2],
                    boxes=[pb.Box(offset=[0], shape=[2], local_offset=[0])],
                    memory=b"x",
                )
            ]
        ),
        "INVALID_ARGUMENT",
        "tensor 'w' of rank 0 in pool 'infer2': unknown dtype 'float33'",
    ),
    (
        dict(tensors=[pb.TensorRegistration(**{**EMPTY, "local_shape": [2, 8]})]),
        "INVALID_ARGUMENT",
        "tensor 'w' of rank 0 in pool 'infer2': no boxes, but local_shape [2, 8] holds 16 "
        "elements (only an empty shard",
    ),
    (dict(device="cpu:7"), "FAILED_PRECONDITION", "no node agent serves device cpu:7 on host"),
    (
        dict(pool="trainer", role=pb.ROLE_DESTINATION),
        "FAILED_PRECONDITION",
        "registers as destination, but the pool is a source pool",
    ),
    (
        dict(pool="trainer2", role=pb.ROLE_SOURCE),
        "FAILED_PRECONDITION",
        "already has source pool 'trainer'",
    ),
    (
        dict(pool="trainer", role=pb.ROLE_SOURCE, rank=1, pool_size=2, adapter=True),
        "INVALID_ARGUMENT",
        "rank 1 of pool 'trainer' sets adapter, but only destination (inference) pools",
    ),
    (
        dict(adapter=True, staged=True),
        "INVALID_ARGUMENT",
        "rank 0 of pool 'infer2' sets both adapter and staged",
    ),
    (
        dict(pool="trainer", role=pb.ROLE_SOURCE, pool_size=3),
        "FAILED_PRECONDITION",
        "says pool_size=3, the registered ranks say 2",
    ),
]


@pytest.mark.parametrize(("change", "code", "message"), CASES)
def test_bad_registration_is_refused_with_its_reason(
    cluster: Cluster, change: dict, code: str, message: str
) -> None:
    before = cluster.stub.GetStatus(pb.StatusRequest(model=cluster.model), timeout=5).json
    err = refused(cluster.stub, request(cluster, **change))
    assert err.code().name == code
    assert message in err.details()
    after = cluster.stub.GetStatus(pb.StatusRequest(model=cluster.model), timeout=5).json
    assert before.split('"uptime_s"')[0] == after.split('"uptime_s"')[0]  # no state change


def test_global_shape_must_agree_within_pool(cluster: Cluster) -> None:
    # rank 0 registered "w" first: its own shape doesn't count, rank 1's does
    for rank, start, other in ((1, 3, 0), (0, 0, 1)):
        err = refused(
            cluster.stub,
            request(
                cluster,
                pool="trainer",
                role=pb.ROLE_SOURCE,
                rank=rank,
                pool_size=2,
                device=f"cpu:{rank}",
                tensors=[tensor("w", [6, 8], [start, 0], [3, 8])],
            ),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        want = f"global_shape [6, 8] disagrees with [4, 8] registered by rank {other}"
        assert want in err.details()


def test_epochs_bump_and_a_live_rank_is_not_registered_twice(cluster: Cluster) -> None:
    r1 = register(
        cluster.stub, cluster.model, "infer2", pb.ROLE_DESTINATION, 0, 1, cluster.host, "cpu:2"
    )
    # The same worker registering again (its client after a restart or moved storage)
    # replaces its own registration at once.
    again = request(cluster, worker_id=r1.worker_id, pid=100)
    r2 = cluster.stub.RegisterWorker(again, timeout=5)
    assert r2.epoch == r1.epoch + 1
    assert r2.worker_id == r1.worker_id and r2.slot == cluster.agent.slot_ids[2]
    # A second process (another identity) while the holder's subscription is open: refused,
    # naming the rank, the pool and the holder, and nothing changes.
    sub = Subscriber(cluster.stub, r1.worker_id).start()
    try:
        err = refused(cluster.stub, request(cluster, pid=4242))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            f"rank 0 of pool 'infer2' of model {cluster.model!r} is held by live worker "
            f"{r1.worker_id} (rank 0 of pool 'infer2'), pid 100 on host {cluster.host!r} "
            "(its subscription is open)" in err.details()
        ), err.details()
        assert (
            cluster.stub.Heartbeat(pb.HeartbeatRequest(worker_id=r1.worker_id), timeout=5).epoch
            == r2.epoch
        )
    finally:
        sub.stop()
    cluster.stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id=r1.worker_id), timeout=5)
    assert (
        cluster.stub.Heartbeat(pb.HeartbeatRequest(worker_id=cluster.trainers[0]), timeout=5).epoch
        == r2.epoch + 1
    )


def test_agents_unknown_ids_and_bad_reports(controller: Controller, stub: pbg.RefitStub) -> None:
    ch = grpc.insecure_channel(controller.grpc_address)
    agents = pbg.AgentControlStub(ch)
    with pytest.raises(grpc.RpcError) as e:
        agents.AgentHeartbeat(pb.AgentHeartbeatRequest(agent_id="ghost"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'ghost'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        agents.RegisterAgent(
            pb.RegisterAgentRequest(host="hx", slots=[pb.SlotInfo(device="cpu:0")] * 2), timeout=5
        )
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "device twice" in e.value.details()
    )
    agent = EchoAgent(controller.grpc_address, "host-reports", ["cpu:0"]).start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            agents.Report(
                pb.AgentReport(agent_id=agent.agent_id, slot=9999, kind=pb.REPORT_KIND_DONE),
                timeout=5,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "slot 9999, which it does not serve" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(agents.Commands(pb.AgentStreamRequest(agent_id="ghost"), timeout=5))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        agent.stop()
        ch.close()

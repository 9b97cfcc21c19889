"""A rank paused by a refit that a dead controller never finished is told how it ended.

The "crash" is the database a controller leaves behind when killed mid-refit (rows written
through StateDB as the coordinator writes them); a real controller then starts on it and a
destination rank re-registers over gRPC saying which refit paused it. `refitd bench faults`
and tests/e2e/test_fault_suite.py kill a real controller process for the same path.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller
from refitd.server.database import StateDB

from .conftest import controller_settings
from .peers import EchoAgent, Subscriber, row_shard

MODEL = "crashed"


def _left_behind(data_dir: Path) -> dict[str, int]:
    """Refits as a killed controller leaves them: v1 committed, v2 killed while
    transferring, v3 killed before writing."""
    db = StateDB(data_dir)
    ids = {}
    ids["committed"] = db.start_refit(MODEL, 1, "requested")
    db.commit_version(MODEL, 1, ids["committed"], 64, 0.1, 1)
    ids["transferring"] = db.start_refit(MODEL, 2, "requested")
    db.mark_refit(ids["transferring"], "transferring")
    ids["requested"] = db.start_refit(MODEL, 3, "requested")
    db.close()
    return ids


def _register(stub: pbg.RefitStub, rank: int, paused: int, role: int = pb.ROLE_DESTINATION) -> str:
    req = pb.RegisterWorkerRequest(
        model=MODEL,
        pool="infer" if role == pb.ROLE_DESTINATION else "trainer",
        role=role,
        rank=rank,
        pool_size=4,
        host="h",
        device=f"cpu:{rank}",
        pid=1,
        tensors=[row_shard("w", 8, 8, rank, 4)],
        paused_refit_id=paused,
    )
    return stub.RegisterWorker(req, timeout=10).worker_id


def history_state(c: Controller, refit_id: int) -> str:
    return next(r.state for r in c.refits.history if r.refit_id == refit_id)


def _answer(sub: Subscriber) -> pb.VersionEvent:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answers = [e for e in sub.events if e.kind != pb.EVENT_KIND_HELLO]
        if answers:
            return answers[0]
        time.sleep(0.02)
    raise AssertionError(f"no answer after HELLO: {sub.kinds()}")


def test_restarted_controller_answers_each_paused_rank(tmp_path: Path) -> None:
    ids = _left_behind(tmp_path)
    c = Controller(controller_settings(tmp_path)).start()
    ch = grpc.insecure_channel(c.grpc_address)
    stub = pbg.RefitStub(ch)
    subs: list[Subscriber] = []
    agent = EchoAgent(c.grpc_address, "h", [f"cpu:{i}" for i in range(4)]).start()
    try:
        assert history_state(c, ids["committed"]) == "committed"  # logged before the kill
        history = {r.refit_id: r for r in c.refits.history}
        assert history[ids["transferring"]].state == "failed"
        assert "controller restarted" in history[ids["transferring"]].reason
        cases = [ids["transferring"], ids["requested"], ids["committed"], 987654]
        for rank, rid in enumerate(cases):
            subs.append(Subscriber(stub, _register(stub, rank, rid)).start())
        got = [_answer(s) for s in subs]
        assert [(e.kind, e.version, e.refit_id) for e in got] == [
            (pb.EVENT_KIND_INCOMPLETE, 2, ids["transferring"]),
            (pb.EVENT_KIND_ABORT, 3, ids["requested"]),
            (pb.EVENT_KIND_COMMIT, 1, ids["committed"]),
            (pb.EVENT_KIND_INCOMPLETE, 0, 987654),
        ]
        assert "controller restarted during the refit (it was transferring)" in got[0].reason
        assert "unknown" in got[3].reason
        # Answered once: a re-subscription gets only HELLO.
        again = Subscriber(stub, subs[0].worker_id).start()
        subs.append(again)
        time.sleep(0.5)
        assert again.kinds() == [(pb.EVENT_KIND_HELLO, 1)]
        # The rank that got COMMIT holds v1, the committed version: no catch-up needed.
        assert c.registry.worker(subs[2].worker_id).holds == 1
    finally:
        for s in subs:
            s.stop()
        agent.stop()
        ch.close()
        c.stop()


@pytest.mark.parametrize(
    "paused,role,field",
    [
        (-1, pb.ROLE_DESTINATION, "paused_refit_id of rank 0"),
        (5, pb.ROLE_SOURCE, "only destination"),
    ],
)
def test_bad_paused_refit_id_is_rejected(
    stub: pbg.RefitStub, paused: int, role: int, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, 0, paused, role)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()

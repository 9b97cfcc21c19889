"""Leases over real gRPC: a silent agent is dropped within heartbeat_timeout_s and the
running refit fails on it; a trainer rank that dies before asking never blocks the others
beyond the barrier timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller

from .conftest import controller_settings, make_cluster
from .test_refit_states import last_event

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


def test_dead_trainer_rank_fails_the_barrier_in_time(short_leases: Controller) -> None:
    ch = grpc.insecure_channel(short_leases.grpc_address)
    stub = pbg.RefitStub(ch)
    cl = make_cluster(short_leases, stub)
    try:
        doc = json.loads(stub.GetStatus(pb.StatusRequest(model=cl.model), timeout=5).json)
        epoch0 = doc["models"][0]["epoch"]
        t0 = time.monotonic()
        (r,) = cl.refit(1, ranks=[0])  # rank 1 never asks (it died)
        assert r.state == pb.REFIT_STATE_FAILED
        assert "ranks [1] of pool trainer never asked for version 1" in r.message
        assert time.monotonic() - t0 < 4.0
        # Its lease expires (no heartbeats): it leaves the pool and the epoch moves on.
        doc_epoch = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            doc = json.loads(stub.GetStatus(pb.StatusRequest(model=cl.model), timeout=5).json)
            m = doc["models"][0]
            trainer = next((p for p in m["pools"] if p["name"] == "trainer"), None)
            if trainer is None or trainer["registered"] < 2:
                doc_epoch = m["epoch"]
                break
            time.sleep(0.1)
        assert doc_epoch is not None, "silent trainer ranks were never expired"
        assert doc_epoch > epoch0
    finally:
        cl.stop()
        ch.close()

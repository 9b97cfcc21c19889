"""Plans ahead: once every pool of a model is registered, the controller builds its next
plan and slot programs while no refit is pending; the refit then builds nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller
from refitd.server.status import status_document

from .conftest import Cluster, controller_settings, make_cluster, register

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ahead_controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    c = Controller(controller_settings(tmp_path_factory.mktemp("state"), plan_ahead=True)).start()
    yield c
    c.stop()


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_next_plan_is_built_before_the_refit_asks(ahead_controller: Controller) -> None:
    c = ahead_controller
    ch = grpc.insecure_channel(c.grpc_address)
    cl: Cluster | None = None
    try:
        stub = pbg.RefitStub(ch)
        cl = make_cluster(c, stub)
        _wait(lambda: c.refits.ahead.ready(cl.model), "the plan built ahead")
        built, hits = c.refits.plans.built, c.refits.plans.hits
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl.refit(1))
        assert c.refits.plans.built == built  # the refit built no plan
        assert c.refits.memberships.cached(cl.model).plan.built_programs == 3
        # built by a planning process, as the status document says
        planning = status_document(c)["controller"]["plan_cache"]["planning_process"]
        assert planning["started"] >= 1 and planning["died"] == 0 and planning["plan_s"] > 0

        # a new destination pool of another layout: a new epoch and a new plan, ahead again
        resp = register(stub, cl.model, "extra", pb.ROLE_DESTINATION, 0, 1, cl.host, "cpu:0")
        _wait(lambda: c.refits.ahead.ready(cl.model), "the new plan built ahead")
        assert c.refits.plans.built == built + 1
        built = c.refits.plans.built
        stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id=resp.worker_id), timeout=10)
        _wait(lambda: c.refits.ahead.ready(cl.model), "the old plan found again")
        assert c.refits.plans.built == built and c.refits.plans.hits > hits  # from the cache
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl.refit(2))
        assert c.refits.plans.built == built
    finally:
        if cl is not None:
            cl.stop()
        ch.close()


def test_an_incomplete_pool_gets_no_plan_ahead(ahead_controller: Controller) -> None:
    """A pool still missing ranks is not planned (the refit would report it)."""
    c = ahead_controller
    ch = grpc.insecure_channel(c.grpc_address)
    try:
        stub = pbg.RefitStub(ch)
        cl = make_cluster(c, stub)
        try:
            _wait(lambda: c.refits.ahead.ready(cl.model), "the plan built ahead")
            built = c.refits.plans.built
            # a destination pool of 2 ranks with only rank 0 registered
            register(stub, cl.model, "half", pb.ROLE_DESTINATION, 0, 2, cl.host, "cpu:0")
            epoch = c.registry.model(cl.model).epoch
            passes = c.refits.ahead.passes
            _wait(lambda: c.refits.ahead.passes >= passes + 2, "two passes of the chore")
            ms = c.refits.memberships.cached(cl.model)
            assert ms is not None and ms.epoch < epoch and c.refits.plans.built == built
        finally:
            cl.stop()
    finally:
        ch.close()

"""One outcome per attempt: every trainer rank asking for version v in one attempt gets its
single result, and once every rank was told of a failure, asking for v again retries it.

A version that failed (here: its communicator could not be formed, reported at once) is
not run a second time by a later Refit(v) from a rank not yet told: that rank gets the
recorded failure. Once every rank of the pool got it, Refit(v) starts a new attempt, which
lands; the next version runs normally.
"""

from __future__ import annotations

import time

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller
from refitd.server.database import RefitRecord

from .conftest import make_cluster

REFUSED = "gloo communicator of epoch 1 failed after 0.03s: Connection refused"


def history(c: Controller, model: str, n: int) -> list[RefitRecord]:
    """The model's refit history once it has `n` rows (10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        rows = [r for r in c.refits.history if r.model == model]
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.01)


def test_a_failed_version_is_the_answer_of_every_rank_then_retried(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub)
    try:
        bad = cl.agent.slot_ids[1]
        cl.agent.fail_connect[bad] = REFUSED
        t0 = time.monotonic()
        (first,) = cl.refit(1, ranks=[1])  # the first rank to ask starts the run (early pause)
        assert isinstance(first, pb.RefitResponse), first
        assert first.state == pb.REFIT_STATE_FAILED
        assert REFUSED in first.message, first.message
        # It failed when the failure was reported, not at a timeout.
        assert time.monotonic() - t0 < controller.settings.connect_timeout_s
        connects = cl.agent.kinds().count("connect")
        del cl.agent.fail_connect[bad]  # a second run of v1 would now succeed
        # Rank 0 was not told yet: rank 1 asking again gets the same outcome, nothing runs.
        (again,) = cl.refit(1, ranks=[1])
        assert isinstance(again, pb.RefitResponse), again
        assert (again.state, again.message) == (first.state, first.message)
        (late,) = cl.refit(1, ranks=[0])  # rank 0 arrives late to the failed attempt
        assert isinstance(late, pb.RefitResponse), late
        assert (late.state, late.message) == (first.state, first.message)
        assert cl.agent.kinds().count("connect") == connects  # no second run of version 1
        # Every rank was told: asking for version 1 again is a new attempt, and it lands.
        retried = cl.refit(1)
        assert all(isinstance(r, pb.RefitResponse) for r in retried), retried
        assert {r.state for r in retried} == {pb.REFIT_STATE_COMMITTED}, retried
        rows = history(controller, cl.model, 2)  # recorded just after the waiters woke
        assert [(r.version, r.state) for r in rows] == [(1, "failed"), (1, "committed")], rows
        # Each attempt's outcome stays its own in SQLite (what a rank paused by it learns
        # after a controller restart), though the version is logged under the second.
        outcomes = [controller.db.refit_outcome(r.refit_id) for r in rows]
        assert [(o.version, o.state) for o in outcomes if o] == [(1, "failed"), (1, "committed")]
        out = cl.refit(2)
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in out), out
        err = cl.refit(1, ranks=[0])[0]  # older than the committed version now
        assert isinstance(err, grpc.RpcError)
        assert "not newer than the committed version 2" in err.details()
    finally:
        cl.stop()

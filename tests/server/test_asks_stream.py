"""The Asks stream over real gRPC: a trainer rank's Refit calls on one stream kept open.
Each ask is answered as its Refit call would be, refit after refit on the same stream; an
error ends the stream with Refit's status and the client's next ask opens another; an ask
past its deadline raises DEADLINE_EXCEEDED."""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.rpc.asks import AskStream
from refitd.rpc.connection import ControllerConnection, RefitError
from refitd.server.controller import Controller

from .conftest import make_cluster


def test_refits_commit_ask_after_ask_on_one_stream_per_rank(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub, on_stream=True)
    feeds: list[queue.SimpleQueue[pb.RefitRequest | None]] = [queue.SimpleQueue() for _ in range(2)]
    streams = [stub.Asks(iter(f.get, None), timeout=30) for f in feeds]
    try:

        def ask(i: int, version: int) -> pb.RefitResponse:
            feeds[i].put(
                pb.RefitRequest(worker_id=cl.trainers[i], version=version, wait=pb.WAIT_SERVED)
            )
            return next(streams[i])

        with ThreadPoolExecutor(2) as ex:
            for version in (1, 2):
                out = list(ex.map(ask, range(2), [version] * 2))
                assert [r.state for r in out] == [pb.REFIT_STATE_COMMITTED] * 2, out
                assert [r.version for r in out] == [version] * 2 and all(r.served for r in out)
        kinds = cl.subscribers[0].kinds()
        for version in (1, 2):
            assert (pb.EVENT_KIND_PAUSE, version) in kinds
            assert (pb.EVENT_KIND_COMMIT, version) in kinds
        assert controller.registry.model(cl.model).committed_version == 2
    finally:
        for f, s in zip(feeds, streams, strict=True):
            f.put(None)
            s.cancel()
        cl.stop()


def test_an_error_ends_the_stream_with_refits_status_and_the_next_ask_opens_another(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub)
    conn = ControllerConnection(controller.grpc_address)
    a = AskStream(conn)
    try:
        dest = pb.RefitRequest(worker_id=cl.inference[0], version=1, wait=pb.WAIT_COMMITTED)
        with pytest.raises(RefitError) as e:
            a.ask(dest, "an inference rank", 10.0)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "only source (trainer) ranks call Refit" in str(e.value)
        with pytest.raises(grpc.RpcError) as unary:
            stub.Refit(dest, timeout=10)
        assert unary.value.code() == e.value.code  # as a Refit call answers

        def ask(i: int) -> pb.RefitResponse:
            req = pb.RefitRequest(worker_id=cl.trainers[i], version=1, wait=pb.WAIT_COMMITTED)
            return (a if i == 0 else AskStream(conn)).ask(req, f"rank {i}", 30.0)

        with ThreadPoolExecutor(2) as ex:
            out = list(ex.map(ask, range(2)))
        assert [r.state for r in out] == [pb.REFIT_STATE_COMMITTED] * 2, out
    finally:
        a.close()
        conn.close()
        cl.stop()


def test_an_ask_past_its_deadline_raises_deadline_exceeded(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub)
    conn = ControllerConnection(controller.grpc_address)
    a = AskStream(conn)
    try:
        # rank 1 never asks: the barrier holds rank 0's ask past its deadline
        req = pb.RefitRequest(worker_id=cl.trainers[0], version=1, wait=pb.WAIT_COMMITTED)
        t0 = time.monotonic()
        with pytest.raises(RefitError) as e:
            a.ask(req, "rank 0", 0.5)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        assert time.monotonic() - t0 < 5.0
    finally:
        a.close()
        conn.close()
        cl.stop()

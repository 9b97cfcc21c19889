"""The Events stream over real gRPC: an inference rank subscribes and acks on one stream.
Its acks count as Ack calls do (PAUSE before the transfer, COMMIT for wait=served), a
refusal fails the pause naming it, and a malformed request ends the stream with
INVALID_ARGUMENT naming what is wrong."""

from __future__ import annotations

import queue

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.server.controller import Controller

from .conftest import make_cluster


def test_a_refit_commits_and_is_served_with_acks_on_the_stream(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub, on_stream=True)
    try:
        out = cl.refit(1, wait=pb.WAIT_SERVED)
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in out), out
        assert all(r.served for r in out), [r.message for r in out]  # its COMMIT ack counted
        sub = cl.subscribers[0]
        assert (pb.EVENT_KIND_PAUSE, 1) in sub.kinds() and (pb.EVENT_KIND_COMMIT, 1) in sub.kinds()
    finally:
        cl.stop()


def test_a_refusal_on_the_stream_fails_the_pause_naming_it(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub, on_stream=True)
    cl.subscribers[0].stop()
    cl.subscribers[0] = type(cl.subscribers[0])(
        stub, cl.inference[0], refuse="engine busy", on_stream=True
    ).start()
    try:
        out = cl.refit(1)
        assert all(r.state == pb.REFIT_STATE_FAILED for r in out), out
        assert "refused pause of version 1: engine busy" in out[0].message, out[0].message
        assert "(rank 0 of pool 'infer')" in out[0].message, out[0].message
    finally:
        cl.stop()


def _events(stub: pbg.RefitStub, *requests: pb.EventsRequest) -> grpc.RpcError:
    """The error that ends an Events stream fed `requests`."""
    feed: queue.SimpleQueue[pb.EventsRequest | None] = queue.SimpleQueue()
    for r in requests:
        feed.put(r)
    stream = stub.Events(iter(feed.get, None), timeout=10)
    try:
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        return e.value
    finally:
        feed.put(None)


def test_a_malformed_request_ends_the_stream_naming_it(
    controller: Controller, stub: pbg.RefitStub
) -> None:
    cl = make_cluster(controller, stub)
    try:
        me = cl.inference[0]
        ack = pb.AckRequest(worker_id=me, event_id=1, ok=True)
        err = _events(stub, pb.EventsRequest(ack=ack))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the first request of Events must set field subscribe" in err.details()

        other = pb.AckRequest(worker_id=cl.trainers[0], event_id=1, ok=True)
        subscribe = pb.SubscribeRequest(worker_id=me)
        err = _events(stub, pb.EventsRequest(subscribe=subscribe), pb.EventsRequest(ack=other))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"field ack.worker_id={cl.trainers[0]!r}: the stream is worker {me}" in (
            err.details()
        ), err.details()

        err = _events(stub, pb.EventsRequest(subscribe=pb.SubscribeRequest(worker_id="nobody")))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "worker_id 'nobody' is not registered" in err.details()
    finally:
        cl.stop()

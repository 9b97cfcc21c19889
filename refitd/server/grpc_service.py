"""gRPC front end: the Refit and AgentControl services (the generated servicers' subclasses)
over what the controller offers them (frontend.ServiceBackend).

The services only translate: proto in, ControlError -> status code out. Streams (Subscribe,
Commands) hold a pool thread each and end when the client goes or the controller stops.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.security import ServerSecurity
from refitd.server.auth import TokenAuthInterceptor
from refitd.server.errors import ControlError, ErrorKind, invalid, not_found
from refitd.server.explain import explain_document
from refitd.server.frontend import ServiceBackend
from refitd.server.status import status_document
from refitd.server.validation import (
    check_ack,
    check_id,
    check_identifier,
    check_refit_request,
    check_register_agent,
    check_report,
)

F = TypeVar("F", bound=Callable[..., Any])

GRPC_CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
WAITS = (
    pb.WAIT_UNSPECIFIED,
    pb.WAIT_SOURCES_READ,
    pb.WAIT_COMMITTED,
    pb.WAIT_ACCEPTED,
    pb.WAIT_SERVED,
)


def _translated(fn: F) -> F:
    """Run a unary handler; a ControlError becomes the matching gRPC status."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except ControlError as e:
            context.abort(GRPC_CODES[e.kind], e.message)

    return wrapper  # type: ignore[return-value]


class RequestDecodeInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Parses requests inside the handler, so undecodable bytes get INVALID_ARGUMENT naming
    the method and message type (gRPC's own answer is a bare INTERNAL)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method

        def decoded(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception as e:
                kind = getattr(parse, "__self__", None)
                what = getattr(kind, "__name__", "message")
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request of {method} is not a valid {what} message: {e}",
                )

        ser = handler.response_serializer
        if handler.response_streaming:
            behavior = handler.unary_stream

            def stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
                yield from behavior(decoded(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(stream, None, ser)
        unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, context: unary(decoded(raw, context), context), None, ser
        )


def server_interceptors(security: ServerSecurity) -> list[grpc.ServerInterceptor]:
    """The controller's gRPC interceptors: the token check (when a token is configured)
    before anything parses the request, then the request decoding."""
    auth = [TokenAuthInterceptor(security.token)] if security.token else []
    return [*auth, RequestDecodeInterceptor()]


class RefitService(pbg.RefitServicer):
    """What workers call (through refitd.client)."""

    def __init__(self, controller: ServiceBackend) -> None:
        self.c = controller

    @_translated
    def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: Any) -> Any:
        claims = self.c.refits.claims  # a live holder of the rank refuses a second process
        w = self.c.registry.register_worker(request, lambda h: claims.replaced(h, request))
        model = self.c.registry.model(w.model)
        self.c.refresh_gauges()
        self.c.refits.settle_paused([w.worker_id])  # when its stream is open already
        return pb.RegisterWorkerResponse(
            worker_id=w.worker_id,
            epoch=model.epoch,
            current_version=model.committed_version,
            slot=w.slot,
            heartbeat_interval_s=self.c.settings.heartbeat_period_s,
        )

    @_translated
    def UnregisterWorker(self, request: pb.UnregisterWorkerRequest, context: Any) -> Any:
        check_id(request.worker_id, "worker_id")
        w = self.c.registry.unregister_worker(request.worker_id)
        self.c.refits.source_gone(w, "unregistered")
        self.c.refresh_gauges()
        return pb.UnregisterWorkerResponse()

    @_translated
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        check_id(request.worker_id, "worker_id")
        _, epoch = self.c.registry.touch_worker(request.worker_id)
        return pb.HeartbeatResponse(epoch=epoch)

    @_translated
    def Refit(self, request: pb.RefitRequest, context: Any) -> Any:
        check_refit_request(request, WAITS)
        return self.c.refits.request(
            request.worker_id, request.version, request.wait, request.timeout_s
        )

    def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> Iterator[pb.VersionEvent]:
        try:
            check_id(request.worker_id, "worker_id")
            if request.after_event < 0:
                raise invalid(f"field after_event must be >= 0, got {request.after_event}")
            w = self.c.registry.worker(request.worker_id)
            if w.role != "destination":
                raise invalid(
                    f"field worker_id: {w.describe()} is a source; only destination ranks subscribe"
                )
            if not w.live:  # its client registers again (it heartbeats only while unsubscribed)
                raise not_found(
                    f"{w.describe()} was restored after a controller restart; register again"
                )
        except ControlError as e:
            context.abort(GRPC_CODES[e.kind], e.message)
        stream = self.c.events.open(w.worker_id)
        try:
            hello = pb.VersionEvent(
                event_id=self.c.events.next_id(),
                kind=pb.EVENT_KIND_HELLO,
                model=w.model,
                pool=w.pool,
                version=self.c.registry.model(w.model).committed_version,
            )
            self.c.refits.settle_paused([w.worker_id])  # queued behind HELLO, ids above it
            yield hello
            context.add_callback(stream.wake)  # the client went away: end at once
            yield from stream.items(lambda: context.is_active() and not self.c.stopping)
        finally:
            self.c.events.close(stream, f"{w.describe()} closed its subscription")

    @_translated
    def Ack(self, request: pb.AckRequest, context: Any) -> Any:
        check_ack(request)
        w = self.c.registry.worker(request.worker_id)
        self.c.events.ack(request, w.describe())
        return pb.AckResponse()

    @_translated
    def GetStatus(self, request: pb.StatusRequest, context: Any) -> Any:
        if request.model:
            check_identifier(request.model, "model")
        if request.model and not self.c.registry.has_model(request.model):
            raise ControlError(ErrorKind.NOT_FOUND, f"model {request.model!r} is not registered")
        return pb.StatusResponse(json=json.dumps(status_document(self.c, request.model)))

    @_translated
    def Explain(self, request: pb.ExplainRequest, context: Any) -> Any:
        check_identifier(request.model, "model")
        if not request.tensor or len(request.tensor) > 1024:
            raise invalid("explain needs a tensor name of at most 1024 characters")
        if request.pool:
            check_identifier(request.pool, "pool")
        rank = request.rank if request.HasField("rank") else None
        doc, text = explain_document(self.c, request.model, request.tensor, request.pool, rank)
        return pb.ExplainResponse(json=json.dumps(doc), text=text)


class AgentControlService(pbg.AgentControlServicer):
    """What node agents call."""

    def __init__(self, controller: ServiceBackend) -> None:
        self.c = controller

    @_translated
    def RegisterAgent(self, request: pb.RegisterAgentRequest, context: Any) -> Any:
        check_register_agent(request)
        agent = self.c.registry.register_agent(
            request.host,
            [s.device for s in request.slots],
            request.pid,
            request.agent_id,
            batch_execute=request.batch_execute,
            data_plane_address=request.data_plane_address,
            links=tuple(request.links),
        )
        self.c.refresh_gauges()
        return pb.RegisterAgentResponse(
            agent_id=agent.agent_id,
            slot_ids=agent.slot_ids,
            heartbeat_interval_s=self.c.settings.heartbeat_period_s,
        )

    def Commands(self, request: pb.AgentStreamRequest, context: Any) -> Iterator[pb.AgentCommand]:
        try:
            check_id(request.agent_id, "agent_id")
            agent = self.c.registry.agent(request.agent_id)
        except ControlError as e:
            context.abort(GRPC_CODES[e.kind], e.message)
        # The lease counts from here: between RegisterAgent and this stream an agent spawns
        # its transfer processes (each imports torch), which on a busy host outlasts a lease.
        stream = self.c.agents.open(agent.agent_id)
        self.c.registry.agent_connected(agent)
        self.c.refresh_gauges()
        try:
            context.add_callback(stream.wake)
            yield from stream.items(lambda: context.is_active() and not self.c.stopping)
        finally:
            if self.c.agents.close(
                stream, f"agent {agent.agent_id} on host {agent.host!r} disconnected"
            ):
                # A re-registration on this stream (a transfer process restarted) replaced
                # the registry's Agent: mark the current one, or its slots stay claimed.
                self.c.registry.agent_disconnected(agent)
            self.c.refresh_gauges()

    @_translated
    def Report(self, request: pb.AgentReport, context: Any) -> Any:
        check_id(request.agent_id, "agent_id")
        agent = self.c.registry.agent(request.agent_id)
        check_report(request, agent.slot_ids)
        self.c.registry.touch_agent(agent.agent_id)
        self.c.agents.report(request, agent.slot_ids)
        return pb.AgentReportResponse()

    @_translated
    def AgentHeartbeat(self, request: pb.AgentHeartbeatRequest, context: Any) -> Any:
        check_id(request.agent_id, "agent_id")
        self.c.registry.touch_agent(request.agent_id)
        return pb.AgentHeartbeatResponse()

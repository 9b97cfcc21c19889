"""gRPC front end: the Refit and AgentControl services over what the controller offers them
(frontend.ServiceBackend), as coroutines on the gRPC server's loop (server/loop.py).

The services only translate: proto in, ControlError -> status code out. The calls of a
refit (Refit, Ack, Events, Report, heartbeats) run on the loop and take short locks only;
the ones that may block (registrations, status, explain, SQLite reads) run on the loop's
thread pool. Streams (Subscribe, Events, Commands) hold no thread: they wait on the loop for
their next item and end when the client goes (the call is cancelled) or the controller
stops. Every call is checked for the token first, then its request parsed here, so
undecodable bytes get INVALID_ARGUMENT naming the method and message type.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message

from refitd._proto import refitd_pb2 as pb
from refitd.server.auth import call_token_problem
from refitd.server.errors import ControlError, ErrorKind, invalid, not_found
from refitd.server.explain import explain_document
from refitd.server.frontend import ServiceBackend
from refitd.server.loop import ServerLoop
from refitd.server.members import Agent, Worker
from refitd.server.status import status_document
from refitd.server.streams import Stream
from refitd.server.validation import (
    check_ack,
    check_id,
    check_identifier,
    check_refit_request,
    check_register_agent,
    check_report,
)

log = logging.getLogger("refitd.controller")
M = TypeVar("M", bound=Message)
Context = grpc.aio.ServicerContext

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


# ---------------------------------------------------------------------- method handlers
def service_handler(name: str, servicer: object, token: str) -> grpc.GenericRpcHandler:
    """The handlers of service `name` of refitd.proto, each calling the servicer's method of
    the same name after the token check and the parse; a ControlError becomes its status."""
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in service.methods:
        method = f"/{service.full_name}/{m.name}"
        kind: type[Message] = getattr(pb, m.input_type.name)
        ser = getattr(pb, m.output_type.name).SerializeToString
        fn = getattr(servicer, m.name)
        if m.client_streaming and m.server_streaming:
            handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                _bidi(method, kind, fn, token), None, ser
            )
        elif m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _server_stream(method, kind, fn, token), None, ser
            )
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(method, kind, fn, token), None, ser
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def parse(raw: bytes, kind: type[M], method: str) -> M:
    try:
        return kind.FromString(raw)
    except Exception as e:
        raise invalid(f"request of {method} is not a valid {kind.__name__} message: {e}") from e


async def _refuse(context: Context, e: ControlError) -> NoReturn:
    await context.abort(GRPC_CODES[e.kind], e.message, e.trailers)
    raise AssertionError("abort returned")  # pragma: no cover - abort raises


async def _admit(context: Context, method: str, token: str) -> None:
    problem = call_token_problem(context.invocation_metadata(), token, method)
    if problem:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)


def _unary(method: str, kind: type[Message], fn: Callable[..., Any], token: str) -> Any:
    async def call(raw: bytes, context: Context) -> Any:
        await _admit(context, method, token)
        try:
            return await fn(parse(raw, kind, method), context)
        except ControlError as e:
            await _refuse(context, e)

    return call


def _server_stream(method: str, kind: type[Message], fn: Callable[..., Any], token: str) -> Any:
    async def call(raw: bytes, context: Context) -> AsyncIterator[Any]:
        await _admit(context, method, token)
        try:
            async for item in fn(parse(raw, kind, method), context):
                yield item
        except ControlError as e:
            await _refuse(context, e)

    return call


def _bidi(method: str, kind: type[Message], fn: Callable[..., Any], token: str) -> Any:
    async def call(raw: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        await _admit(context, method, token)

        async def requests() -> AsyncIterator[Message]:
            async for r in raw:
                yield parse(r, kind, method)

        try:
            async for item in fn(requests(), context):
                yield item
        except ControlError as e:
            await _refuse(context, e)

    return call


# ---------------------------------------------------------------------- services
class RefitService:
    """What workers call (through refitd.client)."""

    def __init__(self, controller: ServiceBackend, loop: ServerLoop) -> None:
        self.c = controller
        self.loop = loop

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: Context) -> Any:
        return await self.loop.offload(self._register, request)

    def _register(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        claims = self.c.refits.claims  # a live holder of the rank refuses a second process
        w = self.c.registry.register_worker(
            request,
            lambda h: claims.replaced(h, request),
            lambda h: claims.must_name(h, request),
        )
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

    async def UnregisterWorker(self, request: pb.UnregisterWorkerRequest, context: Context) -> Any:
        check_id(request.worker_id, "worker_id")
        return await self.loop.offload(self._unregister, request.worker_id)

    def _unregister(self, worker_id: str) -> pb.UnregisterWorkerResponse:
        w = self.c.registry.unregister_worker(worker_id)
        self.c.refits.source_gone(w, "unregistered")
        self.c.refresh_gauges()
        return pb.UnregisterWorkerResponse()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> Any:
        check_id(request.worker_id, "worker_id")
        _, epoch = self.c.registry.touch_worker(request.worker_id)
        return pb.HeartbeatResponse(epoch=epoch)

    async def Refit(self, request: pb.RefitRequest, context: Context) -> Any:
        return await self._refit(request)

    async def Asks(
        self, requests: AsyncIterator[pb.RefitRequest], context: Context
    ) -> AsyncIterator[pb.RefitResponse]:
        """A trainer rank's Refit calls on one stream, answered in turn: a message on an
        open stream costs the server about half a new call, so a refit's start, when every
        rank asks at once, takes in each ask for less."""
        async for request in requests:
            yield await self._refit(request)

    async def _refit(self, request: pb.RefitRequest) -> pb.RefitResponse:
        check_refit_request(request, WAITS)
        refits = self.c.refits
        a = refits.ask(request.worker_id, request.version, request.wait, request.timeout_s)
        if a.ready is None:
            return a.run.response()
        while True:
            came = await a.ready.wait_async(self.loop.soon, a.deadline - time.monotonic())
            response = refits.woke(a, came)
            if response is not None:
                break
        if request.wait == pb.WAIT_SERVED:  # waits for the COMMIT acks
            return await self.loop.offload(refits.answer, a, came, response)
        return refits.answer(a, came, response)

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: Context
    ) -> AsyncIterator[pb.VersionEvent]:
        w = self._subscriber(request)
        stream = self.c.events.open(w.worker_id)
        async for event in self._follow(w, stream):
            yield event

    async def Events(
        self, requests: AsyncIterator[pb.EventsRequest], context: Context
    ) -> AsyncIterator[pb.VersionEvent]:
        """Subscribe and Ack on one stream: the first request subscribes, the others ack."""
        first = await anext(requests, None)
        if first is None or first.WhichOneof("what") != "subscribe":
            raise invalid("the first request of Events must set field subscribe")
        w = self._subscriber(first.subscribe)
        stream = self.c.events.open(w.worker_id)
        refused: list[ControlError] = []
        reader = asyncio.ensure_future(self._acks(w, requests, stream, refused))
        try:
            async for event in self._follow(w, stream):
                yield event
        finally:
            reader.cancel()
        if refused:
            raise refused[0]

    async def _acks(
        self,
        w: Worker,
        requests: AsyncIterator[pb.EventsRequest],
        stream: Stream[pb.VersionEvent],
        refused: list[ControlError],
    ) -> None:
        """The acks of an Events stream; a bad one ends the stream with its error."""
        try:
            async for r in requests:
                if r.WhichOneof("what") != "ack":
                    raise invalid("after the first request of Events, each must set field ack")
                if r.ack.worker_id != w.worker_id:
                    raise invalid(
                        f"field ack.worker_id={r.ack.worker_id[:64]!r}: the stream is "
                        f"{w.describe()}'s"
                    )
                check_ack(r.ack)
                self.c.events.ack(r.ack, w.describe())
        except ControlError as e:
            refused.append(e)
            stream.close()
        except grpc.RpcError:
            pass  # the call ended: its handler ends too
        except Exception:  # a bug here must not pass unseen; the stream ends
            log.exception("acks of %s", w.describe())
            stream.close()

    def _subscriber(self, request: pb.SubscribeRequest) -> Worker:
        """The worker a subscription is for (refused: unknown, a source, or restored)."""
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
        return w

    async def _follow(
        self, w: Worker, stream: Stream[pb.VersionEvent]
    ) -> AsyncIterator[pb.VersionEvent]:
        """HELLO, then the worker's events until its stream ends."""
        try:
            hello = pb.VersionEvent(
                event_id=self.c.events.next_id(),
                kind=pb.EVENT_KIND_HELLO,
                model=w.model,
                pool=w.pool,
                version=self.c.registry.model(w.model).committed_version,
            )
            # queued behind HELLO, ids above it
            await self.loop.offload(self.c.refits.settle_paused, [w.worker_id])
            yield hello
            async for event in stream.items():
                yield event
        finally:
            self.c.events.close(stream, f"{w.describe()} closed its subscription")

    async def Ack(self, request: pb.AckRequest, context: Context) -> Any:
        check_ack(request)
        w = self.c.registry.worker(request.worker_id)
        self.c.events.ack(request, w.describe())
        return pb.AckResponse()

    async def GetStatus(self, request: pb.StatusRequest, context: Context) -> Any:
        if request.model:
            check_identifier(request.model, "model")
        if request.model and not self.c.registry.has_model(request.model):
            raise ControlError(ErrorKind.NOT_FOUND, f"model {request.model!r} is not registered")
        doc = await self.loop.offload(status_document, self.c, request.model)
        return pb.StatusResponse(json=json.dumps(doc))

    async def Explain(self, request: pb.ExplainRequest, context: Context) -> Any:
        check_identifier(request.model, "model")
        if not request.tensor or len(request.tensor) > 1024:
            raise invalid("explain needs a tensor name of at most 1024 characters")
        if request.pool:
            check_identifier(request.pool, "pool")
        rank = request.rank if request.HasField("rank") else None
        doc, text = await self.loop.offload(
            explain_document, self.c, request.model, request.tensor, request.pool, rank
        )
        return pb.ExplainResponse(json=json.dumps(doc), text=text)


class AgentControlService:
    """What node agents call."""

    def __init__(self, controller: ServiceBackend, loop: ServerLoop) -> None:
        self.c = controller
        self.loop = loop

    async def RegisterAgent(self, request: pb.RegisterAgentRequest, context: Context) -> Any:
        check_register_agent(request)
        return await self.loop.offload(self._register, request)

    def _register(self, request: pb.RegisterAgentRequest) -> pb.RegisterAgentResponse:
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

    async def Commands(
        self, request: pb.AgentStreamRequest, context: Context
    ) -> AsyncIterator[pb.AgentCommand]:
        check_id(request.agent_id, "agent_id")
        agent = self.c.registry.agent(request.agent_id)
        # The lease counts from here: between RegisterAgent and this stream an agent spawns
        # its transfer processes (each imports torch), which on a busy host outlasts a lease.
        stream = self.c.agents.open(agent.agent_id)
        try:
            await self.loop.offload(self._connected, agent)
            async for command in stream.items():
                yield command
        finally:
            if self.c.agents.close(
                stream, f"agent {agent.agent_id} on host {agent.host!r} disconnected"
            ):
                # A re-registration on this stream (a transfer process restarted) replaced
                # the registry's Agent: mark the current one, or its slots stay claimed.
                self.c.registry.agent_disconnected(agent)
            with contextlib.suppress(RuntimeError):  # the pool is shut down: stopping
                self.loop.pool.submit(self.c.refresh_gauges)

    def _connected(self, agent: Agent) -> None:
        self.c.registry.agent_connected(agent)
        self.c.refresh_gauges()

    async def Report(self, request: pb.AgentReport, context: Context) -> Any:
        check_id(request.agent_id, "agent_id")
        agent = self.c.registry.agent(request.agent_id)
        check_report(request, agent.slot_ids)
        self.c.registry.touch_agent(agent.agent_id)
        self.c.agents.report(request, agent.slot_ids)
        return pb.AgentReportResponse()

    async def AgentHeartbeat(self, request: pb.AgentHeartbeatRequest, context: Context) -> Any:
        check_id(request.agent_id, "agent_id")
        self.c.registry.touch_agent(request.agent_id)
        return pb.AgentHeartbeatResponse()

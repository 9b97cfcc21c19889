"""Inference side: register the engine's weights, then follow version events.

The handshake keeps torn weights from ever being served. On PAUSE the client calls the
engine's `pause(version)` hook (it must stop reading weights) and acks; the controller then
writes the weights in place. On COMMIT it calls `resume(version)` and acks: the engine
serves the new version. On ABORT (weights untouched) it calls `resume(served_version)`. On
INCOMPLETE (the refit failed after writing in place) it calls `incomplete(version, reason)`
and the weights must not be served: `served_version` becomes None until the next COMMIT.

A rank that registers without weights (a restart) is caught up by the controller: PAUSE and
COMMIT of the committed version arrive without the trainer refitting, copied from another
inference replica that serves it (when one covers this rank's shards; otherwise the rank
gets the next version). Re-registering after a controller restart tells the controller the
version already served, so nothing is copied again, or the refit whose PAUSE the rank is
still in: the controller then says how that refit ended (COMMIT, ABORT or INCOMPLETE), so a
rank paused by a controller that died mid-refit is never left paused without an answer.

With `staged=True` (the same on every rank of the pool) the refit lands in staging buffers
of the node agent while the engine keeps serving; PAUSE comes only once every byte has
landed, and the pause lasts for the copy from staging into the weights, then COMMIT. It
costs a second copy of this rank's weights on its device.

With `register_adapter(targets)` (and a `flip` hook) the rank holds an adapter in two
slots and never pauses: refits land in the slot it does not serve, and COMMIT flips the
served slot (refitd.client.adapter). PAUSE (sent only to catch a rank up) and ABORT reach
no engine hook, and INCOMPLETE leaves the served slot and version as they were.

Order of work for each event: (1) the hook; (2) the new state (`state`, `served_version`,
`committed_version`), seen at once by the thread that delivers the event (the `subscribe()`
loop body, or the `on_update` callback); (3) the delivery; (4) once it returns, the state is
published to every other thread, then the ack goes to the controller. So a thread that sees
`served_version == v` knows the commit event of v was delivered, and a trainer's
`refit(v, wait="served")` returns only after every inference rank got that far.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd.client.adapter import AdapterSlots, FlipHook, Targets
from refitd.client.tensors import collect
from refitd.client.worker import Registration, WorkerClient
from refitd.rpc.connection import Backoff, RefitError

log = logging.getLogger(__name__)

KINDS = {
    pb.EVENT_KIND_HELLO: "hello",
    pb.EVENT_KIND_PAUSE: "pause",
    pb.EVENT_KIND_COMMIT: "commit",
    pb.EVENT_KIND_ABORT: "abort",
    pb.EVENT_KIND_INCOMPLETE: "incomplete",
}


@dataclass(frozen=True, slots=True)
class VersionEvent:
    """One event of this worker's pool: kind is hello, pause, commit, abort or incomplete."""

    event_id: int
    kind: str
    model: str
    pool: str
    version: int
    reason: str
    refit_id: int


@dataclass(frozen=True, slots=True)
class ClientState:
    """What an inference rank serves: state, served_version and committed_version."""

    state: str = "new"
    served_version: int | None = None
    committed_version: int = 0


@dataclass(frozen=True, slots=True)
class Handled:
    """An event whose hook ran, waiting for its delivery, then its ack."""

    event: VersionEvent
    ok: bool
    message: str
    moved: list[str]
    numbered: bool  # has an event id (acked, and remembered for resuming)


Hook = Callable[[int], None]


class InferenceClient(WorkerClient):
    """An inference rank: `register(weights)`, then `subscribe()` or `on_update(callback)`.

    state is "new" (registered, no version served yet), "serving", "paused" or
    "incomplete" (weights must not be served).
    """

    ROLE = pb.ROLE_DESTINATION

    def __init__(
        self,
        controller: str,
        model: str,
        pool: str,
        rank: int = 0,
        pool_size: int = 1,
        device: str = "cpu:0",
        host: str | None = None,
        pause: Hook | None = None,
        resume: Hook | None = None,
        incomplete: Callable[[int, str], None] | None = None,
        rpc_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        staged: bool = False,
        flip: FlipHook | None = None,
    ) -> None:
        super().__init__(
            controller,
            model,
            pool,
            rank,
            pool_size,
            device,
            host,
            rpc_timeout_s,
            connect_timeout_s,
        )
        self.staged = staged
        self._pause = pause
        self._resume = resume
        self._incomplete = incomplete
        self._flip = flip
        self._adapter: AdapterSlots | None = None
        self._latest = ClientState()  # after the newest event handled
        self._published = ClientState()  # what other threads see (after its delivery)
        self._delivering: tuple[int, ClientState] | None = None  # (thread id, its view)
        self._last_event = 0
        self._paused_in = 0  # refit id of the PAUSE being honoured
        self._stream: grpc.Future | None = None
        self._events_rpc = True  # the controller has the Events RPC (until it says otherwise)
        self._acks: queue.SimpleQueue[pb.EventsRequest | None] | None = None  # its requests
        self._streaming = threading.Event()  # the subscription is open (and holds the lease)
        self._listener: threading.Thread | None = None

    def register_adapter(self, targets: Targets, slots: tuple[int, int] = (0, 1)) -> Registration:
        """Register an adapter held in two slots: `targets(slot)` is what `register` takes
        for one slot (e.g. engine placements of its views). Refits land in the slot not
        served; COMMIT calls `flip(version, slot)` (module docstring)."""
        if self.staged:
            raise RefitError(f"{self._who()}: an adapter pool cannot be staged as well")
        self._adapter = AdapterSlots(targets, tuple(slots))
        self.adapter = True
        return self.register(targets(self._adapter.spare))

    @property
    def serving_slot(self) -> int | None:
        """The adapter slot the engine serves (None: no version committed yet)."""
        return None if self._adapter is None else self._adapter.serving

    def _register_spare(self, held_version: int) -> None:
        """Register the adapter's spare slot as this rank's destination (storages already
        shared stay where they are: the engine keeps reading the served slot)."""
        assert self._adapter is not None
        local = collect(self._adapter.targets(self._adapter.spare), None, self._who())
        with self._lock:
            self._handles = self._share(local)
            self._tensors = local
            self._send_registration(held_version)

    def subscribe(self) -> Iterator[VersionEvent]:
        """Events of this worker's pool, in order (see the module docstring for what the
        client does around each one, and in which order).

        Events and their acks share one stream (the Events RPC); a controller without it
        is followed with Subscribe, each ack an Ack call. Reconnects with backoff when the
        controller goes away (registering again if it forgot this worker) and resumes
        after the last event seen. Ends on close().
        """
        backoff = Backoff()
        while not self._closed.is_set():
            acks: queue.SimpleQueue[pb.EventsRequest | None] | None = None
            try:
                subscribe = pb.SubscribeRequest(
                    worker_id=self.worker_id, after_event=self._last_event
                )
                if self._events_rpc:
                    acks = queue.SimpleQueue()
                    acks.put(pb.EventsRequest(subscribe=subscribe))
                    stream = self._conn.refit.Events(iter(acks.get, None))
                else:
                    stream = self._conn.refit.Subscribe(subscribe)
                self._stream, self._acks = stream, acks
                for raw in stream:
                    backoff.reset()
                    self._streaming.set()
                    handled = self._handle(raw)
                    if handled is None:
                        continue
                    try:
                        yield handled.event  # delivered: the consumer's code runs here
                    finally:
                        self._settle(handled)
                if self._closed.is_set():
                    return
            except grpc.RpcError as err:
                if self._closed.is_set():
                    return
                if err.code() == grpc.StatusCode.UNIMPLEMENTED and self._events_rpc:
                    self._events_rpc = False  # a controller without Events: Subscribe
                    continue
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    self._try_reregister()
                else:
                    log.info("%s: subscription interrupted: %s", self._who(), err.details())
            except RefitError as err:  # not registered (yet): try again, never end the loop
                if self._closed.is_set():
                    return
                log.info("%s: subscription waits: %s", self._who(), err)
            finally:
                self._streaming.clear()
                self._stream, self._acks = None, None
                if acks is not None:
                    acks.put(None)  # the stream's requests end
            backoff.wait(self._closed)

    def on_update(self, callback: Callable[[VersionEvent], None]) -> threading.Thread:
        """Run subscribe() on a background thread, calling `callback(event)` for each event."""
        if self._listener is not None:
            raise RefitError(f"{self._who()}: on_update() already running")

        def listen() -> None:
            for event in self.subscribe():
                try:
                    callback(event)
                except Exception:
                    log.exception("%s: on_update callback failed on %s", self._who(), event)

        self._listener = threading.Thread(
            target=listen, name=f"refitd-events-{self.pool}-{self.rank}", daemon=True
        )
        self._listener.start()
        return self._listener

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        return self._view().state

    @property
    def served_version(self) -> int | None:
        return self._view().served_version

    @property
    def committed_version(self) -> int:
        return self._view().committed_version

    def _view(self) -> ClientState:
        """The published state; the thread delivering an event already sees its outcome."""
        delivering = self._delivering
        if delivering is not None and delivering[0] == threading.get_ident():
            return delivering[1]
        return self._published

    def _held_version(self) -> int:
        if self._adapter is not None:
            return 0  # the registered memory is the spare slot, not the version served
        latest = self._latest
        return latest.served_version or 0 if latest.state == "serving" else 0

    def _lease_by_stream(self) -> bool:
        return self._streaming.is_set()

    def _paused_refit_id(self) -> int:
        return self._paused_in if self._latest.state == "paused" else 0

    # ------------------------------------------------------------------ events
    def _handle(self, raw: pb.VersionEvent) -> Handled | None:
        """Run the event's hook and compute the state it leads to (visible to this thread
        only until the event is delivered); None for an event seen before a reconnect."""
        if raw.event_id and raw.event_id <= self._last_event:
            return None  # replayed after a reconnect
        event = VersionEvent(
            event_id=raw.event_id,
            kind=KINDS.get(raw.kind, "unspecified"),
            model=raw.model,
            pool=raw.pool,
            version=raw.version,
            reason=raw.reason,
            refit_id=raw.refit_id,
        )
        ok, message, moved = True, "", []
        try:
            after = self._run_hook(event, self._latest)
            if event.kind == "pause":
                moved = self.moved_tensors()
        except Exception as exc:
            log.exception("%s: %s hook failed", self._who(), event.kind)
            ok, message, after = False, f"{event.kind} hook failed: {exc!r}", self._latest
        self._latest = after
        self._delivering = (threading.get_ident(), after)
        return Handled(event, ok, message, moved, bool(raw.event_id))

    def _run_hook(self, event: VersionEvent, now: ClientState) -> ClientState:
        """Call the engine's hook for `event`; the state after it (unchanged on a raise)."""
        if self._adapter is not None and event.kind != "hello":
            return self._adapter_event(event, now)
        if event.kind == "hello":
            return replace(now, committed_version=event.version)
        if event.kind == "pause":
            served = now.served_version
            if now.state == "paused" and self._paused_in != event.refit_id:
                # Never told how the earlier refit ended: it may have written.
                log.warning(
                    "%s: paused again without an answer for refit %s: the weights "
                    "are untrusted until the next commit",
                    self._who(),
                    self._paused_in,
                )
                served = None
            self._paused_in = event.refit_id
            after = self._latest = replace(now, state="paused", served_version=served)
            if self._pause:  # paused even if it raises: the refit then ends with ABORT
                self._pause(event.version)
            return after
        if event.kind == "commit":
            if self._resume:
                self._resume(event.version)
            return ClientState("serving", event.version, event.version)
        if event.kind == "abort":
            if self._resume and now.served_version is not None:
                self._resume(now.served_version)
            return replace(now, state="serving" if now.served_version is not None else "new")
        if event.kind == "incomplete":
            after = self._latest = replace(now, state="incomplete", served_version=None)
            if self._incomplete:
                self._incomplete(event.version, event.reason)
            return after
        return now

    def _adapter_event(self, event: VersionEvent, now: ClientState) -> ClientState:
        """An adapter rank: COMMIT flips the served slot, then registers the old one as
        the spare; nothing else touches the served slot or calls an engine hook."""
        slots = self._adapter
        assert slots is not None
        if event.kind == "pause":  # a catch-up writes the spare: nothing to stop
            self._paused_in = event.refit_id
            return now
        if event.kind == "incomplete":
            log.warning(
                "%s: refit of version %s failed after writing the spare adapter slot; slot "
                "%s keeps serving version %s",
                self._who(),
                event.version,
                slots.serving,
                now.served_version,
            )
            return now
        if event.kind != "commit":
            return now
        new = slots.spare
        try:
            if self._flip:
                self._flip(event.version, new)
        except Exception:
            # Not flipped: the same spare again, so the controller's wait ends at once.
            self._register_spare(0)
            raise
        slots.serving = new
        self._register_spare(event.version)
        return ClientState("serving", event.version, event.version)

    def _settle(self, handled: Handled) -> None:
        """After delivery: publish the state, then ack (so the controller, and a trainer
        waiting with wait="served", hear of it only once every observer can see it)."""
        self._published = self._latest
        self._delivering = None
        event = handled.event
        if handled.numbered and event.kind != "hello":
            self._ack(event, handled.ok, handled.message, handled.moved)
        if handled.numbered:
            self._last_event = event.event_id
        if handled.moved:
            try:
                self.refresh()
            except RefitError as err:
                log.error("%s: registering moved tensors again failed: %s", self._who(), err)

    def _ack(self, event: VersionEvent, ok: bool, message: str, moved: list[str]) -> None:
        """Ack on the Events stream (sent in order after what came before), or with an Ack
        call when following with Subscribe."""
        req = pb.AckRequest(
            worker_id=self.worker_id,
            event_id=event.event_id,
            ok=ok,
            message=message,
            moved_tensors=moved,
        )
        acks = self._acks
        if acks is not None:
            acks.put(pb.EventsRequest(ack=req))
            return
        try:
            self._conn.call(self._conn.refit.Ack, req, f"ack {event.kind} v{event.version}")
        except RefitError as err:
            log.warning("%s: %s", self._who(), err)

    def _stop_streams(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._listener is not None and self._listener is not threading.current_thread():
            self._listener.join(timeout=5.0)

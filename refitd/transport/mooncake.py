"""`mooncake`: one-sided writes into a peer's registered memory through Mooncake Transfer
Engine (the optional extra `refitd[rdma]`), over RDMA on a fabric or TCP elsewhere.

A destination registers its memory once per program load (`MooncakeEndpoint.register`) and
publishes `descriptor()`: its engines' sessions ("host:port"), its buffers and a digest that
also sits in a small registered stamp of the destination's. A writer registers its sources,
`open`s the descriptor (which checks the digest against the live stamp with a one-sided read,
so a descriptor of an earlier registration or of a restarted peer is refused) and posts
batches of (local address, remote address, bytes) writes. Every write is checked against
both registrations before it is posted; every failure is a TransportError naming the peer
slot and the message. An endpoint runs several engines (each has one I/O thread, which moves
64 KiB per system call over TCP) and spreads requests over them. Polling sleeps between
checks: the engines' threads do the copying and a spinning waiter would take a core from them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from refitd.transport.errors import TransportError
from refitd.transport.mooncake_env import check_fabric
from refitd.transport.mooncake_runs import Batch, Ranges, Runs, batches

STAMP_BYTES = 64
BATCH_BYTES = 256 << 10  # runs of up to this many bytes in all share a batch
PROBE_S = 2.0  # longest wait for a peer's answer when telling a gone peer from a refusal
MAGIC = b"refitd-mc1:"
Route = tuple[Any, str]  # a local engine and a session of the peer's


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """How an endpoint's engine runs. The engine reads its tunables from the environment
    once per process, so every endpoint of a process shares them."""

    protocol: str = "tcp"  # tcp, or rdma (one-sided RDMA WRITEs; needs devices)
    devices: tuple[str, ...] = ()  # RDMA devices to use (empty: every one found)
    host: str = "127.0.0.1"  # the address peers reach this endpoint at (the data plane)
    engines: int = 2  # TCP: engines per endpoint, one I/O thread each (RDMA: always one)
    lanes: int = 4  # TCP: connections per peer and engine
    split_bytes: int = 16 << 20  # writes above this are posted as several requests
    window: int = 4096  # batches in flight per Work
    # requests per batch. 1: the engine's status of a batch is that of its first request
    # (a batch of several reads "done" while the others are still on the wire)
    batch: int = 1


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Write nbytes from this process's address `local` to the peer's address `remote`."""

    local: int
    remote: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    """What a writer needs to reach a destination's registered memory."""

    slot: int
    sessions: tuple[str, ...]  # one per engine of the owner
    token: str  # the registration the owner named (e.g. plan digest and epoch)
    buffers: tuple[tuple[int, int], ...]  # (address, nbytes), sorted
    stamp: int  # address of the owner's registered stamp, which holds `digest`
    digest: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> SegmentDescriptor:
        try:
            d = json.loads(raw)
            buffers = tuple((int(a), int(n)) for a, n in d["buffers"])
            sessions = tuple(map(str, d["sessions"])) or ("",)
            slot, stamp, token = int(d["slot"]), int(d["stamp"]), str(d["token"])
            desc = SegmentDescriptor(slot, sessions, token, buffers, stamp, str(d["digest"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransportError(f"malformed mooncake segment descriptor: {e}") from e
        if desc.digest != _digest(astuple(desc)[:-1]):
            raise TransportError(
                f"segment descriptor of slot {desc.slot} does not match its digest "
                "(altered, or assembled from two registrations)"
            )
        return desc

    @property
    def where(self) -> str:
        return f"slot {self.slot} ({self.sessions[0]})"


def _digest(fields: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(list(fields)).encode()).hexdigest()[:32]


class MooncakeEndpoint:
    """This slot's Transfer Engines: its registered memory, its descriptor, its peers."""

    def __init__(self, slot: int, options: MooncakeOptions | None = None) -> None:
        self.slot = slot
        self.options = options = options or MooncakeOptions()
        check_fabric(options.protocol, options.devices, options.lanes)
        count = max(1, options.engines) if options.protocol == "tcp" else 1
        self._engines: list[Any] = [self._start_engine() for _ in range(count)]
        host = f"[{options.host}]" if ":" in options.host else options.host
        self.sessions = tuple(f"{host}:{e.get_rpc_port()}" for e in self._engines)
        self._lock = threading.Lock()
        # [0, 64): the stamp peers read; [64, 128): where this endpoint reads theirs.
        self._stamp = torch.zeros(2 * STAMP_BYTES, dtype=torch.uint8)
        self._register_raw([(self._stamp.data_ptr(), self._stamp.numel())])
        self._held: list[torch.Tensor] = []
        self._local = Ranges([])
        self._extra: dict[int, tuple[int, torch.Tensor]] = {}  # add_local: addr -> (n, held)
        self._descriptor: SegmentDescriptor | None = None

    def _start_engine(self) -> Any:
        from mooncake.engine import TransferEngine

        o = self.options
        engine = TransferEngine()
        if engine.initialize(o.host, "P2PHANDSHAKE", o.protocol, ",".join(o.devices)) != 0:
            raise TransportError(
                f"slot {self.slot}: Mooncake Transfer Engine did not start on {o.host} "
                f"(protocol {o.protocol}, devices {','.join(o.devices) or 'any'})"
            )
        return engine

    def register(self, buffers: Sequence[torch.Tensor], token: str) -> None:
        """Register these tensors' memory (once per program load), replacing what was
        registered before; `token` names the registration in the descriptor."""
        ranges = []
        for t in buffers:
            if not t.is_contiguous() or t.numel() == 0:
                raise TransportError(
                    f"slot {self.slot}: registered buffers must be contiguous "
                    f"and non-empty, got shape {tuple(t.shape)}"
                )
            ranges.append((t.data_ptr(), t.numel() * t.element_size()))
        new = Ranges(ranges)
        clash = next(((p, c) for p, c in pairwise(new.ranges) if sum(p) > c[0]), None)
        if clash:
            raise TransportError(
                f"slot {self.slot}: registered buffers overlap: "
                f"{_hex(clash[0])} and {_hex(clash[1])}"
            )
        self.unregister()
        self._register_raw(new.ranges)
        self._held, self._local = list(buffers), new
        stamp = self._stamp.data_ptr()
        digest = _digest([self.slot, self.sessions, token, new.ranges, stamp])
        self._descriptor = SegmentDescriptor(
            self.slot, self.sessions, token, tuple(new.ranges), stamp, digest
        )
        self._stamp[:STAMP_BYTES] = torch.tensor(list(_stamp_bytes(digest)), dtype=torch.uint8)

    def add_local(self, buffer: torch.Tensor) -> None:
        """Register memory this endpoint only writes from or reads into (a writer's sources
        and staging), beside the registration peers see; held until `remove_local`."""
        addr, n = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if not buffer.is_contiguous() or n == 0:
            raise TransportError(f"slot {self.slot}: a local buffer must be contiguous, non-empty")
        if addr in self._extra:
            raise TransportError(f"slot {self.slot}: {_hex((addr, n))} is registered already")
        self._register_raw([(addr, n)])
        self._extra[addr] = (n, buffer)

    def remove_local(self, buffer: torch.Tensor) -> None:
        """Unregister a buffer of `add_local` (idempotent)."""
        if self._extra.pop(buffer.data_ptr(), None) is not None:
            for engine in self._engines:
                engine.unregister_memory(buffer.data_ptr())

    def unregister(self) -> None:
        """Unregister this slot's buffers; descriptors of them are refused from now on."""
        self._stamp[:STAMP_BYTES] = 0
        for engine in self._engines:
            for addr, _ in self._local.ranges:
                engine.unregister_memory(addr)
        self._held, self._local, self._descriptor = [], Ranges([]), None

    def descriptor(self) -> bytes:
        """The bytes a peer needs to write here (they travel through the rendezvous store)."""
        if self._descriptor is None:
            raise TransportError(f"slot {self.slot}: no memory registered, nothing to describe")
        return self._descriptor.encode()

    def open(self, raw: bytes, token: str | None = None, timeout_s: float = 10.0) -> MooncakePeer:
        """A writer to the peer `raw` describes. Refused: a token other than `token` (when
        given), a digest that does not match the descriptor or the peer's live stamp."""
        desc = SegmentDescriptor.decode(raw)
        if token is not None and desc.token != token:
            raise TransportError(
                f"stale segment descriptor of {desc.where}: it names registration "
                f"{desc.token!r}, expected {token!r}"
            )
        if not self._engines:
            raise TransportError(f"slot {self.slot}: the endpoint is closed")
        alive = _probe(self._engines[0], desc.sessions[0], timeout_s)
        if not alive:
            why = f"does not answer (stalled?) in {timeout_s:g}s" if alive is None else "is gone"
            raise TransportError(f"{desc.where} {why}: its engine did not answer a probe")
        k, m = len(self._engines), len(desc.sessions)
        routes = [(self._engines[i % k], desc.sessions[i % m]) for i in range(max(k, m))]
        spare = [(e, s) for e in self._engines for s in desc.sessions if (e, s) not in routes]
        control = spare[0] if spare else routes[0]
        with self._lock:  # the stamp through every route: each has shaken hands once
            for route in [*routes, *spare[:1]]:
                self._stamp[STAMP_BYTES:] = 0
                scratch = self._stamp.data_ptr() + STAMP_BYTES
                work = MooncakeWork([route], f"stamp read of {desc.where}", timeout_s, 1, True)
                work.post([(0, [scratch], [desc.stamp], [STAMP_BYTES])])
                work.wait(timeout_s)
                live = bytes(self._stamp[STAMP_BYTES:].tolist())
                if not live.startswith(MAGIC):
                    raise TransportError(
                        f"{desc.where} has registered no memory (not loaded, or unloaded)"
                    )
                if live != _stamp_bytes(desc.digest):
                    raise TransportError(
                        f"stale segment descriptor of {desc.where}: the peer's registration "
                        "changed since it was published (a new program load or a restarted peer)"
                    )
        return MooncakePeer(self, desc, routes, control)

    def check_local(self, local: np.ndarray, nbytes: np.ndarray) -> None:
        """Refuse runs of this process's memory outside what this endpoint registered."""
        mine = Ranges(self._local.ranges + [(a, n) for a, (n, _) in self._extra.items()])
        bad = mine.outside(local, nbytes)
        if bad.size:
            k = int(bad[0])
            raise TransportError(
                f"slot {self.slot}: source {_hex((int(local[k]), int(nbytes[k])))} is outside "
                "this slot's registered memory (register it first)"
            )

    def close(self) -> None:
        """Unregister everything and drop the engines (idempotent); a Work still in flight
        keeps its engines alive until it is dropped."""
        if self._engines:
            self.unregister()
            for addr in list(self._extra):
                self.remove_local(self._extra[addr][1])
            for engine in self._engines:
                engine.unregister_memory(self._stamp.data_ptr())
            self._engines = []

    def _register_raw(self, ranges: Sequence[tuple[int, int]]) -> None:
        for engine in self._engines:
            for addr, n in ranges:
                if engine.register_memory(addr, n) != 0:
                    raise TransportError(
                        f"slot {self.slot}: the engine refused to register {_hex((addr, n))}"
                    )


class MooncakePeer:
    """A checked descriptor of one destination slot: posts one-sided writes into it."""

    def __init__(
        self,
        endpoint: MooncakeEndpoint,
        desc: SegmentDescriptor,
        routes: list[Route],
        control: Route,
    ) -> None:
        self.endpoint, self.desc, self.slot = endpoint, desc, desc.slot
        self._routes, self._remote = routes, Ranges(desc.buffers)
        # small control writes and reads (a doorbell) go on a route of their own where the
        # engines allow one: the engine queues a route's requests first in, first out, so
        # on a data route they would wait behind every write posted before them
        self._control = control

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies in one buffer the peer registered."""
        return self._remote.contains(addr, nbytes)

    def write(self, ops: Sequence[WriteOp], timeout_s: float, message: str = "") -> MooncakeWork:
        """Post these writes (each checked against both registrations first) and return the
        Work; its wait raises TransportError on any failure or after timeout_s."""
        return self.post(_arrays(ops), timeout_s, message, False)

    def read(self, ops: Sequence[WriteOp], timeout_s: float, message: str = "") -> MooncakeWork:
        """Post one-sided reads: each op's `remote` bytes into its `local` address."""
        return self.post(_arrays(ops), timeout_s, message, True)

    def post(
        self,
        runs: Runs,
        timeout_s: float,
        message: str = "",
        read: bool = False,
        control: bool = False,
    ) -> MooncakeWork:
        """Post writes (or reads) of runs given as arrays (local, remote, nbytes), each
        checked against both registrations first: many small runs cost no Python objects.
        `control`: on the control route, ahead of the data writes in flight."""
        what = f"message {message}" if message else ("read" if read else "write")
        if not self._remote.ranges:
            raise TransportError(f"{what} to {self.desc.where}: the peer registered no memory")
        local, remote, nbytes = (np.asarray(a, np.int64) for a in runs)
        keep = nbytes > 0
        if not keep.all():
            local, remote, nbytes = local[keep], remote[keep], nbytes[keep]
        self.endpoint.check_local(local, nbytes)
        bad = self._remote.outside(remote, nbytes)
        if bad.size:
            k = int(bad[0])
            raise TransportError(
                f"{what} to {self.desc.where}: destination "
                f"{_hex((int(remote[k]), int(nbytes[k])))} is outside the peer's registered buffers"
            )
        options = self.endpoint.options
        split = options.split_bytes
        if (nbytes > split).any():  # large runs: several requests each
            parts = -(-nbytes // split)
            first = np.repeat(np.cumsum(parts) - parts, parts)
            off = (np.arange(int(parts.sum())) - first) * split
            local, remote, total = (np.repeat(a, parts) for a in (local, remote, nbytes))
            local, remote, nbytes = local + off, remote + off, np.minimum(split, total - off)
        label = f"mooncake {what} {'from' if read else 'to'} {self.desc.where}"
        routes = [self._control] if control else self._routes
        work = MooncakeWork(routes, label, timeout_s, options.window, read)
        # only small runs share a batch: a batch goes to one route, large runs use them all
        cap = min(split, BATCH_BYTES)
        work.post(batches((local, remote, nbytes), options.batch, cap, len(routes)))
        return work


def _arrays(ops: Sequence[WriteOp]) -> Runs:
    table = np.array([(o.local, o.remote, o.nbytes) for o in ops], np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


class MooncakeWork:
    """Batches of requests posted to the engines (at most `window` batches at once);
    wait() polls them."""

    def __init__(
        self, routes: list[Route], label: str, timeout: float, window: int, read: bool
    ) -> None:
        self._routes, self._label, self._window, self._read = routes, label, window, read
        self._queue: deque[Batch] = deque()
        self._inflight: list[tuple[Any, int, int]] = []  # (engine, batch id, requests)
        self._total = self._done = 0
        self._start, self._default_timeout = time.monotonic(), timeout
        self._deadline = self._start + timeout
        self._error: TransportError | None = None

    def post(self, batches: Sequence[Batch]) -> None:
        self._queue.extend(batches)
        self._total += sum(len(b[1]) for b in batches)
        self._submit()

    def wait(self, timeout_s: float | None = None) -> None:
        timeout_s = self._default_timeout if timeout_s is None else timeout_s
        deadline = self._deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while self._error is None and (self._inflight or self._queue):
            finished = self._poll()
            self._submit()
            if self._error is not None or not (self._inflight or self._queue):
                break
            if time.monotonic() >= deadline:
                self._fail(
                    f"timed out after {timeout_s:.1f}s ({self._done} of {self._total} "
                    "requests done; is the peer stalled?)"
                )
                break
            pause = 20e-6 if finished else min(pause * 2, 2e-3)
            time.sleep(pause)
        if self._error is not None:
            raise self._error

    def _submit(self) -> None:
        while self._error is None and self._queue and len(self._inflight) < self._window:
            route, local, remote, n = self._queue.popleft()
            engine, session = self._routes[route]
            post = (
                engine.batch_transfer_async_read
                if self._read
                else engine.batch_transfer_async_write
            )
            bid = post(session, local, remote, n)
            if bid == 0:
                self._fail(f"could not post to the peer: {self._peer_state()}")
                return
            self._inflight.append((engine, bid, len(n)))

    def _poll(self) -> int:
        still, finished = [], 0
        for engine, bid, count in self._inflight:
            state = engine.transfer_check_status(bid)
            if state == 0:
                still.append((engine, bid, count))
            elif state == 1:
                finished += count
            else:
                kind = "failed" if state == -1 else "timed out in the engine"
                self._fail(f"a request {kind}: {self._peer_state()}")
                return finished
        self._inflight, self._done = still, self._done + finished
        return finished

    def _peer_state(self) -> str:
        budget = min(PROBE_S, max(0.05, self._deadline - time.monotonic()))
        engine, session = self._routes[0]
        alive = _probe(engine, session, budget)
        if alive is None:
            return f"the peer does not answer a probe within {budget:.1f}s (stalled or gone)"
        if not alive:
            return "peer gone (its engine does not answer)"
        why = "the peer's memory is no longer registered, or the request waited past"
        return f"the engine failed the request itself: {why} MC_TCP_ADMISSION_TIMEOUT_MS"

    def _fail(self, why: str) -> None:
        elapsed = time.monotonic() - self._start
        self._error = TransportError(f"{self._label} after {elapsed:.2f}s: {why}")


def _probe(engine: Any, session: str, budget_s: float) -> bool | None:
    """Whether the peer's engine answers a probe, None when it does not answer within
    budget_s: the engine's own handshake waits up to a minute on a stalled peer, so the
    probe runs on a thread of its own and is abandoned after the budget."""
    answer: list[int] = []
    probe = threading.Thread(target=lambda: answer.append(engine.send_probe(session)), daemon=True)
    probe.start()
    probe.join(budget_s)
    return answer[0] == 0 if answer else None


def _stamp_bytes(digest: str) -> bytes:
    return (MAGIC + digest.encode()).ljust(STAMP_BYTES, b"\0")


def _hex(r: tuple[int, int]) -> str:
    return f"[{r[0]:#x}, +{r[1]})"

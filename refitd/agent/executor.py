"""Runs one slot's program for one refit: local copies, then every message, pipelined.

The program is read as columns (program.py); chunks.py cuts its messages into chunks (each
one send matched by one receive, computed identically on both ends from the program) and
slotdata.py prepares, once, every view a refit needs. Chunks are posted in (round, chunk
index, message id) order on every slot, so every pair of slots sees its common chunks in the
same order and the smallest unfinished chunk can always progress.

A chunk whose bytes are one contiguous run of memory on this end (a large contiguous copy,
or copies of adjacent regions) is sent or received in place (zero-copy); other chunks are
packed and unpacked through staging buffers (a ring of bounded total size), each with one
`torch._foreach_copy_` over prepared views. While chunk k is on the wire, k+1 is being
packed (poster thread) and k-1 unpacked (receiver thread). Local copies run as one
`_foreach_copy_` too (quantized destinations one by one).

Relays (program.py): a copy whose source is a destination tensor of this slot forwards
what an earlier round delivered. Before packing (or zero-copy sending) a chunk of a message
with relay copies, the poster waits until the receiver has completed (waited and unpacked)
the receives, in posting order, up to the last one writing what the message forwards (never
more than every receive of a smaller round); ordinary chunks never wait. Local relay copies run after
every receive completed. Sources are released once every chunk and local copy reading a
source tensor is done: relays don't hold the trainer.

Verification (run(verify=True), see checksums.py): the sender checksums each copy's source
block before the sources are released, the receiver reads each copy's destination block back
once it landed; both combine a message's copies in order into one checksum per message id,
returned in ExecReport.checksums for the controller to compare. A copy that the receiver
decodes (quantized wire or storage) is checked on its wire segment instead (sender after
encode, receiver before decode). Local copies are compared here (ExecutionError on a
mismatch); those into quantized storage are not checked.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from refitd.agent.chunks import (
    DIRECT_MIN,
    TAG_CHUNK_BITS,
    WIRE_CHUNK,
    Chunk,
    CopyInfo,
    ExecutionError,
    StagingRing,
    chunk_messages,
    flat_range_views,
)
from refitd.agent.segments import ResolvedTensor
from refitd.agent.slotdata import LocalStep, SlotData
from refitd.plan.layout import PLAIN
from refitd.plan.program import MessageColumns, SlotProgram
from refitd.transport.base import DoneWork, P2POp, Transport, Work
from refitd.transport.memory import StorageMovedError, torch_dtype

_SKIPPED = torch.empty(0, dtype=torch.uint8)  # marks a receive chunk of a skipped message

GROUPED_ENV = "REFITD_GROUPED_LANDING"  # "0": land local copies one call each (comparisons)
DEFAULT_STAGING_BYTES = 256 << 20

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "TAG_CHUNK_BITS",
    "WIRE_CHUNK",
    "Chunk",
    "DirectResolver",
    "ExecReport",
    "ExecutionError",
    "Executor",
    "ExecutorConfig",
    "chunk_messages",
    "flat_range_views",
]

_Sums = dict[tuple[int, int], torch.Tensor]  # (message id, copy row) -> 0-d int64 checksum


class TensorResolver(Protocol):
    """Plan tensor index -> the registered tensor on this slot."""

    def resolve(self, index: int) -> ResolvedTensor: ...

    def check(self, indices: Iterable[int]) -> None:
        """Raise StorageMovedError naming every tensor whose registered storage moved."""
        ...


class DirectResolver:
    """Resolver over tensors of this process (tests, embedded use); detects moved storage
    by comparing data pointers with those seen at construction."""

    def __init__(self, tensors: dict[int, ResolvedTensor]) -> None:
        self.tensors = tensors
        self._ptrs = {i: t.data.data_ptr() for i, t in tensors.items()}

    def resolve(self, index: int) -> ResolvedTensor:
        try:
            return self.tensors[index]
        except KeyError:
            raise ExecutionError(f"no tensor registered for plan tensor {index}") from None

    def check(self, indices: Iterable[int]) -> None:
        moved = [
            self.tensors[i].name
            for i in indices
            if i in self.tensors and self.tensors[i].data.data_ptr() != self._ptrs[i]
        ]
        if moved:
            raise StorageMovedError(
                f"registered storage moved for {moved}: register these tensors again"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    staging_bytes: int = DEFAULT_STAGING_BYTES
    wire_chunk: int = WIRE_CHUNK
    staged_chunk: int | None = None  # chunk of segments that go through staging
    direct_min: int = DIRECT_MIN  # a contiguous raw copy this large gets its own chunks


@dataclass
class MessageStat:
    id: int
    direction: str  # "send" | "recv"
    peer_slot: int
    nbytes: int
    seconds: float
    zero_copy_chunks: int = 0
    staged_chunks: int = 0


@dataclass
class ExecReport:
    """What one refit of one slot did: bytes and seconds per message, and totals.

    phases: seconds of the refit's phases (check_start_s: storage check and thread start;
    local_s: local copies from sources; messages_s: waiting for the messages after that;
    with messages, pack_s / unpack_s / recv_wait_s summed over chunks), so fixed per-refit
    overhead and the staging cost are visible next to the bytes.
    """

    slot: int
    seconds: float = 0.0
    sources_released_s: float = 0.0
    local_bytes: int = 0
    local_seconds: float = 0.0
    sent_bytes: int = 0
    recv_bytes: int = 0
    staging_peak_bytes: int = 0
    messages: list[MessageStat] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    # with verify: {"send": {message id: checksum}, "recv": {...}} (unsigned 64-bit)
    checksums: dict[str, dict[int, int]] | None = None

    def to_dict(self) -> dict:
        return {
            "slot": self.slot,
            "seconds": self.seconds,
            "sources_released_s": self.sources_released_s,
            "local_bytes": self.local_bytes,
            "local_seconds": self.local_seconds,
            "sent_bytes": self.sent_bytes,
            "recv_bytes": self.recv_bytes,
            "staging_peak_bytes": self.staging_peak_bytes,
            "messages": [vars(m) for m in self.messages],
            "phases": dict(self.phases),
            "checksums": self.checksums,
        }


@dataclass
class _Posted:
    chunk: Chunk
    work: Work
    buf: torch.Tensor
    ring: int  # staging ring slot, -1 for a zero-copy chunk

    @property
    def staged(self) -> bool:
        return self.ring >= 0


class Executor:
    """A prepared slot program: regions resolved and chunks cut once, run every refit."""

    def __init__(
        self,
        program: SlotProgram,
        resolver: TensorResolver,
        transport: Transport | None,
        slot_ranks: dict[int, int] | None = None,
        config: ExecutorConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.program = program
        self.resolver = resolver
        self.transport = transport
        self.slot_ranks = slot_ranks
        self.config = config or ExecutorConfig()
        p = program
        self.info = CopyInfo.of(p, self.config.direct_min)
        self._tensors: dict[int, ResolvedTensor] = {}
        self._index_list = self._indices()
        self._validate()
        self.device = device or self._guess_device()
        self.data = SlotData(p, self.info, self._tensors)
        try:
            self.send_chunks = chunk_messages(
                p.send, self.info, self.config.wire_chunk, self.config.staged_chunk
            )
            self.recv_chunks = chunk_messages(
                p.recv, self.info, self.config.wire_chunk, self.config.staged_chunk
            )
        except ExecutionError as e:
            raise ExecutionError(f"slot {p.slot}: {e}") from e
        steps: dict[tuple[int, int, int], tuple[list[Chunk], list[Chunk]]] = {}
        for c in self.send_chunks:
            steps.setdefault(c.key, ([], []))[0].append(c)
        for c in self.recv_chunks:
            steps.setdefault(c.key, ([], []))[1].append(c)
        self._steps = [steps[k] for k in sorted(steps)]
        self._zc_send = {id(c): self._zero_copy_send(c) for c in self.send_chunks}
        self._zc_recv = {id(c): self.data.zero_copy_recv(c) for c in self.recv_chunks}
        staged_send = [c.nbytes for c in self.send_chunks if self._zc_send[id(c)] is None]
        staged_recv = [c.nbytes for c in self.recv_chunks if self._zc_recv[id(c)] is None]
        buf_bytes = -(-max(staged_send + staged_recv, default=16) // 16) * 16
        self.pool = StagingRing(
            self.config.staging_bytes,
            buf_bytes,
            self.device,
            max(len(staged_send), len(staged_recv)),
        )
        self._ring: dict[int, int] = {}  # staged chunk -> its ring slot, in posting order
        n_send = n_recv = 0
        for sends, recvs in self._steps:
            for ch in recvs:
                if self._zc_recv[id(ch)] is None:
                    self._ring[id(ch)] = self.pool.slot_of(n_recv)
                    n_recv += 1
            for ch in sends:
                if self._zc_send[id(ch)] is None:
                    self._ring[id(ch)] = self.pool.slot_of(n_send)
                    n_send += 1
        # relays: a copy reading a destination tensor of this slot (see the module docstring)
        relay = self.info.relay.tolist()
        recv_rounds = sorted(c.round for c in self.recv_chunks)
        feeds = self._feed_index()
        self._relay_wait: dict[int, int] = {}  # send chunk -> receives to complete first
        self._reads_source: dict[int, bool] = {}
        waits: dict[int, int] = {}  # relay message id -> receives to complete first
        for k in range(len(p.send)):
            rows = [i for i in range(int(p.send.start[k]), int(p.send.end[k])) if relay[i]]
            if rows:
                # every receive of a smaller round holds everything it may forward; the
                # prefix up to the last receive writing what it forwards is enough
                n = bisect.bisect_left(recv_rounds, int(p.send.round[k]))
                waits[int(p.send.id[k])] = min(n, max(feeds(i) for i in rows))
        for ch in self.send_chunks:
            if ch.mid in waits:
                self._relay_wait[id(ch)] = waits[ch.mid]
            self._reads_source[id(ch)] = any(not relay[i] for i in ch.rows)
        self._source_chunks = sum(self._reads_source.values())
        local = range(p.local_start, len(p.copies))
        self._local_direct_rows = [i for i in local if not relay[i]]
        self._local_relay_rows = [i for i in local if relay[i]]
        self._local_direct = self._local_plan(self._local_direct_rows)
        self._local_relay = self._local_plan(self._local_relay_rows)

    # ------------------------------------------------------------------ preparation
    def _indices(self) -> list[int]:
        """Tensors this slot touches: sources it sends, destinations it receives, both
        ends of its local copies."""
        p, c = self.program, self.program.copies
        recv_lo = int(p.recv.start[0]) if len(p.recv) else p.local_start
        send_hi = int(p.send.end[-1]) if len(p.send) else 0
        idx = np.unique(
            np.concatenate(
                [
                    c.src[:send_hi],
                    c.dst[recv_lo : p.local_start],
                    c.src[p.local_start :],
                    c.dst[p.local_start :],
                ]
            )
        )
        return idx.tolist()

    def _validate(self) -> None:
        p = self.program
        for i in self._index_list:
            spec = p.tensors[i]  # decode checked every copy's tensors are in the table
            t = self.resolver.resolve(i)
            if tuple(t.data.shape) != tuple(spec.local_shape):
                raise ExecutionError(
                    f"tensor {t.name!r} (pool {spec.pool}, rank {spec.rank}): mapped shape "
                    f"{tuple(t.data.shape)} != registered local shape {tuple(spec.local_shape)}"
                )
            if spec.storage == PLAIN and t.data.dtype != torch_dtype(spec.dtype):
                raise ExecutionError(
                    f"tensor {t.name!r} (pool {spec.pool}, rank {spec.rank}): mapped dtype "
                    f"{t.data.dtype} != registered {spec.dtype}"
                )
            self._tensors[i] = t

    def _zero_copy_send(self, ch: Chunk) -> torch.Tensor | None:
        """The chunk's source bytes as one view to send in place, or None (staged). A host
        snapshot of GPU sources lives off the executor's device: it is staged to it."""
        view = self.data.zero_copy_send(ch)
        return None if view is None or view.device != self.device else view

    def _guess_device(self) -> torch.device:
        for t in self._tensors.values():
            return t.data.device
        return torch.device("cpu")

    def _feed_index(self) -> Callable[[int], int]:
        """For a relay copy row: how many receive chunks, in posting order, complete the
        last one that writes (part of) the region it forwards."""
        order = sorted(self.recv_chunks, key=lambda c: c.key)
        c = self.program.copies
        dst_t, src_t, nd = c.dst.tolist(), c.src.tolist(), c.ndim.tolist()
        src_off, dst_off, shape = c.src_off.tolist(), c.dst_off.tolist(), c.shape.tolist()
        writes: dict[int, list[tuple[int, int]]] = {}
        for k, ch in enumerate(order):
            for i in ch.rows:
                writes.setdefault(dst_t[i], []).append((k, i))

        def overlaps(a: int, b: int) -> bool:  # a's source region, b's destination region
            return all(
                ao < bo + bn and bo < ao + an
                for ao, an, bo, bn in zip(
                    src_off[a][: nd[a]],
                    shape[a][: nd[a]],
                    dst_off[b][: nd[b]],
                    shape[b][: nd[b]],
                    strict=True,
                )
            )

        def feed(i: int) -> int:
            hits = [k for k, w in writes.get(src_t[i], ()) if overlaps(i, w)]
            return max(hits) + 1 if hits else len(order)

        return feed

    def _local_plan(self, rows: list[int]) -> LocalStep:
        """The local copies as a ready-to-run step (SlotData.local_plan); on CUDA with
        triton the grouped kernels take every copy they can (REFITD_GROUPED_LANDING=0: off)."""
        grouped = None
        if rows and self.device.type == "cuda" and os.environ.get(GROUPED_ENV, "1") != "0":
            from refitd.formats import grouped as grouped_mod

            if grouped_mod.available(self.device):
                grouped = grouped_mod.GroupedLanding(self.device)
        return self.data.local_plan(rows, grouped)

    # ------------------------------------------------------------------ run
    def _peer(self, slot: int) -> int:
        return slot if self.slot_ranks is None else self.slot_ranks[slot]

    def run(
        self,
        timeout_s: float,
        on_sources_released: Callable[[], None] | None = None,
        abort: threading.Event | None = None,
        verify: bool = False,
        skip: frozenset[int] = frozenset(),
    ) -> ExecReport:
        """One refit of this slot; raises ExecutionError (or StorageMovedError) on failure.
        With verify, fills report.checksums and checks local copies (module docstring).
        `skip`: message ids moved elsewhere this refit (delta refits), on both ends."""
        t0 = time.monotonic()
        p = self.program
        relayed = [
            int(p.send.id[k])
            for k in range(len(p.send))
            if int(p.send.id[k]) in skip
            and self.info.relay[int(p.send.start[k]) : int(p.send.end[k])].any()
        ]
        if relayed:  # a relay forwards what this refit delivered: it cannot go first
            raise ExecutionError(
                f"slot {self.program.slot}: relay messages {relayed[:4]} cannot be skipped"
            )
        self.resolver.check(self._index_list)
        abort = abort or threading.Event()
        self.pool.reset()
        deadline = t0 + timeout_s
        report = ExecReport(slot=self.program.slot)
        phases = report.phases
        has_messages = bool(self.send_chunks or self.recv_chunks)
        if has_messages and self.transport is None:
            raise ExecutionError(f"slot {self.program.slot}: program has messages but no transport")
        errors: list[BaseException] = []
        sends_left = [
            self._source_chunks
            - sum(self._reads_source[id(c)] for c in self.send_chunks if c.mid in skip)
        ]
        released = threading.Event()
        lock = threading.Lock()
        progress = threading.Condition(lock)
        recvs_done = [0]  # receive chunks completed (waited and unpacked), in posting order
        stats: dict[tuple[str, int], MessageStat] = {}
        started: dict[tuple[str, int], float] = {}
        is_cuda = self.device.type == "cuda"
        busy = {"pack_s": 0.0, "unpack_s": 0.0, "recv_wait_s": 0.0}  # summed per thread
        send_sums: _Sums | None = {} if verify else None
        recv_sums: _Sums | None = {} if verify else None

        def fail(e: BaseException) -> None:
            with lock:
                errors.append(e)
                progress.notify_all()
            abort.set()

        def wait_recvs(n: int, what: str) -> None:
            """Block until the first n posted receive chunks are complete."""
            with progress:
                while recvs_done[0] < n:
                    if abort.is_set():
                        raise ExecutionError(f"{what}: aborted")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExecutionError(
                            f"{what}: timed out waiting for {n - recvs_done[0]} earlier receives"
                        )
                    progress.wait(min(left, 0.1))
            if is_cuda:  # unpacks are queued on the stream: make them visible before reading
                torch.cuda.current_stream(self.device).synchronize()

        def stat(direction: str, ch: Chunk, zc: bool) -> MessageStat:
            key = (direction, ch.mid)
            with lock:
                s = stats.get(key)
                if s is None:
                    peer = ch.dst_slot if direction == "send" else ch.src_slot
                    s = stats[key] = MessageStat(ch.mid, direction, peer, ch.msg_nbytes, 0.0)
                    started[key] = time.monotonic()
                if zc:
                    s.zero_copy_chunks += 1
                else:
                    s.staged_chunks += 1
            return s

        def source_done(n: int = 1) -> None:
            with lock:
                sends_left[0] -= n
                done = sends_left[0] == 0 and local_done.is_set()
                if done and released.is_set():
                    done = False
                if done:
                    released.set()
            if done:
                if verify and is_cuda:  # source checksums are queued on the stream
                    torch.cuda.current_stream(self.device).synchronize()
                report.sources_released_s = time.monotonic() - t0
                if on_sources_released is not None:
                    on_sources_released()

        local_done = threading.Event()
        send_q: queue.Queue[_Posted | None] = queue.Queue()
        recv_q: queue.Queue[_Posted | None] = queue.Queue()

        def describe(ch: Chunk, direction: str) -> str:
            peer = ch.dst_slot if direction == "send" else ch.src_slot
            return (
                f"slot {self.program.slot}: {direction} of message {ch.mid} (round {ch.round}, "
                f"chunk {ch.index}, {ch.nbytes} bytes) {'to' if direction == 'send' else 'from'} "
                f"slot {peer} (rank {self._peer(peer)})"
            )

        def poster() -> None:
            try:
                for sends, recvs in self._steps:
                    ops: list[P2POp] = []
                    posted: list[tuple[Chunk, torch.Tensor, int, bool]] = []
                    for ch in recvs:
                        if ch.mid in skip:  # landed before the executor ran
                            posted.append((ch, _SKIPPED, -1, False))
                            continue
                        zc = self._zc_recv[id(ch)]
                        ring = self._ring.get(id(ch), -1)
                        buf = (
                            zc
                            if zc is not None
                            else self.pool.acquire(
                                "recv", ring, deadline, abort, describe(ch, "recv")
                            )
                        )
                        ops.append(P2POp(False, buf[: ch.nbytes], self._peer(ch.src_slot), ch.tag))
                        posted.append((ch, buf, ring, False))
                    for ch in sends:
                        if ch.mid in skip:
                            continue
                        need = self._relay_wait.get(id(ch))
                        if need is not None:
                            wait_recvs(need, describe(ch, "send"))
                        zc = self._zc_send[id(ch)]
                        ring = self._ring.get(id(ch), -1)
                        if zc is None and send_sums is not None:
                            self.data.source_sums(ch, send_sums)
                        if zc is None:
                            buf = self.pool.acquire(
                                "send", ring, deadline, abort, describe(ch, "send")
                            )
                            tp = time.monotonic()
                            self.data.pack(ch, buf, send_sums)
                            busy["pack_s"] += time.monotonic() - tp
                            if buf.is_cuda:
                                torch.cuda.current_stream(buf.device).synchronize()
                            if self._reads_source[id(ch)]:
                                source_done()
                        else:
                            buf = zc
                        ops.append(P2POp(True, buf[: ch.nbytes], self._peer(ch.dst_slot), ch.tag))
                        posted.append((ch, buf, ring, True))
                    if abort.is_set():
                        return
                    try:
                        works = iter(self.transport.batch(ops) if ops else [])  # type: ignore[union-attr]
                    except Exception as e:
                        ch0 = posted[0][0]
                        raise ExecutionError(
                            f"{describe(ch0, 'send' if posted[0][3] else 'recv')}: {e}"
                        ) from e
                    for ch, buf, ring, is_send in posted:
                        if buf is _SKIPPED:  # counted in posting order by the receiver
                            recv_q.put(_Posted(ch, DoneWork(), buf, -1))
                            continue
                        stat("send" if is_send else "recv", ch, ring < 0)
                        (send_q if is_send else recv_q).put(_Posted(ch, next(works), buf, ring))
            except BaseException as e:
                fail(e)
            finally:
                send_q.put(None)
                recv_q.put(None)

        def send_waiter() -> None:
            try:
                while (item := send_q.get()) is not None:
                    try:
                        item.work.wait(deadline - time.monotonic())
                    except Exception as e:
                        raise ExecutionError(f"{describe(item.chunk, 'send')}: {e}") from e
                    key = ("send", item.chunk.mid)
                    stats[key].seconds = time.monotonic() - started[key]
                    if item.staged:
                        self.pool.release("send", item.ring)
                    else:
                        if send_sums is not None:  # zero-copy: overlaps the next sends
                            self.data.source_sums(item.chunk, send_sums)
                        if self._reads_source[id(item.chunk)]:
                            source_done()
                    with lock:
                        report.sent_bytes += item.chunk.nbytes
            except BaseException as e:
                fail(e)
                while send_q.get() is not None:
                    pass

        def receiver() -> None:
            partial: dict[int, torch.Tensor] = {}
            try:
                while (item := recv_q.get()) is not None:
                    if item.buf is _SKIPPED:
                        with progress:
                            recvs_done[0] += 1
                            progress.notify_all()
                        continue
                    tw = time.monotonic()
                    try:
                        item.work.wait(deadline - time.monotonic())
                    except Exception as e:
                        raise ExecutionError(f"{describe(item.chunk, 'recv')}: {e}") from e
                    tu = time.monotonic()
                    busy["recv_wait_s"] += tu - tw
                    if item.staged:
                        try:
                            self.data.unpack(item.chunk, item.buf, partial, recv_sums)
                            busy["unpack_s"] += time.monotonic() - tu
                        except Exception as e:
                            raise ExecutionError(
                                f"{describe(item.chunk, 'recv')}: unpack failed: {e}"
                            ) from e
                        self.pool.release("recv", item.ring)
                    if recv_sums is not None:
                        self.data.landed(item.chunk, recv_sums)
                    key = ("recv", item.chunk.mid)
                    stats[key].seconds = time.monotonic() - started[key]
                    with progress:
                        report.recv_bytes += item.chunk.nbytes
                        recvs_done[0] += 1
                        progress.notify_all()
            except BaseException as e:
                fail(e)
                while recv_q.get() is not None:
                    pass

        def on_device(f: Callable[[], None]) -> Callable[[], None]:
            def body() -> None:
                if is_cuda:  # the CUDA current device is per thread
                    torch.cuda.set_device(self.device)
                f()

            return body

        threads: list[threading.Thread] = []
        if has_messages:
            threads = [
                threading.Thread(target=on_device(f), name=f"refitd-{f.__name__}", daemon=True)
                for f in (poster, send_waiter, receiver)
            ]
            for t in threads:
                t.start()
        tl = time.monotonic()
        phases["check_start_s"] = tl - t0

        def run_local(step: LocalStep, what: str) -> None:
            try:
                fused = None
                timed = is_cuda and not step.empty
                if timed:  # GPU time of the local copies next to the host's (phases)
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    events[0].record()
                    t_launch = time.monotonic()
                if step.grouped is not None:
                    fused = step.grouped.run(hash=verify)
                    report.local_bytes += step.grouped.nbytes
                if step.dst:
                    torch._foreach_copy_(step.dst, step.src)
                for call, a, b in step.slow:
                    call(a, b)
                report.local_bytes += step.nbytes
                if timed:
                    events[1].record()
                    phases["local_launch_s"] = phases.get("local_launch_s", 0.0) + (
                        time.monotonic() - t_launch
                    )
                if verify:
                    self.data.check_local(step.rows, fused, step.grouped_plain)
                if timed:  # local copies are async on the GPU
                    torch.cuda.current_stream(self.device).synchronize()
                    gpu_s = events[0].elapsed_time(events[1]) / 1e3
                    phases["local_gpu_s"] = phases.get("local_gpu_s", 0.0) + gpu_s
            except ExecutionError as e:
                fail(e)
            except BaseException as e:
                fail(ExecutionError(f"slot {self.program.slot}: {what} failed: {e}"))

        run_local(self._local_direct, "local copy")
        report.local_seconds = time.monotonic() - tl
        phases["local_s"] = report.local_seconds
        local_done.set()
        source_done(0)
        if not self._local_relay.empty and not errors:
            try:
                wait_recvs(len(self.recv_chunks), f"slot {self.program.slot}: local relay copies")
            except BaseException as e:
                fail(e)
            else:
                tr = time.monotonic()
                run_local(self._local_relay, "local relay copy")
                report.local_seconds += time.monotonic() - tr
        tj = time.monotonic()
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0) + 1.0)
        if any(t.is_alive() for t in threads):
            abort.set()
            if not errors:
                errors.append(
                    ExecutionError(
                        f"slot {self.program.slot}: refit did not finish within {timeout_s:.1f}s"
                    )
                )
        if errors:
            raise errors[0]
        if is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.monotonic()
        phases["messages_s"] = t1 - tj
        if has_messages:
            phases.update(busy)
        if send_sums is not None and recv_sums is not None:
            report.checksums = {
                "send": self.data.message_sums(_without(self.program.send, skip), send_sums),
                "recv": self.data.message_sums(_without(self.program.recv, skip), recv_sums),
            }
            phases["checksums_s"] = time.monotonic() - t1
            t1 = time.monotonic()
        report.seconds = t1 - t0
        report.staging_peak_bytes = self.pool.peak_bytes
        report.messages = sorted(stats.values(), key=lambda s: (s.direction, s.id))
        return report


def _without(m: MessageColumns, skip: frozenset[int]) -> MessageColumns:
    """The messages not in `skip` (they went through the delta path)."""
    if not skip:
        return m
    keep = ~np.isin(m.id, np.fromiter(skip, dtype=np.int64, count=len(skip)))
    return MessageColumns(*(getattr(m, f.name)[keep] for f in dataclasses.fields(m)))

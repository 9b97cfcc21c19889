"""Runs one slot's program for one refit: local copies, then every message, pipelined.

Wire protocol of a message (both ends derive it from the program alone): its copies'
segments laid end to end (wire.segment_nbytes each) are cut into chunks of at most
WIRE_CHUNK bytes. Consecutive small segments share a chunk; a segment larger than WIRE_CHUNK
gets chunks of its own. Each chunk is one send matched by one receive. Chunks are posted in
(round, chunk index, message id) order on every slot, so every pair of slots sees its
common chunks in the same order and the smallest unfinished chunk can always progress.

A chunk that is one piece of one raw segment whose block is contiguous is sent straight
from the source tensor, and received straight into the destination when the destination
block is contiguous, plain and of the source dtype (zero-copy). Other chunks are packed and
unpacked through staging buffers from a pool of bounded total size. While chunk k is on the
wire, k+1 is being packed (poster thread) and k-1 unpacked (receiver thread).

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
import functools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from refitd.agent.checksums import Checksummer, combine
from refitd.agent.segments import (
    ResolvedTensor,
    block,
    decode_segment,
    encode_segment,
    is_plain_raw,
)
from refitd.plan.layout import PLAIN
from refitd.plan.program import Copy, Message, SlotProgram
from refitd.plan.wire import RAW, dtype_size, segment_nbytes
from refitd.transport.base import DoneWork, P2POp, Transport, Work
from refitd.transport.memory import StorageMovedError, torch_dtype

if TYPE_CHECKING:
    from refitd.formats.grouped import GroupedLanding

WIRE_CHUNK = 32 << 20
_SKIPPED = torch.empty(0, dtype=torch.uint8)  # marks a receive chunk of a skipped message
GROUPED_ENV = "REFITD_GROUPED_LANDING"  # "0": land local copies one call each (comparisons)
DEFAULT_STAGING_BYTES = 256 << 20
TAG_CHUNK_BITS = 12


_Sums = dict[tuple[int, Copy], torch.Tensor]  # (message id, copy) -> 0-d int64 checksum


class ExecutionError(RuntimeError):
    """A refit of one slot failed: which message, which peer, why."""


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
class LocalStep:
    """Local copies prepared for a refit: a grouped launch (refitd.formats.grouped) and
    one call per copy it did not take (`copies`, for verification); `grouped_plain`: the
    plain copies inside the grouped launch, in the order of its checksums."""

    grouped: GroupedLanding | None = None
    calls: list[tuple[Callable[[], None], int]] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    grouped_plain: list[Copy] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.grouped is None and not self.calls


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [seg_start, seg_start + nbytes) of a copy's segment, at chunk_offset in a chunk."""

    copy: Copy
    seg_start: int
    nbytes: int
    chunk_offset: int
    whole: bool  # the piece is the copy's entire segment


@dataclass(frozen=True, slots=True)
class Chunk:
    message: Message
    index: int
    nbytes: int
    pieces: tuple[Piece, ...]

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.message.round, self.index, self.message.id)

    @property
    def tag(self) -> int:
        return ((self.message.id << TAG_CHUNK_BITS) | self.index) & 0x7FFFFFFF


def chunk_message(
    m: Message,
    src_dtype: Callable[[Copy], str],
    wire_chunk: int = WIRE_CHUNK,
    staged_chunk: int | None = None,
    lands_direct: Callable[[Copy], bool] | None = None,
) -> list[Chunk]:
    """Cut a message into chunks; both ends compute the same list from the program.

    A segment that lands straight in its destination (lands_direct, decided from the specs)
    is cut at wire_chunk; other segments, and groups of small segments, at staged_chunk
    (default wire_chunk): a small staged chunk is still in cache when it is unpacked.
    """
    staged_chunk = staged_chunk or wire_chunk
    if wire_chunk % 16 or staged_chunk % 16:
        raise ValueError("wire_chunk and staged_chunk must be multiples of 16")
    chunks: list[Chunk] = []
    group: list[Piece] = []
    group_start = 0

    def flush() -> None:
        nonlocal group
        if group:
            n = max(p.chunk_offset + p.nbytes for p in group)
            chunks.append(Chunk(m, len(chunks), n, tuple(group)))
        group = []

    off = 0
    for c in m.copies:
        dt = src_dtype(c)
        total = segment_nbytes(c.wire, c.shape, dt)
        payload = math.prod(c.shape) * dtype_size(dt) if c.wire == RAW else total
        size = wire_chunk if lands_direct is None or lands_direct(c) else staged_chunk
        if total > size:
            flush()
            for s in range(0, payload, size):
                n = min(size, payload - s)
                chunks.append(Chunk(m, len(chunks), n, (Piece(c, s, n, 0, payload == n),)))
        else:
            if group and off + total - group_start > staged_chunk:
                flush()
            if not group:
                group_start = off
            group.append(Piece(c, 0, payload, off - group_start, True))
        off += total
    flush()
    if off != m.nbytes:
        raise ExecutionError(
            f"message {m.id} ({m.src_slot}->{m.dst_slot}): copies need {off} bytes on the "
            f"wire but the plan says {m.nbytes}"
        )
    return chunks


def flat_range_views(t: torch.Tensor, e0: int, e1: int) -> list[torch.Tensor]:
    """Views covering elements [e0, e1) of `t` in row-major order, fewest blocks possible."""
    if e0 >= e1:
        return []
    if t.dim() == 0:
        return [t.reshape(1)]
    if t.dim() == 1:
        return [t[e0:e1]]
    if t.is_contiguous():
        return [t.reshape(-1)[e0:e1]]
    inner = t.numel() // t.shape[0]
    i0, r0 = divmod(e0, inner)
    i1, r1 = divmod(e1, inner)
    if i0 == i1:
        return flat_range_views(t[i0], r0, r1)
    out: list[torch.Tensor] = []
    if r0:
        out += flat_range_views(t[i0], r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(t[i0:i1])
    if r1:
        out += flat_range_views(t[i1], 0, r1)
    return out


class StagingPool:
    """Staging buffers of at most `chunk` bytes; sends and receives each get half the cap.

    Buffers are allocated on first use and reused across refits, so a steady refit does no
    allocation. `peak_bytes` is what was ever allocated: never more than the cap.
    """

    def __init__(self, cap_bytes: int, chunk: int, device: torch.device) -> None:
        self.cap_bytes = cap_bytes
        self.chunk = chunk
        self.device = device
        self.per_side = (cap_bytes // 2) // chunk
        if self.per_side < 1:
            raise ValueError(
                f"staging cap {cap_bytes} bytes is below two wire chunks ({2 * chunk} bytes)"
            )
        self._free: dict[str, list[torch.Tensor]] = {"send": [], "recv": []}
        self._count: dict[str, int] = {"send": 0, "recv": 0}
        self._cv = threading.Condition()
        self.peak_bytes = 0

    def acquire(
        self, side: str, deadline: float, abort: threading.Event, what: str = ""
    ) -> torch.Tensor:
        with self._cv:
            while True:
                if abort.is_set():
                    raise ExecutionError("aborted while waiting for a staging buffer")
                if self._free[side]:
                    return self._free[side].pop()
                if self._count[side] < self.per_side:
                    self._count[side] += 1
                    self.peak_bytes = self.chunk * (self._count["send"] + self._count["recv"])
                    pin = self.device.type == "cpu" and torch.cuda.is_available()
                    return torch.empty(
                        self.chunk, dtype=torch.uint8, device=self.device, pin_memory=pin
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutionError(
                        f"{what}: timed out waiting for a free {side} staging buffer (earlier "
                        "messages still in flight: a peer is slow, stuck or absent)"
                    )
                self._cv.wait(min(left, 0.1))

    def release(self, side: str, buf: torch.Tensor) -> None:
        with self._cv:
            self._free[side].append(buf)
            self._cv.notify()


@dataclass
class _Posted:
    chunk: Chunk
    work: Work
    buf: torch.Tensor
    staged: bool


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
        self._tensors: dict[int, ResolvedTensor] = {}
        self._index_list = sorted(self._indices())
        self._validate()
        self.device = device or self._guess_device()
        self.send_chunks = self._chunks(program.sends)
        self.recv_chunks = self._chunks(program.recvs)
        steps: dict[tuple[int, int, int], tuple[list[Chunk], list[Chunk]]] = {}
        for c in self.send_chunks:
            steps.setdefault(c.key, ([], []))[0].append(c)
        for c in self.recv_chunks:
            steps.setdefault(c.key, ([], []))[1].append(c)
        self._steps = [steps[k] for k in sorted(steps)]
        self._zc_send = {id(c): self._zero_copy_send(c) for c in self.send_chunks}
        self._zc_recv = {id(c): self._zero_copy_recv(c) for c in self.recv_chunks}
        staged = [c.nbytes for c in self.send_chunks if self._zc_send[id(c)] is None]
        staged += [c.nbytes for c in self.recv_chunks if self._zc_recv[id(c)] is None]
        buf_bytes = -(-max(staged, default=16) // 16) * 16
        self.pool = StagingPool(self.config.staging_bytes, buf_bytes, self.device)
        # relays: a copy reading a destination tensor of this slot (see the module docstring)
        self._dest_tensors = frozenset(
            [c.dst_tensor for m in program.recvs for c in m.copies]
            + [c.dst_tensor for c in program.local]
        )
        recv_rounds = sorted(c.message.round for c in self.recv_chunks)
        feeds = self._feed_index()
        self._relay_wait: dict[int, int] = {}  # send chunk -> receives to complete first
        self._reads_source: dict[int, bool] = {}
        for m_chunks in self._by_message(self.send_chunks):
            m = m_chunks[0].message
            if any(self._is_relay(c) for c in m.copies):
                # every receive of a smaller round holds everything it may forward; the
                # prefix up to the last receive writing what it forwards is enough
                n = bisect.bisect_left(recv_rounds, m.round)
                n = min(n, max((feeds(c) for c in m.copies if self._is_relay(c)), default=n))
                for ch in m_chunks:
                    self._relay_wait[id(ch)] = n
            for ch in m_chunks:
                self._reads_source[id(ch)] = any(not self._is_relay(p.copy) for p in ch.pieces)
        self._source_chunks = sum(self._reads_source.values())
        self._local_direct_copies = [c for c in program.local if not self._is_relay(c)]
        self._local_relay_copies = [c for c in program.local if self._is_relay(c)]
        self._local_direct = self._local_plan(self._local_direct_copies)
        self._local_relay = self._local_plan(self._local_relay_copies)
        self._summer = Checksummer()

    # ------------------------------------------------------------------ preparation
    def _indices(self) -> set[int]:
        idx: set[int] = set()
        for c in self.program.local:
            idx |= {c.src_tensor, c.dst_tensor}
        for m in self.program.sends:
            idx |= {c.src_tensor for c in m.copies}
        for m in self.program.recvs:
            idx |= {c.dst_tensor for c in m.copies}
        return idx

    def _validate(self) -> None:
        p = self.program
        for i in sorted(self._indices()):
            spec = p.tensors.get(i)
            if spec is None:
                raise ExecutionError(
                    f"slot {p.slot}: program uses tensor {i} but has no spec for it"
                )
            t = self.resolver.resolve(i)
            if tuple(t.data.shape) != tuple(spec.local_shape):
                raise ExecutionError(
                    f"tensor {spec.name!r} (pool {spec.pool}, rank {spec.rank}): mapped shape "
                    f"{tuple(t.data.shape)} != registered local shape {tuple(spec.local_shape)}"
                )
            if spec.storage == PLAIN and t.data.dtype != torch_dtype(spec.dtype):
                raise ExecutionError(
                    f"tensor {spec.name!r} (pool {spec.pool}, rank {spec.rank}): mapped dtype "
                    f"{t.data.dtype} != registered {spec.dtype}"
                )
            self._tensors[i] = t
        for m in p.recvs:
            for c in m.copies:
                if c.src_tensor not in p.tensors:
                    raise ExecutionError(
                        f"slot {p.slot}: received message {m.id} copies from tensor "
                        f"{c.src_tensor} whose spec (source dtype) the program lacks"
                    )

    def _guess_device(self) -> torch.device:
        for t in self._tensors.values():
            return t.data.device
        return torch.device("cpu")

    def _src_dtype(self, c: Copy) -> str:
        return self.program.tensors[c.src_tensor].dtype

    def _chunks(self, messages: Iterable[Message]) -> list[Chunk]:
        out: list[Chunk] = []
        for m in messages:
            out += chunk_message(
                m,
                self._src_dtype,
                self.config.wire_chunk,
                self.config.staged_chunk,
                self._lands_direct,
            )
        return out

    def _lands_direct(self, c: Copy) -> bool:
        """Whether the plan says this copy can be received in place: raw wire into a plain
        destination of the source dtype whose block is contiguous (from the specs only, so
        sender and receiver agree)."""
        if c.wire != RAW:
            return False
        d = self.program.tensors.get(c.dst_tensor)
        if d is None or d.storage != PLAIN or d.dtype != self._src_dtype(c):
            return False
        dims = [(n, f) for n, f in zip(c.shape, d.local_shape, strict=True)]
        while dims and dims[0][0] == 1:
            dims.pop(0)
        return all(n == f for n, f in dims[1:])

    @staticmethod
    def _by_message(chunks: list[Chunk]) -> list[list[Chunk]]:
        out: dict[int, list[Chunk]] = {}
        for ch in chunks:
            out.setdefault(ch.message.id, []).append(ch)
        return list(out.values())

    def _feed_index(self) -> Callable[[Copy], int]:
        """For a relay copy: how many receive chunks, in posting order, complete the last
        one that writes (part of) the region it forwards."""
        order = sorted(self.recv_chunks, key=lambda c: c.key)
        writes: dict[int, list[tuple[int, Copy]]] = {}
        for i, ch in enumerate(order):
            for p in ch.pieces:
                writes.setdefault(p.copy.dst_tensor, []).append((i, p.copy))

        def overlaps(a: Copy, b: Copy) -> bool:  # a's source region, b's destination region
            return all(
                ao < bo + bn and bo < ao + an
                for ao, an, bo, bn in zip(a.src_offset, a.shape, b.dst_offset, b.shape, strict=True)
            )

        def feed(c: Copy) -> int:
            hits = [i for i, w in writes.get(c.src_tensor, ()) if overlaps(c, w)]
            return max(hits) + 1 if hits else len(order)

        return feed

    def _is_relay(self, c: Copy) -> bool:
        return c.src_tensor in self._dest_tensors

    def _local_plan(self, copies: list[Copy]) -> LocalStep:
        """The local copies as a ready-to-run step: views are cut once here, not per refit
        (the storage check before every run guards their validity). On CUDA with triton,
        every copy the grouped kernels take (same-dtype plain copies, MXFP8 / block-FP8
        conversions) lands in one launch per group; the others are one call each."""
        grouped = None
        if copies and self.device.type == "cuda" and os.environ.get(GROUPED_ENV, "1") != "0":
            from refitd.formats import grouped as grouped_mod

            if grouped_mod.available(self.device):
                grouped = grouped_mod.GroupedLanding(self.device)
        step = LocalStep(grouped)
        for c in copies:
            nbytes = math.prod(c.shape) * dtype_size(self._src_dtype(c))
            dst = self._tensors[c.dst_tensor]
            if dst.storage == PLAIN:
                if grouped is not None and grouped.add_copy(self._src_block(c), self._dst_block(c)):
                    step.grouped_plain.append(c)
                    continue
                step.calls.append(
                    (functools.partial(self._dst_block(c).copy_, self._src_block(c)), nbytes)
                )
            else:  # quantized storage: the destination region (views) is cut once too
                from refitd import formats

                region = formats.dest_region(
                    dst.storage, dst.data, dst.scales, c.dst_offset, c.shape, name=dst.name
                )
                if grouped is not None and grouped.add_quantize(self._src_block(c), region):
                    continue
                step.calls.append(
                    (functools.partial(formats.copy_region, self._src_block(c), region), nbytes)
                )
            step.copies.append(c)
        if grouped is not None:
            step.grouped = grouped.build() if grouped.regions else None
        return step

    def _src_block(self, c: Copy) -> torch.Tensor:
        return block(self._tensors[c.src_tensor].data, c.src_offset, c.shape)

    def _dst_block(self, c: Copy) -> torch.Tensor:
        return block(self._tensors[c.dst_tensor].data, c.dst_offset, c.shape)

    def _piece_views(self, region: torch.Tensor, p: Piece, itemsize: int) -> list[torch.Tensor]:
        return flat_range_views(
            region, p.seg_start // itemsize, (p.seg_start + p.nbytes) // itemsize
        )

    def _zero_copy_send(self, ch: Chunk) -> torch.Tensor | None:
        if len(ch.pieces) != 1 or ch.pieces[0].copy.wire != RAW:
            return None
        p = ch.pieces[0]
        src = self._src_block(p.copy)
        if src.device != self.device:  # a host snapshot of GPU sources: staged to the device
            return None
        views = self._piece_views(src, p, src.element_size())
        if (
            len(views) == 1
            and views[0].is_contiguous()
            and views[0].numel() * src.element_size() == ch.nbytes
        ):
            return views[0].reshape(-1).view(torch.uint8)
        return None

    def _zero_copy_recv(self, ch: Chunk) -> torch.Tensor | None:
        if len(ch.pieces) != 1:
            return None
        p = ch.pieces[0]
        dst = self._tensors[p.copy.dst_tensor]
        if not is_plain_raw(p.copy.wire, dst) or dst.data.dtype != torch_dtype(
            self._src_dtype(p.copy)
        ):
            return None
        region = self._dst_block(p.copy)
        views = self._piece_views(region, p, region.element_size())
        if (
            len(views) == 1
            and views[0].is_contiguous()
            and views[0].numel() * region.element_size() == ch.nbytes
        ):
            return views[0].reshape(-1).view(torch.uint8)
        return None

    # ------------------------------------------------------------------ pack / unpack
    def _pack(self, ch: Chunk, buf: torch.Tensor, sums: _Sums | None = None) -> None:
        """Pack a chunk; with `sums`, checksum encoded segments (raw ones: _source_sum)."""
        for p in ch.pieces:
            c = p.copy
            src = self._src_block(c)
            if c.wire == RAW:
                pos = p.chunk_offset
                for v in self._piece_views(src, p, src.element_size()):
                    n = v.numel() * v.element_size()
                    buf[pos : pos + n].view(v.dtype).view(v.shape).copy_(v)
                    pos += n
            elif p.whole:
                seg = buf[p.chunk_offset : p.chunk_offset + p.nbytes]
                encode_segment(c.wire, src, seg)
                if sums is not None:
                    sums[(ch.message.id, c)] = self._summer.tensor(seg)
            else:
                # A quantized segment larger than a chunk is encoded whole, then sliced.
                full = segment_nbytes(c.wire, c.shape, self._src_dtype(c))
                scratch = torch.empty(full, dtype=torch.uint8, device=buf.device)
                encode_segment(c.wire, src, scratch)
                buf[: p.nbytes].copy_(scratch[p.seg_start : p.seg_start + p.nbytes])
                if sums is not None and p.seg_start == 0:
                    sums[(ch.message.id, c)] = self._summer.tensor(scratch)

    def _unpack(
        self,
        ch: Chunk,
        buf: torch.Tensor,
        partial: dict[Copy, torch.Tensor],
        sums: _Sums | None = None,
    ) -> None:
        """Unpack a chunk; with `sums`, checksum the segments it decodes (see _landed)."""
        for p in ch.pieces:
            c = p.copy
            dst = self._tensors[c.dst_tensor]
            src_dtype = torch_dtype(self._src_dtype(c))
            seg = buf[p.chunk_offset : p.chunk_offset + p.nbytes]
            if is_plain_raw(c.wire, dst):
                region = self._dst_block(c)
                itemsize = dtype_size(self._src_dtype(c))
                pos = 0
                for v in self._piece_views(region, p, itemsize):
                    n = v.numel() * itemsize
                    v.copy_(seg[pos : pos + n].view(src_dtype).view(v.shape))
                    pos += n
                continue
            if not p.whole:
                full = segment_nbytes(c.wire, c.shape, self._src_dtype(c))
                acc = partial.setdefault(c, torch.empty(full, dtype=torch.uint8, device=buf.device))
                acc[p.seg_start : p.seg_start + p.nbytes].copy_(seg)
                if p.seg_start + p.nbytes < full:
                    continue
                seg = partial.pop(c)
            if sums is not None:  # a raw segment without its alignment padding
                n = math.prod(c.shape) * dtype_size(self._src_dtype(c)) if c.wire == RAW else None
                sums[(ch.message.id, c)] = self._summer.tensor(seg[:n])
            decode_segment(c.wire, seg, c.shape, src_dtype, dst, c.dst_offset)

    # ------------------------------------------------------------------ verification
    def _source_sum(self, c: Copy) -> torch.Tensor:
        """Sender checksum of a raw copy: its source block as a plain destination will hold
        it (cast to the destination dtype when it differs), else as the raw segment."""
        src = self._src_block(c)
        d = self.program.tensors[c.dst_tensor]
        if d.storage == PLAIN and torch_dtype(d.dtype) != src.dtype:
            src = src.to(torch_dtype(d.dtype))
        return self._summer.tensor(src)

    def _source_sums(self, ch: Chunk, sums: _Sums) -> None:
        """Sender checksums of the raw copies that start in ch (encoded ones: _pack)."""
        for p in ch.pieces:
            if p.seg_start == 0 and p.copy.wire == RAW:
                sums[(ch.message.id, p.copy)] = self._source_sum(p.copy)

    def _landed(self, ch: Chunk, sums: _Sums) -> None:
        """Read back the destination blocks of the plain raw copies that ch completes."""
        for p in ch.pieces:
            c = p.copy
            if not is_plain_raw(c.wire, self._tensors[c.dst_tensor]):
                continue  # checked on its segment in _unpack
            if p.seg_start + p.nbytes == math.prod(c.shape) * dtype_size(self._src_dtype(c)):
                sums[(ch.message.id, c)] = self._summer.tensor(self._dst_block(c))

    def _message_sums(self, messages: Iterable[Message], sums: _Sums) -> dict[int, int]:
        """One checksum per message: its copies' checksums combined in order."""
        keys = [(m.id, c) for m in messages for c in m.copies]
        missing = [k for k in keys if k not in sums]
        if missing:
            mid, c = missing[0]
            raise ExecutionError(
                f"slot {self.program.slot}: message {mid}: no checksum for the copy of tensor "
                f"{c.src_tensor} -> {c.dst_tensor} ({len(missing)} copies missing)"
            )
        values = iter(torch.stack([sums[k] for k in keys]).tolist() if keys else [])
        return {m.id: combine(next(values) for _ in m.copies) for m in messages}

    def _check_local(
        self,
        copies: list[Copy],
        fused: torch.Tensor | None = None,
        fused_copies: list[Copy] | None = None,
    ) -> None:
        """Compare each local copy's destination block with its source (plain storage);
        `fused`: (source, landed) checksums the grouped copy kernel computed for
        fused_copies."""
        plain = [c for c in copies if self._tensors[c.dst_tensor].storage == PLAIN]
        pairs = [
            torch.stack((self._source_sum(c), self._summer.tensor(self._dst_block(c))))
            for c in plain
        ]
        if fused is not None and fused_copies:
            plain += fused_copies
            pairs.append(fused)
        if not plain:
            return
        values = torch.cat([p.reshape(-1, 2) for p in pairs]).tolist()
        bad = [c for c, (a, b) in zip(plain, values, strict=True) if a != b]
        if bad:
            raise ExecutionError(
                f"slot {self.program.slot}: checksum mismatch of {len(bad)} local copies: "
                + "; ".join(
                    f"{self._describe_tensor(c.src_tensor)} at {c.src_offset} -> "
                    f"{self._describe_tensor(c.dst_tensor)} at {c.dst_offset} {c.shape}"
                    for c in bad[:8]
                )
            )

    def _describe_tensor(self, index: int) -> str:
        s = self.program.tensors[index]
        return f"{s.name!r} (pool {s.pool}, rank {s.rank})"

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
        relayed = [
            m.id for m in self.program.sends if m.id in skip and any(map(self._is_relay, m.copies))
        ]
        if relayed:  # a relay forwards what this refit delivered: it cannot go first
            raise ExecutionError(
                f"slot {self.program.slot}: relay messages {relayed[:4]} cannot be skipped"
            )
        self.resolver.check(self._index_list)
        abort = abort or threading.Event()
        deadline = t0 + timeout_s
        report = ExecReport(slot=self.program.slot)
        phases = report.phases
        has_messages = bool(self.send_chunks or self.recv_chunks)
        if has_messages and self.transport is None:
            raise ExecutionError(f"slot {self.program.slot}: program has messages but no transport")
        errors: list[BaseException] = []
        sends_left = [
            self._source_chunks
            - sum(self._reads_source[id(c)] for c in self.send_chunks if c.message.id in skip)
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
            key = (direction, ch.message.id)
            with lock:
                s = stats.get(key)
                if s is None:
                    peer = ch.message.dst_slot if direction == "send" else ch.message.src_slot
                    s = stats[key] = MessageStat(
                        ch.message.id, direction, peer, ch.message.nbytes, 0.0
                    )
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
            m = ch.message
            peer = m.dst_slot if direction == "send" else m.src_slot
            return (
                f"slot {self.program.slot}: {direction} of message {m.id} (round {m.round}, "
                f"chunk {ch.index}, {ch.nbytes} bytes) {'to' if direction == 'send' else 'from'} "
                f"slot {peer} (rank {self._peer(peer)})"
            )

        def poster() -> None:
            try:
                for sends, recvs in self._steps:
                    ops: list[P2POp] = []
                    posted: list[tuple[Chunk, torch.Tensor, bool, bool]] = []
                    for ch in recvs:
                        if ch.message.id in skip:  # landed before the executor ran
                            posted.append((ch, _SKIPPED, False, False))
                            continue
                        zc = self._zc_recv[id(ch)]
                        buf = (
                            zc
                            if zc is not None
                            else self.pool.acquire("recv", deadline, abort, describe(ch, "recv"))
                        )
                        ops.append(
                            P2POp(False, buf[: ch.nbytes], self._peer(ch.message.src_slot), ch.tag)
                        )
                        posted.append((ch, buf, zc is None, False))
                    for ch in sends:
                        if ch.message.id in skip:
                            continue
                        need = self._relay_wait.get(id(ch))
                        if need is not None:
                            wait_recvs(need, describe(ch, "send"))
                        zc = self._zc_send[id(ch)]
                        if zc is None and send_sums is not None:
                            self._source_sums(ch, send_sums)
                        if zc is None:
                            buf = self.pool.acquire("send", deadline, abort, describe(ch, "send"))
                            tp = time.monotonic()
                            self._pack(ch, buf, send_sums)
                            busy["pack_s"] += time.monotonic() - tp
                            if buf.is_cuda:
                                torch.cuda.current_stream(buf.device).synchronize()
                            if self._reads_source[id(ch)]:
                                source_done()
                        else:
                            buf = zc
                        ops.append(
                            P2POp(True, buf[: ch.nbytes], self._peer(ch.message.dst_slot), ch.tag)
                        )
                        posted.append((ch, buf, zc is None, True))
                    if abort.is_set():
                        return
                    try:
                        works = iter(self.transport.batch(ops) if ops else [])  # type: ignore[union-attr]
                    except Exception as e:
                        ch0 = posted[0][0]
                        raise ExecutionError(
                            f"{describe(ch0, 'send' if posted[0][3] else 'recv')}: {e}"
                        ) from e
                    for ch, buf, staged, is_send in posted:
                        if buf is _SKIPPED:  # counted in posting order by the receiver
                            recv_q.put(_Posted(ch, DoneWork(), buf, False))
                            continue
                        stat("send" if is_send else "recv", ch, not staged)
                        (send_q if is_send else recv_q).put(_Posted(ch, next(works), buf, staged))
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
                    key = ("send", item.chunk.message.id)
                    stats[key].seconds = time.monotonic() - started[key]
                    if item.staged:
                        self.pool.release("send", item.buf)
                    else:
                        if send_sums is not None:  # zero-copy: overlaps the next sends
                            self._source_sums(item.chunk, send_sums)
                        if self._reads_source[id(item.chunk)]:
                            source_done()
                    with lock:
                        report.sent_bytes += item.chunk.nbytes
            except BaseException as e:
                fail(e)
                while send_q.get() is not None:
                    pass

        def receiver() -> None:
            partial: dict[Copy, torch.Tensor] = {}
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
                            self._unpack(item.chunk, item.buf, partial, recv_sums)
                            busy["unpack_s"] += time.monotonic() - tu
                        except Exception as e:
                            raise ExecutionError(
                                f"{describe(item.chunk, 'recv')}: unpack failed: {e}"
                            ) from e
                        self.pool.release("recv", item.buf)
                    if recv_sums is not None:
                        self._landed(item.chunk, recv_sums)
                    key = ("recv", item.chunk.message.id)
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
                for call, nbytes in step.calls:
                    call()
                    report.local_bytes += nbytes
                if timed:
                    events[1].record()
                    phases["local_launch_s"] = phases.get("local_launch_s", 0.0) + (
                        time.monotonic() - t_launch
                    )
                if verify:
                    self._check_local(step.copies, fused, step.grouped_plain)
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
                "send": self._message_sums(
                    [m for m in self.program.sends if m.id not in skip], send_sums
                ),
                "recv": self._message_sums(
                    [m for m in self.program.recvs if m.id not in skip], recv_sums
                ),
            }
            phases["checksums_s"] = time.monotonic() - t1
            t1 = time.monotonic()
        report.seconds = t1 - t0
        report.staging_peak_bytes = self.pool.peak_bytes
        report.messages = sorted(stats.values(), key=lambda s: (s.direction, s.id))
        return report

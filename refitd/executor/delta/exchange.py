"""Delta messages of one slot: only the elements that changed since the base cross the wire.

A message the controller allows as a delta (every destination it writes holds exactly the
sender's base version) is exchanged here, before the executor runs the other messages: a
16-byte header per message (kind, payload bytes), then the payload in chunks of at most
wire_chunk bytes. Every operation is posted without blocking (all header receives first;
each message's header and payload as soon as it is encoded, so encoding message k overlaps
the wire time of k - 1; payload receives as their headers arrive; landing message k
overlaps the arrival of later ones), so no pair of slots can wait on each other. Tags are
the executor's (message id, chunk index): a message goes here or through the executor.

Payload of a DELTA message: u32 copies | u32 0 | u64 bytes per copy | per copy (8-aligned)
the segment delta of refitd.formats.delta.segments. A message whose measured density is above
the threshold, or whose delta is not smaller, goes as a DENSE payload instead: its segments
end to end as the executor lays them out.

Sender base (DeltaBase): per send copy of a delta-capable message, the wire segment of the
base version. A delta is encoded from the live sources (or their snapshot) against it; what
the sent version changed is kept (the delta, or the whole segment of a row sent dense) and
applied to the base only when the controller reports that version committed everywhere it
was sent (`promote`), so a failed refit never moves the base and the base costs one copy of
the segments, not two.

Device slots: the codec runs on host memory, so a message whose sources or destination
live on a CUDA device is staged through pinned host memory (refitd.executor.delta.host);
the base and its promotion are the same.

Verification: for a delta or dense message of this path the sender checksums each copy's
live wire streams, the receiver the destination streams after landing (the reconstructed
destination), so a delta applied onto a wrong base fails the checksum comparison.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from refitd.executor.checksums import Checksummer, combine
from refitd.executor.chunks import TAG_CHUNK_BITS
from refitd.executor.delta.host import HostSources, on_device_memory, through_host, wait
from refitd.executor.segments import ResolvedTensor, block, dest_region
from refitd.formats.delta import (
    ByteSink,
    DeltaStats,
    Scratch,
    apply_parts,
    encode_parts,
    load_kernels,
    region_streams,
    sampled_changes,
    segment_streams,
    worth_delta,
)
from refitd.plan.wire import aligned
from refitd.transport.base import P2POp, Transport, Work

UNKNOWN = -1
KIND_DENSE, KIND_DELTA = 0, 1
HEADER = 16
# a message of at least this many bytes is sampled (every SAMPLE_STRIDE-th row of each copy)
# before its full encode, and goes dense at once when the sample is clearly above the
# density threshold (by SAMPLE_MARGIN: a borderline sample still gets the exact check)
SAMPLE_MIN_BYTES = 8 << 20
SAMPLE_STRIDE = 64
SAMPLE_MARGIN = 1.25


class DeltaExchangeError(RuntimeError):
    """A delta message failed: which message, which peer, why."""


class CopyAccess(Protocol):
    """What the exchange needs of the executor's copy rows."""

    def wire(self, row: int) -> str: ...
    def shape(self, row: int) -> tuple[int, ...]: ...
    def src_dtype(self, row: int) -> str: ...
    def seg_nbytes(self, row: int) -> int: ...
    def src_block(self, row: int) -> torch.Tensor: ...
    def dst(self, row: int) -> tuple[ResolvedTensor, tuple[int, ...]]: ...
    def encode(self, row: int, out: torch.Tensor) -> None: ...
    def decode(self, row: int, seg: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DeltaMessage:
    mid: int
    peer: int  # transport rank of the other end
    rows: tuple[int, ...]  # copy rows in message order


@dataclass
class DeltaBase:
    """The sender's base wire segments per send copy row, and what the last sent version
    changed (module docstring): per row either the delta it sent or, for a row sent dense,
    its whole segment. `promote` makes the last sent version the base."""

    version: int = UNKNOWN
    pending_version: int = UNKNOWN
    base: dict[int, torch.Tensor] = field(default_factory=dict)
    pending_delta: dict[int, np.ndarray] = field(default_factory=dict)
    pending_full: dict[int, torch.Tensor] = field(default_factory=dict)
    # working memory reused across refits: the codec's scratch and a payload buffer per
    # message (a refit allocates nothing base-sized; pending deltas are views of the payloads)
    scratch: Scratch = field(default_factory=Scratch)
    sinks: dict[int, ByteSink] = field(default_factory=dict)

    def start(self, version: int) -> None:
        """A refit (or a retry) of `version` starts: what an earlier attempt left is dropped."""
        self.pending_version = version
        self.pending_delta.clear()
        self.pending_full.clear()

    def promote(self, version: int, access: CopyAccess) -> bool:
        """`version` committed everywhere it was sent: it becomes the base. False (and the
        base forgotten) when the pending changes are of another version."""
        if version == self.version:
            return True
        if version != self.pending_version:
            self.forget()
            return False
        for r in list(self.base):
            if r not in self.pending_delta and r not in self.pending_full:
                del self.base[r]  # not sent in `version`: its base is stale
        for r, d in self.pending_delta.items():
            streams = segment_streams(access.wire(r), access.shape(r), access.src_dtype(r),
                                      self.base[r])  # fmt: skip
            apply_parts(d, streams, name=f"base of copy row {r}", threads=torch.get_num_threads())
        for r, full in self.pending_full.items():
            self.base[r] = full  # a view of a dense payload, which is never reused
        self.version = version
        self.start(UNKNOWN)
        return True

    def forget(self) -> None:
        self.version = UNKNOWN
        self.base.clear()
        self.sinks.clear()
        self.start(UNKNOWN)

    @property
    def work_nbytes(self) -> int:
        """Bytes of working memory held for the next refit (scratch and payload buffers)."""
        return self.scratch.nbytes + sum(k.capacity for k in self.sinks.values())

    @property
    def nbytes(self) -> int:
        """Bytes held: base segments plus what is pending."""
        return (
            sum(t.numel() for t in self.base.values())
            + sum(d.size for d in self.pending_delta.values())
            + sum(t.numel() for t in self.pending_full.values())
        )


@dataclass
class DeltaReport:
    """Per message sent or received here: kind and stats; checksums with verify."""

    sent: dict[int, dict] = field(default_factory=dict)
    received: dict[int, dict] = field(default_factory=dict)
    encode_s: float = 0.0
    apply_s: float = 0.0
    seconds: float = 0.0
    wire_bytes: int = 0
    send_sums: dict[int, int] = field(default_factory=dict)
    recv_sums: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}


def _tag(mid: int, index: int) -> int:
    return ((mid << TAG_CHUNK_BITS) | index) & 0x7FFFFFFF


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _stream_sum(summer: Checksummer, streams: Sequence[torch.Tensor]) -> int:
    return combine(summer(s.contiguous().view(torch.uint8)) for s in streams)


def _live_segment(access: CopyAccess, row: int) -> torch.Tensor:
    seg = torch.zeros(access.seg_nbytes(row), dtype=torch.uint8)
    access.encode(row, seg)
    return seg


def _dense_payload(m: DeltaMessage, access: CopyAccess, base: DeltaBase) -> torch.Tensor:
    """The message's live segments end to end, as the executor lays them out; each row's
    segment is kept (a view) as its pending change."""
    payload = torch.empty(sum(aligned(access.seg_nbytes(r)) for r in m.rows), dtype=torch.uint8)
    pos = 0
    for r in m.rows:
        n = access.seg_nbytes(r)
        if access.wire(r) != "raw":  # a quantized segment may leave padding between parts
            payload[pos : pos + n].zero_()
        access.encode(r, payload[pos : pos + n])
        payload[pos + n : pos + aligned(n)] = 0  # a raw segment is written whole
        base.pending_full[r] = payload[pos : pos + n]
        pos += aligned(n)
    return payload


def _live_streams(access: CopyAccess, row: int) -> list[torch.Tensor]:
    """The live wire streams of a row: the source block itself on the raw wire."""
    if access.wire(row) == "raw":
        return [access.src_block(row)]
    return segment_streams(access.wire(row), access.shape(row), access.src_dtype(row),
                           _live_segment(access, row))  # fmt: skip


def _sampled(m: DeltaMessage, access: CopyAccess, base: DeltaBase) -> float | None:
    """The density of a raw-wire message estimated on every SAMPLE_STRIDE-th row of each
    copy against its base (None for other wires: their live segment is a conversion, too
    costly to make twice)."""
    if any(access.wire(r) != "raw" for r in m.rows):
        return None
    elements = changed = 0
    for r in m.rows:
        live = access.src_block(r)
        (old,) = segment_streams("raw", access.shape(r), access.src_dtype(r), base.base[r])
        e, c = sampled_changes([old.view(live.shape)], [live], SAMPLE_STRIDE)
        elements, changed = elements + e, changed + c
    return changed / elements if elements else None


def _encode_message(
    m: DeltaMessage, access: CopyAccess, base: DeltaBase, max_density: float, allowed: bool
) -> tuple[int, torch.Tensor, DeltaStats, list[list[torch.Tensor]]]:
    """(kind, payload, stats, live streams per row) of one message: a delta if allowed, the
    base is held for every row and it is worth it; else dense."""
    stats = DeltaStats(0, 0, 0, 0, (0, 0, 0, 0))
    if not allowed or any(r not in base.base for r in m.rows):
        payload = _dense_payload(m, access, base)
        return KIND_DENSE, payload, DeltaStats(0, 0, payload.numel(), payload.numel(),
                                               stats.blocks), []  # fmt: skip
    dense = sum(aligned(access.seg_nbytes(r)) for r in m.rows)
    estimate = _sampled(m, access, base) if dense >= SAMPLE_MIN_BYTES else None
    if estimate is not None and estimate > SAMPLE_MARGIN * max_density:
        payload = _dense_payload(m, access, base)
        full = sum(int(np.prod(access.shape(r))) for r in m.rows)
        n = payload.numel()
        return KIND_DENSE, payload, DeltaStats(full, round(full * estimate), n, n,
                                               stats.blocks), []  # fmt: skip
    sink = base.sinks.setdefault(m.mid, ByteSink())
    sink.reset()
    head = 8 + 8 * len(m.rows)
    sink.reserve(head)
    sizes, at, lives = [], [], []
    for r in m.rows:
        live = _live_streams(access, r)
        old = segment_streams(access.wire(r), access.shape(r), access.src_dtype(r), base.base[r])
        at.append(sink.size)
        d, st = encode_parts(old, live, sink=sink, scratch=base.scratch,
                             threads=torch.get_num_threads())  # fmt: skip
        sizes.append(d.size)
        sink.view(sink.reserve(_pad8(d.size) - d.size), sink.size)[:] = 0
        lives.append(live)
        stats = stats + st
    stats = DeltaStats(stats.elements, stats.changed, sink.size, dense, stats.blocks)
    if not worth_delta(stats, max_density):
        return KIND_DENSE, _dense_payload(m, access, base), stats, []
    out = sink.data()
    out[0:8].view("<u4")[:] = (len(m.rows), 0)
    out[8:head].view("<u8")[:] = sizes
    for r, a, n in zip(m.rows, at, sizes, strict=True):
        base.pending_delta[r] = out[a : a + n]
    return KIND_DELTA, torch.from_numpy(out), stats, lives


def _sources(m: DeltaMessage, access: CopyAccess, what: str) -> CopyAccess:
    """The message's sources as the codec reads them: in place in host memory, else staged
    through it (refitd.executor.delta.host)."""
    device = access.src_block(m.rows[0]).device if m.rows else torch.device("cpu")
    return HostSources(access, m.rows, device, what) if on_device_memory(device) else access


def _land(m: DeltaMessage, kind: int, payload: torch.Tensor, access: CopyAccess) -> DeltaStats:
    """Land a received payload into the message's destination regions (a device
    destination through host memory: refitd.executor.delta.host)."""
    rows = m.rows
    stats = DeltaStats(0, 0, payload.numel(), 0, (0, 0, 0, 0))
    if kind == KIND_DENSE:
        device = access.dst(rows[0])[0].data.device if rows else torch.device("cpu")
        payload = payload.to(device)  # on the destination's device, as the executor lands it
        pos = 0
        for r in rows:
            n = access.seg_nbytes(r)
            access.decode(r, payload[pos : pos + n])
            pos += aligned(n)
        wait(device)
        return stats
    buf = payload.numpy()
    count = int(buf[0:4].view("<u4")[0])
    if count != len(rows):
        raise DeltaExchangeError(f"message {m.mid}: delta of {count} copies for {len(rows)}")
    sizes = buf[8 : 8 + 8 * count].view("<u8").tolist()
    pos = 8 + 8 * count
    for r, size in zip(rows, sizes, strict=True):
        t, off = access.dst(r)
        name = t.name
        apply = functools.partial(
            apply_parts, buf[pos : pos + size], name=name, threads=torch.get_num_threads()
        )
        streams = region_streams(dest_region(t, off, access.shape(r)))
        if on_device_memory(streams[0].device):
            stats = stats + through_host(streams, apply, f"delta for {name}")
        else:
            stats = stats + apply(streams)
        pos += _pad8(size)
    return stats


def _wait_all(works: Sequence[tuple[Work, str]], deadline: float) -> None:
    for w, what in works:
        try:
            w.wait(max(deadline - time.monotonic(), 0.0))
        except Exception as e:
            raise DeltaExchangeError(f"{what}: {e}") from e


def exchange_deltas(
    transport: Transport,
    sends: Sequence[DeltaMessage],
    recvs: Sequence[DeltaMessage],
    access: CopyAccess,
    base: DeltaBase,
    version: int,
    *,
    allowed: frozenset[int],
    max_density: float,
    deadline: float,
    wire_chunk: int = 32 << 20,
    verify: bool = False,
    describe: Callable[[DeltaMessage, str], str] | None = None,
) -> DeltaReport:
    """Exchange this slot's messages of this path (module docstring): those in `allowed` as
    deltas where worth it, the others dense. The live
    segments of every send message's rows are read here (live sources or their snapshot),
    and what `version` changed is kept in `base` until it is promoted."""
    t0 = time.monotonic()
    rep = DeltaReport()
    what = describe or (lambda m, d: f"{d} of delta message {m.mid} with rank {m.peer}")
    summer = Checksummer()
    if base.version == UNKNOWN:  # a first refit (all dense): the codec's kernels loaded now,
        load_kernels()  # not in the first delta refit, which the controller times against it
    base.start(version)
    got = {m.mid: torch.zeros(HEADER, dtype=torch.uint8) for m in recvs}
    header_works = transport.batch(
        [P2POp(False, got[m.mid], m.peer, _tag(m.mid, 0)) for m in recvs]
    )
    keep: list[torch.Tensor] = []  # buffers of posted sends, alive until they complete
    sent: list[tuple[Work, str]] = []
    for m in sends:  # encode message k while message k - 1 is on the wire
        te = time.monotonic()
        src = _sources(m, access, what(m, "send"))
        kind, payload, st, lives = _encode_message(m, src, base, max_density, m.mid in allowed)
        rep.sent[m.mid] = {"kind": kind, "changed": st.changed, "elements": st.elements,
                           "nbytes": payload.numel(), "dense_nbytes": st.dense_nbytes}  # fmt: skip
        if verify:
            if not lives:
                lives = [segment_streams(access.wire(r), access.shape(r), access.src_dtype(r),
                                         base.pending_full[r]) for r in m.rows]  # fmt: skip
            rep.send_sums[m.mid] = combine(_stream_sum(summer, live) for live in lives)
        rep.encode_s += time.monotonic() - te
        header = torch.tensor([kind, payload.numel()], dtype=torch.int64).view(torch.uint8)
        ops = [P2POp(True, header, m.peer, _tag(m.mid, 0))]
        for i, a in enumerate(range(0, payload.numel(), wire_chunk), 1):
            ops.append(P2POp(True, payload[a : a + wire_chunk], m.peer, _tag(m.mid, i)))
        keep += [header, payload]
        sent += [(w, what(m, "send")) for w in transport.batch(ops)]
        rep.wire_bytes += HEADER + payload.numel()
    posted: list[tuple[DeltaMessage, int, torch.Tensor, list[Work]]] = []
    for m, w in zip(recvs, header_works, strict=True):
        _wait_all([(w, what(m, "recv"))], deadline)
        kind, n = torch.frombuffer(bytearray(got[m.mid].numpy().tobytes()), dtype=torch.int64)
        buf = torch.empty(int(n), dtype=torch.uint8)
        ops = [P2POp(False, buf[a : a + wire_chunk], m.peer, _tag(m.mid, i))
               for i, a in enumerate(range(0, int(n), wire_chunk), 1)]  # fmt: skip
        posted.append((m, int(kind), buf, transport.batch(ops) if ops else []))
    for m, kind, buf, works in posted:  # land message k while later ones arrive
        _wait_all([(w, what(m, "recv")) for w in works], deadline)
        ta = time.monotonic()
        try:
            st = _land(m, kind, buf, access)
        except Exception as e:
            raise DeltaExchangeError(f"{what(m, 'recv')}: landing failed: {e}") from e
        rep.received[m.mid] = {"kind": kind, "changed": st.changed,
                               "elements": st.elements, "nbytes": buf.numel()}  # fmt: skip
        if verify:
            rep.recv_sums[m.mid] = combine(_stream_sum(summer, _dst_streams(access, r))
                                           for r in m.rows)  # fmt: skip
        rep.apply_s += time.monotonic() - ta
    _wait_all(sent, deadline)
    del keep
    rep.seconds = time.monotonic() - t0
    return rep


def _dst_streams(access: CopyAccess, row: int) -> list[torch.Tensor]:
    t, off = access.dst(row)
    if t.storage == "plain":
        return [block(t.data, off, access.shape(row))]
    return region_streams(dest_region(t, off, access.shape(row)))

"""Chunks of a slot program's messages, computed from its columns (both ends agree).

A message's copies' segments, laid end to end (wire.segment_nbytes each), are cut into
chunks; each chunk is one send matched by one receive. Rules, from the program alone:
- a raw segment whose blocks are contiguous in both tensors (by their registered local
  shapes), that lands in a plain destination of its dtype, and whose payload is at least
  `direct_min` bytes gets chunks of its own, cut at wire_chunk: it can go straight from the
  source tensor into the destination tensor (zero-copy);
- any segment larger than its chunk size (wire_chunk when it lands direct, else
  staged_chunk) gets chunks of its own;
- other consecutive segments share a chunk of at most staged_chunk bytes.
A message on the rdma path is cut at RDMA_CHUNK at most (both sizes): its destination
learns of each chunk as it lands, and a slot forwarding it passes each piece on then.
A raw segment bound for NVFP4 storage (FLAG_AMAX_WORD) that a chunk carries whole travels
with its amax side word: after the chunk's segments, SEGMENT_ALIGN-aligned, one int32 per
such segment in row order (`Chunk.amax_at`, `Chunk.amax_rows`). The sender folds it from
the values it packs, so the receiver quantizes the segment in one read; a segment cut
into pieces has none (the receiver folds its pieces as they arrive).
Per-copy attributes are computed for all copies at once (`CopyInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from refitd.executor.errors import ExecutionError
from refitd.plan.links import PATHS, RDMA
from refitd.plan.program import (
    DTYPES,
    FLAG_AMAX_WORD,
    FLAG_LANDS_DIRECT,
    FLAG_SRC_CONTIGUOUS,
    MessageColumns,
    SlotProgram,
)
from refitd.plan.rowwise import row_prod
from refitd.plan.wire import BUILTIN_WIRES, DTYPE_SIZES, RAW_CODE, SEGMENT_ALIGN, aligned

WIRE_CHUNK = 32 << 20
# the largest chunk of a message on the rdma path: its destination learns of each chunk
# once it landed, and a pool forwarding it (relay) passes it on only then
RDMA_CHUNK = 2 << 20
# a sender's write of consecutive pieces of one segment to a destination on its own host
# (nothing queues on a link there): fewer, larger requests and doorbell rings
RDMA_JOINED = 8 << 20
DIRECT_MIN = 1 << 20
TAG_CHUNK_BITS = 12
_ESIZE = np.array([DTYPE_SIZES[d] for d in DTYPES], np.int64)


@dataclass(slots=True)
class CopyInfo:
    """Per copy row: source dtype name code, wire bytes, payload bytes, flags."""

    src_dtype: np.ndarray
    seg_bytes: np.ndarray
    payload: np.ndarray
    lands_direct: np.ndarray
    own_chunk: np.ndarray
    relay: np.ndarray
    amax_word: np.ndarray  # a whole segment travels with its amax side word

    @classmethod
    def of(cls, p: SlotProgram, direct_min: int) -> CopyInfo:
        c = p.copies
        if not len(c):
            z = np.zeros(0, np.int64)
            return cls(z, z, z, *(z.astype(bool) for _ in range(4)))
        sdt = c.src_dtype.astype(np.int64)
        esize = _ESIZE[sdt]
        wire = c.wire.astype(np.int64)
        seg = BUILTIN_WIRES.segment_nbytes(wire, c.shape, c.ndim.astype(np.int64), esize)
        payload = np.where(wire == RAW_CODE, row_prod(c.shape) * esize, seg)
        lands = (c.flags & FLAG_LANDS_DIRECT) != 0
        both = FLAG_LANDS_DIRECT | FLAG_SRC_CONTIGUOUS
        own = ((c.flags & both) == both) & (payload >= direct_min)
        # relays read a destination tensor of this slot (one it receives or copies into)
        recv_lo = int(p.recv.start[0]) if len(p.recv) else p.local_start
        relay = np.isin(c.src, np.unique(c.dst[recv_lo:]))
        amax = (c.flags & FLAG_AMAX_WORD) != 0
        return cls(sdt, seg, payload, lands, own, relay, amax)


@dataclass(slots=True)
class Chunk:
    """Bytes of one message sent as one transport op. rows: the copy rows whose segment
    pieces it carries, at chunk offsets `offs`; a chunk that is one piece of a larger
    segment has split=True and seg_start where the piece starts in the segment."""

    mid: int
    round: int
    src_slot: int
    dst_slot: int
    index: int
    nbytes: int
    rows: list[int]
    offs: list[int]
    split: bool = False
    seg_start: int = 0
    msg_nbytes: int = 0
    amax_at: int = 0  # where the amax side words start (after the segments), 0: none
    amax_rows: tuple[int, ...] = ()  # the rows whose amax word it carries, in order
    msg_at: int = 0  # where its first row's segment starts in the message
    cache: dict = field(default_factory=dict)  # views per staging buffer (executor)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.round, self.index, self.mid)

    @property
    def tag(self) -> int:
        return ((self.mid << TAG_CHUNK_BITS) | self.index) & 0x7FFFFFFF


def chunk_messages(
    msgs: MessageColumns,
    info: CopyInfo,
    wire_chunk: int = WIRE_CHUNK,
    staged_chunk: int | None = None,
) -> list[Chunk]:
    """Every message's chunks, messages in order (see the module docstring)."""
    staged_chunk = staged_chunk or wire_chunk
    if wire_chunk % 16 or staged_chunk % 16:
        raise ValueError("wire_chunk and staged_chunk must be multiples of 16")
    cut = _Cutter(info, wire_chunk, staged_chunk)
    small = _Cutter(info, min(wire_chunk, RDMA_CHUNK), min(staged_chunk, RDMA_CHUNK))
    rdma = (msgs.path == PATHS.index(RDMA)).tolist()
    out: list[Chunk] = []
    for k in range(len(msgs)):
        out += (small if rdma[k] else cut).message(
            Chunk(
                int(msgs.id[k]),
                int(msgs.round[k]),
                int(msgs.src_slot[k]),
                int(msgs.dst_slot[k]),
                0,
                0,
                [],
                [],
                msg_nbytes=int(msgs.nbytes[k]),
            ),
            int(msgs.start[k]),
            int(msgs.end[k]),
        )
    return out


def join_pieces(
    chunks: list[Chunk], mids: frozenset[int], payload: np.ndarray, limit: int = RDMA_JOINED
) -> list[Chunk]:
    """Send chunks with the consecutive pieces of one segment of the messages `mids`
    joined, up to `limit` bytes each (`payload`: each copy row's bytes). A joined chunk
    carries the index of its last piece: the destination, which cut the message as usual,
    sees its pieces' count on the doorbell at once (pieces of a message land in order)."""
    if not mids:
        return chunks
    out: list[Chunk] = []
    for ch in chunks:
        prev = out[-1] if out else None
        if (
            prev is None
            or ch.mid not in mids
            or not (ch.split and prev.split and prev.mid == ch.mid and prev.rows == ch.rows)
            or prev.seg_start + prev.nbytes != ch.seg_start
            or prev.nbytes + ch.nbytes > limit
        ):
            out.append(ch)
            continue
        n = prev.nbytes + ch.nbytes
        split = prev.seg_start > 0 or n != int(payload[ch.rows[0]])
        fields = (ch.mid, ch.round, ch.src_slot, ch.dst_slot, ch.index, n, ch.rows, ch.offs)
        out[-1] = Chunk(*fields, split, prev.seg_start, ch.msg_nbytes, msg_at=prev.msg_at)
    return out


class _Cutter:
    """Cuts one message at a time (copy attributes as Python lists, read once)."""

    def __init__(self, info: CopyInfo, wire_chunk: int, staged_chunk: int) -> None:
        self.seg = info.seg_bytes.tolist()
        self.pay = info.payload.tolist()
        self.lands = info.lands_direct.tolist()
        self.own = info.own_chunk.tolist()
        self.amax = info.amax_word.tolist()
        self.wire_chunk, self.staged_chunk = wire_chunk, staged_chunk

    def message(self, m: Chunk, lo: int, hi: int) -> list[Chunk]:
        """Chunks of the message whose copies are rows [lo, hi); `m` carries its fields."""
        chunks: list[Chunk] = []
        rows: list[int] = []
        offs: list[int] = []

        def new(n: int, r: list[int], o: list[int], start: int, split: bool = False,
                at: int = 0) -> None:  # fmt: skip
            words = () if split or not k else tuple(i for i in r if self.amax[i])
            amax_at = aligned(n) if words else 0
            nbytes = amax_at + aligned(4 * len(words)) if words else n
            fields = (m.mid, m.round, m.src_slot, m.dst_slot, len(chunks), nbytes, r, o)
            chunks.append(Chunk(*fields, split, at, m.msg_nbytes, amax_at, words, start))

        group_start = off = k = 0  # k: amax words of the group so far
        for i in range(lo, hi):
            total = self.seg[i]
            word = int(self.amax[i])
            size = self.wire_chunk if self.lands[i] else self.staged_chunk
            if total + SEGMENT_ALIGN * word > size or self.own[i]:
                if rows:
                    new(offs[-1] + self.pay[rows[-1]], rows, offs, group_start)
                    rows, offs = [], []
                p, k = self.pay[i], 0  # no side word: the receiver folds any pieces
                for s in range(0, p, size):
                    n = min(size, p - s)
                    new(n, [i], [0], off, n != p, s)
            else:
                side = aligned(4 * (k + word))
                if rows and off + total - group_start + side > self.staged_chunk:
                    new(offs[-1] + self.pay[rows[-1]], rows, offs, group_start)
                    rows, offs, k = [], [], 0
                if not rows:
                    group_start = off
                rows.append(i)
                offs.append(off - group_start)
                k += word
            off += total
        if rows:
            new(offs[-1] + self.pay[rows[-1]], rows, offs, group_start)
        if off != m.msg_nbytes:
            raise ExecutionError(
                f"message {m.mid} ({m.src_slot}->{m.dst_slot}): copies need {off} bytes on "
                f"the wire but the plan says {m.msg_nbytes}"
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


def flat_range_pairs(
    a: torch.Tensor, b: torch.Tensor, e0: int, e1: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """flat_range_views of two tensors of one shape cut at the same places (views of one
    piece have one shape on both sides): a copy between regions of different strides."""
    if e0 >= e1:
        return [], []
    if a.dim() <= 1 or (a.is_contiguous() and b.is_contiguous()):
        return [a.reshape(-1)[e0:e1]], [b.reshape(-1)[e0:e1]]
    inner = a.numel() // a.shape[0]
    i0, r0 = divmod(e0, inner)
    i1, r1 = divmod(e1, inner)
    if i0 == i1:
        return flat_range_pairs(a[i0], b[i0], r0, r1)
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    if r0:
        x, y = flat_range_pairs(a[i0], b[i0], r0, inner)
        xs, ys = xs + x, ys + y
        i0 += 1
    if i1 > i0:
        xs.append(a[i0:i1])
        ys.append(b[i0:i1])
    if r1:
        x, y = flat_range_pairs(a[i1], b[i1], 0, r1)
        xs, ys = xs + x, ys + y
    return xs, ys


def messages_without(m: MessageColumns, skip: frozenset[int]) -> MessageColumns:
    """The messages not in `skip` (they went through the delta path)."""
    if not skip:
        return m
    keep = ~np.isin(m.id, np.fromiter(skip, dtype=np.int64, count=len(skip)))
    return MessageColumns(*(getattr(m, f.name)[keep] for f in fields(m)))


def run_view(views: list[torch.Tensor], nbytes: int) -> torch.Tensor | None:
    """One uint8 view over `views` when they are contiguous, in one storage, back to back
    and `nbytes` long in all; else None."""
    if not views or any(not v.is_contiguous() for v in views):
        return None
    storage = views[0].untyped_storage()
    pos = views[0].data_ptr()
    for v in views:
        if v.untyped_storage().data_ptr() != storage.data_ptr() or v.data_ptr() != pos:
            return None
        pos += v.numel() * v.element_size()
    if pos - views[0].data_ptr() != nbytes:
        return None
    if len(views) == 1:
        return views[0].reshape(-1).view(torch.uint8)
    out = torch.empty(0, dtype=torch.uint8, device=views[0].device)
    return out.set_(storage, views[0].data_ptr() - storage.data_ptr(), (nbytes,))


def amax_words(ch: Chunk, buf: torch.Tensor) -> dict[int, torch.Tensor]:
    """Copy row -> its amax side word (an int32 view of one element of buf) of every
    segment whose word chunk ch carries in buf."""
    if not ch.amax_rows:
        return {}
    key = ("amax", buf.data_ptr())
    out = ch.cache.get(key)
    if out is None:
        at = ch.amax_at
        out = ch.cache[key] = {
            i: buf[at + 4 * k : at + 4 * k + 4].view(torch.int32)
            for k, i in enumerate(ch.amax_rows)
        }
    return out

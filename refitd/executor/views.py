"""The bytes side of a slot program: views of its regions, pack, unpack, local copies.

Everything here is prepared once per (program, mapped tensors) from the program's columns:
block views of every copy's regions, the views into each staging buffer a chunk uses, the
zero-copy views of chunks whose bytes are one contiguous run in memory (one large copy, or
several copies of adjacent regions, e.g. tensors of one arena). A refit then packs a chunk
with one `torch._foreach_copy_` over ready view lists, and unpacks it the same way; only
quantized segments (sender- or receiver-side conversion) go one copy at a time through
refitd.formats.

Verification keys checksums by (message id, copy row) (see executor.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from refitd.executor.checksums import Checksummer, combine
from refitd.executor.chunks import (
    Chunk,
    CopyInfo,
    amax_words,
    flat_range_pairs,
    flat_range_views,
    run_view,
)
from refitd.executor.errors import ExecutionError
from refitd.executor.segments import (
    ResolvedTensor,
    block,
    decode_hashed,
    decode_known_amax,
    decode_segment,
    dest_region,
    encode_raw_amax,
    encode_segment,
    fold_amax,
    nvfp4_amax,
    whole_amax,
)
from refitd.plan.program import DTYPES, FLAG_DST_PLAIN, WIRES, MessageColumns, SlotProgram
from refitd.plan.wire import PLAIN
from refitd.torch_dtypes import torch_dtype

if TYPE_CHECKING:
    from refitd.formats.grouped import GroupedLanding

_Sums = dict[tuple[int, int], torch.Tensor]  # (message id, copy row) -> 0-d int64 checksum
# copy row -> (its segment so far, its NVFP4 amax so far): segments arriving in pieces
PartialSegments = dict[int, tuple[torch.Tensor, torch.Tensor | None]]
_RAW = 0


@dataclass
class LocalStep:
    """Local copies prepared for a refit: a grouped launch (refitd.formats.grouped, CUDA)
    and, for the copies it did not take, one `_foreach_copy_` over plain destinations plus
    one call per quantized destination. `rows`: the copies outside the grouped launch (for
    verification); `grouped_plain`: the plain copies inside it, in the order of its
    checksums; `nbytes`: the bytes of the copies outside it."""

    grouped: GroupedLanding | None = None
    dst: list[torch.Tensor] = field(default_factory=list)
    src: list[torch.Tensor] = field(default_factory=list)
    slow: list[tuple[Callable[..., Any], torch.Tensor, Any]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    grouped_plain: list[int] = field(default_factory=list)
    nbytes: int = 0

    @property
    def empty(self) -> bool:
        return self.grouped is None and not self.dst and not self.slow


@dataclass(slots=True)
class _Views:
    """A staged chunk's ready work for one staging buffer."""

    dst: list[torch.Tensor]  # foreach_copy_ destinations
    src: list[torch.Tensor]
    slow: list[tuple[int, int]]  # (copy row, chunk offset): quantized, one at a time


class SlotViews:
    """Regions of one slot program over resolved tensors (see the module docstring)."""

    def __init__(
        self, program: SlotProgram, info: CopyInfo, tensors: dict[int, ResolvedTensor]
    ) -> None:
        self.p = program
        self.info = info
        self.tensors = tensors
        self.summer = Checksummer()
        c = program.copies
        self._src_t = c.src.tolist()
        self._dst_t = c.dst.tolist()
        self._nd = c.ndim.tolist()
        self._src_off = c.src_off.tolist()
        self._dst_off = c.dst_off.tolist()
        self._shape = c.shape.tolist()
        self._wire = c.wire.tolist()
        self._dtype = [torch_dtype(DTYPES[d]) for d in info.src_dtype.tolist()]
        self._pay = info.payload.tolist()
        self._seg = info.seg_bytes.tolist()
        self._src_views: dict[int, torch.Tensor] = {}
        self._dst_views: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ regions
    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self._shape[i][: self._nd[i]])

    def src_block(self, i: int) -> torch.Tensor:
        v = self._src_views.get(i)
        if v is None:
            nd = self._nd[i]
            t = self.tensors[self._src_t[i]].data
            v = self._src_views[i] = block(t, tuple(self._src_off[i][:nd]), self.shape(i))
        return v

    def dst_block(self, i: int) -> torch.Tensor:
        v = self._dst_views.get(i)
        if v is None:
            nd = self._nd[i]
            t = self.tensors[self._dst_t[i]].data
            v = self._dst_views[i] = block(t, tuple(self._dst_off[i][:nd]), self.shape(i))
        return v

    def plain_raw_dst(self, i: int) -> bool:
        return self._wire[i] == _RAW and self.tensors[self._dst_t[i]].storage == PLAIN

    def _piece(self, region: torch.Tensor, ch: Chunk, i: int) -> list[torch.Tensor]:
        """Views of the part of a copy's region that chunk `ch` carries."""
        if not ch.split:
            return [region]
        size = self._dtype[i].itemsize  # segment bytes are in the source dtype
        return flat_range_views(region, ch.seg_start // size, (ch.seg_start + ch.nbytes) // size)

    # ------------------------------------------------------------------ zero-copy
    def zero_copy_send(self, ch: Chunk) -> torch.Tensor | None:
        if ch.amax_rows or any(self._wire[i] != _RAW for i in ch.rows):
            return None
        views = [v for i in ch.rows for v in self._piece(self.src_block(i), ch, i)]
        if not ch.split and any(self._pay[i] != self._seg[i] for i in ch.rows[:-1]):
            return None  # alignment padding between segments
        return run_view(views, ch.nbytes)

    def zero_copy_recv(self, ch: Chunk) -> torch.Tensor | None:
        for i in ch.rows:
            d = self.tensors[self._dst_t[i]]
            if not self.plain_raw_dst(i) or d.data.dtype != self._dtype[i]:
                return None
        if not ch.split and any(self._pay[i] != self._seg[i] for i in ch.rows[:-1]):
            return None
        views = [v for i in ch.rows for v in self._piece(self.dst_block(i), ch, i)]
        return run_view(views, ch.nbytes)

    # ------------------------------------------------------------------ pack / unpack
    def _stage_views(self, buf: torch.Tensor, ch: Chunk, i: int, off: int, region: torch.Tensor):
        """Views of the staging buffer matching _piece(region) (raw wire)."""
        out = []
        pos = off
        for v in self._piece(region, ch, i):
            n = v.numel() * self._dtype[i].itemsize
            out.append(buf[pos : pos + n].view(self._dtype[i]).view(v.shape))
            pos += n
        return out

    def _views(self, ch: Chunk, buf: torch.Tensor, send: bool) -> _Views:
        key = (send, buf.data_ptr())
        w = ch.cache.get(key)
        if w is not None:
            return w
        w = _Views([], [], [])
        for i, off in zip(ch.rows, ch.offs, strict=True):
            if send and self._wire[i] == _RAW and i not in ch.amax_rows:
                region = self.src_block(i)
                w.dst += self._stage_views(buf, ch, i, off, region)
                w.src += self._piece(region, ch, i)
            elif not send and self.plain_raw_dst(i):
                region = self.dst_block(i)
                w.src += self._stage_views(buf, ch, i, off, region)
                w.dst += self._piece(region, ch, i)
            else:
                w.slow.append((i, off))
        ch.cache[key] = w
        return w

    def pack(self, ch: Chunk, buf: torch.Tensor, sums: _Sums | None) -> None:
        """Pack a staged chunk; with `sums`, checksum encoded segments (raw: source_sums)."""
        w = self._views(ch, buf, True)
        if w.dst:
            torch._foreach_copy_(w.dst, w.src)
        words = amax_words(ch, buf)
        for i, off in w.slow:
            src = self.src_block(i)
            if i in words:  # raw, with its amax word: both from one read of the source
                encode_raw_amax(src, buf[off : off + self._pay[i]], words[i])
                continue
            wire = WIRES[self._wire[i]]
            if not ch.split:
                seg = buf[off : off + self._seg[i]]
                encode_segment(wire, src, seg)
                if sums is not None:
                    sums[(ch.mid, i)] = self.summer.tensor(seg)
            else:  # a quantized segment larger than a chunk is encoded whole, then sliced;
                # zeroed, so every chunk's encoding carries the same alignment padding
                scratch = torch.zeros(self._seg[i], dtype=torch.uint8, device=buf.device)
                encode_segment(wire, src, scratch)
                buf[: ch.nbytes].copy_(scratch[ch.seg_start : ch.seg_start + ch.nbytes])
                if sums is not None and ch.seg_start == 0:
                    sums[(ch.mid, i)] = self.summer.tensor(scratch)

    def unpack(
        self, ch: Chunk, buf: torch.Tensor, partial: PartialSegments, sums: _Sums | None
    ) -> None:
        """Unpack a staged chunk; with `sums`, checksum the segments it decodes (landed)."""
        w = self._views(ch, buf, False)
        if w.dst:
            torch._foreach_copy_(w.dst, w.src)
        words = amax_words(ch, buf)
        for i, off in w.slow:
            amax = words.get(i)
            if ch.split:
                whole = self._assemble(ch, i, buf[off : off + ch.nbytes], partial)
                if whole is None:
                    continue
                seg, amax = whole
            else:
                seg = buf[off : off + self._seg[i]]
            dst, at = self.tensors[self._dst_t[i]], tuple(self._dst_off[i][: self._nd[i]])
            args = (WIRES[self._wire[i]], seg, self.shape(i), self._dtype[i], dst, at)
            if sums is not None:  # the quantizer's own read of the segment, where it can
                fused = decode_hashed(*args)
                if fused is not None:
                    sums[(ch.mid, i)] = fused
                    continue
                n = self._pay[i] if self._wire[i] == _RAW else None  # without the padding
                sums[(ch.mid, i)] = self.summer.tensor(seg[:n])
            if amax is not None and (sums is None or i not in words):  # a verified refit
                decode_known_amax(seg, *args[2:], amax)  # folds its own: words are unsummed
            else:
                decode_segment(*args)

    def _assemble(
        self, ch: Chunk, i: int, piece: torch.Tensor, partial: PartialSegments
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Add a chunk's piece to segment i; once whole, (segment, its NVFP4 amax folded
        piece by piece as they arrived, or None), else None."""
        acc, amax = partial.get(i, (None, None))
        if acc is None:
            acc = torch.empty(self._seg[i], dtype=torch.uint8, device=piece.device)
            amax = nvfp4_amax(self.tensors[self._dst_t[i]], WIRES[self._wire[i]], acc.device)
        lo, hi = ch.seg_start, ch.seg_start + ch.nbytes
        acc[lo:hi].copy_(piece)
        if amax is not None:
            size = self._dtype[i].itemsize  # a piece cutting a pair leaves it to the quantizer
            n = max(0, min(hi, self._pay[i]) - lo)
            if lo % (2 * size) or n % (2 * size):
                amax = None
            elif n:
                fold_amax(acc[lo : lo + n].view(self._dtype[i]), amax)
        partial[i] = (acc, amax)
        if hi < self._pay[i]:
            return None
        del partial[i]
        return acc, amax

    # ------------------------------------------------------------------ one-sided
    def direct_views(self, ch: Chunk) -> _Views:
        """A one-sided send chunk's work: each plain raw copy's destination pieces with
        its source pieces (copied straight, strided regions in place, casts included), and
        in `slow` the other copies (encoded and landed whole, by `land_coded`)."""
        w = ch.cache.get("direct")
        if w is None:
            w = ch.cache["direct"] = _Views([], [], [])
            for i, off in zip(ch.rows, ch.offs, strict=True):
                if not self.plain_raw_dst(i):
                    w.slow.append((i, off))
                elif ch.split:
                    e0 = ch.seg_start // self._dtype[i].itemsize
                    e1 = e0 + ch.nbytes // self._dtype[i].itemsize
                    dst, src = flat_range_pairs(self.dst_block(i), self.src_block(i), e0, e1)
                    w.dst += dst
                    w.src += src
                else:
                    w.dst.append(self.dst_block(i))
                    w.src.append(self.src_block(i))
        return w

    def land_coded(self, i: int) -> None:
        """Copy row i through its wire format into its destination as a receiver would, bit
        for bit (raw into NVFP4 storage: copied with its amax, then quantized in one read)."""
        wire, src, dst = WIRES[self._wire[i]], self.src_block(i), self.tensors[self._dst_t[i]]
        seg = torch.empty(self._seg[i], dtype=torch.uint8, device=src.device)
        amax = nvfp4_amax(dst, wire, src.device)
        if amax is None:
            encode_segment(wire, src, seg)
        else:
            encode_raw_amax(src, seg[: self._pay[i]], amax)
        at = (self.shape(i), self._dtype[i], dst, tuple(self._dst_off[i][: self._nd[i]]))
        seg = seg.to(dst.data.device)
        if amax is None:
            decode_segment(wire, seg, *at)
        else:
            decode_known_amax(seg, *at, amax.to(dst.data.device))

    def dst_parts(self, i: int) -> list[torch.Tensor]:
        """Views of what row i's copy writes in its destination: the region's values, and
        of a quantized storage its scales (and global scale)."""
        d = self.tensors[self._dst_t[i]]
        if d.storage == PLAIN:
            return [self.dst_block(i)]
        return list(dest_region(d, tuple(self._dst_off[i][: self._nd[i]]), self.shape(i)).parts())

    def region_sum(self, i: int) -> torch.Tensor:
        """Checksum of what row i's copy left in its destination (values, and scales of a
        quantized storage): on a one-sided path both ends read the landed region."""
        d = self.tensors[self._dst_t[i]]
        if d.storage == PLAIN:
            return self.summer.tensor(self.dst_block(i))
        r = dest_region(d, tuple(self._dst_off[i][: self._nd[i]]), self.shape(i))
        h = torch.zeros((), dtype=torch.int64, device=d.data.device)
        for part in r.parts():  # values, scales (, global scale)
            h = h * 1000003 + self.summer.tensor(part)
        return h

    def landed_direct(self, ch: Chunk, sums: _Sums) -> None:
        """Receiver checksums of a one-sided chunk once its doorbell rang: every copy whose
        last piece it carries, read back from where it landed."""
        for i in ch.rows:
            if self.ends(ch, i):
                sums[(ch.mid, i)] = self.region_sum(i)

    # ------------------------------------------------------------------ local copies
    def local_plan(self, rows: list[int], grouped: GroupedLanding | None = None) -> LocalStep:
        """Local copies as a ready-to-run step: views are cut once here, not per refit.
        With `grouped` (CUDA with triton), every copy its kernels take (same-dtype plain
        copies, MXFP8 / block-FP8 conversions) lands in one launch per group."""
        step = LocalStep()
        for i in rows:
            d = self.tensors[self._dst_t[i]]
            if d.storage == PLAIN:
                if grouped is not None and grouped.add_copy(self.src_block(i), self.dst_block(i)):
                    step.grouped_plain.append(i)
                    continue
                step.dst.append(self.dst_block(i))
                step.src.append(self.src_block(i))
            else:
                from refitd import formats

                region = dest_region(d, tuple(self._dst_off[i][: self._nd[i]]), self.shape(i))
                amax = whole_amax(self.tensors[self._src_t[i]], self.src_block(i))
                if grouped is not None and grouped.add_quantize(self.src_block(i), region, amax):
                    continue
                call = functools.partial(formats.copy_region, amax=amax)
                step.slow.append((call, self.src_block(i), region))
            step.rows.append(i)
        step.nbytes = self.local_bytes(step.rows)
        if grouped is not None and grouped.regions:
            step.grouped = grouped.build()
        return step

    def local_bytes(self, rows: list[int]) -> int:
        return sum(math.prod(self.shape(i)) * self._dtype[i].itemsize for i in rows)

    # ------------------------------------------------------------------ verification
    def source_sum(self, i: int) -> torch.Tensor:
        """Sender checksum of a raw copy: its source block as a plain destination will hold
        it (cast to the destination dtype when it differs), else as the raw segment."""
        src = self.src_block(i)
        c = self.p.copies
        dst_dtype = torch_dtype(DTYPES[int(c.dst_dtype[i])])
        if int(c.flags[i]) & FLAG_DST_PLAIN and dst_dtype != src.dtype:
            src = src.to(dst_dtype)
        return self.summer.tensor(src)

    def ends(self, ch: Chunk, i: int) -> bool:
        """Whether ch carries copy i's end: all of it, or its last piece (a relay has it whole)."""
        return not ch.split or ch.seg_start + ch.nbytes == self._pay[i]

    def source_sums(self, ch: Chunk, sums: _Sums) -> None:
        """Sender checksums of the raw copies that end in ch (encoded ones: pack)."""
        for i in ch.rows:
            if self._wire[i] == _RAW and self.ends(ch, i):
                sums[(ch.mid, i)] = self.source_sum(i)

    def landed(self, ch: Chunk, sums: _Sums) -> None:
        """Read back the destination blocks of the plain raw copies that ch completes."""
        for i in ch.rows:  # the others are checked on their segment in unpack
            if self.plain_raw_dst(i) and self.ends(ch, i):
                sums[(ch.mid, i)] = self.summer.tensor(self.dst_block(i))

    def message_sums(self, m: MessageColumns, sums: _Sums) -> dict[int, int]:
        """One checksum per message: its copies' checksums combined in order."""
        keys = [
            (int(m.id[k]), i) for k in range(len(m)) for i in range(int(m.start[k]), int(m.end[k]))
        ]
        missing = [k for k in keys if k not in sums]
        if missing:
            mid, i = missing[0]
            raise ExecutionError(
                f"slot {self.p.slot}: message {mid}: no checksum for the copy of tensor "
                f"{self._src_t[i]} -> {self._dst_t[i]} ({len(missing)} copies missing)"
            )
        values = iter(torch.stack([sums[k] for k in keys]).tolist() if keys else [])
        return {
            int(m.id[k]): combine(next(values) for _ in range(int(m.end[k] - m.start[k])))
            for k in range(len(m))
        }

    def check_local(
        self,
        rows: list[int],
        fused: torch.Tensor | None = None,
        fused_rows: list[int] | None = None,
    ) -> None:
        """Compare each local copy's destination block with its source (plain storage);
        `fused`: (source, landed) checksums the grouped copy kernel computed for
        fused_rows."""
        plain = [i for i in rows if self.tensors[self._dst_t[i]].storage == PLAIN]
        pairs = [
            torch.stack((self.source_sum(i), self.summer.tensor(self.dst_block(i)))) for i in plain
        ]
        if fused is not None and fused_rows:
            plain += fused_rows
            pairs.append(fused)
        if not plain:
            return
        values = torch.cat([p.reshape(-1, 2) for p in pairs]).tolist()
        bad = [i for i, (a, b) in zip(plain, values, strict=True) if a != b]
        if bad:
            raise ExecutionError(
                f"slot {self.p.slot}: checksum mismatch of {len(bad)} local copies: "
                + "; ".join(
                    f"{self.describe(self._src_t[i])} at {self._src_off[i][: self._nd[i]]} -> "
                    f"{self.describe(self._dst_t[i])} at {self._dst_off[i][: self._nd[i]]} "
                    f"{list(self.shape(i))}"
                    for i in bad[:8]
                )
            )

    def describe(self, index: int) -> str:
        s = self.p.tensors[index]  # a tensor of this slot: its name came with its handle
        return f"{self.tensors[index].name!r} (pool {s.pool}, rank {s.rank})"

"""Snapshot release: a slot copies the source bytes it reads into a buffer of its own,
releases the trainer, then sends and copies from that buffer.

Prepared once per loaded program (`prepare_snapshot`): the source tensors the slot reads
(sources of its sends and local copies, not relays) are grouped by the memory that holds
them and their byte extents merged into a few large ranges (a worker's CPU tensors sit side
by side in its shared-memory arena), so a capture is a handful of bulk copies however many
tensors there are. The executor is built over `SnapshotResolver`: sources resolve to views
of the buffer, with the live tensors' shapes and strides, so it needs no other change. A
contiguous source that a local copy reads whole into NVFP4 storage is captured on its own
through the NVFP4 amax kernel (`_Fold`): its copy and its amax come from one read, and the
local copy quantizes from the snapshot in one read as well.

Where the buffer lives: host shared memory for CPU sources; for GPU sources device memory
when it fits (free memory minus a margin), else pinned host memory. `cap_bytes` bounds the
buffer per slot; above it, or when something cannot be snapshotted, the slot reads live
memory as before and `Snapshot.fallback` says why (it reaches the refit's record).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from refitd.executor.prepare import TensorResolver
from refitd.executor.segments import ResolvedTensor, encode_raw_amax
from refitd.memory.segments import shared_buffer
from refitd.plan.program import FLAG_AMAX_WORD, SlotProgram
from refitd.plan.wire import PLAIN
from refitd.slot_protocol import SnapshotInfo

ALIGN = 64  # ranges start on this boundary in source and buffer: element alignment is kept
MERGE_GAP = 4 << 10  # bytes between two extents of one storage copied rather than split
DEVICE_MARGIN = 1 << 30  # GPU memory left free when deciding where a GPU snapshot goes


@dataclass
class _Range:
    """One bulk copy: bytes [start, end) of a source storage -> buffer at `offset`."""

    storage: torch.Tensor  # uint8 view of the whole source storage
    start: int  # byte offset in that storage
    end: int
    offset: int = 0  # byte offset in the snapshot buffer


@dataclass
class _Fold:
    """A source captured with its NVFP4 amax: `live` into `out` (its bytes in the buffer),
    its amax bits into `amax` (None: a plain copy, the buffer being on another device,
    where the amax would cost a pass of its own)."""

    live: torch.Tensor
    out: torch.Tensor
    amax: torch.Tensor | None


@dataclass
class Snapshot:
    """A prepared snapshot of one slot's sources: `capture()` per refit.

    `fallback` is empty when the snapshot is used, else why the slot reads live memory.
    """

    indices: frozenset[int]
    checked: frozenset[int] = frozenset()  # the key of the resolver's prepared check
    nbytes: int = 0
    fallback: str = ""
    where: str = ""  # "host_shm" | "device" | "pinned_host"
    tensors: dict[int, ResolvedTensor] = field(default_factory=dict)
    _ranges: list[_Range] = field(default_factory=list)
    _folds: list[_Fold] = field(default_factory=list)
    _buffer: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return not self.fallback and bool(self.tensors)

    def capture(self) -> float:
        """Copy the live source bytes into the buffer; returns the seconds it took."""
        t0 = time.monotonic()
        buf = self._buffer
        assert buf is not None
        cuda = buf.is_cuda or any(r.storage.is_cuda for r in self._ranges)
        cuda = cuda or any(f.live.is_cuda for f in self._folds)
        for r in self._ranges:
            buf[r.offset : r.offset + r.end - r.start].copy_(
                r.storage[r.start : r.end], non_blocking=cuda
            )
        for f in self._folds:
            if f.amax is None:
                f.out.view(f.live.dtype).view(f.live.shape).copy_(f.live, non_blocking=cuda)
            else:
                encode_raw_amax(f.live, f.out, f.amax)
        if cuda:
            torch.cuda.synchronize()
        return time.monotonic() - t0

    def info(self) -> SnapshotInfo:
        """What the execute and load replies say about it."""
        return SnapshotInfo(self.nbytes if self.active else 0, self.fallback)


@dataclass
class SnapshotResolver:
    """The executor's resolver over a snapshot: sources from the buffer, the rest live."""

    base: TensorResolver
    snapshot: Snapshot

    def resolve(self, index: int) -> ResolvedTensor:
        t = self.snapshot.tensors.get(index)
        return t if t is not None else self.base.resolve(index)

    def check(self, indices: Iterable[int]) -> None:
        self.base.check(indices)


def source_indices(program: SlotProgram) -> set[int]:
    """Tensors this slot reads as sources (relays, which read destinations, excluded).
    Copy rows are laid out sends, then receives, then local copies (the program codec
    checks it), so both sets come from slices of the copy columns."""
    c = program.copies
    send_end = int(program.send.end[-1]) if len(program.send) else 0
    local = slice(program.local_start, len(c))
    dests = set(c.dst[send_end : program.local_start].tolist()) | set(c.dst[local].tolist())
    srcs = set(c.src[:send_end].tolist()) | set(c.src[local].tolist())
    return srcs - dests


def prepare_snapshot(
    program: SlotProgram, resolver: TensorResolver, wanted: Iterable[int], cap_bytes: int
) -> Snapshot:
    """Plan and allocate the snapshot of the sources in `wanted` (or say why not)."""
    reads = source_indices(program)
    wanted_set = frozenset(wanted)
    snap = Snapshot(indices=frozenset(reads & wanted_set))
    snap.checked = snap.indices
    if not snap.indices:
        return snap
    if reads - wanted_set:
        snap.fallback = (
            f"{len(reads - wanted_set)} source tensors of this slot come from a pool without "
            "snapshot: the trainer is released when live memory has been read"
        )
        return snap
    live = {i: resolver.resolve(i) for i in sorted(snap.indices)}
    odd = [t.name for t in live.values() if t.storage != PLAIN or t.scales is not None]
    if odd:
        snap.fallback = f"quantized source storage cannot be snapshotted: {odd[:4]}"
        return snap
    whole = _read_whole_into_nvfp4(program, live)
    ranges, places = _ranges({i: t.data for i, t in live.items() if i not in whole})
    snap.nbytes = sum(r.end - r.start for r in ranges) + ALIGN * len(ranges)
    snap.nbytes += sum(_padded(live[i].data.nbytes) for i in whole)
    if snap.nbytes > cap_bytes:
        snap.fallback = (
            f"snapshot of {snap.nbytes} bytes exceeds snapshot_bytes {cap_bytes}: the slot "
            "reads live trainer memory"
        )
        return snap
    buf, snap.where = _allocate(snap.nbytes, next(iter(live.values())).data.device)
    pos = 0
    for r in ranges:
        r.offset = pos
        pos += _padded(r.end - r.start)
    for i, t in live.items():
        if i in whole:
            out = buf[pos : pos + t.data.nbytes]
            amax = torch.zeros(1, dtype=torch.int32, device=buf.device)
            snap._folds.append(_Fold(t.data, out, amax if buf.device == t.data.device else None))
            view = out.view(t.data.dtype).view(t.data.shape)
            snap.tensors[i] = ResolvedTensor(t.name, view, amax=snap._folds[-1].amax)
            pos += _padded(t.data.nbytes)
            continue
        r, delta = places[i]
        snap.tensors[i] = ResolvedTensor(t.name, _view(buf, r.offset + delta, t.data), None)
    snap._ranges, snap._buffer = ranges, buf
    return snap


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _read_whole_into_nvfp4(program: SlotProgram, live: dict[int, ResolvedTensor]) -> set[int]:
    """Sources (contiguous, not float64) that a local copy reads whole into NVFP4 storage:
    captured through the amax kernel (_Fold)."""
    c, out = program.copies, set()
    for r in range(program.local_start, len(c)):
        i, nd = int(c.src[r]), int(c.ndim[r])
        t = live[i].data if i in live else None
        if t is None or not int(c.flags[r]) & FLAG_AMAX_WORD or c.src_off[r, :nd].any():
            continue
        whole = tuple(c.shape[r, :nd].tolist()) == tuple(t.shape)
        if whole and t.is_contiguous() and t.dtype != torch.float64:
            out.add(i)
    return out


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte offsets [first, end) of t's elements in its storage (non-negative strides)."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return first, first + (last + 1) * size


def _ranges(
    tensors: dict[int, torch.Tensor],
) -> tuple[list[_Range], dict[int, tuple[_Range, int]]]:
    """Merged byte ranges per storage, and for each tensor its range and offset in it."""
    by_storage: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    storages: dict[tuple[str, int], torch.Tensor] = {}
    for i, t in tensors.items():
        if min(t.stride(), default=0) < 0:
            raise ValueError(f"tensor {i}: negative strides cannot be snapshotted")
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr())
        if key not in storages:
            storages[key] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s)
        first, end = _extent(t)
        by_storage.setdefault(key, []).append((first, end, i))
    ranges: list[_Range] = []
    places: dict[int, tuple[_Range, int]] = {}
    for key, extents in by_storage.items():
        extents.sort()
        cur: _Range | None = None
        for first, end, i in extents:
            if cur is None or first > cur.end + MERGE_GAP:
                cur = _Range(storages[key], first - first % ALIGN, max(end, first))
                ranges.append(cur)
            cur.end = max(cur.end, end)
            places[i] = (cur, first - cur.start)
    return ranges, places


def _allocate(nbytes: int, device: torch.device) -> tuple[torch.Tensor, str]:
    if device.type == "cpu":
        return shared_buffer(nbytes), "host_shm"
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes + DEVICE_MARGIN <= free:
        return torch.empty(nbytes, dtype=torch.uint8, device=device), "device"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pinned_host"


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor over buf at byte `offset` with like's dtype, shape and strides."""
    size = like.element_size()
    if offset % size:
        raise AssertionError("snapshot offset not aligned to the element size")
    typed = buf[: buf.numel() - buf.numel() % size].view(like.dtype)
    return typed.as_strided(like.shape, like.stride(), offset // size)

"""The transfer side of worker memory: `MemoryMapper` maps handles to tensors over the
worker's bytes (shared memory segments, CUDA IPC storages) and checks their liveness words,
one at a time (`check_live`), in one gather per state segment for a whole slot
(`liveness_check`, `check_live_words`), or before every refit as one read of each state
segment's stale count (`PreparedLiveness`)."""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from refitd.memory.errors import StorageMovedError
from refitd.memory.handles import (
    CUDA_IPC,
    SHM,
    STATE_LIVE,
    STATE_STALE_COUNT,
    STATE_WORD,
    MemoryHandle,
)
from refitd.memory.segments import Segment
from refitd.torch_dtypes import torch_dtype


@dataclass
class MemoryMapper:
    """Transfer-side cache of mapped segments and CUDA IPC storages (one per process/owner)."""

    _segments: dict[str, Segment] = field(default_factory=dict)
    _cuda: dict[tuple, torch.Tensor] = field(default_factory=dict)
    _typed_views: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def _segment(self, name: str) -> Segment:
        seg = self._segments.get(name)
        if seg is None:
            seg = Segment(name, 0, False)
            self._segments[name] = seg
        return seg

    def _typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole segment viewed as `dtype`, once per (segment, dtype)."""
        key = (name, dtype)
        typed = self._typed_views.get(key)
        if typed is None:
            raw = self._segment(name).bytes
            typed = raw[: raw.numel() - raw.numel() % _itemsize(dtype)].view(dtype)
            self._typed_views[key] = typed
        return typed

    def map_handle(self, handle: MemoryHandle) -> torch.Tensor:
        """A tensor over the worker's bytes (no copy), after checking the handle is live."""
        self.check_live(handle)
        dtype = torch_dtype(handle.dtype)
        if handle.kind == SHM:
            typed = self._typed(handle.segment, dtype)
            itemsize = typed.element_size()
            first = handle.offset // itemsize + handle.storage_offset
            if len(handle.shape) != len(handle.strides):
                raise ValueError(f"tensor {handle.name!r}: handle shape and strides differ in rank")
            extent = sum(map(operator.mul, handle.shape, handle.strides)) - sum(handle.strides)
            if (
                handle.offset % itemsize
                or handle.storage_offset < 0
                or min(handle.strides, default=0) < 0
                or handle.offset + handle.nbytes > typed.numel() * itemsize
                or (
                    0 not in handle.shape
                    and (first + extent + 1) * itemsize > handle.offset + handle.nbytes
                )
            ):
                raise StorageMovedError(
                    f"tensor {handle.name!r}: its handle does not fit segment {handle.segment!r} "
                    f"(offset {handle.offset}, {handle.nbytes} bytes, shape {handle.shape}, "
                    f"strides {handle.strides}, storage offset {handle.storage_offset})"
                )
            return typed.as_strided(handle.shape, handle.strides, first)
        if handle.kind == CUDA_IPC:
            return self._map_cuda(handle, dtype)
        raise ValueError(f"tensor {handle.name!r}: unknown memory kind {handle.kind!r}")

    def _map_cuda(self, handle: MemoryHandle, dtype: torch.dtype) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        key = (handle.ipc[0], handle.offset, handle.nbytes)
        base = self._cuda.get(key)
        if base is None:
            ipc_handle, ref_handle, ref_offset, event_handle, event_sync = handle.ipc
            base = rebuild_cuda_tensor(
                torch.Tensor,
                (handle.nbytes,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                handle.device,
                ipc_handle,
                handle.nbytes,
                handle.offset,
                False,
                ref_handle,
                ref_offset,
                event_handle,
                event_sync,
            )
            self._cuda[key] = base
        typed = base[: handle.nbytes - handle.nbytes % _itemsize(dtype)].view(dtype)
        return typed.as_strided(handle.shape, handle.strides, handle.storage_offset)

    def state_words(self, name: str) -> torch.Tensor:
        """The liveness words of a state segment (int64 view of its mapping)."""
        raw = self._segment(name).bytes
        return raw[: raw.numel() - raw.numel() % STATE_WORD].view(torch.int64)

    def check_live(self, handle: MemoryHandle) -> None:
        """Raise StorageMovedError if the worker marked this registration stale."""
        if not handle.state_segment:
            return
        seg = self._segment(handle.state_segment)
        (state,) = struct.unpack_from("<Q", seg.buf, handle.state_index * STATE_WORD)
        if state != STATE_LIVE:
            raise StorageMovedError(
                f"tensor {handle.name!r}: its storage moved or was released since registration "
                f"(was at 0x{handle.data_ptr:x}); the worker must register it again"
            )

    def close(self) -> None:
        self._segments.clear()
        self._typed_views.clear()
        self._cuda.clear()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


LivenessCheck = list[tuple[str, torch.Tensor, list[str]]]  # (state segment, indices, names)


def liveness_check(handles: Iterable[MemoryHandle]) -> LivenessCheck:
    """The liveness words of `handles` (and their scale buffers) grouped per state segment,
    ready for `check_live_words` (prepared once, checked before every refit)."""
    by_state: dict[str, tuple[list[int], list[str]]] = {}
    for h in handles:
        for part in (h, h.scales, h.global_scale):
            if part is None or not part.state_segment:
                continue
            idx, names = by_state.setdefault(part.state_segment, ([], []))
            idx.append(part.state_index)
            names.append(part.name)
    return [
        (seg, torch.tensor(idx, dtype=torch.int64), names) for seg, (idx, names) in by_state.items()
    ]


def check_live_words(mapper: MemoryMapper, check: LivenessCheck) -> None:
    """Raise StorageMovedError naming every stale tensor of a prepared check; the words
    are read in one gather per state segment (a slot may hold 100,000 tensors)."""
    stale: list[str] = []
    for seg_name, idx, names in check:
        words = mapper.state_words(seg_name)
        if idx.numel() and (int(idx.max()) >= words.numel() or int(idx.min()) < 0):
            raise StorageMovedError(
                f"state segment {seg_name!r} is smaller than its handles say: register again"
            )
        bad = (words[idx] != STATE_LIVE).nonzero().flatten()
        stale += [names[i] for i in bad.tolist()]
    if stale:
        raise StorageMovedError(
            f"registered storage moved or released for {stale}: the worker must register "
            "these tensors again before the next refit"
        )


@dataclass
class PreparedLiveness:
    """The liveness check of a fixed set of handles, prepared once (`of`) and run before
    every refit (`check`): it reads each state segment's stale count (STATE_STALE_COUNT,
    through numpy views of the mapped segments: no torch op, one word a segment), and
    reads the liveness words again only when a count moved since the last check passed
    (some registration of that worker went stale)."""

    mapper: MemoryMapper
    named: LivenessCheck  # what check_live_words reads to name stale tensors
    words: list[np.ndarray] = field(init=False)
    counts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.words = [self.mapper.state_words(seg).numpy() for seg, _, _ in self.named]
        self.counts = self.stale_counts()

    @classmethod
    def of(cls, mapper: MemoryMapper, handles: Iterable[MemoryHandle]) -> PreparedLiveness:
        """Prepared and checked (StorageMovedError names every stale tensor); the counts
        are read before the words, so a mark between the two shows at the next check."""
        prepared = cls(mapper, liveness_check(handles))
        check_live_words(mapper, prepared.named)  # also checks the words are in the segments
        return prepared

    def stale_counts(self) -> list[int]:
        return [int(w[STATE_STALE_COUNT]) for w in self.words]

    def check(self) -> None:
        counts = self.stale_counts()
        if counts != self.counts:
            check_live_words(self.mapper, self.named)
            self.counts = counts

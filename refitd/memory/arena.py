"""The worker side of worker memory: `SharedTensorArena` places registered CPU storages in
owner-only shared memory in place (`_move_storage`: the storage object itself moves, so every
tensor and view over it follows) and exports CUDA storages as IPC handles; each registration
gets a liveness word the worker marks stale when the storage moves or the arena closes."""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from refitd.memory.handles import (
    CUDA_IPC,
    SHM,
    STATE_LIVE,
    STATE_STALE,
    STATE_STALE_COUNT,
    STATE_WORD,
    MemoryHandle,
)
from refitd.memory.segment_names import new_segment_name, reap_orphaned_segments
from refitd.memory.segments import Segment
from refitd.torch_dtypes import dtype_name

ALIGN = 64  # bytes between storages in a segment: a cache line, any element size
SEGMENT_BYTES = 1 << 30
STATE_WORDS = 1 << 20  # liveness words per state segment


@dataclass
class _Registration:
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    state_index: int
    state: Segment


@dataclass
class SharedTensorArena:
    """Worker-side owner of the shared memory behind registered tensors.

    `register({name: tensor})` moves CPU storages into owner-only (0600) shared memory in
    place (the storage object itself gets the new address: same tensor objects, same
    values, and every view of the storage, registered or not, follows) and exports CUDA
    storages as IPC handles. Tensors that share a storage keep sharing it.

    Storages are packed into a few large segments (`segment_bytes` each, sparse: only the
    bytes placed in them use memory; a storage larger than that gets a segment of its own),
    so descriptors and mappings grow with the bytes registered, not with the tensor count.
    Space of a storage registered again after it moved is not reused until close().
    """

    prefix: str = "refitd"
    segment_bytes: int = SEGMENT_BYTES
    state_words: int = STATE_WORDS
    _segments: list[Segment] = field(default_factory=list)
    _state: Segment | None = None
    _full_states: list[Segment] = field(default_factory=list)
    _regs: dict[str, _Registration] = field(default_factory=dict)
    _next_state: int = 0
    _open: Segment | None = None  # the segment new storages go into
    _used: int = 0  # bytes of _open already placed

    def register(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, MemoryHandle]:
        """Place `tensors` in shared memory (CPU) or export them (CUDA); return their handles."""
        for name, t in tensors.items():
            if not (t.is_cpu or t.is_cuda):
                raise ValueError(f"tensor {name!r}: device {t.device} cannot be shared")
        if self._state is None:
            reap_orphaned_segments()  # a new worker on a host clears what killed ones left
        cpu = {n: t for n, t in tensors.items() if t.is_cpu}
        placed = self._register_cpu(cpu) if cpu else {}
        handles: dict[str, MemoryHandle] = {}
        for name, t in tensors.items():
            state, idx = self._state_word()
            struct.pack_into("<Q", state.buf, idx * STATE_WORD, STATE_LIVE)
            shape, strides, ptr = tuple(t.shape), t.stride(), t.data_ptr()
            self._regs[name] = _Registration(t, ptr, shape, strides, idx, state)
            if t.is_cuda:
                h = self._register_cuda(name, t)
                handles[name] = dataclasses.replace(h, state_segment=state.name, state_index=idx)
                continue
            seg, offset, nbytes = placed[name]
            handles[name] = MemoryHandle(
                SHM,
                seg.name,
                offset,
                nbytes,
                dtype_name(t.dtype),
                shape,
                strides,
                t.storage_offset(),
                ptr,
                -1,
                (),
                state.name,
                idx,
                name,
            )
        return handles

    def _state_word(self) -> tuple[Segment, int]:
        """The next free liveness word (a new state segment when the current one is full)."""
        if self._state is None or self._next_state >= self.state_words:
            if self._state is not None:
                self._full_states.append(self._state)
            self._state = Segment(
                new_segment_name(self.prefix + "-state"), self.state_words * STATE_WORD, True
            )
            self._next_state = STATE_STALE_COUNT + 1  # word 0 counts stale marks
        self._next_state += 1
        return self._state, self._next_state - 1

    def _place(self, nbytes: int) -> tuple[Segment, int]:
        """Room for nbytes: in the open segment, else in a new one."""
        need = ((nbytes or 1) + ALIGN - 1) & -ALIGN
        if self._open is None or self._used + need > self._open.size:
            seg = Segment(new_segment_name(self.prefix), max(self.segment_bytes, need), True)
            self._segments.append(seg)
            self._open, self._used = seg, 0
        offset = self._used
        self._used += need
        return self._open, offset

    def _register_cpu(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[Segment, int, int]]:
        """Move the storages of `tensors` into segments; name -> (segment, byte offset of its
        storage there, storage bytes). Bytes are copied with memmove: a torch copy per small
        storage costs more than the copy itself.

        Each storage moves in place (`_move_storage`): every tensor and view over it, the
        registered ones and those held elsewhere (a framework's flat or padded buffer, an
        optimizer's references), reads and writes the shared memory from then on.
        """
        # Taken before any storage moves: one storage may back several registered tensors.
        where: dict[int, tuple[Segment, int, int]] = {}
        old_ptrs: dict[str, int] = {}
        placed: dict[int, tuple[Segment, int, int]] = {}  # storages in a segment already
        for name, t in tensors.items():
            if t.layout != torch.strided:
                raise ValueError(f"tensor {name!r}: layout cannot be shared")
            s = t.untyped_storage()
            ptr = old_ptrs[name] = s.data_ptr()
            if ptr not in where:
                n = s.nbytes()
                home = self._segment_holding(ptr, n)
                if home is not None:
                    where[ptr] = placed[ptr] = (home, ptr - home.address, n)
                    continue
                seg, offset = self._place(n)
                where[ptr] = (seg, offset, n)
        spans: dict[str, tuple[Segment, int, int]] = {}
        for ptr, (seg, offset, n) in where.items():
            if ptr in placed:
                continue
            _, lo, hi = spans.get(seg.name, (seg, offset, offset + n))
            spans[seg.name] = (seg, min(lo, offset), max(hi, offset + n))
        for seg, lo, hi in spans.values():
            seg.reserve(lo, hi - lo)
        for ptr, (seg, offset, n) in where.items():
            if ptr not in placed:
                ctypes.memmove(seg.address + offset, ptr, n)
        moved: dict[int, torch.UntypedStorage] = {}  # old address -> the moved storage
        out: dict[str, tuple[Segment, int, int]] = {}
        for name, t in tensors.items():
            seg, offset, n = out[name] = where[old_ptrs[name]]
            if n == 0:
                continue  # an empty storage has no bytes to move
            storage = t.untyped_storage()
            if storage.data_ptr() == seg.address + offset:
                continue  # its storage moved already (a view registered under another name)
            first = moved.get(old_ptrs[name])
            if first is None:
                moved[old_ptrs[name]] = _move_storage(storage, seg, offset)
            else:
                # A second storage object over the same bytes (from_numpy twice, say): its
                # tensor follows the moved one, so the registered tensors keep sharing bytes.
                with torch.no_grad():
                    t.set_(first, t.storage_offset(), t.size(), t.stride())
        return out

    def _segment_holding(self, ptr: int, nbytes: int) -> Segment | None:
        """The segment of this arena a storage already lives in (registered before, e.g.
        another view of it): it stays where it is, so a reader of it is never disturbed."""
        for seg in self._segments:
            if seg.address <= ptr and ptr + nbytes <= seg.address + seg.size:
                return seg
        return None

    def _register_cuda(self, name: str, t: torch.Tensor) -> MemoryHandle:
        storage = t.untyped_storage()
        (
            device,
            handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
        return MemoryHandle(
            kind=CUDA_IPC,
            segment="",
            offset=int(offset_bytes),
            nbytes=int(size_bytes),
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            strides=tuple(t.stride()),
            storage_offset=t.storage_offset(),
            data_ptr=t.data_ptr(),
            device=int(device),
            ipc=(
                bytes(handle),
                bytes(ref_handle),
                int(ref_offset),
                bytes(event_handle),
                bool(event_sync),
            ),
            name=name,
        )

    def check_unmoved(self, tensors: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """Names of registered tensors whose storage moved or was resized since registration.

        Their liveness words are marked stale, so transfer processes refuse them until the
        worker registers them again. `tensors` defaults to the registered objects themselves.
        """
        moved: list[str] = []
        for name, reg in self._regs.items():
            t = reg.tensor if tensors is None else tensors.get(name, reg.tensor)
            if (
                t.data_ptr() != reg.data_ptr
                or tuple(t.shape) != reg.shape
                or tuple(t.stride()) != reg.strides
            ):
                moved.append(name)
                _mark_stale(reg)
        return moved

    def names(self) -> list[str]:
        return list(self._regs)

    def close(self) -> None:
        """Mark every handle stale and unlink the segments (mappings stay valid until unmapped)."""
        for reg in self._regs.values():
            _mark_stale(reg)
        for seg in [*self._full_states, *([self._state] if self._state else []), *self._segments]:
            seg.unlink()
        self._segments.clear()
        self._full_states.clear()
        self._state = None
        self._open = None
        self._regs.clear()


def _mark_stale(reg: _Registration) -> None:
    """Mark a registration's liveness word stale, then count it in its segment's word 0."""
    struct.pack_into("<Q", reg.state.buf, reg.state_index * STATE_WORD, STATE_STALE)
    at = STATE_STALE_COUNT * STATE_WORD
    (count,) = struct.unpack_from("<Q", reg.state.buf, at)
    struct.pack_into("<Q", reg.state.buf, at, count + 1)


def _move_storage(storage: torch.UntypedStorage, seg: Segment, offset: int) -> torch.UntypedStorage:
    """Point `storage` itself at the copy of its bytes at `offset` in `seg`, in place.

    The storage object keeps its identity: every tensor and view over it (whoever holds
    them) sees the shared memory, and no tensor's storage offset changes. The segment's
    mapping lives as long as the storage does. Its old memory is released as torch's own
    `share_memory_()` releases it, so raw addresses taken before (numpy views, data_ptr())
    must not be used after. Returns `storage`.
    """
    swap = getattr(storage, "_swap_data_ptr_", None)
    if swap is None:
        raise RuntimeError(
            f"torch {torch.__version__} cannot move a storage into shared memory in place "
            "(UntypedStorage._swap_data_ptr_ is missing); use the torch version refitd pins"
        )
    n = storage.nbytes()
    shared = torch.frombuffer(seg.buf, dtype=torch.uint8, count=n, offset=offset)
    swap(shared.untyped_storage())  # `shared` now owns the old memory and frees it
    return storage

"""Worker memory that a transfer process can read and write in place.

Worker side (client library): `SharedTensorArena` moves the storage of registered CPU tensors
into POSIX shared memory without replacing the tensor objects, and exports GPU tensors as CUDA
IPC handles. Each registration yields a `MemoryHandle` (the opaque `memory` bytes of the proto).
Transfer side: `MemoryMapper.map_handle` turns a handle back into a tensor over the same bytes.

Every arena owns a small state segment with one word per registered storage. The worker
marks a word stale when it finds that storage moved (`check_unmoved`) or when it closes, and
the transfer side refuses stale handles, so moved storage is never read or written stale.

A worker killed with -9 cannot unlink its segments (POSIX shared memory outlives its
creator), so the creator holds a shared flock on each segment for its lifetime and
`reap_orphaned_segments` (run by node agents and new arenas) unlinks the ones nobody holds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import operator
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgpack
import torch

from refitd.torch_dtypes import dtype_name, torch_dtype
from refitd.transport.errors import StorageMovedError
from refitd.transport.segment_names import SHM_DIR, new_segment_name, reap_orphaned_segments
from refitd.transport.shm import Segment

__all__ = [
    "SHM_DIR",
    "MemoryHandle",
    "MemoryMapper",
    "SharedTensorArena",
    "StorageMovedError",
    "reap_orphaned_segments",
]

SHM = "shm"
CUDA_IPC = "cuda_ipc"
ALIGN = 64  # bytes between storages in a segment: a cache line, any element size
SEGMENT_BYTES = 1 << 30
STATE_WORDS = 1 << 20  # liveness words per state segment
STATE_WORD = 8
STATE_LIVE = 1
STATE_STALE = 2
HANDLE_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class MemoryHandle:
    """Where a registered tensor's bytes live, enough for another process to map them.

    shm: `segment` names a file under /dev/shm and `offset` is the byte offset of the tensor's
    storage in it. cuda_ipc: `ipc` holds the fields of torch's `_share_cuda_()` and `offset`
    is the storage's byte offset inside its CUDA allocation. In both cases `storage_offset`,
    `shape` and `strides` (elements) place the tensor in its storage. `data_ptr` is the
    address the worker saw at registration; `state_segment`/`state_index` locate the
    liveness word. `scales` carries the second buffer of a quantized storage,
    `global_scale` the third of NVFP4 storage (its float32 global scale).
    """

    kind: str
    segment: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int
    data_ptr: int
    device: int = -1
    ipc: tuple = ()
    state_segment: str = ""
    state_index: int = -1
    name: str = ""
    scales: MemoryHandle | None = None
    global_scale: MemoryHandle | None = None

    def to_bytes(self) -> bytes:
        return msgpack.packb(self._to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> MemoryHandle:
        d = msgpack.unpackb(data, raw=False)
        if d.get("v") != HANDLE_FORMAT_VERSION:
            raise ValueError(
                f"memory handle format {d.get('v')!r}, expected {HANDLE_FORMAT_VERSION}"
            )
        return cls._from_dict(d)

    def _to_dict(self) -> dict:
        return {
            "v": HANDLE_FORMAT_VERSION,
            "kind": self.kind,
            "segment": self.segment,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "storage_offset": self.storage_offset,
            "data_ptr": self.data_ptr,
            "device": self.device,
            "ipc": list(self.ipc),
            "state_segment": self.state_segment,
            "state_index": self.state_index,
            "name": self.name,
            "scales": None if self.scales is None else self.scales._to_dict(),
            "global_scale": None if self.global_scale is None else self.global_scale._to_dict(),
        }

    @classmethod
    def _from_dict(cls, d: dict) -> MemoryHandle:
        return cls(
            kind=d["kind"],
            segment=d["segment"],
            offset=d["offset"],
            nbytes=d["nbytes"],
            dtype=d["dtype"],
            shape=tuple(d["shape"]),
            strides=tuple(d["strides"]),
            storage_offset=d["storage_offset"],
            data_ptr=d["data_ptr"],
            device=d["device"],
            ipc=tuple(d["ipc"]),
            state_segment=d["state_segment"],
            state_index=d["state_index"],
            name=d["name"],
            scales=None if d["scales"] is None else cls._from_dict(d["scales"]),
            global_scale=None
            if d.get("global_scale") is None
            else cls._from_dict(d["global_scale"]),
        )


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
            self._next_state = 0
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
        for name, t in tensors.items():
            if t.layout != torch.strided:
                raise ValueError(f"tensor {name!r}: layout cannot be shared")
            s = t.untyped_storage()
            ptr = old_ptrs[name] = s.data_ptr()
            if ptr not in where:
                n = s.nbytes()
                seg, offset = self._place(n)
                where[ptr] = (seg, offset, n)
        spans: dict[str, tuple[Segment, int, int]] = {}
        for seg, offset, n in where.values():
            _, lo, hi = spans.get(seg.name, (seg, offset, offset + n))
            spans[seg.name] = (seg, min(lo, offset), max(hi, offset + n))
        for seg, lo, hi in spans.values():
            seg.reserve(lo, hi - lo)
        for ptr, (seg, offset, n) in where.items():
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
                struct.pack_into("<Q", reg.state.buf, reg.state_index * STATE_WORD, STATE_STALE)
        return moved

    def names(self) -> list[str]:
        return list(self._regs)

    def close(self) -> None:
        """Mark every handle stale and unlink the segments (mappings stay valid until unmapped)."""
        for reg in self._regs.values():
            struct.pack_into("<Q", reg.state.buf, reg.state_index * STATE_WORD, STATE_STALE)
        for seg in [*self._full_states, *([self._state] if self._state else []), *self._segments]:
            seg.unlink()
        self._segments.clear()
        self._full_states.clear()
        self._state = None
        self._open = None
        self._regs.clear()


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


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over an anonymous shared mapping: the same kind of pages (shmem)
    as registered worker tensors, so a benchmark reference measured on it is fair."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


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


def check_all_live(mapper: MemoryMapper, handles: Iterable[MemoryHandle]) -> None:
    """Check every handle (and its scale buffers) is live; one error naming all stale
    tensors."""
    check_live_words(mapper, liveness_check(handles))

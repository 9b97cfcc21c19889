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

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgpack
import torch

SHM = "shm"
CUDA_IPC = "cuda_ipc"
SHM_DIR = "/dev/shm"
ALIGN = 4096
STATE_WORD = 8
STATE_LIVE = 1
STATE_STALE = 2
HANDLE_FORMAT_VERSION = 1


class StorageMovedError(RuntimeError):
    """A registered tensor's storage moved or was released: it must be registered again."""


@dataclass(frozen=True, slots=True)
class MemoryHandle:
    """Where a registered tensor's bytes live, enough for another process to map them.

    shm: `segment` names a file under /dev/shm and `offset` is the byte offset of the tensor's
    storage in it. cuda_ipc: `ipc` holds the fields of torch's `_share_cuda_()` and `offset`
    is the storage's byte offset inside its CUDA allocation. In both cases `storage_offset`,
    `shape` and `strides` (elements) place the tensor in its storage. `data_ptr` is the
    address the worker saw at registration; `state_segment`/`state_index` locate the
    liveness word. `scales` carries the second buffer of a quantized storage.
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
        )


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16, with a clear error for unknown names."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dt


class _Segment:
    """One POSIX shared-memory segment (a file under /dev/shm), mapped read-write."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise StorageMovedError(
                f"shared memory segment {name!r} is gone (worker exited or closed its arena); "
                "the worker must register its tensors again"
            ) from None
        self._owner_fd: int | None = None
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_SH)  # "my creator lives": released when it dies
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if create:
            self._owner_fd = fd
        else:
            os.close(fd)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8) if size else torch.empty(0)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphaned_segments(prefix: str = "refitd", shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's `prefix-*-PID-HEX` segments whose creator is gone: no process holds
    the creator's flock (it dies with the process, in any PID namespace) and PID is not a
    live process here. Mappings that still use a segment keep it until they unmap."""
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        head, _, tail = entry.name.rpartition("-")
        _, _, pid = head.rpartition("-")
        if not entry.name.startswith(prefix + "-") or len(tail) != 12 or not pid.isdigit():
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != uid or _pid_alive(int(pid)):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator (or a fork of it) still holds it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            removed.append(entry.name)
        finally:
            os.close(fd)
    return removed


def _new_segment_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


@dataclass
class _Registration:
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    state_index: int


@dataclass
class SharedTensorArena:
    """Worker-side owner of the shared memory behind registered tensors.

    `register({name: tensor})` moves CPU storages into a new owner-only (0600) segment in
    place (`tensor.set_` under no_grad: same Python object, new address, same values) and
    exports CUDA storages as IPC handles. Tensors that share a storage keep sharing it.
    """

    prefix: str = "refitd"
    max_tensors: int = 65536
    _segments: list[_Segment] = field(default_factory=list)
    _state: _Segment | None = None
    _regs: dict[str, _Registration] = field(default_factory=dict)
    _next_state: int = 0

    def register(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, MemoryHandle]:
        """Place `tensors` in shared memory (CPU) or export them (CUDA); return their handles."""
        state = self._state_segment()
        cpu = {n: t for n, t in tensors.items() if t.device.type == "cpu"}
        handles = self._register_cpu(cpu) if cpu else {}
        for name, t in tensors.items():
            if t.device.type == "cuda":
                handles[name] = self._register_cuda(name, t)
            elif t.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: device {t.device} cannot be shared")
        for name, t in tensors.items():
            idx = self._next_state
            if idx >= self.max_tensors:
                raise ValueError(f"arena full: more than {self.max_tensors} registrations")
            self._next_state += 1
            struct.pack_into("<Q", state.mm, idx * STATE_WORD, STATE_LIVE)
            self._regs[name] = _Registration(
                t, t.data_ptr(), tuple(t.shape), tuple(t.stride()), idx
            )
            h = handles[name]
            handles[name] = MemoryHandle(
                **{
                    **{f: getattr(h, f) for f in h.__dataclass_fields__},
                    "state_segment": state.name,
                    "state_index": idx,
                    "data_ptr": t.data_ptr(),
                }
            )
        return {n: handles[n] for n in tensors}

    def _state_segment(self) -> _Segment:
        if self._state is None:
            reap_orphaned_segments()  # a new worker on a host clears what killed ones left
            self._state = _Segment(
                _new_segment_name(self.prefix + "-state"), self.max_tensors * STATE_WORD, True
            )
        return self._state

    def _register_cpu(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, MemoryHandle]:
        storages: dict[int, torch.UntypedStorage] = {}
        for name, t in tensors.items():
            if t.layout != torch.strided:
                raise ValueError(f"tensor {name!r}: layout cannot be shared")
            s = t.untyped_storage()
            storages.setdefault(s.data_ptr(), s)
        offsets: dict[int, int] = {}
        size = 0
        for ptr, s in storages.items():
            offsets[ptr] = size
            size += -(-max(s.nbytes(), 1) // ALIGN) * ALIGN
        seg = _Segment(_new_segment_name(self.prefix), size, True)
        self._segments.append(seg)
        new_storage: dict[int, torch.UntypedStorage] = {}
        for ptr, s in storages.items():
            view = seg.bytes[offsets[ptr] : offsets[ptr] + s.nbytes()]
            view.copy_(torch.empty(0, dtype=torch.uint8).set_(s))
            new_storage[ptr] = view.untyped_storage()
        handles: dict[str, MemoryHandle] = {}
        # Taken before any tensor moves: one tensor object may be registered under two names.
        where = {
            name: (t.untyped_storage().data_ptr(), t.storage_offset())
            for name, t in tensors.items()
        }
        moved: set[int] = set()
        with torch.no_grad():
            for name, t in tensors.items():
                old_ptr, storage_offset = where[name]
                base_elems = offsets[old_ptr] // t.element_size()
                if offsets[old_ptr] % t.element_size():
                    raise AssertionError("storage offset not aligned to element size")
                if id(t) not in moved:
                    moved.add(id(t))
                    t.set_(new_storage[old_ptr], base_elems + storage_offset, t.size(), t.stride())
                handles[name] = MemoryHandle(
                    kind=SHM,
                    segment=seg.name,
                    offset=0,
                    nbytes=seg.size,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    strides=tuple(t.stride()),
                    storage_offset=t.storage_offset(),
                    data_ptr=t.data_ptr(),
                    name=name,
                )
        return handles

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
                if self._state is not None:
                    struct.pack_into(
                        "<Q", self._state.mm, reg.state_index * STATE_WORD, STATE_STALE
                    )
        return moved

    def names(self) -> list[str]:
        return list(self._regs)

    def close(self) -> None:
        """Mark every handle stale and unlink the segments (mappings stay valid until unmapped)."""
        if self._state is not None:
            for reg in self._regs.values():
                struct.pack_into("<Q", self._state.mm, reg.state_index * STATE_WORD, STATE_STALE)
            self._state.unlink()
        for seg in self._segments:
            seg.unlink()
        self._segments.clear()
        self._regs.clear()


@dataclass
class MemoryMapper:
    """Transfer-side cache of mapped segments and CUDA IPC storages (one per process/owner)."""

    _segments: dict[str, _Segment] = field(default_factory=dict)
    _cuda: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def _segment(self, name: str) -> _Segment:
        seg = self._segments.get(name)
        if seg is None:
            seg = _Segment(name, 0, False)
            self._segments[name] = seg
        return seg

    def map_handle(self, handle: MemoryHandle) -> torch.Tensor:
        """A tensor over the worker's bytes (no copy), after checking the handle is live."""
        self.check_live(handle)
        dtype = torch_dtype(handle.dtype)
        if handle.kind == SHM:
            seg = self._segment(handle.segment)
            if handle.offset + handle.nbytes > seg.size:
                raise StorageMovedError(
                    f"tensor {handle.name!r}: segment {handle.segment!r} is smaller than its handle"
                )
            raw = seg.bytes[handle.offset : handle.offset + handle.nbytes]
            typed = raw[: handle.nbytes - handle.nbytes % _itemsize(dtype)].view(dtype)
            return typed.as_strided(handle.shape, handle.strides, handle.storage_offset)
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

    def check_live(self, handle: MemoryHandle) -> None:
        """Raise StorageMovedError if the worker marked this registration stale."""
        if not handle.state_segment:
            return
        seg = self._segment(handle.state_segment)
        (state,) = struct.unpack_from("<Q", seg.mm, handle.state_index * STATE_WORD)
        if state != STATE_LIVE:
            raise StorageMovedError(
                f"tensor {handle.name!r}: its storage moved or was released since registration "
                f"(was at 0x{handle.data_ptr:x}); the worker must register it again"
            )

    def close(self) -> None:
        self._segments.clear()
        self._cuda.clear()


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over an anonymous shared mapping: the same kind of pages (shmem)
    as registered worker tensors, so a benchmark reference measured on it is fair."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def check_all_live(mapper: MemoryMapper, handles: Iterable[MemoryHandle]) -> None:
    """Check every handle (and its scales) is live; one error naming all stale tensors."""
    stale: list[str] = []
    for h in handles:
        for part in (h, h.scales):
            if part is None:
                continue
            try:
                mapper.check_live(part)
            except StorageMovedError:
                stale.append(part.name)
    if stale:
        raise StorageMovedError(
            f"registered storage moved or released for {stale}: the worker must register "
            "these tensors again before the next refit"
        )

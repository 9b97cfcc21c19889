"""POSIX shared-memory segments mapped without keeping a file descriptor.

A mapping made with Python's `mmap.mmap` keeps a duplicate of the file descriptor for its
whole life, so a process that maps many segments runs out of descriptors (EMFILE under
`ulimit -n 1024`). Segments here are mapped with libc's mmap and the descriptor is closed at
once; the mapping is unmapped when the last tensor over it is freed. Only the creator keeps
one descriptor per segment: it holds a shared flock on it for its lifetime, which
`reap_orphaned_segments` uses to tell the segments of killed workers from live ones.
`shared_buffer` gives anonymous shared pages of the same kind, for benchmark references.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import weakref

import torch

from refitd.memory.errors import StorageMovedError
from refitd.memory.segment_names import SHM_DIR


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, size: int) -> ctypes.Array:
    """Map `size` bytes of `fd` shared read-write; the caller may close fd right after.

    Returns a ctypes byte array over the mapping (a writable buffer); the mapping is
    released when the array (and every tensor made from it) is garbage."""
    addr = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    arr = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(arr, _LIBC.munmap, addr, size)
    return arr


class Segment:
    """One POSIX shared-memory segment (a file under /dev/shm), mapped read-write.

    `buf` is the mapping as a writable buffer (struct.pack_into works on it) and `bytes` a
    uint8 tensor over it. The creator keeps its descriptor (flock, see module docstring);
    a process that opens an existing segment keeps none.
    """

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
                os.ftruncate(fd, size)  # sparse: pages cost memory once written
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.buf = map_fd(fd, size) if size else bytearray(0)
            self.address = ctypes.addressof(self.buf) if size else 0
        except BaseException:
            os.close(fd)
            raise
        if create:
            self._owner_fd = fd
        else:
            os.close(fd)
        self.bytes = torch.frombuffer(self.buf, dtype=torch.uint8) if size else torch.empty(0)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate pages for [offset, offset + nbytes) now (creator only): a full /dev/shm
        fails here with a clear error instead of SIGBUS when the bytes are written."""
        if self._owner_fd is None or nbytes <= 0:
            return
        try:
            os.posix_fallocate(self._owner_fd, offset, nbytes)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot allocate {nbytes} bytes of shared memory in {self.path}: {e.strerror} "
                f"(is {SHM_DIR} large enough?)",
            ) from None

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over an anonymous shared mapping: the same kind of pages (shmem)
    as registered worker tensors, so a benchmark reference measured on it is fair."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]

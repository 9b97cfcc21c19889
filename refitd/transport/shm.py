"""POSIX shared-memory segments mapped without keeping a file descriptor, and their reaper.

A mapping made with Python's `mmap.mmap` keeps a duplicate of the file descriptor for its
whole life, so a process that maps many segments runs out of descriptors (EMFILE under
`ulimit -n 1024`). Segments here are mapped with libc's mmap and the descriptor is closed at
once; the mapping is unmapped when the last tensor over it is freed. Only the creator keeps
one descriptor per segment: it holds a shared flock on it for its lifetime, which
`reap_orphaned_segments` uses to tell the segments of killed workers from live ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import weakref

import psutil
import torch

SHM_DIR = "/dev/shm"


class StorageMovedError(RuntimeError):
    """A registered tensor's storage moved or was released: it must be registered again."""


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


def new_segment_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


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
            if os.fstat(fd).st_uid != uid or psutil.pid_exists(int(pid)):
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

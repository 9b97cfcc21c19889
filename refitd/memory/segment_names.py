"""Names of refitd's POSIX shared-memory segments, and the reaper of those whose creator died.

A segment is named `prefix-PID-HEX` after its creator; the creator holds a shared flock on
it for its lifetime. Torch-free, so the node agent can reap at start without importing torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets

import psutil

SHM_DIR = "/dev/shm"


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

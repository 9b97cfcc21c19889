"""Shared memory left by a worker killed with -9 is unlinked; live workers' is kept."""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.segment_names import SHM_DIR, reap_orphaned_segments

CHILD = """
import sys, torch
from refitd.memory.arena import SharedTensorArena
arena = SharedTensorArena(prefix="refitd-reaptest")
arena.register({"w": torch.ones(1000)})
print(" ".join(s.name for s in [arena._state, *arena._segments]), flush=True)
sys.stdin.readline()
"""


def _segments_of(proc: subprocess.Popen) -> list[Path]:
    assert proc.stdout is not None
    return [Path(SHM_DIR, n) for n in proc.stdout.readline().split()]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_segments_of_a_killed_worker_are_reaped_live_ones_kept() -> None:
    live = SharedTensorArena(prefix="refitd-reaptest")
    live.register({"x": torch.zeros(10)})
    cmd = [sys.executable, "-c", CHILD]
    killed = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    running = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dead_segs, live_segs = _segments_of(killed), _segments_of(running)
        assert len(dead_segs) == 2 and all(p.exists() for p in dead_segs + live_segs)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        assert all(p.exists() for p in dead_segs)  # POSIX shm outlives its creator
        removed = reap_orphaned_segments()
        assert sorted(removed) >= sorted(p.name for p in dead_segs)
        assert not any(p.exists() for p in dead_segs)
        assert all(p.exists() for p in live_segs)
        assert all(Path(SHM_DIR, s.name).exists() for s in [live._state, *live._segments])
    finally:
        running.communicate("\n", timeout=30)
        live.close()


def test_a_held_segment_is_kept_even_when_its_pid_is_gone() -> None:
    """The creator's flock decides (PID namespaces differ between pods): a segment named
    after a dead pid is kept while some process still holds it."""
    path = Path(SHM_DIR, f"refitd-reaptest-{_dead_pid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert path.name not in reap_orphaned_segments()
        assert path.exists()
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert path.name in reap_orphaned_segments()
        assert not path.exists()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_names_that_are_not_ours_are_left_alone(tmp_path: Path) -> None:
    for name in ("refitd-x-123", "other-1-abcdefabcdef", f"refitd-x-{_dead_pid()}-short"):
        (tmp_path / name).write_bytes(b"")
    assert reap_orphaned_segments(shm_dir=str(tmp_path)) == []
    assert len(list(tmp_path.iterdir())) == 3

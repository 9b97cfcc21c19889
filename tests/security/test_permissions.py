"""Owner-only files: shared-memory segments of registered tensors and the SQLite state."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.segment_names import SHM_DIR
from refitd.server.database import StateDB


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_shared_memory_segments_are_owner_only() -> None:
    arena = SharedTensorArena(prefix="refitd-permtest")
    try:
        tensors = {"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(3)}
        handles = arena.register(tensors)
        segments = {h.segment for h in handles.values()} | {
            h.state_segment for h in handles.values()
        }
        assert len(segments) >= 2
        for name in segments:
            path = os.path.join(SHM_DIR, name)
            assert mode(path) == 0o600, (name, oct(mode(path)))
            assert os.stat(path).st_uid == os.getuid()
    finally:
        arena.close()


def test_sqlite_state_is_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a typical umask: files would be 0644 unless created owner-only
    try:
        data_dir = tmp_path / "state"
        db = StateDB(data_dir)
        db.save_model("m", 1, 0)  # a write: the WAL and its index exist now
        files = sorted(p.name for p in data_dir.iterdir())
        assert "refitd.sqlite3" in files and "refitd.sqlite3-wal" in files, files
        assert mode(data_dir) == 0o700
        for p in data_dir.iterdir():
            assert mode(p) == 0o600, (p.name, oct(mode(p)))
        db.close()
    finally:
        os.umask(old)

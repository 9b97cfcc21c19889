"""File descriptors: mapping segments keeps none, packing tensors keeps one per segment, and
every refitd process raises its soft RLIMIT_NOFILE to the hard limit."""

from __future__ import annotations

import subprocess
import sys

import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.mapping import MemoryMapper

# Run in a fresh interpreter: descriptors are counted for the whole process, and threads
# left by earlier tests in the pytest process may open or close some meanwhile.
_MAPPING_CHECK = """
import os, torch
from refitd.memory.arena import SharedTensorArena
from refitd.memory.mapping import MemoryMapper

def fds():
    return len(os.listdir("/proc/self/fd"))

# 4 KiB segments: each 4 KiB tensor gets its own
arena = SharedTensorArena(prefix="refitd-fdtest", segment_bytes=4096)
tensors = {f"t{i}": torch.full((1024,), float(i)) for i in range(200)}
try:
    before = fds()
    handles = arena.register(tensors)
    assert len({h.segment for h in handles.values()}) == 200
    owned = fds() - before
    # the creator's flock descriptor per segment, and the state
    assert owned <= 200 + 2, owned
    mapper = MemoryMapper()
    before = fds()
    mapped = {n: mapper.map_handle(h) for n, h in handles.items()}
    assert fds() == before, (fds(), before)
    assert all(torch.equal(mapped[n], t) for n, t in tensors.items())
    mapped["t7"][3] = -1.0  # the same bytes
    assert tensors["t7"][3].item() == -1.0
finally:
    arena.close()
print("checked")
"""


def test_mapping_many_segments_keeps_no_descriptor() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _MAPPING_CHECK], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["checked"]


def test_small_tensors_share_one_segment() -> None:
    arena = SharedTensorArena(prefix="refitd-fdtest")
    tensors = {f"t{i}": torch.arange(i + 1, dtype=torch.float64) for i in range(3000)}
    ints = {f"i{i}": torch.arange(i % 7 + 1, dtype=torch.int16) for i in range(3000)}
    try:
        handles = arena.register(tensors) | arena.register(ints)
        assert len({h.segment for h in handles.values()}) == 1
        mapper = MemoryMapper()
        for n, t in (tensors | ints).items():
            assert torch.equal(mapper.map_handle(handles[n]), t), n
    finally:
        arena.close()


def test_processes_raise_the_soft_descriptor_limit_to_the_hard_one() -> None:
    code = (
        "import resource; from refitd.limits import raise_nofile_limit;"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048));"
        "print(*raise_nofile_limit())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["2048", "2048"]

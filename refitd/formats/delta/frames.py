"""Frames of the delta codec on the Python side: memory for the compiled kernels and their words.

The byte layout is streams.py's; kernels.py encodes a frame, kernels_apply.py checks and
applies a stream, one pass each. Here: arrays of any strides as the kernels' layouts (flat
storage, row offsets, row length, step: read and written in place, never copied whole),
the room a frame may take, the working memory a sender reuses across frames and refits
(Scratch), the growable buffer frames are written into (ByteSink), runs of frames in
threads, and the apply kernel's outcome codes worded as errors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from refitd.formats.delta import kernels, kernels_apply
from refitd.formats.delta.kernels import BITMAP, DENSE, INDEX, UNCHANGED
from refitd.formats.delta.kernels_apply import (
    BAD_COUNTS,
    BAD_POPULATION,
    BAD_SIZE,
    BLOCK_COUNT,
    OK,
    PAST_BLOCK,
    TRAILING,
    TRUNCATED,
    UNKNOWN_KIND,
    UNORDERED,
)

__all__ = [
    "BITMAP",
    "DENSE",
    "FRAME_HEADER",
    "INDEX",
    "UNCHANGED",
    "ByteSink",
    "DeltaError",
    "Layout",
    "Scratch",
    "apply_frames",
    "encode_frames",
    "frame_capacity",
    "layout",
    "pad8",
    "read_bytes",
]

A, T = TypeVar("A"), TypeVar("T")
FRAME_HEADER = np.dtype([("nbytes", "<u8"), ("blocks", "<u4"), ("zero", "<u4")])
# (flat storage, element offset of each row's first element, row length, element step)
Layout = tuple[np.ndarray, np.ndarray, int, int]


class DeltaError(ValueError):
    """A delta that cannot be applied: malformed, truncated, or for another destination."""


def pad8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass
class Scratch:
    """Reusable working buffers of the codec, grown on demand and never shrunk: per name one
    8-byte aligned byte buffer. One Scratch serves one thread at a time."""

    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    sinks: dict[int, ByteSink] = field(default_factory=dict)  # an encoding thread's output

    def sink(self, thread: int) -> ByteSink:
        return self.sinks.setdefault(thread, ByteSink())

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint64).view(np.uint8)
            self.buffers[name] = buf
        return buf[:nbytes]

    def typed(self, name: str, n: int, dtype: np.dtype | type) -> np.ndarray:
        dt = np.dtype(dtype)
        return self.get(name, n * dt.itemsize).view(dt)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers.values()) + sum(
            k.capacity for k in self.sinks.values()
        )


class ByteSink:
    """A growable byte buffer the encoder appends to, reusable across refits (`reset`).
    `reserve` may move the buffer: a view taken before it is stale after it, so writers keep
    offsets and take views right before writing."""

    def __init__(self, capacity: int = 0) -> None:
        self._buf = np.empty(max(capacity, 64), dtype=np.uint64).view(np.uint8)
        self.size = 0

    def reserve(self, n: int) -> int:
        """Grow by n bytes; returns the offset of the new bytes."""
        at = self.size
        if at + n > self._buf.size:
            grown = np.empty(max(2 * self._buf.size, at + n) // 8 + 1, dtype=np.uint64)
            grown = grown.view(np.uint8)
            grown[:at] = self._buf[:at]
            self._buf = grown
        self.size = at + n
        return at

    def truncate(self, size: int) -> None:
        """Drop the bytes from `size` on (room reserved and not used)."""
        if not 0 <= size <= self.size:
            raise ValueError(f"ByteSink.truncate: {size} outside [0, {self.size}]")
        self.size = size

    def view(self, a: int, b: int) -> np.ndarray:
        return self._buf[a:b]

    def data(self) -> np.ndarray:
        return self._buf[: self.size]

    def reset(self) -> None:
        self.size = 0

    @property
    def capacity(self) -> int:
        return self._buf.size


def read_bytes(buf: np.ndarray, pos: int, nbytes: int, what: str) -> np.ndarray:
    if nbytes < 0 or pos + nbytes > buf.size:
        raise DeltaError(
            f"delta truncated: {what} needs bytes [{pos}, {pos + nbytes}) of {buf.size}"
        )
    return buf[pos : pos + nbytes]


def layout(x: np.ndarray) -> Layout | None:
    """The kernels' view of an array's elements in row-major order, in place: its flat
    storage, its rows' offsets, row length and step (dimensions that are contiguous with
    the next are merged, so a contiguous array is one row and a block of a matrix one offset
    per row). None for an array with a negative stride."""
    item = x.itemsize
    if x.flags.c_contiguous:
        return x.reshape(-1), np.zeros(1, dtype=np.int64), max(x.size, 1), 1
    if any(s < 0 for s in x.strides):
        return None
    dims = [(n, s // item) for n, s in zip(x.shape, x.strides, strict=True) if n != 1]
    merged = [dims[-1]]
    for n, s in reversed(dims[:-1]):
        inner, inner_step = merged[0]
        if s == inner * inner_step:
            merged[0] = (n * inner, inner_step)
        else:
            merged.insert(0, (n, s))
    width, step = merged[-1]
    rows = np.zeros(1, dtype=np.int64)
    for n, s in merged[:-1]:
        rows = (rows[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)  # outer first
    span = int(rows.max()) + (width - 1) * step + 1
    flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(item,))
    return flat, rows, width, step


def frame_capacity(n: int, block: int, width: int) -> int:
    """The most bytes a frame of n elements takes: every block costs at most its elements
    (the encoder picks the cheapest kind, DENSE being one), plus the header and padding."""
    nb = -(-n // block)
    return FRAME_HEADER.itemsize + pad8(nb) + pad8(2 * nb) + n * width + 16


def encode_work(s: Scratch, block: int, frame_blocks: int, dtype: np.dtype, thread: int = 0
                ) -> tuple:  # fmt: skip
    """The encode kernel's working memory for frames of frame_blocks blocks, from s (a set
    per encoding thread): block
    copies of base and live (for blocks not readable in place), their word offsets, the
    block's change masks, bitmaps, indices (an INDEX block has at most block / 16 changes,
    or a bitmap would be cheaper), values, kinds and counts."""
    per_index = frame_blocks * (block // 16) + 8  # + 8: the kernel writes words 8 at a time
    return (
        s.typed(f"base_block{thread}", block, dtype),
        s.typed(f"live_block{thread}", block, dtype),
        s.typed(f"base_words{thread}", -(-block // 64), np.int64),
        s.typed(f"live_words{thread}", -(-block // 64), np.int64),
        s.typed(f"masks{thread}", -(-block // 64), np.uint64),
        s.typed(f"bitmaps{thread}", frame_blocks * (block // 8), np.uint8),
        s.typed(f"indices{thread}", per_index, np.uint16),
        s.typed(f"bitmap_values{thread}", frame_blocks * block + 8, dtype),
        s.typed(f"index_values{thread}", per_index, dtype),
        s.typed(f"kinds{thread}", frame_blocks, np.uint8),
        s.typed(f"counts{thread}", frame_blocks, np.uint16),
    )


def encode_frames(
    base: Layout, live: Layout, n: int, block: int, frame_blocks: int, sink: ByteSink,
    scratch: Scratch, threads: int = 1,
) -> tuple[int, np.ndarray]:  # fmt: skip
    """Append the frames of n elements to sink; (changed, blocks per kind). With threads,
    runs of consecutive frames are encoded in parallel, each into its own buffer, and
    appended in order."""
    step = block * frame_blocks
    runs = _runs(-(-n // step), threads)
    width = live[0].itemsize

    def encode(i: int) -> tuple[int, np.ndarray]:
        run, out = runs[i], sink if len(runs) == 1 else scratch.sink(i)
        work = encode_work(scratch, block, frame_blocks, live[0].dtype, i)
        tally, changed = np.zeros(4, dtype=np.int64), 0
        for start in range(run[0] * step, min(run[1] * step, n), step):
            fn = min(step, n - start)
            cap = frame_capacity(fn, block, width)
            at = out.reserve(cap)
            total, c = kernels.encode_frame(base, live, start, fn, block, work,
                                            out.view(at, at + cap), tally)  # fmt: skip
            out.truncate(at + total)
            changed += int(c)
        return changed, tally

    for i in range(len(runs) if len(runs) > 1 else 0):
        scratch.sink(i).reset()
    results = _in_threads(encode, list(range(len(runs))))
    if len(runs) > 1:
        for i in range(len(runs)):
            part = scratch.sink(i).data()
            at = sink.reserve(part.size)
            sink.view(at, at + part.size)[:] = part
    return sum(c for c, _ in results), sum(t for _, t in results)  # type: ignore[return-value]


_APPLY_ERRORS = {
    TRUNCATED: "delta truncated: the frame at byte {pos} needs bytes up to {detail}",
    BLOCK_COUNT: "delta frame at byte {pos} has {detail} blocks, not as many as its elements fill",
    UNKNOWN_KIND: "delta frame at byte {pos}: unknown block kind {detail}",
    BAD_COUNTS: "delta frame at byte {pos}: changed counts inconsistent with blocks "
    "(block {detail})",
    BAD_POPULATION: "delta frame at byte {pos}: bitmap population differs from counts "
    "(block {detail})",
    PAST_BLOCK: "delta frame at byte {pos}: a changed index lies past its block (block {detail})",
    UNORDERED: "delta frame at byte {pos}: changed indices out of order (block {detail})",
    BAD_SIZE: "delta frame at byte {pos}: {detail} bytes, sections say otherwise",
    TRAILING: "{detail} trailing bytes after the last frame",
}


def apply_frames(
    buf: np.ndarray, pos: int, dst: Layout, n: int, block: int, frame_blocks: int, threads: int = 1
) -> tuple[int, np.ndarray]:
    """Apply the frames at buf[pos:] to the n elements of dst; (changed, blocks per kind).
    A frame is checked in full before any element of it is written. With threads, runs of
    consecutive frames land in parallel (each thread its own elements)."""
    step = block * frame_blocks
    frames = -(-n // step)
    runs = _runs(frames, threads)
    at = _frame_offsets(buf, pos, frames) if len(runs) > 1 else None
    # per thread: its elements [first, first + count) and its frames' bytes [a, b)
    tasks = [(0, n, pos, buf.size)]  # one thread, or frames whose sizes do not add up
    if at is not None:
        tasks = [(f0 * step, min(f1 * step, n) - f0 * step, at[f0], at[f1]) for f0, f1 in runs]

    def land(task: tuple[int, int, int, int]) -> tuple[int, np.ndarray]:
        first, count, a, b = task
        tally = np.zeros(4, dtype=np.int64)
        code, detail, where, changed = kernels_apply.apply_stream(
            buf[a:b], 0, dst, first, count, block, frame_blocks, tally
        )
        if code != OK:  # the kernel says why; the first thread's error in frame order
            raise DeltaError(_APPLY_ERRORS[code].format(pos=a + where, detail=detail))
        return int(changed), tally

    results = _in_threads(land, tasks)
    return sum(c for c, _ in results), sum(t for _, t in results)  # type: ignore[return-value]


def _runs(frames: int, threads: int) -> list[tuple[int, int]]:
    """frames split into at most `threads` runs of consecutive frames, as equal as can be."""
    t = max(1, min(threads, frames))
    cuts = [frames * i // t for i in range(t + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a] or [(0, 0)]


def _frame_offsets(buf: np.ndarray, pos: int, frames: int) -> list[int] | None:
    """Byte offset of each frame and of the end, from the frames' headers; None where they
    do not add up to the buffer exactly (the kernel then reports what is wrong)."""
    at = [pos]
    for _ in range(frames):
        if at[-1] + FRAME_HEADER.itemsize > buf.size:
            return None
        nbytes = int(buf[at[-1] : at[-1] + 8].view("<u8")[0])
        at.append(at[-1] + nbytes)
    return at if at[-1] == buf.size else None


def _in_threads(fn: Callable[[A], T], items: list[A]) -> list[T]:
    """fn over the items, in threads when there are several (the kernels release the GIL)."""
    if len(items) == 1:
        return [fn(items[0])]
    with ThreadPoolExecutor(len(items), thread_name_prefix="delta-codec") as pool:
        return list(pool.map(fn, items))

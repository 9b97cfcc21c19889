"""Delta codec: only the elements that changed since a base version, exact to the bit.

A *stream* is one flat run of fixed-width elements (2-byte BF16/FP16, 4-byte FP32, 1-byte
E4M3 values or E8M0 scales, ...). Elements are compared on their bit patterns (an unsigned
integer view), so NaN payloads, -0.0 and every other bit difference count as a change and
are reproduced exactly. The stream is cut into blocks of `block` elements; each block is
sent as whichever is smallest of

- UNCHANGED: nothing,
- BITMAP: one bit per element (block / 8 bytes) plus the changed values,
- INDEX: one uint16 in-block index per changed element plus the changed values,
- DENSE: every element of the block (a mostly changed block).

Blocks are grouped into frames of at most `frame_blocks` blocks, each encoded on its own, so
encode and apply need working memory per frame, not per stream. Byte layout (little-endian,
every section starting at a multiple of 8 bytes):

    stream: magic "RDLT" | u8 format version | u8 width | u16 0 | u32 block |
            u32 frame_blocks | u64 elements | frames...
    frame:  u64 frame bytes | u32 blocks | u32 0 | u8 kinds[blocks] | pad |
            u16 changed[blocks] | pad | bitmaps (BITMAP blocks, block/8 bytes each) |
            u16 indices (INDEX blocks) | pad | values: BITMAP blocks', then INDEX blocks',
            then DENSE blocks' (whole blocks), each group in block order | pad

A segment with several parts (MXFP8: E4M3 bytes and E8M0 scales; block FP8: E4M3 bytes and
FP32 scales) is a *container*: magic "RDLP" | u32 parts | u64 stream bytes[parts] | streams.

Everything is vectorised NumPy over a frame (frames.py: how the changes are
found); torch CPU tensors are read and written through zero-copy integer views
(bits_view). A strided live source is read a frame at a time into reused scratch memory,
never copied whole; the output goes into a growable ByteSink that a sender reuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from refitd.formats.delta.frames import (
    BITMAP,
    DENSE,
    INDEX,
    UNCHANGED,
    ByteSink,
    DeltaError,
    Layout,
    Scratch,
    apply_frames,
    encode_frames,
    layout,
    pad8,
    read_bytes,
)

__all__ = [
    "BITMAP",
    "DENSE",
    "INDEX",
    "UNCHANGED",
    "ByteSink",
    "DeltaError",
    "DeltaStats",
    "Scratch",
    "apply_parts",
    "apply_stream",
    "bits_view",
    "encode_parts",
    "encode_stream",
    "load_kernels",
    "sampled_changes",
    "worth_delta",
]

STREAM_MAGIC = b"RDLT"
CONTAINER_MAGIC = b"RDLP"
FORMAT_VERSION = 1
DEFAULT_BLOCK = 4096
DEFAULT_FRAME_BLOCKS = 1024
MAX_BLOCK = 32768  # changed counts and in-block indices are uint16
KIND_NAMES = ("unchanged", "bitmap", "index", "dense")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
STREAM_HEADER = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u1"),
        ("width", "<u1"),
        ("zero", "<u2"),
        ("block", "<u4"),
        ("frame_blocks", "<u4"),
        ("elements", "<u8"),
    ]
)


@dataclass(frozen=True)
class DeltaStats:
    """What an encode or apply saw: elements compared, elements changed, bytes of the delta
    and of the same elements sent dense, and how many blocks took each encoding."""

    elements: int
    changed: int
    nbytes: int
    dense_nbytes: int
    blocks: tuple[int, int, int, int]  # per kind: unchanged, bitmap, index, dense

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def __add__(self, other: DeltaStats) -> DeltaStats:
        return DeltaStats(
            self.elements + other.elements,
            self.changed + other.changed,
            self.nbytes + other.nbytes,
            self.dense_nbytes + other.dense_nbytes,
            tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)),  # type: ignore[arg-type]
        )


EMPTY_STATS = DeltaStats(0, 0, 0, 0, (0, 0, 0, 0))


def worth_delta(stats: DeltaStats, max_density: float) -> bool:
    """The sender's measured check for a message a delta was allowed for: a delta only if its
    density is within the threshold and it is smaller than the dense bytes."""
    return stats.density <= max_density and stats.nbytes < stats.dense_nbytes


def sampled_changes(
    bases: Sequence[np.ndarray | torch.Tensor],
    lives: Sequence[np.ndarray | torch.Tensor],
    stride: int,
) -> tuple[int, int]:
    """(elements compared, elements changed) over every `stride`-th index of dim 0 of each
    part, on bit patterns: a cheap density estimate that lets a sender skip the full encode
    of a message that is clearly too dense (the full encode of a 60 % changed gigabyte costs
    several times its dense send)."""
    if stride < 1:
        raise ValueError("sampled_changes: stride must be at least 1")
    elements = changed = 0
    for b, lv in zip(bases, lives, strict=True):
        bb, ll = bits_view(b), bits_view(lv)
        if bb.shape != ll.shape:
            raise DeltaError(f"delta sample: base shape {bb.shape} != live shape {ll.shape}")
        if bb.ndim == 0:
            bb, ll = bb.reshape(1), ll.reshape(1)
        bs, ls = bb[::stride], ll[::stride]
        elements += bs.size
        changed += int(np.count_nonzero(bs != ls))
    return elements, changed


def bits_view(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """The unsigned-integer view of an array or CPU tensor of 1/2/4/8-byte elements, sharing
    its memory (any strides), so comparisons and writes act on exact bit patterns."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise DeltaError(f"delta codec: expected a CPU tensor, got one on {x.device}")
        if x.element_size() not in _TORCH_INT:
            raise DeltaError(f"delta codec: unsupported element size {x.element_size()}")
        x = x.view(_TORCH_INT[x.element_size()]).numpy()
    width = x.dtype.itemsize
    if width not in _UINT:
        raise DeltaError(f"delta codec: unsupported element size {width}")
    return x.view(_UINT[width])


def check_block(block: int, frame_blocks: int) -> None:
    if block <= 0 or block % 8 or block > MAX_BLOCK:
        raise ValueError(f"delta block must be a positive multiple of 8 up to {MAX_BLOCK}")
    if frame_blocks <= 0:
        raise ValueError("delta frame_blocks must be positive")


def _layout(x: np.ndarray, scratch: Scratch | None, name: str) -> tuple[Layout, np.ndarray | None]:
    """The kernels' layout of x; for an array with a negative stride (NumPy only), a
    contiguous copy in scratch, returned too so a destination can be written back."""
    lay = layout(x)
    if lay is not None:
        return lay, None
    copy = (scratch or Scratch()).typed(name, x.size, x.dtype).reshape(x.shape)
    copy[...] = x
    return layout(copy), copy  # type: ignore[return-value]


def encode_stream(
    base: np.ndarray | torch.Tensor,
    live: np.ndarray | torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    frame_blocks: int = DEFAULT_FRAME_BLOCKS,
    sink: ByteSink | None = None,
    scratch: Scratch | None = None,
    threads: int = 1,
) -> tuple[np.ndarray, DeltaStats]:
    """Encode the delta that turns `base` into `live` (same element count and size, any
    shapes and strides; elements in row-major order). It is appended to `sink` (a new one
    when None); returns (a view of the appended bytes, valid until the sink grows again; its
    stats). `scratch` is reused working memory (a sender keeps one across refits); with
    `threads`, runs of frames are encoded in parallel (the same bytes)."""
    check_block(block, frame_blocks)
    b, lv = bits_view(base), bits_view(live)
    if b.size != lv.size or b.dtype != lv.dtype:
        raise DeltaError(
            f"delta encode: base {b.shape} {b.dtype} and live {lv.shape} {lv.dtype} differ"
        )
    sink = ByteSink() if sink is None else sink
    scratch = Scratch() if scratch is None else scratch
    (bl, _), (ll, _) = _layout(b, scratch, "base_copy"), _layout(lv, scratch, "live_copy")
    width, n = lv.dtype.itemsize, lv.size
    at = sink.reserve(STREAM_HEADER.itemsize)
    header = (STREAM_MAGIC, FORMAT_VERSION, width, 0, block, frame_blocks, n)
    sink.view(at, sink.size).view(STREAM_HEADER)[0] = header
    changed, tally = encode_frames(bl, ll, n, block, frame_blocks, sink, scratch, threads)
    size = sink.size - at
    stats = DeltaStats(n, changed, size, n * width, tuple(int(k) for k in tally))  # type: ignore[arg-type]
    return sink.view(at, sink.size), stats


def apply_stream(delta: np.ndarray | bytes | memoryview, dst: np.ndarray | torch.Tensor,
                 *, name: str = "destination", threads: int = 1) -> DeltaStats:  # fmt: skip
    """Apply a stream delta in place to `dst` (any strides, elements in row-major order), which
    must hold exactly the base the delta was encoded against. `name` goes into errors; with
    `threads`, runs of frames land in parallel."""
    buf = np.frombuffer(delta, dtype=np.uint8) if not isinstance(delta, np.ndarray) else delta
    target = bits_view(dst)
    try:
        head = read_bytes(buf, 0, STREAM_HEADER.itemsize, "stream header").view(STREAM_HEADER)[0]
        if bytes(head["magic"]) != STREAM_MAGIC or int(head["version"]) != FORMAT_VERSION:
            raise DeltaError("not a delta stream (bad magic or format version)")
        width, block = int(head["width"]), int(head["block"])
        n, frame_blocks = int(head["elements"]), int(head["frame_blocks"])
        if width != target.dtype.itemsize or n != target.size:
            raise DeltaError(
                f"delta of {n} {width}-byte elements cannot land in {target.size} "
                f"{target.dtype.itemsize}-byte elements"
            )
        check_block(block, frame_blocks)
        lay, copy = _layout(target, None, "destination")
        changed, tally = apply_frames(buf, STREAM_HEADER.itemsize, lay, n, block, frame_blocks,
                                      threads)  # fmt: skip
        if copy is not None:
            target[...] = copy
    except (DeltaError, ValueError) as e:
        raise DeltaError(f"delta for {name}: {e}") from None
    return DeltaStats(n, changed, buf.size, n * width, tuple(int(k) for k in tally))  # type: ignore[arg-type]


def encode_parts(
    bases: Sequence[np.ndarray | torch.Tensor],
    lives: Sequence[np.ndarray | torch.Tensor],
    *,
    block: int = DEFAULT_BLOCK,
    sink: ByteSink | None = None,
    scratch: Scratch | None = None,
    threads: int = 1,
) -> tuple[np.ndarray, DeltaStats]:
    """Encode a segment of several parts (values, scales ...) as one container, each part a
    stream at its own element width; appended to `sink` like encode_stream."""
    if len(bases) != len(lives):
        raise DeltaError(f"delta encode: {len(bases)} base parts for {len(lives)} live parts")
    sink = ByteSink() if sink is None else sink
    head = 8 + 8 * len(bases)
    at = sink.reserve(head)
    sizes, stats = [], EMPTY_STATS
    for b, lv in zip(bases, lives, strict=True):
        d, st = encode_stream(b, lv, block=block, sink=sink, scratch=scratch, threads=threads)
        sizes.append(d.size)
        pad = sink.reserve(pad8(d.size) - d.size)
        sink.view(pad, sink.size)[:] = 0
        stats = stats + st
    out = sink.view(at, sink.size)
    out[:4] = np.frombuffer(CONTAINER_MAGIC, dtype=np.uint8)
    out[4:8].view("<u4")[0] = len(sizes)
    out[8:head].view("<u8")[:] = sizes
    return out, DeltaStats(stats.elements, stats.changed, out.size, stats.dense_nbytes,
                           stats.blocks)  # fmt: skip


def apply_parts(delta: np.ndarray | bytes | memoryview, dsts: Sequence[np.ndarray | torch.Tensor],
                *, name: str = "destination", threads: int = 1) -> DeltaStats:  # fmt: skip
    """Apply a container delta in place, part i into dsts[i]."""
    buf = np.frombuffer(delta, dtype=np.uint8) if not isinstance(delta, np.ndarray) else delta
    if buf.size < 8 or bytes(buf[:4]) != CONTAINER_MAGIC:
        raise DeltaError(f"delta for {name}: not a delta container (bad magic)")
    nparts = int(buf[4:8].view("<u4")[0])
    if nparts != len(dsts):
        raise DeltaError(f"delta for {name}: {nparts} parts for {len(dsts)} destination parts")
    head = 8 + 8 * nparts
    sizes = read_bytes(buf, 8, 8 * nparts, "part sizes").view("<u8").astype(np.int64)
    pos, stats = head, EMPTY_STATS
    for i, (size, dst) in enumerate(zip(sizes, dsts, strict=True)):
        part = read_bytes(buf, pos, int(size), f"part {i}")
        stats = stats + apply_stream(part, dst, name=f"{name} part {i}", threads=threads)
        pos += pad8(int(size))
    if pos != buf.size:
        raise DeltaError(f"delta for {name}: {buf.size - pos} trailing bytes after the parts")
    return DeltaStats(stats.elements, stats.changed, buf.size, stats.dense_nbytes, stats.blocks)


def load_kernels(widths: Sequence[int] = (1, 2, 4, 8)) -> None:
    """Have the compiled kernels ready for these element widths: encode and apply a small
    delta with every block kind (numba compiles them, or loads them from its disk cache,
    on first use: a fraction of a second loaded, seconds compiled, once per process)."""
    for width in widths:
        base = np.zeros(4 * DEFAULT_BLOCK, dtype=_UINT[width])
        live = base.copy()
        live[5] = 1  # an INDEX block, a BITMAP block and a DENSE block
        live[DEFAULT_BLOCK : DEFAULT_BLOCK + DEFAULT_BLOCK // 2] = 1
        live[2 * DEFAULT_BLOCK :] = 1
        delta, _ = encode_stream(base, live)
        apply_stream(delta, base)
        if not np.array_equal(base, live):
            raise RuntimeError(f"delta kernels for {width}-byte elements do not round-trip")

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

Everything is vectorised NumPy over a frame; torch CPU tensors are read and written through
zero-copy integer views (bits_view).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

STREAM_MAGIC = b"RDLT"
CONTAINER_MAGIC = b"RDLP"
FORMAT_VERSION = 1
DEFAULT_BLOCK = 4096
DEFAULT_FRAME_BLOCKS = 1024
MAX_BLOCK = 32768  # changed counts and in-block indices are uint16

UNCHANGED, BITMAP, INDEX, DENSE = 0, 1, 2, 3
KIND_NAMES = ("unchanged", "bitmap", "index", "dense")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STREAM_HEADER = np.dtype(
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
_FRAME_HEADER = np.dtype([("nbytes", "<u8"), ("blocks", "<u4"), ("zero", "<u4")])


class DeltaError(ValueError):
    """A delta that cannot be applied: malformed, truncated, or for another destination."""


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


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


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


def _check_block(block: int, frame_blocks: int) -> None:
    if block <= 0 or block % 8 or block > MAX_BLOCK:
        raise ValueError(f"delta block must be a positive multiple of 8 up to {MAX_BLOCK}")
    if frame_blocks <= 0:
        raise ValueError("delta frame_blocks must be positive")


def _frame_overhead(blocks: int) -> int:
    return _FRAME_HEADER.itemsize + _pad8(blocks) + _pad8(2 * blocks) + 16


def max_stream_nbytes(
    elements: int, width: int, block: int = DEFAULT_BLOCK, frame_blocks: int = DEFAULT_FRAME_BLOCKS
) -> int:
    """An upper bound on the encoded size of a stream (every block costs at most its dense size)."""
    nblocks = -(-elements // block)
    frames = -(-nblocks // frame_blocks)
    return (
        _STREAM_HEADER.itemsize
        + frames * _frame_overhead(frame_blocks)
        + _pad8(elements * width)
        + 8 * frames
    )


def _choose_kinds(counts: np.ndarray, lens: np.ndarray, block: int, width: int) -> np.ndarray:
    """Per block the cheapest encoding (ties go to the simpler one)."""
    bitmap_cost = block // 8 + counts * width
    index_cost = counts * (2 + width)
    dense_cost = lens * width
    kinds = np.where(index_cost <= bitmap_cost, INDEX, BITMAP)
    kinds = np.where(dense_cost <= np.minimum(bitmap_cost, index_cost), DENSE, kinds)
    return np.where(counts == 0, UNCHANGED, kinds).astype(np.uint8)


def _runs(blocks: np.ndarray) -> list[tuple[int, int]]:
    """Sorted block numbers -> [(first, end)) runs of consecutive blocks."""
    if blocks.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [blocks.size]))
    return [(int(blocks[s]), int(blocks[e - 1]) + 1) for s, e in zip(starts, ends, strict=True)]


def _encode_frame(
    base: np.ndarray, live: np.ndarray, out: np.ndarray, block: int
) -> tuple[int, int, np.ndarray]:
    """Encode one frame of flat uint arrays into out (uint8); returns (bytes, changed, kinds)."""
    width, n = live.dtype.itemsize, live.size
    nb = -(-n // block)
    mask = np.zeros(nb * block, dtype=bool)
    np.not_equal(base, live, out=mask[:n])
    m2 = mask.reshape(nb, block)
    sparse = np.count_nonzero(mask) * 4 < n  # positions of every change are cheap to list
    if sparse:
        changed_at = np.flatnonzero(mask)
        blk = (
            changed_at >> (block.bit_length() - 1)
            if block & (block - 1) == 0
            else changed_at // block
        )
        counts = np.bincount(blk, minlength=nb)
    else:
        counts = np.count_nonzero(m2, axis=1)
    lens = np.full(nb, block, dtype=np.int64)
    lens[-1] = n - (nb - 1) * block
    kinds = _choose_kinds(counts, lens, block, width)
    bm = np.flatnonzero(kinds == BITMAP)
    dn = np.flatnonzero(kinds == DENSE)
    pos = _FRAME_HEADER.itemsize
    out[pos : pos + nb] = kinds
    pos += _pad8(nb)
    out[pos : pos + 2 * nb].view("<u2")[:] = counts
    pos += _pad8(2 * nb)
    if bm.size:
        bits = np.packbits(m2[bm], axis=1, bitorder="little")
        out[pos : pos + bits.size] = bits.reshape(-1)
        pos += bits.size
    vals_bm = None
    if not sparse:
        m2[dn] = False  # dense blocks send every element; the rest their changed ones
        if bm.size:  # bitmap values in block order through a boolean mask
            only_bm = np.zeros(nb, dtype=bool)
            only_bm[bm] = True
            vals_bm = live[(m2 & only_bm[:, None]).reshape(-1)[:n]]
            m2[bm] = False
        changed_at = np.flatnonzero(mask)  # now: the changes of INDEX blocks only
        blk = changed_at // block
    if bm.size or dn.size:
        kind_at = kinds[blk]
        at_bm, at_ix = changed_at[kind_at == BITMAP], changed_at[kind_at == INDEX]
    else:  # every changed element is in an INDEX block
        at_bm, at_ix = changed_at[:0], changed_at
    out[pos : pos + 2 * at_ix.size].view("<u2")[:] = at_ix % block
    pos = _pad8(pos + 2 * at_ix.size)
    for at, vals in ((at_bm, vals_bm), (at_ix, None)):
        if vals is None:
            vals = live[at] if at.size else None
        if vals is not None and vals.size:
            out[pos : pos + vals.size * width].view(live.dtype)[:] = vals
            pos += vals.size * width
    for first, end in _runs(dn):
        a, b = first * block, min(end * block, n)
        out[pos : pos + (b - a) * width].view(live.dtype)[:] = live[a:b]
        pos += (b - a) * width
    pos = _pad8(pos)
    out[: _FRAME_HEADER.itemsize].view(_FRAME_HEADER)[0] = (pos, nb, 0)
    return pos, int(counts.sum()), kinds


def encode_stream(
    base: np.ndarray | torch.Tensor,
    live: np.ndarray | torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    frame_blocks: int = DEFAULT_FRAME_BLOCKS,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, DeltaStats]:
    """Encode the delta that turns `base` into `live` (same element count and size, any
    shapes and strides; elements in row-major order). Returns (the delta as a uint8 array, a view of
    `out` when given, at least max_stream_nbytes long; its stats)."""
    _check_block(block, frame_blocks)
    b, lv = bits_view(base), bits_view(live)
    if b.size != lv.size or b.dtype != lv.dtype:
        raise DeltaError(
            f"delta encode: base {b.shape} {b.dtype} and live {lv.shape} {lv.dtype} differ"
        )
    b, lv = b.reshape(-1), lv.reshape(-1)  # copies only non-contiguous inputs
    width, n = lv.dtype.itemsize, lv.size
    cap = max_stream_nbytes(n, width, block, frame_blocks)
    if out is None:
        out = np.empty(cap, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.size < cap:
        raise DeltaError(f"delta encode: out must be uint8 1-D of at least {cap} bytes")
    header = (STREAM_MAGIC, FORMAT_VERSION, width, 0, block, frame_blocks, n)
    out[: _STREAM_HEADER.itemsize].view(_STREAM_HEADER)[0] = header
    pos, changed, per_kind = _STREAM_HEADER.itemsize, 0, np.zeros(4, dtype=np.int64)
    step = block * frame_blocks
    for start in range(0, n, step):
        used, c, kinds = _encode_frame(b[start : start + step], lv[start : start + step],
                                       out[pos:], block)  # fmt: skip
        pos, changed = pos + used, changed + c
        per_kind += np.bincount(kinds, minlength=4)
    stats = DeltaStats(n, changed, pos, n * width, tuple(int(k) for k in per_kind))  # type: ignore[arg-type]
    return out[:pos], stats


def _read(buf: np.ndarray, pos: int, nbytes: int, what: str) -> np.ndarray:
    if nbytes < 0 or pos + nbytes > buf.size:
        raise DeltaError(
            f"delta truncated: {what} needs bytes [{pos}, {pos + nbytes}) of {buf.size}"
        )
    return buf[pos : pos + nbytes]


class _Target:
    """Flat element access to a destination of any strides, in place."""

    def __init__(self, dst: np.ndarray) -> None:
        self.flat = dst.reshape(-1) if dst.flags.c_contiguous else dst.flat

    def put(self, positions: np.ndarray, values: np.ndarray) -> None:
        self.flat[positions] = values

    def put_range(self, a: int, b: int, values: np.ndarray) -> None:
        self.flat[a:b] = values

    def put_mask(self, start: int, mask: np.ndarray, values: np.ndarray) -> None:
        """values into the elements start + i where mask[i], in order."""
        if isinstance(self.flat, np.ndarray):
            self.flat[start : start + mask.size][mask] = values
        else:
            self.flat[start + np.flatnonzero(mask)] = values


def _apply_frame(buf: np.ndarray, pos: int, dst: _Target, start: int, n: int, block: int,
                 dtype: np.dtype) -> tuple[int, int, np.ndarray]:  # fmt: skip
    """Apply one frame at buf[pos:] to elements [start, start + n); (frame bytes, changed, kinds)."""
    width = dtype.itemsize
    head = _read(buf, pos, _FRAME_HEADER.itemsize, "frame header").view(_FRAME_HEADER)[0]
    nbytes, nb = int(head["nbytes"]), int(head["blocks"])
    if nb != -(-n // block):
        raise DeltaError(f"delta frame at byte {pos} has {nb} blocks, expected {-(-n // block)}")
    frame = _read(buf, pos, nbytes, "frame")
    at = _FRAME_HEADER.itemsize
    kinds = _read(frame, at, nb, "block kinds")
    at += _pad8(nb)
    counts = _read(frame, at, 2 * nb, "changed counts").view("<u2").astype(np.int64)
    at += _pad8(2 * nb)
    lens = np.full(nb, block, dtype=np.int64)
    lens[-1] = n - (nb - 1) * block
    if kinds.size and int(kinds.max()) > DENSE:
        raise DeltaError(f"delta frame at byte {pos}: unknown block kind {int(kinds.max())}")
    if np.any(counts > lens) or np.any((kinds == UNCHANGED) & (counts != 0)):
        raise DeltaError(f"delta frame at byte {pos}: changed counts inconsistent with blocks")
    bm, ix, dn = (np.flatnonzero(kinds == k) for k in (BITMAP, INDEX, DENSE))
    bits = _read(frame, at, bm.size * (block // 8), "bitmaps").reshape(bm.size, block // 8)
    at += bits.size
    flags = np.unpackbits(bits, axis=1, count=block, bitorder="little").view(bool)
    if not np.array_equal(np.count_nonzero(flags, axis=1), counts[bm]):
        raise DeltaError(f"delta frame at byte {pos}: bitmap population differs from counts")
    nbm = int(counts[bm].sum())
    nix = int(counts[ix].sum())
    ci = _read(frame, at, 2 * nix, "indices").view("<u2").astype(np.int64)
    at = _pad8(at + 2 * nix)
    ri = np.repeat(np.arange(ix.size), counts[ix])
    tail = bm.size and bm[-1] == nb - 1 and bool(flags[-1, lens[-1] :].any())
    if tail or np.any(ci >= lens[ix][ri]):
        raise DeltaError(f"delta frame at byte {pos}: a changed index lies past its block")
    ndense = int(lens[dn].sum())
    values = _read(frame, at, (nbm + nix + ndense) * width, "values").view(dtype)
    if _pad8(at + values.size * width) != nbytes:
        raise DeltaError(f"delta frame at byte {pos}: {nbytes} bytes, sections say otherwise")
    if nbm:  # bitmap values in block order: a boolean mask over the frame places them
        frame_mask = np.zeros(nb * block, dtype=bool)
        frame_mask.reshape(nb, block)[bm] = flags
        dst.put_mask(start, frame_mask[:n], values[:nbm])
    if nix:
        dst.put(start + ix[ri] * block + ci, values[nbm : nbm + nix])
    v = nbm + nix
    for first, end in _runs(dn):
        a, b = first * block, min(end * block, n)
        dst.put_range(start + a, start + b, values[v : v + b - a])
        v += b - a
    return nbytes, int(counts.sum()), kinds


def apply_stream(delta: np.ndarray | bytes | memoryview, dst: np.ndarray | torch.Tensor,
                 *, name: str = "destination") -> DeltaStats:  # fmt: skip
    """Apply a stream delta in place to `dst` (any strides, elements in row-major order), which
    must hold exactly the base the delta was encoded against. `name` goes into errors."""
    buf = np.frombuffer(delta, dtype=np.uint8) if not isinstance(delta, np.ndarray) else delta
    target = bits_view(dst)
    try:
        head = _read(buf, 0, _STREAM_HEADER.itemsize, "stream header").view(_STREAM_HEADER)[0]
        if bytes(head["magic"]) != STREAM_MAGIC or int(head["version"]) != FORMAT_VERSION:
            raise DeltaError("not a delta stream (bad magic or format version)")
        width, block = int(head["width"]), int(head["block"])
        n, frame_blocks = int(head["elements"]), int(head["frame_blocks"])
        if width != target.dtype.itemsize or n != target.size:
            raise DeltaError(
                f"delta of {n} {width}-byte elements cannot land in {target.size} "
                f"{target.dtype.itemsize}-byte elements"
            )
        _check_block(block, frame_blocks)
        flat, pos, changed = _Target(target), _STREAM_HEADER.itemsize, 0
        per_kind = np.zeros(4, dtype=np.int64)
        step = block * frame_blocks
        for start in range(0, n, step):
            used, c, kinds = _apply_frame(
                buf, pos, flat, start, min(step, n - start), block, target.dtype
            )
            pos, changed = pos + used, changed + c
            per_kind += np.bincount(kinds, minlength=4)
        if pos != buf.size:
            raise DeltaError(f"{buf.size - pos} trailing bytes after the last frame")
    except (DeltaError, ValueError) as e:
        raise DeltaError(f"delta for {name}: {e}") from None
    return DeltaStats(n, changed, pos, n * width, tuple(int(k) for k in per_kind))  # type: ignore[arg-type]


def encode_parts(
    bases: Sequence[np.ndarray | torch.Tensor],
    lives: Sequence[np.ndarray | torch.Tensor],
    *,
    block: int = DEFAULT_BLOCK,
) -> tuple[np.ndarray, DeltaStats]:
    """Encode a segment of several parts (values, scales ...) as one container, each part a
    stream at its own element width."""
    if len(bases) != len(lives):
        raise DeltaError(f"delta encode: {len(bases)} base parts for {len(lives)} live parts")
    streams = [encode_stream(b, lv, block=block) for b, lv in zip(bases, lives, strict=True)]
    head = 8 + 8 * len(streams)
    total = head + sum(_pad8(s.size) for s, _ in streams)
    out = np.zeros(total, dtype=np.uint8)
    out[:4] = np.frombuffer(CONTAINER_MAGIC, dtype=np.uint8)
    out[4:8].view("<u4")[0] = len(streams)
    out[8:head].view("<u8")[:] = [s.size for s, _ in streams]
    pos, stats = head, EMPTY_STATS
    for s, st in streams:
        out[pos : pos + s.size] = s
        pos += _pad8(s.size)
        stats = stats + st
    return out, DeltaStats(stats.elements, stats.changed, total, stats.dense_nbytes, stats.blocks)


def apply_parts(delta: np.ndarray | bytes | memoryview, dsts: Sequence[np.ndarray | torch.Tensor],
                *, name: str = "destination") -> DeltaStats:  # fmt: skip
    """Apply a container delta in place, part i into dsts[i]."""
    buf = np.frombuffer(delta, dtype=np.uint8) if not isinstance(delta, np.ndarray) else delta
    if buf.size < 8 or bytes(buf[:4]) != CONTAINER_MAGIC:
        raise DeltaError(f"delta for {name}: not a delta container (bad magic)")
    nparts = int(buf[4:8].view("<u4")[0])
    if nparts != len(dsts):
        raise DeltaError(f"delta for {name}: {nparts} parts for {len(dsts)} destination parts")
    head = 8 + 8 * nparts
    sizes = _read(buf, 8, 8 * nparts, "part sizes").view("<u8").astype(np.int64)
    pos, stats = head, EMPTY_STATS
    for i, (size, dst) in enumerate(zip(sizes, dsts, strict=True)):
        part = _read(buf, pos, int(size), f"part {i}")
        stats = stats + apply_stream(part, dst, name=f"{name} part {i}")
        pos += _pad8(int(size))
    if pos != buf.size:
        raise DeltaError(f"delta for {name}: {buf.size - pos} trailing bytes after the parts")
    return DeltaStats(stats.elements, stats.changed, buf.size, stats.dense_nbytes, stats.blocks)

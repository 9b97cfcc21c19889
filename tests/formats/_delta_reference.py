"""The NumPy reference of the delta codec, which the compiled codec must equal bit for bit.

This is the vectorised NumPy implementation of the byte format of refitd.formats.delta.streams
(finding the changes by one of two routes per frame, chosen on the fraction of changed 8-byte
words: a sparse route over the differing words, a mask route packing an element mask into
bits), written independently of the compiled kernels: tests encode and apply with both and
compare the bytes and the destinations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from refitd.formats.delta.frames import (
    BITMAP,
    DENSE,
    FRAME_HEADER,
    INDEX,
    UNCHANGED,
    ByteSink,
    DeltaError,
    Scratch,
    pad8,
    read_bytes,
)
from refitd.formats.delta.streams import (
    DEFAULT_BLOCK,
    DEFAULT_FRAME_BLOCKS,
    FORMAT_VERSION,
    STREAM_HEADER,
    STREAM_MAGIC,
    DeltaStats,
    bits_view,
    check_block,
)

SPARSE_WORDS = 1 / 3  # above this fraction of changed words a frame takes the mask route
CHUNK_WORDS = 1 << 16  # words compared and gathered at a time (512 KiB per side: in cache)


def choose_kinds(counts: np.ndarray, lens: np.ndarray, block: int, width: int) -> np.ndarray:
    """Per block the cheapest encoding (ties go to the simpler one)."""
    bitmap_cost = block // 8 + counts * width
    index_cost = counts * (2 + width)
    dense_cost = lens * width
    kinds = np.where(index_cost <= bitmap_cost, INDEX, BITMAP)
    kinds = np.where(dense_cost <= np.minimum(bitmap_cost, index_cost), DENSE, kinds)
    return np.where(counts == 0, UNCHANGED, kinds).astype(np.uint8)


def runs(blocks: np.ndarray) -> list[tuple[int, int]]:
    """Sorted block numbers -> [(first, end)) runs of consecutive blocks."""
    if blocks.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [blocks.size]))
    return [(int(blocks[s]), int(blocks[e - 1]) + 1) for s, e in zip(starts, ends, strict=True)]


def _aligned(x: np.ndarray) -> bool:
    return x.ctypes.data % 8 == 0


def _block_of(pos: np.ndarray, block: int) -> np.ndarray:
    if block & (block - 1) == 0:
        return pos >> (block.bit_length() - 1)
    return pos // block


def _word_changes(
    b: np.ndarray, lv: np.ndarray, s: Scratch
) -> tuple[np.ndarray, np.ndarray] | None:
    """Sparse route: (positions, values) of the changed elements, or None when more than
    SPARSE_WORDS of the 8-byte words changed (the mask route is cheaper then). Works through
    the frame in cache-sized chunks, so the gathers read what the comparison just brought in."""
    width, n = lv.dtype.itemsize, lv.size
    lanes = 8 // width
    nm = n - n % lanes
    bw, lw = b[:nm].view(np.uint64), lv[:nm].view(np.uint64)
    wm = s.typed("word_mask", min(CHUNK_WORDS, bw.size), np.bool_)
    limit = SPARSE_WORDS * max(bw.size, 1)
    shift = lanes.bit_length() - 1
    found, seen = [], 0
    for a in range(0, bw.size, CHUNK_WORDS):
        cb, cl = bw[a : a + CHUNK_WORDS], lw[a : a + CHUNK_WORDS]
        m = wm[: cb.size]
        np.not_equal(cb, cl, out=m)
        wi = np.flatnonzero(m)
        seen += wi.size
        if seen > limit:
            return None
        lx = cl.take(wi)
        if lanes == 1:
            found.append((wi + a, lx))
            continue
        x = cb.take(wi)
        np.bitwise_xor(x, lx, out=x)
        j = np.flatnonzero(x.view(lv.dtype) != 0)  # nonzero of bools is several times faster
        wi += a
        found.append((((wi.take(j >> shift)) << shift) | (j & (lanes - 1)),
                      lx.view(lv.dtype).take(j)))  # fmt: skip
    if nm < n:  # the last elements, fewer than a word
        tail = np.flatnonzero(b[nm:] != lv[nm:]) + nm
        found.append((tail, lv[tail]))
    if not found:
        return np.zeros(0, dtype=np.int64), lv[:0]
    if len(found) == 1:
        return found[0]
    return np.concatenate([p for p, _ in found]), np.concatenate([v for _, v in found])


@dataclass
class _Frame:
    """What one frame sends, before its bytes are written."""

    kinds: np.ndarray
    counts: np.ndarray
    bitmaps: np.ndarray  # uint8 [BITMAP blocks, block / 8]
    indices: np.ndarray  # in-block indices of INDEX blocks' changes
    values: list[np.ndarray]  # BITMAP blocks' changed values, then INDEX blocks'
    dense: np.ndarray  # DENSE block numbers

    def nbytes(self, block: int, n: int, width: int) -> tuple[int, int]:
        """(frame bytes, dense elements)."""
        nb = self.kinds.size
        dense_n = sum(min(e * block, n) - a * block for a, e in runs(self.dense))
        nvals = sum(v.size for v in self.values) + dense_n
        head = FRAME_HEADER.itemsize + pad8(nb) + pad8(2 * nb) + self.bitmaps.size
        return pad8(pad8(head + 2 * self.indices.size) + nvals * width), dense_n


def _sparse_frame(pos: np.ndarray, vals: np.ndarray, n: int, block: int, width: int) -> _Frame:
    nb = -(-n // block)
    bk = _block_of(pos, block)
    counts = np.bincount(bk, minlength=nb)
    lens = np.full(nb, block, dtype=np.int64)
    lens[-1] = n - (nb - 1) * block
    kinds = choose_kinds(counts, lens, block, width)
    bm = np.flatnonzero(kinds == BITMAP)
    dn = np.flatnonzero(kinds == DENSE)
    if bm.size == 0 and dn.size == 0:  # every change is in an INDEX block
        local = pos - bk * block if block & (block - 1) else pos & (block - 1)
        empty = np.zeros((0, block // 8), dtype=np.uint8)
        return _Frame(kinds, counts, empty, local, [vals], dn)
    kind_at = kinds.take(bk)
    at_bm, at_ix = kind_at == BITMAP, kind_at == INDEX
    flags = np.zeros((bm.size, block), dtype=bool)
    flags[np.searchsorted(bm, bk[at_bm]), pos[at_bm] - bk[at_bm] * block] = True
    bitmaps = np.packbits(flags, axis=1, bitorder="little")
    local = pos[at_ix] - bk[at_ix] * block
    return _Frame(kinds, counts, bitmaps, local, [vals[at_bm], vals[at_ix]], dn)


def _mask_frame(b: np.ndarray, lv: np.ndarray, block: int, s: Scratch) -> _Frame:
    n, width = lv.size, lv.dtype.itemsize
    nb = -(-n // block)
    mask = s.typed("mask", nb * block, np.bool_)
    np.not_equal(b, lv, out=mask[:n])
    mask[n:] = False
    m2 = mask.reshape(nb, block)
    bits = np.packbits(mask, bitorder="little").reshape(nb, block // 8)
    if block % 64 == 0:
        counts = np.bitwise_count(bits.view(np.uint64)).sum(axis=1, dtype=np.int64)
    else:
        counts = np.bitwise_count(bits).sum(axis=1, dtype=np.int64)
    lens = np.full(nb, block, dtype=np.int64)
    lens[-1] = n - (nb - 1) * block
    kinds = choose_kinds(counts, lens, block, width)
    bm, ix, dn = (np.flatnonzero(kinds == k) for k in (BITMAP, INDEX, DENSE))
    if bm.size == nb:  # every block a bitmap: one boolean selection over the frame
        values = [lv[mask[:n]]]
    elif bm.size:
        keep = np.zeros(nb, dtype=bool)
        keep[bm] = True
        values = [lv[(m2 & keep[:, None]).reshape(-1)[:n]]]
    else:
        values = [lv[:0]]
    rows, local = np.nonzero(m2[ix])
    values.append(lv.take(ix.take(rows) * block + local))
    return _Frame(kinds, counts, bits[bm], local, values, dn)


def encode_frame(
    b: np.ndarray, lv: np.ndarray, sink: ByteSink, block: int, s: Scratch
) -> tuple[int, np.ndarray]:
    """Append one frame of flat contiguous uint arrays to sink; (changed, kinds)."""
    n, width = lv.size, lv.dtype.itemsize
    if not (_aligned(b) and _aligned(lv)):
        raise ValueError("delta encode_frame: base and live frames must be 8-byte aligned")
    found = _word_changes(b, lv, s)
    if found is not None:
        f = _sparse_frame(found[0], found[1], n, block, width)
    else:
        f = _mask_frame(b, lv, block, s)
    nb = f.kinds.size
    total, _ = f.nbytes(block, n, width)
    at = sink.reserve(total)
    out = sink.view(at, at + total)
    out[: FRAME_HEADER.itemsize].view(FRAME_HEADER)[0] = (total, nb, 0)
    pos = FRAME_HEADER.itemsize
    out[pos : pos + pad8(nb)] = 0
    out[pos : pos + nb] = f.kinds
    pos += pad8(nb)
    out[pos : pos + pad8(2 * nb)] = 0
    out[pos : pos + 2 * nb].view("<u2")[:] = f.counts
    pos += pad8(2 * nb)
    out[pos : pos + f.bitmaps.size] = f.bitmaps.reshape(-1)
    pos += f.bitmaps.size
    end = pad8(pos + 2 * f.indices.size)
    out[pos:end] = 0
    out[pos : pos + 2 * f.indices.size].view("<u2")[:] = f.indices
    pos = end
    for v in f.values:
        out[pos : pos + v.size * width].view(lv.dtype)[:] = v
        pos += v.size * width
    for first, end_block in runs(f.dense):
        a, e = first * block, min(end_block * block, n)
        out[pos : pos + (e - a) * width].view(lv.dtype)[:] = lv[a:e]
        pos += (e - a) * width
    out[pos:total] = 0
    return int(f.counts.sum()), f.kinds


class Target:
    """Flat element access to a destination of any strides, in place: contiguous arrays by
    flat index, 2-D-collapsible ones by (row, column), anything else through .flat."""

    def __init__(self, dst: np.ndarray) -> None:
        self.flat: np.ndarray | None = dst.reshape(-1) if dst.flags.c_contiguous else None
        self.rows: np.ndarray | None = None
        self.any = dst
        if self.flat is None and dst.ndim >= 1:
            v = dst.view()
            try:
                v.shape = (-1, dst.shape[-1]) if dst.size else (0, 1)
                self.rows = v
            except AttributeError:
                self.rows = None

    def put(self, positions: np.ndarray, values: np.ndarray) -> None:
        if self.flat is not None:
            self.flat[positions] = values
        elif self.rows is not None:
            w = self.rows.shape[1]
            self.rows[positions // w, positions % w] = values
        else:
            self.any.flat[positions] = values

    def put_mask(self, start: int, mask: np.ndarray, values: np.ndarray) -> None:
        """values into the elements start + i where mask[i], in order."""
        if self.flat is not None:
            self.flat[start : start + mask.size][mask] = values
        else:
            self.put(start + np.flatnonzero(mask), values)

    def put_range(self, a: int, b: int, values: np.ndarray) -> None:
        if self.flat is not None:
            self.flat[a:b] = values
        else:
            self.put(np.arange(a, b), values)


def apply_frame(buf: np.ndarray, pos: int, dst: Target, start: int, n: int, block: int,
                dtype: np.dtype) -> tuple[int, int, np.ndarray]:  # fmt: skip
    """Apply one frame at buf[pos:] to elements [start, start + n); (frame bytes, changed, kinds)."""
    width = dtype.itemsize
    head = read_bytes(buf, pos, FRAME_HEADER.itemsize, "frame header").view(FRAME_HEADER)[0]
    nbytes, nb = int(head["nbytes"]), int(head["blocks"])
    if nb != -(-n // block):
        raise DeltaError(f"delta frame at byte {pos} has {nb} blocks, expected {-(-n // block)}")
    frame = read_bytes(buf, pos, nbytes, "frame")
    at = FRAME_HEADER.itemsize
    kinds = read_bytes(frame, at, nb, "block kinds")
    at += pad8(nb)
    counts = read_bytes(frame, at, 2 * nb, "changed counts").view("<u2").astype(np.int64)
    at += pad8(2 * nb)
    lens = np.full(nb, block, dtype=np.int64)
    lens[-1] = n - (nb - 1) * block
    if kinds.size and int(kinds.max()) > DENSE:
        raise DeltaError(f"delta frame at byte {pos}: unknown block kind {int(kinds.max())}")
    if np.any(counts > lens) or np.any((kinds == UNCHANGED) & (counts != 0)):
        raise DeltaError(f"delta frame at byte {pos}: changed counts inconsistent with blocks")
    bm, ix, dn = (np.flatnonzero(kinds == k) for k in (BITMAP, INDEX, DENSE))
    bits = read_bytes(frame, at, bm.size * (block // 8), "bitmaps").reshape(bm.size, block // 8)
    at += bits.size
    if block % 64 == 0 and bits.size:
        population = np.bitwise_count(bits.view("<u8")).sum(axis=1, dtype=np.int64)
    else:
        population = np.bitwise_count(bits).sum(axis=1, dtype=np.int64)
    if not np.array_equal(population, counts[bm]):
        raise DeltaError(f"delta frame at byte {pos}: bitmap population differs from counts")
    nbm = int(counts[bm].sum())
    nix = int(counts[ix].sum())
    ci = read_bytes(frame, at, 2 * nix, "indices").view("<u2")
    at = pad8(at + 2 * nix)
    ri = np.repeat(ix * block, counts[ix])
    last = ci[nix - int(counts[nb - 1]) :] if nix and ix[-1] == nb - 1 else ci[:0]
    if nix and (int(ci.max()) >= block or (last.size and int(last.max()) >= lens[-1])):
        raise DeltaError(f"delta frame at byte {pos}: a changed index lies past its block")
    ndense = int(lens[dn].sum())
    values = read_bytes(frame, at, (nbm + nix + ndense) * width, "values").view(dtype)
    if pad8(at + values.size * width) != nbytes:
        raise DeltaError(f"delta frame at byte {pos}: {nbytes} bytes, sections say otherwise")
    if nbm:  # bitmap values in block order: a boolean mask over the frame places them
        flags = np.unpackbits(bits, axis=1, count=block, bitorder="little").view(bool)
        if bm.size == nb:
            fm = flags.reshape(-1)
        else:
            fm = np.zeros(nb * block, dtype=bool)
            fm.reshape(nb, block)[bm] = flags
        if fm[n:].any():
            raise DeltaError(f"delta frame at byte {pos}: a changed index lies past its block")
        dst.put_mask(start, fm[:n], values[:nbm])
    if nix:
        ri += ci
        ri += start
        dst.put(ri, values[nbm : nbm + nix])
    v = nbm + nix
    for first, end in runs(dn):
        a, b = first * block, min(end * block, n)
        dst.put_range(start + a, start + b, values[v : v + b - a])
        v += b - a
    return nbytes, int(counts.sum()), kinds


class _Frames:
    """A live array of any strides read as flat frames: contiguous 8-byte aligned views where
    it is, else copied a frame at a time into scratch (a strided source is never copied whole)."""

    def __init__(self, x: np.ndarray, scratch: Scratch, name: str) -> None:
        self.x, self.scratch, self.name = x, scratch, name
        self.flat = x.reshape(-1) if x.flags.c_contiguous else None
        self.rows: np.ndarray | None = None
        if self.flat is None:
            v = x.view()
            try:
                v.shape = (-1, x.shape[-1])
                self.rows = v
            except AttributeError:  # not collapsible to rows: one flat copy
                self.flat = x.reshape(-1)

    def frame(self, a: int, b: int) -> np.ndarray:
        if self.flat is not None:
            f = self.flat[a:b]
            if f.ctypes.data % 8 == 0:
                return f
            out = self.scratch.typed(self.name, b - a, f.dtype)
            out[:] = f
            return out
        rows = self.rows
        assert rows is not None
        w = rows.shape[1]
        out = self.scratch.typed(self.name, b - a, rows.dtype)
        r0, c0 = divmod(a, w)
        r1, c1 = divmod(b, w)
        if c1 == 0:  # ends at a row end
            r1, c1 = r1 - 1, w
        if r0 == r1:
            out[:] = rows[r0, c0:c1]
            return out
        k = w - c0
        out[:k] = rows[r0, c0:]
        mid = (r1 - r0 - 1) * w
        out[k : k + mid].reshape(r1 - r0 - 1, w)[:] = rows[r0 + 1 : r1]
        out[k + mid :] = rows[r1, :c1]
        return out


def encode_stream_reference(
    base: np.ndarray | torch.Tensor,
    live: np.ndarray | torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    frame_blocks: int = DEFAULT_FRAME_BLOCKS,
) -> tuple[np.ndarray, DeltaStats]:
    """The delta turning `base` into `live` (any shapes and strides, row-major order)."""
    check_block(block, frame_blocks)
    b, lv = bits_view(base), bits_view(live)
    assert b.size == lv.size and b.dtype == lv.dtype
    sink, scratch = ByteSink(), Scratch()
    bases, lives = _Frames(b, scratch, "base_frame"), _Frames(lv, scratch, "live_frame")
    width, n = lv.dtype.itemsize, lv.size
    sink.reserve(STREAM_HEADER.itemsize)
    header = (STREAM_MAGIC, FORMAT_VERSION, width, 0, block, frame_blocks, n)
    sink.data().view(STREAM_HEADER)[0] = header
    changed, per_kind = 0, np.zeros(4, dtype=np.int64)
    step = block * frame_blocks
    for start in range(0, n, step):
        end = min(start + step, n)
        c, kinds = encode_frame(bases.frame(start, end), lives.frame(start, end), sink, block,
                                scratch)  # fmt: skip
        changed += c
        per_kind += np.bincount(kinds, minlength=4)
    out = sink.data().copy()
    return out, DeltaStats(n, changed, out.size, n * width, tuple(int(k) for k in per_kind))  # type: ignore[arg-type]


def apply_stream_reference(delta: np.ndarray, dst: np.ndarray | torch.Tensor) -> DeltaStats:
    """Apply a stream delta in place to `dst` (any strides, row-major order)."""
    target = bits_view(dst)
    head = read_bytes(delta, 0, STREAM_HEADER.itemsize, "stream header").view(STREAM_HEADER)[0]
    if bytes(head["magic"]) != STREAM_MAGIC or int(head["version"]) != FORMAT_VERSION:
        raise DeltaError("not a delta stream (bad magic or format version)")
    width, block = int(head["width"]), int(head["block"])
    n, frame_blocks = int(head["elements"]), int(head["frame_blocks"])
    if width != target.dtype.itemsize or n != target.size:
        raise DeltaError("delta cannot land in this destination")
    check_block(block, frame_blocks)
    flat, pos, changed = Target(target), STREAM_HEADER.itemsize, 0
    per_kind = np.zeros(4, dtype=np.int64)
    step = block * frame_blocks
    for start in range(0, n, step):
        used, c, kinds = apply_frame(delta, pos, flat, start, min(step, n - start), block,
                                     target.dtype)  # fmt: skip
        pos, changed = pos + used, changed + c
        per_kind += np.bincount(kinds, minlength=4)
    if pos != delta.size:
        raise DeltaError(f"{delta.size - pos} trailing bytes after the last frame")
    return DeltaStats(n, changed, pos, n * width, tuple(int(k) for k in per_kind))  # type: ignore[arg-type]


def encode_parts_reference(
    bases: list[np.ndarray | torch.Tensor], lives: list[np.ndarray | torch.Tensor]
) -> np.ndarray:
    """A container of the parts' reference stream deltas (magic, part count, sizes, streams)."""
    streams = [encode_stream_reference(b, lv)[0] for b, lv in zip(bases, lives, strict=True)]
    head = np.zeros(8 + 8 * len(streams), dtype=np.uint8)
    head[:4] = np.frombuffer(b"RDLP", dtype=np.uint8)
    head[4:8].view("<u4")[0] = len(streams)
    head[8:].view("<u8")[:] = [s.size for s in streams]
    padded = [np.concatenate([s, np.zeros(pad8(s.size) - s.size, np.uint8)]) for s in streams]
    return np.concatenate([head, *padded])

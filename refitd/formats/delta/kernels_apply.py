"""Compiled kernels of the delta codec, the apply half: a stream checked and applied.

The byte layout is streams.py's, the shared pieces kernels.py's. Every frame is checked in
full (kinds, counts against the bitmaps' populations, indices ascending and inside their
block, section sizes) before any element of it is written, so a malformed delta is an error
code (frames.py words it), never a write outside the destination; then its BITMAP and INDEX
values are scattered and its DENSE blocks copied, through the destination's layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from refitd.formats.delta.kernels import (
    BITMAP,
    DENSE,
    FRAME_HEADER_BYTES,
    INDEX,
    ONE,
    UNCHANGED,
    leading_zeros,
    pad8,
    popcount,
    trailing_zeros,
    unsigned,
)

# apply_stream's outcome codes (frames.py words them)
OK, TRUNCATED, BLOCK_COUNT, UNKNOWN_KIND, BAD_COUNTS, BAD_POPULATION = 0, 1, 2, 3, 4, 5
PAST_BLOCK, UNORDERED, BAD_SIZE, TRAILING = 6, 7, 8, 9


@njit(nogil=True, cache=True, inline="always")
def _u16(buf, p):  # type: ignore[no-untyped-def]
    return np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)


@njit(nogil=True, cache=True, inline="always")
def _bit_word(buf, at, nbytes, w):  # type: ignore[no-untyped-def]
    """64-bit word w of the bitmap of nbytes bytes at buf[at:] (little-endian bit order)."""
    m = np.uint64(0)
    o = at + 8 * w
    for q in range(min(8, nbytes - 8 * w)):
        m |= np.uint64(buf[o + q]) << np.uint64(8 * q)
    return m


@njit(nogil=True, cache=True)
def _check_blocks(buf, kinds_at, counts_at, nb, block, last, bits_at, idx_at, nidx):  # type: ignore[no-untyped-def]
    """The blocks of a frame whose offsets add up: each bitmap's population equals its count
    and sets no bit past its block; each index list ascends inside its block."""
    bbytes = block // 8
    indices = buf[idx_at : idx_at + 2 * nidx].view(np.uint16)
    b = bits_at
    i = 0
    for k in range(nb):
        kind = buf[kinds_at + k]
        c = _u16(buf, counts_at + 2 * k)
        ln = block if k < nb - 1 else last
        if kind == BITMAP:
            population = 0
            for w in range((bbytes + 7) // 8):
                m = _bit_word(buf, b, bbytes, w)
                population += popcount(m)
                if m and (w << 6) + 63 - leading_zeros(m) >= ln:
                    return PAST_BLOCK, k
            if population != c:
                return BAD_POPULATION, k
            b += bbytes
        elif kind == INDEX:
            x = indices[i : i + c]
            unordered = False
            for j in range(1, c):  # no early exit: the check vectorises
                unordered |= x[j] <= x[j - 1]
            if unordered:
                return UNORDERED, k
            if x[c - 1] >= ln:  # ascending, so the last one is the largest
                return PAST_BLOCK, k
            i += c
    return OK, np.int64(0)


@njit(nogil=True, cache=True)
def _check_frame(buf, pos, n, block, width, lay):  # type: ignore[no-untyped-def]
    """Check the frame at buf[pos:] against n elements in full; (code, detail) and its
    layout in lay: blocks; offsets of kinds, counts, bitmaps, indices and values; frame
    bytes; value elements; where the INDEX and the DENSE blocks' values start."""
    size = buf.size
    if pos + FRAME_HEADER_BYTES > size:
        return TRUNCATED, pos + FRAME_HEADER_BYTES
    head = buf[pos : pos + FRAME_HEADER_BYTES].view(np.uint64)
    nbytes = np.int64(head[0])
    nb = np.int64(head[1] & np.uint64(0xFFFFFFFF))
    if nb != (n + block - 1) // block:
        return BLOCK_COUNT, nb
    if nbytes < 0 or pos + nbytes > size:
        return TRUNCATED, pos + max(nbytes, 0)
    end = pos + nbytes
    kinds_at = pos + FRAME_HEADER_BYTES
    counts_at = kinds_at + pad8(nb)
    at = counts_at + pad8(2 * nb)
    if kinds_at + nb > end or counts_at + 2 * nb > end:
        return TRUNCATED, counts_at + 2 * nb
    last = n - (nb - 1) * block
    nbits = nidx = nvals = nbitmap_values = 0
    for k in range(nb):
        kind = buf[kinds_at + k]
        c = _u16(buf, counts_at + 2 * k)
        ln = block if k < nb - 1 else last
        if kind > DENSE:
            return UNKNOWN_KIND, np.int64(kind)
        if c > ln or (kind == UNCHANGED and c != 0):
            return BAD_COUNTS, k
        if kind == BITMAP:
            nbits += 1
            nvals += c
            nbitmap_values += c
        elif kind == INDEX:
            nidx += c
            nvals += c
        elif kind == DENSE:
            nvals += ln
    bbytes = block // 8
    bits_at = at
    idx_at = bits_at + nbits * bbytes
    values_at = pad8(idx_at + 2 * nidx)
    if idx_at + 2 * nidx > end or values_at + nvals * width > end:
        return TRUNCATED, values_at + nvals * width
    if pad8(values_at + nvals * width) != end:
        return BAD_SIZE, nbytes
    code, detail = _check_blocks(buf, kinds_at, counts_at, nb, block, last, bits_at, idx_at, nidx)
    if code != OK:
        return code, detail
    lay[0] = nb
    lay[1] = kinds_at
    lay[2] = counts_at
    lay[3] = bits_at
    lay[4] = idx_at
    lay[5] = values_at
    lay[6] = nbytes
    lay[7] = nvals
    lay[8] = nbitmap_values
    lay[9] = nbitmap_values + nidx
    return OK, 0


@njit(nogil=True, cache=True)
def _scatter(dst, a, n, positions, count, values, v):  # type: ignore[no-untyped-def]
    """values[v : v + count] into the elements a + positions[j] (ascending, < n) of a layout:
    directly where the block [a, a + n) lies in one row of step 1, else row by row."""
    flat, rows, width, step = dst
    r = a // width
    c = a - r * width
    if step == 1 and c + n <= width:
        d = flat[rows[r] + c : rows[r] + c + n]
        for j in range(count):
            d[unsigned(positions[j])] = values[unsigned(v + j)]
        return
    q = 0  # the block position the cursor (r, c) is at
    for j in range(count):
        c += positions[j] - q
        q = positions[j]
        if c >= width:
            r += c // width
            c = c % width
        flat[rows[r] + c * step] = values[v + j]


@njit(nogil=True, cache=True)
def _write_run(dst, a, n, values, v):  # type: ignore[no-untyped-def]
    """values[v : v + n] into the elements [a, a + n) of a layout."""
    flat, rows, width, step = dst
    r = a // width
    c = a - r * width
    k = 0
    while k < n:
        take = min(width - c, n - k)
        o = rows[r] + c * step
        if step == 1:
            flat[o : o + take] = values[v + k : v + k + take]
        else:
            for j in range(take):
                flat[o + j * step] = values[v + k + j]
        k += take
        r += 1
        c = 0


@njit(nogil=True, cache=True)
def _apply_frame(buf, lay, dst, start, n, block, positions, tally):  # type: ignore[no-untyped-def]
    """Apply the frame _check_frame accepted (its offsets in lay); returns changed elements."""
    flat = dst[0]
    nb, kinds_at, counts_at, bits_at, idx_at, values_at = lay[:6]
    width = flat.itemsize
    values = buf[values_at : values_at + lay[7] * width].view(flat.dtype)
    bbytes = block // 8
    indices = buf[idx_at : idx_at + 2 * (lay[9] - lay[8])].view(np.uint16)
    b = bits_at
    i = 0
    vb, vi, vd = 0, lay[8], lay[9]  # BITMAP, INDEX and DENSE blocks' values, in block order
    changed = 0
    for k in range(nb):
        kind = buf[kinds_at + k]
        tally[kind] += 1
        if kind == UNCHANGED:
            continue
        c = _u16(buf, counts_at + 2 * k)
        a = k * block
        ln = min(block, n - a)
        changed += c
        if kind == DENSE:
            _write_run(dst, start + a, ln, values, vd)
            vd += ln
        elif kind == INDEX:
            _scatter(dst, start + a, ln, indices[i : i + c], c, values, vi)
            i += c
            vi += c
        else:
            p = 0
            for w in range((bbytes + 7) // 8):
                m = _bit_word(buf, b, bbytes, w)
                while m:
                    positions[p] = (w << 6) + trailing_zeros(m)
                    p += 1
                    m &= m - ONE
            b += bbytes
            _scatter(dst, start + a, ln, positions, c, values, vb)
            vb += c
    return changed


@njit(nogil=True, cache=True)
def apply_stream(buf, pos, dst, first, n, block, frame_blocks, tally):  # type: ignore[no-untyped-def]
    """Apply the frames at buf[pos:] (the rest of buf) to the n elements of the destination
    layout from element `first` on, each frame checked in full before it is written; returns
    (code, detail, byte position, changed elements) and adds the blocks per kind to tally."""
    lay = np.zeros(10, np.int64)
    positions = np.empty(block, np.int64)
    width = dst[0].itemsize
    step = block * frame_blocks
    changed = 0
    start = first
    while start < first + n:
        fn = min(step, first + n - start)
        code, detail = _check_frame(buf, pos, fn, block, width, lay)
        if code != OK:
            return code, detail, pos, changed
        changed += _apply_frame(buf, lay, dst, start, fn, block, positions, tally)
        pos += lay[6]
        start += fn
    if pos != buf.size:
        return TRAILING, buf.size - pos, pos, changed
    return OK, 0, pos, changed

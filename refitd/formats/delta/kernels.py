"""Compiled kernels of the delta codec: a frame encoded, a stream applied, each in one pass.

numba compiles them on first use per element width (and caches the machine code on disk,
next to this file or in NUMBA_CACHE_DIR), so a frame is found, chosen and written without
a NumPy temporary per step: each block of base and live is compared into 64-bit change masks
while it is in L1 cache (the compare loop vectorises), and only the set bits are visited
(count trailing zeros) to write in-block indices, bitmaps and values. The byte layout is
streams.py's; every function here writes exactly what that layout says.

Memory comes in as a *layout* (streams.Layout): the flat storage an array lies in, the
element offset of each row's first element, the row length and the element step within a
row, so strided sources and destinations are read and written in place. The kernels release
the GIL. They trust their arguments' sizes (the callers in streams.py check them), and the
apply kernel checks every frame in full before writing any element of it, so a malformed
delta is an error, never a write outside the destination.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

UNCHANGED, BITMAP, INDEX, DENSE = 0, 1, 2, 3
FRAME_HEADER_BYTES = 16

# apply_stream's outcome codes (streams.APPLY_ERRORS words them)
OK, TRUNCATED, BLOCK_COUNT, UNKNOWN_KIND, BAD_COUNTS, BAD_POPULATION = 0, 1, 2, 3, 4, 5
PAST_BLOCK, UNORDERED, BAD_SIZE, TRAILING = 6, 7, 8, 9

_ONE = np.uint64(1)
_TOP = np.uint64(1 << 63)


@intrinsic
def _trailing_zeros(typingctx, word):  # type: ignore[no-untyped-def]
    """Trailing zero bits of a nonzero uint64 (one tzcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(types.uint64), codegen


@intrinsic
def _leading_zeros(typingctx, word):  # type: ignore[no-untyped-def]
    """Leading zero bits of a nonzero uint64 (one lzcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(types.uint64), codegen


@intrinsic
def _popcount(typingctx, word):  # type: ignore[no-untyped-def]
    """Set bits of a uint64 (one popcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen


@njit(nogil=True, cache=True, inline="always")
def _u(i):  # type: ignore[no-untyped-def]
    """An index known not to be negative, as unsigned: numba then emits no wraparound code
    for it (which would keep the loops around it from being vectorised or scheduled well)."""
    return np.uint64(i)


@njit(nogil=True, cache=True, inline="always")
def _pad8(n):  # type: ignore[no-untyped-def]
    return (n + 7) & ~7


@njit(nogil=True, cache=True, inline="always")
def _kind(changed, length, block, width):  # type: ignore[no-untyped-def]
    """The cheapest encoding of a block (ties go to the simpler one): streams.py's rule."""
    if changed == 0:
        return UNCHANGED
    bitmap_cost = block // 8 + changed * width
    index_cost = changed * (2 + width)
    if length * width <= min(bitmap_cost, index_cost):
        return DENSE
    return INDEX if index_cost <= bitmap_cost else BITMAP


@njit(nogil=True, cache=True)
def _gather(flat, rows, width, step, a, n, scratch):  # type: ignore[no-untyped-def]
    """Elements [a, a + n) of a layout copied into scratch[:n], row by row."""
    r = a // width
    c = a - r * width
    k = 0
    while k < n:
        take = min(width - c, n - k)
        o = rows[r] + c * step
        if step == 1:
            scratch[k : k + take] = flat[o : o + take]
        else:
            for j in range(take):
                scratch[np.uint64(k + j)] = flat[np.uint64(o + j * step)]
        k += take
        r += 1
        c = 0


@njit(nogil=True, cache=True)
def _words(flat, rows, width, step, a, n, scratch, offsets):  # type: ignore[no-untyped-def]
    """The block [a, a + n) of a layout as 64-element words: (array, offsets) such that
    word w is array[offsets[w] : offsets[w] + 64]. In place where every word lies in one
    row of step 1 (a contiguous array, or rows of a multiple of 64 elements), else the
    block is gathered into scratch first."""
    if step == 1:
        r = a // width
        c = a - r * width
        ok = True
        for w in range((n + 63) >> 6):
            if c + min(64, n - (w << 6)) > width:
                ok = False
                break
            offsets[w] = rows[r] + c
            c += 64
            if c >= width:
                r += 1
                c -= width
        if ok:
            return flat
    _gather(flat, rows, width, step, a, n, scratch)
    for w in range((n + 63) >> 6):
        offsets[w] = w << 6
    return scratch


@njit(nogil=True, cache=True)
def _mask(b, boffsets, lv, loffsets, n, masks):  # type: ignore[no-untyped-def]
    """Bit j of masks[w] set where element 64 w + j of the block differs between base and
    live (bit patterns); masks past n are zeroed. Returns the number of changed elements.
    Words are compared through slices (no index wraparound), so the loop vectorises."""
    changed = 0
    full = n >> 6
    for w in range(full):
        bw = b[boffsets[w] : boffsets[w] + 64]
        lw = lv[loffsets[w] : loffsets[w] + 64]
        m = np.uint64(0)
        for j in range(64):
            m |= np.uint64(bw[j] != lw[j]) << np.uint64(j)
        masks[w] = m
        changed += _popcount(m)
    used = full
    if n > full << 6:
        rest = n - (full << 6)
        bw = b[boffsets[full] : boffsets[full] + rest]
        lw = lv[loffsets[full] : loffsets[full] + rest]
        m = np.uint64(0)
        for j in range(rest):
            m |= np.uint64(bw[j] != lw[j]) << np.uint64(j)
        masks[full] = m
        changed += _popcount(m)
        used += 1
    for w in range(used, masks.size):
        masks[w] = 0
    return changed


@njit(nogil=True, cache=True, inline="always")
def _emit(masks, n, lv, loffs, idx, values, k, index):  # type: ignore[no-untyped-def]
    """The changed elements of a block of n, in order: their values into values[k:] and,
    with index, their in-block positions into idx[k:]; returns the new k. A whole word
    with at most 4 (8) changes is written in 4 (8) unconditional steps (the arrays keep room
    for 8 more entries), so the loop does not mispredict on every word's count of changes."""
    full = n >> 6
    for w in range((n + 63) >> 6):
        m = masks[w]
        if m == 0:
            continue
        o = loffs[w]
        count = _popcount(m)
        if w < full and count <= 8:
            for q in range(8):
                if q == 4 and count <= 4:
                    break
                j = _trailing_zeros(m | _TOP)  # 63 past the last change: inside the word
                if index:
                    idx[_u(k + q)] = (w << 6) + j
                values[_u(k + q)] = lv[_u(o + j)]
                m &= m - _ONE
            k += count
            continue
        while m:
            j = _trailing_zeros(m)
            if index:
                idx[_u(k)] = (w << 6) + j
            values[_u(k)] = lv[_u(o + j)]
            k += 1
            m &= m - _ONE
    return k


@njit(nogil=True, cache=True)
def encode_frame(base, live, start, n, block, work, out, tally):  # type: ignore[no-untyped-def]
    """Write the frame of elements [start, start + n) into out (room for the largest frame:
    frames.frame_capacity); returns (frame bytes, changed elements) and adds its blocks per
    kind to tally. base / live: (flat, rows, row length, step) layouts; work: scratch
    (frames.encode_work)."""
    bflat, brows, bwidth, bstep = base
    lflat, lrows, lwidth, lstep = live
    bblk, lblk, boffs, loffs, masks, bits, idx, vbm, vix, kinds, counts = work
    width = lflat.itemsize
    nb = (n + block - 1) // block
    bbytes = block // 8
    mask_bytes = masks.view(np.uint8)
    nbits = nidx = nvbm = ndense = changed = 0
    for k in range(nb):
        a = k * block
        ln = min(block, n - a)
        bv = _words(bflat, brows, bwidth, bstep, start + a, ln, bblk, boffs)
        lv = _words(lflat, lrows, lwidth, lstep, start + a, ln, lblk, loffs)
        c = _mask(bv, boffs, lv, loffs, ln, masks)
        kind = _kind(c, ln, block, width)
        kinds[k] = kind
        counts[k] = c
        tally[kind] += 1
        changed += c
        if kind == BITMAP:
            bits[nbits * bbytes : (nbits + 1) * bbytes] = mask_bytes[:bbytes]
            nbits += 1
            nvbm = _emit(masks, ln, lv, loffs, idx, vbm, nvbm, False)
        elif kind == INDEX:
            nidx = _emit(masks, ln, lv, loffs, idx, vix, nidx, True)
        elif kind == DENSE:
            ndense += ln
    at = FRAME_HEADER_BYTES + _pad8(nb) + _pad8(2 * nb) + nbits * bbytes
    values_at = _pad8(at + 2 * nidx)
    total = _pad8(values_at + (nvbm + nidx + ndense) * width)
    out[:values_at] = 0
    head = out[:FRAME_HEADER_BYTES].view(np.uint64)
    head[0] = total
    head[1] = nb  # u32 blocks, u32 0
    p = FRAME_HEADER_BYTES
    out[p : p + nb] = kinds[:nb]
    p += _pad8(nb)
    out[p : p + 2 * nb].view(np.uint16)[:] = counts[:nb]
    p += _pad8(2 * nb)
    out[p : p + nbits * bbytes] = bits[: nbits * bbytes]
    p += nbits * bbytes
    out[p : p + 2 * nidx].view(np.uint16)[:] = idx[:nidx]
    values = out[values_at : values_at + (nvbm + nidx + ndense) * width].view(lflat.dtype)
    values[:nvbm] = vbm[:nvbm]
    values[nvbm : nvbm + nidx] = vix[:nidx]
    v = nvbm + nidx
    for k in range(nb):
        if kinds[k] == DENSE:
            a = k * block
            ln = min(block, n - a)
            _gather(lflat, lrows, lwidth, lstep, start + a, ln, values[v : v + ln])
            v += ln
    out[values_at + v * width : total] = 0
    return total, changed


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
    counts_at = kinds_at + _pad8(nb)
    at = counts_at + _pad8(2 * nb)
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
    values_at = _pad8(idx_at + 2 * nidx)
    if idx_at + 2 * nidx > end or values_at + nvals * width > end:
        return TRUNCATED, values_at + nvals * width
    if _pad8(values_at + nvals * width) != end:
        return BAD_SIZE, nbytes
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
                population += _popcount(m)
                if m and (w << 6) + 63 - _leading_zeros(m) >= ln:
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
            d[_u(positions[j])] = values[_u(v + j)]
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
                    positions[p] = (w << 6) + _trailing_zeros(m)
                    p += 1
                    m &= m - _ONE
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

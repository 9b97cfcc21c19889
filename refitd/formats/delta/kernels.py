"""Compiled kernels of the delta codec: a frame encoded in one pass (kernels_apply.py: applied).

numba compiles them on first use per element width (and caches the machine code on disk,
next to this file or in NUMBA_CACHE_DIR), so a frame is found, chosen and written without
a NumPy temporary per step: each block of base and live is compared into 64-bit change masks
while it is in L1 cache (the compare loop vectorises), and only the set bits are visited
(count trailing zeros) to write in-block indices, bitmaps and values. The byte layout is
streams.py's; every function here writes exactly what that layout says.

Memory comes in as a *layout* (frames.Layout): the flat storage an array lies in, the
element offset of each row's first element, the row length and the element step within a
row, so strided sources and destinations are read and written in place. The kernels release
the GIL and trust their arguments' sizes (the callers in frames.py check them).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

UNCHANGED, BITMAP, INDEX, DENSE = 0, 1, 2, 3
FRAME_HEADER_BYTES = 16

ONE = np.uint64(1)
_TOP = np.uint64(1 << 63)


@intrinsic
def trailing_zeros(typingctx, word):  # type: ignore[no-untyped-def]
    """Trailing zero bits of a nonzero uint64 (one tzcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(types.uint64), codegen


@intrinsic
def leading_zeros(typingctx, word):  # type: ignore[no-untyped-def]
    """Leading zero bits of a nonzero uint64 (one lzcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(types.uint64), codegen


@intrinsic
def popcount(typingctx, word):  # type: ignore[no-untyped-def]
    """Set bits of a uint64 (one popcnt)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen


@njit(nogil=True, cache=True, inline="always")
def unsigned(i):  # type: ignore[no-untyped-def]
    """An index known not to be negative, as unsigned: numba then emits no wraparound code
    for it (which would keep the loops around it from being vectorised or scheduled well)."""
    return np.uint64(i)


@njit(nogil=True, cache=True, inline="always")
def pad8(n):  # type: ignore[no-untyped-def]
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
        changed += popcount(m)
    used = full
    if n > full << 6:
        rest = n - (full << 6)
        bw = b[boffsets[full] : boffsets[full] + rest]
        lw = lv[loffsets[full] : loffsets[full] + rest]
        m = np.uint64(0)
        for j in range(rest):
            m |= np.uint64(bw[j] != lw[j]) << np.uint64(j)
        masks[full] = m
        changed += popcount(m)
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
        count = popcount(m)
        if w < full and count <= 8:
            for q in range(8):
                if q == 4 and count <= 4:
                    break
                j = trailing_zeros(m | _TOP)  # 63 past the last change: inside the word
                if index:
                    idx[unsigned(k + q)] = (w << 6) + j
                values[unsigned(k + q)] = lv[unsigned(o + j)]
                m &= m - ONE
            k += count
            continue
        while m:
            j = trailing_zeros(m)
            if index:
                idx[unsigned(k)] = (w << 6) + j
            values[unsigned(k)] = lv[unsigned(o + j)]
            k += 1
            m &= m - ONE
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
    at = FRAME_HEADER_BYTES + pad8(nb) + pad8(2 * nb) + nbits * bbytes
    values_at = pad8(at + 2 * nidx)
    total = pad8(values_at + (nvbm + nidx + ndense) * width)
    out[:values_at] = 0
    head = out[:FRAME_HEADER_BYTES].view(np.uint64)
    head[0] = total
    head[1] = nb  # u32 blocks, u32 0
    p = FRAME_HEADER_BYTES
    out[p : p + nb] = kinds[:nb]
    p += pad8(nb)
    out[p : p + 2 * nb].view(np.uint16)[:] = counts[:nb]
    p += pad8(2 * nb)
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

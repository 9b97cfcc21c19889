"""Grouped Triton kernels: one launch lands many regions (imported through refitd.formats.grouped).

Every kernel reads two tables prepared once per program: `seg` (int64 rows, one per region:
element offsets from the base pointers, sizes, strides) and `work` (int32 pairs, one per
program: region index, tile index within the region), so one launch covers every region of
a refit step and the host does O(1) work per refit. Offsets are relative to base tensors
passed as arguments (no integer-to-pointer casts). In an aligned group every offset, row
stride and row length is a multiple of 16 bytes and is stored divided by the constexpr
factor (XA, QA, CA, WA) that the kernel multiplies back: the compiler then knows the
alignment and uses 16-byte accesses, as it does for the per-tensor kernels' arguments.

The tiles are the per-tensor kernels' own (refitd.formats._triton_jit), so the grouped
quantizers are bit-identical to them. The copy kernel optionally hashes what it reads from
the source and, after storing, what the destination then holds (a volatile load, so the
value comes back from the memory system, not from registers): the 64-bit positional
checksum of refitd.executor.checksums, as per-program partial sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from refitd.formats._triton_jit import fp8_block_tile, mxfp8_tile, word_tile_hash

# int64 fields of one region's row in the segment table, per kernel
MX_FIELDS = ("x_off", "q_off", "s_off", "M", "C", "n_c", "sxm", "sqm", "ssm")
FB_FIELDS = (
    "x_off",
    "q_off",
    "s_off",
    "R",
    "C",
    "TR",
    "TC",
    "sxb",
    "sxr",
    "sqb",
    "sqr",
    "ssb",
    "ssr",
)
COPY_FIELDS = ("s_off", "d_off", "n_rows", "row_words", "s_stride", "d_stride", "total", "n_c")


@triton.jit
def mxfp8_grouped_kernel(
    x_base,
    q_base,
    s_base,
    seg_ptr,
    work_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    XA: tl.constexpr,
    QA: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 9
    x_off = tl.load(row) * XA
    q_off = tl.load(row + 1) * QA
    s_off = tl.load(row + 2)
    M = tl.load(row + 3)
    C = tl.load(row + 4) * QA  # QA > 1: C is a multiple of 16
    n_c = tl.load(row + 5)
    sxm = tl.load(row + 6) * XA
    sqm = tl.load(row + 7) * QA
    ssm = tl.load(row + 8)
    mxfp8_tile(
        x_base + x_off, q_base + q_off, s_base + s_off, M, C, (C + 31) // 32,
        lp // n_c, lp % n_c, sxm, 1, sqm, 1, ssm, 1, BLOCK_M, BLOCK_C, SRC_BF16, FAST,
    )  # fmt: skip


@triton.jit
def fp8_block_grouped_kernel(
    x_base,
    q_base,
    s_base,
    seg_ptr,
    work_ptr,
    SUB_R: tl.constexpr,
    TILE: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    XA: tl.constexpr,
    QA: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 13
    x_off = tl.load(row) * XA
    q_off = tl.load(row + 1) * QA
    s_off = tl.load(row + 2)
    R = tl.load(row + 3)
    C = tl.load(row + 4) * QA
    TR = tl.load(row + 5)
    TC = tl.load(row + 6)
    sxb = tl.load(row + 7) * XA
    sxr = tl.load(row + 8) * XA
    sqb = tl.load(row + 9) * QA
    sqr = tl.load(row + 10) * QA
    ssb = tl.load(row + 11)
    ssr = tl.load(row + 12)
    tc = lp % TC
    rest = lp // TC
    tr = rest % TR
    b = rest // TR
    fp8_block_tile(
        x_base + x_off + b * sxb, q_base + q_off + b * sqb,
        s_base + s_off + b * ssb + tr * ssr + tc,
        R, C, tr, tc, sxr, 1, sqr, 1, SUB_R, TILE, SRC_BF16, FAST,
    )  # fmt: skip


@triton.jit
def copy_hash_kernel(
    src_base,
    dst_base,
    seg_ptr,
    work_ptr,
    out_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    COPY: tl.constexpr,
    HASH_SRC: tl.constexpr,
    HASH_DST: tl.constexpr,
    WA: tl.constexpr,
):
    """Regions as rows of 32-bit words: copy src -> dst and/or hash either side.
    out[pid, 0] / out[pid, 1]: partial checksum of this program's words of src / dst."""
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 8
    s_off = tl.load(row) * WA
    d_off = tl.load(row + 1) * WA
    n_rows = tl.load(row + 2)
    row_words = tl.load(row + 3) * WA
    s_stride = tl.load(row + 4) * WA
    d_stride = tl.load(row + 5) * WA
    total = tl.load(row + 6) * WA
    n_c = tl.load(row + 7)
    r0 = lp // n_c * BLOCK_R
    c0 = lp % n_c * BLOCK_W
    r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)[:, None]
    c = c0 + tl.arange(0, BLOCK_W).to(tl.int64)[None, :]
    mask = (r < n_rows) & (c < row_words) & (r * row_words + c < total)
    i0 = r0 * row_words + c0
    dr = tl.arange(0, BLOCK_R)[:, None]
    dc = tl.arange(0, BLOCK_W)
    if HASH_SRC or COPY:
        x = tl.load(src_base + s_off + r * s_stride + c, mask=mask, other=0)
        if HASH_SRC:
            tl.store(out_ptr + 2 * pid, word_tile_hash(x, i0, row_words, dr, dc))
        if COPY:
            tl.store(dst_base + d_off + r * d_stride + c, x, mask=mask)
    if HASH_DST:
        y = tl.load(dst_base + d_off + r * d_stride + c, mask=mask, other=0, volatile=True)
        tl.store(out_ptr + 2 * pid + 1, word_tile_hash(y, i0, row_words, dr, dc))


def launch(kernel: triton.JITFunction, n_programs: int, *args, **meta) -> None:
    kernel[(n_programs,)](*args, **meta)

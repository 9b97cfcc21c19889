"""Grouped Triton kernels: one launch lands many regions (imported through refitd.formats.grouped).

Every kernel reads two tables prepared once per program: `seg` (int64 rows, one per region:
element offsets from the base pointers, sizes, strides) and `work` (int32 pairs, one per
program: region index, tile index within the region), so one launch covers every region of
a refit step and the host does O(1) work per refit. Offsets are relative to base tensors
passed as arguments (no integer-to-pointer casts); with ALIGNED every offset and row stride
is a multiple of 16 bytes, which lets the compiler use 16-byte accesses.

The tiles are the per-tensor kernels' own (refitd.formats._triton_jit), so the grouped
quantizers are bit-identical to them. The copy kernel optionally hashes what it reads from
the source and, after storing, what the destination then holds (a volatile load, so the
value comes back from the memory system, not from registers): the 64-bit positional
checksum of refitd.agent.checksums, as per-program partial sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from refitd.formats._triton_jit import fp8_block_tile, mxfp8_tile

# 2 * 0x9E3779B97F4A7C15 mod 2**64 (refitd.agent.checksums.A), positive as an int64
TWO_A = 0x3C6EF372FE94F82A

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
def _hint(v, ALIGNED: tl.constexpr, N: tl.constexpr):
    if ALIGNED:
        v = tl.multiple_of(v, N)
    return v


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
    ALIGNED: tl.constexpr,
    XA: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 9
    x_off = _hint(tl.load(row), ALIGNED, XA)
    q_off = _hint(tl.load(row + 1), ALIGNED, 16)
    s_off = tl.load(row + 2)
    M = tl.load(row + 3)
    C = tl.load(row + 4)
    n_c = tl.load(row + 5)
    sxm = _hint(tl.load(row + 6), ALIGNED, XA)
    sqm = _hint(tl.load(row + 7), ALIGNED, 16)
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
    ALIGNED: tl.constexpr,
    XA: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 13
    x_off = _hint(tl.load(row), ALIGNED, XA)
    q_off = _hint(tl.load(row + 1), ALIGNED, 16)
    s_off = tl.load(row + 2)
    R = tl.load(row + 3)
    C = tl.load(row + 4)
    TR = tl.load(row + 5)
    TC = tl.load(row + 6)
    sxb = tl.load(row + 7)
    sxr = _hint(tl.load(row + 8), ALIGNED, XA)
    sqb = tl.load(row + 9)
    sqr = _hint(tl.load(row + 10), ALIGNED, 16)
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
    ALIGNED: tl.constexpr,
):
    """Regions as rows of 32-bit words: copy src -> dst and/or hash either side.
    out[pid, 0] / out[pid, 1]: partial checksum of this program's words of src / dst."""
    pid = tl.program_id(0)
    seg = tl.load(work_ptr + 2 * pid).to(tl.int64)
    lp = tl.load(work_ptr + 2 * pid + 1)
    row = seg_ptr + seg * 8
    s_off = _hint(tl.load(row), ALIGNED, 4)
    d_off = _hint(tl.load(row + 1), ALIGNED, 4)
    n_rows = tl.load(row + 2)
    row_words = _hint(tl.load(row + 3), ALIGNED, 4)
    s_stride = _hint(tl.load(row + 4), ALIGNED, 4)
    d_stride = _hint(tl.load(row + 5), ALIGNED, 4)
    total = tl.load(row + 6)
    n_c = tl.load(row + 7)
    r = (lp // n_c * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = (lp % n_c * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)[None, :]
    idx = r * row_words + c
    mask = (r < n_rows) & (c < row_words) & (idx < total)
    weight = idx * TWO_A + 1  # wraps mod 2**64, as the CPU checksum does
    if HASH_SRC or COPY:
        x = tl.load(src_base + s_off + r * s_stride + c, mask=mask, other=0)
        if HASH_SRC:
            tl.store(out_ptr + 2 * pid, tl.sum(tl.sum(x.to(tl.int64) * weight, axis=1), axis=0))
        if COPY:
            tl.store(dst_base + d_off + r * d_stride + c, x, mask=mask)
    if HASH_DST:
        y = tl.load(dst_base + d_off + r * d_stride + c, mask=mask, other=0, volatile=True)
        tl.store(out_ptr + 2 * pid + 1, tl.sum(tl.sum(y.to(tl.int64) * weight, axis=1), axis=0))


def launch(kernel: triton.JITFunction, n_programs: int, *args, **meta) -> None:
    kernel[(n_programs,)](*args, **meta)

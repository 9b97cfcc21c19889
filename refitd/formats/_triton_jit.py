"""Triton kernels for the quantizers (imported only through refitd.formats.triton_kernels).

Bit-identity with the torch reference does not rest on the GPU's float rounding modes:
amax, the E8M0 exponent and the E4M3 rounding (nearest, ties to even, saturating) are done
in integer arithmetic on IEEE bit patterns; the MXFP8 power-of-two scaling is an exponent
add; the block-FP8 divisions are IEEE (div_rn, or float64 for tiles with amax < 2^-100
where flush-to-zero of subnormals could otherwise change a result).
FAST=True swaps the integer E4M3 rounding for the hardware cvt.rn.satfinite (sm_89+), after
an exact float32 scaling; the benchmark and the gpu tests check both variants bit for bit.
The NVFP4 kernels live in refitd.formats._triton_nvfp4.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_code(biased, mant, sign):
    """E4M3 code of sign * 1.mant * 2^(biased - 127) (biased may be <= 0), RNE, saturating."""
    biased = tl.minimum(biased, 136)
    a = tl.minimum((tl.maximum(biased, 0) << 23) | mant, 0x43E00000)  # clamp to 448
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - 960  # rebias 127 -> 7, keep 3 mantissa bits
    # below 2^-6: multiples of 2^-9, sig24 >> (141 - biased) with ties to even
    sig = mant | 0x800000
    shift = tl.minimum(tl.maximum(141 - biased, 21), 30)
    one = shift * 0 + 1
    q = sig >> shift
    rem = sig & ((one << shift) - 1)
    half = one << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    return tl.where(biased >= 121, normal, q) | sign


@triton.jit
def _load_f32_bits(ptrs, mask, SRC_BF16: tl.constexpr):
    """IEEE float32 bits of the loaded values; bf16 (passed as int16) is widened by a shift,
    which keeps bf16 subnormals exact on every backend (the interpreter flushes them)."""
    if SRC_BF16:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    return bits


# 2 * 0x9E3779B97F4A7C15 mod 2**64 (refitd.executor.checksums.A), positive as an int64
TWO_A = tl.constexpr(0x3C6EF372FE94F82A)


@triton.jit
def _col_sums16(v, dr):
    """Per-column sums over axis 0 of int32 values |v| <= 2**16: (sum v, sum dr * v), dr
    the row index along axis 0. Exact in int32 for up to 256 rows (|sum dr * v| <=
    256 * 255 / 2 * 2**16 < 2**31). In the copy kernel's default tile a thread holds whole
    columns, so these sums cost an add and a multiply-add per element, no cross-thread
    traffic."""
    tl.static_assert(v.shape[0] <= 256)
    return tl.sum(v, axis=0), tl.sum(v * dr, axis=0)


@triton.jit
def word_tile_hash(x, i0, row_words, dr, dc):
    """sum x * (2A * i + 1) mod 2**64 over a tile of int32 words x (0 where masked) whose
    element (dr, dc) is word i = i0 + dr * row_words + dc of its region. Per column, S =
    sum x and R = sum dr * x (from the 16-bit halves x = hi * 2**16 + lo, _col_sums16), so
    the column adds S * (2A * (i0 + dc) + 1) + R * 2A * row_words: int64 work per column,
    not per element, and one cross-thread reduction. dr: the row index along axis 0; dc:
    the column index, shaped like x without axis 0."""
    c_lo, r_lo = _col_sums16(x & 0xFFFF, dr)
    c_hi, r_hi = _col_sums16(x >> 16, dr)
    s = (c_hi.to(tl.int64) << 16) + c_lo
    r = (r_hi.to(tl.int64) << 16) + r_lo
    w = (i0.to(tl.int64) * TWO_A + 1) + dc.to(tl.int64) * TWO_A
    return tl.sum(s * w + r * (row_words.to(tl.int64) * TWO_A))


@triton.jit
def _lane_sums16(v, lane):
    """(sum v, sum lane * v) over the last axis of int32 values |v| <= 2**16, lane the index
    along it: exact in int32 for up to 128 lanes (|sum lane * v| <= 128 * 127 / 2 * 2**16)."""
    tl.static_assert(v.shape[len(v.shape) - 1] <= 128)
    axis: tl.constexpr = len(v.shape) - 1
    return tl.sum(v, axis=axis), tl.sum(v * lane, axis=axis)


@triton.jit
def _bits_hash(bits, kg, lane, SRC_BF16: tl.constexpr):
    """This tile's share of the checksum of refitd.executor.checksums over the source's
    bytes: `bits` as _load_f32_bits returned them (0 where masked), in groups along the last
    axis: the element at lane l (`lane`, the index along it) of a group has row-major index
    kg + l in the region (`kg`: int64, one per group). A float32 element is word k; a bf16
    element is the low (k even, zero-extended) or the high (k odd, sign-extended) half of
    word k // 2. Each group's sums are int32 (_lane_sums16, of 16-bit values), then weighted
    in int64, wrapping mod 2**64 as the checksum's arithmetic does."""
    if SRC_BF16:
        # lane l holds half (b + l) % 2 of word kg // 2 + (b + l) // 2, b = kg % 2
        b = (kg & 1).to(tl.int32)
        odd = (tl.expand_dims(b, len(b.shape)) + lane) & 1
        half = bits >> 16
        s_lo, u_lo = _lane_sums16(half & 0xFFFF & (odd - 1), lane)
        s_hi, u_hi = _lane_sums16(half & -odd, lane)
        # sum v * ((b + l) // 2): each v * (b + l) is even for the low halves, each
        # v * (b + l - 1) for the high ones, so the halving is exact (and fits in int32)
        q_lo = (b * s_lo + u_lo) >> 1
        q_hi = ((b - 1) * s_hi + u_hi) >> 1
        s = s_lo.to(tl.int64) + (s_hi.to(tl.int64) << 16)
        q = q_lo.to(tl.int64) + (q_hi.to(tl.int64) << 16)
        h = s * ((kg >> 1) * TWO_A + 1) + q * TWO_A
    else:
        s_lo, u_lo = _lane_sums16(bits & 0xFFFF, lane)
        s_hi, u_hi = _lane_sums16(bits >> 16, lane)
        s = s_lo.to(tl.int64) + (s_hi.to(tl.int64) << 16)
        u = u_lo.to(tl.int64) + (u_hi.to(tl.int64) << 16)
        h = s * (kg * TWO_A + 1) + u * TWO_A
    return tl.sum(h)


@triton.jit
def mxfp8_tile(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    C,
    NB,
    pid_m,
    pid_c,
    sxm,
    sxc,
    sqm,
    sqc,
    ssm,
    ssc,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    HASH: tl.constexpr = False,
):
    """One (BLOCK_M x BLOCK_C) tile of an MXFP8 quantization (shared by the per-tensor and
    the grouped kernels, so both compute the same codes); with HASH, returns the tile's
    share of the checksum of the source region's bytes (_bits_hash), else 0."""
    NBB: tl.constexpr = BLOCK_C // 32
    srows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    rows = srows[:, :, None]
    blk = pid_c * NBB + tl.arange(0, NBB)
    cols = blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rows < M) & (cols < C)
    bits = _load_f32_bits(x_ptr + rows * sxm + cols * sxc, mask, SRC_BF16)
    h = tl.zeros((1,), dtype=tl.int64)
    if HASH:
        kg = srows * C + blk[None, :] * 32  # each 32-element block's first index
        h += _bits_hash(bits, kg, tl.arange(0, 32)[None, None, :], SRC_BF16)
    absb = bits & 0x7FFFFFFF
    amax = tl.max(absb, axis=2)
    nonfinite = amax >= 0x7F800000
    sbyte = tl.maximum((amax >> 23) - 8, 0)
    if FAST and tl.min(sbyte) > 11:
        # x * 2^(127 - sbyte) is exact in float32 here (no subnormal input can reach the
        # E4M3 range once amax >= 2^-107), then one hardware RNE satfinite cvt.
        mult = ((254 - tl.minimum(sbyte, 254)) << 23).to(tl.float32, bitcast=True)
        p = bits.to(tl.float32, bitcast=True) * mult[:, :, None]
        p = tl.minimum(tl.maximum(p, -448.0), 448.0)
        code = p.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        # x * 2^(127 - sbyte) as an exponent add; float32 subnormals are normalized through
        # an exact int -> float conversion of their mantissa.
        exp = absb >> 23
        mant = absb & 0x7FFFFF
        mf = mant.to(tl.float32).to(tl.int32, bitcast=True)
        sub = exp == 0
        biased = tl.where(sub, (mf >> 23) - 149, exp) + (127 - sbyte)[:, :, None]
        mant = tl.where(sub, mf & 0x7FFFFF, mant)
        code = _e4m3_code(biased, mant, (bits >> 24) & 0x80)
    code = tl.where(nonfinite[:, :, None], 0x7F, code)
    tl.store(q_ptr + rows * sqm + cols * sqc, code.to(tl.uint8), mask=mask)
    sbyte = tl.where(nonfinite, 255, sbyte)
    tl.store(
        s_ptr + srows * ssm + blk[None, :] * ssc,
        sbyte.to(tl.uint8),
        mask=(srows < M) & (blk[None, :] < NB),
    )
    return h


@triton.jit
def mxfp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    h_ptr,
    M,
    C,
    NB,
    n_col_programs,
    sxm,
    sxc,
    sqm,
    sqc,
    ssm,
    ssc,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    HASH: tl.constexpr,
):
    """h_ptr[pid] (with HASH): this program's partial checksum of x's bytes."""
    pid = tl.program_id(0)
    h = mxfp8_tile(
        x_ptr, q_ptr, s_ptr, M, C, NB, pid // n_col_programs, pid % n_col_programs,
        sxm, sxc, sqm, sqc, ssm, ssc, BLOCK_M, BLOCK_C, SRC_BF16, FAST, HASH,
    )  # fmt: skip
    if HASH:
        tl.store(h_ptr + pid + tl.arange(0, 1), h)


@triton.jit
def fp8_block_tile(
    xb,
    qb,
    s_tile,
    R,
    C,
    tr,
    tc,
    sxr,
    sxc,
    sqr,
    sqc,
    SUB_R: tl.constexpr,
    TILE: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    HASH: tl.constexpr = False,
    k0=0,
):
    """One 128x128 tile of a block-FP8 quantization: xb / qb point at the tile's matrix,
    s_tile at its scale (shared by the per-tensor and the grouped kernels); with HASH,
    returns the tile's share of the checksum of the source region's bytes (_bits_hash;
    k0: the row-major index of the matrix's first element in the region), else 0."""
    cols = tc * TILE + tl.arange(0, TILE)
    cmask = cols < C
    acc = tl.zeros((SUB_R, TILE), dtype=tl.int32)
    h = tl.zeros((1,), dtype=tl.int64)
    for i in tl.static_range(0, TILE, SUB_R):
        rows = (tr * TILE + i + tl.arange(0, SUB_R)).to(tl.int64)
        m = (rows[:, None] < R) & cmask[None, :]
        bits = _load_f32_bits(xb + rows[:, None] * sxr + cols[None, :] * sxc, m, SRC_BF16)
        acc = tl.maximum(acc, bits & 0x7FFFFFFF)
        if HASH:
            kg = k0 + rows * C + tc * TILE  # each row's first index
            h += _bits_hash(bits, kg, tl.arange(0, TILE)[None, :], SRC_BF16)
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    nonfinite = amax >= 0x7F800000
    tiny = amax < (27 << 23)
    scale = (amax.to(tl.float32, bitcast=True).to(tl.float64) / 448.0).to(tl.float32)
    scale = tl.where(amax == 0, 1.0, scale)
    nan = tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    tl.store(s_tile, tl.where(nonfinite, nan, scale))
    for i in tl.static_range(0, TILE, SUB_R):
        rows = (tr * TILE + i + tl.arange(0, SUB_R)).to(tl.int64)
        m = (rows[:, None] < R) & cmask[None, :]
        bits = _load_f32_bits(xb + rows[:, None] * sxr + cols[None, :] * sxc, m, SRC_BF16)
        x = bits.to(tl.float32, bitcast=True)
        if tiny:
            p = (x.to(tl.float64) / scale.to(tl.float64)).to(tl.float32)
        else:
            p = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        if FAST:
            p = tl.minimum(tl.maximum(p, -448.0), 448.0)
            code = p.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            bits = p.to(tl.int32, bitcast=True)
            absb = bits & 0x7FFFFFFF
            code = _e4m3_code(absb >> 23, absb & 0x7FFFFF, (bits >> 24) & 0x80)
        code = tl.where(nonfinite, 0x7F, code)
        tl.store(qb + rows[:, None] * sqr + cols[None, :] * sqc, code.to(tl.uint8), mask=m)
    return h


@triton.jit
def fp8_block_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    h_ptr,
    R,
    C,
    TR,
    TC,
    sxb,
    sxr,
    sxc,
    sqb,
    sqr,
    sqc,
    ssb,
    ssr,
    ssc,
    SUB_R: tl.constexpr,
    TILE: tl.constexpr,
    SRC_BF16: tl.constexpr,
    FAST: tl.constexpr,
    HASH: tl.constexpr,
):
    """h_ptr[pid] (with HASH): this program's partial checksum of x's bytes."""
    pid = tl.program_id(0)
    tc = pid % TC
    rest = pid // TC
    tr = rest % TR
    b = (rest // TR).to(tl.int64)
    h = fp8_block_tile(
        x_ptr + b * sxb, q_ptr + b * sqb, s_ptr + b * ssb + tr * ssr + tc * ssc,
        R, C, tr, tc, sxr, sxc, sqr, sqc, SUB_R, TILE, SRC_BF16, FAST, HASH, b * R * C,
    )  # fmt: skip
    if HASH:
        tl.store(h_ptr + pid + tl.arange(0, 1), h)

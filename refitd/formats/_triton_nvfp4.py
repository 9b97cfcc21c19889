"""NVFP4 Triton kernels (imported only through refitd.formats.triton_kernels).

Two launches: the tensor's amax (an integer atomic max of the bits of |x|), then one pass
that computes every block scale and packs the E2M1 codes. Both read the source as words
of two elements (int32 for 16-bit sources, int64 for float32), so an output byte is one
word and no register shuffle splits even from odd elements. The quantization pass walks
the tiles in the reverse of the amax pass's order, so it starts on the tiles the amax
pass read last, still in L2. Its float32 steps are the reference's IEEE operations in
the reference's order (refitd.formats.nvfp4); the E4M3 scale rounding is the integer one
of the FP8 kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from refitd.formats._triton_jit import _e4m3_code

# float32 constants as bit patterns, so every backend uses the same values (the float32
# nearest to 1e-8 and to 1/6)
NVFP4_AMAX_FLOOR_BITS = tl.constexpr(0x322BCC77)
NVFP4_SIXTH_BITS = tl.constexpr(0x3E2AAAAB)
SRC_BF16, SRC_F16, SRC_F32 = 0, 1, 2  # the SRC constexpr: what a word's halves are


@triton.jit
def _pair_bits(w, SRC: tl.constexpr):
    """IEEE float32 bits of a word's (low, high) elements: element 2i is the low half."""
    if SRC == 0:
        lo = w << 16
        hi = (w >> 16) << 16
    elif SRC == 1:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        lo = lo.to(tl.int32, bitcast=True)
        hi = hi.to(tl.int32, bitcast=True)
    else:
        lo = w.to(tl.int32)
        hi = (w >> 32).to(tl.int32)
    return lo, hi


@triton.jit
def nvfp4_amax_kernel(
    w_ptr,
    amax_ptr,
    M,
    W,
    n_col_programs,
    n_tiles,
    swm,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SRC: tl.constexpr,
):
    """amax_ptr (int32, zeroed) <- the bits of max |x| over the finite values of x (M rows
    of W words). Each program folds every n-th tile (n: the grid) and makes one atomic,
    so a large tensor does not queue hundreds of thousands of atomics on one address."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.int32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        rows = ((t // n_col_programs) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
        cols = ((t % n_col_programs) * BLOCK_W + tl.arange(0, BLOCK_W))[None, :]
        w = tl.load(w_ptr + rows * swm + cols, mask=(rows < M) & (cols < W), other=0)
        lo, hi = _pair_bits(w, SRC)
        lo &= 0x7FFFFFFF
        hi &= 0x7FFFFFFF
        lo = tl.where(lo < 0x7F800000, lo, 0)
        hi = tl.where(hi < 0x7F800000, hi, 0)
        acc = tl.maximum(acc, tl.maximum(lo, hi))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _e2m1_magnitude(a):
    """E2M1 magnitude index of float32 a >= 0 (nearest of min(a, 6), ties to the even
    code). From 1 up, E2M1 is a float with one mantissa bit: the bits of min(a, 6)
    rounded at bit 22 (ties to even) and rebased (the exponent of 1.0 to code 2). Below
    1 the codes are 0, 1, 2 at 0, 0.5, 1: two comparisons, ties as the reference counts
    them. Equal to the reference's midpoint comparisons for every float32 in [0, 16]
    and +Inf (checked exhaustively once; the tests run every midpoint and neighbour)."""
    b = tl.minimum(a.to(tl.int32, bitcast=True), 0x40C00000)
    big = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252
    small = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
    return tl.where(b >= 0x3F800000, big, small)


@triton.jit
def _block_scales(bbits, amax_ptr):
    """(E4M3 scale codes, float32 multipliers 1 / (s * D), decode scale D) of blocks whose
    finite max |x| has bits bbits, given the tensor's amax bits."""
    amax = tl.maximum(tl.load(amax_ptr), NVFP4_AMAX_FLOOR_BITS).to(tl.float32, bitcast=True)
    encode = tl.math.div_rn(tl.full((), 2688.0, tl.float32), amax)
    decode = tl.math.div_rn(tl.full((), 1.0, tl.float32), encode)
    bmax = bbits.to(tl.float32, bitcast=True)
    sixth = tl.full((), NVFP4_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    s = tl.minimum(encode * (bmax * sixth), 448.0).to(tl.int32, bitcast=True)
    scode = _e4m3_code(s >> 23, s & 0x7FFFFF, 0)
    e, m = scode >> 3, scode & 7
    sf = tl.where(
        e == 0,
        m.to(tl.float32) * 0.001953125,
        ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True),
    )
    mult = tl.where(sf == 0, 0.0, tl.math.div_rn(tl.zeros_like(sf) + 1.0, sf * decode))
    return scode, mult, decode


@triton.jit
def nvfp4_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    amax_ptr,
    M,
    W,
    NB,
    n_col_programs,
    n_tiles,
    swm,
    sqm,
    ssm,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SRC: tl.constexpr,
):
    """One (BLOCK_M x BLOCK_W words) tile of an NVFP4 quantization, given the tensor's
    amax bits (nvfp4_amax_kernel): word j of a row is output byte j, eight words a block.
    Subnormal inputs cannot reach a nonzero code or scale once amax is at least 1e-8, so
    flush-to-zero on the device changes nothing."""
    NBB: tl.constexpr = BLOCK_W // 8
    t = n_tiles - 1 - tl.program_id(0)
    srows = ((t // n_col_programs) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    rows = srows[:, :, None]
    blk = (t % n_col_programs) * NBB + tl.arange(0, NBB)
    cols = blk[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    mask = (rows < M) & (cols < W)
    lo, hi = _pair_bits(tl.load(w_ptr + rows * swm + cols, mask=mask, other=0), SRC)
    alo = lo & 0x7FFFFFFF
    ahi = hi & 0x7FFFFFFF
    bbits = tl.max(tl.maximum(alo, ahi), axis=2)
    nonfinite = bbits >= 0x7F800000
    scode, mult, decode = _block_scales(tl.where(nonfinite, 0, bbits), amax_ptr)
    mult = mult[:, :, None]
    code = _e2m1_magnitude(alo.to(tl.float32, bitcast=True) * mult) | ((lo >> 28) & 8)
    code |= (_e2m1_magnitude(ahi.to(tl.float32, bitcast=True) * mult) << 4) | ((hi >> 24) & 0x80)
    code = tl.where(nonfinite[:, :, None], 0, code)
    tl.store(q_ptr + rows * sqm + cols, code.to(tl.uint8), mask=mask)
    scode = tl.where(nonfinite, 0x7F, scode)
    smask = (srows < M) & (blk[None, :] < NB)
    tl.store(s_ptr + srows * ssm + blk[None, :], scode.to(tl.uint8), mask=smask)
    if t == 0:
        tl.store(g_ptr, decode)

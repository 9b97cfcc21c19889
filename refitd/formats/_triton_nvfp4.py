"""NVFP4 Triton kernels (imported only through refitd.formats.triton_kernels).

Two launches: the tensor's amax (an atomic max of the bits of |x|, which also folds the
amax of a tensor's pieces one launch each), then one pass that computes every block scale
and packs the E2M1 codes; only the second when a step that read the tensor already folded
its amax. Both read the source as words of two
elements (int32 for 16-bit sources, int64 for float32), so an output byte is one word and
no register shuffle splits even from odd elements. The quantization pass walks the tiles
in the reverse of the amax pass's order, so it starts on the tiles the amax pass read
last, still in L2. Its float32 steps are the reference's IEEE operations in the
reference's order (refitd.formats.nvfp4). Both passes keep the work per element small
(the quantization pass is bound by instruction issue otherwise): the amax is one
multiply-add and a max per element, and both roundings (E4M3 scales, E2M1 codes) are one
float add of a magic number built from the value's exponent (_round_to_code), equal to
the reference's roundings for every float32 in their ranges (checked exhaustively once:
[0, 448] for E4M3, [0, 16] clamped to 6 for E2M1)."""

from __future__ import annotations

import triton
import triton.language as tl

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
def _finite_key(bits):
    """uint32 keys whose unsigned order is that of the finite |x| of float32 bits, with
    every NaN and +-Inf below all of them: 2 |x| + 2^24 (the sign shifted out), which
    wraps past 2^32 exactly for the non-finite. One multiply-add per element."""
    return bits.to(tl.uint32, bitcast=True) * 2 + 0x01000000


@triton.jit
def nvfp4_amax_kernel(
    w_ptr,
    amax_ptr,
    o_ptr,
    M,
    W,
    n_col_programs,
    n_tiles,
    swm,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SRC: tl.constexpr,
    FLAT: tl.constexpr,
    COPY: tl.constexpr,
):
    """amax_ptr (int32, zeroed) <- the bits of max |x| over the finite values of x (M rows
    of W words). Each program folds every n-th tile (n: the grid) and makes one atomic,
    so a large tensor does not queue hundreds of thousands of atomics on one address.
    FLAT: rows follow each other (swm == W), so tile t is words t * BLOCK_M * BLOCK_W on.
    COPY: the words read are also stored to o_ptr, rows back to back (a copy of x that
    folds its amax in the same read)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.uint32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        if FLAT:
            offs = tl.cast(t, tl.int64) * (BLOCK_M * BLOCK_W) + (
                tl.arange(0, BLOCK_M)[:, None] * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
            )
            w = tl.load(w_ptr + offs, mask=offs < tl.cast(M, tl.int64) * W, other=0)
            if COPY:
                tl.store(o_ptr + offs, w, mask=offs < tl.cast(M, tl.int64) * W)
        else:
            rows = ((t // n_col_programs) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = ((t % n_col_programs) * BLOCK_W + tl.arange(0, BLOCK_W))[None, :]
            mask = (rows[:, None] < M) & (cols < W)
            w = tl.load(w_ptr + rows[:, None] * swm + cols, mask=mask, other=0)
            if COPY:
                tl.store(o_ptr + rows[:, None] * W + cols, w, mask=mask)
        if SRC == 0:
            # the high half's key keeps the low half in its bits 0..16, below its own
            # last bit: the order of the high values is unchanged (masked off at the end)
            hi = _finite_key(w)
            lo = _finite_key(w << 16)
        else:
            lo, hi = _pair_bits(w, SRC)
            lo = _finite_key(lo)
            hi = _finite_key(hi)
        acc = tl.maximum(acc, tl.maximum(lo, hi))
    key = tl.maximum(tl.max(tl.max(acc, axis=1), axis=0), 0x01000000)
    bits = ((key - 0x01000000) >> 1).to(tl.int32, bitcast=True)
    if SRC == 0:
        bits &= 0x7FFF0000
    tl.atomic_max(amax_ptr, bits)


@triton.jit
def _round_to_code(a, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """(code, magic) of float32 a >= 0 in a small float format of MBITS mantissa bits and
    least normal exponent EMIN (no saturation: a is clamped first). One IEEE add does the
    rounding: the magic M has the format's spacing at a's binade as its last bit (2^(e +
    23 - MBITS), e = max(exponent of a, EMIN): the subnormal spacing below), so a + M
    rounds a to nearest, ties to even; M also carries the code's offset for that binade,
    an even number of last bits (parity and so ties unchanged), so the low bits of a + M
    are the code and (a + M) - M the value, exact."""
    K: tl.constexpr = 23 - MBITS
    e = a.to(tl.int32, bitcast=True) & 0x7F800000
    m = e + (e >> K) + ((K << 23) - ((127 + EMIN) << MBITS))
    magic = tl.maximum(m, (127 + EMIN + K) << 23).to(tl.float32, bitcast=True)
    return (a + magic).to(tl.int32, bitcast=True), magic


@triton.jit
def _block_scales(bbits, amax_ptr):
    """(E4M3 scale codes, float32 multipliers 1 / (s * D), decode scale D) of blocks whose
    finite max |x| has bits bbits, given the tensor's amax bits. The E4M3 rounding of s
    (RNE, subnormals; s <= 448 so no saturation) is _round_to_code's."""
    amax = tl.maximum(tl.load(amax_ptr), NVFP4_AMAX_FLOOR_BITS).to(tl.float32, bitcast=True)
    encode = tl.math.div_rn(tl.full((), 2688.0, tl.float32), amax)
    decode = tl.math.div_rn(tl.full((), 1.0, tl.float32), encode)
    bmax = bbits.to(tl.float32, bitcast=True)
    sixth = tl.full((), NVFP4_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    s = tl.minimum(encode * (bmax * sixth), 448.0)
    sbits, magic = _round_to_code(s, 3, -6)
    sf = sbits.to(tl.float32, bitcast=True) - magic
    mult = tl.where(sf == 0, 0.0, tl.math.div_rn(tl.zeros_like(sf) + 1.0, sf * decode))
    return sbits & 0x7F, mult, decode


@triton.jit
def _e2m1_bits(a, mult):
    """Bits whose low 3 are the E2M1 magnitude index of min(a * mult, 6) (nearest, ties to
    the even code), bits 3 and up of the low byte zero. The clamp sits between the product
    and the rounding add, so no fused multiply-add can skip the product's own rounding."""
    code, _ = _round_to_code(tl.minimum(a.to(tl.float32, bitcast=True) * mult, 6.0), 1, 0)
    return code


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
    w = tl.load(w_ptr + rows * swm + cols, mask=mask, other=0)
    lo, hi = _pair_bits(w, SRC)
    alo = lo & 0x7FFFFFFF
    ahi = hi & 0x7FFFFFFF
    bbits = tl.max(tl.maximum(alo, ahi), axis=2)
    nonfinite = bbits >= 0x7F800000
    scode, mult, decode = _block_scales(tl.where(nonfinite, 0, bbits), amax_ptr)
    mult = mult[:, :, None]
    if SRC == 0:
        # the two signs (bits 15 and 31 of the word) to bits 3 and 7 of the low byte
        sgn = w & -0x7FFF8000
        sgn = (sgn >> 12) | (sgn >> 24)
    else:
        sgn = ((lo >> 28) & 8) | ((hi >> 24) & 0x80)
    # the byte is the low 8 bits: the high code's bits from 8 up drop in the cast
    code = (_e2m1_bits(alo, mult) & 7) | (_e2m1_bits(ahi, mult) << 4) | sgn
    code = tl.where(nonfinite[:, :, None], 0, code)
    tl.store(q_ptr + rows * sqm + cols, code.to(tl.uint8), mask=mask)
    scode = tl.where(nonfinite, 0x7F, scode)
    smask = (srows < M) & (blk[None, :] < NB)
    tl.store(s_ptr + srows * ssm + blk[None, :], scode.to(tl.uint8), mask=smask)
    if t == 0:
        tl.store(g_ptr, decode)

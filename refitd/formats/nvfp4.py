"""NVFP4: E2M1 values two per byte, one E4M3 scale per 16 elements of the last dim, and one
FP32 global scale per tensor (what vLLM and TensorRT-LLM serve on Blackwell).

Layout of a tensor of shape (..., n), n even: data uint8 (..., n / 2), element 2i in the low
nibble of byte i and element 2i + 1 in the high nibble (the order of NVIDIA ModelOpt
checkpoints and vLLM's kernels); scales uint8 (..., ceil(n / 16)), E4M3 bytes; one float32
global scale D, the decode factor (ModelOpt's `weight_scale_2`). A nibble is sign << 3 | m,
m indexing the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantization (float32 IEEE arithmetic, each step rounded to nearest even, in the order of
vLLM's reference quantizer, so its results are reproduced bit for bit):
  amax  = max |x| over the finite values of the whole tensor, at least 1e-8 (float32)
  G     = 2688 / amax          (2688 = 448 * 6: the encode scale; D = 1 / G is stored)
  per block of 16 (the last block of a row may be shorter; it uses its own elements):
  s     = E4M3(min(G * (bmax * f32(1/6)), 448))   bmax: max |x| of the block; RNE cast
  v     = x * (1 / (s * D))                        (x * 0 when s is 0)
  code  = E2M1 nearest to min(|v|, 6), ties to the even code, with the sign of x.
Policies (tested): -0.0 and negative values that round to zero keep their sign (0x8); an
all-zero tensor gets amax 1e-8 and zero codes. E2M1 has no NaN or infinity, so a NaN or
+-Inf makes its block's scale byte 0x7F (E4M3 NaN) and its codes 0; the tensor's other
blocks and D come from its finite values (a diverged weight shows as NaN after
dequantization, never as a plausible value). float64 input is rounded to float32 first.
Dequantization: x = E2M1(code) * (E4M3(s) * D), in float32 as vLLM's reference dequantizer
does, then cast once to the requested dtype.

The global scale spans the tensor, so only a place that holds the whole tensor can compute
it: refitd quantizes a destination tensor of NVFP4 storage from the one copy that lands
all of it (the planner refuses any other layout, refitd.plan.checks.check_whole_tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refitd.formats.fp8 import (
    E4M3_MAX,
    E4M3_NAN,
    F32_EXP_MASK,
    abs_bits,
    check_float,
    check_nvfp4_buffers,
    check_packed_pairs,
    e4m3_values,
    to_e4m3_codes,
)
from refitd.plan.wire import NVFP4_BLOCK, nvfp4_data_shape, nvfp4_scale_shape

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GLOBAL_NUMERATOR = 448.0 * 6.0
AMAX_FLOOR = 1e-8  # as float32: the smallest amax a global scale is computed from
# (midpoint between E2M1 magnitudes m and m + 1, whether a tie goes up): up when m + 1 is even
E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 scalar tensor on like's device (a tensor operand keeps IEEE division on
    CUDA, where a Python scalar divisor becomes a reciprocal multiply)."""
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bits of max |x| over the finite values of x (0 when there are none), as a
    tensor of one element: what `nvfp4_quantize_into(amax=...)` takes. The bits of the
    maxima of pieces of a tensor combine by max into the tensor's (int32 order is float
    order for non-negative floats)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=x.device)
    bits = abs_bits(x.to(torch.float32))
    return torch.where(bits < F32_EXP_MASK, bits, 0).amax().reshape(1)


def global_scales(
    x32: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode scale G, decode scale D = 1 / G) of a float32 tensor, as 0-d float32; amax:
    its `amax_bits` when already known (then x32 is not read)."""
    bits = amax_bits(x32) if amax is None else amax.to(x32.device)
    amax_f = bits.reshape(()).view(torch.float32)
    amax = torch.maximum(amax_f, _f32(AMAX_FLOOR, x32))
    encode = _f32(GLOBAL_NUMERATOR, x32) / amax
    return encode, _f32(1.0, x32) / encode


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude index (0..7, int32) of |values| a <= 6, nearest with ties to even."""
    m = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for mid, up in E2M1_MIDPOINTS:
        m += (a >= mid) if up else (a > mid)
    return m


def _reference(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: (packed data, E4M3 scale bytes, decode scale D of shape (1,))."""
    cols = x.shape[-1]
    nb = -(-cols // NVFP4_BLOCK)
    x32 = x.to(torch.float32)
    encode, decode = global_scales(x32, amax)
    pad = nb * NVFP4_BLOCK - cols
    blocks = (F.pad(x32, (0, pad)) if pad else x32).reshape(*x.shape[:-1], nb, NVFP4_BLOCK)
    bbits = abs_bits(blocks).amax(-1)
    nonfinite = bbits >= F32_EXP_MASK
    bmax = bbits.view(torch.float32)
    s = torch.minimum(encode * (bmax * _f32(1.0 / E2M1_MAX, x32)), _f32(E4M3_MAX, x32))
    s_code = to_e4m3_codes(torch.where(nonfinite, 0.0, s))
    sf = s_code.view(torch.float8_e4m3fn).to(torch.float32)
    mult = torch.where(sf == 0, 0.0, _f32(1.0, x32) / (sf * decode))
    v = (blocks * mult.unsqueeze(-1)).abs().clamp_max(E2M1_MAX)
    sign = ((blocks.view(torch.int32) >> 28) & 8).to(torch.int32)
    codes = torch.where(nonfinite.unsqueeze(-1), 0, e2m1_magnitude(v) | sign)
    codes = codes.reshape(*x.shape[:-1], nb * NVFP4_BLOCK)[..., :cols].to(torch.uint8)
    s_code = torch.where(nonfinite, E4M3_NAN, s_code.to(torch.int32)).to(torch.uint8)
    return pack(codes), s_code, decode.reshape(1)


def check_amax(amax: torch.Tensor, what: str) -> None:
    """A known amax is int32 bits of one element (`amax_bits`)."""
    if amax.dtype != torch.int32 or amax.numel() != 1:
        raise ValueError(
            f"{what}: amax must be the int32 bits of one element (amax_bits), got "
            f"{amax.dtype} of shape {tuple(amax.shape)}"
        )


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (..., n) -> bytes (..., n / 2): element 2i low, element 2i + 1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """bytes (..., n / 2) -> uint8 nibbles (..., n), the inverse of pack."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], -1)


def nvfp4_quantize_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    amax: torch.Tensor | None = None,
) -> None:
    """Quantize x into existing buffers (written in place, never reallocated): data uint8
    of nvfp4_data_shape(x.shape), scales uint8 of nvfp4_scale_shape(x.shape), global_scale
    float32 of one element (D). amax: x's `amax_bits`, when a step that read x anyway
    computed it; the quantization then reads x once (it must be x's: other bits give
    other bytes). CUDA tensors use the Triton kernel when triton is installed
    (bit-identical to this reference)."""
    check_float(x, "nvfp4 quantize")
    shape = tuple(x.shape)
    check_nvfp4_buffers(shape, data, scales, global_scale, "nvfp4 quantize")
    if amax is not None:
        check_amax(amax, "nvfp4 quantize")
    if x.numel() == 0:
        return
    if x.is_cuda:
        from refitd.formats import triton_kernels

        if triton_kernels.available():
            triton_kernels.nvfp4_quantize_into(x, data, scales, global_scale, amax=amax)
            return
    packed, s_code, decode = _reference(x, amax)
    data.copy_(packed)
    scales.copy_(s_code)
    global_scale.copy_(decode.reshape(global_scale.shape))


def nvfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (bf16/fp16/fp32, even last dim) -> (packed E2M1 data, E4M3 scale bytes, float32
    global scale D of shape (1,))."""
    check_float(x, "nvfp4 quantize")
    check_packed_pairs(tuple(x.shape), "nvfp4 quantize")
    data = torch.empty(nvfp4_data_shape(tuple(x.shape)), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nvfp4_scale_shape(tuple(x.shape)), dtype=torch.uint8, device=x.device)
    global_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    nvfp4_quantize_into(x, data, scales, global_scale)
    return data, scales, global_scale


def nvfp4_dequantize_into(
    data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """Dequantize into an existing tensor (any float dtype, its shape gives the element
    shape), in place."""
    shape = tuple(out.shape)
    check_nvfp4_buffers(shape, data, scales, global_scale, "nvfp4 dequantize")
    if out.numel() == 0:
        return
    codes = unpack(data).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    values = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    block_scale = e4m3_values(scales).to(torch.float32) * global_scale.reshape(()).to(scales.device)
    factor = block_scale.repeat_interleave(NVFP4_BLOCK, dim=-1)[..., : shape[-1]]
    out.copy_(values * factor)


def nvfp4_dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(packed data, scale bytes, global scale) -> a new tensor of the element shape
    data.shape[:-1] + (2 * data.shape[-1],) in dtype."""
    shape = (*data.shape[:-1], 2 * data.shape[-1])
    out = torch.empty(shape, dtype=dtype, device=data.device)
    nvfp4_dequantize_into(data, scales, global_scale, out)
    return out

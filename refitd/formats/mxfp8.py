"""MXFP8 (OCP Microscaling v1.0): E4M3 values, one E8M0 scale per 32 elements of the last dim.

Scale: for a block with amax = max|x|, the shared exponent is floor(log2(amax)) - 8 (8 is the
exponent of E4M3's largest power of two; 448 = 1.75 * 2^8), clamped to E8M0's range
[-127, 127]; the E8M0 byte is exponent + 127. Values are x / 2^exponent rounded to E4M3
(nearest, ties to even) with saturation to +-448. The last block of a row may be partial
(fewer than 32 elements); it is scaled from its own elements only.

Policies (tested):
- all-zero block (or one whose amax is below 2^-119): scale byte 0x00 (2^-127); an all-zero
  block's values are zeros (signs kept: -0.0 -> 0x80).
- non-finite: a NaN, +Inf or -Inf anywhere in a block makes the block's scale byte 0xFF
  (E8M0 NaN) and every value of the block 0x7F (E4M3 NaN). E4M3 has no infinity, and a
  saturated Inf would silently turn a diverged weight into a plausible one.
- float64 input is rounded to float32 first; bf16/fp16/fp32 are read exactly.
Dequantization multiplies in float64 (exact) and rounds once to the requested dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from refitd.formats.fp8 import (
    E4M3_NAN,
    F32_EXP_MASK,
    abs_bits,
    check_buffer,
    check_float,
    e4m3_values,
    to_e4m3_codes,
)
from refitd.formats.quantize import quantize_into
from refitd.plan.wire import MXFP8_BLOCK, mxfp8_scale_shape

E8M0_NAN = 0xFF
E8M0_BIAS = 127
EMAX_E4M3 = 8


def _reference_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (E4M3 codes of x.shape, E8M0 bytes), both uint8 and contiguous."""
    cols = x.shape[-1]
    nblocks = -(-cols // MXFP8_BLOCK)
    x32 = x.to(torch.float32)
    pad = nblocks * MXFP8_BLOCK - cols
    if pad:
        x32 = F.pad(x32, (0, pad))
    blocks = x32.reshape(*x.shape[:-1], nblocks, MXFP8_BLOCK)
    amax = abs_bits(blocks).amax(-1)
    nonfinite = amax >= F32_EXP_MASK
    # biased float32 exponent of amax is floor(log2(amax)) + 127 (0 for zero/subnormal, where
    # the clamp to -127 applies anyway): byte = clamp(floor(log2(amax)) - 8, -127) + 127.
    scale_byte = ((amax >> 23) - EMAX_E4M3).clamp_min(0)
    # 2^-(byte - 127) as float32 bits: exact power of two in [2^-119, 2^127].
    inv_scale = ((254 - scale_byte.clamp_max(254)) << 23).view(torch.float32)
    codes = to_e4m3_codes(blocks * inv_scale.unsqueeze(-1))
    codes = torch.where(nonfinite.unsqueeze(-1), E4M3_NAN, codes.to(torch.int32))
    scale_byte = torch.where(nonfinite, E8M0_NAN, scale_byte)
    codes = codes.reshape(*x.shape[:-1], nblocks * MXFP8_BLOCK)[..., :cols]
    return codes.to(torch.uint8), scale_byte.to(torch.uint8)


def mxfp8_quantize_into(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize x into existing buffers (written in place, never reallocated).

    data: uint8 of x.shape; scales: uint8 of mxfp8_scale_shape(x.shape). CUDA tensors use
    the Triton kernel when triton is installed (bit-identical to this reference).
    """
    quantize_into(
        "mxfp8", x, data, scales, torch.uint8, mxfp8_scale_shape(tuple(x.shape)), _reference_codes
    )


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (bf16/fp16/fp32) -> (E4M3 codes as uint8 of x.shape, E8M0 scale bytes as uint8)."""
    check_float(x, "mxfp8 quantize")
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(mxfp8_scale_shape(tuple(x.shape)), dtype=torch.uint8, device=x.device)
    mxfp8_quantize_into(x, data, scales)
    return data, scales


def mxfp8_dequantize_into(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantize into an existing tensor of data.shape (any float dtype), in place."""
    shape = tuple(data.shape)
    check_buffer(data, torch.uint8, shape, "mxfp8 data")
    check_buffer(scales, torch.uint8, mxfp8_scale_shape(shape), "mxfp8 scales")
    if tuple(out.shape) != shape:
        raise ValueError(f"mxfp8 dequantize: out has shape {tuple(out.shape)}, data {shape}")
    if data.numel() == 0:
        return
    cols = shape[-1]
    nblocks = -(-cols // MXFP8_BLOCK)
    values = e4m3_values(data)
    pad = nblocks * MXFP8_BLOCK - cols
    if pad:
        values = F.pad(values, (0, pad))
    values = values.reshape(*shape[:-1], nblocks, MXFP8_BLOCK)
    exponent = scales.to(torch.float64) - E8M0_BIAS
    factor = torch.where(scales == E8M0_NAN, math.nan, torch.exp2(exponent))
    values = (values * factor.unsqueeze(-1)).reshape(*shape[:-1], nblocks * MXFP8_BLOCK)
    out.copy_(values[..., :cols])


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(codes, scale bytes) -> a new tensor of data.shape in dtype."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    mxfp8_dequantize_into(data, scales, out)
    return out

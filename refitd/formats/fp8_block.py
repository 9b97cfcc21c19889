"""Block FP8 (DeepSeek-V3 style): E4M3 values, one float32 scale per 128x128 tile.

Tiles cover the last two dims (leading dims are independent); a 1-D tensor is one row
(scales of shape (1, ceil(n / 128))), matching refitd.plan.wire.fp8_block_scale_shape.
Edge tiles may be partial and are scaled from their own elements only.

scale = amax / 448 (float32, IEEE division); values = x / scale (float32, IEEE division)
rounded to E4M3 (nearest, ties to even) with saturation to +-448.

Policies (tested):
- all-zero tile: scale 1.0, values zeros (signs kept);
- non-finite: a NaN, +Inf or -Inf anywhere in a tile makes its scale NaN and every value
  of the tile 0x7F (E4M3 NaN), for the same reason as MXFP8 (refitd.formats.mxfp8).
- float64 input is rounded to float32 first.
Dequantization multiplies in float64 (exact) and rounds once to the requested dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refitd.formats.fp8 import (
    E4M3_MAX,
    E4M3_NAN,
    F32_EXP_MASK,
    abs_bits,
    check_buffer,
    check_float,
    e4m3_values,
    to_e4m3_codes,
)
from refitd.formats.quantize import quantize_into
from refitd.plan.wire import FP8_TILE, fp8_block_scale_shape


def as_2d_rows(x: torch.Tensor) -> torch.Tensor:
    """1-D tensors are one row of tiles; others are returned unchanged."""
    return x.unsqueeze(0) if x.dim() == 1 else x


def _tiles(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """x (..., R, C) zero-padded to whole tiles, viewed as (..., tr, 128, tc, 128)."""
    rows, cols = x.shape[-2:]
    tr, tc = -(-rows // FP8_TILE), -(-cols // FP8_TILE)
    pad_r, pad_c = tr * FP8_TILE - rows, tc * FP8_TILE - cols
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(*x.shape[:-2], tr, FP8_TILE, tc, FP8_TILE), (rows, cols)


def _untile(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    tr, tc = t.shape[-4], t.shape[-2]
    return t.reshape(*t.shape[:-4], tr * FP8_TILE, tc * FP8_TILE)[..., :rows, :cols]


def _reference_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: (E4M3 codes of x.shape as uint8, float32 scales)."""
    x2 = as_2d_rows(x).to(torch.float32)
    tiles, (rows, cols) = _tiles(x2)
    amax_bits = abs_bits(tiles).amax(dim=(-3, -1))
    nonfinite = amax_bits >= F32_EXP_MASK
    amax = amax_bits.view(torch.float32)
    # a tensor divisor: CUDA turns division by a Python scalar into a reciprocal multiply
    scale = torch.where(amax == 0, 1.0, amax / torch.full_like(amax, E4M3_MAX))
    scale = torch.where(nonfinite, torch.nan, scale)
    codes = to_e4m3_codes(tiles / scale[..., :, None, :, None]).to(torch.int32)
    codes = torch.where(nonfinite[..., :, None, :, None], E4M3_NAN, codes)
    codes = _untile(codes, rows, cols).reshape(x.shape)
    return codes.to(torch.uint8), scale


def fp8_block_quantize_into(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize x into existing buffers (written in place, never reallocated).

    data: uint8 of x.shape; scales: float32 of fp8_block_scale_shape(x.shape). CUDA tensors
    use the Triton kernel when triton is installed (bit-identical to this reference).
    """
    quantize_into(
        "fp8_block",
        x,
        data,
        scales,
        torch.float32,
        fp8_block_scale_shape(tuple(x.shape)),
        _reference_codes,
    )


def fp8_block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (bf16/fp16/fp32) -> (E4M3 codes as uint8 of x.shape, float32 tile scales)."""
    check_float(x, "fp8_block quantize")
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(
        fp8_block_scale_shape(tuple(x.shape)), dtype=torch.float32, device=x.device
    )
    fp8_block_quantize_into(x, data, scales)
    return data, scales


def fp8_block_dequantize_into(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantize into an existing tensor of data.shape (any float dtype), in place."""
    shape = tuple(data.shape)
    check_buffer(data, torch.uint8, shape, "fp8_block data")
    check_buffer(scales, torch.float32, fp8_block_scale_shape(shape), "fp8_block scales")
    if tuple(out.shape) != shape:
        raise ValueError(f"fp8_block dequantize: out has shape {tuple(out.shape)}, data {shape}")
    if data.numel() == 0:
        return
    tiles, (rows, cols) = _tiles(e4m3_values(as_2d_rows(data)))
    values = tiles * scales.to(torch.float64)[..., :, None, :, None]
    out.copy_(_untile(values, rows, cols).reshape(shape))


def fp8_block_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(codes, tile scales) -> a new tensor of data.shape in dtype."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    fp8_block_dequantize_into(data, scales, out)
    return out

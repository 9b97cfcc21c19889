"""MXFP8 and block-FP8 codecs against the element-by-element reference, and error bounds."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from _fp8_data import special_tensor
from _fp8_reference import e4m3_code, fp8_block_reference, mxfp8_reference

from refitd.formats import (
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
)
from refitd.plan.wire import fp8_block_scale_shape, mxfp8_scale_shape

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def as_f64(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float32).to(torch.float64).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 200), (2, 3, 33), (7,), (1,), (6, 31)])
def test_mxfp8_matches_elementwise_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = special_tensor(shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()), block=32)
    data, scales = mxfp8_quantize(x)
    assert data.dtype == torch.uint8 and tuple(data.shape) == shape
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == mxfp8_scale_shape(shape)
    ref_codes, ref_scales = mxfp8_reference(as_f64(x))
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(data.numpy(), ref_codes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(130, 260), (2, 5, 129), (300,), (1,)])
def test_fp8_block_matches_elementwise_reference(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x = special_tensor(shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()), block=128)
    data, scales = fp8_block_quantize(x)
    assert data.dtype == torch.uint8 and tuple(data.shape) == shape
    assert scales.dtype == torch.float32 and tuple(scales.shape) == fp8_block_scale_shape(shape)
    ref_codes, ref_scales = fp8_block_reference(as_f64(x))
    s = scales.numpy()
    np.testing.assert_array_equal(np.isnan(s), np.isnan(ref_scales))
    np.testing.assert_array_equal(np.nan_to_num(s), np.nan_to_num(ref_scales))
    np.testing.assert_array_equal(data.numpy(), ref_codes)


def test_reference_rounding_is_ties_to_even() -> None:
    # the independent reference itself, on hand-checked E4M3 values
    assert e4m3_code(1.0625) == 0x38  # tie between 1.0 (0x38) and 1.125 (0x39) -> even
    assert e4m3_code(1.1875) == 0x3A  # tie between 1.125 and 1.25 -> 1.25 (even)
    assert e4m3_code(2**-10) == 0x00 and e4m3_code(1.5 * 2**-9) == 0x02
    assert e4m3_code(1e6) == 0x7E and e4m3_code(-1e6) == 0xFE and e4m3_code(-0.0) == 0x80


def test_mxfp8_policies() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[1, 40] = math.nan
    x[2, 3] = math.inf
    x[3, 5] = -math.inf
    x[3, 40] = 3.0
    data, scales = mxfp8_quantize(x)
    assert scales[0].tolist() == [0, 0] and data[0].eq(0).all()  # all-zero: 2^-127, zeros
    assert scales[1].tolist() == [0, 0xFF] and data[1, 32:].eq(0x7F).all()
    assert scales[2, 0] == 0xFF and scales[3, 0] == 0xFF and data[2:, :32].eq(0x7F).all()
    assert scales[3, 1] == 1 - 8 + 127  # floor(log2(3)) - 8, biased
    back = mxfp8_dequantize(data, scales, torch.float32)
    assert back[1, 32:].isnan().all() and back[1, :32].eq(0).all() and back[3, 40] == 3.0


def test_fp8_block_policies() -> None:
    x = torch.zeros(130, 129, dtype=torch.float32)
    x[129, 128] = math.inf
    x[5, 7] = 2.0
    data, scales = fp8_block_quantize(x)
    assert (
        scales[0, 0].item() == np.float32(2.0) / np.float32(448.0)
        and scales[1, 0] == 1.0
        and scales[0, 1] == 1.0
    )
    assert scales[1, 1].isnan() and data[128:, 128:].eq(0x7F).all()
    assert data[5, 7] == 0x7E  # the tile max lands exactly on 448


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_round_trip_error_bound(dtype: torch.dtype) -> None:
    x = special_tensor((16, 96), dtype, seed=7, block=32)
    x = torch.where(x.isfinite(), x, 0.0)
    data, scales = mxfp8_quantize(x)
    back = mxfp8_dequantize(data, scales, torch.float32)
    x32 = x.to(torch.float32)
    scale = torch.exp2(scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)[:, :96]
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normals and 2^-10 of the
    # scale below the normal range; saturation above 448*scale loses at most 1/8 of |x|.
    bound = torch.maximum(x32.abs() * 2**-4, scale * 2**-10)
    bound = torch.where(x32.abs() > 448 * scale, x32.abs() / 8, bound)
    assert ((back - x32).abs() <= bound).all()
    assert ((back - x32).abs() / scale).max() > 0  # the bound is actually exercised


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_round_trip_error_bound(dtype: torch.dtype) -> None:
    x = special_tensor((200, 150), dtype, seed=11, block=128)
    x = torch.where(x.isfinite(), x, 0.0)
    data, scales = fp8_block_quantize(x)
    back = fp8_block_dequantize(data, scales, torch.float32)
    x32 = x.to(torch.float32)
    scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :150]
    bound = torch.maximum(x32.abs() * 2**-4, scale * 2**-10) * (1 + 2**-20)
    assert ((back - x32).abs() <= bound).all()


def test_dequantize_to_bf16_rounds_once() -> None:
    x = torch.randn(8, 64)
    data, scales = mxfp8_quantize(x)
    exact = mxfp8_dequantize(data, scales, torch.float64)
    assert torch.equal(mxfp8_dequantize(data, scales, torch.bfloat16), exact.to(torch.bfloat16))
    data, scales = fp8_block_quantize(x)
    exact = fp8_block_dequantize(data, scales, torch.float64)
    assert torch.equal(fp8_block_dequantize(data, scales, torch.bfloat16), exact.to(torch.bfloat16))


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(TypeError, match="float tensor"):
        mxfp8_quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-d"):
        fp8_block_quantize(torch.tensor(1.0))

"""Triton quantizers vs the torch reference, bit for bit, for every shape class.

gpu tests run on a CUDA device. The interpreter test runs the same kernels on CPU when
TRITON_INTERPRET=1 is set and triton is installed (slow: tiny shapes only).
"""

from __future__ import annotations

import os

import pytest
import torch
from _fp8_data import special_tensor

from refitd.formats import (
    decode_segment,
    dest_region,
    encode_segment,
    fp8_block_quantize,
    mxfp8_quantize,
    triton_kernels,
)
from refitd.plan.wire import fp8_block_scale_shape, mxfp8_scale_shape, segment_nbytes

HAS_CUDA = torch.cuda.is_available() and triton_kernels.available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")

MX_SHAPES = [(1,), (7,), (33,), (31, 33), (3, 5, 100), (64, 4096), (129, 257)]
BLOCK_SHAPES = [(1,), (300,), (5, 7), (129, 257), (2, 300, 130), (256, 512)]


def _check(device: str, dtype: torch.dtype, mx_shapes, block_shapes, fast: bool = False) -> None:
    for shape in mx_shapes:
        x = special_tensor(shape, dtype, seed=len(shape) * 1000 + shape[-1], block=32)
        want = mxfp8_quantize(x)  # CPU: torch reference
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        scales = torch.empty(mxfp8_scale_shape(shape), dtype=torch.uint8, device=device)
        triton_kernels.mxfp8_quantize_into(x.to(device), data, scales, fast=fast)
        assert torch.equal(data.cpu(), want[0]), ("mxfp8 data", shape, dtype)
        assert torch.equal(scales.cpu(), want[1]), ("mxfp8 scales", shape, dtype)
    for shape in block_shapes:
        x = special_tensor(shape, dtype, seed=len(shape) * 1000 + shape[-1], block=128)
        want = fp8_block_quantize(x)
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        scales = torch.empty(fp8_block_scale_shape(shape), dtype=torch.float32, device=device)
        triton_kernels.fp8_block_quantize_into(x.to(device), data, scales, fast=fast)
        assert torch.equal(data.cpu(), want[0]), ("fp8_block data", shape, dtype)
        assert torch.equal(scales.cpu().view(torch.int32), want[1].view(torch.int32)), (
            "fp8_block scales",
            shape,
            dtype,
        )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.available(),
    reason="set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU",
)
def test_kernels_in_interpreter_match_reference() -> None:
    _check("cpu", torch.bfloat16, [(1,), (33,), (6, 100)], [(5, 7), (130, 129)])
    _check("cpu", torch.float32, [(3, 70)], [(300,)])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kernels_bit_identical_to_reference(dtype: torch.dtype, fast: bool) -> None:
    _check("cuda", dtype, MX_SHAPES, BLOCK_SHAPES, fast)


@pytest.mark.gpu
@gpu
def test_kernels_write_strided_regions_in_place() -> None:
    x = torch.randn(8, 6, 300, dtype=torch.bfloat16, device="cuda")
    data = torch.zeros(8, 6, 300, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(mxfp8_scale_shape((8, 6, 300)), dtype=torch.uint8, device="cuda")
    ptrs = (data.data_ptr(), scales.data_ptr())
    for off, shape in [
        ((0, 0, 0), (8, 2, 300)),
        ((0, 2, 0), (8, 4, 128)),
        ((0, 2, 128), (8, 4, 172)),
    ]:
        sl = tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))
        region = dest_region("mxfp8", data, scales, off, shape)
        triton_kernels.mxfp8_quantize_into(x[sl], region.values, region.scales)
    want = mxfp8_quantize(x.cpu())
    assert torch.equal(data.cpu(), want[0]) and torch.equal(scales.cpu(), want[1])
    assert ptrs == (data.data_ptr(), scales.data_ptr())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("wire", "storage"), [("raw", "mxfp8"), ("raw", "fp8_block"), ("mxfp8", "mxfp8")]
)
def test_receiver_side_conversion_keeps_persistent_pointers(wire: str, storage: str) -> None:
    shape = (384, 640)
    data = torch.zeros(shape, dtype=torch.uint8, device="cuda")
    if storage == "mxfp8":
        scales = torch.zeros(mxfp8_scale_shape(shape), dtype=torch.uint8, device="cuda")
        quantize = mxfp8_quantize
    else:
        scales = torch.zeros(fp8_block_scale_shape(shape), dtype=torch.float32, device="cuda")
        quantize = fp8_block_quantize
    ptrs = (data.data_ptr(), scales.data_ptr())
    seg = torch.empty(segment_nbytes(wire, shape, "bfloat16"), dtype=torch.uint8, device="cuda")
    for step in range(3):  # three refits into the same buffers
        src = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * (step + 1)
        encode_segment(wire, src, seg)
        decode_segment(
            wire, seg, shape, "bfloat16", dest_region(storage, data, scales, (0, 0), shape)
        )
        assert ptrs == (data.data_ptr(), scales.data_ptr())
        want = quantize(src.cpu())
        assert torch.equal(data.cpu(), want[0]) and torch.equal(scales.cpu(), want[1])

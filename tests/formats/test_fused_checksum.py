"""The quantizing kernels' fused checksum: the MXFP8 and block-FP8 Triton kernels return,
with the codes they land, the checksum of refitd.executor.checksums over the bytes they
read, bit for bit what the unfused checksum of the same bytes (or of the raw wire segment
carrying them) gives, and a corrupted byte on the wire shows in it.

The interpreter tests run the kernels on CPU when TRITON_INTERPRET=1 is set and triton is
installed (tiny shapes: the interpreter is slow); the gpu test lands a raw segment through
refitd.formats.decode_raw_hashed on a CUDA device.
"""

from __future__ import annotations

import os

import pytest
import torch
from _fp8_data import special_tensor

from refitd.executor.checksums import MASK, checksum
from refitd.formats import (
    decode_raw_hashed,
    dest_region,
    encode_segment,
    fp8_block_quantize,
    mxfp8_quantize,
    triton_kernels,
)
from refitd.plan.wire import RAW, fp8_block_scale_shape, mxfp8_scale_shape, segment_nbytes

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.available(),
    reason="set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU",
)
gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_kernels.available()), reason="needs CUDA, triton"
)

# (format, shape of the source tensor, slice of it quantized: a strided view when partial)
CASES = [
    ("mxfp8", (33,), None),
    ("mxfp8", (7, 70), None),
    ("mxfp8", (3, 5, 64), None),
    ("mxfp8", (9, 96), (slice(1, 8), slice(32, 96))),
    ("mxfp8", (11, 601), None),  # two column tiles, odd rows: bf16 blocks start mid-word
    ("fp8_block", (301,), None),
    ("fp8_block", (130, 129), None),
    ("fp8_block", (2, 5, 7), None),
    ("fp8_block", (140, 300), (slice(3, 133), slice(0, 129))),
]


def _buffers(fmt: str, shape: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.full(shape, 0xAB, dtype=torch.uint8, device=device)
    if fmt == "mxfp8":
        return data, torch.full(mxfp8_scale_shape(shape), 7, dtype=torch.uint8, device=device)
    return data, torch.full(fp8_block_scale_shape(shape), 7.0, device=device)


def _land(fmt: str, x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(fused checksum, data, scales) of x quantized by the Triton kernel with hash."""
    data, scales = _buffers(fmt, tuple(x.shape), str(x.device))
    quantize = getattr(triton_kernels, f"{fmt}_quantize_into")
    h = quantize(x, data, scales, fast=False, hash=True)
    assert h is not None and h.dtype == torch.int64 and h.dim() == 0
    return int(h) & MASK, data, scales


def _same_codes(fmt: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> bool:
    want = (mxfp8_quantize if fmt == "mxfp8" else fp8_block_quantize)(x.cpu())
    got_s, want_s = scales.cpu(), want[1]
    if got_s.dtype == torch.float32:
        got_s, want_s = got_s.view(torch.int32), want_s.view(torch.int32)
    return torch.equal(data.cpu(), want[0]) and torch.equal(got_s, want_s)


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_checksum_is_the_checksum_of_the_bytes_read(dtype: torch.dtype) -> None:
    for n, (fmt, shape, part) in enumerate(CASES):
        block = 32 if fmt == "mxfp8" else 128
        full = special_tensor(shape, dtype, seed=50 + n, block=block)
        x = full if part is None else full[part]
        fused, data, scales = _land(fmt, x)
        assert fused == checksum(x), (fmt, shape, part, dtype)
        # what the receiver checksums today: the raw wire segment carrying x
        seg = torch.zeros(segment_nbytes(RAW, tuple(x.shape), str(dtype)[6:]), dtype=torch.uint8)
        encode_segment(RAW, x, seg)
        assert fused == checksum(seg[: x.numel() * x.element_size()]), (fmt, shape, dtype)
        assert _same_codes(fmt, x, data, scales), (fmt, shape, part, dtype)


@interpreter
def test_fused_checksum_shows_a_corrupted_wire_byte() -> None:
    for fmt, shape in (("mxfp8", (4, 64)), ("fp8_block", (3, 130))):
        x = torch.linspace(-3, 3, shape[0] * shape[1]).reshape(shape).to(torch.bfloat16)
        sent = checksum(x)  # the sender's checksum of its source block
        seg = torch.zeros(segment_nbytes(RAW, shape, "bfloat16"), dtype=torch.uint8)
        encode_segment(RAW, x, seg)
        n = x.numel() * 2  # the payload, before the segment's alignment padding
        for pos in (0, 1, n // 2 + 1, n - 1):
            bad = seg.clone()
            bad[pos] ^= 0x10
            fused, _, _ = _land(fmt, bad[:n].view(torch.bfloat16).view(shape))
            assert fused != sent, (fmt, pos)
            assert fused == checksum(bad[:n]), (fmt, pos)
        assert _land(fmt, seg[:n].view(torch.bfloat16).view(shape))[0] == sent


def test_fused_checksum_refuses_sources_it_reads_converted() -> None:
    x = torch.zeros(4, 32, dtype=torch.float16)
    data, scales = _buffers("mxfp8", (4, 32), "cpu")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        triton_kernels.mxfp8_quantize_into(x, data, scales, hash=True)


def test_decode_raw_hashed_leaves_cpu_segments_to_the_unfused_path() -> None:
    x = torch.ones(4, 32, dtype=torch.bfloat16)
    seg = torch.zeros(x.numel() * 2, dtype=torch.uint8)
    encode_segment(RAW, x, seg)
    data, scales = _buffers("mxfp8", (4, 32), "cpu")
    region = dest_region("mxfp8", data, scales, (0, 0), (4, 32))
    assert decode_raw_hashed(seg, (4, 32), "bfloat16", region) is None
    assert bool((data == 0xAB).all())  # nothing landed


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
def test_decode_raw_hashed_on_gpu(fmt: str) -> None:
    shape = (256, 384)
    x = special_tensor(shape, torch.bfloat16, seed=9, block=128).cuda()
    seg = torch.zeros(segment_nbytes(RAW, shape, "bfloat16"), dtype=torch.uint8, device="cuda")
    encode_segment(RAW, x, seg)
    data, scales = _buffers(fmt, (512, 384), "cuda")  # the region is rows 128..384
    region = dest_region(fmt, data, scales, (128, 0), shape)
    h = decode_raw_hashed(seg, shape, "bfloat16", region)
    assert h is not None and int(h) & MASK == checksum(seg[: x.numel() * 2])
    assert _same_codes(fmt, x, region.values, region.scales)

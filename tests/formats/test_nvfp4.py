"""NVFP4 codec: bit for bit against an independent encoder/decoder written from the format's
definition, the rounding and scale policies, vLLM's own reference helpers, segments into
persistent buffers, and the Triton kernel (interpreter / GPU)."""

from __future__ import annotations

import importlib
import math
import os
import zlib

import numpy as np
import pytest
import torch
from _fp8_data import special_tensor
from _nvfp4_reference import nvfp4_decode, nvfp4_reference

from refitd.formats import (
    copy_region,
    decode_segment,
    dest_region,
    encode_segment,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_into,
    triton_kernels,
)
from refitd.formats.nvfp4 import amax_bits
from refitd.plan.wire import nvfp4_data_shape, nvfp4_scale_shape, segment_nbytes

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
SHAPES = [(6, 100), (2, 3, 48), (40,), (2,), (5, 18)]


def as_f32(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float32).numpy()


def data(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return special_tensor(shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()), block=16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_independent_encoder_and_decoder(shape: tuple[int, ...], dtype) -> None:
    x = data(shape, dtype)
    packed, scales, gscale = nvfp4_quantize(x)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == nvfp4_data_shape(shape)
    assert tuple(scales.shape) == nvfp4_scale_shape(shape) and tuple(gscale.shape) == (1,)
    want_data, want_scales, want_d = nvfp4_reference(as_f32(x))
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    np.testing.assert_array_equal(packed.numpy(), want_data)
    assert gscale.numpy().view(np.int32)[0] == np.array([want_d]).view(np.int32)[0]
    back = nvfp4_dequantize(packed, scales, gscale, torch.float32)
    ref = nvfp4_decode(packed.numpy(), scales.numpy(), float(gscale))
    nan = np.isnan(ref)  # NaN payloads differ between decoders; positions must not
    np.testing.assert_array_equal(np.isnan(back.numpy()), nan)
    np.testing.assert_array_equal(back.numpy().view(np.int32)[~nan], ref.view(np.int32)[~nan])


def test_ties_go_to_the_even_code_and_values_saturate_at_six() -> None:
    # amax 2688 gives G = D = 1; a block with max 6 has scale E4M3(6 * f32(1/6)) = 1, so
    # its values are rounded as they are: each midpoint between E2M1 magnitudes is a tie
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0, 2, 2, 4, 4, 6, 6]  # magnitudes 0, 1, 1, 2, 2, 4, 4: the even neighbour
    row0 = [6.0, *ties, *[-t for t in ties], -0.0]
    # a block whose max 6.375 makes the scale a tie between E4M3 1.0 and 1.125 -> 1.0
    # (even), so 6.375 lands above 6 and saturates
    row1 = [6.375, -6.375, 5.9, 0.0, *[1.0] * 12]
    x = torch.tensor([row0, row1, [2688.0] + [0.0] * 15])
    packed, scales, gscale = nvfp4_quantize(x)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(3, 16).tolist()
    assert float(gscale) == 1.0 and scales.tolist() == [[0x38], [0x38], [0x7E]]  # 1, 1, 448
    assert codes[0] == [7, *want, *[w | 8 for w in want], 8]
    assert codes[1][:4] == [7, 15, 7, 0]  # -6.375 -> -6; 5.9 -> 6
    assert codes[2][0] == 7


def test_zeros_keep_their_sign_and_an_all_zero_tensor_is_zero() -> None:
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 1] = -0.0
    packed, scales, gscale = nvfp4_quantize(x)
    assert packed[0, 0] == 0x80 and packed.flatten()[1:].eq(0).all() and scales.eq(0).all()
    assert float(gscale) == np.float32(1.0) / (np.float32(2688.0) / np.float32(1e-8))
    assert nvfp4_dequantize(packed, scales, gscale, torch.float32).eq(0).all()
    # a negative value that rounds to zero keeps its sign
    y = torch.tensor([[6.0, -0.1] + [0.0] * 14])
    assert nvfp4_quantize(y)[0][0, 0] == 0x87


def test_non_finite_values_poison_their_block_only() -> None:
    x = torch.ones(3, 32)
    x[0, 3], x[1, 20], x[2, 31] = math.nan, math.inf, -math.inf
    x[2, 0] = 4.0
    packed, scales, gscale = nvfp4_quantize(x)
    # G = 2688 / 4: scale 448 for the block of max 4, 112 (0x6E) for blocks of ones
    assert scales.tolist() == [[0x7F, 0x6E], [0x6E, 0x7F], [0x7E, 0x7F]]
    assert float(gscale) == np.float32(1.0) / (np.float32(2688.0) / np.float32(4.0))
    back = nvfp4_dequantize(packed, scales, gscale, torch.float32)
    poisoned = torch.zeros(3, 32, dtype=torch.bool)
    poisoned[0, :16] = poisoned[1:, 16:] = True
    assert back[poisoned].isnan().all() and not back[~poisoned].isnan().any()
    assert back[2, 0].item() == pytest.approx(4.0) and back[0, 16].item() == pytest.approx(1.0)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="last dim, which must be even"):
        nvfp4_quantize(torch.zeros(4, 33))
    with pytest.raises(TypeError, match="float tensor"):
        nvfp4_quantize(torch.zeros(4, 32, dtype=torch.int32))
    packed, scales, gscale = nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="global scale: expected a float32 tensor of one"):
        nvfp4_dequantize(packed, scales, gscale.to(torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_known_amax_gives_the_same_bytes(dtype: torch.dtype) -> None:
    """amax from a step that read the tensor (the maxima of its pieces combined) gives the
    bytes of the quantization that reads it for its amax, NaN/Inf and all-zero included."""
    for x in (data((6, 100), dtype), torch.zeros(3, 32, dtype=dtype), -torch.zeros(2, 16)):
        whole = amax_bits(x)
        pieces = torch.stack([amax_bits(x[:2]), amax_bits(x[2:]), amax_bits(x[:0])]).amax(0)
        assert torch.equal(pieces, whole)
        got = _buffers(tuple(x.shape))
        nvfp4_quantize_into(x, *got, amax=pieces)
        for g, w in zip(got, nvfp4_quantize(x), strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    with pytest.raises(ValueError, match="int32 bits of one element"):
        nvfp4_quantize_into(x, *_buffers(tuple(x.shape)), amax=torch.zeros(1))


def _vllm_helpers():
    """vLLM 0.33's NVFP4 reference helpers, or a skip naming exactly what failed to import."""
    name = "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} does not import here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_vllm_reference_helpers(dtype: torch.dtype) -> None:
    """vLLM's ref_nvfp4_quant (given the encode scale G = 2688 / amax) and
    dequantize_to_dtype (given D) on the same tensors, bit for bit. ref_nvfp4_quant returns
    float E2M1 values, and a zero whose scaled value is exactly -0.0 comes back +0.0 there
    (torch.sign(-0.0) is 0) while refitd keeps the sign of x: codes are compared as values,
    and every negative zero of vLLM's must be one of refitd's."""
    m = _vllm_helpers()
    x = data((64, 96), dtype)
    x = torch.where(x.isfinite(), x, 0.0)  # vLLM's reference has no non-finite policy
    packed, scales, gscale = nvfp4_quantize(x)
    x32 = x.to(torch.float32)
    encode = torch.tensor(2688.0) / x32.abs().max().clamp_min(1e-8)
    q, s = m.ref_nvfp4_quant(x32, encode.reshape(1), 16)
    assert torch.equal(bits(scales.view(torch.float8_e4m3fn).float()), bits(s))
    assert float(gscale) == float(torch.tensor(1.0) / encode)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(64, 96).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ours = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    assert torch.equal(ours, q)
    assert not (q.signbit() & ~ours.signbit()).any()  # every -0 of theirs is ours too
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        theirs = m.dequantize_to_dtype(
            packed, scales.view(torch.float8_e4m3fn), gscale, out_dtype, 16, swizzle=False
        )
        mine = nvfp4_dequantize(packed, scales, gscale, out_dtype)
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), out_dtype


def _buffers(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent NVFP4 buffers as an engine holds them (garbage-filled)."""
    return (
        torch.full(nvfp4_data_shape(shape), 0x55, dtype=torch.uint8),
        torch.full(nvfp4_scale_shape(shape), 0x11, dtype=torch.uint8),
        torch.full((1,), -3.0),
    )


@pytest.mark.parametrize("wire", ["raw", "nvfp4"])
def test_segments_land_whole_tensors_in_place(wire: str) -> None:
    """raw (the receiver quantizes) and nvfp4 (the sender does) into persistent NVFP4
    buffers, twice (two refits, same addresses); nvfp4 into plain storage dequantizes."""
    shape = (12, 80)
    buffers = _buffers(shape)
    ptrs = [b.data_ptr() for b in buffers]
    for step in range(2):
        src = data(shape, torch.bfloat16) * (step + 1)
        seg = torch.full((segment_nbytes(wire, shape, "bfloat16"),), 0xAA, dtype=torch.uint8)
        encode_segment(wire, src, seg)
        region = dest_region(
            "nvfp4", buffers[0], buffers[1], (0, 0), shape, global_scale=buffers[2]
        )
        decode_segment(wire, seg, shape, "bfloat16", region)
        for got, want in zip(buffers, nvfp4_quantize(src), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert ptrs == [b.data_ptr() for b in buffers]
    if wire == "nvfp4":
        plain = torch.zeros(shape)
        decode_segment(
            wire, seg, shape, "bfloat16", dest_region("plain", plain, None, (0, 0), shape)
        )
        want = nvfp4_dequantize(*nvfp4_quantize(src), torch.float32)
        assert torch.equal(bits(plain), bits(want))
    local = _buffers(shape)
    copy_region(src, dest_region("nvfp4", local[0], local[1], (0, 0), shape, global_scale=local[2]))
    assert all(torch.equal(a, b) for a, b in zip(local, buffers, strict=True))


def test_regions_of_nvfp4_storage_must_be_the_whole_tensor() -> None:
    d, s, g = _buffers((8, 64))
    with pytest.raises(ValueError, match=r"w: region \(0, 32\)\+\(8, 32\) is not the whole"):
        dest_region("nvfp4", d, s, (0, 32), (8, 32), name="w", global_scale=g)
    with pytest.raises(ValueError, match="needs a scale buffer and a global scale"):
        dest_region("nvfp4", d, s, (0, 0), (8, 64), name="w")
    with pytest.raises(ValueError, match="global scale float32 of one element"):
        dest_region("nvfp4", d, s, (0, 0), (8, 64), name="w", global_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="cannot land in 'nvfp4' storage"):
        seg = torch.zeros(segment_nbytes("mxfp8", (8, 64), "float32"), dtype=torch.uint8)
        decode_segment(
            "mxfp8",
            seg,
            (8, 64),
            "float32",
            dest_region("nvfp4", d, s, (0, 0), (8, 64), global_scale=g),
        )


def _check_kernel(device: str, shapes, dtypes, **config) -> None:
    for dtype in dtypes:
        for shape in shapes:
            x = data(shape, dtype)
            want = nvfp4_quantize(x)  # CPU: the torch reference
            got = [torch.full(b.shape, 0x33, dtype=b.dtype, device=device) for b in want]
            triton_kernels.nvfp4_quantize_into(x.to(device), *got, **config)
            for g, w, what in zip(got, want, ("data", "scales", "global scale"), strict=True):
                assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)), (
                    what,
                    shape,
                    dtype,
                )


def _check_tensor(x: torch.Tensor, **config) -> None:
    got = [torch.zeros_like(b) for b in nvfp4_quantize(x)]
    triton_kernels.nvfp4_quantize_into(x, *got, **config)
    for g, w in zip(got, nvfp4_quantize(x), strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.available(),
    reason="set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU",
)
def test_kernel_in_interpreter_matches_reference() -> None:
    _check_kernel("cpu", [(40,), (6, 100), (3, 2, 48)], [torch.bfloat16, torch.float32])
    _check_kernel("cpu", [(6, 100)], [torch.float16], block_m=2, block_c=32, num_warps=1)
    # every E2M1 midpoint and its float32 neighbours, unscaled (amax 2688: global scale 1;
    # each block's max 6: block scale 1), signed
    points = torch.tensor([0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    near = torch.cat([points, points.nextafter(torch.zeros(1)), points.nextafter(points + 1)])
    near = torch.cat([near, -near, torch.zeros(15 - (2 * len(near)) % 15)]).reshape(-1, 15)
    blocks = torch.cat([near, torch.full((len(near), 1), 6.0)], 1).reshape(1, -1)
    _check_tensor(torch.cat([blocks, torch.full((1, 16), 2688.0)], 1))
    # a source that is no row-major view of pairs (a copy in the kernel's word layout)
    _check_tensor(data((12, 40), torch.bfloat16)[:, 3:37])
    # more tiles than amax programs (each program folds several), the amax mid-tensor
    x = torch.linspace(-1, 1, 40 * 64).reshape(40, 64).to(torch.bfloat16)
    x[20, 3] = 9.0
    _check_tensor(x, amax_programs=2)
    # rows apart in memory: the amax pass's tiles are rows x words, several a program
    for dtype in (torch.bfloat16, torch.float32):
        _check_tensor(data((20, 80), dtype)[:, 8:72], block_m=4, block_c=32, amax_programs=3)


def _check_one_read(device: str, x: torch.Tensor, pieces: int) -> None:
    """The amax folded over row pieces (nvfp4_amax_into), then one quantizing launch: the
    reference's bytes, and the reference's amax."""
    x = x.to(device)
    acc = torch.zeros(1, dtype=torch.int32, device=device)
    for part in x.tensor_split(pieces):
        triton_kernels.nvfp4_amax_into(part, acc)
    assert torch.equal(acc.cpu(), amax_bits(x.cpu()))
    got = [b.to(device) for b in _buffers(tuple(x.shape))]
    triton_kernels.nvfp4_quantize_into(x, *got, amax=acc)
    for g, w in zip(got, nvfp4_quantize(x.cpu()), strict=True):
        assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


def _check_copy_amax(device: str, x: torch.Tensor) -> None:
    """nvfp4_amax_into with `out`: x's values row-major in out, its amax bits in acc."""
    x = x.to(device)
    acc = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.full((x.numel(),), 7, dtype=x.dtype, device=device)
    triton_kernels.nvfp4_amax_into(x, acc, out=out)
    assert torch.equal(acc.cpu(), amax_bits(x.cpu()))
    assert torch.equal(out.cpu().view(torch.uint8), x.cpu().reshape(-1).view(torch.uint8))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.available(),
    reason="set TRITON_INTERPRET=1 with triton installed to run the kernels on CPU",
)
def test_one_read_kernel_in_interpreter_matches_reference() -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        _check_one_read("cpu", data((6, 100), dtype), 3)
    _check_one_read("cpu", data((12, 40), torch.bfloat16)[:, 2:38], 2)  # rows apart
    _check_one_read("cpu", data((96,), torch.bfloat16), 3)  # flat pieces, as a segment's
    for x in (data((6, 100), torch.float16), data((12, 40), torch.float32)[:, 2:38]):
        _check_copy_amax("cpu", x)  # the sender's pack: a copy that folds the amax
    with pytest.raises(ValueError, match="int32 bits of one element"):
        triton_kernels.nvfp4_quantize_into(
            torch.zeros(2, 16), *_buffers((2, 16)), amax=torch.zeros(1, dtype=torch.int64)
        )


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_kernels.available()), reason="needs CUDA and triton"
)
def test_kernel_bit_identical_to_reference_on_gpu() -> None:
    shapes = [(2,), (40,), (6, 100), (3, 2, 48), (129, 258), (64, 4096)]
    _check_kernel("cuda", shapes, DTYPES)
    for dtype in DTYPES:  # the amax of pieces, then the one-read quantization
        _check_one_read("cuda", data((129, 258), dtype), 5)
        _check_copy_amax("cuda", data((129, 258), dtype))
    _check_copy_amax("cuda", data((40, 300), torch.bfloat16)[:, 20:260])
    # a strided source region lands in persistent buffers in place
    x = torch.randn(6, 300, 64, dtype=torch.bfloat16, device="cuda")[:, 100:220]
    bufs = [b.cuda() for b in _buffers(tuple(x.shape))]
    ptrs = [b.data_ptr() for b in bufs]
    copy_region(
        x, dest_region("nvfp4", bufs[0], bufs[1], (0, 0, 0), tuple(x.shape), global_scale=bufs[2])
    )
    for got, want in zip(bufs, nvfp4_quantize(x.cpu()), strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert ptrs == [b.data_ptr() for b in bufs]

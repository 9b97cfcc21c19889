"""Segment encode/decode for every (wire, storage) pair, region-wise quantization into
persistent buffers, and a user-registered transform."""

from __future__ import annotations

import pytest
import torch

from refitd.formats import (
    DestRegion,
    RawTransform,
    Transform,
    copy_region,
    decode_segment,
    default_registry,
    dest_region,
    encode_segment,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    split_parts,
)
from refitd.plan.wire import (
    SEGMENT_ALIGN,
    WireFormat,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
    segment_nbytes,
)

QUANTIZE = {"mxfp8": mxfp8_quantize, "fp8_block": fp8_block_quantize}
DEQUANTIZE = {"mxfp8": mxfp8_dequantize, "fp8_block": fp8_block_dequantize}


def persistent(storage: str, shape: tuple[int, ...], dtype: torch.dtype):
    """Destination buffers as an inference engine would hold them (garbage-filled)."""
    if storage == "plain":
        return torch.full(shape, -7.0, dtype=dtype), None
    data = torch.full(shape, 0x55, dtype=torch.uint8)
    if storage == "mxfp8":
        return data, torch.full(mxfp8_scale_shape(shape), 0x11, dtype=torch.uint8)
    return data, torch.full(fp8_block_scale_shape(shape), -3.0, dtype=torch.float32)


def regions(storage: str, shape: tuple[int, int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A block-aligned split of a 2-D tensor into four regions (last ones partial)."""
    r, c = shape
    rs = 128 if storage == "fp8_block" else 3
    cs = 128 if storage == "fp8_block" else 64
    return [
        ((0, 0), (rs, cs)),
        ((0, cs), (rs, c - cs)),
        ((rs, 0), (r - rs, cs)),
        ((rs, cs), (r - rs, c - cs)),
    ]


def send_message(
    wire: str, src: torch.Tensor, parts: list, registry=None
) -> tuple[torch.Tensor, list[int]]:
    """Pack all regions of src into one message buffer as the executor does."""
    reg = registry or default_registry()
    sizes = [reg.segment_nbytes(wire, shape, "bfloat16") for _, shape in parts]
    if registry is None:  # the built-in formats agree with the planner's sizes
        assert sizes == [segment_nbytes(wire, shape, "bfloat16") for _, shape in parts]
    msg = torch.full((sum(sizes),), 0xAA, dtype=torch.uint8)
    offsets, at = [], 0
    for (off, shape), size in zip(parts, sizes, strict=True):
        view = src[off[0] : off[0] + shape[0], off[1] : off[1] + shape[1]]
        encode_segment(wire, view, msg[at : at + size], registry)
        offsets.append(at)
        at += size
    assert all(o % SEGMENT_ALIGN == 0 for o in offsets)
    return msg, offsets


PAIRS = [
    ("raw", "plain"),
    ("raw", "mxfp8"),
    ("raw", "fp8_block"),
    ("mxfp8", "mxfp8"),
    ("fp8_block", "fp8_block"),
    ("mxfp8", "plain"),
    ("fp8_block", "plain"),
]


@pytest.mark.parametrize(("wire", "storage"), PAIRS)
def test_segment_round_trip(wire: str, storage: str) -> None:
    shape = (200, 300) if "fp8_block" in (wire, storage) else (7, 100)
    src = torch.randn(shape, dtype=torch.bfloat16) * 3
    src[0, :5] = 0.0
    dst_dtype = torch.float32
    values, scales = persistent(storage, shape, dst_dtype)
    ptrs = (values.data_ptr(), None if scales is None else scales.data_ptr())
    parts = regions(storage if storage != "plain" else wire if wire != "raw" else "mxfp8", shape)
    msg, offsets = send_message(wire, src, parts)
    for (off, rshape), at in zip(parts, offsets, strict=True):
        dst = dest_region(storage, values, scales, off, rshape)
        seg = msg[at : at + segment_nbytes(wire, rshape, "bfloat16")]
        decode_segment(wire, seg, rshape, "bfloat16", dst)
    assert ptrs == (values.data_ptr(), None if scales is None else scales.data_ptr())
    if storage == "plain" and wire == "raw":
        assert torch.equal(values, src.to(dst_dtype))
    elif storage == "plain":
        # a quantized wire dequantizes on landing: equal to the whole-tensor round trip
        assert torch.equal(values, DEQUANTIZE[wire](*QUANTIZE[wire](src), dst_dtype))
    else:
        # piecewise writes into the persistent buffers equal whole-tensor quantization
        want_data, want_scales = QUANTIZE[storage](src)
        assert torch.equal(values, want_data)
        assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("storage", ["plain", "mxfp8", "fp8_block"])
def test_copy_region_local_writes_in_place(storage: str) -> None:
    shape = (130, 260)
    src = torch.randn(shape, dtype=torch.float32)
    values, scales = persistent(storage, shape, torch.bfloat16)
    before = (values.data_ptr(), None if scales is None else scales.data_ptr())
    for _ in range(2):  # two refits: same buffers
        for off, rshape in regions("fp8_block", shape):
            sl = tuple(slice(o, o + n) for o, n in zip(off, rshape, strict=True))
            copy_region(src[sl], dest_region(storage, values, scales, off, rshape))
        src = src * 2
    src = src / 2
    assert before == (values.data_ptr(), None if scales is None else scales.data_ptr())
    if storage == "plain":
        assert torch.equal(values, src.to(torch.bfloat16))
    else:
        want_data, want_scales = QUANTIZE[storage](src)
        assert torch.equal(values, want_data) and torch.equal(scales, want_scales)


def test_regionwise_quantization_of_3d_tensor() -> None:
    # regions along leading dims and along the last dim of a 3-D tensor, any strides
    src = torch.randn(4, 6, 70, dtype=torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    data, scales = persistent("mxfp8", (4, 6, 70), torch.float32)
    for off, shape in [((0, 0, 0), (4, 2, 32)), ((0, 0, 32), (4, 2, 38)), ((0, 2, 0), (4, 4, 70))]:
        sl = tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))
        copy_region(src[sl], dest_region("mxfp8", data, scales, off, shape))
    want = mxfp8_quantize(src)
    assert torch.equal(data, want[0]) and torch.equal(scales, want[1])


def test_fp8_block_one_dimensional_regions() -> None:
    src = torch.randn(300)
    data, scales = persistent("fp8_block", (300,), torch.float32)
    for off, n in [(0, 128), (128, 172)]:
        copy_region(src[off : off + n], dest_region("fp8_block", data, scales, (off,), (n,)))
    want = fp8_block_quantize(src)
    assert torch.equal(data, want[0]) and torch.equal(scales, want[1])


def test_misaligned_and_mismatched_regions_are_rejected() -> None:
    data, scales = persistent("mxfp8", (4, 100), torch.float32)
    with pytest.raises(ValueError, match=r"w\.q.*not aligned.*32"):
        dest_region("mxfp8", data, scales, (0, 16), (4, 32), name="w.q")
    with pytest.raises(ValueError, match="not aligned"):
        dest_region("mxfp8", data, scales, (0, 0), (4, 40))
    with pytest.raises(ValueError, match="exceeds"):
        dest_region("mxfp8", data, scales, (1, 0), (4, 32))
    fdata, fscales = persistent("fp8_block", (256, 256), torch.float32)
    with pytest.raises(ValueError, match="dim 0"):
        dest_region("fp8_block", fdata, fscales, (64, 0), (64, 128))
    with pytest.raises(ValueError, match="scales must be"):
        dest_region("mxfp8", data, scales[:, :2], (0, 0), (4, 32))
    # mxfp8 on the wire cannot land in fp8_block storage
    src = torch.randn(128, 128)
    seg = torch.empty(segment_nbytes("mxfp8", (128, 128), "float32"), dtype=torch.uint8)
    encode_segment("mxfp8", src, seg)
    with pytest.raises(ValueError, match="cannot land"):
        decode_segment(
            "mxfp8",
            seg,
            (128, 128),
            "float32",
            dest_region("fp8_block", fdata, fscales, (0, 0), (128, 128)),
        )
    with pytest.raises(ValueError, match="bytes"):
        encode_segment("raw", src, seg)
    with pytest.raises(ValueError, match="unknown wire"):
        encode_segment("fp4", src, seg)
    with pytest.raises(TypeError, match="cannot cast"):
        copy_region(src, DestRegion("plain", torch.empty(128, 128, dtype=torch.int32), None))


class Float16Wire(Transform):
    """A user format: values travel as float16 whatever the source dtype."""

    format = WireFormat("fp16", element_bytes=2)

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def should_transform(self, name: str) -> bool:
        return name in self.names

    def prepare_send(self, src: torch.Tensor, seg: torch.Tensor) -> None:
        (values,) = self.prepare_recv(seg, tuple(src.shape), "float16")
        values.copy_(src)

    def prepare_recv(self, seg, shape, src_dtype):
        (part,) = split_parts(seg, self.segment_parts(shape, src_dtype))
        return [part.view(torch.float16).view(shape)]

    def finalize_recv(self, parts, shape, src_dtype, dst):
        RawTransform().finalize_recv(parts, shape, "float16", dst)


def test_custom_transform_registered_and_used() -> None:
    registry = default_registry()
    registry.register(Float16Wire({"layers.0.mlp.fc1"}))
    assert set(registry.names()) == {"raw", "mxfp8", "fp8_block", "nvfp4", "fp16"}
    assert registry.wire_for("layers.0.mlp.fc1", "fp16") == "fp16"
    assert registry.wire_for("embedding", "fp16") == "raw"
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Float16Wire(set()))
    assert "fp16" not in default_registry()  # registries are independent objects

    src = torch.randn(5, 64, dtype=torch.float32)
    parts = [((0, 0), (5, 32)), ((0, 32), (5, 32))]
    msg, offsets = send_message("fp16", src.to(torch.bfloat16), parts, registry)
    values, scales = persistent("mxfp8", (5, 64), torch.float32)
    for (off, shape), at in zip(parts, offsets, strict=True):
        seg = msg[at : at + registry.segment_nbytes("fp16", shape, "bfloat16")]
        decode_segment(
            "fp16",
            seg,
            shape,
            "bfloat16",
            dest_region("mxfp8", values, scales, off, shape),
            registry,
        )
    want = mxfp8_quantize(src.to(torch.bfloat16).to(torch.float16))
    assert torch.equal(values, want[0]) and torch.equal(scales, want[1])
    with pytest.raises(ValueError, match="unknown wire"):
        decode_segment(
            "fp16", msg, (5, 32), "bfloat16", dest_region("plain", src, None, (0, 0), (5, 32))
        )

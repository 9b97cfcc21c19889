"""A wire format added by one WireFormat and one Transform registration is planned (segment
sizes, bucket cuts at its block granularity) and moved bit for bit by the NumPy oracle,
whose codec for it is the registered Transform itself."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from refitd.bench.plan_oracle import WireCodec
from refitd.formats import Transform, decode_segment, default_registry, encode_segment, split_parts
from refitd.formats.region import DestRegion, dest_region
from refitd.formats.transform import TransformRegistry, store_region
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.wire import RAW_CODE, WireFormat
from refitd.torch_dtypes import dtype_name, torch_dtype

from .oracle import run_and_check
from .test_layouts_plan import tp_side

SUM_BLOCK = 8
# Values in the source dtype plus one int32 checksum per 8 values of the last dim, which
# the receiver verifies before landing: sent to plain float32 destinations under
# sender quantization.
BLOCKSUM = WireFormat(
    "blocksum",
    block=(SUM_BLOCK,),
    scale_bytes=4,
    scale_dtype="int32",
    storage="plain",
    src_dtypes=("float32",),
)


def _sums(x: torch.Tensor) -> torch.Tensor:
    """Per block of 8 along the last dim: the sum of the values' int32 bit patterns,
    masked to 31 bits (the tail block is zero-padded)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    pad = -bits.shape[-1] % SUM_BLOCK
    bits = torch.nn.functional.pad(bits, (0, pad))
    blocks = bits.reshape(*bits.shape[:-1], -1, SUM_BLOCK).sum(-1)
    return (blocks & 0x7FFFFFFF).to(torch.int32)


class BlockSumTransform(Transform):
    """The codec of BLOCKSUM: encode values and checksums, verify them on landing."""

    format = BLOCKSUM

    def __init__(self) -> None:
        self.verified = 0

    def prepare_send(self, src: torch.Tensor, seg: torch.Tensor) -> None:
        values, sums = self.prepare_recv(seg, tuple(src.shape), dtype_name(src.dtype))
        values.copy_(src)
        sums.copy_(_sums(src))

    def prepare_recv(
        self, seg: torch.Tensor, shape: tuple[int, ...], src_dtype: str
    ) -> list[torch.Tensor]:
        values, sums = split_parts(seg, self.segment_parts(shape, src_dtype))
        return [
            values.view(torch_dtype(src_dtype)).view(shape),
            sums.view(torch.int32).view(self.format.scale_shape(shape)),
        ]

    def finalize_recv(
        self, parts: list[torch.Tensor], shape: tuple[int, ...], src_dtype: str, dst: DestRegion
    ) -> None:
        values, sums = parts
        if not torch.equal(_sums(values), sums):
            raise ValueError("blocksum: a block's checksum does not match its values")
        self.verified += 1
        store_region(values, dst)


def _codec(registry: TransformRegistry) -> WireCodec:
    """The oracle's codec for BLOCKSUM: the registered Transform through formats.segment."""

    def encode(block: np.ndarray) -> bytes:
        out = torch.zeros(BLOCKSUM.segment_nbytes(block.shape, block.dtype.name), dtype=torch.uint8)
        encode_segment("blocksum", torch.from_numpy(block.copy()), out, registry)
        return out.numpy().tobytes()

    def decode(seg: bytes, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        landed = torch.zeros(shape, dtype=torch_dtype(dtype.name))
        region = dest_region("plain", landed, None, (0,) * len(shape), shape)
        buf = torch.frombuffer(bytearray(seg), dtype=torch.uint8)
        decode_segment("blocksum", buf, shape, dtype.name, region, registry)
        return landed.numpy()

    return WireCodec(encode, decode)


def _sides() -> tuple[list, list]:
    src = tp_side("train", 2, 1, 1, (64, 32), 0, 0)
    src += tp_side("train", 2, 1, 1, (256,), 0, 0, name="bias")
    dst = tp_side("inf", 2, 2, 1, (64, 32), 1, 10)
    dst += tp_side("inf", 1, 2, 1, (256,), 0, 10, name="bias")
    return src, dst


def _pieces(plan, wires) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """(wire name, destination offset, shape, ndim) of every remote copy, from programs."""
    out = []
    for p in plan.programs().values():
        c = p.copies
        for m in range(len(p.send)):
            want = 0
            for i in range(int(p.send.start[m]), int(p.send.end[m])):
                nd = int(c.ndim[i])
                shape = tuple(c.shape[i, :nd].tolist())
                fmt = wires.formats[int(c.wire[i])]
                want += fmt.segment_nbytes(shape, "float32")
                out.append((fmt.name, tuple(c.dst_off[i, :nd].tolist()), shape, nd))
            assert int(p.send.nbytes[m]) == want  # the message is its copies' segments
    return out


def test_registered_wire_format_is_planned_and_moved_bit_for_bit() -> None:
    transform = BlockSumTransform()
    registry = default_registry()
    registry.register(transform)
    wires = registry.wires()
    assert wires.names() == ("raw", "mxfp8", "fp8_block", "nvfp4", "blocksum")
    src, dst = _sides()
    bucket = 100  # cuts the 1-D copies: 24 rows (3 blocks) per piece, 25 on the raw wire
    cfg = PlanConfig(bucket_bytes=bucket, sender_quantization=True, wires=wires)
    plan = run_and_check(src, dst, cfg, codecs={"blocksum": _codec(registry)})
    assert transform.verified > 0  # every segment went through the Transform's checks

    pieces = _pieces(plan, wires)
    assert {w for w, *_ in pieces} == {"blocksum"}
    one_d = [(off, shape) for w, off, shape, nd in pieces if nd == 1]
    assert one_d and all(off[0] % SUM_BLOCK == 0 for off, _ in one_d)
    assert {shape[0] for _, shape in one_d} == {24, 128 - 5 * 24}
    # the sizes include the checksums: a 24-row piece is 96 bytes of values + 3 sums
    assert BLOCKSUM.segment_nbytes((24,), "float32") == 96 + 16

    raw = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=bucket))
    raw_pieces = _pieces(raw, raw.config.wires)
    assert {w for w, *_ in raw_pieces} == {"raw"}
    assert {s[0] for _, _, s, nd in raw_pieces if nd == 1} == {25, 128 - 5 * 25}
    assert plan.stats.remote_bytes > raw.stats.remote_bytes


def test_unregistered_or_declined_wire_stays_raw() -> None:
    """Without sender quantization, or for a source dtype the format does not take, copies
    travel raw even with the format registered."""
    registry = default_registry()
    registry.register(BlockSumTransform())
    src, dst = _sides()
    off = build_plan("m", 1, src, dst, PlanConfig(wires=registry.wires()))
    assert all((p.copies.wire == RAW_CODE).all() for p in off.programs().values())
    src16 = [dataclasses.replace(s, dtype="bfloat16") for s in src]
    dst16 = [dataclasses.replace(s, dtype="bfloat16") for s in dst]
    cfg = PlanConfig(sender_quantization=True, wires=registry.wires())
    declined = build_plan("m", 1, src16, dst16, cfg)
    assert all((p.copies.wire == RAW_CODE).all() for p in declined.programs().values())
    taken = build_plan("m", 1, src, dst, cfg)
    assert all((p.copies.wire != RAW_CODE).all() for p in taken.programs().values())


def test_registering_needs_a_format_and_unique_names() -> None:
    registry = default_registry()
    registry.register(BlockSumTransform())
    with pytest.raises(ValueError, match="already registered"):
        registry.register(BlockSumTransform())
    with pytest.raises(ValueError, match="already registered"):
        registry.wires().with_format(BLOCKSUM)
    assert "blocksum" not in default_registry().wires().names()

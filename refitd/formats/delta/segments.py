"""Deltas of wire segments: a segment's parts as streams at the wire's element granularity.

raw: one stream of source-dtype elements (2-byte BF16/FP16, 4-byte FP32 ...); mxfp8: the E4M3
bytes and the E8M0 scales; fp8_block: the E4M3 bytes and the FP32 scales; nvfp4: the packed
E2M1 bytes, the E4M3 scale bytes and the FP32 global scale. A delta lands in place in a
destination region whose storage holds exactly these elements (delta_capable): a
destination that converts on landing (a cast, a quantization or a dequantization) cannot
apply one without a base of its own, so such copies always go dense.
"""

from __future__ import annotations

import numpy as np
import torch

from refitd.formats.delta.streams import DeltaStats, apply_parts, encode_parts
from refitd.formats.region import DestRegion
from refitd.formats.transform import split_parts
from refitd.plan.wire import FP8_BLOCK, MXFP8, NVFP4, RAW, segment_parts
from refitd.torch_dtypes import torch_dtype

__all__ = [
    "apply_segment_delta",
    "encode_segment_delta",
    "region_streams",
    "segment_streams",
]


def segment_streams(
    wire: str, shape: tuple[int, ...], src_dtype: str, seg: torch.Tensor
) -> list[torch.Tensor]:
    """Typed views of a segment's parts, one per delta stream, in wire order."""
    parts = split_parts(seg, segment_parts(wire, tuple(shape), src_dtype))
    if wire == RAW:
        return [parts[0].view(torch_dtype(src_dtype))]
    if wire == MXFP8:
        return parts
    if wire == FP8_BLOCK:
        return [parts[0], parts[1].view(torch.float32)]
    if wire == NVFP4:
        return [parts[0], parts[1], parts[2].view(torch.float32)]
    raise ValueError(f"delta: unknown wire format {wire!r}")


def region_streams(dst: DestRegion) -> list[torch.Tensor]:
    """The destination views a segment delta lands in, in wire order."""
    return dst.parts()


def encode_segment_delta(
    wire: str,
    shape: tuple[int, ...],
    src_dtype: str,
    base_seg: torch.Tensor,
    live_seg: torch.Tensor,
    *,
    threads: int = 1,
) -> tuple[np.ndarray, DeltaStats]:
    """The delta from the base version's segment to the live one (both encoded segments)."""
    return encode_parts(
        segment_streams(wire, shape, src_dtype, base_seg),
        segment_streams(wire, shape, src_dtype, live_seg),
        threads=threads,
    )


def apply_segment_delta(
    delta: np.ndarray | bytes | memoryview,
    dst: DestRegion,
    *,
    name: str = "destination",
    threads: int = 1,
) -> DeltaStats:
    """Apply a segment delta in place to a destination region holding the base version."""
    return apply_parts(delta, region_streams(dst), name=name, threads=threads)

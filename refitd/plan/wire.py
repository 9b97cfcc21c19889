"""Bytes on the wire per copy, by wire format name: thin lookups into the registry.

The size rule lives once, in wireformat.WireFormat; the formats in wires.WireRegistry. These
functions answer for a format name in a registry (the built-in one unless given), for
callers that hold names rather than codes (the codecs, the delta paths, tools).
"""

from __future__ import annotations

from refitd.plan.wireformat import DTYPE_SIZES, SEGMENT_ALIGN, aligned, dtype_size
from refitd.plan.wires import (
    BUILTIN_WIRES,
    FP8_BLOCK_FORMAT,
    FP8_TILE,
    MXFP8_BLOCK,
    MXFP8_FORMAT,
    WireRegistry,
)

RAW = "raw"
MXFP8 = MXFP8_FORMAT.name
FP8_BLOCK = FP8_BLOCK_FORMAT.name
WIRE_FORMATS = BUILTIN_WIRES.names()

__all__ = [
    "DTYPE_SIZES",
    "FP8_BLOCK",
    "FP8_TILE",
    "MXFP8",
    "MXFP8_BLOCK",
    "RAW",
    "SEGMENT_ALIGN",
    "WIRE_FORMATS",
    "aligned",
    "delta_capable",
    "dtype_size",
    "fp8_block_scale_shape",
    "mxfp8_scale_shape",
    "segment_nbytes",
    "segment_parts",
]


def mxfp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the E8M0 scales of an MXFP8 block of `shape` (one per 32 of the last dim)."""
    return MXFP8_FORMAT.scale_shape(shape)


def fp8_block_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the FP32 scales of a block-FP8 block of `shape` (one per 128x128 tile).

    A 1-D tensor is treated as a single row.
    """
    return FP8_BLOCK_FORMAT.scale_shape(shape)


def segment_parts(
    wire: str, shape: tuple[int, ...], src_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> tuple[int, ...]:
    """Byte sizes of the parts of one copy's wire segment, in wire order (each part starts
    SEGMENT_ALIGN-aligned): raw (values in the source dtype,); mxfp8 (E4M3 values, E8M0
    scales); fp8_block (E4M3 values, FP32 scales)."""
    return wires.get(wire).segment_parts(shape, src_dtype)


def segment_nbytes(
    wire: str, shape: tuple[int, ...], src_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> int:
    """Bytes one copy occupies in a message, alignment padding included."""
    return wires.get(wire).segment_nbytes(shape, src_dtype)


def delta_capable(
    wire: str, src_dtype: str, storage: str, dst_dtype: str, wires: WireRegistry = BUILTIN_WIRES
) -> bool:
    """Whether a copy's destination holds the wire's elements unchanged, so a delta of them
    can land in place: raw into plain storage of the source dtype, MXFP8 into MXFP8, block
    FP8 into block FP8 (a cast, quantization or dequantization on landing cannot)."""
    return wires.get(wire).lands_unchanged(src_dtype, storage, dst_dtype)

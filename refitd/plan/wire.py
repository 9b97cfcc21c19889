"""Bytes on the wire per copy: one definition shared by the planner and the executor.

A message is its copies' segments laid end to end, each segment starting at a multiple of
SEGMENT_ALIGN bytes so the receiver can view it in any dtype without a copy.
"""

from __future__ import annotations

import math

RAW = "raw"
MXFP8 = "mxfp8"
FP8_BLOCK = "fp8_block"
WIRE_FORMATS = (RAW, MXFP8, FP8_BLOCK)

MXFP8_BLOCK = 32
FP8_TILE = 128
SEGMENT_ALIGN = 16

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_size(dtype: str) -> int:
    """Element size in bytes of a dtype name; a clear error for unknown names."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def mxfp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the E8M0 scales of an MXFP8 block of `shape` (one per 32 of the last dim)."""
    if not shape:
        return ()
    return (*shape[:-1], -(-shape[-1] // MXFP8_BLOCK))


def fp8_block_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the FP32 scales of a block-FP8 block of `shape` (one per 128x128 tile).

    A 1-D tensor is treated as a single row.
    """
    if len(shape) == 1:
        return (1, -(-shape[0] // FP8_TILE))
    return (*shape[:-2], -(-shape[-2] // FP8_TILE), -(-shape[-1] // FP8_TILE))


def aligned(n: int) -> int:
    """n rounded up to SEGMENT_ALIGN."""
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


def segment_parts(wire: str, shape: tuple[int, ...], src_dtype: str) -> tuple[int, ...]:
    """Byte sizes of the parts of one copy's wire segment, in wire order.

    raw: (values in the source dtype,); mxfp8: (E4M3 values, E8M0 scales);
    fp8_block: (E4M3 values, FP32 scales). Each part starts SEGMENT_ALIGN-aligned.
    """
    n = math.prod(shape)
    if wire == RAW:
        return (n * dtype_size(src_dtype),)
    if wire == MXFP8:
        return (n, math.prod(mxfp8_scale_shape(shape)))
    if wire == FP8_BLOCK:
        return (n, 4 * math.prod(fp8_block_scale_shape(shape)))
    raise ValueError(f"unknown wire format {wire!r}; known: {WIRE_FORMATS}")


def segment_nbytes(wire: str, shape: tuple[int, ...], src_dtype: str) -> int:
    """Bytes one copy occupies in a message, alignment padding included."""
    return sum(aligned(p) for p in segment_parts(wire, shape, src_dtype))


def delta_capable(wire: str, src_dtype: str, storage: str, dst_dtype: str) -> bool:
    """Whether a copy's destination holds the wire's elements unchanged, so a delta of them
    can land in place: raw into plain storage of the source dtype, MXFP8 into MXFP8, block
    FP8 into block FP8 (a cast, quantization or dequantization on landing cannot)."""
    if wire == RAW:
        return storage == "plain" and src_dtype == dst_dtype
    return wire in (MXFP8, FP8_BLOCK) and storage == wire

"""Destination regions: where one copy lands inside a destination tensor's buffers.

A plain destination is one tensor; a quantized one is a persistent pair (uint8 E4M3 data,
scales) whose addresses never change (CUDA graphs capture them), so regions are views
into those buffers and every write goes through copy_ into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refitd.plan.wire import (
    FP8_BLOCK,
    FP8_TILE,
    MXFP8,
    MXFP8_BLOCK,
    PLAIN,
    STORAGE_FORMATS,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
)


@dataclass
class DestRegion:
    """Where a copy lands on the destination.

    storage: "plain" | "mxfp8" | "fp8_block" (refitd.plan.wire.STORAGE_FORMATS).
    values: plain: view of the destination tensor's region (its dtype); quantized: view of
    the uint8 E4M3 data region. scales: quantized: view of the scale region covering
    exactly these blocks; None for plain.
    """

    storage: str
    values: torch.Tensor
    scales: torch.Tensor | None


def _block_slice(name: str, dim: int, offset: int, length: int, full: int, block: int) -> slice:
    """Scale-index slice of a data range that must start on a block and end on one or at the end."""
    end = offset + length
    if offset % block or (end % block and end != full):
        raise ValueError(
            f"{name}: region [{offset}, {end}) of dim {dim} (size {full}) is not aligned to "
            f"the {block}-element quantization blocks; quantized regions must start at a "
            f"multiple of {block} and end at one or at the end of the dim"
        )
    return slice(offset // block, -(-end // block))


def dest_region(
    storage: str,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    name: str = "destination",
) -> DestRegion:
    """Cut the region views out of a destination tensor's persistent buffers.

    Scale offsets are data offsets // block. Raises a clear error naming `name` when the
    region is out of bounds, the buffers do not match the storage layout, or a quantized
    region is not block-aligned.
    """
    if storage not in STORAGE_FORMATS:
        raise ValueError(f"{name}: unknown storage {storage!r}; known: {STORAGE_FORMATS}")
    full = tuple(values.shape)
    if not (len(offset) == len(shape) == len(full)):
        raise ValueError(
            f"{name}: region offset {offset} / shape {shape} do not match the rank of "
            f"the tensor of shape {full}"
        )
    for d, (o, n, f) in enumerate(zip(offset, shape, full, strict=True)):
        if o < 0 or n < 0 or o + n > f:
            raise ValueError(f"{name}: region {offset}+{shape} exceeds shape {full} in dim {d}")
    data_slices = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    if storage == PLAIN:
        return DestRegion(PLAIN, values[data_slices], None)
    if values.dtype != torch.uint8:
        raise TypeError(f"{name}: {storage} data must be uint8, got {values.dtype}")
    if scales is None:
        raise ValueError(f"{name}: {storage} storage needs a scale buffer")
    if storage == MXFP8:
        expected, scale_dtype = mxfp8_scale_shape(full), torch.uint8
    else:
        expected, scale_dtype = fp8_block_scale_shape(full), torch.float32
    if tuple(scales.shape) != expected or scales.dtype != scale_dtype:
        raise ValueError(
            f"{name}: {storage} scales must be {scale_dtype} of shape {expected}, got "
            f"{scales.dtype} of shape {tuple(scales.shape)}"
        )
    nd = len(full)
    if storage == MXFP8:
        last = _block_slice(name, nd - 1, offset[-1], shape[-1], full[-1], MXFP8_BLOCK)
        return DestRegion(MXFP8, values[data_slices], scales[(*data_slices[:-1], last)])
    assert storage == FP8_BLOCK
    col = _block_slice(name, nd - 1, offset[-1], shape[-1], full[-1], FP8_TILE)
    if nd == 1:
        return DestRegion(FP8_BLOCK, values[data_slices], scales[0:1, col])
    row = _block_slice(name, nd - 2, offset[-2], shape[-2], full[-2], FP8_TILE)
    return DestRegion(FP8_BLOCK, values[data_slices], scales[(*data_slices[:-2], row, col)])

"""Destination regions: where one copy lands inside a destination tensor's buffers.

A plain destination is one tensor; a quantized one is a persistent pair (uint8 E4M3 data,
scales), for NVFP4 a triple (packed E2M1 data, E4M3 scale bytes, FP32 global scale), whose
addresses never change (CUDA graphs capture them), so regions are views into those
buffers and every write goes through copy_ into them. An NVFP4 region is the whole tensor:
its global scale is the whole tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refitd.plan.wire import (
    FP8_BLOCK,
    FP8_TILE,
    MXFP8,
    MXFP8_BLOCK,
    NVFP4,
    PLAIN,
    STORAGE_FORMATS,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
    nvfp4_scale_shape,
)


@dataclass
class DestRegion:
    """Where a copy lands on the destination.

    storage: "plain" | "mxfp8" | "fp8_block" | "nvfp4" (refitd.plan.wire.STORAGE_FORMATS).
    values: plain: view of the destination tensor's region (its dtype); quantized: view of
    the uint8 data region (nvfp4: the packed bytes). scales: quantized: view of the scale
    region covering exactly these blocks; None for plain. global_scale: nvfp4: the float32
    global scale of the tensor; None otherwise.
    """

    storage: str
    values: torch.Tensor
    scales: torch.Tensor | None
    global_scale: torch.Tensor | None = None

    def parts(self) -> list[torch.Tensor]:
        """The buffers this region holds, in the wire order of its storage's format:
        [values], [values, scales] or [values, scales, global scale]."""
        if self.storage == PLAIN:
            return [self.values]
        if self.scales is None:
            raise ValueError(f"a {self.storage} destination region needs its scales view")
        if self.storage != NVFP4:
            return [self.values, self.scales]
        if self.global_scale is None:
            raise ValueError("an nvfp4 destination region needs its global scale")
        return [self.values, self.scales, self.global_scale.reshape(1)]

    @property
    def shape(self) -> tuple[int, ...]:
        """The region's shape in elements (nvfp4 packs two per byte of its last dim)."""
        if self.storage == NVFP4:
            return (*self.values.shape[:-1], 2 * self.values.shape[-1])
        return tuple(self.values.shape)


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
    global_scale: torch.Tensor | None = None,
) -> DestRegion:
    """Cut the region views out of a destination tensor's persistent buffers.

    Scale offsets are data offsets // block. Raises a clear error naming `name` when the
    region is out of bounds, the buffers do not match the storage layout, or a quantized
    region is not block-aligned (nvfp4: not the whole tensor). offset and shape are in
    elements; an nvfp4 `values` is the packed data, `global_scale` its float32 scale.
    """
    if storage not in STORAGE_FORMATS:
        raise ValueError(f"{name}: unknown storage {storage!r}; known: {STORAGE_FORMATS}")
    if storage == NVFP4:
        return _nvfp4_region(values, scales, global_scale, offset, shape, name)
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


def _nvfp4_region(
    values: torch.Tensor,
    scales: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    name: str,
) -> DestRegion:
    """The whole-tensor region of NVFP4 buffers (its global scale is the whole tensor's)."""
    full = (*values.shape[:-1], 2 * values.shape[-1]) if values.dim() else ()
    if values.dtype != torch.uint8 or not full:
        raise TypeError(f"{name}: nvfp4 data must be uint8 of 1+ dims, got {values.dtype}")
    if tuple(offset) != (0,) * len(full) or tuple(shape) != full:
        raise ValueError(
            f"{name}: region {tuple(offset)}+{tuple(shape)} is not the whole nvfp4 tensor of "
            f"shape {full}; nvfp4 storage is landed whole (its global scale is the tensor's)"
        )
    if scales is None or global_scale is None:
        raise ValueError(f"{name}: nvfp4 storage needs a scale buffer and a global scale")
    if (
        scales.dtype != torch.uint8
        or tuple(scales.shape) != nvfp4_scale_shape(full)
        or global_scale.dtype != torch.float32
        or global_scale.numel() != 1
    ):
        raise ValueError(
            f"{name}: nvfp4 scales must be uint8 of shape {nvfp4_scale_shape(full)} and the "
            f"global scale float32 of one element, got {scales.dtype} {tuple(scales.shape)} "
            f"and {global_scale.dtype} {tuple(global_scale.shape)}"
        )
    return DestRegion(NVFP4, values, scales, global_scale)

"""The transform hook: how one wire format is encoded, received and landed.

A Transform owns one wire format. The executor never branches on formats: for each copy
it asks the registry for the copy's wire transform and calls
  prepare_send(src, seg)                     sender: encode a source region into its segment
  prepare_recv(seg, shape, src_dtype)        receiver: typed views of the segment's parts
  finalize_recv(parts, shape, src_dtype, dst) receiver: land them in the destination region
so a user plugs in a format by subclassing Transform and registering it. should_transform
lets a transform decline tensors by name (the caller then sends them raw).

A Transform's geometry is its `format`, a refitd.plan.wire.WireFormat: segment sizes
come from there (the same rule the planner uses), and TransformRegistry.wires() is the
refitd.plan.wire.WireRegistry a PlanConfig takes, so a registered format is planned too.
Segment layout: parts of the byte sizes segment_parts() returns, each starting at a
SEGMENT_ALIGN-aligned offset, so every part can be viewed in its dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from refitd.formats.fp8_block import fp8_block_dequantize_into, fp8_block_quantize_into
from refitd.formats.mxfp8 import mxfp8_dequantize_into, mxfp8_quantize_into
from refitd.formats.nvfp4 import nvfp4_dequantize_into, nvfp4_quantize_into
from refitd.formats.passthrough import cast_copy
from refitd.formats.region import DestRegion
from refitd.plan.wire import (
    FP8_BLOCK,
    FP8_BLOCK_FORMAT,
    MXFP8,
    MXFP8_FORMAT,
    NVFP4,
    NVFP4_FORMAT,
    PLAIN,
    RAW_FORMAT,
    WireFormat,
    WireRegistry,
    aligned,
)
from refitd.torch_dtypes import dtype_name, torch_dtype


def split_parts(seg: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """uint8 views of a segment's parts, each starting SEGMENT_ALIGN-aligned."""
    if seg.dtype != torch.uint8 or seg.dim() != 1:
        raise ValueError(
            f"a segment must be a 1-D uint8 tensor, got {seg.dtype} {tuple(seg.shape)}"
        )
    need = sum(aligned(s) for s in sizes)
    if seg.numel() < need:
        raise ValueError(f"segment of {seg.numel()} bytes is smaller than its parts ({need})")
    parts, start = [], 0
    for size in sizes:
        parts.append(seg[start : start + size])
        start += aligned(size)
    return parts


def store_region(src: torch.Tensor, dst: DestRegion) -> None:
    """Write plain values into a destination region: cast, or quantize into its buffers."""
    if dst.storage == PLAIN:
        cast_copy(src, dst.values, "store region")
    elif dst.storage == MXFP8:
        mxfp8_quantize_into(src, dst.values, _scales(dst))
    elif dst.storage == FP8_BLOCK:
        fp8_block_quantize_into(src, dst.values, _scales(dst))
    elif dst.storage == NVFP4:
        nvfp4_quantize_into(src, *dst.parts())
    else:
        raise ValueError(f"unknown destination storage {dst.storage!r}")


def _scales(dst: DestRegion) -> torch.Tensor:
    return dst.parts()[1]


class Transform(ABC):
    """One wire format: segment sizes, encode on the sender, decode and land on the receiver.
    Subclasses set `format` (the format's geometry, shared with the planner)."""

    format: WireFormat

    @property
    def wire(self) -> str:
        """The wire format's name."""
        return self.format.name

    def should_transform(self, name: str) -> bool:
        """Whether this format applies to the tensor `name` (default: every tensor)."""
        return True

    def segment_parts(self, shape: tuple[int, ...], src_dtype: str) -> tuple[int, ...]:
        """Byte sizes of the parts of one region's segment, in wire order."""
        return self.format.segment_parts(shape, src_dtype)

    def segment_nbytes(self, shape: tuple[int, ...], src_dtype: str) -> int:
        """Bytes of one region's segment, alignment padding included."""
        return self.format.segment_nbytes(shape, src_dtype)

    @abstractmethod
    def prepare_send(self, src: torch.Tensor, seg: torch.Tensor) -> None:
        """Encode the source region src (any strides) into the uint8 segment seg, in place."""

    @abstractmethod
    def prepare_recv(
        self, seg: torch.Tensor, shape: tuple[int, ...], src_dtype: str
    ) -> list[torch.Tensor]:
        """Typed views of the parts of a received segment (receive buffers; no copies)."""

    @abstractmethod
    def finalize_recv(
        self, parts: list[torch.Tensor], shape: tuple[int, ...], src_dtype: str, dst: DestRegion
    ) -> None:
        """Land the received parts into the destination region (conversion happens here)."""


class RawTransform(Transform):
    """Values in the source dtype; cast or quantized on landing (receiver-side conversion)."""

    format = RAW_FORMAT

    def prepare_send(self, src: torch.Tensor, seg: torch.Tensor) -> None:
        (values,) = self.prepare_recv(seg, tuple(src.shape), dtype_name(src.dtype))
        values.copy_(src)

    def prepare_recv(
        self, seg: torch.Tensor, shape: tuple[int, ...], src_dtype: str
    ) -> list[torch.Tensor]:
        (part,) = split_parts(seg, self.segment_parts(shape, src_dtype))
        return [part.view(torch_dtype(src_dtype)).view(shape)]

    def finalize_recv(
        self, parts: list[torch.Tensor], shape: tuple[int, ...], src_dtype: str, dst: DestRegion
    ) -> None:
        store_region(parts[0], dst)


class _QuantizedTransform(Transform):
    """Shared shape of the quantized wires: uint8 values, scales and, for a format with a
    tensor scale, that float32 scale on the wire; the parts a region of the format's
    storage holds (DestRegion.parts)."""

    @property
    def storage(self) -> str | None:
        return self.format.storage

    @abstractmethod
    def _quantize_into(self, x: torch.Tensor, parts: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def _dequantize_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None: ...

    def prepare_send(self, src: torch.Tensor, seg: torch.Tensor) -> None:
        self._quantize_into(src, self.prepare_recv(seg, tuple(src.shape), dtype_name(src.dtype)))

    def prepare_recv(
        self, seg: torch.Tensor, shape: tuple[int, ...], src_dtype: str
    ) -> list[torch.Tensor]:
        fmt = self.format
        data, scales, *tensor_scale = split_parts(seg, self.segment_parts(shape, src_dtype))
        return [
            data.view(fmt.values_shape(shape)),
            scales.view(torch_dtype(fmt.scale_dtype)).view(fmt.scale_shape(shape)),
            *(t.view(torch.float32) for t in tensor_scale),
        ]

    def finalize_recv(
        self, parts: list[torch.Tensor], shape: tuple[int, ...], src_dtype: str, dst: DestRegion
    ) -> None:
        if dst.storage == self.storage:
            for buf, part in zip(dst.parts(), parts, strict=True):
                buf.copy_(part)
        elif dst.storage == PLAIN:
            self._dequantize_into(parts, dst.values)
        else:
            raise ValueError(
                f"wire {self.wire!r} cannot land in {dst.storage!r} storage; send such "
                f"copies raw (receiver-side conversion) or in the storage's own format"
            )


class MXFP8Transform(_QuantizedTransform):
    """MXFP8 on the wire (sender-side conversion): E4M3 codes + E8M0 scales, ~1.03 B/elem."""

    format = MXFP8_FORMAT

    def _quantize_into(self, x: torch.Tensor, parts: list[torch.Tensor]) -> None:
        mxfp8_quantize_into(x, *parts)

    def _dequantize_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        mxfp8_dequantize_into(*parts, out)


class FP8BlockTransform(_QuantizedTransform):
    """Block FP8 on the wire: E4M3 codes + one float32 scale per 128x128 tile."""

    format = FP8_BLOCK_FORMAT

    def _quantize_into(self, x: torch.Tensor, parts: list[torch.Tensor]) -> None:
        fp8_block_quantize_into(x, *parts)

    def _dequantize_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        fp8_block_dequantize_into(*parts, out)


class NVFP4Transform(_QuantizedTransform):
    """NVFP4 on the wire: packed E2M1 values + one E4M3 scale per 16 + the FP32 global
    scale, ~0.56 B/elem. The global scale is the region's: a copy into NVFP4 storage is
    the destination's whole tensor (refitd.formats.nvfp4)."""

    format = NVFP4_FORMAT

    def _quantize_into(self, x: torch.Tensor, parts: list[torch.Tensor]) -> None:
        nvfp4_quantize_into(x, *parts)

    def _dequantize_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        nvfp4_dequantize_into(*parts, out)


class TransformRegistry:
    """Wire format name -> Transform. Owned by its caller; no global registry exists."""

    def __init__(self, transforms: list[Transform] | None = None) -> None:
        self._by_wire: dict[str, Transform] = {}
        for t in transforms or []:
            self.register(t)

    def register(self, transform: Transform, *, replace: bool = False) -> None:
        """Add a transform under its wire name; replacing one needs replace=True."""
        fmt = getattr(transform, "format", None)
        if not isinstance(fmt, WireFormat):
            raise ValueError(f"{type(transform).__name__} must set `format` (a WireFormat)")
        name = fmt.name
        if name in self._by_wire and not replace:
            raise ValueError(f"wire format {name!r} is already registered")
        self._by_wire[name] = transform

    def get(self, wire_name: str) -> Transform:
        try:
            return self._by_wire[wire_name]
        except KeyError:
            raise ValueError(
                f"unknown wire format {wire_name!r}; registered: {sorted(self._by_wire)}"
            ) from None

    def __contains__(self, wire_name: object) -> bool:
        return wire_name in self._by_wire

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_wire)

    def wire_for(self, name: str, preferred: str) -> str:
        """The wire to use for tensor `name`: preferred if its transform accepts it, else raw."""
        return preferred if self.get(preferred).should_transform(name) else RAW_FORMAT.name

    def segment_nbytes(self, wire_name: str, shape: tuple[int, ...], src_dtype: str) -> int:
        return self.get(wire_name).segment_nbytes(shape, src_dtype)

    def wires(self) -> WireRegistry:
        """The wire formats of the registered transforms, in registration order (their
        codes): what PlanConfig.wires takes so the planner plans these formats."""
        return WireRegistry(tuple(t.format for t in self._by_wire.values()))


def default_registry() -> TransformRegistry:
    """A new registry holding the built-in formats: raw, mxfp8, fp8_block, nvfp4."""
    return TransformRegistry(
        [RawTransform(), MXFP8Transform(), FP8BlockTransform(), NVFP4Transform()]
    )

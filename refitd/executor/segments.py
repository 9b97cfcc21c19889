"""The executor's one door to wire formats: regions, encode and decode of one copy's segment.

The raw wire into plain storage (with a cast when dtypes differ) is handled here; every other
case (quantized wire or quantized destination storage) goes to refitd.formats, imported only
when needed so a raw refit does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refitd.plan.wire import NVFP4, PLAIN, RAW


@dataclass(frozen=True, slots=True)
class ResolvedTensor:
    """A registered tensor as the executor sees it: plain data, or quantized data + scales
    (nvfp4: + its float32 global scale). amax: the NVFP4 amax bits (int32, one element) of
    the whole of data, folded by the step that wrote data (a snapshot capture), else None."""

    name: str
    data: torch.Tensor
    scales: torch.Tensor | None = None
    storage: str = PLAIN
    global_scale: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    def buffers(self) -> list[torch.Tensor]:
        """Every persistent buffer of the tensor: data, then scales and global scale."""
        return [t for t in (self.data, self.scales, self.global_scale) if t is not None]


def _formats():
    try:
        import refitd.formats as formats
    except ImportError as e:  # pragma: no cover - formats ships with refitd
        raise RuntimeError(f"refitd.formats is needed for quantized formats: {e}") from e
    if not hasattr(formats, "encode_segment"):
        raise NotImplementedError("refitd.formats does not provide quantized codecs yet")
    return formats


def block(t: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """View of the block of `t` at `offset` with `shape` (no copy)."""
    if len(offset) != t.dim() or len(shape) != t.dim():
        raise ValueError(f"block {offset}/{shape} does not match a {t.dim()}-d tensor")
    return t[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def is_plain_raw(wire: str, dst: ResolvedTensor | None = None) -> bool:
    """True when this module handles the copy itself (raw wire, plain storage)."""
    return wire == RAW and (dst is None or dst.storage == PLAIN)


def encode_segment(wire: str, src: torch.Tensor, out: torch.Tensor) -> None:
    """Write one copy's wire segment (uint8 `out`, segment_nbytes long) from source block `src`."""
    if wire == RAW:
        out[: src.numel() * src.element_size()].view(src.dtype).view(src.shape).copy_(src)
        return
    _formats().encode_segment(wire, src, out)


def decode_segment(
    wire: str,
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: torch.dtype,
    dst: ResolvedTensor,
    offset: tuple[int, ...],
) -> None:
    """Land one copy's wire segment into the destination block at `offset` of `dst`."""
    if is_plain_raw(wire, dst):
        n = 1
        for s in shape:
            n *= s
        itemsize = torch.empty(0, dtype=src_dtype).element_size()
        block(dst.data, offset, shape).copy_(seg[: n * itemsize].view(src_dtype).view(shape))
        return
    name = str(src_dtype).removeprefix("torch.")
    _formats().decode_segment(wire, seg, shape, name, dest_region(dst, offset, shape))


def decode_hashed(
    wire: str,
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: torch.dtype,
    dst: ResolvedTensor,
    offset: tuple[int, ...],
) -> torch.Tensor | None:
    """decode_segment of a raw segment landed by a quantizing kernel that also returns the
    segment's checksum (refitd.formats.decode_raw_hashed); None, with nothing landed, where
    no such kernel runs (plain storage, a CPU device, other wires or dtypes)."""
    if wire != RAW or dst.storage == PLAIN or not seg.is_cuda:
        return None
    name = str(src_dtype).removeprefix("torch.")
    region = dest_region(dst, offset, shape)
    return _formats().decode_raw_hashed(seg, shape, name, region)


def nvfp4_amax(dst: ResolvedTensor, wire: str, device: torch.device) -> torch.Tensor | None:
    """A zeroed amax accumulator for a raw segment that lands in NVFP4 storage (folded
    as its chunks arrive, refitd.formats.fold_amax); None for every other copy."""
    if wire != RAW or dst.storage != NVFP4:
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)


def decode_known_amax(
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: torch.dtype,
    dst: ResolvedTensor,
    offset: tuple[int, ...],
    amax: torch.Tensor,
) -> None:
    """decode_segment of a raw segment into NVFP4 storage given its folded amax."""
    name = str(src_dtype).removeprefix("torch.")
    region = dest_region(dst, offset, shape)
    _formats().decode_raw_known_amax(seg, shape, name, region, amax)


def encode_raw_amax(src: torch.Tensor, out: torch.Tensor, amax: torch.Tensor) -> None:
    """refitd.formats.encode_raw_amax: a raw segment packed with its NVFP4 amax word."""
    _formats().encode_raw_amax(src, out, amax)


def whole_amax(src: ResolvedTensor, region: torch.Tensor) -> torch.Tensor | None:
    """src's folded amax when `region` (a block of src's data) is all of it, on its device."""
    a = src.amax
    ok = a is not None and region.numel() == src.data.numel() and a.device == region.device
    return a if ok else None


def fold_amax(values: torch.Tensor, amax: torch.Tensor) -> None:
    """refitd.formats.fold_amax (the formats package is imported only when needed)."""
    _formats().fold_amax(values, amax)


def dest_region(dst: ResolvedTensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """The refitd.formats.DestRegion of the block at `offset` of a quantized (or plain)
    destination: views of its buffers."""
    return _formats().dest_region(
        dst.storage,
        dst.data,
        dst.scales,
        offset,
        shape,
        name=dst.name,
        global_scale=dst.global_scale,
    )

"""The segment API the executor calls: encode a source region, decode into a destination.

Every function writes into buffers it is given (message buffers, persistent destination
buffers) and allocates nothing persistent, so destination addresses never change.
"""

from __future__ import annotations

import torch

from refitd.formats.region import DestRegion
from refitd.formats.transform import TransformRegistry, default_registry, store_region
from refitd.plan.wire import FP8_BLOCK, MXFP8, NVFP4, RAW
from refitd.torch_dtypes import dtype_name, torch_dtype


def encode_segment(
    wire: str, src: torch.Tensor, out: torch.Tensor, registry: TransformRegistry | None = None
) -> None:
    """Encode a source region into its wire segment.

    src: region view (any strides) in the source dtype; out: uint8 1-D of length
    refitd.plan.wire.segment_nbytes(wire, tuple(src.shape), dtype name); parts laid out per
    wire.segment_parts, each part starting at a 16-byte-aligned offset.
    """
    transform = (registry or default_registry()).get(wire)
    shape, src_dtype = tuple(src.shape), dtype_name(src.dtype)
    expected = transform.segment_nbytes(shape, src_dtype)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != expected:
        raise ValueError(
            f"encode_segment({wire!r}): out must be uint8 1-D of {expected} bytes for a "
            f"{src_dtype} region of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    transform.prepare_send(src, out)


def decode_segment(
    wire: str,
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: str,
    dst: DestRegion,
    registry: TransformRegistry | None = None,
) -> None:
    """Write a received segment into the destination region.

    raw -> plain: copy with cast; raw -> mxfp8/fp8_block/nvfp4: quantize on landing
    (receiver-side conversion); mxfp8 -> mxfp8 / fp8_block -> fp8_block / nvfp4 -> nvfp4:
    copy the parts; quantized -> plain: dequantize.
    """
    transform = (registry or default_registry()).get(wire)
    shape = tuple(shape)
    if dst.shape != shape:
        raise ValueError(
            f"decode_segment({wire!r}): segment shape {shape} does not match the destination "
            f"region {dst.shape}"
        )
    parts = transform.prepare_recv(seg, shape, src_dtype)
    transform.finalize_recv(parts, shape, src_dtype, dst)


def decode_raw_hashed(
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: str,
    dst: DestRegion,
    registry: TransformRegistry | None = None,
) -> torch.Tensor | None:
    """decode_segment of a raw segment into MXFP8 or block-FP8 storage that also returns
    the checksum (refitd.executor.checksums) of the segment's values, computed by the
    quantizing kernel as it reads them (a 0-d int64 tensor, queued), so verification does
    not read the segment a second time. Only on CUDA with triton and a bfloat16 or
    float32 source; None otherwise, and nothing is landed (the caller decodes as usual)."""
    from refitd.formats import triton_kernels

    dtype = torch_dtype(src_dtype)
    if (
        not seg.is_cuda
        or dst.storage not in (MXFP8, FP8_BLOCK)
        or dst.scales is None
        or dtype not in triton_kernels.HASHABLE
        or not triton_kernels.available()
    ):
        return None
    if dst.shape != tuple(shape):
        raise ValueError(
            f"decode_raw_hashed: segment shape {tuple(shape)} does not match the destination "
            f"region {dst.shape}"
        )
    (values,) = (registry or default_registry()).get(RAW).prepare_recv(seg, shape, src_dtype)
    quantize = getattr(triton_kernels, f"{dst.storage}_quantize_into")
    return quantize(values, dst.values, dst.scales, hash=True)


def fold_amax(values: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold the NVFP4 amax bits of `values` (a piece of a tensor of whole element pairs, as
    it arrives) into amax (int32 of one element, zeroed before the first piece), so the
    tensor's quantization (decode_raw_known_amax) reads the tensor once."""
    from refitd.formats import triton_kernels
    from refitd.formats.nvfp4 import amax_bits

    if values.numel() % 2:
        raise ValueError(f"fold_amax: a piece of {values.numel()} elements is not whole pairs")
    if values.is_cuda and triton_kernels.available():
        triton_kernels.nvfp4_amax_into(values.reshape(-1), amax)
    else:
        torch.maximum(amax, amax_bits(values).to(amax.device), out=amax)


def encode_raw_amax(src: torch.Tensor, out: torch.Tensor, amax: torch.Tensor) -> None:
    """The raw segment's values of src (uint8 `out`, its payload bytes) with src's NVFP4
    amax bits into amax (int32 of one element, overwritten): what a sender packs for a
    receiver that quantizes into NVFP4 storage in one read. On CUDA with triton the amax
    kernel stores the words it reads, so src is read once; elsewhere a copy, then a fold
    over the bytes just written."""
    from refitd.formats import triton_kernels

    values = out.view(src.dtype).view(src.shape)
    amax.zero_()
    one_read = src.is_cuda and out.device == src.device and src.dtype != torch.float64
    if one_read and triton_kernels.available():
        triton_kernels.nvfp4_amax_into(src, amax, out=values)
        return
    values.copy_(src)
    fold_amax(values.reshape(-1), amax)


def decode_raw_known_amax(
    seg: torch.Tensor,
    shape: tuple[int, ...],
    src_dtype: str,
    dst: DestRegion,
    amax: torch.Tensor,
    registry: TransformRegistry | None = None,
) -> None:
    """decode_segment of a raw segment into NVFP4 storage whose amax bits a step that
    read the segment folded (fold_amax): one read of the segment, the same bytes."""
    from refitd.formats.nvfp4 import nvfp4_quantize_into

    if dst.storage != NVFP4 or dst.shape != tuple(shape):
        raise ValueError(
            f"decode_raw_known_amax: a {tuple(shape)} segment cannot land in {dst.storage} "
            f"storage of region {dst.shape} with a known amax"
        )
    (values,) = (registry or default_registry()).get(RAW).prepare_recv(seg, shape, src_dtype)
    nvfp4_quantize_into(values, *dst.parts(), amax=amax)


def copy_region(src: torch.Tensor, dst: DestRegion, amax: torch.Tensor | None = None) -> None:
    """A local copy (same slot) without a wire buffer: cast, or quantize into quantized
    storage. amax: src's NVFP4 amax bits when a step that read src folded them (an NVFP4
    destination then quantizes in one read of src)."""
    if tuple(src.shape) != dst.shape:
        raise ValueError(
            f"copy_region: source shape {tuple(src.shape)} does not match the destination "
            f"region {dst.shape}"
        )
    if amax is not None and dst.storage == NVFP4:
        from refitd.formats.nvfp4 import nvfp4_quantize_into

        nvfp4_quantize_into(src, *dst.parts(), amax=amax)
        return
    store_region(src, dst)

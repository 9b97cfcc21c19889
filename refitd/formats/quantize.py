"""Quantizing into existing buffers: the Triton kernel on CUDA tensors when triton is
installed (bit-identical to the torch reference), else the format's torch reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refitd.formats import triton_kernels
from refitd.formats.fp8 import check_buffer, check_float


def quantize_into(
    fmt: str,
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    scale_dtype: torch.dtype,
    scale_shape: tuple[int, ...],
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Quantize x into existing buffers of format `fmt` ("mxfp8" or "fp8_block").

    Checks the buffers, then uses the Triton kernel `{fmt}_quantize_into` for CUDA tensors
    when triton is installed (bit-identical to the torch reference), else `reference`.
    """
    check_float(x, f"{fmt} quantize")
    check_buffer(data, torch.uint8, tuple(x.shape), f"{fmt} data")
    check_buffer(scales, scale_dtype, scale_shape, f"{fmt} scales")
    if x.numel() == 0:
        return
    if x.is_cuda and triton_kernels.available():
        getattr(triton_kernels, f"{fmt}_quantize_into")(x, data, scales)
        return
    codes, scale_values = reference(x)
    data.copy_(codes)
    scales.copy_(scale_values)

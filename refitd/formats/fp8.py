"""E4M3 helpers shared by the quantized formats: saturating casts, IEEE bit views and the
checks of their inputs and buffers.

Both quantizers find a block's amax on the integer view of |x| (for non-negative floats
the integer order is the float order, and NaN/Inf sort above every finite value), so the
amax and the non-finite test are exact and identical on every backend.
"""

from __future__ import annotations

import torch

from refitd.plan.wire import nvfp4_data_shape, nvfp4_scale_shape

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
F32_EXP_MASK = 0x7F800000
F32_ABS_MASK = 0x7FFFFFFF

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float(x: torch.Tensor, what: str) -> None:
    """A clear error for tensors a quantizer cannot read."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what}: expected a float tensor ({FLOAT_DTYPES}), got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: cannot quantize a 0-d tensor")


def check_buffer(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> None:
    """Output buffers must already have the exact dtype and shape (they are written in place)."""
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{what}: expected {dtype} of shape {tuple(shape)}, got {t.dtype} of shape "
            f"{tuple(t.shape)}"
        )


def check_packed_pairs(shape: tuple[int, ...], what: str) -> None:
    """NVFP4 packs two values per byte along the last dim, which must therefore be even."""
    if not shape or shape[-1] % 2:
        raise ValueError(
            f"{what}: NVFP4 packs two values per byte along the last dim, which must be even; "
            f"got shape {shape}"
        )


def check_global_scale(t: torch.Tensor, what: str) -> None:
    """A tensor scale (NVFP4's global scale) is a float32 tensor of one element (any shape:
    (), (1,), ...)."""
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(
            f"{what}: expected a float32 tensor of one element, got {t.dtype} of shape "
            f"{tuple(t.shape)}"
        )


def check_nvfp4_buffers(
    shape: tuple[int, ...],
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    what: str,
) -> None:
    """The three NVFP4 buffers of element shape `shape` (even last dim): packed data and
    E4M3 scale bytes of their exact shapes, and a float32 global scale of one element."""
    check_packed_pairs(shape, what)
    check_buffer(data, torch.uint8, nvfp4_data_shape(shape), "nvfp4 data")
    check_buffer(scales, torch.uint8, nvfp4_scale_shape(shape), "nvfp4 scales")
    check_global_scale(global_scale, "nvfp4 global scale")


def abs_bits(x32: torch.Tensor) -> torch.Tensor:
    """IEEE bits of |x| as int32 (x must be float32)."""
    return x32.view(torch.int32) & F32_ABS_MASK


def to_e4m3_codes(x32: torch.Tensor) -> torch.Tensor:
    """Round float32 to E4M3 (nearest, ties to even) with saturation at +-448; uint8 codes."""
    return x32.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """Exact float64 values of uint8 E4M3 codes (0x7F/0xFF are NaN)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float64)

"""Passthrough: values travel in the source dtype and land with a configured cast.

Casts are allowed between float dtypes (bf16, fp16, fp32, fp64); other dtypes must match
exactly, so an integer tensor is never silently converted to a float one or back.
"""

from __future__ import annotations

import torch

CASTABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_cast(src: torch.dtype, dst: torch.dtype, what: str = "copy") -> None:
    """A clear error for a cast passthrough does not allow."""
    if src != dst and not (src in CASTABLE and dst in CASTABLE):
        raise TypeError(
            f"{what}: cannot cast {src} to {dst}; casts are allowed between {CASTABLE} only"
        )


def cast_copy(src: torch.Tensor, dst: torch.Tensor, what: str = "copy") -> None:
    """Copy src into dst in place, casting between float dtypes (round to nearest even)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
    check_cast(src.dtype, dst.dtype, what)
    dst.copy_(src)

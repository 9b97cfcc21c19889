"""Torch dtypes by name and back: the names ("bfloat16", "float32") that plans, programs and
memory handles carry, for the layers that hold tensors (formats, transport, client, agent).

It imports torch and nothing else of refitd, so every one of those layers may import it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

_DTYPE_NAMES: Mapping[torch.dtype, str] = types.MappingProxyType(
    {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the names refitd.plan.wire uses)."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16, with a clear error for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dtype

"""`nvshmem`: optional placeholder for one-sided GPU transfers over NVSHMEM.

It needs a CUDA build of torch with NVSHMEM support (torch.distributed._symmetric_memory
with the NVSHMEM backend), the libnvshmem host and device libraries, and GPUs connected by
NVLink or InfiniBand/RoCE with GPUDirect RDMA. None of this exists on a CPU machine, so the
transport reports clearly that it is unavailable instead of failing later.
"""

from __future__ import annotations

import ctypes.util

import torch

from refitd.transport.base import ConnectInfo, Transport, TransportError, Work


def nvshmem_unavailable_reason() -> str | None:
    """Why NVSHMEM cannot be used here, or None if its prerequisites are present."""
    if not torch.cuda.is_available():
        return "no CUDA device (nvshmem needs GPUs)"
    if ctypes.util.find_library("nvshmem_host") is None:
        return "libnvshmem_host not found (install NVSHMEM and add it to the library path)"
    return None


class NvshmemTransport(Transport):
    name = "nvshmem"

    def connect(self, info: ConnectInfo) -> None:
        reason = nvshmem_unavailable_reason()
        raise TransportError(
            f"nvshmem transport unavailable: {reason or 'not implemented in this build; use nccl'}"
        )

    @property
    def rank(self) -> int:
        raise TransportError("nvshmem transport is not connected")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        raise TransportError("nvshmem transport is not connected")

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        raise TransportError("nvshmem transport is not connected")

    def close(self) -> None:
        pass

"""Host staging of the delta path for slots whose tensors live on a CUDA device.

The delta codec runs on host memory, so a slot on a device stages through pinned host
memory. A sender copies the live segments of a message's copies into one pinned host
buffer (the copies are queued on the device's current stream, after whatever was queued
there before, and waited once per message) and encodes them against its host base as a CPU
slot does: `HostSources` is the message's CopyAccess reading that buffer. A receiver copies
the destination streams of a copy to pinned host memory, applies the delta there and copies
the reconstructed streams back (`through_host`): its base stays the destination memory
itself, the memory the controller's version log speaks of. A dense payload is copied to the
device once per message and lands as the executor lands it.

Every helper takes tensors of any device, CPU included (no pinning there): the same code
path runs with CPU tensors standing for the device side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from refitd.executor.segments import ResolvedTensor
from refitd.formats.delta import DeltaStats
from refitd.plan.wire import RAW, aligned
from refitd.torch_dtypes import torch_dtype


class HostStagingError(RuntimeError):
    """A device slot's delta message cannot be staged through host memory."""


def on_device_memory(device: torch.device) -> bool:
    """True for memory outside the host's (a delta message there stages through the host)."""
    return device.type != "cpu"


def host_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device, what: str
               ) -> torch.Tensor:  # fmt: skip
    """Host memory to stage `device` memory through: pinned for a CUDA device (so the copies
    run asynchronously on its stream), plain for the CPU; any other device is an error."""
    if device.type == "cpu":
        return torch.empty(tuple(shape), dtype=dtype)
    if device.type != "cuda":
        raise HostStagingError(f"{what}: the delta path stages only CUDA devices, not {device}")
    try:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    except RuntimeError as e:
        raise HostStagingError(
            f"{what}: staging {device} memory through the host needs pinned host memory "
            f"({shape} {dtype}), which could not be allocated: {e}"
        ) from e


def wait(device: torch.device) -> None:
    """Wait for the copies queued on the device's current stream (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HostSources:
    """The CopyAccess of one sent message whose sources live on a device: its copies' live
    segments read from one host buffer filled at construction (module docstring)."""

    def __init__(self, access: object, rows: Sequence[int], device: torch.device, what: str
                 ) -> None:  # fmt: skip
        self._access = access
        self._at: dict[int, tuple[int, int]] = {}
        pos = 0
        for r in rows:
            n = access.seg_nbytes(r)  # type: ignore[attr-defined]
            self._at[r] = (pos, n)
            pos += aligned(n)
        self._buf = host_empty((pos,), torch.uint8, device, what)
        for r in rows:
            seg = self.segment(r)
            if access.wire(r) == RAW:  # type: ignore[attr-defined]
                block = access.src_block(r)  # type: ignore[attr-defined]
                raw = seg[: block.numel() * block.element_size()]
                raw.view(block.dtype).view(block.shape).copy_(block, non_blocking=True)
                seg[raw.numel() :].zero_()  # alignment padding
            else:  # converted on the device, then copied (padding between parts zeroed)
                out = torch.zeros(n, dtype=torch.uint8, device=device)
                access.encode(r, out)  # type: ignore[attr-defined]
                seg.copy_(out, non_blocking=True)
        wait(device)

    def segment(self, row: int) -> torch.Tensor:
        pos, n = self._at[row]
        return self._buf[pos : pos + n]

    def wire(self, row: int) -> str:
        return self._access.wire(row)  # type: ignore[attr-defined]

    def shape(self, row: int) -> tuple[int, ...]:
        return self._access.shape(row)  # type: ignore[attr-defined]

    def src_dtype(self, row: int) -> str:
        return self._access.src_dtype(row)  # type: ignore[attr-defined]

    def seg_nbytes(self, row: int) -> int:
        return self._at[row][1]

    def src_block(self, row: int) -> torch.Tensor:
        """The staged source block (raw wire: the segment is the block's bytes)."""
        if self.wire(row) != RAW:
            raise ValueError(f"copy row {row}: no source block on the {self.wire(row)} wire")
        dtype, shape = torch_dtype(self.src_dtype(row)), self.shape(row)
        n = math.prod(shape) * dtype.itemsize
        return self.segment(row)[:n].view(dtype).view(shape)

    def dst(self, row: int) -> tuple[ResolvedTensor, tuple[int, ...]]:
        return self._access.dst(row)  # type: ignore[attr-defined]

    def encode(self, row: int, out: torch.Tensor) -> None:
        out.copy_(self.segment(row))

    def decode(self, row: int, seg: torch.Tensor) -> None:
        self._access.decode(row, seg)  # type: ignore[attr-defined]


def through_host(
    streams: Sequence[torch.Tensor],
    apply: Callable[[list[torch.Tensor]], DeltaStats],
    what: str,
) -> DeltaStats:
    """`apply` run on host copies of device `streams` (the destination views of one copy),
    which then receive the result: the device memory is read once and written once."""
    device = streams[0].device
    host = [host_empty(s.shape, s.dtype, device, what) for s in streams]
    for h, s in zip(host, streams, strict=True):
        h.copy_(s, non_blocking=True)
    wait(device)
    stats = apply(host)
    for s, h in zip(streams, host, strict=True):
        s.copy_(h, non_blocking=True)
    wait(device)  # the host copies are freed on return
    return stats

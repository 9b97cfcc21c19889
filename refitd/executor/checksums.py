"""64-bit positional checksums of tensor regions, for verifying landed versions.

The checksum of a region is over its bytes in row-major order (what a raw wire segment
carries), read as little-endian int32 words w_0..w_{n-1} (the tail zero-padded to a word),
each sign-extended to 64 bits:

    H = sum_i w_i * (2 * A * i + 1)   (mod 2**64),   A = 0x9E3779B97F4A7C15

computed with torch integer ops in blocks, so it runs on the tensor's device (CPU or CUDA)
and never copies more than one block; on CUDA with triton, one kernel pass
(refitd.formats.grouped) computes the same value. Integer sums wrap, so the result does
not depend on reduction order: deterministic on every device. Guarantees: any change
confined to one word changes H (each weight is odd, |w_i - w'_i| < 2**33), and so does
swapping two different words of a region under 4 GiB (the weight difference 2A(i - j) has
too few factors of two to cancel). Like every linear checksum it can miss crafted multi-word changes; it guards
against torn, misplaced or stale data, not against an adversary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from refitd.formats.grouped import GroupedLanding

MASK = (1 << 64) - 1
A = 0x9E3779B97F4A7C15
COMBINE = 0x100000001B3  # FNV-64 prime: combines a message's copy checksums in order
CPU_BLOCK_WORDS = 1 << 16  # 512 KiB of int64 temporaries: stays in cache
CUDA_BLOCK_WORDS = 1 << 24  # fewer kernel launches
FUSED_VIEWS = 4096  # views whose checksum kernel tables a Checksummer keeps


def _signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


class Checksummer:
    """Computes region checksums; keeps one block of position weights per device and, on
    CUDA, the checksum kernel's tables per view (a program checksums the same views every
    refit: building the tables costs blocking host-to-device copies)."""

    def __init__(self, block_words: int | None = None) -> None:
        self.block_words = block_words
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._fused: dict[tuple, GroupedLanding | None] = {}

    def _block(self, device: torch.device) -> int:
        if self.block_words is not None:
            return self.block_words
        return CUDA_BLOCK_WORDS if device.type == "cuda" else CPU_BLOCK_WORDS

    def _weights_for(self, device: torch.device, n: int) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None:
            w = torch.arange(self._block(device), dtype=torch.int64, device=device)
            w = w.mul_(_signed(2 * A)).add_(1)
            self._weights[device] = w
        return w[:n]

    def tensor(self, region: torch.Tensor) -> torch.Tensor:
        """H of `region` (any strides, any dtype) as a 0-d int64 tensor on its device; the
        computation is queued on the current stream (no host sync)."""
        if region.is_cuda and self.block_words is None:
            fused = self._fused_sum(region)
            if fused is not None:
                return fused
        flat = region.contiguous().reshape(-1).view(torch.uint8)
        if flat.storage_offset() % 4:
            flat = flat.clone()
        n = flat.numel()
        nw = n // 4
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        words = flat[: nw * 4].view(torch.int32)
        if n % 4:  # the zero-padded tail word, at position nw
            tail = torch.zeros(4, dtype=torch.uint8, device=flat.device)
            tail[: n % 4] = flat[nw * 4 :]
            total += tail.view(torch.int32).to(torch.int64)[0] * _signed(2 * A * nw + 1)
        block = self._block(flat.device)
        for b0 in range(0, words.numel(), block):
            x = words[b0 : b0 + block].to(torch.int64)
            # weights of positions b0 + j: w_j + 2A * b0, so H_block = x.w + 2A*b0 * sum(x)
            if b0:
                total += x.sum() * _signed(2 * A * b0)
            total += x.mul_(self._weights_for(x.device, x.numel())).sum()
        return total

    def _fused_sum(self, region: torch.Tensor) -> torch.Tensor | None:
        """H by the grouped checksum kernel (tables built once per view), or None where it
        does not take the view."""
        from refitd.formats import grouped

        key = (region.device, region.data_ptr(), region.dtype, region.shape, region.stride())
        if key not in self._fused:
            if len(self._fused) >= FUSED_VIEWS:
                self._fused.clear()
            self._fused[key] = grouped.hash_landing([region])
        landing = self._fused[key]
        return None if landing is None else landing.hash_only()[0]

    def __call__(self, region: torch.Tensor) -> int:
        """H of `region` as an unsigned 64-bit Python int."""
        return int(self.tensor(region).item()) & MASK


def checksum(region: torch.Tensor) -> int:
    """H of one region (see the module docstring), unsigned 64-bit."""
    return Checksummer()(region)


def combine(sums: Iterable[int]) -> int:
    """One checksum for an ordered sequence of region checksums (a message's copies)."""
    h = 0
    for s in sums:
        h = (h * COMBINE + (s & MASK) + 1) & MASK
    return h

"""Successive weight versions as an RL trainer produces them: FP32 master weights moved by
Adam-like steps of +-lr per element, published as BF16.

With a tiny learning rate most BF16 values do not move from one version to the next (the
FP32 change is below half a BF16 ulp); how many do is measured (changed_fraction), never
assumed. Adam's normalised step m_hat / sqrt(v_hat) has magnitude about 1 for each element,
so a step of lr * sign(g) with a random sign per element and step is its stand-in, at the
cost of one FP32 master copy (no moment buffers). Work is done in chunks so the scratch
memory stays bounded for GiB-sized models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK = 1 << 22


@dataclass
class VersionGenerator:
    """numel FP32 master weights ~ N(0, std); step() applies one +-lr update and writes the
    BF16 (or `dtype`) version into `out`."""

    numel: int
    lr: float
    seed: int = 0
    std: float = 0.02
    dtype: torch.dtype = torch.bfloat16
    master: torch.Tensor = field(init=False, repr=False)
    version: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.numel <= 0 or self.lr < 0:
            raise ValueError(f"VersionGenerator: numel {self.numel} and lr {self.lr} invalid")
        g = torch.Generator().manual_seed(self.seed)
        self.master = torch.empty(self.numel, dtype=torch.float32)
        for a in range(0, self.numel, CHUNK):
            self.master[a : a + CHUNK].normal_(0.0, self.std, generator=g)
        self._gen = torch.Generator().manual_seed(self.seed + 1)

    def current(self, out: torch.Tensor) -> torch.Tensor:
        """Write the current version into out (numel elements of `dtype`)."""
        flat = out.view(-1)
        if flat.numel() != self.numel or out.dtype != self.dtype:
            raise ValueError(f"out must hold {self.numel} {self.dtype}, got {out.dtype}")
        for a in range(0, self.numel, CHUNK):
            flat[a : a + CHUNK].copy_(self.master[a : a + CHUNK])
        return out

    def step(self, out: torch.Tensor) -> torch.Tensor:
        """Advance the master weights by one +-lr step and write the new version into out."""
        for a in range(0, self.numel, CHUNK):
            m = self.master[a : a + CHUNK]
            sign = torch.randint(0, 2, (m.numel(),), generator=self._gen, dtype=torch.int8)
            m.add_(sign.to(torch.float32).mul_(2 * self.lr).sub_(self.lr))
        self.version += 1
        return self.current(out)


def changed_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements whose bit patterns differ between two same-dtype tensors."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"changed_fraction: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    n = a.numel()
    diff = sum(
        int((x != y).sum())
        for x, y in zip(
            a.reshape(-1).view(ints).split(CHUNK),
            b.reshape(-1).view(ints).split(CHUNK),
            strict=True,
        )
    )
    return diff / n if n else 0.0


def perturb(x: torch.Tensor, density: float, seed: int) -> float:
    """Give about `density` of x's elements a fresh random value in place (for a forced
    high-density version); returns the fraction that actually changed."""
    g = torch.Generator().manual_seed(seed)
    before = x.clone()
    flat = x.view(-1)
    pick = torch.rand(flat.numel(), generator=g) < density
    flat[pick] = (torch.randn(int(pick.sum()), generator=g) * 0.02).to(x.dtype)
    return changed_fraction(before, x)

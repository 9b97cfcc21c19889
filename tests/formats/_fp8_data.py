"""Test data with the hard cases for the FP8 quantizers."""

from __future__ import annotations

import math

import numpy as np
import torch


def special_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, block: int
) -> torch.Tensor:
    """Random data with the hard cases: zeros, zero blocks, subnormals, exact block maxima,
    rounding ties, values per block across a wide exponent range, NaN and +-Inf."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, size=n // block + 1).repeat(block)[:n]
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.02] = -0.0
    tiny = np.float64(torch.finfo(dtype).tiny)
    sub = rng.random(n) < 0.03
    x[sub] = tiny * rng.uniform(-0.9, 0.9, size=int(sub.sum()))  # subnormals of dtype
    if n >= 3 * block:
        x[:block] = 0.0  # an all-zero block
        x[block : 2 * block] = tiny * rng.uniform(-0.5, 0.5, size=block)  # all-subnormal block
        k = 2 * block
        x[k : k + 8] = [256.0, 1.0625, 1.1875, 1.5 * 2**-9, 2**-10, -448.0, 300.0, 1.75]
    if n > 8:
        x[rng.integers(0, n)] = 448.0 * 2.0 ** rng.integers(-10, 10)  # exactly at a block max
        x[rng.integers(0, n)] = 2.0 ** rng.integers(-10, 10)  # a power of two
    t = torch.from_numpy(x).reshape(shape).to(dtype)
    if n >= 6 * block:
        flat = t.view(-1)
        flat[4 * block + 3] = math.nan
        flat[5 * block + 7] = math.inf
        flat[-1] = -math.inf
    return t

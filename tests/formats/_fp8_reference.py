"""An independent, element-by-element reference for the FP8 codecs (pure Python + NumPy).

Written from the format definitions, not from refitd.formats: E4M3 rounding picks the
nearest of the 126 finite positive E4M3 values (ties to the even code) after saturating.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

BLOCK = 32
TILE = 128


def _e4m3_value(code: int) -> float:
    e, m = code >> 3, code & 7
    return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


POSITIVE = [_e4m3_value(c) for c in range(0x7F)]  # 0x00..0x7E; 0x7F is NaN


def e4m3_code(v: float) -> int:
    """Finite float -> E4M3 code, nearest with ties to even, saturating at 448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(POSITIVE, a)
    if i < len(POSITIVE) and POSITIVE[i] == a:
        return sign | i
    lo, hi = i - 1, i
    dlo, dhi = a - POSITIVE[lo], POSITIVE[hi] - a
    if dlo < dhi or (dlo == dhi and lo % 2 == 0):
        return sign | lo
    return sign | hi


def mxfp8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: float64 array holding the float32 values; returns (codes, E8M0 bytes)."""
    rows = x.reshape(-1, x.shape[-1])
    nb = -(-x.shape[-1] // BLOCK)
    codes = np.zeros(rows.shape, dtype=np.uint8)
    scales = np.zeros((rows.shape[0], nb), dtype=np.uint8)
    for r in range(rows.shape[0]):
        for b in range(nb):
            block = [float(v) for v in rows[r, b * BLOCK : (b + 1) * BLOCK]]
            if not all(math.isfinite(v) for v in block):
                scales[r, b] = 0xFF
                codes[r, b * BLOCK : b * BLOCK + len(block)] = 0x7F
                continue
            amax = max(abs(v) for v in block)
            if amax == 0:
                exp = -127
            else:
                _, e = math.frexp(amax)  # amax = m * 2^e, 0.5 <= m < 1
                exp = max(-127, min(127, (e - 1) - 8))
            scales[r, b] = exp + 127
            for j, v in enumerate(block):
                codes[r, b * BLOCK + j] = e4m3_code(v / 2.0**exp)
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], nb)


def fp8_block_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: float64 array holding float32 values, ndim >= 1; returns (codes, float32 scales)."""
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    lead = x2.shape[:-2]
    mats = x2.reshape(-1, *x2.shape[-2:])
    nr, nc = -(-mats.shape[1] // TILE), -(-mats.shape[2] // TILE)
    codes = np.zeros(mats.shape, dtype=np.uint8)
    scales = np.zeros((mats.shape[0], nr, nc), dtype=np.float32)
    for k in range(mats.shape[0]):
        for tr in range(nr):
            for tc in range(nc):
                rs, cs = slice(tr * TILE, (tr + 1) * TILE), slice(tc * TILE, (tc + 1) * TILE)
                tile = mats[k, rs, cs].astype(np.float32)
                if not np.all(np.isfinite(tile)):
                    scales[k, tr, tc] = np.nan
                    codes[k, rs, cs] = 0x7F
                    continue
                amax = np.float32(np.max(np.abs(tile)))
                scale = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(448.0))
                scales[k, tr, tc] = scale
                out = codes[k, rs, cs]
                for (i, j), v in np.ndenumerate(tile):
                    out[i, j] = e4m3_code(float(np.float32(v / scale)))
    return codes.reshape(x.shape), scales.reshape(*lead, nr, nc) if x.ndim > 1 else scales.reshape(
        1, nc
    )

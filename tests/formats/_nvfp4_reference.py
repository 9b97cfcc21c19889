"""An independent, element-by-element NVFP4 encoder and decoder (Python + NumPy scalars).

Written from the format's definition, not from refitd.formats: the 16 E2M1 codes as a
table, the nearest magnitude found by search (ties to the even code), float32 steps as
NumPy float32 scalar operations, E4M3 rounding from _fp8_reference.
"""

from __future__ import annotations

import math

import numpy as np
from _fp8_reference import _e4m3_value, e4m3_code

f32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
DECODE = E2M1 + [-v for v in E2M1]  # the 16 codes: sign bit 3, magnitude bits 0-2
BLOCK = 16


def e2m1_code(q: float, negative: bool) -> int:
    """Nibble of a float32 value q after saturation at 6: nearest magnitude, ties to even."""
    a = min(abs(q), 6.0)
    dist = [abs(a - v) for v in E2M1]
    best = min(dist)
    ties = [i for i, d in enumerate(dist) if d == best]
    m = ties[0] if len(ties) == 1 else next(i for i in ties if i % 2 == 0)
    return m | (8 if negative else 0)


def nvfp4_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """x: float32 array, even last dim -> (packed uint8 data, E4M3 scale bytes, D)."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    finite = rows[np.isfinite(rows)]
    amax = max(f32(np.abs(finite).max()) if finite.size else f32(0), f32(1e-8))
    encode = f32(2688.0) / amax
    decode = f32(1.0) / encode
    n = rows.shape[1]
    nb = -(-n // BLOCK)
    codes = np.zeros(rows.shape, np.uint8)
    scales = np.zeros((rows.shape[0], nb), np.uint8)
    for r in range(rows.shape[0]):
        for b in range(nb):
            block = rows[r, b * BLOCK : (b + 1) * BLOCK]
            if not np.all(np.isfinite(block)):
                scales[r, b] = 0x7F
                continue
            bmax = f32(np.abs(block).max())
            s = min(encode * (bmax * f32(1.0 / 6.0)), f32(448.0))
            scales[r, b] = e4m3_code(float(s))
            sf = f32(_e4m3_value(int(scales[r, b])))
            mult = f32(0.0) if sf == 0 else f32(1.0) / (sf * decode)
            for j, v in enumerate(block):
                codes[r, b * BLOCK + j] = e2m1_code(float(v * mult), bool(np.signbit(v)))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return (
        packed.reshape(*x.shape[:-1], n // 2),
        scales.reshape(*x.shape[:-1], nb),
        decode,
    )


def nvfp4_decode(data: np.ndarray, scales: np.ndarray, decode: float) -> np.ndarray:
    """float32 values of packed data: E2M1(code) * f32(E4M3(scale) * D), per element."""
    d = data.reshape(-1, data.shape[-1])
    s = scales.reshape(-1, scales.shape[-1])
    out = np.zeros((d.shape[0], 2 * d.shape[1]), np.float32)
    for r in range(d.shape[0]):
        for i in range(out.shape[1]):
            byte = int(d[r, i // 2])
            code = byte & 0xF if i % 2 == 0 else byte >> 4
            sc = _e4m3_value(int(s[r, i // BLOCK]) & 0x7F)
            if int(s[r, i // BLOCK]) & 0x7F == 0x7F:
                sc = math.nan
            out[r, i] = f32(DECODE[code]) * (f32(sc) * f32(decode))
    return out.reshape(*data.shape[:-1], 2 * data.shape[-1])

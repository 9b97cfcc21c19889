"""`python -m refitd.formats.delta`: compile the codec's kernels into numba's on-disk cache.

numba compiles a kernel on its first call per element width (seconds each) and keeps the
machine code on disk; running this once after an install (the Makefile does) means no
transfer process or test pays that on its first delta. Prints the seconds it took.
"""

from __future__ import annotations

import time

import numpy as np

from refitd.formats.delta.streams import apply_stream, encode_stream


def compile_kernels() -> float:
    """Encode and apply a small delta with every block kind at every element width."""
    t0 = time.monotonic()
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        base = np.zeros(4 * 4096, dtype=dtype)
        live = base.copy()
        live[5] = 1  # an INDEX block, a BITMAP block and a DENSE block
        live[4096 : 4096 + 2048] = 1
        live[2 * 4096 :] = 1
        delta, _ = encode_stream(base, live)
        apply_stream(delta, base)
        if not np.array_equal(base, live):
            raise RuntimeError(f"delta kernels for {np.dtype(dtype)} do not round-trip")
    return time.monotonic() - t0


if __name__ == "__main__":
    print(f"delta codec kernels ready in {compile_kernels():.1f} s")

"""`python -m refitd.formats.delta`: compile the codec's kernels into numba's on-disk cache.

numba compiles a kernel on its first call per element width (seconds each) and keeps the
machine code on disk; running this once after an install (the Makefile does) means no
transfer process or test compiles them. Prints the seconds it took.
"""

from __future__ import annotations

import time

from refitd.formats.delta.streams import load_kernels

if __name__ == "__main__":
    t0 = time.monotonic()
    load_kernels()
    print(f"delta codec kernels ready in {time.monotonic() - t0:.1f} s")

"""The heap of the controller's process: glibc told how to keep a plan's large arrays.

A plan allocates and frees NumPy arrays of tens of MB by the hundred; the controller keeps
them in glibc's heap (`keep_plan_heap`, at start) and gives the free part back to the OS
once a plan's programs are encoded (`release_free_heap`); a planning process keeps all
it frees (`keep_freed_heap`). All do nothing off glibc.
"""

from __future__ import annotations

import contextlib
import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MAP_ABOVE = 1 << 30  # blocks of this size and more get their own mapping
_TRIM_ABOVE = 64 << 20  # free memory kept at the top of the heap
_TRIM_NEVER = (1 << 31) - 1  # the largest trim threshold mallopt takes (an int)


def keep_plan_heap() -> None:
    """Have glibc serve NumPy's large blocks (up to 1 GiB) from its heap and keep up to
    64 MB free at its top (mallopt; nothing elsewhere). A plan allocates and frees arrays
    of tens of MB by the hundred; mapped afresh each time (glibc's default above 32 MB),
    every one faults in zeroed pages: 80-150k faults per plan at 1,024 ranks, a tenth of
    its time. Kept in the heap, the pages are reused; release_free_heap hands the rest
    back once the programs are encoded. NumPy's huge page advice goes off too
    (_no_huge_page_advice). Process-wide: the controller sets it at start."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MAP_ABOVE)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)
    _no_huge_page_advice()


def keep_freed_heap() -> None:
    """Have glibc keep the heap's freed memory for good (mallopt; nothing elsewhere): for
    a planning process, which exits once its plan is written. Trimmed, the top of its
    heap (a plan's transient arrays, each chunk of program copy columns) goes back to the
    OS and the next arrays fault the same pages in afresh: about 40k of 450k faults at
    4,096 ranks."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER)


def _no_huge_page_advice() -> None:
    """Stop NumPy advising huge pages for its arrays (its default on Linux): where the
    kernel's huge pages are on request only, each advised first touch may wait for the
    kernel to compact memory into a huge page. A 4,096-rank plan and its programs first
    touch gigabytes; without the advice they take about a third less CPU time."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # NumPy 2, NumPy 1
    with contextlib.suppress(AttributeError):  # a NumPy without the switch
        core.multiarray._set_madvise_hugepage(False)


def release_free_heap() -> None:
    """Give the heap's free memory back to the OS (glibc's malloc_trim; nothing elsewhere).
    glibc keeps freed NumPy blocks under its growing mmap threshold (up to 32 MB) in its
    arenas, so a plan's transient peak and its released program index (240 MB at 1,024
    ranks) would stay in the controller's RSS for good. A few milliseconds."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)

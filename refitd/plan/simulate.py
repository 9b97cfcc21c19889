"""In-memory reference executor (NumPy): the oracle of the planner's tests.

Replays every slot's program: local copies, then each message packed into a byte buffer
segment by segment (SEGMENT_ALIGN-aligned, raw wire) and unpacked at its receiver, so a
plan is checked exactly as an agent would run it.
"""

from __future__ import annotations

import numpy as np

from refitd.plan.planner import Plan
from refitd.plan.program import Copy
from refitd.plan.wire import RAW, aligned


def _region(c_off: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(c_off, shape, strict=True))


def execute(
    plan: Plan, src_arrays: dict[int, np.ndarray], dst_arrays: dict[int, np.ndarray]
) -> None:
    """Run the plan: dst_arrays (by plan tensor index) are written in place from
    src_arrays; a destination of another dtype receives the value cast (astype)."""
    programs = [plan.program(s) for s in plan.slots()]
    wire: dict[int, bytes] = {}
    for p in programs:
        for c in p.local:
            _store(
                dst_arrays[c.dst_tensor],
                c,
                src_arrays[c.src_tensor][_region(c.src_offset, c.shape)],
            )
        for m in p.sends:
            buf = bytearray(m.nbytes)
            at = 0
            for c in m.copies:
                if c.wire != RAW:
                    raise ValueError(f"simulate runs raw wire only, got {c.wire!r}")
                data = np.ascontiguousarray(
                    src_arrays[c.src_tensor][_region(c.src_offset, c.shape)]
                )
                raw = data.tobytes()
                buf[at : at + len(raw)] = raw
                at += aligned(len(raw))
            if at != m.nbytes:
                raise AssertionError(f"message {m.id}: packed {at} bytes, nbytes says {m.nbytes}")
            wire[m.id] = bytes(buf)
    for p in programs:
        for m in p.recvs:
            buf = wire.pop(m.id)
            at = 0
            for c in m.copies:
                src_dtype = src_arrays[c.src_tensor].dtype
                n = int(np.prod(c.shape, dtype=np.int64)) * src_dtype.itemsize
                data = np.frombuffer(buf, dtype=src_dtype, count=n // src_dtype.itemsize, offset=at)
                _store(dst_arrays[c.dst_tensor], c, data.reshape(c.shape))
                at += aligned(n)
    if wire:
        raise AssertionError(f"messages sent but never received: {sorted(wire)}")


def _store(dst: np.ndarray, c: Copy, data: np.ndarray) -> None:
    dst[_region(c.dst_offset, c.shape)] = data.astype(dst.dtype, copy=False)

"""In-memory reference executor (NumPy): the oracle of the planner's tests.

Replays every slot's program: local copies, then each message packed into a byte buffer
segment by segment (SEGMENT_ALIGN-aligned, raw wire) and unpacked at its receiver, round
by round so relays (copies forwarded by a destination replica) are checked against the
round rule, exactly as an agent would run it.
"""

from __future__ import annotations

import numpy as np

from refitd.plan.planner import Plan
from refitd.plan.program import Copy, Message
from refitd.plan.wire import RAW, aligned


def _region(c_off: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(c_off, shape, strict=True))


def execute(
    plan: Plan, src_arrays: dict[int, np.ndarray], dst_arrays: dict[int, np.ndarray]
) -> None:
    """Run the plan: dst_arrays (by plan tensor index) are written in place from
    src_arrays; a destination of another dtype receives the value cast (astype).

    Local copies from source tensors run first; then rounds in order, every message of a
    round packed before any of them is unpacked (so a relay that forwards data of its own
    round or a later one reads stale bytes and the oracle catches it); local relays last.
    """
    programs = [plan.program(s) for s in plan.slots()]
    arrays = {**src_arrays, **dst_arrays}
    local_relays = []
    for p in programs:
        for c in p.local:
            if c.src_tensor in src_arrays:
                _store(arrays[c.dst_tensor], c, _read(arrays, c))
            else:
                local_relays.append(c)
    recvs = {m.id: m for p in programs for m in p.recvs}
    sends = sorted((m for p in programs for m in p.sends), key=lambda m: (m.round, m.id))
    if sorted(recvs) != sorted(m.id for m in sends):
        raise AssertionError("sent and received message ids differ")
    i = 0
    while i < len(sends):
        j = i
        while j < len(sends) and sends[j].round == sends[i].round:
            j += 1
        wire = [(m.id, _pack(arrays, m)) for m in sends[i:j]]
        for mid, buf in wire:
            _unpack(arrays, recvs[mid], buf)
        i = j
    for c in local_relays:
        _store(arrays[c.dst_tensor], c, _read(arrays, c))


def _read(arrays: dict[int, np.ndarray], c: Copy) -> np.ndarray:
    return arrays[c.src_tensor][_region(c.src_offset, c.shape)]


def _pack(arrays: dict[int, np.ndarray], m: Message) -> bytes:
    buf = bytearray(m.nbytes)
    at = 0
    for c in m.copies:
        if c.wire != RAW:
            raise ValueError(f"simulate runs raw wire only, got {c.wire!r}")
        raw = np.ascontiguousarray(_read(arrays, c)).tobytes()
        buf[at : at + len(raw)] = raw
        at += aligned(len(raw))
    if at != m.nbytes:
        raise AssertionError(f"message {m.id}: packed {at} bytes, nbytes says {m.nbytes}")
    return bytes(buf)


def _unpack(arrays: dict[int, np.ndarray], m: Message, buf: bytes) -> None:
    at = 0
    for c in m.copies:
        src_dtype = arrays[c.src_tensor].dtype
        n = int(np.prod(c.shape, dtype=np.int64)) * src_dtype.itemsize
        data = np.frombuffer(buf, dtype=src_dtype, count=n // src_dtype.itemsize, offset=at)
        _store(arrays[c.dst_tensor], c, data.reshape(c.shape))
        at += aligned(n)


def _store(dst: np.ndarray, c: Copy, data: np.ndarray) -> None:
    dst[_region(c.dst_offset, c.shape)] = data.astype(dst.dtype, copy=False)

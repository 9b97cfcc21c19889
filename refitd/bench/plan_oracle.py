"""In-memory reference executor (NumPy): the oracle of the planner's tests.

Replays every slot's program as it travels: each program is encoded to bytes and decoded
again (refitd.plan.program.codec), then read column by column: local copies, then each message packed
into a byte buffer segment by segment (SEGMENT_ALIGN-aligned) and unpacked at its receiver, round by round so relays (copies forwarded by a destination replica) are checked
against the round rule, exactly as an agent would run it. Raw segments are packed here; another wire format needs a
WireCodec (e.g. one wrapping a refitd.formats Transform), sized by the plan's wire registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refitd.plan.plan import Plan
from refitd.plan.program import SlotProgram, decode_program, encode_program
from refitd.plan.wire import RAW_CODE, WireRegistry, aligned


@dataclass(frozen=True)
class WireCodec:
    """A wire format's encode and decode for the oracle: encode(source block) -> the
    segment's bytes; decode(segment bytes, shape, source dtype) -> the block as landed."""

    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes, tuple[int, ...], np.dtype], np.ndarray]


class _Rows:
    """Copy rows of one program as Python values (the oracle favours clarity)."""

    def __init__(self, p: SlotProgram) -> None:
        c = p.copies
        self.src, self.dst = c.src.tolist(), c.dst.tolist()
        self.nd = c.ndim.tolist()
        self.so, self.do, self.sh = c.src_off.tolist(), c.dst_off.tolist(), c.shape.tolist()
        self.wire = c.wire.tolist()

    def region(self, i: int, dst: bool) -> tuple[slice, ...]:
        off = (self.do if dst else self.so)[i]
        return tuple(slice(off[k], off[k] + self.sh[i][k]) for k in range(self.nd[i]))

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.sh[i][: self.nd[i]])


def shipped_programs(plan: Plan) -> dict[int, SlotProgram]:
    """Every slot's program after a trip through its wire encoding."""
    wires = plan.config.wires
    return {s: decode_program(encode_program(p), s, wires) for s, p in plan.programs().items()}


def execute(
    plan: Plan,
    src_arrays: dict[int, np.ndarray],
    dst_arrays: dict[int, np.ndarray],
    programs: dict[int, SlotProgram] | None = None,
    codecs: dict[str, WireCodec] | None = None,
) -> None:
    """Run the plan: dst_arrays (by plan tensor index) are written in place from
    src_arrays; a destination of another dtype receives the value cast (astype).

    Local copies from source tensors run first; then rounds in order, every message of a
    round packed before any of them is unpacked (so a relay that forwards data of its own
    round or a later one reads stale bytes and the oracle catches it); local relays last.
    codecs: by wire name, for every wire other than raw the plan uses.
    """
    wire = _Wire(plan.config.wires, codecs or {})
    programs = programs if programs is not None else shipped_programs(plan)
    arrays = {**src_arrays, **dst_arrays}
    rows = {s: _Rows(p) for s, p in programs.items()}
    local_relays = []
    sends, recvs = [], {}
    for s, p in programs.items():
        r = rows[s]
        for i in range(p.local_start, len(p.copies)):
            if r.src[i] in src_arrays:
                _copy(arrays, r, i, _read(arrays, r, i))
            else:
                local_relays.append((r, i))
        m = p.send
        sends += [
            (int(m.round[k]), int(m.id[k]), r, int(m.start[k]), int(m.end[k]), int(m.nbytes[k]))
            for k in range(len(m))
        ]
        m = p.recv
        for k in range(len(m)):
            recvs[int(m.id[k])] = (r, int(m.start[k]), int(m.end[k]))
    sends.sort(key=lambda x: (x[0], x[1]))
    if sorted(recvs) != sorted(x[1] for x in sends):
        raise AssertionError("sent and received message ids differ")
    i = 0
    while i < len(sends):
        j = i
        while j < len(sends) and sends[j][0] == sends[i][0]:
            j += 1
        packed = [(x[1], wire.pack(arrays, *x[1:])) for x in sends[i:j]]
        for mid, buf in packed:
            wire.unpack(arrays, *recvs[mid], buf)
        i = j
    for r, k in local_relays:
        _copy(arrays, r, k, _read(arrays, r, k))


def _read(arrays: dict[int, np.ndarray], r: _Rows, i: int) -> np.ndarray:
    return arrays[r.src[i]][r.region(i, False)]


def _copy(arrays: dict[int, np.ndarray], r: _Rows, i: int, data: np.ndarray) -> None:
    dst = arrays[r.dst[i]]
    dst[r.region(i, True)] = data.astype(dst.dtype, copy=False)


@dataclass(frozen=True)
class _Wire:
    """Packs and unpacks messages segment by segment, sized by the plan's registry."""

    wires: WireRegistry
    codecs: dict[str, WireCodec]

    def _nbytes(self, arrays: dict[int, np.ndarray], r: _Rows, i: int) -> int:
        dtype = arrays[r.src[i]].dtype  # bfloat16 arrays are uint16 here: size raw by itemsize
        if r.wire[i] == RAW_CODE:
            return aligned(int(np.prod(r.shape(i), dtype=np.int64)) * dtype.itemsize)
        return self.wires.formats[r.wire[i]].segment_nbytes(r.shape(i), dtype.name)

    def _codec(self, r: _Rows, i: int) -> WireCodec | None:
        if r.wire[i] == RAW_CODE:
            return None
        name = self.wires.formats[r.wire[i]].name
        if name not in self.codecs:
            raise ValueError(f"simulate has no codec for wire {name!r}")
        return self.codecs[name]

    def pack(
        self, arrays: dict[int, np.ndarray], mid: int, r: _Rows, lo: int, hi: int, nbytes: int
    ) -> bytes:
        buf = bytearray(nbytes)
        at = 0
        for i in range(lo, hi):
            codec = self._codec(r, i)
            block = np.ascontiguousarray(_read(arrays, r, i))
            seg = block.tobytes() if codec is None else codec.encode(block)
            size = self._nbytes(arrays, r, i)
            if len(seg) > size:
                raise AssertionError(
                    f"message {mid}: a segment of {len(seg)} bytes, {size} planned"
                )
            buf[at : at + len(seg)] = seg
            at += size
        if at != nbytes:
            raise AssertionError(f"message {mid}: packed {at} bytes, nbytes says {nbytes}")
        return bytes(buf)

    def unpack(self, arrays: dict[int, np.ndarray], r: _Rows, lo: int, hi: int, buf: bytes) -> None:
        at = 0
        for i in range(lo, hi):
            src_dtype = arrays[r.src[i]].dtype
            size = self._nbytes(arrays, r, i)
            codec = self._codec(r, i)
            if codec is None:
                n = int(np.prod(r.shape(i), dtype=np.int64))
                data = np.frombuffer(buf, dtype=src_dtype, count=n, offset=at).reshape(r.shape(i))
            else:
                data = codec.decode(buf[at : at + size], r.shape(i), src_dtype)
            _copy(arrays, r, i, data)
            at += size

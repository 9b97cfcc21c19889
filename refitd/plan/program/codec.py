"""Bytes of a SlotProgram: a versioned header plus raw little-endian column buffers.

Layout: preamble (magic "RFTP", u16 format version, u16 reserved, u32 header length, u32
header crc32), a JSON header, then the column buffers, each 8-byte aligned. The header
holds the digest, the slot, the pool names, the row counts and, per column, its dtype, byte
offset and crc32. Integer columns travel as int32 when their values fit, else int64.

decode checks everything a wrong byte could break: preamble, header, each column's
presence, dtype, length and checksum, then index ranges (tensor indices known, copies'
regions inside their tensors, message ranges tiling the copies, wire bytes per message).
Every failure is a ProgramError naming the slot and the field; the consistency checks past
the bytes are checks.check_program's.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import fields

import numpy as np

from refitd.plan.program.checks import check_program, failure
from refitd.plan.program.columns import (
    CopyColumns,
    MessageColumns,
    ProgramError,
    SlotProgram,
    TensorColumns,
)
from refitd.plan.wire import BUILTIN_WIRES, WireRegistry

PROGRAM_FORMAT_VERSION = 3
MAGIC = b"RFTP"
_PREAMBLE = struct.Struct("<4sHHII")  # magic, version, reserved, header length, crc32
_INT = ("|u1", "<u2", "<i4", "<i8")  # integer columns: the narrowest of these that fits
_BYTE = ("|u1",)
_LIMITS = ((1 << 8, "|u1"), (1 << 16, "<u2"), (1 << 31, "<i4"))

_BYTE_COLS = {
    "copies.ndim",
    "copies.wire",
    "copies.src_dtype",
    "copies.dst_dtype",
    "copies.flags",
    "send.path",
    "recv.path",
    "tensors.dtype",
    "tensors.storage",
    "tensors.ndim",
}


def narrow_dtypes(top: np.ndarray) -> np.ndarray:
    """The narrowest integer dtype (of _INT) holding values 0..top, per element of top."""
    out = np.full(top.shape, "<i8", dtype=object)
    for limit, dtype in reversed(_LIMITS):
        out[top < limit] = dtype
    return out


_COLUMN_NAMES = tuple(
    (part, f.name, f"{prefix}.{f.name}")
    for part, prefix, cls in (
        ("copies", "copies", CopyColumns),
        ("send", "send", MessageColumns),
        ("recv", "recv", MessageColumns),
        ("table", "tensors", TensorColumns),
    )
    for f in fields(cls)
    if f.name != "pools"
)  # (SlotProgram attribute, column attribute, encoded name) in encoding order
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"))  # as json.dumps(separators=...)


def _columns(p: SlotProgram) -> list[tuple[str, np.ndarray]]:
    parts = {"copies": p.copies, "send": p.send, "recv": p.recv, "table": p.table}
    return [(name, getattr(parts[part], attr)) for part, attr, name in _COLUMN_NAMES]


def _shapes(c: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Expected shape of every column from the row counts."""
    C, D, T = c["copies"], c["dims"], c["tensors"]
    out = {f"copies.{f.name}": (C,) for f in fields(CopyColumns)}
    out |= {f"copies.{n}": (C, D) for n in ("src_off", "dst_off", "shape")}
    for side in ("send", "recv"):
        out |= {f"{side}.{f.name}": (c[side],) for f in fields(MessageColumns)}
    for f in fields(TensorColumns):
        if f.name != "pools":
            out[f"tensors.{f.name}"] = (T, D) if f.name == "local_shape" else (T,)
    return out


def _narrow(a: np.ndarray, name: str, known: dict[str, str] | None) -> np.ndarray:
    """The column in the narrowest travelling dtype its values fit (all are >= 0)."""
    if name in _BYTE_COLS:
        return np.ascontiguousarray(a, dtype="|u1")
    dtype = known.get(name) if known else None
    if dtype is None:
        dtype = str(narrow_dtypes(np.array([int(a.max()) if a.size else 0]))[0])
    return np.ascontiguousarray(a, dtype=dtype)


def encode_program(p: SlotProgram) -> bytes:
    """Versioned header plus raw little-endian column buffers (see the module docstring)."""
    meta: dict[str, list] = {}
    parts: list = []  # column buffers and the zero padding that 8-byte-aligns the next
    off = 0
    for n, a in _columns(p):
        a = _narrow(a, n, p.wire_dtypes)
        pad = -off % 8
        if pad:
            parts.append(bytes(pad))
            off += pad
        meta[n] = [a.dtype.str, off, zlib.crc32(a)]
        parts.append(a.data)
        off += a.nbytes
    header = {
        "digest": p.digest,
        "slot": p.slot,
        "pools": list(p.table.pools),
        "local_start": p.local_start,
        "counts": {
            "copies": len(p.copies),
            "dims": int(p.copies.shape.shape[1]),
            "send": len(p.send),
            "recv": len(p.recv),
            "tensors": int(p.table.index.size),
        },
        "fields": meta,
    }
    h = _HEADER_JSON.encode(header).encode()
    pre = _PREAMBLE.pack(MAGIC, PROGRAM_FORMAT_VERSION, 0, len(h), zlib.crc32(h))
    return b"".join([pre, h, *parts])


class _Reader:
    """Decoding state: the slot named in errors and the checked columns."""

    def __init__(self, data: bytes, slot: int | None) -> None:
        self.data = memoryview(data)
        self.slot = slot
        self.spans: list[tuple[int, int]] = []  # body bytes the columns cover

    def fail(self, field: str, what: str) -> ProgramError:
        return failure(self.slot)(field, what)

    def header(self) -> dict:
        n = _PREAMBLE.size
        if len(self.data) < n:
            raise self.fail("preamble", f"truncated: {len(self.data)} bytes, need {n}")
        magic, version, reserved, hlen, hcrc = _PREAMBLE.unpack_from(self.data)
        if magic != MAGIC:
            raise self.fail("preamble", f"not a slot program (magic {bytes(magic)!r})")
        if reserved:
            raise self.fail("preamble", f"reserved bytes read {reserved}, written as 0")
        if version != PROGRAM_FORMAT_VERSION:
            raise self.fail(
                "version",
                f"format version {version}, this build reads {PROGRAM_FORMAT_VERSION}",
            )
        if n + hlen > len(self.data):
            raise self.fail("header", f"truncated: {hlen} header bytes announced")
        if zlib.crc32(self.data[n : n + hlen]) != hcrc:
            raise self.fail("header", "checksum mismatch (corrupted in transit or in storage)")
        try:
            h = json.loads(bytes(self.data[n : n + hlen]))
            counts = {k: int(h["counts"][k]) for k in _COUNT_KEYS}
            meta = {k: (str(v[0]), int(v[1]), int(v[2])) for k, v in h["fields"].items()}
            head = (str(h["digest"]), int(h["slot"]), int(h["local_start"]))
            pools = tuple(str(x) for x in h["pools"])
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise self.fail("header", f"malformed ({type(e).__name__}: {e})") from None
        if self.slot is not None and head[1] != self.slot:
            raise self.fail("slot", f"program is for slot {head[1]}")
        self.slot = head[1]
        if min(counts.values()) < 0 or counts["dims"] < 1:
            raise self.fail("counts", f"invalid row counts {counts}")
        self.body = self.data[n + hlen :]
        return {"counts": counts, "meta": meta, "head": head, "pools": pools}

    def padding(self) -> None:
        """Bytes no column covers (alignment padding, written as zeros) must be zero and
        the body must end with the last column: no checksum covers them otherwise."""
        pos = 0
        for lo, hi in sorted(self.spans):
            if lo > pos and any(self.body[pos:lo]):
                raise self.fail("body", f"non-zero padding in bytes [{pos}, {lo})")
            pos = max(pos, hi)
        if len(self.body) != pos:
            raise self.fail("body", f"{len(self.body) - pos} bytes after the last column")

    def column(self, name: str, meta: dict, shape: tuple[int, ...]) -> np.ndarray:
        if name not in meta:
            raise self.fail(name, "missing")
        dtype, off, crc = meta[name]
        allowed = _BYTE if name in _BYTE_COLS else _INT
        if dtype not in allowed:
            raise self.fail(name, f"dtype {dtype!r}, expected one of {allowed}")
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if off < 0 or off + nbytes > len(self.body):
            raise self.fail(
                name,
                f"truncated: needs bytes [{off}, {off + nbytes}) of a {len(self.body)}-byte body",
            )
        raw = self.body[off : off + nbytes]
        self.spans.append((off, off + nbytes))
        if zlib.crc32(raw) != crc:
            raise self.fail(name, "checksum mismatch (corrupted in transit or in storage)")
        a = np.frombuffer(raw, dtype=dtype).reshape(shape)
        return a.astype(np.uint8 if allowed is _BYTE else np.int64)


_COUNT_KEYS = ("copies", "dims", "send", "recv", "tensors")


def decode_program(
    data: bytes, slot: int | None = None, wires: WireRegistry = BUILTIN_WIRES
) -> SlotProgram:
    """Decode and check a program; `slot`: the slot it is meant for (named in errors and
    checked against the header); `wires`: the plan's wire registry (default: the built-in
    one). Raises ProgramError naming slot and field."""
    r = _Reader(data, slot)
    h = r.header()
    shapes = _shapes(h["counts"])
    cols = {name: r.column(name, h["meta"], shape) for name, shape in shapes.items()}
    r.padding()
    digest, slot_, local_start = h["head"]
    pools = h["pools"]

    def group(prefix: str, cls: type) -> object:
        return cls(**{f.name: cols[f"{prefix}.{f.name}"] for f in fields(cls)})

    copies = group("copies", CopyColumns)
    send = group("send", MessageColumns)
    recv = group("recv", MessageColumns)
    table = TensorColumns(
        **{f.name: cols[f"tensors.{f.name}"] for f in fields(TensorColumns) if f.name != "pools"},
        pools=pools,
    )
    p = SlotProgram(digest, slot_, table, copies, send, recv, local_start)  # type: ignore[arg-type]
    check_program(p, r.fail, wires)
    return p

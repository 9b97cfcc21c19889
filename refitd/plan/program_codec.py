"""Bytes of a SlotProgram: a versioned header plus raw little-endian column buffers.

Layout: preamble (magic "RFTP", u16 format version, u16 reserved, u32 header length, u32
header crc32), a JSON header, then the column buffers, each 8-byte aligned. The header
holds the digest, the slot, the pool names, the row counts and, per column, its dtype, byte
offset and crc32. Integer columns travel as int32 when their values fit, else int64.

decode checks everything a wrong byte could break: preamble, header, each column's
presence, dtype, length and checksum, then index ranges (tensor indices known, copies'
regions inside their tensors, message ranges tiling the copies, wire bytes per message).
Every failure is a ProgramError naming the slot and the field.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import fields

import numpy as np

from refitd.plan.program import (
    _BYTE,
    _INT,
    _PREAMBLE,
    DTYPES,
    MAGIC,
    PROGRAM_FORMAT_VERSION,
    STORAGES,
    CopyColumns,
    MessageColumns,
    ProgramError,
    SlotProgram,
    TensorColumns,
    narrow_dtypes,
)
from refitd.plan.wire import BUILTIN_WIRES, DTYPE_SIZES, WireRegistry

_BYTE_COLS = {
    "copies.ndim",
    "copies.wire",
    "copies.src_dtype",
    "copies.dst_dtype",
    "copies.flags",
    "tensors.dtype",
    "tensors.storage",
    "tensors.ndim",
}
_ESIZE = np.array([DTYPE_SIZES[d] for d in DTYPES], np.int64)


def _columns(p: SlotProgram) -> list[tuple[str, np.ndarray]]:
    out: list[tuple[str, np.ndarray]] = []
    for prefix, obj in (("copies", p.copies), ("send", p.send), ("recv", p.recv)):
        out += [(f"{prefix}.{f.name}", getattr(obj, f.name)) for f in fields(obj)]
    t = p.table
    out += [(f"tensors.{f.name}", getattr(t, f.name)) for f in fields(t) if f.name != "pools"]
    return out


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


def encode(p: SlotProgram) -> bytes:
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
    h = json.dumps(header, separators=(",", ":")).encode()
    pre = _PREAMBLE.pack(MAGIC, PROGRAM_FORMAT_VERSION, 0, len(h), zlib.crc32(h))
    return b"".join([pre, h, *parts])


class _Reader:
    """Decoding state: the slot named in errors and the checked columns."""

    def __init__(self, data: bytes, slot: int | None) -> None:
        self.data = memoryview(data)
        self.slot = slot
        self.spans: list[tuple[int, int]] = []  # body bytes the columns cover

    def fail(self, field: str, what: str) -> ProgramError:
        who = "?" if self.slot is None else self.slot
        return ProgramError(f"slot program for slot {who}: field {field!r}: {what}")

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


def decode(
    data: bytes, slot: int | None = None, wires: WireRegistry = BUILTIN_WIRES
) -> SlotProgram:
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
    check(p, r.fail, wires)
    return p


def check(p: SlotProgram, fail=None, wires: WireRegistry = BUILTIN_WIRES) -> None:
    """Consistency of a program's columns (decode runs it; see the module docstring); wire
    codes index `wires` (the registry of the plan that made the program)."""
    if fail is None:

        def fail(field: str, what: str) -> ProgramError:
            return ProgramError(f"slot program for slot {p.slot}: field {field!r}: {what}")

    t, c = p.table, p.copies
    _check_tensors(t, fail)
    _check_ranges(p, fail)
    D = c.shape.shape[1]
    if c.ndim.size and int(c.ndim.max()) > D:
        raise fail("copies.ndim", f"a copy has {int(c.ndim.max())} dims, the program {D}")
    for name, n in (
        ("wire", len(wires.formats)),
        ("src_dtype", len(DTYPES)),
        ("dst_dtype", len(DTYPES)),
    ):
        col = getattr(c, name)
        if col.size and int(col.max()) >= n:
            raise fail(f"copies.{name}", f"unknown code {int(col.max())}")
    if c.flags.size and int(c.flags.max()) >= 8:
        raise fail("copies.flags", f"unknown bits {int(c.flags.max())}")
    if (c.src_off < 0).any() or (c.dst_off < 0).any() or (c.shape < 0).any():
        raise fail("copies.shape", "negative offset or shape")
    send_hi = int(p.send.end[-1]) if len(p.send) else 0
    local = np.arange(p.local_start, len(c))
    # the ends held on this slot: sources it sends or copies, destinations it receives or
    # copies into; they must be in the table, and each region inside its tensor
    own = {"src": np.r_[np.arange(send_hi), local], "dst": np.arange(send_hi, len(c))}
    for end, rows in own.items():
        idx = getattr(c, end)[rows]
        rr = np.minimum(np.searchsorted(t.index, idx), max(t.index.size - 1, 0))
        if idx.size and (not t.index.size or (t.index[rr] != idx).any()):
            bad = int(idx[t.index[rr] != idx][0]) if t.index.size else int(idx[0])
            raise fail(f"copies.{end}", f"tensor {bad} is not in the program's tensor table")
        if (t.ndim[rr] != c.ndim[rows]).any():
            raise fail("copies.ndim", f"a copy's rank differs from its {end} tensor's")
        if (t.dtype[rr] != getattr(c, f"{end}_dtype")[rows]).any():
            raise fail(f"copies.{end}_dtype", f"differs from its {end} tensor's dtype")
        off = getattr(c, f"{end}_off")[rows]
        over = (off + c.shape[rows] > t.local_shape[rr]).any(axis=1)
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise fail(
                f"copies.{end}_off",
                f"copy {int(rows[i])} reaches outside tensor {int(idx[i])} "
                f"(offset {off[i].tolist()}, shape {c.shape[rows[i]].tolist()}, "
                f"local shape {t.local_shape[rr[i]].tolist()})",
            )
    _check_nbytes(p, fail, wires)


def _check_tensors(t: TensorColumns, fail) -> None:
    if t.index.size > 1 and (np.diff(t.index) <= 0).any():
        raise fail("tensors.index", "not strictly increasing")
    if t.index.size and int(t.index.min()) < 0:
        raise fail("tensors.index", "negative tensor index")
    for name, n in (("dtype", len(DTYPES)), ("storage", len(STORAGES)), ("pool", len(t.pools))):
        col = getattr(t, name)
        if col.size and (int(col.min()) < 0 or int(col.max()) >= n):
            raise fail(f"tensors.{name}", f"code out of range [0, {n})")
    D = t.local_shape.shape[1]
    if t.ndim.size and int(t.ndim.max()) > D:
        raise fail("tensors.ndim", f"more dims than the program's {D}")
    if (t.local_shape < 0).any():
        raise fail("tensors.local_shape", "negative size")


def _check_ranges(p: SlotProgram, fail) -> None:
    """Message copy ranges tile the copies in order; ends, rounds and order are sane."""
    pos = 0
    for side, m in (("send", p.send), ("recv", p.recv)):
        if len(m) and not (
            int(m.start[0]) == pos
            and (m.start[1:] == m.end[:-1]).all()
            and (m.end >= m.start).all()
        ):
            raise fail(f"{side}.start", "message copy ranges do not tile the copies in order")
        pos = int(m.end[-1]) if len(m) else pos
        mine = m.src_slot if side == "send" else m.dst_slot
        if (mine != p.slot).any():
            raise fail(f"{side}.{'src' if side == 'send' else 'dst'}_slot", "not this slot")
        if len(m) > 1:
            key_ok = (np.diff(m.round) > 0) | ((np.diff(m.round) == 0) & (np.diff(m.id) > 0))
            if not key_ok.all():
                raise fail(f"{side}.id", "messages not ordered by (round, id)")
    if p.local_start != pos or pos > len(p.copies):
        raise fail("local_start", f"{p.local_start}, copies of messages end at {pos}")


def _check_nbytes(p: SlotProgram, fail, wires: WireRegistry) -> None:
    """Each message's wire bytes are its copies' segments."""
    c = p.copies
    esize = _ESIZE[c.src_dtype.astype(np.int64)]
    nb = wires.segment_nbytes(c.wire, c.shape, c.ndim.astype(np.int64), esize)
    csum = np.r_[0, np.cumsum(nb)]
    for side, m in (("send", p.send), ("recv", p.recv)):
        want = csum[m.end] - csum[m.start]
        if (want != m.nbytes).any():
            k = int(np.flatnonzero(want != m.nbytes)[0])
            raise fail(
                f"{side}.nbytes",
                f"message {int(m.id[k])}: copies need {int(want[k])} wire bytes, "
                f"the program says {int(m.nbytes[k])}",
            )

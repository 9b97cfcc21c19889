"""What one device slot executes for one refit: the contract between planner and executor.

The planner builds a whole-cluster plan once per (model, membership epoch, layouts); the
controller ships to each transfer process the SlotProgram of its slot, and the executor
replays it every refit. A SlotProgram is columns (NumPy arrays), sliced from the plan's own
columns: no per-copy Python object is made to build, ship or run it.

- copies (C rows): source / destination plan tensor index, offsets and shape (local
  coordinates of the registered tensors, see layout.Box; padded with 0 / 1 past `ndim`),
  wire format code (WIRES), source and destination dtype codes (DTYPES) and FLAG_* bits
  (what the two ends need to agree on chunking without the other end's tensors). Rows are
  the send messages' copies in message order, then the receive messages' copies, then the
  local copies (`local_start`..C).
- send / recv messages (M rows each): id, round, source and destination slot, the range
  [start, end) of their copies, and wire bytes. Ordered by (round, id).
- tensors (T rows, sorted by plan index): every tensor held on this slot (copies or not),
  with its rank, pool, dtype, storage, local shape. Tensors of other slots appear only as
  indices in copies. Names do not travel: an agent has them with the memory handles.

Message k of a slot is packed from its copies' source regions in order, each as a wire
segment (wire.segment_parts) starting SEGMENT_ALIGN-aligned, and unpacked in the same order
into the destination regions. Messages carry a round: in round r each slot sends at most one
message to any peer and the executor may overlap round r+1 with round r.

Relays (plans built with PlanConfig.relay): a copy whose src is a destination tensor
forwards a region this slot received earlier. Its message's round is greater than the
rounds that delivered that region: before packing it, the slot completes all its receives
of smaller rounds; local copies reading a destination tensor run after all receives.

Encoding (`to_bytes`): magic, format version, a small JSON header (digest, slot, pools and
one entry per column: dtype, shape, offset, crc32), then the raw little-endian column
buffers. `from_bytes` checks all of it (lengths, dtypes, checksums, index ranges, regions
inside their tensors) and raises ProgramError naming the slot and the field.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from refitd.plan.layout import TensorSpec
from refitd.plan.wire import (
    BUILTIN_WIRES,
    DTYPE_SIZES,
    FP8_BLOCK,
    MXFP8,
    PLAIN,
    RAW,
    WIRE_FORMATS,
    WireRegistry,
    segment_nbytes,
)

PROGRAM_FORMAT_VERSION = 2
MAGIC = b"RFTP"
_PREAMBLE = struct.Struct("<4sHHII")  # magic, version, reserved, header length, crc32
WIRES = WIRE_FORMATS  # wire code -> name (raw, mxfp8, fp8_block)
STORAGES = (PLAIN, MXFP8, FP8_BLOCK)
DTYPES = tuple(DTYPE_SIZES)  # dtype code -> name
_INT = ("|u1", "<u2", "<i4", "<i8")  # integer columns: the narrowest of these that fits
_BYTE = ("|u1",)
FLAG_LANDS_DIRECT = 1  # raw wire into a plain destination of the source dtype, one run
FLAG_SRC_CONTIGUOUS = 2  # the source block is one run of its tensor
FLAG_DST_PLAIN = 4  # the destination keeps plain storage


class ProgramError(ValueError):
    """A slot program that cannot be decoded or is inconsistent: names slot and field."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One block copied from a source tensor region to a destination tensor region (an
    object view of one copy row, for tools and tests; the executor reads columns)."""

    src_tensor: int
    src_offset: tuple[int, ...]
    dst_tensor: int
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    wire: str = RAW


@dataclass(frozen=True, slots=True)
class Message:
    """Copies from one source slot to one destination slot, sent as one buffer (object view)."""

    id: int
    round: int
    src_slot: int
    dst_slot: int
    copies: tuple[Copy, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ProgramTensor:
    """What a program knows of one tensor it touches. Names do not travel: an agent gets
    the names of its own tensors with their memory handles."""

    pool: str
    rank: int
    slot: int
    dtype: str
    storage: str
    local_shape: tuple[int, ...]


def _eq_arrays(a: object, b: object) -> bool:
    for f in fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@dataclass(eq=False, slots=True)
class CopyColumns:
    src: np.ndarray  # [C] int64 plan tensor index
    dst: np.ndarray  # [C] int64
    src_off: np.ndarray  # [C, D] int64
    dst_off: np.ndarray  # [C, D] int64
    shape: np.ndarray  # [C, D] int64 (1 past ndim)
    ndim: np.ndarray  # [C] uint8
    wire: np.ndarray  # [C] uint8 code into WIRES
    src_dtype: np.ndarray  # [C] uint8 code into DTYPES
    dst_dtype: np.ndarray  # [C] uint8
    flags: np.ndarray  # [C] uint8 FLAG_* bits

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CopyColumns) and _eq_arrays(self, other)

    def __len__(self) -> int:
        return int(self.src.size)


@dataclass(eq=False, slots=True)
class MessageColumns:
    id: np.ndarray  # [M] int64
    round: np.ndarray
    src_slot: np.ndarray
    dst_slot: np.ndarray
    start: np.ndarray  # first copy row
    end: np.ndarray
    nbytes: np.ndarray

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessageColumns) and _eq_arrays(self, other)

    def __len__(self) -> int:
        return int(self.id.size)


@dataclass(eq=False, slots=True)
class TensorColumns:
    index: np.ndarray  # [T] int64, ascending
    slot: np.ndarray
    rank: np.ndarray
    pool: np.ndarray  # id into `pools`
    dtype: np.ndarray  # uint8 code into DTYPES
    storage: np.ndarray  # uint8 code into STORAGES
    ndim: np.ndarray  # uint8
    local_shape: np.ndarray  # [T, D] int64 (1 past ndim)
    pools: tuple[str, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorColumns) and _eq_arrays(self, other)

    def row(self, index: int) -> int:
        """Row of a plan tensor index, -1 if absent."""
        r = int(np.searchsorted(self.index, index))
        return r if r < self.index.size and int(self.index[r]) == index else -1

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows of plan tensor indices that are all present."""
        return np.searchsorted(self.index, indices)

    def get(self, r: int) -> ProgramTensor:
        nd = int(self.ndim[r])
        return ProgramTensor(
            pool=self.pools[int(self.pool[r])],
            rank=int(self.rank[r]),
            slot=int(self.slot[r]),
            dtype=DTYPES[int(self.dtype[r])],
            storage=STORAGES[int(self.storage[r])],
            local_shape=tuple(self.local_shape[r, :nd].tolist()),
        )


class TensorView(Mapping[int, ProgramTensor]):
    """program.tensors: plan index -> ProgramTensor, made on access."""

    def __init__(self, cols: TensorColumns) -> None:
        self._cols = cols

    def __getitem__(self, index: int) -> ProgramTensor:
        r = self._cols.row(int(index))
        if r < 0:
            raise KeyError(index)
        return self._cols.get(r)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and self._cols.row(int(index)) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._cols.index.tolist())

    def __len__(self) -> int:
        return int(self._cols.index.size)


@dataclass(eq=False)
class SlotProgram:
    """Everything one transfer process needs for one refit of one plan, as columns."""

    digest: str
    slot: int
    table: TensorColumns
    copies: CopyColumns
    send: MessageColumns
    recv: MessageColumns
    local_start: int
    # travelling dtype per integer column, set by the builder for the columns as built
    # (saves a maximum per column when encoding); whoever changes a column clears it
    wire_dtypes: dict[str, str] | None = field(default=None, repr=False)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SlotProgram)
            and (self.digest, self.slot, self.local_start)
            == (other.digest, other.slot, other.local_start)
            and self.table == other.table
            and self.copies == other.copies
            and self.send == other.send
            and self.recv == other.recv
        )

    # -------------------------------------------------------------- object views (tools)
    @property
    def tensors(self) -> TensorView:
        return TensorView(self.table)

    def copy_objects(self, lo: int, hi: int) -> tuple[Copy, ...]:
        c = self.copies
        out = []
        for i in range(lo, hi):
            nd = int(c.ndim[i])
            out.append(
                Copy(
                    int(c.src[i]),
                    tuple(c.src_off[i, :nd].tolist()),
                    int(c.dst[i]),
                    tuple(c.dst_off[i, :nd].tolist()),
                    tuple(c.shape[i, :nd].tolist()),
                    WIRES[int(c.wire[i])],
                )
            )
        return tuple(out)

    def _messages(self, m: MessageColumns) -> tuple[Message, ...]:
        return tuple(
            Message(
                int(m.id[k]),
                int(m.round[k]),
                int(m.src_slot[k]),
                int(m.dst_slot[k]),
                self.copy_objects(int(m.start[k]), int(m.end[k])),
                int(m.nbytes[k]),
            )
            for k in range(len(m))
        )

    @property
    def sends(self) -> tuple[Message, ...]:
        return self._messages(self.send)

    @property
    def recvs(self) -> tuple[Message, ...]:
        return self._messages(self.recv)

    @property
    def local(self) -> tuple[Copy, ...]:
        return self.copy_objects(self.local_start, len(self.copies))

    @classmethod
    def from_objects(
        cls,
        digest: str,
        slot: int,
        tensors: Mapping[int, TensorSpec | ProgramTensor],
        sends: tuple[Message, ...],
        recvs: tuple[Message, ...],
        local: tuple[Copy, ...],
    ) -> SlotProgram:
        """A program from object form (hand-written programs in tests and checks)."""
        copies = [c for m in sends for c in m.copies]
        copies += [c for m in recvs for c in m.copies]
        copies += list(local)
        d = max([len(c.shape) for c in copies] + [len(t.local_shape) for t in tensors.values()])
        cols = _Columns(max(d, 1))
        send = cols.messages(sends, 0)
        recv = cols.messages(recvs, sum(len(m.copies) for m in sends))
        cc = cols.copies(copies, tensors)
        prog = cls(
            digest, slot, cols.tensors(tensors, slot), cc, send, recv, len(copies) - len(local)
        )
        from refitd.plan.program_codec import check

        check(prog)
        return prog

    # -------------------------------------------------------------- wire encoding
    def to_bytes(self) -> bytes:
        """Versioned header plus raw little-endian column buffers (see module docstring)."""
        from refitd.plan.program_codec import encode

        return encode(self)

    @classmethod
    def from_bytes(
        cls, data: bytes, slot: int | None = None, wires: WireRegistry | None = None
    ) -> SlotProgram:
        """Decode and check a program; `slot`: the slot it is meant for (named in errors
        and checked against the header); `wires`: the plan's wire registry (default: the
        built-in one). Raises ProgramError naming slot and field."""
        from refitd.plan.program_codec import decode

        return decode(data, slot, wires or BUILTIN_WIRES)


_LIMITS = ((1 << 8, "|u1"), (1 << 16, "<u2"), (1 << 31, "<i4"))


def narrow_dtypes(top: np.ndarray) -> np.ndarray:
    """The narrowest integer dtype (of _INT) holding values 0..top, per element of top."""
    out = np.full(top.shape, "<i8", dtype=object)
    for limit, dtype in reversed(_LIMITS):
        out[top < limit] = dtype
    return out


def contiguous_blocks(shape: np.ndarray, full: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Per row: a block of `shape` in a row-major tensor of shape `full` is one run
    (after its leading dims of size 1, every dim is whole)."""
    one_run = np.ones(shape.shape[0], dtype=bool)
    past_first = np.zeros(shape.shape[0], dtype=bool)  # a live dim of size > 1 came before
    for k in range(shape.shape[1]):  # column by column: few dims, many rows
        live = ndim > k
        one_run &= ~(past_first & live & (shape[:, k] != full[:, k]))
        past_first |= live & (shape[:, k] != 1)
    return one_run


def copy_flags(
    wire: np.ndarray,
    src_dtype: np.ndarray,
    dst_dtype: np.ndarray,
    dst_plain: np.ndarray,
    shape: np.ndarray,
    src_full: np.ndarray,
    dst_full: np.ndarray,
    ndim: np.ndarray,
) -> np.ndarray:
    """FLAG_* bits of every copy (shapes padded with 1s past ndim)."""
    nd = ndim.astype(np.int64)
    lands = (wire == 0) & dst_plain & (dst_dtype == src_dtype)
    lands &= contiguous_blocks(shape, dst_full, nd)
    flags = np.where(lands, FLAG_LANDS_DIRECT, 0)
    flags |= np.where(contiguous_blocks(shape, src_full, nd), FLAG_SRC_CONTIGUOUS, 0)
    flags |= np.where(dst_plain, FLAG_DST_PLAIN, 0)
    return flags.astype(np.uint8)


def message_nbytes(copies: tuple[Copy, ...], tensors: Mapping[int, object]) -> int:
    """Wire size of a message made of these copies (source dtypes from the tensors)."""
    return sum(
        segment_nbytes(c.wire, c.shape, tensors[c.src_tensor].dtype)  # type: ignore[attr-defined]
        for c in copies
    )


@dataclass(frozen=True, slots=True)
class _Columns:
    """Object-form program parts as columns, shapes padded to d dims (from_objects)."""

    d: int

    def pad(self, t: tuple[int, ...], fill: int) -> list[int]:
        return list(t) + [fill] * (self.d - len(t))

    @staticmethod
    def arr(rows: list, dtype: type = np.int64) -> np.ndarray:
        return np.array(rows, dtype=dtype).reshape(-1)

    def mat(self, rows: list[list[int]]) -> np.ndarray:
        return np.array(rows, dtype=np.int64).reshape(len(rows), self.d)

    def copies(
        self, copies: list[Copy], tensors: Mapping[int, TensorSpec | ProgramTensor]
    ) -> CopyColumns:
        arr, mat, pad, spec = self.arr, self.mat, self.pad, tensors.__getitem__
        src_dt = arr([DTYPES.index(spec(c.src_tensor).dtype) for c in copies], np.uint8)
        dst_dt = arr([DTYPES.index(spec(c.dst_tensor).dtype) for c in copies], np.uint8)
        shape = mat([pad(c.shape, 1) for c in copies])
        ndim = arr([len(c.shape) for c in copies], np.uint8)
        wire = arr([WIRES.index(c.wire) for c in copies], np.uint8)
        return CopyColumns(
            src=arr([c.src_tensor for c in copies]),
            dst=arr([c.dst_tensor for c in copies]),
            src_off=mat([pad(c.src_offset, 0) for c in copies]),
            dst_off=mat([pad(c.dst_offset, 0) for c in copies]),
            shape=shape,
            ndim=ndim,
            wire=wire,
            src_dtype=src_dt,
            dst_dtype=dst_dt,
            flags=copy_flags(
                wire,
                src_dt,
                dst_dt,
                arr([spec(c.dst_tensor).storage == PLAIN for c in copies], bool),
                shape,
                mat([pad(tuple(spec(c.src_tensor).local_shape), 1) for c in copies]),
                mat([pad(tuple(spec(c.dst_tensor).local_shape), 1) for c in copies]),
                ndim,
            ),
        )

    def messages(self, ms: tuple[Message, ...], first: int) -> MessageColumns:
        """Messages whose copies follow each other from copy row `first`."""
        ends = (first + np.cumsum([len(m.copies) for m in ms], dtype=np.int64)).tolist()
        starts = [first, *ends[:-1]] if ms else []
        arr = self.arr
        return MessageColumns(
            id=arr([m.id for m in ms]),
            round=arr([m.round for m in ms]),
            src_slot=arr([m.src_slot for m in ms]),
            dst_slot=arr([m.dst_slot for m in ms]),
            start=arr(starts),
            end=arr(ends),
            nbytes=arr([m.nbytes for m in ms]),
        )

    def tensors(
        self, tensors: Mapping[int, TensorSpec | ProgramTensor], slot: int
    ) -> TensorColumns:
        arr = self.arr
        idx = sorted(i for i, t in tensors.items() if t.slot == slot)
        specs = [tensors[i] for i in idx]
        pools = tuple(sorted({s.pool for s in specs}))
        return TensorColumns(
            index=arr(idx),
            slot=arr([s.slot for s in specs]),
            rank=arr([s.rank for s in specs]),
            pool=arr([pools.index(s.pool) for s in specs]),
            dtype=arr([DTYPES.index(s.dtype) for s in specs], np.uint8),
            storage=arr([STORAGES.index(s.storage) for s in specs], np.uint8),
            ndim=arr([len(s.local_shape) for s in specs], np.uint8),
            local_shape=self.mat([self.pad(tuple(s.local_shape), 1) for s in specs]),
            pools=pools,
        )


__all__ = [
    "DTYPES",
    "STORAGES",
    "WIRES",
    "Copy",
    "CopyColumns",
    "Message",
    "MessageColumns",
    "ProgramError",
    "ProgramTensor",
    "SlotProgram",
    "TensorColumns",
]
